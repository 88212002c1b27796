"""Storage backends: :class:`DeviceStorage` (G1), :class:`HostStorage` (G2),
:class:`DiskStorage` (G3), :class:`ObjectStorage` (G4, an S3-compatible bucket; its client
config is :class:`S3Config`), all behind :class:`~kvstrata.physical.storage.base.Storage`."""

from .base import BlockMemory, MemoryStorage, Storage, StorageStatus
from .device import DeviceStorage
from .disk import DiskStorage
from .fileio import FileOps
from .host import HostStorage
from .objects import ObjectStorage
from .s3client import S3Client, S3Config

__all__ = ["BlockMemory", "MemoryStorage", "Storage", "StorageStatus", "DeviceStorage",
           "DiskStorage", "FileOps", "HostStorage", "ObjectStorage", "S3Client", "S3Config"]
