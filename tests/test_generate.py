"""Generate, merge, compare and the basic filter on hand-made inputs."""

from __future__ import annotations

from typing import Any

from ruamel.yaml.comments import CommentedMap

from opguard_core.formats.config import dump_config, parse_config
from opguard_core.model import RunOptions
from opguard_plugins.stages.basic_filter import load_basic_list, opguard_filter
from opguard_plugins.stages.compare import compare_configs
from opguard_plugins.stages.compress import compress_trace
from opguard_plugins.stages.generate import generate_config, tags_for
from opguard_plugins.stages.merge import merge_configs
from tests.builders import as_trace, trace_doc

MAIN = ("train", "main")
MODEL = ("model", "Model.forward")
BLOCK = ("model", "Block.forward")
RECURSE = ("model", "walk")


def config_of(
    *docs: dict[str, Any], depth: int = 1, source: str = "t", **opts: Any
) -> CommentedMap:
    trace = as_trace(*docs)
    tree = compress_trace(trace, RunOptions(min_fraction=0.0, **opts))
    return generate_config(tree, source, depth)


def by_target(config: CommentedMap) -> dict[tuple[str, tuple[str, ...]], Any]:
    return {(e["target"], tuple(e["context"])): e for e in config["entries"]}


def test_entries_are_inclusive_with_context() -> None:
    doc = trace_doc([
        ([MAIN, MODEL, BLOCK], "torch.mm", "aten::mm", 4),
        ([MAIN, MODEL], "torch.cat", "aten::cat", 1),
        ([MAIN, MODEL, BLOCK], "torch.distributed.all_reduce", "c10d::allreduce_", 2),
    ])  # fmt: skip
    config = config_of(doc, chains=False)
    entries = by_target(config)
    model = entries[("model:Model.forward", ("train:main",))]
    assert model["ops"] == {"aten::cat": 1, "aten::mm": 4, "c10d::allreduce_": 2}
    assert model["count"] == 7 == sum(model["stream_counts"].values())
    assert model["kind"] == "method"
    assert "forward" in model["tags"] and "communication" in model["tags"]
    assert "user" in model["tags"]
    block = entries[("model:Block.forward", ("model:Model.forward",))]
    assert block["count"] == 6
    # top-level entries add up to the total less the root's own ops
    assert sum(e["count"] for e in config["entries"] if not e["context"]) == 7
    assert {k: config["meta"][k] for k in ("ranks", "total", "sources")} == {
        "ranks": [0],
        "total": 7,
        "sources": ["t"],
    }
    assert config["meta"]["settings"]["context_depth"] == 1
    assert "ranks" not in model


def test_context_depth_widens_and_zero_empties() -> None:
    doc = trace_doc([([MAIN, MODEL, BLOCK], "torch.mm", "aten::mm", 4)])
    deep = by_target(config_of(doc, depth=2, chains=False))
    assert ("torch:mm", ("model:Model.forward", "model:Block.forward")) in deep
    flat = config_of(doc, depth=0, chains=False)
    assert all(e["context"] == [] for e in flat["entries"])


def test_recursion_counts_an_op_once_per_entry() -> None:
    doc = trace_doc([([MAIN, RECURSE, RECURSE, RECURSE], "torch.mm", "aten::mm", 5)])
    config = config_of(doc, depth=0, chains=False)
    walk = by_target(config)[("model:walk", ())]
    assert walk["count"] == 5


def test_rank_specific_entries_list_their_ranks() -> None:
    r0 = trace_doc([([MAIN, MODEL], "torch.mm", "aten::mm", 1)], rank=0, world_size=2)
    r1 = trace_doc([([MAIN, BLOCK], "torch.mm", "aten::mm", 1)], rank=1, world_size=2)
    entries = by_target(config_of(r0, r1, chains=False))
    assert entries[("model:Model.forward", ("train:main",))]["ranks"] == [0]
    assert "ranks" not in entries[("train:main", ())]


def test_tags_follow_documented_rules() -> None:
    assert tags_for("torch.optim.adam:Adam.step", "method", {"aten::add_": 1}) == [
        "library",
        "optimizer",
    ]
    assert tags_for("torch:cat", "torch_api", {"aten::cat": 1}) == [
        "data_movement",
        "library",
        "torch_api",
    ]
    assert "backward" in tags_for("x:f", "function", {"aten::mm_backward": 1})
    assert "compute" in tags_for("x:f", "function", {"aten::addmm": 1})


def test_yaml_round_trip_is_exact() -> None:
    doc = trace_doc([([MAIN, MODEL], "torch.mm", "aten::mm", 3)])
    text = dump_config(config_of(doc))
    assert dump_config(parse_config(text, "x.yaml")) == text
    assert "    ops:\n      aten::mm: 3\n" in text  # v2: one op per line


def test_merge_adds_counts_and_unions_sets() -> None:
    a = config_of(
        trace_doc([([MAIN, MODEL], "torch.mm", "aten::mm", 3)], rank=0), source="a", chains=False
    )
    b = config_of(
        trace_doc([([MAIN, MODEL], "torch.mm", "aten::mm", 2), ([MAIN, BLOCK], None, "aten::x", 1)],
                  rank=1),
        source="b",
        chains=False,
    )  # fmt: skip
    merged = merge_configs(a, b)
    entries = by_target(merged)
    model = entries[("model:Model.forward", ("train:main",))]
    assert model["count"] == 5 and model["ops"] == {"aten::mm": 5}
    assert "ranks" not in model
    assert entries[("model:Block.forward", ("train:main",))]["ranks"] == [1]
    assert (merged["meta"]["ranks"], merged["meta"]["total"]) == ([0, 1], 6)
    assert merged["meta"]["sources"] == ["a", "b"]
    assert merged["source"] == "a+b"
    keys = [(e["target"], tuple(e["context"])) for e in merged["entries"]]
    assert keys == sorted(keys)
    # inputs untouched
    assert by_target(a)[("model:Model.forward", ("train:main",))]["count"] == 3


def test_merge_keeps_comments_of_the_left_config() -> None:
    a = config_of(trace_doc([([MAIN, MODEL], "torch.mm", "aten::mm", 3)]), source="a", chains=False)
    text = dump_config(a).replace("entries:", "# reviewed by ops team\nentries:")
    text = text.replace("count: 3", "count: 3  # keep an eye on this")
    b = config_of(trace_doc([([MAIN, MODEL], "torch.mm", "aten::mm", 2)]), source="b")
    merged = dump_config(merge_configs(parse_config(text, "a.yaml"), b))
    assert "# reviewed by ops team" in merged
    assert "# keep an eye on this" in merged


def test_compare_report_sections() -> None:
    a = config_of(trace_doc([([MAIN, MODEL], "torch.mm", "aten::mm", 3)]), source="a", chains=False)
    b_sites = [([MAIN, MODEL], "torch.mm", "aten::mm", 5), ([MAIN, BLOCK], None, "aten::x", 1)]
    b = config_of(
        trace_doc(b_sites),
        source="b",
        chains=False,
    )  # fmt: skip
    report = compare_configs(a, b, "1 (a)", "2 (b)")
    lines = report.splitlines()
    assert lines[0] == "comparison: 1 (a) vs 2 (b)"
    assert lines[2] == "totals:"
    sections = [line for line in lines if line and not line.startswith(" ")]
    assert sections[1:] == ["totals:", "only in 1 (a): 0", "only in 2 (b): 1", "changed: 3"]
    assert "      op aten::mm: 3 -> 5 (+2)" in lines
    assert "  + model:Block.forward  [train:main]  count=1" in lines


def test_basic_filter_drops_utilities_and_non_functions_and_is_idempotent() -> None:
    doc = trace_doc([
        ([MAIN, MODEL], "torch.cat", "aten::cat", 2),
        ([MAIN, MODEL, ("torch.functional", "split")], "torch.split", "aten::split", 1),
        ([MAIN, MODEL, ("torch._tensor", "Tensor.split")], None, "aten::split", 1),
        ([MAIN, MODEL], "Tensor.reshape", "aten::view", 1),
        ([MAIN, MODEL], "torch.nn.functional.linear", "aten::addmm", 4),
        ([MAIN, ("train", "<lambda>")], None, "aten::mm", 1),
    ])  # fmt: skip
    config = config_of(doc, chains=False)
    options = RunOptions(basic=True)
    filtered = opguard_filter(config, options)
    targets = {e["target"] for e in filtered["entries"]}
    assert targets == {"train:main", "model:Model.forward"}
    model = by_target(filtered)[("model:Model.forward", ("train:main",))]
    assert model["ops"]["aten::cat"] == 2  # utilities' ops still counted inclusively
    again = opguard_filter(parse_config(dump_config(filtered), "f.yaml"), options)
    assert dump_config(again) == dump_config(filtered)


def test_basic_list_can_be_replaced_without_code(tmp_path) -> None:
    custom = tmp_path / "list.yaml"
    custom.write_text("utilities: [mm]\nkeep_kinds: [function, method, torch_api]\n")
    rules = load_basic_list(custom)
    assert rules.utilities == frozenset({"mm"})
    doc = trace_doc([([MAIN], "torch.mm", "aten::mm", 1), ([MAIN], "torch.cat", "aten::cat", 1)])
    filtered = opguard_filter(
        config_of(doc, chains=False), RunOptions(basic=True, basic_list=custom)
    )
    assert {e["target"] for e in filtered["entries"]} == {"train:main", "torch:cat"}
    bundled = load_basic_list()
    assert {"cat", "stack", "reshape", "view", "permute", "transpose", "contiguous", "squeeze",
            "unsqueeze", "flatten", "split", "chunk"} <= bundled.utilities  # fmt: skip


def test_an_entrys_kind_is_the_documented_one_whichever_node_counts_more() -> None:
    """Two frames of one target, a method and a lambda (``X.y`` defined both ways):
    the entry's kind is ``lambda`` (alphabetically smaller, formats.md §3) whether the
    method's ops or the lambda's are more (the tree's count order once decided it)."""
    kinds = set()
    for method_count, lambda_count in ((10, 5), (5, 10)):
        doc = trace_doc([
            ([("m", "p"), ("m", "X.y")], None, "aten::mm", method_count),
            ([("m", "p"), ("m", "X.y")], None, "aten::add", lambda_count),
        ])  # fmt: skip
        doc["frames"].append({**doc["frames"][1], "function": "<lambda>", "line": 9})
        doc["callsites"][1]["stack"] = [0, 2]  # the second site: the lambda's frame
        entry = by_target(config_of(doc, chains=False))[("m:X.y", ("m:p",))]
        kinds.add(entry["kind"])
    assert kinds == {"lambda"}


def test_a_merged_source_is_the_union_of_the_sources_names_holding_a_plus() -> None:
    """Entry names may hold ``+``: the merged ``source`` joins ``meta.sources`` (a
    config of ``a+b`` once read as the two sources ``a`` and ``b``)."""
    doc = trace_doc([([MAIN], None, "aten::mm", 1)])
    configs = [config_of(doc, source=name) for name in ("a+b", "b", "a")]
    merged = merge_configs(merge_configs(configs[0], configs[1]), configs[2])
    assert list(merged["meta"]["sources"]) == ["a", "a+b", "b"]
    assert merged["source"] == "a+a+b+b"  # the three names, sorted, joined


def _two_rank_config(log_rank: int | None, total: int | None = 52) -> CommentedMap:
    ranks = "" if log_rank is None else f", ranks: [{log_rank}]"
    meta_total = "" if total is None else f", total: {total}"
    return parse_config(
        "version: 5\n"
        f"meta: {{ranks: [0, 1]{meta_total}}}\n"
        "entries:\n"
        "  - {target: 'app:main', kind: function, context: [], ops: {aten::mm: 2}, count: 2}\n"
        "  - {target: 'app:log_metrics', kind: function, context: [],"
        f" ops: {{aten::add: 50}}, count: 50{ranks}}}\n",
        "c.yaml",
    )


def test_compare_reports_a_rank_specific_entry_that_moved_to_another_rank() -> None:
    """``log_metrics`` ran on rank 1, now on rank 0: a change (it was none)."""
    from opguard_plugins.stages.compare import diff_configs, render_diff

    diff = diff_configs(_two_rank_config(1), _two_rank_config(0), "a", "b")
    (change,) = diff.changed
    assert change.key == ("app:log_metrics", ()) and change.ranks == ([1], [0])
    assert "      ranks: [1] -> [0]" in render_diff(diff)
    widened = diff_configs(_two_rank_config(1), _two_rank_config(None), "a", "b")
    assert [c.ranks for c in widened.changed] == [([1], [0, 1])]  # now on every rank
    assert not diff_configs(_two_rank_config(None), _two_rank_config(None), "a", "b").differs


def test_compare_shows_an_unknown_total_as_unknown_and_no_difference() -> None:
    from opguard_plugins.stages.compare import diff_configs, render_diff

    diff = diff_configs(_two_rank_config(1, total=None), _two_rank_config(1), "a", "b")
    assert not diff.differs
    assert "unknown" in next(line for line in render_diff(diff).splitlines() if "total ops" in line)


def test_a_config_without_meta_sources_keeps_its_name_through_merges() -> None:
    """An old or hand-written config (no ``meta.sources``) is named by its ``source``:
    its name stays in ``meta.sources`` and ``source`` whatever the merge order (it
    was lost at the next merge, and merge was no longer associative)."""
    doc = trace_doc([([MAIN], None, "aten::mm", 1)])
    old, a, b = (config_of(doc, source=name) for name in ("oldsrc", "a", "b"))
    del old["meta"]["sources"]
    left = merge_configs(merge_configs(old, a), b)
    right = merge_configs(old, merge_configs(a, b))
    assert list(left["meta"]["sources"]) == ["a", "b", "oldsrc"] and left["source"] == "a+b+oldsrc"
    assert dump_config(left) == dump_config(right)
