"""A thin, typed wrapper over one NIXL agent: register memory, publish and import agent
metadata, read remote byte ranges with a deadline.

NIXL is imported on first use (``RemoteUnavailableError`` if missing). UCX is told to skip its
InfiniBand modules (``UCX_MODULES=^ib``) before NIXL loads it: without that, processes on
machines without IB may crash at exit. Only host memory (NIXL ``DRAM``) is registered on a
CPU machine; device memory (``VRAM``) goes through the same calls where CUDA exists.

The agent's UCX progress thread sleeps until its worker has something to do
(:data:`PROGRESS_WAIT_US`). NIXL's Python API starts it with a wait of 0, which makes it
busy-poll: one core per agent, for the life of the process. Where a host pins its threads to
one core (vLLM's CPU worker), that thread starves every other thread on the core, including the
ones that connect UCX endpoints, and reads between two such processes time out.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Sequence

from .errors import RemoteReadError, RemoteUnavailableError

__all__ = ["NixlAgent", "nixl_available", "PROGRESS_WAIT_US"]

_MEM = {"host": "DRAM", "pinned": "DRAM", "device": "VRAM"}
_SPIN_SECONDS = 0.002
"""A read is polled without sleeping this long (a small copy is over by then), then with
short sleeps: no core is burned waiting on a stalled peer."""
PROGRESS_WAIT_US = 10_000
"""The longest the agent's progress thread sleeps in ``poll()`` on its UCX worker's event
descriptor; it wakes at once when the worker has an event (an incoming connection, a message),
so this only bounds the wait for one the descriptor does not signal."""
_CREATE_LOCK = threading.Lock()


def _nixl():
    os.environ.setdefault("UCX_MODULES", "^ib")
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except Exception as exc:  # ImportError, or a shared library that does not load
        raise RemoteUnavailableError(f"NIXL is not usable here ({exc}); install it with "
                                     f"scripts/setup.sh") from None
    return nixl_agent, nixl_agent_config


def nixl_available() -> bool:
    """Whether NIXL imports here."""
    try:
        _nixl()
        return True
    except RemoteUnavailableError:
        return False


def _waiting_agent(nixl_agent, name: str, config):
    """``nixl_agent(name, config)`` whose progress thread waits :data:`PROGRESS_WAIT_US`
    instead of busy-polling. The Python API sets the wait to 0 right before it creates the
    native agent and has no option for it, so the native constructor is wrapped while this
    agent is made (under a lock; an agent another library makes in that instant gets the
    same wait)."""
    bindings = getattr(sys.modules.get(nixl_agent.__module__), "nixlBind", None)
    create = getattr(bindings, "nixlAgent", None)
    if create is None:                    # another NIXL layout: take its default
        return nixl_agent(name, config)

    def create_waiting(agent_name, agent_config):
        agent_config.pthrDelay = PROGRESS_WAIT_US
        return create(agent_name, agent_config)

    with _CREATE_LOCK:
        bindings.nixlAgent = create_waiting
        try:
            return nixl_agent(name, config)
        finally:
            bindings.nixlAgent = create


class NixlAgent:
    """One NIXL agent named ``name`` with the ``UCX`` backend (see the module docstring)."""

    def __init__(self, name: str, backends: Sequence[str] = ("UCX",)) -> None:
        nixl_agent, nixl_agent_config = _nixl()
        try:
            self._agent = _waiting_agent(nixl_agent, name,
                                         nixl_agent_config(backends=list(backends)))
        except Exception as exc:
            raise RemoteUnavailableError(f"NIXL agent {name!r} did not start: {exc}") from None
        self.name = name
        self._registered: list = []
        self._remotes: set[str] = set()

    def register(self, regions: Sequence[tuple[int, int]], memory_kind: str = "host",
                 device_id: int = 0) -> None:
        """Register ``(address, size)`` regions so peers can read them (and so this agent
        can read into them)."""
        mem = _MEM[memory_kind]
        descs = [(int(addr), int(size), int(device_id), "") for addr, size in regions]
        self._registered.append(self._agent.register_memory(descs, mem))

    def metadata(self) -> bytes:
        """What a peer needs to reach this agent's registered memory."""
        return self._agent.get_agent_metadata()

    def add_remote(self, metadata: bytes) -> str:
        """Import a peer's metadata; returns the peer's agent name."""
        try:
            name = self._agent.add_remote_agent(metadata)
        except Exception as exc:
            raise RemoteReadError(f"NIXL refused the peer's metadata: {exc}") from None
        name = name.decode() if isinstance(name, bytes) else str(name)
        self._remotes.add(name)
        return name

    def remove_remote(self, name: str) -> None:
        """Forget a peer (idempotent)."""
        if name in self._remotes:
            self._remotes.discard(name)
            try:
                self._agent.remove_remote_agent(name)
            except Exception:
                pass

    def read(self, peer: str, local: Sequence[tuple[int, int]], remote: Sequence[tuple[int, int]],
             timeout: float, memory_kind: str = "host") -> None:
        """Copy each ``remote[i]`` range of ``peer`` into ``local[i]`` (same lengths), or
        raise :class:`RemoteReadError`: the peer disconnected or died, NIXL reported an
        error, or ``timeout`` seconds passed (the transfer is then abandoned)."""
        if len(local) != len(remote) or any(a[1] != b[1] for a, b in zip(local, remote)):
            raise ValueError("local and remote ranges must pair up with equal lengths")
        if not local:
            return
        mem = _MEM[memory_kind]
        agent = self._agent
        handle = None
        deadline = time.monotonic() + timeout
        try:
            ldescs = agent.get_xfer_descs([(a, n, 0) for a, n in local], mem)
            rdescs = agent.get_xfer_descs([(a, n, 0) for a, n in remote], mem)
            handle = agent.initialize_xfer("READ", ldescs, rdescs, peer)
            state = agent.transfer(handle)
            spin_until = time.monotonic() + _SPIN_SECONDS
            while state not in ("DONE", "ERR"):
                now = time.monotonic()
                if now > deadline:
                    raise RemoteReadError(f"read from {peer!r} timed out after {timeout:.1f} s")
                # sleep(0) still lets go of the GIL: a thread hashing what already arrived
                # must not wait a whole switch interval for this loop
                time.sleep(0.0002 if now > spin_until else 0)
                state = agent.check_xfer_state(handle)
            if state == "ERR":
                raise RemoteReadError(f"NIXL reported an error reading from {peer!r}")
        except RemoteReadError:
            raise
        except Exception as exc:      # nixlRemoteDisconnectError and the like
            raise RemoteReadError(f"read from {peer!r} failed: {type(exc).__name__}: "
                                  f"{exc}") from None
        finally:
            if handle is not None:
                try:
                    agent.release_xfer_handle(handle)
                except Exception:
                    pass

    def close(self) -> None:
        """Forget peers and deregister memory (idempotent)."""
        for name in list(self._remotes):
            self.remove_remote(name)
        registered, self._registered = self._registered, []
        for reg in registered:
            try:
                self._agent.deregister_memory(reg)
            except Exception:
                pass
