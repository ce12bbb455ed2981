"""Exit codes, in one place: what each command's codes mean, the one mapping from
errors to codes, and the ``Exit codes:`` section of every command's ``--help``.

A command is declared with :func:`command` and the codes it can end with. Its
callback returns an :class:`~opguard_core.errors.ExitCode` (or None for ``OK``) or
raises; an :class:`~opguard_core.errors.OpGuardError` becomes one line on stderr
(``opguard: error: …``) and the code the error carries (``exit_code``), after its
traceback with ``--verbose`` (the code is the same). click's own usage errors exit 2.
The help text lists the declared codes from the same table, so it cannot drift from
what the command does; ``tests/test_exit_codes.py`` holds each documented code to a
run that ends with it.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import inspect
import os
import sys
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import click

from opguard_core.errors import ExitCode, OpGuardError, one_line

#: What each code means when a command does not say more.
MEANING: dict[ExitCode, str] = {
    ExitCode.OK: "success",
    ExitCode.STAGE_FAILED: "the command could not do all it was asked",
    ExitCode.USAGE_ERROR: "bad command line or option value",
    ExitCode.PLUGIN_ERROR: "a plugin could not be loaded, or failed",
    ExitCode.DIVERGENCE: "ranks diverge (an error finding, with --fail-on-divergence)",
    ExitCode.INPUT_UNREADABLE: "an input (trace, config, run directory) could not be read",
    ExitCode.COMMAND_NOT_EXECUTABLE: "COMMAND is not executable (a directory, no permission)",
    ExitCode.COMMAND_NOT_FOUND: "COMMAND was not found",
    ExitCode.INTERRUPTED: "stopped by SIGINT or SIGTERM",
    ExitCode.GUARD_FAILED: "the program was not checked (opguard guard)",
}

#: The codes every command can end with, whatever it declares: a bad command line
#: and a plugin that cannot load (the group loads plugins before any command runs).
ALWAYS: dict[ExitCode, str] = {
    ExitCode.USAGE_ERROR: MEANING[ExitCode.USAGE_ERROR],
    ExitCode.PLUGIN_ERROR: MEANING[ExitCode.PLUGIN_ERROR],
}

#: A command's codes: the code, and what it means for this command (None: MEANING's).
Codes = Mapping[ExitCode, str | None]


def exit_codes(codes: Codes) -> dict[ExitCode, str]:
    """Every code a command declared with ``codes`` can end with, and its meaning."""
    merged = {code: text or MEANING[code] for code, text in codes.items()}
    return dict(sorted({**ALWAYS, **merged}.items()))


def help_section(codes: Codes, extra: str = "") -> str:
    """The ``Exit codes:`` paragraph of a command's help (``extra``: a sentence first)."""
    lines = [f"{int(code)} {text}" for code, text in exit_codes(codes).items()]
    return "\b\nExit codes:" + (f" {extra}" if extra else "") + "\n" + "\n".join(lines)


def code_of(exc: OpGuardError) -> ExitCode:
    """The one mapping from an error to an exit code: the code it carries."""
    return exc.exit_code


def command(
    name: str,
    codes: Codes,
    *,
    extra: str = "",
    cls: type[click.Command] | None = None,
    **kwargs: Any,
) -> Callable[[Callable[..., ExitCode | int | None]], click.Command]:
    """``click.command(name)`` whose help ends with its exit codes and whose callback's
    result is the exit code (None: ``OK``); an :class:`OpGuardError` it raises exits
    with :func:`code_of` after one line on stderr (after the traceback with ``--verbose``).
    The callback must take ``verbose`` (``-v``, counted) or be given ``-v`` by the
    group."""

    def decorate(callback: Callable[..., ExitCode | int | None]) -> click.Command:
        @functools.wraps(callback)
        def run(*args: Any, **params: Any) -> None:
            ctx = click.get_current_context()
            verbose = bool(params.get("verbose") or (ctx.obj or {}).get("verbose"))
            try:
                code = callback(*args, **params)
            except OpGuardError as exc:
                if verbose:  # the traceback too, and the same code
                    traceback.print_exc(file=sys.stderr)
                click.echo(f"opguard: error: {one_line(str(exc))}", err=True)
                ctx.exit(int(code_of(exc)))
            ctx.exit(int(ExitCode.OK if code is None else code))

        made = click.command(name, cls=cls, **kwargs)(run)
        # the docstring dedented (click leaves that to a help it builds itself): its
        # lines would otherwise keep their indent, and be wrapped with it
        own = inspect.cleandoc(made.help or "")
        made.help = (own + "\n\n" + help_section(codes, extra)).strip()
        made.opguard_exit_codes = exit_codes(codes)  # type: ignore[attr-defined]
        return made

    return decorate


#: the exit code of a command that asked to end without teardown, once it is known
_ending: dict[str, int | bool] = {"asked": False}


def end_without_teardown() -> None:
    """Ask that the process end as soon as the command's exit code is known and the
    exit handlers registered since start-up have run (``os._exit``), without
    tearing its objects down one by one: ``opguard run`` leaves its last entry's
    trace and tree to the exit (0.16 s to free at 4 ranks × 160,000 callsites).
    Only where the console script watches the exit (:func:`watch_exit`): a command
    invoked in a process of the caller's, as tests do, ends as any function returns,
    and that process exits as it would have."""
    _ending["asked"] = True


def watch_exit() -> None:
    """Called first by the console script, in a process that is its own: registers
    :func:`_end_now` before any other exit handler of the command (atexit runs the
    last registered first, so it runs after them all)."""
    _ending["watching"] = True
    atexit.register(_end_now)


def exit_code_known(code: object) -> None:
    """The console script's exit code (``SystemExit.code``), for :func:`_end_now`; a
    message for a code (``SystemExit("…")``) leaves the exit to Python, which prints it."""
    if code is None or isinstance(code, int):
        _ending["code"] = code or 0


def _end_now() -> None:
    if not (_ending.get("watching") and _ending["asked"] and "code" in _ending):
        return
    if "logging" in sys.modules:  # its own exit handler was registered before ours
        sys.modules["logging"].shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe (| head)
            stream.flush()
    os._exit(int(_ending["code"]))


__all__ = [
    "ALWAYS",
    "MEANING",
    "code_of",
    "command",
    "end_without_teardown",
    "exit_code_known",
    "exit_codes",
    "help_section",
    "watch_exit",
]
