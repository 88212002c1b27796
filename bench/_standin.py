"""The stand-in remote store of the engine benchmarks: SeaweedFS and slow links, kept off the
engine's CPU as a store on another host would be.

A bench that needs a remote object tier starts :class:`StandinStore`: one SeaweedFS
(``weed mini``) and, per configuration, a :mod:`kvstrata.testing.slowlink` process in front of it.
Both run on the engine's machine, so on a small VM they compete with the engine for its cores
(a real remote store would not). :class:`CpuBudget` confines them, after they start, to a hard
CPU budget, like a store on a host of its own with that much CPU: a cgroup with a CPU quota
(``cpu.max`` on cgroup v2; ``cpu.cfs_quota_us`` on a v1 ``cpu`` hierarchy where the controller
is bound there, as on hybrid hosts) at the normal weight. The quota bounds what they can take
from the engine in any period, which the idle class could not: on a kernel built
``PREEMPT_NONE`` a task inside a system call keeps its CPU whatever its class, so SeaweedFS in
``SCHED_IDLE`` still took 80-360 ms of a 2-s prefill during upload bursts. The group is not
given the idle weight (``cpu.idle``): with two busy threads standing for the engine's compute
threads, a store so weighted completed none of 16 PUTs within their 5-s timeout (starved:
the engine's G4 stayed empty), while the quota alone carried 9.3 MB/s. Where no cgroup can be
made (not root, no ``cpu`` controller), the stand-ins' threads go into ``SCHED_IDLE`` at
nice 19 instead (4.6 MB/s, some requests 3 s, in the same test), and :attr:`CpuBudget.kind`
says which.

The cgroup is named with this process's owner tag
(:func:`kvstrata.physical.leftovers.owner_tag`) and removed by :meth:`CpuBudget.close`
(processes still in it are moved back to the hierarchy's root first); one left by a killed
bench is removed by the next :meth:`CpuBudget.open` on the same host. A cgroup2 hierarchy
this module had to mount is unmounted again.

SeaweedFS needs about 1.5 % of one CPU per MB/s it stores (measured on the 2-core VM:
15 % at 10 MB/s of 512-KiB PUTs, 8 % at 5 MB/s, 0.3 % idle) and the link about 0.2 % per
MB/s: :data:`DEFAULT_SHARE` carries the benches' 10 MB/s link with some room (a few % of a
CPU would not); a smaller budget makes the store slower than its link.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import time
from pathlib import Path

from kvstrata.physical.leftovers import owner_tag, reclaim

__all__ = ["CpuBudget", "SlowLinkProcess", "StandinStore", "DEFAULT_SHARE"]

DEFAULT_SHARE = 0.25        # of one CPU: SeaweedFS + the link at 10 MB/s need ~0.17-0.18
# (bursts above that were throttled in 55 of 307 periods at 0.25, carrying 9.3 MB/s)
PERIOD_US = 50_000          # the quota's period (a throttled group waits at most this long)
PREFIX = "kvstrata-standin-"
CGROUP_FS = "/sys/fs/cgroup"


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(filesystem type, mount point, options) of every mount, from /proc/self/mounts."""
    out = []
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 4:
                    out.append((parts[2], parts[1].replace("\\040", " "),
                                set(parts[3].split(","))))
    except OSError:
        pass
    return out


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _rmdir_cgroup(path: Path) -> None:
    """Remove a cgroup: move what is still in it to its parent, then ``rmdir`` (a cgroup's
    files cannot be unlinked; a task still exiting may keep it busy for a moment)."""
    procs = path / "cgroup.procs"
    if procs.exists():
        for pid in procs.read_text().split():
            try:
                _write(path.parent / "cgroup.procs", pid)
            except OSError:
                pass                                   # exited meanwhile
    for attempt in range(50):
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if attempt == 49:
                raise
            time.sleep(0.1)


class CpuBudget:
    """A hard CPU budget of ``share`` of one CPU for processes confined with :meth:`confine`
    (see the module docstring). :meth:`open` makes the cgroup, or settles for ``SCHED_IDLE``;
    :attr:`kind` names what is used, :meth:`describe` says it in a sentence. ``hierarchies``
    overrides where cgroups are looked for (``[]``: none, the fallback; for tests)."""

    def __init__(self, share: float = DEFAULT_SHARE, *, period_us: int = PERIOD_US,
                 hierarchies: list[tuple[str, str]] | None = None) -> None:
        if not 0 < share <= os.cpu_count():
            raise ValueError(f"share must be in (0, {os.cpu_count()}], got {share!r}")
        self.share = share
        self.period_us = period_us
        self.quota_us = max(1000, round(share * period_us))
        self._hierarchies = hierarchies
        self.kind: str | None = None         # "cgroup v2" | "cgroup v1" | "SCHED_IDLE"
        self.path: Path | None = None
        self.reason = ""                     # why the fallback, if it is used
        self._mounted: Path | None = None
        self._enabled_cpu: Path | None = None
        self.confined: list[int] = []

    # -- set-up ----------------------------------------------------------------------------
    def hierarchies(self) -> list[tuple[str, str]]:
        """Candidate (version, root directory) pairs where the ``cpu`` controller can be
        used: a cgroup2 mount whose root offers ``cpu``, then a v1 hierarchy of ``cpu``. With
        no cgroup2 mount at all, one is mounted at :data:`CGROUP_FS` if that is free (root
        only), and unmounted by :meth:`close`."""
        if self._hierarchies is not None:
            return list(self._hierarchies)
        mounts = _mounts()
        if not any(kind == "cgroup2" for kind, _, _ in mounts):
            self._mount_cgroup2(mounts)
            mounts = _mounts()
        found = []
        for kind, where, options in mounts:
            if kind == "cgroup2":
                try:
                    controllers = (Path(where) / "cgroup.controllers").read_text().split()
                except OSError:
                    continue
                if "cpu" in controllers:
                    found.append(("v2", where))
        found += [("v1", where) for kind, where, options in mounts
                  if kind == "cgroup" and "cpu" in options]
        return found

    def _mount_cgroup2(self, mounts) -> None:
        target = Path(CGROUP_FS)
        if os.geteuid() != 0 or any(where == CGROUP_FS for _, where, _ in mounts):
            return
        try:
            if not target.is_dir() or any(target.iterdir()):
                return
        except OSError:
            return
        if subprocess.run(["mount", "-t", "cgroup2", "none", str(target)],
                          capture_output=True).returncode == 0:
            self._mounted = target

    def open(self) -> "CpuBudget":
        """Make the cgroup (the first hierarchy that takes it), else fall back to
        ``SCHED_IDLE``; also remove cgroups left by killed benches. Registers :meth:`close`
        to run at interpreter exit as well."""
        errors = []
        for version, root in self.hierarchies():
            reclaim(root, PREFIX, remove=_rmdir_cgroup)
            try:
                self._make(version, Path(root))
                self.kind = f"cgroup {version}"
                break
            except OSError as exc:
                errors.append(f"{version} at {root}: {exc}")
                self._undo()
        else:
            self.kind = "SCHED_IDLE"
            self.reason = "; ".join(errors) or (
                "no cgroup hierarchy with the cpu controller" if os.geteuid() == 0
                else "not root")
        atexit.register(self.close)
        return self

    def _make(self, version: str, root: Path) -> None:
        path = root / f"{PREFIX}{owner_tag()}-{id(self) & 0xffff:x}"
        if version == "v2":
            subtree = root / "cgroup.subtree_control"
            if "cpu" not in subtree.read_text().split():
                _write(subtree, "+cpu")
                self._enabled_cpu = subtree
        path.mkdir()
        self.path = path
        if version == "v2":
            _write(path / "cpu.max", f"{self.quota_us} {self.period_us}")
        else:
            _write(path / "cpu.cfs_period_us", str(self.period_us))
            _write(path / "cpu.cfs_quota_us", str(self.quota_us))

    # -- use -------------------------------------------------------------------------------
    def confine(self, pid: int) -> None:
        """Put process ``pid`` (every thread, and whatever it starts later) under the
        budget; in the fallback, each of its threads into ``SCHED_IDLE`` at nice 19 (the
        threads they start inherit it)."""
        if self.kind is None:
            raise RuntimeError("CpuBudget.open() first")
        if self.path is not None:
            _write(self.path / "cgroup.procs", str(pid))
        else:
            _idle_threads(pid)
        self.confined.append(pid)

    def members(self) -> list[int]:
        """The processes in the cgroup now (the fallback: those confined and still alive)."""
        if self.path is not None:
            try:
                return [int(x) for x in (self.path / "cgroup.procs").read_text().split()]
            except OSError:
                return []
        return [p for p in self.confined if os.path.exists(f"/proc/{p}")]

    def throttling(self) -> dict:
        """The cgroup's ``cpu.stat``: periods, periods throttled, seconds throttled (a
        store held back by its budget; empty in the fallback)."""
        if self.path is None:
            return {}
        try:
            stat = dict(line.split() for line in (self.path / "cpu.stat").read_text()
                        .splitlines() if len(line.split()) == 2)
        except OSError:
            return {}
        throttled = (int(stat["throttled_usec"]) / 1e6 if "throttled_usec" in stat
                     else int(stat.get("throttled_time", 0)) / 1e9)
        return {"periods": int(stat.get("nr_periods", 0)),
                "throttled_periods": int(stat.get("nr_throttled", 0)),
                "throttled_s": throttled}

    def describe(self) -> str:
        """One sentence: what confines the stand-ins."""
        if self.path is not None:
            limit = (f"cpu.max {self.quota_us} {self.period_us}" if self.kind == "cgroup v2"
                     else f"cpu.cfs_quota_us {self.quota_us} / cpu.cfs_period_us "
                          f"{self.period_us}")
            return (f"{self.kind} {self.path} ({limit}: {self.quota_us / self.period_us:.0%} "
                    f"of one CPU)")
        return f"SCHED_IDLE at nice 19, no CPU quota ({self.reason})"

    # -- tear-down -------------------------------------------------------------------------
    def close(self) -> None:
        """Remove the cgroup (moving what is still in it to the root first), and undo what
        :meth:`open` changed (``+cpu`` it enabled, a cgroup2 it mounted). Idempotent."""
        self._undo()
        atexit.unregister(self.close)

    def _undo(self) -> None:
        path, self.path = self.path, None
        if path is not None:
            _rmdir_cgroup(path)
        subtree, self._enabled_cpu = self._enabled_cpu, None
        if subtree is not None:
            try:
                _write(subtree, "-cpu")
            except OSError:
                pass                       # another group uses it now: leave it on
        mounted, self._mounted = self._mounted, None
        if mounted is not None:
            subprocess.run(["umount", str(mounted)], capture_output=True)

    def __enter__(self) -> "CpuBudget":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()


def _idle_threads(pid: int) -> None:
    """Every thread of ``pid`` into ``SCHED_IDLE`` and nice 19, until no new one appears."""
    done: set[int] = set()
    while True:
        try:
            tids = {int(t) for t in os.listdir(f"/proc/{pid}/task")} - done
        except FileNotFoundError:
            return
        if not tids:
            return
        for tid in tids:
            try:
                os.setpriority(os.PRIO_PROCESS, tid, 19)
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            except (ProcessLookupError, PermissionError, OSError):
                pass
        done |= tids


class SlowLinkProcess:
    """``python -m kvstrata.testing.slowlink`` in front of ``upstream``, as a process of its own (so a
    :class:`CpuBudget` can hold it). :attr:`port`, :attr:`endpoint`; :meth:`close` ends it by
    closing its stdin (then SIGTERM, SIGKILL)."""

    def __init__(self, upstream: tuple[str, int], latency: float = 0.0,
                 bytes_per_s: float | None = None) -> None:
        cmd = [sys.executable, "-m", "kvstrata.testing.slowlink", f"{upstream[0]}:{upstream[1]}",
               "--latency", str(latency)]
        if bytes_per_s:
            cmd += ["--rate", str(bytes_per_s)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        line = self.proc.stdout.readline()
        if not line.strip().isdigit():
            self.close()
            raise RuntimeError(f"the slow link did not start: {line!r}")
        self.port = int(line)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        """End the link process and wait for it. Idempotent."""
        proc = self.proc
        if proc.poll() is None:
            try:
                proc.stdin.close()
                proc.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                proc.terminate()
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for stream in (proc.stdin, proc.stdout):
            try:
                stream.close()
            except (OSError, AttributeError):
                pass


class StandinStore:
    """The stand-in remote store: SeaweedFS and its slow links, each confined to one
    :class:`CpuBudget` as it starts (the bench and the engines are never in it). Sets
    ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` for the engines. Use as a context
    manager, or :meth:`start` and :meth:`close` (which stops everything and removes the
    budget, also on an exception)."""

    def __init__(self, share: float = DEFAULT_SHARE, *, budget: CpuBudget | None = None) -> None:
        self.budget = budget or CpuBudget(share)
        self.weed = None
        self.links: list[SlowLinkProcess] = []

    def start(self) -> "StandinStore":
        from kvstrata.physical.storage.seaweed import SeaweedServer

        try:
            self.budget.open()
            self.weed = SeaweedServer().start()
            self.budget.confine(self.weed.proc.pid)
        except BaseException:
            self.close()
            raise
        os.environ.update(AWS_ACCESS_KEY_ID=self.weed.access_key,
                          AWS_SECRET_ACCESS_KEY=self.weed.secret_key)
        return self

    @property
    def url(self) -> str:
        """The bucket, reached directly (no link)."""
        return f"{self.weed.endpoint_url}/{self.weed.bucket}"

    def link(self, latency: float, bytes_per_s: float | None) -> SlowLinkProcess:
        """A new slow link to the store, confined with it; :meth:`close_link` ends it."""
        link = SlowLinkProcess(("127.0.0.1", self.weed.s3_port), latency, bytes_per_s)
        self.links.append(link)
        self.budget.confine(link.pid)
        return link

    def link_url(self, link: SlowLinkProcess) -> str:
        return f"{link.endpoint}/{self.weed.bucket}"

    def close_link(self, link: SlowLinkProcess) -> None:
        link.close()
        if link in self.links:
            self.links.remove(link)

    def pids(self) -> list[int]:
        """The stand-ins' processes now running (for a turn's CPU accounting)."""
        live = [link.pid for link in self.links if link.proc.poll() is None]
        return ([self.weed.proc.pid] if self.weed is not None and self.weed.running else []) \
            + live

    def describe(self) -> str:
        return f"stand-in store and slow link confined by {self.budget.describe()}"

    def close(self) -> None:
        """Stop the links and SeaweedFS, remove its data, then the budget. Idempotent."""
        try:
            for link in list(self.links):
                self.close_link(link)
            if self.weed is not None:
                self.weed.stop()
                self.weed.cleanup()
        finally:
            self.budget.close()

    def __enter__(self) -> "StandinStore":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
