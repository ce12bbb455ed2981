"""Stage 6, merge: combine two configs entry by entry (formats.md §3).

Entries match on (``target``, ``context``): ``ops`` and ``stream_counts`` add per
key, ``dtype_counts`` too where both entries have them (else the merged entry has
none: formats.md, "Dtypes"), ``count`` adds, ``tags``, ``lines`` and ``ranks`` become sorted unions.
Unmatched entries are kept. The left config's mappings are reused, so comments a
person wrote there survive; so do the right's, where the left has none on a key,
and the comment lines above an entry in either (the left's first). ``meta.ranks`` is
the union, ``meta.total`` the sum, and ``source`` lists every merged source, sorted,
joined by ``+``. ``collectives`` (config version 4) keeps every source's sequences
(:func:`~opguard_core.formats.config_collectives.merge_config_collectives`). A merge
of two or more sources records what each contributed (config version 4): an entry's
``sources`` (source -> count) and ``meta.source_ranks`` (source -> ranks), so
``opguard check`` can hold one source's traces to that source's share (configs.md,
"Checking against a run directory or a merged config").
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any

from ruamel.yaml.comments import CommentedMap, CommentedSeq

from opguard_core import hookimpl
from opguard_core.formats.config import copy_config, entry_comments, entry_key, set_entry_comments
from opguard_core.formats.config_collectives import merge_config_collectives
from opguard_core.formats.op_ranks import entry_op_ranks, ranges_seq, records_op_ranks
from opguard_core.formats.streams import sorted_roles
from opguard_core.formats.styles import block_map, elements_of, flow_map, flow_seq, items_of
from opguard_core.formats.tree import TORCH_API
from opguard_core.formats.values import is_count, same_json, value_order

_ENTRY_FIELDS = frozenset(
    {
        "target",
        "context",
        "kind",
        "file",
        "lines",
        "tags",
        "ops",
        "stream_counts",
        "dtype_counts",
        "count",
        "ranks",
        "op_ranks",
        "sources",
    }
)


def _carry_extras(into: dict[str, Any], other: dict[str, Any], known: frozenset[str]) -> None:
    """Carry fields this version does not know. On a conflict the value whose repr sorts
    first wins, which keeps merging associative and commutative; values are compared
    by type and value (``1``, ``true`` and ``1.0`` conflict: ``opguard_core.formats.values``)."""
    for field, value in other.items():
        if field in known:
            continue
        if field not in into or (
            not same_json(into[field], value) and value_order(value) < value_order(into[field])
        ):
            into[field] = copy.deepcopy(value)


def _sorted_union(a: Any, b: Any) -> CommentedSeq:
    return flow_seq(sorted(set(elements_of(a or ())) | set(elements_of(b or ()))))


def _keep_comments(into: CommentedMap, *sources: Any) -> None:
    """Comments a person wrote on keys of ``sources`` move to the same keys of
    ``into`` (the first source wins where both have one)."""
    for source in reversed(sources):
        if isinstance(source, CommentedMap):
            for key, comment in source.ca.items.items():
                if key in into:
                    into.ca.items[key] = comment


def _add_counts(a: Any, b: Any, roles: bool = False) -> CommentedMap:
    """The sum of two count mappings, sorted by key (stream ``roles`` in role order)."""
    total: dict[Any, int] = dict(items_of(a or {}))
    for key, value in items_of(b or {}):
        total[key] = total.get(key, 0) + value
    summed = block_map(sorted_roles(total) if roles else sorted(total.items()))
    _keep_comments(summed, a, b)
    return summed


def _entry_ranks(entry: dict[str, Any], meta_ranks: list[int]) -> list[int]:
    return list(entry["ranks"]) if "ranks" in entry else list(meta_ranks)


def _merge_kind(a: str | None, b: str | None) -> str | None:
    """A frame's kind wins over ``torch_api``; otherwise the smaller name, for determinism."""
    kinds = [k for k in (a, b) if k is not None]
    frames = [k for k in kinds if k != TORCH_API]
    return min(frames or kinds) if kinds else None


def merge_entries(
    left: CommentedMap, right: dict[str, Any], left_ranks: list[int], right_ranks: list[int]
) -> CommentedMap:
    """Merge ``right`` into ``left`` (same key) and return ``left``."""
    # which ranks ran each op (dropped by merge_configs unless both configs record it)
    ran: dict[str, set[int]] = {}
    for side, ranks in ((left, left_ranks), (right, right_ranks)):
        for op, op_ranks in _op_ranks(side, ranks).items():
            ran.setdefault(op, set()).update(op_ranks)
    _carry_extras(left, right, _ENTRY_FIELDS)
    _keep_comments(left, left, right)
    mine = entry_comments(left)
    theirs = [line for line in entry_comments(right) if line not in mine]
    if theirs:
        set_entry_comments(left, mine + theirs)
    kind = _merge_kind(left.get("kind"), right.get("kind"))
    if kind is not None:
        left["kind"] = kind
    files = [f for f in (left.get("file"), right.get("file")) if f]
    left["file"] = min(files) if files else None
    left["lines"] = _sorted_union(left.get("lines"), right.get("lines"))
    left["tags"] = _sorted_union(left.get("tags"), right.get("tags"))
    left["ops"] = _add_counts(left.get("ops"), right.get("ops"))
    left["stream_counts"] = _add_counts(
        left.get("stream_counts"), right.get("stream_counts"), roles=True
    )
    if "dtype_counts" in left and "dtype_counts" in right:
        left["dtype_counts"] = _add_counts(left["dtype_counts"], right["dtype_counts"])
    else:  # what the side without them ran is unknown (formats.md, "Dtypes")
        left.pop("dtype_counts", None)
    left["count"] = int(left.get("count", 0)) + int(right.get("count", 0))
    left["ranks"] = _sorted_union(_entry_ranks(left, left_ranks), _entry_ranks(right, right_ranks))
    _set_op_ranks(left, ran)
    return left


def _op_ranks(entry: dict[str, Any], meta_ranks: list[int]) -> dict[str, list[int]]:
    """Which ranks ran each of ``entry``'s ops (an op not in its ``op_ranks``: all of
    the entry's ranks), as far as the config records it."""
    listed = entry_op_ranks(entry)
    everywhere = _entry_ranks(entry, meta_ranks)
    return {str(op): listed.get(str(op), everywhere) for op, _ in items_of(entry.get("ops") or {})}


def _set_op_ranks(entry: CommentedMap, ran: dict[str, set[int]]) -> None:
    """Write ``entry``'s ``op_ranks``: the ops of ``ran`` that not all of its ranks ran."""
    everywhere = set(elements_of(entry.get("ranks") or ()))
    some = [(op, sorted(ranks)) for op, ranks in sorted(ran.items()) if ranks != everywhere]
    entry.pop("op_ranks", None)
    if some:
        entry["op_ranks"] = flow_map((op, ranges_seq(ranks)) for op, ranks in some)


def _merge_steps(a: Any, b: Any, add: bool = False) -> CommentedMap:
    """``meta.steps`` (source -> steps) of both, or ``meta.phases`` (source -> phase):
    the union; where both name a source, with ``add`` (steps) the sum, as the counts
    of its entries are summed (two recordings of one source), else the value whose
    repr sorts first (associative, commutative)."""
    steps: dict[Any, Any] = dict(a or {})
    for source, value in (b or {}).items():
        mine = steps.get(source)
        if add and is_count(mine) and is_count(value):
            steps[source] = mine + value
        elif source not in steps or repr(value) < repr(mine):
            steps[source] = value
    return flow_map(sorted(steps.items(), key=lambda kv: str(kv[0])))


def shared_sources(configs: list[dict[str, Any]]) -> list[str]:
    """The sources two or more of ``configs`` name (two recordings of one job under
    one label: merge adds their counts and steps)."""
    seen: set[str] = set()
    shared: set[str] = set()
    for config in configs:
        names = _sources(config)
        shared |= seen & names
        seen |= names
    return sorted(shared)


def differing_settings(configs: list[dict[str, Any]]) -> list[str]:
    """The ``meta.settings`` (formats.md §3: compressor, hide patterns, thresholds…)
    whose values differ between the ``configs`` that record them: the merged config
    can hold one value of each, and ``check`` makes traces into configs with it. A
    setting one of them lacks (``filters``: one was filtered, ``hide``) differs too,
    among the configs that record settings at all."""
    values: dict[str, set[str]] = {}
    every = [(config.get("meta") or {}).get("settings") or {} for config in configs]
    every = [settings for settings in every if isinstance(settings, dict) and settings]
    for key in sorted({k for settings in every for k in settings}, key=str):
        values[str(key)] = {repr(settings.get(key, _ABSENT)) for settings in every}
    return [key for key, seen in values.items() if len(seen) > 1]


#: a setting a config does not record (:func:`differing_settings`)
_ABSENT = object()


def _sources(config: dict[str, Any]) -> set[str]:
    """A config's sources: ``meta.sources`` where it lists them (an entry's name may
    hold a ``+``), else its ``source`` split at ``+`` (a hand-written config)."""
    listed = (config.get("meta") or {}).get("sources")
    if isinstance(listed, list) and listed:
        return {str(name) for name in listed}
    return set(str(config.get("source", "")).split("+")) - {""}


#: per entry key, each source's count; and each source's ranks
Contributions = tuple[dict[Any, dict[str, int]], dict[str, list[int]]]


def contributions(config: dict[str, Any]) -> Contributions | None:
    """What each source contributed to ``config``: its entries' ``sources`` and its
    ``meta.source_ranks`` where it records them (a merge of several sources), the whole
    config for its one source, or None when neither is known (a merge made before
    configs recorded it)."""
    meta = config.get("meta") or {}
    names = sorted(_sources(config))
    source_ranks = meta.get("source_ranks")
    entries = config.get("entries") or []
    if isinstance(source_ranks, dict) and all(isinstance(e.get("sources"), dict) for e in entries):
        return (
            {entry_key(e): {str(s): int(c) for s, c in e["sources"].items()} for e in entries},
            {str(s): [int(r) for r in ranks] for s, ranks in source_ranks.items()},
        )
    if len(names) != 1:
        return None
    ranks = [int(r) for r in meta.get("ranks") or []]
    return {entry_key(e): {names[0]: int(e.get("count", 0))} for e in entries}, {names[0]: ranks}


def _add_contributions(left: Contributions, right: Contributions) -> Contributions:
    counts = {key: dict(by_source) for key, by_source in left[0].items()}
    for key, by_source in right[0].items():
        mine = counts.setdefault(key, {})
        for source, count in by_source.items():
            mine[source] = mine.get(source, 0) + count
    ranks = {source: set(r) for source, r in left[1].items()}
    for source, r in right[1].items():
        ranks.setdefault(source, set()).update(r)
    return counts, {source: sorted(r) for source, r in ranks.items()}


def _record_contributions(result: CommentedMap, both: Contributions | None) -> None:
    """Write each entry's ``sources`` and ``meta.source_ranks`` (two or more sources,
    all known); else remove them: a record that covers only some sources would hold
    a source's traces to a wrong share."""
    meta = result["meta"]
    if both is None or len(both[1]) < 2:
        meta.pop("source_ranks", None)
        for entry in result["entries"]:
            entry.pop("sources", None)
        return
    counts, ranks = both
    record = flow_map((s, flow_seq(ranks[s])) for s in sorted(ranks))
    after = [k for k in ("ranks", "total", "sources", "steps", "phases") if k in meta]
    meta.insert(list(meta).index(after[-1]) + 1 if after else len(meta), "source_ranks", record)
    for entry in result["entries"]:
        entry.pop("sources", None)  # written last: after count and ranks
        by_source = counts.get(entry_key(entry), {})
        entry["sources"] = flow_map(sorted(by_source.items()))


#: ``meta``'s keys in the order generate writes them; any others after, sorted
_META_ORDER = ("ranks", "total", "sources", "steps", "phases", "source_ranks", "recorded_by",
               "op_ranks", "settings")  # fmt: skip


def merge_configs(left: CommentedMap, right: CommentedMap) -> CommentedMap:
    """The built-in merge. ``left`` is copied, never changed in place."""
    left_share, right_share = contributions(left), contributions(right)
    both = (
        _add_contributions(left_share, right_share)
        if left_share is not None and right_share is not None
        else None
    )
    result: CommentedMap = copy_config(left)
    left_meta = result.get("meta") or {}
    right_meta = right.get("meta") or {}
    left_ranks = list(left_meta.get("ranks", []))
    right_ranks = list(right_meta.get("ranks", []))
    all_ranks = sorted(set(left_ranks) | set(right_ranks))
    by_key: dict[Any, CommentedMap] = {}
    for entry in result["entries"]:
        by_key[entry_key(entry)] = entry
        if "ranks" not in entry and left_ranks != all_ranks:
            entry["ranks"] = flow_seq(left_ranks)
    for entry in right["entries"]:
        key = entry_key(entry)
        mine = by_key.get(key)
        if mine is None:
            mine = by_key[key] = copy_config(entry)
            if "ranks" not in mine:
                mine["ranks"] = flow_seq(right_ranks)
        else:
            merge_entries(mine, entry, left_ranks, right_ranks)
    entries = []
    for key in sorted(by_key):
        entry = by_key[key]
        if "ranks" in entry and sorted(entry["ranks"]) == all_ranks:
            del entry["ranks"]
        entries.append(entry)
    meta = CommentedMap(left_meta)
    # every key of meta this merge decides (settings: carried as an unknown key is)
    _carry_extras(meta, right_meta, frozenset(_META_ORDER) - {"settings"})
    meta["ranks"] = flow_seq(all_ranks)
    if "total" in left_meta and "total" in right_meta:
        meta["total"] = int(left_meta["total"]) + int(right_meta["total"])
    else:  # unknown on one (a hand-written config): unknown, not the other side's alone
        meta.pop("total", None)
    if "sources" in left_meta or "sources" in right_meta:
        # both sides' sources, a side without meta.sources (an old or hand-written
        # config) by its ``source``: else its name is lost at the next merge
        meta["sources"] = flow_seq(sorted(_sources(left) | _sources(right)))
    if "steps" in left_meta or "steps" in right_meta:
        meta["steps"] = _merge_steps(left_meta.get("steps"), right_meta.get("steps"), add=True)
    if "phases" in left_meta or "phases" in right_meta:
        meta["phases"] = _merge_steps(left_meta.get("phases"), right_meta.get("phases"))
    if "recorded_by" in left_meta and "recorded_by" in right_meta:  # unknown on one: unknown
        meta["recorded_by"] = _sorted_union(left_meta["recorded_by"], right_meta["recorded_by"])
    else:
        meta.pop("recorded_by", None)
    if records_op_ranks(left) and records_op_ranks(right):
        meta["op_ranks"] = True
    else:  # which ranks ran an op is unknown on one side: unknown
        meta.pop("op_ranks", None)
        for entry in entries:
            entry.pop("op_ranks", None)
    _put_in_order(meta, _META_ORDER)  # the left side's order once decided it
    meta.fa.set_block_style()
    _keep_comments(meta, left_meta, right_meta)
    result["meta"] = meta
    result["source"] = "+".join(sorted(_sources(left) | _sources(right)))
    _carry_extras(result, right, frozenset({"version", "source", "meta", "entries", "collectives"}))
    seq = CommentedSeq(entries)
    result["entries"] = seq
    if "collectives" in left or "collectives" in right:
        result["collectives"] = merge_config_collectives(
            left.get("collectives"), right.get("collectives")
        )
    _record_contributions(result, both)
    _put_in_order(result, _DOC_ORDER)
    for entry in result["entries"]:
        _put_in_order(entry, _ENTRY_ORDER, last=("sources",))
    return result


#: the document's and an entry's keys in the order generate writes them: fields this
#: version does not know go after them, sorted (an entry's ``sources`` stays last)
_DOC_ORDER = ("version", "source", "meta", "entries", "collectives")
_ENTRY_ORDER = ("target", "kind", "file", "lines", "context", "tags", "ops", "stream_counts",
                "dtype_counts", "count", "ranks", "op_ranks")  # fmt: skip


#: (order, last) -> each known key's place, for :func:`_put_in_order`
_PLACES: dict[tuple[tuple[str, ...], tuple[str, ...]], dict[str, int]] = {}


def _put_in_order(
    mapping: CommentedMap, order: tuple[str, ...], last: tuple[str, ...] = ()
) -> None:
    """Reorder ``mapping`` in place (comments stay on their keys): ``order``'s keys,
    the others sorted, then ``last``'s, so that the bytes of a merge do not depend on
    which side had which key (a side without ``meta``, or with a field of its own, put
    it at the end of the other side's keys: ``merge A B`` and ``merge B A`` differed)."""
    # the mapping's own keys through OrderedDict's C methods: CommentedMap's Python
    # __iter__ and __contains__ made this 8 % of a merge of 2,600 entries
    keys = list(OrderedDict.__iter__(mapping))
    place = _PLACES.get((order, last))
    if place is None:
        place = _PLACES[(order, last)] = {k: i for i, k in enumerate((*order, *last))}
    at = [place.get(key, -1) for key in keys]
    if -1 not in at and at == sorted(at):  # known keys, in order, as generate wrote them
        return
    present = set(keys)
    extras = sorted(
        (key for key in keys if key not in order and key not in last),
        key=lambda key: (str(key), type(key).__name__),
    )
    wanted = [*(k for k in order if k in present), *extras, *(k for k in last if k in present)]
    if keys == wanted:
        return
    for key in wanted:
        mapping.move_to_end(key)


@hookimpl(trylast=True)
def opguard_merge(left: CommentedMap, right: CommentedMap) -> CommentedMap:
    return merge_configs(left, right)
