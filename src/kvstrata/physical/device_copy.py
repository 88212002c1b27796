"""The GPU data path: blocks between CUDA memory and host memory the GPU can address.

:class:`DeviceCopyEngine` moves a batch of blocks between G1 (the engine's KV tensors, in any
layout :class:`~kvstrata.physical.storage.device.DeviceStorage` wraps) and host memory that is
registered with CUDA (G2, the transfer engine's bounce buffer), with **one launch per slice of
a batch**: every piece of every block is a row of two offset arrays, and a Triton kernel
copies the pieces (:mod:`._triton_copy`), reading or writing the host side through its
device-visible address. No packed intermediate buffer, no second copy on the CPU, no DMA call
per piece. ``transport="dma"`` queues the same pieces on the GPU's copy engines instead, one
``cuMemcpyBatchAsync`` per slice (:mod:`._cuda_dma`).

* **Plan** (:mod:`.device_plan`, pure numpy, checked on CPU): the batch as equal pieces,
  addressed from one base region per side in 16-byte units where possible. Each kernel
  program copies a group of consecutive pieces, the grid near the device's SM count
  (``programs``).
* **Slices**: a batch is queued in slices of ``slice_bytes`` (the first and last an eighth of
  that), so the GPU copies the first slice while the next ones are planned.
* **Streams**: each direction has its own CUDA stream (onboard at high priority: the engine's
  next forward waits for it); the engine's compute stream is never used, and the calling
  thread waits on a blocking event (sleeping).
* **Integrity at copy speed: device checksums.** :meth:`copy_summed` also computes, on the
  GPU, each block's *device checksum*
  (:func:`~kvstrata.physical.checksum.device_checksum`: the sum of a 64-bit mix of every
  word with its position), by the copy kernel from the words it moves or, with DMA, by a
  kernel over the device side after the copy. The transfer engine records it with the G2
  slot on an offload and compares it on an onboard, so the bytes checked are the bytes that
  arrived in G1, and no host thread reads the bytes. Host reads of G2 (a store to G3, a
  peer's export) check it natively first. :meth:`copy_hashed` / :meth:`copy_checked` are the
  xxh3 forms (hashing on ``hash_threads`` host threads, overlapped slice by slice), used for
  slots that have no device checksum.
* **Self-test**: before first use on a device, each transport copies random bytes to
  registered host memory and back in reversed pieces; one that fails is not used
  (:attr:`DeviceCopyEngine.kernel_error` says why).

Memory the GPU cannot address (pageable host memory, or host <-> host) goes to the
``fallback`` engine (:class:`~kvstrata.physical.copy.StagedCopyEngine` by default). With
``interpret=True`` the kernels run on CPU tensors under Triton's interpreter: what tests
without a GPU use to check the plan, the kernels and the checksums byte for byte.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
import weakref
from typing import Callable

import numpy as np
import torch

from ..protocol.layout import FullyContiguousLayout, LayoutConfig
from .buffers import AlignedBuffer, cuda_mapped
from .checksum import device_checksum, memory_checksums
from .copy import OFFLOAD, ONBOARD, CopyEngine, StagedCopyEngine
from .device_plan import DevicePiecePlan, plan_device_pieces
from .device_staging import StagingRing, host_runs
from .storage.base import BlockMemory

__all__ = ["DeviceCopyEngine", "device_kernel_status", "device_kernels", "TRANSPORTS"]


@functools.cache
def device_kernels():
    """``(module, None)`` with the Triton kernels (:mod:`._triton_copy`), or ``(None, why
    not)``. Imported on first use, not with kvstrata: Triton takes a second and tens of MiB
    to import, and a CPU-only process never needs it."""
    try:
        from . import _triton_copy
    except Exception as exc:   # not installed, or a Triton that does not import here
        return None, f"Triton unavailable ({type(exc).__name__}: {exc})"
    return _triton_copy, None


def device_kernel_status() -> dict:
    """Whether the device copy kernel can run: ``{"available": bool, "reason": str|None}``
    (``available`` needs Triton and CUDA)."""
    kernels, error = device_kernels()
    if kernels is None:
        return {"available": False, "reason": error}
    if not torch.cuda.is_available():
        return {"available": False, "reason": "no CUDA device"}
    return {"available": True, "reason": None}


def _element(unit_bytes: int) -> tuple[torch.dtype, int]:
    """The element type the kernel moves and how many make one unit."""
    if unit_bytes >= 4:
        return torch.int32, unit_bytes // 4
    return (torch.int16, 1) if unit_bytes == 2 else (torch.uint8, 1)


def _typed_start(region: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A ``dtype`` tensor whose data pointer is ``region``'s first byte (the kernel's base;
    it addresses past the tensor's nominal size, within the memory the offsets name)."""
    size = torch.empty(0, dtype=dtype).element_size()
    offset = region.storage_offset()     # uint8: in bytes
    view = torch.empty(0, dtype=dtype, device=region.device)
    storage = region.untyped_storage()
    view.set_(storage, offset // size, (max(1, (storage.nbytes() - offset) // size),), (1,))
    return view


def _mapped_host(memory: BlockMemory) -> bool:
    """Whether every region of a host memory is registered with CUDA by kvstrata or pinned
    by torch (and so addressable by the kernel); cached per memory (its regions never
    change)."""
    cached = memory.__dict__.get("_device_addressable")
    if cached is None:
        cached = all(cuda_mapped(r.data_ptr(), r.numel()) or r.is_pinned()
                     for r in memory.regions)
        object.__setattr__(memory, "_device_addressable", cached)
    return cached


TRANSPORTS = ("kernel", "dma", "staged")
_DMA_BATCH = 8192          # copies per cuMemcpyBatchAsync call


class DeviceCopyEngine(CopyEngine):
    """Device <-> host copies on the GPU (see the module docstring).

    ``transport``: ``"kernel"`` (the default: the Triton copy kernel moves the bytes through
    streaming multiprocessors) or ``"dma"`` (the GPU's copy engines through
    ``cuMemcpyBatchAsync``, with a kernel only to compute device checksums in device memory:
    it holds no SM while bytes cross PCIe and overlaps a forward far better, but measured
    0.4-0.8 of the DMA limit for 32-64 KiB pieces and under 0.1 for 8-18 KiB pieces on an
    H200, so it is opt-in); a transport that fails its self-test on a device falls back to
    the other, then to ``fallback``. ``programs``: the grid the kernel aims at (default: the
    device's SM count); each program copies a group of consecutive pieces."""

    name = "device"

    def __init__(self, *, fallback: CopyEngine | None = None, interpret: bool = False,
                 transport: str = "kernel", slice_bytes: int = 32 << 20,
                 max_piece_bytes: int = 64 << 10, block_elements: int = 4096,
                 num_warps: int = 4, programs: int | None = None,
                 hash_threads: int | None = None, device_checksums: bool = True) -> None:
        kernels, error = device_kernels()
        if kernels is None:
            raise RuntimeError(f"device copy kernel unavailable: {error}")
        if not interpret and not torch.cuda.is_available():
            raise RuntimeError("device copy kernel unavailable: no CUDA device")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if interpret and transport == "dma":
            raise ValueError("Triton's interpreter runs the kernel transport only")
        if block_elements < 1 or block_elements & (block_elements - 1):
            raise ValueError(f"block_elements must be a power of two, got {block_elements}")
        from .storage.host import default_hash_threads
        self.interpret = interpret
        self.transport = transport
        self._kernel = kernels.interpreted() if interpret else kernels.copy_pieces
        self._summed_kernel = (kernels.interpreted(summed=True) if interpret
                               else kernels.copy_pieces_summed)
        self.fallback = fallback if fallback is not None else StagedCopyEngine()
        self.slice_bytes = slice_bytes
        self.max_piece_bytes = max_piece_bytes
        self.block_elements = block_elements
        self.num_warps = num_warps
        self.programs = programs
        self.hash_threads = default_hash_threads() if hash_threads is None else hash_threads
        self.device_checksums = device_checksums
        self._streams: dict[tuple[str, torch.device], torch.cuda.Stream] = {}
        self._lock = threading.Lock()
        self._rings: dict[tuple[str, torch.device], StagingRing] = {}
        self._transports: dict[torch.device, str | None] = {}   # what passed the self-test
        self.kernel_error: str | None = None   # why a transport failed its self-test

    @property
    def kernel(self) -> str:
        """The host copy kernel of the fallback (host <-> host copies run there)."""
        return self.fallback.kernel

    def transport_on(self, device: torch.device | str) -> str | None:
        """The transport in use on ``device`` after its self-test (None: the fallback)."""
        device = torch.device(device)
        if self.interpret:
            return "kernel"
        if device.index is None:     # the key a memory's device has
            device = torch.device(device.type, torch.cuda.current_device())
        return self._self_test(device)

    # ------------------------------------------------------------------ public API
    def handles(self, src: BlockMemory, dst: BlockMemory) -> bool:
        """Whether this engine copies the pair on the GPU (else :attr:`fallback` does)."""
        if self.interpret:
            return src.device.type == "cpu" and dst.device.type == "cpu"
        kinds = {src.device.type, dst.device.type}
        if "cuda" not in kinds or not kinds <= {"cuda", "cpu"}:
            return False
        if src.device.type == dst.device.type == "cuda" and src.device != dst.device:
            return False
        if not all(_mapped_host(m) for m in (src, dst) if m.device.type == "cpu"):
            return False
        transport = self._self_test(self._device_of(src, dst))
        if transport == "staged" and "cpu" in kinds:   # the host side must be one run of
            return self._host_side(src, dst, OFFLOAD) is not None   # slots (G2 is)
        return transport is not None

    def copy(self, src, src_ids, dst, dst_ids, *, direction=OFFLOAD) -> int:
        if not self.handles(src, dst):
            return self.fallback.copy(src, src_ids, dst, dst_ids, direction=direction)
        # slice by slice: the GPU copies the first slice while the next ones are planned
        with self._queued() as launches:
            for lo, hi in self._slices(len(src_ids), src.layout.config.block_bytes):
                launches.append(self._launch(src, src_ids[lo:hi], dst, dst_ids[lo:hi],
                                             direction))
        return len(src_ids) * src.layout.config.block_bytes

    def summable(self, src: BlockMemory, dst: BlockMemory) -> bool:
        """Whether :meth:`copy_summed` can copy this pair: device checksums are on
        (``device_checksums``), the GPU copies the pair and every piece is 8-byte aligned
        (any real KV geometry; odd test geometries are not)."""
        if (not self.device_checksums or not self.handles(src, dst)
                or src.layout.config.block_bytes % 8):
            return False
        cache = src.__dict__.setdefault("_summable", {})   # BlockMemory is frozen: a cache
        known = cache.get(id(dst))
        if known is None or known[0]() is not dst:           # an id can be reused
            ids = [0, 1] if min(src.layout.config.num_blocks,
                                dst.layout.config.num_blocks) > 1 else [0]
            known = cache[id(dst)] = (weakref.ref(dst),
                                      plan_device_pieces(src, ids, dst, ids).unit_bytes >= 8)
        return known[1]

    def copy_summed(self, src, src_ids, dst, dst_ids, *,
                    direction=OFFLOAD) -> np.ndarray | None:
        """Copy the batch and return the device checksum
        (:func:`~kvstrata.physical.checksum.device_checksum`) of every block's bytes
        (``uint64`` array), computed on the GPU: by the copy kernel while they pass, or,
        with DMA, by a kernel over the device side after the copy (the bytes that arrived,
        on an onboard). No host pass over the bytes. None, copying nothing, where
        :meth:`summable` says no."""
        if not self.summable(src, dst):
            return None
        with self._queued() as launches:
            for lo, hi in self._slices(len(src_ids), src.layout.config.block_bytes):
                launches.append(self._launch(src, src_ids[lo:hi], dst, dst_ids[lo:hi],
                                             direction, summed=True))
        sums = [launch.block_sums() for launch in launches if launch is not None]
        return np.concatenate(sums) if sums else np.zeros(0, dtype=np.uint64)

    def copy_hashed(self, src, src_ids, dst, dst_ids, *, direction=OFFLOAD,
                    slice_bytes: int = 8 << 20, from_source: bool = False) -> list[int]:
        """:meth:`CopyEngine.copy_hashed` with the hashing overlapped: the batch is queued
        slice by slice (``self.slice_bytes``; ``slice_bytes`` is the fallback's), and each
        slice's destination blocks are hashed (xxh3) on host threads as soon as it landed,
        while the next slices copy."""
        if from_source or not self.handles(src, dst) or dst.device.type != "cpu":
            return self.fallback.copy_hashed(src, src_ids, dst, dst_ids, direction=direction,
                                             slice_bytes=slice_bytes, from_source=from_source)
        if not isinstance(dst.layout, FullyContiguousLayout):
            raise ValueError("copy_hashed needs a FullyContiguous destination")
        bounds = self._slices(len(src_ids), src.layout.config.block_bytes)
        base = int(dst.base_addresses()[0])
        stride, nbytes = dst.layout.block_stride, dst.layout.config.block_bytes
        ids = np.asarray(dst_ids, dtype=np.int64)
        sums: list[int] = []
        with self._queued() as launches:
            for lo, hi in bounds:   # all queued: the GPU copies while this thread hashes
                launches.append(self._launch(src, src_ids[lo:hi], dst, dst_ids[lo:hi],
                                             direction))
            for (lo, hi), launch in zip(bounds, launches):
                self._wait(launch)
                sums.extend(memory_checksums(base + ids[lo:hi] * stride, nbytes,
                                             threads=self.hash_threads).tolist())
        return sums

    def copy_checked(self, src, src_ids, dst, dst_ids, check: Callable[[int, int], list[int]],
                     *, direction=ONBOARD, slice_bytes: int = 8 << 20) -> list[int]:
        """:meth:`CopyEngine.copy_checked`, slice by slice (``self.slice_bytes``;
        ``slice_bytes`` is the fallback's): ``check`` of the next slice runs on this thread
        while the GPU copies the slice before."""
        if not self.handles(src, dst):
            return self.fallback.copy_checked(src, src_ids, dst, dst_ids, check,
                                              direction=direction, slice_bytes=slice_bytes)
        good: list[int] = []
        with self._queued() as launches:
            for lo, hi in self._slices(len(src_ids), src.layout.config.block_bytes):
                passed = check(lo, hi)
                if passed:
                    launches.append(self._launch(src, [src_ids[p] for p in passed], dst,
                                                 [dst_ids[p] for p in passed], direction))
                    good.extend(passed)
        return good

    @contextlib.contextmanager
    def _queued(self):
        """A list to put this call's launches in; on leaving, however it is left (a check
        or a later slice raising included), every launch queued is waited for, so no copy
        lands after the call has returned or failed."""
        launches: list = []
        try:
            yield launches
        finally:
            for launch in launches:   # one stream: in order
                self._wait(launch)

    def close(self) -> None:
        self.fallback.close()

    # ------------------------------------------------------------------ self-test
    def _self_test(self, device: torch.device) -> str | None:
        """Once per device: the requested transport, else the other, copies random bytes
        between registered host memory and the device in reversed 4 KiB pieces, both ways;
        the first that moves them right is used, and what failed is kept in
        :attr:`kernel_error` (None returned: every copy goes to the fallback)."""
        with self._lock:
            if device in self._transports:
                return self._transports[device]
        errors = []
        chosen = None
        for transport in (self.transport, *(t for t in TRANSPORTS if t != self.transport)):
            error = self._try_transport(transport, device)
            if error is None:
                chosen = transport
                break
            errors.append(f"{transport}: {error}")
        with self._lock:
            self._transports[device] = chosen
            self.kernel_error = "; ".join(errors) or None
        return chosen

    def _try_transport(self, transport: str, device: torch.device) -> str | None:
        """Why ``transport`` cannot be used on ``device`` (None: it can). It moves random
        bytes host -> device and back in reversed pieces, the way back with device
        checksums (the 16 pieces as one block), and compares bytes and checksum."""
        if transport == "staged":
            return self._try_staged(device)
        try:
            host = AlignedBuffer(1 << 16, pin=True)
            expected = torch.randint(0, 256, (16, 4096), dtype=torch.uint8)
            host.tensor.copy_(expected.reshape(-1))
            device_side = torch.zeros(1 << 16, dtype=torch.uint8, device=device)
            forward = np.arange(16, dtype=np.int64) * 256             # 4 KiB runs, in units
            reverse = DevicePiecePlan(0, 0, forward[::-1].copy(), forward, 16, 4096)
            # a stream of our own: batched DMA refuses the legacy default stream
            stream = self._stream(ONBOARD, device)
            with torch.cuda.device(device), torch.cuda.stream(stream):
                self._queue(transport, host.tensor, device_side, reverse, 0, device, stream,
                            fall_back=False)
            torch.cuda.synchronize(device)
            if not torch.equal(device_side.cpu().view(16, 4096), expected.flip(0)):
                return "its self-test read wrong bytes from host memory"
            host.tensor.zero_()
            with torch.cuda.device(device), torch.cuda.stream(stream):
                launch = self._queue(transport, device_side, host.tensor, reverse, 16, device,
                                     stream, fall_back=False)
            torch.cuda.synchronize(device)
            if not torch.equal(host.tensor.view(16, 4096), expected):
                return "its self-test wrote wrong bytes to host memory"
            if launch.block_sums().tolist() != [device_checksum(expected.numpy())]:
                return "its self-test computed a wrong device checksum"
            host.unpin()
            return None
        except Exception as exc:      # noqa: BLE001 - any failure means: do not use it
            return f"{type(exc).__name__}: {exc}"

    def _try_staged(self, device: torch.device) -> str | None:
        """The staged transport's self-test: 16 random 4 KiB blocks from registered host
        memory to the device in runs of consecutive and reversed slots, and back to other
        slots with device checksums, compared block by block."""
        try:
            layout = FullyContiguousLayout(LayoutConfig(num_blocks=16, num_layers=1,
                                                        outer_dim=1, page_size=16,
                                                        inner_dim=128, dtype="bfloat16"))
            host = AlignedBuffer(1 << 16, pin=True)
            expected = torch.randint(0, 256, (16, 4096), dtype=torch.uint8)
            host.tensor.copy_(expected.reshape(-1))
            host_memory = BlockMemory(layout, (host.tensor,))
            device_memory = BlockMemory(layout, (torch.zeros(1 << 16, dtype=torch.uint8,
                                                             device=device),))
            slots = [4, 5, 6, 7, 0, 1, 2, 3, 15, 14, 13, 12, 8, 9, 10, 11]
            here = list(range(16))
            launch = self._launch_staged(host_memory, slots, device_memory, here, ONBOARD,
                                         False, device, fall_back=False)
            self._wait(launch)
            if not torch.equal(device_memory.regions[0].cpu().view(16, 4096), expected[slots]):
                return "its self-test read wrong bytes from host memory"
            host.tensor.zero_()
            back = slots[::-1]
            launch = self._launch_staged(device_memory, here, host_memory, back, OFFLOAD,
                                         True, device, fall_back=False)
            self._wait(launch)
            if not torch.equal(host.tensor.view(16, 4096)[back], expected[slots]):
                return "its self-test wrote wrong bytes to host memory"
            if launch.block_sums().tolist() != [device_checksum(b) for b in
                                                expected[slots].numpy()]:
                return "its self-test computed a wrong device checksum"
            host.unpin()
            return None
        except Exception as exc:      # noqa: BLE001 - any failure means: do not use it
            return f"{type(exc).__name__}: {exc}"

    # ------------------------------------------------------------------ internals
    def _slices(self, n: int, block_bytes: int) -> list[tuple[int, int]]:
        """Batch positions cut into slices of about ``slice_bytes``, the first and the last
        an eighth of that: the host work of a pipeline's first slice (a check) and its last
        (a hash) is the part nothing overlaps, so they are kept short."""
        step = max(1, self.slice_bytes // max(1, block_bytes))
        edge = max(1, step // 8)
        if n <= step:
            return [(0, n)]
        bounds = [0, edge]
        while n - bounds[-1] > step + edge:
            bounds.append(bounds[-1] + step)
        if n - bounds[-1] > edge:
            bounds.append(n - edge)
        bounds.append(n)
        return list(zip(bounds[:-1], bounds[1:]))

    def _device_of(self, src: BlockMemory, dst: BlockMemory) -> torch.device:
        return src.device if src.device.type == "cuda" else dst.device

    def _stream(self, direction: str, device: torch.device) -> torch.cuda.Stream:
        key = (direction, device)
        with self._lock:
            stream = self._streams.get(key)
            if stream is None:
                # onboards first: the engine's next forward waits for them
                stream = torch.cuda.Stream(device=device,
                                           priority=-1 if direction == ONBOARD else 0)
                self._streams[key] = stream
            return stream

    def _launch(self, src: BlockMemory, src_ids, dst: BlockMemory, dst_ids, direction: str,
                summed: bool = False) -> "_Launch | None":
        """Queue the copy of one batch (``summed``: with device checksums, which need pieces
        8-byte aligned: see :meth:`summable`); None when there is nothing to copy."""
        if not len(src_ids):
            return None
        if self.interpret:
            transport, device = self.transport, None
        else:
            device = self._device_of(src, dst)
            transport = self._self_test(device)
        if transport == "staged" and self._host_side(src, dst, direction) is not None:
            return self._launch_staged(src, src_ids, dst, dst_ids, direction, summed, device)
        plan, per_block = self._plan(src, src_ids, dst, dst_ids, summed)
        src_region, dst_region = src.regions[plan.src_base], dst.regions[plan.dst_base]
        if self.interpret:
            return self._queue("kernel", src_region, dst_region, plan, per_block, None, None)
        if transport == "staged":   # device <-> device (handles() says): the kernel
            transport = "kernel"
        stream = self._stream(direction, device)
        with torch.cuda.device(device), torch.cuda.stream(stream):
            launch = self._queue(transport, src_region, dst_region, plan, per_block, device,
                                 stream)
            launch.event = torch.cuda.Event(blocking=True)
            launch.event.record(stream)
        return launch

    def _plan(self, src: BlockMemory, src_ids, dst: BlockMemory, dst_ids,
              summed: bool) -> tuple[DevicePiecePlan, int]:
        """The kernel's plan and, ``summed``, its pieces per block (0 otherwise)."""
        plan = plan_device_pieces(src, src_ids, dst, dst_ids,
                                  max_piece_bytes=self.max_piece_bytes)
        if summed and plan.unit_bytes < 8:
            raise ValueError(f"device checksums need 8-byte aligned pieces, these are aligned "
                             f"to {plan.unit_bytes} (see summable)")
        return plan, (plan.pieces // len(src_ids) if summed else 0)

    def _host_side(self, src: BlockMemory, dst: BlockMemory, direction: str) -> str | None:
        """Which side of a pair the staged transport moves by DMA: ``"src"`` or ``"dst"``,
        the host memory, when it is one FullyContiguous region (G2 and bounce buffers
        are); None where there is none (device <-> device) or it is laid out otherwise.
        Under the interpreter both sides are CPU tensors and ``direction`` says."""
        if self.interpret:
            side = "src" if direction == ONBOARD else "dst"
        elif src.device.type == "cpu":
            side = "src"
        elif dst.device.type == "cpu":
            side = "dst"
        else:
            return None
        host = src if side == "src" else dst
        return side if isinstance(host.layout, FullyContiguousLayout) else None

    def _ring(self, direction: str, device: torch.device) -> StagingRing:
        key = (direction, device)
        with self._lock:
            ring = self._rings.get(key)
            if ring is None:
                ring = self._rings[key] = StagingRing(device)
            return ring

    def _launch_staged(self, src: BlockMemory, src_ids, dst: BlockMemory, dst_ids,
                       direction: str, summed: bool, device: torch.device | None, *,
                       fall_back: bool = True) -> "_Launch":
        """Queue one slice through device staging (:mod:`.device_staging`): an offload packs
        the blocks from G1 into a staging buffer with the kernel (device checksums taken
        there, ``summed``), then DMA copies each run of consecutive host slots; an onboard
        copies the runs into staging by DMA, then the kernel unpacks them into G1, taking
        the checksums from the bytes it writes. Under the interpreter the DMA is a host
        copy and the buffer a CPU tensor."""
        onboard = self._host_side(src, dst, direction) == "src"
        host, host_ids = (src, src_ids) if onboard else (dst, dst_ids)
        n = len(src_ids)
        layout = FullyContiguousLayout(host.layout.config.with_blocks(n))
        stride = layout.block_stride
        positions, slots, lengths = host_runs(host_ids, stride, layout.config.block_bytes)
        ring = None if device is None else self._ring(direction, device)
        with ring.lock if ring is not None else contextlib.nullcontext():
            if ring is None:
                buffer, released = torch.empty(n * stride, dtype=torch.uint8), None
            else:
                buffer, released = ring.take(n * stride)
            staging = BlockMemory(layout, (buffer,))
            host_addresses = (np.uint64(host.regions[0].data_ptr())
                              + slots.astype(np.uint64) * np.uint64(stride))
            staged_addresses = (np.uint64(buffer.data_ptr())
                                + positions.astype(np.uint64) * np.uint64(stride))
            sizes = lengths.astype(np.uint64)
            staged_ids = range(n)
            if onboard:
                plan, per_block = self._plan(staging, staged_ids, dst, dst_ids, summed)
                pack_src, pack_dst = buffer, dst.regions[plan.dst_base]
                dma = (staged_addresses, host_addresses, sizes)
            else:
                plan, per_block = self._plan(src, src_ids, staging, staged_ids, summed)
                pack_src, pack_dst = src.regions[plan.src_base], buffer
                dma = (host_addresses, staged_addresses, sizes)
            if ring is None:           # the interpreter: every step runs as it is queued
                if onboard:
                    _host_memcpy(*dma)
                launch = self._queue("kernel", pack_src, pack_dst, plan, per_block, None,
                                     None)
                if not onboard:
                    _host_memcpy(*dma)
                launch.keep += [buffer]
                return launch
            from ._cuda_dma import memcpy_batch
            stream = self._stream(direction, device)
            first, last = (ring.dma_stream, stream) if onboard else (stream, ring.dma_stream)
            try:
                if released is not None:
                    first.wait_event(released)
                with torch.cuda.device(device):
                    if onboard:
                        memcpy_batch(*dma, ring.dma_stream.cuda_stream, device.index or 0)
                    with torch.cuda.stream(stream):
                        if onboard:
                            stream.wait_event(_recorded(ring.dma_stream))
                        launch = self._queue("kernel", pack_src, pack_dst, plan, per_block,
                                             device, stream)
                    if not onboard:
                        ring.dma_stream.wait_event(_recorded(stream))
                        memcpy_batch(*dma, ring.dma_stream.cuda_stream, device.index or 0)
                    launch.event = torch.cuda.Event(blocking=True)
                    launch.event.record(last)
            except RuntimeError as exc:
                if not fall_back or ("cuMemcpyBatchAsync" not in str(exc)
                                     and "batched DMA" not in str(exc)):
                    raise
                failed = exc        # the driver refused the DMA: nothing reached the host side
            else:
                ring.release(launch.event)
                launch.keep += [buffer, *dma]
                return launch
        with self._lock:          # the kernel takes this device from now on
            self._transports[device] = "kernel"
            self.kernel_error = f"staged: {failed}"
        return self._launch(src, src_ids, dst, dst_ids, direction, summed)

    def _queue(self, transport: str, src: torch.Tensor, dst: torch.Tensor,
               plan: DevicePiecePlan, per_block: int, device: torch.device | None,
               stream, *, fall_back: bool = True) -> "_Launch":
        """Queue ``plan`` from byte tensor ``src`` (the plan's source base region) to ``dst``
        on ``stream`` (the current one); with ``per_block`` (pieces per block), the device
        checksum shares come back to host memory on the same stream. A DMA batch the driver
        refuses outright goes to the kernel (and the kernel takes the device from then on)
        unless not ``fall_back`` (the self-test: it must see DMA fail)."""
        if transport == "kernel":
            return self._run_kernel(src, dst, plan.src_units, plan.dst_units, plan, per_block,
                                    device, copy=True)
        from ._cuda_dma import memcpy_batch
        unit = np.uint64(plan.unit_bytes)
        dsts = np.uint64(dst.data_ptr()) + plan.dst_units.astype(np.uint64) * unit
        srcs = np.uint64(src.data_ptr()) + plan.src_units.astype(np.uint64) * unit
        sizes = np.full(plan.pieces, plan.piece_bytes, dtype=np.uint64)
        try:
            for lo in range(0, plan.pieces, _DMA_BATCH):
                memcpy_batch(dsts[lo:lo + _DMA_BATCH], srcs[lo:lo + _DMA_BATCH],
                             sizes[lo:lo + _DMA_BATCH], stream.cuda_stream,
                             stream.device.index or 0)
        except RuntimeError as exc:
            if not fall_back or device is None or lo:   # part queued: nothing safe to redo
                raise
            with self._lock:        # refused outright: the kernel takes this device from now
                self._transports[device] = "kernel"
                self.kernel_error = f"dma: {exc}"
            return self._queue("kernel", src, dst, plan, per_block, device, stream)
        if not per_block:
            return _Launch(keep=[dsts, srcs, sizes])
        # the device checksums of the device side, read in device memory after the copy
        on_device, units = (src, plan.src_units) if src.device.type == "cuda" \
            else (dst, plan.dst_units)
        launch = self._run_kernel(on_device, on_device, units, units, plan, per_block, device,
                                  copy=False)
        launch.keep += [dsts, srcs, sizes]
        return launch

    def _group(self, pieces: int, device: torch.device | None) -> int:
        """Consecutive pieces per program: a power of two that brings the grid near
        ``programs`` (default: the device's streaming multiprocessors)."""
        target = self.programs
        if target is None:
            target = (torch.cuda.get_device_properties(device).multi_processor_count
                      if device is not None else pieces)
        group = 1
        while group < 1024 and pieces > group * max(1, target):
            group *= 2
        return group

    def _run_kernel(self, src: torch.Tensor, dst: torch.Tensor, src_units: np.ndarray,
                    dst_units: np.ndarray, plan: DevicePiecePlan, per_block: int,
                    device: torch.device | None, *, copy: bool) -> "_Launch":
        """Launch a kernel on the current stream over ``plan``'s pieces at ``src_units`` /
        ``dst_units`` of byte tensors ``src`` / ``dst``: the copy kernel, or with
        ``per_block`` the device checksum kernel (copying too unless not ``copy``), whose
        per-piece shares come back to pinned host memory on the same stream."""
        if per_block:
            dtype, per_unit = torch.int64, plan.unit_bytes // 8
        else:
            dtype, per_unit = _element(plan.unit_bytes)
        src, dst = _typed_start(src, dtype), _typed_start(dst, dtype)
        elements = plan.piece_bytes // (plan.unit_bytes // per_unit)
        block = min(self.block_elements, 1 << max(0, (elements - 1).bit_length()))
        group = self._group(plan.pieces, device)
        padded = -(-plan.pieces // group) * group
        offsets = np.empty((2, padded), dtype=np.int64)
        offsets[0, :plan.pieces], offsets[1, :plan.pieces] = src_units, dst_units
        offsets[:, plan.pieces:] = offsets[:, plan.pieces - 1:plan.pieces]   # repeat the last
        offsets = torch.from_numpy(offsets)
        extra: dict = {}
        if device is not None:
            offsets = offsets.to(device, non_blocking=True)
            extra["num_warps"] = self.num_warps
        launch = _Launch(keep=[offsets], per_block=per_block, pieces=plan.pieces)
        grid = (padded // group,)
        if not per_block:
            self._kernel[grid](src, dst, offsets[0], offsets[1], UNIT=per_unit,
                               PIECE=elements, BLOCK=block, GROUP=group, **extra)
            return launch
        shares = torch.empty(padded, dtype=torch.int64, device=offsets.device)
        self._summed_kernel[grid](src, dst, offsets[0], offsets[1], shares, UNIT=per_unit,
                                  PIECE=elements, BLOCK=block, GROUP=group,
                                  PER_BLOCK=per_block, LOG2_BLOCK=block.bit_length() - 1,
                                  COPY=copy, **extra)
        if device is not None:
            launch.shares = torch.empty(padded, dtype=torch.int64, pin_memory=True)
            launch.shares.copy_(shares, non_blocking=True)
            launch.keep.append(shares)
        else:
            launch.shares = shares
        return launch

    @staticmethod
    def _wait(launch: "_Launch | None") -> None:
        if launch is not None and launch.event is not None:
            launch.event.synchronize()


def _recorded(stream: "torch.cuda.Stream") -> "torch.cuda.Event":
    """An event recorded now on ``stream`` (for another stream to wait on)."""
    event = torch.cuda.Event()
    event.record(stream)
    return event


def _host_memcpy(dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray) -> None:
    """The staged transport's DMA step under the interpreter: host copies."""
    for dst, src, size in zip(dsts.tolist(), srcs.tolist(), sizes.tolist()):
        ctypes.memmove(dst, src, size)


class _Launch:
    """One queued batch: the event that says it ran (None under the interpreter), what it
    reads that must outlive it, and (device checksums) the per-piece shares in host memory,
    ``per_block`` to a block, for the first ``pieces`` entries."""

    __slots__ = ("event", "keep", "shares", "per_block", "pieces")

    def __init__(self, keep: list, per_block: int = 0, pieces: int = 0) -> None:
        self.event = None
        self.keep = keep
        self.shares: torch.Tensor | None = None
        self.per_block = per_block
        self.pieces = pieces

    def block_sums(self) -> np.ndarray:
        """Each block's device checksum (after :meth:`DeviceCopyEngine._wait`)."""
        shares = self.shares.numpy().view(np.uint64)[:self.pieces]
        return shares.reshape(-1, self.per_block).sum(axis=1, dtype=np.uint64)
