"""Page-aligned host buffers (anonymous ``mmap``), usable for O_DIRECT I/O.

An :class:`AlignedBuffer` exposes the same bytes as a numpy ``uint8`` array (for ``os.preadv``
/ ``os.pwritev``, which need buffer objects) and as a torch ``uint8`` tensor (for copies).

With ``pin=True`` (and CUDA present) the buffer is also page-locked and mapped into the GPU's
address space with ``cudaHostRegister``: the DMA engines and the device copy kernel
(:mod:`~kvstrata.physical.device_copy`) reach it directly, and it stays page aligned, which
torch's own pinned allocator does not promise (O_DIRECT needs 4 KiB alignment).
"""

from __future__ import annotations

import mmap
import weakref

import numpy as np
import torch

__all__ = ["PAGE_SIZE", "AlignedBuffer", "address_of", "CudaRegistrationError", "cuda_mapped",
           "pinned_if_possible"]

PAGE_SIZE = mmap.PAGESIZE
HUGE_PAGE_SIZE = 2 << 20


def address_of(array: np.ndarray) -> int:
    """Address of the first byte of a numpy array."""
    return int(array.ctypes.data)


class CudaRegistrationError(RuntimeError):
    """``cudaHostRegister`` refused a buffer (the driver's locked-memory limit, no CUDA)."""


_registered: dict[int, int] = {}     # start address -> bytes, of the buffers registered here


def cuda_mapped(address: int, nbytes: int) -> bool:
    """Whether ``[address, address + nbytes)`` lies in one buffer this module registered with
    CUDA (device-addressable at the same address)."""
    for start, size in list(_registered.items()):
        if start <= address and address + nbytes <= start + size:
            return True
    return False


CUDA_HOST_REGISTER_READ_ONLY = 8
"""``cudaHostRegisterReadOnly``: the device only reads the range (needed for memory mapped
without write permission)."""


def _cuda_register(address: int, size: int, flags: int = 0) -> None:
    # flags 0 = cudaHostRegisterDefault: with unified addressing (every 64-bit Linux CUDA
    # platform) the range is mapped for the device at the same address, and portable.
    code = int(torch.cuda.cudart().cudaHostRegister(address, size, flags))
    if code != 0:
        raise CudaRegistrationError(f"cudaHostRegister of {size} bytes failed with CUDA "
                                    f"error {code}")
    _registered[address] = size


def pinned_if_possible(size: int, **mapped) -> AlignedBuffer:
    """An :class:`AlignedBuffer` registered with CUDA, or, where the driver refuses (a
    locked-memory limit, say), an unregistered one with a warning: copies then go through
    a staging engine, slower but right. ``mapped``: :class:`AlignedBuffer`'s ``mapping``,
    ``offset`` and ``read_only``."""
    try:
        return AlignedBuffer(size, pin=True, **mapped)
    except CudaRegistrationError as exc:
        import warnings
        if torch.cuda.is_available():
            clear = getattr(torch.cuda.cudart(), "cudaGetLastError", None)
            if clear is not None:  # the refusal must not surface at an unrelated later call
                clear()
        warnings.warn(f"{exc}; host memory left unpinned (GPU copies will be staged)",
                      RuntimeWarning, stacklevel=2)
        return AlignedBuffer(size, **mapped)


def _cuda_unregister(address: int) -> None:
    _registered.pop(address, None)
    torch.cuda.cudart().cudaHostUnregister(address)


class AlignedBuffer:
    """``size`` bytes of page-aligned, pre-touched anonymous memory; ``pin``: also
    page-locked and mapped for CUDA (requires CUDA; see the module docstring).

    ``mapping``: the bytes are instead ``size`` bytes of that memory map (a shared file's,
    say) from ``offset`` (a multiple of :data:`PAGE_SIZE`); ``read_only``: the map was made
    without write permission (pages are pre-touched by reading, and pinned read-only)."""

    def __init__(self, size: int, *, huge_pages: bool = True, pin: bool = False,
                 mapping: mmap.mmap | None = None, offset: int = 0,
                 read_only: bool = False) -> None:
        if size < 1:
            raise ValueError(f"buffer size must be positive, got {size}")
        if offset % PAGE_SIZE:
            raise ValueError(f"buffer offset {offset} is not a multiple of {PAGE_SIZE}")
        self.size = size
        self.huge_pages = False
        if mapping is None:
            self._mmap = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if huge_pages and size >= HUGE_PAGE_SIZE and hasattr(mmap, "MADV_HUGEPAGE"):
                try:   # transparent huge pages: far fewer TLB misses on random block access
                    self._mmap.madvise(mmap.MADV_HUGEPAGE)
                    self.huge_pages = True
                except OSError:
                    pass
        else:
            self._mmap = mapping
        self.array: np.ndarray = np.frombuffer(self._mmap, dtype=np.uint8, count=size,
                                               offset=offset)
        # pre-touch every page: no faults on the data path
        if read_only:
            int(self.array[::PAGE_SIZE].max())
        else:
            self.array[::PAGE_SIZE] = 0 if mapping is None else self.array[::PAGE_SIZE]
        with _quiet():
            self.tensor: torch.Tensor = torch.frombuffer(self._mmap, dtype=torch.uint8,
                                                         count=size, offset=offset)
        self.pinned = False
        self._unpin = None
        if pin:
            if not torch.cuda.is_available():
                raise CudaRegistrationError("pinning a buffer needs CUDA")
            _cuda_register(self.address, size,
                           CUDA_HOST_REGISTER_READ_ONLY if read_only else 0)
            self.pinned = True
            # unregistered before the mapping goes, whoever drops the buffer last
            self._unpin = weakref.finalize(self, _cuda_unregister, self.address)

    def unpin(self) -> None:
        """Unregister from CUDA now (idempotent); the memory stays usable as host memory.
        The caller vouches that no device copy still reads or writes it."""
        if self._unpin is not None:
            self._unpin()
        self.pinned = False

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
