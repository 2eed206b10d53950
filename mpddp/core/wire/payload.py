"""Shipping ``fn``: the user's function and arguments travel by value.

Owns: serializing ``(fn, args, kwargs)`` with cloudpickle before any worker
starts (so a function from a notebook cell or a lambda works under every
start method), keeping code objects' file names so that worker tracebacks
point at the user's file, the notebook cells' source lines, and naming the
one thing that cannot be pickled. Leaves unpickling to core/rank/worker.py.
"""

from __future__ import annotations

import io
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ...errors import ShipError


@dataclass(frozen=True)
class _Unshippable:
    what: str
    error: Exception
    value: Any = None


_ITERATORS = (types.GeneratorType, types.AsyncGeneratorType, types.CoroutineType)


def _dumps(value: Any) -> bytes:
    """cloudpickle, but code keeps its file name so worker tracebacks point at it."""
    import copyreg

    import cloudpickle

    reduce_code = getattr(cloudpickle.cloudpickle, "_code_reduce", None)

    def code_with_filename(code: types.CodeType) -> Any:
        ctor, fields = reduce_code(code)  # type: ignore[misc]
        return ctor, tuple(code.co_filename if f == "<dynamic-code>" else f for f in fields)

    class Pickler(cloudpickle.Pickler):
        dispatch_table = copyreg.dispatch_table.copy()
        dispatch_table.update(cloudpickle.Pickler.dispatch_table)
        if reduce_code is not None:
            dispatch_table[types.CodeType] = code_with_filename

    buffer = io.BytesIO()
    Pickler(buffer, protocol=cloudpickle.DEFAULT_PROTOCOL).dump(value)
    return buffer.getvalue()


def pack_call(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> bytes:
    """Serialize ``fn`` and its arguments by value, before any worker starts."""
    try:
        return _dumps((fn, args, kwargs, _cell_sources()))
    except Exception as e:
        culprit = _find_unshippable(fn, args, kwargs)
        where = f"{culprit.what} ({culprit.error})" if culprit else str(e)
        raise ShipError(f"cannot send {where} to the workers: each worker is a separate process, so everything fn "
                        f"uses is pickled; {_fix(culprit.value if culprit else None)}") from e


def _fix(value: Any) -> str:
    """What to do instead, by the kind of thing that cannot travel (its type, not the error's words)."""
    if isinstance(value, _ITERATORS) or (isinstance(value, Iterator) and not isinstance(value, io.IOBase)):
        return "pass the values themselves (e.g. list(...) of it), or make the generator or iterator inside fn"
    if isinstance(value, types.ModuleType):
        return "import the module inside fn instead"
    return "create locks, sockets, files, threads and connections inside fn instead"


def _cell_sources() -> dict[str, tuple]:
    """Lines of code typed into Jupyter/IPython cells, which no file holds.

    IPython keeps them in linecache with no mtime; sent along, a worker's
    traceback shows the cell's lines instead of bare line numbers.
    """
    import linecache

    return {name: entry for name, entry in list(linecache.cache.items()) if len(entry) == 4 and entry[1] is None}


def _find_unshippable(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> _Unshippable | None:
    import cloudpickle

    candidates: list[tuple[str, Any]] = [(f"args[{i}]={a!r}", a) for i, a in enumerate(args)]
    candidates += [(f"kwargs[{k!r}]={v!r}", v) for k, v in kwargs.items()]
    closure = getattr(fn, "__closure__", None) or ()
    names = getattr(getattr(fn, "__code__", None), "co_freevars", ())
    candidates += [(f"{n}={c.cell_contents!r} (captured by fn)", c.cell_contents) for n, c in zip(names, closure)]
    globs = getattr(fn, "__globals__", {})
    for name in getattr(getattr(fn, "__code__", None), "co_names", ()):
        if name in globs:
            candidates.append((f"global {name}={globs[name]!r} (used by fn)", globs[name]))
    candidates.append((f"fn={fn!r}", fn))
    for what, value in candidates:
        try:
            cloudpickle.dumps(value)
        except Exception as e:
            return _Unshippable(what, e, value)
    return None
