"""The forward pacer: background writes wait while a forward runs, at most ``max_hold`` each;
a plan's held time is accounted apart; the transfer engine paces exactly the writes away from
the engine that do not read its memory (disk plans whole, object batches per PUT)."""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest

from kvstrata.physical import HostStorage, ObjectStorage, TransferEngine, TransferPlan
from kvstrata.physical.pacing import ForwardPacer, PlanPacing
from kvstrata.protocol import Endpoint
from kvstrata.protocol.errors import TransferPlanError
from kvstrata.protocol.results import TransferResult

from .conftest import random_block_arrays, small_config
from .test_transfer import make_tiers, run

pytestmark = pytest.mark.timeout(60)


class ManualClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _start(target, *args) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    return thread


def _wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


# -- the gate ---------------------------------------------------------------------------------
def test_without_a_forward_nothing_waits_or_is_counted():
    pacer = ForwardPacer()
    assert pacer.wait() == 0.0
    assert pacer.counters.to_dict() == {"forwards": 0, "holds": 0, "held_seconds": 0.0,
                                        "overruns": 0}


def test_a_writer_waits_for_the_forward_to_end():
    pacer = ForwardPacer(max_hold=30)
    pacer.forward_started()
    waited: list[float] = []
    thread = _start(lambda: waited.append(pacer.wait()))
    thread.join(0.3)
    assert thread.is_alive() and not waited          # still held: the forward runs
    pacer.forward_ended()
    thread.join(5)
    assert not thread.is_alive() and waited[0] >= 0.3
    c = pacer.counters
    assert (c.forwards, c.holds, c.overruns) == (1, 1, 0) and c.held_seconds >= 0.3
    assert pacer.wait() == 0.0                       # between forwards: no wait


def test_a_forward_that_never_ends_holds_a_writer_at_most_max_hold():
    pacer = ForwardPacer(max_hold=0.2)
    pacer.forward_started()
    start = time.monotonic()
    assert pacer.wait() >= 0.2
    assert time.monotonic() - start < 5
    assert pacer.counters.overruns == 1
    assert pacer.forward_running                     # the forward is still announced


def test_every_waiter_goes_when_the_forward_ends():
    pacer = ForwardPacer(max_hold=30)
    pacer.forward_started()
    threads = [_start(pacer.wait) for _ in range(8)]
    time.sleep(0.1)
    assert all(t.is_alive() for t in threads)
    pacer.forward_ended()
    for t in threads:
        t.join(5)
        assert not t.is_alive()
    assert pacer.counters.holds == 8


def test_back_to_back_forwards_do_not_starve_a_writer():
    """A waiter goes once the forward it waited for ended, even if the next forward began
    before it got to run (the gap is shorter than a thread takes to be scheduled)."""
    pacer = ForwardPacer(max_hold=30)
    stop = threading.Event()

    def engine():                                    # forwards with no gap at all
        while not stop.is_set():
            pacer.forward_started()
            time.sleep(0.02)
            with pacer._cond:      # (an RLock) no waiter runs between the end and the start
                pacer.forward_ended()
                pacer.forward_started()

    driver = _start(engine)
    try:
        _wait_until(lambda: pacer.forward_running)
        start = time.monotonic()
        writers = [_start(pacer.wait) for _ in range(4)]
        for w in writers:
            w.join(10)
            assert not w.is_alive()
        assert time.monotonic() - start < 10
        assert pacer.counters.overruns == 0          # released by forwards ending
    finally:
        stop.set()
        driver.join(5)


def test_close_releases_waiters_and_turns_pacing_off_for_good():
    pacer = ForwardPacer(max_hold=30)
    pacer.forward_started()
    thread = _start(pacer.wait)
    time.sleep(0.05)
    pacer.close()
    thread.join(5)
    assert not thread.is_alive()
    pacer.forward_started()                          # after close: ignored
    assert not pacer.forward_running and pacer.wait() == 0.0


def test_repeated_starts_count_one_forward():
    pacer = ForwardPacer()
    pacer.forward_started()
    pacer.forward_started()
    pacer.forward_ended()
    pacer.forward_ended()
    assert pacer.counters.forwards == 1 and not pacer.forward_running


@pytest.mark.parametrize("bad", [-1, float("nan"), -0.001])
def test_max_hold_must_be_seconds(bad):
    with pytest.raises(ValueError, match="max_hold"):
        ForwardPacer(max_hold=bad)


# -- a plan's held time -----------------------------------------------------------------------
def test_held_time_is_when_a_request_waits_and_none_runs():
    clock = ManualClock()
    pacer = ForwardPacer(max_hold=30, clock=clock)
    plan = pacer.plan()
    assert isinstance(plan, PlanPacing) and plan.held_seconds == 0.0
    pacer.forward_started()
    entered = threading.Event()

    def one_request():
        with plan.request():
            entered.set()

    thread = _start(one_request)
    _wait_until(lambda: plan._waiting == 1)
    clock.now += 3.0
    assert plan.held_seconds == pytest.approx(3.0)   # counted while it still waits
    pacer.forward_ended()
    thread.join(5)
    assert entered.is_set()
    clock.now += 10.0                                # after: nothing waits, nothing added
    assert plan.held_seconds == pytest.approx(3.0)


def test_a_request_running_while_another_waits_is_not_held_time():
    clock = ManualClock()
    pacer = ForwardPacer(max_hold=30, clock=clock)
    plan = pacer.plan()
    running = threading.Event()
    release = threading.Event()

    def long_request():
        with plan.request():
            running.set()
            release.wait(10)

    first = _start(long_request)
    running.wait(5)
    pacer.forward_started()
    second = _start(lambda: plan.request().__enter__())
    _wait_until(lambda: plan._waiting == 1)
    clock.now += 2.0                                 # one runs, one waits: the plan moves
    release.set()
    first.join(5)
    clock.now += 1.5                                 # only the waiter is left: held
    pacer.forward_ended()
    second.join(5)
    assert plan.held_seconds == pytest.approx(1.5)


# -- results carry it -------------------------------------------------------------------------
def _plan(n=2):
    return TransferPlan(7, Endpoint("G2"), Endpoint("G3"), tuple(range(1, n + 1)),
                        src_block_ids=tuple(range(n)), dst_block_ids=tuple(range(n)))


def test_held_seconds_round_trips_and_old_reports_read_as_zero():
    result = TransferResult(_plan(), (True, True), (None, None), 10, 0.5, held_seconds=1.25)
    assert TransferResult.from_dict(result.to_dict()).held_seconds == 1.25
    old = result.to_dict()
    del old["held_seconds"]
    assert TransferResult.from_dict(old).held_seconds == 0.0


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), "x", None, [1]])
def test_a_hostile_held_seconds_is_refused(bad):
    data = TransferResult(_plan(), (True, True), (None, None), 10, 0.5).to_dict()
    data["held_seconds"] = bad
    with pytest.raises(TransferPlanError):
        TransferResult.from_dict(data)


# -- the transfer engine ----------------------------------------------------------------------
def test_a_disk_write_waits_for_the_forward_and_its_wait_is_not_its_seconds(tmp_path):
    pacer = ForwardPacer(max_hold=30)
    tiers = make_tiers(tmp_path)
    with TransferEngine(tiers, pacer=pacer) as engine:
        assert run(engine, "G1->G2", [0, 1], [0, 1], [11, 12]).all_ok
        pacer.forward_started()
        store = engine.submit(TransferPlan.for_path("G1->G2", [2, 3], [2, 3], [13, 14],
                                                    job_id=1))
        load = engine.submit(TransferPlan.for_path("G2->G1", [0], [5], [11], job_id=2))
        write = engine.submit(TransferPlan.for_path("G2->G3", [0, 1], [4, 5], [11, 12],
                                                    job_id=3))
        # copies out of the engine's memory and loads towards it are never held
        assert store.result(timeout=10).all_ok and load.result(timeout=10).all_ok
        time.sleep(0.3)
        assert not write.done()
        pacer.forward_ended()
        result = write.result(timeout=10)
    assert result.all_ok
    assert result.held_seconds >= 0.3
    assert result.seconds < result.held_seconds      # the copy itself took far less


def test_without_a_pacer_nothing_is_held(tmp_path):
    tiers = make_tiers(tmp_path)
    with TransferEngine(tiers) as engine:
        assert run(engine, "G1->G2", [0], [0], [11]).all_ok
        result = run(engine, "G2->G3", [0], [0], [11])
    assert result.all_ok and result.held_seconds == 0.0


class RecordingS3:
    """An in-memory bucket with the S3Client methods ObjectStorage uses; records when each
    PUT began."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.put_times: list[float] = []
        self.lock = threading.Lock()

    def put_if_absent(self, key: str, body) -> bool:
        with self.lock:
            self.put_times.append(time.monotonic())
            if key in self.objects:
                return False
            self.objects[key] = bytes(body)
            return True

    def get(self, key: str, *, max_bytes: int | None = None):
        return self.objects.get(key)

    def ensure_bucket(self) -> bool:
        return False

    def close(self) -> None:
        pass


def _object_tiers(blocks: int = 12):
    cfg = small_config(num_blocks=blocks)
    host = HostStorage(cfg)
    for b, a in enumerate(random_block_arrays(blocks, cfg.block_bytes, seed=3)):
        host.block_array(b)[:cfg.block_bytes] = a
    host.seal(list(range(blocks)), list(range(1, blocks + 1)))
    client = RecordingS3()
    store = ObjectStorage(cfg, client, namespace="ns", fingerprint="fp", max_concurrency=2,
                          ensure_bucket=False)
    return host, store, client


def test_object_puts_wait_per_request_and_the_batch_deadline_allows_it():
    pacer = ForwardPacer(max_hold=30)
    host, store, client = _object_tiers()
    keys = tuple(f"k{i}" for i in range(12))
    plan = TransferPlan(9, Endpoint("G2"), Endpoint("G4"), tuple(range(1, 13)),
                        src_block_ids=tuple(range(12)), dst_keys=keys)
    with TransferEngine({"G2": host, "G4": store}, pacer=pacer) as engine:
        pacer.forward_started()
        began = time.monotonic()
        future = engine.submit(plan)
        time.sleep(0.4)
        assert client.put_times == [] and not future.done()
        ended = time.monotonic()
        pacer.forward_ended()
        result = future.result(timeout=20)
    assert result.all_ok and len(client.objects) == 12
    assert min(client.put_times) >= ended
    assert result.held_seconds == pytest.approx(ended - began, abs=0.2)
    assert pacer.counters.holds >= 1


def test_a_put_batch_held_by_a_stuck_forward_still_completes_after_max_hold():
    pacer = ForwardPacer(max_hold=0.2)
    host, store, client = _object_tiers(4)
    plan = TransferPlan(9, Endpoint("G2"), Endpoint("G4"), (1, 2, 3, 4),
                        src_block_ids=(0, 1, 2, 3), dst_keys=("a", "b", "c", "d"))
    with TransferEngine({"G2": host, "G4": store}, pacer=pacer) as engine:
        pacer.forward_started()                      # and never ended
        result = engine.submit(plan).result(timeout=20)
    assert result.all_ok and len(client.objects) == 4
    assert pacer.counters.overruns >= 2              # two rounds of two PUTs
    assert not math.isnan(result.held_seconds) and result.held_seconds >= 0.2


def test_object_reads_are_never_held():
    pacer = ForwardPacer(max_hold=30)
    host, store, client = _object_tiers(4)
    with TransferEngine({"G2": host, "G4": store}, pacer=pacer) as engine:
        put = TransferPlan(1, Endpoint("G2"), Endpoint("G4"), (1, 2),
                           src_block_ids=(0, 1), dst_keys=("a", "b"))
        assert engine.submit(put).result(timeout=10).all_ok
        pacer.forward_started()
        get = TransferPlan(2, Endpoint("G4"), Endpoint("G2"), (1, 2),
                           src_keys=("a", "b"), dst_block_ids=(2, 3))
        result = engine.submit(get).result(timeout=5)
        pacer.forward_ended()
    assert result.all_ok and result.held_seconds == 0.0
    assert np.array_equal(host.block_array(2), host.block_array(0))
