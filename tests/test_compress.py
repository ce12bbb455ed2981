"""The built-in compressor on hand-made traces whose tree can be worked out by hand."""

from __future__ import annotations

from typing import Any

import pytest

from opguard_core.formats.tree import check_tree, node_target
from opguard_core.model import RunOptions
from opguard_plugins.stages.compress import compress_trace, frame_kind
from tests.builders import as_trace, trace_doc

CALL_IMPL = ("torch.nn.modules.module", "Module._call_impl")
WRAPPED = ("torch.nn.modules.module", "Module._wrapped_call_impl")
MAIN = ("train", "main")
STEP = ("train", "step")
MODEL = ("model", "Model.forward")
BLOCK = ("model", "Block.forward")
LINEAR = ("torch.nn.modules.linear", "Linear.forward")


def children(node: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {node_target(c) + f" <{c['kind']}>": c for c in node["children"]}


def compress(*docs: dict[str, Any], **options: Any) -> dict[str, Any]:
    trace = as_trace(*docs)
    tree = compress_trace(trace, RunOptions(**{"min_fraction": 0.0, **options}))
    check_tree(tree, expected_total=trace.total)
    return tree


def test_plumbing_is_hidden_and_chains_fold_into_the_deepest_frame() -> None:
    doc = trace_doc(
        [
            ([MAIN, STEP, WRAPPED, CALL_IMPL, MODEL, WRAPPED, CALL_IMPL, BLOCK, WRAPPED,
              CALL_IMPL, LINEAR], "torch.nn.functional.linear", "aten::addmm", 4),
            ([MAIN, STEP, WRAPPED, CALL_IMPL, MODEL, WRAPPED, CALL_IMPL, BLOCK],
             "torch.relu", "aten::relu", 2),
            ([MAIN, STEP, WRAPPED, CALL_IMPL, MODEL], "torch.cat", "aten::cat", 1),
        ]
    )  # fmt: skip
    tree = compress(doc)
    root = tree["root"]
    assert root["count"] == 7
    (model,) = root["children"]
    # main and step had one child and no ops: folded into Model.forward
    assert node_target(model) == "model:Model.forward"
    assert model["chain"] == ["train:main", "train:step"]
    assert model["kind"] == "method"
    below = children(model)
    assert set(below) == {"model:Block.forward <method>", "torch:cat <torch_api>"}
    block = below["model:Block.forward <method>"]
    assert block["count"] == 6
    # Linear.forward keeps its node above its only (torch_api) child
    linear = children(block)["torch.nn.modules.linear:Linear.forward <method>"]
    (api,) = linear["children"]
    assert (node_target(api), api["kind"], api["self_ops"]) == (
        "torch.nn.functional:linear",
        "torch_api",
        {"aten::addmm": 4},
    )
    assert api["file"] is None and api["lines"] == []
    meta = tree["meta"]["compression"]
    assert meta["nodes_before"] > meta["nodes_after"]
    assert "stack" not in str(tree)


def test_without_hiding_call_impl_nodes_remain() -> None:
    doc = trace_doc([([MAIN, CALL_IMPL, MODEL], "torch.cat", "aten::cat", 1),
                     ([MAIN, CALL_IMPL, BLOCK], "torch.cat", "aten::cat", 1)])  # fmt: skip
    tree = compress(doc, default_hide=False)
    (impl,) = tree["root"]["children"]
    assert node_target(impl) == "torch.nn.modules.module:Module._call_impl"
    assert impl["chain"] == ["train:main"]
    assert tree["meta"]["compression"]["hide"] == []


def test_user_hide_pattern_is_applied_and_recorded() -> None:
    doc = trace_doc([([MAIN, STEP, MODEL], "torch.cat", "aten::cat", 1),
                     ([MAIN, BLOCK], "torch.cat", "aten::cat", 1)])  # fmt: skip
    tree = compress(doc, hide=(r"train:main",), chains=False)
    assert {node_target(c) for c in tree["root"]["children"]} == {
        "train:step",
        "model:Block.forward",
    }
    assert "train:main" in tree["meta"]["compression"]["hide"]


def test_api_takes_the_place_of_its_own_python_frame() -> None:
    embedding = ("torch.nn.functional", "embedding")
    split = ("torch.functional", "split")
    doc = trace_doc([
        ([MODEL, embedding], "torch.nn.functional.embedding", "aten::embedding", 3),
        ([MODEL, split], "torch.split", "aten::split", 2),
    ])  # fmt: skip
    tree = compress(doc)
    (model,) = tree["root"]["children"]
    kinds = {node_target(c): c["kind"] for c in model["children"]}
    assert kinds == {"torch.nn.functional:embedding": "torch_api", "torch:split": "torch_api"}


def test_subtree_pruning_folds_small_subtrees_into_the_parent() -> None:
    doc = trace_doc([
        ([MAIN, MODEL], "torch.mm", "aten::mm", 100),
        ([MAIN, BLOCK], "torch.cat", "aten::cat", 2),
        ([MAIN, STEP], "torch.add", "aten::add", 3),
    ])  # fmt: skip
    tree = compress(doc, min_count=5, chains=False)
    (main,) = tree["root"]["children"]
    assert [node_target(c) for c in main["children"]] == ["model:Model.forward"]
    assert main["self_ops"] == {"aten::add": 3, "aten::cat": 2}
    assert main["self_streams"] == {"compute": 5}
    fraction = compress(doc, min_fraction=0.05, chains=False)
    assert fraction["root"]["children"][0]["self_ops"] == {"aten::add": 3, "aten::cat": 2}


def test_siblings_merge_after_chain_folding() -> None:
    # main -> a -> X and main -> b -> X: after folding a and b into X, the two X merge.
    a, b, x = ("m", "a"), ("m", "b"), ("m", "X.run")
    doc = trace_doc([([a, x], "torch.mm", "aten::mm", 2), ([b, x], "torch.mm", "aten::mm", 3)])
    tree = compress(doc)
    (merged,) = tree["root"]["children"]
    assert node_target(merged) == "m:X.run"
    assert merged["count"] == 5
    assert merged["chain"] == ["m:a", "m:b"]


def test_ranks_of_nodes_follow_the_callsites() -> None:
    r0 = trace_doc([([MAIN, MODEL], "torch.mm", "aten::mm", 1)], rank=0, world_size=2)
    r1 = trace_doc([([MAIN, BLOCK], "torch.mm", "aten::mm", 1)], rank=1, world_size=2)
    tree = compress(r0, r1, chains=False)
    (main,) = tree["root"]["children"]
    assert main["ranks"] == [0, 1]
    assert {node_target(c): c["ranks"] for c in main["children"]} == {
        "model:Model.forward": [0],
        "model:Block.forward": [1],
    }


def test_streams_are_roles_and_ops_without_frames_stay_at_root() -> None:
    """A version-1 trace's stream 7 is side1 (its only stream besides 0)."""
    doc = trace_doc([([], None, "aten::empty", 2)], stream=7)
    tree = compress(doc)
    assert tree["root"]["self_ops"] == {"aten::empty": 2}
    assert tree["root"]["self_streams"] == {"side1": 2}


@pytest.mark.parametrize(
    ("function", "qualname", "kind"),
    [
        ("forward", "Block.forward", "method"),
        ("main", "main", "function"),
        ("inner", "outer.<locals>.inner", "function"),
        ("<lambda>", "f.<locals>.<lambda>", "lambda"),
        ("<listcomp>", "Model.__init__.<locals>.<listcomp>", "comprehension"),
        ("<module>", "<module>", "module"),
    ],
)
def test_frame_kinds(function: str, qualname: str, kind: str) -> None:
    assert frame_kind(function, qualname) == kind


def test_chain_pruning_can_be_turned_off() -> None:
    doc = trace_doc([([MAIN, STEP, MODEL], "torch.mm", "aten::mm", 1)])
    tree = compress(doc, chains=False)
    (main,) = tree["root"]["children"]
    assert node_target(main) == "train:main"
    assert main["chain"] == []
