"""The pipeline needs neither torch (the ``trace`` extra) nor dask (the ``dask`` extra)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import SAMPLES

BLOCK_AND_RUN = """
import sys
sys.modules["torch"] = None      # any 'import torch' now raises ImportError
sys.modules["dask"] = None
sys.modules["distributed"] = None
from opguard_core.cli.app import main
main(sys.argv[1:])
"""


def test_run_works_with_torch_and_dask_unimportable(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-c", BLOCK_AND_RUN, "--log-format", "json", "run",
         "--output-base", str(out), "--base-dir", str(SAMPLES),
         "--input", "gpt_callsite_rank*.json", "fsdp_callsite_rank*.json", "--basic"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (run_dir,) = out.iterdir()
    assert (run_dir / "final_combined_filtered_instrumentation.yaml").exists()
    listing = subprocess.run(
        [sys.executable, "-c", BLOCK_AND_RUN, "plugins", "--all"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert listing.returncode == 0, listing.stderr
    assert "trace" in listing.stdout and "dask_executor" in listing.stdout
