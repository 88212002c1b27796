"""Every test of the logical layer runs on both paths of the pool's block loops: the pure-
Python one and the optional native one (``kvstrata.logical._blockops``, skipped when not
built), and on both paths of block hashing (``kvstrata._tokenhash``). The stateful pool
machine (a unittest-style case) has one class per path in test_pool.py."""

import pytest
from native_paths import NATIVE_BUILT, restore_native, set_native


def pytest_generate_tests(metafunc):
    if "native_path" in metafunc.fixturenames:
        metafunc.parametrize("native_path", ["python", "native"], indirect=True)


@pytest.fixture(autouse=True)
def native_path(request):
    path = getattr(request, "param", None)
    if path is None:          # a unittest-style case: it chooses its own path
        yield None
        return
    if path == "native" and not NATIVE_BUILT:
        pytest.skip("native extensions (kvstrata.logical._blockops, kvstrata._tokenhash) not built")
    before = set_native(path == "native")
    yield path
    restore_native(before)
