"""Nothing is left behind: SIGTERM and Ctrl-C unwind ``replay --data`` (its slab and temporary
directory removed, one line, no traceback), what a SIGKILL leaves is reclaimed by the next
start, and a KvBlockManager its user never closed is closed at interpreter exit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from kvstrata.physical.leftovers import owner_tag, reclaim


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_reclaim_removes_only_dead_owners_of_this_host(tmp_path):
    dead = _dead_pid()
    stale_file = tmp_path / f"kvstrata-g3-{owner_tag(dead)}-abcd.slab"
    stale_dir = tmp_path / f"kvstrata-data-replay-{owner_tag(dead)}-x1"
    mine = tmp_path / f"kvstrata-g3-{owner_tag()}-beef.slab"
    other_host = tmp_path / f"kvstrata-g3-h00000000-{dead}-cafe.slab"
    unrelated = tmp_path / f"notes-{owner_tag(dead)}-1.txt"
    stale_file.write_bytes(b"x")
    stale_dir.mkdir()
    (stale_dir / "inner").write_bytes(b"y")
    for path in (mine, other_host, unrelated):
        path.write_bytes(b"z")
    removed = set(reclaim(tmp_path, "kvstrata-g3-")) | set(reclaim(tmp_path,
                                                                  "kvstrata-data-replay-"))
    assert removed == {str(stale_file), str(stale_dir)}
    assert mine.exists() and other_host.exists() and unrelated.exists()


def test_reclaim_leaves_what_another_pid_namespace_owns(tmp_path):
    """Another container with the same host name sharing the directory (``--ipc=host``):
    its pids mean nothing here, so its entries are never taken for a dead owner's."""
    import socket

    import xxhash

    dead = _dead_pid()
    other = "h" + xxhash.xxh32_hexdigest(f"{socket.gethostname()}\0pid:[1]".encode())
    assert not owner_tag(dead).startswith(other)
    theirs = tmp_path / f"kvstrata-g2-{other}-{dead}-x-r0"
    ours = tmp_path / f"kvstrata-g2-{owner_tag(dead)}-x-r0"
    for path in (theirs, ours):
        path.write_bytes(b"x")
    assert reclaim(tmp_path, "kvstrata-g2-") == [str(ours)]
    assert theirs.exists()
    # what a version before the namespace was in the tag left is still reclaimed
    legacy = tmp_path / (f"kvstrata-g3-h{xxhash.xxh32_hexdigest(socket.gethostname().encode())}"
                         f"-{dead}-abcd.slab")
    legacy.write_bytes(b"x")
    assert reclaim(tmp_path, "kvstrata-g3-") == [str(legacy)]


def test_a_new_disk_tier_reclaims_slabs_of_killed_processes(tmp_path):
    pytest.importorskip("torch")
    from kvstrata.physical import DiskStorage
    from kvstrata.protocol.layout import LayoutConfig

    stale = tmp_path / f"kvstrata-g3-{owner_tag(_dead_pid())}-0001.slab"
    stale.write_bytes(b"\0" * 8192)
    disk = DiskStorage(LayoutConfig(num_blocks=4, num_layers=1, outer_dim=2, page_size=4,
                                    inner_dim=8, dtype="float16"), tmp_path, o_direct=False)
    try:
        assert not stale.exists()
        assert disk.path.exists() and owner_tag() in disk.path.name
    finally:
        disk.close()
    assert list(tmp_path.iterdir()) == []


_STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _no_replay_outlives_its_test():
    yield
    while _STARTED:
        proc = _STARTED.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _replay_data(tmp_dir, *extra):
    env = dict(os.environ, TMPDIR=str(tmp_dir), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "kvstrata.cli", "replay", "--data",
                             "--no-progress", "--limit", "100000", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    _STARTED.append(proc)
    return proc


def _wait_for_slab(tmp_dir, proc, timeout=120.0):
    """Wait until ``proc`` created its own slab (its owner tag names its pid)."""
    tag = owner_tag(proc.pid)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        slabs = [p for p in tmp_dir.rglob("*.slab") if tag in p.name]
        if slabs:
            return slabs
        assert proc.poll() is None, proc.stderr.read().decode()
        time.sleep(0.1)
    raise AssertionError("the replay never created its slab")


@pytest.mark.slow
@pytest.mark.parametrize("sig, code, word", [(signal.SIGTERM, 143, "terminated"),
                                             (signal.SIGINT, 130, "interrupted")])
def test_sigterm_and_ctrl_c_remove_the_slab(tmp_path, sig, code, word):
    proc = _replay_data(tmp_path)
    _wait_for_slab(tmp_path, proc)
    time.sleep(0.5)                                    # mid-replay
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    err = err.decode()
    assert proc.returncode == code, err
    assert "Traceback" not in err and word in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_what_sigkill_leaves_the_next_start_reclaims(tmp_path):
    proc = _replay_data(tmp_path)
    _wait_for_slab(tmp_path, proc)
    proc.kill()
    proc.wait()
    left = [p for p in tmp_path.iterdir() if p.name.startswith("kvstrata-")]
    assert left, "a killed replay leaves its temporary directory"
    second = _replay_data(tmp_path)
    _wait_for_slab(tmp_path, second)
    assert not any(p.exists() for p in left), "the next start reclaims it"
    second.send_signal(signal.SIGTERM)
    second.communicate(timeout=120)
    assert list(tmp_path.iterdir()) == []


def test_an_unclosed_manager_is_closed_at_exit(tmp_path):
    pytest.importorskip("torch")
    code = (
        "from kvstrata import KvBlockManager, KvConfig\n"
        "from kvstrata.config import TierConfig, ModelGeometry\n"
        f"m = KvBlockManager(KvConfig(tiers={{'G1': TierConfig(blocks=8), 'G2': "
        f"TierConfig(blocks=8), 'G3': TierConfig(blocks=8)}}, model=ModelGeometry(num_layers=1,"
        f" kv_heads=1, head_dim=8)), disk_dir={str(tmp_path)!r}, durable_disk=False)\n"
        "import os; assert os.listdir(" + repr(str(tmp_path)) + ")\n"
        "print('exiting without close')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode()
    assert b"exiting without close" in proc.stdout
    assert list(tmp_path.iterdir()) == []


_THREADS_AT_EXIT = """
import sys, threading, time
from kvstrata import KvBlockManager, KvConfig
from kvstrata.config import TierConfig, ModelGeometry

def config():
    return KvConfig(tiers={"G1": TierConfig(blocks=8), "G2": TierConfig(blocks=8),
                           "G3": TierConfig(blocks=8)},
                    model=ModelGeometry(num_layers=1, kv_heads=1, head_dim=8))

first = KvBlockManager(config(), disk_dir=sys.argv[1], durable_disk=False)
main_done = threading.Event()

def worker():                      # a thread the interpreter waits for at exit
    main_done.wait()
    time.sleep(0.3)                # threading's exit hooks have run by now
    for _ in range(20):
        first.allocate(1).result(30).release()
    KvBlockManager(config(), disk_dir=sys.argv[2], durable_disk=False)     # left open too
    print("worker done", flush=True)

threading.Thread(target=worker).start()
main_done.set()
"""


def test_managers_stay_usable_by_threads_running_at_exit_and_are_all_closed(tmp_path):
    """A thread still running when the main thread ends may go on using a manager (it is
    closed once every such thread ended), and one it makes then is closed too."""
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    proc = subprocess.run([sys.executable, "-c", _THREADS_AT_EXIT, str(first), str(second)],
                          capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert b"worker done" in proc.stdout, proc.stderr.decode()[-2000:]
    assert list(first.iterdir()) == [] and list(second.iterdir()) == []


# -- sizes no machine can hold: refused before anything is allocated; empty slots cost nothing


def test_a_huge_empty_pool_costs_next_to_nothing():
    from kvstrata.logical.pool import BlockPool

    with pytest.raises(ValueError, match="num_blocks"):     # slot ids are int32
        BlockPool("G1", 10 ** 23, 16)
    pool = BlockPool("G1", 10 ** 7, 16)          # columns reserved, pages untouched
    assert pool.status().reset == 10 ** 7 and pool._made == 0
    blocks = pool.allocate(3)
    assert blocks.block_ids == [0, 1, 2] and pool._made == 3
    pool.release(blocks)
    again = pool.allocate(2)
    assert sorted(again.block_ids) == [1, 2]          # slots that came back are reused first
    pool.release(again)
    pool.check_invariants()


def test_replay_with_an_absurd_tier_is_a_one_line_error_and_a_big_one_runs_in_bounded_memory():
    """A tier of more blocks than a pool holds (2**31 - 3: slot ids are 32-bit) is a config
    error naming the tier (exit 2, no traceback); a big tier within the limit replays with
    its columns reserved but untouched."""
    code = ("import resource, sys\n"
            "from kvstrata.cli import main\n"
            "rc = main(['replay', '--tiers', sys.argv[1], '--limit', '200',"
            " '--json', '--no-progress'])\n"
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\n"
            "sys.exit(rc)\n")
    absurd = subprocess.run([sys.executable, "-c", code, "G1=99999999999999999999999"],
                            capture_output=True, timeout=300, text=True)
    assert absurd.returncode == 2
    message = absurd.stderr.strip().splitlines()[0]
    assert "tier G1" in message and "2,147,483,645" in message and "Traceback" not in absurd.stderr
    big = subprocess.run([sys.executable, "-c", code, "G1=100000000,G2=200000000"],
                         capture_output=True, timeout=300, text=True)
    assert big.returncode == 0, big.stderr[-2000:]
    peak_kib = int(big.stderr.strip().splitlines()[-1])
    assert peak_kib < 2 * 1024 * 1024, f"peak RSS {peak_kib} KiB"


def test_a_manager_no_machine_can_hold_is_a_config_error_naming_the_tier(tmp_path):
    pytest.importorskip("torch")
    from kvstrata.config import KvConfig, ModelGeometry, TierConfig
    from kvstrata.config import ConfigError
    from kvstrata.manager import KvBlockManager, ManagerConfigError

    model = ModelGeometry(num_layers=64, kv_heads=8, head_dim=128)     # 4 MiB blocks
    big = 2 * 10 ** 9          # within the blocks a pool holds; no machine's RAM or disk
    for tiers, tier in (({"G1": TierConfig(blocks=big)}, "G1"),
                        ({"G1": TierConfig(blocks=8), "G2": TierConfig(blocks=big)}, "G2"),
                        ({"G1": TierConfig(blocks=8), "G2": TierConfig(blocks=8),
                          "G3": TierConfig(blocks=big)}, "G3")):
        with pytest.raises(ManagerConfigError, match=f"tier {tier} needs"):
            KvBlockManager(KvConfig(tiers=tiers, model=model), disk_dir=str(tmp_path))
    # more blocks than a pool holds: the config itself is refused, naming the tier
    for tiers, tier in (({"G1": TierConfig(blocks=10 ** 12)}, "G1"),
                        ({"G1": TierConfig(blocks=8), "G2": TierConfig(blocks=8),
                          "G3": TierConfig(blocks=10 ** 15)}, "G3")):
        with pytest.raises(ConfigError, match=f"tier {tier}: .* more than a tier holds"):
            KvBlockManager(KvConfig(tiers=tiers, model=model), disk_dir=str(tmp_path))
    assert list(tmp_path.iterdir()) == []
