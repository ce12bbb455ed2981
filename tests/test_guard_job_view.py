"""``opguard guard`` judges ``count_drift`` and ``missing_op`` by the job as a whole
from every rank's counts, as ``opguard check`` does with its combined view
(docs/guard.md, "One view of the job"): the pieces, without torch. The whole command
on a torchrun job is in tests/test_guard_one_view.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from opguard_core.formats.check import GUARD_FORMAT, guard_report
from opguard_plugins.enforce.guard import job_of, judge_by_job

METRICS = ("job:metrics", ["job:main"])


def _config(exp: int = 8, count: int = 16) -> dict[str, Any]:
    """A 2-rank, 4-step config whose ``metrics`` ran ``exp`` exps and ``count`` ops."""
    return {
        "meta": {"ranks": [0, 1], "sources": ["mt"], "steps": {"mt": 4}},
        "entries": [
            {"target": METRICS[0], "context": METRICS[1], "count": count,
             "ops": {"aten::_local_scalar_dense": count - exp, "aten::exp": exp}},
        ],
    }  # fmt: skip


def _counts(
    rank: int, count: int, ops: list[str], world: int = 2, unknown: int = 0, total: int = 40
) -> dict[str, Any]:
    """A rank's counts; ``unknown``: the ops of an ``unknown_target`` it ran
    (``torch:exp [job:log]``), against its threshold of 2; ``total``: its ops."""
    return {
        "rank": rank,
        "world_size": world,
        "steps": 4,
        "entries": [[METRICS[0], METRICS[1], count, ops]],
        "threshold": 2.0,
        "unknown": [["unknown_target", "torch:exp", ["job:log"], unknown]] if unknown else [],
        "pruned": [],
        "total": total,
    }


def _ran_too_little(counts: dict[str, Any], ops: int) -> dict[str, Any]:
    """``counts`` where the rank ran ``metrics`` (``ops``) too little to keep it."""
    return {**counts, "entries": [], "pruned": [[METRICS[0], METRICS[1], ops]]}


def _report(folder: Path, rank: int, *violations: dict[str, Any]) -> Path:
    items = [
        {"target": METRICS[0], "context": METRICS[1], "ranks": [rank], "rank": rank,
         "count": 1, "stack": [], **v}
        for v in violations
    ]  # fmt: skip
    path = folder / f"guard_report_rank{rank}.json"
    document = guard_report("c.yaml", rank, items, "warn", 1.0, 4, 4, 1)
    path.write_text(json.dumps(document))
    return path


DRIFT = {"kind": "count_drift", "severity": "warning", "message": "drifted"}
MISSING_EXP = {"kind": "missing_op", "severity": "error", "op": "aten::exp", "message": "gone"}


def test_a_job_whose_ranks_do_different_shares_is_clean(tmp_path: Path) -> None:
    """Rank 0: 12 ops with exp, rank 1: 4 without (the config's own job): each rank
    drifted from the average of 8 and rank 1 "never ran" exp; the job agrees."""
    reports = [_report(tmp_path, 0, DRIFT), _report(tmp_path, 1, DRIFT, MISSING_EXP)]
    counts = [_counts(0, 12, ["aten::_local_scalar_dense", "aten::exp"]),
              _counts(1, 4, ["aten::_local_scalar_dense"])]  # fmt: skip
    dropped, why = judge_by_job(reports, counts, _config(), None)
    assert (dropped, why) == (3, None)
    for path in reports:  # rewritten, the totals with them
        document = json.loads(path.read_text())
        assert document["format"] == GUARD_FORMAT
        assert (document["violations"], document["errors"], document["warnings"]) == ([], 0, 0)


def test_what_the_job_shows_is_kept(tmp_path: Path) -> None:
    """exp gone from every rank: missing on both, as check says; the job's count per
    rank halved: drift kept."""
    reports = [_report(tmp_path, r, DRIFT, MISSING_EXP) for r in (0, 1)]
    counts = [_counts(r, 4, ["aten::_local_scalar_dense"]) for r in (0, 1)]
    assert judge_by_job(reports, counts, _config(), None) == (0, None)
    for path in reports:
        document = json.loads(path.read_text())
        assert {v["kind"] for v in document["violations"]} == {"count_drift", "missing_op"}
        assert document["errors"] == 1


def test_without_every_rank_the_ranks_are_judged_alone(tmp_path: Path) -> None:
    """On one node of a multi-node job `opguard guard` sees its node's ranks: no job
    view, each rank's violations stay and the summary says why."""
    reports = [_report(tmp_path, 0, DRIFT), _report(tmp_path, 1, DRIFT, MISSING_EXP)]
    counts = [_counts(0, 12, ["aten::exp"], world=4), _counts(1, 4, [], world=4)]
    dropped, why = judge_by_job(reports, counts, _config(), None)
    assert dropped == 0
    assert why == "the counts of rank(s) 0, 1 of a world of 4 here"
    assert len(json.loads(reports[1].read_text())["violations"]) == 2


def test_counts_of_another_shape_are_not_read(tmp_path: Path) -> None:
    reports = [_report(tmp_path, 0, DRIFT)]
    bad = [{"rank": 0, "world_size": 1, "steps": "4", "entries": [], "threshold": 1, "unknown": []}]
    assert judge_by_job(reports, bad, _config(), None) == (0, "the ranks' counts could not be read")
    assert (
        job_of([{"rank": 0, "world_size": 1, "steps": 4, "entries": [["t", [], "x", []]]}])[0]
        is None
    )


def test_the_job_adds_the_ranks_counts() -> None:
    job, why = job_of([_counts(1, 4, ["b"]), _counts(0, 12, ["a", "b"])])
    assert why is None and job is not None
    assert job["meta"] == {"ranks": [0, 1], "steps": 4}
    [entry] = job["entries"]
    assert (entry["count"], sorted(entry["ops"]), entry["ranks"]) == (16, ["a", "b"], None)
    only_one, _ = job_of([_counts(0, 12, ["a"]), {**_counts(1, 0, []), "entries": []}])
    assert only_one is not None and only_one["entries"][0]["ranks"] == [0]


UNKNOWN = {"kind": "unknown_target", "severity": "warning", "message": "not in the config"}


def test_what_one_rank_runs_is_held_to_the_threshold_of_the_job(tmp_path: Path) -> None:
    """A function only rank 0 runs (its logging): 3 ops are over rank 0's share of the
    config's pruning threshold (2 of 4), so the guard reported it, where the config's
    tree, made from the job's ops added up, pruned it and check said nothing. The job's
    ops against the job's threshold: gone; run on both ranks, kept."""
    counts = [_counts(0, 12, ["aten::exp"], unknown=3), _counts(1, 4, [])]
    reports = [_report(tmp_path, 0, {**UNKNOWN, "target": "torch:exp", "context": ["job:log"]})]
    assert judge_by_job(reports, counts, _config(), None) == (1, None)
    assert json.loads(reports[0].read_text())["violations"] == []
    counts[1] = _counts(1, 4, [], unknown=3)
    reports = [_report(tmp_path, r, {**UNKNOWN, "target": "torch:exp", "context": ["job:log"]})
               for r in (0, 1)]  # fmt: skip
    assert judge_by_job(reports, counts, _config(), None) == (0, None)
    assert all(json.loads(p.read_text())["warnings"] == 1 for p in reports)


TOO_LITTLE = {"kind": "missing", "severity": "warning", "message": "ran too little"}


def test_what_one_rank_ran_too_little_of_is_held_to_the_pruning_floor_of_the_job(
    tmp_path: Path,
) -> None:
    """A config pruned at ``min_fraction`` 0.1; each rank ran 40 ops, so the floor is
    4 on a rank and 8 on the job. Rank 1 ran ``metrics`` 3 times, too little to keep
    it as an entry: a ``missing`` warning on its own. With rank 0's 12 the job ran it
    15 times, over its floor, as check's tree of the job keeps it: dropped. With rank
    0's 4 (kept there, at its floor of 4) the job's 7 are under 8: check prunes it
    too, and the warning stays. A rank that never ran it keeps its own finding."""
    config = _config()
    config["meta"]["settings"] = {"min_count": 1, "min_fraction": 0.1}
    counts = [_counts(0, 12, ["aten::exp"]), _ran_too_little(_counts(1, 0, []), 3)]
    reports = [_report(tmp_path, 1, TOO_LITTLE)]
    assert judge_by_job(reports, counts, config, None) == (1, None)
    assert json.loads(reports[0].read_text())["violations"] == []
    counts[0] = _counts(0, 4, ["aten::exp"])
    reports = [_report(tmp_path, 1, TOO_LITTLE)]
    assert judge_by_job(reports, counts, config, None) == (0, None)
    assert json.loads(reports[0].read_text())["warnings"] == 1
    never = {**TOO_LITTLE, "message": "never ran"}
    counts = [_counts(0, 12, ["aten::exp"]), {**_counts(1, 0, []), "entries": []}]
    reports = [_report(tmp_path, 1, never)]
    assert judge_by_job(reports, counts, config, None) == (0, None)


def test_a_report_that_cannot_be_rewritten_keeps_all_it_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk while a report is rewritten: the report stays as the rank wrote it,
    nothing is counted as left out, and every violation in it is logged."""
    import opguard_plugins.enforce.guard as guard_module

    def full(path: Path, document: dict[str, Any]) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(guard_module, "write_json", full)
    reports = [_report(tmp_path, 0, DRIFT), _report(tmp_path, 1, DRIFT, MISSING_EXP)]
    counts = [_counts(0, 12, ["aten::_local_scalar_dense", "aten::exp"]),
              _counts(1, 4, ["aten::_local_scalar_dense"])]  # fmt: skip
    assert judge_by_job(reports, counts, _config(), None) == (0, None)
    assert [len(json.loads(p.read_text())["violations"]) for p in reports] == [1, 2]
