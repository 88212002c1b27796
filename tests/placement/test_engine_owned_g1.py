"""The planner with an engine-owned G1, moving real bytes: the engine's own KV tensors are G1,
kvstrata's host and disk storages are G2 and G3, plans run on the in-process transfer engine.

This is the mode an engine connector uses: the engine allocates device blocks and hands their
ids over; the planner reads them for an offload, fills them for an onboard, and never touches
any other engine block."""

from __future__ import annotations

import queue

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvstrata.config import KvConfig, TierConfig  # noqa: E402
from kvstrata.physical import DeviceStorage, DiskStorage, HostStorage, TransferEngine  # noqa: E402
from kvstrata.placement import EngineExecutor, PlacementError, Planner  # noqa: E402
from kvstrata.tokens import hash_blocks  # noqa: E402
from kvstrata.types import BlockRecord  # noqa: E402

BS, LAYERS, HEADS, DIM = 4, 2, 2, 8
ENGINE_BLOCKS = 12
TIMEOUT = 30


def chain(n: int, start: int = 0) -> list[BlockRecord]:
    local, seqs = hash_blocks(np.arange(start, start + n * BS, dtype="<u4"), BS)
    return [BlockRecord(s, l, p, BS) for s, l, p in zip(seqs, local, [None, *seqs[:-1]])]


class Engine:
    """A stand-in engine: per-layer KV tensors it owns, a transfer engine over them and
    kvstrata's lower tiers, and the planner with ``engine_owns_top=True``."""

    def __init__(self, tmp_path, g2: int = 8, g3: int = 32) -> None:
        self.layers = [torch.full((2, ENGINE_BLOCKS, BS, HEADS, DIM), -1.0, dtype=torch.float16)
                       for _ in range(LAYERS)]
        g1 = DeviceStorage.wrap(self.layers)
        geometry = g1.config
        self.storages = {"G1": g1,
                         "G2": HostStorage(geometry.with_blocks(g2).with_alignment(4096)),
                         "G3": DiskStorage(geometry.with_blocks(g3), tmp_path, o_direct=False)}
        self.transfers = TransferEngine(self.storages)
        config = KvConfig(block_size=BS, eviction="lru",
                          tiers={"G1": TierConfig(blocks=ENGINE_BLOCKS),
                                 "G2": TierConfig(blocks=g2), "G3": TierConfig(blocks=g3)})
        self.planner = Planner(config, engine_owns_top=True)
        self.results: queue.SimpleQueue = queue.SimpleQueue()
        self.executor = EngineExecutor(self.transfers, self.results.put)

    def compute(self, block_id: int, seed: int) -> None:
        for i, layer in enumerate(self.layers):
            gen = torch.Generator().manual_seed(seed * 31 + i)
            layer[:, block_id] = torch.randn(2, BS, HEADS, DIM, generator=gen).half()

    def block(self, block_id: int) -> torch.Tensor:
        return torch.stack([layer[:, block_id] for layer in self.layers]).clone()

    def run(self) -> None:
        """One scheduler loop: hand out plans, take results, until nothing is pending."""
        planner = self.planner
        while True:
            self.executor.submit(planner.take_plans())
            if planner.idle:
                return
            result = self.results.get(timeout=TIMEOUT)
            planner.complete([result])
            self.executor.settled(result)

    def close(self) -> None:
        self.transfers.close()
        for storage in self.storages.values():
            storage.close()


@pytest.fixture
def engine(tmp_path):
    e = Engine(tmp_path)
    yield e
    e.close()


def test_offload_reads_engine_blocks_and_onboard_fills_the_ids_given(engine):
    planner = engine.planner
    assert "G1" not in planner.pools                # no pool of ours over the engine's blocks
    records = chain(3)
    hashes = [r.sequence_hash for r in records]
    computed_in = [5, 9, 2]
    for block_id, r in zip(computed_in, records):
        engine.compute(block_id, r.sequence_hash % 1000)
    expected = {h: engine.block(b) for h, b in zip(hashes, computed_in)}

    planner.prepare_offload("G1", records, engine_block_ids=computed_in)
    plans = planner.take_plans()
    assert [(p.path, p.src_block_ids) for p in plans] == [("G1->G2", tuple(computed_in))]
    assert planner.engine_blocks_in_use() == frozenset(computed_in)   # engine must keep them
    engine.executor.submit(plans)
    engine.run()
    assert planner.engine_blocks_in_use() == frozenset()
    assert planner.lookup(hashes) == ["G2"] * 3
    assert all(h in planner.pools["G3"] for h in hashes)          # cascaded down

    before = {b: engine.block(b) for b in range(ENGINE_BLOCKS)}
    targets = [1, 3, 7]
    ticket = planner.prepare_onboard(hashes, engine_block_ids=targets)
    assert planner.engine_blocks_in_use() == frozenset(targets)
    engine.run()
    (result,) = planner.take_finished()
    assert result.ticket == ticket and result.sources == ("G2",) * 3
    assert result.block_ids == targets and result.failures == ()
    for h, b in zip(hashes, targets):
        assert torch.equal(engine.block(b), expected[h])
    for b in set(range(ENGINE_BLOCKS)) - set(targets):             # nothing else touched
        assert torch.equal(engine.block(b), before[b])


def test_onboard_from_disk_reads_no_engine_block_after_and_failures_stop_the_prefix(engine):
    planner = engine.planner
    records = chain(4, start=100)
    hashes = [r.sequence_hash for r in records]
    for block_id, r in enumerate(records):
        engine.compute(block_id, r.sequence_hash % 1000)
    expected = {h: engine.block(b) for b, h in enumerate(hashes)}
    planner.prepare_offload("G1", records, engine_block_ids=[0, 1, 2, 3])
    engine.run()
    planner.pools["G2"].reset_blocks(list(reversed(hashes)))
    assert planner.lookup(hashes) == ["G3"] * 4

    g3 = engine.storages["G3"]
    bad = hashes[2]
    slot = planner.pools["G3"].lookup(bad).block_id
    with open(g3.path, "r+b") as fh:                              # corrupt one block on disk
        offset = slot * g3.layout.block_stride + 10
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0xFF]))

    targets = [8, 9, 10, 11]
    planner.prepare_onboard(hashes, engine_block_ids=targets)
    engine.run()
    (result,) = planner.take_finished()
    assert result.sources == ("G3", "G3")                          # stops before the bad block
    assert result.failed == [bad] and result.failures[0].kind == "checksum_mismatch"
    for h, b in zip(result.sequence_hashes, result.block_ids):
        assert torch.equal(engine.block(b), expected[h])
    assert bad not in planner.pools["G3"]                          # dropped where it was bad
    # No write-back to G2: the engine may reuse its blocks once the load is done, so nothing
    # reads them unless the engine offers them again.
    assert planner.take_plans() == [] and planner.engine_blocks_in_use() == frozenset()
    assert planner.lookup(hashes) == ["G3", "G3"]
    planner.prepare_offload("G1", records[:2], engine_block_ids=targets[:2])
    engine.run()
    assert planner.lookup(hashes) == ["G2", "G2"]
    assert planner.idle and planner.engine_blocks_in_use() == frozenset()
    for pool in planner.pools.values():
        assert pool.status().active == 0
        pool.check_invariants()


def test_engine_ids_are_checked_before_anything_changes(engine):
    planner = engine.planner
    records = chain(2, start=300)
    hashes = [r.sequence_hash for r in records]
    for bad_ids in ([1], [1, 1], [1, -2], [True, 2], None):
        with pytest.raises(PlacementError):
            planner.prepare_offload("G1", records, engine_block_ids=bad_ids)
        with pytest.raises(PlacementError):
            planner.prepare_onboard(hashes, engine_block_ids=bad_ids)
    with pytest.raises(PlacementError, match="engine owns"):
        planner.register(None)
    assert planner.take_plans() == [] and planner.idle
    assert all(pool.status().active == 0 for pool in planner.pools.values())
