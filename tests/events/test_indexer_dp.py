"""The indexer with data-parallel engines, and its costs under hostile input.

* The engines of one worker (one ``worker_id``, a ``dp_rank`` each, event ids each from 1)
  are followed and indexed apart: before, engine 1's first event was taken as the worker's
  restart and engine 0's later ids as conflicts, and ``/match`` could not tell them apart.
* Linking a placeholder under a deep node walked to the root each time, and clearing a
  holder (or listing it) scanned every node record of the native core.
* ``/match`` split a string of hashes whole (about 12 times its size in memory) and took any
  number of hashes.
"""

import asyncio
import json
import random
import time
import tracemalloc

import pytest

from kvstrata.events import formats
from kvstrata.events.indexer import NATIVE_CORE, IndexServer, PrefixIndex, main, match_response
from kvstrata.events.model import (ClearedEvent, EventFormatError, RemovedEvent, StoredBlock,
                                   StoredEvent, stored_event)
from kvstrata.events.spec import make_publisher
from kvstrata.events.subscriber import NatsFollower, StreamFollower, follow_file

from .helpers import chain

CORES = [pytest.param(True, marks=pytest.mark.skipif(NATIVE_CORE is None, reason="not built"),
                      id="native"), pytest.param(False, id="python")]


def seqs(records):
    return [r.sequence_hash for r in records]


def _publish(path, worker, rank, records_by_call):
    """Engine ``rank`` of ``worker`` stores each list of records in G1, in Dynamo's format
    (engine k > 0 writes ``<stem>.dp<k><suffix>``)."""
    publisher = make_publisher(f"dynamo-json:{path}", worker_id=worker, dp_rank=rank, max_delay=0.0)
    for records in records_by_call:
        publisher.on_tier_stored("G1", records)
    publisher.close()


# -- data-parallel engines ----------------------------------------------------------------------


def test_dynamo_files_of_two_engines_of_one_worker_are_indexed_apart(tmp_path, capsys):
    """docs/vllm.md's data-parallel set-up: engine k writes ``ev.dp<k>.jsonl`` in Dynamo's
    format under the worker's id. Before, reading the second file reset the worker."""
    c0, c1 = chain(1, 3, 4), chain(2, 3, 4)
    _publish(tmp_path / "ev.jsonl", 7, 0, [c0])
    _publish(tmp_path / "ev.jsonl", 7, 1, [c1])          # writes ev.dp1.jsonl
    files = ["--file", str(tmp_path / "ev.jsonl"), "--file", str(tmp_path / "ev.dp1.jsonl")]
    for records, engine in ((c0, {"worker_id": 7}), (c1, {"worker_id": 7, "dp_rank": 1})):
        assert main([*files, "--query", ",".join(map(str, seqs(records)))]) == 0
        answer = json.loads(capsys.readouterr().out)
        assert answer["matches"] == [{**engine, "tier": "G1", "prefix": 3}]
        assert answer["best"] == {**engine, "tier": "G1", "prefix": 3}
        assert answer["per_worker"] == {"7": 3}
    assert main(files) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["blocks"] == {"7": {"G1": 6}}
    assert stats["blocks_by_dp_rank"] == {"7": {"0": {"G1": 3}, "1": {"G1": 3}}}
    assert stats["stream"]["restarts"] == 0 and stats["stream"]["conflicts"] == 0
    assert stats["stream"]["workers"] == 1 and stats["stream"]["streams"] == 2


def test_a_restart_of_one_engine_resets_that_engine_only(tmp_path):
    c0, c1, again = chain(1, 3, 4), chain(2, 3, 4), chain(3, 2, 4)
    _publish(tmp_path / "ev.jsonl", 7, 0, [c0])
    _publish(tmp_path / "ev.jsonl", 7, 1, [c1])
    _publish(tmp_path / "ev.jsonl", 7, 1, [again])       # engine 1 restarted: ids from 1 again
    index = PrefixIndex()
    follower = StreamFollower(index, snapshots=False)
    for name in ("ev.jsonl", "ev.dp1.jsonl"):
        follow_file(str(tmp_path / name), follower)
    assert follower.restarts == 1
    assert index.hashes_in(7, "G1") == set(seqs(c0))
    assert index.hashes_in(7, "G1", dp_rank=1) == set(seqs(again))


def test_kvstrata_files_of_two_engines_of_one_worker_are_indexed_apart(tmp_path, capsys):
    """kvstrata's JSON lines carried no rank (each engine's file has its own publisher id,
    so the second file read as the worker's restart): engine k > 0 writes its rank."""
    c0, c1 = chain(1, 3, 4), chain(2, 3, 4)
    for rank, records in ((0, c0), (1, c1)):
        publisher = make_publisher(f"jsonl:{tmp_path / 'ev.jsonl'}", worker_id=7, dp_rank=rank)
        publisher.on_tier_stored("G1", records)
        publisher.close()
    files = ["--file", str(tmp_path / "ev.jsonl"), "--file", str(tmp_path / "ev.dp1.jsonl")]
    for records, engine in ((c0, {"worker_id": 7}), (c1, {"worker_id": 7, "dp_rank": 1})):
        assert main([*files, "--query", ",".join(map(str, seqs(records)))]) == 0
        assert json.loads(capsys.readouterr().out)["matches"] == [
            {**engine, "tier": "G1", "prefix": 3}]


def test_kvstrata_lines_that_name_their_engine_are_followed_apart(tmp_path, capsys):
    """A line's ``dp_rank`` names its engine; a bad one is refused."""
    c0, c1 = chain(1, 2, 4), chain(2, 2, 4)
    paths = []
    for rank, records, pid in ((0, c0, 11), (1, c1, 12)):
        event = formats.event_to_dict(stored_event(1, "G1", records, 0.0))
        line = {"publisher_id": pid, "worker_id": 7, **({"dp_rank": rank} if rank else {}), **event}
        paths.append(tmp_path / f"w{rank}.jsonl")
        paths[-1].write_text(json.dumps(line) + "\n")
    assert main(["--file", str(paths[0]), "--file", str(paths[1]),
                 "--query", ",".join(map(str, seqs(c1)))]) == 0
    assert json.loads(capsys.readouterr().out)["matches"] == [
        {"worker_id": 7, "dp_rank": 1, "tier": "G1", "prefix": 2}]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(paths[1].read_text().replace('"dp_rank": 1', '"dp_rank": -1'))
    assert main(["--file", str(bad)]) == 2
    assert "dp_rank" in capsys.readouterr().err


def test_nats_dynamo_engines_of_one_worker_are_indexed_apart():
    """The reviewer's case: two engines of worker 7 on one subject in Dynamo's format.
    Before, 8 of engine 0's 10 blocks and 2 of engine 1's were indexed."""
    from kvstrata.events.natsserver import NatsServer, find_nats_server

    if find_nats_server() is None:
        pytest.skip("nats-server binary not found")
    server = NatsServer().start()
    try:
        spec = f"{server.url}/kv.dp?format=dynamo"
        publishers = [make_publisher(spec, worker_id=7, dp_rank=k, max_delay=0.0) for k in (0, 1)]
        index = PrefixIndex()
        follower = NatsFollower(server.url, "kv.dp", index, format="dynamo").start()
        try:
            deadline = time.monotonic() + 10
            while not all(p.sink.connected for p in publishers):
                assert time.monotonic() < deadline
                time.sleep(0.02)
            truth = {0: set(), 1: set()}
            for i in range(5):
                for k, publisher in enumerate(publishers):
                    records = chain(100 * k + i, 2, 16)
                    publisher.on_tier_stored("G1", records)
                    assert publisher.flush(5)
                    truth[k] |= set(seqs(records))
            assert follower.wait_for(lambda: follower.follower.applied == 10, 10), \
                follower.follower.stats()
            assert index.hashes_in(7, "G1") == truth[0]
            assert index.hashes_in(7, "G1", dp_rank=1) == truth[1]
            stats = follower.follower.stats()
            assert stats["restarts"] == stats["conflicts"] == stats["duplicates"] == 0
        finally:
            follower.close()
            for publisher in publishers:
                publisher.close(1)
    finally:
        server.cleanup()


class _Msg:
    def __init__(self, subject: str, data: bytes) -> None:
        self.subject, self.data = subject, data


def test_trusted_workers_and_per_worker_subjects_hold_for_every_rank():
    """A worker's engines are that worker's: its ranks pass on its own subject and under
    --trust-workers, and no rank of it is taken from another worker's subject."""
    index = PrefixIndex()
    nf = NatsFollower("nats://127.0.0.1:4222", "kv", index, format="dynamo", per_worker=True,
                      trusted_workers=[7])

    def send(subject, worker, rank, records):
        event = formats.dynamo_router_event(stored_event(1, "G1", records, 0.0), worker, rank)
        asyncio.run(nf._on_msg(_Msg(subject, json.dumps(event).encode())))

    mine0, mine1, forged, other = chain(1, 2), chain(2, 2), chain(3, 2), chain(4, 2)
    send("kv.worker.7", 7, 0, mine0)
    send("kv.worker.7", 7, 1, mine1)
    send("kv.worker.8", 7, 2, forged)                    # worker 8's user claiming 7's rank 2
    send("kv.worker.8", 8, 1, other)                     # not a trusted worker
    assert index.hashes_in(7, "G1") == set(seqs(mine0))
    assert index.hashes_in(7, "G1", dp_rank=1) == set(seqs(mine1))
    assert index.hashes_in(7, "G1", dp_rank=2) == set() and index.workers() == [7]
    assert nf.follower.untrusted == 2 and nf.follower.restarts == 0


def test_match_answers_name_the_engine_and_read_as_before_without_data_parallelism():
    c = chain(4, 5)
    index = PrefixIndex()
    index.apply_event(3, stored_event(1, "G2", c[:2], 0))
    assert match_response(index, seqs(c)) == {       # one engine: the answer of old
        "length": 5, "matches": [{"worker_id": 3, "tier": "G2", "prefix": 2}],
        "best": {"worker_id": 3, "tier": "G2", "prefix": 2}, "per_worker": {"3": 2}}
    index.apply_event(3, stored_event(1, "G2", c[:4], 0), dp_rank=2)
    index.apply_event(3, stored_event(1, "G1", c[:3], 0), dp_rank=1)
    assert index.match(seqs(c)) == {3: {"G2": 2}, (3, 1): {"G1": 3}, (3, 2): {"G2": 4}}
    answer = match_response(index, seqs(c))
    assert answer["matches"] == [{"worker_id": 3, "tier": "G2", "prefix": 2},
                                 {"worker_id": 3, "dp_rank": 1, "tier": "G1", "prefix": 3},
                                 {"worker_id": 3, "dp_rank": 2, "tier": "G2", "prefix": 4}]
    assert answer["best"] == {"worker_id": 3, "dp_rank": 2, "tier": "G2", "prefix": 4}
    assert answer["per_worker"] == {"3": 4}
    index.reset_worker(3, dp_rank=2)
    assert index.match(seqs(c)) == {3: {"G2": 2}, (3, 1): {"G1": 3}}
    index.reset_worker(3)
    assert index.match(seqs(c)) == {(3, 1): {"G1": 3}}


# -- decoding dp_rank -----------------------------------------------------------------------------

_DECODERS = [d for d in (formats._fast_dynamo_decoder(True), formats._fast_dynamo_decoder(False)) if d]


def _reference(text, **kw):
    saved, formats.fast_decode_dynamo = formats.fast_decode_dynamo, None
    try:
        return formats.decode_dynamo(text, **kw)
    finally:
        formats.fast_decode_dynamo = saved


@pytest.mark.parametrize("rank_text, rank", [("", 0), (',"dp_rank":0', 0), (',"dp_rank":3', 3),
                                             (',"dp_rank":4294967295', 2**32 - 1)])
def test_every_dynamo_decoder_reads_dp_rank(rank_text, rank):
    text = '{"worker_id":7,"event":{"event_id":1,"data":"cleared"%s}}' % rank_text
    want = (7, ClearedEvent(1, "G1"), rank)
    assert _reference(text, with_rank=True) == want
    assert _reference(text) == want[:2]                  # the two-value answer of old
    assert formats.decode_dynamo(text, with_rank=True) == want
    for decode in _DECODERS:
        assert decode(text, False, True) == want and decode(text) == want[:2]


@pytest.mark.parametrize("rank_text", ['-1', '4294967296', '1.0', '"1"', 'true', 'null'])
def test_a_dp_rank_that_is_no_u32_is_refused_by_every_decoder(rank_text):
    text = '{"worker_id":7,"event":{"event_id":1,"data":"cleared","dp_rank":%s}}' % rank_text
    for decode in _DECODERS:
        assert decode(text, False, True) is None and decode(text) is None
    with pytest.raises(EventFormatError, match="dp_rank"):
        _reference(text)


def test_a_repeated_dp_rank_is_read_as_the_reference_reads_it_or_left_to_it():
    text = '{"worker_id":7,"event":{"event_id":1,"data":"cleared","dp_rank":1,"dp_rank":2}}'
    want = _reference(text, with_rank=True)
    assert want[2] == 2                                  # json.loads keeps the last
    for decode in _DECODERS:
        assert decode(text, False, True) in (None, want)


# -- costs of hostile input ------------------------------------------------------------------------


def _chain_of(index: PrefixIndex, rng: random.Random, depth: int) -> int:
    """A chain ``depth`` blocks deep, stored from the root; returns its last hash."""
    parent = None
    for start in range(0, depth, 10_000):
        hashes = [rng.getrandbits(64) for _ in range(min(10_000, depth - start))]
        index.apply_event(1, StoredEvent(1, "G1", parent, 4, tuple(StoredBlock(h, h) for h in hashes)))
        parent = hashes[-1]
    return parent


@pytest.mark.parametrize("native", CORES)
def test_placeholders_linked_under_a_deep_node_stay_right(native):
    """Linking a placeholder under a deep node walked to the root each time (to rule out a
    cycle); it now follows shortcuts to the top of the tree, shortened as they are used:
    what is linked must still be right (bench/bench_indexer_hostile.py measures the cost
    against a shallow node's)."""
    rng = random.Random(3)
    index = PrefixIndex(native=native)
    deep = _chain_of(index, rng, 20_000)
    for _ in range(200):
        placeholder, kid = rng.getrandbits(64), rng.getrandbits(64)
        index.apply_event(2, StoredEvent(1, "G1", placeholder, 4, (StoredBlock(kid, kid),)))
        index.apply_event(2, StoredEvent(1, "G1", deep, 4, (StoredBlock(placeholder, placeholder),)))
        assert index.match([placeholder, kid]) == {2: {"G1": 2}}
    assert index.match([deep]) == {1: {"G1": 1}}
    index.reset_worker(1)
    index.reset_worker(2)
    assert index.stats()["nodes"] == 0


@pytest.mark.parametrize("native", CORES)
def test_a_clear_and_a_listing_take_exactly_what_the_holder_holds(native):
    """Clearing a holder (or listing it) scanned every node record of the native core; it
    now goes through the holder's own log (bench/bench_indexer_hostile.py measures it): the
    log must give exactly what the holder holds, however records were reused."""
    rng = random.Random(4)
    index = PrefixIndex(native=native)
    _chain_of(index, rng, 20_000)
    kept: set[int] = set()
    for round_ in range(300):
        h = rng.getrandbits(64)
        index.apply_event(9, StoredEvent(1, "G2", None, 4, (StoredBlock(h, h),)))
        kept.add(h)
        if round_ % 3 == 0:
            index.apply_event(9, RemovedEvent(1, "G2", (h,)))
            kept.discard(h)
        assert index.hashes_in(9, "G2") == kept
        if round_ % 50 == 49:
            index.apply_event(9, ClearedEvent(1, "G2"))
            kept.clear()
            assert index.hashes_in(9, "G2") == set()
    assert index.hashes_in(1, "G1") and index.stats()["nodes"] >= 20_000


@pytest.mark.skipif(NATIVE_CORE is None, reason="native indexer core not built")
def test_the_native_holder_log_stays_bounded_by_what_the_holder_holds():
    """The native core logs the records each holder is given (what clear and hashes_in read);
    records let go of are dropped from the log in passes. Here one record is freed and reused
    for worker 1 over and over: churn must not grow the log."""
    index = PrefixIndex(native=True)

    def stored(worker, h):
        index.apply_event(worker, StoredEvent(1, "G1", None, 4, (StoredBlock(h, h),)))

    def removed(worker, h):
        index.apply_event(worker, RemovedEvent(1, "G1", (h,)))

    def churn(n: int) -> int:
        for _ in range(n):
            stored(2, 6)             # block 6 takes the record freed last round
            stored(1, 6)             # worker 1 is given that record again ...
            stored(1, 7)             # ... and, while it holds it, another (a log pass may run)
            removed(1, 7)
            removed(1, 6)
            removed(2, 6)            # the record is freed
        return index._core.memory()

    settled = churn(1_000)
    assert churn(100_000) <= settled
    stored(1, 6)
    assert index.hashes_in(1, "G1") == {6}
    index.apply_event(1, ClearedEvent(1, "G1"))
    assert index.stats()["nodes"] == 0


@pytest.mark.skipif(NATIVE_CORE is None, reason="native indexer core not built")
def test_the_cores_agree_when_records_are_reused_for_the_same_holders():
    """Four blocks, two workers, stores and removals at random: records are freed and reused
    all the time, so holders' logs name records again while they hold them, and passes over
    the logs drop those repeats (marking the holders they keep, then unmarking them)."""
    rng = random.Random(8)
    ours, ref = PrefixIndex(native=True), PrefixIndex(native=False)
    for step in range(40_000):
        w, h = rng.randrange(2), rng.randrange(4)
        event = (StoredEvent(1, "G1", None, 4, (StoredBlock(h, h),)) if rng.random() < 0.5
                 else RemovedEvent(1, "G1", (h,)))
        for index in (ours, ref):
            index.apply_event(w, event)
        if step % 97 == 0:
            assert [ours.hashes_in(w, "G1") for w in range(2)] == \
                [ref.hashes_in(w, "G1") for w in range(2)], step
            assert ours.stats() == ref.stats() and ours.match(list(range(4))) == ref.match(list(range(4)))
    for index in (ours, ref):
        index.apply_event(0, ClearedEvent(1, "G1"))
        index.apply_event(1, ClearedEvent(1, "G1"))
        assert index.stats()["nodes"] == 0


def _engine_ops(rng: random.Random, n: int) -> list:
    """Random events of 3 workers x 2 ranks over a small pool of hashes (nodes come and go,
    records are reused, holders fill and drain), with parents that make placeholders and
    cycles."""
    pool = [rng.getrandbits(64) for _ in range(60)]
    ops = []
    for _ in range(n):
        w, dp, tier = rng.randrange(3), rng.randrange(2), rng.choice(("G1", "G2"))
        r = rng.random()
        if r < 0.6:
            hashes = rng.sample(pool, rng.randrange(1, 6))
            parent = rng.choice([None, *pool])
            ops.append(("apply", w, dp, StoredEvent(1, tier, parent, 4, tuple(
                StoredBlock(h, h ^ 1) for h in hashes))))
        elif r < 0.95:
            ops.append(("apply", w, dp, RemovedEvent(1, tier, tuple(rng.sample(pool, rng.randrange(1, 8))))))
        elif r < 0.99:
            ops.append(("apply", w, dp, ClearedEvent(1, tier)))
        else:
            ops.append(("reset", w, dp))
    return ops


@pytest.mark.skipif(NATIVE_CORE is None, reason="native indexer core not built")
@pytest.mark.parametrize("seed", range(4))
def test_the_cores_agree_over_long_churn_of_data_parallel_engines(seed):
    """Long enough for the native core's per-holder logs to be compacted many times (records
    let go of, and records reused by a holder that held them before)."""
    rng = random.Random(seed)
    ours, ref = PrefixIndex(native=True), PrefixIndex(native=False)
    queries = [[rng.getrandbits(64)] for _ in range(2)]
    for step, (what, w, dp, *event) in enumerate(_engine_ops(rng, 6000)):
        for index in (ours, ref):
            if what == "apply":
                index.apply_event(w, event[0], dp)
            else:
                index.reset_worker(w, dp)
        if step % 500 == 0 or what != "apply":
            views = [(index.stats(), {(w, dp, t): index.hashes_in(w, t, dp) for w in range(3)
                                      for dp in range(2) for t in ("G1", "G2")})
                     for index in (ours, ref)]
            assert views[0] == views[1], step
    pool = [h for (w, dp, t), held in views[1][1].items() for h in held]
    for q in [pool[:5], pool[-5:], *queries]:
        assert match_response(ours, q) == match_response(ref, q)
    for index in (ours, ref):
        for w in range(3):
            for dp in range(2):
                index.reset_worker(w, dp)
        assert index.stats()["nodes"] == 0


# -- /match bounds ---------------------------------------------------------------------------------


def _post(server, body: bytes, extra: bytes = b"") -> tuple[int, dict]:
    import socket

    from kvstrata.events.indexer import http_token

    request = (b"POST /match HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n" % len(body)
               + b"Authorization: Bearer %s\r\n" % http_token().encode()
               + extra + b"\r\n" + body)
    with socket.create_connection(server.address, timeout=30) as sock:
        sock.sendall(request)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
            head, _, rest = reply.partition(b"\r\n\r\n")
            length = [int(h.split(b":")[1]) for h in head.split(b"\r\n")
                      if h.lower().startswith(b"content-length:")]
            if length and len(rest) >= length[0]:
                return int(head.split()[1]), json.loads(rest[: length[0]])
    raise AssertionError(f"no whole reply: {reply[:200]!r}")


def test_match_takes_at_most_a_million_hashes_in_either_form():
    MAX_MATCH_HASHES = 1 << 20                           # indexer.MAX_MATCH_HASHES
    server = IndexServer(PrefixIndex()).start()
    try:
        code, answer = _post(server, json.dumps({"hashes": [1] * MAX_MATCH_HASHES}).encode())
        assert code == 200 and answer["length"] == MAX_MATCH_HASHES
        for body in ({"hashes": [1] * (MAX_MATCH_HASHES + 1)},
                     {"hashes": "1 " * (MAX_MATCH_HASHES + 1)},
                     {"local_hashes": ",".join(["0x1"] * (MAX_MATCH_HASHES + 1))}):
            code, answer = _post(server, json.dumps(body).encode())
            assert code == 400 and "more than 1,048,576 hashes" in answer["error"], answer
    finally:
        server.close()


def test_a_string_of_hashes_is_not_split_whole():
    """Splitting a 16 MiB string of one-digit hashes took ~12 times its size."""
    from kvstrata.events.indexer import _parse_hash_list

    text = "0 " * (4 << 20)                              # 8 MiB, 4 M hashes
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="more than"):
            _parse_hash_list(text, "hashes")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak


def test_a_body_of_more_values_than_a_query_holds_is_refused_before_parsing():
    """``[],`` repeated: 5 M empty lists out of a 16 MiB body (~300 MiB) before any check."""
    from kvstrata.events.indexer import _parse_body

    body = b'{"hashes": [' + b"[]," * (2 << 20) + b"[]]}"
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="commas"):
            _parse_body(body)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak


def test_a_body_is_read_by_its_length_only():
    """A body sent chunked (``Transfer-Encoding``) is refused, not read as its length says
    with the rest taken for the next request."""
    server = IndexServer(PrefixIndex(), read_timeout=1.0).start()
    try:
        code, answer = _post(server, b'{"hashes": [1]}', b"Transfer-Encoding: chunked\r\n")
        assert code == 400 and "Transfer-Encoding" in answer["error"]
        code, _ = _post(server, b'{"hashes": [1]}')
        assert code == 200
    finally:
        server.close()


def test_a_target_that_does_not_tell_engines_apart_gets_rank_0_only():
    """A target written for one engine per worker (``apply_event(worker, event)``) raised
    TypeError on an engine of rank > 0, after the follower had counted the event applied."""
    class OneEnginePerWorker:
        def __init__(self) -> None:
            self.got: list[tuple[int, int]] = []

        def apply_event(self, worker_id, event):
            self.got.append((worker_id, event.event_id))

        def reset_worker(self, worker_id):
            self.got.clear()

    target = OneEnginePerWorker()
    follower = StreamFollower(target, snapshots=False)
    event = lambda i: StoredEvent(i, "G1", None, 4, (StoredBlock(i, i),))  # noqa: E731
    follower.feed(3, None, [event(1)], 0)
    follower.feed(3, None, [event(1), event(2)], 1)
    follower.feed(3, None, [event(2)], 0)
    assert target.got == [(3, 1), (3, 2)]
    assert follower.stats()["unranked"] == 2 and follower.applied == 2
    assert StreamFollower(PrefixIndex()).ranked and not follower.ranked


@pytest.mark.skipif(NATIVE_CORE is None, reason="the native core is not built")
def test_a_holder_emptied_by_removals_keeps_no_log_of_what_it_held():
    """The native core's per-holder log was compacted only when the holder took more, so a
    holder emptied by removals listed and cleared at the cost of its peak, and kept its
    log's memory."""
    core = NATIVE_CORE()
    blocks = [(h, h) for h in range(1, 50_001)]
    core.store(0, None, blocks)
    peak = core.memory()
    core.remove(0, [h for h, _ in blocks[1:]][::-1])
    assert core.count(0) == 1 and core.hashes_in(0) == {1}
    assert core.memory() < peak - 4 * 40_000      # the log shrank with what it holds
