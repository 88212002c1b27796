"""Host RAM claimed by host tiers across processes (kvstrata.kinds.ram_claims): engines that
each fit the machine alone but not together are refused, claims of processes that are gone
are reclaimed, and nothing is trusted from a directory others could write."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from kvstrata.config import KvConfig, TierConfig
from kvstrata.kinds import StorageOptions, TierSetupError, build_storages
from kvstrata.kinds import ram_claims
from kvstrata.kinds.ram_claims import claim_host_ram, held_claims
from kvstrata.physical.errors import StorageConfigError

MiB = 1 << 20


def _holder(directory, nbytes: int, ram: int) -> subprocess.Popen:
    """Another process that claims ``nbytes`` and holds them until its stdin closes."""
    code = textwrap.dedent(f"""
        import sys
        from kvstrata.kinds.ram_claims import claim_host_ram
        claim = claim_host_ram({nbytes}, "tier G2", directory={str(directory)!r}, ram={ram})
        print("held" if claim is not None else "none", flush=True)
        sys.stdin.read()
        claim.release()
    """)
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "held"
    return child


def test_claims_that_fit_the_machine_alone_but_not_together_are_refused(tmp_path):
    directory = tmp_path / "claims"
    child = _holder(directory, 60 * MiB, ram=100 * MiB)
    try:
        assert held_claims(str(directory)) == [(child.pid, 60 * MiB)]
        with pytest.raises(StorageConfigError, match=rf"tier G2 needs 50.00 MiB.*60.00 MiB.*"
                                                     rf"{child.pid}.*100.00 MiB"):
            claim_host_ram(50 * MiB, "tier G2", directory=str(directory), ram=100 * MiB)
        assert len(held_claims(str(directory))) == 1          # the refused one left nothing
        mine = claim_host_ram(40 * MiB, "tier G2", directory=str(directory), ram=100 * MiB)
        assert sorted(n for _, n in held_claims(str(directory))) == [40 * MiB, 60 * MiB]
    finally:
        child.communicate("")
    assert held_claims(str(directory)) == [(os.getpid(), 40 * MiB)]   # released at its end
    mine.release()
    mine.release()
    assert held_claims(str(directory)) == []


@pytest.mark.parametrize("reaped", [True, False])
def test_the_claim_of_a_killed_process_is_reclaimed_by_the_next_claim(tmp_path, reaped):
    """Killed and reaped, or killed and not yet reaped (a zombie, whose memory is gone
    though its pid and start time are still there)."""
    directory = tmp_path / "claims"
    child = _holder(directory, 90 * MiB, ram=100 * MiB)
    os.kill(child.pid, signal.SIGKILL)
    if reaped:
        child.wait()
    else:
        while ram_claims._started(child.pid) != 0:          # a zombie once it died
            time.sleep(0.01)
    try:
        claim = claim_host_ram(90 * MiB, "tier G2", directory=str(directory), ram=100 * MiB)
        assert held_claims(str(directory)) == [(os.getpid(), 90 * MiB)]
        assert len([n for n in os.listdir(directory) if n.startswith("claim-")]) == 1
        claim.release()
    finally:
        child.wait()


def test_a_claim_of_a_reused_pid_is_the_dead_process_s_not_the_live_one_s(tmp_path):
    directory = tmp_path / "claims"
    claim = claim_host_ram(10 * MiB, "tier G2", directory=str(directory), ram=100 * MiB)
    started = ram_claims._started(os.getpid())
    assert started is not None
    with open(claim.path, "w") as f:                 # as if an earlier process of our pid
        f.write(f"{90 * MiB} {started - 1}\n")
    assert held_claims(str(directory)) == []
    again = claim_host_ram(90 * MiB, "tier G2", directory=str(directory), ram=100 * MiB)
    assert not os.path.exists(claim.path)            # removed under the lock
    again.release()


def _claim_at_once(directory: str, barrier, results) -> None:
    barrier.wait()
    try:
        claim = claim_host_ram(60 * MiB, "tier G2", directory=directory, ram=100 * MiB,
                               lock_timeout=300)
        results.put("claimed")
        barrier.wait()                               # held until both have tried
        claim.release()
    except StorageConfigError:
        results.put("refused")
        barrier.wait()


def test_two_engines_starting_at_once_cannot_both_claim_what_only_one_fits(tmp_path):
    directory = str(tmp_path / "claims")
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(2, timeout=300), ctx.Queue()
    workers = [ctx.Process(target=_claim_at_once, args=(directory, barrier, results),
                           daemon=True) for _ in range(2)]
    try:
        for w in workers:
            w.start()
        assert sorted(results.get(timeout=300) for _ in workers) == ["claimed", "refused"]
    finally:
        for w in workers:
            w.join(60)
            if w.is_alive():
                w.terminate()


def test_a_claim_waits_for_the_lock_and_goes_uncounted_if_it_is_held_too_long(tmp_path,
                                                                            caplog):
    """Another process claiming holds the lock; one stopped (or forked) while it held it
    must not stop every start on the machine: after the timeout, uncounted, with a
    warning."""
    directory = str(tmp_path / "claims")
    claim_host_ram(1 * MiB, "tier G2", directory=directory, ram=100 * MiB).release()
    with ram_claims._locked(directory):
        started = time.monotonic()
        assert claim_host_ram(1 * MiB, "tier G2", directory=directory, ram=100 * MiB,
                              lock_timeout=0.3) is None
        assert time.monotonic() - started >= 0.3
    assert "not counted for tier G2" in caplog.text and "lock was held" in caplog.text
    assert held_claims(directory) == []


def test_a_claim_that_cannot_be_written_goes_uncounted_and_stops_nothing(tmp_path,
                                                                       monkeypatch, caplog):
    directory = str(tmp_path / "claims")

    def full(*args):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(ram_claims, "_write_claim", full)
    assert claim_host_ram(1 * MiB, "tier G2", directory=directory, ram=100 * MiB) is None
    assert "not counted for tier G2" in caplog.text and "No space left" in caplog.text


def test_a_mistyped_claims_directory_creates_no_tree_and_stops_nothing(tmp_path, caplog):
    """The directory itself is made if missing, never its parents: a typo in
    ``KVSTRATA_RAM_CLAIMS_DIR`` leaves RAM uncounted with a warning, not a new tree."""
    directory = tmp_path / "no-such-place" / "claims"
    assert claim_host_ram(1 * MiB, "tier G2", directory=str(directory), ram=100 * MiB) is None
    assert not (tmp_path / "no-such-place").exists()
    assert "not counted for tier G2" in caplog.text
    claim = claim_host_ram(1 * MiB, "tier G2", directory=str(tmp_path / "claims"),
                           ram=100 * MiB)
    assert claim is not None and (tmp_path / "claims").is_dir()
    claim.release()


def test_the_claims_directory_is_named_by_the_environment_or_is_in_dev_shm(monkeypatch):
    monkeypatch.setenv(ram_claims.DIRECTORY_ENV, "/somewhere/claims")
    assert ram_claims.claims_directory() == "/somewhere/claims"
    monkeypatch.delenv(ram_claims.DIRECTORY_ENV)
    expected = (f"/dev/shm/kvstrata-ram-{os.geteuid()}"
                if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None)
    assert ram_claims.claims_directory() == expected


def test_a_forked_childs_copy_of_a_claim_gives_back_nothing(tmp_path):
    directory = str(tmp_path / "claims")
    claim = claim_host_ram(1 * MiB, "tier G2", directory=directory, ram=100 * MiB)
    pid = os.fork()
    if pid == 0:                                      # the child: its exit releases nothing
        claim.release()
        os._exit(0)
    os.waitpid(pid, 0)
    assert held_claims(directory) == [(os.getpid(), 1 * MiB)]
    claim.release()
    assert held_claims(directory) == []


@pytest.mark.parametrize("how", ["group_writable", "symlink", "file"])
def test_a_directory_others_could_write_is_not_trusted_and_nothing_is_claimed(tmp_path, how,
                                                                              caplog):
    directory = tmp_path / "claims"
    if how == "group_writable":
        directory.mkdir(mode=0o700)
        os.chmod(directory, 0o770)
    elif how == "symlink":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        directory.symlink_to(tmp_path / "elsewhere")
    else:
        directory.write_text("")
    assert claim_host_ram(10 * MiB, "tier G2", directory=str(directory),
                          ram=100 * MiB) is None
    assert "not counted for tier G2" in caplog.text
    assert not any(n.startswith("claim-") for n in os.listdir(tmp_path / "elsewhere")) \
        if how == "symlink" else True


def test_files_in_the_directory_that_are_not_claims_of_this_host_are_left_alone(tmp_path):
    directory = tmp_path / "claims"
    claim = claim_host_ram(1 * MiB, "tier G2", directory=str(directory), ram=100 * MiB)
    other_host = directory / "claim-h00000000-1-0123abcd"       # another host's tag
    other_host.write_text(f"{99 * MiB} 1\n")
    junk = directory / "claim-not-a-claim"
    junk.write_text("x")
    assert held_claims(str(directory), remove_dead=True) == [(os.getpid(), 1 * MiB)]
    assert other_host.exists() and junk.exists()
    claim.release()


def test_host_tiers_built_claim_their_bytes_and_give_them_back_on_close(tmp_path,
                                                                       monkeypatch):
    """Two tier sets whose G2s each fit a (pretended) 8 MiB machine, but not both: the
    second build is refused whole, the first's close gives its RAM back."""
    directory = str(tmp_path / "claims")
    monkeypatch.setattr(ram_claims, "claims_directory", lambda: directory)
    monkeypatch.setattr(ram_claims, "physical_memory", lambda: 8 * MiB)
    config = KvConfig(block_size=16, tiers={"G1": TierConfig(blocks=8),
                                            "G2": TierConfig(blocks=40)}).validate()
    options = StorageOptions()
    first = build_storages(config, options)
    g2_bytes = sum(n for _, n in held_claims(directory))
    assert 4 * MiB < g2_bytes <= 8 * MiB
    with pytest.raises(TierSetupError, match="G2.*already hold"):
        build_storages(config, options)
    assert sum(n for _, n in held_claims(directory)) == g2_bytes
    first.close()
    assert held_claims(directory) == []
    second = build_storages(config, options)
    second.close()
