"""The import graph of ``tidal/`` and ``benchmarks/`` keeps the layer map (LAYERS below).

Pure AST: no module is imported, so the whole graph is read in well under a second. Five rules:

- no import cycle between modules;
- a lower layer never imports a higher one (``LAYERS`` below, highest first), nor the front door
  ``tidal`` itself; nothing in ``tidal/`` imports ``tidal.testing``, and only ``tidal.cli`` (which
  runs them as ``tidal bench NAME``) imports ``benchmarks``;
- no module imports another module's private name (``from tidal.x import _y``, ``mod._y``);
- no layer below ``train`` imports ``tidal.models`` (models reach them through a ModelSpec);
- a pure layer (``PURE``: the planner) imports neither the layers that run things nor
  ``torch.distributed``: it computes plans, and what carries them out (DTensor, FSDP2, hooks,
  collectives) lives in ``parallel/`` above it.

[Note: what counts as an import]
Every ``import tidal...`` and ``from tidal... import`` counts wherever it stands: at module level,
inside a function (the usual way to hide a cycle from the interpreter) and inside an
``if TYPE_CHECKING:`` block. A TYPE_CHECKING import costs nothing at run time, but it couples the
two modules' types just the same: a lower layer that names a higher layer's class in an
annotation changes when that class changes. An edge goes to the module named: ``from tidal.a
import b`` reaches ``tidal.a.b`` when that is a module, else ``tidal.a``; the packages a dotted
import passes through (``tidal``, ``tidal.a``) are not edges, or every module would reach the
front door.

[Note: known violations]
``KNOWN_VIOLATIONS`` lists what the architecture issue (16) is still removing, one entry per
offending edge with the part of the issue that removes it. The test fails on a violation not
listed AND on a listed one that no longer exists, so the list only shrinks: delete an entry in
the commit that fixes it.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

# The checkout's root, wherever under tests/ this file sits.
REPO = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
ROOTS = ("tidal", "benchmarks")

# Highest first; a layer may import its own and every layer after it. Layers on one row sit side
# by side: neither is above the other.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("cli",),
    ("train",),
    ("models", "data"),
    ("runtime",),
    ("parallel",),
    ("planner",),
    ("pipeline",),
    ("activations",),
    ("sharding",),
    ("memory",),
    ("distributed",),
    ("config",),
)
FRONT_DOOR = "front door"  # tidal/__init__.py and tidal/__main__.py: may import any layer
TESTING = "testing"  # may import anything; imported by nothing in tidal/
BENCHMARKS = "benchmarks"  # may import tidal below cli; only cli (tidal bench) imports it
MODELS_FLOOR = "train"  # the lowest layer that may import tidal.models
# A pure layer -> the layers it never imports, whatever their place in LAYERS (so moving a layer
# cannot let the planner reach a runtime); nor does it import torch.distributed or anything in it.
RUNTIME_LAYERS = ("runtime", "parallel", "sharding", "memory", "distributed")
PURE: dict[str, tuple[str, ...]] = {"planner": RUNTIME_LAYERS}
PURE_EXTERNAL = "torch.distributed"

# Owners: "engines" (parallel/, train/build.py, tidal/__init__.py), "placement" (memory/store.py and
# its policy, sharding/store.py), "trainckpt" (train/ trainers, checkpoints, cli/main.py),
# "modelspec" (models/, planner/, pipeline/split.py, cli/plan.py, cli/simulate.py, train/job.py).
# Empty since issue 16 removed the last one; a violation a change must keep for a while goes
# here with the issue that removes it.
KNOWN_VIOLATIONS: frozenset[str] = frozenset()


# -- the graph ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Module:
    name: str  # dotted: tidal.memory.store; a package is named by its __init__: tidal.memory
    source: str
    is_package: bool = False

    @property
    def package(self) -> str:
        return self.name if self.is_package else self.name.rpartition(".")[0]


@dataclass(frozen=True, slots=True)
class Import:
    importer: str
    target: str  # the module reached
    name: str | None  # the name taken from it (``from target import name``), else None
    line: int


@dataclass(frozen=True, order=True, slots=True)
class Violation:
    kind: str  # cycle | layer | models | private | pure
    importer: str
    imported: str
    why: str = ""

    @property
    def key(self) -> str:
        if not self.imported:  # a cycle: importer names its modules
            return f"{self.kind} {self.importer}"
        return f"{self.kind} {self.importer} -> {self.imported}"


def read_modules(repo: Path, roots: Iterable[str] = ROOTS) -> dict[str, Module]:
    modules: dict[str, Module] = {}
    for root in roots:
        for path in sorted((repo / root).rglob("*.py")):
            parts = path.relative_to(repo).with_suffix("").parts
            is_package = parts[-1] == "__init__"
            name = ".".join(parts[:-1] if is_package else parts)
            modules[name] = Module(name, path.read_text(encoding="utf-8"), is_package)
    return modules


@functools.cache
def _tree(module: Module) -> ast.Module:
    return ast.parse(module.source)


def _absolute(module: Module, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.package.split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _ours(name: str) -> bool:
    return name.split(".")[0] in ROOTS


def imports_of(module: Module, known: Mapping[str, Module]) -> Iterator[Import]:
    """Every import of a tidal or benchmarks module in ``module``, at any depth of its tree."""
    for node in ast.walk(_tree(module)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _ours(alias.name):
                    yield Import(module.name, alias.name, None, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, node)
            if not _ours(base):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in known:  # a submodule: the edge goes to it
                    yield Import(module.name, sub, None, node.lineno)
                else:
                    yield Import(module.name, base, alias.name, node.lineno)


def external_imports(module: Module) -> Iterator[str]:
    """Every module outside ours that ``module`` imports (``from a.b import c``: ``a.b.c``, as c
    may be a module), at any depth of its tree."""
    for node in ast.walk(_tree(module)):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names if not _ours(alias.name))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            base = node.module
            yield from (f"{base}.{alias.name}" for alias in node.names if not _ours(base))


def _module_aliases(module: Module, known: Mapping[str, Module]) -> dict[str, str]:
    """Local names bound to one of our modules: ``import a.b as m``, ``from a import b``."""
    aliases: dict[str, str] = {}
    for node in ast.walk(_tree(module)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _ours(alias.name):
                    local = alias.asname or alias.name.split(".")[0]
                    aliases[local] = alias.name if alias.asname else local
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, node)
            for alias in node.names:
                if f"{base}.{alias.name}" in known:
                    aliases[alias.asname or alias.name] = f"{base}.{alias.name}"
    return aliases


def _dotted(node: ast.expr) -> list[str] | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def private_attributes(module: Module, known: Mapping[str, Module]) -> Iterator[tuple[str, int]]:
    """``mod._y`` where ``mod`` names one of our modules: (``tidal.x._y``, line)."""
    aliases = _module_aliases(module, known)
    for node in ast.walk(_tree(module)):
        if not isinstance(node, ast.Attribute) or not _is_private(node.attr):
            continue
        chain = _dotted(node.value)
        if chain is None or chain[0] not in aliases:
            continue
        owner = ".".join([aliases[chain[0]], *chain[1:]])
        if owner in known and owner != module.name:
            yield f"{owner}.{node.attr}", node.lineno


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


# -- the rules ---------------------------------------------------------------------------------


def layer_of(name: str) -> str:
    parts = name.split(".")
    if parts[0] == BENCHMARKS:
        return BENCHMARKS
    if len(parts) == 1 or parts[1] == "__main__":
        return FRONT_DOOR
    return parts[1]


def _rank(layer: str) -> int | None:
    for depth, row in enumerate(LAYERS):
        if layer in row:
            return len(LAYERS) - depth
    return None


def layer_violation(importer: str, imported: str) -> Violation | None:
    """The rule the edge ``importer -> imported`` breaks, if any (cycles aside)."""
    a, b = layer_of(importer), layer_of(imported)
    if b == BENCHMARKS and a not in (BENCHMARKS, "cli"):
        return Violation(
            "layer", importer, imported, "only the CLI (tidal bench) imports benchmarks"
        )
    if a == BENCHMARKS and b == "cli":
        return Violation("layer", importer, imported, "benchmarks sit below the CLI that runs them")
    if b == TESTING and a not in (TESTING, BENCHMARKS):
        return Violation("layer", importer, imported, "only tests import tidal.testing")
    if a in (FRONT_DOOR, TESTING, BENCHMARKS) or b == BENCHMARKS:
        return None
    if b == FRONT_DOOR:
        return Violation("layer", importer, imported, "a layer never imports the front door")
    rank_a, rank_b = _rank(a), _rank(b)
    assert rank_a is not None, f"{importer}: layer {a!r} is not in LAYERS; place it there"
    assert rank_b is not None, f"{imported}: layer {b!r} is not in LAYERS; place it there"
    if b == "models" and a != "models" and rank_a < (_rank(MODELS_FLOOR) or 0):
        return Violation("models", importer, imported, f"{a} is below {MODELS_FLOOR}")
    if rank_a < rank_b:
        return Violation("layer", importer, imported, f"{a} is below {b}")
    return None


def pure_violations(module: Module, imports: Iterable[Import]) -> Iterator[Violation]:
    """A pure layer's imports of the layers that run things, or of ``torch.distributed``."""
    layer = layer_of(module.name)
    if layer not in PURE:
        return
    for imp in imports:
        if layer_of(imp.target) in PURE[layer]:
            yield Violation("pure", module.name, imp.target, f"{layer} runs nothing")
    for name in external_imports(module):
        if name == PURE_EXTERNAL or name.startswith(PURE_EXTERNAL + "."):
            yield Violation("pure", module.name, name, f"{layer} runs nothing")


def private_violation(imp: Import, modules: Mapping[str, Module]) -> Violation | None:
    """A private name of another module, or a private module outside its own package."""
    importer = modules[imp.importer]
    if imp.name is not None and _is_private(imp.name) and imp.target != imp.importer:
        return Violation("private", imp.importer, f"{imp.target}.{imp.name}")
    target_parts = imp.target.split(".")
    for i, part in enumerate(target_parts):
        if _is_private(part) and ".".join(target_parts[:i]) != importer.package:
            return Violation("private", imp.importer, imp.target)
    return None


def cycles(edges: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component: list[str] = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(found)


def violations(modules: Mapping[str, Module]) -> list[Violation]:
    """Every broken rule of the graph ``modules`` makes, one per offending edge."""
    found: set[Violation] = set()
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for module in modules.values():
        imports = list(imports_of(module, modules))
        found.update(pure_violations(module, imports))
        for imp in imports:
            if imp.target != module.name and imp.target in modules:
                edges[module.name].add(imp.target)
            if (broken := layer_violation(imp.importer, imp.target)) is not None:
                found.add(broken)
            if (broken := private_violation(imp, modules)) is not None:
                found.add(broken)
        for name, _line in private_attributes(module, modules):
            found.add(Violation("private", module.name, name))
    for component in cycles(edges):
        found.add(Violation("cycle", " <-> ".join(component), ""))
    return sorted(found)


def new_and_gone(found: Iterable[str], known: frozenset[str]) -> tuple[list[str], list[str]]:
    """Violations not listed, and listed ones that no longer occur: both fail the guard."""
    keys = set(found)
    return sorted(keys - known), sorted(known - keys)


def _report(title: str, lines: Iterable[str]) -> str:
    return title + "".join(f"\n  {line}" for line in lines)


# -- the guard ---------------------------------------------------------------------------------


def test_the_import_graph_keeps_the_layer_map() -> None:
    modules = read_modules(REPO)
    assert "tidal.memory.store" in modules and "benchmarks.dp" in modules
    found = {v.key: v for v in violations(modules)}
    new, gone = new_and_gone(found, KNOWN_VIOLATIONS)
    assert not new, _report(
        "new import violations (fix the import, or move the code to the layer that owns it; "
        "LAYERS in tests/unit/test_layers.py is the layer map):",
        (f"{key}  ({found[key].why})" if found[key].why else key for key in new),
    )
    assert not gone, _report(
        "fixed, so delete these entries from KNOWN_VIOLATIONS in tests/unit/test_layers.py:", gone
    )


def test_every_package_sits_in_a_layer() -> None:
    layers = {layer_of(name) for name in read_modules(REPO)}
    placed = {layer for row in LAYERS for layer in row} | {FRONT_DOOR, TESTING, BENCHMARKS}
    assert layers <= placed, f"place {sorted(layers - placed)} in LAYERS of this test"


# -- the checker catches what it should (synthetic graphs) -------------------------------------


def _graph(sources: Mapping[str, str]) -> dict[str, Module]:
    return {
        name.removesuffix(".__init__"): Module(
            name.removesuffix(".__init__"), src, name.endswith("__init__")
        )
        for name, src in sources.items()
    }


def _keys(sources: Mapping[str, str]) -> list[str]:
    return [v.key for v in violations(_graph(sources))]


def test_a_cycle_is_found_wherever_its_imports_hide() -> None:
    sources = {
        "tidal.memory.a": "from tidal.memory.b import f\n",
        "tidal.memory.b": "def g():\n    from tidal.memory.c import h\n",
        "tidal.memory.c": "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import tidal.memory.a\n",
        "tidal.memory.d": "import tidal.memory.a\n",
    }
    assert _keys(sources) == ["cycle tidal.memory.a <-> tidal.memory.b <-> tidal.memory.c"]


def test_a_lower_layer_importing_a_higher_one_is_found() -> None:
    sources = {
        "tidal.config.x": "from tidal.distributed import y\n",
        "tidal.distributed.__init__": "",
        "tidal.sharding.s": "def f():\n    from tidal.memory.m import M\n",
        "tidal.memory.m": "from tidal.sharding.s import f\n",
        "tidal.data.d": "from tidal.models.gpt import GPT\n",
        "tidal.parallel.p": "import tidal.models.gpt\nfrom tidal.data import batches\n",
        "tidal.models.gpt": "from tidal.data.batches import x\nfrom tidal.train import loop\n",
        "tidal.cli.c": "from benchmarks import dp\n",
        "tidal.train.b": "from benchmarks import dp\n",
        "benchmarks.bench": "from tidal.cli.c import main\n",
        "tidal.pipeline.q": "from tidal.testing import run_on_ranks\nimport tidal\n",
        "tidal.__init__": "from tidal.cli.c import main\n",
        "tidal.testing.t": "from tidal.train.loop import main\n",
        "benchmarks.dp": "from tidal.testing.t import x\nfrom tidal.config.x import y\n",
    }
    assert _keys(sources) == [
        "cycle tidal.memory.m <-> tidal.sharding.s",
        "layer benchmarks.bench -> tidal.cli.c",
        "layer tidal.config.x -> tidal.distributed",
        "layer tidal.memory.m -> tidal.sharding.s",
        "layer tidal.models.gpt -> tidal.train",
        "layer tidal.parallel.p -> tidal.data",
        "layer tidal.pipeline.q -> tidal",
        "layer tidal.pipeline.q -> tidal.testing",
        "layer tidal.train.b -> benchmarks.dp",
        "models tidal.data.d -> tidal.models.gpt",
        "models tidal.parallel.p -> tidal.models.gpt",
    ]


def test_a_pure_layer_importing_a_runtime_is_found() -> None:
    """The planner computes plans: DTensor, FSDP2, collectives and the runtimes are above it,
    imported where they hide (a function, TYPE_CHECKING) or not."""
    sources = {
        "tidal.planner.a": "import torch\nfrom torch import nn\nimport torch.distributed as dist\n",
        "tidal.planner.b": "def f():\n    from torch.distributed.tensor import DTensor\n",
        "tidal.planner.c": "from torch.distributed import fsdp\nfrom tidal.memory.store import S\n",
        "tidal.planner.d": "from tidal.pipeline.ir import Schedule\nimport torch.distributions\n",
        "tidal.memory.store": "import torch.distributed\n",  # not pure: allowed
        "tidal.pipeline.ir": "",
    }
    assert _keys(sources) == [
        "pure tidal.planner.a -> torch.distributed",
        "pure tidal.planner.b -> torch.distributed.tensor.DTensor",
        "pure tidal.planner.c -> tidal.memory.store",
        "pure tidal.planner.c -> torch.distributed.fsdp",
    ]


def test_a_private_name_of_another_module_is_found() -> None:
    sources = {
        "tidal.memory.__init__": "",
        "tidal.memory.store": "_CACHE = {}\n_x = _CACHE\n",
        "tidal.memory._impl": "",
        "tidal.memory.user": "from tidal.memory._impl import ok\nfrom tidal.memory import store\n"
        "store.__name__\nstore._CACHE.clear()\n",
        "tidal.sharding.s": "import tidal.memory.store as st\nfrom tidal.memory.store import _CACHE\n"
        "def f():\n    return st._x, tidal.memory.store.public\n",
        "tidal.sharding.t": "import tidal.memory.store\nimport tidal.memory._impl\n"
        "tidal.memory.store._x\n",
    }
    assert _keys(sources) == [
        "private tidal.memory.user -> tidal.memory.store._CACHE",
        "private tidal.sharding.s -> tidal.memory.store._CACHE",
        "private tidal.sharding.s -> tidal.memory.store._x",
        "private tidal.sharding.t -> tidal.memory._impl",
        "private tidal.sharding.t -> tidal.memory.store._x",
    ]


def test_the_known_list_can_only_shrink() -> None:
    known = frozenset({"layer a -> b", "cycle c <-> d"})
    assert new_and_gone(["layer a -> b", "cycle c <-> d"], known) == ([], [])
    assert new_and_gone(["layer a -> b"], known) == ([], ["cycle c <-> d"])  # fixed: delete it
    assert new_and_gone(["layer a -> b", "cycle c <-> d", "private e -> f._g"], known) == (
        ["private e -> f._g"],
        [],
    )


def test_an_unplaced_layer_is_named() -> None:
    with pytest.raises(AssertionError, match="layer 'widgets' is not in LAYERS"):
        layer_violation("tidal.widgets.swap", "tidal.memory.store")
