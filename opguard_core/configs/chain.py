"""The filter chain of ``opguard run``, shared with ``opguard filter``, and the merge
fold shared with ``opguard merge``.

Both call the same :func:`active_filters` and :func:`apply_filters`, so a config
filtered by the command equals the one the run writes, byte for byte; ``opguard
merge`` folds through the same ``opguard_merge`` hook (:func:`fold`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ruamel.yaml.comments import CommentedMap

from opguard_core.errors import OpGuardError
from opguard_core.formats.config import entry_key, validate_config
from opguard_core.formats.styles import block_map, flow_seq
from opguard_core.logs import get_logger
from opguard_core.model import RunOptions
from opguard_core.plugin.manager import OpGuardPluginManager, call_impl

BASIC_FILTER_PLUGIN = "basic_filter"


def active_filters(manager: OpGuardPluginManager, options: RunOptions) -> list[Any]:
    """The ``opguard_filter`` implementations a run with ``options`` calls, in order:
    every installed one, the basic filter only with ``--basic``."""
    impls = manager.implementations("opguard_filter")
    return [i for i in impls if options.basic or i.plugin_name != BASIC_FILTER_PLUGIN]


def apply_filters(
    filters: list[Any],
    config: CommentedMap,
    options: RunOptions,
    log: Any = None,
    on_plugin: Any = None,
) -> tuple[CommentedMap, list[dict[str, Any]]]:
    """Fold ``config`` through ``filters``; return the result and, per filter, what
    it kept and dropped. The names of the filters are added to
    ``meta.settings.filters``. ``on_plugin(name)`` is told which filter runs."""
    log = log or get_logger()
    chain = []
    for impl in filters:
        if on_plugin is not None:
            on_plugin(impl.plugin_name)
        before = [entry_key(e) for e in config["entries"]]
        result = call_impl(impl, {"config": config, "options": options})
        if result is not None:
            config = result
        validate_config(config, f"output of filter {impl.plugin_name}")
        after = {entry_key(e) for e in config["entries"]}
        dropped = [k for k in before if k not in after]
        chain.append(
            {
                "plugin": impl.plugin_name,
                "entries_before": len(before),
                "entries_after": len(after),
                "dropped": [f"{t} [{' > '.join(c)}]" if c else t for t, c in dropped],
            }
        )
        log.info("filter applied", plugin=impl.plugin_name, dropped=len(dropped), kept=len(after))
    if filters:
        record_filters(config, [impl.plugin_name for impl in filters])
    return config, chain


def settings_of(config: CommentedMap) -> CommentedMap:
    """``meta.settings`` of ``config``, made (as block mappings) when missing."""
    meta = config.get("meta")
    if meta is None:
        meta = config["meta"] = block_map([])
    settings = meta.get("settings")
    if not isinstance(settings, dict):
        settings = meta["settings"] = block_map([])
    return settings  # type: ignore[no-any-return]


def record_setting(config: CommentedMap, key: str, values: Sequence[str]) -> None:
    """Add ``values`` to the list ``meta.settings[key]`` (``filters``, ``filter_focus``,
    ...), after those already recorded, each once: filtering a filtered config again
    records nothing new (so it writes the same bytes)."""
    if not values:
        return
    settings = settings_of(config)
    recorded = list(settings.get(key) or [])
    settings[key] = flow_seq([*recorded, *(v for v in dict.fromkeys(values) if v not in recorded)])


def record_filters(config: CommentedMap, names: list[str]) -> None:
    """Add ``names`` to ``meta.settings.filters`` (after any already recorded)."""
    record_setting(config, "filters", names)


def merge_step(
    manager: OpGuardPluginManager, left: CommentedMap, right: CommentedMap
) -> tuple[str, CommentedMap]:
    """One merge: the first ``opguard_merge`` implementation (in call order) that
    returns a config; returns its plugin's name and the validated result."""
    for impl in manager.implementations("opguard_merge"):
        result = call_impl(impl, {"left": left, "right": right})
        if result is not None:
            validate_config(result, f"merge result (from {impl.plugin_name})")
            return impl.plugin_name, result
    raise OpGuardError("no plugin returned a result for opguard_merge")


def fold(manager: OpGuardPluginManager, configs: list[CommentedMap]) -> CommentedMap:
    """``((1+2)+3)+…`` through :func:`merge_step`, as the run's merge stage folds."""
    accumulated = configs[0]
    for config in configs[1:]:
        accumulated = merge_step(manager, accumulated, config)[1]
    return accumulated
