"""The ``shallow`` compressor: a call tree no deeper than ``K`` levels.

It runs the built-in compressor (hide plumbing frames, fold, prune subtrees, fold
chains) and then folds every node deeper than ``K`` into its ancestor at depth
``K`` (the root's children are at depth 1): the ancestor takes the folded nodes'
ops as its own, so counts are conserved and the result is still a valid
``opguard-calltree`` document. A guard built from it wraps only the outer layers of
a program, each with every op that runs below it.

``K`` comes from ``$OPGUARD_EXAMPLE_MAX_DEPTH`` (default 3). Once installed, it
replaces the built-in compressor (which is ``trylast``) on every run; ``opguard run
--compressor compress`` picks the built-in instead, ``--disable-plugin shallow``
blocks this one.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

from opguard_core import hookimpl
from opguard_core.combine.accumulator import CallsiteTrace
from opguard_core.errors import OpGuardError
from opguard_core.formats.dtypes import sorted_dtypes
from opguard_core.formats.streams import sorted_roles
from opguard_core.model import RunOptions
from opguard_plugins.stages.compress import compress_trace

MAX_DEPTH_ENV = "OPGUARD_EXAMPLE_MAX_DEPTH"
DEFAULT_MAX_DEPTH = 3


def max_depth() -> int:
    """``K`` from ``$OPGUARD_EXAMPLE_MAX_DEPTH`` (default 3, at least 1)."""
    raw = os.environ.get(MAX_DEPTH_ENV, "").strip()
    if not raw:
        return DEFAULT_MAX_DEPTH
    if not raw.isdigit() or int(raw) < 1:
        raise OpGuardError(f"${MAX_DEPTH_ENV}={raw!r}: expected an integer >= 1")
    return int(raw)


def _op_ranks(node: dict[str, Any]) -> dict[str, set[int]]:
    """Which ranks ran each of ``node``'s own ops (tree version 6: an op its
    ``self_op_ranks`` does not list ran on all of the node's ranks)."""
    listed = node.get("self_op_ranks", {})
    return {op: set(listed.get(op, node["ranks"])) for op in node["self_ops"]}


def _fold_subtrees(node: dict[str, Any]) -> None:
    """Move the own counts of every node below ``node`` into ``node``, and which ranks
    ran each op; drop its children."""
    ops: Counter[str] = Counter(node["self_ops"])
    streams: Counter[str] = Counter(node["self_streams"])
    dtypes: Counter[str] = Counter(node["self_dtypes"])
    ran = _op_ranks(node)
    stack = list(node["children"])
    while stack:
        below = stack.pop()
        ops.update(below["self_ops"])
        streams.update(below["self_streams"])
        dtypes.update(below["self_dtypes"])
        for op, ranks in _op_ranks(below).items():
            ran.setdefault(op, set()).update(ranks)
        stack.extend(below["children"])
    node["self_ops"] = dict(sorted(ops.items()))
    node["self_streams"] = dict(sorted_roles(streams))  # stream roles, compute first
    node["self_dtypes"] = dict(sorted_dtypes(dtypes))  # tree version 5: by dtype name
    # tree version 6: the ops not all of the node's ranks ran, with the ranks that did
    everywhere = set(node["ranks"])
    some = {op: sorted(ranks) for op, ranks in sorted(ran.items()) if ranks != everywhere}
    node.pop("self_op_ranks", None)
    if some:
        node["self_op_ranks"] = some
    node["children"] = []


def limit_depth(root: dict[str, Any], depth: int) -> int:
    """Fold every node deeper than ``depth`` into its ancestor; return the nodes left."""
    left = 0
    level = [(child, 1) for child in root["children"]]
    while level:
        node, at = level.pop()
        left += 1
        if at >= depth:
            _fold_subtrees(node)
        else:
            level.extend((child, at + 1) for child in node["children"])
    return left


@hookimpl
def opguard_compress(trace: CallsiteTrace, options: RunOptions) -> dict[str, Any]:
    depth = max_depth()
    tree = compress_trace(trace, options)
    nodes_after = limit_depth(tree["root"], depth)
    settings = tree["meta"]["compression"]
    settings["compressor"] = "shallow"
    settings["max_depth"] = depth
    settings["nodes_after"] = nodes_after
    return tree
