"""``kvstrata.testing`` holds helpers for benchmarks and tests only: nothing else in kvstrata
imports it (at module level or inside functions), and each of its modules imports."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import kvstrata

SRC = Path(kvstrata.__file__).parent
TESTING = SRC / "testing"
PACKAGE = "kvstrata.testing"


def _module_name(path: Path, root: Path = SRC) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imported(path: Path, root: Path = SRC) -> list[tuple[int, str]]:
    """Every module ``path`` imports, anywhere in it (functions, classes, ``if`` blocks and
    ``if TYPE_CHECKING`` included), relative imports resolved, with their line numbers;
    ``from a import b`` gives ``a`` and ``a.b`` (``b`` may be a submodule)."""
    name = _module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((node.lineno, target))
            found.extend((node.lineno, f"{target}.{a.name}") for a in node.names)
    return found


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


def test_the_check_sees_deferred_and_relative_imports(tmp_path):
    root = tmp_path / "kvstrata"
    (root / "remote").mkdir(parents=True)
    module = root / "remote" / "mod.py"
    module.write_text("def f():\n    from ..testing import exporter\n"
                      "class C:\n    def g(self):\n        import kvstrata.testing.random_model\n")
    hits = {m for _, m in _imported(module, root) if _is_testing(m)}
    assert hits == {"kvstrata.testing", "kvstrata.testing.exporter",
                    "kvstrata.testing.random_model"}


def test_nothing_outside_the_package_imports_it():
    assert TESTING.is_dir()
    wrong = []
    for path in sorted(SRC.rglob("*.py")):
        if TESTING in path.parents:
            continue
        where = path.relative_to(SRC.parent)
        wrong += [f"{where}:{line}: imports {m}" for line, m in _imported(path)
                  if _is_testing(m)]
        wrong += [f"{where}:{line}: names {s!r}" for line, s in _string_names_testing(path)]
    assert not wrong, wrong


def test_the_package_imports_none_of_its_modules_eagerly():
    init = TESTING / "__init__.py"
    assert ast.get_docstring(ast.parse(init.read_text()))
    assert not [m for _, m in _imported(init) if _is_testing(m)]


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
