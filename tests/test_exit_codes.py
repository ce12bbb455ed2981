"""Every exit code a command's --help documents is the code it really ends with.

The help texts are made from each command's declared codes (opguard_core/cli/exits.py);
here every declared code of every command is held to a scenario that ends with it, and
a command or code without a scenario fails the test, so the help cannot promise a code
nobody has seen.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Callable
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from opguard_core import hookimpl
from opguard_core.cli.app import cli_for, create_cli, main
from opguard_core.errors import ExitCode
from opguard_core.formats.check import ERROR, Violation, guard_report
from opguard_core.plugin import manager as manager_module
from opguard_core.plugin.manager import create_plugin_manager

EXAMPLES = Path(__file__).parents[1] / "examples" / "traces"
DIVERGENT = Path(__file__).parent / "data" / "divergent"
FSDP = str(EXAMPLES / "fsdp_callsite_rank*.json")

#: a scenario: a function of (workspace) returning the command's arguments
Scenario = Callable[[Path], list[str]]


def _trace(tmp: Path) -> str:
    return str(EXAMPLES / "single_callsite_rank0.json")


def _config(tmp: Path) -> str:
    """A config made from the single-process example trace (once per test)."""
    out = tmp / "made"
    if not out.exists():
        argv = ["run", "-i", _trace(tmp), "--output-base", str(out)]
        assert CliRunner().invoke(cli_for(argv), argv).exit_code == 0
    (run_dir,) = out.iterdir()
    return str(run_dir / "single_callsite_instrumentation.yaml")


def _broken(tmp: Path) -> str:
    path = tmp / "broken.json"
    path.write_text("{not json")
    return str(path)


def _unwritable(tmp: Path) -> str:
    """An output whose directory exists but takes no new file (``/proc``, even for
    root): the write itself fails. An output whose directory does not exist is a usage
    error before any work."""
    return "/proc/opguard_unwritable.out"


def _relu_config(tmp: Path) -> str:
    """A config whose one entry is F.relu, which may run aten::relu."""
    path = tmp / "relu.yaml"
    path.write_text(
        "version: 3\nentries:\n  - target: torch.nn.functional:relu\n    kind: function\n"
        "    context: []\n    ops: {aten::relu: 1}\n    count: 1\n"
    )
    return str(path)


def _python(code: str) -> list[str]:
    return ["--", sys.executable, "-c", code]


def _writes_error_report(tmp: Path) -> list[str]:
    """A 'program' that leaves a guard report with an error in the report directory."""
    violation = Violation("unexpected_op", ERROR, "m:f", [], [0], "aten::mul ran", op="aten::mul")
    item = {**violation.to_dict(), "rank": 0, "count": 1, "stack": []}
    report = guard_report("c", 0, [item], "warn", 1.0, 1, 1, 1)
    target = tmp / "reports" / "guard_report_rank0.json"
    code = f"import pathlib; pathlib.Path({str(target)!r}).write_text({json.dumps(report)!r})"
    return ["--config", _config(tmp), "--report-dir", str(tmp / "reports"), *_python(code)]


def _trace_write_fails(tmp: Path) -> list[str]:
    """A 'program' that leaves what a traced process leaves when its trace could not be
    written (its marker, saying why); tests/test_crash_safe_trace.py does it for real."""
    out = tmp / "traces"
    marker = out / ".trace_callsite.4242.tracing"
    info = json.dumps({"pid": 4242, "forked_from": None, "error": "No space left on device"})
    code = f"import pathlib; pathlib.Path({str(marker)!r}).write_text({info!r})"
    return ["--output-dir", str(out), *_python(code)]


class _Interrupting:
    """A discover plugin that receives SIGTERM while the run runs."""

    @hookimpl(tryfirst=True)
    def opguard_discover(self, inputs: list[str], base_dir: Path) -> None:
        os.kill(os.getpid(), signal.SIGTERM)


class _RaisingRule:
    @hookimpl
    def opguard_check_entry(self, observed: object, expected: object, check: object) -> None:
        raise RuntimeError("rule broke")


#: (command, code) → the arguments after the command name
SCENARIOS: dict[tuple[str, ExitCode], Scenario] = {
    ("run", ExitCode.OK): lambda t: ["-i", FSDP],
    ("run", ExitCode.STAGE_FAILED): lambda t: ["-i", _broken(t)],
    ("run", ExitCode.DIVERGENCE): lambda t: [
        "-i",
        str(DIVERGENT / "divergent_callsite_rank*.json"),
        "--fail-on-divergence",
    ],
    ("check", ExitCode.OK): lambda t: ["--config", _config(t), "-i", _trace(t)],
    ("check", ExitCode.STAGE_FAILED): lambda t: ["--config", _config(t), "-i", FSDP],
    ("check", ExitCode.INPUT_UNREADABLE): lambda t: ["--config", _broken(t), "-i", _trace(t)],
    ("guard", ExitCode.OK): lambda t: [
        "--config",
        _relu_config(t),
        *_python("import torch; torch.nn.functional.relu(torch.ones(2))"),
    ],
    ("guard", ExitCode.STAGE_FAILED): _writes_error_report,
    # no process of the command imports torch: no guard ran
    ("guard", ExitCode.GUARD_FAILED): lambda t: ["--config", _config(t), *_python("pass")],
    ("guard", ExitCode.COMMAND_NOT_FOUND): lambda t: ["--config", _config(t), "--", "no_such_xyz"],
    ("guard", ExitCode.COMMAND_NOT_EXECUTABLE): lambda t: ["--config", _config(t), "--", str(t)],
    ("guard", ExitCode.INPUT_UNREADABLE): lambda t: ["--config", _broken(t), *_python("pass")],
    ("trace", ExitCode.OK): lambda t: ["--output-dir", str(t / "traces"), *_python("pass")],
    ("trace", ExitCode.STAGE_FAILED): _trace_write_fails,
    ("trace", ExitCode.COMMAND_NOT_EXECUTABLE): lambda t: ["--output-dir", str(t), "--", "/etc"],
    ("trace", ExitCode.COMMAND_NOT_FOUND): lambda t: ["--output-dir", str(t), "--", "no-such-x"],
    ("show", ExitCode.OK): lambda t: [_config(t)],
    ("show", ExitCode.STAGE_FAILED): lambda t: [_config(t), "--focus", "no_such:frame"],
    ("show", ExitCode.INPUT_UNREADABLE): lambda t: [_broken(t)],
    ("compare", ExitCode.OK): lambda t: [_config(t), _config(t)],
    ("compare", ExitCode.STAGE_FAILED): lambda t: [
        str(Path(__file__).parent / "data" / "configs" / "gpt_callsite_v1.yaml"),
        _config(t),
        "--fail-on-change",
    ],
    ("compare", ExitCode.INPUT_UNREADABLE): lambda t: [_broken(t), _broken(t)],
    ("merge", ExitCode.OK): lambda t: [_config(t), _config(t), "-o", str(t / "m.yaml")],
    ("merge", ExitCode.STAGE_FAILED): lambda t: [_config(t), _config(t), "-o", _unwritable(t)],
    ("merge", ExitCode.INPUT_UNREADABLE): lambda t: [_broken(t), _config(t), "-o", "x.yaml"],
    ("filter", ExitCode.OK): lambda t: [_config(t), "--basic", "-o", str(t / "f.yaml")],
    ("filter", ExitCode.STAGE_FAILED): lambda t: [_config(t), "-o", _unwritable(t)],
    ("filter", ExitCode.INPUT_UNREADABLE): lambda t: [_broken(t), "-o", str(t / "f.yaml")],
    ("export", ExitCode.OK): lambda t: [_trace(t), "--format", "collapsed", "-o", str(t / "e")],
    ("export", ExitCode.STAGE_FAILED): lambda t: [
        _trace(t),
        "--format",
        "pprof",
        "-o",
        _unwritable(t),
    ],
    ("export", ExitCode.INPUT_UNREADABLE): lambda t: [_broken(t), "--format", "collapsed"],
    ("report", ExitCode.OK): lambda t: [str(Path(_config(t)).parent)],
    ("report", ExitCode.INPUT_UNREADABLE): lambda t: [str(t)],
    ("plugins", ExitCode.OK): lambda t: ["--all"],
}

#: scenarios that need a plugin registered in-process
WITH_PLUGIN: dict[tuple[str, ExitCode], tuple[object, list[str] | Scenario]] = {
    ("run", ExitCode.INTERRUPTED): (_Interrupting(), lambda t: ["-i", FSDP]),
    ("check", ExitCode.PLUGIN_ERROR): (
        _RaisingRule(),
        lambda t: ["--config", _config(t), "-i", _trace(t)],
    ),
}


def _report_write_fails(tmp: Path) -> list[str]:
    """A run directory whose report.html is a directory: it cannot be replaced."""
    run_dir = Path(_config(tmp)).parent
    (run_dir / "report.html").unlink()
    (run_dir / "report.html").mkdir()
    return [str(run_dir)]


SCENARIOS[("report", ExitCode.STAGE_FAILED)] = _report_write_fails


def documented() -> dict[str, dict[ExitCode, str]]:
    """Every command's declared codes, as its --help lists them."""
    cli = create_cli(create_plugin_manager())
    return {
        name: dict(command.opguard_exit_codes)  # type: ignore[attr-defined]
        for name, command in cli.commands.items()
    }


#: scenarios that run a torch program: the slow group
SLOW = {("guard", ExitCode.OK)}


def _case_ids() -> list[Any]:
    return [
        pytest.param(name, code, marks=[pytest.mark.slow] if (name, code) in SLOW else [])
        for name, codes in documented().items()
        for code in codes
    ]


@pytest.fixture(autouse=True)
def _workspace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OPGUARD_TRACE_OUTPUT_BASE", str(tmp_path / "runs"))
    monkeypatch.delenv("OPGUARD_DISABLE_PLUGINS", raising=False)


def test_every_command_declares_its_codes_and_its_help_lists_them() -> None:
    codes = documented()
    assert {"run", "check", "guard", "trace", "show", "compare", "merge", "filter",
            "export", "report", "plugins"} <= set(codes)  # fmt: skip
    cli = create_cli(create_plugin_manager())
    for name, declared in codes.items():
        help_text = CliRunner().invoke(cli, [name, "--help"]).output
        section = help_text.split("Exit codes:", 1)[1].split("Options:", 1)[0]
        listed = {
            int(line.split()[0]) for line in section.splitlines() if line.strip()[:1].isdigit()
        }
        assert listed == {int(c) for c in declared}, name


@pytest.mark.parametrize(("command", "code"), _case_ids(), ids=lambda v: getattr(v, "name", v))
def test_a_documented_code_is_the_real_one(
    command: str, code: ExitCode, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if code == ExitCode.USAGE_ERROR:
        # trace and guard pass unknown options on to COMMAND: a bad value instead
        bad = {"trace": ["--backend", "nope", "--", "true"], "guard": ["--sample", "2"]}
        assert _exit_of([command, *bad.get(command, ["--no-such-option"])]) == code
        return
    if code == ExitCode.PLUGIN_ERROR and (command, code) not in WITH_PLUGIN:
        args = [command, *_minimal(command, tmp_path)]  # before the plugin breaks
        broken = EntryPoint("broken", "opguard_no_such_module_xyz", "opguard")
        real = manager_module.entry_points
        monkeypatch.setattr(
            manager_module,
            "entry_points",
            lambda group: [*real(group=group), broken],
        )
        assert _exit_of(args) == code
        return
    if (command, code) in WITH_PLUGIN:
        plugin, scenario = WITH_PLUGIN[(command, code)]
        manager = create_plugin_manager()
        manager.register(plugin, name="test_plugin")
        args = scenario(tmp_path) if callable(scenario) else scenario
        result = CliRunner().invoke(create_cli(manager), [command, *args])
        assert result.exit_code == code, result.output
        return
    scenario = SCENARIOS.get((command, code))
    assert scenario is not None, f"no scenario shows that {command} exits {int(code)}"
    args = [command, *scenario(tmp_path)]
    if command in ("guard", "trace"):  # real processes: through the console script
        assert _exit_of(args) == code
    else:
        result = CliRunner().invoke(cli_for(args), args)
        assert result.exit_code == code, result.output


def _minimal(command: str, tmp: Path) -> list[str]:
    """Arguments that get a command past its option checks (to where plugins load)."""
    scenario = SCENARIOS.get((command, ExitCode.OK))
    return scenario(tmp) if scenario is not None else []


def _exit_of(args: list[str]) -> int:
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    code = exit_info.value.code
    return code if isinstance(code, int) else 1


def test_a_signal_forwarded_twice_is_named_once() -> None:
    """GNU ``timeout`` sends SIGTERM, then SIGTERM again to what is left."""
    from opguard_plugins.record.trace import TraceOutcome

    outcome = TraceOutcome(1, [signal.SIGTERM, signal.SIGTERM], [], [])
    assert outcome.status_line() == (
        "received SIGTERM (2 times), forwarded to the command, which exited with 1"
    )
    assert outcome.exit_code == 143
    assert TraceOutcome(-2, [signal.SIGINT], [], []).status_line() == (
        "received SIGINT, forwarded to the command, which was killed by SIGINT"
    )


def test_a_lost_processs_flush_is_said_marked_only_where_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process lost after a flush: its flush is marked ``lost`` and the message says
    so; a flush whose marker says something else (the program's own SIGTERM handler,
    then SIGKILL: ``sigterm``) is left as it is, and the message does not claim it."""
    from opguard_plugins.record import trace as trace_module

    flushes = {}
    for reason in ("flush", "sigterm"):
        flushes[reason] = tmp_path / f"{reason}_callsite_rank0.json"
        flushes[reason].write_text(json.dumps({"meta": {"partial": {"reason": reason}}}))
    for reason, path in flushes.items():
        outcome = trace_module.TraceOutcome(-9, [], [], [{"pid": 7, "flushed": str(path)}])
        monkeypatch.setattr(trace_module, "launch", lambda *args, o=outcome: o)
        argv = ["trace", "--output-dir", str(tmp_path / "out"), "--", "true"]
        result = CliRunner().invoke(cli_for(argv), argv)
        lost = json.loads(path.read_text())["meta"]["partial"]["reason"]
        said = "(marked partial, reason lost)" in result.stderr
        assert (lost, said) == (("lost", True) if reason == "flush" else ("sigterm", False))


#: a program that runs the console script with an object whose finalizer says when
#: the interpreter tore it down
_TORN_DOWN = """
import sys
from opguard_core.cli.app import main

class Witness:
    def __del__(self):
        sys.stderr.write("torn down\\n")

witness = Witness()
main()  # as the console script calls it: the arguments in sys.argv
"""


@pytest.mark.parametrize(
    ("args", "code", "torn_down"),
    [
        (["run", "-i", FSDP], 0, False),
        (
            ["run", "-i", str(DIVERGENT / "divergent_callsite_rank*.json"), "--fail-on-divergence"],
            4,
            False,
        ),
        (["run", "-i", "nothing_matches_*.json"], 1, False),
        (["show", str(EXAMPLES / "missing.yaml")], 5, True),  # asks nothing: torn down
    ],
)
def test_run_ends_without_teardown_and_keeps_its_code_and_output(
    tmp_path: Path, args: list[str], code: int, torn_down: bool
) -> None:
    """``opguard run`` leaves its last entry's trace and tree to the exit and the console
    script then ends with ``os._exit`` (exits.end_without_teardown): no finalizer of
    the interpreter's runs, the exit code is the run's and what it printed is all
    there (the run directory on stdout, through a pipe); another command ends as
    usual."""
    import subprocess

    if args[0] == "run":
        args = [*args, "--output-base", str(tmp_path / "runs")]
    done = subprocess.run(
        [sys.executable, "-c", _TORN_DOWN, "--log-format", "json", *args],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == code, done.stderr
    assert ("torn down" in done.stderr) is torn_down, done.stderr
    if args[0] == "run" and code != 1:
        run_dir = Path(done.stdout.strip().splitlines()[-1])
        summary = json.loads((run_dir / "pipeline_summary.json").read_text())
        assert summary["exit_code"] == code
        assert (run_dir / "report.html").read_text().endswith("</html>\n")


@pytest.mark.parametrize(
    "args",
    [
        ["show", "{missing}"],
        ["compare", "{missing}", "{missing}"],
        ["merge", "{missing}", "{missing}", "-o", "{out}"],
        ["filter", "{missing}", "-o", "{out}"],
        ["export", "{missing_trace}", "--format", "collapsed", "-o", "{out}"],
        ["report", "{missing}"],
        ["check", "--config", "{missing}", "-i", FSDP],
    ],
    ids=lambda args: args[0],
)
def test_verbose_adds_the_traceback_and_keeps_the_code(tmp_path: Path, args: list[str]) -> None:
    """``-v`` shows the traceback of an error and ends with the same code as without it
    (a missing input: 5). It ended with 1, a Python traceback's code, in show, compare,
    merge, filter, report and export."""
    names = {"missing": str(tmp_path / "missing.yaml"), "out": str(tmp_path / "out")}
    names["missing_trace"] = str(tmp_path / "missing_rank0.json")
    argv = [a.format(**names) for a in args]
    quiet = CliRunner().invoke(cli_for(argv), argv)
    loud = CliRunner().invoke(cli_for(["-v", *argv]), ["-v", *argv])
    assert quiet.exit_code == loud.exit_code == 5, (quiet.output, loud.output)
    assert "Traceback" not in quiet.stderr and "Traceback" in loud.stderr
    assert "opguard: error:" in loud.stderr.splitlines()[-1]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "args",
    [
        ["check", "--config", "{config}", "-i", FSDP, "-o", "{nodir}"],
        ["merge", "{config}", "{config}", "-o", "{nodir}"],
        ["filter", "{config}", "--basic", "-o", "{nodir}"],
        ["export", str(EXAMPLES / "single_callsite_rank0.json"), "--format", "collapsed",
         "-o", "{nodir}"],
        ["merge", "{config}", "{config}", "-o", "-"],
    ],
    ids=["check", "merge", "filter", "export", "dash"],
)  # fmt: skip
def test_an_output_that_cannot_be_made_is_a_usage_error_before_any_work(
    tmp_path: Path, args: list[str]
) -> None:
    """``-o`` into a directory that does not exist (check said ``cannot write`` after
    the whole check, with exit 1, its code for errors found), and ``-o -`` (which made a
    file named ``-``): one line, exit 2, nothing written."""
    config = tmp_path / "c.yaml"
    made = CliRunner().invoke(cli_for([]), ["run", "-i", FSDP, "--output-base", str(tmp_path)])
    run_dir = Path(made.stdout.strip().splitlines()[-1])
    config.write_bytes((run_dir / "fsdp_callsite_instrumentation.yaml").read_bytes())
    names = {"config": str(config), "nodir": str(tmp_path / "nodir" / "out")}
    argv = [a.format(**names) for a in args]
    result = CliRunner().invoke(cli_for(argv), argv)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.stderr
    expected = "does not exist" if argv[-1] != "-" else "give a file name"
    assert expected in result.stderr
    assert not (tmp_path / "nodir").exists() and not (tmp_path / "-").exists()


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full")
def test_standard_output_that_cannot_be_written_is_one_line(tmp_path: Path) -> None:
    """``opguard show RUN > /dev/full``: one line, exit 1 (it was a traceback)."""
    import subprocess

    made = CliRunner().invoke(cli_for([]), ["run", "-i", FSDP, "--output-base", str(tmp_path)])
    run_dir = made.stdout.strip().splitlines()[-1]
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [sys.executable, "-m", "opguard_core.cli.app", "show", run_dir],
            stdout=full, stderr=subprocess.PIPE, text=True, timeout=60,
        )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.strip() == (
        "opguard: error: cannot write standard output: No space left on device"
    )


def test_a_run_that_fails_on_divergence_says_why(tmp_path: Path) -> None:
    """``--fail-on-divergence`` ending with 4 names the entry, its error findings and
    their log in one plain line (the summary said only ``failed … 0 failures``)."""
    argv = ["--log-format", "json", "run", "-i", str(DIVERGENT / "divergent_callsite_rank*.json"),
            "--fail-on-divergence", "--output-base", str(tmp_path)]  # fmt: skip
    result = CliRunner().invoke(cli_for(argv), argv)
    assert result.exit_code == 4, result.stderr
    plain = [line for line in result.stderr.splitlines() if not line.startswith("{")]
    assert len(plain) == 1 and plain[0].startswith("opguard: divergence [divergent_callsite]: ")
    assert plain[0].endswith("error finding(s); see divergent_callsite_divergence.log")


def test_main_called_in_a_callers_process_leaves_its_exit_alone(tmp_path: Path) -> None:
    """``main(args)`` inside another program (as tests call it) never ends that
    program: after a run that ended with 1, the program exits with its own code, torn
    down as usual. ``pytest -n 0 tests/test_plugins.py`` exited 3 with every test
    passed: a run there had asked to end the process without teardown."""
    import subprocess

    program = _TORN_DOWN.replace(
        "main()  # as the console script calls it: the arguments in sys.argv",
        "try:\n    main(sys.argv[1:])\nexcept SystemExit as ended:\n"
        "    sys.stderr.write(f'run ended {ended.code}\\n')\nsys.exit(0)",
    )
    assert program != _TORN_DOWN
    args = ["run", "-i", "nothing_matches_*.json", "--output-base", str(tmp_path / "runs")]
    done = subprocess.run(
        [sys.executable, "-c", program, *args], capture_output=True, text=True, timeout=120
    )
    assert "run ended 1" in done.stderr, done.stderr
    assert done.returncode == 0, done.stderr
    assert "torn down" in done.stderr
