"""Checkpoint files: atomic writes, validation, and finding the newest good one.

Owns: the on-disk format (a dict of tensors, ints, strings and lists, so that
``torch.load(weights_only=True)`` reads it), the file names
(``ckpt-<global step, 9 digits>.pt``, sortable), writing through a temporary
file in the same directory + fsync + ``os.replace`` (a reader sees the old
file or the new one, never half of one), the model signature that stops a
resume from another model, and retention (which never deletes the file just
written). Leaves *when* to save and what the state means to trainer/loop.py
and trainer/state.py; only rank 0 calls :func:`save`. torch is imported
where it is used, so that trainer/config.py can check checkpoint directories
without it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError

if TYPE_CHECKING:
    from torch import nn

FORMAT = "mpddp-checkpoint-1"
_NAME = re.compile(r"^ckpt-(\d{9})\.pt$")
_REQUIRED = ("format", "signature", "model", "optimizer", "epoch", "batches_done", "global_step", "rng")


def checkpoint_name(global_step: int) -> str:
    """``ckpt-000000120.pt``: names sort by global step."""
    return f"ckpt-{global_step:09d}.pt"


def signature(model: nn.Module) -> dict[str, Any]:
    """The model's class and every parameter/buffer name with its shape."""
    shapes = {name: list(t.shape) for name, t in model.state_dict().items()}
    return {"model": type(model).__name__, "shapes": shapes}


def save(state: dict[str, Any], directory: Path, global_step: int,
         before_replace: Callable[[Path], None] | None = None, owner: str = "") -> Path:
    """Write ``state`` as ``directory/ckpt-<step>.pt`` atomically; return the path.

    ``before_replace(tmp)`` runs after the temporary file is complete and
    before it takes the final name (fault injection uses it). ``owner``: the
    run's token, in the temporary file's name, so that the run (and only
    it) can remove what a rank killed mid-write leaves (:func:`remove_temporaries`).
    """
    import torch

    directory.mkdir(parents=True, exist_ok=True)
    final = directory / checkpoint_name(global_step)
    tmp = directory / _temporary(final.name, owner or _OWNER, os.getpid())  # same directory: one rename
    try:
        with open(tmp, "wb") as f:
            torch.save({"format": FORMAT, **state}, f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        if before_replace is not None:
            before_replace(tmp)
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(directory)  # make the rename itself durable
    return final


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load(path: Path, expected: dict[str, Any] | None = None) -> dict[str, Any]:
    """Read and validate a checkpoint; ConfigError names the file and the fix."""
    if not path.is_file():
        raise ConfigError(f"resume={str(path)!r}: no such checkpoint file; pass an existing ckpt-*.pt "
                          "or --resume auto for the newest in --checkpoint-dir")
    return _validate(_read(path), path, expected)


def _read(path: Path) -> Any:
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ConfigError(f"resume={str(path)!r} is not a readable checkpoint ({type(e).__name__}); "
                          "it is damaged or not an mpddp checkpoint: pass an older ckpt-*.pt or --resume auto") from e


def _validate(state: Any, path: Path, expected: dict[str, Any] | None) -> dict[str, Any]:
    missing = [k for k in _REQUIRED if not isinstance(state, dict) or k not in state]
    if missing or state["format"] != FORMAT:
        raise ConfigError(f"resume={str(path)!r} is not an mpddp checkpoint "
                          f"(missing {', '.join(missing) or 'format'}); "
                          "pass a ckpt-*.pt written by `mpddp train`")
    if expected is not None and state["signature"] != expected:
        raise ConfigError(f"resume={str(path)!r} holds a different model "
                          f"({_difference(state['signature'], expected)}); "
                          "pass a checkpoint of this task's model, or a new --checkpoint-dir to start fresh")
    return state


def _difference(saved: dict[str, Any], expected: dict[str, Any]) -> str:
    if saved.get("model") != expected["model"]:
        return f"{saved.get('model')} vs {expected['model']}"
    saved_shapes, shapes = saved.get("shapes", {}), expected["shapes"]
    for name in sorted(set(saved_shapes) | set(shapes)):
        if saved_shapes.get(name) != shapes.get(name):
            return f"{name}: {saved_shapes.get(name)} in the file vs {shapes.get(name)} here"
    return "signature differs"


def candidates(directory: Path) -> list[Path]:
    """Checkpoint files in ``directory``, newest first; temporary files are ignored."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if _NAME.match(p.name)]
    return sorted(found, key=lambda p: p.name, reverse=True)


def newest(directory: Path, expected: dict[str, Any] | None = None) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that loads and validates, with its state, or None.

    A file that fails to load (cut short by a crash outside this module, or
    damaged) is skipped, so a resume falls back to the last complete one.
    A file of another model is not skipped: that is the user's mistake.
    """
    for path in candidates(directory):
        try:
            state = _read(path)
        except ConfigError:
            continue
        if isinstance(state, dict) and state.get("format") == FORMAT:
            return path, _validate(state, path, expected)
    return None


_OWNER = "solo"  # a run without a token (a Trainer used by hand)


def _temporary(name: str, owner: str, pid: int | str) -> str:
    return f".{name}.{owner}.{pid}.tmp"


def remove_temporaries(directory: Path, owner: str) -> None:
    """Remove the temporary files run ``owner`` left (a rank killed while it wrote): never another run's."""
    if directory.is_dir():
        for stale in directory.glob(_temporary("ckpt-*.pt", owner, "*")):
            stale.unlink(missing_ok=True)


def prune(directory: Path, keep: int, written: Path | None = None, owner: str = "") -> None:
    """Keep the ``keep`` newest whole checkpoints (0: keep all) and drop this run's stale temporary files.

    ``written``, the file this run has just saved, is always kept, and files
    named newer than it are left alone: counted, a damaged ``ckpt-000000999.pt``
    would have every checkpoint this run writes deleted right after writing.
    A file that is not whole is not counted as kept.
    """
    remove_temporaries(directory, owner or _OWNER)
    if keep <= 0:
        return
    found = [p for p in candidates(directory) if written is None or p.name <= written.name]
    kept = 0
    for path in found:
        if kept < keep and ((written is not None and path.name == written.name) or _whole(path)):
            kept += 1
        else:
            path.unlink(missing_ok=True)


def _whole(path: Path) -> bool:
    """Whether ``path`` is a complete zip archive, as torch.save writes: cheap, it reads only the index at the end."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as archive:
            return bool(archive.namelist())
    except (OSError, zipfile.BadZipFile):
        return False
