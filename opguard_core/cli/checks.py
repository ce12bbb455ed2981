"""Checks of ``opguard`` option values made before anything runs.

Each check either returns the usable value or raises :class:`click.BadParameter`
naming the option and the value (exit 2, one ``Error:`` line from click), so a bad
value never reaches a stage as a silent fallback or a traceback.

* patterns (``--hide``, ``--focus``, ``--ignore``) are compiled one by one by
  :func:`opguard_core.configs.selection.compile_patterns`.
* :func:`check_executor`: ``local`` or an executor an installed plugin provides,
  whose own requirements are importable.
* :func:`unknown_disabled`: ``--disable-plugin`` names that match no plugin (a
  warning, not an error: blocking a plugin that is absent is harmless).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable, Sequence
from typing import Any

import click

from opguard_core import ENTRY_POINT_GROUP

#: The executor every installation has (combine in this process, or its own pool).
LOCAL_EXECUTOR = "local"
#: the built-in combine plugin's module (it is the ``local`` executor)
BUILTIN_COMBINE = "opguard_plugins.stages.combine"


def executors(plugins: Iterable[Any]) -> dict[str, Any]:
    """Executor name → the plugin module providing it (``EXECUTOR_NAME``), plus ``local``."""
    found: dict[str, Any] = {LOCAL_EXECUTOR: None}
    for plugin in plugins:
        name = getattr(plugin, "EXECUTOR_NAME", None)
        if isinstance(name, str):
            found.setdefault(name, plugin)
    return found


def check_executor(name: str, plugins: Iterable[Any]) -> str:
    """``name`` if an installed plugin provides that executor and its requirements import.

    A plugin states its requirements as ``EXECUTOR_REQUIRES`` (module names) and the
    install hint as ``EXECUTOR_INSTALL``. While a plugin implements ``opguard_combine``
    without declaring ``EXECUTOR_NAME``, an unknown name is let through (it may be
    that plugin's).
    """
    plugins = list(plugins)
    known = executors(plugins)
    undeclared = [
        p
        for p in plugins
        if hasattr(p, "opguard_combine")
        and not hasattr(p, "EXECUTOR_NAME")
        and getattr(p, "__name__", "") != BUILTIN_COMBINE
    ]
    if name not in known and undeclared:
        return name  # an executor plugin that does not say its name may take it
    if name not in known:
        raise click.BadParameter(
            f"{name!r}: no such executor (installed: {', '.join(sorted(known))})",
            param_hint="--executor",
        )
    plugin = known[name]
    missing = [m for m in getattr(plugin, "EXECUTOR_REQUIRES", ()) if not _importable(m)]
    if missing:
        hint = getattr(plugin, "EXECUTOR_INSTALL", "")
        raise click.BadParameter(
            f"{name!r}: executor is not installed (missing {', '.join(missing)})"
            + (f"; {hint}" if hint else ""),
            param_hint="--executor",
        )
    return name


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def unknown_disabled(disabled: Sequence[str], builtin: Iterable[str]) -> list[str]:
    """Names in ``disabled`` that are neither built-in nor an installed entry point."""
    builtin = set(builtin)
    if all(name in builtin for name in disabled):
        return []  # no need to read the installed plugins' metadata
    from importlib.metadata import entry_points

    known = builtin | {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}
    return [name for name in disabled if name not in known]


__all__ = [
    "LOCAL_EXECUTOR",
    "check_executor",
    "executors",
    "unknown_disabled",
]
