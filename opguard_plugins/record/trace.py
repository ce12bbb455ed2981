"""Built-in plugin: the ``opguard trace`` command, which records callsite traces.

``opguard trace [--label L] [--output-dir D] -- COMMAND...`` runs COMMAND (a Python
script, ``python -m pkg``, ``torchrun ...``) with tracing on in every Python process it
starts that imports torch: a bootstrap directory holding a ``sitecustomize`` module is
put first on ``PYTHONPATH`` (see ``_trace_bootstrap/sitecustomize.py``). Each traced
process writes ``{L}_callsite_rank{R}.json`` into D (formats.md §1; default: the trace
output base). SIGINT and SIGTERM sent to ``opguard trace`` are forwarded to COMMAND. The
command exits with COMMAND's exit code (128+N after signal N). torch is needed only by
the traced program, not here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from opguard_core import hookimpl
from opguard_core.cli import exits
from opguard_core.cli.options import FiniteFloatRange
from opguard_core.errors import CommandNotRunnable, ExitCode, one_line
from opguard_core.files.output_dirs import (
    OUTPUT_BASE_ENV,
    prepare_output_dir,
    trace_output_base,
)
from opguard_core.processes import child_dies_with_parent
from opguard_plugins.record.flush import (
    DEFAULT_FLUSH_SECONDS,
    DEFAULT_FLUSH_STEPS,
    FLUSH_SECONDS_ENV,
    FLUSH_STEPS_ENV,
    LOST,
    SPLIT_ENV,
    mark_lost,
)

BOOTSTRAP_DIR = Path(__file__).resolve().parent / "_trace_bootstrap"
PACKAGE_ROOT = Path(__file__).resolve().parents[2]
_SAFE_LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def build_argv(command: Sequence[str]) -> list[str]:
    """The argv to execute for COMMAND.

    A leading ``script.py`` runs with this Python; ``torchrun`` that is not on PATH
    becomes ``python -m torch.distributed.run``; ``python``/``python3`` not on PATH
    becomes this Python.
    """
    argv = list(command)
    head = argv[0]
    if head.endswith(".py"):
        return [sys.executable, *argv]
    if head == "torchrun" and shutil.which(head) is None:
        return [sys.executable, "-m", "torch.distributed.run", *argv[1:]]
    if head in {"python", "python3"} and shutil.which(head) is None:
        return [sys.executable, *argv[1:]]
    return argv


def bootstrap_env(variables: dict[str, str], command: Sequence[str]) -> dict[str, str]:
    """The environment that runs the bootstrap in COMMAND's Python processes.

    The bootstrap directory goes first on ``PYTHONPATH``; ``variables`` (the
    ``OPGUARD_TRACE_*`` or ``OPGUARD_GUARD_*`` settings) say what it starts. Shared by
    ``opguard trace`` and ``opguard guard``.
    """
    env = dict(os.environ)
    python_path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = (
        f"{BOOTSTRAP_DIR}{os.pathsep}{python_path}" if python_path else str(BOOTSTRAP_DIR)
    )
    env.update(variables)
    env["OPGUARD_TRACE_COMMAND"] = shlex.join(command)
    env["OPGUARD_TRACE_PKGROOT"] = str(PACKAGE_ROOT)
    return env


def build_env(
    label: str,
    output_dir: Path,
    command: Sequence[str],
    backend: str = "modes",
    flush_seconds: float | None = None,
    flush_steps: int | None = None,
    split: bool = True,
) -> dict[str, str]:
    """The environment that turns tracing on in COMMAND's Python processes (the flush
    settings: ``$OPGUARD_TRACE_FLUSH_SECONDS``/``_STEPS``; None keeps what is set)."""
    variables = {
        "OPGUARD_TRACE_LABEL": label,
        "OPGUARD_TRACE_DIR": str(output_dir),
        "OPGUARD_TRACE_BACKEND": backend,
        SPLIT_ENV: "1" if split else "0",
    }
    if flush_seconds is not None:
        variables[FLUSH_SECONDS_ENV] = repr(float(flush_seconds))
    if flush_steps is not None:
        variables[FLUSH_STEPS_ENV] = str(int(flush_steps))
    return bootstrap_env(variables, command)


def written_traces(output_dir: Path, label: str, since: float) -> list[Path]:
    """The trace files for ``label`` in ``output_dir`` modified at or after ``since``:
    ``{label}_callsite_rank{R}.json``, ``{label}_setup_rank{R}.json`` (the set-up
    phase) and forked children's ``{label}.fork{PID}_callsite_rank{R}.json``, by rank
    then name."""
    pattern = re.compile(rf"^{re.escape(label)}(\.fork\d+)?_(callsite|setup)_rank(\d+)\.json$")
    found: list[tuple[int, str, Path]] = []
    for path in output_dir.glob(f"{label}*_rank*.json"):
        match = pattern.match(path.name)
        if match and path.stat().st_mtime >= since:
            found.append((int(match.group(3)), path.name, path))
    return [path for _, _, path in sorted(found)]


def lost_processes(output_dir: Path, label: str, since: float) -> list[dict[str, Any]]:
    """Traced processes of this run (markers written at or after ``since``) that ended
    without writing their trace; their markers are removed.

    A traced process leaves a marker (``opguard_plugins.record.backends.MARKER_SUFFIX``) until
    its exit handler has run; one still there after the command ended means the
    process ended by ``os._exit`` or was killed by a signal. An older marker is another
    run's (one SIGKILLed with its ``opguard trace``, or one still running): left alone.
    """
    lost: list[dict[str, Any]] = []
    for marker in sorted(output_dir.glob(f".{label}_callsite.*.tracing")):
        with contextlib.suppress(OSError):
            if marker.stat().st_mtime < since:
                continue
        try:
            info = json.loads(marker.read_text())
        except (OSError, ValueError):
            info = {}
        lost.append(info if isinstance(info, dict) else {})
        with contextlib.suppress(OSError):
            marker.unlink()
    return lost


@dataclasses.dataclass
class TraceOutcome:
    """What :func:`launch` saw: the command's status, the signals forwarded to it, the
    trace files written, and the traced processes that wrote none."""

    returncode: int
    signals: list[int]
    files: list[Path]
    lost: list[dict[str, Any]]

    @property
    def failed(self) -> list[dict[str, Any]]:
        """The traced processes that tried to write their trace and could not."""
        return [info for info in self.lost if info.get("error")]

    @property
    def exit_code(self) -> int:
        """``opguard trace``'s exit code: 128+N after signal N was sent to it (130 for
        SIGINT, 143 for SIGTERM), else the command's code, 128+N if a signal killed it;
        1 where the command succeeded but a trace could not be written."""
        if self.signals:
            return 128 + self.signals[-1]
        if self.returncode < 0:
            return 128 - self.returncode
        if self.returncode == 0 and self.failed:
            return int(ExitCode.STAGE_FAILED)
        return self.returncode

    def status_line(self) -> str | None:
        """One line on how the command ended, when that was not a plain exit."""
        own = (
            f"was killed by {signal.Signals(-self.returncode).name}"
            if self.returncode < 0
            else f"exited with {self.returncode}"
        )
        if self.signals:
            counts: dict[str, int] = {}
            for number in self.signals:  # SIGTERM twice (GNU timeout sends two): once
                name = signal.Signals(number).name
                counts[name] = counts.get(name, 0) + 1
            names = ", ".join(n if c == 1 else f"{n} ({c} times)" for n, c in counts.items())
            return f"received {names}, forwarded to the command, which {own}"
        if self.returncode < 0:
            return f"the command {own} (exit {self.exit_code})"
        return None


def _terminal_delivered(signum: int) -> bool:
    """Whether a SIGINT most likely came from the terminal (Ctrl-C), which sends it to
    the whole foreground process group, so the command has it already."""
    if signum != signal.SIGINT:
        return False
    for fd in (0, 1, 2):
        try:
            if os.isatty(fd):
                return os.tcgetpgrp(fd) == os.getpgrp()
        except OSError:
            continue
    return False


def launch(
    command: Sequence[str],
    label: str,
    output_dir: Path,
    backend: str = "modes",
    flush_seconds: float | None = None,
    flush_steps: int | None = None,
    split: bool = True,
) -> TraceOutcome:
    """Run COMMAND traced (tracer ``backend``), forwarding SIGINT and SIGTERM to it, and
    wait for it."""
    output_dir = output_dir.resolve()
    output_dir.mkdir(parents=True, exist_ok=True)
    started = time.time() - 1.0  # file systems with coarse timestamps
    env = build_env(label, output_dir, command, backend, flush_seconds, flush_steps, split)
    returncode, received = run_forwarding(command, env)
    return TraceOutcome(
        returncode=returncode,
        signals=received,
        files=written_traces(output_dir, label, started),
        lost=lost_processes(output_dir, label, started),
    )


def run_forwarding(command: Sequence[str], env: dict[str, str]) -> tuple[int, list[int]]:
    """Run COMMAND (see :func:`build_argv`) with ``env``, forwarding SIGINT and SIGTERM
    to it; return its return code and the signals forwarded.

    COMMAND gets SIGTERM if this process dies (Linux: even by SIGKILL; see
    :func:`opguard_core.processes.child_dies_with_parent`), so it never runs on
    unwatched. Raises :class:`CommandNotRunnable` (exit 127 or 126, as a shell) when
    COMMAND cannot be found or executed."""
    received: list[int] = []
    argv = build_argv(command)
    try:
        process = subprocess.Popen(argv, env=env, preexec_fn=child_dies_with_parent())
    except FileNotFoundError:
        raise CommandNotRunnable(command[0], found=False) from None
    except (PermissionError, IsADirectoryError, NotADirectoryError):
        # NotADirectoryError: a path through a file (file/x); a shell says 126 too
        raise CommandNotRunnable(command[0], found=True) from None
    except OSError as exc:  # ENOEXEC (no #! line), E2BIG, ...: found, not executable
        reason = exc.strerror or type(exc).__name__
        raise CommandNotRunnable(f"{command[0]} ({reason})", found=True) from None

    def forward(signum: int, _frame: Any) -> None:
        received.append(signum)
        if not _terminal_delivered(signum) and process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        returncode = process.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return returncode, received


def run_bootstrapped(command: Sequence[str], env: dict[str, str]) -> int:
    """Run COMMAND with ``env`` (signals forwarded); return the exit code a shell would
    give: 128+N after signal N was sent to us or killed the command."""
    returncode, received = run_forwarding(command, env)
    return TraceOutcome(returncode, received, [], []).exit_code


def run_traced(
    command: Sequence[str], label: str, output_dir: Path, backend: str = "modes"
) -> tuple[int, list[Path]]:
    """Run COMMAND traced; return its exit code and the trace files it wrote."""
    outcome = launch(command, label, output_dir, backend)
    return outcome.exit_code, outcome.files


#: the codes of starting COMMAND (``opguard trace`` and ``opguard guard``)
LAUNCH_CODES: exits.Codes = {
    ExitCode.COMMAND_NOT_EXECUTABLE: None,
    ExitCode.COMMAND_NOT_FOUND: None,
}

CODES: exits.Codes = {
    ExitCode.OK: "the command succeeded",
    ExitCode.STAGE_FAILED: "the command succeeded but a traced process could not write its trace",
    **LAUNCH_CODES,
}


@click.option(
    "--label",
    default="trace",
    show_default=True,
    help="Names the trace files: {label}_callsite_rank{R}.json.",
)
@click.option(
    "--output-dir",
    type=click.Path(path_type=Path),
    default=None,
    help="Directory for the trace files (created if missing; default: the trace "
    "output base, $OPGUARD_TRACE_OUTPUT_BASE or ./opguard_traces).",
)
@click.option(
    "--backend",
    type=click.Choice(["modes", "profiler"]),
    default="modes",
    show_default=True,
    help="modes: torch's Python modes (exact dispatch view, api names); profiler: "
    "torch's profiler (runs the program's own ops, torch.compile compiles). "
    "See docs/tracing.md.",
)
@click.option(
    "--flush-seconds",
    type=FiniteFloatRange(min=0.0, max=1e9),
    default=DEFAULT_FLUSH_SECONDS,
    show_default=True,
    envvar=FLUSH_SECONDS_ENV,
    show_envvar=True,
    help="Also write each trace, marked partial (meta.partial), every N seconds while "
    "the program runs, so a SIGKILL loses at most N seconds; 0: never.",
)
@click.option(
    "--flush-steps",
    type=click.IntRange(min=0),
    default=DEFAULT_FLUSH_STEPS,
    show_default=True,
    envvar=FLUSH_STEPS_ENV,
    show_envvar=True,
    help="Also write each trace, marked partial, every N optimizer steps; 0: never.",
)
@click.option(
    "--split/--no-split",
    default=True,
    show_default=True,
    envvar=SPLIT_ENV,
    show_envvar=True,
    help="Once the first optimizer step has ended, write what ran up to its end "
    "(construction, initialisation, the first step) to {label}_setup_rank{R}.json and "
    'the loop to {label}_callsite_rank{R}.json (docs/tracing.md, "Set-up and loop"); '
    "--no-split: one file for the whole process.",
)
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def trace(
    label: str,
    output_dir: Path | None,
    backend: str,
    flush_seconds: float,
    flush_steps: int,
    split: bool,
    command: tuple[str, ...],
) -> int:
    """Run COMMAND with callsite tracing on, writing one trace per rank.

    COMMAND is a Python script (train.py ARGS), python -m PKG ARGS, or
    torchrun --nproc-per-node N train.py ARGS; put it after "--". Every Python
    process it starts that imports torch is traced and writes
    {label}_callsite_rank{R}.json into --output-dir at exit (a forked child:
    {label}.fork{PID}_callsite_rank{R}.json), also when it ends by SIGTERM or an
    exception (then marked partial), and every --flush-seconds while it runs.
    SIGINT and SIGTERM are forwarded to COMMAND; if opguard trace itself is killed,
    COMMAND gets SIGTERM (Linux).
    """
    if not _SAFE_LABEL.match(label):
        raise click.BadParameter(
            "use letters, digits, '.', '_' or '-' (it becomes part of file names)",
            param_hint="--label",
        )
    what = "--output-dir"
    if output_dir is None:
        output_dir = trace_output_base()
        what = f"${OUTPUT_BASE_ENV}" if os.environ.get(OUTPUT_BASE_ENV) else "output base"
    prepare_output_dir(output_dir, what)
    outcome = launch(command, label, output_dir, backend, flush_seconds, flush_steps, split)
    files = outcome.files
    status = outcome.status_line()
    if status:
        click.echo(f"opguard trace: {status}", err=True)
    for info in outcome.lost:
        pid = info.get("pid", "?")
        forked = f" (rank {info['rank']})" if isinstance(info.get("rank"), int) else ""
        forked += f" (forked from {info['forked_from']})" if info.get("forked_from") else ""
        if info.get("error"):
            click.echo(
                f"opguard trace: error: process {pid}{forked} could not write its trace: "
                f"{one_line(str(info['error']))}",
                err=True,
            )
            continue
        flushed = info.get("flushed")
        kept = "its operators are lost"
        if flushed:
            marked = False
            with contextlib.suppress(OSError, ValueError):  # msgspec.DecodeError is one
                marked = mark_lost(Path(str(flushed)))
            kept = f"its trace up to the last flush is in {one_line(Path(str(flushed)).name)}" + (
                f" (marked partial, reason {LOST})" if marked else ""
            )
        why = (
            "a multiprocessing child, a DataLoader worker or a pool's, ended by its parent"
            if info.get("helper") is True
            else "os._exit, or killed by a signal"
        )
        click.echo(
            f"opguard trace: process {pid}{forked} ended without writing its trace ({why}): {kept}",
            err=True,
        )
    if files:
        names = ", ".join(path.name for path in files)
        click.echo(
            f"opguard trace: wrote {len(files)} trace file(s) to {files[0].parent}: {names}",
            err=True,
        )
    elif not outcome.lost:
        click.echo(
            f"opguard trace: no trace written to {output_dir} "
            "(did the command import torch and run any operator?)",
            err=True,
        )
    return outcome.exit_code


trace_command = exits.command(
    "trace",
    CODES,
    extra="COMMAND's own exit code (128+N after signal N); else",
    context_settings={"allow_interspersed_args": False},
)(trace)


@hookimpl
def opguard_register_commands(cli: click.Group) -> None:
    """Add ``opguard trace``."""
    cli.add_command(trace_command)


__all__ = [
    "LAUNCH_CODES",
    "TraceOutcome",
    "bootstrap_env",
    "build_argv",
    "build_env",
    "launch",
    "opguard_register_commands",
    "run_bootstrapped",
    "run_forwarding",
    "run_traced",
    "trace_command",
]

if __name__ == "__main__":  # python -m opguard_plugins.record.trace -- COMMAND...
    signal.signal(signal.SIGINT, signal.default_int_handler)
    trace_command()
