"""The compressor's fast tree builder against a slow, obviously right reference.

``build_tree`` never builds the whole call tree (see its docstring). The reference
below does: it walks every callsite's stack from the root, creating nodes as it
goes, then folds small subtrees with :func:`prune_subtrees`. Both must give the
same nodes (identity, file, lines, counts, ranks, own ops, streams, dtypes and the
ranks that ran each own op) and the same count of nodes before pruning, for any
traces and thresholds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from opguard_core.combine.accumulator import CallsiteTrace, ranks_to_mask
from opguard_core.formats.tree import TORCH_API, split_api, threshold
from opguard_core.model import RunOptions
from opguard_plugins.stages.compress import (
    DEFAULT_HIDE,
    Node,
    build_tree,
    count_nodes,
    frame_kind,
    hidden_frames,
)
from tests.builders import trace_doc
from tests.strategies import rank_file_sets
from tests.test_properties import combined


def api_replaces_frame(
    api_module: str, api_qualname: str, module: str | None, qualname: str
) -> bool:
    """Whether a frame is the api's own Python function (``torch.functional:split``)."""
    if module is None or qualname != api_qualname:
        return False
    return module == api_module or (api_module == "torch" and module.startswith("torch."))


def reference_tree(trace: CallsiteTrace, hide: list[str]) -> Node:
    """The whole, unpruned call tree, one callsite at a time."""
    hidden = hidden_frames(trace, hide)
    all_mask = ranks_to_mask(trace.ranks)
    root = Node(None, None, "<root>", "root")
    for site in trace.callsites:
        root.count += site.count
        mask = all_mask if site.ranks is None else ranks_to_mask(site.ranks)
        path = [trace.frames[i] for i in site.stack if not hidden[i]]
        api = None if site.api is None else split_api(site.api)
        if api and path and api_replaces_frame(api[0], api[1], path[-1].module, path[-1].qualname):
            path.pop()
        steps: list[tuple[tuple[str, str, str], str | None, str | None, str, int | None]] = [
            (
                (f.module or f.file, f.qualname, frame_kind(f.function, f.qualname)),
                f.module,
                f.file,
                f.qualname,
                f.line,
            )
            for f in path
        ]
        if api:
            steps.append(((api[0], api[1], TORCH_API), api[0], None, api[1], None))
        node = root
        for key, module, file, qualname, line in steps:
            child = node.children.get(key)
            if child is None:  # the first callsite to reach a node gives its module and file
                child = node.children[key] = Node(module, file, qualname, key[2])
            if line is not None:
                child.lines.add(line)
            child.count += site.count
            child.ranks |= mask
            node = child
        node.self_ops[site.op] += site.count
        node.self_streams[site.role] += site.count
        if site.dtype is not None:
            node.self_dtypes[site.dtype] += site.count
        node.self_op_ranks[site.op] = node.self_op_ranks.get(site.op, 0) | mask
    return root


def prune_subtrees(
    root: Node, floor: float, rank_floor: float | None = None, all_mask: int = 0
) -> None:
    """Fold every non-root subtree with ``count < floor`` into its parent's own ops;
    with ``rank_floor``, keep one that is or holds a *divergent* node: a count of at
    least ``rank_floor`` and ranks that differ from its parent's (the root's are
    ``all_mask``), all computed on the whole tree."""
    holds: dict[int, bool] = {}  # node id -> it or a node below it is divergent

    def mark(node: Node, parent_ranks: int) -> bool:
        divergent = (
            rank_floor is not None and node.count >= rank_floor and node.ranks != parent_ranks
        )
        below = [mark(child, node.ranks) for child in node.children.values()]
        holds[id(node)] = divergent or any(below)
        return holds[id(node)]

    for child in root.children.values():
        mark(child, all_mask)
    fold_small(root, floor, lambda child: holds[id(child)])


def fold_small(root: Node, floor: float, keep: Callable[[Node], bool]) -> None:
    """Fold every node below ``floor`` that ``keep`` refuses, with its subtree, into
    its parent's own ops, streams and dtypes."""
    stack = [root]
    while stack:
        node = stack.pop()
        for key, child in list(node.children.items()):
            if child.count < floor and not keep(child):
                del node.children[key]
                folded = [child]
                while folded:
                    below = folded.pop()
                    node.self_ops.update(below.self_ops)
                    node.self_streams.update(below.self_streams)
                    node.self_dtypes.update(below.self_dtypes)
                    for op, mask in below.self_op_ranks.items():
                        node.self_op_ranks[op] = node.self_op_ranks.get(op, 0) | mask
                    folded.extend(below.children.values())
            else:
                stack.append(child)


def bound_rank_nodes(root: Node, floor: float, limit: int, all_mask: int) -> tuple[int, int]:
    """Keep at most ``limit`` of the nodes below ``floor`` and fold the others into
    their parents, on the whole, pruned tree: the divergent nodes below ``floor``
    (ranks differ from the parent's; the root's are ``all_mask``) largest first (by
    count, then path of identities), each with the nodes below ``floor`` on its way
    up while the total stays within ``limit``. Returns (kept, folded)."""
    parents: dict[int, Node] = {}
    small: list[Node] = []
    divergent: list[tuple[int, tuple[tuple[str, str, str], ...], Node]] = []
    todo: list[tuple[Node, int, tuple[tuple[str, str, str], ...]]] = [(root, all_mask, ())]
    while todo:
        node, ranks, path = todo.pop()
        for key, child in node.children.items():
            parents[id(child)] = node
            child_path = (*path, (key[0] or "", key[1], key[2]))
            if child.count < floor:
                small.append(child)
                if child.ranks != ranks:
                    divergent.append((child.count, child_path, child))
            todo.append((child, child.ranks, child_path))
    if len(small) <= limit:
        return len(small), 0
    divergent.sort(key=lambda item: (-item[0], item[1]))
    kept: set[int] = set()
    for _, _, node in divergent:
        way = []
        step: Node | None = node
        while step is not None and step is not root and step.count < floor:
            if id(step) in kept:
                break
            way.append(step)
            step = parents.get(id(step))
        if len(kept) + len(way) <= limit:
            kept.update(map(id, way))
    fold_small(root, floor, lambda child: id(child) in kept)
    return len(kept), len(small) - len(kept)


def state(node: Node) -> dict[str, Any]:
    """Everything a node holds after building and pruning, children by key."""
    return {
        "identity": (node.module, node.file, node.qualname, node.kind),
        "lines": sorted(node.lines),
        "count": node.count,
        "ranks": node.ranks,
        "self_ops": dict(sorted(node.self_ops.items())),
        "self_streams": dict(sorted(node.self_streams.items())),
        "self_dtypes": dict(sorted(node.self_dtypes.items())),
        "self_op_ranks": dict(sorted(node.self_op_ranks.items())),
        "children": {key: state(child) for key, child in sorted(node.children.items())},
    }


def check_against_reference(
    trace: CallsiteTrace,
    hide: list[str],
    floor: float,
    rank_floor: float | None = None,
    limit: int | None = None,
) -> None:
    expected = reference_tree(trace, hide)
    nodes_before = count_nodes(expected)
    prune_subtrees(expected, floor, rank_floor, ranks_to_mask(trace.ranks))
    bounded = (0, 0)
    if rank_floor is not None:
        bounded = bound_rank_nodes(
            expected, floor, 10**9 if limit is None else limit, ranks_to_mask(trace.ranks)
        )
    built = build_tree(trace, hide, floor, rank_floor, limit)
    assert built.nodes_before == nodes_before
    assert (built.rank_kept, built.rank_folded) == bounded
    assert state(built.root) == state(expected)


@pytest.mark.slow  # > 4 s: the slow group
@settings(max_examples=150, deadline=None)
@given(
    rank_file_sets(min_files=1, max_files=3),
    st.booleans(),
    st.one_of(st.just(0.0), st.integers(1, 60).map(float), st.floats(0.0, 200.0)),
)
def test_build_tree_matches_the_reference(
    docs: list[dict[str, Any]], default_hide: bool, floor: float
) -> None:
    hide = list(DEFAULT_HIDE) if default_hide else []
    check_against_reference(combined(*docs), hide, floor)


@settings(max_examples=150, deadline=None)
@given(
    rank_file_sets(min_files=2, max_files=4),
    st.integers(1, 60).map(float),
    st.integers(1, 5).map(float),
)
@pytest.mark.slow  # over 2 s in the quick group
def test_rank_specific_subtrees_are_kept_like_the_reference(
    docs: list[dict[str, Any]], floor: float, rank_floor: float
) -> None:
    """With ``rank_floor`` (``min_count``) a subtree below ``floor`` whose ranks differ
    from its parent's stays, in the fast pass as in the reference."""
    check_against_reference(combined(*docs), list(DEFAULT_HIDE), floor, rank_floor)


@settings(max_examples=150, deadline=None)
@given(
    rank_file_sets(min_files=2, max_files=4),
    st.integers(1, 60).map(float),
    st.integers(1, 3).map(float),
    st.integers(0, 6),
)
@pytest.mark.slow  # over 2 s in the quick group
def test_the_bound_on_rank_nodes_matches_the_reference(
    docs: list[dict[str, Any]], floor: float, rank_floor: float, limit: int
) -> None:
    """With a ``limit``, the nodes kept for divergence are chosen before any is made,
    and the tree is the one the whole pruned tree gives once bounded."""
    check_against_reference(combined(*docs), list(DEFAULT_HIDE), floor, rank_floor, limit)


@pytest.mark.parametrize("name", ["gpt_callsite", "fsdp_callsite"])
@pytest.mark.parametrize("min_fraction", [0.0, 0.001, 0.01, 0.1])
def test_build_tree_matches_the_reference_on_real_traces(
    samples: Any, name: str, min_fraction: float
) -> None:
    from opguard_core.combine.accumulator import TraceAccumulator
    from opguard_core.formats.trace import load_trace

    accumulator = TraceAccumulator()
    for path in sorted(samples.glob(f"{name}_rank*.json")):
        accumulator.add(load_trace(path))
    trace = accumulator.result()
    options = RunOptions()
    floor = threshold(trace.total, options.min_count, min_fraction)
    check_against_reference(trace, list(DEFAULT_HIDE), floor)
    check_against_reference(trace, list(DEFAULT_HIDE), floor, options.min_count)
    check_against_reference(trace, list(DEFAULT_HIDE), floor, options.min_count, limit=3)


def test_the_bound_breaks_ties_by_the_path_from_the_root() -> None:
    """Two rank-specific nodes of one count, one slot left: the one whose path from the
    root sorts first stays (``main.a.q`` before ``main.b.p``, though ``p`` < ``q``)."""
    bulk = [
        ([("app", "main"), ("app", "a")], None, "aten::mm", 1000),
        ([("app", "main"), ("app", "b")], None, "aten::mm", 1000),
    ]
    docs = [
        trace_doc([*bulk, ([("app", "main"), ("app", "a"), ("app", "q")], None, "aten::add", 5)]),
        trace_doc(
            [*bulk, ([("app", "main"), ("app", "b"), ("app", "p")], None, "aten::add", 5)], rank=1
        ),
    ]
    trace = combined(*docs)
    check_against_reference(trace, [], 100.0, 1.0, limit=1)
    built = build_tree(trace, [], 100.0, 1.0, limit=1)
    (main,) = built.root.children.values()
    kept = {key[1]: [k[1] for k in child.children] for key, child in main.children.items()}
    assert kept == {"a": ["q"], "b": []}
    assert (built.rank_kept, built.rank_folded) == (1, 1)
