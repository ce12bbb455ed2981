"""Input files of other formats: the ``opguard_read_trace`` hook, gzip, and errors.

A third-party reader (here, a two-column text format) is used by ``opguard run``'s
combine (in-process and in worker processes), ``opguard check`` and ``opguard export``.
"""

from __future__ import annotations

import gzip
import json
import os
import pickle
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from opguard_core import hookimpl
from opguard_core.cli.app import create_cli
from opguard_core.combine.accumulator import TraceAccumulator
from opguard_core.errors import InputError, OpGuardError
from opguard_core.formats.readers import Readers, is_callsite_trace
from opguard_core.plugin.manager import create_plugin_manager
from opguard_plugins.stages import combine as combine_module

SAMPLES = Path(__file__).parent / "data" / "samples"


class OpCounts:
    """Reads ``opcounts`` files: a first line ``opcounts rank=R``, then ``function op
    count`` lines; each function becomes a frame of module ``app``."""

    @hookimpl
    def opguard_read_trace(self, path: Path, data: bytes) -> dict[str, Any] | None:
        lines = data.decode().splitlines()
        if not lines or not lines[0].startswith("opcounts "):
            return None
        rank = int(lines[0].split("rank=")[1])
        frames: list[dict[str, Any]] = []
        callsites = []
        for line in lines[1:]:
            function, op, count = line.split()
            frame = {"file": "app.py", "line": 1, "function": function, "qualname": function,
                     "module": "app"}  # fmt: skip
            if frame not in frames:
                frames.append(frame)
            callsites.append({"stack": [frames.index(frame)], "op": op, "stream": 0,
                              "count": int(count)})  # fmt: skip
        if not callsites:
            raise InputError(path, "an opcounts file without counts")
        return {"format": "opguard-callsites", "version": 1, "meta": {"rank": rank},
                "frames": frames, "callsites": callsites}  # fmt: skip


def _write(tmp_path: Path, rank: int, text: str) -> Path:
    path = tmp_path / f"job_rank{rank}.txt"
    path.write_text(f"opcounts rank={rank}\n{text}")
    return path


def _manager() -> Any:
    manager = create_plugin_manager()
    manager.register(OpCounts(), name="opcounts")
    return manager


def _invoke(manager: Any, *args: str | Path) -> Any:
    return CliRunner().invoke(create_cli(manager), [str(a) for a in args])


def test_hook_read_trace(tmp_path: Path) -> None:
    """run, export and check read the format; a rank-file glob is one entry."""
    for rank in (0, 1):
        _write(tmp_path, rank, "train aten::mm 3\ntrain aten::add 2\nstep aten::mul 1\n")
    manager = _manager()
    result = _invoke(manager, "run", "-i", tmp_path / "job_rank*.txt", "--output-base",
                     tmp_path / "out")  # fmt: skip
    assert result.exit_code == 0, result.output
    run_dir = Path(result.stdout.strip().splitlines()[-1])
    combined = json.loads((run_dir / "job_combined.json").read_text())
    assert combined["meta"]["ranks"] == [0, 1]
    assert sum(c["count"] for c in combined["callsites"]) == 12
    config = (run_dir / "job_instrumentation.yaml").read_text()
    assert "target: app:train" in config and "aten::mm: 6" in config

    out = tmp_path / "job.collapsed"
    result = _invoke(manager, "export", tmp_path / "job_rank0.txt", "--format", "collapsed",
                     "-o", out)  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "app:train;aten::mm 3" in out.read_text()

    result = _invoke(manager, "check", "--config", run_dir / "job_instrumentation.yaml",
                     "-i", tmp_path / "job_rank0.txt")  # fmt: skip
    assert result.exit_code == 0, result.output


def test_a_reader_refusing_its_own_file_is_one_line(tmp_path: Path) -> None:
    empty = _write(tmp_path, 0, "")
    result = _invoke(_manager(), "export", empty, "--format", "collapsed")
    assert result.exit_code == 5
    assert result.stderr.strip() == f"opguard: error: {empty}: an opcounts file without counts"


class Careless:
    """Takes ``careless`` files and returns what ``data`` says to return."""

    @hookimpl
    def opguard_read_trace(self, path: Path, data: bytes) -> Any:
        if not data.startswith(b"careless "):
            return None
        return {"list": ["x"], "object": object()}[data.split()[1].decode()]


@pytest.mark.parametrize(
    ("returned", "code", "problem"),
    [
        ("list", 5, 'plugin "careless" read it as an invalid trace: expected a JSON object'),
        ("object", 3, 'plugin "careless": opguard_read_trace('),
    ],
)
def test_a_reader_s_invalid_document_names_the_reader(
    tmp_path: Path, returned: str, code: int, problem: str
) -> None:
    """A reader returning ``["x"]`` was reported as the file's fault (``expected a
    JSON object``), the plugin unnamed; one returning an object, with a traceback."""
    path = tmp_path / "job_rank0.txt"
    path.write_text(f"careless {returned}")
    manager = create_plugin_manager()
    manager.register(Careless(), name="careless")
    result = _invoke(manager, "export", path, "--format", "collapsed")
    assert result.exit_code == code, result.output
    assert problem in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_file_no_reader_takes_is_refused_as_before(tmp_path: Path) -> None:
    other = tmp_path / "notes.txt"
    other.write_text("hello")
    result = _invoke(_manager(), "export", other, "--format", "collapsed")
    assert result.exit_code == 5 and str(other) in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_worker_processes_read_with_the_same_plugins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Readers pickle as the disabled names; a spawned worker rebuilds them from the
    installed plugins, so a reader registered by hand reaches a forked worker only."""
    monkeypatch.setattr(combine_module, "start_method", lambda: "fork")
    paths = [_write(tmp_path, r, f"f aten::mm {r + 1}\n") for r in range(3)]
    readers = Readers(_manager())
    total = combine_module.combine_parallel(paths, jobs=2, readers=readers).result()
    assert total.total == 6 and total.ranks == [0, 1, 2]
    copy = pickle.loads(pickle.dumps(readers))
    assert copy.disabled == readers.disabled and copy._manager is None


class EndsQuietlyInAWorker(OpCounts):
    """OpCounts, but a combine helper process that reads a file ends with
    ``os._exit(0)``: no result, no error, a clean exit code."""

    def __init__(self) -> None:
        self.parent = os.getpid()

    @hookimpl(tryfirst=True)
    def opguard_read_trace(self, path: Path, data: bytes) -> dict[str, Any] | None:
        if os.getpid() != self.parent:
            os._exit(0)
        time.sleep(0.1)  # the main process reads too: leave files to the worker
        return super().opguard_read_trace(path, data)


def test_a_worker_that_ends_without_its_result_fails_combine_instead_of_hanging(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only a worker's non-zero exit was noticed: one that ended with exit code 0
    (``os._exit(0)`` in a reader plugin) left ``opguard run`` waiting for ever."""
    monkeypatch.setattr(combine_module, "start_method", lambda: "fork")
    paths = [_write(tmp_path, r, f"f aten::mm {r + 1}\n") for r in range(8)]
    manager = create_plugin_manager()
    manager.register(EndsQuietlyInAWorker(), name="ends_quietly")
    with pytest.raises(OpGuardError, match=r"a helper process ended \(exit code 0\) without"):
        combine_module.combine_parallel(paths, jobs=2, readers=Readers(manager))


def test_gzip_traces_are_read_by_content(tmp_path: Path) -> None:
    plain = SAMPLES / "gpt_callsite_rank0.json"
    packed = tmp_path / "gpt_callsite_rank0.data"  # the name says nothing
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    one, two = TraceAccumulator(), TraceAccumulator()
    one.add_file(plain)
    two.add_file(packed)
    assert b"".join(one.result().json_parts()) == b"".join(two.result().json_parts())
    broken = tmp_path / "broken.json.gz"
    broken.write_bytes(gzip.compress(plain.read_bytes())[:100])
    try:
        TraceAccumulator().add_file(broken)
    except InputError as exc:
        assert str(exc).startswith(f"{broken}: not a readable gzip file")
    else:
        raise AssertionError("a truncated gzip file was read")


def test_a_callsite_trace_is_known_by_its_head() -> None:
    assert is_callsite_trace((SAMPLES / "gpt_callsite_rank0.json").read_bytes())
    assert not is_callsite_trace(b'{"traceEvents": []}')


@pytest.mark.parametrize("compressed", [False, True], ids=["plain", "gzip"])
def test_a_trace_after_a_byte_order_mark_combines_as_without(
    opguard: Any, tmp_path: Path, compressed: bool
) -> None:
    """Kineto and Flight Recorder files were read past a UTF-8 BOM, our own traces were
    refused ("not valid JSON"), by the C scanner and by ``check`` alike."""
    examples = Path(__file__).parent.parent / "examples" / "traces"
    for folder, bom in (("plain", b""), ("bom", b"\xef\xbb\xbf")):
        (tmp_path / folder).mkdir()
        for rank in (0, 1):
            data = bom + (examples / f"ddp_callsite_rank{rank}.json").read_bytes()
            name = f"ddp_callsite_rank{rank}.json"
            if compressed:
                data, name = gzip.compress(data, mtime=0), name + ".gz"
            (tmp_path / folder / name).write_bytes(data)
    combined = []
    for folder in ("plain", "bom"):
        run = opguard("run", "-i", tmp_path / folder / "ddp_callsite_rank*")
        assert run.exit_code == 0, run.stderr[-2000:]
        combined.append((run.run_dir / "ddp_callsite_combined.json").read_bytes())
    assert combined[0] == combined[1]
    config = run.run_dir
    check = opguard("check", "--config", config, "-i", tmp_path / "bom" / "ddp_callsite_rank*")
    assert check.exit_code == 0, check.stderr[-2000:]


class Crashing:
    """Takes ``crash`` files and fails reading them (a bug in the plugin)."""

    @hookimpl
    def opguard_read_trace(self, path: Path, data: bytes) -> Any:
        if data.startswith(b"crash"):
            raise RuntimeError("kaput")
        return None


def test_a_reader_that_raises_is_a_plugin_error_in_every_command(tmp_path: Path) -> None:
    """export and check both exit 3 (a plugin failed) naming the plugin; check said 5,
    as if the file could not be read."""
    path = tmp_path / "job_rank0.txt"
    path.write_text("crash")
    manager = create_plugin_manager()
    manager.register(Crashing(), name="crashing")
    config = Path(__file__).parent / "data" / "configs" / "gpt_callsite_v1.yaml"
    for args in (("export", path, "--format", "collapsed", "-o", tmp_path / "out"),
                 ("check", "--config", config, "-i", path)):  # fmt: skip
        result = _invoke(manager, *args)
        assert result.exit_code == 3, (args[0], result.output)
        assert 'plugin "crashing": opguard_read_trace(' in result.stderr
        assert "Traceback" not in result.stderr
    # a file that cannot be read is still an unreadable input (5)
    bad = tmp_path / "bad_rank0.json"
    bad.write_text('{"format": "opguard-callsites", "version": 1}')
    assert _invoke(manager, "check", "--config", config, "-i", bad).exit_code == 5


def test_a_file_no_reader_takes_names_the_readers_and_the_disabled_ones(tmp_path: Path) -> None:
    """A Kineto trace with the kineto reader disabled: the one line says no reader
    took it and which are disabled (it said only ``unknown format None version
    None``); an OpGuard document of another kind keeps its own message."""
    kineto = Path(__file__).parent / "data" / "kineto" / "hta_backward_thread.json"
    manager = create_plugin_manager(["kineto"])
    for args in (("export", kineto, "--format", "collapsed", "-o", tmp_path / "out"),
                 ("run", "-i", kineto, "--output-base", tmp_path / "runs")):  # fmt: skip
        result = _invoke(manager, *args)
        assert result.exit_code == (5 if args[0] == "export" else 1), result.output
        assert (
            'no "format" key: not an OpGuard document (expected format '
            "'opguard-callsites' version"
        ) in result.stderr
        assert "; and no reader plugin took it (readers: flight_recorder; disabled: kineto)" in (
            result.stderr
        )
    tree = tmp_path / "tree_rank0.json"
    tree.write_text('{"format": "opguard-divergence", "version": 4}')
    result = _invoke(manager, "export", tree, "--format", "collapsed", "-o", tmp_path / "o2")
    assert result.exit_code == 5 and "no reader plugin" not in result.stderr
