"""Configs record what recorded their traces (``meta.recorded_by``), and ``opguard check``
says in one line when a config and the traces come from different tracers, then
compares what both record: which functions ran, where (issue 29, point 3;
docs/guard.md, docs/formats.md §3).

Hand-made traces; configs are made by ``opguard run`` and checked through the CLI.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from click.testing import CliRunner, Result

from opguard_core.cli.app import create_cli
from opguard_core.formats.config import load_config
from opguard_core.plugin.manager import create_plugin_manager
from tests.builders import trace_doc, write

MAIN = ("app", "main")
STEP = ("app", "step")
FWD = ("app", "Model.forward")
HELPER = ("app", "helper")


def invoke(*args: str | Path) -> Result:
    cli = create_cli(create_plugin_manager())
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def program(
    extra_op: bool = False, helper: bool = False, api: bool = False, **meta: Any
) -> dict[str, Any]:
    """main > step > Model.forward, two steps; ``meta`` says what recorded it; with
    ``api`` the relu carries its torch api (only the modes backend records one)."""
    sites: list[tuple[list[tuple[str, str]], str | None, str, int]] = [
        ([MAIN, STEP, FWD], None, "aten::addmm", 8),
        ([MAIN, STEP, FWD], "torch.relu" if api else None, "aten::relu", 4),
        ([MAIN, STEP], None, "aten::sum", 2),
        ([MAIN], None, "aten::empty", 3),
    ]
    if extra_op:
        sites.append(([MAIN, STEP, FWD], None, "aten::mul", 2))
    if helper:
        sites.append(([MAIN, STEP, FWD, HELPER], None, "aten::addmm", 4))
    return trace_doc(sites, steps=2, **meta)


MODES = {"tracer": "opguard/2", "tracer_backend": "modes"}
PROFILER = {"tracer": "opguard/2", "tracer_backend": "profiler"}


def make_config(tmp_path: Path, name: str, doc: dict[str, Any]) -> Path:
    trace = write(tmp_path / f"{name}_rank0.json", doc)
    result = invoke("run", "-i", trace, "--output-base", tmp_path / f"run_{name}")
    assert result.exit_code == 0, result.stderr
    run_dir = Path(result.stdout.strip().splitlines()[-1])
    return sorted(run_dir.glob("*_instrumentation.yaml"))[0]


def check(config: Path, trace: Path) -> tuple[Result, dict[str, Any]]:
    result = invoke("check", "--config", config, "-i", trace, "--format", "json")
    return result, json.loads(result.stdout)


def warnings_of(result: Result) -> list[str]:
    """check's own warning lines (not the stages' log records)."""
    return [
        line for line in result.stderr.splitlines() if line.startswith("opguard check: warning")
    ]


def test_configs_record_what_recorded_their_traces(tmp_path: Path) -> None:
    cases = {
        "modes": MODES,
        "profiler": PROFILER,
        "old_modes": {"tracer": "opguard/1"},  # version 1: modes wrote no backend
        "old_profiler": {"tracer": "opguard/1", "tracer_backend": "profiler"},
        "kineto": {"source_format": "kineto", "importer": "opguard-kineto/1"},
    }
    expected = {
        "modes": ["modes"],
        "profiler": ["profiler"],
        "old_modes": ["modes"],
        "old_profiler": ["profiler"],
        "kineto": ["kineto"],
    }
    for name, meta in cases.items():
        config = load_config(make_config(tmp_path, name, program(**meta)))
        assert list(config["meta"]["recorded_by"]) == expected[name], name
    unknown = load_config(make_config(tmp_path, "unknown", program(tracer="someone/9")))
    assert "recorded_by" not in unknown["meta"]


def test_merge_takes_the_union_and_unknown_stays_unknown(tmp_path: Path) -> None:
    modes = make_config(tmp_path, "m", program(**MODES))
    profiler = make_config(tmp_path, "p", program(**PROFILER))
    unknown = make_config(tmp_path, "u", program())
    both = tmp_path / "both.yaml"
    assert invoke("merge", modes, profiler, "-o", both).exit_code == 0
    assert list(load_config(both)["meta"]["recorded_by"]) == ["modes", "profiler"]
    some = tmp_path / "some.yaml"
    assert invoke("merge", modes, unknown, "-o", some).exit_code == 0
    assert "recorded_by" not in load_config(some)["meta"]


def test_same_tracer_no_warning_every_kind_compared(tmp_path: Path) -> None:
    config = make_config(tmp_path, "base", program(**MODES))
    changed = write(tmp_path / "new_rank0.json", program(extra_op=True, **MODES))
    result, report = check(config, changed)
    assert result.exit_code == 1
    assert warnings_of(result) == []
    assert {"unexpected_op", "count_drift"} <= {v["kind"] for v in report["violations"]}


def test_different_backends_one_warning_targets_still_compared(tmp_path: Path) -> None:
    config = make_config(tmp_path, "base", program(api=True, **MODES))
    assert "torch:relu" in {e["target"] for e in load_config(config)["entries"]}
    # the profiler's trace: an op the modes trace lacks (as where the backends' op
    # views differ), and a function the config does not know
    other = write(tmp_path / "new_rank0.json", program(extra_op=True, helper=True, **PROFILER))
    result, report = check(config, other)
    lines = warnings_of(result)
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("opguard check: warning: the config was recorded by modes, ")
    assert "the traces by profiler" in lines[0]
    kinds = {v["kind"] for v in report["violations"]}
    assert "unknown_target" in kinds  # which functions ran is still compared
    assert not kinds & {"unexpected_op", "count_drift"}  # op views differ between backends
    # the api entry the profiler's trace cannot have is not reported missing
    assert all(not v["target"].startswith("torch:") for v in report["violations"])
    assert result.exit_code == 0
    # the same traces checked against a config recorded alike: the op is an error
    same = make_config(tmp_path, "prof", program(**PROFILER))
    result, report = check(same, other)
    assert warnings_of(result) == [] and result.exit_code == 1
    assert {"unexpected_op", "count_drift"} <= {v["kind"] for v in report["violations"]}


def test_across_tracers_what_ran_every_step_missing_is_a_warning(tmp_path: Path) -> None:
    """The loop rule (an entry run in every step must run: an error) compares one view
    with itself; across tracers one tree can keep a link the other folds, so there a
    function gone is a ``missing`` warning. In one view it stays an error."""
    loop = {"phase": "loop"}  # two steps, as every program here
    config = make_config(tmp_path, "base", program(helper=True, **{**loop, **MODES}))
    run = write(tmp_path / "new_rank0.json", program(**{**loop, **PROFILER}))
    result, report = check(config, run)
    gone = [v for v in report["violations"] if v["target"] == "app:helper"]
    assert [(v["kind"], v["severity"]) for v in gone] == [("missing", "warning")]
    assert result.exit_code == 0
    same = write(tmp_path / "same_rank0.json", program(**{**loop, **MODES}))
    result, report = check(config, same)
    gone = [v for v in report["violations"] if v["target"] == "app:helper"]
    assert [(v["kind"], v["severity"]) for v in gone] == [("missing", "error")]


def test_a_config_that_does_not_say_is_compared_in_full(tmp_path: Path) -> None:
    config = make_config(tmp_path, "base", program(**MODES))
    text = config.read_text()
    assert "recorded_by: [modes]" in text
    config.write_text(text.replace("  recorded_by: [modes]\n", ""))  # made before issue 29
    other = write(tmp_path / "new_rank0.json", program(extra_op=True, **PROFILER))
    result, report = check(config, other)
    assert warnings_of(result) == [] and result.exit_code == 1
    assert {"unexpected_op", "count_drift"} <= {v["kind"] for v in report["violations"]}


def test_recorded_by_must_be_a_list_of_names(tmp_path: Path) -> None:
    config = make_config(tmp_path, "base", program(**MODES))
    config.write_text(config.read_text().replace("recorded_by: [modes]", "recorded_by: modes"))
    trace = write(tmp_path / "new_rank0.json", program(**MODES))
    result = invoke("check", "--config", config, "-i", trace)
    assert result.exit_code == 5
    assert "meta.recorded_by must be a list of names" in result.stderr
    assert "Traceback" not in result.stderr
