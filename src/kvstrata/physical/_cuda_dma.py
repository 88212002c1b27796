"""Batched DMA copies through the CUDA driver: ``cuMemcpyBatchAsync`` (CUDA 12.8 and later).

One call queues a whole list of (destination, source, size) copies on a stream; the GPU's copy
engines move them, so no streaming multiprocessor is taken from the engine's kernels (the
device copy kernel, :mod:`._triton_copy`, uses SMs). The lists are host arrays; every copy
shares one attribute set: sources read in stream order, and the driver's hint to overlap the
copies with compute.

The driver is reached with ctypes, so nothing is compiled; where the symbol is missing (an
older driver) :data:`DMA_ERROR` says so and callers use the kernel. The CUDA 13 entry point
(``cuMemcpyBatchAsync_v2``) has no ``failIdx`` argument; the 12.8 one has.
"""

from __future__ import annotations

import ctypes

import numpy as np

__all__ = ["memcpy_batch", "DmaRefused", "DMA_ERROR"]


class DmaRefused(RuntimeError):
    """The driver refused a batch of copies outright (nothing of it was queued), or has no
    batched copies at all."""


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _MemLocation),
                ("dstLocHint", _MemLocation), ("flags", ctypes.c_uint)]


_SRC_ACCESS_ORDER_STREAM = 1            # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
_FLAG_PREFER_OVERLAP_WITH_COMPUTE = 1   # CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
_u64p = ctypes.POINTER(ctypes.c_uint64)
_sizep = ctypes.POINTER(ctypes.c_size_t)


def _load():
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        return None, False, f"no CUDA driver library ({exc})"
    version = ctypes.c_int(0)
    if lib.cuDriverGetVersion(ctypes.byref(version)) != 0 or version.value < 12080:
        return None, False, f"CUDA driver {version.value} has no batched copies (12.8+)"
    for name, with_fail_index in (("cuMemcpyBatchAsync_v2", False), ("cuMemcpyBatchAsync", True)):
        fn = getattr(lib, name, None)
        if fn is None:
            continue
        fn.restype = ctypes.c_int
        fn.argtypes = ([_u64p, _u64p, _sizep, ctypes.c_size_t,
                        ctypes.POINTER(_MemcpyAttributes), _sizep, ctypes.c_size_t]
                       + ([_sizep] if with_fail_index else []) + [ctypes.c_void_p])
        return fn, with_fail_index, None
    return None, False, "the CUDA driver exports no cuMemcpyBatchAsync"


_batch, _FAIL_INDEX, DMA_ERROR = _load()
_driver = ctypes.CDLL("libcuda.so.1") if _batch is not None else None


def _ensure_context(device_index: int) -> None:
    """Make the device's primary context (the one the CUDA runtime and torch use) current on
    this thread: a driver call in a thread that made no runtime call would find none."""
    current = ctypes.c_void_p()
    if _driver.cuCtxGetCurrent(ctypes.byref(current)) == 0 and current.value:
        return
    device = ctypes.c_int()
    context = ctypes.c_void_p()
    for code in (_driver.cuDeviceGet(ctypes.byref(device), device_index),
                 _driver.cuDevicePrimaryCtxRetain(ctypes.byref(context), device),
                 _driver.cuCtxSetCurrent(context)):
        if code != 0:
            raise DmaRefused(f"no CUDA context for device {device_index} (driver error {code})")
_ATTRIBUTES = _MemcpyAttributes(_SRC_ACCESS_ORDER_STREAM, _MemLocation(0, 0), _MemLocation(0, 0),
                                _FLAG_PREFER_OVERLAP_WITH_COMPUTE)
_FIRST = (ctypes.c_size_t * 1)(0)


def memcpy_batch(dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int,
                 device_index: int = 0) -> None:
    """Queue ``sizes[i]`` bytes from ``srcs[i]`` to ``dsts[i]`` for every ``i`` on the CUDA
    ``stream`` (a ``cudaStream_t`` handle of device ``device_index``), in any order within
    the batch. Addresses are
    device pointers or host memory the device can address (registered or pinned). Raises
    :class:`DmaRefused` with the driver's error code, having queued nothing, if it refuses."""
    if _batch is None:
        raise DmaRefused(f"batched DMA unavailable: {DMA_ERROR}")
    dsts = np.ascontiguousarray(dsts, dtype=np.uint64)
    srcs = np.ascontiguousarray(srcs, dtype=np.uint64)
    sizes = np.ascontiguousarray(sizes, dtype=np.uint64)   # size_t on 64-bit Linux
    if not dsts.size:
        return
    _ensure_context(device_index)
    args = [dsts.ctypes.data_as(_u64p), srcs.ctypes.data_as(_u64p),
            sizes.ctypes.data_as(_sizep), dsts.size, ctypes.byref(_ATTRIBUTES), _FIRST, 1]
    if _FAIL_INDEX:
        failed_at = ctypes.c_size_t(0)
        args.append(ctypes.byref(failed_at))
    code = _batch(*args, ctypes.c_void_p(stream))
    if code != 0:
        raise DmaRefused(f"cuMemcpyBatchAsync of {dsts.size} copies failed with CUDA "
                           f"driver error {code}")
