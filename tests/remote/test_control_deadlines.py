"""The control server is bounded per connection in time (issue 28: an idle connection was
never timed out, so 256 idle readers locked every other reader out): a connection that moves
no byte for ``idle_timeout`` is closed, a request that does not arrive whole within
``request_timeout`` drops its connection, and a reader's channel whose kept connection the
server closed sends its request again on a fresh one, once, without the caller seeing it."""

from __future__ import annotations

import contextlib
import socket
import time

import msgpack

from kvstrata.remote.control import FRAME, ControlChannel, ControlServer, parse_control


def echo_id(body: bytes) -> bytes:
    request = msgpack.unpackb(body, raw=False)
    return msgpack.packb({"echo": request, "id": request.get("id")})


@contextlib.contextmanager
def serving(**deadlines):
    server = ControlServer("127.0.0.1", 0, lambda body, peer: echo_id(body),
                           max_request=1 << 16, tick=0.05,
                           on_tick=lambda: None, name="kvstrata-control-test", **deadlines)
    server.start()
    try:
        yield server
    finally:
        server.close()


def _closed_by_server(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except (socket.timeout, TimeoutError):
        return False
    except ConnectionResetError:
        return True


def test_idle_connections_are_closed_and_free_their_slots():
    with serving(idle_timeout=0.5) as server:
        host, port = parse_control(server.address)
        idle = [socket.create_connection((host, port)) for _ in range(20)]
        try:
            assert all(_closed_by_server(s, 5) for s in idle)
            deadline = time.monotonic() + 5
            while server._peers and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not server._peers
        finally:
            for s in idle:
                s.close()
        channel = ControlChannel(server.address, timeout=5, secret=b"")
        try:
            assert channel.call({"op": "ping"})["echo"]["op"] == "ping"
        finally:
            channel.close()


def test_a_request_dripped_slower_than_its_deadline_drops_the_connection():
    with serving(idle_timeout=60, request_timeout=0.6) as server:
        host, port = parse_control(server.address)
        body = msgpack.packb({"op": "ping", "id": 1})
        frame = FRAME.pack(len(body)) + body
        with socket.create_connection((host, port)) as sock:
            started = time.monotonic()
            for byte in frame:
                try:
                    sock.sendall(bytes([byte]))
                except OSError:
                    break
                if _closed_by_server(sock, 0.2):
                    break
            assert time.monotonic() - started < 5
            assert _closed_by_server(sock, 5)


def test_a_channel_whose_kept_connection_was_closed_as_idle_sends_again_unseen():
    with serving(idle_timeout=0.3) as server:
        channel = ControlChannel(server.address, timeout=5, secret=b"")
        try:
            assert channel.call({"op": "first"})["echo"]["op"] == "first"
            time.sleep(1.0)                            # the server closes the idle channel
            assert channel.call({"op": "second"})["echo"]["op"] == "second"
            channel.call({"op": "release"}, wait=False)
            time.sleep(1.0)
            assert channel.call({"op": "third"})["echo"]["op"] == "third"
        finally:
            channel.close()


def test_a_connection_still_in_use_is_not_closed():
    with serving(idle_timeout=0.5) as server:
        channel = ControlChannel(server.address, timeout=5, secret=b"")
        try:
            first = channel._sock
            for i in range(15):                        # 1.5 s of calls, 0.1 s apart
                assert channel.call({"op": "ping", "n": i})["echo"]["n"] == i
                first = first or channel._sock
                time.sleep(0.1)
            assert channel._sock is first              # one connection all along
        finally:
            channel.close()


def test_an_idle_connection_that_holds_something_is_kept_until_it_holds_nothing():
    """A reader holding a lease sits idle while it reads the blocks over NIXL: closing its
    connection then would release the lease under it (a lease granted for 300 s went after
    the 120 s idle timeout, and the exporter reused the slots the reader was reading)."""
    holding: set[int] = set()
    with serving(idle_timeout=0.3, holds=lambda peer: peer.ident in holding) as server:
        def connect():
            sock = socket.create_connection(parse_control(server.address), timeout=5)
            sock.sendall(FRAME.pack(len(msgpack.packb({"id": 1}))) + msgpack.packb({"id": 1}))
            sock.recv(1 << 16)                        # answered: it reached the handler
            return sock
        keeper, other = connect(), connect()
        try:
            holding.add(max(p.ident for p in server._peers.values() if p.sock is not None
                            and p.sock.getpeername() == keeper.getsockname()))
            assert _closed_by_server(other, within=3)
            assert not _closed_by_server(keeper, within=1.0)   # idle 1 s, still open
            holding.clear()
            assert _closed_by_server(keeper, within=3)
        finally:
            keeper.close()
            other.close()
