"""The device copy kernels (Triton). A batch is ``n`` blocks of ``PER_BLOCK`` pieces of
``PIECE`` elements; every layout kvstrata addresses puts piece ``p`` of block ``b`` at the
same place relative to the block, so its start is ``(template[p] + b * stride) * UNIT``
elements after the side's base, with one ``template`` and ``stride`` per side
(:func:`kvstrata.physical.device_plan.block_template`). Piece ``q`` of the batch is piece
``q % PER_BLOCK`` of the block at batch position ``q // PER_BLOCK``, whose ids on the two
sides are ``src_ids`` / ``dst_ids``; program ``g`` copies pieces ``g * GROUP`` to
``g * GROUP + GROUP - 1`` (the last program's extra pieces copy the batch's last piece
again, harmlessly). The host sends only the block ids, so planning a slice costs next to
nothing whatever the layout.

Either side may be device memory or host memory mapped into the device's address space (G2
registered with CUDA): the loads and stores then cross PCIe. Offsets are counted in units of
``UNIT`` elements (16 bytes where the pieces allow), which tells the compiler every piece
start is that aligned, so each thread moves 16 bytes per instruction.

Imported only where Triton is installed (:mod:`kvstrata.physical.device_copy` says why not);
:func:`interpreted` runs the same kernel on CPU tensors through Triton's interpreter, which is
how tests without a GPU check it.
"""

import types

import triton
import triton.language as tl

__all__ = ["copy_blocks", "copy_blocks_summed", "interpreted"]


def _copy_blocks(src, dst, src_ids, dst_ids, src_template, dst_template, src_stride,
                 dst_stride, total, UNIT: tl.constexpr, PIECE: tl.constexpr,
                 BLOCK: tl.constexpr, GROUP: tl.constexpr, PER_BLOCK: tl.constexpr):
    for member in range(GROUP):
        piece = tl.minimum(tl.program_id(0) * GROUP + member, total - 1)
        at, part = piece // PER_BLOCK, piece % PER_BLOCK
        source = src + (tl.load(src_template + part)
                        + tl.load(src_ids + at) * src_stride) * UNIT
        target = dst + (tl.load(dst_template + part)
                        + tl.load(dst_ids + at) * dst_stride) * UNIT
        for start in range(0, PIECE, BLOCK):
            offsets = start + tl.arange(0, BLOCK)
            if PIECE % BLOCK == 0:
                tl.store(target + offsets, tl.load(source + offsets))
            else:
                inside = offsets < PIECE
                tl.store(target + offsets, tl.load(source + offsets, mask=inside), mask=inside)


def _copy_blocks_summed(src, dst, src_ids, dst_ids, src_template, dst_template, src_stride,
                        dst_stride, total, sums, UNIT: tl.constexpr, PIECE: tl.constexpr,
                        BLOCK: tl.constexpr, GROUP: tl.constexpr, PER_BLOCK: tl.constexpr,
                        LOG2_BLOCK: tl.constexpr, COPY: tl.constexpr):
    """:func:`_copy_blocks` over 64-bit words (with ``COPY`` false: no copy, only the sums),
    also writing to ``sums[q]`` piece ``q``'s share of its block's device checksum: the
    sum, modulo 2**64, of ``fmix64(word ^ (index + 1) * PHI)`` over its words, ``index``
    being the word's position in the block's payload (a block's pieces are in payload
    order). The host adds the shares of a block;
    :func:`kvstrata.physical.checksum.device_checksum` computes the same on the host."""
    for member in range(GROUP):
        slot = tl.program_id(0) * GROUP + member
        piece = tl.minimum(slot, total - 1)
        at, part = piece // PER_BLOCK, piece % PER_BLOCK
        source = src + (tl.load(src_template + part)
                        + tl.load(src_ids + at) * src_stride) * UNIT
        target = dst + (tl.load(dst_template + part)
                        + tl.load(dst_ids + at) * dst_stride) * UNIT
        first_word = part * PIECE
        acc = tl.full([BLOCK], 0, tl.uint64)   # tl.zeros is a jit function: _lanes_sum_by_halves
        for start in range(0, PIECE, BLOCK):
            offsets = start + tl.arange(0, BLOCK)
            if PIECE % BLOCK == 0:
                words = tl.load(source + offsets)
                if COPY:
                    tl.store(target + offsets, words)
            else:
                inside = offsets < PIECE
                words = tl.load(source + offsets, mask=inside, other=0)
                if COPY:
                    tl.store(target + offsets, words, mask=inside)
            index = (first_word + offsets + 1).to(tl.uint64)
            k = words.to(tl.uint64, bitcast=True) ^ (index * 0x9E3779B97F4A7C15)
            k ^= k >> 33            # murmur3's 64-bit finalizer
            k *= 0xFF51AFD7ED558CCD
            k ^= k >> 33
            k *= 0xC4CEB9FE1A85EC53
            k ^= k >> 33
            if PIECE % BLOCK == 0:
                acc += k
            else:
                acc += tl.where(inside, k, 0)
        total_share = _sum_lanes(acc, BLOCK, LOG2_BLOCK)
        tl.store(sums + slot + tl.arange(0, 1), total_share.to(tl.int64, bitcast=True))


def _lanes_sum(acc, BLOCK: tl.constexpr, LOG2_BLOCK: tl.constexpr):
    return tl.sum(acc, axis=0, keep_dims=True)


def _lanes_sum_by_halves(acc, BLOCK: tl.constexpr, LOG2_BLOCK: tl.constexpr):
    """The same sum from builtins only: Triton's interpreter cannot call ``tl.sum`` (itself
    a jit function) unless TRITON_INTERPRET was set before Triton was imported."""
    for step in tl.static_range(LOG2_BLOCK):
        left, right = tl.split(tl.reshape(acc, [BLOCK >> (step + 1), 2]))
        acc = left + right
    return acc


_sum_lanes = triton.jit(_lanes_sum)
copy_blocks = triton.jit(_copy_blocks)
copy_blocks_summed = triton.jit(_copy_blocks_summed)


def interpreted(summed: bool = False):
    """A kernel under Triton's CPU interpreter (slow; for tests on CPU tensors)."""
    from triton.runtime.interpreter import InterpretedFunction
    if not summed:
        return InterpretedFunction(_copy_blocks)
    scope = dict(_copy_blocks_summed.__globals__)
    scope["_sum_lanes"] = InterpretedFunction(_lanes_sum_by_halves)
    kernel = types.FunctionType(_copy_blocks_summed.__code__, scope, "_copy_blocks_summed")
    return InterpretedFunction(kernel)
