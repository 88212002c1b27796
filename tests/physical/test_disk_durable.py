"""Durable disk tier: a slab and its index journal that survive the process, a lock that keeps
the directory to one process, recovery that drops what it cannot trust."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest

from kvstrata.physical import ChecksumMismatchError, DiskStorage, FailureKind
from kvstrata.physical.storage.disk_home import DiskTierBusyError, home_name
from kvstrata.physical.storage.disk_index import RECORD_BYTES

from .conftest import small_config
from .test_disk import _aligned_blocks

FP = "0123456789abcdef"
OTHER_FP = "fedcba9876543210"


def _open(tmp_path, num_blocks=16, fingerprint=FP, rank=0, **kw):
    return DiskStorage.durable(small_config(num_blocks=num_blocks), tmp_path,
                               fingerprint=fingerprint, rank=rank, **kw)


def _write(disk, slots, seqs, seed=0, parents=None):
    _, blocks = _aligned_blocks(disk, len(slots), seed=seed)
    parents = parents if parents is not None else [None] + list(seqs[:-1])
    disk.write_blocks(slots, blocks, seqs, parent_hashes=parents,
                      local_hashes=[s + 1000 for s in seqs])
    return blocks


def _read(disk, slots, seqs):
    _, out = _aligned_blocks(disk, len(slots), seed=99)
    disk.read_blocks(slots, out, seqs)
    return out


def _same(a, b, nbytes):
    return all(np.array_equal(x[:nbytes], y[:nbytes]) for x, y in zip(a, b))


def test_blocks_survive_close_and_reopen(tmp_path):
    disk = _open(tmp_path)
    home = disk.path.parent
    assert home.name == home_name("g3", 0, FP)
    blocks = _write(disk, [2, 3, 7], [11, 12, 13])
    disk.close()
    assert (home / "slab").exists() and (home / "index").exists()

    again = _open(tmp_path)
    got = {e.slot: e for e in again.recovered}
    assert sorted(got) == [2, 3, 7]
    assert got[2].parent_hash is None and got[3].parent_hash == 11 and got[7].local_hash == 1013
    out = _read(again, [2, 3, 7], [11, 12, 13])
    assert _same(blocks, out, again.config.block_bytes)
    assert "recovered 3 blocks" in again.status().notes[-1]
    again.close()


def test_overwritten_slot_recovers_the_new_block_only(tmp_path):
    disk = _open(tmp_path)
    _write(disk, [1, 2], [21, 22])
    new = _write(disk, [2], [33], seed=5, parents=[21])
    disk.close()
    again = _open(tmp_path)
    assert {(e.slot, e.sequence_hash) for e in again.recovered} == {(1, 21), (2, 33)}
    assert _same(new, _read(again, [2], [33]), again.config.block_bytes)
    again.close()


def test_a_block_moved_to_another_slot_is_recovered_once(tmp_path):
    disk = _open(tmp_path)
    _write(disk, [1], [5])
    _write(disk, [4], [5], seed=3)             # evicted from slot 1, stored again in slot 4
    disk.close()
    again = _open(tmp_path)
    assert [(e.slot, e.sequence_hash) for e in again.recovered] == [(4, 5)]
    assert again.index.report.duplicates == 1
    again.close()


def test_second_process_is_refused_while_the_first_holds_the_directory(tmp_path):
    disk = _open(tmp_path)
    with pytest.raises(DiskTierBusyError, match=f"pid {os.getpid()}"):
        _open(tmp_path)
    other_rank = _open(tmp_path, rank=1)        # another rank has its own home
    other_rank.close()
    disk.close()
    _open(tmp_path).close()                     # free again once closed


def test_changed_fingerprint_starts_fresh_and_removes_the_old_home(tmp_path, caplog):
    disk = _open(tmp_path)
    _write(disk, [0], [1])
    disk.close()
    keep = _open(tmp_path, rank=1)              # other ranks are never touched
    keep.close()
    with caplog.at_level(logging.WARNING):
        fresh = _open(tmp_path, fingerprint=OTHER_FP)
    assert len(fresh.recovered) == 0
    assert not (tmp_path / home_name("g3", 0, FP)).exists()
    assert (tmp_path / home_name("g3", 1, FP)).exists()
    lines = [r.getMessage() for r in caplog.records if "starting fresh" in r.getMessage()]
    assert len(lines) == 1 and home_name("g3", 0, FP) in lines[0]
    fresh.close()


def test_torn_and_corrupt_records_are_dropped(tmp_path):
    disk = _open(tmp_path)
    blocks = _write(disk, [0, 1, 2], [1, 2, 3])
    index_path = disk.index.path
    disk.close()
    data = bytearray(index_path.read_bytes())
    header = len(data) - 3 * RECORD_BYTES
    data[header + RECORD_BYTES + 9] ^= 0xFF          # damage the record of slot 1
    data += b"\x01\x00\x00"                           # a torn record at the end
    index_path.write_bytes(bytes(data))
    again = _open(tmp_path)
    report = again.index.report
    assert (report.corrupt_records, report.torn_bytes) == (1, 3)
    assert sorted(e.slot for e in again.recovered) == [0, 2]
    assert _same([blocks[0], blocks[2]], _read(again, [0, 2], [1, 3]), again.config.block_bytes)
    again.close()
    # the journal was rewritten compactly: nothing left to drop on the next start
    third = _open(tmp_path)
    assert (third.index.report.corrupt_records, third.index.report.torn_bytes) == (0, 0)
    third.close()


def test_damaged_header_starts_fresh(tmp_path):
    disk = _open(tmp_path)
    _write(disk, [0], [1])
    index_path = disk.index.path
    disk.close()
    index_path.write_bytes(b"garbage" * 20)
    again = _open(tmp_path)
    assert len(again.recovered) == 0 and "damaged" in again.index.report.fresh_reason
    again.close()


def test_corrupt_slab_bytes_fail_the_first_read_and_nothing_wrong_is_served(tmp_path):
    disk = _open(tmp_path)
    _write(disk, [0, 1], [1, 2])
    slab = disk.path
    stride = disk.layout.block_stride
    disk.close()
    with open(slab, "r+b") as fh:                # bit rot in block 1 while nobody ran
        fh.seek(stride + 10)
        byte = fh.read(1)
        fh.seek(stride + 10)
        fh.write(bytes([byte[0] ^ 0x40]))
    again = _open(tmp_path)
    assert len(again.recovered) == 2             # verification is lazy: found at the read
    _, out = _aligned_blocks(again, 2, seed=7)
    with pytest.raises(ChecksumMismatchError) as err:
        again.read_blocks([0, 1], out, [1, 2])
    assert [(f.position, f.kind) for f in err.value.failures] == \
        [(1, FailureKind.CHECKSUM_MISMATCH)]
    again.close()
    third = _open(tmp_path)                      # forgotten: not recovered a second time
    assert [e.slot for e in third.recovered] == [0]
    third.close()


def test_smaller_capacity_drops_entries_past_the_end_and_shrinks_the_slab(tmp_path):
    disk = _open(tmp_path, num_blocks=16)
    _write(disk, [1, 12], [1, 2])
    disk.close()
    small = _open(tmp_path, num_blocks=8)
    assert [e.slot for e in small.recovered] == [1]
    assert small.index.report.beyond_capacity == 1
    assert os.path.getsize(small.path) == 8 * small.layout.block_stride
    small.close()
    big = _open(tmp_path, num_blocks=32)         # grows again without losing slot 1
    assert [e.slot for e in big.recovered] == [1]
    assert os.path.getsize(big.path) == 32 * big.layout.block_stride
    big.close()


def test_writes_without_identity_are_served_but_not_recovered(tmp_path):
    disk = _open(tmp_path)
    _, blocks = _aligned_blocks(disk, 1)
    disk.write_blocks([3], blocks, [9])
    assert _same(blocks, _read(disk, [3], [9]), disk.config.block_bytes)
    disk.close()
    again = _open(tmp_path)
    assert len(again.recovered) == 0
    again.close()


def test_journal_is_compacted_as_it_grows(tmp_path):
    disk = _open(tmp_path, num_blocks=4)
    for i in range(600):                          # far more records than 4 x max(slots, 256)
        _write(disk, [i % 4], [i + 1], seed=i, parents=[None])
    size = os.path.getsize(disk.index.path)
    assert size < 64 + 4 * max(4, 256) * RECORD_BYTES * 2 + 64
    disk.close()
    again = _open(tmp_path, num_blocks=4)
    assert sorted(e.sequence_hash for e in again.recovered) == [597, 598, 599, 600]
    again.close()


def test_a_read_only_filesystem_is_a_typed_error_and_writes_fail_without_losing_blocks(tmp_path):
    """EROFS when the slab is opened: a typed error, the directory unlocked, no fd left;
    EROFS on writes later: the batch fails, the blocks already recovered stay served."""
    import errno

    from kvstrata.physical import FileOps, StorageConfigError, StorageIOError

    class ReadOnly(FileOps):
        def __init__(self, on_open: bool) -> None:
            self.on_open = on_open

        def open(self, path, flags, mode=0o644):
            if self.on_open:
                raise OSError(errno.EROFS, "Read-only file system")
            return super().open(path, flags, mode)

        def pwritev(self, fd, buffers, offset):
            raise OSError(errno.EROFS, "Read-only file system")

    disk = _open(tmp_path)
    blocks = _write(disk, [0, 1], [1, 2])
    disk.close()
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(StorageConfigError, match="Read-only"):
        _open(tmp_path, file_ops=ReadOnly(on_open=True))
    assert len(os.listdir("/proc/self/fd")) == before
    again = _open(tmp_path, file_ops=ReadOnly(on_open=False), o_direct=False)
    with pytest.raises(StorageIOError):
        _write(again, [5], [9])
    assert _same(blocks, _read(again, [0, 1], [1, 2]), again.config.block_bytes)
    again.close()
    last = _open(tmp_path)
    assert sorted(e.slot for e in last.recovered) == [0, 1]
    last.close()
