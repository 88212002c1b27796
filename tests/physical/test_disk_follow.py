"""A durable disk tier followed read-only by another reader (one copy that several ranks
read): what the writer journals becomes readable, what it overwrites or frees never is, a
compacted or restarted writer's journal is read again, and nothing is ever written."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kvstrata.physical import BlockIOError, DiskStorage, FailureKind, StorageConfigError
from kvstrata.physical.storage.disk_index import RECORD_BYTES
from kvstrata.physical.tags import BlockTagger

from .conftest import small_config
from .test_disk import _aligned_blocks
from .test_disk_durable import FP, OTHER_FP, _open, _read, _same, _write


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _follow(tmp_path, num_blocks=16, fingerprint=FP, **kw):
    return DiskStorage.follow(small_config(num_blocks=num_blocks), tmp_path,
                              fingerprint=fingerprint, **kw)


def _failed_positions(disk, slots, seqs):
    try:
        _read(disk, slots, seqs)
    except BlockIOError as exc:
        return sorted(f.position for f in exc.failures)
    return []


def test_what_the_writer_journals_is_read_by_the_follower(tmp_path):
    writer = _open(tmp_path)
    follower = _follow(tmp_path)
    assert follower.followed and not writer.followed
    blocks = _write(writer, [2, 3, 7], [11, 12, 13])
    assert _failed_positions(follower, [2], [11]) == [0]      # not refreshed yet
    assert follower.refresh()
    out = _read(follower, [2, 3, 7], [11, 12, 13])
    assert _same(blocks, out, writer.config.block_bytes)
    more = _write(writer, [4], [14], seed=5, parents=[13])
    follower.refresh()
    assert _same(more, _read(follower, [4], [14]), writer.config.block_bytes)
    follower.close()
    writer.close()


def test_an_overwritten_slot_is_never_served_as_the_block_it_held(tmp_path):
    writer = _open(tmp_path)
    _write(writer, [5], [50])
    follower = _follow(tmp_path)
    newer = _write(writer, [5], [51], seed=3, parents=[None])
    # stale view: slot 5 still "holds" block 50, whose checksum the new bytes fail
    try:
        _read(follower, [5], [50])
        pytest.fail("a block overwritten since the last refresh was served")
    except BlockIOError as exc:
        assert exc.failures[0].kind is FailureKind.CHECKSUM_MISMATCH
    follower.refresh()
    assert _failed_positions(follower, [5], [50]) == [0]
    assert _same(newer, _read(follower, [5], [51]), writer.config.block_bytes)
    assert os.path.exists(writer.index.path)       # the follower removed nothing
    follower.close()
    writer.close()


def test_freed_and_moved_blocks_follow_the_writers_replay(tmp_path):
    writer = _open(tmp_path)
    _write(writer, [1, 2], [10, 20])
    follower = _follow(tmp_path)
    writer.forget([1])
    moved = _write(writer, [6], [20], seed=4, parents=[None])   # block 20 moved to slot 6
    follower.refresh()
    journal = follower._journal
    assert journal.slot_of(10) is None and journal.slot_of(20) == 6
    assert sorted(e.slot for e in journal.entries()) == [6]
    assert _same(moved, _read(follower, [6], [20]), writer.config.block_bytes)
    assert _failed_positions(follower, [2], [20]) == [0]
    follower.close()
    writer.close()


def test_a_compacted_journal_and_a_restarted_writer_are_read_again(tmp_path):
    writer = _open(tmp_path, num_blocks=4)
    follower = _follow(tmp_path, num_blocks=4)
    for i in range(1100):                          # past the compaction threshold
        _write(writer, [i % 4], [i + 1], seed=i, parents=[None])
        if i % 250 == 0:
            follower.refresh()
    follower.refresh()
    assert sorted(follower._journal.slot_of(h) for h in range(1097, 1101)) == [0, 1, 2, 3]
    writer.close()
    again = _open(tmp_path, num_blocks=4)          # a restart rewrites the journal
    last = _write(again, [0], [5000], seed=9, parents=[None])
    follower.refresh()
    assert follower._journal.slot_of(1097) is None          # slot 0 holds 5000 now
    assert _same(last, _read(follower, [0], [5000]), again.config.block_bytes)
    follower.close()
    again.close()


def test_a_record_cut_short_is_read_once_it_is_whole(tmp_path):
    writer = _open(tmp_path)
    blocks = _write(writer, [3], [33])
    index_path = writer.index.path
    writer.close()
    whole = index_path.read_bytes()
    index_path.write_bytes(whole[:-RECORD_BYTES // 2])      # the PUT still being written
    follower = _follow(tmp_path)
    assert follower._journal.slot_of(33) is None
    with open(index_path, "ab") as fh:
        fh.write(whole[-RECORD_BYTES // 2:])
    follower.refresh()
    assert follower._journal.slot_of(33) == 3
    assert _same(blocks, _read(follower, [3], [33]), follower.config.block_bytes)
    follower.close()


def test_nothing_is_written_and_writes_are_refused(tmp_path):
    writer = _open(tmp_path)
    _write(writer, [0], [1])
    slab, index = writer.path, writer.index.path
    before = (slab.read_bytes(), index.read_bytes())
    follower = _follow(tmp_path)
    _, blocks = _aligned_blocks(follower, 1)
    with pytest.raises(StorageConfigError, match="read-only"):
        follower.write_blocks([0], blocks, [2])
    with pytest.raises(StorageConfigError, match="read-only"):
        follower._journal.free([0])
    follower.forget([0])                             # forgets here only
    assert _failed_positions(follower, [0], [1]) == [0]
    follower.close()
    assert (slab.read_bytes(), index.read_bytes()) == before
    assert slab.exists() and index.exists()
    writer.close()


def test_no_tier_yet_another_fingerprint_and_another_key_are_refused_or_empty(tmp_path):
    with pytest.raises(StorageConfigError, match="cannot open the slab"):
        _follow(tmp_path)
    writer = _open(tmp_path, fingerprint=OTHER_FP)
    _write(writer, [0], [1])
    with pytest.raises(StorageConfigError):
        _follow(tmp_path)                          # no home of this fingerprint
    writer.close()
    keyed = _open(tmp_path, tagger=BlockTagger(b"k" * 32))
    _write(keyed, [0], [1])
    with pytest.raises(StorageConfigError, match="secret"):
        _follow(tmp_path)                          # kept under a key this reader lacks
    keyed.close()


def test_blocks_of_another_key_are_refused(tmp_path):
    keyed = _open(tmp_path, tagger=BlockTagger(b"k" * 32))
    blocks = _write(keyed, [0], [1])
    same_key = _follow(tmp_path, tagger=BlockTagger(b"k" * 32))
    assert _same(blocks, _read(same_key, [0], [1]), keyed.config.block_bytes)
    same_key.close()
    with pytest.raises(StorageConfigError, match="secret"):
        _follow(tmp_path, tagger=BlockTagger(b"x" * 32))
    keyed.close()


def test_a_writer_in_another_process_is_followed_while_it_writes(tmp_path):
    """The writer is a separate process writing and overwriting slots as fast as it can;
    every block the follower reads is the one the writer wrote under that name."""
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {ROOT!r})
        from tests.physical.test_disk_durable import _open, _write
        import pathlib
        disk = _open(pathlib.Path({str(tmp_path)!r}), num_blocks=8)
        print("ready", flush=True)
        for i in range(3000):
            _write(disk, [i % 8], [i + 1], seed=i, parents=[None])
        disk.close()
        print("done", flush=True)
    """)
    writer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "ready"
        follower = _follow(tmp_path, num_blocks=8)
        served = 0
        while writer.poll() is None or served == 0:
            follower.refresh()
            journal = follower._journal
            pairs = [(e.slot, e.sequence_hash) for e in journal.entries()]
            for slot, seq in pairs:
                try:
                    got = _read(follower, [slot], [seq])[0]
                except BlockIOError:
                    continue                        # overwritten meanwhile: a miss
                _, expected = _aligned_blocks(follower, 1, seed=seq - 1)
                assert np.array_equal(got[:follower.config.block_bytes],
                                      expected[0][:follower.config.block_bytes])
                served += 1
            if writer.poll() is not None and served:
                break
        assert served > 0
        follower.close()
    finally:
        writer.kill()
        writer.wait()
