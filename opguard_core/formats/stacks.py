"""A call tree as flat stacks: what the export formats (collapsed, speedscope, pprof) draw.

One :class:`Stack` per (node, op, stream role) with own ops: the frames from the
root's child down to the node (``module:qualname``) with each frame's file and first
line, the op and stream role, and the count. The stacks' counts add up to the tree's root count
(conservation, formats.md §2).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from opguard_core.formats.streams import COMPUTE, sorted_roles
from opguard_core.formats.tree import node_target


class Stack(NamedTuple):
    frames: tuple[str, ...]
    op: str
    #: the stream role
    stream: str
    weight: int
    #: per frame, (file, first line) as the tree's node records them (``""`` and 0 where
    #: it has none, e.g. a torch api); parallel to ``frames``, or empty when unknown
    sites: tuple[tuple[str, int], ...] = ()


def tree_stacks(tree: dict[str, Any]) -> list[Stack]:
    """Every (node, op, stream role) of ``tree`` with own ops, depth first (iterative).

    A node's own ops are split over streams by ``self_streams`` in op order; the
    tree records ops and streams separately, so where a node has several of both
    the split is an attribution, not a measurement (their totals are exact).
    """
    out: list[Stack] = []
    # a path is a linked list (target, site, parent's path), made into tuples only for
    # a node with own ops: a deep tree costs memory linear in its size, not in depth²
    Link = tuple[str, tuple[str, int], "Any"] | None
    todo: list[tuple[dict[str, Any], Link]] = [(tree["root"], None)]
    while todo:
        node, link = todo.pop()
        pieces = split_streams(node["self_ops"], node["self_streams"])
        if pieces:
            path, sites = _unlink(link)
            out.extend(Stack(path, op, stream, count, sites) for op, stream, count in pieces)
        for child in reversed(node.get("children", [])):
            site = (child.get("file") or "", min(child.get("lines") or [0]))
            todo.append((child, (node_target(child), site, link)))
    return out


def _unlink(link: Any) -> tuple[tuple[str, ...], tuple[tuple[str, int], ...]]:
    names: list[str] = []
    sites: list[tuple[str, int]] = []
    while link is not None:
        names.append(link[0])
        sites.append(link[1])
        link = link[2]
    return tuple(reversed(names)), tuple(reversed(sites))


def split_streams(
    self_ops: dict[str, int], self_streams: dict[str, int]
) -> list[tuple[str, str, int]]:
    """(op, role, count) triples whose op sums are ``self_ops`` and role sums
    ``self_streams``: ops and roles are paired off in sorted order (roles by
    :func:`~opguard_core.formats.streams.role_order`)."""
    streams = [(s, c) for s, c in sorted_roles(self_streams) if c > 0]
    out: list[tuple[str, str, int]] = []
    index = 0
    left = streams[0][1] if streams else 0
    for op, count in sorted(self_ops.items()):
        while count > 0 and index < len(streams):
            take = min(count, left)
            out.append((op, streams[index][0], take))
            count -= take
            left -= take
            if left == 0:
                index += 1
                left = streams[index][1] if index < len(streams) else 0
        if count > 0:  # self_streams sum short (the tree check forbids it): compute
            out.append((op, COMPUTE, count))
    return out
