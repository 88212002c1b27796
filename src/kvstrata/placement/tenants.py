"""Per-tenant quotas on the tiers kvstrata stores into: one busy tenant cannot evict the rest.

A *tenant* is whoever the engine says a block was computed for: vLLM's ``cache_salt`` of the
request, else its LoRA adapter's name (:mod:`kvstrata.connectors.vllm.scheduler`); the
``tenant`` argument of a manager's or planner's store verbs; ``""`` is the default tenant of
requests that name none. Tenants never share a block: their salt or adapter already seeds every
sequence hash (:func:`kvstrata.tokens.isolation_seed`). A *quota* is the most blocks of one
tier one tenant may hold (config: a tier's ``tenant_quota`` for every tenant,
``tenant_quotas`` per named tenant; :meth:`kvstrata.config.KvConfig.tenant_limits`).

The rules, applied when blocks are offered to a tier (:mod:`.offload`):

* a tenant under its quota stores as before: the tier's eviction policy picks victims among
  everyone's idle blocks;
* a tenant that would go over its quota first evicts its own idle blocks, oldest stored
  first, a chain's newest blocks before its prefix (a leaf-first pool keeps a prefix while
  its children are held); what still does not fit is not stored (skipped, reason ``quota``).

So with quotas that add up to at most a tier's size, every tenant keeps its quota's worth of
that tier whatever the others store. Blocks whose tenant is not known belong to none and
count against no quota: blocks a durable G3 recovered at start (its index keeps no tenant)
and blocks learned from a shared G4's listing.

:class:`TenantLedger` keeps, per tier, which tenant each held block belongs to and each
tenant's blocks in the order they were stored (a loaded block moves to the end: it was just
used). It hears every removal (evictions by the policy, drops, clears) from the registry, so
it holds exactly the blocks the tiers hold. Without any quota configured the planner makes no
ledger: nothing is tracked and nothing costs.
"""

from __future__ import annotations

from collections import Counter
from itertools import islice
from typing import Iterable, Mapping, Sequence

from ..logical.pool import BlockPool
from ..logical.registry import RegistryObserver
from ..types import BlockRecord

__all__ = ["TenantLedger", "TENANT_OTHERS"]

TENANT_OTHERS = "*"
"""The label of tenants that ``tenant_quotas`` does not name, summed, in per-tenant
metrics: a tenant key can be a secret salt, so only names the operator wrote are shown."""


class TenantLedger(RegistryObserver):
    """Which tenant holds which blocks of each tier, and their quotas (module docstring).

    ``limits`` maps a tier to ``(quota of any tenant or None, {named tenant: quota})`` in
    blocks. Owner-thread only, like the pools; register it as an observer of the pools'
    registry so it hears removals."""

    def __init__(self, limits: Mapping[str, tuple[int | None, Mapping[str, int]]]) -> None:
        self._default = {tier: default for tier, (default, _) in limits.items()}
        self._named = {tier: dict(named) for tier, (_, named) in limits.items()}
        self.named = frozenset(t for _, named in limits.values() for t in named)
        """Tenants that the config names (their own label in metrics)."""
        self._owner: dict[str, dict[int, str]] = {tier: {} for tier in limits}
        self._mine: dict[str, dict[str, dict[int, None]]] = {tier: {} for tier in limits}
        self._incoming: dict[str, Counter[str]] = {tier: Counter() for tier in limits}
        # by (tier, label): what metrics show, kept as it changes (O(1) to read per step)
        self.held: Counter[tuple[str, str]] = Counter()
        """``(tier, label) -> blocks`` held now (labels: :meth:`label`)."""
        self.evicted: Counter[tuple[str, str]] = Counter()
        """``(tier, label) -> blocks`` a tenant's own stores evicted to stay in its quota."""
        self.refused: Counter[tuple[str, str]] = Counter()
        """``(tier, label) -> blocks`` not stored because their tenant was at its quota."""

    # -- what the offload asks -------------------------------------------------------------
    def limit(self, tier: str, tenant: str) -> int | None:
        """The most blocks of ``tier`` ``tenant`` may hold (None: no limit)."""
        named = self._named.get(tier)
        if named is None:
            return None
        return named.get(tenant, self._default[tier])

    def room(self, pool: BlockPool, tenant: str | None, count: int) -> int:
        """How many of ``count`` blocks of ``tenant`` may be stored in ``pool``'s tier now;
        evicts the tenant's own idle blocks first to make room. Counts what is refused."""
        if tenant is None:
            return count
        tier = pool.tier
        limit = self.limit(tier, tenant)
        if limit is None:
            return count
        mine = self._mine[tier].get(tenant)
        held = len(mine) if mine else 0
        over = held + self._incoming[tier][tenant] + count - limit
        if over > 0 and mine:
            made = self._evict_own(pool, mine, over)
            self.evicted[tier, self.label(tenant)] += made
            over -= made
        if over <= 0:
            return count
        allowed = max(count - over, 0)
        self.refused[tier, self.label(tenant)] += count - allowed
        return allowed

    @staticmethod
    def _evict_own(pool: BlockPool, mine: dict[int, None], wanted: int) -> int:
        """Drop up to ``wanted`` of ``mine`` (oldest stored first) that are idle; returns how
        many. A window of the oldest is tried newest first, so a chain's blocks go before its
        prefix; it doubles while that frees too few (a chain longer than the window)."""
        dropped, window, total = 0, wanted, len(mine)
        while dropped < wanted:
            for h in reversed(list(islice(mine, window))):
                if pool.reset_blocks((h,)):      # the registry tells us: ``mine`` shrinks
                    dropped += 1
                    if dropped == wanted:
                        break
            if window >= total:
                break
            window *= 2
        return dropped

    def coming(self, tier: str, tenant: str | None, count: int) -> None:
        """``count`` blocks of ``tenant`` are on their way into ``tier`` (negative: no
        longer): they count against its quota until they arrive."""
        if tenant is not None and tier in self._incoming:
            incoming = self._incoming[tier]
            incoming[tenant] += count
            if incoming[tenant] <= 0:
                del incoming[tenant]

    def stored(self, tier: str, hashes: Iterable[int], tenant: str | None) -> None:
        """``hashes`` were newly registered in ``tier`` for ``tenant`` (None: unknown)."""
        if tenant is None or tier not in self._owner:
            return
        owner = self._owner[tier]
        mine = self._mine[tier].setdefault(tenant, {})
        before = len(mine)
        for h in hashes:
            if h not in owner:
                owner[h] = tenant
                mine[h] = None
        if len(mine) > before:
            self.held[tier, self.label(tenant)] += len(mine) - before
        elif not mine:
            del self._mine[tier][tenant]

    def used(self, tier: str, hashes: Iterable[int]) -> None:
        """``hashes`` of ``tier`` were just loaded: the newest of their tenants' blocks."""
        owner = self._owner.get(tier)
        if not owner:
            return
        by_tenant = self._mine[tier]
        for h in hashes:
            tenant = owner.get(h)
            if tenant is not None:
                mine = by_tenant[tenant]
                del mine[h]
                mine[h] = None

    def owner(self, sequence_hash: int) -> str | None:
        """The tenant of a held block, in whichever tier holds it (None: unknown)."""
        for owner in self._owner.values():
            tenant = owner.get(sequence_hash)
            if tenant is not None:
                return tenant
        return None

    # -- what is held ----------------------------------------------------------------------
    def usage(self) -> dict[str, dict[str, int]]:
        """``{tier: {tenant: blocks held}}``, tenants with none left out."""
        return {tier: {t: len(m) for t, m in by_tenant.items() if m}
                for tier, by_tenant in self._mine.items()}

    def label(self, tenant: str) -> str:
        """``tenant`` as metrics show it: its name if the config names it, else
        :data:`TENANT_OTHERS`."""
        return tenant if tenant in self.named else TENANT_OTHERS

    # -- registry observer: removals ---------------------------------------------------------
    def on_tier_removed(self, tier: str, sequence_hashes: Sequence[int]) -> None:
        owner = self._owner.get(tier)
        if not owner:
            return
        by_tenant, held = self._mine[tier], self.held
        for h in sequence_hashes:
            tenant = owner.pop(h, None)
            if tenant is not None:
                mine = by_tenant[tenant]
                del mine[h]
                if not mine:
                    del by_tenant[tenant]
                key = (tier, self.label(tenant))
                held[key] -= 1
                if not held[key]:
                    del held[key]

    def on_tier_cleared(self, tier: str) -> None:
        if tier in self._owner:
            self._owner[tier].clear()
            self._mine[tier].clear()
            for key in [k for k in self.held if k[0] == tier]:
                del self.held[key]

    def on_tier_stored(self, tier: str, records: Sequence[BlockRecord]) -> None:
        """Nothing: the offload says whose they are (:meth:`stored`)."""
