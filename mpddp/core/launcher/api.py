"""The front door: ``launch()``, from options to every rank's return value.

Owns: checking ``launch``'s own arguments, building the one validated
:class:`~mpddp.config.LaunchConfig` from options, an optional config and
the job's layout (SLURM, MPI, PBS, LSF, Kubeflow; :func:`make_config`, used
by the CLI too: one rule for both), and ``spawn()``, torch.multiprocessing.spawn's
signature on top of ``launch()`` (core/launcher/mp_spawn.py). Leaves start-up to core/launcher/startup.py,
shipping ``fn`` to core/wire/payload.py, the plan to core/launcher/plan.py and the job (its
store, its rounds, the restart loop) to core/launcher/job.py.
"""

from __future__ import annotations

import difflib
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import fields, replace
from typing import Any

from ... import rendezvous_options
from ...config import LaunchConfig
from ...errors import ConfigError
from ...shutdown_options import signal_numbers
from ..rank.by_index import ByIndex
from ..wire import signals, stacks
from ..wire.fingerprint import call_job, script_job
from ..wire.payload import pack_call
from .mp_spawn import SpawnContext
from .startup import LAUNCHING, TRAINING_PRELOAD, interrupts_deferred, launcher_process, refuse_bootstrap, start_context

LAYOUT_KEYS = ("nnodes", "node_rank", "master_addr", "master_port")


def make_config(options: Mapping[str, Any], config: LaunchConfig | None = None) -> LaunchConfig:
    """``config`` (or the defaults) with ``options`` over it; a job's layout (SLURM, MPI, ...) fills what neither set.

    Options that are None count as unset. The job's environment is read only
    when no ``config`` was passed: a config object already describes the job.
    """
    given = {k: v for k, v in options.items() if v is not None}
    known = [f.name for f in fields(LaunchConfig)]
    for name in sorted(given.keys() - set(known)):
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(f"launch() got an unexpected keyword argument {name!r}: {hint}"
                          "see help(mpddp.LaunchConfig) for the launch options")
    # c10d's endpoint is node 0's address: given, it wins over a scheduler's, as --master-addr would
    given = {k: v for k, v in rendezvous_options.endpoint_as_master(given).items() if v is not None}
    if config is None and given.get("hosts") is None and given.get("hostfile") is None:  # --hosts: the layout
        from ...machine.cluster import apply_cluster

        # SLURM, MPI, PBS, LSF or Kubeflow (machine/cluster.py); unchanged outside them
        layout = apply_cluster({k: given.get(k) for k in (*LAYOUT_KEYS, "nprocs")})
        given |= {k: v for k, v in layout.items() if v is not None}
    return replace(config, **given) if config is not None else LaunchConfig(**given)


def launch(
    fn: Callable[..., Any],
    nprocs: int | None = None,
    *,
    args: tuple = (),
    kwargs: dict[str, Any] | None = None,
    config: LaunchConfig | None = None,
    init_process_group: bool = True,
    preload: tuple[str, ...] | list[str] = (),
    live: bool = False,
    **options: Any,
) -> list[Any]:
    """Run ``fn(ctx, *args, **kwargs)`` on every local rank; return their values.

    ``options`` are :class:`LaunchConfig` fields (``nnodes``, ``timeout``,
    ``max_restarts``, ...). ``init_process_group=False`` leaves the process
    group to ``fn`` (torchrun-style code calling ``init_process_group("env://")``).
    ``preload``: modules every rank imports anyway, imported once in the
    forkserver instead (``mpddp.core.launcher.startup.TRAINING_PRELOAD`` when ``fn``
    builds an optimizer or DDP; added by itself when ``max_restarts`` > 0, so
    that a restarted rank's first step is not one more import); it counts
    when the forkserver starts, at the interpreter's first launch.
    ``live=True`` shows ``mpddp top``'s table while the job runs: in a
    notebook cell, updated in place every second; elsewhere on stderr, now
    and then; the last look stays when the job ends.
    The list is in local rank order. If a rank fails,
    the whole group is stopped and :class:`WorkerFailed` names the rank that
    failed first, with its traceback.
    """
    refuse_bootstrap()
    if "join" in options or "daemon" in options:
        raise ConfigError(f"launch() got {'join' if 'join' in options else 'daemon'}=: launch() always waits for every "
                          "rank and returns their values; for torch.multiprocessing.spawn's signature (fn(i, *args), "
                          "join=, daemon=) use mpddp.spawn(fn, args=..., nprocs=..., join=False)")
    if not callable(fn):
        raise ConfigError(f"fn={fn!r} is not callable: pass a function such as `def train(ctx): ...`")
    if not isinstance(args, (tuple, list)):
        raise ConfigError(f"args={args!r} is not a tuple: pass fn's extra arguments as a tuple, e.g. args=({args!r},)")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ConfigError(f"kwargs={kwargs!r} is not a dict: pass fn's keyword arguments as a dict")
    if not isinstance(preload, (tuple, list)) or not all(isinstance(m, str) for m in preload):
        raise ConfigError(f"preload={preload!r} is not a list of module names: pass e.g. preload=['torch._dynamo']")
    if not isinstance(live, bool):
        raise ConfigError(f"live={live!r} is not True or False: pass live=True to see the job's table while it runs")
    config = make_config({**options, "nprocs": nprocs}, config)
    refuse_unguarded(config)
    if config.max_restarts:  # a job that may restart trains: a restarted rank must not import torch._dynamo again
        preload = (*preload, *(m for m in TRAINING_PRELOAD if m not in preload))
    payload, job = pack_call(fn, tuple(args), dict(kwargs or {})), _job(fn, tuple(args))
    if config.hosts is not None:  # a launcher on every host, over ssh (core/launcher/hosts_head.py)
        if live:
            raise ConfigError("live=True with hosts=: the ranks run on the hosts, not under this process; run "
                              "`mpddp top` on one of the hosts instead")
        from .hosts_head import launch_hosts

        return launch_hosts(config, payload, init_process_group, tuple(preload), job)
    if config.nnodes > 1:
        from ...machine.netif import resolve

        resolve(config.master_addr)  # a bad address: one line now, before any process or torch import
    config, listening = _store_socket(config)
    try:
        return run_node(config, payload, init_process_group, tuple(preload), listening, live, job)
    finally:
        if listening is not None:
            listening.close()  # a failure before the store server took it; else closed already


def _job(fn: Callable[..., Any], args: tuple) -> str:
    """What this launch runs, as its fingerprint says it (core/wire/fingerprint.py): ``mpddp run``'s script and its
    arguments, else the function (spawn's own, not its wrapper)."""
    from ..rank.script import run_script

    if fn is run_script:
        return script_job(*args)
    return call_job(fn.fn if isinstance(fn, ByIndex) else fn)


def _store_socket(config: LaunchConfig) -> tuple[LaunchConfig, socket.socket | None]:
    """Node 0's listening socket, bound now and kept until its store server serves it, and the config of a
    launcher numbered on joining (``node_rank=None``, c10d) that turns out to be node 0.

    Given node rank 0: an address not of this machine, or a port taken, is one line now. Numbered on joining:
    torchrun's rule. The launcher that can bind the endpoint (its host is an address of this machine, its
    port free) is node 0 and hosts the store; any other joins it as a client and is numbered as it comes
    (core/nodes/c10d.py). The bind decides, and is kept: two launchers on one machine cannot both be node 0.
    """
    # asked of rendezvous_options, not of the backend's class: importing the backends (core/nodes/) here cost every
    # launch about 40 ms before its forkserver started, in series with the forkserver's own imports
    if not rendezvous_options.node_0_hosts_store(config.rdzv_backend):
        return config, None  # each round's store is its first node's, whatever its number (core/launcher/job.py)
    from ..stores.listen import listen, try_listen

    if config.node_rank == 0:
        return config, listen(config.master_addr, config.master_port)
    if config.node_rank is None:
        sock = try_listen(config.master_addr, config.master_port)
        return (replace(config, node_rank=0) if sock is not None else config), sock
    return config, None


def run_node(config: LaunchConfig, payload: bytes, init_process_group: bool, preload: tuple[str, ...],
             listening: socket.socket | None = None, live: bool = False, job: str = "") -> list[Any]:
    """This node's ranks, from a checked config and a shipped ``fn``: the forkserver, the plan, the attempts.

    ``listening``: node 0's socket for the job's store, already listening (:func:`_store_socket`'s, or a ``--hosts``
    node's, core/launcher/hosts_node.py); None on the other nodes, and where each round's first node hosts its store.
    ``live``: the job's table shown while it runs (core/launcher/live_display.py). ``job``: what it runs, as the
    other launchers of the job compare it (:func:`_job`).
    """
    LAUNCHING.set()  # the command line's start-up handler (exit_on_interrupt) now leaves Ctrl-C to the teardown
    with stacks.on_demand(), interrupts_deferred():  # SIGUSR1: where is every rank (from the first moment)
        mp_context = start_context(config.start_method, preload)
        from .plan import plan_launch

        plan = plan_launch(config)
    from .job import run_job  # the attempt and what it imports: at the first launch, not at `import mpddp`

    # SIGTERM, SLURM's SIGUSR1, ...: the ranks get the signal and their grace (--signals-to-handle)
    with stacks.on_demand(), signals.stops_on(signal_numbers(config.signals_to_handle), launcher_process()):
        return run_job(plan, mp_context, payload, init_process_group, listening, live, job)


def refuse_unguarded(config: LaunchConfig) -> None:
    """A script whose top level starts workers with no main guard: one line and exit 2, before any worker starts
    (core/launcher/guard.py; the script's top level is the caller, so nothing could catch an error and go on)."""
    from .guard import unguarded_launch

    if (told := unguarded_launch(config.start_method)) is not None:
        print(f"mpddp: error: {told}", file=sys.stderr, flush=True)
        raise SystemExit(2)


def spawn(fn: Callable[..., Any], args: tuple = (), nprocs: int = 1, join: bool = True, daemon: bool = False,
          start_method: str | None = None, **options: Any) -> list[Any] | SpawnContext:
    """``torch.multiprocessing.spawn``, with mpddp's launcher underneath: ``fn(i, *args)`` in ``nprocs``
    processes, ``i`` from 0; ``fn`` makes its own process group, as under mp.spawn.

    ``join=True`` waits and returns every process's value (mp.spawn returns None); ``join=False`` returns a
    context whose ``join(timeout=None)`` waits. ``daemon`` is accepted for the signature: mpddp's processes
    never outlive the launcher either way, and may start processes of their own (DataLoader workers).
    ``start_method``: None is mpddp's forkserver (fast: torch is imported once); "spawn" and "fork" as in
    mp.spawn. ``options``: any :class:`~mpddp.LaunchConfig` field (``timeout``, ``max_restarts``, ...).
    """
    if not callable(fn):
        raise ConfigError(f"fn={fn!r} is not callable: pass a function such as `def main(rank, world_size): ...`")
    if not isinstance(join, bool) or not isinstance(daemon, bool):
        raise ConfigError(f"join={join!r}, daemon={daemon!r}: both are True or False, "
                          "as in torch.multiprocessing.spawn")
    if not isinstance(args, (tuple, list)):
        raise ConfigError(f"args={args!r} is not a tuple: pass fn's extra arguments as a tuple, e.g. args=({args!r},)")
    if start_method is not None:
        options["start_method"] = start_method
    config = make_config({**options, "nprocs": nprocs})  # bad input: one line now, also with join=False
    refuse_unguarded(config)  # here: with join=False, launch() runs in a thread that cannot see the script's frame

    def run() -> list[Any]:
        return launch(ByIndex(fn), args=tuple(args), init_process_group=False, config=config)

    return run() if join else SpawnContext(run)
