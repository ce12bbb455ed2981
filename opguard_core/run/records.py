"""What a run records: one :class:`~opguard_core.model.StageRecord` per stage and entry,
the run's warnings, and the log events that go with them.

:class:`Recorder` times a stage, turns its failure into one line (and
:class:`~opguard_core.model.StageFailed` for the runner), and says after each stage
that the summary should be rewritten. A forked helper records into a capturing
recorder of its own (:meth:`Recorder.capturing`) and hands back what it recorded,
which the parent puts in place (:meth:`Recorder.absorb`): the helper never touches
the parent's state.
"""

from __future__ import annotations

import contextlib
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import structlog

from opguard_core.errors import Interrupted, OpGuardError, PluginError, ended_by_plugin, one_line
from opguard_core.logs import get_logger
from opguard_core.model import StageFailed, StageRecord

#: (logger method, event, fields) of one log call made in a helper
Event = tuple[str, str, dict[str, Any]]


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


class Recorder:
    """The records, warnings and log of one run (or of one helper's share of it)."""

    def __init__(
        self,
        verbose: bool = False,
        on_change: Callable[[], object] = lambda: None,
        is_user_interrupt: Callable[[KeyboardInterrupt], bool] = lambda exc: True,
    ) -> None:
        self.records: list[StageRecord] = []
        #: run warnings (opguard_core.run.warnings), also in the summary
        self.warnings: list[dict[str, Any]] = []
        self.log: Any = get_logger()
        self.verbose = verbose
        #: called after every change worth a new summary
        self.on_change = on_change
        #: whether a KeyboardInterrupt came from the user (SIGINT), not from a plugin
        self.is_user_interrupt = is_user_interrupt
        #: the stage and entry running now, for the summary of an interrupted run
        self.current: tuple[str, str | None] = ("setup", None)
        #: whether a stage failed by a plugin's fault (a :class:`PluginError`, or a
        #: plugin that raised ``SystemExit`` or ``KeyboardInterrupt``), not its input's
        self.plugin_failed = False

    def capturing(self) -> tuple[Recorder, list[Event]]:
        """A recorder for a forked helper: same settings, its own records, warnings and
        a log that keeps its events (returned with it)."""
        events: list[Event] = []
        child = Recorder(self.verbose, is_user_interrupt=self.is_user_interrupt)
        child.log = EventRecorder(events)
        return child, events

    def absorb(
        self,
        slot: int,
        records: list[StageRecord],
        warnings: list[dict[str, Any]],
        events: list[Event],
        stage: str,
        entry: str,
    ) -> None:
        """Put a helper's records at ``slot``, its warnings after ours, and log its
        events as if they had happened here, in ``stage`` of ``entry``."""
        with structlog.contextvars.bound_contextvars(stage=stage, entry=entry):
            for method, event, fields in events:
                getattr(self.log, method)(event, **fields)
        self.records[slot:slot] = records
        self.warnings.extend(warnings)
        self.on_change()

    def skipped(self, stage: str, entry: str | None, reason: str) -> None:
        self.records.append(StageRecord(stage, entry, status="skipped", error=reason))
        self.log.info("stage skipped", stage=stage, entry=entry, reason=reason)
        self.on_change()

    def refused(self, spec: str, error: str) -> None:
        """An input ``discover`` refused (``spec``, as given): a failed record, logged."""
        error = one_line(error)
        self.records.append(StageRecord("discover", spec, "failed", error=error))
        self.log.error("input refused", stage="discover", input=spec, error=error)

    def fail(self, stage: str, entry: str | None, error: str) -> None:
        """Mark the ``ok`` record of ``stage`` failed after the fact (a deferred write
        of it failed), and log it."""
        for record in self.records:
            if record.stage == stage and record.entry == entry:
                record.status, record.error, record.outputs = "failed", error, []
        with structlog.contextvars.bound_contextvars(stage=stage, entry=entry):
            self.log.error("stage failed", plugin=None, error=error)

    def crashed(self, exc: Exception) -> None:
        """Record an error no stage caught (a bug of ours: the run stops) as a failure
        of the stage where the run was, and log it (its traceback with ``--verbose``)."""
        stage, entry = self.current
        error = one_line(f"internal error: {type(exc).__name__}: {exc}")
        self.records.append(StageRecord(stage, entry, status="failed", error=error))
        with structlog.contextvars.bound_contextvars(stage=stage, entry=entry):
            self.log.error("run failed", error=error, exc_info=exc if self.verbose else False)

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
                record.seconds = round(time.perf_counter() - started, 6)
                if isinstance(exc, Interrupted) or (
                    isinstance(exc, KeyboardInterrupt) and self.is_user_interrupt(exc)
                ):
                    record.status = "interrupted"
                    self.records.append(record)
                    raise
                record.status = "failed"
                record.error = one_line(failure_reason(exc, record))
                if isinstance(exc, PluginError | SystemExit | KeyboardInterrupt):
                    self.plugin_failed = True
                self.records.append(record)
                self.log.error(
                    "stage failed", plugin=record.plugin, error=record.error, exc_info=self.verbose
                )
                if self.verbose and not isinstance(exc, OpGuardError):
                    self.log.debug("traceback", traceback=traceback.format_exc())
                self.on_change()
                raise StageFailed(record.error) from exc
            record.seconds = round(time.perf_counter() - started, 6)
            self.records.append(record)
            scalars = {k: v for k, v in record.counts.items() if not isinstance(v, list | dict)}
            self.log.info("stage done", seconds=record.seconds, **scalars)
            self.log.debug("stage detail", plugin=record.plugin, outputs=record.outputs)
            self.on_change()

    def failed(self) -> bool:
        return any(r.status == "failed" for r in self.records)


def failure_reason(exc: BaseException, record: StageRecord | None) -> str:
    """What a failed stage's record (and the log) says about ``exc``: an
    :class:`OpGuardError`'s own line; for a plugin that tried to end the process,
    which one; a MemoryError names the stage's inputs."""
    plugin = f" by plugin {record.plugin}" if record is not None and record.plugin else ""
    if isinstance(exc, SystemExit):
        return ended_by_plugin(exc.code, record.plugin if record is not None else None)
    if isinstance(exc, KeyboardInterrupt):
        return f"KeyboardInterrupt raised{plugin} without a SIGINT"
    if isinstance(exc, OpGuardError):
        return str(exc)
    if isinstance(exc, MemoryError):
        inputs = ", ".join(record.inputs) if record is not None and record.inputs else "?"
        return f"out of memory{plugin} (inputs: {inputs})"
    return f"{type(exc).__name__}: {exc}"


__all__ = ["Event", "EventRecorder", "Recorder", "failure_reason"]
