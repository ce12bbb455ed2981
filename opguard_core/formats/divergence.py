"""Divergence reports (``{name}_divergence.json`` and ``.log``): document, writer, reader.

The document is ``{"format": "opguard-divergence", "version": 2, "meta", "findings"}``;
every finding has ``kind``, ``severity`` (``error`` or ``warning``), ``ranks`` (the
ranks that deviate), ``target`` and ``message``, plus what its kind carries (see
docs/divergence.md). The log is the same findings for a person: errors first, each
with the stack it came from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from opguard_core.errors import InputError

DIVERGENCE_FORMAT = "opguard-divergence"
#: version 2: a collective finding's ``stream`` is its stream role (``comm``), not a raw
#: id; version 3: the collective-sequence kinds (``SEQUENCE_KINDS``) and
#: ``meta.sequence_ranks``; versions 1 and 2 are still read
DIVERGENCE_VERSION = 3
READ_VERSIONS = (1, 2, 3)
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
KINDS = ("collective_mismatch", *SEQUENCE_KINDS, "rank_specific", "count_skew")

Finding = dict[str, Any]


def sort_findings(findings: list[Finding]) -> list[Finding]:
    """By severity (errors first), then size (``ops`` deviating, largest first), then
    kind, target, op and ranks, so the order is the same for the same trace."""

    def key(f: Finding) -> tuple[Any, ...]:
        severity = f.get("severity")
        rank = SEVERITIES.index(severity) if severity in SEVERITIES else len(SEVERITIES)
        return (
            rank,
            -int(f.get("size", 0)),
            str(f.get("kind", "")),
            str(f.get("target", "")),
            str(f.get("op") or ""),
            list(f.get("ranks") or []),
        )

    return sorted(findings, key=key)


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
    counts = {"findings": len(findings), "errors": 0, "warnings": 0}
    for f in findings:
        counts["errors" if f["severity"] == "error" else "warnings"] += 1
        counts[f["kind"]] = counts.get(f["kind"], 0) + 1
    return counts


def encode_divergence(meta: dict[str, Any], findings: list[Finding]) -> bytes:
    """The JSON document: header, then one finding per line, in :func:`sort_findings` order."""
    encoder = msgspec.json.Encoder(order="deterministic")
    head = encoder.encode(
        {"format": DIVERGENCE_FORMAT, "version": DIVERGENCE_VERSION, "meta": meta}
    )[:-1]
    body = b",\n".join(encoder.encode(f) for f in sort_findings(findings))
    return head + b',\n"findings":[\n' + body + (b"\n" if body else b"") + b"]}\n"


def load_divergence(path: Path) -> dict[str, Any]:
    """Read a ``{name}_divergence.json``; one-line :class:`InputError` on any problem."""
    try:
        doc = msgspec.json.decode(path.read_bytes())
    except OSError as exc:
        raise InputError(path, f"cannot read file: {exc.strerror or exc}") from None
    except msgspec.DecodeError as exc:
        raise InputError(path, f"not valid JSON: {exc}") from None
    if (
        not isinstance(doc, dict)
        or doc.get("format") != DIVERGENCE_FORMAT
        or doc.get("version") not in READ_VERSIONS
    ):
        raise InputError(
            path,
            f"expected format {DIVERGENCE_FORMAT!r} version {' or '.join(map(str, READ_VERSIONS))}",
        )
    check_findings(doc.get("findings"), str(path))
    return doc


def render_log(meta: dict[str, Any], findings: list[Finding]) -> str:
    """The log for a person: a header line, then each finding with its stack."""
    counts = tally(findings)
    lines = [
        f"divergence: {meta.get('source', '?')}, {len(meta.get('ranks', []))} ranks, "
        f"{counts['errors']} error(s), {counts['warnings']} warning(s) "
        f"(count skew threshold {meta.get('skew')})",
    ]
    sequence_ranks = meta.get("sequence_ranks")
    if isinstance(sequence_ranks, list) and sequence_ranks:
        lines.append(
            f"collective sequences compared by position for rank(s) {_ranks(sequence_ranks)}"
        )
        without = [r for r in meta.get("ranks", []) if r not in sequence_ranks]
        if without:
            lines.append(
                f"note: rank(s) {_ranks(without)} recorded no collective sequence (an older "
                "trace): their collectives are not compared"
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
    for f in sort_findings(findings):
        lines.append("")
        what = f["target"]
        if f.get("op"):
            api = f" ({f['api']})" if f.get("api") else ""
            what = f"{f['op']}{api} in {f['target']}"
        lines.append(f"{f['severity'].upper()} {f['kind']}: {what}")
        lines.append(f"  {f['message']}")
        if f["kind"] in SEQUENCE_KINDS:
            lines.extend(_sequence_lines(f))
        counts_by_rank = f.get("counts")
        if counts_by_rank:
            shown = list(counts_by_rank.items())
            text = ", ".join(f"rank {r}: {c}" for r, c in shown[:32])
            more = f", … ({len(shown) - 32} more)" if len(shown) > 32 else ""
            lines.append(f"  counts: {text}{more} (expected {f.get('expected')})")
        stack = f.get("stack") or []
        if stack:
            lines.append("  stack (outermost first):")
            lines.extend(f"    {frame}" for frame in stack)
        expected_stack = f.get("expected_stack") or []
        if expected_stack and expected_stack != stack:
            lines.append("  expected from (outermost first):")
            lines.extend(f"    {frame}" for frame in expected_stack)
    return "\n".join(lines) + "\n"


def _ranks(ranks: list[int]) -> str:
    text = ", ".join(map(str, ranks[:16]))
    return text + (f" … ({len(ranks)} ranks)" if len(ranks) > 16 else "")


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
