"""The publisher's native observer hooks (``_hooks.c``) against its Python hooks.

Two publishers see the same random sequence of hook calls, one through the C hooks and one
through the Python code; they must produce the same events (ids, kinds, tiers, hashes,
parents, sizes, tokens), the same shadow state and the same counters, including for input the
C fast path declines (repeats, held hashes, broken runs, mixed sizes, duck-typed records) and
for a full buffer.
"""

import random

import pytest
from _pytest.monkeypatch import MonkeyPatch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.events import publisher as publisher_module
from kvstrata.events.publisher import EventPublisher, Sink
from kvstrata.types import BlockRecord

from .helpers import CountingCondition

pytestmark = pytest.mark.skipif(publisher_module._native_hooks is None,
                                reason="the native hooks are not built (_hooks.c)")


class Keep(Sink):
    kind = "keep"

    def __init__(self) -> None:
        self.items: list[tuple] = []

    def open(self, publisher) -> None:
        pass

    def send(self, batch) -> None:
        self.items.extend(batch.items)

    def flush(self, timeout: float) -> bool:
        return True

    def close(self, timeout: float) -> None:
        pass


class DuckRecord:
    """A record that is not a BlockRecord: the C hooks must leave it to the Python code."""

    def __init__(self, r: BlockRecord) -> None:
        self.sequence_hash, self.local_hash = r.sequence_hash, r.local_hash
        self.parent_hash, self.block_size, self.token_ids = r.parent_hash, r.block_size, r.token_ids


def records_for(rng: random.Random, pool: list[int]) -> list:
    """A run of records over hashes from ``pool``: usually one linked run, sometimes broken,
    repeated, of mixed sizes or duck-typed."""
    n = rng.randint(0, 6)
    parent = rng.choice([None, rng.choice(pool)])
    size = rng.choice([4, 16])
    out = []
    for _ in range(n):
        h = rng.choice(pool)
        tokens = tuple(rng.randrange(100) for _ in range(size)) if rng.random() < 0.5 else None
        out.append(BlockRecord(h, rng.getrandbits(64), parent, size, tokens))
        parent = h if rng.random() < 0.9 else rng.choice(pool)
        if rng.random() < 0.05:
            size = 20 - size
    if out and rng.random() < 0.05:
        out[rng.randrange(len(out))] = DuckRecord(out[0])
    return out if rng.random() < 0.8 else tuple(out)


def run(ops, native: bool, monkeypatch, buffer_events: int) -> EventPublisher:
    monkeypatch.setattr(publisher_module, "_native_hooks",
                        publisher_module._load_native_hooks() if native else None)
    pub = EventPublisher(Keep(), max_batch=4, buffer_events=buffer_events, keep_tokens=True)
    pub._cond = CountingCondition(pub._lock)
    for op, tier, arg in ops:
        if op == "stored":
            pub.on_tier_stored(tier, arg)
        else:
            pub.on_tier_removed(tier, arg)
    pub.wakeups = pub._cond.notified
    pub.start()
    assert pub.flush(5)
    pub.close()
    return pub


def comparable(item: tuple) -> tuple:
    return item[:3] + item[4:]       # all but the timestamp text


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), buffer_events=st.sampled_from([8, 10_000]))
def test_native_hooks_make_the_python_hooks_events(seed, buffer_events):
    rng = random.Random(seed)
    pool = [rng.getrandbits(64) for _ in range(12)] + [2**64 - 1, 0]
    ops = []
    for _ in range(60):
        tier = rng.choice(["G1", "G1", "G2"])
        if rng.random() < 0.6:
            ops.append(("stored", tier, records_for(rng, pool)))
        else:
            hashes = [rng.choice(pool) for _ in range(rng.randint(0, 4))]
            ops.append(("removed", tier, hashes if rng.random() < 0.7 else tuple(hashes)))
    with MonkeyPatch.context() as m:
        c = run(ops, True, m, buffer_events)
    with MonkeyPatch.context() as m:
        p = run(ops, False, m, buffer_events)
    assert [comparable(i) for i in c.sink.items] == [comparable(i) for i in p.sink.items]
    assert c.state() == p.state()
    assert (c.last_event_id, c.enqueued, c.dropped) == (p.last_event_id, p.enqueued, p.dropped)
    assert c.wakeups == p.wakeups  # the batching thread is woken at the same points
    assert [comparable(e) for e in c._tiers["G1"].log] == [comparable(e) for e in p._tiers["G1"].log]


def test_native_hooks_raise_as_the_python_hooks_and_change_nothing():
    pub = EventPublisher(Keep(), max_batch=4)
    record = BlockRecord(5, 6, None, 16, None)
    with pytest.raises(KeyError):
        pub.on_tier_stored("G9", [record])
    with pytest.raises(KeyError):
        pub.on_tier_removed("G9", [5])
    with pytest.raises(TypeError):
        pub.on_tier_removed("G1", [[1]])          # unhashable, as set.discard says
    assert pub.last_event_id == 0 and pub.state()["G1"] == set()
    pub.on_tier_stored("G1", [record])
    pub.on_tier_removed("G1", [5, 5, 7])          # one event naming 5 once
    assert pub.last_event_id == 2 and pub.state()["G1"] == set()
    assert list(pub._buffer)[-1][4:] == (5,)


def test_a_records_list_changed_while_the_hook_waits_for_the_lock_is_read_as_it_was():
    """The C hook validates the records, then may wait for the publisher's lock (the GIL let
    go): a list emptied meanwhile must not be read again (it was, once: a crash)."""
    import threading
    import time

    pub = EventPublisher(Keep(), max_batch=4)
    records = [BlockRecord(10**18 + i, i, 10**18 + i - 1 if i else None, 16, None)
               for i in range(200)]
    pub._lock.acquire()
    waiter = threading.Thread(target=pub.on_tier_stored, args=("G1", records))
    waiter.start()
    time.sleep(0.2)
    records.clear()
    junk = [str(i) * 3 for i in range(100_000)]     # reuse the freed item array's memory
    pub._lock.release()
    waiter.join(10)
    del junk
    assert len(pub.state()["G1"]) == 200
    assert [len(item) for item in pub._buffer] == [7 + 2 * 200]


@pytest.mark.parametrize("limit", [float("inf"), 2**64])
def test_settings_beyond_64_bits_are_compared_as_python_compares_them(limit):
    pub = EventPublisher(Keep(), max_batch=4, buffer_events=limit)
    pub.on_tier_stored("G1", [BlockRecord(1, 2, None, 16, None)])
    pub.on_tier_removed("G1", [1])
    assert (pub.enqueued, pub.dropped, len(pub._buffer)) == (2, 0, 2)
