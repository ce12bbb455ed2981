"""The compressor's fast tree builder against a slow, obviously right reference.

``build_tree`` never builds the whole call tree (see its docstring). The reference
below does: it walks every callsite's stack from the root, creating nodes as it
goes, then folds small subtrees with :func:`prune_subtrees`. Both must give the
same nodes (identity, file, lines, counts, ranks, own ops and streams) and the same
count of nodes before pruning, for any traces and thresholds.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from opguard_core.combined import CallsiteTrace, ranks_to_mask
from opguard_core.model import RunOptions
from opguard_core.tree_format import TORCH_API, split_api, threshold
from opguard_plugins.compress import (
    DEFAULT_HIDE,
    Node,
    api_replaces_frame,
    build_tree,
    count_nodes,
    frame_kind,
    hidden_frames,
)
from tests.strategies import rank_file_sets
from tests.test_properties import combined


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
        node.self_streams[site.stream] += site.count
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
    stack = [root]
    while stack:
        node = stack.pop()
        for key, child in list(node.children.items()):
            if child.count < floor and not holds[id(child)]:
                del node.children[key]
                folded = [child]
                while folded:
                    below = folded.pop()
                    node.self_ops.update(below.self_ops)
                    node.self_streams.update(below.self_streams)
                    folded.extend(below.children.values())
            else:
                stack.append(child)


def state(node: Node) -> dict[str, Any]:
    """Everything a node holds after building and pruning, children by key."""
    return {
        "identity": (node.module, node.file, node.qualname, node.kind),
        "lines": sorted(node.lines),
        "count": node.count,
        "ranks": node.ranks,
        "self_ops": dict(sorted(node.self_ops.items())),
        "self_streams": dict(sorted(node.self_streams.items())),
        "children": {key: state(child) for key, child in sorted(node.children.items())},
    }


def check_against_reference(
    trace: CallsiteTrace, hide: list[str], floor: float, rank_floor: float | None = None
) -> None:
    expected = reference_tree(trace, hide)
    nodes_before = count_nodes(expected)
    prune_subtrees(expected, floor, rank_floor, ranks_to_mask(trace.ranks))
    root, before = build_tree(trace, hide, floor, rank_floor)
    assert before == nodes_before
    assert state(root) == state(expected)


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


@pytest.mark.parametrize("name", ["gpt_callsite", "fsdp_callsite"])
@pytest.mark.parametrize("min_fraction", [0.0, 0.001, 0.01, 0.1])
def test_build_tree_matches_the_reference_on_real_traces(
    samples: Any, name: str, min_fraction: float
) -> None:
    from opguard_core.combined import TraceAccumulator
    from opguard_core.trace_format import load_trace

    accumulator = TraceAccumulator()
    for path in sorted(samples.glob(f"{name}_rank*.json")):
        accumulator.add(load_trace(path))
    trace = accumulator.result()
    options = RunOptions()
    floor = threshold(trace.total, options.min_count, min_fraction)
    check_against_reference(trace, list(DEFAULT_HIDE), floor)
    check_against_reference(trace, list(DEFAULT_HIDE), floor, options.min_count)
