"""Copy engines: exact bytes between every layout pair, with every engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstrata.physical import (DeviceStorage, HostStorage, LayoutMismatchError,
                               MemmoveCopyEngine, StagedCopyEngine, TorchCopyEngine)
from kvstrata.physical.copy import _coalesce, plan_pieces

from .conftest import block_bytes_of, fill_random, small_config

ENGINES = {
    "memmove": lambda: MemmoveCopyEngine(),
    "memmove_threads": lambda: MemmoveCopyEngine(threads=2, parallel_piece=1, parallel_bytes=1),
    "torch": lambda: TorchCopyEngine(),
    "staged": lambda: StagedCopyEngine(stage_all=True),
}
KINDS = ["outer_contiguous", "block_contiguous", "fully_contiguous"]


@pytest.mark.parametrize("engine_name", list(ENGINES))
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


@pytest.mark.parametrize("engine_name", list(ENGINES))
def test_dtypes_exact(engine_name, dtype):
    engine = ENGINES[engine_name]()
    cfg = small_config(dtype=dtype)
    src = DeviceStorage.wrap([torch.zeros(2, 16, 4, 8, dtype=cfg.torch_dtype) for _ in range(3)])
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
