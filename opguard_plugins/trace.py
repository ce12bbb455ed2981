"""Built-in plugin: the ``opguard trace`` command, which records callsite traces.

``opguard trace [--label L] [--output-dir D] -- COMMAND...`` runs COMMAND (a Python
script, ``python -m pkg``, ``torchrun ...``) with tracing on in every Python process it
starts that imports torch: a bootstrap directory holding a ``sitecustomize`` module is
put first on ``PYTHONPATH`` (see ``_trace_bootstrap/sitecustomize.py``). Each traced
process writes ``{L}_callsite_rank{R}.json`` into D (formats.md §1). The command exits
with COMMAND's exit code. torch is needed only by the traced program, not here.
"""

from __future__ import annotations

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

import click

from opguard_core import hookimpl

BOOTSTRAP_DIR = Path(__file__).resolve().parent / "_trace_bootstrap"
PACKAGE_ROOT = Path(__file__).resolve().parent.parent
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


def build_env(label: str, output_dir: Path, command: Sequence[str]) -> dict[str, str]:
    """The environment that turns tracing on in COMMAND's Python processes."""
    variables = {"OPGUARD_TRACE_LABEL": label, "OPGUARD_TRACE_DIR": str(output_dir)}
    return bootstrap_env(variables, command)


def run_bootstrapped(command: Sequence[str], env: dict[str, str]) -> int:
    """Run COMMAND (see :func:`build_argv`) with ``env``; return its exit code.

    A command killed by a signal returns 128 + the signal number, like a shell.
    """
    try:
        process = subprocess.run(build_argv(command), env=env, check=False)
    except FileNotFoundError:
        raise click.ClickException(f"command not found: {command[0]}") from None
    code = process.returncode
    if code < 0:  # killed by a signal: report it like a shell does
        code = 128 - code
    return code


def written_traces(output_dir: Path, label: str, since: float) -> list[Path]:
    """The trace files for ``label`` in ``output_dir`` modified at or after ``since``."""
    pattern = re.compile(rf"^{re.escape(label)}_callsite_rank(\d+)\.json$")
    found: list[tuple[int, Path]] = []
    for path in output_dir.glob(f"{label}_callsite_rank*.json"):
        match = pattern.match(path.name)
        if match and path.stat().st_mtime >= since:
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def run_traced(command: Sequence[str], label: str, output_dir: Path) -> tuple[int, list[Path]]:
    """Run COMMAND traced; return its exit code and the trace files it wrote."""
    output_dir = output_dir.resolve()
    output_dir.mkdir(parents=True, exist_ok=True)
    started = time.time() - 1.0  # file systems with coarse timestamps
    code = run_bootstrapped(command, build_env(label, output_dir, command))
    return code, written_traces(output_dir, label, started)


@click.command(
    "trace",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@click.option(
    "--label",
    default="trace",
    show_default=True,
    help="Names the trace files: {label}_callsite_rank{R}.json.",
)
@click.option(
    "--output-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("."),
    show_default=True,
    help="Directory for the trace files (created if missing).",
)
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def trace_command(label: str, output_dir: Path, command: tuple[str, ...]) -> None:
    """Run COMMAND with callsite tracing on, writing one trace per rank.

    COMMAND is a Python script (train.py ARGS), python -m PKG ARGS, or
    torchrun --nproc-per-node N train.py ARGS; put it after "--". Every Python
    process it starts that imports torch is traced and writes
    {label}_callsite_rank{R}.json into --output-dir at exit. Exits with COMMAND's
    exit code.
    """
    if not _SAFE_LABEL.match(label):
        raise click.BadParameter(
            "use letters, digits, '.', '_' or '-' (it becomes part of file names)",
            param_hint="--label",
        )
    code, files = run_traced(command, label, output_dir)
    if files:
        names = ", ".join(path.name for path in files)
        click.echo(
            f"opguard trace: wrote {len(files)} trace file(s) to {files[0].parent}: {names}",
            err=True,
        )
    else:
        click.echo(
            f"opguard trace: no trace written to {output_dir} "
            "(did the command import torch and run any operator?)",
            err=True,
        )
    sys.exit(code)


@hookimpl
def opguard_register_commands(cli: click.Group) -> None:
    """Add ``opguard trace``."""
    cli.add_command(trace_command)


__all__ = [
    "bootstrap_env",
    "build_argv",
    "build_env",
    "opguard_register_commands",
    "run_bootstrapped",
    "run_traced",
    "trace_command",
]

if __name__ == "__main__":  # python -m opguard_plugins.trace -- COMMAND...
    signal.signal(signal.SIGINT, signal.default_int_handler)
    trace_command()
