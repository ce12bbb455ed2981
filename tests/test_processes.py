"""opguard_core.processes: work done at SIGTERM (docs/reliability.md, "Crash-safe
recording"), in a real child process that signals itself."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

#: a callback that writes its file in steps and gets a second SIGTERM halfway, as from
#: a launcher that sends two; it must finish before the process dies of the first
SECOND_SIGTERM_WHILE_WRITING = """
import os, signal, sys, time
from opguard_core.processes import at_sigterm

out = sys.argv[1]
calls = []

def write(ends):
    calls.append(ends)
    with open(out + ".tmp", "w") as f:
        f.write("begun;")
        if len(calls) == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # handled at the next bytecode
        for _ in range(20):
            time.sleep(0.005)
        f.write("calls=%d" % len(calls))
    os.replace(out + ".tmp", out)

assert at_sigterm(write)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(30)
"""


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_a_second_sigterm_does_not_cut_the_first_ones_work_short(tmp_path: Path) -> None:
    out = tmp_path / "report"
    proc = subprocess.run(
        [sys.executable, "-c", SECOND_SIGTERM_WHILE_WRITING, str(out)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == -signal.SIGTERM, proc.stderr  # died of it, as untraced
    assert out.read_text() == "begun;calls=1", proc.stderr
    assert not (tmp_path / "report.tmp").exists()
