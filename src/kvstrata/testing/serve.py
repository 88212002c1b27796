"""One ``vllm serve`` process on 127.0.0.1 for tests and benchmarks, waited for by readiness.

:class:`VllmServer` starts ``vllm serve MODEL`` in its own process group (the API server, the
engine core and its workers are stopped together), with a KV connector configured
(:func:`kvstrata_connector`, or :data:`NULL_CONNECTOR` for the recompute baseline), logs to a
file, and :meth:`VllmServer.wait_healthy` polls ``/health`` until it answers, however long
a loaded machine takes to start it (up to a generous ``timeout``), failing with the log's
tail if the process exits first. :func:`http` is the small HTTP client both use.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Mapping, Sequence

__all__ = ["VllmServer", "kvstrata_connector", "NULL_CONNECTOR", "free_port", "http"]

NULL_CONNECTOR: dict[str, Any] = {"kv_connector": "NullConnector",
                                  "kv_connector_module_path":
                                      "kvstrata.testing.null_connector",
                                  "kv_role": "kv_both"}
"""vLLM's ``kv_transfer_config`` naming the connector that loads and stores nothing."""


def kvstrata_connector(extra: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's ``kv_transfer_config`` naming kvstrata's connector with ``extra`` as its
    ``kv_connector_extra_config``."""
    return {"kv_connector": "KvStrataConnector",
            "kv_connector_module_path": "kvstrata.connectors.vllm", "kv_role": "kv_both",
            "kv_connector_extra_config": dict(extra)}


def free_port() -> int:
    """A TCP port of 127.0.0.1 free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, body: dict | None = None, timeout: float = 60.0) -> bytes:
    """GET ``url`` (or POST ``body`` as JSON); the response's bytes."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method="POST" if body is not None else "GET",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.read()


class VllmServer:
    """``vllm serve model`` with ``kv_transfer_config``, on a free port of 127.0.0.1, in its
    own process group; its output goes to ``log_path``. ``args`` are more ``vllm serve``
    flags; ``env`` is added to this process's environment (``VLLM_CPU_KVCACHE_SPACE``
    defaults to 1 GiB)."""

    def __init__(self, model: str | os.PathLike, kv_transfer_config: Mapping[str, Any],
                 log_path: str | os.PathLike, *, name: str = "tiny", block_size: int = 32,
                 max_model_len: int = 2048, args: Sequence[str] = (),
                 env: Mapping[str, str] | None = None) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        full_env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_SERVER_DEV_MODE="1")
        full_env.update(env or {})
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [os.path.join(os.path.dirname(sys.executable), "vllm"), "serve", str(model),
             "--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", name,
             "--enforce-eager", "--block-size", str(block_size),
             "--max-model-len", str(max_model_len), "--dtype", "bfloat16",
             "--enable-prompt-tokens-details", *args,
             "--kv-transfer-config", json.dumps(dict(kv_transfer_config))],
            stdout=self._log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)

    def log_tail(self, n: int = 4000) -> str:
        """The last ``n`` characters of the server's output."""
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def wait_healthy(self, timeout: float = 300) -> str:
        """Wait until ``/health`` answers; returns the base URL. ``RuntimeError`` with the
        log's tail if the server exits first or is not up within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n"
                                   f"{self.log_tail()}")
            try:
                http(self.base + "/health", timeout=2)
                return self.base
            except (OSError, urllib.error.URLError):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"vllm serve did not become healthy in {timeout} s:\n"
                                       f"{self.log_tail()}") from None
                time.sleep(0.5)

    def kill(self) -> None:
        """SIGKILL the whole process group: API server, engine core and workers at once."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._log.close()

    def stop(self, grace: float = 60) -> None:
        """SIGTERM the process group, wait up to ``grace`` seconds, then :meth:`kill`."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        self.kill()
