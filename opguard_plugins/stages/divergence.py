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
  median over ranks by more than ``--skew`` times the median.

Memory is that of the trace plus one rank mask per function and, for the few
functions whose callsites disagree between ranks, one count per rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from statistics import median_low
from typing import Any

from opguard_core import hookimpl
from opguard_core.combine.accumulator import (
    COLLECTIVE_APIS,
    CallsiteTrace,
    is_collective,
    mask_to_ranks,
    ranks_to_mask,
)
from opguard_core.formats.divergence import Finding
from opguard_core.formats.trace import Callsite
from opguard_core.formats.tree import target_name
from opguard_core.model import RunOptions
from opguard_plugins.stages.compress import DEFAULT_HIDE, hidden_frames
from opguard_plugins.stages.sequences import sequence_findings
from opguard_plugins.stages.sorted_runs import visible_frames

#: how many enclosing functions a finding's ``context`` lists (as config entries do)
CONTEXT_DEPTH = 3


def site_histogram(site: Callsite, all_mask: int, exact: bool) -> dict[int, int] | None:
    """{per-rank count: rank mask} over *all* ranks (0 for ranks that never ran the
    callsite); None when the counts are not known exactly."""
    mask = all_mask if site.ranks is None else ranks_to_mask(site.ranks)
    stats = site.per_rank
    if stats is None:
        if not exact:
            return None
        hist = {site.count // mask.bit_count(): mask}
    elif stats.counts is None:
        return None
    else:
        hist = {value: ranks_to_mask(ranks) for value, ranks in stats.counts}
    missing = all_mask & ~mask
    if missing:
        hist[0] = missing
    return hist


def add_per_rank_counts(into: dict[int, float], site: Callsite, ranks: list[int]) -> None:
    """Add each rank's count of ``site`` to ``into`` (nothing for ranks that never ran
    it); where the histogram overflowed, ranks other than the min and max ones get
    the mean of the rest. Added in place: a function's totals gather many callsites."""
    get = into.get
    stats = site.per_rank
    if stats is None:
        present = ranks if site.ranks is None else site.ranks
        value = site.count // len(present)
        for rank in present:
            into[rank] = get(rank, 0) + value
        return
    if stats.counts is not None:
        for value, holders in stats.counts:
            for rank in holders:
                into[rank] = get(rank, 0) + value
        return
    counts: dict[int, float] = dict.fromkeys(stats.min_ranks, stats.min)
    counts.update(dict.fromkeys(stats.max_ranks, stats.max))
    present = ranks if site.ranks is None else site.ranks
    rest = [r for r in present if r not in counts]
    if rest:
        left = site.count - stats.min * len(stats.min_ranks) - stats.max * len(stats.max_ranks)
        counts.update(dict.fromkeys(rest, left / len(rest)))
    for rank, share in counts.items():
        into[rank] = get(rank, 0) + share


def majority(hist: dict[int, int]) -> int:
    """The count most ranks have; a tie goes to the count of the lowest rank."""
    return max(hist, key=lambda value: (hist[value].bit_count(), -_lowest(hist[value])))


def _lowest(mask: int) -> int:
    return (mask & -mask).bit_length() - 1


class _Stacks:
    """Every callsite's visible frames (hidden plumbing removed), calling function,
    rank mask and whether it is a collective, in trace order, and the frames' names."""

    def __init__(self, trace: CallsiteTrace, options: RunOptions) -> None:
        hide = [*(DEFAULT_HIDE if options.default_hide else ()), *options.hide]
        self.frames = trace.frames
        self.names = [target_name(f.module, f.file, f.qualname) for f in trace.frames]
        self.user = bytes(not (f.module or "").startswith("torch") for f in trace.frames)
        self.hidden = bytes(hidden_frames(trace, hide))
        #: per callsite: its frame ids without hidden ones, and the position in them of
        #: the calling function (the innermost frame outside torch, else the innermost
        #: frame; None for no frame)
        self.visible, self.callers = visible_frames(
            [site.stack for site in trace.callsites], self.hidden, self.user
        )
        #: per callsite: whether it is a collective (:func:`is_collective`, once per op)
        ops = {site.op for site in trace.callsites}
        c10d = {op: is_collective(op, None) for op in ops}
        self.collective = [c10d[site.op] or site.api in COLLECTIVE_APIS for site in trace.callsites]
        #: per callsite: its ranks as a mask (all of them where ``ranks`` is None)
        all_mask = ranks_to_mask(trace.ranks)
        self.masks = [
            all_mask if site.ranks is None else ranks_to_mask(site.ranks)
            for site in trace.callsites
        ]

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
        names = [self.names[fid] for fid in frames]
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
    findings = sequence_findings(collectives, stacks.describe_stack) if collectives else []
    if not covered.issuperset(ranks):
        # some rank recorded no sequence (an older trace): counts per callsite too
        findings.extend(_collectives(trace, stacks, exact))
    findings.extend(_rank_specific(trace, stacks))
    if exact:
        findings.extend(_count_skew(trace, stacks, options.skew))
    return findings


def _collectives(trace: CallsiteTrace, stacks: _Stacks, exact: bool) -> Iterator[Finding]:
    all_mask = ranks_to_mask(trace.ranks)
    for site, frames, caller, collective in zip(
        trace.callsites, stacks.visible, stacks.callers, stacks.collective, strict=True
    ):
        if not collective:
            continue
        hist = site_histogram(site, all_mask, exact)
        if hist is None:  # counts unknown: only ranks that never issued it can be told
            if site.ranks is None:
                continue
            hist = {-1: ranks_to_mask(site.ranks), 0: all_mask & ~ranks_to_mask(site.ranks)}
        if len(hist) < 2:
            continue
        expected = majority(hist)
        counts = {
            rank: value
            for value, mask in hist.items()
            if value != expected
            for rank in mask_to_ranks(mask)
        }
        deviating = sorted(counts)
        where = stacks.describe(frames, caller)
        known = -1 not in hist
        shown = {str(r): counts[r] for r in deviating} if known else {}
        issued = (
            ", ".join(f"rank {r}: {counts[r]}" for r in deviating[:8])
            + (" …" if len(deviating) > 8 else "")
            if known
            else "counts unknown"
        )
        yield {
            "kind": "collective_mismatch",
            "severity": "error",
            "ranks": deviating,
            "op": site.op,
            "api": site.api,
            "stream": site.role,
            "target": where["target"],
            "context": where["context"],
            "expected": expected if known else None,
            "counts": shown,
            "size": sum(abs(counts[r] - expected) for r in deviating) if known else len(deviating),
            "message": (
                f"{site.op} in {where['target']} is issued "
                f"{expected if known else 'never'} time(s) on most ranks but differently on "
                f"rank(s) {_short(deviating)} ({issued}); every rank must issue a "
                f"collective equally often"
            ),
            "stack": where["stack"],
        }


def _rank_specific(trace: CallsiteTrace, stacks: _Stacks) -> Iterator[Finding]:
    """The outermost function of each path some ranks never took."""
    all_mask = ranks_to_mask(trace.ranks)
    visible = stacks.visible
    masks = stacks.masks
    # a function in any callsite that every rank ran is run by every rank: one C-level
    # set update per such callsite; only the (few) other callsites are walked
    everywhere: set[int] = set()
    # callsites share one list per stack: each distinct list is read once
    full = {
        id(frames): frames for frames, mask in zip(visible, masks, strict=True) if mask == all_mask
    }
    for frames in full.values():
        everywhere.update(frames)
    function_mask: dict[str, int] = dict.fromkeys({stacks.names[f] for f in everywhere}, all_mask)
    for frames, mask in zip(visible, masks, strict=True):
        if mask != all_mask:
            for fid in frames:
                name = stacks.names[fid]
                function_mask[name] = function_mask.get(name, 0) | mask
    roots: dict[str, dict[str, Any]] = {}
    for site, frames, mask in zip(trace.callsites, visible, masks, strict=True):
        if mask != all_mask:
            for position, name in enumerate(map(stacks.names.__getitem__, frames)):
                if function_mask[name] != all_mask:
                    root = roots.setdefault(name, {"ops": 0, "best": (-1, frames, position)})
                    if site.count > root["best"][0]:
                        root["best"] = (site.count, frames, position)
                    break
    if not roots:
        return
    root_frames = {fid for fid, name in enumerate(stacks.names) if name in roots}
    within: dict[int, list[str]] = {}  # by stack (its frames' list): the roots in it
    for site, frames in zip(trace.callsites, visible, strict=True):
        names = within.get(id(frames))
        if names is None:
            names = within[id(frames)] = (
                []
                if root_frames.isdisjoint(frames)
                else [name for name in {stacks.names[fid] for fid in frames} if name in roots]
            )
        for name in names:
            roots[name]["ops"] += site.count
    for name, root in roots.items():
        ran = mask_to_ranks(function_mask[name])
        missing = mask_to_ranks(all_mask & ~function_mask[name])
        _, frames, position = root["best"]
        where = stacks.describe(frames, position)
        yield {
            "kind": "rank_specific",
            "severity": "warning",
            "ranks": ran,
            "missing": missing,
            "target": name,
            "context": where["context"],
            "ops": root["ops"],
            "size": root["ops"],
            "message": (
                f"{name} ran only on rank(s) {_short(ran)} ({root['ops']} ops), "
                f"never on {_short(missing)}"
            ),
            "stack": where["stack"][: position + 1],
        }


def _count_skew(trace: CallsiteTrace, stacks: _Stacks, skew: float) -> Iterator[Finding]:
    """Functions (the calling function of their callsites) whose per-rank op count
    strays from the median over ranks by more than ``skew`` times the median."""
    ranks = trace.ranks
    all_mask = ranks_to_mask(ranks)
    # per calling function: ops summed over callsites, and per-rank totals, the latter
    # only for functions with a callsite whose ranks disagree
    ops: dict[str, int] = {}
    uniform: dict[str, float] = {}
    varied: dict[str, dict[int, float]] = {}
    example: dict[str, tuple[int, list[int], int]] = {}
    function_mask: dict[str, int] = {}
    names = stacks.names
    for site, frames, position, collective, mask in zip(
        trace.callsites, stacks.visible, stacks.callers, stacks.collective, stacks.masks,
        strict=True,
    ):  # fmt: skip
        if collective:
            continue
        name = "<root>" if position is None else names[frames[position]]
        function_mask[name] = function_mask.get(name, 0) | mask
        ops[name] = ops.get(name, 0) + site.count
        if position is not None and site.count > example.get(name, (-1, [], 0))[0]:
            example[name] = (site.count, frames, position)
        if site.per_rank is None and mask == all_mask:
            uniform[name] = uniform.get(name, 0) + site.count // len(ranks)
            continue
        add_per_rank_counts(varied.setdefault(name, {}), site, ranks)
    for name, totals in varied.items():
        if function_mask[name] != all_mask:
            continue  # some ranks never ran it: a rank_specific finding says so
        base = uniform.get(name, 0)
        per_rank = {rank: base + totals.get(rank, 0) for rank in ranks}
        middle = median_low(per_rank.values())
        deviating = sorted(r for r, v in per_rank.items() if abs(v - middle) > skew * middle)
        if not deviating:
            continue
        _, frames, position = example.get(name, (0, [], 0))
        where = stacks.describe(frames, position) if frames else stacks.describe([], None)
        counts = {str(r): _number(per_rank[r]) for r in deviating}
        yield {
            "kind": "count_skew",
            "severity": "warning",
            "ranks": deviating,
            "target": name,
            "context": where["context"],
            "expected": _number(middle),
            "counts": counts,
            "ops": ops[name],
            "size": int(sum(abs(per_rank[r] - middle) for r in deviating)),
            "message": (
                f"{name}: ops on rank(s) {_short(deviating)} differ from the median "
                f"{_number(middle)} by more than {skew:g}x"
            ),
            "stack": where["stack"][: position + 1] if frames else [],
        }


def _number(value: float) -> int | float:
    return int(value) if float(value).is_integer() else round(value, 3)


def _short(ranks: list[int]) -> str:
    text = ", ".join(map(str, ranks[:8]))
    return text + (f" … ({len(ranks)} ranks)" if len(ranks) > 8 else "")


@hookimpl(trylast=True)
def opguard_divergence(trace: CallsiteTrace, options: RunOptions) -> list[Finding]:
    return find_divergence(trace, options)
