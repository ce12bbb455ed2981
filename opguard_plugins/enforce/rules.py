"""Built-in plugin: the check rules of ``opguard check`` (docs/guard.md).

Each rule is a function ``(observed, expected, check) -> list[Violation]``; the
plugin's ``opguard_check_entry`` runs them all. A third-party package adds a rule by
implementing ``opguard_check_entry`` itself; ``--disable-plugin check_rules`` turns
the built-in rules off.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from opguard_core import hookimpl
from opguard_core.formats.check import ERROR, WARNING, CheckInput, Violation
from opguard_core.formats.config import entry_key
from opguard_core.formats.dtypes import sorted_dtypes
from opguard_core.formats.op_ranks import entry_op_ranks, ranks_of_op, records_op_ranks
from opguard_core.formats.sources import SHARED_OPS, config_loops
from opguard_core.formats.sources import config_steps as config_steps_of
from opguard_core.formats.streams import sorted_roles
from opguard_core.formats.trace import list_ranks

Rule = Callable[[dict[str, Any] | None, dict[str, Any] | None, CheckInput], list[Violation]]

#: ``--tolerance`` default: a count may change by 10% (per rank, per step) unflagged.
DEFAULT_TOLERANCE = 0.1


def _violation(
    kind: str, severity: str, check: CheckInput, message: str, **extra: Any
) -> Violation:
    target, context = check.key
    return Violation(kind, severity, target, list(context), [check.rank], message, **extra)


def _where(check: CheckInput) -> str:
    target, context = check.key
    return f"{target} [{' > '.join(context)}]" if context else target


def unexpected_ops(
    observed: dict[str, Any] | None, expected: dict[str, Any] | None, check: CheckInput
) -> list[Violation]:
    """``unexpected_op``: an op ran while the target was active that its entry lacks."""
    if observed is None or expected is None:
        return []
    known = expected.get("ops") or {}
    return [
        _violation(
            "unexpected_op",
            ERROR,
            check,
            f"{op} ran {count}x inside {_where(check)}, which does not list it",
            op=op,
        )
        for op, count in sorted((observed.get("ops") or {}).items())
        if op not in known
    ]


def unexpected_streams(
    observed: dict[str, Any] | None, expected: dict[str, Any] | None, check: CheckInput
) -> list[Violation]:
    """``unexpected_stream``: an op ran on a stream role the entry does not list."""
    if observed is None or expected is None:
        return []
    known = set(expected.get("stream_counts") or {})
    return [
        _violation(
            "unexpected_stream",
            ERROR,
            check,
            f"{count} op(s) of {_where(check)} ran on stream {role}, which it does not list",
            stream=role,
        )
        for role, count in sorted_roles(observed.get("stream_counts") or {})
        if role not in known
    ]


def unexpected_dtypes(
    observed: dict[str, Any] | None, expected: dict[str, Any] | None, check: CheckInput
) -> list[Violation]:
    """``unexpected_dtype``: an op ran in a dtype the entry does not list (both the
    config's entry and the observed one record dtypes: formats.md, "Dtypes")."""
    if observed is None or expected is None:
        return []
    known, seen = expected.get("dtype_counts"), observed.get("dtype_counts")
    if known is None or seen is None:
        return []
    return [
        _violation(
            "unexpected_dtype",
            ERROR,
            check,
            f"{count} op(s) of {_where(check)} ran in {dtype}, which it does not list",
            dtype=dtype,
        )
        for dtype, count in sorted_dtypes(seen)
        if dtype not in known
    ]


def unknown_keys(
    observed: dict[str, Any] | None, expected: dict[str, Any] | None, check: CheckInput
) -> list[Violation]:
    """``unknown_context`` for a config target under a new context, ``unknown_target``
    for a function the config does not have (the observed config went through the
    config's filters, so it is one they would have kept)."""
    if observed is None or expected is not None:
        return []
    target, context = check.key
    known = [c for t, c in check.expected if t == target]
    if known:
        listed = "; ".join(" > ".join(c) or "(top level)" for c in sorted(known))
        return [
            _violation(
                "unknown_context",
                WARNING,
                check,
                f"{target} ran under [{' > '.join(context)}]; the config has it under {listed}",
            )
        ]
    return [
        _violation(
            "unknown_target",
            WARNING,
            check,
            f"{_where(check)} ran ({observed.get('count', 0)} ops) and is not in the config",
        )
    ]


def every_step(
    count: int, expected: dict[str, Any], check: CheckInput, ranks: list[int] | None = None
) -> float:
    """``count`` of the config's per rank and loop step where the config and this run
    are both loops with steps (``CheckInput.loop``), else 0: at 1 or more, the config
    ran it in every step (on average), so this run must run it. A config of one loop
    step cannot tell a step's work from what ran once after the loop (a final
    ``loss.item()``): it needs two."""
    observed_steps = check.observed_steps.get(check.rank)
    if not (check.loop and (check.expected_steps or 0) >= 2 and observed_steps):
        return 0.0
    ran_on = check.entry_ranks(expected) if ranks is None else ranks
    return per_rank_step(count, len(ran_on), check.expected_steps)


def missing(
    observed: dict[str, Any] | None, expected: dict[str, Any] | None, check: CheckInput
) -> list[Violation]:
    """``missing``: a config entry that ran on no observed rank; an error when the
    config's loop ran it in every step (:func:`every_step`). An entry the config's loop
    ran in every step on each of its ranks that this rank alone left out, while others
    ran it, is an error of this rank too (a rank that stopped doing what the others
    do); left out less often, it is :func:`rank_mismatch`'s warning."""
    if observed is not None or expected is None:
        return []
    ranks = check.entry_ranks(expected)
    if check.rank not in ranks:
        return []
    rate = every_step(int(expected.get("count", 0)), expected, check)
    if check.key_ran():  # it ran, too little here to be an entry of its own (pruned)
        if rate < 1:
            return []
        message = (
            f"{_where(check)} ran too little in this run to be an entry of its own (below "
            f"its pruning threshold); the config's loop ran it in every step ({rate:g} ops "
            "a step)"
        )
        return [_violation("missing", WARNING, check, message)]
    if check.seen_on():
        if rate < 1:
            return []
        message = (
            f"{_where(check)} never ran on rank {check.rank}, though other ranks ran it; "
            f"the config's loop ran it in every step on ranks {ranks} ({rate:g} ops a step)"
        )
        return [_violation("missing", ERROR, check, message)]
    if rate >= 1:
        message = (
            f"{_where(check)} never ran; the config's loop ran it in every step "
            f"({rate:g} ops a step)"
        )
        return [_violation("missing", ERROR, check, message)]
    return [_violation("missing", WARNING, check, f"{_where(check)} never ran")]


def missing_ops(
    observed: dict[str, Any] | None, expected: dict[str, Any] | None, check: CheckInput
) -> list[Violation]:
    """``missing_op``: an op the config's loop issued inside the entry in every step
    (:func:`every_step`) never ran inside it (the entry ran). Where the config records
    which ranks ran each op (``op_ranks``), an op only some ranks ran is held to those
    ranks, by their count a step; else to every rank, by the entry's ranks' count (and
    :class:`JobView` then keeps it only where no rank of the job ran the op). Not for
    an entry of a merged config that other sources ran too (its ``ops`` are theirs as
    well)."""
    if observed is None or expected is None or expected.get(SHARED_OPS):
        return []
    seen = observed.get("ops") or {}
    some = entry_op_ranks(expected) if records_op_ranks(check.config) else {}
    found = []
    for op, count in sorted((expected.get("ops") or {}).items()):
        ran = some.get(op)
        if op in seen or (ran is not None and check.rank not in ran):
            continue
        rate = every_step(int(count), expected, check, ran)
        if rate >= 1:
            on = f" on rank(s) {list_ranks(ran)}" if ran is not None else ""
            message = (
                f"{op} never ran inside {_where(check)}; the config's loop ran it "
                f"{rate:g}x a step{on}"
            )
            found.append(_violation("missing_op", ERROR, check, message, op=op))
    return found


def rank_mismatch(
    observed: dict[str, Any] | None, expected: dict[str, Any] | None, check: CheckInput
) -> list[Violation]:
    """``rank_mismatch``: the entry ran on a rank the config does not have it on, or
    did not run on a rank the config has it on (while running on others)."""
    if expected is None:
        return []
    ranks = check.entry_ranks(expected)
    if observed is not None and check.rank not in ranks:
        message = f"{_where(check)} ran on rank {check.rank}; the config has it on {ranks}"
    elif (
        observed is None
        and check.rank in ranks
        and check.seen_on()
        and every_step(int(expected.get("count", 0)), expected, check) < 1  # else missing
    ):
        message = f"{_where(check)} did not run on rank {check.rank}; the config has it on {ranks}"
    else:
        return []
    return [_violation("rank_mismatch", WARNING, check, message)]


def per_rank_step(count: int, ranks: int, steps: int | None) -> float:
    """A count on one rank in one step (whole run when ``steps`` is unknown)."""
    return count / max(ranks, 1) / max(steps or 1, 1)


def drifts(got: float, want: float, tolerance: float) -> bool:
    """Whether a count ``got`` differs from ``want`` by more than ``tolerance``
    (relative; any count against none)."""
    return got != want and not (want and abs(got - want) / want <= tolerance)


def drifts_per_step(
    got: float,
    got_steps: int | None,
    want: float,
    want_steps: int | None,
    tolerance: float,
    loops: tuple[int, int] = (1, 1),
) -> bool:
    """Whether a count per rank ``got`` over ``got_steps`` loop steps drifts from
    ``want`` over ``want_steps`` by more than ``tolerance``, per step (whole runs
    where either side's steps are unknown). A loop's last iteration runs its work
    after ``optimizer.step()`` (logging, ``loss.item()``, a scheduler's step) after the
    last step ends, so such work is counted once per step plus once: per step it is
    ``count / (steps + 1)``, work before the step ``count / steps``, and an entry with
    both in between. So the counts drift only where no share ``t`` in [0, 1] makes
    ``got / (got_steps + t)`` and ``want / (want_steps + t)`` agree within
    ``tolerance``; with equal steps (and ``loops``) on both sides, exactly as
    :func:`drifts`. ``loops``: how many loops each side's counts cover (got's, want's):
    a config merged from several sources has each one's work after its last step,
    ``want / (want_steps + loops * t)``."""
    if got_steps is None or want_steps is None or min(got_steps, want_steps) < 1:
        return drifts(got, want, tolerance)  # whole runs: a loop of no step has no rate
    if (got_steps == want_steps and loops[0] == loops[1]) or not want or not got:
        return drifts(got / max(got_steps, 1), want / max(want_steps, 1), tolerance)
    # the ratio of the two rates is monotonic in t: the ends bound it
    got_loops, want_loops = loops
    ends = [
        (got / (got_steps + got_loops * t)) / (want / (want_steps + want_loops * t)) for t in (0, 1)
    ]
    return max(ends) < 1 - tolerance or min(ends) > 1 + tolerance


def expected_on_rank(expected: dict[str, Any], check: CheckInput) -> float:
    """The entry's count the config expects of ``check.rank`` over the whole run: its
    count over its ranks, divided among them, except that where the config records
    which ranks ran each op (``op_ranks``) an op some ranks alone ran is divided among
    those (none of it on the others), so a rank that runs more ops than the rest (rank 0
    logs) is held to its own share. Not in a merged config's entry that other sources
    ran too (:data:`SHARED_OPS`): its ``count`` is one source's, its ops all of theirs."""
    ranks = check.entry_ranks(expected)
    count = int(expected.get("count", 0))
    recorded = records_op_ranks(check.config) and not expected.get(SHARED_OPS)
    some = entry_op_ranks(expected) if recorded else {}
    if not some or check.rank not in ranks:
        return count / max(len(ranks), 1)
    ops = expected.get("ops") or {}
    shared = count - sum(int(ops.get(op, 0)) for op in some)
    mine = sum(int(ops.get(op, 0)) / len(ran) for op, ran in some.items() if check.rank in ran)
    return shared / len(ranks) + mine


def count_drift(
    observed: dict[str, Any] | None, expected: dict[str, Any] | None, check: CheckInput
) -> list[Violation]:
    """``count_drift``: the entry's op count per rank, and per step when both sides
    record ``meta.steps``, differs by more than ``tolerance`` (relative), allowing for
    the work after the last optimizer step (:func:`drifts_per_step`)."""
    if observed is None or expected is None:
        return []
    observed_steps = check.observed_steps.get(check.rank)
    both = check.expected_steps is not None and observed_steps is not None
    got_steps = observed_steps if both else None
    want_steps = check.expected_steps if both else None
    count = int(observed.get("count", 0))
    per_rank = expected_on_rank(expected, check)
    loops = (1, config_loops(check.config.get("meta") or {}))  # a rank's trace: one loop
    if not drifts_per_step(count, got_steps, per_rank, want_steps, check.tolerance, loops):
        return []
    want = per_rank / max(want_steps or 1, 1)  # as per_rank_step
    got = per_rank_step(count, 1, got_steps)
    unit = "per rank and step" if both else "per rank"
    change = f"{(got - want) / want:+.0%}" if want else "new"
    return [
        _violation(
            "count_drift",
            WARNING,
            check,
            f"{_where(check)} issued {got:g} ops {unit}, the config {want:g} ({change}; "
            f"tolerance {check.tolerance:g})",
        )
    ]


class JobView:
    """The job as a whole (all its ranks' counts in one observed config: ``opguard
    check``'s combined view, ``opguard guard``'s ranks' counts added up) against the
    config, for the rules that compare a rank's counts with the config's: a config
    holds an entry's counts over all its ranks, so a rank that does more than the
    others (rank 0 logs, the rest do not) differs from that average on every run,
    the config's own traces included. A rank's ``count_drift`` is kept where the
    job's count per rank (and step) drifts too, and its ``missing_op`` where no rank
    of the job ran the op inside the entry (an op only some ranks run is not missing
    on the others: the config does not record which ranks ran an op), or, where the
    config records it (``op_ranks``), where the job does not show the rank ran it
    there (:meth:`_missing_op`). Every other
    violation is kept (docs/guard.md, "One view of the job")."""

    def __init__(self, config: dict[str, Any], job: dict[str, Any], tolerance: float) -> None:
        self.config, self.job, self.tolerance = config, job, tolerance
        self.expected = {entry_key(e): e for e in config["entries"]}
        self.op_ranks = records_op_ranks(config)
        self.whole = {entry_key(e): e for e in job["entries"]}
        config_steps = config_steps_of(config.get("meta") or {})
        job_steps = config_steps_of(job.get("meta") or {})
        both = config_steps is not None and job_steps is not None
        self.config_steps = config_steps if both else None
        self.job_steps = job_steps if both else None
        self.loops = (
            config_loops(job.get("meta") or {}),
            config_loops(config.get("meta") or {}),
        )

    def keeps(self, violation: Violation) -> bool:
        """Whether the job as a whole shows ``violation`` too (see the class)."""
        if violation.kind not in JOB_KINDS:
            return True
        key = (violation.target, tuple(violation.context))
        expected, observed = self.expected.get(key), self.whole.get(key)
        if expected is None or observed is None:
            return True
        if violation.kind == "missing_op":
            return self._missing_op(violation, observed)
        got = _per_rank(observed, self.job)
        want = _per_rank(expected, self.config)
        return drifts_per_step(
            got, self.job_steps, want, self.config_steps, self.tolerance, self.loops
        )

    def _missing_op(self, violation: Violation, observed: dict[str, Any]) -> bool:
        """Whether the job shows ``violation``'s op missing on its ranks: without
        ``op_ranks`` in the config, where no rank of the job ran it inside the entry;
        with them, where the job's view does not record that each of the violation's
        ranks ran it there (a rank's own tree prunes by its own count, so its config
        can lack an op the rank ran inside the entry), or does not record it at all
        (``opguard guard``'s job: its ranks' own ops are exact)."""
        ops = observed.get("ops") or {}
        if violation.op not in ops:
            return True
        if not self.op_ranks:
            return False
        all_ranks = [int(r) for r in (self.job.get("meta") or {}).get("ranks") or ()]
        ran = ranks_of_op(observed, str(violation.op), self.job, all_ranks)
        return ran is None or not set(violation.ranks) <= set(ran)


#: the kinds that compare what a rank ran over its whole run (docs/guard.md, "What
#: needs the whole run"): a rank whose run ended early ran less, and says nothing by
#: that, to the guard (not checked) and to check (left out of a partial trace's rank)
WHOLE_RUN_KINDS = ("missing", "missing_op", "count_drift", "unknown_target")
#: the kinds :class:`JobView` judges by the job as a whole
JOB_KINDS = frozenset({"count_drift", "missing_op"})
#: the kinds a config's pruning threshold decides (a key that ran fewer ops than the
#: config keeps is no violation), judged by the job's ops added up
UNKNOWN_KINDS = frozenset({"unknown_target", "unknown_context"})
#: the kind whose "ran too little to be an entry of its own" a config's pruning
#: threshold decides: judged by the job's ops added up, as ``opguard check`` prunes the
#: job's tree (a function small on one rank and large on another is kept there)
PRUNED_KINDS = frozenset({"missing"})
#: the kinds ``opguard guard`` judges by the whole job from every rank's counts once
#: COMMAND ended, and logs (docs/guard.md, "One view of the job")
JUDGED_BY_JOB = JOB_KINDS | UNKNOWN_KINDS | PRUNED_KINDS


def _per_rank(entry: dict[str, Any], document: dict[str, Any]) -> float:
    """An entry's count per rank (its ``ranks``, else the document's)."""
    ranks = entry.get("ranks") or (document.get("meta") or {}).get("ranks") or ()
    return per_rank_step(int(entry.get("count", 0)), len(ranks), None)


#: The built-in rules, in the order they run.
RULES: tuple[Rule, ...] = (
    unexpected_ops,
    unexpected_streams,
    unexpected_dtypes,
    unknown_keys,
    missing,
    missing_ops,
    count_drift,
    rank_mismatch,
)


@hookimpl
def opguard_check_entry(
    observed: dict[str, Any] | None, expected: dict[str, Any] | None, check: CheckInput
) -> list[Violation]:
    """Run every built-in rule."""
    found: list[Violation] = []
    for rule in RULES:
        found.extend(rule(observed, expected, check))
    return found
