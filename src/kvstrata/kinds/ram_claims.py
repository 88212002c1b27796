"""Host RAM that kvstrata's host tiers take on this machine, counted across processes.

A host tier (G2) is checked at start against this machine's RAM (:mod:`.host`), but that
check sees one process. The engines of a data-parallel vLLM server (each has its own G2),
several servers on one host, or SGLang's ranks each pass it alone, and together can take
more RAM than the machine has: the kernel's OOM killer then ends one of them while it
serves. So a host tier *claims* its bytes before it allocates them (:func:`claim_host_ram`):

* a claim is a small file in a directory of this user's alone
  (``/dev/shm/kvstrata-ram-<uid>``, or ``$KVSTRATA_RAM_CLAIMS_DIR``: :func:`claims_directory`;
  0700, created so), named with the claimant's owner tag
  (:func:`~kvstrata.physical.leftovers.owner_tag`) and holding the bytes and the
  claimant's start time;
* under an exclusive lock on that directory, the claims of processes that are gone (no such
  pid, or a pid reused by a process started at another time) are removed, and a claim that
  would bring the live ones over this machine's RAM is refused, naming what holds the rest;
* a claim is released when its tier closes; one left by a killed process is removed by the
  next claim;
* the count is best effort, never a new reason to fail: where the directory is missing,
  someone else's, writable by others, or cannot be written, or its lock is held for over
  :data:`LOCK_TIMEOUT` seconds, the tier goes uncounted with a warning (the per-process check
  still applies).

The scope is this user on this host and pid namespace: another user's files are not read,
and another container's processes cannot be told alive or dead (their claims are neither
counted nor removed).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import secrets
import time

from ..config import format_size
from ..paths import NotPrivateError, check_private_file, make_private_directory
from ..physical.capacity import physical_memory
from ..physical.errors import StorageConfigError
from ..physical.leftovers import owner_tag, process_alive

__all__ = ["RamClaim", "claim_host_ram", "claims_directory", "held_claims", "DIRECTORY_ENV"]

DIRECTORY_ENV = "KVSTRATA_RAM_CLAIMS_DIR"
"""Names the claims directory instead of ``/dev/shm/kvstrata-ram-<uid>`` (every process
that shares the machine's RAM must name the same one)."""
LOCK_TIMEOUT = 10.0
"""Seconds a claim waits for the lock (another process claiming, or one stopped or forked
while it held it) before it goes uncounted, with a warning."""

log = logging.getLogger(__name__)

PREFIX = "claim-"
_NAME = re.compile(r"^claim-h[0-9a-f]{8}-(\d+)-[0-9a-f]{8}$")
_MAX_CLAIM_BYTES = 64
"""Longest claim file read (two numbers)."""


class RamClaim:
    """Host RAM held by one host tier of this process until :meth:`release`."""

    def __init__(self, path: str, nbytes: int) -> None:
        self.path: str | None = path
        self.nbytes = nbytes
        self._pid = os.getpid()

    def release(self) -> None:
        """Give the bytes back (idempotent; a forked child's copy gives back nothing)."""
        path, self.path = self.path, None
        if path is not None and os.getpid() == self._pid:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def claims_directory() -> str | None:
    """Where this user's claims on this machine are kept: ``$KVSTRATA_RAM_CLAIMS_DIR``, else
    ``/dev/shm/kvstrata-ram-<uid>`` (memory, as what it counts: emptied by a reboot, private
    to a container that has its own). None where neither is set or usable (no /dev/shm, or
    one this process cannot write): host RAM is then not counted across processes. The
    directory stays between processes, with its lock file; claims come and go."""
    named = os.environ.get(DIRECTORY_ENV)
    if named:
        return named
    if not os.access("/dev/shm", os.W_OK | os.X_OK) or not os.path.isdir("/dev/shm"):
        return None
    return os.path.join("/dev/shm", f"kvstrata-ram-{os.geteuid()}")


def claim_host_ram(nbytes: int, what: str, *, directory: str | None = None,
                   ram: int | None = None, lock_timeout: float = LOCK_TIMEOUT
                   ) -> RamClaim | None:
    """Claim ``nbytes`` of host RAM for ``what`` (a tier, named in the error), or raise
    :class:`~kvstrata.physical.errors.StorageConfigError` if the live claims of this user's
    processes on this machine and these bytes together exceed ``ram`` (default: this
    machine's). The count is best effort: None, claiming nothing (with a warning where
    something failed), where the machine does not say its RAM, there is no claims directory,
    it cannot be trusted or written, or its lock is not had within ``lock_timeout`` seconds
    (see the module docstring)."""
    ram = physical_memory() if ram is None else ram
    directory = claims_directory() if directory is None else directory
    if not ram or nbytes <= 0 or directory is None:
        return None
    try:
        make_private_directory(directory, parents=False)   # a mistyped path makes no tree
        with _locked(directory, lock_timeout):
            live = held_claims(directory, remove_dead=True)
            held = sum(n for _, n in live)
            if held + nbytes > ram:
                pids = sorted({pid for pid, _ in live})
                raise StorageConfigError(
                    f"{what} needs {format_size(nbytes)} of host RAM, and kvstrata's host "
                    f"tiers already hold {format_size(held)} on this machine ({len(live)} "
                    f"tier(s) of process(es) {', '.join(map(str, pids[:8]))}"
                    f"{' ...' if len(pids) > 8 else ''}); together they are over the "
                    f"{format_size(ram)} it has: shrink the host tier (each engine of a "
                    f"data-parallel server, each server, keeps its own)")
            return RamClaim(_write_claim(directory, nbytes), nbytes)
    except (NotPrivateError, OSError) as exc:
        log.warning("kvstrata: host RAM of other processes not counted for %s: %s", what, exc)
        return None


def _write_claim(directory: str, nbytes: int) -> str:
    """A new claim file of this process for ``nbytes``; nothing left if it fails."""
    path = os.path.join(directory, f"{PREFIX}{owner_tag()}-{secrets.token_hex(4)}")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        os.write(fd, f"{nbytes} {_started(os.getpid()) or 0}\n".encode())
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    os.close(fd)
    return path


def held_claims(directory: str, *, remove_dead: bool = False) -> list[tuple[int, int]]:
    """``(pid, bytes)`` of each live claim in ``directory`` (``remove_dead``: the claims of
    processes that are gone are removed; the caller holds the lock)."""
    live = []
    try:
        names = os.listdir(directory)
    except OSError:
        return live
    for name in names:
        match = _NAME.match(name)
        if match is None:
            continue
        pid = int(match.group(1))
        if not name.startswith(f"{PREFIX}{owner_tag(pid)}-"):
            continue                    # another host or pid namespace: cannot be told
        path = os.path.join(directory, name)
        claim = _read(path)
        if claim is not None and _alive(pid, claim[1]):
            live.append((pid, claim[0]))
        elif remove_dead and (claim is not None or not _alive(pid, 0)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    return live


@contextlib.contextmanager
def _locked(directory: str, timeout: float = LOCK_TIMEOUT):
    """The directory's lock, or ``TimeoutError`` (an ``OSError``) after ``timeout``
    seconds."""
    fd = os.open(os.path.join(directory, ".lock"),
                 os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(errno.ETIMEDOUT, f"its lock was held for over "
                                       f"{timeout:g} s", directory) from None
                time.sleep(0.01)
        yield
    finally:
        os.close(fd)


def _read(path: str) -> tuple[int, int] | None:
    """(bytes, start time) of a claim file, or None where it is not a whole one of ours."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        check_private_file(fd, path, tighten=False)
        fields = os.read(fd, _MAX_CLAIM_BYTES).split()
        nbytes, started = (int(f) for f in fields) if len(fields) == 2 else (None, None)
    except (NotPrivateError, OSError, ValueError):
        return None
    finally:
        os.close(fd)
    return None if nbytes is None or nbytes < 0 else (nbytes, started)


def _alive(pid: int, started: int) -> bool:
    """Whether ``pid`` is the live process that started at ``started`` (clock ticks after
    boot; 0: any process of that pid). A zombie (killed, not yet reaped) is not: its memory
    is gone."""
    now = _started(pid)
    if now is not None:
        return now > 0 and (not started or now == started)
    return process_alive(pid)


def _started(pid: int) -> int | None:
    """When ``pid`` started (``/proc/<pid>/stat``'s starttime; 0 for a zombie or a dead
    process not yet gone), or None where it cannot be read (no such process, no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read(4096)
        fields = stat[stat.rindex(b")") + 2:].split()
        return 0 if fields[0] in (b"Z", b"X") else int(fields[19])
    except (OSError, ValueError, IndexError):
        return None
