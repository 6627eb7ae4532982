"""Files lsgd writes: readable by their owner only, replaced atomically.

Run directories are created mode 0700 and files mode 0600 (the job's metrics, summaries and
checkpoints are nobody else's business). ``write_atomic`` writes a temporary file, fsyncs it and
renames it over the target, so a reader (or a crash) never sees half a file.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator


def private_dir(path: str | Path) -> Path:
    """Create ``path`` (and parents) if needed; the directory itself is made mode 0700.

    Every parent lsgd creates is mode 0700 too (``RUN_DIR`` for ``RUN_DIR/node0``); a parent
    that already exists keeps its mode (it may be the user's own, such as ``.``).
    """
    path = Path(path)
    for parent in reversed(path.parents):
        if not parent.exists():
            try:
                parent.mkdir(mode=0o700)
            except FileExistsError:  # made meanwhile (another node on this machine)
                pass
    path.mkdir(exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    return path


def open_private(path: str | Path, mode: str = "w", **kwargs) -> IO:
    """Open ``path`` for writing, created (or truncated) with mode 0600."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if "a" in mode else os.O_TRUNC)
    fd = os.open(path, flags, 0o600)
    os.fchmod(fd, 0o600)
    return os.fdopen(fd, mode, **kwargs)


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path to write ``path``'s new content to (mode 0600); on success it is
    fsynced and renamed over ``path``, on failure removed."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Replace ``path`` with ``data``: temporary file, fsync, rename, fsync of the directory."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open_private(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
