"""When and how a traced process writes its trace: the periodic flush's settings, the
``meta.partial`` marker (formats.md §1, version 5) and whether the set-up phase goes to
a file of its own. No torch here: ``opguard trace`` reads the defaults for its options."""

from __future__ import annotations

import datetime as _dt
import os
import sys
from pathlib import Path
from typing import Any

import msgspec

from opguard_core.files.atomic import atomic_write_bytes
from opguard_core.formats.trace import LOST

#: seconds between periodic flushes of a traced process's trace (0: none)
FLUSH_SECONDS_ENV = "OPGUARD_TRACE_FLUSH_SECONDS"
#: optimizer steps between periodic flushes of a traced process's trace (0: none)
FLUSH_STEPS_ENV = "OPGUARD_TRACE_FLUSH_STEPS"
#: ``0``: one trace file for the whole process, not the set-up apart from the loop
#: (``opguard trace --no-split``; tracing.md, "Set-up and loop")
SPLIT_ENV = "OPGUARD_TRACE_SPLIT"
DEFAULT_FLUSH_SECONDS = 30.0
DEFAULT_FLUSH_STEPS = 0


def flush_settings() -> tuple[float, int]:
    """(seconds, steps) between periodic flushes, from the environment (0: none); a
    value that is not a number, or negative, is warned about and the default used."""
    seconds, steps = DEFAULT_FLUSH_SECONDS, DEFAULT_FLUSH_STEPS
    text = os.environ.get(FLUSH_SECONDS_ENV)
    if text:
        try:
            seconds = float(text)
            if not seconds >= 0 or seconds == float("inf"):
                raise ValueError(text)
        except ValueError:
            print(f"opguard trace: ignoring ${FLUSH_SECONDS_ENV}={text!r}", file=sys.stderr)
            seconds = DEFAULT_FLUSH_SECONDS
    text = os.environ.get(FLUSH_STEPS_ENV)
    if text:
        try:
            steps = int(text)
            if steps < 0:
                raise ValueError(text)
        except ValueError:
            print(f"opguard trace: ignoring ${FLUSH_STEPS_ENV}={text!r}", file=sys.stderr)
            steps = DEFAULT_FLUSH_STEPS
    return seconds, steps


def partial_marker(reason: str, steps: int, **more: Any) -> dict[str, Any]:
    """``meta.partial`` (formats.md §1, version 5): why the trace is partial, the UTC
    time it holds operators up to, and the optimizer steps done by then."""
    at = _dt.datetime.now(_dt.UTC).isoformat(timespec="milliseconds")
    return {"reason": reason, "at": at.replace("+00:00", "Z"), "step": steps, **more}


def mark_lost(path: Path) -> bool:
    """Mark the trace at ``path``, a periodic flush's, as the last record of a process
    that ended without writing its own (:data:`LOST`); False if it is not a flush's."""
    doc = msgspec.json.decode(path.read_bytes())
    partial = doc.get("meta", {}).get("partial") if isinstance(doc, dict) else None
    if not isinstance(partial, dict) or partial.get("reason") != "flush":
        return False
    partial["reason"] = LOST
    atomic_write_bytes(path, msgspec.json.encode(doc))
    return True


__all__ = [
    "DEFAULT_FLUSH_SECONDS",
    "DEFAULT_FLUSH_STEPS",
    "FLUSH_SECONDS_ENV",
    "FLUSH_STEPS_ENV",
    "LOST",
    "SPLIT_ENV",
    "flush_settings",
    "mark_lost",
    "partial_marker",
]
