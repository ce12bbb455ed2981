"""The guard's collective check: catch a desync on the rank that causes it, before the hang.

A config generated from a trace with collective sequences (config version 4: formats.md,
"Collective sequences") carries them (:func:`config_sequences`); ``opguard guard``
gives them to every guarded process (docs/guard.md, "Collective sequences"), as does
``--collectives TRACE`` for a callsite trace with ``collectives`` (the good run's
``{entry}_combined.json``), which takes precedence. Each rank then checks every
collective it is about to issue against the one its own rank issued at that place in
the good run, **before** it is issued (:class:`SequenceChecker`):

* the place is (step, process group, position): the n-th collective the rank issues
  on a group within an optimizer step (steps counted as the tracer counts them). The
  good run's last recorded step may hold what ran after its loop (a final barrier, a
  loss all-reduce) and the guard cannot know which step of this run is the last, so
  from that step on a step may follow either of two plans (:meth:`ExpectedSteps.plans`):
  the good run's last step, or its last loop step (the one before); each call narrows
  the plans the step still follows, and only a call no plan allows is a departure. So
  a 3-step recording guards a 1000-step run;
* it compares what the divergence stage compares
  (:meth:`~opguard_core.formats.collectives.Signature.key`: what the op does,
  dtype, element count, shapes, reduce op; a field either side does not know is not
  compared) and the group. A disagreement is ``collective_group`` (the collective
  the good run issued next on another group), ``collective_order`` (one the good run
  issued later in the step on this group: skipped or out of order; or another
  collective; or one issued before a collective on another group sharing two or more
  ranks with its own that the good run issued first in the step: the two groups'
  collectives interleave in another order, a hang each group alone misses, as the
  divergence stage finds it), ``collective_dtype``, ``collective_size``, ``collective_reduce_op``,
  ``collective_extra`` (more collectives on the group in the step than the good run
  issued) or ``collective_missing`` (fewer, found when the next step starts; a step
  in which the rank issued no collective at all is held to its plans too, up to
  the first such step that comes up short, when a later step's first collective
  comes);
* with ``--on-violation raise`` the offending rank raises
  :class:`~opguard_plugins.enforce.runtime.OpGuardViolation` inside the call, with
  the stack, so the collective is never issued and no peer waits for it; ``warn``
  logs it and lets it run.

:class:`Watchdog` (``--collective-timeout SECONDS``) reports a rank that has waited
longer than that inside one collective call (a blocking gloo collective, a
``wait_tensor``): a ``collective_timeout`` violation with its stack and its last
collectives, logged and written to the rank's report at once (a hung job may be
killed before it exits). It reports; it never stops the job. A ``c10d::`` collective
is in flight from its call until its ``Work`` completes (a callback on the work's
future, so the time spent in ``work.wait()`` or ``dist.all_reduce``'s own wait
counts); a call that returns no work (``_c10d_functional::wait_tensor``) while it
runs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opguard_core.errors import InputError, UsageProblem
from opguard_core.formats.check import ERROR, Violation
from opguard_core.formats.collectives import (
    UNKNOWN_GROUP,
    Collectives,
    CollectiveSequence,
    Signature,
    collective_kind,
    compared_by_position,
    compared_size,
)
from opguard_core.formats.config_collectives import read_config_collectives
from opguard_core.formats.sources import recorded_sources
from opguard_core.formats.trace import decode_trace, list_ranks, read_bytes

#: op namespaces whose ops the checker looks at (``func.namespace``)
NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional"})
#: how many of its last collectives a watchdog report names
LAST = 8

#: (group name, dtype, numel, shapes, reduce op) of a call about to be issued
Call = tuple[str, str | None, int | None, tuple[tuple[int, ...], ...] | None, str | None]


def work_of(result: Any) -> Any:
    """The ``Work`` a ``c10d::`` op returned (boxed in a ScriptObject), or None."""
    import torch
    from torch.distributed.distributed_c10d import Work

    items = result if isinstance(result, tuple | list) else (result,)
    for item in items:
        if isinstance(item, torch.ScriptObject):
            try:
                return Work.unbox(item)
            except Exception:
                return None
    return None


def load_collectives(path: Path) -> Collectives:
    """The collective sequences of a callsite trace; one-line :class:`InputError` when
    it has none."""
    trace = decode_trace(read_bytes(path), path)
    if trace.collectives is None or not trace.collectives.sequences:
        raise InputError(
            path,
            "has no collective sequences (record the good run with opguard trace, "
            "then give its {entry}_combined.json from opguard run)",
        )
    return trace.collectives


def config_sequences(
    config: Mapping[str, Any], path: Path | str, source: str | None = None
) -> Collectives | None:
    """The collective sequences a config (version 4) recorded for ``source``; None
    when it recorded none (then a ``source`` must be one of its recorded sources).
    With several sources and no ``source``, or a ``source`` it lacks, a one-line
    :class:`~opguard_core.errors.UsageProblem` names them."""
    if "collectives" not in config:
        # no sequences to follow; ``source`` still names the share the whole run is
        # compared with (guard.md), so it must be one of the sources the config records
        sources = recorded_sources(dict(config))
        if source is not None and source not in sources:
            raise UsageProblem(
                f"{path}: --source {source}: the config has no collective sequences, and "
                f"its sources are {', '.join(sources) or 'not recorded'}"
            )
        return None
    found = read_config_collectives(config["collectives"], path)
    if source is None and len(found) == 1:
        return next(iter(found.values()))
    names = ", ".join(sorted(found))
    if source is None:
        raise UsageProblem(
            f"{path}: the config has the collective sequences of several sources ({names}): "
            "name the one the program must follow with --source"
        )
    if source not in found:
        raise UsageProblem(f"{path}: --source {source}: the config's sources are {names}")
    return found[source]


def describe_signature(sig: Signature, groups: list[str]) -> str:
    """``c10d::allreduce_ float32[8] on group 0`` (``?`` where unknown)."""
    return _text(sig.op, sig.dtype, sig.numel, groups[sig.group])


def call_text(op: str, call: Call, step: int) -> str:
    """``c10d::allreduce_ float32[8] on group 0 (step 3)``: a watchdog's last collectives."""
    return f"{_text(op, call[1], call[2], call[0])} (step {step})"


def _text(op: str, dtype: str | None, numel: int | None, group: str) -> str:
    size = "?" if numel is None else str(numel)
    return f"{op} {dtype or '?'}[{size}] on group {group}"


@dataclass
class Plan:
    """What one step may issue: per group name, the collectives on it in order
    (``calls``), and per call, what the good run issued on other groups before it
    (``after``: for the n-th call on a group, ``(other group, how many of its calls came
    first)`` for each group that shares two or more ranks with it and issued a call
    since the group's call before; the earlier ones were asked of that call)."""

    calls: dict[str, list[Signature]] = field(default_factory=dict)
    after: dict[str, list[tuple[tuple[str, int], ...]]] = field(default_factory=dict)


class ExpectedSteps:
    """One rank's expected collectives, per step and group name (:meth:`at`)."""

    def __init__(self, sequence: CollectiveSequence) -> None:
        self.sequence = sequence
        self.groups = [g.name for g in sequence.groups]
        members: dict[str, set[int]] = {}
        for group in sequence.groups:
            members.setdefault(group.name, set()).update(group.ranks)
        #: group name -> the other groups it shares two or more ranks with: ranks that
        #: wait on both, so the two groups' calls must keep their relative order
        self.related = {
            name: frozenset(o for o in members if o != name and len(ranks & members[o]) > 1)
            for name, ranks in members.items()
        }
        self._members = members
        self._cache: dict[int, Plan] = {}

    def shared(self, one: str, other: str) -> list[int]:
        """The ranks two groups (names) share."""
        return sorted(self._members.get(one, set()) & self._members.get(other, set()))

    def run_index(self, step: int) -> int | None:
        """The run holding ``step``; a step past every run is the last run's (the job
        repeats itself); a step between runs (or before the first) has none."""
        runs = self.sequence.steps
        if not runs:
            return None
        for index, run in enumerate(runs):
            if run.first <= step <= run.last:
                return index
        return len(runs) - 1 if step > runs[-1].last else None

    def plans(self, step: int) -> list[Plan]:
        """What ``step`` may issue, one or two plans (see :meth:`at`): from the good
        run's last recorded step on, the last step's (what it ran after the loop
        included) or the last loop step's, where they differ; before it, its own."""
        runs = self.sequence.steps
        good_last = runs[-1].last if runs else 0
        own = self.at(step)
        if step < good_last or good_last < 1:
            return [own]
        loop = self.at(good_last - 1)
        return [own] if loop == own else [own, loop]

    def at(self, step: int) -> Plan:
        """The collectives the good run issued in ``step`` (:class:`Plan`), made once
        per run of steps."""
        index = self.run_index(step)
        if index is None:
            return Plan()
        found = self._cache.get(index)
        if found is None:
            found = self._cache[index] = self._plan(self.sequence.steps[index].calls)
        return found

    def _plan(self, calls: tuple[int, ...]) -> Plan:
        """The plan of a step that issued ``calls`` (signature ids, in order)."""
        plan = Plan()
        #: group name -> the related groups that issued since its last call: how many
        #: calls each had issued then
        since: dict[str, dict[str, int]] = {}
        signatures = self.sequence.signatures
        for call in calls:
            sig = signatures[call]
            if not compared_by_position(sig.op):
                continue
            name = self.groups[sig.group]
            on_group = plan.calls.setdefault(name, [])
            on_group.append(sig)
            plan.after.setdefault(name, []).append(tuple(since.pop(name, {}).items()))
            for other in self.related.get(name, ()):
                since.setdefault(other, {})[name] = len(on_group)
        return plan


def _differs(expected: Any, got: Any) -> bool:
    return expected is not None and got is not None and expected != got


def compare(expected: Signature, op: str, call: Call) -> str | None:
    """The kind of the first difference between a call and the expected signature on
    the same group (None: they agree)."""
    _, dtype, numel, shapes, reduce_op = call
    if collective_kind(expected.op) != collective_kind(op):
        return "collective_order"
    if _differs(expected.dtype, dtype):
        return "collective_dtype"
    want = compared_size(expected.op, expected.numel, expected.shapes)
    if any(map(_differs, want, compared_size(op, numel, shapes))):
        return "collective_size"
    if _differs(expected.reduce_op, reduce_op):
        return "collective_reduce_op"
    return None


class SequenceChecker:
    """Checks one process's collectives against its rank's expected sequence.

    :param collectives: the good run's sequences (every rank's).
    :param report: called with each violation and whether this call must raise.
    :param watched: whether a step's collectives are seen (every step's, by default): a
        step the guard does not check (the set-up, where the config is of the loop; a
        step ``--sample`` leaves out) is not held to its plans when a later one comes.
    """

    def __init__(
        self,
        collectives: Collectives,
        report: Callable[[Violation, str, bool], None],
        watched: Callable[[int], bool] | None = None,
    ) -> None:
        self.collectives = collectives
        self.report = report
        self.watched = watched
        self.expected: ExpectedSteps | None = None
        self.rank: int | None = None
        self.step: int | None = None
        self.positions: dict[str, int] = {}
        #: the plans the current step's calls so far agree with (None: not begun)
        self.alive: list[Plan] | None = None
        self.one_group = False
        self._lock = threading.Lock()

    def bind(self, rank: int) -> bool:
        """Take ``rank``'s expected sequence; False when the good run had no such rank."""
        self.rank = rank
        sequence = self.collectives.by_rank().get(rank)
        self.expected = ExpectedSteps(sequence) if sequence is not None else None
        #: the good run's groups are unknown (a profiler backend's trace): every call
        #: is checked as on that one group, by position among all of the rank's calls
        self.one_group = self.expected is not None and self.expected.groups == [UNKNOWN_GROUP]
        return self.expected is not None

    def check(self, op: str, call: Call, step: int, target: str) -> None:
        """Before ``op`` is issued (``call`` describes it) in ``step``; ``target`` is
        its innermost caller (``module:qualname``). Reports what disagrees; a
        point-to-point op is not checked (:func:`compared_by_position`)."""
        if not compared_by_position(op):
            return
        expected = self.expected
        with self._lock:
            if step != self.step:
                missing = self._close_step()
                # the steps in between issued no collective: each is held to its plans,
                # up to the first that comes up short (the rest of the gap follows from it)
                for skipped in range(0 if self.step is None else self.step + 1, step):
                    if expected is None or missing:
                        break
                    if self.watched is not None and not self.watched(skipped):
                        continue
                    self.step, self.positions = skipped, {}
                    self.alive = expected.plans(skipped)
                    missing = self._close_step()
                self.step, self.positions, self.alive = step, {}, None
            else:
                missing = []
            group = UNKNOWN_GROUP if self.one_group else call[0]
            position = self.positions.get(group, 0)
            self.positions[group] = position + 1
            plans = self.alive
            if plans is None and expected is not None:
                plans = self.alive = expected.plans(step)
            agree = [
                plan
                for plan in plans or ()
                if position < len(plan.calls.get(group, ()))
                and compare(plan.calls[group][position], op, call) is None
                and self._passed_over(plan, group, position) is None
            ]
            if agree:  # else every plan stays: later calls are held to them as before
                self.alive = agree
        for violation in missing:
            self.report(violation, "", False)
        if expected is None or agree or not plans:
            return
        # of two plans (a step past the good run's loop), the one issuing the same kind
        # of collective here says best what differs (its dtype, its size)
        plan = next(
            (
                p
                for p in plans
                if position < len(p.calls.get(group, ()))
                and compare(p.calls[group][position], op, call) != "collective_order"
            ),
            plans[0],
        )
        on_group = plan.calls.get(group, [])
        got = _text(op, call[1], call[2], group)
        where = f"collective #{position} on group {group}, step {step}"
        passed = (
            self._passed_over(plan, group, position)
            if position < len(on_group) and compare(on_group[position], op, call) is None
            else None
        )
        other = self._on_other_group(plan, group, op, call)
        later = next((s for s in on_group[position + 1 :] if compare(s, op, call) is None), None)
        if passed is not None:
            kind = "collective_order"
            first, sig = passed
            want = (
                f"{describe_signature(sig, expected.groups)} first (groups {first} and {group} "
                f"share ranks {list_ranks(expected.shared(first, group))}: their collectives "
                "interleave in another order; the job hangs here)"
            )
        elif other is not None:
            kind = "collective_group"
            want = describe_signature(other, expected.groups)
        elif position >= len(on_group):
            kind = "collective_extra"
            want = f"no more (it issued {len(on_group)} on group {group} in this step)"
        elif later is not None:
            kind = "collective_order"
            want = (
                f"{describe_signature(on_group[position], expected.groups)} first "
                "(this one comes later: skipped or out of order)"
            )
        else:
            kind = compare(on_group[position], op, call) or "collective_order"
            want = describe_signature(on_group[position], expected.groups)
        message = f"rank {self.rank}: {where}: issues {got} where the good run issued {want}"
        self.report(Violation(kind, ERROR, target, [], [], message, op=op), message, True)

    def _passed_over(self, plan: Plan, group: str, position: int) -> tuple[str, Signature] | None:
        """(its group, the call) of the first call the plan issued on a group that shares
        two or more ranks with ``group`` before the ``position``-th call on ``group``, and
        that this step has not issued yet; None when every such call is issued. A few
        lookups: only the groups that issued since the group's call before are asked."""
        for other, before in plan.after[group][position]:
            issued = self.positions.get(other, 0)
            if issued < before:
                return other, plan.calls[other][issued]
        return None

    def _on_other_group(self, plan: Plan, group: str, op: str, call: Call) -> Signature | None:
        """The collective the good run issued next on another group, if it is this one."""
        for name, signatures in plan.calls.items():
            if name == group:
                continue
            position = self.positions.get(name, 0)
            if position < len(signatures) and compare(signatures[position], op, call) is None:
                return signatures[position]
        return None

    def finish(self) -> list[Violation]:
        """The end of the run: ``collective_missing`` for the last step's shortfall."""
        with self._lock:
            return self._close_step()

    def _close_step(self) -> list[Violation]:
        """``collective_missing`` for each group the finished step issued too few on,
        by the plan it came closest to; none where some plan it followed is complete."""
        if self.expected is None or self.step is None:
            return []
        return min((self._shortfall(plan) for plan in self.alive or [Plan()]), key=len)

    def _shortfall(self, plan: Plan) -> list[Violation]:
        assert self.expected is not None
        out = []
        for group, signatures in plan.calls.items():
            issued = self.positions.get(group, 0)
            if issued < len(signatures):
                sig = signatures[issued]
                message = (
                    f"rank {self.rank}: step {self.step} ended after {issued} collective(s) "
                    f"on group {group}; the good run went on with "
                    f"{describe_signature(sig, self.expected.groups)}"
                )
                out.append(Violation("collective_missing", ERROR, sig.op, [], [], message))
        return out


class Watchdog:
    """Reports a collective that has not completed ``timeout`` seconds after it was
    issued (see the module docstring): :meth:`enter` when it is issued, :meth:`leave`
    (with the token ``enter`` gave) when it completes."""

    def __init__(
        self,
        timeout: float,
        report: Callable[[str, str, str, list[dict[str, Any]]], None],
        last: Callable[[], list[str]],
    ) -> None:
        self.timeout = timeout
        self.report = report
        self.last = last
        self._calls: dict[int, tuple[float, str, str, list[dict[str, Any]], bool]] = {}
        self._tokens = iter(range(1 << 62))
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="opguard-watchdog", daemon=True)
        self._thread.start()

    def enter(self, op: str, target: str, stack: list[dict[str, Any]]) -> int:
        with self._lock:
            token = next(self._tokens)
            self._calls[token] = (time.monotonic(), op, target, stack, False)
        return token

    def leave(self, token: int) -> None:
        with self._lock:
            self._calls.pop(token, None)

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        period = min(max(self.timeout / 4, 0.05), 1.0)
        while not self._stop.wait(period):
            now = time.monotonic()
            due = []
            with self._lock:
                for token, (start, op, target, stack, told) in self._calls.items():
                    if not told and now - start > self.timeout:
                        self._calls[token] = (start, op, target, stack, True)
                        due.append((now - start, op, target, stack))
            for waited, op, target, stack in due:
                last = "; ".join(self.last()) or "none"
                message = (
                    f"waited {waited:.1f} s (more than {self.timeout:g} s) in {op}; "
                    f"its last collectives: {last}"
                )
                self.report(op, target, message, stack)
