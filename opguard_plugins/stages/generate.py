"""Stage 4, generate: one instrumentation entry per (target, context) of the tree.

``ops``, ``stream_counts``, ``dtype_counts`` and ``count`` are inclusive (everything that ran while
the target was active in that context); an op is counted once per entry even where
the entry's key recurs along its path. Tags follow the rules in docs/tags.md.
"""

from __future__ import annotations

import sys
from collections import Counter
from typing import Any

from ruamel.yaml.comments import CommentedMap

from opguard_core import hookimpl
from opguard_core.combine.accumulator import mask_to_ranks, ranks_to_mask
from opguard_core.formats.config import CONFIG_VERSION, EntryKey
from opguard_core.formats.dtypes import sorted_dtypes
from opguard_core.formats.op_ranks import ranges_seq
from opguard_core.formats.streams import sorted_roles
from opguard_core.formats.styles import block_map, flow_map, flow_seq
from opguard_core.formats.trace import PHASES, recorded_by
from opguard_core.formats.tree import TORCH_API, iter_nodes, node_target
from opguard_core.model import RunOptions
from opguard_plugins.stages import locations

#: Op-name prefixes (after ``aten::``) that tag an entry ``compute``: matmuls,
#: convolutions, attention, softmax, norms, embeddings, activations, losses.
COMPUTE_PREFIXES = (
    "mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "conv", "_convolution",
    "scaled_dot_product", "_scaled_dot_product", "softmax", "_softmax", "_log_softmax",
    "_safe_softmax", "native_layer_norm", "layer_norm", "native_batch_norm", "batch_norm",
    "group_norm", "native_group_norm", "embedding", "gelu", "tanh", "relu", "silu",
    "nll_loss", "cross_entropy",
)  # fmt: skip

#: Ops whose presence tags an entry ``data_movement`` (copies, gathers, layout changes).
DATA_MOVEMENT_OPS = frozenset(
    {
        "aten::copy_", "aten::_to_copy", "aten::to", "aten::clone", "aten::cat",
        "aten::stack", "aten::contiguous", "aten::index_select", "aten::gather",
        "aten::scatter", "aten::split_with_sizes_copy", "aten::_foreach_copy_",
        "fsdp::all_gather_copy_in", "fsdp::split_with_sizes_copy", "fsdp::chunk_cat",
    }
)  # fmt: skip

#: Top-level packages always counted as library code (an override; the rule is where the
#: module lives, :mod:`opguard_plugins.stages.locations`).
LIBRARY_PACKAGES = locations.LIBRARY_PACKAGES | frozenset(sys.stdlib_module_names)


def tags_for(target: str, kind: str, ops: dict[str, int]) -> list[str]:
    """Tags of an entry, from its target, kind and inclusive ops (docs/tags.md)."""
    module, _, qualname = target.partition(":")
    name = qualname.rsplit(".", 1)[-1].lower()
    tags = set()
    if "forward" in name:
        tags.add("forward")
    if "backward" in name or any("backward" in op for op in ops):
        tags.add("backward")
    if module.startswith("torch.optim") or "optimizer" in qualname.lower():
        tags.add("optimizer")
    if any(op.startswith("c10d::") for op in ops):
        tags.add("communication")
    if any(op in DATA_MOVEMENT_OPS for op in ops):
        tags.add("data_movement")
    if any(op.startswith("aten::") and op[6:].startswith(COMPUTE_PREFIXES) for op in ops):
        tags.add("compute")
    if kind == TORCH_API:
        tags.add("torch_api")
    library = kind == TORCH_API or locations.is_library_module(module)
    tags.add("library" if library else "user")
    return sorted(tags)


class _Entry:
    __slots__ = ("dtypes", "file", "kind", "lines", "op_ranks", "ops", "ranks", "streams")

    def __init__(self) -> None:
        self.kind: str | None = None
        self.file: str | None = None
        self.lines: set[int] = set()
        self.ops: Counter[str] = Counter()
        #: ops by stream role
        self.streams: Counter[str] = Counter()
        #: ops by dtype (formats.md, "Dtypes")
        self.dtypes: Counter[str] = Counter()
        self.ranks: set[int] = set()
        #: which ranks ran each op, as bit masks (formats.md, "Which ranks ran an op")
        self.op_ranks: dict[str, int] = {}


_Sums = tuple[Counter[str], Counter[str], Counter[str]]


def _inclusive_op_ranks(root: dict[str, Any], all_ranks: list[int]) -> dict[int, dict[str, int]]:
    """Which ranks ran each op at or below every node (bit masks by op), keyed by
    ``id(node)``: a node's own op ran on the ranks its ``self_op_ranks`` gives, else on
    all of the node's ranks (the root's, and those of a node that does not say:
    ``all_ranks``, as :func:`~opguard_core.formats.tree.check_tree` reads them)."""
    masks: dict[int, dict[str, int]] = {}
    every = ranks_to_mask(all_ranks)
    for node, parent in reversed(iter_nodes(root)):  # children before their parents
        mine = ranks_to_mask(node["ranks"]) if parent and "ranks" in node else every
        listed = node.get("self_op_ranks") or {}
        ops = {op: ranks_to_mask(listed[op]) if op in listed else mine for op in node["self_ops"]}
        for child in node["children"]:
            for op, mask in masks[id(child)].items():
                ops[op] = ops.get(op, 0) | mask
        masks[id(node)] = ops
    return masks


def _inclusive(root: dict[str, Any]) -> dict[int, _Sums]:
    """Inclusive ops, stream roles and dtypes of every node, keyed by ``id(node)``
    (post-order)."""
    sums: dict[int, _Sums] = {}
    for node, _ in reversed(iter_nodes(root)):  # children before their parents
        ops: Counter[str] = Counter(node["self_ops"])
        streams: Counter[str] = Counter(node["self_streams"])
        dtypes: Counter[str] = Counter(node.get("self_dtypes") or {})
        for child in node["children"]:
            child_ops, child_streams, child_dtypes = sums[id(child)]
            ops.update(child_ops)
            streams.update(child_streams)
            dtypes.update(child_dtypes)
        sums[id(node)] = (ops, streams, dtypes)
    return sums


def _kind_first(kind: str) -> tuple[bool, str]:
    """The order in which one key's kinds win (formats.md §3): any frame's kind before
    ``torch_api``, then the alphabetically smaller, whatever order the tree (by count)
    visits them in."""
    return (kind == TORCH_API, kind)


def collect_entries(tree: dict[str, Any], depth: int) -> dict[EntryKey, _Entry]:
    root = tree["root"]
    sums = _inclusive(root)
    meta = tree.get("meta", {})
    all_ranks = list(meta.get("ranks", []))
    op_masks = _inclusive_op_ranks(root, all_ranks) if meta.get("op_ranks") else {}
    entries: dict[EntryKey, _Entry] = {}
    active: Counter[EntryKey] = Counter()
    # iterative DFS with explicit exit markers, carrying the context's targets
    stack: list[tuple[dict[str, Any], tuple[str, ...], EntryKey | None]] = [
        (child, (), None) for child in reversed(root["children"])
    ]
    while stack:
        node, path, leaving = stack.pop()
        if leaving is not None:
            active[leaving] -= 1
            continue
        target = node_target(node)
        context = path[-depth:] if depth > 0 else ()
        key = (target, context)
        entry = entries.get(key)
        if entry is None:
            entry = entries[key] = _Entry()
        kind = node["kind"]
        if entry.kind is None or _kind_first(kind) < _kind_first(entry.kind):
            entry.kind = kind
        if node.get("file") and (entry.file is None or node["file"] < entry.file):
            entry.file = node["file"]
        entry.lines.update(node.get("lines", ()))
        entry.ranks.update(node.get("ranks", all_ranks))  # none said: every rank's
        if not active[key]:
            ops, streams, dtypes = sums[id(node)]
            entry.ops.update(ops)
            entry.streams.update(streams)
            entry.dtypes.update(dtypes)
        for op, mask in op_masks.get(id(node), {}).items():
            entry.op_ranks[op] = entry.op_ranks.get(op, 0) | mask
        active[key] += 1
        stack.append((node, path, key))
        # only the last ``depth`` targets are ever read: keep no more (a deep tree's
        # paths would otherwise cost memory quadratic in its depth)
        child_path = (*path, target)[-depth:] if depth > 0 else ()
        stack.extend((child, child_path, None) for child in reversed(node["children"]))
    return entries


def run_settings(tree: dict[str, Any], depth: int) -> CommentedMap:
    """``meta.settings``: how the tree was made (from the compressor's own record in
    the tree's ``meta.compression``, so another compressor reports what it did) and
    the context depth; the filter stage adds ``filters``."""
    made = tree.get("meta", {}).get("compression", {})
    settings = block_map(
        (key, flow_seq(made[key]) if isinstance(made[key], list) else made[key])
        for key in ("min_count", "min_fraction", "chains", "hide", "focus", "ignore", "compressor")
        if key in made
    )
    settings["context_depth"] = depth
    return settings


def generate_config(tree: dict[str, Any], source: str, depth: int) -> CommentedMap:
    """The built-in generator: the config mapping for ``tree``."""
    meta_ranks = sorted(tree.get("meta", {}).get("ranks", []))
    # every entry says which dtypes its ops ran in where the traces recorded them
    with_dtypes = tree.get("meta", {}).get("dtypes") is True
    # and which ranks ran its ops, where the compressor recorded it
    with_op_ranks = tree.get("meta", {}).get("op_ranks") is True
    entries = collect_entries(tree, depth)
    out = []
    for (target, context), entry in sorted(entries.items()):
        kind = entry.kind or "function"
        item = CommentedMap()
        item["target"] = target
        item["kind"] = kind
        item["file"] = entry.file
        item["lines"] = flow_seq(sorted(entry.lines))
        item["context"] = flow_seq(context)
        item["tags"] = flow_seq(tags_for(target, kind, entry.ops))
        item["ops"] = block_map(sorted(entry.ops.items()))
        item["stream_counts"] = block_map(sorted_roles(entry.streams))
        if with_dtypes:
            item["dtype_counts"] = block_map(sorted_dtypes(entry.dtypes))
        item["count"] = sum(entry.ops.values())
        ranks = sorted(entry.ranks)
        if ranks != meta_ranks:
            item["ranks"] = flow_seq(ranks)
        everywhere = ranks_to_mask(ranks)
        some = [(op, mask) for op, mask in sorted(entry.op_ranks.items()) if mask != everywhere]
        if some:
            item["op_ranks"] = flow_map((op, ranges_seq(mask_to_ranks(mask))) for op, mask in some)
        out.append(item)
    config = CommentedMap()
    config["version"] = CONFIG_VERSION
    config["source"] = source
    steps = tree.get("meta", {}).get("steps")
    known_steps = isinstance(steps, int) and not isinstance(steps, bool)
    origin = recorded_by(tree.get("meta", {}))
    phase = tree.get("meta", {}).get("phase")
    config["meta"] = block_map(
        [
            ("ranks", flow_seq(meta_ranks)),
            ("total", tree["root"]["count"]),
            ("sources", flow_seq([source])),
            *([("steps", flow_map([(source, steps)]))] if known_steps else []),
            *([("phases", flow_map([(source, phase)]))] if phase in PHASES else []),
            *([("recorded_by", flow_seq([origin]))] if origin else []),
            *([("op_ranks", True)] if with_op_ranks else []),
            ("settings", run_settings(tree, depth)),
        ]
    )
    config["entries"] = out
    return config


@hookimpl(trylast=True)
def opguard_generate(tree: dict[str, Any], source: str, options: RunOptions) -> CommentedMap:
    return generate_config(tree, source, options.context_depth)
