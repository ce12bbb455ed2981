"""Built-in plugin: commands on existing configs (docs/configs.md).

``opguard compare BASE OTHER``, ``opguard merge A B [C…] -o OUT``, ``opguard filter
CONFIG -o OUT`` and ``opguard show CONFIG``. Each CONFIG may be a config file or a
run directory: its final config (the filtered one when the run filtered), or for
``filter`` the final config before filtering. They do what the run does, with the
run's code: compare's difference is :func:`opguard_plugins.stages.compare.diff_configs`,
merge folds through the ``opguard_merge`` hook, filter runs the run's filter chain
(:mod:`opguard_core.configs.chain`, installed filter plugins included), and
``--focus``/``--ignore`` are :mod:`opguard_core.configs.selection`'s.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import click
from click.decorators import FC
from ruamel.yaml.comments import CommentedMap

from opguard_core import hookimpl
from opguard_core.cli import exits
from opguard_core.cli.options import (
    basic_options,
    check_basic,
    format_option,
    selection_options,
    verbose_option,
)
from opguard_core.combine.accumulator import gc_paused
from opguard_core.configs.chain import (
    active_filters,
    apply_filters,
    fold,
    record_setting,
)
from opguard_core.configs.selection import PatternError, Selection, select_entries
from opguard_core.errors import ExitCode, OpGuardError, one_line
from opguard_core.files.atomic import atomic_write_text
from opguard_core.files.output_dirs import check_output_file
from opguard_core.formats.config import dump_config, entry_key, load_config
from opguard_core.formats.op_ranks import entry_op_ranks, records_op_ranks
from opguard_core.formats.tree import ranks_to_ranges
from opguard_core.logs import get_logger
from opguard_core.model import RunOptions
from opguard_core.plugin.manager import OpGuardPluginManager
from opguard_core.run.summary import config_source, without_surrogates
from opguard_plugins.stages.compare import Sort, diff_configs, diff_to_json, render_diff
from opguard_plugins.stages.merge import differing_settings, shared_sources

#: how many ops ``show`` names per entry
MAIN_OPS = 3


def read_input(path: Path, filtered: bool = True) -> tuple[Path, CommentedMap]:
    """The config ``path`` names (a file, or a run directory's final config)."""
    source = config_source(path, filtered)
    return source, load_config(source)


def _selection(focus: Sequence[str], ignore: Sequence[str]) -> Selection:
    try:
        return Selection.of(focus, ignore)
    except PatternError as exc:
        raise click.UsageError(str(exc)) from None


def _warn_unmatched(selection: Selection) -> None:
    log = get_logger()
    for option, pattern in selection.unmatched():
        log.warning("pattern matched nothing", option=option, pattern=pattern)


def _config_argument(name: str) -> Callable[[FC], FC]:
    return click.argument(name, type=click.Path(path_type=Path))


_selection_options = selection_options("entries with a context frame or target")

#: the codes of a command that writes a config
WRITES: exits.Codes = {
    ExitCode.OK: None,
    ExitCode.STAGE_FAILED: "the output could not be written",
    ExitCode.INPUT_UNREADABLE: None,
}
#: filter's: its selection may also leave nothing
FILTERS: exits.Codes = {
    **WRITES,
    ExitCode.STAGE_FAILED: "the output could not be written, or --focus/--ignore left no entry",
}


# ------------------------------------------------------------------ compare


@_config_argument("base")
@_config_argument("other")
@click.option(
    "--top", type=click.IntRange(min=0), default=0, show_default=True, help="0 shows all."
)
@format_option
@click.option(
    "--sort",
    type=click.Choice(["delta", "key"]),
    default="delta",
    show_default=True,
    help="Largest change first, or by (target, context).",
)
@click.option("--fail-on-change", is_flag=True, help="Exit 1 when the configs differ.")
@verbose_option
def compare(
    base: Path,
    other: Path,
    top: int | None,
    fmt: str,
    sort: str,
    fail_on_change: bool,
    verbose: int,
) -> ExitCode:
    """Compare two configs (or run directories): totals, only in one, changed."""
    base_path, first = read_input(base)
    other_path, second = read_input(other)
    diff = diff_configs(first, second, str(base_path), str(other_path))
    if fmt == "json":
        # a file name that is not UTF-8 with its odd bytes as \xNN: JSON cannot carry them
        document = without_surrogates(diff_to_json(diff, cast(Sort, sort), top or None))
        click.echo(json.dumps(document, indent=2))
    else:
        click.echo(render_diff(diff, cast(Sort, sort), top or None), nl=False)
    return ExitCode.STAGE_FAILED if fail_on_change and diff.differs else ExitCode.OK


compare_command = exits.command(
    "compare",
    {
        ExitCode.OK: "done (with --fail-on-change: the configs are the same)",
        ExitCode.STAGE_FAILED: "--fail-on-change and the configs differ",
        ExitCode.INPUT_UNREADABLE: None,
    },
)(compare)


# ------------------------------------------------------------------ merge


def make_merge(manager: OpGuardPluginManager) -> click.Command:
    @click.argument("configs", nargs=-1, type=click.Path(path_type=Path))
    @click.option("-o", "--output", type=click.Path(path_type=Path), required=True)
    @verbose_option
    def merge(configs: tuple[Path, ...], output: Path, verbose: int) -> None:
        """Merge configs (or run directories) as the run does: ((A+B)+C)+…"""
        if len(configs) < 2:
            raise click.UsageError("give at least two configs to merge")
        with gc_paused():  # as in the run: a config is acyclic, and GC passes cost half
            inputs = [read_input(path) for path in configs]
            check_output_file(output, [source for source, _ in inputs])
            shared = shared_sources([config for _, config in inputs])
            if shared:
                get_logger().warning(
                    f"{', '.join(shared)} in several configs: two recordings of one "
                    "source, their counts and steps are added (a config twice counts twice)",
                    sources=shared,
                )
            differ = differing_settings([config for _, config in inputs])
            if differ:
                get_logger().warning(
                    f"the configs were made with different settings ({', '.join(differ)}): "
                    "the merged config records one value of each, and check makes traces "
                    "into configs with it; merge configs made alike",
                    settings=differ,
                )
            merged = fold(manager, [config for _, config in inputs])
            atomic_write_text(output, dump_config(merged))
            # freed while the GC is paused: re-enabled, its first pass would otherwise
            # walk every object the configs hold (a fifth of the command's time)
            del inputs, merged
        click.echo(one_line(str(output)))

    return exits.command("merge", WRITES)(merge)


# ------------------------------------------------------------------ filter


def _record_selection(config: CommentedMap, focus: Sequence[str], ignore: Sequence[str]) -> None:
    """``meta.settings.filter_focus`` / ``filter_ignore``: the entry patterns applied."""
    record_setting(config, "filter_focus", focus)
    record_setting(config, "filter_ignore", ignore)


def make_filter(manager: OpGuardPluginManager) -> click.Command:
    @_config_argument("config")
    @basic_options
    @_selection_options
    @click.option("-o", "--output", type=click.Path(path_type=Path), required=True)
    @verbose_option
    def filter_(
        config: Path,
        basic: bool,
        basic_list: Path | None,
        focus: tuple[str, ...],
        ignore: tuple[str, ...],
        output: Path,
        verbose: int,
    ) -> None:
        """Filter a config (or a run's final config) with the run's filter chain."""
        selection = _selection(focus, ignore)
        check_basic(manager.disabled, basic, basic_list)
        options = RunOptions(basic=basic, basic_list=basic_list, verbose=bool(verbose))
        with gc_paused():
            source, loaded = read_input(config, filtered=False)
            check_output_file(output, [source])
            if selection:
                kept = select_entries(loaded, selection)
                _warn_unmatched(selection)
                selection.refuse_empty(str(config), "entry", len(loaded["entries"]), len(kept))
                loaded["entries"][:] = kept
                _record_selection(loaded, focus, ignore)
            filtered, _ = apply_filters(active_filters(manager, options), loaded, options)
            atomic_write_text(output, dump_config(filtered))
        click.echo(one_line(str(output)))

    return exits.command("filter", FILTERS)(filter_)


# ------------------------------------------------------------------ show


def show_rows(
    config: dict[str, Any],
    selection: Selection,
    tags: Sequence[str] = (),
    top: int | None = None,
) -> tuple[list[dict[str, Any]], int]:
    """The entries ``show`` lists, largest count first (ties by key), cut to ``top``;
    and how many were selected before the cut."""
    total = int((config.get("meta") or {}).get("total", 0) or 0)
    wanted = set(tags)
    chosen = [e for e in select_entries(config, selection) if wanted <= set(e.get("tags") or ())]
    chosen.sort(key=lambda e: (-int(e.get("count", 0)), entry_key(e)))
    rows = []
    recorded = records_op_ranks(config)
    for entry in chosen[:top] if top else chosen:
        count = int(entry.get("count", 0))
        ops = sorted((entry.get("ops") or {}).items(), key=lambda kv: (-kv[1], kv[0]))
        # the ops that not all of the entry's ranks ran (config version 6)
        some = entry_op_ranks(entry) if recorded else {}
        rows.append(
            {
                "target": str(entry["target"]),
                "context": [str(c) for c in entry.get("context") or ()],
                "kind": entry.get("kind"),
                "count": count,
                "share": round(count / total, 6) if total else None,
                "main_ops": [
                    {"op": str(op), "count": int(n), **({"ranks": some[op]} if op in some else {})}
                    for op, n in ops[:MAIN_OPS]
                ],
                "tags": [str(t) for t in entry.get("tags") or ()],
            }
        )
    return rows, len(chosen)


def _cells(row: dict[str, Any]) -> list[str]:
    """The row's table cells, control characters escaped (:func:`one_line`): a name
    from a config can neither forge a row nor send a terminal an escape sequence."""
    share = "" if row["share"] is None else f"{100 * row['share']:.1f}%"
    ops = ", ".join(
        f"{o['op']} {o['count']}" + (f" (ranks {_ranks_text(o['ranks'])})" if "ranks" in o else "")
        for o in row["main_ops"]
    )
    names = [row["target"], " > ".join(row["context"]), ops]
    return [str(row["count"]), share, *(one_line(name) for name in names)]


def _ranks_text(ranks: list[int]) -> str:
    """``0-3,7``: ranks as ranges, short enough for a table cell."""
    return ",".join(
        f"{item[0]}-{item[1]}" if isinstance(item, list) else str(item)
        for item in ranks_to_ranges(ranks)
    )


HEADERS = ["count", "share", "target", "context", "main ops"]


def plain_table(rows: list[dict[str, Any]]) -> str:
    """The rows as aligned text (numbers right-aligned, no trailing spaces)."""
    cells = [HEADERS, *[_cells(r) for r in rows]]
    widths = [max(len(c[i]) for c in cells) for i in range(len(HEADERS))]
    lines = []
    for line in cells:
        parts = [
            text.rjust(width) if i < 2 else text.ljust(width)
            for i, (text, width) in enumerate(zip(line, widths, strict=True))
        ]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines) + "\n"


def _on_terminal() -> bool:
    return sys.stdout.isatty()


def _rich_table(title: str, rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    # Text, not str: rich would read ``[...]`` in a name as console markup
    table = Table(title=Text(title), title_justify="left")
    for i, header in enumerate(HEADERS):
        table.add_column(header, justify="right" if i < 2 else "left", overflow="fold")
    for row in rows:
        table.add_row(*(Text(cell) for cell in _cells(row)))
    Console().print(table)


@_config_argument("config")
@click.option(
    "--top", type=click.IntRange(min=0), default=20, show_default=True, help="0 shows all."
)
@_selection_options
@click.option(
    "--tag",
    "tags",
    multiple=True,
    metavar="TAG",
    help="Only entries with TAG (repeatable: with every TAG given).",
)
@format_option
@verbose_option
def show(
    config: Path,
    top: int,
    focus: tuple[str, ...],
    ignore: tuple[str, ...],
    tags: tuple[str, ...],
    fmt: str,
    verbose: int,
) -> None:
    """The largest entries of a config (or a run's final config), like pprof -top."""
    selection = _selection(focus, ignore)
    path, loaded = read_input(config)
    rows, selected = show_rows(loaded, selection, tags, top or None)
    _warn_unmatched(selection)
    selection.refuse_empty(str(path), "entry", len(loaded["entries"]), selected)
    if tags and loaded["entries"] and not selected:  # as a --focus that keeps nothing
        known = sorted({str(t) for e in loaded["entries"] for t in e.get("tags") or ()})
        raise OpGuardError(
            one_line(
                f"{path}: nothing left: no entry has --tag {' --tag '.join(tags)} "
                f"(the config's tags: {', '.join(known) or 'none'})"
            )
        )
    meta = loaded.get("meta") or {}
    head = {
        "config": str(path),
        "source": loaded.get("source"),
        # a config without them (hand-written, or merged with one) does not know them
        "total": int(meta["total"]) if meta.get("total") is not None else None,
        "ranks": [int(r) for r in meta["ranks"]] if meta.get("ranks") is not None else None,
        "entries_in_config": len(loaded["entries"]),
        "entries_selected": selected,
        "shown": len(rows),
    }
    if fmt == "json":
        click.echo(json.dumps(without_surrogates({**head, "entries": rows}), indent=2))
        return
    title = one_line(
        f"{head['config']}: {head['source']}, "
        + ("ops unknown" if head["total"] is None else f"{head['total']} ops")
        + (", ranks unknown" if head["ranks"] is None else f" on ranks {head['ranks']}")
        + "; "
        f"showing {len(rows)} of {selected} entries ({head['entries_in_config']} in the config)"
    )
    if _on_terminal():
        _rich_table(title, rows)
    else:
        click.echo(title)
        click.echo(plain_table(rows), nl=False)


show_command = exits.command(
    "show",
    {
        ExitCode.OK: None,
        ExitCode.STAGE_FAILED: "--focus/--ignore left no entry",
        ExitCode.INPUT_UNREADABLE: None,
    },
)(show)


@hookimpl
def opguard_register_commands(cli: click.Group, manager: OpGuardPluginManager) -> None:
    """Add ``opguard compare``, ``merge``, ``filter`` and ``show``."""
    for command in (compare_command, make_merge(manager), make_filter(manager), show_command):
        cli.add_command(command)
