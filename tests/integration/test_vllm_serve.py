"""``vllm serve`` with kvstrata in ``--kv-transfer-config``: vLLM's OpenAI-compatible server
answers completions over HTTP, a returning prompt is served from kvstrata's G2 after vLLM's
own prefix cache is reset (``cached_tokens`` in the usage, same text), and kvstrata's counters
show in vLLM's Prometheus ``/metrics``. The server is a real subprocess on 127.0.0.1."""

from __future__ import annotations

import json
import os
import random
import re
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("vllm")

pytestmark = [pytest.mark.slow, pytest.mark.integration]

BLOCK = 32


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _request(url: str, body: dict | None = None, timeout: float = 60.0) -> bytes:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method="POST" if body is not None else "GET",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.read()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from kvstrata.connectors.vllm.random_model import TINY, make_random_llama

    model = str(make_random_llama(tmp_path_factory.mktemp("model"), TINY))
    port = _free_port()
    config = {"kv_connector": "KvStrataConnector",
              "kv_connector_module_path": "kvstrata.connectors.vllm", "kv_role": "kv_both",
              "kv_connector_extra_config": {"tiers": {"G2": {"bytes": "64MiB"}}}}
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_SERVER_DEV_MODE="1")
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen(
        [os.path.join(os.path.dirname(sys.executable), "vllm"), "serve", model,
         "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny",
         "--enforce-eager", "--block-size", str(BLOCK), "--max-model-len", "2048",
         "--dtype", "bfloat16", "--enable-prompt-tokens-details",
         "--kv-transfer-config", json.dumps(config)],
        stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    try:
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"vllm serve exited with {proc.returncode}:\n"
                                     f"{log_path.read_text()[-4000:]}")
            try:
                _request(base + "/health", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise AssertionError("vllm serve did not become healthy in 240 s:\n"
                                         + log_path.read_text()[-4000:])
                time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _complete(base: str, prompt: list[int]) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0}
    return json.loads(_request(base + "/v1/completions", body))


def _metric(base: str, name: str) -> float:
    text = _request(base + "/metrics").decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_serve_answers_and_returning_prompt_comes_from_kvstrata(server):
    rng = random.Random(5)
    prompt = [rng.randrange(3, 1000) for _ in range(300)]
    first = _complete(server, prompt)
    assert first["choices"][0]["text"]
    expected = (len(prompt) - 1) // BLOCK * BLOCK
    deadline = time.monotonic() + 60
    while True:                              # the first request's stores land in G2 (the
        time.sleep(0.5)                      # server steps while they run); a loaded
        _request(server + "/reset_prefix_cache", {})   # machine may need another try
        second = _complete(server, prompt)
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        if cached == expected or time.monotonic() > deadline:
            break
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    assert cached == expected
    deadline = time.monotonic() + 30                      # stats reach the logger per step
    while time.monotonic() < deadline:
        if _metric(server, "vllm:kvstrata_blocks_loaded") >= cached // BLOCK:
            break
        time.sleep(0.5)
    assert _metric(server, "vllm:kvstrata_blocks_loaded") >= cached // BLOCK
    assert re.search(r'vllm:kvstrata_blocks_loaded_total\{[^}]*tier="G2"',
                     _request(server + "/metrics").decode())
