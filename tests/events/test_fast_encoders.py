"""The item-based encoders (what the publisher's sinks run) against the dict reference forms.

``formats.json_event_texts`` / ``dynamo_event_texts`` / ``vllm_items`` write the wire formats
straight from the publisher's compact items with pre-built format strings; these tests pin
them byte for byte to ``json.dumps`` / ``msgpack.packb`` of the documented dict forms
(``event_to_dict``, ``dynamo_router_event``, ``vllm_event``).
"""

import json
import random

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.events import formats
from kvstrata.events.model import (
    ClearedEvent,
    EventBatch,
    PublisherIdentity,
    RemovedEvent,
    StoredBlock,
    StoredEvent,
    event_to_item,
    item_to_event,
)

from .native import native_or_python
@pytest.fixture(autouse=True, params=["native", "python"])
def _native_or_python(request, monkeypatch):
    """Every test here runs with the native fast paths (when built) and without them."""
    return native_or_python(request, monkeypatch)


IDENT = PublisherIdentity(publisher_id=2**64 - 1, worker_id=3, started_at=1795331161.25)

u64 = st.integers(0, 2**64 - 1)
tokens = st.one_of(st.none(), st.lists(st.integers(0, 2**31), max_size=5).map(tuple))
ts = st.one_of(st.floats(0, 2e9, allow_nan=False), st.integers(0, 2**31))
tier = st.sampled_from(["G1", "G2", "G3", "G4"])


@st.composite
def events(draw):
    out = []
    for eid in range(1, draw(st.integers(1, 12)) + 1):
        kind = draw(st.sampled_from(["stored", "stored", "removed", "cleared"]))
        if kind == "stored":
            n = draw(st.integers(1, 6))
            with_tokens = draw(st.booleans())
            blocks = tuple(
                StoredBlock(draw(u64), draw(u64), draw(tokens) if with_tokens else None) for _ in range(n)
            )
            if with_tokens and blocks[0].token_ids is None:
                blocks = (blocks[0]._replace(token_ids=(1, 2)),) + blocks[1:]
            out.append(
                StoredEvent(eid, draw(tier), draw(st.one_of(st.none(), u64)), draw(st.integers(0, 64)), blocks, draw(ts))
            )
        elif kind == "removed":
            out.append(RemovedEvent(eid, draw(tier), tuple(draw(st.lists(u64, min_size=1, max_size=4))), draw(ts)))
        else:
            out.append(ClearedEvent(eid, draw(tier), tuple(draw(st.lists(u64, max_size=4))), draw(ts)))
    return out


def _dumps(obj) -> str:
    return json.dumps(obj, separators=(",", ":"))


@settings(max_examples=150, deadline=None)
@given(events())
def test_items_round_trip_and_encoders_match_reference(evs):
    items = [event_to_item(e) for e in evs]
    assert [item_to_event(i) for i in items] == evs
    batch = EventBatch(IDENT, items=items)
    assert batch.events == evs and len(batch) == len(evs)

    # kvstrata batch (NATS payload)
    ref = dict(formats._identity_fields(IDENT), events=[formats.event_to_dict(e) for e in evs])
    assert formats.encode_batch(batch) == _dumps(ref).encode()
    assert formats.encode_batch(EventBatch(IDENT, evs)) == _dumps(ref).encode()
    # kvstrata JSON lines
    head = {"publisher_id": IDENT.publisher_id, "worker_id": IDENT.worker_id}
    assert formats.encode_jsonl(batch) == "".join(_dumps({**head, **formats.event_to_dict(e)}) + "\n" for e in evs)
    # Dynamo RouterEvents
    assert formats.encode_dynamo_messages(batch, dp_rank=2) == [
        _dumps(formats.dynamo_router_event(e, IDENT.worker_id, 2)).encode() for e in evs
    ]
    # vLLM KVEventBatch, both layouts
    for layout in ("map", "array"):
        ref_bytes = msgpack.packb([5.0, [formats.vllm_event(e, layout) for e in evs], 0], use_bin_type=True)
        assert formats.encode_vllm_items(items, 5.0, 0, layout) == ref_bytes
        assert formats.encode_vllm_batch(evs, 5.0, 0, layout) == ref_bytes
    # and the decoder reads it back
    back = formats.decode_kvstrata(formats.encode_batch(batch))
    assert [e.event_id for e in back.events] == [e.event_id for e in evs]


def test_documented_examples_are_exact():
    # the literal examples in docs/events.md
    a, b = 14643705804678351452, 4945711292740353085
    ident = PublisherIdentity(12097228711370203493, 3, 1795331161.25)
    stored = StoredEvent(1, "G1", None, 4, (StoredBlock(a, a), StoredBlock(b, 16777012769546811212)), 1795331161.5)
    removed = RemovedEvent(2, "G1", (b,), 1795331161.75)
    cleared = ClearedEvent(3, "G2", (a,), 1795331162.0)
    assert formats.encode_batch(EventBatch(ident, [stored, removed])) == (
        b'{"v":1,"publisher_id":12097228711370203493,"worker_id":3,"started_at":1795331161.25,"events":'
        b'[{"type":"stored","event_id":1,"tier":"G1","ts":1795331161.5,"parent_hash":null,"block_size":4,'
        b'"block_hashes":[14643705804678351452,4945711292740353085],'
        b'"tokens_hashes":[14643705804678351452,16777012769546811212]},'
        b'{"type":"removed","event_id":2,"tier":"G1","ts":1795331161.75,"block_hashes":[4945711292740353085]}]}'
    )
    assert formats.encode_jsonl(EventBatch(ident, [cleared])) == (
        '{"publisher_id":12097228711370203493,"worker_id":3,"type":"cleared","event_id":3,"tier":"G2",'
        '"ts":1795331162.0,"block_hashes":[14643705804678351452]}\n'
    )
    assert formats.encode_dynamo_messages(EventBatch(ident, [stored, removed, cleared])) == [
        b'{"worker_id":3,"storage_tier":"device","event":{"event_id":1,"data":{"stored":{"parent_hash":null,'
        b'"blocks":[{"block_hash":14643705804678351452,"tokens_hash":14643705804678351452},'
        b'{"block_hash":4945711292740353085,"tokens_hash":16777012769546811212}]}},"dp_rank":0}}',
        b'{"worker_id":3,"storage_tier":"device","event":{"event_id":2,"data":{"removed":'
        b'{"block_hashes":[4945711292740353085]}},"dp_rank":0}}',
        b'{"worker_id":3,"storage_tier":"host_pinned","event":{"event_id":3,"data":"cleared","dp_rank":0}}',
    ]


def test_long_chains_beyond_the_format_cache():
    n = formats._FMT_CACHE_MAX_N + 7
    rng = random.Random(1)
    blocks = tuple(StoredBlock(rng.getrandbits(64), rng.getrandbits(64)) for _ in range(n))
    evs = [StoredEvent(1, "G3", 5, 16, blocks, 2.5), RemovedEvent(2, "G3", tuple(b.block_hash for b in blocks), 3.0)]
    ref = dict(formats._identity_fields(IDENT), events=[formats.event_to_dict(e) for e in evs])
    assert formats.encode_batch(EventBatch(IDENT, evs)) == _dumps(ref).encode()
    assert n not in formats._stored_fmts


def test_batch_messages_split_under_the_limit_and_keep_order():
    rng = random.Random(2)
    evs = [
        StoredEvent(i, "G1", None, 16, tuple(StoredBlock(rng.getrandbits(64), rng.getrandbits(64)) for _ in range(4)), 1.0)
        for i in range(1, 301)
    ]
    batch = EventBatch(IDENT, evs)
    whole = formats.encode_batch(batch)
    one, ids = formats.encode_batch_messages(batch, len(whole))
    assert one == [whole] and ids == [1]
    limit = 4096
    payloads, ids = formats.encode_batch_messages(batch, limit)
    assert len(payloads) > 5 and all(len(p) <= limit for p in payloads)
    decoded = [formats.decode_kvstrata(p) for p in payloads]
    assert [d.events[0].event_id for d in decoded] == ids
    assert [e for d in decoded for e in d.events] == evs
    # a single event bigger than the limit still goes out, alone
    payloads, ids = formats.encode_batch_messages(EventBatch(IDENT, evs[:3]), 10)
    assert len(payloads) == 3 and ids == [1, 2, 3]


def test_integers_at_every_digit_and_word_boundary_print_as_python_does():
    """The native encoder prints ints from their digits in 8-digit chunks: every power of ten,
    every digit-word boundary of CPython's ints, the ends of u64 and beyond (negative and
    > 64-bit ints take its slower paths) must print exactly as ``%d``."""
    edges = {0, 2**64 - 1, 2**64, 2**70 + 3, -1, -(2**63), -(2**63) - 1}
    for k in range(21):
        edges |= {10**k - 1, 10**k, 10**k + 1}
    for bits in (30, 60, 63, 64):
        edges |= {2**bits - 1, 2**bits, 2**bits + 1}
    values = sorted(edges)
    items = [(i + 1, 1, "G1", "1.0", v) for i, v in enumerate(values)]
    items.append((len(items) + 1, 0, "G2", "2.0", values[-1], 16, None, *values, *values))
    texts = [",".join(map(str, item[4:])) for item in items[:-1]]
    assert texts == [str(v) for v in values]          # the reference prints them as str does
    payloads, _ = formats.encode_batch_messages(EventBatch(IDENT, items=items), 1 << 20)
    assert payloads == [(formats._batch_head(IDENT) + ",".join(formats.json_event_texts(items))
                         + "]}").encode()]
