"""The exporter's control socket under hostile input: every malformed request gets a typed
error reply and changes nothing, the exporter keeps serving; the lease table's limits hold."""

from __future__ import annotations

import socket
import struct

import msgpack
import numpy as np
import pytest

from kvstrata.remote.control import ControlChannel, format_control, parse_control
from kvstrata.remote.errors import LeaseError
from kvstrata.remote.lease import MAX_TTL, LeaseTable
from kvstrata.remote.nixl_agent import nixl_available

from .pool_stand_in import Pins


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_lease_table_grants_prefixes_caps_ttl_expires_and_closes():
    clock, pins = Clock(), Pins()
    table = LeaseTable(pins.pin, pins.unpin, max_leases=2, clock=clock)
    lease = table.grant([1, 2, 3, 99, 4], ttl=5)
    assert [b[0] for b in lease.blocks] == [1, 2, 3] and lease.deadline == 105
    assert table.grant([50], ttl=5) is None and pins.unpinned == [[]]   # nothing held
    long = table.grant([1], ttl=10_000)
    assert long.ttl == MAX_TTL
    with pytest.raises(LeaseError):
        table.grant([1], ttl=5)                                          # max_leases
    with pytest.raises(LeaseError):
        table.grant([1], ttl=0)
    clock.t += 6
    assert table.expire() == 1 and table.expired == 1 and len(table) == 1
    assert not table.release(lease.lease_id)                            # already expired
    assert table.release(long.lease_id) and len(table) == 0
    again = table.grant([1, 2], ttl=1)
    table.close()
    assert len(table) == 0 and pins.unpinned[-1] == [1, 2] and again.lease_id != long.lease_id


def test_leases_pin_at_most_their_shares_and_a_slot_pinned_twice_counts_once():
    """One reader pinned the whole exported tier for as long as it renewed its lease: its
    owner could store nothing new. A lease past a cap is cut to the prefix that fits."""
    pins = Pins()                                        # hashes 1..8 at slots 10..17
    table = LeaseTable(pins.pin, pins.unpin, max_blocks_per_owner=4, max_blocks=6)
    first = table.grant([1, 2, 3, 4, 5, 6], ttl=5, owner="c1", group="host-a")
    assert [b[0] for b in first.blocks] == [1, 2, 3, 4]             # the host's share
    again = table.grant([1, 2], ttl=5, owner="c2", group="host-b")   # same slots: no room used
    other = table.grant([5, 6, 7, 8], ttl=5, owner="c3", group="host-b")
    assert [b[0] for b in again.blocks] == [1, 2] and [b[0] for b in other.blocks] == [5, 6]
    with pytest.raises(LeaseError, match="no block may be pinned"):  # 6 slots in all
        table.grant([7], ttl=5, owner="c3", group="host-b")
    shared = table.grant([1, 2, 3, 7], ttl=5, owner="c5", group="host-d")
    assert [b[0] for b in shared.blocks] == [1, 2, 3]      # pinned already: they cost nothing
    table.release_owner("c5")
    assert table.release(first.lease_id, "c1")          # 1, 2 still c2's: 4 slots pinned
    assert [b[0] for b in table.grant([3, 4, 7], ttl=5, owner="c4", group="host-c").blocks] \
        == [3, 4]
    table.release_owner("c2")
    table.release_owner("c3")
    table.release_owner("c4")
    assert not table._pinned and not table._pinned_by_group


from .handshake import connect  # noqa: E402

needs_nixl = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")


def ask(control: str, body: bytes, timeout_ms: int = 5000, length: int | None = None):
    """Send ``body`` framed as the control protocol frames it (its length, or ``length``
    where a test lies about it) on a connection of its own; the reply, or None if the
    exporter closed the connection or did not answer in time."""
    host, port = parse_control(control)
    with connect((host, port), timeout=timeout_ms / 1000) as s:
        try:
            s.sendall(struct.pack("<I", len(body) if length is None else length) + body)
        except (BrokenPipeError, ConnectionResetError):      # dropped while we were sending
            return None
        data = b""
        try:
            while len(data) < 4 or len(data) < 4 + struct.unpack_from("<I", data)[0]:
                chunk = s.recv(1 << 16)
                if not chunk:
                    return None
                data += chunk
        except (socket.timeout, ConnectionResetError):
            return None
        return msgpack.unpackb(data[4:], raw=False)


def hashes(*values) -> bytes:
    return np.array(values, dtype="<u8").tobytes()


@needs_nixl
@pytest.mark.parametrize("body", [
    b"\xc1not msgpack",
    msgpack.packb([1, 2, 3]),
    msgpack.packb({"op": "launch"}),
    msgpack.packb({"op": None}),
    msgpack.packb({"op": "lease"}),
    msgpack.packb({"op": "lease", "hashes": [1, 2], "ttl": 5}),               # not packed
    msgpack.packb({"op": "lease", "hashes": b"1234567", "ttl": 5}),           # not 8-byte
    msgpack.packb({"op": "lease", "hashes": b"", "ttl": 5}),
    msgpack.packb({"op": "lease", "hashes": b"\0" * 8 * 70000, "ttl": 5}),    # too many
    msgpack.packb({"op": "lease", "hashes": hashes(1), "ttl": -1}),
    msgpack.packb({"op": "lease", "hashes": hashes(1), "ttl": True}),
    msgpack.packb({"op": "lease", "hashes": hashes(1), "ttl": "5"}),
    msgpack.packb({"op": "release", "lease": "1"}),
    msgpack.packb({"op": "release", "lease": True}),
])
def test_malformed_requests_get_errors_and_change_nothing(exporter, body):
    ex, pins = exporter
    reply = ask(ex.control, body)
    assert isinstance(reply, dict) and "error" in reply
    assert len(ex.leases) == 0 and pins.pinned == []
    ok = ask(ex.control, msgpack.packb({"op": "lease", "hashes": hashes(1, 2), "ttl": 5}))
    assert ok["lease"] > 0 and np.frombuffer(ok["slots"], "<u8").tolist() == [10, 11]


@needs_nixl
def test_an_oversized_request_is_dropped_and_the_exporter_keeps_serving(exporter):
    ex, _ = exporter
    assert ask(ex.control, b"\0" * (2 << 20), timeout_ms=500) is None
    reply = ask(ex.control, msgpack.packb({"op": "blockset", "id": 7}))
    assert reply["id"] == 7 and isinstance(reply["blockset"], bytes)
    released = ask(ex.control, msgpack.packb({"op": "release", "lease": 12345}))
    assert released == {"released": False}


@needs_nixl
def test_a_length_over_the_limit_drops_the_connection_before_any_body(exporter):
    ex, _ = exporter
    assert ask(ex.control, b"", length=2 << 20, timeout_ms=2000) is None
    assert ask(ex.control, msgpack.packb({"op": "blockset"}))["blockset"]


@needs_nixl
def test_a_stalled_or_flooding_reader_does_not_hold_up_the_others(exporter):
    ex, pins = exporter
    host, port = parse_control(ex.control)
    # half a request, never finished
    stalled = connect((host, port))
    stalled.sendall(struct.pack("<I", 100) + b"\x81")
    # a reader that sends many requests and reads no reply
    flooder = connect((host, port))
    request = msgpack.packb({"op": "blockset"})
    flooder.setblocking(False)
    frame = struct.pack("<I", len(request)) + request
    sent = 0
    try:
        for _ in range(20000):
            sent += flooder.send(frame)
    except BlockingIOError:
        pass
    try:
        assert sent > 0
        channel = ControlChannel(ex.control, 2.0)
        ok = channel.call({"op": "lease", "hashes": hashes(1, 2), "ttl": 5})
        assert ok["lease"] > 0 and len(pins.pinned) == 1
    finally:
        stalled.close()
        flooder.close()
    assert channel.call({"op": "release", "lease": ok["lease"]})["released"] is True
    channel.close()


def test_control_addresses_parse_and_format_round_trip():
    for host, port in (("127.0.0.1", 5555), ("::1", 1), ("worker-3.local", 65535)):
        assert parse_control(format_control(host, port)) == (host, port)
    for bad in ("127.0.0.1:5", "tcp://127.0.0.1", "tcp://:5", "tcp://h:0", "tcp://h:70000",
                "ipc:///tmp/x", None):
        with pytest.raises(ValueError):
            parse_control(bad)
    with pytest.raises(LeaseError):
        ControlChannel("udp://h:1", 1.0)
