"""The built-in plugin table mirrors the entry points pyproject.toml declares."""

from __future__ import annotations

import tomllib
from pathlib import Path

from opguard_core.plugin.manager import BUILTIN_PLUGINS, ESSENTIAL_PLUGINS, create_plugin_manager

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_builtin_table_matches_pyproject_entry_points() -> None:
    declared = tomllib.loads(PYPROJECT.read_text())["project"]["entry-points"]["opguard"]
    assert declared == BUILTIN_PLUGINS
    assert set(declared) >= ESSENTIAL_PLUGINS


def test_every_builtin_is_registered_under_its_entry_point_name() -> None:
    manager = create_plugin_manager()
    for name, module in BUILTIN_PLUGINS.items():
        plugin = manager.get_plugin(name)
        assert plugin is not None, name
        assert plugin.__name__ == module
