"""The connector's scheduler half: placement decisions in vLLM's engine-core process, no bytes.

(Over 500 lines on purpose: one concern, answering vLLM's scheduler-side calls; each call's
bookkeeping (tracked requests, held blocks, what the tiers kept at start) is read by others.)

It runs kvstrata's :class:`~kvstrata.placement.Planner` with an engine-owned G1 (vLLM's KV
cache) over the lower tiers, driven by vLLM's scheduler calls:

* ``get_num_new_matched_tokens`` -- hash the prompt (kvstrata's router-compatible chain, seeded
  per LoRA adapter and cache salt) and look up the longest prefix the lower tiers hold beyond
  vLLM's own hit, in every KV cache group (a sliding-window group: the window where the hit
  ends; :mod:`.groups`); answered as an asynchronous load, never the whole prompt.
* ``update_state_after_alloc`` -- vLLM allocated the blocks: open an onboard into exactly those
  engine block ids; its plans and the request's :class:`LoadOrder` go to the workers.
* ``build_connector_meta`` -- offer every block that becomes full in this step to G2 (the
  write-through cascade: dedup, admission, eviction, then G3), every group's, and ship the
  step's plans (with a flush when a sliding window freed a block a store still reads).
* ``update_connector_output`` -- combine the workers' results (every rank's), apply them to the
  planner, and release finished requests whose blocks no copy reads any more.
* ``request_finished`` -- hold a finished request's blocks while a store still reads them.

Everything happens on vLLM's scheduler thread; the planner needs no lock.
"""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Sequence

from ...logical.registry import BlockRegistry
from ...manager.catalog import StoreLister
from ...kinds import StorageOptions, cost_priors, kind_of, peek_recovered
from ...placement.costs import CostModel
from ...placement import PlacementError, Planner
from ...placement.onboard import OnboardResult
from ...protocol.plans import TransferPlan
from ...tiers import TOP_TIER, Addressing, spec
from ...tokens import hash_blocks, isolation_seed, tenant_key
from ...types import BlockRecord
from .events import VllmEventCollector
from .groups import KvGroups
from .metadata import LoadOrder, RankResults, StepOrders, WorkerReport
from .settings import ConnectorSettings
from .sharing import PeerDirectory, RemoteLoad

__all__ = ["SchedulerHalf", "ConnectorCounters"]

log = logging.getLogger(__name__)


@dataclass
class ConnectorCounters:
    """What the scheduler half did, cumulative (reported to vLLM's stats and Prometheus)."""

    lookups: int = 0
    """Requests that were given a load."""
    tokens_matched: dict[str, int] = field(default_factory=dict)
    """Tokens answered as loadable, by the tier the blocks were found in."""
    blocks_loaded: dict[str, int] = field(default_factory=dict)
    blocks_load_failed: int = 0
    blocks_offered: int = 0
    requests_held: int = 0
    blocks_not_stored: dict[str, int] = field(default_factory=dict)
    """Blocks offered to a tier and not copied there, by ``"tier:reason"`` (admission refused
    them; ``no_slot``: every free slot was taken by copies in flight)."""
    tokens_not_loaded: dict[str, int] = field(default_factory=dict)
    """Tokens held in a tier but recomputed because loading them was estimated slower."""
    writes_held_seconds: dict[str, float] = field(default_factory=dict)
    """Seconds writes to a tier were held back while the engine's forward ran."""
    tenant_tokens_matched: dict[str, int] = field(default_factory=dict)
    """With tenant quotas: tokens answered as loadable, by tenant label
    (:meth:`~kvstrata.placement.tenants.TenantLedger.label`)."""
    tenant_blocks_evicted: dict[str, int] = field(default_factory=dict)
    """With tenant quotas: blocks a tenant's stores evicted of its own, by ``"tier:label"``."""
    tenant_blocks_refused: dict[str, int] = field(default_factory=dict)
    """With tenant quotas: blocks not stored, their tenant at its quota, by ``"tier:label"``."""

    def as_dict(self) -> dict[str, Any]:
        return {"lookups": self.lookups, "tokens_matched": dict(self.tokens_matched),
                "blocks_loaded": dict(self.blocks_loaded),
                "blocks_load_failed": self.blocks_load_failed,
                "blocks_offered": self.blocks_offered, "requests_held": self.requests_held,
                "blocks_not_stored": dict(self.blocks_not_stored),
                "tokens_not_loaded": dict(self.tokens_not_loaded),
                "writes_held_seconds": dict(self.writes_held_seconds),
                "tenant_tokens_matched": dict(self.tenant_tokens_matched),
                "tenant_blocks_evicted": dict(self.tenant_blocks_evicted),
                "tenant_blocks_refused": dict(self.tenant_blocks_refused)}


class _Tracked:
    """One live request: its block hashes so far, the blocks offered, its engine blocks."""

    __slots__ = ("request", "seed", "tenant", "local", "seq", "offered", "load", "remote",
                 "reading", "observed")

    def __init__(self, request: Any, seed: int, groups: int = 1, tenant: str = "") -> None:
        self.request = request
        self.seed = seed
        self.tenant = tenant
        """Whose blocks these are, for tenant quotas (:func:`kvstrata.tokens.tenant_key`)."""
        self.local: list[int] = []
        self.seq: list[int] = []
        self.offered = [0] * groups
        """Per KV cache group, the blocks offered to the tiers so far."""
        self.load: tuple[int, list[str]] | None = None
        """(first block, tier each block is counted from) last answered to vLLM as
        loadable."""
        self.reading: list[tuple[int, int, int]] = []
        """(group, block, engine block id) of stores from groups whose blocks vLLM frees
        while the request runs (sliding window), until no copy reads them."""
        self.remote: tuple[int, str, int] | None = None
        """(first block, peer, blocks) last answered as loadable from a peer engine."""
        self.observed = False
        """Whether the tiers' request-learning policies saw its hashes."""

    def hash_upto(self, blocks: int, block_size: int) -> None:
        """Hash the request's tokens up to ``blocks`` full blocks (incrementally)."""
        have = len(self.seq)
        if blocks <= have:
            return
        tokens = self.request.all_token_ids[have * block_size:blocks * block_size]
        local, seq = hash_blocks(tokens, block_size, self.seed,
                                 self.seq[-1] if self.seq else None)
        self.local.extend(local)
        self.seq.extend(seq)

    def records(self, blocks: Sequence[int], block_size: int, groups: KvGroups,
                pos: int = 0) -> list[BlockRecord]:
        """The records of KV cache group ``pos``'s ``blocks`` (positions in the request)."""
        seq, local, key, local_hash = self.seq, self.local, groups.key, groups.local_hash
        return [BlockRecord(key(pos, seq[i]), local_hash(pos, local[i]),
                            key(pos, seq[i - 1]) if i else None, block_size) for i in blocks]


_TIMED_STEPS_KEPT = 64
"""Timed steps remembered while their forward's report is awaited."""


class SchedulerHalf:
    """See the module docstring. ``world_size`` is the number of workers (tensor-parallel
    ranks) whose results make up one plan's result."""

    def __init__(self, settings: ConnectorSettings, world_size: int = 1,
                 observers: Iterable[Any] = ()) -> None:
        self.settings = settings
        self.block_size = settings.kv.block_size
        self.groups = settings.groups
        self._null_block = 0
        """The engine block id of vLLM's null block (what a block table holds where a
        sliding window freed a block); read from vLLM's block pool when it is bound."""
        self._block_ids_of = None
        """vLLM's KV cache manager's ``get_block_ids(req_id)``: any request's block tables
        now, scheduled or not (set by :meth:`bind_kv_cache_manager`)."""
        self._skipped = None
        """vLLM's own count of the tokens a KV cache group no longer attends to (set by
        :meth:`bind_kv_cache_manager`); without it a window's size gives it."""
        if not self.groups.single:
            log.info("kvstrata: %d KV cache groups: %s (the first full-attention one is "
                     "named by the prompt's chain hashes)", len(self.groups.groups),
                     self.groups.signature())
        self.registry = BlockRegistry()
        self.events = VllmEventCollector(self.groups, self.registry)
        self.registry.add_observer(self.events)
        for observer in observers:
            self.registry.add_observer(observer)
        self.planner = Planner(settings.kv, registry=self.registry, engine_owns_top=True,
                               worker=0, costs=CostModel(cost_priors()))
        self.counters = ConnectorCounters()
        self._results = RankResults(world_size)
        self._world_size = world_size
        self._reset_before_recovery = False
        self._reset_pending = False
        """``reset_cache`` ran while workers' reports of their recovered blocks were due."""
        self._recovered: dict[int, dict[str, list]] | None = {}
        """Each worker's recovered durable blocks until every rank reported (then None)."""
        self._restore_from_index_files()
        self._learned: queue.SimpleQueue = queue.SimpleQueue()
        self._peers = PeerDirectory(settings.peers, settings.peer_ask_timeout) if settings.peers else None
        self._remote_loads: dict[str, RemoteLoad] = {}
        self._forget: dict[str, list[int]] = {}
        """Per tier, slots dropped by ``reset_cache`` that the workers must forget."""
        self._timed_steps: dict[int, int] = {}
        """Steps whose forward the workers time, and the tokens each scheduled."""
        self._step = 0
        self._listers = self._open_store_listers()
        self._requests: dict[str, _Tracked] = {}
        self._readers: dict[str, _Tracked] = {}
        """The tracked requests with ``reading`` entries (stores of blocks vLLM may free
        while the request lives), checked every step."""
        self._outbox: list[TransferPlan] = []
        self._loads: dict[str, LoadOrder] = {}
        self._loading: set[str] = set()
        self._held: dict[str, frozenset[int]] = {}
        self._flush = False
        self._load_tiers: dict[str, list[str]] = {}
        self._warned_no_slot = float("-inf")

    # -- state -----------------------------------------------------------------------------
    @property
    def idle(self) -> bool:
        """No copy in flight or waiting to be shipped, no request held or loading."""
        return (self.planner.idle and not self._outbox and not self._held
                and not self._loading and self._results.waiting == 0)

    def status(self) -> dict[str, Any]:
        """Counts for tests and operators: requests tracked, held, loading; plans in
        flight; per kvstrata pool, its slots by place; the learned costs of each path and
        the engine's prefill rate (:mod:`kvstrata.placement.costs`)."""
        pools = {t: asdict(p.status()) for t, p in self.planner.pools.items()}
        return {"tracked": len(self._requests) + len(self._load_tiers), "held": len(self._held),
                "loading": len(self._loading), "pending_plans": self.planner.pending,
                "unshipped_plans": len(self._outbox), "engine_blocks_in_use":
                len(self.planner.engine_blocks_in_use()), "pools": pools,
                "counters": self.counters.as_dict(), "costs": self.planner.costs.snapshot()}

    def _observe(self, chain: list[int]) -> None:
        """Show a request to the policies that learn from requests: each KV cache group's
        blocks under their own names, as its own chain (a filter then decides a group's
        block as it decides the primary one at that position)."""
        key = self.groups.key
        for pos in range(len(self.groups.groups)):
            self.planner.observe_request(
                chain if pos == self.groups.primary else [key(pos, h) for h in chain])

    # -- vLLM scheduler calls --------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        tracked = self._track(request)          # tracked for its stores even with loads off
        if tracked is None:
            return 0, False
        bs = self.block_size
        limit = (request.num_tokens - 1) // bs        # vLLM computes at least one token
        if limit > 0 and not tracked.observed and self.planner.learns_from_requests:
            tracked.observed = True             # once, whoever serves it (vLLM asks again)
            tracked.hash_upto(limit, bs)
            self._observe(tracked.seq[:limit])
        if not self.settings.load or self._reset_pending:
            return 0, False              # a reset waits for copies: nothing stored before loads
        if self._listers:
            self._apply_learned()
        start = num_computed_tokens // bs
        if limit <= start:
            return 0, False
        tracked.hash_upto(limit, bs)
        chain = tracked.seq[:limit]
        tiers = self._held_prefix(chain, start)
        if tiers and self.settings.cost_aware:
            worth = self.planner.costs.worth_loading(
                tiers, TOP_TIER, self._bytes_per_position(start, len(tiers)), bs)
            if worth < len(tiers):
                skipped = self.counters.tokens_not_loaded
                for tier in tiers[worth:]:
                    skipped[tier] = skipped.get(tier, 0) + bs
                log.debug("kvstrata: request %s loads %d of %d held blocks (%s); recomputing "
                          "the rest is estimated faster", request.request_id, worth,
                          len(tiers), ",".join(tiers))
                tiers = self._held_prefix(chain[:start + worth], start)
        tracked.load = (start, tiers) if tiers else None
        tracked.remote = None
        if self._peers is not None and len(tiers) < limit - start:
            best = self._peers.best(request.request_id, tracked.seq[start:limit])
            if best is None:
                return None, False                   # asking the peers: vLLM asks again
            peer, held = best
            if held > len(tiers):                    # a peer holds more: load it all from there
                tracked.load, tracked.remote = None, (start, peer, held)
                return held * bs, True
        return len(tiers) * bs, bool(tiers)

    def update_state_after_alloc(self, request: Any, block_ids: Sequence[list[int]],
                                 num_external_tokens: int) -> None:
        """vLLM allocated ``block_ids`` (one list per KV cache group) for the request,
        ``num_external_tokens`` of them to be loaded: plan the load into those blocks."""
        tracked = self._requests.get(request.request_id)
        if tracked is not None and tracked.remote is not None and num_external_tokens > 0:
            self._order_remote_load(request.request_id, tracked, block_ids,
                                    num_external_tokens)
            return
        if tracked is None or num_external_tokens <= 0 or tracked.load is None:
            return
        start, tiers = tracked.load
        tracked.load = None
        count = num_external_tokens // self.block_size
        if count > len(tiers):
            log.warning("kvstrata: vLLM asked %d blocks of request %s, %d were offered",
                        count, request.request_id, len(tiers))
        count = min(count, len(tiers))
        self.counters.lookups += 1
        self._load_tiers[request.request_id] = tiers[:count]
        matched = self.counters.tokens_matched
        for tier in tiers[:count]:
            matched[tier] = matched.get(tier, 0) + self.block_size
        self._count_tenant_match(tracked, count)
        self._loading.add(request.request_id)
        try:
            hashes, targets = self._load_targets(tracked, block_ids, start, start + count)
            self.planner.prepare_onboard(hashes, engine_block_ids=targets, observe=False)
        except PlacementError as exc:
            # e.g. a block vLLM reused while a copy still reads it: recompute instead
            log.warning("kvstrata: load for request %s not planned: %s", request.request_id, exc)
            self._fail_load(request.request_id,
                            [b for ids in block_ids for b in ids[start:start + count]
                             if b != self._null_block])
            return
        plans = self.planner.take_plans()
        self._outbox.extend(plans)
        wanted = set(targets)
        mine = [p for p in plans if p.dst_tier == TOP_TIER and wanted.issuperset(p.dst_block_ids)]
        filled = {b for p in mine for b in p.dst_block_ids}
        self._loads[request.request_id] = LoadOrder(
            tuple(p.job_id for p in mine), tuple(b for b in targets if b not in filled))
        self._collect_finished()

    def _order_remote_load(self, req_id: str, tracked: "_Tracked",
                           block_ids: Sequence[list[int]], num_external_tokens: int) -> None:
        """vLLM allocated the blocks of a prefix a peer engine holds: order the worker to
        read it from there, into the blocks a local load would fill (a sliding window's
        null block is never a target)."""
        start, peer, held = tracked.remote
        tracked.remote = None
        count = min(held, num_external_tokens // self.block_size)
        hashes, targets = self._load_targets(tracked, block_ids, start, start + count)
        self._loading.add(req_id)
        self.counters.lookups += 1
        matched = self.counters.tokens_matched
        matched["remote"] = matched.get("remote", 0) + count * self.block_size
        self._count_tenant_match(tracked, count)
        self._peers.forget(req_id)
        if self.planner.engine_blocks_in_use().intersection(targets):
            # vLLM gave the load blocks a store still reads (freed in this step by a
            # preemption or a window): the worker starts a remote load before the step's
            # flush, so it would write them under the store
            log.warning("kvstrata: remote load for request %s not ordered: its blocks are "
                        "still read by stores; recomputed", req_id)
            self._fail_load(req_id, targets)
            return
        self._remote_loads[req_id] = RemoteLoad(peer, tuple(hashes), tuple(targets))

    def _fail_load(self, req_id: str, targets: Sequence[int]) -> None:
        """Have the workers report a load's ``targets`` failed, without copying anything
        (vLLM recomputes them)."""
        self._loads[req_id] = LoadOrder((), tuple(targets))
        self.counters.blocks_load_failed += len(targets)

    def build_connector_meta(self, scheduler_output: Any) -> StepOrders:
        step = self._time_if_prefill(scheduler_output)
        preempted = getattr(scheduler_output, "preempted_req_ids", None) or ()
        if preempted:
            self._flush = True
        self._check_freed_while_read(scheduler_output)
        if self._reset_pending and self.idle:
            self._reset_pending = False
            self._drop_every_block()
        if self.settings.store and not self._reset_pending:
            self._offer_new_blocks(scheduler_output)
        self._outbox.extend(self.planner.take_plans())
        self._count_not_stored()
        self._count_tenants()
        orders = StepOrders(plans=self._outbox, loads=self._loads, flush=self._flush,
                            step=step, remote_loads=self._remote_loads, forget=self._forget)
        self._outbox, self._loads, self._flush = [], {}, False
        self._remote_loads, self._forget = {}, {}
        return orders

    def update_connector_output(self, output: Any) -> None:
        for req_id in getattr(output, "finished_recving", None) or ():
            self._loading.discard(req_id)
        report = getattr(output, "kv_connector_worker_meta", None)
        if isinstance(report, WorkerReport) and report.recovered \
                and self._recovered is not None:
            self._recovered.update(report.recovered)
            if len(self._recovered) >= self._world_size:
                self._restore_recovered()
        if isinstance(report, WorkerReport) and report.forwards:
            self._observe_forwards(report.forwards)
        if isinstance(report, WorkerReport) and report.results:
            combined = [c for rank, r in report.results
                        if (c := self._results.add(rank, r)) is not None]
            if combined:
                try:
                    self.planner.complete(combined)
                except PlacementError:
                    log.exception("kvstrata: workers reported results the planner refuses")
                else:
                    self._count_held(combined)
                self._collect_finished()
        if self._held:
            in_use = self.planner.engine_blocks_in_use()
            done = [r for r, ids in self._held.items() if not ids & in_use]
            if done:
                # vLLM frees a held request's blocks when its id is in finished_sending; the
                # scheduler reads that set right after this call.
                finished = set(output.finished_sending or ())
                finished.update(done)
                output.finished_sending = finished
                for req_id in done:
                    del self._held[req_id]

    def _open_store_listers(self) -> list[StoreLister]:
        """For a shared tier (addressed by keys: an object store): list every rank's
        namespace of the store now (a new server finds what others stored on its first
        request) and every ``list_interval`` seconds from a thread; what it finds is learned
        on the scheduler's thread."""
        listers = []
        kv = self.settings.kv
        identities = sorted({(i.rank, i.world_size) for i in self._identities()})
        for tier in self.planner.tiers:
            if spec(tier).addressing is not Addressing.KEYS:
                continue
            storages = [kind_of(tier).open_shared(kv, tier, StorageOptions(
                            world_size=world_size, block_layout=self.settings.block_layout),
                            rank) for rank, world_size in identities]
            lister = StoreLister(storages, tier, self.block_size,
                                 lambda t, records: self._learned.put((t, records)),
                                 self.settings.list_interval, limit=kv.tier_blocks(tier))
            lister.refresh(self.planner.learn)
            lister.start()
            listers.append(lister)
        return listers

    def _apply_learned(self) -> None:
        """Learn what the store listers found since the last call (scheduler thread)."""
        learned = self._learned
        while not learned.empty():
            tier, records = learned.get_nowait()
            self.planner.learn(tier, records)

    def close(self) -> None:
        """Stop the store listers. Idempotent."""
        for lister in self._listers:
            lister.close(storages=True)
        self._listers = []
        if self._peers is not None:
            self._peers.close()

    def _time_if_prefill(self, scheduler_output: Any) -> int:
        """A step number for the workers to time this step's forward under, if it computes
        at least two blocks' worth of tokens (a prefill; decode steps say nothing about
        prefill speed); 0 otherwise."""
        tokens = sum((getattr(scheduler_output, "num_scheduled_tokens", None) or {}).values())
        if tokens < 2 * self.block_size:
            return 0
        self._step += 1
        self._timed_steps[self._step] = tokens
        if len(self._timed_steps) > _TIMED_STEPS_KEPT:    # reports that never came
            del self._timed_steps[next(iter(self._timed_steps))]
        return self._step

    def _observe_forwards(self, forwards: list[tuple[int, float]]) -> None:
        """The engine's prefill rate: the tokens of each timed step over its forward's time
        (the first rank's report of a step counts, the others find it gone)."""
        for step, seconds in forwards:
            tokens = self._timed_steps.pop(step, None)
            if tokens is not None:
                self.planner.costs.observe_prefill(tokens, seconds)

    def _restore_from_index_files(self) -> None:
        """At start, read what every worker's durable tiers hold from their index files (on
        one machine they are readable here; vLLM builds the workers' caches before the
        scheduler), so the first request already finds the blocks. Otherwise the workers'
        first reports bring the same rows a step later."""
        per_rank = [peek_recovered(self.settings.kv, StorageOptions(
                        world_size=i.world_size, block_layout=self.settings.block_layout),
                        i.rank) for i in self._identities()]
        if all(rows is not None for rows in per_rank) and any(per_rank):
            self._recovered = dict(enumerate(per_rank))
            self._restore_recovered()

    def _identities(self) -> list:
        """How each worker, by rank, stores blocks (:meth:`ConnectorSettings.stored_as`)."""
        return [self.settings.stored_as(rank, self._world_size)
                for rank in range(self._world_size)]

    def _restore_recovered(self) -> None:
        """Every worker reported the blocks its durable tiers recovered: restore those that
        all of them hold in the same slot (each rank holds its own share of a block; a block
        some rank lost is a miss), then announce them. Slots the planner used meanwhile are
        skipped (:meth:`Planner.restore`)."""
        per_rank, self._recovered = list(self._recovered.values()), None
        if self._reset_before_recovery:
            self._forget_recovered(per_rank)
            return
        for tier in per_rank[0]:
            common = set(map(tuple, per_rank[0][tier]))
            for other in per_rank[1:]:
                common &= set(map(tuple, other.get(tier, ())))
            entries = [(slot, BlockRecord(seq, local, parent, self.block_size))
                       for slot, seq, parent, local in map(tuple, per_rank[0][tier])
                       if (slot, seq, parent, local) in common]
            try:
                restored = self.planner.restore(tier, entries)
            except (PlacementError, ValueError) as exc:
                log.warning("kvstrata: could not restore the blocks %s recovered: %s", tier, exc)
                continue
            log.info("kvstrata: %s serves %d block(s) kept from the last run (of %d that "
                     "every worker recovered)", tier, restored, len(entries))

    def _forget_recovered(self, per_rank: list[dict[str, list]]) -> None:
        """``reset_cache`` ran before every worker reported its recovered blocks: restore
        none of them, and have the workers forget their slots (those the planner has not
        used since)."""
        for tier in {t for rows in per_rank for t in rows}:
            pool = self.planner.pools.get(tier)
            if pool is None:
                continue
            slots = {row[0] for rows in per_rank for row in rows.get(tier, ())}
            unused = pool.unused_slots(sorted(slots))
            if unused:
                self._forget.setdefault(tier, []).extend(unused)
        log.info("kvstrata: the cache was reset before the workers reported what they kept; "
                 "it is dropped")

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        """vLLM's scheduler-side KV cache manager: its null block's id, the block tables of
        requests it does not schedule, and each KV cache group's own count of the tokens it
        skips (exact where a window keeps extra tokens)."""
        pool = getattr(kv_cache_manager, "block_pool", None)
        null = getattr(getattr(pool, "null_block", None), "block_id", None)
        if isinstance(null, int):
            self._null_block = null
        self._block_ids_of = getattr(kv_cache_manager, "get_block_ids", None)
        managers = getattr(getattr(kv_cache_manager, "coordinator", None),
                           "single_type_managers", None)
        if managers is not None and len(managers) == len(self.groups.groups):
            self._skipped = lambda group, tokens: managers[group].get_num_skipped_tokens(tokens)

    def request_finished(self, request: Any, block_ids: Sequence[int] | Sequence[list[int]]
                         ) -> bool:
        """True: vLLM must keep the blocks until they are released (stores read them).
        ``block_ids``: the request's blocks, or one list per KV cache group."""
        if block_ids and not isinstance(block_ids[0], int):
            block_ids = [b for ids in block_ids for b in ids if b != self._null_block]
        req_id = request.request_id
        tracked = self._requests.pop(req_id, None)
        self._readers.pop(req_id, None)
        self._load_tiers.pop(req_id, None)
        if self._peers is not None:
            self._peers.forget(req_id)
        if req_id in self._loading:
            return False            # vLLM already waits for the load before freeing
        ids = frozenset(block_ids)
        in_use = self.planner.engine_blocks_in_use()
        if tracked is not None and tracked.reading \
                and any(b in in_use and b not in ids for _, _, b in tracked.reading):
            # vLLM freed blocks that left the window as the request finished, before this
            # call, so they cannot be held: finish their copies before the next forward
            self._flush = True
        if ids & in_use:
            self._held[req_id] = ids
            self.counters.requests_held += 1
            return True
        return False

    def last_load_tiers(self, req_id: str) -> list[str]:
        """The tier of each block of the load last planned for ``req_id`` (taken once)."""
        return self._load_tiers.pop(req_id, [])

    def has_pending_work(self) -> bool:
        """Copies in flight or not yet shipped, or slots the workers must forget (a
        :meth:`reset_cache` an idle engine would otherwise never journal): the engine must
        keep stepping."""
        return (not self.planner.idle or bool(self._outbox) or bool(self._forget)
                or self._reset_pending)

    def take_events(self) -> list:
        return self.events.take()

    def reset_cache(self) -> bool:
        """Drop every block of kvstrata's tiers, for good: the next step's orders tell the
        workers to forget their slots, so a durable G3 journals it and a restart does not
        bring them back (after a change of weights, say). True once done. With copies still
        in flight it is not done yet (False), but under way: from now on nothing is loaded
        and nothing new is stored, the engine is kept stepping, and the drop is made as soon
        as the copies have ended (a caller that asks again then gets True). Until then a
        restart would still find the old blocks."""
        if not self.idle:
            self._reset_pending = True
            return False
        self._reset_pending = False
        self._drop_every_block()
        return True

    def _drop_every_block(self) -> None:
        """:meth:`reset_cache`, once no copy is in flight."""
        if self._recovered is not None:
            # The workers have not all reported what their durable tiers recovered: when
            # they do, those blocks are dropped too (:meth:`_restore_recovered`).
            self._reset_before_recovery = True
        for tier, pool in self.planner.pools.items():
            held = self.registry.hashes_in(tier)
            slots = pool.clear_slots()
            if slots and tier != TOP_TIER:
                self._forget.setdefault(tier, []).extend(slots)
            gone = held - self.registry.hashes_in(tier)
            if gone:
                self.events.on_tier_removed(tier, sorted(gone))

    # -- helpers ---------------------------------------------------------------------------
    def _track(self, request: Any) -> _Tracked | None:
        tracked = self._requests.get(request.request_id)
        if tracked is not None:
            return tracked
        if getattr(request, "prompt_token_ids", None) is None \
                or getattr(request, "prompt_embeds", None) is not None \
                or getattr(request, "mm_features", None):
            # prompt embeddings (alone or mixed with token ids, whose embedded positions are
            # zeros) or multimodal inputs: the token ids do not name the KV
            return None
        lora = getattr(request, "lora_request", None)
        lora_name = getattr(lora, "lora_name", None) if lora else None
        lora_path = getattr(lora, "lora_path", None) if lora else None
        salt = getattr(request, "cache_salt", None)
        tracked = self._requests[request.request_id] = _Tracked(
            request, isolation_seed(lora_name, salt, lora_path), len(self.groups.groups),
            tenant_key(lora_name, salt))
        return tracked

    def _tier_of(self, key: int) -> str | None:
        found = self.planner.lookup((key,))
        return found[0] if found else None

    def _held_prefix(self, chain: Sequence[int], start: int) -> list[str]:
        """Per block of the longest prefix after ``chain[:start]`` every KV cache group can
        serve from the lower tiers, the tier it is counted from (:meth:`KvGroups.tiers`)."""
        if self.groups == KvGroups():
            return self.planner.lookup(chain[start:])
        return self.groups.tiers(chain, start, self._tier_of, self.block_size, self._skipped)

    def _bytes_per_position(self, start: int, count: int) -> float:
        """The bytes a load of ``count`` blocks after ``start`` moves per block of the
        prompt (every group's blocks; a sliding window's only inside the window)."""
        per_block = self.settings.kv.bytes_per_block
        if self.groups == KvGroups() or count <= 0:
            return per_block
        needed = self.groups.needed(start, start + count, self.block_size, self._skipped)
        return per_block * len(needed) / count

    def _load_targets(self, tracked: "_Tracked", block_ids: Sequence[list[int]], start: int,
                      stop: int) -> tuple[list[int], list[int]]:
        """(block names, engine block ids) to load for blocks ``[start, stop)``."""
        pairs = self.groups.targets(tracked.seq, block_ids, start, stop, self._null_block)
        targets = [b for _, b in pairs]
        if len(set(targets)) != len(targets):
            raise PlacementError("vLLM gave one engine block id to two KV cache groups")
        return [k for k, _ in pairs], targets

    def _offer_new_blocks(self, scheduler_output: Any) -> None:
        """Offer the blocks that this step's forward makes full to the tiers below G1, every
        KV cache group's."""
        bs = self.block_size
        state = getattr(scheduler_output, "kv_connector_block_state", None)
        if state is None:
            return
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            tracked = self._requests.get(req_id)
            if tracked is None:
                continue
            tables = state.get_block_ids(req_id)
            if not tables:
                continue
            request = tracked.request
            # Full after this step's forward, and named by token ids already sampled: draft
            # tokens (speculative decoding) and async scheduling's placeholders are scheduled
            # before their ids are known; their blocks are offered in a later step.
            computed = min((request.num_computed_tokens + scheduled) // bs,
                           len(request.all_token_ids) // bs)
            for pos, ids in enumerate(tables[:len(tracked.offered)]):
                self._offer_group(tracked, pos, ids, min(computed, len(ids)))

    def _offer_group(self, tracked: "_Tracked", pos: int, ids: list[int], full: int) -> None:
        """Offer KV cache group ``pos``'s blocks up to ``full`` (its null blocks, which a
        sliding window freed before they were seen, cannot be)."""
        first = tracked.offered[pos]
        if full <= first:
            return
        tracked.hash_upto(full, self.block_size)
        blocks = [i for i in range(first, full) if ids[i] != self._null_block]
        if blocks:
            records = tracked.records(blocks, self.block_size, self.groups, pos)
            engine_ids = [ids[i] for i in blocks]
            try:
                self.planner.prepare_offload(TOP_TIER, records, engine_block_ids=engine_ids,
                                             tenant=tracked.tenant)
            except PlacementError as exc:
                log.debug("kvstrata: store of request %s deferred: %s",
                          tracked.request.request_id, exc)
                return
            self.counters.blocks_offered += len(blocks)
            if not self.groups.groups[pos].keeps_every_block:
                tracked.reading.extend((pos, i, ids[i]) for i in blocks)
                self._readers[tracked.request.request_id] = tracked
        tracked.offered[pos] = full

    def _check_freed_while_read(self, scheduler_output: Any) -> None:
        """vLLM frees a sliding-window (or Mamba) block once the window has passed it,
        without asking, when it tries to schedule the request: also in a step that then does
        not schedule it (``allocate_slots`` frees them before it finds no room, and may give
        them to a waiting request in that step). If a store still reads such a block, the
        workers must finish the copies reading vLLM's KV before this step's forward (as
        after a preemption). Every request with such stores in flight is checked, scheduled
        or not."""
        if not self._readers:
            return
        in_use = self.planner.engine_blocks_in_use()
        for req_id, tracked in list(self._readers.items()):
            still = [(pos, i, b) for pos, i, b in tracked.reading if b in in_use]
            tracked.reading = still
            if not still:
                del self._readers[req_id]
                continue
            tables = self._tables_now(req_id, scheduler_output)
            if tables is None or any(tables[pos][i] != b for pos, i, b in still
                                     if i < len(tables[pos])):
                self._flush = True

    def _tables_now(self, req_id: str, scheduler_output: Any) -> Sequence[list[int]] | None:
        """A request's block tables as vLLM holds them in this step, one per KV cache group
        (None where they cannot be read: a request not scheduled, no KV cache manager
        bound)."""
        state = getattr(scheduler_output, "kv_connector_block_state", None)
        if state is not None and req_id in scheduler_output.num_scheduled_tokens:
            return state.get_block_ids(req_id)
        return self._block_ids_of(req_id) if self._block_ids_of is not None else None

    def _count_not_stored(self) -> None:
        skipped = self.planner.stats.skipped_blocks
        counts = self.counters.blocks_not_stored
        for (tier, reason), n in skipped.items():
            key = f"{tier}:{reason}"
            before = counts.get(key, 0)
            if n == before:
                continue
            counts[key] = n
            if reason == "no_slot" and time.monotonic() - self._warned_no_slot > 60.0:
                self._warned_no_slot = time.monotonic()
                log.warning("kvstrata: %d block(s) not stored in %s: its free slots were all "
                            "taken by copies in flight; grow %s to hold what a few engine "
                            "steps store (docs/vllm.md)", n - before, tier, tier)

    def _count_tenant_match(self, tracked: "_Tracked", blocks: int) -> None:
        ledger = self.planner.tenants
        if ledger is not None and blocks > 0:
            label = ledger.label(tracked.tenant)
            matched = self.counters.tenant_tokens_matched
            matched[label] = matched.get(label, 0) + blocks * self.block_size

    def _count_tenants(self) -> None:
        """The ledger's quota evictions and refusals into the counters (a few entries: one
        per tier and named tenant, plus the others')."""
        ledger = self.planner.tenants
        if ledger is None:
            return
        counters = self.counters
        counters.tenant_blocks_evicted = {f"{t}:{label}": n
                                          for (t, label), n in ledger.evicted.items()}
        counters.tenant_blocks_refused = {f"{t}:{label}": n
                                          for (t, label), n in ledger.refused.items()}

    def _count_held(self, results) -> None:
        held = self.counters.writes_held_seconds
        for result in results:
            if result.held_seconds:
                tier = result.plan.dst_tier
                held[tier] = held.get(tier, 0.0) + result.held_seconds

    def _collect_finished(self) -> None:
        for result in self.planner.take_finished():
            self._count_onboard(result)

    def _count_onboard(self, result: OnboardResult) -> None:
        loaded = self.counters.blocks_loaded
        for tier in result.sources:
            loaded[tier] = loaded.get(tier, 0) + 1
        self.counters.blocks_load_failed += result.requested - len(result)
