"""Run warnings: things a run did not refuse but a person should know.

:func:`warn` logs a warning (structlog, stderr) and, while a run collects them
(:func:`collecting`, the runner does), adds it to the run's list, which
``pipeline_summary.json`` carries as ``warnings`` and ``opguard run`` prints at
the end, one ``opguard: warning: ...`` line each. Stages and plugins call it for an
unmatched ``--hide`` pattern, a rank file whose name disagrees with ``meta.rank``,
a trace without callsites, a stale run directory, ...
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

from opguard_core.logs import get_logger

_COLLECTED: contextvars.ContextVar[list[dict[str, Any]] | None] = contextvars.ContextVar(
    "opguard_run_warnings", default=None
)
#: whether the warnings collected now are only collected, not logged
_QUIET: contextvars.ContextVar[bool] = contextvars.ContextVar("opguard_quiet", default=False)
#: the ``alike`` kinds among the warnings collected now (a repeat is not logged)
_KINDS: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar(
    "opguard_warning_kinds", default=None
)


#: what :func:`warn` puts in a record beside the caller's fields
_OWN_KEYS = frozenset({"message", "alike", "stage", "entry"})


def warn(message: str, *, alike: str | None = None, **fields: Any) -> None:
    """Log ``message`` as a warning and add it to the current run's warnings.

    :param message: one line, complete on its own (it is printed as is).
    :param alike: a name for one kind of warning made once per input (a Kineto file's
        profiling window, for each of a thousand ranks): all are kept, but only the
        first of a kind is logged, and the run's summary prints it once with how many
        more there are.
    :param fields: JSON-able details (``pattern=``, ``file=``, ...); the bound
        ``stage`` and ``entry`` are added where there are (a field overrides them).
    """
    import structlog  # here: importing this module stays cheap (opguard CMD --help)

    bound = structlog.contextvars.get_contextvars()
    record: dict[str, Any] = {"message": " ".join(message.split())}
    for key in ("stage", "entry"):
        if bound.get(key) is not None:
            record[key] = bound[key]
    record.update(fields)
    collected, kinds = _COLLECTED.get(), _KINDS.get()
    repeat = False
    if alike is not None:
        record["alike"] = alike
        repeat = kinds is not None and alike in kinds
        if kinds is not None:
            kinds.add(alike)
    if not _QUIET.get() and not repeat:
        get_logger().warning(record["message"], **fields)
    if collected is not None:
        collected.append(record)


def warn_again(records: list[dict[str, Any]]) -> None:
    """Make here, as :func:`warn` makes them (logged, collected), the warnings another
    process collected quietly (a combine's helper process, a Dask worker): each keeps
    its message, ``alike`` and fields; ``stage`` and ``entry`` are this process's."""
    for record in records:
        fields = {k: v for k, v in record.items() if k not in _OWN_KEYS}
        warn(record["message"], alike=record.get("alike"), **fields)


@contextlib.contextmanager
def collecting(into: list[dict[str, Any]], quiet: bool = False) -> Iterator[list[dict[str, Any]]]:
    """Collect every :func:`warn` made inside the block into ``into`` (``quiet``: and
    log none: a command that runs stages as a library and reports on its own)."""
    token, quieted = _COLLECTED.set(into), _QUIET.set(quiet)
    known = _KINDS.set({r["alike"] for r in into if "alike" in r})
    try:
        yield into
    finally:
        _KINDS.reset(known)
        _QUIET.reset(quieted)
        _COLLECTED.reset(token)


__all__ = ["collecting", "warn", "warn_again"]
