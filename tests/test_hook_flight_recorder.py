"""The built-in ``flight_recorder`` reader as an ``opguard_read_trace`` plugin.

It is registered through the ``opguard`` entry-point group like every built-in,
listed by ``opguard plugins --all``, can be turned off with ``--disable-plugin``,
and makes ``run`` (a glob of dumps is one entry), ``export`` and worker processes
read Flight Recorder dumps (``tests/data/flight_recorder``, README.md there).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from opguard_core.formats.readers import Readers
from opguard_core.plugin.manager import create_plugin_manager
from opguard_plugins.stages.combine import combine_parallel
from tests.conftest import RunResult

DATA = Path(__file__).parent / "data" / "flight_recorder"

Opguard = Callable[..., RunResult]


def test_hook_read_trace_flight_recorder_entry_point() -> None:
    (point,) = [p for p in entry_points(group="opguard") if p.name == "flight_recorder"]
    assert point.value == "opguard_plugins.readers.flight_recorder"
    manager = create_plugin_manager()
    names = [impl.plugin_name for impl in manager.implementations("opguard_read_trace")]
    assert "flight_recorder" in names and "kineto" in names


def test_hook_read_trace_flight_recorder_reads_a_dump() -> None:
    """Through the hook: a dump is a trace of its rank with its collective sequence;
    a callsite trace and a Kineto trace are not taken."""
    path = DATA / "skip" / "rank_1"
    trace = Readers().read(path, path.read_bytes())
    assert trace is not None and trace.ranks() == [1]
    assert trace.meta["source_format"] == "flight_recorder"
    assert trace.collectives is not None
    (sequence,) = trace.collectives.sequences
    ops = [sequence.signatures[call].op for _, call in sequence.calls()]
    assert ops == ["c10d::allreduce_", "c10d::broadcast_", "c10d::allreduce_", "c10d::broadcast_"]
    manager = create_plugin_manager()
    from opguard_core.plugin.manager import call_impl

    (impl,) = [
        i
        for i in manager.implementations("opguard_read_trace")
        if i.plugin_name == "flight_recorder"
    ]
    samples = Path(__file__).parent / "data" / "samples" / "gpt_callsite_rank0.json"
    for other in (samples, Path(__file__).parent / "data" / "kineto" / "hta_backward_thread.json"):
        assert call_impl(impl, {"path": other, "data": other.read_bytes()}) is None


def test_plugins_lists_the_reader(opguard: Opguard) -> None:
    result = opguard("plugins", "--all")
    assert result.exit_code == 0
    (line,) = [
        line for line in result.result.stdout.splitlines() if line.startswith("flight_recorder")
    ]
    assert "opguard_read_trace" in line


def test_disabled_reader_leaves_dumps_unread(opguard: Opguard, tmp_path: Path) -> None:
    out = tmp_path / "x.folded"
    path = DATA / "ok" / "rank_0"
    result = opguard(
        "--disable-plugin", "flight_recorder", "export", path, "--format", "collapsed", "-o", out
    )
    assert result.exit_code == 5 and not out.exists()
    assert result.stderr.strip().startswith(f"opguard: error: {path}:")
    assert opguard("export", path, "--format", "collapsed", "-o", out).exit_code == 0
    lines = out.read_text().splitlines()
    assert sum(int(line.rsplit(" ", 1)[1]) for line in lines) == 6
    assert any(line.endswith(";c10d::broadcast_ 2") for line in lines)


def test_a_glob_of_dumps_is_one_entry(opguard: Opguard, tmp_path: Path) -> None:
    """``rank_*`` (no ``_rankN`` in the names): one entry whose ranks come from the
    dumps' names, with each rank's sequence carried into the combined trace."""
    shutil.copytree(DATA / "dtype", tmp_path / "dumps")
    run = opguard("run", "-i", tmp_path / "dumps" / "rank_*")
    summary = json.loads(run.read("pipeline_summary.json"))
    assert [e["name"] for e in summary["entries"]] == ["rank"]
    combined = json.loads(run.read("rank_combined.json"))
    assert combined["meta"]["ranks"] == [0, 1, 2]
    assert combined["meta"]["source_format"] == "flight_recorder"
    sequences = combined["collectives"]["sequences"]
    assert sorted(s["ranks"] for s in sequences) == [[0, 2], [1]]


def test_dumps_named_prefix_dot_rank_are_one_entry(opguard: Opguard, tmp_path: Path) -> None:
    """torch writes ``<prefix><rank>`` with any prefix: ``dump.0``, ``dump.1``, ... (the
    rank after a dot once read as a suffix, and the dumps were refused)."""
    (tmp_path / "dumps").mkdir()
    for rank in range(3):
        shutil.copy(DATA / "dtype" / f"rank_{rank}", tmp_path / "dumps" / f"dump.{rank}")
    run = opguard("run", "-i", tmp_path / "dumps" / "dump.*")
    assert run.exit_code == 0, run.stderr[-2000:]
    combined = json.loads(run.read("dump_combined.json"))
    assert combined["meta"]["ranks"] == [0, 1, 2]


@pytest.mark.slow
def test_readers_in_worker_processes_read_dumps() -> None:
    """The built-in reader is found by a spawned worker's plugin manager too."""
    paths = [DATA / "order" / f"rank_{r}" for r in range(3)]
    total = combine_parallel(paths, jobs=2, readers=Readers()).result()
    assert total.ranks == [0, 1, 2]
