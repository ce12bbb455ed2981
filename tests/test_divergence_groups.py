"""Divergence files a person can read (format version 4): findings grouped by kind and
deviating-rank set, each frame and stack written once, and a majority that is one
(a strict majority of the ranks, else "no majority" with the distribution); through
``opguard run`` and the public readers."""

from __future__ import annotations

import json
import random
from array import array
from collections.abc import Callable
from itertools import compress
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from opguard_core.combine.accumulator import TraceAccumulator
from opguard_core.formats.divergence import (
    DIVERGENCE_VERSION,
    encode_divergence,
    load_divergence,
    render_log,
)
from opguard_core.formats.trace import Callsite, PerRank, decode_trace, list_ranks
from opguard_core.model import RunOptions
from opguard_plugins.stages import divergence, sorted_runs
from opguard_plugins.view.report import read_divergence
from tests.builders import trace_doc
from tests.compiled import compiled, needs

RUNS = compiled("opguard_plugins.stages._runs")

MAIN = [("app", "main"), ("app", "step")]


def write_job(folder: Path, per_rank: list[list[tuple[str, int]]]) -> str:
    """One rank file per entry of ``per_rank``: (function under app:step, count of
    its all_reduce) pairs; version-1 traces (no collective sequence), so collectives
    are compared by count per callsite. Returns the input pattern."""
    folder.mkdir(exist_ok=True)
    for rank, sites in enumerate(per_rank):
        doc = trace_doc(
            [
                ([*MAIN, ("app", name)], "torch.distributed.all_reduce", "c10d::allreduce_", n)
                for name, n in sites
                if n > 0
            ]
            + [(MAIN, None, "aten::mm", 10)],
            rank=rank,
        )
        (folder / f"job_callsite_rank{rank}.json").write_text(json.dumps(doc))
    return str(folder / "job_callsite_rank*.json")


def run_job(
    opguard: Callable[..., Any], folder: Path, per_rank: list[list[tuple[str, int]]]
) -> tuple[dict[str, Any], str, dict[str, Any]]:
    """Run the job with --fail-on-divergence (exit 4: every job here has an error);
    the divergence document as read back, its log and the raw document."""
    run = opguard("run", "-i", write_job(folder, per_rank), "--fail-on-divergence", expect=4)
    path = run.run_dir / "job_callsite_divergence.json"
    raw = msgspec.json.decode(path.read_bytes())
    summary = json.loads(run.read("pipeline_summary.json"))
    (stage,) = [s for s in summary["stages"] if s["stage"] == "divergence"]
    assert stage["counts"] == raw["meta"]["counts"]  # findings, errors, …, groups
    return load_divergence(path), run.read("job_callsite_divergence.log"), raw


def mismatches(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [f for f in doc["findings"] if f["kind"] == "collective_mismatch"]


def test_two_ranks_that_disagree_have_no_majority(
    opguard: Callable[..., Any], tmp_path: Path
) -> None:
    doc, log, _ = run_job(opguard, tmp_path / "job", [[("sync", 2)], [("sync", 3)]])
    (f,) = mismatches(doc)
    assert f["majority"] is False
    assert (f["ranks"], f["expected"], f["counts"]) == ([1], 2, {"1": 3})  # rank 0: reference
    assert f["distribution"] == [[2, 1], [3, 1]]
    assert "most ranks" not in f["message"] and "no majority (2x: 1 rank(s), 3x: 1" in f["message"]
    assert "against rank 0, the lowest (2x), rank(s) 1 differ (rank 1: 3)" in f["message"]
    assert "most ranks" not in log and "no majority" in log


def test_four_ranks_split_two_and_two_have_no_majority(
    opguard: Callable[..., Any], tmp_path: Path
) -> None:
    doc, log, _ = run_job(
        opguard, tmp_path / "job", [[("sync", 5)], [("sync", 7)], [("sync", 5)], [("sync", 7)]]
    )
    (f,) = mismatches(doc)
    assert f["majority"] is False
    assert (f["ranks"], f["expected"], f["counts"]) == ([1, 3], 5, {"1": 7, "3": 7})
    assert f["distribution"] == [[5, 2], [7, 2]]
    assert "no majority (5x: 2 rank(s), 7x: 2 rank(s))" in f["message"]
    assert "most ranks" not in log


@pytest.mark.parametrize(
    ("counts", "distribution"),
    [([1, 2, 3], [[1, 1], [2, 1], [3, 1]]), ([4, 4, 6, 6, 9], [[4, 2], [6, 2], [9, 1]])],
)
def test_three_ways_have_no_majority(
    opguard: Callable[..., Any], tmp_path: Path, counts: list[int], distribution: list[list[int]]
) -> None:
    doc, _, _ = run_job(opguard, tmp_path / "job", [[("sync", n)] for n in counts])
    (f,) = mismatches(doc)
    assert f["majority"] is False and f["distribution"] == distribution
    assert f["expected"] == counts[0]  # the lowest rank is the reference
    assert f["ranks"] == [r for r, n in enumerate(counts) if n != counts[0]]
    assert f"no majority ({distribution[0][0]}x: {distribution[0][1]} rank(s)" in f["message"]


def test_a_strict_majority_is_named_as_one(opguard: Callable[..., Any], tmp_path: Path) -> None:
    """3 of 5 ranks hold 4: the majority, even though rank 0 does not."""
    doc, log, _ = run_job(opguard, tmp_path / "job", [[("sync", n)] for n in [6, 4, 4, 9, 4]])
    (f,) = mismatches(doc)
    assert f["majority"] is True and "distribution" not in f
    assert (f["ranks"], f["expected"], f["counts"]) == ([0, 3], 4, {"0": 6, "3": 9})
    assert "issued 4x on 3 of 5 ranks (a majority)" in f["message"]
    assert "counts: rank 0: 6, rank 3: 9 (expected 4)" in log


def test_findings_are_grouped_and_each_stack_written_once(
    opguard: Callable[..., Any], tmp_path: Path
) -> None:
    """Rank 3 issues one all_reduce more in each of 12 functions: one group of 12
    findings (collective_mismatch, rank 3), written once, its first stack once; the
    reader gives back every finding with its counts."""
    names = [f"sync{i:02d}" for i in range(12)]
    per_rank = [[(name, 2 + (rank == 3) * (i + 1)) for i, name in enumerate(names)]
                for rank in range(4)]  # fmt: skip
    doc, log, raw = run_job(opguard, tmp_path / "job", per_rank)
    assert raw["version"] == DIVERGENCE_VERSION == 4 and "findings" not in raw
    (group,) = [g for g in raw["groups"] if g["kind"] == "collective_mismatch"]
    assert (group["ranks"], group["count"], group["severity"]) == ([3], 12, "error")
    assert group["common"]["expected"] == 2 and group["common"]["majority"] is True
    assert len(raw["frames"]) == len(set(raw["frames"]))
    stacks = [tuple(s) for s in raw["stacks"]]
    assert len(stacks) == len(set(stacks))
    assert raw["meta"]["counts"]["groups"] == len(raw["groups"])
    assert raw["meta"]["counts"]["collective_mismatch"] == 12
    found = mismatches(doc)
    assert [f["target"] for f in found] == [f"app:{n}" for n in reversed(names)]  # largest first
    assert [f["counts"] for f in found] == [{"3": 2 + i + 1} for i in reversed(range(12))]
    assert found[0]["stack"] == ["app:main", "app:step", "app:sync11"]
    assert all(f["stack"] == [] for f in found[1:])  # their callsite names it
    assert all(isinstance(f["callsite"], int) for f in found)
    # the log: the group once, its largest findings listed, one stack
    assert log.count("ERROR collective_mismatch") == 1
    assert "12 findings" in log and "… 2 more" in log
    assert log.count("stack (outermost first):") == len(raw["groups"])


def test_round_trip_and_older_versions(tmp_path: Path) -> None:
    """What encode_divergence writes, load_divergence reads back (the first finding of
    a group whole, the others with their callsite for a stack); version 3 still
    reads, and the report groups both."""
    base = {"severity": "error", "kind": "collective_mismatch", "op": "c10d::allreduce_",
            "api": None, "stream": "comm", "expected": 1, "majority": True}  # fmt: skip
    findings = [
        {**base, "ranks": [2], "target": f"app:f{i}", "counts": {"2": 1 + i}, "size": i,
         "callsite": i, "context": ["app:main"], "stack": ["app:main", f"app:f{i}"],
         "message": f"m{i}"}
        for i in range(1, 4)
    ] + [{"kind": "rank_specific", "severity": "warning", "ranks": [0], "missing": [1, 2],
          "target": "app:log", "ops": 5, "size": 5, "context": [], "stack": ["app:log"],
          "callsite": 9, "message": "only rank 0"}]  # fmt: skip
    meta = {"source": "x", "ranks": [0, 1, 2], "skew": 0.25}
    path = tmp_path / "x_divergence.json"
    path.write_bytes(encode_divergence(meta, findings))
    back = load_divergence(path)["findings"]
    assert [f["target"] for f in back] == ["app:f3", "app:f2", "app:f1", "app:log"]
    assert back[0] == {**findings[2]}  # the group's first: whole
    assert back[1]["stack"] == [] and back[1]["callsite"] == 2 and back[1]["counts"] == {"2": 3}
    assert back[1]["message"] == "m3"  # the group's message
    assert back[3] == findings[3]
    view = read_divergence(path)
    assert view is not None and (view["findings"], view["ngroups"], view["errors"]) == (4, 2, 3)
    assert view["groups"][0]["target"] == "app:f3 (and 2 more)"
    old = tmp_path / "old_divergence.json"
    old.write_text(
        json.dumps(
            {"format": "opguard-divergence", "version": 3, "meta": meta, "findings": findings}
        )
    )
    assert load_divergence(old)["findings"] == findings
    view = read_divergence(old)
    assert view is not None and view["findings"] == 4
    # the log of the same findings: two groups, errors first
    log = render_log(meta, findings)
    assert log.index("ERROR collective_mismatch [finding group 1]") < log.index(
        "WARNING rank_specific"
    )


def test_a_malformed_version_4_document_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "bad_divergence.json"
    doc = {"format": "opguard-divergence", "version": 4, "meta": {}, "frames": [],
           "stacks": [], "groups": [{"kind": "x", "severity": "error", "ranks": [1],
           "fields": ["stack"], "findings": [[7]], "message": "m"}]}  # fmt: skip
    path.write_text(json.dumps(doc))
    with pytest.raises(Exception, match="stack 7 is not in stacks"):
        load_divergence(path)
    view = read_divergence(path)
    assert view is not None and "malformed" in view["note"]


def random_job(rnd: random.Random) -> list[dict[str, Any]]:
    """Rank files (version 1) of a job whose counts differ: up to 12 ranks (more
    than MAX_DISTINCT distinct counts: overflowed histograms), not numbered 0..N-1,
    callsites some ranks never ran, collectives among them."""
    ranks = sorted(rnd.sample(range(20), rnd.randint(2, 12)))
    functions = [("app", f"f{i}") for i in range(rnd.randint(1, 6))]
    sites = [
        (rnd.sample(functions, rnd.randint(1, len(functions))), rnd.choice(OPS),
         [rnd.choice([0, rnd.randint(1, 30)]) if rnd.random() < 0.3 else rnd.randint(1, 30)
          for _ in ranks])
        for _ in range(rnd.randint(1, 12))
    ]  # fmt: skip
    docs = []
    for at, rank in enumerate(ranks):
        own = [([("app", "main"), *stack], None, op, counts[at])
               for stack, op, counts in sites if counts[at] > 0]  # fmt: skip
        docs.append(trace_doc(own or [([("app", "main")], None, "aten::mm", 1)], rank=rank))
    return docs


OPS = ["aten::mm", "aten::add", "c10d::allreduce_"]


@needs(RUNS)
@pytest.mark.parametrize("middle", [2**53 + 1, 2**53 - 3, 2**60 + 7])
def test_the_compiled_skew_fold_rounds_huge_shares_as_python(middle: int) -> None:
    """An overflowed histogram's middle ranks share ``(count - min - max) / rest``: past
    2**53 the C division rounded twice (the numerator, then the quotient)."""
    assert RUNS is not None
    low, high = 1, middle + 4
    stats = SimpleNamespace(min=low, max=high, min_ranks=[0], max_ranks=[4], counts=None)
    site = SimpleNamespace(count=3 * middle + low + high + 1, ranks=None, per_rank=stats)
    one = array("i", [0]).tobytes()
    args = ([site], one, one, b"\0", 1, [0, 1, 2, 3, 4], 0.0)
    assert RUNS.skew_fold(*args) == divergence.py_skew_fold(*args)  # type: ignore[arg-type]


@needs(RUNS)
def test_the_compiled_skew_fold_is_the_python_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """``skew_fold`` (C) gives what ``py_skew_fold`` gives, bit for bit, and so the
    same count_skew findings (C or Python in use), on random jobs; so do the pass over
    the stacks (``site_summary``, ``site_touching``, ``site_visible_frames``) for every
    kind."""
    native = RUNS
    assert native is not None
    rnd = random.Random(31)
    compared = 0
    kinds: set[str] = set()
    for _ in range(150):
        accumulator = TraceAccumulator()
        for doc in random_job(rnd):
            rank = doc["meta"]["rank"]
            accumulator.add(decode_trace(json.dumps(doc).encode(), f"x_rank{rank}.json"))
        trace = accumulator.result()
        stacks = divergence._Stacks(trace, RunOptions())
        function = array("i", stacks.function).tobytes()
        functions = len(stacks.function_names)
        args = (trace.callsites, stacks.callers, function, stacks.collective, functions,
                trace.ranks, 0.25)  # fmt: skip
        folded = native.skew_fold(*args)
        assert folded == divergence.py_skew_fold(*args)
        # the callsites but the collectives alone, none skipped: the same totals
        keep = [not c for c in stacks.collective]
        alone = (list(compress(trace.callsites, keep)),
                 array("i", compress(stacks.caller, keep)).tobytes(), function,
                 bytes(sum(keep)), functions, trace.ranks, 0.25)  # fmt: skip
        ops, full, _, found = divergence.py_skew_fold(*alone)
        assert (ops, full, found) == (folded[0], folded[1], folded[3])
        monkeypatch.setattr(divergence, "skew_fold", native.skew_fold)
        with_c = divergence.find_divergence(trace, RunOptions())
        monkeypatch.setattr(divergence, "skew_fold", divergence.py_skew_fold)
        monkeypatch.setattr(divergence, "site_summary", sorted_runs.py_site_summary)
        monkeypatch.setattr(
            divergence, "collective_histograms", divergence.py_collective_histograms
        )
        monkeypatch.setattr(divergence, "skew_findings", divergence.py_skew_findings)
        monkeypatch.setattr(divergence, "site_touching", sorted_runs.py_site_touching)
        monkeypatch.setattr(divergence, "visible_frames", sorted_runs.py_visible_frames)
        assert divergence.find_divergence(trace, RunOptions()) == with_c
        monkeypatch.undo()
        compared += bool(with_c)
        kinds.update(f["kind"] for f in with_c)
    assert compared > 50  # most jobs diverge
    assert {"rank_specific", "count_skew", "collective_mismatch"} <= kinds
    # a callsite of ranks the trace does not have: one line, no crash
    site = trace_doc([(MAIN, None, "aten::mm", 3)], rank=7)["callsites"][0]
    lone = msgspec.convert({**site, "stack": [0], "ranks": [7], "role": "compute"}, Callsite)
    one = array("i", [0]).tobytes()
    with pytest.raises(ValueError, match="rank 7 is not one of the trace's"):
        native.skew_fold([lone], one, one, b"\0", 1, [0, 1], 0.25)


def _general_path_only(sites: Any, indices: list[int], ranks: Any, names: Any) -> list[None]:
    return [None] * len(indices)


def test_collective_counts_read_at_once_are_what_the_general_path_finds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``collective_histograms`` (C where built) reads a collective callsite's counts
    at once where they are a clean partition of the ranks: the findings are those of
    the general path (site_histogram, majority, distribution) on every random job."""
    rnd = random.Random(7)
    compared = 0
    for _ in range(120):
        accumulator = TraceAccumulator()
        for doc in random_job(rnd):
            rank = doc["meta"]["rank"]
            accumulator.add(decode_trace(json.dumps(doc).encode(), f"x_rank{rank}.json"))
        trace = accumulator.result()
        fast = divergence.find_divergence(trace, RunOptions())
        monkeypatch.setattr(divergence, "collective_histograms", _general_path_only)
        assert divergence.find_divergence(trace, RunOptions()) == fast
        monkeypatch.undo()
        compared += any(f["kind"] == "collective_mismatch" for f in fast)
    assert compared > 20


@st.composite
def collective_sites(draw: st.DrawFn) -> tuple[list[Any], list[int], list[str]]:
    """Callsites with per-rank counts, most a clean partition of the trace's ranks
    (not numbered 0..N-1, not sorted), some not: a rank twice or outside, a count
    twice, an empty list, ``ranks`` that are not the ranks counted."""
    ranks = draw(st.lists(st.integers(0, 40), min_size=2, max_size=12, unique=True))
    sites: list[Any] = []
    for _ in range(draw(st.integers(0, 8))):
        present = draw(st.none() | st.lists(st.sampled_from(ranks), min_size=1, unique=True))
        holders = list(ranks if present is None else present)
        pairs: list[tuple[int, list[int]]] = []
        values = draw(st.lists(st.integers(1, 9), min_size=1, max_size=5, unique=True))
        for number, value in enumerate(values):
            take = holders if number == len(values) - 1 else holders[: draw(st.integers(0, 3))]
            holders = holders[len(take) :]
            if take:
                pairs.append((value, take))
        if draw(st.integers(0, 5)) == 0:  # spoil it
            spoil = draw(st.sampled_from(["twice", "outside", "count", "empty", "present"]))
            if spoil == "twice":
                pairs.append((99, [pairs[0][1][0]]))
            elif spoil == "outside":
                pairs.append((98, [41]))
            elif spoil == "count":
                pairs.append((pairs[0][0], [41]))
            elif spoil == "empty":
                pairs.append((97, []))
            else:
                present = [*(present or ranks), 41]
        low = min(pairs, key=lambda p: p[0])
        high = max(pairs, key=lambda p: p[0])
        stats = PerRank(min=low[0], min_ranks=low[1], max=high[0], max_ranks=high[1],
                        counts=sorted(pairs))  # fmt: skip
        sites.append(Callsite(stack=(0,), op="c10d::allreduce_", count=1, ranks=present,
                              per_rank=stats))  # fmt: skip
    sites.append(Callsite(stack=(0,), op="c10d::allreduce_", count=1))  # no per_rank
    indices = draw(st.lists(st.integers(0, len(sites) - 1), max_size=12))
    return sites, indices, ranks


@needs(RUNS)
@settings(max_examples=400, deadline=None)
@given(collective_sites())
def test_the_compiled_collective_histograms_are_the_python_ones(
    drawn: tuple[list[Any], list[int], list[int]],
) -> None:
    """``collective_histograms`` (C) gives what ``py_collective_histograms`` gives:
    the same reading of a clean partition, False for one count, None (the general
    path) for anything else."""
    assert RUNS is not None
    sites, indices, ranks = drawn
    names = list(map(str, ranks))
    got = RUNS.collective_histograms(sites, indices, ranks, names)
    assert got == divergence.py_collective_histograms(sites, indices, ranks, names)
    assert [type(g) for g in got] == [
        type(g) for g in divergence.py_collective_histograms(sites, indices, ranks, names)
    ]


@needs(RUNS)
def test_the_compiled_skew_findings_are_the_python_ones() -> None:
    """``skew_findings`` (C) builds the findings ``py_skew_findings`` builds: a
    function with no frame (``<root>``, no example callsite), more than eight straying
    ranks, medians and ops that are not whole numbers, a stack shorter than its
    context, an example whose stack shows no visible frame."""
    assert RUNS is not None
    ranks = [3, 5, 7, 9, 11, 13, 15, 17, 19, 21]
    names = [str(r) for r in ranks]
    whole = array("d", [float(v) for v in range(10)]).tobytes()
    half = array("d", [v + 0.5 for v in range(10)]).tobytes()
    third = array("d", [v / 3 for v in range(10)]).tobytes()
    kept = [
        (-1, 3, 4.0, whole, [0, 9]),  # <root>: no example callsite
        (0, 0, 2.5, half, list(range(10))),  # every rank strays, medians of halves
        (1, 1, 1.0 / 3, third, [1, 5]),  # thirds: rounded
        (2, 2, 7.0, whole, [8]),  # an example with no visible frame
    ]
    site_indices = [None, 4, 9, 11]
    visible = [[0, 1, 2, 3, 4], [2], []]
    callers = [3, 0, None]
    function_names = ["a.f", "b.g", "c.h"]
    frame_names = [f"m.f{i}" for i in range(5)]
    args = (kept, site_indices, visible, callers, function_names, frame_names, ranks, names,
            [10, 20, 30, 40], "0.25x", divergence._number, divergence._stray_size,
            list_ranks)  # fmt: skip
    found = RUNS.skew_findings(*args)
    assert found == divergence.py_skew_findings(*args)
    assert [list(f) for f in found] == [list(f) for f in divergence.py_skew_findings(*args)]
    assert found[1]["message"].count("…") == 1  # more than eight ranks
    assert found[2]["expected"] == 0.333 and found[2]["counts"] == {"5": 0.333, "13": 1.667}
    assert (found[0]["stack"], found[3]["stack"]) == ([], [])  # no frame to show
    assert found[1]["stack"] == ["m.f0", "m.f1", "m.f2", "m.f3"]  # down to the function
    assert found[1]["context"] == ["m.f0", "m.f1", "m.f2"]
