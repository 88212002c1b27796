"""The GPU data path: blocks between CUDA memory and host memory the GPU can address.

:class:`DeviceCopyEngine` moves a batch of blocks between G1 (the engine's KV tensors, in any
layout :class:`~kvstrata.physical.storage.device.DeviceStorage` wraps) and host memory that is
registered with CUDA (G2, the transfer engine's bounce buffer), slice by slice, on one of its
transports (see the class docstring): the Triton copy kernel through host memory
(``kernel``), the kernel packing blocks in a device staging buffer and the copy engines
moving each run of host slots by DMA (``staged``, :mod:`.device_staging`), per slice
whichever suits it (``auto``, the default), or one DMA per piece (``dma``, :mod:`._cuda_dma`).

* **Addresses by template** (:func:`.device_plan.block_template`, pure numpy, checked on
  CPU): piece ``p`` of block ``b`` starts ``template[p] + b * stride`` units after its side's
  base, for every layout kvstrata addresses, so a launch needs only the slice's block ids;
  the kernels (:mod:`._triton_copy`) compute the rest. Each kernel program copies a group of
  consecutive pieces, the grid near the device's SM count (``programs``).
* **Slices**: a batch is queued in slices of ``slice_bytes`` (the first and last an eighth of
  that), so the GPU copies the first slice while the host works on the next ones. A batch's
  ids are checked whole before its first slice moves.
* **Streams**: each direction has its own CUDA stream (onboard at high priority: the engine's
  next forward waits for it), and the staged transport a DMA stream per direction; the
  engine's compute stream is never used, and the calling thread waits on a blocking event
  (sleeping).
* **Integrity at copy speed: device checksums.** :meth:`copy_summed` also computes, on the
  GPU, each block's *device checksum*
  (:func:`~kvstrata.physical.checksum.device_checksum`: the sum of a 64-bit mix of every
  word with its position), by the copy kernel from the words it moves (with ``staged``, the
  pack or unpack in device memory; with DMA per piece, a kernel over the device side after
  the copy). The transfer engine records it with the G2 slot on an offload and compares it
  on an onboard, so the bytes checked are the bytes that arrived in G1, and no host thread
  reads the bytes. Host reads of G2 (a store to G3, a peer's export) check it natively
  first. :meth:`copy_hashed` / :meth:`copy_checked` are the xxh3 forms (hashing on
  ``hash_threads`` host threads, overlapped slice by slice), used for slots that have no
  device checksum.
* **Self-test**: before first use on a device, the transport (``auto``: both of its own)
  moves random blocks between registered host memory and a device layout like vLLM's and
  back with device checksums; one that fails is not used (:attr:`DeviceCopyEngine.
  kernel_error` says why).

Memory the GPU cannot address (pageable host memory, or host <-> host) goes to the
``fallback`` engine (:class:`~kvstrata.physical.copy.StagedCopyEngine` by default). With
``interpret=True`` the kernels run on CPU tensors under Triton's interpreter (the staged
transport's DMA a host copy, its staging a CPU tensor, ``direction`` saying which side is
the host): what tests without a GPU use to check the templates, the kernels and the checksums
byte for byte.
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

from ..protocol.layout import FullyContiguousLayout, LayerSeparateLayout, LayoutConfig
from .buffers import AlignedBuffer, cuda_mapped
from .checksum import device_checksum, memory_checksums
from .copy import OFFLOAD, ONBOARD, CopyEngine, StagedCopyEngine, _checked_ids
from .device_plan import BlockTemplate, block_template, plan_device_pieces
from ._cuda_dma import DmaRefused as _DmaRefused
from .device_staging import StagingRing, staged_runs
from .storage.base import BlockMemory

__all__ = ["DeviceCopyEngine", "device_kernel_status", "device_kernels", "slice_bounds",
           "TRANSPORTS"]


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


TRANSPORTS = ("auto", "kernel", "staged", "dma")
_DMA_BATCH = 8192          # copies per cuMemcpyBatchAsync call


class DeviceCopyEngine(CopyEngine):
    """Device <-> host copies on the GPU (see the module docstring).

    ``transport`` (how the bytes cross PCIe):

    * ``"kernel"``: the Triton copy kernel moves them through streaming multiprocessors,
      reading or writing host memory in place; the fastest for scattered small blocks, but
      it holds SMs for the whole copy (a forward beside it waits for them);
    * ``"staged"``: the kernel packs the blocks in device memory and the GPU's copy engines
      move each run of consecutive host slots by DMA (:mod:`.device_staging`); SMs are held
      only for the pack, so it overlaps a forward, and large runs reach the DMA limit, but
      every run is one DMA copy, which small scattered blocks make many;
    * ``"auto"`` (the default): per slice, ``staged`` where its host slots form runs of at
      least ``staged_run_bytes`` on average, else ``kernel``;
    * ``"dma"``: one DMA copy per piece (a few KiB in G1's layout) and a checksum kernel
      after it; measured far below the others (kept for drivers where kernels fail).

    A transport that fails its self-test on a device is replaced by the next that passes
    (``auto`` needs ``kernel`` and ``staged``), then by ``fallback``. ``programs``: the
    grid the kernel aims at (default: the device's SM count); each program copies a group
    of consecutive pieces. ``staging_depth``: the staged transport's buffers per direction
    and device (:class:`~.device_staging.StagingRing`), each ``slice_bytes`` of device
    memory once used."""

    name = "device"

    def __init__(self, *, fallback: CopyEngine | None = None, interpret: bool = False,
                 transport: str = "auto", slice_bytes: int = 32 << 20,
                 staged_run_bytes: int = 512 << 10,
                 max_piece_bytes: int = 64 << 10, block_elements: int = 4096,
                 num_warps: int = 4, programs: int | None = None,
                 hash_threads: int | None = None, device_checksums: bool = True,
                 staging_depth: int = 2) -> None:
        kernels, error = device_kernels()
        if kernels is None:
            raise RuntimeError(f"device copy kernel unavailable: {error}")
        if not interpret and not torch.cuda.is_available():
            raise RuntimeError("device copy kernel unavailable: no CUDA device")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if interpret and transport == "dma":
            raise ValueError("Triton's interpreter runs no DMA transport")
        if block_elements < 1 or block_elements & (block_elements - 1):
            raise ValueError(f"block_elements must be a power of two, got {block_elements}")
        if not 2 <= staging_depth <= 64:
            raise ValueError(f"staging_depth must be 2 to 64, got {staging_depth}")
        from .storage.host import default_hash_threads
        self.interpret = interpret
        self.transport = transport
        self._kernel = kernels.interpreted() if interpret else kernels.copy_blocks
        self._summed_kernel = (kernels.interpreted(summed=True) if interpret
                               else kernels.copy_blocks_summed)
        self.fallback = fallback if fallback is not None else StagedCopyEngine()
        self.slice_bytes = slice_bytes
        self.staged_run_bytes = staged_run_bytes
        self.max_piece_bytes = max_piece_bytes
        self.block_elements = block_elements
        self.num_warps = num_warps
        self.programs = programs
        self.hash_threads = default_hash_threads() if hash_threads is None else hash_threads
        self.device_checksums = device_checksums
        self.staging_depth = staging_depth
        self._streams: dict[tuple[str, torch.device], torch.cuda.Stream] = {}
        self._lock = threading.Lock()
        self._rings: dict[tuple[str, torch.device], StagingRing] = {}
        self._closed = False
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
            return self.transport
        if device.index is None:     # the key a memory's device has
            device = torch.device(device.type, torch.cuda.current_device())
        return self._self_test(device)

    # ------------------------------------------------------------------ public API
    def handles(self, src: BlockMemory, dst: BlockMemory) -> bool:
        """Whether this engine copies the pair on the GPU (else :attr:`fallback` does)."""
        if self.interpret:
            return (src.device.type == "cpu" and dst.device.type == "cpu"
                    and self._template(src, dst) is not None)
        kinds = {src.device.type, dst.device.type}
        if "cuda" not in kinds or not kinds <= {"cuda", "cpu"}:
            return False
        if src.device.type == dst.device.type == "cuda" and src.device != dst.device:
            return False
        if not all(_mapped_host(m) for m in (src, dst) if m.device.type == "cpu"):
            return False
        if self._template(src, dst) is None:   # no layout kvstrata builds
            return False
        transport = self._self_test(self._device_of(src, dst))
        if transport == "staged" and "cpu" in kinds:   # the host side must be one run of
            return self._host_side(src, dst, OFFLOAD) is not None   # slots (G2 is)
        return transport is not None

    def copy(self, src, src_ids, dst, dst_ids, *, direction=OFFLOAD) -> int:
        if not self.handles(src, dst):
            return self.fallback.copy(src, src_ids, dst, dst_ids, direction=direction)
        src_ids, dst_ids = _batch_ids(src, src_ids, dst, dst_ids)
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
        return self._template(src, dst).unit_bytes >= 8

    def copy_summed(self, src, src_ids, dst, dst_ids, *, direction=OFFLOAD,
                    landed: Callable[[int, int, np.ndarray], None] | None = None
                    ) -> np.ndarray | None:
        """Copy the batch and return the device checksum
        (:func:`~kvstrata.physical.checksum.device_checksum`) of every block's bytes
        (``uint64`` array), computed on the GPU: by the copy kernel while they pass, or,
        with DMA, by a kernel over the device side after the copy (the bytes that arrived,
        on an onboard). No host pass over the bytes. None, copying nothing, where
        :meth:`summable` says no.

        ``landed(lo, hi, sums)`` runs on this thread as soon as batch positions ``lo:hi``
        (a slice) have landed, with their checksums, while the slices after it still copy:
        a verifying G2 seals each slice then, so only the last (short) slice's sealing is
        left when the copy ends. If it raises, the slices queued are waited for and the
        call raises."""
        if not self.summable(src, dst):
            return None
        src_ids, dst_ids = _batch_ids(src, src_ids, dst, dst_ids)
        bounds = self._slices(len(src_ids), src.layout.config.block_bytes)
        sums = []
        with self._queued() as launches:
            for lo, hi in bounds:     # all queued first: the GPU never waits for this thread
                launches.append(self._launch(src, src_ids[lo:hi], dst, dst_ids[lo:hi],
                                             direction, summed=True))
            for (lo, hi), launch in zip(bounds, launches):
                if launch is None:    # an empty batch
                    continue
                self._wait(launch)
                sums.append(launch.block_sums())
                if landed is not None:
                    landed(lo, hi, sums[-1])
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
        src_ids, dst_ids = _batch_ids(src, src_ids, dst, dst_ids)
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
        src_ids, dst_ids = _batch_ids(src, src_ids, dst, dst_ids)
        good: list[int] = []
        with self._queued() as launches:
            for lo, hi in self._slices(len(src_ids), src.layout.config.block_bytes):
                passed = check(lo, hi)
                if passed:
                    launches.append(self._launch(src, src_ids[passed], dst, dst_ids[passed],
                                                 direction))
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
        """Wait for what the staging rings still move, let their device memory go, close
        the fallback."""
        with self._lock:
            self._closed = True
            rings, self._rings = list(self._rings.values()), {}
        for ring in rings:
            ring.close()
        self.fallback.close()

    # ------------------------------------------------------------------ self-test
    def _self_test(self, device: torch.device) -> str | None:
        """Once per device: the requested transport, else the others, must move random
        blocks right (:meth:`_try_transport`); the first that does is used, and what failed
        is kept in :attr:`kernel_error` (None returned: every copy goes to the fallback)."""
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
        """Why ``transport`` cannot be used on ``device`` (None: it can); ``auto`` needs
        both of its transports."""
        if transport == "auto":
            errors = [f"{t}: {e}" for t in ("kernel", "staged")
                      if (e := self._try_one(t, device)) is not None]
            return "; ".join(errors) or None
        return self._try_one(transport, device)

    def _try_one(self, transport: str, device: torch.device) -> str | None:
        """Why ``transport`` cannot be used on ``device`` (None: it can): 16 random 4 KiB
        blocks from registered host memory into device memory laid out as vLLM's
        FlashAttention cache is (K and V of a block apart), from half the slots of a host
        region in runs of consecutive, reversed and single ones with gaps between (staged:
        several DMA copies at several offsets), then back to other slots with device checksums,
        compared block by block and checksum by checksum."""
        try:
            config = LayoutConfig(num_blocks=32, num_layers=2, outer_dim=2, page_size=4,
                                  inner_dim=128, dtype="bfloat16")   # 4 KiB blocks
            host = AlignedBuffer(32 * config.block_bytes, pin=True)
            expected = torch.randint(0, 256, (32, config.block_bytes), dtype=torch.uint8)
            host.tensor.copy_(expected.reshape(-1))
            host_memory = BlockMemory(FullyContiguousLayout(config), (host.tensor,))
            layout = LayerSeparateLayout(config, "outer_contiguous")
            # allocated on a stream of ours: memory the engine's own streams just freed
            # could still be in use there
            with torch.cuda.stream(self._stream(ONBOARD, device)):
                device_memory = BlockMemory(layout, tuple(
                    torch.zeros(layout.region_bytes(i), dtype=torch.uint8, device=device)
                    for i in range(layout.num_regions)))
            # half the slots, with gaps: several runs (staged: several DMA copies, none at
            # offset 0 alone), consecutive, reversed and single
            slots = [9, 10, 11, 2, 3, 30, 29, 28, 27, 17, 20, 21, 22, 23, 5, 14]
            here = list(range(16))
            self._wait(self._launch_with(transport, host_memory, slots, device_memory, here,
                                         ONBOARD, False, device, fall_back=False))
            host.tensor.zero_()
            back = [31, 0, 1, 12, 13, 6, 7, 8, 26, 25, 24, 18, 19, 4, 15, 16]
            launch = self._launch_with(transport, device_memory, here, host_memory, back,
                                       OFFLOAD, True, device, fall_back=False)
            self._wait(launch)
            if not torch.equal(host.tensor.view(32, -1)[back], expected[slots]):
                return "its self-test moved wrong bytes"
            if launch.block_sums().tolist() != [device_checksum(b) for b in
                                                expected[slots].numpy()]:
                return "its self-test computed a wrong device checksum"
            host.unpin()
            return None
        except Exception as exc:      # noqa: BLE001 - any failure means: do not use it
            return f"{type(exc).__name__}: {exc}"

    # ------------------------------------------------------------------ internals
    def _slices(self, n: int, block_bytes: int) -> list[tuple[int, int]]:
        return slice_bounds(n, block_bytes, self.slice_bytes)

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

    def _template(self, src: BlockMemory, dst: BlockMemory) -> BlockTemplate | None:
        """The pair's :func:`~.device_plan.block_template`, cached on the source memory
        (it never changes; BlockMemory is frozen, hence the ``__dict__``)."""
        cache = src.__dict__.setdefault("_block_templates", {})
        key = (id(dst), self.max_piece_bytes)
        known = cache.get(key)
        if known is None or known[0]() is not dst:           # an id can be reused
            for stale, (ref, _) in list(cache.items()):     # other threads add too
                if ref() is None:
                    cache.pop(stale, None)                    # destinations gone
            known = cache[key] = (weakref.ref(dst), block_template(
                src, dst, max_piece_bytes=self.max_piece_bytes))
        return known[1]

    def _staging_template(self, device_memory: BlockMemory, host: BlockMemory,
                          onboard: bool) -> BlockTemplate | None:
        """The template between ``device_memory`` and a staging buffer laid out as
        ``host`` is (its block stride; the buffer's own address comes at launch)."""
        cache = device_memory.__dict__.setdefault("_staging_templates", {})
        key = (host.layout.config, onboard, self.max_piece_bytes)
        if key not in cache:
            layout = FullyContiguousLayout(host.layout.config.with_blocks(2))
            shape = BlockMemory(layout, (torch.empty(layout.region_bytes(0), dtype=torch.uint8,
                                                     device="meta"),))   # address 0
            pair = (shape, device_memory) if onboard else (device_memory, shape)
            cache[key] = block_template(*pair, max_piece_bytes=self.max_piece_bytes)
        return cache[key]

    def _launch(self, src: BlockMemory, src_ids, dst: BlockMemory, dst_ids, direction: str,
                summed: bool = False) -> "_Launch | None":
        """Queue the copy of one slice on the device's transport (``summed``: with device
        checksums, which need pieces 8-byte aligned: see :meth:`summable`); None when there
        is nothing to copy."""
        if not len(src_ids):
            return None
        if self.interpret:
            return self._launch_with(self.transport, src, src_ids, dst, dst_ids, direction,
                                     summed, None)
        device = self._device_of(src, dst)
        transport = self._self_test(device)
        if transport is None:    # taken away since handles() (a refused DMA): never guess
            raise RuntimeError(f"no GPU transport left on {device}: {self.kernel_error}")
        return self._launch_with(transport, src, src_ids, dst, dst_ids, direction, summed,
                                 device)

    def _launch_with(self, transport: str, src, src_ids, dst, dst_ids, direction: str,
                     summed: bool, device: torch.device | None, *,
                     fall_back: bool = True) -> "_Launch":
        """:meth:`_launch` on ``transport``. ``fall_back``: where the driver refuses a DMA
        outright, the kernel takes the device from then on and copies this slice (not in
        the self-test, which must see the refusal)."""
        side = self._host_side(src, dst, direction)
        staging = None
        if transport in ("auto", "staged") and side is not None:
            host, ids = (src, src_ids) if side == "src" else (dst, dst_ids)
            staging = staged_runs(ids, host.layout.block_stride, host.layout.config.block_bytes,
                                  self.staged_run_bytes if transport == "auto" else 0)
        if staging is not None:     # (auto: None for short runs, which the kernel moves)
            return self._launch_staged(src, src_ids, dst, dst_ids, direction, summed, device,
                                       *staging, fall_back=fall_back)
        if transport == "dma":
            return self._launch_dma(src, src_ids, dst, dst_ids, direction, summed, device,
                                    fall_back=fall_back)
        # the kernel; also the staged transport's device <-> device copies (its pack step)
        template = self._template(src, dst)
        src_region, dst_region = src.regions[template.src_base], dst.regions[template.dst_base]
        if device is None:
            return self._run_kernel(src_region, dst_region, template, src_ids, dst_ids,
                                    summed, True, None)
        stream = self._stream(direction, device)
        with torch.cuda.device(device), torch.cuda.stream(stream):
            launch = self._run_kernel(src_region, dst_region, template, src_ids, dst_ids,
                                      summed, True, device)
            launch.event = torch.cuda.Event(blocking=True)
            launch.event.record(stream)
        return launch

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
            if self._closed:
                raise RuntimeError("the device copy engine is closed")
            ring = self._rings.get(key)
            if ring is None:
                ring = self._rings[key] = StagingRing(device, self.staging_depth)
            return ring

    def _dma_refused(self, device: torch.device, transport: str, exc: Exception) -> None:
        """The driver refused a DMA outright: the kernel takes ``device`` from now on if it
        passes its self-test (it may never have been tried: the DMA transport was chosen);
        else nothing does, and this slice fails (copies then go to :attr:`fallback`)."""
        kernel_error = self._try_one("kernel", device)
        with self._lock:
            self._transports[device] = "kernel" if kernel_error is None else None
            self.kernel_error = f"{transport}: {exc}" + (f"; kernel: {kernel_error}"
                                                         if kernel_error else "")
        if kernel_error is not None:
            raise RuntimeError(f"the driver refused a DMA ({exc}) and the copy kernel "
                               f"failed its self-test ({kernel_error})")

    def _launch_staged(self, src: BlockMemory, src_ids, dst: BlockMemory, dst_ids,
                       direction: str, summed: bool, device: torch.device | None,
                       staged_ids: np.ndarray,
                       runs: tuple[np.ndarray, np.ndarray, np.ndarray], *,
                       fall_back: bool = True) -> "_Launch":
        """Queue one slice through device staging (:mod:`.device_staging`): an offload packs
        the blocks from G1 into a staging buffer with the kernel (device checksums taken
        there, ``summed``), then DMA copies each run of consecutive host slots; an onboard
        copies the runs into staging by DMA, then the kernel unpacks them into G1, taking
        the checksums from the bytes it writes. Block ``i`` of the slice is at staging
        position ``staged_ids[i]``, in the order of its host slot
        (:func:`~.device_staging.staging_order`; ``runs`` are of the slots in that order).
        Under the interpreter the DMA is a host copy and the buffer a CPU tensor."""
        onboard = self._host_side(src, dst, direction) == "src"
        host = src if onboard else dst
        device_memory, device_ids = (dst, dst_ids) if onboard else (src, src_ids)
        template = self._staging_template(device_memory, host, onboard)
        n = len(src_ids)
        stride = host.layout.block_stride
        positions, slots, lengths = runs          # host_runs of the host ids in slot order
        ring = None if device is None else self._ring(direction, device)
        with ring.lock if ring is not None else contextlib.nullcontext():
            if ring is None:
                buffer, released = torch.zeros(n * stride, dtype=torch.uint8), None
            else:
                buffer, released = ring.take(n * stride)
            host_addresses = (np.uint64(host.regions[0].data_ptr())
                              + slots.astype(np.uint64) * np.uint64(stride))
            staged_addresses = (np.uint64(buffer.data_ptr())
                                + positions.astype(np.uint64) * np.uint64(stride))
            sizes = lengths.astype(np.uint64)
            if onboard:
                pack = (buffer, device_memory.regions[template.dst_base], template,
                        staged_ids, device_ids)
                dma = (staged_addresses, host_addresses, sizes)
            else:
                pack = (device_memory.regions[template.src_base], buffer, template,
                        device_ids, staged_ids)
                dma = (host_addresses, staged_addresses, sizes)
            if ring is None:           # the interpreter: every step runs as it is queued
                if onboard:
                    _host_memcpy(*dma)
                launch = self._run_kernel(*pack, summed, True, None)
                if not onboard:
                    _host_memcpy(*dma)
                launch.keep += [buffer]
                return launch
            stream = self._stream(direction, device)
            first, last = (ring.dma_stream, stream) if onboard else (stream, ring.dma_stream)
            try:
                if released is not None:
                    first.wait_event(released)
                with torch.cuda.device(device):
                    if onboard:
                        _queue_dma(dma, ring.dma_stream, device)
                    with torch.cuda.stream(stream):
                        if onboard:
                            stream.wait_event(_recorded(ring.dma_stream))
                        launch = self._run_kernel(*pack, summed, True, device)
                    if not onboard:
                        ring.dma_stream.wait_event(_recorded(stream))
                        _queue_dma(dma, ring.dma_stream, device)
                    launch.event = torch.cuda.Event(blocking=True)
                    launch.event.record(last)
            except _DmaRefused as exc:
                # what was queued (a pack, part of the runs) finishes before anything else
                # touches the buffer or the slots: the slice is then copied again whole
                ring.dma_stream.synchronize()
                stream.synchronize()
                if not fall_back:
                    raise
                refused = exc
            else:
                ring.release(launch.event)
                launch.keep += [buffer, *dma]
                return launch
        self._dma_refused(device, "staged", refused)
        return self._launch_with("kernel", src, src_ids, dst, dst_ids, direction, summed,
                                 device)

    def _launch_dma(self, src: BlockMemory, src_ids, dst: BlockMemory, dst_ids,
                    direction: str, summed: bool, device: torch.device, *,
                    fall_back: bool = True) -> "_Launch":
        """Queue one slice as one DMA per piece (``cuMemcpyBatchAsync``), then, ``summed``,
        the checksum kernel over the device side (the bytes that arrived, on an onboard)."""
        plan = plan_device_pieces(src, src_ids, dst, dst_ids,
                                  max_piece_bytes=self.max_piece_bytes)
        unit = np.uint64(plan.unit_bytes)
        dsts = (np.uint64(dst.regions[plan.dst_base].data_ptr())
                + plan.dst_units.astype(np.uint64) * unit)
        srcs = (np.uint64(src.regions[plan.src_base].data_ptr())
                + plan.src_units.astype(np.uint64) * unit)
        sizes = np.full(plan.pieces, plan.piece_bytes, dtype=np.uint64)
        stream = self._stream(direction, device)
        with torch.cuda.device(device), torch.cuda.stream(stream):
            try:
                _queue_dma((dsts, srcs, sizes), stream, device)
            except _DmaRefused as exc:
                stream.synchronize()    # a part queued lands before the call returns
                if not fall_back:
                    raise
                self._dma_refused(device, "dma", exc)
                return self._launch_with("kernel", src, src_ids, dst, dst_ids, direction,
                                         summed, device)
            if summed:   # the device checksums of the device side, after the copy
                side, ids = (src, src_ids) if src.device.type == "cuda" else (dst, dst_ids)
                template = self._template(side, side)
                region = side.regions[template.src_base]
                launch = self._run_kernel(region, region, template, ids, ids, True, False,
                                          device)
            else:
                launch = _Launch(keep=[])
            launch.keep += [dsts, srcs, sizes]
            launch.event = torch.cuda.Event(blocking=True)
            launch.event.record(stream)
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

    def _template_tensor(self, template: BlockTemplate, device) -> torch.Tensor:
        """``template``'s piece offsets (source, destination) as a ``[2, per_block]`` int64
        tensor on ``device`` (the current stream's), made once per template and device and
        kept with the template."""
        offsets = template.device_offsets.get(device)
        if offsets is None:
            offsets = torch.from_numpy(np.stack([template.src_units, template.dst_units])
                                       .astype(np.int64))
            if device is not None:
                offsets = offsets.to(device)
            offsets = template.device_offsets.setdefault(device, offsets)
        return offsets

    def _run_kernel(self, src: torch.Tensor, dst: torch.Tensor, template: BlockTemplate,
                    src_ids, dst_ids, summed: bool, copy: bool,
                    device: torch.device | None) -> "_Launch":
        """Launch a kernel on the current stream copying blocks ``src_ids`` at byte tensor
        ``src`` (the template's source base region) to ``dst_ids`` at ``dst``: the copy
        kernel, or ``summed`` the device checksum kernel (copying too unless not ``copy``),
        whose per-piece shares come back to pinned host memory on the same stream."""
        n = len(src_ids)
        total = n * template.per_block
        dtype, shape = self.kernel_shape(template, summed, total, device)
        src, dst = _typed_start(src, dtype), _typed_start(dst, dtype)
        group = shape["GROUP"]
        programs = -(-total // group)
        ids = np.empty((2, n), dtype=np.int64)
        ids[0], ids[1] = src_ids, dst_ids
        ids = torch.from_numpy(ids)
        offsets = self._template_tensor(template, device)
        if device is not None:
            ids = ids.to(device, non_blocking=True)
            shape["num_warps"] = self.num_warps
        launch = _Launch(keep=[ids], per_block=template.per_block if summed else 0,
                         pieces=total)
        args = (src, dst, ids[0], ids[1], offsets[0], offsets[1], template.src_stride,
                template.dst_stride, total)
        if not summed:
            self._kernel[(programs,)](*args, **shape)
            return launch
        shares = torch.empty(programs * group, dtype=torch.int64, device=ids.device)
        self._summed_kernel[(programs,)](*args, shares, COPY=copy, **shape)
        if device is not None:
            launch.shares = torch.empty(shares.numel(), dtype=torch.int64, pin_memory=True)
            launch.shares.copy_(shares, non_blocking=True)
            launch.keep.append(shares)
        else:
            launch.shares = shares
        return launch

    def kernel_shape(self, template: BlockTemplate, summed: bool, pieces: int,
                     device: torch.device | None) -> tuple[torch.dtype, dict]:
        """What a launch over ``pieces`` pieces of ``template`` compiles the kernel for: the
        element type it moves and its compile-time constants (``UNIT``, ``PIECE``,
        ``BLOCK``, ``GROUP``, ``PER_BLOCK``; ``summed``: ``LOG2_BLOCK`` too)."""
        if summed:
            if template.unit_bytes < 8:
                raise ValueError(f"device checksums need 8-byte aligned pieces, these are "
                                 f"aligned to {template.unit_bytes} (see summable)")
            dtype, per_unit = torch.int64, template.unit_bytes // 8
        else:
            dtype, per_unit = _element(template.unit_bytes)
        elements = template.piece_bytes // (template.unit_bytes // per_unit)
        block = min(self.block_elements, 1 << max(0, (elements - 1).bit_length()))
        shape = dict(UNIT=per_unit, PIECE=elements, BLOCK=block,
                     GROUP=self._group(pieces, device), PER_BLOCK=template.per_block)
        if summed:
            shape["LOG2_BLOCK"] = block.bit_length() - 1
        return dtype, shape

    @staticmethod
    def _wait(launch: "_Launch | None") -> None:
        if launch is not None and launch.event is not None:
            launch.event.synchronize()


def slice_bounds(n: int, block_bytes: int, slice_bytes: int) -> list[tuple[int, int]]:
    """Batch positions ``0..n`` cut into slices of about ``slice_bytes``, the first and the
    last an eighth of that: the host work of a pipeline's first slice (a check) and its last
    (a hash or a seal) is the part nothing overlaps, so they are kept short."""
    step = max(1, slice_bytes // max(1, block_bytes))
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


def _recorded(stream: "torch.cuda.Stream") -> "torch.cuda.Event":
    """An event recorded now on ``stream`` (for another stream to wait on)."""
    event = torch.cuda.Event()
    event.record(stream)
    return event


def _batch_ids(src: BlockMemory, src_ids, dst: BlockMemory,
               dst_ids) -> tuple[np.ndarray, np.ndarray]:
    """A batch's ids as ``int64`` arrays, checked whole before any slice moves: lists of
    equal length, every id a slot of its memory (the kernels trust them)."""
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source ids but {len(dst_ids)} destination ids")
    return (_checked_ids(src_ids, src.layout.config.num_blocks),
            _checked_ids(dst_ids, dst.layout.config.num_blocks))


def _queue_dma(copies: tuple[np.ndarray, np.ndarray, np.ndarray], stream, device) -> None:
    """Queue ``(destinations, sources, sizes)`` on ``stream`` by DMA, ``_DMA_BATCH`` copies
    a driver call. Raises :class:`~._cuda_dma.DmaRefused` where the driver refuses (a part
    may then be queued already)."""
    from ._cuda_dma import memcpy_batch
    dsts, srcs, sizes = copies
    for lo in range(0, sizes.size, _DMA_BATCH):
        memcpy_batch(dsts[lo:lo + _DMA_BATCH], srcs[lo:lo + _DMA_BATCH],
                     sizes[lo:lo + _DMA_BATCH], stream.cuda_stream, device.index or 0)


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
