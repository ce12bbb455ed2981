"""Built-in plugin: ``report.html`` in every run directory, and ``opguard report RUN_DIR``.

One self-contained file (CSS and our own small JavaScript inlined from
``_report/``, no network): the run summary and stage timings; per entry an icicle
graph of the compressed tree (click to zoom, hover for counts and ops), the config's
entries as a sortable, searchable table, and the divergence findings when
``{name}_divergence.json`` exists; the comparison logs. Only the compressed tree is
embedded (slimmed to name, kind, count, own ops), never the raw callsites.
"""

from __future__ import annotations

import html
from collections.abc import Mapping
from importlib.resources import files
from pathlib import Path
from typing import Any

import click
import msgspec

from opguard_core import hookimpl
from opguard_core.cli import exits
from opguard_core.cli.options import verbose_option
from opguard_core.errors import ExitCode, InputError
from opguard_core.files.atomic import atomic_write_text, safe_child
from opguard_core.formats.config import load_config
from opguard_core.formats.deep_json import encode_compact
from opguard_core.formats.trace import read_bytes
from opguard_core.formats.tree import load_tree, node_target

REPORT_NAME = "report.html"
SUMMARY_NAME = "pipeline_summary.json"
#: configs with more entries than this get a note instead of a table
MAX_CONFIG_ROWS = 2_000


def slim_tree(node: dict[str, Any], is_root: bool = True) -> dict[str, Any]:
    """What the graph draws: ``n`` name, ``k`` kind, ``c`` count, ``o`` own ops,
    ``ch`` children (iterative, so deep trees do not hit the recursion limit)."""
    out: dict[str, Any] = {}
    todo: list[tuple[dict[str, Any], dict[str, Any], bool]] = [(node, out, is_root)]
    while todo:
        src, dst, root = todo.pop()
        dst["n"] = "all" if root else node_target(src)
        dst["k"] = None if root else src.get("kind")
        dst["c"] = src["count"]
        dst["o"] = src["self_ops"]
        dst["ch"] = []
        for child in src.get("children", []):
            slot: dict[str, Any] = {}
            dst["ch"].append(slot)
            todo.append((child, slot, False))
    return out


def config_rows(config: Any) -> list[list[Any]]:
    rows = []
    for e in config["entries"]:
        ops = e.get("ops") or {}
        ranks = e.get("ranks")
        rows.append(
            [
                str(e["target"]),
                str(e.get("kind") or ""),
                " > ".join(str(c) for c in e.get("context") or []),
                ", ".join(str(t) for t in e.get("tags") or []),
                ", ".join(f"{op} {n}" for op, n in sorted(ops.items(), key=lambda kv: -kv[1])),
                int(e.get("count") or 0),
                len(ranks)
                if ranks is not None
                else len((config.get("meta") or {}).get("ranks") or []),
            ]
        )
    return rows


def _short_ranks(ranks: list[Any], shown: int = 8) -> str:
    """A finding's ranks for the table: the first few, then how many there are, so the
    report does not grow with the number of ranks."""
    text = ", ".join(map(str, ranks[:shown]))
    return text + (f", … ({len(ranks)} ranks)" if len(ranks) > shown else "")


def divergence_rows(path: Path) -> list[list[Any]]:
    """Findings of ``{name}_divergence.json`` (a list, or an object with
    ``findings``); an unreadable or unexpected file gives none."""
    try:
        doc = msgspec.json.decode(path.read_bytes())
    except (OSError, msgspec.DecodeError):
        return []
    found = doc.get("findings") if isinstance(doc, dict) else doc
    if not isinstance(found, list):
        return []
    rows = []
    for f in found:
        if not isinstance(f, dict):
            continue
        ranks = f.get("ranks")
        rows.append(
            [
                str(f.get("severity", "")),
                str(f.get("kind", "")),
                str(f.get("target", "")),
                str(f.get("op", "") or ""),
                _short_ranks(ranks) if isinstance(ranks, list) else str(ranks or ""),
                str(f.get("message", "")),
            ]
        )
    return rows


def report_data(
    run_dir: Path, summary: dict[str, Any], configs: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Everything the page shows, read from the run directory's artifacts; a config
    found in ``configs`` (by file name: the objects the run wrote) is not read back."""
    configs = configs or {}
    entries = []
    for item in summary.get("entries") or []:
        name = str(item["name"])
        entry: dict[str, Any] = {
            "name": name,
            "index": item.get("index"),
            "tree": None,
            "config": None,
        }
        tree_path = safe_child(run_dir, f"{name}_compressed.json")
        if tree_path.exists():
            entry["tree"] = slim_tree(load_tree(tree_path)["root"])
        config_path = safe_child(run_dir, f"{name}_instrumentation.yaml")
        written = configs.get(config_path.name)
        if written is not None and len(written["entries"]) <= MAX_CONFIG_ROWS:
            entry["config"] = config_rows(written)
        elif config_path.exists():
            # the round-trip YAML loader reads ~100 kB/s: a config of tens of
            # thousands of entries (a deep tree without chain pruning) would hold
            # up the end of the run for minutes, so its table is left out
            size = read_bytes(config_path).count(b"\n  - target: ")
            if size > MAX_CONFIG_ROWS:
                entry["config_note"] = (
                    f"{config_path.name} has {size} entries, more than the report shows"
                    f" ({MAX_CONFIG_ROWS}); open the file itself."
                )
            else:
                entry["config"] = config_rows(load_config(config_path))
        entry["findings"] = divergence_rows(safe_child(run_dir, f"{name}_divergence.json"))
        entries.append(entry)
    comparisons = [
        {"name": p.name, "text": p.read_text(encoding="utf-8", errors="replace")}
        for p in sorted(run_dir.glob("comparison_*.log"))
    ]
    return {"summary": summary, "entries": entries, "comparisons": comparisons}


def _script_json(data: Any) -> str:
    """JSON safe inside ``<script>``: ``<``, ``>`` and ``&`` as ``\\u`` escapes."""
    text = encode_compact(data).decode()
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render_report(
    run_dir: Path, summary: dict[str, Any], configs: Mapping[str, Any] | None = None
) -> str:
    assets = files("opguard_plugins.view") / "_report"
    title = html.escape(f"OpGuard run {run_dir.name}")
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{title}</title>\n"
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
        "style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:\">\n"
        f"<style>\n{(assets / 'report.css').read_text()}</style></head>\n"
        f'<body><h1>{title}</h1><div id="content"></div>\n'
        '<script type="application/json" id="opguard-data">'
        f"{_script_json(report_data(run_dir, summary, configs))}</script>\n"
        f"<script>\n{(assets / 'report.js').read_text()}</script>\n</body></html>\n"
    )


def write_report(
    run_dir: Path,
    summary: dict[str, Any] | None = None,
    configs: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``report.html`` into ``run_dir`` (atomically); returns its path."""
    if summary is None:
        path = run_dir / SUMMARY_NAME
        try:
            summary = msgspec.json.decode(read_bytes(path))
        except msgspec.DecodeError as exc:
            raise InputError(path, f"not valid JSON: {exc}") from None
        if not isinstance(summary, dict):
            raise InputError(path, "expected a JSON object at top level")
    out = safe_child(run_dir, REPORT_NAME)
    atomic_write_text(out, render_report(run_dir, summary, configs))
    return out


@hookimpl
def opguard_run_finished(
    run_dir: Path, summary: dict[str, Any], configs: Mapping[str, Any]
) -> None:
    write_report(run_dir, summary, configs)


@click.argument("run_dir", type=click.Path(file_okay=False, path_type=Path))
@verbose_option
def report(run_dir: Path, verbose: int) -> None:
    """(Re)write RUN_DIR/report.html from the run's artifacts."""
    click.echo(str(write_report(run_dir)))


report_command = exits.command(
    "report",
    {
        ExitCode.OK: None,
        ExitCode.STAGE_FAILED: "report.html could not be written",
        ExitCode.INPUT_UNREADABLE: "RUN_DIR is not a readable run directory",
    },
)(report)


@hookimpl
def opguard_register_commands(cli: click.Group) -> None:
    """Add ``opguard report``."""
    cli.add_command(report_command)
