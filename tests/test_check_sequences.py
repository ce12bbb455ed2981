"""``opguard check`` replays each rank's collective sequence against the config's, as
the guard does at run time (docs/guard.md, "Collective sequences"): an extra, a
missing or a reordered collective, another dtype or size, is an error naming the
function that issued it, offline. A one-rank gloo group, traced in-process."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from click.testing import CliRunner  # noqa: E402

from opguard_core.cli.app import create_cli  # noqa: E402
from opguard_core.plugin.manager import create_plugin_manager  # noqa: E402
from opguard_plugins.tracer import trace_callsites  # noqa: E402

pytestmark = pytest.mark.torch


def logged() -> None:
    """What a program that departs (``new``) also runs: a function the config lacks."""
    torch.ones(3).exp().sum()


def sync(step: int, case: str) -> None:
    """The program's collectives of one step; ``case`` departs from step 2 on (``die``:
    raises in step 3, after its first collective; ``new``: runs :func:`logged`)."""
    odd = step >= 2
    if odd and case.startswith("new"):
        logged()
    dtype = torch.int32 if odd and case.startswith("dtype") else torch.float32
    dist.all_reduce(torch.ones(6, dtype=dtype))
    if case.endswith("die") and step == 3:
        raise RuntimeError("the peer is gone")
    if not (odd and case == "missing"):
        dist.all_reduce(torch.ones(8 if odd and case == "size" else 4))
    if odd and case == "extra":
        dist.broadcast(torch.ones(3), 0)


def train(steps: int, case: str = "none") -> None:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        sync(step, case)
        model(torch.ones(1, 2)).sum().backward()
        opt.step()


@pytest.fixture
def group(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def invoke(*args: str | Path) -> Any:
    cli = create_cli(create_plugin_manager())
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def traced(folder: Path, label: str, steps: int, case: str = "none") -> Path:
    with trace_callsites(label, folder, rank=0) as tracer:
        train(steps, case)
    assert tracer.written is not None
    return tracer.written


@pytest.mark.usefixtures("group")
def test_check_finds_what_the_guard_would_raise(tmp_path: Path) -> None:
    base = traced(tmp_path / "t", "base", 3)
    result = invoke("run", "-i", base, "--output-base", tmp_path / "run")
    assert result.exit_code == 0, result.stderr
    config = Path(result.stdout.strip().splitlines()[-1]) / "base_callsite_instrumentation.yaml"
    assert "collectives:" in config.read_text()
    # unchanged, at the config's length and longer: nothing
    for steps in (3, 6):
        again = traced(tmp_path / "t", f"same{steps}", steps)
        report = json.loads(
            invoke("check", "--config", config, "-i", again, "--format", "json").stdout
        )
        assert report["violations"] == [], report["violations"]
    wanted = {
        "dtype": "collective_dtype",
        "size": "collective_size",
        "missing": "collective_missing",
        "extra": "collective_extra",
    }
    for case, kind in wanted.items():
        changed = traced(tmp_path / "t", case, 4, case)
        checked = invoke("check", "--config", config, "-i", changed, "--format", "json")
        assert checked.exit_code == 1, (case, checked.stdout)
        report = json.loads(checked.stdout)
        found = [v for v in report["violations"] if v["kind"] == kind]
        assert found and all(v["severity"] == "error" for v in found), (case, report)
        # named by the function that issued it (or, missing, by the op it lacks)
        assert found[0]["target"] in {"test_check_sequences:sync", "c10d::allreduce_"}, found
        assert "step 2" in found[0]["message"], found[0]["message"]


@pytest.mark.usefixtures("group")
def test_a_run_that_died_mid_step_is_held_to_what_it_got_to(tmp_path: Path) -> None:
    """The program raised halfway through step 3: its trace is partial. Its last step
    is held to a loop step (not to what the good run did after its loop) and neither
    what it did not get to nor its counts are reported; the report says why."""
    base = traced(tmp_path / "t", "base", 6)
    result = invoke("run", "-i", base, "--output-base", tmp_path / "run")
    config = Path(result.stdout.strip().splitlines()[-1])

    with pytest.raises(RuntimeError), trace_callsites("died", tmp_path / "t", rank=0):
        train(6, "die")
    died = tmp_path / "t" / "died_callsite_rank0.json"  # marked partial: the block raised
    assert json.loads(died.read_text())["meta"]["partial"]["exception"] == "RuntimeError"
    checked = invoke("check", "--config", config, "-i", died)
    assert checked.exit_code == 0, checked.stdout
    head, *rest = checked.stdout.splitlines()
    assert "traces that end early, rank 0: exception RuntimeError at step 3" in head
    assert head.endswith(": 0 error(s), 0 warning(s)") and rest == [], checked.stdout
    checked = invoke("check", "--config", config, "-i", died, "--format", "json")
    report = json.loads(checked.stdout)  # says so too: not a clean pass
    assert report["violations"] == [] and report["notes"] == [
        "traces that end early, rank 0: exception RuntimeError at step 3: "
        "their counts and last step not compared"
    ]
    # a function the config lacks, in a run that died: its ops are counted against the
    # config's pruning threshold, a whole-run rule, which the guard does not check for a
    # run that ended early; nor does check now (it reported an unknown_target warning
    # the guard did not; what ran inside the functions the config has still counts)
    with pytest.raises(RuntimeError), trace_callsites("new", tmp_path / "t", rank=0):
        train(6, "new+die")
    new = tmp_path / "t" / "new_callsite_rank0.json"
    checked = invoke("check", "--config", config, "-i", new, "--format", "json")
    found = {(v["kind"], v["target"]) for v in json.loads(checked.stdout)["violations"]}
    assert ("unexpected_op", "test_check_sequences:sync") in found, checked.stdout
    assert not any(kind == "unknown_target" for kind, _ in found), checked.stdout
    # a departure before the end is still one
    with pytest.raises(RuntimeError), trace_callsites("odd", tmp_path / "t", rank=0):
        train(6, "dtype+die")
    odd = tmp_path / "t" / "odd_callsite_rank0.json"
    checked = invoke("check", "--config", config, "-i", odd, "--format", "json")
    kinds = [v["kind"] for v in json.loads(checked.stdout)["violations"]]
    assert checked.exit_code == 1 and "collective_dtype" in kinds, checked.stdout


@pytest.mark.usefixtures("group")
def test_traces_without_sequences_say_the_collectives_were_not_compared(tmp_path: Path) -> None:
    base = traced(tmp_path / "t", "base", 3)
    result = invoke("run", "-i", base, "--output-base", tmp_path / "run")
    config = Path(result.stdout.strip().splitlines()[-1])
    again = traced(tmp_path / "t", "again", 3)
    doc = json.loads(again.read_text())
    del doc["collectives"]  # as a reader that records none (a Kineto trace without them)
    again.write_text(json.dumps(doc))
    checked = invoke("check", "--config", config, "-i", again)
    head = checked.stdout.splitlines()[0]
    assert "the config's collective sequences not compared: the traces record none" in head


def _job_traces(folder: Path, docs: list[dict[str, Any]]) -> str:
    """Hand-made rank documents written as ``folder/job_rank{R}.json``; their glob."""
    folder.mkdir()
    for doc in docs:
        (folder / f"job_rank{doc['meta']['rank']}.json").write_text(json.dumps(doc))
    return str(folder / "job_rank*.json")


def _pipeline_config(tmp_path: Path) -> Path:
    """The run directory of a good 2-stage pipeline job of 2 steps (hand-made)."""
    from tests.test_collective_sequences import pipeline, rank_doc

    good = _job_traces(tmp_path / "good", [rank_doc(r, pipeline(r, 2)) for r in range(2)])
    result = invoke("run", "-i", good, "--output-base", tmp_path / "run")
    assert result.exit_code == 0, result.stdout
    return Path(result.stdout.strip().splitlines()[-1])


def test_point_to_point_ops_are_not_replayed_by_position(tmp_path: Path) -> None:
    """Hand-made 2-stage pipeline traces (no torch run): a stage that sends twice, or
    another size, in a step departs from nothing; its all_reduce is still compared."""
    from tests.test_collective_sequences import AR, SEND, pipeline, rank_doc, replace_step

    config = _pipeline_config(tmp_path)
    sends = [(1, SEND, "float32", 32, 21), (1, SEND, "float32", 8, 21), (1, AR, "float32", 8, 11)]
    odd = [rank_doc(0, replace_step(pipeline(0, 2), 1, sends)), rank_doc(1, pipeline(1, 2))]
    checked = invoke("check", "--config", config, "-i", _job_traces(tmp_path / "odd", odd),
                     "--format", "json")  # fmt: skip
    assert checked.exit_code == 0, checked.stdout
    kinds = {v["kind"] for v in json.loads(checked.stdout)["violations"]}
    assert not {k for k in kinds if k.startswith("collective_")}, kinds
    sends[-1] = (1, AR, "int32", 8, 11)
    odd[0] = rank_doc(0, replace_step(pipeline(0, 2), 1, sends))
    checked = invoke("check", "--config", config, "-i", _job_traces(tmp_path / "dtype", odd),
                     "--format", "json")  # fmt: skip
    kinds = {v["kind"] for v in json.loads(checked.stdout)["violations"]}
    assert checked.exit_code == 1 and "collective_dtype" in kinds, checked.stdout


def test_ranks_that_depart_alike_are_one_violation_naming_them_all(tmp_path: Path) -> None:
    """Both stages all-reduce int32 where the good run reduced float32: one violation on
    ranks 0 and 1, whose message named rank 0 alone (``ranks 0,1   rank 0: …``)."""
    from tests.test_collective_sequences import AR, SEND, pipeline, rank_doc, replace_step

    config = _pipeline_config(tmp_path)
    odd = [
        rank_doc(r, replace_step(pipeline(r, 2), 1, [(1, SEND, "float32", 8, 21),
                                                     (1, AR, "int32", 8, 11)]))
        for r in range(2)
    ]  # fmt: skip
    checked = invoke("check", "--config", config, "-i", _job_traces(tmp_path / "odd", odd),
                     "--format", "json")  # fmt: skip
    found = [v for v in json.loads(checked.stdout)["violations"] if v["kind"] == "collective_dtype"]
    assert [v["ranks"] for v in found] == [[0, 1]], found
    assert not found[0]["message"].startswith("rank "), found[0]["message"]


def test_two_groups_issued_in_another_order_are_a_collective_order(tmp_path: Path) -> None:
    """Hand-made traces of 2 ranks (no torch run): each step all-reduces on the world
    group, then on group 1 (both ranks); rank 1 swaps them in step 1. Each group on its
    own follows the config, yet both ranks wait for the other: check names rank 1,
    step 1 and both groups, as divergence does (docs/divergence.md)."""
    from tests.test_collective_sequences import AR, WORLD, rank_doc, replace_step

    sub = {"name": "1", "desc": None, "size": 2, "ranks": [0, 1]}
    a, b = (AR, "float32", 6, 10), (AR, "float32", 6, 11, "1")  # the same all_reduce
    calls = [(step, *c) for step in range(3) for c in (a, b)]
    swapped = replace_step(calls, 1, [(1, *b), (1, *a)])
    good = _job_traces(tmp_path / "good", [rank_doc(r, calls, [WORLD, sub]) for r in range(2)])
    result = invoke("run", "-i", good, "--output-base", tmp_path / "run")
    assert result.exit_code == 0, result.stdout
    config = Path(result.stdout.strip().splitlines()[-1])
    odd = [rank_doc(0, calls, [WORLD, sub]), rank_doc(1, swapped, [WORLD, sub])]
    checked = invoke("check", "--config", config, "-i", _job_traces(tmp_path / "odd", odd),
                     "--format", "json")  # fmt: skip
    assert checked.exit_code == 1, checked.stdout
    found = [v for v in json.loads(checked.stdout)["violations"] if v["kind"].startswith("coll")]
    assert [(v["kind"], v["ranks"]) for v in found] == [("collective_order", [1])], found
    message = found[0]["message"]
    # the ranks are the violation's (joined over ranks that depart alike), not the text's
    assert message.startswith("collective #0 on group 1, step 1: issues"), message
    assert "on group 0 first" in message and "interleave in another order" in message


def test_a_longer_run_is_not_held_to_a_one_of_a_kind_last_loop_step(tmp_path: Path) -> None:
    """Hand-made 2-rank traces (no torch run) shaped as DDP's: the second iteration
    also broadcasts the rebuilt bucket sizes. Of a 3-step good run that is the last loop
    step, which check held every step past the good run's loop to: an unchanged 10-step
    run of transformers' GPT-2 under DDP gave `collective_order` and
    `collective_missing` errors (the guard, holding such a step to either the last loop
    step or the last step, gave none). A departure there is still an error."""
    from tests.test_collective_sequences import AR, rank_doc

    def traces(folder: Path, calls: list[tuple[Any, ...]]) -> str:
        folder.mkdir()
        for rank in range(2):
            (folder / f"dp_rank{rank}.json").write_text(json.dumps(rank_doc(rank, calls)))
        return str(folder / "dp_rank*.json")

    rebuild = ("c10d::broadcast_", "int32", 29, 12)

    def job(steps: int, odd: int | None = None) -> list[tuple[Any, ...]]:
        calls: list[tuple[Any, ...]] = []
        for step in range(steps):
            if step == 1:
                calls.append((step, *rebuild))
            calls.append((step, AR, "int32" if step == odd else "float32", 64, 10))
        return calls

    result = invoke("run", "-i", traces(tmp_path / "good", job(3)), "--output-base", tmp_path / "r")
    assert result.exit_code == 0, result.stdout
    config = Path(result.stdout.strip().splitlines()[-1])
    checked = invoke("check", "--config", config, "-i", traces(tmp_path / "long", job(10)),
                     "--format", "json")  # fmt: skip
    kinds = [v["kind"] for v in json.loads(checked.stdout)["violations"]]
    assert checked.exit_code == 0 and not [k for k in kinds if k.startswith("coll")], kinds
    checked = invoke("check", "--config", config, "-i", traces(tmp_path / "odd", job(10, 5)),
                     "--format", "json")  # fmt: skip
    found = [v for v in json.loads(checked.stdout)["violations"] if v["kind"].startswith("coll")]
    assert checked.exit_code == 1 and [v["kind"] for v in found] == ["collective_dtype"], found
    assert "step 5" in found[0]["message"], found[0]["message"]
