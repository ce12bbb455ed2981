"""Stub of the C extension ``opguard_core.combine._scan`` (``_scan.c``).

Loaded by :mod:`opguard_core.combine.stack_table` through
:func:`opguard_core.native.load_native`; :class:`~opguard_core.combine.stack_table.PyStackTable`,
:func:`~opguard_core.combine.stack_table.py_site_order` and the accumulator's loops are
the Python references.
"""

from collections.abc import Sequence
from typing import Any, final

from _typeshed import ReadableBuffer

#: (stack id, api or None, op, role, dtype or None)
_SiteKey = tuple[int, str | None, str, str, str | None]
#: a scanned key: the raw stream (an int) in the role's place where a callsite has none
_ScanKey = tuple[int, str | None, str, str | int, str | None]

@final
class StackTable:
    """Stacks (sequences of frame ids) interned as dense ids."""

    def __init__(self) -> None: ...
    def intern(self, stack: Sequence[int], /) -> int: ...
    def absorb(self, other: StackTable, remap: Sequence[int] | None, /) -> list[int]: ...
    def canonical(self, new_id: list[int], /) -> list[tuple[bytes, tuple[int, ...]]]: ...
    def flat(self) -> tuple[bytes, bytes]: ...
    @classmethod
    def from_flat(cls, ids: ReadableBuffer, lengths: ReadableBuffer, /) -> StackTable: ...
    def __reduce__(self) -> tuple[Any, ...]: ...
    def __getitem__(self, index: int, /) -> tuple[int, ...]: ...
    def __len__(self) -> int: ...

def find_callsites(data: ReadableBuffer, /) -> int | None: ...
def scan_callsites(
    data: ReadableBuffer,
    offset: int,
    closes: bool,
    remap: ReadableBuffer,
    table: StackTable,
    apis: dict[str | None, str | None],
    ops: dict[str, str],
    roles: dict[str, str],
    dtypes: dict[str, str],
    require_role: bool,
    /,
) -> tuple[list[_ScanKey], list[int], int] | None: ...
def fold_rank(
    sites: dict[_SiteKey, list[Any]],
    keys: list[_SiteKey],
    counts: list[int],
    mask: int,
    collective_apis: frozenset[str],
    max_distinct: int,
    /,
) -> bool: ...
def build_callsites(
    sites: list[tuple[_SiteKey, list[Any]]],
    order: list[int],
    canonical: list[tuple[bytes, tuple[int, ...]]],
    all_mask: int,
    stats_valid: bool,
    ranks_of: dict[int, list[int]],
    callsite_type: type[Any],
    per_rank_type: type[Any],
    /,
) -> list[Any]: ...
def site_order(
    keys: list[_SiteKey], canonical: list[tuple[bytes, tuple[int, ...]]], /
) -> list[int]: ...
def merge_packed(
    sites: dict[_SiteKey, list[Any]],
    stack_ids: list[int],
    apis: list[str | None],
    ops: list[str],
    roles: list[str],
    dtypes: list[str | None],
    counts: list[int],
    masks: list[int],
    mins: list[int],
    stats: dict[int, tuple[Any, ...]],
    collective_apis: frozenset[str],
    max_distinct: int,
    /,
) -> None: ...
