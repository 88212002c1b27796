"""The physical layer of kvstrata: the bytes of KV blocks.

Entry points::

    from kvstrata.physical import (LayoutConfig, HostStorage, DiskStorage, DeviceStorage,
                                   TransferEngine, TransferPlan)

    cfg = LayoutConfig(num_blocks=1024, num_layers=32, outer_dim=2, page_size=16,
                       inner_dim=1024, dtype="bf16")
    g1 = DeviceStorage.wrap(kv_caches)               # engine tensors, zero-copy
    g2 = HostStorage(cfg.with_blocks(4096))          # pinned when CUDA is present
    g3 = DiskStorage(cfg.with_blocks(65536), "/nvme/kvstrata")
    g4 = ObjectStorage(cfg, S3Config(endpoint_url="http://127.0.0.1:8333"),
                       namespace="kvstrata/<fingerprint>/", fingerprint="<fingerprint>")
    engine = TransferEngine({"G1": g1, "G2": g2, "G3": g3, "G4": g4})
    plan = TransferPlan(1, Endpoint("G1"), Endpoint("G2"), [h3, h7],
                        src_block_ids=[3, 7], dst_block_ids=[0, 1])
    result = engine.submit(plan).result()

Modules: :mod:`.storage` (backends), :mod:`.checksum` (xxh3-64 and device checksums),
:mod:`.copy` (host copy engines), :mod:`.device_copy` (the GPU one), :mod:`.engines` (the
default), :mod:`.transfer` (the engine), :mod:`.dtypes` (names to torch dtypes),
:mod:`.errors` (typed errors). Layouts, plans and results are the torch-free
:mod:`kvstrata.protocol`, re-exported here. See docs/physical.md.
"""

from .checksum import ChecksumTable, block_checksum
from .copy import CopyEngine, MemmoveCopyEngine, StagedCopyEngine, TorchCopyEngine
from .device_copy import DeviceCopyEngine
from .engines import default_copy_engine
from .dtypes import SUPPORTED_DTYPES
from .errors import (BlockFailure, BlockIntegrityError, BlockIOError, BlockNotFoundError,
                     ChecksumMismatchError, DiskFullError, EngineBusyError, EngineClosedError, FailureKind,
                     LayoutConfigError, LayoutError, LayoutFormatError, LayoutMismatchError,
                     LayoutVersionError, PhysicalError, StorageClosedError, StorageConfigError,
                     StorageError, StorageIOError, TransferError, TransferPlanError)
from ..protocol import (Endpoint, FullyContiguousLayout, Granularity, LayerOrder,
                        LayerSeparateLayout, Layout, LayoutConfig, Region, SharedLayout,
                        StorageDescriptor, TransferPlan, TransferResult)
from .storage import (BlockMemory, DeviceStorage, DiskStorage, FileOps, HostStorage,
                      MemoryStorage, ObjectStorage, S3Config, Storage, StorageStatus)
from .transfer import TransferEngine

__all__ = ["ChecksumTable", "block_checksum", "CopyEngine", "MemmoveCopyEngine",
           "StagedCopyEngine", "TorchCopyEngine", "DeviceCopyEngine", "default_copy_engine",
           "SUPPORTED_DTYPES",
           "BlockFailure", "BlockIntegrityError", "BlockIOError", "BlockNotFoundError",
           "ChecksumMismatchError",
           "DiskFullError", "EngineBusyError", "EngineClosedError", "FailureKind",
           "LayoutConfigError", "LayoutError", "LayoutFormatError", "LayoutMismatchError",
           "LayoutVersionError", "PhysicalError", "StorageClosedError", "StorageConfigError",
           "StorageError", "StorageIOError", "TransferError", "TransferPlanError",
           "FullyContiguousLayout", "Granularity", "LayerOrder", "LayerSeparateLayout",
           "Layout", "LayoutConfig", "Region", "SharedLayout", "StorageDescriptor", "Endpoint",
           "TransferPlan", "TransferResult", "BlockMemory", "DeviceStorage",
           "DiskStorage", "FileOps", "HostStorage", "MemoryStorage", "ObjectStorage",
           "S3Config", "Storage",
           "StorageStatus", "TransferEngine"]
