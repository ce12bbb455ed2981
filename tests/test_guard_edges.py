"""The guard's rough edges (issue 29, point 4), on whole programs (subprocesses: slow).

* ``guarded()`` around a training loop at a script's top level, with the model
  defined in the script, is clean on the unchanged program (traced with ``opguard
  trace``, made into a config by ``opguard run``), also run five times longer, and
  still catches an edit;
* the violations the guard prints on stderr are the ones its report (and ``opguard
  guard``'s summary line) counts: an ``unknown_context`` below the config's pruning
  threshold is neither printed nor counted.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from opguard_core.formats.check import load_report
from opguard_core.formats.config import dump_config, load_config
from tests.builders import run_opguard as run

pytestmark = [pytest.mark.torch, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"

#: A user's script: model, data, loop and evaluation at the top level; GUARD_CONFIG
#: puts the loop under guarded(), EDIT adds an op to Block.forward.
SCRIPT = """
import os
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

STEPS = int(os.environ.get("STEPS", "6"))


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.conv = nn.Conv2d(width, width, 3, padding=1)
        self.norm = nn.BatchNorm2d(width)
        self.gate = nn.Linear(width, width)

    def forward(self, x):
        y = F.relu(self.norm(self.conv(x)))
        if os.environ.get("EDIT"):
            y = torch.tanh(y)
        g = torch.sigmoid(self.gate(y.mean(dim=(2, 3))))[:, :, None, None]
        return x + y * g


class Net(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.blocks = nn.ModuleList([Block(16) for _ in range(3)])
        self.head = nn.Linear(16, classes)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


def batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 10, (8,), generator=g)


def evaluate(model):
    model.eval()
    with torch.no_grad():
        x, y = batch(1000)
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    model.train()
    return accuracy


torch.manual_seed(0)
model = Net()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
guard = nullcontext()
if os.environ.get("GUARD_CONFIG"):
    from opguard_plugins.enforce.runtime import guarded

    guard = guarded(os.environ["GUARD_CONFIG"], report_dir=os.environ["GUARD_REPORTS"])
with guard:
    for step in range(STEPS):
        x, y = batch(step)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        if step % 3 == 2:
            print(f"step {step} loss {loss.item():.4f} accuracy {evaluate(model):.2f}")
"""

VIOLATION = "opguard guard: violation"


def printed(stderr: str) -> list[dict[str, Any]]:
    """The violations the guard logged (JSON lines: stderr is not a terminal)."""
    return [json.loads(line) for line in stderr.splitlines() if VIOLATION in line]


def make_run(tmp_path: Path, trace: str, *options: str) -> Path:
    out = tmp_path / f"out{len(list(tmp_path.glob('out*')))}"
    proc = run("run", "-i", trace, "--output-base", out, *options)
    assert proc.returncode == 0, proc.stderr
    return Path(proc.stdout.strip().splitlines()[-1])


def run_guarded(script: Path, config: Path, reports: Path, **env: str) -> tuple[Any, Any]:
    environment = {**os.environ, "GUARD_CONFIG": str(config), "GUARD_REPORTS": str(reports)}
    environment.update(env)
    environment.pop("OPGUARD_GUARD_LOG_FORMAT", None)
    proc = subprocess.run(
        [sys.executable, script.name],
        cwd=script.parent,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, load_report(reports / "guard_report_rank0.json")


def test_guarded_at_a_scripts_top_level_is_clean_on_the_unchanged_program(
    tmp_path: Path,
) -> None:
    script = tmp_path / "net.py"
    script.write_text(SCRIPT)
    traced = run("trace", "--label", "net", "--output-dir", tmp_path / "t", "--", "python", script)
    assert traced.returncode == 0, traced.stderr
    trace = str(tmp_path / "t" / "net_callsite_rank0.json")
    # depth 2: the evaluation's pruned subtrees make contexts the config does not
    # list, below its threshold; they used to be printed as unknown_context
    for depth in ("1", "2"):
        run_dir = make_run(tmp_path, trace, "--context-depth", depth)
        reports = tmp_path / f"clean{depth}"
        proc, report = run_guarded(script, run_dir, reports)  # a run directory, as check
        assert printed(proc.stderr) == [], (depth, proc.stderr[-3000:])
        assert report["violations"] == [] and report["steps"] == 6, depth
        # five times the traced steps: what the config pruned stays below its
        # threshold, scaled by the steps (the config records 6)
        proc, longer = run_guarded(script, run_dir, tmp_path / f"long{depth}", STEPS="30")
        assert printed(proc.stderr) == [] and longer["violations"] == [], depth
        assert longer["steps"] == 30
        assert report["targets_seen"] > 0  # the script's own classes are on the stack
        config = load_config(run_dir / "net_callsite_instrumentation.yaml")
        listed = {str(e["target"]) for e in config["entries"]}
        assert {"net:Block.forward", "net:Net.forward", "net:evaluate"} <= listed
        # and the guard is awake: the same edit check catches is caught
        proc, report = run_guarded(script, run_dir, tmp_path / f"edit{depth}", EDIT="1")
        ops = {(v["target"], v["op"]) for v in report["violations"] if v["severity"] == "error"}
        assert ("net:Block.forward", "aten::tanh") in ops, report["violations"]
        assert len(printed(proc.stderr)) == len(report["violations"])


def _edited(config_path: Path, out: Path, min_count: int) -> Path:
    """The single example's config with ``aten::gelu`` taken out of every entry (each
    one that ran it now makes an ``unexpected_op``), ``MLP.forward`` moved to a context
    it never runs in (an ``unknown_context`` of 96 ops), and ``min_count`` set."""
    config = load_config(config_path)
    config["meta"]["settings"]["min_count"] = min_count
    for entry in config["entries"]:
        ops = entry.get("ops") or {}
        if "aten::gelu" in ops:
            del ops["aten::gelu"]
        if entry["target"] == "tiny_gpt:MLP.forward":
            entry["context"] = ["tiny_gpt:TinyGPT.forward"]
    out.write_text(dump_config(config))
    return out


@pytest.mark.parametrize("min_count", [1, 100_000])
def test_the_printed_violations_are_the_counted_ones(tmp_path: Path, min_count: int) -> None:
    """``opguard guard``'s summary line counts exactly the violations printed (errors
    as they occur, an ``unknown_context`` when the guard finishes): with ``min_count``
    100000 the moved entry's ``unknown_context`` is below the threshold, so it is
    neither printed nor counted (it was printed and not counted); with 1 it is both."""
    proc = run(
        "trace", "--label", "p", "--output-dir", tmp_path / "t",
        "--", "python", EXAMPLES / "train_single.py",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    run_dir = make_run(tmp_path, str(tmp_path / "t" / "p_callsite_rank0.json"))
    config = _edited(run_dir / "p_callsite_instrumentation.yaml", tmp_path / "c.yaml", min_count)
    reports = tmp_path / "reports"
    proc = run(
        "guard", "--config", config, "--report-dir", reports,
        "--", "python", EXAMPLES / "train_single.py",
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    summary = re.search(r"opguard guard: (\d+) error\(s\), (\d+) warning\(s\)", proc.stderr)
    assert summary, proc.stderr[-3000:]
    errors, warnings = int(summary[1]), int(summary[2])
    lines = printed(proc.stderr)
    assert errors == sum(v["severity"] == "error" for v in lines) > 0
    assert warnings == sum(v["severity"] == "warning" for v in lines)
    report = load_report(reports / "guard_report_rank0.json")
    assert sorted((v["kind"], v["target"], v["context"]) for v in report["violations"]) == sorted(
        (v["kind"], v["target"], v["context"]) for v in lines
    )
    unknown = [v for v in lines if v["kind"] == "unknown_context"]
    moved = [v for v in unknown if v["target"] == "tiny_gpt:MLP.forward"]
    assert len(moved) == (1 if min_count == 1 else 0), unknown
