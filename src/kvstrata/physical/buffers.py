"""Page-aligned host buffers (anonymous ``mmap``), usable for O_DIRECT I/O.

An :class:`AlignedBuffer` exposes the same bytes as a numpy ``uint8`` array (for ``os.preadv``
/ ``os.pwritev``, which need buffer objects) and as a torch ``uint8`` tensor (for copies).
"""

from __future__ import annotations

import mmap

import numpy as np
import torch

__all__ = ["PAGE_SIZE", "AlignedBuffer", "address_of"]

PAGE_SIZE = mmap.PAGESIZE
HUGE_PAGE_SIZE = 2 << 20


def address_of(array: np.ndarray) -> int:
    """Address of the first byte of a numpy array."""
    return int(array.ctypes.data)


class AlignedBuffer:
    """``size`` bytes of page-aligned, pre-touched anonymous memory."""

    def __init__(self, size: int, *, huge_pages: bool = True) -> None:
        if size < 1:
            raise ValueError(f"buffer size must be positive, got {size}")
        self.size = size
        self._mmap = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.huge_pages = False
        if huge_pages and size >= HUGE_PAGE_SIZE and hasattr(mmap, "MADV_HUGEPAGE"):
            try:   # transparent huge pages: far fewer TLB misses on random block access
                self._mmap.madvise(mmap.MADV_HUGEPAGE)
                self.huge_pages = True
            except OSError:
                pass
        self.array: np.ndarray = np.frombuffer(self._mmap, dtype=np.uint8)
        self.array[::PAGE_SIZE] = 0   # pre-touch every page: no faults on the data path
        with _quiet():
            self.tensor: torch.Tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)

    @property
    def address(self) -> int:
        """Address of the first byte (a multiple of :data:`PAGE_SIZE`)."""
        return address_of(self.array)


class _quiet:
    """Silence torch's one-time 'non-writable buffer' style warnings during frombuffer."""

    def __enter__(self):
        import warnings
        self._ctx = warnings.catch_warnings()
        self._ctx.__enter__()
        warnings.simplefilter("ignore", UserWarning)

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)
