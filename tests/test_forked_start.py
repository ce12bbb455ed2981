"""A forked helper starts without a process of its own (libc looked up before the fork)."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest

from opguard_core import processes
from opguard_core.run.forked import ForkedCall


def test_a_forked_helper_does_not_run_ldconfig_to_find_libc(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``die_with_parent`` in the child needs libc's ``prctl``; looked up there, ctypes'
    ``find_library`` runs ``ldconfig -p``: a fork of the helper (all of the run's pages,
    counted again in the process tree's RSS while it lasts). ``ForkedCall.start``
    looks it up before forking, so the child starts no process."""
    started: list[Any] = []
    real = subprocess.Popen.__init__

    def spy(self: subprocess.Popen[Any], args: Any, *rest: Any, **options: Any) -> None:
        started.append(args)
        real(self, args, *rest, **options)

    monkeypatch.setattr(processes, "_PRCTL", None)  # not looked up yet, as in a fresh run
    monkeypatch.setattr(subprocess.Popen, "__init__", spy)
    job = ForkedCall.start(lambda: list(started), "test")
    if job is None:
        pytest.skip("this process may not fork here (another thread runs)")
    assert job.result() == started  # what the parent started before the fork, no more
