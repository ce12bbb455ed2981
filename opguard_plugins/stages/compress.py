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

import math
import re
from array import array
from collections import Counter, deque
from itertools import groupby
from operator import itemgetter
from typing import Any, NamedTuple

from opguard_core import hookimpl
from opguard_core.combine.accumulator import CallsiteTrace, gc_paused, mask_to_ranks, ranks_to_mask
from opguard_core.configs.selection import compile_patterns
from opguard_core.formats.dtypes import sorted_dtypes
from opguard_core.formats.streams import COMPUTE, sorted_roles
from opguard_core.formats.trace import Frame
from opguard_core.formats.tree import (
    TORCH_API,
    TREE_FORMAT,
    TREE_VERSION,
    frame_targets,
    split_api,
    target_name,
    threshold,
)
from opguard_core.model import RunOptions
from opguard_plugins.stages.sorted_runs import PathTables, Runs, callsite_paths, frames_at

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
    # the same closures of torch's own decorators in traces without qualnames (Kineto's
    # frames name a function, not its class or enclosing function: docs/compression.md)
    r"torch\.[^:]*:(wrapper|wrapped|wrapped_fn|wrapped_func|inner|_fn|decorate_context"
    r"|maybe_fallback|_use_grad)",
)

_DEFAULT_SET = frozenset(DEFAULT_HIDE)

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
        "self_dtypes",
        "self_op_ranks",
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
        #: own ops by stream role
        self.self_streams: Counter[str] = _new_counter(Counter)
        #: own ops by dtype (only ops with one: formats.md, "Dtypes")
        self.self_dtypes: Counter[str] = _new_counter(Counter)
        #: own ops' rank masks: which ranks ran each op (formats.md, "Which ranks ran an op")
        self.self_op_ranks: dict[str, int] = {}
        self.ranks = 0
        #: targets folded into this node by chain pruning, outermost first
        self.chain: list[str] | deque[str] = []
        self.children: dict[tuple[str | None, str, str], Node] = {}

    @property
    def tallies(self) -> tuple[dict[str, int], dict[str, int], dict[str, int], dict[str, int]]:
        """What :meth:`PyRuns.tally` adds a run's ops to."""
        return self.self_ops, self.self_streams, self.self_dtypes, self.self_op_ranks

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.module or self.file or "", self.qualname, self.kind)

    @property
    def target(self) -> str:
        return target_name(self.module, self.file, self.qualname)


def hidden_frames(
    trace: CallsiteTrace, patterns: list[str], names: list[str] | None = None
) -> list[bool]:
    """For every frame id, whether one of ``patterns`` matches it whole (``names``: the
    frames' :func:`target_name`, where the caller has them).

    Each pattern is compiled and matched on its own (never joined into one
    alternation, where inline flags, group names and backreferences would change
    meaning or fail). Patterns that hide nothing are the runner's warnings
    (:func:`opguard_core.configs.selection.unmatched_hide`).
    """
    if not patterns:
        return [False] * len(trace.frames)
    # the built-in patterns are known to join safely: one regex for all of them
    defaults = [p for p in patterns if p in _DEFAULT_SET]
    own = [p for p in patterns if p not in _DEFAULT_SET]
    regexes = compile_patterns(own, "--hide")
    if defaults:
        regexes.insert(0, re.compile("|".join(f"(?:{p})" for p in defaults)))
    if names is None:
        names = frame_targets(trace.frames)
    if len(regexes) == 1:  # the defaults alone: one C-level match per frame
        match = regexes[0].fullmatch
        return [match(name) is not None for name in names]
    return [any(regex.fullmatch(name) is not None for regex in regexes) for name in names]


def path_tables(
    frames: list[Frame],
    hidden: list[bool],
    frame_key_ids: list[int],
    api_parts: list[tuple[str, str]],
    api_key_ids: list[int],
) -> PathTables:
    """The tables :func:`~opguard_plugins.stages.sorted_runs.callsite_paths` builds paths
    from; ``api_parts`` are the apis' (module, qualname) by api index. A callsite's
    innermost visible frame is replaced by its api where it is the api's own Python
    function (``torch.functional:split``): the same qualname, and the api's module or,
    for a ``torch`` api, any ``torch.*`` module."""
    quals: dict[str, int] = {}
    mods: dict[str, int] = {}
    frame_quals = array("i", [quals.setdefault(f.qualname, len(quals)) for f in frames])
    frame_mods = array(
        "i", [-1 if f.module is None else mods.setdefault(f.module, len(mods)) for f in frames]
    )
    return PathTables(  # the apis' strings looked up once the frames' are all numbered
        array("i", [-1 if h else kid for h, kid in zip(hidden, frame_key_ids, strict=True)]),
        frame_quals,
        frame_mods,
        array("i", [f.module is not None and f.module.startswith("torch.") for f in frames]),
        array("i", api_key_ids),
        array("i", [quals.get(qualname, -2) for _, qualname in api_parts]),
        array("i", [mods.get(module, -2) for module, _ in api_parts]),
        array("i", [module == "torch" for module, _ in api_parts]),
    )


#: bytes per id in a path (:func:`build_tree`)
WIDTH = 4


#: an array type code of WIDTH bytes
_ID_TYPE = next(code for code in "IL" if array(code).itemsize == WIDTH)


def _unchunk(chunk: bytes) -> int:
    return int.from_bytes(chunk, "big")


#: At most this many nodes below the fraction threshold are kept because their ranks
#: differ from their parent's; past it, the smallest are folded (docs/compression.md).
MAX_RANK_NODES = 1000


class TreeBuild(NamedTuple):
    """What :func:`build_tree` returns."""

    root: Node
    #: non-root nodes of the unpruned tree
    nodes_before: int
    #: nodes below ``floor`` kept for divergence, and those the ``limit`` folded
    rank_kept: int
    rank_folded: int


def _sortable(key: tuple[str | None, str, str]) -> tuple[str, str, str]:
    return (key[0] or "", key[1], key[2])


def build_tree(
    trace: CallsiteTrace,
    hide: list[str],
    floor: float = 0.0,
    rank_floor: float | None = None,
    limit: int | None = None,
) -> TreeBuild:
    """The call tree of ``trace`` below a ``<root>`` node, pruned at ``floor``, and the
    number of non-root nodes the unpruned tree has.

    With ``rank_floor`` (the ``min_count``), a node is *divergent* when its count is at
    least ``rank_floor`` and its ranks differ from its parent's (the root's ranks are
    all of the trace's); a subtree below ``floor`` is kept all the same when it holds
    a divergent node, so every path to one survives: divergence is never pruned away
    by the fraction. With ``limit``, at most that many nodes below ``floor`` stay:
    the divergent ones are taken largest first (by count, then path of identities),
    each with the nodes below ``floor`` on its way up, while the total stays within
    ``limit`` (one that does not fit is skipped; a smaller one may still fit); every
    other node below ``floor`` is folded into its parent. The nodes to keep are chosen
    before any is made (tests/test_compress_reference.py checks the result against
    the whole tree, pruned, then bounded).

    The tree is the one you get by walking every callsite's stack (without hidden
    frames) from the root, one node per function identity, with a ``torch_api`` leaf
    per api, and then folding every non-root subtree with a count below ``floor``
    into its parent's own ops (tests/test_compress_reference.py checks exactly
    that). But a large trace's whole tree has hundreds of thousands of nodes, nearly
    all in deep, rarely run suffixes that pruning folds away, so it is never built:

    1. every callsite becomes a *path* of identity ids; the paths are sorted, so the
       callsites below any node form one contiguous run;
    2. from the root down, a node's children are the runs of equal next id inside its
       run (found by bisection), and a child's inclusive count is a difference of
       prefix sums. A child below ``floor`` is never made: its run's ops go to the node
       itself, where pruning would have folded them. Work is spent on kept nodes only;
    3. the unpruned tree has one node per distinct path prefix: the sum, over the
       sorted paths, of each one's length minus its common prefix with the previous.

    A node's module and file come from the first callsite (in trace order) that
    reaches it; its lines are those of all the frames it stands for.
    """
    frames = trace.frames
    callsites = trace.callsites
    key_ids: dict[tuple[str | None, str, str], int] = {}
    frame_key_ids = [
        key_ids.setdefault(
            (f.module or f.file, f.qualname, frame_kind(f.function, f.qualname)), len(key_ids)
        )
        for f in frames
    ]
    # Paths are bytes, one fixed-width chunk per id (a hidden frame has none): sorting
    # and slicing bytes is plain memory comparison.
    hidden = hidden_frames(trace, hide)
    apis = [site.api for site in callsites]
    api_names = [api for api in dict.fromkeys(apis) if api is not None]  # first seen first
    api_parts = [split_api(api) for api in api_names]
    api_key_ids = [key_ids.setdefault((m, q, TORCH_API), len(key_ids)) for m, q in api_parts]
    paths, frame_paths = callsite_paths(
        [site.stack for site in callsites],
        apis,
        {api: index for index, api in enumerate(api_names)},
        path_tables(frames, hidden, frame_key_ids, api_parts, api_key_ids),
        WIDTH,
    )
    del apis
    keys = list(key_ids)  # id -> key
    order = sorted(range(len(paths)), key=paths.__getitem__)
    all_mask = ranks_to_mask(trace.ranks)
    sorted_sites = [callsites[j] for j in order]
    # a combined trace's callsites share one ranks list per rank set: one mask each,
    # not an int per callsite (past 62 ranks a mask is an int of its own, 36+ bytes)
    masks: dict[int, int] = {}

    def site_mask(ranks: list[int]) -> int:
        mask = masks.get(id(ranks))
        if mask is None:
            mask = masks[id(ranks)] = ranks_to_mask(ranks)
        return mask

    runs = Runs(
        [paths[j] for j in order],
        [site.count for site in sorted_sites],
        [all_mask if site.ranks is None else site_mask(site.ranks) for site in sorted_sites],
        all_mask,
        [site.op for site in sorted_sites],
        [site.role or COMPUTE for site in sorted_sites],
        [site.dtype for site in sorted_sites],
        WIDTH,
    )
    del paths, sorted_sites
    masks.clear()
    sorted_frame_paths = [frame_paths[j] for j in order]
    del frame_paths
    # a weight is kept at weight >= floor: for an int weight, weight >= ceil(floor)
    floor_count = math.ceil(floor)

    def make_node(key: tuple[str | None, str, str], at: slice, start: int, end: int) -> Node:
        if key[2] == TORCH_API:
            node = Node(key[0], None, key[1], TORCH_API)
        else:
            first, distinct = frames_at(sorted_frame_paths, order, at.start, start, end)
            frame = frames[first]
            node = Node(frame.module, frame.file, frame.qualname, key[2])
            node.lines = {frames[fid].line for fid in distinct}
        node.count = runs.weight(start, end)
        node.ranks = runs.mask(start, end)
        return node

    def divergent_runs() -> tuple[set[tuple[int, int]], int]:
        """The nodes below ``floor`` to keep for divergence, as (path length, run start),
        and how many such nodes the unbounded tree has (the search itself:
        :meth:`PyRuns.divergent`)."""
        assert rank_floor is not None
        parent_of, idents, found = runs.divergent(floor_count, math.ceil(rank_floor))
        # the unbounded tree keeps every divergent node with its way up to floor: a
        # flag a node, not a set of ids (100k nodes and more at 128 ranks, other generator)
        wanted = bytearray(len(parent_of))
        total = 0
        for _, node in found:
            while node >= 0 and not wanted[node]:
                wanted[node] = 1
                total += 1
                node = parent_of[node]
        if limit is None or total <= limit:
            return {idents[n] for n, flag in enumerate(wanted) if flag}, total
        del wanted
        # largest first; ties by the path of identities, as key tuples would sort
        key_order = sorted(range(len(keys)), key=lambda k: _sortable(keys[k]))
        rank_of = array(_ID_TYPE, [0]) * len(keys)  # uint32s
        for position, kid in enumerate(key_order):
            rank_of[kid] = position

        # the path's ids through rank_of, as bytes: they sort as the tuples of ranks
        def path_order(item: tuple[int, int]) -> bytes:
            own, position = idents[item[1]]
            return runs.ranked_prefix(own, position, rank_of)

        # by weight, then each weight's nodes by path as they come: the order of one
        # sort by (-weight, path), without every node's path at once; once ``limit``
        # nodes are kept no other way fits (each adds a node), so the rest is not sorted
        found.sort(key=itemgetter(0), reverse=True)
        kept: set[int] = set()
        for _, same in groupby(found, key=itemgetter(0)):
            if len(kept) >= limit:
                break
            for _, node in sorted(same, key=path_order):
                way = []
                while node >= 0 and node not in kept:
                    way.append(node)
                    node = parent_of[node]
                if len(kept) + len(way) <= limit:
                    kept.update(way)
        return {idents[n] for n in kept}, total

    rank_keep: set[tuple[int, int]] = set()
    rank_total = 0
    if rank_floor is not None:
        rank_keep, rank_total = divergent_runs()

    root = Node(None, None, "<root>", "root")
    root.count = runs.weight(0, len(order))
    nodes_before = runs.distinct_prefixes()
    todo = [(root, 0, 0, len(order))]
    while todo:
        node, offset, start, high = todo.pop()  # offset: bytes of the node's own path
        # callsites whose path ends here come first in the run (a prefix sorts first)
        ended = runs.skip_ended(offset, start, high)
        runs.tally(start, ended, *node.tallies)
        start = ended
        at = slice(offset, offset + WIDTH)
        while start < high:
            end = runs.run_end(offset, start, high)
            if runs.weight(start, end) >= floor_count or (offset + WIDTH, start) in rank_keep:
                key = keys[_unchunk(runs.id_at(offset, start))]
                child = make_node(key, at, start, end)
                node.children[key] = child
                todo.append((child, offset + WIDTH, start, end))
            else:  # pruned: the run's ops are the node's own
                runs.tally(start, end, *node.tallies)
            start = end
    return TreeBuild(root, nodes_before, len(rank_keep), rank_total - len(rank_keep))


def count_nodes(root: Node) -> int:
    """Number of non-root nodes."""
    total = 0
    stack = list(root.children.values())
    while stack:
        node = stack.pop()
        total += 1
        stack.extend(node.children.values())
    return total


def _merge_into(into: Node, other: Node) -> None:
    """Merge ``other`` (same identity) into ``into``: counts add, children merge
    (iteratively, level by level: no recursion per tree level)."""
    todo = [(into, other)]
    while todo:
        into, other = todo.pop()
        into.count += other.count
        into.self_ops.update(other.self_ops)
        into.self_streams.update(other.self_streams)
        into.self_dtypes.update(other.self_dtypes)
        for op, mask in other.self_op_ranks.items():
            into.self_op_ranks[op] = into.self_op_ranks.get(op, 0) | mask
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
                todo.append((mine, child))


def _is_chain_link(node: Node) -> bool:
    if node.kind == TORCH_API or node.self_ops or len(node.children) != 1:
        return False
    (only,) = node.children.values()
    return only.kind != TORCH_API


def fold_chains(root: Node, ranks: int | None = None) -> None:
    """Fold linear chains below ``root`` (bottom-up), merging siblings that collide.

    Every node's children are folded after all of their descendants' (reversed
    pre-order, an explicit stack: no recursion per tree level). A chain's targets
    are prepended to a deque, so a chain thousands of links long costs linear time.
    A link whose ranks differ from its parent's (``ranks`` for the root: all of them;
    the root's own otherwise) is kept, so that the function where a path becomes
    rank-specific stays a node (and a config entry) of its own.
    """
    order: list[Node] = []
    todo = [root]
    while todo:
        node = todo.pop()
        order.append(node)
        todo.extend(node.children.values())
    for node in reversed(order):
        mine = ranks if node is root and ranks is not None else node.ranks
        folded: dict[tuple[str | None, str, str], Node] = {}
        for child in node.children.values():
            if _is_chain_link(child) and child.ranks == mine:
                links: list[str] = []
                while _is_chain_link(child) and child.ranks == mine:
                    links.extend(child.chain)
                    links.append(child.target)
                    (child,) = child.children.values()
                chain = child.chain if isinstance(child.chain, deque) else deque(child.chain)
                chain.extendleft(reversed(links))
                child.chain = chain
            existing = folded.get(child.key)
            if existing is None:
                folded[child.key] = child
            else:
                _merge_into(existing, child)
        node.children = folded


def _op_ranks(node: Node, ranks: int) -> dict[str, list[int]]:
    """``self_op_ranks`` as written: the own ops that not every one of ``ranks`` (the
    node's) ran, by op, each with the ranks that ran it."""
    return {
        op: mask_to_ranks(mask) for op, mask in sorted(node.self_op_ranks.items()) if mask != ranks
    }


def _node_fields(node: Node) -> dict[str, Any]:
    op_ranks = _op_ranks(node, node.ranks)
    return {
        "module": node.module,
        "qualname": node.qualname,
        "file": node.file,
        "lines": sorted(node.lines),
        "kind": node.kind,
        "count": node.count,
        "self_ops": dict(sorted(node.self_ops.items())),
        "self_streams": dict(sorted_roles(node.self_streams)),
        "self_dtypes": dict(sorted_dtypes(node.self_dtypes)),
        **({"self_op_ranks": op_ranks} if op_ranks else {}),
        "ranks": mask_to_ranks(node.ranks),
        "chain": list(node.chain),
        "children": [],
    }


def _sorted_children(node: Node) -> list[Node]:
    return sorted(node.children.values(), key=lambda n: (-n.count, n.key))


def _node_doc(node: Node) -> dict[str, Any]:
    """The document of ``node``'s subtree (built top-down with an explicit stack)."""
    doc = _node_fields(node)
    todo = [(node, doc)]
    while todo:
        parent, parent_doc = todo.pop()
        for child in _sorted_children(parent):
            child_doc = _node_fields(child)
            parent_doc["children"].append(child_doc)
            todo.append((child, child_doc))
    return doc


def compress_trace(trace: CallsiteTrace, options: RunOptions) -> dict[str, Any]:
    """The built-in compressor: returns the ``opguard-calltree`` document."""
    with gc_paused():  # the trie is acyclic: collections would only rescan it
        return _compress_trace(trace, options)


def _compress_trace(trace: CallsiteTrace, options: RunOptions) -> dict[str, Any]:
    hide = [*(DEFAULT_HIDE if options.default_hide else ()), *options.hide]
    floor = threshold(trace.total, options.min_count, options.min_fraction)
    root, nodes_before, rank_kept, rank_folded = build_tree(
        trace, hide, floor, rank_floor=options.min_count, limit=MAX_RANK_NODES
    )
    if options.chains:
        fold_chains(root, ranks_to_mask(trace.ranks))
    root_children = _sorted_children(root)
    meta = dict(trace.meta)
    # whether the recorder recorded dtypes: a node's empty self_dtypes then means its
    # own ops had no tensor argument, not that nobody looked (formats.md, "Dtypes")
    meta["dtypes"] = any(site.dtype is not None for site in trace.callsites)
    # each node says which ranks ran each of its own ops, where not all of its own did
    meta["op_ranks"] = True
    meta["compression"] = {
        "chains": options.chains,
        "min_count": options.min_count,
        "min_fraction": options.min_fraction,
        "hide": hide,
        "focus": list(options.focus),
        "ignore": list(options.ignore),
        "nodes_before": nodes_before,
        "nodes_after": count_nodes(root),
        "rank_nodes_kept": rank_kept,
        "rank_nodes_folded": rank_folded,
        "max_rank_nodes": MAX_RANK_NODES,
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
            "self_streams": dict(sorted_roles(root.self_streams)),
            "self_dtypes": dict(sorted_dtypes(root.self_dtypes)),
            **_root_op_ranks(root, ranks_to_mask(trace.ranks)),
            "children": [_node_doc(child) for child in root_children],
        },
    }


def _root_op_ranks(root: Node, ranks: int) -> dict[str, Any]:
    """The root's ``self_op_ranks`` (against every rank of the trace), where it has any."""
    op_ranks = _op_ranks(root, ranks)
    return {"self_op_ranks": op_ranks} if op_ranks else {}


@hookimpl(trylast=True)
def opguard_compress(trace: CallsiteTrace, options: RunOptions) -> dict[str, Any]:
    return compress_trace(trace, options)
