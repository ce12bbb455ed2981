"""Scale of the small things (issue 30, point 4): costs that must follow the size of
the input, not the square of a count or the magnitude of a rank number.

Each figure runs ``python -m opguard ...`` as a subprocess on generated inputs and
reads wall seconds (and, for the run's own merge, the merge stage's seconds from
``pipeline_summary.json``):

1. ``opguard run`` on N one-rank inputs (N = 250, 500, 1000, 2000 by default):
   seconds and seconds per input (linear: the last column stays flat);
2. ``opguard merge`` of two configs of E entries each (E = 4000) against the merge
   stage of ``opguard run`` over two inputs that generate the same two configs
   (``--merge-repeat`` pairs, and their medians);
3. ``opguard run`` on one trace whose ``meta.ranks`` lists 100,000 ranks against the
   same trace on one rank: seconds and ``_compressed.json`` bytes;
4. the same trace as rank 1048575 against rank 0.

Prints a markdown report (and writes it to ``--output``). Not a test: nothing here
asserts a time.

    python benchmarks/small_things.py --inputs 250,500,1000,2000 --entries 4000
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def frame(module: str, qualname: str, line: int) -> dict[str, Any]:
    return {
        "file": module.replace(".", "/") + ".py",
        "line": line,
        "function": qualname.rsplit(".", 1)[-1],
        "qualname": qualname,
        "module": module,
    }


def trace(sites: int, offset: int = 0, **meta: Any) -> dict[str, Any]:
    """A version-4 trace whose ``sites`` callsites each sit in their own function
    (``work{offset + i}`` called from ``main``): ``sites`` config entries."""
    frames = [frame("app", "main", 1)]
    callsites = []
    for i in range(sites):
        frames.append(frame(f"mod{(offset + i) % 97}", f"work{offset + i}", 10 + i % 500))
        for op, count in (("aten::add", 1), ("aten::mul", 2)):
            callsites.append(
                {"stack": [0, len(frames) - 1], "op": op, "stream": 0, "role": "compute",
                 "count": count}
            )  # fmt: skip
    return {
        "format": "opguard-callsites",
        "version": 4,
        "meta": {"world_size": 1, **meta},
        "frames": frames,
        "callsites": callsites,
    }


def write(path: Path, doc: dict[str, Any]) -> Path:
    path.write_text(json.dumps(doc))
    return path


#: CPU seconds (user + system) of the last :func:`opguard` command and its children
LAST_CPU = [0.0]


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def opguard(*args: str, cwd: Path) -> tuple[float, int]:
    """Wall seconds and exit code of ``python -m opguard ARGS`` (its CPU seconds in
    :data:`LAST_CPU`: on a shared machine wall time waits for other work, CPU does not)."""
    cpu = _children_cpu()
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "opguard", *args], cwd=cwd, capture_output=True, text=True
    )
    seconds = time.perf_counter() - start
    LAST_CPU[0] = _children_cpu() - cpu
    if done.returncode not in (0,):
        sys.stderr.write(done.stderr[-2000:])
    return seconds, done.returncode


def run_dir(base: Path) -> Path:
    return max(base.glob("preprocessing_*"), key=lambda p: p.stat().st_mtime)


def stage_seconds(run: Path, stage: str) -> float:
    summary = json.loads((run / "pipeline_summary.json").read_text())
    return sum(float(s.get("seconds") or 0) for s in summary["stages"] if s["stage"] == stage)


def many_inputs(work: Path, counts: list[int]) -> list[str]:
    rows = [
        "| inputs | seconds | seconds/input | CPU seconds | CPU seconds/input | exit |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for n in counts:
        folder = work / f"inputs{n}"
        folder.mkdir()
        for i in range(n):
            write(folder / f"job{i}.json", trace(2, offset=i % 7, rank=0))
        out = work / f"out{n}"
        seconds, code = opguard("run", "-i", str(folder / "job*.json"),
                                "--output-base", str(out), cwd=work)  # fmt: skip
        cpu = LAST_CPU[0]
        rows.append(
            f"| {n} | {seconds:.1f} | {seconds / n:.4f} | {cpu:.1f} | {cpu / n:.4f} | {code} |"
        )
    return rows


def merge_figures(work: Path, entries: int, repeat: int = 1) -> list[str]:
    """The run's merge stage against the ``opguard merge`` command on the run's two
    configs, ``repeat`` times in turn (run, command, run, command, ...): each pair's
    figures, then the medians."""
    folder = work / "merge"
    folder.mkdir()
    write(folder / "left.json", trace(entries, offset=0, rank=0))
    write(folder / "right.json", trace(entries, offset=entries // 2, rank=1))
    rows = [
        f"| pair ({entries} + {entries} entries) | run's merge stage s | `opguard merge` "
        "wall s | CPU s | ratio | same bytes | exits |",
        "|---:|---:|---:|---:|---:|---|---|",
    ]
    stages, commands, cpus = [], [], []
    for index in range(repeat):
        out = folder / f"out{index}"
        _, code = opguard("run", "-i", str(folder / "left.json"), "-i",
                          str(folder / "right.json"), "--min-fraction", "0",
                          "--output-base", str(out), cwd=work)  # fmt: skip
        run = run_dir(out)
        stage = stage_seconds(run, "merge")
        left, right = (run / f"{n}_instrumentation.yaml" for n in ("left", "right"))
        merged = folder / f"m{index}.yaml"
        seconds, code2 = opguard("merge", str(left), str(right), "-o", str(merged), cwd=work)
        same = merged.read_bytes() == (run / "final_combined_instrumentation.yaml").read_bytes()
        stages.append(stage)
        commands.append(seconds)
        cpus.append(LAST_CPU[0])
        rows.append(
            f"| {index + 1} | {stage:.2f} | {seconds:.2f} | {LAST_CPU[0]:.2f} "
            f"| {seconds / max(stage, 1e-9):.2f} | {same} | {code}, {code2} |"
        )
    stage, command = statistics.median(stages), statistics.median(commands)
    rows.append(
        f"| median | {stage:.2f} | {command:.2f} | {statistics.median(cpus):.2f} "
        f"| {command / max(stage, 1e-9):.2f} | | |"
    )
    return rows


def rank_figures(work: Path, ranks: int, big_rank: int) -> list[str]:
    folder = work / "ranks"
    folder.mkdir()
    cases = {
        "rank 0": trace(20, rank=0),
        f"{ranks} ranks": trace(20, ranks=list(range(ranks))),
        f"rank {big_rank}": trace(20, rank=big_rank),
    }
    rows = ["| trace | seconds | _compressed.json bytes | exit |", "|---|---:|---:|---:|"]
    for i, (label, doc) in enumerate(cases.items()):
        path = write(folder / f"case{i}.json", doc)
        out = folder / f"out{i}"
        seconds, code = opguard("run", "-i", str(path), "--output-base", str(out), cwd=work)
        compressed = run_dir(out) / f"case{i}_compressed.json"
        size = compressed.stat().st_size if compressed.exists() else -1
        rows.append(f"| {label} | {seconds:.2f} | {size} | {code} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inputs", default="250,500,1000,2000", help="N for the run figures")
    parser.add_argument("--entries", type=int, default=4000, help="entries per merged config")
    parser.add_argument("--merge-repeat", type=int, default=3, help="pairs of merge figures")
    parser.add_argument("--ranks", type=int, default=100_000, help="ranks of the wide trace")
    parser.add_argument("--big-rank", type=int, default=1_048_575)
    parser.add_argument("--output", type=Path, default=None, help="also write the report here")
    parser.add_argument(
        "--no-bytecode",
        action="store_true",
        help="no bytecode cache: every command compiles its modules (PYTHONDONTWRITEBYTECODE)",
    )
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.inputs.split(",") if n]
    with tempfile.TemporaryDirectory(prefix="opguard-small-") as tmp:
        work = Path(tmp)
        if not args.no_bytecode:
            # bytecode cached outside the tree, as an installed package has it: without
            # it each command compiles its modules again (about 0.13 s a start here)
            os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
            os.environ["PYTHONPYCACHEPREFIX"] = str(work / "pycache")
        else:
            os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
        lines = [
            "# Scale of the small things",
            "",
            f"Python {sys.version.split()[0]}, {os.cpu_count()} CPUs, "
            + ("no bytecode cache." if args.no_bytecode else "bytecode cached (as installed)."),
            "",
            "## `opguard run` on N one-rank inputs",
            "",
            *many_inputs(work, counts),
            "",
            "## Merging two configs",
            "",
            *merge_figures(work, args.entries, args.merge_repeat),
            "",
            "## Many ranks, large rank numbers",
            "",
            *rank_figures(work, args.ranks, args.big_rank),
        ]
    report = "\n".join(lines) + "\n"
    sys.stdout.write(report)
    if args.output is not None:
        args.output.write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
