"""The Flight Recorder reader: the dumps recorded here, hostile dumps, NCCL's shape.

The recorded dumps are in ``tests/data/flight_recorder`` (README.md: how, and what
each 3-rank gloo job does; ``fr_job.py`` is the job). The expectations below are
derived from ``fr_job.py``'s source, not from the reader's output.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from opguard_core.formats.divergence import load_divergence
from opguard_core.formats.trace import decode_trace, read_bytes
from opguard_plugins.readers.flight_recorder import (
    FlightRecorderError,
    PlainUnpickler,
    check_cost,
    looks_like_json_dump,
    looks_like_pickle,
    read_dump,
)
from tests.conftest import RunResult

DATA = Path(__file__).parent / "data" / "flight_recorder"
JOB = DATA / "fr_job.py"
SCENARIOS = ("ok", "order", "dtype", "size", "skip", "group")

Opguard = Callable[..., RunResult]


def read(path: Path) -> dict[str, Any]:
    document, warnings = read_dump(path.read_bytes(), path)
    assert warnings == []
    return json.loads(json.dumps(document))  # as a file holds it


def job_lines(text: str) -> list[int]:
    """The lines of ``fr_job.py`` holding ``text``."""
    return [n for n, line in enumerate(JOB.read_text().splitlines(), 1) if text in line]


def job_line(text: str) -> int:
    """The line of ``fr_job.py`` holding ``text`` (once)."""
    (line,) = job_lines(text)
    return line


#: the call in fr_job.py where rank 1 departs: (text, which of the lines holding it)
CULPRIT_LINE = {
    "order": ("dist.broadcast(b, src=0)", 0),
    "skip": ("dist.broadcast(b, src=0)", 1),
    "dtype": ("dist.all_reduce(a, group=", 0),
    "size": ("dist.broadcast(b, src=0)", 2),
    "group": ("dist.all_reduce(a, group=", 0),
}


# what each call of fr_job.py's step is: (op, group name, dtype, numel)
ALL_REDUCE = ("c10d::allreduce_", "0", "float32", 8)
BROADCAST = ("c10d::broadcast_", "0", "float32", 6)
SUB_REDUCE = ("c10d::allreduce_", "1", "float32", 2)
STEP = [ALL_REDUCE, BROADCAST, SUB_REDUCE]
#: rank 1's second step, per scenario (its first is STEP; ranks 0 and 2 issue STEP twice)
CULPRIT_STEP = {
    "ok": STEP,
    "order": [BROADCAST],  # times out: the others are in all_reduce
    "dtype": [("c10d::allreduce_", "0", "int32", 8), BROADCAST, SUB_REDUCE],
    "size": [ALL_REDUCE, ("c10d::broadcast_", "0", "float32", 8), SUB_REDUCE],
    "skip": [BROADCAST],  # times out
    "group": [("c10d::allreduce_", "1", "float32", 8)],  # times out
}
#: what the others issue when the job stops (a timeout ends their step early)
OTHERS_STEP = {
    "ok": STEP,
    "order": [ALL_REDUCE],
    "dtype": STEP,
    "size": STEP,
    "skip": [ALL_REDUCE],
    "group": [ALL_REDUCE],
}


def calls(document: dict[str, Any]) -> list[tuple[str, str, str | None, int | None]]:
    (sequence,) = document["collectives"]["sequences"]
    groups, signatures = sequence["groups"], sequence["signatures"]
    (run,) = sequence["steps"]
    assert run[:2] == [0, 0]  # a dump has no steps: everything is step 0
    out = []
    for sid in run[2]:
        sig = signatures[sid]
        out.append((sig["op"], groups[sig["group"]]["name"], sig["dtype"], sig["numel"]))
    return out


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_recorded_dumps_read_as_the_job_issued(scenario: str) -> None:
    for rank in range(3):
        path = DATA / scenario / f"rank_{rank}"
        document = read(path)
        decode_trace(json.dumps(document).encode(), path)  # a valid trace document
        meta = document["meta"]
        assert meta["rank"] == rank and meta["ranks"] == [rank]
        assert meta["source_format"] == "flight_recorder" and meta["backend"] == "gloo"
        assert meta["stack_source"] == "frames"
        second = CULPRIT_STEP[scenario] if rank == 1 else OTHERS_STEP[scenario]
        assert calls(document) == STEP + second, (scenario, rank)
        (sequence,) = document["collectives"]["sequences"]
        # gloo's pg_config says nothing of the groups' members
        assert [(g["name"], g["desc"], g["size"]) for g in sequence["groups"]][:1] == [
            ("0", "default_pg", None)
        ]
        assert sum(site["count"] for site in document["callsites"]) == meta["entries"]


def test_stacks_come_from_the_dumps_frames() -> None:
    """Outermost first, ending in torch's ``all_reduce``; the job's line is the call's."""
    document = read(DATA / "dtype" / "rank_1")
    frames = document["frames"]
    (sequence,) = document["collectives"]["sequences"]
    int_reduce = next(s for s in sequence["signatures"] if s["dtype"] == "int32")
    stack = [frames[i] for i in int_reduce["stack"]]
    assert [f["function"] for f in stack[:2]] == ["<module>", "main"]
    assert (stack[-1]["file"], stack[-1]["function"]) == (
        "torch/distributed/distributed_c10d.py",
        "all_reduce",
    )
    assert stack[-1]["module"] == "torch.distributed.distributed_c10d"
    step = next(f for f in stack if f["function"] == "step")
    assert step["line"] == job_line("dist.all_reduce(a, group=sub if culprit")
    keys = [(f["file"], f["line"], f["function"]) for f in frames]
    assert keys == sorted(keys)


def test_json_dump_reads_like_the_pickle_without_stacks() -> None:
    for rank in range(3):
        pickled = read(DATA / "dtype" / f"rank_{rank}")
        as_json = read(DATA / "dtype_json" / f"rank_{rank}.json")
        assert calls(as_json) == calls(pickled)
        assert as_json["frames"] == [] and as_json["meta"]["stack_source"] == "none"


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_detected_by_content(scenario: str) -> None:
    assert looks_like_pickle((DATA / scenario / "rank_0").read_bytes())
    assert looks_like_json_dump((DATA / "dtype_json" / "rank_0.json").read_bytes())


def test_kineto_traces_are_not_taken() -> None:
    """Kineto's ``distributedInfo`` names a ``pg_config`` as a dump does."""
    kineto = Path(__file__).parent / "data" / "kineto"
    for path in sorted(kineto.glob("*.json*")):
        data = read_bytes(path)
        assert not looks_like_json_dump(data) and not looks_like_pickle(data), path


@pytest.mark.parametrize(
    "head",
    [
        b'{"format": "opguard-callsites", "version": 1, "pg_config": {}}',
        b'{"traceEvents": []}',
        b'{"distributedInfo": {"pg_config": []}, "traceEvents": []}',
        b'{"schemaVersion": 1, "comm_lib_version": "x"}',
        b"[1, 2, 3]",
        b"",
    ],
)
def test_not_a_json_dump(head: bytes) -> None:
    assert not looks_like_json_dump(head)


def test_a_json_dump_naming_opguard_is_a_dump() -> None:
    """Only an OpGuard document's ``"format"`` makes it one: a group or thread named
    ``opguard-…`` does not."""
    dump = b'{"comm_lib_version": "", "pg_config": {"0": {"desc": "opguard-x"}}}'
    assert looks_like_json_dump(dump)


# --- NCCL's dump, as torch writes it (built here: no GPU on this machine) -----------


def nccl_dump(**changes: Any) -> dict[str, Any]:
    """A dump of the shape ProcessGroupNCCL writes (FlightRecorder version 2.x):
    ``pg_config`` keyed by the group's name with its members as a string."""

    def entry(record: int, name: str, seq: int, sizes: list[list[int]], **more: Any) -> Any:
        return {
            "record_id": record,
            "pg_id": 0,
            "process_group": ("0", "default_pg"),
            "collective_seq_id": seq,
            "p2p_seq_id": 0,
            "op_id": seq,
            "profiling_name": name,
            "time_created_ns": 1000 + record,
            "input_sizes": sizes,
            "input_dtypes": ["BFloat16"] * len(sizes),
            "output_sizes": sizes,
            "output_dtypes": ["BFloat16"] * len(sizes),
            "state": "completed",
            "time_discovered_started_ns": None,
            "time_discovered_completed_ns": None,
            "retired": True,
            "timeout_ms": 600000,
            "is_p2p": False,
            "frames": [
                {"name": "_allgather_base", "filename": "/x/torch/distributed/c.py", "line": 9},
                {"name": "train", "filename": "/home/u/train.py", "line": 40},
            ],
            **more,
        }

    dump: dict[str, Any] = {
        "version": "2.10",
        "comm_lib_version": "2.21.5",
        "pg_config": {
            "0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"},
            "1": {"name": "1", "desc": "tp", "ranks": "[2, 3]"},
        },
        "pg_status": {"0": {"last_enqueued_collective": 2, "last_completed_collective": 1}},
        "entries": [
            entry(0, "nccl:_allgather_base", 1, [[4, 16]]),
            entry(1, "nccl:all_reduce", 2, [[3], [5]], state="scheduled"),
            entry(
                2,
                "nccl:send 2->3",
                0,
                [[7]],
                process_group=("1", "tp"),
                is_p2p=True,
                p2p_seq_id=1,
            ),
        ],
    }
    dump.update(changes)
    return dump


def test_a_coalesced_batch_of_sends_and_recvs_is_point_to_point(
    opguard: Opguard, tmp_path: Path
) -> None:
    """A 3-stage pipeline (``batch_isend_irecv``: each send or recv, then the batch's
    ``nccl:coalesced`` entry, ``is_p2p``) between all-reduces: no finding (the batch
    read as ``c10d::coalesced``, compared by position: a false collective_order)."""
    base = nccl_dump()["entries"][0]
    plan = {0: ["send 0->1"], 1: ["recv 0->1", "send 1->2"], 2: ["recv 1->2"]}
    for rank in range(3):
        calls: list[tuple[str, int, int]] = []  # (type, collective seq, p2p seq)
        for step in range(2):
            calls.append(("nccl:all_reduce", step + 1, 0))
            for number, op in enumerate(plan[rank], 1):
                calls += [(f"nccl:{op}", 0, 2 * step + number),
                          ("nccl:coalesced", 0, 2 * step + number)]  # fmt: skip
        calls.append(("nccl:all_reduce", 3, 0))
        entries = [
            dict(base, record_id=n, profiling_name=name, collective_seq_id=seq, op_id=n + 1,
                 is_p2p=bool(p2p), p2p_seq_id=p2p)
            for n, (name, seq, p2p) in enumerate(calls)
        ]  # fmt: skip
        dump = nccl_dump(entries=entries)
        dump["pg_config"] = {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2]"}}
        (tmp_path / f"nccl_trace_rank_{rank}").write_bytes(pickle.dumps(dump, protocol=2))
    run = opguard("run", "-i", tmp_path / "nccl_trace_rank_*", "--fail-on-divergence")
    assert run.exit_code == 0, run.stderr[-2000:]


def test_nccl_dump(tmp_path: Path) -> None:
    path = tmp_path / "nccl_trace_rank_2"
    path.write_bytes(pickle.dumps(nccl_dump(), protocol=2))
    document = read(path)
    (sequence,) = document["collectives"]["sequences"]
    assert sequence["ranks"] == [2]
    assert sequence["groups"] == [
        {"name": "0", "desc": "default_pg", "size": 4, "ranks": [0, 1, 2, 3]},
        {"name": "1", "desc": "tp", "size": 2, "ranks": [2, 3]},
    ]
    shapes = [(s["op"], s["dtype"], s["numel"], s["shapes"]) for s in sequence["signatures"]]
    assert shapes == [
        ("c10d::_allgather_base_", "bfloat16", 64, [[4, 16]]),
        ("c10d::allreduce_", "bfloat16", 8, [[3], [5]]),
        ("c10d::send", "bfloat16", 7, [[7]]),
    ]
    # a callsite's dtype: only where the op's first argument is one tensor (formats.md,
    # "Dtypes"), as the tracer reads it; lists of tensors have none
    assert sorted((c["op"], c.get("dtype")) for c in document["callsites"]) == [
        ("c10d::_allgather_base_", "bfloat16"),
        ("c10d::allreduce_", None),
        ("c10d::send", None),
    ]
    meta = document["meta"]
    assert meta["backend"] == "nccl" and meta["world_size"] == 4
    assert meta["not_completed"] == 1  # the all_reduce a hang would sit in
    assert [f["file"] for f in document["frames"]] == [
        "/home/u/train.py",
        "/x/torch/distributed/c.py",
    ]


def test_a_wrapped_ring_buffer_is_warned_about(tmp_path: Path) -> None:
    dump = nccl_dump()
    for entry in dump["entries"]:
        entry["record_id"] += 500
        entry["collective_seq_id"] += 400 if entry["collective_seq_id"] else 0
    path = tmp_path / "rank_0"
    path.write_bytes(pickle.dumps(dump))
    _, warnings = read_dump(path.read_bytes(), path)
    (message,) = warnings
    assert "ring buffer wrapped" in message and "starts at record 500" in message
    assert "group(s) 0 past their first collective" in message


# --- hostile and broken dumps: one line naming the file, never code run ----------


class _Exploit:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def _shared(count: int) -> bytes:
    """A small pickle whose entries are ``count`` references to one entry, itself with
    ``count`` references to one frame: count**2 frames to convert."""
    frame = {"filename": "a.py", "line": 1, "name": "f"}
    entry = nccl_dump()["entries"][0] | {"frames": [frame] * count}
    return pickle.dumps({"version": "2.10", "entries": [entry] * count}, protocol=2)


def hostile_cases(tmp_path: Path) -> list[tuple[str, bytes, str]]:
    good = (DATA / "order" / "rank_0").read_bytes()
    marker = tmp_path / "pwned"
    return [
        (
            "global",
            pickle.dumps({"version": "2", "entries": [_Exploit(marker)]}),
            "refuses the global",
        ),
        ("truncated", good[: len(good) // 2], "truncated pickle"),
        ("garbage opcode", b"\x80\x02\xff\xfe", "not a readable pickle"),
        ("huge length", b"\x80\x02X\xff\xff\xff\x7f", "pickle data was truncated"),
        (
            "entries not a list",
            pickle.dumps({"version": "2.10", "entries": {"a": 1}}, protocol=4),
            "Expected `array`, got `object` - at `$.entries`",
        ),
        ("not a dump", pickle.dumps([1, 2, 3]), "not a Flight Recorder dump"),
        (
            "wrong type",
            pickle.dumps(nccl_dump(entries=[{"profiling_name": 5, "process_group": ("0", "")}])),
            "Expected `str`, got `int` - at `$.entries[0].profiling_name`",
        ),
        ("no version", pickle.dumps({"entries": []}), "missing required field `version`"),
        (
            "negative size",
            pickle.dumps(nccl_dump(entries=[nccl_dump()["entries"][0] | {"input_sizes": [[-4]]}])),
            "negative size",
        ),
        ("shared", _shared(3000), "expands to more than"),
        ("json", b'{"comm_lib_version": "", "version": 3}', "Expected `str`, got `int`"),
        ("json truncated", b'{"comm_lib_version": "", "entries": [', "invalid dump"),
        (
            "json deep",
            b'{"comm_lib_version": "", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
            "nesting too deep",
        ),
    ]


def test_hostile_dumps_are_refused_in_one_line(tmp_path: Path) -> None:
    for name, data, problem in hostile_cases(tmp_path):
        path = tmp_path / "rank_0"
        with pytest.raises(FlightRecorderError) as error:
            read_dump(data, path)
        message = str(error.value)
        assert problem in message, (name, message)
        assert "\n" not in message, name
    assert not (tmp_path / "pwned").exists()


def test_a_deeply_nested_pickle_is_read_without_recursion(tmp_path: Path) -> None:
    """200,000 nested lists under a key the reader does not read: built, never walked."""
    depth = 200_000
    # EMPTY_DICT, MARK, 'version': '2.10', 'entries': [], 'x': the nest, SETITEMS, STOP
    head = b"\x80\x02}(X\x07\x00\x00\x00versionX\x04\x00\x00\x002.10X\x07\x00\x00\x00entries]"
    nest = b"X\x01\x00\x00\x00x" + b"]" * depth + b"a" * (depth - 1)
    data = head + nest + b"u."
    document, _ = read_dump(data, tmp_path / "rank_0")
    assert document["meta"]["entries"] == 0


def test_plain_unpickler_refuses_every_global() -> None:
    for value in (os.system, pickle.Pickler, Path("x"), range(3)):
        data = pickle.dumps(value)
        with pytest.raises(pickle.UnpicklingError, match="refuses the global"):
            PlainUnpickler(io.BytesIO(data)).load()


def test_a_real_dump_stays_within_the_value_budget() -> None:
    """The budget (4 values per byte) holds for real dumps with room to spare: one
    value per byte is refused for none of them."""
    for scenario in SCENARIOS:
        data = (DATA / scenario / "rank_1").read_bytes()
        check_cost(PlainUnpickler(io.BytesIO(data)).load(), len(data))
    with pytest.raises(FlightRecorderError, match="expands to more than 100 values"):
        check_cost(PlainUnpickler(io.BytesIO(data)).load(), 100)


def test_the_rank_is_the_number_a_name_ends_with(tmp_path: Path) -> None:
    data = (DATA / "ok" / "rank_2").read_bytes()
    named = [("nccl_trace_rank_12", 12), ("dump3.json", 3), ("trace_7", 7),
             ("dump.0", 0), ("nccl_trace.rank_5", 5), ("host.domain_4", 4)]  # fmt: skip
    for name, rank in named:
        assert read_dump(data, tmp_path / name)[0]["meta"]["rank"] == rank
    with pytest.raises(FlightRecorderError, match="cannot tell the rank"):
        read_dump(data, tmp_path / "dump")


@pytest.mark.parametrize("command", ["run", "export"])
def test_commands_refuse_a_hostile_dump_in_one_line(
    opguard: Opguard, tmp_path: Path, command: str
) -> None:
    path = tmp_path / "dumps" / "rank_0"
    path.parent.mkdir()
    path.write_bytes(hostile_cases(tmp_path)[0][1])
    args = ("run", "-i", path) if command == "run" else ("export", path, "--format", "collapsed")
    result = opguard(*args)
    assert result.exit_code == (1 if command == "run" else 5)  # run: the entry fails
    lines = [line for line in result.stderr.strip().splitlines() if "error" in line]
    assert len(lines) == 1 and f"{path}: Flight Recorder dump: not a plain-data pickle" in lines[0]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "pwned").exists()
    assert re.search(r"refuses the global (posix|os)\.system", lines[0])


# --- the same dumps through opguard run, and side by side with torchfrtrace ---------

#: what OpGuard reports for each recorded job: (finding kind, deviating ranks); the
#: skip reads as an order change because gloo timed out at the skipped collective,
#: so no rank's dump goes on past it
OPGUARD_FINDS = {
    "ok": [],
    "order": [("collective_order", [1])],
    "dtype": [("collective_dtype", [1])],
    "size": [("collective_size", [1])],
    "skip": [("collective_order", [1])],
    "group": [("collective_group", [1])],
}


def opguard_findings(opguard: Opguard, scenario: str) -> list[dict[str, Any]]:
    run = opguard("run", "-i", DATA / scenario / "rank_*", "--fail-on-divergence")
    assert run.exit_code == (4 if OPGUARD_FINDS[scenario] else 0), run.stderr
    findings: list[dict[str, Any]] = load_divergence(run.run_dir / "rank_divergence.json")[
        "findings"
    ]
    return [f for f in findings if f["severity"] == "error"]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_opguard_names_the_culprit_of_each_recorded_job(opguard: Opguard, scenario: str) -> None:
    """``opguard run`` on a job's dumps: the first disagreement, its kind, rank 1, the
    position on the default group, and both stacks from the dumps' frames."""
    findings = opguard_findings(opguard, scenario)
    assert [(f["kind"], f["ranks"]) for f in findings] == OPGUARD_FINDS[scenario]
    for finding in findings:
        assert finding["group"]["name"] == "0" and finding["expected_ranks"] == [0, 2]
        assert finding["stack"][-1].startswith("torch.distributed.distributed_c10d:")
        # the culprit's own line, from the dump's frames
        text, index = CULPRIT_LINE[scenario]
        line = job_lines(text)[index]  # the path is where fr_job.py was when recorded
        assert any(
            re.fullmatch(rf"fr_job:step \(/\S+/fr_job\.py:{line}\)", s) for s in finding["stack"]
        )


def test_a_group_whose_members_are_unknown_is_not_said_to_be_empty(opguard: Opguard) -> None:
    """gloo's dumps list no group's members: the message said ``on group 1 (ranks [])
    where the others issue it on group 0 (ranks [])``, two empty groups."""
    (finding,) = opguard_findings(opguard, "group")
    assert (
        "group 1 (members unknown) where the others issue it on group 0 (members unknown)"
        in (finding["message"])
    )
    assert "[]" not in finding["message"]


def patched_for_torchfrtrace(source: Path, target: Path) -> None:
    """Copies of a job's gloo dumps that ``torchfrtrace`` can read: gloo keys its
    ``pg_config`` by ``''`` with no members, and torchfrtrace then fails with
    ``KeyError: ('0', 0)``; each group the entries name is given every rank as members
    (true of these jobs: both groups hold all three ranks). Read without unpickling
    code, written back as plain data."""
    target.mkdir()
    paths = sorted(source.iterdir())
    ranks = str(list(range(len(paths))))
    for path in paths:
        dump = PlainUnpickler(io.BytesIO(path.read_bytes())).load()
        groups = {tuple(entry["process_group"]) for entry in dump["entries"]}
        dump["pg_config"] = {n: {"name": n, "desc": d, "ranks": ranks} for n, d in groups}
        (target / path.name).write_bytes(pickle.dumps(dump, protocol=2))


def torchfrtrace_culprits(dumps: Path) -> tuple[set[int], list[str]]:
    """Run ``python -m torch.distributed.flight_recorder.fr_trace`` on a folder of dumps:
    the ranks it blames (``Culprit rank N``; for ``Not all ranks joining``, the
    minority: the missing ranks, or the ranks that joined when most are missing) and
    its error lines."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace"]
    result = subprocess.run(
        [*command, str(dumps), "-p", "rank_"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout + result.stderr  # its report is logged (to stderr)
    culprits = {int(r) for r in re.findall(r"Culprit rank (\d+);", out)}
    lines = re.findall(r"error msg: (.*)", out)
    for block in out.split("Not all ranks joining collective")[1:]:
        missing = {
            int(r) for r in re.findall(r"\d+", re.findall(r"missing ranks: \{(.*)\}", block)[0])
        }
        expected = {
            int(r) for r in re.findall(r"\d+", re.findall(r"expected ranks: \{(.*)\}", block)[0])
        }
        culprits |= missing if 2 * len(missing) < len(expected) else expected - missing
        lines.append(f"not all ranks joining: missing {sorted(missing)}")
    return culprits, lines


@pytest.mark.slow
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_side_by_side_with_torchfrtrace(opguard: Opguard, tmp_path: Path, scenario: str) -> None:
    """Every mismatch torchfrtrace names on these dumps, OpGuard names with the same
    culprit rank (docs/flight_recorder.md has the table)."""
    pytest.importorskip("torch.distributed.flight_recorder.fr_trace")
    findings = opguard_findings(opguard, scenario)
    assert [(f["kind"], f["ranks"]) for f in findings] == OPGUARD_FINDS[scenario]
    patched_for_torchfrtrace(DATA / scenario, tmp_path / "dumps")
    culprits, lines = torchfrtrace_culprits(tmp_path / "dumps")
    assert bool(lines) == bool(findings), lines
    assert culprits == {rank for f in findings for rank in f["ranks"]}, lines


@pytest.mark.slow
def test_torchfrtrace_fails_on_gloo_dumps_as_recorded(tmp_path: Path) -> None:
    """Why the dumps are patched above: torch 2.13's analyser on gloo's own dumps."""
    import subprocess
    import sys

    pytest.importorskip("torch.distributed.flight_recorder.fr_trace")
    command = [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace"]
    result = subprocess.run(
        [*command, str(DATA / "order"), "-p", "rank_"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if result.returncode == 0:
        pytest.skip("this torch's torchfrtrace reads gloo dumps as they are")
    # ('0', R): the default group's name with the first rank it walks to
    assert re.search(r"KeyError: \('0', \d+\)", result.stderr), result.stderr[-2000:]


def wrapped_dumps(folder: Path) -> Path:
    """The dtype job's dumps as if each rank's ring buffer had wrapped at another point:
    ranks 0, 1, 2 lost their first 2, 1, 3 entries."""
    folder.mkdir()
    for rank, lost in ((0, 2), (1, 1), (2, 3)):
        dump = PlainUnpickler(io.BytesIO((DATA / "dtype" / f"rank_{rank}").read_bytes())).load()
        dump["entries"] = dump["entries"][lost:]
        (folder / f"rank_{rank}").write_bytes(pickle.dumps(dump, protocol=2))
    return folder


def test_ring_buffers_that_wrapped_at_different_points_line_up(
    opguard: Opguard, tmp_path: Path
) -> None:
    """Positions still count from the job's start (``Group.first`` from
    ``collective_seq_id``), so the finding is the one on the whole dumps, and each
    reader warns."""
    folder = wrapped_dumps(tmp_path / "wrapped")
    run = opguard("run", "-i", folder / "rank_*", "--fail-on-divergence")
    assert run.exit_code == 4, run.stderr
    findings = load_divergence(run.run_dir / "rank_divergence.json")["findings"]
    errors = [f for f in findings if f["severity"] == "error"]
    assert [(f["kind"], f["ranks"], f["position"]) for f in errors] == [
        ("collective_dtype", [1], 2)
    ]
    combined = json.loads(run.read("rank_combined.json"))
    firsts = {
        (s["ranks"][0], g["name"]): g.get("first", 0)
        for s in combined["collectives"]["sequences"]
        for g in s["groups"]
    }
    assert firsts == {(0, "0"): 2, (0, "1"): 0, (1, "0"): 1, (1, "1"): 0, (2, "0"): 2, (2, "1"): 1}
    summary = json.loads(run.read("pipeline_summary.json"))
    assert sum("ring buffer wrapped" in w["message"] for w in summary["warnings"]) == 3


@pytest.mark.slow
def test_side_by_side_on_wrapped_ring_buffers(tmp_path: Path) -> None:
    """torchfrtrace pairs by ``collective_seq_id`` too: the same culprit."""
    pytest.importorskip("torch.distributed.flight_recorder.fr_trace")
    patched_for_torchfrtrace(wrapped_dumps(tmp_path / "wrapped"), tmp_path / "dumps")
    culprits, lines = torchfrtrace_culprits(tmp_path / "dumps")
    assert culprits == {1} and "COLLECTIVE_DTYPE_MISMATCH" in lines[0], lines


def test_a_json_dump_after_a_byte_order_mark_reads_as_without(tmp_path: Path) -> None:
    """Detection looked past a UTF-8 BOM, decoding did not ("JSON is malformed")."""
    data = (DATA / "dtype_json" / "rank_0.json").read_bytes()
    assert (
        read_dump(b"\xef\xbb\xbf" + data, tmp_path / "rank_0")[0]
        == read_dump(data, tmp_path / "rank_0")[0]
    )


def test_a_group_named_by_a_unicode_digit_is_ordered_as_a_name(
    opguard: Opguard, tmp_path: Path
) -> None:
    """``"²"`` is a digit to ``str.isdigit`` but not to ``int``: divergence once failed."""
    (tmp_path / "dumps").mkdir()
    for rank in range(3):
        text = (DATA / "dtype_json" / f"rank_{rank}.json").read_text()
        renamed = text.replace('"process_group":["0","default_pg"]', '"process_group":["²","x"]')
        assert renamed != text
        (tmp_path / "dumps" / f"rank_{rank}.json").write_text(renamed)
    run = opguard("run", "-i", tmp_path / "dumps" / "rank_*.json")
    assert run.exit_code == 0, run.stderr[-2000:]
    findings = load_divergence(run.run_dir / "rank_divergence.json")["findings"]
    assert [(f["kind"], f["ranks"], f["group"]["name"]) for f in findings] == [
        ("collective_dtype", [1], "²")
    ]
