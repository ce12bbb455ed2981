"""Check and guard reports: the :class:`Violation` record, its writer, reader and validation.

``opguard check`` writes ``{"format": "opguard-check-report", "version": 2, "config",
"violations"}``; ``opguard guard`` writes ``guard_report_rank{R}.json`` with the same
violation objects plus ``rank``, ``stack`` and ``count`` (formats.md §5).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Container, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from opguard_core.errors import InputError
from opguard_core.files.atomic import atomic_write_text

CHECK_FORMAT = "opguard-check-report"
GUARD_FORMAT = "opguard-guard-report"
#: version 2: a violation's ``stream`` is a stream role (``side1``), not a raw id;
#: version 1 reports are still read
REPORT_VERSION = 2
READ_REPORT_VERSIONS = (1, 2)
#: the guard report's version 3 (issue 29): the guard finds targets on the stack, so
#: ``wrapped``/``unwrapped`` gave way to ``targets_seen``, and the report holds the
#: whole-run kinds ``missing`` and ``count_drift``; versions 1 and 2 are still read
GUARD_REPORT_VERSION = 3
READ_GUARD_VERSIONS = (1, 2, 3)

ERROR = "error"
WARNING = "warning"
SEVERITIES = (ERROR, WARNING)

#: Every violation kind the built-in rules report, with its default severity.
KINDS: dict[str, str] = {
    "unexpected_op": ERROR,
    "unexpected_stream": ERROR,
    "unexpected_dtype": ERROR,
    "unknown_context": WARNING,
    "unknown_target": WARNING,
    "missing": WARNING,
    "missing_op": ERROR,
    "count_drift": WARNING,
    "rank_mismatch": WARNING,
}

#: The kinds compared when a config and what is held to it come from different
#: tracers (``meta.recorded_by``: a ``profiler`` config, a ``modes`` trace or the guard,
#: which sees ops as the ``modes`` tracer does): which functions ran, where, on which
#: ranks. Ops, streams, dtypes and counts differ between backends and readers by design
#: (docs/tracing.md, "Backends").
ACROSS_TRACERS = frozenset({"unknown_target", "unknown_context", "missing", "rank_mismatch"})
#: what the guard's view is recorded by: the ``modes`` tracer's
GUARD_VIEW = "modes"


@dataclasses.dataclass
class Violation:
    """One way an observed run departs from a config.

    :ivar kind: ``unexpected_op``, ``unexpected_stream``, ``unexpected_dtype``,
        ``unknown_context``,
        ``unknown_target``, ``missing``, ``missing_op``, ``count_drift``,
        ``rank_mismatch`` (or a plugin's own kind).
    :ivar severity: ``error`` or ``warning``.
    :ivar target: the entry's target (``module:qualname``).
    :ivar context: the entry's context, outermost first.
    :ivar ranks: the ranks it was seen on, sorted.
    :ivar message: one line for a person.
    :ivar op: the operator, for op kinds (and op-level drift).
    :ivar stream: the stream role, for ``unexpected_stream``.
    :ivar dtype: the dtype, for ``unexpected_dtype`` (formats.md, "Dtypes").
    """

    kind: str
    severity: str
    target: str
    context: list[str]
    ranks: list[int]
    message: str
    op: str | None = None
    stream: str | None = None
    dtype: str | None = None

    def identity(self) -> tuple[Any, ...]:
        """What makes two violations the same one (their ranks are then joined)."""
        return (
            self.kind,
            self.severity,
            self.target,
            tuple(self.context),
            self.op,
            self.stream,
            self.dtype,
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "kind": self.kind,
            "severity": self.severity,
            "target": self.target,
            "context": list(self.context),
            "ranks": list(self.ranks),
            "message": self.message,
        }
        if self.op is not None:
            out["op"] = self.op
        if self.stream is not None:
            out["stream"] = self.stream
        if self.dtype is not None:
            out["dtype"] = self.dtype
        return out


EntryKey = tuple[str, tuple[str, ...]]


@dataclasses.dataclass
class CheckInput:
    """What a check rule (``opguard_check_entry``) is told besides the two entries.

    :ivar rank: the rank whose observed entry is being checked.
    :ivar key: the entry's (target, context).
    :ivar config: the config being enforced (a mapping, as loaded).
    :ivar expected: every config entry by key.
    :ivar observed: per observed rank, every observed entry by key.
    :ivar ranks: the config's ``meta.ranks``.
    :ivar tolerance: ``--tolerance``: the relative count change ``count_drift`` allows.
    :ivar expected_steps: the config's ``meta.steps`` (None when not recorded).
    :ivar observed_steps: per observed rank, its trace's ``meta.steps`` (None when not recorded).
    :ivar loop: the config's counts and the observed ones are both of a training loop
        (``meta.phases``: tracing.md, "Set-up and loop"), so what the config ran in
        every step must run in every step (``missing`` and ``missing_op`` as errors).
    :ivar ran: per observed rank, the keys that ran there at all, an entry of their
        own or too little to be one (pruned), as a container
        (:class:`~opguard_core.formats.tree.RanUnder`); a rank not in it: unknown.
    """

    rank: int
    key: EntryKey
    config: dict[str, Any]
    expected: dict[EntryKey, dict[str, Any]]
    observed: dict[int, dict[EntryKey, dict[str, Any]]]
    ranks: list[int]
    tolerance: float
    expected_steps: int | None = None
    observed_steps: dict[int, int | None] = dataclasses.field(default_factory=dict)
    loop: bool = False
    ran: Mapping[int, Container[EntryKey]] = dataclasses.field(default_factory=dict)

    def entry_ranks(self, entry: dict[str, Any]) -> list[int]:
        """A config entry's ranks: its own ``ranks``, else the config's."""
        return list(entry.get("ranks") or self.ranks)

    def seen_on(self) -> list[int]:
        """The observed ranks where this key ran."""
        return sorted(r for r, entries in self.observed.items() if self.key in entries)

    def key_ran(self) -> bool:
        """Whether this key ran on this rank at all, an entry of its own or too little
        to be one (pruned); False where that is not known."""
        return self.key in self.ran.get(self.rank, ())


def join_ranks(violations: Iterable[Violation]) -> list[Violation]:
    """One violation per identity, its ranks the sorted union; sorted for output."""
    joined: dict[tuple[Any, ...], Violation] = {}
    for item in violations:
        key = item.identity()
        seen = joined.get(key)
        if seen is None:
            joined[key] = dataclasses.replace(item, ranks=sorted(set(item.ranks)))
        else:
            seen.ranks = sorted(set(seen.ranks) | set(item.ranks))
    return sorted(joined.values(), key=sort_key)


def sort_key(item: Violation) -> tuple[Any, ...]:
    """Errors first, then by kind, target, context, op, stream, dtype."""
    return (
        item.severity != ERROR,
        item.kind,
        item.target,
        item.context,
        item.op or "",
        "" if item.stream is None else item.stream,
        item.dtype or "",
    )


def check_report(
    config: str, violations: Sequence[Violation], notes: Sequence[str] = ()
) -> dict[str, Any]:
    """The ``opguard-check-report`` document; ``notes``: what was not compared and why
    (the text report's first line), where anything was not."""
    return {
        "format": CHECK_FORMAT,
        "version": REPORT_VERSION,
        "config": config,
        **({"notes": list(notes)} if notes else {}),
        "errors": sum(v.severity == ERROR for v in violations),
        "warnings": sum(v.severity == WARNING for v in violations),
        "violations": [v.to_dict() for v in violations],
    }


def guard_report(
    config: str,
    rank: int,
    violations: list[dict[str, Any]],
    on_violation: str,
    sample: float,
    steps: int,
    checked_steps: int,
    targets_seen: int,
    partial: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``opguard-guard-report`` document of one rank (``violations`` already carry
    ``rank``, ``count`` and ``stack``); ``partial``, where the program ended early
    (``meta.partial``'s shape), is written last and only then."""
    document = {
        "format": GUARD_FORMAT,
        "version": GUARD_REPORT_VERSION,
        "config": config,
        "rank": rank,
        "on_violation": on_violation,
        "sample": sample,
        "steps": steps,
        "checked_steps": checked_steps,
        "errors": sum(v["severity"] == ERROR for v in violations),
        "warnings": sum(v["severity"] == WARNING for v in violations),
        "violations": violations,
        "targets_seen": targets_seen,
    }
    if partial is not None:
        document["partial"] = partial
    return document


def sample_every(sample: float) -> int:
    """The guard's ``--sample P`` as "check every N-th optimizer step":
    ``N = round(1/P)`` (≥ 1); ``ValueError`` naming the problem unless P is a finite
    number in (0, 1] whose ``1/P`` is finite (``nan``, ``1e-320`` are refused)."""
    try:
        value = float(sample)
    except (TypeError, ValueError):
        raise ValueError(f"{sample!r} is not a number") from None
    if not (math.isfinite(value) and 0.0 < value <= 1.0):
        raise ValueError(f"{sample!r} is not a finite number in (0, 1]")
    interval = 1.0 / value
    if not math.isfinite(interval):
        raise ValueError(f"{sample!r} is too small: 1/P overflows")
    return max(1, round(interval))


def write_json(path: Path, document: dict[str, Any]) -> None:
    """Write a report atomically (sorted keys are not used: field order is the contract's)."""
    atomic_write_text(path, json.dumps(document, indent=2) + "\n")


_FIELDS = {
    "kind": str,
    "severity": str,
    "target": str,
    "context": list,
    "ranks": list,
    "message": str,
}


def validate_violation(data: object, where: str) -> None:
    """Refuse a violation object of the wrong shape with one line naming ``where``."""
    if not isinstance(data, dict):
        raise InputError(where, "a violation is not an object")
    for name, kind in _FIELDS.items():
        if not isinstance(data.get(name), kind):
            raise InputError(where, f"violation field {name!r} is not a {kind.__name__}")
    if data["severity"] not in SEVERITIES:
        raise InputError(where, f"severity {data['severity']!r} is not error or warning")


def load_report(path: Path) -> dict[str, Any]:
    """Read a check or guard report back, validating every violation."""
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(path, f"cannot read report: {exc}") from None
    if not isinstance(document, dict) or document.get("format") not in (
        CHECK_FORMAT,
        GUARD_FORMAT,
    ):
        raise InputError(path, "not an opguard check or guard report")
    versions = READ_GUARD_VERSIONS if document["format"] == GUARD_FORMAT else READ_REPORT_VERSIONS
    if document.get("version") not in versions:
        raise InputError(path, f"unsupported report version {document.get('version')!r}")
    violations = document.get("violations")
    if not isinstance(violations, list):
        raise InputError(path, "'violations' is not a list")
    for index, item in enumerate(violations):
        validate_violation(item, f"{path} violations[{index}]")
    if document["format"] == GUARD_FORMAT:
        _validate_guard(document, path)
    return document


def _validate_guard(document: dict[str, Any], path: Path) -> None:
    """The guard report's own fields: ``rank``, each violation's ``rank``, ``count``
    and ``stack``, and ``unwrapped`` (versions 1 and 2) or ``targets_seen`` (3)."""
    if not isinstance(document.get("rank"), int):
        raise InputError(path, "'rank' is not an integer")
    for index, item in enumerate(document["violations"]):
        where = f"violations[{index}]"
        if not isinstance(item.get("count"), int) or item["count"] < 1:
            raise InputError(path, f"{where}: 'count' is not an integer >= 1")
        if not isinstance(item.get("rank"), int) or not isinstance(item.get("stack"), list):
            raise InputError(path, f"{where}: 'rank' or 'stack' is missing")
    if document.get("version") == GUARD_REPORT_VERSION:
        seen = document.get("targets_seen")
        if not isinstance(seen, int) or isinstance(seen, bool) or seen < 0:
            raise InputError(path, "'targets_seen' is not an integer >= 0")
        return
    unwrapped = document.get("unwrapped")
    if not isinstance(unwrapped, list) or not all(
        isinstance(u, dict)
        and isinstance(u.get("target"), str)
        and isinstance(u.get("reason"), str)
        for u in unwrapped
    ):
        raise InputError(path, "'unwrapped' is not a list of {target, reason} objects")


__all__ = [
    "ACROSS_TRACERS",
    "CHECK_FORMAT",
    "ERROR",
    "GUARD_FORMAT",
    "GUARD_REPORT_VERSION",
    "GUARD_VIEW",
    "KINDS",
    "REPORT_VERSION",
    "WARNING",
    "CheckInput",
    "Violation",
    "check_report",
    "guard_report",
    "join_ranks",
    "load_report",
    "sample_every",
    "write_json",
]
