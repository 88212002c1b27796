"""The NIXL agent wrapper on its own: an idle agent costs no CPU (NIXL's Python API would
start its UCX progress thread busy-polling a core)."""

from __future__ import annotations

import time

import pytest

from kvstrata.remote.nixl_agent import NixlAgent, nixl_available

if not nixl_available():
    pytest.skip("NIXL is not installed (scripts/setup.sh installs it)", allow_module_level=True)


def test_an_idle_agent_leaves_the_cpu_alone():
    agent = NixlAgent("kvstrata-test-idle")
    try:
        time.sleep(0.2)                               # its threads are up
        before = time.process_time()                  # every thread of this process
        time.sleep(1.0)
        used = time.process_time() - before
    finally:
        agent.close()
    assert used < 0.3, f"{used:.2f} s of CPU in 1 s idle: the progress thread busy-polls"
