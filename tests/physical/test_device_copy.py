"""The GPU data path (physical/device_copy.py): the plan, the kernel under Triton's CPU
interpreter, the verified pipelines through the transfer engine, and on a GPU (marked ``gpu``,
skipped without CUDA) the same bytes between CUDA tensors of every layout vLLM hands over and
G2 registered with CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xxhash

from kvstrata.physical import (DeviceStorage, DiskStorage, FailureKind, HostStorage,
                               MemmoveCopyEngine, TransferEngine, TransferPlan)
from kvstrata.physical.buffers import PAGE_SIZE, cuda_mapped
from kvstrata.physical.copy import default_copy_engine
from kvstrata.physical.device_copy import (KERNEL_ERROR, DeviceCopyEngine, _kernels, _split,
                                           device_kernel_status, plan_device_pieces)

from .conftest import block_bytes_of, fill_random, small_config

needs_triton = pytest.mark.skipif(_kernels is None, reason=f"device kernel: {KERNEL_ERROR}")
gpu = pytest.mark.skipif(not torch.cuda.is_available(),
                         reason="needs a CUDA GPU (scripts/gpu-check runs these on one)")
CUDA_LAYOUTS = {   # the KV tensors vLLM hands a connector, per attention backend
    "flash_attn": lambda nb: torch.empty(2, nb, 16, 4, 64, dtype=torch.bfloat16),
    "flashinfer": lambda nb: torch.empty(nb, 2, 16, 4, 64, dtype=torch.bfloat16),
    "mla": lambda nb: torch.empty(nb, 16, 576, dtype=torch.bfloat16),
}


def interpreter(**kw) -> DeviceCopyEngine:
    kw.setdefault("hash_threads", 2)
    return DeviceCopyEngine(interpret=True, fallback=MemmoveCopyEngine(), **kw)


def test_plan_counts_from_the_lowest_region_in_the_widest_unit():
    cfg = small_config(num_blocks=9, alignment=64)
    g1 = DeviceStorage.allocate(cfg, kv_layout="outer_contiguous", device="cpu")
    host = HostStorage(cfg.with_blocks(7))
    plan = plan_device_pieces(g1.memory, [8, 0], host.memory, [2, 6])
    assert plan.piece_bytes == cfg.chunk_bytes and plan.unit_bytes == 16
    assert plan.pieces == 2 * cfg.num_layers * cfg.outer_dim
    bases = g1.memory.base_addresses()
    assert plan.src_base == int(np.argmin(bases))
    # every piece start, rebuilt from the plan, is the address the layout gives
    starts = bases[plan.src_base] + plan.src_units * plan.unit_bytes
    region, offset = g1.layout.pieces(np.array([8, 0]), g1.layout.contiguous_granularity)
    assert starts.tolist() == (bases[region] + offset).reshape(-1).tolist()
    dst = host.memory.base_addresses()[0] + plan.dst_units * plan.unit_bytes
    assert dst[0] == host.memory.base_addresses()[0] + 2 * host.layout.block_stride


def test_plan_splits_big_pieces_and_narrows_the_unit_for_odd_sizes():
    assert _split(64 << 10, 64 << 10) == 1
    assert _split(2 << 20, 64 << 10) == 32
    assert _split(3 * 16, 16) == 3
    assert _split(24, 16) == 1          # no 16-byte aligned part: left whole
    cfg = small_config(num_blocks=4, dtype="float16", inner_dim=3, alignment=2)
    a = DeviceStorage.allocate(cfg, kv_layout="outer_contiguous", device="cpu")
    b = DeviceStorage.allocate(cfg, kv_layout="block_contiguous", device="cpu")
    plan = plan_device_pieces(a.memory, [1], b.memory, [2])
    assert plan.piece_bytes == 24 and plan.unit_bytes == 8
    split = plan_device_pieces(HostStorage(small_config()).memory, [1],
                               HostStorage(small_config()).memory, [0], max_piece_bytes=64)
    assert split.piece_bytes == 64 and split.pieces == small_config().block_bytes // 64


def test_block_elements_must_be_a_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        interpreter(block_elements=12)


def test_slices_keep_the_unoverlapped_ends_short():
    engine = interpreter(slice_bytes=800)
    cuts = engine._slices(100, 10)      # 80 blocks a slice, edges of 10
    assert cuts[0] == (0, 10) and cuts[-1][1] == 100
    assert all(b == c for (_, b), (c, _) in zip(cuts, cuts[1:]))
    assert engine._slices(50, 10) == [(0, 50)]


@needs_triton
@pytest.mark.parametrize("kind", ["outer_contiguous", "block_contiguous", "fully_contiguous"])
def test_odd_geometry_round_trips_through_the_interpreted_kernel(kind):
    cfg = small_config(num_blocks=6, dtype="float16", inner_dim=3, alignment=2)
    g1 = DeviceStorage.allocate(cfg, kv_layout=kind, device="cpu")
    fill_random(g1.memory.regions, seed=11)
    host = HostStorage(cfg.with_blocks(5))
    engine = interpreter()
    engine.copy(g1.memory, [5, 1, 2], host.memory, [0, 4, 2])
    back = DeviceStorage.allocate(cfg, kv_layout=kind, device="cpu")
    engine.copy(host.memory, [0, 4, 2], back.memory, [1, 3, 5])
    for s, d in zip([5, 1, 2], [1, 3, 5]):
        assert torch.equal(block_bytes_of(g1, s), block_bytes_of(back, d))
    for untouched in (0, 2, 4):
        assert not block_bytes_of(back, untouched).any()


@needs_triton
def test_copy_checked_copies_only_what_passed_slice_by_slice():
    cfg = small_config(num_blocks=12, alignment=64)
    host = HostStorage(cfg)
    fill_random([host.memory.regions[0]], seed=4)
    g1 = DeviceStorage.allocate(cfg, kv_layout="outer_contiguous", device="cpu")
    engine = interpreter(slice_bytes=3 * cfg.block_bytes)
    asked = []

    def check(lo, hi):
        asked.append((lo, hi))
        return [p for p in range(lo, hi) if p % 3 != 1]

    src, dst = list(range(10)), [11 - i for i in range(10)]
    good = engine.copy_checked(host.memory, src, g1.memory, dst, check)
    assert good == [p for p in range(10) if p % 3 != 1]
    assert len(asked) > 1 and asked[0][0] == 0 and asked[-1][1] == 10
    for p in range(10):
        copied = torch.equal(block_bytes_of(host, src[p]), block_bytes_of(g1, dst[p]))
        assert copied == (p in good)
        if p not in good:
            assert not block_bytes_of(g1, dst[p]).any()


@needs_triton
@pytest.mark.parametrize("checksums", ["eager", "deferred"])
def test_transfer_engine_never_onboards_a_g2_byte_changed_after_the_offload(tmp_path,
                                                                            checksums):
    cfg = small_config(num_blocks=16, alignment=64)
    g1 = DeviceStorage.allocate(cfg, kv_layout="outer_contiguous", device="cpu")
    fill_random(g1.memory.regions, seed=9)
    g2 = HostStorage(cfg.with_blocks(12).with_alignment(512), verify_reads=True,
                     checksums=checksums)
    seq = [501, 502, 503, 504]
    engine_copy = interpreter(slice_bytes=cfg.block_bytes)
    with TransferEngine({"G1": g1, "G2": g2}, copy_engine=engine_copy) as engine:
        off = engine.submit(TransferPlan.for_path("G1->G2", [0, 3, 4, 5], [7, 1, 2, 3], seq,
                                                  job_id=1)).result(timeout=60)
        assert off.all_ok
        if checksums == "eager":
            assert list(off.checksums) == [xxhash.xxh3_64_intdigest(g2.payload(b))
                                           for b in [7, 1, 2, 3]]
        else:   # hashed on first need: the verified read takes it as it finds it
            g2.ensure_checksums([7, 1, 2, 3])
        g2.payload(2)[5] ^= 0xFF                        # a byte of block 503 changes in G2
        before = block_bytes_of(g1, 10).clone()
        on = engine.submit(TransferPlan.for_path("G2->G1", [7, 1, 2, 3], [8, 9, 10, 11], seq,
                                                 job_id=2)).result(timeout=60)
    assert on.ok == (True, True, False, True)
    assert on.failures[0].kind is FailureKind.CHECKSUM_MISMATCH
    assert torch.equal(block_bytes_of(g1, 10), before)          # never reached the engine
    for s, d in zip([0, 3, 5], [8, 9, 11]):
        assert torch.equal(block_bytes_of(g1, s), block_bytes_of(g1, d))


def test_default_engine_follows_the_machine():
    engine = default_copy_engine()
    status = device_kernel_status()
    if torch.cuda.is_available() and status["available"]:
        assert isinstance(engine, DeviceCopyEngine)
    else:
        assert not isinstance(engine, DeviceCopyEngine)
        assert status["available"] is False and status["reason"]
    engine.close()


# ----------------------------------------------------------------------------- on a GPU
@gpu
@needs_triton
@pytest.mark.parametrize("block_elements", [4096, 256])    # a piece in one step or in many
@pytest.mark.parametrize("layout", sorted(CUDA_LAYOUTS))
def test_gpu_every_vllm_layout_round_trips_through_registered_g2(layout, block_elements):
    make = CUDA_LAYOUTS[layout]
    tensors = [make(64).cuda() for _ in range(3)]
    for t in tensors:
        t.view(torch.uint8).random_(0, 256)
    g1 = DeviceStorage.wrap(tensors)
    host = HostStorage(g1.config.with_blocks(40).with_alignment(PAGE_SIZE))
    region = host.memory.regions[0]
    assert host.pinned and cuda_mapped(region.data_ptr(), region.numel())
    engine = DeviceCopyEngine(slice_bytes=4 * g1.config.block_bytes,
                              block_elements=block_elements)
    assert engine.handles(g1.memory, host.memory), engine.kernel_error
    rng = np.random.default_rng(3)
    src = rng.choice(64, 30, replace=False).tolist()
    dst = rng.choice(40, 30, replace=False).tolist()
    sums = engine.copy_hashed(g1.memory, src, host.memory, dst)
    assert sums == [xxhash.xxh3_64_intdigest(host.payload(d)) for d in dst]
    for s, d in zip(src, dst):
        assert torch.equal(block_bytes_of(g1, s).cpu(), block_bytes_of(host, d))
    back = DeviceStorage.wrap([torch.zeros_like(t) for t in tensors])
    good = engine.copy_checked(host.memory, dst, back.memory, src,
                               lambda lo, hi: list(range(lo, hi)))
    assert good == list(range(30))
    for s in range(64):
        expected = block_bytes_of(g1, s).cpu() if s in src else None
        got = block_bytes_of(back, s).cpu()
        assert torch.equal(got, expected) if expected is not None else not got.any()
    engine.close()


@gpu
@needs_triton
def test_gpu_pageable_host_memory_goes_to_the_fallback_with_the_same_bytes():
    g1 = DeviceStorage.wrap([CUDA_LAYOUTS["flash_attn"](8).cuda().random_() for _ in range(2)])
    host = HostStorage(g1.config.with_blocks(8), pin=False)
    engine = DeviceCopyEngine()
    assert not engine.handles(g1.memory, host.memory)
    engine.copy(g1.memory, [1, 5], host.memory, [0, 7])
    assert torch.equal(block_bytes_of(g1, 5).cpu(), block_bytes_of(host, 7))


@gpu
def test_gpu_g2_is_page_aligned_and_goes_to_disk_with_o_direct(tmp_path):
    cfg = small_config(num_blocks=8, alignment=PAGE_SIZE)
    host = HostStorage(cfg, verify_reads=True)
    assert host.status().pinned and host.memory.regions[0].data_ptr() % PAGE_SIZE == 0
    fill_random([host.memory.regions[0]], seed=2)
    host.begin_write([0, 1, 2])
    host.seal([0, 1, 2], [1, 2, 3])
    disk = DiskStorage(cfg, tmp_path, o_direct=True)
    assert disk.status().o_direct
    with TransferEngine({"G2": host, "G3": disk}) as engine:
        down = engine.submit(TransferPlan.for_path("G2->G3", [0, 1, 2], [5, 6, 7], [1, 2, 3],
                                                   job_id=1)).result(timeout=60)
        up = engine.submit(TransferPlan.for_path("G3->G2", [5, 6, 7], [3, 4, 5], [1, 2, 3],
                                                 job_id=2)).result(timeout=60)
    assert down.all_ok and up.all_ok
    for a, b in zip([0, 1, 2], [3, 4, 5]):
        assert bytes(host.payload(a)) == bytes(host.payload(b))
