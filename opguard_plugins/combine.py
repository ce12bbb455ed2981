"""Stage 2, combine: merge an entry's rank files into one trace, streaming.

Rank files are decoded (and validated) one at a time and folded into a
:class:`~opguard_core.combined.TraceAccumulator`, so memory holds one file plus the
distinct callsites seen so far, whatever the number of ranks. With ``--jobs N``
(N > 1) the files are split across N worker processes, each streaming its share
into its own accumulator; the partial results are folded together at the end.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
from collections.abc import Callable, Sequence
from pathlib import Path

from opguard_core import hookimpl
from opguard_core.combined import CallsiteTrace, TraceAccumulator
from opguard_core.logs import progress
from opguard_core.model import InputEntry, RunOptions
from opguard_core.trace_format import load_trace


def combine_files(
    paths: Sequence[Path], advance: Callable[[int], None] | None = None
) -> TraceAccumulator:
    """Stream ``paths`` into one accumulator, one file in memory at a time."""
    accumulator = TraceAccumulator()
    for path in paths:
        accumulator.add(load_trace(path))
        if advance is not None:
            advance(1)
    return accumulator


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


def combine_parallel(paths: Sequence[Path], jobs: int) -> TraceAccumulator:
    """Map chunks of files to worker processes, then fold the partial results."""
    chunks = split_evenly(paths, jobs)
    context = multiprocessing.get_context("spawn")
    total = TraceAccumulator()
    with (
        concurrent.futures.ProcessPoolExecutor(len(chunks), mp_context=context) as pool,
        progress("combine", len(chunks)) as advance,
    ):
        for partial in pool.map(combine_files, chunks):
            total.update(partial)
            advance(1)
    return total


def combine_entry(entry: InputEntry, options: RunOptions) -> CallsiteTrace:
    """The built-in combine: sequential, or a bounded process pool with ``jobs`` > 1."""
    if options.jobs > 1 and len(entry.files) > 1:
        return combine_parallel(entry.files, options.jobs).result()
    with progress(f"combine {entry.name}", len(entry.files)) as advance:
        return combine_files(entry.files, advance).result()


@hookimpl(trylast=True)
def opguard_combine(entry: InputEntry, options: RunOptions) -> CallsiteTrace:
    return combine_entry(entry, options)
