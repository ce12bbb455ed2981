"""Divergence: find the ranks that did something different (docs/divergence.md).

Where the trace carries the ranks' collective sequences (formats.md, "Collective
sequences"), they are compared by position per process group
(:mod:`opguard_plugins.stages.sequences`: ``collective_order``, ``_dtype``,
``_size``, ``_missing``, ``_extra``, ``_group``, ``_reduce_op``, all errors).
Otherwise (traces recorded before sequences existed) the per-rank statistics combine
keeps per callsite (formats.md §1, version 2) give

* ``collective_mismatch`` (error): a collective callsite whose count differs
  between ranks, or that some ranks never issue.

Both ways, two more kinds of finding:

* ``rank_specific`` (warning): a function only some ranks ran (the outermost such
  function of each rank-specific path);
* ``count_skew`` (warning): a function whose ops on some rank differ from the
  median over ranks by more than ``--skew`` times the median;
* ``dtype_mismatch`` (warning): a callsite whose op some ranks ran in other dtypes
  than the rest (formats.md, "Dtypes"), found from the callsites that not every rank
  ran (a difference makes one), so a trace without one costs a pass over its flags.

A ``collective_mismatch`` names a strict majority (more than half the ranks) or
says there is none, with the distribution (count → number of ranks), as sequence
findings do. The runner writes the findings grouped by kind and deviating ranks
(divergence format version 4, :mod:`opguard_core.formats.divergence`).

Memory is that of the trace plus, per function, its ops and a few numbers and, for
functions whose callsites disagree between ranks, one count per rank
(:func:`py_skew_fold`, in C where built: ``_runs.skew_fold``).
"""

from __future__ import annotations

import array
import math
from collections.abc import Callable, Iterator
from functools import reduce
from itertools import compress, islice, repeat
from itertools import count as counter
from operator import neg, or_
from statistics import median_low
from typing import Any

from opguard_core import hookimpl
from opguard_core.combine.accumulator import (
    COLLECTIVE_APIS,
    CallsiteTrace,
    RankLists,
    is_collective,
    mask_to_ranks,
    ranks_to_mask,
)
from opguard_core.errors import plural
from opguard_core.formats.collectives import POINT_TO_POINT_APIS, compared_by_position
from opguard_core.formats.divergence import Finding
from opguard_core.formats.trace import (
    TOLD_TO_STOP,
    Callsite,
    describe_partial,
    end_times,
    is_torch_module,
    list_ranks,
    partial_ranks_of,
)
from opguard_core.formats.tree import frame_targets
from opguard_core.model import RunOptions
from opguard_core.native import load_native
from opguard_plugins.stages.compress import DEFAULT_HIDE, hidden_frames
from opguard_plugins.stages.sequences import (
    all_partial,
    last_end,
    outlived,
    sequence_findings,
    went_on_longest,
)
from opguard_plugins.stages.sorted_runs import (
    site_summary,
    site_touching,
    site_visible_frames,
    visible_frames,
)

#: how many enclosing functions a finding's ``context`` lists (as config entries do)
CONTEXT_DEPTH = 3


def site_histogram(
    site: Callsite,
    all_mask: int,
    exact: bool,
    mask_of: Callable[[list[int]], int] = ranks_to_mask,
) -> dict[int, int] | None:
    """{per-rank count: rank mask} over *all* ranks (0 for ranks that never ran the
    callsite); None when the counts are not known exactly (``mask_of``: a rank list's
    mask, :func:`ranks_to_mask` or :class:`_MaskOf`)."""
    mask = all_mask if site.ranks is None else mask_of(site.ranks)
    stats = site.per_rank
    if stats is None:
        if not exact:
            return None
        hist = {site.count // mask.bit_count(): mask}
    elif stats.counts is None:
        return None
    elif isinstance(mask_of, _MaskOf):  # its known masks read inline: no call each
        known = mask_of.known
        hist = {value: known.get(id(ranks)) or mask_of(ranks) for value, ranks in stats.counts}
    else:
        hist = {value: mask_of(ranks) for value, ranks in stats.counts}
    missing = all_mask & ~mask
    if missing:
        hist[0] = missing
    return hist


def majority(hist: dict[int, int], ended: dict[int, float] | None = None) -> tuple[int, bool]:
    """The count a strict majority (more than half) of the ranks has, and True; without
    one, the count of the reference and False: a rank whose record is complete, then
    the ranks whose records went on longest (``ended``: when partial ranks' records
    ended, as for collective sequences), then the lowest rank. A majority whose records
    all ended before another rank's is none
    (:func:`~opguard_plugins.stages.sequences.outlived`). ``hist`` is {count: rank
    mask} over every rank compared."""
    held = list(map(int.bit_count, hist.values()))
    total = sum(held)
    best_ranks = max(held, default=-1)
    best = next(compress(hist, map(best_ranks.__eq__, held)), -1)  # the first that many
    if not ended:
        if 2 * best_ranks > total:
            return best, True
        if 0 in held:  # a count no rank holds: its "lowest rank" is -1
            return min(hist, key=lambda value: _lowest(hist[value])), False
        # the count the lowest rank of all holds (the first holder of it, as min's)
        union = reduce(or_, hist.values())
        return next(compress(hist, map((union & -union).__and__, hist.values()))), False
    holders = {value: mask_to_ranks(mask) for value, mask in hist.items()}
    if 2 * best_ranks > total and not outlived(holders[best], holders, ended):
        return best, True
    return went_on_longest(holders, ended), False


def distribution(hist: dict[int, int]) -> list[list[int]]:
    """``[[count, number of ranks], …]``, the most held first, then by count."""
    # counts are distinct keys: (-holders, count) orders as the key (-d[1], d[0]) would
    order = sorted(zip(map(neg, map(int.bit_count, hist.values())), hist, strict=True))
    return [[value, -held] for held, value in order]


def _lowest(mask: int) -> int:
    return (mask & -mask).bit_length() - 1


class _MaskOf:
    """:func:`ranks_to_mask` once per list object: a combined trace shares one list
    per rank set (:class:`RankLists`), held by the trace while this is used."""

    def __init__(self) -> None:
        self.known: dict[int, int] = {}

    def __call__(self, ranks: list[int]) -> int:
        mask = self.known.get(id(ranks))
        if mask is None:
            mask = self.known[id(ranks)] = ranks_to_mask(ranks)
        return mask


def _collective_op(op: str) -> bool:
    """Whether ``op`` is a collective whatever its api (:func:`is_collective`)."""
    return is_collective(op, None)


class _Stacks:
    """Every callsite's calling function (its frame id), whether every rank ran it and
    whether it is a collective, in trace order, the frames' names, and which frames a
    callsite of every rank shows; a callsite's rank mask (:meth:`mask`) and visible
    frames (hidden plumbing removed, :meth:`visible_of`) are read for the few that need
    them, not kept for all. The callsites are read in place where the C extension is
    built (``_runs.site_summary``): in the forked helper that runs divergence, a
    Python-level pass over them would write every callsite's reference count and copy
    its page from the main process."""

    def __init__(self, trace: CallsiteTrace, options: RunOptions) -> None:
        hide = [*(DEFAULT_HIDE if options.default_hide else ()), *options.hide]
        self.frames = trace.frames
        self.names = frame_targets(trace.frames)
        #: per frame id: its function's number (frames of one function, at other lines,
        #: share it), and per number the function's name
        self.function_names = list(dict.fromkeys(self.names))
        number = {name: i for i, name in enumerate(self.function_names)}
        self.function = list(map(number.__getitem__, self.names))
        modules = [f.module for f in trace.frames]  # a few hundred distinct
        user = {module: not is_torch_module(module) for module in set(modules)}
        self.user = bytes(map(user.__getitem__, modules))
        self.hidden = bytes(hidden_frames(trace, hide, self.names))
        #: per callsite: its calling function's frame id (the innermost visible frame
        #: outside torch, else the innermost visible frame; -1 for none), whether
        #: every rank ran it and whether it is a collective (:func:`is_collective`, once
        #: per op); per frame id: whether a callsite every rank ran shows it; the
        #: callsites some ranks never ran with a visible frame outside those, and those
        #: with a dtype: one pass, in C where built, reading the callsites in place (a
        #: combined trace shares one ``ranks`` list per rank set: one mask each)
        self.callsites = trace.callsites
        self.all_mask = all_mask = ranks_to_mask(trace.ranks)
        self.mask_of = _MaskOf()
        (
            self.callers,
            self.everywhere,
            self.outside,
            self.full,
            self.collective,
            self.partial_dtyped,
        ) = site_summary(
            trace.callsites,
            self.hidden,
            self.user,
            all_mask,
            self.mask_of,
            _collective_op,
            COLLECTIVE_APIS,
        )
        self.caller = memoryview(self.callers).cast("i")

    def mask(self, index: int) -> int:
        """Callsite ``index``'s ranks as a mask (all of them where ``ranks`` is None)."""
        ranks = self.callsites[index].ranks
        return self.all_mask if ranks is None else self.mask_of(ranks)

    def visible_of(self, indices: list[int]) -> tuple[list[list[int]], list[int | None]]:
        """Per callsite of ``indices``: its visible frames and the position in them of
        its calling function (None for no frame)."""
        return site_visible_frames(self.callsites, indices, self.hidden, self.user)

    def where(self, index: int) -> dict[str, Any]:
        """:meth:`describe` for callsite ``index``: its target, context and stack."""
        visible, callers = self.visible_of([index])
        return self.describe(visible[0], callers[0])

    def describe_stack(self, stack: tuple[int, ...]) -> dict[str, Any]:
        """:meth:`describe` for a stack of frame ids (a collective signature's), its
        ``stack`` with each frame's file and line (two ranks' stacks often differ in
        lines only)."""
        visible, callers = visible_frames([tuple(stack)], self.hidden, self.user)
        where = self.describe(visible[0], callers[0])
        where["stack"] = [
            f"{self.names[fid]} ({self.frames[fid].file}:{self.frames[fid].line})"
            for fid in visible[0]
        ]
        return where

    def describe(self, frames: list[int], position: int | None) -> dict[str, Any]:
        if position is None:
            return {"target": "<root>", "context": [], "stack": []}
        names = list(map(self.names.__getitem__, frames))
        return {
            "target": names[position],
            "context": names[max(0, position - CONTEXT_DEPTH) : position],
            "stack": names,
        }


def find_divergence(trace: CallsiteTrace, options: RunOptions) -> list[Finding]:
    """Every finding for ``trace`` (unsorted); none for fewer than two ranks."""
    ranks = trace.ranks
    if len(ranks) < 2:
        return []
    exact = trace.per_rank_stats
    stacks = _Stacks(trace, options)
    collectives = trace.collectives
    covered = {r for seq in collectives.sequences for r in seq.ranks} if collectives else set()
    partial = partial_ranks_of(trace.meta)
    # when the partial ranks' records ended; a rank told to stop ran until every rank was
    # (infinity, as a complete record, but still partial: sequences.all_partial)
    ended = {**dict.fromkeys(partial, math.inf), **end_times(partial, leave_out=TOLD_TO_STOP)}
    findings = sequence_findings(collectives, stacks.describe_stack, ended) if collectives else []
    if not covered.issuperset(ranks):
        # some rank recorded no sequence (an older trace): counts per callsite too
        findings.extend(_collectives(trace, stacks, exact, ended))
    findings.extend(_rank_specific(trace, stacks))
    findings.extend(_dtype_mismatch(trace, stacks))
    if exact:
        findings.extend(_count_skew(trace, stacks, options.skew))
    if partial:
        _note_partial(findings, partial)
    return findings


#: the findings a rank whose record ended early makes by that alone: collectives it did
#: not issue (sequences compared, or counts where there are none)
ENDED_EARLY_KINDS = frozenset({"collective_missing", "collective_mismatch"})


#: findings that compare the ranks' op counts: a rank whose record ended early ran
#: fewer ops, so the others can look like the odd ones out (a median of two is the
#: lower count)
COUNTED_KINDS = frozenset({"count_skew", "rank_specific"})


def _note_partial(findings: list[Finding], partial: dict[int, dict[str, Any]]) -> None:
    """Say so in the message of a collective finding whose deviating ranks' traces were
    all written before their process was done (a rank that died, or hung and was
    killed, issues nothing after that point: its record simply ends there), and in
    every finding that compares op counts (the ranks' records do not cover the same
    stretch of the run)."""
    counted = f" (not comparable: traces that end early, {describe_partial(partial)})"
    for finding in findings:
        ranks = finding.get("ranks") or []
        if finding["kind"] in ENDED_EARLY_KINDS and ranks and partial.keys() >= set(ranks):
            mine = {r: partial[r] for r in ranks}
            finding["message"] += (
                f" (its trace was written before the process was done: {describe_partial(mine)};"
                " the sequence may only have ended there)"
            )
        elif finding["kind"] in COUNTED_KINDS:
            finding["message"] += counted


def _collectives(
    trace: CallsiteTrace, stacks: _Stacks, exact: bool, ended: dict[int, float]
) -> Iterator[Finding]:
    """``collective_mismatch``: a collective callsite the ranks issued unequally often,
    against the count a strict majority issued it, else the reference's
    (:func:`majority`; ``ended``: when partial ranks' records ended)."""
    all_mask = stacks.all_mask
    ranks = trace.ranks
    nranks = len(ranks)
    ranks_of = RankLists()
    callsites = trace.callsites
    # the collectives compared by count; what their per-rank counts say, read at once
    # where they are a clean partition of the ranks and no record ended early (in C
    # where built: :func:`py_collective_histograms`), else (None) by the general path
    compared = []
    for index in compress(counter(), stacks.collective):
        site = callsites[index]
        if site.per_rank is None and site.ranks is None:
            continue  # every rank issued it equally often
        if not compared_by_position(site.op) or site.api in POINT_TO_POINT_APIS:
            continue  # a send on one rank pairs with a recv on its peer, not with a send
        compared.append(index)
    read: list[CollectiveHistogram | bool | None] = (
        [None] * len(compared)
        if ended
        else collective_histograms(callsites, compared, ranks, list(map(str, ranks)))
    )
    # (callsite index, its histogram over every rank, or what was read) of each
    # collective the ranks issued unequally; then the visible frames of all in one pass
    unequal: list[tuple[int, dict[int, int] | CollectiveHistogram]] = []
    for index, got in zip(compared, read, strict=True):
        if got is False:
            continue  # one count on every rank
        if isinstance(got, tuple):
            unequal.append((index, got))
            continue
        site = callsites[index]
        hist = site_histogram(site, all_mask, exact, stacks.mask_of)
        if hist is None:  # counts unknown: only ranks that never issued it can be told
            if site.ranks is None:
                continue
            mask = stacks.mask(index)
            hist = {-1: mask, 0: all_mask & ~mask}
        if len(hist) > 1:
            unequal.append((index, hist))
    visible, callers = stacks.visible_of([index for index, _ in unequal])
    for (index, histogram), frames, position in zip(unequal, visible, callers, strict=True):
        site = callsites[index]
        never = 0
        if isinstance(histogram, tuple):
            expected, most, deviating, counts, size, shown, holders, reference = histogram
            known = True
            why = "" if most else "the lowest"
        else:
            hist = histogram
            expected, most = majority(hist, ended)
            deviating = ranks_of(all_mask & ~hist[expected])
            known = -1 not in hist
            counts = {}
            if known:
                value_of: dict[int, int] = {}
                for value, mask in hist.items():
                    if value != expected:
                        value_of.update(zip(ranks_of(mask), repeat(value)))
                counts = dict(
                    zip(map(str, deviating), map(value_of.__getitem__, deviating), strict=True)
                )
            size = (
                sum(abs(value - expected) * mask.bit_count() for value, mask in hist.items())
                if known
                else len(deviating)
            )
            shown = distribution(hist) if known and not most else None  # once for both
            holders, reference = hist[expected].bit_count(), _lowest(hist[expected])
            never = hist[0].bit_count() if 0 in hist else 0
            why = _why_reference(hist, expected, ended) if not most else ""
        where = stacks.describe(frames, position)
        finding: Finding = {
            "kind": "collective_mismatch",
            "severity": "error",
            "ranks": deviating,
            "op": site.op,
            "api": site.api,
            "stream": site.role,
            "target": where["target"],
            "context": where["context"],
            "expected": expected if known else None,
            "majority": most,
            "counts": counts,
            "size": size,
            "message": _mismatch_message(
                site.op,
                where["target"],
                expected,
                most,
                (holders, nranks),
                deviating,
                counts if known else None,
                shown,
                why,
                reference,
                never,
            ),
            "stack": where["stack"],
            "callsite": index,
        }
        if not most:
            finding["distribution"] = shown if shown is not None else []
        yield finding


#: what :func:`py_collective_histograms` reads for a collective callsite: (expected,
#: majority, deviating ranks, their counts by str(rank), size, distribution (None with
#: a majority), how many ranks hold the expected count, the lowest of them)
CollectiveHistogram = tuple[
    int, bool, list[int], dict[str, int], int, list[list[int]] | None, int, int
]


def py_collective_histograms(
    sites: list[Callsite], indices: list[int], ranks: list[int], rank_names: list[str]
) -> list[CollectiveHistogram | bool | None]:
    """Per callsite ``sites[i]`` of ``indices``, what its collective_mismatch finding
    says where no record ended early (:func:`site_histogram`, :func:`majority`,
    :func:`distribution`: :data:`CollectiveHistogram`); False where every rank has one
    count; None where its ``per_rank.counts`` are not a clean partition of the ranks
    (none, a rank twice or not one of ``ranks``, not the ranks of ``site.ranks``, a
    count twice, an empty list, a count not in 1..2**63-1), which the caller reads by
    the general path. ``rank_names[i]`` is ``str(ranks[i])``. The reference of the C
    ``collective_histograms`` (``_runs.c``)."""
    if len(set(ranks)) != len(ranks):
        raise ValueError("collective_histograms: a rank twice")
    if len(rank_names) != len(ranks):
        raise ValueError("collective_histograms: ranks and names differ")
    everyone = set(ranks)
    all_mask = ranks_to_mask(ranks)
    out: list[CollectiveHistogram | bool | None] = []
    for index in indices:
        site = sites[index]
        stats = site.per_rank
        if stats is None or stats.counts is None:
            out.append(None)
            continue
        present = everyone if site.ranks is None else site.ranks
        counted = [rank for _, holders in stats.counts for rank in holders]
        values = [value for value, _ in stats.counts]
        if (
            not all(0 < value < 2**63 for value in values)
            or len(set(values)) != len(values)
            or not all(holders for _, holders in stats.counts)
            or len(set(counted)) != len(counted)
            or len(set(present)) != len(present)
            or set(counted) != set(present)
            or not everyone.issuperset(present)
        ):
            out.append(None)
            continue
        hist = site_histogram(site, all_mask, True)
        assert hist is not None  # per_rank.counts are known
        if len(hist) < 2:
            out.append(False)
            continue
        expected, most = majority(hist)
        deviating = mask_to_ranks(all_mask & ~hist[expected])
        value_of = {rank: value for value, mask in hist.items() for rank in mask_to_ranks(mask)}
        out.append(
            (
                expected,
                most,
                deviating,
                {str(rank): value_of[rank] for rank in deviating},
                sum(abs(value - expected) * mask.bit_count() for value, mask in hist.items()),
                None if most else distribution(hist),
                hist[expected].bit_count(),
                _lowest(hist[expected]),
            )
        )
    return out


#: (sites, indices, ranks, rank_names) -> per index, :data:`CollectiveHistogram`,
#: False or None
CollectiveReader = Callable[
    [list[Callsite], list[int], list[int], list[str]], list[CollectiveHistogram | bool | None]
]


def _collective_reader() -> CollectiveReader:
    if load_native("opguard_plugins.stages._runs") is None:
        return py_collective_histograms
    from opguard_plugins.stages._runs import collective_histograms as compiled

    return compiled


#: the implementation in use: the C one where it was built
collective_histograms = _collective_reader()


def _why_reference(hist: dict[int, int], expected: int, ended: dict[int, float]) -> str:
    """Why rank ``_lowest(hist[expected])`` is the reference without a majority."""
    if not ended:  # no record ended early: the lowest rank's
        return "the lowest"
    holders = {value: mask_to_ranks(mask) for value, mask in hist.items()}
    others = [ranks for value, ranks in holders.items() if value != expected]
    if any(last_end(ranks, ended) < last_end(holders[expected], ended) for ranks in others):
        return "whose record went on longest"
    if not all_partial(holders[expected], ended) and any(
        all_partial(ranks, ended) for ranks in others
    ):
        return "whose record is complete"
    return "the lowest"


def _times(value: int) -> str:
    return "never" if value == 0 else "an unknown number of times" if value < 0 else f"{value}x"


def _mismatch_message(
    op: str,
    target: str,
    expected: int,
    most: bool,
    share: tuple[int, int],
    deviating: list[int],
    counts: dict[str, int] | None,
    shown: list[list[int]] | None,
    why: str,
    reference: int,
    never: int,
) -> str:
    """A ``collective_mismatch``'s message: who holds what, honestly (a strict
    majority, else no majority with the distribution, count → number of ranks:
    ``shown``, :func:`distribution`, where the counts are known; ``why``: why the
    reference rank, ``reference``, is the reference; ``never``: how many ranks never
    issued it, where the counts are not known)."""
    issued = (
        # counts are by str(rank), in the order of ``deviating``
        ", ".join([f"rank {r}: {value}" for r, value in islice(counts.items(), 8)])
        + (" …" if len(deviating) > 8 else "")
        if counts is not None
        else "counts unknown"
    )
    holders, nranks = share
    tail = "every rank must issue a collective equally often"
    if most:
        return (
            f"{op} in {target} is issued {_times(expected)} on {holders} of {nranks} ranks "
            f"(a majority) but differently on rank(s) {list_ranks(deviating)} ({issued}); {tail}"
        )
    if counts is None or shown is None:
        spread = f"issued on {nranks - never}, never on {never}"
    else:
        spread = ", ".join([f"{_times(v)}: {n} rank(s)" for v, n in shown[:8]])
        spread += f", … ({len(shown)} values)" if len(shown) > 8 else ""
    return (
        f"{op} in {target} is issued unequally with no majority ({spread}); against rank "
        f"{reference}, {why} ({_times(expected)}), rank(s) "
        f"{list_ranks(deviating)} differ ({issued}); {tail}"
    )


def _rank_specific(trace: CallsiteTrace, stacks: _Stacks) -> Iterator[Finding]:
    """The outermost function of each path some ranks never took."""
    all_mask = stacks.all_mask
    function = stacks.function
    # a function in any callsite that every rank ran is run by every rank: the frames
    # those callsites show come from the one pass over the stacks (``everywhere``, by
    # frame id: a function at another line of one shares its number), and so do the
    # callsites some ranks never ran with a frame outside them, the only ones walked
    everywhere = set(map(function.__getitem__, compress(counter(), stacks.everywhere)))
    outside = stacks.outside
    visible, _ = stacks.visible_of(outside)
    partial = [
        (index, frames, stacks.mask(index))
        for index, frames in zip(outside, visible, strict=True)
        if not everywhere.issuperset(map(function.__getitem__, frames))
    ]
    if not partial:
        return
    function_mask: dict[int, int] = {}
    for _, frames, mask in partial:
        for fid in frames:
            number = function[fid]
            if number not in everywhere:
                function_mask[number] = function_mask.get(number, 0) | mask
    # function → [ops, best count, its frames, position, callsite]
    roots: dict[int, list[Any]] = {}
    for index, frames, _ in partial:
        count = trace.callsites[index].count
        for position, fid in enumerate(frames):
            number = function[fid]
            if number in function_mask and function_mask[number] != all_mask:
                root = roots.get(number)
                if root is None:
                    roots[number] = [0, count, frames, position, index]
                elif count > root[1]:
                    root[1:] = [count, frames, position, index]
                break
    if not roots:
        return
    # the visible frames of the roots' functions: a stack shows a root where it has one
    hidden = stacks.hidden
    marked = bytes(number in roots and not hidden[fid] for fid, number in enumerate(function))
    within: dict[int, set[int]] = {}  # by stack (a tuple shared by callsites): its roots
    callsites = trace.callsites
    for index in site_touching(trace.callsites, marked):
        site = callsites[index]
        numbers = within.get(id(site.stack))
        if numbers is None:
            numbers = within[id(site.stack)] = {function[fid] for fid in site.stack if marked[fid]}
        for number in numbers:
            roots[number][0] += site.count
    ranks_of = RankLists()
    for number, (ops, _, frames, position, site_index) in roots.items():
        name = stacks.function_names[number]
        ran = ranks_of(function_mask[number])
        missing = ranks_of(all_mask & ~function_mask[number])
        where = stacks.describe(frames[: position + 1], position)  # down to it
        yield {
            "kind": "rank_specific",
            "severity": "warning",
            "ranks": ran,
            "missing": missing,
            "target": name,
            "context": where["context"],
            "ops": ops,
            "size": ops,
            "message": (
                f"{name} ran only on rank(s) {list_ranks(ran)} ({plural(ops, 'op')}), "
                f"never on {list_ranks(missing)}"
            ),
            "stack": where["stack"],
            "callsite": site_index,
        }


#: a bytes translation table: 0 to 1, anything else to 0
_NOT = bytes([1] + [0] * 255)


def _dtype_mismatch(trace: CallsiteTrace, stacks: _Stacks) -> Iterator[Finding]:
    """Each callsite (stack, api, op, stream role) whose ranks ran its op in different
    sets of dtypes: the set a strict majority of the ranks that ran it ran, else the
    lowest rank's, against every other. A difference needs a variant some rank did not
    run, so only the keys of such variants are gathered."""
    callsites = trace.callsites
    # the callsites some ranks never ran with a dtype (from the pass over all), only
    # those read
    partial = list(map(callsites.__getitem__, stacks.partial_dtyped))
    if not partial:
        return
    near = {(site.stack[-1:], site.op) for site in partial}  # a cheap first test
    variants: dict[tuple[Any, ...], list[int]] = {}
    for index, site in enumerate(callsites):
        if site.dtype is not None and (site.stack[-1:], site.op) in near:
            key = (site.stack, site.api, site.op, site.role)
            variants.setdefault(key, []).append(index)
    ranks_of = RankLists()
    for (_, api, op, role), members in variants.items():
        if len(members) < 2:
            continue
        held: dict[int, list[str]] = {}  # rank -> the dtypes it ran here, sorted
        for index in sorted(members, key=lambda i: str(callsites[i].dtype)):
            for rank in ranks_of(stacks.mask(index)):
                held.setdefault(rank, []).append(str(callsites[index].dtype))
        sets: dict[tuple[str, ...], list[int]] = {}
        for rank in sorted(held):
            sets.setdefault(tuple(held[rank]), []).append(rank)
        if len(sets) < 2:
            continue
        ran = len(held)
        common, holders = max(sets.items(), key=lambda item: (len(item[1]), -item[1][0]))
        most = 2 * len(holders) > ran
        if not most:
            common = next(s for s, r in sets.items() if min(held) in r)
            holders = sets[common]
        deviating = sorted(r for s, ranks in sets.items() if s != common for r in ranks)
        others = {"+".join(s): ranks for s, ranks in sets.items() if s != common}
        got = "; ".join(f"{name} on rank(s) {list_ranks(r)}" for name, r in sorted(others.items()))
        where = stacks.where(members[0])
        reference = (
            f"on {len(holders)} of {ran} ranks (a majority)"
            if most
            else f"on rank {holders[0]}, the lowest (no majority)"
        )
        yield {
            "kind": "dtype_mismatch",
            "severity": "warning",
            "ranks": deviating,
            "op": op,
            "api": api,
            "stream": role,
            "target": where["target"],
            "context": where["context"],
            "expected": list(common),
            "majority": most,
            "dtypes": {name: ranks for name, ranks in sorted(others.items())},
            "size": sum(callsites[i].count for i in members if callsites[i].dtype not in common),
            "message": (
                f"{op} in {where['target']} ran in {'+'.join(common)} {reference}, but in {got}: "
                "the ranks compute in different dtypes"
            ),
            "stack": where["stack"],
            "callsite": members[0],
        }


#: what :func:`py_skew_fold` gives: per calling function (its number; the last slot:
#: no frame) the ops, whether every rank ran a callsite of it (one callsite whose
#: ``ranks`` are None, or the ``ranks`` of its callsites together, all of them the
#: trace's) and the position in the callsites of its largest callsite; and per
#: function whose per-rank ops stray from their median by more than ``skew`` times
#: it, (number, median, per-rank ops in ``ranks`` order as native doubles: 8 bytes a
#: rank, where a list of floats is 32, for thousands of functions at 128 ranks, and
#: the positions in ``ranks`` of the ranks that stray)
SkewFold = tuple[list[int], bytearray, list[int | None], list[tuple[int, float, bytes, list[int]]]]


def py_skew_fold(
    sites: list[Callsite],
    callers: bytes,
    function: bytes,
    skip: bytes,
    functions: int,
    ranks: list[int],
    skew: float,
) -> SkewFold:
    """Fold ``sites`` but those ``skip`` marks (bytes, one a site: the collectives)
    into per-function totals (:data:`SkewFold`); the reference of the C ``skew_fold``
    (``_runs.c``), which gives the same numbers, bit for bit. The calling function of
    ``sites[i]`` is ``function[callers[i]]`` (both native 4-byte ints: ``callers`` by
    site, -1 for none; ``function`` by frame id: the function's number).

    A function's per-rank total is a share every rank has plus what differs per
    rank: a callsite whose histogram overflowed adds the mean of its middle ranks to
    every rank and the difference to its min and max ranks only, so a callsite costs
    a few additions, not one per rank. The median is the lower one."""
    caller = memoryview(callers).cast("i")
    number_of = memoryview(function).cast("i")
    if len(caller) != len(sites) or len(skip) != len(sites):
        raise ValueError("skew_fold: sites, callers and skip differ in length")
    nranks = len(ranks)
    at = {rank: position for position, rank in enumerate(ranks)}
    size = functions + 1
    ops = [0] * size
    uniform = [0.0] * size
    full = bytearray(size)
    best = [-1] * size
    example: list[int | None] = [None] * size
    varied: dict[int, list[float]] = {}
    #: per slot, the ranks of its callsites with ``ranks`` (None: one outside the
    #: trace's; every rank ran the function where they are all of them)
    cover: dict[int, set[int] | None] = {}
    for index in compress(counter(), skip.translate(_NOT)):
        site = sites[index]
        fid = caller[index]
        number = -1 if fid < 0 else number_of[fid]
        if not -1 <= number < functions:
            raise IndexError("skew_fold: function number out of range")
        slot = number if number >= 0 else functions
        count = site.count
        if number >= 0 and count > best[slot]:
            best[slot] = count
            example[slot] = index
        ops[slot] += count
        present = site.ranks
        if present is None:
            full[slot] = 1
        else:
            seen = cover.setdefault(slot, set())
            if seen is not None:
                cover[slot] = None if not at.keys() >= set(present) else seen.union(present)
        stats = site.per_rank
        if stats is None and present is None:
            uniform[slot] += count // nranks
            continue
        row = varied.get(slot)
        if row is None:
            row = varied[slot] = [0.0] * nranks
        if stats is None:
            assert present is not None
            value = count // len(present)
            for rank in present:
                row[at[rank]] += value
        elif stats.counts is not None:
            for value, holders in stats.counts:
                for rank in holders:
                    row[at[rank]] += value
        else:  # overflowed: min and max ranks exact, the rest their mean
            low, high = stats.min_ranks, stats.max_ranks
            rest = (nranks if present is None else len(present)) - len(low) - len(high)
            share = (count - stats.min * len(low) - stats.max * len(high)) / rest if rest else 0
            if present is None:
                uniform[slot] += share
            else:
                for rank in present:
                    row[at[rank]] += share
            for rank in low:
                row[at[rank]] += stats.min - share
            for rank in high:
                row[at[rank]] += stats.max - share
    found = []
    for slot, row in varied.items():
        base = uniform[slot]
        per_rank = [base + value for value in row]
        middle = median_low(per_rank)
        limit = skew * middle
        stray = [at for at, v in enumerate(per_rank) if abs(v - middle) > limit]
        if stray:
            row_bytes = array.array("d", per_rank).tobytes()
            found.append((slot if slot < functions else -1, middle, row_bytes, stray))
    for slot, seen in cover.items():
        if seen is not None and len(seen) == nranks:
            full[slot] = 1
    return ops, full, example, found


#: (sites, callers, function, skip, functions, ranks, skew) -> :data:`SkewFold`
SkewFolder = Callable[[list[Callsite], bytes, bytes, bytes, int, list[int], float], SkewFold]


def _skew_fold() -> SkewFolder:
    if load_native("opguard_plugins.stages._runs") is None:
        return py_skew_fold
    from opguard_plugins.stages._runs import skew_fold as compiled

    return compiled


#: the implementation in use: the C one where it was built
skew_fold = _skew_fold()


def _count_skew(trace: CallsiteTrace, stacks: _Stacks, skew: float) -> Iterator[Finding]:
    """Functions (the calling function of their callsites) whose per-rank op count
    strays from the median over ranks by more than ``skew`` times the median: per
    function, the share every rank has plus what differs per rank
    (:func:`py_skew_fold`)."""
    ranks = trace.ranks
    functions = len(stacks.function_names)
    ops, full, example, found = skew_fold(
        trace.callsites,
        stacks.callers,
        array.array("i", stacks.function).tobytes(),
        stacks.collective,
        functions,
        ranks,
        float(skew),
    )
    names = stacks.function_names
    kept: list[SkewKept] = []
    for number, middle, row, stray in found:
        slot = number if number >= 0 else functions
        if full[slot]:
            kept.append((number, slot, middle, row, stray))
        # else some ranks never ran it: a rank_specific finding says so
    # each finding's example callsite, and the visible frames of all of them in one pass
    site_indices = [example[slot] for _, slot, _, _, _ in kept]
    visible, callers = stacks.visible_of([i for i in site_indices if i is not None])
    yield from skew_findings(
        kept,
        site_indices,
        visible,
        callers,
        names,
        stacks.names,
        ranks,
        list(map(str, ranks)),
        ops,
        f"{skew:g}x",
        _number,
        _stray_size,
        list_ranks,
    )


#: (number, slot, middle, per-rank ops, straying positions) of a function that strays
SkewKept = tuple[int, int, float, bytes, list[int]]


def py_skew_findings(
    kept: list[SkewKept],
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
    ranks_text: Callable[[list[int]], str],
) -> list[Finding]:
    """The count_skew finding of each function of ``kept`` (as :func:`py_skew_fold`
    found it, and kept: every rank ran it): its straying ranks and their ops, its
    example callsite's stack down to the function (``visible`` and ``callers``: the
    visible frames of the ``site_indices`` that are not None, in order), the median
    (``number``: :func:`_number`), the size (``size_of``) and the message
    (``ranks_text``: :func:`list_ranks`). The reference of the C ``skew_findings``."""
    found: list[Finding] = []
    shown = iter(zip(visible, callers, strict=True))
    for (fnumber, slot, middle, row, stray), site_index in zip(kept, site_indices, strict=True):
        # the straying ranks (positions in ``ranks``) and their ops, in rank order
        deviating = list(map(ranks.__getitem__, stray))
        strayed = list(map(memoryview(row).cast("d").__getitem__, stray))
        name = "<root>" if fnumber < 0 else function_names[fnumber]
        frames, position = next(shown) if site_index is not None else ([], None)
        stack: list[str] = []
        context: list[str] = []
        if frames:  # down to the function
            at = position or 0
            stack = list(map(frame_names.__getitem__, frames[: at + 1]))
            context = stack[max(0, at - CONTEXT_DEPTH) : at]
        expected = number(middle)
        found.append(
            {
                "kind": "count_skew",
                "severity": "warning",
                "ranks": deviating,
                "target": name,
                "context": context,
                "expected": expected,
                "counts": dict(
                    zip(map(rank_names.__getitem__, stray), map(number, strayed), strict=True)
                ),
                "ops": ops[slot],
                "size": size_of(middle, strayed),
                "message": (
                    f"{name}: ops on rank(s) {ranks_text(deviating)} differ from the median "
                    f"{expected} by more than {threshold}"
                ),
                "stack": stack,
                "callsite": site_index,
            }
        )
    return found


#: (kept, site_indices, visible, callers, function_names, frame_names, ranks,
#: rank_names, ops, threshold, number, size_of, ranks_text) -> findings
SkewFinder = Callable[
    [
        list[SkewKept],
        list[int | None],
        list[list[int]],
        list[int | None],
        list[str],
        list[str],
        list[int],
        list[str],
        list[int],
        str,
        Callable[[float], int | float],
        Callable[[float, list[float]], int],
        Callable[[list[int]], str],
    ],
    list[Finding],
]


def _skew_finder() -> SkewFinder:
    if load_native("opguard_plugins.stages._runs") is None:
        return py_skew_findings
    from opguard_plugins.stages._runs import skew_findings as compiled

    return compiled


#: the implementation in use: the C one where it was built
skew_findings = _skew_finder()


def _stray_size(middle: float, strayed: list[float]) -> int:
    """A count_skew finding's size: how far its straying ranks' ops are from the
    median, together."""
    return int(round(sum([abs(v - middle) for v in strayed]), 6))


def _number(value: float) -> int | float:
    if type(value) is float and value.is_integer():  # nearly every count: no rounding
        return int(value)
    rounded = round(value, 3)
    return int(rounded) if float(rounded).is_integer() else rounded


@hookimpl(trylast=True)
def opguard_divergence(trace: CallsiteTrace, options: RunOptions) -> list[Finding]:
    return find_divergence(trace, options)
