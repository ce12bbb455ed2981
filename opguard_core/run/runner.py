"""The runner: one loop over the steps of ``opguard run`` (:mod:`opguard_core.run.steps`).

It discovers the entries, runs the entry steps for each entry (side steps and
deferred writes in the entry's forked helper where that pays: :mod:`.helper`), then
the run steps. A step the user skipped, or whose needs are missing, is recorded as
skipped with the reason. Failures are caught per stage and per entry, recorded in
``pipeline_summary.json`` and the run goes on where it can. SIGINT/SIGTERM stop the
run between writes; the summary says where. The runner names no stage's files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from opguard_core.combine.accumulator import collect_kept, gc_paused_run
from opguard_core.errors import ExitCode, Interrupted, OpGuardError, one_line
from opguard_core.files.atomic import atomic_write_bytes, safe_child
from opguard_core.files.output_dirs import trace_output_base
from opguard_core.model import InputEntry, RunOptions, StageFailed, StageRecord
from opguard_core.plugin.manager import OpGuardPluginManager, call_impl
from opguard_core.processes import signals_deferred
from opguard_core.run.artifacts import check_entry_names
from opguard_core.run.helper import EntryHelper, SideWork, overlaps
from opguard_core.run.interrupts import Interrupts
from opguard_core.run.records import Recorder, failure_reason
from opguard_core.run.stale import find_stale_runs, release_run_directory, start_run_directory
from opguard_core.run.steps import STEPS, RunContext, Step, StepCall, skip_reasons, unanswered
from opguard_core.run.summary import SUMMARY_FILE, SummaryPace, build_summary, encode_summary
from opguard_core.run.warnings import collecting, warn


class Runner:
    """One ``opguard run``."""

    def __init__(
        self,
        manager: OpGuardPluginManager,
        inputs: Sequence[str],
        options: RunOptions,
        skip: Sequence[str] = (),
        output_base: Path | None = None,
        steps: Sequence[Step] = STEPS,
    ) -> None:
        self.manager = manager
        self.per_entry = [s for s in steps if s.scope == "entry"]
        self.per_run = [s for s in steps if s.scope == "run"]
        self.inputs = list(inputs)
        self.options = options
        self.skip = [s.name for s in steps if s.name in set(skip)]
        self.skip_reason = skip_reasons(self.skip, steps, unanswered(manager, steps))
        self.output_base = trace_output_base(output_base)
        self.interrupts = Interrupts()
        self.recorder = Recorder(options.verbose, self.write_summary, self.interrupts.from_user)
        self.run_dir: Path | None = None
        self.context: RunContext | None = None
        self.entries: list[InputEntry] = []
        self.started = _dt.datetime.now(_dt.UTC)
        self.interrupted: dict[str, Any] | None = None
        self.finished = False
        self.summary_error: str | None = None  # the last summary write's failure, if it failed
        self.summary_pace = SummaryPace()
        self.left_to_exit: dict[str, Any] | None = None  # the last entry's: see run_steps

    def start(self, run_dir: Path) -> RunContext:
        """Use ``run_dir`` for this run's artifacts; the context its steps share."""
        self.run_dir = run_dir.resolve()
        self.context = RunContext(self.manager, self.options, self.run_dir, self.recorder)
        return self.context

    def discover(self) -> list[InputEntry]:
        """The ``discover`` stage: the entries, and a failed record per refused input."""
        with self.recorder.stage("discover", None) as record:
            record.inputs = list(self.inputs)
            found = self.manager.first_result(
                "opguard_discover",
                {"inputs": self.inputs, "base_dir": self.options.base_dir},
                on_plugin=lambda name: setattr(record, "plugin", name),
            )
            record.counts = {"entries": len(found.entries), "problems": len(found.problems)}
            clashes = check_entry_names(e.name for e in found.entries)
            if clashes:
                raise OpGuardError(f"plugin {record.plugin!r} refused: {'; '.join(clashes)}")
            record.outputs = [e.name for e in found.entries]
        for problem in found.problems:
            self.recorder.refused(problem.spec, problem.error)
        return list(found.entries)

    def process_entry(self, entry: InputEntry, side: bool = True) -> dict[str, Any]:
        """The entry steps for one entry (``side``: with the side steps); the results
        by step name. A step skipped or failed makes the steps that need it skipped."""
        results: dict[str, Any] = {}
        missing: dict[str, str] = {}  # why a step has no result
        helpers: list[EntryHelper] = []
        main = [s for s in self.per_entry if not s.side]
        try:
            for step in main:
                if not self._ready(step, entry, results, missing):
                    continue
                try:
                    call = self._entry_step(step, entry, results)
                    sides = [
                        s for s in self.per_entry if side and s.side and s.needs == (step.name,)
                    ]
                    names = tuple(s.name for s in sides if self._ready(s, entry, results, missing))
                    if call.pending or names:
                        helper = self._helper(step, entry, call, results, names)
                        helpers += [helper] if helper is not None else []
                except StageFailed as exc:
                    missing[step.name] = f"an earlier stage failed: {exc}"
                    for later in main[main.index(step) + 1 :]:
                        self._ready(later, entry, results, missing)
                    break
        except BaseException:  # interrupted (or worse): the helpers' work is moot
            for helper in helpers:
                helper.cancel()
            raise
        for helper in helpers:
            helper.finish()
        return results

    def _ready(
        self, step: Step, entry: InputEntry, results: dict[str, Any], missing: dict[str, str]
    ) -> bool:
        """Whether ``step`` runs for ``entry``; if not, records why (unless it does not
        apply to the entry at all)."""
        reason = next((missing[n] for n in step.needs if n in missing), None)
        if reason is None and step.applies is not None and not step.applies(results):
            return False
        reason = reason or self.skip_reason.get(step.name)
        if reason is not None:
            missing[step.name] = reason
            self.recorder.skipped(step.name, entry.name, reason)
        return reason is None

    def _entry_step(self, step: Step, entry: InputEntry, results: dict[str, Any]) -> StepCall:
        """Run one entry step; its call, with its writes left for the entry's helper when
        they are worth deferring. Raises StageFailed when it failed."""
        with self.recorder.stage(step.name, entry.name) as record:
            call = StepCall(self._context(), step, record)
            results[step.name] = step.run(call, entry, results)
            if step.weight is None or not overlaps(self.options, step.size(results[step.name])):
                call.flush()
        return call

    def _helper(
        self, step: Step, entry: InputEntry, call: StepCall, results: dict[str, Any],
        names: tuple[str, ...],
    ) -> EntryHelper | None:  # fmt: skip
        """The helper for ``step``'s deferred writes and the side steps ``names``."""
        return EntryHelper.start(
            self.recorder, entry.name, step.name, call.pending,
            (names, self._side_work(entry, results, names)) if names else None,
            step.size(results[step.name]), self.options,
        )  # fmt: skip

    def _side_work(
        self, entry: InputEntry, results: dict[str, Any], names: tuple[str, ...]
    ) -> SideWork:
        def work(recorder: Recorder) -> None:
            context = dataclasses.replace(self._context(), recorder=recorder)
            for name in names:
                step = next(s for s in self.per_entry if s.name == name)
                with contextlib.suppress(StageFailed), recorder.stage(name, entry.name) as record:
                    call = StepCall(context, step, record)
                    step.run(call, entry, results)
                    call.flush()

        return work

    def run_steps(self) -> None:
        """Discover, every entry's steps, then the run steps."""
        try:
            self.entries = self.discover()
        except StageFailed:
            return
        kept = {n for step in self.per_run for n in step.needs} - {s.name for s in self.per_run}
        results: dict[str, Any] = {"discover": self.entries, **{name: {} for name in kept}}
        for entry in self.entries:
            last = entry is self.entries[-1]
            try:
                done = self.process_entry(entry)
                for name in kept & done.keys():
                    results[name][entry.index] = (entry, done[name])
                self.left_to_exit = done if last else None  # exits.end_without_teardown
                del done  # its trace and tree go now (the last entry's at the exit, unfreed)
            finally:  # cycles an entry's plugins left (the run pauses the collector)
                collect_kept(collect=not last)
        for step in self.per_run:
            reason = self.skip_reason.get(step.name)
            if reason is not None:
                self.recorder.skipped(step.name, None, reason)
                continue
            call = StepCall(self._context(), step, StageRecord(step.name, None))
            results[step.name] = step.run(call, results)

    def _context(self) -> RunContext:
        assert self.context is not None, "Runner.start() first"
        return self.context

    # ----------------------------------------------------------------- the run

    def run(self) -> ExitCode:
        """Run every step; return the exit code (non-zero when anything failed)."""
        run_dir, lock = start_run_directory(self.output_base)
        self.start(run_dir)
        log = self.recorder.log
        log.info("run started", run_dir=str(self.run_dir), inputs=self.inputs)
        log.info(
            "plugins", active=self.manager.plugin_names(), disabled=list(self.manager.disabled)
        )
        # no cyclic collection in the run, its summary or report: it would rescan the millions
        # of acyclic objects a large entry holds, to free nothing (run_steps collects)
        with gc_paused_run():
            try:
                with self.interrupts.handled(), collecting(self.recorder.warnings):
                    for stale in find_stale_runs(self.output_base, exclude=self.run_dir):
                        warn(stale.line(), stale_run_dir=str(stale.run_dir))
                    self.run_steps()
            except (Interrupted, KeyboardInterrupt) as exc:
                name = exc.signal_name if isinstance(exc, Interrupted) else "SIGINT"
                stage, entry = self.recorder.current
                self.interrupted = {"signal": name, "stage": stage, "entry": entry}
                log.error("run interrupted", **self.interrupted)
            except Exception as exc:  # a bug: recorded, so neither summary nor exit code says ok
                self.recorder.crashed(exc)
            finally:  # a SIGTERM now waits for the summary and the report (then ends us)
                with signals_deferred():
                    written = self.write_summary(final=True)
                    self.finished = True
                    code = self.exit_code()
                    self._run_finished(written)
                    release_run_directory(lock)
                    log.info("run finished", exit_code=int(code))
        return code

    def exit_code(self) -> ExitCode:
        if self.interrupted is not None:
            return ExitCode.INTERRUPTED
        if self.recorder.failed() or (self.summary_error is not None and self.finished):
            return ExitCode.STAGE_FAILED
        if self.options.fail_on_divergence and any(
            r.stage == "divergence" and r.counts.get("errors") for r in self.recorder.records
        ):
            return ExitCode.DIVERGENCE
        return ExitCode.OK

    def summary(self, final: bool = False) -> dict[str, Any]:
        return build_summary(
            run_dir=self.run_dir, started=self.started, final=final,
            exit_code=int(self.exit_code()) if final else None, interrupted=self.interrupted,
            inputs=self.inputs, options=self.options, entries=self.entries, skipped=self.skip,
            manager=self.manager, records=self.recorder.records, warnings=self.recorder.warnings,
        )  # fmt: skip

    def _run_finished(self, written: dict[str, Any] | None) -> None:
        """Call every ``opguard_run_finished`` (the report) with the summary ``written``
        (the one in the file), else a final one; a failure is only logged."""
        if self.run_dir is None:
            return
        summary = written if written is not None else self.summary(final=True)
        configs: Mapping[str, Any] = self.context.written_configs if self.context else {}
        for impl in self.manager.implementations("opguard_run_finished"):
            try:
                call_impl(impl, {"run_dir": self.run_dir, "summary": summary, "configs": configs})
            except (KeyboardInterrupt, SystemExit, Exception) as exc:
                if isinstance(exc, KeyboardInterrupt) and self.interrupts.from_user(exc):
                    raise
                error = one_line(failure_reason(exc, None))
                self.recorder.log.error("run_finished failed", plugin=impl.plugin_name, error=error)

    def write_summary(self, final: bool = False) -> dict[str, Any] | None:
        """Rewrite ``pipeline_summary.json``; the summary written, if it was. A failure
        (disk full, ...) never stops the run: it is logged once, retried, and kept in
        ``summary_error`` until a write succeeds."""
        if self.run_dir is None or not self.summary_pace.ready(final):
            return None
        try:
            summary = self.summary(final)
            atomic_write_bytes(safe_child(self.run_dir, SUMMARY_FILE), encode_summary(summary))
        except (OSError, OpGuardError, MemoryError, msgspec.EncodeError) as exc:
            error = one_line(str(exc) or type(exc).__name__)
            if error != self.summary_error:
                self.recorder.log.error("summary not written", file=SUMMARY_FILE, error=error)
            self.summary_error = error
            return None
        self.summary_error = None
        self.summary_pace.wrote()
        return summary


__all__ = ["Runner"]
