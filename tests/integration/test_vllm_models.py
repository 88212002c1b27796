"""kvstrata's connector in a real vLLM engine for attention types other than plain full
attention (issue 26): a Gemma-3-style model (sliding-window layers with a window smaller than
the prompts, and a full-attention layer; vLLM's hybrid KV cache manager on, four KV cache
groups), a DeepSeek-V2-style model (MLA) and a Qwen3-Next-style one (linear-attention layers,
whose recurrent state vLLM keeps as a Mamba group in its "align" mode, beside full attention). For each, random weights made locally, greedy
outputs compared token for token with vLLM's without a connector, cold and returning, with the
returning prefix served from G2 and, after G2 was refilled with other prompts, from G3.

vLLM's CPU build cannot attend to a cached prefix of an MLA model (its CPU MLA prefill sees the
new tokens only; it turns its own prefix caching off): there the connector stores the latent
KV but loads none, and the outputs stay vLLM's. MLA's bytes through every load path are
checked in tests/connectors/vllm/test_groups.py.

One engine per architecture (module scope); the engine core runs in this process so the tests
read the connector's scheduler half, as in test_vllm_engine.py.
"""

from __future__ import annotations

import random
import time

import pytest

from .conftest import shutdown_engine

pytest.importorskip("vllm")

pytestmark = [pytest.mark.slow, pytest.mark.integration]

BLOCK = {"gemma3": 32, "deepseek_v2": 16, "qwen3_next": None}
"""vLLM's CPU build: sliding-window attention needs a multiple of 32; MLA keeps 16; with a
Mamba state vLLM picks it (an attention page at least as large as the state: 128 here)."""
G2_BLOCKS = {"gemma3": 48, "deepseek_v2": 48, "qwen3_next": 8}
"""About one prompt's blocks of every group: the fillers push a conversation down to G3."""
WINDOW = 64


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


PROMPTS = {"turn_1": _tokens(1, 300), "other": _tokens(2, 230)}
PROMPTS["turn_2"] = PROMPTS["turn_1"] + _tokens(3, 16) + _tokens(4, 90)
PROMPTS["turn_3"] = PROMPTS["turn_2"] + _tokens(5, 16) + _tokens(6, 70)
PROMPTS["system_user_a"] = PROMPTS["other"][:160] + _tokens(7, 50)
for i in range(3):
    PROMPTS[f"filler_{i}"] = _tokens(400 + i, 300)


def _engine(model_dir: str, arch: str, kv_transfer_config: dict | None, **kw):
    from vllm import LLM

    if BLOCK[arch]:
        kw["block_size"] = BLOCK[arch]
    return LLM(model=model_dir, skip_tokenizer_init=True, enforce_eager=True,
               max_model_len=1024, dtype="bfloat16", max_num_seqs=8,
               num_gpu_blocks_override=512, kv_transfer_config=kv_transfer_config, seed=0,
               **kw)


def _half(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler


def _generate(llm, prompt: list[int], max_tokens: int = 12) -> tuple[list[int], int]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm.reset_prefix_cache()              # vLLM's own cache emptied, kvstrata's kept
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, detokenize=False)
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)
    half = _half(llm) if llm.llm_engine.vllm_config.kv_transfer_config else None
    deadline = time.monotonic() + 60
    while half is not None and not half.idle and time.monotonic() < deadline:
        llm.llm_engine.step()             # nobody else steps the in-process engine
        time.sleep(0.01)
    return list(out.outputs[0].token_ids), out.num_cached_tokens


@pytest.fixture(scope="module", params=["gemma3", "deepseek_v2", "qwen3_next"])
def model(request, in_process_vllm, tmp_path_factory):
    from kvstrata.testing.random_model import ModelShape, make_random_model

    arch = request.param
    # Qwen3-Next: heads of 64 so that vLLM's attention block (>= the state's page) stays
    # well under the prompts' length
    shape = ModelShape(num_layers=4, hidden_size=256 if arch == "qwen3_next" else 128,
                       num_heads=4, num_kv_heads=4 if arch == "qwen3_next" else 2,
                       intermediate_size=256, sliding_window=WINDOW)
    path = str(make_random_model(tmp_path_factory.mktemp(arch), shape, arch))
    llm = _engine(path, arch, None)
    reference = {name: _generate(llm, p)[0] for name, p in PROMPTS.items()}
    shutdown_engine(llm)
    g3_dir = tmp_path_factory.mktemp(f"g3-{arch}")
    config = {"kv_connector": "KvStrataConnector",
              "kv_connector_module_path": "kvstrata.connectors.vllm",
              "kv_role": "kv_both",
              "kv_connector_extra_config": {
                  # G2 holds about one prompt's blocks of every group: the fillers push a
                  # conversation's blocks down to G3
                  "tiers": {"G2": {"blocks": G2_BLOCKS[arch]},
                            "G3": {"blocks": 2048, "path": str(g3_dir)}},
                  "cost_aware": False}}
    llm = _engine(path, arch, config)
    yield arch, llm, reference
    shutdown_engine(llm)


def test_the_connector_holds_every_kv_cache_group_of_the_model(model):
    arch, llm, _ = model
    groups = _half(llm).groups.groups
    if arch == "gemma3":
        kinds = sorted(g.kind for g in groups)
        assert kinds.count("sliding_window") >= 1 and "full_attention" in kinds, groups
        assert all(g.sliding_window == WINDOW for g in groups if g.kind == "sliding_window")
    elif arch == "qwen3_next":
        assert sorted(g.kind for g in groups) == ["full_attention", "mamba"], groups
    else:
        assert [g.kind for g in groups] == ["mla_attention"]
        assert _half(llm).settings.kv.model.outer_dim == 1


def full_blocks(tokens: int, block_size: int) -> int:
    """Tokens of the full blocks before the last of ``tokens`` (what a hit can cover)."""
    return (tokens - 1) // block_size * block_size


def loads_here(arch: str) -> bool:
    """Whether vLLM's build here can use a loaded prefix of ``arch`` (see the docstring)."""
    from vllm.platforms import current_platform

    return not (arch == "deepseek_v2" and current_platform.is_cpu())


def test_returning_turns_come_back_with_the_outputs_of_vllm_without_a_connector(model):
    arch, llm, reference = model
    half = _half(llm)
    assert half.settings.load is loads_here(arch)
    for name in ("turn_1", "turn_2", "turn_3"):
        before = dict(half.counters.blocks_loaded)
        tokens, cached = _generate(llm, PROMPTS[name])
        assert tokens == reference[name], (arch, name)
        loaded = sum(half.counters.blocks_loaded.values()) - sum(before.values())
        if name != "turn_1" and loads_here(arch):
            assert cached >= full_blocks(len(PROMPTS["turn_1"]), half.block_size)
            assert loaded > 0, (arch, name, half.counters.as_dict())
    assert half.counters.blocks_offered >= len(PROMPTS["turn_3"]) // half.block_size
    assert half.counters.blocks_load_failed == 0


def test_a_shared_prefix_ending_mid_prompt_loads_its_window_and_matches(model):
    """The hit ends inside an earlier prompt: a sliding-window group needs the blocks of the
    window at that point, which were stored as the earlier prompt ran."""
    arch, llm, reference = model
    _generate(llm, PROMPTS["other"])
    tokens, cached = _generate(llm, PROMPTS["system_user_a"])
    assert tokens == reference["system_user_a"]
    if loads_here(arch):
        assert cached >= full_blocks(160, _half(llm).block_size)


def test_with_g2_refilled_the_prefix_comes_back_from_g3_with_the_same_outputs(model):
    arch, llm, reference = model
    half = _half(llm)
    _generate(llm, PROMPTS["turn_1"])
    for i in range(3):
        assert _generate(llm, PROMPTS[f"filler_{i}"])[0] == reference[f"filler_{i}"]
    assert half.status()["pools"]["G3"]["inactive"] > 0, "blocks went down to G3"
    before = half.counters.blocks_loaded.get("G3", 0)
    tokens, cached = _generate(llm, PROMPTS["turn_1"])
    assert tokens == reference["turn_1"]
    if loads_here(arch):
        assert half.counters.blocks_loaded.get("G3", 0) > before, half.counters.as_dict()
        assert cached > 0
