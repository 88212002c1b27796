"""kvstrata's connector inside a real vLLM engine (vLLM's CPU build, a random-weight Llama made
locally): returning prefixes come back from G2 and G3 after vLLM's own prefix cache is
emptied, greedy outputs equal vLLM's without the connector, a corrupt G3 becomes a load error
and a recompute, and many requests under a small KV cache (preemptions) and aborts leave
every kvstrata pool idle.

One engine per module (engine start is ~25 s on two cores); the engine core runs in this
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the tests can read the connector's
scheduler half; the model runs in vLLM's worker process, with the connector's worker half.
"""

from __future__ import annotations

import random
import time

import pytest

from .conftest import shutdown_engine

pytest.importorskip("vllm")

pytestmark = [pytest.mark.slow, pytest.mark.integration]

BLOCK = 32
G1_BLOCKS = 96                      # small on purpose: many requests preempt each other


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from kvstrata.testing.random_model import TINY, make_random_llama

    return str(make_random_llama(tmp_path_factory.mktemp("model"), TINY))


def _engine(model_dir: str, kv_transfer_config: dict | None, **kw):
    from vllm import LLM

    return LLM(model=model_dir, skip_tokenizer_init=True, enforce_eager=True,
               block_size=BLOCK, max_model_len=2048, dtype="bfloat16", max_num_seqs=16,
               num_gpu_blocks_override=G1_BLOCKS, kv_transfer_config=kv_transfer_config,
               seed=0, **kw)


PROMPTS = {
    "multi_turn_1": _tokens(1, 300),
    "shared": _tokens(2, 200),
    "corrupt": _tokens(3, 260),
}


@pytest.fixture(scope="module")
def reference(in_process_vllm, model_dir):
    """Greedy outputs of vLLM without any connector, for every prompt the tests send."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = _engine(model_dir, None)
    prompts = _all_prompts()
    sp = SamplingParams(max_tokens=16, temperature=0, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts.values()], sp)
    ref = {name: list(o.outputs[0].token_ids) for name, o in zip(prompts, outs)}
    shutdown_engine(llm)
    return ref


def _all_prompts() -> dict[str, list[int]]:
    out = dict(PROMPTS)
    # a conversation whose turns extend the previous prompt (answers are fixed tokens)
    turn = PROMPTS["multi_turn_1"]
    for i in range(2, 4):
        turn = turn + _tokens(100 + i, 16) + _tokens(200 + i, 90)
        out[f"multi_turn_{i}"] = turn
    system = PROMPTS["shared"]
    for i in range(3):
        out[f"shared_user_{i}"] = system + _tokens(300 + i, 40 + 7 * i)
    for i in range(4):
        out[f"filler_{i}"] = _tokens(400 + i, 330)
    return out


@pytest.fixture(scope="module")
def engine(in_process_vllm, model_dir, reference, tmp_path_factory):
    from vllm.config import KVEventsConfig

    g3_dir = tmp_path_factory.mktemp("g3")
    EVENTS["jsonl"] = str(tmp_path_factory.mktemp("events") / "kvstrata.jsonl")
    EVENTS["endpoint"] = endpoint = f"ipc://{tmp_path_factory.mktemp('zmq')}/kv-events.sock"
    config = {"kv_connector": "KvStrataConnector",
              "kv_connector_module_path": "kvstrata.connectors.vllm",
              "kv_role": "kv_both",
              "kv_connector_extra_config": {
                  # G2 holds ~1.5 prompts of these sizes: older blocks live in G3 only
                  "tiers": {"G2": {"blocks": 16}, "G3": {"blocks": 512, "path": str(g3_dir)}},
                  "events": [f"jsonl:{EVENTS['jsonl']}"],
                  # this tiny model prefills so fast that the cost model would rightly
                  # recompute many of these loads; these tests are about the loads
                  "cost_aware": False,
              }}
    llm = _engine(model_dir, config, kv_events_config=KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint))
    yield llm, g3_dir
    shutdown_engine(llm)


EVENTS: dict = {}


def _half(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler


def _generate(llm, prompt: list[int], max_tokens: int = 16, reset: bool = True):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if reset:
        assert llm.reset_prefix_cache()           # vLLM's own cache emptied, kvstrata's kept
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, detokenize=False)
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)
    # The turn's stores land before the next turn (a conversation's pause), whatever the
    # machine's load: the in-process engine is stepped until kvstrata is idle.
    _wait_idle(_half(llm), llm=llm)
    return list(out.outputs[0].token_ids), out.num_cached_tokens


def _wait_idle(half, timeout: float = 30.0, llm=None) -> dict:
    """The engine steps while copies are in flight (has_pending_push_work). Here the engine
    core runs in this process and nobody steps it between ``generate`` calls: step it."""
    deadline = time.monotonic() + timeout
    while not half.idle and time.monotonic() < deadline:
        if llm is not None:
            llm.llm_engine.step()
        time.sleep(0.01)
    status = half.status()
    assert half.idle, status
    for tier, pool in status["pools"].items():
        assert pool["active"] == 0, (tier, pool)
    assert status["tracked"] == 0 and status["held"] == 0 and status["loading"] == 0
    return status


def test_multi_turn_prefixes_come_back_from_g2_with_identical_outputs(engine, reference):
    llm, _ = engine
    half = _half(llm)
    for i in (1, 2, 3):
        prompt = _all_prompts()[f"multi_turn_{i}"]
        before = dict(half.counters.blocks_loaded)
        tokens, cached = _generate(llm, prompt)
        assert tokens == reference[f"multi_turn_{i}"], f"turn {i}"
        if i > 1:                                   # the previous turn's prompt is held
            previous = len(_all_prompts()[f"multi_turn_{i - 1}"]) // BLOCK * BLOCK
            assert cached >= previous, (i, cached, previous)
            loaded = sum(half.counters.blocks_loaded.values()) - sum(before.values())
            assert loaded * BLOCK == cached
        else:
            assert cached == 0
    _wait_idle(half, llm=llm)


def test_returning_prompt_loads_the_same_bytes_from_g2(engine, reference):
    llm, _ = engine
    half = _half(llm)
    prompt = _all_prompts()["shared_user_0"]
    cold, cached = _generate(llm, prompt)
    assert cold == reference["shared_user_0"]
    g2_before = half.counters.blocks_loaded.get("G2", 0)
    warm, cached = _generate(llm, prompt)
    assert warm == cold
    assert cached == (len(prompt) - 1) // BLOCK * BLOCK
    assert half.counters.blocks_loaded.get("G2", 0) - g2_before == cached // BLOCK
    _wait_idle(half, llm=llm)


def test_shared_system_prompt_served_to_other_users(engine, reference):
    llm, _ = engine
    half = _half(llm)
    system_blocks = len(PROMPTS["shared"]) // BLOCK
    for i in (1, 2):
        tokens, cached = _generate(llm, _all_prompts()[f"shared_user_{i}"])
        assert tokens == reference[f"shared_user_{i}"]
        assert cached >= system_blocks * BLOCK
    _wait_idle(half, llm=llm)


def test_with_g2_too_small_the_prefix_comes_from_g3(engine, reference):
    llm, _ = engine
    half = _half(llm)
    prompts = _all_prompts()
    first, _ = _generate(llm, prompts["filler_0"])
    for i in (1, 2, 3):                       # push filler_0 out of the 16-block G2
        _generate(llm, prompts[f"filler_{i}"])
    _wait_idle(half, llm=llm)
    g3_before = half.counters.blocks_loaded.get("G3", 0)
    tokens, cached = _generate(llm, prompts["filler_0"])
    assert tokens == first == reference["filler_0"]
    assert cached == (len(prompts["filler_0"]) - 1) // BLOCK * BLOCK
    assert half.counters.blocks_loaded.get("G3", 0) > g3_before
    _wait_idle(half, llm=llm)


def test_a_corrupt_g3_is_a_load_error_and_vllm_recomputes(engine, reference):
    llm, g3_dir = engine
    half = _half(llm)
    prompts = _all_prompts()
    _generate(llm, prompts["corrupt"])
    for i in (1, 2):
        _generate(llm, prompts[f"filler_{i}"])
    _wait_idle(half, llm=llm)
    (slab,) = g3_dir.glob("kvstrata-g3-r0-*/slab")        # the durable G3's slab
    data = bytearray(slab.read_bytes())
    for i in range(0, len(data), 512):
        data[i] ^= 0xA5
    slab.write_bytes(bytes(data))
    failed_before = half.counters.blocks_load_failed
    tokens, cached = _generate(llm, prompts["corrupt"])
    assert tokens == reference["corrupt"]            # recomputed, never wrong KV
    assert half.counters.blocks_load_failed > failed_before
    status = _wait_idle(half, llm=llm)
    assert status["pools"]["G3"]["inactive"] < 512


def test_many_concurrent_requests_preempted_and_aborted_leave_nothing_behind(engine):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm, _ = engine
    half = _half(llm)
    core = llm.llm_engine
    system = _tokens(7, 96)
    sp = SamplingParams(max_tokens=160, temperature=0, detokenize=False, ignore_eos=True)
    preempted: set[str] = set()
    build = half.build_connector_meta

    def recording(scheduler_output):
        preempted.update(getattr(scheduler_output, "preempted_req_ids", None) or ())
        return build(scheduler_output)

    half.build_connector_meta = recording
    ids = []
    for i in range(12):                    # 12 x ~560 tokens > 96 blocks of 32: preemption
        req_id = f"load-{i}"
        core.add_request(req_id, TokensPrompt(prompt_token_ids=system + _tokens(500 + i, 300)),
                         sp)
        ids.append(req_id)
    finished = set()
    steps = 0
    deadline = time.monotonic() + 240
    while core.has_unfinished_requests() and time.monotonic() < deadline:
        for out in core.step():
            if out.finished:
                finished.add(out.request_id)
        steps += 1
        if steps == 6:
            core.abort_request(ids[::3])          # abort some mid-flight
    del half.build_connector_meta
    assert not core.has_unfinished_requests(), "engine hung"
    aborted = set(ids[::3])
    assert finished | aborted >= set(ids)
    assert preempted, "the small KV cache was meant to force preemptions"
    assert half.counters.blocks_offered > 0
    _wait_idle(half, timeout=60, llm=llm)


def test_tier_events_in_vllms_stream_and_kvstratas_sinks(engine):
    """G2 / G3 changes reach vLLM's own KV event stream (ZMQ, decoded with vLLM's classes)
    with media CPU and STORAGE, and kvstrata's own sink, under router-compatible hashes."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    from kvstrata.events.formats import decode_kvstrata
    from kvstrata.tokens import hash_blocks

    llm, _ = engine
    half = _half(llm)
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(EVENTS["endpoint"])                 # vLLM's PUB binds an ipc:// endpoint
    time.sleep(1.0)                                   # the subscription reaches it
    prompt = _tokens(77, 5 * BLOCK + 3)
    _generate(llm, prompt)
    _generate(llm, _tokens(78, 8))                    # one more step publishes the last batch
    _wait_idle(half, llm=llm)
    _generate(llm, _tokens(79, 8))
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    stored: dict[str, set[int]] = {}
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if not sub.poll(500):
            if stored.get("CPU") and stored.get("STORAGE"):
                break
            continue
        _topic, _seq, payload = sub.recv_multipart()
        for event in decoder.decode(payload).events:
            if isinstance(event, BlockStored):
                stored.setdefault(event.medium, set()).update(event.block_hashes)
    sub.close()
    _, expected = hash_blocks(prompt, BLOCK)
    assert set(expected) <= stored.get("CPU", set()), "G2 stores in vLLM's stream"
    assert set(expected) <= stored.get("STORAGE", set()), "G3 stores in vLLM's stream"
    ours: dict[str, set[int]] = {}
    with open(EVENTS["jsonl"]) as fh:
        for line in fh:
            for event in decode_kvstrata(line).events:
                if hasattr(event, "blocks"):
                    ours.setdefault(event.tier, set()).update(event.block_hashes)
    assert set(expected) <= ours.get("G2", set()) and set(expected) <= ours.get("G3", set())
