"""``KvBlockManager`` and its errors: kvstrata in one process (see :mod:`.block_manager`).

Modules: :mod:`.block_manager` (the public class and its wiring), :mod:`.engine_owned` (the
same over an engine's own G1), :mod:`.owner` (the owner thread),
:mod:`.g1_bytes` (flat payload I/O on G1), :mod:`.catalog` (listing a shared store),
:mod:`.errors`. The storages come from :mod:`kvstrata.kinds` (one module per kind of tier).
"""

from ..placement import LoadFailure, OnboardResult
from .errors import (InvalidBlockError, InvalidConfigError, ManagerClosedError,
                     ManagerConfigError, ManagerError)
from .block_manager import KvBlockManager
from .engine_owned import EngineOwnedManager

__all__ = ["KvBlockManager", "EngineOwnedManager", "OnboardResult", "LoadFailure", "ManagerError",
           "ManagerClosedError", "ManagerConfigError", "InvalidConfigError",
           "InvalidBlockError"]
