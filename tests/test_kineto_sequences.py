"""Collective sequences read from torch.profiler (Kineto) traces (docs/kineto.md,
"Collective sequences"): hand-made minimal traces for each rule, the real MI300 and
DLRM traces (tests/data/kineto/collectives, NOTICE there), and ``opguard run`` over
the 8 DLRM ranks, as recorded and with one rank changed (dtype, order)."""

from __future__ import annotations

import copy
import gzip
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from opguard_core.formats.divergence import load_divergence
from opguard_core.formats.trace import TRACE_VERSION, read_bytes
from opguard_plugins.readers.kineto import read_kineto
from tests.conftest import RunResult

Opguard = Callable[..., RunResult]

COLLECTIVES = Path(__file__).parent / "data" / "kineto" / "collectives"
KINETO = Path(__file__).parent / "data" / "kineto"


def read(data: dict[str, Any], name: str = "t.json") -> dict[str, Any]:
    return plain(read_kineto(json.dumps(data).encode(), name))


def plain(doc: dict[str, Any]) -> dict[str, Any]:
    """A reader's document as JSON values (a combine encodes it), groups without
    their default ``first``."""
    out: dict[str, Any] = json.loads(msgspec.json.encode(doc))
    for seq in out.get("collectives", {}).get("sequences", []):
        for group in seq["groups"]:
            if group.get("first") == 0:
                del group["first"]
    return out


def sequence(doc: dict[str, Any]) -> dict[str, Any]:
    sequences = doc["collectives"]["sequences"]
    assert len(sequences) == 1
    seq: dict[str, Any] = sequences[0]
    return seq


def calls(seq: dict[str, Any]) -> list[tuple[int, dict[str, Any]]]:
    """(step, signature) of every collective, in order."""
    out = []
    for first, last, ids in seq["steps"]:
        for step in range(first, last + 1):
            out.extend((step, seq["signatures"][i]) for i in ids)
    return out


def op(name: str, ts: float, dur: float, tid: int = 1, **args: Any) -> dict[str, Any]:
    return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": tid, "ts": ts,
            "dur": dur, "args": args}  # fmt: skip


def label(name: str, ts: float, dur: float, tid: int = 1, **args: Any) -> dict[str, Any]:
    return {"ph": "X", "cat": "user_annotation", "name": name, "pid": 1, "tid": tid,
            "ts": ts, "dur": dur, "args": args}  # fmt: skip


def comms(ts: float, dur: float, **args: Any) -> dict[str, Any]:
    """A record_param_comms event (its keys as torch >= 2.3 writes them)."""
    keys = {
        "dtype": "dtype",
        "name": "Process Group Name",
        "desc": "Process Group Description",
        "size": "Group size",
        "ranks": "Process Group Ranks",
        "nelems": "In msg nelems",
    }
    return op("record_param_comms", ts, dur, **{keys[k]: v for k, v in args.items()})


DISTRIBUTED = {
    "rank": 1,
    "world_size": 4,
    "backend": "nccl",
    "pg_config": [
        {"pg_name": "0", "pg_desc": "default_pg", "pg_size": 4, "ranks": [0, 1, 2, 3]},
        {"pg_name": "1", "pg_desc": "tp", "pg_size": 2, "ranks": [0, 1]},
    ],
}


def handmade() -> dict[str, Any]:
    """Two profiler steps of rank 1 of 4: an allreduce on subgroup ``1`` described by
    record_param_comms, a functional all_reduce (group and reduce op from its concrete
    inputs) with its wait, an old-style broadcast that names nothing, and an allgather
    nested in a custom op, described by its own args."""
    events = [
        label("ProfilerStep#5", 0, 100),
        label("train", 1, 98),
        op("c10d::allreduce_", 10, 10, **{
            "Input Dims": [[[2, 4]], [], [], [], []],
            "Input type": ["TensorList", "", "", "", "Scalar"]}),
        comms(11, 8, dtype="BFloat16", name="1", desc="tp", size=2, ranks="[0, 1]", nelems=8),
        label("nccl:all_reduce", 12, 5, **{"Input Dims": [[8]], "Input type": ["c10::BFloat16"]}),
        label("Optimizer.step#SGD.step", 80, 10),
        label("ProfilerStep#6", 100, 100),
        op("_c10d_functional::all_reduce", 110, 10, **{
            "Input Dims": [[3], [], []], "Input type": ["float", "", ""],
            "Concrete Inputs": ["", "avg", "2"]}),
        op("_c10d_functional::wait_tensor", 121, 2, **{"Input Dims": [[3]]}),
        op("c10d::broadcast_", 130, 10, **{
            "Input Dims": [[], [], [], [], [], []],
            "Input type": ["TensorList", "", "Scalar", "Scalar", "Scalar", "Scalar"]}),
        op("myns::all_gather", 150, 20),
        op("c10d::_allgather_base_", 152, 10, **{
            "Input Dims": [[8], [2], [], [], []],
            "Input type": ["long int", "long int", "", "Scalar", "Scalar"]}),
        label("Optimizer.step#SGD.step", 180, 10),
    ]  # fmt: skip
    return {"schemaVersion": 1, "distributedInfo": DISTRIBUTED, "traceEvents": events}


@pytest.mark.parametrize(
    ("field", "value"), [("Process Group Ranks", [0, 1]), ("Process Group Name", {"x": 1})]
)
def test_a_group_described_by_a_json_array_or_object_is_read(field: str, value: Any) -> None:
    """``Process Group Ranks`` as an array (not torch's string), a name as an object:
    read (the ranks) or ignored (the name), not a crash of the reader."""
    doc = handmade()
    for event in doc["traceEvents"]:
        if event["name"] == "record_param_comms":
            event["args"][field] = value
    seq = sequence(read(doc))
    assert len(calls(seq)) == 4
    if field == "Process Group Ranks":
        assert [0, 1] in [g["ranks"] for g in seq["groups"]]


def test_handmade_sequence_fields_groups_and_steps() -> None:
    seq = sequence(read(handmade()))
    assert seq["ranks"] == [1]
    groups = [(g["name"], g["desc"], g["size"], g["ranks"]) for g in seq["groups"]]
    found = [(step, {k: v for k, v in sig.items() if k != "stack"}) for step, sig in calls(seq)]
    by_name = {g[0]: i for i, g in enumerate(groups)}
    assert found == [
        (5, {"op": "c10d::allreduce_", "group": by_name["1"], "dtype": "bfloat16",
             "numel": 8, "shapes": [[2, 4]], "reduce_op": None}),
        (6, {"op": "_c10d_functional::all_reduce", "group": by_name["2"],
             "dtype": "float32", "numel": 3, "shapes": [[3]], "reduce_op": "avg"}),
        (6, {"op": "c10d::broadcast_", "group": by_name["0"], "dtype": None,
             "numel": None, "shapes": None, "reduce_op": None}),
        (6, {"op": "c10d::_allgather_base_", "group": by_name["0"], "dtype": "int64",
             "numel": 2, "shapes": [[2]], "reduce_op": None}),
    ]  # fmt: skip
    # record_param_comms' group; a functional group name completed from nothing; the
    # default group from distributedInfo's pg_config
    assert sorted(groups) == [
        ("0", "default_pg", 4, [0, 1, 2, 3]),
        ("1", "tp", 2, [0, 1]),
        ("2", None, None, []),
    ]
    # the op's callsite: the labels above it (stack_source labels)
    stacks = {sig["op"]: sig["stack"] for _, sig in calls(seq)}
    doc = read(handmade())
    names = {i: f["function"] for i, f in enumerate(doc["frames"])}
    assert [names[f] for f in stacks["c10d::allreduce_"]] == ["train"]
    assert [names[f] for f in stacks["c10d::_allgather_base_"]] == []
    # the nested collective keeps being counted with its callsite, too
    assert {s["op"] for s in doc["callsites"]} >= {"c10d::_allgather_base_", "myns::all_gather"}


def test_steps_without_optimizer_labels_are_profiler_steps() -> None:
    """No ``Optimizer.step#`` label: a collective's step is the ``ProfilerStep#N`` it
    follows (the first one's number before it); a job that repeats itself is one run."""
    events = [op("c10d::barrier", 0, 5)]
    for n in range(3, 9):
        events += [
            label(f"ProfilerStep#{n}", n * 100, 90),
            op("c10d::allreduce_", n * 100 + 10, 5),
            comms(n * 100 + 11, 3, dtype="Float", name="0", size=2, nelems=6),
        ]
    seq = sequence(read({"distributedInfo": {"rank": 0, "world_size": 2}, "traceEvents": events}))
    assert seq["steps"] == [[3, 3, [0, 1]], [4, 8, [1]]]
    assert [sig["op"] for sig in seq["signatures"]] == ["c10d::barrier", "c10d::allreduce_"]
    assert seq["signatures"][1]["numel"] == 6 and seq["signatures"][1]["shapes"] is None
    assert seq["groups"] == [{"name": "0", "desc": None, "size": 2, "ranks": [0, 1]}]


def test_no_group_info_is_the_default_group() -> None:
    """No record_param_comms, no distributedInfo: group ``"0"``, size unknown; the
    sequence's rank is the trace's (0 here)."""
    events = [op("c10d::allreduce_", 0, 5), op("c10d::allreduce_", 10, 5)]
    seq = sequence(read({"traceEvents": events}, "job.json"))
    assert seq["ranks"] == [0]
    assert seq["groups"] == [{"name": "0", "desc": None, "size": None, "ranks": []}]
    assert seq["steps"] == [[0, 0, [0, 0]]]


def test_collectives_without_distributed_info_are_described() -> None:
    """A trace without ``distributedInfo`` in its head is decoded without the args
    that describe collectives (faster); when it has collectives, they are decoded
    after all: the description is the same."""
    events = [
        op("c10d::allreduce_", 0, 10),
        comms(1, 5, dtype="Half", name="3", desc="dp", size=2, ranks="[1, 3]", nelems=5),
    ]
    plain_doc = read({"traceEvents": events}, "job_rank1.json")
    seq = sequence(plain_doc)
    assert seq["ranks"] == [1]
    assert seq["groups"] == [{"name": "3", "desc": "dp", "size": 2, "ranks": [1, 3]}]
    assert (seq["signatures"][0]["dtype"], seq["signatures"][0]["numel"]) == ("float16", 5)
    with_info = read({"distributedInfo": {"rank": 1}, "traceEvents": events}, "job_rank1.json")
    assert sequence(with_info) == seq


def test_odd_args_are_unknown_not_errors() -> None:
    """Truncated rank lists, sizes that are strings, shapes that are not shapes: the
    field is null, the trace is read."""
    events = [
        op("c10d::allreduce_", 0, 10, **{"Input Dims": "x", "Input type": [1, None]}),
        comms(1, 5, dtype="NoSuchType", name=7, size="8", ranks="[0, 1, ...]", nelems=-1),
        label("nccl:all_reduce", 2, 1, **{"Input Dims": [["a"]], "Input type": ["float"]}),
    ]
    seq = sequence(read({"distributedInfo": {"rank": 0, "world_size": 8}, "traceEvents": events}))
    sig = seq["signatures"][0]
    assert (sig["dtype"], sig["numel"], sig["shapes"]) == ("float32", None, None)
    assert seq["groups"] == [{"name": "7", "desc": None, "size": None, "ranks": []}]


def test_trace_without_collectives_has_no_sequence() -> None:
    doc = read_kineto(read_bytes(KINETO / "h100_bert_small.pt.trace.json.gz"), "bert.json")
    assert "collectives" not in doc


def test_real_mi300_sequence() -> None:
    """The MI300 DDP trace (rank 0 of 8, steps 15-17; torch's full record_param_comms):
    per step 2 broadcasts (DDP's buffers) and 2 bucket allreduces, bfloat16, on
    default_pg; one run for the three steps."""
    name = "mi300_resnet_ddp_rank0_comm.pt.trace.json.gz"
    seq = sequence(plain(read_kineto(read_bytes(COLLECTIVES / name), name)))
    assert seq["ranks"] == [0]
    assert seq["groups"] == [
        {"name": "0", "desc": "default_pg", "size": 8, "ranks": list(range(8))}
    ]
    described = [(s["op"], s["dtype"], s["numel"], s["shapes"]) for s in seq["signatures"]]
    assert described == [
        ("c10d::broadcast_", "bfloat16", 9600, [[9600]]),
        ("c10d::broadcast_", "int64", 20, [[20]]),
        ("c10d::allreduce_", "bfloat16", 2873320, [[2873320]]),
        ("c10d::allreduce_", "bfloat16", 8816192, [[8816192]]),
    ]
    assert seq["steps"] == [[15, 17, [0, 1, 2, 3]]]


def dlrm(rank: int) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(read_bytes(COLLECTIVES / f"dlrm_rank{rank}.pt.trace.json.gz"))
    return data


def test_real_dlrm_sequence_from_old_record_param_comms() -> None:
    """DLRM rank 3 (2023 torch: record_param_comms without metadata): dtype and sizes
    from the nccl:* labels and the ops' args, the default group of world_size 8, the
    DDP allreduces issued from the autograd thread in time order with the
    alltoalls, all in ProfilerStep#10 (no optimizer step finished before them)."""
    seq = sequence(read(dlrm(3), "worker3.json"))
    assert seq["ranks"] == [3]
    assert seq["groups"] == [{"name": "0", "desc": None, "size": 8, "ranks": list(range(8))}]
    described = [(s["op"], s["dtype"], s["numel"]) for _, s in calls(seq)]
    assert described == [
        ("c10d::alltoall_base_", "float32", 6144),
        ("c10d::alltoall_base_", "int64", 24),
        ("c10d::alltoall_base_", "int32", 384),
        ("c10d::alltoall_base_", "int32", 3392),  # the input (arg 1), not the output
        ("c10d::allreduce_", "float32", 394241),
        ("c10d::alltoall_base_", "float32", 6144),
        ("c10d::allreduce_", "float32", 112),
        ("c10d::allreduce_", "float32", 226960),
    ]
    assert {step for step, _ in calls(seq)} == {10}
    # every signature has the op's callsite (record_function labels here)
    assert all(s["stack"] for s in seq["signatures"])


def write_ranks(
    directory: Path, change: Callable[[int, dict[str, Any]], None] | None = None
) -> Path:
    directory.mkdir()
    for rank in range(8):
        data = dlrm(rank)
        if change is not None:
            change(rank, data)
        (directory / f"dlrm_rank{rank}.pt.trace.json.gz").write_bytes(
            gzip.compress(json.dumps(data).encode(), mtime=0)
        )
    return directory / "dlrm_rank*.pt.trace.json.gz"


def collective_events(data: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """Each collective op with the record_param_comms and nccl:* events inside it, in
    time order."""
    events = data["traceEvents"]
    ops = sorted(
        (e for e in events if e.get("cat") == "cpu_op" and e["name"].startswith("c10d::")),
        key=lambda e: e["ts"],
    )
    out = []
    for outer in ops:
        inside = [
            e
            for e in events
            if e is not outer
            and e.get("tid") == outer["tid"]
            and e.get("ph") == "X"
            and outer["ts"] <= e["ts"] < outer["ts"] + outer["dur"]
            and (e["name"] == "record_param_comms" or e["name"].startswith("nccl:"))
        ]
        out.append([outer, *inside])
    return out


def run_divergence(opguard: Opguard, pattern: Path, expect: int) -> list[dict[str, Any]]:
    run = opguard("run", "-i", pattern, "--fail-on-divergence", expect=expect)
    combined = json.loads(run.read("dlrm_combined.json"))
    assert combined["version"] == TRACE_VERSION and combined["meta"]["ranks"] == list(range(8))
    assert run.run_dir is not None
    findings: list[dict[str, Any]] = load_divergence(run.run_dir / "dlrm_divergence.json")[
        "findings"
    ]
    return findings


def test_dlrm_8_ranks_agree(opguard: Opguard, tmp_path: Path) -> None:
    """The real job: all 8 ranks issue the same 8 collectives: one sequence for all,
    no finding, exit 0 under --fail-on-divergence."""
    pattern = write_ranks(tmp_path / "job")
    run = opguard("run", "-i", pattern, "--fail-on-divergence", expect=0)
    combined = json.loads(run.read("dlrm_combined.json"))
    sequences = combined["collectives"]["sequences"]
    assert [s["ranks"] for s in sequences] == [list(range(8))]
    assert sum(len(ids) for _, _, ids in sequences[0]["steps"]) == 8
    assert run.run_dir is not None
    assert load_divergence(run.run_dir / "dlrm_divergence.json")["findings"] == []
    config = run.read("dlrm_instrumentation.yaml")
    assert "collectives:" in config  # generate writes the sequence for guard


def test_dlrm_rank_with_another_dtype_is_named(opguard: Opguard, tmp_path: Path) -> None:
    """Rank 5 sends its third alltoall as int64 where the others send int32: a
    collective_dtype in the sequence, and its callsite runs in another dtype."""

    def change(rank: int, data: dict[str, Any]) -> None:
        if rank == 5:
            for event in collective_events(data)[2]:
                types = event["args"].get("Input type")
                if types:
                    event["args"]["Input type"] = ["long int" if t == "int" else t for t in types]

    findings = run_divergence(opguard, write_ranks(tmp_path / "job", change), 4)
    assert [(f["kind"], f["ranks"], f.get("position")) for f in findings] == [
        ("collective_dtype", [5], 2),
        ("dtype_mismatch", [5], None),  # the op's callsite (dtype from Input type, v7)
    ]
    assert findings[1]["op"] == "c10d::alltoall_base_"
    assert findings[0]["expected"]["dtype"] == "int32" and findings[0]["got"]["dtype"] == "int64"
    assert findings[0]["step"] == 10 and findings[0]["majority"] is True


def test_dlrm_rank_with_two_collectives_swapped_is_named(opguard: Opguard, tmp_path: Path) -> None:
    """Rank 2 issues its second and third alltoall (int64[24], int32[384]) in the
    opposite order: same counts per callsite, a desync all the same (and, since the
    callsites carry dtypes, each of the two runs in the other's)."""

    def change(rank: int, data: dict[str, Any]) -> None:
        if rank == 2:
            found = collective_events(data)
            for a, b in zip(found[1], found[2], strict=True):
                a["args"], b["args"] = copy.deepcopy(b["args"]), copy.deepcopy(a["args"])

    findings = run_divergence(opguard, write_ranks(tmp_path / "job", change), 4)
    assert [(f["kind"], f["ranks"], f.get("position")) for f in findings] == [
        ("collective_order", [2], 1),
        ("dtype_mismatch", [2], None),
        ("dtype_mismatch", [2], None),
    ]
    assert (findings[0]["expected"]["dtype"], findings[0]["got"]["dtype"]) == ("int64", "int32")


@pytest.mark.parametrize("rank", [0, 7])
def test_every_dlrm_rank_reads_the_same_collectives(rank: int) -> None:
    """Ranks' traces differ in their own cuts (ranks 1 and 3 lost launches); their
    collectives do not."""
    assert [(s["op"], s["dtype"], s["numel"]) for _, s in calls(sequence(read(dlrm(rank))))] == [
        (s["op"], s["dtype"], s["numel"]) for _, s in calls(sequence(read(dlrm(3))))
    ]


def test_a_trace_after_a_byte_order_mark_reads_as_without() -> None:
    data = json.dumps(handmade()).encode()
    assert plain(read_kineto(b"\xef\xbb\xbf" + data, "t.json")) == plain(
        read_kineto(data, "t.json")
    )


def test_a_step_number_of_thousands_of_digits_is_no_step() -> None:
    """``int()`` refuses more than 4300 digits: the reader once failed on such a label."""
    doc = handmade()
    doc["traceEvents"][0]["name"] = "ProfilerStep#" + "9" * 5000
    assert read(doc)["meta"]["steps"] == 1 and read(handmade())["meta"]["steps"] == 2
