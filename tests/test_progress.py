"""Progress bars: per-file progress in combine; nothing in JSON mode or off a terminal."""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from opguard_core import logs
from opguard_core.model import InputEntry, RunOptions
from opguard_plugins.stages import combine
from tests.conftest import RunResult

BAR_MARKS = ("━", "\r", "\x1b[")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def restore_logging() -> Iterator[None]:
    saved = dict(logs._state)
    yield
    logs._state.update(saved)


@pytest.mark.parametrize(
    ("mode", "stream"),
    [("json", _Terminal), ("console", io.StringIO)],  # a StringIO's isatty() is False
    ids=["json-mode-even-on-a-terminal", "console-mode-off-a-terminal"],
)
def test_no_progress_in_json_mode_or_off_a_terminal(
    monkeypatch: pytest.MonkeyPatch, restore_logging: None, mode: str, stream: type[io.StringIO]
) -> None:
    output = stream()
    monkeypatch.setattr(logs.sys, "stderr", output)
    logs.configure_logging(mode)
    assert not logs.progress_enabled()
    with logs.progress("combine x", 10) as advance:
        advance(5)
    assert output.getvalue() == ""


def test_console_mode_on_a_terminal_enables_progress(
    monkeypatch: pytest.MonkeyPatch, restore_logging: None
) -> None:
    monkeypatch.setattr(logs.sys, "stderr", _Terminal())
    logs.configure_logging("console")
    assert logs.progress_enabled()


@pytest.mark.parametrize("log_format", ["json", "console"])
def test_a_multi_file_run_off_a_terminal_writes_no_progress(
    opguard: Callable[..., RunResult], samples: Path, log_format: str
) -> None:
    argv = ["--input", str(samples / "fsdp_callsite_rank*.json"), "--jobs", "2"]
    run = opguard("--log-format", log_format, "run", *argv, expect=0)
    stderr = run.stderr
    assert not any(mark in stderr for mark in BAR_MARKS), stderr
    if log_format == "json":
        for line in stderr.splitlines():
            json.loads(line)  # only log records, no bar


@pytest.mark.parametrize("jobs", [1, 2])
def test_combine_advances_once_per_file(
    samples: Path, monkeypatch: pytest.MonkeyPatch, jobs: int
) -> None:
    calls: list[tuple[str, int]] = []
    advanced: list[int] = []

    @contextlib.contextmanager
    def recording(description: str, total: int) -> Iterator[Callable[[int], None]]:
        calls.append((description, total))
        yield advanced.append

    monkeypatch.setattr(combine, "progress", recording)
    # one entry, one file per rank (two files claiming one rank are refused)
    files = tuple(sorted(samples.glob("gpt_callsite_rank*.json")))
    entry = InputEntry(name="all", files=files, index=1)
    trace = combine.combine_entry(entry, RunOptions(jobs=jobs))
    assert calls == [("combine all", len(files))]
    assert sum(advanced) == len(files)
    assert trace.ranks == [0, 1]
