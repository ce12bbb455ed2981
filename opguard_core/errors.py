"""Error types and exit codes shared by the runner, the CLI and plugins."""

from __future__ import annotations

import enum
import re
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
    #: ``--fail-on-divergence`` and an error-severity divergence finding (and no failed stage)
    DIVERGENCE = 4
    #: ``opguard check``/``guard``: a trace or the config could not be read
    INPUT_UNREADABLE = 5
    #: stopped by SIGINT or SIGTERM
    INTERRUPTED = 130


#: characters that could start a new line or restyle a terminal: C0 and C1 controls
#: (newline, carriage return, ESC of ANSI sequences, NEL, ...), DEL, U+2028/2029
_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    named = _NAMED.get(char)
    if named is not None:
        return named
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def one_line(text: str) -> str:
    """``text`` with every control character escaped (``\\n``, ``\\x1b``,
    ``\\u2028``, ...): what a user's string becomes in an error, a log line or the
    comparison log, so no input can forge a line or an ANSI sequence."""
    return _CONTROLS.sub(_escape, text)


class OpGuardError(Exception):
    """Base class of every error OpGuard reports to a user as one line."""


class InputError(OpGuardError):
    """An input document (trace, tree or config) is unusable.

    The message always names the file and the problem, on one line.
    """

    def __init__(self, path: Path | str | None, problem: str) -> None:
        self.path = str(path) if path is not None else None
        self.problem = one_line(" ".join(problem.split()))
        where = f"{one_line(self.path)}: " if self.path else ""
        super().__init__(f"{where}{self.problem}")


class WriteError(OpGuardError, OSError):
    """Writing an artifact failed (disk full, file too large, ...): one line naming the
    file, and still an ``OSError`` with the original ``errno``."""

    def __init__(self, path: Path | str, error: OSError) -> None:
        reason = error.strerror or str(error) or type(error).__name__
        super().__init__(error.errno, f"{one_line(str(path))}: cannot write: {one_line(reason)}")

    def __str__(self) -> str:
        return str(self.strerror)


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
