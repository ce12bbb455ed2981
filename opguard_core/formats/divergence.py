"""Divergence reports (``{name}_divergence.json`` and ``.log``): document, writer, reader.

A finding (what the ``opguard_divergence`` hook returns) has ``kind``, ``severity``
(``error`` or ``warning``), ``ranks`` (the ranks that deviate), ``target`` and
``message``, plus what its kind carries (see docs/divergence.md).

The document (version 4) is ``{"format": "opguard-divergence", "version": 4, "meta",
"frames", "stacks", "groups"}``: the findings grouped by kind and deviating-rank set
(:func:`group_findings`), each stack written once (``stacks``: lists of indices into
``frames``, the frames' text written once), a group's message written once and its
findings as rows that name their stack by index. Versions 1 to 3 (``"findings"``, a
flat list, each with its stack and message) are still read; :func:`load_divergence`
gives every version's findings as one flat list. The log is the groups for a person:
errors first, each group once with its largest findings and one stack.
"""

from __future__ import annotations

from collections import Counter
from operator import itemgetter
from pathlib import Path
from typing import Any

import msgspec

from opguard_core.errors import InputError
from opguard_core.formats.trace import list_ranks
from opguard_core.formats.values import is_counts

DIVERGENCE_FORMAT = "opguard-divergence"
#: version 2: a collective finding's ``stream`` is its stream role (``comm``), not a raw
#: id; version 3: the collective-sequence kinds (``SEQUENCE_KINDS``) and
#: ``meta.sequence_ranks``; version 4: findings grouped by kind and deviating-rank
#: set, stacks and frames written once (``groups``, ``stacks``, ``frames``, no flat
#: ``findings``), ``meta.counts``; versions 1 to 3 are still read
DIVERGENCE_VERSION = 4
READ_VERSIONS = (1, 2, 3, 4)
#: a group's findings listed in the log (the largest; the JSON lists all)
LOG_MEMBERS = 10
SEVERITIES = ("error", "warning")
#: findings of the comparison of collective sequences by position (docs/divergence.md)
SEQUENCE_KINDS = (
    "collective_order",
    "collective_dtype",
    "collective_size",
    "collective_reduce_op",
    "collective_missing",
    "collective_extra",
    "collective_group",
)
#: a warning: a group whose sequences were compared only up to a position
#: (``opguard_plugins/stages/sequences.py``, ``MAX_STEPPED``)
UNCHECKED_KIND = "sequence_unchecked"
KINDS = (
    "collective_mismatch",
    *SEQUENCE_KINDS,
    UNCHECKED_KIND,
    "rank_specific",
    "count_skew",
    "dtype_mismatch",
)

Finding = dict[str, Any]


def sort_findings(findings: list[Finding]) -> list[Finding]:
    """By severity (errors first), then size (``ops`` deviating, largest first), then
    kind, target, op and ranks, so the order is the same for the same trace."""

    # the keys built in one pass (no call per finding), the position last: ties keep
    # the findings' order, as a stable sort by the key alone does
    keyed = [
        (
            SEVERITIES.index(severity) if (severity := f.get("severity")) in SEVERITIES else 2,
            -int(f.get("size", 0)),
            str(f.get("kind", "")),
            str(f.get("target", "")),
            str(f.get("op") or ""),
            list(f.get("ranks") or []),
            position,
        )
        for position, f in enumerate(findings)
    ]
    keyed.sort()
    return [findings[key[-1]] for key in keyed]


def check_findings(findings: object, where: str) -> list[Finding]:
    """Refuse anything but a list of findings with the required fields."""
    if not isinstance(findings, list):
        raise InputError(where, "findings must be a list")
    for index, f in enumerate(findings):
        if not isinstance(f, dict):
            raise InputError(where, f"findings[{index}] must be an object")
        if f.get("severity") not in SEVERITIES:
            raise InputError(where, f"findings[{index}].severity must be error or warning")
        ranks = f.get("ranks")
        if not isinstance(ranks, list) or not all(isinstance(r, int) for r in ranks):
            raise InputError(where, f"findings[{index}].ranks must be a list of ranks")
        for name in ("kind", "target", "message"):
            if not isinstance(f.get(name), str):
                raise InputError(where, f"findings[{index}].{name} must be a string")
    return findings


def tally(findings: list[Finding]) -> dict[str, int]:
    """Counts for the summary: findings, errors, warnings, and one per kind."""
    severities = Counter(map(itemgetter("severity"), findings))
    errors = severities.get("error", 0)
    counts = {"findings": len(findings), "errors": errors, "warnings": len(findings) - errors}
    for kind, number in Counter(map(itemgetter("kind"), findings)).items():
        counts[kind] = counts.get(kind, 0) + number
    return counts


def group_findings(findings: list[Finding], ordered: bool = False) -> list[dict[str, Any]]:
    """Findings grouped by (kind, deviating-rank set), in the order the log and the
    report show them: errors first, then by the group's summed ``size`` (largest
    first), kind and ranks. Each group: ``kind``, ``severity`` (``error`` when any
    member is), ``ranks``, ``size`` and ``findings`` (its members in
    :func:`sort_findings` order; ``ordered``: ``findings`` already are)."""
    groups: dict[tuple[str, tuple[int, ...]], dict[str, Any]] = {}
    for f in findings if ordered else sort_findings(findings):
        key = (f["kind"], tuple(f["ranks"]))
        group = groups.get(key)
        if group is None:
            group = groups[key] = {
                "kind": key[0],
                "severity": f["severity"],
                "ranks": list(key[1]),
                "size": 0,
                "findings": [],
            }
        elif f["severity"] == "error":
            group["severity"] = "error"
        group["size"] += int(f.get("size", 0))
        group["findings"].append(f)

    def order(g: dict[str, Any]) -> tuple[Any, ...]:
        severity = SEVERITIES.index(g["severity"]) if g["severity"] in SEVERITIES else 2
        return (severity, -g["size"], g["kind"], g["ranks"])

    return sorted(groups.values(), key=order)


#: a finding's fields a version-4 group holds for all its members (not repeated per row)
_GROUP_FIELDS = ("kind", "severity", "ranks", "message")
_STACK_FIELDS = ("stack", "expected_stack")
#: per group, the findings (the largest) whose stacks and context a version-4 document
#: writes, as many as the log shows: the others name their ``callsite`` in the
#: combined trace, where their stack is (stacks are most of a document's bytes; a
#: finding with no callsite, a collective sequence's, always has its stacks)
STACKS_PER_GROUP = 1
#: groups whose first finding's stacks are written (the largest; a finding with no
#: callsite, a collective sequence's, always has its stacks): the log shows every
#: group's, and the combined trace has every callsite's
MAX_STACK_GROUPS = 64


def encode_divergence(
    meta: dict[str, Any], findings: list[Finding], groups: list[dict[str, Any]] | None = None
) -> bytes:
    """The version-4 document: header (``meta`` with ``counts``), ``frames`` and
    ``stacks`` (each written once), then one group per line.

    A group carries ``kind``, ``severity``, ``ranks``, ``size``, ``count`` (its
    findings), ``message`` (its first finding's), ``first`` (the fields only its
    first finding has: its stacks and context, for a group of several), ``common``
    (the fields every one of its findings has with one value), ``fields`` and
    ``findings``: one row (a list, in the order of ``fields``) per finding, without
    the group's fields.
    In a row ``stack`` and ``expected_stack`` are indices into ``stacks`` (written for
    the group's first :data:`STACKS_PER_GROUP` findings, with their ``context``;
    left out for the rest, whose ``callsite`` names where the stack is), ``counts`` is a
    list (one count per rank of the group) where it names exactly the group's ranks,
    and a ``distribution`` that its counts give is left out (null). ``groups``:
    :func:`group_findings` of ``findings``, where the caller has them."""
    encoder = msgspec.json.Encoder(order="deterministic")
    groups = group_findings(findings) if groups is None else groups
    nranks = len(meta.get("ranks") or [])
    frame_ids: dict[str, int] = {}
    stack_ids: dict[tuple[int, ...], int] = {}

    def stack_id(stack: Any) -> int | None:
        if not isinstance(stack, list) or not stack:
            return None
        key = tuple(frame_ids.setdefault(str(frame), len(frame_ids)) for frame in stack)
        return stack_ids.setdefault(key, len(stack_ids))

    lines = []
    for group_number, g in enumerate(groups):
        ranks = g["ranks"]
        keys = [str(r) for r in ranks]
        stacked = group_number < MAX_STACK_GROUPS
        rows = []
        for number, f in enumerate(g["findings"]):
            row = f.copy()  # then the group's fields out: the finding's order kept
            for name in _GROUP_FIELDS:
                row.pop(name, None)
            with_stack = (stacked and number < STACKS_PER_GROUP) or row.get("callsite") is None
            for name in _STACK_FIELDS:
                if name in row:
                    if with_stack:
                        row[name] = stack_id(row[name])
                    else:
                        del row[name]
            if not with_stack:
                row.pop("context", None)
            counts = row.get("counts")
            if (
                "distribution" in row
                and isinstance(counts, dict)
                and row["distribution"] == rebuilt_distribution(counts, row.get("expected"), nranks)
            ):
                row["distribution"] = None
            if (
                isinstance(counts, dict)
                and counts
                and len(counts) == len(keys)
                and list(counts) == keys
            ):
                row["counts"] = list(counts.values())
            rows.append(row)
        # what only the first finding has (its stacks, its context) is written once
        head, others = rows[0], rows[1:]
        first = {k: v for k, v in head.items() if all(k not in r for r in others)} if others else {}
        for k in first:
            del head[k]
        names = sorted(set().union(*rows))
        # a field with one value in every row is written once, in ``common``
        common = (
            {k: head.get(k) for k in names if all(k in row and row[k] == head[k] for row in rows)}
            if others
            else {}
        )
        fields = [k for k in names if k not in common]
        lines.append(
            encoder.encode(
                {
                    "kind": g["kind"],
                    "severity": g["severity"],
                    "ranks": ranks,
                    "size": g["size"],
                    "count": len(rows),
                    "message": g["findings"][0]["message"],
                    **({"first": first} if first else {}),
                    **({"common": common} if common else {}),
                    "fields": fields,
                    "findings": [list(map(row.get, fields)) for row in rows],
                }
            )
        )
    counts = tally(findings)
    counts["groups"] = len(groups)
    head = encoder.encode(
        {
            "format": DIVERGENCE_FORMAT,
            "version": DIVERGENCE_VERSION,
            "meta": {**meta, "counts": counts},
        }
    )[:-1]
    frames = encoder.encode(list(frame_ids))
    stacks = b",\n".join(encoder.encode(list(stack)) for stack in stack_ids)
    body = b",\n".join(lines)
    return b"".join(
        [
            head,
            b',\n"frames":',
            frames,
            b',\n"stacks":[\n',
            stacks,
            b"\n]" if stacks else b"]",
            b',\n"groups":[\n',
            body,
            b"\n" if body else b"",
            b"]}\n",
        ]
    )


def rebuilt_distribution(counts: dict[str, Any], expected: Any, nranks: int) -> list[list[Any]]:
    """A ``collective_mismatch``'s distribution ``[[count, number of ranks], …]`` (the
    most held first, then by count) from its ``counts`` (the deviating ranks) and
    ``expected`` (every other of the ``nranks`` ranks)."""
    held: dict[Any, int] = {}
    for value in counts.values():
        held[value] = held.get(value, 0) + 1
    rest = nranks - len(counts)
    if rest > 0:
        held[expected] = held.get(expected, 0) + rest
    return sorted(([v, n] for v, n in held.items()), key=lambda d: (-d[1], d[0]))


def flatten_groups(doc: dict[str, Any], where: str, distributions: bool = True) -> list[Finding]:
    """A version-4 document's findings as one flat list, each as the stage found it
    (its stacks as frame lists, its ``counts`` by rank, its ``distribution``) but for
    ``message`` (the group's first finding has its own, the others the group's) and
    the stacks and context of findings past a group's first
    :data:`STACKS_PER_GROUP` (empty: their ``callsite`` says where they are). With
    ``distributions=False`` a distribution the document left out stays None (the
    report, which does not show it, saves rebuilding it)."""
    frames = doc.get("frames")
    stacks = doc.get("stacks")
    groups = doc.get("groups")
    meta = doc.get("meta")
    nranks = len(meta.get("ranks") or []) if isinstance(meta, dict) else 0
    if not isinstance(frames, list) or not isinstance(stacks, list):
        raise InputError(where, "frames and stacks must be lists")
    if not isinstance(groups, list):
        raise InputError(where, "groups must be a list")
    found: list[Finding] = []
    for number, g in enumerate(groups):
        g = g if isinstance(g, dict) else {}
        rows, ranks, fields = g.get("findings"), g.get("ranks"), g.get("fields")
        if not (isinstance(rows, list) and isinstance(ranks, list) and isinstance(fields, list)):
            raise InputError(where, f"groups[{number}] must have ranks, fields and findings lists")
        common = g.get("common") or {}
        if not isinstance(common, dict):
            raise InputError(where, f"groups[{number}].common must be an object")
        shared = {**{k: g.get(k) for k in _GROUP_FIELDS}, **common}
        first = g.get("first") or {}
        if not isinstance(first, dict):
            raise InputError(where, f"groups[{number}].first must be an object")
        for index, row in enumerate(rows):
            if not isinstance(row, list) or len(row) != len(fields):
                raise InputError(
                    where, f"groups[{number}].findings[{index}] must be a list as long as fields"
                )
            f = {**shared, **dict(zip(map(str, fields), row, strict=True)), "ranks": list(ranks)}
            if index == 0:
                f.update(first)
                if not is_counts(f["ranks"]):
                    raise InputError(
                        where, f"groups[{number}].ranks must be a list of non-negative integers"
                    )
            for name in _STACK_FIELDS:
                if f.get(name) is not None:
                    f[name] = _stack(f[name], stacks, frames, where, number, index)
            if index and f.get("callsite") is not None:  # its stacks: see the callsite
                for name in (*_STACK_FIELDS, "context"):
                    if name in first:
                        f[name] = []
            if f.get("callsite") is not None:  # no stack written: the callsite's
                f.setdefault("stack", [])
                f.setdefault("context", [])
            counts = f.get("counts")
            if isinstance(counts, list):
                if len(counts) != len(ranks):
                    raise InputError(
                        where, f"groups[{number}].findings[{index}].counts must match the ranks"
                    )
                f["counts"] = {str(r): c for r, c in zip(ranks, counts, strict=True)}
            if "distribution" in f and f["distribution"] is None and f.get("majority", True):
                del f["distribution"]  # a column another finding of the group fills
            elif distributions and "distribution" in f and f["distribution"] is None:
                f["distribution"] = rebuilt_distribution(
                    f.get("counts") or {}, f.get("expected"), nranks
                )
            found.append(f)
    return found


def _stack(index: Any, stacks: list[Any], frames: list[Any], where: str, g: int, i: int) -> Any:
    if not isinstance(index, int) or not 0 <= index < len(stacks):
        raise InputError(where, f"groups[{g}].findings[{i}]: stack {index!r} is not in stacks")
    stack = stacks[index]
    if not isinstance(stack, list) or not all(
        isinstance(fid, int) and 0 <= fid < len(frames) for fid in stack
    ):
        raise InputError(where, f"stacks[{index}] must list indices into frames")
    return [frames[fid] for fid in stack]


def load_divergence(path: Path) -> dict[str, Any]:
    """Read a ``{name}_divergence.json`` of any version read; one-line
    :class:`InputError` on any problem. A version-4 document also gets ``findings``,
    its groups' findings as one flat list (:func:`flatten_groups`)."""
    try:
        doc = msgspec.json.decode(path.read_bytes())
    except OSError as exc:
        raise InputError(path, f"cannot read file: {exc.strerror or exc}") from None
    except msgspec.DecodeError as exc:
        raise InputError(path, f"not valid JSON: {exc}") from None
    except RecursionError:
        raise InputError(path, "not valid JSON: nested too deep") from None
    if (
        not isinstance(doc, dict)
        or doc.get("format") != DIVERGENCE_FORMAT
        or doc.get("version") not in READ_VERSIONS
    ):
        raise InputError(
            path,
            f"expected format {DIVERGENCE_FORMAT!r} version {' or '.join(map(str, READ_VERSIONS))}",
        )
    if doc["version"] >= 4:
        doc["findings"] = flatten_groups(doc, str(path))
    check_findings(doc.get("findings"), str(path))
    return doc


def render_log(
    meta: dict[str, Any], findings: list[Finding], groups: list[dict[str, Any]] | None = None
) -> str:
    """The log for a person: a header, then each group of findings (kind and
    deviating ranks) once: its first finding's message, its largest findings (at
    most :data:`LOG_MEMBERS`, one line each) and one stack; a stack shown for an
    earlier group is named, not repeated. ``groups``: as for :func:`encode_divergence`."""
    counts = tally(findings)
    groups = group_findings(findings) if groups is None else groups
    lines = [
        f"divergence: {meta.get('source', '?')}, {len(meta.get('ranks', []))} ranks, "
        f"{counts['errors']} error(s), {counts['warnings']} warning(s) in {len(groups)} "
        f"group(s) (count skew threshold {meta.get('skew')})",
    ]
    sequence_ranks = meta.get("sequence_ranks")
    if isinstance(sequence_ranks, list) and sequence_ranks:
        lines.append(
            f"collective sequences compared by position for rank(s) {_ranks(sequence_ranks)}"
        )
        without = [r for r in meta.get("ranks", []) if r not in sequence_ranks]
        if without:
            lines.append(
                f"note: rank(s) {_ranks(without)} recorded no collective sequence (none "
                "issued, or an older trace): collectives are compared by count per callsite too"
            )
    elif isinstance(sequence_ranks, list):
        lines.append(
            "note: no collective sequence was recorded (traces older than version 6): "
            "collectives are compared by count per callsite"
        )
    if not meta.get("per_rank_stats", True):
        lines.append(
            "note: the combined trace has no per-rank statistics (a rank came twice or a "
            "version-1 combined input): only ranks that never ran something are reported"
        )
    if not findings:
        lines.append("")
        lines.append("no divergence: every rank did the same")
    shown: dict[tuple[str, ...], int] = {}
    for number, g in enumerate(groups, 1):
        members = g["findings"]
        first = members[0]
        lines.append("")
        what = _what(first) if len(members) == 1 else f"{len(members)} findings (size {g['size']})"
        lines.append(
            f"{g['severity'].upper()} {g['kind']} [finding group {number}] on rank(s) "
            f"{_ranks(g['ranks'])}: {what}"
        )
        lines.append(f"  {first['message']}")
        if first["kind"] in SEQUENCE_KINDS:
            lines.extend(_sequence_lines(first))
        if len(members) == 1:
            lines.extend(_counts_lines(first))
        else:
            lines.append("  findings (largest first):")
            lines.extend(f"    {_member(f)}" for f in members[:LOG_MEMBERS])
            if len(members) > LOG_MEMBERS:
                lines.append(
                    f"    … {len(members) - LOG_MEMBERS} more "
                    f"(all in {meta.get('source', '?')}_divergence.json)"
                )
        lines.extend(_stack_lines(first.get("stack"), "stack", number, shown))
        expected_stack = first.get("expected_stack") or []
        if expected_stack and expected_stack != first.get("stack"):
            lines.extend(_stack_lines(expected_stack, "expected from", number, shown))
    return "\n".join(lines) + "\n"


def _what(f: Finding) -> str:
    if f.get("op"):
        api = f" ({f['api']})" if f.get("api") else ""
        return f"{f['op']}{api} in {f['target']}"
    return str(f["target"])


def _counts_lines(f: Finding) -> list[str]:
    counts_by_rank = f.get("counts")
    if not counts_by_rank:
        return []
    shown = list(counts_by_rank.items())
    text = ", ".join(f"rank {r}: {c}" for r, c in shown[:32])
    more = f", … ({len(shown) - 32} more)" if len(shown) > 32 else ""
    reference = "expected" if f.get("majority", True) else "no majority; the reference has"
    return [f"  counts: {text}{more} ({reference} {f.get('expected')})"]


def _member(f: Finding) -> str:
    """One line for a finding of a group: what, and its counts or its message."""
    counts_by_rank = f.get("counts")
    if counts_by_rank:
        shown = list(counts_by_rank.items())
        text = ", ".join(f"{r}: {c}" for r, c in shown[:8])
        more = " …" if len(shown) > 8 else ""
        reference = (
            "median"
            if f["kind"] == "count_skew"
            else "expected"
            if f.get("majority", True)
            else "no majority, the reference"
        )
        return f"{_what(f)}: {reference} {f.get('expected')}; rank {text}{more}"
    what, message = _what(f), str(f["message"])
    return message if message.startswith(what) else f"{what}: {message}"


def _stack_lines(
    stack: Any, label: str, group: int, shown: dict[tuple[str, ...], int]
) -> list[str]:
    """A stack, outermost first; one shown before is named by its group."""
    if not isinstance(stack, list) or not stack:
        return []
    key = tuple(map(str, stack))
    before = shown.get(key)
    if before is not None:
        return [f"  {label}: as in group {before}"]
    shown[key] = group
    return [f"  {label} (outermost first):", *(f"    {frame}" for frame in key)]


def _ranks(ranks: list[int]) -> str:
    """Ranks for a log line (up to 16, then how many)."""
    return list_ranks(ranks, 16)


def _sequence_lines(f: Finding) -> list[str]:
    """A sequence finding's expected/got and distribution, one line each."""

    def call(doc: Any) -> str:
        if not isinstance(doc, dict):
            return "none"
        shapes = doc.get("shapes")
        shape = "".join(str(s) for s in shapes) if isinstance(shapes, list) else ""
        text = f"{doc.get('op')} {doc.get('dtype')}{shape.replace(' ', '')}"
        if doc.get("reduce_op"):
            text += f" {doc['reduce_op']}"
        return f"{text} on group {doc.get('group')} (step {doc.get('step')})"

    lines = [
        f"  expected: {call(f.get('expected'))}"
        + (f" (ranks {_ranks(f.get('expected_ranks') or [])})" if f.get("expected_ranks") else ""),
        f"  got:      {call(f.get('got'))} (ranks {_ranks(f.get('ranks') or [])})",
    ]
    if not f.get("majority", True):
        spread = "; ".join(
            f"{d.get('value')}: ranks {_ranks(d.get('ranks') or [])}"
            for d in f.get("distribution") or []
            if isinstance(d, dict)
        )
        lines.append(f"  no majority: {spread}")
    return lines
