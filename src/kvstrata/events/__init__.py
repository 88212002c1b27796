"""The event plane: what the block manager holds, published for routers and storage systems.

Quick start::

    from kvstrata.events import make_publisher
    publisher = make_publisher("jsonl:/tmp/events.jsonl")   # or nats://..., zmq://..., none
    registry.add_observer(publisher)
    ...
    publisher.close()

See docs/events.md for the event model, formats, sink specs, snapshots, metrics and the indexer.
"""

from kvstrata.events.model import (
    ClearedEvent,
    Event,
    EventBatch,
    EventFormatError,
    PublisherIdentity,
    RemovedEvent,
    Snapshot,
    StoredBlock,
    StoredEvent,
    TierState,
)
from kvstrata.events.publisher import EventPublisher, Sink, SinkUnavailableError
from kvstrata.events.spec import SinkSpec, SinkSpecError, make_publisher, make_sink, parse_sink_spec
from kvstrata.events.subscriber import StreamFollower, WorkerStates

__all__ = [
    "ClearedEvent",
    "Event",
    "EventBatch",
    "EventFormatError",
    "EventPublisher",
    "PublisherIdentity",
    "RemovedEvent",
    "Sink",
    "SinkSpec",
    "SinkSpecError",
    "SinkUnavailableError",
    "Snapshot",
    "StoredBlock",
    "StoredEvent",
    "StreamFollower",
    "TierState",
    "WorkerStates",
    "make_publisher",
    "make_sink",
    "parse_sink_spec",
]
