"""Determinism (issue 5, part 4): the same inputs, in any order and run twice, give
byte-identical artifacts (all but ``pipeline_summary.json``), with no timestamps or
absolute paths inside them."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.builders import sample_inputs

SUMMARY = "pipeline_summary.json"
REPORT = "report.html"  # shows the summary (timestamps, paths), like it
#: artifacts whose content depends on input order by definition (1 vs N, fold order)
ORDER_DEPENDENT = re.compile(r"^(comparison_1_vs_\d+\.log|temp_combined_\d+\.yaml)$")
DATE = re.compile(rb"(19|20)\d\d-?[01]\d-?[0-3]\d[T _]?[0-2]\d:?[0-5]\d")


def artifacts(run_dir: Path) -> dict[str, bytes]:
    skip = (SUMMARY, REPORT)
    return {p.name: p.read_bytes() for p in sorted(run_dir.iterdir()) if p.name not in skip}


def rank_files(samples: Path, name: str) -> list[Path]:
    return sorted(samples.glob(f"{name}_rank*.json"))


@pytest.mark.slow  # > 4 s: the slow group
def test_rerun_gives_byte_identical_artifacts(opguard: Callable[..., Any], samples: Path) -> None:
    args = [
        "run",
        *sample_inputs(samples, "fsdp", "gpt"),
        "--basic",
    ]
    first = opguard(*args, expect=0)
    second = opguard(*args, expect=0)
    assert first.run_dir != second.run_dir
    assert len(artifacts(first.run_dir)) == 14  # with two divergence files per entry
    assert artifacts(first.run_dir) == artifacts(second.run_dir)


def test_rank_file_order_does_not_matter(opguard: Callable[..., Any], samples: Path) -> None:
    files = rank_files(samples, "fsdp_callsite")
    forward = opguard("run", "--basic", "-i", *files, expect=0)
    backward = opguard("run", "--basic", "-i", *reversed(files), expect=0)
    assert artifacts(forward.run_dir) == artifacts(backward.run_dir)
    assert len(artifacts(forward.run_dir)) == 6


def test_parallel_combine_gives_the_same_bytes(opguard: Callable[..., Any], samples: Path) -> None:
    files = rank_files(samples, "gpt_callsite")
    serial = opguard("run", "-i", *files, expect=0)
    parallel = opguard("run", "--jobs", "2", "-i", *reversed(files), expect=0)
    assert artifacts(serial.run_dir) == artifacts(parallel.run_dir)


@pytest.mark.slow  # > 4 s: the slow group
def test_entry_order_does_not_change_any_entry_or_the_final_config(
    opguard: Callable[..., Any], samples: Path
) -> None:
    shutil.copy(samples / "gpt_callsite_rank1.json", samples / "solo.json")
    specs = {
        "fsdp": str(samples / "fsdp_callsite_rank*.json"),
        "gpt": str(samples / "gpt_callsite_rank*.json"),
        "solo": str(samples / "solo.json"),
    }
    outputs = []
    for order in (["fsdp", "gpt", "solo"], ["solo", "fsdp", "gpt"], ["gpt", "solo", "fsdp"]):
        args = [arg for name in order for arg in ("-i", specs[name])]
        run = opguard("run", "--basic", *args, expect=0)
        outputs.append(
            {k: v for k, v in artifacts(run.run_dir).items() if not ORDER_DEPENDENT.match(k)}
        )
    assert "final_combined_instrumentation.yaml" in outputs[0]
    assert "final_combined_filtered_instrumentation.yaml" in outputs[0]
    assert len(outputs[0]) == 15  # solo (one rank) has no divergence files
    for other in outputs[1:]:
        assert other.keys() == outputs[0].keys()
        for name in outputs[0]:
            assert other[name] == outputs[0][name], name


@pytest.mark.parametrize("verbose", [False, True], ids=["quiet", "verbose"])
def test_artifacts_hold_no_timestamps_or_absolute_paths(
    opguard: Callable[..., Any], samples: Path, tmp_path: Path, verbose: bool
) -> None:
    run = opguard(
        "run",
        *(["-v"] if verbose else []),
        *sample_inputs(samples, "fsdp", "gpt"),
        "--basic",
        expect=0,
    )
    forbidden = [
        str(tmp_path).encode(),
        str(tmp_path.resolve()).encode(),
        str(Path.cwd()).encode(),
        run.run_dir.name.encode(),
        b"preprocessing_",
    ]
    found = artifacts(run.run_dir)
    assert len(found) == 14
    for name, content in found.items():
        for needle in forbidden:
            assert needle not in content, f"{name} contains {needle!r}"
        assert DATE.search(content) is None, f"{name} contains a timestamp"
    # the run's own time and place belong in the summary, and are there
    summary = json.loads(run.read(SUMMARY))
    assert summary["run_dir"] == str(run.run_dir.resolve())
    assert DATE.search(summary["started_at"].encode())
