"""Stream roles (formats.md, "Streams and roles"): the rule, old files, tracer and guard.

The tracer and the guard are tested on CPU with CUDA streams simulated: ``torch.cuda``
reports itself initialised and its ``current_stream`` is the id the test sets, which
is all either reads on a GPU (the ops still run on CPU).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from opguard_core.combine.accumulator import TraceAccumulator
from opguard_core.formats.config import CONFIG_VERSION, load_config, parse_config
from opguard_core.formats.streams import (
    StreamRoles,
    is_role,
    legacy_roles,
    legacy_side_roles,
    legacy_stream_counts,
    role_order,
)
from opguard_core.formats.trace import TRACE_VERSION, load_trace
from opguard_core.formats.tree import load_tree
from tests.builders import trace_doc, write

MAIN = ("train", "main")


def test_roles_by_first_use() -> None:
    roles = StreamRoles()
    assert [roles.see(s) for s in (0, 9, 4, 9)] == [0, 9, 4, 9]
    assert roles.role(0, "aten::mm") == "compute"
    assert roles.role(4, "aten::mm") == "side2"  # 9 was seen first
    assert roles.role(9, "aten::mm") == "side1"
    assert roles.role(9, "c10d::allreduce_") == "comm"  # whichever stream called it
    assert roles.role(0, "_c10d_functional::all_reduce") == "comm"
    assert roles.role(12, "aten::add") == "side3"  # first seen now
    assert all(is_role(r) for r in ("compute", "comm", "comm2", "side1", "side10"))
    assert not any(is_role(r) for r in ("", "side0", "comm1", "stream7", "Compute", 7))
    assert sorted(["side2", "comm", "side10", "compute", "comm2"], key=role_order) == [
        "compute", "comm", "comm2", "side2", "side10",
    ]  # fmt: skip


def test_files_before_roles_get_them_by_rule() -> None:
    """Versions 1 and 2: a collective is comm, stream 0 compute, others sideN ascending."""
    pairs = [("aten::mm", 0), ("aten::mm", 7), ("aten::add", 3), ("c10d::allreduce_", 0)]
    assert legacy_roles(pairs) == {
        ("aten::mm", 0): "compute",
        ("aten::mm", 7): "side2",
        ("aten::add", 3): "side1",
        ("c10d::allreduce_", 0): "comm",
    }


@given(
    st.dictionaries(st.sampled_from([0, 3, 7]), st.integers(0, 50)),
    st.dictionaries(
        st.sampled_from(["aten::mm", "c10d::allreduce_", "c10d::broadcast_"]), st.integers(0, 50)
    ),
)
def test_old_counts_by_stream_become_counts_by_role(
    streams: dict[int, int], ops: dict[str, int]
) -> None:
    """The total is kept; ``comm`` gets the collectives (as far as the counts go)."""
    sides = legacy_side_roles([0, 3, 7])
    roles = legacy_stream_counts(streams, ops, sides)
    assert sum(roles.values()) == sum(streams.values())
    collectives = sum(c for op, c in ops.items() if op.startswith("c10d::"))
    assert roles.get("comm", 0) == min(collectives, sum(streams.values()))
    assert all(is_role(r) and n > 0 for r, n in roles.items())
    assert list(roles) == sorted(roles, key=role_order)


def test_a_version_2_config_reads_with_roles(tmp_path: Path) -> None:
    text = (
        "version: 2\nsource: s\nmeta:\n  ranks: [0]\n  total: 10\nentries:\n"
        "  - target: a:f\n    ops:\n      aten::mm: 6\n      c10d::allreduce_: 2\n"
        "    stream_counts:\n      0: 5\n      7: 3\n    count: 8\n"
        "  - target: a:g\n    ops:\n      aten::add: 2\n    stream_counts:\n      3: 2\n"
        "    count: 2\n"
    )
    config = parse_config(text, "old.yaml")
    assert config["version"] == CONFIG_VERSION == 6
    assert dict(config["entries"][0]["stream_counts"]) == {"compute": 3, "comm": 2, "side2": 3}
    assert dict(config["entries"][1]["stream_counts"]) == {"side1": 2}
    with pytest.raises(Exception, match="stream roles"):
        parse_config(text.replace("version: 2", "version: 3"), "new.yaml")


def test_the_bundled_version_1_config_reads_with_roles() -> None:
    config = load_config(Path(__file__).parent / "data" / "configs" / "gpt_callsite_v1.yaml")
    assert config["version"] == CONFIG_VERSION == 6
    for entry in config["entries"]:
        assert set(entry.get("stream_counts") or {}) <= {"compute", "comm"}


def test_a_version_1_tree_reads_with_roles(tmp_path: Path) -> None:
    own = {"self_ops": {"aten::mm": 3, "c10d::allreduce_": 2}, "self_streams": {"0": 4, "7": 1}}
    leaf = {"module": "m", "qualname": "f", "file": "m.py", "lines": [1], "kind": "function",
            "count": 5, **own, "ranks": [0], "chain": [], "children": []}  # fmt: skip
    tree = {"format": "opguard-calltree", "version": 1, "meta": {"ranks": [0]},
            "root": {"name": "<root>", "count": 5, "self_ops": {}, "self_streams": {},
                     "children": [leaf]}}  # fmt: skip
    path = tmp_path / "old_compressed.json"
    path.write_text(json.dumps(tree))
    loaded = load_tree(path)
    assert loaded["version"] == 6  # upgraded to the version in memory (TREE_VERSION)
    assert loaded["root"]["children"][0]["self_streams"] == {"compute": 2, "comm": 2, "side1": 1}
    assert loaded["root"]["children"][0]["self_dtypes"] == {} and loaded["meta"]["dtypes"] is False


@pytest.mark.parametrize("scanned", [True, False])
def test_a_version_1_trace_combines_by_role(tmp_path: Path, scanned: bool) -> None:
    """A collective an old tracer recorded on two streams (the callers') is one comm
    callsite, not a callsite twice in one file (which would drop the statistics)."""
    sites = [([MAIN], None, "aten::mm", 4), ([MAIN], None, "c10d::allreduce_", 1),
             ([MAIN], None, "c10d::allreduce_", 2)]  # fmt: skip
    accumulator = TraceAccumulator()
    for rank in (0, 1):
        doc = trace_doc(sites, rank=rank)
        doc["callsites"][2]["stream"] = 7
        path = write(tmp_path / f"t_rank{rank}.json", doc)
        if scanned:
            accumulator.add_file(path)  # the C scanner where built
        else:
            accumulator.add(load_trace(path))  # msgspec's path
    combined = json.loads(accumulator.result().to_json())
    assert combined["version"] == TRACE_VERSION and combined["meta"]["per_rank_stats"] is True
    assert [(s["op"], s["role"], s["count"], "stream" in s) for s in combined["callsites"]] == [
        ("aten::mm", "compute", 8, False),
        ("c10d::allreduce_", "comm", 6, False),
    ]


# --- the tracer and the guard, with CUDA streams simulated (needs torch) -------------

PROGRAM = """
import torch
import torch.distributed as dist


def prep(x):
    return x + 1


def side(x):
    return x * 2


def reduce(x):
    dist.all_reduce(x)
    return x


def run(streams, moved=False):
    x = prep(torch.ones(4))
    with streams.on(5):  # a side stream
        y = side(x)
        if moved:
            y = prep(y)  # prep's op now runs on the side stream
    with streams.on(3):  # a collective issued from another stream: comm all the same
        reduce(y)
    return y
"""


class SimulatedStreams:
    """``torch.cuda`` as the tracer and the guard read it, with the current stream id
    set by :meth:`on`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, torch: Any) -> None:
        self.current = 0
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(
            torch.cuda,
            "current_stream",
            lambda device=None: types.SimpleNamespace(stream_id=self.current),
        )

    @contextlib.contextmanager
    def on(self, stream: int) -> Iterator[None]:
        before, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = before


@pytest.fixture
def program(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The program module (``smod``), a one-rank gloo group, and simulated streams."""
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    folder = tmp_path / "src"
    folder.mkdir()
    (folder / "smod.py").write_text(PROGRAM)
    monkeypatch.syspath_prepend(str(folder))
    sys.modules.pop("smod", None)
    module: Any = importlib.import_module("smod")
    module.streams = SimulatedStreams(monkeypatch, torch)
    try:
        yield module
    finally:
        sys.modules.pop("smod", None)
        dist.destroy_process_group()


@pytest.mark.torch
def test_tracer_and_guard_use_roles(program: Any, tmp_path: Path) -> None:
    """The tracer writes raw ids and roles (a collective on comm, whichever stream
    called it); a config made from it checks the same program clean, and catches an op
    moved to a side stream, offline (``opguard check``) and at run time (the guard).
    (Imports here: they need torch, which the fixture skips without.)"""
    from opguard_core.formats.trace import load_trace
    from opguard_plugins.enforce.runtime import guarded
    from opguard_plugins.tracer import trace_callsites
    from tests.test_guard import errors_of, invoke, make_config, report_of

    for label, moved in (("base", False), ("moved", True)):
        with trace_callsites(label=label, output_dir=tmp_path / "traces", rank=0):
            program.run(program.streams, moved=moved)
    trace = load_trace(tmp_path / "traces" / "base_callsite_rank0.json")
    placed = {(s.op, s.stream, s.role) for s in trace.callsites}
    assert {("aten::add", 0, "compute"), ("aten::mul", 5, "side1"),
            ("c10d::allreduce_", 3, "comm")} <= placed  # fmt: skip
    assert trace.meta["streams"] == {"0": "compute", "5": "side1"}
    assert trace.meta["device"] == "cuda"

    config = make_config(tmp_path, str(tmp_path / "traces" / "base_callsite_rank0.json"))
    text = config.read_text()
    assert "comm: 1" in text and "side1: 1" in text
    same = invoke(
        "check", "--config", config, "-i", tmp_path / "traces" / "base_callsite_rank0.json"
    )
    assert same.exit_code == 0, same.stdout
    traces = tmp_path / "traces"
    moved = invoke("check", "--config", config, "-i", traces / "moved_callsite_rank0.json",
                   "--format", "json")  # fmt: skip
    assert moved.exit_code == 1
    found = {
        (v["kind"], v["target"], v.get("stream")) for v in json.loads(moved.stdout)["violations"]
    }
    assert ("unexpected_stream", "smod:prep", "side1") in found

    with guarded(config, report_dir=tmp_path / "clean", rank=0) as guard:
        program.run(program.streams)
    assert errors_of(report_of(guard)) == []
    with guarded(config, report_dir=tmp_path / "caught", rank=0) as guard:
        program.run(program.streams, moved=True)
    errors = {(v["kind"], v["target"], v.get("stream")) for v in errors_of(report_of(guard))}
    # one view: the guard finds at run time what check finds in the trace (the
    # function and the public call, torch:Tensor.add, that ran on the side stream)
    assert ("unexpected_stream", "smod:prep", "side1") in errors
    assert errors == {f for f in found if f[0] == "unexpected_stream"}
