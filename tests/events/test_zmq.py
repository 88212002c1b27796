import time

import pytest

from kvstrata.events import formats, make_publisher
from kvstrata.events.natsserver import free_port
from kvstrata.logical.registry import BlockRegistry

from .helpers import chain

zmq = pytest.importorskip("zmq")


def test_zmq_pub_speaks_vllm_frames():
    port = free_port()
    pub = make_publisher(f"zmq://tcp://127.0.0.1:{port}?topic=kv-events", max_delay=0.001)
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(f"tcp://127.0.0.1:{port}")
    reg = BlockRegistry()
    reg.add_observer(pub)
    c = chain(1, 3, block_size=4, tokens=True)
    # PUB/SUB joins asynchronously: publish until the subscriber sees a frame
    deadline = time.monotonic() + 5
    frames = None
    i = 0
    while frames is None and time.monotonic() < deadline:
        reg.record_stored("G1", chain(100 + i, 1))
        reg.record_removed("G1", list(reg.hashes_in("G1")))
        pub.flush(1)
        i += 1
        if sub.poll(50):
            frames = sub.recv_multipart()
    assert frames is not None, "no ZMQ frame received"
    topic, seq, payload = frames
    assert topic == b"kv-events" and len(seq) == 8
    reg.record_stored("G1", c)
    pub.flush(1)
    found = None
    while found is None and sub.poll(2000):
        _, _, payload = sub.recv_multipart()
        ts, events, dp = formats.decode_vllm_batch(payload)
        for ev in events:
            if ev["type"] == "BlockStored" and ev["block_hashes"] == [r.sequence_hash for r in c]:
                found = ev
    assert found is not None and dp == 0
    assert found["token_ids"] == [t for r in c for t in r.token_ids] and found["medium"] == "GPU"
    pub.close()
    sub.close(0)


def test_zmq_bind_error_is_clear():
    port = free_port()
    first = make_publisher(f"zmq://tcp://127.0.0.1:{port}")
    try:
        with pytest.raises(OSError, match="cannot bind"):
            make_publisher(f"zmq://tcp://127.0.0.1:{port}")
    finally:
        first.close()
