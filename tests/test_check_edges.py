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
import shutil
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from opguard_core.cli.app import create_cli
from opguard_core.formats.config import dump_config, entry_key, load_config
from opguard_core.plugin.manager import create_plugin_manager
from opguard_plugins.stages.compress import DEFAULT_HIDE
from tests.builders import trace_doc, write

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
    """``opguard check --format json``; ``inputs`` are traces, or options (``--x``) with
    their values."""
    args: list[str | Path] = ["check", "--config", config, "--format", "json"]
    values = iter(inputs)
    for item in values:
        args += [item, next(values)] if item.startswith("--") else ["-i", item]
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


# ------------------------------------------------------------ merged configs


@pytest.fixture(scope="module")
def merged_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled example pipeline: the DDP, FSDP2 and single-process traces, merged."""
    return make_run(
        tmp_path_factory.mktemp("merged"),
        SOURCES["ddp_callsite"],
        SOURCES["fsdp_callsite"],
        SOURCES["single_callsite"],
    )


@pytest.mark.parametrize("source", sorted(SOURCES))
@pytest.mark.parametrize("strict", [False, True])
def test_a_merged_config_checks_each_of_its_sources_cleanly(
    merged_run: Path, source: str, strict: bool
) -> None:
    final = merged_run / "final_combined_instrumentation.yaml"
    report = check(final, SOURCES[source], strict=strict)
    assert report["violations"] == [], kinds(report)
    text = invoke("check", "--config", final, "-i", SOURCES[source])
    line = f"(per source, of 3: {source} with {source} (its name)): 0 error(s), 0 warning(s)"
    assert line in text.stdout


def test_a_merged_config_checks_all_its_sources_together(merged_run: Path) -> None:
    report = check(merged_run, *SOURCES.values(), strict=True)
    assert report["violations"] == []


def test_a_merged_config_records_what_each_source_contributed(merged_run: Path) -> None:
    config = load_config(merged_run / "final_combined_instrumentation.yaml")
    assert config["meta"]["source_ranks"] == {
        "ddp_callsite": [0, 1],
        "fsdp_callsite": [0, 1],
        "single_callsite": [0],
    }
    for entry in config["entries"]:
        assert sum(entry["sources"].values()) == entry["count"], entry["target"]
    for source in SOURCES:  # each source's share is that source's own config
        own = load_config(merged_run / f"{source}_instrumentation.yaml")
        share = {
            entry_key(e): e["sources"][source] for e in config["entries"] if source in e["sources"]
        }
        assert share == {entry_key(e): e["count"] for e in own["entries"]}
    # one source's config records nothing: it is all its source's
    single = load_config(merged_run / "single_callsite_instrumentation.yaml")
    assert "source_ranks" not in single["meta"]
    assert all("sources" not in e for e in single["entries"])


def test_the_merge_command_records_the_same(merged_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "m.yaml"
    configs = [merged_run / f"{s}_instrumentation.yaml" for s in sorted(SOURCES)]
    result = invoke("merge", *configs, "-o", out)
    assert result.exit_code == 0, result.stderr
    # the run folds in command-line order (ddp, fsdp, single): the same merge
    assert out.read_text() == (merged_run / "final_combined_instrumentation.yaml").read_text()


def test_traces_under_another_name_are_compared_with_the_best_fitting_source(
    merged_run: Path, tmp_path: Path
) -> None:
    """A new run of the DDP job, labelled ``week2``: the DDP share fits it; forcing
    the FSDP2 share shows the comparison is per source (FSDP2 ran other functions)."""
    for rank in (0, 1):
        shutil.copy(EXAMPLES / f"ddp_callsite_rank{rank}.json", tmp_path / f"week2_rank{rank}.json")
    week2 = str(tmp_path / "week2_rank*.json")
    assert check(merged_run, week2, strict=True)["violations"] == []
    text = invoke("check", "--config", merged_run, "-i", week2)
    assert "(per source, of 3: week2 with ddp_callsite (best fit))" in text.stdout
    forced = check(merged_run, week2, "--source", "fsdp_callsite")
    assert kinds(forced).get("missing", 0) > 0 and kinds(forced).get("unknown_target", 0) > 0
    unknown = invoke("check", "--config", merged_run, "-i", week2, "--source", "nope")
    assert unknown.exit_code == 2 and "nope: not a source this config records" in unknown.stderr
    # a config of one source: --source naming it is that config checked (it was refused
    # as "not a source this config records (none)"); another name is refused naming it
    single = merged_run / "ddp_callsite_instrumentation.yaml"
    own = check(single, week2, "--source", "ddp_callsite", strict=True)
    assert own["violations"] == check(single, week2, strict=True)["violations"] == []
    other = invoke("check", "--config", single, "-i", week2, "--source", "nope")
    assert other.exit_code == 2
    assert "nope: not a source this config records (ddp_callsite)" in other.stderr


def test_per_source_checks_still_find_missing_and_drift(merged_run: Path) -> None:
    """Held to DDP and FSDP2 together, the DDP traces miss every FSDP2-only entry, and
    the entries both ran issue half the ops per rank."""
    report = check(
        merged_run,
        SOURCES["ddp_callsite"],
        "--source",
        "ddp_callsite",
        "--source",
        "fsdp_callsite",
    )
    found = kinds(report)
    assert found.get("missing", 0) > 0 and found.get("count_drift", 0) > 0
    assert found.get("unexpected_op", 0) == 0


def test_a_merged_config_without_records_is_checked_whole_with_a_warning(
    merged_run: Path, tmp_path: Path
) -> None:
    """A merge made before configs recorded the sources' shares (or edited by hand):
    check compares with the whole config, as before, and says why."""
    config = load_config(merged_run / "final_combined_instrumentation.yaml")
    del config["meta"]["source_ranks"]
    for entry in config["entries"]:
        del entry["sources"]
    old = tmp_path / "old.yaml"
    old.write_text(dump_config(config))
    report = check(old, SOURCES["ddp_callsite"])
    assert kinds(report).get("count_drift", 0) > 0
    assert "merged config without per-source counts" in report["stderr"]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ("    count: 192\n    sources: {ddp_callsite: x}\n", "entries[0].sources must map"),
        ("    count: 192\n    sources: [1]\n", "entries[0].sources must map"),
    ],
)
def test_bad_source_records_are_refused_in_one_line(
    merged_run: Path, tmp_path: Path, edit: str, message: str
) -> None:
    text = (merged_run / "final_combined_instrumentation.yaml").read_text()
    first = text.index("    count: ")
    end = text.index("\n  #", first)
    bad = tmp_path / "bad.yaml"
    bad.write_text(text[:first] + edit + text[end + 1 :])
    result = invoke("check", "--config", bad, "-i", SOURCES["ddp_callsite"])
    assert result.exit_code == 5, result.stderr
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_bad_source_ranks_are_refused_in_one_line(merged_run: Path, tmp_path: Path) -> None:
    text = (merged_run / "final_combined_instrumentation.yaml").read_text()
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        text.replace("source_ranks: {ddp_callsite: [0, 1]", "source_ranks: {ddp_callsite: [x]")
    )
    result = invoke("check", "--config", bad, "-i", SOURCES["ddp_callsite"])
    assert result.exit_code == 5 and "meta.source_ranks must map" in result.stderr


def test_a_filtered_merged_config_checks_each_of_its_sources_cleanly(tmp_path: Path) -> None:
    """``--basic``: the run directory stands for the filtered merged config, which
    keeps each entry's record of its sources."""
    run = make_run(tmp_path, *SOURCES.values(), extra=("--basic",))
    for source, traces in SOURCES.items():
        report = check(run, traces, strict=True)
        assert report["config"].endswith("final_combined_filtered_instrumentation.yaml")
        assert report["violations"] == [], (source, kinds(report))


def test_a_record_that_does_not_add_up_is_not_used(merged_run: Path, tmp_path: Path) -> None:
    """Shares carried unread by another tool's merge no longer sum to the count: check
    compares with the whole config (and says so) rather than with a wrong share."""
    config = load_config(merged_run / "final_combined_instrumentation.yaml")
    config["entries"][0]["count"] += 1
    stale = tmp_path / "stale.yaml"
    stale.write_text(dump_config(config))
    report = check(stale, SOURCES["ddp_callsite"])
    assert kinds(report).get("count_drift", 0) > 0
    assert "merged config without per-source counts" in report["stderr"]


def test_a_missing_input_is_named_once(tmp_path: Path) -> None:
    """``opguard: error: nope.json: no such file`` (once ``nope.json: nope.json: ...``)."""
    run = make_run(tmp_path, SOURCES["ddp_callsite"])
    result = invoke("check", "--config", run, "-i", str(tmp_path / "nope.json"))
    assert result.exit_code != 0
    assert result.stderr.strip().splitlines()[-1] == (
        f"opguard: error: {tmp_path / 'nope.json'}: no such file"
    )


def _branching_job(folder: Path, rank1_branch: str | None) -> str:
    """Two ranks of a loop (4 steps) whose ``metrics`` calls ``log_mean`` on rank 0 and
    ``rank1_branch`` on rank 1 (None: rank 1 skips ``metrics``)."""
    folder.mkdir()
    for rank, branch in ((0, "log_mean"), (1, rank1_branch)):
        sites = [([("job", "main"), ("job", "train")], None, "aten::mm", 40)]
        if branch is not None:
            sites.append(([("job", "main"), ("job", "metrics"), ("job", branch)], None,
                          "aten::mean", 4))  # fmt: skip
        write(folder / f"as_callsite_rank{rank}.json",
              trace_doc(sites, rank=rank, world_size=2, steps=4, phase="loop"))  # fmt: skip
    return str(folder / "as_callsite_rank*.json")


def test_ranks_taking_different_branches_are_not_missing(tmp_path: Path) -> None:
    """Each rank's own tree folds its one-child chain (``metrics → log_max``) that the
    combined tree keeps: check of a config's own traces gave three ``missing`` errors
    (``log_max [metrics]`` "never ran" on the rank that ran it). Rank 1 skipping
    ``metrics`` is rank 1's: both functions its loop ran in every step, though rank 0
    still runs ``metrics``."""
    own = _branching_job(tmp_path / "own", "log_max")
    run = make_run(tmp_path, own)
    report = check(run, own)
    assert report["violations"] == []
    skipped = check(run, _branching_job(tmp_path / "skipped", None), expect=1)
    assert {(v["kind"], v["target"], tuple(v["ranks"])) for v in skipped["violations"]} == {
        ("missing", "job:log_max", (1,)),
        ("missing", "job:metrics", (1,)),
    }


def _logging_job(folder: Path, rank0: int, rank1: int) -> str:
    """Two ranks of a 4-step loop whose ``log_stats`` issues ``rank0`` ops a step on
    rank 0 and ``rank1`` on rank 1."""
    folder.mkdir()
    for rank, ops in ((0, rank0), (1, rank1)):
        sites = [([("job", "main"), ("job", "train")], None, "aten::mm", 40),
                 ([("job", "main"), ("job", "log_stats")], None, "aten::add", 4 * ops)]  # fmt: skip
        write(folder / f"lg_callsite_rank{rank}.json",
              trace_doc(sites, rank=rank, world_size=2, steps=4, phase="loop"))  # fmt: skip
    return str(folder / "lg_callsite_rank*.json")


def test_a_rank_that_does_more_than_the_others_does_not_drift_from_itself(
    tmp_path: Path,
) -> None:
    """A config holds an entry's count over its ranks: rank 0 (3 ops a step) and rank 1
    (1) each drifted from the average (2) on the config's own traces, ±50 %."""
    own = _logging_job(tmp_path / "own", 3, 1)
    run = make_run(tmp_path, own)
    assert check(run, own)["violations"] == []
    doubled = check(run, _logging_job(tmp_path / "doubled", 6, 2))
    drifted = {(v["target"], tuple(v["ranks"])) for v in doubled["violations"]}
    assert ("job:log_stats", (0,)) in drifted  # 6 against 2; rank 1's 2 is the average
    assert {v["kind"] for v in doubled["violations"]} == {"count_drift"}


def _metric_job(folder: Path, *exp: int) -> str:
    """Two ranks of a 4-step loop whose ``metrics`` reads the loss on every rank and
    computes ``exp[rank]`` more ops a step on each rank (``if rank == 0: ...`` where
    only rank 0's is non-zero)."""
    folder.mkdir()
    for rank in (0, 1):
        metrics = [("job", "main"), ("job", "metrics")]
        sites = [([("job", "main"), ("job", "train")], None, "aten::mm", 40),
                 (metrics, None, "aten::_local_scalar_dense", 4)]  # fmt: skip
        if exp[rank]:
            sites.append((metrics, None, "aten::exp", 4 * exp[rank]))
        write(folder / f"mt_callsite_rank{rank}.json",
              trace_doc(sites, rank=rank, world_size=2, steps=4, phase="loop"))  # fmt: skip
    return str(folder / "mt_callsite_rank*.json")


def _errors(report: dict[str, Any]) -> set[tuple[str, str, str | None, tuple[int, ...]]]:
    return {(v["kind"], v["target"], v.get("op"), tuple(v["ranks"]))
            for v in report["violations"] if v["severity"] == "error"}  # fmt: skip


def _without_op_ranks(run: Path, folder: Path) -> Path:
    """``run``'s config as a version-5 config (which ranks ran an op not recorded)."""
    config = load_config(next(run.glob("*_instrumentation.yaml")))
    config["version"] = 5
    del config["meta"]["op_ranks"]
    for entry in config["entries"]:
        entry.pop("op_ranks", None)
    path = folder / "v5_instrumentation.yaml"
    path.write_text(dump_config(config))
    return path


def test_an_op_only_one_rank_runs_is_not_missing_on_the_others(tmp_path: Path) -> None:
    """An op rank 0 alone runs inside a function every rank runs (``aten::exp`` in
    ``metrics``, 1 a step on average over the two ranks) was a ``missing_op`` error on
    rank 1 of the config's own traces. The config records which ranks ran it
    (``op_ranks``, version 6): held to rank 0 alone, at rank 0's 2 a step; a config
    that does not record it judges by the job (guard.md, "One view of the job")."""
    own = _metric_job(tmp_path / "own", 2, 0)
    run = make_run(tmp_path, own)
    config = load_config(next(run.glob("*_instrumentation.yaml")))
    metrics = next(e for e in config["entries"] if e["target"] == "job:metrics")
    assert metrics["op_ranks"] == {"aten::exp": [0]} and config["meta"]["op_ranks"] is True
    assert check(run, own)["violations"] == []
    removed = check(run, _metric_job(tmp_path / "removed", 0, 0), expect=1)
    assert ("missing_op", "job:metrics", "aten::exp", (0,)) in _errors(removed)
    assert not [v for v in removed["violations"] if 1 in v["ranks"]]
    # without the record: the average over both ranks, so both are named
    old = _without_op_ranks(run, tmp_path)
    assert check(old, own)["violations"] == []
    removed = check(old, _metric_job(tmp_path / "removed_old", 0, 0), expect=1)
    assert ("missing_op", "job:metrics", "aten::exp", (0, 1)) in _errors(removed)


def test_an_op_one_rank_stops_running_is_missing_on_that_rank(tmp_path: Path) -> None:
    """Both ranks ran ``aten::exp`` every step; rank 1 stops, rank 0 goes on. With
    ``op_ranks`` recorded that is rank 1's ``missing_op`` error (the job as a whole
    still ran the op, which is all a config without the record can see: it keeps
    nothing), and a rank that stops running an op only it ran is one too."""
    own = _metric_job(tmp_path / "own", 1, 1)
    run = make_run(tmp_path, own)
    assert check(run, own)["violations"] == []
    stopped = check(run, _metric_job(tmp_path / "stopped", 1, 0), expect=1)
    assert _errors(stopped) == {
        ("missing_op", target, "aten::exp", (1,)) for target in ("job:main", "job:metrics")
    }
    message = next(v["message"] for v in stopped["violations"] if v["kind"] == "missing_op")
    assert message.endswith("the config's loop ran it 1x a step")
    assert check(_without_op_ranks(run, tmp_path), _metric_job(tmp_path / "old", 1, 0))[
        "violations"
    ] == [v for v in stopped["violations"] if v["severity"] != "error"]
    # an op rank 0 alone ran: named with its rank, held to its count on that rank
    alone = make_run(tmp_path, _metric_job(tmp_path / "alone", 1, 0))
    gone = check(alone, _metric_job(tmp_path / "gone", 0, 0), expect=1)
    (item,) = [v for v in gone["violations"] if v["kind"] == "missing_op" and v["context"]]
    assert item["ranks"] == [0] and item["message"].endswith("1x a step on rank(s) 0")


def test_a_merged_config_holds_a_source_to_its_share_where_ops_ran_on_some_ranks(
    tmp_path: Path,
) -> None:
    """Two sources share ``metrics``; in one, rank 0 alone computes ``aten::exp`` there.
    A source's share of the merged entry is its count, not its ops (the merge does
    not split ``ops`` per source), so a rank's own share cannot be read from which
    ranks ran which op: each source checks clean against the merged config."""
    logs = _metric_job(tmp_path / "logs", 2, 0)
    folder = tmp_path / "plain"
    folder.mkdir()
    for rank in (0, 1):
        metrics = [("job", "main"), ("job", "metrics")]
        sites = [([("job", "main"), ("job", "train")], None, "aten::mm", 40),
                 (metrics, None, "aten::_local_scalar_dense", 4)]  # fmt: skip
        write(folder / f"pl_callsite_rank{rank}.json",
              trace_doc(sites, rank=rank, world_size=2, steps=4, phase="loop"))  # fmt: skip
    plain = str(folder / "pl_callsite_rank*.json")
    run = make_run(tmp_path, logs, plain)
    final = run / "final_combined_instrumentation.yaml"
    merged = load_config(final)
    (metrics,) = [e for e in merged["entries"] if e["target"] == "job:metrics"]
    assert metrics["op_ranks"] == {"aten::exp": [0]} and len(metrics["sources"]) == 2
    for source in (logs, plain):
        assert check(final, source, strict=True)["violations"] == [], source
    # rank 1 of the plain source reads the loss three times as often: rank 1's drift
    # alone (rank 0 was held to rank 0's exp of the other source)
    changed = tmp_path / "changed"
    changed.mkdir()
    for rank in (0, 1):
        sites = [([("job", "main"), ("job", "train")], None, "aten::mm", 40),
                 ([("job", "main"), ("job", "metrics")], None, "aten::_local_scalar_dense",
                  12 if rank else 4)]  # fmt: skip
        write(changed / f"pl_callsite_rank{rank}.json",
              trace_doc(sites, rank=rank, world_size=2, steps=4, phase="loop"))  # fmt: skip
    report = check(final, str(changed / "pl_callsite_rank*.json"))
    drifted = {(v["target"], tuple(v["ranks"])) for v in report["violations"]}
    assert ("job:metrics", (1,)) in drifted and ("job:metrics", (0,)) not in drifted, drifted


def test_an_op_a_rank_pruned_elsewhere_in_its_own_tree_is_not_missing(tmp_path: Path) -> None:
    """Rank 0 does five times rank 1's work, so its own tree's threshold (a fraction of
    its ops) prunes ``main → Q → A → f``, where ``aten::exp`` runs, which the combined
    tree (the config's, and check's combined view) keeps: ``A [main]`` and ``f [A]``
    of rank 0's own config lack ``exp``, though rank 0 ran it there. The combined view
    records which ranks ran it (``op_ranks``), so an unchanged rerun is no
    ``missing_op``; a rank 0 that stops running it still is."""
    main = ("job", "main")

    def sites(big: int, exp: bool = True) -> list[Any]:
        return [([main, ("job", "train")], None, "aten::mm", big),
                ([main, ("job", "P"), ("job", "A")], None, "aten::add", 8),
                ([main, ("job", "P"), ("job", "A"), ("job", "f")], None, "aten::mm", 1000),
                ([main, ("job", "Q"), ("job", "A")], None, "aten::add", 8),
                *([([main, ("job", "Q"), ("job", "A"), ("job", "f")], None, "aten::exp", 64)]
                  if exp else [])]  # fmt: skip

    def job(folder: Path, exp0: bool = True) -> str:
        folder.mkdir()
        for rank, doc in enumerate([sites(100000, exp0), sites(20000)]):
            write(folder / f"pr_callsite_rank{rank}.json",
                  trace_doc(doc, rank=rank, world_size=2, steps=4, phase="loop"))  # fmt: skip
        return str(folder / "pr_callsite_rank*.json")

    own = job(tmp_path / "own")
    run = make_run(tmp_path, own)
    assert check(run, own)["violations"] == []
    stopped = check(run, job(tmp_path / "stopped", exp0=False), expect=1)
    assert ("missing_op", "job:f", "aten::exp", (0,)) in _errors(stopped)


def test_a_source_of_a_merged_config_is_held_to_its_own_share(tmp_path: Path) -> None:
    """A merged config of ``a`` (2 ranks, rank 0 logs: ``exp`` in ``metrics``) and
    ``b`` (4 ranks, no logging): ``metrics`` is both sources', its ``ops`` and
    ``op_ranks`` the sum's. ``b``'s ranks doubling their reads is +100% on every rank,
    not rank 0 held to ``a``'s logging (it read -20%, the config 2.5 a step)."""
    metrics = [("job", "main"), ("job", "metrics")]

    def job(folder: Path, name: str, exp: list[int], reads: int = 4) -> str:
        folder.mkdir()
        for rank, extra in enumerate(exp):
            sites = [([("job", "main"), ("job", "train")], None, "aten::mm", 40),
                     (metrics, None, "aten::_local_scalar_dense", reads)]  # fmt: skip
            if extra:
                sites.append((metrics, None, "aten::exp", 4 * extra))
            doc = trace_doc(sites, rank=rank, world_size=len(exp), steps=4, phase="loop")
            write(folder / f"{name}_callsite_rank{rank}.json", doc)
        return str(folder / f"{name}_callsite_rank*.json")

    a, b = job(tmp_path / "a", "a", [2, 0]), job(tmp_path / "b", "b", [0, 0, 0, 0])
    run = make_run(tmp_path, a, b)
    assert check(run, b, "--source", "b_callsite")["violations"] == []
    doubled = check(run, job(tmp_path / "b2", "b", [0, 0, 0, 0], 8), "--source", "b_callsite")
    [drift] = [v for v in doubled["violations"] if v["kind"] == "count_drift"]
    assert drift["ranks"] == [0, 1, 2, 3] and "the config 1 (+100%" in drift["message"]
