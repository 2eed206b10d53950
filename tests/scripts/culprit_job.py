"""A torchrun-style script whose one rank goes wrong, for tests/test_culprit_elsewhere.py.

``culprit_job.py FAULTS RANKS AT STEPS``: every rank all-reduces a one-element tensor every 50 ms for
STEPS steps; at step AT rank RANK instead:

* ``stop``: stops itself (SIGSTOP), forever;
* ``skip``: skips that step's all_reduce (it ends one collective early, while its peers wait for it);
* ``broadcast``: calls broadcast where its peers call all_reduce;
* ``short``: ends its loop there (exit 0) while its peers go on.

FAULTS and RANKS are comma-separated lists, one entry a round: a job restarted after each fault
(``--max-restarts``) goes wrong in round R (TORCHELASTIC_RESTART_COUNT) the way entry R says.
"""

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
fault, culprit = sys.argv[1].split(",")[restart], int(sys.argv[2].split(",")[restart])
at, steps = int(sys.argv[3]), int(sys.argv[4])
dist.init_process_group("gloo")
rank = dist.get_rank()
print(f"READY rank {rank}", flush=True)
for step in range(steps):
    if rank == culprit and step == at:
        if fault == "stop":
            print(f"FAULT_AT {time.monotonic()}", flush=True)  # the machine's clock: the test measures from here
            os.kill(os.getpid(), signal.SIGSTOP)
        elif fault == "skip":
            continue
        elif fault == "broadcast":
            dist.broadcast(torch.ones(1), 0)
            continue
        elif fault == "short":
            break
    dist.all_reduce(torch.ones(1))
    time.sleep(0.05)
dist.destroy_process_group()
