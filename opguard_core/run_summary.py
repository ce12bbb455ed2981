"""What a run made, read from its ``pipeline_summary.json`` data: the final configs
(also how ``opguard show|compare|merge|filter RUN_DIR`` find them) and the short
human summary ``opguard run`` prints at the end.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from opguard_core.errors import InputError

SUMMARY_FILE = "pipeline_summary.json"
MERGED = "final_combined_instrumentation.yaml"
#: the page the built-in ``report`` plugin writes at the end of a run
REPORT_FILE = "report.html"


def final_configs(summary: dict[str, Any]) -> tuple[str | None, str | None]:
    """(final config, filtered final config) of a run, as names inside its directory:
    the last merge's ``final_combined_instrumentation.yaml`` or, for one entry, its
    config; and the filter stage's output. None where the run made none."""
    ok = [r for r in summary.get("stages", []) if r.get("status") == "ok"]
    filtered = next((r["outputs"][0] for r in ok if r["stage"] == "filter" and r["outputs"]), None)
    merged = [o for r in ok if r["stage"] == "merge" for o in r["outputs"] if o == MERGED]
    final = merged[-1] if merged else None
    if final is None and len(summary.get("entries", [])) == 1:
        final = next((r["outputs"][0] for r in ok if r["stage"] == "generate"), None)
    return final, filtered


def read_summary(run_dir: Path) -> dict[str, Any]:
    """The run directory's summary; :class:`InputError` when it is not a run directory."""
    import msgspec

    path = run_dir / SUMMARY_FILE
    try:
        data = msgspec.json.decode(path.read_bytes())
    except FileNotFoundError:
        raise InputError(run_dir, f"not a run directory (no {SUMMARY_FILE})") from None
    except (OSError, msgspec.DecodeError) as exc:
        raise InputError(path, f"unreadable run summary: {exc}") from None
    if not isinstance(data, dict):
        raise InputError(path, "unreadable run summary: not a JSON object")
    return data


def run_config(run_dir: Path, filtered: bool = True) -> Path:
    """The config a run directory stands for: its filtered final config when there is
    one and ``filtered``, else its final config."""
    final, filtered_name = final_configs(read_summary(run_dir))
    name = (filtered_name if filtered else None) or final
    if name is None:
        raise InputError(run_dir, "the run made no final config (name an entry's config)")
    return run_dir / name


def divergence_counts(summary: dict[str, Any]) -> dict[str, Any] | None:
    """The divergence stage's findings over the run (``findings``, ``errors``,
    ``warnings`` and the ``entries`` with findings), or None when no entry ran it."""
    records = [
        r for r in summary.get("stages", []) if r.get("stage") == "divergence"
        and r.get("status") == "ok"
    ]  # fmt: skip
    if not records:
        return None
    totals: dict[str, Any] = {"findings": 0, "errors": 0, "warnings": 0, "entries": []}
    for record in records:
        counts = record.get("counts") or {}
        for key in ("findings", "errors", "warnings"):
            totals[key] += int(counts.get(key, 0))
        if counts.get("findings"):
            totals["entries"].append(record.get("entry"))
    return totals


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """The end-of-run summary for a person: entries, final config, failures,
    warnings, divergence findings (when the summary has them) and, last, the
    run's ``report.html`` when one was written."""
    stages = summary.get("stages", [])
    names = [e["name"] for e in summary.get("entries", [])]
    failed = [r for r in stages if r.get("status") == "failed"]
    bad = {r["entry"] for r in failed}
    ok = [n for n in names if n not in bad]
    broken = [n for n in names if n in bad]
    warnings = summary.get("warnings") or []
    head = f"summary: {summary.get('status', '?')}, {len(names)} entries ({len(ok)} ok"
    head += f", {len(broken)} failed: {', '.join(broken)})" if broken else ")"
    head += f", {len(failed)} failures, {len(warnings)} warnings"
    lines = [head]
    final, filtered = final_configs(summary)
    run_dir = Path(str(summary.get("run_dir", ".")))
    for label, name in (("final config", final), ("filtered config", filtered)):
        if name is not None:
            lines.append(f"  {label}: {run_dir / name}")
    if final is None:
        lines.append("  final config: none")
    for warning in warnings:
        fields = ", ".join(
            f"{k}={v}" for k, v in warning.items() if k != "message" and v is not None
        )
        lines.append(f"  warning: {warning.get('message')}" + (f" ({fields})" if fields else ""))
    found = divergence_counts(summary)
    if found is not None:
        where = f" in {', '.join(found['entries'])}" if found["entries"] else ""
        lines.append(
            f"  divergence: {found['findings']} findings ({found['errors']} errors, "
            f"{found['warnings']} warnings){where}"
        )
    report = run_dir / REPORT_FILE
    if report.is_file():
        lines.append(f"  report: {report}")
    return lines


def summary_fields(summary: dict[str, Any]) -> dict[str, Any]:
    """The same summary as log fields (JSON mode)."""
    final, filtered = final_configs(summary)
    run_dir = Path(str(summary.get("run_dir", ".")))
    failed = [r for r in summary.get("stages", []) if r.get("status") == "failed"]
    names = [e["name"] for e in summary.get("entries", [])]
    fields: dict[str, Any] = {
        "status": summary.get("status"),
        "entries": len(names),
        "failed_entries": sorted({r["entry"] for r in failed} & set(names)),
        "final_config": str(run_dir / final) if final else None,
        "filtered_config": str(run_dir / filtered) if filtered else None,
        "failures": len(failed),
        "warnings": len(summary.get("warnings") or []),
        "report": str(run_dir / REPORT_FILE) if (run_dir / REPORT_FILE).is_file() else None,
    }
    found = divergence_counts(summary)
    if found is not None:
        fields["divergence_findings"] = found["findings"]
        fields["divergence_errors"] = found["errors"]
    return fields


__all__ = [
    "REPORT_FILE",
    "divergence_counts",
    "final_configs",
    "read_summary",
    "run_config",
    "summary_fields",
    "summary_lines",
]
