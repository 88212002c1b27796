"""The GPU data path (physical/device_copy.py): the plan, the kernel under Triton's CPU
interpreter, the verified pipelines through the transfer engine, and on a GPU (marked ``gpu``,
skipped without CUDA) the same bytes between CUDA tensors of every layout vLLM hands over and
G2 registered with CUDA."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import xxhash

from kvstrata.physical import (BlockMemory, DeviceStorage, DiskStorage, FailureKind, HostStorage,
                               MemmoveCopyEngine, StorageConfigError, TransferEngine,
                               TransferPlan, TransferResult)
from kvstrata.physical.buffers import PAGE_SIZE, cuda_mapped
from kvstrata.physical.checksum import device_checksum, memory_device_checksums
from kvstrata.physical.errors import ChecksumMismatchError
from kvstrata.physical.engines import default_copy_engine
from kvstrata.physical.device_copy import DeviceCopyEngine, device_kernel_status, device_kernels
from kvstrata.physical.device_plan import _split, block_template, plan_device_pieces
from kvstrata.physical.device_staging import host_runs, staging_order

from .conftest import block_bytes_of, fill_random, small_config

needs_triton = pytest.mark.skipif(device_kernels()[0] is None,
                                  reason=f"device kernel: {device_kernels()[1]}")
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


@pytest.mark.parametrize("kind", ["outer_contiguous", "block_contiguous", "fully_contiguous"])
def test_a_block_template_places_every_piece_of_every_block_as_the_plan_does(kind):
    cfg = small_config(num_blocks=11, alignment=64)
    g1 = DeviceStorage.allocate(cfg, kv_layout=kind, device="cpu")
    host = HostStorage(cfg.with_blocks(7))
    template = block_template(g1.memory, host.memory)
    src, dst = [10, 0, 3, 7], [6, 2, 0, 5]
    plan = plan_device_pieces(g1.memory, src, host.memory, dst)
    per = template.per_block
    assert plan.pieces == per * len(src)
    for side, ids in (("src", src), ("dst", dst)):
        t_units = getattr(template, f"{side}_units")
        stride = getattr(template, f"{side}_stride")
        from_template = (t_units[None, :] + np.array(ids)[:, None] * stride) * template.unit_bytes
        bases = (g1 if side == "src" else host).memory.base_addresses()
        assert (bases[getattr(template, f"{side}_base")] + from_template.reshape(-1)).tolist() \
            == (bases[getattr(plan, f"{side}_base")]
                + getattr(plan, f"{side}_units") * plan.unit_bytes).tolist()


def test_a_layout_whose_blocks_are_not_evenly_spaced_has_no_template_and_is_not_handled():
    from kvstrata.protocol.layout import FullyContiguousLayout

    class Uneven(FullyContiguousLayout):      # block b at b * b strides: no single stride
        def _offsets(self, blocks, layers, outers):
            return super()._offsets(blocks * blocks, layers, outers)

        def region_bytes(self, index):
            return self.config.num_blocks ** 2 * self.block_stride

    cfg = small_config(num_blocks=4)
    layout = Uneven(cfg)
    uneven = BlockMemory(layout, (torch.zeros(layout.region_bytes(0), dtype=torch.uint8),))
    host = HostStorage(cfg)
    assert block_template(uneven, host.memory) is None
    assert block_template(host.memory, uneven) is None
    engine = interpreter()
    assert not engine.handles(uneven, host.memory)
    fill_random([uneven.regions[0]], seed=3)
    engine.copy(uneven, [3, 1], host.memory, [0, 2])        # the fallback copies it right
    offsets = layout.pieces(np.array([3]), layout.contiguous_granularity)[1].reshape(-1)
    assert bytes(host.payload(0)) == bytes(uneven.regions[0][int(offsets[0]):
                                                              int(offsets[0]) + cfg.block_bytes])


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="power of two"):
        interpreter(block_elements=12)
    with pytest.raises(ValueError, match="transport"):
        interpreter(transport="carrier-pigeon")
    with pytest.raises(ValueError, match="interpreter"):
        interpreter(transport="dma")
    for depth in (1, 65):
        with pytest.raises(ValueError, match="staging_depth"):
            interpreter(staging_depth=depth)


def test_host_runs_are_the_consecutive_slots_of_a_slice():
    positions, slots, lengths = host_runs([7, 8, 9, 3, 5, 6, 6, 0], stride=4096, block_bytes=4000)
    assert positions.tolist() == [0, 3, 4, 6, 7]
    assert slots.tolist() == [7, 3, 5, 6, 0]
    assert lengths.tolist() == [2 * 4096 + 4000, 4000, 4096 + 4000, 4000, 4000]
    assert [a.size for a in host_runs([], 64, 64)] == [0, 0, 0]


def test_staging_puts_a_slices_blocks_in_the_order_of_their_host_slots():
    position, in_order = staging_order([9, 4, 7, 4, 8])
    assert in_order.tolist() == [4, 4, 7, 8, 9]
    assert position.tolist() == [4, 0, 2, 1, 3]           # ranks; a tie keeps batch order
    assert [in_order[p] for p in position] == [9, 4, 7, 4, 8]
    assert [a.size for a in staging_order([])] == [0, 0]


@needs_triton
@pytest.mark.parametrize("transport", ["staged", "auto"])
def test_a_slice_of_one_consecutive_set_of_slots_in_any_order_moves_as_one_dma_copy(
        monkeypatch, transport):
    """The pool hands out slots freed together last-freed first, and a prefix comes back
    in request order: staged in slot order, such a slice is one run, each way."""
    import kvstrata.physical.device_copy as device_copy

    cfg = small_config(num_blocks=16, alignment=64)
    g1 = DeviceStorage.allocate(cfg, kv_layout="outer_contiguous", device="cpu")
    fill_random(g1.memory.regions, seed=23)
    host = HostStorage(cfg)
    engine = interpreter(transport=transport, staged_run_bytes=4 * cfg.block_bytes,
                         slice_bytes=64 * cfg.block_bytes)
    copies = []
    real = device_copy._host_memcpy
    monkeypatch.setattr(device_copy, "_host_memcpy",
                        lambda d, s_, n: copies.append(n.size) or real(d, s_, n))
    src = [3, 0, 14, 9, 5, 11, 7, 2]
    dst = [12, 11, 10, 9, 8, 7, 6, 5]                       # last freed, first handed out
    sums = engine.copy_summed(g1.memory, src, host.memory, dst, direction="offload")
    assert copies == [1]
    assert sums.tolist() == [device_checksum(block_bytes_of(g1, b).numpy()) for b in src]
    for s_, d in zip(src, dst):
        assert torch.equal(block_bytes_of(g1, s_), block_bytes_of(host, d))
    shuffled = [dst[i] for i in (5, 2, 7, 0, 3, 6, 1, 4)]   # a prefix read in its own order
    back = DeviceStorage.allocate(cfg, kv_layout="outer_contiguous", device="cpu")
    copies.clear()
    again = engine.copy_summed(host.memory, shuffled, back.memory, list(range(8)),
                               direction="onboard")
    assert copies == [1]
    assert again.tolist() == [sums[dst.index(d)] for d in shuffled]
    for i, d in enumerate(shuffled):
        assert torch.equal(block_bytes_of(back, i), block_bytes_of(host, d))


@needs_triton
def test_a_host_slot_named_twice_in_a_staged_onboard_lands_in_both_places():
    cfg = small_config(num_blocks=8, alignment=64)
    host = HostStorage(cfg)
    fill_random([host.memory.regions[0]], seed=29)
    g1 = DeviceStorage.allocate(cfg, kv_layout="outer_contiguous", device="cpu")
    engine = interpreter(transport="staged")
    engine.copy(host.memory, [4, 2, 4, 3], g1.memory, [0, 1, 2, 3], direction="onboard")
    for g, h in zip([0, 1, 2, 3], [4, 2, 4, 3]):
        assert torch.equal(block_bytes_of(g1, g), block_bytes_of(host, h))


@needs_triton
def test_auto_stages_slices_of_long_host_runs_and_copies_the_rest_with_the_kernel(monkeypatch):
    cfg = small_config(num_blocks=16, alignment=64)
    g1 = DeviceStorage.allocate(cfg, kv_layout="outer_contiguous", device="cpu")
    fill_random(g1.memory.regions, seed=21)
    host = HostStorage(cfg)
    # staged where a slice's runs average at least 3 blocks
    engine = interpreter(transport="auto", staged_run_bytes=3 * cfg.block_bytes,
                         slice_bytes=4 * cfg.block_bytes)
    staged = []
    real = engine._launch_staged
    monkeypatch.setattr(engine, "_launch_staged",
                        lambda *a, **k: staged.append(list(a[3])) or real(*a, **k))
    src = list(range(16))
    dst = [0, 1, 2, 3, 4, 5, 6, 7, 15, 13, 11, 9, 14, 12, 10, 8]   # runs, then scattered
    sums = engine.copy_summed(g1.memory, src, host.memory, dst, direction="offload")
    assert sums.tolist() == [device_checksum(host.payload(d)) for d in dst]
    assert staged and all(ids == list(range(ids[0], ids[0] + len(ids))) for ids in staged)
    assert sum(map(len, staged)) < 16          # the scattered slices went to the kernel
    back = DeviceStorage.allocate(cfg, kv_layout="outer_contiguous", device="cpu")
    engine.copy(host.memory, dst, back.memory, src, direction="onboard")
    for s_ in src:
        assert torch.equal(block_bytes_of(g1, s_), block_bytes_of(back, s_))


@needs_triton
@pytest.mark.parametrize("transport", ["kernel", "staged", "auto"])
def test_ids_out_of_range_or_unequal_lists_are_refused_before_anything_moves(transport):
    cfg = small_config(num_blocks=4, alignment=64)
    g1 = DeviceStorage.allocate(cfg, kv_layout="outer_contiguous", device="cpu")
    fill_random(g1.memory.regions, seed=8)
    host = HostStorage(cfg)
    before = host.memory.regions[0].clone()
    # one block a slice: a bad id in the last slice must stop the first one too
    engine = interpreter(transport=transport, staged_run_bytes=1,
                         slice_bytes=cfg.block_bytes)
    for src, dst, error in (([0], [4], IndexError), ([0], [-1], IndexError),
                            ([4], [0], IndexError), ([0, 1, 2], [3], ValueError),
                            ([0, 1, 2], [0, 1, 2, 3], ValueError),
                            ([0, 1, 2, 3], [0, 1, 2, 4], IndexError)):
        for call in (engine.copy, engine.copy_summed, engine.copy_hashed):
            with pytest.raises(error):
                call(g1.memory, src, host.memory, dst, direction="offload")
        with pytest.raises(error):
            engine.copy_checked(g1.memory, src, host.memory, dst,
                                lambda lo, hi: list(range(lo, hi)), direction="offload")
    assert torch.equal(host.memory.regions[0], before)


@needs_triton
@pytest.mark.parametrize("transport", ["kernel", "staged", "auto"])
@pytest.mark.parametrize("g1_blocks, g2_blocks", [(1, 1), (1, 6), (6, 1)])
def test_a_side_of_one_block_is_copied_on_the_device_path(transport, g1_blocks, g2_blocks):
    cfg = small_config(num_blocks=g1_blocks, alignment=64)
    g1 = DeviceStorage.allocate(cfg, kv_layout="outer_contiguous", device="cpu")
    fill_random(g1.memory.regions, seed=9)
    host = HostStorage(cfg.with_blocks(g2_blocks))
    engine = interpreter(transport=transport, staged_run_bytes=1)
    assert engine.handles(g1.memory, host.memory) and engine.summable(g1.memory, host.memory)
    s_, d_ = g1_blocks - 1, g2_blocks - 1
    sums = engine.copy_summed(g1.memory, [s_], host.memory, [d_], direction="offload")
    assert sums.tolist() == [device_checksum(host.payload(d_))]
    assert torch.equal(block_bytes_of(g1, s_), block_bytes_of(host, d_))


@needs_triton
def test_templates_of_destinations_that_are_gone_are_not_kept():
    import gc
    cfg = small_config(num_blocks=4, alignment=64)
    g1 = DeviceStorage.allocate(cfg, kv_layout="outer_contiguous", device="cpu")
    engine = interpreter(transport="kernel")
    for _ in range(20):
        host = HostStorage(cfg)
        engine.copy(g1.memory, [0], host.memory, [1], direction="offload")
        del host
        gc.collect()
    assert len(g1.memory.__dict__["_block_templates"]) <= 2


@needs_triton
def test_threads_making_new_destinations_share_one_source_memorys_templates():
    """(Triton's interpreter runs one kernel at a time: the threads ask for templates, as
    every copy does first.)"""
    import threading
    cfg = small_config(num_blocks=4, alignment=64)
    g1 = DeviceStorage.allocate(cfg, kv_layout="outer_contiguous", device="cpu")
    engine = interpreter(transport="kernel")
    errors = []

    def work() -> None:
        try:
            for _ in range(40):
                host = HostStorage(cfg.with_blocks(2))
                assert engine.summable(g1.memory, host.memory)
                del host
        except Exception as exc:     # noqa: BLE001 - reported below
            errors.append(exc)

    interval = __import__("sys").getswitchinterval()
    __import__("sys").setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        __import__("sys").setswitchinterval(interval)
    assert not errors, errors[:1]


def test_slices_keep_the_unoverlapped_ends_short():
    engine = interpreter(slice_bytes=800)
    cuts = engine._slices(100, 10)      # 80 blocks a slice, edges of 10
    assert cuts[0] == (0, 10) and cuts[-1][1] == 100
    assert all(b == c for (_, b), (c, _) in zip(cuts, cuts[1:]))
    assert engine._slices(50, 10) == [(0, 50)]


@needs_triton
@pytest.mark.parametrize("transport", ["kernel", "staged"])
@pytest.mark.parametrize("kind", ["outer_contiguous", "block_contiguous", "fully_contiguous"])
def test_odd_geometry_round_trips_through_the_interpreted_kernel(kind, transport):
    cfg = small_config(num_blocks=6, dtype="float16", inner_dim=3, alignment=2)
    g1 = DeviceStorage.allocate(cfg, kv_layout=kind, device="cpu")
    fill_random(g1.memory.regions, seed=11)
    host = HostStorage(cfg.with_blocks(5))
    engine = interpreter(transport=transport)
    engine.copy(g1.memory, [5, 1, 2], host.memory, [0, 4, 2], direction="offload")
    back = DeviceStorage.allocate(cfg, kv_layout=kind, device="cpu")
    engine.copy(host.memory, [0, 4, 2], back.memory, [1, 3, 5], direction="onboard")
    for s, d in zip([5, 1, 2], [1, 3, 5]):
        assert torch.equal(block_bytes_of(g1, s), block_bytes_of(back, d))
    for untouched in (0, 2, 4):
        assert not block_bytes_of(back, untouched).any()


@needs_triton
@pytest.mark.parametrize("transport", ["kernel", "staged"])
def test_copy_checked_copies_only_what_passed_slice_by_slice(transport):
    cfg = small_config(num_blocks=12, alignment=64)
    host = HostStorage(cfg)
    fill_random([host.memory.regions[0]], seed=4)
    g1 = DeviceStorage.allocate(cfg, kv_layout="outer_contiguous", device="cpu")
    engine = interpreter(slice_bytes=3 * cfg.block_bytes, transport=transport)
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
@pytest.mark.parametrize("kind", ["outer_contiguous", "block_contiguous", "fully_contiguous"])
@pytest.mark.parametrize("block_elements", [4096, 4])     # a piece in one step, or in many
@pytest.mark.parametrize("dtype, inner", [("bfloat16", 8), ("float16", 3)])   # 64 B / 24 B pieces
@pytest.mark.parametrize("transport", ["kernel", "staged"])
def test_copy_summed_returns_the_device_checksum_of_every_block(kind, block_elements, dtype,
                                                                inner, transport):
    cfg = small_config(num_blocks=9, dtype=dtype, inner_dim=inner, alignment=8)
    g1 = DeviceStorage.allocate(cfg, kv_layout=kind, device="cpu")
    fill_random(g1.memory.regions, seed=13)
    host = HostStorage(cfg.with_blocks(7))
    engine = interpreter(block_elements=block_elements, slice_bytes=2 * cfg.block_bytes,
                         programs=5,       # fewer programs than pieces: each takes several
                         transport=transport)
    assert engine.summable(g1.memory, host.memory)
    src, dst = [8, 0, 3, 4, 5], [2, 3, 4, 6, 0]      # a run of consecutive slots too
    sums = engine.copy_summed(g1.memory, src, host.memory, dst, direction="offload")
    assert sums.tolist() == [device_checksum(host.payload(d)) for d in dst]
    back = DeviceStorage.allocate(cfg, kv_layout=kind, device="cpu")
    again = engine.copy_summed(host.memory, dst, back.memory, src, direction="onboard")
    assert again.tolist() == sums.tolist()
    for s_ in src:
        assert torch.equal(block_bytes_of(g1, s_), block_bytes_of(back, s_))


def test_device_checksum_native_equals_the_numpy_reference():
    rng = np.random.default_rng(5)
    data = rng.integers(0, 256, 3 * 4096 + 8, dtype=np.uint8)
    base = data.ctypes.data
    sums = memory_device_checksums([base, base + 8, base + 4096], 4096, threads=2)
    assert sums.tolist() == [device_checksum(data[o:o + 4096]) for o in (0, 8, 4096)]
    flipped = data.copy()
    flipped[100] ^= 1
    assert device_checksum(flipped[:4096]) != device_checksum(data[:4096])
    swapped = data[:4096].copy()
    swapped[:8], swapped[8:16] = data[8:16], data[:8]      # word order matters
    assert device_checksum(swapped) != device_checksum(data[:4096])


def _tiers(verify=True, checksums="auto"):
    cfg = small_config(num_blocks=16, alignment=64)
    g1 = DeviceStorage.allocate(cfg, kv_layout="outer_contiguous", device="cpu")
    fill_random(g1.memory.regions, seed=9)
    g2 = HostStorage(cfg.with_blocks(12).with_alignment(512), verify_reads=verify,
                     checksums=checksums)
    return g1, g2


def _submit(engine, path, src, dst, seq, job=1):
    return engine.submit(TransferPlan.for_path(path, src, dst, seq, job_id=job)).result(timeout=60)


@needs_triton
def test_offload_records_device_checksums_and_a_changed_g2_byte_fails_the_onboard():
    g1, g2 = _tiers()
    seq = [501, 502, 503, 504]
    with TransferEngine({"G1": g1, "G2": g2}, copy_engine=interpreter(slice_bytes=1536)) as eng:
        off = _submit(eng, "G1->G2", [0, 3, 4, 5], [7, 1, 2, 3], seq)
        assert off.all_ok and off.checksums == (None,) * 4          # xxh3: on first need
        sums, known = g2.checksums.device_sums_of([7, 1, 2, 3])
        assert known.all()
        assert sums.tolist() == [device_checksum(block_bytes_of(g1, b).numpy())
                                 for b in [0, 3, 4, 5]]
        g2.payload(2)[5] ^= 0xFF                        # a byte of block 503 changes in G2
        on = _submit(eng, "G2->G1", [7, 1, 2, 3], [8, 9, 10, 11], seq, job=2)
    assert on.ok == (True, True, False, True)
    failure = on.failures[0]
    assert failure.kind is FailureKind.CHECKSUM_MISMATCH and "device checksum" in failure.detail
    for s_, d in zip([0, 3, 5], [8, 9, 11]):
        assert torch.equal(block_bytes_of(g1, s_), block_bytes_of(g1, d))


@needs_triton
def test_slots_without_device_checksums_are_verified_on_the_host_before_the_copy():
    g1, g2 = _tiers()
    for slot, source in ((4, 1), (5, 2), (6, 6)):       # G2 blocks that came another way
        g2.payload(slot)[:] = block_bytes_of(g1, source).numpy()
    g2.begin_write([4, 5, 6])
    g2.seal([4, 5, 6], [61, 62, 63])                    # xxh3 only, as a G3 load leaves them
    with TransferEngine({"G1": g1, "G2": g2}, copy_engine=interpreter(slice_bytes=1536)) as eng:
        assert _submit(eng, "G1->G2", [0, 3], [7, 8], [71, 72]).all_ok    # device-summed
        g2.payload(5)[0] ^= 1
        g2.payload(8)[9] ^= 1
        before = [block_bytes_of(g1, b).clone() for b in (12, 13)]
        on = _submit(eng, "G2->G1", [4, 7, 5, 8, 6], [11, 14, 12, 13, 15],
                     [61, 71, 62, 72, 63], job=2)
    assert on.ok == (True, True, False, False, True)
    assert [f.position for f in on.failures] == [2, 3]
    assert "xxh3" in on.failures[0].detail and "device checksum" in on.failures[1].detail
    _assert_plain(on, [5, 8])
    assert torch.equal(block_bytes_of(g1, 12), before[0])     # host path: never copied
    for s_, d in ((1, 11), (0, 14), (6, 15)):
        assert torch.equal(block_bytes_of(g1, s_), block_bytes_of(g1, d))


@needs_triton
def test_a_changed_g2_byte_never_goes_down_to_disk_or_out_to_a_peer(tmp_path):
    g1, g2 = _tiers()
    disk = DiskStorage(g2.config.with_blocks(8), tmp_path, o_direct=False)
    with TransferEngine({"G1": g1, "G2": g2, "G3": disk},
                        copy_engine=interpreter(slice_bytes=1536)) as eng:
        assert _submit(eng, "G1->G2", [0, 3, 4], [7, 1, 2], [81, 82, 83]).all_ok
        g2.payload(1)[3] ^= 0x40
        down = _submit(eng, "G2->G3", [7, 1, 2], [0, 1, 2], [81, 82, 83], job=2)
    assert down.ok == (True, False, True)
    assert down.failures[0].kind is FailureKind.CHECKSUM_MISMATCH
    _assert_plain(down, [1])
    assert g2.checksums.checksums_of([7, 2]) == [xxhash.xxh3_64_intdigest(g2.payload(b))
                                                 for b in (7, 2)]
    with pytest.raises(ChecksumMismatchError, match="device checksum"):
        g2.ensure_checksums([1])
    disk.close()


def _assert_plain(result: TransferResult, failed_slots: list[int]) -> None:
    """The failures name these slots as plain ints (the engine hands storages numpy ids),
    and the result crosses a process boundary as JSON intact."""
    assert [f.block_id for f in result.failures] == failed_slots
    assert all(type(f.block_id) is int and type(f.position) is int for f in result.failures)
    assert TransferResult.from_dict(json.loads(json.dumps(result.to_dict()))) == result


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
@pytest.mark.parametrize("transport, block_elements", [("kernel", 4096), ("kernel", 256),
                                                       ("dma", 4096), ("staged", 4096),
                                                       ("auto", 4096)])
@pytest.mark.parametrize("layout", sorted(CUDA_LAYOUTS))
def test_gpu_every_vllm_layout_round_trips_through_registered_g2(layout, transport,
                                                                 block_elements):
    make = CUDA_LAYOUTS[layout]
    tensors = [make(64).cuda() for _ in range(3)]
    for t in tensors:
        t.view(torch.uint8).random_(0, 256)
    g1 = DeviceStorage.wrap(tensors)
    host = HostStorage(g1.config.with_blocks(40).with_alignment(PAGE_SIZE))
    region = host.memory.regions[0]
    assert host.pinned and cuda_mapped(region.data_ptr(), region.numel())
    engine = DeviceCopyEngine(slice_bytes=4 * g1.config.block_bytes, transport=transport,
                              block_elements=block_elements, programs=7)
    assert engine.handles(g1.memory, host.memory), engine.kernel_error
    assert engine.transport_on("cuda") == transport, engine.kernel_error
    rng = np.random.default_rng(3)
    src = rng.choice(64, 30, replace=False).tolist()
    dst = rng.choice(40, 30, replace=False).tolist()
    sums = engine.copy_hashed(g1.memory, src, host.memory, dst)
    assert sums == [xxhash.xxh3_64_intdigest(host.payload(d)) for d in dst]
    for s, d in zip(src, dst):
        assert torch.equal(block_bytes_of(g1, s).cpu(), block_bytes_of(host, d))
    summed = engine.copy_summed(g1.memory, src, host.memory, dst)
    assert summed.tolist() == [device_checksum(host.payload(d)) for d in dst]
    back = DeviceStorage.wrap([torch.zeros_like(t) for t in tensors])
    good = engine.copy_checked(host.memory, dst, back.memory, src,
                               lambda lo, hi: list(range(lo, hi)))
    assert good == list(range(30))
    assert engine.copy_summed(host.memory, dst, back.memory, src).tolist() == summed.tolist()
    for s in range(64):
        expected = block_bytes_of(g1, s).cpu() if s in src else None
        got = block_bytes_of(back, s).cpu()
        assert torch.equal(got, expected) if expected is not None else not got.any()
    engine.close()


def _flash_g1_and_g2(blocks: int, slots: int):
    g1 = DeviceStorage.wrap([CUDA_LAYOUTS["flash_attn"](blocks).cuda() for _ in range(3)])
    for t in g1.tensors:
        t.view(torch.uint8).random_(0, 256)
    return g1, HostStorage(g1.config.with_blocks(slots).with_alignment(PAGE_SIZE))


@gpu
@needs_triton
@pytest.mark.parametrize("depth", [2, 5])
def test_gpu_staged_slices_of_two_threads_at_once_each_land_right(depth):
    """Two threads share the staging ring of a direction (of ``depth`` buffers, taken in
    turn many times over): every block lands byte for byte."""
    import threading
    g1, host = _flash_g1_and_g2(96, 96)
    engine = DeviceCopyEngine(transport="staged", slice_bytes=3 * g1.config.block_bytes,
                              staging_depth=depth)
    assert engine.transport_on("cuda") == "staged", engine.kernel_error
    back = DeviceStorage.wrap([torch.zeros_like(t) for t in g1.tensors])
    errors = []

    def work(part: int) -> None:
        try:
            ids = list(range(part, 96, 2))
            for _ in range(5):
                engine.copy_summed(g1.memory, ids, host.memory, ids[::-1], direction="offload")
                engine.copy_summed(host.memory, ids[::-1], back.memory, ids,
                                   direction="onboard")
        except Exception as exc:     # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(p,)) for p in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for t, b in zip(g1.tensors, back.tensors):
        assert torch.equal(t.view(torch.int16), b.view(torch.int16))
    ring = next(r for (direction, _), r in engine._rings.items() if direction == "onboard")
    assert sum(b is not None for b in ring._buffers) == depth      # every buffer took turns
    engine.close()


def _staged_with_dma_refused(monkeypatch):
    """G1, G2 and a staged engine that passed its self-test, then a driver that refuses
    every DMA."""
    from kvstrata.physical import _cuda_dma
    g1, host = _flash_g1_and_g2(16, 16)
    engine = DeviceCopyEngine(transport="staged")
    assert engine.transport_on("cuda") == "staged", engine.kernel_error

    def refuse(*args, **kwargs):
        raise _cuda_dma.DmaRefused("cuMemcpyBatchAsync of 1 copies failed with CUDA "
                                   "driver error 1")

    monkeypatch.setattr(_cuda_dma, "memcpy_batch", refuse)
    return g1, host, engine


@gpu
@needs_triton
def test_gpu_staged_goes_to_the_kernel_when_the_driver_refuses_its_dma(monkeypatch):
    g1, host, engine = _staged_with_dma_refused(monkeypatch)
    sums = engine.copy_summed(g1.memory, [3, 4, 9], host.memory, [0, 1, 7])
    assert sums.tolist() == [device_checksum(host.payload(d)) for d in (0, 1, 7)]
    assert engine.transport_on("cuda") == "kernel" and "staged" in engine.kernel_error
    for s, d in zip([3, 4, 9], [0, 1, 7]):
        assert torch.equal(block_bytes_of(g1, s).cpu(), block_bytes_of(host, d))


@gpu
@needs_triton
def test_gpu_a_refused_dma_never_hands_the_device_to_a_kernel_that_fails_its_self_test(
        monkeypatch):
    g1, host, engine = _staged_with_dma_refused(monkeypatch)
    monkeypatch.setattr(engine, "_try_one", lambda transport, device: "planted failure")
    with pytest.raises(RuntimeError, match="planted failure"):
        engine.copy(g1.memory, [3, 4, 9], host.memory, [0, 1, 7])
    assert engine.transport_on("cuda") is None and not engine.handles(g1.memory, host.memory)
    engine.copy(g1.memory, [3, 4, 9], host.memory, [0, 1, 7])      # the fallback engine
    for s, d in zip([3, 4, 9], [0, 1, 7]):
        assert torch.equal(block_bytes_of(g1, s).cpu(), block_bytes_of(host, d))
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


@gpu
@needs_triton
def test_gpu_transfer_engine_catches_a_changed_g2_byte_with_device_checksums():
    g1 = DeviceStorage.wrap([CUDA_LAYOUTS["flash_attn"](32).cuda() for _ in range(4)])
    for t in g1.tensors:
        t.view(torch.uint8).random_(0, 256)
    g2 = HostStorage(g1.config.with_blocks(16).with_alignment(PAGE_SIZE), verify_reads=True)
    with TransferEngine({"G1": g1, "G2": g2}) as engine:
        assert isinstance(engine.copy_engine, DeviceCopyEngine)
        seq = list(range(900, 908))
        off = engine.submit(TransferPlan.for_path("G1->G2", list(range(8)), list(range(8, 16)),
                                                  seq, job_id=1)).result(timeout=60)
        assert off.all_ok and g2.checksums.device_sums_of(list(range(8, 16)))[1].all()
        g2.payload(11)[123] ^= 0x10
        on = engine.submit(TransferPlan.for_path("G2->G1", list(range(8, 16)),
                                                 list(range(16, 24)), seq,
                                                 job_id=2)).result(timeout=60)
    assert [f.position for f in on.failures] == [3]
    assert on.failures[0].kind is FailureKind.CHECKSUM_MISMATCH
    for s_ in (0, 1, 2, 4, 5, 6, 7):
        assert torch.equal(block_bytes_of(g1, s_).cpu(), block_bytes_of(g1, 16 + s_).cpu())


# ----------------------------------------------------------------------------- review fixes
@needs_triton
def test_a_byte_changed_between_the_device_check_and_the_store_fails_the_g3_read(tmp_path):
    """The store's xxh3 of a device-summed G2 block is taken before its device check and
    travels to G3: a change after the check is written, but every G3 read of it fails."""
    g1, g2 = _tiers()
    disk = DiskStorage(g2.config.with_blocks(8), tmp_path, o_direct=False)
    with TransferEngine({"G1": g1, "G2": g2, "G3": disk},
                        copy_engine=interpreter(slice_bytes=1536)) as eng:
        assert _submit(eng, "G1->G2", [0, 1], [7, 8], [81, 82]).all_ok
        original = disk.write_blocks

        def racing_write(ids, sources, seqs, **kw):   # a writer races the store
            sources[0][3] ^= 0x40
            return original(ids, sources, seqs, **kw)
        disk.write_blocks = racing_write
        down = _submit(eng, "G2->G3", [7, 8], [0, 1], [81, 82], job=2)
        disk.write_blocks = original
        up = _submit(eng, "G3->G2", [0, 1], [3, 4], [81, 82], job=3)
    assert down.all_ok
    assert up.ok == (False, True) and up.failures[0].kind is FailureKind.CHECKSUM_MISMATCH
    assert g2.check_readable([7], [81])[0].kind is FailureKind.CHECKSUM_MISMATCH
    disk.close()


@needs_triton
def test_an_export_stops_before_a_block_that_fails_its_device_checksum():
    g1, g2 = _tiers()
    with TransferEngine({"G1": g1, "G2": g2}, copy_engine=interpreter(slice_bytes=1536)) as eng:
        assert _submit(eng, "G1->G2", [0, 1, 2], [7, 8, 9], [81, 82, 83]).all_ok
    g2.payload(9)[0] ^= 1
    held = g2.pin_held([81, 82, 83])
    assert [row[:2] for row in held] == [(81, 7), (82, 8)]
    assert [row[2] for row in held] == [xxhash.xxh3_64_intdigest(g2.payload(b)) for b in (7, 8)]
    assert g2.check_readable([9], [83])[0].kind is FailureKind.NOT_WRITTEN   # invalidated
    g2.unpin([7, 8])
    g2.begin_write([7, 8])                       # nothing left pinned


def _record_launches(monkeypatch, engine, *, wait: bool = True) -> tuple[list, list]:
    """Lists the engine's launches go to as they are queued and as they are waited for
    (``wait``: still waited for; else only recorded)."""
    queued, waited = [], []
    launch, really_wait = engine._launch, engine._wait
    monkeypatch.setattr(engine, "_launch", lambda *a, **k: queued.append(launch(*a, **k))
                        or queued[-1])
    monkeypatch.setattr(engine, "_wait", lambda item: waited.append(item)
                        or (really_wait(item) if wait else None))
    return queued, waited


@needs_triton
def test_every_queued_launch_is_waited_for_when_a_check_raises(monkeypatch):
    cfg = small_config(num_blocks=12, alignment=64)
    host = HostStorage(cfg)
    g1 = DeviceStorage.allocate(cfg, kv_layout="outer_contiguous", device="cpu")
    engine = interpreter(slice_bytes=2 * cfg.block_bytes)
    queued, waited = _record_launches(monkeypatch, engine, wait=False)

    def check(lo, hi):
        if lo:
            raise RuntimeError("the check broke")
        return list(range(lo, hi))
    with pytest.raises(RuntimeError, match="broke"):
        engine.copy_checked(host.memory, list(range(10)), g1.memory, list(range(10)), check)
    assert queued and waited == queued


@needs_triton
def test_each_slice_is_handed_on_with_its_checksums_once_it_has_landed(monkeypatch):
    cfg = small_config(num_blocks=12, alignment=64)
    g1 = DeviceStorage.allocate(cfg, kv_layout="outer_contiguous", device="cpu")
    fill_random(g1.memory.regions, seed=21)
    host = HostStorage(cfg)
    engine = interpreter(slice_bytes=2 * cfg.block_bytes)
    src, dst = list(range(10)), [11 - i for i in range(10)]
    seen = []
    queued, waited = _record_launches(monkeypatch, engine)

    def landed(lo, hi, sums):      # handed on once its own launch was waited for
        assert waited and waited[-1] is queued[len(seen)]
        assert sums.tolist() == [device_checksum(host.payload(dst[p])) for p in range(lo, hi)]
        assert all(torch.equal(block_bytes_of(g1, src[p]), block_bytes_of(host, dst[p]))
                   for p in range(lo, hi))
        seen.append((lo, hi))

    sums = engine.copy_summed(g1.memory, src, host.memory, dst, landed=landed)
    assert len(seen) > 2 and seen[0][0] == 0 and seen[-1][1] == 10
    assert all(a[1] == b[0] for a, b in zip(seen, seen[1:]))           # in order, each once
    assert sums.tolist() == [device_checksum(host.payload(d)) for d in dst]
    assert engine.copy_summed(g1.memory, [], host.memory, [], landed=landed).size == 0


@needs_triton
def test_every_queued_launch_is_waited_for_when_a_landed_slice_raises(monkeypatch):
    cfg = small_config(num_blocks=12, alignment=64)
    g1 = DeviceStorage.allocate(cfg, kv_layout="outer_contiguous", device="cpu")
    host = HostStorage(cfg)
    engine = interpreter(slice_bytes=2 * cfg.block_bytes)
    queued, waited = _record_launches(monkeypatch, engine)

    def landed(lo, hi, sums):
        raise RuntimeError("sealing broke")
    with pytest.raises(RuntimeError, match="sealing broke"):
        engine.copy_summed(g1.memory, list(range(10)), host.memory, list(range(10)),
                           landed=landed)
    assert len(queued) > 2 and set(map(id, queued)) <= set(map(id, waited))


@needs_triton
def test_a_verifying_g2_is_sealed_slice_by_slice_as_the_offload_lands(monkeypatch):
    g1, g2 = _tiers()
    seals = []
    seal = g2.seal
    monkeypatch.setattr(g2, "seal", lambda ids, *a, **k: seals.append(list(ids))
                        or seal(ids, *a, **k))
    src, dst, seq = [0, 3, 4, 5, 6, 9, 10], [7, 1, 2, 3, 0, 11, 8], list(range(601, 608))
    with TransferEngine({"G1": g1, "G2": g2}, copy_engine=interpreter(slice_bytes=1536)) as eng:
        off = _submit(eng, "G1->G2", src, dst, seq)
        assert off.all_ok
        assert len(seals) > 2 and [b for part in seals for b in part] == dst
        sums, known = g2.checksums.device_sums_of(dst)
        assert known.all() and sums.tolist() == [
            device_checksum(block_bytes_of(g1, b).numpy()) for b in src]
        on = _submit(eng, "G2->G1", dst, [12, 13, 14, 15, 1, 2, 11], seq, job=2)
    assert on.all_ok
    for s_, d in zip(src, [12, 13, 14, 15, 1, 2, 11]):
        assert torch.equal(block_bytes_of(g1, s_), block_bytes_of(g1, d))


@needs_triton
def test_a_slice_failing_after_others_were_sealed_fails_the_plan_and_serves_no_wrong_block(
        monkeypatch):
    """The slices sealed before a later one failed hold their blocks, checked (a read finds
    them right); the plan is reported failed whole, and nothing unsealed is readable."""
    g1, g2 = _tiers()
    engine = interpreter(slice_bytes=1536)
    launches = []
    launch = engine._launch

    def third_fails(*a, **k):
        if len(launches) == 2:
            raise RuntimeError("the device broke")
        launches.append(launch(*a, **k))
        return launches[-1]
    monkeypatch.setattr(engine, "_launch", third_fails)
    src, dst, seq = [0, 3, 4, 5, 6, 9, 10], [7, 1, 2, 3, 0, 11, 8], list(range(701, 708))
    with TransferEngine({"G1": g1, "G2": g2}, copy_engine=engine) as eng:
        off = _submit(eng, "G1->G2", src, dst, seq)
    assert not any(off.ok) and "the device broke" in off.error
    readable = [p for p in range(len(dst))
                if not g2.check_readable([dst[p]], [seq[p]])]
    assert readable == list(range(len(readable))) and len(readable) < len(dst)
    for p in readable:                            # the slices that landed before the failure
        assert torch.equal(block_bytes_of(g1, src[p]), block_bytes_of(g2, dst[p]))


@needs_triton
def test_an_offload_falls_back_to_host_checksums_when_the_engine_cannot_sum(monkeypatch):
    g1, g2 = _tiers()
    engine = interpreter(slice_bytes=1536)
    monkeypatch.setattr(engine, "copy_summed", lambda *a, **k: None)
    with TransferEngine({"G1": g1, "G2": g2}, copy_engine=engine) as eng:
        off = _submit(eng, "G1->G2", [0, 3], [7, 1], [81, 82])
    assert off.all_ok
    assert list(off.checksums) == [xxhash.xxh3_64_intdigest(g2.payload(b)) for b in (7, 1)]
    for s_, d in ((0, 7), (3, 1)):
        assert torch.equal(block_bytes_of(g1, s_), block_bytes_of(g2, d))


def test_checksum_threads_survive_callers_asking_for_different_sizes():
    rng = np.random.default_rng(1)
    data = rng.integers(0, 256, 64 << 20, dtype=np.uint8)
    addresses = data.ctypes.data + np.arange(32, dtype=np.uint64) * (2 << 20)
    expected = [xxhash.xxh3_64_intdigest(data[i * (2 << 20):(i + 1) * (2 << 20)])
                for i in range(32)]
    from concurrent.futures import ThreadPoolExecutor
    from kvstrata.physical.checksum import memory_checksums
    with ThreadPoolExecutor(4) as callers:
        runs = [callers.submit(memory_checksums, addresses, 2 << 20, threads=t,
                               min_part_bytes=1 << 20) for t in (2, 8, 3, 16, 5, 1) * 3]
        assert all(r.result().tolist() == expected for r in runs)


def test_g2_refuses_pinning_without_cuda_and_slot_ids_out_of_range():
    if not torch.cuda.is_available():
        with pytest.raises(StorageConfigError, match="CUDA"):
            HostStorage(small_config(), pin=True)
    host = HostStorage(small_config(num_blocks=4))
    for bad in ([4], [-1], [10 ** 6]):
        with pytest.raises(IndexError):
            host.payload_checksums(bad)
        with pytest.raises(IndexError):
            host.seal(bad, [1])


def test_a_forked_child_hashes_with_threads_of_its_own():
    import os
    data = np.random.default_rng(2).integers(0, 256, 16 << 20, dtype=np.uint8)
    addresses = data.ctypes.data + np.arange(8, dtype=np.uint64) * (2 << 20)
    from kvstrata.physical.checksum import memory_checksums
    expected = memory_checksums(addresses, 2 << 20, threads=4, min_part_bytes=1).tolist()
    child = os.fork()
    if child == 0:       # the child: must not wait on the parent's threads
        ok = memory_checksums(addresses, 2 << 20, threads=4, min_part_bytes=1).tolist() \
            == expected
        os._exit(0 if ok else 1)
    _, status = os.waitpid(child, 0)     # the test's own timeout catches a hang
    assert os.WEXITSTATUS(status) == 0
