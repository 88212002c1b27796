"""kvstrata's tier changes as vLLM KV events, for the connector's ``take_events``.

vLLM publishes what a connector returns from ``take_events`` in its own KV event stream
(ZMQ, ``--kv-events-config``), beside the events of its own G1 prefix cache (``medium``
``GPU``). :class:`VllmEventCollector` observes kvstrata's block registry and turns each change
in a lower tier into vLLM's ``BlockStored`` / ``BlockRemoved`` with that tier's medium (G2
``CPU``, G3 ``STORAGE``; :mod:`kvstrata.tiers`), one ``BlockStored`` per chain of blocks.
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent

from ...events.model import split_chains
from ...logical.registry import RegistryObserver
from ...tiers import TOP_TIER, spec
from ...types import BlockRecord

__all__ = ["VllmEventCollector"]


class VllmEventCollector(RegistryObserver):
    """Collects vLLM events for the lower tiers until :meth:`take` (bounded: past
    ``max_events`` the oldest are dropped and counted in :attr:`dropped`)."""

    def __init__(self, max_events: int = 100_000) -> None:
        self._events: deque[KVCacheEvent] = deque()
        self.max_events = max_events
        self.dropped = 0

    def on_tier_stored(self, tier: str, records: Sequence[BlockRecord]) -> None:
        if tier == TOP_TIER:
            return
        medium = spec(tier).vllm_medium
        for chain in split_chains(records):
            self._add(BlockStored(block_hashes=[r.sequence_hash for r in chain],
                                  parent_block_hash=chain[0].parent_hash,
                                  token_ids=[t for r in chain for t in (r.token_ids or ())]
                                  if all(r.token_ids is not None for r in chain) else [],
                                  block_size=chain[0].block_size, lora_id=None,
                                  medium=medium, lora_name=None))

    def on_tier_removed(self, tier: str, sequence_hashes: Sequence[int]) -> None:
        if tier != TOP_TIER and sequence_hashes:
            self._add(BlockRemoved(block_hashes=list(sequence_hashes),
                                   medium=spec(tier).vllm_medium))

    def take(self) -> list[KVCacheEvent]:
        events = list(self._events)
        self._events.clear()
        return events

    def _add(self, event: KVCacheEvent) -> None:
        if len(self._events) >= self.max_events:
            self._events.popleft()
            self.dropped += 1
        self._events.append(event)
