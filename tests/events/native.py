"""A fixture body that runs a test module on the native fast paths (when built) and without
them (the pure-Python code they must equal)."""

import pytest


def native_or_python(request, monkeypatch):
    from kvstrata.events import formats, indexer, publisher

    native = (indexer.NATIVE_CORE, formats.fast_decode_dynamo, formats.native_encode_message,
              publisher._native_hooks)
    if request.param == "python":
        monkeypatch.setattr(indexer, "NATIVE_CORE", None)
        monkeypatch.setattr(formats, "fast_decode_dynamo", None)
        monkeypatch.setattr(formats, "native_encode_message", None)
        monkeypatch.setattr(publisher, "_native_hooks", None)
    elif indexer.NATIVE_CORE is None or any(x is None for x in native):
        pytest.skip("native event fast paths not built")
    return request.param
