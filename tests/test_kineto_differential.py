"""Differential: one CPU program traced by ``opguard trace --backend profiler`` and by
torch.profiler (``with_stack=True``, then imported by the Kineto reader) gives the same
ops per function (docs/kineto.md, "Against OpGuard's tracer").

The program is ``tests/data/differential/mlp.py`` (a 2-layer MLP, 3 SGD steps). A
callsite's function is the innermost frame of the program's own module; the
``profiler`` backend records no ``api``, so backward ops are compared with the
forward ones of their function. Lines are not compared: Kineto names a frame by the
line its function starts on, the tracer by the line of the call.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import pytest

pytest.importorskip("torch")

from opguard_core.formats.trace import decode_trace, load_trace
from opguard_plugins.readers.kineto import read_kineto

pytestmark = [pytest.mark.torch, pytest.mark.slow]  # two profiled torch processes (~30 s)

PROGRAM = Path(__file__).parent / "data" / "differential" / "mlp.py"
OPGUARD = [sys.executable, "-m", "opguard_core.cli.app"]


def per_function(frames: list[Any], callsites: list[Any]) -> Counter[tuple[str, str]]:
    """Ops per (innermost ``mlp`` function, op); ``-`` where no frame is the program's.
    A frame's module is its file's stem where the module is unknown."""
    counts: Counter[tuple[str, str]] = Counter()
    for site in callsites:
        own = [
            frames[i].function
            for i in site.stack
            if (frames[i].module or Path(frames[i].file).stem) == "mlp"
        ]
        counts[(own[-1] if own else "-", site.op)] += site.count
    return counts


def test_profiler_backend_and_kineto_import_agree(tmp_path: Path) -> None:
    profile = tmp_path / "mlp.pt.trace.json"
    run = subprocess.run(
        [sys.executable, str(PROGRAM), "--profile", str(profile)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    traced = subprocess.run(
        [
            *OPGUARD,
            *("trace", "--backend", "profiler", "--label", "mlp", "--output-dir", str(tmp_path)),
            "--no-split",  # the whole program, as the profile holds it
            *("--", sys.executable, str(PROGRAM)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert traced.returncode == 0, traced.stderr
    ours = load_trace(tmp_path / "mlp_callsite_rank0.json")
    imported = read_kineto(profile.read_bytes(), profile.name)
    assert imported["meta"]["device"] == "cpu" and imported["meta"]["stack_source"] == "python"
    theirs = decode_trace(msgspec.json.encode(imported), profile)
    expected = per_function(ours.frames, ours.callsites)
    found = per_function(theirs.frames, theirs.callsites)
    assert found == expected
    # what the program does, as both see it
    assert expected[("forward", "aten::linear")] == 6  # 2 layers x 3 steps
    assert expected[("make_batch", "aten::randn")] == 6
    assert {site.role for site in theirs.callsites} == {"compute"}
    # backward ops: the import attributes them to loss.backward(), as the modes tracer does
    backward = [s for s in theirs.callsites if s.api == "Tensor.backward"]
    assert backward and all(
        "train_step" in {theirs.frames[i].function for i in s.stack} for s in backward
    )
