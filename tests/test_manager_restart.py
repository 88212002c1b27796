"""KvBlockManager over a durable G3: what one manager stored, the next one in the same
directory finds, serves with the right bytes, and announces; one manager per directory."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest

from kvstrata.config import KvConfig, ModelGeometry, TierConfig
from kvstrata.logical.registry import RegistryObserver
from kvstrata.manager import KvBlockManager, ManagerConfigError

from test_manager import (BS, HANG_GUARD, assert_g1_bytes, chain, g3_journal_full, hashes_of,
                          make_config, payloads, put)


class Recorder(RegistryObserver):
    def __init__(self) -> None:
        self.stored: dict[str, list] = {}

    def on_tier_stored(self, tier, records) -> None:
        self.stored.setdefault(tier, []).extend(records)


def _store(tmp_path, records, config=None, **kw):
    config = config or make_config(g1=8, g2=4, g3=32)
    with KvBlockManager(config, disk_dir=str(tmp_path), **kw) as mgr:
        data = payloads(mgr, records)
        for start in range(0, len(records), 4):
            put(mgr, records[start:start + 4], data)
            mgr.wait_idle(HANG_GUARD)            # every block reaches G3 before G1 evicts it
        held = mgr.locate(hashes_of(records)).result(HANG_GUARD)
    return data, held


def test_a_restarted_manager_serves_what_the_last_one_stored(tmp_path):
    records = chain(12)
    data, held = _store(tmp_path, records)
    assert len(held) == 12                        # G1 and G2 go with the process

    recorder = Recorder()
    with KvBlockManager(make_config(g1=8, g2=4, g3=32), disk_dir=str(tmp_path),
                        observers=[recorder]) as mgr:
        assert mgr.locate(hashes_of(records)).result(HANG_GUARD) == ["G3"] * 12
        stored = {r.sequence_hash: r for r in recorder.stored["G3"]}
        assert set(stored) == set(hashes_of(records))
        for r in records:                         # identity survives: events keep the chain
            assert (stored[r.sequence_hash].parent_hash, stored[r.sequence_hash].local_hash) \
                == (r.parent_hash, r.local_hash)
        with mgr.onboard(hashes_of(records[:8])).result(HANG_GUARD) as loaded:
            assert loaded.sources == ("G3",) * 8 and not loaded.failures
            assert_g1_bytes(mgr, loaded, data)


def test_a_second_manager_on_the_same_directory_is_refused(tmp_path):
    with KvBlockManager(make_config(), disk_dir=str(tmp_path)):
        with pytest.raises(ManagerConfigError, match="in use by another process"):
            KvBlockManager(make_config(), disk_dir=str(tmp_path))


def test_another_model_id_never_sees_the_blocks(tmp_path):
    records = chain(4)
    _store(tmp_path, records)
    other = dataclasses.replace(make_config(g1=8, g2=4, g3=32), model_id="another/model")
    with KvBlockManager(other, disk_dir=str(tmp_path)) as mgr:
        assert mgr.locate(hashes_of(records)).result(HANG_GUARD) == []


def test_not_durable_when_asked(tmp_path):
    records = chain(4)
    _store(tmp_path, records, durable_disk=False)
    with KvBlockManager(make_config(g1=8, g2=4, g3=32), disk_dir=str(tmp_path)) as mgr:
        assert mgr.locate(hashes_of(records)).result(HANG_GUARD) == []
    assert not [p for p in tmp_path.rglob("*.slab")]   # the temporary slab went with it


def test_a_corrupt_recovered_block_is_dropped_and_reported_never_served(tmp_path):
    records = chain(4)
    data, _ = _store(tmp_path, records)
    slab = next(tmp_path.glob("kvstrata-g3-r0-*/slab"))
    raw = bytearray(slab.read_bytes())
    with KvBlockManager(make_config(g1=8, g2=4, g3=32), disk_dir=str(tmp_path)) as mgr:
        slot = mgr.pools["G3"].lookup(records[2].sequence_hash).block_id
        stride = mgr.storage("G3").layout.block_stride
    raw[slot * stride + 5] ^= 0x01
    slab.write_bytes(bytes(raw))
    with KvBlockManager(make_config(g1=8, g2=4, g3=32), disk_dir=str(tmp_path)) as mgr:
        with mgr.onboard(hashes_of(records)).result(HANG_GUARD) as loaded:
            assert len(loaded) == 2 and [f.kind for f in loaded.failures] == ["checksum_mismatch"]
            assert_g1_bytes(mgr, loaded, data)
        assert mgr.locate(hashes_of(records)).result(HANG_GUARD) == ["G1", "G1"]
    assert np.any(raw)


def test_recovered_blocks_are_in_the_publishers_snapshot_for_late_subscribers(tmp_path):
    from kvstrata.events import make_publisher
    from kvstrata.events.indexer import PrefixIndex

    records = chain(6, start=900)
    _store(tmp_path, records)
    publisher = make_publisher("none", worker_id=7)
    try:
        with KvBlockManager(make_config(g1=8, g2=4, g3=32), disk_dir=str(tmp_path),
                            observers=[publisher]):
            publisher.flush()
            snapshot = publisher.snapshot()          # what a subscriber joining now gets
        index = PrefixIndex().apply_events(7, snapshot.events)
        assert index.match(hashes_of(records)) == {7: {"G3": 6}}
    finally:
        publisher.close()


_EXIT_WITHOUT_CLOSE = """
import sys, time
sys.path.insert(0, sys.argv[2])
from kvstrata.config import KvConfig, ModelGeometry, TierConfig
from kvstrata.manager import KvBlockManager
from kvstrata.physical import FileOps
from test_manager import BS, chain, payloads, put


class SlowDisk(FileOps):          # writes still pending when the interpreter exits
    def pwritev(self, fd, buffers, offset):
        time.sleep(0.02)
        return super().pwritev(fd, buffers, offset)


# blocks of 128 KiB: a batch of 16 is big enough for the disk tier to hash on its helper
# thread while it writes (the pool the interpreter's exit shuts down)
# G1 holds every block: its slots are never all held by copies a loaded machine has not
# finished, so no allocation fails
config = KvConfig(block_size=BS, admission="always",
                  tiers={"G1": TierConfig(blocks=128), "G2": TierConfig(blocks=64),
                         "G3": TierConfig(blocks=256)},
                  model=ModelGeometry(num_layers=4, kv_heads=8, head_dim=64, dtype="fp16"))
mgr = KvBlockManager(config, disk_dir=sys.argv[1], file_ops=SlowDisk())
records = chain(96)
data = payloads(mgr, records)
for start in range(0, len(records), 16):
    put(mgr, records[start:start + 16], data)
print(mgr.status()["transfers_pending"], flush=True)
"""


def test_a_manager_left_open_at_exit_lands_its_pending_writes(tmp_path):
    """An interpreter that exits with a manager open closes it as close() would: the G3
    writes still pending land (the interpreter's own exit shuts thread pools down first,
    which refused them)."""
    tests = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run([sys.executable, "-c", _EXIT_WITHOUT_CLOSE, str(tmp_path), tests],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) > 0, "nothing was pending at exit: the test proves nothing"
    config = KvConfig(block_size=BS, tiers={"G1": TierConfig(blocks=128), "G2": TierConfig(blocks=64),
                                            "G3": TierConfig(blocks=256)},
                      model=ModelGeometry(num_layers=4, kv_heads=8, head_dim=64, dtype="fp16"))
    with KvBlockManager(config, disk_dir=str(tmp_path)) as mgr:
        assert len(mgr.storage("G3").recovered) == 96


def test_a_clear_the_journal_cannot_record_fails_its_future(tmp_path):
    """clear() promises the blocks are gone for good (after a change of weights, say): one a
    full disk kept from the G3 journal said it had dropped them, and a restart served them."""
    records = chain(12)
    _store(tmp_path, records)
    with KvBlockManager(make_config(g1=8, g2=4, g3=32), disk_dir=str(tmp_path)) as mgr:
        with g3_journal_full(), pytest.raises(OSError):
            mgr.clear().result(HANG_GUARD)
        assert mgr.locate(hashes_of(records)).result(HANG_GUARD) == []   # served no more


def test_blocks_evicted_from_a_durable_g3_stay_gone_after_a_restart(tmp_path):
    """evict() is an invalidation: a durable G3 journals it, as clear() does."""
    records = chain(8)
    _store(tmp_path, records)
    gone = hashes_of(records[4:])[::-1]                     # leaves first: a whole idle tail
    with KvBlockManager(make_config(g1=8, g2=4, g3=32), disk_dir=str(tmp_path)) as mgr:
        assert sorted(mgr.evict("G3", gone).result(HANG_GUARD)) == sorted(gone)
    with KvBlockManager(make_config(g1=8, g2=4, g3=32), disk_dir=str(tmp_path)) as mgr:
        assert mgr.locate(hashes_of(records)).result(HANG_GUARD) == ["G3"] * 4
        with g3_journal_full(), pytest.raises(OSError):
            mgr.evict("G3", hashes_of(records[:4])[::-1]).result(HANG_GUARD)
        assert mgr.locate(hashes_of(records)).result(HANG_GUARD) == []   # served no more
