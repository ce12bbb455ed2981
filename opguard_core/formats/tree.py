"""Compressed call tree documents (formats.md §2): names, the invariant check, and the
reader and writer (any depth: docs/formats.md "Deep trees")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from opguard_core.errors import InputError, InvariantError
from opguard_core.formats import deep_json
from opguard_core.formats.streams import is_role, legacy_side_roles, legacy_stream_counts

TREE_FORMAT = "opguard-calltree"
#: version 3 keys ``self_streams`` by stream role (formats.md, "Streams and roles");
#: version 1 (raw stream ids) is read and upgraded (:func:`upgrade_tree`)
TREE_VERSION = 3
READ_VERSIONS = (1, 3)
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


def target_name(module: str | None, file: str | None, qualname: str) -> str:
    """``module:qualname``, or ``file:qualname`` when the module is unknown."""
    return f"{module or file or '?'}:{qualname}"


def node_target(node: dict[str, Any]) -> str:
    return target_name(node.get("module"), node.get("file"), node["qualname"])


def threshold(total: int, min_count: int, min_fraction: float) -> float:
    """The smallest count a non-root subtree may have: max(min_count, min_fraction·total)."""
    return max(min_count, min_fraction * total)


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


def check_tree(tree: dict[str, Any], expected_total: int | None = None) -> None:
    """Raise :class:`InvariantError` unless ``tree`` meets every invariant of §2."""
    if tree.get("format") != TREE_FORMAT or tree.get("version") != TREE_VERSION:
        raise InvariantError(
            f"compressor returned format {tree.get('format')!r} version {tree.get('version')!r},"
            f" expected {TREE_FORMAT!r} version {TREE_VERSION}"
        )
    root = tree["root"]
    settings = tree.get("meta", {}).get("compression", {})
    _check_count("root", "count", root["count"])
    if expected_total is not None and root["count"] != expected_total:
        raise InvariantError(
            f"root.count {root['count']} != input total {expected_total} (counts not conserved)"
        )
    floor = threshold(
        root["count"], settings.get("min_count", 1), settings.get("min_fraction", 0.0)
    )
    chains = settings.get("chains", False)
    all_ranks = tree.get("meta", {}).get("ranks")
    nodes = iter_nodes(root)
    holds = _holds_divergence(nodes, all_ranks)
    for node, parent in nodes:
        where = "root" if parent is None else node_target(node)
        if "stack" in node:
            raise InvariantError(f"{where}: compressed tree nodes must not carry a stack")
        _check_count(where, "count", node["count"])
        for field in ("self_ops", "self_streams"):
            for name, value in node[field].items():
                _check_count(where, f"{field}[{name!r}]", value)
        for name in node["self_streams"]:
            if not is_role(name):
                raise InvariantError(f"{where}: self_streams key {name!r} is not a stream role")
        own = sum(node["self_ops"].values())
        below = sum(child["count"] for child in node["children"])
        if node["count"] != own + below:
            raise InvariantError(
                f"{where}: count {node['count']} != own ops {own} + children {below}"
            )
        if own != sum(node["self_streams"].values()):
            raise InvariantError(f"{where}: self_ops and self_streams sums differ")
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


def upgrade_tree(tree: dict[str, Any]) -> None:
    """Bring a version-1 tree to version 3 in place: ``self_streams`` by raw id become
    counts by role (:func:`legacy_stream_counts`: 0 is ``compute``, other ids
    ``side1``, … ascending over the whole tree, a node's collective ops ``comm``)."""
    if tree.get("format") != TREE_FORMAT or tree.get("version") != 1:
        return
    nodes = [node for node, _ in iter_nodes(tree["root"])]
    raw = [{int(k): v for k, v in node["self_streams"].items()} for node in nodes]
    sides = legacy_side_roles(stream for streams in raw for stream in streams)
    for node, streams in zip(nodes, raw, strict=True):
        node["self_streams"] = legacy_stream_counts(streams, node["self_ops"], sides)
    tree["version"] = TREE_VERSION


def checked_tree(tree: Any, path: Path | str) -> dict[str, Any]:
    """``tree`` (a decoded document) when it is a valid call tree (of a version read,
    upgraded), else InputError."""
    if not isinstance(tree, dict):
        raise InputError(path, "expected a JSON object at top level")
    try:
        if tree.get("version") in READ_VERSIONS:
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
    subtree of every node at level :data:`COMPACT_LEVEL` on one line (formats.md)."""
    if not deep_json.nests_deeper_than(tree, _COMPACT_NESTING):
        try:
            return msgspec.json.format(msgspec.json.encode(tree), indent=1) + b"\n"
        except RecursionError:  # called deep in the stack: the same bytes, iteratively
            pass
    return deep_json.encode_indented(tree, compact_from=_COMPACT_NESTING) + b"\n"
