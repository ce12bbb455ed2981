"""Stub of the C extension ``opguard_plugins.stages._runs`` (``_runs.c``).

Loaded by :mod:`opguard_plugins.stages.sorted_runs` through
:func:`opguard_core.native.load_native`; :class:`~opguard_plugins.stages.sorted_runs.PyRuns`
and the ``py_*`` functions there are the Python references.
"""

from collections.abc import Callable, Container, Sequence
from typing import Any, final

from _typeshed import ReadableBuffer

from opguard_core.formats.trace import Callsite
from opguard_plugins.stages.sorted_runs import PathTables

@final
class Runs:
    """The sorted paths of a trace's callsites and the runs below every node."""

    def __new__(
        cls,
        paths: Sequence[bytes],
        counts: Sequence[int],
        masks: Sequence[int],
        all_mask: int,
        ops: Sequence[str],
        streams: Sequence[str],
        dtypes: Sequence[str | None],
        width: int,
    ) -> Runs: ...
    def weight(self, start: int, end: int, /) -> int: ...
    def mask(self, start: int, end: int, /) -> int: ...
    def uniform(self, start: int, end: int, /) -> bool: ...
    def skip_ended(self, own: int, start: int, end: int, /) -> int: ...
    def run_end(self, own: int, start: int, end: int, /) -> int: ...
    def id_at(self, own: int, position: int, /) -> bytes: ...
    def ranked_prefix(self, own: int, position: int, ranks: ReadableBuffer, /) -> bytes: ...
    def tally(
        self,
        start: int,
        end: int,
        ops: dict[str, int],
        streams: dict[str, int],
        dtypes: dict[str, int],
        op_masks: dict[str, int],
        /,
    ) -> None: ...
    def distinct_prefixes(self) -> int: ...
    def divergent(
        self, floor: int, rank_floor: int, /
    ) -> tuple[list[int], list[tuple[int, int]], list[tuple[int, int]]]: ...

def callsite_paths(
    stacks: list[tuple[int, ...]],
    apis: list[str | None],
    api_index: dict[str, int],
    tables: PathTables,
    width: int,
    /,
) -> tuple[list[bytes], list[bytes]]: ...
def frames_at(
    frame_paths: list[bytes], origins: list[int], own: int, start: int, end: int, /
) -> tuple[int, list[int]]: ...
def visible_frames(
    stacks: list[tuple[int, ...]], hidden: ReadableBuffer, user: ReadableBuffer, /
) -> tuple[list[list[int]], list[int | None]]: ...
def site_visible_frames(
    sites: list[Callsite], indices: list[int], hidden: ReadableBuffer, user: ReadableBuffer, /
) -> tuple[list[list[int]], list[int | None]]: ...
def site_summary(
    sites: list[Callsite],
    hidden: ReadableBuffer,
    user: ReadableBuffer,
    all_mask: int,
    mask_of: Callable[[list[int]], int],
    collective_op: Callable[[str], bool],
    collective_apis: Container[str | None],
    /,
) -> tuple[bytes, bytearray, list[int], bytes, bytes, list[int]]: ...
def collective_histograms(
    sites: list[Callsite], indices: list[int], ranks: list[int], rank_names: list[str], /
) -> list[
    tuple[int, bool, list[int], dict[str, int], int, list[list[int]] | None, int, int] | bool | None
]: ...
def skew_findings(
    kept: list[tuple[int, int, float, bytes, list[int]]],
    site_indices: list[int | None],
    visible: list[list[int]],
    callers: list[int | None],
    function_names: list[str],
    frame_names: list[str],
    ranks: list[int],
    rank_names: list[str],
    ops: list[int],
    threshold: str,
    number: Callable[[float], int | float],
    size_of: Callable[[float, list[float]], int],
    list_ranks: Callable[[list[int]], str],
    /,
) -> list[dict[str, Any]]: ...
def site_touching(sites: list[Callsite], marked: ReadableBuffer, /) -> list[int]: ...
def skew_fold(
    sites: list[Callsite],
    callers: ReadableBuffer,
    function: ReadableBuffer,
    skip: ReadableBuffer,
    functions: int,
    ranks: list[int],
    skew: float,
    /,
) -> tuple[list[int], bytearray, list[int | None], list[tuple[int, float, bytes, list[int]]]]: ...
