"""Stacks interned as dense ids, and the scanner that reads callsites from bytes.

A combine keys its callsites by (stack id, api, op, role, dtype) instead of by the stack's
tuple of frame ids: the tuple is hashed and compared once per distinct stack, not
once per callsite per rank, and a partial result travels with each stack once.

:class:`PyStackTable` is the reference implementation. The C extension
``opguard_core.combine._scan`` (built by ``setup.py`` where a compiler is found) provides
the same table; ``find_callsites`` and ``scan_callsites``, which read a rank file's
``callsites`` array straight from its JSON bytes into keys; ``fold_rank``, which
folds one rank's keys in, per-rank statistics and all; ``merge_packed``, which folds
in a helper's packed partial; ``site_order``, which sorts the sites into
canonical order (:func:`py_site_order` its reference); and ``build_callsites``, which
makes the result's callsites (``accumulator.py_build_callsites`` its reference). See
performance.md, "Folding from the bytes" and "Compiled per-site work".
:func:`opguard_core.native.load_native` picks the module (``OPGUARD_PURE_PYTHON=1``
forces the Python path, which decodes every file with msgspec); ``_scan.pyi`` is its
stub.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from opguard_core.native import load_native


class StackTableLike(Protocol):
    """What the accumulator needs of a stack table (both implementations have it)."""

    def intern(self, stack: Sequence[int]) -> int: ...

    def absorb(self, other: Any, remap: Sequence[int] | None) -> list[int]: ...

    def flat(self) -> tuple[bytes, bytes]: ...

    def canonical(self, new_id: list[int]) -> list[tuple[bytes, tuple[int, ...]]]: ...

    def __getitem__(self, index: int) -> tuple[int, ...]: ...

    def __len__(self) -> int: ...


class PyStackTable:
    """Stacks interned as dense ids (0, 1, ...) in the order first seen."""

    def __init__(self) -> None:
        self.ids: dict[tuple[int, ...], int] = {}
        self.stacks: list[tuple[int, ...]] = []

    def intern(self, stack: Sequence[int]) -> int:
        """The id of ``stack``, added if new."""
        key = tuple(stack)
        index = self.ids.get(key)
        if index is None:
            index = self.ids[key] = len(self.stacks)
            self.stacks.append(key)
        return index

    def absorb(self, other: Any, remap: Sequence[int] | None) -> list[int]:
        """Intern every stack of ``other`` (frame id ``i`` becoming ``remap[i]``, kept
        when ``remap`` is None); the new ids, by ``other``'s id."""
        if remap is None:
            return [self.intern(other[index]) for index in range(len(other))]
        table = list(remap)
        return [
            self.intern([table[frame] for frame in other[index]]) for index in range(len(other))
        ]

    def canonical(self, new_id: list[int]) -> list[tuple[bytes, tuple[int, ...]]]:
        """For every stack id, its frame ids through ``new_id``: as big-endian uint32
        bytes (which sort as the tuples of ids do: fixed width, a prefix first, but
        compare with one memcmp) and as a tuple."""
        out = []
        for stack in self.stacks:
            mapped = tuple(new_id[frame] for frame in stack)
            ids = array.array("I", mapped)
            if sys.byteorder == "little":
                ids.byteswap()
            out.append((ids.tobytes(), mapped))
        return out

    def flat(self) -> tuple[bytes, bytes]:
        """Every stack's frame ids end to end, and the stacks' lengths (uint32 bytes)."""
        ids = array.array("I")
        for stack in self.stacks:
            ids.extend(stack)
        return ids.tobytes(), array.array("I", map(len, self.stacks)).tobytes()

    @classmethod
    def from_flat(cls, ids: bytes, lengths: bytes) -> PyStackTable:
        """The inverse of :meth:`flat`."""
        table = cls()
        flat = array.array("I")
        flat.frombytes(ids)
        sizes = array.array("I")
        sizes.frombytes(lengths)
        start = 0
        for size in sizes:
            table.intern(flat[start : start + size])
            start += size
        return table

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self).from_flat, self.flat())

    def __getitem__(self, index: int) -> tuple[int, ...]:
        return self.stacks[index]

    def __len__(self) -> int:
        return len(self.stacks)


if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

    from opguard_core.combine import _scan

    #: (stack id, api, op, role, dtype)
    _Key = tuple[int, str | None, str, str, str | None]
    #: a scanned key: a callsite without a role has its raw stream in the role's place
    _ScanKey = tuple[int, str | None, str, str | int, str | None]
    #: data -> offset of the top-level callsites value, or None
    Finder = Callable[[ReadableBuffer], int | None]
    #: (data, offset, closes, remap, table, apis, ops, roles, dtypes, require_role) ->
    #: (keys, counts, total), or None where the bytes are not of the plain shape; the
    #: table is the C one
    Scanner = Callable[
        [
            ReadableBuffer,
            int,
            bool,
            ReadableBuffer,
            _scan.StackTable,
            dict[str | None, str | None],
            dict[str, str],
            dict[str, str],
            dict[str, str],
            bool,
        ],
        tuple[list[_ScanKey], list[int], int] | None,
    ]
    #: (sites, keys, counts, mask, collective_apis, max_distinct) -> no rank seen twice
    Folder = Callable[
        [dict[_Key, list[Any]], list[_Key], list[int], int, frozenset[str], int], bool
    ]
    #: (sites, stack_ids, apis, ops, roles, dtypes, counts, masks, mins, stats,
    #: collective_apis, max_distinct): a packed partial's sites folded in
    Merger = Callable[
        [
            dict[_Key, list[Any]],
            list[int],
            list[str | None],
            list[str],
            list[str],
            list[str | None],
            list[int],
            list[int],
            list[int],
            dict[int, tuple[Any, ...]],
            frozenset[str],
            int,
        ],
        None,
    ]
    #: (keys, canonical) -> the keys' positions in canonical order
    Orderer = Callable[[list[_Key], list[tuple[bytes, tuple[int, ...]]]], list[int]]
    #: (sites, order, canonical, all_mask, stats_valid, ranks_of, Callsite, PerRank)
    #: -> the combined trace's callsites
    Builder = Callable[
        [
            list[tuple[_Key, list[Any]]],
            list[int],
            list[tuple[bytes, tuple[int, ...]]],
            int,
            bool,
            dict[int, list[int]],
            type[Any],
            type[Any],
        ],
        list[Any],
    ]


def py_site_order(
    keys: list[tuple[int, str | None, str, str, str | None]],
    canonical: list[tuple[bytes, tuple[int, ...]]],
) -> list[int]:
    """The positions of ``keys`` (stack id, api, op, role, dtype) sorted by (the stack's
    canonical bytes, api or "", op, role, dtype is not None, dtype or "", api is not
    None): the canonical order of a combined trace's callsites, a callsite without a
    dtype before those with one, then dtypes by name (formats.md, "Dtypes"). The first
    seven fields already differ between any two keys, so a plain tuple sort orders by
    them alone."""
    keyed = [
        (
            canonical[key[0]][0],
            key[1] or "",
            key[2],
            key[3],
            key[4] is not None,
            key[4] or "",
            key[1] is not None,
            position,
        )
        for position, key in enumerate(keys)
    ]
    keyed.sort()
    return [item[-1] for item in keyed]


def _implementation() -> tuple[
    type[StackTableLike],
    Finder | None,
    Scanner | None,
    Folder | None,
    Merger | None,
    Orderer,
    Builder | None,
]:
    if load_native("opguard_core.combine._scan") is None:
        return PyStackTable, None, None, None, None, py_site_order, None
    from opguard_core.combine._scan import (
        StackTable,
        build_callsites,
        find_callsites,
        fold_rank,
        merge_packed,
        scan_callsites,
        site_order,
    )

    return (StackTable, find_callsites, scan_callsites, fold_rank, merge_packed, site_order,
            build_callsites)  # fmt: skip


#: the table the accumulator uses; the scanner and its finder (None: decode with
#: msgspec); the one-rank fold (None: TraceAccumulator._fold_file's Python loop); the
#: fold of a packed partial (None: TraceAccumulator._merge_packed's Python loop); the
#: canonical order of the sites; the callsites of the result (None:
#: accumulator.py_build_callsites)
(StackTable, find_callsites, scan_callsites, fold_rank, merge_packed, site_order,
 build_callsites) = _implementation()  # fmt: skip


def new_table() -> StackTableLike:
    """An empty stack table of the implementation in use."""
    table: StackTableLike = StackTable()
    return table
