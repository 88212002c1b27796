"""The placement planner: every decision about where KV blocks go, in one step-driven object.

:class:`Planner` owns the pools of the configured tiers and decides where blocks go; it has no
threads, no futures and no I/O. Its public verbs, by what a driver does with them:

* **look up** -- :meth:`~Planner.lookup`: the fastest tier holding each block of the longest
  held prefix (side-effect free).
* **onboard** -- :meth:`~Planner.prepare_onboard` opens a ticket that brings that prefix into
  the top tier (kvstrata's own slots, or device block ids an engine supplies);
  :meth:`~Planner.take_finished` collects the :class:`~.onboard.OnboardResult` s of finished
  tickets.
* **offload** (write-through, :mod:`.offload`) -- :meth:`~Planner.register` (computed blocks
  of an owned top tier), :meth:`~Planner.register_fetched` (blocks of a lower tier filled
  from outside), :meth:`~Planner.prepare_offload` (blocks newly stored in a tier, e.g. the
  engine's), :meth:`~Planner.admit` (a tier's admission filter, for blocks an engine
  computed): blocks are offered down the tiers with admission, dedup and deferral.
* **execute** -- :meth:`~Planner.take_plans` hands out the plans made since the last call; an
  *executor* runs them (:mod:`.executors`) and :meth:`~Planner.complete` applies their
  results (register what arrived, drop and quarantine what failed, release holds, offer
  further down, finish onboards); :meth:`~Planner.settle` retries deferred and quarantined
  blocks after handles were released outside the planner.
* **restore / learn** -- :meth:`~Planner.restore` (blocks a durable tier recovered at start),
  :meth:`~Planner.learn` (blocks other workers put in a shared key-addressed tier).
* **observe** -- :attr:`~Planner.stats`, :attr:`~Planner.costs`, :attr:`~Planner.tenants`,
  :attr:`~Planner.pending`,
  :attr:`~Planner.idle`, :meth:`~Planner.quarantined`, :meth:`~Planner.engine_blocks_in_use`,
  and what it manages: :attr:`~Planner.tiers`, :attr:`~Planner.top`, :attr:`~Planner.pools`,
  :attr:`~Planner.registry`.

The metadata replay drives it with an executor that completes every plan at once;
``KvBlockManager`` from its owner thread over the in-process transfer engine; an engine
connector from its scheduler step over its workers. Every method must be called from one
thread (the pools' owner). Results and engine block ids are checked before anything changes
(:mod:`.checks`).

**Two top-tier modes.** *Owned* (``engine_owns_top=False``): the top tier (G1) is a kvstrata
pool like the others; onboards allocate its slots, :meth:`~Planner.register` adds computed
blocks. *External* (``engine_owns_top=True``): an engine allocates G1 and runs its own prefix
cache; the planner keeps pools for the lower tiers only, reads the engine's block ids it is
given for an offload and fills those it is given for an onboard, and never allocates, evicts
or reuses an engine block. :meth:`~Planner.engine_blocks_in_use` names the engine blocks
copies in flight still read or write.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable, Sequence

from ..config import KvConfig, tenant_problem
from ..logical.admission import AdmissionPolicy
from ..logical.handles import ImmutableBlocks, MutableBlocks
from ..logical.policy import make_tier_policies
from ..logical.pool import BlockPool
from ..logical.registry import BlockRegistry
from ..protocol.plans import TransferPlan
from ..protocol.results import TransferResult
from ..tiers import Addressing, ordered, spec
from ..types import BlockRecord, first_bad_record
from .checks import PlacementError, check_results, engine_ids
from .costs import CostModel
from .keys import block_key, chain_consistent
from .offload import Offload, allocate_up_to
from .onboard import OnboardResult, Onboarding
from .state import Job, PlacementState
from .telemetry import PlacementListener, PlacementStats
from .tenants import RECOVERED_TENANT, TenantLedger

__all__ = ["Planner", "PlacementError"]

log = logging.getLogger(__name__)


def _tenant(tenant: object) -> str:
    """A store verb's ``tenant``, checked (``PlacementError``)."""
    problem = tenant_problem(tenant)
    if problem:
        raise PlacementError(problem)
    return tenant  # type: ignore[return-value]


def _release_handle(handle: ImmutableBlocks) -> None:
    if not handle.released:
        handle.pool.release(handle)


class Planner:
    """Placement decisions for one worker's tiers (see the module docstring).

    ``config`` gives the tiers, capacities and policies. ``registry`` is shared by the pools
    (a fresh one by default). ``worker`` names this worker in plan endpoints; ``key_of``
    turns a block's record into its key in a key-addressed tier (:mod:`.keys`). ``listeners``
    hear about completed copies, skipped blocks and finished onboards (:class:`PlacementListener`);
    :attr:`stats` is always one of them. ``release`` is what :meth:`OnboardResult.release`
    calls with the result's top-tier handle (default: release it here, on the caller's
    thread; a threaded owner passes a function that posts it to itself). ``costs`` is the
    :class:`~.costs.CostModel` to teach with every completed copy (a driver whose plans
    move real bytes passes one); None: no costs are learned (a metadata replay).
    """

    def __init__(self, config: KvConfig, *, registry: BlockRegistry | None = None,
                 engine_owns_top: bool = False, worker: int = 0,
                 key_of: Callable[[BlockRecord], str] = block_key,
                 listeners: Iterable[PlacementListener] = (),
                 release: Callable[[ImmutableBlocks], object] | None = None,
                 costs: CostModel | None = None) -> None:
        config.validate()
        self.registry = registry if registry is not None else BlockRegistry()
        tiers = ordered(config.tiers)
        pools: dict[str, BlockPool] = {}
        admission: dict[str, AdmissionPolicy] = {}
        self._request_observers: list[Callable[[Sequence[int]], None]] = []
        for index, name in enumerate(tiers):
            capacity = config.tier_blocks(name)
            policies = make_tier_policies(config.tier_eviction(name),
                                          config.tier_admission(name), capacity)
            admission[name] = policies.admission
            if policies.observe_request is not None:
                self._request_observers.append(policies.observe_request)
            if index == 0 and engine_owns_top:
                continue                      # the engine's blocks: no pool of ours
            pools[name] = BlockPool(name, capacity, config.block_size,
                                    eviction=policies.eviction, registry=self.registry,
                                    keep_tokens=config.keep_tokens)
        limits = {name: config.tenant_limits(name) for name in pools if name != tiers[0]}
        tenants = None
        if any(default is not None or named for default, named in limits.values()):
            tenants = TenantLedger(limits)
            self.registry.add_observer(tenants)
        self._state = PlacementState(tiers, pools, admission, engine_owns_top=engine_owns_top,
                                     worker=worker, key_of=key_of, listeners=listeners,
                                     costs=costs, tenants=tenants)
        self._offload = Offload(self._state)
        self._onboarding = Onboarding(self._state, self._offload,
                                      release if release is not None else _release_handle)

    # -- what it manages -------------------------------------------------------------------
    @property
    def tiers(self) -> tuple[str, ...]:
        """The configured tiers, fastest first."""
        return self._state.tiers

    @property
    def top(self) -> str:
        return self._state.top

    @property
    def pools(self) -> dict[str, BlockPool]:
        """The pools kvstrata owns: every tier, but the top one when the engine owns it."""
        return self._state.pools

    @property
    def stats(self) -> PlacementStats:
        return self._state.stats

    @property
    def costs(self) -> CostModel | None:
        """What moving blocks costs on each path, learned from the completed plans
        (:mod:`.costs`); None when the planner was built without a cost model."""
        return self._state.costs

    @property
    def tenants(self) -> TenantLedger | None:
        """Whose blocks each tier holds and what their quotas evicted and refused
        (:mod:`.tenants`); None when the config sets no tenant quota."""
        return self._state.tenants

    def quarantined(self, tier: str) -> int:
        """Blocks of ``tier`` found bad while in use, waiting to be dropped."""
        return len(self._state.quarantine[self._tier(tier)])

    def engine_blocks_in_use(self) -> frozenset[int]:
        """Engine-owned top-tier block ids that copies in flight still read or write: the
        engine must not reuse them until they leave this set."""
        return frozenset(self._state.engine_blocks)

    @property
    def pending(self) -> int:
        """Plans handed out (or not yet taken) and not completed, plus deferred batches."""
        return self._state.pending

    @property
    def idle(self) -> bool:
        return self._state.pending == 0

    def restore(self, tier: str, entries: Sequence[tuple[int, BlockRecord]]) -> int:
        """Register the blocks a durable ``tier`` recovered at start ((slot, record), oldest
        first) in its pool; returns how many. Entries whose slot was used since are skipped
        (:meth:`BlockPool.restore`). Observers of the registry hear them as stored.
        ``PlacementError`` for a tier with no pool of ours; ``ValueError`` (nothing changed)
        for entries that do not fit the pool."""
        tier = self._tier(tier)
        pool = self._state.pools.get(tier)
        if pool is None:
            raise PlacementError(f"restore: {tier} is the engine's; nothing to restore")
        restored = pool.restore(entries)
        ledger = self._state.tenants
        if ledger is not None and restored:
            # the journal keeps no tenant: the blocks it recovered share one tenant's quota
            ledger.stored(tier, [r for _, r in entries if r.sequence_hash in pool],
                          RECOVERED_TENANT)
        return restored

    def learn(self, tier: str, records: Sequence[BlockRecord]) -> int:
        """Blocks found in a shared, key-addressed ``tier`` that this worker did not put
        there (another worker did; a listing of the store shows them): hold them in the
        tier's catalog so lookups find them. Returns how many were new. Blocks already held
        or on their way are skipped; of several records for one block, the first that
        follows the chaining rule is kept (:func:`.keys.chain_consistent`), else the first.
        If the catalog is full, its idle entries are forgotten in eviction order (the store
        keeps the objects) and what does not fit is left out.
        A block that is gone by the time it is read is a load failure and is dropped."""
        tier = self._tier(tier)
        if spec(tier).addressing is not Addressing.KEYS:
            raise PlacementError(f"learn: {tier} is addressed by slots; only a shared "
                                 f"key-addressed tier learns blocks from others")
        s = self._state
        pool, receiving = s.pools[tier], s.receiving[tier]
        records = list(records)
        bad = first_bad_record(records, pool.block_size)
        if bad is not None:
            raise PlacementError(f"learn: records[{bad}] = {records[bad]!r:.120} is not a "
                                 f"block of {pool.block_size} tokens with u64 hashes")
        chosen: dict[int, BlockRecord] = {}
        for record in records:
            h = record.sequence_hash
            if record.parent_hash == h:
                continue                        # never its own prefix: not a real block
            if h in pool or h in receiving:
                continue
            other = chosen.get(h)               # several keys for one hash: not all real
            if other is None or (not chain_consistent(other) and chain_consistent(record)):
                chosen[h] = record
        new = list(chosen.values())
        slots = allocate_up_to(pool, len(new)) if new else None
        if slots is None:
            return 0
        new = new[:len(slots)]
        slots.apply_token_blocks(new)
        pool.release(pool.register(slots))
        return len(new)

    # -- lookups ---------------------------------------------------------------------------
    def lookup(self, sequence_hashes: Iterable[int]) -> list[str]:
        """The fastest tier holding each block of the longest prefix held (side-effect free).

        With an engine-owned top tier only the lower tiers are searched: the engine knows
        what its own cache holds."""
        s = self._state
        searched = tuple(s.pools) if not s.engine_owns_top else s.tiers[1:]
        out: list[str] = []
        for h in sequence_hashes:
            tier = s.holder(h, searched)
            if tier is None:
                break
            out.append(tier)
        return out

    @property
    def learns_from_requests(self) -> bool:
        """Whether a tier's policy learns from the requests (:meth:`observe_request`)."""
        return bool(self._request_observers)

    def observe_request(self, sequence_hashes: Sequence[int]) -> None:
        """Show a request's block hashes, from its first block, to the policies that learn
        from requests (the ``adaptive`` duel, the ``predicted-reuse`` filter; not
        thread-safe: the thread that calls this offers the blocks). :meth:`prepare_onboard`
        does it for the request it serves; a connector whose engine serves some requests
        without asking (its own cache hit them) calls this once per request and onboards
        with ``observe=False``."""
        for observe in self._request_observers:
            observe(sequence_hashes)

    # -- onboard ---------------------------------------------------------------------------
    def prepare_onboard(self, sequence_hashes: Sequence[int],
                        engine_block_ids: Sequence[int] | None = None, *,
                        observe: bool = True) -> int:
        """Start bringing the longest held prefix of a request into the top tier; returns
        the onboard's ticket number. Its :class:`OnboardResult` appears in
        :meth:`take_finished` once the copies it needs completed (at once if it needs none).

        Owned top tier: leave ``engine_block_ids`` out. External: give one engine block id
        to fill per hash, none of them in :meth:`engine_blocks_in_use` (``PlacementError``
        otherwise); blocks past the held prefix are not touched."""
        hashes = list(sequence_hashes)
        if self._state.engine_owns_top:
            ids = engine_ids(engine_block_ids, len(hashes), "prepare_onboard")
            busy = [b for b in ids if b in self._state.engine_blocks]
            if busy:
                raise PlacementError(f"prepare_onboard: engine blocks {busy} are still read or "
                                     f"written by copies in flight (engine_blocks_in_use)")
            if observe:
                self.observe_request(hashes)
            return self._onboarding.prepare_external(hashes, ids)
        if engine_block_ids is not None:
            raise PlacementError("prepare_onboard: kvstrata owns the top tier here; "
                                 "engine_block_ids must be left out")
        if observe:
            self.observe_request(hashes)
        return self._onboarding.prepare_owned(hashes)

    def take_finished(self) -> list[OnboardResult]:
        """Onboards finished since the last call, in the order they finished."""
        done = self._onboarding.finished
        if not done:
            return []
        self._onboarding.finished = []
        return done

    # -- offload ---------------------------------------------------------------------------
    def register(self, blocks: MutableBlocks, priority: int = 0,
                 tenant: str = "") -> ImmutableBlocks:
        """Owned top tier: register blocks computed for ``tenant`` (consumed) and offer the
        newly stored ones down the tiers. Returns handles on the registered blocks (a hash
        already held dedups onto the existing block); on error nothing stays held."""
        return self._offload.register_and_offer(self._owned_top("register"), blocks, priority,
                                                _tenant(tenant))

    def register_fetched(self, blocks: MutableBlocks, priority: int = 0,
                         tenant: str | None = None) -> ImmutableBlocks:
        """Register blocks of a tier below the top whose bytes were filled from outside (read
        from another worker's memory; consumed) for ``tenant`` (None: whoever another tier
        knows them by, else :data:`~.tenants.RECOVERED_TENANT`), and offer them further down,
        as :meth:`register` does for computed ones. With quotas, blocks beyond the tenant's
        are given back, not registered."""
        if tenant is not None:
            tenant = _tenant(tenant)
        s = self._state
        owner = getattr(blocks, "pool", None)
        tier = getattr(owner, "tier", None)
        if tier is None or tier == s.top or s.pools.get(tier) is not owner:
            raise PlacementError("register_fetched: blocks must come from a pool of ours "
                                 "below the top tier")
        return self._offload.register_and_offer(owner, blocks, priority, tenant)

    def room_for(self, tier: str, records: Sequence[BlockRecord], tenant: str, *,
                 refuse: bool = False) -> int:
        """How many of ``records`` (a prefix new to ``tier``) ``tenant``'s quota of ``tier``
        has room for now, after evicting the tenant's own idle blocks (none of these or their
        parents); all of them without quotas. Ask before taking slots for blocks filled from
        outside (:meth:`register_fetched`): taking slots evicts any tenant's blocks. A
        question: what it has no room for is counted nowhere, unless ``refuse`` (a caller
        that stores only what fits, once) counts it as refused for ``quota``, in the ledger
        and as skipped (:attr:`stats`) alike."""
        s = self._state
        tier = self._tier(tier)
        if s.tenants is None:
            return len(records)
        tenant = _tenant(tenant)
        protect = {r.sequence_hash for r in records} | {r.parent_hash for r in records}
        fits = s.tenants.room(s.pools[tier], tenant, len(records), protect,
                              count_refused=False)
        if refuse and fits < len(records):
            s.tenants.refuse(tier, tenant, len(records) - fits)
            s.skipped(tier, "quota", len(records) - fits)
        return fits

    def prepare_offload(self, tier: str, records: Sequence[BlockRecord],
                        engine_block_ids: Sequence[int] | None = None,
                        tenant: str | None = None) -> None:
        """Offer blocks newly stored in ``tier`` for ``tenant`` to the next tier down
        (write-through; the tenant's quotas apply there and further down).

        For an engine-owned top tier, ``engine_block_ids`` names the engine block holding
        each record (read by the copy; see :meth:`engine_blocks_in_use`), and ``tenant``
        None is the default tenant ``""``. For a kvstrata tier the records must be
        registered there, and ``tenant`` None means whoever holds them there (with quotas,
        :data:`~.tenants.RECOVERED_TENANT` for a block no tier knows the tenant of)."""
        tier = self._tier(tier)
        if tenant is not None:
            tenant = _tenant(tenant)
        s = self._state
        records = list(records)
        if tier == s.top and s.engine_owns_top:
            ids = engine_ids(engine_block_ids, len(records), "prepare_offload")
            busy = [b for b in ids if b in self._state.engine_writing]
            if busy:
                raise PlacementError(f"prepare_offload: engine blocks {busy} are still being "
                                     f"filled by an onboard in flight")
            self._offload.offer(tier, records, ids, "" if tenant is None else tenant)
            return
        if engine_block_ids is not None:
            raise PlacementError(f"prepare_offload: {tier} is kvstrata's; engine_block_ids "
                                 f"must be left out")
        pool = s.pools[tier]
        missing = [r.sequence_hash for r in records if r.sequence_hash not in pool]
        if missing:
            raise PlacementError(f"prepare_offload: {len(missing)} block(s) are not "
                                 f"registered in {tier}, e.g. {missing[0]:#x}")
        ledger = s.tenants
        if tenant is not None or ledger is None:
            self._offload.offer(tier, records, tenant=tenant)
            return
        # a block no tier knows the tenant of is offered as RECOVERED_TENANT's (.offload)
        by_owner: dict[str | None, list[BlockRecord]] = {}
        for record in records:
            by_owner.setdefault(ledger.owner(record.sequence_hash), []).append(record)
        for owner, mine in by_owner.items():
            self._offload.offer(tier, mine, tenant=owner)

    def admit(self, tier: str, records: Sequence[BlockRecord]) -> list[BlockRecord]:
        """The records ``tier``'s admission filter accepts (for one that keeps prefixes
        whole, none whose parent it refused in the same call; refusals are counted as
        skipped for ``admission``); for blocks an engine computed before storing them."""
        tier = self._tier(tier)
        return [records[i] for i in self._state.admitted(tier, records)]

    # -- executing -------------------------------------------------------------------------
    def take_plans(self) -> list[TransferPlan]:
        """Plans made since the last call; hand each to an executor and its result to
        :meth:`complete`."""
        return self._state.take_plans()

    def complete(self, results: Iterable[TransferResult]) -> None:
        """Apply the results of plans handed out by :meth:`take_plans`.

        Every result is checked first (``PlacementError``, nothing applied, if one answers no
        job in flight, answers a different plan, or is malformed). Then, per result: blocks
        that arrived are registered (and offered further down) or delivered to their
        onboard; failed ones are given back, and a source found bad is dropped (quarantined
        while in use). If applying one result fails (a bug), its holds are released, its
        onboard's blocks fail with kind ``internal``, and the error is logged, not raised."""
        checked = check_results(self._state.jobs, list(results))
        s = self._state
        for job, result in checked:
            s.close_job(job)
            good = bad = None
            try:
                ok = result.ok
                if job.target is not None:
                    good, bad = job.target.split(ok)
                kinds: dict[str, int] = {}
                for failure in result.failures:
                    kinds[failure.kind.value] = kinds.get(failure.kind.value, 0) + 1
                unexplained = ok.count(False) - len(result.failures)
                if unexplained > 0:
                    kinds["internal"] = kinds.get("internal", 0) + unexplained
                s.transfer_done(job, ok.count(True), result.bytes_moved, result.seconds,
                                kinds.items(), result.held_seconds + result.waited_seconds)
                if job.ticket is not None:
                    self._onboarding.finish(job, good, bad, result)
                else:
                    self._offload.finish(job, good, bad, result)
            except Exception as exc:
                log.exception("kvstrata: applying the result of a %s copy failed", job.path)
                self._abandon(job, (job.source, job.target, good, bad), exc)
        self.settle()

    def settle(self) -> None:
        """Offer deferred blocks whose target has free slots again, and drop quarantined
        blocks that are idle now. :meth:`complete` does it; a driver that releases handles
        outside the planner (an onboard's blocks) calls it afterwards too."""
        self._offload.retry_deferred()
        self._state.retry_quarantine()

    def _abandon(self, job: Job, handles: Iterable, exc: BaseException) -> None:
        """Clean up after a result whose handling failed part-way."""
        s = self._state
        for handle in handles:
            s.release_quietly(handle)
        s.receiving[job.dst_tier].difference_update(r.sequence_hash for r in job.records)
        try:
            self._onboarding.abandon(job, exc)
        except Exception:
            log.exception("kvstrata: settling the onboard of an abandoned copy failed")

    # -- helpers ---------------------------------------------------------------------------
    def _tier(self, tier: str) -> str:
        if tier not in self._state.receiving:
            raise PlacementError(f"no tier {tier!r}; tiers are {', '.join(self.tiers)}")
        return tier

    def _owned_top(self, what: str) -> BlockPool:
        s = self._state
        if s.engine_owns_top:
            raise PlacementError(f"{what}: the engine owns {s.top}; use prepare_offload with "
                                 f"its block ids")
        return s.pools[s.top]
