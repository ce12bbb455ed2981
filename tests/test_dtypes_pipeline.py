"""Op dtypes through combine and compress (formats.md, "Dtypes"; issue 29, point 5).

A callsite's identity is (stack, api, op, role, dtype): one stack that ran ``aten::mm``
in float32 and in float64 is two callsites of the combined trace, written with
``dtype`` after ``role`` (none where the op had no dtype, and those first); the
compressed tree (version 5) counts every node's own ops by dtype (``self_dtypes``) and
says in ``meta.dtypes`` whether the input recorded any. The C scanner, fold, merge and
runs and their Python references give the same bytes; a version-6 trace still
combines (no dtypes, ``meta.dtypes`` false); a dtype that is not a name is refused in
one line naming the file.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from opguard_core.combine import accumulator as combined
from opguard_core.combine.accumulator import TraceAccumulator
from opguard_core.combine.stack_table import PyStackTable, py_site_order
from opguard_core.errors import InputError, InvariantError
from opguard_core.formats.dtypes import is_dtype
from opguard_core.formats.trace import TRACE_VERSION, decode_trace
from opguard_core.formats.tree import TREE_VERSION, check_tree, iter_nodes, load_tree
from opguard_core.model import RunOptions
from opguard_core.native import PURE_PYTHON_ENV
from opguard_plugins.stages import compress as compress_stage
from opguard_plugins.stages import sorted_runs
from opguard_plugins.stages.compress import compress_trace
from tests.compiled import compiled
from tests.conftest import RunResult

Run = Callable[..., RunResult]
REPO = Path(__file__).resolve().parent.parent
_scan = compiled("opguard_core.combine._scan")
_runs = compiled("opguard_plugins.stages._runs")
needs_c = pytest.mark.skipif(_scan is None or _runs is None, reason="C extensions not built")

FRAMES = [
    {"file": "train.py", "line": 3, "function": "main", "qualname": "main", "module": "train"},
    {"file": "model.py", "line": 9, "function": "forward", "qualname": "Model.forward",
     "module": "model"},
    {"file": "model.py", "line": 20, "function": "head", "qualname": "Model.head",
     "module": "model"},
]  # fmt: skip
#: (stack, api, op, dtype, count): a callsite of :func:`rank_doc`
Site = tuple[list[int], str | None, str, str | None, int]


def rank_doc(rank: int, sites: list[Site], version: int = TRACE_VERSION) -> dict[str, Any]:
    """A rank file as the tracer writes it: ``dtype`` after ``role``, where there is one."""
    callsites = []
    for stack, api, op, dtype, count in sites:
        site: dict[str, Any] = {"stack": stack}
        if api is not None:
            site["api"] = api
        site.update({"op": op, "stream": 0, "role": "comm" if op.startswith("c10d::") else
                     "compute"})  # fmt: skip
        if dtype is not None:
            site["dtype"] = dtype
        site["count"] = count
        callsites.append(site)
    return {"format": "opguard-callsites", "version": version,
            "meta": {"rank": rank, "world_size": 4}, "frames": FRAMES,
            "callsites": callsites}  # fmt: skip


def model_sites(dtype: str = "float32") -> list[Site]:
    """One step of a small model: a matmul in ``dtype``, a factory (no dtype), an
    index op in int64 and an all-reduce (its tensors are a list: no dtype)."""
    return [
        ([0, 1], "torch.mm", "aten::mm", dtype, 6),
        ([0, 1], None, "aten::empty", None, 2),
        ([0, 1, 2], None, "aten::embedding", "int64", 3),
        ([0], None, "c10d::allreduce_", None, 1),
    ]


def write_ranks(directory: Path, docs: list[dict[str, Any]], name: str = "job") -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for doc in docs:
        path = directory / f"{name}_rank{doc['meta']['rank']}.json"
        path.write_text(json.dumps(doc))
        paths.append(path)
    return paths


def combine_paths(paths: list[Path]) -> TraceAccumulator:
    accumulator = TraceAccumulator()
    for path in paths:
        accumulator.add_file(path)
    return accumulator


def options(**changes: Any) -> RunOptions:
    return RunOptions(**{"min_count": 1, "min_fraction": 0.0, **changes})


# ------------------------------------------------------------------------- combine


def test_a_callsite_in_two_dtypes_stays_two_callsites(tmp_path: Path, opguard: Run) -> None:
    """Rank 1 ran the matmul in float64: the combined trace has the float32 callsite on
    ranks 0, 2, 3 and the float64 one on rank 1 alone, written dtype after role, the
    callsite without a dtype first."""
    docs = [rank_doc(rank, model_sites("float64" if rank == 1 else "float32")) for rank in range(4)]
    paths = write_ranks(tmp_path / "traces", docs)
    run = opguard("run", "-i", str(tmp_path / "traces" / "job_rank*.json"), expect=0)
    raw = run.read("job_combined.json")
    doc = json.loads(raw)
    assert doc["version"] == TRACE_VERSION >= 7
    mm = [site for site in doc["callsites"] if site["op"] == "aten::mm"]
    assert [(s.get("dtype"), s["count"], s.get("ranks")) for s in mm] == [
        ("float32", 18, [0, 2, 3]),
        ("float64", 6, [1]),
    ]
    assert '"op":"aten::mm","role":"compute","dtype":"float32","count":18,"ranks":[0,2,3]' in raw
    assert not any(
        "dtype" in s for s in doc["callsites"] if s["op"] in ("aten::empty", "c10d::allreduce_")
    )
    assert run.read("job_combined.json").encode() == combine_paths(paths).result().to_json()


def test_no_dtype_sorts_first_then_dtypes_by_name(tmp_path: Path) -> None:
    stack: list[int] = [0, 1]
    doc = rank_doc(0, [(stack, None, "aten::add", dtype, 1) for dtype in
                       ("int64", None, "bfloat16", "float32")])  # fmt: skip
    trace = combine_paths(write_ranks(tmp_path, [doc])).result()
    assert [site.dtype for site in trace.callsites] == [None, "bfloat16", "float32", "int64"]
    keys = [(0, None, "aten::add", "compute", d) for d in ("int64", None, "bfloat16", "float32")]
    canonical = [(b"", ())]
    assert py_site_order(keys, canonical) == [1, 2, 3, 0]
    if _scan is not None:
        assert _scan.site_order(keys, canonical) == [1, 2, 3, 0]


@contextmanager
def reference_paths(python: bool) -> Iterator[None]:
    """With ``python``: the combine's Python references (msgspec's decode, the Python
    stack table, fold and merge) and compress's ``PyRuns``; else the C ones."""
    names = ("find_callsites", "scan_callsites", "fold_rank", "merge_packed")
    saved = [getattr(combined, name) for name in names] + [combined.new_table]
    runs_saved = (compress_stage.Runs, compress_stage.callsite_paths, compress_stage.frames_at)
    try:
        if python:
            for name in names:
                setattr(combined, name, None)
            combined.new_table = PyStackTable
            compress_stage.Runs = sorted_runs.PyRuns  # type: ignore[misc]
            compress_stage.callsite_paths = sorted_runs.py_callsite_paths
            compress_stage.frames_at = sorted_runs.py_frames_at
        else:
            assert _scan is not None and _runs is not None
            for name in names:
                setattr(combined, name, getattr(_scan, name))
            combined.new_table = _scan.StackTable
            compress_stage.Runs = _runs.Runs  # type: ignore[misc]
            compress_stage.callsite_paths = _runs.callsite_paths
            compress_stage.frames_at = _runs.frames_at
        yield
    finally:
        for name, value in zip(names, saved, strict=False):
            setattr(combined, name, value)
        combined.new_table = saved[-1]
        compress_stage.Runs, compress_stage.callsite_paths, compress_stage.frames_at = runs_saved


def _outputs(paths: list[Path], split: int | None, python: bool) -> tuple[bytes, bytes] | str:
    """The combined trace and its compressed tree (as encoded), from ``paths`` read in
    that order (those from ``split`` on into a second accumulator whose partial travels
    pickled), on the C or the Python path; the error message where a file is refused."""
    from opguard_core.formats.tree import encode_tree

    with reference_paths(python):
        try:
            first, second = TraceAccumulator(), TraceAccumulator()
            for position, path in enumerate(paths):
                (second if split is not None and position >= split else first).add_file(path)
            if split is not None:
                first.update(pickle.loads(pickle.dumps(second)))
            trace = first.result()
            return trace.to_json(), encode_tree(compress_trace(trace, options()))
        except InputError as exc:
            return str(exc)


DTYPE_NAMES = st.sampled_from([None, "float32", "float64", "bfloat16", "int64"])


@st.composite
def dtype_rank_files(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Rank files sharing a few (stack, api, op) shapes, each run in one or more dtypes
    (or none) per rank, with other counts per rank."""
    shapes = draw(
        st.lists(
            st.tuples(
                st.lists(st.integers(0, 2), min_size=1, max_size=3),
                st.sampled_from([None, "torch.mm"]),
                st.sampled_from(["aten::mm", "aten::add", "c10d::allreduce_"]),
            ),
            min_size=1,
            max_size=4,
        )
    )
    docs = []
    for rank in draw(st.lists(st.integers(0, 9), min_size=1, max_size=5, unique=True)):
        sites: list[Site] = []
        for stack, api, op in shapes:
            for dtype in draw(st.lists(DTYPE_NAMES, max_size=3, unique=True)):
                sites.append((stack, api, op, dtype, draw(st.integers(1, 9))))
        docs.append(rank_doc(rank, draw(st.permutations(sites))))
    return docs


def dtype_counts(doc: dict[str, Any]) -> Counter[tuple[Any, ...]]:
    """Counts by (stack as frame values, api, op, role, dtype) and by dtype alone."""
    counts: Counter[tuple[Any, ...]] = Counter()
    frames = [json.dumps(frame, sort_keys=True) for frame in doc["frames"]]
    for site in doc["callsites"]:
        stack = tuple(frames[i] for i in site["stack"])
        key = (stack, site.get("api"), site["op"], site["role"], site.get("dtype"))
        counts[key] += site["count"]
        counts[("dtype", site.get("dtype"))] += site["count"]
    return counts


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(docs=dtype_rank_files(), data=st.data())
def test_combine_conserves_counts_per_dtype_in_any_order(
    tmp_path_factory: pytest.TempPathFactory, docs: list[dict[str, Any]], data: st.DataObject
) -> None:
    """Counts per (callsite, dtype) and per dtype are conserved; the bytes depend on
    neither the order of the files nor how they were split between accumulators, and
    the C path's bytes (combined and compressed) are the Python references'."""
    paths = write_ranks(tmp_path_factory.mktemp("dtypes"), docs)
    expected = _outputs(paths, None, python=True)
    assert isinstance(expected, tuple)
    shuffled = data.draw(st.permutations(paths))
    split = data.draw(st.none() | st.integers(1, max(1, len(paths) - 1)))
    assert _outputs(shuffled, split, python=True) == expected
    if _scan is not None and _runs is not None:
        assert _outputs(shuffled, split, python=False) == expected
    out = json.loads(expected[0])
    want: Counter[tuple[Any, ...]] = Counter()
    for doc in docs:
        want.update(dtype_counts(doc))
    assert dtype_counts(out) == want
    assert len(out["callsites"]) == len([k for k in want if k[0] != "dtype"])
    tree = json.loads(expected[1])
    assert tree["meta"]["dtypes"] == any("dtype" in s for d in docs for s in d["callsites"])
    by_dtype: Counter[str] = Counter()
    for node, _ in iter_nodes(tree["root"]):
        by_dtype.update(node["self_dtypes"])
    assert dict(by_dtype) == {k[1]: c for k, c in want.items() if k[0] == "dtype" and k[1]}


# ------------------------------------------------------------------------ compress


def test_the_tree_counts_own_ops_by_dtype(tmp_path: Path, opguard: Run) -> None:
    docs = [rank_doc(rank, model_sites("float64" if rank == 1 else "float32")) for rank in range(4)]
    write_ranks(tmp_path / "traces", docs)
    run = opguard("run", "-i", str(tmp_path / "traces" / "job_rank*.json"), expect=0)
    raw = run.read("job_compressed.json")
    tree = json.loads(raw)
    assert tree["version"] == TREE_VERSION == 6 and tree["meta"]["dtypes"] is True
    nodes = {node.get("qualname"): node for node, _ in iter_nodes(tree["root"])}
    assert nodes["mm"]["self_dtypes"] == {"float32": 18, "float64": 6}
    assert nodes["Model.forward"]["self_ops"] == {"aten::empty": 8}
    assert nodes["Model.forward"]["self_dtypes"] == {}  # a factory has no tensor argument
    assert nodes["Model.head"]["self_dtypes"] == {"int64": 12}
    assert nodes["main"]["self_dtypes"] == {}  # the all-reduce: no dtype
    for node, _ in iter_nodes(tree["root"]):  # written after self_streams, on every node
        keys = list(node)
        assert keys[keys.index("self_streams") + 1] == "self_dtypes"
        assert sum(node["self_dtypes"].values()) <= sum(node["self_ops"].values())
    assert list(tree["meta"])[-3:] == ["dtypes", "op_ranks", "compression"]
    check_tree(load_tree(run.run_dir / "job_compressed.json"))  # type: ignore[operator]


def test_a_version_6_trace_still_combines_without_dtypes(tmp_path: Path, opguard: Run) -> None:
    docs = [rank_doc(rank, model_sites(), version=6) for rank in range(2)]
    for doc in docs:
        for site in doc["callsites"]:
            site.pop("dtype", None)
    write_ranks(tmp_path / "traces", docs)
    run = opguard("run", "-i", str(tmp_path / "traces" / "job_rank*.json"), expect=0)
    combined_doc = json.loads(run.read("job_combined.json"))
    assert combined_doc["version"] == TRACE_VERSION and not any(
        "dtype" in s for s in combined_doc["callsites"]
    )
    tree = json.loads(run.read("job_compressed.json"))
    assert tree["meta"]["dtypes"] is False
    assert all(node["self_dtypes"] == {} for node, _ in iter_nodes(tree["root"]))


def _tree(**node_changes: Any) -> dict[str, Any]:
    leaf = {"module": "m", "qualname": "f", "file": "m.py", "lines": [1], "kind": "function",
            "count": 5, "self_ops": {"aten::mm": 5}, "self_streams": {"compute": 5},
            "self_dtypes": {"float32": 4}, "ranks": [0], "chain": [], "children": [],
            **node_changes}  # fmt: skip
    return {"format": "opguard-calltree", "version": TREE_VERSION,
            "meta": {"ranks": [0], "dtypes": True},
            "root": {"name": "<root>", "count": 5, "self_ops": {}, "self_streams": {},
                     "self_dtypes": {}, "children": [leaf]}}  # fmt: skip


@pytest.mark.parametrize(
    ("dtypes", "problem"),
    [
        ({"Float 32": 1}, "self_dtypes key 'Float 32' is not a dtype name"),
        ({"float32": -1}, "self_dtypes['float32'] -1 is not an integer in [0, 2**63)"),
        ({"float32": 2**63}, f"self_dtypes['float32'] {2**63} is not an integer in [0, 2**63)"),
        ({"float32": 3, "int64": 3}, "self_dtypes sum 6 is above self_ops' 5"),
    ],
)
def test_check_tree_refuses_bad_self_dtypes(dtypes: dict[str, int], problem: str) -> None:
    check_tree(_tree())
    with pytest.raises(InvariantError) as caught:
        check_tree(_tree(self_dtypes=dtypes))
    assert str(caught.value) == f"m:f: {problem}"


def test_a_tree_without_self_dtypes_or_with_a_bad_meta_dtypes_is_refused(tmp_path: Path) -> None:
    tree = _tree()
    del tree["root"]["children"][0]["self_dtypes"]
    path = tmp_path / "x_compressed.json"
    path.write_text(json.dumps(tree))
    with pytest.raises(InputError, match=r"x_compressed\.json: invalid call tree: missing"):
        load_tree(path)
    tree = _tree()
    tree["meta"]["dtypes"] = "yes"
    path.write_text(json.dumps(tree))
    with pytest.raises(InputError, match=r"meta\.dtypes 'yes' is not true or false"):
        load_tree(path)


def test_a_version_4_tree_reads_with_empty_self_dtypes(tmp_path: Path) -> None:
    tree = _tree()
    tree["version"] = 4
    tree["meta"] = {"ranks": [0], "compression": {"min_count": 1}}
    for node, _ in iter_nodes(tree["root"]):
        del node["self_dtypes"]
    path = tmp_path / "old_compressed.json"
    path.write_text(json.dumps(tree))
    loaded = load_tree(path)
    assert loaded["version"] == TREE_VERSION and loaded["meta"]["dtypes"] is False
    assert list(loaded["meta"]) == ["ranks", "dtypes", "op_ranks", "compression"]
    for node, _ in iter_nodes(loaded["root"]):
        keys = list(node)
        assert node["self_dtypes"] == {} and keys[keys.index("self_streams") + 1] == "self_dtypes"


# ---------------------------------------------------------------- bad input, paths


@pytest.mark.parametrize("bad", ["Float 32", "", "float32\t", 32])
def test_a_bad_dtype_is_refused_in_one_line_naming_the_file(tmp_path: Path, bad: Any) -> None:
    """On the scanner's path (which interns any string, then declines) and on msgspec's,
    the same one-line error naming the file and the field."""
    doc = rank_doc(0, [([0], None, "aten::add", "float32", 1)])
    doc["callsites"][0]["dtype"] = bad
    path = tmp_path / "job_rank0.json"
    path.write_text(json.dumps(doc))
    messages = {_outputs([path], None, python=python) for python in (True, _scan is None)}
    (message,) = messages
    assert isinstance(message, str) and "\n" not in message
    assert message.startswith(f"{path}: invalid trace: ") and "$.callsites[0].dtype" in message
    with pytest.raises(InputError):
        decode_trace(json.dumps(doc).encode(), path)


def test_the_cli_refuses_a_bad_dtype_and_names_the_file(tmp_path: Path, opguard: Run) -> None:
    good = rank_doc(0, model_sites())
    bad = rank_doc(1, model_sites())
    bad["callsites"][0]["dtype"] = "Float 32"
    paths = write_ranks(tmp_path / "traces", [good, bad])
    run = opguard("run", "-i", str(tmp_path / "traces" / "job_rank*.json"))
    assert run.exit_code == 1 and "Traceback" not in run.stderr
    lines = [line for line in run.stderr.splitlines() if line.startswith("opguard: ")]
    assert len(lines) == 1, run.stderr
    assert str(paths[1]) in lines[0] and "dtype" in lines[0]


def test_the_accumulator_keeps_only_valid_dtype_names_interned(tmp_path: Path) -> None:
    """A declined scan leaves no invalid name behind for the next file's check."""
    bad = rank_doc(1, [([0], None, "aten::add", "Float 32", 1)])
    good = rank_doc(0, model_sites())
    paths = write_ranks(tmp_path, [good, bad])
    accumulator = TraceAccumulator()
    accumulator.add_file(paths[0])
    with pytest.raises(InputError):
        accumulator.add_file(paths[1])
    assert all(map(is_dtype, accumulator.dtypes))


def test_pure_python_writes_the_same_run_with_dtypes(tmp_path: Path) -> None:
    """``OPGUARD_PURE_PYTHON=1`` and the default write the same artifacts for traces
    with dtypes (the pipeline end to end, in two processes)."""
    docs = [rank_doc(rank, model_sites("float64" if rank == 1 else "float32")) for rank in range(4)]
    paths = write_ranks(tmp_path / "traces", docs)
    outputs = []
    for pure in ("1", "0"):
        base = tmp_path / pure
        env = {**os.environ, "OPGUARD_TRACE_OUTPUT_BASE": str(base), PURE_PYTHON_ENV: pure}
        command = [sys.executable, "-m", "opguard_core.cli.app", "run", "--jobs", "1"]
        subprocess.run([*command, "-i", *map(str, paths)], env=env, check=True,
                       capture_output=True)  # fmt: skip
        [run] = base.iterdir()
        outputs.append(
            {
                path.name: path.read_bytes()
                for path in sorted(run.iterdir())
                if path.suffix in (".json", ".yaml", ".log") and path.stem != "pipeline_summary"
            }
        )
    assert outputs[0] == outputs[1]
    assert b'"dtype":"float64"' in outputs[0]["job_combined.json"]


# ---------------------------------------------------------------------- divergence


def _divergence(tmp_path: Path, opguard: Run, docs: list[dict[str, Any]]) -> dict[str, Any]:
    write_ranks(tmp_path / "traces", docs)
    run = opguard("run", "-i", str(tmp_path / "traces" / "job_rank*.json"), expect=0)
    combined_doc = json.loads(run.read("job_combined.json"))
    found = json.loads(run.read("job_divergence.json"))
    return {"combined": combined_doc, "divergence": found}


def test_a_rank_in_another_dtype_is_a_rank_only_callsite(tmp_path: Path, opguard: Run) -> None:
    """The float64 matmul of rank 1 is a callsite of rank 1 alone, beside the float32
    one of the others: the combined trace divergence reads holds both, and a function
    only rank 1 ran (its float64 path) is reported as rank-specific like any other."""
    docs = [rank_doc(rank, model_sites("float64" if rank == 1 else "float32")) for rank in range(4)]
    # rank 1 also casts in a function of its own (Model.to_double): a rank-specific path
    docs[1]["frames"] = [*FRAMES, {"file": "model.py", "line": 30, "function": "to_double",
                                   "qualname": "Model.to_double", "module": "model"}]  # fmt: skip
    docs[1]["callsites"].append({"stack": [0, 3], "op": "aten::_to_copy", "stream": 0,
                                 "role": "compute", "dtype": "float32", "count": 5})  # fmt: skip
    out = _divergence(tmp_path, opguard, docs)
    mm = [(s.get("dtype"), s.get("ranks")) for s in out["combined"]["callsites"]
          if s["op"] == "aten::mm"]  # fmt: skip
    assert mm == [("float32", [0, 2, 3]), ("float64", [1])]
    groups = out["divergence"]["groups"]
    kinds = [(g["kind"], g["ranks"]) for g in groups]
    assert ("rank_specific", [1]) in kinds and ("dtype_mismatch", [1]) in kinds


def test_a_rank_that_ran_an_op_in_float64_shows_up_in_divergence(
    tmp_path: Path, opguard: Run
) -> None:
    """The same callsites on every rank, rank 1's matmul in float64: a
    ``dtype_mismatch`` naming the op, the function, the majority's dtype and rank 1's."""
    docs = [rank_doc(rank, model_sites("float64" if rank == 1 else "float32")) for rank in range(4)]
    out = _divergence(tmp_path, opguard, docs)
    assert any(site.get("ranks") == [1] for site in out["combined"]["callsites"])
    [group] = out["divergence"]["groups"]
    assert (group["kind"], group["severity"], group["ranks"]) == ("dtype_mismatch", "warning", [1])
    assert group["message"].startswith("aten::mm in model:Model.forward ran in float32 on 3 of 4")
    assert "but in float64 on rank(s) 1" in group["message"]
    # two ranks each way: no majority, rank 0's dtypes are the reference
    docs = [rank_doc(rank, model_sites("float64" if rank % 2 else "float32")) for rank in range(4)]
    [group] = _divergence(tmp_path / "even", opguard, docs)["divergence"]["groups"]
    assert group["ranks"] == [1, 3] and "on rank 0, the lowest (no majority)" in group["message"]
