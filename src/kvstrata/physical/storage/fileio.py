"""The operating-system calls the disk backend makes, as one small overridable object.

:class:`FileOps` is the seam for fault injection: a test subclasses it and makes
``pwritev`` raise ``OSError(errno.ENOSPC, ...)`` or ``preadv`` raise ``EIO`` for chosen offsets,
then passes it as ``DiskStorage(..., file_ops=...)``. Production code uses the default.
"""

from __future__ import annotations

import os
from typing import Sequence

__all__ = ["FileOps"]


class FileOps:
    """Thin wrappers over ``os`` file calls (positional I/O only; no shared file offset)."""

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        return os.open(path, flags, mode)

    def close(self, fd: int) -> None:
        os.close(fd)

    def pwritev(self, fd: int, buffers: Sequence, offset: int) -> int:
        return os.pwritev(fd, buffers, offset)

    def preadv(self, fd: int, buffers: Sequence, offset: int) -> int:
        return os.preadv(fd, buffers, offset)

    def fallocate(self, fd: int, offset: int, length: int) -> None:
        os.posix_fallocate(fd, offset, length)

    def ftruncate(self, fd: int, length: int) -> None:
        os.ftruncate(fd, length)

    def unlink(self, path: str) -> None:
        os.unlink(path)
