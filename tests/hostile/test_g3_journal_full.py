"""Hostile tests of the durable G3 index journal on a full disk: a journal write cut short
part-way through a record (ENOSPC after a short write), a cut that cannot be undone, a flush
that fails. The blocks whose records did not land fail with a typed error and are not
served; nothing stored before is lost; once space is back, what is written is journaled on a
record boundary, survives a restart and is seen by a follower. The fault is injected at the
``os`` calls, on the journal's file only, so it hits the journal however it is written."""

from __future__ import annotations

import errno
import os

import pytest

from kvstrata.physical import DiskStorage, FailureKind
from kvstrata.physical.errors import DiskFullError, StorageIOError
from kvstrata.physical.storage.disk_index import RECORD_BYTES, DiskIndex

from ._util import FP, home_of, layout, open_durable, read_ok, write

HEADER_BYTES = 64


class _FullDisk:
    """The filesystem under a tier's journal fills up once the journal has grown ``room``
    more bytes: the write that crosses it is cut short there (as the kernel does) and
    every later one raises ENOSPC, until ``room`` is None again (space back). ``during``
    runs when an error is raised, while what failed is still in the file;
    ``truncate_fails`` makes cutting the journal fail too; ``sync_fails`` makes the next
    flush of the journal fail."""

    def __init__(self, monkeypatch) -> None:
        self.room: int | None = None
        self.during = None
        self.truncate_fails = False
        self.sync_fails = False
        write, pwrite = os.write, os.pwrite
        ftruncate, fdatasync = os.ftruncate, os.fdatasync
        monkeypatch.setattr(os, "write", lambda fd, data: write(fd, self._allow(fd, data)))
        monkeypatch.setattr(os, "pwrite",
                            lambda fd, data, at: pwrite(fd, self._allow(fd, data), at))
        monkeypatch.setattr(os, "ftruncate", self._wrap(ftruncate, "truncate_fails"))
        monkeypatch.setattr(os, "fdatasync", self._wrap(fdatasync, "sync_fails", once=True))

    @staticmethod
    def _journal(fd: int) -> bool:
        try:
            return os.path.basename(os.readlink(f"/proc/self/fd/{fd}")) in ("index",
                                                                              "index.tmp")
        except OSError:
            return False

    def _allow(self, fd: int, data):
        if self.room is None or not self._journal(fd):
            return data
        if self.room <= 0:
            if self.during is not None:
                self.during()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        data = memoryview(data).cast("B")[:self.room]
        self.room -= len(data)
        return data

    def _wrap(self, call, flag: str, once: bool = False):
        def wrapped(fd, *args):
            if getattr(self, flag) and self._journal(fd):
                if once:
                    setattr(self, flag, False)
                if self.during is not None:
                    self.during()
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return call(fd, *args)
        return wrapped


def _seqs(base: int, slots) -> list[int]:
    return [base + s for s in slots]


def _served(disk: DiskStorage, slots, base: int) -> list[int]:
    """The slots that serve their block (exactly its bytes; wrong bytes fail the test)."""
    return [s for s in slots if read_ok(disk, s, base + s)]


def _on_a_record_boundary(home) -> bool:
    return (os.path.getsize(home / "index") - HEADER_BYTES) % RECORD_BYTES == 0


def _journaled(disk: DiskStorage, num_blocks: int) -> dict[int, int]:
    """Slot -> sequence hash of what a restart would recover now, read off the journal."""
    live = DiskIndex.peek(disk.path.parent / "index", capacity=num_blocks, fingerprint=FP,
                          stride=disk.layout.block_stride)
    return dict(zip(live.slots.tolist(), live.sequence_hashes.tolist()))


def _held(disk: DiskStorage) -> dict[int, int]:
    """Slot -> sequence hash of what the writer's own index holds."""
    live = disk.index.live()
    return dict(zip(live.slots.tolist(), live.sequence_hashes.tolist()))


def test_a_record_cut_short_then_space_back_loses_nothing_written_after(tmp_path,
                                                                        monkeypatch):
    full = _FullDisk(monkeypatch)
    disk = open_durable(tmp_path, 128)
    home = home_of(tmp_path)
    write(disk, range(0, 8), _seqs(0x1000, range(0, 8)))
    full.room = 10 * RECORD_BYTES + 40            # ten records land, the eleventh is cut
    with pytest.raises(DiskFullError) as caught:
        write(disk, range(8, 60), _seqs(0x1000, range(8, 60)))
    failures = caught.value.failures
    assert [f.block_id for f in failures] == list(range(18, 60))
    assert {f.kind for f in failures} == {FailureKind.DISK_FULL}
    assert caught.value.checksums[:10] == tuple(disk.checksums.checksums_of(range(8, 18)))
    assert set(caught.value.checksums[10:]) == {None}
    assert _on_a_record_boundary(home)
    assert _served(disk, range(8, 60), 0x1000) == list(range(8, 18))
    assert _held(disk) == _journaled(disk, 128)

    full.room = None                                # space comes back
    write(disk, range(80, 96), _seqs(0x1000, range(80, 96)))
    assert _on_a_record_boundary(home)
    held = _held(disk)
    assert sorted(held) == list(range(0, 18)) + list(range(80, 96))
    disk.close()

    again = open_durable(tmp_path, 128)
    try:
        report = again.index.report
        assert (report.corrupt_records, report.torn_bytes) == (0, 0)
        recovered = dict(zip(again.recovered.slots.tolist(),
                             again.recovered.sequence_hashes.tolist()))
        assert recovered == held
        assert _served(again, held, 0x1000) == sorted(held)
    finally:
        again.close()


def test_a_follower_sees_what_is_written_once_space_is_back(tmp_path, monkeypatch):
    full = _FullDisk(monkeypatch)
    writer = open_durable(tmp_path, 128)
    write(writer, range(0, 8), _seqs(0x1000, range(0, 8)))
    follower = DiskStorage.follow(layout(128), tmp_path, fingerprint=FP, rank=0)
    try:
        full.room = 3 * RECORD_BYTES + 50
        full.during = follower.refresh           # it reads while the cut record is there
        with pytest.raises(DiskFullError):
            write(writer, range(8, 60), _seqs(0x1000, range(8, 60)))
        full.room = full.during = None
        follower.refresh()
        write(writer, range(80, 96), _seqs(0x1000, range(80, 96)))
        follower.refresh()
        found = [s for s in range(128) if follower.slot_of(0x1000 + s) == s]
        assert found == list(range(0, 11)) + list(range(80, 96))
        assert _served(follower, range(128), 0x1000) == found
    finally:
        follower.close()
        writer.close()


def test_a_slot_whose_release_did_not_land_keeps_its_block_until_it_is_released(
        tmp_path, monkeypatch):
    """Overwriting blocks on a full disk: the slots whose FREE record did not land are not
    written (their blocks stay, durable); those are released in the journal before the
    next write changes their bytes, so a restart never names bytes that changed."""
    full = _FullDisk(monkeypatch)
    disk = open_durable(tmp_path, 16)
    write(disk, range(8), _seqs(0x1000, range(8)))
    full.room = 3 * RECORD_BYTES + 20             # FREE of slots 0-2 lands, slot 3's is cut
    with pytest.raises(DiskFullError) as caught:
        write(disk, range(8), _seqs(0x2000, range(8)))
    assert [(f.block_id, f.kind) for f in caught.value.failures] == \
        [(s, FailureKind.DISK_FULL) for s in range(8)]
    assert _served(disk, range(8), 0x1000) == _served(disk, range(8), 0x2000) == []
    assert _journaled(disk, 16) == _held(disk) == {s: 0x1000 + s for s in range(3, 8)}

    full.room = 5 * RECORD_BYTES                  # the FREEs land; the PUTs do not
    with pytest.raises(DiskFullError):
        write(disk, range(3, 8), _seqs(0x3000, range(3, 8)))
    assert _journaled(disk, 16) == _held(disk) == {}

    full.room = None
    write(disk, range(8), _seqs(0x4000, range(8)))
    disk.close()
    again = open_durable(tmp_path, 16)
    try:
        assert sorted(again.recovered.slots.tolist()) == list(range(8))
        assert _served(again, range(8), 0x4000) == list(range(8))
    finally:
        again.close()


def test_blocks_stored_before_a_failed_overwrite_survive_a_restart(tmp_path, monkeypatch):
    full = _FullDisk(monkeypatch)
    disk = open_durable(tmp_path, 16)
    write(disk, range(8), _seqs(0x1000, range(8)))
    full.room = 3 * RECORD_BYTES + 20
    with pytest.raises(DiskFullError):
        write(disk, range(8), _seqs(0x2000, range(8)))
    full.room = None
    disk.close()
    again = open_durable(tmp_path, 16)
    try:
        assert _served(again, range(8), 0x1000) == list(range(3, 8))
        assert _served(again, range(8), 0x2000) == []
    finally:
        again.close()


def test_a_cut_that_fails_too_stops_the_journal_until_it_is_rewritten(tmp_path, monkeypatch):
    full = _FullDisk(monkeypatch)
    disk = open_durable(tmp_path, 64)
    home = home_of(tmp_path)
    write(disk, range(0, 4), _seqs(0x1000, range(0, 4)))
    full.room, full.truncate_fails = 2 * RECORD_BYTES + 30, True
    with pytest.raises(DiskFullError) as caught:
        write(disk, range(4, 12), _seqs(0x1000, range(4, 12)))
    assert [f.block_id for f in caught.value.failures] == list(range(6, 12))
    assert not _on_a_record_boundary(home)        # the cut record is still there
    journal = (home / "index").read_bytes()
    with pytest.raises(DiskFullError) as caught:  # still full: nothing is appended
        write(disk, range(12, 16), _seqs(0x1000, range(12, 16)))
    assert [f.block_id for f in caught.value.failures] == list(range(12, 16))
    assert (home / "index").read_bytes() == journal
    assert sorted(os.listdir(home)) == ["index", "lock", "slab"]
    assert _served(disk, range(64), 0x1000) == list(range(0, 6))

    full.room, full.truncate_fails = None, False   # space back: rewritten, then appended
    write(disk, range(20, 30), _seqs(0x1000, range(20, 30)))
    assert _on_a_record_boundary(home)
    expected = list(range(0, 6)) + list(range(20, 30))
    follower = DiskStorage.follow(layout(64), tmp_path, fingerprint=FP, rank=0)
    try:
        assert [s for s in range(64) if follower.slot_of(0x1000 + s) == s] == expected
    finally:
        follower.close()
        disk.close()
    again = open_durable(tmp_path, 64)
    try:
        assert (again.index.report.corrupt_records, again.index.report.torn_bytes) == (0, 0)
        assert sorted(again.recovered.slots.tolist()) == expected
        assert _served(again, range(64), 0x1000) == expected
    finally:
        again.close()


def test_a_journal_flush_that_fails_records_none_of_its_batch(tmp_path, monkeypatch):
    """With ``sync``, a batch whose journal flush fails is not recorded, though its records
    were whole in the file for a moment: a follower that read them then drops them, and
    sees what is written next where they were."""
    full = _FullDisk(monkeypatch)
    disk = open_durable(tmp_path, 16, sync=True)
    write(disk, range(0, 4), _seqs(0x1000, range(0, 4)))
    follower = DiskStorage.follow(layout(16), tmp_path, fingerprint=FP, rank=0)
    try:
        full.sync_fails, full.during = True, follower.refresh
        with pytest.raises(StorageIOError) as caught:
            write(disk, range(4, 8), _seqs(0x1000, range(4, 8)))
        full.during = None
        assert {f.kind for f in caught.value.failures} == {FailureKind.IO_ERROR}
        assert [f.block_id for f in caught.value.failures] == list(range(4, 8))
        assert _served(disk, range(16), 0x1000) == list(range(4))
        assert _journaled(disk, 16) == _held(disk) == {s: 0x1000 + s for s in range(4)}
        write(disk, range(8, 12), _seqs(0x1000, range(8, 12)))
        expected = list(range(0, 4)) + list(range(8, 12))
        follower.refresh()
        assert [s for s in range(16) if follower.slot_of(0x1000 + s) == s] == expected
    finally:
        follower.close()
        disk.close()
    again = open_durable(tmp_path, 16)
    try:
        assert sorted(again.recovered.slots.tolist()) == expected
        assert _served(again, range(16), 0x1000) == expected
    finally:
        again.close()


def test_a_closed_index_writes_nothing_and_never_opens_its_journal_again(tmp_path):
    """A failed write on a closed index marked the journal to be rewritten, and the next
    write rewrote and reopened it, its directory lock already let go."""
    from kvstrata.physical.storage.disk_index import JournalWriteError

    index = DiskIndex.open(tmp_path / "index", capacity=4, fingerprint="fp", stride=4096)
    index.put([0], [11], [None], [11], [7])
    index.close()
    for _ in range(2):
        with pytest.raises(JournalWriteError):
            index.free([0])
    assert index._fd < 0
