"""Copy engines: move a batch of blocks between two :class:`BlockMemory` of compatible layouts.

``engine.copy(src, src_ids, dst, dst_ids, direction=...)`` copies block ``src_ids[i]`` of
``src`` to block ``dst_ids[i]`` of ``dst`` for the whole batch in one call, gathering or
scattering between layouts (e.g. LayerSeparate device tensors <-> FullyContiguous host blocks).
The unit moved is the coarsest piece both layouts keep contiguous (:func:`plan_pieces`): a
whole block between two FullyContiguous layouts, a layer or a K/V chunk otherwise.

* :class:`MemmoveCopyEngine` — host memory on both sides (the CPU path that runs here).
  Piece addresses are computed with numpy from the layouts, adjacent pieces are merged, and
  each remaining piece is one ``memmove`` with the GIL released; big pieces are split over a
  few threads. (On CPU, torch's ``index_copy_`` into strided rows measured 5-15x slower.)
* :class:`TorchCopyEngine` — ``index_select`` / ``index_copy_`` per layer on any single device
  (the device-side half of the CUDA path; also runs, slowly, on CPU tensors for tests).
* :class:`StagedCopyEngine` — device <-> host: gathers blocks into a packed buffer on the
  device, moves it in one bulk copy through a (pinned, when CUDA) staging buffer, scatters on
  the other side. With CUDA it uses separate streams for offload and onboard and waits on a
  blocking CUDA event (no spinning). Its CUDA parts cannot be measured on a CPU-only machine;
  ``stage_all=True`` runs the same code on CPU tensors so tests cover the logic.

:func:`default_copy_engine` picks ``StagedCopyEngine`` when CUDA is available, else
``MemmoveCopyEngine``.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from .layout import FullyContiguousLayout, Granularity, Layout
from .storage.base import BlockMemory

__all__ = ["PiecePlan", "plan_pieces", "CopyEngine", "MemmoveCopyEngine", "TorchCopyEngine",
           "StagedCopyEngine", "default_copy_engine", "packed_memory"]

OFFLOAD, ONBOARD = "offload", "onboard"


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


def packed_memory(like: Layout, num_blocks: int, region: torch.Tensor) -> BlockMemory:
    """A FullyContiguous, unpadded :class:`BlockMemory` of ``num_blocks`` blocks with the
    geometry of ``like``, over the first bytes of the ``uint8`` tensor ``region``."""
    layout = FullyContiguousLayout(like.config.with_blocks(num_blocks).with_alignment(1))
    return BlockMemory(layout, (region[:layout.region_bytes(0)],))


class CopyEngine(ABC):
    """Copies batches of blocks between two :class:`BlockMemory`."""

    name = "abstract"

    @abstractmethod
    def copy(self, src: BlockMemory, src_ids: Sequence[int], dst: BlockMemory,
             dst_ids: Sequence[int], *, direction: str = OFFLOAD) -> int:
        """Copy the batch; returns payload bytes moved. Blocks until the bytes are in place."""

    def close(self) -> None:
        """Release threads and buffers."""


# ----------------------------------------------------------------------------- memmove
_memmove = ctypes.memmove   # a ctypes foreign function: releases the GIL while copying


def _run_memmoves(dst: list[int], src: list[int], lengths: list[int]) -> None:
    for d, s, n in zip(dst, src, lengths):
        _memmove(d, s, n)


class MemmoveCopyEngine(CopyEngine):
    """Host <-> host copies as address lists executed with ``memmove``.

    ``threads`` helper threads split the work when pieces are at least ``parallel_piece``
    bytes and the batch moves at least ``parallel_bytes`` (small pieces do not gain: the GIL
    hand-off costs more than the copy).
    """

    name = "memmove"

    def __init__(self, threads: int = 2, parallel_piece: int = 32 << 10,
                 parallel_bytes: int = 1 << 20) -> None:
        self.threads = max(1, threads)
        self.parallel_piece = parallel_piece
        self.parallel_bytes = parallel_bytes
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def copy(self, src, src_ids, dst, dst_ids, *, direction=OFFLOAD) -> int:
        for mem in (src, dst):
            if mem.device.type != "cpu":
                raise ValueError(f"{self.name} engine copies host memory only, got {mem.device}")
        plan = plan_pieces(src.layout, src_ids, dst.layout, dst_ids)
        if plan.src_offset.size == 0:
            return 0
        s_addr = src.base_addresses()[plan.src_region] + plan.src_offset
        d_addr = dst.base_addresses()[plan.dst_region] + plan.dst_offset
        s_addr, d_addr, lengths = _coalesce(s_addr, d_addr, plan.length)
        total = int(lengths.sum())
        d_list, s_list, n_list = d_addr.tolist(), s_addr.tolist(), lengths.tolist()
        parts = self.threads if (total >= self.parallel_bytes and
                                 total // len(n_list) >= self.parallel_piece) else 1
        if parts == 1 or len(n_list) < parts:
            _run_memmoves(d_list, s_list, n_list)
        else:
            pool = self._get_pool()
            step = -(-len(n_list) // parts)
            futures = [pool.submit(_run_memmoves, d_list[i:i + step], s_list[i:i + step],
                                   n_list[i:i + step]) for i in range(step, len(n_list), step)]
            _run_memmoves(d_list[:step], s_list[:step], n_list[:step])  # this thread helps
            for f in futures:
                f.result()
        return total

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
        s_idx = torch.as_tensor(list(src_ids), dtype=torch.long, device=src.device)
        d_idx = torch.as_tensor(list(dst_ids), dtype=torch.long, device=dst.device)
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


def default_copy_engine() -> CopyEngine:
    """:class:`StagedCopyEngine` when CUDA is available, else :class:`MemmoveCopyEngine`."""
    return StagedCopyEngine() if torch.cuda.is_available() else MemmoveCopyEngine()
