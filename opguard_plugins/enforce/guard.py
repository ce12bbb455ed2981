"""Built-in plugin: ``opguard guard``, which enforces a config while a program runs.

``opguard guard --config CONFIG [--report-dir DIR] [--on-violation warn|raise]
[--sample P] -- COMMAND...`` runs COMMAND (a script, ``python -m pkg``, ``torchrun
...``) the way ``opguard trace`` does (the same bootstrap, :mod:`opguard_plugins.record.trace`),
with :mod:`opguard_plugins.enforce.runtime` started in every Python process that imports
torch. Each process writes ``DIR/guard_report_rank{R}.json`` at exit (formats.md §5)
and tells this command whether its guard started, wrote its report and checked ops
(:mod:`opguard_plugins.enforce.status`): the command never exits 0 for a program it
did not check (``ExitCode.GUARD_FAILED``). See docs/guard.md.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import tempfile
import time
from pathlib import Path
from typing import Any

import click

from opguard_core import hookimpl
from opguard_core.cli import exits
from opguard_core.cli.options import FiniteFloatRange, config_option
from opguard_core.errors import ExitCode, OpGuardError, one_line
from opguard_core.files.output_dirs import prepare_output_dir
from opguard_core.formats.check import (
    ERROR,
    WARNING,
    Violation,
    load_report,
    sample_every,
    write_json,
)
from opguard_core.formats.config import load_config
from opguard_core.formats.sources import recorded_sources, share_of
from opguard_core.formats.trace import describe_partial, list_ranks
from opguard_core.formats.tree import pruning_floor, pruning_settings
from opguard_core.logs import get_logger
from opguard_core.run.summary import config_source
from opguard_plugins.enforce.rules import (
    DEFAULT_TOLERANCE,
    JUDGED_BY_JOB,
    PRUNED_KINDS,
    UNKNOWN_KINDS,
    WHOLE_RUN_KINDS,
    JobView,
)
from opguard_plugins.enforce.sequence_guard import config_sequences, load_collectives
from opguard_plugins.enforce.status import STATUS_ENV, read_job_counts, read_statuses
from opguard_plugins.enforce.status import problems as guard_problems
from opguard_plugins.record.trace import LAUNCH_CODES, bootstrap_env, run_bootstrapped


def guard_env(
    config: Path,
    report_dir: Path,
    on_violation: str,
    sample: float,
    command: tuple[str, ...],
    status_dir: Path | None = None,
    collectives: Path | None = None,
    collective_timeout: float | None = None,
    source: str | None = None,
) -> dict[str, str]:
    """The environment that starts the guard in COMMAND's Python processes (with
    ``status_dir``: where each process says whether its guard did its work,
    :mod:`opguard_plugins.enforce.status`)."""
    variables = {
        "OPGUARD_GUARD_CONFIG": str(config.resolve()),
        "OPGUARD_GUARD_DIR": str(report_dir.resolve()),
        "OPGUARD_GUARD_ON_VIOLATION": on_violation,
        "OPGUARD_GUARD_SAMPLE": repr(sample),
    }
    if status_dir is not None:
        variables[STATUS_ENV] = str(status_dir)
    if collectives is not None:
        variables["OPGUARD_GUARD_COLLECTIVES"] = str(collectives.resolve())
    if source is not None:
        variables["OPGUARD_GUARD_SOURCE"] = source
    if collective_timeout is not None:
        variables["OPGUARD_GUARD_COLLECTIVE_TIMEOUT"] = repr(collective_timeout)
    return bootstrap_env(variables, command)


#: the status directories' names: the prefix, the pid of the ``opguard guard`` that
#: made it, a dash and tempfile's random letters
STATUS_PREFIX = "opguard-guard-"
_STATUS_NAME = re.compile(re.escape(STATUS_PREFIX) + r"([0-9]+)-[^/]+")


def _status_dir(report_dir: Path) -> tempfile.TemporaryDirectory[str]:
    """A private directory for the guarded processes' status files: in the system's
    temporary directory, else (none usable) in the report directory. Those that
    ``opguard guard`` processes killed by SIGKILL left there are removed first."""
    prefix = f"{STATUS_PREFIX}{os.getpid()}-"
    try:
        sweep_status_dirs(Path(tempfile.gettempdir()))
        return tempfile.TemporaryDirectory(prefix=prefix, ignore_cleanup_errors=True)
    except OSError:
        sweep_status_dirs(report_dir, hidden=True)
        return tempfile.TemporaryDirectory(
            prefix=f".{prefix}", dir=report_dir, ignore_cleanup_errors=True
        )


def sweep_status_dirs(where: Path, hidden: bool = False) -> list[Path]:
    """Remove the status directories in ``where`` of this user's ``opguard guard``
    processes that are gone (SIGKILL leaves no time to remove one); a process that
    runs (or a pid reused since) keeps its own. Returns the removed ones."""
    removed: list[Path] = []
    uid = os.getuid() if hasattr(os, "getuid") else None
    try:
        names = os.listdir(where)
    except OSError:
        return removed
    for name in names:
        if hidden and not name.startswith("."):
            continue
        found = _STATUS_NAME.fullmatch(name[1:] if hidden else name)
        if found is None:
            continue
        path = where / name
        try:
            info = path.lstat()
            os.kill(int(found.group(1)), 0)
        except ProcessLookupError:  # gone: its directory is left over
            if stat.S_ISDIR(info.st_mode) and (uid is None or info.st_uid == uid):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
        except (OSError, OverflowError, ValueError):  # not ours, or alive (EPERM)
            continue
    return removed


def check_sample(_ctx: click.Context, _param: click.Parameter, value: float) -> float:
    """``--sample``: a finite P in (0, 1] whose 1/P is finite (``nan``, ``1e-320`` and
    ``inf`` are refused here, before COMMAND starts, not inside it)."""
    try:
        sample_every(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="'--sample'") from None
    return value


def written_reports(report_dir: Path, since: float) -> list[Path]:
    """The guard reports in ``report_dir`` written at or after ``since``, by rank."""
    found = []
    for path in report_dir.glob("guard_report_rank*.json"):
        suffix = path.stem[len("guard_report_rank") :]
        if suffix.isdigit() and path.stat().st_mtime >= since:
            found.append((int(suffix), path))
    return [path for _, path in sorted(found)]


def _rows(value: object, *types: type) -> bool:
    """Whether ``value`` is a list of rows, each a list of one value of each of
    ``types`` in order."""
    return isinstance(value, list) and all(
        isinstance(row, list)
        and len(row) == len(types)
        and all(isinstance(item, kind) for item, kind in zip(row, types, strict=True))
        for row in value
    )


def _valid_counts(document: dict[str, Any]) -> bool:
    """Whether a rank's counts (``status.write_job_counts``) have the shape the job
    view reads: its entries (target, context, ops counted, ops that ran), the
    entries it ran too little of (target, context, ops), the unknown targets and
    contexts (kind, target, context, ops)."""
    steps = document.get("steps")
    return (
        all(isinstance(document.get(k), int) for k in ("rank", "world_size", "total"))
        and (steps is None or isinstance(steps, int))
        and isinstance(document.get("threshold"), int | float)
        and _rows(document.get("entries"), str, list, int, list)
        and _rows(document.get("pruned"), str, list, int)
        and _rows(document.get("unknown"), str, str, list, int)
        and all(u[0] in UNKNOWN_KINDS for u in document["unknown"])
    )


def job_of(counts: list[dict[str, Any]]) -> tuple[dict[str, Any] | None, str | None]:
    """The job as one observed config from every rank's counts (entries summed, each
    with the ranks that ran it where not all did, the steps where every rank ran as
    many), with the ops of each ``unknown_target`` and ``unknown_context`` added up
    (``unknown``) and the job's threshold for them, the ranks' added up; else None and
    why not: only with the counts of every rank of one world (``opguard guard`` on
    each node of a multi-node job sees its node's ranks)."""
    if not counts or not all(_valid_counts(c) for c in counts):
        return None, "the ranks' counts could not be read"
    sizes = {c["world_size"] for c in counts}
    ranks = sorted(c["rank"] for c in counts)
    world = max(sizes)
    if len(sizes) > 1 or ranks != list(range(world)):
        return None, f"the counts of rank(s) {list_ranks(ranks)} of a world of {world} here"
    entries: dict[tuple[str, tuple[str, ...]], dict[str, Any]] = {}
    for document in counts:
        for target, context, count, ops in document["entries"]:
            entry = entries.setdefault(
                (target, tuple(context)),
                {"target": target, "context": list(context), "count": 0, "ops": {}, "ranks": []},
            )
            entry["count"] += count
            entry["ops"].update(dict.fromkeys(ops, 1))
            entry["ranks"].append(document["rank"])
    for entry in entries.values():
        entry["ranks"] = sorted(entry["ranks"]) if len(entry["ranks"]) < world else None
    meta: dict[str, Any] = {"ranks": list(range(world))}
    steps = {c["steps"] for c in counts}
    if len(steps) == 1 and None not in steps:
        meta["steps"] = steps.pop()
    unknown: dict[tuple[str, str, tuple[str, ...]], int] = {}
    for document in counts:
        for kind, target, context, ops in document["unknown"]:
            key = (kind, target, tuple(context))
            unknown[key] = unknown.get(key, 0) + ops
    # per config entry, the job's ops in it: where ranks kept it as an entry and where
    # they ran it too little to (``pruned``, by the ranks that did)
    ran = {key: entry["count"] for key, entry in entries.items()}
    pruned: dict[tuple[str, tuple[str, ...]], list[int]] = {}
    for document in counts:
        for target, context, ops in document["pruned"]:
            entry_key = (target, tuple(context))
            ran[entry_key] = ran.get(entry_key, 0) + ops
            pruned.setdefault(entry_key, []).append(document["rank"])
    job = {
        "meta": meta,
        "entries": [entries[k] for k in sorted(entries)],
        "unknown": unknown,
        "threshold": sum(c["threshold"] for c in counts),
        "ran": ran,
        "pruned": pruned,
        "total": sum(c["total"] for c in counts),
    }
    return job, None


def judge_by_job(
    reports: list[Path],
    counts: list[dict[str, Any]] | None,
    config: dict[str, Any],
    source: str | None,
) -> tuple[int, str | None]:
    """Judge the reports' whole-run kinds by the job as a whole, as ``opguard check``
    does with its combined view: ``count_drift`` and ``missing_op`` by
    :class:`~opguard_plugins.enforce.rules.JobView`, an ``unknown_target`` or
    ``unknown_context`` by the job's ops against the job's threshold (the config's
    tree pruned what the job as a whole ran too little of: a function only rank 0 runs
    has rank 0's ops, against the threshold of every rank). Drop from each rank's
    report those the job does not show (rewritten atomically), then log those left,
    which the ranks leave to this command. (the number dropped, why the job could not
    be judged or None)."""
    deferred = {c.get("rank") for c in counts or ()}
    held_to = share_of(config, source)
    job, why = job_of(counts or [])
    view = JobView(held_to, job, DEFAULT_TOLERANCE) if job is not None and held_to else None
    if job is not None and held_to:  # the job's tree pruned as the config's settings prune
        job["floor"] = pruning_floor(job["total"], *pruning_settings(held_to.get("meta") or {}))
    dropped = 0
    log = get_logger()
    for path in reports:
        try:
            document = load_report(path)
        except OpGuardError:
            continue  # summarize() names it
        judged = [
            item
            for item in document["violations"]
            if item["kind"] in JUDGED_BY_JOB and (counts is None or item["rank"] in deferred)
        ]
        left_out = {
            id(item)
            for item in judged
            if view is not None and job is not None and not _kept(item, view, job)
        }
        if left_out:
            kept = [item for item in document["violations"] if id(item) not in left_out]
            rewritten = {
                **document,
                "violations": kept,
                "errors": sum(v["severity"] == ERROR for v in kept),
                "warnings": sum(v["severity"] == WARNING for v in kept),
            }
            try:
                write_json(path, rewritten)
            except OSError as exc:  # the report stays whole as written: all of it counts
                log.error(
                    "opguard guard: could not rewrite a report", path=str(path), error=str(exc)
                )
                left_out = set()
        dropped += len(left_out)
        for item in judged:
            if id(item) not in left_out:
                (log.error if item["severity"] == ERROR else log.warning)(
                    "opguard guard: violation",
                    kind=item["kind"],
                    severity=item["severity"],
                    target=item["target"],
                    context=item["context"],
                    op=item.get("op"),
                    rank=item["rank"],
                    message=item["message"],
                )
    return dropped, why if deferred and view is None else None


def _kept(item: dict[str, Any], view: JobView, job: dict[str, Any]) -> bool:
    """Whether the job as a whole shows the report's violation ``item``: a ``missing``
    entry that its rank ran too little to be an entry of its own is missing from the
    job where the ranks' ops in it, added up, are below the job's pruning floor too
    (``opguard check`` prunes the job's tree: the function that is small on one rank
    and large on another is an entry there)."""
    key = (item["target"], tuple(item["context"]))
    if item["kind"] in PRUNED_KINDS:
        if item["rank"] not in job["pruned"].get(key, ()):
            return True  # it never ran on that rank: the rank's own finding
        return bool(job["ran"][key] < job["floor"])
    if item["kind"] in UNKNOWN_KINDS:
        return bool(job["unknown"].get((item["kind"], *key), 0) >= job["threshold"])
    return view.keeps(_violation(item))


def _violation(item: dict[str, Any]) -> Violation:
    return Violation(
        item["kind"],
        item["severity"],
        item["target"],
        list(item["context"]),
        list(item.get("ranks") or [item["rank"]]),
        item["message"],
        op=item.get("op"),
    )


class NothingToCheck(OpGuardError):
    """The config gives the guard nothing to check."""

    exit_code = ExitCode.GUARD_FAILED


def summarize(
    reports: list[Path],
) -> tuple[int, int, list[str], dict[int, dict[str, Any]]]:
    """(errors, warnings, one line per unreadable report, the ``partial`` marker of
    each rank whose program ended early) over the written reports."""
    errors = warnings = 0
    problems = []
    partial: dict[int, dict[str, Any]] = {}
    for path in reports:
        try:
            document: dict[str, Any] = load_report(path)
        except OpGuardError as exc:
            problems.append(str(exc))
            continue
        if isinstance(document.get("partial"), dict):
            partial[document["rank"]] = document["partial"]
        for item in document["violations"]:
            if item["severity"] == ERROR:
                errors += 1
            else:
                warnings += 1
    return errors, warnings, problems, partial


CODES: exits.Codes = {
    ExitCode.OK: "the command succeeded, every guard checked it and no report has an error",
    ExitCode.STAGE_FAILED: "a report has an error, or a report could not be read",
    ExitCode.USAGE_ERROR: "bad command line or option value (--sample nan, an unusable "
    "--report-dir, a --source the config lacks)",
    ExitCode.INPUT_UNREADABLE: "the config (or the --collectives trace) could not be read, "
    "or a setting in it is invalid",
    ExitCode.GUARD_FAILED: "the program was not checked: no config entries, no guard "
    "started, one could not start or write its report, or no op was checked",
    **LAUNCH_CODES,
}


@click.option(
    "--report-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("."),
    show_default=True,
    help="Directory for guard_report_rank{R}.json (created if missing).",
)
@click.option(
    "--on-violation",
    type=click.Choice(["warn", "raise"]),
    default="warn",
    show_default=True,
    help="warn: log each violation's first occurrence; raise: OpGuardViolation in the call.",
)
@click.option(
    "--sample",
    type=FiniteFloatRange(min=0.0, max=1.0, min_open=True),
    callback=check_sample,
    default=1.0,
    show_default=True,
    help="Check only every round(1/P)-th optimizer step (step 0 always).",
)
@click.option(
    "--collectives",
    "collectives_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="A good run's callsite trace with collective sequences ({entry}_combined.json) "
    "to check each collective against before it is issued (default: the config's own).",
)
@click.option(
    "--source",
    default=None,
    metavar="NAME",
    help="Which of a merged config's sources the program is: the whole run is compared "
    "with its share, and each collective with its sequence (needed when the config "
    "has the sequences of several).",
)
@click.option(
    "--collective-timeout",
    type=FiniteFloatRange(min=0.0, min_open=True),
    default=None,
    help="Report a rank that waits longer than this many seconds in one collective.",
)
@config_option
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def guard(
    config_path: Path,
    report_dir: Path,
    on_violation: str,
    sample: float,
    collectives_path: Path | None,
    source: str | None,
    collective_timeout: float | None,
    command: tuple[str, ...],
) -> int:
    """Run COMMAND with CONFIG enforced at run time, writing one report per rank.

    COMMAND is a Python script, python -m PKG, or torchrun ...; put it after "--".
    """
    config_path = config_source(config_path)
    config = load_config(config_path)
    if not config["entries"]:
        raise NothingToCheck(
            f"{config_path}: the config has no entries: the guard would check nothing"
        )
    if collectives_path is not None:
        load_collectives(collectives_path)
    else:
        config_sequences(config, config_path, source)
    prepare_output_dir(report_dir, "--report-dir")
    started = time.time() - 1.0  # file systems with coarse timestamps
    with _status_dir(report_dir) as status_dir:
        env = guard_env(
            config_path,
            report_dir,
            on_violation,
            sample,
            command,
            Path(status_dir),
            collectives_path,
            collective_timeout,
            source,
        )
        log_format = (click.get_current_context().obj or {}).get("log_format")
        if log_format:  # `opguard --log-format X guard ...`: the guarded processes log as X
            env["OPGUARD_GUARD_LOG_FORMAT"] = log_format
        code = run_bootstrapped(command, env)
        failures = guard_problems(read_statuses(Path(status_dir)), command_ok=code == 0)
        counts = read_job_counts(Path(status_dir))
    reports = written_reports(report_dir, started)
    dropped, unjudged = judge_by_job(reports, counts, config, source)
    errors, warnings, problems, partial = summarize(reports)
    for problem in problems:
        click.echo(f"opguard: error: {one_line(problem)}", err=True)
    if reports:
        names = ", ".join(p.name for p in reports)
        skipped = (
            f" (runs that ended early, {describe_partial(partial)}: their whole-run rules "
            f"({', '.join(WHOLE_RUN_KINDS)}) not checked)"
            if partial
            else ""
        )
        if dropped:
            skipped += (
                f" ({dropped} violation(s) of single ranks left out: the job as a whole "
                "agrees with the config)"
            )
        if unjudged:
            skipped += f" (whole-run kinds judged per rank: {unjudged})"
        if share_of(config, source) is None:  # a merged config, no --source: said, not silent
            skipped += (
                f" (a merged config of sources {', '.join(recorded_sources(config))} and no "
                f"--source: the whole-run rules ({', '.join(WHOLE_RUN_KINDS)}) not checked; "
                "--source NAME holds the program to its source's share)"
            )
        click.echo(
            f"opguard guard: {errors} error(s), {warnings} warning(s) in {len(reports)} "
            f"report(s) in {reports[0].parent}: {names}{skipped}",
            err=True,
        )
    else:
        click.echo(
            f"opguard guard: no report written to {report_dir}",
            err=True,
        )
    for failure in failures:
        click.echo(f"opguard guard: error: {one_line(failure)}", err=True)
    if code != 0:
        return code
    if errors or problems:  # what was checked found errors: that first
        return ExitCode.STAGE_FAILED
    return ExitCode.GUARD_FAILED if failures else ExitCode.OK


guard_command = exits.command(
    "guard",
    CODES,
    extra="COMMAND's own exit code when it fails; else",
    context_settings={"allow_interspersed_args": False},
)(guard)


@hookimpl
def opguard_register_commands(cli: click.Group) -> None:
    """Add ``opguard guard``."""
    cli.add_command(guard_command)


__all__ = ["guard_command", "guard_env", "opguard_register_commands", "summarize"]

if __name__ == "__main__":  # python -m opguard_plugins.enforce.guard --config C -- COMMAND...
    signal.signal(signal.SIGINT, signal.default_int_handler)
    guard_command()
