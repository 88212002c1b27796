"""kvstrata's tier changes as vLLM KV events, for the connector's ``take_events``.

vLLM publishes what a connector returns from ``take_events`` in its own KV event stream
(ZMQ, ``--kv-events-config``), beside the events of its own G1 prefix cache (``medium``
``GPU``). :class:`VllmEventCollector` observes kvstrata's block registry and turns each change
in a lower tier into vLLM's ``BlockStored`` / ``BlockRemoved`` with that tier's medium (G2
``CPU``, G3 ``STORAGE``; :mod:`kvstrata.tiers`), one ``BlockStored`` per chain of blocks.

With several KV cache groups (a hybrid model) each event is about one group and says so as
vLLM's own events do: ``group_idx`` (vLLM's index of the group), and on stores the group's
``kv_cache_spec_kind`` and ``kv_cache_spec_sliding_window``; block hashes are the request's
chain hashes in every group (vLLM's ``(group_idx, hash)`` key), not kvstrata's per-group
names (:mod:`.groups`). vLLM does not add these fields to a connector's events; routers such
as Dynamo's index only full-attention kinds and use ``group_idx`` to tell the groups apart.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Sequence

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent

from ...events.model import split_chains
from ...logical.registry import RegistryObserver
from ...tiers import TOP_TIER, spec
from ...types import BlockRecord
from .groups import KvGroups

__all__ = ["VllmEventCollector", "PrimaryGroupOnly"]


class VllmEventCollector(RegistryObserver):
    """Collects vLLM events for the lower tiers until :meth:`take` (bounded: past
    ``max_events`` the oldest are dropped and counted in :attr:`dropped`). ``registry`` (the
    one observed) says when a block of a non-primary group is held nowhere any more."""

    def __init__(self, groups: KvGroups = KvGroups(), registry: Any = None,
                 max_events: int = 100_000) -> None:
        self._events: deque[KVCacheEvent] = deque()
        self.max_events = max_events
        self.dropped = 0
        self._groups = groups
        self._registry = registry
        self._position: dict[int, int] = {}
        """Group (position) of each block of a non-primary group held in a lower tier."""

    def on_tier_stored(self, tier: str, records: Sequence[BlockRecord]) -> None:
        if tier == TOP_TIER:
            return
        medium = spec(tier).vllm_medium
        groups = self._groups
        by_group: dict[int, list[BlockRecord]] = {}
        for record in records:
            by_group.setdefault(groups.position_of(record.local_hash), []).append(record)
        for pos, mine in by_group.items():
            if pos != groups.primary:
                self._position.update((r.sequence_hash, pos) for r in mine)
            for chain in split_chains(mine):
                self._add(BlockStored(
                    block_hashes=[groups.chain_hash(pos, r.sequence_hash) for r in chain],
                    parent_block_hash=None if chain[0].parent_hash is None
                    else groups.chain_hash(pos, chain[0].parent_hash),
                    token_ids=[t for r in chain for t in (r.token_ids or ())]
                    if all(r.token_ids is not None for r in chain) else [],
                    block_size=chain[0].block_size, lora_id=None, medium=medium,
                    lora_name=None, **self._group_fields(pos, stored=True)))

    def on_tier_removed(self, tier: str, sequence_hashes: Sequence[int]) -> None:
        if tier == TOP_TIER or not sequence_hashes:
            return
        groups = self._groups
        by_group: dict[int, list[int]] = {}
        for key in sequence_hashes:
            by_group.setdefault(self._position.get(key, groups.primary), []).append(key)
        medium = spec(tier).vllm_medium
        for pos, keys in by_group.items():
            self._add(BlockRemoved(block_hashes=[groups.chain_hash(pos, k) for k in keys],
                                   medium=medium, **self._group_fields(pos, stored=False)))
            if pos != groups.primary:
                self._forget(keys)

    def take(self) -> list[KVCacheEvent]:
        events = list(self._events)
        self._events.clear()
        return events

    def _group_fields(self, pos: int, stored: bool) -> dict[str, Any]:
        if self._groups == KvGroups():
            return {}                         # one full-attention group: as vLLM's own
        group = self._groups.groups[pos]
        fields: dict[str, Any] = {"group_idx": group.index}
        if stored:
            fields.update(kv_cache_spec_kind=group.kind,
                          kv_cache_spec_sliding_window=group.sliding_window)
        return fields

    def _forget(self, keys: Sequence[int]) -> None:
        held = self._registry.tiers_of if self._registry is not None else None
        for key in keys:
            if held is None or not held(key):
                self._position.pop(key, None)

    def _add(self, event: KVCacheEvent) -> None:
        if len(self._events) >= self.max_events:
            self._events.popleft()
            self.dropped += 1
        self._events.append(event)


class PrimaryGroupOnly(RegistryObserver):
    """Passes to ``observer`` only the blocks of the primary KV cache group: kvstrata's own
    event formats (its JSON, Dynamo's) have no field for a group, and a router matches a
    prompt by the primary group's hashes (Dynamo indexes full-attention groups only)."""

    def __init__(self, observer: RegistryObserver, groups: KvGroups) -> None:
        self.observer = observer
        self._groups = groups

    def _primary(self, records: Sequence[BlockRecord]) -> list[BlockRecord]:
        primary, position_of = self._groups.primary, self._groups.position_of
        return [r for r in records if position_of(r.local_hash) == primary]

    def on_tier_stored(self, tier: str, records: Sequence[BlockRecord]) -> None:
        mine = self._primary(records)
        if mine:
            self.observer.on_tier_stored(tier, mine)

    def on_tier_removed(self, tier: str, sequence_hashes: Sequence[int]) -> None:
        self.observer.on_tier_removed(tier, sequence_hashes)

    def on_tier_cleared(self, tier: str) -> None:
        self.observer.on_tier_cleared(tier)

    def on_stored(self, records: Sequence[BlockRecord]) -> None:
        mine = self._primary(records)
        if mine:
            self.observer.on_stored(mine)

    def on_removed(self, sequence_hashes: Sequence[int]) -> None:
        self.observer.on_removed(sequence_hashes)
