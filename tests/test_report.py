"""report.html: written at the end of every run, rewritten by ``opguard report``,
self-contained, escaped, bounded in size, and (where Chromium is installed)
rendered and used in a browser: layout at 1400 px, search, zoom, the ranks view."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from opguard_core import hookimpl
from opguard_core.cli import create_cli
from opguard_core.errors import InputError
from opguard_core.formats.config import load_config, parse_config
from opguard_core.formats.divergence import load_divergence
from opguard_core.formats.tree import load_tree
from opguard_core.plugin.manager import create_plugin_manager
from opguard_plugins.view.report import (
    MAX_GROUPS,
    MAX_MEMBERS,
    config_view,
    divergence_view,
    group_findings,
    rank_ranges,
    rank_row,
    rank_text,
    tree_view,
)
from tests.builders import sample_inputs, trace_doc, write
from tests.chromium import BINARY as CHROMIUM
from tests.chromium import Chromium

DATA = re.compile(r'<script type="application/json" id="opguard-data">(.*?)</script>', re.S)
DIVERGENT = Path(__file__).parent / "data" / "divergent" / "divergent_callsite_rank*.json"
EXAMPLES = Path(__file__).parents[1] / "examples" / "traces"


def embedded(report: Path) -> dict[str, Any]:
    match = DATA.search(report.read_text())
    assert match is not None
    return json.loads(match.group(1))


NODE = shutil.which("node")
needs_node = pytest.mark.skipif(NODE is None, reason="node (Debian nodejs) is not installed")


def page(report: Path, search: str | None = None) -> list[str]:
    """The page as its script builds it, run under Node in a stand-in for the DOM
    (``report_dom.js``: every <details> and findings row opened, ``search`` typed):
    a line ``tag.class[data-role]: text`` an element, indentation stripped. The
    script failing fails the test."""
    script = Path(__file__).parent / "report_dom.js"
    argv = [str(NODE), str(script), str(report), *([] if search is None else [search])]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    return [line.strip() for line in done.stdout.splitlines()]


def test_every_run_writes_a_self_contained_report(
    opguard: Callable[..., Any], samples: Path
) -> None:
    run = opguard("run", *sample_inputs(samples, "fsdp", "gpt"), expect=0)
    report = run.run_dir / "report.html"
    text = report.read_text()
    assert not re.search(r"<(script|link|img|iframe)[^>]*\b(src|href)=", text)
    assert "default-src 'none'" in text  # the page may not fetch anything
    data = embedded(report)
    assert data["summary"]["status"] == "ok"
    assert [e["name"] for e in data["entries"]] == ["fsdp_callsite", "gpt_callsite"]
    # the final config is the one shown first: the merge's, its rows largest first
    assert data["final"] == {"filtered": None, "final": "final_combined_instrumentation.yaml"}
    for name in ("final_combined_instrumentation.yaml", "fsdp_callsite_instrumentation.yaml"):
        config = load_config(run.run_dir / name)
        view = data["configs"][name]
        assert view["entries"] == len(view["rows"]) == len(config["entries"])
        counts = [row[4] for row in view["rows"]]
        assert counts == sorted(counts, reverse=True)
        assert sorted(counts) == sorted(e["count"] for e in config["entries"])
        assert view["total"] == config["meta"]["total"]
        top = max(config["entries"], key=lambda e: e["count"])
        ops = {view["names"][i]: n for i, n in view["rows"][0][5]}
        assert ops == dict(top["ops"])
    for entry in data["entries"]:
        tree = load_tree(run.run_dir / f"{entry['name']}_compressed.json")
        assert entry["tree"]["c"][0] == tree["root"]["count"]
        assert entry["config"] == f"{entry['name']}_instrumentation.yaml"
        (record,) = [r for r in data["summary"]["stages"]
                     if r["stage"] == "divergence" and r["entry"] == entry["name"]]  # fmt: skip
        found = load_divergence(run.run_dir / record["outputs"][0])["findings"]
        assert entry["divergence"]["findings"] == len(found)
        assert sum(g["count"] for g in entry["divergence"]["groups"]) == len(found)
    assert [c["name"] for c in data["comparisons"]] == ["comparison_1_vs_2.log"]
    assert data["comparisons"][0]["text"] == run.read("comparison_1_vs_2.log")
    # the run hands the report the configs it wrote; reading them back gives the same page
    report.unlink()
    opguard("report", run.run_dir, expect=0)
    again = embedded(report)
    assert again.pop("summary")["stages"] == data.pop("summary")["stages"]
    assert again == data  # (the summary's clock fields come from the file, not the run)
    first = report.read_bytes()
    opguard("report", run.run_dir, expect=0)
    assert report.read_bytes() == first  # deterministic


def test_the_filtered_config_is_the_one_shown_first(
    opguard: Callable[..., Any], samples: Path
) -> None:
    run = opguard("run", *sample_inputs(samples, "gpt"), "--basic", expect=0)
    data = embedded(run.run_dir / "report.html")
    filtered = data["final"]["filtered"]
    assert filtered is not None and filtered.endswith("filtered_instrumentation.yaml")
    assert (run.run_dir / filtered).is_file()
    rows = data["configs"][filtered]["rows"]
    assert len(rows) == len(load_config(run.run_dir / filtered)["entries"])
    unfiltered = data["final"]["final"]
    assert unfiltered in data["configs"] and len(data["configs"][unfiltered]["rows"]) > len(rows)


EVIL = "</script><script>alert(1)</script><b>x</b>"


def evil_run(opguard: Callable[..., Any], tmp_path: Path) -> Path:
    src = write(
        tmp_path / "evil.json",
        trace_doc([([("app", "main"), ("app<b>", EVIL)], None, "aten::<i>mm</i>", 7)]),
    )
    run_dir: Path = opguard("run", "-i", str(src), expect=0).run_dir
    # a divergence file naming the same hostile strings, shown as findings
    finding = {"kind": EVIL, "severity": "error", "ranks": [1], "target": EVIL,
               "op": "aten::<i>mm</i>", "message": EVIL, "stack": [EVIL, "<b>"],
               "counts": {"1": 3}, "expected": 1}  # fmt: skip
    # kinds that name what every JavaScript object has
    tricky = [
        {**finding, "kind": kind, "severity": "warning"} for kind in ("constructor", "__proto__")
    ]
    doc = {"format": "opguard-divergence", "version": 1,
           "meta": {"ranks": [0, 1], "source": EVIL}, "findings": [finding, *tricky]}  # fmt: skip
    (run_dir / "evil_divergence.json").write_text(json.dumps(doc))
    summary_path = run_dir / "pipeline_summary.json"
    summary = json.loads(summary_path.read_text())  # as a two-rank run would record it
    summary["stages"].append({"stage": "divergence", "entry": "evil", "status": "ok",
                              "outputs": ["evil_divergence.json"]})  # fmt: skip
    summary_path.write_text(json.dumps(summary))
    CliRunner().invoke(create_cli(create_plugin_manager()), ["report", str(run_dir)])
    return run_dir


def test_nothing_in_the_inputs_becomes_markup(opguard: Callable[..., Any], tmp_path: Path) -> None:
    run_dir = evil_run(opguard, tmp_path)
    text = (run_dir / "report.html").read_text()
    assert text.count("</script>") == 2  # the data block and the code block, nothing else
    assert "<b>" not in text and "<i>" not in text
    data = embedded(run_dir / "report.html")
    assert "alert(1)" in json.dumps(data["entries"][0]["tree"])  # kept as data, shown as text
    group, *tricky = data["entries"][0]["divergence"]["groups"]
    assert group["target"] == EVIL and group["members"][0]["message"] == EVIL
    assert sorted(g["kind"] for g in tricky) == ["__proto__", "constructor"]


def test_divergence_findings_are_grouped(opguard: Callable[..., Any], samples: Path) -> None:
    run = opguard("run", *sample_inputs(samples, "gpt"), expect=0)
    findings = [
        {"kind": "missing_on_ranks", "severity": "warning", "ranks": [1], "size": 5,
         "target": "torch:Tensor.view", "op": "aten::view", "message": "only on rank 0",
         "stack": ["gpt:main", "gpt:step"]},
        {"kind": "collective_mismatch", "severity": "error", "ranks": [1], "size": 2,
         "target": "gpt:step", "op": "c10d::allreduce_", "counts": {"1": 3}, "expected": 1,
         "message": "m1", "stack": ["gpt:main", "gpt:step"]},
        {"kind": "collective_mismatch", "severity": "error", "ranks": [1], "size": 4,
         "target": "gpt:step", "op": "c10d::broadcast_", "counts": {"1": 0}, "expected": 2,
         "message": "m2", "stack": ["gpt:main", "gpt:step", "gpt:sync"]},
    ]  # fmt: skip
    doc = {"format": "opguard-divergence", "version": 1,
           "meta": {"ranks": [0, 1, 2], "skew": 0.25}, "findings": findings}  # fmt: skip
    (run.run_dir / "gpt_callsite_divergence.json").write_text(json.dumps(doc))
    result = opguard("report", run.run_dir, expect=0)
    assert result.result.stdout.strip() == str(run.run_dir / "report.html")
    (entry,) = embedded(run.run_dir / "report.html")["entries"]
    view = entry["divergence"]
    assert (view["findings"], view["errors"], view["warnings"], view["ngroups"]) == (3, 2, 1, 2)
    first, second = view["groups"]
    assert (first["kind"], first["target"], first["count"], first["size"]) == (
        "collective_mismatch", "gpt:step", 2, 6)  # fmt: skip
    assert first["ops"] == ["c10d::allreduce_", "c10d::broadcast_"]
    # rank 1 issued 3 + 0 collectives where the others issued 1 + 2: the same sum, but
    # rank 1 deviates in both findings, so the picture lists it
    assert first["row"] == {"expected": 3, "values": [[3, "1"]]}
    assert [m.get("message") for m in first["members"]] == ["m1", None]  # one message a group
    stacks = [_stack(view, m["stack"]) for m in first["members"]]
    assert stacks == [["gpt:main", "gpt:step"], ["gpt:main", "gpt:step", "gpt:sync"]]
    assert view["per_rank"] == {"collective_mismatch": [[2, "1"]], "missing_on_ranks": [[1, "1"]]}
    assert second["kind"] == "missing_on_ranks" and second["row"]["values"] == [[1, "1"]]
    (run.run_dir / "gpt_callsite_divergence.json").write_text("[not json")
    opguard("report", run.run_dir, expect=0)
    view = embedded(run.run_dir / "report.html")["entries"][0]["divergence"]
    assert view["groups"] == [] and "could not be read" in view["note"]


@pytest.mark.parametrize("version", [5, "4"])
def test_a_divergence_document_of_a_version_not_read_is_a_note(
    opguard: Callable[..., Any], samples: Path, version: Any
) -> None:
    """A later version's groups were shown as if the layout were version 4's."""
    run = opguard("run", *sample_inputs(samples, "gpt"), expect=0)
    path = run.run_dir / "gpt_callsite_divergence.json"
    doc = json.loads(path.read_text())
    doc["version"] = version
    path.write_text(json.dumps(doc))
    opguard("report", run.run_dir, expect=0)
    view = embedded(run.run_dir / "report.html")["entries"][0]["divergence"]
    assert view["groups"] == [] and view["note"] == (
        f"gpt_callsite_divergence.json is of version {version}, which this OpGuard does "
        "not read (it reads 1, 2, 3, 4)"
    )


def test_a_divergence_document_nested_too_deep_is_a_note(
    opguard: Callable[..., Any], samples: Path
) -> None:
    """It ended ``opguard report`` with a RecursionError traceback."""
    run = opguard("run", *sample_inputs(samples, "gpt"), expect=0)
    deep = '{"format": "opguard-divergence", "version": 4, "meta": ' + "[" * 100_000
    (run.run_dir / "gpt_callsite_divergence.json").write_text(deep + "]" * 100_000 + "}")
    opguard("report", run.run_dir, expect=0)
    view = embedded(run.run_dir / "report.html")["entries"][0]["divergence"]
    assert view["note"] == "gpt_callsite_divergence.json could not be read"
    with pytest.raises(InputError, match="nested too deep"):
        load_divergence(run.run_dir / "gpt_callsite_divergence.json")


def test_the_findings_on_the_rank_row_counts_the_ranks_that_deviate(
    opguard: Callable[..., Any], tmp_path: Path
) -> None:
    """8 ranks, rank 7 alone never runs ``app:extra``: the "findings on the rank" row
    once counted the finding for ranks 0-6 (those that ran it), not for rank 7."""
    for rank in range(8):
        sites = [([("app", "main")], None, "aten::mm", 5)]
        if rank != 7:
            sites.append(([("app", "main"), ("app", "extra")], None, "aten::add", 3))
        write(tmp_path / f"job_rank{rank}.json", trace_doc(sites, rank=rank, world_size=8))
    run = opguard("run", "-i", str(tmp_path / "job_rank*.json"), expect=0)
    view = embedded(run.run_dir / "report.html")["entries"][0]["divergence"]
    (group,) = view["groups"]
    assert (group["kind"], group["ranks"]) == ("rank_specific", [7, "0-6"])
    assert group["row"] == {"expected": 1, "values": [[0, "7"]]}
    assert view["per_rank"] == {"rank_specific": [[1, "7"]]}


def test_the_findings_on_the_rank_row_counts_a_finding_s_ranks_however_many() -> None:
    """Two of three ranks died (no majority: rank 2 went on): the sequence finding
    names ranks 0 and 1, which the row once inverted to rank 2, as for rank_specific."""
    finding = {"kind": "collective_missing", "severity": "error", "ranks": [0, 1], "size": 1,
               "target": "app:step", "message": "m"}  # fmt: skip
    view = divergence_view({"ranks": [0, 1, 2]}, group_findings([finding]), 1)
    assert view["per_rank"] == {"collective_missing": [[1, "0-1"]]}
    assert view["groups"][0]["row"] == {"expected": 0, "values": [[1, "0-1"]]}


@needs_node
def test_a_group_of_several_functions_names_each_finding_s_own(
    opguard: Callable[..., Any], samples: Path
) -> None:
    """A version-4 count_skew group of 10 functions: every finding was titled with
    the group's first function, a search for another one found nothing, and no
    stack frame was marked as the finding's (it was compared with "f (and 9 more)")."""
    run = opguard("run", *sample_inputs(samples, "gpt"), expect=0)
    (group,) = embedded(run.run_dir / "report.html")["entries"][0]["divergence"]["groups"]
    first, gelu = (
        "transformers.pytorch_utils:Conv1D.forward",
        "transformers.activations:NewGELUActivation.forward",
    )
    assert group["target"] == f"{first} (and 9 more)"
    targets = [m["target"] for m in group["members"]]
    assert targets[:2] == [first, gelu] and len(set(targets)) == 10
    lines = page(run.run_dir / "report.html")
    titles = [f"div.sev-warning: {target}" for target in targets]
    assert [line for line in lines if line in titles] == titles
    assert f"li.here: {first}" in lines
    found = page(run.run_dir / "report.html", search=gelu)
    assert f"td: {first} (and 9 more)" in found


@needs_node
def test_a_finding_whose_stack_the_file_left_out_names_its_callsite(
    opguard: Callable[..., Any], samples: Path
) -> None:
    """A version-4 divergence file writes the stack of a group's first finding only
    (of the largest groups); the others were drawn as "stack (0 frames)"."""
    run = opguard("run", *sample_inputs(samples, "gpt"), expect=0)
    doc = json.loads((run.run_dir / "gpt_callsite_divergence.json").read_text())
    fields, rows = doc["groups"][0]["fields"], doc["groups"][0]["findings"]
    callsites = [row[fields.index("callsite")] for row in rows]
    (group,) = embedded(run.run_dir / "report.html")["entries"][0]["divergence"]["groups"]
    assert [m["callsite"] for m in group["members"]] == callsites
    assert "stack" in group["members"][0] and "stack" not in group["members"][1]
    lines = page(run.run_dir / "report.html")
    assert "summary: stack (11 frames, outermost first)" in lines
    assert not any(line.startswith("summary: stack (0 frames") for line in lines)
    notes = [f"div.note: stack: callsite {n} in gpt_callsite_combined.json" for n in callsites]
    assert [line for line in lines if line in notes] == notes[1:]


@pytest.mark.parametrize(
    "doc",
    [
        {
            "format": "opguard-divergence",
            "version": 4,
            "meta": {"ranks": [0, 1, 2]},
            "frames": [],
            "stacks": [],
            "groups": [
                {
                    "kind": "rank_specific",
                    "severity": "warning",
                    "ranks": ["1", 2],
                    "size": 1,
                    "count": 1,
                    "message": "m",
                    "fields": ["target"],
                    "findings": [["t"]],
                }
            ],
        },
        {
            "format": "opguard-divergence",
            "version": 1,
            "meta": {"ranks": [0, 1, 2]},
            "findings": [
                {
                    "kind": "rank_specific",
                    "severity": "warning",
                    "ranks": ["1", 2],
                    "size": 1,
                    "target": "t",
                    "message": "m",
                }
            ],
        },
    ],
    ids=["v4", "v1"],
)
def test_a_divergence_file_with_ranks_not_integers_is_a_note(
    opguard: Callable[..., Any], samples: Path, doc: dict[str, Any]
) -> None:
    """Ranks that are not integers once ended ``opguard report`` in a traceback."""
    run = opguard("run", *sample_inputs(samples, "gpt"), expect=0)
    (run.run_dir / "gpt_callsite_divergence.json").write_text(json.dumps(doc))
    result = opguard("report", run.run_dir, expect=0)
    assert "Traceback" not in result.result.stderr
    view = embedded(run.run_dir / "report.html")["entries"][0]["divergence"]
    assert view["groups"] == [] and "gpt_callsite_divergence.json has malformed" in view["note"]


def test_a_config_too_large_to_read_back_is_a_note_naming_the_command_that_lists_it(
    opguard: Callable[..., Any], samples: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``opguard report RUN`` reads configs back from YAML up to a size; past it the
    note points at ``opguard show`` (it once pointed at the run's page, which the
    command had just replaced)."""
    from opguard_plugins.view import report

    run = opguard("run", *sample_inputs(samples, "gpt"), expect=0)
    monkeypatch.setattr(report, "MAX_CONFIG_ROWS", 3)
    opguard("report", run.run_dir, expect=0)
    notes = json.dumps(embedded(run.run_dir / "report.html"))
    config = run.run_dir / "gpt_callsite_instrumentation.yaml"
    assert f"more than the report reads back from YAML (3); `opguard show {config}`" in notes


def _stack(view: dict[str, Any], path: int) -> list[str]:
    out = []
    while path >= 0:
        parent, frame = view["paths"][path]
        out.insert(0, view["frames"][frame])
        path = parent
    return out


def test_group_findings_by_kind_target_and_rank_set() -> None:
    def f(kind: str, target: str, ranks: list[int], size: int, severity: str = "warning") -> Any:
        return {"kind": kind, "target": target, "ranks": ranks, "size": size,
                "severity": severity, "message": ""}  # fmt: skip

    groups = group_findings(
        [
            f("count_skew", "a:f", [3], 1),
            f("count_skew", "a:f", [3], 5),
            f("count_skew", "a:f", [2, 3], 1),
            f("collective_mismatch", "a:g", [3, 1], 1, "error"),
            f("collective_mismatch", "a:g", [1, 3], 1, "error"),
            f("count_skew", "a:h", [3], 9),
        ]
    )
    keys = [(g["kind"], g["target"], g["ranks"], len(g["findings"]), g["size"]) for g in groups]
    assert keys == [
        ("collective_mismatch", "a:g", [1, 3], 2, 2),  # errors first
        ("count_skew", "a:h", [3], 1, 9),  # then the largest
        ("count_skew", "a:f", [3], 2, 6),
        ("count_skew", "a:f", [2, 3], 1, 1),
    ]
    assert groups[0]["severity"] == "error"


def test_rank_rows_show_which_rank_differs() -> None:
    ranks = list(range(8))
    collective = {"kind": "collective_mismatch", "ranks": [5], "findings": [
        {"counts": {"5": 4}, "expected": 2}, {"counts": {"5": 0}, "expected": 1}]}  # fmt: skip
    assert rank_row(collective, ranks) == {"expected": 3, "values": [[4, "5"]]}
    skew = {"kind": "count_skew", "ranks": [0, 7], "findings": [
        {"counts": {"0": 90, "7": 10}, "expected": 50}]}  # fmt: skip
    assert rank_row(skew, ranks) == {"expected": 50, "values": [[90, "0"], [10, "7"]]}
    # a function most ranks ran: the ranks that did not stand out
    only = {"kind": "rank_specific", "ranks": [0, 1, 2, 3, 4, 6], "findings": [{}]}
    assert rank_row(only, ranks) == {"expected": 1, "values": [[0, "5,7"]]}
    few = {"kind": "rank_specific", "ranks": [2], "findings": [{}]}
    assert rank_row(few, ranks) == {"expected": 0, "values": [[1, "2"]]}


@given(st.sets(st.integers(0, 3000), max_size=200))
def test_rank_ranges_read_back(ranks: set[int]) -> None:
    text = rank_ranges(ranks)
    back: set[int] = set()
    for part in filter(None, text.split(",")):
        a, _, b = part.partition("-")
        back.update(range(int(a), int(b or a) + 1))
    assert back == ranks
    count, shown = rank_text(ranks, limit=20)
    assert count == len(ranks)
    assert shown == text or (shown.endswith("…") and text.startswith(shown[:-1]))


def test_tree_view_keeps_the_largest_nodes_and_their_parents() -> None:
    def node(name: str, count: int, own: int, children: list[Any], ranks: list[int]) -> Any:
        return {"module": "m", "qualname": name, "file": None, "kind": "function",
                "count": count, "self_ops": {"aten::x": own} if own else {},
                "self_streams": {"compute": own} if own else {}, "children": children,
                "ranks": ranks}  # fmt: skip

    leaves = [node(f"leaf{i}", 10 - i, 10 - i, [], [0, 1]) for i in range(6)]
    small = node("small", 1, 1, [], [1])
    mid = node("mid", 45 + 1, 0, [*leaves, small], [0, 1])
    root = {"count": 46, "self_ops": {}, "self_streams": {}, "children": [mid]}
    tree = {"root": root, "meta": {"ranks": [0, 1]}}
    full = tree_view(tree)
    assert full["cut"] == 0 and len(full["n"]) == 9
    names = [full["names"][i] for i in full["n"]]
    assert names == ["all", "m:mid", *[f"m:leaf{i}" for i in range(6)], "m:small"]
    assert full["r"] == {"8": [1, "1"]}  # only the rank-specific node lists its ranks
    assert full["o"][2] == [[full["names"].index("aten::x"), 10]]
    cut = tree_view(tree, limit=4)
    assert cut["cut"] == 5
    assert [cut["names"][i] for i in cut["n"]] == ["all", "m:mid", "m:leaf0", "m:leaf1"]
    assert all(p < i for i, p in enumerate(cut["p"]))  # every parent before its children


def test_many_findings_keep_the_report_small(opguard: Callable[..., Any], samples: Path) -> None:
    """20,000 findings over 1024 ranks (as a later, grouped divergence file would
    summarise): the page embeds at most MAX_GROUPS groups of MAX_MEMBERS findings."""
    run = opguard("run", *sample_inputs(samples, "gpt"), expect=0)
    frames = [f"mod{i % 50}:fn{i}" for i in range(60)]
    findings = [
        {"kind": "collective_mismatch", "severity": "error", "target": f"mod:f{i % 1500}",
         "ranks": [i % 1024], "size": i, "op": f"c10d::op{i % 7}", "counts": {str(i % 1024): 2},
         "expected": 1, "message": "x" * 300, "stack": frames[: 20 + i % 40]}
        for i in range(20_000)
    ]  # fmt: skip
    doc = {"format": "opguard-divergence", "version": 1,
           "meta": {"ranks": list(range(1024))}, "findings": findings}  # fmt: skip
    (run.run_dir / "gpt_callsite_divergence.json").write_text(json.dumps(doc))
    opguard("report", run.run_dir, expect=0)
    report = run.run_dir / "report.html"
    view = embedded(report)["entries"][0]["divergence"]
    assert view["findings"] == 20_000 and view["ngroups"] > MAX_GROUPS
    assert len(view["groups"]) == MAX_GROUPS
    assert max(len(g["members"]) for g in view["groups"]) <= MAX_MEMBERS
    assert view["per_rank"]["collective_mismatch"] == [[20, "0-543"], [19, "544-1023"]]
    assert report.stat().st_size < 1_500_000


def test_a_path_that_is_not_utf8_is_shown_with_its_bytes_escaped(
    opguard: Callable[..., Any], tmp_path: Path
) -> None:
    """A run over inputs whose path is not UTF-8 once wrote no report.html (the hook
    failed), and ``opguard report`` on a run directory so named ended in a traceback."""
    inputs = tmp_path / os.fsdecode(b"in\xffdir")
    inputs.mkdir()
    shutil.copy(EXAMPLES / "single_callsite_rank0.json", inputs)
    run = opguard("run", "-i", str(inputs / "single_callsite_rank*.json"), expect=0)
    assert "run_finished failed" not in run.result.stderr
    data = embedded(run.run_dir / "report.html")
    assert data["summary"]["inputs"] == [
        str(tmp_path / "in\\xffdir" / "single_callsite_rank*.json")
    ]
    renamed = run.run_dir.with_name(os.fsdecode(b"run\xff"))
    run.run_dir.rename(renamed)
    # a subprocess: its stdout writes the odd byte back as it was (CliRunner's cannot)
    done = subprocess.run(
        [sys.executable, "-m", "opguard", "report", renamed], capture_output=True, check=False
    )
    assert (done.returncode, done.stderr) == (0, b"")
    assert done.stdout == os.fsencode(renamed / "report.html") + b"\n"
    assert "<title>OpGuard run run\\xff</title>" in (renamed / "report.html").read_text()


@needs_node
def test_a_stage_time_that_is_not_a_number_does_not_stop_the_page(
    opguard: Callable[..., Any], samples: Path
) -> None:
    """A malformed summary (a stage's ``seconds`` a string) once stopped the page at
    the stages table (``r.seconds.toFixed is not a function``): nothing after it
    was drawn."""
    run = opguard("run", *sample_inputs(samples, "gpt"), expect=0)
    summary_path = run.run_dir / "pipeline_summary.json"
    summary = json.loads(summary_path.read_text())
    summary["stages"][0]["seconds"] = "1.5"
    summary_path.write_text(json.dumps(summary))
    opguard("report", run.run_dir, expect=0)
    lines = page(run.run_dir / "report.html")
    assert "td.num: 1.5" in lines
    assert "td.num: " + f"{summary['stages'][1]['seconds']:.3f}" in lines


@needs_node
def test_a_failed_entry_says_where_and_why(opguard: Callable[..., Any], tmp_path: Path) -> None:
    """An entry whose combine failed once had an empty section."""
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "bad_rank0.json").write_text('{"format": "opguard-callsites", "frames"')
    run = opguard(
        "run", "-i", str(tmp_path / "bad" / "bad_rank*.json"),
        "-i", str(EXAMPLES / "single_callsite_rank*.json"),
    )  # fmt: skip
    error = f"{tmp_path / 'bad' / 'bad_rank0.json'}: not valid JSON: Input data was truncated"
    bad, good = embedded(run.run_dir / "report.html")["entries"]
    assert bad["failures"] == [{"stage": "combine", "error": error}]
    assert good["failures"] == []
    lines = page(run.run_dir / "report.html")
    at = lines.index("h2: Entry 1: bad")
    assert lines[at + 1] == f"p.sev-error: failed at combine: {error}"


@needs_node
def test_an_interrupted_run_says_by_what_and_where(
    opguard: Callable[..., Any], samples: Path
) -> None:
    """The summary's ``interrupted`` (signal, stage, entry) was never shown."""
    run = opguard("run", *sample_inputs(samples, "gpt"), expect=0)
    summary_path = run.run_dir / "pipeline_summary.json"
    summary = json.loads(summary_path.read_text())
    summary.update(status="interrupted", exit_code=130)
    summary["interrupted"] = {"signal": "SIGTERM", "stage": "compress", "entry": "gpt_callsite"}
    summary_path.write_text(json.dumps(summary))
    opguard("report", run.run_dir, expect=0)
    lines = page(run.run_dir / "report.html")
    said = "interrupted by SIGTERM during compress of gpt_callsite"
    assert f"span.sev-error: {said}" in lines
    assert f"td: {said}" in lines  # and in the run's facts


def test_report_command_bad_run_dir(opguard: Callable[..., Any], tmp_path: Path) -> None:
    result = opguard("report", tmp_path, expect=5)
    assert result.stderr == (
        f"opguard: error: {tmp_path}: not a run directory (no pipeline_summary.json)\n"
    )
    missing = tmp_path / "missing"  # said to be no run directory, as if it were there
    result = opguard("report", missing, expect=5)
    assert result.stderr == f"opguard: error: {missing}: no such run directory\n"


def test_the_console_summary_names_the_report(opguard: Callable[..., Any], samples: Path) -> None:
    run = opguard("--log-format", "console", "run", *sample_inputs(samples, "gpt"), expect=0)
    assert run.stderr.splitlines()[-1] == f"  report: {run.run_dir / 'report.html'}"
    quiet = opguard("run", *sample_inputs(samples, "gpt"), "--disable-plugin", "report", expect=0)
    assert not (quiet.run_dir / "report.html").exists()
    summary = [json.loads(line) for line in quiet.stderr.splitlines() if '"run summary"' in line]
    assert summary[-1]["report"] is None


@pytest.mark.slow  # over 2 s in the quick group
def test_report_embeds_the_tree_not_the_ranks(opguard: Callable[..., Any], tmp_path: Path) -> None:
    """A 1024-rank entry: the report does not grow with the ranks each node lists."""
    ranks = list(range(1024))
    doc = trace_doc(
        [([("app", "main"), ("app", f"f{i}")], None, "aten::mm", 10 + i) for i in range(60)],
        ranks=ranks,
    )
    for i, site in enumerate(doc["callsites"]):
        site["ranks"] = ranks[i % 2 :: 2]  # every node lists 512 ranks
    del doc["meta"]["rank"]
    run_dir = opguard("run", "-i", str(write(tmp_path / "big.json", doc)), expect=0).run_dir
    match = DATA.search((run_dir / "report.html").read_text())
    assert match is not None
    data = len(match.group(1))  # the page's data, beside its fixed code and styles
    tree = (run_dir / "big_compressed.json").stat().st_size
    assert data < 100_000 < tree


def test_hook_run_finished(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, samples: Path) -> None:
    seen: list[tuple[Path, dict[str, Any]]] = []
    written: dict[str, Any] = {}

    class Recorder:
        @hookimpl
        def opguard_run_finished(
            self, run_dir: Path, summary: dict[str, Any], configs: dict[str, Any]
        ) -> None:
            seen.append((run_dir, summary))
            written.update(configs)
            raise RuntimeError("a broken end-of-run plugin")

    monkeypatch.setenv("OPGUARD_TRACE_OUTPUT_BASE", str(tmp_path / "out"))
    pm = create_plugin_manager()
    pm.register(Recorder(), name="recorder")
    argv = ["--log-format", "json", "run", *sample_inputs(samples, "gpt")]
    result = CliRunner().invoke(create_cli(pm), argv)
    assert result.exit_code == 0, result.stderr  # a failing hook does not fail the run
    (run_dir,) = (tmp_path / "out").iterdir()
    assert [r for r, _ in seen] == [run_dir.resolve()]
    assert seen[0][1]["status"] == "ok" and seen[0][1]["exit_code"] == 0
    assert "run_finished failed" in result.stderr and "recorder" in result.stderr
    assert (run_dir / "report.html").exists()
    # every config the run wrote, as the objects dumped: the same data as the files
    assert sorted(written) == sorted(p.name for p in run_dir.glob("*instrumentation.yaml"))
    for name, config in written.items():
        assert json.dumps(config) == json.dumps(load_config(run_dir / name))


# ---------------------------------------------------------------- in a browser

needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="chromium (Debian) is not installed")


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Chromium]:
    with Chromium(tmp_path / "chromium-profile", width=1400, height=900) as chromium:
        yield chromium


def open_report(browser: Chromium, report: Path) -> None:
    browser.open(report.as_uri())
    assert browser.evaluate("document.body.dataset.ready") == "1"
    assert browser.errors == []  # no exception, and our code logs nothing at all


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert len(zlib.decompress(b"".join(_idat(data)))) > 0
    return width, height


def _idat(data: bytes) -> Iterator[bytes]:
    at = 8
    while at < len(data):
        (length,) = struct.unpack(">I", data[at : at + 4])
        if data[at + 4 : at + 8] == b"IDAT":
            yield data[at + 8 : at + 8 + length]
        at += 12 + length


def type_search(browser: Chromium, text: str) -> str:
    return str(
        browser.evaluate(
            "(function(){const s=document.querySelector('[data-role=search]');"
            f"s.value={json.dumps(text)};s.dispatchEvent(new Event('input'));"
            "return document.querySelector('.hits').textContent})()"
        )
    )


def count(browser: Chromium, selector: str) -> int:
    return int(browser.evaluate(f"document.querySelectorAll({json.dumps(selector)}).length"))


def texts(browser: Chromium, selector: str, attribute: str = "textContent") -> list[str]:
    found = f"document.querySelectorAll({json.dumps(selector)})"
    return list(browser.evaluate(f"Array.from({found}, e => e.{attribute})"))


def detail_text(browser: Chromium, role: str) -> str:
    """Open the first row of table ``role`` and return its detail's text."""
    table = f"table[data-role={role}]"
    browser.evaluate(f"document.querySelector('{table} tr.row').click()")
    return str(browser.evaluate(f"document.querySelector('{table} tr.detail').innerText"))


def cells(browser: Chromium, role: str, column: int) -> list[str]:
    return list(
        browser.evaluate(
            f"Array.from(document.querySelectorAll('table[data-role={role}] tbody tr.row'))"
            f".map(function(tr){{return tr.children[{column}].textContent}})"
        )
    )


@pytest.mark.slow  # a headless browser
@needs_chromium
def test_the_report_fits_1400_px_final_config_first(
    opguard: Callable[..., Any], samples: Path, tmp_path: Path, browser: Chromium
) -> None:
    run = opguard("run", "-i", str(DIVERGENT), *sample_inputs(samples, "fsdp", "gpt"), expect=0)
    open_report(browser, run.run_dir / "report.html")
    # no horizontal scrolling at 1400 px, and no table wider than the page
    width = browser.evaluate("document.documentElement.scrollWidth")
    assert width <= 1400, width
    widest = browser.evaluate(
        "Math.max(...Array.from(document.querySelectorAll('table')).map(t => t.scrollWidth))"
    )
    assert widest <= 1400 - 2 * 21  # inside main's padding
    # the first section is the final config, sorted by count, compact rows
    first = browser.evaluate("document.querySelector('main section').id")
    assert first == "final-config"
    counts = [int(c.replace(",", "")) for c in cells(browser, "config", 5)]
    config = load_config(run.run_dir / "final_combined_instrumentation.yaml")
    assert counts == sorted((e["count"] for e in config["entries"]), reverse=True)[:30]
    heights = browser.evaluate(
        "Array.from(document.querySelectorAll('table[data-role=config] tr.row'))"
        ".map(tr => tr.getBoundingClientRect().height)"
    )
    assert max(heights) < 24  # one line a row
    # a row opens its ops, streams and ranks
    detail = detail_text(browser, "config")
    assert "ops (" in detail and "streams" in detail and "ranks" in detail
    # counted words read as English: "12 entries", never "12 entrys"
    page = str(browser.evaluate("document.body.innerText"))
    assert re.search(r"\d entries\b", page) and "entrys" not in page, page[:400]
    shot = browser.screenshot(tmp_path / "report.png", full_page=True)
    assert png_size(shot)[0] == 1400


@pytest.mark.slow  # a headless browser
@needs_chromium
def test_search_filters_tables_and_lights_up_the_graph(
    opguard: Callable[..., Any], browser: Chromium
) -> None:
    run = opguard("run", "-i", str(DIVERGENT), expect=0)
    open_report(browser, run.run_dir / "report.html")
    all_rows = count(browser, "table[data-role=config] tr.row")
    note = type_search(browser, "LOG_METRICS")  # case does not matter
    assert "match" in note
    targets = cells(browser, "config", 0)
    contexts = cells(browser, "config", 2)
    assert 0 < len(targets) < all_rows
    assert all("log_metrics" in t + c for t, c in zip(targets, contexts, strict=True))
    hits = browser.evaluate(
        "Array.from(document.querySelectorAll('.flame .hit'), d => d.textContent)"
    )
    assert hits and all("log_metrics" in h for h in hits if h and not h.startswith("+"))
    assert browser.evaluate("document.querySelector('.flame').classList.contains('searching')")
    assert cells(browser, "findings", 2) == ["divergent_job:log_metrics"]
    type_search(browser, "")
    assert count(browser, "table[data-role=config] tr.row") == all_rows
    assert count(browser, ".flame .hit") == 0


@pytest.mark.slow  # a headless browser
@needs_chromium
def test_clicking_a_frame_zooms_and_the_top_row_zooms_out(
    opguard: Callable[..., Any], samples: Path, browser: Chromium
) -> None:
    run = opguard("run", *sample_inputs(samples, "fsdp"), expect=0)
    open_report(browser, run.run_dir / "report.html")
    flame = "document.querySelector('.flame')"
    row_2 = f"Array.from({flame}.children).filter(d => d.style.top === '34px')"  # third row
    narrow = browser.evaluate(
        f"(function(){{const bars={row_2}.filter(d => !d.classList.contains('more'));"
        "bars.sort((a, b) => parseFloat(a.style.width) - parseFloat(b.style.width));"
        "bars[0].click(); return parseFloat(bars[0].style.width)})()"
    )
    full = browser.evaluate(f"{flame}.clientWidth")
    assert narrow < full / 2
    zoomed = browser.evaluate(f"{row_2}.map(d => parseFloat(d.style.width))")
    assert zoomed == [full]  # the clicked frame now spans the graph
    crumbs = browser.evaluate("document.querySelectorAll('.crumbs a').length")
    assert crumbs == 3  # all › its parent › it
    browser.evaluate(f"{flame}.children[0].click()")  # the top row: back to everything
    assert browser.evaluate("document.querySelectorAll('.crumbs a').length") == 1


def pixel(browser: Chromium, kind: str, row: int, rank_position: int) -> list[int]:
    """The colour of a ranks-view cell: ``row`` 0 is the findings-per-rank summary."""
    return list(
        browser.evaluate(
            f"(function(){{const c=document.querySelector('[data-kind={kind}] canvas');"
            "const g=JSON.parse(c.dataset.geometry);"
            f"const x=g.labelW+Math.floor({rank_position}/g.per)*g.cellW+Math.min(1, g.cellW-1);"
            f"const y=g.axisH+{row}*g.rowH+Math.floor(g.rowH/2);"
            "return Array.from(c.getContext('2d').getImageData(x,y,1,1).data)})()"
        )
    )


GREY = [233, 233, 233, 255]


@pytest.mark.slow  # a headless browser
@needs_chromium
def test_the_ranks_view_points_at_the_divergent_rank(
    opguard: Callable[..., Any], browser: Chromium
) -> None:
    """The recorded divergent job: rank 1 issues an extra all_reduce in extra_sync."""
    run = opguard("run", "-i", str(DIVERGENT), expect=0)
    open_report(browser, run.run_dir / "report.html")
    kinds = browser.evaluate(
        "Array.from(document.querySelectorAll('[data-role=ranks]'), b => b.dataset.kind)"
    )
    assert kinds == ["collective_mismatch", "rank_specific"]
    assert pixel(browser, "collective_mismatch", 1, 0) == GREY  # rank 0: as expected
    red, green, blue, _ = pixel(browser, "collective_mismatch", 1, 1)  # rank 1: more
    assert red > 150 and green < 100 and blue < 100
    text = browser.evaluate("document.querySelector('[data-role=ranks]').innerText")
    assert "Ranks in the most findings: rank 1 (1)" in text
    # clicking the row opens its findings in the table
    browser.evaluate(
        "(function(){const c=document.querySelector('[data-role=ranks] canvas');"
        "const g=JSON.parse(c.dataset.geometry);const b=c.getBoundingClientRect();"
        "const y=b.top+g.axisH+g.rowH*1.5;"
        "c.dispatchEvent(new MouseEvent('click',{clientX:b.left+5,clientY:y}))})()"
    )
    detail = browser.evaluate("document.querySelector('[data-role=findings] tr.detail').innerText")
    assert "c10d::allreduce_" in detail and "divergent_job:extra_sync" in detail


@pytest.mark.slow  # a headless browser
@needs_chromium
@pytest.mark.parametrize("nranks", [8, 1024])
def test_one_odd_rank_stands_out_among_8_and_1024(
    opguard: Callable[..., Any], samples: Path, browser: Chromium, nranks: int
) -> None:
    run = opguard("run", *sample_inputs(samples, "gpt"), expect=0)
    odd = nranks * 5 // 8 + 1
    findings = [
        {"kind": "collective_mismatch", "severity": "error", "target": "gpt:step", "ranks": [odd],
         "op": "c10d::allreduce_", "counts": {str(odd): 0}, "expected": 6, "size": 6},
        {"kind": "count_skew", "severity": "warning", "target": "gpt:forward", "ranks": [odd],
         "counts": {str(odd): 900}, "expected": 300, "size": 600},
    ]  # fmt: skip
    doc = {"format": "opguard-divergence", "version": 1,
           "meta": {"ranks": list(range(nranks))}, "findings": findings}  # fmt: skip
    (run.run_dir / "gpt_callsite_divergence.json").write_text(json.dumps(doc))
    opguard("report", run.run_dir, expect=0)
    open_report(browser, run.run_dir / "report.html")
    for kind, shade in (("collective_mismatch", "blue"), ("count_skew", "red")):
        others = [p for p in range(nranks) if p != odd][:: max(1, nranks // 16)]
        assert all(pixel(browser, kind, 1, p) == GREY for p in others)
        r, g, b, _ = pixel(browser, kind, 1, odd)
        assert (b > r + 60) if shade == "blue" else (r > b + 60), (kind, r, g, b)
        summary = pixel(browser, kind, 0, odd)  # the findings-per-rank row marks it too
        assert summary != GREY and summary[0] > summary[2]
    assert browser.evaluate("document.documentElement.scrollWidth") <= 1400


@pytest.mark.slow  # a headless browser
@needs_chromium
def test_hostile_names_stay_text_in_the_browser(
    opguard: Callable[..., Any], tmp_path: Path, browser: Chromium
) -> None:
    run_dir = evil_run(opguard, tmp_path)
    open_report(browser, run_dir / "report.html")
    assert count(browser, "b, i") == 0
    assert browser.evaluate("document.scripts.length") == 2
    kinds = texts(browser, "[data-role=ranks]", "dataset.kind")
    assert sorted(kinds) == sorted([EVIL, "__proto__", "constructor"])
    assert EVIL in detail_text(browser, "findings")  # the hostile text, shown as text
    type_search(browser, "<b>")
    assert browser.errors == [] and count(browser, "b, i") == 0


@pytest.mark.slow  # a headless browser
@needs_chromium
def test_control_and_bidi_characters_in_names_are_shown_escaped(
    opguard: Callable[..., Any], tmp_path: Path, browser: Chromium
) -> None:
    """A right-to-left override would reverse the rest of its cell, an escape sequence
    hide text: the report shows them as \\uXXXX, as the terminal commands do."""
    name = "step\u202eevil\x1b[31m"
    src = write(
        tmp_path / "bidi.json", trace_doc([([("app", "main"), ("app", name)], None, "aten::mm", 7)])
    )
    run_dir = opguard("run", "-i", str(src), expect=0).run_dir
    open_report(browser, run_dir / "report.html")
    page = str(browser.evaluate("document.body.innerText"))
    assert "\u202e" not in page and "\x1b" not in page
    assert "step\\u202eevil\\u001b[31m" in page


@pytest.mark.slow  # generates traces, runs opguard and a browser
@needs_chromium
def test_the_load_benchmark_runs_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "load.md"
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "report_load.py"
    done = subprocess.run(
        [sys.executable, str(script), "--shapes", "4x300", "--repeat", "1",
         "--data", str(tmp_path / "data"), "--output", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    text = out.read_text()
    assert "| 4 × 300 |" in text
    assert "load under 2 s: **yes**" in text and "under 2 MB: **yes**" in text


def test_an_entry_shows_its_dtypes_where_the_config_records_them() -> None:
    """The config table's row ends with the entry's dtypes (largest first), None for an
    entry that records none (a trace without dtypes: formats.md, "Dtypes")."""
    text = (
        "version: 5\nsource: s\nmeta:\n  ranks: [0]\n  total: 9\nentries:\n"
        "  - target: m:f\n    ops:\n      aten::mm: 9\n    stream_counts:\n      compute: 9\n"
        "    dtype_counts:\n      float32: 2\n      float64: 7\n    count: 9\n"
        "  - target: m:g\n    ops:\n      aten::mm: 3\n    count: 3\n"
    )
    rows = {row[0]: row for row in config_view(parse_config(text, "c.yaml"))["rows"]}
    assert rows["m:f"][10] == [["float64", 7], ["float32", 2]]
    assert rows["m:g"][10] is None


def test_the_run_s_report_shows_the_summary_it_wrote(opguard: Any, samples: Path) -> None:
    """The report hook was handed a summary built again after the file's, so its
    ``finished_at`` and ``seconds`` differed from ``pipeline_summary.json``'s (and
    ``opguard report`` on the same directory wrote other bytes)."""
    run = opguard("run", "-i", samples / "fsdp_callsite_rank*.json", expect=0)
    summary = json.loads(run.read("pipeline_summary.json"))
    assert f'"finished_at":"{summary["finished_at"]}"' in run.read("report.html")


@needs_node
@pytest.mark.parametrize("damage", ["missing", "garbled"])
def test_a_divergence_file_gone_or_unreadable_never_reads_as_no_divergence(
    opguard: Callable[..., Any], tmp_path: Path, damage: str
) -> None:
    """A run directory that travelled without its divergence JSON, or with a broken
    one: the page said "No divergence: every rank did the same." and counted 0
    findings (a missing .json had the .log read as the document). It says the file
    cannot be shown, with the counts the run recorded."""
    run = opguard("run", "-i", str(DIVERGENT), expect=0)
    path = run.run_dir / "divergent_callsite_divergence.json"
    recorded = embedded(run.run_dir / "report.html")["entries"][0]["divergence"]
    assert recorded["findings"] > 0
    if damage == "missing":
        path.unlink()
        note = f"{path.name} is missing from the run directory"
    else:
        path.write_text('{"format": "opguard-divergence", "version": 4, "meta": {}, "groups": 5}')
        note = f"{path.name} has no findings list"
    opguard("report", run.run_dir, expect=0)
    view = embedded(run.run_dir / "report.html")["entries"][0]["divergence"]
    assert view["unshown"] and view["note"] == note
    counts = (recorded["findings"], recorded["errors"], recorded["warnings"])
    assert (view["recorded"]["findings"], view["recorded"]["errors"],
            view["recorded"]["warnings"]) == counts  # fmt: skip
    lines = page(run.run_dir / "report.html")
    assert not any("No divergence" in line for line in lines)
    at = lines.index("h3: Divergence: not shown")
    assert lines[at + 1].startswith(f"p.note.sev-error: {note}; the run recorded ")
    assert f"span.sev-error: {recorded['findings']} divergence finding" in "\n".join(lines)


@needs_node
def test_a_call_tree_that_cannot_be_read_is_a_note_not_a_failed_report(
    opguard: Callable[..., Any], tmp_path: Path
) -> None:
    """A truncated ``_compressed.json`` ended ``opguard report`` with exit 5: no page
    for the other entries either."""
    run = opguard("run", "-i", str(DIVERGENT), "-i", str(EXAMPLES / "single_callsite_rank*.json"),
                  expect=0)  # fmt: skip
    tree = run.run_dir / "divergent_callsite_compressed.json"
    tree.write_bytes(tree.read_bytes()[:3000])
    opguard("report", run.run_dir, expect=0)
    broken, whole = embedded(run.run_dir / "report.html")["entries"]
    assert broken["tree"] is None and whole["tree"] is not None
    assert broken["tree_note"] == f"{tree.name}: not valid JSON: Input data was truncated"
    lines = page(run.run_dir / "report.html")
    at = lines.index("h3: Call tree: not shown")
    assert lines[at + 1] == f"p.note.sev-error: {broken['tree_note']}"
