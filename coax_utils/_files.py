"""Files and folders on disk: the one place for atomic writes, folder swaps, locks, and for
opening files that may be hostile.

Every save path of the package (``utils.dump``, the checkpoint manager, GIFs, replay
folders, sharded replay) writes through here, in one plain way:

* a file: temp file in the same folder, write (``os.pwrite``, from any number of threads),
  fsync, rename over the target, fsync of the folder (:func:`atomic_write`);
* a folder: a new folder beside the target, filled and fsynced, swapped in with two renames,
  the folder fsynced, the old folder removed last, all under a lock on the target
  (:func:`atomic_folder`); a reader resolves a swap cut short by a kill with
  :func:`resolve_folder`.

Temp files and folders carry the writer's process id, so that leftovers of dead writers (and
only those) are removed by later writers.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import secrets
import shutil
import stat
import time
from collections.abc import Callable, Iterator
from typing import Any

__all__ = [
    "as_path",
    "atomic_folder",
    "atomic_write",
    "fsync_dir",
    "lock_file",
    "open_regular_file",
    "remove_stale_temps",
    "rename",
    "resolve_folder",
    "write_file",
]

_TEMP = re.compile(r"\.coax_utils-([0-9]+)-[0-9a-f]{12}\.tmp\Z")


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


def rename(path: str, new_path: str) -> None:
    """Rename ``path`` to ``new_path`` (replacing a file there) and make it durable: the
    folder is fsynced, so after a crash the file has one of the two names, not none."""
    os.replace(path, new_path)
    fsync_dir(os.path.dirname(os.path.abspath(new_path)))


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
    """Remove the temp files of :func:`atomic_write` left in ``dirname`` by dead processes."""
    try:
        names = os.listdir(dirname)
    except OSError:
        return
    for name in names:
        m = _TEMP.match(name)
        if m and not _pid_alive(int(m.group(1))):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(dirname, name))


def _pwrite_all(fd: int, piece: Any, offset: int) -> None:
    view = memoryview(piece).cast("B")
    done = 0
    while done < view.nbytes:  # os.pwrite may write less than asked
        done += os.pwrite(fd, view[done:], offset + done)


def write_file(
    path: str, write_all: Callable[[Callable[[int, Any], None]], None], mode: int | None = None
) -> None:
    """Create the new file ``path`` (it must not exist), fill it and fsync it.

    ``write_all(place)`` produces the content by calling ``place(offset, piece)`` for pieces
    (bytes-like) that together cover the file; ``place`` may be called from several threads
    at once. ``mode``, if given, is set before any byte is written (otherwise the umask's
    default). A failure removes the file. Not atomic by itself: used for a temp file that is
    renamed afterwards (:func:`atomic_write`), or inside a folder that is swapped in whole
    (:func:`atomic_folder`).
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        try:
            if mode is not None:
                os.fchmod(fd, mode)
            write_all(lambda offset, piece: _pwrite_all(fd, piece, offset))
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise


def atomic_write(path: str, write_all: Callable[[Callable[[int, Any], None]], None]) -> None:
    """Write the file ``path`` atomically: temp file in the same folder, fsync, rename, fsync
    of the folder.

    ``write_all`` is as for :func:`write_file`. The new file keeps the permission bits of
    the file it replaces (set before any byte is written); a new file gets the default of
    the umask. A failure removes the temp file and leaves ``path`` as it was; temp files of
    dead writers in the folder are removed.
    """
    dirname = os.path.dirname(os.path.abspath(path))
    os.makedirs(dirname, exist_ok=True)
    try:
        mode: int | None = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        mode = None
    remove_stale_temps(dirname)
    tmp = os.path.join(dirname, f".coax_utils-{os.getpid()}-{secrets.token_hex(6)}.tmp")
    write_file(tmp, write_all, mode)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(dirname)


@contextlib.contextmanager
def open_regular_file(path: str, follow_links: bool = True) -> Iterator[tuple[int, int]]:
    """Open a file for reading; ValueError at once for a FIFO, a folder or a device (and,
    with ``follow_links=False``, for a symbolic link).

    The checks read the opened file itself, so a file swapped after them is never read.
    Yields the file descriptor and the file's size.
    """
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
    if not follow_links:
        if os.path.islink(path):
            raise ValueError(f"{path!r} is a symbolic link, not a regular file")
        flags |= getattr(os, "O_NOFOLLOW", 0)  # a link put in place since: ELOOP
    fd = os.open(path, flags)  # O_NONBLOCK: opening a FIFO does not wait for a writer
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path!r} is not a regular file")
        if hasattr(os, "O_NONBLOCK"):
            os.set_blocking(fd, True)
        yield fd, st.st_size
    finally:
        os.close(fd)


def lock_file(path: str, blocking: bool = True) -> int:
    """Open (creating it if needed) the lock file ``path`` and lock it exclusively.

    The file is opened without following links and must be a regular file (ValueError
    otherwise). With ``blocking=False`` a lock held by another open file raises
    :class:`BlockingIOError` at once; otherwise the call waits for it. Returns the file
    descriptor; closing it releases the lock (so does the death of the process).
    """
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
    flags |= getattr(os, "O_NONBLOCK", 0)  # a FIFO put there must not make open wait
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ValueError(f"lock file {path!r} is a symbolic link") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"lock file {path!r} is not a regular file")
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except BaseException:
        os.close(fd)
        raise
    return fd


def _folder_names(target: str) -> tuple[str, str, str]:
    parent, base = os.path.split(target)
    return parent, f".{base}.saving-", f".{base}.old-"


def _leftovers(target: str) -> tuple[dict[str, str], dict[str, str]]:
    """The folders of interrupted saves into ``target``: ``(staged, replaced)`` by token."""
    parent, saving, old = _folder_names(target)
    staged: dict[str, str] = {}
    replaced: dict[str, str] = {}
    try:
        names = os.listdir(parent)
    except FileNotFoundError:
        return staged, replaced
    for name in names:
        for prefix, found in ((saving, staged), (old, replaced)):
            if name.startswith(prefix):
                found[name[len(prefix) :]] = os.path.join(parent, name)
    return staged, replaced


def resolve_folder(target: str) -> str:
    """The folder a reader of ``target`` should open: ``target`` itself, or, where a save
    was killed between its two renames (the old folder moved away, the complete new one not
    yet moved in), that new folder."""
    if os.path.lexists(target):
        return target
    staged, replaced = _leftovers(target)
    tokens = sorted(set(staged) & set(replaced))
    return staged[tokens[-1]] if tokens else target


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        with contextlib.suppress(OSError):
            os.remove(path)


@contextlib.contextmanager
def atomic_folder(target: str) -> Iterator[str]:
    """Replace the folder ``target`` atomically with one the caller fills.

    Yields a new, empty folder beside ``target``; the caller writes (and fsyncs) its files
    there. When the block ends without an error, the folder is fsynced and swapped in with
    two renames (old ``target`` aside, new one in), the parent fsynced, and the old folder
    removed last. An error removes the new folder and leaves ``target`` as it was.

    The whole save holds an exclusive lock on ``target`` (a ``.<name>.lock`` file beside
    it): a concurrent save into the same folder waits for this one. Under the lock, a swap
    cut short by a killed writer is finished (its folder was complete) and every other
    leftover of dead writers is removed; the working folders of live saves are never
    touched. Readers use :func:`resolve_folder`.
    """
    target = os.path.abspath(target)
    parent, saving, old = _folder_names(target)
    os.makedirs(parent, exist_ok=True)
    lock = lock_file(os.path.join(parent, f".{os.path.basename(target)}.lock"))
    try:
        interrupted = resolve_folder(target)
        if interrupted != target:  # finish the swap of a killed save: it was complete
            os.rename(interrupted, target)
            fsync_dir(parent)
        staged, replaced = _leftovers(target)
        for leftover in [*staged.values(), *replaced.values()]:
            _remove(leftover)
        token = f"{time.time_ns():020d}-{os.getpid()}-{secrets.token_hex(4)}"
        staging = os.path.join(parent, saving + token)
        os.mkdir(staging)
        try:
            yield staging
            fsync_dir(staging)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        if os.path.lexists(target):
            aside = os.path.join(parent, old + token)
            os.rename(target, aside)
            os.rename(staging, target)
            fsync_dir(parent)
            _remove(aside)
        else:
            os.rename(staging, target)
        fsync_dir(parent)
    finally:
        os.close(lock)
