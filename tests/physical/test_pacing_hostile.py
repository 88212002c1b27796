"""Hostile tests of the forward pacer (kvstrata.physical.pacing) and how the transfer engine
and the object storage use it: loads and device copies must never wait for a forward, held
time must never count as a path being slow, a batch must not fail because of another batch's
hold, the caller's buffers are never touched after ``write_blocks`` returned, and the accounting
stays balanced when something raises."""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import TimeoutError as FuturesTimeout
from types import SimpleNamespace

import numpy as np
import pytest

from kvstrata.physical import HostStorage, ObjectStorage, TransferEngine, TransferPlan
from kvstrata.physical.pacing import ForwardPacer
from kvstrata.protocol import Endpoint

from .conftest import random_block_arrays, small_config
from .test_pacing import ManualClock, _start, _wait_until
from .test_transfer import make_tiers, run

pytestmark = pytest.mark.timeout(60)


# -- helpers ----------------------------------------------------------------------------------
class SpyPacer(ForwardPacer):
    """A ForwardPacer that counts the calls to its gate (to know a writer is at it)."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.calls = 0
        self._calls_lock = threading.Lock()

    def wait(self) -> float:
        with self._calls_lock:
            self.calls += 1
        return super().wait()


class FakeS3:
    """An in-memory bucket with the S3Client methods ObjectStorage uses. With ``config``
    the storage derives a real (short) batch deadline from it."""

    def __init__(self, config=None) -> None:
        self.objects: dict[str, bytes] = {}
        self.lock = threading.Lock()
        if config is not None:
            self.config = config

    def put_if_absent(self, key: str, body) -> bool:
        with self.lock:
            if key in self.objects:
                return False
            self.objects[key] = bytes(body)
            return True

    def get(self, key: str, *, max_bytes: int | None = None):
        with self.lock:
            return self.objects.get(key)

    def head(self, key: str) -> bool:
        with self.lock:
            return key in self.objects

    def ensure_bucket(self) -> bool:
        return False

    def close(self) -> None:
        pass


def short_deadline_config():
    # per request (0 retries): 0.1 + 0.1 + 0.5 = 0.7 s; a batch: rounds * 0.7 + 1.0 s
    return SimpleNamespace(retries=0, request_timeout=0.1, connect_timeout=0.1,
                           endpoint_url="http://fake", bucket="bucket")


def object_tiers(blocks: int = 12, *, max_concurrency: int = 2, config=None):
    cfg = small_config(num_blocks=blocks)
    host = HostStorage(cfg)
    for b, a in enumerate(random_block_arrays(blocks, cfg.block_bytes, seed=5)):
        host.block_array(b)[:cfg.block_bytes] = a
    host.seal(list(range(blocks)), list(range(1, blocks + 1)))   # block b: sequence hash b+1
    client = FakeS3(config)
    store = ObjectStorage(cfg, client, namespace="ns", fingerprint="fp",
                          max_concurrency=max_concurrency, ensure_bucket=False)
    return host, store, client


def put_plan(job: int, src: list[int], keys: list[str]) -> TransferPlan:
    return TransferPlan(job, Endpoint("G2"), Endpoint("G4"), tuple(b + 1 for b in src),
                        src_block_ids=tuple(src), dst_keys=tuple(keys))


def get_plan(job: int, keys: list[str], dst: list[int], seqs: list[int]) -> TransferPlan:
    return TransferPlan(job, Endpoint("G4"), Endpoint("G2"), tuple(seqs),
                        src_keys=tuple(keys), dst_block_ids=tuple(dst))


# -- the shared G4 request pool: one plan's held PUTs hold back everything else ---------------
def test_a_g4_load_does_not_wait_behind_puts_held_for_the_forward():
    """Loads are never paced -- but an object storage has one request pool for GETs and PUTs.
    PUTs waiting at the gate occupy its threads, so a G4 load started during the forward
    (WorkerHalf.start announces the forward, then submits the step's loads) waits for the
    forward to end, and its seconds count the wait (the cost model learns G4 loads slow)."""
    pacer = SpyPacer(max_hold=30)
    host, store, client = object_tiers(8, max_concurrency=1)
    with TransferEngine({"G2": host, "G4": store}, pacer=pacer) as engine:
        assert engine.submit(put_plan(1, [0], ["a"])).result(timeout=10).all_ok
        pacer.forward_started()
        base = pacer.calls
        try:
            held = engine.submit(put_plan(2, [1, 2], ["b", "c"]))
            _wait_until(lambda: pacer.calls > base)          # a PUT waits at the gate
            load = engine.submit(get_plan(3, ["a"], [6], [1]))
            try:
                result = load.result(timeout=3)
            except FuturesTimeout:
                result = None
        finally:
            pacer.forward_ended()
        assert held.result(timeout=10).all_ok
        late = load.result(timeout=10)
    assert result is not None, (
        f"a G4 load waited for the forward to end (queued behind held PUTs in the storage's "
        f"shared request pool); it reported seconds={late.seconds:.2f}, "
        f"held_seconds={late.held_seconds}")
    assert result.all_ok and result.held_seconds == 0.0
    assert np.array_equal(host.block_array(6), host.block_array(0))


def test_a_put_batch_queued_behind_anothers_held_puts_does_not_count_that_as_its_seconds():
    """Two store plans on one G4 (workers_per_path=2, or G2->G4 and G3->G4 at once), both
    held by a forward: that time is the forward's, not the path's: it must show as
    held_seconds, not as seconds (busy time the cost model turns into bandwidth). (Was a bug:
    the PUTs waited at the gate inside the store's request pool, and the second plan's PUTs
    queued behind the first's, their wait counted as seconds.)"""
    pacer = SpyPacer(max_hold=30)
    host, store, client = object_tiers(8, max_concurrency=1)
    with TransferEngine({"G2": host, "G4": store}, pacer=pacer, workers_per_path=2) as engine:
        pacer.forward_started()
        base = pacer.calls
        try:
            first = engine.submit(put_plan(1, [0], ["a"]))
            _wait_until(lambda: pacer.calls > base)
            second = engine.submit(put_plan(2, [1], ["b"]))
            _wait_until(lambda: pacer.calls > base + 1)        # both at the gate
            time.sleep(0.6)                                    # the forward runs on
        finally:
            pacer.forward_ended()
        results = [first.result(timeout=10), second.result(timeout=10)]
    assert all(r.all_ok for r in results) and len(client.objects) == 2
    for r in results:                       # each PUT itself takes microseconds
        assert 0.0 <= r.held_seconds and r.seconds >= 0.0
        assert r.seconds < 0.3, (f"job {r.plan.job_id}: {r.seconds:.2f} s counted as copy "
                                 f"time (held_seconds={r.held_seconds:.2f})")


def test_a_put_batch_queued_behind_anothers_held_puts_is_not_failed_by_its_deadline():
    """A small batch beside a big one, with a forward that does not end (the case max_hold
    exists for): nothing is wrong with the store, so neither may fail. (Was a bug: PUTs waited
    at the gate inside the store's request pool, and the small batch's PUTs queued behind the
    big one's missed their own batch deadline.)"""
    pacer = SpyPacer(max_hold=0.4)
    host, store, client = object_tiers(12, max_concurrency=1, config=short_deadline_config())
    with TransferEngine({"G2": host, "G4": store}, pacer=pacer, workers_per_path=2) as engine:
        pacer.forward_started()                          # and it hangs
        try:
            base = pacer.calls
            began = time.monotonic()
            big = engine.submit(put_plan(1, list(range(8)), [f"k{i}" for i in range(8)]))
            _wait_until(lambda: pacer.calls > base)
            small = engine.submit(put_plan(2, [9], ["small"]))
            results = [big.result(timeout=30), small.result(timeout=30)]
            wall = time.monotonic() - began
        finally:
            pacer.forward_ended()
    for r in results:
        assert 0.0 <= r.held_seconds <= wall + 0.05 and r.seconds >= 0.0
    big_r, small_r = results
    assert big_r.all_ok
    if not small_r.all_ok:           # whatever happened, a failed PUT wrote nothing later
        time.sleep(0.5)
        assert "small" not in client.objects
    assert small_r.all_ok, f"the small batch failed: {small_r.failures}"


# -- the gate itself --------------------------------------------------------------------------
@pytest.mark.parametrize("max_hold", [float("inf"), 1e10])
def test_a_max_hold_the_constructor_accepts_works(max_hold):
    """A max_hold the constructor accepts must work; inf or one above threading.TIMEOUT_MAX
    may be refused. (Was a bug: they were accepted, and Condition.wait raised OverflowError
    in every paced write during a forward.)"""
    try:
        pacer = ForwardPacer(max_hold=max_hold)
    except ValueError:
        return                                       # refusing it is fine too
    pacer.forward_started()
    out: list = []

    def waiter():
        try:
            out.append(pacer.wait())
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            out.append(exc)

    thread = _start(waiter)
    time.sleep(0.1)
    pacer.forward_ended()
    thread.join(5)
    assert not thread.is_alive()
    assert isinstance(out[0], float), f"wait() raised {out[0]!r}"


def test_an_infinite_max_hold_does_not_break_object_writes_without_any_forward():
    """max_hold=inf, if accepted, must not break writes when no forward runs. (Was a bug: the
    batch deadline became inf and concurrent.futures.wait(timeout=inf) raised OverflowError,
    failing every G2->G4 plan.)"""
    try:
        pacer = ForwardPacer(max_hold=float("inf"))
    except ValueError:
        return
    host, store, client = object_tiers(8, max_concurrency=2)
    with TransferEngine({"G2": host, "G4": store}, pacer=pacer) as engine:
        result = engine.submit(put_plan(1, [0, 1, 2, 3], ["a", "b", "c", "d"])).result(10)
    assert result.all_ok, f"no forward ran, yet: {result.error or result.failures}"
    assert len(client.objects) == 4


def test_a_gate_that_raises_leaves_the_plan_accounting_balanced():
    """A gate that raises leaves the plan's accounting balanced, so its later waits still
    count as held. (Was a bug: the unit was marked running in a finally around the gate and
    stayed running for good.)"""
    class FlakyPacer(ForwardPacer):
        fail = True

        def wait(self) -> float:
            if self.fail:
                self.fail = False
                raise RuntimeError("the gate broke")
            return super().wait()

    clock = ManualClock()
    pacer = FlakyPacer(max_hold=30, clock=clock)
    plan = pacer.plan()
    pacer.forward_started()
    with pytest.raises(RuntimeError):
        with plan.request():
            pass
    assert (plan._waiting, plan._running) == (0, 0)
    thread = _start(lambda: plan.request().__enter__())
    _wait_until(lambda: plan._waiting == 1)
    clock.now += 2.0
    held = plan.held_seconds
    pacer.forward_ended()
    thread.join(5)
    assert held == pytest.approx(2.0), f"held_seconds {held} (running={plan._running})"


def test_a_body_that_raises_leaves_the_plan_accounting_balanced():
    clock = ManualClock()
    pacer = ForwardPacer(max_hold=30, clock=clock)
    plan = pacer.plan()
    for _ in range(3):
        with pytest.raises(ValueError):
            with plan.request():
                raise ValueError("the PUT failed")
    assert (plan._waiting, plan._running) == (0, 0)
    pacer.forward_started()
    thread = _start(lambda: plan.request().__enter__())
    _wait_until(lambda: plan._waiting == 1)
    clock.now += 1.5
    assert plan.held_seconds == pytest.approx(1.5)
    pacer.forward_ended()
    thread.join(5)


def test_close_during_waits_and_later_forwards_never_block():
    pacer = ForwardPacer(max_hold=30)
    pacer.forward_started()
    threads = [_start(pacer.wait) for _ in range(4)]
    _wait_until(lambda: len(pacer._cond._waiters) == 4)
    pacer.close()
    for t in threads:
        t.join(5)
        assert not t.is_alive()
    pacer.forward_started()
    pacer.forward_ended()
    pacer.forward_started()
    assert pacer.wait() == 0.0 and not pacer.forward_running
    pacer.close()                                    # twice: fine


def test_held_time_stays_within_wall_time_under_racing_forwards():
    """Many writers through one plan while forwards start and end as fast as they can: the
    counters stay balanced, held time is >= 0, never more than the wall time, and frozen
    once nothing waits."""
    pacer = ForwardPacer(max_hold=0.05)
    plan = pacer.plan()
    stop = threading.Event()

    def engine():
        while not stop.is_set():
            pacer.forward_started()
            time.sleep(0.001)
            pacer.forward_ended()

    def writer():
        for i in range(40):
            try:
                with plan.request():
                    if i % 7 == 0:
                        raise OSError("a PUT failed")
            except OSError:
                pass

    began = time.monotonic()
    driver = _start(engine)
    writers = [_start(writer) for _ in range(6)]
    for w in writers:
        w.join(30)
        assert not w.is_alive()
    wall = time.monotonic() - began
    stop.set()
    driver.join(5)
    held = plan.held_seconds
    assert (plan._waiting, plan._running) == (0, 0)
    assert 0.0 <= held <= wall and not math.isnan(held)
    time.sleep(0.05)
    assert plan.held_seconds == held
    c = pacer.counters
    assert c.holds <= 240 and c.overruns <= c.holds and c.held_seconds >= 0


# -- the transfer engine ----------------------------------------------------------------------
def test_loads_and_device_copies_are_never_held_by_a_pacer_two_engines_share(tmp_path):
    """Two engines (workers_per_path=2) share one pacer: during a forward, G1->G2 and every
    load run; G2->G3 writes wait in both engines and one forward_ended releases them all."""
    pacer = ForwardPacer(max_hold=30)
    for i in range(2):
        (tmp_path / f"e{i}").mkdir()
    engines = [TransferEngine(make_tiers(tmp_path / f"e{i}"), pacer=pacer, workers_per_path=2)
               for i in range(2)]
    try:
        for engine in engines:
            assert run(engine, "G1->G2", [0, 1, 2, 3], [0, 1, 2, 3], [11, 12, 13, 14]).all_ok
            assert run(engine, "G2->G3", [0, 1], [0, 1], [11, 12]).all_ok
        pacer.forward_started()
        try:
            writes = [e.submit(TransferPlan.for_path("G2->G3", [p + 2], [p + 2], [13 + p],
                                                     job_id=10 + p))
                      for e in engines for p in range(2)]
            unpaced = []
            for e in engines:
                for path, src, dst, seq in (("G1->G2", [4], [4], [15]),
                                            ("G2->G1", [0], [8], [11]),
                                            ("G3->G2", [0], [6], [11]),
                                            ("G3->G1", [1], [9], [12])):
                    unpaced.append(e.submit(TransferPlan.for_path(path, src, dst, seq,
                                                                  job_id=20)))
            for f in unpaced:
                r = f.result(timeout=10)
                assert r.all_ok and r.held_seconds == 0.0, r.plan.path
            time.sleep(0.2)
            assert not any(w.done() for w in writes)
        finally:
            pacer.forward_ended()
        results = [w.result(timeout=10) for w in writes]
        assert all(r.all_ok and r.held_seconds >= 0.2 for r in results)
        assert pacer.counters.holds == 4 and pacer.counters.overruns == 0
    finally:
        for engine in engines:
            engine.close()


def test_a_failed_paced_plan_leaves_nothing_for_the_next_plan_on_its_thread():
    """The thread-local pacing of a plan whose handler raised is cleared: the next plan on
    the same worker thread is held and accounted with its own PlanPacing."""
    pacer = ForwardPacer(max_hold=30)
    host, store, client = object_tiers(8, max_concurrency=2)
    with TransferEngine({"G2": host, "G4": store}, pacer=pacer) as engine:
        bad = TransferPlan.trusted(1, Endpoint("G2"), Endpoint("G4"), (1, 2), (0, 1),
                                   dst_keys=("same", "same"))     # write_blocks refuses it
        failed = engine.submit(bad).result(timeout=10)
        assert not any(failed.ok) and failed.error and failed.held_seconds == 0.0
        pacer.forward_started()
        try:
            later = engine.submit(put_plan(2, [2], ["z"]))
            time.sleep(0.3)
            assert not later.done()
        finally:
            pacer.forward_ended()
        result = later.result(timeout=10)
    assert result.all_ok and result.held_seconds >= 0.25 and result.seconds < 0.25


def test_close_cancel_pending_with_a_held_disk_plan_is_bounded_by_max_hold(tmp_path):
    pacer = SpyPacer(max_hold=0.5)
    engine = TransferEngine(make_tiers(tmp_path), pacer=pacer)
    assert run(engine, "G1->G2", [0, 1, 2, 3], [0, 1, 2, 3], [11, 12, 13, 14]).all_ok
    pacer.forward_started()                          # never ends
    base = pacer.calls
    futures = [engine.submit(TransferPlan.for_path("G2->G3", [b], [b], [11 + b], job_id=b))
               for b in range(4)]
    _wait_until(lambda: pacer.calls > base)
    began = time.monotonic()
    engine.close(cancel_pending=True)
    assert time.monotonic() - began < 0.5 + 2.0
    assert futures[0].result(timeout=5).all_ok        # the one held ran after max_hold
    assert all(f.cancelled() for f in futures[1:])
    assert pacer.counters.overruns == 1
