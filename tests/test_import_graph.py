"""The package's import graph: no circle between modules (typing-only imports included), and the packages import each other only
down the layers of ``LAYERS`` (every import, also those inside functions; those under
``if TYPE_CHECKING:`` name types only and are left out).

``python tests/test_import_graph.py`` prints the package graph that docs/architecture.md shows
(``test_the_architecture_page_shows_the_graph`` checks that the page is current).
"""

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


def import_graph(typing_imports: bool = False) -> dict[str, set[str]]:
    """module -> the modules it imports; ``typing_imports``: those under ``if TYPE_CHECKING:`` too."""
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


# package -> the packages it may import (besides itself and the top-level ``fl_lightning``, whose
# ``__init__`` imports only ``package_names``). A module's package: its folder under fl_lightning/
# (``models``/``datamodules`` for the bundled folders); docs/architecture.md, "Layout".
LAYERS: dict[str, set[str]] = {
    "core": set(),
    "optim": {"core"},
    "reliability": {"core"},
    "models": {"core"},
    "datamodules": {"core"},
    "algorithms": {"core", "optim"},
    "executors": {"core", "optim", "algorithms", "reliability"},
    "pipeline": {"core", "optim", "algorithms", "executors"},
    "compression": {"core", "pipeline"},
    "lora": {"core"},
    "robust": {"core", "algorithms", "pipeline"},
    "adversary": {"core", "algorithms", "executors", "pipeline"},
    "clock": {"core", "pipeline", "compression"},
    "secagg": {"core", "pipeline"},
    "rounds": {"core", "reliability", "optim", "algorithms", "executors", "pipeline", "compression", "robust", "adversary", "clock", "lora",
               "secagg"},
}
LAYERS["engine"] = {*LAYERS["rounds"], "rounds"}
LAYERS["run"] = {*LAYERS["engine"], "engine", "models", "datamodules"}
LAYERS["experiments"] = {*LAYERS["run"], "run"}
LAYERS["commands"] = {*LAYERS["experiments"], "experiments"}
TOP = ("fl_lightning", "fl_lightning.package_names")  # the package's __init__ and its import names


def package_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] in ("models", "datamodules"):
        return parts[0]
    return "fl_lightning" if module in TOP else parts[1]


def package_graph(graph: dict[str, set[str]] | None = None) -> dict[str, set[str]]:
    """package -> the packages its modules import (itself and the top-level package left out)."""
    packages: dict[str, set[str]] = {}
    for module, deps in (graph or import_graph()).items():
        if module in TOP:
            continue
        package = package_of(module)
        packages.setdefault(package, set()).update(package_of(d) for d in deps if d.split(".")[0] in PACKAGES)
    return {p: deps - {p, "fl_lightning"} for p, deps in packages.items()}


def markdown(packages: dict[str, set[str]]) -> str:
    """The package graph, lowest layer first: ``package -> the packages it imports`` (docs/architecture.md)."""
    order: list[str] = []
    while len(order) < len(packages):  # a topological order (the graph has no circle)
        order += sorted(p for p, deps in packages.items() if p not in order and deps <= set(order))
    width = max(map(len, order))
    rows = [f"{p:<{width}}  -> {', '.join(sorted(packages[p], key=order.index)) or '(nothing of the package)'}" for p in order]
    return "\n".join(rows)


def test_no_import_circle():
    assert circles(import_graph()) == []


def test_no_import_circle_even_through_annotations():
    """A circle that only type annotations close is still a circle of meaning: a lower layer naming an upper one's types."""
    assert circles(import_graph(typing_imports=True)) == []


def test_the_check_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_subcommands_do_not_import_the_dispatcher():
    graph = import_graph()
    importers = sorted(m for m, deps in graph.items() if "fl_lightning.commands.cli" in deps)
    assert importers == []


def test_every_module_lies_in_a_package_of_the_layers():
    """A new folder, or a module left in fl_lightning/ itself, has to be placed in LAYERS first."""
    unplaced = sorted(m for m in import_graph() if package_of(m) not in LAYERS and m not in TOP)
    assert unplaced == []


def test_packages_import_only_their_layers():
    graph = import_graph()
    wrong = sorted(f"{m} -> {d}" for m, deps in graph.items() if m not in TOP for d in deps
                   if package_of(d) not in (package_of(m), "fl_lightning") and package_of(d) not in LAYERS[package_of(m)])  # fmt: skip
    assert wrong == []
    assert graph["fl_lightning"] <= {"fl_lightning.package_names"} and graph["fl_lightning.package_names"] == set()


def test_the_layers_have_no_circle():
    assert circles(LAYERS) == [] and circles(package_graph()) == []


def test_the_package_never_imports_the_checkouts_top_level_names():
    """``fl_lightning`` names its bundled packages ``fl_lightning.models``/``fl_lightning.datamodules``: the top-level
    ``models``/``datamodules`` exist only in a checkout (a wheel installs them inside the package)."""
    import re

    pattern = re.compile(r"^\s*(from|import)\s+(models|datamodules)\b", re.M)
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "fl_lightning").rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []


def test_the_architecture_page_shows_the_graph():
    page = (ROOT / "docs" / "architecture.md").read_text()
    assert markdown(package_graph()) in page, "regenerate with: python tests/test_import_graph.py"


if __name__ == "__main__":
    print(markdown(package_graph()))
