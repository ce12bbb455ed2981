"""A config's ``collectives`` (config version 4; formats.md, "Collective sequences in a
config"): generate writes the good run's sequences, merge and filter carry them,
validation refuses a broken one in one line, and the guard takes them from the config
(``--source`` picks one of a merged config's; the torchrun jobs that prove it end to
end are in tests/test_sequence_guard.py).
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from opguard_core.errors import InputError, UsageProblem
from opguard_core.formats.config import CONFIG_VERSION, dump_config, load_config, parse_config
from opguard_core.formats.config_collectives import read_config_collectives
from opguard_core.formats.trace import load_trace
from opguard_plugins.enforce.sequence_guard import SequenceChecker, config_sequences
from opguard_plugins.stages.merge import merge_configs
from tests.test_collective_sequences import rank_doc

REPO = Path(__file__).resolve().parent.parent

#: (step, op, dtype, numel, line): a job that all-reduces, broadcasts, then repeats
ALLREDUCE = ("c10d::allreduce_", "float32", 6, 10)
CALLS = [(0, *ALLREDUCE), (0, "c10d::broadcast_", "int64", 2, 11), (1, *ALLREDUCE), (2, *ALLREDUCE)]


def opguard(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "opguard", *map(str, args)],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip


def pipeline(tmp_path: Path, jobs: dict[str, list[Any]], *extra: str) -> Path:
    """The run directory of ``opguard run`` over 2-rank jobs (name -> calls)."""
    traces = tmp_path / "traces"
    traces.mkdir()
    for name, calls in jobs.items():
        for rank in (0, 1):
            (traces / f"{name}_rank{rank}.json").write_text(json.dumps(rank_doc(rank, calls)))
    inputs = [str(traces / f"{name}_rank*.json") for name in jobs]
    done = opguard("run", "--output-base", tmp_path / "runs", *extra, "-i", *inputs)
    assert done.returncode == 0, done.stderr[-2000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    return run_dir


def test_generate_writes_the_good_runs_sequences(tmp_path: Path) -> None:
    run_dir = pipeline(tmp_path, {"job": CALLS})
    path = run_dir / "job_instrumentation.yaml"
    text = path.read_text()
    assert text.startswith(f"version: {CONFIG_VERSION}\n")
    section = text[text.index("collectives:\n") :]
    assert section == (
        "collectives:\n"
        "  - source: job\n"
        "    ranks: [0, 1]\n"
        "    groups:\n"
        "      0: {name: '0', desc: default_pg, size: 2, ranks: [0, 1]}\n"
        "    signatures:\n"
        "      0: {op: c10d::allreduce_, group: 0, dtype: float32, numel: 6, reduce_op: sum,"
        " shapes: ['6'], at: job:step (job.py:10)}\n"
        "      1: {op: c10d::broadcast_, group: 0, dtype: int64, numel: 2, shapes: ['2'],"
        " at: job:step (job.py:11)}\n"
        "    steps:\n"
        "      0-0: [0, 1]\n"
        "      1-1: [0]\n"
        "      2-2: [0]\n"
    )
    # what the config says is what the trace recorded (but the frames)
    (expected,) = load_trace(run_dir / "job_combined.json").collectives.sequences  # type: ignore[union-attr]
    (found,) = read_config_collectives(load_config(path)["collectives"], path)["job"].sequences
    assert found.ranks == expected.ranks and found.groups == expected.groups
    assert found.steps == expected.steps
    assert [s.key() for s in found.signatures] == [s.key() for s in expected.signatures]
    # the fast writer and reader handle the section: load and write give the same bytes
    assert dump_config(parse_config(text, path)) == text


def test_merge_and_filter_carry_every_sources_sequences(tmp_path: Path) -> None:
    other = [(0, "c10d::allgather_", "bfloat16", 4, 20)]
    run_dir = pipeline(tmp_path, {"a": CALLS, "b": other}, "--basic")
    for name in (
        "final_combined_instrumentation.yaml",
        "final_combined_filtered_instrumentation.yaml",
    ):
        config = load_config(run_dir / name)
        found = read_config_collectives(config["collectives"], name)
        assert sorted(found) == ["a", "b"]
        assert [s.op for s in found["b"].sequences[0].signatures] == ["c10d::allgather_"]


def _config(source: str, op: str) -> dict[str, Any]:
    text = (
        f"version: 4\nsource: {source}\nmeta:\n  ranks: [0]\n  total: 1\nentries:\n"
        f"  - target: job:main\n    ops:\n      aten::add: 1\n    count: 1\n"
        f"collectives:\n  - source: {source}\n    ranks: [0]\n    groups:\n"
        f"      0: {{name: '0', size: 1, ranks: [0]}}\n    signatures:\n"
        f"      0: {{op: '{op}', group: 0}}\n    steps:\n      0-9: [0]\n"
    )
    return parse_config(text, f"{source}.yaml")


def test_merge_of_sequences_is_order_independent() -> None:
    configs = [_config("a", "c10d::allreduce_"), _config("b", "c10d::broadcast_"),
               _config("a", "c10d::barrier")]  # fmt: skip
    written = set()
    for x, y, z in itertools.permutations(configs):
        written.add(dump_config(merge_configs(merge_configs(x, y), z)))
        written.add(dump_config(merge_configs(x, merge_configs(y, z))))
    assert len(written) == 1
    merged = parse_config(written.pop(), "merged")
    # source a twice, differently: the same one wins whatever the order
    assert [item["source"] for item in merged["collectives"]] == ["a", "b"]


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (("0-9: [0]", "9-0: [0]"), "collectives[0].steps[0] is out of order ([9, 0])"),
        (("0-9: [0]", "0-x: [0]"), "collectives[0].steps.0-x must be first-last"),
        (("0-9: [0]", "0-9: [3]"), "steps[0] refers to signature 3"),
        (("group: 0}", "group: 2}"), "signatures[0].group is 2"),
        (("ranks: [0]\n    groups", "ranks: []\n    groups"), "collectives[0].ranks must be"),
        (("op: c10d::allreduce_", "op: 1"), "collectives[0].signatures.0 must be a mapping"),
        ((f"version: {CONFIG_VERSION}", "version: 3"), "collectives needs config version 4"),
    ],
)
def test_a_broken_section_is_refused_in_one_line(
    tmp_path: Path, change: tuple[str, str], problem: str
) -> None:
    text = dump_config(_config("a", "c10d::allreduce_"))
    assert change[0] in text
    path = tmp_path / "c.yaml"
    path.write_text(text.replace(*change))
    with pytest.raises(InputError) as caught:
        load_config(path)
    assert problem in str(caught.value) and str(path) in str(caught.value)
    assert "\n" not in str(caught.value)
    done = opguard("show", path)
    assert done.returncode == 5 and problem in done.stderr and "Traceback" not in done.stderr


def test_the_guard_takes_the_configs_sequences(tmp_path: Path) -> None:
    config = _config("a", "c10d::allreduce_")
    sequences = config_sequences(config, "a.yaml")
    assert sequences is not None
    seen: list[str] = []
    checker = SequenceChecker(
        sequences, lambda violation, message, may_raise: seen.append(violation.kind)
    )
    assert checker.bind(0)
    checker.check("c10d::allreduce_", ("0", None, None, None, None), 0, "job:step")
    assert seen == []
    checker.check("c10d::broadcast_", ("0", None, None, None, None), 1, "job:step")
    assert seen == ["collective_order"]


def test_a_merged_config_needs_a_source(tmp_path: Path) -> None:
    merged = merge_configs(_config("a", "c10d::allreduce_"), _config("b", "c10d::broadcast_"))
    with pytest.raises(UsageProblem, match=r"several sources \(a, b\): name the one"):
        config_sequences(merged, "m.yaml")
    assert (
        config_sequences(merged, "m.yaml", "b").sequences[0].signatures[0].op == "c10d::broadcast_"
    )  # type: ignore[union-attr]
    path = tmp_path / "m.yaml"
    path.write_text(dump_config(merged))
    cases = [((), "name the one the program must follow with --source"),
             (("--source", "c"), "--source c: the config's sources are a, b")]  # fmt: skip
    for extra, problem in cases:
        done = opguard("guard", "--config", path, *extra, "--", sys.executable, "-c", "pass")
        assert done.returncode == 2, done.stderr
        assert problem in done.stderr and "Traceback" not in done.stderr
    assert (
        config_sequences(load_config(REPO / "tests/data/configs/gpt_callsite_v1.yaml"), "v1")
        is None
    )
