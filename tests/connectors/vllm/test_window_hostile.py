"""Blocks vLLM does not keep, in the corners a review found:

* a peer (NIXL) load for a model whose only KV cache group is a sliding window: vLLM gives
  the positions before the window its null block (0); the load must fill the window's blocks
  byte-exact and never read into, nor report, the null block (vLLM would reschedule every
  running request whose table holds it);
* a peer load into blocks vLLM freed in that step while a store still reads them (a window
  frees blocks every step; a preemption too): the worker starts a remote load before the
  step's flush, so it is not ordered and the blocks are recomputed;
* a store still reading window blocks that vLLM freed for a request it then did not schedule
  (vLLM 0.32's ``allocate_slots`` frees them before it finds no room; with async scheduling
  nothing is preempted and a waiting request may get them in that step): the workers must
  finish the store before that step's forward, so G2 never keeps the other request's KV.
"""

from __future__ import annotations

import socket
import time
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from kvstrata.connectors.vllm.groups import SLIDING, KvGroup, KvGroups  # noqa: E402
from kvstrata.remote.nixl_agent import nixl_available  # noqa: E402

from .sim import FakeRequest, SimEngine, assert_idle, block_kv, sim_factory, slow_path  # noqa: E402
from .test_groups import (BS, WINDOW, HybridSim, assert_loaded_bytes,  # noqa: E402
                          first_in_window, prompt)

WINDOW_ONLY = KvGroups((KvGroup(0, SLIDING, WINDOW),))


def reader_settings(address: str) -> dict:
    """A reading engine's settings; patient with the peers' answers on a busy machine."""
    return {"peers": [address], "peer_ask_timeout": 10}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WindowOnlySim(SimEngine):
    """:class:`SimEngine` of a model whose one KV cache group is a sliding window: as vLLM,
    the positions a load's window does not reach get the null block (0)."""

    def __init__(self, tmp_path, **kw) -> None:
        super().__init__(tmp_path, groups=WINDOW_ONLY, **kw)

    def _allocate_for(self, request, external_tokens: int) -> None:
        first = first_in_window(external_tokens)
        blocks = -(-request.num_tokens // self.block_size)
        request.block_ids = [0] * first + self._allocate(blocks - first)

    def _free(self, request) -> None:
        self.free.extend(b for b in request.block_ids if b)
        request.block_ids = []


@pytest.mark.integration
@pytest.mark.timeout(120)
@pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")
def test_a_peer_load_of_a_window_only_model_fills_the_window_never_the_null_block(tmp_path):
    """Two engines over real NIXL, a window of 9 tokens, a prompt of 10 blocks that only A
    computed: B's table holds the null block before the window (blocks 0-7); the remote
    load reads blocks 8 and 9 alone, byte-exact, and block 0 is neither written nor
    reported invalid."""
    address = f"tcp://127.0.0.1:{free_port()}"
    a = WindowOnlySim(tmp_path / "a", block_size=BS, g3_blocks=0, extra={"export": address})
    b = WindowOnlySim(tmp_path / "b", block_size=BS, g3_blocks=0,
                      extra=reader_settings(address))
    orders = []
    build = b.scheduler.build_connector_meta
    b.scheduler.build_connector_meta = lambda out: orders.append(build(out)) or orders[-1]
    try:
        tokens = prompt(41, 10 * BS + 1)
        a.add("a", tokens)
        a.run()
        request = b.add("b", tokens + [7])
        deadline = time.monotonic() + 20
        while request.state in ("waiting", "loading") and time.monotonic() < deadline:
            b.step()
            time.sleep(0.002)
        assert request.state == "running" and request.loaded == 10
        first = first_in_window(10 * BS)
        assert first > 0 and request.block_ids[:first] == [0] * first
        loads = [load for o in orders for load in o.remote_loads.values()]
        assert len(loads) == 1
        seq = b.scheduler._requests["b"].seq
        assert loads[0].block_ids == tuple(request.block_ids[first:10])
        assert loads[0].sequence_hashes == tuple(seq[first:10])
        assert not b.invalid_seen
        for layer, tensor in enumerate(b.kv[0]):
            assert not tensor[0].any(), ("null block written", layer)
            for i in range(first, 10):
                assert torch.equal(tensor[request.block_ids[i]],
                                   block_kv(seq[i], layer, 0, BS)), (i, layer)
        b.run()
        assert_idle(b)
    finally:
        for sim in (b, a):
            for worker in sim.workers:
                worker.shutdown()
            sim.scheduler.close()


@pytest.mark.integration
@pytest.mark.timeout(120)
@pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")
def test_a_peer_load_into_blocks_a_store_still_reads_is_recomputed(tmp_path):
    """vLLM frees a request's blocks (a preemption here; a sliding window does it every
    step) while their stores to G2 run, and gives them in that step to a request whose
    prefix a peer holds. The worker starts a remote load before the step's flush, so it
    would write the blocks under the stores and G2 would keep the peer's KV under the
    first request's names: the load is not ordered, its blocks are recomputed, and what
    G2 kept loads back byte-exact."""
    address = f"tcp://127.0.0.1:{free_port()}"
    a = SimEngine(tmp_path / "a", block_size=BS, g3_blocks=0, extra={"export": address})
    b = SimEngine(tmp_path / "b", block_size=BS, g3_blocks=0, g1_blocks=7,
                  extra=reader_settings(address))
    try:
        shared = prompt(50, 5 * BS + 1)
        a.add("a", shared)
        a.run()
        restore = slow_path(b.workers[0], "G1->G2", 2.0)
        mine = prompt(51, 5 * BS + 1)
        first = b.add("r", mine, max_new=2)
        while first.num_computed_tokens == 0:        # the peers are asked first
            b.step()
            time.sleep(0.01)
        second = FakeRequest("x", shared + [7], 2)   # waiting for room, its answer in
        deadline = time.monotonic() + 10
        while b.scheduler.get_num_new_matched_tokens(second, 0)[0] is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        b.preempt("r", overwrite=False)
        parked = b.requests.pop("r")
        b.requests["x"] = second
        b.step()                                     # x gets r's blocks
        taken = second.block_ids[:5]
        assert taken == [1, 2, 3, 4, 5]
        restore()
        b.run()
        b.requests["r"] = parked
        b.run()
        again = b.add("c", mine + [3])
        while again.state in ("waiting", "loading"):
            b.step()
            time.sleep(0.002)
        assert again.loaded == 5
        seq = b.scheduler._requests["c"].seq
        for layer, tensor in enumerate(b.kv[0]):
            for i in range(5):
                assert torch.equal(tensor[again.block_ids[i]],
                                   block_kv(seq[i], layer, 0, BS)), (i, layer)
        assert set(taken) <= b.invalid_seen, "recomputed, not loaded"
    finally:
        for sim in (b, a):
            for worker in sim.workers:
                worker.shutdown()
            sim.scheduler.close()


class BoundHybridSim(HybridSim):
    """:class:`HybridSim` whose scheduler half is bound to a KV cache manager, as vLLM binds
    its own: ``get_block_ids`` gives any request's tables, scheduled or not (requests the
    test holds back from scheduling are in :attr:`parked`)."""

    def __init__(self, tmp_path, **kw) -> None:
        super().__init__(tmp_path, **kw)
        self.parked: dict = {}
        self.scheduler.bind_kv_cache_manager(SimpleNamespace(get_block_ids=self._block_ids))

    def _block_ids(self, req_id: str) -> tuple[list[int], ...]:
        request = self.requests.get(req_id) or self.parked.get(req_id)
        return self._tables(request) if request is not None else ([], [])


@pytest.fixture
def make(tmp_path):
    yield from sim_factory(BoundHybridSim, tmp_path, BS)


def _spy_flushes(sim) -> list[bool]:
    flushes = []
    build = sim.scheduler.build_connector_meta
    sim.scheduler.build_connector_meta = lambda out: (o := build(out), flushes.append(o.flush))[0]
    return flushes


def _step_without(sim, req_id: str) -> None:
    """One step in which vLLM does not schedule ``req_id`` (its allocation failed and
    nothing could be preempted) while a new request runs and takes free blocks."""
    sim.parked[req_id] = sim.requests.pop(req_id)
    sim.add(f"w-{req_id}", prompt(99, 2 * BS + 1), max_new=1)
    sim.step()


@pytest.mark.parametrize("bound", [True, False], ids=["kv-cache-manager", "unbound"])
def test_window_blocks_freed_for_a_request_not_scheduled_are_flushed_before_reuse(
        make, bound):
    """After a prefill of 6 blocks the window frees blocks 0-3 while their stores run; in
    the next step the request is not scheduled and another request's forward overwrites
    them. The scheduler reads the request's tables through vLLM's KV cache manager (or,
    without one, cannot see them and assumes the worst) and orders the flush: G2 holds what
    the prefill wrote, and a prompt ending at block 4 loads it byte-exact."""
    sim = make(g3_blocks=0)
    if not bound:
        sim.scheduler.bind_kv_cache_manager(SimpleNamespace())
    flushes = _spy_flushes(sim)
    restore = slow_path(sim.workers[0], "G1->G2", 0.5)
    tokens = prompt(6, 6 * BS + 1)
    sim.add("r", tokens, max_new=8)
    sim.step()                                    # the prefill; its stores run slowly
    parked = sim.requests["r"]
    freed = first_in_window(parked.num_computed_tokens)
    assert freed == 4 and parked.window_ids[:freed] == [0] * freed
    _step_without(sim, "r")
    flushed = flushes[-1]
    restore()
    sim.requests["r"] = sim.parked.pop("r")
    sim.run()
    request = sim.add("b", tokens[:4 * BS] + [4])
    while request.state in ("waiting", "loading"):
        sim.step()
        time.sleep(0.001)
    assert request.loaded == 4 and not sim.invalid_seen
    assert_loaded_bytes(sim, request, tokens[:4 * BS])
    assert flushed, "no flush before the forward that overwrites the freed blocks"
    sim.run()
    assert_idle(sim)


def test_a_request_not_scheduled_whose_window_kept_its_blocks_orders_no_flush(make):
    """The check reads the tables: a prompt inside the window frees nothing, so holding the
    request back a step, its stores still running, costs no flush."""
    sim = make(g3_blocks=0)
    flushes = _spy_flushes(sim)
    restore = slow_path(sim.workers[0], "G1->G2", 0.2)
    sim.add("r", prompt(7, WINDOW), max_new=2)
    sim.step()
    assert first_in_window(sim.requests["r"].num_computed_tokens) == 0
    assert sim.scheduler.planner.engine_blocks_in_use(), "its stores are in flight"
    _step_without(sim, "r")
    assert flushes[-1] is False
    restore()
    sim.requests["r"] = sim.parked.pop("r")
    sim.run()
    assert_idle(sim)
    assert not sim.scheduler._readers
