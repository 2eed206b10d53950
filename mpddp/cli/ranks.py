"""``mpddp ranks``: how every worker's rank is computed, filled in.

Owns: the teaching table (node, local rank, the formula, the device) and,
inside a job (SLURM, MPI, PBS, LSF, Kubeflow), which environment was found
and where each value came from. Leaves the formula to ranks.py and reading
the job to machine/cluster.py (a job's GPUs too).
"""

from __future__ import annotations

import os

import click

from .. import rank_math
from ..config import LaunchConfig, parse_gpus
from ..errors import ConfigError
from ..machine import cluster


@click.command()
@click.option("--nprocs", "--nproc-per-node", "--nproc_per_node", "nprocs", type=int, default=None,
              help="Workers per node (torchrun's --nproc-per-node) [default: GPUs chosen, else 1].")
@click.option("--nnodes", type=int, default=None, help="Number of machines [default: 1].")
@click.option("--gpus", default=None, help="GPU ids used on every node, such as 0,1,2,5.")
def ranks(nprocs: int | None, nnodes: int | None, gpus: str | None) -> None:
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
    nnodes = 1 if nnodes is None else nnodes
    config = LaunchConfig(nprocs=nprocs, nnodes=nnodes, gpus=ids, master_port=29500 if nnodes > 1 else 0)
    click.echo(format_ranks(config.nnodes, config.nprocs or 1, ids))


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
