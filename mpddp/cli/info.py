"""``mpddp info``: what this machine has, and what a launch here would choose.

Owns: the report itself (torch build, CUDA and NCCL, the GPUs with their
memory and processes, the cores, the cluster environment found, the
launch's choices). Leaves the facts to machine/gpus.py, machine/cores.py and
machine/cluster.py and the choices to core/launcher/plan.py.

It must never initialize CUDA, so that ``mpddp info`` in a notebook does not
poison a later fork: torch is asked only ``cuda.device_count()`` (never
``is_available()``), the GPUs come from NVML or ``nvidia-smi``.
"""

from __future__ import annotations

import os
import platform
import socket

import click

from .. import __version__, rank_math
from ..config import LaunchConfig, parse_gpus
from ..errors import ConfigError
from ..machine import cluster
from ..machine.cores import physical_cores, threads_per_rank
from ..machine.gpus import GpuInfo, GpuQuery, busy_warnings, child_cuda_env, query_gpus, resolve_gpus


@click.command()
@click.option("--nprocs", type=int, default=None, help="Show the choices for this many workers.")
@click.option("--gpus", default=None, help="Show the choices for these GPUs (0,3, free, free:N).")
def info(nprocs: int | None, gpus: str | None) -> None:
    """Show torch, CUDA, NCCL, the GPUs and who uses them, the CPU cores,
    the cluster environment found (SLURM, MPI, PBS, LSF, Kubeflow), and what
    a launch here would choose (backend, nprocs, threads, devices).

    Never initializes CUDA: GPUs are read through NVML or nvidia-smi.
    """
    config = LaunchConfig(nprocs=nprocs, gpus=parse_gpus(gpus))
    query = query_gpus()
    click.echo("\n".join(torch_lines() + [""] + gpu_lines(query) + [""] + cpu_lines() + [""] + cluster_lines() + [""]))
    click.echo("\n".join(choice_lines(config, query)))


def torch_lines() -> list[str]:
    """The torch build, the CUDA devices torch counts, the backends."""
    import torch
    import torch.distributed as dist

    build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
    nccl = "no"
    if dist.is_available() and dist.is_nccl_available():
        nccl = "yes, " + ".".join(map(str, torch.cuda.nccl.version()))
    gloo = "yes" if dist.is_available() and dist.is_gloo_available() else "no"
    # device_count() asks NVML or the runtime without a context: a later fork still works.
    count = torch.cuda.device_count()
    return [
        f"mpddp {__version__} · Python {platform.python_version()} · host {socket.gethostname()}",
        f"torch         {torch.__version__} ({build})",
        f"CUDA devices  {count} visible to torch (cuda.device_count(); CUDA not initialized)",
        f"backends      nccl: {nccl} · gloo: {gloo}",
    ]


def gpu_lines(query: GpuQuery) -> list[str]:
    """The GPUs table: id, name, memory used/total, utilization, processes."""
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    head = f"GPUs          {len(query.gpus)} (from {query.source})"
    if cvd is not None:
        head += f", CUDA_VISIBLE_DEVICES={cvd!r}"
    if not query.gpus:
        return [f"GPUs          none ({query.problem})"]
    width = max(len(g.name) for g in query.gpus)
    lines = [head, f"  {'id':>3}  {'name':<{width}}  {'memory used / total':>21}  {'util':>4}  state  processes"]
    lines += [_gpu_row(g, width, g.index in query.visible) for g in query.gpus]
    return lines


def _gpu_row(gpu: GpuInfo, width: int, visible: bool) -> str:
    memory = f"{gpu.memory_used_mib} / {gpu.memory_total_mib} MiB"
    util = "-" if gpu.utilization is None else f"{gpu.utilization}%"
    state = "free" if gpu.is_free else "busy" if gpu.is_busy else "used"
    users = gpu.users() if gpu.processes else "-"
    mark = "" if visible else "  (hidden by CUDA_VISIBLE_DEVICES)"
    return f"  {gpu.index:>3}  {gpu.name:<{width}}  {memory:>21}  {util:>4}  {state:<5}  {users}{mark}"


def cpu_lines() -> list[str]:
    """Physical and logical cores."""
    import psutil

    return [f"CPU cores     {physical_cores()} physical, {psutil.cpu_count(logical=True)} logical"]


def cluster_lines() -> list[str]:
    """Which cluster environment a launch here would take its layout from, and where each value comes from."""
    try:
        found = cluster.detect(os.environ)
    except ConfigError as e:  # a job whose files cannot be read: say so, the rest of the report still helps
        return [f"cluster       unreadable: {e}"]
    if found is None:
        return [f"cluster       none found (looked for {', '.join(cluster.PRECEDENCE)})"]
    lines = [f"cluster       {found.name}: a launch here takes this layout (explicit flags win)"]
    lines += ["  " + line for line in cluster.describe(found).splitlines()]
    why = cluster.note(found)
    return lines + ([f"  note: {why}"] if why else [])


def choice_lines(config: LaunchConfig, query: GpuQuery) -> list[str]:
    """What a one-node launch with ``config`` would choose here, and why."""
    from ..core.launcher.plan import choose

    ids = resolve_gpus(config.gpus, config.nprocs, query)  # a ConfigError ends the report, exit code 2
    nprocs, chosen = choose(config, ids)  # what the launch itself decides (a ConfigError, too)
    backend = "gloo (no GPU)" if not ids else "nccl (one GPU per rank)" if chosen == "nccl" else "gloo"
    omp = os.environ.get("OMP_NUM_THREADS")
    cores = physical_cores()
    why = f"OMP_NUM_THREADS={omp}" if omp else f"{cores} physical cores // {nprocs} rank{'s' if nprocs > 1 else ''}"
    lines = [
        "A launch here would choose:",
        f"  backend       {backend}",
        f"  nprocs        {nprocs} ({_why_nprocs(config, ids)})",
        f"  threads/rank  {threads_per_rank(nprocs, cores, omp)} ({why})",
        f"  start method  {config.start_method}",
        f"  master        {config.master_addr}, a port the OS picks (one node)",
    ]
    if ids:
        lines.append("  children get  " + " ".join(f"{k}={v}" for k, v in child_cuda_env(ids).items()))
    lines += [f"  [rank {s.rank}] {rank_math.banner(s)}" for s in rank_math.layout(1, nprocs, ids)]
    return lines + busy_warnings(ids, query)


def _why_nprocs(config: LaunchConfig, ids: tuple[int, ...] | None) -> str:
    if config.nprocs is not None:
        return "--nprocs"
    if ids:
        return "one per chosen GPU" if config.gpus is not None else "one per visible GPU"
    return "no GPU: one CPU worker; pass --nprocs N for more"
