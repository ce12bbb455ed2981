"""What a run made, read from its ``pipeline_summary.json`` data: the final configs
(also how ``opguard show|compare|merge|filter RUN_DIR`` find them) and the short
human summary ``opguard run`` prints at the end.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opguard_core import __version__
from opguard_core.errors import InputError, plural
from opguard_core.files.lookup import is_directory, is_special_file

if TYPE_CHECKING:
    from opguard_core.model import InputEntry, RunOptions, StageRecord
    from opguard_core.plugin.manager import OpGuardPluginManager

SUMMARY_FILE = "pipeline_summary.json"
#: the page the built-in ``report`` plugin writes at the end of a run
REPORT_FILE = "report.html"


def final_configs(summary: dict[str, Any]) -> tuple[str | None, str | None]:
    """(final config, filtered final config) of a run, as names inside its directory:
    the last merge's ``final_combined_instrumentation.yaml`` or, where one config was
    made (one entry, or the other entries failed), that config; and the filter stage's
    output. None where the run made none."""
    from opguard_core.run.steps import STEP  # its imports cost start-up time

    merged_name = STEP["merge"].artifacts["final"]
    ok = [r for r in summary.get("stages", []) if r.get("status") == "ok"]
    outputs = [(r.get("stage"), r.get("outputs") or []) for r in ok]
    filtered = next((o[0] for stage, o in outputs if stage == "filter" and o), None)
    merged = [n for stage, o in outputs if stage == "merge" for n in o if n == merged_name]
    final = merged[-1] if merged else None
    generated = [o[0] for stage, o in outputs if stage == "generate" and o]
    # one entry, or the others failed; not a run stopped before its other entries ran
    if final is None and len(generated) == 1 and (finished(summary) or _entries(summary) <= 1):
        final = generated[0]
    return final, filtered


#: a summary's ``status`` while, or because, the run did not get to its end
UNFINISHED = ("running", "interrupted", "abandoned")


def finished(summary: dict[str, Any]) -> bool:
    """Whether the run got to its end (``ok`` or ``failed``): a run still going, or
    interrupted or killed, may have skipped entries and made no final config."""
    return summary.get("status") not in UNFINISHED


def _entries(summary: dict[str, Any]) -> int:
    entries = summary.get("entries")
    return len(entries) if isinstance(entries, list) else 0


#: what to say of a run directory given where traces go (``run -i``, found by discover)
RUN_DIR_INSTEAD = (
    "a run directory, not a callsite trace; use opguard show, compare, merge, filter, "
    "export or report on it, or give the traces it was made from"
)


def ok_records(summary: dict[str, Any], stage: str) -> list[dict[str, Any]]:
    """The records of ``stage`` that ended ok, in order."""
    return [
        r for r in summary.get("stages", []) if r.get("stage") == stage and r.get("status") == "ok"
    ]


def stage_outputs(summary: dict[str, Any], stage: str, entry: str | None = None) -> list[str]:
    """The files the ok records of ``stage`` (for ``entry``, when given) wrote, as
    names inside the run directory, in order: how a reader finds a run's artifacts
    without knowing what any stage calls them."""
    return [
        str(output)
        for r in ok_records(summary, stage)
        if entry is None or r.get("entry") == entry
        for output in r.get("outputs") or []
    ]


def outputs_by_entry(summary: dict[str, Any], stage: str) -> dict[str | None, list[str]]:
    """:func:`stage_outputs` of ``stage`` for every entry at once (entry name, None for
    the run's own record, to its files): one pass however many entries a run has."""
    found: dict[str | None, list[str]] = {}
    for r in ok_records(summary, stage):
        entry = r.get("entry")
        if isinstance(entry, str | None):
            files = found.setdefault(entry, [])
            files += [str(output) for output in r.get("outputs") or []]
    return found


def read_summary(run_dir: Path) -> dict[str, Any]:
    """The run directory's summary; :class:`InputError` when it is not a run directory."""
    import msgspec

    path = run_dir / SUMMARY_FILE
    try:
        if is_special_file(path):  # a FIFO would block for ever
            raise InputError(path, "unreadable run summary: not a regular file")
        data = msgspec.json.decode(path.read_bytes())
    except FileNotFoundError:
        if not run_dir.exists():
            raise InputError(run_dir, "no such run directory") from None
        raise InputError(run_dir, f"not a run directory (no {SUMMARY_FILE})") from None
    except (OSError, msgspec.DecodeError) as exc:
        raise InputError(path, f"unreadable run summary: {exc}") from None
    except RecursionError:  # a summary nests a few levels; msgspec recurses in C
        raise InputError(path, "unreadable run summary: nested too deep") from None
    if not isinstance(data, dict):
        raise InputError(path, "unreadable run summary: not a JSON object")
    check_summary(data, path)
    return data


def _safe_name(name: object) -> bool:
    """A plain file name: one path component, never ``.``, ``..`` or absolute."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and not any(c in name for c in "/\\\0")
    )


def check_summary(data: dict[str, Any], path: Path | str) -> None:
    """Check the parts of a summary that readers use (formats.md §4): ``stages`` a
    list of records whose ``outputs`` are plain file names (the artifacts of a run
    are inside its directory, so a name with a path separator or ``..`` is refused),
    ``entries`` a list of records with a ``name``, ``warnings`` a list of mappings.
    :class:`InputError` names the first problem."""
    stages = data.get("stages", [])
    if not isinstance(stages, list):
        raise InputError(path, "unreadable run summary: 'stages' must be a list")
    for index, record in enumerate(stages):
        where = f"stages[{index}]"
        if not isinstance(record, dict):
            raise InputError(path, f"unreadable run summary: {where} must be an object")
        for field in ("stage", "status", "entry"):
            if record.get(field) is not None and not isinstance(record[field], str):
                raise InputError(path, f"unreadable run summary: {where}.{field} must be a string")
        outputs = record.get("outputs")
        if outputs is None:
            continue
        if not isinstance(outputs, list):
            raise InputError(path, f"unreadable run summary: {where}.outputs must be a list")
        for output in outputs:
            if not _safe_name(output):
                raise InputError(
                    path,
                    f"{where}.outputs names {output!r}, not a file inside the run directory",
                )
    entries = data.get("entries", [])
    if not isinstance(entries, list) or not all(
        isinstance(e, dict) and isinstance(e.get("name"), str) for e in entries
    ):
        raise InputError(path, "unreadable run summary: 'entries' must be a list of named entries")
    warnings = data.get("warnings")
    if warnings is not None and (
        not isinstance(warnings, list) or not all(isinstance(w, dict) for w in warnings)
    ):
        raise InputError(path, "unreadable run summary: 'warnings' must be a list of objects")


def run_artifact(run_dir: Path, name: str) -> Path:
    """``run_dir / name`` for a name a summary gave, confined to the run directory:
    a name that is not a plain file name, or a link that leads out of the directory,
    is an :class:`InputError` (a run directory is input, not trusted)."""
    summary = run_dir / SUMMARY_FILE
    if not _safe_name(name):
        raise InputError(summary, f"names {name!r}, not a file inside the run directory")
    path = run_dir / name
    if path.resolve().parent != run_dir.resolve():
        raise InputError(summary, f"{name!r} leads outside the run directory")
    return path


def run_config(run_dir: Path, filtered: bool = True) -> Path:
    """The config a run directory stands for: its filtered final config when there is
    one and ``filtered``, else its final config (confined: :func:`run_artifact`)."""
    summary = read_summary(run_dir)
    final, filtered_name = final_configs(summary)
    name = (filtered_name if filtered else None) or final
    if name is None:
        why = "" if finished(summary) else f" (its status is {summary.get('status')!r})"
        raise InputError(run_dir, f"the run made no final config{why}: name an entry's config")
    return run_artifact(run_dir, name)


def config_source(path: Path, filtered: bool = True) -> Path:
    """The config file ``path`` names: itself, or a run directory's final config
    (:func:`run_config`)."""
    return run_config(path, filtered) if is_directory(path) else path


def run_tree(run_dir: Path) -> Path:
    """The compressed tree a run directory stands for (``opguard export RUN``): its
    entry's, when it has one entry; a run of several names their trees."""
    trees = stage_outputs(read_summary(run_dir), "compress")
    if len(trees) == 1:
        return run_artifact(run_dir, trees[0])
    if not trees:
        raise InputError(run_dir, "the run made no compressed tree")
    raise InputError(
        run_dir, f"the run has {len(trees)} entries: name one of its trees ({', '.join(trees)})"
    )


def divergence_counts(summary: dict[str, Any]) -> dict[str, Any] | None:
    """The divergence stage's findings over the run (``findings``, ``errors``,
    ``warnings`` and the ``entries`` with findings), or None when no entry ran it."""
    records = ok_records(summary, "divergence")
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


class SummaryPace:
    """When the run rewrites its summary. A write is followed by none (but the final
    one) for :attr:`PACE` times its own duration, so the writes take at most
    1/PACE of the run however many stage records the summary holds (a write after
    every stage of n entries, each as long as the summary, would be quadratic); a
    short run still writes after every stage."""

    PACE = 20

    def __init__(self) -> None:
        self.due = 0.0
        self.began = 0.0

    def ready(self, final: bool) -> bool:
        """Whether to write now (and if so, the write's timing starts)."""
        now = time.perf_counter()
        if not final and now < self.due:
            return False
        self.began = now
        return True

    def wrote(self) -> None:
        """The write that :meth:`ready` allowed succeeded."""
        self.due = self.began + self.PACE * (time.perf_counter() - self.began)


def build_summary(
    *,
    run_dir: Path | None,
    started: _dt.datetime,
    final: bool,
    exit_code: int | None,
    interrupted: dict[str, Any] | None,
    inputs: Sequence[str],
    options: RunOptions,
    entries: Sequence[InputEntry],
    skipped: Sequence[str],
    manager: OpGuardPluginManager,
    records: Sequence[StageRecord],
    warnings: Sequence[dict[str, Any]],
) -> dict[str, Any]:
    """The ``pipeline_summary.json`` document of a run (formats.md §4); ``status``
    ``interrupted``, else ``running`` until ``final``, then ``failed`` or ``ok`` by
    ``exit_code``."""
    finished = _dt.datetime.now(_dt.UTC)
    status = (
        "interrupted"
        if interrupted
        else "running"
        if not final
        else "failed"
        if exit_code
        else "ok"
    )
    return {
        "opguard_version": __version__,
        "run_dir": str(run_dir),
        "started_at": started.isoformat(),
        "finished_at": finished.isoformat() if final else None,
        "seconds": round((finished - started).total_seconds(), 6),
        "status": status,
        "exit_code": exit_code,
        "interrupted": interrupted,
        "inputs": list(inputs),
        "base_dir": str(options.base_dir.resolve()),
        "entries": [
            {
                "name": e.name,
                "index": e.index,
                "files": [str(f) for f in e.files],
                "specs": list(e.specs),
            }
            for e in entries
        ],
        "options": _jsonable(dataclasses.asdict(options)),
        "skipped_stages": list(skipped),
        "disabled_plugins": list(manager.disabled),
        "plugins": [
            {"name": p.name, "distribution": p.distribution, "version": p.version, "hooks": p.hooks}
            for p in manager.describe()
        ],
        "stages": [record_fields(r) for r in records],
        "warnings": list(warnings),
    }


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _field_names(kind: type) -> tuple[str, ...]:
    names = _FIELD_NAMES.get(kind)
    if names is None:
        names = _FIELD_NAMES[kind] = tuple(f.name for f in dataclasses.fields(kind))
    return names


def record_fields(record: StageRecord) -> dict[str, Any]:
    """A stage record as the summary lists it: its fields by name, values shared,
    not copied (``dataclasses.asdict`` deep-copies every record's counts on every
    summary write: quadratic in a run of many entries)."""
    return {name: getattr(record, name) for name in _field_names(type(record))}


def _jsonable(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def encode_summary(document: dict[str, Any]) -> bytes:
    """``document`` as ``pipeline_summary.json``'s text. A file name that is not UTF-8
    (Python holds its odd bytes as lone surrogates, which JSON cannot carry) is written
    with them as ``\\xNN`` escapes: ``caf\\xe9_rank0.json``. A value JSON has no type
    for (a plugin's warning with a ``Path`` field) is written as its ``str()``."""
    import msgspec  # not at start-up: ``opguard show`` reads summaries without it

    try:
        encoded = msgspec.json.encode(document, enc_hook=str)
    except UnicodeEncodeError:
        encoded = msgspec.json.encode(without_surrogates(document), enc_hook=str)
    return msgspec.json.format(encoded, indent=2) + b"\n"


def without_surrogates(value: Any) -> Any:
    """``value`` (strings, dicts, lists) with a file name's undecodable bytes as
    ``\\xNN`` and any other lone surrogate as ``\\udNNN``: text JSON can carry."""
    if isinstance(value, str):
        try:  # a file name's undecodable bytes (os.fsdecode) back as \xNN
            return value.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        except UnicodeEncodeError:  # any other lone surrogate as \udNNN
            return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, dict):
        return {without_surrogates(k): without_surrogates(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [without_surrogates(v) for v in value]
    return value


def _entry_states(
    names: list[str], stages: list[dict[str, Any]], interrupted: bool
) -> dict[str, str]:
    """Per entry: ``failed`` (a stage failed), ``interrupted`` (the run was stopped in
    one of its stages), ``not run`` (an interrupted run never reached it), else ``ok``."""
    status: dict[str, set[str]] = {name: set() for name in names}
    for record in stages:
        entry = record.get("entry")
        if isinstance(entry, str) and entry in status:  # not a run-wide stage's (None)
            status[entry].add(str(record.get("status")))
    return {
        name: "failed" if "failed" in seen
        else "interrupted" if "interrupted" in seen
        else "not run" if interrupted and not seen
        else "ok"
        for name, seen in status.items()
    }  # fmt: skip


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """The end-of-run summary for a person: entries, final config, failures,
    warnings, divergence findings (when the summary has them) and, last, the
    run's ``report.html`` when one was written."""
    stages = summary.get("stages", [])
    names = [e["name"] for e in summary.get("entries", [])]
    failed = [r for r in stages if r.get("status") == "failed"]
    state = _entry_states(names, stages, bool(summary.get("interrupted")))
    ok = [n for n in names if state[n] == "ok"]
    warnings = summary.get("warnings") or []
    head = f"summary: {summary.get('status', '?')}, {plural(len(names), 'entry')} ({len(ok)} ok"
    for kind in ("failed", "interrupted", "not run"):
        these = [n for n in names if state[n] == kind]
        head += f", {len(these)} {kind}: {', '.join(these)}" if these else ""
    head += f"), {plural(len(failed), 'failure')}, {plural(len(warnings), 'warning')}"
    lines = [head]
    final, filtered = final_configs(summary)
    run_dir = Path(str(summary.get("run_dir", ".")))
    for label, name in (("final config", final), ("filtered config", filtered)):
        if name is not None:
            lines.append(f"  {label}: {run_dir / name}")
    if final is None:
        lines.append("  final config: none")
    alike: dict[str, int] = {}  # kind -> how many of it after the first
    for warning in warnings:
        kind = warning.get("alike")
        if kind is not None and kind in alike:
            alike[kind] += 1
            continue
        if kind is not None:
            alike[kind] = 0
        fields = ", ".join(
            f"{k}={v}"
            for k, v in warning.items()
            if k not in ("message", "alike") and v is not None
        )
        lines.append(f"  warning: {warning.get('message')}" + (f" ({fields})" if fields else ""))
    for kind, more in alike.items():
        if more:
            lines.append(f"  warning: … and {more} more like it ({kind}; all in {SUMMARY_FILE})")
    found = divergence_counts(summary)
    if found is not None:
        where = f" in {', '.join(found['entries'])}" if found["entries"] else ""
        lines.append(
            f"  divergence: {plural(found['findings'], 'finding')} "
            f"({plural(found['errors'], 'error')}, {plural(found['warnings'], 'warning')}){where}"
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
    "RUN_DIR_INSTEAD",
    "SUMMARY_FILE",
    "SummaryPace",
    "build_summary",
    "check_summary",
    "config_source",
    "divergence_counts",
    "final_configs",
    "ok_records",
    "outputs_by_entry",
    "read_summary",
    "run_artifact",
    "run_config",
    "stage_outputs",
    "summary_fields",
    "summary_lines",
    "without_surrogates",
]
