import json
import struct

import msgpack
import pytest

from kvstrata.events import formats
from kvstrata.events.subscriber import SnapshotChunks
from kvstrata.events.model import (
    ClearedEvent,
    EventBatch,
    EventFormatError,
    PublisherIdentity,
    RemovedEvent,
    Snapshot,
    StoredBlock,
    StoredEvent,
)

IDENT = PublisherIdentity(publisher_id=0xABCDEF, worker_id=7, started_at=100.5)
STORED = StoredEvent(
    event_id=1,
    tier="G2",
    parent_hash=None,
    block_size=4,
    blocks=(StoredBlock(14643705804678351452, 14643705804678351452, (1, 2, 3, 4)), StoredBlock(4945711292740353085, 16777012769546811212, (5, 6, 7, 8))),
    ts=12.0,
)
REMOVED = RemovedEvent(2, "G1", (4945711292740353085,), 13.0)
CLEARED = ClearedEvent(3, "G3", (1, 2), 14.0)


# -- kvstrata JSON ------------------------------------------------------------------------------
def test_kvstrata_batch_round_trip():
    batch = EventBatch(IDENT, [STORED, REMOVED, CLEARED])
    raw = formats.encode_batch(batch)
    obj = json.loads(raw)
    assert obj["v"] == 1 and obj["publisher_id"] == 0xABCDEF and obj["worker_id"] == 7
    assert obj["events"][0] == {
        "type": "stored",
        "event_id": 1,
        "tier": "G2",
        "ts": 12.0,
        "parent_hash": None,
        "block_size": 4,
        "block_hashes": [14643705804678351452, 4945711292740353085],
        "tokens_hashes": [14643705804678351452, 16777012769546811212],
        "token_ids": [[1, 2, 3, 4], [5, 6, 7, 8]],
    }
    back = formats.decode_kvstrata(raw)
    assert back.identity == IDENT and back.events == [STORED, REMOVED, CLEARED]


def test_kvstrata_jsonl_lines_are_self_contained():
    text = formats.encode_jsonl(EventBatch(IDENT, [REMOVED, CLEARED]))
    lines = text.splitlines()
    assert len(lines) == 2
    first = json.loads(lines[0])
    assert first == {
        "publisher_id": 0xABCDEF,
        "worker_id": 7,
        "type": "removed",
        "event_id": 2,
        "tier": "G1",
        "ts": 13.0,
        "block_hashes": [4945711292740353085],
    }
    back = formats.decode_kvstrata(lines[1])
    assert back.events == [CLEARED] and back.identity.worker_id == 7


def test_snapshot_chunks_reassemble():
    events = [StoredEvent(9, "G1", None, 4, (StoredBlock(i, i),)) for i in range(1, 400)]
    chunks = formats.encode_snapshot(Snapshot(IDENT, 9, events), max_bytes=2000)
    assert len(chunks) > 3
    parts = [formats.decode_kvstrata(c) for c in chunks]
    assert all(isinstance(p, Snapshot) and p.last_event_id == 9 for p in parts)
    assert [json.loads(c)["last"] for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert [e for p in parts for e in p.events] == events


def _chunks(ident=IDENT, last_event_id=9, n=400):
    events = [StoredEvent(last_event_id, "G1", None, 4, (StoredBlock(i, i),))
              for i in range(1, n)]
    chunks = [formats.decode_snapshot_chunk(c) for c in formats.encode_snapshot(
        Snapshot(ident, last_event_id, events), max_bytes=2000)]
    assert len(chunks) > 3 and [c[1] for c in chunks] == list(range(len(chunks)))
    return events, chunks


def test_snapshot_chunks_are_whole_only_in_order_from_one_publisher():
    events, chunks = _chunks()
    gathered = SnapshotChunks()
    outs = [gathered.add(*c) for c in chunks]
    assert outs[:-1] == [None] * (len(chunks) - 1) and outs[-1].events == events
    assert outs[-1].identity == IDENT and outs[-1].last_event_id == 9 and not gathered.dropped
    # chunks lost on the way (core NATS may drop any): the rest is never the whole state
    for lost in ([0], [1], list(range(len(chunks) - 1))):
        gathered = SnapshotChunks()
        kept = [c for i, c in enumerate(chunks) if i not in lost]
        assert all(gathered.add(*c) is None for c in kept) and gathered.dropped
    repeated = SnapshotChunks()
    assert all(repeated.add(*c) is None for c in [chunks[0], chunks[1], chunks[1], *chunks[2:]])
    # another identity or event id under the same publisher id is not merged in
    _, forged = _chunks(PublisherIdentity(IDENT.publisher_id, 8, 100.5))
    _, later = _chunks(last_event_id=12)
    for other in (forged, later):
        mixed = SnapshotChunks()
        assert all(mixed.add(*c) is None for c in [*chunks[:2], *other[2:]])
        assert mixed.dropped
    # two publishers interleaved: each whole on its own; a fresh chunk 0 starts over
    _, second = _chunks(PublisherIdentity(0x1234, 7, 1.0))
    both = SnapshotChunks()
    wholes = [w for pair in zip(chunks, second) for w in (both.add(*pair[0]), both.add(*pair[1]))
              if w is not None]
    assert sorted(w.identity.publisher_id for w in wholes) == [0x1234, IDENT.publisher_id]
    again = SnapshotChunks()
    assert again.add(*chunks[0]) is None and again.add(*chunks[0]) is None   # restarts
    assert [again.add(*c) for c in chunks[1:]][-1].events == events and again.dropped == 1


@pytest.mark.parametrize("field, value", [("chunk", -1), ("chunk", "0"), ("last", "yes"),
                                          ("last", 1)])
def test_a_snapshot_chunk_with_a_bad_index_or_last_flag_is_refused(field, value):
    obj = json.loads(formats.encode_snapshot(Snapshot(IDENT, 9, []))[0])
    obj[field] = value
    with pytest.raises(EventFormatError, match=field):
        formats.decode_snapshot_chunk(json.dumps(obj))
    with pytest.raises(EventFormatError, match="not a snapshot"):
        formats.decode_snapshot_chunk(json.dumps({"publisher_id": 1, "worker_id": 1,
                                                  "events": []}))


@pytest.mark.parametrize(
    "bad,needle",
    [
        (b"{", "not valid JSON"),
        (b"[1]", "must be a JSON object"),
        (b'{"publisher_id":1,"worker_id":1,"type":"stored","event_id":1,"tier":"G9","block_hashes":[]}', "unknown tier"),
        (b'{"publisher_id":1,"worker_id":1,"type":"moved","event_id":1,"tier":"G1"}', "unknown event type"),
        (b'{"publisher_id":1,"worker_id":1,"type":"removed","event_id":-1,"tier":"G1","block_hashes":[]}', "event_id"),
        (b'{"publisher_id":1,"worker_id":1,"type":"removed","event_id":1,"tier":"G1","block_hashes":["x"]}', "block_hashes"),
        (b'{"publisher_id":1,"worker_id":1,"type":"stored","event_id":1,"tier":"G1","block_size":4,"block_hashes":[],"tokens_hashes":[]}', "non-empty"),
        (b'{"publisher_id":18446744073709551616,"worker_id":1,"type":"cleared","event_id":1,"tier":"G1"}', "publisher_id"),
        (b'{"publisher_id":1,"worker_id":1,"type":"cleared","event_id":18446744073709551616,"tier":"G1"}', "event_id"),
        (b'{"publisher_id":1,"worker_id":1,"started_at":"nan","type":"cleared","event_id":1,"tier":"G1"}', "started_at"),
        (b'{"publisher_id":1,"worker_id":1,"started_at":1e400,"type":"cleared","event_id":1,"tier":"G1"}', "started_at"),
        (b'{"publisher_id":1,"worker_id":1,"type":"snapshot","last_event_id":18446744073709551616,"events":[]}', "last_event_id"),
        (b'{"worker_id":1,"type":"cleared","event_id":1,"tier":"G1"}', "publisher_id"),
        (b'{"publisher_id":1,"worker_id":1,"type":"removed","event_id":1,"tier":[1],"block_hashes":[]}', "tier"),
        (b'{"publisher_id":1,"worker_id":1,"type":"removed","event_id":1,"tier":"G1","ts":"x","block_hashes":[]}', "'ts'"),
        (b'{"publisher_id":1,"worker_id":1,"type":"removed","event_id":1,"tier":"G1","block_hashes":[true]}', "block_hashes"),
        (b'{"publisher_id":1,"worker_id":1,"type":"stored","event_id":1,"tier":"G1","block_size":-1,"block_hashes":[1],"tokens_hashes":[1]}', "block_size"),
        (b'{"publisher_id":1,"worker_id":1,"type":"stored","event_id":1,"tier":"G1","block_size":4,"parent_hash":"p","block_hashes":[1],"tokens_hashes":[1]}', "parent_hash"),
        (b'{"publisher_id":1,"worker_id":1,"type":"stored","event_id":1,"tier":"G1","block_size":4,"block_hashes":[1],"tokens_hashes":[1],"token_ids":[[1.5]]}', "token_ids"),
    ],
)
def test_kvstrata_decode_errors(bad, needle):
    with pytest.raises(EventFormatError, match=needle):
        formats.decode_kvstrata(bad)


# -- Dynamo JSON --------------------------------------------------------------------------------
def test_dynamo_exact_shapes():
    msgs = [json.loads(m) for m in formats.encode_dynamo_messages(EventBatch(IDENT, [STORED, REMOVED, CLEARED]))]
    assert msgs[0] == {
        "worker_id": 7,
        "storage_tier": "host_pinned",
        "event": {
            "event_id": 1,
            "data": {
                "stored": {
                    "parent_hash": None,
                    "blocks": [
                        {"block_hash": 14643705804678351452, "tokens_hash": 14643705804678351452},
                        {"block_hash": 4945711292740353085, "tokens_hash": 16777012769546811212},
                    ],
                }
            },
            "dp_rank": 0,
        },
    }
    assert msgs[1] == {
        "worker_id": 7,
        "storage_tier": "device",
        "event": {"event_id": 2, "data": {"removed": {"block_hashes": [4945711292740353085]}}, "dp_rank": 0},
    }
    assert msgs[2] == {"worker_id": 7, "storage_tier": "disk", "event": {"event_id": 3, "data": "cleared", "dp_rank": 0}}
    # key order as Dynamo's serde writes it
    assert list(msgs[0]) == ["worker_id", "storage_tier", "event"]
    assert list(msgs[0]["event"]) == ["event_id", "data", "dp_rank"]


def test_dynamo_round_trip_and_errors():
    for ev in (STORED, REMOVED, CLEARED):
        wid, back = formats.decode_dynamo(formats.dynamo_router_event(ev, 7))
        assert wid == 7 and back.event_id == ev.event_id and back.tier == ev.tier and type(back) is type(ev)
    _, st = formats.decode_dynamo(formats.dynamo_router_event(STORED, 7))
    assert st.block_hashes == STORED.block_hashes and st.parent_hash is None
    with pytest.raises(EventFormatError, match="storage_tier"):
        formats.decode_dynamo({"worker_id": 1, "storage_tier": "tape", "event": {"event_id": 1, "data": "cleared"}})
    with pytest.raises(EventFormatError, match="unknown data"):
        formats.decode_dynamo({"worker_id": 1, "event": {"event_id": 1, "data": {"moved": {}}}})


# -- vLLM msgpack -------------------------------------------------------------------------------
def test_vllm_exact_bytes_small():
    # [1.5, [{"type": "AllBlocksCleared"}], 0] written out by hand from the msgpack spec
    expected = (
        b"\x93"  # array(3): ts, events, data_parallel_rank
        + b"\xcb" + struct.pack(">d", 1.5)  # float64
        + b"\x91"  # array(1)
        + b"\x81\xa4type\xb0AllBlocksCleared"  # map(1) {"type": "AllBlocksCleared"}
        + b"\x00"  # dp rank 0
    )
    assert formats.encode_vllm_batch([ClearedEvent(1, "G1")], 1.5) == expected
    legacy = b"\x93\xcb" + struct.pack(">d", 1.5) + b"\x91\x91\xb0AllBlocksCleared\x00"
    assert formats.encode_vllm_batch([ClearedEvent(1, "G1")], 1.5, layout="array") == legacy


def test_vllm_field_order_map_layout():
    raw = formats.encode_vllm_batch([STORED, REMOVED, CLEARED], 2.0)
    obj = msgpack.unpackb(raw, object_pairs_hook=list)
    assert obj[0] == 2.0 and obj[2] == 0
    stored, removed, cleared = obj[1]
    assert stored == [
        ("type", "BlockStored"),
        ("block_hashes", [14643705804678351452, 4945711292740353085]),
        ("parent_block_hash", None),
        ("token_ids", [1, 2, 3, 4, 5, 6, 7, 8]),
        ("block_size", 4),
        ("lora_id", None),
        ("medium", "CPU"),
        ("lora_name", None),
    ]
    assert removed == [("type", "BlockRemoved"), ("block_hashes", [4945711292740353085]), ("medium", "GPU")]
    # clearing a lower tier is said as a removal of what it held (AllBlocksCleared has no medium)
    assert cleared == [("type", "BlockRemoved"), ("block_hashes", [1, 2]), ("medium", "STORAGE")]


def test_vllm_hand_decoder_both_layouts():
    for layout in ("map", "array"):
        ts, events, dp = formats.decode_vllm_batch(formats.encode_vllm_batch([STORED, REMOVED], 3.0, 2, layout))
        assert ts == 3.0 and dp == 2
        assert events[0]["type"] == "BlockStored" and events[0]["block_size"] == 4
        assert events[0]["parent_block_hash"] is None and events[0]["medium"] == "CPU"
        assert events[1] == {"type": "BlockRemoved", "block_hashes": [4945711292740353085], "medium": "GPU"}
        back = formats.events_from_vllm(events)
        assert back[0].block_hashes == STORED.block_hashes and back[0].tier == "G2"
        assert back[0].blocks[1].token_ids == (5, 6, 7, 8)
    with pytest.raises(EventFormatError):
        formats.decode_vllm_batch(b"\xc1")


def test_vllm_own_classes_decode_our_bytes():
    try:
        import msgspec
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
    except Exception as exc:  # vLLM is a multi-GB optional install
        pytest.skip(f"vLLM not importable here ({type(exc).__name__}: {exc}); exact bytes are checked above")
    layout = "array" if getattr(BlockStored, "__struct_config__").array_like else "map"
    raw = formats.encode_vllm_batch([STORED, REMOVED, ClearedEvent(3, "G1")], 4.0, 0, layout)
    batch = msgspec.msgpack.Decoder(type=KVEventBatch).decode(raw)
    assert batch.ts == 4.0
    stored, removed, cleared = batch.events
    assert isinstance(stored, BlockStored) and list(stored.block_hashes) == STORED.block_hashes
    assert stored.token_ids == [1, 2, 3, 4, 5, 6, 7, 8] and stored.block_size == 4 and stored.medium == "CPU"
    assert isinstance(removed, BlockRemoved) and isinstance(cleared, AllBlocksCleared)
