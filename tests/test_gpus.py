"""GPU query and choice, fed with recorded nvidia-smi answers; the threads rule; the banner."""

from __future__ import annotations

import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from mpddp.context import WorkerContext
from mpddp.errors import ConfigError
from mpddp.machine import gpus
from mpddp.machine.cores import threads_per_rank
from mpddp.machine.gpus import GpuQuery, busy_warnings, parse_visible_devices, resolve_gpus
from mpddp.rank_math import RankSlot, banner

DATA = Path(__file__).parent / "data"


def recorded(name: str, cvd: str | None = None) -> GpuQuery:
    """A query as query_gpus() builds it, from recorded nvidia-smi answers."""
    found = gpus.parse_query_gpu((DATA / f"smi_{name}_query_gpu.csv").read_text())
    apps = gpus.parse_compute_apps((DATA / f"smi_{name}_compute_apps.csv").read_text())
    return gpus._apply_visible(GpuQuery(gpus.with_processes(found, apps), source="nvidia-smi"), cvd)


NODE = recorded("8xh100")  # free: 0, 3; used, not busy: 4; busy: 1, 2, 5, 6, 7


# --- parsing ---------------------------------------------------------------------------------------------------

def test_parse_8_gpu_node() -> None:
    assert [g.index for g in NODE.gpus] == list(range(8))
    one = NODE.gpus[1]
    assert (one.name, one.memory_total_mib, one.memory_used_mib, one.utilization) == (
        "NVIDIA H100 80GB HBM3", 81559, 71234, 97)
    assert one.processes == (gpus.GpuProcess(4242, 71222, "python3"),)
    assert NODE.gpus[7].utilization is None  # "[N/A]"
    assert NODE.gpus[5].processes[0].name == "vllm, serve"  # a comma inside the name
    assert NODE.gpus[6].processes[0].used_mib is None
    assert [g.index for g in NODE.gpus if g.is_free] == [0, 3]
    assert [g.index for g in NODE.gpus if g.is_busy] == [1, 2, 5, 6, 7]


def test_parse_h200_recorded_on_the_gpu_machine() -> None:
    idle = recorded("1xh200_idle")
    assert len(idle.gpus) == 1 and idle.gpus[0].name == "NVIDIA H200" and idle.gpus[0].is_free
    busy = recorded("1xh200_busy")
    assert busy.gpus[0].is_busy and busy.gpus[0].processes


def test_parse_driver_error_raises() -> None:
    with pytest.raises(ValueError, match="couldn't communicate with the NVIDIA driver"):
        gpus.parse_query_gpu((DATA / "smi_no_driver.txt").read_text())
    assert gpus.parse_compute_apps("No running processes found\n") == {}


def fake_run(answers: dict[str, tuple[int, str]]):  # type: ignore[no-untyped-def]
    def run(argv: list[str], **kwargs: object) -> SimpleNamespace:
        code, text = answers[argv[1].split("=")[0]]
        return SimpleNamespace(returncode=code, stdout=text, stderr="")
    return run


def test_query_smi_with_recorded_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(subprocess, "run", fake_run({
        "--query-gpu": (0, (DATA / "smi_8xh100_query_gpu.csv").read_text()),
        "--query-compute-apps": (0, (DATA / "smi_8xh100_compute_apps.csv").read_text()),
    }))
    monkeypatch.setattr(gpus, "_import_pynvml", lambda: None)  # as where pynvml is not installed
    query = gpus.query_gpus({"CUDA_VISIBLE_DEVICES": "3,1"})
    assert query.visible == (3, 1) and query.gpus == NODE.gpus and query.problem is None


def test_query_smi_failures(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(subprocess, "run", fake_run({"--query-gpu": (9, (DATA / "smi_no_driver.txt").read_text())}))
    assert gpus._query_smi().problem == (
        "nvidia-smi failed: NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
        "Make sure that the latest NVIDIA driver is installed and running."
    )

    def missing(*args: object, **kwargs: object) -> None:
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(subprocess, "run", missing)
    assert gpus._query_smi() == GpuQuery(source="nvidia-smi", problem="nvidia-smi not found")

    def slow(*args: object, **kwargs: object) -> None:
        raise subprocess.TimeoutExpired("nvidia-smi", gpus.SMI_TIMEOUT)

    monkeypatch.setattr(subprocess, "run", slow)
    assert gpus._query_smi().problem == "nvidia-smi did not answer within 15 s"


class FakeNvml:
    """The parts of pynvml that query_gpus uses, answering like two GPUs."""

    class NVMLError(Exception):
        pass

    def __init__(self, fail_init: bool = False) -> None:
        self.fail_init, self.shut = fail_init, False

    def nvmlInit(self) -> None:
        if self.fail_init:
            raise self.NVMLError("Driver Not Loaded")

    def nvmlShutdown(self) -> None:
        self.shut = True

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, h: int) -> bytes:
        return b"NVIDIA H200"

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return f"GPU-{h}abc"

    def nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(total=143771 * 2**20, used=(81920 if h else 0) * 2**20)

    def nvmlDeviceGetUtilizationRates(self, h: int) -> SimpleNamespace:
        if h:
            raise self.NVMLError("Not Supported")
        return SimpleNamespace(gpu=7)

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[SimpleNamespace]:
        return [SimpleNamespace(pid=31, usedGpuMemory=81900 * 2**20),
                SimpleNamespace(pid=32, usedGpuMemory=None)] if h else []

    def nvmlSystemGetProcessName(self, pid: int) -> bytes:
        if pid == 32:
            raise self.NVMLError("Not Found")
        return b"/opt/bin/python3"


def test_query_nvml() -> None:
    nvml = FakeNvml()
    query = gpus.query_gpus({"CUDA_VISIBLE_DEVICES": "GPU-1a"}, nvml=nvml)
    assert query.source == "nvml" and query.visible == (1,) and nvml.shut
    zero, one = query.gpus
    assert (zero.name, zero.memory_total_mib, zero.memory_used_mib, zero.utilization) == ("NVIDIA H200", 143771, 0, 7)
    assert one.utilization is None
    assert one.processes == (gpus.GpuProcess(31, 81900, "python3"), gpus.GpuProcess(32, None, "?"))


def test_query_falls_back_to_smi_when_nvml_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(*args: object, **kwargs: object) -> None:
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(subprocess, "run", missing)
    query = gpus.query_gpus({}, nvml=FakeNvml(fail_init=True))
    assert query == GpuQuery(source="nvidia-smi", problem="nvidia-smi not found")


# --- CUDA_VISIBLE_DEVICES ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, visible", [
    (None, (0, 1, 2, 3, 4, 5, 6, 7)),
    ("", ()),
    ("-1", ()),
    ("3", (3,)),
    ("3,1", (3, 1)),  # CUDA's order, not sorted
    (" 2 , 0 ", (2, 0)),
    ("0,9,1", (0,)),  # CUDA stops at the first id that names no GPU
    ("0,-1,1", (0,)),
    ("1,1", (1,)),
    ("GPU-0a1b2c3d-5555-4e5f-8a9b-555555555555", (5,)),
    ("GPU-0a1b2c3d-6666,4", (6, 4)),  # a unique UUID prefix is enough
    ("0a1b2c3d-7777-4e5f-8a9b-777777777777", (7,)),  # CUDA also takes it without "GPU-"
    ("GPU-0a1b2c3d", ()),  # ambiguous prefix
])
def test_cuda_visible_devices(value: str | None, visible: tuple[int, ...]) -> None:
    assert parse_visible_devices(value, NODE.gpus) == visible


def test_all_hidden_says_why() -> None:
    assert recorded("8xh100", "").problem == "CUDA_VISIBLE_DEVICES='' hides all 8"


# --- resolve_gpus -------------------------------------------------------------------------------------------------

def test_resolve_default_takes_visible_gpus() -> None:
    assert resolve_gpus(None, None, NODE) == (0, 1, 2, 3, 4, 5, 6, 7)
    assert resolve_gpus(None, 2, NODE) == (0, 1)
    assert resolve_gpus(None, None, recorded("8xh100", "5,2")) == (5, 2)
    assert resolve_gpus(None, None, GpuQuery(problem="nvidia-smi not found")) is None
    assert resolve_gpus(None, 4, recorded("8xh100", "")) is None


def test_resolve_explicit_ids() -> None:
    assert resolve_gpus((0, 3), None, NODE) == (0, 3)
    assert resolve_gpus((3, 0), 1, NODE) == (3,)


def test_resolve_unknown_id() -> None:
    with pytest.raises(ConfigError, match=r"^gpus=0,9 names GPU 9, which does not exist: this machine's GPUs are "
                                          r"0, 1, 2, 3, 4, 5, 6, 7; see `mpddp info` for the GPUs here$"):
        resolve_gpus((0, 9), None, NODE)
    with pytest.raises(ConfigError, match=r"^gpus=0 names GPU 0, which CUDA_VISIBLE_DEVICES hides: use one of the "
                                          r"visible GPUs 2, 3; see `mpddp info`"):
        resolve_gpus((0,), None, recorded("8xh100", "2,3"))


def test_resolve_ids_without_gpus() -> None:
    with pytest.raises(ConfigError, match=r"^gpus=0,3 but this machine has no visible NVIDIA GPU \(nvidia-smi not "
                                          r"found\); drop --gpus to train on the CPU with gloo$"):
        resolve_gpus((0, 3), None, GpuQuery(problem="nvidia-smi not found"))
    with pytest.raises(ConfigError, match=r"gpus=free but .* \(CUDA_VISIBLE_DEVICES='-1' hides all 8\)"):
        resolve_gpus("free", None, recorded("8xh100", "-1"))


def test_resolve_free() -> None:
    assert resolve_gpus("free", None, NODE) == (0, 3)
    assert resolve_gpus("free", 1, NODE) == (0,)
    assert resolve_gpus("free:2", None, NODE) == (0, 3)
    assert resolve_gpus("free:1", None, NODE) == (0,)
    assert resolve_gpus("free", None, recorded("8xh100", "3,2,0")) == (3, 0)  # in CUDA_VISIBLE_DEVICES order


def test_resolve_free_not_enough() -> None:
    with pytest.raises(ConfigError) as caught:
        resolve_gpus("free:3", None, NODE)
    message = str(caught.value)
    assert message.startswith("gpus=free:3 asks for 3 free GPUs but only 2 of 8 are free (not free: GPU 1: 71234 MiB "
                              "used, pid 4242 (python3, 71222 MiB); GPU 2: ")
    assert "GPU 7: 45012 MiB used, no process listed" in message
    assert message.endswith("wait for them, pass --gpus free:2, or name GPUs such as --gpus 0,1 to share them")
    with pytest.raises(ConfigError,
                       match=r"^gpus=free asks for 1 free GPU but none of the 2 is free \(not free: GPU 1: "):
        resolve_gpus("free", None, recorded("8xh100", "1,5"))


# --- busy warnings ------------------------------------------------------------------------------------------------

def test_busy_warnings() -> None:
    assert busy_warnings((0, 3, 4), NODE) == []  # GPU 4 holds 2 GiB, no process: not worth a warning
    assert busy_warnings(None, NODE) == []
    lines = busy_warnings((0, 2, 7), NODE)
    assert lines == [
        "mpddp: warning: GPU 2 (NVIDIA H100 80GB HBM3) is in use: 40533 of 81559 MiB taken, pid 5151 (python, "
        "20260 MiB), pid 5152 (python, 20260 MiB); this launch may run out of GPU memory (pick idle GPUs with "
        "--gpus free, see `mpddp info`)",
        "mpddp: warning: GPU 7 (NVIDIA H100 80GB HBM3) is in use: 45012 of 81559 MiB taken, no process listed; "
        "this launch may run out of GPU memory (pick idle GPUs with --gpus free, see `mpddp info`)",
    ]
    assert "pid 9001 (jupyter-lab)" in busy_warnings((6,), NODE)[0]  # any compute process counts


def test_child_cuda_env() -> None:
    assert gpus.child_cuda_env((1, 3)) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "1,3"}


# --- threads and banner -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("ranks, cores, omp, threads", [
    (1, 2, None, 2),
    (2, 2, None, 1),
    (4, 2, None, 1),  # at least 1
    (3, 16, None, 5),
    (8, 64, None, 8),
    (2, None, None, 1),  # psutil could not count
    (2, 16, "3", 3),  # the user's OMP_NUM_THREADS wins
    (2, 16, "4,2", 4),  # nested OpenMP: the first level
    (2, 16, "", 8),
    (2, 16, "0", 8),  # not a usable count: the rule
    (2, 16, "many", 8),
])
def test_threads_per_rank(ranks: int, cores: int | None, omp: str | None, threads: int) -> None:
    assert threads_per_rank(ranks, cores, omp) == threads


def test_banner_gpu_and_cpu() -> None:
    ctx = WorkerContext(rank=5, local_rank=1, node_rank=1, world_size=8, nprocs_per_node=4, nnodes=2,
                        device="cuda:1", backend="nccl", gpu=3)
    assert banner(ctx) == "node 1 · local rank 1 · rank 1×4+1 = 5 of 8 · cuda:1 (physical GPU 3)"
    cpu = WorkerContext(rank=1, local_rank=1, node_rank=0, world_size=2, nprocs_per_node=2, nnodes=1,
                        device="cpu", backend="gloo")
    assert banner(cpu) == "node 0 · local rank 1 · rank 0×2+1 = 1 of 2 · cpu"
    slot = RankSlot(node_rank=1, local_rank=1, rank=5, world_size=8, nprocs_per_node=4, gpu=None)
    assert banner(slot) == "node 1 · local rank 1 · rank 1×4+1 = 5 of 8 · cpu"


def test_torch_build_is_read_without_importing_torch(tmp_path):
    import json
    import sys

    import torch

    code = ("import json, sys; from mpddp.machine.gpus import torch_builds_for_gpus as f; "
            "print(json.dumps([f(), 'torch' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    built_for_gpus = bool(torch.version.cuda or torch.version.hip)  # torch's own answer, in this process
    assert json.loads(out.stdout) == [built_for_gpus, False]
    assert gpus.torch_builds_for_gpus() is built_for_gpus  # torch already imported: asked directly


def test_an_unreadable_torch_build_lets_torch_answer(monkeypatch):
    import importlib.util
    import sys

    monkeypatch.delitem(sys.modules, "torch")
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name: SimpleNamespace(submodule_search_locations=["/nowhere"]))
    assert gpus.torch_builds_for_gpus() is True
