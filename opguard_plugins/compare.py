"""Stage 5, compare: a readable report of how one config differs from another.

Layout: totals first; then entries only in the first config, entries only in the
other, and entries present in both whose ops, streams, count or tags differ. Each
section is sorted by key (target, context).
"""

from __future__ import annotations

from typing import Any

from opguard_core import hookimpl
from opguard_core.config_format import EntryKey, entry_key
from opguard_core.errors import one_line


def _label(key: EntryKey) -> str:
    """``target  [context > …]``, control characters escaped: one entry, one line."""
    target, context = key
    return one_line(f"{target}  [{' > '.join(context)}]" if context else target)


def _total(config: dict[str, Any]) -> int:
    """Every op the config's input recorded (``meta.total``)."""
    return int((config.get("meta") or {}).get("total", 0))


def _count_changes(name: str, a: dict[Any, int], b: dict[Any, int]) -> list[str]:
    lines = []
    for key in sorted(set(a) | set(b), key=str):
        before, after = int(a.get(key, 0)), int(b.get(key, 0))
        if before != after:
            shown = one_line(str(key))
            lines.append(f"      {name} {shown}: {before} -> {after} ({after - before:+d})")
    return lines


def _changes(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    lines = []
    ca, cb = int(a.get("count", 0)), int(b.get("count", 0))
    if ca != cb:
        lines.append(f"      count: {ca} -> {cb} ({cb - ca:+d})")
    lines += _count_changes("op", a.get("ops") or {}, b.get("ops") or {})
    lines += _count_changes("stream", a.get("stream_counts") or {}, b.get("stream_counts") or {})
    ta, tb = set(a.get("tags") or ()), set(b.get("tags") or ())
    if ta != tb:
        added = " ".join(f"+{one_line(str(t))}" for t in sorted(tb - ta))
        removed = " ".join(f"-{one_line(str(t))}" for t in sorted(ta - tb))
        lines.append(f"      tags: {' '.join(x for x in (added, removed) if x)}")
    return lines


def compare_configs(
    first: dict[str, Any], other: dict[str, Any], first_label: str, other_label: str
) -> str:
    """The built-in comparison report."""
    a = {entry_key(e): e for e in first["entries"]}
    b = {entry_key(e): e for e in other["entries"]}
    only_a = sorted(set(a) - set(b))
    only_b = sorted(set(b) - set(a))
    changed = [(k, _changes(a[k], b[k])) for k in sorted(set(a) & set(b))]
    changed = [(k, lines) for k, lines in changed if lines]
    ranks_a = list((first.get("meta") or {}).get("ranks", []))
    ranks_b = list((other.get("meta") or {}).get("ranks", []))
    out = [
        f"comparison: {first_label} vs {other_label}",
        "",
        "totals:",
        f"  {'':<18}{first_label:>24}  {other_label:>24}",
        f"  {'entries':<18}{len(a):>24}  {len(b):>24}",
        f"  {'total ops':<18}{_total(first):>24}  {_total(other):>24}",
        f"  {'ranks':<18}{ranks_a!s:>24}  {ranks_b!s:>24}",
        f"  {'only in one':<18}{len(only_a):>24}  {len(only_b):>24}",
        f"  {'changed':<18}{len(changed):>24}",
        "",
        f"only in {first_label}: {len(only_a)}",
    ]
    out += [f"  - {_label(k)}  count={a[k].get('count', 0)}" for k in only_a]
    out += ["", f"only in {other_label}: {len(only_b)}"]
    out += [f"  + {_label(k)}  count={b[k].get('count', 0)}" for k in only_b]
    out += ["", f"changed: {len(changed)}"]
    for key, lines in changed:
        out.append(f"  ~ {_label(key)}")
        out += lines
    return "\n".join(out) + "\n"


@hookimpl(trylast=True)
def opguard_compare(
    first: dict[str, Any], other: dict[str, Any], first_label: str, other_label: str
) -> str:
    return compare_configs(first, other, first_label, other_label)
