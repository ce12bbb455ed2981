"""Benchmark ``opguard run`` on a generated rank set against a bare JSON parse.

For one shape (``--ranks N --callsites M``) it:

1. generates the rank files (benchmarks/generate_traces.py) unless they exist;
2. times a **bare parse** of the same files with the fastest available parser
   (``msgspec.json.decode`` untyped and ``orjson.loads`` if installed: the faster
   one counts), reading each file and decoding it, one after the other, in a fresh
   child process, with the garbage collector as Python leaves it; then the same
   with the collector off (the strict floor; its peak RSS is the memory
   reference), and with the collector off split over two forked processes (half
   the files each: the floor on two cores);
3. byte-compiles opguard's modules (as ``pip install`` of a wheel does; an editable
   install writes them on first use, unless ``PYTHONDONTWRITEBYTECODE`` is set, as on
   the machine these figures come from, where every run would otherwise compile
   about 50 modules again: 0.1 s), then runs ``opguard run`` on them **as a
   subprocess**, measuring wall seconds and
   peak RSS of the child and its helper processes (the peak of their summed RSS,
   polled every 50 ms with psutil; and the largest single process's max RSS from
   ``wait4``), and reads each stage's seconds from ``pipeline_summary.json``;
4. optionally (``--memory-ranks 8,32``) runs the same shape with other rank counts
   and compares peak RSS.

Prints a markdown report (and writes it to ``--output``).

    python benchmarks/run_benchmark.py --ranks 16 --callsites 40000 --memory-ranks 8,32
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import psutil

import opguard_core

sys.path.insert(0, str(Path(__file__).resolve().parent))
import generate_traces_other
from generate_traces import Shape, generate
from side_by_side import compile_checkout

DEFAULT_DATA = Path(tempfile.gettempdir()) / "opguard-bench"


@dataclasses.dataclass
class RunFigures:
    ranks: int
    callsites: int
    megabytes: float
    wall: float
    peak_rss_tree: int
    peak_rss_single: int
    exit_code: int
    stages: list[dict[str, Any]]
    command: str
    #: the tree's peak with shared pages split between their processes (PSS)
    peak_pss_tree: int = 0


@dataclasses.dataclass
class ParseFigures:
    parser: str
    seconds: float
    seconds_gc_off: float
    all_parsers: dict[str, float]
    #: the GC-off parse split over ``processes`` forked processes (half the files each
    #: on two), the floor where the machine has that many cores
    seconds_parallel: float = float("nan")
    processes: int = 2
    #: peak RSS of the GC-off single-process parse (its process tree)
    peak_rss: int = 0


#: the data sets: the project's own generator, and one shaped unlike it
#: (generate_traces_other.py: deep random stacks, counts differing on every rank)
GENERATORS = ("team", "other")

AnyShape = Shape | generate_traces_other.OtherShape


def data_dir(base: Path, shape: AnyShape) -> Path:
    return base / f"{shape.label}_r{shape.ranks}_m{shape.callsites}_s{shape.seed}"


def ensure_data(base: Path, shape: AnyShape) -> list[Path]:
    """The rank files of ``shape``, generated if missing."""
    folder = data_dir(base, shape)
    paths = [folder / f"{shape.label}_callsite_rank{r}.json" for r in range(shape.ranks)]
    if not all(p.exists() for p in paths):
        if isinstance(shape, Shape):
            generate(shape, folder)
        else:
            generate_traces_other.generate(shape, folder)
    return paths


def _parsers() -> dict[str, Callable[[bytes], Any]]:
    parsers: dict[str, Callable[[bytes], Any]] = {"msgspec.json.decode": msgspec.json.decode}
    try:
        import orjson

        parsers["orjson.loads"] = orjson.loads
    except ImportError:
        pass
    return parsers


def _parse_all(paths: Sequence[str], parse: Callable[[bytes], Any]) -> None:
    for path in paths:
        with open(path, "rb") as handle:
            parse(handle.read())


def parse_child(parser: str, gc_mode: str, processes: int) -> None:
    """The body of a bare-parse child: file paths on stdin, seconds on stdout.

    With ``processes`` > 1 the files are dealt round-robin to that many forked
    processes, and the time is until the last one is done.
    """
    paths = sys.stdin.read().split("\n")
    paths = [p for p in paths if p]
    parse = _parsers()[parser]
    if gc_mode == "off":
        gc.disable()
    started = time.perf_counter()
    children = []
    for index in range(1, processes):
        pid = os.fork()
        if pid == 0:
            _parse_all(paths[index::processes], parse)
            os._exit(0)
        children.append(pid)
    _parse_all(paths[0::processes], parse)
    for pid in children:
        os.waitpid(pid, 0)
    print(f"{time.perf_counter() - started:.6f}")


@dataclasses.dataclass
class ChildFigures:
    wall: float
    peak_rss_tree: int
    peak_rss_single: int
    exit_code: int
    stdout: str
    stderr: str
    peak_pss_tree: int = 0


def measure_child(
    args: Sequence[str], stdin: bytes = b"", env: dict[str, str] | None = None, pss: bool = False
) -> ChildFigures:
    """Run ``args``; wall seconds, peak RSS of its process tree (the largest sum of the
    RSS of the child and its descendants, polled every 50 ms), the same with PSS (a
    forked process's pages shared with its parent counted once, split between them;
    only with ``pss``, as reading it slows a large run by 4-8 %, and only while the
    tree has more than one process, else its RSS) and the peak of its largest
    single process (``wait4``)."""
    started = time.perf_counter()
    child = subprocess.Popen(
        args,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )
    assert child.stdin is not None
    child.stdin.write(stdin)
    child.stdin.close()
    peak = peak_pss = 0
    proc = psutil.Process(child.pid)
    while True:
        try:
            subs = proc.children(recursive=True)
            rss = proc.memory_info().rss
            shared = proc.memory_full_info().pss if subs and pss else rss
            for sub in subs:
                with contextlib.suppress(psutil.Error):
                    sub_rss = sub.memory_info().rss
                    rss += sub_rss
                    shared += sub.memory_full_info().pss if pss else sub_rss
            peak, peak_pss = max(peak, rss), max(peak_pss, shared)
        except psutil.Error:
            pass
        finished, status, usage = os.wait4(child.pid, os.WNOHANG)
        if finished:
            break
        time.sleep(0.05)
    wall = time.perf_counter() - started
    code = os.waitstatus_to_exitcode(status)
    stdout = child.stdout.read().decode() if child.stdout else ""
    stderr = child.stderr.read().decode() if child.stderr else ""
    child.returncode = code
    return ChildFigures(wall, peak, usage.ru_maxrss * 1024, code, stdout, stderr, peak_pss)


def _timed_parse(
    paths: Sequence[Path], parser: str, gc_mode: str, processes: int
) -> tuple[float, int]:
    """(seconds, peak RSS of the process tree) of one bare-parse child."""
    args = [sys.executable, __file__, "--parse-child", parser, gc_mode, str(processes)]
    fig = measure_child(args, "\n".join(map(str, paths)).encode())
    if fig.exit_code != 0:
        sys.exit(f"the bare parse failed: {fig.stderr[-2000:]}")
    return float(fig.stdout.strip()), max(fig.peak_rss_tree, fig.peak_rss_single)


def bare_parse(paths: Sequence[Path], repeat: int = 1, processes: int = 2) -> ParseFigures:
    """Best-of-``repeat`` time to read and parse every file in a fresh process, per
    parser (the fastest wins), with the collector on; then the winner with the
    collector off, in one process and split over ``processes``."""
    for path in paths:  # warm the page cache, as for the opguard run
        path.read_bytes()
    times = {}
    for name in _parsers():
        times[name] = min(_timed_parse(paths, name, "on", 1)[0] for _ in range(repeat))
    best = min(times, key=lambda k: times[k])
    runs = [_timed_parse(paths, best, "off", 1) for _ in range(repeat)]
    parallel = min(_timed_parse(paths, best, "off", processes)[0] for _ in range(repeat))
    return ParseFigures(
        best,
        times[best],
        min(r[0] for r in runs),
        times,
        seconds_parallel=parallel,
        processes=processes,
        peak_rss=max(r[1] for r in runs),
    )


def run_opguard(
    paths: Sequence[Path],
    out: Path,
    extra: Sequence[str],
    env: dict[str, str] | None = None,
    pss: bool = False,
) -> RunFigures:
    """``opguard run`` on ``paths`` as a child process; wall time and peak RSS."""
    out.mkdir(parents=True, exist_ok=True)
    pattern = str(paths[0].parent / paths[0].name.replace("_rank0.json", "_rank*.json"))
    args = [
        sys.executable, "-m", "opguard_core.cli.app", "--log-format", "json", "run",
        "--output-base", str(out), "--input", pattern, *extra,
    ]  # fmt: skip
    fig = measure_child(args, env=env, pss=pss)
    if fig.exit_code != 0:
        print(fig.stderr[-4000:], file=sys.stderr)
    run_dir = Path(fig.stdout.strip().splitlines()[-1]) if fig.stdout.strip() else None
    stages: list[dict[str, Any]] = []
    if run_dir and (run_dir / "pipeline_summary.json").exists():
        summary = json.loads((run_dir / "pipeline_summary.json").read_text())
        stages = summary.get("stages", [])
    size = sum(p.stat().st_size for p in paths) / 1e6
    return RunFigures(
        ranks=len(paths),
        callsites=0,
        megabytes=size,
        wall=fig.wall,
        peak_rss_tree=fig.peak_rss_tree,
        peak_rss_single=fig.peak_rss_single,
        exit_code=fig.exit_code,
        stages=stages,
        command="opguard run " + " ".join(args[args.index("run") + 1 :]),
        peak_pss_tree=fig.peak_pss_tree,
    )


def _mib(value: int) -> str:
    return f"{value / 2**20:,.0f} MiB"


def machine() -> str:
    memory = psutil.virtual_memory().total / 2**30
    cpu = platform.processor() or platform.machine()
    return (
        f"{psutil.cpu_count(logical=True)} CPUs ({cpu}), {memory:.0f} GiB RAM, "
        f"Python {platform.python_version()}, {platform.system()} {platform.release()}"
    )


def report(
    shape: AnyShape,
    parse: ParseFigures,
    run: RunFigures,
    memory: list[RunFigures],
    extra: Sequence[str],
    pss: bool = False,
) -> str:
    lines = [
        f"## {shape.ranks} ranks × {shape.callsites:,} callsites ({run.megabytes:,.0f} MB, "
        f"generator {shape.label})",
        "",
        f"Machine: {machine()}",
        "",
        f"Command: `{run.command}`",
        "",
        "| what | wall s | peak RSS (process tree) | ratio to bare parse |",
        "|---|---:|---:|---:|",
        f"| bare parse ({parse.parser}, read + decode every file) | {parse.seconds:.2f} | | 1.00 |",
        f"| bare parse, GC off | {parse.seconds_gc_off:.2f} | {_mib(parse.peak_rss)} | "
        f"{parse.seconds_gc_off / parse.seconds:.2f} |",
        f"| bare parse, GC off, {parse.processes} processes | {parse.seconds_parallel:.2f} | | "
        f"{parse.seconds_parallel / parse.seconds:.2f} |",
    ]
    for stage in run.stages:
        if stage.get("status") == "skipped":
            continue
        name = stage["stage"] + (f" [{stage['entry']}]" if stage.get("entry") else "")
        seconds = float(stage.get("seconds", 0.0))
        lines.append(f"| stage {name} | {seconds:.2f} | | {seconds / parse.seconds:.2f} |")
    status = "" if run.exit_code == 0 else f" (exit code {run.exit_code})"
    lines.append(
        f"| **opguard run, end to end**{status} | **{run.wall:.2f}** | "
        f"**{_mib(run.peak_rss_tree)}** | **{run.wall / parse.seconds:.2f}** |"
    )
    lines += [
        "",
        f"End to end / bare parse: **{run.wall / parse.seconds:.2f}×**; "
        f"against the GC-off parse: **{run.wall / parse.seconds_gc_off:.2f}×**; "
        f"against the GC-off parse in {parse.processes} processes: "
        f"**{run.wall / parse.seconds_parallel:.2f}×**. "
        + (
            f"Peak RSS / the GC-off parse's: **{run.peak_rss_tree / parse.peak_rss:.2f}×**"
            + (
                f" (peak PSS {_mib(run.peak_pss_tree)}: "
                f"**{run.peak_pss_tree / parse.peak_rss:.2f}×**)"
                if pss
                else ""
            )
            + ". "
            if parse.peak_rss
            else ""
        )
        + "Parsers: "
        + ", ".join(f"{k} {v:.2f} s" for k, v in sorted(parse.all_parsers.items()))
        + f". Largest single process: {_mib(run.peak_rss_single)}.",
    ]
    if memory:
        lines += [
            "",
            "| ranks | MB of traces | wall s | peak RSS (process tree) | largest process |"
            + (" peak PSS (process tree) |" if pss else ""),
            "|---:|---:|---:|---:|---:|" + ("---:|" if pss else ""),
        ]
        # the run above is one of the rank counts compared (--memory-ranks 128 beside
        # --ranks 8: 128 against 8, not 128 against itself); a count run twice: the
        # --memory-ranks run
        by_ranks = {fig.ranks: fig for fig in (run, *memory)}
        figures = [by_ranks[ranks] for ranks in sorted(by_ranks)]
        for fig in figures:
            lines.append(
                f"| {fig.ranks} | {fig.megabytes:,.0f} | {fig.wall:.2f} | "
                f"{_mib(fig.peak_rss_tree)} | {_mib(fig.peak_rss_single)} |"
                + (f" {_mib(fig.peak_pss_tree)} |" if pss else "")
            )
        low, high = figures[0], figures[-1]
        lines += [
            "",
            f"Peak RSS {high.ranks} vs {low.ranks} ranks: "
            f"**{high.peak_rss_tree / low.peak_rss_tree:.2f}×** (process tree), "
            f"{high.peak_rss_single / low.peak_rss_single:.2f}× (largest process)"
            + (
                f", {high.peak_pss_tree / low.peak_pss_tree:.2f}× (PSS of the process tree: "
                "a page the fork shares counted once)."
                if pss
                else "."
            ),
        ]
    if extra:
        lines += ["", f"Extra `opguard run` options: `{' '.join(extra)}`"]
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", "-n", type=int, default=16)
    parser.add_argument("--callsites", "-m", type=int, default=40_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--generator",
        choices=GENERATORS,
        default="team",
        help="team: generate_traces.py; other: generate_traces_other.py (shaped unlike it)",
    )
    parser.add_argument(
        "--data",
        type=Path,
        default=DEFAULT_DATA,
        help=f"where generated traces go (default {DEFAULT_DATA})",
    )
    parser.add_argument(
        "--memory-ranks",
        default="",
        help="comma-separated rank counts to compare peak RSS, e.g. 8,32",
    )
    parser.add_argument(
        "--jobs", "-j", default=None, help="pass --jobs to opguard run (default: opguard's default)"
    )
    parser.add_argument("--executor", default=None, help="pass --executor to opguard run")
    parser.add_argument("--no-parse", action="store_true", help="skip the bare parse")
    parser.add_argument(
        "--pss",
        action="store_true",
        help="also poll the process tree's PSS (shared pages counted once; slows the "
        "run by 4-8 %%: take times from a run without it)",
    )
    parser.add_argument("--repeat", type=int, default=1, help="bare parse: best of this many")
    parser.add_argument(
        "--cleanup", action="store_true", help="delete the generated traces afterwards"
    )
    parser.add_argument("--output", "-o", type=Path, default=None, help="also write the report")
    parser.add_argument("opguard_args", nargs="*", help="more `opguard run` options, after --")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    if argv is None and sys.argv[1:2] == ["--parse-child"]:
        parser, gc_mode, processes = sys.argv[2:5]
        parse_child(parser, gc_mode, int(processes))
        return
    args = parse_args(argv)
    extra = list(args.opguard_args)
    if args.jobs is not None:
        extra += ["--jobs", str(args.jobs)]
    if args.executor is not None:
        extra += ["--executor", args.executor]
    shape: AnyShape = (
        Shape(ranks=args.ranks, callsites=args.callsites, seed=args.seed)
        if args.generator == "team"
        else generate_traces_other.OtherShape(
            ranks=args.ranks, callsites=args.callsites, seed=args.seed
        )
    )
    made: list[Path] = []
    out = Path(tempfile.mkdtemp(prefix="opguard-bench-out-"))
    try:
        paths = ensure_data(args.data, shape)
        made.append(data_dir(args.data, shape))
        if args.no_parse:
            parse = ParseFigures("none", float("nan"), float("nan"), {})
        else:
            parse = bare_parse(paths, args.repeat)
        compile_checkout(Path(opguard_core.__file__).resolve().parent.parent)
        run = run_opguard(paths, out / "main", extra, pss=args.pss)
        run.callsites = shape.callsites
        memory = []
        for count in [int(x) for x in args.memory_ranks.split(",") if x.strip()]:
            other = dataclasses.replace(shape, ranks=count)
            other_paths = ensure_data(args.data, other)
            made.append(data_dir(args.data, other))
            memory.append(run_opguard(other_paths, out / f"mem{count}", extra, pss=args.pss))
            if args.cleanup and count != shape.ranks:
                shutil.rmtree(data_dir(args.data, other), ignore_errors=True)
        text = report(shape, parse, run, memory, extra, pss=args.pss)
        print(text)
        if args.output:
            args.output.parent.mkdir(parents=True, exist_ok=True)
            args.output.write_text(text)
        failed = [fig for fig in (run, *memory) if fig.exit_code != 0]
        if failed:
            sys.exit(
                f"opguard run failed ({failed[0].ranks} ranks, exit code {failed[0].exit_code}):"
                " the figures above are not a benchmark"
            )
    finally:
        shutil.rmtree(out, ignore_errors=True)
        if args.cleanup:
            for folder in made:
                shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
