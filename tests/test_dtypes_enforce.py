"""Op dtypes in configs, check and guard (formats.md, "Dtypes"; issue 29, point 5).

The config records, per entry, the dtypes its ops ran in (``dtype_counts``, config
version 5); ``opguard check`` and ``opguard guard`` report an op that ran in another
dtype as an ``unexpected_dtype`` error naming the function. The recording side (the
tracers, the readers) and the pipeline side (combine, compress) have their own tests
(test_dtypes_record.py, test_dtypes_pipeline.py); here: the config's field, merge, the
rule, and whole programs through the public commands and ``guarded()``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from opguard_core.formats.check import CheckInput
from opguard_core.formats.config import CONFIG_VERSION, dump_config, parse_config
from opguard_plugins.enforce.rules import unexpected_dtypes
from opguard_plugins.stages.generate import generate_config
from opguard_plugins.stages.merge import merge_configs

HEAD = "version: {version}\nsource: s\nmeta:\n  ranks: [0]\n  total: 9\nentries:\n"
ENTRY = (
    "  - target: m:f\n    ops:\n      aten::mm: 6\n      aten::empty: 3\n"
    "    stream_counts:\n      compute: 9\n{dtypes}    count: 9\n"
)
FLOAT32 = "    dtype_counts:\n      float32: 6\n"


def config_text(dtypes: str = FLOAT32, version: int = CONFIG_VERSION) -> str:
    return HEAD.format(version=version) + ENTRY.format(dtypes=dtypes)


def test_a_config_records_dtypes_and_refuses_bad_ones() -> None:
    config = parse_config(config_text(), "c.yaml")
    assert CONFIG_VERSION >= 5
    assert dict(config["entries"][0]["dtype_counts"]) == {"float32": 6}
    assert "dtype_counts:\n      float32: 6\n" in dump_config(config)  # a block mapping
    bad = config_text("    dtype_counts:\n      Float 32: 6\n")
    with pytest.raises(Exception, match=r"entries\[0\]\.dtype_counts must map dtype names"):
        parse_config(bad, "c.yaml")
    with pytest.raises(Exception, match=r"dtype_counts needs config version 5"):
        parse_config(config_text(version=4), "c.yaml")
    # a version-4 config (no dtypes) still reads, as the current version
    old = parse_config(config_text("", version=4), "c.yaml")
    assert old["version"] == CONFIG_VERSION and "dtype_counts" not in old["entries"][0]


def test_merge_adds_dtypes_only_where_both_sides_record_them() -> None:
    a = parse_config(config_text(), "a.yaml")
    b = parse_config(config_text("    dtype_counts:\n      float32: 2\n      float64: 4\n"), "b")
    b["source"] = "t"
    merged = merge_configs(a, b)
    assert dict(merged["entries"][0]["dtype_counts"]) == {"float32": 8, "float64": 4}
    # what a source without dtypes ran is unknown: the merged entry says nothing
    unknown = parse_config(config_text(""), "u.yaml")
    unknown["source"] = "u"
    assert "dtype_counts" not in merge_configs(a, unknown)["entries"][0]
    assert "dtype_counts" not in merge_configs(unknown, a)["entries"][0]


def _check(config: Any) -> CheckInput:
    return CheckInput(
        rank=0, key=("m:f", ()), config=config, expected={}, observed={}, ranks=[0], tolerance=0.1
    )


def test_the_rule_names_each_dtype_the_entry_does_not_list() -> None:
    expected = {"dtype_counts": {"float32": 6}}
    check = _check({})
    [found] = unexpected_dtypes({"dtype_counts": {"float32": 1, "float64": 5}}, expected, check)
    assert (found.kind, found.severity, found.dtype) == ("unexpected_dtype", "error", "float64")
    assert found.message == "5 op(s) of m:f ran in float64, which it does not list"
    assert found.to_dict()["dtype"] == "float64"
    # either side without dtypes: nothing to compare
    assert unexpected_dtypes({"dtype_counts": {"float64": 5}}, {}, check) == []
    assert unexpected_dtypes({}, expected, check) == []
    assert unexpected_dtypes({"dtype_counts": {"float32": 2}}, expected, check) == []


def _node(name: str, own: dict[str, int], dtypes: dict[str, int], children: list[Any]) -> Any:
    return {
        "module": "m", "qualname": name, "file": "m.py", "lines": [1], "kind": "function",
        "count": sum(own.values()) + sum(c["count"] for c in children), "self_ops": own,
        "self_streams": {"compute": sum(own.values())}, "self_dtypes": dtypes,
        "ranks": [0], "chain": [], "children": children,
    }  # fmt: skip


@pytest.mark.parametrize("recorded", [True, False])
def test_generate_writes_inclusive_dtype_counts_where_recorded(recorded: bool) -> None:
    inner = _node("g", {"aten::mm": 4, "aten::empty": 1}, {"float64": 4}, [])
    outer = _node("f", {"aten::add": 2}, {"float32": 2}, [inner])
    root = {"name": "<root>", "count": 7, "self_ops": {}, "self_streams": {},
            "self_dtypes": {}, "children": [outer]}  # fmt: skip
    tree = {"format": "opguard-calltree", "meta": {"ranks": [0], "dtypes": recorded},
            "root": root}  # fmt: skip
    entries = {e["target"]: e for e in generate_config(tree, "s", 1)["entries"]}
    if recorded:
        assert dict(entries["m:f"]["dtype_counts"]) == {"float32": 2, "float64": 4}
        assert dict(entries["m:g"]["dtype_counts"]) == {"float64": 4}
    else:
        assert all("dtype_counts" not in e for e in entries.values())


# ------------------------------------------------------------- whole programs

MODEL = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.fc = nn.Linear(8, 8)

    def forward(self, tokens):
        return torch.relu(self.fc(self.embed(tokens))).sum()


def step(model, optimizer, tokens):
    optimizer.zero_grad()
    model(tokens).backward()
    optimizer.step()


def train(steps=3, dtype=torch.float32, index=torch.int64):
    torch.manual_seed(0)
    model = Net().to(dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        step(model, optimizer, torch.randint(0, 16, (4, 3)).to(index))
"""


def _invoke(*args: str | Path) -> Any:
    from click.testing import CliRunner

    from opguard_core.cli.app import create_cli
    from opguard_core.plugin.manager import create_plugin_manager

    cli = create_cli(create_plugin_manager())
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture
def dmodel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The small model module, importable as ``dmodel``."""
    pytest.importorskip("torch")
    from tests.builders import importable_module

    yield from importable_module(tmp_path, monkeypatch, "dmodel", MODEL)


def _trace(tmp_path: Path, label: str, run: Callable[[], None]) -> Path:
    from opguard_plugins.tracer import trace_callsites

    with trace_callsites(label=label, output_dir=tmp_path / label, rank=0):
        run()
    return tmp_path / label / f"{label}_callsite_rank0.json"


def _dtypes(violations: list[dict[str, Any]]) -> set[tuple[str, str]]:
    return {(v["target"], v["dtype"]) for v in violations if v["kind"] == "unexpected_dtype"}


@pytest.mark.torch
def test_check_and_guard_catch_a_model_run_in_another_dtype(tmp_path: Path, dmodel: Any) -> None:
    """A config of the float32 program; the same program in bfloat16 and in float64:
    ``unexpected_dtype`` errors naming the functions, from check (a trace)
    and guard (at run time) alike; the unchanged program: none from either."""
    import torch

    from opguard_core.formats.check import load_report
    from opguard_plugins.enforce.runtime import guarded

    good = _trace(tmp_path, "good", dmodel.train)
    result = _invoke("run", "-i", good, "--output-base", tmp_path / "run")
    assert result.exit_code == 0, result.stderr
    [config] = (tmp_path / "run").glob("*/good_callsite_instrumentation.yaml")
    entries = {e["target"]: e for e in parse_config(config.read_text(), config)["entries"]}
    # the embedding's first tensor argument is its weight: float32 alone
    assert dict(entries["dmodel:Net.forward"]["dtype_counts"]).keys() == {"float32"}
    changes: dict[str, dict[str, Any]] = {
        "same": {},
        "bfloat16": {"dtype": torch.bfloat16},
        "float64": {"dtype": torch.float64},
    }
    for name, change in changes.items():
        trace = _trace(tmp_path, name, lambda change=change: dmodel.train(**change))
        result = _invoke("check", "--config", config, "--format", "json", "-i", trace)
        checked = json.loads(result.stdout)["violations"]
        with guarded(config, report_dir=tmp_path / f"g_{name}", rank=0) as guard:
            dmodel.train(**change)
        assert guard.written is not None
        at_run_time = load_report(guard.written)["violations"]
        assert _dtypes(checked) == _dtypes(at_run_time), name
        assert all(v["severity"] == "error" for v in checked if v["kind"] == "unexpected_dtype")
        if name == "same":
            assert _dtypes(checked) == set() and result.exit_code == 0
        else:
            assert result.exit_code == 1
        if name != "same":  # named by function and dtype
            assert ("dmodel:Net.forward", name) in _dtypes(checked)


def test_compare_shows_dtype_changes_where_both_entries_record_them() -> None:
    from opguard_plugins.stages.compare import compare_configs, diff_configs, diff_to_json

    first = parse_config(config_text(), "a.yaml")
    other = parse_config(config_text("    dtype_counts:\n      float64: 6\n"), "b.yaml")
    text = compare_configs(first, other, "a", "b")
    assert "      dtype float32: 6 -> 0 (-6)\n" in text
    assert "      dtype float64: 0 -> 6 (+6)\n" in text
    [changed] = diff_to_json(diff_configs(first, other, "a", "b"))["changed"]["entries"]
    assert {d["dtype"] for d in changed["dtypes"]} == {"float32", "float64"}
    # an entry without dtypes says nothing of them: no change to report
    unknown = parse_config(config_text(""), "u.yaml")
    assert "dtype" not in compare_configs(first, unknown, "a", "u")
