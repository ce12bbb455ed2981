"""Options that several commands share, each defined once.

Commands (the core's and plugins') take their common options from here, so
``--input``, ``--base-dir``, ``--basic``, ``--focus``/``--ignore``, ``--config``,
``-o``, ``--format`` and ``-v`` read and mean the same everywhere. This module and
:mod:`opguard_core.cli.exits` are what a command plugin imports of the CLI; the group
itself (:mod:`opguard_core.cli.app`) is not for plugins.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])


class FiniteFloatRange(click.FloatRange):
    """click's ``FloatRange`` that refuses ``nan`` and the infinities: ``nan`` compares
    false with every bound, so a range lets it through (``--skew nan`` turned the
    check off, ``--tolerance nan`` printed ``tolerance nan``)."""

    name = "finite float range"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{number!r} is not a finite number", param, ctx)
        return number


DISABLE_OPTION = "--disable-plugin"


def disable_option(func: F) -> F:
    """``--disable-plugin NAME``: read from the arguments before any plugin loads
    (:func:`opguard_core.cli.app.disabled_from_args`); here only for ``--help``."""
    return click.option(
        DISABLE_OPTION,
        "disable_plugin",
        multiple=True,
        metavar="NAME",
        help="Block a plugin before it loads (repeatable; also $OPGUARD_DISABLE_PLUGINS).",
        expose_value=False,
        is_eager=True,
    )(func)


def spread_inputs(args: Sequence[str]) -> list[str]:
    """Rewrite ``--input A B C`` as ``--input A --input B --input C``.

    The shell expands ``X_rank*.json`` into several words after one ``--input``;
    this keeps them, in order, as inputs of their own.
    """
    out: list[str] = []
    taking = False
    for arg in args:
        if arg == "--":
            taking = False
        elif arg in ("--input", "-i"):
            out.append(arg)
            taking = False
            out.append("\0")  # placeholder: the value follows
            continue
        elif taking and not arg.startswith("-"):
            out += ["--input", arg]
            continue
        else:
            taking = False
        if out and out[-1] == "\0":
            out[-1] = arg
            taking = not arg.startswith("-")
            continue
        out.append(arg)
    if out and out[-1] == "\0":
        out.pop()
    return out


class InputsCommand(click.Command):
    """A command that accepts several words after one ``--input`` (:func:`spread_inputs`)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, spread_inputs(args))


#: ``--input FILE|PATTERN`` (repeatable; with :class:`InputsCommand`, several words)
input_option = click.option(
    "--input",
    "-i",
    "input_options",
    multiple=True,
    metavar="FILE|PATTERN",
    help="A trace file or a quoted glob; shell-expanded rank files may follow it "
    "(repeatable). Relative to --base-dir.",
)

#: ``--base-dir DIR``
base_dir_option = click.option(
    "--base-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("."),
    show_default=True,
    help="Directory that relative inputs resolve against.",
)

#: ``-v/--verbose`` (counted; ``opguard -v`` counts too)
verbose_option = click.option(
    "-v", "--verbose", count=True, help="More detail in logs; tracebacks on errors."
)

#: ``--config CONFIG``: the instrumentation config a command enforces
config_option = click.option(
    "--config",
    "config_path",
    required=True,
    type=click.Path(path_type=Path),
    help="The instrumentation config to enforce (a file, or a run directory: its final config).",
)

#: ``-o/--output FILE``
output_option = click.option(
    "--output",
    "-o",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write here (atomically) instead of stdout.",
)

#: ``--format text|json``
format_option = click.option(
    "--format",
    "fmt",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="Output format.",
)


def basic_options(func: F) -> F:
    """``--basic`` and ``--basic-list``, shared by ``opguard run`` and ``opguard filter``."""
    func = click.option(
        "--basic-list",
        type=click.Path(exists=True, dir_okay=False, path_type=Path),  # before any stage
        default=None,
        help="YAML file replacing the basic filter's list of torch utilities.",
    )(func)
    return click.option("--basic", is_flag=True, help="Run the built-in basic filter.")(func)


def check_basic(disabled: Sequence[str], basic: bool, basic_list: Path | None) -> None:
    """``--basic`` with the basic filter disabled, and ``--basic-list`` without
    ``--basic`` (a list that would be silently ignored), are usage errors."""
    if basic and "basic_filter" in disabled:
        raise click.UsageError("--basic needs the basic_filter plugin, which is disabled")
    if basic_list is not None and not basic:
        raise click.UsageError("--basic-list replaces the basic filter's list: it needs --basic")


def selection_options(what: str) -> Callable[[F], F]:
    """``--focus REGEX`` and ``--ignore REGEX`` (pprof's), keeping or dropping ``what``
    (``callsites with a frame, api or op``, ``entries with a context frame or
    target``) that matches REGEX whole."""

    def add(func: F) -> F:
        func = click.option(
            "--ignore",
            multiple=True,
            metavar="REGEX",
            help=f"Drop {what} matching REGEX whole (repeatable).",
        )(func)
        return click.option(
            "--focus",
            multiple=True,
            metavar="REGEX",
            help=f"Keep only {what} matching REGEX whole (repeatable).",
        )(func)

    return add


__all__ = [
    "DISABLE_OPTION",
    "InputsCommand",
    "base_dir_option",
    "basic_options",
    "check_basic",
    "config_option",
    "disable_option",
    "format_option",
    "input_option",
    "output_option",
    "selection_options",
    "spread_inputs",
    "verbose_option",
]
