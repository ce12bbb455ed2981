"""``opguard run`` from two (or more) checkouts, side by side, rounds alternating.

    python benchmarks/side_by_side.py --source ../before --source . --rounds 3 \\
        --input "/tmp/opguard-bench/bench_r16_m40000_s0/bench_callsite_rank*.json"

Each ``--source`` is a checkout put first on ``PYTHONPATH`` (and the working
directory), as in benchmarks/startup.py, with its modules byte-compiled first (what an
installed package has; see run_benchmark.py). In every round each source runs
``opguard run`` on the same inputs in turn, so a noisy minute hits both. The report
gives each round's wall seconds (the whole process) and the combine and compress
stages' seconds (from ``pipeline_summary.json``), and whether every artifact but the
summary and ``report.html`` is byte-identical to the first source's. Exits non-zero
when a run fails or the artifacts differ.
"""

from __future__ import annotations

import argparse
import compileall
import filecmp
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec

REPO = Path(__file__).resolve().parent.parent
#: artifacts that hold times, paths or dates, so differ from run to run
VARYING = {"pipeline_summary.json", "report.html"}


def compile_checkout(root: Path) -> None:
    """Write the bytecode of a checkout's opguard modules, as an installed package has
    it (this machine sets ``PYTHONDONTWRITEBYTECODE``; performance.md, round three)."""
    for package in ("opguard_core", "opguard_plugins"):
        compileall.compile_dir(root / package, quiet=1)


def run_once(source: Path, inputs: list[str], out: Path) -> tuple[float, dict[str, float], Path]:
    """One ``opguard run`` from ``source``: wall seconds, stage seconds, run directory."""
    env = {**os.environ, "PYTHONPATH": str(source)}
    command = [sys.executable, "-m", "opguard_core.cli.app", "--log-format", "json", "run"]
    start = time.perf_counter()
    done = subprocess.run(
        [*command, "--output-base", str(out), "--input", *inputs],
        cwd=source,
        env=env,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - start
    if done.returncode != 0 or not done.stdout.strip():
        sys.exit(
            f"opguard run from {source} failed (exit {done.returncode}): {done.stderr[-2000:]}"
        )
    run_dir = Path(done.stdout.strip().splitlines()[-1])
    summary = msgspec.json.decode((run_dir / "pipeline_summary.json").read_bytes())
    stages: dict[str, float] = {}
    for record in summary.get("stages", []):
        name = record.get("stage")
        stages[name] = stages.get(name, 0.0) + float(record.get("seconds") or 0.0)
    return wall, stages, run_dir


def differing(left: Path, right: Path) -> list[str]:
    """Artifacts of two run directories that are not byte-identical (or missing)."""
    names = {p.name for p in left.iterdir()} | {p.name for p in right.iterdir()}
    return sorted(
        name
        for name in names - VARYING
        if not (left / name).exists()
        or not (right / name).exists()
        or not filecmp.cmp(left / name, right / name, shallow=False)
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, action="append", required=True)
    parser.add_argument("--input", nargs="+", required=True, help="what opguard run gets")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    sources = [source.resolve() for source in args.source]
    inputs = [str(Path(pattern).absolute()) for pattern in args.input]  # runs change cwd
    for source in sources:
        compile_checkout(source)
    rows: list[list[tuple[float, dict[str, float]]]] = [[] for _ in sources]
    problems: list[str] = []
    with tempfile.TemporaryDirectory(prefix="opguard-side-by-side-") as scratch:
        for round_number in range(args.rounds):
            first: Path | None = None
            for index, source in enumerate(sources):
                out = Path(scratch) / f"r{round_number}_s{index}"
                wall, stages, run_dir = run_once(source, inputs, out)
                rows[index].append((wall, stages))
                if first is None:
                    first = run_dir
                elif round_number == 0:
                    problems += [f"{source}: {name}" for name in differing(first, run_dir)]
    print(f"Inputs: {' '.join(inputs)}; {args.rounds} rounds, alternating.\n")
    print("| source | end to end s (each round) | combine s | compress s |")
    print("|---|---|---|---|")
    for source, runs in zip(sources, rows, strict=True):
        walls = " ".join(f"{wall:.2f}" for wall, _ in runs)
        combine = " ".join(f"{stages.get('combine', 0.0):.2f}" for _, stages in runs)
        compress = " ".join(f"{stages.get('compress', 0.0):.2f}" for _, stages in runs)
        print(f"| {source} | {walls} | {combine} | {compress} |")
    print()
    if problems:
        print("Artifacts differ from the first source's: " + ", ".join(problems))
        sys.exit(1)
    print(
        "Artifacts byte-identical to the first source's (all but "
        + ", ".join(sorted(VARYING))
        + ")."
    )


if __name__ == "__main__":
    main()
