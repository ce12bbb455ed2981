"""Output locations: check a directory OpGuard is about to write into, once, up front.

``--output-base``, ``$OPGUARD_TRACE_OUTPUT_BASE`` and ``opguard trace --output-dir``
all go through :func:`prepare_output_dir`. A location that cannot be used (an existing
file, a path under a file, a symlink loop, a dangling symlink, a read-only file
system, a directory without write permission) becomes one
:class:`OutputLocationError` naming the path and the problem; the commands print it
as one line and exit with :attr:`~opguard_core.errors.ExitCode.USAGE_ERROR` (2).
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterable
from pathlib import Path

from opguard_core.errors import UsageProblem


class OutputLocationError(UsageProblem):
    """An output directory cannot be created or written; the message names it."""

    def __init__(self, what: str, path: Path | str, problem: str) -> None:
        self.what = what
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{what} {os.fsdecode(path)!r}: {problem}")


_ERRNO_PROBLEMS = {
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied (directory is not writable)",
    errno.EPERM: "permission denied (directory is not writable)",
    errno.ELOOP: "symlink loop",
    errno.ENOTDIR: "a component of the path is a file, not a directory",
    errno.ENOSPC: "no space left on device",
    errno.ENAMETOOLONG: "file name too long",
    errno.EDQUOT: "disk quota exceeded",
}


def _problem_of(exc: OSError) -> str:
    return _ERRNO_PROBLEMS.get(exc.errno or 0, exc.strerror or type(exc).__name__)


def _describe_existing(path: Path) -> str | None:
    """What is wrong with ``path`` as it stands (None: absent, or a usable directory)."""
    if os.path.islink(path):
        try:
            os.stat(path)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                return "symlink loop"
            if exc.errno == errno.ENOENT:
                return f"dangling symlink (points to {os.readlink(path)!r}, which does not exist)"
            return _problem_of(exc)
    try:
        os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return _problem_of(exc)
    if os.path.isfile(path):
        return "an existing file, not a directory"
    if not os.path.isdir(path):
        return "exists and is not a directory"
    return None


def _first_blocking_ancestor(path: Path) -> str | None:
    """The problem with the nearest existing ancestor of a missing ``path``, if any."""
    for parent in path.parents:
        if os.path.lexists(parent):
            problem = _describe_existing(parent)
            if problem is None:
                return None
            if "an existing file" in problem:
                return f"{os.fsdecode(parent)!r} is a file, so nothing can be created under it"
            return f"{os.fsdecode(parent)!r}: {problem}"
    return None


def prepare_output_dir(path: Path, what: str) -> Path:
    """Create ``path`` (and its parents) if needed and make sure files can be written in it.

    :param path: the directory.
    :param what: how the user named it (``--output-base``, ``$OPGUARD_TRACE_OUTPUT_BASE``,
        ``--output-dir``), for the message.
    :returns: ``path``.
    :raises OutputLocationError: one line naming the path and the problem.
    """
    problem = _describe_existing(path) if os.path.lexists(path) else None
    if problem is not None:
        raise OutputLocationError(what, path, problem)
    if not os.path.lexists(path):
        blocking = _first_blocking_ancestor(path)
        if blocking is not None:
            raise OutputLocationError(what, path, blocking)
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OutputLocationError(what, path, _problem_of(exc)) from None
    if not os.access(path, os.W_OK | os.X_OK):
        try:
            read_only = bool(os.statvfs(path).f_flag & os.ST_RDONLY)
        except OSError:
            read_only = False
        raise OutputLocationError(
            what,
            path,
            "read-only file system"
            if read_only
            else "permission denied (directory is not writable)",
        )
    return path


def wrap_os_error(what: str, path: Path, exc: OSError) -> OutputLocationError:
    """An :class:`OutputLocationError` for an OS error met while creating under ``path``."""
    return OutputLocationError(what, path, _problem_of(exc))


OUTPUT_BASE_ENV = "OPGUARD_TRACE_OUTPUT_BASE"
DEFAULT_OUTPUT_BASE = Path("opguard_traces")


def trace_output_base(explicit: Path | None = None) -> Path:
    """Where run directories go: ``--output-base``, else ``$OPGUARD_TRACE_OUTPUT_BASE``,
    else ``./opguard_traces``."""
    if explicit is not None:
        return explicit
    env = os.environ.get(OUTPUT_BASE_ENV)
    return Path(env) if env else DEFAULT_OUTPUT_BASE


def check_output_file(output: Path, inputs: Iterable[Path], option: str = "-o") -> None:
    """Refuse an output file that would replace one of ``inputs`` (the same file by
    ``os.path.samefile``: a hard link, a symlink or another spelling of it), or that
    is not a regular file (a device, a FIFO, ``/dev/stdout``: an atomic write would
    replace the node itself), or one whose directory does not exist, or ``-`` (a file
    named ``-``, not standard output). :class:`UsageProblem`, one line, before anything
    is written."""
    if str(output) == "-":  # a file of that name is what it would make
        raise UsageProblem(f"{option} -: give a file name (-o does not write to standard output)")
    try:
        info = output.stat()
    except OSError:  # nothing there yet: its directory must be
        parent = output.parent
        if not parent.is_dir():
            raise UsageProblem(
                f"{option} {os.fsdecode(output)!r}: the directory {os.fsdecode(parent)!r} "
                + ("is not a directory" if parent.exists() else "does not exist")
            ) from None
        return
    if not stat.S_ISREG(info.st_mode):
        raise UsageProblem(
            f"{option} {os.fsdecode(output)!r}: not a regular file (a directory, device"
            " or FIFO); write to a file"
        )
    for source in inputs:
        try:
            same = os.path.samefile(output, source)
        except OSError:
            continue
        if same:
            raise UsageProblem(
                f"{option} {os.fsdecode(output)!r}: is the input {os.fsdecode(source)!r};"
                " write the output elsewhere"
            )


__all__ = [
    "OUTPUT_BASE_ENV",
    "OutputLocationError",
    "check_output_file",
    "prepare_output_dir",
    "trace_output_base",
    "wrap_os_error",
]
