"""Event files, event sockets and plots are not left to other local users (security review,
findings 1-4). A KV event carries the prompt (block hashes; token ids with ``keep_tokens``),
and ``kvstrata indexer --file`` applies what an event file says.

Before: a ``jsonl:`` / ``dynamo-json:`` file was created 0644 (every local user read the
prompts' token ids), a symbolic link at its path was followed (root appended to a file of
the link maker's choice), and a file another user had planted (0666) was appended to (that
user read every event and added forged ones, which ``kvstrata indexer --file`` applied); a
ZMQ ``ipc://`` socket was 0777 under umask 0 (any local user subscribed); ``kvstrata replay
--plot`` wrote a 0666 PNG under umask 0.

The other user is a real second OS user (``kvstrata-other``, made when the tests run as
root, as in tests/physical/test_disk_private.py); the tests that need one skip without it,
and the same refusals are checked without it on a file of this user's that others can write.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap

import pytest

from kvstrata.events.sinks import event_file_problem
from kvstrata.events.spec import make_publisher
from kvstrata.events.subscriber import read_events_file
from kvstrata.paths import NotPrivateError
from kvstrata.types import BlockRecord

TIMEOUT = 180
"""Generous for a loaded machine: a subprocess that runs a short command."""
TOKENS = (9906, 374, 757, 3636)


def as_user(user, argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
    """Run ``argv`` as ``user`` (setpriv: that uid and gid, no other groups)."""
    return subprocess.run(["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}",
                           "--clear-groups", *argv], check=check, timeout=TIMEOUT,
                          capture_output=True, text=True)


@pytest.fixture
def open_dir():
    """A directory every user can write and enter, without the sticky bit (so the kernel's
    protected_regular / protected_symlinks rules, which only guard sticky directories, do
    not refuse first: what is checked is kvstrata's own refusal)."""
    path = tempfile.mkdtemp(prefix="kvstrata-evpriv-", dir="/tmp")
    os.chmod(path, 0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def umask0():
    old = os.umask(0)
    yield
    os.umask(old)


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def emit(spec: str, **kw) -> None:
    """Publish one stored block of a prompt (token ids kept) through ``spec``."""
    pub = make_publisher(spec, keep_tokens=True, worker_id=7, **kw)
    try:
        pub.on_tier_stored("G1", [BlockRecord(0x1234, 0x99, None, 4, TOKENS)])
        assert pub.flush(60)
    finally:
        pub.close()


def cli(*argv: str, umask: int | None = None) -> tuple[int, str, str]:
    proc = subprocess.run([sys.executable, "-m", "kvstrata.cli", *argv], capture_output=True,
                          text=True, timeout=TIMEOUT,
                          preexec_fn=None if umask is None else (lambda: os.umask(umask)))
    return proc.returncode, proc.stdout, proc.stderr


def one_line(code: int, err: str, *words: str) -> str:
    lines = [line for line in err.splitlines() if line.strip() and "Triton" not in line]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (code, err)
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


# -- finding 1: the file sinks ----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["jsonl", "dynamo-json"])
@pytest.mark.parametrize("dp_rank", [0, 1])
def test_an_event_file_is_made_0600_whatever_the_umask(tmp_path, umask0, kind, dp_rank):
    """Finding 1: under umask 0 (and 022) the file was 0644. A data-parallel engine's own
    ``<stem>.dp<k><suffix>`` file goes the same way."""
    emit(f"{kind}:{tmp_path / 'events.jsonl'}", dp_rank=dp_rank)
    written = tmp_path / ("events.jsonl" if not dp_rank else f"events.dp{dp_rank}.jsonl")
    assert mode(written) == 0o600
    assert "9906" in written.read_text() or "block_hash" in written.read_text()


def test_another_user_cannot_read_the_events(open_dir, umask0, other_user):
    path = os.path.join(open_dir, "events.jsonl")
    emit(f"jsonl:{path}")
    seen = as_user(other_user, ["cat", path], check=False)
    assert seen.returncode != 0 and "9906" not in seen.stdout


def test_an_own_file_others_may_read_is_taken_back_and_appended_to(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text("")
    os.chmod(path, 0o644)
    emit(f"jsonl:{path}")
    assert mode(path) == 0o600 and len(path.read_text().splitlines()) == 1


@pytest.mark.parametrize("kind", ["jsonl", "dynamo-json"])
def test_a_file_another_user_planted_is_refused_and_left_alone(open_dir, other_user, kind):
    """Finding 1: a 0666 file another user made at the path was appended to; that user read
    every event and could add forged ones. Now opening the sink is a NotPrivateError naming
    the file and its owner, and nothing is written into it."""
    path = os.path.join(open_dir, "planted.jsonl")
    as_user(other_user, ["sh", "-c", f"umask 0 && : > '{path}'"])
    with pytest.raises(NotPrivateError, match=f"owned by uid {other_user.pw_uid}") as info:
        emit(f"{kind}:{path}")
    assert info.value.filename == path
    assert os.path.getsize(path) == 0 and os.stat(path).st_uid == other_user.pw_uid
    assert "owned by uid" in (event_file_problem(path) or "")


def test_a_planted_data_parallel_file_is_refused(open_dir, other_user):
    path = os.path.join(open_dir, "events.jsonl")
    rank_file = os.path.join(open_dir, "events.dp2.jsonl")
    as_user(other_user, ["sh", "-c", f"umask 0 && : > '{rank_file}'"])
    with pytest.raises(NotPrivateError, match="owned by uid") as info:
        emit(f"jsonl:{path}", dp_rank=2)
    assert info.value.filename == rank_file and os.path.getsize(rank_file) == 0


def test_an_own_file_others_can_write_is_refused(tmp_path):
    """The same refusal without a second user: a file others could have written forged
    events into is not appended to (nor made private: what is in it is not ours alone)."""
    path = tmp_path / "events.jsonl"
    path.write_text("")
    os.chmod(path, 0o666)
    with pytest.raises(NotPrivateError, match="writable by its group or others"):
        emit(f"jsonl:{path}")
    assert path.read_text() == "" and mode(path) == 0o666


def test_a_symbolic_link_is_not_followed(open_dir, tmp_path, other_user):
    """Finding 1: a link another user made at the event file's path was followed, and the
    events were appended to the file it named (a 0600 file of root's)."""
    victim = tmp_path / "precious.conf"
    victim.write_text("original\n")
    os.chmod(victim, 0o600)
    path = os.path.join(open_dir, "linked.jsonl")
    as_user(other_user, ["ln", "-s", str(victim), path])
    with pytest.raises(NotPrivateError, match="symbolic link"):
        emit(f"jsonl:{path}")
    assert victim.read_text() == "original\n"
    assert "symbolic link" in (event_file_problem(path) or "")


def test_an_own_symbolic_link_is_not_followed_either(tmp_path):
    victim = tmp_path / "precious.conf"
    victim.write_text("original\n")
    (tmp_path / "linked.jsonl").symlink_to(victim)
    with pytest.raises(NotPrivateError, match="symbolic link"):
        emit(f"jsonl:{tmp_path / 'linked.jsonl'}")
    assert victim.read_text() == "original\n"


def test_devices_still_take_events():
    """``/dev/null`` (discard) and ``/dev/full`` (the full-disk tests) are root's devices:
    still accepted."""
    emit("jsonl:/dev/null")
    assert event_file_problem("/dev/null") is None


def test_the_cli_says_so_in_one_line(open_dir, other_user, tmp_path):
    """``kvstrata replay --events`` on a planted file: one line naming the file, exit 2."""
    path = os.path.join(open_dir, "planted.jsonl")
    as_user(other_user, ["sh", "-c", f"umask 0 && : > '{path}'"])
    code, _, err = cli("replay", "--limit", "3", "--events", f"jsonl:{path}")
    one_line(code, err, path, f"owned by uid {other_user.pw_uid}")
    assert os.path.getsize(path) == 0
    link = tmp_path / "linked.jsonl"
    link.symlink_to(tmp_path / "target.jsonl")
    code, _, err = cli("replay", "--limit", "3", "--events", f"jsonl:{link}")
    one_line(code, err, str(link), "symbolic link")
    assert not (tmp_path / "target.jsonl").exists()


# -- finding 2: kvstrata indexer --file ---------------------------------------------------------

FORGED = ('{"worker_id":7,"storage_tier":"device","event":{"event_id":1,"data":{"stored":'
          '{"parent_hash":null,"blocks":[{"block_hash":4242,"tokens_hash":4242}]}}}}\n')


def test_the_indexer_refuses_a_file_another_user_wrote(open_dir, other_user):
    """Finding 2: ``kvstrata indexer --file`` applied what another user's file said."""
    path = os.path.join(open_dir, "theirs.jsonl")
    as_user(other_user, ["sh", "-c", f"umask 022 && printf '%s' '{FORGED.strip()}' > '{path}'"
                                     f" && echo >> '{path}'"])
    assert mode(path) == 0o644 and os.stat(path).st_uid == other_user.pw_uid
    code, out, err = cli("indexer", "--file", path, "--format", "dynamo", "--query", "4242")
    one_line(code, err, "--file", path, f"owned by uid {other_user.pw_uid}", "not applied")
    assert out == ""


def test_the_indexer_refuses_a_file_others_can_write(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text(FORGED)
    os.chmod(path, 0o666)
    code, out, err = cli("indexer", "--file", str(path), "--format", "dynamo",
                         "--query", "4242")
    one_line(code, err, str(path), "writable by its group or others", "chmod go-w")
    os.chmod(path, 0o620)
    with pytest.raises(NotPrivateError, match="mode 0620"):
        list(read_events_file(str(path), "dynamo"))


def test_the_indexer_reads_its_own_file_and_one_of_roots(tmp_path, open_dir, other_user):
    """An own file (any read bits) is read; so is a root-owned file that no one else can
    write, by any user (as a secret file may be root's): here the second user reads one."""
    path = tmp_path / "events.jsonl"
    path.write_text(FORGED)
    os.chmod(path, 0o644)
    code, out, err = cli("indexer", "--file", str(path), "--format", "dynamo",
                         "--query", "4242")
    assert code == 0 and json.loads(out)["best"]["prefix"] == 1, err
    shared = os.path.join(open_dir, "roots.jsonl")
    shutil.copyfile(path, shared)
    os.chmod(shared, 0o644)
    assert os.stat(shared).st_uid == 0
    seen = as_user(other_user, [sys.executable, "-m", "kvstrata.cli", "indexer", "--file",
                                shared, "--format", "dynamo", "--query", "4242"], check=False)
    assert seen.returncode == 0 and json.loads(seen.stdout)["best"]["prefix"] == 1, seen.stderr


# -- finding 3: the ZMQ ipc:// socket -----------------------------------------------------------

CONNECT = textwrap.dedent("""
    import socket, sys
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(sys.argv[1])
    except PermissionError:
        print("refused")
    else:
        print("connected")
""")


def test_an_ipc_socket_is_the_owners_alone_whatever_the_umask(open_dir, umask0):
    """Finding 3: under umask 0 the socket was 0777 (any local user subscribed and read the
    events); it is bound privately and made 0600 before it has its name. Nothing of the
    private directory it was bound in is left, and closing removes the socket."""
    path = os.path.join(open_dir, "events.sock")
    pub = make_publisher(f"zmq://ipc://{path}", keep_tokens=True, worker_id=7)
    try:
        assert stat.S_ISSOCK(os.lstat(path).st_mode) and mode(path) == 0o600
        assert os.listdir(open_dir) == ["events.sock"]
        receive_one(path, pub)
    finally:
        pub.close()
    assert os.listdir(open_dir) == []


def test_another_user_cannot_connect_to_the_ipc_socket(open_dir, umask0, other_user):
    path = os.path.join(open_dir, "events.sock")
    pub = make_publisher(f"zmq://ipc://{path}")
    try:
        seen = as_user(other_user, [sys.executable, "-c", CONNECT, path])
        assert seen.stdout.strip() == "refused", seen
    finally:
        pub.close()


def receive_one(path: str, pub) -> None:
    """A subscriber of this user's gets a published event (PUB/SUB drops what is sent before
    the subscription is in place: publish again until one arrives, within 60 s)."""
    import time

    import zmq

    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(f"ipc://{path}")
    try:
        deadline = time.monotonic() + 60
        n = 0
        while time.monotonic() < deadline:
            n += 1
            pub.on_tier_stored("G1", [BlockRecord(n, 0x99, None, 4, TOKENS)])
            pub.flush(30)
            if sub.poll(200):
                assert len(sub.recv_multipart()) == 3
                return
        raise AssertionError("no event reached a subscriber of the socket's owner")
    finally:
        sub.close(0)


def test_a_stale_socket_is_replaced_and_a_planted_file_or_link_is_not(open_dir, tmp_path,
                                                                       umask0):
    """A socket left at the path (a run that did not clean up) is replaced, as ZMQ's own bind
    did; a regular file or a symbolic link there is refused and left as it was."""
    path = os.path.join(open_dir, "events.sock")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)
    stale.close()
    pub = make_publisher(f"zmq://ipc://{path}")
    try:
        assert mode(path) == 0o600
    finally:
        pub.close()
    assert not os.path.lexists(path)
    with open(path, "w") as fh:
        fh.write("keep me")
    with pytest.raises(OSError, match="not a socket"):
        make_publisher(f"zmq://ipc://{path}")
    assert open(path).read() == "keep me"
    os.unlink(path)
    os.symlink(tmp_path / "elsewhere", path)
    with pytest.raises(OSError, match="not a socket"):
        make_publisher(f"zmq://ipc://{path}")
    assert os.path.islink(path) and not (tmp_path / "elsewhere").exists()
    assert sorted(os.listdir(open_dir)) == ["events.sock"]


def test_a_planted_file_of_another_user_is_not_replaced(open_dir, other_user):
    path = os.path.join(open_dir, "events.sock")
    as_user(other_user, ["sh", "-c", f"printf theirs > '{path}'"])
    with pytest.raises(OSError, match="not a socket"):
        make_publisher(f"zmq://ipc://{path}")
    assert open(path).read() == "theirs" and os.stat(path).st_uid == other_user.pw_uid


def test_the_socket_of_a_data_parallel_engine_is_private_too(open_dir, umask0):
    path = os.path.join(open_dir, "events.sock")
    pub = make_publisher(f"zmq://ipc://{path}", dp_rank=1)
    try:
        assert mode(f"{path}-dp1") == 0o600
    finally:
        pub.close()
    assert os.listdir(open_dir) == []


# -- finding 4: the plot ------------------------------------------------------------------------


def test_the_plot_is_not_writable_by_others(tmp_path):
    """Finding 4: ``kvstrata replay --plot`` under umask 0 wrote a 0666 PNG. Now 0644 at
    most (a plot of hit rates carries no prompt: others may read it, not change it)."""
    pytest.importorskip("matplotlib")
    png = tmp_path / "hit.png"
    code, _, err = cli("replay", "--limit", "5", "--no-progress", "--plot", str(png), umask=0)
    assert code == 0, err
    assert mode(png) == 0o644


def test_an_ipc_path_too_long_to_bind_privately_is_refused_clearly(tmp_path):
    """The socket is first bound in a private directory beside the path (18 bytes longer
    than the directory): where that passes the 107 bytes a socket's path may have, the open
    says so, naming the limit, and leaves nothing behind."""
    directory = tmp_path / ("d" * max(1, 100 - len(str(tmp_path))))
    directory.mkdir()
    path = f"{directory}/e"
    assert len(path) <= 107 < len(str(directory)) + 18
    with pytest.raises(OSError, match="longer than 107 bytes") as info:
        make_publisher(f"zmq://ipc://{path}")
    assert "shorter directory" in str(info.value)
    assert os.listdir(directory) == []


def test_engines_refuse_such_a_file_at_start_in_one_line(tmp_path):
    """vLLM and SGLang check their sinks before they open them (sink_problem, and
    engine_sink_problems for a data-parallel engine's own file): a link or a file others can
    write is one line naming it there, not a traceback later."""
    from kvstrata.connectors.engine_config import engine_sink_problems
    from kvstrata.events.spec import sink_problem

    real = tmp_path / "real.jsonl"
    real.write_text("")
    link = tmp_path / "events.jsonl"
    os.symlink(real, link)
    problem = sink_problem(f"jsonl:{link}") or ""
    assert "symbolic link" in problem and str(link) in problem
    os.chmod(real, 0o666)
    problem = sink_problem(f"dynamo-json:{real}") or ""
    assert "writ" in problem and "\n" not in problem
    assert sink_problem(f"jsonl:{tmp_path / 'new.jsonl'}") is None
    (tmp_path / "new.dp1.jsonl").symlink_to(real)
    problems = engine_sink_problems((f"jsonl:{tmp_path / 'new.jsonl'}",), 1)
    assert len(problems) == 1 and "symbolic link" in problems[0]
