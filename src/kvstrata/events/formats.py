"""Wire formats: kvstrata JSON, Dynamo KV-router JSON, vLLM ``KVEventBatch`` msgpack.

(Over 800 lines on purpose: one concern, the wire formats; all three encode the publisher's
compact items and decode through the same field checks to one ``EventFormatError``, and each
encoder sits beside its decoder and reference dict form.)

Every encoder here is a pure function of events; every decoder raises
:class:`~kvstrata.events.model.EventFormatError` naming what is wrong. See docs/events.md for
a literal example of each format.

The encoders work on the publisher's compact items (``EventBatch.items``, see
:mod:`kvstrata.events.model`) and write JSON text with pre-built ``%``-format strings (one
format operation per event, integers rendered by ``%d``), which is several times cheaper than
building dicts for :func:`json.dumps`. The output is byte-identical to
``json.dumps(..., separators=(",", ":"))`` of the dict forms (:func:`event_to_dict`,
:func:`dynamo_router_event`), which stay as the reference (tests compare the two).
"""

from __future__ import annotations

import functools
import math
import os

import json
from itertools import chain as _chain
from typing import Any, Iterable, Sequence

from kvstrata.paths import MAX_LINE_BYTES
from kvstrata.events.model import (
    CLEARED,
    ITEM_HEAD,
    STORAGE_TIER,
    TIER_OF_MEDIUM,
    TIER_OF_STORAGE,
    VLLM_MEDIUM,
    ClearedEvent,
    Event,
    EventBatch,
    EventFormatError,
    PublisherIdentity,
    RemovedEvent,
    Snapshot,
    StoredBlock,
    StoredEvent,
    check_tier,
    event_to_item,
    item_blocks,
    item_parent,
)
from kvstrata.tiers import TIER_NAMES, TOP_TIER

_TIERS = frozenset(TIER_NAMES)
_new_block = tuple.__new__  # StoredBlock without the NamedTuple __new__ frame

FORMAT_VERSION = 1

# --------------------------------------------------------------------------------------------
# kvstrata JSON (own format): one event = one dict; a batch/snapshot wraps them with identity.
# --------------------------------------------------------------------------------------------


def event_to_dict(event: Event) -> dict[str, Any]:
    """One event as a kvstrata JSON object (without publisher identity)."""
    if type(event) is StoredEvent:
        blocks = event.blocks
        obj = {
            "type": "stored",
            "event_id": event.event_id,
            "tier": event.tier,
            "ts": event.ts,
            "parent_hash": event.parent_hash,
            "block_size": event.block_size,
            "block_hashes": [b[0] for b in blocks],
            "tokens_hashes": [b[1] for b in blocks],
        }
        if blocks[0][2] is not None:
            obj["token_ids"] = [list(b[2]) if b[2] is not None else None for b in blocks]
        return obj
    if type(event) is RemovedEvent:
        return {
            "type": "removed",
            "event_id": event.event_id,
            "tier": event.tier,
            "ts": event.ts,
            "block_hashes": list(event.block_hashes),
        }
    if type(event) is ClearedEvent:
        return {
            "type": "cleared",
            "event_id": event.event_id,
            "tier": event.tier,
            "ts": event.ts,
            "block_hashes": list(event.block_hashes),
        }
    raise TypeError(f"not an event: {event!r}")


def _identity_fields(identity: PublisherIdentity) -> dict[str, Any]:
    return {
        "v": FORMAT_VERSION,
        "publisher_id": identity.publisher_id,
        "worker_id": identity.worker_id,
        "started_at": identity.started_at,
    }


# -- fast JSON text from items ------------------------------------------------------------------
_FMT_CACHE_MAX_N = 256  # cache format strings for hash lists up to this long


def _ints(n: int) -> str:
    return ",".join(("%d",) * n)


# Formats applied to a whole item (``fmt % item``): ``%.0s`` swallows the fields JSON does not
# show at that place (the kind, and tokens, appended separately when present).
_STORED_HEAD = '{"type":"stored","event_id":%d%.0s,"tier":"%s","ts":%s,"parent_hash":%s,"block_size":%d%.0s,"block_hashes":['
_stored_fmts: dict[int, str] = {}
_removed_fmts: dict[int, str] = {}


def _stored_fmt(n: int) -> str:
    ints = _ints(n)
    fmt = _STORED_HEAD + ints + '],"tokens_hashes":[' + ints + "]}"
    if n <= _FMT_CACHE_MAX_N:
        _stored_fmts[n] = fmt
    return fmt


def _removed_fmt(n: int) -> str:
    fmt = '{"type":"removed","event_id":%d%.0s,"tier":"%s","ts":%s,"block_hashes":[' + _ints(n) + "]}"
    if n <= _FMT_CACHE_MAX_N:
        _removed_fmts[n] = fmt
    return fmt


def _token_ids_json(tokens: Sequence[Any]) -> str:
    """``,"token_ids":[[...],...]`` (one list, or null, per block)."""
    return (
        ',"token_ids":['
        + ",".join(["[" + ",".join(map(str, t)) + "]" if t is not None else "null" for t in tokens])
        + "]"
    )


def json_event_texts(items: Sequence[tuple]) -> list[str]:
    """Each item as its kvstrata JSON object text (the elements of a batch's ``events``)."""
    out: list[str] = []
    append = out.append
    stored_fmts = _stored_fmts
    removed_fmts = _removed_fmts
    for item in items:
        kind = item[1]
        if kind == 0:
            n = (len(item) - 7) >> 1
            text = (stored_fmts.get(n) or _stored_fmt(n)) % item
            if item[6] is not None:
                text = text[:-1] + _token_ids_json(item[6]) + "}"
            append(text)
        elif kind == 1:
            n = len(item) - 4
            append((removed_fmts.get(n) or _removed_fmt(n)) % item)
        else:
            append(
                '{"type":"cleared","event_id":%d,"tier":"%s","ts":%s,"block_hashes":[%s]}'
                % (item[0], item[2], item[3], ",".join(map(str, item[4:])))
            )
    return out


def _batch_head(identity: PublisherIdentity) -> str:
    return '{"v":%d,"publisher_id":%d,"worker_id":%d,"started_at":%r,"events":[' % (
        FORMAT_VERSION,
        identity.publisher_id,
        identity.worker_id,
        identity.started_at,
    )


def _native_encode_message():
    if os.environ.get("KVSTRATA_NATIVE_EVENTS", "1") == "0":
        return None
    try:
        from kvstrata.events._native import encode_message
    except ImportError:
        return None
    return encode_message


native_encode_message = _native_encode_message()
"""``_native.encode_message(head, items)``: ``(head + ",".join(json_event_texts(items)) +
"]}").encode()`` in one C call, or None for items it leaves to Python (tokens, cleared
events); None when not built."""


def encode_batch(batch: EventBatch) -> bytes:
    """A batch as one kvstrata JSON message (the NATS payload in ``format=kvstrata``)."""
    head = _batch_head(batch.identity)
    if native_encode_message is not None:
        payload = native_encode_message(head, batch.items)
        if payload is not None:
            return payload
    return (head + ",".join(json_event_texts(batch.items)) + "]}").encode()


def encode_batch_messages(batch: EventBatch, max_bytes: int) -> tuple[list[bytes], list[int]]:
    """A batch as kvstrata JSON messages of at most ``max_bytes`` each (one unless it is too
    big; a single event larger than ``max_bytes`` still gets its own message). Returns the
    payloads and the first event id of each."""
    items = batch.items
    head = _batch_head(batch.identity)
    if native_encode_message is not None:
        payload = native_encode_message(head, items)
        if payload is not None and len(payload) <= max_bytes:
            return [payload], [items[0][0]]
    fixed = len(head) + 2
    texts = _fitting_texts(items, max_bytes - fixed)
    if fixed + sum(map(len, texts)) + len(texts) - 1 <= max_bytes:
        return [(head + ",".join(texts) + "]}").encode()], [items[0][0]]
    payloads: list[bytes] = []
    first_ids: list[int] = []
    start = 0
    size = fixed - 1
    for i, text in enumerate(texts):
        if i > start and size + len(text) + 1 > max_bytes:
            payloads.append((head + ",".join(texts[start:i]) + "]}").encode())
            first_ids.append(items[start][0])
            start, size = i, fixed - 1
        size += len(text) + 1
    payloads.append((head + ",".join(texts[start:]) + "]}").encode())
    first_ids.append(items[start][0])
    return payloads, first_ids


def _fitting_texts(items: Sequence[tuple], room: int) -> list[str]:
    """:func:`json_event_texts`, but a cleared event longer than ``room`` without its
    ``block_hashes``: they are informative (a follower clears the tier whatever they say), and
    a whole tier's list would not fit a message (or a line a reader takes)."""
    texts = json_event_texts(items)
    if texts and max(map(len, texts)) > room:
        for i, item in enumerate(items):
            if item[1] == CLEARED and len(texts[i]) > room:
                texts[i] = '{"type":"cleared","event_id":%d,"tier":"%s","ts":%s}' % (item[0], item[2], item[3])
    return texts


def encode_jsonl(batch: EventBatch, dp_rank: int = 0) -> str:
    """A batch as kvstrata JSON lines: one self-contained line per event (a cleared event
    without its hash list where that would pass :data:`~kvstrata.paths.MAX_LINE_BYTES`, the
    longest line readers take). A data-parallel engine's lines (``dp_rank`` > 0) say its
    rank, so a reader of every engine's file follows each engine apart."""
    ident = batch.identity
    head = '{"publisher_id":%d,"worker_id":%d,' % (ident.publisher_id, ident.worker_id)
    if dp_rank:
        head += '"dp_rank":%d,' % dp_rank
    room = MAX_LINE_BYTES - len(head)   # a line is head + the text after its "{"
    return "".join([head + text[1:] + "\n" for text in _fitting_texts(batch.items, room)])


SNAPSHOT_CHUNK_BYTES = 512 * 1024
"""Default size of a snapshot reply's chunks (a sink passes less for a server that takes less)."""


def stored_part(item: tuple, start: int, stop: int) -> tuple:
    """Blocks ``start:stop`` of a stored item, as a stored item: its parent is the block
    before ``start`` (a run can be cut anywhere)."""
    n = (len(item) - ITEM_HEAD) >> 1
    parent = item[4] if start == 0 else item[ITEM_HEAD + start - 1]
    tokens = item[6][start:stop] if item[6] is not None else None
    return (item[:4] + (parent, item[5], tokens) + item[ITEM_HEAD + start : ITEM_HEAD + stop]
            + item[ITEM_HEAD + n + start : ITEM_HEAD + n + stop])


def _texts_within(item: tuple, room: int) -> list[str]:
    """A snapshot event's JSON text, or, when it is longer than ``room``, the texts of the
    parts it is cut into so each fits (down to single blocks, which may not)."""
    text = json_event_texts([item])[0]
    n = (len(item) - ITEM_HEAD) >> 1
    if len(text) <= room or item[1] != 0 or n < 2:
        return [text]
    parts = min(n, -(-len(text) // max(room, 1)))
    step = -(-n // parts)
    out: list[str] = []
    for start in range(0, n, step):
        out += _texts_within(stored_part(item, start, min(start + step, n)), room)
    return out


def encode_snapshot(snapshot: Snapshot, max_bytes: int = SNAPSHOT_CHUNK_BYTES) -> list[bytes]:
    """A snapshot as one or more JSON messages of at most ``max_bytes`` each.

    Each chunk carries ``chunk`` (0-based) and ``last``; the receiver concatenates ``events``.
    A stored event too large for a chunk is cut into parts (each part's parent the previous
    part's last block; all carry the snapshot's ``last_event_id``, as every snapshot event
    does), so only a single block larger than ``max_bytes`` makes a larger message.
    """
    dumps = json.JSONEncoder(separators=(",", ":")).encode

    def head(chunk: int, last: bool) -> str:
        obj = _identity_fields(snapshot.identity)
        obj.update(type="snapshot", last_event_id=snapshot.last_event_id, chunk=chunk, last=last)
        return dumps(obj)[:-1] + ',"events":['  # the closing brace dropped, events appended

    groups: list[list[str]] = [[]]
    room = max_bytes - len(head(0, False)) - 2   # 2: the closing "]}"
    any_room = max_bytes - len(head(10**9, False)) - 2   # what any chunk has room for
    size = 0   # of the current group's texts, joined by commas
    items = [event_to_item(e) for e in snapshot.events]
    for item, whole in zip(items, json_event_texts(items)):
        for text in [whole] if len(whole) <= any_room else _texts_within(item, any_room):
            grown = size + len(text) + (1 if groups[-1] else 0)
            if groups[-1] and grown > room:
                groups.append([])
                room = max_bytes - len(head(len(groups) - 1, False)) - 2
                grown = len(text)
            groups[-1].append(text)
            size = grown
    return [(head(i, i == len(groups) - 1) + ",".join(texts) + "]}").encode()
            for i, texts in enumerate(groups)]


def _int(obj: dict, key: str, what: str) -> int:
    """An id, count or size: an unsigned 64-bit integer (Dynamo's ids are u64 too)."""
    value = obj.get(key)
    if type(value) is not int or not 0 <= value < _U64:
        raise EventFormatError(f"{what}: field {key!r} must be an unsigned 64-bit integer, "
                               f"got {value!r:.40}")
    return value


MAX_DP_RANK = (1 << 32) - 1
"""Largest data-parallel rank (Dynamo's ``DpRank`` is an unsigned 32-bit integer)."""


def dp_rank_of(obj: dict, what: str) -> int:
    """The ``dp_rank`` field of a decoded message: the data-parallel rank of the engine that
    published it, 0 when absent (one engine per worker)."""
    value = obj.get("dp_rank", 0)
    if type(value) is not int or not 0 <= value <= MAX_DP_RANK:
        raise EventFormatError(f"{what}: field 'dp_rank' must be an unsigned 32-bit integer, "
                               f"got {value!r:.40}")
    return value


_INT_ONLY = {int}


_U64 = 1 << 64


def _hash(obj: dict, key: str, what: str) -> int:
    """A block hash: an unsigned 64-bit integer (what every tier and index stores)."""
    value = obj.get(key)
    if type(value) is not int or not 0 <= value < _U64:
        raise EventFormatError(f"{what}: field {key!r} must be an unsigned 64-bit integer, "
                               f"got {value!r}")
    return value


def _hash_list(obj: dict, key: str, what: str) -> tuple[int, ...]:
    values = obj.get(key)
    # C-level checks (no per-element Python code): every element exactly an int, all u64
    if type(values) is not list or (values and (not set(map(type, values)) <= _INT_ONLY
                                                or min(values) < 0 or max(values) >= _U64)):
        raise EventFormatError(f"{what}: field {key!r} must be a list of unsigned 64-bit "
                               f"integers")
    return tuple(values)


def event_from_dict(obj: Any) -> Event:
    """Decode one kvstrata JSON event object."""
    if type(obj) is not dict:
        raise EventFormatError(f"event must be a JSON object, got {type(obj).__name__}")
    kind = obj.get("type")
    event_id = obj.get("event_id")
    tier = obj.get("tier")
    ts = obj.get("ts", 0.0)
    if type(event_id) is not int or not 0 <= event_id < _U64 or type(tier) is not str or tier not in _TIERS or type(ts) not in (float, int):
        what = f"{kind!r} event"
        _int(obj, "event_id", what)
        if not isinstance(tier, str):
            raise EventFormatError(f"{what}: field 'tier' missing or not a string")
        check_tier(tier)
        raise EventFormatError(f"{what}: field 'ts' must be a number")
    if kind == "stored":
        what = "'stored' event"
        hashes = _hash_list(obj, "block_hashes", what)
        locals_ = _hash_list(obj, "tokens_hashes", what)
        if not hashes or len(locals_) != len(hashes):
            raise EventFormatError(f"{what}: 'block_hashes' must be non-empty and as long as 'tokens_hashes'")
        tokens = obj.get("token_ids")
        if tokens is None:
            blocks = tuple([_new_block(StoredBlock, (h, lh, None)) for h, lh in zip(hashes, locals_)])
        else:
            if type(tokens) is not list or len(tokens) != len(hashes):
                raise EventFormatError(f"{what}: 'token_ids' must hold one list (or null) per block")
            for t in tokens:
                if t is not None and (type(t) is not list or (t and not set(map(type, t)) <= _INT_ONLY)):
                    raise EventFormatError(f"{what}: 'token_ids' entries must be lists of integers")
            blocks = tuple(
                [
                    _new_block(StoredBlock, (h, lh, tuple(t) if t is not None else None))
                    for h, lh, t in zip(hashes, locals_, tokens)
                ]
            )
        parent = obj.get("parent_hash")
        if parent is not None and (type(parent) is not int or not 0 <= parent < _U64):
            _hash(obj, "parent_hash", what)
        size = obj.get("block_size")
        if type(size) is not int or size < 0:
            _int(obj, "block_size", what)
        return StoredEvent(event_id, tier, parent, size, blocks, float(ts))
    if kind == "removed":
        return RemovedEvent(event_id, tier, _hash_list(obj, "block_hashes", "'removed' event"), float(ts))
    if kind == "cleared":
        hashes = _hash_list(obj, "block_hashes", "'cleared' event") if "block_hashes" in obj else ()
        return ClearedEvent(event_id, tier, hashes, float(ts))
    raise EventFormatError(f"unknown event type {kind!r} (expected stored, removed or cleared)")


def _typed_decode_errors(decode):
    """Decoders promise :class:`EventFormatError` for any malformed input: turn the stray
    ``TypeError`` / ``KeyError`` / ``AttributeError`` / ``RecursionError`` ... of a message
    of the wrong shape into one, naming what was being decoded."""

    @functools.wraps(decode)
    def wrapper(*args, **kwargs):
        try:
            return decode(*args, **kwargs)
        except EventFormatError:
            raise
        except Exception as exc:  # a malformed message, whatever its shape
            raise EventFormatError(
                f"{decode.__name__}: malformed message ({type(exc).__name__}: {exc})"
            ) from None

    return wrapper


def _started_at(obj: dict) -> float:
    """When the publisher started (seconds since the epoch; 0.0 when not said): finite."""
    value = obj.get("started_at", 0.0)
    if type(value) not in (int, float) or not math.isfinite(value):
        raise EventFormatError(f"message: field 'started_at' must be a finite number, got "
                               f"{value!r:.40}")
    return float(value)


def _identity_from(obj: dict) -> PublisherIdentity:
    return PublisherIdentity(
        publisher_id=_int(obj, "publisher_id", "message"),
        worker_id=_int(obj, "worker_id", "message"),
        started_at=_started_at(obj),
    )


@_typed_decode_errors
def decode_kvstrata(data: bytes | str | dict, with_rank: bool = False):
    """Decode a kvstrata message: a batch, a snapshot chunk, or one JSON line.

    ``with_rank``: return ``(message, dp_rank)``, the publishing engine's data-parallel rank
    (an optional ``dp_rank`` field, 0 when absent); it is checked either way."""
    obj = _load_json(data)
    identity = _identity_from(obj)
    dp_rank = dp_rank_of(obj, "message")
    if obj.get("type") == "snapshot":
        events = [event_from_dict(e) for e in _list(obj, "events")]
        if any(not isinstance(e, StoredEvent) for e in events):
            raise EventFormatError("snapshot: every event must be a stored event")
        message = Snapshot(identity, _int(obj, "last_event_id", "snapshot"), events)  # type: ignore[arg-type]
    elif "events" in obj:
        message = EventBatch(identity, [event_from_dict(e) for e in _list(obj, "events")])
    else:
        message = EventBatch(identity, [event_from_dict(obj)])
    return (message, dp_rank) if with_rank else message


@_typed_decode_errors
def decode_snapshot_chunk(data: bytes | str | dict) -> tuple[Snapshot, int, bool]:
    """Decode one message of :func:`encode_snapshot`: ``(its part of the snapshot, chunk
    index, whether it is the last)``; a message without the two fields is a whole snapshot
    (chunk 0, the last). :class:`EventFormatError` for anything else."""
    obj = _load_json(data)
    part, dp_rank = decode_kvstrata(obj, with_rank=True)
    if not isinstance(part, Snapshot):
        raise EventFormatError("not a snapshot")
    if dp_rank:     # followers re-sync engine 0's stream only: no snapshot speaks for another
        raise EventFormatError(f"snapshot: of data-parallel rank {dp_rank}, not 0")
    chunk = _int(obj, "chunk", "snapshot") if "chunk" in obj else 0
    last = obj.get("last", True)
    if type(last) is not bool:
        raise EventFormatError(f"snapshot: field 'last' must be a boolean, got {last!r}")
    return part, chunk, last


def _list(obj: dict, key: str) -> list:
    value = obj.get(key)
    if not isinstance(value, list):
        raise EventFormatError(f"message: field {key!r} must be a list")
    return value


def _load_json(data: bytes | str | dict) -> dict:
    if isinstance(data, dict):
        return data
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise EventFormatError(f"not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise EventFormatError(f"message must be a JSON object, got {type(obj).__name__}")
    return obj


# --------------------------------------------------------------------------------------------
# Dynamo KV-router JSON: one RouterEvent per change.
# --------------------------------------------------------------------------------------------


def dynamo_event(event: Event, dp_rank: int = 0) -> dict[str, Any]:
    """The inner Dynamo ``KvCacheEvent`` ({event_id, data, dp_rank})."""
    if type(event) is StoredEvent:
        data: Any = {
            "stored": {
                "parent_hash": event.parent_hash,
                "blocks": [{"block_hash": b.block_hash, "tokens_hash": b.tokens_hash} for b in event.blocks],
            }
        }
    elif type(event) is RemovedEvent:
        data = {"removed": {"block_hashes": list(event.block_hashes)}}
    elif type(event) is ClearedEvent:
        data = "cleared"
    else:
        raise TypeError(f"not an event: {event!r}")
    return {"event_id": event.event_id, "data": data, "dp_rank": dp_rank}


def dynamo_router_event(event: Event, worker_id: int, dp_rank: int = 0) -> dict[str, Any]:
    """The Dynamo NATS-plane wrapper: {worker_id, storage_tier, event}."""
    return {
        "worker_id": worker_id,
        "storage_tier": STORAGE_TIER[event.tier],
        "event": dynamo_event(event, dp_rank),
    }


_DYN_STORED_BLOCK = '{"block_hash":%d,"tokens_hash":%d}'
_dyn_stored_fmts: dict[int, str] = {}


def _dyn_stored_fmt(n: int) -> str:
    fmt = (
        '{"worker_id":%d,"storage_tier":"%s","event":{"event_id":%d,"data":{"stored":{"parent_hash":%s,"blocks":['
        + ",".join((_DYN_STORED_BLOCK,) * n)
        + ']}},"dp_rank":%d}}'
    )
    if n <= _FMT_CACHE_MAX_N:
        _dyn_stored_fmts[n] = fmt
    return fmt


def dynamo_event_texts(items: Sequence[tuple], worker_id: int, dp_rank: int = 0) -> list[str]:
    """Each item as one Dynamo RouterEvent JSON text (same bytes as :func:`dynamo_router_event`
    through ``json.dumps(..., separators=(",", ":"))``)."""
    out: list[str] = []
    append = out.append
    fmts = _dyn_stored_fmts
    for item in items:
        kind = item[1]
        storage = STORAGE_TIER[item[2]]
        if kind == 0:
            hashes, locals_ = item_blocks(item)
            n = len(hashes)
            append(
                (fmts.get(n) or _dyn_stored_fmt(n))
                % (
                    worker_id,
                    storage,
                    item[0],
                    item[4],  # parent hash or "null"
                    *_chain.from_iterable(zip(hashes, locals_)),
                    dp_rank,
                )
            )
        elif kind == 1:
            append(
                '{"worker_id":%d,"storage_tier":"%s","event":{"event_id":%d,"data":{"removed":{"block_hashes":[%s]}},"dp_rank":%d}}'
                % (worker_id, storage, item[0], ",".join(map(str, item[4:])), dp_rank)
            )
        else:
            append(
                '{"worker_id":%d,"storage_tier":"%s","event":{"event_id":%d,"data":"cleared","dp_rank":%d}}'
                % (worker_id, storage, item[0], dp_rank)
            )
    return out


def encode_dynamo_messages(batch: EventBatch, dp_rank: int = 0) -> list[bytes]:
    """One JSON message per event (Dynamo's router consumes one RouterEvent per message)."""
    return [t.encode() for t in dynamo_event_texts(batch.items, batch.identity.worker_id, dp_rank)]


def encode_dynamo_jsonl(batch: EventBatch, dp_rank: int = 0) -> str:
    return "".join([t + "\n" for t in dynamo_event_texts(batch.items, batch.identity.worker_id, dp_rank)])


# The fast path: msgspec decodes a RouterEvent's text straight into typed structs (no dicts),
# and the native core builds the StoredBlocks (one C call per event). It accepts only what the
# reference decoder below accepts and returns the same events; anything else (a malformed
# message, an odd shape, msgspec not installed) returns None and the reference decoder, which
# raises the documented EventFormatError, decides. tests/events/test_formats.py runs the same
# messages through both.

def _stored_blocks_py(structs: list) -> tuple[StoredBlock, ...] | None:
    seqs = [b.block_hash for b in structs]
    locs = [b.tokens_hash for b in structs]
    for hs in (seqs, locs):
        if min(hs) < 0 or max(hs) >= _U64:
            return None
    return tuple(map(StoredBlock, seqs, locs))


try:
    import msgspec
except ImportError:  # pragma: no cover - msgspec is in requirements.txt
    msgspec = None
else:
    # module level: the annotations are strings (__future__), resolved in this module
    class _Block(msgspec.Struct, gc=False):
        block_hash: int
        tokens_hash: int

    class _Stored(msgspec.Struct, gc=False):
        blocks: list[_Block]
        parent_hash: int | None = None

    class _Removed(msgspec.Struct, gc=False):
        block_hashes: list[int]

    class _Data(msgspec.Struct, gc=False):
        stored: _Stored | msgspec.UnsetType = msgspec.UNSET
        removed: _Removed | msgspec.UnsetType = msgspec.UNSET

    class _Inner(msgspec.Struct, gc=False):
        event_id: int
        data: str | _Data
        dp_rank: int = 0

    class _RouterEvent(msgspec.Struct, gc=False):
        worker_id: int
        event: _Inner
        storage_tier: str | msgspec.UnsetType = msgspec.UNSET


def _fast_dynamo_decoder(use_native: bool = True):
    """``decode(data, need_tier=False, with_rank=False) -> (worker_id, event) | None`` (with
    ``with_rank``, ``(worker_id, event, dp_rank)``): the native parser when built (and
    ``use_native``), else msgspec, else None (no fast path)."""
    native = None
    if use_native and os.environ.get("KVSTRATA_NATIVE_EVENTS", "1") != "0":  # as indexer.py
        try:
            from kvstrata.events._native import parse_router_event as native
        except ImportError:
            pass
    tier_of = TIER_OF_STORAGE

    if native is not None:
        def decode(data: bytes | str, need_tier: bool = False,
                   with_rank: bool = False) -> tuple | None:
            parsed = native(data, StoredBlock)
            if parsed is None:
                return None
            worker_id, storage, event_id, kind, parent, payload, dp_rank = parsed
            if storage is None:
                if need_tier:
                    return None
                storage = "device"
            tier = tier_of.get(storage)
            if tier is None:
                return None
            if kind == 0:
                event = StoredEvent(event_id, tier, parent, 0, payload)
            elif kind == 1:
                event = RemovedEvent(event_id, tier, payload)
            else:
                event = ClearedEvent(event_id, tier)
            return (worker_id, event, dp_rank) if with_rank else (worker_id, event)

        return decode

    if msgspec is None:
        return None
    UNSET = msgspec.UNSET
    decoder = msgspec.json.Decoder(_RouterEvent)
    errors = (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError)

    def event_of(msg, tier: str) -> Event | None:
        inner = msg.event
        event_id = inner.event_id
        data_ = inner.data
        if type(data_) is str:
            return ClearedEvent(event_id, tier) if data_ == "cleared" else None
        st = data_.stored
        if st is not UNSET:
            parent = st.parent_hash
            if not st.blocks or (parent is not None and not 0 <= parent < _U64):
                return None
            blocks = _stored_blocks_py(st.blocks)
            return None if blocks is None else StoredEvent(event_id, tier, parent, 0, blocks)
        rm = data_.removed
        if rm is not UNSET:
            hashes = rm.block_hashes
            if hashes and (min(hashes) < 0 or max(hashes) >= _U64):
                return None
            return RemovedEvent(event_id, tier, tuple(hashes))
        return None

    def decode(data: bytes | str, need_tier: bool = False,
               with_rank: bool = False) -> tuple | None:
        try:
            msg = decoder.decode(data)
        except errors:
            return None
        storage = msg.storage_tier
        if storage is UNSET:
            if need_tier:
                return None
            storage = "device"
        tier = tier_of.get(storage)
        dp_rank = msg.event.dp_rank
        if (tier is None or not 0 <= msg.worker_id < _U64 or not 0 <= msg.event.event_id < _U64
                or not 0 <= dp_rank <= MAX_DP_RANK):
            return None
        event = event_of(msg, tier)
        if event is None:
            return None
        return (msg.worker_id, event, dp_rank) if with_rank else (msg.worker_id, event)

    return decode


fast_decode_dynamo = _fast_dynamo_decoder()
"""The fast path of :func:`decode_dynamo` for text and bytes (None when neither the native
parser nor msgspec is there): ``fast_decode_dynamo(data, need_tier=False, with_rank=False)``
returns what :func:`decode_dynamo` would, or None, never raises; ``need_tier`` refuses a
message without ``storage_tier`` (format auto-detection)."""


@_typed_decode_errors
def decode_dynamo(data: bytes | str | dict, with_rank: bool = False) -> tuple:
    """Decode one Dynamo RouterEvent -> ``(worker_id, event)``; with ``with_rank``,
    ``(worker_id, event, dp_rank)``: the publishing engine's data-parallel rank (the inner
    event's ``dp_rank``, 0 when absent, as Dynamo reads it)."""
    if fast_decode_dynamo is not None and not isinstance(data, dict):
        decoded = fast_decode_dynamo(data, False, with_rank)
        if decoded is not None:
            return decoded
    obj = _load_json(data)
    worker_id = _int(obj, "worker_id", "router event")
    storage = obj.get("storage_tier", "device")
    tier = TIER_OF_STORAGE.get(storage)
    if tier is None:
        raise EventFormatError(f"router event: unknown storage_tier {storage!r}")
    inner = obj.get("event")
    if not isinstance(inner, dict):
        raise EventFormatError("router event: field 'event' must be an object")
    event_id = _int(inner, "event_id", "router event")
    dp_rank = dp_rank_of(inner, "router event")
    data_ = inner.get("data")
    if data_ == "cleared":
        event: Event = ClearedEvent(event_id, tier)
    elif isinstance(data_, dict) and "stored" in data_:
        st = data_["stored"]
        if not isinstance(st, dict) or not isinstance(st.get("blocks"), list) or not st["blocks"]:
            raise EventFormatError("router event: 'stored.blocks' must be a non-empty list")
        blocks = tuple(
            StoredBlock(_hash(b, "block_hash", "stored block"), _hash(b, "tokens_hash", "stored block"))
            for b in st["blocks"]
        )
        # Dynamo events carry no block size; 0 means "unknown".
        parent = None if st.get("parent_hash") is None else _hash(st, "parent_hash", "stored")
        event = StoredEvent(event_id, tier, parent, 0, blocks)
    elif isinstance(data_, dict) and "removed" in data_:
        rm = data_["removed"]
        if not isinstance(rm, dict):
            raise EventFormatError("router event: 'removed' must be an object")
        event = RemovedEvent(event_id, tier, _hash_list(rm, "block_hashes", "removed"))
    else:
        raise EventFormatError(f"router event: unknown data {data_!r:.80}")
    return (worker_id, event, dp_rank) if with_rank else (worker_id, event)


# --------------------------------------------------------------------------------------------
# vLLM KVEventBatch msgpack (ZMQ PUB).
# --------------------------------------------------------------------------------------------
#
# vLLM (vllm/distributed/kv_events.py) encodes with msgspec:
#   EventBatch(array_like)      -> [ts, [events...], data_parallel_rank]
#   BlockStored                 fields: block_hashes, parent_block_hash, token_ids, block_size,
#                               lora_id, medium, lora_name  (then defaulted extras, omitted)
#   BlockRemoved                fields: block_hashes, medium
#   AllBlocksCleared            no fields
# Since vLLM PR #42892 the events themselves are tagged *maps* ({"type": "BlockStored", ...});
# releases before it used tagged arrays (["BlockStored", ...]). ``layout`` picks one.

VLLM_LAYOUTS = ("map", "array")


def vllm_event(event: Event, layout: str = "map") -> Any:
    """One event as the vLLM msgpack-ready structure (dict for ``map``, list for ``array``)."""
    medium = VLLM_MEDIUM[event.tier]
    if type(event) is StoredEvent:
        tokens: list[int] = []
        if all(b.token_ids is not None for b in event.blocks):  # all or nothing (see above)
            for b in event.blocks:
                tokens.extend(b.token_ids)
        hashes = [b.block_hash for b in event.blocks]
        if layout == "map":
            return {
                "type": "BlockStored",
                "block_hashes": hashes,
                "parent_block_hash": event.parent_hash,
                "token_ids": tokens,
                "block_size": event.block_size,
                "lora_id": None,
                "medium": medium,
                "lora_name": None,
            }
        return ["BlockStored", hashes, event.parent_hash, tokens, event.block_size, None, medium, None]
    if type(event) is RemovedEvent or (type(event) is ClearedEvent and event.tier != TOP_TIER):
        # vLLM's AllBlocksCleared has no medium: clearing one lower tier is said as a removal.
        hashes = list(event.block_hashes)
        if layout == "map":
            return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}
        return ["BlockRemoved", hashes, medium]
    if type(event) is ClearedEvent:
        return {"type": "AllBlocksCleared"} if layout == "map" else ["AllBlocksCleared"]
    raise TypeError(f"not an event: {event!r}")


def encode_vllm_batch(
    events: Sequence[Event], ts: float, dp_rank: int = 0, layout: str = "map"
) -> bytes:
    """A ``KVEventBatch`` as msgpack bytes, byte-compatible with vLLM's msgspec encoder."""
    import msgpack

    if layout not in VLLM_LAYOUTS:
        raise ValueError(f"vLLM layout must be one of {VLLM_LAYOUTS}, got {layout!r}")
    return msgpack.packb([ts, vllm_items(map(event_to_item, events), layout), dp_rank], use_bin_type=True)


def encode_vllm_items(items: Sequence[tuple], ts: float, dp_rank: int = 0, layout: str = "map") -> bytes:
    """:func:`encode_vllm_batch` straight from the publisher's items."""
    import msgpack

    if layout not in VLLM_LAYOUTS:
        raise ValueError(f"vLLM layout must be one of {VLLM_LAYOUTS}, got {layout!r}")
    return msgpack.packb([ts, vllm_items(items, layout), dp_rank], use_bin_type=True)


def vllm_items(items: Iterable[tuple], layout: str = "map") -> list[Any]:
    """Items as vLLM event structures (same as :func:`vllm_event` of the event objects)."""
    out: list[Any] = []
    append = out.append
    as_map = layout == "map"
    for item in items:
        kind, tier = item[1], item[2]
        medium = VLLM_MEDIUM[tier]
        if kind == 0:
            # vLLM carries one flat token list for the event: only whole or nothing, else the
            # tokens would shift onto the wrong blocks.
            toks_per_block = item[6]
            tokens = (
                [t for toks in toks_per_block for t in toks]
                if toks_per_block is not None and None not in toks_per_block
                else []
            )
            hashes = list(item_blocks(item)[0])
            if as_map:
                append(
                    {
                        "type": "BlockStored",
                        "block_hashes": hashes,
                        "parent_block_hash": item_parent(item),
                        "token_ids": tokens,
                        "block_size": item[5],
                        "lora_id": None,
                        "medium": medium,
                        "lora_name": None,
                    }
                )
            else:
                append(["BlockStored", hashes, item_parent(item), tokens, item[5], None, medium, None])
        elif kind == 1 or tier != TOP_TIER:
            # vLLM's AllBlocksCleared has no medium: clearing one lower tier is said as a removal.
            if as_map:
                append({"type": "BlockRemoved", "block_hashes": list(item[4:]), "medium": medium})
            else:
                append(["BlockRemoved", list(item[4:]), medium])
        else:
            append({"type": "AllBlocksCleared"} if as_map else ["AllBlocksCleared"])
    return out


_VLLM_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name")
_VLLM_REMOVED_FIELDS = ("block_hashes", "medium")


@_typed_decode_errors
def decode_vllm_batch(payload: bytes) -> tuple[float, list[dict[str, Any]], int | None]:
    """Hand-written decoder of the documented vLLM field order (both layouts).

    Returns ``(ts, events, dp_rank)`` where each event is a dict with ``type`` and named fields.
    """
    import msgpack

    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise EventFormatError(f"not valid msgpack: {exc}") from None
    if not isinstance(obj, list) or len(obj) not in (2, 3):
        raise EventFormatError("KVEventBatch must be an array [ts, events, data_parallel_rank?]")
    ts, raw_events = obj[0], obj[1]
    dp_rank = obj[2] if len(obj) == 3 else None
    out = []
    for raw in raw_events:
        if isinstance(raw, dict):
            out.append(dict(raw))
            continue
        if not isinstance(raw, list) or not raw:
            raise EventFormatError(f"bad vLLM event {raw!r:.80}")
        tag, values = raw[0], raw[1:]
        names = {"BlockStored": _VLLM_STORED_FIELDS, "BlockRemoved": _VLLM_REMOVED_FIELDS}.get(tag, ())
        event = {"type": tag}
        event.update(zip(names, values))
        out.append(event)
    return ts, out, dp_rank


@_typed_decode_errors
def events_from_vllm(events: Iterable[dict[str, Any]], first_event_id: int = 1) -> list[Event]:
    """vLLM event dicts (from :func:`decode_vllm_batch`) -> kvstrata events (ids assigned)."""
    out: list[Event] = []
    eid = first_event_id
    for ev in events:
        tier = TIER_OF_MEDIUM.get(ev.get("medium") or VLLM_MEDIUM[TOP_TIER], TOP_TIER)
        kind = ev.get("type")
        if kind == "BlockStored":
            size = _int(ev, "block_size", "vLLM BlockStored")
            tokens = ev.get("token_ids") or []
            hashes = _hash_list(ev, "block_hashes", "vLLM BlockStored")
            if tokens and (type(tokens) is not list or len(tokens) != len(hashes) * size):
                # the tokens of every block or none: a short list would shift them onto
                # the wrong blocks
                raise EventFormatError(f"vLLM BlockStored: {len(hashes)} blocks of {size} "
                                       f"tokens need {len(hashes) * size} token_ids, "
                                       f"got {len(tokens)}")
            blocks = []
            for i, h in enumerate(hashes):
                toks = tuple(tokens[i * size : (i + 1) * size]) if tokens else None
                blocks.append(StoredBlock(h, 0, toks))
            parent = None if ev.get("parent_block_hash") is None else \
                _hash(ev, "parent_block_hash", "vLLM BlockStored")
            out.append(StoredEvent(eid, tier, parent, size, tuple(blocks)))
        elif kind == "BlockRemoved":
            out.append(RemovedEvent(eid, tier, _hash_list(ev, "block_hashes", "vLLM BlockRemoved")))
        elif kind == "AllBlocksCleared":
            out.append(ClearedEvent(eid, tier))
        else:
            raise EventFormatError(f"unknown vLLM event type {kind!r}")
        eid += 1
    return out
