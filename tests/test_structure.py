"""The shape of the code, checked: layers import downwards only, the protocol and the planner
load neither torch nor prometheus_client, tier names are spelled only in ``kvstrata.tiers``,
and the public names import from ``kvstrata``."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import kvstrata
from kvstrata.dtypes import ALIASES, DTYPE_NAMES
from kvstrata.tiers import TIER_NAMES

SRC = Path(kvstrata.__file__).parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: Path, modules: set[str], type_only: bool = False) -> set[str]:
    """kvstrata modules ``path`` imports, at module level or inside functions (a deferred
    import hides a cycle, it does not remove it); ``if TYPE_CHECKING`` blocks only with
    ``type_only``."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(body) -> None:
        for node in body:
            if isinstance(node, ast.If) and _is_type_checking(node):
                visit(node.body if type_only else node.orelse)
                if type_only:
                    visit(node.orelse)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("kvstrata"))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if not target.startswith("kvstrata"):
                    continue
                found.add(target)
                for alias in node.names:      # ``from . import x`` may name a submodule
                    if f"{target}.{alias.name}" in modules:
                        found.add(f"{target}.{alias.name}")
            else:
                for field in ("body", "orelse", "finalbody", "handlers"):
                    inner = getattr(node, field, None)
                    if isinstance(inner, list):
                        visit(inner)

    visit(ast.parse(path.read_text()).body)
    return found


def _graph(type_only: bool = False) -> dict[str, set[str]]:
    paths = [p for p in SRC.rglob("*.py")]
    modules = {_module_name(p) for p in paths}
    graph = {}
    for path in paths:
        deps = set()
        for target in _imports(path, modules, type_only):
            # importing a.b.c runs a/__init__, a/b/__init__ too
            parts = target.split(".")
            deps.update(".".join(parts[:i]) for i in range(2, len(parts) + 1)
                        if ".".join(parts[:i]) in modules)
        name = _module_name(path)
        deps.discard(name)
        # a module's own packages are being imported already when it runs: not an edge
        graph[name] = {d for d in deps if not name.startswith(d + ".")}
    return graph


GRAPH = _graph()
GRAPH_WITH_TYPES = _graph(type_only=True)


@pytest.mark.parametrize("graph", [GRAPH, GRAPH_WITH_TYPES], ids=["runtime", "type-only too"])
def test_no_import_cycles(graph):
    """No cycle, not even through imports made only for type checkers: a type-only import
    that closes a circle is a layering mistake the annotations hide."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycle = stack[stack.index(dep):] + [dep]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


LEAVES = {"kvstrata", "kvstrata.types", "kvstrata.tiers", "kvstrata.dtypes", "kvstrata.tokens",
          "kvstrata.paths", "kvstrata.redact"}


@pytest.mark.parametrize("layer, allowed", [
    ("kvstrata.logical", LEAVES),
    ("kvstrata.protocol", LEAVES),
    ("kvstrata.placement", LEAVES | {"kvstrata.logical", "kvstrata.protocol",
                                     "kvstrata.config"}),
    ("kvstrata.config", LEAVES | {"kvstrata.logical"}),
])
def test_layers_import_only_downwards(layer, allowed):
    """``logical`` and ``protocol`` sit on the leaf modules only; the planner on those plus
    config; config on logical (never the other way round)."""
    wrong = []
    for module, deps in GRAPH.items():
        if module != layer and not module.startswith(layer + "."):
            continue
        for dep in deps:
            if dep == layer or dep.startswith(layer + "."):
                continue
            if not any(dep == a or dep.startswith(a + ".") for a in allowed - {"kvstrata"}) \
                    and dep != "kvstrata":
                wrong.append(f"{module} imports {dep}")
    assert not wrong, wrong


def test_protocol_and_planner_load_without_torch_or_prometheus():
    code = ("import sys\n"
            "import kvstrata.protocol, kvstrata.placement\n"
            "from kvstrata import TransferPlan, TransferResult, Planner, KvConfig\n"
            "plan = TransferPlan.from_dict(TransferPlan.for_path('G1->G2', [0], [1], [7], "
            "job_id=1).to_dict())\n"
            "heavy = sorted(m for m in ('torch', 'prometheus_client') if m in sys.modules)\n"
            "print(','.join(heavy) or 'none')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "none", out.stdout + out.stderr


def _string_constants(path: Path):
    tree = ast.parse(path.read_text())
    docstrings = {id(n.value) for n in ast.walk(tree)
                  if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and id(node) not in docstrings:
            yield node


def test_tier_names_are_spelled_only_in_tiers_module():
    names = set(TIER_NAMES)
    spelled = []
    for path in SRC.rglob("*.py"):
        if path.name == "tiers.py" and path.parent == SRC:
            continue
        for node in _string_constants(path):
            text = node.value
            if text in names or ("->" in text and any(n in text.split("->") for n in names)):
                spelled.append(f"{path.relative_to(SRC)}:{node.lineno}: {text!r}")
    assert not spelled, spelled


def test_public_names_import_from_the_package():
    for name in kvstrata.__all__:
        assert getattr(kvstrata, name) is not None
    assert "owner thread" in kvstrata.KvBlockManager.__doc__
    with pytest.raises(AttributeError):
        kvstrata.NoSuchThing  # noqa: B018


@pytest.mark.parametrize("dtype", sorted({*DTYPE_NAMES, *ALIASES}))
def test_every_dtype_the_config_accepts_round_trips_through_the_manager(dtype, tmp_path):
    """One dtype table: a dtype that passes config validation is one the manager can hold,
    offload to disk and onboard back byte for byte."""
    pytest.importorskip("torch")
    import numpy as np

    from kvstrata.config import KvConfig, ModelGeometry, TierConfig
    from kvstrata.manager import KvBlockManager
    from kvstrata.tokens import hash_blocks
    from kvstrata.types import BlockRecord

    config = KvConfig(block_size=4, model=ModelGeometry(num_layers=1, kv_heads=1, head_dim=8,
                                                        dtype=dtype),
                      tiers={"G1": TierConfig(blocks=2), "G2": TierConfig(blocks=2),
                             "G3": TierConfig(blocks=4)}).validate()
    local, seqs = hash_blocks(np.arange(8, dtype="<u4"), 4)
    records = [BlockRecord(s, l, p, 4) for s, l, p in zip(seqs, local, [None, seqs[0]])]
    with KvBlockManager(config, disk_dir=str(tmp_path), o_direct=False) as mgr:
        size = mgr.status()["block_bytes"]
        data = [np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)
                for i in range(2)]
        blocks = mgr.allocate(2).result()
        mgr.write_g1(blocks.block_ids, data)
        blocks.apply_token_blocks(records)
        mgr.release(mgr.register(blocks).result())
        mgr.wait_idle()
        assert mgr.evict("G1", list(reversed(seqs))).result() == list(reversed(seqs))
        assert mgr.evict("G2", list(reversed(seqs))).result() == list(reversed(seqs))
        with mgr.onboard(seqs).result() as loaded:
            assert loaded.sources == ("G3", "G3")
            got = mgr.read_g1(loaded.block_ids)
        assert all(np.array_equal(a, b) for a, b in zip(got, data))
