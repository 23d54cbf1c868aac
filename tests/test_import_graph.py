"""The package's import graph has no circle (every import, also those inside functions)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("fl_lightning", "models", "datamodules")


def _modules() -> dict[str, Path]:
    mods = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _aliases(name: str) -> str:
    for old in ("models", "datamodules"):  # the old import names are the same modules as fl_lightning.<old>
        if name == f"fl_lightning.{old}" or name.startswith(f"fl_lightning.{old}."):
            return name[len("fl_lightning."):]
    return name


def import_graph() -> dict[str, set[str]]:
    mods = _modules()

    def resolve(name: str) -> str:
        name = _aliases(name)
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for module, path in mods.items():
        deps = set()
        tree = ast.parse(path.read_text())
        # Imports under `if TYPE_CHECKING:` name types for annotations only; they never run.
        typing_only = {
            id(inner) for node in ast.walk(tree)
            if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING"
            for inner in ast.walk(node)
        }  # fmt: skip
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                deps |= {resolve(alias.name) for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        package = package.rpartition(".")[0]
                    base = f"{package}.{base}" if base else package
                for alias in node.names:
                    full = _aliases(f"{base}.{alias.name}")
                    deps.add(resolve(full) if full in mods else resolve(base))
        graph[module] = deps - {module, ""}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle():
    assert circles(import_graph()) == []


def test_the_check_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_subcommands_do_not_import_the_dispatcher():
    graph = import_graph()
    importers = sorted(m for m, deps in graph.items() if "fl_lightning.commands.cli" in deps)
    assert importers == []
