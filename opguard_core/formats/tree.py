"""Compressed call tree documents (formats.md §2): names, the invariant check, and the
reader and writer (any depth: docs/formats.md "Deep trees")."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from opguard_core.errors import InputError, InvariantError
from opguard_core.formats import deep_json
from opguard_core.formats.dtypes import is_dtype
from opguard_core.formats.streams import is_role, legacy_side_roles, legacy_stream_counts

if TYPE_CHECKING:
    from opguard_core.combine.accumulator import CallsiteTrace
    from opguard_core.formats.trace import Frame

TREE_FORMAT = "opguard-calltree"
#: version 6 gives a node ``self_op_ranks`` (which ranks ran each of its own ops, where
#: not all of its ranks did) and the tree ``meta.op_ranks`` (formats.md, "Which ranks
#: ran an op"); version 5 gives every node ``self_dtypes`` (its own ops by dtype) and the tree
#: ``meta.dtypes`` (formats.md, "Dtypes"); version 4 writes ``ranks`` (of every node,
#: and ``meta.ranks``) as ranges (:func:`ranks_to_ranges`); version 3 keys
#: ``self_streams`` by stream role (formats.md, "Streams and roles"); versions 1 (raw
#: stream ids), 3 and 4 are read and upgraded (:func:`upgrade_tree`). In memory
#: ``ranks`` are always lists of ranks.
TREE_VERSION = 6
#: the first version whose ``ranks`` are ranges
RANGES_VERSION = 4
#: the first version with ``self_dtypes`` and ``meta.dtypes``
DTYPES_VERSION = 5
#: the first version with ``self_op_ranks`` and ``meta.op_ranks``
OP_RANKS_VERSION = 6
READ_VERSIONS = (1, 3, 4, 5, 6)
#: a run of at least this many consecutive ranks is written as ``[first, last]``
RANGE_MIN = 3
TORCH_API = "torch_api"
#: nodes at this tree level (the root is level 0) and below are written compactly,
#: one line per such subtree: a shallower tree's bytes are msgspec's indented form
COMPACT_LEVEL = 100
#: JSON nesting of a level-``COMPACT_LEVEL`` node (document, root, then a
#: ``children`` list and a node per level)
_COMPACT_NESTING = 2 * COMPACT_LEVEL + 1
#: the deepest tree a compressor may return (levels below the root)
MAX_TREE_DEPTH = 100_000
#: counts are integers in [0, 2**63): what every JSON and YAML reader holds exactly
MAX_COUNT = 2**63 - 1


def split_api(api: str) -> tuple[str, str]:
    """``torch.nn.functional.linear`` → (``torch.nn.functional``, ``linear``).

    Tensor methods (``Tensor.reshape``) live in module ``torch``.
    """
    if api.startswith("Tensor."):
        return "torch", api
    module, dot, name = api.rpartition(".")
    if not dot:
        return "", api
    if module.endswith(".Tensor"):
        return module[: -len(".Tensor")], f"Tensor.{name}"
    return module, name


def api_target(api: str) -> str:
    """The target of a callsite's ``api`` (``torch.nn.functional.linear`` →
    ``torch.nn.functional:linear``), as compress names its ``torch_api`` node."""
    module, qualname = split_api(api)
    return target_name(module, None, qualname)


def target_name(module: str | None, file: str | None, qualname: str) -> str:
    """``module:qualname``, or ``file:qualname`` when the module is unknown."""
    return f"{module or file or '?'}:{qualname}"


def frame_targets(frames: Sequence[Frame]) -> list[str]:
    """:func:`target_name` of each frame, in order (one comprehension, no call per
    frame: a trace has tens of thousands)."""
    return [f"{f.module or f.file or '?'}:{f.qualname}" for f in frames]


class RanUnder:
    """Which (target, context) keys ran in a trace, pruned or not: a key ran where a
    callsite's stack holds its target (a frame's function, or the torch api called)
    below its context's innermost target, at any distance (a run's pruning folds
    what is between). What ``missing`` asks before it says an entry never ran: a
    function that ran too little in a run to be an entry of its own there (below
    its pruning threshold) did run."""

    def __init__(self, trace: CallsiteTrace) -> None:
        names = frame_targets(trace.frames)
        apis = {api: api_target(api) for api in {site.api for site in trace.callsites} if api}
        paths = {
            (*(names[f] for f in site.stack), *((apis[site.api],) if site.api else ()))
            for site in trace.callsites
        }
        #: per target, the paths (outermost first) it is on, and where
        self._at: dict[str, list[tuple[tuple[str, ...], int]]] = {}
        for path in paths:
            for position, name in enumerate(path):
                self._at.setdefault(name, []).append((path, position))

    def __contains__(self, key: object) -> bool:
        if not (isinstance(key, tuple) and len(key) == 2):
            return False
        target, context = key
        found = self._at.get(target, ())
        if not context:
            return bool(found)
        above = context[-1]
        return any(above in path[:position] for path, position in found)


def node_target(node: dict[str, Any]) -> str:
    return target_name(node.get("module"), node.get("file"), node["qualname"])


def threshold(total: float, min_count: int, min_fraction: float) -> float:
    """The smallest count a non-root subtree may have: max(min_count, min_fraction·total)."""
    return max(min_count, min_fraction * total)


def pruning_settings(meta: Mapping[str, Any]) -> tuple[int, float]:
    """A config's (``meta``'s) ``min_count`` and ``min_fraction``, as it was pruned
    with them (their defaults where it does not record them)."""
    settings = meta.get("settings") or {}
    return int(settings.get("min_count", 1) or 0), float(settings.get("min_fraction", 0) or 0)


def pruning_floor(total: float, min_count: int, min_fraction: float) -> int:
    """:func:`threshold` as the whole count a subtree needs to be kept."""
    return math.ceil(threshold(total, min_count, min_fraction))


def iter_nodes(root: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any] | None]]:
    """Every (node, parent) pair, root first, depth first (iterative).

    Raises :class:`InvariantError` when a node is reached twice (a cycle, or a node
    shared by two parents) or the tree is deeper than :data:`MAX_TREE_DEPTH`.
    """
    out: list[tuple[dict[str, Any], dict[str, Any] | None]] = []
    seen: set[int] = set()
    stack: list[tuple[dict[str, Any], dict[str, Any] | None, int]] = [(root, None, 0)]
    while stack:
        node, parent, depth = stack.pop()
        if id(node) in seen:
            where = "root" if parent is None else _safe_target(parent)
            raise InvariantError(f"{where}: the tree has a cycle or a node with two parents")
        if depth > MAX_TREE_DEPTH:
            raise InvariantError(f"the tree is deeper than {MAX_TREE_DEPTH} levels")
        seen.add(id(node))
        out.append((node, parent))
        stack.extend((child, node, depth + 1) for child in reversed(node.get("children", [])))
    return out


def _safe_target(node: dict[str, Any]) -> str:
    try:
        return node_target(node)
    except (KeyError, TypeError):
        return "a node"


def _check_count(where: str, field: str, value: Any) -> None:
    if type(value) is not int or not 0 <= value <= MAX_COUNT:
        shown = repr(value) if len(repr(value)) <= 40 else f"{repr(value)[:37]}..."
        raise InvariantError(f"{where}: {field} {shown} is not an integer in [0, 2**63)")


def _check_site(where: str, node: dict[str, Any]) -> None:
    """A node's ``file`` is a string or null and its ``lines`` a list of integers,
    where it has them (what ``opguard export`` writes into pprof and speedscope)."""
    file = node.get("file")
    if file is not None and type(file) is not str:
        raise InvariantError(f"{where}: file {_short(file)} is not a string")
    lines = node.get("lines", [])
    if type(lines) is not list or any(type(line) is not int for line in lines):
        raise InvariantError(f"{where}: lines {_short(lines)} is not a list of integers")


def check_tree(tree: dict[str, Any], expected_total: int | None = None) -> None:
    """Raise :class:`InvariantError` unless ``tree`` meets every invariant of §2."""
    if not isinstance(tree, dict):
        raise InvariantError(f"compressor returned {type(tree).__name__}, not a call tree")
    if tree.get("format") != TREE_FORMAT or tree.get("version") != TREE_VERSION:
        raise InvariantError(
            f"compressor returned format {tree.get('format')!r} version {tree.get('version')!r},"
            f" expected {TREE_FORMAT!r} version {TREE_VERSION}"
        )
    root, meta = tree.get("root"), tree.get("meta", {})
    if not isinstance(root, dict) or not isinstance(meta, dict):
        raise InvariantError("a call tree's root and meta must be objects")
    for flag in ("dtypes", "op_ranks"):
        value = meta.get(flag, False)
        if type(value) is not bool:
            raise InvariantError(f"meta.{flag} {_short(value)} is not true or false")
    settings = meta.get("compression", {})
    _check_count("root", "count", root.get("count"))
    if expected_total is not None and root["count"] != expected_total:
        raise InvariantError(
            f"root.count {root['count']} != input total {expected_total} (counts not conserved)"
        )
    floor = threshold(
        root["count"], settings.get("min_count", 1), settings.get("min_fraction", 0.0)
    )
    chains = settings.get("chains", False)
    all_ranks = meta.get("ranks")
    nodes = iter_nodes(root)
    holds = _holds_divergence(nodes, all_ranks)
    for node, parent in nodes:
        where = "root" if parent is None else node_target(node)
        if "stack" in node:
            raise InvariantError(f"{where}: compressed tree nodes must not carry a stack")
        _check_site(where, node)
        _check_count(where, "count", node["count"])
        for field in ("self_ops", "self_streams", "self_dtypes"):
            for name, value in node[field].items():
                _check_count(where, f"{field}[{name!r}]", value)
        for name in node["self_streams"]:
            if not is_role(name):
                raise InvariantError(f"{where}: self_streams key {name!r} is not a stream role")
        for name in node["self_dtypes"]:
            if not is_dtype(name):
                raise InvariantError(f"{where}: self_dtypes key {name!r} is not a dtype name")
        own = sum(node["self_ops"].values())
        below = sum(child["count"] for child in node["children"])
        if node["count"] != own + below:
            raise InvariantError(
                f"{where}: count {node['count']} != own ops {own} + children {below}"
            )
        if own != sum(node["self_streams"].values()):
            raise InvariantError(f"{where}: self_ops and self_streams sums differ")
        typed = sum(node["self_dtypes"].values())
        if typed > own:
            raise InvariantError(f"{where}: self_dtypes sum {typed} is above self_ops' {own}")
        _check_op_ranks(where, node, node.get("ranks", all_ranks) if parent else all_ranks)
        if parent is None:
            continue
        if node["count"] < floor and not (
            node["count"] >= settings.get("min_count", 1) and holds[id(node)]
        ):
            raise InvariantError(f"{where}: count {node['count']} below threshold {floor:g}")
        children = node["children"]
        if (
            chains
            and node["kind"] != TORCH_API
            and own == 0
            and len(children) == 1
            and children[0]["kind"] != TORCH_API
            and node.get("ranks")
            == (parent.get("ranks", all_ranks) if "kind" in parent else all_ranks)
        ):
            raise InvariantError(f"{where}: linear chain left after chain pruning")


def _check_op_ranks(where: str, node: dict[str, Any], ranks: Any) -> None:
    """A node's ``self_op_ranks``: own ops, each run by some of the node's ``ranks``
    but not by all of them (formats.md, "Which ranks ran an op")."""
    op_ranks = node.get("self_op_ranks", {})
    if not isinstance(op_ranks, dict):
        raise InvariantError(f"{where}: self_op_ranks {_short(op_ranks)} is not an object")
    mine = set(ranks) if isinstance(ranks, list) else set()
    for op, ran in op_ranks.items():
        if op not in node["self_ops"]:
            raise InvariantError(f"{where}: self_op_ranks names {op!r}, not one of its own ops")
        if (
            not isinstance(ran, list)
            or not ran
            or any(type(r) is not int for r in ran)
            or ran != sorted(set(ran))
            or not set(ran) < mine
        ):
            raise InvariantError(
                f"{where}: self_op_ranks[{op!r}] {_short(ran)} is not some of the node's ranks"
            )


def _parent_ranks(parent: dict[str, Any], all_ranks: Any) -> Any:
    """A node's parent's ranks; the root's are ``meta.ranks``."""
    return parent.get("ranks", all_ranks) if "kind" in parent else all_ranks


def _holds_divergence(
    nodes: list[tuple[dict[str, Any], dict[str, Any] | None]], all_ranks: Any
) -> dict[int, bool]:
    """For every node (by id): whether it or a node below it has ranks that differ from
    its parent's, or is a chain-folded node (merged siblings can end up with their
    parent's ranks). Such a node may stay below the fraction threshold."""
    holds: dict[int, bool] = {}
    for node, parent in reversed(nodes):  # children before their parents
        mine = parent is not None and (
            node.get("ranks") != _parent_ranks(parent, all_ranks) or bool(node.get("chain"))
        )
        holds[id(node)] = mine or any(holds[id(child)] for child in node["children"])
    return holds


def decode_json(data: bytes, path: Path | str) -> Any:
    """Decode a JSON document of any depth; :class:`InputError` when it is not JSON."""
    try:
        return deep_json.decode(data)
    except MemoryError:
        raise InputError(path, "out of memory decoding the file") from None
    except (msgspec.DecodeError, deep_json.DeepJSONError) as exc:
        raise InputError(path, f"not valid JSON: {exc}") from None


def ranks_to_ranges(ranks: list[int]) -> list[int | list[int]]:
    """Sorted distinct ranks as written in a version-4 tree: each run of at least
    :data:`RANGE_MIN` consecutive ranks as ``[first, last]`` (inclusive), any other
    rank as itself: ``[0, 1, 2, 3, 7, 9, 10]`` → ``[[0, 3], 7, 9, 10]``. One form per
    set of ranks, so the bytes stay deterministic."""
    out: list[int | list[int]] = []
    i, n = 0, len(ranks)
    if n >= RANGE_MIN and ranks[-1] - ranks[0] == n - 1:  # one run (sorted, distinct)
        return [[ranks[0], ranks[-1]]]
    while i < n:
        j = i
        while j + 1 < n and ranks[j + 1] == ranks[j] + 1:
            j += 1
        if j - i + 1 >= RANGE_MIN:
            out.append([ranks[i], ranks[j]])
        else:
            out.extend(ranks[i : j + 1])
        i = j + 1
    return out


def ranges_to_ranks(ranges: Any, where: str = "ranks", top: int | None = None) -> list[int]:
    """The ranks a version-4 ``ranks`` value lists (:func:`ranks_to_ranges`'s inverse).
    Raises :class:`InvariantError` unless it is a list of non-negative integers and
    ``[first, last]`` pairs (first <= last), ascending and disjoint, and, with ``top``,
    none past ``top`` (checked before a range is spelled out: ``[[0, 100000000000]]``
    would not fit in memory)."""
    if not isinstance(ranges, list):
        raise InvariantError(f"{where} must be a list of ranks and [first, last] ranges")
    ranks: list[int] = []
    last = -1
    for item in ranges:
        if type(item) is int:
            first = end = item
        elif isinstance(item, list) and len(item) == 2 and all(type(v) is int for v in item):
            first, end = item
        else:
            raise InvariantError(f"{where}: {_short(item)} is neither a rank nor [first, last]")
        if first <= last or end < first:
            raise InvariantError(
                f"{where}: {_short(item)} is not ascending, disjoint and first <= last"
            )
        if top is not None and end > top:
            raise InvariantError(f"{where}: {_short(item)} is past the last rank, {top}")
        ranks.extend(range(first, end + 1))
        last = end
    return ranks


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def upgrade_tree(tree: dict[str, Any]) -> None:
    """Bring a tree read from a file to the in-memory form of version 6, in place.

    Versions 4 to 6: every ``ranks`` (nodes, ``meta.ranks``; version 6: every value of
    ``self_op_ranks``) from ranges to a list of ranks. Version 3 is that form already.
    Versions before 6: ``meta.op_ranks`` is false (which ranks ran an op was not
    recorded). Versions before 5: every node gets an empty ``self_dtypes`` and
    ``meta.dtypes`` is false (no dtype was recorded). Version 1:
    ``self_streams`` by raw id become counts by role (:func:`legacy_stream_counts`: 0
    is ``compute``, other ids ``side1``, … ascending over the whole tree, a node's
    collective ops ``comm``)."""
    version = tree.get("version")
    if tree.get("format") != TREE_FORMAT or version not in READ_VERSIONS:
        return
    nodes = [node for node, _ in iter_nodes(tree["root"])]
    if version < DTYPES_VERSION:  # where the compress stage writes them
        meta = tree.get("meta")
        if isinstance(meta, dict):
            _insert(meta, "dtypes", False, before="compression")
        for node in nodes:
            _insert(node, "self_dtypes", {}, after="self_streams")
    if version < OP_RANKS_VERSION:  # which ranks ran each op: not recorded
        meta = tree.get("meta")
        if isinstance(meta, dict):
            _insert(meta, "op_ranks", False, before="compression")
    if version >= RANGES_VERSION:
        meta = tree.get("meta")
        if isinstance(meta, dict) and "ranks" in meta:
            meta["ranks"] = ranges_to_ranks(meta["ranks"], "meta.ranks")
        for node in nodes[1:]:
            if "ranks" in node:
                node["ranks"] = ranges_to_ranks(node["ranks"], f"{_safe_target(node)}: ranks")
    if version >= OP_RANKS_VERSION:
        meta = tree.get("meta")
        all_ranks = meta.get("ranks") if isinstance(meta, dict) else None
        for node in nodes:
            held = node.get("self_op_ranks")
            if isinstance(held, dict):
                # none past the node's last rank: a range is spelled out once checked
                mine = node.get("ranks", all_ranks) if node is not nodes[0] else all_ranks
                top = max(mine, default=-1) if mine is not None and _plain_ranks(mine) else None
                where = f"{_safe_target(node)}: self_op_ranks"
                node["self_op_ranks"] = {
                    op: ranges_to_ranks(ran, f"{where}[{op!r}]", top) for op, ran in held.items()
                }
    if version == 1:
        raw = [{int(k): v for k, v in node["self_streams"].items()} for node in nodes]
        sides = legacy_side_roles(stream for streams in raw for stream in streams)
        for node, streams in zip(nodes, raw, strict=True):
            node["self_streams"] = legacy_stream_counts(streams, node["self_ops"], sides)
    tree["version"] = TREE_VERSION


def _insert(
    mapping: dict[str, Any], key: str, value: Any, after: str = "", before: str = ""
) -> None:
    """Set ``mapping[key] = value`` in place, placed right after the key ``after`` or
    before the key ``before`` (at the end where ``mapping`` has neither), so that an
    upgraded tree's keys are in the order a written one's are."""
    items = [(k, v) for k, v in mapping.items() if k != key]
    mapping.clear()
    placed = False
    for name, held in items:
        if name == before and not placed:
            mapping[key], placed = value, True
        mapping[name] = held
        if name == after and not placed:
            mapping[key], placed = value, True
    if not placed:
        mapping[key] = value


def checked_tree(tree: Any, path: Path | str) -> dict[str, Any]:
    """``tree`` (a decoded document) when it is a valid call tree (of a version read,
    upgraded), else InputError."""
    if not isinstance(tree, dict):
        raise InputError(path, "expected a JSON object at top level")
    if tree.get("format") != TREE_FORMAT or tree.get("version") not in READ_VERSIONS:
        raise InputError(  # not "compressor returned": this is a file, read
            path,
            f"unknown format {tree.get('format')!r} version {tree.get('version')!r} (expected "
            f"{TREE_FORMAT!r} version {', '.join(map(str, READ_VERSIONS[:-1]))} or "
            f"{READ_VERSIONS[-1]})",
        )
    try:
        upgrade_tree(tree)
        check_tree(tree)
    except (KeyError, TypeError, AttributeError) as exc:
        raise InputError(path, f"invalid call tree: missing or mistyped {exc}") from None
    except ValueError as exc:  # a version-1 stream id that is not a number
        raise InputError(path, f"invalid call tree: {exc}") from None
    except InvariantError as exc:
        raise InputError(path, str(exc)) from None
    return tree


def load_tree(path: Path) -> dict[str, Any]:
    """Read a ``*_compressed.json`` file (of any depth) and check it."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InputError(path, f"cannot read file: {exc.strerror or exc}") from None
    except MemoryError:
        raise InputError(path, "out of memory reading the file") from None
    return checked_tree(decode_json(data, path), path)


def encode_tree(tree: dict[str, Any]) -> bytes:
    """Canonical JSON of a tree: insertion-ordered keys, one-space indentation; the
    subtree of every node at level :data:`COMPACT_LEVEL` on one line (formats.md);
    ``ranks`` and the values of ``self_op_ranks`` as ranges (:func:`ranks_to_ranges`).
    ``tree`` is left as it was."""
    held: list[tuple[dict[str, Any], str, Any]] = []
    meta = tree.get("meta")
    for holder in [meta] if isinstance(meta, dict) else []:
        held.append((holder, "ranks", holder.get("ranks")))
    nodes = iter_nodes(tree["root"])
    held += [(node, "ranks", node.get("ranks")) for node, _ in nodes[1:]]
    for node, _ in nodes:
        op_ranks = node.get("self_op_ranks")
        if isinstance(op_ranks, dict):
            held += [(op_ranks, op, ran) for op, ran in op_ranks.items()]
    held = [(holder, key, ranks) for holder, key, ranks in held if _plain_ranks(ranks)]
    try:
        for holder, key, ranks in held:
            holder[key] = ranks_to_ranges(sorted(set(ranks)))
        return _encode(tree)
    finally:
        for holder, key, ranks in held:
            holder[key] = ranks


def _plain_ranks(ranks: Any) -> bool:
    return isinstance(ranks, list) and (
        not ranks or (set(map(type, ranks)) == {int} and min(ranks) >= 0)
    )


def _encode(tree: dict[str, Any]) -> bytes:
    if not deep_json.nests_deeper_than(tree, _COMPACT_NESTING):
        try:
            return msgspec.json.format(msgspec.json.encode(tree), indent=1) + b"\n"
        except RecursionError:  # called deep in the stack: the same bytes, iteratively
            pass
    return deep_json.encode_indented(tree, compact_from=_COMPACT_NESTING) + b"\n"
