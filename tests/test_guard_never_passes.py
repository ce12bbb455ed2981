"""Issue 30, point 2: ``opguard guard`` never passes by failing.

Every way the guard used to end with exit 0 without having checked the program is
held to a non-zero, documented exit with one line saying why: a config setting of
the wrong type (refused by ``load_config``, blamed on the config field, not on an
option nobody gave), an invalid ``--sample`` or ``--report-dir`` (refused before the
program starts), a config with no entries, a program that never started a guard, a
guard that could not start or write its report or checked no op (``GUARD_FAILED``),
a missing or non-executable command (127/126, as a shell), and a module that was
half-loaded when the guard started (wrapped when its import finishes, so its
violations are caught). docs/reliability.md, "The guard never passes by failing".
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from opguard_core.cli.app import create_cli, main
from opguard_core.errors import ExitCode, InputError
from opguard_core.formats.check import load_report, sample_every
from opguard_core.formats.config import IGNORED_SETTINGS, SETTINGS, load_config
from opguard_core.model import RunOptions
from opguard_core.plugin.manager import create_plugin_manager
from tests.builders import run_opguard as run

REPO = Path(__file__).resolve().parent.parent
TRACE = REPO / "examples" / "traces" / "single_callsite_rank0.json"

#: a hand-written config: F.relu may run aten::relu and nothing else
RELU_CONFIG = """\
version: 3
meta:
  settings:
    context_depth: 1
entries:
  - target: torch.nn.functional:relu
    kind: function
    context: []
    ops:
      aten::relu: 1
    count: 1
"""


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPGUARD_DISABLE_PLUGINS", raising=False)


def invoke(*args: str | Path) -> Any:
    cli = create_cli(create_plugin_manager())
    return CliRunner().invoke(cli, [str(a) for a in args])


def relu_config(tmp_path: Path, settings: str = "    context_depth: 1\n") -> Path:
    path = tmp_path / "relu.yaml"
    path.write_text(RELU_CONFIG.replace("    context_depth: 1\n", settings))
    return path


def marker_program(tmp_path: Path) -> tuple[list[str], Path]:
    """A command that leaves a file when it runs (to show it never started)."""
    marker = tmp_path / "ran"
    return ["--", sys.executable, "-c", f"open({str(marker)!r}, 'w').close()"], marker


def one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert "Traceback" not in stderr
    errors = [line for line in lines if "error" in line.lower()]
    assert len(errors) == 1, stderr
    return errors[0]


# ---------------------------------------------------------------------------
# config settings: validated at load, blamed on the field
# ---------------------------------------------------------------------------

BAD_SETTINGS = [
    ("    context_depth: deep\n", "meta.settings.context_depth"),
    ("    context_depth: .inf\n", "meta.settings.context_depth"),
    ("    context_depth: -1\n", "meta.settings.context_depth"),
    ("    context_depth: true\n", "meta.settings.context_depth"),
    ("    min_count: lots\n", "meta.settings.min_count"),
    ("    min_count: 99999999999999999999\n", "meta.settings.min_count"),
    ("    min_fraction: .nan\n", "meta.settings.min_fraction"),
    ("    min_fraction: 2\n", "meta.settings.min_fraction"),
    ("    chains: maybe\n", "meta.settings.chains"),
    ("    hide: '.*'\n", "meta.settings.hide"),
    ("    hide: ['(']\n", "meta.settings.hide[0]"),
    ("    focus: [ok, '[']\n", "meta.settings.focus[1]"),
    ("    filters: basic_filter\n", "meta.settings.filters"),
    ("    basic_list: [1]\n", "meta.settings.basic_list"),
    ("    jobs: many\n", "meta.settings.jobs"),
    ("    skew: -.inf\n", "meta.settings.skew"),
    ("    executor: 3\n", "meta.settings.executor"),
    ("    extra: 5\n", "meta.settings.extra"),
]


@pytest.mark.parametrize(
    ("settings", "field"), BAD_SETTINGS, ids=[b[0].strip() for b in BAD_SETTINGS]
)
def test_a_bad_setting_is_refused_at_load_naming_the_field(
    tmp_path: Path, settings: str, field: str
) -> None:
    path = relu_config(tmp_path, settings)
    with pytest.raises(InputError, match=re.escape(f"relu.yaml: {field} ")):
        load_config(path)
    command, marker = marker_program(tmp_path)
    result = invoke("guard", "--config", path, "--report-dir", tmp_path / "rep", *command)
    assert result.exit_code == ExitCode.INPUT_UNREADABLE
    line = one_error_line(result.stderr)
    assert "relu.yaml" in line and field in line
    assert not marker.exists()


@pytest.mark.parametrize("settings", ["  settings: [1]\n", "  settings: deep\n"])
def test_settings_that_are_not_a_mapping_are_refused(tmp_path: Path, settings: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(RELU_CONFIG.replace("  settings:\n    context_depth: 1\n", settings))
    with pytest.raises(InputError, match=r"c\.yaml: meta\.settings must be a mapping"):
        load_config(path)


def test_good_settings_and_unknown_keys_still_load(tmp_path: Path) -> None:
    settings = (
        "    min_count: 0\n    min_fraction: 0\n    chains: false\n    hide: ['a.*']\n"
        "    context_depth: 0\n    skew: 1.5\n    compressor: null\n    someday: [1]\n"
    )
    config = load_config(relu_config(tmp_path, settings))
    assert config["meta"]["settings"]["someday"] == [1]


def test_every_setting_check_reads_is_validated() -> None:
    """``opguard check`` rebuilds a run from any ``meta.settings`` key naming a
    RunOptions field: each must have a rule (or be ignored)."""
    fields = {f.name for f in dataclasses.fields(RunOptions)}
    assert fields - set(SETTINGS) - IGNORED_SETTINGS == set()


def test_check_blames_the_config_field_not_an_option(tmp_path: Path) -> None:
    config = relu_config(tmp_path, "    hide: ['(']\n")
    result = invoke("check", "--config", config, "-i", TRACE)
    assert result.exit_code == ExitCode.INPUT_UNREADABLE
    line = one_error_line(result.stderr)
    assert "meta.settings.hide[0]" in line and "--hide" not in line


# ---------------------------------------------------------------------------
# options: refused before the program starts
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["nan", "1e-320", "-1", "0", "2", "inf", "-inf", "lots"])
def test_an_invalid_sample_is_refused_before_the_program_starts(tmp_path: Path, value: str) -> None:
    command, marker = marker_program(tmp_path)
    result = invoke("guard", "--config", relu_config(tmp_path), "--sample", value, *command)
    assert result.exit_code == ExitCode.USAGE_ERROR
    assert "'--sample'" in result.stderr and "Traceback" not in result.stderr
    assert not marker.exists()


@pytest.mark.parametrize("value", [float("nan"), 1e-320, 0.0, -1.0, 2.0, float("inf")])
def test_sample_every_refuses_what_the_option_refuses(value: float) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(value))):
        sample_every(value)
    assert sample_every(1e-300) == round(1.0 / 1e-300)


@pytest.mark.parametrize("where", ["file/sub", "file"])
def test_an_unusable_report_dir_is_refused_before_the_program_starts(
    tmp_path: Path, where: str
) -> None:
    (tmp_path / "file").write_text("")
    command, marker = marker_program(tmp_path)
    config = relu_config(tmp_path)
    result = invoke("guard", "--config", config, "--report-dir", tmp_path / where, *command)
    assert result.exit_code == ExitCode.USAGE_ERROR, result.output
    assert "Traceback" not in result.output and "file" in result.output
    assert not marker.exists()


# ---------------------------------------------------------------------------
# nothing to check, nothing guarded, no command
# ---------------------------------------------------------------------------


def test_a_config_with_no_entries_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty.yaml"
    empty.write_text("version: 3\nentries: []\n")
    command, marker = marker_program(tmp_path)
    result = invoke("guard", "--config", empty, "--report-dir", tmp_path / "rep", *command)
    assert result.exit_code == ExitCode.GUARD_FAILED
    assert "no entries" in one_error_line(result.stderr)
    assert not marker.exists()


def _exit_of(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in args])
    code = exit_info.value.code
    return (code if isinstance(code, int) else 1), capsys.readouterr().err


def test_a_program_that_never_starts_a_guard_is_not_a_pass(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["guard", "--config", relu_config(tmp_path), "--report-dir", tmp_path / "rep"]
    code, err = _exit_of([*args, "--", sys.executable, "-c", "pass"], capsys)
    assert code == ExitCode.GUARD_FAILED
    assert "no process of COMMAND started the guard" in err


def test_no_usable_temporary_directory_is_no_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The status files go to the report directory when $TMPDIR is unusable."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no_such_tmp"))
    args = ["guard", "--config", relu_config(tmp_path), "--report-dir", tmp_path / "rep"]
    code, err = _exit_of([*args, "--", sys.executable, "-c", "pass"], capsys)
    assert code == ExitCode.GUARD_FAILED and "Traceback" not in err
    assert "no process of COMMAND started the guard" in err
    assert os.listdir(tmp_path / "rep") == []  # cleaned up


def test_status_directories_of_guards_killed_by_sigkill_are_removed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ``opguard guard`` killed by SIGKILL leaves its status directory in $TMPDIR
    (20 were found in one /tmp); the next guard removes those whose process is gone,
    and keeps a running one's and anything else."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # its pid names no process now
    left = temp / f"opguard-guard-{gone.pid}-k1ll3d"
    left.mkdir()
    (left / f"{gone.pid}.json").write_text("{}")
    running = temp / f"opguard-guard-{os.getpid()}-al1ve"
    running.mkdir()
    others = [temp / "opguard-guard-notapid", temp / f"opguard-guard-{gone.pid}-afile"]
    others[0].mkdir()
    others[1].write_text("")
    args = ["guard", "--config", relu_config(tmp_path), "--report-dir", tmp_path / "rep"]
    code, err = _exit_of([*args, "--", sys.executable, "-c", "pass"], capsys)
    assert code == ExitCode.GUARD_FAILED, err  # the command started no guard
    assert not left.exists()
    assert running.is_dir() and all(path.exists() for path in others)
    assert sorted(temp.iterdir()) == sorted([running, *others])  # its own one removed too


def test_a_missing_or_non_executable_command_exits_like_a_shell(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["guard", "--config", relu_config(tmp_path), "--report-dir", tmp_path / "rep", "--"]
    code, err = _exit_of([*args, "no_such_command_xyz"], capsys)
    assert code == ExitCode.COMMAND_NOT_FOUND == 127
    assert "no_such_command_xyz: command not found" in err and "Traceback" not in err
    script = tmp_path / "script.sh"
    script.write_text("#!/bin/sh\nexit 0\n")  # not executable
    for command in (tmp_path, script):
        code, err = _exit_of([*args, command], capsys)
        assert code == ExitCode.COMMAND_NOT_EXECUTABLE == 126, err
        assert "is not executable" in err and "Traceback" not in err
    assert code != ExitCode.STAGE_FAILED  # guard's "violations found"


# ---------------------------------------------------------------------------
# a module half-loaded when the guard starts (in process)
# ---------------------------------------------------------------------------

LATE_MODULE = """\
import torch  # the guard starts here, while this module is half-loaded
from pathlib import Path

from opguard_core.formats.config import load_config
from opguard_plugins.enforce.runtime import Guard

GUARD = Guard(load_config(Path({config!r})), report_dir={report!r}, rank=0, whole_run=True)
GUARD.start()
assert "latemod_never_imported_xyz" not in __import__("sys").modules


def f(x):
    return torch.sin(x)


class Model:
    def forward(self, x):
        return torch.cos(x)
"""

LATE_CONFIG = """\
version: 3
entries:
  - target: latemod_h30b:f
    kind: function
    context: []
    ops: {aten::add: 1}
    count: 1
  - target: latemod_h30b:Model.forward
    kind: method
    context: []
    ops: {aten::add: 1}
    count: 1
  - target: latemod_never_imported_xyz:g
    kind: function
    context: []
    ops: {aten::add: 1}
    count: 1
"""


def test_a_half_loaded_module_is_guarded_moot_by_the_stack(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A guard started while a module is half-loaded (its functions not defined yet)
    still sees them: targets are found on the stack, so no import needs watching."""
    torch = pytest.importorskip("torch")
    config = tmp_path / "late.yaml"
    config.write_text(LATE_CONFIG)
    source = LATE_MODULE.format(config=str(config), report=str(tmp_path / "rep"))
    (tmp_path / "latemod_h30b.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("latemod_h30b", None)
    module = importlib.import_module("latemod_h30b")
    guard = module.GUARD
    try:
        module.f(torch.ones(2))
        module.Model().forward(torch.ones(2))
    finally:
        path = guard.finish()
        sys.modules.pop("latemod_h30b", None)
    assert path is not None and guard.checked_ops > 0
    report = load_report(path)
    found = {(v["target"], v["op"]) for v in report["violations"] if v["severity"] == "error"}
    assert found == {("latemod_h30b:f", "aten::sin"), ("latemod_h30b:Model.forward", "aten::cos")}
    missing = [v["target"] for v in report["violations"] if v["kind"] == "missing"]
    assert missing == ["latemod_never_imported_xyz:g"]  # never ran, and never imported by us
    assert "latemod_never_imported_xyz" not in sys.modules


# ---------------------------------------------------------------------------
# whole programs (subprocesses, torch): slow
# ---------------------------------------------------------------------------


PROGRAMS = {
    # the program overwrites the config before it imports torch: the guard cannot start
    "cannot_start": (
        "import sys\nopen(sys.argv[1], 'w').write('version: [\\n')\n"
        "import torch\ntorch.nn.functional.relu(torch.ones(2))\n",
        "the guard could not start in process",
    ),
    # the report directory becomes a file before the program ends
    "cannot_write": (
        "import shutil, sys\nimport torch\ntorch.nn.functional.relu(torch.ones(2))\n"
        "shutil.rmtree(sys.argv[2])\nopen(sys.argv[2], 'w').close()\n",
        "could not write its guard report",
    ),
    # torch is imported, but no config target ever runs
    "checked_nothing": (
        "import torch\ntorch.ones(2) + 1\n",
        "the guard checked no op",
    ),
    "ok": ("import torch\ntorch.nn.functional.relu(torch.ones(2))\n", None),
}


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.parametrize("case", sorted(PROGRAMS))
def test_a_guard_that_did_not_check_the_program_fails_it(tmp_path: Path, case: str) -> None:
    pytest.importorskip("torch")
    source, reason = PROGRAMS[case]
    script = tmp_path / "program.py"
    script.write_text(source)
    config, report_dir = relu_config(tmp_path), tmp_path / "rep"
    proc = run(
        "guard", "--config", config, "--report-dir", report_dir, "--", script, config, report_dir
    )
    if reason is None:
        assert proc.returncode == ExitCode.OK, proc.stderr
        return
    assert proc.returncode == ExitCode.GUARD_FAILED, proc.stderr
    assert "Traceback" not in proc.stderr
    [line] = [line for line in proc.stderr.splitlines() if line.startswith("opguard guard: error:")]
    assert reason in line


@pytest.mark.slow
@pytest.mark.torch
def test_a_loop_config_on_a_program_that_never_steps_says_so(tmp_path: Path) -> None:
    """A config of the training loop is checked from the end of the first optimizer
    step: a program that ends before it is told that, not to look for "missing"
    warnings its report cannot have."""
    pytest.importorskip("torch")
    config = tmp_path / "loop.yaml"
    config.write_text(
        RELU_CONFIG.replace("meta:\n", "meta:\n  sources: [hand]\n  phases: {hand: loop}\n")
    )
    script = tmp_path / "program.py"
    script.write_text("import torch\ntorch.nn.functional.relu(torch.ones(2))\n")
    proc = run("guard", "--config", config, "--report-dir", tmp_path / "rep", "--", script)
    assert proc.returncode == ExitCode.GUARD_FAILED, proc.stderr
    [line] = [line for line in proc.stderr.splitlines() if line.startswith("opguard guard: error:")]
    assert "the config is of the training loop" in line and "no guarded process ended one" in line


LATE_MODELS = """\
import torch
from torch import nn

EXTRA = False


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        x = torch.relu(self.fc(x))
        if EXTRA:
            x = torch.sigmoid(x)
        return x.sum()


def step(model, optimizer, x):
    optimizer.zero_grad()
    loss = model(x)
    if EXTRA:
        loss = loss + torch.tanh(loss)
    loss.backward()
    optimizer.step()


def train(steps=2):
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        x = torch.randn(4, 8)
        if EXTRA:
            x = torch.cos(x)
        step(model, optimizer, x)
"""

LATE_MAIN = """\
import sys

import models  # the program's first import imports torch

models.EXTRA = "--extra" in sys.argv
models.train()
"""


@pytest.mark.slow
@pytest.mark.torch
def test_a_program_whose_first_import_imports_torch_is_fully_guarded(tmp_path: Path) -> None:
    """Before: the guard started while ``models`` was half-loaded, listed its three
    functions as unwrapped and caught 6 errors (torch's own functions) of 18."""
    pytest.importorskip("torch")
    folder = tmp_path / "prog"
    folder.mkdir()
    (folder / "models.py").write_text(LATE_MODELS)
    (folder / "main.py").write_text(LATE_MAIN)
    main_py = folder / "main.py"
    proc = run("trace", "--label", "p", "--output-dir", tmp_path / "t", "--", main_py)
    assert proc.returncode == 0, proc.stderr
    proc = run(
        "run", "-i", tmp_path / "t" / "p_callsite_rank0.json", "--output-base", tmp_path / "r"
    )
    assert proc.returncode == 0, proc.stderr
    [config] = (tmp_path / "r").glob("*/p_callsite_instrumentation.yaml")
    report_dir = tmp_path / "rep"
    proc = run("guard", "--config", config, "--report-dir", report_dir, "--", main_py, "--extra")
    assert proc.returncode == ExitCode.STAGE_FAILED, proc.stderr
    report = json.loads((report_dir / "guard_report_rank0.json").read_text())
    assert report["targets_seen"] > 0
    found = {(v["target"], v["op"]) for v in report["violations"] if v["severity"] == "error"}
    for target, op in [
        ("models:Net.forward", "aten::sigmoid"),
        ("models:step", "aten::tanh"),
        ("models:train", "aten::cos"),
    ]:
        assert (target, op) in found, sorted(found)
    # the clean program still passes
    proc = run("guard", "--config", config, "--report-dir", tmp_path / "rep2", "--", main_py)
    assert proc.returncode == ExitCode.OK, proc.stderr


# ---------------------------------------------------------------------------
# messages: --help, docs/guard.md and the exit table agree
# ---------------------------------------------------------------------------


def _help_codes(help_text: str) -> dict[int, str]:
    """The ``Exit codes:`` section of a --help: code → meaning (lines joined)."""
    section = help_text.split("Exit codes:", 1)[1].split("Options:", 1)[0]
    codes: dict[int, str] = {}
    last = None
    for line in section.splitlines()[1:]:
        match = re.match(r"\s*(\d+) (.*)", line)
        if match:
            last = int(match.group(1))
            codes[last] = match.group(2).strip()
        elif line.strip() and last is not None:
            codes[last] += " " + line.strip()
    return codes


def _docs_codes(command: str) -> set[int]:
    """The codes docs/guard.md's exit-code table gives ``opguard COMMAND`` a meaning for."""
    text = (REPO / "docs" / "guard.md").read_text()
    table = text.split("### Exit codes", 1)[1].split("\n\n", 2)[1].splitlines()
    header = [cell.strip() for cell in table[0].strip("|").split("|")]
    [row] = [line for line in table if line.startswith(f"| `opguard {command}`")]
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    return {int(h) for h, c in zip(header, cells, strict=True) if h.isdigit() and c}


@pytest.mark.parametrize("name", ["check", "guard"])
def test_help_and_docs_promise_the_codes_of_the_exit_table(name: str) -> None:
    from opguard_core.cli import exits

    cli = create_cli(create_plugin_manager())
    table = {int(code): text for code, text in cli.commands[name].opguard_exit_codes.items()}  # type: ignore[attr-defined]
    assert set(table) <= {int(code) for code in exits.MEANING}  # every code is the table's
    help_text = CliRunner(env={"COLUMNS": "200"}).invoke(cli, [name, "--help"]).output
    promised = _help_codes(help_text)
    assert set(promised) == set(table)
    for code, text in promised.items():
        assert " ".join(text.split()) == " ".join(table[code].split()), code
    prose = help_text.split("Exit codes:", 1)[0]
    for code in re.findall(r"\bexits? (\d+)", prose):  # "exit 1 when any error is found"
        assert int(code) in table, code
    assert _docs_codes(name) == set(table)


def test_a_rank_killed_after_its_collective_timeout_is_said_to_have_left_that_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watchdog writes the report at once (the hung job may be killed): a rank then
    killed is said to have left it as of its collective timeout, not "its first
    collective departure" (which is the warn-mode write, test_sequence_guard)."""
    pytest.importorskip("torch")
    from opguard_plugins.enforce.runtime import Guard
    from opguard_plugins.enforce.status import STATUS_ENV, problems, read_statuses

    status = tmp_path / "status"
    status.mkdir()
    monkeypatch.setenv(STATUS_ENV, str(status))
    config = tmp_path / "relu.yaml"
    config.write_text(RELU_CONFIG)
    guard = Guard(load_config(config), report_dir=tmp_path, rank=0)
    # what the watchdog's thread calls when a collective waited past --collective-timeout
    guard._waited_too_long("c10d::allreduce_", "job:step", "waited 1.0 s in c10d::allreduce_", [])
    (line,) = problems(read_statuses(status))  # the process "ended" here, unfinished
    assert line == (
        f"process {os.getpid()} ended before its guard finished (killed?): its report as of "
        f"its collective timeout is {tmp_path / 'guard_report_rank0.json'}"
    )
    report = load_report(tmp_path / "guard_report_rank0.json")
    assert [v["kind"] for v in report["violations"]] == ["collective_timeout"]


def test_a_multiprocessing_child_ended_by_its_parent_fails_only_a_failed_command() -> None:
    """A process that multiprocessing started by spawn or forkserver (``"helper"``, a
    DataLoader worker) is ended by its parent as the parent exits, before it can write
    a report: no failure where COMMAND succeeded; where COMMAND failed it is said, as
    any process without a report (a rank started by ``mp.spawn`` that died)."""
    from opguard_plugins.enforce.status import problems

    finished = {"pid": 1, "state": "finished", "report": "r.json", "checked": 5}
    worker = {"pid": 2, "state": "started", "helper": True}
    assert problems([finished, worker], command_ok=True) == []
    assert problems([finished, worker], command_ok=False) == [
        "process 2 ended without writing its guard report (killed?)"
    ]
    rank = {"pid": 3, "state": "started"}  # not a multiprocessing child: always said
    assert problems([finished, rank], command_ok=True) == [
        "process 3 ended without writing its guard report (killed?)"
    ]


SPAWNED_WORKERS = """
import sys
import torch
from torch.utils.data import DataLoader, Dataset


class Numbers(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.full((2,), float(i))


if __name__ == "__main__":
    # a script's loader and its iterator: module globals, alive until the interpreter
    # exits, when multiprocessing terminates the workers
    loader = DataLoader(Numbers(), batch_size=8, num_workers=2, multiprocessing_context=sys.argv[1])
    batches = iter(loader)
    for _ in range(3):
        torch.nn.functional.relu(next(batches))
"""


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_dataloader_workers_ended_at_exit_do_not_fail_the_guard_or_alarm_the_tracer(
    tmp_path: Path, method: str
) -> None:
    """DataLoader workers started by spawn (the default on macOS and Windows) or
    forkserver (Python 3.14's on Linux) start the guard and the tracer as every Python
    process of COMMAND does, and are terminated by their parent as it exits: the
    guard failed the unchanged, successful program (exit 6, "process N ended without
    writing its guard report (killed?)" per worker) and the tracer said each worker's
    operators were lost, as of a crash. Now the guard passes it and the tracer says
    what the process was."""
    pytest.importorskip("torch")
    script = tmp_path / "workers.py"
    script.write_text(SPAWNED_WORKERS)
    config, report_dir = relu_config(tmp_path), tmp_path / "rep"
    proc = run("guard", "--config", config, "--report-dir", report_dir, "--", script, method)
    assert proc.returncode == ExitCode.OK, proc.stderr[-3000:]
    assert "ended without writing its guard report" not in proc.stderr
    proc = run("trace", "--label", "w", "--output-dir", tmp_path / "t", "--", script, method)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lost = [line for line in proc.stderr.splitlines() if "ended without writing its trace" in line]
    assert lost and all("a multiprocessing child" in line for line in lost), proc.stderr[-3000:]
