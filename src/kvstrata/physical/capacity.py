"""What this machine can hold: physical memory and free disk space, for size checks made
before anything is allocated (a tier no machine can hold is a configuration error, not a
``MemoryError`` or ``ENOSPC`` later)."""

from __future__ import annotations

import os
import shutil

__all__ = ["physical_memory", "free_disk_bytes"]


def physical_memory() -> int:
    """Bytes of RAM on this machine (0 if the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def free_disk_bytes(directory: str | os.PathLike) -> int | None:
    """Free bytes of the filesystem ``directory`` is on, or would be created on (its nearest
    existing parent); None if it cannot be told."""
    path = os.path.abspath(os.fspath(directory))
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None
