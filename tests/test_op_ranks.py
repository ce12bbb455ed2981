"""Which ranks ran an op (tree and config version 6; formats.md, "Which ranks ran an
op"): written by compress and generate, read back, refused in one line when wrong.
How check and guard use it is in test_check_edges.py and test_guard_one_view.py; how
merge unites it, in test_properties.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from opguard_core.cli.app import create_cli
from opguard_core.errors import InvariantError
from opguard_core.formats.config import load_config, validate_config
from opguard_core.formats.tree import check_tree, iter_nodes, load_tree
from opguard_core.plugin.manager import create_plugin_manager
from opguard_plugins.stages.generate import generate_config
from tests.builders import trace_doc, write

MAIN = [("job", "main"), ("job", "metrics")]


def invoke(*args: str | Path) -> Result:
    argv = ["--log-format", "json", *[str(a) for a in args]]
    return CliRunner().invoke(create_cli(create_plugin_manager()), argv, catch_exceptions=False)


def _job(folder: Path, ranks: int, extra_on: set[int]) -> str:
    """``ranks`` ranks that all run ``aten::mm`` at one callsite, where the ranks of
    ``extra_on`` also run ``aten::exp``."""
    folder.mkdir()
    for rank in range(ranks):
        sites = [(MAIN, None, "aten::mm", 40)]
        if rank in extra_on:
            sites.append((MAIN, None, "aten::exp", 8))
        write(folder / f"j_callsite_rank{rank}.json",
              trace_doc(sites, rank=rank, world_size=ranks, steps=4, phase="loop"))  # fmt: skip
    return str(folder / "j_callsite_rank*.json")


def _run(tmp_path: Path, pattern: str) -> Path:
    result = invoke("run", "-i", pattern, "--output-base", tmp_path / "out")
    assert result.exit_code == 0, result.stderr
    return Path(result.stdout.strip().splitlines()[-1])


def test_a_tree_and_its_config_say_which_ranks_ran_an_op(tmp_path: Path) -> None:
    """Ranks 0-2 of 5 run ``aten::exp`` where all 5 run ``aten::mm``: the node that
    runs both records exp's ranks (ranges in the file, a list once read), the config
    lists them on its entry (and would on every entry above it), and mm, which every
    rank ran, on none."""
    run = _run(tmp_path, _job(tmp_path / "job", 5, {0, 1, 2}))
    [path] = run.glob("*_compressed.json")
    raw = json.loads(path.read_text())
    assert raw["version"] == 6 and raw["meta"]["op_ranks"] is True
    written = [n for n, _ in iter_nodes(raw["root"]) if "self_op_ranks" in n]
    assert [n["self_op_ranks"] for n in written] == [{"aten::exp": [[0, 2]]}]
    tree = load_tree(path)
    [node] = [n for n, _ in iter_nodes(tree["root"]) if "self_op_ranks" in n]
    assert node["self_op_ranks"] == {"aten::exp": [0, 1, 2]} and node["ranks"] == [0, 1, 2, 3, 4]
    config = load_config(next(run.glob("*_instrumentation.yaml")))
    assert config["version"] == 6 and config["meta"]["op_ranks"] is True
    listed = {e["target"]: e.get("op_ranks") for e in config["entries"]}
    assert listed == {"job:metrics": {"aten::exp": [[0, 2]]}}  # main: a chain link
    text = next(run.glob("*_instrumentation.yaml")).read_text()
    assert "    op_ranks: {aten::exp: [[0, 2]]}\n" in text


def _tree(**node: Any) -> dict[str, Any]:
    child = {"module": "job", "qualname": "main", "file": "job.py", "lines": [1],
             "kind": "function", "count": 3, "self_ops": {"aten::mm": 2, "aten::exp": 1},
             "self_streams": {"compute": 3}, "self_dtypes": {}, "ranks": [0, 1],
             "chain": [], "children": [], **node}  # fmt: skip
    return {"format": "opguard-calltree", "version": 6,
            "meta": {"ranks": [0, 1], "dtypes": False, "op_ranks": True, "compression": {}},
            "root": {"name": "<root>", "count": 3, "self_ops": {}, "self_streams": {},
                     "self_dtypes": {}, "children": [child]}}  # fmt: skip


@pytest.mark.parametrize(
    ("op_ranks", "problem"),
    [
        ({"aten::add": [0]}, "job:main: self_op_ranks names 'aten::add', not one of its own ops"),
        ({"aten::exp": [0, 1]}, "job:main: self_op_ranks['aten::exp'] [0, 1] is not some of"),
        ({"aten::exp": [2]}, "job:main: self_op_ranks['aten::exp'] [2] is not some of"),
        ({"aten::exp": []}, "job:main: self_op_ranks['aten::exp'] [] is not some of"),
        ([0], "job:main: self_op_ranks [0] is not an object"),
    ],
)
def test_a_tree_whose_op_ranks_are_not_its_own_is_refused(op_ranks: Any, problem: str) -> None:
    check_tree(_tree(self_op_ranks={"aten::exp": [1]}))  # a valid one
    with pytest.raises(InvariantError, match="^" + problem.replace("[", r"\[")):
        check_tree(_tree(self_op_ranks=op_ranks))


@pytest.mark.parametrize(
    ("ranges", "problem"),
    [
        ([[1, 0]], "[1, 0] is not ascending, disjoint and first <= last"),
        # far past the node's ranks: refused before it is spelled out (a MemoryError)
        ([[0, 10**11]], "[0, 100000000000] is past the last rank, 1"),
    ],
)
def test_a_tree_file_with_bad_op_ranges_is_one_line(
    tmp_path: Path, ranges: list[Any], problem: str
) -> None:
    path = tmp_path / "x_compressed.json"
    path.write_text(json.dumps(_tree(self_op_ranks={"aten::exp": ranges})))
    result = invoke("export", str(path), "--format", "collapsed", "-o", tmp_path / "x.folded")
    assert result.exit_code == 5
    assert result.stderr.strip().splitlines()[-1] == (
        f"opguard: error: {path}: job:main: self_op_ranks['aten::exp']: {problem}"
    )


CONFIG = """version: {version}
source: s
meta:
  ranks: [0, 1]
  total: 3
{meta}entries:
  - target: job:main
    kind: function
    ops:
      aten::exp: 1
      aten::mm: 2
    stream_counts:
      compute: 3
    count: 3
{entry}"""


@pytest.mark.parametrize(
    ("version", "meta", "entry", "problem"),
    [
        (5, "", "    op_ranks: {aten::exp: [0]}\n",
         "entries[0].op_ranks needs config version 6 or later"),
        (5, "  op_ranks: true\n", "", "meta.op_ranks needs config version 6 or later"),
        (6, "  op_ranks: yes\n", "", "meta.op_ranks must be true or false"),
        (6, "", "    op_ranks: [aten::exp]\n",
         "entries[0].op_ranks must map ops to the ranks that ran them"),
        (6, "", "    op_ranks: {aten::add: [0]}\n",
         "entries[0].op_ranks names 'aten::add', which is not one of the entry's ops"),
        (6, "", "    op_ranks: {aten::exp: [1, 0]}\n",
         "entries[0].op_ranks['aten::exp']: 0 is not ascending, disjoint and first <= last"),
        (6, "", "    op_ranks: {aten::exp: [true]}\n",
         "entries[0].op_ranks['aten::exp']: True is neither a rank nor [first, last]"),
        (6, "", "    op_ranks: {aten::exp: []}\n",
         "entries[0].op_ranks['aten::exp'] lists no rank"),
        (6, "", "    op_ranks: {aten::exp: [5]}\n",
         "entries[0].op_ranks['aten::exp']: 5 is past the last rank, 1"),
        (6, "", "    op_ranks: {aten::exp: [[0, 100000000000]]}\n",
         "entries[0].op_ranks['aten::exp']: [0, 100000000000] is past the last rank, 1"),
        (6, "", "    ranks: [0, 2]\n    op_ranks: {aten::exp: [1]}\n",
         "entries[0].op_ranks['aten::exp'] lists a rank that is not one of the entry's"),
    ],
)  # fmt: skip
def test_a_config_with_bad_op_ranks_is_one_line(
    tmp_path: Path, version: int, meta: str, entry: str, problem: str
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(CONFIG.format(version=6, meta="  op_ranks: true\n", entry=""))
    assert load_config(path)["meta"]["op_ranks"] is True  # the valid one
    path.write_text(CONFIG.format(version=version, meta=meta, entry=entry))
    trace = tmp_path / "t_callsite.json"
    write(trace, trace_doc([(MAIN, None, "aten::mm", 2)]))
    result = invoke("check", "--config", path, "-i", trace)
    assert result.exit_code == 5, result.stdout
    assert result.stderr.strip().splitlines()[-1] == f"opguard: error: {path}: {problem}"


def test_show_names_the_ranks_of_an_op_not_all_ranks_ran(tmp_path: Path) -> None:
    run = _run(tmp_path, _job(tmp_path / "job", 5, {0, 1, 2}))
    config = next(run.glob("*_instrumentation.yaml"))
    result = invoke("show", config, "--format", "json")
    assert result.exit_code == 0, result.stderr
    [row] = json.loads(result.stdout)["entries"]
    assert row["main_ops"] == [
        {"op": "aten::mm", "count": 200},
        {"op": "aten::exp", "count": 24, "ranks": [0, 1, 2]},
    ]
    text = invoke("show", config)
    assert "aten::mm 200, aten::exp 24 (ranks 0-2)" in text.stdout


def test_a_node_without_ranks_ran_on_every_rank() -> None:
    """A tree's node that does not say its ranks (another compressor's) ran on
    ``meta.ranks``, as check_tree reads it: its ops are not listed as run by no rank
    (``op_ranks: {aten::exp: []}``, a config its own validation refused)."""
    inner = {"module": "job", "qualname": "inner", "file": "job.py", "lines": [2],
             "kind": "function", "count": 2, "self_ops": {"aten::exp": 2},
             "self_streams": {"compute": 2}, "self_dtypes": {}, "chain": [],
             "children": []}  # fmt: skip
    tree = _tree(self_ops={"aten::mm": 1}, self_streams={"compute": 1}, children=[inner])
    check_tree(tree)
    config = generate_config(tree, "s", 1)
    validate_config(config, "generated")
    assert all("op_ranks" not in e and "ranks" not in e for e in config["entries"])
