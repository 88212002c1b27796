"""The write-through offload: blocks newly registered in a tier are offered to the next one down.

:meth:`Offload.offer` takes the blocks a tier just registered (or, with an engine-owned top
tier, the engine's block ids holding freshly computed blocks) and plans their copy into the
next configured tier:

* blocks the target holds, or is already receiving, are skipped (dedup), and so are blocks
  quarantined at either end;
* the target's admission filter decides the rest (refusals are counted as ``admission``);
* target slots are allocated as unregistered :class:`~kvstrata.logical.handles.MutableBlocks`
  (a full target evicts by its own policy) and the source blocks are held, so neither can be
  reused mid-copy;
* if the target's slots are all taken by copies in flight, the surplus waits (deferred) and is
  offered again as results free slots -- nobody blocks. An engine's block cannot wait (the
  engine may reuse it), so its surplus is skipped (``no_slot``);
* with tenant quotas (:mod:`.tenants`), a tenant at its quota of the target evicts its own
  idle blocks there first; what still does not fit is skipped (``quota``). The tenant of a
  batch travels with it: down the tiers, through deferral, into the copy's job. With quotas
  no block goes unowned: one whose tenant no tier knows (learned from a shared G4, say)
  belongs to :data:`~.tenants.RECOVERED_TENANT`, held to the quota of an unnamed tenant.

:meth:`Offload.register_and_offer` is the one way blocks enter a pool of ours and start down
the tiers: the planner's ``register`` verbs, an offload copy that arrived
(:meth:`Offload.finish`) and an onboard copy that arrived all use it.

:meth:`Offload.finish` handles a copy's result: blocks that arrived are registered in the
target and offered further down; failed ones go back to the free list; a source found bad is
dropped; a copy made from a block quarantined meanwhile is not registered.
"""

from __future__ import annotations

from collections import deque
from typing import Mapping, Sequence

from ..logical.handles import ImmutableBlocks, MutableBlocks
from ..logical.pool import BlockPool, PoolExhaustedError
from ..protocol.results import TransferResult
from ..types import BlockRecord
from .state import Job, PlacementState
from .tenants import RECOVERED_TENANT

__all__ = ["Offload", "allocate_up_to"]


def _owner_of(sequence_hash: int, known: Mapping[int, str | None] | None, ledger) -> str:
    """The tenant of a block registered without one: ``known``'s, else the one a tier knows
    it by, else :data:`~.tenants.RECOVERED_TENANT` (learned from a shared G4, recovered by a
    durable G3: no tier kept its tenant)."""
    owner = known.get(sequence_hash) if known else None
    if owner is None:
        owner = ledger.owner(sequence_hash)
    return RECOVERED_TENANT if owner is None else owner


def allocate_up_to(pool: BlockPool, count: int) -> MutableBlocks | None:
    """Up to ``count`` blocks of ``pool`` (fewer if it cannot free more); None if none."""
    try:
        return pool.allocate(count)
    except PoolExhaustedError as exc:
        if exc.available <= 0:
            return None
        return pool.allocate(min(count, exc.available))


class Offload:
    """The offload half of the planner (see the module docstring)."""

    def __init__(self, state: PlacementState) -> None:
        self.state = state
        self._deferred: dict[str, deque[tuple[str, list[BlockRecord], str | None]]] = {
            t: deque() for t in state.tiers}

    def register_and_offer(self, pool: BlockPool, blocks: MutableBlocks,
                           priority: int = 0, tenant: str | None = None,
                           known: Mapping[int, str | None] | None = None) -> ImmutableBlocks:
        """Register ``blocks`` (Complete, of ``pool``; consumed) for ``tenant`` and offer the
        newly stored ones to the tier below. Returns handles on the registered blocks (a
        hash already held dedups onto the existing block, which is not offered again); if
        the offer raises, they are released first, so nothing stays held. With quotas, new
        blocks beyond their tenant's quota of the tier (after it evicted its own) are given
        back, not registered; with ``tenant`` None, each block's tenant is the one ``known``
        names (read by the caller before its other copies could be dropped), else the one
        another tier knows it by (a block loaded up the tiers), else
        :data:`~.tenants.RECOVERED_TENANT`: with a ledger no block is stored unowned."""
        ledger = self.state.tenants
        owners: list[str | None] = [tenant] * len(blocks)
        if ledger is not None:
            if tenant is None:
                owners = [_owner_of(b.sequence_hash, known, ledger) for b in blocks.blocks]
            blocks, owners = self._within_quota(pool, blocks, owners)
        before = blocks.block_ids
        registered = pool.register(blocks, priority)
        new = [(b.record(), owner) for b, slot, owner
               in zip(registered.blocks, before, owners) if b.block_id == slot]
        try:
            by_tenant: dict[str | None, list[BlockRecord]] = {}
            for record, owner in new:
                by_tenant.setdefault(owner, []).append(record)
            for owner, records in by_tenant.items():
                if ledger is not None:
                    ledger.stored(pool.tier, records, owner)
                self.offer(pool.tier, records, tenant=owner)
        except BaseException:
            pool.release(registered)
            raise
        return registered

    def _within_quota(self, pool: BlockPool, blocks: MutableBlocks,
                      owners: list[str | None]) -> tuple[MutableBlocks, list[str | None]]:
        """``blocks`` (and their owners) less the new ones their tenant has no room for in
        ``pool``'s tier (given back, counted as skipped for ``quota``)."""
        ledger = self.state.tenants
        assert ledger is not None
        views = blocks.blocks                     # built once: a property makes a list
        hashes = [b.sequence_hash for b in views]
        protect = set(hashes) | {b.parent_hash for b in views}
        wanted: dict[str, list[int]] = {}
        seen: set[int] = set()
        for i, (h, owner) in enumerate(zip(hashes, owners)):
            if owner is not None and h not in pool and h not in seen:   # new, counted once
                seen.add(h)
                wanted.setdefault(owner, []).append(i)
        keep = [True] * len(owners)
        for owner, positions in wanted.items():
            allowed = ledger.room(pool, owner, len(positions), protect)
            for i in positions[allowed:]:
                keep[i] = False
        if all(keep):
            return blocks, owners
        self.state.skipped(pool.tier, "quota", keep.count(False))
        kept, refused = blocks.split(keep)
        if refused is not None:
            pool.release(refused)
        if kept is None:
            return MutableBlocks(pool, []), []
        return kept, [o for o, k in zip(owners, keep) if k]

    def offer(self, source_tier: str, records: Sequence[BlockRecord],
              engine_ids: Sequence[int] | None = None, tenant: str | None = None) -> None:
        """Offer blocks of ``tenant`` (None: unknown; with quotas,
        :data:`~.tenants.RECOVERED_TENANT`) newly registered in ``source_tier`` (held by the
        engine's blocks ``engine_ids`` when the engine owns that tier) to the next tier
        down."""
        state = self.state
        target = state.below(source_tier)
        if target is None or not records:
            return
        if tenant is None and state.tenants is not None:
            tenant = RECOVERED_TENANT           # never stored unowned where quotas apply
        pool, receiving = state.pools[target], state.receiving[target]
        bad_source, bad_target = state.quarantine[source_tier], state.quarantine[target]
        seen: set[int] = set()
        offered: list[int] = []
        for i, record in enumerate(records):
            h = record.sequence_hash
            # A quarantined target block counts as absent: it is dropped once idle, and a
            # good copy offered meanwhile dedups onto it harmlessly when registered.
            if (h in pool and h not in bad_target) or h in receiving or h in seen \
                    or h in bad_source:
                continue
            seen.add(h)
            offered.append(i)
        admitted = [offered[k] for k in state.admitted(target, [records[i] for i in offered])]
        if not admitted:
            return
        chosen = [records[i] for i in admitted]
        receiving.update(r.sequence_hash for r in chosen)
        ids = None if engine_ids is None else [engine_ids[i] for i in admitted]
        self._copy(source_tier, target, chosen, ids, tenant)

    def _copy(self, source_tier: str, target: str, records: list[BlockRecord],
              engine_ids: list[int] | None, tenant: str | None, *,
              oldest: bool = False) -> None:
        """Plan the copy of ``records`` (already marked as receiving) as far as ``tenant``'s
        quota and target slots allow now; defer or skip the rest (at the front of the queue
        if ``records`` were the oldest deferred batch, so deferred blocks keep their order)."""
        state = self.state
        pool = state.pools[target]
        if state.tenants is not None and tenant is not None:
            records, engine_ids = self._within_tenant_quota(target, records, engine_ids, tenant)
            if not records:
                return
        slots = allocate_up_to(pool, len(records))
        got = len(slots) if slots is not None else 0
        if got < len(records):
            rest = records[got:]
            if engine_ids is None and (got or state.jobs):
                # Copies in flight (this one included) hold the slots; retried as they finish.
                queue = self._deferred[target]
                (queue.appendleft if oldest else queue.append)((source_tier, rest, tenant))
                state.waiting += 1
                state.announce_pending()
            else:
                state.receiving[target].difference_update(r.sequence_hash for r in rest)
                state.skipped(target, "no_slot", len(rest))
        if slots is None:
            return
        records = records[:got]
        slots.apply_token_blocks(records)
        if engine_ids is None:
            source = state.pools[source_tier].acquire([r.sequence_hash for r in records])
            assert len(source) == len(records), f"offload source {source_tier} lost blocks"
            state.new_job(source_tier, target, records, source=source, target=slots,
                          tenant=tenant)
        else:
            state.new_job(source_tier, target, records, engine_src=engine_ids[:got],
                          target=slots, tenant=tenant)

    def _within_tenant_quota(self, target: str, records: list[BlockRecord],
                             engine_ids: list[int] | None, tenant: str
                             ) -> tuple[list[BlockRecord], list[int] | None]:
        """The records (and engine ids) of ``tenant`` its quota of ``target`` has room for,
        after it evicted its own; the rest are no longer receiving and count as skipped for
        ``quota``. A tenant already at its quota is refused first the blocks whose parent
        kvstrata holds in no tier and the target is not receiving: each could only be stored
        by evicting a reachable block, to be unreachable itself."""
        state, ledger = self.state, self.state.tenants
        assert ledger is not None
        pool, receiving = state.pools[target], state.receiving[target]
        keep = list(range(len(records)))
        if ledger.over(target, tenant, 0) >= 0:           # at its quota already
            held_anywhere = state.pools.values()
            orphans: set[int] = set()
            keep = []
            for i, r in enumerate(records):
                p = r.parent_hash
                if p is not None and (p in orphans or (
                        p not in receiving and not any(p in q for q in held_anywhere))):
                    orphans.add(r.sequence_hash)
                else:
                    keep.append(i)
            ledger.refuse(target, tenant, len(orphans))
        protect = {r.sequence_hash for r in records} | {r.parent_hash for r in records}
        allowed = ledger.room(pool, tenant, len(keep), protect)
        kept = keep[:allowed]
        if len(kept) == len(records):
            return records, engine_ids
        chosen = set(kept)
        receiving.difference_update(r.sequence_hash for i, r in enumerate(records)
                                    if i not in chosen)
        state.skipped(target, "quota", len(records) - len(kept))
        return ([records[i] for i in kept],
                None if engine_ids is None else [engine_ids[i] for i in kept])

    def finish(self, job: Job, good: MutableBlocks | None, bad: MutableBlocks | None,
               result: TransferResult) -> None:
        """Settle an offload copy: register what arrived (and offer it further down), give
        back what failed, drop sources found bad."""
        state = self.state
        target = state.pools[job.dst_tier]
        state.receiving[job.dst_tier].difference_update(r.sequence_hash for r in job.records)
        if bad is not None:
            target.release(bad)
        good = state.without_tainted(job, good)
        if job.source is not None:
            job.source.pool.release(job.source)
            broken = [job.records[f.position].sequence_hash for f in result.failures
                      if f.kind.bad_source]
            if broken:   # the source's bytes failed their check: drop them where they live
                state.drop(job.src_tier, broken)
        if good is not None:
            target.release(self.register_and_offer(target, good, tenant=job.tenant))

    def retry_deferred(self) -> None:
        """Offer deferred blocks again, oldest first, while their target has free slots."""
        state = self.state
        if not state.waiting:
            return
        for target, deferred in self._deferred.items():
            while deferred:
                source_tier, records, tenant = deferred[0]
                source, bad = state.pools[source_tier], state.quarantine[source_tier]
                live = [r for r in records if r.sequence_hash in source
                        and r.sequence_hash not in bad]
                stuck = bool(live) and not state.pools[target].can_allocate(1)
                if stuck and state.jobs:
                    break                      # a copy in flight will free a slot
                deferred.popleft()
                state.waiting -= 1
                kept = set() if stuck else {r.sequence_hash for r in live}
                state.receiving[target].difference_update(
                    r.sequence_hash for r in records if r.sequence_hash not in kept)
                state.skipped(target, "evicted", len(records) - len(live))
                if stuck:                      # nothing in flight can free one: give up
                    state.skipped(target, "no_slot", len(live))
                elif live:
                    self._copy(source_tier, target, live, None, tenant, oldest=True)
        state.announce_pending()
