"""Host RAM that kvstrata's host tiers take on this machine, counted across processes.

A host tier (G2) is checked at start against this machine's RAM (:mod:`.host`), but that
check sees one process. The engines of a data-parallel vLLM server (each has its own G2),
several servers on one host, or SGLang's ranks each pass it alone, and together can take
more RAM than the machine has: the kernel's OOM killer then ends one of them while it
serves. So a host tier *claims* its bytes before it allocates them (:func:`claim_host_ram`):

* a claim is a small file in a directory of this user's alone
  (``/dev/shm/kvstrata-ram-<uid>``, see :func:`claims_directory`; 0700, created so; one
  that is not this user's, or that
  others can write, is not trusted: the cross-process count is then skipped with a
  warning, the per-process check still applies), named with the claimant's owner tag
  (:func:`~kvstrata.physical.leftovers.owner_tag`) and holding the bytes and the
  claimant's start time;
* under an exclusive lock on that directory, the claims of processes that are gone (no such
  pid, or a pid reused by a process started at another time) are removed, and a claim that
  would bring the live ones over this machine's RAM is refused, naming what holds the rest;
* a claim is released when its tier closes; one left by a killed process is removed by the
  next claim.

The scope is this user on this host and pid namespace: another user's files are not read,
and another container's processes cannot be told alive or dead (their claims are neither
counted nor removed).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import secrets
import tempfile

from ..config import format_size
from ..paths import NotPrivateError, check_private_file, make_private_directory
from ..physical.capacity import physical_memory
from ..physical.errors import StorageConfigError
from ..physical.leftovers import owner_tag

__all__ = ["RamClaim", "claim_host_ram", "claims_directory", "held_claims"]

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

    def release(self) -> None:
        """Give the bytes back (idempotent)."""
        path, self.path = self.path, None
        if path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def claims_directory() -> str:
    """Where this user's claims on this machine are kept: ``/dev/shm/kvstrata-ram-<uid>``
    (memory, as what it counts: emptied by a reboot, private to a container that has its
    own), else under the temporary directory. The directory stays between processes, with
    the lock file in it; claims come and go."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, f"kvstrata-ram-{os.geteuid()}")


def claim_host_ram(nbytes: int, what: str, *, directory: str | None = None,
                   ram: int | None = None) -> RamClaim | None:
    """Claim ``nbytes`` of host RAM for ``what`` (a tier, named in the error), or raise
    :class:`~kvstrata.physical.errors.StorageConfigError` if the live claims of this user's
    processes on this machine and these bytes together exceed ``ram`` (default: this
    machine's). None, claiming nothing, where the machine does not say its RAM or the
    directory cannot be trusted (see the module docstring)."""
    ram = physical_memory() if ram is None else ram
    if not ram or nbytes <= 0:
        return None
    directory = claims_directory() if directory is None else directory
    try:
        make_private_directory(directory)
    except (NotPrivateError, OSError) as exc:
        log.warning("kvstrata: host RAM of other processes not counted for %s: %s", what, exc)
        return None
    with _locked(directory):
        live = held_claims(directory, remove_dead=True)
        others = sum(n for _, n in live)
        if others + nbytes > ram:
            pids = sorted({pid for pid, _ in live})
            raise StorageConfigError(
                f"{what} needs {format_size(nbytes)} of host RAM, and kvstrata's host tiers "
                f"already hold {format_size(others)} on this machine ({len(live)} tier(s) of "
                f"process(es) {', '.join(map(str, pids[:8]))}{' ...' if len(pids) > 8 else ''}"
                f"); together they are over the {format_size(ram)} it has: shrink the host "
                f"tier (each engine of a data-parallel server, each server, keeps its own)")
        path = os.path.join(directory, f"{PREFIX}{owner_tag()}-{secrets.token_hex(4)}")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        try:
            os.write(fd, f"{nbytes} {_started(os.getpid()) or 0}\n".encode())
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
    return RamClaim(path, nbytes)


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
def _locked(directory: str):
    fd = os.open(os.path.join(directory, ".lock"),
                 os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
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
    boot; 0: any process of that pid)."""
    now = _started(pid)
    if now is not None:
        return not started or now == started
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _started(pid: int) -> int | None:
    """When ``pid`` started (``/proc/<pid>/stat``'s starttime), or None where it cannot be
    read (no such process, no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read(4096)
        return int(stat[stat.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None
