"""The indexer's HTTP (``kvstrata indexer --http``, :class:`IndexServer`) against hostile
clients (review findings):

* it answered /match and /stats to anyone who could connect: a prompt-membership oracle
  (hash a guessed prompt with ``kvstrata hash``, ask /match whether a worker caches it), and
  ``--http 0.0.0.0:PORT`` was taken without a word. Now both need a bearer token derived from
  the deployment's secret, and without a secret there is no server;
* one client dripping headers on 64 connections kept it unanswered;
* a /match body took about 6 times its size to parse, as many at once as connections.

The test session's secret is set in tests/conftest.py.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from kvstrata.events.indexer import (HTTP_TOKEN_PURPOSE, MATCH_CONCURRENCY, MATCH_GATE_BYTES,
                                     MAX_BODY_BYTES, IndexerSecretError, IndexServer,
                                     PrefixIndex, http_token, main)
from kvstrata.events.model import stored_event
from kvstrata.secret import SECRET_ENV, SECRET_FILE_ENV, derive_key

from .helpers import chain

WAIT = 60.0
"""Socket timeout and readiness deadline: generous, never a timing claim."""


def _request(server, method: str, path: str, body: bytes | None = None,
             headers: dict[str, str] | None = None, source: str = "127.0.0.1"):
    conn = http.client.HTTPConnection(*server.address, timeout=WAIT, source_address=(source, 0))
    try:
        conn.request(method, path, body, headers or {})
        reply = conn.getresponse()
        return reply.status, dict(reply.getheaders()), reply.read()
    finally:
        conn.close()


def _bearer(token: str | None = None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token or http_token()}"}


@pytest.fixture
def served():
    """An index holding a 4-block prefix of worker 7 in G2, served."""
    c = chain(4, 5)
    index = PrefixIndex()
    index.apply_event(7, stored_event(1, "G2", c[:4], 0))
    server = IndexServer(index).start()
    try:
        yield server, [r.sequence_hash for r in c]
    finally:
        server.close()


# -- authentication ----------------------------------------------------------------------------


def test_match_and_stats_answer_only_the_bearer_of_the_token(served):
    server, hashes = served
    body = json.dumps({"hashes": hashes}).encode()
    other = http_token("another deployment's secret, 32b")
    refused = [None, _bearer(other), {"Authorization": "Bearer"},
               {"Authorization": f"Basic {http_token()}"},
               {"Authorization": f"Bearer {http_token()}x"},
               {"Authorization": http_token()}]
    for headers in refused:
        for method, path, data in (("POST", "/match", body), ("GET", "/stats", None)):
            status, reply_headers, reply = _request(server, method, path, data, headers)
            assert status == 401, (headers, path, reply)
            assert "error" in json.loads(reply) and "7" not in reply.decode()
            assert reply_headers["WWW-Authenticate"].startswith("Bearer")
    # a body is not looked at before the token: a malformed one is 401, not 400
    assert _request(server, "POST", "/match", b'{"hashes": [-1]}')[0] == 401
    status, _, reply = _request(server, "POST", "/match", body, _bearer())
    assert status == 200 and json.loads(reply)["per_worker"] == {"7": 4}
    status, _, reply = _request(server, "GET", "/stats", None,
                                {"Authorization": f"bearer  {http_token()} "})
    assert status == 200 and json.loads(reply)["blocks"] == {"7": {"G2": 4}}


def test_requests_without_the_token_hold_no_connection_for_their_body(served):
    """A 401 read the rest of a small body first, on a connection no longer one to close
    for room: a client without the token held every connection of its address (and with
    two addresses, every connection) by announcing bodies it never sent."""
    import socket

    server, hashes = served
    held = []
    try:
        for source in ("127.0.0.2", "127.0.0.3"):
            for _ in range(server.httpd.max_connections_per_host):
                sock = socket.create_connection(server.address, timeout=WAIT,
                                                source_address=(source, 0))
                sock.sendall(b"POST /match HTTP/1.0\r\nAuthorization: Bearer wrong\r\n"
                             b"Content-Length: 65536\r\n\r\nx")     # the rest never comes
                held.append(sock)
        status, _, body = _request(server, "POST", "/match",
                                   json.dumps({"hashes": hashes}).encode(), _bearer(),
                                   source="127.0.0.9")
        assert status == 200 and json.loads(body)["matches"][0]["prefix"] == 4
        for sock in held:                          # each answered without its body
            assert sock.recv(64).startswith(b"HTTP/1.0 401")
    finally:
        for sock in held:
            sock.close()


def test_two_authorization_headers_are_refused(served):
    server, hashes = served
    conn = http.client.HTTPConnection(*server.address, timeout=WAIT)
    try:
        conn.putrequest("GET", "/stats")
        conn.putheader("Authorization", "Bearer wrong")
        conn.putheader("Authorization", f"Bearer {http_token()}")
        conn.endheaders()
        assert conn.getresponse().status == 401
    finally:
        conn.close()


def test_healthz_is_answered_to_anyone_and_tells_nothing(served):
    server, _ = served
    for path in ("/healthz", "/"):
        status, _, reply = _request(server, "GET", path)
        assert status == 200 and json.loads(reply) == {"ok": True}


def test_the_token_is_derived_from_the_deployment_secret(tmp_path):
    secret = "0123456789abcdef-a test secret"
    token = http_token(secret)
    assert token == derive_key(secret.encode(), HTTP_TOKEN_PURPOSE).hex() and len(token) == 64
    assert secret not in token and http_token("0123456789abcdef-another secret") != token
    assert http_token(env={}) is None
    assert http_token(env={SECRET_ENV: secret}) == token
    path = tmp_path / "secret"
    path.write_text(secret + "\n")
    path.chmod(0o600)
    assert http_token(env={SECRET_FILE_ENV: str(path)}) == token


def test_without_a_secret_there_is_no_server(monkeypatch, capsys):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    with pytest.raises(IndexerSecretError, match=SECRET_ENV):
        IndexServer(PrefixIndex())
    for argv in (["--file", os.devnull, "--http", "127.0.0.1:0"], ["--print-token"]):
        assert main(argv) == 2
        out, err = capsys.readouterr()
        assert out == "" and len(err.strip().splitlines()) == 1 and SECRET_ENV in err, err
    monkeypatch.setenv(SECRET_ENV, "a" * 32)                  # a placeholder: refused
    assert main(["--file", os.devnull, "--http", "127.0.0.1:0"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    with pytest.raises(IndexerSecretError):
        IndexServer(PrefixIndex())


def test_print_token_prints_the_token_and_exits_0(capsys):
    assert main(["--print-token"]) == 0
    assert capsys.readouterr().out == http_token() + "\n"


def test_the_command_serves_the_token_bearer_only(tmp_path):
    """The reviewer's oracle, end to end: another client guesses a cached prompt."""
    from kvstrata.events.spec import make_publisher
    from kvstrata.tokens import hash_blocks
    from kvstrata.types import BlockRecord

    events = tmp_path / "events.jsonl"
    local, seq = hash_blocks([9906, 374, 757, 3636, 11, 1268, 527, 499], 4)
    publisher = make_publisher(f"jsonl:{events}", worker_id=7, max_delay=0.0)
    publisher.on_tier_stored("G2", [BlockRecord(seq[0], local[0], None, 4),
                                    BlockRecord(seq[1], local[1], seq[0], 4)])
    publisher.close()
    command = [sys.executable, "-m", "kvstrata.cli", "indexer"]
    token = subprocess.run(command + ["--print-token"], capture_output=True, text=True,
                           timeout=120, check=True).stdout.strip()
    assert token == http_token()
    proc = subprocess.Popen(command + ["--file", str(events), "--http", "127.0.0.1:0"],
                            stderr=subprocess.PIPE, bufsize=0)   # readline reads no further
    try:
        line = proc.stderr.readline().decode()   # readiness: it says where it serves
        assert "serving http://127.0.0.1:" in line, line
        port = int(line.rsplit(":", 1)[1])
        body = json.dumps({"hashes": seq}).encode()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT)
        conn.request("POST", "/match", body)
        assert conn.getresponse().status == 401
        conn.close()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT)
        conn.request("POST", "/match", body, {"Authorization": f"Bearer {token}"})
        reply = conn.getresponse()
        assert reply.status == 200 and json.loads(reply.read())["per_worker"] == {"7": 2}
        conn.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143 and b"warning" not in err, err


def test_serving_beyond_this_machine_is_said(tmp_path):
    events = tmp_path / "events.jsonl"
    events.write_text("")
    proc = subprocess.Popen([sys.executable, "-m", "kvstrata.cli", "indexer", "--file",
                             str(events), "--http", "0.0.0.0:0"], stderr=subprocess.PIPE,
                            bufsize=0)                   # readline reads no further
    try:
        said = [proc.stderr.readline()]           # the warning, then where it serves
        if b"serving" not in said[0]:
            said.append(proc.stderr.readline())
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
    assert b"warning" in said[0] and b"other machines" in said[0], said
    assert b"serving http://0.0.0.0:" in said[-1], said


# -- slowloris ---------------------------------------------------------------------------------


def test_a_client_dripping_headers_on_many_connections_leaves_the_indexer_answering():
    """Review finding (was a bug): one local client's 64 connections, each dripping a header
    every 5 s, kept /healthz unanswered for 70 s. Now one client holds at most
    ``MAX_CONNECTIONS_PER_HOST`` connections (its newcomers replace its own oldest still
    sending headers): another client's /match and /healthz, and the dripping client's own
    newcomer, are answered (the request deadline is an hour here: no connection is answered
    by another timing out)."""
    import socket

    from kvstrata.httpserve import MAX_CONNECTIONS

    server = IndexServer(PrefixIndex(), request_timeout=3600.0).start()
    socks = []
    try:
        for _ in range(MAX_CONNECTIONS + 8):
            sock = socket.create_connection(server.address, timeout=WAIT)
            sock.sendall(b"POST /match HTTP/1.1\r\nHost: x\r\nX-Slow: a\r\n")
            socks.append(sock)
        for sock in socks:
            try:
                sock.sendall(b"X-Slow: b\r\n")
            except OSError:
                pass
        status, _, reply = _request(server, "POST", "/match", b'{"hashes": [1]}', _bearer(),
                                    source="127.0.0.2")
        assert status == 200 and json.loads(reply)["length"] == 1
        assert _request(server, "GET", "/healthz", source="127.0.0.2")[0] == 200
        assert _request(server, "GET", "/healthz")[0] == 200
        assert server.httpd.refused == 0
    finally:
        for sock in socks:
            sock.close()
        server.close()


# -- memory --------------------------------------------------------------------------------------


def test_large_match_bodies_are_parsed_a_few_at_a_time(monkeypatch):
    """Review finding (was a bug): a 16 MiB /match body peaked at 98 MiB while parsed, 8 at
    once at 515 MiB. Bodies over ``MATCH_GATE_BYTES`` are parsed and matched by at most
    ``MATCH_CONCURRENCY`` requests at once; small ones never wait."""
    from kvstrata.events import indexer

    real = indexer._parse_body
    lock = threading.Lock()
    inside: list[int] = []
    most = [0]
    go = threading.Event()

    def parse(body: bytes) -> dict:
        large = len(body) > MATCH_GATE_BYTES
        if large:
            with lock:
                inside.append(1)
                most[0] = max(most[0], len(inside))
            go.wait(WAIT)                       # held until the test has looked
        try:
            return real(body)
        finally:
            if large:
                with lock:
                    inside.pop()

    monkeypatch.setattr(indexer, "_parse_body", parse)
    server = IndexServer(PrefixIndex(), request_timeout=3600.0).start()
    big = json.dumps({"hashes": list(range(1, 30_000))}).encode()
    assert len(big) > MATCH_GATE_BYTES
    answers: list[int] = []
    clients = [threading.Thread(target=lambda: answers.append(
        _request(server, "POST", "/match", big, _bearer())[0])) for _ in range(6)]
    try:
        for client in clients:
            client.start()
        deadline = time.monotonic() + WAIT
        gate = server.match_gate
        while not (gate.held == MATCH_CONCURRENCY and gate.waiting == 6 - MATCH_CONCURRENCY):
            assert time.monotonic() < deadline, (gate.held, gate.waiting, len(inside))
            time.sleep(0.05)
        assert len(inside) == MATCH_CONCURRENCY
        # a small body is answered while the large ones wait
        status, _, reply = _request(server, "POST", "/match", b'{"hashes": [1]}', _bearer())
        assert status == 200 and json.loads(reply)["length"] == 1
    finally:
        go.set()
        for client in clients:
            client.join(WAIT)
        server.close()
    assert answers == [200] * 6 and most[0] == MATCH_CONCURRENCY


def test_a_body_over_the_cap_is_refused_unread(served):
    import socket

    server, _ = served
    with socket.create_connection(server.address, timeout=WAIT) as sock:
        sock.sendall(b"POST /match HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
                     b"Content-Length: %d\r\n\r\n" % (http_token().encode(), MAX_BODY_BYTES + 1))
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply.split(b"\r\n", 1)[0].split()[1] == b"400"
    assert MAX_BODY_BYTES <= 8 << 20
