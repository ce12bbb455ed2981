"""Ctrl-C or SIGTERM to the whole process group while the combine pool runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def big_traces(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8 rank files × 30k callsites (about 60 MB): combine takes about a second."""
    out = tmp_path_factory.mktemp("pool") / "traces"
    subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "generate_traces.py"),
         "-n", "8", "-m", "30000", "--out", str(out), "--quiet"],
        check=True, timeout=120,
    )  # fmt: skip
    return out


def _children(pid: int) -> list[str]:
    """The pids of ``pid``'s children (the combine pool's workers, once it runs):
    signalling then, not after a fixed sleep, keeps the test true on a fast machine
    where the whole combine takes less than any sleep we could choose."""
    try:
        return Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_to_the_group_stops_pool_cleanly(
    big_traces: Path, tmp_path: Path, sig: signal.Signals
) -> None:
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "opguard_core.cli.app", "--log-format", "json", "run",
         "--jobs", "2", "--output-base", str(out), "-i", str(big_traces / "*_rank*.json")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 30
    summary = None
    while time.monotonic() < deadline:  # wait until discover is done and the pool runs
        found = list(out.glob("*/pipeline_summary.json"))
        if found:
            summary = found[0]
            stages = json.loads(summary.read_text())["stages"]
            if any(s["stage"] == "discover" for s in stages) and _children(proc.pid):
                break
        time.sleep(0.005)
    os.killpg(proc.pid, sig)
    _, err = proc.communicate(timeout=60)
    stderr = err.decode()
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert summary is not None
    data = json.loads(summary.read_text())
    assert data["status"] == "interrupted"
    assert data["interrupted"]["signal"] == sig.name
    assert data["interrupted"]["stage"] == "combine"
    # the report of an interrupted run shows how far it got (like the summary)
    expected = {"pipeline_summary.json", "report.html"}
    leftovers = [p.name for p in summary.parent.iterdir() if p.name not in expected]
    assert leftovers == []
