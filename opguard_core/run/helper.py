"""An entry's side work in forked helper processes, beside the main line of its steps.

After a step such as combine, two pieces of an entry's work feed nothing the run's
own process needs next: the step's deferred writes (encoding and writing
``{name}_combined.json``) and the side steps that read its result (divergence). On a
large entry (at least :data:`OVERLAP_MIN_CALLSITES`, ``--jobs`` other than 1, and a
process that may fork: :func:`opguard_core.run.forked.can_fork`) :class:`EntryHelper`
runs both in a forked child (:class:`~opguard_core.run.forked.ForkedCall`), or each in
one of its own on a very large entry (:data:`SPLIT_MIN_CALLSITES`), while the run goes
on with compress and generate. It then records them as if they had run in-process:
the side steps' records, warnings and log events come back and are put in place
(:meth:`~opguard_core.run.records.Recorder.absorb`), a failed or missing write fails
the step that deferred it, an interruption records the children that had ended, kills
the others and removes what they left half-written. Elsewhere the same work runs in-process.

The helper knows no stage: it gets the writes, a function that runs the side steps
with a given recorder, and the names to say what it does.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

from opguard_core.errors import Interrupted, OpGuardError, one_line
from opguard_core.files.atomic import TMP_SUFFIX, remove_temporaries
from opguard_core.model import RunOptions, StageFailed, StageRecord
from opguard_core.run.forked import ForkedCall, can_fork
from opguard_core.run.records import Event, Recorder
from opguard_core.run.steps import Write
from opguard_core.run.warnings import collecting

#: below this many distinct callsites writing the combined trace and the divergence
#: stage take less time than a fork and a summary exchange are worth
OVERLAP_MIN_CALLSITES = 20_000

#: from this many distinct callsites the write and the divergence stage each take
#: about as long as compress and generate: each gets a child of its own, and the two
#: cores share three pieces of work instead of two far apart in size (below it the
#: second fork costs more than it saves: docs/performance.md, "Two helpers")
SPLIT_MIN_CALLSITES = 300_000

#: runs an entry's side steps, recording into the recorder it is given
SideWork = Callable[[Recorder], None]


def overlaps(options: RunOptions, size: int) -> bool:
    """Whether an entry's side work pays to run in a forked helper."""
    return options.jobs != 1 and size >= OVERLAP_MIN_CALLSITES and can_fork()


def perform(writes: list[Write]) -> str | None:
    """Do ``writes`` (atomically, in order); the one-line error of the first that
    failed, or None."""
    for write in writes:
        try:
            write.perform()
        except MemoryError:
            return f"{write.path.name}: out of memory encoding it"
        except (OpGuardError, OSError) as exc:
            return one_line(str(exc))
    return None


class EntryHelper:
    """One entry's side work running in forked children (see the module docstring)."""

    def __init__(
        self,
        recorder: Recorder,
        entry: str,
        owner: str,
        writes: list[Write],
        sides: tuple[str, ...],
    ) -> None:
        self.recorder = recorder
        self.entry = entry
        #: the side steps' names
        self.sides = sides
        #: the step whose writes these are (failed if they fail)
        self.owner = owner
        self.writes = writes
        #: where the side steps' records go in ``recorder.records``
        self.slot = len(recorder.records)
        #: (child, whether it writes, whether it runs the side steps)
        self.jobs: list[tuple[ForkedCall, bool, bool]] = []

    @classmethod
    def start(
        cls,
        recorder: Recorder,
        entry: str,
        owner: str,
        writes: list[Write],
        side: tuple[tuple[str, ...], SideWork] | None,
        size: int,
        options: RunOptions,
    ) -> EntryHelper | None:
        """Do ``writes`` (of step ``owner``) and run the ``side`` steps (their names,
        and the function that runs them): in forked children when the entry's ``size``
        makes that pay (:func:`overlaps`; a child each from :data:`SPLIT_MIN_CALLSITES`),
        else, or where this process may not fork, here and now. None when nothing was
        forked. Raises ``StageFailed`` when a write fails here."""
        helper = cls(recorder, entry, owner, writes, side[0] if side else ())
        write, diverge = bool(writes), side is not None
        split = size >= SPLIT_MIN_CALLSITES
        if overlaps(options, size) and (write or diverge):
            parts = [(True, False), (False, True)] if split and write and diverge else None
            for writes_here, side_here in parts or [(write, diverge)]:
                what = (
                    f"{'/'.join(helper.sides)} of {entry}"
                    if side_here
                    else f"writing {writes[0].path}"
                )
                work = partial(helper._work, side[1] if side_here and side else None, writes_here)
                job = ForkedCall.start(work, what)
                if job is not None:
                    helper.jobs.append((job, writes_here, side_here))
                    write, diverge = write and not writes_here, diverge and not side_here
        if write:  # not forked
            error = perform(writes)
            if error is not None:
                helper.cancel()
                recorder.fail(owner, entry, error)
                raise StageFailed(error)
        if diverge and side is not None:
            side[1](recorder)
        return helper if helper.jobs else None

    def _work(
        self, side: SideWork | None, write: bool
    ) -> tuple[str | None, list[StageRecord], list[Any], list[Event]]:
        """In a forked child: the writes and/or the side steps; what they left. Both:
        the writes run in a thread beside the steps, so that their waits on the disk
        (the writes, the fsync: 0.19 of 0.46 s at 4 x 160k) overlap the steps' work."""
        recorder, events = self.recorder.capturing()
        written: list[str | None] = [None]
        raised: list[BaseException] = []  # what the writes raised, raised again here
        writer: threading.Thread | None = None
        if write:

            def write_them() -> None:
                try:
                    written[0] = perform(self.writes)
                except BaseException as exc:
                    raised.append(exc)

            if side is not None:
                writer = threading.Thread(target=write_them, name="opguard-write")
                writer.start()
            else:
                write_them()
        if side is not None:
            with collecting(recorder.warnings):
                side(recorder)
        if writer is not None:
            writer.join()
        if raised:
            raise raised[0]
        return written[0], recorder.records, recorder.warnings, events

    def finish(self) -> None:
        """Wait for the children (or kill them when the run is being interrupted) and
        record their work as if it had run in-process. A failed write fails the step
        that deferred it (the steps that read its result in memory have run)."""
        # where a signal finds the run now: waiting for them, not in its last step
        self.recorder.current = (self.sides[0] if self.sides else self.owner, self.entry)
        self._collect(self.jobs)

    def _collect(self, jobs: list[tuple[ForkedCall, bool, bool]]) -> None:
        """Wait for ``jobs`` and record what they did (see :meth:`finish`); interrupted,
        what came back so far is recorded and the rest is cancelled."""
        error: str | None = None
        records: list[StageRecord] = []
        warnings: list[Any] = []
        events: list[Event] = []
        died = False
        try:
            for job, writes, sides in jobs:
                try:
                    job_error, job_records, job_warnings, job_events = job.result()
                except OpGuardError as exc:
                    died = True
                    failure = one_line(str(exc))
                    # the writes are atomic: the file exists only if it was written whole
                    job_error = failure if writes and not self._written() else None
                    job_records, job_warnings, job_events = [], [], []
                    if sides:
                        job_records = [
                            StageRecord(s, self.entry, status="failed", error=failure)
                            for s in self.sides
                        ]
                        job_events = [("error", "stage failed", {"plugin": None, "error": failure})]
                error = error or job_error
                records += job_records
                warnings += job_warnings
                events += job_events
        except (KeyboardInterrupt, Interrupted):
            self._record(records, warnings, events, error)
            self.cancel()
            raise
        if died:
            self._remove_temporaries()
        self._record(records, warnings, events, error)

    def _record(
        self, records: list[StageRecord], warnings: list[Any], events: list[Event],
        error: str | None,
    ) -> None:  # fmt: skip
        stage = self.sides[0] if self.sides else self.owner
        self.recorder.absorb(self.slot, records, warnings, events, stage, self.entry)
        if error is not None:
            self.recorder.fail(self.owner, self.entry, error)
            self.recorder.on_change()

    def _remove_temporaries(self) -> None:
        """Once every child is reaped: the temporary files a child that died (killed,
        ``os._exit``) left half-written in the run directory, its own writes' and its
        side steps' (whose names the helper does not know). Nothing else writes there
        now: the run waits here, and an entry's helpers are done before the next's."""
        for directory in {w.path.parent for w in self.writes}:
            with contextlib.suppress(OSError):
                for leftover in directory.glob(f".*{TMP_SUFFIX}"):
                    with contextlib.suppress(OSError):
                        leftover.unlink()

    def _written(self) -> bool:
        return all(w.path.exists() for w in self.writes)

    def cancel(self) -> None:
        """Kill the children; a file not written yet is not claimed. A child that had
        already ended is recorded as if it had been waited for: its work is done, its
        files are whole, and an in-process run would have recorded them."""
        ended = [job for job in self.jobs if job[0].ended()]
        killed = [job for job in self.jobs if job not in ended]
        for job, _, _ in killed:
            job.cancel()
        if killed:  # what they left half-written: their side steps' files too
            self._remove_temporaries()
        if ended:
            self._collect(ended)
        writing = any(writes for _, writes, _ in self.jobs)
        unwritten = [w.path for w in self.writes if not w.path.exists()]
        if writing and unwritten:
            for path in unwritten:
                with contextlib.suppress(OSError):
                    remove_temporaries(path)
            self.recorder.fail(
                self.owner, self.entry, f"interrupted before {unwritten[0].name} was written"
            )


__all__ = ["OVERLAP_MIN_CALLSITES", "SPLIT_MIN_CALLSITES", "EntryHelper", "overlaps"]
