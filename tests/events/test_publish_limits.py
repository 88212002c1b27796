"""Events stay within a transport's message limit, and a sink in trouble is visible.

* A long run of stored blocks (or a long removal) becomes several events of bounded size, on
  the native hooks and in Python alike; snapshot chunks cut events too large for them; a 30,000
  block run (~1.3 MB as one event) crosses a real nats-server with the default 1 MiB
  ``max_payload`` whole, live and through a snapshot, in kvstrata's format and Dynamo's.
* A message still over ``max_payload`` loses only its own events, not its neighbours'.
* A JetStream stream that disappeared is made again; while a sink is unavailable the lag
  metrics count the batch being retried, and the publisher says so.
* A ZMQ sink in vLLM's format says once that its events carry no token ids.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid

import pytest

from kvstrata.events import EventPublisher, SinkUnavailableError, TierState, formats, make_publisher
from kvstrata.events import publisher as publisher_module
from kvstrata.events.indexer import PrefixIndex
from kvstrata.events.model import (ClearedEvent, EventBatch, PublisherIdentity, Snapshot,
                                   StoredBlock, StoredEvent)
from kvstrata.events.publisher import Sink
from kvstrata.events.natsserver import free_port
from kvstrata.events.sinks import CallbackSink, MemorySink, snapshot_subject
from kvstrata.events.subscriber import NatsFollower, SnapshotChunks, read_events_file

from .helpers import chain
from .native import native_or_python

RUN = 30_000
WORKER = 5


@pytest.fixture(params=["native", "python"])
def paths(request, monkeypatch):
    """Run on the native hooks and encoder (when built) and without them."""
    return native_or_python(request, monkeypatch)


def _linked(events: list[StoredEvent]) -> list[int]:
    """The blocks of consecutive stored events, checking each continues the one before."""
    hashes: list[int] = []
    for e in events:
        assert e.parent_hash == (hashes[-1] if hashes else None)
        hashes += e.block_hashes
    return hashes


# -- where events are made --------------------------------------------------------------------


def test_a_long_run_becomes_linked_events_of_bounded_size(paths):
    pub = EventPublisher(MemorySink()).start()
    run = chain(1, 1200)
    pub.on_tier_stored("G1", run)
    pub.on_tier_stored("G1", chain(2, 5))
    pub.on_tier_removed("G1", [r.sequence_hash for r in run])
    assert pub.flush(30)
    events = pub.sink.events
    assert [(type(e).__name__, len(e.block_hashes)) for e in events] == [
        ("StoredEvent", 512), ("StoredEvent", 512), ("StoredEvent", 176), ("StoredEvent", 5),
        ("RemovedEvent", 512), ("RemovedEvent", 512), ("RemovedEvent", 176)]
    assert [e.event_id for e in events] == list(range(1, 8))     # one id each: no duplicates
    assert _linked(events[:3]) == [r.sequence_hash for r in run]
    assert [b.tokens_hash for e in events[:3] for b in e.blocks] == [r.local_hash for r in run]
    assert TierState().apply_all(events).hashes()["G1"] == pub.state()["G1"]
    assert pub.metrics()["enqueued"] == pub.metrics()["published"] == 7
    pub.close()


def test_the_native_hooks_leave_long_runs_to_python():
    hooks = publisher_module._native_hooks
    if hooks is None:
        pytest.skip("native hooks not built")
    pub = EventPublisher(MemorySink(), max_event_blocks=4, max_event_tokens=40).start()
    assert hooks.stored(pub, "G1", chain(1, 4)) is True
    assert hooks.stored(pub, "G1", chain(2, 5)) is False              # over max_event_blocks
    assert hooks.stored(pub, "G1", chain(3, 3, tokens=True)) is False  # 48 tokens > 40
    assert hooks.stored(pub, "G1", chain(4, 2, tokens=True)) is True
    assert hooks.removed(pub, "G1", [1, 2, 3, 4, 5]) is False
    assert pub.last_event_id == 2                                      # declined: nothing done
    pub.close()


def test_split_runs_are_the_same_on_both_paths(monkeypatch):
    """Runs with tokens, runs partly held (slow path), seeds: the C hooks and Python agree."""
    if publisher_module._native_hooks is None:
        pytest.skip("native hooks not built")

    def drive() -> list[tuple]:
        pub = EventPublisher(MemorySink(), max_event_blocks=7, max_event_tokens=40).start()
        pub.on_tier_stored("G1", chain(1, 20, block_size=8, tokens=True))   # 5 blocks an event
        pub.on_tier_stored("G1", chain(2, 7))
        partly = chain(3, 30)
        pub.on_tier_stored("G2", partly[10:12])
        pub.on_tier_stored("G2", partly)                                    # slow path
        pub.seed("G3", chain(4, 16)[::-1])
        pub.on_tier_removed("G2", [r.sequence_hash for r in partly] * 2)
        assert pub.flush(30)
        pub.close()
        return [(e.event_id, type(e).__name__, getattr(e, "parent_hash", None),
                 tuple(map(tuple, getattr(e, "blocks", ()))), tuple(getattr(e, "block_hashes", ())))
                for e in pub.sink.events]

    native = drive()
    monkeypatch.setattr(publisher_module, "_native_hooks", None)
    assert drive() == native
    sizes = [len(e[3]) or len(e[4]) for e in native]
    assert max(sizes) == 7 and sizes[:4] == [5, 5, 5, 5]


# -- where events are encoded -----------------------------------------------------------------


IDENT = PublisherIdentity(7, WORKER, 1.5)


def test_snapshot_chunks_fit_and_cut_long_events(paths):
    run = chain(1, 3000, tokens=True)
    event = StoredEvent(9, "G1", None, 16, tuple(
        StoredBlock(r.sequence_hash, r.local_hash, r.token_ids) for r in run))
    limit = 64 * 1024
    chunks = formats.encode_snapshot(Snapshot(IDENT, 9, [event, StoredEvent(
        9, "G2", None, 16, (StoredBlock(1, 2),))]), limit)
    assert len(chunks) >= 5 and all(len(c) <= limit for c in chunks)
    gathered = SnapshotChunks()
    whole = [gathered.add(*formats.decode_snapshot_chunk(c)) for c in chunks][-1]
    assert whole is not None and whole.last_event_id == 9
    g1 = [e for e in whole.events if e.tier == "G1"]
    assert _linked(g1) == [r.sequence_hash for r in run]
    assert [b.token_ids for e in g1 for b in e.blocks] == [r.token_ids for r in run]
    assert [e.tier for e in whole.events][-1] == "G2"


def test_an_oversized_cleared_event_goes_out_without_its_hashes(paths, tmp_path):
    items = [(1, 1, "G1", "1.0", 11), (2, 2, "G2", "2.0", *range(10**18, 10**18 + 100_000)),
             (3, 1, "G1", "3.0", 12)]
    payloads, ids = formats.encode_batch_messages(EventBatch(IDENT, items=items), 1 << 20)
    assert all(len(p) <= 1 << 20 for p in payloads) and ids[0] == 1
    events = [e for p in payloads for e in formats.decode_kvstrata(p).events]
    assert [e.event_id for e in events] == [1, 2, 3]
    assert isinstance(events[1], ClearedEvent) and events[1].block_hashes == ()
    # where it fits, the list stays (it is what a vLLM relay says as a removal)
    small = formats.encode_batch_messages(EventBatch(IDENT, items=items[:1] + [(2, 2, "G2", "2.0", 5)]), 1 << 20)
    assert json.loads(small[0][0])["events"][1]["block_hashes"] == [5]
    # a JSON-lines file: every line one a reader takes
    path = tmp_path / "events.jsonl"
    path.write_text(formats.encode_jsonl(EventBatch(IDENT, items=items)))
    assert [e.event_id for _, _, e in read_events_file(str(path))] == [1, 2, 3]


# -- a sink in trouble ------------------------------------------------------------------------


def test_lag_counts_the_batch_being_retried_and_the_publisher_warns(monkeypatch, caplog):
    monkeypatch.setattr(publisher_module, "UNAVAILABLE_WARN_AFTER", 0.2)
    up = threading.Event()
    got = []

    def send(batch):
        if not up.is_set():
            raise SinkUnavailableError("server down (test)")
        got.extend(batch.events)

    pub = EventPublisher(CallbackSink(send), max_delay=0, retry_backoff=(0.01, 0.05)).start()
    with caplog.at_level(logging.WARNING, logger="kvstrata.events.publisher"):
        for s in range(3):
            pub.on_tier_stored("G1", chain(s, 2))
        deadline = time.monotonic() + 30
        while "unavailable for" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.02)
        m = pub.metrics()
        assert m["lag"] == 3 and m["lag_seconds"] >= 0.2 and m["published"] == 0
        assert caplog.text.count("unavailable for") == 1 and "server down (test)" in caplog.text
        up.set()
        assert pub.flush(30)
    assert len(got) == 3 and pub.metrics()["lag"] == 0 and pub.metrics()["lag_seconds"] == 0
    pub.close()


class _LeavesOneOut(Sink):
    """Sends every batch but its last event (as a NATS sink does with one message too big)."""

    def __init__(self) -> None:
        self.sent: list = []

    def send(self, batch: EventBatch) -> int:
        self.sent += batch.events[:-1]
        return 1


def test_events_a_sink_left_out_are_counted_dropped():
    pub = EventPublisher(_LeavesOneOut(), max_delay=1.0).start()
    for s in range(3):
        pub.on_tier_stored("G1", chain(s, 2))
    assert pub.flush(30)
    m = pub.metrics()
    assert (m["published"], m["dropped"], m["sink_errors"], m["batches"]) == (2, 1, 1, 1)
    assert [e.event_id for e in pub.sink.sent] == [1, 2]
    pub.close()


def test_a_zmq_sink_says_once_that_its_events_carry_no_tokens(caplog):
    pytest.importorskip("zmq")
    with caplog.at_level(logging.WARNING, logger="kvstrata.events.sinks"):
        pub = make_publisher(f"zmq://tcp://127.0.0.1:{free_port()}", max_delay=0)
        pub.on_tier_stored("G1", chain(1, 2, tokens=True))
        assert pub.flush(30) and "token_ids" not in caplog.text
        pub.on_tier_stored("G1", chain(2, 2))
        pub.on_tier_stored("G1", chain(3, 2))
        assert pub.flush(30)
        pub.close()
    assert caplog.text.count("token_ids: []") == 1 and "keep_tokens" in caplog.text
    assert pub.sink.stored_without_tokens == 2


# -- a real nats-server -----------------------------------------------------------------------


def _subject() -> str:
    return f"kvlimits.{uuid.uuid4().hex[:10]}"


def _wait(predicate, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _holds_run(index: PrefixIndex, run) -> bool:
    """The index holds the whole run for the worker, linked (a prefix walk reaches its end)."""
    return index.match([r.sequence_hash for r in run]).get(WORKER, {}).get("G1") == len(run)


async def _request_snapshot(url: str, subject: str, worker: int) -> Snapshot | None:
    """One snapshot request, its chunks gathered; None if incomplete."""
    import nats as nats_py

    nc = await nats_py.connect(url)
    try:
        inbox = nc.new_inbox()
        replies: asyncio.Queue = asyncio.Queue()
        sub = await nc.subscribe(inbox, cb=replies.put)
        await nc.publish(snapshot_subject(subject, worker), b"", reply=inbox)
        gathered, whole = SnapshotChunks(), None
        while whole is None:
            msg = await asyncio.wait_for(replies.get(), 5)
            assert len(msg.data) <= nc.max_payload
            whole = gathered.add(*formats.decode_snapshot_chunk(msg.data))
        await sub.unsubscribe()
        return whole
    finally:
        await nc.close()


@pytest.mark.integration
@pytest.mark.parametrize("direct", ["1", "0"], ids=["direct", "nats-py"])
def test_a_30000_block_run_crosses_nats_whole_in_kvstrata_format(own_nats_server, direct):
    server = own_nats_server()
    subj = _subject()
    run = chain(1, RUN)
    live = PrefixIndex()
    with NatsFollower(server.url, subj, live) as nf:
        pub = make_publisher(f"{server.url}/{subj}?direct={direct}", worker_id=WORKER)
        assert _wait(lambda: pub.sink.connected)
        pub.on_tier_stored("G1", chain(9, 3))
        pub.on_tier_stored("G1", run)
        assert pub.flush(10)
        assert _wait(lambda: nf.follower.last_event_id(WORKER) == pub.last_event_id)
        assert _holds_run(live, run) and nf.follower.stats()["gaps"] == 0
        assert pub.metrics()["dropped"] == 0
    # a follower that missed all that catches up through the snapshot
    late = PrefixIndex()
    with NatsFollower(server.url, subj, late) as nf:
        pub.on_tier_stored("G1", chain(10, 2))
        assert pub.flush(10)
        assert _wait(lambda: nf.follower.stats()["snapshots_applied"] == 1
                     and nf.follower.last_event_id(WORKER) == pub.last_event_id)
        assert _holds_run(late, run) and late.hashes_in(WORKER, "G1") == pub.state()["G1"]
    assert pub.sink.snapshot_errors == 0
    pub.close()


@pytest.mark.integration
def test_a_30000_block_run_crosses_nats_whole_in_dynamo_format(own_nats_server):
    server = own_nats_server()
    subj = _subject()
    run = chain(1, RUN)
    index = PrefixIndex()
    with NatsFollower(server.url, subj, index, format="dynamo") as nf:
        pub = make_publisher(f"{server.url}/{subj}?format=dynamo", worker_id=WORKER, max_delay=0.5)
        assert _wait(lambda: pub.sink.connected)
        before = chain(9, 3)
        pub.on_tier_stored("G1", before)
        assert pub.flush(30)
        # one batch: a removal, a small store and the long run (its neighbours must arrive too)
        pub.on_tier_removed("G1", [r.sequence_hash for r in before])
        pub.on_tier_stored("G1", chain(10, 3))
        pub.on_tier_stored("G1", run)
        assert pub.flush(10)
        assert _wait(lambda: nf.follower.last_event_id(WORKER) == pub.last_event_id)
        assert _holds_run(index, run) and index.hashes_in(WORKER, "G1") == pub.state()["G1"]
        assert pub.metrics()["dropped"] == 0
    # the sink's snapshot service (kvstrata JSON) carries the run whole too
    snap = asyncio.run(_request_snapshot(server.url, subj, WORKER))
    from_snapshot = PrefixIndex()
    for event in snap.events:
        from_snapshot.apply_event(WORKER, event)
    assert _holds_run(from_snapshot, run) and snap.last_event_id == pub.last_event_id
    pub.close()


@pytest.mark.integration
@pytest.mark.parametrize("direct", ["1", "0"], ids=["direct", "nats-py"])
def test_a_message_over_max_payload_loses_only_its_own_events(own_nats_server, direct, caplog):
    server = own_nats_server("max_payload: 4096\n")
    subj = _subject()
    index = PrefixIndex()
    with NatsFollower(server.url, subj, index, format="dynamo") as nf:
        pub = make_publisher(f"{server.url}/{subj}?format=dynamo&direct={direct}",
                             worker_id=WORKER, max_delay=0.5)
        assert _wait(lambda: pub.sink.connected)
        before, small, big = chain(1, 3), chain(2, 3), chain(3, 100)   # big: ~7 KB in Dynamo's
        pub.on_tier_stored("G1", before)
        assert pub.flush(30)
        with caplog.at_level(logging.WARNING, logger="kvstrata.events.sinks"):
            pub.on_tier_removed("G1", [r.sequence_hash for r in before])
            pub.on_tier_stored("G1", big)
            pub.on_tier_stored("G1", small)
            assert pub.flush(30)
        assert _wait(lambda: nf.follower.last_event_id(WORKER) == pub.last_event_id)
        held = index.hashes_in(WORKER, "G1")
        assert held == {r.sequence_hash for r in small}      # the removal and the store arrived
        m = pub.metrics()
        assert m["dropped"] == 1 and m["published"] == 3 and m["sink_errors"] == 1
        assert "max_payload" in caplog.text and pub.sink.too_large_events == 1
        if direct == "1":
            assert pub.sink._wire.connects == 1
    # the snapshot, in chunks the server takes, carries the event it lost
    snap = asyncio.run(_request_snapshot(server.url, subj, WORKER))
    state = TierState().apply_all(snap.events).hashes()
    assert state["G1"] == {r.sequence_hash for r in small + big}
    pub.close()


@pytest.mark.integration
def test_a_jetstream_stream_that_disappeared_is_made_again(own_nats_server, monkeypatch, caplog):
    import nats as nats_py
    from nats.js.api import StreamConfig

    monkeypatch.setattr(publisher_module, "UNAVAILABLE_WARN_AFTER", 0.3)
    server = own_nats_server()
    subj = _subject()
    pub = make_publisher(f"{server.url}/{subj}?jetstream=1", worker_id=WORKER, max_delay=0)
    stream = pub.sink.stream
    assert _wait(lambda: pub.sink.connected)
    pub.on_tier_stored("G1", chain(1, 2))
    assert pub.flush(30)

    async def admin(action):
        nc = await nats_py.connect(server.url)
        try:
            return await action(nc.jetstream())
        finally:
            await nc.close()

    def messages() -> int:
        return asyncio.run(admin(lambda js: js.stream_info(stream))).state.messages

    # deleted: the next batch makes it again and is stored there
    asyncio.run(admin(lambda js: js.delete_stream(stream)))
    with caplog.at_level(logging.WARNING, logger="kvstrata.events.sinks"):
        pub.on_tier_stored("G1", chain(2, 2))
        assert pub.flush(10)
    assert messages() == 1 and pub.sink.streams_recreated == 1 and "made it again" in caplog.text
    # stuck (a stream of that name that does not hold the subject): lag shows it, a warning
    asyncio.run(admin(lambda js: js.delete_stream(stream)))
    asyncio.run(admin(lambda js: js.add_stream(StreamConfig(name=stream, subjects=[subj + ".other"]))))
    with caplog.at_level(logging.WARNING, logger="kvstrata.events.publisher"):
        pub.on_tier_stored("G1", chain(3, 2))
        assert _wait(lambda: "unavailable for" in caplog.text)
        m = pub.metrics()
        assert m["lag"] == 1 and m["lag_seconds"] >= 0.3 and "does not hold subject" in caplog.text
    asyncio.run(admin(lambda js: js.delete_stream(stream)))
    assert pub.flush(10) and messages() == 1 and pub.metrics()["lag"] == 0
    assert pub.metrics()["dropped"] == 0 and pub.metrics()["published"] == 3
    pub.close()
