"""The device copy's plan: a batch of blocks as equal pieces, addressed from one base.

The indexing logic of the GPU data path (:mod:`.device_copy`), pure numpy so the CPU tests
check it: the piece addresses of both layouts (the coarsest piece both keep contiguous, as
the host engines use), pieces over a size split so a large block spreads over many streaming
multiprocessors, and every address counted from the lowest region start of its side in the
widest unit (up to 16 bytes) that divides every piece start and length, which is what lets
the kernel move 16 bytes per instruction.

:func:`block_template` is the same plan for one block, once per pair of memories: in every
layout kvstrata addresses, piece ``p`` of block ``b`` starts ``template[p] + b * stride``
units after its side's base, so the copy kernel needs only the block ids of a batch (the
host plans nothing per batch). :func:`plan_device_pieces` gives every piece's address (the
DMA transport's copies).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .copy import _checked_ids, _piece_addresses
from .storage.base import BlockMemory

__all__ = ["BlockTemplate", "DevicePiecePlan", "block_template", "plan_device_pieces"]


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


@dataclass(frozen=True)
class BlockTemplate:
    """Where the pieces of any block lie on both sides of a pair of memories: piece ``p``
    of block ``b`` starts ``(src_units[p] + b * src_stride) * unit_bytes`` bytes after the
    start of region ``src_base`` of the source (likewise ``dst_*``), ``per_block`` pieces
    of ``piece_bytes`` to a block, in payload order. :attr:`device_offsets` holds the copy
    engine's copies of the offsets on each device, so they live and die with the template."""

    src_base: int
    dst_base: int
    src_units: np.ndarray
    dst_units: np.ndarray
    src_stride: int
    dst_stride: int
    unit_bytes: int
    piece_bytes: int
    device_offsets: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def per_block(self) -> int:
        return int(self.src_units.size)


def block_template(src: BlockMemory, dst: BlockMemory, *,
                   max_piece_bytes: int = 64 << 10) -> BlockTemplate | None:
    """The :class:`BlockTemplate` of a pair (raises like :func:`plan_device_pieces` for
    incompatible layouts), or None where a side's piece addresses are not the same for
    every block but for a fixed stride (no layout kvstrata builds; the caller copies such
    a pair another way). Checked on the first, second and last block of each side."""
    n_src, n_dst = src.layout.config.num_blocks, dst.layout.config.num_blocks
    # blocks 0 and 1 of each side (block 0 twice on a side of one block: stride 0)
    plan = plan_device_pieces(src, [0, min(1, n_src - 1)], dst, [0, min(1, n_dst - 1)],
                              max_piece_bytes=max_piece_bytes)
    per_block = plan.pieces // 2
    s_units = plan.src_units.reshape(2, per_block)
    d_units = plan.dst_units.reshape(2, per_block)
    strides = []
    for units in (s_units, d_units):
        step = units[1] - units[0]
        if np.any(step != step[0]):
            return None
        strides.append(int(step[0]))
    template = BlockTemplate(plan.src_base, plan.dst_base, s_units[0].copy(),
                             d_units[0].copy(), strides[0], strides[1], plan.unit_bytes,
                             plan.piece_bytes)
    last = plan_device_pieces(src, [n_src - 1], dst, [n_dst - 1],
                              max_piece_bytes=max_piece_bytes)
    for side, units, stride, n in (("src", last.src_units, strides[0], n_src),
                                   ("dst", last.dst_units, strides[1], n_dst)):
        base = getattr(last, f"{side}_base")
        expected = (getattr(template, f"{side}_units") + (n - 1) * stride) * plan.unit_bytes
        if (base != getattr(template, f"{side}_base") or units.size != per_block
                or not np.array_equal(units * last.unit_bytes, expected)):
            return None
    return template
