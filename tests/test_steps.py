"""The runner knows no stage: stages are declared steps (opguard_core/run/steps.py).

A stage added by declaration alone (a hookspec, a plugin, one Step) runs, writes its
artifact, is recorded, is skipped with ``--skip`` and when what it needs is missing;
the runner module stays small and names no artifact.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from opguard_core import hookimpl, hookspec
from opguard_core.model import STAGES, InputEntry, RunOptions
from opguard_core.plugin.manager import create_plugin_manager
from opguard_core.run import runner as runner_module
from opguard_core.run.runner import Runner
from opguard_core.run.steps import STEP, STEPS, Step, StepCall

SAMPLES = Path(__file__).parent / "data" / "samples"


def test_the_runner_fits_on_two_screens_and_names_no_artifact() -> None:
    source = Path(runner_module.__file__).read_text()
    assert len(source.splitlines()) <= 300
    for step in STEPS:
        for template in step.artifacts.values():
            fixed = max(re.split(r"\{\w+\}", template), key=len)  # its longest literal part
            assert fixed not in source, (step.name, template)


def test_the_stage_names_are_the_steps() -> None:
    assert ("discover", *(step.name for step in STEPS)) == STAGES


# ------------------------------------------------------------- a new stage


class Specs:
    """The new stage's hookspec (its own module in a real plugin package)."""

    @hookspec(firstresult=True)
    def opguard_op_totals(self, trace: Any) -> dict[str, int] | None:
        """Count every op of an entry's combined trace.

        Stops at first non-None result.

        :param trace: the combined trace.
        :returns: op name → count.
        """


class Totals:
    """The built-in implementation of the new stage."""

    @hookimpl(trylast=True)
    def opguard_op_totals(self, trace: Any) -> dict[str, int]:
        totals: dict[str, int] = {}
        for site in trace.callsites:
            totals[site.op] = totals.get(site.op, 0) + site.count
        return dict(sorted(totals.items()))


def op_totals(call: StepCall, entry: InputEntry, needs: Mapping[str, Any]) -> dict[str, int]:
    """The glue: call the hook, write the artifact, record counts."""
    totals: dict[str, int] = call.call("opguard_op_totals", trace=needs["combine"])
    call.write("totals", json.dumps(totals, indent=1) + "\n")
    call.record.counts = {"ops": len(totals)}
    return totals


TOTALS = Step("op_totals", "entry", op_totals, needs=("combine",),
              artifacts={"totals": "{entry}_op_totals.json"})  # fmt: skip
WITH_TOTALS = (STEP["combine"], TOTALS, *STEPS[1:])


def _runner(tmp_path: Path, skip: tuple[str, ...] = (), inputs: list[str] | None = None) -> Runner:
    manager = create_plugin_manager()
    manager.add_hookspecs(Specs)
    manager.register(Totals(), name="op_totals")
    inputs = inputs or [str(SAMPLES / "gpt_callsite_rank*.json")]
    return Runner(manager, inputs, RunOptions(), skip, tmp_path / "out", steps=WITH_TOTALS)


def _records(runner: Runner) -> dict[tuple[str, str | None], Any]:
    return {(r.stage, r.entry): r for r in runner.recorder.records}


def test_a_declared_stage_runs_writes_and_is_recorded(tmp_path: Path) -> None:
    runner = _runner(tmp_path)
    assert runner.run() == 0
    assert runner.run_dir is not None
    totals = json.loads((runner.run_dir / "gpt_callsite_op_totals.json").read_text())
    assert sum(totals.values()) == 2826 + 2722  # every op of both ranks
    record = _records(runner)[("op_totals", "gpt_callsite")]
    assert record.status == "ok" and record.plugin == "op_totals"
    assert record.outputs == ["gpt_callsite_op_totals.json"]
    summary = json.loads((runner.run_dir / "pipeline_summary.json").read_text())
    assert ["op_totals", "gpt_callsite", "ok"] in [
        [s["stage"], s["entry"], s["status"]] for s in summary["stages"]
    ]


def test_a_declared_stage_is_skipped_as_asked_and_when_its_need_is_missing(
    tmp_path: Path,
) -> None:
    runner = _runner(tmp_path, skip=("op_totals",))
    assert runner.run() == 0
    assert _records(runner)[("op_totals", "gpt_callsite")].error == "--skip op_totals"
    assert runner.run_dir is not None and not list(runner.run_dir.glob("*_op_totals.json"))

    broken = tmp_path / "broken.json"
    broken.write_text("{")
    runner = _runner(tmp_path / "b", inputs=[str(broken)])
    assert runner.run() == 1
    record = _records(runner)[("op_totals", "broken")]
    assert record.status == "skipped" and record.error.startswith("an earlier stage failed")


def test_a_skipped_stage_skips_every_stage_that_needs_it(tmp_path: Path) -> None:
    runner = _runner(tmp_path, skip=("compress",))
    assert runner.run() == 0
    records = _records(runner)
    assert records[("op_totals", "gpt_callsite")].status == "ok"  # needs combine only
    for stage in ("generate", "compare", "merge", "filter"):
        entry = "gpt_callsite" if stage == "generate" else None
        assert records[(stage, entry)].error == "--skip compress", stage
