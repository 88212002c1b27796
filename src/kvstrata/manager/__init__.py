"""``KvBlockManager`` and its errors: kvstrata in one process (see :mod:`.facade`).

Modules: :mod:`.facade` (the public class and its wiring), :mod:`.owner` (the owner thread),
:mod:`.storages` (a storage per tier kind), :mod:`.g1_bytes` (flat payload I/O on G1),
:mod:`.errors`.
"""

from ..placement import LoadFailure, OnboardResult
from .errors import InvalidBlockError, ManagerClosedError, ManagerConfigError, ManagerError
from .facade import KvBlockManager
from .storages import layout_config_for

__all__ = ["KvBlockManager", "OnboardResult", "LoadFailure", "ManagerError",
           "ManagerClosedError", "ManagerConfigError", "InvalidBlockError", "layout_config_for"]
