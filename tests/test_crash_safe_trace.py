"""Crash-safe recording (docs/reliability.md, "Round three", "Crash-safe recording").

Every way a traced program can end leaves its trace: SIGTERM to ``opguard trace``
(forwarded) or straight to the worker, SIGINT, ``sys.exit``, an uncaught exception, a
torchrun job torn down after another rank failed, a gloo collective timeout. A trace
written before the program was done says so (``meta.partial``). SIGKILL loses at most
one flush interval; a SIGKILLed ``opguard trace`` leaves no traced program behind; a
trace that cannot be written makes ``opguard trace`` exit non-zero; a command that
cannot run is one line and exit 126/127. Real processes and signals: the slow group.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from opguard_core.formats.trace import TRACE_VERSION, load_trace

pytestmark = [pytest.mark.torch, pytest.mark.slow]

OPGUARD = [sys.executable, "-m", "opguard_core.cli.app"]
#: a real config for `opguard guard` (its targets are not in the programs here)
CONFIG = Path(__file__).parent / "data" / "configs" / "gpt_callsite_v1.yaml"
LINUX = sys.platform.startswith("linux")

#: a program that runs a few ops, says it is ready (writes its pid to argv[1]), then
#: waits in Python (interruptible) for up to a minute
WAITING = """
import os, sys, time
import torch

def work(i):
    return torch.ones(4) * i + 1

for i in range(3):
    work(i)
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
MODE = sys.argv[2] if len(sys.argv) > 2 else "wait"
if MODE == "exit":
    sys.exit(3)
if MODE == "raise":
    raise RuntimeError("boom")
for _ in range(600):
    time.sleep(0.1)
"""


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["OPGUARD_TRACE_OUTPUT_BASE"] = str(tmp_path / "runs")
    env.pop("OPGUARD_DISABLE_PLUGINS", None)
    env.update(extra)
    return env


def _wait_for(condition: Callable[[], bool], timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (not yet reaped by its new parent) is dead
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return True


def _start(
    tmp_path: Path, mode: str = "wait", *options: str, **env: str
) -> tuple[subprocess.Popen[str], Path, Path]:
    script = tmp_path / "prog.py"
    script.write_text(WAITING)
    ready = tmp_path / "ready"
    out = tmp_path / "traces"
    proc = subprocess.Popen(
        [*OPGUARD, "trace", "--label", "p", "--output-dir", str(out), *options, "--",
         str(script), str(ready), mode],
        env=_env(tmp_path, **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    return proc, ready, out


def _finish(proc: subprocess.Popen[str]) -> tuple[int, str]:
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err


def _trace(path: Path) -> tuple[Any, dict[str, Any]]:
    raw = json.loads(path.read_text())
    return load_trace(path), raw


def _ops(trace: Any) -> set[str]:
    return {site.op for site in trace.callsites}


def _assert_work_recorded(path: Path) -> dict[str, Any]:
    trace, raw = _trace(path)
    assert raw["version"] == TRACE_VERSION >= 5
    assert {"aten::ones", "aten::mul", "aten::add"} <= _ops(trace)
    return dict(trace.meta)


def test_sigterm_to_opguard_trace_is_forwarded_and_the_trace_written(tmp_path: Path) -> None:
    proc, ready, out = _start(tmp_path)
    _wait_for(ready.exists)
    proc.send_signal(signal.SIGTERM)
    code, err = _finish(proc)
    assert code == 143, err
    meta = _assert_work_recorded(out / "p_callsite_rank0.json")
    assert meta["partial"]["reason"] == "sigterm"
    assert meta["partial"]["at"].endswith("Z") and meta["partial"]["step"] == 0
    assert "ended without writing" not in err
    assert not list(out.glob(".*"))  # no marker, no temporary file left


def test_sigterm_straight_to_the_worker(tmp_path: Path) -> None:
    proc, ready, out = _start(tmp_path)
    _wait_for(ready.exists)
    os.kill(int(ready.read_text()), signal.SIGTERM)
    code, err = _finish(proc)
    assert code == 143, err  # the worker died of SIGTERM, as it would have untraced
    assert "killed by SIGTERM" in err
    meta = _assert_work_recorded(out / "p_callsite_rank0.json")
    assert meta["partial"]["reason"] == "sigterm"


def test_sigterm_chains_to_the_programs_own_handler(tmp_path: Path) -> None:
    script = tmp_path / "own.py"
    script.write_text(
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda s, f: sys.exit(7))\n"
        "import torch\n"
        "torch.ones(2) + 1\n"
        "open(sys.argv[1], 'w').write('x')\n"
        "time.sleep(60)\n"
    )
    ready, out = tmp_path / "ready", tmp_path / "traces"
    proc = subprocess.Popen(
        [*OPGUARD, "trace", "--label", "p", "--output-dir", str(out), "--", str(script),
         str(ready)],
        env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    _wait_for(lambda: ready.exists() and ready.read_text() == "x")
    proc.send_signal(signal.SIGTERM)
    code, err = _finish(proc)
    assert code == 143, err  # opguard trace itself got SIGTERM
    assert "exited with 7" in err  # the program's handler ran: sys.exit(7)
    meta = load_trace(out / "p_callsite_rank0.json").meta
    assert meta["partial"]["reason"] == "sigterm"


def test_sigint_to_opguard_trace(tmp_path: Path) -> None:
    proc, ready, out = _start(tmp_path)
    _wait_for(ready.exists)
    proc.send_signal(signal.SIGINT)
    code, err = _finish(proc)
    assert code == 130, err
    meta = _assert_work_recorded(out / "p_callsite_rank0.json")
    assert meta["partial"]["reason"] == "sigint"


def test_sys_exit_writes_a_complete_trace(tmp_path: Path) -> None:
    proc, _, out = _start(tmp_path, "exit")
    code, err = _finish(proc)
    assert code == 3, err
    meta = _assert_work_recorded(out / "p_callsite_rank0.json")
    assert "partial" not in meta  # the program ran to its own end


def test_an_earlier_runs_marker_is_not_this_runs_loss(tmp_path: Path) -> None:
    """A marker left by an earlier run that was SIGKILLed as a whole (its ``opguard
    trace`` too) is not reported as a process of this run, nor does it mark this run's
    complete trace lost; it is left alone."""
    out = tmp_path / "traces"
    out.mkdir()
    stale = out / ".p_callsite.4242.tracing"
    stale.write_text(json.dumps({"pid": 4242, "flushed": str(out / "p_callsite_rank0.json")}))
    hour_ago = time.time() - 3600
    os.utime(stale, (hour_ago, hour_ago))
    proc, _, _ = _start(tmp_path, "exit")
    code, err = _finish(proc)
    assert code == 3, err
    assert "4242" not in err and "without writing" not in err, err
    meta = _assert_work_recorded(out / "p_callsite_rank0.json")
    assert "partial" not in meta and stale.exists()


def test_uncaught_exception_writes_a_trace_marked_partial(tmp_path: Path) -> None:
    proc, _, out = _start(tmp_path, "raise")
    code, err = _finish(proc)
    assert code == 1, err
    assert "RuntimeError: boom" in err
    meta = _assert_work_recorded(out / "p_callsite_rank0.json")
    assert meta["partial"]["reason"] == "exception"
    assert meta["partial"]["exception"] == "RuntimeError"


#: a rank that fails and, while its trace is written at exit, gets the SIGTERM that
#: torchrun sends when it tears the job down (a thread sends it as soon as the write's
#: temporary file appears); with --flush-steps 1, the same during a step's flush
SIGTERM_WHILE_WRITING = """
import glob, os, signal, sys, threading, time
import torch

source = "\\n".join(f"def f{i}(x):\\n    return x + {i}" for i in range(3000))
functions = {}
exec(compile(source, "many_functions.py", "exec"), functions)
x = torch.ones(2)
out = os.environ["OPGUARD_TRACE_DIR"]

def killer():
    while not glob.glob(os.path.join(out, ".*.tmp")):
        time.sleep(0.0005)
    os.kill(os.getpid(), signal.SIGTERM)

for i in range(3000):
    functions[f"f{i}"](x)
if sys.argv[1] == "exit":
    threading.Thread(target=killer, daemon=True).start()
    raise RuntimeError("collective failed")
model = torch.nn.Linear(2, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
threading.Thread(target=killer, daemon=True).start()
for step in range(100000):
    model(x).sum().backward()
    opt.step()
"""


@pytest.mark.parametrize("when", ["exit", "flush"])
def test_a_sigterm_while_the_trace_is_written_waits_for_it(tmp_path: Path, when: str) -> None:
    """The write is finished before SIGTERM does what it does: the trace is there and
    no temporary is left (before: a rank failing as torchrun tore the job down lost its
    whole trace, and a step flush left its temporary)."""
    script = tmp_path / "prog.py"
    script.write_text(SIGTERM_WHILE_WRITING)
    out = tmp_path / "traces"
    flush = ["--flush-steps", "1"] if when == "flush" else []
    proc = subprocess.run(
        [*OPGUARD, "trace", "--label", "p", "--output-dir", str(out), "--flush-seconds", "0",
         *flush, "--", str(script), when],
        env=_env(tmp_path), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 143, proc.stderr
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == [], proc.stderr
    # the 3000 functions ran before any optimizer step: the set-up's, where there is one
    trace, _ = _trace(out / ("p_callsite_rank0.json" if when == "exit" else "p_setup_rank0.json"))
    assert len(trace.callsites) >= 3000
    final, _ = _trace(out / "p_callsite_rank0.json")
    assert final.meta["partial"]["reason"] == ("exception" if when == "exit" else "sigterm")


def test_periodic_flush_bounds_what_sigkill_of_the_worker_loses(tmp_path: Path) -> None:
    proc, ready, out = _start(tmp_path, "wait", "--flush-seconds", "0.3")
    trace_file = out / "p_callsite_rank0.json"
    _wait_for(ready.exists)
    _wait_for(trace_file.exists)  # a flush, while the program still runs
    os.kill(int(ready.read_text()), signal.SIGKILL)
    code, err = _finish(proc)
    assert code == 137, err
    meta = _assert_work_recorded(trace_file)
    # opguard trace saw the process end without writing: the flush's marker says so
    assert meta["partial"]["reason"] == "lost"
    assert "its trace up to the last flush is in p_callsite_rank0.json" in err
    assert "(marked partial, reason lost)" in err


def test_flush_seconds_zero_flushes_nothing(tmp_path: Path) -> None:
    proc, ready, out = _start(tmp_path, "wait", OPGUARD_TRACE_FLUSH_SECONDS="0")
    _wait_for(ready.exists)
    time.sleep(1.0)
    assert not (out / "p_callsite_rank0.json").exists()
    os.kill(int(ready.read_text()), signal.SIGKILL)
    code, err = _finish(proc)
    assert code == 137
    assert "its operators are lost" in err


def test_flush_every_n_optimizer_steps(tmp_path: Path) -> None:
    script = tmp_path / "steps.py"
    script.write_text(
        "import os, sys, time\nimport torch\n"
        "w = torch.nn.Parameter(torch.ones(2))\n"
        "opt = torch.optim.SGD([w], lr=0.1)\n"
        "for _ in range(4):\n"
        "    (w * 2).sum().backward()\n"
        "    opt.step()\n"
        "open(sys.argv[1], 'w').write(str(os.getpid()))\n"
        "time.sleep(60)\n"
    )
    ready, out = tmp_path / "ready", tmp_path / "traces"
    proc = subprocess.Popen(
        [*OPGUARD, "trace", "--label", "p", "--output-dir", str(out), "--flush-seconds",
         "0", "--flush-steps", "2", "--", str(script), str(ready)],
        env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    _wait_for(lambda: ready.exists() and ready.read_text() != "")
    os.kill(int(ready.read_text()), signal.SIGKILL)
    _finish(proc)
    meta = load_trace(out / "p_callsite_rank0.json").meta
    assert meta["partial"] == {**meta["partial"], "reason": "lost", "step": 4}
    # a flush writes the set-up apart from the loop as the exit would; the set-up had
    # ended, so it is complete: neither a flush's mark nor, after the kill, a loss's
    setup = load_trace(out / "p_setup_rank0.json").meta
    assert (meta["phase"], meta["steps"], setup["phase"], setup["steps"]) == ("loop", 3, "setup", 1)
    assert "partial" not in setup


@pytest.mark.skipif(not LINUX, reason="PR_SET_PDEATHSIG is Linux only (documented)")
def test_sigkill_of_opguard_trace_leaves_no_traced_program(tmp_path: Path) -> None:
    proc, ready, out = _start(tmp_path)
    _wait_for(ready.exists)
    worker = int(ready.read_text())
    proc.kill()
    proc.communicate(timeout=30)
    _wait_for(lambda: not _alive(worker), timeout=30)
    # it got SIGTERM, so it wrote its trace on the way out
    meta = _assert_work_recorded(out / "p_callsite_rank0.json")
    assert meta["partial"]["reason"] == "sigterm"


@pytest.mark.skipif(not LINUX, reason="PR_SET_PDEATHSIG is Linux only (documented)")
def test_sigkill_of_opguard_guard_leaves_no_guarded_program(tmp_path: Path) -> None:
    config = CONFIG
    script = tmp_path / "prog.py"
    script.write_text(WAITING)
    ready = tmp_path / "ready"
    proc = subprocess.Popen(
        [*OPGUARD, "guard", "--config", str(config), "--report-dir", str(tmp_path / "r"),
         "--", str(script), str(ready)],
        env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    _wait_for(ready.exists)
    worker = int(ready.read_text())
    proc.kill()
    proc.communicate(timeout=30)
    _wait_for(lambda: not _alive(worker), timeout=30)


def test_guard_writes_its_report_when_the_program_gets_sigterm(tmp_path: Path) -> None:
    config = CONFIG
    script = tmp_path / "prog.py"
    script.write_text(WAITING)
    ready, reports = tmp_path / "ready", tmp_path / "r"
    proc = subprocess.Popen(
        [*OPGUARD, "guard", "--config", str(config), "--report-dir", str(reports), "--",
         str(script), str(ready)],
        env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    _wait_for(ready.exists)
    os.kill(int(ready.read_text()), signal.SIGTERM)
    code, err = _finish(proc)
    assert code == 143, err
    assert (reports / "guard_report_rank0.json").exists(), err


def test_a_trace_that_cannot_be_written_fails_the_command(tmp_path: Path) -> None:
    script = tmp_path / "prog.py"
    # the trace's own path is taken by a directory when the program ends: the write
    # fails as on a full disk, after the program succeeded
    script.write_text(
        "import os, sys\nimport torch\ntorch.ones(2) + 1\n"
        "os.mkdir(os.path.join(sys.argv[1], 'p_callsite_rank0.json'))\n"
    )
    out = tmp_path / "traces"
    proc = subprocess.run(
        [*OPGUARD, "trace", "--label", "p", "--output-dir", str(out), "--", str(script),
         str(out)],
        env=_env(tmp_path), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert "could not write its trace" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("what", "code", "message"),
    [
        ("directory", 126, "is not executable"),
        ("plain_file", 126, "is not executable"),
        ("missing", 127, "command not found"),
    ],
)
def test_a_command_that_cannot_run_is_one_line_and_126_or_127(
    tmp_path: Path, what: str, code: int, message: str
) -> None:
    plain = tmp_path / "data.txt"
    plain.write_text("not a program\n")
    command = {"directory": "/etc", "plain_file": str(plain), "missing": "no-such-cmd-xyz"}[what]
    for sub in (
        ["trace", "--output-dir", str(tmp_path / "t")],
        ["guard", "--config", str(CONFIG), "--report-dir", str(tmp_path / "r")],
    ):
        proc = subprocess.run(
            [*OPGUARD, *sub, "--", command], env=_env(tmp_path), capture_output=True,
            text=True, timeout=60,
        )  # fmt: skip
        assert proc.returncode == code, (sub[0], proc.stderr)
        assert "Traceback" not in proc.stderr
        [line] = proc.stderr.strip().splitlines()
        assert line == f"opguard: error: {command}: {message}"


# ---------------------------------------------------------------------------
# torchrun: another rank fails, a collective times out
# ---------------------------------------------------------------------------

#: two gloo ranks run some ops and a collective; then rank 1 fails (FAIL=raise) or
#: skips the next collective so rank 0's times out (FAIL=timeout, 3 s)
DISTRIBUTED = """
import datetime, os, sys, time
import torch
import torch.distributed as dist

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3))
rank = dist.get_rank()
t = torch.ones(4) * (rank + 1)
dist.all_reduce(t)
open(os.path.join(sys.argv[1], f"ready{rank}"), "w").write(str(os.getpid()))
FAIL = sys.argv[2]
if FAIL == "raise":
    if rank == 1:
        time.sleep(1)
        raise RuntimeError("rank 1 fails")
    time.sleep(60)  # torchrun tears this rank down
elif FAIL == "timeout":
    if rank == 0:
        dist.all_reduce(t)  # rank 1 never joins: times out after 3 s
    time.sleep(60)
"""


def _torchrun(tmp_path: Path, fail: str) -> tuple[int, str, Path]:
    script = tmp_path / "dist.py"
    script.write_text(DISTRIBUTED)
    out = tmp_path / "traces"
    proc = subprocess.run(
        [*OPGUARD, "trace", "--label", "d", "--output-dir", str(out), "--", "torchrun",
         "--nproc-per-node", "2", "--standalone", str(script), str(tmp_path), fail],
        env=_env(tmp_path), capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    return proc.returncode, proc.stderr, out


def test_torchrun_tears_down_the_other_rank_and_both_traces_are_written(
    tmp_path: Path,
) -> None:
    code, err, out = _torchrun(tmp_path, "raise")
    assert code != 0, err
    survivor = load_trace(out / "d_callsite_rank0.json")
    failed = load_trace(out / "d_callsite_rank1.json")
    assert "c10d::allreduce_" in _ops(survivor) and "c10d::allreduce_" in _ops(failed)
    assert failed.meta["partial"]["reason"] == "exception"
    assert survivor.meta["partial"]["reason"] == "sigterm"  # torchrun's SIGTERM
    assert "ended without writing" not in err


def test_gloo_collective_timeout_leaves_every_ranks_trace(tmp_path: Path) -> None:
    code, err, out = _torchrun(tmp_path, "timeout")
    assert code != 0, err
    timed_out = load_trace(out / "d_callsite_rank0.json")
    other = load_trace(out / "d_callsite_rank1.json")
    assert timed_out.meta["partial"]["reason"] == "exception"
    assert other.meta["partial"]["reason"] == "sigterm"

    # the collective that timed out was issued: rank 0 counts two, rank 1 one
    def allreduces(trace: Any) -> int:
        return sum(s.count for s in trace.callsites if s.op == "c10d::allreduce_")

    assert (allreduces(timed_out), allreduces(other)) == (2, 1)
    assert "ended without writing" not in err
