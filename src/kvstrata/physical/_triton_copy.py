"""The device copy kernel (Triton): one program per piece, a piece being ``PIECE`` elements
at ``src + src_units[i] * UNIT`` copied to ``dst + dst_units[i] * UNIT``.

Either side may be device memory or host memory mapped into the device's address space (G2
registered with CUDA): the loads and stores then cross PCIe, and a batch of thousands of
scattered pieces costs one launch instead of one DMA call per piece. Offsets are counted in
units of ``UNIT`` elements (16 bytes where the pieces allow), which tells the compiler every
piece start is that aligned, so each thread moves 16 bytes per instruction.

Imported only where Triton is installed (:mod:`kvstrata.physical.device_copy` says why not);
:func:`interpreted` runs the same kernel on CPU tensors through Triton's interpreter, which is
how tests without a GPU check it.
"""

import triton
import triton.language as tl

__all__ = ["copy_pieces", "interpreted"]


def _copy_pieces(src, dst, src_units, dst_units, UNIT: tl.constexpr, PIECE: tl.constexpr,
                 BLOCK: tl.constexpr):
    piece = tl.program_id(0)
    source = src + tl.load(src_units + piece) * UNIT
    target = dst + tl.load(dst_units + piece) * UNIT
    for start in range(0, PIECE, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        if PIECE % BLOCK == 0:
            tl.store(target + offsets, tl.load(source + offsets))
        else:
            inside = offsets < PIECE
            tl.store(target + offsets, tl.load(source + offsets, mask=inside), mask=inside)


copy_pieces = triton.jit(_copy_pieces)


def interpreted():
    """The kernel under Triton's CPU interpreter (slow; for tests on CPU tensors)."""
    from triton.runtime.interpreter import InterpretedFunction
    return InterpretedFunction(_copy_pieces)
