"""The divergence stage in a forked helper while compress and generate go on
(``opguard_core.run.helper``, ``opguard_core.run.forked``): the same artifacts, records
and logs as in-process, and a helper that fails, dies or is cut short by an
interruption is recorded, never waited on forever, never left behind.

Each run is a fresh ``python`` process that imports a small patch module first
(every divergence stage forks, the helpers' pids are logged, a stage misbehaves):
a fork is refused while another thread runs, and a test process may hold threads
other tests left (Dask's offload thread), so in-process runs would not fork at all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from opguard_core.run.forked import can_fork
from tests.builders import sample_inputs

pytestmark = pytest.mark.skipif(
    "fork" not in __import__("multiprocessing").get_all_start_methods(), reason="needs fork"
)

ARTIFACTS = (
    "gpt_callsite_combined.json",
    "gpt_callsite_divergence.json",
    "gpt_callsite_divergence.log",
    "gpt_callsite_compressed.json",
    "gpt_callsite_instrumentation.yaml",
)

#: run before the CLI in every child: every divergence stage forks (no size
#: threshold), the write and the divergence stage share one helper unless
#: OVERLAP_SPLIT_MIN says from how many callsites each gets its own, and each
#: helper's pid is appended to the file named by OVERLAP_PIDS
PATCH = """
import os
from opguard_core.run import helper as entry_helper
from opguard_core.run.forked import ForkedCall

entry_helper.OVERLAP_MIN_CALLSITES = 0
entry_helper.SPLIT_MIN_CALLSITES = int(os.environ.get("OVERLAP_SPLIT_MIN", 10**9))
_start = ForkedCall.start.__func__

def _logged(cls, work, what):
    job = _start(cls, work, what)
    if job is not None:
        with open(os.environ["OVERLAP_PIDS"], "a") as pids:
            pids.write(f"{job.pid}\\n")
    return job

ForkedCall.start = classmethod(_logged)
"""


class Run:
    def __init__(self, proc: subprocess.CompletedProcess[str], out: Path, pids: Path) -> None:
        self.stderr = proc.stderr
        self.exit_code = proc.returncode
        dirs = sorted(out.iterdir()) if out.exists() else []
        self.run_dir = dirs[-1]
        self.pids = [int(p) for p in pids.read_text().split()] if pids.exists() else []

    def read(self, name: str) -> str:
        return (self.run_dir / name).read_text()

    def stages(self) -> list[tuple[str, str | None, str, Any, Any]]:
        summary = json.loads(self.read("pipeline_summary.json"))
        return [
            (r["stage"], r["entry"], r["status"], r["counts"], r["error"])
            for r in summary["stages"]
        ]

    def events(self) -> list[tuple[str, str | None]]:
        logged = [json.loads(line) for line in self.stderr.splitlines() if line.startswith("{")]
        return [(e["event"], e.get("stage")) for e in logged]


def run(tmp_path: Path, name: str, *args: str, patch: str = "", split: bool = False) -> Run:
    """``opguard run ARGS`` in a fresh process, after PATCH and ``patch``; with
    ``split``, the write and the divergence stage each in a helper of its own."""
    where = tmp_path / name
    where.mkdir()
    (where / "overlap_patch.py").write_text(PATCH + textwrap.dedent(patch))
    code = (
        f"import sys; sys.path.insert(0, {str(where)!r}); import overlap_patch\n"
        "from opguard_core.cli.app import main\n"
        "main(sys.argv[1:])\n"
    )
    env = {
        **os.environ,
        "OVERLAP_PIDS": str(where / "pids"),
        **({"OVERLAP_SPLIT_MIN": "0"} if split else {}),
        "PYTHONPATH": str(Path(__file__).parents[1]),
    }
    env.pop("OPGUARD_DISABLE_PLUGINS", None)
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            "--log-format",
            "json",
            "run",
            "--output-base",
            str(where / "out"),
            *args,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    return Run(proc, where / "out", where / "pids")


def gone(pid: int) -> bool:
    """Whether no process ``pid`` exists (a helper killed and reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize("split", [False, True], ids=["one_helper", "two_helpers"])
def test_a_forked_divergence_stage_gives_what_an_in_process_one_gives(
    tmp_path: Path, samples: Path, split: bool
) -> None:
    alone = run(tmp_path, "alone", "--jobs", "1", *sample_inputs(samples, "gpt"))
    assert alone.exit_code == 0, alone.stderr
    assert alone.pids == []  # --jobs 1: one process
    overlapped = run(tmp_path, "overlapped", *sample_inputs(samples, "gpt"), split=split)
    assert overlapped.exit_code == 0, overlapped.stderr
    assert len(overlapped.pids) == (2 if split else 1)
    for name in ARTIFACTS:
        assert overlapped.read(name) == alone.read(name), name
    assert overlapped.stages() == alone.stages()
    assert [s[0] for s in overlapped.stages()][:5] == [
        "discover", "combine", "divergence", "compress", "generate",
    ]  # fmt: skip
    # the helper's log events are logged by the run, with their stage
    assert ("ranks diverge", "divergence") in overlapped.events()
    assert sorted(overlapped.events()) == sorted(alone.events())
    assert all(map(gone, overlapped.pids))


@pytest.mark.parametrize("split", [False, True], ids=["one_helper", "two_helpers"])
def test_a_divergence_plugin_failing_in_the_helper_fails_its_stage_only(
    tmp_path: Path, samples: Path, split: bool
) -> None:
    broken = run(tmp_path, "broken", *sample_inputs(samples, "gpt"), patch="""
        from opguard_plugins.stages import divergence

        def broken(trace, options):
            raise RuntimeError("no findings today")

        divergence.find_divergence = broken
    """, split=split)  # fmt: skip
    assert broken.exit_code == 1, broken.stderr
    assert len(broken.pids) == (2 if split else 1)
    records = {s[0]: s for s in broken.stages()}
    assert records["divergence"][2] == "failed"
    assert "RuntimeError: no findings today" in records["divergence"][4]
    assert records["compress"][2] == records["generate"][2] == "ok"
    assert (broken.run_dir / "gpt_callsite_instrumentation.yaml").exists()
    assert ("stage failed", "divergence") in broken.events()


@pytest.mark.parametrize("split", [False, True], ids=["one_helper", "two_helpers"])
def test_a_helper_that_dies_is_named_and_the_run_goes_on(
    tmp_path: Path, samples: Path, split: bool
) -> None:
    dies = run(tmp_path, "dies", *sample_inputs(samples, "gpt"), patch="""
        import os
        from opguard_plugins.stages import divergence

        parent = os.getpid()

        def dies(trace, options):
            if os.getpid() == parent:
                raise AssertionError("the divergence stage did not run in a helper")
            os._exit(7)

        divergence.find_divergence = dies
    """, split=split)  # fmt: skip
    assert dies.exit_code == 1, dies.stderr
    records = {s[0]: s for s in dies.stages()}
    # the write: its own helper's, whole (two helpers); or in the dying helper's thread,
    # claimed only if it came to the end before the helper died (one helper)
    written = (dies.run_dir / "gpt_callsite_combined.json").exists()
    assert written or not split
    assert records["combine"][2] == ("ok" if written else "failed")
    assert records["divergence"][2] == "failed"
    assert records["divergence"][4] == (
        "divergence of gpt_callsite: its helper process died (exit code 7; out of memory?)"
    )
    assert records["generate"][2] == "ok"
    assert not (dies.run_dir / "gpt_callsite_divergence.json").exists()


@pytest.mark.parametrize("split", [False, True], ids=["one_helper", "two_helpers"])
def test_an_interrupted_run_kills_the_helper_instead_of_waiting(
    tmp_path: Path, samples: Path, split: bool
) -> None:
    started = time.monotonic()
    stopped = run(tmp_path, "stopped", *sample_inputs(samples, "gpt"), patch="""
        import os, signal, time
        from opguard_plugins.stages import compress
        from opguard_plugins.stages import divergence

        parent = os.getpid()
        real_compress = compress.compress_trace

        def slow(trace, options):
            if os.getpid() != parent:
                time.sleep(120)  # the helper: far longer than the test may take
            return []

        def interrupted(trace, options):
            os.kill(os.getpid(), signal.SIGTERM)  # the runner turns it into Interrupted
            return real_compress(trace, options)

        divergence.find_divergence = slow
        compress.compress_trace = interrupted
    """, split=split)  # fmt: skip
    assert stopped.exit_code == 130, stopped.stderr  # the runner uses 130 for any signal
    assert time.monotonic() - started < 60
    summary = json.loads(stopped.read("pipeline_summary.json"))
    assert summary["interrupted"]["signal"] == "SIGTERM"
    assert summary["interrupted"]["stage"] == "compress"
    # killed, not left sleeping
    assert len(stopped.pids) == (2 if split else 1) and all(map(gone, stopped.pids))


def test_no_fork_while_another_thread_runs() -> None:
    """A fork with another thread running could inherit a lock held forever: refused."""
    import threading

    assert can_fork() == (threading.active_count() == 1)
    release = threading.Event()
    other = threading.Thread(target=release.wait)
    other.start()
    try:
        assert not can_fork()
    finally:
        release.set()
        other.join()


def test_the_helper_writes_the_combined_trace_of_a_single_rank_entry(
    tmp_path: Path, samples: Path
) -> None:
    """No divergence stage (one rank): the helper only encodes and writes the file."""
    one = ["-i", str(samples / "gpt_callsite_rank0.json")]
    alone = run(tmp_path, "alone", "--jobs", "1", *one)
    helped = run(tmp_path, "helped", *one)
    assert alone.exit_code == helped.exit_code == 0, helped.stderr
    assert alone.pids == [] and len(helped.pids) == 1
    (written,) = helped.run_dir.glob("*_combined.json")
    assert helped.read(written.name) == alone.read(written.name)
    assert "divergence" not in [s[0] for s in helped.stages()]
    assert [s[2] for s in helped.stages()] == [s[2] for s in alone.stages()]


WRITE_FAILS = """
    import errno
    from opguard_core.errors import WriteError
    from opguard_core.run import steps

    real_write = steps.atomic_write_parts

    def write(path, data):
        if path.name.endswith("_combined.json"):
            {action}
        real_write(path, data)

    steps.atomic_write_parts = write
"""


@pytest.mark.parametrize("split", [False, True], ids=["one_helper", "two_helpers"])
def test_a_failed_write_in_the_helper_fails_the_combine_stage(
    tmp_path: Path, samples: Path, split: bool
) -> None:
    action = 'raise WriteError(path, OSError(errno.ENOSPC, "No space left on device"))'
    full = run(tmp_path, "full", *sample_inputs(samples, "gpt"),
               patch=WRITE_FAILS.format(action=action), split=split)  # fmt: skip
    assert full.exit_code == 1, full.stderr
    assert len(full.pids) == (2 if split else 1)
    records = {s[0]: s for s in full.stages()}
    assert records["combine"][2] == "failed"
    assert "gpt_callsite_combined.json" in records["combine"][4]
    assert "No space left on device" in records["combine"][4]
    assert "\n" not in records["combine"][4]
    # compress and generate read the trace in memory: they ran; so did divergence
    assert records["divergence"][2] == records["compress"][2] == records["generate"][2] == "ok"
    assert not (full.run_dir / "gpt_callsite_combined.json").exists()
    assert ("stage failed", "combine") in full.events()
    assert not list(full.run_dir.glob(".*.tmp"))


@pytest.mark.parametrize("split", [False, True], ids=["one_helper", "two_helpers"])
def test_a_helper_dying_before_the_write_fails_combine_and_its_own_work(
    tmp_path: Path, samples: Path, split: bool
) -> None:
    dies = run(tmp_path, "dies", *sample_inputs(samples, "gpt"),
               patch=WRITE_FAILS.format(action="os._exit(9)"), split=split)  # fmt: skip
    assert dies.exit_code == 1, dies.stderr
    records = {s[0]: s for s in dies.stages()}
    died = "its helper process died (exit code 9; out of memory?)"
    assert records["combine"][2] == "failed"
    assert records["generate"][2] == "ok"
    if split:  # the write's own helper died; the divergence stage's ran to the end
        path = dies.run_dir / "gpt_callsite_combined.json"
        assert records["combine"][4] == f"writing {path}: {died}"
        assert records["divergence"][2] == "ok"
    else:
        assert (
            records["combine"][4]
            == records["divergence"][4]
            == f"divergence of gpt_callsite: {died}"
        )


@pytest.mark.parametrize("split", [False, True], ids=["one_helper", "two_helpers"])
def test_an_interrupted_run_removes_what_the_helper_left_half_written(
    tmp_path: Path, samples: Path, split: bool
) -> None:
    """The helper is killed mid-write (SIGKILL: no cleanup of its own); the run removes
    the temporary file and does not claim the combined trace."""
    half = run(tmp_path, "half", *sample_inputs(samples, "gpt"), patch="""
        import os, signal, tempfile, time
        from opguard_plugins.stages import compress

        parent = os.getpid()
        real_compress = compress.compress_trace

        def write(path, data):
            if os.getpid() != parent and path.name.endswith("_combined.json"):
                tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
                time.sleep(120)  # half-way through, far longer than the test may take
            runner_write(path, data)

        def interrupted(trace, options):
            time.sleep(0.5)  # the helper has made its temporary file
            os.kill(os.getpid(), signal.SIGTERM)
            return real_compress(trace, options)

        from opguard_core.run import steps
        runner_write = steps.atomic_write_parts
        steps.atomic_write_parts = write
        compress.compress_trace = interrupted
    """, split=split)  # fmt: skip
    assert half.exit_code == 130, half.stderr
    assert len(half.pids) == (2 if split else 1) and all(map(gone, half.pids))
    assert not list(half.run_dir.glob(".*"))
    records = {s[0]: s for s in half.stages()}
    assert records["combine"][2] == "failed"
    assert records["combine"][4] == "interrupted before gpt_callsite_combined.json was written"
    assert not (half.run_dir / "gpt_callsite_combined.json").exists()


@pytest.mark.parametrize("split", [False, True], ids=["one_helper", "two_helpers"])
def test_an_unexpected_error_in_the_write_fails_the_combine_stage(
    tmp_path: Path, samples: Path, split: bool
) -> None:
    """Raised in the helper's writing thread (one helper) or its own helper (two), a
    bug in the write is not lost: the combine stage fails and the file is not claimed."""
    broken = run(tmp_path, "broken", *sample_inputs(samples, "gpt"), split=split,
                 patch=WRITE_FAILS.format(action='raise RuntimeError("disk on fire")'))  # fmt: skip
    assert broken.exit_code == 1, broken.stderr
    records = {s[0]: s for s in broken.stages()}
    assert records["combine"][2] == "failed"
    assert "disk on fire" in records["combine"][4], records["combine"][4]
    assert records["generate"][2] == "ok"
    assert not (broken.run_dir / "gpt_callsite_combined.json").exists()


def test_a_helper_killed_while_it_sends_its_result_is_a_death_not_a_traceback() -> None:
    """A result larger than a pipe's buffer is sent in pieces: a helper killed after
    the first piece (SIGKILL, the OOM killer) left part of a pickle, which raised
    UnpicklingError out of the run (a traceback, and a summary that said ok)."""
    import signal

    from opguard_core.errors import OpGuardError
    from opguard_core.run.forked import ForkedCall

    if not can_fork():
        pytest.skip("another thread runs in this test process")
    job = ForkedCall.start(lambda: b"x" * (4 << 20), "sending")
    assert job is not None
    time.sleep(0.5)  # the child has filled the pipe and waits for us to read it
    os.kill(job.pid, signal.SIGKILL)
    died = r"^sending: its helper process died \(killed by SIGKILL"
    with pytest.raises(OpGuardError, match=died):
        job.result()
    assert gone(job.pid)


@pytest.mark.parametrize("split", [False, True], ids=["one_helper", "two_helpers"])
@pytest.mark.parametrize("name", ["_combined.json", "_divergence.json"])
def test_a_helper_dying_mid_write_leaves_no_temporary_file(
    tmp_path: Path, samples: Path, split: bool, name: str
) -> None:
    """A helper that dies half-way through a write (the OOM killer, os._exit in a
    plugin) runs no cleanup of its own: its temporary file was left in the run
    directory of a run that went on and ended ``failed``, not interrupted."""
    patch = f"""
        import os, tempfile
        from opguard_core.run import steps

        def dying(real):
            def write(path, data):
                if path.name.endswith({name!r}):
                    tempfile.mkstemp(prefix=f".{{path.name}}.", suffix=".tmp", dir=path.parent)
                    os._exit(9)
                real(path, data)
            return write

        steps.atomic_write_parts = dying(steps.atomic_write_parts)
        steps.atomic_write_bytes = dying(steps.atomic_write_bytes)
    """
    dies = run(tmp_path, "dies", *sample_inputs(samples, "gpt"), patch=patch, split=split)
    assert dies.exit_code == 1, dies.stderr
    assert "its helper process died (exit code 9" in dies.stderr
    assert not list(dies.run_dir.glob(".*.tmp"))
    assert all(map(gone, dies.pids))


def test_an_error_no_stage_caught_is_a_failed_run_not_an_ok_summary(
    tmp_path: Path, samples: Path
) -> None:
    """An exception out of the runner's own plumbing (here, reading a helper's
    result; before, the part of a pickle a killed helper left) ended the command with
    a traceback while the final summary, written on the way out, said ok, exit 0."""
    bug = run(tmp_path, "bug", *sample_inputs(samples, "gpt"), patch="""
        real_result = ForkedCall.result

        def broken(self):
            real_result(self)
            raise RuntimeError("a bug of ours")

        ForkedCall.result = broken
    """)  # fmt: skip
    assert bug.exit_code == 1, bug.stderr
    assert "Traceback" not in bug.stderr
    summary = json.loads(bug.read("pipeline_summary.json"))
    assert (summary["status"], summary["exit_code"]) == ("failed", 1)
    failed = [s for s in bug.stages() if s[2] == "failed"]
    assert [(s[1], s[4]) for s in failed] == [
        ("gpt_callsite", "internal error: RuntimeError: a bug of ours")
    ]
    assert "failed: internal error: RuntimeError: a bug of ours" in bug.stderr
    assert ("run failed", failed[0][0]) in bug.events()
    assert all(map(gone, bug.pids))


@pytest.mark.parametrize("split", [False, True], ids=["one_helper", "two_helpers"])
def test_an_interrupted_run_records_what_its_helper_had_finished(
    tmp_path: Path, samples: Path, split: bool
) -> None:
    """The helper had written the divergence stage's files and ended when the signal
    came: the summary said nothing of the stage (its records were dropped with the
    helper, as if it had been cut short) while its files were in the run directory.
    An in-process run records it ok; so does a run whose helper was done."""
    stopped = run(tmp_path, "stopped", *sample_inputs(samples, "gpt"), patch="""
        import os, signal, time
        from opguard_plugins.stages import compress

        real_compress = compress.compress_trace

        def interrupted(trace, options):
            time.sleep(1.5)  # the helper is done by now
            os.kill(os.getpid(), signal.SIGTERM)
            return real_compress(trace, options)

        compress.compress_trace = interrupted
    """, split=split)  # fmt: skip
    assert stopped.exit_code == 130, stopped.stderr
    assert all(map(gone, stopped.pids))
    records = {s[0]: s for s in stopped.stages()}
    assert records["compress"][2] == "interrupted"
    assert records["divergence"][2] == records["combine"][2] == "ok"
    summary = json.loads(stopped.read("pipeline_summary.json"))
    assert summary["interrupted"]["stage"] == "compress"
    summary = json.loads(stopped.read("pipeline_summary.json"))
    outputs = {r["stage"]: r["outputs"] for r in summary["stages"]}
    assert outputs["divergence"] == ["gpt_callsite_divergence.json", "gpt_callsite_divergence.log"]
    assert all((stopped.run_dir / name).exists() for name in outputs["divergence"])
    assert ("stage done", "divergence") in stopped.events()
    assert not list(stopped.run_dir.glob(".*"))


def test_a_run_interrupted_while_it_waits_for_its_helper_kills_it(
    tmp_path: Path, samples: Path
) -> None:
    """The signal came while the run waited for the helper's result (compress and
    generate done): the wait went on until the helper ended of itself (here two
    minutes; a stuck divergence plugin, never), instead of killing it."""
    started = time.monotonic()
    stopped = run(tmp_path, "stopped", *sample_inputs(samples, "gpt"), patch="""
        import os, signal, threading, time
        from opguard_plugins.stages import compress
        from opguard_plugins.stages import divergence

        parent = os.getpid()
        real_compress = compress.compress_trace

        def slow(trace, options):
            time.sleep(120)  # the helper: far longer than the test may take
            return []

        def later(trace, options):  # after the fork: a thread no longer stops it
            threading.Timer(1.5, os.kill, (parent, signal.SIGTERM)).start()
            return real_compress(trace, options)

        divergence.find_divergence = slow
        compress.compress_trace = later
    """)  # fmt: skip
    assert stopped.exit_code == 130, stopped.stderr
    assert time.monotonic() - started < 60
    summary = json.loads(stopped.read("pipeline_summary.json"))
    assert summary["interrupted"] == {
        "signal": "SIGTERM", "stage": "divergence", "entry": "gpt_callsite"
    }  # fmt: skip
    assert len(stopped.pids) == 1 and all(map(gone, stopped.pids))
    assert not (stopped.run_dir / "gpt_callsite_divergence.json").exists()
    assert not list(stopped.run_dir.glob(".*"))
