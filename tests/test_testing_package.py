"""``kvstrata.testing`` holds helpers for benchmarks and tests only: nothing else in kvstrata
imports it (at module level or inside functions), and each of its modules imports."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import kvstrata
from test_structure import GRAPH_WITH_TYPES

SRC = Path(kvstrata.__file__).parent
TESTING = SRC / "testing"
PACKAGE = "kvstrata.testing"


def _is_testing(module: str) -> bool:
    return module == PACKAGE or module.startswith(PACKAGE + ".")


def _string_names_testing(path: Path) -> list[tuple[int, str]]:
    """String constants naming the package (``importlib.import_module("kvstrata.testing...")``,
    a connector's module path), docstrings excepted."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {id(n.value) for n in ast.walk(tree)
                  if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and id(n) not in docstrings and _is_testing(n.value.strip())]


def test_nothing_outside_the_package_imports_it():
    """Not at module level, not inside a function, not for a type checker (the import graph
    of ``tests/test_structure.py``), and no string names it (a connector's module path)."""
    assert TESTING.is_dir()
    wrong = [f"{module} imports {dep}" for module, deps in GRAPH_WITH_TYPES.items()
             if not _is_testing(module) for dep in deps if _is_testing(dep)]
    for path in sorted(SRC.rglob("*.py")):
        if TESTING not in path.parents:
            wrong += [f"{path.relative_to(SRC.parent)}:{line}: names {s!r}"
                      for line, s in _string_names_testing(path)]
    assert not wrong, wrong


def test_the_package_imports_none_of_its_modules_eagerly():
    init = TESTING / "__init__.py"
    assert ast.get_docstring(ast.parse(init.read_text()))
    assert not [dep for dep in GRAPH_WITH_TYPES[PACKAGE] if _is_testing(dep)]


@pytest.mark.parametrize("name", ["random_model", "exporter"])
def test_module_imports(name):
    module = importlib.import_module(f"{PACKAGE}.{name}")
    for public in module.__all__:
        assert getattr(module, public) is not None


def test_null_connector_imports():
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # not installed, or installed but broken here
        pytest.skip(f"vllm does not import ({type(exc).__name__}: {exc}); "
                    "kvstrata.testing.null_connector subclasses vLLM's KV connector base")
    from kvstrata.testing.null_connector import NullConnector

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    assert issubclass(NullConnector, KVConnectorBase_V1)
