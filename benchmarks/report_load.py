"""How heavy ``report.html`` is at scale: its size, the time to write it, and the time
headless Chromium takes to load it and to answer a search.

For each shape (``--shapes 16x40000,1024x4000``: ranks × callsites per rank) it:

1. generates the rank files (benchmarks/generate_traces.py) unless they exist, and
   runs ``opguard run`` on them (extra options after ``--``);
2. times the report's own work as the run does it at its end: ``render_report``
   with the configs the run wrote handed over (loaded beforehand, not timed), best
   of ``--repeat``;
3. loads ``report.html`` in headless Chromium at 1400 × 900 (``tests/chromium.py``:
   the DevTools protocol over ``--remote-debugging-pipe``), ``--repeat`` times, each
   a fresh navigation of one browser (its first load, cold, reported apart), and
   reads the page's own Navigation Timing: ``loadEventEnd``, milliseconds from the
   start of the navigation to the end of the load event; the report's script runs
   before the load event, so this includes parsing the data and building the page.
   Also: the page's width (no horizontal scrolling at 1400 px) and height;
4. types a query into the search box one character at a time and times each
   keystroke in the page (``performance.now()`` around the synchronous input
   handler, with a forced layout after it).

Prints a markdown table (and writes it to ``--output``) with the goals of issue 32:
a load under 2 s and a file under 2 MB.

    python benchmarks/report_load.py --shapes 16x40000,1024x4000 --repeat 5

1024 × 4,000 callsites is 1.3 GB of traces; 1024 × 40,000 (11 GB) works too, given
the disk and about 5 GB of memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate_traces import Shape  # noqa: E402
from run_benchmark import DEFAULT_DATA, data_dir, ensure_data, run_opguard  # noqa: E402

from opguard_core.formats.config import load_config  # noqa: E402
from opguard_plugins.view.report import render_report  # noqa: E402
from tests.chromium import BINARY, Chromium  # noqa: E402

LOAD_GOAL_S = 2.0
SIZE_GOAL_BYTES = 2_000_000
QUERY = "router"
KEYSTROKE = """(function (text) {
  const box = document.querySelector("[data-role=search]");
  const start = performance.now();
  box.value = text;
  box.dispatchEvent(new Event("input"));
  void document.body.offsetHeight;  // the layout the new rows need
  return performance.now() - start;
})(%s)"""


@dataclasses.dataclass
class Figures:
    shape: str
    run_seconds: float
    report_bytes: int
    render_seconds: float
    cold_ms: float
    load_ms: list[float]
    wall_ms: list[float]
    width: int
    height: int
    keystroke_ms: list[float]
    findings: int
    groups: int
    config_rows: int
    tree_nodes: int
    errors: list[str]


def _summary(run_dir: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((run_dir / "pipeline_summary.json").read_text())
    return data


def render_seconds(run_dir: Path, repeat: int) -> float:
    """The report's work at the end of a run, given the configs the run wrote."""
    summary = _summary(run_dir)
    configs = {p.name: load_config(p) for p in sorted(run_dir.glob("*_instrumentation.yaml"))}
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        render_report(run_dir, summary, configs)
        best = min(best, time.perf_counter() - start)
    return best


def in_browser(report: Path, profile: Path, repeat: int) -> dict[str, Any]:
    with Chromium(profile, width=1400, height=900) as browser:
        cold = browser.open(report.as_uri())
        timing = "performance.getEntriesByType('navigation')[0].loadEventEnd"
        cold_ms = float(browser.evaluate(timing))
        loads, walls = [], []
        for _ in range(repeat):
            walls.append(1000 * browser.open(report.as_uri()))
            loads.append(float(browser.evaluate(timing)))
        assert browser.evaluate("document.body.dataset.ready") == "1", "the page did not finish"
        width = int(browser.evaluate("document.documentElement.scrollWidth"))
        height = int(browser.evaluate("document.documentElement.scrollHeight"))
        keys = [
            float(browser.evaluate(KEYSTROKE % json.dumps(QUERY[: i + 1])))
            for i in range(len(QUERY))
        ]
        keys.append(float(browser.evaluate(KEYSTROKE % json.dumps(""))))
        del cold
        return {
            "cold_ms": cold_ms,
            "load_ms": loads,
            "wall_ms": walls,
            "width": width,
            "height": height,
            "keystroke_ms": keys,
            "errors": list(browser.errors),
        }


def _embedded(report: Path) -> dict[str, Any]:
    text = report.read_text()
    start = text.index('id="opguard-data">') + len('id="opguard-data">')
    data: dict[str, Any] = json.loads(text[start : text.index("</script>", start)])
    return data


def measure(shape: Shape, base: Path, out: Path, extra: Sequence[str], repeat: int) -> Figures:
    paths = ensure_data(base, shape)
    run = run_opguard(paths, out, extra)
    if run.exit_code not in (0, 4):
        sys.exit(f"opguard run failed (exit code {run.exit_code})")
    (run_dir,) = [p for p in out.iterdir() if p.name.startswith("preprocessing_")]
    report = run_dir / "report.html"
    page = in_browser(report, out / "chromium-profile", repeat)
    data = _embedded(report)
    entries = data["entries"]
    return Figures(
        shape=f"{shape.ranks} × {shape.callsites:,}",
        run_seconds=run.wall,
        report_bytes=report.stat().st_size,
        render_seconds=render_seconds(run_dir, repeat),
        findings=sum(e["divergence"]["findings"] for e in entries if e["divergence"]),
        groups=sum(e["divergence"]["ngroups"] for e in entries if e["divergence"]),
        config_rows=sum(len(c["rows"]) for c in data["configs"].values()),
        tree_nodes=sum(len(e["tree"]["n"]) for e in entries if e["tree"]),
        **page,
    )


def table(figures: list[Figures], extra: Sequence[str], repeat: int) -> str:
    lines = [
        "| shape | findings (groups) | config rows | tree nodes | report.html | written in "
        "| load, cold | load, median (max) | wall, median | width × height | keystroke, max |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for f in figures:
        lines.append(
            f"| {f.shape} | {f.findings:,} ({f.groups:,}) | {f.config_rows:,} | "
            f"{f.tree_nodes:,} | {f.report_bytes / 1e6:.2f} MB | {f.render_seconds:.2f} s | "
            f"{f.cold_ms:.0f} ms | {statistics.median(f.load_ms):.0f} ms "
            f"({max(f.load_ms):.0f} ms) | {statistics.median(f.wall_ms):.0f} ms | "
            f"{f.width} × {f.height} | {max(f.keystroke_ms):.1f} ms |"
        )
    lines.append("")
    for f in figures:
        load = max(f.cold_ms, *f.load_ms) / 1000
        lines.append(
            f"- {f.shape}: load under {LOAD_GOAL_S:.0f} s: "
            f"**{'yes' if load < LOAD_GOAL_S else 'NO'}** (slowest {load:.2f} s); "
            f"under {SIZE_GOAL_BYTES / 1e6:.0f} MB: "
            f"**{'yes' if f.report_bytes < SIZE_GOAL_BYTES else 'NO'}**; "
            f"no horizontal scrolling at 1400 px: **{'yes' if f.width <= 1400 else 'NO'}**"
            + (f"; page errors: {f.errors}" if f.errors else "")
        )
    lines += [
        "",
        f"Loads: {repeat} per shape after a cold one, one browser, Navigation Timing "
        f"`loadEventEnd`; keystrokes: {QUERY!r} typed one character at a time, then cleared.",
    ]
    if extra:
        lines.append(f"Extra `opguard run` options: `{' '.join(extra)}`.")
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="16x40000,1024x4000", help="RANKSxCALLSITES,...")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="generated traces")
    parser.add_argument("--repeat", type=int, default=5, help="loads per shape (after a cold one)")
    parser.add_argument("--cleanup", action="store_true", help="delete generated traces after")
    parser.add_argument("--output", "-o", type=Path, default=None, help="also write the table")
    parser.add_argument("opguard_args", nargs="*", help="more `opguard run` options, after --")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if BINARY is None:
        sys.exit("chromium is not installed (Debian: apt install chromium)")
    shapes = []
    for item in args.shapes.split(","):
        ranks, _, callsites = item.strip().partition("x")
        shapes.append(Shape(ranks=int(ranks), callsites=int(callsites), seed=args.seed))
    out = Path(tempfile.mkdtemp(prefix="opguard-report-load-"))
    figures = []
    try:
        for number, shape in enumerate(shapes):
            figures.append(
                measure(shape, args.data, out / str(number), args.opguard_args, args.repeat)
            )
            if args.cleanup:
                shutil.rmtree(data_dir(args.data, shape), ignore_errors=True)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    text = table(figures, args.opguard_args, args.repeat)
    print(text)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text)
    if any(f.errors for f in figures):
        sys.exit("the page logged errors: the figures above are not a benchmark")


if __name__ == "__main__":
    main()
