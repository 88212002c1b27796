"""Device staging for the GPU data path's ``staged`` transport (:mod:`.device_copy`).

A staged copy moves a slice of blocks between G1 and host memory in two steps: a kernel packs
the slice's blocks between G1's layout (pieces of a few KiB scattered over every layer's
tensor) and a device buffer laid out as the host side is (block after block), at device memory
speed; the GPU's copy engines (DMA) move the packed bytes across PCIe in one copy per run of
consecutive host slots. The copy engines reach the DMA limit only with large copies, and the
kernel holds streaming multiprocessors only for the short device-side pack.

The staging buffer holds a slice's blocks in the order of their host slots, not in the
order the batch names them (:func:`staging_order`): the pack kernel puts each block where its
slot's rank says, so a slice whose slots are one consecutive set in any order (a batch the
pool allocated from slots it freed together, which come back last-freed first; a returning
prefix stored by one offload) moves as one DMA copy.

This module holds the pieces that are not the copy itself: :func:`staging_order` and
:func:`host_runs` (the slice's host slots as runs of consecutive slots, pure numpy, checked
on CPU) and :class:`StagingRing` (device buffers one direction takes turns in, so the DMA of
one slice overlaps the pack of the next, and the stream the DMA runs on).
"""

from __future__ import annotations

import threading

import numpy as np
import torch

__all__ = ["staging_order", "host_runs", "staged_runs", "StagingRing"]


def staging_order(slots) -> tuple[np.ndarray, np.ndarray]:
    """Where each block of a staged slice goes in the staging buffer, and the slots in that
    order: ``(position, in_order)``, ``position[i]`` the rank of ``slots[i]`` among the
    slice's slots (ties in batch order) and ``in_order`` the slots sorted, so staging
    position ``j`` holds the block of slot ``in_order[j]``."""
    slots = np.asarray(slots, dtype=np.int64).reshape(-1)
    order = np.argsort(slots, kind="stable")
    position = np.empty(slots.size, dtype=np.int64)
    position[order] = np.arange(slots.size, dtype=np.int64)
    return position, slots[order]


def host_runs(slots, stride: int, block_bytes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The host slots of a staged slice as runs of consecutive slots: ``(first position in
    the slice, first slot, byte length)`` per run. Staging position ``j`` holds the block of
    ``slots[j]``, both laid out ``stride`` bytes apart, so a run of ``k`` consecutive slots is
    one copy of ``(k - 1) * stride + block_bytes`` bytes (the padding between blocks comes
    along; no reader looks at it)."""
    slots = np.asarray(slots, dtype=np.int64).reshape(-1)
    if not slots.size:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    breaks = np.flatnonzero(np.diff(slots) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [slots.size]))
    return starts, slots[starts], (ends - starts - 1) * stride + block_bytes


def staged_runs(slots, stride: int, block_bytes: int, min_average: int = 0
                ) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray]] | None:
    """How a slice with host slots ``slots`` is staged: ``(position, runs)``, each block's
    staging position (:func:`staging_order`) and the :func:`host_runs` of the slots in
    that order; None where its runs average under ``min_average`` bytes of blocks (a DMA
    copy each would cost more than moving the blocks through the copy kernel)."""
    position, in_order = staging_order(slots)
    runs = host_runs(in_order, stride, block_bytes)
    if position.size * block_bytes < min_average * runs[0].size:
        return None
    return position, runs


class StagingRing:
    """``depth`` device buffers (at least 2) that one direction's staged slices on one
    device take turns in, and the CUDA stream their DMA runs on. Callers hold :attr:`lock`
    from :meth:`take` to :meth:`release` so two threads' slices never share a buffer; the
    GPU orders the rest (a slice waits for the event of the last slice that used its
    buffer). With two, one slice's DMA overlaps the next slice's pack; more let packs run
    ahead of the DMA, which matters where the pack waits for SMs (a forward beside it
    holding them): each buffer is a slice's worth of device memory."""

    def __init__(self, device: torch.device, depth: int = 2) -> None:
        if depth < 2:
            raise ValueError(f"a staging ring needs at least 2 buffers, got {depth}")
        self.device = device
        self.lock = threading.Lock()
        self.dma_stream = torch.cuda.Stream(device=device)
        self._buffers: list[torch.Tensor | None] = [None] * depth
        self._released: list[torch.cuda.Event | None] = [None] * depth
        self._turn = 0

    def take(self, nbytes: int) -> tuple[torch.Tensor, "torch.cuda.Event | None"]:
        """The next buffer (at least ``nbytes``, as a 1-D ``uint8`` tensor of exactly that
        size) and the event its previous use ends with (None: never used); the caller makes
        its first step wait for that event."""
        turn = self._turn
        buffer = self._buffers[turn]
        released = self._released[turn]
        if buffer is None or buffer.numel() < nbytes:
            if released is not None:       # the old one may still be read: let it finish
                released.synchronize()
                released = None
            buffer = self._buffers[turn] = None
            # on the ring's own stream: the caching allocator hands out memory by stream,
            # and memory freed on the caller's stream may still be in use there. Zeroed:
            # a run copies the padding between blocks too, which must not carry whatever
            # the device memory held before.
            with torch.cuda.stream(self.dma_stream):
                buffer = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
            self.dma_stream.synchronize()
            self._buffers[turn] = buffer
        return buffer[:nbytes], released

    def release(self, event: "torch.cuda.Event") -> None:
        """The buffer :meth:`take` gave last is in use until ``event``; the next take gets
        the next one."""
        self._released[self._turn] = event
        self._turn = (self._turn + 1) % len(self._buffers)

    def close(self) -> None:
        """Wait for the last use of each buffer, then let them go."""
        with self.lock:
            for event in self._released:
                if event is not None:
                    event.synchronize()
            self._buffers = [None] * len(self._buffers)
            self._released = [None] * len(self._released)

    def nbytes(self) -> int:
        """Device memory the ring holds."""
        return sum(b.numel() for b in self._buffers if b is not None)
