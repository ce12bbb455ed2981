"""End-to-end runs of ``opguard run`` on the real sample traces."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from ruamel.yaml import YAML

from opguard_core.cli.app import cli_for, disabled_from_args
from opguard_core.formats.tree import load_tree
from opguard_core.run.summary import summary_fields


def test_two_entries_write_every_artifact(opguard, samples: Path) -> None:
    run = opguard(
        "run",
        "--input",
        samples / "fsdp_callsite_rank0.json",
        samples / "fsdp_callsite_rank1.json",
        "--input",
        str(samples / "gpt_callsite_rank*.json"),
        "--basic",
        expect=0,
    )
    names = sorted(p.name for p in run.run_dir.iterdir())
    assert names == [
        "comparison_1_vs_2.log",
        "final_combined_filtered_instrumentation.yaml",
        "final_combined_instrumentation.yaml",
        "fsdp_callsite_combined.json",
        "fsdp_callsite_compressed.json",
        "fsdp_callsite_divergence.json",
        "fsdp_callsite_divergence.log",
        "fsdp_callsite_instrumentation.yaml",
        "gpt_callsite_combined.json",
        "gpt_callsite_compressed.json",
        "gpt_callsite_divergence.json",
        "gpt_callsite_divergence.log",
        "gpt_callsite_instrumentation.yaml",
        "pipeline_summary.json",
        "report.html",
        "temp_combined_1.yaml",
    ]
    summary = json.loads(run.read("pipeline_summary.json"))
    assert summary["exit_code"] == 0
    assert [e["name"] for e in summary["entries"]] == ["fsdp_callsite", "gpt_callsite"]
    assert {s["status"] for s in summary["stages"]} == {"ok"}
    tree = load_tree(run.run_dir / "gpt_callsite_compressed.json")
    assert tree["root"]["count"] == 2826 + 2722
    config = YAML(typ="safe").load(run.read("final_combined_instrumentation.yaml"))
    meta = config["meta"]
    assert (meta["ranks"], meta["total"]) == ([0, 1], 6241 + 5548)
    assert meta["sources"] == ["fsdp_callsite", "gpt_callsite"]


def test_rank_files_of_one_directory_however_spelt_are_one_entry(
    opguard, samples: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``sub/x_rank0.json``, ``/abs/sub/x_rank1.json``, ``sub/../sub/...`` and a link to
    the directory all name one directory: one entry of their ranks (once, two entries
    of one rank each, compared and merged with each other)."""
    folder = tmp_path / "sub"
    folder.mkdir()
    for rank in range(2):
        name = f"gpt_callsite_rank{rank}.json"
        (folder / f"x_rank{rank}.json").write_bytes((samples / name).read_bytes())
    (tmp_path / "link").symlink_to(folder)
    monkeypatch.chdir(tmp_path)
    for spelt in (["sub/x_rank0.json", folder / "x_rank1.json"],
                  ["sub/../sub/x_rank0.json", "link/x_rank1.json"]):  # fmt: skip
        run = opguard("run", "-i", *spelt, expect=0)
        summary = json.loads(run.read("pipeline_summary.json"))
        assert [(e["name"], len(e["files"])) for e in summary["entries"]] == [("x", 2)]


def test_single_pattern_entry_has_no_merge_and_filters_under_its_name(opguard, samples) -> None:
    run = opguard("run", "--input", "gpt_callsite_rank*.json", "--base-dir", samples, "--basic",
                  expect=0)  # fmt: skip
    names = {p.name for p in run.run_dir.iterdir()}
    assert "gpt_callsite_filtered_instrumentation.yaml" in names
    assert not any(n.startswith(("temp_combined", "final_combined", "comparison")) for n in names)
    summary = json.loads(run.read("pipeline_summary.json"))
    merge = [s for s in summary["stages"] if s["stage"] == "merge"]
    assert merge[0]["status"] == "skipped"


def test_three_entries_fold_left_and_compare_first_against_each(opguard, samples, tmp_path) -> None:
    single = tmp_path / "single.json"
    single.write_bytes((samples / "gpt_callsite_rank1.json").read_bytes())
    run = opguard(
        "run", "--base-dir", samples,
        "--input", "fsdp_callsite_rank*.json",
        "--input", "gpt_callsite_rank0.json", "gpt_callsite_rank1.json",
        "--input", single,
        expect=0,
    )  # fmt: skip
    names = {p.name for p in run.run_dir.iterdir()}
    assert {"comparison_1_vs_2.log", "comparison_1_vs_3.log", "temp_combined_1.yaml",
            "temp_combined_2.yaml", "final_combined_instrumentation.yaml",
            "single_instrumentation.yaml"} <= names  # fmt: skip
    assert run.read("temp_combined_2.yaml") == run.read("final_combined_instrumentation.yaml")
    final = YAML(typ="safe").load(run.read("final_combined_instrumentation.yaml"))
    assert final["meta"]["total"] == 6241 + 5548 + 2722
    assert final["source"] == "fsdp_callsite+gpt_callsite+single"
    log = run.read("comparison_1_vs_3.log")
    assert log.startswith("comparison: 1 (fsdp_callsite) vs 3 (single)")


def test_a_failing_entry_is_recorded_and_the_others_go_on(opguard, samples) -> None:
    (samples / "broken.json").write_text('{"format": "opguard-callsites", "version": 1')
    run = opguard("run", "--base-dir", samples, "--input", "broken.json",
                  "--input", "gpt_callsite_rank*.json", "--basic")  # fmt: skip
    assert run.exit_code == 1
    assert "broken.json: not valid JSON" in run.stderr
    assert "Traceback" not in run.stderr
    assert (run.run_dir / "gpt_callsite_instrumentation.yaml").exists()
    summary = json.loads(run.read("pipeline_summary.json"))
    assert summary["status"] == "failed" and summary["exit_code"] == 1
    by_stage = {(s["stage"], s["entry"]): s for s in summary["stages"]}
    assert by_stage[("combine", "broken")]["status"] == "failed"
    assert "not valid JSON" in by_stage[("combine", "broken")]["error"]
    assert by_stage[("compress", "broken")]["status"] == "skipped"
    assert by_stage[("generate", "gpt_callsite")]["status"] == "ok"
    # merge needs two configs; compare takes the first config that exists (entry 2)
    # as its base and has nothing to compare it with
    assert by_stage[("merge", None)]["status"] == "skipped"
    assert by_stage[("compare", "broken")]["status"] == "skipped"
    assert by_stage[("compare", "broken")]["error"] == "this entry made no config"
    assert ("compare", "gpt_callsite") not in by_stage
    # the one config made is the final one, filtered as a single entry's would be
    assert "gpt_callsite's" in by_stage[("merge", None)]["error"]
    assert by_stage[("filter", "gpt_callsite")]["status"] == "ok"
    assert summary_fields(summary)["final_config"].endswith("gpt_callsite_instrumentation.yaml")
    assert (run.run_dir / "gpt_callsite_filtered_instrumentation.yaml").exists()


def test_missing_input_and_empty_pattern_fail_discovery(opguard, samples) -> None:
    run = opguard("run", "--base-dir", samples, "--input", "nope.json", "--input", "zz_*.json",
                  "--input", "gpt_callsite_rank0.json")  # fmt: skip
    assert run.exit_code == 1
    assert "nope.json: no such file" in run.stderr
    assert "'zz_*.json' matched no files" in run.stderr
    assert (run.run_dir / "gpt_callsite_instrumentation.yaml").exists()


def test_skip_is_recorded_and_downstream_stages_skip(opguard, samples) -> None:
    run = opguard("run", "--base-dir", samples, "--input", "gpt_callsite_rank*.json",
                  "--input", "fsdp_callsite_rank*.json", "--skip", "compress", "--skip", "compare",
                  expect=0)  # fmt: skip
    summary = json.loads(run.read("pipeline_summary.json"))
    assert summary["skipped_stages"] == ["compress", "compare"]
    statuses = {(s["stage"], s["entry"]): s["status"] for s in summary["stages"]}
    assert statuses[("combine", "gpt_callsite")] == "ok"
    assert statuses[("compress", "gpt_callsite")] == "skipped"
    assert statuses[("generate", "gpt_callsite")] == "skipped"
    assert not (run.run_dir / "gpt_callsite_compressed.json").exists()


@pytest.mark.parametrize("skipped", ["filter", "merge", "generate"])
def test_basic_where_the_filter_stage_would_not_run_is_a_usage_error(
    opguard, samples, skipped: str
) -> None:
    """``--basic`` with the filter stage skipped, or a stage it needs: it filtered
    nothing, with status ok and no warning."""
    run = opguard("run", "--base-dir", samples, "--input", "gpt_callsite_rank*.json",
                  "--basic", "--skip", skipped, expect=2)  # fmt: skip
    assert "--basic needs the filter stage, which would not run: " in run.stderr
    assert f"--skip {skipped}" in run.stderr
    assert run.run_dir is None


def test_thresholds_and_context_depth_reach_the_outputs(opguard, samples) -> None:
    run = opguard("run", "--base-dir", samples, "--input", "gpt_callsite_rank*.json",
                  "--min-count", "50", "--min-fraction", "0", "--no-chains",
                  "--context-depth", "2", expect=0)  # fmt: skip
    tree = load_tree(run.run_dir / "gpt_callsite_compressed.json")
    assert tree["meta"]["compression"]["min_count"] == 50
    assert tree["meta"]["compression"]["chains"] is False
    config = YAML(typ="safe").load(run.read("gpt_callsite_instrumentation.yaml"))
    assert max(len(e["context"]) for e in config["entries"]) == 2


def test_json_logs_name_stage_and_entry(opguard, samples) -> None:
    run = opguard("run", "--base-dir", samples, "--input", "gpt_callsite_rank*.json", expect=0)
    events = [json.loads(line) for line in run.stderr.splitlines() if line.startswith("{")]
    done = [e for e in events if e["event"] == "stage done" and e["stage"] == "compress"]
    assert done and done[0]["entry"] == "gpt_callsite"
    assert str(run.run_dir) == run.result.stdout.strip()


def test_output_base_env_and_fresh_directories(opguard, samples, tmp_path) -> None:
    first = opguard("run", "--base-dir", samples, "--input", "gpt_callsite_rank0.json", expect=0)
    second = opguard("run", "--base-dir", samples, "--input", "gpt_callsite_rank0.json", expect=0)
    assert first.run_dir != second.run_dir
    assert first.run_dir.parent == tmp_path / "out"
    assert first.run_dir.name.startswith("preprocessing_")
    # an empty --output-base is refused: it wrote into the current directory
    empty = opguard("run", "--base-dir", samples, "--input", "gpt_callsite_rank0.json",
                    "--output-base", "", expect=2)  # fmt: skip
    assert "Invalid value for '--output-base': give a directory" in empty.stderr
    assert not list(Path.cwd().glob("preprocessing_*"))


def test_every_commands_help_is_wrapped_without_its_docstrings_indent() -> None:
    """A docstring's indent once reached the help (``Every\\n Python     process``)."""
    import re

    from click.testing import CliRunner

    from opguard_core.cli import create_cli
    from opguard_core.plugin.manager import create_plugin_manager

    cli = create_cli(create_plugin_manager())
    for name in sorted(cli.commands):
        text = CliRunner(env={"COLUMNS": "80"}).invoke(cli, [name, "--help"]).output
        description = text.split("Options:", 1)[0]
        assert not re.search(r"\S {3,}\S", description), (name, description)


@pytest.mark.parametrize(
    ("argv", "disabled"),
    [
        (["--disable-plugin", "a", "run", "--disable-plugin=b", "-i", "x"], ["a", "b"]),
        (["--log-format", "json", "--disable-plugin", "a", "plugins", "--disable-plugin", "b"],
         ["a", "b"]),
        (["--disable-plugin", "a", "trace", "python", "job.py", "--disable-plugin", "trace"],
         ["a"]),
        (["guard", "--config", "c.yaml", "python", "job.py", "--disable-plugin=guard"], []),
        (["--log-format", "run", "trace", "python", "--disable-plugin", "x"], []),
        (["run", "-i", "x", "--", "--disable-plugin", "y"], []),
    ],
    ids=["run", "plugins", "trace-program", "guard-program", "log-format-value", "after-dashes"],
)  # fmt: skip
def test_disable_plugin_is_read_where_opguard_takes_it(
    argv: list[str], disabled: list[str]
) -> None:
    """``opguard trace python job.py --disable-plugin trace`` disabled the trace plugin
    (``No such command 'trace'``) instead of passing the option to the program."""
    assert disabled_from_args(argv) == disabled


@pytest.mark.parametrize("command", ["trace", "guard"])
def test_an_unknown_option_before_command_is_a_usage_error(command: str, tmp_path: Path) -> None:
    """``guard --smaple 0.5 -- python …`` ran a program named ``--smaple`` (exit 127,
    "command not found")."""
    config = tmp_path / "c.yaml"
    config.write_text("version: 1\n")
    own = ["--config", str(config)] if command == "guard" else ["--output-dir", str(tmp_path)]
    argv = [command, *own, "--smaple", "0.5", "--", sys.executable, "-c", "pass"]
    result = CliRunner().invoke(cli_for(argv), argv)
    assert result.exit_code == 2, result.output
    assert "No such option '--smaple'" in result.stderr


def test_compare_top_zero_keeps_all_as_show_does(opguard, samples) -> None:
    """``compare --top 0`` keeps every entry (it was refused: 0 is not in 1..)."""
    run = opguard("run", "--base-dir", samples, "--input", "gpt_callsite_rank*.json",
                  "--input", "fsdp_callsite_rank*.json", expect=0)  # fmt: skip
    configs = [str(run.run_dir / f"{n}_callsite_instrumentation.yaml") for n in ("gpt", "fsdp")]
    argv = ["compare", *configs, "--format", "json"]
    every = json.loads(CliRunner().invoke(cli_for(argv), argv).stdout)
    zero = json.loads(
        CliRunner().invoke(cli_for([*argv, "--top", "0"]), [*argv, "--top", "0"]).stdout
    )
    assert zero == every and every["only_first"]["entries"]
