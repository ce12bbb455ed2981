"""Every hook is documented (docstring and docs/plugins.md) and has a test of its own.

A hook is a function in :mod:`opguard_core.hookspecs` carrying the ``@hookspec``
marker. For ``opguard_NAME`` there must be:

* a docstring on the spec, with a ``:param:`` line for every argument;
* a section in ``docs/plugins.md`` whose heading is ``### `opguard_NAME` ``;
* a test function ``test_hook_NAME`` somewhere under ``tests/``.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

from opguard_core import PROJECT_NAME, hookspecs
from opguard_core.plugin.manager import HOOK_PREFIX, hook_names

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "plugins.md"
TESTS = ROOT / "tests"

HOOKS = hook_names()


def documented_hooks() -> set[str]:
    """Hooks with a ``### `opguard_…` `` heading in docs/plugins.md."""
    text = DOCS.read_text(encoding="utf-8")
    return set(re.findall(r"^###\s+`(opguard_\w+)`", text, flags=re.MULTILINE))


def hook_tests() -> set[str]:
    """Names of every ``test_hook_*`` function defined under tests/."""
    names = set()
    for path in TESTS.rglob("test_*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            is_function = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            if is_function and node.name.startswith("test_hook_"):
                names.add(node.name)
    return names


def test_there_are_hooks() -> None:
    assert "opguard_filter" in HOOKS
    assert "opguard_compress" in HOOKS
    assert all(name.startswith(HOOK_PREFIX) for name in HOOKS)
    undeclared = [
        name
        for name, value in vars(hookspecs).items()
        if inspect.isfunction(value)
        and value.__module__ == hookspecs.__name__
        and not hasattr(value, f"{PROJECT_NAME}_spec")
    ]
    assert not undeclared, f"functions in hookspecs.py without @hookspec: {undeclared}"


@pytest.mark.parametrize("hook", HOOKS)
def test_hooks_have_docstrings(hook: str) -> None:
    spec = getattr(hookspecs, hook)
    doc = inspect.getdoc(spec)
    assert doc, f"{hook} has no docstring in opguard_core/hookspecs.py"
    for argument in inspect.signature(spec).parameters:
        assert f":param {argument}:" in doc, f"{hook}: docstring lacks ':param {argument}:'"


@pytest.mark.parametrize("hook", HOOKS)
def test_hooks_are_documented(hook: str) -> None:
    assert hook in documented_hooks(), f"docs/plugins.md has no '### `{hook}`' section"


@pytest.mark.parametrize("hook", HOOKS)
def test_hooks_have_tests(hook: str) -> None:
    wanted = f"test_hook_{hook.removeprefix(HOOK_PREFIX)}"
    assert wanted in hook_tests(), f"no test function named {wanted} under tests/"


def test_docs_name_no_hook_that_does_not_exist() -> None:
    unknown = documented_hooks() - set(HOOKS)
    assert not unknown, f"docs/plugins.md documents hooks that hookspecs.py lacks: {unknown}"
