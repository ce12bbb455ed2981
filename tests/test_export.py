"""``opguard export``: collapsed stacks, speedscope JSON, pprof, and the formats hook."""

from __future__ import annotations

import gzip
import json
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from opguard_core import hookimpl
from opguard_core.cli import create_cli
from opguard_core.formats.stacks import Stack, split_streams, tree_stacks
from opguard_core.formats.tree import load_tree
from opguard_core.plugin.manager import create_plugin_manager
from opguard_plugins.view.export import load_source, select_stacks
from tests.builders import sample_inputs, trace_doc, write

SCHEMA = Path(__file__).parent / "data" / "speedscope" / "file-format-schema.json"
DIVERGENT = Path(__file__).parent / "data" / "divergent"
GO = shutil.which("go")
FSDP_TOTAL = 6241


def export(*args: str | Path, expect: int = 0) -> click.testing.Result:
    argv = ["--log-format", "json", "export", *[str(a) for a in args]]
    result = CliRunner().invoke(create_cli(create_plugin_manager()), argv)
    assert result.exit_code == expect, (result.stdout, result.stderr)
    return result


def folded(path: Path) -> dict[str, int]:
    lines = path.read_text().splitlines()
    out = {}
    for line in lines:
        stack, _, count = line.rpartition(" ")
        assert stack and count.isdigit(), line
        out[stack] = int(count)
    return out


@pytest.fixture
def tree_file(opguard: Callable[..., Any], samples: Path) -> Path:
    run = opguard("run", "-i", str(samples / "fsdp_callsite_rank*.json"), expect=0)
    return run.run_dir / "fsdp_callsite_compressed.json"


def test_collapsed_from_a_tree_keeps_every_op(tree_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "t.folded"
    export(tree_file, "--format", "collapsed", "-o", out)
    stacks = folded(out)
    assert sum(stacks.values()) == FSDP_TOTAL == load_tree(tree_file)["root"]["count"]
    # the leaf of every line is an op the tree records at that node
    ops = {op for s in tree_stacks(load_tree(tree_file)) for op in [s.op]}
    assert {s.split(";")[-1] for s in stacks} == ops


def test_collapsed_from_a_raw_trace_and_default_output_name(samples: Path) -> None:
    src = samples / "gpt_callsite_rank0.json"
    result = export(src, "--format", "collapsed")
    out = samples / "gpt_callsite_rank0.folded"
    assert result.stdout.strip() == str(out)
    total = sum(c["count"] for c in json.loads(src.read_text())["callsites"])
    assert sum(folded(out).values()) == total == 2826


def test_the_default_output_name_drops_every_suffix_of_src(samples: Path, tmp_path: Path) -> None:
    """``x.pt.trace.json.gz`` once gave ``x.pt.trace.json.gz.folded``."""
    kineto = Path(__file__).parent / "data" / "kineto" / "dlrm_rank0.pt.trace.json.gz"
    gzipped = tmp_path / "gpt_callsite_rank0.json.gz"
    gzipped.write_bytes(gzip.compress((samples / "gpt_callsite_rank0.json").read_bytes()))
    for src, fmt, name in [
        (shutil.copy(kineto, tmp_path), "collapsed", "dlrm_rank0.folded"),
        (gzipped, "speedscope", "gpt_callsite_rank0.speedscope.json"),
        (gzipped, "pprof", "gpt_callsite_rank0.pb.gz"),
    ]:
        result = export(src, "--format", fmt)
        assert result.stdout.strip() == str(tmp_path / name)
        assert (tmp_path / name).stat().st_size


def test_hide_focus_ignore(tmp_path: Path) -> None:
    src = write(
        tmp_path / "t.json",
        trace_doc(
            [
                ([("app", "main"), ("app", "step"), ("lib", "inner")], None, "aten::mm", 5),
                ([("app", "main"), ("app", "other")], None, "aten::add", 3),
            ]
        ),
    )
    out = tmp_path / "o.folded"
    export(src, "--format", "collapsed", "-o", out, "--hide", "app:step")
    assert folded(out) == {"app:main;lib:inner;aten::mm": 5, "app:main;app:other;aten::add": 3}
    export(src, "--format", "collapsed", "-o", out, "--focus", "lib:.*")
    assert folded(out) == {"app:main;app:step;lib:inner;aten::mm": 5}
    export(src, "--format", "collapsed", "-o", out, "--ignore", "aten::mm")
    assert folded(out) == {"app:main;app:other;aten::add": 3}


@pytest.mark.parametrize(
    ("option", "patterns", "expected"),
    [
        # joined into one alternation these failed: two groups named m, a global flag
        # not at the start, a backreference to the other pattern's group
        ("--focus", ["(?P<m>lib):.*", "(?P<m>app):other"], {"mm": 5, "add": 3}),
        ("--ignore", ["x:y", "(?i)LIB:.*"], {"add": 3}),
        ("--hide", [r"(x)y:.*", r"(a)\1:nothing", "(?i)APP:STEP"], {"mm": 5, "add": 3}),
    ],
)
def test_patterns_are_compiled_one_by_one(
    tmp_path: Path, option: str, patterns: list[str], expected: dict[str, int]
) -> None:
    """Like opguard run's (issue 10, point 9): each pattern on its own, never joined."""
    src = write(
        tmp_path / "t.json",
        trace_doc(
            [
                ([("app", "main"), ("app", "step"), ("lib", "inner")], None, "aten::mm", 5),
                ([("app", "main"), ("app", "other")], None, "aten::add", 3),
            ]
        ),
    )
    out = tmp_path / "o.folded"
    export(src, "--format", "collapsed", "-o", out, *[x for p in patterns for x in (option, p)])
    stacks = folded(out)
    assert {k.rsplit("aten::", 1)[1]: v for k, v in stacks.items()} == expected
    if option == "--hide":
        assert not any("app:step" in k for k in stacks)
    export(src, "--format", "collapsed", "--focus", "a{99999999999}", expect=2)


def test_speedscope_matches_the_published_schema(tree_file: Path, tmp_path: Path) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    out = tmp_path / "t.speedscope.json"
    export(tree_file, "--format", "speedscope", "-o", out)
    doc = json.loads(out.read_text())
    jsonschema.validate(doc, json.loads(SCHEMA.read_text()))
    (profile,) = doc["profiles"]
    assert sum(profile["weights"]) == profile["endValue"] == FSDP_TOTAL
    names = [f["name"] for f in doc["shared"]["frames"]]
    paths = {
        ";".join(names[i] for i in s): w
        for s, w in zip(profile["samples"], profile["weights"], strict=True)
    }
    collapsed = tmp_path / "t.folded"
    export(tree_file, "--format", "collapsed", "-o", collapsed)
    assert paths == folded(collapsed)


def _pprof(*args: str, cwd: Path | None = None) -> str:
    assert GO is not None
    done = subprocess.run(
        [GO, "tool", "pprof", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=cwd,
    )
    return done.stdout


@pytest.mark.skipif(GO is None, reason="go (Debian golang-go) is not installed")
def test_pprof_reads_back_with_go_tool_pprof(tree_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "t.pb.gz"
    export(tree_file, "--format", "pprof", "-o", out)
    assert gzip.decompress(out.read_bytes())  # gzipped
    top = _pprof("-top", "-nodecount=100000", "-nodefraction=0", "-edgefraction=0", str(out))
    assert "Type: ops" in top
    assert re.search(rf"accounting for {FSDP_TOTAL}, 100% of {FSDP_TOTAL} total", top), top
    stacks = tree_stacks(load_tree(tree_file))
    by_op: dict[str, int] = {}
    for s in stacks:
        by_op[s.op] = by_op.get(s.op, 0) + s.weight
    flat = {
        m.group(2): int(m.group(1))
        for m in re.finditer(r"^\s+(\d+)\s+\S+%\s+\S+%\s+\d+\s+\S+%\s+(\S+)\s*$", top, re.M)
    }
    assert {op: flat[op] for op in by_op} == by_op  # ops are the leaves: flat = own ops
    raw = _pprof("-raw", str(out))
    samples = re.findall(r"^\s+(\d+): [\d ]+$", raw.split("Locations")[0], re.M)
    assert sum(map(int, samples)) == FSDP_TOTAL
    assert len(samples) == len(stacks)  # one sample per (node, op, stream)
    assert "ref_workloads:run_fsdp" in raw
    tags = _pprof("-tags", str(out))
    assert re.search(rf"stream: Total {FSDP_TOTAL}", tags), tags


@pytest.mark.slow  # go tool pprof builds itself on first use
@pytest.mark.skipif(GO is None, reason="go (Debian golang-go) is not installed")
def test_pprof_has_files_and_lines_for_list_and_full_names_for_top(tmp_path: Path) -> None:
    """The recorded divergent job (rank 1 issues an extra all_reduce in extra_sync,
    divergent_job.py line 29): ``-list`` shows that line of the source with its ops,
    ``-top`` the frames' full names, ``<module>`` and all."""
    out = tmp_path / "r1.pb.gz"
    export(DIVERGENT / "divergent_callsite_rank1.json", "--format", "pprof", "-o", out)
    top = _pprof("-top", "-cum", "-nodecount=100000", "-nodefraction=0", str(out))
    names = {line.split()[-1] for line in top.splitlines() if re.match(r"^\s+\d", line)}
    assert {"divergent_job:<module>", "divergent_job:main", "c10d::allreduce_"} <= names
    assert not {n for n in names if n.endswith(":")}  # nothing cut at a '<'
    listed = _pprof("-list", "divergent_job:extra_sync", "-source_path", str(DIVERGENT), str(out))
    assert "ROUTINE ======================== divergent_job:extra_sync in divergent_job.py" in listed
    (line,) = [x for x in listed.splitlines() if "dist.all_reduce(tensor, group=group)" in x]
    assert re.match(r"^\s+\.\s+2\s+29:", line), listed  # 2 ops, cumulative, at line 29
    raw = _pprof("-raw", str(out))
    assert re.search(r"divergent_job:extra_sync divergent_job.py:29 s=29\(extra_sync\)", raw), raw
    # without the source at hand pprof says so instead of printing lines
    missing = subprocess.run(
        [GO, "tool", "pprof", "-list", "divergent_job:extra_sync", str(out)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert "29:" not in missing.stdout


def test_pprof_encodes_a_negative_line_as_protobuf_does(tmp_path: Path) -> None:
    """A trace's line may be any int: a negative one is a ten-byte varint (its 64-bit
    two's complement); the encoder once shifted -1 right forever."""
    doc = trace_doc([([("app", "main"), ("app", "step")], None, "aten::mm", 5)])
    doc["frames"][0]["line"] = -5
    out = tmp_path / "neg.pb.gz"
    export(write(tmp_path / "neg.json", doc), "--format", "pprof", "-o", out)
    minus_five = b"\xfb" + b"\xff" * 8 + b"\x01"
    assert b"\x10" + minus_five in gzip.decompress(out.read_bytes())  # Line.line = -5


def test_stacks_carry_each_frame_s_file_and_first_line(tmp_path: Path) -> None:
    src = write(
        tmp_path / "t.json",
        trace_doc([([("app", "main"), ("app", "step"), ("lib", "inner")], None, "aten::mm", 5)]),
    )
    tree = load_source(src)
    (stack,) = tree_stacks(tree)
    assert stack.frames == ("app:main", "app:step", "lib:inner")
    assert stack.sites == (("app.py", 1), ("app.py", 1), ("lib.py", 1))
    (hidden,) = select_stacks([stack], hide=["app:step"])
    assert hidden.frames == ("app:main", "lib:inner")
    assert hidden.sites == (("app.py", 1), ("lib.py", 1))  # sites follow their frames


def test_a_selection_that_leaves_nothing_is_an_error(tmp_path: Path) -> None:
    src = write(
        tmp_path / "t.json",
        trace_doc(
            [
                ([("app", "main"), ("app", "step")], None, "aten::mm", 5),
                ([("app", "main"), ("app", "other")], None, "aten::add", 3),
            ]
        ),
    )
    out = tmp_path / "o.folded"
    result = export(src, "--format", "pprof", "-o", out, "--focus", "nothing:here", expect=1)
    assert not out.exists()
    lines = result.stderr.strip().splitlines()
    warning = json.loads(lines[0])
    assert (warning["event"], warning["option"], warning["pattern"]) == (
        "pattern matched nothing", "--focus", "nothing:here")  # fmt: skip
    assert lines[-1] == f"opguard: error: {src}: nothing left: no stack passes --focus nothing:here"
    # a pattern with a line break stays on one line
    result = export(src, "--format", "collapsed", "-o", out, "--focus", "a\nb", expect=1)
    assert result.stderr.strip().splitlines()[-1].endswith("--focus a\\nb")
    # everything ignored: the same
    export(src, "--format", "collapsed", "-o", out, "--ignore", "app:main", expect=1)
    assert not out.exists()
    # a pattern that matched nothing beside one that did: a warning, and the file
    result = export(src, "--format", "collapsed", "-o", out, "--focus", "app:step",
                    "--focus", "zzz", "--hide", "yyy")  # fmt: skip
    assert folded(out) == {"app:main;app:step;aten::mm": 5}
    warned = [json.loads(x) for x in result.stderr.splitlines() if x.startswith("{")]
    assert [(w["option"], w["pattern"]) for w in warned] == [("--hide", "yyy"), ("--focus", "zzz")]


def test_a_run_directory_exports_its_entry_s_tree(
    opguard: Callable[..., Any], samples: Path, tree_file: Path, tmp_path: Path
) -> None:
    export(tree_file.parent, "--format", "collapsed", "-o", tmp_path / "run.folded")
    export(tree_file, "--format", "collapsed", "-o", tmp_path / "tree.folded")
    assert (tmp_path / "run.folded").read_bytes() == (tmp_path / "tree.folded").read_bytes()
    two = opguard("run", *sample_inputs(samples, "fsdp", "gpt"), expect=0)
    result = export(two.run_dir, "--format", "collapsed", expect=5)
    assert "the run has 2 entries: name one of its trees (" in result.stderr
    assert "fsdp_callsite_compressed.json" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_config_is_not_exported_and_says_what_is(tree_file: Path) -> None:
    config = tree_file.parent / "fsdp_callsite_instrumentation.yaml"
    result = export(config, "--format", "collapsed", expect=2)
    assert f"{config}: a YAML config, not a callsite trace, a compressed tree" in result.stderr
    assert "Traceback" not in result.stderr


def test_bad_source_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    result = export(bad, "--format", "collapsed", expect=5)
    assert result.stderr.strip().startswith(f"opguard: error: {bad}: not valid JSON")
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    result = export(tmp_path / "missing.json", "--format", "collapsed", expect=5)
    assert result.stderr == f"opguard: error: {tmp_path / 'missing.json'}: no such file\n"


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("lines", [1, "a"], "lines [1, 'a'] is not a list of integers"),
        ("lines", ["a"], "lines ['a'] is not a list of integers"),
        ("lines", 7, "lines 7 is not a list of integers"),
        ("file", 5, "file 5 is not a string"),
    ],
)
def test_a_tree_node_with_a_mistyped_site_is_one_line(
    tree_file: Path, tmp_path: Path, field: str, value: Any, says: str
) -> None:
    """A node's ``file`` and ``lines`` once ended ``opguard export`` in a traceback."""
    tree = json.loads(tree_file.read_text())
    tree["root"]["children"][0][field] = value
    bad = write(tmp_path / "bad_compressed.json", tree)
    for fmt in ("collapsed", "speedscope", "pprof"):
        result = export(bad, "--format", fmt, "-o", tmp_path / "o.folded", expect=5)
        (line,) = result.stderr.splitlines()
        assert line.startswith(f"opguard: error: {bad}: ") and line.endswith(says)
    assert not (tmp_path / "o.folded").exists()


def test_unknown_format_is_a_usage_error(tmp_path: Path) -> None:
    result = export(tmp_path / "x.json", "--format", "svg", expect=2)
    assert "'svg': not one of collapsed, pprof, speedscope" in result.stderr
    # with the plugin that provides them disabled it says so (it said "not one of ")
    argv = ["export", str(tmp_path / "x.json"), "--format", "collapsed"]
    cli = create_cli(create_plugin_manager(["export_formats"]))
    disabled = CliRunner().invoke(cli, argv)
    assert disabled.exit_code == 2
    assert "no export format is installed (is the export_formats plugin disabled?)" in (
        disabled.stderr
    )


def _export_lines(tmp_path: Path, writer: Callable[[list[Stack]], bytes]) -> tuple[Any, Path]:
    """``opguard export --format lines`` of a one-callsite trace, ``lines`` written by
    ``writer`` (a plugin's format): the result and the output path."""

    class Lines:
        @hookimpl
        def opguard_export_formats(self) -> dict[str, Callable[[list[Stack]], bytes]]:
            return {"lines": writer}

    pm = create_plugin_manager()
    pm.register(Lines(), name="lines")
    src = write(tmp_path / "t.json", trace_doc([([("app", "main")], None, "aten::mm", 4)]))
    out = tmp_path / "t.lines"
    argv = ["export", str(src), "--format", "lines", "-o", str(out)]
    return CliRunner().invoke(create_cli(pm), argv), out


def test_hook_export_formats(tmp_path: Path) -> None:
    result, out = _export_lines(
        tmp_path, lambda stacks: b"".join(f"{s.op} {s.weight}\n".encode() for s in stacks)
    )
    assert result.exit_code == 0, result.stderr
    assert out.read_text() == "aten::mm 4\n"


def _quit(stacks: list[Stack]) -> bytes:
    raise SystemExit(0)


@pytest.mark.parametrize(
    ("writer", "says"),
    [
        (_quit, "SystemExit(0) raised by plugin lines: a plugin may not end the process"),
        (lambda stacks: "text", "plugin \"lines\": export format 'lines' returned str, not bytes"),
    ],
    ids=["system-exit", "not-bytes"],
)
def test_a_plugin_s_writer_that_misbehaves_is_named(
    tmp_path: Path, writer: Callable[[list[Stack]], bytes], says: str
) -> None:
    """A writer raising ``SystemExit(0)`` ended ``opguard export`` with exit 0 and
    nothing written; one returning text, with a traceback."""
    result, out = _export_lines(tmp_path, writer)
    assert result.exit_code == 3, result.output
    assert result.stderr.strip() == f"opguard: error: {says}"
    assert not out.exists()


@given(
    st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), st.integers(1, 50), min_size=1),
    st.data(),
)
def test_split_streams_keeps_both_marginals(ops: dict[str, int], data: st.DataObject) -> None:
    total = sum(ops.values())
    cuts = sorted(data.draw(st.lists(st.integers(0, total), max_size=3)))
    parts = [b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True)]
    roles = ["compute", "comm", "side1", "side2"]
    streams = {roles[i]: n for i, n in enumerate(parts) if n}
    triples = split_streams(ops, streams)
    by_op: dict[str, int] = {}
    by_stream: dict[str, int] = {}
    for op, stream, n in triples:
        assert n > 0
        by_op[op] = by_op.get(op, 0) + n
        by_stream[stream] = by_stream.get(stream, 0) + n
    assert by_op == ops
    assert by_stream == streams


@pytest.mark.parametrize("version", [2, 7, "6"])
def test_a_tree_of_a_version_not_read_is_one_line_naming_the_version(
    tree_file: Path, tmp_path: Path, version: Any
) -> None:
    """A future (or never written) tree version was refused as if a compressor had
    returned it: `compressor returned format 'opguard-calltree' version 6, expected …`."""
    doc = json.loads(tree_file.read_text())
    doc["version"] = version
    src = tmp_path / "x_compressed.json"
    src.write_text(json.dumps(doc))
    out = tmp_path / "x.folded"
    result = export(src, "--format", "collapsed", "-o", out, expect=5)
    (line,) = result.stderr.strip().splitlines()
    assert line == (
        f"opguard: error: {src}: unknown format 'opguard-calltree' version {version!r} "
        "(expected 'opguard-calltree' version 1, 3, 4, 5 or 6)"
    )
    assert not out.exists()


def test_a_fifo_src_is_refused_without_blocking(tree_file: Path, tmp_path: Path) -> None:
    """A FIFO SRC (or a run directory whose tree is one) held export up for ever, and
    one with a writer was read twice: `empty file` for a whole trace behind it."""
    import contextlib
    import os
    import threading

    run = tmp_path / "run"
    shutil.copytree(tree_file.parent, run)
    (run / tree_file.name).unlink()
    os.mkfifo(run / tree_file.name)
    done, fired = threading.Event(), threading.Event()

    def unblock() -> None:  # every 20 s, give a blocked reader end of file
        while not done.wait(20):
            fired.set()
            with contextlib.suppress(OSError):
                os.close(os.open(run / tree_file.name, os.O_WRONLY | os.O_NONBLOCK))

    threading.Thread(target=unblock, daemon=True).start()
    for src in (run / tree_file.name, run):
        result = export(src, "--format", "collapsed", "-o", tmp_path / "x.folded", expect=5)
        assert result.stderr.strip().endswith("not a regular file (a FIFO, device or socket)")
    done.set()
    assert not fired.is_set()  # nobody had to unblock it
