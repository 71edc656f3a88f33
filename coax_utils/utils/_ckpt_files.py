"""Files of checkpoints: atomic replacement, kept permissions, no temp litter, safe opening."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import stat
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["as_path", "atomic_write", "fsync_dir", "open_regular_file"]

_TEMP = re.compile(r"\.coax_utils-([0-9]+)-[0-9a-f]{12}\.tmp\Z")
_umask_lock = threading.Lock()


def as_path(filepath: Any) -> str:
    """``filepath`` as a str (bytes paths are decoded losslessly); TypeError for non-paths."""
    if not isinstance(filepath, (str, bytes, os.PathLike)):
        raise TypeError(f"filepath must be a str or os.PathLike, got {type(filepath).__name__}")
    return os.fsdecode(os.fspath(filepath))


def fsync_dir(dirname: str) -> None:
    """Make a folder's entries durable (a no-op where folders cannot be opened)."""
    if os.name == "nt":
        return
    fd = os.open(dirname, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    with _umask_lock:  # elsewhere the only way to read it is to set it
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def remove_stale_temps(dirname: str) -> None:
    """Remove temp files of this naming left in ``dirname`` by processes that have died."""
    try:
        names = os.listdir(dirname)
    except OSError:
        return
    for name in names:
        m = _TEMP.match(name)
        if m and not _pid_alive(int(m.group(1))):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(dirname, name))


def temp_name(dirname: str) -> str:
    """A new temp file name in ``dirname`` (its pid lets a later writer spot leftovers)."""
    return os.path.join(dirname, f".coax_utils-{os.getpid()}-{secrets.token_hex(6)}.tmp")


def atomic_write(path: str, write_all: Callable[[Callable[[int, Any], None]], None]) -> None:
    """Write a file atomically: temp file in the same folder, fsync, rename, folder fsync.

    ``write_all(place)`` produces the content by calling ``place(offset, piece)``, from
    any number of threads at once, for pieces that together cover the file. The file keeps
    the permission bits of the file it replaces (a new file gets the default of the umask);
    until the rename it is readable by its owner only. A failure removes the temp file and
    leaves ``path`` as it was; temp files of killed writers are removed too.
    """
    dirname = os.path.dirname(os.path.abspath(path))
    os.makedirs(dirname, exist_ok=True)
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        mode = 0o666 & ~_umask()
    remove_stale_temps(dirname)
    tmp = temp_name(dirname)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        try:
            write_all(lambda offset, piece: _place(fd, offset, piece))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(dirname)


def _place(fd: int, offset: int, piece: Any) -> None:
    """Write ``piece`` at ``offset`` of the file (``os.pwrite``: safe from several threads)."""
    view = memoryview(piece).cast("B")
    done = 0
    while done < view.nbytes:
        done += os.pwrite(fd, view[done:], offset + done)
    if view.nbytes >= 1 << 20 and hasattr(os, "posix_fadvise"):
        # Start write-back of what is written, so the disk works while the next chunks
        # are compressed; the final fsync has less left to do.
        with contextlib.suppress(OSError):  # a hint only
            os.posix_fadvise(fd, offset, view.nbytes, os.POSIX_FADV_DONTNEED)


@contextlib.contextmanager
def open_regular_file(path: str) -> Iterator[tuple[int, int]]:
    """Open a file for reading; ValueError at once for a FIFO, a folder or a device.

    Yields the file descriptor and the file's size.
    """
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
    fd = os.open(path, flags)  # O_NONBLOCK: opening a FIFO does not wait for a writer
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path!r} is not a regular file; a checkpoint is a regular file")
        if hasattr(os, "O_NONBLOCK"):
            os.set_blocking(fd, True)
        yield fd, st.st_size
    finally:
        os.close(fd)
