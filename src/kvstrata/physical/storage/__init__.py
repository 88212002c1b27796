"""Storage backends: :class:`DeviceStorage` (G1), :class:`HostStorage` (G2),
:class:`DiskStorage` (G3), all behind :class:`~kvstrata.physical.storage.base.Storage`."""

from .base import BlockMemory, MemoryStorage, Storage, StorageStatus
from .device import DeviceStorage
from .disk import DiskStorage
from .fileio import FileOps
from .host import HostStorage

__all__ = ["BlockMemory", "MemoryStorage", "Storage", "StorageStatus", "DeviceStorage",
           "DiskStorage", "FileOps", "HostStorage"]
