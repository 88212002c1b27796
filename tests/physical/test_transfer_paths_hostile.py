"""Hostile review of the transfer engine's derived paths against the nine handlers it had
before (``_device_to_host`` ... ``_object_to_device``): which paths exist for every set of
tiers and which are paced (whole or per round), which checksums a result carries on each
path, G2 slots after a load that failed part-way, failures at their plan positions through
staging rounds and paced rounds of object writes, and blocks' identities reaching a durable
disk's index. Real storages: a CPU device tier, host RAM, a slab in tmp_path, SeaweedFS."""

from __future__ import annotations

import errno
import uuid

import pytest
import torch
import xxhash

from kvstrata.physical import (DeviceStorage, DiskStorage, FailureKind, HostStorage,
                               ObjectStorage, TransferEngine, TransferPlan, TransferPlanError)
from kvstrata.physical.pacing import ForwardPacer
from kvstrata.physical.storage.s3client import ObjectStoreRequestError
from kvstrata.protocol import Endpoint

from .conftest import FaultyFileOps, block_bytes_of, fill_random, small_config

pytestmark = pytest.mark.timeout(60)

CFG = small_config(num_blocks=16)
FP = "0123456789abcdef"                         # a durable home's fingerprint
STRIDE = 4096                                   # a slab slot (and a staging slot) of CFG


@pytest.fixture
def g4(weed):
    store = ObjectStorage(CFG, weed.s3_config(), namespace=f"hostile/{uuid.uuid4().hex[:12]}/",
                          fingerprint="fp-hostile", max_concurrency=2)
    yield store
    store.close()


def tiers_of(tmp_path, *names, verify_host=True, file_ops=None, g4=None, durable=False):
    g1 = DeviceStorage.allocate(CFG, device="cpu")
    fill_random(g1.memory.regions, seed=3)
    out = {"G1": g1, "G2": HostStorage(CFG.with_alignment(512), verify_reads=verify_host)}
    if "G3" in names:
        out["G3"] = (DiskStorage.durable(CFG, tmp_path, fingerprint=FP, file_ops=file_ops)
                     if durable else DiskStorage(CFG, tmp_path, file_ops=file_ops))
    if "G4" in names:
        out["G4"] = g4
    return out


def plan(job, source, target, seqs, *, src=(), dst=(), src_keys=(), dst_keys=(), ids=False):
    identity = dict(parent_hashes=(None, *seqs[:-1]), local_hashes=tuple(s + 1000 for s in seqs))
    return TransferPlan(job, Endpoint(source), Endpoint(target), seqs, src_block_ids=src,
                        dst_block_ids=dst, src_keys=src_keys, dst_keys=dst_keys,
                        **(identity if ids else {}))


def run(engine, p):
    return engine.submit(p).result(timeout=30)


def xxh(storage, block_id) -> int:
    return xxhash.xxh3_64_intdigest(block_bytes_of(storage, block_id).numpy())


def held_forward(max_hold: float = 0.01) -> ForwardPacer:
    """A pacer whose forward never ends: every paced unit waits ``max_hold`` once and counts
    one hold, so ``counters.holds`` is how many units a plan was paced in."""
    pacer = ForwardPacer(max_hold=max_hold)
    pacer.forward_started()
    return pacer


# ------------------------------------------------------------------- paths and pacing
OLD_PATHS = {
    ("G1", "G2"): ("G1->G2", "G2->G1"),
    ("G1", "G2", "G3"): ("G1->G2", "G2->G1", "G2->G3", "G3->G1", "G3->G2"),
    ("G1", "G2", "G4"): ("G1->G2", "G2->G1", "G2->G4", "G4->G1", "G4->G2"),
    ("G1", "G2", "G3", "G4"): ("G1->G2", "G2->G1", "G2->G3", "G2->G4", "G3->G1", "G3->G2",
                               "G3->G4", "G4->G1", "G4->G2"),
}
"""What the nine handlers of the old engine gave for each set of tiers, in order."""


@pytest.mark.parametrize("names", list(OLD_PATHS), ids=lambda n: "+".join(n))
def test_paths_and_pacing_of_every_tier_set_are_the_old_ones(tmp_path, g4, names):
    tiers = tiers_of(tmp_path, *names, g4=g4)
    # whole: a disk plan waits once; per round: an object store's PUTs wait per round
    old_paced = {"G2->G3": True, "G2->G4": False, "G3->G4": False}
    with TransferEngine(tiers) as engine:
        assert engine.paths == OLD_PATHS[names]
        assert engine._paced_paths == {p: w for p, w in old_paced.items() if p in engine.paths}
        for path in ("G1->G3", "G1->G4", "G4->G3"):
            a, b = path.split("->")
            if a in tiers and b in tiers:
                with pytest.raises(TransferPlanError, match="no handler"):
                    engine.submit(plan(1, a, b, [1], **{
                        ("src_keys" if a == "G4" else "src"): ("k",) if a == "G4" else (0,),
                        ("dst_keys" if b == "G4" else "dst"): ("k",) if b == "G4" else (0,)}))
    if "G3" in tiers:
        tiers["G3"].close()


def test_loads_and_copies_out_of_device_memory_are_never_paced(tmp_path):
    pacer = held_forward()
    tiers = tiers_of(tmp_path, "G3")
    seqs = [1, 2, 3, 4, 5]
    ids = tuple(range(5))
    with TransferEngine(tiers, pacer=pacer) as engine:
        for p in (plan(1, "G1", "G2", seqs, src=ids, dst=ids),
                  plan(2, "G2", "G1", seqs, src=ids, dst=(8, 9, 10, 11, 12))):
            assert run(engine, p).all_ok and pacer.counters.holds == 0
        stored = run(engine, plan(3, "G2", "G3", seqs, src=ids, dst=ids))
        assert stored.all_ok and pacer.counters.holds == 1        # a disk plan: once, whole
        assert stored.held_seconds > 0
        for p in (plan(4, "G3", "G2", seqs, src=ids, dst=(5, 6, 7, 8, 9)),
                  plan(5, "G3", "G1", seqs, src=ids, dst=(11, 12, 13, 14, 15))):
            assert run(engine, p).all_ok
        assert pacer.counters.holds == 1
    tiers["G3"].close()


# -------------------------------------------------------------- checksums on each path
@pytest.mark.parametrize("mode", ["eager", "deferred"])
def test_which_checksums_each_path_reports(tmp_path, mode):
    tiers = tiers_of(tmp_path, "G3")
    tiers["G2"] = HostStorage(CFG.with_alignment(512), verify_reads=mode == "eager",
                              checksums=mode)
    g1, g2, g3 = tiers["G1"], tiers["G2"], tiers["G3"]
    seqs = [7, 8, 9]
    want = tuple(xxh(g1, b) for b in range(3))
    with TransferEngine(tiers) as engine:
        down = run(engine, plan(1, "G1", "G2", seqs, src=(0, 1, 2), dst=(0, 1, 2)))
        assert down.checksums == (want if mode == "eager" else (None,) * 3)
        stored = run(engine, plan(2, "G2", "G3", seqs, src=(0, 1, 2), dst=(3, 4, 5)))
        assert stored.checksums == want
        assert g2.checksums.checksums_of([0, 1, 2]) == list(want)     # deferred: filled in
        assert g3.checksums.checksums_of([3, 4, 5]) == list(want)
        loaded = run(engine, plan(3, "G3", "G2", seqs, src=(3, 4, 5), dst=(6, 7, 8)))
        assert loaded.checksums == want
        assert g2.checksums.checksums_of([6, 7, 8]) == list(want)
        for p in (plan(4, "G2", "G1", seqs, src=(6, 7, 8), dst=(10, 11, 12)),
                  plan(5, "G3", "G1", seqs, src=(3, 4, 5), dst=(13, 14, 15))):
            result = run(engine, p)                   # into device memory: none, as before
            assert result.all_ok and result.checksums == (None,) * 3
        for b in range(3):
            assert xxh(g1, 10 + b) == want[b] == xxh(g1, 13 + b)
    g3.close()


# ------------------------------------------------------ loads that fail part of the way
def test_a_partial_load_into_g2_leaves_failed_slots_invalid(tmp_path):
    ops = FaultyFileOps(read_errno=errno.EIO, fail_offsets={4 * STRIDE})
    ops.armed = False
    tiers = tiers_of(tmp_path, "G3", file_ops=ops)
    g1, g2, g3 = tiers["G1"], tiers["G2"], tiers["G3"]
    with TransferEngine(tiers) as engine:
        assert run(engine, plan(1, "G1", "G2", [1, 2, 3], src=(0, 1, 2), dst=(0, 1, 2))).all_ok
        assert run(engine, plan(2, "G2", "G3", [1, 2, 3], src=(0, 1, 2), dst=(3, 4, 5))).all_ok
        # G2 slots 8 and 9 hold valid blocks that the load overwrites
        assert run(engine, plan(3, "G1", "G2", [50, 51], src=(5, 6), dst=(8, 9))).all_ok
        ops.armed = True
        result = run(engine, plan(4, "G3", "G2", [1, 2, 3], src=(3, 4, 5), dst=(7, 8, 9)))
        assert result.ok == (True, False, True)
        assert result.failures[0].position == 1 and result.failures[0].kind is FailureKind.IO_ERROR
        assert result.checksums == (xxh(g1, 0), None, xxh(g1, 2))
        assert g2.checksums.get(8) is None                  # neither 51's nor 2's any more
        assert g2.checksums.get(9)[:2] == (xxh(g1, 2), 3)
        for slot, seq in ((8, 51), (8, 2)):
            (failure,) = g2.check_readable([slot], [seq])
            assert failure.kind is FailureKind.NOT_WRITTEN
        back = run(engine, plan(5, "G2", "G1", [1, 3], src=(7, 9), dst=(12, 13)))
        assert back.all_ok and xxh(g1, 12) == xxh(g1, 0) and xxh(g1, 13) == xxh(g1, 2)
    g3.close()


def test_a_dead_store_fails_every_position_and_leaves_no_g2_slot_valid(tmp_path):
    tiers = tiers_of(tmp_path, "G3")
    g2, g3 = tiers["G2"], tiers["G3"]
    with TransferEngine(tiers) as engine:
        assert run(engine, plan(1, "G1", "G2", [1, 2], src=(0, 1), dst=(0, 1))).all_ok
        assert run(engine, plan(2, "G2", "G3", [1, 2], src=(0, 1), dst=(0, 1))).all_ok
        assert run(engine, plan(3, "G1", "G2", [60, 61], src=(2, 3), dst=(4, 5))).all_ok
        g3.close()
        result = run(engine, plan(4, "G3", "G2", [1, 2], src=(0, 1), dst=(4, 5)))
        assert result.ok == (False, False) and result.error
        assert [f.kind for f in result.failures] == [FailureKind.INTERNAL] * 2
        assert [f.block_id for f in result.failures] == [4, 5]
        assert g2.checksums.get(4) is None and g2.checksums.get(5) is None


def test_staged_load_failures_keep_their_positions_across_rounds(tmp_path):
    ops = FaultyFileOps(read_errno=errno.EIO, fail_offsets={(8 + 5) * STRIDE})
    ops.armed = False
    tiers = tiers_of(tmp_path, "G3", file_ops=ops)
    g1, g3 = tiers["G1"], tiers["G3"]
    seqs = [31, 32, 33, 34, 35, 36, 37]
    before = block_bytes_of(g1, 14)
    with TransferEngine(tiers, staging_bytes=3 * STRIDE) as engine:   # 3 blocks a round
        assert run(engine, plan(1, "G1", "G2", seqs, src=tuple(range(7)),
                                dst=tuple(range(7)))).all_ok
        assert run(engine, plan(2, "G2", "G3", seqs, src=tuple(range(7)),
                                dst=tuple(range(8, 15)))).all_ok
        ops.armed = True
        result = run(engine, plan(3, "G3", "G1", seqs, src=tuple(range(8, 15)),
                                  dst=(15, 7, 8, 9, 10, 14, 11)))
        assert result.ok == (True,) * 5 + (False, True)
        (failure,) = result.failures
        assert failure.position == 5 and failure.block_id == 13 and failure.kind is \
            FailureKind.IO_ERROR
        assert result.failed_sequence_hashes == (36,)
    assert torch.equal(block_bytes_of(g1, 14), before)
    for src, dst in zip(range(7), (15, 7, 8, 9, 10, None, 11)):
        if dst is not None:
            assert xxh(g1, dst) == xxh(g1, src), (src, dst)
    g3.close()


# ------------------------------------------------------ paced rounds of object writes
def fail_puts_of(store: ObjectStorage, bad: set[str]) -> None:
    """Unit-level fault: the store's client refuses the PUT of these keys."""
    real = store.client.put_if_absent

    def put(key, body):
        if key.rsplit("/", 1)[-1] in bad:
            raise ObjectStoreRequestError(f"injected refusal of {key}", 500)
        return real(key, body)

    store.client.put_if_absent = put


def test_paced_object_writes_fail_per_round_at_their_positions(tmp_path, g4):
    pacer = held_forward()
    tiers = tiers_of(tmp_path, "G4", g4=g4)
    g1, g2 = tiers["G1"], tiers["G2"]
    seqs = [41, 42, 43, 44, 45]
    keys = tuple(f"k{s}" for s in seqs)
    fail_puts_of(g4, {"k43"})                       # in the second round of two PUTs
    with TransferEngine(tiers, pacer=pacer) as engine:
        assert run(engine, plan(1, "G1", "G2", seqs, src=tuple(range(5)),
                                dst=tuple(range(5)))).all_ok
        result = run(engine, plan(2, "G2", "G4", seqs, src=tuple(range(5)), dst_keys=keys,
                                  ids=True))
    assert pacer.counters.holds == 3                # rounds of 2, 2 and 1 PUTs
    assert result.ok == (True, True, False, True, True)
    assert [(f.position, f.kind) for f in result.failures] == [(2, FailureKind.IO_ERROR)]
    assert result.checksums == (xxh(g1, 0), xxh(g1, 1), None, xxh(g1, 3), xxh(g1, 4))
    assert g2.checksums.checksums_of(range(5)) == [xxh(g1, b) for b in range(5)]
    assert g4.exists(list(keys)) == [True, True, False, True, True]


def test_disk_to_object_through_staging_and_paced_rounds(tmp_path, g4):
    """G3 -> G4: staging rounds of 3 blocks, PUT rounds of 2 inside each; a disk read that
    fails in one round and a PUT that fails in another land at their plan positions, and
    every stored block carries the checksum the disk verified."""
    ops = FaultyFileOps(read_errno=errno.EIO, fail_offsets={4 * STRIDE})
    ops.armed = False
    pacer = held_forward()
    tiers = tiers_of(tmp_path, "G3", "G4", file_ops=ops, g4=g4)
    g1, g3 = tiers["G1"], tiers["G3"]
    seqs = [61, 62, 63, 64, 65, 66, 67]
    keys = tuple(f"k{s}" for s in seqs)
    ids = tuple(range(7))
    fail_puts_of(g4, {"k62"})
    with TransferEngine(tiers, pacer=pacer, staging_bytes=3 * STRIDE) as engine:
        assert run(engine, plan(1, "G1", "G2", seqs, src=ids, dst=ids)).all_ok
        assert run(engine, plan(2, "G2", "G3", seqs, src=ids, dst=ids)).all_ok
        holds = pacer.counters.holds
        ops.armed = True
        result = run(engine, plan(3, "G3", "G4", seqs, src=ids, dst_keys=keys, ids=True))
        # rounds [0,1,2] -> PUTs (2, 1); [3,_,5] -> (2); [6] -> (1)
        assert pacer.counters.holds - holds == 4
        assert result.ok == (True, False, True, True, False, True, True)
        assert [(f.position, f.kind) for f in result.failures] == [
            (1, FailureKind.IO_ERROR), (4, FailureKind.IO_ERROR)]
        want = [xxh(g1, b) for b in ids]
        assert g3.checksums.checksums_of(ids) == want
        assert result.checksums == tuple(None if p in (1, 4) else want[p] for p in ids)
        assert result.failed_sequence_hashes == (62, 65)
        assert g4.exists(list(keys)) == [True, False, True, True, False, True, True]
        good = [p for p in ids if p not in (1, 4)]
        back = run(engine, plan(4, "G4", "G1", [seqs[p] for p in good],
                                src_keys=tuple(keys[p] for p in good),
                                dst=tuple(range(8, 8 + len(good)))))
        assert back.all_ok
        assert [xxh(g1, 8 + i) for i in range(len(good))] == [want[p] for p in good]
    g3.close()


# ------------------------------------------------------- identities and the durable index
def test_identities_reach_the_durable_index_and_only_with_the_plan(tmp_path):
    tiers = tiers_of(tmp_path, "G3", durable=True)
    g3 = tiers["G3"]
    seqs = [71, 72, 73]
    with TransferEngine(tiers, pacer=held_forward()) as engine:
        assert run(engine, plan(1, "G1", "G2", seqs, src=(0, 1, 2), dst=(0, 1, 2))).all_ok
        assert run(engine, plan(2, "G2", "G3", seqs[:2], src=(0, 1), dst=(5, 6),
                                ids=True)).all_ok
        assert run(engine, plan(3, "G2", "G3", seqs[2:], src=(2,), dst=(7,))).all_ok
    g3.close()
    again = DiskStorage.durable(CFG, tmp_path, fingerprint=FP)
    try:
        assert again.recovered.rows() == [(5, 71, None, 1071), (6, 72, 71, 1072)]
    finally:
        again.close()
