"""A training run, as its launcher sees it: :func:`train` checks, launches, and finishes the curves.

Owns: what :func:`train` does in the launching process: the checks before
any worker starts, the run's token, who takes the run directory and its
lock (:func:`taken_by`: this launcher when its node's rank 0 writes
there, holding it from before the ranks start to after the curves; else
rank 0 itself), one :func:`mpddp.launch` of the ranks' :func:`_work`, and
``curves.png`` with TensorBoard's last point once rank 0 wrote the last
epoch. Imports no torch, nor anything that does: a fresh run of a built-in
task never loads torch in its launcher (the forkserver does, for the
ranks). Measured: the launcher's own import of torch kept the second core
busy until the ranks started, and its curves' imports then competed with
them. Leaves the ranks' side to trainer/loop.py, the checks to
trainer/prepare.py, the directory and the lock themselves to
trainer/rundir.py and the curves to trainer/output.py.
"""

from __future__ import annotations

import contextlib
import enum
import uuid
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mpddp

from ..config import LaunchConfig
from ..rendezvous_options import node_0_hosts_store
from . import checkpoint, rundir
from .config import TrainConfig
from .curves import prefetch
from .faults import check_fault_rank
from .output import EarlyCurves, TrainResult, finish_curves
from .prepare import resolve_run

if TYPE_CHECKING:
    from ..context import WorkerContext

IMPORTS_WAIT = 60.0  # seconds a call waits at most for the curves' imports (0.5 s quiet) before it returns


def train(config: TrainConfig | None = None, *, launch_config: LaunchConfig | None = None,
          **launch_options: Any) -> TrainResult:
    """Check ``config``, launch one worker per rank, return rank 0's result.

    ``launch_config`` and ``launch_options`` go to :func:`mpddp.launch`
    (e.g. ``nprocs=2, max_restarts=1``). The run directory is this run's
    alone: a new one gets a name no other run has, and one in use by a live
    run is refused (ConfigError naming its pid and host) before any worker
    starts, where the launch options say which node this is (see
    :func:`taken_by`), else by rank 0 as it starts.
    """
    config = config or TrainConfig()
    _check_fault_rank(config, launch_config, launch_options)
    config, new = resolve_run(config)
    # The run's token names its checkpoints' temporary files: a rank killed while it writes one (Ctrl-C, the
    # watchdog, the OOM killer: the teardown ends in SIGKILL, and no cleanup runs in it) leaves one behind, which
    # this launcher removes once every rank is gone, and no other run's.
    owner = uuid.uuid4().hex[:12]
    taker = taken_by(launch_config, launch_options)
    here, ranks = taker is TakenBy.LAUNCHER, taker is TakenBy.RANK_0
    with rundir.held(str(config.run_dir), new, owner) if here else contextlib.nullcontext(config.run_dir) as run_dir:
        # rank 0 takes the directory where this launcher cannot (a new one's name as proposed here)
        work = (replace(config, run_dir=run_dir), owner, False, ranks, new and ranks)  # _work's arguments
        result = _launch(work, here and one_node(launch_config, launch_options), launch_config, launch_options)
    print(f"checkpoint: {result.checkpoint}  metrics: {result.metrics}  curves: {result.curves or result.curves_note}",
          flush=True)
    return result


def _launch(work: tuple[TrainConfig, str, bool, bool, bool], early_curves: bool, launch_config: LaunchConfig | None,
            launch_options: dict[str, Any]) -> TrainResult:
    """One :func:`mpddp.launch` of :func:`_work` with ``work`` as its arguments, then the curves (node 0's
    launcher; ``early_curves``: as soon as rank 0 wrote the last epoch, see EarlyCurves)."""
    config, owner = work[:2]
    # curves.png is drawn and TensorBoard's last point logged here, their imports done in a thread while the
    # forkserver imports torch (off the path), unless this process forks the ranks (no import may run across a
    # fork): on one node as soon as rank 0 wrote the last epoch (EarlyCurves), else once the ranks exit.
    forks = _option("start_method", launch_config, launch_options, None) == "fork"
    imports = None if forks else prefetch()
    early = EarlyCurves(config.metrics_path.parent, config.epochs) if not forks and early_curves else None
    try:
        result: TrainResult = mpddp.launch(_work, args=work, config=launch_config, **launch_options)[0]
    except Exception:  # a failed launch returns at once: no thread of ours outlives the call, importing (a Ctrl-C
        if imports is not None:  # is answered at once: the process ends, and the daemon thread with it)
            imports.join(IMPORTS_WAIT)
        raise
    finally:
        checkpoint.remove_temporaries(config.checkpoint_path, owner)
        if early is not None:
            early.stop()
    if imports is not None:
        imports.join(IMPORTS_WAIT)
    if result.rank == 0:  # node 0's launcher: the metrics file is on this machine
        if (done := early.result(result.global_step) if early is not None else None) is None:
            done = finish_curves(Path(result.run_dir), result.global_step)
        result = replace(result, curves=done[0], curves_note=done[1])
    return result


def _work(ctx: WorkerContext, config: TrainConfig, owner: str, draw: bool, lock: bool, new: bool) -> TrainResult:
    """What :func:`train` launches: :func:`~mpddp.trainer.train_worker`, named here, where no torch is imported
    (the forkserver has trainer/loop.py loaded already: ``mpddp train`` preloads it)."""
    from .loop import train_worker

    return train_worker(ctx, config, owner, draw, lock=lock, new=new)


class TakenBy(enum.Enum):
    """Who takes a run's directory and its lock (trainer/rundir.py)."""

    LAUNCHER = "this launcher"  # its node's rank 0 writes the run: refused, if in use, before any worker starts
    RANK_0 = "rank 0"  # which node writes is known only once the ranks run: rank 0 takes it as it starts
    NODE_0 = "node 0's launcher"  # this node's ranks write nothing there


def taken_by(launch_config: LaunchConfig | None, options: dict[str, Any]) -> TakenBy:
    """Who takes the run directory, from the launch options as :func:`mpddp.launch` will see them.

    Rank 0 writes the metrics and the checkpoints; it runs on node 0 of a
    c10d launch. Without a launch config and without ``node_rank`` (or
    ``nnodes=1``), launch() reads a scheduler's layout (SLURM, MPI, ...)
    that this launcher does not see; an etcd round numbers the nodes as they
    meet; ``--hosts`` starts node 0 on the first host, over ssh, where the
    head's disk may not be. In those cases rank 0 takes it itself.
    """
    if _option("hosts", launch_config, options, None) or _option("hostfile", launch_config, options, None):
        return TakenBy.RANK_0
    if not node_0_hosts_store(_option("rdzv_backend", launch_config, options, "c10d")):  # no node is node 0 for good
        return TakenBy.RANK_0
    if launch_config is None and options.get("node_rank") is None and options.get("nnodes") != 1:
        return TakenBy.RANK_0
    node_rank = _option("node_rank", launch_config, options, 0)
    several = (_option("nnodes", launch_config, options, 1) or 1) != 1
    if node_rank is None and several:  # numbered as it joins (torchrun's elastic line): node 0 is not known yet
        return TakenBy.RANK_0
    return TakenBy.LAUNCHER if not node_rank else TakenBy.NODE_0


def one_node(launch_config: LaunchConfig | None, options: dict[str, Any]) -> bool:
    """Surely a job of one node, whose rank 0 is this launcher's: a launch config that says so (the command
    line's, which holds the scheduler's layout too), no option that changes it. Else (launch() reads the layout
    itself) rank 0 may be another node's, whose metrics file a shared disk shows here too."""
    return (launch_config is not None and launch_config.nnodes == 1 and launch_config.hosts is None
            and launch_config.hostfile is None and not options.keys() & {"nnodes", "hosts", "hostfile"})


def _option(name: str, launch_config: LaunchConfig | None, options: dict[str, Any], default: Any) -> Any:
    """A launch option as :func:`mpddp.launch` will see it: ``options`` override ``launch_config``."""
    given = options.get(name)
    return given if given is not None else (getattr(launch_config, name) if launch_config else default)


def _check_fault_rank(config: TrainConfig, launch_config: LaunchConfig | None, options: dict[str, Any]) -> None:
    """``inject_fault``'s RANK against nnodes × nprocs, before launching, where the launch options fix both.

    Without nprocs (one rank per GPU, counted at launch) each rank checks it in Trainer.
    """
    nprocs, nnodes = (_option(k, launch_config, options, d) for k, d in (("nprocs", None), ("nnodes", 1)))
    if type(nprocs) is int and type(nnodes) is int:  # a bad value: LaunchConfig says so
        check_fault_rank(config.inject_fault, nnodes * nprocs, f"nnodes={nnodes} × nprocs={nprocs}")
