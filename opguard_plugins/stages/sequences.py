"""Divergence by collective sequence (docs/divergence.md, "Collective sequences").

Every rank's collectives on a process group must match the other members' one by
one, in order: the n-th collective a rank issues on a group pairs with the n-th of
every other member, whatever line issued it. :func:`sequence_findings` compares the
sequences a combined trace carries (formats.md, "Collective sequences") by position,
per group, and reports the *first* position where the members disagree: later ones
usually follow from it.

At that position each member issues a collective (its kind, dtype, element count,
shapes, reduce op: :meth:`~opguard_core.formats.collectives.Signature.key`) or none
(its sequence ended). The value a strict majority of members holds is the expected
one and the other ranks deviate; without a strict majority (always so for two ranks
that disagree) the reference is the value of a rank whose record is complete, then a
collective over the end of a sequence (in a job where a rank died or hung, the rank
whose sequence ended is reported, not the one left waiting in the next collective,
which timed out: whichever of them was told to stop), then the value of the ranks
whose records went on longest (``ended``: when each rank's partial trace ends; one
told to stop, SIGTERM or SIGINT, which every rank is told at once, never does: in a
job where a rank died first, it is the one reported, whatever its number), then the
lowest rank's, and the finding says ``"majority": false`` with the distribution.
Ranks whose sequences end at the position because their records ended before another
rank's are no majority (:func:`outlived`: two ranks of three that died do not make
the third the odd one out).
Each deviating value is one finding, whose kind a short look-ahead decides: the
explanation under which the two sequences agree longest after the position (a window
of :data:`WINDOW` collectives):

* ``collective_order``: the next two collectives swapped (or another collective
  where the others issue this one);
* ``collective_missing``: the rank skipped this collective; ``collective_extra``: it
  issued one the others do not;
* ``collective_dtype``, ``collective_size``, ``collective_reduce_op``: the same
  collective with another dtype, element count/shape or reduce op;
* ``collective_group``: a ``collective_missing`` on one group and a
  ``collective_extra`` of the same collective, in the same step, on another group of
  the same rank merge into one: the rank issued it on a different group.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from opguard_core.formats.collectives import (
    Collectives,
    CollectiveSequence,
    Group,
    Signature,
    collective_kind,
    compared_by_position,
)
from opguard_core.formats.divergence import UNCHECKED_KIND, Finding
from opguard_core.formats.trace import list_ranks

#: collectives compared after the first disagreement to tell its kind
WINDOW = 32
#: collectives compared one by one on a group before giving up, with a
#: ``sequence_unchecked`` warning (stretches that repeat alike are skipped at once:
#: :func:`_walk`)
MAX_STEPPED = 10_000_000

#: collectives walked, over every distinct sequence, to look for a cycle of ranks
#: waiting for each other across groups (:func:`_wait_cycles`): each sequence's first
#: calls, its share of this; a cycle only later is not found
MAX_CYCLE_CALLS = 250_000

#: a group as divergence knows it: its name and members (several groups may share a
#: name where ranks created groups in a different order)
GroupId = tuple[str, tuple[int, ...]]
#: one collective at a position: (step, signature) of one sequence
Call = tuple[int, Signature]

#: turns a signature's stack into {"target", "context", "stack"} (frame names)
Describe = Callable[[tuple[int, ...]], dict[str, Any]]


#: one stretch of a view: steps ``first``..``last`` each issued ``calls`` on the group
Block = tuple[int, int, tuple[Signature, ...], tuple[Any, ...]]


@dataclass
class _View:
    """One distinct sequence's collectives on one group, and the ranks that issued it:
    its runs filtered on the group, runs with none dropped, neighbours with the same
    keys merged (canonical, however the sequence's other groups split its runs)."""

    blocks: list[Block]
    ranks: list[int]
    #: the position of its first call (``Group.first``: earlier ones not recorded)
    first: int = 0

    @classmethod
    def of(cls, sequence: CollectiveSequence, group_index: int | None) -> _View:
        if group_index is None:
            return cls([], [], 0)
        #: signature id -> its key, for the group's compared signatures (a sequence has
        #: a few signatures and millions of calls: one key() each)
        keyed = {
            number: sig.key()
            for number, sig in enumerate(sequence.signatures)
            if sig.group == group_index and compared_by_position(sig.op)
        }
        return cls(_blocks(sequence, keyed), [], sequence.groups[group_index].first)

    def shape(self) -> tuple[Any, ...]:
        """What two views must share to agree."""
        return (self.first, *((first, last, keys) for first, last, _, keys in self.blocks))


class _Cursor:
    """A position in a view: block, repetition (step) in it, call in that step. Moves
    a call at a time, or whole steps at once (:meth:`skip`), so runs of millions of
    steps are never expanded."""

    __slots__ = ("block", "blocks", "call", "periods", "rep")

    def __init__(self, blocks: list[Block]) -> None:
        self.blocks = blocks
        self.block = self.rep = self.call = 0
        #: block index -> the period of its step's keys (:meth:`rest`), once computed
        self.periods: dict[int, int] = {}

    def copy(self) -> _Cursor:
        other = _Cursor(self.blocks)
        other.block, other.rep, other.call = self.block, self.rep, self.call
        other.periods = self.periods
        return other

    def previous_step(self) -> int | None:
        """The step of the call before the current one (None before the first)."""
        if self.call or self.rep:
            return self.blocks[self.block][0] + self.rep - (0 if self.call else 1)
        return self.blocks[self.block - 1][1] if self.block else None

    def rest(self) -> tuple[tuple[Any, ...], int] | None:
        """What the rest of the current block repeats (one period of its keys, from
        the current call on) and how many calls it has left; None past the end."""
        block = self.current()
        if block is None:
            return None
        keys = block[3]
        period = self.periods.get(self.block)
        if period is None:
            period = self.periods[self.block] = _period(keys)
        offset = self.call % period
        return keys[offset:period] + keys[:offset], self.reps_left() * len(keys) - self.call

    def current(self) -> Block | None:
        return self.blocks[self.block] if self.block < len(self.blocks) else None

    def peek(self) -> Call | None:
        block = self.current()
        if block is None:
            return None
        return block[0] + self.rep, block[2][self.call]

    def key(self) -> Any:
        block = self.current()
        return None if block is None else block[3][self.call]

    def advance(self) -> None:
        block = self.blocks[self.block]
        self.call += 1
        if self.call == len(block[2]):
            self.skip(1)

    def reps_left(self) -> int:
        block = self.blocks[self.block]
        return block[1] - block[0] + 1 - self.rep

    def skip(self, reps: int) -> None:
        """Skip ``reps`` whole steps from the start of one (at most those left)."""
        first, last = self.blocks[self.block][:2]
        self.call = 0
        self.rep += reps
        if self.rep > last - first:  # the block is done
            self.block += 1
            self.rep = 0

    def window(self, size: int) -> list[Call]:
        cursor, out = self.copy(), list[Call]()
        while len(out) < size and (call := cursor.peek()) is not None:
            out.append(call)
            cursor.advance()
        return out


def _period(keys: tuple[Any, ...]) -> int:
    """The length of the shortest tuple whose repetition is ``keys`` (its own length
    where none is shorter): the prefix function of Knuth, Morris and Pratt."""
    border = [0] * len(keys)
    k = 0
    for i in range(1, len(keys)):
        while k and keys[i] != keys[k]:
            k = border[k - 1]
        if keys[i] == keys[k]:
            k += 1
        border[i] = k
    period = len(keys) - (border[-1] if keys else 0)
    return period if period and len(keys) % period == 0 else len(keys)


def _group_id(group: Group) -> GroupId:
    return (group.name, tuple(group.ranks))


def sequence_findings(
    collectives: Collectives, describe: Describe, ended: dict[int, float] | None = None
) -> list[Finding]:
    """The first disagreement on every process group (module docstring); ``ended``:
    when the records of the ranks whose traces are partial end (a POSIX time)."""
    by_rank = collectives.by_rank()
    groups: dict[GroupId, Group] = {}
    #: per group: each sequence that used it, with the group's index there
    users: dict[GroupId, dict[int, int]] = {}
    for seq in collectives.sequences:
        for index, group in enumerate(seq.groups):
            gid = _group_id(group)
            groups.setdefault(gid, group)
            users.setdefault(gid, {})[id(seq)] = index
    findings: list[Finding] = []
    #: the groups compared (two or more members), and those with a finding
    compared: set[GroupId] = set()
    reported: set[GroupId] = set()
    for gid in sorted(groups, key=lambda g: (_name_order(g[0]), g)):
        group = groups[gid]
        used = users[gid]
        members = {r for r in group.ranks if r in by_rank}
        members.update(r for seq in collectives.sequences if id(seq) in used for r in seq.ranks)
        if len(members) < 2:
            continue
        compared.add(gid)
        views: dict[int, _View] = {}
        for rank in sorted(members):
            seq = by_rank[rank]
            view = views.get(id(seq))
            if view is None:
                view = views[id(seq)] = _View.of(seq, used.get(id(seq)))
            view.ranks.append(rank)
        classes: dict[tuple[Any, ...], list[_View]] = {}
        for view in views.values():
            classes.setdefault(view.shape(), []).append(view)
        if len(classes) < 2:
            continue
        found = _first_disagreement(group, list(classes.values()), describe, ended or {})
        reported.update([gid] if found else [])
        findings.extend(found)
    alone = [gid for gid in groups if gid not in compared]
    findings = _merge_groups(
        findings,
        functools.partial(
            _issued_alone,
            collectives=collectives,
            groups=groups,
            users=users,
            alone=alone,
            describe=describe,
        ),
    )
    unreported = compared - reported
    ordered = _interleavings(collectives, groups, unreported, describe, ended or {})
    findings.extend(ordered or _wait_cycles(collectives, groups, unreported, describe))
    return findings


def _name_order(name: str) -> tuple[int, str]:
    """Groups by number (``"2"`` before ``"10"``), then any other names by text (a
    Unicode digit such as ``"²"``, or a number of more than 18 digits, among them)."""
    numeric = name.isascii() and name.isdigit() and len(name) <= 18
    return (int(name), "") if numeric else (1 << 62, name)


def _advance_by(cursor: _Cursor, calls: int) -> None:
    """Move ``cursor`` on by ``calls`` calls, whole steps at once where it can."""
    while calls > 0 and (block := cursor.current()) is not None:
        per = len(block[2])
        if cursor.call == 0 and calls >= per:
            reps = min(cursor.reps_left(), calls // per)
            cursor.skip(reps)
            calls -= reps * per
        else:
            cursor.advance()
            calls -= 1


def last_end(ranks: Iterable[int], ended: dict[int, float]) -> float:
    """When the last of ``ranks``' records ends (infinity: one is complete, or was told
    to stop)."""
    return max(ended.get(rank, math.inf) for rank in ranks)


def all_partial(ranks: Iterable[int], ended: dict[int, float]) -> bool:
    """Whether the records of all of ``ranks`` were written before their process was
    done (they are in ``ended``, a rank told to stop at infinity)."""
    return all(rank in ended for rank in ranks)


def outlived(ranks: list[int], holders: Mapping[Any, list[int]], ended: dict[int, float]) -> bool:
    """Whether the records of all of ``ranks`` ended early (``ended``) and before the
    record of another rank among ``holders`` (value → its ranks): such ranks cannot
    outvote a rank that went on (three ranks, two of which died: the one left is not
    the odd one out)."""
    return all_partial(ranks, ended) and last_end(
        (r for held in holders.values() for r in held), ended
    ) > last_end(ranks, ended)


def went_on_longest(holders: Mapping[Any, list[int]], ended: dict[int, float]) -> Any:
    """The reference without a majority: of ``holders`` (value → its ranks), the value
    of a rank whose record is complete (it ran to its own end), then a collective over
    None or a :class:`Skipped` step (the rank whose sequence ended, or that issued
    nothing in the step, is the odd one: of two ranks whose records ended early, one
    that waited in a collective the other never issued, and so timed out, ended by
    waiting, whichever of them was then told to stop), then the value of the ranks
    whose records went on longest, then the value of the lowest rank."""
    return min(
        holders,
        key=lambda k: (
            all_partial(holders[k], ended),
            k is None or isinstance(k, Skipped),
            -last_end(holders[k], ended),
            min(holders[k]),
        ),
    )


class Skipped(NamedTuple):
    """What ranks hold at a position in a step in which they issued no collective on
    the group, where others issue this one (they issue theirs in a later step)."""

    step: int


#: why :func:`_walk` stopped: the classes differ in a key; one skipped a step; all
#: ended together (they agree); :data:`MAX_STEPPED` calls walked one at a time
DIFFER, GAP, AGREE, UNCHECKED = "differ", "gap", "agree", "unchecked"


def _walk(cursors: list[_Cursor], position: int) -> tuple[int, str]:
    """Move ``cursors`` on together to the first position where they part, from
    ``position``: where a key differs; or, where a class's sequence comes up short
    (ends while another's goes on), where it first skipped a whole step in which
    another issues its next call (:func:`_skipped_step`): the step it left out. Step
    numbers alone part nothing (a rank whose optimizer steps are numbered otherwise
    issues the same collectives in the same order). Stretches that repeat alike (the
    rests of the current blocks repeat the same keys from where each cursor is: whole
    steps issued alike, or the same calls split into steps differently) are skipped at
    once; only where they do not is it a call at a time, and at most
    :data:`MAX_STEPPED` calls. Returns the position and why it stopped."""
    stepped = 0
    #: the blocks where the rests were last found not to repeat alike: moving a call
    #: at a time turns every rest by one, so they do not until a block changes
    apart: tuple[int, ...] | None = None
    #: where a class first skipped a step, and the cursors there
    gap: tuple[int, list[_Cursor]] | None = None
    while True:
        if gap is None and _skipped_step(cursors) is not None:
            gap = (position, [c.copy() for c in cursors])
        blocks = tuple(c.block for c in cursors)
        if blocks != apart:
            rests = [c.rest() for c in cursors]
            if all(r is not None for r in rests) and len({r[0] for r in rests if r}) == 1:
                calls = min(r[1] for r in rests if r)
                for cursor in cursors:
                    _advance_by(cursor, calls)
                position += calls
                continue
            apart = blocks
        keys = [c.key() for c in cursors]
        if len(set(keys)) > 1:
            if gap is not None and None in keys:  # it came up short: the step it left out
                cursors[:] = gap[1]
                return gap[0], GAP
            return position, DIFFER
        if keys[0] is None:  # all ended together: they differ in step numbers only
            return position, AGREE
        if stepped == MAX_STEPPED:
            return position, UNCHECKED
        for cursor in cursors:
            cursor.advance()
        position += 1
        stepped += 1


def _skipped_step(cursors: list[_Cursor]) -> int | None:
    """The step a class skipped at the cursors' position: the earliest step of their
    current calls, where a class whose call is later issued its previous call before
    it (it issued nothing in a step in which another class issues this call)."""
    steps = [(call[0], c) for c in cursors if (call := c.peek()) is not None]
    if len(steps) < 2:
        return None
    low = min(step for step, _ in steps)
    for step, cursor in steps:
        if step > low and (before := cursor.previous_step()) is not None and before < low:
            return low
    return None


def _first_disagreement(
    group: Group, classes: list[list[_View]], describe: Describe, ended: dict[int, float]
) -> list[Finding]:
    """Findings at the first position where ``classes`` (views that agree) differ."""
    cursors = [_Cursor(views[0].blocks) for views in classes]
    ranks_of = [sorted(r for v in views for r in v.ranks) for views in classes]
    # a view that starts later (its first calls not recorded) is compared from there:
    # the others skip their calls before it
    position = max(views[0].first for views in classes)
    for views, cursor in zip(classes, cursors, strict=True):
        _advance_by(cursor, position - views[0].first)
    position, why = _walk(cursors, position)
    if why == AGREE:
        return []
    if why == UNCHECKED:
        return [_unchecked(group, position, sorted(r for ranks in ranks_of for r in ranks))]
    here = [c.peek() for c in cursors]
    keys: list[Any] = [c.key() for c in cursors]
    gap = _skipped_step(cursors) if why == GAP else None
    if gap is not None:  # a class that skipped the step holds that, not its next call
        keys = [
            Skipped(gap) if call is not None and call[0] > gap else key
            for call, key in zip(here, keys, strict=True)
        ]
    distribution, winner, majority = _reference(keys, ranks_of, ended)
    reference = next(i for i, key in enumerate(keys) if key == winner)
    expected_window = cursors[reference].window(WINDOW + 2)
    skipped = {i for i, key in enumerate(keys) if isinstance(key, Skipped)}
    shown = [
        {"value": _text(here[keys.index(key)], gap if keys.index(key) in skipped else None),
         "ranks": sorted(ranks)}
        for key, ranks in sorted(distribution.items(), key=lambda kv: min(kv[1]))
    ]  # fmt: skip
    findings = []
    done: set[Any] = set()
    for index, key in enumerate(keys):
        if key == winner or key in done:
            continue
        done.add(key)
        got_window = cursors[index].window(WINDOW + 2)
        if (index in skipped) != (reference in skipped):  # one of them skipped the step
            kind = "collective_missing" if index in skipped else "collective_extra"
        else:
            kind = _kind(expected_window, got_window)
        findings.append(
            _finding(
                kind,
                group,
                position,
                expected_window[0] if expected_window else None,
                got_window[0] if got_window else None,
                sorted(distribution[key]),
                sorted(distribution[winner]),
                majority,
                shown,
                describe,
                gap if (index in skipped) != (reference in skipped) else None,
            )
        )
    return findings


def _reference(
    keys: list[Any], ranks_of: list[list[int]], ended: dict[int, float]
) -> tuple[dict[Any, list[int]], Any, bool]:
    """The distribution at a position (each class's value ``keys[i]``, held by its
    ``ranks_of[i]``: value -> ranks), the reference value and whether a strict majority
    holds it (else the ranks that went on longest, then the lowest: module docstring)."""
    distribution: dict[Any, list[int]] = {}
    for key, ranks in zip(keys, ranks_of, strict=True):
        distribution.setdefault(key, []).extend(ranks)
    total = sum(len(r) for r in distribution.values())
    winner = max(distribution, key=lambda k: len(distribution[k]))
    # a majority whose sequences ended here because their records did is no majority
    majority = 2 * len(distribution[winner]) > total and not (
        winner is None and outlived(distribution[winner], distribution, ended)
    )
    if not majority:  # the ranks that went on longest are the reference, then the lowest
        winner = went_on_longest(distribution, ended)
    return distribution, winner, majority


def _unchecked(
    group: Group, position: int, ranks: list[int], other: Group | None = None
) -> Finding:
    """A warning that ``group`` (or the order of ``group``'s and ``other``'s
    collectives between them) was compared only up to ``position``: the members'
    sequences agree so far, call by call, but they split their steps so differently
    that :data:`MAX_STEPPED` calls were walked one at a time."""
    what = (
        f"{_label(group)} compared only up to collective #{position}"
        if other is None
        else f"the order of {_label(group)}'s and {_label(other)}'s collectives compared "
        f"only up to their collective #{position}"
    )
    finding: Finding = {
        "kind": UNCHECKED_KIND,
        "severity": "warning",
        "ranks": ranks,
        "op": None,
        "group": _group_doc(group),
        "position": position,
        "target": "<root>",
        "context": [],
        "stack": [],
        "size": len(ranks),
        "message": (
            f"{what}: its members agree call by call so far, but split their steps "
            f"differently, and past {MAX_STEPPED} collectives compared one at a time the "
            "rest was not compared"
        ),
    }
    if other is not None:
        finding["other_group"] = _group_doc(other)
    return finding


def _interleavings(
    collectives: Collectives,
    groups: dict[GroupId, Group],
    compared: set[GroupId],
    describe: Describe,
    ended: dict[int, float],
) -> list[Finding]:
    """``collective_order`` where ranks that share two groups interleave the groups'
    collectives in another order (each group on its own agrees): the first position,
    among the two groups' collectives merged in the order each rank issued them, where
    the ranks differ. Only pairs of ``compared`` groups (two or more members, no
    finding of their own) that two or more ranks both use, and that every one of them
    recorded from the start (``Group.first``), are compared."""
    #: per pair of groups: each sequence that used both, with their indexes there
    pairs: dict[tuple[GroupId, GroupId], list[tuple[CollectiveSequence, int, int]]] = {}
    for seq in collectives.sequences:
        mine = sorted(
            (gid, index)
            for index, group in enumerate(seq.groups)
            if (gid := _group_id(group)) in compared and not group.first
        )
        for a, (gid, index) in enumerate(mine):
            for other, other_index in mine[a + 1 :]:
                pairs.setdefault((gid, other), []).append((seq, index, other_index))
    findings: list[Finding] = []
    for pair in sorted(pairs, key=lambda p: [(_name_order(g[0]), g) for g in p]):
        users = pairs[pair]
        if sum(len(seq.ranks) for seq, _, _ in users) < 2:
            continue
        classes: dict[tuple[Any, ...], list[_View]] = {}
        for seq, index, other_index in users:
            view = _merged_view(seq, {index: pair[0], other_index: pair[1]})
            classes.setdefault(view.shape(), []).append(view)
        if len(classes) > 1:
            views = list(classes.values())
            findings.extend(_first_interleaving(groups, pair, views, describe, ended))
    return findings


def _wait_cycles(
    collectives: Collectives,
    groups: dict[GroupId, Group],
    candidates: set[GroupId],
    describe: Describe,
) -> list[Finding]:
    """A ``collective_order`` where ranks wait for each other in a cycle through three
    or more groups, each agreeing on its own and every two of them in the order their
    shared ranks issue them (a 2 × 2 mesh: rank 0 all-reduces on its tensor-parallel
    group first, rank 1 on its data-parallel group; no pair of groups is used by two
    ranks, so :func:`_interleavings` compares none). The ranks' collectives on the
    ``candidates`` (compared groups without a finding of their own, recorded from the
    start) are played as blocking calls: the n-th collective on a group completes once
    every member issued it. A wait left when no call can complete, traced from rank
    to the member it waits for, closes the cycle. Looked for only where the groups
    that ranks use together form a cycle, over each sequence's first calls (its share
    of :data:`MAX_CYCLE_CALLS`)."""
    used: list[tuple[CollectiveSequence, dict[int, GroupId]]] = []
    for seq in collectives.sequences:
        mine = {
            index: gid
            for index, group in enumerate(seq.groups)
            if (gid := _group_id(group)) in candidates and not group.first
        }
        if mine:
            used.append((seq, mine))
    if not _groups_form_a_cycle([sorted(set(mine.values())) for _, mine in used]):
        return []
    members: dict[GroupId, int] = {}
    for seq, mine in used:
        for gid in set(mine.values()):
            members[gid] = members.get(gid, 0) + len(seq.ranks)
    budget = max(MAX_CYCLE_CALLS // len(used), 1)
    calls = [_first_calls(seq, mine, budget) for seq, mine in used]
    blocked = _play(calls, [len(seq.ranks) for seq, _ in used], members)
    cycle = _cycle_of(blocked, used)
    if cycle is None:
        return []
    return [_cycle_finding(cycle, blocked, calls, used, groups, describe)]


def _groups_form_a_cycle(used_together: list[list[GroupId]]) -> bool:
    """Whether the groups, joined where a sequence uses two of them (each pair once),
    form a cycle: else no ranks can wait for each other in a circle through them that
    a pair of groups does not show."""
    parent: dict[GroupId, GroupId] = {}

    def root(gid: GroupId) -> GroupId:
        while parent.setdefault(gid, gid) != gid:
            parent[gid] = parent[parent[gid]]
            gid = parent[gid]
        return gid

    edges = {(a, b) for gids in used_together for i, a in enumerate(gids) for b in gids[i + 1 :]}
    for a, b in sorted(edges):
        ra, rb = root(a), root(b)
        if ra == rb:
            return True
        parent[ra] = rb
    return False


def _first_calls(
    sequence: CollectiveSequence, indexes: dict[int, GroupId], limit: int
) -> list[tuple[GroupId, int, Signature]]:
    """The first ``limit`` collectives ``sequence`` issued on the groups ``indexes``,
    in order, as (group, step, signature)."""
    keyed = {
        number: indexes[sig.group]
        for number, sig in enumerate(sequence.signatures)
        if sig.group in indexes and compared_by_position(sig.op)
    }
    found: list[tuple[GroupId, int, Signature]] = []
    for run in sequence.steps:
        ids = [c for c in run.calls if c in keyed]
        for step in range(run.first, run.last + 1) if ids else ():
            for call in ids:
                found.append((keyed[call], step, sequence.signatures[call]))
                if len(found) == limit:
                    return found
    return found


#: where a sequence waits when no call can complete: (its position in its calls, the
#: group and the group's position there); a sequence that got to its end has none
Wait = tuple[int, GroupId, int]


def _play(
    calls: list[list[tuple[GroupId, int, Signature]]],
    weights: list[int],
    members: dict[GroupId, int],
) -> dict[int, Wait]:
    """Issue every sequence's ``calls`` as blocking collectives (a sequence stands for
    ``weights`` ranks): the n-th on a group completes when all its ``members`` issued
    it. Returns where each sequence that cannot go on waits."""
    at = [0] * len(calls)
    on_group: list[dict[GroupId, int]] = [{} for _ in calls]
    arrived: dict[tuple[GroupId, int], int] = {}
    waiting: dict[tuple[GroupId, int], list[int]] = {}
    runnable = list(range(len(calls)))
    while runnable:
        index = runnable.pop()
        while at[index] < len(calls[index]):
            gid = calls[index][at[index]][0]
            instance = (gid, on_group[index].get(gid, 0))
            arrived[instance] = arrived.get(instance, 0) + weights[index]
            if arrived[instance] < members[gid]:
                waiting.setdefault(instance, []).append(index)
                break
            for done in [index, *waiting.pop(instance, [])]:
                at[done] += 1
                on_group[done][gid] = instance[1] + 1
                if done != index:
                    runnable.append(done)
    return {
        index: (at[index], *instance) for instance, indexes in waiting.items() for index in indexes
    }


def _cycle_of(
    blocked: dict[int, Wait], used: list[tuple[CollectiveSequence, dict[int, GroupId]]]
) -> list[tuple[int, int]] | None:
    """A cycle of waits among the ``blocked`` sequences, as (sequence, the sequence it
    waits for) from the lowest rank's; None where every wait leads to a sequence that
    is not waiting (it ended, or was cut at its share of calls: no cycle is claimed)."""
    users: dict[GroupId, list[int]] = {}
    for index, (_, mine) in enumerate(used):
        for gid in set(mine.values()):
            users.setdefault(gid, []).append(index)

    def awaited(waiter: int) -> int | None:
        """A member the wait of ``waiter`` is for that waits elsewhere itself."""
        _, gid, position = blocked[waiter]
        for other in users[gid]:
            wait = blocked.get(other)
            if other != waiter and wait is not None and wait[1:] != (gid, position):
                return other
        return None

    for start in sorted(blocked, key=lambda i: min(used[i][0].ranks)):
        path: list[int] = []
        current: int | None = start
        while current is not None and current not in path:
            path.append(current)
            current = awaited(current)
        if current is not None:
            loop = path[path.index(current) :]
            first = loop.index(min(loop, key=lambda i: min(used[i][0].ranks)))
            loop = loop[first:] + loop[:first]
            return [(a, loop[(k + 1) % len(loop)]) for k, a in enumerate(loop)]
    return None


def _cycle_finding(
    cycle: list[tuple[int, int]],
    blocked: dict[int, Wait],
    calls: list[list[tuple[GroupId, int, Signature]]],
    used: list[tuple[CollectiveSequence, dict[int, GroupId]]],
    groups: dict[GroupId, Group],
    describe: Describe,
) -> Finding:
    """The ``collective_order`` finding of a cycle of waits: each rank waits in its
    next collective for the next rank of the cycle, which waits on another group; the
    finding is on the first rank's group, ``got`` the next rank's call there."""
    parts = []
    ranks: list[int] = []
    waits: list[tuple[GroupId, int, Call]] = []
    for index, other in cycle:
        at, gid, position = blocked[index]
        _, step, sig = calls[index][at]
        waits.append((gid, position, (step, sig)))
        rank, next_rank = min(used[index][0].ranks), min(used[other][0].ranks)
        ranks.extend(used[index][0].ranks)
        parts.append(
            f"rank {rank} waits in {_text((step, sig))} on {_label(groups[gid])} (its "
            f"collective #{position} there, step {step}) for rank {next_rank}"
        )
    gid, position, expected = waits[0]
    other_gid, _, got = waits[1]
    finding = _finding(
        "collective_order",
        groups[gid],
        position,
        expected,
        got,
        sorted(set(ranks)),
        ranks[:1],
        False,
        [],
        describe,
    )
    finding["expected_ranks"] = []  # no rank is the reference: each waits for the next
    finding["other_group"] = _group_doc(groups[other_gid])
    finding["got"] = _signature_doc(got, groups[other_gid])
    finding["message"] = (
        f"collectives on {len({w[0] for w in waits})} groups issued in orders that wait "
        f"for each other in a circle: {'; '.join(parts)}; the job hangs here"
    )
    return finding


def _merged_view(sequence: CollectiveSequence, indexes: dict[int, GroupId]) -> _View:
    """``sequence``'s collectives on the groups ``indexes`` (group index -> id), in the
    order it issued them, each keyed by its group and what it does; its ranks."""
    #: signature id -> its key, for the signatures on the groups (one key() each)
    keyed = {
        number: (indexes[sig.group], sig.key())
        for number, sig in enumerate(sequence.signatures)
        if sig.group in indexes and compared_by_position(sig.op)
    }
    return _View(_blocks(sequence, keyed), list(sequence.ranks))


def _blocks(sequence: CollectiveSequence, keyed: Mapping[int, Any]) -> list[Block]:
    """``sequence``'s step runs as blocks of the calls whose signature ``keyed`` keys
    (signature id -> key), runs of the same keys in consecutive steps joined."""
    blocks: list[Block] = []
    signatures = sequence.signatures
    for run in sequence.steps:
        ids = [c for c in run.calls if c in keyed]
        if not ids:
            continue
        calls = tuple(signatures[c] for c in ids)
        keys = tuple(keyed[c] for c in ids)
        if blocks and blocks[-1][1] + 1 == run.first and blocks[-1][3] == keys:
            blocks[-1] = (blocks[-1][0], run.last, blocks[-1][2], keys)
        else:
            blocks.append((run.first, run.last, calls, keys))
    return blocks


def _on_group_before(cursor: _Cursor, gid: GroupId) -> int:
    """How many collectives on ``gid`` a merged view's cursor has passed."""
    count = 0
    for index, (first, last, _, keys) in enumerate(cursor.blocks[: cursor.block + 1]):
        on = sum(1 for key in keys if key[0] == gid)
        if index < cursor.block:
            count += (last - first + 1) * on
        else:
            count += cursor.rep * on + sum(1 for key in keys[: cursor.call] if key[0] == gid)
    return count


def _first_interleaving(
    groups: dict[GroupId, Group],
    pair: tuple[GroupId, GroupId],
    classes: list[list[_View]],
    describe: Describe,
    ended: dict[int, float],
) -> list[Finding]:
    """Findings at the first position where ``classes`` (merged views of the groups
    ``pair``, each agreeing on its own) issue the two groups' collectives in another
    order; or a ``sequence_unchecked`` warning naming both groups where that position
    was not reached (:data:`MAX_STEPPED`)."""
    cursors = [_Cursor(views[0].blocks) for views in classes]
    ranks_of = [sorted(r for v in views for r in v.ranks) for views in classes]
    position, why = _walk(cursors, 0)
    if why == UNCHECKED:
        first, second = (groups[gid] for gid in pair)
        return [_unchecked(first, position, sorted(r for ranks in ranks_of for r in ranks), second)]
    here = [c.peek() for c in cursors]
    keys = [c.key() for c in cursors]
    if why != DIFFER or any(call is None for call in here):
        return []  # a sequence that ends first is the groups' own finding
    distribution, winner, majority = _reference(keys, ranks_of, ended)
    reference = keys.index(winner)
    expected = here[reference]
    group = groups[winner[0]]
    at = _on_group_before(cursors[reference], winner[0])
    shown = [
        {"value": f"{_text(here[keys.index(key)])} on group {key[0][0]}", "ranks": sorted(ranks)}
        for key, ranks in sorted(distribution.items(), key=lambda kv: min(kv[1]))
    ]
    findings = []
    for index, key in enumerate(keys):
        if key == winner or key in [keys[i] for i in range(index)]:
            continue
        got = here[index]
        other = groups[key[0]]
        ranks = sorted(distribution[key])
        finding = _finding(
            "collective_order",
            group,
            at,
            expected,
            got,
            ranks,
            sorted(distribution[winner]),
            majority,
            shown,
            describe,
        )
        them = (
            "most ranks"
            if majority
            else f"rank {finding['expected_ranks'][0]} (no majority: the reference)"
        )
        finding["got"]["group"] = other.name
        finding["other_group"] = _group_doc(other)
        finding["message"] = (
            f"collective #{at} on {_label(group)}, step {got[0] if got else None}: rank(s) "
            f"{list_ranks(ranks)} issue {_text(got)} on {_label(other)} (its collective "
            f"#{_on_group_before(cursors[index], key[0])} there) first, where {them} "
            f"issue(s) {_text(expected)} on {_label(group)} first: the two groups' "
            "collectives interleave in another order; the job hangs here"
        )
        findings.append(finding)
    return findings


def _group_doc(group: Group) -> dict[str, Any]:
    """A finding's ``group`` (or ``other_group``)."""
    return {"name": group.name, "desc": group.desc, "size": group.size, "ranks": list(group.ranks)}


def _label(group: Group) -> str:
    """``group 0 (default_pg)``."""
    return f"group {group.name}" + (f" ({group.desc})" if group.desc else "")


def _kind(expected: list[Call], got: list[Call]) -> str:
    """What explains the disagreement at ``expected[0]`` / ``got[0]`` best."""
    if not got:
        return "collective_missing"
    if not expected:
        return "collective_extra"
    exp = [s.key() for _, s in expected]
    have = [s.key() for _, s in got]
    e, g = expected[0][1], got[0][1]

    def agree(a: list[Any], b: list[Any]) -> int:
        count = 0
        for x, y in zip(a, b, strict=False):
            if x != y:
                return count
            count += 1
        return count + (WINDOW if len(a) == len(b) else 0)  # both end: as good as it gets

    same = collective_kind(e.op) == collective_kind(g.op)
    scores = {
        "substitute": agree(exp[1:], have[1:]),
        "collective_order": (
            agree(exp[2:], have[2:]) + 2
            if len(exp) > 1 and len(have) > 1 and exp[0] == have[1] and exp[1] == have[0]
            else -1
        ),
        "collective_missing": agree(exp[1:], have) if exp[1:2] == have[:1] else -1,
        "collective_extra": agree(exp, have[1:]) if have[1:2] == exp[:1] else -1,
    }
    order = ["substitute", "collective_order", "collective_missing", "collective_extra"]
    if not same:  # another collective: a substitution only where nothing else explains it
        order = [*order[1:], "substitute"]
    best = max(order, key=lambda name: (scores[name], -order.index(name)))
    if best != "substitute":
        return best
    if not same:
        return "collective_order"
    if e.dtype != g.dtype:
        return "collective_dtype"
    if e.numel != g.numel or e.shapes != g.shapes:
        return "collective_size"
    return "collective_reduce_op"


def _signature_doc(call: Call | None, group: Group) -> dict[str, Any] | None:
    if call is None:
        return None
    step, sig = call
    return {
        "op": sig.op,
        "dtype": sig.dtype,
        "numel": sig.numel,
        "shapes": [list(shape) for shape in sig.shapes] if sig.shapes is not None else None,
        "reduce_op": sig.reduce_op,
        "group": group.name,
        "step": step,
    }


def _text(call: Call | None, gap: int | None = None) -> str:
    """A collective as a person reads it: ``c10d::allreduce_ float32[6] sum``; with
    ``gap``, the step it is issued in and the one skipped before it."""
    if call is None:
        return "no collective (its sequence ended)"
    if gap is not None:
        return f"no collective in step {gap} ({_text(call)} in step {call[0]} next)"
    sig = call[1]
    if sig.shapes is None:
        shape = f"({sig.numel} elements)" if sig.numel is not None else ""
    else:
        shape = ",".join("[" + ",".join(map(str, s)) + "]" for s in sig.shapes)
    parts = [sig.op, f"{sig.dtype or '?'}{shape}"]
    if sig.reduce_op:
        parts.append(sig.reduce_op)
    return " ".join(parts)


_WHAT = {
    "collective_order": "another collective at this position (out of order)",
    "collective_dtype": "another dtype",
    "collective_size": "another size",
    "collective_reduce_op": "another reduce op",
}


def _finding(
    kind: str,
    group: Group,
    position: int,
    expected: Call | None,
    got: Call | None,
    ranks: list[int],
    expected_ranks: list[int],
    majority: bool,
    distribution: list[dict[str, Any]],
    describe: Describe,
    gap: int | None = None,
) -> Finding:
    """One sequence finding; ``gap``: the step in which one side (the deviating ranks
    for a ``collective_missing``, the reference for a ``collective_extra``) issued no
    collective on the group where the other issues this one."""
    where_got = describe(got[1].stack) if got is not None else None
    where_expected = describe(expected[1].stack) if expected is not None else None
    where = where_got or where_expected or {"target": "<root>", "context": [], "stack": []}
    # a skipped collective's step and op are the skipped one's (``got`` is the rank's
    # next collective, maybe steps later); otherwise the rank's own call's
    call = (expected or got) if kind == "collective_missing" else (got or expected)
    step, op = call if call is not None else (None, None)
    label = _label(group)
    rank_text = list_ranks(ranks)
    them = "most ranks" if majority else f"rank {expected_ranks[0]} (no majority: the reference)"
    head = f"collective #{position} on {label}, step {step}: rank(s) {rank_text}"
    if kind == "collective_missing":
        then = f"issue {_text(got)} next" if got is not None else "issue no further collective"
        if gap is not None:
            then = f"issue {_text(got, gap)}"
        message = f"{head} skip {_text(expected)}, which {them} issue(s) here; they {then}"
    elif kind == "collective_extra":
        then = f"issue(s) {_text(expected)} here" if expected is not None else "issue(s) none"
        if gap is not None:
            then = f"issue(s) {_text(expected, gap)}"
        message = f"{head} issue {_text(got)}, which {them} do(es) not: {them} {then}"
    else:
        message = (
            f"{head} issue {_text(got)} where {them} issue(s) {_text(expected)}: {_WHAT[kind]}"
        )
    message += "; the job hangs here or computes wrong values"
    return {
        "kind": kind,
        "severity": "error",
        "ranks": ranks,
        "op": op.op if op is not None else None,
        "group": _group_doc(group),
        "position": position,
        "step": step,
        "expected": _signature_doc(expected, group),
        "got": _signature_doc(got, group),
        "expected_ranks": expected_ranks,
        "majority": majority,
        "distribution": distribution,
        "target": where["target"],
        "context": where["context"],
        "stack": where_got["stack"] if where_got else [],
        "expected_stack": where_expected["stack"] if where_expected else [],
        "size": len(ranks),
        "message": message,
    }


def _issued_alone(
    finding: Finding,
    collectives: Collectives,
    groups: Mapping[GroupId, Group],
    users: Mapping[GroupId, dict[int, int]],
    alone: Iterable[GroupId],
    describe: Describe,
) -> Finding | None:
    """Where the one rank of a ``collective_missing`` issued the collective it skipped,
    in the same step, on a group no other rank uses (so never compared: no
    ``collective_extra`` there), that call as an extra's finding; else None."""
    expected = finding["expected"]
    if expected is None or len(finding["ranks"]) != 1:
        return None
    step = expected["step"]
    want = {k: v for k, v in expected.items() if k != "group"}
    mine = [seq for seq in collectives.sequences if list(seq.ranks) == finding["ranks"]]
    for gid in alone:
        for seq in mine:
            index = users[gid].get(id(seq))
            run = next((r for r in seq.steps if r.first <= step <= r.last), None)
            if index is None or run is None:
                continue
            for sig in (seq.signatures[number] for number in run.calls):
                doc = _signature_doc((step, sig), groups[gid]) if sig.group == index else None
                if doc is not None and {k: v for k, v in doc.items() if k != "group"} == want:
                    return {
                        **describe(sig.stack),
                        "group": _group_doc(groups[gid]),
                        "alone": True,
                        "got": doc,
                        "step": step,
                        "op": sig.op,
                    }
    return None


def _merge_groups(
    findings: list[Finding], issued_alone: Callable[[Finding], Finding | None]
) -> list[Finding]:
    """A rank's ``collective_missing`` on one group and ``collective_extra`` of the
    same collective in the same step on another: one ``collective_group`` finding.
    Without a majority the other group's finding may be the mirror of an extra: the
    ranks that did not issue it there ``collective_missing`` it, the moving rank being
    the reference. A missing finding whose ranks go on with another collective on
    their group is taken as the move first (the others never issued it there). The
    collective issued on a group no other rank uses makes no extra's finding (the
    group is not compared): ``issued_alone`` finds it."""
    #: (finding, the collective issued on the other group, the ranks that issued it,
    #: its stack)
    issued = [
        (f, f["got"], f["ranks"], f["stack"])
        for f in findings
        if f["kind"] == "collective_extra" and f["got"] is not None
    ] + [
        (f, f["expected"], f["expected_ranks"], f["expected_stack"])
        for f in findings
        if f["kind"] == "collective_missing" and not f["majority"] and f["expected"] is not None
    ]
    merged: list[Finding] = []
    used: set[int] = set()
    missing = [f for f in findings if f["kind"] == "collective_missing"]
    for finding in sorted(missing, key=lambda f: f["got"] is None):
        if id(finding) in used or finding["expected"] is None:
            continue
        want = {k: v for k, v in finding["expected"].items() if k != "group"}
        for other, call, ranks, stack in issued:
            if id(other) in used or other["group"] == finding["group"]:
                continue
            have = {k: v for k, v in call.items() if k != "group"}
            if have == want and ranks == finding["ranks"]:
                used.update((id(other), id(finding)))
                moved = {**other, "got": call, "stack": stack, "op": call["op"]}
                merged.append(_group_finding(finding, moved))
                break
        else:
            lone = issued_alone(finding)
            if lone is not None:
                used.add(id(finding))
                merged.append(_group_finding(finding, lone))
    return [f for f in findings if id(f) not in used] + merged


def _members(group: dict[str, Any]) -> str:
    """`` (ranks [0, 1])`` for a group whose members the traces list; `` (members
    unknown)`` where they do not (a gloo Flight Recorder dump): never an empty list."""
    ranks = group.get("ranks")
    return f" (ranks {ranks})" if ranks else " (members unknown)"


def _group_finding(missing: Finding, extra: Finding) -> Finding:
    expected, got = missing["expected"], extra["got"]
    group, other = missing["group"], extra["group"]
    ranks = missing["ranks"]
    rank_text = list_ranks(ranks)
    return {
        **missing,
        "kind": "collective_group",
        "op": extra["op"],  # the moved collective's (``missing`` has the next one's)
        "step": extra["step"],
        "got": got,
        "other_group": other,
        "stack": extra["stack"],
        "target": extra["target"],
        "context": extra["context"],
        "message": (
            f"collective #{missing['position']} on group {group['name']}"
            f"{' (' + group['desc'] + ')' if group['desc'] else ''}, step {extra['step']}: "
            f"rank(s) {rank_text} issue {expected['op']} {expected['dtype']}"
            f"{''.join(str(s) for s in expected['shapes'] or []).replace(' ', '')} on group "
            f"{other['name']}{_members(other)}"
            f"{', which no other rank uses,' if extra.get('alone') else ''} where the others "
            "issue it on "
            f"group {group['name']}{_members(group)}: a different process group; "
            "the job hangs here"
        ),
    }
