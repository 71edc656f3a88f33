"""Opening files read from disk, which may be hostile: one shared helper."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator

__all__ = ["open_regular_file"]


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
