"""Run directories left behind by a run that was killed (SIGKILL, power loss, OOM).

A live run holds an exclusive ``flock`` on its run directory for as long as it runs
(:func:`start_run_directory`); the kernel drops the lock when the process dies, however
it dies. A run directory whose ``pipeline_summary.json`` still says
``"status": "running"`` but whose lock can be taken is therefore *stale*: its run was
killed before it could write the final summary. The next run into the same output
base reports each one in one line (a run warning), and
``opguard run --clean-stale`` removes their temporary files (``.*.tmp``) and marks
their summary ``"status": "abandoned"``, so they are reported no more.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
from pathlib import Path

import msgspec

from opguard_core.files.atomic import TMP_SUFFIX, atomic_write_bytes, create_run_directory
from opguard_core.files.output_dirs import wrap_os_error
from opguard_core.run.summary import SUMMARY_FILE

RUN_DIR_PREFIX = "preprocessing_"


@dataclasses.dataclass(frozen=True)
class StaleRun:
    """A run directory whose run died without finishing."""

    run_dir: Path
    temporaries: tuple[Path, ...]

    def line(self) -> str:
        tmp = len(self.temporaries)
        return (
            f"stale run directory {str(self.run_dir)!r}: its summary says 'running' but no "
            f"process holds it (killed?); {tmp} temporary file(s) left; "
            "'opguard run --clean-stale' removes them"
        )


def lock_run_directory(run_dir: Path) -> int:
    """Take the exclusive lock that marks ``run_dir`` live; returns the fd to close."""
    fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise
    return fd


def start_run_directory(base: Path, what: str = "output base") -> tuple[Path, int]:
    """Create a fresh run directory under ``base`` and lock it (see the module docstring).

    :raises OutputLocationError: when the directory cannot be created.
    """
    try:
        run_dir = create_run_directory(base)
        return run_dir, lock_run_directory(run_dir)
    except OSError as exc:
        raise wrap_os_error(what, base, exc) from None


def release_run_directory(fd: int | None) -> None:
    """Drop the lock taken by :func:`start_run_directory`."""
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)


def _is_live(run_dir: Path) -> bool:
    try:
        fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
    return False


def _status(summary: Path) -> str | None:
    try:
        if not summary.is_file():  # a FIFO would hold every later run up for ever
            return None
        data = json.loads(summary.read_bytes())
    except (OSError, ValueError, RecursionError):  # RecursionError: nested too deep
        return None
    return data.get("status") if isinstance(data, dict) else None


def find_stale_runs(base: Path, exclude: Path | None = None) -> list[StaleRun]:
    """Stale run directories directly under ``base``, oldest first."""
    found: list[StaleRun] = []
    try:
        candidates = sorted(p for p in base.iterdir() if p.name.startswith(RUN_DIR_PREFIX))
    except OSError:
        return found
    for run_dir in candidates:
        if exclude is not None and run_dir.resolve() == exclude.resolve():
            continue
        if not run_dir.is_dir() or run_dir.is_symlink():
            continue
        if _status(run_dir / SUMMARY_FILE) != "running" or _is_live(run_dir):
            continue
        temporaries = tuple(
            sorted(
                p
                for p in run_dir.iterdir()
                if p.name.startswith(".") and p.name.endswith(TMP_SUFFIX)
            )
        )
        found.append(StaleRun(run_dir=run_dir, temporaries=temporaries))
    return found


def clean_stale_runs(base: Path) -> list[StaleRun]:
    """Remove the temporaries of every stale run under ``base`` and mark it abandoned."""
    cleaned = find_stale_runs(base)
    for stale in cleaned:
        for tmp in stale.temporaries:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        summary = stale.run_dir / SUMMARY_FILE
        try:
            data = json.loads(summary.read_bytes())
        except (OSError, ValueError):
            continue
        data["status"] = "abandoned"
        data["abandoned_reason"] = "the run died before finishing (found by --clean-stale)"
        encoded = msgspec.json.format(msgspec.json.encode(data), indent=2) + b"\n"
        atomic_write_bytes(summary, encoded)
    return cleaned


__all__ = [
    "StaleRun",
    "clean_stale_runs",
    "find_stale_runs",
    "lock_run_directory",
    "release_run_directory",
    "start_run_directory",
]
