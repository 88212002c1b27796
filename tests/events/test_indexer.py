import json
import urllib.request

import pytest

from kvstrata.events import EventPublisher, make_publisher
from kvstrata.events.indexer import (IndexServer, PrefixIndex, build_index, http_token, main,
                                     match_response)
from kvstrata.events.model import ClearedEvent, RemovedEvent, stored_event
from kvstrata.events.sinks import MemorySink
from kvstrata.logical.registry import BlockRegistry

from .helpers import chain
from .native import native_or_python


@pytest.fixture(autouse=True, params=["native", "python"])
def _native_or_python(request, monkeypatch):
    """Every test here runs with the native fast paths (when built) and without them."""
    return native_or_python(request, monkeypatch)


def seqs(c):
    return [r.sequence_hash for r in c]


def bearer() -> dict[str, str]:
    """The header the indexer's /match and /stats require (the test session's secret is set
    in tests/conftest.py)."""
    return {"Authorization": f"Bearer {http_token()}"}


def test_match_prefix_per_worker_and_tier():
    c = chain(1, 6)
    idx = PrefixIndex()
    idx.apply_event(1, stored_event(1, "G1", c[:3], 0))
    idx.apply_event(1, stored_event(2, "G2", c[:5], 0))
    idx.apply_event(2, stored_event(1, "G3", c[:6], 0))
    idx.apply_event(2, RemovedEvent(2, "G3", (c[3].sequence_hash,)))
    assert idx.match(seqs(c)) == {1: {"G1": 3, "G2": 5}, 2: {"G3": 3}}
    assert idx.match(seqs(c)[1:]) == {1: {"G1": 2, "G2": 4}, 2: {"G3": 2}}  # counts leading hashes given
    assert idx.match([]) == {}
    assert idx.match_local([r.local_hash for r in c]) == {1: {"G1": 3, "G2": 5}, 2: {"G3": 3}}
    resp = match_response(idx, seqs(c))
    assert resp["best"] == {"worker_id": 1, "tier": "G2", "prefix": 5} and resp["per_worker"] == {"1": 5, "2": 3}


def test_orphans_pruning_and_reset():
    c = chain(2, 4)
    idx = PrefixIndex()
    idx.apply_event(1, stored_event(1, "G2", c[2:], 0))  # children first, parent unknown
    assert idx.match(seqs(c)) == {}
    idx.apply_event(1, stored_event(2, "G2", c[:2], 0))
    assert idx.match(seqs(c)) == {1: {"G2": 4}}
    idx.apply_event(1, RemovedEvent(3, "G2", tuple(seqs(c))))
    assert idx.stats()["nodes"] == 0  # nothing held, nothing left
    idx.apply_event(1, stored_event(4, "G1", c, 0))
    idx.apply_event(3, stored_event(1, "G1", c[:2], 0))
    idx.reset_worker(1)
    assert idx.match(seqs(c)) == {3: {"G1": 2}} and idx.stats()["nodes"] == 2
    idx.apply_event(3, ClearedEvent(2, "G1"))
    assert idx.stats()["nodes"] == 0


def test_build_index_and_compare_with_registry():
    reg = BlockRegistry()
    pub = EventPublisher(MemorySink(), max_delay=0).start()
    reg.add_observer(pub)
    c = chain(3, 8)
    reg.record_stored("G1", c)
    reg.record_stored("G2", c[:4])
    reg.record_removed("G1", seqs(c[6:]))
    pub.flush(2)
    idx = build_index(pub.sink.events, worker_id=9)
    assert idx.compare_with_registry(reg, 9) == {}
    reg.record_stored("G3", c[:1])
    assert idx.compare_with_registry(reg, 9) == {"G3": {"missing": 1, "extra": 0, "index": 0, "registry": 1}}
    pub.close()


def test_http_match_and_stats():
    c = chain(4, 5)
    idx = PrefixIndex()
    idx.apply_event(7, stored_event(1, "G2", c[:4], 0))
    server = IndexServer(idx).start()
    host, port = server.address
    try:
        body = json.dumps({"hashes": [str(h) for h in seqs(c)]}).encode()
        with urllib.request.urlopen(urllib.request.Request(f"http://{host}:{port}/match", body,
                                                           bearer(), method="POST")) as r:
            resp = json.load(r)
        assert resp["matches"] == [{"worker_id": 7, "tier": "G2", "prefix": 4}] and resp["length"] == 5
        with urllib.request.urlopen(urllib.request.Request(f"http://{host}:{port}/stats",
                                                           headers=bearer())) as r:
            stats = json.load(r)
        assert stats["blocks"] == {"7": {"G2": 4}} and stats["nodes"] == 4
        bad = urllib.request.Request(f"http://{host}:{port}/match", b'{"hashes": [-1]}',
                                     bearer(), method="POST")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(bad)
        assert err.value.code == 400 and "unsigned 64-bit" in json.load(err.value)["error"]
    finally:
        server.close()


def test_cli_query_from_files(tmp_path, capsys):
    reg = BlockRegistry()
    kv = make_publisher(f"jsonl:{tmp_path}/a.jsonl", worker_id=1)
    dyn = make_publisher(f"dynamo-json:{tmp_path}/b.jsonl", worker_id=2)
    c = chain(5, 6)
    reg.add_observer(kv)
    reg.record_stored("G1", c[:2])
    reg.add_observer(dyn)
    reg.record_stored("G1", c[2:])  # worker 2 sees only these, worker 1 all
    reg.record_stored("G2", c)
    kv.close()
    dyn.close()
    q = ",".join(str(h) for h in seqs(c))
    assert main(["--file", f"{tmp_path}/a.jsonl", "--file", f"{tmp_path}/b.jsonl", "--query", q]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {(m["worker_id"], m["tier"]): m["prefix"] for m in out["matches"]} == {(1, "G1"): 6, (1, "G2"): 6, (2, "G2"): 6}
    assert main(["--file", f"{tmp_path}/a.jsonl"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["blocks"] == {"1": {"G1": 6, "G2": 6}} and stats["stream"]["gaps"] == 0


def test_cli_errors(tmp_path, capsys):
    (tmp_path / "bad.jsonl").write_text('{"nope": 1}\n')
    assert main(["--file", str(tmp_path / "bad.jsonl")]) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err
    assert main(["--file", str(tmp_path / "missing.jsonl")]) == 2
    assert main(["--file", str(tmp_path / "bad.jsonl"), "--query", "x,y"]) == 2
    with pytest.raises(SystemExit):
        main([])


# -- the HTTP endpoint cannot be stalled: bounded reads, timeouts, 400 for bad requests ---

def _raw(server, payload: bytes, wait: float = 5.0) -> bytes:
    import socket

    host, port = server.address
    with socket.create_connection((host, port), timeout=wait) as sock:
        sock.sendall(payload)
        chunks = []
        try:
            while True:
                data = sock.recv(65536)
                if not data:
                    break
                chunks.append(data)
        except TimeoutError:
            pass
    return b"".join(chunks)


def _post(length_header: str, body: bytes) -> bytes:
    return (b"POST /match HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + b"Authorization: Bearer %s\r\n" % http_token().encode()
            + length_header.encode() + body)


@pytest.mark.parametrize("request_bytes", [
    _post("Content-Length: -1\r\n\r\n", b""),
    _post("Content-Length: abc\r\n\r\n", b"{}"),
    _post("Content-Length: 999999999999\r\n\r\n", b"{}"),
    _post("\r\n", b""),                                                    # no Content-Length
    _post("Content-Length: 100000\r\n\r\n", b"[" * 100000),               # nests too deep
    _post("Content-Length: 4\r\n\r\n", b"\xff\xfe\x00\x01"),               # not JSON
    _post("Content-Length: 2\r\n\r\n", b"[]"),                             # not an object
], ids=["negative", "not-a-number", "huge", "missing", "deep", "binary", "list"])
def test_malformed_requests_are_answered_400(request_bytes):
    from kvstrata.events.indexer import IndexServer, PrefixIndex

    server = IndexServer(PrefixIndex(), read_timeout=1.0).start()
    try:
        reply = _raw(server, request_bytes)
        assert reply.startswith(b"HTTP/1.0 400") or reply.startswith(b"HTTP/1.1 400"), reply[:200]
        # and the server still answers others
        ok = _raw(server, _post("Content-Length: 15\r\n\r\n", b'{"hashes": [1]}'))
        assert b" 200 " in ok.split(b"\r\n", 1)[0]
    finally:
        server.close()


def test_a_body_shorter_than_announced_times_out_with_400():
    from kvstrata.events.indexer import IndexServer, PrefixIndex

    server = IndexServer(PrefixIndex(), read_timeout=1.0).start()
    try:
        reply = _raw(server, _post("Content-Length: 100\r\n\r\n", b'{"hashes"'), wait=60)
        assert b" 400 " in reply.split(b"\r\n", 1)[0]
    finally:
        server.close()


def test_only_trusted_workers_are_indexed(tmp_path, capsys):
    import json as json_module

    from kvstrata.events.indexer import main
    from kvstrata.events.spec import make_publisher
    from kvstrata.tokens import hash_blocks
    from kvstrata.types import BlockRecord

    paths = []
    for worker in (1, 2):
        path = tmp_path / f"w{worker}.jsonl"
        publisher = make_publisher(f"jsonl:{path}", worker_id=worker, max_delay=0.0)
        local, seqs = hash_blocks(list(range(worker * 100, worker * 100 + 8)), 4)
        publisher.on_tier_stored("G2", [BlockRecord(s, l, p, 4) for s, l, p
                                        in zip(seqs, local, [None, seqs[0]])])
        publisher.close()
        paths.append(str(path))
    assert main(["--file", paths[0], "--file", paths[1], "--trust-workers", "1"]) == 0
    stats = json_module.loads(capsys.readouterr().out)
    assert stats["stream"]["untrusted"] == 1 and stats["stream"]["workers"] == 1
    with pytest.raises(SystemExit) as stop:
        main(["--file", paths[0], "--trust-workers", "x"])
    assert stop.value.code == 2


def test_a_client_dripping_its_request_is_cut_off_at_the_request_deadline():
    """Issue 28, item 4 (was a bug): the timeout was per read, so one header byte every few
    seconds kept a connection (and its thread) for as long as the client liked. Now the whole
    request has a deadline."""
    import socket
    import time

    from kvstrata.events.indexer import IndexServer, PrefixIndex

    server = IndexServer(PrefixIndex(), read_timeout=1.0, request_timeout=2.0).start()
    try:
        with socket.create_connection(server.address, timeout=10) as sock:
            closed_at = None
            # dripped for far longer than the 2 s deadline (a hang guard on a loaded machine)
            for byte in b"POST /match HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200:
                try:
                    sock.sendall(bytes([byte]))
                    time.sleep(0.3)                  # well under the old per-read timeout
                    sock.setblocking(False)
                    try:
                        if sock.recv(1) == b"":      # the server closed the connection
                            closed_at = time.monotonic()
                            break
                    except BlockingIOError:
                        pass
                    finally:
                        sock.setblocking(True)
                except OSError:
                    closed_at = time.monotonic()
                    break
        assert closed_at is not None, "the dripping client was never cut off"
        ok = _raw(server, _post("Content-Length: 15\r\n\r\n", b'{"hashes": [1]}'))
        assert b" 200 " in ok.split(b"\r\n", 1)[0]
    finally:
        server.close()


def test_connections_beyond_the_bound_are_closed_and_threads_stay_bounded():
    """Issue 28, item 4 (was a bug): a thread per connection without a bound (100 slow
    connections held 103 threads). At most ``max_connections`` are served at once; the rest
    are closed at once, and the server answers again once the slow ones are cut off."""
    import socket
    import threading
    import time

    from kvstrata.events.indexer import IndexServer, PrefixIndex

    server = IndexServer(PrefixIndex(), read_timeout=1.0, request_timeout=1.5,
                         max_connections=8).start()
    socks = []
    try:
        before = threading.active_count()
        peak = 0
        for _ in range(40):
            sock = socket.create_connection(server.address, timeout=10)
            sock.sendall(b"POST /match HTTP/1.1\r\n")          # and then nothing
            socks.append(sock)
            peak = max(peak, threading.active_count() - before)
        for _ in range(20):
            time.sleep(0.1)
            peak = max(peak, threading.active_count() - before)
        assert peak <= 8, peak
        assert server.httpd.dropped > 0      # newcomers replace the oldest still in headers
        deadline = time.monotonic() + 30
        while True:                       # the slow ones are cut off at their deadline
            try:
                ok = _raw(server, _post("Content-Length: 15\r\n\r\n", b'{"hashes": [1]}'))
                if b" 200 " in ok.split(b"\r\n", 1)[0]:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the server never answered again"
            time.sleep(0.2)
    finally:
        for sock in socks:
            sock.close()
        server.close()


def test_the_indexer_never_answers_one_tenants_prefix_to_another():
    """A prompt stored under one cache salt (or LoRA) is no match, by sequence or by local
    hashes, for the same tokens under another salt, an adapter, or none."""
    from kvstrata.tokens import hash_blocks, isolation_seed
    from kvstrata.types import BlockRecord

    tokens = list(range(100, 100 + 6 * 16))

    def records(seed):
        local, seq = hash_blocks(tokens, 16, seed)
        return [BlockRecord(s, lh, p, 16) for s, lh, p in zip(seq, local, [None, *seq[:-1]])]

    mine = records(isolation_seed(cache_salt="tenant-1"))
    idx = PrefixIndex()
    idx.apply_event(1, stored_event(1, "G2", mine, 0))
    assert idx.match(seqs(mine)) == {1: {"G2": 6}}
    assert idx.match_local([r.local_hash for r in mine]) == {1: {"G2": 6}}
    for seed in (isolation_seed(cache_salt="tenant-2"), isolation_seed(),
                 isolation_seed(lora_name="tenant-1")):
        other = records(seed)
        assert idx.match(seqs(other)) == {}
        assert idx.match_local([r.local_hash for r in other]) == {}
        assert match_response(idx, seqs(other))["best"] is None
