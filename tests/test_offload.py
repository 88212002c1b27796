"""Offload cascade and onboard: integrity failures, injected I/O errors, full tiers, admission,
in-flight deduplication and a concurrent stress run (through KvBlockManager)."""

from __future__ import annotations

import errno
import os
import random
import threading

import numpy as np
import pytest

from kvstrata.logical.pool import PoolExhaustedError
from kvstrata.manager import KvBlockManager, ManagerError
from kvstrata.physical import FileOps

from test_manager import (HANG_GUARD, assert_baseline, assert_g1_bytes, chain, evict_g1,
                          hashes_of, make_config, payloads, put)


class FlakyFileOps(FileOps):
    """Fault injection for the G3 slab: ``read_errno`` / ``write_errno`` for I/O that
    touches one of ``offsets`` (byte offsets in the slab) while ``armed``."""

    def __init__(self) -> None:
        self.read_errno: int | None = None
        self.write_errno: int | None = None
        self.offsets: set[int] = set()

    def _hits(self, buffers, offset: int) -> bool:
        end = offset + sum(len(memoryview(b)) for b in buffers)
        return any(offset <= o < end for o in self.offsets)

    def preadv(self, fd, buffers, offset):
        if self.read_errno is not None and self._hits(buffers, offset):
            raise OSError(self.read_errno, os.strerror(self.read_errno))
        return super().preadv(fd, buffers, offset)

    def pwritev(self, fd, buffers, offset):
        if self.write_errno is not None and self._hits(buffers, offset):
            raise OSError(self.write_errno, os.strerror(self.write_errno))
        return super().pwritev(fd, buffers, offset)


class GatedFileOps(FileOps):
    """Fault injection: G3 writes (``pwritev``) or reads (``preadv``) wait at a gate.
    ``*_entered`` is set once one is waiting."""

    def __init__(self, reads: bool = False, writes: bool = False) -> None:
        self.reads, self.writes = reads, writes
        self.gate = threading.Event()
        self.read_entered = threading.Event()
        self.write_entered = threading.Event()

    def preadv(self, fd, buffers, offset):
        if self.reads:
            self.read_entered.set()
            self.gate.wait(HANG_GUARD)
        return super().preadv(fd, buffers, offset)

    def pwritev(self, fd, buffers, offset):
        if self.writes:
            self.write_entered.set()
            self.gate.wait(HANG_GUARD)
        return super().pwritev(fd, buffers, offset)


def fail_once(obj, name: str):
    """Make ``obj.name(...)`` raise RuntimeError on its next call only (fault injection)."""
    original = getattr(obj, name)
    calls = []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError(f"injected failure in {name}")
        return original(*args, **kwargs)
    setattr(obj, name, flaky)
    return calls


def g3_offset(mgr: KvBlockManager, sequence_hash: int) -> int:
    slot = mgr.pools["G3"].lookup(sequence_hash).block_id
    return slot * mgr.storage("G3").layout.block_stride


def only_in_g3(mgr: KvBlockManager, records) -> None:
    evict_g1(mgr)
    mgr.evict("G2", hashes_of(reversed(records))).result()
    assert mgr.locate(hashes_of(records)).result() == ["G3"] * len(records)


def test_corrupted_disk_bytes_are_detected_dropped_and_reported(tmp_path):
    with KvBlockManager(make_config(), disk_dir=tmp_path) as mgr:
        records = chain(5)
        data = payloads(mgr, records)
        put(mgr, records, data)
        only_in_g3(mgr, records)
        bad = records[2].sequence_hash
        path = mgr.storage("G3").path
        fd = os.open(path, os.O_RDWR)
        try:
            offset = g3_offset(mgr, bad) + 100
            byte = os.pread(fd, 1, offset)
            os.pwrite(fd, bytes([byte[0] ^ 0xFF]), offset)
            os.fsync(fd)
        finally:
            os.close(fd)
        with mgr.onboard(hashes_of(records)).result() as result:
            assert result.sequence_hashes == hashes_of(records[:2])   # stops before the bad one
            assert result.failed == [bad]
            assert result.failures[0].tier == "G3"
            assert result.failures[0].kind == "checksum_mismatch"
            assert_g1_bytes(mgr, result, data)
        assert bad not in mgr.pools["G3"]            # dropped from the tier
        assert mgr.metrics.value("kvstrata_checksum_failures_total", tier="G3") == 1
        # The good blocks after it were still loaded (valid bytes), just not handed back.
        assert records[3].sequence_hash in mgr.pools["G1"]
        assert_baseline(mgr)


@pytest.mark.parametrize("verifying", [{}, {"verify_host_reads": True}],
                         ids=["by_default", "asked"])
def test_corrupted_host_bytes_detected_when_verifying_g2(tmp_path, verifying):
    with KvBlockManager(make_config(), disk_dir=tmp_path, **verifying) as mgr:
        records = chain(3)
        data = payloads(mgr, records)
        put(mgr, records, data)
        evict_g1(mgr)
        bad = records[1].sequence_hash
        slot = mgr.pools["G2"].lookup(bad).block_id
        mgr.storage("G2").payload(slot)[7] ^= 0x55
        with mgr.onboard(hashes_of(records)).result() as result:
            assert result.sequence_hashes == hashes_of(records[:1])
            assert result.failed == [bad] and result.failures[0].tier == "G2"
        assert bad not in mgr.pools["G2"]
        # The disk copy is intact: the next onboard serves it from G3.
        with mgr.onboard(hashes_of(records)).result() as result:
            assert result.sources == ("G1", "G3", "G1")   # the third was loaded before
            assert_g1_bytes(mgr, result, data)
        assert_baseline(mgr)


def test_injected_read_error_drops_block_and_reports_it(tmp_path):
    ops = FlakyFileOps()
    with KvBlockManager(make_config(), disk_dir=tmp_path, file_ops=ops, o_direct=False) as mgr:
        records = chain(4)
        data = payloads(mgr, records)
        put(mgr, records, data)
        only_in_g3(mgr, records)
        bad = records[1].sequence_hash
        ops.offsets = {g3_offset(mgr, bad)}
        ops.read_errno = errno.EIO
        with mgr.onboard(hashes_of(records)).result() as result:
            assert result.sequence_hashes == hashes_of(records[:1])
            assert result.failed == [bad] and result.failures[0].kind == "io_error"
        assert bad not in mgr.pools["G3"]
        assert mgr.metrics.value("kvstrata_transfer_failed_blocks_total", path="G3->G1",
                                 kind="io_error") == 1
        assert_baseline(mgr)


def test_injected_write_error_is_not_registered(tmp_path):
    ops = FlakyFileOps()
    with KvBlockManager(make_config(g3=8), disk_dir=tmp_path, file_ops=ops,
                        o_direct=False) as mgr:
        stride = mgr.storage("G3").layout.block_stride
        ops.offsets = {1 * stride}          # the second G3 slot handed out
        ops.write_errno = errno.ENOSPC
        records = chain(3)
        put(mgr, records, payloads(mgr, records))
        mgr.wait_idle(10)
        in_g3 = [r.sequence_hash in mgr.pools["G3"] for r in records]
        assert in_g3 == [True, False, True]
        assert mgr.metrics.value("kvstrata_transfer_failed_blocks_total", path="G2->G3",
                                 kind="disk_full") == 1
        assert mgr.status()["tiers"]["G3"]["pool"]["reset"] == 8 - 2
        assert_baseline(mgr)


def test_full_lower_tiers_evict_by_policy_without_blocking(tmp_path):
    with KvBlockManager(make_config(g1=4, g2=4, g3=6), disk_dir=tmp_path) as mgr:
        chains = [chain(2, start=1000 * i) for i in range(6)]
        data: dict[int, np.ndarray] = {}
        for i, records in enumerate(chains):
            data.update(payloads(mgr, records, seed=i))
            # Every call resolves while all tiers are full (put's futures carry a hang
            # guard only): room is made by eviction, nobody waits for memory.
            put(mgr, records, data)
            mgr.wait_idle(HANG_GUARD)
        status = mgr.status()["tiers"]
        assert status["G2"]["pool"]["evictions"] == 12 - 4
        assert status["G3"]["pool"]["evictions"] == 12 - 6
        assert sum(s["failed_blocks"] for s in mgr.transfer_stats().values()) == 0
        # Least recently used chains went first; the newest ones are still held.
        assert mgr.locate(hashes_of(chains[-1])).result() == ["G1", "G1"]
        assert mgr.locate(hashes_of(chains[3])).result() == ["G3", "G3"]
        assert mgr.locate(hashes_of(chains[0])).result() == []
        with mgr.onboard(hashes_of(chains[3])).result(HANG_GUARD) as result:
            assert result.sources == ("G3", "G3")
            assert_g1_bytes(mgr, result, data)
        assert_baseline(mgr)


def test_offload_larger_than_a_busy_tier_is_deferred_not_dropped(tmp_path):
    """10 blocks offered to a 4-slot G2: the slots are all held by the copies in flight, so
    the rest waits for completions (no caller blocks) and every block still reaches G3."""
    with KvBlockManager(make_config(g1=16, g2=4, g3=16), disk_dir=tmp_path) as mgr:
        records = chain(10)
        data = payloads(mgr, records)
        put(mgr, records, data)
        mgr.wait_idle(10)
        assert all(r.sequence_hash in mgr.pools["G3"] for r in records)
        assert mgr.transfer_stats()["G1->G2"]["blocks"] == 10
        assert mgr.status()["tiers"]["G2"]["pool"]["evictions"] == 6
        assert mgr.metrics.value("kvstrata_offload_skipped_blocks_total", tier="G2",
                                 reason="evicted") == 0
        only_in_g3(mgr, records)
        with mgr.onboard(hashes_of(records)).result() as result:
            assert len(result) == 10
            assert_g1_bytes(mgr, result, data)
        assert_baseline(mgr)


def test_second_offer_admission_on_g3(tmp_path):
    with KvBlockManager(make_config(g3_admission="second-offer"), disk_dir=tmp_path) as mgr:
        records = chain(3)
        data = payloads(mgr, records)
        put(mgr, records, data)
        mgr.wait_idle(10)
        assert not any(r.sequence_hash in mgr.pools["G3"] for r in records)
        assert mgr.metrics.value("kvstrata_offload_skipped_blocks_total", tier="G3",
                                 reason="admission") == 3
        # Offered a second time (recomputed after leaving G1 and G2): admitted.
        evict_g1(mgr)
        mgr.evict("G2", hashes_of(reversed(records))).result()
        put(mgr, records, data)
        mgr.wait_idle(10)
        assert all(r.sequence_hash in mgr.pools["G3"] for r in records)
        only_in_g3(mgr, records)
        with mgr.onboard(hashes_of(records)).result() as result:
            assert_g1_bytes(mgr, result, data)
        assert_baseline(mgr)


def test_concurrent_onboards_of_one_prefix_copy_once(tmp_path):
    with KvBlockManager(make_config(g1=16), disk_dir=tmp_path) as mgr:
        records = chain(6)
        data = payloads(mgr, records)
        put(mgr, records, data)
        only_in_g3(mgr, records)
        futures = [mgr.onboard(hashes_of(records)) for _ in range(4)]
        results = [f.result(10) for f in futures]
        first_ids = results[0].block_ids
        for result in results:
            assert len(result) == 6 and result.failed == []
            assert result.sources == ("G3",) * 6
            assert result.block_ids == first_ids
            assert_g1_bytes(mgr, result, data)
            result.release()
        mgr.wait_idle(10)
        assert mgr.transfer_stats()["G3->G1"]["blocks"] == 6
        assert_baseline(mgr)


def test_g1_exhausted_by_held_blocks_shortens_onboard(tmp_path):
    with KvBlockManager(make_config(g1=4), disk_dir=tmp_path) as mgr:
        records = chain(4)
        data = payloads(mgr, records)
        put(mgr, records, data)
        evict_g1(mgr)
        held = mgr.allocate(2).result()           # the engine holds half of G1
        with mgr.onboard(hashes_of(records)).result() as result:
            assert len(result) == 2 and result.failed == []
            assert_g1_bytes(mgr, result, data)
        mgr.release(held).result()
        assert_baseline(mgr)


def test_concurrent_offload_and_onboard_stress(tmp_path):
    """Threads compute, register and onboard overlapping chains at once; afterwards every
    block is still held once somewhere, bytes are right, and no handle is left behind."""
    with KvBlockManager(make_config(g1=24, g2=24, g3=400), disk_dir=tmp_path,
                        workers_per_path=2) as mgr:
        chains = [chain(4, start=500 * i) for i in range(12)]
        data: dict[int, np.ndarray] = {}
        for i, records in enumerate(chains):
            data.update(payloads(mgr, records, seed=i))
        errors: list[BaseException] = []
        loaded = [0]
        computed: set[int] = set()
        lock = threading.Lock()

        def worker(seed: int) -> None:
            rng = random.Random(seed)
            try:
                for _ in range(25):
                    records = rng.choice(chains)
                    hashes = hashes_of(records)
                    with mgr.onboard(hashes).result(HANG_GUARD) as result:
                        assert result.failed == []
                        assert_g1_bytes(mgr, result, data)
                        with lock:
                            loaded[0] += len(result)
                            # Only blocks some thread computed can be found anywhere.
                            assert set(result.sequence_hashes) <= computed
                        missing = records[len(result):]
                    if not missing:
                        continue
                    with lock:   # before put: another thread may find them at once
                        computed.update(hashes_of(missing))
                    for _attempt in range(20):   # G1 may be briefly all in use by others
                        try:
                            put(mgr, missing, data)
                            break
                        except PoolExhaustedError:
                            mgr.wait_idle(HANG_GUARD)
                    else:
                        raise AssertionError("G1 stayed exhausted for 20 attempts")
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "a worker thread hung"
        assert not errors, errors[0]
        assert loaded[0] > 0
        assert_baseline(mgr)
        # Nothing lost: G3 (400 slots) never evicts these 48 blocks, so every block any
        # thread computed reached it, and every chain held there is found whole.
        g3 = mgr.pools["G3"]
        assert computed and all(h in g3 for h in computed), \
            f"{len([h for h in computed if h not in g3])} computed blocks missing from G3"
        for records in chains:   # computed blocks of a chain form its prefix, found whole
            held = [h for h in hashes_of(records) if h in computed]
            assert held == hashes_of(records)[:len(held)]
            assert len(mgr.locate(hashes_of(records)).result()) == len(held)
        stats = mgr.transfer_stats()
        assert sum(s["failed_blocks"] for s in stats.values()) == 0
        assert sum(stats.get(p, {}).get("blocks", 0) for p in ("G2->G1", "G3->G1")) > 0
        # No duplicate: each hash sits in at most one slot per tier, with the right bytes.
        g2 = mgr.storage("G2")
        for h in mgr.registry.hashes_in("G2"):
            assert np.array_equal(g2.payload(mgr.pools["G2"].lookup(h).block_id), data[h])
        assert set(mgr.registry.hashes_in("G3")) == computed


def test_transfer_that_cannot_be_submitted_fails_and_settles(tmp_path):
    with KvBlockManager(make_config(), disk_dir=tmp_path) as mgr:
        fail_once(mgr.engine, "submit")
        records = chain(3)
        data = payloads(mgr, records)
        put(mgr, records, data)
        mgr.wait_idle(HANG_GUARD)             # the failed copy settled: nothing pending
        assert mgr.transfer_stats()["G1->G2"]["failed_blocks"] == 3
        assert mgr.metrics.value("kvstrata_transfer_failed_blocks_total", path="G1->G2",
                                 kind="internal") == 3
        assert not any(r.sequence_hash in mgr.pools["G2"] for r in records)
        assert_baseline(mgr)                  # G2 slots and G1 holds were given back
        more = chain(2, start=700)
        data.update(payloads(mgr, more, seed=1))
        put(mgr, more, data)
        mgr.wait_idle(HANG_GUARD)
        assert all(r.sequence_hash in mgr.pools["G3"] for r in more)


def test_error_handling_a_completion_still_settles_the_onboard(tmp_path):
    with KvBlockManager(make_config(), disk_dir=tmp_path) as mgr:
        records = chain(3)
        data = payloads(mgr, records)
        put(mgr, records, data)
        evict_g1(mgr)
        fail_once(mgr.metrics, "transfer_done")    # a bug while handling the G2->G1 copy
        with mgr.onboard(hashes_of(records)).result(HANG_GUARD) as result:
            assert len(result) == 0
            assert result.failed == hashes_of(records)
            assert {f.kind for f in result.failures} == {"internal"}
        assert_baseline(mgr)                      # holds released, nothing pending
        # The same prefix is not stuck behind the failed request.
        with mgr.onboard(hashes_of(records)).result(HANG_GUARD) as result:
            assert result.sources == ("G2",) * 3
            assert_g1_bytes(mgr, result, data)
        assert_baseline(mgr)


def test_owner_failure_breaks_the_manager_and_fails_every_waiter(tmp_path):
    ops = GatedFileOps(reads=True)
    mgr = KvBlockManager(make_config(), disk_dir=tmp_path, file_ops=ops, o_direct=False)
    try:
        records = chain(2)
        put(mgr, records, payloads(mgr, records))
        only_in_g3(mgr, records)
        onboard = mgr.onboard(hashes_of(records))       # waits at the read gate
        assert ops.read_entered.wait(HANG_GUARD)
        fail_once(mgr.metrics, "set_pool")              # a bug outside any one request
        flush = mgr.flush()                             # the owner fails right after it
        with pytest.raises(ManagerError, match="owner thread"):
            onboard.result(HANG_GUARD)
        with pytest.raises(ManagerError, match="owner thread"):
            flush.result(HANG_GUARD)
        with pytest.raises(ManagerError, match="owner thread"):
            mgr.allocate(1)
        with pytest.raises(ManagerError):
            mgr.wait_idle(HANG_GUARD)
    finally:
        ops.gate.set()
        closer = threading.Thread(target=mgr.close)
        closer.start()
        closer.join(HANG_GUARD)
    assert not closer.is_alive()


def test_copy_from_a_source_quarantined_mid_copy_is_not_registered(tmp_path):
    """A G2 block found corrupt while it is being copied to G3 is quarantined; the G3 copy
    (made from the corrupt bytes, under the original checksum) must not be registered."""
    ops = GatedFileOps(writes=True)
    with KvBlockManager(make_config(), disk_dir=tmp_path, file_ops=ops, o_direct=False,
                        verify_host_reads=True) as mgr:
        records = chain(3)
        data = payloads(mgr, records)
        hashes = hashes_of(records)
        put(mgr, records, data)
        assert ops.write_entered.wait(HANG_GUARD)          # G2->G3 holds the G2 blocks
        assert len(mgr.evict("G1", list(reversed(hashes))).result(HANG_GUARD)) == 3
        bad = hashes[1]
        mgr.storage("G2").payload(mgr.pools["G2"].lookup(bad).block_id)[5] ^= 0xFF
        with mgr.onboard(hashes).result(HANG_GUARD) as result:
            assert result.failed == [bad] and len(result) == 1
            assert mgr.status()["tiers"]["G2"]["quarantined"] == 1
        ops.gate.set()
        mgr.wait_idle(HANG_GUARD)
        assert bad not in mgr.pools["G2"] and bad not in mgr.pools["G3"]
        assert hashes[0] in mgr.pools["G3"] and hashes[2] in mgr.pools["G3"]
        mgr.evict("G1", list(reversed(hashes))).result(HANG_GUARD)
        with mgr.onboard(hashes).result(HANG_GUARD) as result:
            assert len(result) == 1 and result.failed == []   # recompute, never wrong bytes
            assert_g1_bytes(mgr, result, data)
        assert_baseline(mgr)


def test_in_flight_gauge_returns_to_zero_after_deferred_blocks_are_skipped(tmp_path):
    ops = GatedFileOps(writes=True)
    with KvBlockManager(make_config(g1=8, g2=2, g3=16), disk_dir=tmp_path, file_ops=ops,
                        o_direct=False) as mgr:
        records = chain(6)
        put(mgr, records, payloads(mgr, records))
        # G2 took 2 blocks, now held by the G2->G3 copy at the gate; 4 are deferred.
        assert ops.write_entered.wait(HANG_GUARD)
        held = mgr.allocate(8).result(HANG_GUARD)       # evicts the deferred blocks' sources
        ops.gate.set()
        mgr.wait_idle(HANG_GUARD)
        assert mgr.metrics.value("kvstrata_offload_skipped_blocks_total", tier="G2",
                                 reason="evicted") == 4
        assert mgr.status()["transfers_pending"] == 0
        assert mgr.metrics.value("kvstrata_transfers_in_flight") == 0
        mgr.release(held).result(HANG_GUARD)
        assert_baseline(mgr)
