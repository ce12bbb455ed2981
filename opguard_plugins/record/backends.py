"""Tracer backends by name, and the two ways to run one: around a block and for a process.

:func:`trace_callsites` traces the ``with`` block it wraps; :func:`start_process_tracer`
traces a whole process from the moment torch is imported (``opguard trace``'s
bootstrap) and writes at exit, leaving a marker file while it runs. Both make their
tracer with :func:`make_tracer`: the ``modes`` backend
(:mod:`opguard_plugins.record.tracer`) or the ``profiler`` one
(:mod:`opguard_plugins.record.profiler`), which builds on it. ``trace_callsites`` is
public as ``opguard_plugins.tracer.trace_callsites``.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from opguard_core.processes import at_sigterm, multiprocessing_child, signals_deferred
from opguard_plugins.record import tracer as tracer_module
from opguard_plugins.record.flush import SPLIT_ENV, flush_settings, partial_marker
from opguard_plugins.record.tracer import CallsiteTracer, _gc_paused, _is_launcher


@contextmanager
def trace_callsites(
    label: str = "trace",
    output_dir: str | os.PathLike[str] = ".",
    rank: int | None = None,
    *,
    backend: str = "modes",
    split: bool = True,
    **extra_meta: Any,
) -> Iterator[CallsiteTracer]:
    """Trace the torch operators run inside the ``with`` block; write the trace on exit.

    ::

        from opguard_plugins.tracer import trace_callsites

        with trace_callsites(label="mine", output_dir="traces") as tracer:
            for step in range(3):
                train_step(...)
        print(tracer.written)   # traces/mine_callsite_rank0.json

    :param label: the ``{label}`` in the file name and ``meta.label``.
    :param output_dir: directory for the trace (created if missing).
    :param rank: the rank to record; by default torch.distributed's rank (if the
        default group exists at exit, or existed when a collective ran), else
        ``$RANK``, else 0.
    :param backend: ``modes`` (Python modes) or ``profiler`` (torch's profiler;
        :mod:`opguard_plugins.record.profiler`), see docs/tracing.md.
    :param split: once the first optimizer step has ended, write what ran up to its end
        (construction, initialisation, the first step) to ``{label}_setup_rank{R}.json``
        and the loop to the trace file (docs/tracing.md, "Set-up and loop"); False:
        one file for the whole block.
    :param extra_meta: more keys for the trace's ``meta``.

    A block left by an exception (not ``SystemExit``) writes its trace marked partial
    (``meta.partial``, as ``opguard trace`` marks a process that died of one), then the
    exception goes on.
    """
    tracer = make_tracer(backend, label, output_dir, rank=rank, extra_meta=extra_meta)
    tracer.split_setup = split
    tracer.start()
    try:
        yield tracer
    except BaseException as exc:  # the block ended early: the trace says so, then it goes on
        tracer.stop()
        tracer.write(partial=ended_by(type(exc), tracer.steps_done))
        raise
    tracer.stop()
    tracer.write()


def ended_by(kind: type[BaseException], steps: int) -> dict[str, Any] | None:
    """``meta.partial`` of tracing ended by an exception of ``kind`` after ``steps``
    optimizer steps: ``sigint`` for a KeyboardInterrupt, else ``exception`` with its
    class name; None for ``SystemExit`` (``sys.exit`` ends a complete record)."""
    if issubclass(kind, SystemExit):
        return None
    if issubclass(kind, KeyboardInterrupt):
        return partial_marker("sigint", steps)
    return partial_marker("exception", steps, exception=kind.__name__)


# ---------------------------------------------------------------------------
# Whole-process tracing (used by `opguard trace`)
# ---------------------------------------------------------------------------

_PROCESS_TRACER: CallsiteTracer | None = None
_FORK_HOOK_INSTALLED = False
#: a traced process announces itself with an empty marker file in the output
#: directory and removes it once it has written (or decided not to write) its trace;
#: a marker left behind tells ``opguard trace`` that a process ended without running
#: its exit handlers (``os._exit``, a signal), so its operators were lost
MARKER_SUFFIX = ".tracing"


def marker_path(output_dir: str | os.PathLike[str], label: str, pid: int) -> Path:
    """The marker of traced process ``pid`` (see :data:`MARKER_SUFFIX`)."""
    return Path(output_dir) / f".{label}_callsite.{pid}{MARKER_SUFFIX}"


def fork_label(label: str, pid: int) -> str:
    """The label a forked child writes under: ``{label}.fork{pid}``, so that no two
    processes write the same file (the child inherits its parent's rank)."""
    return f"{label}.fork{pid}"


#: the pid this process was forked from (None: not a forked child); in its marker
_FORKED_FROM: int | None = None


def _write_marker(
    tracer: CallsiteTracer,
    parent: int | None,
    *,
    flushed: Path | None = None,
    error: str | None = None,
) -> None:
    """Write (or rewrite) this process's marker: its pid, its rank where the launcher
    says (``$RANK``: torchrun sets it before the process starts), the parent it was
    forked from, whether multiprocessing started it (``helper``), its label, the last
    partial trace flushed and why writing failed."""
    path = marker_path(tracer.output_dir, tracer.base_label, os.getpid())
    info: dict[str, Any] = {"pid": os.getpid(), "forked_from": parent, "label": tracer.label}
    rank = os.environ.get("RANK", "")
    if rank.isdigit():
        info["rank"] = int(rank)
    if multiprocessing_child():
        info["helper"] = True
    if flushed is not None:
        info["flushed"] = str(flushed)
    if error is not None:
        info["error"] = error
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(info) + "\n")
    tracer.marker = path


def _remove_marker(tracer: CallsiteTracer) -> None:
    if tracer.marker is not None:
        with contextlib.suppress(OSError):
            tracer.marker.unlink()
        tracer.marker = None


def _after_fork_in_child() -> None:
    """A forked child traces on (its modes are inherited) but records only its own ops,
    under its own file name, with fresh locks."""
    tracer = _PROCESS_TRACER
    if tracer is None:
        return
    global _FORKED_FROM
    if tracer_module.GC_PAUSED:  # forked while the flusher copied the counts
        tracer_module.GC_PAUSED = False
        gc.enable()
    parent = _FORKED_FROM = os.getppid()
    tracer.recorder.reset_after_fork()
    tracer.writing = threading.RLock()  # the parent's flusher may have held it
    tracer.label = fork_label(tracer.base_label, os.getpid())
    tracer.marker = None
    _write_marker(tracer, parent)
    state = _STATE
    if state is not None and not state.finished:
        state.flushed = None
        state.start_flusher()  # threads do not survive a fork


#: Tracer backends by name (``opguard trace --backend NAME``); the first is the default.
BACKENDS = ("modes", "profiler")


def make_tracer(backend: str, *args: Any, **kwargs: Any) -> CallsiteTracer:
    """A tracer of the named backend (``modes`` or ``profiler``)."""
    if backend == "modes":
        return CallsiteTracer(*args, **kwargs)
    if backend == "profiler":
        from opguard_plugins.record.profiler import ProfilerTracer

        return ProfilerTracer(*args, **kwargs)
    raise ValueError(f"unknown tracer backend {backend!r} (choose from {', '.join(BACKENDS)})")


class _ProcessState:
    """The whole-process tracer's life: why its trace is partial, its flusher, done."""

    def __init__(self, seconds: float, steps: int) -> None:
        self.seconds = seconds
        self.steps = steps
        #: ``meta.partial`` of the trace written at exit: set by SIGTERM or an
        #: uncaught exception (the program did not run to its end)
        self.ended: dict[str, Any] | None = None
        self.finished = False
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.flush_failed = False
        #: what the last flush wrote (:func:`_seen`)
        self.flushed: tuple[int, int, int] | None = None

    def start_flusher(self) -> None:
        if self.seconds > 0:
            self.stop = threading.Event()
            self.thread = threading.Thread(
                target=self._loop, name="opguard-trace-flush", daemon=True
            )
            self.thread.start()

    def _loop(self) -> None:
        stop = self.stop
        wait = self.seconds
        while not stop.wait(wait):
            started = time.monotonic()
            _flush("flush", blocking=False)
            # a flush holds the GIL while it builds the trace: never more than
            # 1 / FLUSH_SHARE of the time between flushes (a huge trace waits longer)
            wait = max(self.seconds, (time.monotonic() - started) * FLUSH_SHARE)


_STATE: _ProcessState | None = None
#: a periodic flush waits at least this many times as long as the last one took
FLUSH_SHARE = 100


def _flush(reason: str, blocking: bool = True) -> Path | None:
    """Write the process's trace now, marked partial, while it goes on; None when
    there is nothing (new) to write or the tracer is busy (``blocking=False``)."""
    tracer, state = _PROCESS_TRACER, _STATE
    if tracer is None or state is None or state.finished:
        return None
    if not tracer.writing.acquire(blocking=blocking):
        return None
    try:
        with tracer.quiesced() as ready:
            if not ready or state.finished:
                return None
            seen = _seen(tracer)
            if not seen[0] or (seen == state.flushed and reason == "flush"):  # nothing new
                return None
            state.flushed = seen
            path = tracer.write(partial=partial_marker(reason, tracer.steps_done))
        _write_marker(tracer, _FORKED_FROM, flushed=path)
        return path
    except Exception as exc:  # never disturb the program
        if not state.flush_failed:
            state.flush_failed = True
            print(f"opguard trace: could not flush the trace: {exc}", file=sys.stderr)
        return None
    finally:
        tracer.writing.release()


def _seen(tracer: CallsiteTracer) -> tuple[int, int, int]:
    """(callsites, operator calls, steps) recorded so far: what a flush compares."""
    with tracer.recorder._lock, _gc_paused():
        counts = tracer.recorder.counts
        return len(counts), sum(counts.values()), tracer.steps_done


def _on_step(steps: int) -> None:
    state = _STATE
    if state is not None and state.steps and steps % state.steps == 0:
        with signals_deferred():  # a SIGTERM waits for the flush, not leaves its temporary
            _flush("flush")


def _on_sigterm(ends: bool) -> None:
    """SIGTERM: the trace is written now, marked partial; when the process ends with
    the signal (no handler of the program's) this is its final trace."""
    tracer, state = _PROCESS_TRACER, _STATE
    if tracer is None or state is None:
        return
    state.ended = partial_marker("sigterm", tracer.steps_done)
    if ends:
        _finish_process_tracer()
    else:
        _flush("sigterm")


def _note_uncaught(previous: Any) -> Any:
    """A ``sys.excepthook`` that marks the trace partial, then calls ``previous``."""

    def excepthook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        tracer, state = _PROCESS_TRACER, _STATE
        if tracer is not None and state is not None and state.ended is None:
            state.ended = ended_by(kind, tracer.steps_done)
        previous(kind, value, tb)

    return excepthook


def start_process_tracer(label: str, output_dir: str) -> CallsiteTracer | None:
    """Trace this whole process from now on and write the trace at interpreter exit.

    Called by the ``sitecustomize`` bootstrap once torch is imported. Does nothing in
    torchrun's launcher (it runs no model code and would otherwise claim rank 0), and
    writes nothing if no operator ran. The trace is also written, marked partial
    (``meta.partial``), on SIGTERM (then the process dies of it, or the program's own
    handler runs), every ``$OPGUARD_TRACE_FLUSH_SECONDS`` seconds (default 30) from a
    thread and every ``$OPGUARD_TRACE_FLUSH_STEPS`` optimizer steps (default none):
    a SIGKILL loses at most what ran since the last flush. After an uncaught
    exception (SIGINT's ``KeyboardInterrupt`` included) the trace written at exit is
    marked partial too.
    """
    global _PROCESS_TRACER, _STATE
    if _PROCESS_TRACER is not None or _is_launcher():
        return _PROCESS_TRACER
    global _FORK_HOOK_INSTALLED
    tracer = make_tracer(os.environ.get("OPGUARD_TRACE_BACKEND") or BACKENDS[0], label, output_dir)
    # the imports after torch's are not the program's ops: the profiler's first cycle
    # starts at the first torch call (profiler.py)
    tracer.start_at_first_call = True
    tracer.split_setup = os.environ.get(SPLIT_ENV, "1") != "0"
    seconds, steps = flush_settings()
    state = _ProcessState(seconds, steps)
    tracer.on_step = _on_step
    tracer.start()
    _PROCESS_TRACER, _STATE = tracer, state
    _write_marker(tracer, None)
    atexit.register(_finish_process_tracer)
    at_sigterm(_on_sigterm)
    sys.excepthook = _note_uncaught(sys.excepthook)
    state.start_flusher()
    if not _FORK_HOOK_INSTALLED:
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _FORK_HOOK_INSTALLED = True
    return tracer


def _finish_process_tracer() -> None:
    tracer, state = _PROCESS_TRACER, _STATE
    if tracer is None or state is None:
        return
    state.stop.set()
    # a flush in progress finishes first; but a signal handler may have interrupted this
    # very thread inside the recorder, whose lock that flush then waits for: go on
    # without it after a while (the counts' own lock is re-entrant)
    acquired = tracer.writing.acquire(timeout=10)
    try:
        # a SIGTERM now (torchrun tearing down the job as this rank exits) would find
        # the trace "finished" and end the process half-way through writing it: it
        # waits for the write, then does what it does
        with signals_deferred():
            _finish(tracer, state)
    finally:
        if acquired:
            tracer.writing.release()


def _finish(tracer: CallsiteTracer, state: _ProcessState) -> None:
    """Stop, write the final trace (partial if the program did not run to its end)."""
    if state.finished:
        return
    state.finished = True
    try:
        tracer.stop()
    except Exception as exc:
        print(f"opguard trace: could not stop tracing cleanly: {exc!r}", file=sys.stderr)
    try:
        if not tracer.recorder.counts or _is_launcher():  # `python -m torch.distributed.run`
            _remove_marker(tracer)
            return
        tracer.write(partial=state.ended)
    except Exception as exc:  # never turn a finished training run into a crash
        print(f"opguard trace: could not write the trace: {exc}", file=sys.stderr)
        # the marker stays, saying why: `opguard trace` exits non-zero
        _write_marker(tracer, _FORKED_FROM, error=str(exc) or type(exc).__name__)
        return
    _remove_marker(tracer)
