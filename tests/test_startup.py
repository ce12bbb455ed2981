"""Start-up: ``opguard --version`` and ``opguard run --help`` load no plugin and import
none of the heavy dependencies (their import time is measured by
benchmarks/startup.py, not here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = ("pluggy", "structlog", "msgspec", "rich", "ruamel.yaml", "opguard_core.run.runner")
PROBE = """
import json, sys
from opguard_core.cli.app import main
try:
    main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
heavy = [m for m in {heavy!r} if m in sys.modules]
plugins = sorted(m for m in sys.modules if m.startswith("opguard_plugins."))
print(json.dumps({{"code": code, "heavy": heavy, "plugins": plugins}}), file=sys.stderr)
"""


def _probe(*args: str) -> tuple[dict[str, object], str]:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE.format(heavy=HEAVY), *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).parent.parent,
    )
    return json.loads(proc.stderr.strip().splitlines()[-1]), proc.stdout


@pytest.mark.parametrize("args", [["--version"], ["run", "--help"], ["run", "-h"]])
def test_version_and_run_help_import_nothing_heavy(args: list[str]) -> None:
    seen, out = _probe(*args)
    assert seen == {"code": 0, "heavy": [], "plugins": []}
    assert ("opguard, version" in out) if args == ["--version"] else ("--input" in out)


def test_a_plugin_command_loads_the_plugins() -> None:
    seen, out = _probe("export", "--help")
    assert seen["code"] == 0 and "opguard_plugins.view.export" in seen["plugins"]  # type: ignore[operator]
    assert "--format" in out


def test_the_top_level_help_lists_the_plugin_commands() -> None:
    seen, out = _probe("--help")
    assert seen["code"] == 0
    for command in ("run", "plugins", "trace", "export", "report", "compare", "merge"):
        assert f"  {command} " in out, command
