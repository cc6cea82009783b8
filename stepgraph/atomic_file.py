"""Files written atomically: the bytes go to a temporary file in the target's folder, are
flushed to disk, then renamed over the target, so a crash or a full disk never leaves a
half-written artifact or table behind."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from stepgraph.errors import UserError


def writable_path(path: str | Path, flag: str | None = None) -> Path:
    """``path`` checked for writing before any work is done: a one-line error (naming the
    command-line ``flag`` that gave it, when one did) if its folder does not exist or the
    path is a folder."""
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    named = f"{flag} {path}" if flag else str(path)
    if not folder.is_dir():
        raise UserError(f"{named}: folder {folder} does not exist")
    if path.is_dir():
        raise UserError(f"{named}: is a folder; name a file in it")
    return path


def write_atomically(path: str | Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` (the folder must exist)."""
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
