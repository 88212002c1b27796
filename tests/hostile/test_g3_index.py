"""Hostile tests of the durable G3 index journal: crafted records, foreign headers, damaged
slabs, unbounded journals, leftovers. Every recovered block must either serve exactly its
bytes or be refused with a typed error."""

from __future__ import annotations

import errno
import os
import time

import numpy as np
import logging

import pytest

from kvstrata.physical.errors import StorageConfigError

from kvstrata.physical.storage.disk_index import RECORD_BYTES, DiskIndex

from ._util import (FP, FREE, OTHER_FP, PUT, header, home_of, open_durable, read_ok, record,
                    write)

SEQS = [0x1111, 0x2222, 0x3333, 0x4444]


def _stored(tmp_path, n=16):
    disk = open_durable(tmp_path, n)
    sums = write(disk, [0, 1, 2, 3], SEQS)
    stride = disk.layout.block_stride
    disk.close()
    return home_of(tmp_path), sums, stride


def test_crafted_records_with_valid_xxh_never_serve_wrong_bytes(tmp_path):
    home, sums, stride = _stored(tmp_path)
    index = home / "index"
    crafted = b"".join([
        record(PUT, 0xFFFFFFFF, 0x9999, checksum=sums[0]),         # slot past any slab
        record(PUT, 1 << 20, 0x9998, checksum=sums[0]),             # huge slot
        record(0, 5, 0x9997, checksum=sums[0]),                     # op 0
        record(3, 6, 0x9996, checksum=sums[0]),                     # op 3
        record(255, 7, 0x9995, checksum=sums[0]),                   # op 255
        record(PUT, 8, SEQS[1], SEQS[0], checksum=sums[1]),         # dup of slot 1's block in
                                                                    # a slot of zeros (newest)
        record(PUT, 9, 0x7777, checksum=sums[2]),                   # claims block 2's checksum
                                                                    # over a slot of zeros
        record(PUT, 2, 0x5555, checksum=0xDEAD),                    # slot 2 re-named, wrong sum
        record(PUT, 10, 0x6666, 0x6666, flags=0xFE, pad=0xFFFF),    # nonsense flags / pad
        record(FREE, 3, 0),                                         # slot 3 freed
        record(PUT, 3, SEQS[3], SEQS[2], checksum=sums[3])[:-1] + b"\0",   # bad xxh: dropped
    ])
    index.write_bytes(index.read_bytes() + crafted + b"\x01\x02\x03")   # and a torn tail
    disk = open_durable(tmp_path)
    try:
        report = disk.index.report
        assert report.beyond_capacity == 2
        assert report.corrupt_records == 4      # ops 0/3/255 and the bad xxh
        assert report.torn_bytes == 3
        live = {e.slot: e.sequence_hash for e in disk.recovered}
        assert 0xFFFFFFFF not in live and (1 << 20) not in live
        assert 3 not in live                    # FREE is the last valid record of slot 3
        assert list(live.values()).count(SEQS[1]) == 1
        served = {slot: read_ok(disk, slot, seq) for slot, seq in live.items()}
        # only the untouched original survives; every crafted entry is refused, typed
        assert served == {0: True, 8: False, 9: False, 2: False, 10: False}
        for slot, seq in [(1, SEQS[1]), (3, SEQS[3]), (5, 0x9997)]:
            assert not read_ok(disk, slot, seq)
    finally:
        disk.close()
    # what was recovered (and compacted), minus what failed its checksum when read (freed
    # in the index then), is what the next open sees
    again = open_durable(tmp_path)
    try:
        assert {e.slot for e in again.recovered} <= set(live) and 0 in \
            {e.slot for e in again.recovered}
    finally:
        again.close()


@pytest.mark.parametrize("bad_header", [
    pytest.param(lambda: header(OTHER_FP), id="other-fingerprint"),
    pytest.param(lambda: header(FP, stride=8192), id="other-stride"),
    pytest.param(lambda: header(FP, version=1), id="other-version"),
    pytest.param(lambda: header(FP)[:-1] + b"\0", id="damaged"),
    pytest.param(lambda: header(FP)[:40], id="cut-short"),
    pytest.param(lambda: b"", id="empty"),
])
def test_a_foreign_or_damaged_index_recovers_nothing_and_is_replaced(tmp_path, bad_header):
    home, sums, _ = _stored(tmp_path)
    index = home / "index"
    body = index.read_bytes()[64:]
    index.write_bytes(bad_header() + body)
    disk = open_durable(tmp_path)
    try:
        assert len(disk.recovered) == 0 and disk.index.report.fresh_reason
        for slot, seq in enumerate(SEQS):
            assert not read_ok(disk, slot, seq)
    finally:
        disk.close()
    assert index.read_bytes()[:64] == header(FP, stride=4096)
    assert DiskIndex.peek(index, capacity=16, fingerprint=FP, stride=4096) is not None


def test_index_copied_from_another_rank_with_its_slab_is_never_read(tmp_path):
    """An operator copies rank 1's files into rank 0's home: another fingerprint in the
    header (the fingerprint covers the rank), so nothing is recovered."""
    r1 = open_durable(tmp_path, fingerprint=OTHER_FP, rank=1)
    write(r1, [0, 1], SEQS[:2])
    r1.close()
    r0 = open_durable(tmp_path, rank=0)
    r0.close()
    src, dst = home_of(tmp_path, OTHER_FP, 1), home_of(tmp_path, FP, 0)
    for name in ("slab", "index"):
        (dst / name).write_bytes((src / name).read_bytes())
    r0 = open_durable(tmp_path, rank=0)
    try:
        assert len(r0.recovered) == 0
        assert not read_ok(r0, 0, SEQS[0])
    finally:
        r0.close()


def test_slab_truncated_extended_or_replaced_never_serves_wrong_bytes(tmp_path):
    home, sums, stride = _stored(tmp_path)
    slab = home / "slab"
    os.truncate(slab, 2 * stride + 100)             # cut inside block 2
    disk = open_durable(tmp_path)
    try:
        assert os.path.getsize(slab) == 16 * stride
        assert [read_ok(disk, s, q) for s, q in enumerate(SEQS)] == [True, True, False, False]
    finally:
        disk.close()
    with open(slab, "ab") as fh:                    # garbage after the end
        fh.write(os.urandom(3 * stride + 7))
    disk = open_durable(tmp_path)
    try:
        assert os.path.getsize(slab) == 16 * stride
        assert read_ok(disk, 0, SEQS[0]) and read_ok(disk, 1, SEQS[1])
        assert len(disk.recovered) == 2             # the blocks cut off were forgotten
    finally:
        disk.close()
    _stored_again = _stored(tmp_path)               # four good blocks again
    home, sums, stride = _stored_again
    slab.unlink()
    slab.write_bytes(np.random.default_rng(3).integers(0, 256, 16 * stride,
                                                       dtype=np.uint8).tobytes())
    disk = open_durable(tmp_path)
    try:
        assert len(disk.recovered) == 4             # entries kept, bytes not trusted
        assert not any(read_ok(disk, s, q) for s, q in enumerate(SEQS))
    finally:
        disk.close()


def test_shrinking_then_growing_the_slab_forgets_the_cut_blocks(tmp_path):
    disk = open_durable(tmp_path, 16)
    seqs = [0xA000 + i for i in range(16)]
    write(disk, range(16), seqs)
    stride = disk.layout.block_stride
    disk.close()
    disk = open_durable(tmp_path, 8)
    try:
        assert sorted(e.slot for e in disk.recovered) == list(range(8))
        assert disk.index.report.beyond_capacity == 8
        assert os.path.getsize(disk.path) == 8 * stride
    finally:
        disk.close()
    disk = open_durable(tmp_path, 16)
    try:
        assert sorted(e.slot for e in disk.recovered) == list(range(8))
        assert all(read_ok(disk, s, seqs[s]) for s in range(8))
        assert not any(read_ok(disk, s, seqs[s]) for s in range(8, 16))
    finally:
        disk.close()


def test_a_huge_crafted_journal_opens_quickly_and_is_compacted(tmp_path):
    home, sums, _ = _stored(tmp_path)
    index = home / "index"
    n = 200_000
    body = b"".join(record(PUT, i % 16, 0x10_0000 + i, checksum=i) for i in range(n))
    index.write_bytes(index.read_bytes() + body)
    start = time.monotonic()
    disk = open_durable(tmp_path)
    took = time.monotonic() - start
    try:
        assert took < 10, f"recovering {n} records took {took:.1f}s"
        assert len(disk.recovered) == 16
        assert index.stat().st_size == 64 + 16 * RECORD_BYTES
        assert not any(read_ok(disk, e.slot, e.sequence_hash) for e in disk.recovered)
    finally:
        disk.close()


def test_the_journal_stays_bounded_under_churn(tmp_path):
    disk = open_durable(tmp_path, 8)
    index = disk.path.parent / "index"
    biggest = 0
    try:
        for i in range(700):
            slots = [(2 * i) % 8, (2 * i + 1) % 8]
            write(disk, slots, [0x50_0000 + 2 * i, 0x50_0000 + 2 * i + 1])
            biggest = max(biggest, index.stat().st_size)
        # compaction at 4 x max(capacity, 256) records, plus one batch of FREE + PUT
        assert biggest <= 64 + RECORD_BYTES * (4 * 256 + 4)
        last = [0x50_0000 + n for n in range(1392, 1400)]
        assert all(read_ok(disk, n % 8, q) for n, q in zip(range(1392, 1400), last))
    finally:
        disk.close()
    disk = open_durable(tmp_path, 8)
    try:
        assert sorted(e.sequence_hash for e in disk.recovered) == sorted(last)
    finally:
        disk.close()


def test_a_leftover_index_tmp_is_consumed_not_trusted(tmp_path):
    home, sums, _ = _stored(tmp_path)
    # what a compaction killed before its rename leaves: a temp journal naming other blocks
    (home / "index.tmp").write_bytes(header(FP) + record(PUT, 0, 0xBAD, checksum=sums[0]))
    disk = open_durable(tmp_path)
    try:
        assert {e.sequence_hash for e in disk.recovered} == set(SEQS)
        assert not read_ok(disk, 0, 0xBAD)
        assert all(read_ok(disk, s, q) for s, q in enumerate(SEQS))
    finally:
        disk.close()
    assert sorted(p.name for p in home.iterdir()) == ["index", "lock", "slab"]


def test_peek_is_read_only_even_while_the_owner_holds_the_home(tmp_path):
    home, sums, _ = _stored(tmp_path)
    index = home / "index"
    index.write_bytes(index.read_bytes() + record(PUT, 9, SEQS[0], checksum=sums[0]) + b"xx")
    before = (index.read_bytes(), index.stat().st_mtime_ns)
    rows = DiskIndex.peek(index, capacity=16, fingerprint=FP, stride=4096)
    assert (index.read_bytes(), index.stat().st_mtime_ns) == before
    assert sorted(rows.slots.tolist()) == [1, 2, 3, 9]
    disk = open_durable(tmp_path)             # the owner: recovers what peek said
    try:
        assert sorted(disk.recovered.slots.tolist()) == [1, 2, 3, 9]
        again = DiskIndex.peek(index, capacity=16, fingerprint=FP, stride=4096)
        assert sorted(again.slots.tolist()) == [1, 2, 3, 9]
    finally:
        disk.close()
    assert DiskIndex.peek(home, capacity=16, fingerprint=FP, stride=4096) is None   # a dir
    assert DiskIndex.peek(index, capacity=16, fingerprint=OTHER_FP, stride=4096) is None


class _FailingFsync:
    """Stands in for ``os`` inside disk_index: fsync fails with EIO while armed (a disk that
    errors during compaction); everything else is the real ``os``."""

    def __init__(self) -> None:
        self.armed = True

    def __getattr__(self, name):
        return getattr(os, name)

    def fsync(self, fd):
        if self.armed:
            raise OSError(errno.EIO, "injected EIO in fsync")
        return os.fsync(fd)


def test_compaction_io_errors_lose_nothing_and_leave_nothing(tmp_path, monkeypatch, caplog):
    from kvstrata.physical.storage import disk_index
    disk = open_durable(tmp_path, 8)
    write(disk, [0, 1], [11, 12])
    disk.close()
    fake = _FailingFsync()
    monkeypatch.setattr(disk_index, "os", fake)
    with pytest.raises(StorageConfigError):      # the open-time compaction fails, typed
        open_durable(tmp_path, 8)
    home = home_of(tmp_path)
    assert sorted(p.name for p in home.iterdir()) == ["index", "lock", "slab"]
    fake.armed = False
    disk = open_durable(tmp_path, 8)             # not locked by the failure, nothing lost
    assert {e.sequence_hash for e in disk.recovered} == {11, 12}
    fake.armed = True                            # now every runtime compaction fails
    with caplog.at_level(logging.WARNING):
        for i in range(600):                     # the writes land; compaction waits
            write(disk, [i % 8], [0x9000 + i])
    assert any("compacting" in r.getMessage() for r in caplog.records)
    assert not (home / "index.tmp").exists()
    fake.armed = False
    disk.close()
    disk = open_durable(tmp_path, 8)
    try:
        assert sorted(e.sequence_hash for e in disk.recovered) == \
            [0x9000 + i for i in range(592, 600)]
        assert all(read_ok(disk, e.slot, e.sequence_hash) for e in disk.recovered)
    finally:
        disk.close()


def _reference_recovery(records: list[tuple[int, int, int, bool]], capacity: int):
    """What recovery must keep, computed plainly: ``records`` as (op, slot, seq, sound) in
    journal order; the last sound record naming a slot inside the slab decides it, and of
    two live slots naming one block only the newer record's counts."""
    last: dict[int, tuple[int, int, int]] = {}
    for number, (op, slot, seq, sound) in enumerate(records):
        if sound and slot < capacity:
            last[slot] = (op, seq, number)
    newest: dict[int, tuple[int, int]] = {}
    for slot, (op, seq, number) in last.items():
        if op == PUT and (seq not in newest or newest[seq][1] < number):
            newest[seq] = (slot, number)
    return sorted((slot, seq) for seq, (slot, _) in newest.items())


@pytest.mark.parametrize("seed", range(6))
def test_recovery_read_in_chunks_keeps_exactly_what_the_journal_says(tmp_path, monkeypatch,
                                                                      seed):
    """The journal is replayed a chunk at a time; whatever the chunk size (records naming
    one slot in different chunks, a damaged record, a torn tail), what is recovered is what
    a plain reading of the whole journal gives."""
    rng = np.random.default_rng(seed)
    capacity = 12
    records, body = [], []
    for _ in range(int(rng.integers(1, 400))):
        op = PUT if rng.random() < 0.7 else FREE
        slot = int(rng.integers(0, capacity + 3))           # some past the slab's end
        seq = int(rng.integers(1, 40))                       # blocks that move between slots
        raw = bytearray(record(op, slot, seq, checksum=seq))
        sound = rng.random() >= 0.05
        if not sound:
            raw[20] ^= 0x40                                  # damaged: its own xxh3 fails
        records.append((op, slot, seq, sound))
        body.append(bytes(raw))
    journal = header(FP, stride=4096) + b"".join(body) + bytes(int(rng.integers(0, 5)) * 9)
    expected = _reference_recovery(records, capacity)
    import kvstrata.physical.storage.disk_index as disk_index
    for chunk in (1, 2, 7, 1 << 18):
        monkeypatch.setattr(disk_index, "REPLAY_CHUNK", chunk)
        path = tmp_path / f"index-{chunk}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, journal)
        os.close(fd)
        index = DiskIndex.open(path, capacity=capacity, fingerprint=FP, stride=4096)
        try:
            live = index.live()
            assert sorted(zip(live.slots.tolist(), live.sequence_hashes.tolist())) == expected
            assert index.report.records == len(records)
            assert index.report.corrupt_records == sum(not r[3] for r in records)
            assert index.report.torn_bytes == len(journal) - 64 - len(body) * RECORD_BYTES
        finally:
            index.close()


def test_a_long_journal_is_replayed_in_bounded_memory(tmp_path, monkeypatch):
    """Recovery holds a chunk of the journal at a time, not the whole file."""
    import tracemalloc

    import kvstrata.physical.storage.disk_index as disk_index
    monkeypatch.setattr(disk_index, "REPLAY_CHUNK", 256)
    path = tmp_path / "index"
    n = 40_000                                              # 3.5 MB of records
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, header(FP, stride=4096)
             + b"".join(record(PUT, i % 16, 1 + i, checksum=i) for i in range(n)))
    os.close(fd)
    tracemalloc.start()
    try:
        live = DiskIndex.peek(path, capacity=16, fingerprint=FP, stride=4096)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert sorted(live.sequence_hashes.tolist()) == list(range(n - 15, n + 1))
    assert peak < n * RECORD_BYTES // 4, f"peak {peak} bytes replaying {n * RECORD_BYTES}"
