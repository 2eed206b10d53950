"""CPU cores, and how many threads each rank gets from them.

Owns: counting physical cores, the threads-per-rank rule, and the note for more CPU ranks than cores. Leaves GPUs to
machine/gpus.py, the rank formula to ranks.py and writing the workers'
environment to core/launcher/plan.py; no torch here.
"""

from __future__ import annotations

import os

import psutil


def threads_per_rank(local_ranks: int, physical_cores: int | None, omp_env: str | None) -> int:
    """Intra-op threads each rank gets: ``OMP_NUM_THREADS`` if set, else cores // ranks, at least 1.

    torchrun's blanket 1 thread leaves cores idle; more threads than
    physical cores, summed over the ranks, makes them fight.
    ``omp_env`` may be a nested list such as ``"4,2"``: the first level counts.
    """
    if omp_env:
        first = omp_env.split(",")[0].strip()
        if first.isdigit() and int(first) > 0:
            return int(first)
    return max(1, (physical_cores or 1) // max(1, local_ranks))


def physical_cores() -> int:
    """Physical cores (psutil), or logical ones where psutil cannot tell."""
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def usable_cpus() -> int:
    """The logical CPUs this process may run on (its affinity: a scheduler's cgroup or taskset narrows it)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def oversubscribed(local_ranks: int, cpus: int) -> str | None:
    """A note when CPU ranks outnumber the CPUs they share, else None (pure)."""
    if local_ranks <= cpus:
        return None
    return (f"{local_ranks} CPU ranks on this node's {cpus} CPU(s): about {local_ranks / cpus:.0f} ranks share each "
            f"CPU, so starting, every collective and every step are that much slower; pass --nprocs {cpus} (one "
            "rank a CPU) unless you mean to oversubscribe")
