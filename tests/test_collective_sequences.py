"""Collective sequences: the format (formats.md, "Collective sequences"), combine's
carrying them, and divergence comparing them by position (docs/divergence.md).

Hand-made traces here; the real 2-rank gloo jobs under torchrun are the slow tests at
the end (tests/data/desync/desync_job.py).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from opguard_core.combine.accumulator import TraceAccumulator
from opguard_core.errors import InputError
from opguard_core.formats.collectives import (
    Collectives,
    CollectiveSequence,
    Group,
    Signature,
    StepRecorder,
    StepRun,
    collective_kind,
)
from opguard_core.formats.divergence import load_divergence
from opguard_core.formats.trace import decode_trace, encode_trace, load_trace
from tests.builders import write

REPO = Path(__file__).resolve().parent.parent
DESYNC = REPO / "tests" / "data" / "desync"

WORLD = {"name": "0", "desc": "default_pg", "size": 2, "ranks": [0, 1]}

#: one collective: (step, op, dtype, numel, line); group "0" unless a 6th item names one
Call = tuple[Any, ...]


def rank_doc(
    rank: int,
    calls: list[Call],
    groups: list[dict[str, Any]] | None = None,
    world_size: int = 2,
) -> dict[str, Any]:
    """A version-6 rank file whose collectives are ``calls``, in order."""
    groups = [dict(g) for g in (groups or [WORLD])]
    names = [g["name"] for g in groups]
    frames = [{"file": "job.py", "line": 1, "function": "main", "qualname": "main",
               "module": "job"}]  # fmt: skip
    lines: dict[int, int] = {}
    signatures: list[dict[str, Any]] = []
    sig_ids: dict[str, int] = {}
    steps: list[list[Any]] = []
    counts: dict[tuple[int, str], int] = {}
    for call in calls:
        step, op, dtype, numel, line = call[:5]
        group = names.index(call[5]) if len(call) > 5 else 0
        if line not in lines:
            lines[line] = len(frames)
            frames.append({"file": "job.py", "line": line, "function": "step",
                           "qualname": "step", "module": "job"})  # fmt: skip
        reduce_op = "sum" if "reduce" in op else None
        sig = {"op": op, "group": group, "dtype": dtype, "numel": numel, "shapes": [[numel]],
               "reduce_op": reduce_op, "stack": [0, lines[line]]}  # fmt: skip
        key = json.dumps(sig)
        if key not in sig_ids:
            sig_ids[key] = len(signatures)
            signatures.append(sig)
        if steps and steps[-1][0] == step:
            steps[-1][2].append(sig_ids[key])
        else:
            steps.append([step, step, [sig_ids[key]]])
        counts[(lines[line], op)] = counts.get((lines[line], op), 0) + 1
    callsites = [{"stack": [0, frame], "op": op, "stream": 0, "role": "comm", "count": n}
                 for (frame, op), n in sorted(counts.items())]  # fmt: skip
    callsites.append({"stack": [0], "op": "aten::add", "stream": 0, "role": "compute",
                      "count": 1})  # fmt: skip
    return {
        "format": "opguard-callsites",
        "version": 6,
        "meta": {"rank": rank, "world_size": world_size},
        "frames": frames,
        "callsites": callsites,
        "collectives": {"sequences": [{"ranks": [rank], "groups": groups,
                                       "signatures": signatures, "steps": steps}]},
    }  # fmt: skip


AR = "c10d::allreduce_"


def good(line_a: int = 10, line_b: int = 11, steps: int = 3) -> list[Call]:
    """Each step: all_reduce a (float32, 6) then b (float32, 8)."""
    calls: list[Call] = []
    for step in range(steps):
        calls += [(step, AR, "float32", 6, line_a), (step, AR, "float32", 8, line_b)]
    return calls


def replace_step(calls: list[Call], step: int, new: list[Call]) -> list[Call]:
    return [c for c in calls if c[0] < step] + new + [c for c in calls if c[0] > step]


def run_docs(
    opguard: Callable[..., Any], tmp_path: Path, *docs: dict[str, Any], expect: int = 4
) -> dict[str, Any]:
    for doc in docs:
        write(tmp_path / f"job_rank{doc['meta']['rank']}.json", doc)
    run = opguard("run", "-i", str(tmp_path / "job_rank*.json"), "--fail-on-divergence",
                  expect=expect)  # fmt: skip
    result: dict[str, Any] = load_divergence(run.run_dir / "job_divergence.json")
    result["log"] = run.read("job_divergence.log")
    result["run_dir"] = run.run_dir
    return result


def collective_findings(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [f for f in doc["findings"] if f["kind"].startswith("collective_")]


# ----------------------------------------------------------------------------- format


def test_a_sequence_round_trips_and_steps_run_length_encode() -> None:
    recorder = StepRecorder()
    for step in range(1000):
        recorder.add(step, 0)
        recorder.add(step, 1)
    recorder.add(1000, 1)
    runs = recorder.finish()
    assert runs == [StepRun(0, 999, (0, 1)), StepRun(1000, 1000, (1,))]
    seq = CollectiveSequence(
        ranks=[0],
        groups=[Group(name="0", desc="default_pg", size=2, ranks=(0, 1))],
        signatures=[
            Signature(op=AR, group=0, dtype="float32", numel=6, shapes=((6,),), stack=(0,)),
            Signature(op="_c10d_functional::all_reduce", group=0, stack=(0,)),
        ],
        steps=runs,
    )
    frames = decode_trace(json.dumps(rank_doc(0, good())).encode(), "x_rank0.json").frames
    data = encode_trace({"rank": 0}, frames, [], collectives=Collectives(sequences=[seq]))
    back = decode_trace(data, "x_rank0.json")
    assert back.collectives == Collectives(sequences=[seq])
    assert back.collectives.sequences[0].count() == 2001
    assert collective_kind(AR) == collective_kind("_c10d_functional::all_reduce") == "allreduce"


def test_old_traces_read_without_a_sequence(tmp_path: Path) -> None:
    doc = rank_doc(0, good())
    del doc["collectives"]
    doc["version"] = 4
    assert load_trace(write(tmp_path / "old_rank0.json", doc)).collectives is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda s: s["signatures"][0].update(group=5), "signatures[0].group is 5"),
        (lambda s: s["signatures"][0].update(stack=[0, 99]), "refers to frame 99"),
        (lambda s: s["steps"].append([0, 0, [0]]), "steps[3] is out of order"),
        (lambda s: s["steps"][0][2].append(7), "refers to signature 7"),
        (lambda s: s.update(ranks=[3]), "ranks has rank 3, not one of the trace's"),
        (lambda s: s["groups"][0].update(size=3), "has size 3 but 2 ranks"),
    ],
)
def test_a_bad_sequence_is_refused_in_one_line(
    opguard: Callable[..., Any], tmp_path: Path, change: Any, message: str
) -> None:
    doc = rank_doc(0, good())
    change(doc["collectives"]["sequences"][0])
    path = write(tmp_path / "bad_rank0.json", doc)
    with pytest.raises(InputError, match=re.escape(message)):
        load_trace(path)
    write(tmp_path / "bad_rank1.json", rank_doc(1, good()))
    run = opguard("run", "-i", str(tmp_path / "bad_rank*.json"))
    assert run.exit_code != 0
    assert message in run.stderr and "Traceback" not in run.stderr


# ----------------------------------------------------------------------------- combine


def test_combine_keeps_one_sequence_for_ranks_that_agree(tmp_path: Path) -> None:
    """64 ranks issuing the same sequence cost one sequence; a rank that differs costs
    one more; every way of folding gives the same bytes."""
    paths = [write(tmp_path / f"j_rank{r}.json", rank_doc(r, good())) for r in range(64)]
    odd = replace_step(good(), 1, [(1, AR, "int32", 6, 10), (1, AR, "float32", 8, 11)])
    paths.append(write(tmp_path / "j_rank64.json", rank_doc(64, odd)))
    whole = TraceAccumulator()
    for path in paths:
        whole.add_file(path)
    result = whole.result()
    assert result.collectives is not None
    assert [s.ranks for s in result.collectives.sequences] == [list(range(64)), [64]]
    halves = [TraceAccumulator(), TraceAccumulator()]
    for index, path in enumerate(reversed(paths)):
        halves[index % 2].add(load_trace(path))  # msgspec's path, other order
    halves[1].update(halves[0])
    assert halves[1].result().to_json() == result.to_json()
    again = TraceAccumulator()  # a combined trace read back
    again.add(decode_trace(result.to_json(), "j_combined.json"))
    assert again.result().to_json() == result.to_json()


def test_a_rank_whose_sequence_comes_twice_drops_the_sequences(tmp_path: Path) -> None:
    accumulator = TraceAccumulator()
    accumulator.add_file(write(tmp_path / "a_rank0.json", rank_doc(0, good())))
    accumulator.add_file(write(tmp_path / "b_rank0.json", rank_doc(0, good(12))))
    assert accumulator.result().collectives is None


# ----------------------------------------------------------------------------- divergence


def test_ranks_issuing_the_same_sequence_from_other_lines_agree(
    opguard: Callable[..., Any], tmp_path: Path
) -> None:
    doc = run_docs(opguard, tmp_path, rank_doc(0, good(10, 11)), rank_doc(1, good(20, 21)),
                   expect=0)  # fmt: skip
    assert collective_findings(doc) == []
    assert doc["meta"]["sequence_ranks"] == [0, 1]
    assert "compared by position" in doc["log"]


@pytest.mark.parametrize(
    ("step1", "kind"),
    [
        ([(1, AR, "float32", 8, 11), (1, AR, "float32", 6, 10)], "collective_order"),
        ([(1, AR, "int32", 6, 10), (1, AR, "float32", 8, 11)], "collective_dtype"),
        ([(1, AR, "float32", 7, 10), (1, AR, "float32", 8, 11)], "collective_size"),
        ([(1, AR, "float32", 8, 11)], "collective_missing"),
        (
            [
                (1, AR, "float32", 6, 10),
                (1, "c10d::broadcast_", "float32", 6, 12),
                (1, AR, "float32", 8, 11),
            ],
            "collective_extra",
        ),
    ],
)
def test_each_kind_of_disagreement_names_the_culprit(
    opguard: Callable[..., Any], tmp_path: Path, step1: list[Call], kind: str
) -> None:
    """Three ranks, rank 2 departs in step 1: a strict majority names rank 2, at
    position 2 of the default group (step 1's first collective), in step 1."""
    world = {**WORLD, "size": 3, "ranks": [0, 1, 2]}
    docs = [rank_doc(r, good(), [world], 3) for r in (0, 1)]
    docs.append(rank_doc(2, replace_step(good(), 1, step1), [world], 3))
    found = collective_findings(run_docs(opguard, tmp_path, *docs))
    assert len(found) == 1, found
    finding = found[0]
    assert finding["kind"] == kind and finding["severity"] == "error"
    assert finding["ranks"] == [2] and finding["expected_ranks"] == [0, 1]
    assert finding["majority"] is True
    # an extra collective comes after step 1's first (a), the others replace it
    assert (finding["position"], finding["step"]) == (3 if kind == "collective_extra" else 2, 1)
    assert finding["group"]["name"] == "0" and finding["group"]["ranks"] == [0, 1, 2]
    if kind != "collective_extra":
        assert finding["expected"]["dtype"] == "float32" and finding["expected"]["numel"] == 6
        assert any("job.py:10" in frame for frame in finding["expected_stack"])
    if kind == "collective_dtype":
        assert finding["got"]["dtype"] == "int32"
    if kind == "collective_size":
        assert finding["got"]["numel"] == 7
    if kind == "collective_extra":
        assert finding["got"]["op"] == "c10d::broadcast_"


def test_a_rank_whose_trace_ended_early_is_said_to_have(
    opguard: Callable[..., Any], tmp_path: Path
) -> None:
    """Rank 2 died (SIGTERM) after step 0: its rank file is partial (meta.partial,
    version 5). The combined trace lists it (meta.partial_ranks, version 8), the run
    warns about the input, and the finding it makes by ending says why it may have."""
    world = {**WORLD, "size": 3, "ranks": [0, 1, 2]}
    docs = [rank_doc(r, good(), [world], 3) for r in (0, 1)]
    cut = rank_doc(2, [c for c in good() if c[0] == 0], [world], 3)
    marker = {"reason": "sigterm", "at": "2026-12-06T10:00:00.000Z", "step": 1}
    cut["meta"]["partial"] = marker
    doc = run_docs(opguard, tmp_path, *docs, cut)
    (finding,) = collective_findings(doc)
    assert finding["kind"] == "collective_missing" and finding["ranks"] == [2]
    assert "written before the process was done: rank 2: sigterm at step 1" in finding["message"]
    run_dir = doc["run_dir"]
    combined = json.loads((run_dir / "job_combined.json").read_text())
    assert combined["version"] == 8 and combined["meta"]["partial_ranks"] == {"2": marker}
    summary = json.loads((run_dir / "pipeline_summary.json").read_text())
    (warning,) = [w for w in summary["warnings"] if "before their process" in w["message"]]
    assert warning["partial"] == 1 and "rank 2: sigterm at step 1" in warning["message"]
    assert "ended first" not in warning["message"]  # one rank: nothing to order
    # a complete rank that issued fewer collectives gets no such excuse
    del cut["meta"]["partial"]
    (tmp_path / "complete").mkdir()
    doc = run_docs(opguard, tmp_path / "complete", *docs, cut)
    (finding,) = collective_findings(doc)
    assert "before the process was done" not in finding["message"]


def test_a_rank_0_that_ended_early_is_the_one_reported(
    opguard: Callable[..., Any], tmp_path: Path
) -> None:
    """Two ranks, no majority: the rank whose sequence ended is the one reported (not
    the healthy rank 1 as 'extra' because rank 0 is the lowest)."""
    cut = rank_doc(0, [c for c in good() if c[0] == 0])
    cut["meta"]["partial"] = {"reason": "exception", "exception": "RuntimeError",
                              "at": "2026-12-06T10:00:00.100Z", "step": 1}  # fmt: skip
    # rank 1 then fails too (its peer is gone), a moment later, in step 2
    torn = rank_doc(1, [c for c in good() if c[0] <= 1])
    torn["meta"]["partial"] = {"reason": "exception", "exception": "RuntimeError",
                               "at": "2026-12-06T10:00:00.500Z", "step": 2}  # fmt: skip
    cut["callsites"][-1]["count"], torn["callsites"][-1]["count"] = 20, 40  # the compute op
    doc = run_docs(opguard, tmp_path, cut, torn)
    (finding,) = collective_findings(doc)
    assert finding["kind"] == "collective_missing" and finding["ranks"] == [0]
    assert finding["expected_ranks"] == [1] and finding["majority"] is False
    assert "rank 0: exception RuntimeError at step 1" in finding["message"]
    # the ranks' op counts differ because rank 0 stopped: every count finding says so
    counted = [f for f in doc["findings"] if f["kind"] in ("count_skew", "rank_specific")]
    assert counted and all("(not comparable: traces that end early" in f["message"]
                           for f in counted)  # fmt: skip


@pytest.mark.parametrize("partial", [None, "sigterm"])
def test_a_rank_0_whose_sequence_ends_first_is_the_one_reported(
    opguard: Callable[..., Any], tmp_path: Path, partial: str | None
) -> None:
    """Two complete ranks (or rank 0 told to stop, which says nothing of when its
    record ended): rank 0 issues one all-reduce fewer in step 1. The reference is the
    collective, not the end of rank 0's sequence: rank 0 is missing it (once rank 1
    was reported as issuing an extra one, rank 0 being the lowest)."""
    cut = rank_doc(0, good(steps=2)[:-1])
    if partial:
        cut["meta"]["partial"] = {"reason": partial, "at": "2026-12-06T10:00:00.100Z",
                                  "step": 1}  # fmt: skip
    doc = run_docs(opguard, tmp_path, cut, rank_doc(1, good(steps=2)))
    (finding,) = collective_findings(doc)
    assert (finding["kind"], finding["ranks"], finding["expected_ranks"]) == (
        "collective_missing",
        [0],
        [1],
    )
    assert (finding["position"], finding["step"]) == (3, 1)


def test_check_finds_a_step_in_which_a_rank_issued_no_collective(
    opguard: Callable[..., Any], tmp_path: Path
) -> None:
    """``opguard check`` against a good run's config: rank 1 issues nothing in step 2
    of 5. That step's collectives are missing (once only a count drift warned)."""
    (tmp_path / "good").mkdir()
    (tmp_path / "bad").mkdir()
    for r in (0, 1):
        write(tmp_path / "good" / f"job_rank{r}.json", rank_doc(r, good(steps=5)))
    run = opguard("run", "-i", str(tmp_path / "good" / "job_rank*.json"), expect=0)
    skipped = [c for c in good(steps=5) if c[0] != 2]
    for r, calls in ((0, good(steps=5)), (1, skipped)):
        write(tmp_path / "bad" / f"job_rank{r}.json", rank_doc(r, calls))
    result = opguard("check", "--config", str(run.run_dir), "-i",
                     str(tmp_path / "bad" / "job_rank*.json"), expect=1)  # fmt: skip
    assert "collective_missing" in result.result.stdout
    # on rank 1 (the violation's ranks), the text no longer repeating one of them
    [line] = [x for x in result.result.stdout.splitlines() if "collective_missing" in x]
    assert re.search(r"ranks? 1 +step 2 ended after 0 collective\(s\) on group 0", line), line


def test_ranks_that_died_are_no_majority_against_the_one_that_went_on(
    opguard: Callable[..., Any], tmp_path: Path
) -> None:
    """Three ranks, two of which were lost after step 0: their sequences end there
    because their records do, so they do not outvote rank 2, which went on: they are
    reported (missing, with why), not the healthy rank as issuing an 'extra' one."""
    world = {**WORLD, "size": 3, "ranks": [0, 1, 2]}
    lost = []
    for rank in (0, 1):
        doc = rank_doc(rank, [c for c in good() if c[0] == 0], [world], 3)
        doc["meta"]["partial"] = {"reason": "lost", "at": f"2026-12-06T10:00:0{rank}.000Z",
                                  "step": 1}  # fmt: skip
        lost.append(doc)
    doc = run_docs(opguard, tmp_path, *lost, rank_doc(2, good(), [world], 3))
    (finding,) = collective_findings(doc)
    assert (finding["kind"], finding["ranks"], finding["majority"]) == (
        "collective_missing",
        [0, 1],
        False,
    )
    assert "ranks 0, 1: lost at step 1" in finding["message"]
    # complete ranks that end their sequence there are a majority: rank 2's is extra
    for d in lost:
        del d["meta"]["partial"]
    (tmp_path / "complete").mkdir()
    doc = run_docs(opguard, tmp_path / "complete", *lost, rank_doc(2, good(), [world], 3))
    assert [(f["kind"], f["ranks"], f["majority"]) for f in collective_findings(doc)] == [
        ("collective_extra", [2], True)
    ]


def test_without_sequences_a_rank_0_that_died_is_the_one_reported(
    opguard: Callable[..., Any], tmp_path: Path
) -> None:
    """Counts only (traces with no collective sequences, as older ones and Kineto's):
    the rank whose record ended is held to the one that went on, as with sequences."""
    cut = rank_doc(0, [c for c in good() if c[0] == 0])
    cut["meta"]["partial"] = {"reason": "exception", "exception": "RuntimeError",
                              "at": "2026-12-06T10:00:00.000Z", "step": 1}  # fmt: skip
    whole = rank_doc(1, good())
    for d in (cut, whole):
        del d["collectives"]
    doc = run_docs(opguard, tmp_path, cut, whole)
    found = collective_findings(doc)
    assert len(found) == 2  # both all-reduce callsites
    for finding in found:
        assert (finding["kind"], finding["ranks"], finding["expected"]) == (
            "collective_mismatch",
            [0],
            3,
        )
        assert "against rank 1, whose record went on longest (3x)" in finding["message"]
        assert "rank 0: exception RuntimeError at step 1" in finding["message"]


@pytest.mark.parametrize("later", [0, 1])
def test_ranks_all_told_to_stop_are_not_ordered_by_when(
    opguard: Callable[..., Any], tmp_path: Path, later: int
) -> None:
    """A hang a timeout ends: every rank gets SIGTERM at once. Rank 1 stalled before
    step 1's first all-reduce; which rank's handler ran a millisecond later does not
    change who is reported."""
    ahead = rank_doc(0, [c for c in good() if c[0] == 0] + [(1, AR, "float32", 6, 10)])
    stalled = rank_doc(1, [c for c in good() if c[0] == 0])
    for rank, d in enumerate((ahead, stalled)):
        ms = 1 if rank == later else 0
        d["meta"]["partial"] = {"reason": "sigterm", "at": f"2026-12-06T10:00:00.00{ms}Z",
                                "step": 1}  # fmt: skip
    doc = run_docs(opguard, tmp_path, ahead, stalled)
    assert [(f["kind"], f["ranks"]) for f in collective_findings(doc)] == [
        ("collective_missing", [1])
    ]


@pytest.mark.parametrize("hung", [1, 0])
@pytest.mark.parametrize("stopped", ["sigterm", "exception"])
def test_a_rank_left_waiting_in_a_collective_is_not_the_one_reported(
    opguard: Callable[..., Any], tmp_path: Path, hung: int, stopped: str
) -> None:
    """A rank hangs (or is evicted: SIGTERM) before step 2's first all-reduce; the
    other issues it, waits, times out (its trace: exception) and torchrun then stops
    the hung rank (sigterm), or it fails later on its own (exception, after the
    other's). The rank whose sequence ended is reported missing the collective, not
    the one left waiting as issuing an extra one (before: the waiting rank, since a
    rank told to stop counted as never ending and the waiting one as ending first)."""
    waiting = rank_doc(1 - hung, [c for c in good() if c[0] <= 1] + [(2, AR, "float32", 6, 10)])
    waiting["meta"]["partial"] = {"reason": "exception", "exception": "RuntimeError",
                                  "at": "2026-12-06T10:00:05.000Z", "step": 3}  # fmt: skip
    ended = rank_doc(hung, [c for c in good() if c[0] <= 1])
    ended["meta"]["partial"] = {"reason": stopped, "at": "2026-12-06T10:00:05.200Z", "step": 3}
    if stopped == "exception":
        ended["meta"]["partial"]["exception"] = "RuntimeError"
    doc = run_docs(opguard, tmp_path, waiting, ended)
    (finding,) = collective_findings(doc)
    assert (finding["kind"], finding["ranks"], finding["expected_ranks"]) == (
        "collective_missing",
        [hung],
        [1 - hung],
    )
    assert finding["majority"] is False and finding["step"] == 2
    assert f"written before the process was done: rank {hung}: {stopped}" in finding["message"]
    # the run's warning names the waiting rank as ending first, and says it was waiting
    summary = json.loads((doc["run_dir"] / "pipeline_summary.json").read_text())
    (warning,) = [w for w in summary["warnings"] if "ended first" in w["message"]]
    assert warning["message"].endswith(
        f"rank {1 - hung} ended first, at 2026-12-06T10:00:05.000Z, 0.200 s before the "
        f"next (rank {hung}), but it had issued more collectives than rank(s) {hung} on "
        "the groups they share (5 to 4), which ended after it: it was likely left waiting "
        "in a collective they never issued"
    )


def test_without_sequences_a_complete_rank_is_the_reference(
    opguard: Callable[..., Any], tmp_path: Path
) -> None:
    """Counts only: rank 0 issued fewer all-reduces and was told to stop; rank 1's record
    is complete, so it is the reference though neither 'ends' (before: rank 0's, the
    lowest, and the complete rank 1 was reported)."""
    stopped = rank_doc(0, [c for c in good() if c[0] == 0])
    stopped["meta"]["partial"] = {"reason": "sigterm", "at": "2026-12-06T10:00:00.000Z",
                                  "step": 1}  # fmt: skip
    whole = rank_doc(1, good())
    for d in (stopped, whole):
        del d["collectives"]
    found = collective_findings(run_docs(opguard, tmp_path, whole, stopped))
    assert found and all(f["ranks"] == [0] for f in found), found
    assert all("against rank 1, whose record is complete (3x)" in f["message"] for f in found)


def test_a_rank_without_a_trace_is_named(opguard: Callable[..., Any], tmp_path: Path) -> None:
    """Rank 1 of 2 died before it wrote anything (os._exit, SIGKILL before a flush):
    the run says which rank is missing, from meta.world_size."""
    write(tmp_path / "job_rank0.json", rank_doc(0, good()))
    run = opguard("run", "-i", str(tmp_path / "job_rank*.json"), expect=0)
    summary = json.loads(run.read("pipeline_summary.json"))
    (warning,) = [w for w in summary["warnings"] if "world_size" in w["message"]]
    assert warning["message"] == (
        "job: meta.world_size is 2 but there is no trace of rank(s) 1 "
        "(lost with its process, or not given)"
    )
    assert warning["missing"] == 1


def test_the_rank_that_ended_first_is_named() -> None:
    """A job that fell apart: every rank's trace is partial; the one whose record ends
    first is where to look."""
    from opguard_core.formats.trace import describe_partial, first_to_end, partial_ranks_of

    raised = {"reason": "exception", "exception": "RuntimeError", "step": 3}
    partial = partial_ranks_of({"partial_ranks": {
        "0": {**raised, "at": "2026-12-06T18:30:20.558Z"},
        "1": {**raised, "at": "2026-12-06T18:30:20.216Z"},
        "2": {"reason": "sigterm", "at": "2026-12-06T18:30:21.000Z", "step": 3},
    }})  # fmt: skip
    assert describe_partial(partial) == (
        "ranks 0, 1: exception RuntimeError at step 3; rank 2: sigterm at step 3"
    )
    assert first_to_end(partial) == (
        "rank 1 ended first, at 2026-12-06T18:30:20.216Z, 0.342 s before the next (rank 0)"
    )
    partial[0]["at"] = partial[1]["at"]  # a tie names no one
    assert first_to_end(partial) is None
    assert first_to_end({0: {"reason": "flush", "at": "not a time"}, 1: {}}) is None
    # every rank told to stop (a hang killed by a timeout): the first to go is no culprit
    stopped = {r: {"reason": "sigterm", "at": f"2026-12-06T18:30:2{r}.000Z"} for r in (0, 1)}
    assert first_to_end(stopped) is None
    # a lost rank's time is its last flush, not its end: it is not named first
    flushed = {**partial, 1: {"reason": "lost", "at": "2026-12-06T18:30:12.000Z", "step": 2}}
    assert first_to_end(flushed) == (
        "rank 0 ended first, at 2026-12-06T18:30:20.216Z, 0.784 s before the next (rank 2)"
    )


def test_ranks_of_other_groups_are_not_said_to_be_behind() -> None:
    """The rank that ended first is said to have been waiting only where it issued
    more collectives than a later one on the groups they share: a pipeline stage that
    issues fewer by design (its own group) is not behind (once: totals, 30 to 15)."""
    from opguard_core.formats.trace import first_to_end

    partial = {r: {"reason": "exception", "at": f"2026-12-06T18:30:2{r}.000Z"} for r in (0, 1, 2)}
    world, stage0, stage1 = ("0", (0, 1, 2)), ("1", (0,)), ("2", (1, 2))
    issued = {0: {world: 10, stage0: 20}, 1: {world: 10, stage1: 5}, 2: {world: 10, stage1: 5}}
    assert first_to_end(partial, issued) == (
        "rank 0 ended first, at 2026-12-06T18:30:20.000Z, 1.000 s before the next (rank 1)"
    )
    issued[2] = {world: 9, stage1: 5}
    assert first_to_end(partial, issued) == (
        "rank 0 ended first, at 2026-12-06T18:30:20.000Z, 1.000 s before the next (rank 1), "
        "but it had issued more collectives than rank(s) 2 on the groups they share (10 to "
        "9), which ended after it: it was likely left waiting in a collective they never "
        "issued"
    )


def test_combined_partial_ranks_read_back_and_bad_ones_are_refused(tmp_path: Path) -> None:
    marker = {"reason": "exception", "exception": "RuntimeError", "at": "x", "step": 0}
    docs = [rank_doc(r, good()) for r in (0, 1)]
    docs[1]["meta"]["partial"] = marker
    paths = [write(tmp_path / f"j_rank{r}.json", d) for r, d in enumerate(docs)]
    orders = []
    for order in (paths, paths[::-1]):
        acc = TraceAccumulator()
        for path in order:
            acc.add_file(path)
        orders.append(acc.result())
    assert orders[0].meta["partial_ranks"] == orders[1].meta["partial_ranks"] == {"1": marker}
    assert "partial" not in orders[0].meta  # rank 0 is complete: the ranks disagree
    again = TraceAccumulator()  # a combined trace as an input keeps the list
    again.add_file(write(tmp_path / "c.json", json.loads(b"".join(orders[0].json_parts()))))
    assert again.result().meta["partial_ranks"] == {"1": marker}
    setup = [{**d, "meta": {**d["meta"], "phase": "setup"}} for d in docs]  # its phase ended
    acc = TraceAccumulator()
    for r, d in enumerate(setup):
        acc.add_file(write(tmp_path / f"s_rank{r}.json", d))
    assert "partial_ranks" not in acc.result().meta
    bad = json.loads(b"".join(orders[0].json_parts()))
    for key in ("7", "²", "9" * 5000):  # not a rank of the file; not a number; too long
        bad["meta"]["partial_ranks"] = {"1": marker, key: marker}
        with pytest.raises(InputError, match="partial_ranks must map the file's ranks"):
            TraceAccumulator().add_file(write(tmp_path / "bad.json", bad))


def test_two_ranks_have_no_majority_and_say_so(opguard: Callable[..., Any], tmp_path: Path) -> None:
    odd = replace_step(good(), 1, [(1, AR, "int32", 6, 10), (1, AR, "float32", 8, 11)])
    doc = run_docs(opguard, tmp_path, rank_doc(0, good()), rank_doc(1, odd))
    (finding,) = collective_findings(doc)
    assert finding["kind"] == "collective_dtype" and finding["majority"] is False
    assert finding["ranks"] == [1] and finding["expected_ranks"] == [0]
    assert [d["ranks"] for d in finding["distribution"]] == [[0], [1]]
    assert "int32[6]" in finding["distribution"][1]["value"]
    assert "no majority" in doc["log"]


SEND, RECV = "c10d::send", "c10d::recv_"


def pipeline(rank: int, world: int, steps: int = 3) -> list[Call]:
    """Each step: recv from the previous stage, send to the next, then all_reduce."""
    calls: list[Call] = []
    for step in range(steps):
        calls += [(step, RECV, "float32", 16, 20)] if rank > 0 else []
        calls += [(step, SEND, "float32", 16, 21)] if rank < world - 1 else []
        calls.append((step, AR, "float32", 8, 11))
    return calls


def test_point_to_point_ops_are_not_compared_by_position(
    opguard: Callable[..., Any], tmp_path: Path
) -> None:
    """A send on one rank and the recv on its peer, and a 4-stage pipeline (stage 0
    only sends, the last only receives): no finding; a desync of the collectives
    after them is still found, at its position among the collectives alone."""
    world = {**WORLD, "size": 4, "ranks": [0, 1, 2, 3]}
    docs = [rank_doc(r, pipeline(r, 4), [world], world_size=4) for r in range(4)]
    (tmp_path / "pipe").mkdir()
    doc = run_docs(opguard, tmp_path / "pipe", *docs, expect=0)
    assert collective_findings(doc) == [] and not any(
        f["severity"] == "error" for f in doc["findings"]
    )
    odd = replace_step(pipeline(2, 4), 1, [(1, RECV, "float32", 16, 20),
                                            (1, SEND, "float32", 16, 21),
                                            (1, AR, "int32", 8, 11)])  # fmt: skip
    docs[2] = rank_doc(2, odd, [world], world_size=4)
    (tmp_path / "odd").mkdir()
    (finding,) = collective_findings(run_docs(opguard, tmp_path / "odd", *docs))
    assert finding["kind"] == "collective_dtype" and finding["ranks"] == [2]
    assert finding["position"] == 1 and finding["step"] == 1


def test_point_to_point_ops_are_not_compared_by_count_either(
    opguard: Callable[..., Any], tmp_path: Path
) -> None:
    """The same pipeline in traces without sequences (Kineto, older tracers): its sends
    and recvs were ``collective_mismatch`` errors (rank 0 never receives, the last rank
    never sends), compared by count per callsite."""
    world = {**WORLD, "size": 4, "ranks": [0, 1, 2, 3]}
    docs = [rank_doc(r, pipeline(r, 4), [world], world_size=4) for r in range(4)]
    for doc in docs:
        del doc["collectives"]
    (tmp_path / "pipe").mkdir()
    doc = run_docs(opguard, tmp_path / "pipe", *docs, expect=0)
    assert not any(f["severity"] == "error" for f in doc["findings"])


SCATTER = "c10d::scatter_"


def scatter_doc(rank: int, shapes: list[list[int]]) -> dict[str, Any]:
    """Rank ``rank`` scatters from rank 0 each step, then all-reduces; its scatter
    recorded with ``shapes``."""
    step: list[Call] = [(0, SCATTER, "float32", 4, 30), (0, AR, "float32", 8, 11)]
    doc = rank_doc(rank, [(n, *call[1:]) for n in range(3) for call in step])
    sig = doc["collectives"]["sequences"][0]["signatures"][0]
    sig.update(shapes=shapes, numel=sum(math.prod(shape) for shape in shapes))
    return doc


def test_a_scatter_recorded_by_an_older_tracer_agrees(
    opguard: Callable[..., Any], tmp_path: Path
) -> None:
    """An older tracer recorded the root's whole scatter list ([4],[4]) and the other
    ranks' output ([4]): each rank's share agrees. Another share is a size finding."""
    (tmp_path / "old").mkdir()
    doc = run_docs(opguard, tmp_path / "old", scatter_doc(0, [[4], [4]]),
                   scatter_doc(1, [[4]]), expect=0)  # fmt: skip
    assert collective_findings(doc) == []
    (tmp_path / "odd").mkdir()
    doc = run_docs(opguard, tmp_path / "odd", scatter_doc(0, [[4], [4]]), scatter_doc(1, [[5]]))
    (finding,) = collective_findings(doc)
    assert finding["kind"] == "collective_size" and finding["position"] == 0


A2A = "c10d::alltoall_base_"


def test_uneven_all_to_all_sizes_are_not_compared(
    opguard: Callable[..., Any], tmp_path: Path
) -> None:
    """all_to_all_single with uneven splits (an MoE's token dispatch): each rank sends
    its own number of elements, no finding; another dtype is still one."""

    def moe(rank: int, dtype: str = "float32") -> dict[str, Any]:
        calls = [(n, A2A, dtype, 4 + rank + n, 40) for n in range(3)]  # sizes vary by step
        return rank_doc(rank, [c for n in range(3) for c in (calls[n], (n, AR, "float32", 8, 11))])

    (tmp_path / "moe").mkdir()
    doc = run_docs(opguard, tmp_path / "moe", moe(0), moe(1), expect=0)
    assert collective_findings(doc) == []
    (tmp_path / "odd").mkdir()
    doc = run_docs(opguard, tmp_path / "odd", moe(0), moe(1, "int32"))
    (finding,) = collective_findings(doc)
    assert finding["kind"] == "collective_dtype" and finding["position"] == 0


def test_a_collective_on_another_group_is_one_group_finding(
    opguard: Callable[..., Any], tmp_path: Path
) -> None:
    other = {"name": "1", "desc": None, "size": 2, "ranks": [0, 1]}
    odd = replace_step(good(), 1, [(1, AR, "float32", 6, 10, "1"), (1, AR, "float32", 8, 11)])
    doc = run_docs(opguard, tmp_path, rank_doc(0, good(), [WORLD, other]),
                   rank_doc(1, odd, [WORLD, other]))  # fmt: skip
    (finding,) = collective_findings(doc)
    assert finding["kind"] == "collective_group" and finding["ranks"] == [1]
    assert finding["group"]["name"] == "0" and finding["other_group"]["name"] == "1"
    assert finding["step"] == 1


def test_a_collective_on_a_group_no_other_rank_uses_is_one_group_finding(
    opguard: Callable[..., Any], tmp_path: Path
) -> None:
    """Rank 1 issues step 1's first all_reduce on group 7, which only it uses: a group
    of one member is not compared, so there was no extra's finding to pair, and the
    finding was a ``collective_missing`` ("rank(s) 1 skip c10d::allreduce_
    float32[6]") that never named the call it did issue (found on edited gloo Flight
    Recorder dumps). The same on a group both ranks use is the test above."""
    alone = {"name": "7", "desc": None, "size": 1, "ranks": [1]}
    odd = replace_step(good(), 1, [(1, AR, "float32", 6, 10, "7"), (1, AR, "float32", 8, 11)])
    doc = run_docs(opguard, tmp_path, rank_doc(0, good()), rank_doc(1, odd, [WORLD, alone]))
    (finding,) = collective_findings(doc)
    assert finding["kind"] == "collective_group" and finding["ranks"] == [1], finding["message"]
    assert finding["group"]["name"] == "0" and finding["other_group"]["name"] == "7"
    assert finding["step"] == 1 and finding["got"]["group"] == "7"
    assert "on group 7 (ranks [1]), which no other rank uses, where" in finding["message"]
    # another collective there (not the one skipped) is still a skip
    (tmp_path / "other").mkdir()
    odd = replace_step(good(), 1, [(1, AR, "int32", 6, 10, "7"), (1, AR, "float32", 8, 11)])
    doc = run_docs(
        opguard, tmp_path / "other", rank_doc(0, good()), rank_doc(1, odd, [WORLD, alone])
    )
    (finding,) = collective_findings(doc)
    assert finding["kind"] == "collective_missing", finding["message"]


def test_two_groups_issued_in_another_order_are_a_desync(
    opguard: Callable[..., Any], tmp_path: Path
) -> None:
    """Each step all-reduces on the world group, then on group 1 (both ranks); rank 1
    swaps them in step 1. Each group on its own agrees, yet both ranks wait for the
    other (a real hang under gloo and NCCL): a collective_order naming rank 1, step 1
    (once: no divergence)."""
    other = {"name": "1", "desc": None, "size": 2, "ranks": [0, 1]}
    a, b = (AR, "float32", 6, 10), (AR, "float32", 8, 11, "1")
    calls = [(step, *c) for step in range(3) for c in (a, b)]
    swapped = replace_step(calls, 1, [(1, *b), (1, *a)])
    doc = run_docs(opguard, tmp_path, rank_doc(0, calls, [WORLD, other]),
                   rank_doc(1, swapped, [WORLD, other]))  # fmt: skip
    (finding,) = collective_findings(doc)
    assert (finding["kind"], finding["ranks"], finding["step"]) == ("collective_order", [1], 1)
    assert (finding["group"]["name"], finding["other_group"]["name"]) == ("0", "1")
    assert finding["position"] == 1 and finding["got"]["group"] == "1"
    assert "interleave in another order" in finding["message"]
    # the same order on both ranks, whatever it is, agrees
    (tmp_path / "same").mkdir()
    doc = run_docs(opguard, tmp_path / "same", rank_doc(0, swapped, [WORLD, other]),
                   rank_doc(1, swapped, [WORLD, other]), expect=0)  # fmt: skip
    assert collective_findings(doc) == []


def mesh_docs(swapped: set[int], world: bool = False) -> list[dict[str, Any]]:
    """A 2 x 2 mesh: tensor-parallel groups {0, 1} and {2, 3}, data-parallel {0, 2}
    and {1, 3}; every step each rank all-reduces on its TP group, then on its DP
    group (after one on the world group, with ``world``); ranks in ``swapped`` issue
    the DP one first in step 1."""
    everyone = {"name": "0", "desc": "default_pg", "size": 4, "ranks": [0, 1, 2, 3]}
    docs = []
    for rank in range(4):
        tp = {"name": f"tp{rank // 2}", "desc": "tp", "size": 2, "ranks": [rank & ~1, rank | 1]}
        dp = {"name": f"dp{rank % 2}", "desc": "dp", "size": 2, "ranks": [rank % 2, rank % 2 + 2]}
        calls: list[Call] = []
        for step in range(3):
            mine = [
                (step, AR, "float32", 6, 10, tp["name"]),
                (step, AR, "float32", 8, 11, dp["name"]),
            ]
            if step == 1 and rank in swapped:
                mine.reverse()
            calls += [(step, AR, "float32", 4, 9, "0")] * world + mine
        docs.append(rank_doc(rank, calls, [everyone, tp, dp], world_size=4))
    return docs


@pytest.mark.parametrize("world", [False, True])
def test_ranks_waiting_for_each_other_in_a_circle_of_groups_are_a_desync(
    opguard: Callable[..., Any], tmp_path: Path, world: bool
) -> None:
    """Ranks 1 and 2 issue their data-parallel all-reduce before the tensor-parallel
    one in step 1: rank 0 waits on TP for 1, which waits on DP for 3, which waits on
    TP for 2, which waits on DP for 0. Each group agrees, and no two ranks share two
    groups, so no pair shows it (once: no divergence, and the job hangs)."""
    doc = run_docs(opguard, tmp_path, *mesh_docs({1, 2}, world))
    (finding,) = collective_findings(doc)
    assert (finding["kind"], finding["ranks"], finding["step"]) == (
        "collective_order",
        [0, 1, 2, 3],
        1,
    )
    assert (finding["group"]["name"], finding["other_group"]["name"]) == ("tp0", "dp1")
    assert finding["message"] == (
        "collectives on 4 groups issued in orders that wait for each other in a circle: "
        "rank 0 waits in c10d::allreduce_ float32[6] sum on group tp0 (tp) (its collective "
        "#1 there, step 1) for rank 1; rank 1 waits in c10d::allreduce_ float32[8] sum on "
        "group dp1 (dp) (its collective #1 there, step 1) for rank 3; rank 3 waits in "
        "c10d::allreduce_ float32[6] sum on group tp1 (tp) (its collective #1 there, step "
        "1) for rank 2; rank 2 waits in c10d::allreduce_ float32[8] sum on group dp0 (dp) "
        "(its collective #1 there, step 1) for rank 0; the job hangs here"
    )
    # every rank swapping, or two that do not close a circle (0 and 1: rank 0 waits on
    # DP for 2, which goes on), is no hang
    for swapped in ({0, 1, 2, 3}, {0, 1}, set()):
        folder = tmp_path / f"ok{len(swapped)}"
        folder.mkdir()
        doc = run_docs(opguard, folder, *mesh_docs(swapped, world), expect=0)
        assert collective_findings(doc) == [], swapped


def test_ranks_whose_other_groups_split_their_steps_differently_agree(
    opguard: Callable[..., Any], tmp_path: Path
) -> None:
    """Every rank issues broadcast, then one all-reduce per step on the world group;
    ranks 0-1's tensor-parallel group calls change from step 1 to 2 (two runs), ranks
    2-3's do not (one run of steps 1-2). The world group's views are the same: no
    finding (a view built from merged runs once lined the ranks up one call apart)."""
    world = {"name": "0", "desc": "default_pg", "size": 4, "ranks": [0, 1, 2, 3]}
    docs = []
    for rank in range(4):
        tp = {"name": str(1 + rank // 2), "desc": "tp", "size": 2, "ranks": [rank & ~1, rank | 1]}
        last = 16 if rank < 2 else 8
        group = tp["name"]
        calls: list[Call] = [
            (0, "c10d::broadcast_", "float32", 4, 9),
            (1, AR, "float32", 6, 10),
            (1, AR, "float32", 8, 11, group),
            (2, AR, "float32", 6, 10),
            (2, AR, "float32", last, 11, group),
        ]
        doc = rank_doc(rank, calls, [world, tp], world_size=4)
        sequence = doc["collectives"]["sequences"][0]
        if rank >= 2:  # steps 1 and 2 issue the same calls: one run, as the recorder writes
            sequence["steps"] = [sequence["steps"][0], [1, 2, sequence["steps"][1][2]]]
        docs.append(doc)
    doc = run_docs(opguard, tmp_path, *docs, expect=0)
    assert collective_findings(doc) == []


def test_a_skipped_collective_is_reported_at_its_own_step_and_op(
    opguard: Callable[..., Any], tmp_path: Path
) -> None:
    """Rank 2 skips step 1's second all-reduce: the finding is at step 1 (the rank's
    next collective is step 2's, once reported as the step)."""
    skipped = replace_step(good(), 1, [(1, AR, "float32", 6, 10)])
    docs = [rank_doc(r, good(), world_size=3) for r in (0, 1)]
    doc = run_docs(opguard, tmp_path, *docs, rank_doc(2, skipped, world_size=3))
    (finding,) = collective_findings(doc)
    assert (finding["kind"], finding["ranks"], finding["step"]) == ("collective_missing", [2], 1)
    assert finding["expected"]["numel"] == 8 and ", step 1: rank(s) 2 skip" in finding["message"]


def test_a_collective_moved_to_another_group_names_its_own_step_and_op(
    opguard: Callable[..., Any], tmp_path: Path
) -> None:
    """Rank 1 issues step 1's last all-reduce on group 1, and a broadcast follows: the
    finding names the all-reduce and step 1 (once the broadcast and step 2)."""
    other = {"name": "1", "desc": None, "size": 2, "ranks": [0, 1]}
    after = [(2, "c10d::broadcast_", "float32", 4, 12)]
    odd = replace_step(good(), 1, [(1, AR, "float32", 6, 10), (1, AR, "float32", 8, 11, "1")])
    doc = run_docs(opguard, tmp_path, rank_doc(0, good() + after, [WORLD, other]),
                   rank_doc(1, odd + after, [WORLD, other]))  # fmt: skip
    (finding,) = collective_findings(doc)
    assert finding["kind"] == "collective_group"
    assert (finding["op"], finding["step"]) == (AR, 1)
    assert ", step 1: rank(s) 1 issue c10d::allreduce_" in finding["message"]


def test_only_the_first_disagreement_per_group_is_reported(
    opguard: Callable[..., Any], tmp_path: Path
) -> None:
    odd = [(s, AR, "int32", 6, 10) if s >= 1 and n == 6 else (s, AR, "float32", n, line)
           for s, _, _, n, line in good(steps=50)]  # fmt: skip
    doc = run_docs(opguard, tmp_path, rank_doc(0, good(steps=50)), rank_doc(1, odd))
    assert len(collective_findings(doc)) == 1


def test_runs_are_compared_without_expanding_them(
    opguard: Callable[..., Any], tmp_path: Path
) -> None:
    """A run of 10**15 identical steps costs one comparison: the disagreement after
    it is found at once, with its position and step."""
    last = 10**15
    docs = [rank_doc(r, good(steps=2)) for r in (0, 1)]
    for doc in docs:
        seq = doc["collectives"]["sequences"][0]
        seq["steps"] = [[0, last, [0, 1]]]
    docs[1]["collectives"]["sequences"][0]["signatures"].append(
        {**docs[1]["collectives"]["sequences"][0]["signatures"][1], "dtype": "int32"}
    )
    docs[0]["collectives"]["sequences"][0]["steps"].append([last + 1, last + 1, [1]])
    docs[1]["collectives"]["sequences"][0]["steps"].append([last + 1, last + 1, [2]])
    (finding,) = collective_findings(run_docs(opguard, tmp_path, *docs))
    assert finding["kind"] == "collective_dtype"
    assert (finding["position"], finding["step"]) == (2 * (last + 1), last + 1)


@pytest.mark.parametrize("skipper", [1, 0])
def test_a_step_a_rank_skipped_is_reported_where_it_parts(
    opguard: Callable[..., Any], tmp_path: Path, skipper: int
) -> None:
    """A rank issues no collective in step 2 of 5: the finding is at step 2, position
    4, and names that rank, whichever its number (once the whole steps were skipped as
    alike, and the rank was found short at step 4, position 8)."""
    skipped = [c for c in good(steps=5) if c[0] != 2]
    docs = [rank_doc(r, skipped if r == skipper else good(steps=5)) for r in (0, 1)]
    (finding,) = collective_findings(run_docs(opguard, tmp_path, *docs))
    assert (finding["kind"], finding["ranks"]) == ("collective_missing", [skipper])
    assert (finding["position"], finding["step"]) == (4, 2)
    assert finding["got"]["step"] == 3 and "no collective in step 2" in finding["message"]


def test_step_numbers_alone_part_nothing(opguard: Callable[..., Any], tmp_path: Path) -> None:
    """The same collectives in the same order, numbered in other steps (rank 1 counts
    two optimizer steps an iteration, or its collective comes just after the step):
    no finding (the skipped-step check once called the first gap a hang)."""
    twice = [(2 * c[0], *c[1:]) for c in good(steps=5)]
    shifted = [(c[0] + 1, *c[1:]) for c in good(steps=5)]
    for name, other in (("twice", twice), ("shifted", shifted)):
        (tmp_path / name).mkdir()
        docs = [rank_doc(0, good(steps=5)), rank_doc(1, other)]
        assert collective_findings(run_docs(opguard, tmp_path / name, *docs, expect=0)) == []


def split(rank: int, steps: list[list[Any]], dtype: str = "bfloat16") -> dict[str, Any]:
    """A rank file whose runs are ``steps``: signature 0 a float32 all-reduce of 8,
    1 the same from another line, 2 the same in ``dtype``."""
    doc = rank_doc(rank, [(0, AR, "float32", 8, 10), (1, AR, "float32", 8, 11),
                          (2, AR, dtype, 8, 12)])  # fmt: skip
    doc["collectives"]["sequences"][0]["steps"] = steps
    return doc


def test_sequences_that_split_their_steps_differently_are_compared_to_the_end(
    opguard: Callable[..., Any], tmp_path: Path
) -> None:
    """12 million all-reduces, one a step on rank 0 and two on rank 1, then one in
    another dtype: the runs are compared a stretch at a time, and the dtype found (once
    a walk of 10 million calls, tens of seconds, gave up and said they agree)."""
    n = 12_000_000
    docs = [split(0, [[0, n - 1, [0]], [n, n, [1]]]),
            split(1, [[0, n // 2 - 1, [0, 0]], [n // 2, n // 2, [2]]])]  # fmt: skip
    (finding,) = collective_findings(run_docs(opguard, tmp_path, *docs))
    assert (finding["kind"], finding["ranks"], finding["position"]) == ("collective_dtype", [1], n)


def test_a_group_compared_only_in_part_says_so(
    opguard: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past MAX_STEPPED calls compared one at a time the rest of a group is not
    compared: a warning says up to where (once it said nothing, and the log that every
    rank did the same)."""
    monkeypatch.setattr("opguard_plugins.stages.sequences.MAX_STEPPED", 2)
    a, b = (AR, "float32", 6, 10), (AR, "float32", 8, 11)
    steps = [[a, b, a], [b, a, b], [a, b]]  # the same calls as good()'s 4 steps
    odd = [(step, *c) for step, calls in enumerate(steps) for c in calls]
    docs = [rank_doc(0, good(steps=4)), rank_doc(1, odd)]
    doc = run_docs(opguard, tmp_path, *docs, expect=0)
    (finding,) = [f for f in doc["findings"] if f["kind"] == "sequence_unchecked"]
    assert finding["severity"] == "warning" and finding["ranks"] == [0, 1]
    assert "group 0 (default_pg) compared only up to collective #2" in finding["message"]
    assert "no divergence" not in doc["log"]


def test_two_groups_ordered_only_in_part_say_so(
    opguard: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The order across two groups compared past MAX_STEPPED calls one at a time:
    a warning naming both groups says up to where (once it said nothing)."""
    monkeypatch.setattr("opguard_plugins.stages.sequences.MAX_STEPPED", 2)
    other = {"name": "1", "desc": None, "size": 2, "ranks": [0, 1]}
    a, b = (AR, "float32", 6, 10), (AR, "float32", 8, 11, "1")
    even = [(step, *c) for step in range(4) for c in (a, b)]
    steps = [[a, b, a], [b, a, b], [a, b]]  # the same calls, split otherwise
    odd = [(step, *c) for step, calls in enumerate(steps) for c in calls]
    doc = run_docs(opguard, tmp_path, rank_doc(0, even, [WORLD, other]),
                   rank_doc(1, odd, [WORLD, other]), expect=0)  # fmt: skip
    (finding,) = [f for f in doc["findings"] if f["kind"] == "sequence_unchecked"]
    assert finding["severity"] == "warning" and finding["ranks"] == [0, 1]
    assert (finding["group"]["name"], finding["other_group"]["name"]) == ("0", "1")
    assert finding["message"].startswith(
        "the order of group 0 (default_pg)'s and group 1's collectives compared only up to "
        "their collective #2: "
    )
    assert collective_findings(doc) == []


def test_a_reduce_op_mismatch_is_its_own_kind(opguard: Callable[..., Any], tmp_path: Path) -> None:
    docs = [rank_doc(r, good()) for r in (0, 1)]
    docs[1]["collectives"]["sequences"][0]["signatures"].append(
        {**docs[1]["collectives"]["sequences"][0]["signatures"][0], "reduce_op": "max"}
    )
    docs[1]["collectives"]["sequences"][0]["steps"][1][2][0] = 2
    (finding,) = collective_findings(run_docs(opguard, tmp_path, *docs))
    assert finding["kind"] == "collective_reduce_op" and finding["got"]["reduce_op"] == "max"


def test_without_sequences_collectives_are_compared_by_count(
    opguard: Callable[..., Any], tmp_path: Path
) -> None:
    """An old trace (version 4, no sequence): the count-based finding stays."""
    docs = [rank_doc(0, good()), rank_doc(1, good(steps=2))]
    for doc in docs:
        del doc["collectives"]
        doc["version"] = 4
    doc = run_docs(opguard, tmp_path, *docs)
    assert {f["kind"] for f in collective_findings(doc)} == {"collective_mismatch"}
    assert doc["meta"]["sequence_ranks"] == []
    assert "compared by count" in doc["log"]


def test_ranks_without_a_sequence_are_counted_and_named(
    opguard: Callable[..., Any], tmp_path: Path
) -> None:
    """Rank 1's trace is older (no sequence) and issued fewer collectives: the count
    finding stays, and the log names the rank whose sequence is missing."""
    old = rank_doc(1, good(steps=2))
    del old["collectives"]
    old["version"] = 4
    doc = run_docs(opguard, tmp_path, rank_doc(0, good()), old)
    assert doc["meta"]["sequence_ranks"] == [0]
    assert {f["kind"] for f in collective_findings(doc)} == {"collective_mismatch"}
    assert "rank(s) 1 recorded no collective sequence" in doc["log"]


def test_a_rank_that_issued_no_collective_is_counted_and_the_note_says_so(
    opguard: Callable[..., Any], tmp_path: Path
) -> None:
    """Rank 2 of 3 issued no collective: its current trace has no sequence. The count
    finding names it, and the log's note says its collectives are counted (not that
    they are not compared)."""
    world = {**WORLD, "size": 3, "ranks": [0, 1, 2]}
    idle = rank_doc(2, [], [world], world_size=3)
    del idle["collectives"]
    idle["version"] = 8  # a current trace: a version that records sequences
    docs = [rank_doc(r, good(), [world], world_size=3) for r in range(2)]
    doc = run_docs(opguard, tmp_path, *docs, idle)
    (finding, *_) = collective_findings(doc)
    assert finding["kind"] == "collective_mismatch" and finding["ranks"] == [2]
    assert (
        "rank(s) 2 recorded no collective sequence (none issued, or an older trace): "
        "collectives are compared by count per callsite too" in doc["log"]
    )
    assert "not compared" not in doc["log"]


# ----------------------------------------------------------------------------- tracer

#: tries of the sequence job: torch's own crash (a signal) is tried again
JOB_TRIES = 3


def sequence_of(tmp_path: Path, backend: str) -> Any:
    """The trace tests/data/desync/sequence_job.py writes with ``backend``, in its own
    process. A run that torch's profiler crashes (killed by a signal; torch alone does
    it too: docs/tracing.md, "Limits") is tried again, up to ``JOB_TRIES`` times; any
    other failure fails."""
    pytest.importorskip("torch")
    crashes = []
    for attempt in range(JOB_TRIES):
        out = tmp_path / str(attempt)
        out.mkdir()
        proc = subprocess.run(
            [sys.executable, str(DESYNC / "sequence_job.py"), str(out), backend],
            capture_output=True, text=True, timeout=300, cwd=REPO,
        )  # fmt: skip
        if proc.returncode >= 0:
            break
        crashes.append(proc.returncode)
    assert proc.returncode == 0, f"crashes {crashes}, then:\n{proc.stderr[-3000:]}"
    return load_trace(Path(proc.stdout.strip().splitlines()[-1]))


@pytest.mark.torch
@pytest.mark.parametrize("backend", ["modes", "modes-python"])
def test_the_tracer_records_the_sequence(tmp_path: Path, backend: str) -> None:
    """One-rank gloo group: c10d, functional and nested collectives, by step, with
    group, dtype, shapes and reduce op; the C path and the Python path agree."""
    trace = sequence_of(tmp_path, backend)
    assert trace.collectives is not None
    (seq,) = trace.collectives.sequences
    assert seq.ranks == [0]
    assert [(g.name, g.desc, g.size, g.ranks) for g in seq.groups] == [("0", "default_pg", 1, (0,))]
    described = [(s.op, s.dtype, s.numel, s.shapes, s.reduce_op) for s in seq.signatures]
    assert described == [
        ("c10d::allreduce_", "float32", 6, ((6,),), "max"),
        ("_c10d_functional::all_reduce", "int32", 6, ((2, 3),), "sum"),
        ("c10d::_allgather_base_", "float32", 3, ((3,),), None),
        ("c10d::broadcast_", "float32", 4, ((4,),), None),
    ]
    assert [(r.first, r.last, r.calls) for r in seq.steps] == [(0, 2, (0, 1, 2)), (3, 3, (3,))]
    frames = trace.frames
    nested = seq.signatures[2].stack
    assert any(frames[f].function == "gather" for f in nested)  # the kernel's own frame
    assert not any(frames[f].file.endswith("collectives.py") for f in nested)


@pytest.mark.torch
def test_a_scatter_is_described_by_what_every_rank_holds() -> None:
    """The root's scatter list is the root's alone: every rank, the root too, records
    its output (a gather's input is on every rank: recorded as before)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("torch.distributed")
    from opguard_plugins.record.collectives import describe

    out = torch.empty(4)
    chunks = [torch.ones(4), torch.ones(4)]
    for op, args in [
        (SCATTER, ([out], [chunks], None, 0)),  # the root
        (SCATTER, ([out], [], None, 0)),  # another rank
        ("c10d::gather_", ([chunks], [out], None, 0)),  # the root
        ("c10d::gather_", ([], [out], None, 0)),  # another rank
    ]:
        func = getattr(torch.ops.c10d, op.split("::")[1]).default
        assert describe(func, op, args, None)[1:4] == ("float32", 4, ((4,),)), op


@pytest.mark.torch
def test_the_bytes_of_an_object_collective_are_described_without_their_size() -> None:
    """A ``uint8`` call inside one of torch.distributed's object collectives moves
    pickled bytes: described by op, dtype and group, no size (compared by neither
    check nor the guard); the same call elsewhere, or another dtype inside, keeps it.
    The stack is read only for a ``uint8`` call."""
    pytest.importorskip("torch")
    from opguard_plugins.record.collectives import carries_objects, data_sized

    class Code:
        def __init__(self, name: str, filename: str) -> None:
            self.co_name, self.co_filename = name, filename

    c10d = os.path.join("site-packages", "torch", "distributed", "distributed_c10d.py")
    inside = [Code("all_gather", c10d), Code("all_gather_object", c10d), Code("main", "t.py")]
    elsewhere = [Code("all_gather", c10d), Code("all_gather_object", "mine.py")]
    assert carries_objects(inside) and not carries_objects(elsewhere)
    payload = (None, "uint8", 83, ((83,),), None)
    assert data_sized(payload, lambda: inside) == (None, "uint8", None, None, None)
    assert data_sized(payload, lambda: elsewhere) == payload
    lengths = (None, "int64", 2, ((2,),), None)

    def unasked() -> list[Code]:
        raise AssertionError("the stack was read for a call that is not uint8")

    assert data_sized(lengths, unasked) == lengths


# ----------------------------------------------------------------------------- live


CASES = {
    "order": "collective_order",
    "dtype": "collective_dtype",
    "size": "collective_size",
    "skip": "collective_missing",
    "group": "collective_group",
    "funcol": "collective_dtype",
    "nested": "collective_dtype",
    "lines": None,
    "p2p": None,
    "scatter": None,
    "a2a": None,
}


def trace_and_run(
    case: str, tmp_path: Path, *trace_options: str
) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]]:
    """``opguard trace`` (with ``trace_options``) the 2-rank gloo job of ``case``, then
    ``opguard run --fail-on-divergence``: the run and its collective findings."""
    pytest.importorskip("torch")
    out = tmp_path / "traces"
    # torch 2.13's profiler, restarted while gloo runs, now and then corrupts its heap
    # and a worker dies by SIGSEGV or SIGABRT (docs/tracing.md, with a torch-only
    # repro): such a run is tried again, at most 3 tries; any other failure fails
    for _ in range(3 if "profiler" in trace_options else 1):
        shutil.rmtree(out, ignore_errors=True)
        proc = subprocess.run(
            [sys.executable, "-m", "opguard_core.cli.app", "trace", *trace_options,
             "--label", "desync", "--output-dir", str(out), "--", sys.executable, "-m",
             "torch.distributed.run", "--nproc-per-node", "2", str(DESYNC / "desync_job.py"),
             "--case", case, "--timeout", "2"],
            capture_output=True, text=True, timeout=300, cwd=REPO,
        )  # fmt: skip
        if proc.returncode == 0 or not re.search(r"exitcode: -(6|11)\b", proc.stderr):
            break
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = subprocess.run(
        [sys.executable, "-m", "opguard_core.cli.app", "run", "-i",
         str(out / "desync_callsite_rank*.json"), "--output-base", str(tmp_path / "runs"),
         "--fail-on-divergence"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    (run_dir,) = (tmp_path / "runs").iterdir()
    return run, collective_findings(load_divergence(run_dir / "desync_callsite_divergence.json"))


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_real_two_rank_gloo_job(case: str, tmp_path: Path) -> None:
    """``opguard trace`` a 2-rank gloo job under torchrun whose rank 1 departs in step
    1 (tests/data/desync/desync_job.py), then ``opguard run --fail-on-divergence``."""
    run, found = trace_and_run(case, tmp_path)
    kind = CASES[case]
    if kind is None:
        assert found == [] and run.returncode == 0, run.stderr
        return
    assert run.returncode == 4, run.stderr
    assert [f["kind"] for f in found] == [kind]
    finding = found[0]
    assert finding["ranks"] == [1] and finding["expected_ranks"] == [0]
    assert (finding["step"], finding["position"]) == (1, 2)
    assert finding["group"]["name"] == "0" and finding["group"]["desc"] == "default_pg"
    op = {"funcol": "_c10d_functional::all_reduce", "nested": "c10d::_allgather_base_"}
    assert finding["op"] == op.get(case, "c10d::allreduce_")
    assert finding["stack"] and finding["expected_stack"]


@pytest.mark.slow  # runs a torch program twice
def test_the_sequence_does_not_grow_with_steps() -> None:
    """``benchmarks/sequence_memory.py``: a job repeating 10 or 2000 steps records the
    same signatures and one step run; the written sequence is the same size but for
    the digits of the last step."""
    pytest.importorskip("torch")
    figures = []
    for steps in (10, 2000):
        proc = subprocess.run(
            [sys.executable, str(REPO / "benchmarks" / "sequence_memory.py"), "--steps",
             str(steps)],
            capture_output=True, text=True, timeout=300, cwd=REPO,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
        figures.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    few, many = figures
    assert few["collectives"] == 30 and many["collectives"] == 6000
    assert (few["signatures"], few["runs"]) == (many["signatures"], many["runs"]) == (3, 1)
    assert many["collectives_bytes"] - few["collectives_bytes"] <= 3


@pytest.mark.torch
# slow group: torch's profiler now and then crashes this job (see sequence_of)
@pytest.mark.slow
def test_the_profiler_backend_records_the_sequence(tmp_path: Path) -> None:
    """The profiler backend: c10d, functional and nested collectives in time order, by
    step, with dtype and shapes (``record_shapes`` in a job of several ranks); the
    profiler records no group nor reduce op (unknown)."""
    trace = sequence_of(tmp_path, "profiler")
    assert trace.collectives is not None
    (seq,) = trace.collectives.sequences
    assert [(g.name, g.size) for g in seq.groups] == [("?", 1)]
    described = [(s.op, s.dtype, s.numel, s.shapes, s.reduce_op) for s in seq.signatures]
    assert described == [
        ("c10d::allreduce_", "float32", 6, ((6,),), None),
        ("_c10d_functional::all_reduce", "int32", 6, ((2, 3),), None),
        ("c10d::_allgather_base_", "float32", 3, ((3,),), None),
        ("c10d::broadcast_", "float32", 4, ((4,),), None),
    ]
    assert [(r.first, r.last, r.calls) for r in seq.steps] == [(0, 2, (0, 1, 2)), (3, 3, (3,))]
    assert trace.meta.get("tracer_backend") == "profiler"


@pytest.mark.slow
@pytest.mark.parametrize("case", ["dtype", "order", "lines"])
def test_a_real_two_rank_gloo_job_under_the_profiler_backend(case: str, tmp_path: Path) -> None:
    """The same job traced with ``--backend profiler``: the same finding on the same
    rank, step and position (the group is unknown to the profiler: ``?``)."""
    run, found = trace_and_run(case, tmp_path, "--backend", "profiler")
    if CASES[case] is None:
        assert found == [] and run.returncode == 0, run.stderr
        return
    assert run.returncode == 4, run.stderr
    assert [(f["kind"], f["ranks"], f["step"], f["position"]) for f in found] == [
        (CASES[case], [1], 1, 2)
    ]
    assert found[0]["group"]["name"] == "?"
