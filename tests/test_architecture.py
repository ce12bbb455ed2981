"""The shape of the house (docs/architecture.md), from the source's import statements.

The graph holds every module of ``opguard``, ``opguard_core`` and ``opguard_plugins``
and an edge for each import of one of them, at module level or inside a function
(a lazy import still ties two modules together), but not those under
``if TYPE_CHECKING:``, which never run. ``from package import name`` is an edge to
``package.name`` where that is a module, else to ``package``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("opguard", "opguard_core", "opguard_plugins")

#: pytest's pattern: the manager and the specs know each other's types (type-only)
ALLOWED_CYCLES = [{"opguard_core.hookspecs", "opguard_core.plugin.manager"}]


def _module_files(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _statements(node: ast.AST) -> Iterator[ast.stmt]:
    """Every statement below ``node`` that can run: not the body of an
    ``if TYPE_CHECKING:`` (its ``else`` runs)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _type_checking(child.test):
            for statement in child.orelse:
                yield statement
                yield from _statements(statement)
            continue
        if isinstance(child, ast.stmt):
            yield child
        yield from _statements(child)


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """``name`` or its closest enclosing module of ours (None: not ours)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


@cache
def import_graph(
    root: Path = REPO, packages: tuple[str, ...] = PACKAGES
) -> dict[str, dict[str, int]]:
    """Module -> {imported module: line of its first import}."""
    modules = _module_files(root, packages)
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges: dict[str, int] = {}
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for statement in _statements(ast.parse(path.read_text(), str(path))):
            targets: list[str | None] = []
            if isinstance(statement, ast.Import):
                targets = [_known(alias.name, modules) for alias in statement.names]
            elif isinstance(statement, ast.ImportFrom):
                if statement.level:
                    base = package[: len(package) - statement.level + 1]
                    source = ".".join([*base, *([statement.module] if statement.module else [])])
                else:
                    source = statement.module or ""
                for alias in statement.names:
                    full = f"{source}.{alias.name}"
                    targets.append(full if full in modules else _known(source, modules))
            for target in targets:
                if target is not None and target != name:
                    edges.setdefault(target, statement.lineno)
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, dict[str, int]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def _describe(component: set[str], graph: dict[str, dict[str, int]]) -> str:
    edges = [
        f"{source} -> {target} (line {line})"
        for source in sorted(component)
        for target, line in sorted(graph[source].items())
        if target in component
    ]
    return "; ".join(edges)


def test_the_graph_sees_lazy_imports_and_skips_type_only_ones(tmp_path: Path) -> None:
    files = {
        "pkg/__init__.py": "",
        "pkg/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.b\n",
        "pkg/b.py": "def f():\n    from pkg import c\n",
        "pkg/c.py": "from . import d\nfrom .sub import e\nimport json\n",
        "pkg/d.py": "from pkg.sub.e import name\n",
        "pkg/sub/__init__.py": "from ..a import x\n",
        "pkg/sub/e.py": "if TYPE_CHECKING:\n    pass\nelse:\n    import pkg.b\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path, ("pkg",))
    assert {module: set(edges) for module, edges in graph.items()} == {
        "pkg": set(),
        "pkg.a": set(),  # type-only
        "pkg.b": {"pkg.c"},  # inside a function; ``from pkg import module``
        "pkg.c": {"pkg.d", "pkg.sub.e"},  # relative
        "pkg.d": {"pkg.sub.e"},  # ``from module import name``
        "pkg.sub": {"pkg.a"},
        "pkg.sub.e": {"pkg.b"},  # the else of ``if TYPE_CHECKING`` runs
    }
    assert _cycles(graph) == [{"pkg.b", "pkg.c", "pkg.d", "pkg.sub.e"}]


def test_no_import_cycles() -> None:
    """Two modules that import each other share something that belongs in a third
    (pytest's type-only hookspecs <-> manager excepted)."""
    graph = import_graph()
    cycles = [c for c in _cycles(graph) if c not in ALLOWED_CYCLES]
    assert not cycles, "\n".join(_describe(c, graph) for c in cycles)


def _plugin_imports(forbidden: tuple[str, ...]) -> list[str]:
    return [
        f"{module} imports {target} (line {line})"
        for module, edges in sorted(import_graph().items())
        if module.startswith("opguard_plugins.")
        for target, line in sorted(edges.items())
        if any(target == name or target.startswith(f"{name}.") for name in forbidden)
    ]


def test_plugins_do_not_import_the_cli() -> None:
    """A plugin is called by the CLI, never the other way round: it takes the exit-code
    table and the shared options (``cli.exits``, ``cli.options``), not the group."""
    found = _plugin_imports(("opguard_core.cli.app", "opguard_core.cli.run_command"))
    assert not found, "\n".join(found)


def test_the_command_api_does_not_load_the_group() -> None:
    """Importing what command plugins use leaves the group (and ``opguard run``) out."""
    code = (
        "import sys, opguard_core.cli.exits, opguard_core.cli.options\n"
        "print(sorted(m for m in sys.modules if m.startswith('opguard_core.cli.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["['opguard_core.cli.exits',", "'opguard_core.cli.options']"]


def test_plugins_do_not_import_the_runner() -> None:
    """The runner calls the plugins; a plugin that needs a run asks through a hook or
    a small public API, not the runner's or its helper's module."""
    found = _plugin_imports(("opguard_core.run.runner", "opguard_core.run.helper"))
    assert not found, "\n".join(found)
