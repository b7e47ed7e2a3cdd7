"""The layer graph: no import cycle among the package's modules, nothing imports upward, and a rollout source
never loads the trainer that uses it (neither at import time nor through another module)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("mmrl", "pipelines", "rewards")
#: module -> modules it must never load (directly or transitively)
FORBIDDEN = {
    "mmrl.rollouts": ("mmrl.flow.trainer", "mmrl.vlm.trainer", "mmrl.bandit.trainer"),
    "mmrl.flow.pooled": ("mmrl.flow.trainer",),
    "mmrl.vlm.pooled": ("mmrl.vlm.trainer",),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def import_time_imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules that ``name`` imports when it is imported: its module-level imports (also inside
    module-level ``try`` / ``if`` blocks, not under ``if TYPE_CHECKING``), not those inside functions."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def resolve(module: str | None, level: int) -> str:
        if level == 0:
            return module or ""
        base = package.split(".")[: len(package.split(".")) - (level - 1)]
        return ".".join([*base, module] if module else base)

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                target = resolve(node.module, node.level)
                found.add(target)
                found.update(f"{target}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.If) and not _is_type_checking(node):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)
                visit(node.finalbody)

    visit(tree.body)
    return {m for m in found if m in modules and m != name}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: import_time_imports(name, path, modules) for name, path in modules.items()}


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def test_graph_sees_the_known_edges(graph):
    # the parser must find real edges, or every check below passes vacuously
    assert "mmrl.flow.pooled" in graph["mmrl.flow.trainer"]
    assert "mmrl.rollouts" in graph["mmrl.flow.pooled"]
    assert "pipelines.flow.rollout" in graph["mmrl.flow.pooled"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles(graph):
    assert cycles(graph) == []


def test_lower_layers_never_import_upward(graph):
    for name, targets in graph.items():
        if name.startswith("pipelines"):
            assert not {t for t in targets if t.startswith("mmrl")}, name
        if name.startswith("rewards"):
            assert not {t for t in targets if t.startswith(("mmrl", "pipelines"))}, name
        if name.startswith("mmrl.core"):
            assert all(t.startswith("mmrl.core") for t in targets if t.startswith("mmrl")), name


@pytest.mark.parametrize("module", sorted(FORBIDDEN))
def test_rollout_sources_never_reach_their_trainer(graph, module):
    assert not reachable(graph, module) & set(FORBIDDEN[module])


@pytest.mark.parametrize("module", sorted(FORBIDDEN))
def test_rollout_sources_do_not_even_name_their_trainer(module):
    # not for type checking either: a source is typed against what it receives, never the trainer
    tree = ast.parse(project_modules()[module].read_text())
    named = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            named.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            named.add(node.module)
            named.update(f"{node.module}.{alias.name}" for alias in node.names)
    assert not named & set(FORBIDDEN[module])


@pytest.mark.parametrize("module", sorted(FORBIDDEN))
def test_rollout_sources_load_no_trainer_in_a_fresh_interpreter(module):
    # what the static graph cannot see: imports made by other modules' code while they are imported
    script = f"import json, sys, {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300, check=True
    )
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert module in loaded and not loaded & set(FORBIDDEN[module])
