"""An entry's side work in a forked helper process, beside compress and generate.

After the combine, two pieces of an entry's work read the combined trace and feed
nothing the run's own process needs next: encoding and writing
``{name}_combined.json``, and the divergence stage. On a large entry (at least
:data:`OVERLAP_MIN_CALLSITES` distinct callsites, ``--jobs`` other than 1, and a
process that may fork: :func:`opguard_core.forked.can_fork`) :class:`EntryHelper`
runs both in a forked child (:class:`~opguard_core.forked.ForkedCall`) while the
run goes on with compress and generate, then records them as if they had run
in-process: the stage's records, warnings and log events come back and are put in
place, a failed or missing write fails the combine stage, an interruption kills the
child and removes what it left half-written. Elsewhere the same work runs in-process.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from opguard_core.atomic import atomic_write_bytes, remove_temporaries
from opguard_core.errors import Interrupted, OpGuardError, one_line
from opguard_core.forked import ForkedCall, can_fork
from opguard_core.model import StageFailed, StageRecord

if TYPE_CHECKING:
    from opguard_core.combined import CallsiteTrace
    from opguard_core.model import InputEntry, RunOptions
    from opguard_core.runner import Runner

#: below this many distinct callsites writing the combined trace and the divergence
#: stage take less time than a fork and a summary exchange are worth
OVERLAP_MIN_CALLSITES = 20_000

#: (logger method, event, fields) of one log call made in the helper
Event = tuple[str, str, dict[str, Any]]


def overlaps(options: RunOptions, trace: CallsiteTrace) -> bool:
    """Whether an entry's side work pays to run in a forked helper."""
    return options.jobs != 1 and len(trace.callsites) >= OVERLAP_MIN_CALLSITES and can_fork()


def write_combined(trace: CallsiteTrace, path: Path) -> str | None:
    """Encode and write the combined trace atomically; the one-line error, or None."""
    try:
        atomic_write_bytes(path, trace.to_json())
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
    """One entry's side work running in a forked child (see the module docstring)."""

    def __init__(
        self, runner: Runner, entry: InputEntry, unwritten: Path | None, divergence: bool
    ) -> None:
        self.runner = runner
        self.entry = entry
        self.unwritten = unwritten
        self.divergence = divergence
        #: where the stage's records go in ``runner.records``
        self.slot = len(runner.records)
        self.job: ForkedCall | None = None

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
        run the divergence stage (if ``divergence``): in a forked child when that pays
        (the combine leaves the write to it only then), else here and now (None).
        Raises ``StageFailed`` when the write fails here."""
        helper = cls(runner, entry, unwritten, divergence)
        if unwritten is not None or (divergence and overlaps(runner.options, trace)):
            what = f"divergence of {entry.name}" if divergence else f"writing {unwritten}"
            helper.job = ForkedCall.start(lambda: helper._work(trace), what)
        if helper.job is not None:
            return helper
        if unwritten is not None:  # could not fork after all
            error = write_combined(trace, unwritten)
            if error is not None:
                helper._combine_failed(error)
                raise StageFailed(error)
        if divergence:
            with contextlib.suppress(StageFailed):  # later stages do not need it
                runner.divergence_stage(entry, trace)
        return None

    def _work(self, trace: CallsiteTrace) -> tuple[str | None, list[Any], list[Any], list[Event]]:
        """In the forked child: the write, then the divergence stage; what they left."""
        runner = self.runner
        runner.in_helper = True  # the parent alone writes the summary
        events: list[Event] = []
        runner.log = EventRecorder(events)
        mark = len(runner.warnings)
        error = None if self.unwritten is None else write_combined(trace, self.unwritten)
        if self.divergence:
            with contextlib.suppress(StageFailed):
                runner.divergence_stage(self.entry, trace)
        return error, runner.records[self.slot :], runner.warnings[mark:], events

    def finish(self) -> None:
        """Wait for the child (or kill it when the run is being interrupted) and record
        its work as if it had run in-process. A failed write of the combined trace
        fails the combine stage (compress and generate, which read the trace in
        memory, have run)."""
        assert self.job is not None
        runner, name = self.runner, self.entry.name
        try:
            error, records, warnings, events = self.job.result()
        except (KeyboardInterrupt, Interrupted):
            self.cancel()
            raise
        except OpGuardError as exc:
            failure = one_line(str(exc))
            # the write is atomic: the file exists only if it was written whole
            error = None if self.unwritten is None or self.unwritten.exists() else failure
            records, warnings, events = [], [], []
            if self.divergence:
                records = [StageRecord("divergence", name, status="failed", error=failure)]
                events = [("error", "stage failed", {"plugin": None, "error": failure})]
        with structlog.contextvars.bound_contextvars(stage="divergence", entry=name):
            for method, event, fields in events:
                getattr(runner.log, method)(event, **fields)
        runner.records[self.slot : self.slot] = records
        runner.warnings.extend(warnings)
        if error is not None:
            self._combine_failed(error)
        runner.write_summary()

    def cancel(self) -> None:
        """Kill the child; a combined trace it had not written yet is not claimed."""
        assert self.job is not None
        self.job.cancel()
        if self.unwritten is not None and not self.unwritten.exists():
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
