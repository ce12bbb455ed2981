"""Optional combine executor on Dask distributed: ``opguard run --executor dask``.

Combining is a multiset union (associative and commutative), so it maps onto a
cluster as map + tree-reduce: chunks of rank files go to workers, each streams its
chunk into a :class:`~opguard_core.combine.accumulator.TraceAccumulator`
(:func:`opguard_plugins.stages.combine.combine_files_portable`), and partial accumulators
are folded pairwise with :meth:`TraceAccumulator.update` on the workers until one
is left, which the client turns into the canonical trace. The output is
byte-identical to the local executor's.

Which cluster:

* ``$OPGUARD_DASK_SCHEDULER`` (``tcp://host:8786``), else ``options.extra
  ["dask_scheduler"]``: connect to that scheduler; the workers must see the trace
  files at the same paths (a shared file system) and have opguard installed;
* else a :class:`~distributed.LocalCluster` on this machine: ``--jobs N`` worker
  processes when N > 1, else 2, one thread each.

Dask is imported only inside the hook, so this plugin loads (and stays out of the
way) when dask is not installed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opguard_core import hookimpl
from opguard_core.combine.accumulator import CallsiteTrace, TraceAccumulator, gc_paused
from opguard_core.combine.rank_claims import check_rank_claims
from opguard_core.errors import OpGuardError
from opguard_core.formats.readers import Readers
from opguard_core.logs import get_logger, progress
from opguard_core.model import InputEntry, RunOptions
from opguard_plugins.stages.combine import (
    combine_files_portable,
    earliest_error,
    portable_error,
    split_evenly,
    warn_in_input_order,
)

EXECUTOR_NAME = "dask"
#: modules ``--executor dask`` needs (checked before the run: opguard_core.cli.checks)
EXECUTOR_REQUIRES = ("dask", "distributed")
EXECUTOR_INSTALL = "pip install 'opguard[dask]'"
SCHEDULER_ENV = "OPGUARD_DASK_SCHEDULER"
#: Files per map task: small enough to spread over workers and show progress,
#: large enough that a task is not mostly overhead.
FILES_PER_TASK = 4
DEFAULT_LOCAL_WORKERS = 2


def merge_partials(*partials: TraceAccumulator) -> TraceAccumulator:
    """Fold partial accumulators into the first (a reduce step; runs on a worker)."""
    try:
        with gc_paused():
            total = partials[0]
            for partial in partials[1:]:
                total.update(partial)
        return total
    except Exception as exc:
        raise portable_error(exc) from None


def scheduler_address(options: RunOptions) -> str | None:
    """The scheduler to use: ``$OPGUARD_DASK_SCHEDULER``, else ``options.extra``, else None."""
    address = os.environ.get(SCHEDULER_ENV) or options.extra.get("dask_scheduler")
    return str(address) if address else None


def chunk_files(paths: Sequence[Path], workers: int) -> list[list[str]]:
    """Chunks of about :data:`FILES_PER_TASK` files, at least one per worker."""
    parts = max(workers, -(-len(paths) // FILES_PER_TASK))
    return [[str(p) for p in chunk] for chunk in split_evenly(paths, parts)]


def _import_distributed() -> Any:
    try:
        import distributed
    except ImportError:
        raise OpGuardError(
            "--executor dask needs dask[distributed]: pip install 'opguard[dask]'"
        ) from None
    return distributed


def combine_on_dask(
    entry: InputEntry, options: RunOptions, readers: Readers | None = None
) -> CallsiteTrace:
    """Map chunks of ``entry.files`` to Dask workers and tree-reduce the partials."""
    distributed = _import_distributed()
    log = get_logger()
    address = scheduler_address(options)
    cluster = None
    if address:
        client = distributed.Client(address)
    else:
        workers = options.jobs if options.jobs > 1 else DEFAULT_LOCAL_WORKERS
        cluster = distributed.LocalCluster(
            n_workers=workers,
            threads_per_worker=1,
            processes=bool(options.extra.get("dask_processes", True)),
            dashboard_address=None,
            # a bad rank file is one line from the run, not also a worker's multi-line
            # "Compute Failed" block on stderr (not JSON, whatever --log-format says)
            silence_logs=logging.WARNING if options.verbose else logging.CRITICAL,
        )
        client = distributed.Client(cluster)
    try:
        nworkers = max(1, len(client.scheduler_info().get("workers", {})))
        log.info("dask combine", scheduler=client.scheduler.address, workers=nworkers)
        chunks = chunk_files(entry.files, nworkers)
        futures = client.map(combine_files_portable, chunks, readers=readers, pure=False)
        sizes = {f.key: len(c) for f, c in zip(futures, chunks, strict=True)}
        with progress(f"combine {entry.name} (dask)", len(entry.files)) as advance:
            # tree-reduce as results arrive: any two finished partials are merged on
            # a worker, and the merge joins the stream of finished partials
            finished = distributed.as_completed(futures)
            ready: list[Any] = []
            for future in finished:
                if future.status == "error":  # the first bad file's, in input order
                    raise earliest_error(future.exception(), entry.files, readers) from None
                advance(sizes.get(future.key, 0))
                ready.append(future)
                if len(ready) == 2:
                    finished.add(client.submit(merge_partials, *ready, pure=False))
                    ready = []
            total: TraceAccumulator = ready[0].result()
        warn_in_input_order(total.warnings, entry.files)
        check_rank_claims(total.claims)
        with gc_paused():
            return total.result()
    finally:
        client.close()
        if cluster is not None:
            cluster.close()


@hookimpl(tryfirst=True)
def opguard_combine(
    entry: InputEntry, options: RunOptions, readers: Readers
) -> CallsiteTrace | None:
    """Combine on Dask when ``--executor dask``; otherwise leave it to the next executor."""
    if options.executor != EXECUTOR_NAME:
        return None
    return combine_on_dask(entry, options, readers)
