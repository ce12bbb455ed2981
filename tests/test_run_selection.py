"""opguard run: --focus/--ignore, warnings for patterns that match nothing, YAML inputs,
the end-of-run summary, the plugins line, run_dir logged once, the compare base."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from ruamel.yaml import YAML

from opguard_core.errors import plural
from opguard_core.formats.tree import split_api, target_name
from opguard_core.run.summary import summary_lines

GPT = "gpt_callsite"


def _config(run: Any, name: str = f"{GPT}_instrumentation.yaml") -> Any:
    return YAML(typ="safe", pure=True).load(run.read(name))


def _summary(run: Any) -> Any:
    return json.loads(run.read("pipeline_summary.json"))


def _events(stderr: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]


def _gpt(opguard: Any, samples: Path, *extra: str, expect: int | None = 0) -> Any:
    return opguard("run", "-i", str(samples / "gpt_callsite_rank*.json"), *extra, expect=expect)


def _selected_total(run: Any, pattern: str) -> int:
    """Ops of the combined trace's callsites with a frame, api or op matching ``pattern``."""
    trace = json.loads(run.read(f"{GPT}_combined.json"))
    names = [target_name(f.get("module"), f.get("file"), f["qualname"]) for f in trace["frames"]]
    regex = re.compile(pattern)
    total = 0
    for site in trace["callsites"]:
        path = [names[i] for i in site["stack"]] + [site["op"]]
        if site.get("api"):
            module, qualname = split_api(site["api"])
            path.append(target_name(module, None, qualname))
        if any(regex.fullmatch(n) for n in path):
            total += site["count"]
    return total


@pytest.mark.parametrize("pattern", [r"torch\.optim\..*", "aten::view", r"torch:Tensor\..*"])
def test_focus_and_ignore_split_the_ops_between_them(opguard, samples, pattern) -> None:
    plain = _gpt(opguard, samples)
    focus = _gpt(opguard, samples, "--focus", pattern)
    ignore = _gpt(opguard, samples, "--ignore", pattern)
    total = _config(plain)["meta"]["total"]
    focused, ignored = _config(focus)["meta"]["total"], _config(ignore)["meta"]["total"]
    assert focused == _selected_total(plain, pattern)
    assert 0 < focused < total
    assert focused + ignored == total
    # the combined trace stays whole: selection happens between combine and compress
    assert focus.read(f"{GPT}_combined.json") == plain.read(f"{GPT}_combined.json")
    settings = _config(focus)["meta"]["settings"]
    assert (settings["focus"], settings["ignore"]) == ([pattern], [])
    assert _config(ignore)["meta"]["settings"]["ignore"] == [pattern]


def test_ignoring_an_op_removes_it_from_every_entry(opguard, samples) -> None:
    run = _gpt(opguard, samples, "--ignore", "aten::view")
    entries = _config(run)["entries"]
    assert entries and not any("aten::view" in e["ops"] for e in entries)


def test_patterns_that_match_nothing_are_warnings_in_log_and_summary(opguard, samples) -> None:
    run = _gpt(opguard, samples, "--hide", r"no\.such:frame", "--ignore", "nothing::here",
               "--focus", ".*", "--hide", r"ref_workloads:.*")  # fmt: skip
    expected = [
        {"message": "pattern matched nothing", "stage": "compress", "option": "--ignore",
         "pattern": "nothing::here", "entry": GPT},
        {"message": "pattern matched nothing", "stage": "compress", "option": "--hide",
         "pattern": r"no\.such:frame", "entry": GPT},
    ]  # fmt: skip
    assert _summary(run)["warnings"] == expected
    logged = [e for e in _events(run.stderr) if e["event"] == "pattern matched nothing"]
    assert [(e["option"], e["pattern"], e["level"]) for e in logged] == [
        ("--ignore", "nothing::here", "warning"),
        ("--hide", r"no\.such:frame", "warning"),
    ]
    assert _gpt(opguard, samples).exit_code == 0
    assert _summary(_gpt(opguard, samples))["warnings"] == []


@pytest.mark.parametrize("option", ["--hide", "--focus", "--ignore"])
def test_a_bad_regex_is_a_usage_error_naming_the_pattern(opguard, samples, option) -> None:
    run = _gpt(opguard, samples, option, "fine", option, "[unclosed", expect=2)
    assert f"{option} '[unclosed': not a regular expression" in run.stderr
    assert run.run_dir is None


@pytest.mark.parametrize("name", ["gpt_instrumentation.yaml", "configs/*.yml"])
def test_a_yaml_input_names_the_config_commands(opguard, samples, name) -> None:
    run = opguard("run", "-i", name, expect=2)
    assert f"--input {name}: a YAML config, not a callsite trace" in run.stderr
    assert "use opguard compare, merge, filter or show" in run.stderr
    assert run.run_dir is None


def test_a_run_directory_input_names_the_commands_for_it(opguard, samples) -> None:
    """A run directory given to ``run`` was an input refused at discover, in a new run
    directory of its own (exit 1); it is a usage error, as a config is."""
    first = _gpt(opguard, samples)
    run = opguard("run", "-i", str(first.run_dir), expect=2)
    assert f"--input {first.run_dir}: a run directory, not a callsite trace" in run.stderr
    assert run.run_dir is None
    # found by a pattern, it fails its input at discover (as any input a pattern
    # finds), saying the same: it said only "is a directory, not a trace file"
    pattern = str(first.run_dir.parent / "preprocessing_*")
    run = opguard("run", "-i", pattern, expect=1)
    assert f"{first.run_dir}: a run directory, not a callsite trace; use opguard show" in (
        run.stderr
    )
    # a name that cannot be looked up is refused at discover in one line, as before
    # the run-directory check (it raised OSError: File name too long, a traceback)
    run = opguard("run", "-i", "a" * 300, expect=1)
    assert "Traceback" not in run.stderr and "File name too long" in run.stderr, run.stderr


def test_the_end_of_a_run_says_what_it_made(opguard, samples) -> None:
    run = opguard("run", "-i", str(samples / "fsdp_callsite_rank*.json"),
                  "-i", str(samples / "gpt_callsite_rank*.json"), "--basic", expect=0)  # fmt: skip
    events = _events(run.stderr)
    (summary,) = [e for e in events if e["event"] == "run summary"]
    assert summary["status"] == "ok" and summary["entries"] == 2
    assert summary["final_config"] == str(run.run_dir / "final_combined_instrumentation.yaml")
    assert summary["filtered_config"] == str(
        run.run_dir / "final_combined_filtered_instrumentation.yaml"
    )
    assert (summary["failures"], summary["warnings"], summary["failed_entries"]) == (0, 0, [])
    stages = json.loads((run.run_dir / "pipeline_summary.json").read_text())["stages"]
    assert summary["divergence_findings"] == sum(
        r["counts"]["findings"] for r in stages if r["stage"] == "divergence"
    )
    # the plugins once, at the start; run_dir once
    (plugins,) = [e for e in events if e["event"] == "plugins"]
    listed = opguard("plugins", "--all", "--json", expect=0).result.stdout
    assert plugins["active"] == [p["name"] for p in json.loads(listed)]
    first_stage = min(i for i, e in enumerate(events) if e["event"] == "stage done")
    assert events.index(plugins) < first_stage
    assert [e["event"] for e in events if "run_dir" in e] == ["run started"]


def test_the_console_summary_is_a_few_lines_for_a_person(opguard, samples, tmp_path) -> None:
    bad = tmp_path / "broken.json"
    bad.write_bytes(b"{")
    run = opguard("--log-format", "console", "run", "-i", bad,
                  "-i", str(samples / "gpt_callsite_rank*.json"),
                  "-i", str(samples / "fsdp_callsite_rank*.json"), "--hide", "zzz")  # fmt: skip
    assert run.exit_code == 1
    lines = run.stderr.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("summary: "))
    assert lines[start - 1].startswith("opguard: combine [broken] failed: ")
    assert lines[start] == (
        "summary: failed, 3 entries (2 ok, 1 failed: broken), 1 failure, 3 warnings"
    )
    final = run.run_dir / "final_combined_instrumentation.yaml"
    assert lines[start + 1] == f"  final config: {final}"
    assert final.is_file()
    warnings = lines[start + 2 : start + 5]
    assert all(line.startswith("  warning: ") for line in warnings)
    assert "compare base is not entry 1 (base=2, entry=gpt_callsite" in warnings[-1]
    assert not any(line.lstrip().startswith("{") for line in lines)


def test_compare_uses_the_first_config_that_exists_and_says_so(opguard, samples, tmp_path) -> None:
    bad = tmp_path / "broken.json"
    bad.write_bytes(b"{")
    run = opguard("run", "-i", bad, "-i", str(samples / "gpt_callsite_rank*.json"),
                  "-i", str(samples / "fsdp_callsite_rank*.json"))  # fmt: skip
    summary = _summary(run)
    (compare,) = [s for s in summary["stages"] if s["stage"] == "compare" and s["status"] == "ok"]
    assert compare["counts"]["base"] == 2
    assert compare["outputs"] == ["comparison_2_vs_3.log"]
    assert run.read("comparison_2_vs_3.log").startswith(
        "comparison: 2 (gpt_callsite) vs 3 (fsdp_callsite)"
    )
    assert {"message": "compare base is not entry 1", "base": 2, "entry": GPT,
            "reason": "entry 1 made no config"} in summary["warnings"]  # fmt: skip
    logged = [e for e in _events(run.stderr) if e["event"] == "compare base is not entry 1"]
    assert len(logged) == 1 and logged[0]["level"] == "warning"


def test_the_summary_counts_divergence_findings(opguard, samples) -> None:
    """The recorded divergent job (rank 1 issues an extra all_reduce) beside the FSDP
    sample: the console summary and the JSON record count the divergence stage's
    findings and name the entry; without the stage there is no divergence line."""
    divergent = Path(__file__).parent / "data" / "divergent" / "divergent_callsite_rank*.json"
    run = opguard("run", "-i", str(divergent), "-i", str(samples / "fsdp_callsite_rank*.json"))
    summary = _summary(run)
    records = [s for s in summary["stages"] if s["stage"] == "divergence"]
    findings = sum(r["counts"]["findings"] for r in records)
    errors = sum(r["counts"]["errors"] for r in records)
    assert errors >= 1  # the extra all_reduce
    (record,) = [e for e in _events(run.stderr) if e["event"] == "run summary"]
    assert (record["divergence_findings"], record["divergence_errors"]) == (findings, errors)
    (line,) = [x for x in summary_lines(summary) if x.startswith("  divergence:")]
    assert line.startswith(
        f"  divergence: {plural(findings, 'finding')} ({plural(errors, 'error')}, "
    )
    assert "divergent_callsite" in line
    skipped = _summary(opguard("run", "-i", str(divergent), "--skip", "divergence"))
    assert not any("divergence" in x for x in summary_lines(skipped))


def test_meta_records_the_steps_of_each_source(opguard, samples) -> None:
    def steps(name: str) -> int:
        return json.loads((samples / f"{name}_rank0.json").read_text())["meta"]["steps"]

    run = opguard("run", "-i", str(samples / "fsdp_callsite_rank*.json"),
                  "-i", str(samples / "gpt_callsite_rank*.json"), expect=0)  # fmt: skip
    expected = {"fsdp_callsite": steps("fsdp_callsite"), "gpt_callsite": steps(GPT)}
    assert _config(run)["meta"]["steps"] == {GPT: expected[GPT]}
    assert _config(run, "final_combined_instrumentation.yaml")["meta"]["steps"] == expected


def test_a_selection_that_leaves_nothing_is_an_error(opguard, samples) -> None:
    """A --focus that matches nothing at all (a typo) fails the entry's compress and the
    run, as show, filter and export fail: an empty config would pass for a result."""
    run = opguard("run", "--base-dir", samples, "-i", "gpt_callsite_rank*.json",
                  "--focus", "no_such_module:.*", expect=1)  # fmt: skip
    summary = json.loads(run.read("pipeline_summary.json"))
    (failed,) = [s for s in summary["stages"] if s["status"] == "failed"]
    assert failed["stage"] == "compress"
    assert failed["error"] == (
        "gpt_callsite: nothing left: no callsite passes --focus no_such_module:.*"
    )
    assert not (run.run_dir / "gpt_callsite_compressed.json").exists()


def test_show_and_filter_refuse_a_selection_that_leaves_nothing(opguard, samples) -> None:
    run = opguard("run", "--base-dir", samples, "-i", "gpt_callsite_rank*.json", expect=0)
    config = run.run_dir / "gpt_callsite_instrumentation.yaml"
    shown = opguard("show", config, "--focus", "nothing:here")
    assert shown.exit_code == 1 and "nothing left: no entry passes --focus nothing:here" in (
        shown.stderr
    )
    out = samples / "f.yaml"
    filtered = opguard("filter", config, "--ignore", ".*", "-o", out)
    assert filtered.exit_code == 1 and not out.exists()


@pytest.mark.parametrize(
    ("count", "word", "text"),
    [(1, "entry", "1 entry"), (2, "entry", "2 entries"), (0, "finding", "0 findings"),
     (3, "match", "3 matches"), (2, "day", "2 days"), (1, "op", "1 op"), (5, "op", "5 ops")],
)  # fmt: skip
def test_counts_read_as_english(count: int, word: str, text: str) -> None:
    assert plural(count, word) == text


def test_the_summary_line_of_an_interrupted_run_counts_no_unfinished_entry_ok() -> None:
    """SIGTERM in entry ``a``'s combine: the line said ``2 entries (2 ok)`` (only a
    failed record made an entry not ok)."""
    summary = {
        "status": "interrupted",
        "interrupted": {"signal": "SIGTERM", "stage": "combine", "entry": "a"},
        "entries": [{"name": "done"}, {"name": "a"}, {"name": "b"}],
        "stages": [
            {"stage": "discover", "entry": None, "status": "ok"},
            {"stage": "combine", "entry": "done", "status": "ok"},
            {"stage": "combine", "entry": "a", "status": "interrupted"},
        ],
    }
    assert summary_lines(summary)[0] == (
        "summary: interrupted, 3 entries (1 ok, 1 interrupted: a, 1 not run: b), "
        "0 failures, 0 warnings"
    )
