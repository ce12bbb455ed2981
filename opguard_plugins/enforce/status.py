"""How each guarded process tells ``opguard guard`` whether its guard did its work.

``opguard guard`` makes a private directory and names it in ``$OPGUARD_GUARD_STATUS``;
every process whose guard starts (or fails to start) writes ``{pid}.json`` there:

* ``{"pid": N, "state": "failed", "error": "..."}``: the guard could not start (written
  by the bootstrap, which may not be able to import this module, so it writes the
  same JSON by hand);
* ``{"pid": N, "state": "started"}``: running; a process that ends without replacing
  it (SIGKILL, ``os._exit``) wrote no report; with ``"report": PATH, "as_of": WHAT``
  it wrote one mid-run, as of WHAT ("its first collective departure" in warn mode,
  "its collective timeout" from the watchdog), and then ended so; ``"helper": true``
  marks a multiprocessing child (:func:`~opguard_core.processes.multiprocessing_child`);
* ``{"pid": N, "state": "finished", "report": PATH or null, "error": ... or null,
  "checked": K, "waits_for_a_step": B}``: the report was written (or could not be:
  ``error``), and ``K`` ops were checked against the config (first sights per
  active-entry state); ``B``: the config is of the loop and no optimizer step ended.

A process whose guard checked the whole run also writes ``{pid}.counts``: its rank,
world size, loop steps and the ops it counted per config entry
(:func:`write_job_counts`), from which ``opguard guard`` judges ``count_drift`` and
``missing_op`` by the job as a whole, as ``opguard check`` does (docs/guard.md, "One
view of the job"). torchrun's launcher, which imports torch but runs no training
code, removes its file. ``opguard guard`` reads them all after COMMAND ended (:func:`read_statuses`)
and exits with ``ExitCode.GUARD_FAILED`` when a guard failed, a report is missing,
or no process checked an op. No torch, no click: the guarded process imports this.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

#: the environment variable naming the status directory
STATUS_ENV = "OPGUARD_GUARD_STATUS"


def _path() -> Path | None:
    folder = os.environ.get(STATUS_ENV)
    return Path(folder) / f"{os.getpid()}.json" if folder else None


def write_status(state: str, **fields: Any) -> None:
    """Write this process's status (nothing without ``$OPGUARD_GUARD_STATUS``); never raises."""
    path = _path()
    if path is None:
        return
    document = {"pid": os.getpid(), "state": state, **fields}
    temporary = path.with_name(f".{path.name}.tmp")
    with contextlib.suppress(OSError, TypeError, ValueError):
        temporary.write_text(json.dumps(document))
        os.replace(temporary, path)


def clear_status() -> None:
    """Remove this process's status (torchrun's launcher: it guards nothing)."""
    path = _path()
    if path is not None:
        with contextlib.suppress(OSError):
            path.unlink()


def write_job_counts(document: dict[str, Any]) -> bool:
    """Write this process's counts for the job view (``{pid}.counts``); whether it was
    written (not without ``$OPGUARD_GUARD_STATUS``); never raises."""
    path = _path()
    if path is None:
        return False
    path = path.with_suffix(".counts")
    temporary = path.with_name(f".{path.name}.tmp")
    try:
        temporary.write_text(json.dumps(document))
        os.replace(temporary, path)
    except (OSError, TypeError, ValueError):
        return False
    return True


def read_job_counts(folder: Path) -> list[dict[str, Any]] | None:
    """Every process's counts in ``folder`` (:func:`write_job_counts`), or None where
    one cannot be read."""
    found: list[dict[str, Any]] = []
    for path in sorted(folder.glob("*.counts")):
        try:
            document = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            return None
        if not isinstance(document, dict):
            return None
        found.append(document)
    return found


def read_statuses(folder: Path) -> list[dict[str, Any]]:
    """Every process's status in ``folder``, by pid; an unreadable one is a failure."""
    found: list[dict[str, Any]] = []
    for path in sorted(folder.glob("*.json")):
        try:
            document = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            document = {"state": "failed", "error": f"unreadable status {path.name}: {exc}"}
        if not isinstance(document, dict):
            document = {"state": "failed", "error": f"unreadable status {path.name}"}
        document.setdefault("pid", path.stem)
        found.append(document)
    return found


def problems(statuses: list[dict[str, Any]], command_ok: bool = False) -> list[str]:
    """One line per process whose guard did not do its work; then, when every guard
    finished but none checked an op, one line saying so; and one when no process
    started a guard at all (COMMAND never imported torch). A multiprocessing child
    (``"helper"``: :func:`~opguard_core.processes.multiprocessing_child`) that ended
    without a report is no problem where COMMAND succeeded (``command_ok``): its parent
    ended it as it exited (DataLoader workers), and a rank started so that died would
    have failed COMMAND."""
    if not statuses:
        return ["no process of COMMAND started the guard (did it import torch?)"]
    lines: list[str] = []
    checked = 0
    waited = False
    for status in statuses:
        pid, state, error = status.get("pid"), status.get("state"), status.get("error")
        if state == "started" and status.get("helper") is True and command_ok:
            continue
        if state == "failed":
            lines.append(f"the guard could not start in process {pid}: {error}")
        elif state == "started" and status.get("report"):
            as_of = status.get("as_of") or "a write during the run"
            lines.append(
                f"process {pid} ended before its guard finished (killed?): its report as of "
                f"{as_of} is {status['report']}"
            )
        elif state == "started":
            lines.append(f"process {pid} ended without writing its guard report (killed?)")
        elif error:
            lines.append(f"process {pid} could not write its guard report: {error}")
        else:
            value = status.get("checked")
            checked += value if isinstance(value, int) else 0
            waited = waited or status.get("waits_for_a_step") is True
    if not lines and checked == 0 and waited:
        lines.append(
            "the guard checked no op: the config is of the training loop, checked from the "
            "end of the first optimizer step, and no guarded process ended one (a config "
            "made with opguard trace --no-split checks from the first op)"
        )
    elif not lines and checked == 0:
        lines.append(
            "the guard checked no op: no config target ran (is the config made from this "
            "program? each report's 'missing' warnings name the targets that never ran)"
        )
    return lines


__all__ = [
    "STATUS_ENV",
    "clear_status",
    "problems",
    "read_job_counts",
    "read_statuses",
    "write_job_counts",
    "write_status",
]
