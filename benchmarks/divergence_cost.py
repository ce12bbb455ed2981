"""What the divergence stage costs and writes, this checkout against another, side by side.

For each generator (``team``: generate_traces.py, ``other``: generate_traces_other.py,
whose per-rank counts differ on every rank for every callsite) the rank files are
combined once per child process, then the stage's own work is timed in-process,
with the garbage collector paused as ``opguard run`` pauses it: the
``opguard_divergence`` hook (``find_divergence``), sorting, the JSON document and the
log (what ``opguard_core.run.steps.divergence`` does but write the two files). Each
side runs in its own process (its own checkout on ``sys.path``), the sides
alternating, ``--rounds`` processes a side, ``--repeat`` timings a process (the
least counts); the report gives the median over processes, wall and CPU seconds
(the CPU time waits less for other work on a shared machine).

    python benchmarks/divergence_cost.py                       # this checkout only
    python benchmarks/divergence_cost.py --baseline-ref main   # and main, side by side
    python benchmarks/divergence_cost.py --baseline /path/to/checkout --generator other

``--baseline-ref REF`` extracts ``REF`` with ``git archive`` into a temporary folder
(kept for the next run) and builds its C extensions there. Findings are counted as
the stage returns them; groups are the distinct (kind, deviating ranks), as
version 4 of the divergence document writes them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DEFAULT_DATA = Path(tempfile.gettempdir()) / "opguard-bench"


def child(checkout: Path, data: Path, repeat: int) -> dict[str, Any]:
    """In a process of its own: combine ``data`` with ``checkout``'s code, then time
    the divergence stage ``repeat`` times."""
    sys.path.insert(0, str(checkout))
    import gc
    import time

    from opguard_core.formats import divergence as fmt
    from opguard_core.model import RunOptions
    from opguard_plugins.stages.combine import combine_files
    from opguard_plugins.stages.divergence import find_divergence

    paths = sorted(data.glob("*_callsite_rank*.json"))
    trace = combine_files(paths).result()
    options = RunOptions()
    meta = {"source": data.name, "ranks": trace.ranks, "skew": options.skew,
            "per_rank_stats": trace.per_rank_stats, "sequence_ranks": []}  # fmt: skip
    seconds, cpu = [], []
    gc.collect()
    gc.disable()
    for _ in range(repeat):
        started, cpu_started = time.perf_counter(), time.process_time()
        found = fmt.sort_findings(find_divergence(trace, options))
        if hasattr(fmt, "group_findings"):  # as the step does: grouped once
            groups = fmt.group_findings(found, ordered=True)
            document = fmt.encode_divergence(meta, found, groups)
            log = fmt.render_log(meta, found, groups).encode()
        else:
            document = fmt.encode_divergence(meta, found)
            log = fmt.render_log(meta, found).encode()
        seconds.append(time.perf_counter() - started)
        cpu.append(time.process_time() - cpu_started)
    gc.enable()
    kinds: dict[str, int] = {}
    for f in found:
        kinds[f["kind"]] = kinds.get(f["kind"], 0) + 1
    return {
        "checkout": str(checkout),
        "version": fmt.DIVERGENCE_VERSION,
        "findings": len(found),
        "groups": len({(f["kind"], tuple(f["ranks"])) for f in found}),
        "kinds": kinds,
        "seconds": min(seconds),
        "cpu_seconds": min(cpu),
        "json_bytes": len(document),
        "log_bytes": len(log),
        # what the two files hold, to tell that both sides wrote the same bytes
        "json_sha256": hashlib.sha256(document).hexdigest(),
        "log_sha256": hashlib.sha256(log).hexdigest(),
        "log_lines": log.count(b"\n"),
    }


def ensure_data(base: Path, generator: str, ranks: int, callsites: int) -> Path:
    """The rank files of one generator's shape (made if missing), as run_benchmark.py
    names them."""
    sys.path.insert(0, str(HERE))
    if generator == "team":
        from generate_traces import Shape, generate

        shape: Any = Shape(ranks=ranks, callsites=callsites)
    else:
        from generate_traces_other import OtherShape
        from generate_traces_other import generate as generate_other

        shape = OtherShape(ranks=ranks, callsites=callsites)
    folder = base / f"{shape.label}_r{shape.ranks}_m{shape.callsites}_s{shape.seed}"
    paths = [folder / f"{shape.label}_callsite_rank{r}.json" for r in range(shape.ranks)]
    if not all(p.exists() for p in paths):
        (generate if generator == "team" else generate_other)(shape, folder)
    return folder


def baseline_checkout(ref: str) -> Path:
    """``ref`` of this repository, extracted once into the temporary folder, with its
    C extensions built in place (they are optional: a failed build runs Python)."""
    sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", ref], check=True,
                         capture_output=True, text=True).stdout.strip()  # fmt: skip
    folder = Path(tempfile.gettempdir()) / f"opguard-divergence-base-{sha[:12]}"
    if not (folder / "setup.py").exists():
        folder.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(REPO), "archive", sha], check=True,
                                 capture_output=True).stdout  # fmt: skip
        subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
        subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
                       cwd=folder, check=False, capture_output=True)  # fmt: skip
    return folder


def run_child(checkout: Path, data: Path, repeat: int) -> dict[str, Any]:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run(
        [sys.executable, __file__, "--child", str(checkout), str(data), str(repeat)],
        capture_output=True, text=True, check=False, env=env, cwd=checkout,
    )  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"child for {checkout} failed:\n{proc.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _kib(value: float) -> str:
    return f"{value / 1024:,.0f} KiB" if value < 10 * 1024 * 1024 else f"{value / 2**20:,.1f} MiB"


def report(generator: str, shape: str, sides: dict[str, list[dict[str, Any]]]) -> list[str]:
    lines = [f"## {generator} generator, {shape}"]
    rows = []
    for name, runs in sides.items():
        first = runs[0]
        seconds = statistics.median(r["seconds"] for r in runs)
        cpu = statistics.median(r["cpu_seconds"] for r in runs)
        rows.append((name, first, seconds))
        lines.append(
            f"{name:>9}: v{first['version']}  {first['findings']:>6} findings  "
            f"{first['groups']:>5} groups  stage {seconds * 1e3:8.1f} ms "
            f"(CPU {cpu * 1e3:.1f} ms)  "
            f"{seconds / max(1, first['findings']) * 1e6:7.1f} µs/finding "
            f"(CPU {cpu / max(1, first['findings']) * 1e6:.1f})  "
            f"JSON {_kib(first['json_bytes']):>10}  log {_kib(first['log_bytes']):>10} "
            f"({first['log_lines']:,} lines)"
        )
        each = ", ".join(f"{r['seconds']:.3f}" for r in runs)
        lines.append(f"{'':>11}kinds {first['kinds']}; seconds per process {each}")
    if len(rows) == 2:
        (_, base, base_s), (_, mine, mine_s) = rows
        lines.append(
            f"{'ratio':>9}: stage {base_s / mine_s:.1f}× faster, JSON "
            f"{base['json_bytes'] / mine['json_bytes']:.1f}× smaller, log "
            f"{base['log_bytes'] / mine['log_bytes']:.1f}× smaller "
            f"({base['findings']} → {mine['findings']} findings)"
        )
        same = {
            name: {r[f"{name}_sha256"] for runs in sides.values() for r in runs}
            for name in ("json", "log")
        }
        lines.append(
            f"{'bytes':>9}: "
            + ", ".join(
                f"{name} {'identical' if len(hashes) == 1 else 'DIFFERENT'} "
                f"(sha256 {sorted(hashes)[0][:16]}{'' if len(hashes) == 1 else ' …'})"
                for name, hashes in same.items()
            )
            + " on both sides, every process"
        )
    return lines


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--generator", choices=("team", "other", "both"), default="both")
    parser.add_argument("--ranks", "-n", type=int, default=16)
    parser.add_argument("--callsites", "-m", type=int, default=40_000)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--rounds", type=int, default=3, help="processes a side")
    parser.add_argument("--repeat", type=int, default=3, help="timings a process")
    parser.add_argument("--baseline", type=Path, help="another checkout to run side by side")
    parser.add_argument("--baseline-ref", help="a git ref of this repository, as --baseline")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        checkout, data, repeat = args.child
        print(json.dumps(child(Path(checkout), Path(data), int(repeat))))
        return
    baseline = args.baseline or (
        baseline_checkout(args.baseline_ref) if args.baseline_ref else None
    )
    generators = ("team", "other") if args.generator == "both" else (args.generator,)
    out = [f"divergence stage cost, {args.rounds} process(es) a side × {args.repeat} timings"
           f" (least), GC paused; python {sys.version.split()[0]}"]  # fmt: skip
    for generator in generators:
        data = ensure_data(args.data, generator, args.ranks, args.callsites)
        sides: dict[str, list[dict[str, Any]]] = {}
        names = [("baseline", baseline)] if baseline is not None else []
        names.append(("this", REPO))
        for _ in range(args.rounds):
            for name, checkout in names:  # alternating
                sides.setdefault(name, []).append(run_child(checkout, data, args.repeat))
        out.append("")
        out.extend(report(generator, f"{args.ranks} ranks × {args.callsites} callsites", sides))
    print("\n".join(out))


if __name__ == "__main__":
    main()
