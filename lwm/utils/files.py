"""Writing a file so that readers see the old one or the new one, never a torn one."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any


def temp_path(path: Path) -> Path:
    """``.NAME.tmp-HOST-PID`` beside ``path``: whose it is, for :func:`stale_temp_files`."""
    return path.parent / f".{path.name}.tmp-{socket.gethostname()}-{os.getpid()}"


def atomic_write(path: str | Path, write: Callable[[IO[Any]], object], mode: str = "wb", **open_kwargs: Any) -> Path:
    """``write(file)`` into :func:`temp_path` (folders made), fsynced, renamed over ``path``; the temp never stays."""
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


_TEMP = re.compile(r"^\.(?P<target>.+)\.tmp-(?:(?P<host>.+)-)?(?P<pid>\d+)$")  # (.NAME.tmp-PID: before hosts)
STALE_AFTER_S = 3600.0  # another host's temp file


def stale_temp_files(directory: str | Path, now: float | None = None,
                     target: Callable[[str], bool] | None = None) -> list[Path]:
    """The temp files of :func:`atomic_write` in ``directory`` whose writers are gone (``target``: of these names)."""
    now = time.time() if now is None else now
    stale = []
    for entry in os.scandir(directory):
        match = _TEMP.match(entry.name)
        if match is None or not entry.is_file(follow_symlinks=False) or (target and not target(match["target"])):
            continue
        if match["host"] in (None, socket.gethostname()):
            gone = not _pid_alive(match["pid"])
        else:
            try:
                gone = now - entry.stat().st_mtime > STALE_AFTER_S
            except FileNotFoundError:
                continue
        if gone:
            stale.append(Path(entry.path))
    return stale


def _pid_alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:  # another user's
        pass
    return True


def fsync_file(path: Path) -> None:
    """fsync a file (or folder) another process, or this one, wrote."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):  # (not every filesystem syncs a folder)
        fsync_file(directory)


def remove_stale_temp_files(directory: str | Path, target: Callable[[str], bool] | None = None) -> None:
    """Remove :func:`stale_temp_files`, best effort."""
    for stale in stale_temp_files(directory, target=target):
        with contextlib.suppress(OSError):
            stale.unlink(missing_ok=True)
