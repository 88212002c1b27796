"""Serialized layouts: round trips and every kind of malformed or mismatched input."""

from __future__ import annotations

import copy
import json

import pytest

from kvstrata.physical import (DiskStorage, FullyContiguousLayout, HostStorage,
                               LayerSeparateLayout, LayoutFormatError, LayoutMismatchError,
                               LayoutVersionError, StorageDescriptor)
from kvstrata.protocol import layout_codec as codec

from .conftest import small_config


def _host_payload():
    with HostStorage(small_config()) as host:
        return host.share()


def test_round_trip_dict_json_bytes(tmp_path):
    host = HostStorage(small_config(alignment=64))
    disk = DiskStorage(small_config(), tmp_path, o_direct=False)
    ls = LayerSeparateLayout(small_config(), "block_contiguous")
    ls_regions = [StorageDescriptor("device", ls.region_bytes(i), address=4096 * (i + 1),
                                    device_id=0) for i in range(ls.num_regions)]
    cases = [(host.layout, host.descriptors()), (disk.layout, disk.descriptors()),
             (ls, ls_regions)]
    for layout, regions in cases:
        for wire in (codec.encode(layout, regions), codec.to_json(layout, regions),
                     codec.to_bytes(layout, regions)):
            shared = codec.decode(wire)
            assert shared.layout == layout
            assert list(shared.regions) == list(regions)
            shared.require_matches(layout)
    assert json.loads(codec.to_json(*cases[1]))["regions"][0]["path"] == str(disk.path)
    disk.close()
    host.close()


def _mutations():
    def set_(path, value):
        def apply(d):
            target = d
            for key in path[:-1]:
                target = target[key]
            target[path[-1]] = value
        return apply

    def delete(path):
        def apply(d):
            target = d
            for key in path[:-1]:
                target = target[key]
            del target[path[-1]]
        return apply

    return [
        ("format", set_(["format"], "other"), "format"),
        ("version type", set_(["version"], "1"), "version"),
        ("extra key", set_(["surprise"], 1), "unknown keys"),
        ("missing regions", delete(["regions"]), "missing keys"),
        ("layout kind", set_(["layout", "kind"], "spiral"), "kind"),
        ("config value", set_(["layout", "config", "outer_dim"], 3), "outer_dim"),
        ("config missing", delete(["layout", "config", "page_size"]), "page_size"),
        ("dtype", set_(["layout", "config", "dtype"], "int4"), "dtype"),
        ("region count", set_(["regions"], []), "regions"),
        ("region size", set_(["regions", 0, "size"], 10), "size"),
        ("memory kind", set_(["regions", 0, "memory_kind"], "tape"), "memory_kind"),
        ("address type", set_(["regions", 0, "address"], "0x10"), "address"),
        ("path on host", set_(["regions", 0, "path"], "/x"), "address"),
        ("region extra key", set_(["regions", 0, "color"], "red"), "unknown keys"),
        ("regions type", set_(["regions"], {"a": 1}), "list"),
    ]


@pytest.mark.parametrize("name,mutate,match", _mutations(), ids=[m[0] for m in _mutations()])
def test_malformed_input_rejected_with_named_problem(name, mutate, match):
    data = copy.deepcopy(_host_payload())
    mutate(data)
    with pytest.raises(LayoutFormatError, match=match):
        codec.decode(data)


@pytest.mark.parametrize("wire", [b"\xff\xfe", "not json", "[1, 2]", 42,
                                  b"[" * 200_000])                   # nested past the parser
def test_garbage_rejected(wire):
    with pytest.raises(LayoutFormatError):
        codec.decode(wire)


def test_future_version_rejected():
    data = _host_payload()
    data["version"] = 2
    with pytest.raises(LayoutVersionError, match="version 2"):
        codec.decode(data)


def test_mismatched_layout_rejected():
    shared = codec.decode(_host_payload())
    with pytest.raises(LayoutMismatchError, match="page_size"):
        shared.require_matches(FullyContiguousLayout(small_config(page_size=8)))
    with pytest.raises(LayoutMismatchError, match="differ"):
        shared.require_matches(FullyContiguousLayout(small_config(num_blocks=3)))


def test_encode_checks_descriptor_count():
    layout = LayerSeparateLayout(small_config())
    with pytest.raises(LayoutFormatError, match="3 regions"):
        codec.encode(layout, [StorageDescriptor("host", 10**6, address=0)])
