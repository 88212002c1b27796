"""Malformed input never escapes as anything but EventFormatError, and edge cases of the stream."""

from __future__ import annotations

import asyncio

import msgpack
import pytest

from kvstrata.events import formats, make_publisher
from kvstrata.events.model import EventFormatError
from kvstrata.events.subscriber import NatsFollower, WorkerStates, decode_line
from kvstrata.logical.registry import BlockRecord, BlockRegistry

BAD_MESSAGES = [
    (formats.decode_dynamo, '{"worker_id":1,"storage_tier":"device","event":{"event_id":1,'
                            '"data":{"stored":{"parent_hash":null,"blocks":[1]}}}}'),
    (formats.decode_dynamo, '{"worker_id":1,"storage_tier":[1],"event":{"event_id":1,"data":"cleared"}}'),
    (formats.decode_kvstrata, '{"publisher_id":1,"worker_id":1,"started_at":"x","events":[]}'),
    (formats.decode_kvstrata, '{"publisher_id":1,"worker_id":1,"started_at":[1],"events":[]}'),
    (formats.decode_vllm_batch, msgpack.packb([1.0, 5, 0])),
    (formats.events_from_vllm, [{"type": "BlockStored", "block_hashes": [1]}]),
    (decode_line, "[" * 100_000),
]


@pytest.mark.parametrize("decode, message", BAD_MESSAGES)
def test_malformed_messages_raise_event_format_error(decode, message):
    with pytest.raises(EventFormatError):
        decode(message)


class _Msg:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.subject = "kv.events"


def test_follower_survives_a_malformed_message():
    follower = NatsFollower("nats://127.0.0.1:1", "kv.events", WorkerStates())
    asyncio.run(follower._on_msg(_Msg(b'{"publisher_id":1,"worker_id":1,"started_at":"x","events":[]}')))
    asyncio.run(follower._on_msg(_Msg(b"[" * 50_000)))
    assert follower.decode_errors == 2


def test_a_bad_snapshot_reply_is_no_snapshot():
    # Fault injection: a NATS connection whose snapshot reply is garbage.
    class Sub:
        async def next_msg(self, timeout):
            return _Msg(b'{"garbage": 1}')

        async def unsubscribe(self):
            pass

    class Conn:
        def new_inbox(self):
            return "_INBOX.x"

        async def subscribe(self, subject):
            return Sub()

        async def publish(self, *args, **kwargs):
            pass

    follower = NatsFollower("nats://127.0.0.1:1", "kv.events", WorkerStates())
    follower._nc = Conn()
    assert asyncio.run(follower._request_snapshot(1)) is None


def _publish(records_by_call):
    pub = make_publisher("callback", worker_id=1)
    reg = BlockRegistry()
    reg.add_observer(pub)
    for records in records_by_call:
        reg.record_stored("G1", records)
    assert pub.flush(5)
    return pub


def test_vllm_tokens_are_all_or_nothing_per_event():
    pub = _publish([[BlockRecord(1, 1, None, 2, (5, 6)), BlockRecord(2, 2, 1, 2, None),
                     BlockRecord(3, 3, 2, 2, (9, 9))]])
    items = pub.sink.batches[0].items
    decoded = msgpack.unpackb(formats.encode_vllm_items(items, 0.0))
    assert decoded[1][0]["token_ids"] == []  # not [5, 6, 9, 9] shifted onto blocks 1 and 2
    pub.close()


def test_a_hash_cycle_never_repeats_a_hash_in_one_event():
    pub = _publish([[BlockRecord(1, 1, 2, 4), BlockRecord(2, 2, 1, 4), BlockRecord(1, 1, 2, 4)]])
    hashes = [h for e in pub.sink.events for h in getattr(e, "block_hashes", ())]
    assert sorted(hashes) == [1, 2]
    pub.close()


def test_clearing_an_empty_tier_makes_no_event():
    pub = make_publisher("callback", worker_id=1)
    reg = BlockRegistry()
    reg.add_observer(pub)
    reg.record_cleared("G2", [])
    assert pub.flush(5) and pub.last_event_id == 0
    reg.record_stored("G2", [BlockRecord(7, 7, None, 4)])
    reg.record_cleared("G2", [7])
    assert pub.flush(5) and pub.last_event_id == 2
    pub.close()


# -- torn output: whole lines only, one warning with a count, readers skip a torn tail ------

def _publish_some(publisher, n: int, start: int = 0) -> None:
    from kvstrata.tokens import hash_blocks
    from kvstrata.types import BlockRecord

    for i in range(start, start + n):
        local, seqs = hash_blocks(list(range(i * 8, i * 8 + 8)), 4)
        records = [BlockRecord(s, l, p, 4) for s, l, p in zip(seqs, local, [None, seqs[0]])]
        publisher.on_tier_stored("G2", records)
        assert publisher.flush(5)


def test_a_full_disk_leaves_whole_lines_and_one_warning(tmp_path, monkeypatch, caplog):
    import errno
    import os as os_module

    from kvstrata.events.formats import decode_kvstrata
    from kvstrata.events.spec import make_publisher

    path = tmp_path / "events.jsonl"
    publisher = make_publisher(f"jsonl:{path}", max_delay=0.0)
    _publish_some(publisher, 3)
    good = path.read_text().splitlines()
    real_write = os_module.write

    def half_then_full(fd, data):                  # the disk fills up mid-batch
        if fd == publisher.sink._file:
            real_write(fd, bytes(data[: max(1, len(data) // 2)]))
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os_module, "write", half_then_full)
    with caplog.at_level("WARNING", logger="kvstrata.events.publisher"):
        _publish_some(publisher, 5, start=10)
    monkeypatch.setattr(os_module, "write", real_write)
    text = path.read_text()
    assert text.endswith("\n") and text.splitlines() == good    # nothing torn was left
    for line in text.splitlines():
        decode_kvstrata(line)
    warnings = [r for r in caplog.records if "event sink" in r.getMessage()]
    assert len(warnings) == 1 and "Traceback" not in caplog.text
    assert "dropped" in warnings[0].getMessage()
    assert publisher.sink_errors == 5
    _publish_some(publisher, 1, start=30)         # space again: writing resumes
    assert len(path.read_text().splitlines()) == len(good) + 1
    publisher.close()


def test_readers_skip_and_count_a_torn_tail(tmp_path):
    from kvstrata.events.indexer import main
    from kvstrata.events.spec import make_publisher
    from kvstrata.events.subscriber import read_events_file

    path = tmp_path / "events.jsonl"
    publisher = make_publisher(f"jsonl:{path}", max_delay=0.0)
    _publish_some(publisher, 4)
    publisher.close()
    whole = path.read_text()
    path.write_text(whole + whole.splitlines()[0][:25])          # a writer died mid-line
    torn: list[int] = []
    events = list(read_events_file(str(path), torn=torn))
    assert len(events) == len(whole.splitlines()) and torn == [len(whole.splitlines()) + 1]
    assert main(["--file", str(path)]) == 0
    path.write_text("{not json}\n" + whole)                        # a bad line inside: an error
    assert main(["--file", str(path)]) == 2


@pytest.mark.parametrize("line", [
    '{"event_id": 1, "data": {"stored": {"parent_hash": null, "blocks": [{"block_hash": 18446744073709551616, "tokens_hash": 1}]}}, "dp_rank": 0}',
    '{"event_id": 1, "data": {"stored": {"parent_hash": 18446744073709551616, "blocks": [{"block_hash": 1, "tokens_hash": 1}]}}, "dp_rank": 0}',
    '{"event_id": 1, "data": {"removed": {"block_hashes": [18446744073709551616]}}, "dp_rank": 0}',
], ids=["block_hash", "parent_hash", "removed"])
def test_hashes_beyond_u64_are_format_errors(line):
    import json

    wrapped = {"worker_id": 1, "storage_tier": "device", "event": json.loads(line)}
    with pytest.raises(EventFormatError, match="64-bit"):
        formats.decode_dynamo(wrapped)


def test_vllm_events_with_hashes_beyond_u64_are_format_errors():
    for event in ({"type": "BlockStored", "block_hashes": [1 << 64], "parent_block_hash": None,
                   "token_ids": [], "block_size": 4, "medium": "CPU"},
                  {"type": "BlockRemoved", "block_hashes": [-1], "medium": "CPU"}):
        with pytest.raises(EventFormatError):
            formats.events_from_vllm([event])


@pytest.mark.parametrize("size, tokens", [(-4, [1, 2, 3, 4]), (0, [1, 2]), (1.5, []),
                                          ("4", []), (4, [1, 2, 3]), (2, [1, 2, 3, 4, 5])])
def test_vllm_stored_events_with_a_bad_block_size_or_token_count_are_format_errors(size,
                                                                                   tokens):
    """A block size that is not a count, or tokens that are not exactly the blocks' (they
    would land on the wrong blocks), is refused, not sliced into wrong token runs."""
    event = {"type": "BlockStored", "block_hashes": [1, 2] if size == 2 else [1],
             "parent_block_hash": None, "token_ids": tokens, "block_size": size,
             "medium": "CPU"}
    with pytest.raises(EventFormatError):
        formats.events_from_vllm([event])
