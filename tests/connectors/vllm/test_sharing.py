"""Two engines sharing G2 over NIXL (``export`` / ``peers``), driven as vLLM drives the
connector, with real NIXL agents: engine B loads into its KV cache, byte-exact, a prefix only
engine A computed; what B does not get from A it recomputes; A's leased slots are never
overwritten mid-read; bad settings are refused; the threads that talk to peers are not held
to the core vLLM binds its worker to."""

from __future__ import annotations

import os
import socket
import threading
import time

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from kvstrata.remote.nixl_agent import nixl_available  # noqa: E402

if not nixl_available():
    pytest.skip("NIXL is not installed (scripts/setup.sh installs it)", allow_module_level=True)

from kvstrata.connectors.vllm.settings import (ConnectorConfigError, KvGeometry,  # noqa: E402
                                               settings_from)
from kvstrata.physical.errors import SlotPinnedError  # noqa: E402
from kvstrata.tokens import hash_blocks  # noqa: E402

from .sim import HEAD_DIM, HEADS, LAYERS, SimEngine, assert_idle, block_kv  # noqa: E402

SHARING = {"KVSTRATA_SHARING_SECRET": os.environ["KVSTRATA_SHARING_SECRET"]}
"""The session's sharing secret (tests/conftest.py), for settings built from an explicit env."""
from .test_halves import BS, prompt  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def pair(tmp_path):
    address = f"tcp://127.0.0.1:{free_port()}"
    a = SimEngine(tmp_path / "a", g3_blocks=0, extra={"export": address})
    b = SimEngine(tmp_path / "b", g3_blocks=0, extra={"peers": [address]})
    yield a, b, address
    for sim in (b, a):
        for worker in sim.workers:
            worker.shutdown()
        sim.scheduler.close()


def run_until_loaded(sim, req_id, tokens):
    request = sim.add(req_id, tokens)
    deadline = time.monotonic() + 20
    while request.state in ("waiting", "loading") and time.monotonic() < deadline:
        sim.step()
        time.sleep(0.002)
    assert request.state == "running"
    return request


def test_b_loads_from_a_what_only_a_computed(pair):
    a, b, _ = pair
    tokens = prompt(200, 10 * BS + 1)
    a.add("a", tokens)
    a.run()
    hashes = hash_blocks(tokens, BS)[1]
    assert len(a.scheduler.planner.lookup(hashes)) == 10            # in A's G2
    assert b.scheduler.planner.lookup(hashes) == []                 # B has nothing
    request = run_until_loaded(b, "b", tokens + [7])
    assert request.loaded == 10
    for i, block_id in enumerate(request.block_ids[:10]):
        for layer, tensor in enumerate(b.kv[0]):
            assert torch.equal(tensor[block_id], block_kv(hashes[i], layer, 0, BS)), (i, layer)
    assert not b.invalid_seen
    assert b.scheduler.counters.tokens_matched.get("remote") == 10 * BS
    b.run()
    assert_idle(b)
    # B stored what it loaded: its own G2 serves the next turn
    assert len(b.scheduler.planner.lookup(hashes)) == 10
    assert_idle(a)


def test_after_a_reset_a_peer_loads_nothing_a_held_before(pair):
    """A reset (new weights everywhere) told A's workers to forget their G2 slots, but G2
    had no way to: A's export went on serving the old KV to B."""
    a, b, _ = pair
    tokens = prompt(202, 8 * BS + 1)
    a.add("a", tokens)
    a.run()
    assert a.scheduler.reset_cache() is True
    a.add("next", prompt(203, 2 * BS + 1))        # the step that carries the reset's orders
    a.run()
    request = run_until_loaded(b, "b", tokens + [7])
    assert request.loaded == 0
    assert "remote" not in b.scheduler.counters.tokens_matched
    b.run()
    assert_idle(b)


def test_what_a_does_not_hold_b_recomputes_and_a_dead_peer_costs_nothing(pair):
    a, b, address = pair
    request = run_until_loaded(b, "x", prompt(201, 6 * BS + 1))      # nobody holds it
    assert request.loaded == 0
    b.run()
    tokens = prompt(202, 6 * BS + 1)
    a.add("a", tokens)
    a.run()
    for worker in a.workers:                                         # A goes away
        worker.shutdown()
    request = run_until_loaded(b, "y", tokens + [9])
    assert request.loaded == 0 or set(request.block_ids[:request.loaded]) <= b.invalid_seen
    b.run()
    assert_idle(b)


def test_a_pinned_slot_is_not_overwritten():
    from kvstrata.physical.storage.host import HostStorage
    from kvstrata.protocol.layout import LayoutConfig

    g2 = HostStorage(LayoutConfig(num_blocks=4, num_layers=1, outer_dim=2, page_size=4,
                                  inner_dim=8))
    g2.begin_write([0, 1])
    g2.seal([0, 1], [11, 12])
    rows = g2.pin_held([11, 12, 13])
    assert [(h, s) for h, s, _ in rows] == [(11, 0), (12, 1)]
    with pytest.raises(SlotPinnedError, match=r"slots \[1\] are being read"):
        g2.begin_write([3, 1])
    with pytest.raises(SlotPinnedError, match=r"slots \[1, 0\] are being read"):
        g2.begin_write(np.array([1, 2, 0]))        # as the transfer engine passes them
    assert not g2.check_readable([0, 1], [11, 12])                  # untouched
    g2.unpin([0, 1])
    g2.begin_write([1])


def _threads() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_the_threads_that_talk_to_peers_are_not_bound_to_the_workers_core(tmp_path):
    """vLLM's CPU worker binds itself to its OpenMP cores and every thread it starts inherits
    that. The threads serving and reading peers (NIXL's and UCX's, ZMQ's, the exporter's, the
    loader's) must not: held on that core next to vLLM's busy-waiting thread and another
    engine's threads, they waited seconds for the CPU and remote loads timed out."""
    from kvstrata.connectors.vllm.sharing import HOST, G2Export, RemoteLoader
    from kvstrata.tiers import TOP_TIER

    sim = SimEngine(tmp_path / "sim", g3_blocks=0)
    storages = sim.workers[0].storages.by_tier
    geometry = KvGeometry(BS, LAYERS, HEADS, HEAD_DIM, "bfloat16", 64)
    address = f"tcp://127.0.0.1:{free_port()}"
    exporting = settings_from({"disk_dir": str(tmp_path), "export": address}, geometry,
                              env=SHARING)
    reading = settings_from({"disk_dir": str(tmp_path), "peers": [address]}, geometry,
                            env=SHARING)
    everywhere = os.sched_getaffinity(0)
    seen: dict = {}

    def worker_thread():                                  # bound as vLLM binds its worker
        os.sched_setaffinity(0, {min(everywhere)})
        before = _threads()
        seen["export"] = G2Export(exporting, storages[HOST], 0, 1)
        seen["loader"] = RemoteLoader(reading, storages[TOP_TIER], 0, 1)
        seen["load thread"] = seen["loader"]._pool.submit(os.sched_getaffinity, 0).result()
        seen["started"] = _threads() - before

    thread = threading.Thread(target=worker_thread)
    thread.start()
    thread.join()
    try:
        bound = {}
        for tid in seen["started"]:
            try:
                affinity = os.sched_getaffinity(tid)
            except OSError:                               # ended since
                continue
            if affinity != everywhere:
                bound[tid] = affinity
        assert len(seen["started"]) >= 3                  # NIXL's, the exporter's, ...
        assert not bound
        assert seen["load thread"] == everywhere
    finally:
        seen["loader"].close()
        seen["export"].close()
        sim.workers[0].shutdown()
        sim.scheduler.close()


@pytest.mark.parametrize("extra, match", [
    ({"export": "http://x:1"}, "export"), ({"peers": "tcp://x"}, "peers"),
    ({"peers": [5]}, "peers"), ({"export": "tcp://127.0.0.1:99999999"}, "export"),
])
def test_bad_sharing_settings_are_refused(tmp_path, extra, match):
    geometry = KvGeometry(BS, LAYERS, HEADS, HEAD_DIM, "bfloat16", 64)
    with pytest.raises(ConnectorConfigError, match=match):
        settings_from({"disk_dir": str(tmp_path), **extra}, geometry, env=SHARING)
    two = KvGeometry(BS, LAYERS, HEADS, HEAD_DIM, "bfloat16", 64, workers=2)
    with pytest.raises(ConnectorConfigError, match="one worker"):
        settings_from({"peers": ["tcp://127.0.0.1:5000"]}, two, env=SHARING)
