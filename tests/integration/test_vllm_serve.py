"""``vllm serve`` with kvstrata in ``--kv-transfer-config``: vLLM's OpenAI-compatible server
answers completions over HTTP, a returning prompt is served from kvstrata's G2 after vLLM's
own prefix cache is reset (``cached_tokens`` in the usage, same text), and kvstrata's counters
show in vLLM's Prometheus ``/metrics``. The server is a real subprocess on 127.0.0.1."""

from __future__ import annotations

import json
import random
import re
import time

import pytest

from kvstrata.physical.storage.disk_index import RECORD_BYTES
from kvstrata.testing.serve import VllmServer, free_port, http, kvstrata_connector

pytest.importorskip("vllm")

pytestmark = [pytest.mark.slow, pytest.mark.integration]

BLOCK = 32


def Server(model: str, extra: dict, log_path, env: dict | None = None) -> VllmServer:
    """``vllm serve`` of the tiny model with kvstrata configured by ``extra``."""
    return VllmServer(model, kvstrata_connector(extra), log_path, block_size=BLOCK, env=env)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from kvstrata.testing.random_model import TINY, make_random_llama

    return str(make_random_llama(tmp_path_factory.mktemp("model"), TINY))


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    proc = Server(model, {"tiers": {"G2": {"bytes": "64MiB"}}},
                  tmp_path_factory.mktemp("serve") / "server.log")
    try:
        yield proc.wait_healthy()
    finally:
        proc.stop()


def _complete(base: str, prompt: list[int]) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0}
    return json.loads(http(base + "/v1/completions", body))


def _metric(base: str, name: str) -> float:
    text = http(base + "/metrics").decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _returning_prompt(server: str, prompt: list[int], block: int = BLOCK) -> tuple[int, int]:
    """Send ``prompt`` twice, vLLM's own prefix cache reset in between; the second answer is
    the first's, and its cached tokens (returned, with what a full hit would be) came from
    kvstrata."""
    first = _complete(server, prompt)
    assert first["choices"][0]["text"]
    expected = (len(prompt) - 1) // block * block
    deadline = time.monotonic() + 60
    while True:                              # the first request's stores land in G2 (the
        time.sleep(0.5)                      # server steps while they run); a loaded
        http(server + "/reset_prefix_cache", {})   # machine may need another try
        second = _complete(server, prompt)
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        if cached == expected or time.monotonic() > deadline:
            break
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    return cached, expected


def test_serve_answers_and_returning_prompt_comes_from_kvstrata(server):
    rng = random.Random(5)
    prompt = [rng.randrange(3, 1000) for _ in range(300)]
    cached, expected = _returning_prompt(server, prompt)
    assert cached == expected
    deadline = time.monotonic() + 30                      # stats reach the logger per step
    while time.monotonic() < deadline:
        if _metric(server, "vllm:kvstrata_blocks_loaded") >= cached // BLOCK:
            break
        time.sleep(0.5)
    assert _metric(server, "vllm:kvstrata_blocks_loaded") >= cached // BLOCK
    assert re.search(r'vllm:kvstrata_blocks_loaded_total\{[^}]*tier="G2"',
                     http(server + "/metrics").decode())


def test_a_server_killed_with_sigkill_serves_its_disk_tier_after_restart(model, tmp_path):
    """G3 outlives the process: a server killed with SIGKILL (no shutdown at all) is started
    again on the same disk directory and its very first request finds the prompt's blocks
    in the recovered G3, with the same text as before."""
    rng = random.Random(9)
    prompt = [rng.randrange(3, 1000) for _ in range(400)]
    expected = (len(prompt) - 1) // BLOCK * BLOCK
    disk = tmp_path / "g3"
    disk.mkdir()
    extra = {"tiers": {"G2": {"bytes": "16MiB"}, "G3": {"bytes": "64MiB"}},
             "disk_dir": str(disk)}
    first = Server(model, extra, tmp_path / "first.log")
    try:
        base = first.wait_healthy()
        before = _complete(base, prompt)
        index = next(disk.glob("kvstrata-g3-r0-*/index"))
        deadline = time.monotonic() + 60              # stores reach G3 (write-through)
        while index.stat().st_size < 64 + (expected // BLOCK) * RECORD_BYTES \
                and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        first.kill()
    second = Server(model, extra, tmp_path / "second.log")
    try:
        base = second.wait_healthy()
        after = _complete(base, prompt)                 # the first request after the restart
        assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == expected
        assert after["choices"][0]["text"] == before["choices"][0]["text"]
        assert re.search(r'vllm:kvstrata_blocks_loaded_total\{[^}]*tier="G3"[^}]*\} [1-9]',
                         http(base + "/metrics").decode())
    finally:
        second.stop()


def test_a_new_server_reads_the_shared_g4_on_its_first_request(model, tmp_path, weed):
    """Two `vllm serve` processes, one after the other, sharing G4 in a real S3 server: the
    second starts with nothing of its own and its first request loads the prompt the first
    one stored, with the same text."""
    import uuid

    from kvstrata.physical.storage.s3client import S3Client

    rng = random.Random(11)
    prompt = [rng.randrange(3, 1000) for _ in range(400)]
    expected = (len(prompt) - 1) // BLOCK * BLOCK
    tenant = f"serve{uuid.uuid4().hex[:8]}"
    extra = {"tiers": {"G2": {"bytes": "16MiB"},
                       "G4": {"blocks": 4096, "url": f"{weed.endpoint_url}/{weed.bucket}"}},
             "tenant": tenant}
    env = {"AWS_ACCESS_KEY_ID": weed.access_key, "AWS_SECRET_ACCESS_KEY": weed.secret_key}
    client = S3Client(weed.s3_config())

    def stored() -> int:
        return sum(1 for key in client.list_keys("kvstrata") if f"/{tenant}/" in key)

    first = Server(model, extra, tmp_path / "first.log", env)
    try:
        before = _complete(first.wait_healthy(), prompt)
        deadline = time.monotonic() + 60                 # stores reach G4 (write-through)
        while stored() < expected // BLOCK and time.monotonic() < deadline:
            time.sleep(0.3)
        assert stored() >= expected // BLOCK
    finally:
        first.kill()
    second = Server(model, extra, tmp_path / "second.log", env)
    try:
        base = second.wait_healthy()
        after = _complete(base, prompt)                  # its very first request
        assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == expected
        assert after["choices"][0]["text"] == before["choices"][0]["text"]
        assert re.search(r'vllm:kvstrata_blocks_loaded_total\{[^}]*tier="G4"[^}]*\} [1-9]',
                         http(base + "/metrics").decode())
    finally:
        second.stop()


def test_an_engine_loads_a_prefix_from_another_engines_g2_over_nixl(model, tmp_path):
    """Two `vllm serve` processes: A exports its G2, B names A as a peer. A prompt only A
    computed is answered by B from A's memory (NIXL reads into B's KV cache, verified):
    every full block cached, the same text, counted under tier "remote"."""
    from kvstrata.remote.importer import ask, pack_hashes
    from kvstrata.remote.nixl_agent import nixl_available
    from kvstrata.tokens import hash_blocks

    if not nixl_available():
        pytest.skip("NIXL is not installed (scripts/setup.sh installs it)")
    address = f"tcp://127.0.0.1:{free_port()}"
    a = Server(model, {"tiers": {"G2": {"bytes": "64MiB"}}, "export": address},
               tmp_path / "a.log")
    # generous waits: this checks that the prefix comes over, not how fast a loaded CI
    # machine answers (the defaults, 0.2 s and 5 s, are for engines with cores of their own)
    b = Server(model, {"tiers": {"G2": {"bytes": "64MiB"}}, "peers": [address],
                       "peer_ask_timeout": 20, "peer_read_timeout": 60}, tmp_path / "b.log")
    try:
        base_a, base_b = a.wait_healthy(), b.wait_healthy()
        rng = random.Random(17)
        prompt = [rng.randrange(3, 1000) for _ in range(400)]
        expected = (len(prompt) - 1) // BLOCK * BLOCK
        on_a = _complete(base_a, prompt)
        hashes = hash_blocks(prompt[:expected], BLOCK)[1]
        deadline = time.monotonic() + 60
        while ask(address, {"op": "has", "hashes": pack_hashes(hashes)}, 5)["held"] \
                < len(hashes):
            assert time.monotonic() < deadline, "A's stores never reached its G2"
            time.sleep(0.3)
        on_b = _complete(base_b, prompt)                  # B computed nothing of it
        assert on_b["usage"]["prompt_tokens_details"]["cached_tokens"] == expected, \
            b.log_tail(4000)
        assert on_b["choices"][0]["text"] == on_a["choices"][0]["text"]
        # stats reach the logger per step; a load that failed on a loaded machine and was
        # asked again counts its tokens again, so at least the prefix, not exactly it
        pattern = r'vllm:kvstrata_tokens_matched_total\{[^}]*tier="remote"[^}]*\} ([0-9.]+)'
        deadline = time.monotonic() + 30
        while (found := re.search(pattern, text := http(base_b + "/metrics").decode())) \
                is None or float(found.group(1)) < expected:
            if time.monotonic() > deadline:
                shown = "\n".join(line for line in text.splitlines() if "kvstrata" in line)
                raise AssertionError(f"{shown}\n--- B's log:\n{b.log_tail(4000)}")
            time.sleep(0.5)
    finally:
        b.stop()
        a.stop()


def test_serve_a_hybrid_sliding_window_model_with_its_hybrid_cache_manager_on(tmp_path):
    """A Gemma-3-style model (sliding-window layers, window smaller than the prompt, and a
    full-attention layer): vLLM keeps its hybrid KV cache manager on with kvstrata's
    connector (SupportsHMA), and a returning prompt comes back from kvstrata."""
    from kvstrata.testing.random_model import ModelShape, make_random_model

    shape = ModelShape(num_layers=4, hidden_size=128, num_heads=4, num_kv_heads=2,
                       intermediate_size=256, sliding_window=64)
    model = make_random_model(tmp_path / "gemma3", shape, "gemma3")
    proc = Server(str(model), {"tiers": {"G2": {"bytes": "64MiB"}}},
                  tmp_path / "server.log")
    try:
        base = proc.wait_healthy()
        rng = random.Random(6)
        cached, expected = _returning_prompt(base, [rng.randrange(3, 1000) for _ in range(300)])
        assert cached == expected
    finally:
        proc.stop()
    log = proc.log_tail(10 ** 6)
    assert "Turning off hybrid kv cache manager" not in log
    assert re.search(r"kv cache group sizes \(\d+(, \d+)+\)", log), log[-3000:]
