"""Sorted paths and the runs of callsites below every call-tree node (compress).

:func:`opguard_plugins.stages.compress.build_tree` sorts every callsite's *path* (the
fixed-width ids of its nodes' identities, as bytes), so the callsites below any node
form one contiguous run. :class:`PyRuns` answers what the build asks of those runs:
where a run of equal next id ends, its weight (a difference of prefix sums), its
ranks, the ops, streams and dtypes it folds into a node, how many nodes the unpruned tree
has, and the search for rank-divergent nodes below the fraction threshold.

:class:`PyRuns` is the reference implementation. The C extension
``opguard_plugins.stages._runs`` (built by ``setup.py`` where a compiler is found) provides
the same type, which does each of these without a Python-level step per callsite
(docs/performance.md, "Compiled per-site work"); and ``callsite_paths``, which builds
the paths, ``frames_at``, which reads a node's frames, and ``visible_frames``, every
stack's visible frames and calling function for divergence.
:func:`opguard_core.native.load_native` picks the module (``OPGUARD_PURE_PYTHON=1``
forces the references); ``_runs.pyi`` is its stub.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections.abc import Callable, Container
from functools import reduce
from itertools import accumulate, pairwise
from operator import itemgetter, or_
from typing import TYPE_CHECKING, NamedTuple

from opguard_core.formats.trace import Callsite
from opguard_core.native import load_native


class PyRuns:
    """The sorted ``paths`` (bytes, ``width`` bytes an id) of a trace's callsites,
    with each one's ``counts``, rank ``masks`` (``all_mask``: every rank), ``ops``,
    ``streams`` (stream roles) and ``dtypes`` (None: the op had none); positions are
    indices into the sorted order."""

    def __init__(
        self,
        paths: list[bytes],
        counts: list[int],
        masks: list[int],
        all_mask: int,
        ops: list[str],
        streams: list[str],
        dtypes: list[str | None],
        width: int,
    ) -> None:
        self.paths = list(paths)
        self.counts = list(counts)
        self.masks = list(masks)
        self.all_mask = all_mask
        self.ops = list(ops)
        self.streams = list(streams)
        self.dtypes = list(dtypes)
        self.width = width
        self.below = [0, *accumulate(self.counts)]
        # a run's ranks are all of them as soon as it has one callsite seen on every
        # rank (a callsite's ranks are a subset of the trace's: formats.md §1)
        self.full = [0, *accumulate(mask == all_mask for mask in self.masks)]
        # changes[i]: how many j < i have masks[j] != masks[j - 1]; a run [s, e) has
        # one mask for all its callsites when changes[e] == changes[s + 1]
        self.changes = [0, 0, *accumulate(a != b for a, b in pairwise(self.masks))]

    def weight(self, start: int, end: int) -> int:
        """The total count of positions ``start`` to ``end`` (exclusive)."""
        return self.below[end] - self.below[start]

    def mask(self, start: int, end: int) -> int:
        """The union of the ranks of positions ``start`` to ``end`` (a non-empty run)."""
        if self.full[end] > self.full[start]:
            return self.all_mask
        if self.changes[end] == self.changes[start + 1]:
            return self.masks[start]
        return reduce(or_, self.masks[start:end], 0)

    def uniform(self, start: int, end: int) -> bool:
        """Whether positions ``start`` to ``end`` all have one mask."""
        return self.changes[end] == self.changes[start + 1]

    def skip_ended(self, own: int, start: int, end: int) -> int:
        """The first position from ``start`` whose path is longer than ``own`` bytes
        (paths ending at the node come first in its run: a prefix sorts first)."""
        paths = self.paths
        while start < end and len(paths[start]) == own:
            start += 1
        return start

    def run_end(self, own: int, start: int, end: int) -> int:
        """The end of the run from ``start`` whose id at byte ``own`` is the same."""
        at = slice(own, own + self.width)
        return bisect_right(self.paths, self.paths[start][at], start, end, key=itemgetter(at))

    def id_at(self, own: int, position: int) -> bytes:
        """The id (``width`` bytes) of ``position``'s path at byte ``own``."""
        return self.paths[position][own : own + self.width]

    def ranked_prefix(self, own: int, position: int, ranks: array[int]) -> bytes:
        """The whole 4-byte ids of the first ``own`` bytes of ``position``'s path, each
        replaced by ``ranks[id]`` (big-endian): bytes that sort as the tuples of ranks."""
        prefix = self.paths[position][: max(own, 0)]
        ids = [int.from_bytes(prefix[j : j + 4], "big") for j in range(0, len(prefix) - 3, 4)]
        return b"".join(ranks[i].to_bytes(4, "big") for i in ids)

    def tally(
        self,
        start: int,
        end: int,
        ops: dict[str, int],
        streams: dict[str, int],
        dtypes: dict[str, int],
        op_masks: dict[str, int],
    ) -> None:
        """Add the counts of positions ``start`` to ``end`` to ``ops``, ``streams`` and
        ``dtypes`` (by each position's op, stream role and dtype; a position without a
        dtype adds to the first two only), and or each position's rank mask into
        ``op_masks`` under its op (which ranks ran each op)."""
        counts, my_ops, my_streams, my_dtypes = self.counts, self.ops, self.streams, self.dtypes
        for position in range(start, end):
            count = counts[position]
            op, stream, dtype = my_ops[position], my_streams[position], my_dtypes[position]
            ops[op] = ops.get(op, 0) + count
            op_masks[op] = op_masks.get(op, 0) | self.masks[position]
            streams[stream] = streams.get(stream, 0) + count
            if dtype is not None:
                dtypes[dtype] = dtypes.get(dtype, 0) + count

    def distinct_prefixes(self) -> int:
        """The number of distinct non-empty path prefixes of whole ids: the nodes of
        the unpruned tree below its root (each path's length minus its common prefix
        with the previous one, in ids)."""
        width, total, previous = self.width, 0, b""
        for path in self.paths:
            size = min(len(previous), len(path))
            difference = int.from_bytes(previous[:size], "big") ^ int.from_bytes(path[:size], "big")
            shared = (size * 8 - difference.bit_length()) // 8
            total += len(path) // width - shared // width
            previous = path
        return total

    def divergent(
        self, floor: int, rank_floor: int
    ) -> tuple[list[int], list[tuple[int, int]], list[tuple[int, int]]]:
        """The search for divergent nodes below ``floor`` (an int: a weight is kept at
        ``weight >= floor``): every node met below the skeleton of nodes at or above
        ``floor`` whose weight is at least ``rank_floor``, as ``parent_of`` (by node
        id; -1: a node at or above ``floor``), ``idents`` ((path length, run start) by
        node id) and ``found`` ((weight, node id) of each whose ranks differ from its
        parent's). Nothing is materialised; ids are given in the order nodes are met."""
        width, paths = self.width, self.paths
        parent_of: list[int] = []
        idents: list[tuple[int, int]] = []
        found: list[tuple[int, int]] = []
        search: list[tuple[int, int, int, int, int]] = []
        skeleton = [(0, 0, len(paths), self.all_mask)]
        while skeleton:  # the nodes at or above floor (as the build makes them)
            own, start, end, mask = skeleton.pop()
            start = self.skip_ended(own, start, end)
            while start < end:
                stop = self.run_end(own, start, end)
                weight = self.weight(start, stop)
                if weight >= floor:
                    skeleton.append((own + width, start, stop, self.mask(start, stop)))
                elif weight >= rank_floor:
                    search.append((own + width, start, stop, mask, -1))
                start = stop
        while search:  # below floor: every node that is or may hold a divergent one
            own, start, end, parent_mask, parent = search.pop()
            weight = self.weight(start, end)
            if weight < rank_floor:
                continue  # counts only shrink downwards: nothing below qualifies
            node = len(parent_of)
            parent_of.append(parent)
            idents.append((own, start))
            mask = self.mask(start, end)
            if mask != parent_mask:
                found.append((weight, node))
            if self.uniform(start, end):
                continue  # one mask for every callsite: every node below has it
            start = self.skip_ended(own, start, end)
            while start < end:
                stop = self.run_end(own, start, end)
                search.append((own + width, start, stop, mask, node))
                start = stop
        return parent_of, idents, found


class PathTables(NamedTuple):
    """What a callsite's path is made from, as int32 arrays (``array("i")``).

    By frame id: the frame's identity key id (-1: a hidden frame), and its qualname,
    its module (-1: none) and whether the module is ``torch.*``; by api index: the
    api's key id, qualname and module (-2: no frame has it) and whether its module is
    ``torch``. Qualnames and modules are numbered in one table each, so equal ids are
    equal strings (:func:`opguard_plugins.stages.compress.path_tables` says when an api
    replaces a frame; the paths compare those ids).
    """

    frame_keys: array[int]
    frame_quals: array[int]
    frame_mods: array[int]
    frame_torch: array[int]
    api_keys: array[int]
    api_quals: array[int]
    api_mods: array[int]
    api_torch: array[int]


def py_callsite_paths(
    stacks: list[tuple[int, ...]],
    apis: list[str | None],
    api_index: dict[str, int],
    tables: PathTables,
    width: int,
) -> tuple[list[bytes], list[bytes]]:
    """Every callsite's path (the key ids of its visible frames, then its api's) and
    frame path (its visible frame ids), ``width`` bytes an id, big-endian. An api
    whose own Python function is the last visible frame replaces that frame."""
    keys = tables.frame_keys
    key_chunks = [b"" if key < 0 else key.to_bytes(width, "big") for key in keys]
    frame_chunks = [b"" if key < 0 else fid.to_bytes(width, "big") for fid, key in enumerate(keys)]
    api_chunks = [key.to_bytes(width, "big") for key in tables.api_keys]
    quals, mods, torch = tables.frame_quals, tables.frame_mods, tables.frame_torch
    api_quals, api_mods, api_torch = tables.api_quals, tables.api_mods, tables.api_torch
    join = b"".join
    paths: list[bytes] = []
    frame_paths: list[bytes] = []
    # a combined trace's callsites share one tuple per distinct stack (fewer stacks
    # than callsites): its paths are built once, keyed by the tuple's identity
    stack_paths: dict[int, tuple[bytes, bytes]] = {}
    for stack, api in zip(stacks, apis, strict=True):
        known = stack_paths.get(id(stack))
        if known is None:
            known = stack_paths[id(stack)] = (
                join([key_chunks[fid] for fid in stack]),
                join([frame_chunks[fid] for fid in stack]),
            )
        path, frame_path = known
        if api is not None:
            index = api_index[api]
            if frame_path:
                last = int.from_bytes(frame_path[-width:], "big")
                if (
                    mods[last] >= 0
                    and quals[last] == api_quals[index]
                    and (mods[last] == api_mods[index] or (api_torch[index] and torch[last]))
                ):
                    path, frame_path = path[:-width], frame_path[:-width]
            path += api_chunks[index]
        paths.append(path)
        frame_paths.append(frame_path)
    return paths, frame_paths


def py_frames_at(
    frame_paths: list[bytes], origins: list[int], own: int, start: int, end: int
) -> tuple[int, list[int]]:
    """Over positions ``start`` to ``end`` of the sorted frame paths (4-byte big-endian
    frame ids): the frame id at byte ``own`` of the position whose origin (index in
    trace order) is least, and every distinct frame id there, ascending."""
    at = slice(own, own + 4)
    first = min(range(start, end), key=origins.__getitem__)
    chunks = set(map(itemgetter(at), frame_paths[start:end]))
    return int.from_bytes(frame_paths[first][at], "big"), sorted(
        int.from_bytes(chunk, "big") for chunk in chunks
    )


def py_visible_frames(
    stacks: list[tuple[int, ...]], hidden: bytes, user: bytes
) -> tuple[list[list[int]], list[int | None]]:
    """Per stack, its frame ids without the hidden ones (one list per distinct tuple
    object: a combined trace's callsites share one per stack) and its caller: the
    position of the innermost visible user frame, else of the innermost visible
    frame, else None (``hidden`` and ``user``: bytes by frame id, non-zero for true)."""
    known: dict[int, tuple[list[int], int | None]] = {}
    visible: list[list[int]] = []
    callers: list[int | None] = []
    for stack in stacks:
        found = known.get(id(stack))
        if found is None:
            frames = [fid for fid in stack if not hidden[fid]]
            caller = len(frames) - 1 if frames else None
            for position in range(len(frames) - 1, -1, -1):
                if user[frames[position]]:
                    caller = position
                    break
            found = known[id(stack)] = (frames, caller)
        visible.append(found[0])
        callers.append(found[1])
    return visible, callers


def py_site_visible_frames(
    sites: list[Callsite], indices: list[int], hidden: bytes, user: bytes
) -> tuple[list[list[int]], list[int | None]]:
    """:func:`py_visible_frames` of the stacks of ``sites[i]`` for ``i`` in
    ``indices`` (the C ``site_visible_frames`` reads them in place, without a list of
    them: no reference count of a callsite or of its stack written)."""
    return py_visible_frames([sites[i].stack for i in indices], hidden, user)


def py_stack_summary(
    stacks: list[tuple[int, ...]], hidden: bytes, user: bytes, full: bytes
) -> tuple[bytes, bytearray, list[int]]:
    """Divergence's one pass over every stack, in place of a visible-frames list per
    stack: per stack its caller (the frame id :func:`py_visible_frames` gives the
    position of, -1 for none) as native 4-byte ints; per frame id whether it is a
    visible frame of a stack with ``full[i]`` (a callsite every rank ran); and the
    stacks without ``full[i]`` with a visible frame outside that union, ascending
    (``hidden``, ``user``: bytes by frame id; ``full``: bytes by stack)."""
    if len(user) != len(hidden) or len(full) != len(stacks):
        raise ValueError("stack_summary: lengths differ")
    callers = array("i")
    union = bytearray(len(hidden))
    for stack, everywhere in zip(stacks, full, strict=True):
        last = innermost_user = -1
        for fid in stack:
            if not hidden[fid]:
                last = fid
                if user[fid]:
                    innermost_user = fid
                if everywhere:
                    union[fid] = 1
        callers.append(innermost_user if innermost_user >= 0 else last)
    outside = [
        index
        for index, (stack, everywhere) in enumerate(zip(stacks, full, strict=True))
        if not everywhere and any(not hidden[fid] and not union[fid] for fid in stack)
    ]
    return callers.tobytes(), union, outside


def py_site_summary(
    sites: list[Callsite],
    hidden: bytes,
    user: bytes,
    all_mask: int,
    mask_of: Callable[[list[int]], int],
    collective_op: Callable[[str], bool],
    collective_apis: Container[str | None],
) -> tuple[bytes, bytearray, list[int], bytes, bytes, list[int]]:
    """Divergence's one pass over every callsite: :func:`py_stack_summary` of their
    stacks with ``full`` (per site: its ``ranks`` are None or ``mask_of(ranks) ==
    all_mask``, every rank ran it), then ``full`` and per site whether it is a
    collective (``collective_op(op)``, asked once per op, or its api is in
    ``collective_apis``), both as bytes, and the sites not ``full`` whose ``dtype``
    is not None (what ``dtype_mismatch`` reads), ascending. The C ``site_summary`` reads the sites'
    fields in place, without writing their reference counts."""
    full = bytes(site.ranks is None or mask_of(site.ranks) == all_mask for site in sites)
    known: dict[str, bool] = {}
    collective = bytearray(len(sites))
    for index, site in enumerate(sites):
        answer = known.get(site.op)
        if answer is None:
            answer = known[site.op] = bool(collective_op(site.op))
        collective[index] = answer or site.api in collective_apis
    callers, union, outside = py_stack_summary([site.stack for site in sites], hidden, user, full)
    partial_dtyped = [
        index
        for index, (site, everywhere) in enumerate(zip(sites, full, strict=True))
        if not everywhere and site.dtype is not None
    ]
    return callers, union, outside, full, bytes(collective), partial_dtyped


def py_site_touching(sites: list[Callsite], marked: bytes) -> list[int]:
    """:func:`py_touching` of the sites' stacks (the C ``site_touching`` reads them in
    place, without a list of them: no reference count written)."""
    return py_touching([site.stack for site in sites], marked)


def py_touching(stacks: list[tuple[int, ...]], marked: bytes) -> list[int]:
    """The positions of the stacks with a frame id marked (non-zero in ``marked``)."""
    return [index for index, stack in enumerate(stacks) if any(marked[fid] for fid in stack)]


if TYPE_CHECKING:
    from opguard_plugins.stages import _runs

    #: (stacks, apis, api_index, tables, width) -> (paths, frame paths)
    PathsBuilder = Callable[
        [list[tuple[int, ...]], list[str | None], dict[str, int], PathTables, int],
        tuple[list[bytes], list[bytes]],
    ]
    #: (frame paths, origins, own, start, end) -> (first frame id, distinct frame ids)
    FramesReader = Callable[[list[bytes], list[int], int, int, int], tuple[int, list[int]]]
    #: (stacks, hidden, user) -> (visible frames, callers), per stack
    VisibleFrames = Callable[
        [list[tuple[int, ...]], bytes, bytes], tuple[list[list[int]], list[int | None]]
    ]
    #: (sites, hidden, user, all_mask, mask_of, collective_op, collective_apis) ->
    #: (callers, union, outside, full, collective)
    SiteSummary = Callable[
        [
            list[Callsite],
            bytes,
            bytes,
            int,
            Callable[[list[int]], int],
            Callable[[str], bool],
            Container[str | None],
        ],
        tuple[bytes, bytearray, list[int], bytes, bytes, list[int]],
    ]
    #: (sites, indices, hidden, user) -> (visible frames, callers), per index
    SiteVisibleFrames = Callable[
        [list[Callsite], list[int], bytes, bytes], tuple[list[list[int]], list[int | None]]
    ]
    #: (sites, marked) -> positions
    SiteTouching = Callable[[list[Callsite], bytes], list[int]]


def _implementation() -> tuple[
    type[PyRuns] | type[_runs.Runs], PathsBuilder, FramesReader, VisibleFrames
]:
    if load_native("opguard_plugins.stages._runs") is None:
        return PyRuns, py_callsite_paths, py_frames_at, py_visible_frames
    from opguard_plugins.stages._runs import Runs, callsite_paths, frames_at, visible_frames

    return Runs, callsite_paths, frames_at, visible_frames


#: the implementations in use: the runs type, the paths builder and a node's frames
#: (compress), and the visible frames (divergence)
Runs, callsite_paths, frames_at, visible_frames = _implementation()


def _divergence_implementation() -> tuple[SiteSummary, SiteVisibleFrames, SiteTouching]:
    if load_native("opguard_plugins.stages._runs") is None:
        return py_site_summary, py_site_visible_frames, py_site_touching
    from opguard_plugins.stages._runs import site_summary, site_touching, site_visible_frames

    return site_summary, site_visible_frames, site_touching


#: divergence's pass over every callsite, the visible frames of some callsites' stacks,
#: and its search for the callsites whose stack has a marked frame, each read in place
site_summary, site_visible_frames, site_touching = _divergence_implementation()
