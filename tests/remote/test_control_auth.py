"""Nobody reads what is not theirs over the control port (issue 27, findings 1 and 2): an
exporter answers nothing, ``has`` included, to a connection that has not proved it holds the
deployment's sharing secret, refuses to start without one, proves it holds it too; lease ids
are random and a lease is its connection's; one connection cannot take the lease table and one
host cannot take every connection."""

from __future__ import annotations

import os
import socket
import struct
import time

import msgpack
import numpy as np
import pytest

from kvstrata.remote import control
from kvstrata.secret import SecretError, resolve_secret
from kvstrata.remote.control import MAX_CONNECTIONS_PER_HOST, ControlChannel, parse_control
from kvstrata.remote.errors import LeaseError
from kvstrata.remote.nixl_agent import nixl_available

from .handshake import connect

pytestmark = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")


def hashes(*values) -> bytes:
    return np.array(values, dtype="<u8").tobytes()


def raw_request(address, request: dict, timeout: float = 2.0):
    """Send one request on a fresh, unauthenticated connection: the reply, or None if the
    connection was closed unanswered."""
    with socket.create_connection(address, timeout=timeout) as sock:
        body = msgpack.packb(request)
        sock.sendall(struct.pack("<I", len(body)) + body)
        try:
            data = sock.recv(1 << 16)
        except ConnectionResetError:
            return None
        return msgpack.unpackb(data[4:], raw=False) if data else None


def test_an_unauthenticated_peer_gets_no_answer_at_all(exporter):
    """Finding 1: any local client got the block set (NIXL metadata), asked ``has`` to learn
    whether a prefix is cached, and took leases."""
    ex, pins = exporter
    address = parse_control(ex.control)
    before = ex.requests
    for request in ({"op": "has", "hashes": hashes(1)}, {"op": "blockset"},
                    {"op": "lease", "hashes": hashes(1), "ttl": 5},
                    {"op": "auth", "proof": b"\0" * 32}):
        assert raw_request(address, request) is None, request
    assert ex.requests == before and not pins.pinned            # the handler never ran


def test_a_wrong_secret_is_refused_and_an_impostor_exporter_is_found_out(exporter):
    ex, _ = exporter
    stranger = ControlChannel(ex.control, 2.0, secret=b"not the deployment's secret")
    with pytest.raises(LeaseError, match="did not prove it holds the sharing secret"):
        stranger.call({"op": "has", "hashes": hashes(1)})
    # a reader of the deployment talking to a server with another secret (an impostor
    # listening on the address) finds out before sending anything
    impostor = control.ControlServer("127.0.0.1", 0, lambda body, peer: body,
                                     max_request=1 << 16, tick=0.05, on_tick=lambda: None,
                                     name="kvstrata-impostor",
                                     secret=b"an impostor's own secret value")
    impostor.start()
    try:
        with pytest.raises(LeaseError, match="did not prove"):
            ControlChannel(impostor.address, 2.0).call({"op": "blockset"})
    finally:
        impostor.close()
    assert ControlChannel(ex.control, 2.0).call({"op": "has", "hashes": hashes(1)})["held"] == 1


def test_a_connection_that_never_authenticates_is_closed(exporter, monkeypatch):
    ex, _ = exporter
    monkeypatch.setattr(control, "AUTH_TIMEOUT", 0.3)
    with socket.create_connection(parse_control(ex.control), timeout=3) as sock:
        t0 = time.monotonic()
        assert sock.recv(1) == b""                               # closed by the exporter
        assert time.monotonic() - t0 < 2.0


def test_an_exporter_without_a_secret_refuses_to_start(monkeypatch):
    from kvstrata.physical.storage.host import HostStorage
    from kvstrata.protocol.layout import LayoutConfig
    from kvstrata.remote.exporter import BlockExporter

    from .pool_stand_in import Pins

    monkeypatch.delenv("KVSTRATA_SHARING_SECRET", raising=False)
    monkeypatch.delenv("KVSTRATA_SHARING_SECRET_FILE", raising=False)
    storage = HostStorage(LayoutConfig(num_blocks=4, num_layers=1, outer_dim=2, page_size=4,
                                       inner_dim=8))
    try:
        with pytest.raises(LeaseError, match="needs the deployment's sharing secret"):
            BlockExporter("nosecret", "G2", storage, Pins().pin, Pins().unpin)
        monkeypatch.setenv("KVSTRATA_SHARING_SECRET", "short")
        with pytest.raises(LeaseError, match="16 to 4096 bytes"):
            BlockExporter("short", "G2", storage, Pins().pin, Pins().unpin)
    finally:
        storage.close()


def test_a_secret_file_is_refused_when_others_could_have_written_it(tmp_path, other_user_uid):
    path = tmp_path / "secret"
    path.write_text("a secret of more than sixteen bytes\n")
    path.chmod(0o600)
    env = {"KVSTRATA_SHARING_SECRET_FILE": str(path)}
    assert resolve_secret(env=env) == b"a secret of more than sixteen bytes"
    link = tmp_path / "link"                         # Kubernetes mounts secrets as links
    link.symlink_to(path)
    assert resolve_secret(env={"KVSTRATA_SHARING_SECRET_FILE": str(link)}) is not None
    path.chmod(0o666)
    with pytest.raises(SecretError, match="writable by no one else"):
        resolve_secret(env=env)
    path.chmod(0o600)
    if other_user_uid is not None:
        os.chown(path, other_user_uid, -1)
        with pytest.raises(SecretError, match="owned by this user or root"):
            resolve_secret(env=env)
    with pytest.raises(SecretError, match="cannot open"):
        resolve_secret(env={"KVSTRATA_SHARING_SECRET_FILE": str(tmp_path / "missing")})


@pytest.fixture
def other_user_uid():
    """A uid that is neither this process's nor root's (chown needs root; None otherwise)."""
    return 4242 if os.geteuid() == 0 else None


def test_lease_ids_are_random_and_a_lease_is_its_connections(exporter):
    """Finding 1: lease ids counted up from 1 and were not tied to the connection, so another
    user released the owner's lease."""
    ex, pins = exporter
    owner, other = ControlChannel(ex.control, 2.0), ControlChannel(ex.control, 2.0)
    ids = [owner.call({"op": "lease", "hashes": hashes(1, 2), "ttl": 30})["lease"]
           for _ in range(4)]
    assert len(set(ids)) == 4 and all(i > 0 for i in ids)
    assert max(ids) - min(ids) > 1000                            # not a count
    assert other.call({"op": "release", "lease": ids[0]})["released"] is False
    assert len(ex.leases) == 4
    for lease_id in ids:
        assert owner.call({"op": "release", "lease": lease_id})["released"] is True
    assert len(ex.leases) == 0 and len(pins.pinned) == len(pins.unpinned)
    owner.close()
    other.close()


def leased(sock: socket.socket, request: dict) -> dict:
    body = msgpack.packb(request)
    sock.sendall(struct.pack("<I", len(body)) + body)
    return msgpack.unpackb(sock.recv(1 << 16)[4:], raw=False)


def test_one_host_cannot_take_the_lease_table_and_a_closed_connection_keeps_none(exporter):
    """Finding 2: one client took all 1,024 leases in 0.42 s; every other reader was then
    refused and the leased blocks stayed pinned. Leases are capped per host, however many
    connections it opens, and go when their connection closes."""
    ex, _ = exporter
    address = parse_control(ex.control)
    greedy, again = ControlChannel(ex.control, 5.0), ControlChannel(ex.control, 5.0)
    granted = 0
    for _ in range(200):
        reply = greedy.call({"op": "lease", "hashes": hashes(1), "ttl": 60})
        if "error" in reply:
            assert "the most one may" in reply["error"]
            break
        granted += 1
    assert granted == 64
    assert "error" in again.call({"op": "lease", "hashes": hashes(1), "ttl": 60})
    with connect(address, timeout=3, source="127.0.0.7") as other_host:
        assert leased(other_host, {"op": "lease", "hashes": hashes(1, 2), "ttl": 5})["lease"]
    greedy.close()
    again.close()
    assert _wait(lambda: len(ex.leases) == 0)       # every connection closed: nothing held


def _wait(predicate, timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not predicate():
        time.sleep(0.02)
    return predicate()


def test_connections_in_the_handshake_are_few_and_small(exporter):
    """A peer without the secret cannot make the exporter hold a request's worth of bytes
    per connection, nor hold the handshake slots of those that have the secret: one more
    connection from a network at its limit closes that network's oldest."""
    ex, _ = exporter
    address = parse_control(ex.control)
    waiting = [socket.create_connection(address, timeout=3)
               for _ in range(control.MAX_UNAUTHENTICATED_PER_HOST)]
    try:
        with socket.create_connection(address, timeout=3) as newest:
            told = b""
            while chunk := waiting[0].recv(64):                  # the oldest made room,
                told += chunk                                    # told it was busy first
            assert msgpack.unpackb(told[4:]) == {"busy": True}
            newest.settimeout(0.3)
            with pytest.raises(socket.timeout):                  # the newest still waits
                newest.recv(1)
    finally:
        for sock in waiting:
            sock.close()
    with socket.create_connection(address, timeout=3) as big:
        big.sendall(struct.pack("<I", control.MAX_HANDSHAKE_BYTES + 1) + b"\x80")
        assert big.recv(1) == b""                                # dropped, nothing buffered


def test_silent_connections_from_many_addresses_do_not_lock_readers_out(exporter):
    """A peer without the secret held every handshake slot from 8 loopback addresses and
    refilled them as they timed out: a reader holding the secret was refused at once."""
    ex, _ = exporter
    address = parse_control(ex.control)
    silent = [socket.create_connection(address, timeout=3, source_address=(f"127.0.1.{i}", 0))
              for i in range(1, 9) for _ in range(control.MAX_UNAUTHENTICATED_PER_HOST)]
    try:
        for _ in range(3):
            silent.append(socket.create_connection(address, timeout=3))  # refills as it goes
            channel = ControlChannel(ex.control, 5.0)
            try:
                assert channel.call({"op": "has", "hashes": hashes(1)}) == {"held": 1, "id": 1}
            finally:
                channel.close()
    finally:
        for sock in silent:
            sock.close()


@pytest.mark.parametrize("host, network", [
    ("127.0.0.1", "loopback"), ("127.0.5.9", "loopback"), ("::1", "loopback"),
    ("::ffff:127.0.0.2", "loopback"), ("10.1.2.3", "10.1.2.0/24"),
    ("::ffff:10.1.2.3", "10.1.2.0/24"), ("2001:db8:1:2:3::4", "2001:db8:1:2::/64"),
    ("not-an-address", "not-an-address"),
])
def test_handshake_limits_count_networks_not_addresses(host, network):
    assert control.network_of(host) == network


def assert_refused_at_once(address) -> None:
    """A new connection to ``address`` is closed without a byte."""
    with socket.create_connection(address, timeout=3) as extra:
        assert extra.recv(1) == b""


def test_one_host_cannot_take_every_connection(exporter):
    ex, _ = exporter
    address = parse_control(ex.control)
    held = [connect(address, timeout=3) for _ in range(MAX_CONNECTIONS_PER_HOST)]
    try:
        assert_refused_at_once(address)
        with connect(address, timeout=3, source="127.0.0.9") as other_host:
            assert leased(other_host, {"op": "has", "hashes": hashes(1)}) == {"held": 1}
    finally:
        for sock in held:
            sock.close()


def test_a_server_that_just_closes_the_handshake_gets_no_second_try():
    """Only an exporter that says it is busy is tried again: a port whose server drops the
    connection (not an exporter, a proxy with no backend) is an error at once, not a retry
    loop until the call's deadline."""
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    accepted = []

    def serve():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            accepted.append(conn)
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        channel = ControlChannel(f"tcp://127.0.0.1:{listener.getsockname()[1]}", 5.0)
        with pytest.raises(LeaseError):     # closed, or reset: either way no new try
            channel.call({"op": "has", "hashes": hashes(1)})
        assert len(accepted) == 1
    finally:
        listener.close()
        thread.join(5)
