"""Shared fixtures: the bundled sample traces and a CLI runner that finds the run dir."""

from __future__ import annotations

import dataclasses
import shutil
import signal
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
