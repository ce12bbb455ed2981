"""Built-in plugin: ``opguard export SRC --format NAME [-o OUT]``.

SRC is a callsite trace (a rank file or ``{name}_combined.json``), a compressed
call tree (``{name}_compressed.json``) or a run directory of one entry (its tree;
a run of several names them). A trace is folded into a tree by the
built-in compressor with no thresholds and no chain folding (nothing is pruned) and
the default hide patterns unless ``--no-default-hide``; then ``--hide``, ``--focus``
and ``--ignore`` apply to the tree's stacks (a pattern that matched nothing is a
warning; a selection that leaves no stack is an error, and no file is written), and
the writer that a plugin's ``opguard_export_formats`` names (built-ins:
``export_formats.py``) writes OUT.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import click

from opguard_core import hookimpl
from opguard_core.cli import exits
from opguard_core.cli.options import verbose_option
from opguard_core.combine.accumulator import TraceAccumulator
from opguard_core.configs.selection import PatternError, Selection, compile_patterns
from opguard_core.errors import ExitCode, InputError, PluginError, ended_by_plugin, one_line
from opguard_core.files.atomic import atomic_write_bytes
from opguard_core.files.lookup import is_directory, is_special_file
from opguard_core.files.output_dirs import check_output_file
from opguard_core.formats import names_a_config
from opguard_core.formats.readers import HEAD, Readers
from opguard_core.formats.stacks import Stack, tree_stacks
from opguard_core.formats.trace import read_bytes, trace_stem
from opguard_core.formats.tree import TREE_FORMAT, check_tree, checked_tree, decode_json
from opguard_core.logs import get_logger
from opguard_core.model import RunOptions
from opguard_core.plugin.manager import OpGuardPluginManager, call_impl
from opguard_core.run.summary import run_tree
from opguard_plugins.stages.compress import compress_trace

Writer = Callable[[list[Stack]], bytes]
SUFFIX = {"collapsed": ".folded", "speedscope": ".speedscope.json", "pprof": ".pb.gz"}


def export_formats(manager: OpGuardPluginManager) -> dict[str, Writer]:
    """Every format any plugin names; the first plugin in call order keeps a name."""
    found: dict[str, Writer] = {}
    for impl in manager.implementations("opguard_export_formats"):
        try:
            result = call_impl(impl, {}) or {}
        except Exception as exc:
            raise PluginError(
                f'plugin "{impl.plugin_name}": opguard_export_formats: {exc}'
            ) from exc
        for name, writer in result.items():
            found.setdefault(name, _answerable(impl.plugin_name, name, writer))
    return found


def _answerable(plugin: str, fmt: str, writer: Writer) -> Writer:
    """``writer``, whose ``SystemExit`` or result other than bytes is a
    :class:`PluginError` naming ``plugin`` (a ``SystemExit(0)`` in it ended
    ``opguard export`` with exit 0 and nothing written)."""

    def write(stacks: list[Stack]) -> bytes:
        try:
            data = writer(stacks)
        except SystemExit as exc:
            raise PluginError(ended_by_plugin(exc.code, plugin)) from None
        if not isinstance(data, bytes):
            raise PluginError(
                f'plugin "{plugin}": export format {fmt!r} returned '
                f"{type(data).__name__}, not bytes"
            )
        return data

    return write


def load_source(
    path: Path, default_hide: bool = True, readers: Readers | None = None
) -> dict[str, Any]:
    """The call tree of SRC: a compressed tree as it is, a trace (of any format
    ``readers`` read) compressed unpruned."""
    if is_special_file(path):  # a FIFO would block, and is read twice
        raise InputError(path, "not a regular file (a FIFO, device or socket)")
    data = read_bytes(path)
    if f'"{TREE_FORMAT}"'.encode() in data[:HEAD]:
        head = decode_json(data, path)
        if isinstance(head, dict) and head.get("format") == TREE_FORMAT:
            return checked_tree(head, path)
        del head
    del data
    accumulator = TraceAccumulator()
    accumulator.add_file(path, readers)
    trace = accumulator.result()
    options = RunOptions(min_count=1, min_fraction=0.0, chains=False, default_hide=default_hide)
    tree = compress_trace(trace, options)
    check_tree(tree, expected_total=trace.total)
    return tree


def select_stacks(
    stacks: list[Stack],
    hide: Sequence[str] = (),
    focus: Sequence[str] = (),
    ignore: Sequence[str] = (),
    unmatched: list[tuple[str, str]] | None = None,
) -> list[Stack]:
    """Drop hidden frames (their callees move up), keep stacks with a frame matching
    ``focus`` (all when empty), then drop stacks with a frame matching ``ignore``.

    A pattern matches a frame name (``module:qualname``, or the op) whole. Every
    pattern is compiled and matched on its own, as in ``opguard run``
    (:mod:`opguard_core.configs.selection`): never joined into one alternation, where inline
    flags, group names and backreferences would change meaning or fail. The
    (option, pattern) of every pattern that matched no frame are appended to
    ``unmatched`` when it is given.
    """
    hidden = compile_patterns(hide, "--hide")
    hid: set[int] = set()
    selection = Selection.of(focus, ignore)
    out = []
    for stack in stacks:
        frames, sites = stack.frames, stack.sites
        if hidden:
            keep = [i for i, f in enumerate(frames) if not _hides(hidden, f, hid)]
            frames = tuple(frames[i] for i in keep)
            sites = tuple(sites[i] for i in keep) if sites else sites
        if selection and not selection.keeps((*frames, stack.op)):
            continue
        out.append(stack._replace(frames=frames, sites=sites))
    if unmatched is not None:
        unmatched.extend(("--hide", p.pattern) for i, p in enumerate(hidden) if i not in hid)
        unmatched.extend(selection.unmatched())
    return out


def _hides(hidden: Sequence[re.Pattern[str]], frame: str, matched: set[int]) -> bool:
    """Whether ``frame`` is hidden; notes which patterns matched it."""
    found = False
    for index, pattern in enumerate(hidden):
        if pattern.fullmatch(frame):
            matched.add(index)
            found = True
    return found


def _regexes(
    ctx: click.Context, param: click.Parameter, values: tuple[str, ...]
) -> tuple[str, ...]:
    try:
        compile_patterns(values, f"--{param.name}")
    except PatternError as exc:
        raise click.BadParameter(str(exc)) from None
    return values


CODES: exits.Codes = {
    ExitCode.OK: None,
    ExitCode.STAGE_FAILED: "the output could not be written, or the selection left nothing",
    ExitCode.INPUT_UNREADABLE: "SRC could not be read",
}


def make_command(manager: OpGuardPluginManager) -> click.Command:
    @click.argument("src", type=click.Path(path_type=Path))
    @click.option(
        "--format",
        "fmt",
        required=True,
        metavar="NAME",
        help="collapsed, speedscope, pprof, or a plugin's format.",
    )
    @click.option(
        "-o",
        "--output",
        type=click.Path(path_type=Path),
        help="Output file (default: beside SRC, its name less its suffixes - .json,"
        " .pt.trace.json, either gzip'd - plus the format's suffix).",
    )
    @click.option(
        "--hide",
        multiple=True,
        metavar="REGEX",
        callback=_regexes,
        help="Hide frames matching REGEX whole (repeatable).",
    )
    @click.option(
        "--focus",
        multiple=True,
        metavar="REGEX",
        callback=_regexes,
        help="Keep only stacks with a frame matching REGEX whole (repeatable).",
    )
    @click.option(
        "--ignore",
        multiple=True,
        metavar="REGEX",
        callback=_regexes,
        help="Drop stacks with a frame matching REGEX whole (repeatable).",
    )
    @click.option(
        "--no-default-hide", is_flag=True, help="For a trace SRC: keep the default plumbing frames."
    )
    @verbose_option
    def export(
        src: Path,
        fmt: str,
        output: Path | None,
        hide: tuple[str, ...],
        focus: tuple[str, ...],
        ignore: tuple[str, ...],
        no_default_hide: bool,
        verbose: int,
    ) -> None:
        """Write SRC (a callsite trace, a compressed tree, or a run directory of one
        entry: its tree) as a flame-graph file."""
        writers = export_formats(manager)
        if fmt not in writers:
            known = (
                f"not one of {', '.join(sorted(writers))}"
                if writers
                else "no export format is installed (is the export_formats plugin disabled?)"
            )
            raise click.BadParameter(f"{fmt!r}: {known}", param_hint="--format")
        if is_directory(src):  # a run directory: its entry's compressed tree
            src = run_tree(src)
        elif names_a_config(src.name):
            raise click.UsageError(
                f"{src}: a YAML config, not a callsite trace, a compressed tree or a run "
                "directory; opguard show, compare and filter read configs"
            )
        out = output or src.with_name(trace_stem(src) + SUFFIX.get(fmt, f".{fmt}"))
        check_output_file(out, [src])
        tree = load_source(src, not no_default_hide, Readers(manager))
        unmatched: list[tuple[str, str]] = []
        all_stacks = tree_stacks(tree)
        stacks = select_stacks(all_stacks, hide, focus, ignore, unmatched)
        for option, pattern in unmatched:
            get_logger().warning("pattern matched nothing", option=option, pattern=pattern)
        Selection.of(focus, ignore).refuse_empty(str(src), "stack", len(all_stacks), len(stacks))
        data = writers[fmt](stacks)
        atomic_write_bytes(out, data)
        click.echo(one_line(str(out)))

    return exits.command("export", CODES)(export)


@hookimpl
def opguard_register_commands(cli: click.Group, manager: OpGuardPluginManager) -> None:
    """Add ``opguard export``; its ``--format`` choices come from ``manager``'s plugins."""
    cli.add_command(make_command(manager))
