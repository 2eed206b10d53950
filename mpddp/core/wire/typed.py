"""What comes from outside (a file in the runtime folder, a launcher's reply, another node's rows), read at the door.

Owns: :func:`loads` (JSON or one line), :func:`fill`, which turns a JSON object into a frozen dataclass of plain fields
only once every field has the type it declares (a bool is no int, an int is a float, a float is finite, an int fits 64
bits), else :class:`Malformed` with one line that names the field; and :func:`receive`, a socket's whole answer with a
cap on its size and a deadline on the whole read. Past these, code trusts its types: a malformed value is one line where
it enters, never a traceback further in, nor another thread's death. Leaves what a value means to its owner
(core/launcher/runtime_dir.py's entry, core/launcher/live.py's snapshot).
"""

from __future__ import annotations

import json
import math
import socket
import time
import types
import typing
from dataclasses import MISSING, fields, is_dataclass
from typing import Any, TypeVar

T = TypeVar("T")
_BIG = 1 << 63  # an int beyond this is no pid, count or size: a float of it, or its sum, could overflow


class Malformed(ValueError):
    """A value from outside that does not have its declared shape; the message says which field, in one line."""


def loads(text: str | bytes) -> Any:
    """JSON, or :class:`Malformed` in one line (bad JSON, text that is not UTF-8, nesting too deep to read)."""
    try:
        return json.loads(text)
    except UnicodeDecodeError:
        raise Malformed("not UTF-8 text") from None
    except ValueError as e:
        raise Malformed(f"not JSON ({e})") from None
    except RecursionError:
        raise Malformed("JSON nested too deep") from None


def fill(cls: type[T], data: Any, known_only: bool = True) -> T:
    """``cls`` (a dataclass of ints, floats, strs, bools, None and lists of str) from a JSON object. Keys it does not
    know are left out (a newer mpddp may send more), unless ``known_only`` is False; a field missing without a
    default, or of another type, is :class:`Malformed`."""
    if not isinstance(data, dict):
        raise Malformed(f"a JSON object was expected, not {type(data).__name__}")
    assert is_dataclass(cls)
    hints = typing.get_type_hints(cls)
    if not known_only and (extra := set(data) - set(hints)):
        raise Malformed(f"unknown field(s) {', '.join(sorted(map(str, extra)))}")
    values = {}
    for f in fields(cls):
        if f.name not in data:
            if f.default is MISSING and f.default_factory is MISSING:
                raise Malformed(f"no {f.name!r}")
            continue
        if not _fits(data[f.name], hints[f.name]):
            raise Malformed(f"{f.name}={_short(data[f.name])} is not {_said(hints[f.name])}")
        values[f.name] = data[f.name]
    return cls(**values)


def _fits(value: Any, hint: Any) -> bool:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return any(_fits(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool) and -_BIG < value < _BIG
    if hint is float:
        return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                and -_BIG < value < _BIG)
    if hint is str:
        return isinstance(value, str)
    if typing.get_origin(hint) in (list, tuple):
        inner = typing.get_args(hint)[0]
        return isinstance(value, list) and all(_fits(v, inner) for v in value)
    raise TypeError(f"typed.fill does not read {hint!r}")  # a field type of ours this module does not know: a bug


def _said(hint: Any) -> str:
    union = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
    return " or ".join(_name(h) for h in typing.get_args(hint)) if union else _name(hint)


def _name(hint: Any) -> str:
    if hint is type(None):
        return "null"
    return str(hint) if typing.get_origin(hint) is not None else str(getattr(hint, "__name__", hint))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def receive(conn: socket.socket, cap: int, timeout: float) -> bytes:
    """Everything the peer sends until it closes, at most ``cap`` bytes and ``timeout`` s for the whole read:
    :class:`Malformed` past the cap, TimeoutError past the deadline (a peer that sends without end, or slowly)."""
    deadline = time.monotonic() + timeout
    chunks: list[bytes] = []
    size = 0
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no whole answer within {timeout:g} s")
        conn.settimeout(left)
        try:
            chunk = conn.recv(min(1 << 16, cap + 1 - size))
        except TimeoutError:
            raise TimeoutError(f"no whole answer within {timeout:g} s") from None
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        size += len(chunk)
        if size > cap:
            raise Malformed(f"an answer over {cap:,} bytes")
