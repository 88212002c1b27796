"""G2 shared between processes (:mod:`kvstrata.physical.storage.host_shared`): one process
writes slots in its shared memory (a memfd), others map it through a rendezvous file and read
it in place, every read verified against one snapshot of the writer's seals. A reader serves
a block only with the bytes the writer sealed for it (a writer in another process rewriting
slots all the while included), writes nothing, trusts only a rendezvous file of this user's
alone naming memory of this user's with the expected geometry, and keeps reading what it
mapped after the writer is killed, whose memory no file keeps."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstrata.kinds import StorageOptions, TierSetupError, build_storages
from kvstrata.kinds.host import shared_host_problem
from kvstrata.physical import LayoutConfig
from kvstrata.physical.checksum import device_checksum
from kvstrata.physical.errors import FailureKind, StorageConfigError
from kvstrata.physical.leftovers import owner_tag
from kvstrata.physical.storage.host_shared import (FollowedHostStorage, PublishedHostStorage,
                                                   SharedHost, shared_host_path)

from .conftest import block_bytes_of

ROOT = str(Path(__file__).resolve().parents[2])
CFG = LayoutConfig(num_blocks=8, num_layers=2, outer_dim=1, page_size=4, inner_dim=128,
                   dtype="float16")


@pytest.fixture
def shm(tmp_path):
    """A directory in shared memory where there is one (else on disk: the same mechanism)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) \
        else str(tmp_path)
    directory = Path(base) / f"kvstrata-test-{owner_tag()}-{os.urandom(3).hex()}"
    directory.mkdir(mode=0o700)
    yield directory
    for entry in directory.iterdir():
        entry.unlink()
    directory.rmdir()


def fill(storage, slot: int, seq: int) -> np.ndarray:
    """Write block ``seq``'s bytes (a pattern made from it) into ``slot`` and seal it."""
    storage.begin_write([slot])
    payload = pattern(seq)
    storage.payload(slot)[:] = payload
    storage.seal([slot], [seq])
    return payload


def fill_summed(storage, slot: int, seq: int) -> np.ndarray:
    """:func:`fill`, sealed as the GPU copy kernel seals: with the block's device checksum
    and its xxh3 deferred."""
    storage.begin_write([slot])
    payload = pattern(seq)
    storage.payload(slot)[:] = payload
    storage.seal([slot], [seq], defer=True,
                 device_sums=np.array([device_checksum(payload)], dtype=np.uint64))
    return payload


def strict(reader, monkeypatch) -> None:
    """Make every plan out of ``reader`` end with nothing remembered: each slot checked was
    confirmed exactly as often (the transfer engine's forget_reads would hide a leak)."""
    forget = reader.forget_reads

    def checked_forget():
        left = dict(reader._verified.__dict__.get("seals") or {})
        forget()
        assert not left, f"seals left behind: {left}"

    monkeypatch.setattr(reader, "forget_reads", checked_forget)


def pattern(seq: int) -> np.ndarray:
    return np.random.default_rng(seq).integers(0, 255, CFG.block_bytes, dtype=np.uint8)


def test_a_reader_reads_what_the_writer_sealed_and_nothing_else(shm):
    path = shm / "kvstrata-g2-a"
    writer = PublishedHostStorage(CFG, path)
    reader = FollowedHostStorage(CFG, path)
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    expected = {slot: fill(writer, slot, 100 + slot) for slot in range(4)}
    assert reader.check_readable([0, 1, 2, 3], [100, 101, 102, 103]) == []
    for slot, payload in expected.items():
        assert np.array_equal(reader.payload(slot), payload)
    kinds = [f.kind for f in reader.check_readable([4, 1], [104, 999])]
    assert kinds == [FailureKind.NOT_WRITTEN, FailureKind.HASH_MISMATCH]
    writer.begin_write([2])                          # being overwritten: not readable
    assert [f.kind for f in reader.check_readable([2], [102])] == [FailureKind.NOT_WRITTEN]
    writer.close()
    assert not path.exists()                         # the writer's close removes the name
    assert reader.check_readable([0], [100]) == []   # a reader's mapping stays whole
    reader.close()


def test_bytes_changed_after_the_seal_fail_the_readers_check(shm):
    path = shm / "kvstrata-g2-b"
    writer = PublishedHostStorage(CFG, path)
    reader = FollowedHostStorage(CFG, path)
    fill(writer, 0, 7)
    fill(writer, 1, 8)
    writer.payload(1)[10] ^= 0xFF                    # corrupted in place, seal unchanged
    failures = reader.check_readable([0, 1], [7, 8])
    assert [(f.position, f.kind) for f in failures] == [(1, FailureKind.CHECKSUM_MISMATCH)]
    # identity only (a caller that verifies as it copies) does not hash
    assert reader.check_readable([0, 1], [7, 8], verify=False) == []
    writer.close()
    reader.close()


def test_a_seal_torn_between_two_blocks_is_never_valid(shm):
    """Fields of two seals (a reader looking while the writer rewrites one) fail the check
    word, whatever the order of the stores."""
    path = shm / "kvstrata-g2-c"
    writer = PublishedHostStorage(CFG, path)
    reader = FollowedHostStorage(CFG, path)
    fill_summed(writer, 0, 7)
    seals = writer.file.seals
    old = seals[0].copy()
    fill_summed(writer, 0, 9)
    new = seals[0].copy()
    assert old[2] != new[2]                          # each with its device checksum
    for mix in range(1, 31):                         # every mix of the two seals' fields
        seals[0] = [new[i] if mix >> i & 1 else old[i] for i in range(5)]
        assert reader.check_readable([0], [9]) != [] and reader.check_readable([0], [7]) != []
        assert not reader.device_sums_for_read([0, 0], [9, 7])[1].any()
    seals[0] = new
    assert reader.check_readable([0], [9]) == []
    reader.confirm_read([0], [9])
    sums, known = reader.device_sums_for_read([0], [9])
    assert known.tolist() == [True] and sums.tolist() == [device_checksum(pattern(9))]
    assert reader.confirm_read([0], [9]) == []
    writer.close()
    reader.close()


def test_a_reader_writes_nothing(shm):
    path = shm / "kvstrata-g2-d"
    writer = PublishedHostStorage(CFG, path)
    reader = FollowedHostStorage(CFG, path)
    for call in (lambda: reader.begin_write([0]), lambda: reader.seal([0], [1]),
                 lambda: reader.pin_held([1]), lambda: reader.ensure_checksums([0])):
        with pytest.raises(StorageConfigError, match="read here"):
            call()
    assert not reader.payload(0).flags.writeable     # mapped without write permission
    writer.close()
    reader.close()


def test_deferred_seals_are_hashed_for_the_readers_at_once(shm):
    """A seal without a checksum (the GPU copy's deferred one) is hashed by the writer
    before it returns, so readers can verify the block."""
    path = shm / "kvstrata-g2-e"
    writer = PublishedHostStorage(CFG, path)
    reader = FollowedHostStorage(CFG, path)
    writer.begin_write([3])
    writer.payload(3)[:] = pattern(5)
    assert writer.seal([3], [5], defer=True) == [None]
    assert writer.checksums.checksums_of([3])[0] is not None
    assert reader.check_readable([3], [5]) == []
    writer.close()
    reader.close()


def test_only_a_file_of_this_users_alone_with_these_slots_is_trusted(shm):
    path = shm / "kvstrata-g2-f"
    with pytest.raises(StorageConfigError, match="no shared host memory"):
        FollowedHostStorage(CFG, path)
    writer = PublishedHostStorage(CFG, path)
    with pytest.raises(StorageConfigError, match="cannot publish"):
        PublishedHostStorage(CFG, path)              # a second writer of the same name
    assert sorted(p.name for p in shm.iterdir()) == [path.name]    # nothing left behind
    with pytest.raises(StorageConfigError, match="bytes"):
        FollowedHostStorage(CFG.with_blocks(16), path)
    other = LayoutConfig(num_blocks=8, num_layers=1, outer_dim=2, page_size=4, inner_dim=128,
                         dtype="float16")            # same size, other geometry
    with pytest.raises(StorageConfigError, match="other slots"):
        FollowedHostStorage(other, path)
    os.chmod(path, 0o640)
    with pytest.raises(StorageConfigError, match="not trusted"):
        FollowedHostStorage(CFG, path)
    os.chmod(path, 0o600)
    link = shm / "kvstrata-g2-link"
    link.symlink_to(path)
    with pytest.raises(StorageConfigError):
        FollowedHostStorage(CFG, link)
    link.unlink()
    writer.close()


def test_a_rendezvous_naming_other_memory_is_refused(shm, tmp_path):
    """A rendezvous file naming another descriptor of a process of this user (a plain file
    of the right size), the memory of another writer of the same geometry (a pid reused
    after the writer died would name it), or a process that is gone, is not trusted."""
    from kvstrata.physical.storage import host_shared

    path = shm / "kvstrata-g2-forged"
    size = host_shared._placement(CFG.num_blocks, 2048)[2]
    decoy = tmp_path / "decoy"
    decoy.write_bytes(b"\0" * size)
    fd = os.open(decoy, os.O_RDONLY)
    other = PublishedHostStorage(CFG, shm / "kvstrata-g2-other")

    def forge(pid: int, number: int, nonce: bytes = b"n" * 16) -> None:
        path.unlink(missing_ok=True)
        host_shared._publish(path, host_shared._RENDEZVOUS.pack(
            host_shared._RENDEZVOUS_MAGIC, pid, number, size, nonce))

    try:
        forge(os.getpid(), fd)
        with pytest.raises(StorageConfigError, match="not trusted"):   # not a memfd
            FollowedHostStorage(CFG, path)
        forge(os.getpid(), other.file._memory_fd)
        with pytest.raises(StorageConfigError, match="another writer's"):
            FollowedHostStorage(CFG, path)
        gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True).stdout.strip()
        forge(int(gone), fd)
        with pytest.raises(StorageConfigError, match=f"process {gone}.*share_host_tier"):
            FollowedHostStorage(CFG, path)
        path.unlink()
        path.write_bytes(b"garbage" * 3)
        os.chmod(path, 0o600)
        with pytest.raises(StorageConfigError, match="not trusted"):
            FollowedHostStorage(CFG, path)
        path.unlink()
    finally:
        os.close(fd)
        other.close()


def test_this_machine_can_share_memory_the_way_the_readers_open_it():
    from kvstrata.physical.storage.host_shared import memory_sharing_problem

    assert memory_sharing_problem() is None


def test_a_killed_writer_leaves_no_memory_behind_and_readers_keep_theirs(shm):
    """SIGKILL: the writer cannot clean up. Its memory is no file: what a reader mapped stays
    readable, a reader that comes later is told the writer is gone, and what is left (the
    rendezvous file, a few dozen bytes) the next writer in the directory removes."""
    path = shm / f"kvstrata-g2-{owner_tag()}-killed"
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {ROOT!r})
        from tests.physical.test_host_shared import CFG, fill
        from kvstrata.physical.storage.host_shared import PublishedHostStorage
        writer = PublishedHostStorage(CFG, {str(path)!r})
        fill(writer, 2, 77)
        print("ready", flush=True)
        time.sleep(600)
    """)
    writer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert writer.stdout.readline().strip() == "ready"
        reader = FollowedHostStorage(CFG, path)
    finally:
        writer.kill()
        writer.wait()
    assert reader.check_readable([2], [77]) == []
    assert np.array_equal(reader.payload(2), pattern(77))
    reader.close()
    assert [p.name for p in shm.iterdir()] == [path.name]
    assert path.stat().st_size < 64                       # no slots in any file
    with pytest.raises(StorageConfigError, match="cannot open"):
        FollowedHostStorage(CFG, path)


def test_a_writer_in_another_process_is_read_while_it_rewrites(shm):
    """The writer is a separate process rewriting slots as fast as it can; every block the
    reader verifies and copies out is the one the writer wrote under that name."""
    path = shm / "kvstrata-g2-g"
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {ROOT!r})
        from tests.physical.test_host_shared import CFG, fill
        from kvstrata.physical.storage.host_shared import PublishedHostStorage
        writer = PublishedHostStorage(CFG, {str(path)!r})
        for slot in range(8):
            fill(writer, slot, 1 + slot)
        print("ready", flush=True)
        for i in range(8, 4000):
            fill(writer, i % 8, 1 + i)
        print("done", flush=True)
        sys.stdin.readline()
        writer.close()
    """)
    writer = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "ready"
        reader = FollowedHostStorage(CFG, path)
        served = missed = 0
        for _ in range(400):
            for slot in range(8):
                seq = int(reader.file.seals[slot, 0])
                if reader.check_readable([slot], [seq]):
                    missed += 1                      # being rewritten: a miss
                    continue
                copy = reader.payload(slot).copy()   # verified, then copied (the engine's order)
                if np.array_equal(copy, pattern(seq)):
                    served += 1
                else:
                    # rewritten after the check: the writer invalidated the seal first
                    assert reader.check_readable([slot], [seq]) != []
                    missed += 1
        assert served > 0
        assert writer.stdout.readline().strip() == "done"
        # the last seals name the last blocks written, byte for byte
        for slot in range(8):
            seq = int(reader.file.seals[slot, 0])
            assert reader.check_readable([slot], [seq]) == []
            assert np.array_equal(reader.payload(slot), pattern(seq))
        reader.close()
    finally:
        writer.communicate("\n", timeout=60)
    assert not path.exists()


def test_the_kind_builds_one_writer_and_readers(shm, tmp_path):
    from kvstrata.config import KvConfig, ModelGeometry, TierConfig
    from kvstrata.kinds import kind_of

    config = KvConfig(block_size=4, model=ModelGeometry(num_layers=2, kv_heads=1,
                                                        head_dim=64, dtype="fp16"),
                      tiers={"G1": TierConfig(blocks=4), "G2": TierConfig(blocks=8)})
    name = f"{owner_tag()}-kind"
    reading = StorageOptions(shared_host=SharedHost(str(shm), name, writer=False))
    assert not kind_of("G2").followed_exists(config, "G2", reading)
    with pytest.raises(TierSetupError, match="no shared host memory"):
        build_storages(config, reading)
    writing = StorageOptions(shared_host=SharedHost(str(shm), name, writer=True))
    written = build_storages(config, writing)
    assert kind_of("G2").followed_exists(config, "G2", reading)
    read = build_storages(config, reading)
    g2w, g2r = written.by_tier["G2"], read.by_tier["G2"]
    assert isinstance(g2w, PublishedHostStorage) and isinstance(g2r, FollowedHostStorage)
    assert g2w.file.path == g2r.file.path == shared_host_path(shm, "G2", name)
    fill_cfg = g2w.config
    g2w.begin_write([1])
    g2w.payload(1)[:] = 3
    g2w.seal([1], [42])
    assert g2r.check_readable([1], [42]) == []
    assert fill_cfg == g2r.config
    read.close()
    written.close()
    assert list(shm.iterdir()) == []
    # what a killed server left is removed by the next writer in that directory
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    left = shm / f"kvstrata-g2-{owner_tag(int(dead))}-x-r0"
    left.write_bytes(b"x")
    again = build_storages(config, writing)
    assert not left.exists()
    again.close()
    assert shared_host_problem("G2", str(shm)) is None
    assert "not a directory" in shared_host_problem("G2", str(shm / "none"))


def _meddled_load(writer, reader, g1, meddle, slots, seqs, *, summable=False):
    """A G2 -> G1 load out of ``reader`` through the host copy engine, with ``meddle()``
    (the writer at work) run between the reader's check and the copy; the result."""
    from kvstrata.physical import TransferEngine, TransferPlan
    from kvstrata.physical.engines import default_copy_engine

    inner = default_copy_engine()

    class Meddling:
        def __getattr__(self, name):
            return getattr(inner, name)

        def summable(self, a, b):                # the GPU kernel's path (_onboard_summed)
            return summable

        def copy_checked(self, src, src_ids, dst, dst_ids, check, **kw):
            good = check(0, len(src_ids))
            meddle()
            inner.copy(src, [src_ids[p] for p in good], dst, [dst_ids[p] for p in good],
                       direction=kw.get("direction"))
            return good

    engine = TransferEngine({"G1": g1, "G2": reader}, copy_engine=Meddling())
    try:
        return engine.submit(TransferPlan.for_path("G2->G1", slots, list(range(4, 4 + len(
            slots))), seqs, job_id=0)).result()
    finally:
        engine.close()


@pytest.mark.parametrize("summable", [False, True])
def test_a_slot_rewritten_while_it_is_copied_out_is_reported_failed(shm, summable,
                                                                    monkeypatch):
    """The writer rewrites a slot between the reader's check and its copy (a scheduler that
    let a slot be reused during a load), even giving it back its block afterwards (same
    hash and checksum): the copy lands, but the transfer engine reports the block failed
    (the engine recomputes it), never loaded as the block it replaced."""
    from kvstrata.physical import DeviceStorage

    path = shm / "kvstrata-g2-race"
    writer = PublishedHostStorage(CFG, path)
    reader = FollowedHostStorage(CFG, path)
    strict(reader, monkeypatch)
    g1 = DeviceStorage.allocate(CFG, device="cpu")
    for slot in range(4):
        fill(writer, slot, 100 + slot)
    seqs = [100, 101, 102, 103]
    calm = _meddled_load(writer, reader, g1, lambda: None, [0, 1, 2, 3], seqs,
                         summable=summable)
    assert all(calm.ok)
    rewritten = _meddled_load(writer, reader, g1, lambda: fill(writer, 2, 999),
                              [0, 1, 2, 3], seqs, summable=summable)
    assert [p for p in range(4) if not rewritten.ok[p]] == [2]
    assert "rewritten" in rewritten.failures[0].detail
    fill(writer, 2, 102)

    def rewritten_and_given_back():
        fill(writer, 2, 999)
        fill(writer, 2, 102)

    restored = _meddled_load(writer, reader, g1, rewritten_and_given_back, [0, 1, 2, 3],
                             seqs, summable=summable)
    assert [p for p in range(4) if not restored.ok[p]] == [2]
    # one slot twice in a plan: a rewrite after the first check fails both copies
    twice = _meddled_load(writer, reader, g1, lambda: fill(writer, 1, 101), [1, 0, 1],
                          [101, 100, 101], summable=summable)
    assert list(twice.ok) == [False, True, False]
    again = _meddled_load(writer, reader, g1, lambda: None, [1, 0, 1], [101, 100, 101],
                          summable=summable)
    assert all(again.ok)
    assert not reader._verified.__dict__.get("seals")       # nothing left behind
    writer.close()
    reader.close()
    g1.close()


def test_nothing_is_stored_from_a_reader(shm, tmp_path):
    """The writer stores what the shared G2 holds; a store plan out of a reader fails
    whole, and nothing reaches the disk tier."""
    from kvstrata.physical import DeviceStorage, DiskStorage, TransferEngine, TransferPlan

    path = shm / "kvstrata-g2-store"
    writer = PublishedHostStorage(CFG, path)
    reader = FollowedHostStorage(CFG, path)
    fill(writer, 0, 100)
    g1 = DeviceStorage.allocate(CFG, device="cpu")
    disk = DiskStorage(CFG, tmp_path, o_direct=False)
    engine = TransferEngine({"G1": g1, "G2": reader, "G3": disk})
    result = engine.submit(TransferPlan.for_path("G2->G3", [0], [0], [100], job_id=0)).result()
    assert not any(result.ok) and "another process writes" in result.failures[0].detail
    assert disk.checksums.get(0) is None
    engine.close()
    for storage in (disk, g1, reader, writer):
        storage.close()


def _offloaded_through_the_kernel(shm, name, blocks, first_seq):
    """A writer and a reader of a shared G2, and the writer's first ``blocks`` slots filled
    from a random CPU G1 through the GPU copy kernel (Triton's interpreter), so their seals
    carry device checksums; returns writer, reader, that G1, an empty one, the hashes."""
    from kvstrata.physical import DeviceStorage, TransferEngine, TransferPlan

    path = shm / name
    writer = PublishedHostStorage(CFG, path, verify_reads=True)
    reader = FollowedHostStorage(CFG, path)
    g1w, g1r = (DeviceStorage.allocate(CFG, device="cpu") for _ in range(2))
    for region in g1w.memory.regions:
        region.copy_(torch.randint(0, 256, region.shape, dtype=torch.uint8))
    seqs = [first_seq + b for b in range(blocks)]
    with TransferEngine({"G1": g1w, "G2": writer}, copy_engine=_summing_engine()) as down:
        assert down.submit(TransferPlan.for_path("G1->G2", list(range(blocks)),
                                                 list(range(blocks)), seqs,
                                                 job_id=1)).result().all_ok
    return writer, reader, g1w, g1r, seqs


def _summing_engine():
    from kvstrata.physical import MemmoveCopyEngine
    from kvstrata.physical.device_copy import DeviceCopyEngine, device_kernels
    if device_kernels()[0] is None:
        pytest.skip(f"device kernel: {device_kernels()[1]}")
    return DeviceCopyEngine(interpret=True, fallback=MemmoveCopyEngine(), hash_threads=1)


def test_a_reader_loads_by_the_device_checksums_in_the_seals_without_hashing(shm,
                                                                             monkeypatch):
    """The writer's offload through the GPU copy kernel (Triton's interpreter here) seals
    its slots with device checksums; a reader's load compares the device checksum of the
    bytes that arrive with the seal's, hashes nothing on the host, and still fails a changed
    byte, a slot rewritten during the copy (even given its block back), and leaves nothing
    remembered."""
    from kvstrata.physical import TransferEngine, TransferPlan

    writer, reader, g1w, g1r, seqs = _offloaded_through_the_kernel(shm, "kvstrata-g2-summed",
                                                                   6, 300)
    strict(reader, monkeypatch)
    seals = writer.file.snapshot(np.arange(6))
    assert seals.ok.all() and seals.device_known.all()

    def no_host_hashing(*args, **kwargs):
        raise AssertionError("a reader hashed slots on the host")

    monkeypatch.setattr(reader, "payload_checksums", no_host_hashing)
    engine = _summing_engine()
    meddle = {"now": lambda: None}
    real = engine.copy_summed

    def copy_summed(*args, **kwargs):
        meddle["now"]()
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "copy_summed", copy_summed)
    with TransferEngine({"G1": g1r, "G2": reader}, copy_engine=engine) as up:
        def load():
            return up.submit(TransferPlan.for_path("G2->G1", list(range(6)), list(range(6)),
                                                   seqs, job_id=2)).result()

        calm = load()
        assert calm.all_ok, calm.failures
        for b in range(6):
            assert torch.equal(block_bytes_of(g1w, b), block_bytes_of(g1r, b))
        writer.payload(1)[5] ^= 0x40                 # a byte changed after the seal
        assert [(f.position, f.kind) for f in load().failures] == [
            (1, FailureKind.CHECKSUM_MISMATCH)]
        writer.payload(1)[5] ^= 0x40

        def rewritten_and_given_back():
            payload = writer.payload(4).copy()
            writer.begin_write([4])
            writer.payload(4)[:] = payload
            writer.seal([4], [seqs[4]], defer=True,
                        device_sums=np.array([device_checksum(payload)], dtype=np.uint64))

        meddle["now"] = rewritten_and_given_back
        assert [(f.position, f.kind) for f in load().failures] == [(4, FailureKind.NOT_WRITTEN)]
        meddle["now"] = lambda: None
        assert load().all_ok
    assert not reader._verified.__dict__.get("seals")       # nothing left behind
    writer.close()
    reader.close()


def test_a_reader_whose_engine_cannot_sum_after_all_verifies_on_the_host(shm, monkeypatch):
    from kvstrata.physical import TransferEngine, TransferPlan

    writer, reader, g1w, g1r, seqs = _offloaded_through_the_kernel(
        shm, "kvstrata-g2-unsummed", 4, 400)
    strict(reader, monkeypatch)
    engine = _summing_engine()
    monkeypatch.setattr(engine, "copy_summed", lambda *a, **k: None)
    hashed = []
    real = reader.payload_checksums
    monkeypatch.setattr(reader, "payload_checksums",
                        lambda slots: hashed.extend(np.asarray(slots).tolist()) or real(slots))
    with TransferEngine({"G1": g1r, "G2": reader}, copy_engine=engine) as up:
        for _ in range(2):
            out = up.submit(TransferPlan.for_path("G2->G1", list(range(4)), list(range(4)),
                                                  seqs, job_id=2)).result()
            assert out.all_ok, out.failures
    assert sorted(hashed) == [0, 0, 1, 1, 2, 2, 3, 3]
    for b in range(4):
        assert torch.equal(block_bytes_of(g1w, b), block_bytes_of(g1r, b))
    assert not reader._verified.__dict__.get("seals")
    writer.close()
    reader.close()


def test_a_copy_that_raises_leaves_no_seal_remembered_for_the_next_plan(shm, monkeypatch):
    """A plan whose copy raises confirms nothing; the seals its check remembered are
    dropped with it, so a later read of those slots is held to its own check, not to a
    seal the writer has since replaced."""
    from kvstrata.physical import TransferEngine, TransferPlan

    writer, reader, g1w, g1r, seqs = _offloaded_through_the_kernel(shm, "kvstrata-g2-raise",
                                                                   2, 500)
    engine = _summing_engine()
    real = engine.copy_summed
    monkeypatch.setattr(engine, "copy_summed",
                        lambda *a, **k: (_ for _ in ()).throw(RuntimeError("planted")))
    with TransferEngine({"G1": g1r, "G2": reader}, copy_engine=engine) as up:
        def load():
            return up.submit(TransferPlan.for_path("G2->G1", [0, 1], [0, 1], seqs,
                                                   job_id=2)).result()

        assert not any(load().ok)                       # the planted failure
        with TransferEngine({"G1": g1w, "G2": writer},
                            copy_engine=_summing_engine()) as down:   # the writer moves on
            assert down.submit(TransferPlan.for_path("G1->G2", [0, 1], [0, 1], seqs,
                                                     job_id=3)).result().all_ok
        monkeypatch.setattr(engine, "copy_summed", real)
        assert load().all_ok                            # held to the new seals, not the old
    writer.close()
    reader.close()


def _memfd_mappings(name: str) -> int:
    with open("/proc/self/maps") as maps:
        return sum(f"memfd:kvstrata-{name}" in line for line in maps)


def test_a_second_writer_on_a_name_in_use_lets_go_of_its_memory_at_once(shm):
    """The start that fails (the name is another writer's) unmaps what it reserved at once,
    not when the caller lets go of the error (its traceback held the mapping)."""
    path = shm / "g2"
    writer = PublishedHostStorage(CFG, path)
    try:
        assert _memfd_mappings(path.name) == 1
        with pytest.raises(StorageConfigError) as failed:
            PublishedHostStorage(CFG, path)
        assert failed.value is not None                   # the error is still held here
        assert _memfd_mappings(path.name) == 1
    finally:
        writer.close()
