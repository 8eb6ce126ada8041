"""Writing a file so that readers see the old one or the new one, never a torn one."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any


def temp_path(path: Path) -> Path:
    """``.NAME.tmp-HOST-PID`` beside ``path``: whose it is, for :func:`lwm.checkpoint.stale_temp_files`."""
    return path.parent / f".{path.name}.tmp-{socket.gethostname()}-{os.getpid()}"


def atomic_write(path: str | Path, write: Callable[[IO[Any]], object], mode: str = "wb", **open_kwargs: Any) -> Path:
    """``write(file)`` into :func:`temp_path` of ``path`` (folders made), fsynced, then renamed over ``path``; the
    temp file is removed whatever happens."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        with open(tmp, mode, **open_kwargs) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
