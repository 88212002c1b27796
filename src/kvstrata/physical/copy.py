"""Copy engines: move a batch of blocks between two :class:`BlockMemory` of compatible layouts.

(Over 600 lines on purpose: one concern, copying a batch between two layouts; the piece
planner, the native and pure-Python kernels and the device path must agree byte for byte.)

``engine.copy(src, src_ids, dst, dst_ids, direction=...)`` copies block ``src_ids[i]`` of
``src`` to block ``dst_ids[i]`` of ``dst`` for the whole batch in one call, gathering or
scattering between layouts (e.g. LayerSeparate device tensors <-> FullyContiguous host blocks).
The unit moved is the coarsest piece both layouts keep contiguous (:func:`plan_pieces`): a
whole block between two FullyContiguous layouts, a layer or a K/V chunk otherwise.

* :class:`MemmoveCopyEngine` — host memory on both sides (the CPU path that runs here).
  With the native kernel (``_copykernel``, a small C extension built by ``pip install -e .``)
  a batch becomes arrays of piece addresses, adjacent pieces merged, copied by one C call
  that releases the GIL and splits the bytes over ``threads`` pthreads (``memcpy``, or
  non-temporal stores for batches much larger than the cache). Without it (it failed to
  build, or ``KVSTRATA_NATIVE_COPY=0``) each memory is viewed as rows of one 2-D array spanning all its regions; a batch becomes
  arrays of row numbers moved by ``torch.index_select`` (gather) and numpy fancy assignment
  (scatter), C loops with a few Python calls per batch, GIL released; odd geometries fall
  back to one ``memmove`` per piece. (Torch's CPU ``index_copy_`` is elementwise and
  measured 5-15x slower, so it is not used.)
* :class:`TorchCopyEngine` — ``index_select`` / ``index_copy_`` per layer on any single device
  (the device-side half of the CUDA path; also runs, slowly, on CPU tensors for tests).
* :class:`StagedCopyEngine` — device <-> host: gathers blocks into a packed buffer on the
  device, moves it in one bulk copy through a (pinned, when CUDA) staging buffer, scatters on
  the other side. With CUDA it uses separate streams for offload and onboard and waits on a
  blocking CUDA event (no spinning). Its CUDA parts cannot be measured on a CPU-only machine;
  ``stage_all=True`` runs the same code on CPU tensors so tests cover the logic.

:func:`~kvstrata.physical.engines.default_copy_engine` picks the engine a machine uses. :func:`native_kernel_status` says whether the native kernel loaded
(and why not); ``engine.kernel`` says which kernel an engine uses (``"native"``/``"python"``).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import math
import os
import threading
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import xxhash

from ..protocol.layout import FullyContiguousLayout, Granularity, Layout
from .storage.base import BlockMemory

__all__ = ["PiecePlan", "plan_pieces", "CopyEngine", "MemmoveCopyEngine", "TorchCopyEngine",
           "StagedCopyEngine", "packed_memory", "native_kernel_status"]

OFFLOAD, ONBOARD = "offload", "onboard"


def _load_native():
    """The native batched-copy kernel, or ``(None, why not)``."""
    if os.environ.get("KVSTRATA_NATIVE_COPY", "1").strip().lower() in ("0", "false", "no", "off"):
        return None, "disabled by KVSTRATA_NATIVE_COPY"
    if importlib.util.find_spec(f"{__package__}._copykernel") is None:
        return None, ("not built (an optional extension: `pip install -e .` compiles it with "
                      "gcc and the Python headers, and installs without it if that fails)")
    try:
        from . import _copykernel
    except ImportError as exc:   # built for another interpreter, missing symbols, ...
        return None, f"failed to load: {exc}"
    return _copykernel, None


_native, NATIVE_KERNEL_ERROR = _load_native()
NATIVE_KERNEL = _native is not None


def native_kernel_status() -> dict:
    """Whether the native copy kernel is available: ``{"available": bool, "reason": str|None,
    "streaming_stores": bool}`` (``reason`` says why not, e.g. it failed to build)."""
    return {"available": NATIVE_KERNEL, "reason": NATIVE_KERNEL_ERROR,
            "streaming_stores": bool(_native is not None and _native.HAVE_STREAM)}


@dataclass(frozen=True)
class PiecePlan:
    """Flat arrays describing a batch copy as ``length``-byte pieces."""

    src_region: np.ndarray
    src_offset: np.ndarray
    dst_region: np.ndarray
    dst_offset: np.ndarray
    length: int
    granularity: Granularity


def plan_pieces(src: Layout, src_ids: Sequence[int], dst: Layout,
                dst_ids: Sequence[int]) -> PiecePlan:
    """Pieces to copy blocks ``src_ids`` of ``src`` to ``dst_ids`` of ``dst``.

    Raises :class:`~kvstrata.physical.errors.LayoutMismatchError` for incompatible layouts,
    ``ValueError`` for unequal batch lengths and ``IndexError`` for ids out of range.
    """
    src.require_compatible(dst)
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source ids but {len(dst_ids)} destination ids")
    gran = max(src.contiguous_granularity, dst.contiguous_granularity)
    sr, so = src.pieces(src_ids, gran)
    dr, do = dst.pieces(dst_ids, gran)
    return PiecePlan(sr.reshape(-1), so.reshape(-1), dr.reshape(-1), do.reshape(-1),
                     src.piece_bytes(gran), gran)


def block_checksums(memory: BlockMemory, block_ids: Sequence[int]) -> list[int]:
    """The xxh3-64 of each block's payload as it would lie FullyContiguous (layer, K/V,
    tokens x elements), read in place from host ``memory`` of any layout (streamed over the
    block's pieces): the checksum a copy into G2 records."""
    if memory.device.type != "cpu":
        raise ValueError(f"block_checksums reads host memory only, got {memory.device}")
    layout = memory.layout
    gran = layout.contiguous_granularity
    regions, offsets = layout.pieces(np.asarray(block_ids, dtype=np.int64), gran)
    length = layout.piece_bytes(gran)
    arrays = [r.numpy() for r in memory.regions]
    digest = xxhash.xxh3_64_intdigest
    out = []
    for rs, offs in zip(regions.tolist(), offsets.tolist()):
        if len(rs) == 1:
            out.append(digest(arrays[rs[0]][offs[0]:offs[0] + length]))
            continue
        state = xxhash.xxh3_64()
        for r, o in zip(rs, offs):
            state.update(arrays[r][o:o + length])
        out.append(state.intdigest())
    return out


def packed_memory(like: Layout, num_blocks: int, region: torch.Tensor) -> BlockMemory:
    """A FullyContiguous, unpadded :class:`BlockMemory` of ``num_blocks`` blocks with the
    geometry of ``like``, over the first bytes of the ``uint8`` tensor ``region``."""
    layout = FullyContiguousLayout(like.config.with_blocks(num_blocks).with_alignment(1))
    return BlockMemory(layout, (region[:layout.region_bytes(0)],))


class CopyEngine(ABC):
    """Copies batches of blocks between two :class:`BlockMemory`."""

    name = "abstract"

    @property
    def kernel(self) -> str:
        """Which host copy kernel runs: ``"native"`` (C extension) or ``"python"`` (numpy /
        torch / ctypes kernels); engines without a host kernel report their name."""
        return self.name

    @abstractmethod
    def copy(self, src: BlockMemory, src_ids: Sequence[int], dst: BlockMemory,
             dst_ids: Sequence[int], *, direction: str = OFFLOAD) -> int:
        """Copy the batch; returns payload bytes moved. Blocks until the bytes are in place."""

    def copy_hashed(self, src: BlockMemory, src_ids: Sequence[int], dst: BlockMemory,
                    dst_ids: Sequence[int], *, direction: str = OFFLOAD,
                    slice_bytes: int = 8 << 20, from_source: bool = False) -> list[int]:
        """:meth:`copy`, plus the xxh3-64 of each block's payload (``dst`` must be a host
        FullyContiguous memory, e.g. G2). This default copies in slices of about
        ``slice_bytes`` and hashes each slice right after; engines override it to hash while
        the bytes are still in cache.

        ``from_source``: hash the *source* blocks (host memory only), each slice just before
        it is copied (so the copy reads it from cache): the checksum is then the one of the
        bytes the engine produced, and a byte that changes in the destination at any moment
        after is caught by the next verified read (:func:`block_checksums`)."""
        if not isinstance(dst.layout, FullyContiguousLayout):
            raise ValueError("copy_hashed needs a FullyContiguous destination")
        region = dst.regions[0].numpy()
        stride, nbytes = dst.layout.block_stride, dst.layout.config.block_bytes
        step = max(1, slice_bytes // max(1, nbytes))
        sums: list[int] = []
        if from_source:
            return self._copy_hashing_source(src, src_ids, dst, dst_ids, direction, step)
        for first in range(0, len(src_ids), step):
            part = list(dst_ids[first:first + step])
            self.copy(src, src_ids[first:first + step], dst, part, direction=direction)
            sums.extend(xxhash.xxh3_64_intdigest(region[b * stride:b * stride + nbytes])
                        for b in part)
        return sums

    def copy_checked(self, src: BlockMemory, src_ids: Sequence[int], dst: BlockMemory,
                     dst_ids: Sequence[int], check, *, direction: str = ONBOARD,
                     slice_bytes: int = 8 << 20) -> list[int]:
        """Copy the blocks that pass ``check``: ``check(lo, hi)`` examines batch positions
        ``[lo, hi)`` and returns those that may be copied (recording why the others may
        not); returns the positions copied. This default checks the whole batch, then copies
        what passed in one call; an engine that copies asynchronously checks each slice
        while the slice before it copies (:class:`~.device_copy.DeviceCopyEngine`)."""
        good = check(0, len(src_ids))
        if len(good) == len(src_ids):
            self.copy(src, src_ids, dst, dst_ids, direction=direction)
        elif good:
            self.copy(src, np.asarray(src_ids)[good], dst, np.asarray(dst_ids)[good],
                      direction=direction)
        return good

    def _copy_hashing_source(self, src, src_ids, dst, dst_ids, direction, step) -> list[int]:
        """Hash each slice of the source, then copy it (the hash is always taken before its
        bytes are copied). Slices are large: a copy call per slice costs more than the cache
        a small slice would save (measured: 16-32 MiB slices run at 0.55-0.6 of the
        destination-hashing copy, 1-2 MiB ones at 0.25-0.4; hashing on a helper thread while
        the copy runs was slower still)."""
        step = max(step, -(-(32 << 20) // max(1, dst.layout.config.block_bytes)))
        sums: list[int] = []
        for first in range(0, len(src_ids), step):
            part_src = list(src_ids[first:first + step])
            sums.extend(block_checksums(src, part_src))
            self.copy(src, part_src, dst, list(dst_ids[first:first + step]),
                      direction=direction)
        return sums

    def close(self) -> None:
        """Release threads and buffers."""


# ----------------------------------------------------------------------------- host
_memmove = ctypes.memmove   # a ctypes foreign function: releases the GIL while copying


_CPUS = max(1, os.cpu_count() or 1)


def _run_memmoves(dst: list[int], src: list[int], lengths: list[int]) -> None:
    for d, s, n in zip(dst, src, lengths):
        _memmove(d, s, n)


def _memmove_runner(dst: np.ndarray, src: np.ndarray, lengths: np.ndarray) -> None:
    _run_memmoves(dst.tolist(), src.tolist(), lengths.tolist())


def _piece_addresses(src: BlockMemory, s_idx: np.ndarray, dst: BlockMemory, d_idx: np.ndarray,
                     gran: Granularity) -> tuple[np.ndarray, np.ndarray, int]:
    """Source and destination addresses ``[len(ids), pieces per block]`` (``int64``) of the
    batch's ``gran`` pieces, and the piece length."""
    sr, so = src.layout.pieces(s_idx, gran)
    dr, do = dst.layout.pieces(d_idx, gran)
    return (src.base_addresses()[sr] + so, dst.base_addresses()[dr] + do,
            src.layout.piece_bytes(gran))


class _Span:
    """All regions of a host :class:`BlockMemory` seen as rows of one 2-D ``uint8`` array.

    The array covers the address range from the lowest region start to the highest region
    end, cut into rows of ``row`` bytes, where ``row`` divides every piece offset, stride and
    length of the layout. Any piece of any block is then a run of row numbers, so a whole
    batch — across all layers' regions — is gathered by one ``torch.index_select`` (a C loop
    of ``memcpy`` over rows, on torch's intra-op threads, GIL released) or scattered by one
    numpy fancy assignment (a C loop, GIL released). Only rows that belong to the regions
    are ever touched; the view itself owns nothing (the ``BlockMemory`` keeps the memory
    alive, and caches its span).
    """

    __slots__ = ("base", "row", "array", "tensor", "bases")

    def __init__(self, mem: BlockMemory, row: int) -> None:
        bases = mem.base_addresses()
        ends = [int(b) + mem.layout.region_bytes(i) for i, b in enumerate(bases)]
        self.base = int(bases.min())
        self.row = row
        self.bases = bases - self.base
        rows = (max(ends) - self.base) // row
        raw = (ctypes.c_uint8 * (rows * row)).from_address(self.base)
        self.array = np.ctypeslib.as_array(raw).reshape(rows, row)
        self.tensor = torch.from_numpy(self.array)

    @staticmethod
    def row_bytes(mem: BlockMemory) -> int:
        """Largest row size that divides every piece address offset of ``mem``."""
        layout, cfg = mem.layout, mem.layout.config
        g = math.gcd(cfg.chunk_bytes, layout.block_stride)
        if not isinstance(layout, FullyContiguousLayout):
            g = math.gcd(g, layout.outer_stride)
        bases = mem.base_addresses()
        for b in (bases - bases.min()).tolist():
            g = math.gcd(g, b)
        return g

    @classmethod
    def of(cls, mem: BlockMemory, row: int) -> "_Span":
        cache = mem.__dict__.setdefault("_spans", {})   # BlockMemory is frozen: a cache
        span = cache.get(row)
        if span is None:
            span = cache[row] = cls(mem, row)
        return span

    def rows(self, layout: Layout, ids: np.ndarray, gran: Granularity) -> np.ndarray:
        """Row numbers ``[len(ids), block_bytes // row]`` of blocks ``ids``, in payload order."""
        region, offset = layout.pieces(ids, gran)
        start = (self.bases[region] + offset) // self.row
        per_piece = layout.piece_bytes(gran) // self.row
        if per_piece == 1:
            return start
        return (start[:, :, None] + np.arange(per_piece)).reshape(len(ids), -1)


class MemmoveCopyEngine(CopyEngine):
    """Host <-> host copies, the CPU data path (the name is historical).

    **Native kernel** (``kernel == "native"``; the default when the ``_copykernel`` extension
    loaded, ``native=False`` forces the Python kernels below, ``native=True`` requires it):
    the batch's piece addresses are computed with numpy, pieces adjacent on both sides are
    merged, and one C call copies them all with the GIL released, its bytes split evenly over
    ``threads`` pthreads (capped at ``os.cpu_count()``) when the batch has at least
    ``parallel_bytes``. Batches of at least ``stream_bytes`` (much larger than the cache) use
    non-temporal stores (no read-for-ownership of the destination, no cache eviction);
    ``prefetch`` warms each next piece while the current one is copied. :meth:`copy_hashed`
    copies ``tile_bytes`` windows of blocks per call (cached stores) and hashes each block
    right after, the batch split over ``threads`` Python threads.

    **Python kernels** (``kernel == "python"``): both memories are viewed as *rows* (:class:`_Span`): the largest unit that divides every
    piece of both layouts (typically 4 KiB, or a whole K/V chunk). A batch becomes two arrays
    of row numbers, and the copy runs in C with a handful of Python calls per batch:

    * destination FullyContiguous and blocks of at least ``direct_block_bytes``: one
      ``torch.index_select(src_rows, out=dst_block)`` per block, straight into the block;
    * source FullyContiguous and blocks of at least ``scatter_block_bytes``: one numpy
      assignment ``dst_rows[idx] = block`` per block, straight from the block;
    * FullyContiguous on both sides and blocks of at least ``parallel_piece``: one
      ``memmove`` per block (per run of adjacent blocks);
    * otherwise (small blocks, e.g. 64 KiB vLLM blocks): per tile of ``tile_bytes``
      (cache-sized) one ``index_select`` gathers the rows into a private buffer and one numpy
      assignment scatters them (two passes, the second from cache).

    ``threads`` Python threads (this one plus helpers) split a batch of at least
    ``parallel_bytes``; every kernel call releases the GIL. If a layout pair only allows rows
    smaller than ``min_row_bytes``, pieces are copied with one ``memmove`` each instead.
    :meth:`copy_hashed` also returns the xxh3-64 of every destination block, hashed right
    after each block/tile is written, while its bytes are still in cache, in cache-sized
    segments of ``hash_window_bytes`` for big blocks (xxh3 streaming = one-shot digest).
    ``parallel_piece`` is also the memmove kernel's threshold for using the helper threads.
    """

    name = "memmove"

    def __init__(self, threads: int = 2, parallel_piece: int = 32 << 10,
                 parallel_bytes: int = 1 << 20, *, direct_block_bytes: int = 256 << 10,
                 scatter_block_bytes: int = 64 << 10, tile_bytes: int = 2 << 20,
                 hash_window_bytes: int = 256 << 10,
                 min_row_bytes: int = 64, pipeline_hash: bool = True,
                 native: bool | None = None, stream_bytes: int = 4 << 20,
                 prefetch: bool = True) -> None:
        if native and _native is None:
            raise RuntimeError(f"native copy kernel unavailable ({NATIVE_KERNEL_ERROR})")
        self._native = _native if native is not False else None
        self.stream_bytes = stream_bytes
        self.prefetch = prefetch
        self.pipeline_hash = pipeline_hash
        self.threads = max(1, threads)
        self.parallel_piece = parallel_piece
        self.parallel_bytes = parallel_bytes
        self.direct_block_bytes = direct_block_bytes
        self.scatter_block_bytes = scatter_block_bytes
        self.tile_bytes = tile_bytes
        self.hash_window_bytes = hash_window_bytes
        self.min_row_bytes = min_row_bytes
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._local = threading.local()

    @property
    def kernel(self) -> str:
        return "native" if self._native is not None else "python"

    def copy(self, src, src_ids, dst, dst_ids, *, direction=OFFLOAD) -> int:
        return self._copy(src, src_ids, dst, dst_ids, None)

    def copy_hashed(self, src, src_ids, dst, dst_ids, *, direction=OFFLOAD,
                    slice_bytes: int = 8 << 20, from_source: bool = False) -> list[int]:
        if from_source:                  # hash the source slice, then copy it from cache
            return CopyEngine.copy_hashed(self, src, src_ids, dst, dst_ids,
                                          direction=direction, slice_bytes=slice_bytes,
                                          from_source=True)
        if not isinstance(dst.layout, FullyContiguousLayout):
            raise ValueError("copy_hashed needs a FullyContiguous destination")
        sums: list[int] = [0] * len(dst_ids)
        self._copy(src, src_ids, dst, dst_ids, sums)
        return sums

    # ------------------------------------------------------------------ internals
    def _copy(self, src: BlockMemory, src_ids, dst: BlockMemory, dst_ids,
              sums: list[int] | None) -> int:
        for mem in (src, dst):
            if mem.device.type != "cpu":
                raise ValueError(f"{self.name} engine copies host memory only, got {mem.device}")
        src.layout.require_compatible(dst.layout)
        n = len(src_ids)
        if n != len(dst_ids):
            raise ValueError(f"{n} source ids but {len(dst_ids)} destination ids")
        if n == 0:
            return 0
        s_idx = _checked_ids(src_ids, src.layout.config.num_blocks)
        d_idx = _checked_ids(dst_ids, dst.layout.config.num_blocks)
        cfg = src.layout.config
        nbytes = cfg.block_bytes
        total = n * nbytes
        gran = max(src.layout.contiguous_granularity, dst.layout.contiguous_granularity)
        row = math.gcd(_row_bytes(src), _row_bytes(dst))
        hasher = None
        if sums is not None:
            host = dst.regions[0].numpy()
            hasher = (memoryview(host), dst.layout.block_stride, nbytes, d_idx, sums,
                      self.hash_window_bytes)
        both_fc = (isinstance(src.layout, FullyContiguousLayout)
                   and isinstance(dst.layout, FullyContiguousLayout))
        if self._native is not None:
            s_addr, d_addr, length = _piece_addresses(src, s_idx, dst, d_idx, gran)
            if hasher is None:   # one C call for the whole batch
                s, d, lengths = _coalesce(s_addr.reshape(-1), d_addr.reshape(-1), length)
                threads = self.threads if total >= self.parallel_bytes else 1
                self._native.copy_pieces(d, s, lengths, min(threads, _CPUS),
                                         total >= self.stream_bytes, self.prefetch)
                return total
            # eager checksums: a window of blocks per call, hashed right behind (in cache)
            run = self._native.copy_pieces
            prefetch = self.prefetch
            job = ("memmove", s_addr, d_addr, length,
                   lambda d, s, n: run(d, s, n, 1, False, prefetch))
            window = max(1, self.tile_bytes // nbytes)
            parallel = True
        elif row < self.min_row_bytes or (both_fc and nbytes >= self.parallel_piece):
            # whole blocks on both sides: one memmove per block (per run of adjacent blocks)
            job = self._memmove_job(src, s_idx, dst, d_idx, gran)
            window = max(1, self.hash_window_bytes // nbytes)
            parallel = src.layout.piece_bytes(gran) >= self.parallel_piece
        else:
            s_span, d_span = _Span.of(src, row), _Span.of(dst, row)
            s_rows = s_span.rows(src.layout, s_idx, gran)
            src_fc = isinstance(src.layout, FullyContiguousLayout)
            dst_fc = isinstance(dst.layout, FullyContiguousLayout)
            if dst_fc and nbytes >= self.direct_block_bytes:
                kind, d_rows = "gather", None
            elif src_fc and nbytes >= self.scatter_block_bytes:
                kind, d_rows = "scatter", d_span.rows(dst.layout, d_idx, gran)
            else:
                kind, d_rows = "tile", d_span.rows(dst.layout, d_idx, gran)
            job = (kind, self._local, s_span, torch.from_numpy(s_rows), d_span, d_rows,
                   src, s_idx, dst, d_idx, row)
            window = 1 if kind != "tile" else max(1, self.tile_bytes // nbytes)
            parallel = True
        parts = self.threads if parallel and total >= self.parallel_bytes else 1
        parts = min(parts, -(-n // window))
        if (hasher is not None and parts > 1 and job[0] == "gather"
                and self.pipeline_hash):   # eager G2 checksums of big blocks
            # Big blocks into G2: this thread copies block i+1 while a helper hashes block i.
            pool = self._get_pool()
            view, stride_, nb_, _, _, _ = hasher
            futures = []
            for i in range(n):
                _run_part(job, i, i + 1, 1, None)
                off = int(d_idx[i]) * stride_
                futures.append(pool.submit(xxhash.xxh3_64_intdigest, view[off:off + nb_]))
            for i, f in enumerate(futures):
                sums[i] = f.result()
            return total
        if parts <= 1:
            _run_part(job, 0, n, window, hasher)
            return total
        pool = self._get_pool()
        bounds = [n * i // parts for i in range(parts + 1)]
        futures = [pool.submit(_run_part, job, bounds[i], bounds[i + 1], window, hasher)
                   for i in range(1, parts)]
        try:
            _run_part(job, bounds[0], bounds[1], window, hasher)   # this thread helps
        finally:
            for f in futures:
                f.result()
        return total

    def _memmove_job(self, src, s_idx, dst, d_idx, gran):
        return ("memmove", *_piece_addresses(src, s_idx, dst, d_idx, gran), _memmove_runner)

    def _get_pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads - 1 or 1,
                                                thread_name_prefix="kvstrata-memmove")
            return self._pool

    def close(self) -> None:
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        super().close()


def _row_bytes(mem: BlockMemory) -> int:
    cached = mem.__dict__.get("_row_bytes")
    if cached is None:
        cached = _Span.row_bytes(mem)
        object.__setattr__(mem, "_row_bytes", cached)
    return cached


def _checked_ids(ids, num_blocks: int) -> np.ndarray:
    idx = np.asarray(ids, dtype=np.int64).reshape(-1)
    if idx.size and (idx.min() < 0 or idx.max() >= num_blocks):
        raise IndexError(f"block id out of range [0, {num_blocks})")
    return idx


def _block_rows(mem: BlockMemory, block: int, row: int) -> np.ndarray:
    """Payload of FullyContiguous block ``block`` as ``[block_bytes // row, row]``."""
    layout = mem.layout
    start = block * layout.block_stride
    region = mem.regions[0].numpy()
    return region[start:start + layout.config.block_bytes].reshape(-1, row)


def _run_part(job, lo: int, hi: int, window: int, hasher) -> None:
    """Copy blocks ``[lo, hi)`` of a batch, ``window`` blocks per step; with ``hasher``
    (memoryview, stride, payload bytes, dst ids, out list, segment bytes) hash each
    destination block right after it is written."""
    if hasher is not None:
        view, stride, nbytes, h_idx, sums, segment = hasher
        digest = xxhash.xxh3_64_intdigest
    kind = job[0]
    if kind == "memmove":   # piece addresses, copied by runner(dst, src, lengths)
        _, s_addr, d_addr, length, runner = job
        for w in range(lo, hi, window):
            e = min(w + window, hi)
            s, d, lengths = _coalesce(s_addr[w:e].reshape(-1), d_addr[w:e].reshape(-1), length)
            runner(d, s, lengths)
            if hasher is not None:
                for i, off in zip(range(w, e), (h_idx[w:e] * stride).tolist()):
                    sums[i] = digest(view[off:off + nbytes])
        return
    _, local, s_span, s_rows, d_span, d_rows, src, s_idx, dst, d_idx, row = job
    if kind == "gather":
        region = dst.regions[0].numpy()
        d_stride, nbytes_ = dst.layout.block_stride, dst.layout.config.block_bytes
        per_seg = max(1, (hasher[5] if hasher is not None else nbytes_) // row)
        for i in range(lo, hi):
            off = int(d_idx[i]) * d_stride
            out = torch.from_numpy(region[off:off + nbytes_].reshape(-1, row))
            rows = s_rows[i]
            if hasher is None or nbytes_ <= segment:
                torch.index_select(s_span.tensor, 0, rows, out=out)
                if hasher is not None:
                    sums[i] = digest(view[off:off + nbytes_])
                continue
            state = xxhash.xxh3_64()   # big block: copy and hash segment by segment
            for k in range(0, rows.numel(), per_seg):
                torch.index_select(s_span.tensor, 0, rows[k:k + per_seg],
                                   out=out[k:k + per_seg])
                state.update(view[off + k * row:off + min(k + per_seg, rows.numel()) * row])
            sums[i] = state.intdigest()
        return
    if kind == "scatter":
        target = d_span.array
        for i in range(lo, hi):
            target[d_rows[i]] = _block_rows(src, int(s_idx[i]), row)
            if hasher is not None:
                off = int(h_idx[i]) * stride
                sums[i] = digest(view[off:off + nbytes])
        return
    # tile: gather a cache-sized tile of blocks into a private buffer, then scatter it
    per_block = s_rows.shape[1]
    need = window * per_block * row
    buf = getattr(local, "buf", None)
    if buf is None or buf.numel() < need:
        buf = local.buf = torch.empty(need, dtype=torch.uint8)
    target = d_span.array
    for w in range(lo, hi, window):
        e = min(w + window, hi)
        count = (e - w) * per_block
        tile = buf[:count * row].view(count, row)
        torch.index_select(s_span.tensor, 0, s_rows[w:e].reshape(-1), out=tile)
        target[d_rows[w:e].reshape(-1)] = tile.numpy()
        if hasher is not None:
            for i, off in zip(range(w, e), (h_idx[w:e] * stride).tolist()):
                sums[i] = digest(view[off:off + nbytes])


def _coalesce(src: np.ndarray, dst: np.ndarray, length: int):
    """Merge pieces that continue both the previous source and destination piece."""
    n = src.size
    joins = np.zeros(n, dtype=bool)
    if n > 1:
        joins[1:] = (src[1:] == src[:-1] + length) & (dst[1:] == dst[:-1] + length)
    starts = np.flatnonzero(~joins)
    counts = np.diff(np.append(starts, n))
    return src[starts], dst[starts], counts * length


# ----------------------------------------------------------------------------- torch
def _piece_views(mem: BlockMemory, gran: Granularity) -> list[torch.Tensor]:
    """Per layer (or one for all layers when the layout is FullyContiguous at BLOCK
    granularity), a strided ``uint8`` view ``[num_blocks, pieces, piece_bytes]``."""
    layout, cfg = mem.layout, mem.layout.config
    piece = layout.piece_bytes(gran)
    per_layer = {Granularity.BLOCK: 0, Granularity.LAYER: 1, Granularity.CHUNK: cfg.outer_dim}
    layers = [None] if gran is Granularity.BLOCK else range(cfg.num_layers)
    views = []
    for layer in layers:
        l_idx = np.asarray(0 if layer is None else layer)
        region, base = layout._offsets(np.asarray(0), l_idx, np.asarray(0))
        _, next_block = layout._offsets(np.asarray(1), l_idx, np.asarray(0))
        _, next_outer = layout._offsets(np.asarray(0), l_idx, np.asarray(1))
        pieces = per_layer[gran] or 1
        views.append(torch.as_strided(mem.regions[int(region)], (cfg.num_blocks, pieces, piece),
                                      (int(next_block - base), int(next_outer - base), 1),
                                      int(base)))
    return views


class TorchCopyEngine(CopyEngine):
    """Same-device copies with ``index_select`` + ``index_copy_``, one pair per layer."""

    name = "torch"

    def copy(self, src, src_ids, dst, dst_ids, *, direction=OFFLOAD) -> int:
        if src.device != dst.device:
            raise ValueError(f"{self.name} engine copies within one device, got "
                             f"{src.device} -> {dst.device}")
        src.layout.require_compatible(dst.layout)
        if len(src_ids) != len(dst_ids):
            raise ValueError(f"{len(src_ids)} source ids but {len(dst_ids)} destination ids")
        src.layout.pieces(src_ids, Granularity.CHUNK)   # range checks
        dst.layout.pieces(dst_ids, Granularity.CHUNK)
        if not len(src_ids):
            return 0
        gran = max(src.layout.contiguous_granularity, dst.layout.contiguous_granularity)
        s_idx = torch.as_tensor(np.asarray(src_ids, dtype=np.int64), device=src.device)
        d_idx = torch.as_tensor(np.asarray(dst_ids, dtype=np.int64), device=dst.device)
        for s_view, d_view in zip(_piece_views(src, gran), _piece_views(dst, gran)):
            d_view.index_copy_(0, d_idx, s_view.index_select(0, s_idx))
        return len(src_ids) * src.layout.config.block_bytes


# ----------------------------------------------------------------------------- staged
class StagedCopyEngine(CopyEngine):
    """Device <-> host copies through one bulk transfer per batch (see module docstring)."""

    name = "staged"

    def __init__(self, *, host_engine: CopyEngine | None = None,
                 device_engine: CopyEngine | None = None, stage_all: bool = False) -> None:
        self.host_engine = host_engine or MemmoveCopyEngine()
        self.device_engine = device_engine or TorchCopyEngine()
        self.stage_all = stage_all
        self._streams: dict[tuple[str, str], object] = {}
        self._lock = threading.Lock()

    def copy(self, src, src_ids, dst, dst_ids, *, direction=OFFLOAD) -> int:
        cpu = torch.device("cpu")
        if src.device == dst.device and not self.stage_all:
            engine = self.host_engine if src.device == cpu else self.device_engine
            with self._stream(direction, src.device):
                moved = engine.copy(src, src_ids, dst, dst_ids, direction=direction)
                self._wait(src.device)
            return moved
        if len(src_ids) != len(dst_ids):
            raise ValueError(f"{len(src_ids)} source ids but {len(dst_ids)} destination ids")
        src.layout.require_compatible(dst.layout)
        n = len(src_ids)
        if n == 0:
            return 0
        nbytes = n * src.layout.config.block_bytes
        packed_ids = list(range(n))
        # Source side: pack the batch contiguously on the source device.
        src_packed = packed_memory(src.layout, n, torch.empty(nbytes, dtype=torch.uint8,
                                                              device=src.device))
        dst_packed = packed_memory(src.layout, n, self._staging(nbytes, dst.device, src.device))
        device = src.device if src.device.type != "cpu" else dst.device
        with self._stream(direction, device):
            self._engine_for(src.device).copy(src, src_ids, src_packed, packed_ids,
                                              direction=direction)
            dst_packed.regions[0].copy_(src_packed.regions[0], non_blocking=True)
            self._wait(device)
            self._engine_for(dst.device).copy(dst_packed, packed_ids, dst, dst_ids,
                                              direction=direction)
            self._wait(device)
        return nbytes

    @property
    def kernel(self) -> str:
        return self.host_engine.kernel

    def _engine_for(self, device: torch.device) -> CopyEngine:
        return self.host_engine if device.type == "cpu" else self.device_engine

    def _staging(self, nbytes: int, device: torch.device, other: torch.device) -> torch.Tensor:
        pin = device.type == "cpu" and other.type == "cuda"
        return torch.empty(nbytes, dtype=torch.uint8, device=device, pin_memory=pin)

    def _stream(self, direction: str, device: torch.device):
        """A dedicated CUDA stream per (direction, device); a no-op context on CPU."""
        if device.type != "cuda":
            return contextlib.nullcontext()
        key = (direction, str(device))
        with self._lock:
            if key not in self._streams:
                self._streams[key] = torch.cuda.Stream(device=device)
            stream = self._streams[key]
        return torch.cuda.stream(stream)

    @staticmethod
    def _wait(device: torch.device) -> None:
        """Block this thread (sleeping, not spinning) until the current stream's work is done."""
        if device.type == "cuda":
            event = torch.cuda.Event(blocking=True)
            event.record()
            event.synchronize()

    def close(self) -> None:
        self.host_engine.close()
        self.device_engine.close()
