"""Rank divergence: findings on real traces of a job whose ranks diverge, the hook,
the exit code, and properties (rank-file order, copies of one rank, the statistics'
algebra)."""

from __future__ import annotations

import array
import json
import random
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from statistics import median_low
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from opguard_core import hookimpl
from opguard_core.combine.accumulator import CallsiteTrace, TraceAccumulator, merge_slot
from opguard_core.formats.divergence import load_divergence
from opguard_core.formats.trace import decode_trace, load_trace
from opguard_core.model import RunOptions
from opguard_core.plugin.manager import create_plugin_manager
from opguard_plugins.stages.divergence import find_divergence
from tests.builders import trace_doc

DIVERGENT = Path(__file__).parent / "data" / "divergent"
REPO = Path(__file__).resolve().parent.parent


def divergent_files(tmp_path: Path) -> list[Path]:
    target = tmp_path / "divergent"
    target.mkdir()
    for path in sorted(DIVERGENT.glob("divergent_callsite_rank*.json")):
        shutil.copy(path, target / path.name)
    return sorted(target.glob("*.json"))


def combine(paths: list[Path]) -> CallsiteTrace:
    accumulator = TraceAccumulator()
    for path in paths:
        accumulator.add_file(path)
    return accumulator.result()


def by_kind(findings: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [f for f in findings if f["kind"] == kind]


def check_divergent_job(findings: list[dict[str, Any]]) -> None:
    """What the recorded job really did: rank 1 all_reduces in extra_sync, rank 0 logs."""
    (mismatch,) = by_kind(findings, "collective_mismatch")
    assert mismatch["severity"] == "error"
    assert mismatch["ranks"] == [1]
    assert mismatch["op"] == "c10d::allreduce_"
    assert mismatch["api"] == "torch.distributed.all_reduce"
    assert mismatch["target"] == "divergent_job:extra_sync"
    assert mismatch["context"][-1] == "divergent_job:train_step"
    assert mismatch["expected"] == 0
    assert mismatch["counts"] == {"1": 2}  # two steps, one extra all_reduce each
    specific = {f["target"]: f for f in by_kind(findings, "rank_specific")}
    assert specific["divergent_job:log_metrics"]["ranks"] == [0]
    assert specific["divergent_job:log_metrics"]["severity"] == "warning"
    assert specific["divergent_job:extra_sync"]["ranks"] == [1]
    # the shared all_reduce of the gradients is issued equally often: no finding
    assert all(f["target"] != "divergent_job:train_step" for f in findings)


def test_divergent_job_through_the_cli(opguard: Callable[..., Any], tmp_path: Path) -> None:
    files = divergent_files(tmp_path)
    run = opguard("run", "-i", str(files[0].parent / "divergent_callsite_rank*.json"), expect=0)
    doc = load_divergence(run.run_dir / "divergent_callsite_divergence.json")
    check_divergent_job(doc["findings"])
    assert doc["findings"][0]["severity"] == "error"  # errors first
    log = run.read("divergent_callsite_divergence.log")
    first, *_ = [line for line in log.splitlines() if line.startswith(("ERROR", "WARNING"))]
    assert first.startswith("ERROR collective_mismatch") and "extra_sync" in first
    assert "    divergent_job:extra_sync" in log  # the stack it came from
    summary = json.loads(run.read("pipeline_summary.json"))
    (stage,) = [s for s in summary["stages"] if s["stage"] == "divergence"]
    assert stage["counts"]["errors"] == 1
    assert stage["counts"]["findings"] == len(doc["findings"])
    assert stage["outputs"] == [
        "divergent_callsite_divergence.json",
        "divergent_callsite_divergence.log",
    ]
    # the rank-specific paths are in the config with their ranks (never pruned away)
    config = run.read("divergent_callsite_instrumentation.yaml")
    assert "target: divergent_job:log_metrics" in config
    assert "target: divergent_job:extra_sync" in config


def test_fail_on_divergence_exit_code(opguard: Callable[..., Any], tmp_path: Path) -> None:
    files = divergent_files(tmp_path)
    pattern = str(files[0].parent / "divergent_callsite_rank*.json")
    run = opguard("run", "-i", pattern, "--fail-on-divergence", expect=4)
    assert json.loads(run.read("pipeline_summary.json"))["exit_code"] == 4
    # a job without error findings passes with the flag
    opguard("run", "-i", str(files[0]), "-i", str(files[0]), "--fail-on-divergence", expect=0)


@pytest.mark.parametrize(
    ("before", "after", "reason"),
    [
        ([], ["--skip", "divergence"], "--skip divergence"),
        ([], ["--skip", "combine"], "--skip combine"),
        (["--disable-plugin", "divergence"], [], "no plugin implements opguard_divergence"),
    ],
    ids=["skipped", "after-a-skipped-stage", "disabled"],
)
def test_fail_on_divergence_where_divergence_does_not_run_is_a_usage_error(
    before: list[str], after: list[str], reason: str, opguard: Callable[..., Any], tmp_path: Path
) -> None:
    """A CI gate with the stage skipped or disabled passed a job with a known desync
    (exit 0, no warning)."""
    files = divergent_files(tmp_path)
    pattern = str(files[0].parent / "divergent_callsite_rank*.json")
    run = opguard(*before, "run", "-i", pattern, *after, "--fail-on-divergence", expect=2)
    stderr = run.result.stderr
    assert "--fail-on-divergence needs the divergence stage, which would not run" in stderr
    assert reason in stderr
    assert run.run_dir is None


def test_single_rank_entry_has_no_divergence_files(
    opguard: Callable[..., Any], tmp_path: Path
) -> None:
    files = divergent_files(tmp_path)
    run = opguard("run", "-i", str(files[1]), expect=0)
    assert not list(run.run_dir.glob("*_divergence.*"))


def test_hook_divergence(tmp_path: Path) -> None:
    pm = create_plugin_manager()
    trace = combine(divergent_files(tmp_path))
    findings = pm.hook.opguard_divergence(trace=trace, options=RunOptions())
    check_divergent_job(findings)

    class Quiet:
        """A divergence plugin that answers first: no findings."""

        @hookimpl
        def opguard_divergence(self, trace: CallsiteTrace, options: RunOptions) -> list[Any]:
            return []

    pm.register(Quiet(), name="quiet")
    assert pm.hook.opguard_divergence(trace=trace, options=RunOptions()) == []


def test_count_skew_threshold(tmp_path: Path) -> None:
    """Rank 2 runs f 10 times as often: a skew finding at F=0.25, none at F=20."""
    paths = []
    for rank, count in enumerate([10, 10, 100, 11]):
        doc = trace_doc([([("app", "main"), ("app", "f")], None, "aten::mm", count)], rank=rank)
        path = tmp_path / f"job_rank{rank}.json"
        path.write_text(json.dumps(doc))
        paths.append(path)
    trace = combine(paths)
    (skew,) = find_divergence(trace, RunOptions(skew=0.25))
    assert (skew["kind"], skew["ranks"], skew["target"]) == ("count_skew", [2], "app:f")
    assert skew["expected"] == 10 and skew["counts"] == {"2": 100}
    assert find_divergence(trace, RunOptions(skew=20.0)) == []


def test_a_package_named_like_torch_is_the_users_code(tmp_path: Path) -> None:
    """``torchtitan`` is not torch: its function is the one a skew names (only torch's
    own frames, ``torch`` and ``torch.*``, are passed over)."""
    stack = [("train", "main"), ("torchtitan.models.llama", "Attention.forward"),
             ("torch.nn.functional", "linear")]  # fmt: skip
    paths = []
    for rank, count in enumerate([100, 100, 300]):
        doc = trace_doc([(stack, None, "aten::addmm", count)], rank=rank)
        paths.append(tmp_path / f"job_rank{rank}.json")
        paths[-1].write_text(json.dumps(doc))
    (skew,) = find_divergence(combine(paths), RunOptions())
    assert (skew["kind"], skew["target"]) == (
        "count_skew",
        "torchtitan.models.llama:Attention.forward",
    )


def test_version_1_combined_trace_still_reads(tmp_path: Path) -> None:
    """A version-1 combined file (no statistics) is read; counts are then unknown,
    so only ranks that never ran something are reported."""
    trace = combine(divergent_files(tmp_path))
    data = trace.to_json().replace(b'"version":2', b'"version":1')
    data = data.replace(b'"per_rank_stats":true,', b"")
    old = tmp_path / "old_combined.json"
    old.write_bytes(data)
    again = combine([old])
    assert not again.per_rank_stats
    assert again.total == trace.total
    findings = find_divergence(again, RunOptions())
    (mismatch,) = by_kind(findings, "collective_mismatch")
    assert mismatch["ranks"] == [1] and mismatch["target"] == "divergent_job:extra_sync"
    assert by_kind(findings, "count_skew") == []


def test_combined_v2_reads_back_with_its_statistics(tmp_path: Path) -> None:
    paths = []
    for rank, count in enumerate([1, 2, 3, 3, 7]):
        doc = trace_doc([([("app", "main")], None, "c10d::allreduce_", count)], rank=rank)
        path = tmp_path / f"job_rank{rank}.json"
        path.write_text(json.dumps(doc))
        paths.append(path)
    trace = combine(paths)
    (site,) = trace.callsites
    assert site.per_rank is not None
    assert (site.per_rank.min, site.per_rank.min_ranks) == (1, [0])
    assert (site.per_rank.max, site.per_rank.max_ranks) == (7, [4])
    assert site.per_rank.counts == [(1, [0]), (2, [1]), (3, [2, 3]), (7, [4])]
    # a combined file read back (alone, or with more ranks) gives the same statistics
    saved = tmp_path / "saved_combined.json"
    saved.write_bytes(trace.to_json())
    assert combine([saved]).to_json() == trace.to_json()
    halves = tmp_path / "half_combined.json"
    halves.write_bytes(combine(paths[:2]).to_json())
    assert combine([halves, *paths[2:]]).to_json() == trace.to_json()


# ----------------------------------------------------------------------------- properties


@st.composite
def rank_jobs(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Rank files of one job: shared callsites with per-rank counts, some rank-only."""
    ranks = draw(st.integers(2, 6))
    functions = [("app", f"f{i}") for i in range(draw(st.integers(1, 5)))]
    ops = ["aten::mm", "c10d::allreduce_", "aten::add"]
    shapes = draw(
        st.lists(
            st.tuples(
                st.lists(st.sampled_from(functions), min_size=1, max_size=3),
                st.sampled_from(ops),
                st.lists(st.integers(0, 12), min_size=ranks, max_size=ranks),
            ),
            min_size=1,
            max_size=8,
            unique_by=lambda shape: (tuple(shape[0]), shape[1]),  # one callsite each
        )
    )
    docs = []
    for rank in range(ranks):
        sites = [
            ([("app", "main"), *stack], None, op, counts[rank])
            for stack, op, counts in shapes
            if counts[rank] > 0
        ]
        sites = sites or [([("app", "main")], None, "aten::mm", 1)]
        docs.append(trace_doc(sites, rank=rank))
    return docs


def _combine_docs(docs: list[dict[str, Any]]) -> CallsiteTrace:
    accumulator = TraceAccumulator()
    for doc in docs:
        accumulator.add(decode_trace(json.dumps(doc).encode(), f"x_rank{doc['meta']['rank']}.json"))
    return accumulator.result()


@settings(max_examples=60, deadline=None)
@given(rank_jobs(), st.randoms(use_true_random=False))
def test_permuting_rank_files_changes_nothing(
    docs: list[dict[str, Any]], rnd: random.Random
) -> None:
    trace = _combine_docs(docs)
    shuffled = list(docs)
    rnd.shuffle(shuffled)
    again = _combine_docs(shuffled)
    assert again.to_json() == trace.to_json()
    assert find_divergence(again, RunOptions()) == find_divergence(trace, RunOptions())


@settings(max_examples=40, deadline=None)
@given(rank_jobs(), st.integers(2, 9))
def test_copies_of_one_rank_give_no_finding(docs: list[dict[str, Any]], copies: int) -> None:
    clones = []
    for rank in range(copies):
        clone = json.loads(json.dumps(docs[0]))
        clone["meta"]["rank"] = rank
        clone["meta"]["ranks"] = [rank]
        clones.append(clone)
    trace = _combine_docs(clones)
    assert all(site.per_rank is None for site in trace.callsites)
    assert find_divergence(trace, RunOptions()) == []


@settings(max_examples=60, deadline=None)
@given(rank_jobs(), st.randoms(use_true_random=False))
def test_statistics_merge_associatively(docs: list[dict[str, Any]], rnd: random.Random) -> None:
    """Any grouping of the rank files into partial accumulators (as the pool and Dask
    make), folded in any order, even pickled in transit, gives the same bytes."""
    import pickle

    whole = _combine_docs(docs).to_json()
    cut = sorted(rnd.sample(range(1, len(docs)), k=rnd.randint(0, len(docs) - 1)))
    groups = [docs[a:b] for a, b in zip([0, *cut], [*cut, len(docs)], strict=True)]
    partials = []
    for group in groups:
        accumulator = TraceAccumulator()
        for doc in group:
            accumulator.add(
                decode_trace(json.dumps(doc).encode(), f"x_rank{doc['meta']['rank']}.json")
            )
        partials.append(
            pickle.loads(pickle.dumps(accumulator)) if rnd.random() < 0.5 else accumulator
        )
    rnd.shuffle(partials)
    total = TraceAccumulator()
    for partial in partials:
        total.update(partial)
    assert total.result().to_json() == whole


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.lists(st.integers(1, 20), min_size=1, max_size=4), min_size=3, max_size=3),
    st.booleans(),
)
def test_merge_slot_is_associative_and_commutative(
    groups: list[list[int]], collective: bool
) -> None:
    """Slots of disjoint rank sets (rank r has count values[r]) merge to the same slot
    whatever the grouping; the histogram cap applies to the union."""
    slots, rank = [], 0
    for values in groups:
        slot: list[Any] | None = None
        for value in values:
            one = [value, 1 << rank, value, None, value, None, None]
            rank += 1
            if slot is None:
                slot = one
            else:
                merge_slot(slot, one, collective)
        slots.append(slot)

    def fold(order: list[list[Any]]) -> list[Any]:
        copies = [json.loads(json.dumps(s, default=lambda h: {str(k): v for k, v in h.items()}))
                  for s in order]  # fmt: skip
        first = [list(s) for s in order]
        out = [*first[0][:6], _copy(order[0][6])]
        for other in first[1:]:
            merge_slot(out, other, collective)
        assert copies  # the inputs are left as they were
        return out

    a, b, c = slots
    left = fold([a, b])
    left = fold([left, c])
    right = fold([b, c])
    right = fold([a, right])
    assert left == right == fold([c, a, b])


def _copy(hist: Any) -> Any:
    return dict(hist) if isinstance(hist, dict) else hist


# ----------------------------------------------------------------------------- live


@pytest.mark.slow
def test_record_the_divergent_job_live(tmp_path: Path) -> None:
    """Record the job with ``opguard trace`` under torchrun (gloo, 2 ranks) and find
    the same divergence as in the committed traces."""
    pytest.importorskip("torch")
    out = tmp_path / "traces"
    proc = subprocess.run(
        [sys.executable, "-m", "opguard_core.cli.app", "trace", "--label", "divergent",
         "--output-dir", str(out), "--", "torchrun", "--nproc-per-node", "2",
         str(DIVERGENT / "divergent_job.py")],
        capture_output=True, text=True, timeout=180, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    paths = sorted(out.glob("divergent_callsite_rank*.json"))
    assert [p.name for p in paths] == [
        "divergent_callsite_rank0.json",
        "divergent_callsite_rank1.json",
    ]
    assert load_trace(paths[1]).meta["rank"] == 1
    # recorded with collective sequences: rank 1's extra all_reduce is on a group of
    # its own, which cannot desync, so it is no collective error (docs/divergence.md);
    # the paths only one rank took are still reported
    trace = combine(paths)
    assert trace.collectives is not None
    findings = find_divergence(trace, RunOptions())
    assert not [f for f in findings if f["severity"] == "error"]
    specific = {f["target"]: f["ranks"] for f in by_kind(findings, "rank_specific")}
    assert specific["divergent_job:log_metrics"] == [0]
    assert specific["divergent_job:extra_sync"] == [1]
    # without the sequences (as an older tracer wrote them) collectives are counted
    trace.collectives = None
    check_divergent_job(find_divergence(trace, RunOptions()))


def test_rank_specific_nodes_are_bounded(
    opguard: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past MAX_RANK_NODES the largest rank-specific nodes are kept (ties: the path
    that sorts first) and the others folded into their parents (counts conserved, the
    tree still checks), and the summary says how many."""
    import opguard_plugins.stages.compress as compress

    monkeypatch.setattr(compress, "MAX_RANK_NODES", 5)
    for rank in (0, 1):
        sites = [([("app", "main"), ("app", "bulk")], None, "aten::mm", 100_000)]
        sites += [([("app", "main"), ("app", f"only{rank}_{i}")], None, "aten::add", 1 + i)
                  for i in range(10)]  # fmt: skip
        (tmp_path / f"job_rank{rank}.json").write_text(json.dumps(trace_doc(sites, rank=rank)))
    run = opguard("run", "-i", str(tmp_path / "job_rank*.json"), expect=0)
    tree = json.loads(run.read("job_compressed.json"))
    settings_ = tree["meta"]["compression"]
    assert (settings_["rank_nodes_kept"], settings_["rank_nodes_folded"]) == (5, 15)
    (main,) = tree["root"]["children"]
    kept = sorted(child["qualname"] for child in main["children"] if child["qualname"] != "bulk")
    # the largest five stay; of the two with count 8, the one whose path sorts first
    # (only0_7) is kept
    assert kept == ["only0_7", "only0_8", "only0_9", "only1_8", "only1_9"]
    small = 2 * sum(range(1, 11))
    kept_ops = sum(c["count"] for c in main["children"] if c["qualname"] != "bulk")
    assert kept_ops == 10 + 10 + 9 + 9 + 8
    assert main["self_ops"] == {"aten::add": small - kept_ops}


@settings(max_examples=300, deadline=None)
@given(
    counts=st.lists(st.integers(1, 12), min_size=1, max_size=40),
    collective=st.booleans(),
)
def test_add_rank_count_is_merge_slot_of_one_rank(counts: list[int], collective: bool) -> None:
    """The combine's hot path for one rank's count gives the slot merge_slot gives."""
    from opguard_core.combine.accumulator import add_rank_count, merge_slot

    fast = [counts[0], 1, counts[0], None, counts[0], None, None]
    slow = list(fast)
    for rank, count in enumerate(counts[1:], start=1):
        mask = 1 << rank
        add_rank_count(fast, count, mask, collective)
        merge_slot(slow, [count, mask, count, None, count, None, None], collective)
        assert fast == slow, (rank, count)


def test_per_rank_counts_add_up_for_every_shape_of_statistics() -> None:
    """A function's per-rank totals gather its callsites: uniform ones share their
    count out, a histogram gives each rank its value, and an overflowed one gives the
    ranks between min and max the mean of what is left (the fold of count_skew, in
    Python and, where built, in C)."""
    from opguard_core.formats.trace import Callsite, PerRank
    from opguard_plugins.stages import divergence
    from tests.compiled import compiled

    ranks = [0, 1, 2, 3]
    counts = [(1, [0]), (2, [1, 3]), (4, [2])]
    histogram = PerRank(min=1, min_ranks=[0], max=4, max_ranks=[2], counts=counts)
    overflowed = PerRank(min=1, min_ranks=[0], max=10, max_ranks=[3], counts=None)
    sites = [
        Callsite(stack=(), op="aten::mm", count=8),
        Callsite(stack=(), op="aten::mm", count=6, ranks=[1, 3]),
        Callsite(stack=(), op="x", count=9, per_rank=histogram),
        Callsite(stack=(), op="x", count=22, per_rank=overflowed),
    ]
    totals = {2: [2, 5, 2, 5], 3: [3, 7, 6, 7], 4: [4, 12.5, 11.5, 17]}
    largest = {2: 0, 3: 2, 4: 3}  # the index of the function's largest callsite
    native = compiled("opguard_plugins.stages._runs")
    folds = [divergence.py_skew_fold] + ([native.skew_fold] if native is not None else [])
    # every callsite's caller is frame 0, function 0; none skipped
    frame0, function0 = array.array("i", [0] * 4).tobytes(), array.array("i", [0]).tobytes()
    for fold in folds:
        # a callsite every rank ran as often: a share of 2 each, no per-rank row
        assert fold(sites[:1], frame0[:4], function0, b"\0", 1, ranks, -1.0) == (
            [8, 0],
            bytearray([1, 0]),
            [0, None],
            [],
        )
        for upto, per_rank in totals.items():
            # skew -1: every function strays, so the fold gives every one's totals
            ops, full, example, found = fold(
                sites[:upto], frame0[: 4 * upto], function0, bytes(upto), 1, ranks, -1.0
            )
            row = array.array("d", per_rank).tobytes()
            assert found == [(0, median_low(per_rank), row, [0, 1, 2, 3])]
            assert ops[0] == sum(site.count for site in sites[:upto])
            assert (full[0], example[0]) == (1, largest[upto])
        # callsites of some ranks each: every rank ran the function only where together
        # they hold every rank (and no rank outside the trace's)
        two = [Callsite(stack=(), op="x", count=4, ranks=[0, 1]),
               Callsite(stack=(), op="x", count=4, ranks=[2, 3])]  # fmt: skip
        for upto, ran in ((1, 0), (2, 1)):
            assert fold(two[:upto], frame0[: 4 * upto], function0, bytes(upto), 1, ranks, -1.0)[
                1
            ] == bytearray([ran, 0])
        outside = PerRank(min=4, min_ranks=[2, 3], max=4, max_ranks=[2, 3], counts=[(4, [2, 3])])
        spoilt = [*two, Callsite(stack=(), op="x", count=8, ranks=[2, 3, 9], per_rank=outside)]
        assert fold(spoilt, frame0[:12], function0, bytes(3), 1, ranks, -1.0)[1] == bytearray(2)
