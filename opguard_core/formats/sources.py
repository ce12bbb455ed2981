"""A merged config's sources: which sources it records, and one source's share of it.

Used by ``opguard check --source`` and by the runtime guard's whole-run rules
(docs/configs.md, "Merged configs and their sources"; formats.md §3, version 4).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from opguard_core.formats.trace import LOOP_PHASE


def recorded_sources(config: dict[str, Any]) -> list[str]:
    """The sources whose contributions a merged config records (``meta.source_ranks``
    and each entry's ``sources``: formats.md §3, version 4); empty when it records
    none (one source, or a merge made before configs recorded them) or a record that
    does not add up (an entry whose shares do not sum to its count, a share of a
    source without ranks: a merge by a tool that carried the fields unread)."""
    meta = config.get("meta") or {}
    source_ranks = meta.get("source_ranks")
    if not isinstance(source_ranks, dict) or len(source_ranks) < 2:
        return []
    for entry in config["entries"]:
        shares = entry.get("sources")
        if not isinstance(shares, dict) or sum(shares.values()) != entry.get("count", 0):
            return []
        if not set(shares) <= set(source_ranks):
            return []
    return sorted(str(s) for s in source_ranks)


def config_steps(meta: Mapping[str, Any]) -> int | None:
    """The optimizer steps a config's (or an observed config's) counts cover:
    ``meta.steps`` maps each source to its steps (formats.md §3), summed; None unless
    every source in ``meta.sources`` recorded them and they add up to at least one."""
    steps = meta.get("steps")
    if isinstance(steps, int) and not isinstance(steps, bool):  # one number: before sources
        return steps or None
    if not isinstance(steps, Mapping) or not steps:
        return None
    values = list(steps.values())
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return None
    sources = meta.get("sources")
    if isinstance(sources, list) and not all(s in steps for s in sources):
        return None
    return sum(values) or None


def config_loops(meta: Mapping[str, Any]) -> int:
    """How many loops a config's counts cover: one per source in ``meta.steps``
    (a merged config's), each ending with its own work after its last optimizer step;
    one where ``meta.steps`` is a number or absent."""
    steps = meta.get("steps")
    return max(len(steps), 1) if isinstance(steps, Mapping) else 1


#: set (in memory) on a projected entry that other sources ran too: its ``ops`` are not
#: the sources' own, so no rule may read them as counts of theirs (``missing_op``)
SHARED_OPS = "shared_ops"


def loop_only(meta: Mapping[str, Any], sources: Sequence[str] | None = None) -> bool:
    """Whether the counts of ``sources`` (default: every source in ``meta.sources``)
    are all of a training loop, by ``meta.phases`` (tracing.md, "Set-up and loop")."""
    phases = meta.get("phases")
    names = list(sources) if sources is not None else meta.get("sources")
    if not isinstance(phases, Mapping) or not isinstance(names, list) or not names:
        return False
    return all(phases.get(name) == LOOP_PHASE for name in names)


def project(config: dict[str, Any], sources: Sequence[str]) -> dict[str, Any]:
    """``config`` as the config of ``sources`` alone: the entries they contributed to,
    each with their count; their ranks and steps. ``ops`` and ``stream_counts`` stay
    the merged ones (a merge does not record them per source), so an op another source
    ran in the same entry is accepted; such an entry is marked :data:`SHARED_OPS`. An
    entry's ``ranks`` (where it lacks some) are cut to the sources' ranks."""
    meta = dict(config.get("meta") or {})
    source_ranks = meta.pop("source_ranks")
    ranks = sorted({int(r) for s in sources for r in source_ranks[s]})
    entries = []
    for entry in config["entries"]:
        by_source = entry["sources"]
        if not any(s in by_source for s in sources):
            continue
        mine = {k: v for k, v in entry.items() if k != "sources"}
        mine["count"] = sum(int(by_source.get(s, 0)) for s in sources)
        if not set(by_source) <= set(sources):
            mine[SHARED_OPS] = True
        if "ranks" in entry:
            mine["ranks"] = sorted(set(int(r) for r in entry["ranks"]) & set(ranks)) or ranks
        entries.append(mine)
    meta["ranks"] = ranks
    meta["sources"] = sorted(sources)
    steps = meta.pop("steps", None)
    if isinstance(steps, dict) and all(s in steps for s in sources):
        meta["steps"] = {s: steps[s] for s in sorted(sources)}
    phases = meta.pop("phases", None)
    if isinstance(phases, dict) and any(s in phases for s in sources):
        meta["phases"] = {s: phases[s] for s in sorted(sources) if s in phases}
    return {**config, "source": "+".join(sorted(sources)), "meta": meta, "entries": entries}


def share_of(config: dict[str, Any], source: str | None) -> dict[str, Any] | None:
    """What one run is held to by the rules that compare its counts: ``config``, or
    ``source``'s share of a merged config that records its sources (:func:`project`);
    None for a merged config and no source of it named (each source's entries would
    be ``missing``: docs/guard.md)."""
    names = recorded_sources(config)
    if not names:
        return config
    if source in names:
        return project(config, [source])
    return None


__all__ = [
    "SHARED_OPS",
    "config_loops",
    "loop_only",
    "project",
    "recorded_sources",
    "share_of",
]
