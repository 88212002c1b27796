"""Tenant quotas through a real vLLM engine (CPU build, a random-weight Llama made locally):
requests name their tenant with vLLM's ``cache_salt``; one tenant hammering G2 with new
prompts evicts only its own blocks while another keeps its quota's worth of hits; an
unlimited tenant hammering does evict everyone (the control); no hit crosses tenants."""

from __future__ import annotations

import pytest

from .conftest import shutdown_engine
from .test_vllm_engine import (BLOCK, _engine, _half, _tokens, _wait_idle,  # noqa: F401
                               model_dir)

pytest.importorskip("vllm")

pytestmark = [pytest.mark.slow, pytest.mark.integration]

G2_BLOCKS = 24
PROMPT = 300                        # 9 full blocks of 32 tokens


@pytest.fixture(scope="module")
def llm(in_process_vllm, model_dir):
    config = {"kv_connector": "KvStrataConnector",
              "kv_connector_module_path": "kvstrata.connectors.vllm",
              "kv_role": "kv_both",
              "kv_connector_extra_config": {
                  "tiers": {"G2": {"blocks": G2_BLOCKS}},
                  # salt "busy" may hold half of G2; tenants the config does not name are not
                  # limited (no tier tenant_quota): the control below is one of them
                  "tenant_quotas": {"salt:busy": {"G2": "50%"}},
                  "cost_aware": False,            # these tests are about what is held
              }}
    engine = _engine(model_dir, config)
    yield engine
    shutdown_engine(engine)


def _ask(llm, prompt: list[int], salt: str) -> int:
    """Prompt tokens of ``prompt`` (as tenant ``salt``) that came from a cache: vLLM's own
    is emptied first, so they came from kvstrata."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    assert llm.reset_prefix_cache()
    sp = SamplingParams(max_tokens=2, temperature=0, detokenize=False)
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt, cache_salt=salt)], sp,
                          use_tqdm=False)
    _wait_idle(_half(llm), llm=llm)
    return out.num_cached_tokens


def test_a_hammering_tenant_at_its_quota_leaves_the_others_their_hits(llm):
    half = _half(llm)
    held = (PROMPT - 1) // BLOCK * BLOCK
    quiet = _tokens(1000, PROMPT)
    assert _ask(llm, quiet, "quiet") == 0
    assert _ask(llm, quiet, "busy") == 0            # the same tokens, another tenant: no hit
    for i in range(6):                              # 6 x 9 blocks into a 24-block G2
        _ask(llm, _tokens(2000 + i, PROMPT), "busy")
    ledger = half.planner.tenants
    assert ledger.usage()["G2"]["salt:busy"] <= G2_BLOCKS // 2
    assert ledger.evicted["G2", "salt:busy"] > 0
    assert half.counters.tenant_blocks_evicted["G2:salt:busy"] == \
        ledger.evicted["G2", "salt:busy"]
    connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    connector.get_kv_connector_stats()              # what vLLM's next step would report
    assert connector._tenant_blocks_sent == {f"G2:{label}": n for (_, label), n
                                             in ledger.held.items()}
    assert set(connector._tenant_blocks_sent) == {"G2:salt:busy", "G2:*"}
    assert _ask(llm, quiet, "quiet") == held        # every block still in G2
    assert half.counters.tenant_tokens_matched["*"] >= held

    # the control: a tenant the config does not limit takes G2 from everyone
    other = _tokens(3000, PROMPT)
    assert _ask(llm, other, "quiet2") == 0
    for i in range(6):
        _ask(llm, _tokens(4000 + i, PROMPT), "noisy")
    assert _ask(llm, other, "quiet2") == 0
