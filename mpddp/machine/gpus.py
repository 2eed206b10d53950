"""Which NVIDIA GPUs this machine has, who is using them, which ones a launch takes.

Owns: asking the driver about GPUs *without initializing CUDA* (NVML through ``pynvml`` when installed, else
``nvidia-smi``), applying ``CUDA_VISIBLE_DEVICES``, turning ``--gpus`` (ids, ``free``, ``free:N``, nothing) into
physical ids, and warning about GPUs another process fills. A GPU id is the index NVML and ``nvidia-smi`` give it
(PCI bus order), the number ``mpddp info`` prints. The parsers are pure, so tests feed them recorded answers.

Why no torch here: in the launcher's parent, ``torch.cuda.is_available()`` or ``get_device_properties`` is enough to
make every forked child fail with "Cannot re-initialize CUDA in forked subprocess" (measured on an H200 with torch
2.11, even while ``is_initialized()`` says False). NVML and ``nvidia-smi`` answer the same from the driver alone.
"""

from __future__ import annotations

import os
import subprocess
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError

SMI_TIMEOUT = 15.0  # seconds; the first call can take a few on a node without persistence mode
FREE_MEMORY_MIB = 1024  # a GPU using less than this, with no compute process, counts as free
BUSY_FRACTION = 0.5  # warn when another process already holds more than this share of memory
QUERY_GPU = "index,name,uuid,memory.total,memory.used,utilization.gpu"
QUERY_APPS = "gpu_uuid,pid,used_memory,process_name"
INFO_HINT = "see `mpddp info` for the GPUs here"


@dataclass(frozen=True)
class GpuProcess:
    """A compute process on a GPU (its pid as the driver sees it)."""

    pid: int
    used_mib: int | None  # None where the driver does not say (containers, MIG)
    name: str


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as the driver reports it; ``index`` is its physical id."""

    index: int
    name: str
    uuid: str
    memory_total_mib: int
    memory_used_mib: int
    utilization: int | None = None  # percent, None where not supported
    processes: tuple[GpuProcess, ...] = ()

    @property
    def is_free(self) -> bool:
        """No compute process and almost no memory in use."""
        return not self.processes and self.memory_used_mib < FREE_MEMORY_MIB

    @property
    def is_busy(self) -> bool:
        """Another process computes here or holds most of the memory."""
        return bool(self.processes) or self.memory_used_mib > BUSY_FRACTION * self.memory_total_mib

    def users(self) -> str:
        """``pid 4242 (python, 70000 MiB), pid 17 (...)`` or ``no process listed``."""
        if not self.processes:
            return "no process listed"
        return ", ".join(f"pid {p.pid} ({p.name}{'' if p.used_mib is None else f', {p.used_mib} MiB'})"
                         for p in self.processes)


@dataclass(frozen=True)
class GpuQuery:
    """Every GPU the driver reports, and the ids this process may use.

    ``visible`` applies ``CUDA_VISIBLE_DEVICES``, in its order. ``problem``
    says why there is no GPU ("nvidia-smi not found", the driver's error).
    """

    gpus: tuple[GpuInfo, ...] = ()
    visible: tuple[int, ...] = ()
    source: str = ""  # "nvml" or "nvidia-smi"
    problem: str | None = None

    def get(self, index: int) -> GpuInfo | None:
        """The GPU with this physical id, or None."""
        return next((g for g in self.gpus if g.index == index), None)


# --- pure parsers: recorded nvidia-smi answers go in, values come out ---------------------------------------

def _number(text: str) -> int | None:
    """``"143771"`` -> 143771; ``"[N/A]"`` / ``"[Not Supported]"`` -> None."""
    text = text.strip()
    try:
        return int(float(text))
    except ValueError:
        return None


def parse_query_gpu(text: str) -> tuple[GpuInfo, ...]:
    """Parse ``nvidia-smi --query-gpu=<QUERY_GPU> --format=csv,noheader,nounits``.

    Raises ValueError on a line that is not such a row (the driver's error
    text, say), so that the caller can report it.
    """
    gpus = []
    for line in filter(None, (raw.strip() for raw in text.splitlines())):
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 6:
            raise ValueError(line)
        # A name could hold a comma: the index is first, the last four are fixed.
        index, uuid, total, used, util = fields[0], fields[-4], fields[-3], fields[-2], fields[-1]
        name = ", ".join(fields[1:-4])
        total_mib, used_mib = _number(total), _number(used)
        if not index.isdigit() or total_mib is None or used_mib is None:
            raise ValueError(line)
        gpus.append(GpuInfo(int(index), name, uuid, total_mib, used_mib, _number(util)))
    return tuple(gpus)


def parse_compute_apps(text: str) -> dict[str, tuple[GpuProcess, ...]]:
    """Parse ``nvidia-smi --query-compute-apps=<QUERY_APPS> --format=csv,noheader,nounits``.

    Returns the processes per GPU UUID. Lines that are not rows (older
    drivers print "No running processes found") are skipped.
    """
    apps: dict[str, list[GpuProcess]] = {}
    for line in filter(None, (raw.strip() for raw in text.splitlines())):
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 4 or not fields[1].isdigit():
            continue
        uuid, pid, used = fields[0], int(fields[1]), _number(fields[2])
        apps.setdefault(uuid, []).append(GpuProcess(pid, used, os.path.basename(", ".join(fields[3:]))))
    return {uuid: tuple(procs) for uuid, procs in apps.items()}


def with_processes(gpus: Sequence[GpuInfo], apps: Mapping[str, tuple[GpuProcess, ...]]) -> tuple[GpuInfo, ...]:
    """Attach each GPU's compute processes (matched by UUID)."""
    return tuple(
        GpuInfo(g.index, g.name, g.uuid, g.memory_total_mib, g.memory_used_mib, g.utilization, apps.get(g.uuid, ()))
        for g in gpus
    )


def parse_visible_devices(value: str | None, gpus: Sequence[GpuInfo]) -> tuple[int, ...]:
    """The physical ids that ``CUDA_VISIBLE_DEVICES=value`` leaves visible, in its order.

    Unset: every GPU. ``""`` or ``-1``: none. Entries are ids or UUIDs (a
    unique prefix such as ``GPU-5e0c`` is enough). As CUDA does, the list
    stops at the first entry that names no GPU (or names one twice).
    """
    if value is None:
        return tuple(g.index for g in gpus)
    visible: list[int] = []
    for entry in (e.strip() for e in value.split(",")):
        gpu = _match_device(entry, gpus)
        if gpu is None or gpu.index in visible:
            break
        visible.append(gpu.index)
    return tuple(visible)


def _match_device(entry: str, gpus: Sequence[GpuInfo]) -> GpuInfo | None:
    if entry.isdigit():
        return next((g for g in gpus if g.index == int(entry)), None)
    if not entry or entry.startswith("-"):
        return None
    key = entry if entry.startswith(("GPU-", "MIG-")) else f"GPU-{entry}"
    found = [g for g in gpus if g.uuid.startswith(key)]
    return found[0] if len(found) == 1 else None


# --- asking the driver --------------------------------------------------------------------------------------

def query_gpus(environ: Mapping[str, str] | None = None, nvml: Any = None) -> GpuQuery:
    """Ask NVML (``pynvml``), else ``nvidia-smi``; never initializes CUDA."""
    env = os.environ if environ is None else environ
    if nvml is None:
        nvml = _import_pynvml()
    query = _query_nvml(nvml) if nvml is not None else None
    if query is None or query.problem is not None:
        query = _query_smi()
    return _apply_visible(query, env.get("CUDA_VISIBLE_DEVICES"))


def _import_pynvml() -> Any:
    """``pynvml`` (from nvidia-ml-py) or None; the old ``pynvml`` package warns on import."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            import pynvml
        except ImportError:
            return None
    return pynvml


def _apply_visible(query: GpuQuery, cvd: str | None) -> GpuQuery:
    visible = parse_visible_devices(cvd, query.gpus)
    problem = query.problem
    if query.gpus and not visible:
        problem = f"CUDA_VISIBLE_DEVICES={cvd!r} hides all {len(query.gpus)}"
    return GpuQuery(query.gpus, visible, query.source, problem)


def _query_nvml(nvml: Any) -> GpuQuery:
    """Query through an NVML binding (``pynvml``, or a fake in tests)."""
    try:
        nvml.nvmlInit()
    except Exception as e:  # NVMLError: no driver, no library
        return GpuQuery(source="nvml", problem=f"NVML: {e}")
    try:
        return GpuQuery(tuple(_nvml_gpu(nvml, i) for i in range(nvml.nvmlDeviceGetCount())), source="nvml")
    except Exception as e:
        return GpuQuery(source="nvml", problem=f"NVML: {e}")
    finally:
        nvml.nvmlShutdown()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _nvml_gpu(nvml: Any, index: int) -> GpuInfo:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    memory = nvml.nvmlDeviceGetMemoryInfo(handle)
    try:
        utilization: int | None = int(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    except Exception:  # NVMLError_NotSupported on some boards and on MIG
        utilization = None
    processes = tuple(
        GpuProcess(p.pid, None if p.usedGpuMemory is None else p.usedGpuMemory // 2**20, _process_name(nvml, p.pid))
        for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)
    )
    return GpuInfo(index, _text(nvml.nvmlDeviceGetName(handle)), _text(nvml.nvmlDeviceGetUUID(handle)),
                   memory.total // 2**20, memory.used // 2**20, utilization, processes)


def _process_name(nvml: Any, pid: int) -> str:
    try:
        return os.path.basename(_text(nvml.nvmlSystemGetProcessName(pid)))
    except Exception:  # the pid lives in another container's namespace
        return "?"


def _run_smi(query: str) -> str:
    done = subprocess.run(["nvidia-smi", query, "--format=csv,noheader,nounits"],
                          capture_output=True, text=True, timeout=SMI_TIMEOUT, check=False)
    if done.returncode != 0:
        message = (done.stdout + done.stderr).strip().splitlines()
        raise RuntimeError(message[0] if message else f"nvidia-smi exited with {done.returncode}")
    return done.stdout


def _query_smi() -> GpuQuery:
    """Query through ``nvidia-smi``; a missing binary means no NVIDIA GPU."""
    try:
        gpus = parse_query_gpu(_run_smi(f"--query-gpu={QUERY_GPU}"))
        apps = parse_compute_apps(_run_smi(f"--query-compute-apps={QUERY_APPS}")) if gpus else {}
    except FileNotFoundError:
        return GpuQuery(source="nvidia-smi", problem="nvidia-smi not found")
    except subprocess.TimeoutExpired:
        return GpuQuery(source="nvidia-smi", problem=f"nvidia-smi did not answer within {SMI_TIMEOUT:.0f} s")
    except (RuntimeError, ValueError, OSError) as e:
        return GpuQuery(source="nvidia-smi", problem=f"nvidia-smi failed: {e}")
    return GpuQuery(with_processes(gpus, apps), source="nvidia-smi",
                    problem=None if gpus else "nvidia-smi lists no GPU")


def torch_builds_for_gpus() -> bool:
    """Whether the installed torch is a CUDA or ROCm build, read without importing torch.

    torch's ``version.py`` declares its build (``cuda``, ``hip``: None on a
    CPU wheel) and imports nothing but ``typing``: running it costs a
    millisecond where ``import torch`` costs a second. Unknown: True (the
    caller then asks torch itself).
    """
    import importlib.util
    import runpy
    import sys

    torch = sys.modules.get("torch")
    if torch is not None:
        return bool(torch.version.cuda or torch.version.hip)
    try:
        spec = importlib.util.find_spec("torch")
        where = spec.submodule_search_locations if spec is not None else None
        if not where:
            return spec is not None
        build = runpy.run_path(os.path.join(list(where)[0], "version.py"))
    except Exception:  # noqa: BLE001 - an unusual install: let torch answer
        return True
    return bool(build.get("cuda") or build.get("hip"))


# --- choosing GPUs for a launch -----------------------------------------------------------------------------

def resolve_gpus(spec: tuple[int, ...] | str | None, nprocs: int | None,
                 query: GpuQuery | None = None) -> tuple[int, ...] | None:
    """The physical GPU ids local ranks 0, 1, ... use, or None for the CPU.

    ``spec`` is ``LaunchConfig.gpus``: explicit ids, ``"free"``, ``"free:N"``
    or None (every visible GPU; None on a machine without one). With
    ``nprocs`` set, only the first ``nprocs`` GPUs are taken; with more ranks
    than GPUs the caller shares them (gloo only).
    """
    if spec is None:
        query = query or query_gpus()
        return _first(query.visible, nprocs) or None
    query = query or query_gpus()
    shown = spec if isinstance(spec, str) else ",".join(map(str, spec))
    if not query.visible:
        raise ConfigError(
            f"gpus={shown} but this machine has no visible NVIDIA GPU ({query.problem}); "
            "drop --gpus to train on the CPU with gloo"
        )
    if isinstance(spec, str):
        return _first(_free(spec, query), nprocs)
    for gpu in spec:
        if gpu not in query.visible:
            raise ConfigError(f"gpus={shown} names GPU {gpu}, {_why_unknown(gpu, query)}; {INFO_HINT}")
    return _first(spec, nprocs)


def _first(ids: tuple[int, ...], nprocs: int | None) -> tuple[int, ...]:
    return ids if nprocs is None else ids[:nprocs]


def _why_unknown(gpu: int, query: GpuQuery) -> str:
    ids = ", ".join(map(str, query.visible))
    if query.get(gpu) is not None:
        return f"which CUDA_VISIBLE_DEVICES hides: use one of the visible GPUs {ids}"
    return f"which does not exist: this machine's GPUs are {ids}"


def _free(spec: str, query: GpuQuery) -> tuple[int, ...]:
    """``free`` -> every free visible GPU; ``free:N`` -> the first N of them."""
    visible = [g for g in map(query.get, query.visible) if g is not None]  # in CUDA_VISIBLE_DEVICES order
    free = tuple(g.index for g in visible if g.is_free)
    wanted = int(spec.split(":")[1]) if ":" in spec else max(len(free), 1)
    if len(free) >= wanted:
        return free[:wanted]
    busy = "; ".join(f"GPU {g.index}: {g.memory_used_mib} MiB used, {g.users()}" for g in visible if not g.is_free)
    have = f"only {len(free)} of {len(visible)} are free" if free else f"none of the {len(visible)} is free"
    fix = f"pass --gpus free:{len(free)}, " if free else ""
    raise ConfigError(
        f"gpus={spec} asks for {wanted} free GPU{'s' if wanted > 1 else ''} but {have} (not free: {busy}); "
        f"wait for them, {fix}or name GPUs such as --gpus 0,1 to share them"
    )


def busy_warnings(ids: Sequence[int] | None, query: GpuQuery | None = None) -> list[str]:
    """One line per chosen GPU that another process already uses.

    Says it before the out-of-memory error would: the GPU, its memory used
    and total, and the pids on it.
    """
    if not ids:
        return []
    query = query or query_gpus()
    lines = []
    for gpu in filter(None, (query.get(i) for i in ids)):
        if gpu.is_busy:
            lines.append(
                f"mpddp: warning: GPU {gpu.index} ({gpu.name}) is in use: {gpu.memory_used_mib} of "
                f"{gpu.memory_total_mib} MiB taken, {gpu.users()}; this launch may run out of GPU memory "
                "(pick idle GPUs with --gpus free, see `mpddp info`)"
            )
    return lines


def child_cuda_env(ids: Sequence[int]) -> dict[str, str]:
    """The variables that make physical GPUs ``ids`` the child's ``cuda:0, cuda:1, ...``.

    CUDA numbers GPUs fastest first unless told ``PCI_BUS_ID``; NVML and
    nvidia-smi number them in PCI order. Setting the order makes an id mean
    the same GPU in ``mpddp info`` and in the child.
    """
    return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": ",".join(map(str, ids))}
