"""Bad input (issue 5, part 1): every class gets a one-line error that names the file and
the problem, a non-zero exit, no traceback unless ``--verbose``, and the good entry given
beside it is still processed. Table-driven, through the public CLI and at unit level."""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from opguard_core.combine.accumulator import TraceAccumulator
from opguard_core.errors import InputError
from opguard_core.formats.config import load_config, parse_config
from opguard_core.formats.trace import MAX_NESTING, MAX_RANK, decode_trace, load_trace
from opguard_plugins.stages.basic_filter import load_basic_list
from tests.builders import sample_inputs, trace_doc

GOOD_ENTRY = "gpt_callsite"


def valid_doc() -> dict[str, Any]:
    return {
        "format": "opguard-callsites",
        "version": 1,
        "meta": {"label": "x", "rank": 0, "world_size": 1},
        "frames": [
            {"file": "train.py", "line": 3, "function": "main", "qualname": "main", "module": "t"}
        ],
        "callsites": [{"stack": [0], "api": "torch.mm", "op": "aten::mm", "stream": 0, "count": 2}],
    }


def doc(**changes: Any) -> bytes:
    """The valid document with top-level fields replaced (``...`` deletes a field)."""
    data = valid_doc()
    for key, value in changes.items():
        if value is ...:
            del data[key]
        else:
            data[key] = value
    return json.dumps(data).encode()


def site(**changes: Any) -> bytes:
    """The valid document with fields of its first callsite replaced (``...`` deletes)."""
    data = valid_doc()
    for key, value in changes.items():
        if value is ...:
            del data["callsites"][0][key]
        else:
            data["callsites"][0][key] = value
    return json.dumps(data).encode()


def frame(**changes: Any) -> bytes:
    data = valid_doc()
    for key, value in changes.items():
        if value is ...:
            del data["frames"][0][key]
        else:
            data["frames"][0][key] = value
    return json.dumps(data).encode()


DEEP = b'{"format": "opguard-callsites", "version": 1, "meta": ' + b'{"a": ' * 5000 + b"1"
DEEP += b"}" * 5000 + b', "frames": [], "callsites": []}'

#: (id, file content, a phrase the one-line error must contain)
TRACE_CASES: list[tuple[str, bytes, str]] = [
    ("not_json", b"this is not json\n", "not valid JSON"),
    ("truncated", doc()[:60], "truncated"),
    ("empty", b"", "empty file"),
    ("whitespace_only", b"  \n\t\n", "empty file"),
    ("not_utf8", doc().replace(b"train.py", b"tr\xff\xfein.py"), "UTF-8"),
    ("utf16", doc().decode().encode("utf-16"), "not valid JSON"),
    ("deep_array", b"[" * 100_000 + b"]" * 100_000, "nesting too deep"),
    ("deep_meta", DEEP, "nesting too deep"),
    ("top_level_array", b"[1, 2, 3]", "expected a JSON object at top level, got an array"),
    ("top_level_string", b'"opguard"', "expected a JSON object at top level, got a string"),
    ("top_level_null", b"null", "expected a JSON object at top level, got null"),
    ("unknown_format", doc(format="pprof"), "unknown format 'pprof'"),
    ("missing_format", doc(format=...), 'no "format" key: not an OpGuard document'),
    ("unknown_version", doc(version=3), "version 3 (expected"),
    ("version_string", doc(version="1"), "version '1'"),
    ("missing_frames", doc(frames=...), "missing required field `frames`"),
    ("frames_not_list", doc(frames={"0": {}}), "$.frames"),
    ("frame_not_object", doc(frames=[7]), "$.frames[0]"),
    ("frame_missing_file", frame(file=...), "missing required field `file`"),
    ("frame_line_string", frame(line="3"), "$.frames[0].line"),
    ("missing_callsites", doc(callsites=...), "missing required field `callsites`"),
    ("callsites_not_list", doc(callsites="none"), "$.callsites"),
    ("missing_stack", site(stack=...), "missing required field `stack`"),
    ("stack_not_list", site(stack=0), "$.callsites[0].stack"),
    ("stack_negative_id", site(stack=[-1]), "$.callsites[0].stack[0]"),
    ("missing_op", site(op=...), "missing required field `op`"),
    ("op_not_string", site(op=42), "$.callsites[0].op"),
    ("stream_string", site(stream="0"), "$.callsites[0].stream"),
    ("role_unknown", site(role="gpu"), "$.callsites[0].role"),
    ("role_not_string", site(role=3), "$.callsites[0].role"),
    ("role_missing_v4", doc(version=4), "callsites[0] has no role (version 4 needs one)"),
    (
        "version_3",
        doc(version=3),
        "expected format 'opguard-callsites' version 1, 2, 4, 5, 6, 7 or 8",
    ),
    ("dtype_not_a_name", site(role="compute", dtype="Float 32"), "$.callsites[0].dtype"),
    ("dtype_not_string", site(role="compute", dtype=32), "$.callsites[0].dtype"),
    ("count_zero", site(count=0), "$.callsites[0].count"),
    ("count_negative", site(count=-4), "$.callsites[0].count"),
    ("count_float", site(count=2.5), "$.callsites[0].count"),
    ("count_string", site(count="2"), "$.callsites[0].count"),
    ("count_bool", site(count=True), "$.callsites[0].count"),
    ("missing_count", site(count=...), "missing required field `count`"),
    ("frame_id_out_of_range", site(stack=[0, 5]), "refers to frame 5"),
    ("nan_count", site(count=1).replace(b'"count": 1', b'"count": NaN'), "not valid JSON"),
    ("nan_in_meta", doc(meta={"loss": float("nan")}), "not valid JSON"),
    ("infinity", doc(meta={"loss": float("inf")}), "not valid JSON"),
    ("ranks_not_list", site(ranks="0"), "$.callsites[0].ranks"),
    ("absurd_rank", doc(meta={"ranks": [10**12]}), "too large"),
    ("absurd_callsite_rank", site(ranks=[MAX_RANK]), "too large"),
    ("trailing_garbage", doc() + b"}}", "not valid JSON"),
]


# ----------------------------------------------------------------------------- unit level


@pytest.mark.parametrize(
    ("content", "problem"), [c[1:] for c in TRACE_CASES], ids=[c[0] for c in TRACE_CASES]
)
def test_decode_trace_refuses_with_one_line_error(content: bytes, problem: str) -> None:
    with pytest.raises(InputError) as caught:
        decode_trace(content, "dir/bad_rank0.json")
    message = str(caught.value)
    assert message.startswith("dir/bad_rank0.json: "), message
    assert problem in message, message
    assert "\n" not in message
    assert caught.value.path == "dir/bad_rank0.json"


def _nested_meta(depth: int, extra: bool = False) -> bytes:
    """The table's valid document with ``meta`` nesting containers so that the document
    is ``depth`` levels deep (itself level 1); ``extra``: also an unknown field, so
    that msgspec's strict decode refuses it and the lax one reads it."""
    data = json.loads(doc())
    data["meta"]["deep"] = None
    text = json.dumps(data)
    nested = '{"a": ' * (depth - 2) + "1" + "}" * (depth - 2)
    if extra:
        text = text.replace('"frames":', '"extra": 1, "frames":', 1)
    return text.replace('"deep": null', f'"deep": {nested}', 1).encode()


@pytest.mark.parametrize("extra", [False, True], ids=["strict", "lax"])
def test_the_nesting_bound_is_the_same_on_every_python(tmp_path: Path, extra: bool) -> None:
    """msgspec's own bound depends on the Python version (about 1000 less the stack's
    depth on 3.11, 1500 on 3.12, 10000 on 3.13): MAX_NESTING levels decode, one more
    is refused, on every version and on the combine's scanner path too."""
    assert decode_trace(_nested_meta(MAX_NESTING, extra), "ok.json").meta["deep"]
    for depth in (MAX_NESTING + 1, 1200, 5000):
        with pytest.raises(InputError, match=f"nesting too deep .more than {MAX_NESTING} levels"):
            decode_trace(_nested_meta(depth, extra), "deep_rank0.json")
        path = tmp_path / "deep_rank0.json"
        path.write_bytes(_nested_meta(depth, extra))
        with pytest.raises(InputError, match="nesting too deep"):
            TraceAccumulator().add_file(path)


def test_the_valid_document_used_by_the_table_decodes() -> None:
    """Every row above differs from this document in one way only."""
    trace = decode_trace(doc(), "ok.json")
    assert trace.callsites[0].count == 2
    decode_trace(site(ranks=[0]), "ok.json")
    decode_trace(site(extra_field={"x": 1}), "ok.json")


@pytest.mark.parametrize(
    ("make", "problem"),
    [
        pytest.param(lambda p: p / "missing.json", "no such file", id="missing"),
        pytest.param(lambda p: p, "is a directory", id="directory"),
    ],
)
def test_load_trace_refuses_unusable_paths(
    tmp_path: Path, make: Callable[[Path], Path], problem: str
) -> None:
    path = make(tmp_path)
    with pytest.raises(InputError, match=problem) as caught:
        load_trace(path)
    assert str(path) in str(caught.value)


def _deny_reads_of(monkeypatch: pytest.MonkeyPatch, victim: Path) -> None:
    """Simulate a chmod-000 file (tests run as root, where chmod does not block reads)."""
    real_read_bytes = pathlib.Path.read_bytes
    real_read_text = pathlib.Path.read_text

    def read_bytes(self: Path) -> bytes:
        if self.resolve() == victim.resolve():
            raise PermissionError(13, "Permission denied", str(self))
        return real_read_bytes(self)

    def read_text(self: Path, *args: Any, **kwargs: Any) -> str:
        if self.resolve() == victim.resolve():
            raise PermissionError(13, "Permission denied", str(self))
        return real_read_text(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "read_bytes", read_bytes)
    monkeypatch.setattr(pathlib.Path, "read_text", read_text)


def test_load_trace_refuses_unreadable_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "locked_rank0.json"
    path.write_bytes(doc())
    _deny_reads_of(monkeypatch, path)
    with pytest.raises(InputError, match="permission denied") as caught:
        load_trace(path)
    assert str(path) in str(caught.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a chmod 000 file anyway")
def test_load_trace_refuses_chmod_000_file(tmp_path: Path) -> None:
    path = tmp_path / "locked_rank0.json"
    path.write_bytes(doc())
    path.chmod(0)
    try:
        with pytest.raises(InputError, match="permission denied"):
            load_trace(path)
    finally:
        path.chmod(0o644)


CONFIG_CASES: list[tuple[str, str, str]] = [
    ("malformed_yaml", "version: 1\nentries: [\n", "malformed YAML"),
    ("bad_indentation", "version: 1\nentries:\n - target: a\n   x: : :\n", "malformed YAML"),
    ("duplicate_key", "version: 1\nversion: 1\nentries: []\n", "malformed YAML"),
    ("top_level_list", "- version: 1\n", "expected a YAML mapping at top level"),
    ("empty", "", "expected a YAML mapping at top level"),
    ("unknown_version", "version: 7\nentries: []\n", "unknown config version 7"),
    ("meta_not_mapping", "version: 1\nmeta: [1, 2]\nentries: []\n", "'meta' must be a mapping"),
    ("meta_ranks_bad", "version: 1\nmeta: {ranks: [a]}\nentries: []\n", "meta.ranks"),
    ("meta_steps_bad", "version: 2\nmeta: {steps: {a: -1}}\nentries: []\n", "meta.steps"),
    ("meta_total_bad", "version: 1\nmeta: {total: lots}\nentries: []\n", "meta.total"),
    ("entries_not_list", "version: 1\nentries: {}\n", "'entries' must be a list"),
    ("entry_not_mapping", "version: 1\nentries: [3]\n", "entries[0] must be a mapping"),
    ("target_missing", "version: 1\nentries: [{kind: method}]\n", "entries[0].target"),
    ("count_float", "version: 1\nentries: [{target: a, count: 1.5}]\n", "entries[0].count"),
    ("ops_bad", "version: 1\nentries: [{target: a, ops: {x: -1}}]\n", "entries[0].ops"),
    (
        "python_tag",
        "version: 1\nentries:\n  - target: a\n    file: !!python/object/apply:os.system [echo]\n",
        "entries[0].file",
    ),
]


@pytest.mark.parametrize(
    ("text", "problem"), [c[1:] for c in CONFIG_CASES], ids=[c[0] for c in CONFIG_CASES]
)
def test_load_config_refuses_with_one_line_error(tmp_path: Path, text: str, problem: str) -> None:
    path = tmp_path / "bad_instrumentation.yaml"
    path.write_text(text)
    with pytest.raises(InputError) as caught:
        load_config(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: "), message
    assert problem in message, message
    assert "\n" not in message
    with pytest.raises(InputError, match=problem.replace("[", r"\[").replace("]", r"\]")):
        parse_config(text, "x.yaml")


def test_load_config_refuses_unusable_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(InputError, match="no such file"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(InputError, match="cannot read file"):
        load_config(tmp_path)
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"version: 1\nentries: [\xff\xfe]\n")
    with pytest.raises(InputError, match="not UTF-8"):
        load_config(binary)
    locked = tmp_path / "locked.yaml"
    locked.write_text("version: 1\nentries: []\n")
    _deny_reads_of(monkeypatch, locked)
    with pytest.raises(InputError, match="Permission denied") as caught:
        load_config(locked)
    assert str(locked) in str(caught.value)


BASIC_LIST_CASES: list[tuple[str, bytes, str]] = [
    ("malformed_yaml", b"utilities: [cat\n", "malformed YAML"),
    ("not_utf8", b"utilities: [c\xffat]\n", "malformed YAML"),
    ("not_a_mapping", b"- cat\n- stack\n", "must be a mapping"),
    ("utilities_not_list", b"utilities: cat\n", "'utilities' must be a list"),
    ("python_tag", b"utilities: !!python/object/apply:os.system [echo]\n", "malformed YAML"),
]


@pytest.mark.parametrize(
    ("content", "problem"), [c[1:] for c in BASIC_LIST_CASES], ids=[c[0] for c in BASIC_LIST_CASES]
)
def test_basic_list_refuses_with_one_line_error(
    tmp_path: Path, content: bytes, problem: str
) -> None:
    path = tmp_path / "list.yaml"
    path.write_bytes(content)
    with pytest.raises(InputError) as caught:
        load_basic_list(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: ") and problem in message, message
    assert "\n" not in message


# ----------------------------------------------------------------------------- CLI


def _summary(run: Any) -> dict[str, Any]:
    return json.loads(run.read("pipeline_summary.json"))


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("opguard: ")]


def _assert_good_entry_processed(run: Any) -> None:
    assert run.run_dir is not None
    assert (run.run_dir / f"{GOOD_ENTRY}_instrumentation.yaml").is_file()
    stages = {(s["stage"], s["entry"]): s["status"] for s in _summary(run)["stages"]}
    for stage in ("combine", "compress", "generate"):
        assert stages[(stage, GOOD_ENTRY)] == "ok"


@pytest.mark.parametrize(
    ("content", "problem"), [c[1:] for c in TRACE_CASES], ids=[c[0] for c in TRACE_CASES]
)
def test_cli_reports_bad_trace_and_processes_the_good_entry(
    opguard: Callable[..., Any], samples: Path, tmp_path: Path, content: bytes, problem: str
) -> None:
    bad = tmp_path / "broken.json"
    bad.write_bytes(content)
    run = opguard("run", "-i", bad, "-i", str(samples / "gpt_callsite_rank*.json"))
    assert run.exit_code == 1
    assert "Traceback" not in run.stderr
    lines = _error_lines(run.stderr)
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith("opguard: combine [broken] failed: ")
    assert str(bad) in lines[0] and problem in lines[0]
    _assert_good_entry_processed(run)
    summary = _summary(run)
    assert summary["status"] == "failed" and summary["exit_code"] == 1
    failed = [s for s in summary["stages"] if s["status"] == "failed"]
    assert [(s["stage"], s["entry"]) for s in failed] == [("combine", "broken")]
    assert str(bad) in failed[0]["error"] and problem in failed[0]["error"]
    skipped = {s["stage"] for s in summary["stages"] if s["entry"] == "broken"} - {"combine"}
    assert {"compress", "generate"} <= skipped
    assert not (run.run_dir / "broken_combined.json").exists()


def test_cli_names_the_bad_rank_file_of_a_multi_rank_entry(
    opguard: Callable[..., Any], samples: Path
) -> None:
    (samples / "fsdp_callsite_rank1.json").write_bytes(site(count=0))
    run = opguard(
        "run",
        *sample_inputs(samples, "fsdp", "gpt"),
    )
    assert run.exit_code == 1
    (line,) = _error_lines(run.stderr)
    assert line.startswith("opguard: combine [fsdp_callsite] failed: ")
    assert "fsdp_callsite_rank1.json" in line and "count" in line
    _assert_good_entry_processed(run)


def test_cli_with_verbose_still_gives_the_one_line_error(
    opguard: Callable[..., Any], samples: Path, tmp_path: Path
) -> None:
    bad = tmp_path / "broken.json"
    bad.write_bytes(b"{")
    run = opguard("run", "-v", "-i", bad, "-i", str(samples / "gpt_callsite_rank*.json"))
    assert run.exit_code == 1
    assert any(f"{bad}: not valid JSON" in line for line in _error_lines(run.stderr))
    _assert_good_entry_processed(run)


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        pytest.param("missing_rank0.json", "no such file", id="missing_file"),
        pytest.param("nothing_here_*.json", "matched no files", id="pattern_matches_nothing"),
        pytest.param("a_directory", "is a directory", id="directory"),
        pytest.param(
            "dir_glob_*", "dir_glob_1: is a directory", id="pattern_matches_only_directories"
        ),
    ],
)
def test_cli_reports_unusable_inputs_and_processes_the_good_entry(
    opguard: Callable[..., Any], samples: Path, tmp_path: Path, spec: str, problem: str
) -> None:
    (tmp_path / "a_directory").mkdir()
    (tmp_path / "dir_glob_1").mkdir()
    good = str(samples / "gpt_callsite_rank*.json")
    run = opguard("run", "--base-dir", tmp_path, "-i", spec, "-i", good)
    assert run.exit_code == 1
    assert "Traceback" not in run.stderr
    (line,) = _error_lines(run.stderr)
    assert line.startswith(f"opguard: discover [{spec}] failed: ")
    assert spec.split("*")[0] in line and problem in line
    _assert_good_entry_processed(run)
    (failed,) = [s for s in _summary(run)["stages"] if s["status"] == "failed"]
    assert failed["stage"] == "discover" and failed["entry"] == spec
    assert problem in failed["error"]


def test_cli_reports_unreadable_file_and_processes_the_good_entry(
    opguard: Callable[..., Any], samples: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    locked = tmp_path / "locked.json"
    locked.write_bytes(doc())
    _deny_reads_of(monkeypatch, locked)
    run = opguard("run", "-i", locked, "-i", str(samples / "gpt_callsite_rank*.json"))
    assert run.exit_code == 1
    assert "Traceback" not in run.stderr
    (line,) = _error_lines(run.stderr)
    assert line.startswith("opguard: combine [locked] failed: ")
    assert str(locked) in line and "permission denied" in line
    _assert_good_entry_processed(run)


@pytest.mark.parametrize(
    ("content", "problem"), [c[1:] for c in BASIC_LIST_CASES], ids=[c[0] for c in BASIC_LIST_CASES]
)
def test_cli_refuses_a_malformed_basic_list_before_any_stage(
    opguard: Callable[..., Any], samples: Path, tmp_path: Path, content: bytes, problem: str
) -> None:
    """As a missing one (below): the basic filter reads it in ``opguard_check_options``
    (it was found by the filter stage, after every other stage had run: exit 1)."""
    basic_list = tmp_path / "my_list.yaml"
    basic_list.write_bytes(content)
    run = opguard(
        "run",
        "-i",
        str(samples / "gpt_callsite_rank*.json"),
        "--basic",
        "--basic-list",
        basic_list,
    )
    assert run.exit_code == 2
    assert "Traceback" not in run.stderr
    (line,) = [x for x in run.stderr.splitlines() if x.startswith("Error: ")]
    assert line.startswith(f"Error: {basic_list}: ") and problem in line
    assert not list(tmp_path.glob("**/preprocessing_*"))


def test_cli_reports_missing_basic_list_before_any_stage(
    opguard: Callable[..., Any], samples: Path, tmp_path: Path
) -> None:
    """A --basic-list that does not exist is a usage error before any stage runs (it
    was found by the filter stage, after every other stage had run)."""
    missing = tmp_path / "nope.yaml"
    run = opguard(
        "run", "-i", str(samples / "gpt_callsite_rank*.json"), "--basic", "--basic-list", missing
    )
    assert run.exit_code == 2
    assert f"Invalid value for '--basic-list': File '{missing}' does not exist." in run.stderr
    assert "Traceback" not in run.stderr
    assert not list(tmp_path.glob("**/preprocessing_*"))


def test_several_processes_name_the_first_bad_file_in_input_order(tmp_path: Path) -> None:
    """Ranks 3 and 6 of 8 are bad: ``--jobs 4`` names rank 3, as one process reading
    the files in order does, whichever process met a bad file first (once whichever
    error arrived first: rank 6 now and then)."""
    from opguard_core.errors import InputError
    from opguard_plugins.stages.combine import combine_files, combine_parallel, earliest_error

    paths = []
    for rank in range(8):
        doc = trace_doc([([("app", "main")], None, "aten::mm", 0 if rank in (3, 6) else 4)],
                        rank=rank)  # fmt: skip
        paths.append(tmp_path / f"x_rank{rank}.json")
        paths[-1].write_text(json.dumps(doc))
    with pytest.raises(InputError) as in_order:
        combine_files(paths)
    assert in_order.value.path == str(paths[3])
    for _ in range(3):
        with pytest.raises(InputError) as pooled:
            combine_parallel(paths, jobs=4)
        assert str(pooled.value) == str(in_order.value)
    later = InputError(paths[6], "what the process that read rank 6 raised")
    assert str(earliest_error(later, paths, None)) == str(in_order.value)


#: a name longer than the file system allows (NAME_MAX 255): Path.is_dir raises
LONG = "a" * 300


@pytest.mark.parametrize(
    "args",
    [
        ("show", LONG),
        ("export", LONG, "--format", "collapsed"),
        ("compare", LONG, LONG),
        ("merge", LONG, LONG, "-o", "merged.yaml"),
        ("filter", LONG, "-o", "filtered.yaml"),
        ("check", "--config", LONG, "-i", LONG),
        ("report", LONG),
    ],
    ids=lambda args: args[0],
)
def test_a_name_too_long_is_one_line_in_every_command(
    opguard: Callable[..., Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    args: tuple[str, ...],
) -> None:
    """``OSError: File name too long`` was a traceback from show, export, compare,
    merge, filter and check (asking whether SRC is a run directory)."""
    monkeypatch.chdir(tmp_path)
    run = opguard(*args)
    assert run.exit_code == 5, run.stderr
    assert "Traceback" not in run.stderr
    (line,) = _error_lines(run.stderr)
    assert line.startswith(f"opguard: error: {LONG}") and "too long" in line
