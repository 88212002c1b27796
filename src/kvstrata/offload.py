"""Offload (write-through cascade) and onboard orchestration between tier pools and storages.

A :class:`TransferCoordinator` joins the logical pools (which block ids hold which hash) and the
physical transfer engine (which copies bytes). It is driven by exactly one thread, the pool
owner (the manager's owner thread, DESIGN.md "one owner per pool"): every method here is
called on it, and the only thing other threads do is finish transfer futures, whose callbacks
post a :class:`Completion` back to the owner through ``post``.

**Offload** (:meth:`TransferCoordinator.offload`): blocks newly registered in tier *k* are
offered to tier *k+1*. Blocks the target holds, or is already receiving, are skipped; the
target's admission policy filters the rest. Target slots are allocated as ``MutableBlocks``
(a full target evicts by its policy; if every slot is held by transfers in flight, the surplus
is deferred and offered again as completions free slots -- nobody waits), made Complete with
``apply_token_blocks``, and a
``TransferPlan`` is submitted. The source blocks are held (a ``match`` handle) until the copy
completes, so they cannot be evicted or reused mid-copy. On completion the blocks that copied
without error are registered in the target (and offered further down); the others go back to
the free list.

**Onboard** (:meth:`TransferCoordinator.start_onboard`): the longest prefix held anywhere is
brought into G1 -- from G2, or straight from G3 -- and handed back as one ``ImmutableBlocks``
handle of the G1 pool inside an :class:`OnboardResult`. Blocks already in G1 are held while the
rest is copied; a block another onboard is already copying is waited for, not copied twice.
Reads are verified by the physical layer (always from G3, from G2 when the host storage has
``verify_reads``). A block that fails (checksum mismatch, I/O error) is dropped from its tier
and reported in :attr:`OnboardResult.failures`; the result stops at the first failed block, so
wrong bytes are never handed back.

Nothing here blocks: transfers are submitted with ``timeout=0`` and a busy path's plans wait in
a backlog that drains as that path's completions arrive.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from .logical.handles import ImmutableBlocks, MutableBlocks
from .logical.policy import AdmissionPolicy
from .logical.pool import BlockPool, PoolExhaustedError
from .logical.registry import BlockRecord
from .metrics import ManagerMetrics
from .physical import EngineBusyError, TransferEngine, TransferPlan, TransferResult

__all__ = ["TransferCoordinator", "OnboardResult", "LoadFailure", "PathStats", "Completion",
           "TIER_ORDER"]

log = logging.getLogger(__name__)

TIER_ORDER = ("G1", "G2", "G3")
"""Tiers the manager moves bytes between, fastest first."""

_INTEGRITY_KINDS = {"checksum_mismatch", "hash_mismatch", "not_written"}
_DROP_KINDS = _INTEGRITY_KINDS | {"io_error"}
"""Failure kinds of a read that drop the block from the tier it was read from."""


@dataclass(frozen=True)
class LoadFailure:
    """One block an onboard could not load: its hash, the tier it was read from, why."""

    sequence_hash: int
    tier: str
    kind: str
    detail: str = ""


class OnboardResult:
    """What ``onboard(hashes)`` delivered.

    * :attr:`blocks` -- ``ImmutableBlocks`` of the G1 pool holding the verified prefix of the
      request, in request order (``len(result)`` blocks);
    * :attr:`sources` -- per block, the tier its bytes came from (``"G1"`` if already there);
    * :attr:`failures` / :attr:`failed` -- blocks whose load failed (dropped from their tier;
      the engine must recompute them); the prefix stops at the first of them.

    Give the blocks back with :meth:`release` (or a ``with`` block), which hands them to the
    manager's owner thread; do not call ``blocks.release()`` from another thread.
    """

    __slots__ = ("blocks", "sources", "failures", "requested", "_release")

    def __init__(self, blocks: ImmutableBlocks, sources: Sequence[str],
                 failures: Sequence[LoadFailure], requested: int,
                 release: Callable[[ImmutableBlocks], object]) -> None:
        self.blocks = blocks
        self.sources = tuple(sources)
        self.failures = tuple(failures)
        self.requested = requested
        self._release = release

    @property
    def sequence_hashes(self) -> list[int]:
        return [b.sequence_hash for b in self.blocks]  # type: ignore[misc]

    @property
    def block_ids(self) -> list[int]:
        """G1 block ids (slots of the device storage) of the prefix."""
        return self.blocks.block_ids

    @property
    def failed(self) -> list[int]:
        """Sequence hashes whose load failed."""
        return [f.sequence_hash for f in self.failures]

    def __len__(self) -> int:
        return len(self.sources)

    def release(self) -> object:
        """Return the G1 blocks (through the owner thread); idempotent."""
        if self.blocks.released:
            return None
        return self._release(self.blocks)

    def __enter__(self) -> "OnboardResult":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return (f"OnboardResult({len(self)}/{self.requested} blocks, sources={self.sources}, "
                f"failed={self.failed})")


@dataclass
class PathStats:
    """What moved on one path: blocks and bytes that succeeded, plans, failed blocks, and
    ``busy_seconds`` (sum of the plans' execution times, excluding queueing)."""

    plans: int = 0
    blocks: int = 0
    bytes: int = 0
    failed_blocks: int = 0
    busy_seconds: float = 0.0
    latency_seconds: float = 0.0

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["gb_per_s"] = self.bytes / self.busy_seconds / 1e9 if self.busy_seconds else 0.0
        return d


@dataclass(eq=False)
class _Copy:
    """One submitted (or backlogged) plan and the handles it keeps alive."""

    path: str
    records: list[BlockRecord]
    source: ImmutableBlocks
    target: MutableBlocks
    onboard: "_Onboard | None" = None
    submitted: float = 0.0
    settled: bool = False   # the onboard request has counted this copy as done

    @property
    def src_tier(self) -> str:
        return self.path.split("->")[0]

    @property
    def dst_tier(self) -> str:
        return self.path.split("->")[1]


@dataclass(eq=False)
class _Onboard:
    """One onboard request in progress."""

    future: Future
    requested: int
    plan: list[tuple[int, str, "_Onboard | None"]]  # (hash, source tier, op copying it)
    pending: int = 0
    loaded: set[int] = field(default_factory=set)
    failures: dict[int, LoadFailure] = field(default_factory=dict)
    holds: list[ImmutableBlocks] = field(default_factory=list)
    waiters: list["_Onboard"] = field(default_factory=list)
    copying: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Completion:
    """Posted to the owner when a transfer future finishes (from the worker's thread)."""

    copy: _Copy
    future: Future


def split_blocks(handle: MutableBlocks, keep: Sequence[bool]
                 ) -> tuple[MutableBlocks | None, MutableBlocks | None]:
    """Split a mutable handle into (kept, rest) handles; either may be None."""
    return handle.split(keep)


class TransferCoordinator:
    """Offload and onboard between ``pools`` through ``engine``; owner-thread only.

    ``post(item)`` must hand ``item`` (a :class:`Completion`) back to the owner thread, which
    then calls :meth:`complete`; ``release(handle)`` is what :meth:`OnboardResult.release`
    calls (the manager posts the release to the owner thread).
    """

    def __init__(self, pools: dict[str, BlockPool], admission: dict[str, AdmissionPolicy],
                 engine: TransferEngine, post: Callable[[object], None],
                 metrics: ManagerMetrics, release: Callable[[ImmutableBlocks], object]) -> None:
        self.pools = pools
        self.admission = admission
        self.engine = engine
        self.tiers = [t for t in TIER_ORDER if t in pools]
        self._post = post
        self._release_handle = release
        self.metrics = metrics
        self._receiving: dict[str, set[int]] = {t: set() for t in self.tiers}
        self._onboarding: dict[int, tuple[_Onboard, str]] = {}  # hash -> (op, source tier)
        self._backlog: dict[str, deque[_Copy]] = {}
        self._deferred: dict[str, deque[tuple[str, list[BlockRecord]]]] = {
            t: deque() for t in self.tiers}
        self._quarantine: dict[str, set[int]] = {t: set() for t in self.tiers}
        self._plan_ids = itertools.count()
        self._ops: set[_Onboard] = set()   # onboard requests not yet resolved
        self._pending = 0
        self.stats: dict[str, PathStats] = {}

    @property
    def pending(self) -> int:
        """Copies submitted, backlogged or deferred, and not completed."""
        return self._pending

    @pending.setter
    def pending(self, value: int) -> None:
        # Every change goes through here, so the in-flight gauge never goes stale.
        self._pending = value
        self.metrics.in_flight.set(value)

    @property
    def idle(self) -> bool:
        return self._pending == 0

    # -- queries ---------------------------------------------------------------------------
    def locate(self, hashes: Iterable[int]) -> list[str]:
        """The fastest tier holding each block of the longest prefix held anywhere."""
        out: list[str] = []
        for h in hashes:
            tier = self._holder(h)
            if tier is None:
                break
            out.append(tier)
        return out

    def _holder(self, h: int, lower_only: bool = False) -> str | None:
        for tier in self.tiers[1:] if lower_only else self.tiers:
            if h in self.pools[tier] and h not in self._quarantine[tier]:
                return tier
        return None

    # -- offload ---------------------------------------------------------------------------
    def offload(self, source_tier: str, records: Sequence[BlockRecord]) -> None:
        """Offer blocks newly registered in ``source_tier`` to the next tier down."""
        index = self.tiers.index(source_tier)
        if index + 1 >= len(self.tiers) or not records:
            return
        target = self.tiers[index + 1]
        pool, receiving = self.pools[target], self._receiving[target]
        bad_source = self._quarantine[source_tier]
        bad_target = self._quarantine[target]
        seen: set[int] = set()
        offered: list[BlockRecord] = []
        for record in records:
            h = record.sequence_hash
            # A quarantined target block counts as absent: it is dropped once idle, and a
            # good copy offered meanwhile dedups onto it harmlessly when registered.
            if (h in pool and h not in bad_target) or h in receiving or h in seen \
                    or h in bad_source:
                continue
            seen.add(h)
            offered.append(record)
        admit = self.admission[target].admit
        admitted = [r for r in offered if admit(r.sequence_hash)]
        self.metrics.skip(target, "admission", len(offered) - len(admitted))
        if not admitted:
            return
        receiving.update(r.sequence_hash for r in admitted)
        self._offer(source_tier, target, admitted)

    def _offer(self, source_tier: str, target: str, records: list[BlockRecord]) -> None:
        """Copy ``records`` (already marked as receiving) into ``target`` as far as slots can
        be had now; defer the rest until a completion frees slots (never wait)."""
        target_blocks = self._allocate(self.pools[target], len(records))
        got = len(target_blocks) if target_blocks is not None else 0
        if got < len(records):
            # Every slot is held by a transfer in flight: retried when one completes.
            self._deferred[target].append((source_tier, records[got:]))
            self.pending += 1
        if target_blocks is None:
            return
        records = records[:got]
        source = self.pools[source_tier].match([r.sequence_hash for r in records])
        assert len(source) == len(records), f"offload source {source_tier} lost blocks"
        target_blocks.apply_token_blocks(records)
        self._submit(_Copy(f"{source_tier}->{target}", records, source, target_blocks))

    def _retry_deferred(self) -> None:
        """Offer deferred blocks again, oldest first, while their target has free slots."""
        for target, deferred in self._deferred.items():
            while deferred:
                source_tier, records = deferred[0]
                source = self.pools[source_tier]
                bad = self._quarantine[source_tier]
                live = [r for r in records if r.sequence_hash in source
                        and r.sequence_hash not in bad]
                if live and not self.pools[target].can_allocate(1):
                    break
                deferred.popleft()
                self.pending -= 1
                gone = len(records) - len(live)
                if gone:   # evicted from the source before a slot was free
                    self.metrics.skip(target, "evicted", gone)
                    kept = {r.sequence_hash for r in live}
                    self._receiving[target].difference_update(
                        r.sequence_hash for r in records if r.sequence_hash not in kept)
                if live:
                    self._offer(source_tier, target, live)

    @staticmethod
    def _allocate(pool: BlockPool, count: int) -> MutableBlocks | None:
        """Up to ``count`` blocks (fewer if the pool cannot free more); None if none."""
        try:
            return pool.allocate(count)
        except PoolExhaustedError as exc:
            if exc.available <= 0:
                return None
            return pool.allocate(min(count, exc.available))

    def _finish_offload(self, copy: _Copy, good: MutableBlocks | None,
                        bad: MutableBlocks | None, result: TransferResult | None) -> None:
        target = self.pools[copy.dst_tier]
        source = self.pools[copy.src_tier]
        self._receiving[copy.dst_tier].difference_update(r.sequence_hash for r in copy.records)
        if bad is not None:
            target.release(bad)
        tainted_sources = self._quarantine[copy.src_tier]
        if good is not None and tainted_sources:
            # The source was found bad (quarantined) while this copy ran: its bytes may be
            # wrong, so the copy is not registered. Checked before the source hold is
            # released, which may drop the quarantined block.
            good, tainted = split_blocks(good, [b.sequence_hash not in tainted_sources
                                                for b in good.blocks])
            if tainted is not None:
                target.release(tainted)
        source.release(copy.source)
        if result is not None and copy.src_tier != "G1":
            # A source that failed its read check is bad where it lives: drop it there.
            broken = [copy.records[f.position].sequence_hash for f in result.failures
                      if f.kind.value in _INTEGRITY_KINDS]
            self._drop(copy.src_tier, broken)
        if good is not None:
            before = good.block_ids
            registered = target.register(good)
            new = [b.record() for b, slot in zip(registered.blocks, before) if b.block_id == slot]
            self.offload(copy.dst_tier, new)
            target.release(registered)

    # -- onboard ---------------------------------------------------------------------------
    def start_onboard(self, hashes: Sequence[int], future: Future) -> None:
        """Begin bringing the longest available prefix of ``hashes`` into G1; ``future``
        (already marked running) receives the :class:`OnboardResult`."""
        g1 = self.pools["G1"]
        plan: list[tuple[int, str, _Onboard | None]] = []
        resident: list[int] = []
        copies = 0
        for h in hashes:
            if h in g1:
                plan.append((h, "G1", None))
                resident.append(h)
                continue
            copying = self._onboarding.get(h)
            if copying is not None:
                plan.append((h, copying[1], copying[0]))
                continue
            tier = self._holder(h, lower_only=True)
            if tier is None:
                break
            plan.append((h, tier, None))
            copies += 1
        op = _Onboard(future, len(hashes), plan)
        self._ops.add(op)
        if resident:
            hold = g1.match(resident)
            assert len(hold) == len(resident), "G1 lost resident blocks"
            op.holds.append(hold)
        targets = self._allocate(g1, copies) if copies else None
        if copies and (targets is None or len(targets) < copies):
            op.plan = plan = _truncate_copies(plan, len(targets) if targets else 0)
        by_tier: dict[str, list[BlockRecord]] = {}
        for h, tier, other in plan:
            if tier != "G1" and other is None:
                by_tier.setdefault(tier, []).append(self.pools[tier].lookup(h).record())
        waits = {id(o): o for _, _, o in plan if o is not None}
        op.pending = len(by_tier) + len(waits)
        for other in waits.values():
            other.waiters.append(op)
        remaining = targets
        for tier in ("G2", "G3"):
            records = by_tier.get(tier)
            if not records:
                continue
            part, remaining = split_blocks(remaining, [i < len(records)
                                                       for i in range(len(remaining))])
            source = self.pools[tier].match([r.sequence_hash for r in records])
            assert len(source) == len(records), f"onboard source {tier} lost blocks"
            part.apply_token_blocks(records)
            for r in records:
                self._onboarding[r.sequence_hash] = (op, tier)
                op.copying.append(r.sequence_hash)
            self._submit(_Copy(f"{tier}->G1", records, source, part, op))
        if op.pending == 0:
            self._finalize(op)

    def _finish_onboard_copy(self, copy: _Copy, good: MutableBlocks | None,
                             bad: MutableBlocks | None, result: TransferResult | None) -> None:
        op = copy.onboard
        assert op is not None
        g1, source = self.pools["G1"], self.pools[copy.src_tier]
        if bad is not None:
            g1.release(bad)
        source.release(copy.source)
        failed = _failures_by_position(copy, result)
        for pos, record in enumerate(copy.records):
            if pos in failed:
                op.failures[record.sequence_hash] = failed[pos]
            else:
                op.loaded.add(record.sequence_hash)
        self._drop(copy.src_tier, [f.sequence_hash for f in failed.values()
                                   if f.kind in _DROP_KINDS])
        if good is not None:
            before = good.block_ids
            registered = g1.register(good)
            op.holds.append(registered)
            new = [b.record() for b, slot in zip(registered.blocks, before) if b.block_id == slot]
            self.offload("G1", new)   # blocks straight from G3 also go to G2
        copy.settled = True
        op.pending -= 1
        if op.pending == 0:
            self._finalize(op)

    def _finalize(self, op: _Onboard) -> None:
        """Resolve ``op`` (every copy and awaited request done), then its waiters. Whatever
        goes wrong, the future is resolved, the holds released and the waiters settled."""
        g1 = self.pools["G1"]
        self._ops.discard(op)
        for h in op.copying:
            if self._onboarding.get(h, (None,))[0] is op:
                del self._onboarding[h]
        try:
            prefix: list[int] = []
            sources: list[str] = []
            failures: list[LoadFailure] = list(op.failures.values())
            for h, tier, other in op.plan:
                if other is not None and h in other.failures:
                    failures.append(other.failures[h])
                if h not in g1 or h in op.failures or (other is not None
                                                       and h in other.failures):
                    break
                prefix.append(h)
                sources.append(tier)
            handle = g1.match(prefix)
            del sources[len(handle):]
            result = OnboardResult(handle, sources, failures, op.requested,
                                   self._release_handle)
            if op.future.done():   # already failed (e.g. the request raised): give it back
                g1.release(handle)
            else:
                op.future.set_result(result)
            self.metrics.lookup(op.requested, sources)
        except Exception as exc:
            log.exception("kvstrata onboard could not be finalized")
            if not op.future.done():
                op.future.set_exception(exc)
        finally:
            for waiter in op.waiters:
                self._settle_waiter(waiter, op)
            for hold in op.holds:
                _release_quietly(g1, hold)
            op.holds.clear()

    def _settle_waiter(self, waiter: _Onboard, op: _Onboard) -> None:
        """``op``, which ``waiter`` waited for, is done: hold what it loaded for the waiter
        until the waiter finishes too, and finalize the waiter if that was its last wait."""
        g1 = self.pools["G1"]
        try:
            mine = [h for h, _, other in waiter.plan if other is op and h in op.loaded
                    and h in g1]
            if mine:
                waiter.holds.append(g1.match(mine))
        except Exception:
            log.exception("kvstrata onboard: could not hold blocks for a waiting request")
        waiter.pending -= 1
        if waiter.pending == 0:
            self._finalize(waiter)

    def fail_all(self, error: BaseException) -> None:
        """The owner cannot go on (a bug): fail every onboard request still outstanding."""
        for op in list(self._ops):
            if not op.future.done():
                op.future.set_exception(error)
        self._ops.clear()

    # -- failures --------------------------------------------------------------------------
    def _drop(self, tier: str, hashes: Sequence[int]) -> None:
        """Drop bad blocks from ``tier``; those still in use are quarantined (never served,
        dropped as soon as they are free)."""
        if not hashes and not self._quarantine[tier]:
            return
        pool = self.pools[tier]
        quarantine = self._quarantine[tier]
        wanted = [h for h in itertools.chain(hashes, list(quarantine)) if h in pool]
        dropped = set(pool.reset_blocks(wanted))
        left = [h for h in wanted if h not in dropped]
        if left:
            dropped.update(self._drop_subtrees(pool, left))
        quarantine.clear()
        quarantine.update(h for h in left if h in pool)

    @staticmethod
    def _drop_subtrees(pool: BlockPool, roots: list[int]) -> list[int]:
        """Leaf-first pools keep a block while children are registered: drop each idle
        root with its idle descendants (unreachable anyway: matching needs the prefix)."""
        children: dict[int, list[int]] = {}
        for h in pool.registry.hashes_in(pool.tier):
            block = pool.lookup(h)
            if block is not None and block.parent_id >= 0:
                children.setdefault(block.parent_id, []).append(h)
        order: list[int] = []
        for root in roots:
            block = pool.lookup(root)
            if block is None or block.ref_count:
                continue
            stack, subtree = [root], []
            while stack:
                h = stack.pop()
                subtree.append(h)
                node = pool.lookup(h)
                stack.extend(children.get(node.block_id, ()) if node is not None else ())
            order.extend(reversed(subtree))   # descendants before their parents
        return pool.reset_blocks(order)

    # -- transfers -------------------------------------------------------------------------
    def _submit(self, copy: _Copy) -> None:
        self.pending += 1
        backlog = self._backlog.setdefault(copy.path, deque())
        if backlog or not self._try_submit(copy):
            backlog.append(copy)

    def _try_submit(self, copy: _Copy) -> bool:
        """Hand ``copy`` to the engine; False if its path is busy (the caller backlogs it).
        Any other failure (engine closed, a plan the engine refuses, a bug) becomes a failed
        transfer future, so its :class:`Completion` still settles ``pending`` and releases
        the handles."""
        copy.submitted = time.perf_counter()
        try:
            plan = TransferPlan.for_path(copy.path, copy.source.block_ids, copy.target.block_ids,
                                         [r.sequence_hash for r in copy.records],
                                         job_id=next(self._plan_ids))
            future = self.engine.submit(plan, timeout=0)
        except EngineBusyError:
            return False
        except Exception as exc:   # the copy fails as a whole
            log.warning("transfer %s not submitted: %s", copy.path, exc)
            future = Future()
            future.set_exception(exc)
        future.add_done_callback(lambda f, c=copy: self._post(Completion(c, f)))
        return True

    def complete(self, completion: Completion) -> None:
        """Handle a finished transfer (owner thread).

        Whatever fails in here (a bug), the copy's handles are released, its onboard request
        is settled (the blocks not yet accounted for fail with kind ``"internal"``) and the
        backlog and deferred blocks move on; the error is logged, not raised."""
        copy, future = completion.copy, completion.future
        self.pending -= 1
        handles: list = [copy.source, copy.target]
        try:
            result: TransferResult | None = None
            if not future.cancelled() and future.exception() is None:
                result = future.result()
            ok = result.ok if result is not None else (False,) * len(copy.records)
            good, bad = split_blocks(copy.target, ok)
            handles += [good, bad]
            self._account(copy, result, sum(ok))
            if copy.onboard is not None:
                self._finish_onboard_copy(copy, good, bad, result)
            else:
                self._finish_offload(copy, good, bad, result)
        except Exception as exc:
            log.exception("kvstrata: handling the completion of a %s transfer failed",
                          copy.path)
            self._abandon(copy, handles, exc)
        finally:
            backlog = self._backlog.get(copy.path)
            while backlog and self._try_submit(backlog[0]):
                backlog.popleft()
            if any(self._deferred.values()):
                self._retry_deferred()
            if any(self._quarantine.values()):
                for tier, hashes in self._quarantine.items():
                    if hashes:
                        self._drop(tier, [])

    def _abandon(self, copy: _Copy, handles: list, exc: Exception) -> None:
        """Clean up after a completion whose handling failed part-way."""
        pools = {h.pool.tier: h.pool for h in handles if h is not None}
        for handle in handles:
            if handle is not None and not handle.released:
                _release_quietly(pools[handle.pool.tier], handle)
        self._receiving[copy.dst_tier].difference_update(r.sequence_hash for r in copy.records)
        op = copy.onboard
        if op is None or copy.settled:
            return
        copy.settled = True
        for record in copy.records:
            h = record.sequence_hash
            if h not in op.loaded and h not in op.failures:
                op.failures[h] = LoadFailure(h, copy.src_tier, "internal",
                                             f"completion handling failed: {exc!r}")
        op.pending -= 1
        if op.pending == 0:
            self._finalize(op)

    def _account(self, copy: _Copy, result: TransferResult | None, ok_blocks: int) -> None:
        stats = self.stats.setdefault(copy.path, PathStats())
        latency = time.perf_counter() - copy.submitted
        stats.plans += 1
        stats.blocks += ok_blocks
        stats.failed_blocks += len(copy.records) - ok_blocks
        stats.latency_seconds += latency
        kinds: dict[str, int] = {}
        if result is None:
            kinds["internal"] = len(copy.records)
        else:
            stats.bytes += result.bytes_moved
            stats.busy_seconds += result.seconds
            for f in result.failures:
                kinds[f.kind.value] = kinds.get(f.kind.value, 0) + 1
        self.metrics.transfer_done(copy.path, ok_blocks, result.bytes_moved if result else 0,
                                   latency, kinds.items())


def _release_quietly(pool: BlockPool, handle) -> None:
    """Release ``handle`` on cleanup paths: a failure here is logged, never raised."""
    try:
        if not handle.released:
            pool.release(handle)
    except Exception:
        log.exception("kvstrata: could not release a %s handle", pool.tier)


def _failures_by_position(copy: _Copy, result: TransferResult | None) -> dict[int, LoadFailure]:
    records = copy.records
    if result is None:
        return {p: LoadFailure(r.sequence_hash, copy.src_tier, "internal",
                               "transfer did not run") for p, r in enumerate(records)}
    out = {f.position: LoadFailure(records[f.position].sequence_hash, copy.src_tier,
                                   f.kind.value, f.detail) for f in result.failures}
    for p, good in enumerate(result.ok):   # a failed block without a failure record
        if not good and p not in out:
            out[p] = LoadFailure(records[p].sequence_hash, copy.src_tier, "internal",
                                 result.error or "")
    return out


def _truncate_copies(plan: list[tuple[int, str, "_Onboard | None"]], budget: int
                     ) -> list[tuple[int, str, "_Onboard | None"]]:
    """Cut ``plan`` before the copy that would exceed ``budget`` free G1 slots."""
    out = []
    for entry in plan:
        if entry[1] != "G1" and entry[2] is None:
            if budget == 0:
                break
            budget -= 1
        out.append(entry)
    return out
