"""The tiers of one block manager, fastest first, and the logical offload / onboard decisions.

:class:`TierHierarchy` builds one :class:`BlockPool` per configured tier (sharing one
:class:`BlockRegistry`) and the admission filter of each lower tier. It answers, without side
effects, where the longest cached prefix of a request lives (:meth:`locate_prefix`), and it
carries out the metadata side of the two movements between tiers:

* **onboard**: blocks found in a lower tier are registered in G1 (:meth:`onboard`);
* **offload** (write-through cascade): a block newly registered in tier *k* is offered to tier
  *k+1*; blocks the tier already holds are skipped, the admission filter decides for the rest
  (:meth:`offload`).

No bytes move here: the data path (issue: physical layer) executes the same decisions as
transfer plans between storages. Counters of what moved are kept in :attr:`moves`.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

from ..config import KvConfig
from .policy import AdmissionPolicy, make_tier_policies
from .pool import BlockPool
from .registry import TIER_NAMES, BlockRecord, BlockRegistry


class TierHierarchy:
    """Pools for the configured tiers and the movements between them (metadata only)."""

    def __init__(self, config: KvConfig, registry: BlockRegistry | None = None) -> None:
        config.validate()
        self.config = config
        self.registry = registry if registry is not None else BlockRegistry()
        self.tier_names = [t for t in TIER_NAMES if t in config.tiers]
        self.pools: dict[str, BlockPool] = {}
        self.admission: dict[str, AdmissionPolicy] = {}
        self._request_observers = []
        for name in self.tier_names:
            capacity = config.tier_blocks(name)
            policies = make_tier_policies(
                config.tier_eviction(name), config.tier_admission(name), capacity
            )
            self.pools[name] = BlockPool(
                name,
                capacity,
                config.block_size,
                eviction=policies.eviction,
                registry=self.registry,
                keep_tokens=config.keep_tokens,
            )
            self.admission[name] = policies.admission
            if policies.observe_request is not None:
                self._request_observers.append(policies.observe_request)
        self.moves: Counter[str] = Counter()
        """Blocks moved per path, e.g. ``moves["G2->G1"]``; ``rejected:G3`` counts refusals."""

    @property
    def top(self) -> BlockPool:
        return self.pools[self.tier_names[0]]

    def locate_prefix(self, sequence_hashes: Sequence[int]) -> list[str]:
        """For the longest prefix held anywhere, the fastest tier holding each block.

        Side-effect free. ``len(result)`` is the prefix length across all tiers.
        """
        pools = [self.pools[t] for t in self.tier_names]
        where: list[str] = []
        for h in sequence_hashes:
            for pool in pools:
                if h in pool:
                    where.append(pool.tier)
                    break
            else:
                break
        return where

    def observe_request(self, sequence_hashes: Sequence[int]) -> None:
        """Show a request's block hashes to the tiers' policies that learn from requests."""
        for observe in self._request_observers:
            observe(sequence_hashes)

    def register_in(self, tier: str, records: Sequence[BlockRecord]) -> list[BlockRecord]:
        """Register ``records`` in ``tier`` (allocating, evicting as needed) and release them.

        Records already held are skipped. Runs longer than the tier are registered in
        tier-sized chunks. Returns the records newly registered.
        """
        pool = self.pools[tier]
        new = [r for r in records if r.sequence_hash not in pool]
        chunk = max(1, pool.capacity)
        for start in range(0, len(new), chunk):
            part = new[start : start + chunk]
            handle = pool.allocate(len(part))
            handle.apply_token_blocks(part)
            pool.release(pool.register(handle))
        return new

    def store_computed(self, records: Sequence[BlockRecord]) -> list[BlockRecord]:
        """Blocks the engine just computed: keep those the top tier admits; returns them.

        A block the top tier's admission filter refuses is used once and not cached: it takes
        no slot and evicts nothing (``rejected:G1`` counts them).
        """
        top = self.tier_names[0]
        pool = self.pools[top]
        admit = self.admission[top].admit
        offered = [r for r in records if r.sequence_hash not in pool]
        admitted = [r for r in offered if admit(r.sequence_hash)]
        self.moves[f"rejected:{top}"] += len(offered) - len(admitted)
        return self.register_in(top, admitted)

    def onboard(self, source: str, records: Sequence[BlockRecord]) -> list[BlockRecord]:
        """Bring blocks held in ``source`` into the top tier; counts ``source->G1`` moves."""
        top = self.tier_names[0]
        self.pools[source].touch(r.sequence_hash for r in records)
        new = self.register_in(top, records)
        self.moves[f"{source}->{top}"] += len(new)
        return new

    def offload(self, tier: str, records: Sequence[BlockRecord]) -> None:
        """Write-through cascade: offer blocks newly registered in ``tier`` to the tiers below."""
        index = self.tier_names.index(tier)
        while index + 1 < len(self.tier_names) and records:
            source, target = self.tier_names[index], self.tier_names[index + 1]
            pool = self.pools[target]
            admit = self.admission[target].admit
            offered = [r for r in records if r.sequence_hash not in pool]
            admitted = [r for r in offered if admit(r.sequence_hash)]
            self.moves[f"rejected:{target}"] += len(offered) - len(admitted)
            records = self.register_in(target, admitted)
            self.moves[f"{source}->{target}"] += len(records)
            index += 1
