"""Start-up time of the ``opguard`` command: import time (``python -X importtime``) and
wall time of ``opguard --version``, ``opguard run --help`` and a plugin command's help.

    python benchmarks/startup.py [--repeat 9] [--source DIR ...]

Each ``--source`` is a checkout put first on ``PYTHONPATH`` (default: this one), so a
before/after pair runs side by side, alternating. For every command it prints the
median over the repeats of

* **import ms**: the cumulative import time of every module the command imported
  beyond a bare ``python -c pass`` (the interpreter's own start-up is not opguard's);
* **wall ms**: the whole process, interpreter start-up included;
* the heavy modules it imported (pluggy, structlog, msgspec, rich, ruamel.yaml).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: every command's ``--help`` (issue 31: each under 150 ms of import time)
COMMANDS = (
    ["--version"],
    ["--help"],
    *(
        [name, "--help"]
        for name in (
            "run",
            "trace",
            "check",
            "guard",
            "show",
            "compare",
            "merge",
            "filter",
            "export",
            "report",
            "plugins",
        )
    ),
)
HEAVY = ("pluggy", "structlog", "msgspec", "rich", "ruamel")
RUN = "import sys\nfrom opguard_core.cli.app import main\nmain(sys.argv[1:])\n"


def _roots(stderr: str) -> dict[str, int]:
    """Top-level imports (no indentation) and their cumulative microseconds."""
    roots: dict[str, int] = {}
    for line in stderr.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        _, cumulative, name = (part for part in line[len("import time:") :].split("|"))
        if not name.startswith("   "):  # "| name" has one space; nested ones more
            roots[name.strip()] = roots.get(name.strip(), 0) + int(cumulative)
    return roots


def _all_imported(stderr: str) -> set[str]:
    return {
        line.rsplit("|", 1)[1].strip()
        for line in stderr.splitlines()
        if line.startswith("import time:") and "cumulative" not in line
    }


def measure(source: Path, args: list[str], baseline: set[str]) -> tuple[float, float, list[str]]:
    env = {**os.environ, "PYTHONPATH": str(source)}
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", RUN, *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=source,  # ``-c`` puts the working directory first on sys.path
        check=False,
    )
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed ({proc.returncode}): {proc.stderr[-500:]}")
    roots = _roots(proc.stderr)
    imported_us = sum(us for name, us in roots.items() if name not in baseline)
    heavy = sorted({m.split(".")[0] for m in _all_imported(proc.stderr)} & set(HEAVY))
    return imported_us / 1000, wall * 1000, heavy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--source", type=Path, action="append", default=None)
    ns = parser.parse_args()
    sources = ns.source or [REPO]
    bare = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "pass"], capture_output=True, text=True
    )
    baseline = set(_roots(bare.stderr))
    results: dict[tuple[str, str], list[tuple[float, float, list[str]]]] = {}
    for _ in range(ns.repeat):
        for args in COMMANDS:
            for source in sources:
                key = (str(source), " ".join(args))
                results.setdefault(key, []).append(measure(source, args, baseline))
    print(f"python {sys.version.split()[0]}, {ns.repeat} repeats, medians\n")
    print("| source | command | import ms | wall ms | heavy modules imported |")
    print("|---|---|---:|---:|---|")
    for (source, command), runs in results.items():
        imp = statistics.median(r[0] for r in runs)
        wall = statistics.median(r[1] for r in runs)
        heavy = ", ".join(runs[0][2]) or "none"
        print(f"| {source} | opguard {command} | {imp:.0f} | {wall:.0f} | {heavy} |")


if __name__ == "__main__":
    main()
