"""Stage 2, combine: merge an entry's rank files into one trace, streaming.

Rank files are decoded (and validated) one at a time and folded into a
:class:`~opguard_core.combine.accumulator.TraceAccumulator`, so a process holds one file plus
the distinct callsites seen so far, whatever the number of ranks.

With several jobs (``--jobs N``, N > 1; ``0`` means automatic, see
:func:`auto_jobs`) the main process and N - 1 spawned helper processes take files
one at a time from a shared queue (so a slow file does not leave a core idle), each
into its own accumulator; the helpers send their partial accumulators back at the
end and the main process folds them in. The combine is a multiset union, so the
result is the same whichever process took which file. The run warnings made reading
the files (a Kineto file's cut profiling window) are collected, a helper's coming
back with its partial, and made at the end in the order of the files they name
(:func:`warn_in_input_order`), so ``pipeline_summary.json`` lists them as if one
process had read every file in order.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import queue
import signal
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from opguard_core import hookimpl
from opguard_core.combine.accumulator import CallsiteTrace, TraceAccumulator, gc_paused
from opguard_core.combine.rank_claims import check_rank_claims
from opguard_core.errors import InputError, OpGuardError
from opguard_core.formats.readers import Readers
from opguard_core.logs import progress
from opguard_core.model import InputEntry, RunOptions
from opguard_core.processes import before_fork, die_with_parent, signals_deferred
from opguard_core.run.warnings import collecting, warn_again

#: Below this many input bytes a pool costs more (process start-up) than it saves.
AUTO_POOL_MIN_BYTES = 24 * 1024 * 1024
#: ``jobs == 0`` never starts more processes than this.
AUTO_MAX_JOBS = 8


class RemoteInputError(InputError):
    """An :class:`InputError` raised in another process; unlike its base, it pickles."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (RemoteInputError, (self.path, self.problem))


def portable_error(exc: BaseException) -> BaseException:
    """``exc`` in a form that survives pickling to another process, same message."""
    if isinstance(exc, InputError):
        return RemoteInputError(exc.path, exc.problem)
    if isinstance(exc, OpGuardError):
        return OpGuardError(str(exc))
    return exc


def combine_files(
    paths: Sequence[Path | str],
    advance: Callable[[int], None] | None = None,
    readers: Readers | None = None,
) -> TraceAccumulator:
    """Stream ``paths`` into one accumulator, one file in memory at a time."""
    accumulator = TraceAccumulator()
    with gc_paused():
        for path in paths:
            accumulator.add_file(path, readers)
            if advance is not None:
                advance(1)
    return accumulator


def combine_files_portable(
    paths: Sequence[Path | str], readers: Readers | None = None
) -> TraceAccumulator:
    """:func:`combine_files` for other processes (Dask): errors pickle, and the run
    warnings made reading the files travel in the result (``warnings``), unlogged,
    for the run's process to make (:func:`warn_again`)."""
    warnings: list[dict[str, Any]] = []
    try:
        with collecting(warnings, quiet=True):
            accumulator = combine_files(paths, readers=readers)
    except Exception as exc:
        raise portable_error(exc) from None
    accumulator.warnings += warnings
    return accumulator


def warn_in_input_order(warnings: list[dict[str, Any]], files: Sequence[Path]) -> None:
    """Make the run warnings other processes collected (:func:`warn_again`), in the
    order of the input files they name (which process read which file is chance), the
    ones that name none last, as they came."""
    position = {str(path): index for index, path in enumerate(files)}
    warn_again(sorted(warnings, key=lambda w: position.get(str(w.get("file")), len(position))))


def cpu_count() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def auto_jobs(paths: Sequence[Path]) -> int:
    """How many processes to combine ``paths`` with when ``--jobs`` is 0 (auto).

    One per CPU (at most :data:`AUTO_MAX_JOBS`, at most one per file), but just
    one when there are few files or little data, where starting processes costs
    more than it saves.
    """
    if len(paths) < 4:
        return 1
    size = 0
    for path in paths:
        with contextlib.suppress(OSError):  # reading it will report the problem
            size += path.stat().st_size
    if size < AUTO_POOL_MIN_BYTES:
        return 1
    return max(1, min(cpu_count(), AUTO_MAX_JOBS, len(paths)))


def split_evenly(paths: Sequence[Path], parts: int) -> list[list[Path]]:
    """Split ``paths`` into at most ``parts`` contiguous, near-equal chunks."""
    parts = max(1, min(parts, len(paths)))
    size, extra = divmod(len(paths), parts)
    chunks, start = [], 0
    for index in range(parts):
        end = start + size + (1 if index < extra else 0)
        chunks.append(list(paths[start:end]))
        start = end
    return chunks


def start_method() -> Literal["fork", "spawn"]:
    """How to start helpers: ``fork`` when this process has a single thread, else ``spawn``.

    A forked helper starts at once, with every module already imported; a spawned
    one first starts an interpreter and re-imports the CLI (about 0.2 s, a file's
    worth of work lost on the helper side). Forking is only safe with one thread
    (another thread may hold a lock the child would then never see released), so
    with a progress bar's refresh thread running, or where fork is unavailable,
    helpers are spawned.
    """
    if "fork" in multiprocessing.get_all_start_methods() and threading.active_count() == 1:
        return "fork"
    return "spawn"


def _helper(tasks: Any, results: Any, readers: Readers | None, parent: int) -> None:
    """A helper process: combine files from ``tasks`` until ``None``, then send the result.

    Signals: a forked helper inherits the runner's SIGTERM handler, so both are reset.
    SIGTERM kills a helper quietly; SIGINT (Ctrl-C reaches the whole process group) is
    left to the main process, which records the interruption and terminates helpers.
    The helper dies with ``parent`` (the runner), even if that one is SIGKILLed.
    """
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(signal.SIGKILL, parent)
    accumulator = TraceAccumulator()
    try:
        # the run warnings made reading files go back with the result, unlogged
        with gc_paused(), collecting(accumulator.warnings, quiet=True):
            while (path := tasks.get()) is not None:
                accumulator.add_file(path, readers)
                results.put(("file", None))
        results.put(("done", accumulator))
    except BaseException as exc:
        results.put(("error", portable_error(exc)))


def how_it_ended(exitcode: int | None) -> str:
    """A process's end, as a ``multiprocessing`` exit code says it (minus a signal's
    number for a process a signal killed): ``killed by SIGKILL``, ``exit code 0``."""
    if exitcode is not None and exitcode < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-exitcode).name}"
    return f"exit code {exitcode}"


def earliest_error(
    error: BaseException, paths: Sequence[Path], readers: Readers | None
) -> BaseException:
    """The error of the first bad file in input order, as one process reading the
    files in order would raise it: ``error`` came from whichever process met its file
    first, so the files before it are read again, each on its own, in order (the
    failure path only)."""
    failed = str(error.path) if isinstance(error, InputError) else None
    before = [str(p) for p in paths]
    if failed not in before:
        return error
    for path in before[: before.index(failed)]:
        try:
            with collecting([], quiet=True):
                TraceAccumulator().add_file(path, readers)
        except InputError as exc:
            return exc
    return error


def combine_parallel(
    paths: Sequence[Path],
    jobs: int,
    advance: Callable[[int], None] | None = None,
    readers: Readers | None = None,
) -> TraceAccumulator:
    """Combine with the main process and ``jobs - 1`` helpers sharing a queue of files."""
    helpers = max(1, min(jobs, len(paths)) - 1)
    fork = start_method() == "fork"
    context = multiprocessing.get_context("fork") if fork else multiprocessing.get_context("spawn")
    tasks = context.Queue()
    results = context.Queue()
    processes = [
        context.Process(
            target=_helper,
            args=(tasks, results, readers, os.getpid()),
            daemon=True,
            name=f"combine-{i}",
        )
        for i in range(helpers)
    ]
    tick = advance or (lambda n: None)
    partials: list[TraceAccumulator] = []
    if fork:  # die_with_parent's libc looked up once, here, not by each helper
        before_fork()

    def handle(kind: str, payload: Any) -> None:
        if kind == "file":
            tick(1)
        elif kind == "done":
            partials.append(payload)
        else:
            raise earliest_error(payload, paths, readers)

    def drain() -> None:
        while True:
            try:
                kind, payload = results.get_nowait()
            except queue.Empty:
                return
            handle(kind, payload)

    total = TraceAccumulator()
    try:
        # Signals wait until the helpers run and the tasks are queued: a helper that got
        # SIGINT before it ignores it would print a KeyboardInterrupt's traceback, and
        # a signal inside Queue.put would leak the queue's lock (closing it would hang)
        with signals_deferred():
            for process in processes:  # before the feeder threads start (start_method)
                process.start()
            for path in paths:
                tasks.put(str(path))
            for _ in range(helpers + 1):
                tasks.put(None)
        # this process's run warnings join the helpers', made in input order at the end
        with gc_paused(), collecting(total.warnings, quiet=True):
            while (path := tasks.get()) is not None:
                try:
                    total.add_file(path, readers)
                except InputError as exc:
                    raise earliest_error(exc, paths, readers) from None
                tick(1)
                drain()
            while len(partials) < helpers:
                try:
                    kind, payload = results.get(timeout=0.5)
                except queue.Empty:
                    ended = [p for p in processes if p.exitcode is not None]
                    drain()  # what they sent before they ended
                    dead = [p for p in ended if p.exitcode != 0]
                    if dead:
                        raise OpGuardError(
                            f"combine: helper process {dead[0].name} died "
                            f"({how_it_ended(dead[0].exitcode)}; out of memory?)"
                        ) from None
                    if len(ended) > len(partials):  # waiting for it would be for ever
                        raise OpGuardError(
                            "combine: a helper process ended (exit code 0) without sending"
                            " its result (os._exit in a reader plugin?)"
                        ) from None
                    continue
                handle(kind, payload)
            for partial in partials:
                total.update(partial)
    finally:
        for process in processes:
            if process.is_alive():
                process.join(timeout=5 if len(partials) == helpers else 0)
            if process.is_alive():
                process.terminate()
                # a SIGTERM that comes before the helper set its handlers is lost (the
                # noting handler it inherited from signals_deferred is replaced)
                process.join(timeout=2)
            if process.is_alive():
                process.kill()
                process.join()
        tasks.close()
        results.close()
        tasks.cancel_join_thread()
    return total


def effective_jobs(entry: InputEntry, options: RunOptions) -> int:
    """``options.jobs``, with 0 (or less) meaning :func:`auto_jobs`."""
    if options.jobs <= 0:
        return auto_jobs(entry.files)
    return options.jobs


def combine_entry(
    entry: InputEntry, options: RunOptions, readers: Readers | None = None
) -> CallsiteTrace:
    """The built-in combine: sequential, or a bounded process pool with several jobs."""
    jobs = effective_jobs(entry, options)
    with progress(f"combine {entry.name}", len(entry.files)) as advance:
        if jobs > 1 and len(entry.files) > 1:
            accumulator = combine_parallel(entry.files, jobs, advance, readers)
        else:
            accumulator = combine_files(entry.files, advance, readers)
    warn_in_input_order(accumulator.warnings, entry.files)
    check_rank_claims(accumulator.claims)
    with gc_paused():
        return accumulator.result()


@hookimpl(trylast=True)
def opguard_combine(entry: InputEntry, options: RunOptions, readers: Readers) -> CallsiteTrace:
    return combine_entry(entry, options, readers)
