"""The plan of one node's group: GPUs, backend, threads, the ranks here, their environment.

Owns: turning a :class:`~mpddp.config.LaunchConfig` into a :class:`Plan`
without initializing CUDA in this process (GPUs from NVML or nvidia-smi,
``torch.cuda.device_count()`` as the fallback, never ``is_available()``,
which poisons a later fork), choosing nprocs and backend, refusing ``fork``
where a forked child fails or hangs, and the environment every worker gets:
every variable torchrun's elastic agent sets (compared with a real torchrun
in tests/test_torchrun_flags.py), plus mpddp's own (threads, pinned
interfaces and GPUs). Leaves the machine's facts to machine/, the rank
formula to ranks.py, the error file to core/wire/errorfile.py and starting the
processes to core/launcher/attempt.py.
"""

from __future__ import annotations

import os
import sys
import threading
import uuid
from dataclasses import dataclass, replace

import psutil

from ... import rank_math
from ...config import LaunchConfig
from ...errors import ConfigError
from ...log import logger
from ...machine.cores import oversubscribed, physical_cores, threads_per_rank, usable_cpus
from ...machine.gpus import child_cuda_env
from ..rank import recorder
from ..wire import errorfile


@dataclass(frozen=True)
class Plan:
    """A validated config plus what the machine decided: GPUs, backend, threads."""

    config: LaunchConfig
    nprocs: int
    backend: str
    gpus: tuple[int, ...] | None  # physical ids; local rank i drives gpus[i % len]
    pin_visible: bool  # write CUDA_VISIBLE_DEVICES for the workers
    threads: int | None
    slots: tuple[rank_math.RankSlot, ...] = ()  # this node's ranks
    run_id: str = "none"  # TORCHELASTIC_RUN_ID, the same for every attempt


def _gpus(config: LaunchConfig) -> tuple[tuple[int, ...] | None, bool]:
    """Physical GPU ids for local ranks 0, 1, ... (None: CPU), and whether to pin them.

    nvidia-smi/NVML answer without a CUDA context; torch.cuda.device_count()
    is the fallback (it creates no CUDA context), never is_available(), and
    only for a torch built for GPUs: on a CPU build the launcher imports no torch.
    """
    from ...machine.gpus import busy_warnings, query_gpus, resolve_gpus, torch_builds_for_gpus

    query = query_gpus()
    if config.gpus is None and not query.visible:
        if not torch_builds_for_gpus():
            return None, False
        from ..wire.store import quiet_torch

        with quiet_torch():  # the launcher's own import: its store client's C++ warnings off (core/wire/store.py)
            import torch
        count = torch.cuda.device_count()
        return (tuple(range(count)) or None), False
    ids = resolve_gpus(config.gpus, config.nprocs, query)
    for warning in busy_warnings(ids, query):
        logger.warning(warning)
    return ids, ids is not None


def _check_fork(gpus: tuple[int, ...] | None) -> None:
    """Refuse ``fork`` where a forked child fails or can hang (measured: after CUDA, after a threaded op)."""
    torch = sys.modules.get("torch")  # CUDA is initialized only where torch was imported
    if gpus or (torch is not None and torch.cuda.is_initialized()):
        raise ConfigError(
            "start_method='fork' is unsafe with CUDA GPUs visible: a forked child fails with 'Cannot re-initialize "
            "CUDA in forked subprocess'; use start_method='forkserver' (the default, as fast) or 'spawn'"
        )
    if threading.active_count() > 1:
        raise ConfigError(
            f"start_method='fork' is unsafe here: this process runs {threading.active_count()} Python threads "
            "(Jupyter does) and a forked child inherits any lock they hold, so it can hang without a word; "
            "use start_method='forkserver' (the default, as fast after the first launch) or 'spawn'"
        )


def _fork_threads(threads: int) -> int:
    """Forked children use one intra-op thread once this process has other OS threads.

    A child forked after a multi-threaded torch op inherits a dead OpenMP pool
    and hangs on its next parallel op, unless it stays on one thread. OS
    threads cannot tell an OpenMP pool from BLAS's, so any extra one counts.
    """
    return 1 if psutil.Process().num_threads() > 1 else threads


def choose(config: LaunchConfig, gpus: tuple[int, ...] | None) -> tuple[int, str]:
    """nprocs and backend for ``config`` on these GPUs (pure; ``mpddp info`` shows the same)."""
    nprocs = config.nprocs or (len(gpus) if gpus else 1)
    backend = config.backend if config.backend != "auto" else ("nccl" if gpus else "gloo")
    if backend == "nccl" and not gpus:
        raise ConfigError("backend='nccl' needs CUDA GPUs, but none is visible here: pass backend='gloo' "
                          "(--backend gloo on the command line), or leave it 'auto'")
    if backend == "nccl" and gpus and nprocs > len(gpus):
        raise ConfigError(
            f"nprocs={nprocs} with {len(gpus)} GPU(s): NCCL refuses two ranks on one GPU; "
            f"pass --nprocs {len(gpus)}, list {nprocs} GPUs with --gpus, or share them with --backend gloo"
        )
    return nprocs, backend


def plan_launch(config: LaunchConfig) -> Plan:
    """Decide GPUs, nprocs, backend and threads without initializing CUDA here."""
    gpus, pin = _gpus(config)
    nprocs, backend = choose(config, gpus)
    # GPU ranks too: 8 ranks each running a thread per core would fight over the CPU
    threads = threads_per_rank(nprocs, physical_cores(), os.environ.get("OMP_NUM_THREADS"))
    if gpus is None and (note := oversubscribed(nprocs, usable_cpus())) is not None:
        logger.warning("mpddp: %s", note)
    if gpus is None and config.numa_binding is not None:
        logger.warning("mpddp: --numa-binding %s binds nothing here: no GPU is visible, and torch binds each rank "
                       "to the CPUs near its GPU", config.numa_binding)
    if config.start_method == "fork":
        _check_fork(gpus)
        threads = _fork_threads(threads)
    slots = rank_math.layout(config.nnodes, nprocs, gpus)
    mine = tuple(s for s in slots if s.node_rank == config.node_rank)
    # torchrun's ids: --rdzv-id's, else a fresh one on one node (--standalone's), "none" on several (its static
    # rendezvous'); a node cannot make up an id that the other nodes would share
    run_id = config.rdzv_id or (str(uuid.uuid4()) if config.nnodes == 1 else "none")
    return Plan(config, nprocs, backend, gpus, pin, threads, mine, run_id)


def for_round(plan: Plan, nnodes: int, node_rank: int, host: str, port: int) -> Plan:
    """The plan of a round whose nodes changed (etcd's rounds): its size, this node's rank, its store."""
    config = replace(plan.config, nnodes=nnodes, node_rank=node_rank, master_addr=host, master_port=port)
    mine = tuple(s for s in rank_math.layout(nnodes, plan.nprocs, plan.gpus) if s.node_rank == node_rank)
    return replace(plan, config=config, slots=mine)


def node_env(plan: Plan, port: int, restarts: int) -> dict[str, str]:
    """The environment every worker of this node shares, computed once per group; ``restarts``: the job's
    restarts after a failure (a node's admission is none, as under torchrun's agent)."""
    config = plan.config
    env = dict(os.environ)
    env.update(  # torchrun's elastic agent sets the same (TORCHELASTIC_RUN_ID: is_torchelastic_launched())
        WORLD_SIZE=str(plan.slots[0].world_size),
        LOCAL_WORLD_SIZE=str(plan.nprocs),
        GROUP_RANK=str(config.node_rank),
        GROUP_WORLD_SIZE=str(config.nnodes),
        ROLE_NAME="default",
        ROLE_WORLD_SIZE=str(plan.slots[0].world_size),
        MASTER_ADDR=config.master_addr,
        MASTER_PORT=str(port),
        TORCHELASTIC_RESTART_COUNT=str(restarts),
        TORCHELASTIC_MAX_RESTARTS=str(config.max_restarts),
        TORCHELASTIC_RUN_ID=plan.run_id,
        TORCHELASTIC_SIGNALS_TO_HANDLE=",".join(config.signals_to_handle),  # passed on to the ranks
        TORCH_NCCL_ASYNC_ERROR_HANDLING=os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    )
    env.update(  # mpddp's own
        NODE_RANK=str(config.node_rank),
        PYTHONUNBUFFERED="1",
        MPDDP_STDOUT_ISATTY="1" if _interactive() else "0",
    )
    env.update(dict(config.env))
    recorder.env_defaults(env)  # the flight recorder, unless the user set its size
    if plan.threads is not None:
        env["OMP_NUM_THREADS"] = str(plan.threads)
    if plan.pin_visible and plan.gpus:
        env.update(child_cuda_env(tuple(dict.fromkeys(plan.gpus))))
    if config.nnodes == 1:
        # one node: every socket on loopback, none on the machine's public interfaces
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    else:
        from ...machine.netif import interface_env

        for key, value in interface_env(config.master_addr, os.environ).items():
            env.setdefault(key, value)
    return env


def rank_env(node_env: dict[str, str], slot: rank_math.RankSlot, error_dir: str,
             virtual_local_rank: bool = False) -> dict[str, str]:
    """One worker's environment: the node's plus its ranks and its own error file, as torchrun sets them."""
    env = {**node_env, "RANK": str(slot.rank), "LOCAL_RANK": str(slot.local_rank), "ROLE_RANK": str(slot.rank),
           "TORCHELASTIC_ERROR_FILE": errorfile.path(error_dir, slot.rank)}
    if virtual_local_rank:
        env.update(virtual_gpu_env(node_env.get("CUDA_VISIBLE_DEVICES"), slot))
    return env


def virtual_gpu_env(visible: str | None, slot: rank_math.RankSlot) -> dict[str, str]:
    """``--virtual-local-rank``: LOCAL_RANK 0, and CUDA_VISIBLE_DEVICES the rank's own GPU alone, its cuda:0
    (torchrun's local_elastic_agent.py: the entry of the node's CUDA_VISIBLE_DEVICES at its index, else the index).
    On the CPU torchrun writes the local rank; a CUDA_VISIBLE_DEVICES that hid the GPUs stays as it is."""
    index = slot.cuda_index if slot.cuda_index is not None else slot.local_rank
    if visible is None:
        return {"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": str(index)}
    entries = [entry.strip() for entry in visible.split(",")]
    if slot.cuda_index is None or index >= len(entries):
        return {"LOCAL_RANK": "0"}
    return {"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": entries[index]}


def _interactive() -> bool:
    return "ipykernel" in sys.modules or bool(getattr(sys.stdout, "isatty", lambda: False)())
