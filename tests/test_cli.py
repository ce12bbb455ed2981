"""End-to-end runs of ``opguard run`` on the real sample traces."""

from __future__ import annotations

import json
from pathlib import Path

from ruamel.yaml import YAML

from opguard_core.tree_format import load_tree


def test_two_entries_write_every_artifact(opguard, samples: Path) -> None:
    run = opguard(
        "run",
        "--input",
        samples / "fsdp_callsite_rank0.json",
        samples / "fsdp_callsite_rank1.json",
        "--input",
        str(samples / "gpt_callsite_rank*.json"),
        "--basic",
        expect=0,
    )
    names = sorted(p.name for p in run.run_dir.iterdir())
    assert names == [
        "comparison_1_vs_2.log",
        "final_combined_filtered_instrumentation.yaml",
        "final_combined_instrumentation.yaml",
        "fsdp_callsite_combined.json",
        "fsdp_callsite_compressed.json",
        "fsdp_callsite_instrumentation.yaml",
        "gpt_callsite_combined.json",
        "gpt_callsite_compressed.json",
        "gpt_callsite_instrumentation.yaml",
        "pipeline_summary.json",
        "temp_combined_1.yaml",
    ]
    summary = json.loads(run.read("pipeline_summary.json"))
    assert summary["exit_code"] == 0
    assert [e["name"] for e in summary["entries"]] == ["fsdp_callsite", "gpt_callsite"]
    assert {s["status"] for s in summary["stages"]} == {"ok"}
    tree = load_tree(run.run_dir / "gpt_callsite_compressed.json")
    assert tree["root"]["count"] == 2826 + 2722
    config = YAML(typ="safe").load(run.read("final_combined_instrumentation.yaml"))
    assert config["meta"] == {"ranks": [0, 1], "total": 6241 + 5548}
