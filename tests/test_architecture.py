"""The import rule of ARCHITECTURE.md, read from the code with ``ast``.

Every import counts: module level, inside functions, and type-only ones under
``TYPE_CHECKING``. A unit is a subpackage of ``rlvr_lightning`` (``stages``, ``device``, ...)
or one of the root modules (``types``, ``options``, ``module``, ``testing``, the package face).
A unit may import only units of a lower layer; inside a unit, modules import each other
freely but never in a circle. Outside ``device``, only the package's face is imported (one
seam for the fast paths), and nothing of the package imports ``testing``.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "rlvr_lightning"

# Lowest first; a unit may import the units of the layers before its own.
LAYERS: list[tuple[str, ...]] = [
    ("types",),
    ("algorithms",),
    ("device",),
    ("runtime", "hub", "hub_cards"),
    ("rewards",),
    ("environments",),
    ("models",),
    ("heads",),
    ("data",),
    ("rollout",),
    ("asynchrony",),
    ("options",),
    ("stages",),
    ("guidance",),
    ("module",),
    ("face",),
    ("callbacks",),
    ("cli",),
    ("testing",),
]
LAYER = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def package_sources() -> dict[str, str]:
    """``{dotted module name: source}`` for the package and its mapped folders."""
    folders = {PACKAGE: ROOT / PACKAGE, f"{PACKAGE}.callbacks": ROOT / "callbacks"}
    folders[f"{PACKAGE}.hub_cards"] = ROOT / "hub_cards"
    sources = {}
    for prefix, folder in folders.items():
        for path in folder.rglob("*.py"):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            sources[".".join([prefix, *parts])] = path.read_text()
    return sources


def unit_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "face"
    return parts[1]


def _resolve(target: str, modules: set[str]) -> str | None:
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target or None


def import_edges(sources: dict[str, str]) -> dict[str, set[str]]:
    """``{module: modules it imports}``, every import statement counted."""
    modules = set(sources)
    edges: dict[str, set[str]] = defaultdict(set)
    for name, source in sources.items():
        for node in ast.walk(ast.parse(source)):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" for a in node.names] or [node.module]
            for target in targets:
                if not target.startswith(PACKAGE):
                    continue
                resolved = _resolve(target, modules)
                if resolved and resolved != name:
                    edges[name].add(resolved)
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def rule_breaks(edges: dict[str, set[str]]) -> list[str]:
    """Imports that go up (or sideways) a layer, reach past the device seam, or into testing."""
    breaks = []
    for src, targets in sorted(edges.items()):
        for dst in sorted(targets):
            a, b = unit_of(src), unit_of(dst)
            if a != b and LAYER[b] >= LAYER[a]:
                breaks.append(f"{src} ({a}, {LAYER[a]}) imports {dst} ({b}, {LAYER[b]})")
            if b == "device" and a != "device" and dst != f"{PACKAGE}.device":
                breaks.append(f"{src} imports the kernel {dst}: import from {PACKAGE}.device")
    return breaks


def test_every_unit_has_a_layer():
    units = {unit_of(m) for m in package_sources()}
    assert units <= set(LAYER), f"units without a layer: {sorted(units - set(LAYER))}"


def test_the_package_has_no_import_circle():
    assert circles(import_edges(package_sources())) == []


def test_imports_only_go_down_the_layers():
    assert rule_breaks(import_edges(package_sources())) == []


@pytest.mark.parametrize(
    ("module", "planted"),
    [
        ("rlvr_lightning.algorithms.ops", "from rlvr_lightning.algorithms.losses import agg_loss"),
        ("rlvr_lightning.device.cpu_linear", "import rlvr_lightning.device.chunked_head"),
    ],
)
def test_a_planted_circle_is_caught(module, planted):
    sources = package_sources()
    sources[module] += f"\n{planted}\n"
    found = circles(import_edges(sources))
    assert any(module in group for group in found)


def test_a_type_only_upward_import_is_caught():
    sources = package_sources()
    sources["rlvr_lightning.stages.update"] += (
        "\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from rlvr_lightning.module import RLVRModule\n"
    )
    breaks = rule_breaks(import_edges(sources))
    assert any("stages.update" in b and "rlvr_lightning.module" in b for b in breaks)


def test_a_kernel_import_past_the_seam_is_caught():
    sources = package_sources()
    sources["rlvr_lightning.stages.update"] += "\nfrom rlvr_lightning.device import cpu_linear\n"
    breaks = rule_breaks(import_edges(sources))
    assert any("kernel rlvr_lightning.device.cpu_linear" in b for b in breaks)
