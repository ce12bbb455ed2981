"""The config of a trace, for the overhead benchmarks (``guard_overhead.py``,
``trace_overhead.py``): ``opguard run`` in-process on one rank file."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from opguard_core.cli.app import create_cli
from opguard_core.plugin.manager import create_plugin_manager


def config_of(trace: Path, directory: Path) -> Path:
    """``opguard run -i TRACE`` with its run directory under ``directory``; the path of
    the config it wrote (its one entry's). Exits on a failed run."""
    cli = create_cli(create_plugin_manager())
    result = CliRunner().invoke(cli, ["run", "-i", str(trace), "--output-base", str(directory)])
    if result.exit_code != 0:
        raise SystemExit(f"opguard run failed on {trace}: {result.output}")
    run_dir = Path(result.stdout.strip().splitlines()[-1])
    [config] = run_dir.glob("*_instrumentation.yaml")
    return config
