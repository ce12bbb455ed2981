"""The names of the built-in plugins and of the disabled ones: what the CLI needs
before (or without) loading any plugin (start-up: docs/performance.md)."""

from __future__ import annotations

import os

#: Built-in plugins, as declared in pyproject.toml; used only when the package's
#: metadata is missing (running from a source tree that was not pip-installed).
BUILTIN_PLUGINS: dict[str, str] = {
    "discover": "opguard_plugins.stages.discover",
    "combine": "opguard_plugins.stages.combine",
    "compress": "opguard_plugins.stages.compress",
    "generate": "opguard_plugins.stages.generate",
    "compare": "opguard_plugins.stages.compare",
    "merge": "opguard_plugins.stages.merge",
    "basic_filter": "opguard_plugins.stages.basic_filter",
    "trace": "opguard_plugins.record.trace",
    "dask_executor": "opguard_plugins.stages.dask_executor",
    "export": "opguard_plugins.view.export",
    "export_formats": "opguard_plugins.view.export_formats",
    "report": "opguard_plugins.view.report",
    "config_commands": "opguard_plugins.view.config_commands",
    "divergence": "opguard_plugins.stages.divergence",
    "check": "opguard_plugins.enforce.check",
    "check_rules": "opguard_plugins.enforce.rules",
    "guard": "opguard_plugins.enforce.guard",
    "kineto": "opguard_plugins.readers.kineto",
    "flight_recorder": "opguard_plugins.readers.flight_recorder",
}

#: Built-ins the pipeline cannot run without; use ``--skip STAGE`` to skip a stage.
ESSENTIAL_PLUGINS = frozenset({"discover", "combine", "compress", "generate", "compare", "merge"})

DISABLE_ENV = "OPGUARD_DISABLE_PLUGINS"


def disabled_from_env(environ: dict[str, str] | None = None) -> list[str]:
    """The plugin names in ``$OPGUARD_DISABLE_PLUGINS`` (comma or semicolon separated)."""
    raw = (environ if environ is not None else os.environ).get(DISABLE_ENV, "")
    return [name.strip() for name in raw.replace(";", ",").split(",") if name.strip()]


__all__ = ["BUILTIN_PLUGINS", "DISABLE_ENV", "ESSENTIAL_PLUGINS", "disabled_from_env"]
