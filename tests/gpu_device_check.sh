#!/bin/bash
# One device check for mpddp's GPU query, `mpddp info`, and fork safety after it.
# Run from the repo root on a GPU machine with OUT set to a folder: OUT=/tmp/out bash tests/gpu_device_check.sh
export PYTHONUNBUFFERED=1
PY=python3
Q="--query-gpu=index,name,uuid,memory.total,memory.used,utilization.gpu"
A="--query-compute-apps=gpu_uuid,pid,used_memory,process_name"
F="--format=csv,noheader,nounits"
$PY -c "import torch, pynvml; print('torch', torch.__version__, 'pynvml', getattr(pynvml, '__version__', '?'))"
nvidia-smi $Q $F > $OUT/smi_1xh200_idle_query_gpu.csv; echo "query rc=$?"
nvidia-smi $A $F > $OUT/smi_1xh200_idle_compute_apps.csv; echo "apps rc=$?"
cat $OUT/smi_1xh200_idle_*.csv
echo "== info idle"; time $PY -m mpddp info 2>&1 | tee $OUT/info_idle.txt
echo "== nvml vs smi"; $PY -c "
from mpddp.machine import gpus
print('default', gpus.query_gpus())
print('smi    ', gpus._query_smi())
print('visible', gpus.visible_gpu_ids({'CUDA_VISIBLE_DEVICES': ''}), gpus.visible_gpu_ids())"
rm -f /tmp/ready
$PY -c "
import torch, time
x = torch.empty(80 * 2**30, dtype=torch.uint8, device='cuda'); torch.cuda.synchronize()
open('/tmp/ready', 'w').close(); time.sleep(90)" &
BUSY=$!
for i in $(seq 120); do [ -f /tmp/ready ] && break; sleep 0.5; done
nvidia-smi $Q $F > $OUT/smi_1xh200_busy_query_gpu.csv
nvidia-smi $A $F > $OUT/smi_1xh200_busy_compute_apps.csv
cat $OUT/smi_1xh200_busy_*.csv
echo "== info busy"; $PY -m mpddp info 2>&1 | tee $OUT/info_busy.txt
echo "== info --gpus free (busy)"; $PY -m mpddp info --gpus free 2>&1 | tail -3; echo "rc=${PIPESTATUS[0]}"
$PY -c "
from mpddp.machine import gpus
q = gpus.query_gpus(); print(q); print(gpus.busy_warnings((0,), q))
print('smi', gpus._query_smi())"
kill $BUSY; wait $BUSY 2>/dev/null
cp $OUT/smi_1xh200_* tests/data/
echo "== pytest"
$PY -m pytest -q -p no:cacheprovider -n 0 tests/test_gpus.py tests/test_info.py -rs 2>&1 | tee $OUT/pytest.txt | tail -15
echo "== control: is_available() then fork"
$PY -c "
import torch, multiprocessing as mp, sys
torch.cuda.is_available()
def child(): print('child', torch.ones(1, device='cuda').item())
p = mp.get_context('fork').Process(target=child); p.start(); p.join(60); print('exitcode', p.exitcode)" 2>&1 | tail -3
