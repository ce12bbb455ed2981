"""Property-based tests (hypothesis) of the algebra: combine, compress, generate, merge,
the basic filter, and the YAML round trip (issue 5, part 3)."""

from __future__ import annotations

import copy
import dataclasses
import random
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ruamel.yaml.comments import CommentedMap

from opguard_core.combine.accumulator import CallsiteTrace, TraceAccumulator
from opguard_core.formats.config import dump_config, entry_key, parse_config, validate_config
from opguard_core.formats.op_ranks import ranks_of_op, records_op_ranks
from opguard_core.formats.trace import decode_trace
from opguard_core.formats.tree import check_tree, iter_nodes
from opguard_core.model import RunOptions
from opguard_plugins.stages import compress
from opguard_plugins.stages.basic_filter import opguard_filter
from opguard_plugins.stages.compress import compress_trace
from opguard_plugins.stages.generate import generate_config
from opguard_plugins.stages.merge import merge_configs
from tests.builders import as_trace, trace_doc
from tests.strategies import (
    configs,
    encode_doc,
    identity_counts,
    plain,
    rank_file_sets,
)

SETTINGS = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def accumulate(*docs: dict[str, Any]) -> TraceAccumulator:
    accumulator = TraceAccumulator()
    for index, doc in enumerate(docs):
        accumulator.add(decode_trace(encode_doc(doc), f"in{index}_rank{index}.json"))
    return accumulator


def combined(*docs: dict[str, Any]) -> CallsiteTrace:
    return accumulate(*docs).result()


def doc_total(doc: dict[str, Any]) -> int:
    return sum(site["count"] for site in doc["callsites"])


def trace_doc_of(trace: CallsiteTrace) -> dict[str, Any]:
    import json

    return json.loads(trace.to_json())


# ----------------------------------------------------------------------------- combine


@SETTINGS
@given(rank_file_sets(min_files=1, max_files=4), st.randoms(use_true_random=False))
def test_combine_in_any_order_is_byte_identical(docs: list[dict[str, Any]], rnd: Any) -> None:
    shuffled = list(docs)
    rnd.shuffle(shuffled)
    assert combined(*docs).to_json() == combined(*shuffled).to_json()


@SETTINGS
@given(rank_file_sets(min_files=2, max_files=2))
def test_combine_is_commutative(docs: list[dict[str, Any]]) -> None:
    a, b = docs
    left = accumulate(a)
    left.update(accumulate(b))
    right = accumulate(b)
    right.update(accumulate(a))
    assert left.result().to_json() == right.result().to_json()


@SETTINGS
@given(rank_file_sets(min_files=3, max_files=3))
def test_combine_is_associative(docs: list[dict[str, Any]]) -> None:
    a, b, c = docs
    ab = accumulate(a, b)
    ab.update(accumulate(c))
    bc = accumulate(b, c)
    a_bc = accumulate(a)
    a_bc.update(bc)
    nested = accumulate(a)
    inner = accumulate(b)
    inner.update(accumulate(c))
    nested.update(inner)
    expected = combined(a, b, c).to_json()
    assert ab.result().to_json() == expected
    assert a_bc.result().to_json() == expected
    assert nested.result().to_json() == expected


@SETTINGS
@given(rank_file_sets(min_files=1, max_files=4))
def test_combine_conserves_counts(docs: list[dict[str, Any]]) -> None:
    trace = combined(*docs)
    assert trace.total == sum(doc_total(d) for d in docs)
    expected: Counter[Any] = Counter()
    for doc in docs:
        expected.update(identity_counts(doc))
    out = trace_doc_of(trace)
    assert identity_counts(out) == expected
    # every identity appears once: the output is a set of callsites, not a list
    assert len(out["callsites"]) == len(expected)
    # the combined document is itself a valid trace, and ranks are the union
    again = decode_trace(trace.to_json(), "combined.json")
    assert again.ranks() == sorted({r for d in docs for r in _doc_ranks(d)})


@SETTINGS
@given(rank_file_sets(min_files=2, max_files=3))
def test_combining_a_combined_trace_again_changes_nothing_but_adds(
    docs: list[dict[str, Any]],
) -> None:
    """(A+B) written to disk and combined with C equals A+B+C (re-combining is lossless)."""
    *first, last = docs
    partial = trace_doc_of(combined(*first))
    assert combined(partial, last).to_json() == combined(*docs).to_json()


def test_a_callsite_twice_in_a_rank_file_combines_alike_directly_and_again() -> None:
    """What hypothesis found: a rank file with one callsite twice drops the per-rank
    statistics of its combine; its combined trace (of one rank, without
    ``meta.per_rank_stats``) combined again was taken for a rank file, exact, and gave
    other bytes than the direct combine."""
    site = {"stack": [], "op": "aten::mm", "role": "compute", "count": 1, "ranks": [0]}
    meta = {"label": "t", "world_size": 8, "device": "cpu"}
    twice = {"format": "opguard-callsites", "version": 4, "meta": {**meta, "rank": 0},
             "frames": [], "callsites": [site, dict(site)]}  # fmt: skip
    empty = {"format": "opguard-callsites", "version": 1, "meta": {**meta, "rank": 1},
             "frames": [], "callsites": []}  # fmt: skip
    again = combined(trace_doc_of(combined(twice)), empty)
    assert again.to_json() == combined(twice, empty).to_json()
    assert not again.per_rank_stats


def _doc_ranks(doc: dict[str, Any]) -> list[int]:
    meta = doc["meta"]
    return meta.get("ranks") or [meta["rank"]]


# ----------------------------------------------------------------------------- compress

thresholds = st.fixed_dictionaries(
    {
        "min_count": st.integers(min_value=1, max_value=120),
        "min_fraction": st.one_of(
            st.just(0.0), st.floats(min_value=0.0, max_value=1.0, allow_nan=False)
        ),
        "chains": st.booleans(),
        "default_hide": st.booleans(),
    }
)


def _by_rank(ops: dict[str, Any]) -> dict[str, set[int]]:
    """``op@r,s`` keys (:func:`test_which_ranks_ran_each_op_holds_node_by_node`) as
    the ranks that ran each op."""
    ran: dict[str, set[int]] = {}
    for key in ops:
        op, ranks = key.rsplit("@", 1)
        ran.setdefault(op, set()).update(int(r) for r in ranks.split(","))
    return ran


def assert_op_ranks_hold(trace: CallsiteTrace, options: RunOptions, depth: int) -> None:
    """Each node's ``self_op_ranks`` and each entry's ``op_ranks`` against an oracle:
    the same trace with every op named after the ranks of its callsite (``op@0,1``)
    compresses to the same tree (pruning and folding read counts and ranks, never op
    names), whose ops then say which ranks ran what, node by node and entry by entry."""
    import msgspec

    named = dataclasses.replace(
        trace,
        callsites=[
            msgspec.structs.replace(
                site, op=f"{site.op}@{','.join(map(str, site.ranks or trace.ranks))}"
            )
            for site in trace.callsites
        ],
    )
    tree, oracle = compress_trace(trace, options), compress_trace(named, options)
    nodes, truths = iter_nodes(tree["root"]), iter_nodes(oracle["root"])
    assert len(nodes) == len(truths)
    for (node, parent), (truth, _) in zip(nodes, truths, strict=True):
        mine = node["ranks"] if parent is not None else trace.ranks
        listed = node.get("self_op_ranks", {})
        got = {op: set(listed.get(op, mine)) for op in node["self_ops"]}
        assert got == _by_rank(truth["self_ops"])
    config, truth_config = generate_config(tree, "t", depth), generate_config(oracle, "t", depth)
    validate_config(config, "generated")
    all_ranks = [int(r) for r in config["meta"]["ranks"]]
    truths_by_key = {entry_key(e): e for e in truth_config["entries"]}
    for entry in config["entries"]:
        got = {op: set(ranks_of_op(entry, op, config, all_ranks) or ()) for op in entry["ops"]}
        assert got == _by_rank(truths_by_key[entry_key(entry)]["ops"])


@SETTINGS
@given(rank_file_sets(min_files=2, max_files=3), thresholds, st.integers(0, 3))
def test_which_ranks_ran_each_op_holds_node_by_node(
    docs: list[dict[str, Any]], options: dict[str, Any], depth: int
) -> None:
    assert_op_ranks_hold(combined(*docs), RunOptions(**options), depth)


@pytest.mark.parametrize("seed", range(0, 300, 3))
def test_which_ranks_ran_each_op_holds_where_paths_fold_together(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above, on stacks of six functions that recur along and across paths, so
    chains fold into siblings that collide and merge, and pruning folds into parents
    (some with a bound on the rank nodes kept that folds rank-specific ones too)."""
    rng = random.Random(seed)
    stacks = [[("m", rng.choice("abcdef")) for _ in range(rng.randint(1, 5))]
              for _ in range(rng.randint(1, 8))]  # fmt: skip
    world = rng.randint(2, 5)
    docs = []
    for rank in range(world):
        sites = [(stack, None, op, rng.choice([1, 2, 5, 50, 500]))
                 for stack in stacks for op in ("aten::mm", "aten::exp", "aten::add")
                 if rng.random() < 0.4] or [(stacks[0], None, "aten::mm", 1)]  # fmt: skip
        docs.append(trace_doc(sites, rank=rank, world_size=world))
    monkeypatch.setattr(compress, "MAX_RANK_NODES", rng.choice([2, 5, 100_000]))
    options = RunOptions(
        min_count=rng.choice([1, 3, 50]),
        min_fraction=rng.choice([0.0, 0.001, 0.05, 0.2]),
        chains=rng.random() < 0.8,
    )
    for depth in (0, 1, 2):
        assert_op_ranks_hold(as_trace(*docs), options, depth)


@SETTINGS
@given(rank_file_sets(min_files=1, max_files=3), thresholds)
def test_compression_conserves_counts_and_meets_invariants(
    docs: list[dict[str, Any]], options: dict[str, Any]
) -> None:
    trace = combined(*docs)
    tree = compress_trace(trace, RunOptions(**options))
    check_tree(tree, expected_total=trace.total)
    ops: Counter[str] = Counter()
    streams: Counter[str] = Counter()
    for node, _parent in iter_nodes(tree["root"]):
        assert "stack" not in node
        ops.update(node["self_ops"])
        streams.update(node["self_streams"])
    expected_ops: Counter[str] = Counter()
    expected_streams: Counter[str] = Counter()
    for site in trace.callsites:
        expected_ops[site.op] += site.count
        expected_streams[str(site.role)] += site.count
    assert ops == expected_ops
    assert streams == expected_streams
    assert tree["meta"]["compression"]["total"] == trace.total
    # which ranks ran each op (tree version 6): a node's own op on the ranks its
    # self_op_ranks gives, else on all of the node's; over the tree, the callsites' own
    assert tree["meta"]["op_ranks"] is True
    ran: dict[str, set[int]] = {}
    for node, parent in iter_nodes(tree["root"]):
        mine = node["ranks"] if parent is not None else trace.ranks
        for op in node["self_ops"]:
            ran.setdefault(op, set()).update(node.get("self_op_ranks", {}).get(op, mine))
    expected_ran: dict[str, set[int]] = {}
    for site in trace.callsites:
        expected_ran.setdefault(site.op, set()).update(site.ranks or trace.ranks)
    assert ran == expected_ran


@SETTINGS
@given(rank_file_sets(min_files=1, max_files=3), thresholds, st.integers(0, 3))
def test_generated_configs_are_inclusive_and_valid(
    docs: list[dict[str, Any]], options: dict[str, Any], depth: int
) -> None:
    trace = combined(*docs)
    tree = compress_trace(trace, RunOptions(**options))
    config = generate_config(tree, "src", depth)
    validate_config(config, "generated")
    for entry in config["entries"]:
        assert entry["count"] == sum(entry["ops"].values()) == sum(entry["stream_counts"].values())
        assert len(entry["context"]) <= depth
    keys = [entry_key(e) for e in config["entries"]]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)
    if depth >= 1:
        top = sum(e["count"] for e in config["entries"] if not e["context"])
        assert top == trace.total - sum(tree["root"]["self_ops"].values())


# ----------------------------------------------------------------------------- merge


def _op_totals(config: dict[str, Any]) -> Counter[str]:
    totals: Counter[str] = Counter()
    for entry in config["entries"]:
        totals.update(dict(entry["ops"]))
    return totals


def _entries_by_key(config: dict[str, Any]) -> dict[Any, Any]:
    return {entry_key(e): plain(e) for e in config["entries"]}


@SETTINGS
@given(configs(), configs())
def test_merge_is_commutative(a: CommentedMap, b: CommentedMap) -> None:
    ab = merge_configs(a, b)
    ba = merge_configs(b, a)
    assert plain(ab) == plain(ba)
    assert dump_config(ab) == dump_config(ba)  # byte for byte: meta's keys in one order
    assert [entry_key(e) for e in ab["entries"]] == [entry_key(e) for e in ba["entries"]]
    validate_config(ab, "merged")


@pytest.mark.slow  # over 2 s in the quick group
@SETTINGS
@given(configs(), configs(), configs())
def test_merge_is_associative(a: CommentedMap, b: CommentedMap, c: CommentedMap) -> None:
    left = merge_configs(merge_configs(a, b), c)
    right = merge_configs(a, merge_configs(b, c))
    assert plain(left) == plain(right)
    assert dump_config(left) == dump_config(right)


@SETTINGS
@given(configs(), configs())
def test_merge_conserves_counts_and_ops_and_leaves_inputs_alone(
    a: CommentedMap, b: CommentedMap
) -> None:
    before_a, before_b = plain(a), plain(b)
    merged = merge_configs(a, b)
    assert plain(a) == before_a and plain(b) == before_b
    assert _op_totals(merged) == _op_totals(a) + _op_totals(b)
    assert sum(e["count"] for e in merged["entries"]) == sum(
        e["count"] for e in a["entries"]
    ) + sum(e["count"] for e in b["entries"])
    assert merged["meta"]["total"] == a["meta"]["total"] + b["meta"]["total"]
    assert list(merged["meta"]["ranks"]) == sorted(
        set(a["meta"]["ranks"]) | set(b["meta"]["ranks"])
    )
    assert set(_entries_by_key(merged)) == set(_entries_by_key(a)) | set(_entries_by_key(b))
    for entry in merged["entries"]:
        assert entry["count"] == sum(entry["ops"].values()) == sum(entry["stream_counts"].values())
    # dtypes (formats.md, "Dtypes"): added where both inputs' entries record them; an
    # entry whose other side records none has none
    dtyped = {entry_key(e): dict(e["dtype_counts"]) for c in (a, b) for e in c["entries"]
              if "dtype_counts" in e}  # fmt: skip
    for entry in merged["entries"]:
        key = entry_key(entry)
        sides = [e for c in (a, b) for e in c["entries"] if entry_key(e) == key]
        if all("dtype_counts" in e for e in sides):
            want: Counter[str] = Counter()
            for side in sides:
                want.update(dict(side["dtype_counts"]))
            assert dict(entry["dtype_counts"]) == dict(want) and key in dtyped
        else:
            assert "dtype_counts" not in entry


def _ran(config: dict[str, Any]) -> dict[tuple[Any, str], set[int]] | None:
    """Which ranks ran each (entry key, op) of ``config``; None where it does not say."""
    if not records_op_ranks(config):
        return None
    all_ranks = [int(r) for r in config["meta"]["ranks"]]
    found = {}
    for entry in config["entries"]:
        for op in entry["ops"]:
            ran = ranks_of_op(entry, op, config, all_ranks)
            assert ran is not None
            found[(entry_key(entry), op)] = set(ran)
    return found


@SETTINGS
@given(configs(), configs())
def test_merge_unites_which_ranks_ran_each_op(a: CommentedMap, b: CommentedMap) -> None:
    """Config version 6: a merge of two configs that record which ranks ran each op
    records, for each op of each entry, the union of the ranks that ran it on either
    side (an op an entry's ranks all ran is not listed); one that does not record it
    makes the merge record none."""
    merged = merge_configs(a, b)
    validate_config(merged, "merged")
    got, left, right = _ran(merged), _ran(a), _ran(b)
    if left is None or right is None:
        assert got is None and all("op_ranks" not in e for e in merged["entries"])
        return
    assert got is not None
    want: dict[tuple[Any, str], set[int]] = {}
    for side in (left, right):
        for key, ranks in side.items():
            want.setdefault(key, set()).update(ranks)
    assert got == want
    for entry in merged["entries"]:  # listed only where some of the entry's ranks ran it
        ranks = set(entry.get("ranks") or merged["meta"]["ranks"])
        for op in entry.get("op_ranks") or {}:
            assert got[(entry_key(entry), op)] < ranks


@SETTINGS
@given(rank_file_sets(min_files=2, max_files=3))
def test_merging_generated_configs_matches_conservation(docs: list[dict[str, Any]]) -> None:
    generated = []
    for index, doc in enumerate(docs):
        tree = compress_trace(combined(doc), RunOptions())
        generated.append(generate_config(tree, f"s{index}", 1))
    merged = generated[0]
    for other in generated[1:]:
        merged = merge_configs(merged, other)
    assert merged["meta"]["total"] == sum(doc_total(d) for d in docs)
    expected: Counter[str] = Counter()
    for config in generated:
        expected += _op_totals(config)
    assert _op_totals(merged) == expected


# ----------------------------------------------------------------------------- filter


@SETTINGS
@given(configs())
def test_basic_filter_is_idempotent(config: CommentedMap) -> None:
    options = RunOptions(basic=True)
    once = opguard_filter(copy.deepcopy(config), options)
    twice = opguard_filter(copy.deepcopy(once), options)
    assert plain(once) == plain(twice)
    reparsed = opguard_filter(parse_config(dump_config(once), "f.yaml"), options)
    assert dump_config(reparsed) == dump_config(once)
    kept = {entry_key(e) for e in once["entries"]}
    assert kept <= {entry_key(e) for e in config["entries"]}
    assert all(e["kind"] in ("function", "method") for e in once["entries"])


# ----------------------------------------------------------------------------- YAML


@SETTINGS
@given(configs())
def test_config_yaml_round_trip_is_lossless(config: CommentedMap) -> None:
    text = dump_config(config)
    loaded = parse_config(text, "c.yaml")
    assert plain(loaded) == plain(config)
    assert dump_config(loaded) == text


@pytest.mark.slow  # > 4 s: the slow group
@SETTINGS
@given(configs(source="a"), configs(source="b"), st.data())
def test_person_added_comments_survive_load_merge_and_dump(
    left: CommentedMap, right: CommentedMap, data: st.DataObject
) -> None:
    text = dump_config(left)
    lines = text.splitlines()
    targets = [i for i, line in enumerate(lines) if line.startswith("  - target: ")]
    text = "# reviewed by the ops team\n" + text
    if targets:
        chosen = data.draw(st.sampled_from(targets))
        lines[chosen] += "  # keep an eye on this one"
        text = "# reviewed by the ops team\n" + "\n".join(lines) + "\n"
    loaded = parse_config(text, "a.yaml")
    assert dump_config(loaded) == text
    merged = dump_config(merge_configs(loaded, right))
    assert merged.startswith("# reviewed by the ops team\n")
    if targets:
        assert "# keep an eye on this one" in merged
    filtered = dump_config(opguard_filter(parse_config(merged, "m.yaml"), RunOptions(basic=True)))
    assert filtered.startswith("# reviewed by the ops team\n")


@pytest.mark.parametrize("part", [1, 2, 3, 1000])
def test_a_trace_written_in_parts_is_the_trace_encoded_whole(
    part: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The combined trace is written part by part (its callsites a few thousand at a
    time); the parts join into the document encoded whole, one callsite per line,
    extras and all."""
    import msgspec

    from opguard_core.formats import trace as trace_format
    from opguard_core.formats.trace import Callsite

    sites = [Callsite(stack=(0,) * i, op="aten::mm", role="compute", count=i + 1) for i in range(5)]
    extras = {1: {"x": 1}, 4: {"y": [1]}}
    for callsite_extras in ({}, extras):
        trace = CallsiteTrace(
            meta={"ranks": [0]}, frames=[], callsites=sites, callsite_extras=callsite_extras
        )
        monkeypatch.setattr(trace_format, "PART_CALLSITES", part)
        lines = []
        for index, site in enumerate(sites):
            doc = {"stack": site.stack, "op": site.op, "role": "compute", "count": site.count}
            lines.append(msgspec.json.encode({**doc, **callsite_extras.get(index, {})}))
        written = trace.to_json()
        assert written.split(b'"callsites":[\n')[1] == b",\n".join(lines) + b"\n]}\n"
        assert len(list(trace.json_parts())) >= 4 + (len(sites) - 1) // part
