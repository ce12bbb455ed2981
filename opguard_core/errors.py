"""Error types and exit codes shared by the runner, the CLI and plugins."""

from __future__ import annotations

import enum
import re
from pathlib import Path


class ExitCode(enum.IntEnum):
    """Process exit codes of ``opguard`` (what each means to each command:
    :mod:`opguard_core.cli.exits`, and every command's ``--help``)."""

    OK = 0
    #: the command could not do all it was asked: a stage failed (``run``), an
    #: error-severity violation (``check``, ``guard``), an output not written, ...
    STAGE_FAILED = 1
    #: bad command line (unknown option, blocked essential plugin, unusable output dir)
    USAGE_ERROR = 2
    #: a plugin could not be loaded or registered, or failed
    PLUGIN_ERROR = 3
    #: ``--fail-on-divergence`` and an error-severity divergence finding (and no failed stage)
    DIVERGENCE = 4
    #: an input (trace, config, run directory) could not be read
    INPUT_UNREADABLE = 5
    #: the command to run (``opguard trace``/``guard -- COMMAND``) is not executable
    #: (a directory, no execute permission), as a shell says it
    COMMAND_NOT_EXECUTABLE = 126
    #: the command to run was not found, as a shell says it
    COMMAND_NOT_FOUND = 127
    #: stopped by SIGINT or SIGTERM
    INTERRUPTED = 130
    #: ``opguard guard``: the program was not checked (no config entries, no guard
    #: started, one could not start or write its report, or no op was checked)
    GUARD_FAILED = 6


#: characters that could start a new line, restyle a terminal or reorder what it shows:
#: C0 and C1 controls (newline, carriage return, ESC of ANSI sequences, BEL, NEL, ...),
#: DEL, U+2028/2029, and the bidirectional formatting characters (U+061C, U+200E/200F,
#: U+202A-202E, U+2066-2069: "Trojan Source" reordering)
_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]")
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


def plural(count: int, word: str) -> str:
    """``1 entry``, ``2 entries``, ``3 findings``: a count and its English noun."""
    if count == 1:
        return f"{count} {word}"
    if word.endswith("y") and word[-2:-1] not in "aeiou":
        return f"{count} {word[:-1]}ies"
    return f"{count} {word}{'es' if word.endswith(('s', 'x', 'ch', 'sh')) else 's'}"


class OpGuardError(Exception):
    """Base class of every error OpGuard reports to a user as one line; a command that
    ends with one exits with its ``exit_code``."""

    exit_code: ExitCode = ExitCode.STAGE_FAILED


class InputError(OpGuardError):
    """An input document (trace, tree or config) is unusable.

    The message always names the file and the problem, on one line.
    """

    exit_code = ExitCode.INPUT_UNREADABLE

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

    exit_code = ExitCode.PLUGIN_ERROR


def ended_by_plugin(code: object, plugin: str | None) -> str:
    """What is said of a plugin that raised ``SystemExit(code)``: the process would
    have ended (often with exit 0, having done nothing) where a plugin was called."""
    by = f" by plugin {plugin}" if plugin else ""
    return f"SystemExit({code!r}) raised{by}: a plugin may not end the process"


class UsageProblem(OpGuardError):
    """The command line asks for something that cannot be (found after parsing)."""

    exit_code = ExitCode.USAGE_ERROR


class InvariantError(OpGuardError):
    """A stage produced an output that breaks the data contract."""


class Interrupted(BaseException):
    """Raised from the SIGTERM/SIGINT handler so that ``finally`` blocks run."""

    def __init__(self, signal_name: str) -> None:
        self.signal_name = signal_name
        super().__init__(signal_name)


class CommandNotRunnable(OpGuardError):
    """The command ``opguard trace``/``guard`` was asked to run could not be started:
    not found (exit 127) or not executable (exit 126), the codes a shell uses."""

    def __init__(self, command: str, found: bool) -> None:
        self.exit_code = ExitCode.COMMAND_NOT_EXECUTABLE if found else ExitCode.COMMAND_NOT_FOUND
        problem = "is not executable" if found else "command not found"
        super().__init__(f"{one_line(command)}: {problem}")
