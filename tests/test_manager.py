"""KvBlockManager: construction, byte round-trips through the tiers, status, shutdown."""

from __future__ import annotations

import contextlib
import glob
import os
import socket
import tempfile
import threading

import numpy as np
import pytest
import torch

from kvstrata.config import KvConfig, ModelGeometry, TierConfig
from kvstrata.logical.block import BlockHashError
from kvstrata.logical.registry import BlockRecord
from kvstrata.manager import owner as owner_module
from kvstrata.physical import FileOps
from kvstrata.manager import (InvalidBlockError, KvBlockManager, ManagerClosedError,
                              ManagerConfigError, ManagerError)
from kvstrata.tokens import hash_blocks

BS = 4


def make_config(g1=8, g2=8, g3=32, dtype="fp16", **kw) -> KvConfig:
    tiers = {"G1": TierConfig(blocks=g1)}
    if g2:
        tiers["G2"] = TierConfig(blocks=g2, admission=kw.pop("g2_admission", None))
    if g3:
        tiers["G3"] = TierConfig(blocks=g3, admission=kw.pop("g3_admission", None))
    return KvConfig(block_size=BS, tiers=tiers,
                    model=ModelGeometry(num_layers=2, kv_heads=2, head_dim=8, dtype=dtype), **kw)


def chain(n: int, start: int = 0) -> list[BlockRecord]:
    """``n`` chained block records of distinct tokens starting at ``start``."""
    tokens = list(range(start, start + n * BS))
    local, seqs = hash_blocks(tokens, BS)
    return [BlockRecord(s, l, p, BS) for s, l, p in zip(seqs, local, [None, *seqs[:-1]])]


def payloads(mgr: KvBlockManager, records, seed: int = 0) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    size = mgr.storage("G1").config.block_bytes
    return {r.sequence_hash: rng.integers(0, 256, size, dtype=np.uint8) for r in records}


HANG_GUARD = 30
"""Seconds a test waits on a future before calling it a hang (never a performance bound)."""


def put(mgr: KvBlockManager, records, data: dict[int, np.ndarray]) -> None:
    """What an engine does after computing KV: allocate, write, register, release."""
    blocks = mgr.allocate(len(records)).result(HANG_GUARD)
    mgr.write_g1(blocks.block_ids, [data[r.sequence_hash] for r in records])
    blocks.apply_token_blocks(records)
    mgr.release(mgr.register(blocks).result(HANG_GUARD)).result(HANG_GUARD)


def evict_g1(mgr: KvBlockManager) -> None:
    """Push every idle block out of G1 by allocating all of it."""
    mgr.wait_idle(10)
    mgr.release(mgr.allocate(mgr.pools["G1"].capacity).result()).result()


def hashes_of(records) -> list[int]:
    return [r.sequence_hash for r in records]


@contextlib.contextmanager
def g3_journal_full():
    """Inside the block, every write to the G3 index journals this process has open fails
    with ENOSPC, as on a full disk (unit-level fault injection)."""
    import errno

    full = {int(f) for f in os.listdir("/proc/self/fd")
            if os.path.basename(os.path.realpath(f"/proc/self/fd/{f}")) == "index"}
    assert full, "no G3 index journal is open"
    pwrite, write = os.pwrite, os.write

    def refuse(fd):
        if fd in full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    os.pwrite = lambda fd, data, at: refuse(fd) or pwrite(fd, data, at)
    os.write = lambda fd, data: refuse(fd) or write(fd, data)
    try:
        yield
    finally:
        os.pwrite, os.write = pwrite, write


def assert_g1_bytes(mgr, result, data) -> None:
    for got, h in zip(mgr.read_g1(result.block_ids), result.sequence_hashes):
        assert np.array_equal(got, data[h]), f"wrong bytes for block {h}"


def assert_baseline(mgr) -> None:
    mgr.wait_idle(10)
    for tier, info in mgr.status()["tiers"].items():
        assert info["pool"]["active"] == 0, f"{tier} still has active blocks: {info['pool']}"
    for pool in mgr.pools.values():
        pool.check_invariants()


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("g1_layout", ["outer_contiguous", "block_contiguous"])
def test_round_trip_g1_g2_g3_g1(tmp_path, dtype, g1_layout):
    with KvBlockManager(make_config(dtype=dtype), g1_layout=g1_layout, disk_dir=tmp_path) as mgr:
        records = chain(6)
        data = payloads(mgr, records, seed=len(dtype) + len(g1_layout))
        put(mgr, records, data)
        mgr.wait_idle(10)
        assert mgr.locate(hashes_of(records)).result() == ["G1"] * 6
        g2, g3 = mgr.storage("G2"), mgr.storage("G3")
        for r in records:   # the bytes landed in G2, unchanged
            slot = mgr.pools["G2"].lookup(r.sequence_hash).block_id
            assert np.array_equal(g2.payload(slot), data[r.sequence_hash])
            assert r.sequence_hash in mgr.pools["G3"]

        evict_g1(mgr)                                       # G2 -> G1
        assert mgr.locate(hashes_of(records)).result() == ["G2"] * 6
        with mgr.onboard(hashes_of(records)).result() as result:
            assert result.sources == ("G2",) * 6 and result.failed == []
            assert result.sequence_hashes == hashes_of(records)
            assert_g1_bytes(mgr, result, data)

        evict_g1(mgr)                                       # G3 -> G1 (straight)
        assert mgr.evict("G2", hashes_of(reversed(records))).result()
        assert mgr.locate(hashes_of(records)).result() == ["G3"] * 6
        with mgr.onboard(hashes_of(records)).result() as result:
            assert result.sources == ("G3",) * 6
            assert_g1_bytes(mgr, result, data)
        mgr.wait_idle(10)   # blocks onboarded from G3 are written through to G2 again
        for r in records:
            slot = mgr.pools["G2"].lookup(r.sequence_hash).block_id
            assert np.array_equal(g2.payload(slot), data[r.sequence_hash])
        assert g3.status().kind == "disk"
        assert_baseline(mgr)


def test_wraps_engine_kv_tensors_zero_copy(tmp_path):
    """G1 over caller-provided [2, num_blocks, block_size, heads, dim] tensors (vLLM style)."""
    cfg = make_config(g1=6)
    layers = [torch.zeros(2, 6, BS, 2, 8, dtype=torch.float16) for _ in range(2)]
    with KvBlockManager(cfg, kv_caches={f"layer{i}": t for i, t in enumerate(layers)},
                        disk_dir=tmp_path) as mgr:
        assert mgr.pools["G1"].capacity == 6
        records = chain(3)
        blocks = mgr.allocate(3).result()
        expected = {}
        for r, block_id in zip(records, blocks.block_ids):
            parts = []
            for layer in layers:        # the engine writes its own tensors
                kv = torch.randn(2, BS, 2, 8).to(torch.float16)
                layer[:, block_id] = kv
                parts.extend(kv[o].contiguous().view(torch.uint8).reshape(-1) for o in range(2))
            expected[r.sequence_hash] = torch.cat(parts).numpy()
        blocks.apply_token_blocks(records)
        mgr.release(mgr.register(blocks).result())
        evict_g1(mgr)
        for layer in layers:
            layer.zero_()
        with mgr.onboard(hashes_of(records)).result() as result:
            assert result.sources == ("G2",) * 3
            assert_g1_bytes(mgr, result, expected)
            kv0 = layers[0][:, result.block_ids[0]].contiguous().view(torch.uint8).reshape(-1)
            first = expected[records[0].sequence_hash]
            assert np.array_equal(kv0.numpy(), np.concatenate([first[:128], first[128:256]]))


def test_onboard_returns_longest_prefix_across_tiers(tmp_path):
    with KvBlockManager(make_config(), disk_dir=tmp_path) as mgr:
        records = chain(5)
        data = payloads(mgr, records)
        put(mgr, records[:4], {h: data[h] for h in hashes_of(records[:4])})
        evict_g1(mgr)
        with mgr.onboard(hashes_of(records)).result() as result:
            assert len(result) == 4 and result.requested == 5 and result.failed == []
            assert_g1_bytes(mgr, result, data)
        with mgr.onboard(hashes_of(chain(2, start=1000))).result() as result:
            assert len(result) == 0 and result.failed == []
        assert_baseline(mgr)


def test_register_deduplicates_and_copies_once(tmp_path):
    with KvBlockManager(make_config(), disk_dir=tmp_path) as mgr:
        records = chain(3)
        data = payloads(mgr, records)
        put(mgr, records, data)
        put(mgr, records, data)          # same hashes again: deduplicated in G1, no new copy
        mgr.wait_idle(10)
        stats = mgr.transfer_stats()
        assert stats["G1->G2"]["blocks"] == 3 and stats["G2->G3"]["blocks"] == 3
        assert mgr.status()["tiers"]["G1"]["pool"]["inactive"] == 3
        assert_baseline(mgr)


def test_g1_only_and_g1_g2_configs(tmp_path):
    with KvBlockManager(make_config(g2=0, g3=0)) as mgr:
        records = chain(2)
        put(mgr, records, payloads(mgr, records))
        assert mgr.locate(hashes_of(records)).result() == ["G1", "G1"]
        assert set(mgr.status()["tiers"]) == {"G1"}
    with KvBlockManager(make_config(g3=0)) as mgr:
        records = chain(2)
        data = payloads(mgr, records)
        put(mgr, records, data)
        evict_g1(mgr)
        with mgr.onboard(hashes_of(records)).result() as result:
            assert result.sources == ("G2", "G2")
            assert_g1_bytes(mgr, result, data)
        assert mgr.status()["disk_dir"] is None


def test_status_reports_stand_in_and_storages(tmp_path):
    with KvBlockManager(make_config(), disk_dir=tmp_path) as mgr:
        status = mgr.status()
        stand_in = not torch.cuda.is_available()     # CPU tensors stand in for G1 only without a GPU
        assert status["stand_in"] is stand_in
        assert status["tiers"]["G1"]["storage"]["stand_in"] is stand_in
        assert status["tiers"]["G2"]["storage"]["kind"] == "host"
        assert status["tiers"]["G3"]["storage"]["path"].startswith(str(tmp_path))
        assert status["tiers"]["G3"]["pool"] == {"tier": "G3", "capacity": 32, "active": 0,
                                                 "inactive": 0, "reset": 32, "evictions": 0}
        assert status["transfers_pending"] == 0


def test_close_is_idempotent_removes_temp_dir_and_refuses_calls():
    mgr = KvBlockManager(make_config())
    disk_dir = mgr.status()["disk_dir"]
    assert os.path.isdir(disk_dir)
    records = chain(2)
    put(mgr, records, payloads(mgr, records))
    mgr.close()              # waits for the offloads first
    mgr.close()
    assert not os.path.exists(disk_dir)
    with pytest.raises(ManagerClosedError):
        mgr.allocate(1)
    with pytest.raises(ManagerClosedError):
        mgr.onboard([1])


def test_config_errors_are_typed(tmp_path):
    with pytest.raises(ManagerConfigError, match="G4"):
        KvBlockManager(KvConfig(tiers={"G1": TierConfig(blocks=4), "G2": TierConfig(blocks=4),
                                       "G4": TierConfig(blocks=4)}))
    with pytest.raises(ManagerConfigError, match="needs tier G2"):
        KvBlockManager(KvConfig(tiers={"G1": TierConfig(blocks=4), "G3": TierConfig(blocks=4)}))
    with pytest.raises(ManagerConfigError, match="over the limit"):
        KvBlockManager(make_config(g2=1000), max_host_bytes=1 << 20)
    wrong_page = [torch.zeros(2, 4, 8, 2, 8, dtype=torch.float16)]
    with pytest.raises(ManagerConfigError, match="8-token blocks"):
        KvBlockManager(make_config(), kv_caches=wrong_page)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("arguments, problem", [
    (dict(rank=-1), "rank must be"), (dict(rank=5, world_size=2), "rank must be"),
    (dict(rank="0"), "rank must be"), (dict(world_size=0), "world_size must be"),
    (dict(device="nope:7"), "not a device torch knows"),
    (dict(device=f"cuda:{torch.cuda.device_count()}"), "not on this machine"),
    (dict(config=KvConfig(block_size=0)), "block_size must be"),
])
def test_bad_arguments_are_config_errors_and_leave_nothing(tmp_path, arguments, problem):
    """Refused with ManagerConfigError naming the problem before anything is made: a rank
    outside the world would file stored blocks where no rank looks."""
    config = arguments.pop("config", make_config())
    arguments.setdefault("disk_dir", str(tmp_path))
    with pytest.raises(ManagerConfigError, match=problem):
        KvBlockManager(config, **arguments)
    assert list(tmp_path.iterdir()) == []


def test_release_after_close_does_not_hang(tmp_path):
    mgr = KvBlockManager(make_config(), disk_dir=tmp_path)
    records = chain(2)
    put(mgr, records, payloads(mgr, records))
    result = mgr.onboard(hashes_of(records)).result()
    mgr.close()
    assert result.release().result(1) is None


@pytest.mark.parametrize("bad", [2**64 + 5, -1])
def test_register_refuses_a_bad_hash_and_changes_nothing(tmp_path, bad):
    with KvBlockManager(make_config(), disk_dir=tmp_path) as mgr:
        blocks = mgr.allocate(1).result(HANG_GUARD)
        size = mgr.storage("G1").config.block_bytes
        mgr.write_g1(blocks.block_ids, [np.zeros(size, np.uint8)])
        # A pool's slots hold u64 hashes: the handle refuses the record itself now (before,
        # register did, with InvalidBlockError); the block stays Reset, the handle usable.
        with pytest.raises(BlockHashError, match="sequence_hash"):
            blocks.apply_token_blocks([BlockRecord(bad, 1, None, BS)])
        assert blocks.sequence_hashes == [None]
        assert bad not in mgr.pools["G1"]
        status = mgr.status()
        assert status["transfers_pending"] == 0
        assert status["tiers"]["G2"]["pool"]["active"] == 0
        mgr.flush().result(HANG_GUARD)          # nothing left pending
        mgr.release(blocks).result(HANG_GUARD)  # the handle was not consumed
        records = chain(2)
        data = payloads(mgr, records)
        put(mgr, records, data)                 # the manager still works
        mgr.wait_idle(HANG_GUARD)
        assert all(r.sequence_hash in mgr.pools["G3"] for r in records)
        assert_baseline(mgr)


@pytest.mark.parametrize("g1_layout", ["outer_contiguous", "block_contiguous",
                                       "fully_contiguous"])
def test_write_g1_validates_everything_before_writing(g1_layout):
    with KvBlockManager(make_config(g2=0, g3=0), g1_layout=g1_layout) as mgr:
        n = mgr.pools["G1"].capacity
        size = mgr.storage("G1").config.block_bytes
        records = chain(n - 2)
        data = payloads(mgr, records)
        put(mgr, records, data)
        registered = [mgr.pools["G1"].lookup(r.sequence_hash).block_id for r in records]
        free = [i for i in range(n) if i not in registered]
        junk = np.full(size, 0xAB, np.uint8)
        for ids in ([-1], [n], [True], [1.0]):
            with pytest.raises(InvalidBlockError, match="not a G1 block id"):
                mgr.write_g1(ids, [junk])
        with pytest.raises(InvalidBlockError, match="registered"):
            mgr.write_g1([registered[-1]], [junk])
        with pytest.raises(InvalidBlockError, match="not held"):
            mgr.write_g1([free[0]], [junk])
        held = mgr.allocate(2).result(HANG_GUARD)
        first = np.arange(size, dtype=np.uint8)
        mgr.write_g1(held.block_ids, [first, first])
        with pytest.raises(InvalidBlockError, match="payload 1"):
            mgr.write_g1(held.block_ids, [junk, junk[:-1]])    # the second is too short
        with pytest.raises(InvalidBlockError, match="2 block ids but 1 payloads"):
            mgr.write_g1(held.block_ids, [junk])
        assert all(np.array_equal(got, first) for got in mgr.read_g1(held.block_ids))
        for r, block_id in zip(records, registered):        # nothing was corrupted
            assert np.array_equal(mgr.read_g1([block_id])[0], data[r.sequence_hash])
        for ids in ([n], [-1]):
            with pytest.raises(InvalidBlockError):
                mgr.read_g1(ids)
        mgr.release(held).result(HANG_GUARD)


def test_calls_after_close_fail_fast_or_resolve(tmp_path):
    mgr = KvBlockManager(make_config(), disk_dir=tmp_path)
    mgr.close()
    with pytest.raises(ManagerClosedError):
        mgr.status()
    with pytest.raises(ManagerClosedError):
        mgr.transfer_stats()
    assert mgr.flush().result(HANG_GUARD) is None
    mgr.wait_idle(HANG_GUARD)


def test_storage_of_unknown_tier_is_a_typed_error():
    with KvBlockManager(make_config(g3=0)) as mgr:
        with pytest.raises(ManagerError, match="G9"):
            mgr.storage("G9")
        with pytest.raises(ManagerError, match="G3"):
            mgr.evict("G3", [1])


class _SpyQueue:
    """Wraps the owner's queue to tell when something (and the stop marker) is posted."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.posted = threading.Event()
        self.stop_posted = threading.Event()

    def put(self, item) -> None:
        self.inner.put(item)
        self.posted.set()
        if item is owner_module.STOP:
            self.stop_posted.set()

    def get(self, *args, **kwargs):
        return self.inner.get(*args, **kwargs)


class _BlockingObserver:
    """A registry observer that blocks the owner thread inside ``register`` while armed."""

    def __init__(self) -> None:
        self.armed = False
        self.entered = threading.Event()
        self.gate = threading.Event()

    def on_tier_stored(self, tier, records) -> None:
        if self.armed:
            self.armed = False
            self.entered.set()
            self.gate.wait(HANG_GUARD)

    def on_tier_removed(self, tier, hashes) -> None: ...
    def on_tier_cleared(self, tier) -> None: ...
    def on_stored(self, records) -> None: ...
    def on_removed(self, hashes) -> None: ...


def test_release_racing_close_resolves():
    """release() posted after close() queued the owner's stop marker, while the owner is
    still alive, must still resolve (it used to be posted behind the marker, never run)."""
    mgr = KvBlockManager(make_config(g2=0, g3=0))
    records = chain(2)
    put(mgr, records, payloads(mgr, records))
    held = mgr.match(hashes_of(records)).result(HANG_GUARD)   # a handle the caller keeps
    observer = _BlockingObserver()
    mgr.add_observer(observer).result(HANG_GUARD)
    blocks = mgr.allocate(1).result(HANG_GUARD)
    blocks.apply_token_blocks(chain(1, start=900))
    observer.armed = True
    registered = mgr.register(blocks)
    assert observer.entered.wait(HANG_GUARD)          # the owner is busy in register
    spy = mgr._owner.queue = _SpyQueue(mgr._owner.queue)
    closer = threading.Thread(target=mgr.close)
    closer.start()
    assert spy.posted.wait(HANG_GUARD)                # close() posted its flush
    owner_busy, unblock = threading.Event(), threading.Event()
    late = mgr.flush()                                # queued behind close()'s flush
    late.add_done_callback(lambda _: (owner_busy.set(), unblock.wait(HANG_GUARD)))
    observer.gate.set()
    assert spy.stop_posted.wait(HANG_GUARD) and owner_busy.wait(HANG_GUARD)
    assert mgr._owner.thread.is_alive()                      # stop marker queued, owner alive
    released = mgr.release(held)
    try:
        assert released.result(5) is None
    finally:
        unblock.set()
        closer.join(HANG_GUARD)
    assert not closer.is_alive()
    assert registered.done()


def test_concurrent_close_waits_for_the_first(tmp_path):
    gate = threading.Event()

    class GatedWrites(FileOps):
        def pwritev(self, fd, buffers, offset):
            gate.wait(HANG_GUARD)
            return super().pwritev(fd, buffers, offset)

    mgr = KvBlockManager(make_config(), disk_dir=tmp_path, file_ops=GatedWrites(),
                         o_direct=False)
    records = chain(2)
    put(mgr, records, payloads(mgr, records))         # G2->G3 now waits at the gate
    seen = {}

    def second_close() -> None:
        mgr.close()
        seen["owner_alive"] = mgr._owner.thread.is_alive()

    first = threading.Thread(target=mgr.close)
    first.start()
    with pytest.raises(ManagerClosedError):            # the first close() has begun
        while True:
            mgr.allocate(1).result(HANG_GUARD).release()
    second = threading.Thread(target=second_close)
    second.start()
    second.join(0.3)
    assert second.is_alive(), "a second close() returned while the first was still closing"
    gate.set()
    first.join(HANG_GUARD)
    second.join(HANG_GUARD)
    assert seen == {"owner_alive": False}


def test_wait_idle_timeout_withdraws_its_waiter(tmp_path):
    gate = threading.Event()

    class GatedWrites(FileOps):
        def pwritev(self, fd, buffers, offset):
            gate.wait(HANG_GUARD)
            return super().pwritev(fd, buffers, offset)

    with KvBlockManager(make_config(), disk_dir=tmp_path, file_ops=GatedWrites(),
                        o_direct=False) as mgr:
        records = chain(2)
        put(mgr, records, payloads(mgr, records))
        for _ in range(3):
            with pytest.raises(TimeoutError):
                mgr.wait_idle(0.01)
        mgr.status()                                  # the owner has handled the withdrawals
        assert mgr._owner.idle_waiters == []
        gate.set()
        mgr.wait_idle(HANG_GUARD)


def test_busy_metrics_port_is_a_config_error_and_leaks_nothing():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        threads = set(threading.enumerate())
        dirs = set(glob.glob(os.path.join(tempfile.gettempdir(), "kvstrata-g3-*")))
        with pytest.raises(ManagerConfigError, match=str(port)):
            KvBlockManager(make_config(), metrics_port=port)
    assert [t.name for t in set(threading.enumerate()) - threads] == []
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "kvstrata-g3-*"))) == dirs


@pytest.mark.parametrize("shape, dtype, kv_layout, problem", [
    ((3, 2, 6, BS, 2, 8), torch.float16, "auto", "3 layers"),
    ((2, 2, 6, BS, 4, 8), torch.float16, "auto", "2 x 8 = 16"),
    ((2, 2, 6, BS, 2, 8), torch.float32, "auto", "dtype float32"),
    ((2, 6, BS, 1, 16), torch.float16, "mla", "outer dim 1"),
])
def test_kv_caches_must_match_the_model_geometry(tmp_path, shape, dtype, kv_layout, problem):
    tensors = [torch.zeros(shape[1:], dtype=dtype) for _ in range(shape[0])]
    with pytest.raises(ManagerConfigError, match=problem):
        KvBlockManager(make_config(g1=6), kv_caches=tensors, kv_layout=kv_layout,
                       disk_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


# -- API misuse: typed errors at once, nothing changed ---------------------------------------

@pytest.mark.parametrize("count", [1.5, "x", None, True, -1, np.float64(2.0)])
def test_allocate_refuses_what_is_not_a_count(tmp_path, count):
    with KvBlockManager(make_config(), disk_dir=str(tmp_path)) as mgr:
        with pytest.raises(InvalidBlockError, match="allocate"):
            mgr.allocate(count)
        assert mgr.pools["G1"].status().reset == 8             # nothing allocated


def test_allocate_takes_numpy_integers(tmp_path):
    with KvBlockManager(make_config(), disk_dir=str(tmp_path)) as mgr:
        blocks = mgr.allocate(np.int64(2)).result(HANG_GUARD)
        assert len(blocks.block_ids) == 2
        mgr.release(blocks).result(HANG_GUARD)


@pytest.mark.parametrize("bad", [[-1], [2 ** 64], [None], [1.0], ["7"], "abc", 5])
def test_hash_arguments_must_be_u64(tmp_path, bad):
    with KvBlockManager(make_config(), disk_dir=str(tmp_path)) as mgr:
        for call in (mgr.onboard, mgr.match, mgr.locate, lambda h: mgr.evict("G2", h)):
            with pytest.raises(InvalidBlockError):
                call(bad)


def test_bytes_of_g1_after_close_are_a_closed_error_and_released(tmp_path):
    import gc
    import weakref

    mgr = KvBlockManager(make_config(), disk_dir=str(tmp_path))
    regions = weakref.ref(mgr.storage("G1").memory.regions[0])
    mgr.close()
    with pytest.raises(ManagerClosedError):
        mgr.read_g1([0])
    with pytest.raises(ManagerClosedError):
        mgr.write_g1([0], [np.zeros(mgr._g1.block_bytes, np.uint8)])
    assert not mgr._g1._regions                          # no view keeps G1's memory alive
    del regions
    gc.collect()


@pytest.mark.parametrize("operation", ["read", "write"])
def test_g1_bytes_racing_close_end_in_a_closed_error(operation):
    """A read or write of G1's bytes while another thread closes the manager either
    finishes or is refused with ManagerClosedError (it used to fail with an IndexError on
    the views close() dropped under it). A race: tried a few times."""
    for _ in range(4):
        mgr = KvBlockManager(make_config(g1=256, g2=0, g3=0))
        ids = mgr.allocate(256).result(HANG_GUARD).block_ids
        zeros = [np.zeros(mgr._g1.block_bytes, np.uint8)] * len(ids)
        outcome, started = [], threading.Event()

        def hammer():
            started.set()
            try:
                while True:
                    mgr.read_g1(ids) if operation == "read" else mgr.write_g1(ids, zeros)
            except Exception as exc:              # noqa: BLE001 - the type is what is tested
                outcome.append(exc)

        thread = threading.Thread(target=hammer)
        thread.start()
        started.wait(HANG_GUARD)
        mgr.close()
        thread.join(HANG_GUARD)
        assert len(outcome) == 1 and isinstance(outcome[0], ManagerClosedError), outcome


def test_close_from_a_callback_on_the_owner_thread_is_an_error_not_a_deadlock():
    mgr = KvBlockManager(make_config(g3=0))
    outcome = []

    def close_from_callback(_future):
        try:
            mgr.close()
        except ManagerError as exc:
            outcome.append(exc)

    mgr.allocate(1).add_done_callback(close_from_callback)
    mgr.flush().result(HANG_GUARD)               # the callback ran (owner thread, in order)
    assert len(outcome) == 1 and "own thread" in str(outcome[0])
    mgr.close()                                  # from another thread: closes
    with pytest.raises(ManagerClosedError):
        mgr.allocate(1)
