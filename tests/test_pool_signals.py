"""Ctrl-C or SIGTERM to the whole process group while the combine pool runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
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


#: a process that starts a forked helper (opguard run's second core) that would work
#: for a minute, prints the helper's pid, then waits for it
_FORKS_A_HELPER = """
import os, sys, time
from opguard_core.run.forked import ForkedCall

def work():
    time.sleep(60)

read, write = os.pipe()
call = ForkedCall.start(lambda: (os.write(write, str(os.getpid()).encode()), work()), "x")
assert call is not None
print(os.read(read, 100).decode(), flush=True)
call.result()
"""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG: Linux")
def test_sigkill_of_run_kills_its_forked_helper() -> None:
    """An orphaned helper would hold the run directory (and disable stale-run
    detection): it dies with the process that forked it, even by SIGKILL."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _FORKS_A_HELPER], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    assert proc.stdout is not None
    helper = int(proc.stdout.readline())
    assert _alive(helper)
    proc.kill()
    proc.wait(timeout=30)
    deadline = time.monotonic() + 10
    while _alive(helper) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(helper)


_PARENT_GONE_FIRST = """
import os, signal, sys, time
from opguard_core.processes import die_with_parent

before, after = sys.argv[1], sys.argv[2]
if os.fork() == 0:  # an intermediate process: forks the helper and leaves at once
    mid = os.getpid()
    if os.fork() == 0:  # the helper: its parent is gone before it asks
        while os.getppid() == mid:
            time.sleep(0.01)
        open(before, "w").close()
        die_with_parent(signal.SIGKILL, mid)
        open(after, "w").close()  # only if die_with_parent missed the parent's death
    os._exit(0)
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG: Linux")
def test_die_with_parent_when_the_parent_died_before_the_request(tmp_path: Path) -> None:
    """A helper whose parent died between the fork and its request kills itself."""
    before, after = tmp_path / "before", tmp_path / "after"
    subprocess.run(
        [sys.executable, "-c", _PARENT_GONE_FIRST, str(before), str(after)],
        cwd=REPO, timeout=30, check=True,
    )  # fmt: skip
    deadline = time.monotonic() + 10
    while not before.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert before.exists()
    time.sleep(0.5)
    assert not after.exists()


def test_signals_deferred_hold_sigint_until_the_block_ends() -> None:
    """The combine pool queues its tasks with signals deferred: a KeyboardInterrupt
    inside ``Queue.put`` would leak the queue's lock and hang the run at exit (the
    flake this test and the one above caught). Held back in the main thread even
    while another thread runs (the kernel may hand it the signal)."""
    from opguard_core.processes import signals_deferred

    seen: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        with signals_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)  # noted once
            time.sleep(0.05)
            assert seen == []
        assert seen == [signal.SIGINT]
        os.kill(os.getpid(), signal.SIGINT)  # the handler is back: it runs at once
        time.sleep(0.05)
        assert seen == [signal.SIGINT, signal.SIGINT]
    finally:
        stop.set()
        other.join()
        signal.signal(signal.SIGINT, previous)


_KILLED_DURING_COMBINE = """
import os, sys, time
from pathlib import Path
from opguard_plugins.stages import combine

def slow_add(self, path, readers=None):  # the helpers work long enough to be seen
    time.sleep(60)

combine.TraceAccumulator.add_file = slow_add
paths = [Path(f"r{i}.json") for i in range(4)]
combine.combine_parallel(paths, jobs=3)
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
def test_sigkill_of_run_kills_its_combine_helpers() -> None:
    """The combine pool's helpers die with the run, even when it is killed with SIGKILL
    (a daemon process is only reaped by a parent that lives to exit)."""
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_DURING_COMBINE], cwd=REPO)
    deadline = time.monotonic() + 30
    while len(_children(proc.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    helpers = [int(pid) for pid in _children(proc.pid)]
    assert len(helpers) == 2
    proc.kill()
    proc.wait(timeout=30)
    deadline = time.monotonic() + 10
    while any(map(_alive, helpers)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(_alive, helpers))
