"""Transfer engine: every path end to end, failures per block, concurrency, lifecycle."""

from __future__ import annotations

import errno
import gc
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import xxhash

from kvstrata.physical import (CopyEngine, DeviceStorage, DiskStorage, EngineBusyError,
                               EngineClosedError, FailureKind, HostStorage, LayoutMismatchError,
                               MemmoveCopyEngine, StagedCopyEngine, StorageConfigError,
                               TorchCopyEngine, TransferEngine, TransferPlan, TransferPlanError)

from .conftest import FaultyFileOps, block_bytes_of, fill_random, small_config

G1_KINDS = ["outer_contiguous", "block_contiguous", "fully_contiguous"]


def make_tiers(tmp_path, *, g1_kind="outer_contiguous", dtype="bfloat16", o_direct=None,
               file_ops=None, verify_host=False, blocks=(16, 12, 20), host_checksums="auto"):
    cfg = small_config(dtype=dtype)
    g1 = DeviceStorage.allocate(cfg.with_blocks(blocks[0]), kv_layout=g1_kind, device="cpu")
    fill_random(g1.memory.regions, seed=7)
    g2 = HostStorage(cfg.with_blocks(blocks[1]).with_alignment(512), verify_reads=verify_host,
                     checksums=host_checksums)
    g3 = DiskStorage(cfg.with_blocks(blocks[2]), tmp_path, o_direct=o_direct, file_ops=file_ops)
    return {"G1": g1, "G2": g2, "G3": g3}


def run(engine, path, src, dst, seq):
    return engine.submit(TransferPlan.for_path(path, src, dst, seq, job_id=0)).result(timeout=30)


def assert_same(a, a_ids, b, b_ids):
    for x, y in zip(a_ids, b_ids):
        assert torch.equal(block_bytes_of(a, x), block_bytes_of(b, y)), (x, y)


@pytest.mark.parametrize("g1_kind", G1_KINDS)
@pytest.mark.parametrize("o_direct", [True, False], ids=["o_direct", "buffered"])
@pytest.mark.parametrize("host_checksums", ["eager", "deferred"])
def test_every_path_round_trips_exact_bytes(tmp_path, g1_kind, o_direct, dtype, host_checksums):
    tiers = make_tiers(tmp_path, g1_kind=g1_kind, dtype=dtype, o_direct=o_direct,
                       host_checksums=host_checksums)
    g1, g2, g3 = tiers["G1"], tiers["G2"], tiers["G3"]
    assert g3.status().o_direct is o_direct
    seq = [101, 102, 103, 104, 105]
    expected = tuple(xxhash.xxh3_64_intdigest(block_bytes_of(g1, b).numpy())
                     for b in [0, 3, 4, 5, 15])
    with TransferEngine(tiers) as engine:
        r1 = run(engine, "G1->G2", [0, 3, 4, 5, 15], [7, 1, 2, 3, 0], seq)
        assert r1.all_ok and r1.bytes_moved == 5 * g1.config.block_bytes
        assert r1.checksums == (expected if host_checksums == "eager" else (None,) * 5)
        assert_same(g1, [0, 3, 4, 5, 15], g2, [7, 1, 2, 3, 0])
        r2 = run(engine, "G2->G3", [7, 1, 2, 3, 0], [19, 4, 5, 6, 0], seq)
        assert r2.all_ok and r2.checksums == expected        # same bytes, same xxh3
        assert g2.checksums.checksums_of([7, 1, 2, 3, 0]) == list(expected)  # filled in G2
        r3 = run(engine, "G3->G2", [19, 4, 5, 6, 0], [11, 10, 9, 8, 4], seq)
        assert r3.all_ok and r3.checksums == expected
        assert_same(g1, [0, 3, 4, 5, 15], g2, [11, 10, 9, 8, 4])
        r4 = run(engine, "G2->G1", [11, 10, 9, 8, 4], [1, 2, 6, 7, 8], seq)
        assert r4.all_ok
        assert_same(g1, [0, 3, 4, 5, 15], g1, [1, 2, 6, 7, 8])
        r5 = run(engine, "G3->G1", [19, 4, 5, 6, 0], [9, 10, 11, 12, 13], seq)
        assert r5.all_ok
        assert_same(g1, [0, 3, 4, 5, 15], g1, [9, 10, 11, 12, 13])
    g3.close()


@pytest.mark.parametrize("copy_engine", [TorchCopyEngine, lambda: StagedCopyEngine(stage_all=True),
                                         lambda: MemmoveCopyEngine(parallel_bytes=1,
                                                                   parallel_piece=1),
                                         lambda: MemmoveCopyEngine(native=False,
                                                                   parallel_bytes=1,
                                                                   parallel_piece=1)])
def test_other_copy_engines_drive_the_same_paths(tmp_path, copy_engine):
    tiers = make_tiers(tmp_path, g1_kind="block_contiguous")
    with TransferEngine(tiers, copy_engine=copy_engine()) as engine:
        assert run(engine, "G1->G2", [2, 3], [0, 1], [1, 2]).all_ok
        assert run(engine, "G2->G3", [0, 1], [0, 1], [1, 2]).all_ok
        assert run(engine, "G3->G1", [0, 1], [5, 6], [1, 2]).all_ok
        assert run(engine, "G2->G1", [0, 1], [7, 8], [1, 2]).all_ok
    assert_same(tiers["G1"], [2, 3, 2, 3], tiers["G1"], [5, 6, 7, 8])


def test_g3_to_g1_larger_than_staging(tmp_path):
    tiers = make_tiers(tmp_path)
    with TransferEngine(tiers, staging_bytes=4096 * 3) as engine:   # three blocks per round
        ids = list(range(8))
        assert run(engine, "G1->G2", ids, ids, ids).all_ok
        assert run(engine, "G2->G3", ids, [i + 10 for i in ids], ids).all_ok
        assert run(engine, "G3->G1", [i + 10 for i in ids], [i + 8 for i in ids], ids).all_ok
    assert_same(tiers["G1"], ids, tiers["G1"], [i + 8 for i in ids])


def test_disk_full_reports_failed_blocks(tmp_path):
    ops = FaultyFileOps(write_errno=errno.ENOSPC, fail_offsets={7 * 4096})
    tiers = make_tiers(tmp_path, file_ops=ops, o_direct=False)
    with TransferEngine(tiers) as engine:
        run(engine, "G1->G2", [0, 1, 2], [0, 1, 2], [10, 11, 12])
        result = run(engine, "G2->G3", [0, 1, 2], [3, 7, 12], [10, 11, 12])
        assert result.ok == (True, False, True)
        assert result.failed_sequence_hashes == (11,)
        assert result.failures[0].kind is FailureKind.DISK_FULL
        assert result.failures[0].block_id == 7 and result.checksums[1] is None
        assert result.bytes_moved == 2 * tiers["G1"].config.block_bytes
        back = run(engine, "G3->G1", [3, 7, 12], [5, 6, 7], [10, 11, 12])
        assert back.ok == (True, False, True)
        assert back.failures[0].kind is FailureKind.NOT_WRITTEN


def test_eio_on_onboard_leaves_destination_untouched(tmp_path):
    ops = FaultyFileOps(read_errno=errno.EIO, fail_offsets={4 * 4096})
    tiers = make_tiers(tmp_path, file_ops=ops)
    g1 = tiers["G1"]
    before = block_bytes_of(g1, 9)
    with TransferEngine(tiers) as engine:
        run(engine, "G1->G2", [0, 1], [0, 1], [1, 2])
        run(engine, "G2->G3", [0, 1], [3, 4], [1, 2])
        result = run(engine, "G3->G1", [3, 4], [8, 9], [1, 2])
        assert result.ok == (True, False) and result.failed_sequence_hashes == (2,)
        assert result.failures[0].kind is FailureKind.IO_ERROR
        to_host = run(engine, "G3->G2", [3, 4], [5, 6], [1, 2])
        assert to_host.ok == (True, False)
        assert run(engine, "G2->G1", [6], [10], [2]).failures[0].kind is FailureKind.NOT_WRITTEN
    assert torch.equal(block_bytes_of(g1, 9), before)
    assert_same(g1, [0], g1, [8])


def test_corrupted_slab_detected_on_every_read_path(tmp_path):
    tiers = make_tiers(tmp_path, o_direct=True)
    g1 = tiers["G1"]
    before = block_bytes_of(g1, 12)
    with TransferEngine(tiers) as engine:
        run(engine, "G1->G2", [0, 1, 2], [0, 1, 2], [1, 2, 3])
        run(engine, "G2->G3", [0, 1, 2], [0, 1, 2], [1, 2, 3])
        with open(tiers["G3"].path, "r+b") as f:
            f.seek(1 * 4096 + 100)
            value = f.read(1)[0]
            f.seek(1 * 4096 + 100)
            f.write(bytes([value ^ 1]))
        to_g1 = run(engine, "G3->G1", [0, 1, 2], [11, 12, 13], [1, 2, 3])
        assert to_g1.ok == (True, False, True)
        assert to_g1.failures[0].kind is FailureKind.CHECKSUM_MISMATCH
        to_g2 = run(engine, "G3->G2", [0, 1, 2], [3, 4, 5], [1, 2, 3])
        assert to_g2.failed_sequence_hashes == (2,)
        assert run(engine, "G2->G1", [4], [14], [2]).failures[0].kind is FailureKind.NOT_WRITTEN
    assert torch.equal(block_bytes_of(g1, 12), before)      # corrupt bytes never reached G1


def test_host_verification_catches_corruption(tmp_path):
    tiers = make_tiers(tmp_path, verify_host=True)
    with TransferEngine(tiers) as engine:
        run(engine, "G1->G2", [0, 1], [0, 1], [1, 2])
        tiers["G2"].payload(1)[3] ^= 0x80
        result = run(engine, "G2->G1", [0, 1], [4, 5], [1, 2])
        assert result.ok == (True, False)
        assert result.failures[0].kind is FailureKind.CHECKSUM_MISMATCH
        assert run(engine, "G2->G3", [0, 1], [0, 1], [1, 2]).ok == (True, False)
        wrong = run(engine, "G2->G1", [0], [6], [99])
        assert wrong.failures[0].kind is FailureKind.HASH_MISMATCH


def test_the_future_is_the_only_result_channel(tmp_path):
    """Each plan's result reaches its future; once the caller drops the futures, the engine
    holds no result (a long-running engine does not grow with the plans it ran)."""
    tiers = make_tiers(tmp_path)
    with TransferEngine(tiers) as engine:
        futures = [engine.submit(TransferPlan.for_path("G1->G2", [i], [i], [i], job_id=i))
                   for i in range(5)]
        assert sorted(f.result(timeout=30).job_id for f in futures) == list(range(5))
        refs = [weakref.ref(f.result()) for f in futures]
        del futures
        gc.collect()
        assert [r() for r in refs] == [None] * 5


def test_submit_validation(tmp_path):
    tiers = make_tiers(tmp_path)
    with TransferEngine({"G1": tiers["G1"], "G2": tiers["G2"]}) as engine:
        assert engine.paths == ("G1->G2", "G2->G1")
        with pytest.raises(TransferPlanError, match="no handler for path G2->G3"):
            engine.submit(TransferPlan.for_path("G2->G3", [0], [0], [0], job_id=0))
        with pytest.raises(TransferPlanError, match="G2 block id 12 out of range"):
            engine.submit(TransferPlan.for_path("G1->G2", [0], [12], [0], job_id=0))
        with pytest.raises(TransferPlanError):
            engine.submit({"path": "G1->G2"})


def test_storage_validation(tmp_path):
    tiers = make_tiers(tmp_path)
    with pytest.raises(StorageConfigError,
                       match=r"G2 \(host\) needs a storage of its kind, got DeviceStorage"):
        TransferEngine({"G1": tiers["G1"], "G2": tiers["G1"]})
    with pytest.raises(StorageConfigError, match="unknown tier 'G9'"):
        TransferEngine({"G9": tiers["G1"]})
    with pytest.raises(StorageConfigError,
                       match=r"G4 \(object\) needs a storage of its kind, got HostStorage"):
        TransferEngine({"G1": tiers["G1"], "G4": tiers["G2"]})
    other = HostStorage(small_config(page_size=8))
    with pytest.raises(LayoutMismatchError, match="page_size"):
        TransferEngine({"G1": tiers["G1"], "G2": other})


class _GateCopyEngine(CopyEngine):
    """Blocks every copy until released (to hold plans in flight)."""

    def __init__(self):
        self.gate = threading.Event()
        self.inner = MemmoveCopyEngine()

    def copy(self, *args, **kw):
        self.gate.wait(30)
        return self.inner.copy(*args, **kw)


def test_bounded_queue_and_close(tmp_path):
    tiers = make_tiers(tmp_path)
    gate = _GateCopyEngine()
    engine = TransferEngine(tiers, copy_engine=gate, queue_depth=1)
    running = engine.submit(TransferPlan.for_path("G1->G2", [0], [0], [1], job_id=0))
    while not running.running():
        threading.Event().wait(0.001)
    queued = engine.submit(TransferPlan.for_path("G1->G2", [1], [1], [2], job_id=0))
    with pytest.raises(EngineBusyError, match="queue full"):
        engine.submit(TransferPlan.for_path("G1->G2", [2], [2], [3], job_id=0), timeout=0)
    with pytest.raises(EngineBusyError):
        engine.submit(TransferPlan.for_path("G1->G2", [2], [2], [3], job_id=0), timeout=0.05)
    # other paths are not blocked by a full G1->G2 queue
    other = engine.submit(TransferPlan.for_path("G2->G3", [5], [5], [5], job_id=0))
    assert other.result(timeout=30).failures[0].kind is FailureKind.NOT_WRITTEN
    closer = threading.Thread(target=engine.close, kwargs={"cancel_pending": True})
    closer.start()
    gate.gate.set()
    closer.join(30)
    assert running.result(timeout=1).all_ok
    assert queued.cancelled() or queued.result(timeout=1).all_ok
    with pytest.raises(EngineClosedError):
        engine.submit(TransferPlan.for_path("G1->G2", [3], [3], [4], job_id=0))
    engine.close()


class _BrokenCopyEngine(CopyEngine):
    def copy(self, *args, **kw):
        raise RuntimeError("device lost")


def test_unexpected_error_fails_the_whole_batch(tmp_path):
    tiers = make_tiers(tmp_path)
    with TransferEngine(tiers, copy_engine=_BrokenCopyEngine()) as engine:
        result = run(engine, "G1->G2", [0, 1], [0, 1], [1, 2])
        assert result.ok == (False, False) and "device lost" in result.error
        assert {f.kind for f in result.failures} == {FailureKind.INTERNAL}
        assert run(engine, "G2->G3", [0], [0], [1]).failures[0].kind is FailureKind.NOT_WRITTEN


def test_concurrent_stress_all_bytes_right(tmp_path):
    """Four submitter threads, three workers per path, 96 plans over all paths."""
    tiers = make_tiers(tmp_path, blocks=(64, 64, 64), o_direct=True)
    g1 = tiers["G1"]
    expected = {b: block_bytes_of(g1, b) for b in range(32)}

    def lane(k: int) -> None:
        base = k * 8                          # each lane owns 8 slots in every tier
        for rnd in range(4):
            src = [base + (i + rnd) % 8 for i in range(4)]
            seq = [1000 * k + s for s in src]
            host = [base + i for i in range(4)]
            disk = [base + 4 + i for i in range(4)]
            back = [32 + base + i for i in range(4)]
            assert run(engine, "G1->G2", src, host, seq).all_ok
            futs = [engine.submit(TransferPlan.for_path("G2->G3", host, disk, seq, job_id=0)),
                    engine.submit(TransferPlan.for_path("G2->G1", host, back, seq, job_id=0))]
            assert all(f.result(timeout=30).all_ok for f in futs)
            for s, b in zip(src, back):
                assert torch.equal(block_bytes_of(g1, b), expected[s])
            assert run(engine, "G3->G2", disk, [base + 4 + i for i in range(4)], seq).all_ok
            assert run(engine, "G3->G1", disk, back, seq).all_ok
            for s, b in zip(src, back):
                assert torch.equal(block_bytes_of(g1, b), expected[s])
            assert_same(g1, src, tiers["G2"], [base + 4 + i for i in range(4)])

    with TransferEngine(tiers, workers_per_path=3, queue_depth=4) as engine:
        with ThreadPoolExecutor(4) as pool:
            for f in [pool.submit(lane, k) for k in range(4)]:
                f.result(timeout=60)


def test_eager_checksum_travels_end_to_end_to_disk(tmp_path):
    """An eager G2 checksum is what G3 records: bytes corrupted in G2 after they were hashed
    (host verification off) are written to disk but never served from it."""
    tiers = make_tiers(tmp_path, host_checksums="eager")
    g1 = tiers["G1"]
    before = block_bytes_of(g1, 9)
    with TransferEngine(tiers) as engine:
        r1 = run(engine, "G1->G2", [0, 1], [0, 1], [1, 2])
        tiers["G2"].payload(1)[3] ^= 0x40                 # silent corruption in host RAM
        r2 = run(engine, "G2->G3", [0, 1], [0, 1], [1, 2])
        assert r2.all_ok and r2.checksums == r1.checksums
        back = run(engine, "G3->G1", [0, 1], [8, 9], [1, 2])
        assert back.ok == (True, False)
        assert back.failures[0].kind is FailureKind.CHECKSUM_MISMATCH
    assert torch.equal(block_bytes_of(g1, 9), before)


def test_deferred_checksum_is_computed_by_the_disk_write(tmp_path):
    tiers = make_tiers(tmp_path)                          # auto, verify off -> deferred
    g2, g3 = tiers["G2"], tiers["G3"]
    assert not g2.eager_checksums
    with TransferEngine(tiers) as engine:
        assert run(engine, "G1->G2", [2, 3], [4, 5], [7, 8]).checksums == (None, None)
        r2 = run(engine, "G2->G3", [4, 5], [10, 11], [7, 8])
        expected = [xxhash.xxh3_64_intdigest(g2.payload(b)) for b in (4, 5)]
        assert list(r2.checksums) == expected
        assert g2.checksums.checksums_of([4, 5]) == expected    # recorded in G2 as well
        assert [g3.checksums.get(s)[0] for s in (10, 11)] == expected
        assert run(engine, "G3->G1", [10, 11], [12, 13], [7, 8]).all_ok
    assert_same(tiers["G1"], [2, 3], tiers["G1"], [12, 13])


class _FlipAfterCopy(CopyEngine):
    """A copy engine whose copies land, and then a byte of the destination flips (memory
    corruption, or anything else writing host RAM) before any hash of it could be taken."""

    name = "flip-after-copy"

    def __init__(self) -> None:
        from kvstrata.physical.engines import default_copy_engine

        self.inner = default_copy_engine()

    def copy(self, src, src_ids, dst, dst_ids, *, direction="offload"):
        moved = self.inner.copy(src, src_ids, dst, dst_ids, direction=direction)
        if dst.device.type == "cpu" and direction == "offload":
            region = dst.regions[0].numpy()
            region[dst_ids[0] * dst.layout.block_stride + 5] ^= 0x10
        return moved

    def close(self) -> None:
        self.inner.close()


@pytest.mark.parametrize("g1_kind", G1_KINDS)
def test_a_g2_byte_flipped_right_after_the_copy_is_never_served(tmp_path, g1_kind):
    """Integrity across a live copy: with verified G2 reads the checksum comes from the
    engine's own bytes, so a flip in G2 between the copy and any hash is caught on the way
    back (G2->G1) and on the way down (G2->G3->G1), never stored under a matching checksum."""
    tiers = make_tiers(tmp_path, g1_kind=g1_kind, verify_host=True)
    g1 = tiers["G1"]
    want = [block_bytes_of(g1, b) for b in (0, 1)]
    with TransferEngine(tiers, copy_engine=_FlipAfterCopy()) as engine:
        down = run(engine, "G1->G2", [0, 1], [0, 1], [1, 2])
        assert down.all_ok
        assert list(down.checksums) == [xxhash.xxh3_64_intdigest(w.numpy()) for w in want]
        back = run(engine, "G2->G1", [0, 1], [8, 9], [1, 2])
        assert back.ok == (False, True) and back.failures[0].kind is FailureKind.CHECKSUM_MISMATCH
        assert torch.equal(block_bytes_of(g1, 9), want[1])
        disk = run(engine, "G2->G3", [1], [0], [2])
        assert disk.all_ok and disk.checksums == down.checksums[1:]


def _nice_of(native_id: int) -> int:
    with open(f"/proc/self/task/{native_id}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])


def test_store_threads_run_at_the_niceness_asked_and_loads_are_left_alone(tmp_path):
    import os
    import time

    if not os.path.exists(f"/proc/self/task/{threading.get_native_id()}/stat"):
        pytest.skip("no per-thread /proc stat here")
    tiers = make_tiers(tmp_path)
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with TransferEngine(tiers, store_nice=7) as engine:
        deadline = time.monotonic() + 5
        while any(t.native_id is None for t in engine._threads) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)                                   # each thread sets it as it starts
        nice = {t.name: _nice_of(t.native_id) for t in engine._threads}
        assert nice["kvstrata-G1->G2-0"] == max(base, 7)
        assert nice["kvstrata-G2->G3-0"] == max(base, 7)
        assert nice["kvstrata-G2->G1-0"] == base
        assert nice["kvstrata-G3->G2-0"] == base
        assert run(engine, "G1->G2", [0, 1], [2, 3], [11, 12]).all_ok   # still works niced
