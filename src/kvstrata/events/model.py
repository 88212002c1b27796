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

from kvstrata.logical.registry import TIER_NAMES, BlockRecord

STORAGE_TIER = {"G1": "device", "G2": "host_pinned", "G3": "disk", "G4": "external"}
"""kvstrata tier -> Dynamo ``storage_tier`` name."""
TIER_OF_STORAGE = {v: k for k, v in STORAGE_TIER.items()}

VLLM_MEDIUM = {"G1": "GPU", "G2": "CPU", "G3": "DISK", "G4": "REMOTE"}
"""kvstrata tier -> vLLM ``medium`` string."""
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


@dataclass(slots=True)
class EventBatch:
    """Events of one publisher, in ``event_id`` order, as shipped in one message."""

    identity: PublisherIdentity
    events: list[Event]


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
