"""Issue 10, part B: hostile inputs and conditions, one table row per class.

Unusable output locations (3), no silent overwrite (6), inputs taken literally (7),
ranks stated wrongly (8), options checked (9), the tracer's process handling (12),
runs left after SIGKILL (13) and hygiene (14). Each row failed before its fix:
a traceback, a silent overwrite or fallback, a blocked read, a lost trace.
docs/reliability.md ("Round two: paths, inputs, options, processes") lists them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from opguard_core import hookimpl
from opguard_core.cli.app import cli_for
from opguard_core.model import Discovery, InputEntry, RunOptions
from opguard_core.plugin.manager import create_plugin_manager
from opguard_core.run.runner import Runner
from opguard_core.run.stale import lock_run_directory, release_run_directory
from tests.builders import trace_doc, write
from tests.conftest import RunResult

REPO = Path(__file__).resolve().parent.parent
OPGUARD = [sys.executable, "-m", "opguard_core.cli.app"]
SITES = [([("app", "main"), ("app", "step")], "torch.add", "aten::add", 5)]


def _summary(run: RunResult) -> dict[str, Any]:
    return dict(json.loads(run.read("pipeline_summary.json")))


def _logged_warnings(text: str) -> list[str]:
    """The messages of the warnings logged on stderr (JSON log lines)."""
    events = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    return [e["event"] for e in events if e["level"] == "warning"]


def _lines(text: str) -> list[str]:
    """stderr lines that are not JSON log lines."""
    return [line for line in text.splitlines() if line.strip() and not line.startswith("{")]


def _no_traceback(text: str) -> None:
    assert "Traceback" not in text, text


# ============================================================ 3: output locations


def _existing_file(tmp: Path) -> Path:
    (tmp / "afile").write_text("x")
    return tmp / "afile"


def _under_file(tmp: Path) -> Path:
    (tmp / "afile").write_text("x")
    return tmp / "afile" / "sub"


def _symlink_loop(tmp: Path) -> Path:
    (tmp / "loop").symlink_to(tmp / "loop")
    return tmp / "loop"


def _dangling(tmp: Path) -> Path:
    (tmp / "dangling").symlink_to(tmp / "nowhere")
    return tmp / "dangling"


def _refusing(code: int) -> Callable[[Path, pytest.MonkeyPatch], Path]:
    """A directory in which mkdir fails with ``code`` (tests run as root, so permission
    bits alone would not stop them): chmod 555 and, for root, a patched os.mkdir."""

    def make(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
        protected = tmp / "protected"
        protected.mkdir()
        protected.chmod(0o555)
        real = os.mkdir

        def mkdir(path: Any, mode: int = 0o777, **kwargs: Any) -> None:
            if str(path).startswith(str(protected) + os.sep):
                raise OSError(code, os.strerror(code), str(path))
            real(path, mode, **kwargs)

        monkeypatch.setattr(os, "mkdir", mkdir)
        return protected / "sub"

    return make


LOCATIONS: list[Any] = [
    pytest.param(_existing_file, "an existing file, not a directory", id="existing_file"),
    pytest.param(_under_file, "is a file, so nothing can be created under it", id="under_file"),
    pytest.param(_symlink_loop, "symlink loop", id="symlink_loop"),
    pytest.param(_dangling, "dangling symlink", id="dangling_symlink"),
    pytest.param(_refusing(errno.EROFS), "read-only file system", id="read_only_fs"),
    pytest.param(_refusing(errno.EACCES), "permission denied", id="not_writable"),
]


def _make_location(make: Any, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    try:
        return Path(make(tmp, monkeypatch))
    except TypeError:
        return Path(make(tmp))


@pytest.mark.parametrize("how", ["--output-base", "$OPGUARD_TRACE_OUTPUT_BASE", "trace"])
@pytest.mark.parametrize(("make", "problem"), LOCATIONS)
def test_unusable_output_location_is_one_line_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make: Any, problem: str, how: str
) -> None:
    sample = write(tmp_path / "t_rank0.json", trace_doc(SITES))
    location = _make_location(make, tmp_path, monkeypatch)
    monkeypatch.delenv("OPGUARD_TRACE_OUTPUT_BASE", raising=False)
    if how == "--output-base":
        argv = ["run", "-i", str(sample), "--output-base", str(location)]
    elif how == "trace":
        argv = ["trace", "--output-dir", str(location), "--", "true"]
    else:
        monkeypatch.setenv("OPGUARD_TRACE_OUTPUT_BASE", str(location))
        argv = ["run", "-i", str(sample)]
    argv = ["--log-format", "json", *argv]
    result = CliRunner().invoke(cli_for(argv), argv)
    assert result.exit_code == 2, result.stderr
    _no_traceback(result.stderr)
    [line] = _lines(result.stderr)
    assert str(location) in line and problem in line, line
    assert {"trace": "--output-dir"}.get(how, how) in line


# ============================================================ 6: no silent overwrite


def test_entry_named_like_a_run_artifact_is_renamed(
    opguard: Callable[..., RunResult], tmp_path: Path
) -> None:
    """An input ``final_combined_filtered.json`` once wrote its config to the very file
    the filter then replaced."""
    clash = write(tmp_path / "final_combined_filtered.json", trace_doc(SITES))
    other = write(tmp_path / "other.json", trace_doc(SITES))
    run = opguard("run", "-i", clash, "-i", other, "--basic", expect=0)
    names = [e["name"] for e in _summary(run)["entries"]]
    assert names[0] != "final_combined_filtered" and names[0].startswith("final_combined_filtered")
    assert (run.run_dir / f"{names[0]}_instrumentation.yaml").is_file()  # type: ignore[operator]
    filtered = run.read("final_combined_filtered_instrumentation.yaml")
    assert "+" in filtered.split("source:", 1)[1].splitlines()[0]  # the merged config


@dataclasses.dataclass
class _Twice:
    """A discover plugin that returns two entries of the same name."""

    files: tuple[Path, ...]

    @hookimpl(tryfirst=True)
    def opguard_discover(self, inputs: list[str], base_dir: Path) -> Discovery:
        return Discovery([InputEntry("x", self.files, 1), InputEntry("x", self.files, 2)])


def test_plugin_returning_duplicate_entry_names_is_refused(tmp_path: Path) -> None:
    sample = write(tmp_path / "t.json", trace_doc(SITES))
    manager = create_plugin_manager()
    manager.register(_Twice((sample,)), name="twice")
    runner = Runner(manager, ["t.json"], RunOptions(base_dir=tmp_path), output_base=tmp_path / "o")
    assert int(runner.run()) == 1
    [discover] = [r for r in runner.recorder.records if r.stage == "discover"]
    assert discover.status == "failed"
    assert "'twice'" in (discover.error or "") and "duplicate entry name 'x'" in (
        discover.error or ""
    )
    assert runner.run_dir is not None and not list(runner.run_dir.glob("x_*"))


def test_one_file_by_two_spellings_is_one_input(
    opguard: Callable[..., RunResult], tmp_path: Path
) -> None:
    write(tmp_path / "a.json", trace_doc(SITES))
    (tmp_path / "sub").mkdir()
    (tmp_path / "link.json").symlink_to(tmp_path / "a.json")
    run = opguard(
        "run", "--base-dir", tmp_path, "-i", "a.json", "sub/../a.json", "link.json", expect=0
    )
    summary = _summary(run)
    assert [e["name"] for e in summary["entries"]] == ["a"]
    assert [w["file"] for w in summary["warnings"]] == [
        str(Path(tmp_path, "sub/../a.json")),
        str(tmp_path / "link.json"),
    ]


# ============================================================ 7: inputs taken literally


def test_file_names_with_glob_characters_are_read_literally(
    opguard: Callable[..., RunResult], tmp_path: Path
) -> None:
    (tmp_path / "run[1]").mkdir()
    write(tmp_path / "run[1]" / "X_rank0.json", trace_doc(SITES))
    write(tmp_path / "[a].json", trace_doc(SITES, rank=0))
    write(tmp_path / "a.json", trace_doc([([("b", "c")], None, "aten::mul", 1)]))  # [a] glob
    run = opguard(
        "run", "--base-dir", tmp_path, "-i", "run[1]/X_rank0.json", "-i", "[a].json", expect=0
    )
    entries = _summary(run)["entries"]
    assert [(e["name"], [Path(f).name for f in e["files"]]) for e in entries] == [
        ("X", ["X_rank0.json"]),
        ("_a_", ["[a].json"]),
    ]


@pytest.mark.parametrize(
    ("make", "spec", "problem"),
    [
        pytest.param(
            lambda d: (d / "X_rank1.json").mkdir(),
            "X_rank*.json",
            "X_rank1.json: is a directory, not a trace file",
            id="directory_matched_by_rank_glob",
        ),
        pytest.param(
            lambda d: os.mkfifo(d / "fifo.json"),
            "fifo.json",
            "fifo.json: is a FIFO (named pipe), not a trace file",
            id="fifo",
        ),
        pytest.param(
            lambda d: os.mkfifo(d / "X_rank2.json"),
            "X_rank*.json",
            "X_rank2.json: is a FIFO (named pipe), not a trace file",
            id="fifo_matched_by_rank_glob",
        ),
        pytest.param(lambda d: None, "/dev/null", "/dev/null: is a device", id="device"),
    ],
)
def test_non_regular_inputs_are_refused_never_read(
    tmp_path: Path, make: Callable[[Path], Any], spec: str, problem: str
) -> None:
    """A subprocess with a timeout: before the fix a FIFO blocked the run forever."""
    write(tmp_path / "X_rank0.json", trace_doc(SITES))
    make(tmp_path)
    env = {**os.environ, "OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path / "out")}
    proc = subprocess.run(
        [*OPGUARD, "--log-format", "json", "run", "--base-dir", str(tmp_path), "-i", spec,
         "-i", "X_rank0.json"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    _no_traceback(proc.stderr)
    [line] = [x for x in _lines(proc.stderr) if "failed" in x]
    assert problem in line, line


# ============================================================ 8: ranks stated wrongly


def test_one_jobs_rank_files_split_by_directory_are_said_to_be_compared_apart(
    opguard: Callable[..., RunResult], tmp_path: Path
) -> None:
    """A multi-node job kept one directory per node (``node0/X_rank0..1``,
    ``node1/X_rank2..3``): each directory is an entry, so a desync between the nodes
    went unseen with no word but "no trace of rank(s) 2, 3 (lost with its process, or
    not given)". Two runs of a job side by side (the same ranks twice) are not such."""
    for node, ranks in (("node0", (0, 1)), ("node1", (2, 3))):
        (tmp_path / node).mkdir()
        for rank in ranks:
            write(tmp_path / node / f"X_rank{rank}.json", trace_doc(SITES, rank=rank, world_size=4))
    run = opguard("run", "--base-dir", tmp_path, "-i", "node*/X_rank*.json", expect=0)
    [said] = [w for w in _summary(run)["warnings"] if "rank files of one name" in w["message"]]
    assert said["message"] == (
        f"X: rank files of one name in 2 directories, numbered apart ({tmp_path / 'node0'}: "
        f"0, 1; {tmp_path / 'node1'}: 2, 3): each directory is an entry of its own, so their "
        "ranks are not compared with each other; if they are one job, give its rank files "
        "from one directory (links to them will do)"
    )
    for run_name in ("run1", "run2"):
        (tmp_path / run_name).mkdir()
        for rank in (0, 1):
            write(tmp_path / run_name / f"Y_rank{rank}.json", trace_doc(SITES, rank=rank))
    run = opguard("run", "--base-dir", tmp_path, "-i", "run*/Y_rank*.json", expect=0)
    assert not [w for w in _summary(run)["warnings"] if "rank files of one name" in w["message"]]


def test_two_files_claiming_one_rank_fail_the_entry(
    opguard: Callable[..., RunResult], tmp_path: Path
) -> None:
    """Both say meta.rank 0: their counts were silently added (ranks [0], count 10)."""
    write(tmp_path / "X_rank0.json", trace_doc(SITES, rank=0))
    write(tmp_path / "X_rank1.json", trace_doc(SITES, rank=0))
    write(tmp_path / "ok.json", trace_doc(SITES))
    run = opguard("run", "--base-dir", tmp_path, "-i", "X_rank*.json", "ok.json", expect=1)
    [failed] = [s for s in _summary(run)["stages"] if s["status"] == "failed"]
    assert (failed["stage"], failed["entry"]) == ("combine", "X")
    assert "X_rank1.json: claims rank 0, as" in failed["error"]
    assert "X_rank0.json" in failed["error"].split("as", 1)[1]
    assert (run.run_dir / "ok_instrumentation.yaml").is_file()  # type: ignore[operator]


@pytest.mark.parametrize(
    ("name", "doc", "expected"),
    [
        pytest.param(
            "Y_rank3.json",
            trace_doc(SITES, rank=2),
            "the file name says rank 3 but meta says 2",
            id="name_rank_disagrees_with_meta",
        ),
        pytest.param(
            "W_rank3.pt.trace.json",
            trace_doc(SITES, rank=2),
            "the file name says rank 3 but meta says 2",
            id="name_rank_before_a_trace_suffix_disagrees",
        ),
        pytest.param(
            "Z.json",
            {**trace_doc([]), "frames": [], "callsites": []},
            "the trace has no callsites",
            id="no_callsites",
        ),
    ],
)
def test_rank_warnings_name_the_file(
    opguard: Callable[..., RunResult], tmp_path: Path, name: str, doc: Any, expected: str
) -> None:
    write(tmp_path / name, doc)
    run = opguard("run", "--base-dir", tmp_path, "-i", name)
    [warning] = _summary(run)["warnings"]
    assert warning["stage"] == "combine" and expected in warning["message"]
    assert name in warning["message"]
    assert any(expected in line for line in _logged_warnings(run.stderr))


@pytest.mark.parametrize(
    ("meta", "problem"),
    [
        ({"rank": "1"}, 'meta.rank must be a non-negative integer, got "1"'),
        ({"rank": -1}, "meta.rank must be a non-negative integer, got -1"),
        ({"rank": True}, "meta.rank must be a non-negative integer, got true"),
        ({"rank": 1.5}, "meta.rank must be a non-negative integer, got 1.5"),
        ({"rank": None}, "meta.rank must be a non-negative integer, got null"),
        ({"ranks": []}, "meta.ranks must be a non-empty list of non-negative integers, got []"),
        ({"ranks": "0,1"}, "meta.ranks must be a non-empty list"),
        ({"ranks": [0, True]}, "meta.ranks must be a non-empty list"),
        ({"ranks": [0, -3]}, "meta.ranks must be a non-empty list"),
    ],
    ids=lambda v: json.dumps(v) if isinstance(v, dict) else None,
)
def test_invalid_meta_rank_values_are_errors(
    opguard: Callable[..., RunResult], tmp_path: Path, meta: dict[str, Any], problem: str
) -> None:
    doc = trace_doc(SITES)
    doc["meta"] = {"world_size": 1, **meta}
    write(tmp_path / "bad_rank1.json", doc)
    run = opguard("run", "--base-dir", tmp_path, "-i", "bad_rank1.json", expect=1)
    [failed] = [s for s in _summary(run)["stages"] if s["status"] == "failed"]
    assert failed["error"].endswith(problem) or problem in failed["error"], failed["error"]
    assert "bad_rank1.json" in failed["error"]


# ============================================================ 9: options checked


@pytest.mark.parametrize(
    ("options", "message"),
    [
        pytest.param(["--executor", "nosuch"], "'nosuch': no such executor", id="executor"),
        pytest.param(["--min-fraction", "nan"], "nan is not a finite number", id="nan_fraction"),
        pytest.param(["--skew", "nan"], "nan is not a finite number", id="nan_skew"),
        pytest.param(["--skew", "inf"], "inf is not a finite number", id="inf_skew"),
        pytest.param(["--hide", "a{99999999999}"], "'a{99999999999}'", id="hide_overflow"),
    ],
)
def test_bad_option_values_are_usage_errors(
    opguard: Callable[..., RunResult], tmp_path: Path, options: list[str], message: str
) -> None:
    sample = write(tmp_path / "t.json", trace_doc(SITES))
    run = opguard("run", "-i", sample, *options, expect=2)
    assert run.run_dir is None
    _no_traceback(run.stderr)
    assert message in run.stderr and options[-2] in run.stderr


@pytest.mark.parametrize(
    "command",
    [
        ["check", "--config", "c.yaml", "-i", "t.json", "--tolerance", "nan"],
        ["guard", "--config", "c.yaml", "--collective-timeout", "nan", "--", "true"],
        ["trace", "--flush-seconds", "nan", "--", "true"],
    ],
    ids=["check-tolerance", "guard-collective-timeout", "trace-flush-seconds"],
)
def test_nan_is_refused_by_every_number_option(
    opguard: Callable[..., RunResult],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    command: list[str],
) -> None:
    """``check --tolerance nan`` ran, with every drift message saying ``tolerance nan``
    (nan compares false with a range's bounds)."""
    (tmp_path / "c.yaml").write_text("version: 1\n")
    (tmp_path / "t.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    run = opguard(*command, expect=2)
    _no_traceback(run.stderr)
    assert "nan is not a finite number" in run.stderr


def test_unknown_disabled_plugin_is_a_warning(
    opguard: Callable[..., RunResult], tmp_path: Path
) -> None:
    sample = write(tmp_path / "t.json", trace_doc(SITES))
    run = opguard("--disable-plugin", "no_such_plugin", "run", "-i", sample, expect=0)
    assert "warning: --disable-plugin 'no_such_plugin': no such plugin" in run.stderr


HIDE_DOC = trace_doc(
    [
        ([("app", "main"), ("Foo", "wrap"), ("aa", "f"), ("app", "leaf")], None, "aten::add", 9),
        ([("app", "main"), ("q", "gone")], None, "aten::mul", 9),
    ]
)


@pytest.mark.parametrize(
    ("patterns", "hidden"),
    [
        # joined as (?:(?i)foo:.*)|(?:q:.*) these failed: global flags not at the start
        pytest.param(["q:.*", "(?i)foo:.*"], {"q:gone", "Foo:wrap"}, id="inline_flags"),
        # joined: redefinition of group name
        pytest.param(["(?P<m>q):.*", "(?P<m>aa):f"], {"q:gone", "aa:f"}, id="group_names"),
        # joined, \1 names the first pattern's (unmatched) group: aa:f stayed visible
        pytest.param([r"(x)y:.*", r"(a)\1:f"], {"aa:f"}, id="backreference"),
    ],
)
def test_hide_patterns_are_compiled_one_by_one(
    opguard: Callable[..., RunResult], tmp_path: Path, patterns: list[str], hidden: set[str]
) -> None:
    sample = write(tmp_path / "h.json", HIDE_DOC)
    args = [x for p in patterns for x in ("--hide", p)]
    run = opguard("run", "-i", sample, "--min-fraction", "0", "--no-chains", *args, expect=0)
    tree = run.read("h_compressed.json")
    for name in hidden:
        assert f'"{name.split(":")[1]}"' not in tree, name
    unmatched = {w["pattern"] for w in _summary(run)["warnings"]}
    assert unmatched == {p for p in patterns if p.startswith("(x)")}


def test_unmatched_hide_pattern_is_a_warning_in_log_and_summary(
    opguard: Callable[..., RunResult], tmp_path: Path
) -> None:
    sample = write(tmp_path / "h.json", HIDE_DOC)
    run = opguard("run", "-i", sample, "--hide", "nothing:here", "--hide", "q:.*", expect=0)
    [warning] = _summary(run)["warnings"]
    assert warning["pattern"] == "nothing:here" and warning["entry"] == "h"
    logged = [json.loads(x) for x in run.stderr.splitlines() if x.startswith("{")]
    assert any(x["level"] == "warning" and x.get("pattern") == "nothing:here" for x in logged)


# ============================================================ 13: left after SIGKILL


def _fake_killed_run(base: Path, name: str = "preprocessing_20200101_000000") -> Path:
    """What a SIGKILLed run leaves: a summary saying running, and a temporary file."""
    run_dir = base / name
    run_dir.mkdir(parents=True)
    (run_dir / "pipeline_summary.json").write_text(json.dumps({"status": "running"}))
    (run_dir / ".x_combined.json.abcd1234.tmp").write_text("partial")
    return run_dir


def test_stale_run_directory_is_reported_and_cleaned(
    opguard: Callable[..., RunResult], tmp_path: Path
) -> None:
    base = tmp_path / "out"
    stale = _fake_killed_run(base)
    live = _fake_killed_run(base, "preprocessing_20200101_000001")
    fd = lock_run_directory(live)  # a run still going: not stale
    try:
        sample = write(tmp_path / "t.json", trace_doc(SITES))
        run = opguard("run", "-i", sample, expect=0)
        [line] = [x for x in _logged_warnings(run.stderr) if "stale" in x]
        assert str(stale) in line and "1 temporary file" in line and "--clean-stale" in line
        assert [w.get("stale_run_dir") for w in _summary(run)["warnings"]] == [str(stale)]
        cleaned = opguard("run", "--clean-stale", expect=0)
        assert cleaned.run_dir is None
        assert f"cleaned stale run directory {str(stale)!r}" in cleaned.stderr
        assert not list(stale.glob("*.tmp")) and list(live.glob("*.tmp"))
        summary = json.loads((stale / "pipeline_summary.json").read_text())
        assert summary["status"] == "abandoned"
        again = opguard("run", "-i", sample, expect=0)
        assert "stale run directory" not in again.stderr
    finally:
        release_run_directory(fd)


@pytest.mark.parametrize("kind", ["fifo", "deep"])
def test_a_summary_no_run_wrote_does_not_stop_the_next_run(
    opguard: Callable[..., RunResult], tmp_path: Path, kind: str
) -> None:
    """Looking for stale runs, ``opguard run`` read every ``preprocessing_*`` summary
    under its output base: a FIFO there held it up for ever, a summary nested 100,000
    deep ended it with a RecursionError traceback."""
    summary = tmp_path / "out" / "preprocessing_20200101_000000" / "pipeline_summary.json"
    summary.parent.mkdir(parents=True)
    fired = threading.Event()
    if kind == "fifo":
        os.mkfifo(summary)
        fired = _unblock_later(summary)
    else:
        summary.write_text('{"status": ' + "[" * 100_000 + "]" * 100_000 + "}")
    sample = write(tmp_path / "t.json", trace_doc(SITES))
    run = opguard("run", "-i", sample, expect=0)
    assert "stale run directory" not in run.stderr
    assert not fired.is_set()  # it did not wait on the FIFO


@pytest.mark.slow
def test_a_real_sigkill_leaves_a_run_the_next_run_reports(tmp_path: Path) -> None:
    from tests.test_atomic import _write_big_rank_files

    _write_big_rank_files(tmp_path, 200_000)
    env = {**os.environ, "OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path / "out")}
    proc = subprocess.Popen(
        [*OPGUARD, "--log-format", "json", "run", "-i", "big_rank*.json", "--jobs", "1"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    summaries: list[Path] = []
    while time.monotonic() < deadline and not summaries:
        summaries = list((tmp_path / "out").glob("*/pipeline_summary.json"))
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    killed = summaries[0].parent
    assert json.loads(summaries[0].read_text())["status"] == "running"
    sample = write(tmp_path / "t.json", trace_doc(SITES))
    after = subprocess.run(
        [*OPGUARD, "--log-format", "json", "run", "-i", str(sample)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert after.returncode == 0, after.stderr
    [line] = [x for x in _logged_warnings(after.stderr) if "stale" in x]
    assert str(killed) in line


# ============================================================ 12: the tracer's processes

FORKS = """
import os, sys, torch
torch.ones(2) + 1
pid = os.fork()
if pid == 0:
    torch.ones(3) * 2
    sys.exit(0)
os.waitpid(pid, 0)
torch.ones(2) - 1
"""

OS_EXIT = """
import os, torch
torch.ones(2) + 1
os._exit(4)
"""

KILLS_ITSELF = """
import os, signal, torch
torch.ones(2) + 1
os.kill(os.getpid(), signal.SIGKILL)
"""

WAITS = """
import signal, sys, time, torch
from pathlib import Path
torch.ones(2) + 1
def on_term(signum, frame):
    Path(sys.argv[1]).write_text("SIGTERM")
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
try:
    Path(sys.argv[2]).write_text("ready")
    time.sleep(120)
except KeyboardInterrupt:
    Path(sys.argv[1]).write_text("SIGINT")
    raise
"""


def _trace(tmp: Path, program: str, *args: str, rank: str | None = None) -> subprocess.Popen[str]:
    pytest.importorskip("torch")
    script = tmp / "prog.py"
    script.write_text(program)
    env = {**os.environ, "OPGUARD_TRACE_OUTPUT_BASE": str(tmp / "base")}
    env.pop("OPGUARD_DISABLE_PLUGINS", None)
    env.pop("RANK", None)
    if rank is not None:  # as torchrun sets it
        env["RANK"] = rank
    return subprocess.Popen(
        [*OPGUARD, "trace", "--label", "p", "--", str(script), *args],
        env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip


@pytest.mark.slow
def test_a_forked_process_writes_its_own_trace(tmp_path: Path) -> None:
    proc = _trace(tmp_path, FORKS)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    files = sorted(p.name for p in (tmp_path / "base").glob("*.json"))
    assert len(files) == 2 and "p_callsite_rank0.json" in files, files
    [child] = [f for f in files if f != "p_callsite_rank0.json"]
    assert child.startswith("p.fork") and child.endswith("_callsite_rank0.json")
    ops = {
        name: {c["op"] for c in json.loads((tmp_path / "base" / name).read_text())["callsites"]}
        for name in files
    }
    assert "aten::mul" in ops[child] and "aten::add" not in ops[child]
    assert "aten::sub" in ops["p_callsite_rank0.json"]
    assert "aten::mul" not in ops["p_callsite_rank0.json"]
    assert "wrote 2 trace file(s)" in err
    assert not list((tmp_path / "base").glob(".*"))  # no marker left


@pytest.mark.slow
@pytest.mark.parametrize(
    ("program", "code", "message"),
    [
        pytest.param(OS_EXIT, 4, "ended without writing its trace (os._exit", id="os_exit"),
        pytest.param(KILLS_ITSELF, 137, "the command was killed by SIGKILL", id="killed"),
    ],
)
def test_an_abrupt_end_gets_an_accurate_message(
    tmp_path: Path, program: str, code: int, message: str
) -> None:
    proc = _trace(tmp_path, program)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == code, err
    assert message in err and "did the command import torch" not in err
    assert not list((tmp_path / "base").glob(".*"))


@pytest.mark.slow
def test_a_lost_trace_names_the_rank_where_the_launcher_said_it(tmp_path: Path) -> None:
    proc = _trace(tmp_path, OS_EXIT, rank="3")
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 4, err
    assert re.search(r"process \d+ \(rank 3\) ended without writing its trace", err), err


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sig", "code"),
    [
        pytest.param(signal.SIGTERM, 143, id="SIGTERM"),
        pytest.param(signal.SIGINT, 130, id="SIGINT"),
    ],
)
def test_signals_are_forwarded_to_the_traced_command(
    tmp_path: Path, sig: signal.Signals, code: int
) -> None:
    got, ready = tmp_path / "got", tmp_path / "ready"
    proc = _trace(tmp_path, WAITS, str(got), str(ready))
    deadline = time.monotonic() + 120
    while not ready.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert ready.exists(), proc.communicate()[1]
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert got.read_text() == sig.name  # the command got it
    assert f"received {sig.name}, forwarded to the command" in err
    assert (tmp_path / "base" / "p_callsite_rank0.json").is_file()  # and wrote its trace


# ============================================================ 14: hygiene


def test_no_wheels_at_the_repository_root() -> None:
    assert not list(REPO.glob("*.whl"))


@pytest.mark.slow
def test_trace_without_output_dir_writes_under_the_output_base(tmp_path: Path) -> None:
    proc = _trace(tmp_path, "import torch\ntorch.ones(1) + 1\n")
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    assert (tmp_path / "base" / "p_callsite_rank0.json").is_file()
    assert not list(tmp_path.glob("*.json"))


@pytest.mark.parametrize(
    # (examples/opguard_traces/ was already covered by the root .gitignore)
    "written",
    ["examples/trace_callsite_rank0.json", "examples/.trace_callsite.123.tracing"],
)
def test_files_the_tools_write_in_examples_are_ignored(written: str) -> None:
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    proc = subprocess.run(["git", "check-ignore", "-q", written], cwd=REPO, check=False)
    assert proc.returncode == 0, f"{written} is not covered by a .gitignore"


def test_bundled_traces_are_not_ignored() -> None:
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    proc = subprocess.run(
        ["git", "check-ignore", "-q", "examples/traces/ddp_callsite_rank0.json"], cwd=REPO
    )
    assert proc.returncode == 1


def test_counts_adding_up_past_2_63_fail_the_entry_naming_the_file(
    opguard: Callable[..., RunResult], tmp_path: Path
) -> None:
    """Each file's counts are in range, their sum is not: combine refuses the file that
    takes it past 2**63-1 (no JSON or YAML reader would hold the total exactly)."""
    sites = [([("app", "main")], None, "aten::mm", 2**62)]
    for rank in (0, 1):
        write(tmp_path / f"huge_rank{rank}.json", trace_doc(sites, rank=rank))
    write(tmp_path / "fine.json", trace_doc(SITES))
    run = opguard("run", "-i", tmp_path / "huge_rank*.json", "-i", tmp_path / "fine.json")
    assert run.exit_code == 1
    [failed] = [s for s in _summary(run)["stages"] if s["status"] == "failed"]
    assert failed["stage"] == "combine" and "huge_rank1.json" in failed["error"]
    assert "more than 2**63-1 ops" in failed["error"]
    assert run.read("fine_instrumentation.yaml")


def _unblock_later(fifo: Path, after: float = 20.0) -> threading.Event:
    """Set once ``after`` seconds have passed, then open ``fifo`` for writing and close
    it, so a reader blocked on it gets end of file: a test asserts it is not set."""
    fired = threading.Event()

    def unblock() -> None:
        time.sleep(after)
        fired.set()
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))

    threading.Thread(target=unblock, daemon=True).start()
    return fired
