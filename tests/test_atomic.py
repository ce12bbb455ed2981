"""Nothing half-written (issue 5, part 2): atomic artifact writes, and runs interrupted by
SIGINT or SIGTERM mid-stage."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from ruamel.yaml import YAML

import opguard_core.files.atomic as atomic
import opguard_plugins.stages.compress as compress_plugin
import opguard_plugins.stages.generate as generate_plugin
from opguard_core.files.atomic import TMP_SUFFIX, atomic_write_bytes, atomic_write_text
from opguard_core.formats.divergence import load_divergence
from opguard_core.formats.trace import load_trace
from opguard_core.formats.tree import load_tree
from tests.builders import sample_inputs

# ----------------------------------------------------------------------------- helpers


def leftovers(directory: Path) -> list[str]:
    """Temporary files (``.{name}.XXXX.tmp``) left in ``directory``."""
    return sorted(p.name for p in directory.rglob("*") if p.name.endswith(TMP_SUFFIX))


def assert_every_artifact_parses(run_dir: Path) -> None:
    """No temp files; every artifact present is a complete, valid document."""
    assert leftovers(run_dir) == []
    for path in sorted(run_dir.iterdir()):
        name = path.name
        if name == "pipeline_summary.json":
            json.loads(path.read_text())
        elif name.endswith("_combined.json"):
            load_trace(path)
        elif name.endswith("_compressed.json"):
            load_tree(path)
        elif name.endswith("_divergence.json"):
            load_divergence(path)
        elif name.endswith(".yaml"):
            config = YAML(typ="safe").load(path.read_text())
            assert isinstance(config, dict) and "entries" in config, name
        elif name.endswith(".log"):
            assert path.read_text().endswith("\n"), name
        elif name == "report.html":
            assert path.read_text().rstrip().endswith("</html>"), name
        else:
            raise AssertionError(f"unexpected artifact {name}")


# ----------------------------------------------------------------------------- unit level


def test_atomic_write_replaces_whole_file_and_leaves_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "artifact.json"
    atomic_write_bytes(target, b"first")
    atomic_write_text(target, "second \u2713\n")
    assert target.read_bytes() == "second \u2713\n".encode()
    assert [p.name for p in tmp_path.iterdir()] == ["artifact.json"]


@pytest.mark.parametrize(
    ("patched", "error"),
    [
        pytest.param("fsync", OSError(errno.ENOSPC, "No space left on device"), id="disk_full"),
        pytest.param("replace", OSError(errno.EXDEV, "rename failed"), id="rename_fails"),
        pytest.param("fsync", KeyboardInterrupt(), id="interrupted_mid_write"),
    ],
)
def test_failed_write_keeps_old_content_and_leaves_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, patched: str, error: BaseException
) -> None:
    target = tmp_path / "artifact.yaml"
    target.write_text("old: complete\n")
    seen: list[str] = []

    def fail(*args: Any) -> None:
        # by now the temp file holds (part of) the new data in the same directory
        seen.extend(p.name for p in tmp_path.iterdir() if p.name.endswith(TMP_SUFFIX))
        raise error

    monkeypatch.setattr(atomic.os, patched, fail)
    with pytest.raises(type(error)):
        atomic_write_text(target, "new: " + "x" * 100_000 + "\n")
    assert seen and seen[0].startswith(".artifact.yaml.")
    assert target.read_text() == "old: complete\n"
    assert leftovers(tmp_path) == []


def test_failed_first_write_leaves_no_file_at_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(fd: int) -> None:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(atomic.os, "fsync", fail)
    with pytest.raises(OSError):
        atomic_write_bytes(tmp_path / "new.json", b"{}")
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- in a run


def test_write_failing_mid_run_leaves_no_partial_artifact(
    opguard: Callable[..., Any], samples: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if (
            os.readlink(f"/proc/self/fd/{fd}")
            .rsplit("/", 1)[-1]
            .startswith(".gpt_callsite_compressed.json.")
        ):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc to name the file being written")
    monkeypatch.setattr(atomic.os, "fsync", fsync)
    run = opguard(
        "run",
        *sample_inputs(samples, "gpt", "fsdp"),
    )
    assert run.exit_code == 1
    assert "Traceback" not in run.stderr
    assert not (run.run_dir / "gpt_callsite_compressed.json").exists()
    assert (run.run_dir / "gpt_callsite_combined.json").exists()
    assert (run.run_dir / "fsdp_callsite_instrumentation.yaml").exists()
    assert_every_artifact_parses(run.run_dir)
    summary = json.loads(run.read("pipeline_summary.json"))
    failed = [s for s in summary["stages"] if s["status"] == "failed"]
    assert [(s["stage"], s["entry"]) for s in failed] == [("compress", "gpt_callsite")]
    assert "No space left on device" in failed[0]["error"]


def _interrupted_summary(run: Any) -> dict[str, Any]:
    summary: dict[str, Any] = json.loads(run.read("pipeline_summary.json"))
    assert summary["status"] == "interrupted"
    assert summary["exit_code"] == 130
    assert summary["finished_at"] is not None
    return summary


def test_keyboard_interrupt_mid_stage_stops_cleanly(
    opguard: Callable[..., Any], samples: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = compress_plugin.compress_trace

    def compress(trace: Any, options: Any) -> Any:
        if trace.meta.get("label") == "fsdp":
            # Ctrl-C: a real SIGINT (a KeyboardInterrupt a plugin raises without one
            # is a failure of its stage: tests/test_hostile_run.py)
            os.kill(os.getpid(), signal.SIGINT)
        return real(trace, options)

    monkeypatch.setattr(compress_plugin, "compress_trace", compress)
    run = opguard(
        "run",
        *sample_inputs(samples, "gpt", "fsdp"),
    )
    assert run.exit_code == 130
    summary = _interrupted_summary(run)
    assert summary["interrupted"] == {
        "signal": "SIGINT",
        "stage": "compress",
        "entry": "fsdp_callsite",
    }
    last = summary["stages"][-1]
    assert (last["stage"], last["entry"], last["status"]) == (
        "compress",
        "fsdp_callsite",
        "interrupted",
    )
    names = sorted(p.name for p in run.run_dir.iterdir())
    assert names == [
        "fsdp_callsite_combined.json",
        "fsdp_callsite_divergence.json",
        "fsdp_callsite_divergence.log",
        "gpt_callsite_combined.json",
        "gpt_callsite_compressed.json",
        "gpt_callsite_divergence.json",
        "gpt_callsite_divergence.log",
        "gpt_callsite_instrumentation.yaml",
        "pipeline_summary.json",
        "report.html",  # the report of an interrupted run shows how far it got
    ]
    assert_every_artifact_parses(run.run_dir)


def test_sigterm_mid_stage_stops_cleanly(
    opguard: Callable[..., Any], samples: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = generate_plugin.generate_config

    def generate(tree: Any, source: str, depth: int) -> Any:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises before this returns
        return real(tree, source, depth)

    monkeypatch.setattr(generate_plugin, "generate_config", generate)
    before = signal.getsignal(signal.SIGTERM)
    run = opguard("run", "-i", str(samples / "gpt_callsite_rank*.json"))
    assert signal.getsignal(signal.SIGTERM) == before  # the runner restores the handler
    assert run.exit_code == 130
    summary = _interrupted_summary(run)
    assert summary["interrupted"] == {
        "signal": "SIGTERM",
        "stage": "generate",
        "entry": "gpt_callsite",
    }
    assert not (run.run_dir / "gpt_callsite_instrumentation.yaml").exists()
    assert_every_artifact_parses(run.run_dir)


def test_interrupt_during_an_artifact_write_leaves_no_temp(
    opguard: Callable[..., Any], samples: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_replace = os.replace

    def replace(src: str, dst: str) -> None:
        if str(dst).endswith("_compressed.json"):
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C just before the rename
        real_replace(src, dst)

    monkeypatch.setattr(atomic.os, "replace", replace)
    run = opguard("run", "-i", str(samples / "gpt_callsite_rank*.json"))
    assert run.exit_code == 130
    summary = _interrupted_summary(run)
    assert summary["interrupted"]["stage"] == "compress"
    assert not (run.run_dir / "gpt_callsite_compressed.json").exists()
    assert_every_artifact_parses(run.run_dir)


# ----------------------------------------------------------------------------- real signals


def _write_big_rank_files(directory: Path, callsites: int) -> None:
    """2 rank files x ``callsites`` callsites: combine takes a couple of seconds."""
    frames = [
        {
            "file": f"pkg/m{i % 50}.py",
            "line": i,
            "function": f"f{i}",
            "qualname": f"C{i % 7}.f{i}",
            "module": f"pkg.m{i % 50}",
        }
        for i in range(2000)
    ]
    for rank in range(2):
        sites = [
            {
                "stack": [j % 2000, (j * 7 + rank) % 2000, (j // 3) % 2000],
                "op": f"aten::op{j % 13}",
                "stream": j % 3,
                "count": 1 + j % 5,
            }
            for j in range(callsites)
        ]
        doc = {
            "format": "opguard-callsites",
            "version": 1,
            "meta": {"rank": rank, "world_size": 2},
            "frames": frames,
            "callsites": sites,
        }
        (directory / f"big_rank{rank}.json").write_bytes(msgspec.json.encode(doc))


def _reset_sigint() -> None:
    # a child of a shell job may inherit SIGINT ignored; a user's Ctrl-C is not ignored
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow  # a real signal to a subprocess combining 2 x 200k callsites
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_real_signal_during_combine_exits_130_with_summary(
    tmp_path: Path, signum: signal.Signals
) -> None:
    _write_big_rank_files(tmp_path, 200_000)
    out = tmp_path / "out"
    env = {**os.environ, "OPGUARD_TRACE_OUTPUT_BASE": str(out)}
    env.pop("OPGUARD_DISABLE_PLUGINS", None)
    command = [sys.executable, "-m", "opguard_core.cli.app", "--log-format", "json", "run"]
    process = subprocess.Popen(
        [*command, "-i", "big_rank*.json"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=_reset_sigint,
    )
    try:
        deadline = time.monotonic() + 30
        summary_path: Path | None = None
        while time.monotonic() < deadline and process.poll() is None:
            found = list(out.glob("preprocessing_*/pipeline_summary.json"))
            if found:
                summary_path = found[0]
                break
            time.sleep(0.01)
        assert summary_path is not None, "the run directory never appeared"
        time.sleep(0.3)  # well inside combine (which takes seconds on this input)
        assert process.poll() is None, "the run finished before it could be interrupted"
        process.send_signal(signum)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 130, stderr.decode()
    assert b"Traceback" not in stderr
    run_dir = summary_path.parent
    summary = json.loads(summary_path.read_text())
    assert summary["status"] == "interrupted"
    assert summary["interrupted"] == {
        "signal": signal.Signals(signum).name,
        "stage": "combine",
        "entry": "big",
    }
    assert not (run_dir / "big_combined.json").exists()
    assert_every_artifact_parses(run_dir)


def test_parts_are_written_as_one_file(tmp_path: Path) -> None:
    from opguard_core.files.atomic import atomic_write_parts

    target = tmp_path / "doc.json"
    atomic_write_parts(target, iter([b"a", b"", b"bc"]))
    assert target.read_bytes() == b"abc"

    def failing() -> Iterator[bytes]:
        yield b"half"
        raise RuntimeError("the encoder gave up")

    with pytest.raises(RuntimeError):
        atomic_write_parts(target, failing())
    assert target.read_bytes() == b"abc"  # the old file stays whole
    assert [p.name for p in tmp_path.iterdir()] == ["doc.json"]  # no temporary left
