"""Issue 30, point 4: the scale of the small things (docs/reliability.md, "Round three",
"Scale of the small things"). Sizes and structure, never times: the times are
benchmarks/small_things.py's."""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from opguard_core.combine.accumulator import mask_to_ranks, ranks_to_mask
from opguard_core.formats.config import (
    _dump_with_ruamel,
    _load_fast,
    _yaml,
    copy_config,
    dump_config,
    load_config,
    split_entry_comments,
)
from opguard_core.formats.tree import (
    TREE_VERSION,
    iter_nodes,
    load_tree,
    ranges_to_ranks,
    ranks_to_ranges,
)
from opguard_core.run.summary import read_summary
from tests import test_fast_yaml as fast_yaml
from tests.conftest import RunResult

Run = Callable[..., RunResult]


def frame(module: str, qualname: str, line: int) -> dict[str, Any]:
    return {"file": f"{module}.py", "line": line, "function": qualname, "qualname": qualname,
            "module": module}  # fmt: skip


def trace(sites: int, offset: int = 0, **meta: Any) -> dict[str, Any]:
    """``sites`` functions ``work{offset+i}`` called from ``main``, two ops each."""
    frames = [frame("app", "main", 1)]
    callsites = []
    for i in range(sites):
        frames.append(frame(f"mod{(offset + i) % 7}", f"work{offset + i}", 10 + i))
        for op, count in (("aten::add", 1), ("aten::mul", 2)):
            callsites.append({"stack": [0, len(frames) - 1], "op": op, "stream": 0,
                              "role": "compute", "count": count})  # fmt: skip
    return {"format": "opguard-callsites", "version": 4, "meta": {"world_size": 1, **meta},
            "frames": frames, "callsites": callsites}  # fmt: skip


def write(path: Path, doc: dict[str, Any]) -> Path:
    path.write_text(json.dumps(doc))
    return path


# ------------------------------------------------------------------ ranks as ranges


@given(st.sets(st.integers(min_value=0, max_value=(1 << 20) - 1), max_size=60))
def test_ranks_to_ranges_round_trip(ranks: set[int]) -> None:
    ordered = sorted(ranks)
    ranges = ranks_to_ranges(ordered)
    assert ranges_to_ranks(ranges) == ordered
    # canonical: runs of three or more are pairs, nothing else is
    for item in ranges:
        if isinstance(item, list):
            assert item[1] - item[0] >= 2


@given(st.lists(st.integers(min_value=0, max_value=300), max_size=80))
def test_rank_masks_round_trip(ranks: list[int]) -> None:
    mask = ranks_to_mask(ranks)
    assert mask == sum(1 << r for r in set(ranks))
    assert mask_to_ranks(mask) == sorted(set(ranks))


def test_a_large_rank_mask_round_trips() -> None:
    assert mask_to_ranks(ranks_to_mask([1048575])) == [1048575]
    assert mask_to_ranks(ranks_to_mask([0, 7, 8, 1048575])) == [0, 7, 8, 1048575]
    with pytest.raises(ValueError):
        ranks_to_mask([3, -1])


@pytest.mark.parametrize(
    "bad", [[[3, 1]], [5, 5], [[0, 4], 3], ["0-3"], [[1, 2, 3]], [True], 7]
)  # fmt: skip
def test_bad_ranges_are_refused(tmp_path: Path, bad: Any) -> None:
    from opguard_core.errors import InputError

    tree = {"format": "opguard-calltree", "version": TREE_VERSION, "meta": {"ranks": [0]},
            "root": {"name": "<root>", "count": 1, "self_ops": {}, "self_streams": {},
                     "self_dtypes": {},
                     "children": [{"module": "m", "qualname": "f", "file": "m.py",
                                   "lines": [1], "kind": "function", "count": 1,
                                   "self_ops": {"aten::add": 1},
                                   "self_streams": {"compute": 1},
                                   "self_dtypes": {"float32": 1}, "ranks": bad,
                                   "chain": [], "children": []}]}}  # fmt: skip
    path = write(tmp_path / "x_compressed.json", tree)
    with pytest.raises(InputError, match="ranks"):
        load_tree(path)


def _compressed(run: RunResult, name: str) -> Path:
    assert run.run_dir is not None
    return run.run_dir / f"{name}_compressed.json"


def test_a_100k_rank_trace_writes_a_small_tree(tmp_path: Path, opguard: Run) -> None:
    """Every node of a 100,000-rank trace lists its ranks as one range: the tree is
    the size of a one-rank tree (before: 30 MB for 20 callsites, one rank a line)."""
    wide = write(tmp_path / "wide.json", trace(20, ranks=list(range(100_000))))
    one = write(tmp_path / "one.json", trace(20, rank=0))
    run_wide = opguard("run", "-i", wide, "--skip", "divergence", expect=0)
    run_one = opguard("run", "-i", one, "--skip", "divergence", expect=0)
    size_wide = _compressed(run_wide, "wide").stat().st_size
    size_one = _compressed(run_one, "one").stat().st_size
    assert size_wide < 2 * size_one
    raw = json.loads(_compressed(run_wide, "wide").read_text())
    assert raw["version"] == TREE_VERSION
    assert raw["meta"]["ranks"] == [[0, 99_999]]
    nodes = [n for n, _ in iter_nodes(raw["root"])][1:]
    assert nodes and all(n["ranks"] == [[0, 99_999]] for n in nodes)
    tree = load_tree(_compressed(run_wide, "wide"))  # read back: lists in memory
    assert tree["meta"]["ranks"] == list(range(100_000))


def test_rank_1048575_writes_what_rank_0_writes(tmp_path: Path, opguard: Run) -> None:
    high = write(tmp_path / "job_rank1048575.json", trace(20))
    low = write(tmp_path / "low_rank0.json", trace(20))
    run_high = opguard("run", "-i", high, expect=0)
    run_low = opguard("run", "-i", low, expect=0)
    raw = json.loads(_compressed(run_high, "job").read_text())
    assert raw["meta"]["ranks"] == [1048575]
    assert all(n["ranks"] == [1048575] for n, _ in iter_nodes(raw["root"])[1:])
    size_high = _compressed(run_high, "job").stat().st_size
    size_low = _compressed(run_low, "low").stat().st_size
    assert abs(size_high - size_low) < 1000  # the same tree, a wider number


def test_a_version_3_tree_still_reads(tmp_path: Path) -> None:
    leaf = {"module": "m", "qualname": "f", "file": "m.py", "lines": [1], "kind": "function",
            "count": 3, "self_ops": {"aten::add": 3}, "self_streams": {"compute": 3},
            "ranks": [0, 1, 2, 3], "chain": [], "children": []}  # fmt: skip
    tree = {"format": "opguard-calltree", "version": 3, "meta": {"ranks": [0, 1, 2, 3]},
            "root": {"name": "<root>", "count": 3, "self_ops": {}, "self_streams": {},
                     "children": [leaf]}}  # fmt: skip
    loaded = load_tree(write(tmp_path / "old_compressed.json", tree))
    assert loaded["version"] == TREE_VERSION
    assert loaded["root"]["children"][0]["ranks"] == [0, 1, 2, 3]
    assert loaded["meta"]["ranks"] == [0, 1, 2, 3]


# ------------------------------------------------------------------ merge


def test_merge_command_and_run_merge_write_the_same_config(tmp_path: Path, opguard: Run) -> None:
    left = write(tmp_path / "left.json", trace(60, offset=0, rank=0))
    right = write(tmp_path / "right.json", trace(60, offset=30, rank=1))
    run = opguard("run", "-i", left, "-i", right, "--min-fraction", "0", expect=0)
    assert run.run_dir is not None
    configs = [run.run_dir / f"{n}_instrumentation.yaml" for n in ("left", "right")]
    out = tmp_path / "merged.yaml"
    opguard("merge", *configs, "-o", out, expect=0)
    assert out.read_bytes() == (run.run_dir / "final_combined_instrumentation.yaml").read_bytes()
    assert len(load_config(out)["entries"]) == 91  # work0..work89 and main


def test_copying_a_loaded_config_keeps_every_byte(tmp_path: Path) -> None:
    """The merge's linear copy writes what ``copy.deepcopy`` (quadratic on a loaded
    config) writes, comments and flow styles included, and shares nothing."""
    source = Path(__file__).parent / "data" / "configs" / "gpt_callsite_v1.yaml"
    config = load_config(source)
    copied = copy_config(config)
    assert dump_config(copied) == dump_config(copy.deepcopy(config)) == dump_config(config)
    copied["entries"][0]["ops"]["aten::new"] = 1
    copied["entries"][0]["lines"].append(999)
    assert "aten::new" not in config["entries"][0]["ops"]
    assert 999 not in config["entries"][0]["lines"]


# ------------------------------------------------------------------ many inputs


def test_many_inputs_get_distinct_names_and_one_record_each(tmp_path: Path, opguard: Run) -> None:
    """60 inputs whose names clash after making them file-safe (``a b`` and ``a_b``):
    every entry named once, each name's artifacts its own."""
    folder = tmp_path / "in"
    folder.mkdir()
    for i in range(30):
        write(folder / f"job {i}.json", trace(1, offset=i % 3, rank=0))
        write(folder / f"job_{i}.json", trace(1, offset=i % 3, rank=0))
    run = opguard("run", "-i", str(folder / "*.json"), "--skip", "compare", expect=0)
    assert run.run_dir is not None
    summary = read_summary(run.run_dir)
    names = [e["name"] for e in summary["entries"]]
    assert len(names) == len(set(names)) == 60
    generated = [s for s in summary["stages"] if s["stage"] == "generate"]
    assert sorted(s["entry"] for s in generated) == sorted(names)
    assert summary["status"] == "ok"


# ------------------------------------------------------------------ bad symlinks


def test_a_symlink_loop_in_a_glob_fails_its_entry_only(tmp_path: Path, opguard: Run) -> None:
    folder = tmp_path / "in"
    folder.mkdir()
    write(folder / "good_rank0.json", trace(3, rank=0))
    write(folder / "good_rank1.json", trace(3, rank=1))
    os.symlink("loop_rank0.json", folder / "loop_rank0.json")  # points at itself
    os.symlink("b.json", folder / "a.json")
    os.symlink("a.json", folder / "b.json")
    os.symlink("missing.json", folder / "dangling_rank0.json")
    run = opguard("run", "-i", str(folder / "*.json"), expect=1)  # 1: partial failure
    assert run.run_dir is not None
    summary = read_summary(run.run_dir)
    assert [e["name"] for e in summary["entries"]] == ["good"]
    refused = {s["error"] for s in summary["stages"] if s["status"] == "failed"}
    assert all(s["stage"] == "discover" for s in summary["stages"] if s["status"] == "failed")
    assert {e.split(": ", 1)[0].rsplit("/", 1)[-1] for e in refused} == {
        "loop_rank0.json",
        "a.json",
        "b.json",
        "dangling_rank0.json",
    }
    assert any("symbolic link loop" in e for e in refused)
    assert any("dangling symbolic link" in e for e in refused)
    assert (run.run_dir / "good_compressed.json").exists()
    assert (run.run_dir / "final_combined_instrumentation.yaml").exists() or (
        run.run_dir / "good_instrumentation.yaml"
    ).exists()
    assert "Too many levels" not in run.stderr and "Traceback" not in run.stderr


def test_a_named_symlink_loop_is_one_line(tmp_path: Path, opguard: Run) -> None:
    os.symlink("self.json", tmp_path / "self.json")
    run = opguard("run", "-i", tmp_path / "self.json")
    assert run.exit_code != 0
    assert "self.json: a symbolic link loop" in run.stderr
    assert "Traceback" not in run.stderr


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fast_yaml.configs(fast_yaml.strings))
def test_the_fast_reader_reads_what_ruamel_reads(config: Any) -> None:
    """Adversarial strings (``yes``, ``0x1F``, ``a: b``, ``'``, line separators, ...):
    whenever the fast reader's result is taken, it is the document ruamel reads,
    styles included; otherwise ruamel reads the text."""
    text = _dump_with_ruamel(config)
    stripped, _ = split_entry_comments(text)
    fast = _load_fast(stripped)
    slow = _yaml().load(stripped)
    if fast is not None:
        assert fast_yaml.plain(fast) == fast_yaml.plain(slow)
        assert _dump_with_ruamel(fast) == _dump_with_ruamel(slow) == stripped


def test_a_written_config_takes_the_fast_reader(tmp_path: Path, opguard: Run) -> None:
    """What the run writes is read back by the fast reader (not ruamel's loader)."""
    run = opguard("run", "-i", write(tmp_path / "x.json", trace(5, rank=0)), expect=0)
    assert run.run_dir is not None
    text = (run.run_dir / "x_instrumentation.yaml").read_text()
    stripped, _ = split_entry_comments(text)
    fast = _load_fast(stripped)
    assert fast is not None
    assert fast_yaml.plain(fast) == fast_yaml.plain(_yaml().load(stripped))


def test_paced_summary_writes_still_end_complete(
    tmp_path: Path, opguard: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    """However far apart the summary writes are paced, the final write lists every
    stage record (the pace only skips intermediate rewrites)."""
    from opguard_core.files import atomic

    monkeypatch.setattr("opguard_core.run.summary.SummaryPace.PACE", 10**9)
    writes: list[str] = []
    original = atomic.atomic_write_bytes

    def counting(path: Path, data: bytes, *args: Any, **kwargs: Any) -> Any:
        if Path(path).name == "pipeline_summary.json":
            writes.append(json.loads(data)["status"])
        return original(path, data, *args, **kwargs)

    monkeypatch.setattr("opguard_core.run.runner.atomic_write_bytes", counting)
    inputs = [write(tmp_path / f"in{i}.json", trace(2, offset=i, rank=0)) for i in range(3)]
    run = opguard("run", *[a for p in inputs for a in ("-i", p)], expect=0)
    assert run.run_dir is not None
    assert writes == ["running", "ok"]  # the first stage's, then the final one
    summary = read_summary(run.run_dir)
    assert [s["stage"] for s in summary["stages"]].count("generate") == 3
    assert summary["status"] == "ok"
