"""The runner: calls the stage hooks in order and keeps the run directory.

It calls stage implementations one at a time (in pluggy's order) so it can say
which plugin answered or failed; it catches failures per stage and per entry,
records each in ``pipeline_summary.json`` and goes on where it can. Every artifact
is written atomically. SIGINT/SIGTERM stop the run between writes; the summary
says where.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime as _dt
import gc
import os
import signal
import time
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import msgspec
import structlog
from ruamel.yaml.comments import CommentedMap

from opguard_core import __version__
from opguard_core.combine.accumulator import CallsiteTrace, gc_paused
from opguard_core.configs.chain import active_filters, apply_filters
from opguard_core.configs.selection import Selection, select_trace, unmatched_hide
from opguard_core.errors import ExitCode, Interrupted, OpGuardError, one_line
from opguard_core.files.atomic import (
    atomic_write_bytes,
    atomic_write_parts,
    atomic_write_text,
    safe_child,
)
from opguard_core.formats.config import dump_config, entry_key, validate_config
from opguard_core.formats.divergence import check_findings, tally, write_divergence
from opguard_core.formats.tree import check_tree, encode_tree
from opguard_core.logs import get_logger
from opguard_core.model import (
    STAGES,
    Discovery,
    InputEntry,
    RunOptions,
    StageFailed,
    StageRecord,
)
from opguard_core.plugin.manager import OpGuardPluginManager, call_impl
from opguard_core.run.artifacts import check_entry_names
from opguard_core.run.helper import EntryHelper, overlaps
from opguard_core.run.stale import find_stale_runs, release_run_directory, start_run_directory
from opguard_core.run.warnings import collecting, warn

OUTPUT_BASE_ENV = "OPGUARD_TRACE_OUTPUT_BASE"
DEFAULT_OUTPUT_BASE = Path("opguard_traces")


def trace_output_base(explicit: Path | None = None) -> Path:
    """Where run directories go: ``--output-base``, else ``$OPGUARD_TRACE_OUTPUT_BASE``,
    else ``./opguard_traces``."""
    if explicit is not None:
        return explicit
    env = os.environ.get(OUTPUT_BASE_ENV)
    return Path(env) if env else DEFAULT_OUTPUT_BASE


class Runner:
    """One ``opguard run``."""

    def __init__(
        self,
        manager: OpGuardPluginManager,
        inputs: Sequence[str],
        options: RunOptions,
        skip: Sequence[str] = (),
        output_base: Path | None = None,
    ) -> None:
        self.manager = manager
        self.inputs = list(inputs)
        self.options = options
        self.skip = [s for s in STAGES if s in set(skip)]
        self.output_base = trace_output_base(output_base)
        self.records: list[StageRecord] = []
        #: every config this run wrote, by file name in the run directory, handed to
        #: ``opguard_run_finished`` so the report need not parse the YAML back
        self.written_configs: dict[str, CommentedMap] = {}
        self.log = get_logger()
        self.run_dir: Path | None = None
        self.started = _dt.datetime.now(_dt.UTC)
        self.interrupted: dict[str, Any] | None = None
        self.current: tuple[str, str | None] = ("setup", None)
        #: True in a forked helper (:mod:`opguard_core.run.helper`): no summary writes
        self.in_helper = False
        self.entries: list[InputEntry] = []
        #: the last failure to write the summary (None: the last write succeeded)
        self.summary_error: str | None = None
        self.finished = False
        #: SIGINT goes through :meth:`_on_sigint` (when Python's default handler was
        #: installed), so a KeyboardInterrupt without one is a plugin's, not the user's
        self.sigint_tracked = False
        self.sigint_received = False
        #: run warnings (opguard_core.run.warnings), also in the summary
        self.warnings: list[dict[str, Any]] = []
        self._lock: int | None = None

    # ----------------------------------------------------------------- helpers

    def _path(self, filename: str) -> Path:
        assert self.run_dir is not None
        return safe_child(self.run_dir, filename)

    def _rel(self, path: Path) -> str:
        assert self.run_dir is not None
        try:
            return str(path.relative_to(self.run_dir.resolve()))
        except ValueError:
            return str(path)

    def _skipped(self, stage: str, entry: str | None, reason: str) -> None:
        self.records.append(StageRecord(stage, entry, status="skipped", error=reason))
        self.log.info("stage skipped", stage=stage, entry=entry, reason=reason)
        self.write_summary()

    @contextlib.contextmanager
    def stage(self, name: str, entry: str | None) -> Iterator[StageRecord]:
        """Time a stage, record its outcome, and turn a failure into :class:`StageFailed`."""
        record = StageRecord(name, entry)
        self.current = (name, entry)
        started = time.perf_counter()
        with structlog.contextvars.bound_contextvars(stage=name, entry=entry):
            try:
                yield record
            except (Interrupted, KeyboardInterrupt, SystemExit, Exception) as exc:
                if isinstance(exc, Interrupted) or (
                    isinstance(exc, KeyboardInterrupt) and not self._spurious(exc)
                ):
                    record.status = "interrupted"
                    record.seconds = round(time.perf_counter() - started, 6)
                    self.records.append(record)
                    raise
                record.status = "failed"
                record.seconds = round(time.perf_counter() - started, 6)
                record.error = one_line(failure_reason(exc, record))
                self.records.append(record)
                self.log.error(
                    "stage failed",
                    plugin=record.plugin,
                    error=record.error,
                    exc_info=self.options.verbose,
                )
                if self.options.verbose and not isinstance(exc, OpGuardError):
                    self.log.debug("traceback", traceback=traceback.format_exc())
                self.write_summary()
                raise StageFailed(record.error) from exc
            record.seconds = round(time.perf_counter() - started, 6)
            self.records.append(record)
            scalars = {k: v for k, v in record.counts.items() if not isinstance(v, list | dict)}
            self.log.info("stage done", seconds=record.seconds, **scalars)
            self.log.debug("stage detail", plugin=record.plugin, outputs=record.outputs)
            self.write_summary()

    def call_first(self, hook: str, record: StageRecord, **kwargs: Any) -> Any:
        """Call implementations in order until one returns non-None; note which one."""
        impls = self.manager.implementations(hook)
        if hook == "opguard_compress" and self.options.compressor:
            plugin = self.manager.get_plugin(self.options.compressor)
            impls = [i for i in impls if i.plugin is plugin]
        for impl in impls:
            record.plugin = impl.plugin_name
            result = call_impl(impl, kwargs)
            if result is not None:
                return result
        if hook == "opguard_compress" and self.options.compressor:
            raise OpGuardError(f"compressor {self.options.compressor!r} returned no tree")
        raise OpGuardError(f"no plugin returned a result for {hook}")

    # ----------------------------------------------------------------- stages

    def discover(self) -> list[InputEntry]:
        with self.stage("discover", None) as record:
            record.inputs = list(self.inputs)
            found: Discovery = self.call_first(
                "opguard_discover", record, inputs=self.inputs, base_dir=self.options.base_dir
            )
            record.counts = {"entries": len(found.entries), "problems": len(found.problems)}
            clashes = check_entry_names(e.name for e in found.entries)
            if clashes:
                raise OpGuardError(f"plugin {record.plugin!r} refused: {'; '.join(clashes)}")
            record.outputs = [e.name for e in found.entries]
        for problem in found.problems:
            self.records.append(
                StageRecord(
                    "discover", problem.spec, status="failed", error=one_line(problem.error)
                )
            )
            self.log.error(
                "input refused", stage="discover", input=problem.spec, error=one_line(problem.error)
            )
        return found.entries

    def process_entry(self, entry: InputEntry) -> CommentedMap | None:
        """combine → compress → generate for one entry; None when it stopped early.

        A stage that is skipped or fails makes the later ones ``skipped`` for this entry.
        """
        trace: CallsiteTrace | None = None
        tree: dict[str, Any] | None = None
        config: CommentedMap | None = None
        reason: str | None = None
        helper: EntryHelper | None = None
        try:
            if "combine" in self.skip:
                reason = "--skip combine"
                self._skipped("combine", entry.name, reason)
            else:
                trace, unwritten = self._combine(entry)
                divergence = len(trace.ranks) >= 2
                if divergence and "divergence" in self.skip:
                    self._skipped("divergence", entry.name, "--skip divergence")
                    divergence = False
                helper = EntryHelper.start(self, entry, trace, unwritten, divergence)
            if trace is not None and "compress" in self.skip:
                reason = "--skip compress"
                self._skipped("compress", entry.name, reason)
            elif trace is not None:
                tree = self._compress(entry, trace)
            del trace
            if tree is not None and "generate" in self.skip:
                reason = "--skip generate"
                self._skipped("generate", entry.name, reason)
            elif tree is not None:
                config = self._generate(entry, tree)
        except StageFailed as exc:
            reason = f"an earlier stage failed: {exc}"
        except BaseException:  # interrupted (or worse): the helper's work is moot
            if helper is not None:
                helper.cancel()
            raise
        if helper is not None:
            helper.finish()
        if config is None:
            done = {r.stage for r in self.records if r.entry == entry.name}
            for stage in ("combine", "compress", "generate"):
                if stage not in done:
                    self._skipped(stage, entry.name, f"{reason}")
        return config

    def _combine(self, entry: InputEntry) -> tuple[CallsiteTrace, Path | None]:
        """The combine stage; with the combined trace's file, when its encoding and
        writing are left to the entry's helper (:mod:`opguard_core.run.helper`), else
        None."""
        with self.stage("combine", entry.name) as record:
            record.inputs = [str(f) for f in entry.files]
            trace: CallsiteTrace = self.call_first(
                "opguard_combine", record, entry=entry, options=self.options
            )
            out = self._path(f"{entry.name}_combined.json")
            unwritten = out if overlaps(self.options, trace) else None
            if unwritten is None:
                atomic_write_parts(out, trace.json_parts())
            record.outputs = [self._rel(out)]
            record.counts = {
                "files": len(entry.files),
                "ranks": len(trace.ranks),
                "frames": len(trace.frames),
                "callsites": len(trace.callsites),
                "total": trace.total,
            }
        return trace, unwritten

    def divergence_stage(self, entry: InputEntry, trace: CallsiteTrace) -> None:
        """The divergence stage, here or in the entry's helper (:mod:`.entry_helper`)."""
        with self.stage("divergence", entry.name) as record:
            record.inputs = [f"{entry.name}_combined.json"]
            where = f"divergence findings of {entry.name}"
            findings = check_findings(
                self.call_first("opguard_divergence", record, trace=trace, options=self.options),
                where,
            )
            meta = {
                "source": entry.name,
                "ranks": trace.ranks,
                "skew": self.options.skew,
                "per_rank_stats": trace.per_rank_stats,
            }
            outputs = write_divergence(self._path, entry.name, meta, findings)
            record.outputs = [self._rel(o) for o in outputs]
            record.counts = tally(findings)
            if findings:
                self.log.warning(
                    "ranks diverge",
                    errors=record.counts["errors"],
                    warnings=record.counts["warnings"],
                    log=record.outputs[-1],
                )

    def _compress(self, entry: InputEntry, trace: CallsiteTrace) -> dict[str, Any]:
        with self.stage("compress", entry.name) as record:
            record.inputs = [f"{entry.name}_combined.json"]
            trace = self._select(entry, trace)
            tree: dict[str, Any] = self.call_first(
                "opguard_compress", record, trace=trace, options=self.options
            )
            check_tree(tree, expected_total=trace.total)
            out = self._path(f"{entry.name}_compressed.json")
            atomic_write_bytes(out, encode_tree(tree))
            record.outputs = [self._rel(out)]
            settings = tree["meta"].get("compression", {})
            record.counts = {
                "nodes_before": settings.get("nodes_before"),
                "nodes_after": settings.get("nodes_after"),
                "total": tree["root"]["count"],
            }
        return tree

    def _select(self, entry: InputEntry, trace: CallsiteTrace) -> CallsiteTrace:
        """The callsites ``--focus`` and ``--ignore`` keep (every compressor sees the
        same selection); every user pattern that matched nothing is a warning."""
        selection = Selection.of(self.options.focus, self.options.ignore)
        selected = select_trace(trace, selection)
        unmatched = selection.unmatched()
        unmatched += [("--hide", p) for p in unmatched_hide(trace, self.options.hide)]
        for option, pattern in unmatched:
            warn("pattern matched nothing", option=option, pattern=pattern, entry=entry.name)
        return selected

    def _generate(self, entry: InputEntry, tree: dict[str, Any]) -> CommentedMap:
        with self.stage("generate", entry.name) as record:
            record.inputs = [f"{entry.name}_compressed.json"]
            config: CommentedMap = self.call_first(
                "opguard_generate", record, tree=tree, source=entry.name, options=self.options
            )
            validate_config(config, f"{entry.name}_instrumentation.yaml (from {record.plugin})")
            out = self._path(f"{entry.name}_instrumentation.yaml")
            atomic_write_text(out, dump_config(config))
            self.written_configs[out.name] = config
            record.outputs = [self._rel(out)]
            record.counts = {
                "entries": len(config["entries"]),
                "total": (config.get("meta") or {}).get("total"),
            }
        return config

    def compare(self, configs: dict[int, tuple[InputEntry, CommentedMap]]) -> None:
        """Compare the first config that exists against each later entry's (entry 1's
        unless it failed; the log says which one is the base)."""
        base = min(configs) if configs else 1
        first = configs.get(base)
        if first is not None and base != 1:
            warn(
                "compare base is not entry 1", base=base, entry=first[0].name,
                reason="entry 1 made no config",
            )  # fmt: skip
        others = [i.index for i in self.entries if i.index != base]
        for index in others:
            entry = self.entries[index - 1]
            if "compare" in self.skip:
                self._skipped("compare", entry.name, "--skip compare")
                continue
            if index < base:
                self._skipped("compare", entry.name, "this entry made no config")
                continue
            if first is None or index not in configs:
                self._skipped("compare", entry.name, "a config to compare is missing")
                continue
            with contextlib.suppress(StageFailed), self.stage("compare", entry.name) as record:
                first_label = f"{base} ({first[0].name})"
                other_label = f"{index} ({entry.name})"
                record.inputs = [
                    f"{first[0].name}_instrumentation.yaml",
                    f"{entry.name}_instrumentation.yaml",
                ]
                text = self.call_first(
                    "opguard_compare",
                    record,
                    first=first[1],
                    other=configs[index][1],
                    first_label=first_label,
                    other_label=other_label,
                )
                out = self._path(f"comparison_{base}_vs_{index}.log")
                atomic_write_text(out, text)
                record.outputs = [self._rel(out)]
                a = {entry_key(e) for e in first[1]["entries"]}
                b = {entry_key(e) for e in configs[index][1]["entries"]}
                record.counts = {
                    "base": base,
                    "only_first": len(a - b),
                    "only_other": len(b - a),
                    "common": len(a & b),
                }

    def merge(
        self, configs: dict[int, tuple[InputEntry, CommentedMap]]
    ) -> tuple[str, CommentedMap] | None:
        """Fold (1+2)+3+…; returns (name, final config), or the single entry's config."""
        available = [configs[i] for i in sorted(configs)]
        if len(self.entries) == 1:
            self._skipped("merge", None, "a single entry: nothing to merge")
            return (available[0][0].name, available[0][1]) if available else None
        if "merge" in self.skip:
            self._skipped("merge", None, "--skip merge")
            return None
        if len(available) < 2:
            self._skipped("merge", None, "fewer than two configs to merge")
            return None
        accumulated = available[0][1]
        for step, (entry, config) in enumerate(available[1:], start=1):
            last = step == len(available) - 1
            try:
                with self.stage("merge", entry.name) as record:
                    left_name = (
                        f"{available[0][0].name}_instrumentation.yaml"
                        if step == 1
                        else f"temp_combined_{step - 1}.yaml"
                    )
                    record.inputs = [left_name, f"{entry.name}_instrumentation.yaml"]
                    accumulated = self.call_first(
                        "opguard_merge", record, left=accumulated, right=config
                    )
                    validate_config(accumulated, f"merge result (from {record.plugin})")
                    text = dump_config(accumulated)
                    outputs = [self._path(f"temp_combined_{step}.yaml")]
                    if last:
                        outputs.append(self._path("final_combined_instrumentation.yaml"))
                    for out in outputs:
                        atomic_write_text(out, text)
                        self.written_configs[out.name] = accumulated
                    record.outputs = [self._rel(o) for o in outputs]
                    record.counts = {"entries": len(accumulated["entries"])}
            except StageFailed:
                return None
        return ("final_combined", accumulated)

    def active_filters(self) -> list[Any]:
        return active_filters(self.manager, self.options)

    def filter(self, final: tuple[str, CommentedMap] | None) -> None:
        filters = self.active_filters()
        if not filters:
            return
        if "filter" in self.skip:
            self._skipped("filter", None, "--skip filter")
            return
        if final is None:
            self._skipped("filter", None, "no final config to filter")
            return
        name, config = final
        config = copy.deepcopy(config)
        with contextlib.suppress(StageFailed), self.stage("filter", name) as record:
            record.inputs = [
                "final_combined_instrumentation.yaml"
                if name == "final_combined"
                else f"{name}_instrumentation.yaml"
            ]
            config, chain = apply_filters(
                filters,
                config,
                self.options,
                self.log,
                on_plugin=lambda name: setattr(record, "plugin", name),
            )
            record.plugin = ",".join(i.plugin_name for i in filters)
            out = self._path(f"{name}_filtered_instrumentation.yaml")
            atomic_write_text(out, dump_config(config))
            self.written_configs[out.name] = config
            record.outputs = [self._rel(out)]
            record.counts = {"entries": len(config["entries"]), "filters": chain}

    # ----------------------------------------------------------------- run

    def run(self) -> ExitCode:
        """Run every stage; return the exit code (non-zero when anything failed)."""
        run_dir, self._lock = start_run_directory(self.output_base)
        self.run_dir = run_dir.resolve()
        log = self.log = get_logger()
        log.info("run started", run_dir=str(self.run_dir), inputs=self.inputs)
        log.info("plugins", active=self.plugin_names(), disabled=list(self.manager.disabled))
        previous = signal.getsignal(signal.SIGTERM)
        previous_int = signal.getsignal(signal.SIGINT)
        signal.signal(signal.SIGTERM, _raise_interrupted)
        if previous_int is signal.default_int_handler:
            signal.signal(signal.SIGINT, self._on_sigint)
            self.sigint_tracked = True
        try:
            # the cyclic collector stays off for the run: every collection would rescan
            # the millions of acyclic objects a large entry holds (traces, trees) and
            # free nothing; reference counting frees them, and _run_stages collects
            # once between entries, when those objects are gone
            with collecting(self.warnings), gc_paused():
                for stale in find_stale_runs(self.output_base, exclude=self.run_dir):
                    warn(stale.line(), stale_run_dir=str(stale.run_dir))
                self._run_stages()
        except (Interrupted, KeyboardInterrupt) as exc:
            name = exc.signal_name if isinstance(exc, Interrupted) else "SIGINT"
            stage, entry = self.current
            self.interrupted = {"signal": name, "stage": stage, "entry": entry}
            log.error("run interrupted", **self.interrupted)
        finally:
            signal.signal(signal.SIGTERM, previous)
            if self.sigint_tracked:
                signal.signal(signal.SIGINT, previous_int)
            self.write_summary(final=True)
            self.finished = True
            code = self.exit_code()
            self._run_finished()
            release_run_directory(self._lock)
            self._lock = None
            log.info("run finished", exit_code=int(code))
        return code

    def plugin_names(self) -> list[str]:
        """The loaded plugins, as pytest's ``plugins:`` line names them: a built-in by
        name, a third-party one as ``name (distribution version)``."""
        names = []
        for p in self.manager.describe():
            origin = " ".join(x for x in (p.distribution or "?", p.version) if x)
            names.append(p.name if p.builtin else f"{p.name} ({origin})")
        return names

    def _run_stages(self) -> None:
        try:
            self.entries = self.discover()
        except StageFailed:
            return
        configs: dict[int, tuple[InputEntry, CommentedMap]] = {}
        for entry in self.entries:
            try:
                config = self.process_entry(entry)
            except StageFailed:
                continue
            finally:
                gc.collect()  # cycles an entry's plugins left (the run pauses the collector)
            if config is not None:
                configs[entry.index] = (entry, config)
        if len(self.entries) > 1:
            self.compare(configs)
        final = self.merge(configs) if self.entries else None
        self.filter(final)

    def exit_code(self) -> ExitCode:
        if self.interrupted is not None:
            return ExitCode.INTERRUPTED
        if any(r.status == "failed" for r in self.records):
            return ExitCode.STAGE_FAILED
        if self.summary_error is not None and self.finished:
            return ExitCode.STAGE_FAILED  # the final summary could not be written
        if self.options.fail_on_divergence and any(
            r.stage == "divergence" and r.counts.get("errors") for r in self.records
        ):
            return ExitCode.DIVERGENCE
        return ExitCode.OK

    def _spurious(self, exc: KeyboardInterrupt) -> bool:
        """A KeyboardInterrupt that no SIGINT caused (a plugin raised it)."""
        return self.sigint_tracked and not self.sigint_received

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        self.sigint_received = True
        raise KeyboardInterrupt

    def summary(self, final: bool = False) -> dict[str, Any]:
        finished = _dt.datetime.now(_dt.UTC)
        code = self.exit_code()
        return {
            "opguard_version": __version__,
            "run_dir": str(self.run_dir),
            "started_at": self.started.isoformat(),
            "finished_at": finished.isoformat() if final else None,
            "seconds": round((finished - self.started).total_seconds(), 6),
            "status": (
                "interrupted"
                if self.interrupted
                else "running"
                if not final
                else "failed"
                if code
                else "ok"
            ),
            "exit_code": int(code) if final else None,
            "interrupted": self.interrupted,
            "inputs": self.inputs,
            "base_dir": str(self.options.base_dir.resolve()),
            "entries": [
                {
                    "name": e.name,
                    "index": e.index,
                    "files": [str(f) for f in e.files],
                    "specs": list(e.specs),
                }
                for e in self.entries
            ],
            "options": _jsonable(dataclasses.asdict(self.options)),
            "skipped_stages": self.skip,
            "disabled_plugins": list(self.manager.disabled),
            "plugins": [
                {
                    "name": p.name,
                    "distribution": p.distribution,
                    "version": p.version,
                    "hooks": p.hooks,
                }
                for p in self.manager.describe()
            ],
            "stages": [dataclasses.asdict(r) for r in self.records],
            "warnings": self.warnings,
        }

    def _run_finished(self) -> None:
        """Call every ``opguard_run_finished`` (the report); a failure is only logged."""
        if self.run_dir is None:
            return
        summary = self.summary(final=True)
        for impl in self.manager.implementations("opguard_run_finished"):
            try:
                call_impl(
                    impl,
                    {"run_dir": self.run_dir, "summary": summary, "configs": self.written_configs},
                )
            except (KeyboardInterrupt, SystemExit, Exception) as exc:
                if isinstance(exc, KeyboardInterrupt) and not self._spurious(exc):
                    raise
                self.log.error(
                    "run_finished failed",
                    plugin=impl.plugin_name,
                    error=one_line(failure_reason(exc, None)),
                )

    def write_summary(self, final: bool = False) -> None:
        """Rewrite ``pipeline_summary.json``. A failure (disk full, ...) never stops the
        run: it is logged once, the next write tries again, and ``summary_error``
        holds the last failure (None once a write succeeds)."""
        if self.run_dir is None or self.in_helper:
            return
        try:
            data = msgspec.json.format(msgspec.json.encode(self.summary(final)), indent=2)
            atomic_write_bytes(self._path("pipeline_summary.json"), data + b"\n")
        except (OSError, OpGuardError, MemoryError, msgspec.EncodeError) as exc:
            error = one_line(str(exc) or type(exc).__name__)
            if error != self.summary_error:
                self.log.error("summary not written", file="pipeline_summary.json", error=error)
            self.summary_error = error
        else:
            self.summary_error = None


def failure_reason(exc: BaseException, record: StageRecord | None) -> str:
    """What a failed stage's record (and the log) says about ``exc``: an
    :class:`OpGuardError`'s own line; for a plugin that tried to end the process,
    which one; a MemoryError names the stage's inputs."""
    plugin = f" by plugin {record.plugin}" if record is not None and record.plugin else ""
    if isinstance(exc, SystemExit):
        return f"SystemExit({exc.code!r}) raised{plugin}: a plugin may not end the process"
    if isinstance(exc, KeyboardInterrupt):
        return f"KeyboardInterrupt raised{plugin} without a SIGINT"
    if isinstance(exc, OpGuardError):
        return str(exc)
    if isinstance(exc, MemoryError):
        inputs = ", ".join(record.inputs) if record is not None and record.inputs else "?"
        return f"out of memory{plugin} (inputs: {inputs})"
    return f"{type(exc).__name__}: {exc}"


def _jsonable(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def _raise_interrupted(signum: int, frame: FrameType | None) -> None:
    raise Interrupted(signal.Signals(signum).name)


__all__ = ["Runner", "StageRecord", "trace_output_base"]
