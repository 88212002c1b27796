"""Hostile tests of where a durable G3 lives: its home directory, the lock that keeps it to
one process, what a damaged home does to a start, races between processes, fd leaks."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
import types
from pathlib import Path

import pytest

from kvstrata.manager import KvBlockManager, ManagerConfigError
from kvstrata.physical import FileOps
from kvstrata.physical.errors import DiskFullError, StorageConfigError
from kvstrata.physical.storage import disk_home
from kvstrata.physical.storage.disk_home import DiskTierBusyError, DiskTierHome

from ._util import (FP, OTHER_FP, fd_count, home_of, open_durable, read_ok, settled_fd_count,
                    small_manager_config, write)

CLAIMER = Path(__file__).with_name("claimer.py")
SEQS = [0x1111, 0x2222]


def _prepared(tmp_path):
    disk = open_durable(tmp_path)
    write(disk, [0, 1], SEQS)
    disk.close()
    return home_of(tmp_path)


def _reopen_after(tmp_path, repair):
    """After a failed open and ``repair()``, the same process can open the home again (the
    lock was released) and the blocks are intact."""
    repair()
    disk = open_durable(tmp_path)
    try:
        assert all(read_ok(disk, s, q) for s, q in enumerate(SEQS))
    finally:
        disk.close()


def _make_fifo(path: Path):
    path.unlink()
    os.mkfifo(path)


# --------------------------------------------------------------------------- damaged homes
@pytest.mark.parametrize("name", ["slab", "index", "index.tmp", "lock"])
def test_a_home_file_that_is_a_directory_costs_no_fd_and_no_lock(tmp_path, name):
    home = _prepared(tmp_path)
    path = home / name
    if path.exists():
        path.unlink()
    path.mkdir()
    before = settled_fd_count()
    with pytest.raises(StorageConfigError):           # typed, naming the file
        open_durable(tmp_path)
    assert fd_count() <= before                       # a leak is growth
    path.rmdir()
    if name == "index":       # the journal is gone: nothing recovered, but the home opens
        disk = open_durable(tmp_path)
        assert len(disk.recovered) == 0
        disk.close()
    elif name == "slab":      # the bytes are gone: entries recovered, every read refused
        disk = open_durable(tmp_path)
        assert len(disk.recovered) == 2
        assert not any(read_ok(disk, s, q) for s, q in enumerate(SEQS))
        disk.close()
    else:
        _reopen_after(tmp_path, lambda: None)


@pytest.mark.parametrize("name", ["slab", "index", "index.tmp", "lock"])
def test_a_home_file_that_is_a_directory_is_a_typed_error(tmp_path, name):
    home = _prepared(tmp_path)
    path = home / name
    if path.exists():
        path.unlink()
    path.mkdir()
    with pytest.raises(StorageConfigError):
        open_durable(tmp_path)


def test_manager_on_a_damaged_home_is_a_config_error(tmp_path):
    config = small_manager_config()
    KvBlockManager(config, disk_dir=str(tmp_path)).close()
    home = next(tmp_path.glob("kvstrata-g3-r0-*"))
    (home / "slab").unlink()
    (home / "slab").mkdir()
    with pytest.raises(ManagerConfigError):
        KvBlockManager(config, disk_dir=str(tmp_path))


def test_manager_on_a_damaged_home_leaves_no_threads_and_no_lock(tmp_path):
    config = small_manager_config()
    KvBlockManager(config, disk_dir=str(tmp_path)).close()
    home = next(tmp_path.glob("kvstrata-g3-r0-*"))
    (home / "slab").unlink()
    (home / "slab").mkdir()
    threads, fds = threading.active_count(), settled_fd_count()
    with pytest.raises(Exception):
        KvBlockManager(config, disk_dir=str(tmp_path))
    assert threading.active_count() <= threads and fd_count() <= fds   # a leak is growth
    (home / "slab").rmdir()
    KvBlockManager(config, disk_dir=str(tmp_path)).close()     # not locked by the failure


def test_a_home_that_is_a_file_is_a_typed_error(tmp_path):
    home = home_of(tmp_path)
    home.write_text("not a directory")
    with pytest.raises(StorageConfigError, match="is not a directory"):
        open_durable(tmp_path)
    with pytest.raises(ManagerConfigError):
        from kvstrata.compat import compatibility_of
        fp = compatibility_of(small_manager_config()).fingerprint
        (tmp_path / f"kvstrata-g3-r0-{fp}").write_text("x")
        KvBlockManager(small_manager_config(), disk_dir=str(tmp_path))
    assert home.read_text() == "not a directory"


def test_a_lock_that_is_a_fifo_is_a_typed_error_and_leaks_nothing(tmp_path):
    home = _prepared(tmp_path)
    _make_fifo(home / "lock")
    before = fd_count()
    try:
        with pytest.raises(StorageConfigError):
            open_durable(tmp_path)
    finally:
        leaked = fd_count() - before
    assert leaked == 0


def test_an_unwritable_lock_file_is_a_typed_error(tmp_path):
    home = _prepared(tmp_path)
    lock = home / "lock"
    if subprocess.run(["chattr", "+i", str(lock)], capture_output=True).returncode != 0:
        pytest.fail("chattr +i unavailable here")      # strict xfail: still fails
    try:
        with pytest.raises(StorageConfigError):
            open_durable(tmp_path)
    finally:
        subprocess.run(["chattr", "-i", str(lock)], capture_output=True)


def test_a_slab_symlink_is_not_followed_into_another_file(tmp_path):
    home = _prepared(tmp_path)
    victim = tmp_path / "precious.dat"
    victim.write_bytes(b"precious" * 10)
    (home / "slab").unlink()
    (home / "slab").symlink_to(victim)
    try:
        disk = open_durable(tmp_path)
        disk.close()
    except StorageConfigError:
        pass
    assert victim.read_bytes() == b"precious" * 10


# --------------------------------------------------------------------------- one process
def test_same_process_second_claim_is_busy_and_the_first_keeps_working(tmp_path):
    disk = open_durable(tmp_path)
    try:
        with pytest.raises(DiskTierBusyError, match="in use by another process"):
            open_durable(tmp_path)
        write(disk, [0, 1], SEQS)
        assert all(read_ok(disk, s, q) for s, q in enumerate(SEQS))
    finally:
        disk.close()
    disk = open_durable(tmp_path)
    assert {e.sequence_hash for e in disk.recovered} == set(SEQS)
    disk.close()


def _spawn(directory, fingerprint, go):
    return subprocess.Popen([sys.executable, str(CLAIMER), str(directory), fingerprint, str(go)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_processes_racing_for_one_home_get_exactly_one_owner(tmp_path):
    for round_ in range(1):
        go = tmp_path / f"go{round_}"
        procs = [_spawn(tmp_path, FP, go) for _ in range(4)]
        try:
            for p in procs:
                assert p.stdout.readline().strip() == "ready", p.stderr.read()
            go.touch()
            answers = [p.stdout.readline().strip() for p in procs]
            assert sum(a.startswith("OK") for a in answers) == 1, answers
            assert sum(a == "BUSY" for a in answers) == 3, answers
            owner = next(a for a in answers if a.startswith("OK")).split()[1]
            assert (home_of(tmp_path) / "lock").read_text().strip() == owner
            # while another process owns it, this one is refused too
            with pytest.raises(DiskTierBusyError, match=f"pid {owner}"):
                open_durable(tmp_path)
        finally:
            for p in procs:
                p.stdin.close()
                p.wait(30)
                p.stdout.close()
                p.stderr.close()
    assert sorted(p.name for p in home_of(tmp_path).iterdir()) == ["index", "lock", "slab"]


def test_a_killed_owner_releases_its_home(tmp_path):
    go = tmp_path / "go"
    go.touch()
    proc = _spawn(tmp_path, FP, go)
    try:
        assert proc.stdout.readline().strip() == "ready"
        assert proc.stdout.readline().startswith("OK")
        proc.kill()
        proc.wait(30)
    finally:
        proc.stdout.close()
        proc.stderr.close()
        proc.stdin.close()
    disk = open_durable(tmp_path)
    disk.close()


# --------------------------------------------------------------------------- stale homes
def test_stale_homes_of_this_rank_go_others_stay(tmp_path):
    stale = open_durable(tmp_path, fingerprint=OTHER_FP)
    write(stale, [0], [1])
    stale.close()
    other_rank = open_durable(tmp_path, fingerprint=OTHER_FP, rank=1)
    other_rank.close()
    held = open_durable(tmp_path, fingerprint="00000000000000aa")      # live: must stay
    not_ours = tmp_path / "kvstrata-g3-r0-notahexfingerprint"
    not_ours.mkdir()
    try:
        disk = open_durable(tmp_path)
        names = sorted(p.name for p in tmp_path.iterdir())
        assert home_of(tmp_path, OTHER_FP, 0).name not in names
        assert home_of(tmp_path, OTHER_FP, 1).name in names
        assert home_of(tmp_path, "00000000000000aa", 0).name in names
        assert not_ours.name in names
        disk.close()
    finally:
        held.close()


def test_claim_race_never_lets_two_owners_share_a_home(tmp_path, monkeypatch):
    real = disk_home.fcntl
    others: list = []
    state = {"armed": True}

    def flock(fd, op):
        if state["armed"] and op & real.LOCK_NB and os.readlink(f"/proc/self/fd/{fd}") \
                .startswith(str(home_of(tmp_path))):
            state["armed"] = False
            # the window between open(lock) and flock(lock) of the first claimant:
            others.append(DiskTierHome.claim(tmp_path, tier="g3", rank=0,
                                             fingerprint=OTHER_FP))   # removes our home
            others.append(open_durable(tmp_path))                     # re-creates it
        return real.flock(fd, op)

    monkeypatch.setattr(disk_home, "fcntl", types.SimpleNamespace(
        flock=flock, LOCK_EX=real.LOCK_EX, LOCK_NB=real.LOCK_NB, LOCK_UN=real.LOCK_UN))
    first = None
    try:
        try:
            first = open_durable(tmp_path)
        except (DiskTierBusyError, StorageConfigError, OSError):
            return                                   # refused: no sharing
        third = others[1]
        assert first.path != third.path, "two live storages own one G3 home"
    finally:
        if first is not None:
            first.close()
        for o in reversed(others):
            (o.release if isinstance(o, DiskTierHome) else o.close)()


# --------------------------------------------------------------------------- leaks
def test_no_fd_or_thread_leak_over_many_open_close_cycles(tmp_path):
    disk = open_durable(tmp_path)
    disk.close()
    fds, threads = settled_fd_count(), threading.active_count()
    for i in range(150):
        disk = open_durable(tmp_path)
        write(disk, [i % 16], [0x7000 + i])
        if i % 10 == 0:
            try:
                open_durable(tmp_path)
            except DiskTierBusyError:
                pass
        disk.close()
    assert fd_count() <= fds and threading.active_count() <= threads     # a leak is growth


def test_no_fd_or_thread_leak_over_manager_restarts(tmp_path):
    config = small_manager_config()
    KvBlockManager(config, disk_dir=str(tmp_path)).close()
    fds, threads = settled_fd_count(), threading.active_count()
    for _ in range(15):
        with KvBlockManager(config, disk_dir=str(tmp_path)):
            with pytest.raises(ManagerConfigError):
                KvBlockManager(config, disk_dir=str(tmp_path))
    # a leak is growth (one CI run saw one fewer: something of an earlier test closing)
    assert fd_count() <= fds and threading.active_count() <= threads


# --------------------------------------------------------------------------- bad fingerprints
@pytest.mark.parametrize("fingerprint", ["0123456789abcdef0", "../../escaped", "ünïcødé"])
def test_a_malformed_fingerprint_is_refused_before_anything_is_made(tmp_path, fingerprint):
    parent = tmp_path / "disk"
    parent.mkdir()
    with pytest.raises((StorageConfigError, ValueError)):
        disk = open_durable(parent, fingerprint=fingerprint)
        write(disk, [0], [5])
        disk.close()
        again = open_durable(parent, fingerprint=fingerprint)
        recovered = len(again.recovered)
        again.close()
        assert recovered == 1, "stored under this fingerprint, not recovered by it"
    assert list(parent.iterdir()) == [] and sorted(tmp_path.iterdir()) == [parent]


class _RefusesDirectIO(FileOps):
    """A filesystem that refuses O_DIRECT (FUSE, some overlays)."""

    def open(self, path, flags, mode=0o600):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return super().open(path, flags, mode)


class _OverQuota(FileOps):
    """A user quota: free space on the filesystem, but no room for this user's slab."""

    def fallocate(self, fd, offset, length):
        raise OSError(errno.EDQUOT, "Disk quota exceeded")


@pytest.mark.parametrize("failing", [dict(o_direct=True, file_ops=_RefusesDirectIO()),
                                     dict(file_ops=_OverQuota())], ids=["o_direct", "quota"])
def test_a_failed_start_for_another_model_loses_nothing_and_leaves_nothing(tmp_path, failing):
    """Another model's home is removed only once the new tier stands: a start that fails
    keeps the blocks stored before, and takes away the home it made itself."""
    disk = open_durable(tmp_path)
    write(disk, [0, 1], [0x11, 0x22])
    disk.close()
    before = sorted(os.listdir(tmp_path))
    with pytest.raises((StorageConfigError, DiskFullError)):
        open_durable(tmp_path, fingerprint=OTHER_FP, **failing)
    assert sorted(os.listdir(tmp_path)) == before
    disk = open_durable(tmp_path)
    try:
        assert sorted(e.slot for e in disk.recovered) == [0, 1]
        assert read_ok(disk, 0, 0x11) and read_ok(disk, 1, 0x22)
    finally:
        disk.close()
    disk = open_durable(tmp_path, fingerprint=OTHER_FP)        # a start that works does
    disk.close()
    assert sorted(os.listdir(tmp_path)) == [home_of(tmp_path, OTHER_FP).name]


def test_a_failed_start_in_its_own_home_keeps_the_home(tmp_path):
    disk = open_durable(tmp_path)
    write(disk, [0, 1], [0x11, 0x22])
    disk.close()
    with pytest.raises(StorageConfigError):
        open_durable(tmp_path, o_direct=True, file_ops=_RefusesDirectIO())
    disk = open_durable(tmp_path)
    try:
        assert sorted(e.slot for e in disk.recovered) == [0, 1]
    finally:
        disk.close()


def test_homes_in_a_directory_others_can_write_are_never_removed_as_stale(tmp_path, caplog):
    """Where anyone may rename entries (writable by others, no sticky bit), a home under a
    stale name may be this model's own, renamed: nothing is removed."""
    shared = tmp_path / "shared"
    shared.mkdir()
    disk = open_durable(shared)
    write(disk, [0, 1], [0x11, 0x22])
    disk.close()
    os.chmod(shared, 0o777)
    open_durable(shared, fingerprint=OTHER_FP).close()
    assert home_of(shared).is_dir() and "another user can rename" in caplog.text
    os.chmod(shared, 0o1777)                    # sticky: only the owner renames its entries
    open_durable(shared, fingerprint=OTHER_FP).close()
    assert not home_of(shared).exists()


def test_a_failed_start_never_removes_blocks_stored_while_it_claimed_the_home(tmp_path,
                                                                             monkeypatch):
    """Another process of the same model may make the home and store blocks between this
    start's look and its lock; this start then fails (a quota) and gives the home up, but
    it must not remove what the other stored: only a home empty under the lock is removed."""
    make_home = disk_home._make_home

    def another_process_first(path):
        monkeypatch.setattr(disk_home, "_make_home", make_home)
        other = open_durable(tmp_path)               # makes the home, stores, closes
        write(other, [0, 1], [0x11, 0x22])
        other.close()
        return make_home(path)

    monkeypatch.setattr(disk_home, "_make_home", another_process_first)
    with pytest.raises((StorageConfigError, DiskFullError)):
        open_durable(tmp_path, file_ops=_OverQuota())
    disk = open_durable(tmp_path)
    try:
        assert sorted(e.slot for e in disk.recovered) == [0, 1]
    finally:
        disk.close()
