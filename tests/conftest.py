"""Shared fixtures: the bundled sample traces and a CLI runner that finds the run dir."""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from opguard_core.cli.app import cli_for

if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    # pytest started in the background by a shell without job control (`pytest &`,
    # nohup) inherits SIGINT ignored, and Python then installs no KeyboardInterrupt
    # handler: the in-process Ctrl-C tests would see the signal vanish. A user's
    # terminal delivers it, so the tests run as under one.
    signal.signal(signal.SIGINT, signal.default_int_handler)

SAMPLES = Path(__file__).parent / "data" / "samples"


@pytest.fixture
def samples(tmp_path: Path) -> Path:
    """A private copy of the real sample traces (fsdp_ and gpt_callsite_rank{0,1}.json)."""
    target = tmp_path / "traces"
    shutil.copytree(SAMPLES, target)
    return target


@dataclasses.dataclass
class RunResult:
    result: Result
    run_dir: Path | None

    @property
    def exit_code(self) -> int:
        return self.result.exit_code

    @property
    def stderr(self) -> str:
        return self.result.stderr

    def read(self, name: str) -> str:
        assert self.run_dir is not None
        return (self.run_dir / name).read_text()


@pytest.fixture
def opguard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., RunResult]:
    """Run ``opguard ARGS`` in-process with the run directory under ``tmp_path/out``."""
    out = tmp_path / "out"
    monkeypatch.setenv("OPGUARD_TRACE_OUTPUT_BASE", str(out))
    monkeypatch.delenv("OPGUARD_DISABLE_PLUGINS", raising=False)

    def run(*args: str | Path, expect: int | None = None) -> RunResult:
        argv: Sequence[str] = ["--log-format", "json", *[str(a) for a in args]]
        before = set(out.iterdir()) if out.exists() else set()
        result = CliRunner().invoke(cli_for(argv), argv, catch_exceptions=False)
        after = set(out.iterdir()) if out.exists() else set()
        new = sorted(after - before)
        run_dir = new[-1] if new else None
        if expect is not None:
            assert result.exit_code == expect, result.stderr
        return RunResult(result, run_dir)

    return run


# ---------------------------------------------------------------------------
# tests that run torch's profiler in their own process
# ---------------------------------------------------------------------------

IN_CHILD = "OPGUARD_TEST_IN_CHILD"
CRASH_TRIES = 3  # a test process torch's profiler kills is tried again, at most 3 tries
CRASHES = (-signal.SIGSEGV, -signal.SIGABRT)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """A test marked ``profiler`` runs in a pytest process of its own.

    torch's profiler now and then corrupts the heap of the process it runs in, which
    dies by SIGSEGV or SIGABRT later, at any point, even in another test
    (docs/tracing.md, "Limits"; `.ci/run` met it on 2026-12-07, in a garbage
    collection after a profiled loop). In its own process such a crash ends that one
    test: it is tried again, at most ``CRASH_TRIES`` times; any other failure fails
    with the child's report.
    """
    if pyfuncitem.get_closest_marker("profiler") is None or os.environ.get(IN_CHILD):
        return None
    command = [
        *(sys.executable, "-m", "pytest", pyfuncitem.nodeid),
        *("-n", "0", "-m", "", "-q", "-rs", "-p", "no:cacheprovider"),
    ]
    crashes = []
    for _ in range(CRASH_TRIES):
        with tempfile.TemporaryDirectory(prefix="opguard-child-") as basetemp:
            child = subprocess.run(
                [*command, "--basetemp", basetemp],
                capture_output=True,
                text=True,
                cwd=pyfuncitem.config.rootpath,
                env={**os.environ, IN_CHILD: "1"},
            )
        if child.returncode not in CRASHES:
            break
        crashes.append(child.returncode)
    report = (child.stdout + child.stderr)[-6000:]
    if child.returncode != 0:
        pytest.fail(f"in its own process (crashed: {crashes}):\n{report}", pytrace=False)
    last = child.stdout.strip().splitlines()[-1] if child.stdout.strip() else ""
    if "passed" not in last:  # skipped in the child: say why
        reasons = [line for line in child.stdout.splitlines() if line.startswith("SKIPPED")]
        pytest.skip(f"in its own process: {reasons[0].split(': ', 1)[-1] if reasons else last}")
    return True
