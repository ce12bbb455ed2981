"""The plugin manager: entry-point loading, blocking, validation and listing.

Plugins come only from installed entry points in the ``opguard`` group (the
built-ins are declared there too, in this project's ``pyproject.toml``). A plugin
named by ``--disable-plugin`` or ``OPGUARD_DISABLE_PLUGINS`` is blocked *before*
it is imported. Every error names the plugin.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from collections.abc import Iterable
from importlib.metadata import EntryPoint, entry_points
from typing import Any

import pluggy

from opguard_core import ENTRY_POINT_GROUP, PROJECT_NAME, hookspecs
from opguard_core.errors import OpGuardError, PluginError

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
}

#: Built-ins the pipeline cannot run without; use ``--skip STAGE`` to skip a stage.
ESSENTIAL_PLUGINS = frozenset({"discover", "combine", "compress", "generate", "compare", "merge"})

DISABLE_ENV = "OPGUARD_DISABLE_PLUGINS"


class EssentialPluginError(OpGuardError):
    """Someone tried to disable a plugin the pipeline cannot run without."""


@dataclasses.dataclass(frozen=True)
class PluginInfo:
    name: str
    distribution: str | None
    version: str | None
    hooks: list[str]
    builtin: bool


def disabled_from_env(environ: dict[str, str] | None = None) -> list[str]:
    raw = (environ if environ is not None else os.environ).get(DISABLE_ENV, "")
    return [name.strip() for name in raw.replace(";", ",").split(",") if name.strip()]


class OpGuardPluginManager(pluggy.PluginManager):
    """A pluggy manager that remembers where each plugin came from."""

    def __init__(self) -> None:
        super().__init__(PROJECT_NAME)
        self.add_hookspecs(hookspecs)
        self.origins: dict[str, tuple[str | None, str | None]] = {}
        self.disabled: list[str] = []

    def load_entry_points(self, disabled: Iterable[str] = ()) -> None:
        """Block ``disabled``, then load every ``opguard`` entry point that is not blocked."""
        blocked = sorted(set(disabled))
        refused = sorted(set(blocked) & ESSENTIAL_PLUGINS)
        if refused:
            raise EssentialPluginError(
                f"cannot disable essential built-in plugin(s) {', '.join(refused)}; "
                "use --skip STAGE to skip a stage instead"
            )
        for name in blocked:
            self.set_blocked(name)
        self.disabled = blocked
        for entry_point in entry_points(group=ENTRY_POINT_GROUP):
            if self.is_blocked(entry_point.name) or self.has_plugin(entry_point.name):
                continue
            self._register(entry_point.name, _load(entry_point), entry_point)
        for name, module_name in BUILTIN_PLUGINS.items():
            if not self.is_blocked(name) and not self.has_plugin(name):
                self._register(name, importlib.import_module(module_name), None)
        try:
            self.check_pending()
        except pluggy.PluginValidationError as exc:
            raise PluginError(f'plugin "{self.get_name(exc.plugin)}": {exc}') from None

    def _register(self, name: str, plugin: Any, entry_point: EntryPoint | None) -> None:
        try:
            self.register(plugin, name=name)
        except pluggy.PluginValidationError as exc:
            raise PluginError(f'plugin "{name}": {exc}') from None
        dist = entry_point.dist if entry_point is not None else None
        self.origins[name] = (dist.name if dist else None, dist.version if dist else None)

    def describe(self) -> list[PluginInfo]:
        """Every registered plugin with its distribution, version and hooks."""
        infos = []
        for name, plugin in self.list_name_plugin():
            if plugin is None:
                continue
            dist, version = self.origins.get(name, (None, None))
            hooks = sorted(caller.name for caller in self.get_hookcallers(plugin) or [])
            builtin = getattr(plugin, "__name__", "").startswith("opguard_plugins.")
            infos.append(PluginInfo(name, dist, version, hooks, builtin))
        return sorted(infos, key=lambda info: (not info.builtin, info.name))

    def implementations(self, hook_name: str) -> list[pluggy.HookImpl]:
        """Non-wrapper implementations of a hook, in pluggy's call order."""
        caller = getattr(self.hook, hook_name)
        return [
            impl
            for impl in reversed(caller.get_hookimpls())
            if not (impl.hookwrapper or impl.wrapper)
        ]


def _load(entry_point: EntryPoint) -> Any:
    try:
        return entry_point.load()
    except Exception as exc:
        raise PluginError(f'Error importing plugin "{entry_point.name}": {exc}') from exc


def call_impl(impl: pluggy.HookImpl, kwargs: dict[str, Any]) -> Any:
    """Call one implementation with just the arguments it names."""
    return impl.function(*[kwargs[name] for name in impl.argnames])


def create_plugin_manager(disabled: Iterable[str] = ()) -> OpGuardPluginManager:
    """A manager with every installed plugin loaded, except ``disabled`` and the env's."""
    manager = OpGuardPluginManager()
    manager.load_entry_points([*disabled, *disabled_from_env()])
    return manager
