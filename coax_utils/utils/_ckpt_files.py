"""Files of checkpoints: atomic replacement, kept permissions, no temp litter, safe opening."""

from __future__ import annotations

import _thread
import collections
import contextlib
import errno
import mmap
import os
import queue
import re
import secrets
import stat
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["as_path", "atomic_write", "fsync_dir"]

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
    leaves ``path`` as it was; temp files of killed writers are removed too. The blocks of a
    large file replaced are freed on a thread after the call returns.
    """
    dirname = os.path.dirname(os.path.abspath(path))
    os.makedirs(dirname, exist_ok=True)
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        mode = 0o666 & ~_umask()
    remove_stale_temps(dirname)
    _close_replaced()  # files replaced by earlier dumps: freed before this one needs room
    tmp = temp_name(dirname)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    old = None
    try:
        try:
            writer = _DirectWriter.start(fd)
            if writer is not None:
                with writer:
                    write_all(writer.place)
                    writer.finish()
            else:
                write_all(lambda offset, piece: _place(fd, offset, piece))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.chmod(tmp, mode)
        old = _open_replaced(path)
        os.replace(tmp, path)
        fsync_dir(dirname)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if old is not None:
            _close_replaced([old])
        raise
    if old is not None:
        _close_later(old)


# Replaced files held open (see _open_replaced), each closed once: by its thread, by the next
# dump, or in a forked child right after the fork (a child must not keep the file's blocks).
_FREE_LATER_BYTES = 16 << 20
_replaced: set[int] = set()
_replaced_lock = threading.Lock()


def _open_replaced(path: str) -> int | None:
    """A descriptor of the large regular file that replacing ``path`` will unlink, or None.

    While it is open the rename only unlinks the file; its blocks are freed when the
    descriptor is closed (tens of ms for a few hundred MB on ext4), which
    :func:`_close_later` does off the caller's path.
    """
    if os.name == "nt" or not hasattr(os, "O_NOFOLLOW"):
        return None
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return None  # opening a device or a FIFO may do things; a link frees nothing
        with _replaced_lock:
            old = os.open(path, flags)
            _replaced.add(old)
    except OSError:
        return None  # no file, or one not readable: replaced the ordinary way
    st = os.fstat(old)
    if stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_size >= _FREE_LATER_BYTES:
        return old
    _close_replaced([old])
    return None


def _close_replaced(fds: list[int] | None = None) -> None:
    """Close those of ``fds`` (default: all) still held; each descriptor is closed once."""
    with _replaced_lock:
        for fd in list(_replaced) if fds is None else fds:
            if fd in _replaced:
                _replaced.discard(fd)
                with contextlib.suppress(OSError):
                    os.close(fd)


def _close_later(fd: int) -> None:
    """Close ``fd`` on a short-lived thread (the next dump closes it where none starts).

    A bare thread (no start-up handshake that an interrupt could cut short)."""
    with contextlib.suppress(RuntimeError):
        _thread.start_new_thread(_close_replaced, ([fd],))


def _after_fork_in_child() -> None:
    for fd in _replaced:  # the threads that would close them do not exist here
        with contextlib.suppress(OSError):
            os.close(fd)
    _replaced.clear()
    _replaced_lock.release()  # taken by the forking thread, which is this one


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=lambda: _replaced_lock.acquire(),
        after_in_parent=lambda: _replaced_lock.release(),
        after_in_child=_after_fork_in_child,
    )


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """Write all of ``view`` at ``offset`` (``os.pwrite`` may write less than asked)."""
    done = 0
    while done < view.nbytes:
        done += os.pwrite(fd, view[done:], offset + done)


def _place(fd: int, offset: int, piece: Any) -> None:
    """Write ``piece`` at ``offset`` of the file (``os.pwrite``: safe from several threads)."""
    view = memoryview(piece).cast("B")
    _pwrite_all(fd, view, offset)
    if view.nbytes >= 1 << 20 and hasattr(os, "posix_fadvise"):
        # Start write-back of what is written, so the disk works while the next chunks
        # are compressed; the final fsync has less left to do.
        with contextlib.suppress(OSError):  # a hint only
            os.posix_fadvise(fd, offset, view.nbytes, os.POSIX_FADV_DONTNEED)


class _DirectWriter:
    """Writes a file with direct I/O (``O_DIRECT``) from pieces placed at any offsets.

    The pieces (given from several threads, in any order, together covering the file from
    0) are copied in file order into page-aligned staging blocks, and a thread of its own
    writes each full block straight to the disk while the next chunks are compressed.
    Direct I/O skips the copy into the page cache, whose cost grows with what other writers
    left there. The last block is padded to the alignment, written, and the file cut to its
    size. A file system that takes ``O_DIRECT`` but refuses its writes (``EINVAL``) gets
    the rest written buffered. Memory: the block being filled, ``QUEUE`` full blocks
    waiting, one being written, and at most two per placing thread that waits for room in
    the queue (placing waits for the disk).

    Use as a context manager: leaving it stops the thread, after an error too.
    """

    ALIGN = 4096  # a multiple of every logical block size direct I/O asks for here
    BLOCK = 4 << 20
    QUEUE = 2

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._lock = threading.Lock()
        self._pending: dict[int, Any] = {}  # offset -> piece not yet staged
        self._size = 0  # bytes staged so far
        # blocks written, to fill again: the writer thread appends without taking the lock
        # (an interrupted placing thread can never leave it waiting), placing threads pop
        self._free: collections.deque[mmap.mmap] = collections.deque()
        self._block = mmap.mmap(-1, self.BLOCK)  # page-aligned
        self._fill = 0
        self._queue: queue.Queue = queue.Queue(self.QUEUE)
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._drain, name="checkpoint-writer", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, fd: int) -> _DirectWriter | None:
        """A writer for ``fd`` (opened for buffered writes), switched to direct I/O; None,
        with ``fd`` left buffered, where the file system refuses direct I/O (e.g. ramfs) or
        no thread can start (a dump from an ``atexit`` handler while the interpreter exits).
        """
        if not hasattr(os, "O_DIRECT"):
            return None
        try:
            _set_direct(fd, True)
        except OSError:
            return None
        try:
            return cls(fd)
        except RuntimeError:
            _set_direct(fd, False)
            return None

    def __enter__(self) -> _DirectWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        # one attribute store first: the thread ends even if an interrupt stops the rest
        self._closed = True
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)
        self._thread.join()

    def place(self, offset: int, piece: Any) -> None:
        full = []
        with self._lock:
            self._pending[offset] = piece
            while self._size in self._pending:
                view = memoryview(self._pending.pop(self._size)).cast("B")
                while view.nbytes:
                    n = min(view.nbytes, self.BLOCK - self._fill)
                    self._block[self._fill : self._fill + n] = view[:n]
                    self._fill += n
                    self._size += n
                    view = view[n:]
                    if self._fill == self.BLOCK:
                        full.append((self._block, self.BLOCK, self._size - self.BLOCK))
                        self._block = self._free.pop() if self._free else mmap.mmap(-1, self.BLOCK)
                        self._fill = 0
        for job in full:
            self._check()
            self._queue.put(job)

    def finish(self) -> None:
        """Write the last, partial block, wait for the disk and cut the file to its size."""
        if self._pending:
            raise RuntimeError("checkpoint pieces do not cover the file")  # a bug, not input
        if self._fill:
            n = -(-self._fill // self.ALIGN) * self.ALIGN
            self._block[self._fill : n] = bytes(n - self._fill)
            self._queue.put((self._block, n, self._size - self._fill))
        self._queue.put(None)
        self._thread.join()
        self._check()
        os.ftruncate(self._fd, self._size)

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def _drain(self) -> None:
        while True:
            try:
                job = self._queue.get(timeout=0.05)
            except queue.Empty:
                if self._closed:
                    return
                continue
            if job is None:
                return
            block, n, offset = job
            if self._error is None and not self._closed:  # closed: a dump that failed
                try:
                    self._write(block, n, offset)
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        self._error = e
                    else:  # direct I/O set but its writes refused: write buffered
                        try:
                            _set_direct(self._fd, False)
                            self._write(block, n, offset)
                        except BaseException as e2:
                            self._error = e2
                except BaseException as e:  # raised in the placing threads
                    self._error = e
            self._free.append(block)

    def _write(self, block: mmap.mmap, n: int, offset: int) -> None:
        with memoryview(block) as view:
            _pwrite_all(self._fd, view[:n], offset)


def _set_direct(fd: int, on: bool) -> None:
    """Switch ``fd`` to direct (``on``) or buffered writes; OSError where refused."""
    import fcntl

    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT if on else flags & ~os.O_DIRECT)
