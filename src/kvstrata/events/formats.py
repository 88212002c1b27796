"""Wire formats: kvstrata JSON, Dynamo KV-router JSON, vLLM ``KVEventBatch`` msgpack.

Every encoder here is a pure function of events; every decoder raises
:class:`~kvstrata.events.model.EventFormatError` naming what is wrong. See docs/events.md for
a literal example of each format.
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Sequence

from kvstrata.events.model import (
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
)

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


def encode_batch(batch: EventBatch) -> bytes:
    """A batch as one kvstrata JSON message (the NATS payload in ``format=kvstrata``)."""
    obj = _identity_fields(batch.identity)
    obj["events"] = [event_to_dict(e) for e in batch.events]
    return json.dumps(obj, separators=(",", ":")).encode()


def encode_jsonl(batch: EventBatch) -> str:
    """A batch as kvstrata JSON lines: one self-contained line per event."""
    ident = batch.identity
    head = {"publisher_id": ident.publisher_id, "worker_id": ident.worker_id}
    dumps = json.JSONEncoder(separators=(",", ":")).encode
    return "".join(dumps({**head, **event_to_dict(e)}) + "\n" for e in batch.events)


def encode_snapshot(snapshot: Snapshot, max_bytes: int = 512 * 1024) -> list[bytes]:
    """A snapshot as one or more JSON messages of at most about ``max_bytes`` each.

    Each chunk carries ``chunk`` (0-based) and ``last``; the receiver concatenates ``events``.
    """
    dumps = json.JSONEncoder(separators=(",", ":")).encode
    groups: list[list[str]] = [[]]
    size = 0
    for event in snapshot.events:
        text = dumps(event_to_dict(event))
        if groups[-1] and size + len(text) > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(text)
        size += len(text) + 1
    out = []
    for i, texts in enumerate(groups):
        obj = _identity_fields(snapshot.identity)
        obj.update(type="snapshot", last_event_id=snapshot.last_event_id, chunk=i, last=i == len(groups) - 1)
        head = dumps(obj)[:-1]  # drop the closing brace, append the events array
        out.append((head + ',"events":[' + ",".join(texts) + "]}").encode())
    return out


def _int(obj: dict, key: str, what: str) -> int:
    value = obj.get(key)
    if type(value) is not int or value < 0:
        raise EventFormatError(f"{what}: field {key!r} must be a non-negative integer, got {value!r}")
    return value


def _opt_int(obj: dict, key: str, what: str) -> int | None:
    if obj.get(key) is None:
        return None
    return _int(obj, key, what)


def _hash_list(obj: dict, key: str, what: str) -> tuple[int, ...]:
    values = obj.get(key)
    if not isinstance(values, list) or any(type(v) is not int or v < 0 for v in values):
        raise EventFormatError(f"{what}: field {key!r} must be a list of non-negative integers")
    return tuple(values)


def event_from_dict(obj: Any) -> Event:
    """Decode one kvstrata JSON event object."""
    if not isinstance(obj, dict):
        raise EventFormatError(f"event must be a JSON object, got {type(obj).__name__}")
    kind = obj.get("type")
    what = f"{kind!r} event"
    event_id = _int(obj, "event_id", what)
    tier = obj.get("tier")
    if not isinstance(tier, str):
        raise EventFormatError(f"{what}: field 'tier' missing or not a string")
    check_tier(tier)
    ts = obj.get("ts", 0.0)
    if not isinstance(ts, (int, float)):
        raise EventFormatError(f"{what}: field 'ts' must be a number")
    if kind == "stored":
        hashes = _hash_list(obj, "block_hashes", what)
        locals_ = _hash_list(obj, "tokens_hashes", what)
        if not hashes or len(locals_) != len(hashes):
            raise EventFormatError(f"{what}: 'block_hashes' must be non-empty and as long as 'tokens_hashes'")
        tokens = obj.get("token_ids")
        if tokens is None:
            blocks = tuple(StoredBlock(h, lh) for h, lh in zip(hashes, locals_))
        else:
            if not isinstance(tokens, list) or len(tokens) != len(hashes):
                raise EventFormatError(f"{what}: 'token_ids' must hold one list (or null) per block")
            for t in tokens:
                if t is not None and (not isinstance(t, list) or any(type(x) is not int for x in t)):
                    raise EventFormatError(f"{what}: 'token_ids' entries must be lists of integers")
            blocks = tuple(
                StoredBlock(h, lh, tuple(t) if t is not None else None) for h, lh, t in zip(hashes, locals_, tokens)
            )
        return StoredEvent(
            event_id=event_id,
            tier=tier,
            parent_hash=_opt_int(obj, "parent_hash", what),
            block_size=_int(obj, "block_size", what),
            blocks=blocks,
            ts=float(ts),
        )
    if kind == "removed":
        return RemovedEvent(event_id, tier, _hash_list(obj, "block_hashes", what), float(ts))
    if kind == "cleared":
        hashes = _hash_list(obj, "block_hashes", what) if "block_hashes" in obj else ()
        return ClearedEvent(event_id, tier, hashes, float(ts))
    raise EventFormatError(f"unknown event type {kind!r} (expected stored, removed or cleared)")


def _identity_from(obj: dict) -> PublisherIdentity:
    return PublisherIdentity(
        publisher_id=_int(obj, "publisher_id", "message"),
        worker_id=_int(obj, "worker_id", "message"),
        started_at=float(obj.get("started_at", 0.0)),
    )


def decode_kvstrata(data: bytes | str | dict) -> EventBatch | Snapshot:
    """Decode a kvstrata message: a batch, a snapshot chunk, or one JSON line."""
    obj = _load_json(data)
    identity = _identity_from(obj)
    if obj.get("type") == "snapshot":
        events = [event_from_dict(e) for e in _list(obj, "events")]
        if any(not isinstance(e, StoredEvent) for e in events):
            raise EventFormatError("snapshot: every event must be a stored event")
        return Snapshot(identity, _int(obj, "last_event_id", "snapshot"), events)  # type: ignore[arg-type]
    if "events" in obj:
        return EventBatch(identity, [event_from_dict(e) for e in _list(obj, "events")])
    return EventBatch(identity, [event_from_dict(obj)])


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


def encode_dynamo_messages(batch: EventBatch, dp_rank: int = 0) -> list[bytes]:
    """One JSON message per event (Dynamo's router consumes one RouterEvent per message)."""
    wid = batch.identity.worker_id
    return [
        json.dumps(dynamo_router_event(e, wid, dp_rank), separators=(",", ":")).encode()
        for e in batch.events
    ]


def encode_dynamo_jsonl(batch: EventBatch, dp_rank: int = 0) -> str:
    return "".join(m.decode() + "\n" for m in encode_dynamo_messages(batch, dp_rank))


def decode_dynamo(data: bytes | str | dict) -> tuple[int, Event]:
    """Decode one Dynamo RouterEvent -> (worker_id, event)."""
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
    data_ = inner.get("data")
    if data_ == "cleared":
        return worker_id, ClearedEvent(event_id, tier)
    if isinstance(data_, dict) and "stored" in data_:
        st = data_["stored"]
        if not isinstance(st, dict) or not isinstance(st.get("blocks"), list) or not st["blocks"]:
            raise EventFormatError("router event: 'stored.blocks' must be a non-empty list")
        blocks = tuple(
            StoredBlock(_int(b, "block_hash", "stored block"), _int(b, "tokens_hash", "stored block"))
            for b in st["blocks"]
        )
        # Dynamo events carry no block size; 0 means "unknown".
        return worker_id, StoredEvent(event_id, tier, _opt_int(st, "parent_hash", "stored"), 0, blocks)
    if isinstance(data_, dict) and "removed" in data_:
        rm = data_["removed"]
        if not isinstance(rm, dict):
            raise EventFormatError("router event: 'removed' must be an object")
        return worker_id, RemovedEvent(event_id, tier, _hash_list(rm, "block_hashes", "removed"))
    raise EventFormatError(f"router event: unknown data {data_!r:.80}")


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
        for b in event.blocks:
            if b.token_ids is not None:
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
    if type(event) is RemovedEvent or (type(event) is ClearedEvent and event.tier != "G1"):
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
    return msgpack.packb([ts, [vllm_event(e, layout) for e in events], dp_rank], use_bin_type=True)


_VLLM_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name")
_VLLM_REMOVED_FIELDS = ("block_hashes", "medium")


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


def events_from_vllm(events: Iterable[dict[str, Any]], first_event_id: int = 1) -> list[Event]:
    """vLLM event dicts (from :func:`decode_vllm_batch`) -> kvstrata events (ids assigned)."""
    out: list[Event] = []
    eid = first_event_id
    for ev in events:
        tier = TIER_OF_MEDIUM.get(ev.get("medium") or "GPU", "G1")
        kind = ev.get("type")
        if kind == "BlockStored":
            size = ev["block_size"]
            tokens = ev.get("token_ids") or []
            hashes = ev["block_hashes"]
            blocks = []
            for i, h in enumerate(hashes):
                toks = tuple(tokens[i * size : (i + 1) * size]) if tokens else None
                blocks.append(StoredBlock(h, 0, toks))
            out.append(StoredEvent(eid, tier, ev.get("parent_block_hash"), size, tuple(blocks)))
        elif kind == "BlockRemoved":
            out.append(RemovedEvent(eid, tier, tuple(ev["block_hashes"])))
        elif kind == "AllBlocksCleared":
            out.append(ClearedEvent(eid, tier))
        else:
            raise EventFormatError(f"unknown vLLM event type {kind!r}")
        eid += 1
    return out
