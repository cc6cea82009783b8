"""Files written atomically: the bytes go to a temporary file in the target's folder, are
flushed to disk, then renamed over the target, so a crash or a full disk never leaves a
half-written artifact or table behind."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


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
