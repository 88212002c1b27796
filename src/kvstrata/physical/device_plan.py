"""The device copy's plan: a batch of blocks as equal pieces, addressed from one base.

The indexing logic of the GPU data path (:mod:`.device_copy`), pure numpy so the CPU tests
check it: the piece addresses of both layouts (the coarsest piece both keep contiguous, as
the host engines use), pieces over a size split so a large block spreads over many streaming
multiprocessors, and every address counted from the lowest region start of its side in the
widest unit (up to 16 bytes) that divides every piece start and length, which is what lets
the kernel move 16 bytes per instruction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .copy import _checked_ids, _piece_addresses
from .storage.base import BlockMemory

__all__ = ["DevicePiecePlan", "plan_device_pieces"]


@dataclass(frozen=True)
class DevicePiecePlan:
    """A batch as ``len(src_units)`` pieces of ``piece_bytes`` each: piece ``i`` starts
    ``src_units[i] * unit_bytes`` bytes after the start of region ``src_base`` of the source
    and lands ``dst_units[i] * unit_bytes`` after region ``dst_base`` of the destination."""

    src_base: int
    dst_base: int
    src_units: np.ndarray
    dst_units: np.ndarray
    unit_bytes: int
    piece_bytes: int

    @property
    def pieces(self) -> int:
        return int(self.src_units.size)


def _largest_power_of_two_dividing(value: int, cap: int = 16) -> int:
    unit = 1
    while unit < cap and value % (unit * 2) == 0:
        unit *= 2
    return unit


def _split(length: int, max_piece: int) -> int:
    """How many equal parts to cut a ``length``-byte piece into so that each is at most
    ``max_piece`` bytes and 16-byte aligned where possible (1 if none fits)."""
    if length <= max_piece:
        return 1
    for parts in range(-(-length // max_piece), length // 16 + 1):
        if length % parts == 0 and (length // parts) % 16 == 0:
            return parts
    return 1


def plan_device_pieces(src: BlockMemory, src_ids: Sequence[int], dst: BlockMemory,
                       dst_ids: Sequence[int], *,
                       max_piece_bytes: int = 64 << 10) -> DevicePiecePlan:
    """The device kernel's plan for copying blocks ``src_ids`` of ``src`` to ``dst_ids`` of
    ``dst`` (see the module docstring). Raises like :func:`~kvstrata.physical.copy.plan_pieces`
    (incompatible layouts, unequal lengths, ids out of range)."""
    src.layout.require_compatible(dst.layout)
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source ids but {len(dst_ids)} destination ids")
    s_idx = _checked_ids(src_ids, src.layout.config.num_blocks)
    d_idx = _checked_ids(dst_ids, dst.layout.config.num_blocks)
    gran = max(src.layout.contiguous_granularity, dst.layout.contiguous_granularity)
    s_addr, d_addr, length = _piece_addresses(src, s_idx, dst, d_idx, gran)
    s_addr, d_addr = s_addr.reshape(-1), d_addr.reshape(-1)
    parts = _split(length, max_piece_bytes)
    if parts > 1:
        step = np.arange(parts, dtype=np.int64) * (length // parts)
        s_addr = (s_addr[:, None] + step).reshape(-1)
        d_addr = (d_addr[:, None] + step).reshape(-1)
        length //= parts
    s_bases, d_bases = src.base_addresses(), dst.base_addresses()
    s_base, d_base = int(np.argmin(s_bases)), int(np.argmin(d_bases))
    s_rel, d_rel = s_addr - s_bases[s_base], d_addr - d_bases[d_base]
    common = length
    for values in (s_rel, d_rel, s_bases[s_base:s_base + 1], d_bases[d_base:d_base + 1]):
        if values.size:
            common = int(np.gcd.reduce(np.append(values, common).astype(np.int64)))
    unit = _largest_power_of_two_dividing(common)
    return DevicePiecePlan(s_base, d_base, s_rel // unit, d_rel // unit, unit, length)
