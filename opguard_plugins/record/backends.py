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
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from opguard_plugins.record.tracer import CallsiteTracer, _is_launcher


@contextmanager
def trace_callsites(
    label: str = "trace",
    output_dir: str | os.PathLike[str] = ".",
    rank: int | None = None,
    *,
    backend: str = "modes",
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
    :param extra_meta: more keys for the trace's ``meta``.
    """
    tracer = make_tracer(backend, label, output_dir, rank=rank, extra_meta=extra_meta)
    tracer.start()
    try:
        yield tracer
    finally:
        tracer.stop()
        tracer.write()


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


def _write_marker(tracer: CallsiteTracer, parent: int | None) -> None:
    path = marker_path(tracer.output_dir, tracer.base_label, os.getpid())
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            f'{{"pid": {os.getpid()}, "forked_from": {json.dumps(parent)}, '
            f'"label": {json.dumps(tracer.label)}}}\n'
        )
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
    parent = os.getppid()
    tracer.recorder.reset_after_fork()
    tracer.label = fork_label(tracer.base_label, os.getpid())
    tracer.marker = None
    _write_marker(tracer, parent)


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


def start_process_tracer(label: str, output_dir: str) -> CallsiteTracer | None:
    """Trace this whole process from now on and write the trace at interpreter exit.

    Called by the ``sitecustomize`` bootstrap once torch is imported. Does nothing in
    torchrun's launcher (it runs no model code and would otherwise claim rank 0), and
    writes nothing if no operator ran.
    """
    global _PROCESS_TRACER
    if _PROCESS_TRACER is not None or _is_launcher():
        return _PROCESS_TRACER
    global _FORK_HOOK_INSTALLED
    tracer = make_tracer(os.environ.get("OPGUARD_TRACE_BACKEND") or BACKENDS[0], label, output_dir)
    tracer.start()
    _PROCESS_TRACER = tracer
    _write_marker(tracer, None)
    atexit.register(_finish_process_tracer)
    if not _FORK_HOOK_INSTALLED:
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _FORK_HOOK_INSTALLED = True
    return tracer


def _finish_process_tracer() -> None:
    tracer = _PROCESS_TRACER
    if tracer is None:
        return
    tracer.stop()
    try:
        if not tracer.recorder.counts or _is_launcher():  # `python -m torch.distributed.run`
            return
        tracer.write()
    except Exception as exc:  # never turn a finished training run into a crash
        print(f"opguard trace: could not write the trace: {exc}", file=sys.stderr)
    finally:
        _remove_marker(tracer)
