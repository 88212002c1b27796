"""An MLA model (DeepSeek-V2-style, random weights) in a real vLLM engine with two
tensor-parallel workers, each its own process: the latent KV is the same on both, so
kvstrata keeps one copy of it in G2 and G3 (rank 0 writes them; rank 1 maps rank 0's G2 from
shared memory and follows rank 0's G3, both read-only).

Shown here with vLLM's own processes: the engine starts (rank 1 waits for, then follows, rank
0's G2 and G3, whichever registers first), one G2 file exists while it runs and none after,
only rank 0's G3 home exists and it holds the prompts' blocks, the outputs are vLLM's without
a connector at the same parallelism, and a restarted engine restores the one copy through
both workers' reports. (vLLM's CPU build loads no MLA
prefix; loads into both ranks are checked in tests/connectors/vllm/test_mla_replicas.py.)
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest

from .conftest import shutdown_engine

pytest.importorskip("vllm")

pytestmark = [pytest.mark.slow, pytest.mark.integration]

BLOCK = 16


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


PROMPTS = [_tokens(1, 300)]
PROMPTS.append(PROMPTS[0] + _tokens(2, 100))


@pytest.fixture
def two_cpus(monkeypatch):
    """vLLM's CPU build binds each worker's threads to its own cores: one core each."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("two tensor-parallel CPU workers need two cores")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{cpus[0]}|{cpus[1]}")


def _engine(model_dir: str, kv_transfer_config: dict | None):
    from vllm import LLM

    return LLM(model=model_dir, skip_tokenizer_init=True, enforce_eager=True,
               max_model_len=1024, dtype="bfloat16", max_num_seqs=4, block_size=BLOCK,
               num_gpu_blocks_override=256, kv_transfer_config=kv_transfer_config, seed=0,
               tensor_parallel_size=2)


def _half(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler


def _generate(llm, prompt: list[int]) -> list[int]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=8, temperature=0, detokenize=False)
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)
    if llm.llm_engine.vllm_config.kv_transfer_config:
        half, deadline = _half(llm), time.monotonic() + 120
        while not half.idle and time.monotonic() < deadline:
            llm.llm_engine.step()
            time.sleep(0.01)
    return list(out.outputs[0].token_ids)


@pytest.fixture
def shared_memory(tmp_path):
    """A private directory in /dev/shm where there is one (else on disk: the same files)."""
    import shutil

    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else str(tmp_path)
    directory = os.path.join(base, f"kvstrata-test-{os.getpid()}-{os.urandom(3).hex()}")
    os.mkdir(directory, 0o700)
    yield Path(directory)
    shutil.rmtree(directory, ignore_errors=True)


def test_two_mla_ranks_keep_one_g2_and_g3_copy_in_a_real_engine(in_process_vllm, two_cpus,
                                                                tmp_path, shared_memory):
    from kvstrata.physical.storage.disk_index import DiskIndex
    from kvstrata.physical.tags import keys_at_rest
    from kvstrata.testing.random_model import ModelShape, make_random_model

    shape = ModelShape(num_layers=4, hidden_size=128, num_heads=4, num_kv_heads=2,
                       intermediate_size=256)
    path = str(make_random_model(tmp_path / "model", shape, "deepseek_v2"))
    llm = _engine(path, None)
    reference = [_generate(llm, p) for p in PROMPTS]
    shutdown_engine(llm)

    g3 = tmp_path / "g3"
    shm = shared_memory / "g2"
    shm.mkdir(mode=0o700)
    config = {"kv_connector": "KvStrataConnector",
              "kv_connector_module_path": "kvstrata.connectors.vllm", "kv_role": "kv_both",
              "kv_connector_extra_config": {"tiers": {"G2": {"blocks": 64},
                                                      "G3": {"blocks": 512, "path": str(g3)}},
                                            "cost_aware": False,
                                            "shared_memory_dir": str(shm)}}
    llm = _engine(path, config)
    try:
        assert _half(llm).settings.replicas == 2
        assert _half(llm).settings.shared_host_dir == str(shm)
        assert [_generate(llm, p) for p in PROMPTS] == reference
        (g2,) = os.listdir(shm)                 # one G2 for both ranks
        assert g2.startswith("kvstrata-g2-") and g2.endswith("-r0")
        assert os.stat(shm / g2).st_mode & 0o777 == 0o600
    finally:
        shutdown_engine(llm)
    assert os.listdir(shm) == []                # removed with rank 0
    homes = sorted(os.listdir(g3))
    assert len(homes) == 1 and homes[0].startswith("kvstrata-g3-r0-"), homes
    stride = os.path.getsize(g3 / homes[0] / "slab") // 512
    keys = keys_at_rest(None)                   # the deployment's secret tags G3 blocks
    kept = DiskIndex.peek(g3 / homes[0] / "index", capacity=512,
                          fingerprint=homes[0].rsplit("-", 1)[1], stride=stride,
                          key_id=0 if keys is None else keys.tagger.key_id)
    assert kept is not None and len(kept) >= (len(PROMPTS[1]) - 1) // BLOCK

    llm = _engine(path, config)                 # a restart: both workers report the copy
    try:
        deadline = time.monotonic() + 60
        half = _half(llm)
        while half.planner.pools["G3"].status().inactive < len(kept) \
                and time.monotonic() < deadline:
            llm.llm_engine.step()
            time.sleep(0.05)
        assert half.planner.pools["G3"].status().inactive == len(kept)
        assert _generate(llm, PROMPTS[1]) == reference[1]
    finally:
        shutdown_engine(llm)
    assert sorted(os.listdir(g3)) == homes
