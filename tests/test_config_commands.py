"""opguard compare, merge, filter and show on configs and run directories, through the CLI.

The round trips hold the commands to the run: merging the run's per-entry configs
gives its final config byte for byte, filtering its final config gives its filtered
config, and comparing a config with itself finds nothing.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from ruamel.yaml import YAML

from opguard_core.cli.app import cli_for
from opguard_core.configs.selection import Selection
from opguard_core.formats.config import CONFIG_VERSION, load_config

SAMPLES = Path(__file__).parent / "data" / "samples"
V1 = Path(__file__).parent / "data" / "configs" / "gpt_callsite_v1.yaml"
FSDP = "fsdp_callsite_instrumentation.yaml"
GPT = "gpt_callsite_instrumentation.yaml"
FINAL = "final_combined_instrumentation.yaml"
FILTERED = "final_combined_filtered_instrumentation.yaml"


def invoke(*args: str | Path) -> Result:
    argv = ["--log-format", "json", *[str(a) for a in args]]
    return CliRunner().invoke(cli_for(argv), argv, catch_exceptions=False)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One two-entry run of the samples with --basic (shared: the commands only read it)."""
    out = tmp_path_factory.mktemp("out")
    result = invoke(
        "run", "--output-base", out, "--basic",
        "-i", str(SAMPLES / "fsdp_callsite_rank*.json"),
        "-i", str(SAMPLES / "gpt_callsite_rank*.json"),
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    return Path(result.stdout.strip())


def safe(path: Path) -> Any:
    return YAML(typ="safe", pure=True).load(path.read_text())


# ----------------------------------------------------------------- round trips


def test_merge_of_the_runs_configs_is_its_final_config_byte_for_byte(run_dir, tmp_path) -> None:
    out = tmp_path / "merged.yaml"
    result = invoke("merge", run_dir / FSDP, run_dir / GPT, "-o", out)
    assert result.exit_code == 0, result.stderr
    assert result.stdout.strip() == str(out)
    assert out.read_bytes() == (run_dir / FINAL).read_bytes()


def test_merge_bytes_do_not_depend_on_which_side_had_which_key(run_dir, tmp_path) -> None:
    """Fields this version does not know (on the document and on an entry), and a
    side without ``meta``: each went after the other side's keys, so ``merge A B`` and
    ``merge B A`` wrote the same data in two orders."""

    def with_fields(text: str, entry_field: str, field: str) -> str:
        """``text`` with ``entry_field`` on its first entry and ``field`` at the end."""
        at = text.index("\n    count: ") + 1
        at = text.index("\n", at) + 1
        return text[:at] + f"    {entry_field}\n" + text[at:] + f"{field}\n"

    gpt = (run_dir / GPT).read_text()
    a = tmp_path / "a.yaml"
    a.write_text(with_fields(gpt, "reviewer: alice", "zeta: 1"))
    b = tmp_path / "b.yaml"
    b.write_text(with_fields(gpt.replace("gpt_callsite", "gpt2"), "flagged: true", "alpha: 2"))
    c = tmp_path / "c.yaml"
    c.write_text("version: 5\nsource: bare\nentries: []\n")
    outputs = []
    for order in ((a, b, c), (b, a, c), (c, b, a), (c, a, b)):
        out = tmp_path / f"m{len(outputs)}.yaml"
        result = invoke("merge", *order, "-o", out)
        assert result.exit_code == 0, result.stderr
        outputs.append(out.read_bytes())
    assert len(set(outputs)) == 1
    text = outputs[0].decode()
    assert text.startswith("version: 6\nsource: bare+gpt2+gpt_callsite\nmeta:\n")
    assert text.endswith("alpha: 2\nzeta: 1\n")
    assert "    reviewer: alice\n    flagged: true\n" not in text
    assert "    flagged: true\n    reviewer: alice\n    sources: " in text


def test_merge_of_configs_made_with_different_settings_warns(run_dir, tmp_path) -> None:
    """Configs made with another compressor or hide patterns: the merged config holds
    one value of each setting, which check then uses (it kept one silently)."""
    text = (run_dir / GPT).read_text()
    assert "\n    min_count: " in text
    other = tmp_path / "other.yaml"
    other.write_text(re.sub(r"\n    min_count: \d+", "\n    min_count: 999", text).replace(
        "source: gpt_callsite", "source: gpt_other"))  # fmt: skip
    result = invoke("merge", run_dir / GPT, other, "-o", tmp_path / "m.yaml")
    assert result.exit_code == 0, result.stderr
    (event,) = [json.loads(line) for line in result.stderr.splitlines() if "settings" in line]
    assert event["level"] == "warning" and event["settings"] == ["min_count"]
    assert event["event"].startswith("the configs were made with different settings (min_count)")
    result = invoke("merge", run_dir / GPT, run_dir / FSDP, "-o", tmp_path / "alike.yaml")
    assert "different settings" not in result.stderr
    # a setting only one of them records (filtered, the other not) differs too
    other.write_text(text.replace("\n    min_count: ", "\n    filters: [basic]\n    min_count: ")
                     .replace("source: gpt_callsite", "source: gpt_other"))  # fmt: skip
    assert "\n    filters: [basic]\n" in other.read_text()
    result = invoke("merge", run_dir / GPT, other, "-o", tmp_path / "f.yaml")
    (event,) = [json.loads(line) for line in result.stderr.splitlines() if "settings" in line]
    assert event["settings"] == ["filters"], result.stderr


def test_merge_with_a_config_of_unknown_total_loads_back(run_dir, tmp_path) -> None:
    """A config without ``meta.total`` (unknown) merged with one that has it: the
    merged total is unknown too (none), not the one side's, which its counts exceed."""
    text = (run_dir / GPT).read_text()
    assert re.search(r"^  total: \d+$", text, re.M)
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text(re.sub(r"^  total: \d+\n", "", text, flags=re.M).replace(
        "source: gpt_callsite", "source: gpt_again"))  # fmt: skip
    out = tmp_path / "merged.yaml"
    result = invoke("merge", run_dir / GPT, unknown, "-o", out)
    assert result.exit_code == 0, result.stderr
    assert "total" not in load_config(out)["meta"]
    assert invoke("show", out).exit_code == 0


@pytest.mark.parametrize("given", ["run_dir", "file"])
def test_filter_basic_of_the_final_config_is_the_runs_filtered_config(
    run_dir, tmp_path, given
) -> None:
    out = tmp_path / "filtered.yaml"
    source = run_dir if given == "run_dir" else run_dir / FINAL
    result = invoke("filter", source, "--basic", "-o", out)
    assert result.exit_code == 0, result.stderr
    assert out.read_bytes() == (run_dir / FILTERED).read_bytes()


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_compare_a_config_with_itself_reports_no_change(run_dir, fmt) -> None:
    result = invoke("compare", run_dir, run_dir / FILTERED, "--format", fmt, "--fail-on-change")
    assert result.exit_code == 0, result.stderr
    if fmt == "json":
        data = json.loads(result.stdout)
        assert data["differs"] is False
        assert [data[s]["count"] for s in ("only_first", "only_other", "changed")] == [0, 0, 0]
    else:
        assert "changed: 0" in result.stdout
        assert result.stdout.count(": 0\n") == 3  # only in one, only in the other, changed


# ----------------------------------------------------------------- compare


def _entries(path: Path) -> dict[tuple[str, tuple[str, ...]], dict[str, Any]]:
    return {(e["target"], tuple(e["context"])): e for e in safe(path)["entries"]}


def test_compare_exits_0_on_change_unless_asked(run_dir) -> None:
    assert invoke("compare", run_dir / FSDP, run_dir / GPT).exit_code == 0
    failing = invoke("compare", run_dir / FSDP, run_dir / GPT, "--fail-on-change")
    assert failing.exit_code == 1
    assert "comparison:" in failing.stdout


def test_compare_json_sections_match_the_configs(run_dir) -> None:
    a, b = _entries(run_dir / FSDP), _entries(run_dir / GPT)
    data = json.loads(invoke("compare", run_dir / FSDP, run_dir / GPT, "--format", "json").stdout)
    assert data["differs"] is True
    assert data["first"]["entries"] == len(a) and data["other"]["entries"] == len(b)
    only = {(e["target"], tuple(e["context"])): e["count"] for e in data["only_first"]["entries"]}
    assert only == {k: e["count"] for k, e in a.items() if k not in b}
    only = {(e["target"], tuple(e["context"])): e["count"] for e in data["only_other"]["entries"]}
    assert only == {k: e["count"] for k, e in b.items() if k not in a}
    fields = ("count", "ops", "stream_counts")
    expected = {
        k
        for k in set(a) & set(b)
        if [a[k][f] for f in fields] != [b[k][f] for f in fields]
        or set(a[k]["tags"]) != set(b[k]["tags"])
    }
    changed = {(e["target"], tuple(e["context"])): e for e in data["changed"]["entries"]}
    assert set(changed) == expected and expected
    for key, entry in changed.items():
        assert (entry["before"], entry["after"]) == (a[key]["count"], b[key]["count"])
        ops = {o["op"]: (o["before"], o["after"]) for o in entry["ops"]}
        every = set(a[key]["ops"]) | set(b[key]["ops"])
        assert ops == {
            op: (a[key]["ops"].get(op, 0), b[key]["ops"].get(op, 0))
            for op in every
            if a[key]["ops"].get(op, 0) != b[key]["ops"].get(op, 0)
        }


def test_compare_sorts_by_size_by_default_and_by_key_on_request(run_dir) -> None:
    def changed(*extra: str) -> list[dict[str, Any]]:
        args = ("compare", run_dir / FSDP, run_dir / GPT, "--format", "json", *extra)
        return json.loads(invoke(*args).stdout)["changed"]["entries"]

    by_delta, by_key = changed(), changed("--sort", "key")
    assert len(by_delta) == len(by_key) >= 2
    sizes = [abs(e["delta"]) for e in by_delta]
    assert sizes == sorted(sizes, reverse=True)
    keys = [(e["target"], e["context"]) for e in by_key]
    assert keys == sorted(keys)
    for entry in by_delta:
        op_sizes = [abs(o["delta"]) for o in entry["ops"]]
        assert op_sizes == sorted(op_sizes, reverse=True)


@pytest.mark.parametrize("top", [1, 3])
def test_compare_top_cuts_every_section(run_dir, top) -> None:
    args = ("compare", run_dir / FSDP, run_dir / GPT, "--top", top)
    data = json.loads(invoke(*args, "--format", "json").stdout)
    for section in ("only_first", "only_other", "changed"):
        assert len(data[section]["entries"]) == min(top, data[section]["count"])
    text = invoke(*args).stdout
    more = data["only_first"]["count"] - top
    assert f"  … {more} more (--top {top})" in text
    assert text.count("\n  - ") == top


def test_the_runs_comparison_log_is_the_commands_text_sorted_by_key(run_dir) -> None:
    # the stage and the command share one difference; the labels (and so the width of
    # the totals' columns) differ
    text = invoke("compare", run_dir / FSDP, run_dir / GPT, "--sort", "key").stdout
    text = text.replace(str(run_dir / FSDP), "1 (fsdp_callsite)")
    text = text.replace(str(run_dir / GPT), "2 (gpt_callsite)")
    log = (run_dir / "comparison_1_vs_2.log").read_text()
    assert log.split("\n\nonly in ", 1)[1] == text.split("\n\nonly in ", 1)[1]


# ----------------------------------------------------------------- show


def test_show_json_lists_the_largest_entries(run_dir) -> None:
    result = invoke("show", run_dir, "--format", "json", "--top", "5")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    config = safe(run_dir / FILTERED)
    assert data["config"] == str(run_dir / FILTERED)
    assert (data["total"], data["ranks"]) == (config["meta"]["total"], config["meta"]["ranks"])
    assert data["entries_in_config"] == data["entries_selected"] == len(config["entries"])
    assert data["shown"] == len(data["entries"]) == 5
    counts = sorted((e["count"] for e in config["entries"]), reverse=True)
    assert [e["count"] for e in data["entries"]] == counts[:5]
    by_key = {(e["target"], tuple(e["context"])): e for e in config["entries"]}
    for row in data["entries"]:
        entry = by_key[(row["target"], tuple(row["context"]))]
        assert row["share"] == round(entry["count"] / config["meta"]["total"], 6)
        assert set(row) == {"target", "context", "kind", "count", "share", "main_ops", "tags"}
        ops = sorted(entry["ops"].items(), key=lambda kv: (-kv[1], kv[0]))[:3]
        assert [(o["op"], o["count"]) for o in row["main_ops"]] == ops


def test_show_top_0_shows_all_and_tag_selects(run_dir) -> None:
    config = safe(run_dir / FILTERED)
    everything = json.loads(invoke("show", run_dir, "--format", "json", "--top", "0").stdout)
    assert everything["shown"] == len(config["entries"])
    tagged = json.loads(
        invoke("show", run_dir, "--format", "json", "--top", "0", "--tag", "communication").stdout
    )
    expected = [e for e in config["entries"] if "communication" in e["tags"]]
    assert 0 < tagged["shown"] == len(expected) < everything["shown"]
    typo = invoke("show", run_dir, "--tag", "comunication")  # as a --focus keeping nothing
    assert typo.exit_code == 1
    assert "nothing left: no entry has --tag comunication (the config's tags: " in typo.stderr


def test_show_focus_and_ignore_follow_entry_paths(run_dir) -> None:
    config = safe(run_dir / FILTERED)
    pattern = r"torch\.optim\..*"

    def through(entry: dict[str, Any]) -> bool:
        import re

        return any(re.fullmatch(pattern, n) for n in (*entry["context"], entry["target"]))

    def shown(*extra: str) -> set[tuple[str, tuple[str, ...]]]:
        data = json.loads(invoke("show", run_dir, "--format", "json", "--top", "0", *extra).stdout)
        return {(e["target"], tuple(e["context"])) for e in data["entries"]}

    keys = {(e["target"], tuple(e["context"])): e for e in config["entries"]}
    focused = shown("--focus", pattern)
    assert focused == {k for k, e in keys.items() if through(e)} and focused
    assert shown("--ignore", pattern) == set(keys) - focused


def test_show_is_plain_text_when_piped_and_a_rich_table_on_a_terminal(run_dir, monkeypatch) -> None:
    plain = invoke("show", run_dir, "--top", "3").stdout.splitlines()
    assert plain[1].split() == ["count", "share", "target", "context", "main", "ops"]
    assert len(plain) == 2 + 3 and "━" not in "".join(plain)
    import opguard_plugins.view.config_commands as commands

    monkeypatch.setattr(commands, "_on_terminal", lambda: True)
    rich = invoke("show", run_dir, "--top", "3").stdout
    assert "━" in rich or "─" in rich
    assert "main ops" in rich


# ----------------------------------------------------------------- filter


def test_filter_focus_and_ignore_are_recorded_and_select_entries(run_dir, tmp_path) -> None:
    out = tmp_path / "f.yaml"
    result = invoke("filter", run_dir, "--focus", r"torch\..*", "--ignore", r"torch\.optim\..*",
                    "--ignore", "no_such:frame", "-o", out)  # fmt: skip
    assert result.exit_code == 0, result.stderr
    config = safe(out)
    assert config["entries"]
    for entry in config["entries"]:
        path = [*entry["context"], entry["target"]]
        assert any(n.startswith("torch.") for n in path)
        assert not any(n.startswith("torch.optim.") for n in path)
    settings = config["meta"]["settings"]
    assert settings["filter_focus"] == [r"torch\..*"]
    assert settings["filter_ignore"] == [r"torch\.optim\..*", "no_such:frame"]
    assert "filters" not in settings or settings["filters"] == []
    warnings = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    assert [(w["option"], w["pattern"]) for w in warnings if w["event"] == "pattern matched nothing"
            ] == [("--ignore", "no_such:frame")]  # fmt: skip


@pytest.mark.parametrize("options", [["--basic"], ["--focus", r"torch\..*"]])
def test_filtering_a_filtered_config_again_writes_the_same_bytes(
    run_dir, tmp_path, options
) -> None:
    """The filter and the patterns are recorded once in ``meta.settings`` (once
    ``filters: [basic_filter, basic_filter]`` and the pattern twice)."""
    once, twice = tmp_path / "once.yaml", tmp_path / "twice.yaml"
    assert invoke("filter", run_dir, *options, "-o", once).exit_code == 0
    assert invoke("filter", once, *options, "-o", twice).exit_code == 0
    assert twice.read_bytes() == once.read_bytes()


@pytest.mark.parametrize("command", ["filter", "show"])
def test_a_bad_pattern_is_a_usage_error_naming_it(run_dir, tmp_path, command) -> None:
    extra = ["-o", str(tmp_path / "x.yaml")] if command == "filter" else []
    result = invoke(command, run_dir, "--focus", "ok", "--focus", "(unclosed", *extra)
    assert result.exit_code == 2
    assert "--focus '(unclosed': not a regular expression" in result.stderr
    assert "Traceback" not in result.stderr


# ----------------------------------------------------------------- comments, v1, errors


def _commented(source: Path, target: Path) -> tuple[str, str]:
    """``source`` with a comment line above its third entry and one at the end of an op
    line of that entry; returns the third and fourth entries' targets."""
    lines = source.read_text().splitlines(keepends=True)
    out, seen, targets = [], 0, []
    for line in lines:
        if line.startswith("  - target: "):
            seen += 1
            if seen in (3, 4):
                targets.append(line.split(": ", 1)[1].strip())
            if seen == 3:
                out.append("  # reviewed by a person: keep\n")
        if seen == 3 and line.startswith("      aten::") and "# hot" not in "".join(out):
            line = line.rstrip("\n") + "  # hot\n"
        out.append(line)
    target.write_text("".join(out))
    return targets[0], targets[1]


def _comment_above(text: str, comment: str) -> str:
    """The first entry line below ``comment`` (summary lines between them allowed)."""
    after = text.split(comment + "\n", 1)[1].splitlines()
    return next(line for line in after if line.startswith("  - target: "))


@pytest.mark.slow  # over 2 s in the quick group
def test_person_comments_survive_merge_from_either_side(run_dir, tmp_path) -> None:
    mine = tmp_path / "gpt.yaml"
    third, _ = _commented(run_dir / GPT, mine)
    for order in ((run_dir / FSDP, mine), (mine, run_dir / FSDP)):
        out = tmp_path / "merged.yaml"
        result = invoke("merge", *order, "-o", out)
        assert result.exit_code == 0, result.stderr
        text = out.read_text()
        assert _comment_above(text, "  # reviewed by a person: keep") == f"  - target: {third}"
        assert text.count("  # hot\n") == 1
        assert text.count("# reviewed by a person") == 1


def test_person_comments_survive_filter_where_their_entry_does(run_dir, tmp_path) -> None:
    mine = tmp_path / "gpt.yaml"
    third, _ = _commented(run_dir / GPT, mine)
    kept = tmp_path / "kept.yaml"
    assert invoke("filter", mine, "--focus", ".*", "-o", kept).exit_code == 0
    assert _comment_above(kept.read_text(), "  # reviewed by a person: keep") == (
        f"  - target: {third}"
    )
    gone = tmp_path / "gone.yaml"
    pattern = third.replace(".", r"\.")
    assert invoke("filter", mine, "--ignore", pattern, "-o", gone).exit_code == 0
    assert "# reviewed by a person" not in gone.read_text()
    assert "# hot" not in gone.read_text()


def test_summary_lines_are_regenerated_not_kept(run_dir, tmp_path) -> None:
    stale = tmp_path / "stale.yaml"
    text = (run_dir / GPT).read_text()
    first = text.index("  # ")
    stale.write_text(text[:first] + "  # 1 ops, 99.9% of total\n" + text[first:])
    out = tmp_path / "out.yaml"
    assert invoke("filter", stale, "-o", out).exit_code == 0
    assert "99.9% of total" not in out.read_text()
    assert out.read_text() == text


@pytest.mark.slow  # over 2 s in the quick group
def test_a_v1_config_goes_through_every_command(run_dir, tmp_path) -> None:
    v1 = safe(V1)
    assert v1["version"] == 1
    shown = json.loads(invoke("show", V1, "--format", "json").stdout)
    assert shown["total"] == v1["meta"]["total"] and shown["entries_in_config"] == len(
        v1["entries"]
    )
    filtered = tmp_path / "filtered.yaml"
    assert invoke("filter", V1, "--basic", "-o", filtered).exit_code == 0
    merged = tmp_path / "merged.yaml"
    assert invoke("merge", V1, run_dir / FSDP, "-o", merged).exit_code == 0
    for out in (filtered, merged):
        text = out.read_text()
        assert safe(out)["version"] == CONFIG_VERSION
        assert "  ops:\n" in text and "ops: {" not in text  # block ops: v2 layout
        # stream ids became roles (0 is compute; the collectives' counts are comm)
        assert "      compute: " in text and "      0: " not in text
        assert "# reviewed: the training loop, keep\n" in text
        assert "count: 5548  # checked against the profiler\n" in text
        assert text.startswith("# gpt_callsite, reviewed 2026-11-26")
    # v1 against the same data in v2 (the run's gpt config): the same entries and counts,
    # but for the rank-specific nodes pruning now keeps (the v1 file predates that rule)
    same = invoke("compare", V1, run_dir / GPT, "--format", "json")
    data = json.loads(same.stdout)
    tree = json.loads((run_dir / "gpt_callsite_compressed.json").read_text())
    kept = tree["meta"]["compression"]["rank_nodes_kept"]
    assert kept >= 1
    assert [data[s]["count"] for s in ("only_first", "only_other", "changed")] == [0, kept, 0]


def test_commands_refuse_bad_inputs_in_one_line(tmp_path) -> None:
    not_a_run = tmp_path / "empty_dir"
    not_a_run.mkdir()
    broken = tmp_path / "broken.yaml"
    broken.write_text("version: 2\nentries: {}\n")
    for args, problem in (
        (("show", not_a_run), f"{not_a_run}: not a run directory"),
        (("show", tmp_path / "missing.yaml"), "missing.yaml: no such file"),
        (("compare", V1, broken), f"{broken}: 'entries' must be a list"),
    ):
        result = invoke(*args)
        assert result.exit_code == 5  # an input that cannot be read
        (line,) = result.stderr.strip().splitlines()
        assert line.startswith("opguard: error: ") and problem in line


def test_merge_needs_two_configs(tmp_path) -> None:
    result = invoke("merge", V1, "-o", tmp_path / "x.yaml")
    assert result.exit_code == 2
    assert "at least two configs" in result.stderr


def test_a_run_directory_without_a_final_config_is_refused(run_dir, tmp_path) -> None:
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    summary = json.loads((copy / "pipeline_summary.json").read_text())
    summary["stages"] = [s for s in summary["stages"] if s["stage"] not in ("merge", "filter")]
    (copy / "pipeline_summary.json").write_text(json.dumps(summary))
    result = invoke("show", copy)
    assert result.exit_code == 5
    assert "made no final config" in result.stderr


@pytest.mark.parametrize("status", ["running", "interrupted", "abandoned"])
def test_a_run_stopped_after_its_first_entry_is_not_that_entrys_config(
    run_dir, tmp_path, status
) -> None:
    """A run killed (or interrupted) once its first entry's config was written, before
    the second entry ran: its one config is not the run's final config (that fallback
    is for a finished run whose other entries failed); it stood for it silently."""
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    summary = json.loads((copy / "pipeline_summary.json").read_text())
    first = next(i for i, s in enumerate(summary["stages"]) if s["stage"] == "generate")
    summary["stages"] = summary["stages"][: first + 1]
    summary["status"] = status
    (copy / "pipeline_summary.json").write_text(json.dumps(summary))
    for args in (("show", copy), ("merge", copy, V1, "-o", tmp_path / "m.yaml")):
        result = invoke(*args)
        assert result.exit_code == 5
        (line,) = result.stderr.strip().splitlines()
        assert f"made no final config (its status is '{status}')" in line
    assert not (tmp_path / "m.yaml").exists()
    summary["status"] = "failed"  # a finished run whose other entry failed: its one config
    (copy / "pipeline_summary.json").write_text(json.dumps(summary))
    assert invoke("show", copy).exit_code == 0


def test_filter_basic_needs_the_basic_filter(run_dir, tmp_path) -> None:
    out = tmp_path / "x.yaml"
    result = invoke("--disable-plugin", "basic_filter", "filter", run_dir, "--basic", "-o", out)
    assert result.exit_code == 2
    assert "--basic needs the basic_filter plugin, which is disabled" in result.stderr
    assert not out.exists()


@pytest.mark.parametrize("command", ["filter", "run"])
def test_a_basic_list_without_basic_is_a_usage_error(run_dir, tmp_path, command) -> None:
    """The list replaces the basic filter's: without ``--basic`` it was silently ignored
    (even a malformed one), and the command exited 0 having filtered nothing."""
    listed = tmp_path / "list.yaml"
    listed.write_text("utilities: [torch.nn.functional:relu]\n")
    out = tmp_path / "x.yaml"
    args = (
        ["filter", run_dir, "-o", out]
        if command == "filter"
        else ["run", "-i", SAMPLES / "gpt_callsite_rank0.json", "--output-base", tmp_path]
    )
    result = invoke(*args, "--basic-list", listed)
    assert result.exit_code == 2
    assert "--basic-list replaces the basic filter's list: it needs --basic" in result.stderr
    assert not out.exists() and not list(tmp_path.glob("preprocessing_*"))


def test_merging_two_recordings_of_one_source_adds_their_steps_too(run_dir, tmp_path) -> None:
    """The same source in both inputs: counts and steps are added, so per step the
    merged config is the source's own (its steps were kept once: every entry then
    drifted by -50 % in check) and a warning says so."""
    (config,) = run_dir.glob("fsdp_callsite_instrumentation.yaml")
    twice = tmp_path / "twice.yaml"
    merged = invoke("merge", config, config, "-o", twice)
    assert merged.exit_code == 0, merged.stderr
    assert "fsdp_callsite in several configs: two recordings of one source" in merged.stderr
    steps = safe(config)["meta"].get("steps")
    assert safe(twice)["meta"].get("steps") == (
        None if steps is None else {k: 2 * v for k, v in steps.items()}
    )
    found = []
    for checked_config in (config, twice):  # the merged config checks as the source's own
        checked = invoke("check", "--config", checked_config, "-i",
                         SAMPLES / "fsdp_callsite_rank*.json", "--format", "json")  # fmt: skip
        assert checked.exit_code == 0, checked.stderr
        found.append([v["message"] for v in json.loads(checked.stdout)["violations"]])
    assert found[1] == found[0]


@pytest.mark.parametrize(
    "selection",
    [["--focus", r"torch\.optim\..*"], ["--ignore", r"torch\..*"],
     ["--focus", r"torch\..*", "--ignore", r"torch\.optim\..*"]],
    ids=["focus", "ignore", "both"],
)  # fmt: skip
def test_check_holds_traces_to_the_entries_a_filter_kept(run_dir, tmp_path, selection) -> None:
    """A config narrowed by ``filter --focus/--ignore``, checked against the traces it
    was made from: what the filter cut out is not ``unknown_target`` or
    ``unknown_context`` (it was, one warning per target cut out)."""
    narrowed = tmp_path / "narrowed.yaml"
    result = invoke("filter", run_dir / FSDP, *selection, "-o", narrowed)
    assert result.exit_code == 0, result.stderr
    traces = str(SAMPLES / "fsdp_callsite_rank*.json")
    result = invoke("check", "--config", narrowed, "--strict", "--format", "json", "-i", traces)
    assert result.exit_code == 0, result.stdout
    assert json.loads(result.stdout)["violations"] == []
    # the whole config still finds what another job does that it does not
    other = str(SAMPLES / "gpt_callsite_rank*.json")
    result = invoke("check", "--config", narrowed, "--format", "json", "-i", other)
    found = json.loads(result.stdout)["violations"]
    assert found, "another job's traces pass a narrowed config"
    kept = Selection.of(*_patterns(selection))
    for v in found:  # and only within what the config kept
        assert kept.keeps([*v["context"], v["target"]]), v


def _patterns(options: list[str]) -> tuple[list[str], list[str]]:
    pairs = list(zip(options[::2], options[1::2], strict=True))
    return [p for o, p in pairs if o == "--focus"], [p for o, p in pairs if o == "--ignore"]


def test_pyyaml_reads_every_config_of_a_run_as_opguard_does(run_dir) -> None:
    """Configs are files people process with other tools: PyYAML (YAML 1.1, the most
    common Python reader) failed on every config a run wrote, at the default hide
    pattern ``…Module\\._(wrapped_)?call_impl`` written plain in a flow list (a plain
    scalar ends at ``?`` there in YAML 1.1); it is quoted now."""
    import yaml  # the extra `test`: PyYAML is a reader people use, not OpGuard's

    written = sorted(run_dir.glob("*.yaml"))
    assert len(written) >= 4
    for path in written:
        text = path.read_text()
        assert yaml.safe_load(text) == safe(path), path.name
    assert (
        r"'torch\.nn\.modules\.module:Module\._(wrapped_)?call_impl'"
        in (run_dir / FINAL).read_text()
    )
