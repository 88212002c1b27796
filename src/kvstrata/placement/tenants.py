"""Per-tenant quotas on the tiers kvstrata stores into: one busy tenant cannot evict the rest.

A *tenant* is whoever the engine says a block was computed for: in the vLLM connector
``"salt:" + cache_salt`` of the request, else ``"lora:" + adapter name``, else ``""``
(:func:`kvstrata.tokens.tenant_key`); the ``tenant`` argument of a manager's or planner's
store verbs. vLLM's salts and adapters also seed every sequence hash
(:func:`kvstrata.tokens.isolation_seed`), so its tenants never share a block; a manager's
caller must seed its hashes so too. A *quota* is the most blocks of one slot-addressed tier
(G2, G3) one tenant may hold (config: a tier's ``tenant_quota`` for every tenant,
``tenant_quotas`` per named tenant; :meth:`kvstrata.config.KvConfig.tenant_limits`).

The rules, applied when blocks are offered to a tier (:mod:`.offload`) and when blocks fetched
from outside are registered in one:

* a tenant under its quota stores as before: the tier's eviction policy picks victims among
  everyone's idle blocks;
* a tenant that would go over its quota first evicts its own idle blocks: its oldest
  conversation first, tail first (a block leaves only once no block held in the tier, or on
  its way there, extends it, whatever the tier's policy, so no prefix is cut out from under a
  held block), never a block of the batch or the parent of one; a block in use (being read)
  counts as just used; what still does not fit is not stored (skipped, reason ``quota``);
* a tenant already at its quota does not store a block whose parent kvstrata holds nowhere
  and is not receiving: it could only evict a reachable block to be unreachable itself;
* blocks on their way into a tier count against the quota until they arrive.

So when every block of a tier belongs to a tenant with a quota and the quotas add up to at
most the tier, every tenant keeps its quota's worth of it whatever the others store. Blocks
whose tenant no tier knows belong to :data:`RECOVERED_TENANT`: those a durable G3 recovered
at start (its index keeps no tenant) and those learned from a shared G4 (another worker
stored them; :meth:`~.planner.Planner.learn`), whenever they are stored in a tier with a
ledger. Together they are held to one tenant's quota, wherever they are stored or loaded up
to (unowned, they counted against none: after a restart one tenant's recovered blocks,
loaded back, took G2 from every other tenant, and blocks loaded from G4 did so too). With a
ledger no block is stored unowned (:mod:`.offload`); a block loaded up the tiers keeps the
tenant a lower tier knows it by, read before a failed copy of its prefix could drop it.

:class:`TenantLedger` keeps, per tier, which tenant each held block belongs to; in a tier
with a quota also how many held blocks (and blocks on their way) name each hash as their
parent, whether that parent is held or not (so a parent stored after its children, or again,
knows them), and per tenant its *leaves* (held blocks nothing extends) in a heap by the order
they were stored or last loaded: the next own victim is the heap's oldest, O(log n). It hears
every removal (evictions by the policy, drops, clears) from the registry, so it holds exactly
the blocks the tiers hold. Without any quota configured the planner makes no ledger: nothing
is tracked and nothing costs; a tier without a quota keeps only whose its blocks are (about
100 bytes a block), for blocks loaded up from it.
"""

from __future__ import annotations

import heapq
from collections import Counter
from typing import Collection, Iterable, Mapping, Sequence

from ..logical.pool import BlockPool
from ..logical.registry import RegistryObserver
from ..types import BlockRecord

__all__ = ["TenantLedger", "TENANT_OTHERS", "RECOVERED_TENANT"]

RECOVERED_TENANT = "(recovered)"
"""The tenant of the blocks whose tenant no tier knows: those a durable tier recovered at
start (its journal keeps none) and those learned from a shared G4 (another worker's). Not a
key vLLM's connector makes (``""``, ``salt:...``, ``lora:...``); under any quota a tenant
not named in ``tenant_quotas`` gets, and shown among the others (``*``)."""

TENANT_OTHERS = "*"
"""The label of tenants that ``tenant_quotas`` does not name, summed, in per-tenant
metrics: a tenant key can be a secret salt, so only names the operator wrote are shown."""


class _TierBook:
    """One tier's blocks of known tenants (see :class:`TenantLedger`). A tier without a
    quota (``limited`` False) keeps ``owner`` and ``count`` only."""

    __slots__ = ("limited", "owner", "count", "parent", "kids", "pending", "tick", "leaves",
                 "leaf_count")

    def __init__(self, limited: bool) -> None:
        self.limited = limited
        self.owner: dict[int, str] = {}
        self.count: Counter[str] = Counter()
        self.parent: dict[int, int] = {}
        """Each tracked block's recorded parent (held or not)."""
        self.kids: Counter[int] = Counter()
        """Per hash, tracked held blocks naming it as their parent (absent: none)."""
        self.pending: Counter[int] = Counter()
        """Per hash, blocks on their way into this tier naming it as their parent."""
        self.tick: dict[int, int] = {}
        """When each block was stored or last used."""
        self.leaves: dict[str, list[tuple[int, int]]] = {}
        """Per tenant, a heap of ``(tick, block)``; entries whose tick or leafness changed
        are stale and skipped (compacted when they outnumber the live ones)."""
        self.leaf_count: Counter[str] = Counter()
        """Per tenant, its held blocks that nothing held or coming extends."""

    def is_leaf(self, h: int) -> bool:
        return h in self.owner and h not in self.kids and h not in self.pending


class TenantLedger(RegistryObserver):
    """Which tenant holds which blocks of each tier, and their quotas (module docstring).

    ``limits`` maps each tier the ledger keeps to ``(quota of any tenant or None, {named
    tenant: quota})`` in blocks. Owner-thread only, like the pools; register it as an observer
    of the pools' registry so it hears removals."""

    def __init__(self, limits: Mapping[str, tuple[int | None, Mapping[str, int]]]) -> None:
        self._default = {tier: default for tier, (default, _) in limits.items()}
        self._named = {tier: dict(named) for tier, (_, named) in limits.items()}
        self.named = frozenset(t for _, named in limits.values() for t in named)
        """Tenants that the config names (their own label in metrics)."""
        self._books = {tier: _TierBook(default is not None or bool(named))
                       for tier, (default, named) in limits.items()}
        self._incoming: dict[str, Counter[str]] = {tier: Counter() for tier in limits}
        self._clock = 0
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

    def over(self, tier: str, tenant: str | None, count: int) -> int:
        """By how many blocks storing ``count`` more of ``tenant`` would exceed its quota of
        ``tier`` (0 or less: it fits)."""
        limit = None if tenant is None else self.limit(tier, tenant)
        if limit is None:
            return -1
        return self._books[tier].count[tenant] + self._incoming[tier][tenant] + count - limit

    def refuse(self, tier: str, tenant: str, count: int) -> None:
        """Count ``count`` blocks of ``tenant`` not stored in ``tier`` for its quota."""
        if count:
            self.refused[tier, self.label(tenant)] += count

    def room(self, pool: BlockPool, tenant: str | None, count: int,
             protect: Collection[int] = (), count_refused: bool = True) -> int:
        """How many of ``count`` blocks of ``tenant`` may be stored in ``pool``'s tier now;
        evicts the tenant's own idle blocks first to make room, never one of ``protect``
        (the batch's blocks and their parents). Counts what is refused in :attr:`refused`
        unless ``count_refused`` is False (a question asked before storing)."""
        if tenant is None or count <= 0:
            return count
        tier = pool.tier
        over = self.over(tier, tenant, count)
        if over <= 0:
            return count
        book = self._books[tier]
        if book.count[tenant]:
            made = self._evict_own(pool, book, tenant, over, protect)
            if made:
                self.evicted[tier, self.label(tenant)] += made
            over -= made
        if over <= 0:
            return count
        allowed = max(count - over, 0)
        if count_refused:
            self.refuse(tier, tenant, count - allowed)
        return allowed

    def _evict_own(self, pool: BlockPool, book: _TierBook, tenant: str, wanted: int,
                   protect: Collection[int]) -> int:
        """Drop up to ``wanted`` of ``tenant``'s leaves in ``pool``, oldest first; returns how
        many. A dropped leaf's parent becomes a leaf at its own (older) tick, so it comes
        next: a conversation goes tail first. A leaf in use is being read: it counts as just
        used. Each live leaf is tried once."""
        heap = book.leaves.get(tenant)
        dropped, tries, passed = 0, 0, []
        budget = book.leaf_count[tenant] + wanted
        while heap and dropped < wanted and tries < budget:
            entry = heapq.heappop(heap)
            if not self._live(book, tenant, entry):
                continue
            tries += 1
            h = entry[1]
            if h in protect:
                passed.append(entry)
            elif pool.reset_blocks((h,)):        # the registry tells us: the books update
                dropped += 1
            else:                                # in use, or extended by an untracked block
                self._clock += 1
                book.tick[h] = self._clock
                passed.append((self._clock, h))
        for entry in passed:
            heapq.heappush(heap, entry)
        return dropped

    @staticmethod
    def _live(book: _TierBook, tenant: str, entry: tuple[int, int]) -> bool:
        tick, h = entry
        return book.tick.get(h) == tick and book.owner.get(h) == tenant and book.is_leaf(h)

    def coming(self, tier: str, tenant: str | None, records: Sequence[BlockRecord],
               arriving: bool) -> None:
        """``records`` of ``tenant`` (None: unknown) are on their way into ``tier``
        (``arriving`` False: no longer, whether they arrived or not): they count against the
        tenant's quota, and their parents held there are no leaves, until then."""
        book = self._books.get(tier)
        if book is None:
            return
        step = 1 if arriving else -1
        if tenant is not None:
            incoming = self._incoming[tier]
            incoming[tenant] += step * len(records)
            if incoming[tenant] <= 0:
                del incoming[tenant]
        if not book.limited:
            return
        for record in records:
            p = record.parent_hash
            if p is not None:
                self._extend(book, p, book.pending, step)

    def _extend(self, book: _TierBook, p: int, counter: Counter[int], step: int) -> None:
        """One more (``step`` 1) or one fewer (-1) block extending ``p`` in ``counter``
        (held children or children on their way), keeping ``p``'s leafness in step."""
        was = book.is_leaf(p)
        counter[p] += step
        if counter[p] <= 0:
            del counter[p]
        now = book.is_leaf(p)
        if was != now:
            tenant = book.owner[p]
            book.leaf_count[tenant] += 1 if now else -1
            if now:                            # a leaf again, at its own tick: next in line
                heapq.heappush(book.leaves.setdefault(tenant, []), (book.tick[p], p))
                self._compact(book, tenant)

    def stored(self, tier: str, records: Iterable[BlockRecord], tenant: str | None) -> None:
        """``records`` were newly registered in ``tier`` for ``tenant`` (None: unknown)."""
        book = self._books.get(tier)
        if tenant is None or book is None:
            return
        owner = book.owner
        new = 0
        for record in records:
            h = record.sequence_hash
            if h in owner:
                continue
            owner[h] = tenant
            new += 1
            if not book.limited:
                continue
            self._clock += 1
            book.tick[h] = self._clock
            p = record.parent_hash
            if p is not None:
                book.parent[h] = p
                self._extend(book, p, book.kids, 1)
            if book.is_leaf(h):
                book.leaf_count[tenant] += 1
                heapq.heappush(book.leaves.setdefault(tenant, []), (self._clock, h))
        if new:
            book.count[tenant] += new
            self.held[tier, self.label(tenant)] += new
            if book.limited and tenant in book.leaves:
                self._compact(book, tenant)

    def used(self, tier: str, hashes: Iterable[int]) -> None:
        """``hashes`` of ``tier`` were just loaded: the newest of their tenants' blocks."""
        book = self._books.get(tier)
        if book is None or not book.limited or not book.owner:
            return
        touched: set[str] = set()
        for h in hashes:
            tenant = book.owner.get(h)
            if tenant is None:
                continue
            self._clock += 1
            book.tick[h] = self._clock
            if book.is_leaf(h):
                heapq.heappush(book.leaves.setdefault(tenant, []), (self._clock, h))
                touched.add(tenant)
        for tenant in touched:
            self._compact(book, tenant)

    def _compact(self, book: _TierBook, tenant: str) -> None:
        """Drop stale heap entries once they outnumber the live ones (amortized O(1) per
        entry, and an eviction never wades through more stale entries than live ones)."""
        heap = book.leaves.get(tenant)
        if heap is not None and len(heap) > 2 * book.leaf_count[tenant] + 64:
            # a block that became a leaf again is pushed at its old tick: one entry kept
            heap[:] = {e for e in heap if self._live(book, tenant, e)}
            heapq.heapify(heap)

    def owner(self, sequence_hash: int) -> str | None:
        """The tenant of a held block, in whichever tier holds it (None: unknown)."""
        for book in self._books.values():
            tenant = book.owner.get(sequence_hash)
            if tenant is not None:
                return tenant
        return None

    # -- what is held ----------------------------------------------------------------------
    def usage(self) -> dict[str, dict[str, int]]:
        """``{tier: {tenant: blocks held}}``, tenants with none left out (raw tenant keys:
        for tests and the process's own use, never for metrics)."""
        return {tier: {t: n for t, n in book.count.items() if n}
                for tier, book in self._books.items()}

    def label(self, tenant: str) -> str:
        """``tenant`` as metrics show it: its name if the config names it, else
        :data:`TENANT_OTHERS`."""
        return tenant if tenant in self.named else TENANT_OTHERS

    # -- registry observer: removals ---------------------------------------------------------
    def on_tier_removed(self, tier: str, sequence_hashes: Sequence[int]) -> None:
        book = self._books.get(tier)
        if book is None or not book.owner:
            return
        owner = book.owner
        for h in sequence_hashes:
            if h not in owner:
                continue
            leaf = book.is_leaf(h)
            tenant = owner.pop(h)
            book.count[tenant] -= 1
            key = (tier, self.label(tenant))
            self.held[key] -= 1
            if not self.held[key]:
                del self.held[key]
            if not book.limited:
                if not book.count[tenant]:
                    del book.count[tenant]
                continue
            del book.tick[h]
            if leaf:
                book.leaf_count[tenant] -= 1
            p = book.parent.pop(h, None)
            if p is not None:
                self._extend(book, p, book.kids, -1)
            if not book.count[tenant]:
                del book.count[tenant]
                book.leaves.pop(tenant, None)
                book.leaf_count.pop(tenant, None)

    def on_tier_cleared(self, tier: str) -> None:
        if tier in self._books:
            old = self._books[tier]
            self._books[tier] = _TierBook(old.limited)
            self._books[tier].pending = old.pending   # copies still on their way
            for key in [k for k in self.held if k[0] == tier]:
                del self.held[key]

    def on_tier_stored(self, tier: str, records: Sequence[BlockRecord]) -> None:
        """Nothing: the offload says whose they are (:meth:`stored`)."""
