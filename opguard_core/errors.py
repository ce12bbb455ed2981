"""Error types and exit codes shared by the runner, the CLI and plugins."""

from __future__ import annotations

import enum
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class ExitCode(enum.IntEnum):
    """Process exit codes of ``opguard``."""

    OK = 0
    #: the run finished but at least one stage failed for at least one entry
    STAGE_FAILED = 1
    #: bad command line (unknown option, blocked essential plugin, ...)
    USAGE_ERROR = 2
    #: a plugin could not be loaded or registered
    PLUGIN_ERROR = 3
    #: ``opguard check``: a trace or the config could not be read
    INPUT_UNREADABLE = 4
    #: stopped by SIGINT or SIGTERM
    INTERRUPTED = 130


class OpGuardError(Exception):
    """Base class of every error OpGuard reports to a user as one line."""


class InputError(OpGuardError):
    """An input document (trace, tree or config) is unusable.

    The message always names the file and the problem, on one line.
    """

    def __init__(self, path: Path | str | None, problem: str) -> None:
        self.path = str(path) if path is not None else None
        self.problem = " ".join(problem.split())
        where = f"{self.path}: " if self.path else ""
        super().__init__(f"{where}{self.problem}")


class PluginError(OpGuardError):
    """A plugin failed to load, register or validate; the message names it."""


class InvariantError(OpGuardError):
    """A stage produced an output that breaks the data contract."""


class Interrupted(BaseException):
    """Raised from the SIGTERM/SIGINT handler so that ``finally`` blocks run."""

    def __init__(self, signal_name: str) -> None:
        self.signal_name = signal_name
        super().__init__(signal_name)


@contextmanager
def reported_errors(verbose: bool) -> Iterator[None]:
    """For a command's body: an :class:`OpGuardError` becomes one line on stderr
    (``opguard: error: ...``) and exit code ``STAGE_FAILED``; with ``--verbose`` it
    is re-raised, traceback and all."""
    try:
        yield
    except OpGuardError as exc:
        if verbose:
            raise
        print(f"opguard: error: {exc}", file=sys.stderr)
        sys.exit(int(ExitCode.STAGE_FAILED))
