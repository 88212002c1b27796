"""A hybrid model's KV cache groups through the connector's halves (issue 26): one
full-attention group and one sliding-window group sharing vLLM's block pool, simulated as vLLM
runs them (the window's blocks freed while the request runs, null block 0 in their place),
with real bytes. The real engine runs in tests/integration/test_vllm_models.py; this reaches
the hostile cases: a window evicted from one group only, a load failing in one group, a store
still reading a block the window freed, an abort and a preemption during a multi-group load.
"""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("vllm")

from kvstrata.connectors.vllm.groups import FULL, SLIDING, KvGroup, KvGroups  # noqa: E402

from .sim import (LAYERS, FakeRequest, SimEngine, assert_idle, block_kv,  # noqa: E402
                  sim_factory, slow_path)

BS = 4
WINDOW = 2 * BS + 1                  # a window ending at block n reaches back into n - 3
GROUPS = KvGroups((KvGroup(0, FULL), KvGroup(1, SLIDING, WINDOW)))


def prompt(seed: int, n: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 900, (n,), generator=gen).tolist()


def first_in_window(computed_tokens: int) -> int:
    """The first block a sliding-window group keeps once ``computed_tokens`` are computed."""
    return max(0, computed_tokens - WINDOW + 1) // BS


class HybridSim(SimEngine):
    """:class:`SimEngine` with a second, sliding-window group (``request.window_ids``)."""

    def __init__(self, tmp_path, **kw) -> None:
        super().__init__(tmp_path, groups=GROUPS, **kw)
        self.aborted: dict[str, FakeRequest] = {}

    def add(self, req_id: str, prompt_ids: list[int], max_new: int = 2) -> FakeRequest:
        request = super().add(req_id, prompt_ids, max_new)
        request.window_ids = []
        return request

    def _tables(self, request):
        return list(request.block_ids), list(request.window_ids)

    def _allocate_for(self, request, external_tokens: int) -> None:
        super()._allocate_for(request, external_tokens)
        first = first_in_window(external_tokens)
        request.window_ids = [0] * first + self._allocate(len(request.block_ids) - first)

    def _write_block(self, rank, request, tracked, b) -> None:
        super()._write_block(rank, request, tracked, b)
        if request.window_ids[b]:
            for layer, tensor in enumerate(self.kv[rank]):
                tensor[request.window_ids[b]] = window_kv(tracked.seq[b], layer, rank)

    def _grow(self, request) -> None:
        super()._grow(request)
        while len(request.window_ids) < len(request.block_ids):
            request.window_ids += self._allocate(1)
        self._leave_window(request)

    def _finish(self, request) -> None:
        self._leave_window(request)        # vLLM: remove_skipped_blocks, then request_finished
        super()._finish(request)

    def _leave_window(self, request) -> None:
        """vLLM frees what left the window when it next schedules the request, and when it
        finishes; the block may go to another request at once, whose forward overwrites
        it."""
        for i in range(first_in_window(request.num_computed_tokens)):
            if request.window_ids[i]:
                self._scribble.append(request.window_ids[i])
                self.free.append(request.window_ids[i])
                request.window_ids[i] = 0

    def _free(self, request) -> None:
        self.free.extend(b for b in getattr(request, "window_ids", ()) if b)
        request.window_ids = []
        super()._free(request)

    def abort_loading(self, req_id: str) -> None:
        """vLLM aborts a request whose load runs: request_finished now, its blocks freed
        once the load is reported finished."""
        request = self.requests.pop(req_id)
        assert request.state == "loading"
        assert self.scheduler.request_finished(request, self._tables(request)) is False
        self.aborted[req_id] = request

    def _after_step(self, scheduled, output) -> None:
        super()._after_step(scheduled, output)
        for req_id in output.finished_recving or ():
            if req_id in self.aborted:
                self._free(self.aborted.pop(req_id))


def test_mla_latent_pages_come_back_from_g2_and_g3_byte_for_byte(tmp_path):
    """MLA (vLLM's ``[blocks, 1, block_size, latent]`` page, one latent per token): stored
    and loaded whole, from G2 and, once pushed out of it, from G3."""
    sims = []
    try:
        sim = SimEngine(tmp_path / "mla", block_size=BS, g2_blocks=8, mla=True)
        sims.append(sim)
        assert sim.settings.kv.model.outer_dim == 1
        first = prompt(10, 6 * BS + 1)
        sim.add("a", first)
        sim.run()
        for i in range(2):                        # push "a" out of G2 into G3
            sim.add(f"f{i}", prompt(20 + i, 6 * BS + 1))
            sim.run()
        request = sim.add("b", first + [5])
        step_until_loaded(sim, request)
        assert request.loaded == 6
        assert sim.scheduler.counters.blocks_loaded.get("G3", 0) > 0
        seq = hashes_of(sim, first)
        for layer in range(LAYERS):
            for b in range(6):
                assert torch.equal(sim.kv[0][layer][request.block_ids[b]],
                                   sim.page_kv(seq[b], layer, 0)), (b, layer)
        sim.run()
        assert_idle(sim)
    finally:
        for sim in sims:
            for worker in sim.workers:
                worker.shutdown()


def window_kv(sequence_hash: int, layer: int, rank: int) -> torch.Tensor:
    """The KV the forward writes for the sliding-window group's block."""
    return block_kv(GROUPS.key(1, sequence_hash), layer, rank, BS)


@pytest.fixture
def make(tmp_path):
    yield from sim_factory(HybridSim, tmp_path, BS)


def hashes_of(sim: HybridSim, tokens: list[int]) -> list[int]:
    probe = sim.add("_probe", tokens)
    tracked = sim.scheduler._track(probe)
    tracked.hash_upto(len(tokens) // BS, BS)
    seq = list(tracked.seq)
    sim.requests.pop("_probe")
    sim.scheduler.request_finished(probe, [])
    return seq


def step_until_loaded(sim: HybridSim, request: FakeRequest, limit: int = 2000) -> None:
    for _ in range(limit):
        if request.state not in ("loading", "waiting"):
            return
        sim.step()
        time.sleep(0.001)
    raise AssertionError("the load never finished")


def assert_loaded_bytes(sim: HybridSim, request: FakeRequest, tokens: list[int]) -> None:
    """Every block the load filled holds its group's KV: all of the full-attention group's,
    only the window's of the sliding-window group (the rest is vLLM's null block)."""
    n = request.loaded
    seq = hashes_of(sim, tokens)
    first = first_in_window(n * BS)
    assert request.window_ids[:first] == [0] * first
    for rank, layers in enumerate(sim.kv):
        for layer in range(LAYERS):
            for b in range(n):
                assert torch.equal(layers[layer][request.block_ids[b]],
                                   block_kv(seq[b], layer, rank, BS)), ("full", b, layer)
            for b in range(first, n):
                assert torch.equal(layers[layer][request.window_ids[b]],
                                   window_kv(seq[b], layer, rank)), ("window", b, layer)


def test_a_returning_prompt_loads_every_full_block_and_only_the_window(make):
    sim = make()
    tokens = prompt(1, 6 * BS + 1)
    sim.add("a", tokens)
    sim.run()
    g2 = sim.scheduler.planner.pools["G2"]
    seq = hashes_of(sim, tokens)
    assert all(GROUPS.key(1, h) in g2 for h in seq[:6]), "every window block was stored"
    loaded_before = sum(sim.scheduler.counters.blocks_loaded.values())
    request = sim.add("b", tokens + [7, 8])
    step_until_loaded(sim, request)
    assert request.loaded == 6
    assert_loaded_bytes(sim, request, tokens)
    moved = sum(sim.scheduler.counters.blocks_loaded.values()) - loaded_before
    assert moved == 6 + (6 - first_in_window(6 * BS))
    sim.run()
    assert_idle(sim)


def test_the_admission_filter_is_shown_every_groups_blocks(make):
    """A filter that learns from requests must know the window group's blocks too (their
    own names), or it would admit them blind while refusing their full-attention twins."""
    sim = make()
    tokens = prompt(3, 5 * BS + 1)
    sim.add("a", tokens)
    sim.run()
    state = sim.scheduler.planner._state
    admission = state.admission[state.tiers[-1]]
    assert admission.learns_from_requests                  # the default filter
    seq = hashes_of(sim, tokens)
    assert all(admission._seen.holds(h) for h in seq[:5])
    assert all(admission._seen.holds(GROUPS.key(1, h)) for h in seq[:5])
    assert_idle(sim)


def test_a_prefix_ending_inside_an_earlier_prompt_loads_the_window_there(make):
    sim = make()
    tokens = prompt(2, 8 * BS)
    sim.add("a", tokens)
    sim.run()
    request = sim.add("b", tokens[:4 * BS + 2] + prompt(3, 3 * BS))
    step_until_loaded(sim, request)
    assert request.loaded == 4
    assert_loaded_bytes(sim, request, tokens[:4 * BS])
    sim.run()
    assert_idle(sim)


def test_a_window_evicted_from_one_group_only_shortens_the_hit_to_an_intact_window(make):
    """The full-attention group still holds blocks 0-5 but the sliding-window group lost
    block 4: a hit ending at 5 or 6 would need it; a hit ending at 4 needs blocks 2-3 only."""
    sim = make()
    tokens = prompt(4, 6 * BS + 1)
    sim.add("a", tokens)
    sim.run()
    seq = hashes_of(sim, tokens)
    planner = sim.scheduler.planner
    for tier in planner.tiers[1:]:
        planner._state.drop(tier, [GROUPS.key(1, seq[4])])
    request = sim.add("b", tokens + [9])
    n, is_async = sim.scheduler.get_num_new_matched_tokens(request, 0)
    assert (n, is_async) == (4 * BS, True)
    step_until_loaded(sim, request)
    assert request.loaded == 4
    assert_loaded_bytes(sim, request, tokens)
    sim.run()
    assert_idle(sim)


def test_a_load_failing_in_one_group_fails_the_request_not_a_block(make):
    """vLLM cannot map a failed block id of a multi-group model back to its request (it
    raises): the worker reports the request in failed_recving and vLLM recomputes it."""
    from kvstrata.protocol.results import BlockFailure, FailureKind

    sim = make()
    tokens = prompt(5, 5 * BS + 1)
    sim.add("a", tokens)
    sim.run()
    window_keys = {GROUPS.key(1, h) for h in hashes_of(sim, tokens)}
    worker = sim.workers[0]
    real = worker.engine._handlers["G2->G1"]

    def failing(plan, src, dst, failures, checksums):
        real(plan, src, dst, failures, checksums)
        for pos, key in enumerate(plan.sequence_hashes):
            if key in window_keys:
                failures[pos] = BlockFailure(pos, plan.dst_block_ids[pos],
                                             FailureKind.IO_ERROR, "injected")
                return

    worker.engine._handlers["G2->G1"] = failing
    request = sim.add("b", tokens + [3])
    step_until_loaded(sim, request)
    worker.engine._handlers["G2->G1"] = real
    assert not sim.invalid_seen, "block-level errors would make vLLM raise"
    assert request.num_computed_tokens == 0, "recomputed whole"
    assert sim.scheduler.counters.blocks_load_failed >= 1
    sim.run()
    assert_idle(sim)


@pytest.mark.parametrize("prompt_len,max_new", [(6 * BS + 1, 3 * BS), (2 * BS + 3, 1)])
def test_a_store_still_reading_a_block_the_window_freed_is_finished_before_its_reuse(
        make, prompt_len, max_new):
    """The sliding window frees a block in a step after it was computed (a prompt of 6
    blocks and 3 blocks of answer), or as the request finishes, before ``request_finished``
    (a prompt whose window first moves past a block with its last token); its store to G2
    runs on a transfer thread and may still read it. The scheduler sees the null block in
    the table, or the finished request's stores still reading blocks it was not given back,
    and has the workers finish their copies before the next forward, which overwrites the
    freed block: what G2 holds is what the forward wrote, byte for byte."""
    sim = make()
    restore = slow_path(sim.workers[0], "G1->G2", 0.05)
    tokens = prompt(6, prompt_len)
    sim.add("a", tokens, max_new=max_new)
    sim.add("other", prompt(66, BS + 1), max_new=3)    # keeps the engine stepping
    sim.run()
    restore()
    for blocks in range(prompt_len // BS, 0, -1):       # every window, down to block 0's
        request = sim.add(f"b{blocks}", tokens[:blocks * BS] + [4])
        step_until_loaded(sim, request)
        assert request.loaded == blocks
        assert_loaded_bytes(sim, request, tokens[:blocks * BS])
        sim.run()
    assert_idle(sim)


def test_abort_during_a_multi_group_load_and_a_preemption_leave_nothing_behind(make):
    sim = make(g2_blocks=64)
    tokens = prompt(7, 6 * BS + 1)
    sim.add("a", tokens)
    sim.run()
    restore = slow_path(sim.workers[0], "G2->G1", 0.05)
    running = sim.add("r", prompt(8, 3 * BS + 1), max_new=4 * BS)
    loading = sim.add("b", tokens + [2])
    for _ in range(3):
        sim.step()
    assert loading.state == "loading"
    sim.preempt("r")
    sim.abort_loading("b")
    restore()
    sim.run()
    assert_idle(sim)
    assert sorted(sim.free) == list(range(1, 64)), "vLLM blocks leaked"
