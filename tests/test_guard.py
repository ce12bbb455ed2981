"""``opguard guard`` and ``guarded()``: the runtime guard on real torch programs.

Fast tests run in-process: a small model module is written to a temporary
directory, traced with ``trace_callsites``, turned into a config by ``opguard run``
(CliRunner), then run again under :func:`guarded`. The whole-program tests
(``opguard trace`` twice, ``opguard check``, ``opguard guard`` on the bundled
examples and on edited copies of them, under torchrun too) run subprocesses and are
marked slow.
"""

from __future__ import annotations

import importlib
import json
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from click.testing import CliRunner  # noqa: E402
from ruamel.yaml import YAML  # noqa: E402

from opguard_core.cli.app import create_cli  # noqa: E402
from opguard_core.errors import ExitCode, InputError  # noqa: E402
from opguard_core.formats.check import ACROSS_TRACERS, GUARD_FORMAT, load_report  # noqa: E402
from opguard_core.formats.trace import load_trace  # noqa: E402
from opguard_core.native import pure_python  # noqa: E402
from opguard_core.plugin.manager import create_plugin_manager  # noqa: E402
from opguard_plugins.enforce.runtime import OpGuardViolation, guarded, sample_every  # noqa: E402
from opguard_plugins.tracer import trace_callsites  # noqa: E402
from tests.builders import importable_module  # noqa: E402
from tests.builders import run_opguard as run  # noqa: E402
from tests.compiled import compiled, needs  # noqa: E402

_recorder = compiled("opguard_plugins.record._recorder")

pytestmark = pytest.mark.torch

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"

MODEL = """
import torch
from torch import nn


def gate(x):
    return x * torch.sigmoid(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.extra = set()

    def forward(self, x):
        x = torch.relu(self.fc(x))
        if "op" in self.extra:
            x = x * torch.sigmoid(x)
        if "helper" in self.extra:
            x = gate(x)
        return x.sum()


def step(model, optimizer, x):
    optimizer.zero_grad()
    loss = model(x)
    loss.backward()
    optimizer.step()


def train(steps=3, extra=(), extra_steps=None):
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(steps):
        model.extra = set(extra) if extra_steps is None or i in extra_steps else set()
        step(model, optimizer, torch.randn(4, 8))
"""


def invoke(*args: str | Path) -> Any:
    cli = create_cli(create_plugin_manager())
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def make_config(tmp_path: Path, traces: str, *extra: str) -> Path:
    """``opguard run`` on ``traces``; the (filtered, with --basic) config it wrote."""
    out = tmp_path / f"run{len(list(tmp_path.glob('run*')))}"
    result = invoke("run", "-i", traces, "--output-base", out, *extra)
    assert result.exit_code == 0, result.stderr
    run_dir = Path(result.stdout.strip().splitlines()[-1])
    filtered = sorted(run_dir.glob("*_filtered_instrumentation.yaml"))
    return filtered[0] if filtered else sorted(run_dir.glob("*_instrumentation.yaml"))[0]


@pytest.fixture
def gmodel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The small model module, importable as ``gmodel``."""
    yield from importable_module(tmp_path, monkeypatch, "gmodel", MODEL)


@pytest.fixture
def config(tmp_path: Path, gmodel: Any) -> Path:
    """A config made from one in-process trace of ``gmodel.train``."""
    with trace_callsites(label="g", output_dir=tmp_path / "traces", rank=0):
        gmodel.train()
    return make_config(tmp_path, str(tmp_path / "traces" / "g_callsite_rank0.json"))


def report_of(guard: Any) -> dict[str, Any]:
    assert guard.written is not None
    document = load_report(guard.written)
    assert document["format"] == GUARD_FORMAT
    return document


def errors_of(document: dict[str, Any]) -> list[dict[str, Any]]:
    return [v for v in document["violations"] if v["severity"] == "error"]


# ---------------------------------------------------------------------------
# in-process: guarded()
# ---------------------------------------------------------------------------


def test_tracer_records_optimizer_steps(tmp_path: Path, gmodel: Any) -> None:
    with trace_callsites(label="s", output_dir=tmp_path, rank=0) as tracer:
        gmodel.train(steps=4)
    assert tracer.written is not None
    # the loop (after the first step) and the set-up (up to its end) apart
    loop = load_trace(tracer.written).meta
    assert (loop["steps"], loop["phase"]) == (3, "loop")
    setup = load_trace(tmp_path / "s_setup_rank0.json").meta
    assert (setup["steps"], setup["phase"]) == (1, "setup")


def test_the_same_program_has_no_violation(tmp_path: Path, gmodel: Any, config: Path) -> None:
    functions = (gmodel.Net.forward, gmodel.step, gmodel.train)
    with guarded(config, report_dir=tmp_path / "rep", rank=0, whole_run=True) as guard:
        # targets are found on the stack: the program's functions are not replaced
        assert (gmodel.Net.forward, gmodel.step, gmodel.train) == functions
        gmodel.train()
    document = report_of(guard)
    # nothing at all: no error, and no missing/count_drift at exit on the same run
    assert document["violations"] == [], document["violations"]
    assert document["rank"] == 0 and document["steps"] == 3
    assert guard.written == tmp_path / "rep" / "guard_report_rank0.json"
    assert {"gmodel:Net.forward", "gmodel:step", "gmodel:train"} <= guard.seen_targets()
    assert document["targets_seen"] == len(guard.seen_targets())


def test_a_sampled_guard_does_not_invent_missing_targets(tmp_path: Path, gmodel: Any) -> None:
    """``gate`` runs in one step only, which the sampled guard (every 2nd step) did not
    check: it is not said to have never run (sampling may miss, never invent)."""
    with trace_callsites(label="h", output_dir=tmp_path / "traces", rank=0):
        gmodel.train(steps=4, extra=("helper",))
    config = make_config(tmp_path, str(tmp_path / "traces" / "h_callsite_rank0.json"))
    for sample, step in ((0.5, 1), (0.5, 2)):
        report = tmp_path / f"rep{step}"
        with guarded(config, report_dir=report, rank=0, sample=sample, whole_run=True) as guard:
            gmodel.train(steps=4, extra=("helper",), extra_steps={step})
        kinds = [(v["kind"], v["target"]) for v in report_of(guard)["violations"]]
        assert ("missing", "gmodel:gate") not in kinds, (step, kinds)


def test_a_merged_configs_source_is_held_to_its_own_steps(
    tmp_path: Path, gmodel: Any, config: Path
) -> None:
    """A merged config of two sources, the other traced over 4 times the steps:
    ``source`` compares per step of its own (once of both: count_drift everywhere)."""
    with trace_callsites(label="long", output_dir=tmp_path / "long", rank=0):
        gmodel.train(steps=9)
    other = make_config(tmp_path, str(tmp_path / "long" / "long_callsite_rank0.json"))
    merged = tmp_path / "merged.yaml"
    assert invoke("merge", config, other, "-o", merged).exit_code == 0
    with guarded(merged, report_dir=tmp_path / "rep", rank=0, source="g_callsite",
                 whole_run=True) as guard:  # fmt: skip
        gmodel.train()
    assert report_of(guard)["violations"] == []


def test_an_extra_op_in_forward_is_unexpected_op(
    tmp_path: Path, gmodel: Any, config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with guarded(config, report_dir=tmp_path, rank=0) as guard:
        gmodel.train(extra=("op",))
    found = {(v["target"], v["op"]): v for v in errors_of(report_of(guard))}
    hit = found[("gmodel:Net.forward", "aten::sigmoid")]
    # once per step of the loop: the config is the loop's (the set-up, up to the end of
    # the first step, is not checked against it)
    assert hit["kind"] == "unexpected_op" and hit["count"] == 2
    assert hit["rank"] == 0 and hit["ranks"] == [0]
    assert any(f["function"] == "Net.forward" for f in hit["stack"])
    assert ("gmodel:step", "aten::sigmoid") in found  # inclusive: the caller too
    # warn logs each violation once, on stderr
    logged = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line[:1] == "{"]
    mine = [e for e in logged if e.get("op") == "aten::sigmoid" and e["target"] == hit["target"]]
    assert len(mine) == 1 and mine[0]["level"] == "error"


def test_a_config_of_another_tracer_is_held_to_what_ran_where(
    tmp_path: Path, gmodel: Any, config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A config whose traces another tracer recorded (``meta.recorded_by``: the
    profiler backend sees other ops, no api) is compared, as ``opguard check``
    compares across tracers, on which functions ran where: one warning says so; an
    extra op is not an error there, a function the config lacks still is reported."""
    other = tmp_path / "profiler_config.yaml"
    text = config.read_text()
    assert "recorded_by: [modes]" in text
    other.write_text(text.replace("recorded_by: [modes]", "recorded_by: [profiler]"))
    with guarded(other, report_dir=tmp_path / "same", rank=0, whole_run=True) as guard:
        gmodel.train(extra=("op",))
    assert errors_of(report_of(guard)) == []
    assert "the config was recorded by profiler" in capsys.readouterr().err
    with guarded(other, report_dir=tmp_path / "helper", rank=0, whole_run=True) as guard:
        gmodel.train(extra=("helper",))
    kinds = {(v["kind"], v["target"]) for v in report_of(guard)["violations"]}
    assert ("unknown_target", "gmodel:gate") in kinds
    assert all(kind in ACROSS_TRACERS for kind, _ in kinds)


def test_raise_stops_the_offending_call(tmp_path: Path, gmodel: Any, config: Path) -> None:
    raised = pytest.raises(OpGuardViolation, match=r"aten::sigmoid ran inside gmodel:Net\.forward")
    with raised, guarded(config, report_dir=tmp_path, on_violation="raise", rank=0) as guard:
        gmodel.train(extra=("op",))
    # the report is written on the exception path too
    document = report_of(guard)
    hits = [v for v in errors_of(document) if v["op"] == "aten::sigmoid"]
    assert hits and all(v["count"] == 1 for v in hits)


NESTED = """
import torch


def build():
    class Local(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x, extra):
            def helper(y):
                if extra:
                    y = torch.sigmoid(y)
                return torch.relu(y)

            return helper(self.fc(x)).sum()

    return Local()


def run(extra=False):
    torch.manual_seed(0)
    model = build()
    for _ in range(2):
        model(torch.randn(2, 4), extra).backward()
"""


def test_nested_functions_and_late_modules_are_guarded(tmp_path: Path) -> None:
    """Classes and closures defined inside functions (``<locals>``) and a module first
    imported after the guard started are found on the stack like any other target."""
    folder = tmp_path / "src"
    folder.mkdir()
    (folder / "nestmod.py").write_text(NESTED)
    sys.path.insert(0, str(folder))
    try:
        sys.modules.pop("nestmod", None)
        module = importlib.import_module("nestmod")
        with trace_callsites(label="n", output_dir=tmp_path / "traces", rank=0):
            module.run()
        config = make_config(tmp_path, str(tmp_path / "traces" / "n_callsite_rank0.json"))
        targets = config.read_text()
        assert "nestmod:build.<locals>.Local.forward.<locals>.helper" in targets
        sys.modules.pop("nestmod", None)
        with guarded(config, report_dir=tmp_path / "clean", rank=0) as guard:
            fresh = importlib.import_module("nestmod")  # imported after the guard started
            fresh.run()
        assert report_of(guard)["violations"] == []
        with guarded(config, report_dir=tmp_path / "extra", rank=0) as guard:
            fresh.run(extra=True)
        found = {(v["target"], v["op"]) for v in errors_of(report_of(guard))}
        helper = "nestmod:build.<locals>.Local.forward.<locals>.helper"
        assert (helper, "aten::sigmoid") in found
        assert ("nestmod:build.<locals>.Local.forward", "aten::sigmoid") in found
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop("nestmod", None)


@needs(_recorder)
@pytest.mark.skipif(pure_python(), reason="OPGUARD_PURE_PYTHON: the guard has no C path")
@pytest.mark.parametrize("extra", [(), ("op",), ("helper",)], ids=["same", "op", "helper"])
def test_the_c_path_does_what_the_python_path_does(
    tmp_path: Path, gmodel: Any, config: Path, extra: tuple[str, ...]
) -> None:
    """``_recorder.TargetWalker`` against its Python reference on one program: with
    the C modes' methods removed, at every op ``active_targets`` (C) names what
    ``Guard.active_targets`` names (targets, the program's leaf the config lacks,
    re-entries through the api mode); a run on the C path (``dispatch``, ``function``)
    and one on the Python path give the same report and the same per-entry counts."""
    assert _recorder is not None
    runs = []
    for native in (True, False):
        with guarded(config, report_dir=tmp_path / str(native), rank=0) as guard:
            assert guard.walker is not None
            seen: list[tuple[Any, ...]] = []
            if not native:  # every op through the Python modes and walk, each compared
                del guard._mode.__torch_dispatch__
                if guard._api_mode is not None:
                    del guard._api_mode.__torch_function__
                walker = _recorder.TargetWalker(guard._name_code)

                def both(
                    frame: Any,
                    api: Any,
                    walker: Any = walker,
                    guard: Any = guard,
                    seen: list[tuple[Any, ...]] = seen,
                ) -> Any:
                    fast = walker.active_targets(frame, api)
                    reference = guard.active_targets(frame, api)
                    assert fast == reference
                    seen.append(fast)
                    return reference

                guard.walk = both  # type: ignore[assignment]
            gmodel.train(extra=extra)
        if not native:
            assert len(seen) > 30 and any(len(s) > 2 for s in seen)
            assert any(s[1] == "gmodel:gate" for s in seen) == (extra == ("helper",))
        runs.append((report_of(guard)["violations"], guard.observed_entries()))
    assert runs[0] == runs[1]
    assert bool(runs[0][0]) == bool(extra) and runs[0][1]
    with pytest.raises(TypeError):
        _recorder.TargetWalker(guard._name_code).active_targets("not a frame")
    with pytest.raises(TypeError, match="non-empty str or None"):
        _recorder.TargetWalker(lambda code, namespace: 1).active_targets(sys._getframe())
    walker = _recorder.TargetWalker(guard._name_code)
    assert walker.active_targets(None) == (None, None)
    assert walker.active_targets(None, "torch:Tensor.mul") == ("torch:Tensor.mul", None)
    with pytest.raises(TypeError, match="needs guard"):
        walker.dispatch(None, torch.ops.aten.add.Tensor, (), (torch.ones(1), torch.ones(1)))


def test_sampling_checks_every_nth_step(tmp_path: Path, gmodel: Any, config: Path) -> None:
    assert sample_every(0.1) == 10 and sample_every(0.5) == 2 and sample_every(1.0) == 1
    # the config is the loop's: every 2nd step from the loop's first (1, 3, ...) is
    # checked, so the extra op only in step 2 is missed
    with guarded(config, report_dir=tmp_path / "a", sample=0.5, rank=0) as guard:
        gmodel.train(steps=4, extra=("op",), extra_steps={2})
    document = report_of(guard)
    assert errors_of(document) == []
    assert document["steps"] == 4 and document["checked_steps"] == 2  # steps 1, 3
    # in step 1 it is caught
    with guarded(config, report_dir=tmp_path / "b", sample=0.5, rank=0) as guard:
        gmodel.train(steps=4, extra=("op",), extra_steps={1})
    assert any(v["op"] == "aten::sigmoid" for v in errors_of(report_of(guard)))


def test_targets_that_never_run_are_missing_and_never_imported(
    tmp_path: Path, gmodel: Any, config: Path
) -> None:
    yaml = YAML()
    data = yaml.load(config.read_text())
    template = {"kind": "function", "context": [], "ops": {"aten::add": 1}, "count": 1}
    absent = (
        "no_such_module_xyz:f",
        "gmodel:missing_function",
        "gmodel:Net.<locals>.inner",
        "torch.nn.functional:linear",  # a builtin: never a Python frame
    )
    for target in absent:
        data["entries"].append({"target": target, **template})
    edited = tmp_path / "edited.yaml"
    with edited.open("w") as handle:
        yaml.dump(data, handle)
    with guarded(edited, report_dir=tmp_path / "block", rank=0) as guard:
        gmodel.train()
    assert report_of(guard)["violations"] == []  # a block is not the whole run
    with guarded(edited, report_dir=tmp_path, rank=0, whole_run=True) as guard:
        gmodel.train()
    document = report_of(guard)
    assert errors_of(document) == []
    missing = {v["target"] for v in document["violations"] if v["kind"] == "missing"}
    assert missing == set(absent)
    assert "no_such_module_xyz" not in sys.modules  # a config never causes an import


def test_a_run_that_ended_early_says_so_in_its_report(tmp_path: Path, gmodel: Any) -> None:
    """A block left by an exception is not checked by the whole-run rules (its counts
    cover part of a run) and its report says why it ended (``partial``, as a trace's
    ``meta.partial``; before: nothing, so it read as a clean pass)."""
    with trace_callsites(label="h", output_dir=tmp_path / "traces", rank=0):
        gmodel.train(extra=("helper",))
    config = make_config(tmp_path, str(tmp_path / "traces" / "h_callsite_rank0.json"))
    with guarded(config, report_dir=tmp_path / "whole", rank=0, whole_run=True) as guard:
        gmodel.train()  # gate never runs
    document = report_of(guard)
    assert ("missing", "gmodel:gate") in {(v["kind"], v["target"]) for v in document["violations"]}
    assert "partial" not in document
    with (
        pytest.raises(RuntimeError),
        guarded(config, report_dir=tmp_path / "died", rank=0, whole_run=True) as guard,
    ):
        gmodel.train()
        raise RuntimeError("collective failed")
    document = report_of(guard)
    assert document["violations"] == []
    assert document["partial"] == {
        **document["partial"],
        "reason": "exception",
        "exception": "RuntimeError",
        "step": 3,
    }
    # sys.exit(0) in the block is a program that finished (as under `opguard guard`);
    # sys.exit(2) one that failed
    for status in (0, 2):
        with (
            pytest.raises(SystemExit),
            guarded(config, report_dir=tmp_path / f"exit{status}", rank=0, whole_run=True) as guard,
        ):
            gmodel.train()
            sys.exit(status)
        document = report_of(guard)
        if status == 0:
            assert "partial" not in document
            assert ("missing", "gmodel:gate") in {
                (v["kind"], v["target"]) for v in document["violations"]
            }
        else:
            assert document["partial"]["reason"] == "exit" and document["partial"]["status"] == 2


def test_guard_command_usage_and_unreadable_config(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 2\nentries: [\n")
    result = invoke("guard", "--config", bad, "--", "prog.py")
    assert result.exit_code == ExitCode.INPUT_UNREADABLE
    assert "bad.yaml" in result.stderr and "Traceback" not in result.stderr
    good = make_config(tmp_path, str(REPO / "examples" / "traces" / "single_callsite_rank0.json"))
    result = invoke("guard", "--config", good, "--sample", "0", "--", "prog.py")
    assert result.exit_code == ExitCode.USAGE_ERROR
    result = invoke("guard", "--config", good, "--on-violation", "stop", "--", "prog.py")
    assert result.exit_code == ExitCode.USAGE_ERROR


def test_a_damaged_guard_report_is_refused_naming_the_file(
    tmp_path: Path, gmodel: Any, config: Path
) -> None:
    with guarded(config, report_dir=tmp_path, rank=0) as guard:
        gmodel.train(extra=("op",))
    assert guard.written is not None
    document = json.loads(guard.written.read_text())
    document["violations"][0]["count"] = 0
    bad = tmp_path / "bad_report.json"
    bad.write_text(json.dumps(document))
    with pytest.raises(InputError, match=r"bad_report\.json.*'count' is not an integer >= 1"):
        load_report(bad)
    del document["targets_seen"]
    document["violations"][0]["count"] = 1
    bad.write_text(json.dumps(document))
    with pytest.raises(InputError, match="'targets_seen'"):
        load_report(bad)
    document["version"], document["unwrapped"] = 2, []  # version 2 is still read
    bad.write_text(json.dumps(document))
    assert load_report(bad)["version"] == 2


# ---------------------------------------------------------------------------
# whole programs (subprocesses): trace twice, check the second run, guard a third
# ---------------------------------------------------------------------------


def program(example: str, folder: Path) -> list[str]:
    script = folder / f"train_{example}.py"
    if example == "single":
        return [str(script), "--steps", "2"]
    return ["torchrun", "--nproc-per-node", "2", str(script), "--steps", "2"]


def trace(tmp_path: Path, name: str, command: list[str]) -> str:
    proc = run("trace", "--label", "p", "--output-dir", tmp_path / name, "--", *command)
    assert proc.returncode == 0, proc.stderr
    return str(tmp_path / name / "p_callsite_rank*.json")


def check(config: Path, traces: str) -> tuple[int, dict[str, Any]]:
    proc = run("check", "--config", config, "--format", "json", "-i", traces)
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def guard(
    config: Path, report_dir: Path, command: list[str], *options: str
) -> tuple[int, list[dict[str, Any]]]:
    proc = run("guard", "--config", config, "--report-dir", report_dir, *options, "--", *command)
    reports = [load_report(p) for p in sorted(report_dir.glob("guard_report_rank*.json"))]
    assert reports, proc.stderr
    return proc.returncode, reports


def copy_examples(tmp_path: Path, edit: Callable[[str], str] | None = None) -> Path:
    folder = tmp_path / "edited"
    shutil.copytree(EXAMPLES, folder, ignore=shutil.ignore_patterns("traces", "opguard-*"))
    if edit is not None:
        path = folder / "tiny_gpt.py"
        path.write_text(edit(path.read_text()))
    return folder


def gated(source: str) -> str:
    old = "        return self.proj(F.gelu(self.fc(x)))"
    assert old in source
    new = (
        "        x = F.gelu(self.fc(x))\n"
        "        x = x * torch.sigmoid(x)\n"
        "        return self.proj(x)"
    )
    return source.replace(old, new)


@pytest.mark.slow
@pytest.mark.parametrize("example", ["single", "ddp", "fsdp"])
def test_no_false_positives(tmp_path: Path, example: str) -> None:
    # the config from 4 steps (DDP rebuilds its buckets in the second: the loop's
    # steady state starts at the third); check holds a 30-step run to it (its loop per
    # step, its collectives step by step, the last step with the last), and so does the
    # guard at run time, where a step past the good run's may follow its last step (a
    # loss all-reduce, a barrier after the loop) or its last loop step (docs/guard.md)
    command = [*program(example, EXAMPLES)[:-1], "4"]
    longer = [*command[:-1], "30"]
    first, second = trace(tmp_path, "t1", command), trace(tmp_path, "t2", longer)
    for basic in ([], ["--basic"]):
        config = make_config(tmp_path, first, *basic)
        code, report = check(config, second)
        errors = [v for v in report["violations"] if v["severity"] == "error"]
        assert code == 0 and errors == [], (basic, errors)
        for guarded_run in (command, longer):
            report_dir = tmp_path / f"guard{len(basic)}_{guarded_run[-1]}"
            code, reports = guard(config, report_dir, guarded_run)
            assert code == 0, reports
            assert [r["rank"] for r in reports] == ([0] if example == "single" else [0, 1])
            assert all(r["errors"] == 0 for r in reports), [errors_of(r) for r in reports]


@pytest.mark.slow
def test_extra_op_in_forward_is_caught_by_check_and_guard(tmp_path: Path) -> None:
    config = make_config(tmp_path, trace(tmp_path, "t1", program("single", EXAMPLES)))
    edited = program("single", copy_examples(tmp_path, gated))
    code, report = check(config, trace(tmp_path, "t2", edited))
    found = {(v["kind"], v["target"], v.get("op")) for v in report["violations"]}
    assert code == 1
    assert ("unexpected_op", "tiny_gpt:MLP.forward", "aten::sigmoid") in found
    for mode in ("warn", "raise"):
        code, [document] = guard(config, tmp_path / mode, edited, "--on-violation", mode)
        assert code == 1
        hits = [v for v in document["violations"] if v["target"] == "tiny_gpt:MLP.forward"]
        assert any(v["kind"] == "unexpected_op" and v["op"] == "aten::sigmoid" for v in hits)
        assert all(v["count"] == 1 for v in hits) if mode == "raise" else True
        assert any("tiny_gpt.py" in f["file"] for f in hits[0]["stack"])


@pytest.mark.slow
def test_a_new_helper_is_unknown_target(tmp_path: Path) -> None:
    def helper(source: str) -> str:
        source = source.replace(
            "        return self.proj(F.gelu(self.fc(x)))",
            "        return self.proj(scale(F.gelu(self.fc(x))))",
        )
        return source + "\n\ndef scale(x):\n    return x.mul(1.0)\n"

    config = make_config(tmp_path, trace(tmp_path, "t1", program("single", EXAMPLES)))
    edited = program("single", copy_examples(tmp_path, helper))
    _, report = check(config, trace(tmp_path, "t2", edited))
    unknown = [v for v in report["violations"] if v["kind"] == "unknown_target"]
    assert any(v["target"] == "tiny_gpt:scale" for v in unknown), report["violations"]


@pytest.mark.slow
def test_an_extra_collective_is_reported_on_its_rank_only(tmp_path: Path) -> None:
    # rank 1 gathers on a group of its own (a collective on the world group issued
    # by one rank only would wait for the other forever)
    def collective(source: str) -> str:
        old = "    loss.backward()\n"
        assert old in source
        extra = (
            "    if SOLO is not None and dist.get_rank() == 1:\n"
            "        value = loss.detach().reshape(1)\n"
            "        dist.all_gather_into_tensor(torch.empty_like(value), value, group=SOLO)\n"
        )
        source = source.replace(old, old + extra)
        return source.replace(
            "from torch import nn\n",
            "from torch import nn\nimport torch.distributed as dist\n\nSOLO = None\n",
        )

    def solo_group(folder: Path) -> None:
        path = folder / "train_ddp.py"
        old = '    dist.init_process_group(backend="gloo")\n'
        source = path.read_text()
        assert old in source
        new = old + "    import tiny_gpt\n\n    tiny_gpt.SOLO = dist.new_group([1])\n"
        path.write_text(source.replace(old, new))

    config = make_config(tmp_path, trace(tmp_path, "t1", program("ddp", EXAMPLES)))
    folder = copy_examples(tmp_path, collective)
    solo_group(folder)
    edited = program("ddp", folder)
    code, report = check(config, trace(tmp_path, "t2", edited))
    hits = [
        v
        for v in report["violations"]
        if v["kind"] == "unexpected_op" and v["target"] == "tiny_gpt:train_step"
    ]
    assert code == 1 and hits and all(v["ranks"] == [1] for v in hits), report["violations"]
    assert any(v["op"].startswith("c10d::") for v in hits)
    code, reports = guard(config, tmp_path / "g", edited)
    assert code == 1
    by_rank = {r["rank"]: errors_of(r) for r in reports}
    assert by_rank[0] == []
    assert any(
        v["target"] == "tiny_gpt:train_step" and v["op"].startswith("c10d::") for v in by_rank[1]
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("ending", "code"),
    [
        ("raise ValueError('boom')", 1),
        ("os.kill(os.getpid(), signal.SIGTERM)", 128 + 15),  # as torchrun stops a worker
    ],
)
def test_the_report_is_written_when_the_program_fails(
    tmp_path: Path, ending: str, code: int
) -> None:
    config = make_config(tmp_path, str(REPO / "examples" / "traces" / "single_callsite_rank0.json"))
    script = tmp_path / "failing.py"
    script.write_text(
        "import os, signal\nimport torch\n\n"
        f"x = torch.ones(3) + 1\n{ending}\nprint('not reached')\n"
    )
    proc = run("guard", "--config", config, "--report-dir", tmp_path / "rep", "--", script)
    assert proc.returncode == code, proc.stderr
    assert "not reached" not in proc.stdout
    [document] = [load_report(p) for p in (tmp_path / "rep").glob("guard_report_rank*.json")]
    assert document["rank"] == 0 and document["errors"] == 0
    assert document["targets_seen"] == 0  # no config target ran before it ended
    # the report and the summary say the run ended early, so 0 errors is no clean pass
    why = "exception ValueError" if code == 1 else "sigterm"
    assert document["partial"]["reason"] == why.split()[0]
    assert (
        f"in 1 report(s) in {tmp_path / 'rep'}: guard_report_rank0.json (runs that ended early, "
        f"rank 0: {why} at step 0: their whole-run rules (missing, missing_op, count_drift, "
        "unknown_target) not checked)"
    ) in proc.stderr


@pytest.mark.slow
def test_a_merged_config_without_source_says_what_it_did_not_check(tmp_path: Path) -> None:
    """With a merged config and no ``--source`` the whole-run rules are skipped (each
    source's entries would be ``missing``): the summary said nothing of it, so a
    swapped optimizer passed as a clean 0 errors, exit 0."""
    examples = REPO / "examples" / "traces"
    single = make_config(tmp_path / "a", str(examples / "single_callsite_rank0.json"))
    ddp = make_config(tmp_path / "b", str(examples / "ddp_callsite_rank*.json"))
    merged = tmp_path / "merged.yaml"
    assert invoke("merge", single, ddp, "-o", merged).exit_code == 0
    script = (REPO / "examples" / "train_single.py", "--steps", "2")
    proc = run("guard", "--config", merged, "--report-dir", tmp_path / "rep", "--", *script)
    assert proc.returncode == 0, proc.stderr
    assert (
        "(a merged config of sources ddp_callsite, single_callsite and no --source: the "
        "whole-run rules (missing, missing_op, count_drift, unknown_target) not checked; "
        "--source NAME holds the program to its source's share)"
    ) in proc.stderr
    proc = run("guard", "--config", merged, "--source", "single_callsite",
               "--report-dir", tmp_path / "rep2", "--", *script)  # fmt: skip
    assert "no --source" not in proc.stderr
