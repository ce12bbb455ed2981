"""The combine algebra: a multiset union of callsite traces, with frames interned.

:class:`TraceAccumulator` takes decoded traces one at a time (so a run never holds
every rank file at once) and other accumulators (so partial results from worker
processes or a Dask cluster fold together). Callsite identity is
(stack as frame values, api, op, stream role, dtype): one stack that ran ``aten::mm`` in
float32 and in float64 is two callsites (formats.md, "Dtypes"), and a callsite without
a dtype (none recorded, or no tensor argument) is a third; ranks are kept as an integer
bit mask.
Raw stream ids differ between machines and runtimes, so they are not part of it:
a combined trace keeps roles only (formats.md, "Streams and roles").
The result is canonical: frames sorted by value, callsites by stack, so the output
does not depend on the order the inputs came in.

Per-rank statistics (docs/divergence.md): besides the summed count and the rank
mask, every callsite keeps the smallest and largest per-rank count and the masks of
the ranks that hold them, and, once three or more distinct per-rank counts appear,
a histogram ``{count: rank mask}`` (capped at :data:`MAX_DISTINCT` values except for
collective callsites, whose histogram is exact). All of it merges associatively
and commutatively, so pool, Dask and any input order give the same result, and none
of it grows with the number of ranks beyond the width of a rank mask. The
statistics are exact only when every rank comes from one input; an accumulator
that sees a rank twice, or a multi-rank input without statistics (a version-1
combined file), drops them (``stats_valid``).

Collective sequences (formats.md, "Collective sequences") are carried as they are:
each distinct sequence (its stacks re-interned) with the mask of the ranks that
issued it, so ranks that agree cost one sequence. A rank whose sequence arrives
twice makes the sequences unknown (``sequences_valid``), as for the statistics.
"""

from __future__ import annotations

import array
import contextlib
import dataclasses
import enum
import gc
import re
from collections.abc import Callable, Iterable, Iterator
from operator import itemgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import msgspec

from opguard_core.combine.stack_table import (
    build_callsites,
    find_callsites,
    fold_rank,
    merge_packed,
    new_table,
    scan_callsites,
    site_order,
)
from opguard_core.errors import InputError
from opguard_core.formats.collectives import (
    Collectives,
    CollectiveSequence,
    Group,
    Signature,
    StepRun,
    check_collectives,
    decode_collectives,
)
from opguard_core.formats.dtypes import is_dtype
from opguard_core.formats.readers import Readers, is_callsite_trace
from opguard_core.formats.streams import is_role, legacy_roles
from opguard_core.formats.trace import (
    COMBINED_VERSION,
    PARTIAL_RANKS_KEY,
    READ_VERSIONS,
    ROLE_VERSION,
    SETUP_PHASE,
    TRACE_FORMAT,
    Callsite,
    DecodedTrace,
    Frame,
    PerRank,
    TraceHead,
    check_nesting,
    check_ranks,
    decode_trace,
    encode_trace_parts,
    partial_ranks_of,
    read_bytes,
    trace_ranks,
    validate_frame_ids,
)
from opguard_core.formats.tree import MAX_COUNT
from opguard_core.formats.values import same_json

if TYPE_CHECKING:
    from opguard_core.combine._scan import StackTable

#: key of a callsite in an accumulator: (stack id in its :attr:`TraceAccumulator.stacks`,
#: api, op, role, dtype)
SiteKey = tuple[int, str | None, str, str, str | None]
#: a key as the scanner reads it: a callsite without a role has its raw stream there
ScanKey = tuple[int, str | None, str, str | int, str | None]

#: A non-collective callsite's histogram of per-rank counts is kept while it has at
#: most this many distinct values; past it only min and max (with their ranks) are.
MAX_DISTINCT = 8
#: ``meta`` key of a combined trace whose callsites carry exact per-rank statistics
PER_RANK_KEY = "per_rank_stats"
#: a collective sequence in an accumulator: groups, signatures (stacks as the
#: accumulator's frame ids), step runs
SequenceKey = tuple[tuple[Group, ...], tuple[Signature, ...], tuple[StepRun, ...]]
#: ``meta`` keys holding counts by name (an importer's ``window``: what the profiling
#: window cut), which a combine adds up over its inputs instead of keeping only
#: values every input agrees on
SUMMED_META = ("window",)


def _counts(value: object) -> dict[str, int] | None:
    """``value`` when it is a mapping of names to non-negative integers, else None."""
    if isinstance(value, dict) and all(
        isinstance(k, str) and type(v) is int and 0 <= v <= MAX_COUNT for k, v in value.items()
    ):
        return value
    return None


#: Python-level collective apis (``torch.distributed.*``); any op ``c10d::*`` is one too
COLLECTIVE_APIS = frozenset(
    f"torch.distributed.{name}"
    for name in (
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_object",
        "all_to_all",
        "all_to_all_single",
        "barrier",
        "broadcast",
        "broadcast_object_list",
        "gather",
        "gather_object",
        "irecv",
        "isend",
        "recv",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "scatter",
        "scatter_object_list",
        "send",
        "batch_isend_irecv",
        "monitored_barrier",
    )
)


def is_collective(op: str, api: str | None) -> bool:
    """Whether a callsite is a collective: op ``c10d::*`` or a known collective api."""
    return op.startswith("c10d::") or api in COLLECTIVE_APIS


#: a histogram that outgrew :data:`MAX_DISTINCT` (the slot keeps min and max only)
_OVERFLOW = False

# A site's slot: [count, mask, min, min_mask, max, max_mask, hist]. ``min_mask`` and
# ``max_mask`` are None while every rank of ``mask`` has the same count (min == max),
# the common case the hot loop keeps cheap; ``hist`` is None while the counts take
# at most two values (min and max say it all), else {count: mask} or _OVERFLOW.
_COUNT, _MASK, _MIN, _MIN_MASK, _MAX, _MAX_MASK, _HIST = range(7)


def _histogram(slot: list[Any], copy: bool = True) -> dict[int, int] | None:
    """The slot's exact {per-rank count: rank mask}, or None when it overflowed; with
    ``copy=False``, the slot's own dict where it keeps one (only to read)."""
    hist = slot[_HIST]
    if hist is _OVERFLOW:
        return None
    if hist is not None:
        return dict(hist) if copy else hist
    if slot[_MIN_MASK] is None:
        return {slot[_MIN]: slot[_MASK]}
    return {slot[_MIN]: slot[_MIN_MASK], slot[_MAX]: slot[_MAX_MASK]}


def merge_slot(slot: list[Any], other: list[Any], collective: bool) -> None:
    """Fold ``other`` (a slot of the same callsite from disjoint ranks) into ``slot``.

    Sum, union, min and max are associative and commutative, and so is the capped
    histogram union: it overflows exactly when the union of all inputs' distinct
    counts exceeds :data:`MAX_DISTINCT`, whatever the grouping.
    """
    if (
        slot[_MIN_MASK] is None and other[_MIN_MASK] is None and slot[_MIN] == other[_MIN]
    ):  # both uniform with the same count: the common case
        slot[_COUNT] += other[_COUNT]
        slot[_MASK] |= other[_MASK]
        return
    mine, theirs = _histogram(slot), _histogram(other)
    low = min(slot[_MIN], other[_MIN])
    high = max(slot[_MAX], other[_MAX])
    low_mask = _mask_of(slot, low, True) | _mask_of(other, low, True)
    high_mask = _mask_of(slot, high, False) | _mask_of(other, high, False)
    slot[_COUNT] += other[_COUNT]
    slot[_MASK] |= other[_MASK]
    slot[_MIN], slot[_MAX] = low, high
    if low == high:
        slot[_MIN_MASK] = slot[_MAX_MASK] = None
        slot[_HIST] = None
        return
    slot[_MIN_MASK], slot[_MAX_MASK] = low_mask, high_mask
    if mine is not None and theirs is not None:
        for value, mask in theirs.items():
            mine[value] = mine.get(value, 0) | mask
    _store_histogram(slot, mine if theirs is not None else None, collective)


def _store_histogram(slot: list[Any], hist: dict[int, int] | None, collective: bool) -> None:
    """Set ``slot``'s histogram to ``hist`` (None: it overflowed): kept only while the
    counts take three or more values, and at most :data:`MAX_DISTINCT` of them unless
    the callsite is a collective."""
    if hist is None:
        slot[_HIST] = _OVERFLOW
    elif len(hist) <= 2:
        slot[_HIST] = None
    elif len(hist) > MAX_DISTINCT and not collective:
        slot[_HIST] = _OVERFLOW
    else:
        slot[_HIST] = hist


def add_rank_count(slot: list[Any], count: int, mask: int, collective: bool) -> None:
    """``merge_slot(slot, [count, mask, count, None, count, None, None], collective)``
    for one rank's count (``mask``: ranks that are not yet in ``slot``) that differs
    from ``slot``'s uniform count or meets a non-uniform slot: the hot path of a
    combine whose ranks disagree, without building the incoming slot, its histogram
    or a copy of ``slot``'s (which ``slot`` owns: :func:`_copy_slot`)."""
    old_min, old_max, min_mask = slot[_MIN], slot[_MAX], slot[_MIN_MASK]
    if min_mask is None and count == old_min:  # the same count as every rank so far
        slot[_COUNT] += count
        slot[_MASK] |= mask
        return
    hist = slot[_HIST]
    if min_mask is None:  # uniform so far (with another count)
        mine: dict[int, int] | None = {old_min: slot[_MASK]}
        min_mask = max_mask = slot[_MASK]
    else:
        max_mask = slot[_MAX_MASK]
        if hist is _OVERFLOW:
            mine = None
        elif hist is None:
            mine = {old_min: min_mask, old_max: max_mask}
        else:
            mine = hist
    slot[_COUNT] += count
    slot[_MASK] |= mask
    if count < old_min:
        slot[_MIN], slot[_MIN_MASK] = count, mask
    elif count == old_min:
        slot[_MIN_MASK] = min_mask | mask
    else:
        slot[_MIN_MASK] = min_mask
    if count > old_max:
        slot[_MAX], slot[_MAX_MASK] = count, mask
    elif count == old_max:
        slot[_MAX_MASK] = max_mask | mask
    else:
        slot[_MAX_MASK] = max_mask
    if mine is not None:
        mine[count] = mine.get(count, 0) | mask
    _store_histogram(slot, mine, collective)


def _mask_of(slot: list[Any], value: int, low: bool) -> int:
    """The ranks of ``slot`` whose count is ``value``, where ``value`` is the new min
    (``low``) or max; 0 when none is."""
    if slot[_MIN_MASK] is None:
        return slot[_MASK] if slot[_MIN] == value else 0
    if low:
        return slot[_MIN_MASK] if slot[_MIN] == value else 0
    return slot[_MAX_MASK] if slot[_MAX] == value else 0


class _Conflict(enum.Enum):
    """Marks a meta key whose values disagree; an enum, so it survives pickling."""

    CONFLICT = 0


_CONFLICT = _Conflict.CONFLICT


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while building large acyclic structures.

    Decoding a rank file and folding it in create millions of small lists and
    tuples; each gen-0 collection would rescan them (and a gen-2 one the whole
    accumulator), which costs as much as the decoding itself. None of these
    objects can form a cycle, so pausing loses nothing; reference counting still
    frees everything. The previous state is restored on exit.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def collect_kept(collect: bool = True) -> None:
    """Collect cycles, then freeze what survives (``gc.freeze``): what a run keeps
    between entries (the configs merge needs, the records) is no garbage, and a later
    collection skips it, so collecting after each of n entries costs O(n) in all, not
    O(n²). :func:`gc_paused_run` unfreezes it. ``collect=False`` freezes only: the
    millions of objects of an entry kept to the end would otherwise sit in the
    youngest generation, whose first collection once the collector runs again visits
    them all (0.2 s at 4 ranks × 160,000 callsites)."""
    if collect:
        gc.collect()
    gc.freeze()


@contextlib.contextmanager
def gc_paused_run() -> Iterator[None]:
    """:func:`gc_paused` for a whole run, which freezes what it keeps between entries
    (:func:`collect_kept`): unfrozen on exit."""
    try:
        with gc_paused():
            yield
    finally:
        gc.unfreeze()


#: the set bits of each byte value, ascending
_BYTE_BITS = tuple(tuple(b for b in range(8) if value >> b & 1) for value in range(256))
#: runs of non-zero bytes: what :func:`mask_to_ranks` visits (the zeros are skipped in C)
_SET_BYTES = re.compile(rb"[^\x00]+")


def ranks_to_mask(ranks: Iterable[int]) -> int:
    """The mask with bit ``r`` set for each rank ``r``: built as bytes, so n ranks cost
    O(n) plus a C-speed pass over the highest rank's bytes (OR-ing ``1 << r`` into a
    growing int costs O(n · max rank))."""
    ranks = ranks if isinstance(ranks, list | tuple) else list(ranks)
    if len(ranks) == 1:
        return 1 << ranks[0]
    if not ranks:
        return 0
    if min(ranks) < 0:
        raise ValueError("negative shift count")  # as ``1 << rank`` would
    data = bytearray((max(ranks) >> 3) + 1)
    for rank in ranks:
        data[rank >> 3] |= 1 << (rank & 7)
    return int.from_bytes(data, "little")


def mask_to_ranks(mask: int) -> list[int]:
    """The set bits of ``mask``, ascending (rank ``r`` is bit ``1 << r``). Costs the
    set bits plus a C-speed scan of the mask's bytes: rank 1048575 alone is a 128 KB
    scan, not a million-step Python loop."""
    if mask < 0:
        raise ValueError("a rank mask is never negative")
    data = mask.to_bytes((mask.bit_length() + 7) >> 3, "little")
    ranks: list[int] = []
    add, bits = ranks.extend, _BYTE_BITS
    for run in _SET_BYTES.finditer(data):
        at = run.start() << 3
        for offset, value in enumerate(run.group()):
            base = at + (offset << 3)
            add([base + b for b in bits[value]])
    return ranks


class _SiteOut(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A callsite as written: key order stack, api, op, role, dtype, count, ranks,
    per_rank; ``api``, ``dtype``, ``ranks`` and ``per_rank`` left out when None (same
    bytes as the dict form, :meth:`CallsiteTrace._site_doc`)."""

    stack: tuple[int, ...]
    api: str | None = None
    op: str
    role: str | None
    dtype: str | None = None
    count: int
    ranks: list[int] | None = None
    per_rank: PerRank | None = None


@dataclasses.dataclass
class CallsiteTrace:
    """A combined trace in memory, in canonical order.

    ``callsites[j].stack`` holds indices into ``frames``; ``callsites[j].ranks`` is
    None when the callsite was recorded on every rank in ``meta["ranks"]``.
    """

    meta: dict[str, Any]
    frames: list[Frame]
    callsites: list[Callsite]
    extras: dict[str, Any] = dataclasses.field(default_factory=dict)
    frame_extras: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    callsite_extras: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    #: the ranks' collective sequences, None where none was recorded
    collectives: Collectives | None = None

    @property
    def ranks(self) -> list[int]:
        return list(self.meta.get("ranks", []))

    @property
    def total(self) -> int:
        return sum(site.count for site in self.callsites)

    def to_json(self) -> bytes:
        """The canonical ``opguard-callsites`` document (formats.md §1)."""
        return b"".join(self.json_parts())

    def json_parts(self) -> Iterator[bytes]:
        """:meth:`to_json` in parts, to write as they come (``atomic_write_parts``)."""
        if not self.callsite_extras:
            # the common case: one small struct per callsite, no dict to build
            outs = (
                _SiteOut(
                    stack=site.stack,
                    api=site.api,
                    op=site.op,
                    role=site.role,
                    dtype=site.dtype,
                    count=site.count,
                    ranks=site.ranks,
                    per_rank=site.per_rank,
                )
                for site in self.callsites
            )
            return encode_trace_parts(
                self.meta,
                self.frames,
                outs,
                self.extras,
                self.frame_extras,
                COMBINED_VERSION,
                self.collectives,
            )
        return encode_trace_parts(
            self.meta,
            self.frames,
            map(self._site_doc, range(len(self.callsites))),
            self.extras,
            self.frame_extras,
            COMBINED_VERSION,
            self.collectives,
        )

    def _site_doc(self, index: int) -> dict[str, Any]:
        """A callsite with extras as written: its fields in order, then the extras."""
        site = self.callsites[index]
        doc: dict[str, Any] = {"stack": site.stack}
        if site.api is not None:
            doc["api"] = site.api
        doc["op"] = site.op
        doc["role"] = site.role
        if site.dtype is not None:
            doc["dtype"] = site.dtype
        doc["count"] = site.count
        if site.ranks is not None:
            doc["ranks"] = site.ranks
        if site.per_rank is not None:
            doc["per_rank"] = site.per_rank
        extra = self.callsite_extras.get(index)
        if extra:
            doc.update(extra)
        return doc

    @property
    def per_rank_stats(self) -> bool:
        """Whether the callsites carry exact per-rank statistics (``meta.per_rank_stats``)."""
        return bool(self.meta.get(PER_RANK_KEY))


class _Agreement:
    """Keys of several mappings whose values all inputs agree on (order-independent)."""

    def __init__(self) -> None:
        self.values: dict[str, Any] | None = None

    def add(self, mapping: dict[str, Any]) -> None:
        if self.values is None:
            self.values = dict(mapping)
            return
        for key in list(self.values):
            if self.values[key] is not _CONFLICT and not same_json(
                mapping.get(key, _CONFLICT), self.values[key]
            ):
                self.values[key] = _CONFLICT

    def update(self, other: _Agreement) -> None:
        if other.values is None:
            return
        if self.values is None:
            self.values = dict(other.values)
            return
        for key in list(self.values):
            if not same_json(other.values.get(key, _CONFLICT), self.values[key]):
                self.values[key] = _CONFLICT

    def result(self) -> dict[str, Any]:
        values = self.values or {}
        return {k: v for k, v in values.items() if v is not _CONFLICT}


_HEAD_DECODER = msgspec.json.Decoder(TraceHead)


class _PackedSites(NamedTuple):
    """An accumulator's sites in transit: their stack ids (``array('I')`` bytes; the
    stacks travel once each, in the accumulator's table), then one list per column;
    ``stats`` holds (min, min_mask, max, max_mask, hist) for the sites whose ranks
    disagree, by position (the others are uniform: min = max = count / ranks)."""

    stack_ids: bytes
    apis: list[str | None]
    ops: list[str]
    roles: list[str]
    dtypes: list[str | None]
    counts: list[int]
    masks: list[int]
    mins: list[int]
    stats: dict[int, tuple[Any, ...]]


class TraceAccumulator:
    """Accumulates traces into one multiset of callsites."""

    def __init__(self) -> None:
        self.frame_ids: dict[Frame, int] = {}
        self.frames: list[Frame] = []
        #: every stack of global frame ids seen, interned: a site's key holds its id
        self.stacks = new_table()
        #: one object per distinct api / op string, so that the sites' keys share them
        #: and comparing two keys compares these by identity, not by their bytes
        self.apis: dict[str | None, str | None] = {}
        self.ops: dict[str, str] = {}
        self.roles: dict[str, str] = {}
        #: dtype names, interned as roles are (a key's None: no dtype)
        self.dtypes: dict[str, str] = {}
        #: key -> [count, rank mask, min, min mask, max, max mask, histogram] (see _COUNT)
        self.sites: dict[SiteKey, list[Any]] = {}
        #: False once a rank came twice or an input had no per-rank statistics
        self.stats_valid = True
        #: sites as they arrived pickled (see __getstate__), not yet unpacked into ``sites``
        self._packed: _PackedSites | None = None
        self.rank_mask = 0
        #: one (path, ranks, callsites, meta states a rank) per file added: what
        #: opguard_core.combine.rank_claims checks (two files of one entry claiming one rank)
        self.claims: list[tuple[str, tuple[int, ...], int, bool]] = []
        self.inputs = 0
        #: every op added so far; refused past MAX_COUNT (no reader holds more exactly)
        self.total = 0
        self.meta = _Agreement()
        #: SUMMED_META keys: the sums over the inputs
        self.summed: dict[str, dict[str, int]] = {}
        self.extras = _Agreement()
        self.frame_extras: dict[Frame, _Agreement] = {}
        self.site_extras: dict[SiteKey, _Agreement] = {}
        #: each distinct collective sequence -> the mask of the ranks that issued it
        self.sequences: dict[SequenceKey, int] = {}
        #: False once a rank's sequence came twice (the sequences are then dropped)
        self.sequences_valid = True
        #: rank -> its rank file's ``meta.partial`` (PARTIAL_RANKS_KEY)
        self.partial: dict[int, dict[str, Any]] = {}
        #: run warnings (records, opguard_core.run.warnings) made while adding files in
        #: another process (a combine helper, a Dask worker), to be made again where
        #: the result is used; empty where the files were added in that process
        self.warnings: list[dict[str, Any]] = []

    def _intern(self, frame: Frame) -> int:
        index = self.frame_ids.get(frame)
        if index is None:
            index = len(self.frames)
            self.frame_ids[frame] = index
            self.frames.append(frame)
        return index

    def add(self, trace: DecodedTrace) -> None:
        """Add one decoded trace (one rank file, or an earlier combined trace).

        Every callsite becomes a key (stack id, api, op, role, dtype): its stack is
        re-interned with one C-level gather over the file's frame table
        (``itemgetter(*stack)``, a third faster than ``map``), then interned in
        :attr:`stacks`; its api, op, role and dtype strings are interned (so keys
        compare them by identity). The gather also refuses frame ids out of range, so
        decoding may skip that check (``check_frame_ids=False``); the error is the same,
        and comes before any rank error, as if decoding had checked.
        """
        self._unpack()
        callsites = trace.callsites
        counts = [site.count for site in callsites]
        file_ranks = trace.ranks()
        total = self._checked_total(trace.path, sum(counts))
        local = [self._intern(frame) for frame in trace.frames]
        remap = local.__getitem__
        gather = itemgetter
        intern = self.stacks.intern
        intern_api, intern_op = self.apis.setdefault, self.ops.setdefault
        intern_role, intern_dtype = self.roles.setdefault, self.dtypes.setdefault
        try:
            keys = [
                (
                    intern(gather(*site.stack)(local))
                    if len(site.stack) > 1
                    else intern(tuple(map(remap, site.stack))),
                    intern_api(site.api, site.api),
                    intern_op(site.op, site.op),
                    intern_role(site.role or "", site.role or ""),  # set by decoding
                    None if site.dtype is None else intern_dtype(site.dtype, site.dtype),
                )
                for site in callsites
            ]
        except IndexError:  # a frame id out of range (decoding may leave this check to us)
            validate_frame_ids(trace.frames, callsites, trace.path)
            raise
        folded, folded_counts = keys, counts
        if trace.derived_roles and len(file_ranks) == 1:
            folded, folded_counts = _without_duplicates(keys, counts)
        self._fold_file(trace.path, trace.meta, file_ranks, total, folded, folded_counts, callsites)
        if trace.collectives is not None:
            self._add_sequences(trace.collectives.sequences, local)
        for position, site_extra in trace.callsite_extras.items():
            if site_extra:
                self.site_extras.setdefault(keys[position], _Agreement()).add(site_extra)
        for index, extra in trace.frame_extras.items():
            self.frame_extras.setdefault(trace.frames[index], _Agreement()).add(extra)
        self.extras.add(trace.extras)

    def _add_sequences(self, sequences: Iterable[CollectiveSequence], remap: list[int]) -> None:
        """Fold sequences in, their stacks' frame ids mapped through ``remap`` (the
        input's frame id -> this accumulator's)."""
        for seq in sequences:
            key = _sequence_key(seq, remap)
            mask = ranks_to_mask(seq.ranks)
            self._add_sequence(key, mask)

    def _add_sequence(self, key: SequenceKey, mask: int) -> None:
        if any(mask & held for held in self.sequences.values()):
            self.sequences_valid = False
        self.sequences[key] = self.sequences.get(key, 0) | mask

    def _checked_total(self, path: str, file_total: int) -> int:
        """The ops added so far with a file's; refused past :data:`MAX_COUNT`."""
        total = self.total + file_total
        if total > MAX_COUNT:
            raise InputError(
                path,
                f"the counts add up to {total}, more than 2**63-1 ops (with the files before)",
            )
        return total

    def _fold_file(
        self,
        path: str,
        file_meta: dict[str, Any],
        file_ranks: list[int],
        total: int,
        keys: list[SiteKey],
        counts: list[int],
        callsites: list[Callsite] | None,
    ) -> None:
        """Fold one file's callsites, as ``keys`` and ``counts`` in file order, into
        :attr:`sites`, then its header into the bookkeeping (``callsites``, with their
        ``ranks`` and ``per_rank``, is needed only for a multi-rank file).

        The loop is the hot path of a combine (once per callsite per rank): a callsite
        costs one dict lookup, and a rank with the same count as every rank before it
        (the common case) an add and an or.
        """
        file_mask = ranks_to_mask(file_ranks)
        partial = partial_ranks(file_meta, file_ranks, path)
        meta = {
            k: v
            for k, v in file_meta.items()
            if k not in ("rank", "ranks", PER_RANK_KEY, PARTIAL_RANKS_KEY)
        }
        summed = {name: c for name in SUMMED_META if (c := _counts(meta.get(name))) is not None}
        for name in summed:
            del meta[name]
        single = len(file_ranks) == 1
        # a combined input (``meta.ranks`` without a ``meta.rank``, even of one rank: an
        # earlier combine may have dropped them) has exact per-rank counts only if it
        # says so; a rank seen before makes every statistic inexact
        combined = "ranks" in file_meta and "rank" not in file_meta
        stats_valid = (bool(file_meta.get(PER_RANK_KEY)) if combined else single) and not (
            file_mask & self.rank_mask
        )
        sites = self.sites
        get = sites.get
        if single and fold_rank is not None:
            exact = fold_rank(sites, keys, counts, file_mask, COLLECTIVE_APIS, MAX_DISTINCT)
            stats_valid = exact and stats_valid
        elif single:  # the reference for fold_rank (opguard_core/combine/_scan.c)
            mask = file_mask
            for key, count in zip(keys, counts, strict=True):
                slot = get(key)
                if slot is None:
                    sites[key] = [count, mask, count, None, count, None, None]
                elif slot[1] & mask:
                    # the same callsite twice in one file (or a rank seen before): its
                    # per-rank count is no longer known, so statistics are dropped
                    slot[0] += count
                    stats_valid = False
                elif count == slot[2] and count == slot[4] and slot[3] is None:
                    slot[0] += count  # same count as every rank so far: the common case
                    slot[1] |= mask
                else:
                    add_rank_count(slot, count, mask, is_collective(key[2], key[1]))
        else:
            assert callsites is not None
            for position, (key, site) in enumerate(zip(keys, callsites, strict=True)):
                ranks = site.ranks
                if ranks is None:
                    mask = file_mask
                else:
                    mask = ranks_to_mask(ranks)
                    if mask & ~file_mask:
                        raise InputError(
                            path,
                            f"callsites[{position}].ranks {ranks} names ranks outside "
                            f"meta.ranks {file_ranks}",
                        )
                slot = get(key)
                if slot is not None and slot[1] & mask:
                    slot[0] += site.count
                    stats_valid = False
                else:
                    incoming = _incoming_slot(site, mask, path, position, stats_valid)
                    if slot is None:
                        sites[key] = incoming
                    else:
                        merge_slot(slot, incoming, is_collective(key[2], key[1]))
        # bookkeeping last, so a file refused above leaves the accumulator's header alone
        self.stats_valid = self.stats_valid and stats_valid
        self.rank_mask |= file_mask
        self.inputs += 1
        self.total = total
        stated = "rank" in file_meta or "ranks" in file_meta
        self.claims.append((path, tuple(file_ranks), len(keys), stated))
        self.meta.add(meta)
        _add_partial(self.partial, partial)
        self._add_summed(summed)

    def add_file(self, path: Path | str, readers: Readers | None = None) -> None:
        """Read, decode and :meth:`add` one trace file. A plain rank file is read by
        the C scanner when it is built (:meth:`_add_scanned`); anything else, and any
        file it declines, is decoded by msgspec, which leaves the frame-id check to
        :meth:`add`, which makes it while re-interning, with the same error. A file
        of another format goes to ``readers`` (``opguard_read_trace``)."""
        try:
            data = read_bytes(Path(path))
            if readers is not None and not is_callsite_trace(data):
                other = readers.read(path, data)
                if other is not None:
                    self.add(other)
                    return
                try:
                    self.add(decode_trace(data, path, check_frame_ids=False))
                except InputError as exc:
                    raise readers.declined(exc, data) from None
                return
            if find_callsites is None or not self._add_scanned(data, str(path)):
                self.add(decode_trace(data, path, check_frame_ids=False))
        except MemoryError:
            raise InputError(path, "out of memory reading this file") from None

    def _add_scanned(self, data: bytes, path: str) -> bool:
        """Add a one-rank file with the header decoded by msgspec and the callsites
        read from the bytes by ``scan_callsites``; False when the file is not of the
        plain shape it reads (msgspec's path then decodes it and explains any
        problem), having added at most the file's frames, which that path adds too.

        When the callsites are the document's last member (as every writer puts
        them), the header is decoded from the bytes before them (``find_callsites``),
        so msgspec does not also walk the callsites to skip them (19 ms of 10 MB)."""
        assert find_callsites is not None and scan_callsites is not None
        offset = find_callsites(data)
        try:
            head = _HEAD_DECODER.decode(data if offset is None else data[:offset] + b"[]}")
        except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
            return False
        if head.format != TRACE_FORMAT or head.version not in READ_VERSIONS:
            return False
        try:
            check_nesting(head.meta, path)
            check_ranks(head.meta, [], path)
        except InputError:
            return False
        file_ranks = trace_ranks(head.meta, path)
        if len(file_ranks) != 1:
            return False
        self._unpack()
        local = array.array("I", [self._intern(frame) for frame in head.frames]).tobytes()
        scanned = scan_callsites(
            *((head.callsites, 0, False) if offset is None else (data, offset, True)),
            local,
            cast("StackTable", self.stacks),  # the scanner is in use only with the C table
            self.apis,
            self.ops,
            self.roles,
            self.dtypes,
            head.version >= ROLE_VERSION,
        )
        if scanned is not None and not (
            all(map(is_role, self.roles)) and all(map(is_dtype, self.dtypes))
        ):
            # msgspec's path names the callsite and its role or dtype; the names that
            # are valid stay interned (the dicts hold a few names, not one per callsite)
            self.roles = {role: role for role in self.roles if is_role(role)}
            self.dtypes = {dtype: dtype for dtype in self.dtypes if is_dtype(dtype)}
            return False
        if scanned is None:
            return False
        collectives = head.collectives
        if collectives is None and offset is not None:
            try:
                collectives = _tail_collectives(data, path, len(head.frames), file_ranks)
            except InputError:
                return False  # msgspec's path explains it
        elif collectives is not None:
            try:
                check_collectives(collectives, path, len(head.frames), file_ranks)
            except InputError:
                return False
        scan_keys, counts, file_total = scanned
        if head.version >= ROLE_VERSION:  # every key has its role (the scan required it)
            keys = cast("list[SiteKey]", scan_keys)
        else:
            keys = _with_roles(scan_keys, self.roles)
            if any(isinstance(key[3], int) for key in scan_keys):  # a role derived, as
                keys, counts = _without_duplicates(keys, counts)  # add() (derived_roles)
        total = self._checked_total(path, file_total)
        self._fold_file(path, head.meta, file_ranks, total, keys, counts, None)
        if collectives is not None:
            frame_ids = array.array("I")
            frame_ids.frombytes(local)
            self._add_sequences(collectives.sequences, frame_ids.tolist())
        self.extras.add({})
        return True

    def _add_summed(self, summed: dict[str, dict[str, int]]) -> None:
        for key, counts in summed.items():
            mine = self.summed.setdefault(key, {})
            for name, count in counts.items():
                mine[name] = min(mine.get(name, 0) + count, MAX_COUNT)

    def update(self, other: TraceAccumulator) -> None:
        """Fold another accumulator (for example a worker's partial result) into this one."""
        total = self.total + other.total
        if total > MAX_COUNT:
            last = other.claims[-1][0] if other.claims else None
            raise InputError(last, f"the counts add up to {total}, more than 2**63-1 ops")
        self._unpack()
        remap = [self._intern(frame) for frame in other.frames]
        identity = remap == list(range(len(remap)))
        new_ids = self.stacks.absorb(other.stacks, None if identity else remap)
        if other._packed is not None:
            self._merge_packed(other._packed, new_ids)
        self._fold(
            ((new_ids[stack], api, op, role, dtype), slot)
            for (stack, api, op, role, dtype), slot in other.sites.items()
        )
        for (stack, api, op, role, dtype), extra in other.site_extras.items():
            key = (new_ids[stack], api, op, role, dtype)
            self.site_extras.setdefault(key, _Agreement()).update(extra)
        for frame, agreement in other.frame_extras.items():
            self.frame_extras.setdefault(frame, _Agreement()).update(agreement)
        self.sequences_valid = self.sequences_valid and other.sequences_valid
        for seq_key, mask in other.sequences.items():
            self._add_sequence(seq_key if identity else _remap_key(seq_key, remap), mask)
        self.stats_valid = (
            self.stats_valid and other.stats_valid and not (self.rank_mask & other.rank_mask)
        )
        self.rank_mask |= other.rank_mask
        self.inputs += other.inputs
        self.total = total
        self.claims += other.claims
        self.meta.update(other.meta)
        _add_partial(self.partial, other.partial)
        self._add_summed(other.summed)
        self.extras.update(other.extras)
        self.warnings += other.warnings

    def __getstate__(self) -> dict[str, Any]:
        """Pickle compactly: without ``frame_ids`` (rebuilt from ``frames``) or the
        string tables (caches, restarted empty), and with ``sites`` packed into flat
        arrays and columns (:class:`_PackedSites`), so the receiving process
        unpickles a few large objects instead of one tuple and one int per frame of
        every stack, and folds them in with C-level remapping."""
        self._unpack()
        state = dict(self.__dict__)
        for cache in ("frame_ids", "apis", "ops", "roles", "dtypes"):
            del state[cache]
        sites = state.pop("sites")
        keys = list(sites)
        values = list(sites.values())
        state["_packed"] = _PackedSites(
            array.array("I", [key[0] for key in keys]).tobytes(),
            [key[1] for key in keys],
            [key[2] for key in keys],
            [key[3] for key in keys],
            [key[4] for key in keys],
            [value[_COUNT] for value in values],
            [value[_MASK] for value in values],
            [value[_MIN] for value in values],
            {
                position: tuple(value[_MIN_MASK:])
                for position, value in enumerate(values)
                if value[_MIN_MASK] is not None
            },
        )
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.sites = {}
        self.frame_ids = {frame: index for index, frame in enumerate(self.frames)}
        self.apis, self.ops, self.roles, self.dtypes = {}, {}, {}, {}

    def _unpack(self) -> None:
        """Unpack sites that arrived pickled into ``sites`` (once, on first use)."""
        packed = self._packed
        if packed is not None:
            self._packed = None
            self._merge_packed(packed, None)

    def _merge_packed(self, packed: _PackedSites, new_ids: list[int] | None) -> None:
        """Fold packed sites in; their stack ids become ``new_ids[id]`` (unchanged if
        None). Their slots are built here, so they are taken over, not copied."""
        ids = array.array("I")
        ids.frombytes(packed.stack_ids)
        stack_ids = ids.tolist() if new_ids is None else list(map(new_ids.__getitem__, ids))
        stats = packed.stats
        if merge_packed is not None:
            merge_packed(
                self.sites,
                stack_ids,
                packed.apis,
                packed.ops,
                packed.roles,
                packed.dtypes,
                packed.counts,
                packed.masks,
                packed.mins,
                stats,
                COLLECTIVE_APIS,
                MAX_DISTINCT,
            )
            return
        self._fold(  # the reference for merge_packed (opguard_core/combine/_scan.c)
            (
                (
                    (stack, api, op, role, dtype),
                    [count, mask, low, *stats[position]]
                    if position in stats
                    else [count, mask, low, None, low, None, None],
                )
                for position, (stack, api, op, role, dtype, count, mask, low) in enumerate(
                    zip(
                        stack_ids,
                        packed.apis,
                        packed.ops,
                        packed.roles,
                        packed.dtypes,
                        packed.counts,
                        packed.masks,
                        packed.mins,
                        strict=True,
                    )
                )
            ),
            owned=True,
        )

    def _fold(self, items: Iterable[tuple[SiteKey, list[Any]]], owned: bool = False) -> None:
        """Add (key, slot) pairs to the sites (partials; ``add`` inlines this); an
        ``owned`` slot is nobody else's and is taken over, others are copied."""
        sites = self.sites
        get = sites.get
        for key, incoming in items:
            slot = get(key)
            if slot is None:
                sites[key] = incoming if owned else _copy_slot(incoming)
            else:
                merge_slot(slot, incoming, is_collective(key[2], key[1]))

    def result(self) -> CallsiteTrace:
        """The canonical combined trace."""
        self._unpack()
        order = sorted(range(len(self.frames)), key=lambda i: self.frames[i].sort_key())
        new_id = [0] * len(order)
        for new, old in enumerate(order):
            new_id[old] = new
        frames = [self.frames[old] for old in order]
        canonical = self.stacks.canonical(new_id)  # by stack id, once each
        sites = list(self.sites.items())
        order = site_order([key for key, _ in sites], canonical)
        all_mask = self.rank_mask
        site_extras = self.site_extras
        stats_valid = self.stats_valid
        build = build_callsites or py_build_callsites
        callsites = build(sites, order, canonical, all_mask, stats_valid, RankLists(),
                          Callsite, PerRank)  # fmt: skip
        callsite_extras = {}
        for position, index in enumerate(order) if site_extras else ():
            agreement = site_extras.get(sites[index][0])
            if agreement is not None and agreement.result():
                callsite_extras[position] = agreement.result()
        frame_extras = {}
        for position, frame in enumerate(frames):
            agreement = self.frame_extras.get(frame)
            if agreement is not None and agreement.result():
                frame_extras[position] = agreement.result()
        meta = self.meta.result()
        meta.update({key: dict(sorted(counts.items())) for key, counts in self.summed.items()})
        meta["ranks"] = mask_to_ranks(all_mask)
        if stats_valid and self.inputs:
            meta[PER_RANK_KEY] = True
        if self.partial:
            meta[PARTIAL_RANKS_KEY] = {str(r): self.partial[r] for r in sorted(self.partial)}
        collectives = None
        if self.sequences and self.sequences_valid:
            sequences = [
                _sequence_of(_remap_key(key, new_id), mask_to_ranks(mask))
                for key, mask in self.sequences.items()
            ]
            sequences.sort(key=lambda seq: seq.ranks[0])
            collectives = Collectives(sequences=sequences)
        return CallsiteTrace(
            meta=dict(sorted(meta.items())),
            frames=frames,
            callsites=callsites,
            extras=self.extras.result(),
            frame_extras=frame_extras,
            callsite_extras=callsite_extras,
            collectives=collectives,
        )


def _sequence_key(seq: CollectiveSequence, remap: list[int]) -> SequenceKey:
    """A sequence as an accumulator keys it, its stacks mapped through ``remap``."""
    return (
        tuple(seq.groups),
        tuple(
            msgspec.structs.replace(sig, stack=tuple(remap[f] for f in sig.stack))
            for sig in seq.signatures
        ),
        tuple(seq.steps),
    )


def _remap_key(key: SequenceKey, remap: list[int]) -> SequenceKey:
    groups, signatures, steps = key
    return (
        groups,
        tuple(
            msgspec.structs.replace(sig, stack=tuple(remap[f] for f in sig.stack))
            for sig in signatures
        ),
        steps,
    )


def _sequence_of(key: SequenceKey, ranks: list[int]) -> CollectiveSequence:
    groups, signatures, steps = key
    return CollectiveSequence(
        ranks=ranks, groups=list(groups), signatures=list(signatures), steps=list(steps)
    )


#: how a writer puts ``collectives`` after the callsites (a JSON string cannot hold
#: the newline, so this is never inside one)
_COLLECTIVES_TAIL = b'],\n"collectives":'


def _tail_collectives(data: bytes, path: str, frames: int, ranks: list[int]) -> Collectives | None:
    """The ``collectives`` a writer put after the callsites (which the scanner's
    header decode leaves out); None where the document has none; InputError where
    they cannot be read so (msgspec's path then reads the document)."""
    at = data.rfind(_COLLECTIVES_TAIL)
    if at < 0:
        if b'"collectives"' in data:
            raise InputError(path, "collectives where the scanner does not look")
        return None
    tail = data[at + len(_COLLECTIVES_TAIL) :].rstrip()
    if not tail.endswith(b"}"):
        raise InputError(path, "truncated collectives")
    return decode_collectives(tail[:-1], path, frames, ranks)


def _with_roles(keys: list[ScanKey], roles: dict[str, str]) -> list[SiteKey]:
    """A version 1 or 2 file's scanned keys with their roles: a callsite without one
    has its raw stream in the role's place, whose role :func:`legacy_roles` gives
    (interned in ``roles``)."""
    legacy = {(op, stream) for _, _, op, stream, _ in keys if isinstance(stream, int)}
    found = {pair: roles.setdefault(role, role) for pair, role in legacy_roles(legacy).items()}
    return [
        (stack, api, op, found[(op, role)] if isinstance(role, int) else role, dtype)
        for stack, api, op, role, dtype in keys
    ]


def _without_duplicates(keys: list[SiteKey], counts: list[int]) -> tuple[list[SiteKey], list[int]]:
    """A one-rank file's keys with those that are equal (a version 1 or 2 file's
    collective recorded on two streams: one role, ``comm``) made one, counts summed,
    in the order first seen: a callsite twice in one file would otherwise drop every
    per-rank statistic of the combine."""
    if len(set(keys)) == len(keys):
        return keys, counts
    merged: dict[SiteKey, int] = {}
    for key, count in zip(keys, counts, strict=True):
        merged[key] = merged.get(key, 0) + count
    return list(merged), list(merged.values())


def _copy_slot(slot: list[Any]) -> list[Any]:
    """A slot that shares no mutable histogram with ``slot``."""
    copied = list(slot)
    if isinstance(copied[_HIST], dict):
        copied[_HIST] = dict(copied[_HIST])
    return copied


def partial_ranks(
    meta: dict[str, Any], file_ranks: list[int], path: str
) -> dict[int, dict[str, Any]]:
    """The ranks of one input whose records were written before their process was done:
    a combined input's ``meta.partial_ranks``, else every rank of a file with
    ``meta.partial`` (a mapping: what the tracer writes) but a set-up file's. Refuses a
    ``partial_ranks`` that does not map the file's ranks to mappings."""
    if PARTIAL_RANKS_KEY not in meta:
        marker = meta.get("partial")
        if not isinstance(marker, dict) or meta.get("phase") == SETUP_PHASE:
            return {}  # complete, or a set-up file: its phase had ended when it was written
        return {rank: marker for rank in file_ranks}
    listed, found = meta[PARTIAL_RANKS_KEY], partial_ranks_of(meta)
    if isinstance(listed, dict) and len(found) == len(listed) and found.keys() <= set(file_ranks):
        return found
    raise InputError(path, f"meta.{PARTIAL_RANKS_KEY} must map the file's ranks to partial markers")


def _add_partial(into: dict[int, dict[str, Any]], more: dict[int, dict[str, Any]]) -> None:
    """Add ``more`` to ``into``; a rank in both (its file given twice) keeps the marker
    whose JSON sorts first, so the result does not depend on the order of the inputs."""
    for rank, marker in more.items():
        held = into.get(rank)
        if held is None or _json_key(marker) < _json_key(held):
            into[rank] = marker


def _json_key(value: Any) -> bytes:
    return msgspec.json.encode(value, order="sorted")


class RankLists(dict[int, list[int]]):
    """:func:`mask_to_ranks` with the lists of masks seen before kept (a combined
    trace's masks repeat: the same rank sets over and over); callsites with one rank
    set share its list (a copy each cost 10 MiB at 128 ranks × 20k callsites of
    generate_traces_other.py: docs/performance.md), so a combined trace's ``ranks``,
    ``min_ranks``, ``max_ranks`` and ``counts`` lists are read-only.

    Call it with a mask. It is a dict by mask, so a known mask costs a C-level
    lookup (``result()`` makes about a million at 160k callsites of differing
    counts, where a Python ``__call__`` cost a quarter of a second); only a new one
    runs Python (``__missing__``)."""

    def __missing__(self, mask: int) -> list[int]:
        ranks = self[mask] = mask_to_ranks(mask)
        return ranks

    __call__ = dict.__getitem__


def py_build_callsites(
    sites: list[tuple[SiteKey, list[Any]]],
    order: list[int],
    canonical: list[tuple[bytes, tuple[int, ...]]],
    all_mask: int,
    stats_valid: bool,
    ranks_of: RankLists,
    callsite: type[Callsite] = Callsite,
    per_rank: type[PerRank] = PerRank,
) -> list[Callsite]:
    """The combined trace's callsites: ``sites`` (key, slot) in ``order``, each with its
    stack (``canonical[stack id][1]``), its ranks (None for ``all_mask``) and, where
    ``stats_valid`` and its ranks' counts differ, its :class:`PerRank`; every rank list
    from ``ranks_of`` (shared). The reference of the C ``build_callsites``
    (``_scan.c``), which builds the same objects (``callsite`` and ``per_rank`` are the
    two types, passed so the C code imports nothing)."""
    ranks = ranks_of.__getitem__
    return [
        callsite(
            stack=canonical[key[0]][1],
            api=key[1],
            op=key[2],
            role=key[3],
            dtype=key[4],
            count=slot[_COUNT],
            ranks=None if slot[_MASK] == all_mask else ranks(slot[_MASK]),
            per_rank=(
                _per_rank(slot, ranks, per_rank)
                if stats_valid and slot[_MIN_MASK] is not None
                else None
            ),
        )
        for key, slot in map(sites.__getitem__, order)
    ]


def _per_rank(
    slot: list[Any], ranks_of: Callable[[int], list[int]], per_rank: type[PerRank]
) -> PerRank:
    """The written statistics of a site whose ranks disagree (min < max), its rank
    lists from ``ranks_of``."""
    hist = _histogram(slot, copy=False)
    return per_rank(
        min=slot[_MIN],
        min_ranks=ranks_of(slot[_MIN_MASK]),
        max=slot[_MAX],
        max_ranks=ranks_of(slot[_MAX_MASK]),
        counts=None
        if hist is None
        else [(value, ranks_of(mask)) for value, mask in sorted(hist.items())],
    )


def _incoming_slot(site: Callsite, mask: int, path: str, position: int, trusted: bool) -> list[Any]:
    """A multi-rank input's callsite as a slot: its ``per_rank`` statistics, or, without
    them, the same count on each of its ranks (only trusted when the input says
    ``meta.per_rank_stats``; otherwise the accumulator's statistics are dropped)."""
    stats = site.per_rank
    if stats is None:
        ranks = mask.bit_count()
        if trusted and site.count % ranks:
            raise InputError(
                path,
                f"callsites[{position}]: count {site.count} is not the same on each of its "
                f"{ranks} ranks, but the callsite has no per_rank statistics",
            )
        return [site.count, mask, max(1, site.count // ranks), None,
                max(1, site.count // ranks), None, None]  # fmt: skip
    low_mask, high_mask = ranks_to_mask(stats.min_ranks), ranks_to_mask(stats.max_ranks)
    if (low_mask | high_mask) & ~mask or stats.min >= stats.max:
        raise InputError(
            path,
            f"callsites[{position}].per_rank: min_ranks/max_ranks must lie within the "
            f"callsite's ranks and min < max",
        )
    hist: Any = None
    if stats.counts is None:
        hist = _OVERFLOW
    elif len(stats.counts) > 2:
        hist = {value: ranks_to_mask(ranks) for value, ranks in stats.counts}
    return [site.count, mask, stats.min, low_mask, stats.max, high_mask, hist]
