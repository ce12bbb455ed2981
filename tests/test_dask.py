"""The optional Dask executor: same bytes as the local executor, clear errors."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from opguard_core.combine.accumulator import TraceAccumulator
from opguard_core.model import RunOptions
from opguard_plugins.stages import dask_executor
from opguard_plugins.stages.combine import combine_files
from tests.builders import trace_doc, write
from tests.conftest import RunResult

pytestmark = pytest.mark.dask

ENTRIES = ("fsdp_callsite", "gpt_callsite")


@pytest.fixture(scope="module")
def scheduler() -> Iterator[str]:
    """A small in-process Dask cluster (threads, no worker processes: quick to start)."""
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(
        n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None
    ) as cluster:
        yield cluster.scheduler_address


def _inputs(samples: Path) -> list[str]:
    return ["--input", *(str(samples / f"{e}_rank*.json") for e in ENTRIES)]


def _summary(run: RunResult) -> dict[str, Any]:
    summary: dict[str, Any] = json.loads(run.read("pipeline_summary.json"))
    return summary


@pytest.mark.slow  # > 4 s: the slow group
def test_dask_gives_the_same_bytes_as_local(
    opguard: Callable[..., RunResult],
    samples: Path,
    scheduler: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    local = opguard("run", *_inputs(samples), "--jobs", "1", expect=0)
    monkeypatch.setenv(dask_executor.SCHEDULER_ENV, scheduler)
    dask = opguard("run", *_inputs(samples), "--executor", "dask", expect=0)
    for entry in ENTRIES:
        name = f"{entry}_combined.json"
        assert dask.read(name) == local.read(name)
        name = f"{entry}_instrumentation.yaml"
        assert dask.read(name) == local.read(name)
    combines = [s for s in _summary(dask)["stages"] if s["stage"] == "combine"]
    assert [s["plugin"] for s in combines] == ["dask_executor"] * len(ENTRIES)


def test_per_rank_statistics_are_the_same_on_pool_and_dask(
    opguard: Callable[..., RunResult],
    tmp_path: Path,
    scheduler: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The divergent job and a 3-rank job whose ranks ran one callsite 1, 2 and 3
    times: sequential, the pool and Dask give the same combined statistics and
    findings."""
    divergent = Path(__file__).parent / "data" / "divergent" / "divergent_callsite_rank*.json"
    for rank in range(3):
        sites = [([("app", "main"), ("app", "step")], None, "aten::mm", rank + 1)]
        write(tmp_path / f"skewed_rank{rank}.json", trace_doc(sites, rank=rank))
    inputs = ["-i", str(divergent), "-i", str(tmp_path / "skewed_rank*.json")]
    local = opguard("run", *inputs, "--jobs", "1", expect=0)
    pool = opguard("run", *inputs, "--jobs", "2", expect=0)
    monkeypatch.setenv(dask_executor.SCHEDULER_ENV, scheduler)
    dask = opguard("run", *inputs, "--executor", "dask", expect=0)
    assert b'"per_rank":' in (local.run_dir / "skewed_combined.json").read_bytes()
    for entry in ("divergent_callsite", "skewed"):
        for suffix in ("_combined.json", "_divergence.json", "_divergence.log"):
            assert pool.read(entry + suffix) == local.read(entry + suffix), entry + suffix
            assert dask.read(entry + suffix) == local.read(entry + suffix), entry + suffix


def test_dask_reports_a_bad_rank_file_by_name(
    opguard: Callable[..., RunResult],
    samples: Path,
    scheduler: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bad = samples / "gpt_callsite_rank1.json"
    bad.chmod(0o644)
    bad.write_text('{"format": "opguard-callsites", "version": 1, "frames": [], "callsites": [')
    monkeypatch.setenv(dask_executor.SCHEDULER_ENV, scheduler)
    run = opguard("run", *_inputs(samples), "--executor", "dask", expect=1)
    failed = [s for s in _summary(run)["stages"] if s["status"] == "failed"]
    assert [s["stage"] for s in failed] == ["combine"]
    assert "gpt_callsite_rank1.json" in failed[0]["error"]
    assert "not valid JSON" in failed[0]["error"]


def test_dask_names_the_first_bad_file_in_input_order(
    tmp_path: Path, scheduler: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ranks 3 and 4 of 8 are bad: Dask names rank 3, as one process reading the files
    in order does, though rank 4's chunk fails first (its first file; rank 3 comes
    after three large files in the first chunk). It named whichever error arrived
    first."""
    from opguard_core.errors import InputError
    from opguard_core.model import InputEntry

    paths = []
    for rank in range(8):
        sites = [([("app", "main"), ("app", f"f{i}")], None, "aten::mm", 0 if rank in (3, 4) else 2)
                 for i in range(3000 if rank < 3 else 1)]  # fmt: skip
        paths.append(tmp_path / f"x_rank{rank}.json")
        paths[-1].write_text(json.dumps(trace_doc(sites, rank=rank)))
    with pytest.raises(InputError) as in_order:
        combine_files(paths)
    assert in_order.value.path == str(paths[3])
    monkeypatch.setenv(dask_executor.SCHEDULER_ENV, scheduler)
    entry = InputEntry(name="x", files=tuple(paths), index=1)
    for _ in range(3):
        with pytest.raises(InputError) as on_dask:
            dask_executor.combine_on_dask(entry, RunOptions(executor="dask"))
        assert str(on_dask.value) == str(in_order.value)


@pytest.mark.slow  # starts worker processes: about 3 s
def test_a_bad_rank_file_is_not_also_a_worker_s_log_block(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """The LocalCluster opguard starts logged a multi-line "Compute Failed" block (not
    JSON) on stderr beside the run's one line."""
    pytest.importorskip("distributed")
    from opguard_core.errors import InputError
    from opguard_core.model import InputEntry

    bad = tmp_path / "x_rank0.json"
    bad.write_text('{"format": "opguard-callsites", "version": 1, "frames": [], "callsites": [')
    entry = InputEntry(name="x", files=(bad,), index=1)
    options = RunOptions(executor="dask", jobs=2)  # worker processes, as users get
    with pytest.raises(InputError, match="not valid JSON"):
        dask_executor.combine_on_dask(entry, options)
    assert "Compute Failed" not in capfd.readouterr().err


def test_warnings_made_on_workers_reach_the_summary(
    opguard: Callable[..., RunResult],
    tmp_path: Path,
    scheduler: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A run warning made reading a file on a worker (a Kineto file's cut profiling
    window) is the summary's, as with the local executor: eight kept, one logged."""
    kineto = Path(__file__).parent / "data" / "kineto"
    for rank in range(8):
        shutil.copy(kineto / f"dlrm_rank{rank}.pt.trace.json.gz", tmp_path / f"rank{rank}.json.gz")
    monkeypatch.setenv(dask_executor.SCHEDULER_ENV, scheduler)
    run = opguard("run", "-i", tmp_path / "rank*.json.gz", "--executor", "dask", expect=0)
    cuts = [w for w in _summary(run)["warnings"] if "profiling window cut" in w["message"]]
    assert [Path(w["file"]).name for w in cuts] == [f"rank{r}.json.gz" for r in range(8)]
    assert sum("profiling window cut" in line for line in run.stderr.splitlines()) == 1


def test_tree_reduce_of_partials_equals_one_accumulator(samples: Path) -> None:
    files = sorted(samples.glob("*_rank*.json"))
    whole = combine_files(files).result()
    parts = [combine_files([f]) for f in files]
    merged = dask_executor.merge_partials(
        dask_executor.merge_partials(parts[3], parts[0]),
        dask_executor.merge_partials(parts[1], parts[2]),
    )
    assert merged.result().to_json() == whole.to_json()


def test_chunks_cover_every_file_once() -> None:
    files = [Path(f"x_rank{r}.json") for r in range(11)]
    chunks = dask_executor.chunk_files(files, workers=2)
    assert [p for chunk in chunks for p in chunk] == [str(f) for f in files]
    assert len(chunks) >= 2
    assert max(len(c) for c in chunks) <= dask_executor.FILES_PER_TASK


def test_other_executors_are_left_alone() -> None:
    entry: Any = object()
    assert dask_executor.opguard_combine(entry=entry, options=RunOptions(), readers=None) is None


def test_without_dask_the_error_is_one_clear_line(
    opguard: Callable[..., RunResult], samples: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # neither importable, as in a venv without the extra (whether or not this one has it)
    monkeypatch.setitem(sys.modules, "dask", None)
    monkeypatch.setitem(sys.modules, "distributed", None)
    monkeypatch.delenv(dask_executor.SCHEDULER_ENV, raising=False)
    run = opguard("run", "--input", str(samples / "gpt_callsite_rank*.json"),
                  "--executor", "dask", expect=2)  # fmt: skip
    # refused before the run starts (issue 10 point 9): a usage error naming the value
    assert run.run_dir is None
    assert "'dask': executor is not installed (missing dask, distributed)" in run.stderr
    assert "pip install 'opguard[dask]'" in run.stderr
    assert "Traceback" not in run.stderr


def test_partials_pickle_with_conflicting_meta(samples: Path) -> None:
    """Meta keys the ranks disagree on (last_loss) stay dropped after a round trip."""
    import pickle

    files = sorted(samples.glob("gpt_callsite_rank*.json"))
    parts = [pickle.loads(pickle.dumps(combine_files([f]))) for f in files]
    total = TraceAccumulator()
    for part in parts:
        total.update(part)
    assert total.result().to_json() == combine_files(files).result().to_json()
    assert "last_loss" not in total.result().meta
