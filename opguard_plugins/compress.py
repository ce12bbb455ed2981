"""Stage 3, compress: fold callsite stacks into a call tree, then prune it.

Steps, in order (formats.md §2, docs/compression.md):

1. hide plumbing frames (``Module._call_impl``, decorator wrappers, ...);
2. fold every stack into a trie of nodes, one node per function (identity:
   module or file, qualname, kind), with a ``torch_api`` leaf per ``api``;
3. subtree pruning: fold each subtree whose count is below the threshold into its
   parent's own counts;
4. chain pruning: fold runs of single-child, op-less frame nodes into the deepest
   one, then merge siblings that now share an identity.
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from typing import Any

from opguard_core import hookimpl
from opguard_core.combined import CallsiteTrace, gc_paused, mask_to_ranks
from opguard_core.model import RunOptions
from opguard_core.tree_format import (
    TORCH_API,
    TREE_FORMAT,
    TREE_VERSION,
    split_api,
    target_name,
    threshold,
)

#: Frames that only forward a call; each a regex matching ``module:qualname`` whole.
DEFAULT_HIDE: tuple[str, ...] = (
    r"torch\.nn\.modules\.module:Module\._(wrapped_)?call_impl",
    r"contextlib:.*",
    r"functools:.*",
    r"torch\.utils\._contextlib:.*",
    r"torch\._ops:.*\.__call__",
    r"torch\._compile:.*",
    r"torch\._dynamo\.eval_frame:.*<locals>\._fn",
    r"torch\.distributed\.c10d_logger:.*",
    r"[^:]*:.*<locals>\.(wrapper|wrapped|wrapped_fn|wrapped_func|inner|_fn|decorate_context"
    r"|maybe_fallback|_use_grad)",
)

_COMPREHENSIONS = {"<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>"}
_new_counter = Counter.__new__


def frame_kind(function: str, qualname: str) -> str:
    """Kind of a frame node: lambda, comprehension, module, method or function."""
    if function == "<lambda>":
        return "lambda"
    if function in _COMPREHENSIONS:
        return "comprehension"
    if function == "<module>":
        return "module"
    owner, dot, _ = qualname.rpartition(".")
    if dot and not owner.endswith("<locals>"):
        return "method"
    return "function"


class Node:
    """One call-tree node while compressing."""

    __slots__ = (
        "chain",
        "children",
        "count",
        "file",
        "kind",
        "lines",
        "module",
        "qualname",
        "ranks",
        "self_ops",
        "self_streams",
    )

    def __init__(self, module: str | None, file: str | None, qualname: str, kind: str) -> None:
        self.module = module
        self.file = file
        self.qualname = qualname
        self.kind = kind
        self.lines: set[int] = set()
        self.count = 0
        # Counter() runs Python-level __init__/update; an empty one needs neither
        # (a trie of a large trace has hundreds of thousands of nodes).
        self.self_ops: Counter[str] = _new_counter(Counter)
        self.self_streams: Counter[int] = _new_counter(Counter)
        self.ranks = 0
        self.chain: list[str] = []
        self.children: dict[tuple[str, str, str], Node] = {}

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.module or self.file or "", self.qualname, self.kind)

    @property
    def target(self) -> str:
        return target_name(self.module, self.file, self.qualname)


def hidden_frames(trace: CallsiteTrace, patterns: list[str]) -> list[bool]:
    """For every frame id, whether one of ``patterns`` matches it whole."""
    if not patterns:
        return [False] * len(trace.frames)
    regex = re.compile("|".join(f"(?:{p})" for p in patterns))
    return [
        regex.fullmatch(target_name(f.module, f.file, f.qualname)) is not None for f in trace.frames
    ]


def _api_replaces_frame(
    api_module: str, api_qualname: str, module: str | None, qualname: str
) -> bool:
    """Whether a frame is the api's own Python function (``torch.functional:split``)."""
    if module is None or qualname != api_qualname:
        return False
    return module == api_module or (api_module == "torch" and module.startswith("torch."))


def build_tree(trace: CallsiteTrace, hide: list[str]) -> Node:
    """Fold every callsite's stack into a trie below a ``<root>`` node."""
    return _build_tree(trace, hide)[0]


def _build_tree(
    trace: CallsiteTrace, hide: list[str], min_count: int = 0, min_fraction: float = 0.0
) -> tuple[Node, int]:
    """The trie of :func:`build_tree` already pruned at ``threshold(total, min_count,
    min_fraction)``, and the number of non-root nodes of the unpruned trie.

    A trie of a large trace has hundreds of thousands of nodes, most of them in
    deep, rarely run suffixes that subtree pruning folds away. So the trie is first
    built as bare integer ids (parent, origin frame), which is cheap; counts
    are made inclusive in one backward sweep; then only nodes at or above the
    threshold become :class:`Node` objects. Since inclusive counts never grow
    going down a path, that is the set of nodes :func:`prune_subtrees` keeps, and
    a callsite's ops go to the deepest kept node of its path, which is where
    pruning would have folded them: the result is the same tree.

    Callsites come sorted by stack, so consecutive ones share long prefixes: the
    walk restarts where a path leaves the previous one.
    """
    hidden = hidden_frames(trace, hide)
    frames = trace.frames
    frame_keys = [
        (f.module or f.file, f.qualname, frame_kind(f.function, f.qualname)) for f in frames
    ]
    all_mask = sum(1 << r for r in trace.ranks)
    api_cache: dict[str, tuple[str, str]] = {}
    # child lookup by one int: parent id * width + key id (no tuple hashing in the loop)
    key_ids: dict[tuple[str | None, str, str], int] = {}
    frame_key_ids = [key_ids.setdefault(key, len(key_ids)) for key in frame_keys]
    width = len(frames) + len(trace.callsites) + 1  # > every key id, frame or api
    ids: dict[int, int] = {}
    parent = [-1]  # id 0 is the root
    origin = [-1]  # the frame that made the node; -1 for the root and torch_api nodes
    api_keys: dict[int, tuple[str, str, str]] = {}  # the key of each torch_api node
    terminal: list[int] = []
    line_pairs: list[tuple[int, int]] = []  # (node, frame) when the frame is not the origin
    previous: list[int] = []
    walk = [0]  # walk[i]: the node reached after previous[:i]
    for site in trace.callsites:
        path = [i for i in site.stack if not hidden[i]]
        api = None
        if site.api is not None:
            api = api_cache.get(site.api)
            if api is None:
                api = api_cache[site.api] = split_api(site.api)
            if path:
                last = frames[path[-1]]
                if _api_replaces_frame(api[0], api[1], last.module, last.qualname):
                    path.pop()
        shared = _common_prefix(previous, path)
        del walk[shared + 1 :]
        node = walk[shared]
        for fid in path[shared:]:
            lookup = node * width + frame_key_ids[fid]
            child = ids.get(lookup)
            if child is None:
                child = ids[lookup] = len(parent)
                parent.append(node)
                origin.append(fid)
            elif origin[child] != fid:
                line_pairs.append((child, fid))
            walk.append(child)
            node = child
        previous = path
        if api is not None:
            key = (api[0], api[1], TORCH_API)
            kid = key_ids.get(key)
            if kid is None:
                kid = key_ids[key] = len(key_ids)
            lookup = node * width + kid
            child = ids.get(lookup)
            if child is None:
                child = ids[lookup] = len(parent)
                parent.append(node)
                origin.append(-1)
                api_keys[child] = key
            node = child
        terminal.append(node)
    del ids, walk
    counts = [0] * len(parent)
    ranks = [0] * len(parent)
    for site, node in zip(trace.callsites, terminal, strict=True):
        counts[node] += site.count
        ranks[node] |= all_mask if site.ranks is None else sum(1 << r for r in site.ranks)
    for nid in range(len(parent) - 1, 0, -1):
        up = parent[nid]
        counts[up] += counts[nid]
        ranks[up] |= ranks[nid]
    floor = threshold(counts[0], min_count, min_fraction)
    root = Node(None, None, "<root>", "root")
    root.count = counts[0]
    kept: dict[int, Node] = {0: root}
    for nid in range(1, len(parent)):
        if counts[nid] < floor:
            continue
        fid = origin[nid]
        if fid >= 0:
            key = frame_keys[fid]
            frame = frames[fid]
            node_obj = Node(frame.module, frame.file, frame.qualname, key[2])
        else:
            key = api_keys[nid]
            node_obj = Node(key[0], None, key[1], TORCH_API)
        node_obj.count = counts[nid]
        node_obj.ranks = ranks[nid]
        kept[parent[nid]].children[key] = node_obj
        kept[nid] = node_obj
    for nid, node_obj in kept.items():
        if origin[nid] >= 0:
            node_obj.lines.add(frames[origin[nid]].line)
    for nid, fid in line_pairs:
        if counts[nid] >= floor:
            kept[nid].lines.add(frames[fid].line)
    for site, nid in zip(trace.callsites, terminal, strict=True):
        while nid and counts[nid] < floor:  # the root is never pruned
            nid = parent[nid]
        target = kept[nid]
        target.self_ops[site.op] += site.count
        target.self_streams[site.stream] += site.count
    return root, len(parent) - 1


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of ``a`` and ``b`` (binary search on slices)."""
    low, high = 0, min(len(a), len(b))
    if a[:high] == b[:high]:
        return high
    while low < high:  # invariant: a[:low] == b[:low] and a[:high+?] differs
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


def count_nodes(root: Node) -> int:
    """Number of non-root nodes."""
    total = 0
    stack = list(root.children.values())
    while stack:
        node = stack.pop()
        total += 1
        stack.extend(node.children.values())
    return total


def _absorb(into: Node, subtree: Node) -> None:
    stack = [subtree]
    while stack:
        node = stack.pop()
        if node.self_ops:
            into.self_ops.update(node.self_ops)
            into.self_streams.update(node.self_streams)
        stack.extend(node.children.values())


def prune_subtrees(root: Node, floor: float) -> None:
    """Fold every non-root subtree with ``count < floor`` into its parent's own counts."""
    stack = [root]
    while stack:
        node = stack.pop()
        for key, child in list(node.children.items()):
            if child.count < floor:
                del node.children[key]
                _absorb(node, child)
            else:
                stack.append(child)


def _merge_into(into: Node, other: Node) -> None:
    """Merge ``other`` (same identity) into ``into``: counts add, children merge."""
    into.count += other.count
    into.self_ops.update(other.self_ops)
    into.self_streams.update(other.self_streams)
    into.lines |= other.lines
    into.ranks |= other.ranks
    into.chain = sorted(set(into.chain) | set(other.chain))
    if into.file is None or (other.file is not None and other.file < into.file):
        into.file = other.file
    for key, child in other.children.items():
        mine = into.children.get(key)
        if mine is None:
            into.children[key] = child
        else:
            _merge_into(mine, child)


def _is_chain_link(node: Node) -> bool:
    if node.kind == TORCH_API or node.self_ops or len(node.children) != 1:
        return False
    (only,) = node.children.values()
    return only.kind != TORCH_API


def fold_chains(node: Node) -> None:
    """Fold linear chains below ``node`` (bottom-up), merging siblings that collide."""
    folded: dict[tuple[str, str, str], Node] = {}
    for child in node.children.values():
        fold_chains(child)
        while _is_chain_link(child):
            (only,) = child.children.values()
            only.chain = [*child.chain, child.target, *only.chain]
            child = only
        existing = folded.get(child.key)
        if existing is None:
            folded[child.key] = child
        else:
            _merge_into(existing, child)
    node.children = folded


def _node_doc(node: Node) -> dict[str, Any]:
    children = sorted(node.children.values(), key=lambda n: (-n.count, n.key))
    return {
        "module": node.module,
        "qualname": node.qualname,
        "file": node.file,
        "lines": sorted(node.lines),
        "kind": node.kind,
        "count": node.count,
        "self_ops": dict(sorted(node.self_ops.items())),
        "self_streams": {str(s): c for s, c in sorted(node.self_streams.items())},
        "ranks": mask_to_ranks(node.ranks),
        "chain": node.chain,
        "children": [_node_doc(child) for child in children],
    }


def compress_trace(trace: CallsiteTrace, options: RunOptions) -> dict[str, Any]:
    """The built-in compressor: returns the ``opguard-calltree`` document."""
    with gc_paused():  # the trie is acyclic: collections would only rescan it
        return _compress_trace(trace, options)


def _compress_trace(trace: CallsiteTrace, options: RunOptions) -> dict[str, Any]:
    hide = [*(DEFAULT_HIDE if options.default_hide else ()), *options.hide]
    root, nodes_before = _build_tree(trace, hide, options.min_count, options.min_fraction)
    prune_subtrees(root, threshold(root.count, options.min_count, options.min_fraction))
    if options.chains:
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(max(limit, 20_000))
        try:
            fold_chains(root)
        finally:
            sys.setrecursionlimit(limit)
    root_children = sorted(root.children.values(), key=lambda n: (-n.count, n.key))
    meta = dict(trace.meta)
    meta["compression"] = {
        "chains": options.chains,
        "min_count": options.min_count,
        "min_fraction": options.min_fraction,
        "hide": hide,
        "nodes_before": nodes_before,
        "nodes_after": count_nodes(root),
        "total": root.count,
    }
    return {
        "format": TREE_FORMAT,
        "version": TREE_VERSION,
        "meta": meta,
        "root": {
            "name": "<root>",
            "count": root.count,
            "self_ops": dict(sorted(root.self_ops.items())),
            "self_streams": {str(s): c for s, c in sorted(root.self_streams.items())},
            "children": [_node_doc(child) for child in root_children],
        },
    }


@hookimpl(trylast=True)
def opguard_compress(trace: CallsiteTrace, options: RunOptions) -> dict[str, Any]:
    return compress_trace(trace, options)
