"""Issue 10, part A: hostile input and conditions, one row per class, each a case that
failed before the fix (docs/reliability.md, "Round two: trees, writes, plugins").

Classes: deep call trees (1), write errors at any point (4), carried fields that are
equal in Python but not in bytes (5), plugins that end the process, interrupt, or
return cyclic, absurdly deep or huge trees (10), and strings that could forge a line
(11). Through the public CLI wherever a user would meet them.
"""

from __future__ import annotations

import errno
import functools
import itertools
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from opguard_core.cli.app import cli_for
from opguard_core.combine.accumulator import TraceAccumulator
from opguard_core.errors import InputError, one_line
from opguard_core.files import atomic
from opguard_core.formats import deep_json
from opguard_core.formats.config import dump_config
from opguard_core.formats.trace import decode_trace
from opguard_core.formats.tree import COMPACT_LEVEL, MAX_TREE_DEPTH, encode_tree, load_tree
from opguard_plugins.stages import compress as compress_plugin
from opguard_plugins.stages import merge as merge_plugin
from tests.builders import sample_inputs
from tests.test_atomic import assert_every_artifact_parses, leftovers

# ----------------------------------------------------------------------------- helpers


def frame(i: int, qualname: str | None = None, module: str = "deep") -> dict[str, Any]:
    name = qualname or f"f{i}"
    return {"file": f"{module}.py", "line": i, "function": name, "qualname": name, "module": module}


def trace(frames: list[dict[str, Any]], sites: list[dict[str, Any]], **meta: Any) -> bytes:
    return json.dumps(
        {
            "format": "opguard-callsites",
            "version": 1,
            "meta": {"rank": 0, **meta},
            "frames": frames,
            "callsites": sites,
        }
    ).encode()


def site(stack: list[int], op: str = "aten::mm", count: int = 1, **more: Any) -> dict[str, Any]:
    return {"stack": stack, "op": op, "stream": 0, "count": count, **more}


def recursion_600() -> bytes:
    """``main`` → ``rec`` 600 times (one frame id per line), ops at the bottom and half way."""
    frames = [frame(1, "main"), frame(10, "rec"), frame(12, "rec")]
    return trace(
        frames,
        [
            site([0, *[1] * 599, 2], "aten::add", 3, api="torch.add"),
            site([0, *[1] * 300], "aten::mm", 2),
        ],
    )


def stack_30000() -> bytes:
    """One callsite under 30,000 distinct frames."""
    return trace([frame(i) for i in range(30_000)], [site(list(range(30_000)), count=5)])


def staircase_10000() -> bytes:
    """10,000 levels, a callsite every 500 levels down (a different op on each step)."""
    frames = [frame(i) for i in range(10_000)]
    return trace(frames, [site(list(range(d)), f"aten::op{d}") for d in range(500, 10_001, 500)])


DEEP = {"recursion_600": recursion_600, "stack_30000": stack_30000, "staircase": staircase_10000}


def collapsed_total(path: Path) -> int:
    return sum(int(line.rpartition(" ")[2]) for line in path.read_text().splitlines())


def run_cli(*args: str | Path) -> Any:
    argv = ["--log-format", "json", *[str(a) for a in args]]
    return CliRunner().invoke(cli_for(argv), argv, catch_exceptions=False)


def summary_of(run: Any) -> dict[str, Any]:
    return json.loads(run.read("pipeline_summary.json"))  # type: ignore[no-any-return]


def failed_stages(summary: dict[str, Any]) -> list[tuple[str, str, str]]:
    return [
        (s["stage"], s["entry"], s["error"]) for s in summary["stages"] if s["status"] == "failed"
    ]


# ----------------------------------------------------------------------------- 1. deep trees

DEEP_ROWS = [
    pytest.param("recursion_600", True, id="recursion_600-chains"),
    pytest.param("recursion_600", False, id="recursion_600-no_chains"),
    pytest.param("stack_30000", True, id="stack_30000-chains", marks=pytest.mark.slow),
    pytest.param("stack_30000", False, id="stack_30000-no_chains", marks=pytest.mark.slow),
    pytest.param("staircase", True, id="staircase_10000-chains"),
    pytest.param("staircase", False, id="staircase_10000-no_chains", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("shape", "chains"), DEEP_ROWS)
def test_deep_stacks_go_through_every_stage_and_export(
    shape: str, chains: bool, opguard: Callable[..., Any], tmp_path: Path
) -> None:
    source = tmp_path / f"{shape}.json"
    source.write_bytes(DEEP[shape]())
    total = decode_trace(source.read_bytes(), source).callsites
    expected = sum(s.count for s in total)
    run = opguard("run", "-i", source, "--chains" if chains else "--no-chains", expect=0)
    summary = summary_of(run)
    assert summary["status"] == "ok"
    assert {s["stage"] for s in summary["stages"] if s["status"] == "ok"} >= {
        "combine",
        "compress",
        "generate",
    }
    tree_path = run.run_dir / f"{shape}_compressed.json"
    tree = load_tree(tree_path)
    assert tree["root"]["count"] == expected
    config = run.read(f"{shape}_instrumentation.yaml")
    assert "entries:" in config
    assert (run.run_dir / "report.html").read_text().rstrip().endswith("</html>")
    assert_every_artifact_parses(run.run_dir)
    # the compressed tree and the raw trace both export, every op kept
    for src in (tree_path, source):
        out = tmp_path / f"{src.stem}.collapsed"
        result = run_cli("export", src, "--format", "collapsed", "-o", out)
        assert result.exit_code == 0, result.stderr
        assert collapsed_total(out) == expected
    speedscope = tmp_path / "x.speedscope.json"
    assert run_cli("export", tree_path, "--format", "speedscope", "-o", speedscope).exit_code == 0
    assert json.loads(speedscope.read_text())["profiles"][0]["endValue"] == expected


def test_deep_tree_file_is_msgspec_bytes_down_to_the_compact_level(tmp_path: Path) -> None:
    """A tree deeper than COMPACT_LEVEL: indented as before down to that level, each
    deeper subtree on one line; any JSON reader reads the same document."""
    data = trace([frame(i) for i in range(3_000)], [site(list(range(3_000)), count=5)])
    accumulator = TraceAccumulator()
    accumulator.add(decode_trace(data, "x.json"))
    tree = compress_plugin.compress_trace(accumulator.result(), _options(chains=False))
    encoded = encode_tree(tree)
    lines = encoded.splitlines()
    assert max(len(line) - len(line.lstrip(b" ")) for line in lines) <= 2 * COMPACT_LEVEL + 1
    assert len(lines) < 2_000  # below the compact level, one line per subtree
    # (== on a 30,000-level dict would itself recurse: compare the written forms)
    compact = functools.partial(deep_json.encode_indented, compact_from=0)
    assert compact(deep_json.decode(encoded)) == compact(tree)
    assert encoded.startswith(b'{\n "format": "opguard-calltree",\n "version": 6,\n "meta": {\n')


def test_shallow_trees_keep_their_bytes(samples: Path) -> None:
    accumulator = TraceAccumulator()
    for path in sorted(samples.glob("fsdp_callsite_rank*.json")):
        accumulator.add_file(path)
    tree = compress_plugin.compress_trace(accumulator.result(), _options(chains=False))
    assert encode_tree(tree) == msgspec.json.format(msgspec.json.encode(tree), indent=1) + b"\n"


def _options(**changes: Any) -> Any:
    from opguard_core.model import RunOptions

    return RunOptions(**changes)


def test_load_tree_of_absurd_nesting_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "deep_compressed.json"
    path.write_bytes(b'{"format": "opguard-calltree", "version": 1, "root": ' + b"[" * 200_000)
    with pytest.raises(InputError, match=r"deep_compressed.json: not valid JSON: JSON is trunc"):
        load_tree(path)
    path.write_bytes(b"[" * 200_000 + b"]" * 200_000)
    with pytest.raises(InputError, match=r"expected a JSON object at top level"):
        load_tree(path)


def test_decoding_is_bounded_even_with_a_raised_recursion_limit(tmp_path: Path) -> None:
    """With the limit raised (as a traced program may), msgspec would recurse into the C
    stack; deep_json lowers it around the call and parses deep documents iteratively."""
    code = textwrap.dedent(
        """
        import sys
        sys.setrecursionlimit(10**6)
        from opguard_core.formats import deep_json
        doc = b"[" * 300_000 + b"]" * 300_000  # far past what the C stack holds
        value = deep_json.decode(doc)
        depth = 0
        while value:
            (value,) = value
            depth += 1
        print(depth, sys.getrecursionlimit())
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parent.parent,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["299999", "1000000"]


JSONISH = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=30,
)


@settings(max_examples=200, deadline=None)
@given(JSONISH)
def test_deep_json_writes_and_reads_what_msgspec_does(value: Any) -> None:
    indented = msgspec.json.format(msgspec.json.encode(value), indent=1)
    assert deep_json.encode_indented(value) == indented
    assert deep_json.encode_indented(value, compact_from=0) == msgspec.json.encode(value)
    assert deep_json.decode_iterative(indented) == msgspec.json.decode(indented)
    assert deep_json.decode_iterative(msgspec.json.encode(value)) == value
    for level in (0, 1, 2):
        assert deep_json.decode(deep_json.encode_indented(value, compact_from=level)) == value


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=40) | st.text(max_size=40).map(str.encode))
def test_deep_json_refuses_what_msgspec_refuses(data: bytes) -> None:
    try:
        expected = msgspec.json.decode(data)
    except msgspec.DecodeError:
        with pytest.raises(deep_json.DeepJSONError):
            deep_json.decode_iterative(data)
    else:
        assert deep_json.decode_iterative(data) == expected


TRACED_PROGRAM = textwrap.dedent(
    """
    import sys
    import torch
    from opguard_plugins.tracer import trace_callsites

    x = torch.ones(2, 2)

    def height():
        depth, frame = 0, sys._getframe()
        while frame is not None:
            depth, frame = depth + 1, frame.f_back
        return depth

    def rec(n):
        if n % 100 == 0:
            torch.mm(x, x)
        if n:
            return rec(n - 1)
        torch.add(x, 1)
        return height()

    room = sys.getrecursionlimit() - height()
    with trace_callsites(label="deep", output_dir=sys.argv[1], rank=0):
        for margin in range(20, room, 10):  # as deep as the tracer lets the program go
            try:
                reached = rec(room - margin)
                break
            except RecursionError:
                continue
    print(reached, sys.getrecursionlimit())
    """
)


@pytest.mark.slow
@pytest.mark.torch
def test_program_traced_at_the_default_recursion_limit_compresses(
    opguard: Callable[..., Any], tmp_path: Path
) -> None:
    pytest.importorskip("torch")
    proc = subprocess.run(
        [sys.executable, "-c", TRACED_PROGRAM, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parent.parent,
    )
    assert proc.returncode == 0, proc.stderr
    reached, limit = map(int, proc.stdout.split())
    assert limit == 1000 and reached > 900
    source = tmp_path / "deep_callsite_rank0.json"
    for chains in ("--chains", "--no-chains"):
        run = opguard("run", "-i", source, chains, expect=0)
        tree = load_tree(run.run_dir / "deep_callsite_compressed.json")
        depth, todo = 0, [(tree["root"], 0)]
        while todo:
            node, level = todo.pop()
            depth = max(depth, level)
            todo.extend((child, level + 1) for child in node["children"])
        assert depth > (1 if chains == "--chains" else 800)


# ----------------------------------------------------------------------------- 4. write errors


def _failing_writes(
    monkeypatch: pytest.MonkeyPatch, should_fail: Callable[[str, int], bool], code: int
) -> None:
    """Make fsync fail with ``code`` for files whose final name and attempt number
    (per name) ``should_fail`` picks."""
    real = os.fsync
    attempts: dict[str, int] = {}

    def fsync(fd: int) -> None:
        tmp = os.readlink(f"/proc/self/fd/{fd}").rsplit("/", 1)[-1]
        name = tmp[1:].rsplit(".", 2)[0]
        attempts[name] = attempts.get(name, 0) + 1
        if should_fail(name, attempts[name]):
            raise OSError(code, os.strerror(code))
        real(fd)

    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc to name the file being written")
    monkeypatch.setattr(atomic.os, "fsync", fsync)


def test_every_summary_write_failing_is_one_line_and_exit_1(
    opguard: Callable[..., Any], samples: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _failing_writes(monkeypatch, lambda name, n: name == "pipeline_summary.json", errno.ENOSPC)
    run = opguard("run", *sample_inputs(samples, "gpt", "fsdp"), "--basic")
    assert run.exit_code == 1
    assert "Traceback" not in run.stderr
    lines = [line for line in run.stderr.splitlines() if line.startswith("opguard:")]
    assert lines == [
        f"opguard: summary not written: {run.run_dir / 'pipeline_summary.json'}:"
        " cannot write: No space left on device"
    ]
    assert not (run.run_dir / "pipeline_summary.json").exists()
    assert (run.run_dir / "final_combined_filtered_instrumentation.yaml").exists()
    assert leftovers(run.run_dir) == []


@pytest.mark.slow  # over 2 s in the quick group
def test_summary_writes_failing_mid_run_still_leave_the_final_summary(
    opguard: Callable[..., Any], samples: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a write after every stage, as before summary writes were paced (SummaryPace)
    monkeypatch.setattr("opguard_core.run.summary.SummaryPace.PACE", 0)
    _failing_writes(
        monkeypatch, lambda name, n: name == "pipeline_summary.json" and n in (2, 3, 5), errno.EIO
    )
    run = opguard("run", *sample_inputs(samples, "gpt", "fsdp"), expect=0)
    summary = summary_of(run)
    assert summary["status"] == "ok" and summary["exit_code"] == 0
    assert [s["stage"] for s in summary["stages"]].count("generate") == 2
    logged = [json.loads(line) for line in run.stderr.splitlines() if line.startswith("{")]
    assert sum(1 for e in logged if e["event"] == "summary not written") >= 1
    assert_every_artifact_parses(run.run_dir)


@pytest.mark.parametrize(
    ("artifact", "code", "stage", "entry"),
    [
        pytest.param(
            "comparison_1_vs_2.log",
            errno.ENOSPC,
            "compare",
            "fsdp_callsite",
            id="enospc_comparison_log",
        ),
        pytest.param(
            "temp_combined_1.yaml", errno.EFBIG, "merge", "fsdp_callsite", id="efbig_merge"
        ),
        pytest.param(
            "gpt_callsite_combined.json",
            errno.ENOSPC,
            "combine",
            "gpt_callsite",
            id="enospc_combine",
        ),
    ],
)
def test_write_error_names_the_file_and_the_run_goes_on(
    artifact: str,
    code: int,
    stage: str,
    entry: str,
    opguard: Callable[..., Any],
    samples: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _failing_writes(monkeypatch, lambda name, n: name == artifact, code)
    run = opguard("run", *sample_inputs(samples, "gpt", "fsdp"))
    assert run.exit_code == 1
    assert "Traceback" not in run.stderr
    [(failed_stage, failed_entry, error)] = failed_stages(summary_of(run))
    assert (failed_stage, failed_entry) == (stage, entry)
    assert error == f"{run.run_dir / artifact}: cannot write: {os.strerror(code)}"
    assert f"opguard: {stage} [{entry}] failed: {error}" in run.stderr.splitlines()
    assert (run.run_dir / "fsdp_callsite_instrumentation.yaml").exists()  # the rest went on
    assert_every_artifact_parses(run.run_dir)


# ----------------------------------------------------------------------------- 5. determinism

CARRIED = [1, True, 1.0]


def _rank_files(directory: Path, values: list[Any], where: str) -> list[Path]:
    paths = []
    for rank, value in enumerate(values):
        frames = [frame(1, "main", module="m")]
        sites = [site([0], count=rank + 1)]
        meta: dict[str, Any] = {}
        if where == "meta":
            meta["carried"] = value
        elif where == "frame":
            frames[0]["carried"] = value
        else:
            sites[0]["carried"] = value
        path = directory / f"x_rank{rank}.json"
        path.write_bytes(trace(frames, sites, **{**meta, "rank": rank}))
        paths.append(path)
    return paths


@pytest.mark.parametrize("where", ["meta", "frame", "callsite"])
def test_values_equal_in_python_but_not_in_bytes_conflict(
    where: str, opguard: Callable[..., Any], tmp_path: Path
) -> None:
    outputs = set()
    # three orders (each value first once), each local, and one on a pool of 2
    runs = [((0, 1, 2), "1"), ((1, 2, 0), "1"), ((2, 0, 1), "1"), ((2, 1, 0), "2")]
    for order, job in runs:
        directory = tmp_path / "".join(map(str, order))
        directory.mkdir()
        _rank_files(directory, [CARRIED[i] for i in order], where)
        for jobs in (job,):
            run = opguard("run", "-i", directory / "x_rank*.json", "--jobs", jobs, expect=0)
            outputs.add(run.read("x_combined.json"))
    [combined] = outputs  # one set of bytes for every order and --jobs
    assert '"carried"' not in combined  # they disagree, so the field is dropped


def test_merge_picks_the_same_carried_value_in_any_order() -> None:
    from ruamel.yaml.comments import CommentedMap

    def config(value: Any) -> CommentedMap:
        c = CommentedMap()
        c["version"] = 2
        c["source"] = f"s{value!r}"
        c["meta"] = CommentedMap([("ranks", [0]), ("total", 1), ("carried", value)])
        c["entries"] = []
        c["carried"] = value
        return c

    for a, b in itertools.combinations(CARRIED, 2):
        one = dump_config(merge_plugin.opguard_merge(left=config(a), right=config(b)))
        other = dump_config(merge_plugin.opguard_merge(left=config(b), right=config(a)))
        assert one == other, (a, b)
        assert one.count(f"carried: {min((a, b), key=repr)!r}".replace("True", "true")) == 2


# ----------------------------------------------------------------------------- 10. plugins


def _cyclic(tree: dict[str, Any]) -> dict[str, Any]:
    child = tree["root"]["children"][0]
    child["children"].append(child)
    return tree


def _too_deep(tree: dict[str, Any]) -> dict[str, Any]:
    total = tree["root"]["count"]  # conserved: only the depth is wrong
    node = {
        "module": "m",
        "qualname": "f",
        "file": "m.py",
        "lines": [1],
        "kind": "function",
        "count": total,
        "self_ops": {"aten::mm": total},
        "self_streams": {"compute": total},
        "ranks": [0],
        "chain": [],
        "children": [],
    }
    for _ in range(MAX_TREE_DEPTH + 5):
        node = {**node, "self_ops": {}, "self_streams": {}, "children": [node]}
    tree["root"] = {
        "name": "<root>",
        "count": total,
        "self_ops": {},
        "self_streams": {},
        "children": [node],
    }
    return tree


def _huge(tree: dict[str, Any]) -> dict[str, Any]:
    big = 10**400
    tree["root"]["count"] = big
    tree["root"]["self_ops"] = {"aten::mm": big}
    tree["root"]["self_streams"] = {"compute": big}
    tree["root"]["children"] = []
    return tree


PLUGIN_ROWS = [
    pytest.param(
        "exit",
        "SystemExit(3) raised by plugin compress: a plugin may not end the process",
        id="system_exit",
    ),
    pytest.param(
        "interrupt",
        "KeyboardInterrupt raised by plugin compress without a SIGINT",
        id="keyboard_interrupt",
    ),
    pytest.param(_cyclic, "the tree has a cycle or a node with two parents", id="cyclic_tree"),
    pytest.param(
        _too_deep, f"the tree is deeper than {MAX_TREE_DEPTH} levels", id="absurdly_deep_tree"
    ),
    pytest.param(
        _huge,
        "root: count 1000000000000000000000000000000000000... is not an integer in [0, 2**63)",
        id="count_too_large_for_a_float",
    ),
    pytest.param(
        lambda tree: 42,
        "plugin 'compress': compressor returned int, not a call tree",
        id="not_a_tree",
    ),
    pytest.param(
        lambda tree: {**tree, "meta": ["x"]},
        "plugin 'compress': a call tree's root and meta must be objects",
        id="meta_a_list",
    ),
]


@pytest.mark.parametrize(("misbehave", "message"), PLUGIN_ROWS)
def test_a_misbehaving_compressor_fails_its_stage_and_the_summary_says_so(
    misbehave: Any,
    message: str,
    opguard: Callable[..., Any],
    samples: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = compress_plugin.compress_trace

    def compress(trace: Any, options: Any) -> Any:
        if trace.meta.get("label") != "fsdp":
            return real(trace, options)
        if misbehave == "exit":
            sys.exit(3)
        if misbehave == "interrupt":
            raise KeyboardInterrupt
        return misbehave(real(trace, options))

    monkeypatch.setattr(compress_plugin, "compress_trace", compress)
    run = opguard("run", *sample_inputs(samples, "gpt", "fsdp"))
    assert run.exit_code == 1, run.stderr
    assert "Traceback" not in run.stderr
    summary = summary_of(run)
    assert summary["status"] == "failed" and summary["exit_code"] == 1
    assert summary["interrupted"] is None
    [(stage, entry, error)] = failed_stages(summary)
    assert (stage, entry) == ("compress", "fsdp_callsite")
    assert message in error
    assert (run.run_dir / "gpt_callsite_instrumentation.yaml").exists()
    assert_every_artifact_parses(run.run_dir)


def test_a_failed_merge_skips_the_folds_later_steps_and_says_so(
    opguard: Callable[..., Any], samples: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(1+2)+3 with 1+2 failing: the fold stops, and merge [3] was in no record at all
    (not failed, not skipped), while the other stages after a failure are skipped."""
    third = tmp_path / "third"
    third.mkdir()
    for rank in (0, 1):
        text = (samples / f"gpt_callsite_rank{rank}.json").read_text()
        (third / f"third_callsite_rank{rank}.json").write_text(text)

    def merge(left: Any, right: Any) -> Any:
        raise RuntimeError("no merging today")

    monkeypatch.setattr(merge_plugin, "merge_configs", merge)
    run = opguard("run", *sample_inputs(samples, "gpt", "fsdp"),
                  "-i", str(third / "third_callsite_rank*.json"))  # fmt: skip
    assert run.exit_code == 1, run.stderr
    summary = summary_of(run)
    merges = [(r["entry"], r["status"], r["error"]) for r in summary["stages"]
              if r["stage"] == "merge"]  # fmt: skip
    assert merges == [
        ("fsdp_callsite", "failed", "RuntimeError: no merging today"),
        ("third_callsite", "skipped", "an earlier stage failed: RuntimeError: no merging today"),
    ]
    assert not (run.run_dir / "final_combined_instrumentation.yaml").exists()


def test_a_plugin_warning_with_a_path_field_is_in_the_summary(
    opguard: Callable[..., Any], samples: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``warn(..., file=path)`` from a plugin: the summary could not be encoded (a
    TypeError out of msgspec, not caught): a traceback, and a summary left ``running``."""
    from opguard_core.run.warnings import warn

    real = compress_plugin.compress_trace

    def compress(trace: Any, options: Any) -> Any:
        warn("a plugin's warning", file=samples / "gpt_callsite_rank0.json")
        return real(trace, options)

    monkeypatch.setattr(compress_plugin, "compress_trace", compress)
    run = opguard("run", *sample_inputs(samples, "gpt"), expect=0)
    summary = summary_of(run)
    assert (summary["status"], summary["exit_code"]) == ("ok", 0)
    [warning] = [w for w in summary["warnings"] if w["message"] == "a plugin's warning"]
    assert warning["file"] == str(samples / "gpt_callsite_rank0.json")
    assert (run.run_dir / "report.html").exists()  # its encoder failed alike


def test_a_report_plugin_exiting_does_not_end_the_run(
    opguard: Callable[..., Any], samples: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from opguard_plugins.view import report

    def write_report(run_dir: Path, *args: Any) -> None:
        raise SystemExit(0)

    monkeypatch.setattr(report, "write_report", write_report)
    run = opguard("run", *sample_inputs(samples, "gpt"), expect=0)
    logged = [json.loads(line) for line in run.stderr.splitlines() if line.startswith("{")]
    [failure] = [e for e in logged if e["event"] == "run_finished failed"]
    assert failure["plugin"] == "report" and "SystemExit(0)" in failure["error"]
    assert [e["event"] for e in logged][-2:] == ["run finished", "run summary"]


# ----------------------------------------------------------------------------- 11. one line

FORGING = "x\n\x1b[31mopguard: ok\r\u2028\x85\tq"


def test_control_characters_in_file_names_never_forge_an_error_line(
    opguard: Callable[..., Any], tmp_path: Path, samples: Path
) -> None:
    bad = tmp_path / f"bad{FORGING}.json"
    bad.write_bytes(b"{not json")
    missing = tmp_path / f"gone{FORGING}.json"
    run = opguard("run", "-i", bad, "-i", missing, *sample_inputs(samples, "gpt"))
    assert run.exit_code == 1
    errors = [line for line in run.stderr.splitlines() if not line.startswith("{")]
    assert len(errors) == 2, errors
    assert all(line.startswith("opguard: ") and "failed:" in line for line in errors)
    assert all("\x1b" not in line and "\r" not in line for line in errors)
    assert any(one_line(str(bad)) in line for line in errors)
    assert any(one_line(missing.name) in line for line in errors)
    for line in run.stderr.splitlines():  # JSON logs: one record a line
        json.loads(line) if line.startswith("{") else None


def test_a_file_name_that_is_not_utf8_runs_and_the_summary_escapes_it(
    opguard: Callable[..., Any], tmp_path: Path, samples: Path
) -> None:
    """Linux file names are bytes: one that is not UTF-8 reaches Python as lone
    surrogates, which JSON cannot carry; the summary writes its odd byte as ``\\xe9``
    (it once ended the run with a traceback and a summary left 'running')."""
    name = os.fsdecode(b"caf\xe9_rank0.json")
    (tmp_path / name).write_bytes((samples / "gpt_callsite_rank0.json").read_bytes())
    run = opguard("run", "-i", tmp_path / name)
    assert run.exit_code == 0, run.stderr[-2000:]
    summary = json.loads((run.run_dir / "pipeline_summary.json").read_text(encoding="utf-8"))
    assert summary["status"] == "ok"
    assert summary["entries"][0]["files"] == [f"{tmp_path}/caf\\xe9_rank0.json"]


def test_control_characters_in_console_logs_are_escaped(tmp_path: Path, samples: Path) -> None:
    bad = tmp_path / f"bad{FORGING}.json"
    bad.write_bytes(b"[]")
    env = {**os.environ, "OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path / "out")}
    proc = subprocess.run(
        [sys.executable, "-m", "opguard_core.cli.app", "--log-format", "console", "run", "-i", bad],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        cwd=Path(__file__).parent.parent,
    )
    assert proc.returncode == 1
    assert "\x1b[31mopguard" not in proc.stderr and "\u2028" not in proc.stderr
    assert proc.stderr.count("opguard: ok") == proc.stderr.count(r"\x1b[31mopguard: ok")


def test_trace_strings_cannot_forge_comparison_log_lines(
    opguard: Callable[..., Any], tmp_path: Path
) -> None:
    for name, qualname in (("one", f"evil{FORGING}"), ("two", "plain")):
        frames = [frame(1, qualname, module=f"m{FORGING}")]
        (tmp_path / f"{name}.json").write_bytes(trace(frames, [site([0], "aten::mm\n+ fake")]))
    run = opguard("run", "-i", tmp_path / "one.json", "-i", tmp_path / "two.json", expect=0)
    log = run.read("comparison_1_vs_2.log")
    assert "\x1b" not in log and "\r" not in log and "\u2028" not in log and "\x85" not in log
    entries = [line for line in log.splitlines() if line.startswith(("  - ", "  + "))]
    assert len(entries) == 2  # one entry only in each config, each on one line
    assert not any(line.startswith("+ fake") for line in log.splitlines())


def test_memory_error_names_the_file(
    opguard: Callable[..., Any], samples: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from opguard_core.combine import accumulator as combined

    real = combined.read_bytes

    def read_bytes(path: Path) -> Any:
        if path.name == "gpt_callsite_rank1.json":
            raise MemoryError
        return real(path)

    monkeypatch.setattr(combined, "read_bytes", read_bytes)
    run = opguard("run", *sample_inputs(samples, "gpt", "fsdp"), "--jobs", "1")
    assert run.exit_code == 1
    [(stage, entry, error)] = failed_stages(summary_of(run))
    assert (stage, entry) == ("combine", "gpt_callsite")
    assert error == f"{samples / 'gpt_callsite_rank1.json'}: out of memory reading this file"


# ----------------------------------------------------------------------------- 2. configs

AWKWARD = ["?q", ":q", "-q", "!q", "&q", "*q", "#q", "a: b", "a #b", "n\x85l", "l\u2028s",
           "p\u2029s", "t\tb", "'q", '"q', "b\\s"]  # fmt: skip


def test_every_trace_string_reads_back_from_the_config(
    opguard: Callable[..., Any], tmp_path: Path
) -> None:
    """Through the whole pipeline (tests/test_fast_yaml.py proves it for arbitrary
    text): op names, modules, qualnames, files and apis that YAML would misread, and
    a frame with a null module and an empty file."""
    from opguard_core.formats.config import load_config

    frames = [
        {"file": "", "line": 1, "function": "f", "qualname": "?f", "module": None},
        *({"file": f"{s}.py", "line": 2, "function": "g", "qualname": f"{s}g", "module": s}
          for s in AWKWARD),
    ]  # fmt: skip
    sites = [site([0, i + 1], f"aten::{s}", api=f"torch.{s}") for i, s in enumerate(AWKWARD)]
    source = tmp_path / "awkward.json"
    source.write_bytes(trace(frames, sites))
    run = opguard("run", "-i", source, "--min-fraction", "0", "--no-default-hide", expect=0)
    config = load_config(run.run_dir / "awkward_instrumentation.yaml")
    targets = {str(e["target"]) for e in config["entries"]}
    assert "?:?f" in targets
    assert {f"{s}:{s}g" for s in AWKWARD} <= targets
    ops = {str(op) for e in config["entries"] for op in e["ops"]}
    assert ops == {f"aten::{s}" for s in AWKWARD}


def test_a_sigterm_while_the_run_finishes_waits_for_its_summary_and_report(
    tmp_path: Path, samples: Path
) -> None:
    """SIGTERM as the final summary is written (all steps done): the summary and the
    report are written, then the signal ends the process (it once ended it at once,
    leaving a summary that said 'running' and no report)."""
    script = tmp_path / "late_term.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, signal, sys
            from opguard_core.cli.app import main
            from opguard_core.run.runner import Runner

            original = Runner.write_summary

            def write_summary(self, final=False):
                if final:
                    os.kill(os.getpid(), signal.SIGTERM)
                original(self, final)

            Runner.write_summary = write_summary
            sys.argv = ["opguard", "--log-format", "json", *sys.argv[1:]]
            main()
            """
        )
    )
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(script), "run", "-i", str(samples / "gpt_callsite_rank*.json"),
         "--output-base", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == -signal.SIGTERM, proc.stderr[-2000:]
    (run_dir,) = out.iterdir()
    summary = json.loads((run_dir / "pipeline_summary.json").read_text())
    assert summary["status"] == "ok" and summary["finished_at"] is not None
    assert (run_dir / "report.html").is_file()
