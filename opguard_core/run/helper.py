"""An entry's side work in forked helper processes, beside compress and generate.

After the combine, two pieces of an entry's work read the combined trace and feed
nothing the run's own process needs next: encoding and writing
``{name}_combined.json``, and the divergence stage. On a large entry (at least
:data:`OVERLAP_MIN_CALLSITES` distinct callsites, ``--jobs`` other than 1, and a
process that may fork: :func:`opguard_core.run.forked.can_fork`) :class:`EntryHelper`
runs both in a forked child (:class:`~opguard_core.run.forked.ForkedCall`), or each
in one of its own on a very large entry (:data:`SPLIT_MIN_CALLSITES`), while the run
goes on with compress and generate, then records them as if they had run
in-process: the stage's records, warnings and log events come back and are put in
place, a failed or missing write fails the combine stage, an interruption kills the
children and removes what they left half-written. Elsewhere the same work runs
in-process.
"""

from __future__ import annotations

import contextlib
import threading
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from opguard_core.errors import Interrupted, OpGuardError, one_line
from opguard_core.files.atomic import atomic_write_parts, remove_temporaries
from opguard_core.model import StageFailed, StageRecord
from opguard_core.run.forked import ForkedCall, can_fork

if TYPE_CHECKING:
    from opguard_core.combine.accumulator import CallsiteTrace
    from opguard_core.model import InputEntry, RunOptions
    from opguard_core.run.runner import Runner

#: below this many distinct callsites writing the combined trace and the divergence
#: stage take less time than a fork and a summary exchange are worth
OVERLAP_MIN_CALLSITES = 20_000

#: from this many distinct callsites the write and the divergence stage each take
#: about as long as compress and generate: each gets a child of its own, and the two
#: cores share three pieces of work instead of two far apart in size (below it the
#: second fork costs more than it saves: docs/performance.md, "Two helpers")
SPLIT_MIN_CALLSITES = 300_000

#: (logger method, event, fields) of one log call made in the helper
Event = tuple[str, str, dict[str, Any]]


def overlaps(options: RunOptions, trace: CallsiteTrace) -> bool:
    """Whether an entry's side work pays to run in a forked helper."""
    return options.jobs != 1 and len(trace.callsites) >= OVERLAP_MIN_CALLSITES and can_fork()


def write_combined(trace: CallsiteTrace, path: Path) -> str | None:
    """Encode and write the combined trace atomically; the one-line error, or None."""
    try:
        atomic_write_parts(path, trace.json_parts())
    except MemoryError:
        return f"{path.name}: out of memory encoding the combined trace"
    except (OpGuardError, OSError) as exc:
        return one_line(str(exc))
    return None


class EventRecorder:
    """A logger for a forked helper: keeps (method, event, fields) of every call, for
    the parent to log (its logs go where the parent's go, and in order)."""

    def __init__(self, events: list[Event]) -> None:
        self.events = events

    def __getattr__(self, method: str) -> Any:
        def record(event: str, **fields: Any) -> None:
            fields.pop("exc_info", None)  # the exception does not cross processes
            self.events.append((method, event, fields))

        return record


class EntryHelper:
    """One entry's side work running in forked children (see the module docstring)."""

    def __init__(self, runner: Runner, entry: InputEntry, unwritten: Path | None) -> None:
        self.runner = runner
        self.entry = entry
        self.unwritten = unwritten
        #: where the stage's records go in ``runner.records``
        self.slot = len(runner.records)
        #: (child, whether it writes, whether it runs the divergence stage)
        self.jobs: list[tuple[ForkedCall, bool, bool]] = []

    @classmethod
    def start(
        cls,
        runner: Runner,
        entry: InputEntry,
        trace: CallsiteTrace,
        unwritten: Path | None,
        divergence: bool,
    ) -> EntryHelper | None:
        """Write the combined trace to ``unwritten`` (None: the combine wrote it) and
        run the divergence stage (if ``divergence``): in forked children when that
        pays (the combine leaves the write to them only then), else here and now
        (None when nothing was forked). From :data:`SPLIT_MIN_CALLSITES` callsites
        the two get a child each. Raises ``StageFailed`` when the write fails here."""
        helper = cls(runner, entry, unwritten)
        write = unwritten is not None
        if write or (divergence and overlaps(runner.options, trace)):
            if write and divergence and len(trace.callsites) >= SPLIT_MIN_CALLSITES:
                parts = [(True, False), (False, True)]
            else:
                parts = [(write, divergence)]
            for writes, diverges in parts:
                what = f"divergence of {entry.name}" if diverges else f"writing {unwritten}"
                job = ForkedCall.start(partial(helper._work, trace, writes, diverges), what)
                if job is not None:
                    helper.jobs.append((job, writes, diverges))
                    write, divergence = write and not writes, divergence and not diverges
        if write:  # could not fork after all
            assert unwritten is not None
            error = write_combined(trace, unwritten)
            if error is not None:
                helper._combine_failed(error)
                helper.cancel()
                raise StageFailed(error)
        if divergence:
            with contextlib.suppress(StageFailed):  # later stages do not need it
                runner.divergence_stage(entry, trace)
        return helper if helper.jobs else None

    def _work(
        self, trace: CallsiteTrace, write: bool, diverge: bool
    ) -> tuple[str | None, list[Any], list[Any], list[Event]]:
        """In a forked child: the write and/or the divergence stage; what they left.
        Both: the write runs in a thread beside the stage, so that its waits on the
        disk (the writes, the fsync: 0.19 of its 0.46 s at 4 x 160k) overlap the
        stage's work instead of adding to it."""
        runner = self.runner
        runner.in_helper = True  # the parent alone writes the summary
        events: list[Event] = []
        runner.log = EventRecorder(events)
        mark = len(runner.warnings)
        written: list[str | None] = [None]
        raised: list[BaseException] = []  # what the write raised, raised again here
        writer: threading.Thread | None = None
        if write:
            assert self.unwritten is not None
            path = self.unwritten

            def write_it() -> None:
                try:
                    written[0] = write_combined(trace, path)
                except BaseException as exc:
                    raised.append(exc)

            if diverge:
                writer = threading.Thread(target=write_it, name="opguard-write")
                writer.start()
            else:
                write_it()
        if diverge:
            with contextlib.suppress(StageFailed):
                runner.divergence_stage(self.entry, trace)
        if writer is not None:
            writer.join()
        if raised:
            raise raised[0]
        return written[0], runner.records[self.slot :], runner.warnings[mark:], events

    def finish(self) -> None:
        """Wait for the children (or kill them when the run is being interrupted) and
        record their work as if it had run in-process. A failed write of the combined
        trace fails the combine stage (compress and generate, which read the trace in
        memory, have run)."""
        runner, name = self.runner, self.entry.name
        error: str | None = None
        records: list[Any] = []
        warnings: list[Any] = []
        events: list[Event] = []
        for job, writes, diverges in self.jobs:
            try:
                job_error, job_records, job_warnings, job_events = job.result()
            except (KeyboardInterrupt, Interrupted):
                self.cancel()
                raise
            except OpGuardError as exc:
                failure = one_line(str(exc))
                # the write is atomic: the file exists only if it was written whole
                exists = self.unwritten is not None and self.unwritten.exists()
                job_error = failure if writes and not exists else None
                job_records, job_warnings, job_events = [], [], []
                if diverges:
                    job_records = [StageRecord("divergence", name, status="failed", error=failure)]
                    job_events = [("error", "stage failed", {"plugin": None, "error": failure})]
            error = error or job_error
            records += job_records
            warnings += job_warnings
            events += job_events
        with structlog.contextvars.bound_contextvars(stage="divergence", entry=name):
            for method, event, fields in events:
                getattr(runner.log, method)(event, **fields)
        runner.records[self.slot : self.slot] = records
        runner.warnings.extend(warnings)
        if error is not None:
            self._combine_failed(error)
        runner.write_summary()

    def cancel(self) -> None:
        """Kill the children; a combined trace not written yet is not claimed."""
        for job, _, _ in self.jobs:
            job.cancel()
        writing = any(writes for _, writes, _ in self.jobs)
        if writing and self.unwritten is not None and not self.unwritten.exists():
            remove_temporaries(self.unwritten)
            self._combine_failed(f"interrupted before {self.unwritten.name} was written")

    def _combine_failed(self, error: str) -> None:
        """The combine stage's record, once ``ok``, failed by its deferred write."""
        name = self.entry.name
        for record in self.runner.records:
            if record.stage == "combine" and record.entry == name:
                record.status, record.error, record.outputs = "failed", error, []
        with structlog.contextvars.bound_contextvars(stage="combine", entry=name):
            self.runner.log.error("stage failed", plugin=None, error=error)
