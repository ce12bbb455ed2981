"""Time and memory of ``opguard run`` against the shape: N ranks and M callsites.

Runs the measurement of ``run_benchmark.py`` (whose functions it imports) over a list
of shapes, on each generator, and prints one markdown table, a row per generator and
shape. Two sweeps: the number of ranks at a fixed number of callsites
(``--ranks`` at ``--at-callsites``) and the number of callsites at a fixed number of
ranks (``--callsites`` at ``--at-ranks``). Shapes run smallest first (ranks ×
callsites), both generators of a shape one after the other.

For each shape it:

1. generates the rank files under ``--data`` unless they are there (as
   ``run_benchmark.py`` does; the same folders, so either script reuses the other's);
2. times the bare parse with the collector off, with ``msgspec.json.decode`` (the
   parser that wins in every run of ``run_benchmark.py`` so far; timing orjson and the
   GC-on parse as well would double the time of the large shapes), in one process and
   split over two forked processes (``run_benchmark.bare_parse``'s floors);
   ``--no-parse`` skips both;
3. runs ``opguard run`` as a subprocess (``run_benchmark.run_opguard``): wall seconds,
   peak RSS of the process tree (polled every 50 ms) and of the largest single process
   (``wait4``), and each stage's seconds from ``pipeline_summary.json``;
4. deletes the shape's rank files when they come to more than ``--cleanup-above-gb``.

The columns: generator, N, M, MB of rank files, ``opguard run`` wall seconds, the
GC-off parse's seconds, the run over it, the run over the 2-process GC-off parse, the
peak RSS of the process tree and of the largest process, and the slowest stage with
its seconds; then the combine, divergence and compress stages' seconds and the
number of callsites in the combined trace (the rank-only callsites of the other
generator make it grow with N). Run it niced on a shared machine (it takes minutes
per large shape, most of it generating and parsing), e.g.::

    nice -n 10 python benchmarks/curves.py --ranks 8,32,128,512,1024 --at-callsites 40000 \\
        --callsites 40000,160000,640000 --at-ranks 4 --generators team,other \\
        --cleanup-above-gb 2 --output /tmp/curves.md

``--ranks ''`` or ``--callsites ''`` leaves a sweep out.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import generate_traces_other
import run_benchmark as rb
from generate_traces import Shape
from side_by_side import compile_checkout

import opguard_core

PARSER = "msgspec.json.decode"


@dataclasses.dataclass
class Row:
    generator: str
    ranks: int
    callsites: int
    megabytes: float
    wall: float
    parse_gc_off: float
    parse_two: float
    peak_rss_tree: int
    peak_rss_single: int
    slowest_stage: str
    slowest_seconds: float
    exit_code: int
    #: seconds of the combine, divergence and compress stages (NaN where absent)
    combine: float = float("nan")
    divergence: float = float("nan")
    compress: float = float("nan")
    #: callsites in the combined trace (the combine stage's count)
    combined_callsites: int = 0


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def shapes(
    ranks: Sequence[int], at_callsites: int, callsites: Sequence[int], at_ranks: int
) -> list[tuple[int, int]]:
    """The (N, M) of both sweeps, without repeats, smallest N × M first."""
    found = {(n, at_callsites) for n in ranks} | {(at_ranks, m) for m in callsites}
    return sorted(found, key=lambda s: (s[0] * s[1], s[0]))


def make_shape(generator: str, ranks: int, callsites: int, seed: int) -> rb.AnyShape:
    if generator == "team":
        return Shape(ranks=ranks, callsites=callsites, seed=seed)
    return generate_traces_other.OtherShape(ranks=ranks, callsites=callsites, seed=seed)


def generate_in_child(generator: str, ranks: int, callsites: int, seed: int, data: Path) -> None:
    """Generate a shape's rank files (unless present) in a child process.

    Not in this process: ``wait4``'s max RSS of a child started with vfork and exec
    (``subprocess`` on Linux) counts the parent's own peak RSS, so a parent that had
    held a large shape's generation would inflate every later run's "largest process".
    """
    args = [sys.executable, __file__, "--generate-child", generator, str(ranks)]
    subprocess.run([*args, str(callsites), str(seed), str(data)], check=True)


def _warm(path: Path) -> None:
    """Read a file into the page cache without holding it (this process stays small)."""
    with open(path, "rb") as handle:
        while handle.read(1 << 20):
            pass


def measure(
    shape: rb.AnyShape, data: Path, parse: bool, extra: Sequence[str], cleanup_above_gb: float
) -> Row:
    """One row: generate (if missing), parse, run; delete large data afterwards."""
    generator = "team" if isinstance(shape, Shape) else "other"
    generate_in_child(generator, shape.ranks, shape.callsites, shape.seed, data)
    paths = rb.ensure_data(data, shape)  # present now: only the paths
    megabytes = sum(p.stat().st_size for p in paths) / 1e6
    out = Path(tempfile.mkdtemp(prefix="opguard-curves-out-"))
    try:
        gc_off = two = float("nan")
        if parse:
            for path in paths:  # warm the page cache, as run_benchmark.bare_parse does
                _warm(path)
            gc_off = rb._timed_parse(paths, PARSER, "off", 1)[0]
            two = rb._timed_parse(paths, PARSER, "off", 2)[0]
        run = rb.run_opguard(paths, out / "run", extra)
    finally:
        shutil.rmtree(out, ignore_errors=True)
        if megabytes / 1e3 > cleanup_above_gb:
            shutil.rmtree(rb.data_dir(data, shape), ignore_errors=True)
    stages = [s for s in run.stages if s.get("status") != "skipped"]
    slowest = max(stages, key=lambda s: float(s.get("seconds", 0.0)), default=None)
    seconds = {s["stage"]: float(s.get("seconds", 0.0)) for s in stages}
    combined = next((s for s in stages if s["stage"] == "combine"), {})
    return Row(
        generator=generator,
        ranks=shape.ranks,
        callsites=shape.callsites,
        megabytes=megabytes,
        wall=run.wall,
        parse_gc_off=gc_off,
        parse_two=two,
        peak_rss_tree=run.peak_rss_tree,
        peak_rss_single=run.peak_rss_single,
        slowest_stage=slowest["stage"] if slowest else "—",
        slowest_seconds=float(slowest.get("seconds", 0.0)) if slowest else float("nan"),
        exit_code=run.exit_code,
        combine=seconds.get("combine", float("nan")),
        divergence=seconds.get("divergence", float("nan")),
        compress=seconds.get("compress", float("nan")),
        combined_callsites=int(combined.get("counts", {}).get("callsites", 0)),
    )


def _num(value: float, digits: int = 2) -> str:
    return "—" if value != value else f"{value:,.{digits}f}"  # NaN: not measured


HEADER = (
    "| generator | N | M | data MB | opguard run wall s | GC-off parse s | run / GC-off parse "
    "| run / 2-process parse | peak RSS tree MiB | largest process MiB | slowest stage (s) "
    "| combine / divergence / compress s | combined callsites |\n"
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|"
)


def table_row(row: Row) -> str:
    failed = "" if row.exit_code == 0 else f" (exit code {row.exit_code})"
    return (
        f"| {row.generator} | {row.ranks} | {row.callsites:,} | {row.megabytes:,.0f} | "
        f"{row.wall:.2f}{failed} | {_num(row.parse_gc_off)} | "
        f"{_num(row.wall / row.parse_gc_off)} | {_num(row.wall / row.parse_two)} | "
        f"{row.peak_rss_tree / 2**20:,.0f} | {row.peak_rss_single / 2**20:,.0f} | "
        f"{row.slowest_stage} ({_num(row.slowest_seconds)}) | "
        f"{_num(row.combine)} / {_num(row.divergence)} / {_num(row.compress)} | "
        f"{row.combined_callsites:,} |"
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--ranks", default="8,32,128,512,1024", help="N sweep (comma-separated)")
    parser.add_argument("--at-callsites", type=int, default=40_000, help="M of the N sweep")
    parser.add_argument("--callsites", default="40000,160000,640000", help="M sweep")
    parser.add_argument("--at-ranks", type=int, default=4, help="N of the M sweep")
    parser.add_argument("--generators", default="team,other", help="team, other or both")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", type=Path, default=rb.DEFAULT_DATA, help="rank files' root")
    parser.add_argument("--no-parse", action="store_true", help="skip the bare parse")
    parser.add_argument(
        "--cleanup-above-gb",
        type=float,
        default=2.0,
        help="delete a shape's rank files after measuring it when they are larger (GB)",
    )
    parser.add_argument("--output", "-o", type=Path, default=None, help="also write the table")
    parser.add_argument("opguard_args", nargs="*", help="more `opguard run` options, after --")
    args = parser.parse_args(argv)
    for name in args.generators.split(","):
        if name not in rb.GENERATORS:
            parser.error(f"unknown generator {name!r} (choose from {', '.join(rb.GENERATORS)})")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["--generate-child"]:
        name, n, m, seed, data = sys.argv[2:7]
        rb.ensure_data(Path(data), make_shape(name, int(n), int(m), int(seed)))
        return 0
    args = parse_args(argv)
    compile_checkout(Path(opguard_core.__file__).resolve().parent.parent)
    todo = shapes(_ints(args.ranks), args.at_callsites, _ints(args.callsites), args.at_ranks)
    generators = [g for g in args.generators.split(",") if g]
    print(f"Machine: {rb.machine()}\n", flush=True)
    print(HEADER, flush=True)
    lines = []
    for ranks, callsites in todo:
        for generator in generators:
            shape = make_shape(generator, ranks, callsites, args.seed)
            started = time.perf_counter()
            row = measure(
                shape, args.data, not args.no_parse, args.opguard_args, args.cleanup_above_gb
            )
            lines.append(table_row(row))
            print(lines[-1], flush=True)
            print(
                f"  ({generator} {ranks} × {callsites}: {time.perf_counter() - started:.0f} s "
                "with generating and parsing)",
                file=sys.stderr,
                flush=True,
            )
    text = f"Machine: {rb.machine()}\n\n{HEADER}\n" + "\n".join(lines) + "\n"
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text)
    return 0 if all("(exit code" not in line for line in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
