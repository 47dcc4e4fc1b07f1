"""The on-disk cache every streamrl layer shares: where it lives, and the two rules that make it safe for
concurrent processes -- writers take an exclusive lock, and every file or folder appears under its final name
only when complete (written under a temporary name beside it, then renamed, which is atomic on one
filesystem).

``cache_root()`` is ``$STREAMRL_CACHE`` or ``~/.cache/streamrl``; generated ALFWorld games, the PDDL->SAS
translation cache, built models and SFT checkpoints live in sub-folders of it. This module sits in
``streamrl.utils``, below every other layer (``envs`` included), so that each of them can use it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["atomic_dir", "atomic_write_bytes", "atomic_write_text", "cache_root", "file_lock"]


def cache_root() -> Path:
    """``$STREAMRL_CACHE`` if set, else ``~/.cache/streamrl``: where streamrl keeps generated data, models
    and checkpoints. Read at every call, so a process may point it elsewhere before first use."""
    return Path(os.environ.get("STREAMRL_CACHE") or Path.home() / ".cache" / "streamrl").expanduser()


@contextlib.contextmanager
def file_lock(path: str | os.PathLike[str]) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created, with its folder, if missing) for the block.

    The kernel releases the lock when the file closes, also when the holding process dies, so a crashed
    writer never leaves the cache locked. Not re-entrant: a process that takes the same lock twice (or a
    child that waits for a lock its parent holds) waits forever.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder and a rename, so readers see
    the old file or the whole new one, never a partial file. The file is made world-readable (``0644``;
    ``mkstemp`` creates ``0600``) because the cache may be shared."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """:func:`atomic_write_bytes` of ``text`` encoded as UTF-8."""
    atomic_write_bytes(path, text.encode("utf-8"))


@contextlib.contextmanager
def atomic_dir(target: str | os.PathLike[str], *, replace: bool = False) -> Iterator[Path]:
    """Yield a fresh empty folder beside ``target``; when the block succeeds it is renamed to ``target``,
    when it raises it is removed. ``replace=True`` first removes an existing ``target`` (e.g. a stale folder
    of an interrupted run); otherwise an existing non-empty ``target`` makes the rename fail with ``OSError``.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        if replace and target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
