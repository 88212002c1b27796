"""vLLM events of a hybrid model's blocks (issue 26): each says its KV cache group as vLLM's
own events do (``group_idx``; on stores the spec's kind and window), with the request's chain
hashes (vLLM's ``(group_idx, hash)`` key), never kvstrata's per-group names; a block's group
is read from its record, so blocks a durable tier recovered after a restart are announced in
their group too; kvstrata's own formats get the primary group only."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvstrata.connectors.vllm.events import PrimaryGroupOnly, VllmEventCollector  # noqa: E402
from kvstrata.connectors.vllm.groups import FULL, SLIDING, KvGroup, KvGroups  # noqa: E402
from kvstrata.logical.registry import BlockRegistry, RegistryObserver  # noqa: E402
from kvstrata.types import BlockRecord  # noqa: E402

BS = 16
# vLLM orders Gemma 3's groups sliding first; the full-attention group (index 2) is primary
GROUPS = KvGroups((KvGroup(0, SLIDING, 512), KvGroup(1, SLIDING, 512), KvGroup(2, FULL)))
CHAIN = [0x1111, 0x2222, 0x3333]
TOKENS_HASH = [0xA1, 0xA2, 0xA3]


def records(pos: int) -> list[BlockRecord]:
    key = GROUPS.key
    return [BlockRecord(key(pos, h), GROUPS.local_hash(pos, TOKENS_HASH[i]),
                        key(pos, CHAIN[i - 1]) if i else None, BS)
            for i, h in enumerate(CHAIN)]


def collector() -> tuple[BlockRegistry, VllmEventCollector]:
    registry = BlockRegistry()
    events = VllmEventCollector(GROUPS, registry)
    registry.add_observer(events)
    return registry, events


def test_group_names_differ_and_only_the_primary_group_keeps_the_chain_hashes():
    assert GROUPS.primary == 2
    assert [GROUPS.key(2, h) for h in CHAIN] == CHAIN
    names = {GROUPS.key(pos, h) for pos in range(3) for h in CHAIN}
    assert len(names) == 9
    for pos in range(3):
        assert [GROUPS.chain_hash(pos, GROUPS.key(pos, h)) for h in CHAIN] == CHAIN
        assert all(GROUPS.position_of(r.local_hash) == pos for r in records(pos))


def test_stores_and_removals_say_the_group_with_the_chain_hashes():
    registry, events = collector()
    for pos in range(3):
        registry.record_stored("G2", records(pos))
    stored = events.take()
    assert [e.group_idx for e in stored] == [0, 1, 2]
    for event in stored:
        assert event.block_hashes == CHAIN and event.parent_block_hash is None
        assert event.medium == "CPU"
    assert [(e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in stored] == \
        [("sliding_window", 512), ("sliding_window", 512), ("full_attention", None)]
    registry.record_removed("G2", [GROUPS.key(1, CHAIN[2]), GROUPS.key(2, CHAIN[2])])
    removed = events.take()
    assert sorted((e.group_idx, tuple(e.block_hashes)) for e in removed) == \
        [(1, (CHAIN[2],)), (2, (CHAIN[2],))]


def test_a_block_recovered_after_a_restart_is_announced_in_its_group():
    """A durable tier's index keeps each block's record; the group is in its local hash."""
    registry, events = collector()
    registry.record_stored("G3", records(0)[1:])          # as planner.restore does
    (event,) = events.take()
    assert event.group_idx == 0 and event.block_hashes == CHAIN[1:]
    assert event.parent_block_hash == CHAIN[0]
    registry.record_removed("G3", [GROUPS.key(0, CHAIN[1])])
    (removed,) = events.take()
    assert removed.group_idx == 0 and removed.block_hashes == [CHAIN[1]]


def test_a_one_group_model_has_events_exactly_as_before():
    registry = BlockRegistry()
    events = VllmEventCollector(KvGroups(), registry)
    registry.add_observer(events)
    plain = [BlockRecord(h, TOKENS_HASH[i], CHAIN[i - 1] if i else None, BS)
             for i, h in enumerate(CHAIN)]
    registry.record_stored("G2", plain)
    (event,) = events.take()
    assert event.group_idx is None and event.kv_cache_spec_kind is None
    assert event.block_hashes == CHAIN


def test_kvstratas_own_formats_get_the_primary_group_only():
    seen: list[BlockRecord] = []

    class Sink(RegistryObserver):
        def on_tier_stored(self, tier, recs):
            seen.extend(recs)

    registry = BlockRegistry()
    registry.add_observer(PrimaryGroupOnly(Sink(), GROUPS))
    for pos in range(3):
        registry.record_stored("G2", records(pos))
    assert [r.sequence_hash for r in seen] == CHAIN
    assert [r.local_hash for r in seen] == TOKENS_HASH


def test_a_mamba_group_serves_a_prefix_ending_where_it_holds_a_state():
    """A Mamba group's block at position i is the state after (i + 1) blocks: a hit of n
    blocks needs the full-attention blocks 0..n-1 and the Mamba block n-1 alone."""
    from kvstrata.connectors.vllm.groups import MAMBA

    groups = KvGroups((KvGroup(0, MAMBA, state="3x8:bfloat16"), KvGroup(1, FULL)))
    chain = [0x10 + i for i in range(6)]
    held = {groups.key(1, h) for h in chain} | {groups.key(0, chain[1]),
                                                  groups.key(0, chain[3])}
    assert groups.longest_hit(chain, 0, held.__contains__, BS) == 4
    assert groups.needed(0, 4, BS) == [(0, 3), (1, 0), (1, 1), (1, 2), (1, 3)]
    assert groups.longest_hit(chain[:3], 0, held.__contains__, BS) == 2
    assert groups.longest_hit(chain, 2, held.__contains__, BS) == 2     # after a local hit
    held.discard(groups.key(1, chain[2]))                               # full group gap
    assert groups.longest_hit(chain, 0, held.__contains__, BS) == 2
