"""The event model: what a consumer sees of the registry, one event per change, per tier.

Three kinds of event, each tied to one tier ("G1".."G4") and carrying a per-publisher strictly
increasing ``event_id``:

* :class:`StoredEvent` - a chain of blocks became visible in ``tier``. ``blocks`` are in chain
  order; ``blocks[0].parent_hash`` is ``parent_hash`` and each later block's parent is the one
  before it (a registry batch holding several chains becomes several stored events).
* :class:`RemovedEvent` - ``block_hashes`` stopped being visible in ``tier``.
* :class:`ClearedEvent` - ``tier`` was emptied at once (``block_hashes`` lists what it held,
  so formats without a "clear one tier" verb can say it as a removal).

A publisher emits a stored event only when a hash *enters* a tier and a removed event only when
it *leaves*, so replaying the events in ``event_id`` order from an empty state gives exactly the
publisher's state (see :class:`TierState`).
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator, NamedTuple, Sequence

from ..tiers import TIER_NAMES, TIERS
from ..types import BlockRecord

STORAGE_TIER = {s.name: s.router_name for s in TIERS}
"""kvstrata tier -> Dynamo ``storage_tier`` name (from :mod:`kvstrata.tiers`)."""
TIER_OF_STORAGE = {v: k for k, v in STORAGE_TIER.items()}

VLLM_MEDIUM = {s.name: s.vllm_medium for s in TIERS}
"""kvstrata tier -> vLLM ``medium`` string (from :mod:`kvstrata.tiers`)."""
TIER_OF_MEDIUM = {v: k for k, v in VLLM_MEDIUM.items()}


class EventFormatError(ValueError):
    """A message or line could not be decoded as an event (names what was wrong)."""


@dataclass(frozen=True, slots=True)
class PublisherIdentity:
    """Who published an event stream.

    ``publisher_id`` is a random 64-bit id drawn at start, so it changes whenever the publisher
    restarts (a consumer seeing a new id for a known worker must drop that worker's state).
    ``worker_id`` names the worker (stable across restarts when configured; an unsigned 64-bit
    integer so it also fits Dynamo's ``worker_id``).
    """

    publisher_id: int
    worker_id: int
    started_at: float

    @classmethod
    def new(cls, worker_id: int | None = None) -> "PublisherIdentity":
        publisher_id = secrets.randbits(64)
        if worker_id is None:
            worker_id = publisher_id
        if not 0 <= int(worker_id) < 2**64:
            raise ValueError(f"worker_id must be an unsigned 64-bit integer, got {worker_id!r}")
        return cls(publisher_id=publisher_id, worker_id=int(worker_id), started_at=time.time())


class StoredBlock(NamedTuple):
    """One block of a stored event: its sequence hash, local (tokens) hash and optional tokens."""

    block_hash: int
    tokens_hash: int
    token_ids: tuple[int, ...] | None = None


@dataclass(slots=True)
class StoredEvent:
    event_id: int
    tier: str
    parent_hash: int | None
    block_size: int
    blocks: tuple[StoredBlock, ...]
    ts: float = 0.0
    kind = "stored"

    @property
    def block_hashes(self) -> list[int]:
        return [b.block_hash for b in self.blocks]

    def records(self) -> list[BlockRecord]:
        """The blocks as registry records (parents chained)."""
        out = []
        parent = self.parent_hash
        for b in self.blocks:
            out.append(BlockRecord(b.block_hash, b.tokens_hash, parent, self.block_size, b.token_ids))
            parent = b.block_hash
        return out


@dataclass(slots=True)
class RemovedEvent:
    event_id: int
    tier: str
    block_hashes: tuple[int, ...]
    ts: float = 0.0
    kind = "removed"


@dataclass(slots=True)
class ClearedEvent:
    event_id: int
    tier: str
    block_hashes: tuple[int, ...] = ()
    ts: float = 0.0
    kind = "cleared"


Event = StoredEvent | RemovedEvent | ClearedEvent


# Compact event items: what the publisher buffers and the encoders read (no per-event objects
# on the hot path). One flat tuple per event holding only ints, strings, None (and tuples of
# ints for tokens), so it is a single allocation and the garbage collector untracks it at its
# first pass (a buffer of many thousand items costs the collector nothing later):
#   (event_id, STORED,  tier, ts_text, parent, block_size, token_ids, h1..hn, l1..ln)
#   (event_id, REMOVED, tier, ts_text, h1..hk)
#   (event_id, CLEARED, tier, ts_text, h1..hk)
# ``ts_text`` is ``repr(ts)`` (JSON-ready; ``float(ts_text) == ts``); ``parent`` is the parent
# hash or the string "null" (:data:`NO_PARENT`), as JSON writes it; ``h`` are sequence hashes
# in chain order, ``l`` the matching local (tokens) hashes; ``token_ids`` is None when the
# chain's first block carries no tokens, else one tuple (or None) per block. This layout lets
# the JSON encoder format an item with one ``fmt % item`` (see kvstrata.events.formats).
STORED, REMOVED, CLEARED = 0, 1, 2
ITEM_HEAD = 7
"""Index of a stored item's first sequence hash (``ITEM_HEAD`` fields precede the hashes)."""
NO_PARENT = "null"
"""A stored item's ``parent`` when the first block has none."""


def stored_item(event_id: int, tier: str, chain: Sequence[BlockRecord], ts: float) -> tuple:
    """The item of a stored event for ``chain`` (records linked parent to child)."""
    first = chain[0]
    tokens = tuple([r.token_ids for r in chain]) if first.token_ids is not None else None
    parent = first.parent_hash
    return (
        event_id,
        STORED,
        tier,
        repr(ts),
        NO_PARENT if parent is None else parent,
        first.block_size,
        tokens,
        *[r.sequence_hash for r in chain],
        *[r.local_hash for r in chain],
    )


def item_blocks(item: tuple) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A stored item's (sequence hashes, local hashes)."""
    n = (len(item) - ITEM_HEAD) >> 1
    return item[ITEM_HEAD : ITEM_HEAD + n], item[ITEM_HEAD + n :]


def item_parent(item: tuple) -> int | None:
    """A stored item's parent hash (None for a first block)."""
    parent = item[4]
    return None if parent is NO_PARENT or parent == NO_PARENT else parent


def item_to_event(item: tuple) -> "Event":
    """One buffered item as an event object."""
    kind = item[1]
    ts = float(item[3])
    if kind == STORED:
        hashes, locals_ = item_blocks(item)
        tokens = item[6]
        if tokens is None:
            blocks = tuple([_new_block(StoredBlock, (h, lh, None)) for h, lh in zip(hashes, locals_)])
        else:
            blocks = tuple([_new_block(StoredBlock, b) for b in zip(hashes, locals_, tokens)])
        return StoredEvent(item[0], item[2], item_parent(item), item[5], blocks, ts)
    if kind == REMOVED:
        return RemovedEvent(item[0], item[2], item[4:], ts)
    return ClearedEvent(item[0], item[2], item[4:], ts)


def event_to_item(event: "Event") -> tuple:
    """One event object as a buffered item (the inverse of :func:`item_to_event`)."""
    if type(event) is StoredEvent:
        blocks = event.blocks
        tokens = tuple([b[2] for b in blocks]) if blocks[0][2] is not None else None
        parent = event.parent_hash
        return (
            event.event_id,
            STORED,
            event.tier,
            repr(event.ts),
            NO_PARENT if parent is None else parent,
            event.block_size,
            tokens,
            *[b[0] for b in blocks],
            *[b[1] for b in blocks],
        )
    if type(event) is RemovedEvent:
        return (event.event_id, REMOVED, event.tier, repr(event.ts), *event.block_hashes)
    if type(event) is ClearedEvent:
        return (event.event_id, CLEARED, event.tier, repr(event.ts), *event.block_hashes)
    raise TypeError(f"not an event: {event!r}")


class EventBatch:
    """Events of one publisher, in ``event_id`` order, as shipped in one message.

    Built either from event objects (``EventBatch(identity, events)``) or, by the publisher,
    from compact items (``EventBatch(identity, items=...)``); each view is derived lazily from
    the other, so sinks that encode straight from ``items`` never build event objects.
    """

    __slots__ = ("identity", "_events", "_items")

    def __init__(
        self, identity: PublisherIdentity, events: list["Event"] | None = None, *, items: list[tuple] | None = None
    ) -> None:
        if events is None and items is None:
            events = []
        self.identity = identity
        self._events = events
        self._items = items

    @property
    def events(self) -> list["Event"]:
        if self._events is None:
            self._events = [item_to_event(i) for i in self._items]  # type: ignore[union-attr]
        return self._events

    @property
    def items(self) -> list[tuple]:
        if self._items is None:
            self._items = [event_to_item(e) for e in self._events]  # type: ignore[union-attr]
        return self._items

    def __len__(self) -> int:
        return len(self._items) if self._items is not None else len(self._events)  # type: ignore[arg-type]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, EventBatch):
            return NotImplemented
        return self.identity == other.identity and self.events == other.events

    def __repr__(self) -> str:
        return f"EventBatch(identity={self.identity!r}, events={self.events!r})"


@dataclass(slots=True)
class Snapshot:
    """What each tier of one publisher held right after event ``last_event_id``.

    ``events`` are stored events (chains, parents first where the tier holds them) whose
    ``event_id`` is ``last_event_id``; applying them to an empty state and then every live
    event with a larger id reproduces the publisher's state with no gap and no duplicate.
    """

    identity: PublisherIdentity
    last_event_id: int
    events: list[StoredEvent] = field(default_factory=list)


def check_tier(tier: str) -> str:
    if tier not in TIER_NAMES:
        raise EventFormatError(f"unknown tier {tier!r} (expected one of {', '.join(TIER_NAMES)})")
    return tier


def split_chains(records: Sequence[BlockRecord]) -> Iterator[list[BlockRecord]]:
    """Split registry records into runs where each record's parent is the record before it.

    Records of different block sizes never share a run (a stored event has one block size).
    """
    run: list[BlockRecord] = []
    prev: BlockRecord | None = None
    for record in records:
        if (
            prev is not None
            and record.parent_hash == prev.sequence_hash
            and record.block_size == prev.block_size
        ):
            run.append(record)
        else:
            if run:
                yield run
            run = [record]
        prev = record
    if run:
        yield run


_new_block = tuple.__new__  # StoredBlock without the NamedTuple __new__ frame


def stored_event(event_id: int, tier: str, chain: Sequence[BlockRecord], ts: float) -> StoredEvent:
    """A stored event for ``chain`` (records linked parent to child, as :func:`split_chains`)."""
    first = chain[0]
    return StoredEvent(
        event_id=event_id,
        tier=tier,
        parent_hash=first.parent_hash,
        block_size=first.block_size,
        blocks=tuple([_new_block(StoredBlock, (r.sequence_hash, r.local_hash, r.token_ids)) for r in chain]),
        ts=ts,
    )


class TierState:
    """Tier -> ordered {sequence hash: record}: the exact state an event stream describes.

    The publisher keeps one as its shadow (to filter no-op changes and to serve snapshots); a
    consumer can keep one to check it replayed the stream correctly.
    """

    __slots__ = ("tiers",)

    def __init__(self) -> None:
        self.tiers: dict[str, dict[int, BlockRecord]] = {t: {} for t in TIER_NAMES}

    def apply(self, event: Event) -> None:
        held = self.tiers[event.tier]
        if isinstance(event, StoredEvent):
            for record in event.records():
                held[record.sequence_hash] = record
        elif isinstance(event, RemovedEvent):
            for h in event.block_hashes:
                held.pop(h, None)
        else:
            held.clear()

    def apply_all(self, events: Iterable[Event]) -> "TierState":
        for event in events:
            self.apply(event)
        return self

    def hashes(self) -> dict[str, set[int]]:
        """Tier -> set of hashes, for every tier (empty tiers included)."""
        return {t: set(held) for t, held in self.tiers.items()}

    def snapshot_events(self, event_id: int, ts: float = 0.0) -> list[StoredEvent]:
        """The state as stored events (chains in insertion order), all with ``event_id``."""
        out: list[StoredEvent] = []
        for tier, held in self.tiers.items():
            for chain in split_chains(list(held.values())):
                out.append(stored_event(event_id, tier, chain, ts))
        return out
