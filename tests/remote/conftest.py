"""Fixtures shared by the remote tests."""

from __future__ import annotations

import pytest

from .pool_stand_in import Pins


@pytest.fixture
def exporter(request):
    """A :class:`BlockExporter` of a small host storage over :class:`Pins` (NIXL needed, no
    manager): ``(exporter, pins)``. A module may override it (test_nixl_processes does)."""
    from kvstrata.physical.storage.host import HostStorage
    from kvstrata.protocol.layout import LayoutConfig
    from kvstrata.remote.exporter import BlockExporter

    storage = HostStorage(LayoutConfig(num_blocks=32, num_layers=2, outer_dim=2, page_size=4,
                                       inner_dim=16))
    pins = Pins()
    ex = BlockExporter(f"{request.module.__name__.rsplit('.', 1)[-1]}", "G2", storage,
                       pins.pin, pins.unpin)
    yield ex, pins
    ex.close()
    storage.close()
