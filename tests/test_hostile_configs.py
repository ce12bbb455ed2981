"""Issue 30, point 3: configs and run directories as hostile input.

Each class of docs/reliability.md ("Round three" → "Configs and run directories as
hostile input") is a test here: names with control characters escaped wherever they
are printed, patterns that could backtrack catastrophically refused, YAML aliases,
depth, integers and size bounded, duplicate keys and entries, negative counts and a
bool version refused, paths from a run summary confined to the run directory, ``-o``
never an input. Every refusal is one line naming the file and the problem, with the
documented exit code and no traceback. Each failed before its fix (a raw escape
sequence, a hang, a traceback, memory in gigabytes, a replaced input).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from opguard_core.cli.app import cli_for
from opguard_core.configs.selection import PatternError, compile_patterns
from opguard_core.errors import one_line
from opguard_core.formats.config import (
    MAX_ALIAS_NODES,
    MAX_CONFIG_BYTES,
    MAX_CONFIG_BYTES_ENV,
    MAX_DEPTH,
)
from opguard_core.formats.stacks import Stack
from opguard_plugins.stages.compress import DEFAULT_HIDE
from opguard_plugins.view import config_commands
from opguard_plugins.view.export_formats import write_collapsed
from tests.builders import trace_doc, write

#: what a name must never bring to a terminal raw: an OSC 52 clipboard write ended
#: by BEL, a carriage return and a line feed (a forged row), a bidi override
EVIL = "app\x1b]52;c;aGk=\x07\r\nFORGED\u202eevil"
RAW = ("\x1b", "\x07", "\r", "\u202e")
MAIN = ("app", "main")


def invoke(*args: str | Path, env: dict[str, str] | None = None) -> Result:
    argv = ["--log-format", "json", *[str(a) for a in args]]
    return CliRunner(env=env).invoke(cli_for(argv), argv, catch_exceptions=False)


def one_error_line(result: Result, code: int, *parts: str) -> str:
    """The single non-log line of stderr: ``opguard: error: …`` naming ``parts``."""
    assert result.exit_code == code, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if not line.startswith("{")]
    errors = [line for line in lines if line.startswith(("opguard: error:", "Error:"))]
    assert len(errors) == 1, result.stderr
    for part in parts:
        assert part in errors[0], (part, errors[0])
    return errors[0]


def config_text(*entries: dict[str, Any], version: str = "3", **meta: Any) -> str:
    """A small config document (YAML flow style for each entry)."""
    lines = [f"version: {version}", "source: hand", "meta:"]
    meta = {"ranks": [0], "total": sum(int(e.get("count", 0)) for e in entries), **meta}
    lines += [f"  {key}: {json.dumps(value)}" for key, value in meta.items()]
    lines.append("entries:" if entries else "entries: []")
    lines += [f"  - {json.dumps(entry)}" for entry in entries]
    return "\n".join(lines) + "\n"


def entry(target: str, count: int = 5, context: list[str] | None = None) -> dict[str, Any]:
    return {
        "target": target,
        "kind": "function",
        "context": context or [],
        "ops": {"aten::add": abs(count)},
        "count": count,
    }


def make_run(tmp_path: Path, sites: list[Any], name: str = "app") -> Path:
    """A real run of one hand-made rank file; returns the run directory."""
    trace = write(tmp_path / f"{name}_rank0.json", trace_doc(sites))
    out = tmp_path / f"out_{name}"
    result = invoke("run", "-i", trace, "--output-base", out)
    assert result.exit_code == 0, result.stderr
    return next(out.iterdir())


# ============================================================ names escaped


def test_show_escapes_control_characters_in_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "evil.yaml"
    path.write_text(config_text(entry(EVIL, context=[EVIL]), entry("app:fine", 3)))
    plain = invoke("show", path)
    assert plain.exit_code == 0, plain.stderr
    assert not any(ch in plain.stdout for ch in RAW)
    assert len(plain.stdout.splitlines()) == 4  # title, header, two rows: nothing forged
    assert one_line(EVIL) in plain.stdout
    # on a terminal (rich): escaped too, and ``[...]`` in a name is not markup
    monkeypatch.setattr(config_commands, "_on_terminal", lambda: True)
    path.write_text(config_text(entry(EVIL + "[bold red]x[/]")))
    drawn = invoke("show", path)
    assert drawn.exit_code == 0, drawn.stderr
    assert not any(ch in drawn.stdout for ch in RAW)
    assert "[bold red]" in drawn.stdout
    # JSON escapes by itself and keeps the name exact
    data = json.loads(invoke("show", path, "--format", "json").stdout)
    assert data["entries"][0]["target"] == EVIL + "[bold red]x[/]"


def test_check_text_escapes_control_characters_in_names(tmp_path: Path) -> None:
    config = tmp_path / "evil.yaml"
    config.write_text(config_text(entry(EVIL), entry("app:main", 5)))
    trace = write(tmp_path / "new_rank0.json", trace_doc([([MAIN], None, "aten::add", 5)]))
    result = invoke("check", "--config", config, "-i", trace)
    assert "Traceback" not in result.stderr
    assert "missing" in result.stdout and one_line(EVIL) in result.stdout
    assert not any(ch in result.stdout for ch in RAW)
    assert all(
        line.startswith(("opguard check:", "warning", "error"))
        for line in result.stdout.splitlines()
    )


def test_compare_escapes_names_and_labels(tmp_path: Path) -> None:
    base = tmp_path / "base\x1b[31m.yaml"
    base.write_text(config_text(entry(EVIL)))
    other = tmp_path / "other.yaml"
    other.write_text(config_text(entry("app:fine")))
    result = invoke("compare", base, other)
    assert result.exit_code == 0, result.stderr
    assert not any(ch in result.stdout for ch in RAW)
    assert one_line(EVIL) in result.stdout and "base\\x1b[31m.yaml" in result.stdout


def test_folded_export_escapes_control_characters() -> None:
    stack = Stack(frames=(EVIL, "m:f;g"), op="aten::add", stream="compute", weight=3)
    text = write_collapsed([stack]).decode()
    assert text.count("\n") == 1 and not any(ch in text for ch in RAW)
    assert text.endswith(" 3\n") and "m:f_g" in text


def test_one_line_escapes_bidi_and_controls() -> None:
    assert one_line("a\u202eb\u2066c\u200fd\x1b\x07") == "a\\u202eb\\u2066c\\u200fd\\x1b\\x07"


# ============================================================ regexes bounded

REFUSED = [r"(a+)+$", r"(a*)*", r"(a|a)*$", r"(a|ab)*c", r"(.*,)*x", r"(?:a?)+", r"(a+b?)+"]
ALLOWED = [
    r"(\w+\.)*Linear",
    r"(\.\w+)*",
    r"(foo|bar)*",
    r"(a+)++$",
    r"torch\..*",
    r"\w*\w*x",
    r"(?:[A-Za-z_]\w*\.)*Linear",
    *DEFAULT_HIDE,
]


@pytest.mark.parametrize("pattern", REFUSED)
def test_patterns_that_backtrack_catastrophically_are_refused(pattern: str) -> None:
    with pytest.raises(PatternError, match="could backtrack catastrophically"):
        compile_patterns([pattern], "--hide")


@pytest.mark.parametrize("pattern", ALLOWED)
def test_ordinary_patterns_are_allowed(pattern: str) -> None:
    assert compile_patterns([pattern], "--hide")[0].pattern == pattern


def test_a_config_hide_pattern_that_backtracks_is_refused_before_matching(tmp_path: Path) -> None:
    """``(a+)+$`` against a frame of 40 ``a`` and a ``:``: 2**40 tries without the check."""
    slow = ("a" * 40, "f")
    trace = write(tmp_path / "t_rank0.json", trace_doc([([slow], None, "aten::add", 5)]))
    config = tmp_path / "redos.yaml"
    config.write_text(config_text(entry("app:main"), settings={"hide": ["(a+)+$"]}))
    started = time.monotonic()
    result = invoke("check", "--config", config, "-i", trace)
    assert time.monotonic() - started < 20
    one_error_line(result, 5, "redos.yaml", "meta.settings.hide", "(a+)+$", "backtrack")


def test_a_command_line_pattern_that_backtracks_is_a_usage_error(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(config_text(entry("app:main")))
    one_error_line(invoke("show", config, "--focus", "(a+)+$"), 2, "--focus", "backtrack")


# ============================================================ YAML bounded


def _laughs(levels: int = 9) -> str:
    lines = ["version: 3", "a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\nentries: []\n"


def test_alias_amplification_is_refused_in_merge(tmp_path: Path) -> None:
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(_laughs())
    good = tmp_path / "good.yaml"
    good.write_text(config_text(entry("app:main")))
    out = tmp_path / "merged.yaml"
    started = time.monotonic()
    result = invoke("merge", good, bomb, "-o", out)
    assert time.monotonic() - started < 10
    one_error_line(result, 5, "bomb.yaml", f"more than {MAX_ALIAS_NODES} nodes")
    assert not out.exists()


def test_a_few_aliases_are_still_read(tmp_path: Path) -> None:
    path = tmp_path / "alias.yaml"
    path.write_text(
        "version: 3\nentries:\n  - target: a\n    tags: &t [user]\n    count: 1\n"
        "  - target: b\n    tags: *t\n    count: 2\n"
    )
    result = invoke("show", path, "--format", "json")
    assert result.exit_code == 0, result.stderr
    assert [e["tags"] for e in json.loads(result.stdout)["entries"]] == [["user"], ["user"]]


def test_a_surrogate_pair_escape_is_the_character_it_stands_for(tmp_path: Path) -> None:
    """JSON (``json.dumps``) writes a character past U+FFFF as a pair of escapes: the
    config reads it as that character (a lone surrogate is refused, above)."""
    path = tmp_path / "emoji.yaml"
    path.write_text(config_text(entry("a")).replace('"a"', '"m:x\\ud83d\\ude00"', 1))
    result = invoke("show", path, "--format", "json")
    assert result.exit_code == 0, result.output
    assert [e["target"] for e in json.loads(result.stdout)["entries"]] == ["m:x\U0001f600"]


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        pytest.param("version: 3\nversion: 3\nentries: []\n", 'duplicate key "version"', id="key"),
        pytest.param(
            "version: 3\nentries:\n  - target: a\n    ops: {x: 1, x: 2}\n",
            'duplicate key "x"',
            id="op",
        ),
        pytest.param(config_text(entry("a", -5), total=0), "entries[0].count", id="negative_count"),
        pytest.param(config_text(entry("a"), total=-1), "meta.total", id="negative_total"),
        pytest.param(config_text(entry("a"), ranks=[-3]), "meta.ranks", id="negative_rank"),
        pytest.param(config_text(entry("a"), version="true"), "unknown config version", id="bool"),
        pytest.param(
            config_text(entry("a", 5, ["m:f"]), entry("a", 7, ["m:f"])),
            "entries[1] repeats entries[0]",
            id="duplicate_entry",
        ),
        pytest.param(
            config_text(entry("a", 10**38), total=5),
            f"entries[0].count {10**38} is more than meta.total 5",
            id="count_above_total",
        ),
        pytest.param(
            config_text(entry("a")).replace("source: hand", "source: ['touch PWNED']"),
            "'source' must be a string",
            id="source_list",
        ),
        pytest.param(
            config_text(entry("a")).replace("source: hand", "source: {a: 1}"),
            "'source' must be a string",
            id="source_map",
        ),
        pytest.param(
            config_text(entry("a")).replace('"context": []', '"context": !x ["m:f"]'),
            "entries[0].context must be a list of strings",
            id="tagged_context",
        ),
        pytest.param(
            config_text(entry("a"), sources=["a"]).replace('sources: ["a"]', "sources: !x [a]"),
            "meta.sources must be a list of names",
            id="tagged_sources",
        ),
        pytest.param(
            config_text(entry("a"), recorded_by=["modes"]).replace(
                'recorded_by: ["modes"]', "recorded_by: !x [modes]"
            ),
            "meta.recorded_by must be a list of names",
            id="tagged_recorded_by",
        ),
        pytest.param(
            config_text(entry("a")).replace('"a"', '"m:x\\ud800"', 1),
            "'m:x\\ud800' holds a lone surrogate, which is not text",
            id="lone_surrogate",
        ),
        pytest.param(
            config_text(entry("a")).replace('"a"', '"m:x\\U0000DFFF"', 1),
            "holds a lone surrogate",
            id="lone_surrogate_long_escape",
        ),
        pytest.param(
            "version: 3\nentries: []\nmeta: {total: " + "9" * 5000 + "}\n",
            "an integer of 5000 characters",
            id="huge_int",
        ),
        pytest.param(
            "version: 3\nentries: " + "[" * 100_000 + "]" * 100_000 + "\n",
            f"nested deeper than {MAX_DEPTH} levels",
            id="deep_flow",
        ),
        pytest.param(
            "version: 3\nx:\n" + "".join(" " * (i + 1) + f"k{i}:\n" for i in range(3000)),
            f"nested deeper than {MAX_DEPTH} levels",
            id="deep_block",
        ),
    ],
)
def test_bad_configs_are_one_line_exit_5(tmp_path: Path, text: str, problem: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    for command in (["show", path], ["merge", path, path, "-o", tmp_path / "m.yaml"]):
        one_error_line(invoke(*command), 5, "bad.yaml", problem)
    assert not (tmp_path / "m.yaml").exists()


def test_merge_no_longer_keeps_one_of_two_duplicate_entries(tmp_path: Path) -> None:
    """Before: ``merge`` of a config with two (a, []) entries kept one, with count 1."""
    dup = tmp_path / "dup.yaml"
    dup.write_text(config_text(entry("a", 5), entry("a", 7)))
    other = tmp_path / "o.yaml"
    other.write_text(config_text(entry("b", 1)))
    one_error_line(invoke("merge", dup, other, "-o", tmp_path / "m.yaml"), 5, "repeats")


def test_a_config_above_the_size_limit_is_refused_unread(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    with big.open("w") as handle:
        handle.write("version: 3\nentries: []\n")
        handle.write("#" + "x" * (MAX_CONFIG_BYTES + 10) + "\n")
    started = time.monotonic()
    one_error_line(invoke("show", big), 5, "big.yaml", "config too large", MAX_CONFIG_BYTES_ENV)
    assert time.monotonic() - started < 10


def test_the_size_limit_can_be_set(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(config_text(entry("app:main")))
    small = {MAX_CONFIG_BYTES_ENV: "50"}
    one_error_line(invoke("show", path, env=small), 5, "config too large", "more than 50")
    assert invoke("show", path, env={MAX_CONFIG_BYTES_ENV: "100000"}).exit_code == 0


def test_a_fifo_config_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    one_error_line(invoke("show", fifo), 5, "fifo.yaml", "not a regular file")


def test_a_fifo_basic_list_is_refused_without_blocking(tmp_path: Path) -> None:
    """``--basic-list`` was read unchecked: a FIFO held ``filter`` (and a run's filter
    stage) up for ever, and a list of any size was read whole before its limit."""
    config = tmp_path / "c.yaml"
    config.write_text(config_text(entry("app:main")))
    fifo = tmp_path / "list.yaml"
    os.mkfifo(fifo)
    fired = _unblock_later(fifo)
    out = tmp_path / "out.yaml"
    result = invoke("filter", config, "--basic", "--basic-list", fifo, "-o", out)
    one_error_line(result, 5, "list.yaml", "cannot read basic-filter list: not a regular file")
    assert not fired.is_set() and not out.exists()


def test_json_output_names_a_file_that_is_not_utf8_as_the_summary_does(tmp_path: Path) -> None:
    """``show``, ``compare`` and ``check`` ``--format json`` wrote such a name as a lone
    surrogate escape (``"caf\\udce9.yaml"``), which strict JSON readers refuse and
    OpGuard's own readers refuse in a config; the summary writes ``caf\\xe9.yaml``."""
    config = tmp_path / os.fsdecode(b"caf\xe9.yaml")
    config.write_text(config_text(entry("app:main")))
    trace = write(tmp_path / "app_rank0.json", trace_doc([([MAIN], None, "aten::add", 5)]))
    outputs = [
        json.loads(invoke("show", config, "--format", "json").stdout)["config"],
        json.loads(invoke("compare", config, config, "--format", "json").stdout)["first"]["label"],
        json.loads(invoke("check", "--config", config, "-i", trace, "--format", "json").stdout)[
            "config"
        ],
    ]
    assert [name.rpartition("/")[2] for name in outputs] == ["caf\\xe9.yaml"] * 3


# ============================================================ run directories


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return make_run(tmp_path, [([MAIN], None, "aten::add", 5)])


def _edit_summary(run: Path, change: Callable[[dict[str, Any]], Any]) -> None:
    path = run / "pipeline_summary.json"
    summary = json.loads(path.read_text())
    change(summary)
    path.write_text(json.dumps(summary))


def _point_generate_at(name: str) -> Callable[[dict[str, Any]], None]:
    def change(summary: dict[str, Any]) -> None:
        for record in summary["stages"]:
            if record["stage"] == "generate":
                record["outputs"] = [name]

    return change


def _commands(run: Path, tmp_path: Path) -> list[list[str | Path]]:
    trace = tmp_path / "app_rank0.json"
    return [
        ["show", run],
        ["compare", run, run],
        ["merge", run, run, "-o", tmp_path / "m.yaml"],
        ["filter", run, "-o", tmp_path / "f.yaml"],
        ["report", run],
        ["check", "--config", run, "-i", trace],
    ]


@pytest.mark.parametrize("name", ["../../../../../etc/passwd", "/etc/passwd", "..", "a/b.yaml"])
def test_a_summary_cannot_point_outside_its_run_directory(
    tmp_path: Path, run_dir: Path, name: str
) -> None:
    _edit_summary(run_dir, _point_generate_at(name))
    for command in _commands(run_dir, tmp_path):
        one_error_line(invoke(*command), 5, "pipeline_summary.json", "not a file inside")
    assert not (tmp_path / "m.yaml").exists() and not (tmp_path / "f.yaml").exists()


def test_a_link_in_the_run_directory_cannot_lead_out(tmp_path: Path, run_dir: Path) -> None:
    outside = tmp_path / "outside.yaml"
    outside.write_text(config_text(entry("secret")))
    (run_dir / "link.yaml").symlink_to(outside)
    _edit_summary(run_dir, _point_generate_at("link.yaml"))
    for command in _commands(run_dir, tmp_path):
        one_error_line(invoke(*command), 5, "link.yaml", "leads outside the run directory")


def test_report_replaces_a_link_named_report_html_not_what_it_points_at(run_dir: Path) -> None:
    """``report.html`` linked to the run's config: the page replaces the link; the
    config is left as it was (it was once overwritten with the page)."""
    (config,) = run_dir.glob("*_instrumentation.yaml")
    before = config.read_bytes()
    (run_dir / "report.html").unlink()
    (run_dir / "report.html").symlink_to(config.name)
    result = invoke("report", run_dir)
    assert result.exit_code == 0, result.output
    assert config.read_bytes() == before
    page = run_dir / "report.html"
    assert not page.is_symlink() and page.read_bytes().startswith(b"<!DOCTYPE html>")


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda s: s.update(stages=5), "'stages' must be a list"),
        (lambda s: s["stages"].insert(0, 1), "stages[0] must be an object"),
        (lambda s: s["stages"][0].update(outputs=5), "stages[0].outputs must be a list"),
        (lambda s: s["stages"][0].update(stage=["x"]), "stages[0].stage must be a string"),
        (lambda s: s.update(entries=3), "'entries' must be a list"),
        (lambda s: s.update(entries=[{"nom": 1}]), "'entries' must be a list"),
        (lambda s: s.update(warnings="many"), "'warnings' must be a list"),
    ],
    ids=["stages", "record", "outputs", "stage_name", "entries", "entry", "warnings"],
)
def test_a_malformed_summary_is_one_line(
    tmp_path: Path, run_dir: Path, change: Callable[[dict[str, Any]], Any], problem: str
) -> None:
    _edit_summary(run_dir, change)
    for command in (["show", run_dir], ["report", run_dir]):
        one_error_line(invoke(*command), 5, "pipeline_summary.json", problem)


def test_a_summary_nested_too_deep_is_one_line(tmp_path: Path, run_dir: Path) -> None:
    """It was a RecursionError traceback in every command that reads a run directory."""
    deep = '{"stages": ' + "[" * 100_000 + "]" * 100_000 + "}"
    (run_dir / "pipeline_summary.json").write_text(deep)
    for command in _commands(run_dir, tmp_path):
        one_error_line(invoke(*command), 5, "pipeline_summary.json", "nested too deep")


def test_a_fifo_summary_is_one_line_without_blocking(tmp_path: Path, run_dir: Path) -> None:
    """``pipeline_summary.json`` was read unchecked: a FIFO there held every command
    that takes a run directory up for ever."""
    summary = run_dir / "pipeline_summary.json"
    summary.unlink()
    os.mkfifo(summary)
    for command in (["show", run_dir], ["merge", run_dir, run_dir, "-o", tmp_path / "m.yaml"]):
        fired = _unblock_later(summary)
        one_error_line(invoke(*command), 5, "pipeline_summary.json", "not a regular file")
        assert not fired.is_set()
    assert not (tmp_path / "m.yaml").exists()


def test_report_does_not_wait_on_a_fifo_named_as_a_config(run_dir: Path) -> None:
    """``opguard report`` read the run's config unchecked: a FIFO held it up for ever."""
    (config,) = run_dir.glob("*_instrumentation.yaml")
    config.unlink()
    os.mkfifo(config)
    fired = _unblock_later(config)
    assert invoke("report", run_dir).exit_code == 0
    assert not fired.is_set()  # it did not wait on the FIFO
    assert f"{config.name} is not a regular file" in (run_dir / "report.html").read_text()


# ============================================================ -o never an input


def test_output_equal_to_an_input_is_refused(tmp_path: Path, run_dir: Path) -> None:
    config = tmp_path / "c.yaml"
    shutil.copy(next(run_dir.glob("*_instrumentation.yaml")), config)
    trace = tmp_path / "app_rank0.json"
    link = tmp_path / "hard.yaml"
    os.link(config, link)
    before = {p: p.read_bytes() for p in (config, trace)}
    cases: list[list[str | Path]] = [
        ["export", trace, "--format", "collapsed", "-o", trace],
        ["check", "--config", config, "-i", trace, "-o", config],
        ["check", "--config", config, "-i", trace, "-o", trace],
        ["check", "--config", run_dir, "-i", trace, "-o", run_dir / "app_instrumentation.yaml"],
        ["merge", config, config, "-o", link],
        ["merge", run_dir, config, "-o", tmp_path / "." / "c.yaml"],
        ["filter", config, "--basic", "-o", config],
    ]
    for command in cases:
        one_error_line(invoke(*command), 2, "is the input")
    assert {p: p.read_bytes() for p in before} == before


def test_output_onto_a_device_or_fifo_is_refused(tmp_path: Path, run_dir: Path) -> None:
    """An atomic write replaces the path: ``-o /dev/null`` made /dev/null a file (as
    root). Tested on nodes of the test's own (never on /dev: a build without the
    check would break the machine)."""
    config = next(run_dir.glob("*_instrumentation.yaml"))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    nodes = [fifo]
    if os.geteuid() == 0:  # a character device like /dev/null (1, 3)
        device = tmp_path / "null"
        os.mknod(device, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        nodes.append(device)
    for node in nodes:
        result = invoke("merge", config, config, "-o", node)
        one_error_line(result, 2, node.name, "not a regular file")
        assert not node.is_file()


@pytest.mark.parametrize("where", ["file/sub.txt", "/proc/opguard_check.txt"])
def test_check_output_that_cannot_be_written_is_one_line(
    tmp_path: Path, run_dir: Path, where: str
) -> None:
    (tmp_path / "file").write_text("x")
    out = tmp_path / where if not where.startswith("/") else Path(where)
    config = next(run_dir.glob("*_instrumentation.yaml"))
    result = invoke("check", "--config", config, "-i", tmp_path / "app_rank0.json", "-o", out)
    if where.startswith("/"):  # the directory is there, the write fails: after the check
        one_error_line(result, 1, str(out), "cannot write")
    else:  # no directory to write in: a usage error before the check
        one_error_line(result, 2, str(out), "is not a directory")
    assert not out.exists() and not list(out.parent.glob(".*.tmp")) if out.parent.is_dir() else True


# ============================================================ check's basic_list


def test_check_reads_a_configs_basic_list_next_to_it(tmp_path: Path, run_dir: Path) -> None:
    trace = tmp_path / "app_rank0.json"
    config = tmp_path / "c.yaml"
    text = next(run_dir.glob("*_instrumentation.yaml")).read_text()
    settings = "  settings:\n    filters: [basic_filter]\n    basic_list: lists/basic.yaml\n"
    config.write_text(text.replace("  settings:\n", settings, 1))
    one_error_line(
        invoke("check", "--config", config, "-i", trace), 5, "basic.yaml", "basic-filter list"
    )
    (tmp_path / "lists").mkdir()
    (tmp_path / "lists" / "basic.yaml").write_text("utilities: [torch:cat]\n")
    result = invoke("check", "--config", config, "-i", trace)
    assert result.exit_code == 0, result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("utilities: " + "[" * 100_000 + "]" * 100_000 + "\n", "nested deeper than"),
        (_laughs().replace("entries: []", "utilities: []"), "YAML aliases expand"),
        ("utilities: [" + "9" * 5000 + "]\n", "an integer of 5000 characters"),
    ],
    ids=["deep", "aliases", "huge_int"],
)
def test_a_hostile_basic_list_is_one_line(tmp_path: Path, text: str, problem: str) -> None:
    """A config names its basic list for ``check``: the list is bounded like a config."""
    config = tmp_path / "c.yaml"
    config.write_text(config_text(entry("app:main")))
    basic = tmp_path / "basic.yaml"
    basic.write_text(text)
    result = invoke("filter", config, "--basic-list", basic, "--basic", "-o", tmp_path / "f.yaml")
    one_error_line(result, 5, "basic.yaml", problem)
    assert not (tmp_path / "f.yaml").exists()


def _unblock_later(fifo: Path, after: float = 20.0) -> threading.Event:
    """Set once ``after`` seconds have passed, then open ``fifo`` for writing and close
    it, so a reader blocked on it gets end of file: a test asserts it is not set."""
    fired = threading.Event()

    def unblock() -> None:
        time.sleep(after)
        fired.set()
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))

    threading.Thread(target=unblock, daemon=True).start()
    return fired


def test_a_document_that_is_not_a_config_is_named_as_such(tmp_path: Path) -> None:
    """Each artifact of a real run handed where a config goes (show, compare, merge,
    filter, check --config) is named for what it is, with what to give instead, in
    one line, exit 5. Before, a compressed tree said ``meta.ranks must be a list of
    integers``, a trace ``config too large … set OPGUARD_MAX_CONFIG_BYTES`` (its size
    was checked first), a summary ``unknown config version None``."""
    samples = Path(__file__).parent / "data" / "samples"
    trace = samples / "gpt_callsite_rank0.json"
    out = tmp_path / "runs"
    pattern = str(samples / "gpt_callsite_rank*.json")
    assert invoke("run", "-i", pattern, "--output-base", out).exit_code == 0
    run = next(out.iterdir())
    kineto = Path(__file__).parent / "data" / "kineto"
    plain = tmp_path / "kineto.json"
    plain.write_bytes((kineto / "hta_backward_thread.json").read_bytes())
    tree, divergence = "a compressed call tree (a run's", "a divergence report (a run's"
    named = {
        run / "gpt_callsite_combined.json": "a callsite trace, not an instrumentation config",
        run / "gpt_callsite_compressed.json": tree,
        run / "gpt_callsite_divergence.json": divergence,
        run / "pipeline_summary.json": "a run's pipeline summary, not an instrumentation",
        trace: "a callsite trace, not an instrumentation config",
        plain: "a torch.profiler (Kineto) trace, not an instrumentation config",
        kineto / "dlrm_rank0.pt.trace.json.gz": "a gzip file, not an instrumentation config",
    }
    small = {MAX_CONFIG_BYTES_ENV: "64"}  # the kind is named before the size is checked
    for path, problem in named.items():
        for args in (
            ["show", path],
            ["compare", path, run],
            ["merge", run, path, "-o", tmp_path / "m.yaml"],
            ["filter", path, "-o", tmp_path / "f.yaml"],
            ["check", "--config", path, "-i", trace],
        ):
            one_error_line(invoke(*args), 5, path.name, problem)
        one_error_line(invoke("show", path, env=small), 5, path.name, problem)
    assert not (tmp_path / "m.yaml").exists() and not (tmp_path / "f.yaml").exists()
    # a config written as JSON is still a config
    as_json = tmp_path / "config.json"
    as_json.write_text(json.dumps({"version": 3, "meta": {"ranks": [0]}, "entries": [entry("a")]}))
    assert invoke("show", as_json).exit_code == 0
    # and the other way round: a config handed to check as a trace
    config = run / "gpt_callsite_instrumentation.yaml"
    one_error_line(
        invoke("check", "--config", run, "-i", config), 5, "a YAML config, not a callsite trace"
    )
    # a tree or a report handed where a trace goes is named too (it was "unknown format
    # 'opguard-calltree' version 6 (expected format 'opguard-callsites' …)")
    for name, kind in (("compressed", tree), ("divergence", divergence)):
        path = run / f"gpt_callsite_{name}.json"
        line = one_error_line(invoke("check", "--config", run, "-i", path), 5, path.name, kind)
        assert line.endswith(", not a callsite trace"), line
        # the file first, not check's name for it (it said gpt_callsite_compressed_1: …)
        assert line.startswith(f"opguard: error: {path}: "), line
    # a later version than this OpGuard reads says it may be a newer OpGuard's
    newer = tmp_path / "newer.yaml"
    newer.write_text("version: 99\nentries: []\n")
    one_error_line(invoke("show", newer), 5, "unknown config version 99", "a newer OpGuard?")
    doc = json.loads(trace.read_text())
    future = tmp_path / "future_rank0.json"
    future.write_text(json.dumps({**doc, "version": 99}))
    one_error_line(
        invoke("check", "--config", run, "-i", future), 5, "version 99", "a newer OpGuard?"
    )


def test_show_says_a_total_and_ranks_it_does_not_know(tmp_path: Path) -> None:
    """A config without ``meta.total`` or ``meta.ranks`` (hand-written) shows them as
    unknown, as compare does: show said ``0 ops on ranks []`` (JSON ``"total": 0``)."""
    path = tmp_path / "hand.yaml"
    path.write_text("version: 3\nentries:\n  - " + json.dumps(entry("app:main", 7)) + "\n")
    text = invoke("show", path)
    assert text.exit_code == 0, text.stderr
    assert "hand.yaml: None, ops unknown, ranks unknown; showing 1 of 1" in text.stdout
    head = json.loads(invoke("show", path, "--format", "json").stdout)
    assert head["total"] is None and head["ranks"] is None
    known = tmp_path / "known.yaml"
    known.write_text(config_text(entry("app:main", 7)))
    assert "7 ops on ranks [0]; showing 1 of 1" in invoke("show", known).stdout


def test_check_writes_its_text_report_for_a_config_whose_name_is_not_utf8(
    tmp_path: Path,
) -> None:
    """``check -o r.txt`` with a config named ``c\\xe9.yaml`` (not UTF-8): the report is
    written, the name's odd byte as ``\\xe9`` as in the JSON report. It was a
    ``UnicodeEncodeError`` traceback, exit 1 (check's code for errors found)."""
    run = make_run(tmp_path, [([("app", "main")], None, "aten::mm", 3)])
    config = Path(os.fsdecode(bytes(tmp_path) + b"/c\xe9.yaml"))
    shutil.copy(next(run.glob("*_instrumentation.yaml")), config)
    trace = next(tmp_path.glob("app_rank0.json"))
    out = tmp_path / "r.txt"
    result = invoke("check", "--config", config, "-i", trace, "-o", out)
    assert result.exit_code == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert "c\\xe9.yaml: 0 error(s), 0 warning(s)" in out.read_text()
