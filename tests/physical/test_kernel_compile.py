"""The device copy kernels compile for the GPUs kvstrata runs on, without a GPU: Triton's own
NVIDIA backend turns each kernel, at the shapes the engine launches for every G1 layout vLLM
hands over, into a Hopper (sm_90: H100, H200) binary, whose resource usage ``cuobjdump``
reads. Triton's CPU interpreter (test_device_copy.py) checks what the kernels compute; this
checks what the interpreter cannot: that they lower to GPU code at all, that no thread spills
registers to local memory (a spill puts a round trip to memory in every loop step), and that
the bytes move 16 to a load or store instruction, as docs/physical.md says they do."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from collections import Counter

import pytest
import torch

from kvstrata.physical import DeviceStorage, HostStorage
from kvstrata.physical.device_copy import DeviceCopyEngine, device_kernels
from kvstrata.physical.device_plan import block_template

triton = pytest.importorskip("triton")

HOPPER = (90, 32)          # compute capability 9.0, 32-thread warps
SM_COUNT = 132             # an H100/H200 SXM or PCIe has 114-132: the grid the engine aims at
SLICE_BYTES = 32 << 20     # the engine's default slice
LAYOUTS = {   # G1 tensors per layer as vLLM's attention backends hand them over, bf16
    "flash_attn": lambda blocks, layers, heads: [
        torch.empty(2, blocks, 16, heads, 128, dtype=torch.bfloat16) for _ in range(layers)],
    "flashinfer": lambda blocks, layers, heads: [
        torch.empty(blocks, 2, 16, heads, 128, dtype=torch.bfloat16) for _ in range(layers)],
    "mla": lambda blocks, layers, heads: [
        torch.empty(blocks, 16, 576, dtype=torch.bfloat16) for _ in range(layers)],
}
GEOMETRIES = {"64KiB": (4, 2), "2MiB": (32, 8)}   # layers, KV heads (Llama-3.1-8B: 2 MiB)
POINTER = {torch.int64: "*i64", torch.int32: "*i32", torch.int16: "*i16", torch.uint8: "*u8"}


def _cuobjdump() -> str | None:
    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                           "cuobjdump")
    return bundled if os.access(bundled, os.X_OK) else shutil.which("cuobjdump")


def _compile(kernel, dtype: torch.dtype, shape: dict, summed: bool, num_warps: int) -> bytes:
    """The kernel's Hopper binary as a launch specialises it: Triton marks every pointer
    argument whose address is a multiple of 16 (the engine's always are: CUDA allocations,
    page-aligned G2, id arrays) as such, which lets it move 16 bytes per instruction."""
    from triton.backends.compiler import GPUTarget
    pointers = {name: POINTER[dtype] for name in ("src", "dst")}
    pointers.update({name: "*i64" for name in ("src_ids", "dst_ids", "src_template",
                                               "dst_template")})
    signature = dict(pointers, src_stride="i64", dst_stride="i64", total="i32")
    constants = dict(shape)
    if summed:
        signature["sums"] = pointers["sums"] = "*i64"
        constants["COPY"] = True
    signature.update({name: "constexpr" for name in constants})
    names = list(signature)
    aligned = {(names.index(name),): [["tt.divisibility", 16]] for name in pointers}
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constants,
                                       attrs=aligned)
    compiled = triton.compile(source, target=GPUTarget("cuda", *HOPPER),
                              options={"num_warps": num_warps})
    return compiled.asm["cubin"]


def _inspect(cubin: bytes, tool: str) -> tuple[dict[str, int], dict[str, int]]:
    """``(resources, global memory instructions)`` of a binary: registers, stack and local
    memory per thread; each load/store opcode (``STG.E.128``: a 16-byte store) and its
    count in the machine code."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    resources = {key: int(value)
                 for key, value in re.findall(r"\b(REG|STACK|LOCAL):(\d+)", usage)}
    return resources, dict(Counter(re.findall(r"\b((?:LDG|STG)\.E[A-Z0-9.]*)", sass)))


@pytest.mark.skipif(device_kernels()[0] is None, reason=f"device kernel: {device_kernels()[1]}")
@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_kernels_compile_for_hopper_without_spilling(layout, geometry):
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump (Triton's NVIDIA backend ships one) to read a binary with")
    layers, heads = GEOMETRIES[geometry]
    g1 = DeviceStorage.wrap(LAYOUTS[layout](4, layers, heads))
    g2 = HostStorage(g1.config.with_blocks(4).with_alignment(4096))
    engine = DeviceCopyEngine(interpret=True, programs=SM_COUNT)
    kernels = device_kernels()[0]
    try:
        template = block_template(g1.memory, g2.memory, max_piece_bytes=engine.max_piece_bytes)
        slice_blocks = max(1, SLICE_BYTES // g1.config.block_bytes)
        for summed, kernel in ((False, kernels.copy_blocks), (True, kernels.copy_blocks_summed)):
            dtype, shape = engine.kernel_shape(template, summed, slice_blocks * template.per_block,
                                               None)
            for num_warps in sorted({engine.num_warps, 8}):   # the default and the knob
                usage, memory = _inspect(_compile(kernel, dtype, shape, summed, num_warps),
                                         tool)
                what = (f"{'summed' if summed else 'copy'} {shape} {num_warps} warps: "
                        f"{usage} {memory}")
                assert usage.get("REG", 0) > 0, what                  # a kernel was built
                assert usage.get("LOCAL", 0) == 0 and usage.get("STACK", 0) == 0, what
                # the bytes move 16 to an instruction; narrower stores: the checksum
                # shares only, one a piece (a group's loop may be unrolled)
                assert memory.get("LDG.E.128") and memory.get("STG.E.128"), what
                narrow = sum(n for op, n in memory.items() if op.startswith("STG")
                             and not op.endswith(".128"))
                assert narrow <= (shape["GROUP"] if summed else 0), what
    finally:
        g2.close()
