"""The plugin manager: entry-point loading, blocking, validation and listing.

Plugins come only from installed entry points in the ``opguard`` group (the
built-ins are declared there too, in this project's ``pyproject.toml``). A plugin
named by ``--disable-plugin`` or ``OPGUARD_DISABLE_PLUGINS`` is blocked *before*
it is imported. Every error names the plugin.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
from collections.abc import Callable, Iterable
from importlib.metadata import EntryPoint, entry_points
from typing import Any

import pluggy

from opguard_core import ENTRY_POINT_GROUP, PROJECT_NAME, hookspecs
from opguard_core.errors import OpGuardError, PluginError, UsageProblem, ended_by_plugin
from opguard_core.plugin.names import (
    BUILTIN_PLUGINS,
    ESSENTIAL_PLUGINS,
    disabled_from_env,
)

#: Every hook's name starts with this; so must an unmarked function meant as a hook.
HOOK_PREFIX = "opguard_"


class EssentialPluginError(UsageProblem):
    """Someone tried to disable a plugin the pipeline cannot run without."""


@dataclasses.dataclass(frozen=True)
class PluginInfo:
    name: str
    distribution: str | None
    version: str | None
    hooks: list[str]
    builtin: bool


def hook_names() -> list[str]:
    """Every hook that :mod:`opguard_core.hookspecs` declares, sorted."""
    return sorted(
        name
        for name, value in vars(hookspecs).items()
        if name.startswith(HOOK_PREFIX) and hasattr(value, f"{PROJECT_NAME}_spec")
    )


class OpGuardPluginManager(pluggy.PluginManager):
    """A pluggy manager that remembers where each plugin came from."""

    def __init__(self) -> None:
        super().__init__(PROJECT_NAME)
        self.add_hookspecs(hookspecs)
        self.origins: dict[str, tuple[str | None, str | None]] = {}
        self.disabled: list[str] = []

    def parse_hookimpl_opts(self, plugin: Any, name: str) -> pluggy.HookimplOpts | None:
        """Marked functions, and (like pytest) unmarked functions named ``opguard_*``.

        Accepting unmarked ``opguard_*`` functions turns a forgotten ``@hookimpl``
        into a working hook, and a misspelt unmarked one into a clear error,
        rather than a function pluggy silently ignores.
        """
        opts = super().parse_hookimpl_opts(plugin, name)
        if opts is None and name.startswith(HOOK_PREFIX):
            method = getattr(plugin, name, None)
            if inspect.isroutine(method):
                opts = {
                    "wrapper": False,
                    "hookwrapper": False,
                    "optionalhook": False,
                    "tryfirst": False,
                    "trylast": False,
                    "specname": None,
                }
        return opts

    def register(self, plugin: Any, name: str | None = None) -> str | None:
        """Register ``plugin``; raise :class:`PluginError` naming it when it is invalid.

        Invalid means: a hook name that no spec declares (a misspelling: the closest
        hook is suggested), arguments that the hook's spec does not have, or a
        wrapper (``wrapper=True``, ``hookwrapper=True``), which opguard never calls.
        """
        label = name or self.get_canonical_name(plugin)
        if self.is_blocked(label):
            return None
        if self.get_plugin(label) is not None:
            raise PluginError(f'plugin "{label}": a plugin of that name is already registered')
        if self.is_registered(plugin):
            other = self.get_name(plugin)
            raise PluginError(f'plugin "{label}": already registered as plugin "{other}"')
        problems = self._implementation_problems(plugin)
        if problems:
            raise PluginError(f'plugin "{label}": {"; ".join(problems)}')
        try:
            registered = super().register(plugin, name=name)
        except pluggy.PluginValidationError as exc:
            if self.get_plugin(label) is plugin:  # pluggy leaves it half-registered
                self.unregister(plugin)
            raise PluginError(f'plugin "{label}": {_one_line(exc)}') from None
        if registered is None:
            return None
        unknown = sorted(
            caller.name
            for caller in self.get_hookcallers(plugin) or []
            if not caller.has_spec()
            and any(i.plugin is plugin and not i.optionalhook for i in caller.get_hookimpls())
        )
        if unknown:
            self.unregister(plugin)
            raise PluginError(f'plugin "{label}": {"; ".join(map(_unknown_hook, unknown))}')
        return registered

    def _implementation_problems(self, plugin: Any) -> list[str]:
        """``hook(args): unknown argument(s) …`` for every hook function naming arguments
        that its hook's spec does not have, and one for every wrapper: opguard calls
        each plugin's implementation in turn (:meth:`first_result`, ``call_impl``), so
        a wrapper would be accepted and listed, and never run."""
        problems = []
        for attribute in dir(plugin):
            opts = self.parse_hookimpl_opts(plugin, attribute)
            if opts is None:
                continue
            if opts.get("wrapper") or opts.get("hookwrapper"):
                problems.append(
                    f"{attribute}: a wrapper implementation, which opguard does not call;"
                    " implement the hook itself"
                )
                continue
            hook_name = opts.get("specname") or attribute
            caller = getattr(self.hook, hook_name, None)
            if caller is None or caller.spec is None:
                continue
            function = getattr(plugin, attribute)
            try:
                parameters = inspect.signature(function).parameters.values()
            except (TypeError, ValueError):
                continue
            # like pluggy: arguments with defaults, *args and **kwargs are not passed
            names = [
                p.name
                for p in parameters
                if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            ]
            allowed = caller.spec.argnames
            extra = [n for n in names if n not in allowed]
            if extra:
                problems.append(
                    f"{attribute}({', '.join(names)}): unknown argument(s) {', '.join(extra)};"
                    f" {hook_name} takes {', '.join(allowed)}"
                )
        return problems

    def load_entry_points(self, disabled: Iterable[str] = ()) -> None:
        """Block ``disabled``, then load every ``opguard`` entry point that is not blocked.

        Entry points are registered in reverse order of name, so that among
        implementations with the same ``tryfirst``/``trylast`` marking pluggy calls
        them in alphabetical order of plugin name (pluggy calls the most recently
        registered first). This is the documented order of the filter chain.
        """
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
        # reverse=True keeps discovery order among equal names: the first one found wins
        found = sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name, reverse=True)
        for entry_point in found:
            if self.is_blocked(entry_point.name) or self.has_plugin(entry_point.name):
                continue
            self._register(entry_point.name, _load(entry_point), entry_point)
        for name, module_name in sorted(BUILTIN_PLUGINS.items(), reverse=True):
            if not self.is_blocked(name) and not self.has_plugin(name):
                self._register(name, importlib.import_module(module_name), None)
        try:
            self.check_pending()
        except pluggy.PluginValidationError as exc:
            culprit = self.get_name(exc.plugin) if exc.plugin is not None else None
            raise PluginError(f'plugin "{culprit or "?"}": {_one_line(exc)}') from None

    def _register(self, name: str, plugin: Any, entry_point: EntryPoint | None) -> None:
        self.register(plugin, name=name)
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

    def plugin_names(self) -> list[str]:
        """The loaded plugins, as pytest's ``plugins:`` line names them: a built-in by
        name, a third-party one as ``name (distribution version)``."""
        names = []
        for p in self.describe():
            origin = " ".join(x for x in (p.distribution or "?", p.version) if x)
            names.append(p.name if p.builtin else f"{p.name} ({origin})")
        return names

    def first_result(
        self,
        hook_name: str,
        kwargs: dict[str, Any],
        only: str | None = None,
        on_plugin: Callable[[str], None] = lambda name: None,
    ) -> Any:
        """The first non-None result of ``hook_name``'s implementations in call order
        (of plugin ``only``'s, when given), called one at a time so that
        ``on_plugin(name)`` learns which plugin answers (or raises): pluggy alone does
        not say. Raises :class:`OpGuardError` when none answers."""
        impls = self.implementations(hook_name)
        if only is not None:
            plugin = self.get_plugin(only)
            impls = [i for i in impls if i.plugin is plugin]
        for impl in impls:
            on_plugin(impl.plugin_name)
            result = call_impl(impl, kwargs)
            if result is not None:
                return result
        if only is not None:
            raise OpGuardError(f"plugin {only!r} returned no result for {hook_name}")
        raise OpGuardError(f"no plugin returned a result for {hook_name}")

    def implements(self, plugin_name: str, hook_name: str) -> bool:
        """Whether plugin ``plugin_name`` is loaded here and implements ``hook_name``."""
        plugin = self.get_plugin(plugin_name)
        return plugin is not None and any(
            impl.plugin is plugin for impl in getattr(self.hook, hook_name).get_hookimpls()
        )

    def implementations(self, hook_name: str) -> list[pluggy.HookImpl]:
        """The implementations of a hook, in pluggy's call order (:meth:`register`
        refuses wrappers)."""
        return list(reversed(getattr(self.hook, hook_name).get_hookimpls()))


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())


def _unknown_hook(name: str) -> str:
    close = difflib.get_close_matches(name, hook_names(), n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"unknown hook {name!r}{hint}; the hooks are listed in docs/plugins.md"


def _load(entry_point: EntryPoint) -> Any:
    try:
        return entry_point.load()
    except (Exception, SystemExit) as exc:
        why = ended_by_plugin(exc.code, None) if isinstance(exc, SystemExit) else exc
        raise PluginError(f'Error importing plugin "{entry_point.name}": {why}') from exc


def call_impl(impl: pluggy.HookImpl, kwargs: dict[str, Any]) -> Any:
    """Call one implementation with just the arguments it names. A ``SystemExit`` it
    raises is a :class:`PluginError` naming the plugin: the command would otherwise
    end where the plugin was called, with the plugin's exit code (often 0)."""
    try:
        return impl.function(*[kwargs[name] for name in impl.argnames])
    except SystemExit as exc:
        raise PluginError(ended_by_plugin(exc.code, impl.plugin_name)) from None


def create_plugin_manager(disabled: Iterable[str] = ()) -> OpGuardPluginManager:
    """A manager with every installed plugin loaded, except ``disabled`` and the env's."""
    manager = OpGuardPluginManager()
    manager.load_entry_points([*disabled, *disabled_from_env()])
    return manager
