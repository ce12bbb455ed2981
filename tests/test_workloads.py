"""No false positive on real programs (issue 29, point 5): small equivalents of GPT-2,
BERT, a ResNet, a GRU, activation checkpointing and CPU autocast
(tests/data/workloads/families.py), each traced for 3 steps by both backends into a
config of its loop, then run again unchanged (other data, another batch size) for 3
and 30 steps: ``opguard check`` finds nothing, and ``opguard guard``'s per-op check
and whole-run rules find no error. One test per family."""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from click.testing import CliRunner  # noqa: E402

from opguard_core.cli.app import create_cli  # noqa: E402
from opguard_core.formats.check import load_report  # noqa: E402
from opguard_core.plugin.manager import create_plugin_manager  # noqa: E402
from opguard_plugins.enforce.runtime import guarded  # noqa: E402
from opguard_plugins.tracer import trace_callsites  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.profiler]

WORKLOADS = Path(__file__).resolve().parent / "data" / "workloads"
FAMILIES = ("autocast", "bert", "checkpoint", "gpt2", "gru", "resnet")


@pytest.fixture(scope="module")
def families() -> Iterator[Any]:
    sys.path.insert(0, str(WORKLOADS))
    try:
        yield importlib.import_module("families")
    finally:
        sys.path.remove(str(WORKLOADS))
        sys.modules.pop("families", None)


def invoke(*args: str | Path) -> Any:
    cli = create_cli(create_plugin_manager())
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def loop_trace(folder: Path, label: str, backend: str, body: Any) -> Path:
    with trace_callsites(label, folder, rank=0, backend=backend) as tracer:
        body()
    assert tracer.written is not None and tracer.written.name == f"{label}_callsite_rank0.json"
    return tracer.written


def summary(violations: list[dict[str, Any]]) -> list[str]:
    return [f"{v['severity']} {v['kind']} {v['message']}" for v in violations]


@pytest.mark.parametrize("family", FAMILIES)
def test_an_unchanged_rerun_is_clean_in_check_and_guard(
    tmp_path: Path, families: Any, family: str
) -> None:
    for backend in ("modes", "profiler"):
        folder = tmp_path / backend
        base = loop_trace(folder, "base", backend, lambda: families.run(family, 3))
        result = invoke("run", "-i", base, "--output-base", tmp_path / f"run_{backend}")
        assert result.exit_code == 0, result.stderr
        config = Path(result.stdout.strip().splitlines()[-1]) / "base_callsite_instrumentation.yaml"
        for steps, seed, batch in ((3, 1, 6), (30, 2, 4)):
            label = f"again{steps}"
            again = loop_trace(
                folder,
                label,
                backend,
                lambda s=steps, r=seed, b=batch: families.run(family, s, r, b),
            )
            checked = invoke("check", "--config", config, "-i", again, "--format", "json")
            report = json.loads(checked.stdout)
            if steps == 3:  # the same length: nothing at all
                assert report["violations"] == [], (backend, summary(report["violations"]))
            else:  # 30 steps: no error (what ran once after the loop may warn: below)
                assert report["errors"] == 0, (backend, summary(report["violations"]))
                after_the_loop = {"torch:Tensor.__float__", "torch:Tensor.detach"}
                assert {v["target"] for v in report["violations"]} <= after_the_loop
        if backend == "modes":  # the guard is the modes backend's view
            with guarded(config, report_dir=tmp_path / "g", rank=0, whole_run=True) as guard:
                families.run(family, 30, 3, 5)
            document = load_report(guard.written or tmp_path)
            assert document["errors"] == 0, summary(document["violations"])
            warned = {v["target"] for v in document["violations"]}
            assert warned <= {"torch:Tensor.__float__", "torch:Tensor.detach"}, warned
