"""Stage 5, compare: how one config differs from another, for the run and for
``opguard compare``.

:func:`diff_configs` computes the difference once (totals, entries only in one,
entries in both whose count, ops, streams, dtypes or tags differ); :func:`render_diff`
writes it as text and :func:`diff_to_json` as data. The run's
``comparison_{base}_vs_{N}.log`` is ``render_diff`` sorted by key (target,
context); ``opguard compare`` sorts by size of change unless ``--sort key``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from opguard_core import hookimpl
from opguard_core.errors import one_line
from opguard_core.formats.config import EntryKey, entry_key

Sort = Literal["delta", "key"]
#: a count that changed: (name, before, after)
Change = tuple[Any, int, int]


@dataclasses.dataclass(frozen=True)
class EntryChange:
    """An entry present in both configs whose data differ."""

    key: EntryKey
    before: int
    after: int
    ops: list[Change]
    streams: list[Change]
    tags_added: list[str]
    tags_removed: list[str]
    #: where both entries record dtypes (formats.md, "Dtypes"); else none
    dtypes: list[Change] = dataclasses.field(default_factory=list)
    #: (before, after) the ranks that ran it, where one of them is rank-specific
    #: (an entry without ``ranks`` ran on its config's ``meta.ranks``) and they differ
    ranks: tuple[list[int], list[int]] | None = None

    @property
    def delta(self) -> int:
        return self.after - self.before

    def size(self) -> tuple[int, int]:
        """How large the change is: the count's change, then the ops' changes."""
        return (abs(self.delta), sum(abs(b - a) for _, a, b in self.ops))


@dataclasses.dataclass(frozen=True)
class Side:
    """One config's totals."""

    label: str
    entries: int
    #: None: unknown (a hand-written config without ``meta.total``)
    total: int | None
    ranks: list[int]


@dataclasses.dataclass(frozen=True)
class ConfigDiff:
    first: Side
    other: Side
    #: entries only in the first / only in the other config: (key, count), by key
    only_first: list[tuple[EntryKey, int]]
    only_other: list[tuple[EntryKey, int]]
    changed: list[EntryChange]

    @property
    def differs(self) -> bool:
        """Whether anything differs: an entry, the total or the ranks."""
        return bool(
            self.only_first
            or self.only_other
            or self.changed
            or self.first.ranks != self.other.ranks
            or (
                None not in (self.first.total, self.other.total)
                and self.first.total != self.other.total
            )
        )


def _label(key: EntryKey) -> str:
    """``target  [context > …]``, control characters escaped: one entry, one line."""
    target, context = key
    return one_line(f"{target}  [{' > '.join(context)}]" if context else target)


def _side(config: dict[str, Any], label: str) -> Side:
    meta = config.get("meta") or {}
    total = meta.get("total")
    return Side(
        label,
        len(config["entries"]),
        None if total is None else int(total),
        list(meta.get("ranks", [])),
    )


def _count_changes(a: dict[Any, int], b: dict[Any, int]) -> list[Change]:
    out = []
    for key in sorted(set(a) | set(b), key=str):
        before, after = int(a.get(key, 0)), int(b.get(key, 0))
        if before != after:
            out.append((key, before, after))
    return out


def _entry_ranks(
    a: dict[str, Any], b: dict[str, Any], ranks_a: list[int], ranks_b: list[int]
) -> tuple[list[int], list[int]] | None:
    """(before, after) the ranks that ran an entry, where either is rank-specific and
    they differ (a path that moved from rank 1 to rank 0); else None."""
    if "ranks" not in a and "ranks" not in b:
        return None
    before = sorted(int(r) for r in a.get("ranks", ranks_a))
    after = sorted(int(r) for r in b.get("ranks", ranks_b))
    return (before, after) if before != after else None


def _entry_change(
    key: EntryKey, a: dict[str, Any], b: dict[str, Any], ranks: tuple[list[int], list[int]]
) -> EntryChange | None:
    ta, tb = set(a.get("tags") or ()), set(b.get("tags") or ())
    change = EntryChange(
        key,
        int(a.get("count", 0)),
        int(b.get("count", 0)),
        _count_changes(a.get("ops") or {}, b.get("ops") or {}),
        _count_changes(a.get("stream_counts") or {}, b.get("stream_counts") or {}),
        sorted(tb - ta),
        sorted(ta - tb),
        _count_changes(a["dtype_counts"] or {}, b["dtype_counts"] or {})
        if a.get("dtype_counts") is not None and b.get("dtype_counts") is not None
        else [],
        _entry_ranks(a, b, *ranks),
    )
    if (
        change.ranks
        or change.delta
        or change.ops
        or change.streams
        or change.dtypes
        or change.tags_added
        or change.tags_removed
    ):
        return change
    return None


def diff_configs(
    first: dict[str, Any], other: dict[str, Any], first_label: str, other_label: str
) -> ConfigDiff:
    """The difference between two configs; entries match on (target, context)."""
    a = {entry_key(e): e for e in first["entries"]}
    b = {entry_key(e): e for e in other["entries"]}
    sides = _side(first, first_label), _side(other, other_label)
    ranks = sides[0].ranks, sides[1].ranks
    changes = (_entry_change(k, a[k], b[k], ranks) for k in sorted(set(a) & set(b)))
    return ConfigDiff(
        *sides,
        [(k, int(a[k].get("count", 0))) for k in sorted(set(a) - set(b))],
        [(k, int(b[k].get("count", 0))) for k in sorted(set(b) - set(a))],
        [c for c in changes if c is not None],
    )


def _ordered(diff: ConfigDiff, sort: Sort) -> ConfigDiff:
    """``diff`` with its sections (and each entry's changes) in ``sort`` order: by key,
    or largest first (ties by key)."""
    if sort == "key":
        return diff

    def by_size(items: list[Change]) -> list[Change]:
        return sorted(items, key=lambda c: (-abs(c[2] - c[1]), str(c[0])))

    changed = [
        dataclasses.replace(
            c, ops=by_size(c.ops), streams=by_size(c.streams), dtypes=by_size(c.dtypes)
        )
        for c in sorted(diff.changed, key=lambda c: (tuple(-x for x in c.size()), c.key))
    ]
    return dataclasses.replace(
        diff,
        only_first=sorted(diff.only_first, key=lambda kc: (-kc[1], kc[0])),
        only_other=sorted(diff.only_other, key=lambda kc: (-kc[1], kc[0])),
        changed=changed,
    )


def _cut(items: list[Any], top: int | None) -> tuple[list[Any], int]:
    if top is None or len(items) <= top:
        return items, 0
    return items[:top], len(items) - top


def _total(side: Side) -> str:
    return "unknown" if side.total is None else str(side.total)


def render_diff(diff: ConfigDiff, sort: Sort = "key", top: int | None = None) -> str:
    """The comparison as text: totals, only in the first, only in the other, changed.
    ``top`` keeps the first N of each section (a last line says how many more)."""
    diff = _ordered(diff, sort)
    # the labels (file names) escaped like the entries: one side, one line
    first = dataclasses.replace(diff.first, label=one_line(diff.first.label))
    other = dataclasses.replace(diff.other, label=one_line(diff.other.label))
    w = max(24, len(first.label), len(other.label))  # labels of files can be long
    out = [
        f"comparison: {first.label} vs {other.label}",
        "",
        "totals:",
        f"  {'':<18}{first.label:>{w}}  {other.label:>{w}}",
        f"  {'entries':<18}{first.entries:>{w}}  {other.entries:>{w}}",
        f"  {'total ops':<18}{_total(first):>{w}}  {_total(other):>{w}}",
        f"  {'ranks':<18}{first.ranks!s:>{w}}  {other.ranks!s:>{w}}",
        f"  {'only in one':<18}{len(diff.only_first):>{w}}  {len(diff.only_other):>{w}}",
        f"  {'changed':<18}{len(diff.changed):>{w}}",
    ]
    sections = (
        (f"only in {first.label}", "-", diff.only_first),
        (f"only in {other.label}", "+", diff.only_other),
    )
    for title, mark, items in sections:
        shown, more = _cut(items, top)
        out += ["", f"{title}: {len(items)}"]
        out += [f"  {mark} {_label(k)}  count={count}" for k, count in shown]
        out += [f"  … {more} more (--top {top})"] if more else []
    shown_changes, more = _cut(diff.changed, top)
    out += ["", f"changed: {len(diff.changed)}"]
    for change in shown_changes:
        out.append(f"  ~ {_label(change.key)}")
        if change.delta:
            out.append(f"      count: {change.before} -> {change.after} ({change.delta:+d})")
        if change.ranks:
            out.append(f"      ranks: {change.ranks[0]} -> {change.ranks[1]}")
        for name, changes in (
            ("op", change.ops),
            ("stream", change.streams),
            ("dtype", change.dtypes),
        ):
            out += [
                f"      {name} {one_line(str(k))}: {a} -> {b} ({b - a:+d})" for k, a, b in changes
            ]
        if change.tags_added or change.tags_removed:
            added = " ".join(f"+{one_line(str(t))}" for t in change.tags_added)
            removed = " ".join(f"-{one_line(str(t))}" for t in change.tags_removed)
            out.append(f"      tags: {' '.join(x for x in (added, removed) if x)}")
    out += [f"  … {more} more (--top {top})"] if more else []
    return "\n".join(out) + "\n"


def diff_to_json(diff: ConfigDiff, sort: Sort = "key", top: int | None = None) -> dict[str, Any]:
    """The comparison as plain data (``opguard compare --format json``); each section
    has its full ``count`` and the (``top``-cut) ``entries``."""
    diff = _ordered(diff, sort)

    def key_fields(key: EntryKey) -> dict[str, Any]:
        return {"target": key[0], "context": list(key[1])}

    def counts(changes: list[Change], name: str) -> list[dict[str, Any]]:
        return [{name: k, "before": a, "after": b, "delta": b - a} for k, a, b in changes]

    def section(items: list[Any], render: Any) -> dict[str, Any]:
        return {"count": len(items), "entries": [render(i) for i in _cut(items, top)[0]]}

    return {
        "first": dataclasses.asdict(diff.first),
        "other": dataclasses.asdict(diff.other),
        "differs": diff.differs,
        "sort": sort,
        "top": top,
        "only_first": section(diff.only_first, lambda kc: {**key_fields(kc[0]), "count": kc[1]}),
        "only_other": section(diff.only_other, lambda kc: {**key_fields(kc[0]), "count": kc[1]}),
        "changed": section(
            diff.changed,
            lambda c: {
                **key_fields(c.key),
                "before": c.before,
                "after": c.after,
                "delta": c.delta,
                "ops": counts(c.ops, "op"),
                "streams": counts(c.streams, "stream"),
                "dtypes": counts(c.dtypes, "dtype"),
                "tags_added": c.tags_added,
                "tags_removed": c.tags_removed,
                "ranks": None if c.ranks is None else {"before": c.ranks[0], "after": c.ranks[1]},
            },
        ),
    }


def compare_configs(
    first: dict[str, Any], other: dict[str, Any], first_label: str, other_label: str
) -> str:
    """The built-in comparison report of the run (sorted by key)."""
    return render_diff(diff_configs(first, other, first_label, other_label))


@hookimpl(trylast=True)
def opguard_compare(
    first: dict[str, Any], other: dict[str, Any], first_label: str, other_label: str
) -> str:
    return compare_configs(first, other, first_label, other_label)
