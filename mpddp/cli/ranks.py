"""``mpddp ranks``: how every worker's rank is computed, filled in.

Owns: the teaching table (node, local rank, the formula, the device), its
notes (an elastic MIN:MAX shown for MAX; local ranks that share a GPU, which
NCCL refuses) and, inside a job (SLURM, MPI, PBS, LSF, Kubeflow), which
environment was found and where each value came from. Leaves the formula to
rank_math.py and reading the job to machine/cluster.py (a job's GPUs too).
"""

from __future__ import annotations

import os
from typing import Any

import click

from .. import rank_math
from ..config import NNODES_METAVAR, NPROCS_METAVAR, LaunchConfig, parse_gpus, parse_nnodes, parse_nprocs
from ..errors import ConfigError
from ..machine import cluster


@click.command()
@click.option("--nprocs", "--nproc-per-node", "--nproc_per_node", "nprocs", type=parse_nprocs, default=None,
              metavar=NPROCS_METAVAR, help="Workers per node (torchrun's --nproc-per-node): N, or gpu/auto (one per "
              "GPU of --gpus, else 1), cpu (one per CPU here) [default: one per GPU of --gpus, else 1].")
@click.option("--nnodes", type=parse_nnodes, default=None, metavar=NNODES_METAVAR,
              help="Number of machines: N, or MIN:MAX (elastic: the table is for MAX) [default: 1].")
@click.option("--gpus", default=None, help="GPU ids used on every node, such as 0,1,2,5.")
def ranks(nprocs: int | None, nnodes: int | str | None, gpus: str | None) -> None:
    """Print every worker's node, local rank, global rank and device.

    The formula is printed filled in, so you can see why, with 4 workers a
    node, GPU 2 of node 1 is rank 1×4+2 = 6.
    """
    ids = parse_gpus(gpus)
    if isinstance(ids, str):
        raise ConfigError(f"gpus={ids!r}: `mpddp ranks` needs explicit ids such as 0,1,2,5")
    found = cluster.detect(os.environ) if nnodes is None else None
    if found is not None:  # inside a job: show that job's layout
        click.echo(_header(found))
        nnodes = found.nnodes
        job = found.layout
        if nprocs is None and ids is None and job.gpus:  # one worker per GPU the job gave this node
            ids = job.gpu_ids if len(job.gpu_ids or ()) == job.gpus else None
            nprocs = job.gpus
        elif nprocs is None:
            nprocs = job.nprocs
    if nprocs is None:
        nprocs = len(ids) if ids else 1
    size: Any = 1 if nnodes is None else nnodes  # N, or "MIN:MAX": LaunchConfig splits it, as for launch()
    # a fixed port only so that LaunchConfig takes several nodes: nothing is bound
    config = LaunchConfig(nprocs=nprocs, nnodes=size, gpus=ids, master_port=29500)
    click.echo(format_ranks(config.nnodes, config.nprocs or 1, ids))
    if config.min_nnodes < config.nnodes:  # README: a smaller round of an elastic job numbers its nodes anew
        click.echo(f"\n{elastic_note(config.min_nnodes, config.nnodes, config.nprocs or 1)}")
    if (shared := shared_gpus(config.nprocs or 1, ids)):
        click.echo(f"\n{shared_note(shared, config.nprocs or 1, ids or (), config.nnodes)}")


def _header(found: cluster.Detected) -> str:
    """Where the values came from, and why the layout would not work (if so)."""
    problem = cluster.note(found)
    note = f"\nnote: {problem}" if problem else ""
    return f"{cluster.describe(found)}{note}\n"


def format_ranks(nnodes: int, nprocs: int, gpus: tuple[int, ...] | None) -> str:
    """The teaching table of ``mpddp ranks``."""
    slots = rank_math.layout(nnodes, nprocs, gpus)
    size = rank_math.world_size(nnodes, nprocs)
    lines = [
        f"world_size = nnodes × nprocs_per_node = {nnodes} × {nprocs} = {size}",
        "rank       = node_rank × nprocs_per_node + local_rank",
        "",
        f"{'node':>4}  {'local_rank':>10}  {'rank (formula)':<16}  {'device':<7}  physical GPU",
    ]
    for s in slots:
        gpu = "-" if s.gpu is None else str(s.gpu)
        lines.append(f"{s.node_rank:>4}  {s.local_rank:>10}  {s.formula:<16}  {s.device:<7}  {gpu}")
    if nnodes > 1:
        last = slots[-1]
        lines += [
            "",
            f"local_rank is not rank: node {last.node_rank}'s local rank {last.local_rank} is rank {last.rank}. "
            f"Passing local_rank as rank would give {nnodes} workers rank 0 and the job would hang or fail.",
        ]
    return "\n".join(lines)


def elastic_note(low: int, high: int, nprocs: int) -> str:
    """What the table of an elastic job (``--nnodes MIN:MAX``, shown for MAX) leaves out."""
    return (f"note: nnodes={low}:{high} is elastic: the table is for {high} nodes. A round with fewer (down to {low}) "
            f"numbers its nodes 0, 1, ... anew, and every rank follows the same formula: with {low} nodes, ranks "
            f"0 to {low * nprocs - 1}.")


def shared_gpus(nprocs: int, gpus: tuple[int, ...] | None) -> dict[int, tuple[int, ...]]:
    """The GPUs that more than one local rank would drive (``rank_math.layout`` shares them round-robin),
    each with its local ranks; the same on every node."""
    if not gpus:
        return {}
    drivers = {gpu: tuple(local for local in range(nprocs) if gpus[local % len(gpus)] == gpu) for gpu in gpus}
    return {gpu: ranks for gpu, ranks in drivers.items() if len(ranks) > 1}


def shared_note(shared: dict[int, tuple[int, ...]], nprocs: int, gpus: tuple[int, ...], nnodes: int = 1) -> str:
    """One line for :func:`shared_gpus`: NCCL refuses it, and the two ways out."""
    said = "; ".join(f"local ranks {_listed(ranks)} share GPU {gpu}" for gpu, ranks in shared.items())
    where = " on every node" if nnodes > 1 else ""
    return (f"note: {said}{where}: NCCL refuses two ranks on one GPU. Pass --nprocs {len(gpus)}, list {nprocs} GPUs "
            "in --gpus, or share GPUs with --backend gloo.")


def _listed(numbers: tuple[int, ...]) -> str:
    """``0, 2 and 4``."""
    return ", ".join(map(str, numbers[:-1])) + f" and {numbers[-1]}"
