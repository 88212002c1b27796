"""Where a durable disk tier lives, and the lock that keeps it to one process.

A durable G3 keeps its slab and index in ``<directory>/kvstrata-g3-r<rank>-<fingerprint>/``:
the configured directory, this rank, and the compatibility fingerprint of the blocks
(:mod:`kvstrata.compat`), so a restart with the same model and geometry finds its blocks
again and anything else never reads them.

:meth:`DiskTierHome.claim` creates the directory and takes an exclusive ``flock`` on its
``lock`` file (released by the kernel when the process dies, however it dies); a second
process gets :class:`DiskTierBusyError` naming the holder. Homes of the same rank made for
another fingerprint (the model or geometry changed) and not locked by a live process are
removed, in one log line, once the new tier stands (:meth:`DiskTierHome.remove_stale`: a
start that fails loses nothing), so the configured directory never holds more than one tier's
worth per rank. Homes of other ranks are never touched (they may be starting right now), nor
homes of other users.

A home and its files are the running user's alone (:func:`kvstrata.paths.make_private_directory`):
a home that is a symbolic link, belongs to another user or is writable by group or others is
refused with the reason (anyone could have put blocks there that an engine would be served),
files are created 0600 and the home 0700 whatever the umask, and an owned home or file others
can read is made private.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import shutil
import stat
from pathlib import Path

from ...paths import NotPrivateError, check_private_file, make_private_directory
from ..errors import StorageConfigError

__all__ = ["DiskTierHome", "DiskTierBusyError", "check_fingerprint", "home_name"]

log = logging.getLogger(__name__)

_HOME_RE = re.compile(r"^kvstrata-(?P<tier>[a-z0-9]+)-r(?P<rank>\d+)-(?P<fp>[0-9a-f]{16})$")
_FINGERPRINT_RE = re.compile(r"^[0-9a-f]{16}$")
_TIER_RE = re.compile(r"^[a-z0-9]{1,16}$")


class DiskTierBusyError(StorageConfigError):
    """Another live process holds this disk tier's directory."""


def home_name(tier: str, rank: int, fingerprint: str) -> str:
    """The directory name of a durable tier: ``kvstrata-g3-r0-<fingerprint>``."""
    return f"kvstrata-{tier.lower()}-r{rank}-{fingerprint}"


class DiskTierHome:
    """The claimed directory of one durable disk tier; :meth:`release` gives it up."""

    def __init__(self, path: Path, lock_fd: int, empty: bool, tier: str, rank: int,
                 describe: str) -> None:
        self.path = path
        self._lock_fd = lock_fd
        self._empty = empty
        """Whether the home held nothing but its lock when claimed (under the lock)."""
        self._tier, self._rank, self._describe = tier, rank, describe
        self.removed_stale: list[str] = []
        """Names of stale homes (other fingerprints, same rank) :meth:`remove_stale` removed."""

    @classmethod
    def claim(cls, directory: str | os.PathLike, *, tier: str, rank: int, fingerprint: str,
              describe: str = "") -> "DiskTierHome":
        """Create (or reuse) and lock this tier's home under ``directory``. Homes of other
        fingerprints stay until :meth:`remove_stale`, once the tier is built: a start that
        fails loses nothing another model stored."""
        check_fingerprint(fingerprint)
        if not isinstance(tier, str) or not _TIER_RE.match(tier.lower()) \
                or isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise StorageConfigError(f"disk tier home: tier {tier!r} and rank {rank!r} must be "
                                     f"a short name and an integer >= 0")
        path = Path(directory) / home_name(tier, rank, fingerprint)
        _make_home(path)
        lock_fd = _lock_home(path)
        try:      # decided under the lock: another process may have stored blocks until now
            empty = set(os.listdir(path)) <= {"lock"}
        except OSError:
            empty = False
        return cls(path, lock_fd, empty, tier, rank, describe)

    def remove_stale(self) -> list[str]:
        """Remove the homes of this tier and rank made for another fingerprint (the model
        or geometry changed) that no live process holds; their names, logged in one line."""
        removed = _remove_stale(self.path.parent, self._tier, self._rank, self.path.name)
        if removed:
            log.warning("kvstrata %s: no blocks stored for this model and geometry (%s) in %s; "
                        "starting fresh and removing %d home(s) of another fingerprint: %s",
                        self._tier, self._describe or self.path.name, self.path.parent,
                        len(removed), ", ".join(removed))
        self.removed_stale += removed
        return removed

    def abandon(self) -> None:
        """Give up a home whose tier could not be built: removed if it held nothing but its
        lock when claimed (no blocks of anyone's: whatever is in it now, this start made),
        then released."""
        if self._empty and self._lock_fd >= 0:
            shutil.rmtree(self.path, ignore_errors=True)
        self.release()

    def release(self) -> None:
        """Unlock (the directory and its files stay for the next start). Idempotent."""
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


def check_fingerprint(fingerprint: str) -> None:
    """A compatibility fingerprint is 16 lowercase hex digits (:mod:`kvstrata.compat`);
    anything else would name another directory, or none."""
    if not isinstance(fingerprint, str) or not _FINGERPRINT_RE.match(fingerprint):
        raise StorageConfigError(f"a fingerprint is 16 lowercase hex digits, got "
                                 f"{fingerprint!r:.80}")


def _lock_home(path: Path, attempts: int = 5) -> int:
    """Lock ``path``'s lock file; retried if the home was removed and made again while this
    process waited (the lock must be on the file the directory holds now)."""
    for _ in range(attempts):
        fd = _lock(path)
        try:
            current = os.stat(path / "lock", follow_symlinks=False)
            mine = os.fstat(fd)
            if (current.st_dev, current.st_ino) == (mine.st_dev, mine.st_ino):
                return fd
        except OSError:
            pass
        os.close(fd)                     # locked a file that is gone: try the new one
        _make_home(path)
    raise DiskTierBusyError(f"disk tier directory {path} keeps being replaced by another "
                            f"process; give each process its own disk directory")


def _make_home(path: Path) -> None:
    """Create the home (0700) or check it is this user's alone."""
    try:
        make_private_directory(path)
    except NotPrivateError as exc:
        raise StorageConfigError(f"disk tier directory {path} {exc.strerror}") from None
    except OSError as exc:
        raise StorageConfigError(f"cannot create disk tier directory {path}: "
                                 f"{exc.strerror or exc}") from exc


def private_file(fd: int, path: Path, *, tighten: bool = True) -> None:
    """:func:`~kvstrata.paths.check_private_file` for a file of a home, as a
    :class:`StorageConfigError`."""
    try:
        check_private_file(fd, path, tighten=tighten)
    except NotPrivateError as exc:
        raise StorageConfigError(f"{path} {exc.strerror}") from None


def _lock(path: Path) -> int:
    lock_path = path / "lock"
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise StorageConfigError(f"cannot open {lock_path}: {exc.strerror or exc}") from exc
    try:
        private_file(fd, lock_path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise StorageConfigError(f"cannot lock {lock_path}: "
                                         f"{exc.strerror or exc}") from exc
            holder = ""
            try:
                holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
            except OSError:
                pass
            raise DiskTierBusyError(
                f"disk tier directory {path} is in use by another process"
                f"{f' (pid {holder})' if holder else ''}; give each process its own disk "
                f"directory") from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as exc:
            raise StorageConfigError(f"cannot write {lock_path}: {exc.strerror or exc}") from exc
    except BaseException:
        os.close(fd)
        raise
    return fd


def _remove_stale(parent: Path, tier: str, rank: int, mine: str) -> list[str]:
    removed = []
    try:
        names = sorted(os.listdir(parent))
        info = os.stat(parent)
    except OSError:
        return removed
    if info.st_uid not in (os.geteuid(), 0) or (info.st_mode & 0o022
                                                 and not info.st_mode & stat.S_ISVTX):
        # Whoever else may rename entries here (the directory's owner, or anyone where
        # others can write it without the sticky bit) could have given this model's own
        # home a stale one's name: remove nothing.
        log.warning("kvstrata %s: homes of other fingerprints in %s are left: another user "
                    "can rename what is in that directory (give the disk tier a directory of "
                    "its own)", tier, parent)
        return removed
    for name in names:
        match = _HOME_RE.match(name)
        if (match is None or name == mine or match["tier"] != tier.lower()
                or int(match["rank"]) != rank):
            continue
        home = parent / name
        try:
            info = os.lstat(home)
        except OSError:
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
            continue                                  # a link, or another user's: not ours
        try:
            fd = os.open(home / "lock",
                         os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            fd = -1
        except OSError:
            continue
        try:
            if fd >= 0:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)   # in use: leave it
            shutil.rmtree(home, ignore_errors=True)
            removed.append(name)
        except OSError:
            pass
        finally:
            if fd >= 0:
                os.close(fd)
    return removed
