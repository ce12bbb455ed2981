"""``opguard check``'s rough edges (issue 29, point 4), through the CLI.

* the default hide patterns are never reported as "pattern matched nothing"; a
  pattern a person gave still is;
* ``--config RUN_DIR`` checks against the run's final config, as show, compare,
  merge and filter read it;
* a merged config checks any one of its sources (and all of them together) without
  an error, a ``count_drift`` or a ``missing``, also under ``--strict``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from click.testing import CliRunner, Result

from opguard_core.cli.app import create_cli
from opguard_core.plugin.manager import create_plugin_manager
from opguard_plugins.stages.compress import DEFAULT_HIDE

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "traces"
SOURCES = {
    "ddp_callsite": str(EXAMPLES / "ddp_callsite_rank*.json"),
    "fsdp_callsite": str(EXAMPLES / "fsdp_callsite_rank*.json"),
    "single_callsite": str(EXAMPLES / "single_callsite_rank*.json"),
}


def invoke(*args: str | Path) -> Result:
    argv = ["--log-format", "json", *[str(a) for a in args]]
    return CliRunner().invoke(create_cli(create_plugin_manager()), argv, catch_exceptions=False)


def make_run(tmp_path: Path, *inputs: str, extra: tuple[str, ...] = ()) -> Path:
    """An ``opguard run`` of ``inputs``; its run directory."""
    out = tmp_path / f"out{len(list(tmp_path.glob('out*')))}"
    args = [a for i in inputs for a in ("-i", i)]
    result = invoke("run", *args, "--output-base", out, *extra)
    assert result.exit_code == 0, result.stderr
    return Path(result.stdout.strip().splitlines()[-1])


def check(config: Path, *inputs: str, expect: int = 0, strict: bool = False) -> dict[str, Any]:
    args: list[str | Path] = ["check", "--config", config, "--format", "json"]
    args += [a for i in inputs for a in ("-i", i)]
    result = invoke(*args, *(["--strict"] if strict else []))
    assert result.exit_code == expect, (result.stdout[-3000:], result.stderr[-3000:])
    report: dict[str, Any] = json.loads(result.stdout)
    report["stderr"] = result.stderr
    return report


def unmatched(stderr: str) -> list[str]:
    """The patterns of the "pattern matched nothing" records in JSON log lines."""
    found = []
    for line in stderr.splitlines():
        if line.startswith("{") and "pattern matched nothing" in line:
            found.append(json.loads(line)["pattern"])
    return found


def kinds(report: dict[str, Any]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for item in report["violations"]:
        counts[item["kind"]] = counts.get(item["kind"], 0) + 1
    return counts


# ----------------------------------------------------------- default hide patterns


def test_check_reports_no_default_hide_pattern(tmp_path: Path) -> None:
    """The example DDP trace has no frame for most default patterns (the run does not
    warn about them); check, which re-runs the pipeline with the config's recorded
    settings, used to warn about each of them on every run."""
    run = make_run(tmp_path, SOURCES["ddp_callsite"])
    report = check(run, SOURCES["ddp_callsite"])
    assert report["violations"] == []
    assert unmatched(report["stderr"]) == []


def test_check_still_reports_a_users_pattern_that_matched_nothing(tmp_path: Path) -> None:
    run = make_run(tmp_path, SOURCES["ddp_callsite"], extra=("--hide", r"nosuch\.module:.*"))
    report = check(run, SOURCES["ddp_callsite"])
    assert report["violations"] == []
    found = unmatched(report["stderr"])
    assert found and set(found) == {r"nosuch\.module:.*"}  # once per rank file and entry
    assert not set(found) & set(DEFAULT_HIDE)


def test_without_default_hide_every_recorded_pattern_is_the_users(tmp_path: Path) -> None:
    """A run made with --no-default-hide and one of the defaults given by hand: that
    pattern is the person's, and warned about when it matches nothing."""
    pattern = "contextlib:.*"  # a default pattern no DDP example frame matches
    assert pattern in DEFAULT_HIDE
    run = make_run(
        tmp_path, SOURCES["ddp_callsite"], extra=("--no-default-hide", "--hide", pattern)
    )
    report = check(run, SOURCES["ddp_callsite"])
    assert report["violations"] == []
    assert set(unmatched(report["stderr"])) == {pattern}


# ------------------------------------------------------------ a run directory


def test_a_run_directory_is_checked_against_its_final_config(tmp_path: Path) -> None:
    run = make_run(tmp_path, SOURCES["ddp_callsite"], SOURCES["fsdp_callsite"])
    final = run / "final_combined_instrumentation.yaml"
    by_dir = check(run, SOURCES["ddp_callsite"], SOURCES["fsdp_callsite"])
    by_file = check(final, SOURCES["ddp_callsite"], SOURCES["fsdp_callsite"])
    assert by_dir["config"] == str(final)
    assert by_dir["violations"] == by_file["violations"] == []


def test_a_filtered_run_directory_is_checked_against_its_filtered_config(
    tmp_path: Path,
) -> None:
    """The same config ``opguard show RUN`` shows: the filtered one when the run
    filtered; a trace that only the filter's dropped entries would flag passes."""
    run = make_run(tmp_path, SOURCES["single_callsite"], extra=("--basic",))
    report = check(run, SOURCES["single_callsite"])
    filtered = sorted(run.glob("*_filtered_instrumentation.yaml"))
    assert [Path(report["config"])] == filtered
    assert report["violations"] == []


def test_a_run_directory_without_a_summary_is_refused_in_one_line(tmp_path: Path) -> None:
    run = make_run(tmp_path, SOURCES["single_callsite"])
    (run / "pipeline_summary.json").unlink()
    result = invoke("check", "--config", run, "-i", SOURCES["single_callsite"])
    assert result.exit_code == 5
    assert len(result.stderr.strip().splitlines()) == 1 and str(run) in result.stderr
