"""Logging: JSON off a terminal, console when forced, verbose detail and tracebacks."""

from __future__ import annotations

import json
import sys

import pytest

from opguard_core.logs import resolve_format


def test_format_follows_the_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert resolve_format(None) == "console"
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    assert resolve_format(None) == "json"
    assert resolve_format("console") == "console"


def test_console_format_is_not_json(opguard, samples) -> None:
    run = opguard("--log-format", "console", "run", "--base-dir", samples,
                  "--input", "gpt_callsite_rank0.json", expect=0)  # fmt: skip
    lines = [line for line in run.stderr.splitlines() if "stage done" in line]
    assert lines and not lines[0].lstrip().startswith("{")
    assert "stage=compress" in run.stderr or "compress" in run.stderr


def test_verbose_adds_debug_detail(opguard, samples) -> None:
    quiet = opguard("run", "--base-dir", samples, "--input", "gpt_callsite_rank0.json", expect=0)
    loud = opguard("run", "-v", "--base-dir", samples, "--input", "gpt_callsite_rank0.json",
                   expect=0)  # fmt: skip

    def events(text: str) -> list[dict]:
        return [json.loads(line) for line in text.splitlines() if line.startswith("{")]

    assert not [e for e in events(quiet.stderr) if e["level"] == "debug"]
    detail = [e for e in events(loud.stderr) if e["event"] == "stage detail"]
    assert {e["stage"] for e in detail} >= {"combine", "compress", "generate"}
    assert all("plugin" in e for e in detail)


def test_a_plugin_crash_is_one_line_unless_verbose(opguard, samples, monkeypatch) -> None:
    import opguard_plugins.stages.generate as generate

    def broken(tree, source, depth):  # type: ignore[no-untyped-def]
        raise ValueError("boom in generate")

    monkeypatch.setattr(generate, "generate_config", broken)
    run = opguard("run", "--base-dir", samples, "--input", "gpt_callsite_rank0.json")
    assert run.exit_code == 1
    assert "generate [gpt_callsite] failed: ValueError: boom in generate" in run.stderr
    assert "Traceback" not in run.stderr
    verbose = opguard("run", "-v", "--base-dir", samples, "--input", "gpt_callsite_rank0.json")
    assert verbose.exit_code == 1
    assert "Traceback" in verbose.stderr
    summary = json.loads(verbose.read("pipeline_summary.json"))
    failed = [s for s in summary["stages"] if s["status"] == "failed"]
    assert failed[0]["plugin"] == "generate"
