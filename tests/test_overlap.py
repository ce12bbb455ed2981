"""The divergence stage in a forked helper while compress and generate go on
(``opguard_core.forked``, ``Runner._start_divergence``): the same artifacts, records
and logs as in-process, and a helper that fails, dies or is cut short by an
interruption is recorded, never waited on forever, never left behind."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from opguard_core import runner as runner_module
from opguard_core.forked import ForkedCall, can_fork
from opguard_plugins import compress as compress_plugin
from opguard_plugins import divergence as divergence_plugin
from tests.builders import sample_inputs

pytestmark = pytest.mark.skipif(not can_fork(), reason="needs fork and a single thread")

ARTIFACTS = (
    "gpt_callsite_combined.json",
    "gpt_callsite_divergence.json",
    "gpt_callsite_divergence.log",
    "gpt_callsite_compressed.json",
    "gpt_callsite_instrumentation.yaml",
)


@pytest.fixture
def forks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every divergence stage forks (no size threshold); the pids of the helpers."""
    started: list[int] = []
    real = ForkedCall.start.__func__  # type: ignore[attr-defined]

    def start(cls: type[ForkedCall], work: Callable[[], Any], what: str) -> ForkedCall | None:
        job = real(cls, work, what)
        if job is not None:
            started.append(job.pid)
        return job

    monkeypatch.setattr(runner_module, "OVERLAP_MIN_CALLSITES", 0)
    monkeypatch.setattr(ForkedCall, "start", classmethod(start))
    return started


def stages(run_dir: Path) -> list[tuple[str, str | None, str, Any, Any]]:
    summary = json.loads((run_dir / "pipeline_summary.json").read_text())
    return [
        (r["stage"], r["entry"], r["status"], r["counts"], r["error"]) for r in summary["stages"]
    ]


def events(stderr: str) -> list[tuple[str, str | None]]:
    logged = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    return [(e["event"], e.get("stage")) for e in logged]


def test_a_forked_divergence_stage_gives_what_an_in_process_one_gives(
    opguard: Callable[..., Any], samples: Path, forks: list[int]
) -> None:
    alone = opguard("run", "--jobs", "1", *sample_inputs(samples, "gpt"), expect=0)
    assert forks == []  # --jobs 1: one process
    overlapped = opguard("run", *sample_inputs(samples, "gpt"), expect=0)
    assert len(forks) == 1
    for name in ARTIFACTS:
        assert overlapped.read(name) == alone.read(name), name
    assert stages(overlapped.run_dir) == stages(alone.run_dir)
    assert [s[0] for s in stages(overlapped.run_dir)][:5] == [
        "discover", "combine", "divergence", "compress", "generate",
    ]  # fmt: skip
    # the helper's log events are logged by the run, with their stage
    assert ("ranks diverge", "divergence") in events(overlapped.stderr)
    assert sorted(events(overlapped.stderr)) == sorted(events(alone.stderr))
    with pytest.raises(ChildProcessError):
        os.waitpid(forks[0], os.WNOHANG)  # reaped


def test_a_divergence_plugin_failing_in_the_helper_fails_its_stage_only(
    opguard: Callable[..., Any], samples: Path, forks: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(trace: Any, options: Any) -> Any:
        raise RuntimeError("no findings today")

    monkeypatch.setattr(divergence_plugin, "find_divergence", broken)
    run = opguard("run", *sample_inputs(samples, "gpt"), expect=1)
    assert len(forks) == 1
    records = {s[0]: s for s in stages(run.run_dir)}
    assert records["divergence"][2] == "failed"
    assert "RuntimeError: no findings today" in records["divergence"][4]
    assert records["compress"][2] == records["generate"][2] == "ok"
    assert (run.run_dir / "gpt_callsite_instrumentation.yaml").exists()
    assert ("stage failed", "divergence") in events(run.stderr)


def test_a_helper_that_dies_is_named_and_the_run_goes_on(
    opguard: Callable[..., Any], samples: Path, forks: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    parent = os.getpid()

    def dies(trace: Any, options: Any) -> Any:
        if os.getpid() == parent:  # never end the test process itself
            raise AssertionError("the divergence stage did not run in a helper")
        os._exit(7)

    monkeypatch.setattr(divergence_plugin, "find_divergence", dies)
    run = opguard("run", *sample_inputs(samples, "gpt"), expect=1)
    records = {s[0]: s for s in stages(run.run_dir)}
    assert records["divergence"][2] == "failed"
    assert records["divergence"][4] == (
        "divergence of gpt_callsite: its helper process died (exit code 7; out of memory?)"
    )
    assert records["generate"][2] == "ok"
    assert not (run.run_dir / "gpt_callsite_divergence.json").exists()


def test_an_interrupted_run_kills_the_helper_instead_of_waiting(
    opguard: Callable[..., Any], samples: Path, forks: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    parent = os.getpid()
    real_compress = compress_plugin.compress_trace

    def slow(trace: Any, options: Any) -> Any:
        if os.getpid() != parent:
            time.sleep(120)  # the helper: far longer than the test may take
        return []

    def interrupted(trace: Any, options: Any) -> Any:
        os.kill(os.getpid(), signal.SIGTERM)  # the runner turns it into Interrupted
        return real_compress(trace, options)

    monkeypatch.setattr(divergence_plugin, "find_divergence", slow)
    monkeypatch.setattr(compress_plugin, "compress_trace", interrupted)
    started = time.monotonic()
    run = opguard(
        "run", *sample_inputs(samples, "gpt"), expect=130
    )  # interrupted (the runner uses 130 for any signal)
    assert time.monotonic() - started < 60
    summary = json.loads((run.run_dir / "pipeline_summary.json").read_text())
    assert summary["interrupted"]["signal"] == "SIGTERM"
    assert summary["interrupted"]["stage"] == "compress"
    with pytest.raises(ChildProcessError):
        os.waitpid(forks[0], os.WNOHANG)  # killed and reaped
