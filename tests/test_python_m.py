"""``python -m opguard`` is the ``opguard`` console script."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(sys.executable).parent / "opguard"


def _run(command: list[str], cwd: Path) -> tuple[int, str, str]:
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    return done.returncode, done.stdout, done.stderr


@pytest.mark.parametrize(
    "args",
    [["--version"], ["plugins"], ["run", "--min-count", "0"]],
    ids=["version", "plugins", "usage-error"],
)
def test_python_m_opguard_is_the_console_script(tmp_path: Path, args: list[str]) -> None:
    if not SCRIPT.exists():
        pytest.skip("no opguard console script beside this interpreter")
    module = _run([sys.executable, "-m", "opguard", *args], tmp_path)
    script = _run([str(SCRIPT), *args], tmp_path)
    assert module == script
    assert module[1] or module[2]  # it said something
    if args[0] == "run":
        assert module[0] == 2 and "--min-count" in module[2]
