"""Scale of the small things (issue 30, point 4): costs that must follow the size of
the input, not the square of a count or the magnitude of a rank number.

Each figure runs ``python -m opguard ...`` as a subprocess on generated inputs and
reads wall seconds (and, for the run's own merge, the merge stage's seconds from
``pipeline_summary.json``):

1. ``opguard run`` on N one-rank inputs (N = 250, 500, 1000, 2000 by default):
   seconds and seconds per input (linear: the last column stays flat);
2. ``opguard merge`` of two configs of E entries each (E = 4000) against the merge
   stage of ``opguard run`` over two inputs that generate the same two configs;
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


def merge_figures(work: Path, entries: int) -> list[str]:
    folder = work / "merge"
    folder.mkdir()
    write(folder / "left.json", trace(entries, offset=0, rank=0))
    write(folder / "right.json", trace(entries, offset=entries // 2, rank=1))
    out = folder / "out"
    _, code = opguard("run", "-i", str(folder / "left.json"), "-i",
                                str(folder / "right.json"), "--min-fraction", "0",
                                "--output-base", str(out), cwd=work)  # fmt: skip
    run = run_dir(out)
    merge_stage = stage_seconds(run, "merge")
    left, right = (run / f"{n}_instrumentation.yaml" for n in ("left", "right"))
    seconds, code2 = opguard("merge", str(left), str(right), "-o", str(folder / "m.yaml"),
                             cwd=work)  # fmt: skip
    same = (folder / "m.yaml").read_bytes() == (
        run / "final_combined_instrumentation.yaml"
    ).read_bytes()
    return [
        f"| what ({entries} + {entries} entries) | seconds |",
        "|---|---:|",
        f"| `opguard run` merge stage (from its summary) | {merge_stage:.2f} |",
        f"| `opguard merge` command, wall (start, load two configs, merge, write) "
        f"| {seconds:.2f} |",
        f"| ratio command / run merge stage | {seconds / max(merge_stage, 1e-9):.1f} |",
        f"| same bytes as the run's final config | {same} |",
        f"| exit codes (run, merge) | {code}, {code2} |",
    ]


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
    parser.add_argument("--ranks", type=int, default=100_000, help="ranks of the wide trace")
    parser.add_argument("--big-rank", type=int, default=1_048_575)
    parser.add_argument("--output", type=Path, default=None, help="also write the report here")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.inputs.split(",") if n]
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    with tempfile.TemporaryDirectory(prefix="opguard-small-") as tmp:
        work = Path(tmp)
        lines = [
            "# Scale of the small things",
            "",
            f"Python {sys.version.split()[0]}, {os.cpu_count()} CPUs.",
            "",
            "## `opguard run` on N one-rank inputs",
            "",
            *many_inputs(work, counts),
            "",
            "## Merging two configs",
            "",
            *merge_figures(work, args.entries),
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
