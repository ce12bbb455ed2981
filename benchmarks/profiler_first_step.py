"""The ``profiler`` backend's first step against its later ones (issue 29, point 5).

A program that, after ``import torch``, does what a library's import does before the
model exists (``--calls`` Python function calls; importing transformers runs about a
million), then builds a small MLP and trains it for ``--steps`` steps, timing each step
itself (forward, backward, optimizer step, with any fold the tracer does in its step
hook). It runs untraced and under ``opguard trace --backend profiler``, ``--repeat``
times each, alternating; the report gives, per mode, the first step, the median and the
slowest of the later steps (milliseconds, medians over the runs) and the whole run.

Run: ``python benchmarks/profiler_first_step.py [--calls 3000000] [--steps 30]``.
Goal (docs/performance.md): the first traced step costs what the later ones cost.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROGRAM = """
import json, os, sys, time
import torch

def work(i):
    return i + 1

def library_import(calls):  # a library's import: Python calls, no torch op
    total = 0
    for i in range(calls):
        total = work(total)
    return total

library_import(int(sys.argv[1]))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
times = []
for step in range(int(sys.argv[2])):
    start = time.perf_counter()
    model(torch.randn(32, 64)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    times.append(time.perf_counter() - start)
with open(os.environ["STEP_TIMES"], "w") as f:
    json.dump(times, f)
"""


def run(traced: bool, calls: int, steps: int, directory: Path) -> tuple[list[float], float]:
    """(seconds of each step, seconds of the whole process)."""
    times = directory / "times.json"
    command = [sys.executable, str(directory / "program.py"), str(calls), str(steps)]
    if traced:
        opguard = [sys.executable, "-m", "opguard_core.cli.app", "trace", "--backend", "profiler"]
        command = [*opguard, "--output-dir", str(directory / "traces"), "--", *command]
    start = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True,
                   env={**os.environ, "STEP_TIMES": str(times)})  # fmt: skip
    whole = time.perf_counter() - start
    return json.loads(times.read_text()), whole


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3_000_000)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    rows: dict[str, list[tuple[float, float, float, float]]] = {"untraced": [], "profiler": []}
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        (directory / "program.py").write_text(PROGRAM)
        for _ in range(args.repeat):
            for mode in rows:
                times, whole = run(mode == "profiler", args.calls, args.steps, directory)
                later = times[1:]
                rows[mode].append((times[0], statistics.median(later), max(later), whole))
    print(f"{args.calls} Python calls before the model, {args.steps} steps, "
          f"median of {args.repeat} runs (ms; whole run s)")  # fmt: skip
    print(f"{'mode':<10} {'first':>9} {'later med':>10} {'later max':>10} {'first/med':>10} "
          f"{'whole s':>8}")  # fmt: skip
    for mode, values in rows.items():
        first, median, slowest, whole = (statistics.median(v) for v in zip(*values, strict=True))
        print(f"{mode:<10} {first * 1e3:>9.1f} {median * 1e3:>10.2f} {slowest * 1e3:>10.1f} "
              f"{first / median:>9.1f}x {whole:>8.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
