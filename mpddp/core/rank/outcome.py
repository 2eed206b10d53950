"""What a rank sends back when ``fn`` ends: its value, or its failure, typed where it is known.

Owns: the return value moved to the CPU and pickled by value (one that cannot be pickled is told by its
type), and an exception made a :class:`~mpddp.core.wire.protocol.Failure`: raised, exited, or broken in a
collective (torch's own error types, or a RuntimeError from torch's communication code: structure, never
the message's words), with the exception that started it and the exception itself by value. Leaves running
``fn`` and trimming the worker's own frames off a traceback to core/rank/worker.py, the message types to
core/wire/protocol.py.
"""

from __future__ import annotations

import os
import time
import traceback
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist

from ...context import WorkerContext
from ...errors import Outcome, ReturnValueError
from ..wire import protocol


def _to_cpu(value: Any) -> Any:
    """Move tensors in a result to the CPU: the parent must never touch CUDA."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_to_cpu(v) for v in value)
    if isinstance(value, dict) and type(value) is dict:
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


def pickled(rank: int, value: Any) -> bytes:
    """``fn``'s return value for the launcher; a value that cannot be pickled is told as such, by its type."""
    try:
        return cloudpickle.dumps(_to_cpu(value))
    except Exception as e:  # noqa: BLE001 - pickling raises TypeError, PicklingError, AttributeError, ...
        kind = f"{type(value).__module__}.{type(value).__qualname__}".removeprefix("builtins.")
        raise ReturnValueError(
            f"rank {rank}'s return value cannot be sent back to the launcher: a {kind} cannot be pickled "
            f"({type(e).__name__}: {e}); return plain data (numbers, strings, lists, dicts, tensors), e.g. "
            "list(...) of a generator, or the state_dict() of a model") from None  # pickle's frames tell nothing


# Where torch's communication surfaces in Python: its collectives and store, DDP, and the autograd
# engine (DDP all-reduces gradients from C++ hooks during backward, so a peer lost mid-backward is
# raised by the engine's call).
_COMMUNICATION = tuple(os.path.join("torch", *part.split("/"), "") for part in
                       ("distributed", "nn/parallel", "autograd"))
_TORCH = os.path.join("", "torch", "")
_DECORATORS = ("wrapper", "_wrapper", "inner")  # torch.distributed wraps its collectives for logging


def _collective_call(exc: BaseException) -> str | None:
    """``"all_reduce at train.py:12"`` when ``exc`` came out of a torch.distributed call, else None.

    Structure only: torch's own distributed error types (DistBackendError,
    DistNetworkError, DistStoreError: a peer gone, a timeout, the store lost),
    or a RuntimeError (what C++ errors become) raised by torch's communication
    code itself (gloo's "Connection reset by peer" inside DDP's backward is
    one). A user's exception is never one, whatever its message says.
    """
    frames = list(traceback.walk_tb(exc.__traceback__))
    names = [frame.f_code.co_filename for frame, _ in frames]
    raised_inside = bool(names) and any(part in names[-1] for part in _COMMUNICATION)
    if not (isinstance(exc, dist.DistError) or (type(exc) is RuntimeError and raised_inside)):
        return None
    # "all_reduce at train.py:12": the user's last frame, and the torch call it made (decorators skipped)
    user = max((i for i, name in enumerate(names) if _TORCH not in name), default=None)
    start = 0 if user is None else user + 1
    calls = [frame.f_code.co_name for frame, _ in frames[start:] if frame.f_code.co_name not in _DECORATORS]
    call = calls[0] if calls else type(exc).__name__
    return call if user is None else f"{call} at {os.path.basename(names[user])}:{frames[user][1]}"


def failure(ctx: WorkerContext, exc: BaseException, init_group: bool = False) -> protocol.Failure:
    """``exc``, raised in ``fn`` (its traceback starting at the user's frame), as the typed failure the launcher
    gets: its kind from the exception's type and frame, never its words."""
    exc = exc.with_traceback(None) if isinstance(exc, ReturnValueError) else exc
    if isinstance(exc, SystemExit):
        kind, where, code = Outcome.EXITED, None, exit_code(exc)
    else:
        # fn's own init_process_group, where mpddp made the group: its own mistake, not a peer gone
        twice = init_group and _raised_in(exc, "init_process_group")
        where, code = (None if twice else _collective_call(exc)), None
        kind = Outcome.RAISED if where is None else Outcome.COLLECTIVE
    first = _original(exc) if kind is Outcome.RAISED else exc
    return protocol.Failure(
        rank=ctx.rank, kind=kind, error_type=_type_name(first), message=str(first),
        traceback="" if isinstance(exc, ReturnValueError) else "".join(traceback.format_exception(exc)),
        time=time.monotonic(),  # CLOCK_MONOTONIC is machine-wide on Linux: the launcher orders reports by it
        exit_code=code, where=where,
        then=f"{_type_name(exc)}: {exc}" if first is not exc else None,
        hint=_TWICE if init_group and _raised_in(exc, "init_process_group") else None,
        pickled=_exception_payload(exc) if kind is not Outcome.EXITED else None,
    )


_TWICE = ("mpddp already made the process group before calling fn: remove your own init_process_group() call, "
          "or pass init_process_group=False to launch() (or use mpddp run for a torchrun-style script)")


def _raised_in(exc: BaseException, function: str) -> bool:
    """Whether ``exc`` came out of torch.distributed's ``function`` (its frame, not its words)."""
    return any(frame.f_code.co_name == function and _COMMUNICATION[0] in frame.f_code.co_filename
               for frame, _ in traceback.walk_tb(exc.__traceback__))


def _exception_payload(exc: BaseException) -> bytes | None:
    """The exception by value, when it can be pickled and loaded back here (the launcher tries again)."""
    try:
        data = cloudpickle.dumps(exc)
        cloudpickle.loads(data)
        return data if len(data) < 1 << 20 else None
    except Exception:  # noqa: BLE001 - an exception that does not pickle is reported by its text alone
        return None


def _type_name(exc: BaseException) -> str:
    return f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins.")


def _original(exc: BaseException) -> BaseException:
    """The error that started it, when ``exc`` was raised while another was being handled (implicit chaining:
    torch.save's "unexpected pos" while the disk's ENOSPC propagated); a ``raise ... from`` is the user's own
    wording of a cause, and stays the headline."""
    seen = {id(exc)}
    while exc.__context__ is not None and exc.__cause__ is None and not exc.__suppress_context__ \
            and id(exc.__context__) not in seen and isinstance(exc.__context__, Exception):
        exc = exc.__context__
        seen.add(id(exc))
    return exc


def exit_code(exc: SystemExit) -> int:
    """A ``sys.exit`` argument as the process's exit code, as Python makes it."""
    return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
