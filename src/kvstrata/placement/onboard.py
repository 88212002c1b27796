"""Onboarding: bringing the longest held prefix of a request into the top tier.

:meth:`Onboarding.prepare` opens a *ticket* for a request's block hashes and plans the copies
it needs; the ticket finishes when every copy's result came back, and its
:class:`OnboardResult` then waits in :attr:`Onboarding.finished` for the driver to take.

* **kvstrata owns the top tier** (one process: the replay, ``KvBlockManager``): the prefix is
  found across all tiers; blocks already there are held while the rest is copied from the
  fastest lower tier holding each, into freshly allocated top-tier slots (if the top tier
  cannot give that many slots, the prefix is cut to the longest it can hold at once, its
  blocks already there past that point left free to make room). A block another ticket is already
  copying is waited for, not copied twice. The result holds the top-tier blocks of the
  verified prefix.
* **the engine owns the top tier** (a connector): the caller names the engine's block ids to
  fill, one per hash; the prefix is found in the lower tiers only and copied into those ids.
  Nothing of the engine's is allocated, evicted or shared between requests.

Either way the source blocks are held until their copy's result, a block whose load failed is
dropped from its tier (or quarantined while in use) and reported, and the delivered prefix
stops before the first failed block, so wrong bytes are never handed back. With kvstrata's
own top tier, blocks loaded from a tier below the second are then offered to the second
(write-through, through the offload). With the engine's, they are not: the engine may free
or reuse its blocks as soon as the load is done (an aborted request, a load whose first block
failed), so the planner never reads an engine block it was not handed for an offload; the
driver offers the loaded blocks while it knows they are live (the vLLM connector offers every
full block of a request it schedules).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..logical.handles import ImmutableBlocks, MutableBlocks
from ..protocol.results import FailureKind, TransferResult
from ..types import BlockRecord
from .offload import Offload, allocate_up_to
from .state import Job, PlacementState

__all__ = ["LoadFailure", "OnboardResult", "Ticket", "Onboarding"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadFailure:
    """One block an onboard could not load: its hash, the tier it was read from, why."""

    sequence_hash: int
    tier: str
    kind: str
    detail: str = ""


class OnboardResult:
    """What one onboard delivered.

    * :attr:`sequence_hashes` -- the verified prefix of the request, in order (``len(result)``
      blocks); :attr:`sources` -- per block, the tier its bytes came from (the top tier's name
      if they were already there);
    * :attr:`block_ids` -- top-tier block ids holding them (kvstrata's slots, or the engine's
      ids it was asked to fill);
    * :attr:`blocks` -- when kvstrata owns the top tier, handles on those blocks (None
      otherwise);
    * :attr:`failures` / :attr:`failed` -- blocks whose load failed (dropped from their tier;
      the engine must recompute them); the prefix stops at the first of them.

    Give the blocks back with :meth:`release` (or a ``with`` block).
    """

    __slots__ = ("ticket", "sequence_hashes", "sources", "failures", "requested", "blocks",
                 "_block_ids", "_release")

    def __init__(self, ticket: int, sequence_hashes: Sequence[int], sources: Sequence[str],
                 failures: Sequence[LoadFailure], requested: int, *,
                 blocks: ImmutableBlocks | None = None, block_ids: Sequence[int] = (),
                 release: Callable[[ImmutableBlocks], object] | None = None) -> None:
        self.ticket = ticket
        self.sequence_hashes = list(sequence_hashes)
        self.sources = tuple(sources)
        self.failures = tuple(failures)
        self.requested = requested
        self.blocks = blocks
        self._block_ids = list(block_ids)
        self._release = release

    @property
    def block_ids(self) -> list[int]:
        """Top-tier block ids of the prefix."""
        return self.blocks.block_ids if self.blocks is not None else list(self._block_ids)

    @property
    def failed(self) -> list[int]:
        """Sequence hashes whose load failed."""
        return [f.sequence_hash for f in self.failures]

    def __len__(self) -> int:
        return len(self.sources)

    def release(self) -> object:
        """Return the top-tier blocks (owned mode); idempotent, a no-op otherwise."""
        if self.blocks is None or self.blocks.released or self._release is None:
            return None
        return self._release(self.blocks)

    def __enter__(self) -> "OnboardResult":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return (f"OnboardResult({len(self)}/{self.requested} blocks, sources={self.sources}, "
                f"failed={self.failed})")


@dataclass(eq=False)
class Ticket:
    """One onboard in progress."""

    id: int
    requested: int
    plan: list[tuple[int, str, "Ticket | None"]]
    """Per block of the prefix: (hash, tier serving it, another ticket copying it or None)."""
    engine_ids: list[int] | None = None
    """The engine's block ids to fill, per position (engine-owned top tier only)."""
    pending: int = 0
    loaded: set[int] = field(default_factory=set)
    failures: dict[int, LoadFailure] = field(default_factory=dict)
    holds: list[ImmutableBlocks] = field(default_factory=list)
    waiters: list["Ticket"] = field(default_factory=list)
    copying: list[int] = field(default_factory=list)


class Onboarding:
    """The onboard half of the planner (see the module docstring)."""

    def __init__(self, state: PlacementState, offload: Offload,
                 release: Callable[[ImmutableBlocks], object]) -> None:
        self.state = state
        self.offload = offload
        self._release = release
        self._copying: dict[int, tuple[Ticket, str]] = {}
        """Owned top tier: hash -> (ticket copying it there, its source tier)."""
        self._next = 1
        self.finished: list[OnboardResult] = []

    def _ticket(self, hashes: Sequence[int], plan, engine_ids=None) -> Ticket:
        ticket = Ticket(self._next, len(hashes), plan, engine_ids)
        self._next += 1
        return ticket

    # -- kvstrata owns the top tier --------------------------------------------------------
    def prepare_owned(self, hashes: Sequence[int]) -> int:
        state = self.state
        top = state.top
        g1 = state.pools[top]
        lower = state.tiers[1:]
        plan: list[tuple[int, str, Ticket | None]] = []
        resident: list[int] = []
        copies = 0
        bad = state.quarantine[top]
        for h in hashes:
            if h in g1:
                if h in bad:     # found bad while in use: never served, and a good copy
                    break        # would only dedup onto it until it is dropped
                plan.append((h, top, None))
                resident.append(h)
                continue
            copying = self._copying.get(h)
            if copying is not None:
                plan.append((h, copying[1], copying[0]))
                continue
            tier = state.holder(h, lower)
            if tier is None:
                break
            plan.append((h, tier, None))
            copies += 1
        ticket = self._ticket(hashes, plan)
        if len(resident) == len(plan):          # all in the top tier already: no copy
            self._finalize(ticket)
            return ticket.id
        hold = g1.acquire(resident) if resident else None
        if copies and not g1.can_allocate(copies):
            # The top tier cannot take every copy while the plan's resident blocks are held.
            # Those past where the plan must end would take slots its first copies need (a
            # prompt longer than the top tier, whose tail is still there and whose head is
            # not, got nothing): plan again to what fits with them free to go, before any
            # slot is taken.
            if hold is not None:
                g1.release(hold)
            ticket.plan = plan = _fitting(plan, g1, top)
            resident = [h for h, tier, _ in plan if tier == top]
            copies = sum(tier != top and other is None for _, tier, other in plan)
            hold = g1.acquire(resident) if resident else None
        targets = allocate_up_to(g1, copies) if copies else None
        budget = len(targets) if targets is not None else 0
        if budget < copies:
            ticket.plan = plan = _cut_copies(plan, budget, top)
        if hold is not None:
            ticket.holds.append(hold)
        by_tier: dict[str, list[BlockRecord]] = {}
        for h, tier, other in plan:
            if tier != top and other is None:
                by_tier.setdefault(tier, []).append(state.pools[tier].lookup(h).record())
        waits = {id(o): o for _, _, o in plan if o is not None}
        ticket.pending = len(by_tier) + len(waits)
        for other in waits.values():
            other.waiters.append(ticket)
        remaining = targets
        for tier in lower:
            records = by_tier.get(tier)
            if not records:
                continue
            assert remaining is not None
            part, remaining = remaining.split([i < len(records) for i in range(len(remaining))])
            source = state.pools[tier].match([r.sequence_hash for r in records])
            assert len(source) == len(records), f"onboard source {tier} lost blocks"
            part.apply_token_blocks(records)
            for r in records:
                self._copying[r.sequence_hash] = (ticket, tier)
                ticket.copying.append(r.sequence_hash)
            state.new_job(tier, top, records, source=source, target=part, ticket=ticket)
        if ticket.pending == 0:
            self._finalize(ticket)
        return ticket.id

    # -- the engine owns the top tier ------------------------------------------------------
    def prepare_external(self, hashes: Sequence[int], engine_ids: Sequence[int]) -> int:
        state = self.state
        lower = state.tiers[1:]
        plan: list[tuple[int, str, Ticket | None]] = []
        for h in hashes:
            tier = state.holder(h, lower)
            if tier is None:
                break
            plan.append((h, tier, None))
        ticket = self._ticket(hashes, plan, list(engine_ids[:len(plan)]))
        positions: dict[str, list[int]] = {}
        for pos, (_, tier, _) in enumerate(plan):
            positions.setdefault(tier, []).append(pos)
        ticket.pending = len(positions)
        for tier in lower:
            mine = positions.get(tier)
            if not mine:
                continue
            pool = state.pools[tier]
            records = [pool.lookup(plan[p][0]).record() for p in mine]
            source = pool.match([r.sequence_hash for r in records])
            assert len(source) == len(records), f"onboard source {tier} lost blocks"
            state.new_job(tier, state.top, records, source=source,
                          engine_dst=[ticket.engine_ids[p] for p in mine], ticket=ticket)
        if ticket.pending == 0:
            self._finalize(ticket)
        return ticket.id

    # -- results ---------------------------------------------------------------------------
    def finish(self, job: Job, good: MutableBlocks | None, bad: MutableBlocks | None,
               result: TransferResult) -> None:
        """Settle one onboard copy: register (owned) or note what arrived, drop and report
        what failed, and finish the ticket once it has nothing left to wait for."""
        state, ticket = self.state, job.ticket
        assert ticket is not None
        ledger = state.tenants
        # whose the copied blocks are, read now: dropping a failed source below takes its
        # descendants there (good blocks of this very copy) and their ownership with them
        owners = None if ledger is None or good is None else {
            r.sequence_hash: ledger.owner(r.sequence_hash) for r in job.records}
        failed = _failures_by_position(job, result)
        tainted = state.quarantine[job.src_tier]
        for pos, record in enumerate(job.records) if tainted else ():
            if pos not in failed and record.sequence_hash in tainted:   # not delivered
                failed[pos] = LoadFailure(record.sequence_hash, job.src_tier,
                                          FailureKind.CHECKSUM_MISMATCH.value,
                                          "source found bad while it was copied")
        good = state.without_tainted(job, good)
        if bad is not None:
            bad.pool.release(bad)
        if job.source is not None:
            job.source.pool.release(job.source)
        loaded_positions = []
        for pos, record in enumerate(job.records):
            if pos in failed:
                ticket.failures[record.sequence_hash] = failed[pos]
            else:
                ticket.loaded.add(record.sequence_hash)
                loaded_positions.append(pos)
        drop = [f.sequence_hash for f in failed.values() if _drops_source(f.kind)]
        if drop:
            state.drop(job.src_tier, drop)
        if good is not None:   # registered in the top tier; offered on to the second
            ticket.holds.append(self.offload.register_and_offer(good.pool, good,
                                                                known=owners))
        if ledger is not None and loaded_positions:
            ledger.used(job.src_tier, (job.records[p].sequence_hash
                                       for p in loaded_positions))
        job.settled = True
        self._count_down(ticket)

    def abandon(self, job: Job, exc: BaseException) -> None:
        """Handling ``job``'s result failed part-way (a bug): its blocks not yet accounted
        for fail with kind ``internal`` and its ticket moves on."""
        ticket = job.ticket
        if ticket is None or job.settled:
            return
        job.settled = True
        for record in job.records:
            h = record.sequence_hash
            if h not in ticket.loaded and h not in ticket.failures:
                ticket.failures[h] = LoadFailure(h, job.src_tier, FailureKind.INTERNAL.value,
                                                 f"completion handling failed: {exc!r}")
        self._count_down(ticket)

    def _count_down(self, ticket: Ticket) -> None:
        ticket.pending -= 1
        if ticket.pending == 0:
            self._finalize(ticket)

    def _finalize(self, ticket: Ticket) -> None:
        """Deliver ``ticket``'s result (every copy and awaited ticket done), then settle the
        tickets waiting for it. Whatever goes wrong, holds are released and waiters settled."""
        for h in ticket.copying:
            if self._copying.get(h, (None,))[0] is ticket:
                del self._copying[h]
        try:
            result = (self._owned_result(ticket) if ticket.engine_ids is None
                      else self._external_result(ticket))
            self.finished.append(result)
            for listener in self.state.listeners:
                listener.onboarded(result.requested, result.sources)
        except Exception:
            log.exception("kvstrata onboard %d could not be finalized", ticket.id)
            self.finished.append(OnboardResult(ticket.id, (), (), [
                LoadFailure(h, tier, FailureKind.INTERNAL.value, "onboard could not be finalized")
                for h, tier, _ in ticket.plan], ticket.requested))
        finally:
            for waiter in ticket.waiters:
                self._settle_waiter(waiter, ticket)
            for hold in ticket.holds:
                self.state.release_quietly(hold)
            ticket.holds.clear()

    def _owned_result(self, ticket: Ticket) -> OnboardResult:
        state = self.state
        g1, bad = state.pools[state.top], state.quarantine[state.top]
        prefix: list[int] = []
        sources: list[str] = []
        failures = list(ticket.failures.values())
        for h, tier, other in ticket.plan:
            if other is not None and h in other.failures:
                failures.append(other.failures[h])
            if h not in g1 or h in bad or h in ticket.failures \
                    or (other is not None and h in other.failures):
                break
            prefix.append(h)
            sources.append(tier)
        handle = g1.match(prefix)
        n = len(handle)
        return OnboardResult(ticket.id, prefix[:n], sources[:n], failures, ticket.requested,
                             blocks=handle, release=self._release)

    @staticmethod
    def _external_result(ticket: Ticket) -> OnboardResult:
        n = 0
        for h, _, _ in ticket.plan:
            if h not in ticket.loaded or h in ticket.failures:
                break
            n += 1
        return OnboardResult(ticket.id, [h for h, _, _ in ticket.plan[:n]],
                             [tier for _, tier, _ in ticket.plan[:n]],
                             list(ticket.failures.values()), ticket.requested,
                             block_ids=(ticket.engine_ids or [])[:n])

    def _settle_waiter(self, waiter: Ticket, ticket: Ticket) -> None:
        """``ticket``, which ``waiter`` waited for, is done: hold what it loaded for the
        waiter until the waiter finishes too, and finish the waiter if that was its last
        wait."""
        g1 = self.state.pools[self.state.top]
        try:
            mine = [h for h, _, other in waiter.plan
                    if other is ticket and h in ticket.loaded and h in g1]
            if mine:
                waiter.holds.append(g1.acquire(mine))
        except Exception:
            log.exception("kvstrata onboard: could not hold blocks for a waiting request")
        self._count_down(waiter)


def _drops_source(kind: str) -> bool:
    """A read that failed this way means the block is bad (or unreadable) where it lives."""
    kind = FailureKind(kind)
    return kind.bad_source or kind is FailureKind.IO_ERROR


def _failures_by_position(job: Job, result: TransferResult) -> dict[int, LoadFailure]:
    records, tier = job.records, job.src_tier
    out = {f.position: LoadFailure(records[f.position].sequence_hash, tier, f.kind.value,
                                   f.detail) for f in result.failures}
    for p, good in enumerate(result.ok):   # a failed block without a failure record
        if not good and p not in out:
            out[p] = LoadFailure(records[p].sequence_hash, tier, FailureKind.INTERNAL.value,
                                 result.error or "")
    return out


def _fitting(plan: list[tuple[int, str, "Ticket | None"]], pool, top: str
             ) -> list[tuple[int, str, "Ticket | None"]]:
    """The longest prefix of ``plan`` the top tier ``pool`` can hold at once: a copy takes
    a slot, and so does holding a block already there that eviction could otherwise take
    (:meth:`~kvstrata.logical.pool.BlockPool.reachable`); a block another ticket copies
    takes none here."""
    room = pool.allocatable()
    reachable = iter(pool.reachable([h for h, tier, _ in plan if tier == top]))
    for end, (_, tier, other) in enumerate(plan):
        if tier == top:
            need = 1 if next(reachable) else 0
        else:
            need = 1 if other is None else 0
        if need > room:
            return plan[:end]
        room -= need
    return plan


def _cut_copies(plan: list[tuple[int, str, "Ticket | None"]], budget: int, top: str
                ) -> list[tuple[int, str, "Ticket | None"]]:
    """Cut ``plan`` before the copy that would exceed ``budget`` free top-tier slots."""
    out = []
    for entry in plan:
        if entry[1] != top and entry[2] is None:
            if budget == 0:
                break
            budget -= 1
        out.append(entry)
    return out
