"""``opguard check``: violations, exit codes, the JSON report and the check-rule hook.

Configs are made by ``opguard run`` from the bundled example traces or from small
hand-made traces; checking is always done through the CLI.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from opguard_core import hookimpl
from opguard_core.cli.app import create_cli
from opguard_core.errors import ExitCode
from opguard_core.formats.check import (
    CHECK_FORMAT,
    KINDS,
    REPORT_VERSION,
    Violation,
    load_report,
)
from opguard_core.formats.config import load_config
from opguard_core.model import RunOptions
from opguard_core.plugin.manager import create_plugin_manager
from opguard_plugins.enforce.check import options_from_settings
from tests.builders import trace_doc, write

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "traces"

MAIN = ("app", "main")
STEP = ("app", "step")
FWD = ("app", "Model.forward")
HELPER = ("app", "helper")


def invoke(*args: str | Path, manager: Any = None) -> Result:
    argv = ["--log-format", "json", *[str(a) for a in args]]
    cli = create_cli(manager or create_plugin_manager())
    return CliRunner().invoke(cli, argv, catch_exceptions=False)


def make_config(tmp_path: Path, inputs: list[str], *extra: str) -> Path:
    out = tmp_path / f"run{len(list(tmp_path.glob('run*')))}"
    result = invoke("run", *[a for i in inputs for a in ("-i", i)], "--output-base", out, *extra)
    assert result.exit_code == 0, result.stderr
    run_dir = Path(result.stdout.strip().splitlines()[-1])
    filtered = sorted(run_dir.glob("*_filtered_instrumentation.yaml"))
    if filtered:
        return filtered[0]
    final = run_dir / "final_combined_instrumentation.yaml"
    return final if final.exists() else sorted(run_dir.glob("*_instrumentation.yaml"))[0]


def check_json(config: Path, *inputs: str | Path, expect: int | None = None, **kw: Any) -> Any:
    args: list[str | Path] = ["check", "--config", config, "--format", "json"]
    for i in inputs:
        args += ["-i", i]
    for name, value in kw.items():
        flag = f"--{name.replace('_', '-')}"
        args += [flag] if value is True else [flag, str(value)]
    result = invoke(*args)
    if expect is not None:
        assert result.exit_code == expect, (result.stdout, result.stderr)
    return result, json.loads(result.stdout) if result.stdout.strip().startswith("{") else None


def program(
    rank: int = 0,
    extra_op: bool = False,
    helper: bool = False,
    steps: int = 2,
    record_steps: bool = True,
) -> dict[str, Any]:
    """A tiny 'program' trace: main > step > Model.forward with a few ops."""
    sites: list[tuple[list[tuple[str, str]], str | None, str, int]] = [
        ([MAIN, STEP, FWD], None, "aten::addmm", 4 * steps),
        ([MAIN, STEP, FWD], None, "aten::relu", 2 * steps),
        ([MAIN, STEP], None, "aten::sum", steps),
        ([MAIN], None, "aten::empty", 3),
    ]
    if extra_op:
        sites.append(([MAIN, STEP, FWD], None, "aten::mul", steps))
    if helper:
        sites.append(([MAIN, STEP, FWD, HELPER], None, "aten::addmm", 2 * steps))
    meta = {"steps": steps} if record_steps else {}
    return trace_doc(sites, rank=rank, world_size=2, **meta)


@pytest.fixture
def app(tmp_path: Path) -> Callable[..., Path]:
    """Write a rank-0/1 pair of program traces into a fresh directory; return the glob."""

    def make(name: str, **kw: Any) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        for rank in (0, 1):
            options = dict(kw)
            if options.pop("only_rank", rank) != rank:
                options = {"steps": options.get("steps", 2)}
            write(folder / f"app_rank{rank}.json", program(rank=rank, **options))
        return folder / "app_rank*.json"

    return make


@pytest.mark.parametrize("example", ["single", "ddp", "fsdp"])
@pytest.mark.parametrize("basic", [False, True])
def test_a_config_accepts_the_traces_it_was_made_from(
    tmp_path: Path, example: str, basic: bool
) -> None:
    pattern = str(EXAMPLES / f"{example}_callsite_rank*.json")
    config = make_config(tmp_path, [pattern], *(["--basic"] if basic else []))
    _, report = check_json(config, pattern, expect=0)
    assert report["violations"] == []
    assert report["format"] == CHECK_FORMAT and report["version"] == REPORT_VERSION
    assert report["config"] == str(config)


def test_a_rank_without_a_trace_is_named_in_the_report(
    tmp_path: Path, app: Callable[..., Path]
) -> None:
    """Rank 1 of 2 died before writing its trace: the report says which rank was not
    checked (it said only "0 error(s)", the missing rank in a log line)."""
    config = make_config(tmp_path, [str(app("base"))])
    rank0 = str(app("new")).replace("*", "0")
    _, report = check_json(config, rank0, expect=0)
    assert (
        "app: no trace of rank(s) 1 of its meta.world_size (lost with its process, or not "
        "given): not checked"
    ) in report["notes"]
    result = invoke("check", "--config", config, "-i", rank0)
    assert "no trace of rank(s) 1" in result.stdout.splitlines()[0]
    _, report = check_json(config, app("both"), expect=0)
    assert not any("no trace of rank" in note for note in report.get("notes", []))


def test_work_after_the_optimizer_step_does_not_drift_with_the_step_count(
    tmp_path: Path,
) -> None:
    """A loop logs after ``optimizer.step()``: the last iteration's logging runs after
    the last step ends, so the loop's file holds it once per step plus once (3 in a
    2-step loop, 10 in a 9-step one). Checked per step alone that drifted -26 % on
    every run of another length; a real change in it still drifts."""
    log = ("app", "log_loss")

    def job(name: str, steps: int, logs: int) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        sites = [
            ([MAIN, STEP, FWD], None, "aten::addmm", 4 * steps),  # before the step
            ([MAIN, log], None, "aten::mul", logs),  # after it
        ]
        write(folder / "app_rank0.json", trace_doc(sites, rank=0, world_size=1, steps=steps))
        return folder / "app_rank0.json"

    config = make_config(tmp_path, [str(job("base", 2, 3))])
    for name, steps, logs in (("longer", 9, 10), ("shorter", 1, 2), ("same", 2, 3)):
        _, report = check_json(config, job(name, steps, logs), expect=0)
        assert [v for v in report["violations"] if v["kind"] == "count_drift"] == [], name
    for name, logs in (("twice", 20), ("none_half", 5)):  # twice, half as often a step
        _, report = check_json(config, job(name, 9, logs), expect=0)
        drifted = {v["target"] for v in report["violations"] if v["kind"] == "count_drift"}
        assert "app:log_loss" in drifted and "app:Model.forward" not in drifted, name


def test_drift_per_step_allows_only_the_share_after_the_last_step() -> None:
    """The rule's algebra: equal steps compare plainly; other step counts accept any
    mix of work before and after the step, and nothing beyond it."""
    from opguard_plugins.enforce.rules import drifts, drifts_per_step

    for before, after in ((4, 0), (0, 1), (4, 1), (1, 1)):  # ops a step, each side
        for want_steps, got_steps in ((2, 9), (9, 2), (3, 30)):
            want = before * want_steps + after * (want_steps + 1)
            got = before * got_steps + after * (got_steps + 1)
            assert not drifts_per_step(got, got_steps, want, want_steps, 0.1)
            assert drifts_per_step(2 * got, got_steps, want, want_steps, 0.1)
            assert drifts_per_step(got / 2, got_steps, want, want_steps, 0.1)
    assert drifts_per_step(11, 2, 10, 2, 0.05) == drifts(5.5, 5, 0.05)
    # a config of one loop step cannot tell half the work from all of it after the step
    assert not drifts_per_step(60, 30, 4, 1, 0.1)  # 2 a step of 4 a step
    assert drifts_per_step(3, None, 0, None, 0.1) and not drifts_per_step(0, 3, 0, 2, 0.1)
    # a side with no loop step: whole runs (no ZeroDivisionError)
    assert not drifts_per_step(5, 0, 5, 3, 0.1) and drifts_per_step(9, 3, 5, 0, 0.1)


def test_a_merged_config_allows_each_sources_work_after_its_last_step() -> None:
    """A config merged from three 1-step runs holds their work after the step three
    times (2 each: 6 in 3 steps); an unchanged 10-step run (11) is no count_drift (it
    drifted -45 %: one loop's share was allowed); three times as much still drifts."""
    from opguard_core.formats.check import CheckInput
    from opguard_plugins.enforce.rules import count_drift

    key = ("app:log_loss", ())
    expected = {"target": key[0], "context": [], "ops": {"aten::mul": 6}, "count": 6}
    config = {"meta": {"ranks": [0], "steps": {"a": 1, "b": 1, "c": 1}}, "entries": [expected]}

    def drift(count: int) -> list[Any]:
        observed = {"target": key[0], "context": [], "count": count}
        check = CheckInput(rank=0, key=key, config=config, expected={key: expected},
                           observed={0: {key: observed}}, ranks=[0], tolerance=0.1,
                           expected_steps=3, observed_steps={0: 10})  # fmt: skip
        return count_drift(observed, expected, check)

    assert drift(11) == []
    assert [v.kind for v in drift(33)] == ["count_drift"]
    config["meta"]["steps"] = 3  # one loop of 3 steps: 6 is 1.5 a step, 11 in 10 drifts
    assert [v.kind for v in drift(11)] == ["count_drift"]


def test_an_extra_op_is_unexpected_op_naming_the_function_and_op(
    tmp_path: Path, app: Callable[..., Path]
) -> None:
    config = make_config(tmp_path, [str(app("base"))])
    _, report = check_json(config, app("changed", extra_op=True), expect=1)
    ops = [v for v in report["violations"] if v["kind"] == "unexpected_op"]
    assert {(v["target"], v["op"]) for v in ops} == {
        ("app:Model.forward", "aten::mul"),
        ("app:step", "aten::mul"),
        ("app:main", "aten::mul"),
    }
    assert all(v["severity"] == "error" and v["ranks"] == [0, 1] for v in ops)
    forward = next(v for v in ops if v["target"] == "app:Model.forward")
    assert forward["context"] == ["app:step"]
    assert "aten::mul" in forward["message"] and "app:Model.forward" in forward["message"]


def test_an_extra_op_on_one_rank_is_reported_on_that_rank(
    tmp_path: Path, app: Callable[..., Path]
) -> None:
    config = make_config(tmp_path, [str(app("base"))])
    _, report = check_json(config, app("changed", extra_op=True, only_rank=1), expect=1)
    ops = [v for v in report["violations"] if v["kind"] == "unexpected_op"]
    assert ops and all(v["ranks"] == [1] for v in ops)


def test_a_new_helper_is_unknown_target(tmp_path: Path, app: Callable[..., Path]) -> None:
    config = make_config(tmp_path, [str(app("base"))])
    _, report = check_json(config, app("changed", helper=True), expect=0)
    kinds = {(v["kind"], v["target"]) for v in report["violations"]}
    assert ("unknown_target", "app:helper") in kinds
    helper = next(v for v in report["violations"] if v["target"] == "app:helper")
    assert helper["severity"] == "warning" and helper["context"] == ["app:Model.forward"]


def test_a_new_helper_on_one_rank_is_reported_on_that_rank(
    tmp_path: Path, app: Callable[..., Path]
) -> None:
    config = make_config(tmp_path, [str(app("base"))])
    _, report = check_json(config, app("changed", helper=True, only_rank=1), expect=0)
    found = [v for v in report["violations"] if v["kind"] in ("unknown_target", "unknown_context")]
    assert found and all(v["ranks"] == [1] for v in found), found


def test_strict_makes_warnings_errors(tmp_path: Path, app: Callable[..., Path]) -> None:
    config = make_config(tmp_path, [str(app("base"))])
    _, report = check_json(config, app("changed", helper=True), strict=True, expect=1)
    assert report["violations"] and {v["severity"] for v in report["violations"]} == {"error"}


def test_unknown_context_missing_and_rank_mismatch(tmp_path: Path) -> None:
    folder = tmp_path / "base"
    folder.mkdir()
    write(folder / "a_rank0.json", program(rank=0))
    write(
        folder / "a_rank1.json",
        trace_doc([([MAIN, STEP], None, "aten::sum", 2), ([MAIN], None, "aten::empty", 3)], 1, 2),
    )
    config = make_config(tmp_path, [str(folder / "a_rank*.json")])
    new = tmp_path / "new"
    new.mkdir()
    # rank 0: forward called from main directly (new context); step never runs
    write(
        new / "a_rank0.json",
        trace_doc([([MAIN, FWD], None, "aten::addmm", 8), ([MAIN], None, "aten::empty", 3)], 0, 2),
    )
    # rank 1: forward runs on rank 1, where the config does not have it
    write(new / "a_rank1.json", program(rank=1))
    _, report = check_json(config, new / "a_rank*.json", expect=0)
    found = {
        (v["kind"], v["target"], tuple(v["context"]), tuple(v["ranks"]))
        for v in report["violations"]
    }
    assert ("unknown_context", "app:Model.forward", ("app:main",), (0,)) in found
    # ran on rank 1 (not in the config there), did not on rank 0 (where the config has it)
    assert ("rank_mismatch", "app:Model.forward", ("app:step",), (0, 1)) in found
    assert ("rank_mismatch", "app:step", ("app:main",), (0,)) in found
    assert not any(kind == "missing" for kind, *_ in found)
    # a run of rank 0 alone that never reaches step: missing
    only = tmp_path / "only"
    only.mkdir()
    write(only / "a_rank0.json", trace_doc([([MAIN], None, "aten::empty", 3)], 0, 2))
    _, report = check_json(config, only / "a_rank0.json", expect=0)
    missing = {v["target"] for v in report["violations"] if v["kind"] == "missing"}
    assert missing == {"app:step", "app:Model.forward"}


@pytest.mark.parametrize("record_steps", [True, False])
def test_counts_are_compared_per_step(
    tmp_path: Path, app: Callable[..., Path], record_steps: bool
) -> None:
    config = make_config(tmp_path, [str(app("base", steps=2))])
    assert load_config(config)["meta"]["steps"] == {"app": 2}  # source -> steps
    _, report = check_json(config, app("longer", steps=4, record_steps=record_steps), expect=0)
    drifted = {v["target"] for v in report["violations"] if v["kind"] == "count_drift"}
    # twice the steps: the same per step, twice the count per rank
    assert ("app:Model.forward" in drifted) is not record_steps
    assert ("app:step" in drifted) is not record_steps


def test_count_drift_beyond_tolerance(tmp_path: Path) -> None:
    base = write(tmp_path / "base.json", trace_doc([([MAIN, STEP], None, "aten::add", 10)]))
    config = make_config(tmp_path, [str(base)])
    more = write(tmp_path / "more.json", trace_doc([([MAIN, STEP], None, "aten::add", 12)]))
    _, report = check_json(config, more, expect=0)
    # 12 vs 10 is +20%; (the chain main > step is folded into step)
    assert [(v["kind"], v["target"]) for v in report["violations"]] == [("count_drift", "app:step")]
    assert "+20%" in report["violations"][0]["message"]
    _, report = check_json(config, more, tolerance=0.25, expect=0)
    assert report["violations"] == []


def test_text_report_and_output_file(tmp_path: Path, app: Callable[..., Path]) -> None:
    config = make_config(tmp_path, [str(app("base"))])
    changed = app("changed", extra_op=True)
    result = invoke("check", "--config", config, "-i", changed)
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    assert lines[0].endswith("3 error(s), 3 warning(s)")  # the mul also drifts counts
    assert any("unexpected_op" in line and "app:Model.forward" in line for line in lines[1:])
    out = tmp_path / "report.json"
    result = invoke("check", "--config", config, "-i", changed, "--format", "json", "-o", out)
    assert result.exit_code == 1 and result.stdout == ""
    report = load_report(out)
    assert len(report["violations"]) == 6 and report["errors"] == 3


def test_unreadable_inputs_have_their_own_exit_code(
    tmp_path: Path, app: Callable[..., Path]
) -> None:
    config = make_config(tmp_path, [str(app("base"))])
    bad = tmp_path / "bad_rank0.json"
    bad.write_text("{not json")
    result = invoke("check", "--config", config, "-i", bad)
    assert result.exit_code == ExitCode.INPUT_UNREADABLE == 5
    assert "bad_rank0.json" in result.stderr and "Traceback" not in result.stderr
    # one line, said once: no stage log of check's own pipeline, no second report of
    # the same file for the whole entry it is part of
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    result = invoke("check", "--config", config, "-i", tmp_path / "nothing*.json")
    assert result.exit_code == 5 and "nothing" in result.stderr
    broken = tmp_path / "broken.yaml"
    broken.write_text("version: 2\nentries: 7\n")
    result = invoke("check", "--config", broken, "-i", app("other"))
    assert result.exit_code == 5 and "broken.yaml" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_usage_errors_exit_2(tmp_path: Path, app: Callable[..., Path]) -> None:
    config = make_config(tmp_path, [str(app("base"))])
    assert invoke("check", "--config", config).exit_code == 2
    assert invoke("check", "--config", config, "-i", "x", "--tolerance", "-1").exit_code == 2


def test_a_missing_config_is_an_unreadable_input(tmp_path: Path) -> None:
    """Like any input that cannot be read: one line naming it, exit 5 (not click's 2)."""
    result = invoke("check", "--config", tmp_path / "none.yaml", "-i", "x")
    assert result.exit_code == 5
    assert "none.yaml" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_settings_are_read_tolerantly(tmp_path: Path) -> None:
    config: dict[str, Any] = {
        "meta": {
            "settings": {
                "min_count": 3,
                "chains": False,
                "hide": ["a:b"],
                "context_depth": 2,
                "filters": ["basic_filter"],
                "focus": ["x"],
                "someday": 1,
            }
        }
    }
    options = options_from_settings(config)
    assert (options.min_count, options.chains, options.context_depth) == (3, False, 2)
    assert options.hide == ("a:b",) and options.default_hide is False and options.basic
    defaults = options_from_settings({"meta": {}})
    assert defaults.default_hide and not defaults.basic and defaults.min_count == 1


def test_a_config_never_says_how_check_runs() -> None:
    """A config naming ``executor: dask`` and a scheduler address had check start a
    Dask cluster, or connect to the address (Dask speaks pickle): how a run ran is
    not how its entries were made."""
    how_it_ran = {"executor": "dask", "extra": {"dask_scheduler": "tcp://10.0.0.1:8786"},
                  "jobs": 64, "verbose": True, "fail_on_divergence": True,
                  "base_dir": "/etc"}  # fmt: skip
    options = options_from_settings({"meta": {"settings": {**how_it_ran, "min_count": 3}}})
    assert options.min_count == 3
    defaults = RunOptions()
    assert (options.executor, options.extra, options.jobs, options.verbose) == (
        defaults.executor,
        defaults.extra,
        defaults.jobs,
        defaults.verbose,
    )
    assert not options.fail_on_divergence and options.base_dir == Path(".")


def test_hook_check_entry(tmp_path: Path, app: Callable[..., Path]) -> None:
    """A third-party rule adds its own violations; --disable-plugin check_rules turns
    the built-in rules off."""

    class NoRelu:
        @hookimpl
        def opguard_check_entry(
            self, observed: dict[str, Any] | None, expected: dict[str, Any] | None, check: Any
        ) -> list[Violation]:
            if observed is None or "aten::relu" not in (observed.get("ops") or {}):
                return []
            target, context = check.key
            return [Violation("no_relu", "error", target, list(context), [check.rank], "relu!")]

    config = make_config(tmp_path, [str(app("base"))])
    manager = create_plugin_manager()
    manager.register(NoRelu(), name="no_relu")
    result = invoke(
        "check", "--config", config, "-i", app("same"), "--format", "json", manager=manager
    )
    assert result.exit_code == 1
    found = json.loads(result.stdout)["violations"]
    assert {(v["kind"], v["target"], tuple(v["ranks"])) for v in found} == {
        ("no_relu", t, (0, 1)) for t in ("app:main", "app:step", "app:Model.forward")
    }
    manager = create_plugin_manager(disabled=["check_rules"])
    result = invoke(
        "check", "--config", config, "-i", app("changed", extra_op=True), manager=manager
    )
    assert result.exit_code == 0, result.stdout


def test_every_kind_has_a_default_severity() -> None:
    assert set(KINDS) == {
        "unexpected_op", "unexpected_stream", "unexpected_dtype", "unknown_context",
        "unknown_target", "missing", "missing_op", "count_drift", "rank_mismatch",
    }  # fmt: skip


def test_unexpected_stream(tmp_path: Path) -> None:
    """Streams are checked by role: a version-1 trace's stream 7 is side1 (formats.md)."""
    base = write(tmp_path / "s.json", trace_doc([([MAIN], None, "aten::add", 4)], stream=0))
    config = make_config(tmp_path, [str(base)])
    other = write(tmp_path / "o.json", trace_doc([([MAIN], None, "aten::add", 4)], stream=7))
    _, report = check_json(config, other, expect=1)
    assert [(v["kind"], v["stream"]) for v in report["violations"]] == [
        ("unexpected_stream", "side1")
    ]
    assert "ran on stream side1" in report["violations"][0]["message"]


ops = st.sampled_from(["aten::add", "aten::mm", "aten::relu", "c10d::allreduce_"])
frames = st.sampled_from([MAIN, STEP, FWD, HELPER, ("lib", "util")])
sites = st.lists(
    st.tuples(st.lists(frames, min_size=1, max_size=4), ops, st.integers(1, 30)),
    min_size=1,
    max_size=8,
)


@pytest.mark.slow  # ~6 s: 25 examples, each a run and a check
@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(per_rank=st.lists(sites, min_size=1, max_size=3))
def test_property_a_config_never_errors_on_its_own_traces(
    tmp_path_factory: pytest.TempPathFactory, per_rank: list[Any]
) -> None:
    """For arbitrary 1-3 rank traces, the config made from them checks them clean of
    errors (per-rank trees can fold chains differently from the combined tree: the
    structural kinds are confirmed on the combined observed config)."""
    folder = tmp_path_factory.mktemp("prop")
    for rank, rank_sites in enumerate(per_rank):
        doc = trace_doc([(stack, None, op, n) for stack, op, n in rank_sites], rank, len(per_rank))
        write(folder / f"p_rank{rank}.json", doc)
    config = make_config(folder, [str(folder / "p_rank*.json")])
    _, report = check_json(config, folder / "p_rank*.json", expect=0)
    assert not [v for v in report["violations"] if v["severity"] == "error"]
    shutil.rmtree(folder)


def test_a_violation_only_the_whole_view_has_names_the_ranks_that_ran_it() -> None:
    """A new function only the all-ranks config keeps (each rank's own config pruned
    it): reported on the ranks its combined entry lists, not on every rank."""
    from opguard_plugins.enforce.check import check_configs

    def entry(target: str, context: list[str], count: int, **more: Any) -> dict[str, Any]:
        return {"target": target, "kind": "function", "context": context,
                "ops": {"aten::add": count}, "count": count, **more}  # fmt: skip

    base = entry("app:main", [], 10)
    config = {"version": 5, "meta": {"ranks": [0, 1], "total": 10}, "entries": [base]}
    per_rank = {r: {"meta": {"ranks": [r], "total": 5}, "entries": [entry("app:main", [], 5)]}
                for r in (0, 1)}  # fmt: skip
    combined = {"meta": {"ranks": [0, 1], "total": 12},
                "entries": [base, entry("app:new", ["app:main"], 2, ranks=[1])]}  # fmt: skip
    found = check_configs(create_plugin_manager(), config, per_rank, combined=combined)
    (new,) = [v for v in found if v.target == "app:new"]
    assert new.kind == "unknown_target" and new.ranks == [1]


@pytest.mark.parametrize(
    ("stacks", "options", "why"),
    [
        (True, ["--min-count", "100000"], "every function fell below --min-count/--min-fraction"),
        (False, ["--min-count", "1", "--min-fraction", "0"],
         "no op has a stack: the trace records none; a torch.profiler trace needs "
         "with_stack=True or record_function labels"),
        (True, ["--hide", "app:.*"],
         "no op has a visible frame: the --hide patterns hid every frame"),
    ],
    ids=["thresholds", "no_stacks", "all_hidden"],
)  # fmt: skip
def test_a_config_of_no_entry_says_why(
    tmp_path: Path, stacks: bool, options: list[str], why: str
) -> None:
    """The warning named the thresholds whatever emptied the config: a Kineto trace
    recorded without stacks (every op at the root) said `every function fell below
    --min-count/--min-fraction` at --min-count 1 --min-fraction 0."""
    frames = [("app", "main"), ("app", "step")] if stacks else []
    doc = trace_doc([(frames, None, "aten::mm", 5), (frames[:1], None, "aten::add", 3)])
    write(tmp_path / "t_rank0.json", doc)
    result = invoke("run", "-i", tmp_path / "t_rank0.json", "--output-base", tmp_path, *options)
    assert result.exit_code == 0, result.stderr
    run_dir = Path(result.stdout.strip().splitlines()[-1])
    summary = json.loads((run_dir / "pipeline_summary.json").read_text())
    said = [w["message"] for w in summary["warnings"] if "has no entries" in w["message"]]
    assert said == [f"t_instrumentation.yaml has no entries ({why}): opguard check and guard "
                    "refuse it"]  # fmt: skip


def test_a_config_of_no_entry_is_said_so_when_made_and_refused_by_check(tmp_path: Path) -> None:
    """A --min-count above every function's count makes ``entries: []``: the run warns
    that the config checks nothing, and ``check`` refuses it in one line, exit 5, as
    ``guard`` does (it passed FSDP traces against a DDP config with 0 errors, even
    under --strict)."""
    ddp = str(EXAMPLES / "ddp_callsite_rank*.json")
    fsdp = str(EXAMPLES / "fsdp_callsite_rank*.json")
    result = invoke("run", "-i", ddp, "--min-count", "100000000", "--output-base", tmp_path)
    assert result.exit_code == 0, result.stderr
    run_dir = Path(result.stdout.strip().splitlines()[-1])
    config = run_dir / "ddp_callsite_instrumentation.yaml"
    assert load_config(config)["entries"] == []
    summary = json.loads((run_dir / "pipeline_summary.json").read_text())
    said = [w["message"] for w in summary["warnings"]]
    assert any("ddp_callsite_instrumentation.yaml has no entries" in m for m in said), said
    checked = invoke("check", "--strict", "--config", config, "-i", fsdp)
    assert checked.exit_code == 5, checked.output
    assert "the config has no entries: check would check nothing" in checked.stderr
    assert "Traceback" not in checked.stderr


@pytest.mark.parametrize("how", ["run", "filter"])
def test_a_config_filtered_with_a_basic_list_checks_its_own_traces_clean(
    tmp_path: Path, how: str
) -> None:
    """``--basic --basic-list`` is recorded in ``meta.settings.basic_list`` (an absolute
    path), so ``check`` rebuilds the run with the same list: its own traces give no
    violation. It gave 14 ``unknown_target`` warnings, as check filtered with the
    bundled list."""
    rules = tmp_path / "lists" / "mine.yaml"
    rules.parent.mkdir()
    rules.write_text("utilities: []\nkeep_kinds: [method]\n")
    ddp = str(EXAMPLES / "ddp_callsite_rank*.json")
    if how == "run":
        config = make_config(tmp_path, [ddp], "--basic", "--basic-list", str(rules))
    else:
        made = make_config(tmp_path, [ddp])
        config = tmp_path / "filtered.yaml"
        argv = ["filter", made, "--basic", "--basic-list", rules, "-o", config]
        assert invoke(*argv).exit_code == 0
    settings = load_config(config)["meta"]["settings"]
    assert settings["basic_list"] == str(rules.resolve())
    result = invoke("check", "--format", "json", "--config", config, "-i", ddp)
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["violations"] == [], report["violations"][:3]
