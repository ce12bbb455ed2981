"""The guard's collective check (opguard_plugins/enforce/sequence_guard.py, docs/guard.md).

Quick: :class:`SequenceChecker` against hand-built sequences, one kind of departure at
a time, and the watchdog's timing. Slow: a real 2-rank gloo job
(tests/data/guard_desync/guard_job.py) recorded with ``opguard trace`` and ``opguard
run`` when good, then run under ``opguard guard`` (the config's sequences, or
``--collectives`` the combined trace's) with rank 1 departing in step 1: it raises
on rank 1 before the collective is issued, or warns and goes on;
``--collective-timeout`` reports the rank left waiting.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from opguard_core.formats.check import Violation
from opguard_core.formats.collectives import (
    Collectives,
    CollectiveSequence,
    Group,
    Signature,
    StepRun,
)
from opguard_plugins.enforce.sequence_guard import SequenceChecker, Watchdog

REPO = Path(__file__).resolve().parent.parent
JOB = REPO / "tests" / "data" / "guard_desync" / "guard_job.py"

WORLD = Group(name="0", desc="default_pg", size=2, ranks=(0, 1))
OTHER = Group(name="1", desc="undefined", size=2, ranks=(0, 1))
A = Signature(op="c10d::allreduce_", group=0, dtype="float32", numel=6, shapes=((6,),),
              reduce_op="sum")  # fmt: skip
B = Signature(op="c10d::allreduce_", group=0, dtype="float32", numel=8, shapes=((8,),),
              reduce_op="sum")  # fmt: skip
C = Signature(op="c10d::broadcast_", group=1, dtype="float32", numel=2, shapes=((2,),))


def good(rank: int, steps: int = 3) -> Collectives:
    """Steps 0..steps-1 each issue A, B on the world group and C on the other."""
    sequence = CollectiveSequence(
        ranks=[rank], groups=[WORLD, OTHER], signatures=[A, B, C],
        steps=[StepRun(0, steps - 1, (0, 1, 2))],
    )  # fmt: skip
    return Collectives(sequences=[sequence])


def call(sig: Signature, group: str | None = None, **change: Any) -> tuple[str, Any]:
    """(op, call) as the guard describes a call that issues ``sig`` (changed)."""
    fields = {"dtype": sig.dtype, "numel": sig.numel, "shapes": sig.shapes,
              "reduce_op": sig.reduce_op, **change}  # fmt: skip
    name = group or ("0" if sig.group == 0 else "1")
    return sig.op, (name, fields["dtype"], fields["numel"], fields["shapes"], fields["reduce_op"])


class Recorded:
    def __init__(self) -> None:
        self.violations: list[tuple[Violation, bool]] = []

    def __call__(self, violation: Violation, message: str, may_raise: bool) -> None:
        self.violations.append((violation, may_raise))

    def kinds(self) -> list[str]:
        return [v.kind for v, _ in self.violations]


def bound_checker(sequence: CollectiveSequence, rank: int) -> tuple[SequenceChecker, Recorded]:
    """A checker of ``sequence``, bound to ``rank``, and what it records."""
    recorded = Recorded()
    checker = SequenceChecker(Collectives(sequences=[sequence]), recorded)
    assert checker.bind(rank)
    return checker, recorded


def run_steps(steps: list[list[tuple[str, Any]]], rank: int = 1) -> Recorded:
    recorded = Recorded()
    checker = SequenceChecker(good(rank), recorded)
    assert checker.bind(rank)
    for number, calls in enumerate(steps):
        for op, described in calls:
            checker.check(op, described, number, "job:step")
    return recorded


GOOD_STEP = [call(A), call(B), call(C)]


def test_the_good_sequence_passes_and_later_steps_repeat_the_last() -> None:
    """A 3-step recording guards a 10-step run: step 3 on repeats step 2."""
    assert run_steps([GOOD_STEP] * 10).violations == []


def test_another_line_is_not_a_departure() -> None:
    """The stack is not compared: the same collectives from elsewhere agree."""
    recorded = Recorded()
    checker = SequenceChecker(good(0), recorded)
    checker.bind(0)
    for step in range(4):
        for number, (op, described) in enumerate(GOOD_STEP):
            checker.check(op, described, step, f"job:line{(step + number) % 3}")
    assert recorded.violations == []


@pytest.mark.parametrize(
    ("step1", "kind"),
    [
        ([call(A, dtype="int32"), call(B), call(C)], "collective_dtype"),
        ([call(A, numel=8, shapes=((8,),)), call(B), call(C)], "collective_order"),  # B early
        ([call(A, numel=7, shapes=((7,),)), call(B), call(C)], "collective_size"),
        ([call(A, reduce_op="max"), call(B), call(C)], "collective_reduce_op"),
        ([call(B), call(A), call(C)], "collective_order"),
        ([call(B), call(C)], "collective_order"),  # A skipped: B comes early
        ([call(A), call(B), call(A), call(C)], "collective_extra"),
        ([call(C, group="0"), call(A), call(B)], "collective_group"),  # C's is group 1
        ([call(A, group="1")], "collective_group"),  # A's is the world group
        ([call(A), call(B), call(C), call(C)], "collective_extra"),
    ],
)
def test_each_departure_is_named_at_the_first_call(step1: list[Any], kind: str) -> None:
    recorded = run_steps([GOOD_STEP, step1])
    assert recorded.kinds()[0] == kind
    assert recorded.violations[0][1] is True  # raised under --on-violation raise


def test_a_collective_on_another_group_is_a_group_departure() -> None:
    """C issued on the world group after A and B, where the good run issued it on group 1."""
    recorded = run_steps([GOOD_STEP, [call(A), call(B), call(C, group="0")]])
    (violation, _) = recorded.violations[0]
    assert violation.kind == "collective_group"
    assert "issues c10d::broadcast_ float32[2] on group 0 where the good run issued" in (
        violation.message
    )
    assert violation.message.endswith("c10d::broadcast_ float32[2] on group 1")


def test_a_missing_collective_is_found_when_the_next_step_starts() -> None:
    recorded = run_steps([GOOD_STEP, [call(A), call(B)], GOOD_STEP])
    assert recorded.kinds() == ["collective_missing"]
    violation, may_raise = recorded.violations[0]
    assert not may_raise and "step 1 ended after 0 collective(s) on group 1" in violation.message


def test_a_step_without_any_collective_is_missing_its_collectives() -> None:
    """Rank 1 issues nothing in step 2 (steps 0, 1, 3, 4): step 2 is held to its plan
    when step 3's first collective comes (once only the step before it was)."""
    recorded = Recorded()
    checker = SequenceChecker(good(1, steps=5), recorded)
    assert checker.bind(1)
    for number in (0, 1, 3, 4):
        for op, described in GOOD_STEP:
            checker.check(op, described, number, "job:step")
    recorded.violations.extend((v, False) for v in checker.finish())
    assert recorded.kinds() == ["collective_missing", "collective_missing"]  # both groups
    assert all("step 2 ended after 0 collective(s)" in v.message for v, _ in recorded.violations)


@pytest.mark.parametrize(
    ("watched", "steps"),
    [(lambda step: step >= 1, [1, 2, 3, 4]), (lambda step: step % 2 == 0, [0, 2, 4])],
)
def test_steps_the_guard_does_not_watch_are_not_missing(watched: Any, steps: list[int]) -> None:
    """A config of the loop: the guard checks from the end of the first optimizer step
    on, and sees no collective of step 0; ``--sample 0.5``: every other step. Those
    steps issued their collectives unseen: none is missing (a step it watches that
    issues none still is: test_a_step_without_any_collective_is_missing_its_collectives)."""
    recorded = Recorded()
    checker = SequenceChecker(good(1, steps=5), recorded, watched)
    assert checker.bind(1)
    for number in steps:
        for op, described in GOOD_STEP:
            checker.check(op, described, number, "job:step")
    recorded.violations.extend((v, False) for v in checker.finish())
    assert recorded.violations == []


def test_unknown_fields_are_not_compared() -> None:
    """A field the recording lacks (a Flight Recorder dump has no reduce op) matches."""
    assert run_steps([GOOD_STEP, [call(A, reduce_op=None), call(B), call(C)]]).violations == []


def test_point_to_point_ops_are_not_checked() -> None:
    """A send pairs with its peer's recv, not with a position on the group: a pipeline
    stage sending more, or other sizes (microbatches of other lengths), departs from
    nothing; the collectives around the sends are checked as before."""
    send = Signature(op="c10d::send", group=0, dtype="float32", numel=16, shapes=((16,),))
    sequence = CollectiveSequence(
        ranks=[1], groups=[WORLD, OTHER], signatures=[send, A, B, C],
        steps=[StepRun(0, 2, (0, 1, 2, 3))],
    )  # fmt: skip
    checker, recorded = bound_checker(sequence, 1)
    sends = [call(send, numel=32, shapes=((32,),)), call(send, numel=8, shapes=((8,),))]
    for step, calls in enumerate([[call(send), *GOOD_STEP], [*sends, *GOOD_STEP], GOOD_STEP]):
        for op, described in calls:
            checker.check(op, described, step, "job:step")
    assert recorded.violations == []
    checker.check(*call(B), 3, "job:step")  # a collective is still held to its place
    assert recorded.kinds() == ["collective_order"]


def test_a_scatter_is_held_to_each_ranks_share() -> None:
    """A good run recorded by an older tracer holds the root's whole scatter list
    ([6],[6]); this run's root records its output ([6]): the same share. Another
    share is a size departure."""
    scatter = Signature(op="c10d::scatter_", group=0, dtype="float32", numel=12,
                        shapes=((6,), (6,)))  # fmt: skip
    sequence = CollectiveSequence(
        ranks=[0], groups=[WORLD, OTHER], signatures=[scatter, B], steps=[StepRun(0, 2, (0, 1))]
    )
    checker, recorded = bound_checker(sequence, 0)
    for step in range(3):
        checker.check(*call(scatter, numel=6, shapes=((6,),)), step, "job:step")
        checker.check(*call(B), step, "job:step")
    assert recorded.violations == []
    checker.check(*call(scatter, numel=8, shapes=((8,),)), 3, "job:step")
    assert recorded.kinds() == ["collective_size"]


def test_an_all_to_alls_size_is_not_checked() -> None:
    """An all_to_all's split sizes change with the data (an MoE's routing): another
    size than the good run's departs from nothing; another dtype does."""
    a2a = Signature(op="c10d::alltoall_base_", group=0, dtype="float32", numel=5,
                    shapes=((5,),))  # fmt: skip
    sequence = CollectiveSequence(
        ranks=[0], groups=[WORLD, OTHER], signatures=[a2a, B], steps=[StepRun(0, 2, (0, 1))]
    )
    checker, recorded = bound_checker(sequence, 0)
    for step in range(3):
        checker.check(*call(a2a, numel=4 + step, shapes=((4 + step,),)), step, "job:step")
        checker.check(*call(B), step, "job:step")
    assert recorded.violations == []
    checker.check(*call(a2a, dtype="int32"), 3, "job:step")
    assert recorded.kinds() == ["collective_dtype"]


#: a barrier after the loop, on the world group (DDP jobs end with one, or a loss
#: all-reduce): the good run's last recorded step holds it
BARRIER = Signature(op="c10d::barrier", group=0, dtype="uint8", numel=1, shapes=((1,),))


def ends_with_a_barrier(rank: int) -> Collectives:
    """Steps 0..2 issue A, B, C; step 2, the last, the barrier after them."""
    sequence = CollectiveSequence(
        ranks=[rank], groups=[WORLD, OTHER], signatures=[A, B, C, BARRIER],
        steps=[StepRun(0, 1, (0, 1, 2)), StepRun(2, 2, (0, 1, 2, 3))],
    )  # fmt: skip
    return Collectives(sequences=[sequence])


@pytest.mark.parametrize("steps", [3, 4, 30])
def test_a_longer_run_may_end_with_what_ran_after_the_good_runs_loop(steps: int) -> None:
    """From the good run's last step on, a step may be a loop step or the last one (the
    guard cannot know which): a run of any length is clean."""
    recorded = Recorded()
    checker = SequenceChecker(ends_with_a_barrier(1), recorded)
    assert checker.bind(1)
    for number in range(steps):
        calls = GOOD_STEP + ([call(BARRIER)] if number == steps - 1 else [])
        for op, described in calls:
            checker.check(op, described, number, "job:step")
    recorded.violations.extend((v, False) for v in checker.finish())
    assert recorded.violations == []


@pytest.mark.parametrize(
    ("step5", "kind"),
    [
        ([call(A), call(B)], "collective_missing"),  # neither plan ends here
        ([call(A), call(B), call(C), call(C)], "collective_extra"),
        ([call(A), call(B), call(C), call(BARRIER), call(A)], "collective_extra"),
        ([call(A, dtype="bfloat16"), call(B), call(C)], "collective_dtype"),
    ],
)
def test_past_the_good_run_each_plan_must_fail_to_be_a_departure(
    step5: list[Any], kind: str
) -> None:
    recorded = Recorded()
    checker = SequenceChecker(ends_with_a_barrier(1), recorded)
    checker.bind(1)
    for number in range(8):
        for op, described in step5 if number == 5 else GOOD_STEP:
            checker.check(op, described, number, "job:step")
    assert recorded.kinds() == [kind]


def two_groups(other: Group, rank: int = 1) -> SequenceChecker:
    """Steps 0..2 each all-reduce on the world group, then the same on ``other``."""
    same = msgspec.structs.replace(A, group=1)
    sequence = CollectiveSequence(
        ranks=[rank], groups=[WORLD, other], signatures=[A, same],
        steps=[StepRun(0, 2, (0, 1))],
    )  # fmt: skip
    return SequenceChecker(Collectives(sequences=[sequence]), Recorded())


def test_two_groups_issued_in_another_order_are_a_collective_order() -> None:
    """Rank 1 issues step 1's all-reduce on group 1 before the world group's: each
    group alone follows the good run, yet both ranks wait for the other. Raised at the
    first call, as a collective_order naming both groups (not a collective_group: the
    two calls are alike)."""
    checker = two_groups(OTHER)
    assert checker.bind(1)
    recorded = checker.report
    assert isinstance(recorded, Recorded)
    for step, groups in enumerate([("0", "1"), ("1", "0"), ("0", "1")]):
        for group in groups:
            checker.check(*call(A, group=group), step, "job:step")
    ((violation, may_raise),) = recorded.violations
    assert (violation.kind, may_raise) == ("collective_order", True)
    assert violation.message == (
        "rank 1: collective #0 on group 1, step 1: issues c10d::allreduce_ float32[6] on "
        "group 1 where the good run issued c10d::allreduce_ float32[6] on group 0 first "
        "(groups 0 and 1 share ranks 0, 1: their collectives interleave in another order; "
        "the job hangs here)"
    )


def test_groups_that_share_one_rank_may_interleave_in_any_order() -> None:
    """Rank 1's own group with rank 2 shares only rank 1 with the world group of ranks
    0, 1: neither peer waits on the other group, so its order is free."""
    checker = two_groups(Group(name="1", desc=None, size=2, ranks=(1, 2)))
    assert checker.bind(1)
    for step, groups in enumerate([("0", "1"), ("1", "0"), ("0", "1")]):
        for group in groups:
            checker.check(*call(A, group=group), step, "job:step")
    assert isinstance(checker.report, Recorded) and checker.report.violations == []


def test_a_rank_the_good_run_lacked_is_not_checked() -> None:
    checker = SequenceChecker(good(0), Recorded())
    assert not checker.bind(5)


def test_the_watchdog_reports_a_call_in_flight_too_long_once() -> None:
    reports: list[tuple[str, str, str]] = []
    done = threading.Event()

    def report(op: str, target: str, message: str, stack: list[dict[str, Any]]) -> None:
        reports.append((op, target, message))
        done.set()

    watchdog = Watchdog(0.2, report, lambda: ["c10d::allreduce_ float32[6] on group 0 (step 1)"])
    try:
        quick = watchdog.enter("c10d::allreduce_", "job:step", [])
        watchdog.leave(quick)
        token = watchdog.enter("c10d::broadcast_", "job:step", [])
        assert done.wait(5)
        time.sleep(0.3)  # a second period: reported once
        watchdog.leave(token)
    finally:
        watchdog.stop()
    (found,) = reports
    assert found[:2] == ("c10d::broadcast_", "job:step")
    assert "more than 0.2 s" in found[2] and "last collectives: c10d::allreduce_" in found[2]


# --- a real job ------------------------------------------------------------------


def opguard(*args: str | Path, timeout: int = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "opguard_core.cli.app", *map(str, args)],
        capture_output=True, text=True, timeout=timeout, cwd=REPO,
    )  # fmt: skip


def torchrun(case: str, *more: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            str(JOB), "--case", case, *more]  # fmt: skip


@pytest.fixture(scope="module")
def good_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(config, combined trace) of the job with no departure, traced then run."""
    pytest.importorskip("torch")
    base = tmp_path_factory.mktemp("good")
    traced = opguard("trace", "--label", "good", "--output-dir", base / "traces", "--",
                     *torchrun("none"))  # fmt: skip
    assert traced.returncode == 0, traced.stderr[-3000:]
    run = opguard("run", "-i", base / "traces" / "good_callsite_rank*.json",
                  "--output-base", base / "runs")  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    (run_dir,) = (base / "runs").iterdir()
    return run_dir / "good_callsite_instrumentation.yaml", run_dir / "good_callsite_combined.json"


def reports(directory: Path) -> dict[int, list[dict[str, Any]]]:
    """Each rank's violations; a rank torchrun tore down before its guard started (a
    loaded machine) wrote no report and is left out."""
    out = {}
    for rank in (0, 1):
        path = directory / f"guard_report_rank{rank}.json"
        if rank == 0 and not path.exists():
            continue
        out[rank] = json.loads(path.read_text())["violations"]
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "kind"), [("dtype", "collective_dtype"), ("order", "collective_order"),
                       ("skip", "collective_order")],
)  # fmt: skip
def test_raise_stops_the_offending_rank_before_the_collective(
    good_run: tuple[Path, Path], tmp_path: Path, case: str, kind: str
) -> None:
    config, _ = good_run  # the config carries the good run's sequences (version 4)
    assert "\ncollectives:\n" in config.read_text()
    guarded = opguard("guard", "--config", config, "--on-violation", "raise",
                      "--report-dir", tmp_path, "--", *torchrun(case))  # fmt: skip
    assert guarded.returncode != 0
    # rank 1 raised inside its call (the job prints it and exits 3)
    assert f"rank 1: OpGuardViolation: opguard guard: {kind}: rank 1:" in guarded.stderr
    found = reports(tmp_path)
    assert found.get(0, []) == []  # rank 0 did nothing wrong
    (violation,) = found[1]
    assert (violation["kind"], violation["count"], violation["target"]) == (
        kind,
        1,
        "guard_job:step",
    )
    assert "step 1" in violation["message"]
    functions = [frame["function"] for frame in violation["stack"]]
    assert functions[-3:] == ["step", "_exception_logger.<locals>.wrapper", "all_reduce"]


@pytest.mark.slow
def test_warn_lets_the_job_run_on(good_run: tuple[Path, Path], tmp_path: Path) -> None:
    """gloo all-reduces int32 against float32 without a word (same byte size): the job
    ends, wrong; the guard said so on rank 1, once (step 2 is right again)."""
    config, combined = good_run
    guarded = opguard("guard", "--config", config, "--collectives", combined,
                      "--report-dir", tmp_path, "--", *torchrun("dtype"))  # fmt: skip
    assert guarded.returncode == 1, guarded.stderr[-3000:]  # an error in a report
    assert "OpGuardViolation" not in guarded.stderr
    found = reports(tmp_path)
    assert found[0] == [] and [(v["kind"], v["count"]) for v in found[1]] == [
        ("collective_dtype", 1)
    ]


@pytest.mark.slow
def test_a_departure_is_in_the_report_though_the_rank_then_aborts(
    good_run: tuple[Path, Path], tmp_path: Path
) -> None:
    """warn: rank 1 all-reduces int32, then aborts (no atexit, no SIGTERM handler runs):
    its report was written when the departure happened."""
    config, combined = good_run
    guarded = opguard("guard", "--config", config, "--collectives", combined,
                      "--report-dir", tmp_path, "--", *torchrun("abort"))  # fmt: skip
    assert guarded.returncode != 0
    report = json.loads((tmp_path / "guard_report_rank1.json").read_text())
    assert [(v["kind"], v["count"]) for v in report["violations"]] == [("collective_dtype", 1)]
    assert not list(tmp_path.glob(".*.tmp"))
    # and opguard guard says it left that report (not that it wrote none)
    (said,) = [line for line in guarded.stderr.splitlines() if "before its guard finished" in line]
    assert said.endswith(
        f"its first collective departure is {tmp_path / 'guard_report_rank1.json'}"
    )
    assert "without writing its guard report" not in guarded.stderr, guarded.stderr[-2000:]


@pytest.mark.slow
def test_a_good_run_under_the_guard_is_clean(good_run: tuple[Path, Path], tmp_path: Path) -> None:
    config, _ = good_run
    guarded = opguard("guard", "--config", config,
                      "--on-violation", "raise", "--collective-timeout", "5",
                      "--report-dir", tmp_path, "--", *torchrun("none"))  # fmt: skip
    assert guarded.returncode == 0, guarded.stderr[-3000:]
    assert reports(tmp_path) == {0: [], 1: []}


@pytest.mark.slow
def test_the_watchdog_names_the_rank_left_waiting(
    good_run: tuple[Path, Path], tmp_path: Path
) -> None:
    """Rank 1 sleeps 2.5 s in step 1: rank 0 waits in its all-reduce of ``a``."""
    config, _ = good_run
    guarded = opguard("guard", "--config", config, "--collective-timeout", "1",
                      "--report-dir", tmp_path, "--", *torchrun("wait"))  # fmt: skip
    assert guarded.returncode == 1, guarded.stderr[-3000:]
    found = reports(tmp_path)
    assert found[1] == []
    (violation,) = found[0]
    assert (violation["kind"], violation["op"], violation["target"]) == (
        "collective_timeout",
        "c10d::allreduce_",
        "guard_job:step",
    )
    assert "rank 0: waited" in violation["message"]
    assert "c10d::allreduce_ float32[6] on group 0 (step 1)" in violation["message"]
    assert violation["stack"][-1]["function"] == "all_reduce"


def test_a_trace_without_sequences_is_refused_in_one_line(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from opguard_core.cli.app import create_cli
    from opguard_core.plugin.manager import create_plugin_manager

    samples = REPO / "tests" / "data" / "samples"
    config = tmp_path / "c.yaml"
    result = CliRunner().invoke(
        create_cli(create_plugin_manager()),
        ["run", "-i", str(samples / "gpt_callsite_rank*.json"), "--output-base", str(tmp_path)],
    )
    assert result.exit_code == 0, result.output
    (config,) = tmp_path.glob("*/gpt_callsite_instrumentation.yaml")
    old = samples / "gpt_callsite_rank0.json"
    result = CliRunner().invoke(
        create_cli(create_plugin_manager()),
        ["guard", "--config", str(config), "--collectives", str(old), "--", "x.py"],
    )
    assert result.exit_code == 5
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"opguard: error: {old}: has no collective sequences")


def test_a_good_run_of_unknown_groups_is_checked_as_one_group() -> None:
    """A profiler backend's recording knows no group (``?``): the calls are checked by
    their position among all of the rank's collectives, whatever group they are on."""
    unknown = Group(name="?", size=1)
    plain = [msgspec.structs.replace(s, group=0, reduce_op=None) for s in (A, B, C)]
    sequence = CollectiveSequence(
        ranks=[1], groups=[unknown], signatures=plain, steps=[StepRun(0, 2, (0, 1, 2))]
    )
    checker, recorded = bound_checker(sequence, 1)
    for step in range(3):  # the real groups: A and B on "0", C on "1"
        for op, described in GOOD_STEP:
            checker.check(op, described, step, "job:step")
    assert recorded.violations == []
    swapped = [call(B), call(A), call(C)]
    for op, described in swapped:
        checker.check(op, described, 3, "job:step")
    assert recorded.kinds() == ["collective_order", "collective_size"]


@pytest.mark.slow
def test_raise_stops_a_rank_that_swaps_two_groups(tmp_path: Path) -> None:
    """Every step all-reduces on the world group, then on a group of both ranks; rank 1
    swaps them in step 1. The good run, traced with the subgroup, is the config; rank 1
    raises before its subgroup all-reduce, where the job would hang."""
    pytest.importorskip("torch")
    traced = opguard("trace", "--label", "sub", "--output-dir", tmp_path / "traces", "--",
                     *torchrun("none", "--sub"))  # fmt: skip
    assert traced.returncode == 0, traced.stderr[-3000:]
    run = opguard("run", "-i", tmp_path / "traces" / "sub_callsite_rank*.json",
                  "--output-base", tmp_path / "runs")  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    guarded = opguard("guard", "--config", run_dir / "sub_callsite_instrumentation.yaml",
                      "--on-violation", "raise", "--report-dir", tmp_path / "guard", "--",
                      *torchrun("swap", "--sub"))  # fmt: skip
    assert "rank 1: OpGuardViolation: opguard guard: collective_order: rank 1:" in guarded.stderr
    found = reports(tmp_path / "guard")
    assert found.get(0, []) == []
    (violation,) = found[1]
    assert violation["kind"] == "collective_order" and "step 1" in violation["message"]
    assert "on group 0 first (groups 0 and 1 share ranks 0, 1" in violation["message"]
