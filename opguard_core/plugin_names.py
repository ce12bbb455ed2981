"""The names of the built-in plugins and of the disabled ones: what the CLI needs
before (or without) loading any plugin (start-up: docs/performance.md)."""

from __future__ import annotations

import os

#: Built-in plugins, as declared in pyproject.toml; used only when the package's
#: metadata is missing (running from a source tree that was not pip-installed).
BUILTIN_PLUGINS: dict[str, str] = {
    "discover": "opguard_plugins.discover",
    "combine": "opguard_plugins.combine",
    "compress": "opguard_plugins.compress",
    "generate": "opguard_plugins.generate",
    "compare": "opguard_plugins.compare",
    "merge": "opguard_plugins.merge",
    "basic_filter": "opguard_plugins.basic_filter",
    "trace": "opguard_plugins.trace",
    "dask_executor": "opguard_plugins.dask_executor",
    "export": "opguard_plugins.export",
    "export_formats": "opguard_plugins.export_formats",
    "report": "opguard_plugins.report",
    "config_commands": "opguard_plugins.config_commands",
    "divergence": "opguard_plugins.divergence",
    "check": "opguard_plugins.check",
    "check_rules": "opguard_plugins.check_rules",
    "guard": "opguard_plugins.guard",
}

#: Built-ins the pipeline cannot run without; use ``--skip STAGE`` to skip a stage.
ESSENTIAL_PLUGINS = frozenset({"discover", "combine", "compress", "generate", "compare", "merge"})

DISABLE_ENV = "OPGUARD_DISABLE_PLUGINS"


def disabled_from_env(environ: dict[str, str] | None = None) -> list[str]:
    """The plugin names in ``$OPGUARD_DISABLE_PLUGINS`` (comma or semicolon separated)."""
    raw = (environ if environ is not None else os.environ).get(DISABLE_ENV, "")
    return [name.strip() for name in raw.replace(";", ",").split(",") if name.strip()]


__all__ = ["BUILTIN_PLUGINS", "DISABLE_ENV", "ESSENTIAL_PLUGINS", "disabled_from_env"]
