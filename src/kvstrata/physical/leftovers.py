"""What a killed process leaves behind, reclaimed by the next start.

Files and directories that kvstrata creates for the life of one process (a G3 slab, a
temporary directory) carry their owner in their name: :func:`owner_tag` gives
``h<hash of the host name and pid namespace>-<pid>``, e.g.
``kvstrata-g3-h1a2b3c4d-4242-9f3e.slab``. A process that exits or is stopped by a signal it
can handle removes them itself; one killed by SIGKILL (or the OOM killer) cannot.
:func:`reclaim` removes, in one directory, the entries of a given prefix whose owner ran on
this host, in this pid namespace, and is gone. Entries of another host (a shared network
filesystem), of another pid namespace (another container sharing the directory) and of a
live process are left alone; a pid reused by another process makes a leftover look alive,
which only delays its removal.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
from pathlib import Path
from typing import Callable

import xxhash

__all__ = ["owner_tag", "process_alive", "reclaim"]

log = logging.getLogger(__name__)

def _pid_namespace() -> str:
    """The pid namespace this process runs in: a pid means a process only within it."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


# the host, and the pid namespace on it: two containers with one host name that share a
# directory never take each other's live processes for gone
_HOST = "h" + xxhash.xxh32_hexdigest(
    f"{socket.gethostname()}\0{_pid_namespace()}".encode("utf-8", "replace"))
# the tag of kvstrata versions before the namespace was in it: their leftovers are still
# reclaimed (as they were then)
_LEGACY_HOST = "h" + xxhash.xxh32_hexdigest(socket.gethostname().encode("utf-8", "replace"))
_TAG = re.compile(r"-h([0-9a-f]{8})-(\d+)-")


def owner_tag(pid: int | None = None) -> str:
    """``h<host hash>-<pid>``: put it in the name of anything that must not outlive ``pid``."""
    return f"{_HOST}-{os.getpid() if pid is None else pid}"


def process_alive(pid: int) -> bool:
    """Whether a process of this pid exists in this pid namespace (another user's too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True                     # someone else's live process
    return True


def reclaim(directory: str | os.PathLike, prefix: str,
            remove: Callable[[Path], None] | None = None) -> list[str]:
    """Remove the entries of ``directory`` named ``prefix...-<owner tag>-...`` whose owner
    ran on this host and no longer exists; returns what was removed. Never raises: a
    leftover that cannot be removed is logged and left. ``remove`` replaces the default
    removal (a tree or a file), e.g. for a cgroup, which only ``rmdir`` removes."""
    removed: list[str] = []
    try:
        entries = list(Path(directory).iterdir())
    except OSError:
        return removed
    for entry in entries:
        name = entry.name
        if not name.startswith(prefix):
            continue
        match = _TAG.search(name[len(prefix) - 1:])
        if match is None or "h" + match.group(1) not in (_HOST, _LEGACY_HOST):
            continue
        pid = int(match.group(2))
        if pid == os.getpid() or process_alive(pid):
            continue
        try:
            if remove is not None:
                remove(entry)
            elif entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
            removed.append(str(entry))
        except OSError as exc:
            log.warning("kvstrata: cannot remove %s left by process %d: %s", entry, pid, exc)
    if removed:
        log.info("kvstrata: removed %d leftover(s) of killed processes in %s", len(removed),
                 directory)
    return removed
