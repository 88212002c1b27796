"""Copy engines: exact bytes between every layout pair, with every engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xxhash

from kvstrata.physical.dtypes import torch_dtype
from kvstrata.physical import (DeviceStorage, HostStorage, LayoutMismatchError,
                               MemmoveCopyEngine, StagedCopyEngine, TorchCopyEngine)
from kvstrata.physical.copy import NATIVE_KERNEL, NATIVE_KERNEL_ERROR, _coalesce, plan_pieces
from kvstrata.physical.device_copy import DeviceCopyEngine, device_kernels

from .conftest import block_bytes_of, fill_random, small_config

needs_native = pytest.mark.skipif(not NATIVE_KERNEL, reason=f"native kernel: {NATIVE_KERNEL_ERROR}")
needs_triton = pytest.mark.skipif(device_kernels()[0] is None,
                                  reason=f"device kernel: {device_kernels()[1]}")

ENGINES = {
    "memmove": lambda: MemmoveCopyEngine(),   # native when built, else the Python kernels
    # the native kernel: one call, split over pthreads, streaming stores, tiny hash windows
    "native": lambda: MemmoveCopyEngine(native=True),
    "native_threads_stream": lambda: MemmoveCopyEngine(native=True, threads=2, parallel_bytes=1,
                                                       stream_bytes=1),
    "native_no_prefetch_tiles": lambda: MemmoveCopyEngine(native=True, threads=3,
                                                          parallel_bytes=1, prefetch=False,
                                                          tile_bytes=1),
    # the pure-Python fallback kernels (used when the extension is missing), each forced on,
    # alone and split over threads
    "memmove_threads": lambda: MemmoveCopyEngine(threads=2, parallel_piece=1, parallel_bytes=1,
                                                 native=False),
    "rows_gather": lambda: MemmoveCopyEngine(direct_block_bytes=1, scatter_block_bytes=1 << 40,
                                             parallel_bytes=1, native=False),
    "rows_scatter": lambda: MemmoveCopyEngine(direct_block_bytes=1 << 40, scatter_block_bytes=1,
                                              parallel_bytes=1, native=False),
    "rows_tile": lambda: MemmoveCopyEngine(direct_block_bytes=1 << 40,
                                           scatter_block_bytes=1 << 40, tile_bytes=1,
                                           parallel_bytes=1, native=False),
    "memmove_fallback": lambda: MemmoveCopyEngine(min_row_bytes=1 << 30, parallel_piece=1,
                                                  parallel_bytes=1, native=False),
    "torch": lambda: TorchCopyEngine(),
    "staged": lambda: StagedCopyEngine(stage_all=True),
    "staged_python": lambda: StagedCopyEngine(stage_all=True,
                                              host_engine=MemmoveCopyEngine(native=False)),
    # the GPU data path's kernel under Triton's CPU interpreter: pieces split in two (32 of
    # 64 bytes), batches cut into slices of about two blocks
    "device_interpret": lambda: DeviceCopyEngine(interpret=True, max_piece_bytes=32,
                                                 slice_bytes=2 * 1536, hash_threads=2),
    # ... and each piece moved in a loop of four-element steps
    "device_interpret_loop": lambda: DeviceCopyEngine(interpret=True, block_elements=4),
    # ... and by three programs, each taking every third piece
    "device_interpret_three": lambda: DeviceCopyEngine(interpret=True, programs=3),
}
_MARKS = {"native": needs_native, "device": needs_triton}
ENGINE_PARAMS = [pytest.param(name, marks=_MARKS[name.split("_")[0]])
                 if name.split("_")[0] in _MARKS else name for name in ENGINES]
KINDS = ["outer_contiguous", "block_contiguous", "fully_contiguous"]


@pytest.mark.parametrize("engine_name", ENGINE_PARAMS)
@pytest.mark.parametrize("src_kind", KINDS)
@pytest.mark.parametrize("dst_kind", KINDS + ["host"])
def test_every_layout_pair_round_trips(engine_name, src_kind, dst_kind):
    engine = ENGINES[engine_name]()
    cfg = small_config(num_blocks=9, alignment=64)
    src = DeviceStorage.allocate(cfg, kv_layout=src_kind, device="cpu")
    fill_random(src.memory.regions, seed=1)
    dst = HostStorage(cfg.with_blocks(7)) if dst_kind == "host" else \
        DeviceStorage.allocate(cfg.with_blocks(7), kv_layout=dst_kind, device="cpu")
    src_ids, dst_ids = [8, 0, 3, 4, 5], [2, 6, 3, 4, 0]
    moved = engine.copy(src.memory, src_ids, dst.memory, dst_ids)
    assert moved == len(src_ids) * cfg.block_bytes
    for s, d in zip(src_ids, dst_ids):
        assert torch.equal(block_bytes_of(src, s), block_bytes_of(dst, d))
    untouched = set(range(7)) - set(dst_ids)
    for d in untouched:
        assert not block_bytes_of(dst, d).any()
    engine.close()


@pytest.mark.parametrize("engine_name", ENGINE_PARAMS)
def test_dtypes_exact(engine_name, dtype):
    engine = ENGINES[engine_name]()
    cfg = small_config(dtype=dtype)
    src = DeviceStorage.wrap([torch.zeros(2, 16, 4, 8, dtype=torch_dtype(cfg.dtype)) for _ in range(3)])
    fill_random(src.tensors, seed=3)
    host = HostStorage(cfg)
    engine.copy(src.memory, [1, 2, 15], host.memory, [0, 1, 2])
    back = DeviceStorage.wrap([torch.zeros_like(t) for t in src.tensors])
    engine.copy(host.memory, [0, 1, 2], back.memory, [1, 2, 15])
    for s, b in zip(src.tensors, back.tensors):
        assert torch.equal(s[:, [1, 2, 15]].view(torch.uint8), b[:, [1, 2, 15]].view(torch.uint8))
        assert not b[:, 0].view(torch.uint8).any()


def test_mismatched_layouts_rejected():
    a = HostStorage(small_config())
    b = HostStorage(small_config(inner_dim=16))
    for engine in (MemmoveCopyEngine(), TorchCopyEngine()):
        with pytest.raises(LayoutMismatchError, match="inner_dim"):
            engine.copy(a.memory, [0], b.memory, [0])


def test_bad_ids_rejected():
    a, b = HostStorage(small_config(num_blocks=4)), HostStorage(small_config(num_blocks=4))
    with pytest.raises(IndexError):
        MemmoveCopyEngine().copy(a.memory, [4], b.memory, [0])
    with pytest.raises(ValueError, match="ids"):
        MemmoveCopyEngine().copy(a.memory, [0, 1], b.memory, [0])


def test_plan_pieces_uses_coarsest_common_granularity():
    cfg = small_config()
    host = HostStorage(cfg)
    block = DeviceStorage.allocate(cfg, kv_layout="block_contiguous", device="cpu")
    outer = DeviceStorage.allocate(cfg, kv_layout="outer_contiguous", device="cpu")
    assert plan_pieces(host.layout, [0], host.layout, [1]).length == cfg.block_bytes
    assert plan_pieces(block.layout, [0], host.layout, [1]).length == cfg.layer_bytes
    assert plan_pieces(outer.layout, [0], host.layout, [1]).length == cfg.chunk_bytes


def test_coalesce_merges_runs_only_when_both_sides_continue():
    src = np.array([0, 10, 20, 40, 50], dtype=np.int64)
    dst = np.array([100, 110, 120, 130, 140], dtype=np.int64)
    s, d, n = _coalesce(src, dst, 10)
    assert s.tolist() == [0, 40] and d.tolist() == [100, 130] and n.tolist() == [30, 20]


@pytest.mark.parametrize("engine_name", ENGINE_PARAMS)
@pytest.mark.parametrize("src_kind", KINDS)
def test_copy_hashed_returns_xxh3_of_destination_blocks(engine_name, src_kind):
    engine = ENGINES[engine_name]()
    if isinstance(engine, MemmoveCopyEngine):
        engine.hash_window_bytes = 128      # exercise segment-by-segment hashing of big blocks
    cfg = small_config(num_blocks=9, alignment=64)
    src = DeviceStorage.allocate(cfg, kv_layout=src_kind, device="cpu")
    fill_random(src.memory.regions, seed=5)
    host = HostStorage(cfg.with_blocks(7))
    src_ids, dst_ids = [8, 0, 3, 4, 5], [2, 6, 3, 4, 0]
    sums = engine.copy_hashed(src.memory, src_ids, host.memory, dst_ids)
    assert sums == [xxhash.xxh3_64_intdigest(host.payload(d)) for d in dst_ids]
    for s, d in zip(src_ids, dst_ids):
        assert torch.equal(block_bytes_of(src, s), block_bytes_of(host, d))
    if src_kind != "fully_contiguous":
        with pytest.raises(ValueError, match="FullyContiguous"):
            engine.copy_hashed(host.memory, [0], src.memory, [1])
    engine.close()


def test_layouts_without_coarse_rows_fall_back_to_memmove():
    """A chunk of 12 bytes (fp8, 3 x 4 elements) allows only 4-byte rows: still exact."""
    cfg = small_config(num_blocks=6, dtype="float8_e4m3fn", inner_dim=3)
    src = DeviceStorage.allocate(cfg, kv_layout="outer_contiguous", device="cpu")
    fill_random(src.memory.regions, seed=9)
    host = HostStorage(cfg)
    engine = MemmoveCopyEngine(native=False)
    engine.copy(src.memory, [5, 1, 2], host.memory, [0, 4, 2])
    back = DeviceStorage.allocate(cfg, kv_layout="block_contiguous", device="cpu")
    engine.copy(host.memory, [0, 4, 2], back.memory, [3, 0, 1])
    for s, d in zip([5, 1, 2], [3, 0, 1]):
        assert torch.equal(block_bytes_of(src, s), block_bytes_of(back, d))
