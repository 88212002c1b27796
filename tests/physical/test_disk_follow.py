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


def _scribble(writer, slot, at, data: bytes) -> None:
    """Write ``data`` into ``slot`` of the writer's slab at byte ``at``, without journaling
    (bytes changing under a reader)."""
    with open(writer.path, "r+b") as fh:
        fh.seek(slot * writer.layout.block_stride + at)
        fh.write(data[:writer.config.block_bytes - at])


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
    assert follower.slot_of(11) is None                        # not refreshed yet
    out = _read(follower, [2, 3, 7], [11, 12, 13])             # a read refreshes first
    assert follower.slot_of(11) == 2
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
    _read(follower, [5], [50])
    # bytes that change under the follower's view (a write whose journal record it has not
    # read yet) fail the checksum of the block the view names
    _scribble(writer, 5, 0, _aligned_blocks(writer, 1, seed=77)[1][0].tobytes())
    try:
        _read(follower, [5], [50])
        pytest.fail("bytes that changed under the follower were served")
    except BlockIOError as exc:
        assert exc.failures[0].kind is FailureKind.CHECKSUM_MISMATCH
    newer = _write(writer, [5], [51], seed=3, parents=[None])
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


def _views_agree(writer, follower) -> None:
    follower.refresh()
    assert {e.slot: e.sequence_hash for e in follower._journal.entries()} == \
        {e.slot: e.sequence_hash for e in writer.index.entries()}


def test_two_compactions_between_refreshes_are_seen_even_if_an_inode_comes_back(tmp_path):
    """The writer rewrites its journal twice while the follower looks away; a filesystem may
    give the second rewrite the first file's inode. The follower keeps the file it read open,
    so that inode cannot come back: it sees a new file and reads it whole."""
    writer = _open(tmp_path, num_blocks=16)
    _write(writer, list(range(16)), list(range(100, 116)))
    follower = _follow(tmp_path, num_blocks=16)
    inodes = [os.stat(writer.index.path).st_ino]
    i = 0
    while len(inodes) < 3:
        i += 1
        _write(writer, [0, 1, 2, 3], [1000 + 4 * i + k for k in range(4)], seed=i,
               parents=[None] * 4)
        inode = os.stat(writer.index.path).st_ino
        if inode != inodes[-1]:
            inodes.append(inode)
            if len(inodes) == 2:
                _write(writer, [10], [5000], seed=5, parents=[None])
    _views_agree(writer, follower)
    assert follower.slot_of(5000) == 10 and follower.slot_of(110) is None
    follower.close()
    writer.close()


def test_a_long_journal_is_read_in_bounded_chunks_with_the_same_result(tmp_path, monkeypatch):
    from kvstrata.physical.storage import disk_follow
    from kvstrata.physical.storage.disk_index import DiskIndex
    monkeypatch.setattr(disk_follow, "_READ_CHUNK", 5 * RECORD_BYTES + 7)
    writer = _open(tmp_path, num_blocks=64)
    follower = _follow(tmp_path, num_blocks=64)
    rng = np.random.default_rng(3)
    for i in range(300):            # puts, frees and moves (a block put again elsewhere)
        slot = int(rng.integers(0, 64))
        if rng.random() < 0.2:
            writer.forget([slot])
        else:
            _write(writer, [slot], [int(rng.integers(1, 90))], seed=i, parents=[None])
        if i % 37 == 0:
            follower.refresh()
    fresh = _follow(tmp_path, num_blocks=64)          # the whole journal, 5 records a time
    replayed = DiskIndex.peek(writer.index.path, capacity=64, fingerprint=FP,
                              stride=writer.layout.block_stride)
    writer_would_recover = set(zip(replayed.slots.tolist(),
                                   replayed.sequence_hashes.tolist()))
    for view in (follower, fresh):
        view.refresh()
        held = {(e.slot, e.sequence_hash) for e in view._journal.entries()}
        # never more than the writer's own replay; fewer only where a moved block's newer
        # slot was freed again
        assert held <= writer_would_recover
        assert len(held) >= len(writer_would_recover) - 8
        for slot, seq in held:
            _read(view, [slot], [seq])
            assert view.slot_of(seq) == slot
    fresh.close()
    follower.close()
    writer.close()


def test_a_refresh_while_a_block_is_read_never_passes_another_blocks_bytes(tmp_path):
    """The writer overwrites slot 5 and another thread refreshes while a read of slot 5 is
    between its identity check and its byte check: the refresh waits for the read, which
    fails its check instead of passing block 51's bytes as block 50."""
    import threading
    writer = _open(tmp_path)
    _write(writer, [5], [50], seed=1)
    follower = _follow(tmp_path)
    real = follower._pread_all
    threads = []

    def read_with_a_refresh_meanwhile(buffers, offset):
        _write(writer, [5], [51], seed=2, parents=[None])
        thread = threading.Thread(target=follower.refresh)
        thread.start()
        threads.append(thread)
        thread.join(0.3)
        assert thread.is_alive()                  # waits for this read
        return real(buffers, offset)

    follower._pread_all = read_with_a_refresh_meanwhile
    with pytest.raises(BlockIOError) as caught:
        _read(follower, [5], [50])
    assert caught.value.failures[0].kind is FailureKind.CHECKSUM_MISMATCH
    follower._pread_all = real
    threads[0].join(10)
    assert follower.slot_of(51) == 5
    follower.close()
    writer.close()


def test_a_block_that_fails_here_is_not_found_again_until_rewritten(tmp_path):
    writer = _open(tmp_path)
    _write(writer, [4], [40])
    follower = _follow(tmp_path)
    _scribble(writer, 4, 1, b"\xff\x00")
    assert _failed_positions(follower, [4], [40]) == [0]
    assert follower.slot_of(40) is None               # no longer counted as held here
    assert len(writer.index.entries()) == 1           # the writer's journal is untouched
    again = _write(writer, [4], [40], seed=6, parents=[None])
    assert follower.refresh() and follower.slot_of(40) == 4     # written again: back
    assert _same(again, _read(follower, [4], [40]), writer.config.block_bytes)
    follower.close()
    writer.close()


def test_encrypted_blocks_are_followed_and_opened_with_the_key(tmp_path):
    from kvstrata.physical.tags import BlockCipher
    key = b"s" * 32
    writer = _open(tmp_path, tagger=BlockTagger(key), cipher=BlockCipher(key), encrypt=True)
    blocks = _write(writer, [1, 2], [7, 8])
    raw = writer.path.read_bytes()[writer.layout.block_stride:
                                   writer.layout.block_stride + writer.config.block_bytes]
    assert raw != blocks[0][:writer.config.block_bytes].tobytes()      # stored encrypted
    follower = _follow(tmp_path, tagger=BlockTagger(key), cipher=BlockCipher(key))
    assert _same(blocks, _read(follower, [1, 2], [7, 8]), writer.config.block_bytes)
    assert _failed_positions(follower, [1], [8]) == [0]           # another block's name
    follower.close()
    writer.close()


def test_a_slab_not_sized_yet_is_still_read_with_o_direct_once_it_is(tmp_path):
    writer = _open(tmp_path)
    direct = writer.o_direct
    writer.close()
    os.truncate(writer.path, 0)                  # as the writer has just created it
    follower = _follow(tmp_path)
    assert follower.o_direct == direct
    follower.close()


def test_the_kind_says_when_a_writers_g3_can_be_followed(tmp_path):
    """``DiskKind.followed_exists``: only once the writer of that identity made its home with
    both slab and journal, for a durable G3."""
    from dataclasses import replace as with_

    from kvstrata.config import KvConfig, ModelGeometry, TierConfig
    from kvstrata.kinds import StorageOptions, build_storages, kind_of

    config = KvConfig(block_size=4, model=ModelGeometry(num_layers=1, kv_heads=1, head_dim=8,
                                                        dtype="fp16"),
                      tiers={"G1": TierConfig(blocks=4), "G2": TierConfig(blocks=4),
                             "G3": TierConfig(blocks=4)}, disk_dir=str(tmp_path))
    kind = kind_of("G3")
    options = StorageOptions(follow_durable=True)
    assert not kind.followed_exists(config, "G3", options)
    assert kind.followed_exists(config, "G3", StorageOptions())   # not followed: no wait
    built = build_storages(config, StorageOptions())
    home = built.by_tier["G3"].path.parent
    assert kind.followed_exists(config, "G3", options)
    assert not kind.followed_exists(config, "G3", with_(options, rank=1, world_size=2))
    assert not kind.followed_exists(config, "G3", with_(options, durable_disk=False))
    built.close()
    os.unlink(home / "index")                     # a slab whose journal is not made yet
    assert not kind.followed_exists(config, "G3", options)
