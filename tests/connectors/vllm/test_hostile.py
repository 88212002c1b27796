"""Hostile tests of the vLLM connector: vLLM inputs and call orders the happy-path tests
(test_halves.py) do not reach, each checked against what vLLM 0.32's scheduler and model
runner really do (vllm/v1/core/sched/scheduler.py, kv_connector_model_runner_mixin.py).

``HostileSim`` extends the simulated vLLM with what those sources do and sim.py leaves out:

* a freed block may be handed out again at once (here: first), so a copy that reads a block
  vLLM freed reads another request's KV;
* ``abort`` in every state, with vLLM's semantics: a request waiting for its load keeps its
  blocks until the load is reported finished, and vLLM frees them in that same step
  (``_update_from_kv_xfer_finished``: a finished request in ``finished_recving`` is freed at
  once, whatever ``request_finished`` said);
* a token budget (chunked prefill: no token is sampled until the prompt is computed).
"""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("vllm")

from kvstrata.connectors.vllm.groups import SLIDING, KvGroup  # noqa: E402
from kvstrata.connectors.vllm.settings import (ConnectorConfigError, KvGeometry,  # noqa: E402
                                               settings_from)

from .sim import (LAYERS, SimEngine, _BlockState, _ConnectorOutput,  # noqa: E402
                  _SchedulerOutput, assert_idle, block_kv, sim_factory, slow_path)

BS = 4


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 5000 + 3 for i in range(n)]


class HostileSim(SimEngine):
    """See the module docstring."""

    def __init__(self, *args, budget: int | None = None, **kw) -> None:
        super().__init__(*args, **kw)
        self.budget = budget
        self.aborted_loading: dict = {}
        self.freed_log: list[int] = []
        real_update = self.scheduler.update_connector_output

        def audited(output) -> None:
            real_update(output)
            sending = set(output.finished_sending or ())
            recving = set(output.finished_recving or ())
            # vLLM frees a finished request named in finished_recving, then asserts that
            # each id of finished_sending is still one of its requests
            assert not sending & recving, f"reported both sending and recving: {sending & recving}"
            assert sending <= set(self.held), f"finished_sending names {sending - set(self.held)}"
            for req_id in recving:
                live = self.requests.get(req_id)
                assert req_id in self.aborted_loading or (
                    live is not None and live.state == "loading"), \
                    f"finished_recving names {req_id}, which waits for no load"

        self.scheduler.update_connector_output = audited

    # vLLM may reuse a freed block at once
    def _free(self, request) -> None:
        self.freed_log.extend(request.block_ids)
        self.free[:0] = request.block_ids
        request.block_ids = []

    def abort(self, req_id: str) -> bool:
        """vLLM's finish_requests(FINISHED_ABORTED) for a request in any state."""
        request = self.requests.pop(req_id)
        bs = self.block_size
        computed = request.block_ids[:-(-request.num_computed_tokens // bs)]
        held = self.scheduler.request_finished(request, list(computed))
        if request.state == "loading":
            # vLLM: delay_free_blocks while the load runs; freed when finished_recving comes
            self.aborted_loading[req_id] = request
        elif held:
            self.held[req_id] = request
        else:
            self.finished[req_id] = request
            self._free(request)
        return held

    def step(self) -> None:
        """sim.step with a token budget per request (chunked prefill)."""
        if self.budget is None:
            return super().step()
        budget = self.budget
        orig_forward, orig_after = self._forward, self._after_step
        orig_bcm = self.scheduler.build_connector_meta

        def cap(scheduled):
            return {k: min(v, budget) for k, v in scheduled.items()}

        def bcm(out):
            out.num_scheduled_tokens = cap(out.num_scheduled_tokens)
            return orig_bcm(out)

        def after(scheduled, output):
            scheduled = cap(scheduled)
            # a prefill chunk that does not reach the end of the prompt samples no token
            partial = {r for r, n in scheduled.items()
                       if self.requests[r].num_computed_tokens + n < self.requests[r].num_tokens}
            for r in partial:
                self.requests[r].num_computed_tokens += scheduled[r]
            orig_after({r: n for r, n in scheduled.items() if r not in partial}, output)

        self._forward = lambda rank, scheduled: orig_forward(rank, cap(scheduled))
        self._after_step = after
        self.scheduler.build_connector_meta = bcm
        try:
            super().step()
        finally:
            del self._forward, self._after_step
            self.scheduler.build_connector_meta = orig_bcm

    def _after_step(self, scheduled, output) -> None:
        self.last_freed: set[int] = set()
        for req_id in list(output.finished_recving or ()):
            request = self.aborted_loading.pop(req_id, None)
            if request is not None:
                # vLLM's _update_from_kv_xfer_finished: a finished request whose load is
                # reported finished is freed right away
                self.finished[req_id] = request
                self.last_freed |= set(request.block_ids)
                self._free(request)
                continue
            request = self.requests.get(req_id)
            if request is not None and request.block_ids \
                    and request.block_ids[0] in output.invalid_block_ids:
                # vLLM's _update_waiting_for_remote_kv: the first loaded block failed, no
                # valid computed token: "release allocated blocks" and start over
                self.last_freed |= set(request.block_ids)
                self._free(request)
                request.num_computed_tokens = 0
                request.state = "waiting"
        if self.last_freed:
            output = _ConnectorOutput(output.finished_sending, {
                r for r in output.finished_recving or ()
                if r not in self.finished and self.requests[r].state != "waiting"},
                output.kv_connector_worker_meta, output.invalid_block_ids)
        super()._after_step(scheduled, output)

    def run(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while self.aborted_loading and time.monotonic() < deadline:
            self.step()
            time.sleep(0.001)
        super().run(timeout)


@pytest.fixture
def make(tmp_path):
    yield from sim_factory(HostileSim, tmp_path, BS)


def push_out_of_g2(sim: HostileSim, tokens: list[int], others: int, seed: int) -> None:
    """Run ``tokens`` as request "a", then ``others`` requests of the same size, so a's
    blocks leave G2 (kept in G3)."""
    sim.add("a", tokens)
    sim.run()
    for i in range(others):
        sim.add(f"x{i}", prompt(seed + i, len(tokens)))
        sim.run()
    hashes = [h for h in _hashes(sim, tokens)]
    g2 = sim.scheduler.planner.pools["G2"]
    assert not any(h in g2 for h in hashes), "a's blocks are still in G2"


def _hashes(sim: SimEngine, tokens: list[int]) -> list[int]:
    from kvstrata.tokens import hash_blocks, isolation_seed

    return hash_blocks(tokens, sim.block_size, isolation_seed(None, None))[1]


def step_until(sim: SimEngine, cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out: {sim.scheduler.status()}"
        sim.step()
        time.sleep(0.001)


def check_load(sim: HostileSim, req_id: str, tokens: list[int], expect_blocks: int,
               max_new: int = 2) -> None:
    """Add a request, step until its load finished, and compare every loaded block with the
    KV the forward wrote for its hash (rank by rank)."""
    request = sim.add(req_id, tokens, max_new=max_new)
    step_until(sim, lambda: request.state != "loading" and request.state != "waiting")
    assert request.loaded == expect_blocks, (request.loaded, expect_blocks)
    hashes = _hashes(sim, tokens)
    for rank, layers in enumerate(sim.kv):
        for b in range(expect_blocks):
            assert request.block_ids[b] not in sim.invalid_seen
            for layer in range(LAYERS):
                assert torch.equal(layers[layer][request.block_ids[b]],
                                   block_kv(hashes[b], layer, rank, BS)), \
                    f"block {b} of {req_id} (rank {rank}, layer {layer}) holds wrong KV"
    sim.run()


# -- requests aborted while their load runs ------------------------------------------------

def test_aborted_while_loading_from_g3_no_copy_reads_the_freed_blocks(make):
    """Was a bug, fixed in 8798475. A load from G3 is followed by a G1 -> G2 copy of the
    loaded blocks (planned when the load's result comes back, reading vLLM's blocks).
    vLLM frees an aborted request's blocks in the very step its load is reported
    finished, so that copy reads freed blocks."""
    sim = make(g2_blocks=8, g3_blocks=64)
    tokens = prompt(60, 6 * BS + 1)
    push_out_of_g2(sim, tokens, 2, seed=70)
    request = sim.add("b", tokens + [5])
    sim.step()
    assert request.state == "loading"
    blocks = set(request.block_ids)
    assert sim.abort("b") is False              # vLLM waits for the load itself
    step_until(sim, lambda: "b" not in sim.aborted_loading)
    # vLLM has freed b's blocks in this step: nothing kvstrata runs may read or write them
    assert not blocks & sim.scheduler.planner.engine_blocks_in_use(), \
        "a copy planned after the load still reads the blocks vLLM just freed"
    sim.run()
    assert_idle(sim)


def test_aborted_while_loading_from_g3_g2_never_gets_another_requests_kv(make):
    """Was a bug, fixed in 8798475; the consequence of the test above: the freed blocks go
    to the next request, its forward writes them, then the G1 -> G2 copy runs and G2
    files that request's KV under the aborted request's hashes; the next request with
    that prefix loads the wrong KV (no checksum can notice: it is computed from the wrong
    bytes when they are stored)."""
    sim = make(g2_blocks=8, g3_blocks=64)
    tokens = prompt(61, 6 * BS + 1)
    push_out_of_g2(sim, tokens, 2, seed=80)
    request = sim.add("b", tokens + [5])
    sim.step()
    assert request.state == "loading"
    sim.abort("b")
    step_until(sim, lambda: "b" not in sim.aborted_loading)
    other = sim.add("c", prompt(62, 6 * BS + 1), max_new=1)   # takes the freed blocks
    sim.step()
    assert set(other.block_ids) & set(sim.freed_log)
    sim.run()
    check_load(sim, "d", tokens + [9], expect_blocks=6)
    assert_idle(sim)


# -- more tokens scheduled than the request has token ids -----------------------------------

@pytest.mark.parametrize("case", ["spec_decode", "async_scheduling"])
def test_scheduled_tokens_past_the_known_tokens_do_not_crash_the_scheduler(make, case):
    """Was a bug, fixed in 8798475. vLLM schedules tokens whose ids the request does not
    have yet: draft tokens of speculative decoding (num_scheduled_tokens = 1 + drafts;
    the drafts are in spec_token_ids, not all_token_ids) and, with async scheduling (on
    by default on GPU), the position of the token still being sampled
    (num_output_placeholders). When those positions complete a block,
    build_connector_meta must not offer (or index) a block whose hash it cannot compute."""
    sim = make()
    request = sim.add("a", prompt(90, 2 * BS + 1), max_new=20)
    sim.step()                                   # prefill; one token sampled
    assert request.num_tokens == 2 * BS + 2 and request.num_computed_tokens == 2 * BS + 1
    if case == "spec_decode":
        scheduled = 1 + 3                        # the last token + 3 drafts: 2*BS+5 > 3*BS
    else:
        # async scheduling: 2*BS+3 token ids known, the step in flight computes position
        # 2*BS+2 and samples 2*BS+3's token (a placeholder); this step schedules position
        # 2*BS+3 (num_tokens + placeholders - computed = 1), completing block 2
        request._tokens.append(1234)
        request.num_computed_tokens = request.num_tokens
        request.num_output_placeholders = 1
        scheduled = 1
    while len(request.block_ids) * BS < request.num_computed_tokens + scheduled:
        request.block_ids += sim._allocate(1)
    known_full = request.num_tokens // BS
    out = _SchedulerOutput({"a": scheduled}, set(), _BlockState({"a": request.block_ids}))
    assert (request.num_computed_tokens + scheduled) // BS > known_full  # the hostile case
    orders = sim.scheduler.build_connector_meta(out)       # IndexError here
    stored = [h for p in orders.plans for h in p.sequence_hashes]
    assert len(stored) <= known_full
    assert set(stored) <= set(sim.scheduler._requests["a"].seq[:known_full])


# -- switches ----------------------------------------------------------------------------

def test_load_off_still_stores(make):
    """Was a bug, fixed in 8798475. docs/vllm.md: "load, store: turn loading or storing
    off". With load: false the scheduler half never tracks a request (it is tracked in
    get_num_new_matched_tokens, which returns before that), so nothing is stored either."""
    sim = make(extra={"load": False})
    sim.add("a", prompt(100, 4 * BS + 1))
    sim.run()
    assert sim.scheduler.counters.blocks_offered == 4
    assert sim.scheduler.planner.pools["G2"].status().inactive == 4
    assert_idle(sim)


# -- the settings parser with hostile kv_connector_extra_config ------------------------------

GEOMETRY = KvGeometry(BS, 2, 2, 8, "bfloat16", 64)


@pytest.mark.parametrize("extra", [
    {"tiers": {"G2": {"blocks": -5}}},
    {"tiers": {"G2": {"blocks": 0}}},
    {"tiers": {"G2": {"bytes": "-1GiB"}}},
    {"tiers": {"G2": {"bytes": float("nan")}}},
    {"tiers": {"G2": {"gb": "lots"}}},
    {"tiers": {"G2": {"gb": [1]}}},
    {"tiers": {"G2": {"blocks": 8.5}}},
    {"tiers": {"G2": {"blocks": True}}},
    {"tiers": {"G2": None}},
    {"tiers": {"G2": [1, 2]}},
    {"tiers": {"G2": {"blocks": 8, "eviction": ["lru"]}}},
    {"tiers": {"G2": {"blocks": 8, "admission": {"x": 1}}}},
    {"tiers": {"G2": {"blocks": 8, "size": 3}}},
    {"tiers": {"G2": {"bytes": "1e400"}}},
    {"tiers": {"G2": {"gb": 1e300}}},
    {"tiers": {"g2": 8}},
    {"tiers": {"G9": 8}},
    {"tiers": {"G1": 8, "G2": 8}},
    {"tiers": {"G1": 8}},
    {"tiers": {}},
    {"tiers": ""},
    {"tiers": "G2=-5"},
    {"tiers": "G2"},
    {"tiers": 5},
    {"tiers": ["G2"]},
    {"tiers": None},
    {"eviction": 5},
    {"eviction": "nope"},
    {"admission": ""},
    {"disk_dir": 7},
    {"events": 3},
    {"events": ["jsonl:/tmp/x", 4]},
    {"verify_host_reads": "yes"},
    {"o_direct": 1},
    {"worker_id": -1},
    {"worker_id": 1.5},
    {"yield_to_forward": "yes"},
    {"yield_to_forward": 1},
    {"yield_to_forward": None},
    {"yield_to_forward": "AUTO"},
    {"config": 5},
    {"config": "/nonexistent/kvstrata.toml"},
    {"nonsense": 1},
], ids=repr)
def test_bad_extra_config_is_a_connector_config_error(extra):
    with pytest.raises(ConnectorConfigError):
        settings_from(extra, GEOMETRY, env={})


def test_yield_to_forward_reads_auto_true_and_false():
    assert settings_from({}, GEOMETRY, env={}).yield_to_forward is None
    assert settings_from({"yield_to_forward": "auto"}, GEOMETRY, env={}).yield_to_forward \
        is None
    for value in (True, False):
        assert settings_from({"yield_to_forward": value}, GEOMETRY,
                             env={}).yield_to_forward is value


@pytest.mark.parametrize("value, paced", [("auto", True), (True, True), (False, False)])
def test_a_cpu_worker_paces_its_lower_tier_writes_by_default(make, value, paced):
    sim = make(extra={"yield_to_forward": value})
    worker = sim.workers[0]
    assert (worker.pacer is not None) is paced
    assert worker.engine.pacer is worker.pacer
    if paced:
        sim.add("a", list(range(1, 4 * sim.block_size + 2)))
        sim.run()
        assert worker.pacer.counters.forwards >= 2     # every step announced its forward
        assert not worker.pacer.forward_running         # and its end
        worker.shutdown()
        worker.pacer.forward_started()                  # after shutdown nothing waits
        assert worker.pacer.wait() == 0.0


@pytest.mark.parametrize("extra", [
    pytest.param({"tiers": {"G2": {"blocks": 8}, "G4": {"blocks": 8}}}, id="G4"),
    pytest.param({"tiers": "G2=8,G4=8"}, id="G4-flag"),
    pytest.param({"tiers": {"G3": {"blocks": 8}}}, id="G3-without-G2"),
    pytest.param({"tiers": {"G2": {"blocks": 8}}, "events": "bogus:xyz"}, id="unknown-sink"),
    pytest.param({"tiers": {"G2": {"blocks": 10 ** 13}}}, id="G2-of-10^13-blocks"),
    pytest.param({"tiers": {"G2": {"blocks": 8},
                            "G4": {"blocks": 2 ** 31, "url": "http://127.0.0.1:9/bucket"}}},
                 id="G4-catalog-past-int32-slot-ids"),
    pytest.param({"tiers": {"G2": {"blocks": 8}, "G3": {"blocks": 8, "path": 5}}},
                 id="G3-path-not-a-string"),
])
def test_config_the_connector_cannot_run_is_refused_by_the_parser(extra, tmp_path):
    """Was a bug, fixed in 8798475. settings_from accepts these; the connector then fails
    later, with another exception type: G4 and G3-without-G2 with ManagerConfigError in
    the worker's register_kv_caches (after vLLM loaded the model), an unknown event sink
    with SinkSpecError in the scheduler half, a G2 no machine holds with MemoryError when
    the scheduler half builds its pool (or the OOM killer), a non-string G3 path with a
    TypeError. Each must be a ConnectorConfigError from the parser, before anything is
    allocated."""
    with pytest.raises(ConnectorConfigError):
        settings_from(extra, GEOMETRY, env={})


def test_extra_config_g3_path_wins_over_the_environment(tmp_path):
    """Was a bug, fixed in 8798475 (minor). docs/vllm.md: "the extra config wins over"
    kvstrata's environment variables; a G3 ``path`` given in the extra config loses to
    KVSTRATA_DISK_DIR (the storages take disk_dir first, and settings_from copies the
    env's disk_dir)."""
    mine, env_dir = str(tmp_path / "mine"), str(tmp_path / "env")
    settings = settings_from({"tiers": {"G2": {"blocks": 8}, "G3": {"blocks": 8, "path": mine}}},
                             GEOMETRY, env={"KVSTRATA_DISK_DIR": env_dir})
    kv = settings.kv
    assert kv.directory_of("G3") == mine


def fail_first_block_of(sim: HostileSim, path: str) -> None:
    """Make every ``path`` copy fail its first block (an I/O error), on every rank."""
    from kvstrata.protocol.results import BlockFailure, FailureKind

    for worker in sim.workers:
        handlers = worker.engine._handlers
        real = handlers[path]

        def failing(plan, src, dst, failures, checksums, real=real):
            real(plan, src, dst, failures, checksums)
            failures[0] = BlockFailure(0, plan.dst_block_ids[0], FailureKind.IO_ERROR,
                                       "injected")

        handlers[path] = failing


def test_load_failing_at_its_first_block_no_copy_reads_the_blocks_vllm_frees(make):
    """Was a bug, fixed in 8798475; second path to the same root cause: when a load's first
    block fails and vLLM had no local hit, vLLM frees all the request's blocks
    (_update_waiting_for_remote_kv) and starts over; the blocks after it that did arrive
    from G3 are being copied G1 -> G2."""
    sim = make(g2_blocks=8, g3_blocks=64)
    tokens = prompt(63, 6 * BS + 1)
    push_out_of_g2(sim, tokens, 2, seed=90)
    fail_first_block_of(sim, "G3->G1")
    request = sim.add("b", tokens + [5])
    sim.step()
    assert request.state == "loading"
    step_until(sim, lambda: request.state != "loading")
    assert sim.last_freed, "vLLM freed the request's blocks"
    assert not sim.last_freed & sim.scheduler.planner.engine_blocks_in_use(), \
        "a copy planned after the load still reads the blocks vLLM just freed"
    sim.run()
    assert_idle(sim)


# -- regression tests: vLLM inputs that must (and do) work -----------------------------------

def check_blocks(sim: SimEngine, request, nblocks: int) -> None:
    """The first ``nblocks`` blocks of ``request`` hold the KV of its tokens (every rank)."""
    hashes = _hashes(sim, request.all_token_ids)
    for rank, layers in enumerate(sim.kv):
        for b in range(nblocks):
            for layer in range(LAYERS):
                assert torch.equal(layers[layer][request.block_ids[b]],
                                   block_kv(hashes[b], layer, rank, BS)), (rank, b, layer)


def all_blocks_free(sim: HostileSim, g1_blocks: int = 64) -> None:
    assert sorted(sim.free) == list(range(1, g1_blocks)), "vLLM blocks leaked"


def finish_load(sim: HostileSim, request, blocks: int) -> None:
    """Step until ``request``'s load is done, check its first ``blocks`` blocks byte for
    byte, run to the end and check nothing is left held or leaked."""
    step_until(sim, lambda: request.state == "running")
    assert not sim.invalid_seen
    check_blocks(sim, request, blocks)
    sim.run()
    assert_idle(sim)
    all_blocks_free(sim)


def test_abort_in_every_state_leaks_nothing(make, monkeypatch):
    sim = make()
    stored = prompt(110, 5 * BS + 1)
    sim.add("seed", stored)
    sim.run()
    # 1. waiting, never allocated (vLLM still calls request_finished, with no blocks)
    waiting = sim.add("w", stored + [1])
    assert sim.scheduler.get_num_new_matched_tokens(waiting, 0)[0] == 5 * BS
    sim.requests.pop("w")
    assert sim.scheduler.request_finished(waiting, []) is False
    # 2. loading from G2
    loading = sim.add("l", stored + [2])
    sim.step()
    assert loading.state == "loading"
    assert sim.abort("l") is False
    # 3. load finished, not scheduled yet
    loaded = sim.add("f", stored + [3])
    step_until(sim, lambda: loaded.state == "running")
    sim.abort("f")
    # 4. running with its stores in flight: held, its blocks untouched until released
    worker = sim.workers[0]
    real_save = worker.save
    monkeypatch.setattr(worker, "save", lambda: None)          # stores never start
    running = sim.add("r", prompt(111, 4 * BS + 1), max_new=8)
    sim.step()
    blocks = set(running.block_ids)
    assert sim.abort("r") is True
    for _ in range(3):
        sim.step()
        assert blocks.isdisjoint(sim.free), "a held request's blocks were reused"
    monkeypatch.setattr(worker, "save", real_save)
    # 5. decoding, stores done: freed at once
    decoding = sim.add("d", prompt(112, 2 * BS + 1), max_new=8)
    for _ in range(4):
        sim.step()
        time.sleep(0.01)
    assert decoding.state == "running"
    sim.run()                                 # (abort after its stores are done)
    assert "r" in sim.finished and blocks <= set(sim.free)
    sim.add("d2", prompt(113, 2 * BS + 1), max_new=8)
    sim.step()
    time.sleep(0.05)
    sim.step()
    sim.abort("d2")
    sim.requests.pop("d", None)
    sim.run()
    assert_idle(sim)


def test_chunked_prefill_stores_every_block_byte_exact(make):
    sim = make(budget=BS + 1)                  # chunks end mid-block
    tokens = prompt(120, 7 * BS + 2)
    request = sim.add("a", tokens, max_new=2)
    sim.step()
    assert request.num_computed_tokens == BS + 1 and request.num_tokens == len(tokens)
    sim.run()
    assert sim.scheduler.counters.blocks_offered >= 7
    sim.budget = None
    check_load(sim, "b", tokens + [1], expect_blocks=7)
    assert_idle(sim)


def test_prompt_shorter_than_a_block_then_generated_blocks_are_stored(make):
    sim = make()
    request = sim.add("a", [11, 12, 13], max_new=3 * BS)
    sim.run()
    assert request.num_tokens >= 3 * BS
    # the conversation returns with the answer in its prompt: blocks of generated tokens load
    check_load(sim, "b", list(request.all_token_ids) + [7], expect_blocks=3)
    assert_idle(sim)


@pytest.mark.parametrize("extra_tokens", [1, BS])
def test_max_tokens_1_with_a_load_of_all_but_the_last_token(make, extra_tokens):
    sim = make()
    tokens = prompt(130, 6 * BS)
    sim.add("a", tokens, max_new=1)
    sim.run()
    returning = tokens + prompt(131, extra_tokens)[:extra_tokens] if extra_tokens > 1 \
        else tokens + [9]
    request = sim.add("b", returning, max_new=1)
    n, is_async = sim.scheduler.get_num_new_matched_tokens(request, 0)
    assert (n, is_async) == (6 * BS, True) and n < len(returning)
    sim.requests.pop("b")
    sim.scheduler.request_finished(request, [])
    check_load(sim, "c", returning, expect_blocks=6, max_new=1)
    assert sim.finished["c"].generated == 1
    assert_idle(sim)
    all_blocks_free(sim)


def test_load_after_vllms_own_prefix_cache_hit_fills_the_right_blocks(make):
    """vLLM already has the first 2 blocks (its own prefix cache): the connector loads the
    next ones into the blocks after them."""
    sim = make()
    tokens = prompt(140, 6 * BS + 1)
    sim.add("a", tokens)
    sim.run()
    request = sim.add("b", tokens + [4])
    hashes = _hashes(sim, request.all_token_ids)
    n, is_async = sim.scheduler.get_num_new_matched_tokens(request, 2 * BS)
    assert (n, is_async) == (4 * BS, True)
    request.block_ids = sim._allocate(-(-request.num_tokens // BS))
    for rank, layers in enumerate(sim.kv):          # vLLM's cached blocks hold their KV
        for b in range(2):
            for layer, tensor in enumerate(layers):
                tensor[request.block_ids[b]] = block_kv(hashes[b], layer, rank, BS)
    sim.scheduler.update_state_after_alloc(request, (list(request.block_ids),), n)
    request.loaded = 6
    request.state = "loading"
    request.num_computed_tokens = 2 * BS + n
    finish_load(sim, request, 6)


def test_preempted_request_resumes_from_its_own_stored_blocks(make):
    sim = make()
    request = sim.add("a", prompt(150, 3 * BS + 1), max_new=3 * BS)
    for _ in range(2 * BS):
        sim.step()
        time.sleep(0.002)
    computed_blocks = request.num_computed_tokens // BS
    assert computed_blocks >= 4
    sim.preempt("a")                                 # blocks freed and overwritten
    parked = sim.requests.pop("a")                   # not rescheduled in the same step
    sim.step()                                       # (flush, then the scribble)
    sim.requests["a"] = parked
    step_until(sim, lambda: request.state == "running")
    # every block whose store had come back (the last step's may still be in flight)
    assert request.loaded >= computed_blocks - 1
    assert not sim.invalid_seen
    check_blocks(sim, request, request.loaded)
    sim.run()
    assert_idle(sim)
    all_blocks_free(sim)


def test_fewer_tokens_accepted_than_offered(make):
    """vLLM may take fewer external tokens than offered (it trims a hit for its own prefix
    replay, for instance): only those blocks are loaded, the rest released."""
    sim = make()
    tokens = prompt(160, 6 * BS + 1)
    sim.add("a", tokens)
    sim.run()
    request = sim.add("b", tokens + [1])
    n, _ = sim.scheduler.get_num_new_matched_tokens(request, 0)
    request.block_ids = sim._allocate(-(-request.num_tokens // BS))
    sim.scheduler.update_state_after_alloc(request, (list(request.block_ids),), n - 2 * BS)
    request.loaded, request.state = 4, "loading"
    request.num_computed_tokens = n - 2 * BS
    finish_load(sim, request, 4)


def test_blocks_of_a_preempted_request_go_to_a_load_after_the_flush(make):
    """A preempted request's blocks (stores still reading them) are scribbled over by the next
    forward and then handed to a request with a load: the stores were flushed first (G2 keeps
    the right KV) and the load fills the reused blocks byte-exact. (vLLM schedules no waiting
    request in the step that preempted: modelled by parking the preempted one.)"""
    sim = make(g2_blocks=32)
    tokens = prompt(170, 5 * BS + 1)
    sim.add("a0", tokens)
    sim.run()
    restore = slow_path(sim.workers[0], "G1->G2", 0.2)
    other = prompt(171, 5 * BS + 1)
    preempted = sim.add("a", other, max_new=6)
    sim.step()
    freed = list(preempted.block_ids)
    sim.preempt("a")
    parked = sim.requests.pop("a")
    sim.step()                                  # flush, then the forward scribbles
    restore()
    request = sim.add("b", tokens + [3])
    sim.requests["a"] = parked
    step_until(sim, lambda: request.state == "running")
    assert set(request.block_ids) & set(freed)
    assert not sim.invalid_seen
    check_blocks(sim, request, 5)
    sim.run()
    check_load(sim, "c", other + [5], expect_blocks=5)
    assert_idle(sim)


def test_stores_a_flush_gave_up_on_fail_and_g2_never_serves_what_the_forward_wrote(
        make, monkeypatch):
    """The flush before a forward that overwrites a preempted request's blocks waits at most
    FLUSH_TIMEOUT (shortened here, a store made slower than it): a store it gave up on read
    the forward's KV, and it was registered in G2 and served to every later request."""
    import kvstrata.connectors.vllm.worker as worker_module

    monkeypatch.setattr(worker_module, "FLUSH_TIMEOUT", 0.2)
    sim = make(g2_blocks=32, g3_blocks=0)
    restore = slow_path(sim.workers[0], "G1->G2", 1.0)
    tokens = prompt(172, 5 * BS + 1)
    sim.add("a", tokens, max_new=6)
    sim.step()                                  # a's stores start after its forward
    sim.preempt("a")
    parked = sim.requests.pop("a")
    sim.step()                                  # the flush gives up; the forward scribbles
    time.sleep(1.5)                             # the stores finish, with the forward's KV
    restore()
    sim.run()
    g2 = sim.scheduler.planner.pools["G2"]
    assert not any(h in g2 for h in _hashes(sim, tokens))     # failed: not registered
    storage = sim.workers[0].storages.by_tier["G2"]           # nor leased to a peer
    held = storage.pin_held(_hashes(sim, tokens))
    storage.unpin([slot for _, slot, _ in held])
    assert held == []
    sim.requests["a"] = parked
    request = sim.add("b", tokens + [9])
    step_until(sim, lambda: request.state == "running")
    assert not sim.invalid_seen
    check_blocks(sim, request, request.loaded)
    sim.run()
    assert_idle(sim)


def test_two_ranks_abort_while_loading_and_a_failure_on_one_rank(make):
    from kvstrata.protocol.results import BlockFailure, FailureKind

    sim = make(ranks=2)
    tokens = prompt(180, 5 * BS + 1)
    sim.add("a", tokens)
    sim.run()
    request = sim.add("b", tokens + [1])
    sim.step()
    assert request.state == "loading"
    sim.abort("b")
    sim.run()
    handlers = sim.workers[1].engine._handlers
    real = handlers["G2->G1"]

    def third_fails(plan, src, dst, failures, checksums):
        real(plan, src, dst, failures, checksums)
        failures[2] = BlockFailure(2, plan.dst_block_ids[2], FailureKind.IO_ERROR, "rank 1")

    handlers["G2->G1"] = third_fails
    request = sim.add("c", tokens + [2])
    step_until(sim, lambda: request.state == "running")
    assert request.num_computed_tokens == 2 * BS          # recomputed from the failed block
    handlers["G2->G1"] = real
    sim.run()
    assert_idle(sim)
    all_blocks_free(sim)


# -- requests and models whose token ids do not name their KV --------------------------------

def test_mixed_token_and_embedding_prompts_never_share_kv(make):
    """Was a bug, fixed in 8798475. vLLM's mixed-mode prompts (chat completions with
    prompt_embeds) have prompt_token_ids *and* prompt_embeds; vLLM zeroes the embedded
    positions in all_token_ids (vllm/v1/request.py) and folds the embeddings into its own
    block hashes. The connector only skips requests whose prompt_token_ids is None, so
    two prompts that differ only in their embeddings hash alike, and the second is handed
    the first one's KV."""
    sim = make()
    tokens = prompt(190, 5 * BS + 1)
    is_token = [not (BS <= i < 2 * BS) for i in range(len(tokens))]     # block 1 embedded
    zeroed = [t if ok else 0 for t, ok in zip(tokens, is_token)]
    first = sim.add("a", zeroed)
    first.prompt_token_ids = list(tokens)
    first.prompt_embeds = torch.randn(len(tokens), 8)
    first.prompt_is_token_ids = is_token
    sim.run()
    second = sim.add("b", zeroed)
    second.prompt_token_ids = list(tokens)
    second.prompt_embeds = torch.randn(len(tokens), 8)                 # other embeddings
    second.prompt_is_token_ids = is_token
    n, _ = sim.scheduler.get_num_new_matched_tokens(second, 0)
    assert n <= BS, f"{n // BS} blocks of another prompt's KV offered (embedded block 1 on)"
    sim.requests.pop("b")
    sim.scheduler.request_finished(second, [])
    assert_idle(sim)


def _one_group_config(spec):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    return KVCacheConfig(num_blocks=32, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(["l0", "l1"], spec)])


@pytest.mark.parametrize("kind,named", [
    ("chunked_local", "ChunkedLocalAttentionSpec"),
    ("mamba_none", "Mamba state in vLLM's 'none' cache mode"),
    ("mamba_speculative", "with speculative or checkpoint blocks"),
    ("mamba_alone", "not a model without attention")])
def test_a_kv_group_the_connector_does_not_hold_is_refused_by_name(kind, named):
    """Was a bug, fixed in 8798475 (then for sliding-window groups too, which are held since
    issue 26). Chunked-local attention, a Mamba state outside vLLM's align mode (its blocks
    are not states at block boundaries) or with speculative blocks, and a model of Mamba
    layers only are refused at start, named, never run with blocks the connector cannot
    place."""
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, MambaSpec

    common = dict(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
    mamba = dict(block_size=16, shapes=((3, 8),), dtypes=(torch.bfloat16,))
    spec = {"chunked_local": lambda: ChunkedLocalAttentionSpec(attention_chunk_size=64,
                                                               **common),
            "mamba_none": lambda: MambaSpec(**mamba),
            "mamba_speculative": lambda: MambaSpec(**mamba, mamba_cache_mode="align",
                                                   num_speculative_blocks=2),
            "mamba_alone": lambda: MambaSpec(**mamba, mamba_cache_mode="align")}[kind]()
    with pytest.raises(ConnectorConfigError, match=named):
        KvGeometry.from_vllm(_one_group_config(spec))


def test_a_model_of_sliding_window_layers_only_is_held_as_one_windowed_group():
    """A model whose layers all use a sliding window (Mistral-7B-v0.1) has one group of that
    spec: held, its loads limited to the window (issue 26)."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    spec = SlidingWindowSpec(sliding_window=64, block_size=16, num_kv_heads=2, head_size=8,
                             dtype=torch.bfloat16)
    geometry = KvGeometry.from_vllm(_one_group_config(spec))
    assert geometry.groups.groups == (KvGroup(0, SLIDING, 64),)


def test_full_attention_geometry_is_read_from_vllms_spec():
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    geometry = KvGeometry.from_vllm(_one_group_config(FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)))
    assert geometry == KvGeometry(16, 2, 2, 8, "bfloat16", 32)


# -- parallel layouts ----------------------------------------------------------------------

def test_pipeline_stages_do_not_collide_on_one_rank_number(make):
    """Was a bug, fixed in 8798475. The scheduler half waits for
    ``parallel_config.world_size`` results per plan (tensor x pipeline x prefill-context
    parallel), but each worker names itself by its *tensor-parallel* rank
    (connector._tensor_parallel_rank). With two pipeline stages (TP=1) both workers
    report rank 0: RankResults keeps one result per rank, never reaches two, and no plan
    ever completes: held requests are never released, the engine never idles. (Modelled
    with the simulator's two workers both numbered 0.)"""
    sim = make(ranks=2)
    sim.workers[1].rank = 0                     # pipeline stage 1, tensor-parallel rank 0
    sim.add("a", prompt(200, 3 * BS + 1), max_new=1)
    sim.run(timeout=3)
    assert_idle(sim)


def test_repeated_lookups_without_allocation_then_abort(make):
    """vLLM asks again each step while it cannot allocate; the last answer is the one used."""
    sim = make()
    tokens = prompt(210, 4 * BS + 1)
    sim.add("a", tokens)
    sim.run()
    request = sim.add("b", tokens + [1])
    for _ in range(3):
        assert sim.scheduler.get_num_new_matched_tokens(request, 0) == (4 * BS, True)
    assert sim.scheduler.get_num_new_matched_tokens(request, BS) == (3 * BS, True)
    sim.requests.pop("b")
    assert sim.scheduler.request_finished(request, []) is False
    assert_idle(sim)


# -- found in the fixes (commit 8798475) -----------------------------------------------------

def test_a_hybrid_model_vllm_promoted_to_full_attention_is_accepted():
    """BUG (regression of the full-attention check). kvstrata's connector is not SupportsHMA,
    so vLLM turns the hybrid KV cache manager off and promotes the sliding-window layers of a
    hybrid model (Gemma 2/3, gpt-oss: sliding-window and full layers) to FullAttentionSpec,
    keeping ``sliding_window`` on the spec; vLLM then manages them as full attention ("Promoted
    specs allocate blocks for all tokens and never free below the window",
    kv_cache_utils._promote_local_kv_cache_specs). The check refuses that spec because its
    ``sliding_window`` is set, with a message that contradicts itself ("needs full
    attention ...; this model's KV cache is FullAttentionSpec")."""
    from vllm.v1.core.kv_cache_utils import unify_hybrid_kv_cache_specs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    common = dict(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
    specs = {"l0": SlidingWindowSpec(sliding_window=64, **common),
             "l1": FullAttentionSpec(**common)}
    unify_hybrid_kv_cache_specs(specs)                 # what vLLM does with HMA off
    merged = FullAttentionSpec.merge(list(specs.values()))
    assert type(merged) is FullAttentionSpec and merged.sliding_window == 64
    assert KvGeometry.from_vllm(_one_group_config(merged)).num_layers == 2


def test_a_path_on_the_host_tier_does_not_drop_disk_dir(tmp_path):
    """BUG (minor, from the path-precedence fix): any tier's ``path`` in the extra config
    now clears disk_dir, even a path on G2 (which has no directory): G3 then goes to a fresh
    temporary directory instead of the disk_dir the same config names."""
    settings = settings_from({"tiers": {"G2": {"blocks": 8, "path": str(tmp_path / "x")},
                                        "G3": {"blocks": 8}},
                              "disk_dir": str(tmp_path / "nvme")}, GEOMETRY, env={})
    kv = settings.kv
    assert kv.directory_of("G3") == str(tmp_path / "nvme")


def test_a_disk_tier_larger_than_its_filesystem_is_a_config_error(tmp_path):
    """BUG. G3 is not checked against the disk (only host tiers against RAM): a G3 of 900 TiB
    passes the parser, then the scheduler half builds a pool of ~2e12 blocks (MemoryError,
    or the OOM killer) and the worker's slab creation fails with ManagerConfigError after
    vLLM loaded the model."""
    with pytest.raises(ConnectorConfigError):
        settings_from({"tiers": {"G2": {"blocks": 8}, "G3": {"bytes": "900TiB"}},
                       "disk_dir": str(tmp_path)}, GEOMETRY, env={})
