"""The combine algebra: a multiset union of callsite traces, with frames interned.

:class:`TraceAccumulator` takes decoded traces one at a time (so a run never holds
every rank file at once) and other accumulators (so partial results from worker
processes or a Dask cluster fold together). Callsite identity is
(stack as frame values, api, op, stream); ranks are kept as an integer bit mask.
The result is canonical: frames sorted by value, callsites by stack, so the output
does not depend on the order the inputs came in.
"""

from __future__ import annotations

import array
import contextlib
import dataclasses
import enum
import gc
import itertools
from collections.abc import Iterable, Iterator
from operator import itemgetter
from pathlib import Path
from typing import Any, NamedTuple

import msgspec

from opguard_core.errors import InputError
from opguard_core.trace_format import (
    Callsite,
    DecodedTrace,
    Frame,
    encode_trace,
    load_trace,
    validate_frame_ids,
)
from opguard_core.values import same_json

#: key of a callsite in an accumulator: (stack of global frame ids, api, op, stream)
SiteKey = tuple[tuple[int, ...], str | None, str, int]


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


def remap_stack(stack: tuple[int, ...], table: list[int]) -> tuple[int, ...]:
    """``stack`` with every frame id ``i`` replaced by ``table[i]``.

    ``itemgetter(*stack)`` gathers all ids in one C call, about a third faster
    than ``tuple(map(table.__getitem__, stack))``; it returns a bare item, not a
    tuple, for one id, hence the fallback. An id out of range raises IndexError.
    (:meth:`TraceAccumulator.add` inlines this: it is the combine's hot loop.)
    """
    if len(stack) > 1:
        result: tuple[int, ...] = itemgetter(*stack)(table)
        return result
    return tuple(map(table.__getitem__, stack))


def ranks_to_mask(ranks: Iterable[int]) -> int:
    mask = 0
    for rank in ranks:
        mask |= 1 << rank
    return mask


def mask_to_ranks(mask: int) -> list[int]:
    """The set bits of ``mask``, ascending (rank ``r`` is bit ``1 << r``)."""
    if mask < 0:
        raise ValueError("a rank mask is never negative")
    bits = bin(mask)[:1:-1]  # least significant bit first
    return [rank for rank, bit in enumerate(bits) if bit == "1"]


class _SiteOut(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A callsite as written: key order stack, api, op, stream, count, ranks;
    ``api`` and ``ranks`` left out when None (same bytes as the dict form)."""

    stack: tuple[int, ...]
    api: str | None = None
    op: str
    stream: int
    count: int
    ranks: list[int] | None = None


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

    @property
    def ranks(self) -> list[int]:
        return list(self.meta.get("ranks", []))

    @property
    def total(self) -> int:
        return sum(site.count for site in self.callsites)

    def to_json(self) -> bytes:
        """The canonical ``opguard-callsites`` document (formats.md §1)."""
        if not self.callsite_extras:
            # the common case: one small struct per callsite, no dict to build
            outs = [
                _SiteOut(
                    stack=site.stack,
                    api=site.api,
                    op=site.op,
                    stream=site.stream,
                    count=site.count,
                    ranks=site.ranks,
                )
                for site in self.callsites
            ]
            return encode_trace(self.meta, self.frames, outs, self.extras, self.frame_extras)
        sites: list[Any] = []
        for index, site in enumerate(self.callsites):
            doc: dict[str, Any] = {"stack": site.stack}
            if site.api is not None:
                doc["api"] = site.api
            doc["op"] = site.op
            doc["stream"] = site.stream
            doc["count"] = site.count
            if site.ranks is not None:
                doc["ranks"] = site.ranks
            extra = self.callsite_extras.get(index)
            if extra:
                doc.update(extra)
            sites.append(doc)
        return encode_trace(self.meta, self.frames, sites, self.extras, self.frame_extras)


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


class _PackedSites(NamedTuple):
    """An accumulator's sites in transit: every stack's frame ids end to end
    (``array('I')`` bytes), the stacks' lengths (same), then one list per column."""

    stacks: bytes
    lengths: bytes
    apis: list[str | None]
    ops: list[str]
    streams: list[int]
    counts: list[int]
    masks: list[int]


class TraceAccumulator:
    """Accumulates traces into one multiset of callsites."""

    def __init__(self) -> None:
        self.frame_ids: dict[Frame, int] = {}
        self.frames: list[Frame] = []
        #: one object per distinct api / op string, so that the sites' keys share them
        #: and comparing two keys compares these by identity, not by their bytes
        self.apis: dict[str | None, str | None] = {}
        self.ops: dict[str, str] = {}
        #: key -> [count, rank mask]
        self.sites: dict[SiteKey, list[int]] = {}
        #: sites as they arrived pickled (see __getstate__), not yet unpacked into ``sites``
        self._packed: _PackedSites | None = None
        self.rank_mask = 0
        #: one (path, ranks, callsites, meta states a rank) per file added: what
        #: opguard_core.rank_claims checks (two files of one entry claiming one rank)
        self.claims: list[tuple[str, tuple[int, ...], int, bool]] = []
        self.inputs = 0
        self.meta = _Agreement()
        self.extras = _Agreement()
        self.frame_extras: dict[Frame, _Agreement] = {}
        self.site_extras: dict[SiteKey, _Agreement] = {}

    def _intern(self, frame: Frame) -> int:
        index = self.frame_ids.get(frame)
        if index is None:
            index = len(self.frames)
            self.frame_ids[frame] = index
            self.frames.append(frame)
        return index

    def add(self, trace: DecodedTrace) -> None:
        """Add one decoded trace (one rank file, or an earlier combined trace).

        The loop below is the hot path of a combine (once per callsite per rank):
        a stack is re-interned with one C-level gather over the file's frame table
        (:func:`remap_stack`, inlined), its api and op strings are interned (a lookup
        in a small dict that stays in cache, which saves loading two strings' bytes
        from all over memory to compare keys), and a callsite costs one dict lookup. The
        gather also refuses frame ids out of range, so decoding may skip that check
        (``check_frame_ids=False``); the error is the same, and comes before any
        rank error, as if decoding had checked.
        """
        self._unpack()
        file_ranks = trace.ranks()
        file_mask = ranks_to_mask(file_ranks)
        meta = {k: v for k, v in trace.meta.items() if k not in ("rank", "ranks")}
        local = [self._intern(frame) for frame in trace.frames]
        remap = local.__getitem__
        gather = itemgetter
        intern_api, intern_op = self.apis.setdefault, self.ops.setdefault
        callsites = trace.callsites
        sites = self.sites
        get = sites.get
        try:
            for position, site in enumerate(callsites):
                ranks = site.ranks
                if ranks is None:
                    mask = file_mask
                else:
                    mask = ranks_to_mask(ranks)
                    if mask & ~file_mask:
                        # a frame id out of range anywhere in the file is reported first
                        validate_frame_ids(trace.frames, callsites, trace.path)
                        raise InputError(
                            trace.path,
                            f"callsites[{position}].ranks {ranks} names ranks outside "
                            f"meta.ranks {file_ranks}",
                        )
                stack = site.stack
                api, op = site.api, site.op
                key = (
                    gather(*stack)(local) if len(stack) > 1 else tuple(map(remap, stack)),
                    intern_api(api, api),
                    intern_op(op, op),
                    site.stream,
                )
                slot = get(key)
                if slot is None:
                    sites[key] = [site.count, mask]
                else:
                    slot[0] += site.count
                    slot[1] |= mask
        except IndexError:  # a frame id out of range (decoding may leave this check to us)
            validate_frame_ids(trace.frames, callsites, trace.path)
            raise
        for position, site_extra in trace.callsite_extras.items():
            if site_extra:
                site = trace.callsites[position]
                key = (remap_stack(site.stack, local), site.api, site.op, site.stream)
                self.site_extras.setdefault(key, _Agreement()).add(site_extra)
        for index, extra in trace.frame_extras.items():
            self.frame_extras.setdefault(trace.frames[index], _Agreement()).add(extra)
        # bookkeeping last, so a file refused above leaves the accumulator's header alone
        self.rank_mask |= file_mask
        self.inputs += 1
        stated = "rank" in trace.meta or "ranks" in trace.meta
        self.claims.append((trace.path, tuple(file_ranks), len(callsites), stated))
        self.meta.add(meta)
        self.extras.add(trace.extras)

    def add_file(self, path: Path | str) -> None:
        """Read, decode and :meth:`add` one trace file. Decoding leaves the frame-id
        check to :meth:`add`, which makes it while re-interning, with the same error."""
        try:
            self.add(load_trace(Path(path), check_frame_ids=False))
        except MemoryError:
            raise InputError(path, "out of memory reading this file") from None

    def update(self, other: TraceAccumulator) -> None:
        """Fold another accumulator (for example a worker's partial result) into this one."""
        self._unpack()
        remap = [self._intern(frame) for frame in other.frames]
        identity = remap == list(range(len(remap)))
        if other._packed is not None:
            self._merge_packed(other._packed, None if identity else remap)
        self._fold(
            ((stack if identity else remap_stack(stack, remap), api, op, stream), count, mask)
            for (stack, api, op, stream), (count, mask) in other.sites.items()
        )
        for (stack, api, op, stream), extra in other.site_extras.items():
            key = (stack if identity else remap_stack(stack, remap), api, op, stream)
            self.site_extras.setdefault(key, _Agreement()).update(extra)
        for frame, agreement in other.frame_extras.items():
            self.frame_extras.setdefault(frame, _Agreement()).update(agreement)
        self.rank_mask |= other.rank_mask
        self.inputs += other.inputs
        self.claims += other.claims
        self.meta.update(other.meta)
        self.extras.update(other.extras)

    def __getstate__(self) -> dict[str, Any]:
        """Pickle compactly: without ``frame_ids`` (rebuilt from ``frames``) or the
        string tables (caches, restarted empty), and with ``sites`` packed into flat
        arrays and columns (:class:`_PackedSites`), so the receiving process
        unpickles a few large objects instead of one tuple and one int per frame of
        every stack, and folds them in with C-level remapping."""
        self._unpack()
        state = dict(self.__dict__)
        for cache in ("frame_ids", "apis", "ops"):
            del state[cache]
        sites = state.pop("sites")
        keys = list(sites)
        values = list(sites.values())
        stacks = [key[0] for key in keys]
        state["_packed"] = _PackedSites(
            array.array("I", itertools.chain.from_iterable(stacks)).tobytes(),
            array.array("I", map(len, stacks)).tobytes(),
            [key[1] for key in keys],
            [key[2] for key in keys],
            [key[3] for key in keys],
            [value[0] for value in values],
            [value[1] for value in values],
        )
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.sites = {}
        self.frame_ids = {frame: index for index, frame in enumerate(self.frames)}
        self.apis, self.ops = {}, {}

    def _unpack(self) -> None:
        """Unpack sites that arrived pickled into ``sites`` (once, on first use)."""
        packed = self._packed
        if packed is not None:
            self._packed = None
            self._merge_packed(packed, None)

    def _merge_packed(self, packed: _PackedSites, remap: list[int] | None) -> None:
        """Fold packed sites in; their frame ids become ``remap[id]`` (unchanged if None)."""
        ids = array.array("I")
        ids.frombytes(packed.stacks)
        lengths = array.array("I")
        lengths.frombytes(packed.lengths)
        flat = ids.tolist() if remap is None else list(map(remap.__getitem__, ids))
        ends = list(itertools.accumulate(lengths))
        starts = [0, *ends][:-1]
        self._fold(
            ((tuple(flat[start:end]), api, op, stream), count, mask)
            for start, end, api, op, stream, count, mask in zip(
                starts,
                ends,
                packed.apis,
                packed.ops,
                packed.streams,
                packed.counts,
                packed.masks,
                strict=True,
            )
        )

    def _fold(self, items: Iterable[tuple[SiteKey, int, int]]) -> None:
        """Add (key, count, rank mask) triples to the sites (partials; ``add`` inlines this)."""
        sites = self.sites
        get = sites.get
        for key, count, mask in items:
            slot = get(key)
            if slot is None:
                sites[key] = [count, mask]
            else:
                slot[0] += count
                slot[1] |= mask

    def result(self) -> CallsiteTrace:
        """The canonical combined trace."""
        self._unpack()
        order = sorted(range(len(self.frames)), key=lambda i: self.frames[i].sort_key())
        new_id = [0] * len(order)
        for new, old in enumerate(order):
            new_id[old] = new
        frames = [self.frames[old] for old in order]
        # (canonical stack, api or "", op, stream, api is set, original key)
        keyed = [
            (remap_stack(key[0], new_id), key[1] or "", key[2], key[3], key[1] is not None, key)
            for key in self.sites
        ]
        # the first five fields already differ between any two sites, so a plain
        # tuple sort orders by them alone (as a key of item[:5] would), without
        # building a 5-tuple per site
        keyed.sort()
        all_mask = self.rank_mask
        sites = self.sites
        site_extras = self.site_extras
        callsites = []
        callsite_extras = {}
        for position, (stack, _, op, stream, _, key) in enumerate(keyed):
            count, mask = sites[key]
            callsites.append(
                Callsite(
                    stack=stack,
                    api=key[1],
                    op=op,
                    stream=stream,
                    count=count,
                    ranks=None if mask == all_mask else mask_to_ranks(mask),
                )
            )
            if site_extras:
                agreement = site_extras.get(key)
                if agreement is not None and agreement.result():
                    callsite_extras[position] = agreement.result()
        frame_extras = {}
        for position, frame in enumerate(frames):
            agreement = self.frame_extras.get(frame)
            if agreement is not None and agreement.result():
                frame_extras[position] = agreement.result()
        meta = self.meta.result()
        meta["ranks"] = mask_to_ranks(all_mask)
        return CallsiteTrace(
            meta=dict(sorted(meta.items())),
            frames=frames,
            callsites=callsites,
            extras=self.extras.result(),
            frame_extras=frame_extras,
            callsite_extras=callsite_extras,
        )
