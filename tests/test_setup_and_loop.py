"""Set-up and loop (docs/tracing.md): the tracer writes what ran up to the end of the
first optimizer step apart from the loop, so a config is about the training loop and a
run of another length is neither an error nor a warning, in check and in guard alike.

In-process: a small model module written to a temporary directory, traced with
``trace_callsites``, turned into configs by ``opguard run`` (CliRunner), then checked
(``opguard check``) and guarded (:func:`guarded`) at other step counts.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from click.testing import CliRunner  # noqa: E402

from opguard_core.cli.app import create_cli  # noqa: E402
from opguard_core.errors import InputError  # noqa: E402
from opguard_core.formats.check import load_report  # noqa: E402
from opguard_core.formats.config import load_config  # noqa: E402
from opguard_core.formats.sources import project  # noqa: E402
from opguard_core.formats.trace import DecodedTrace, load_trace  # noqa: E402
from opguard_core.plugin.manager import create_plugin_manager  # noqa: E402
from opguard_plugins.enforce.runtime import guarded  # noqa: E402
from opguard_plugins.tracer import trace_callsites  # noqa: E402
from tests.builders import importable_module  # noqa: E402

pytestmark = pytest.mark.torch

MODEL = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 2)
        self.extra = False
        self.relu = True

    def forward(self, x):
        x = self.bn(self.conv(x))
        if self.relu:
            x = torch.relu(x)
        if self.extra:
            x = x * torch.sigmoid(x)
        return self.fc(x.mean((2, 3)))


def batch(dtype=None):
    return torch.randn(2, 3, 6, 6, dtype=dtype)


def step(model, optimizer, x):
    optimizer.zero_grad(set_to_none=False)
    loss = model(x).square().mean()
    loss.backward()
    optimizer.step()


def train(steps=2, extra_from=None, optimizer="adamw", relu=True, eval_mode=False, dtype=None):
    torch.manual_seed(0)
    model = Net() if dtype is None else Net().to(dtype)
    model.relu = relu
    kind = torch.optim.AdamW if optimizer == "adamw" else torch.optim.SGD
    opt = kind(model.parameters(), lr=1e-3)
    if eval_mode:
        model.eval()
    for i in range(steps):
        model.extra = extra_from is not None and i >= extra_from
        step(model, opt, batch(dtype))


def log(loss):
    return float(loss.detach())


def finish(model):
    # once, after the loop: a few ops, as a final barrier or save is
    total = torch.zeros(())
    with torch.no_grad():
        for p in model.parameters():
            total = total + p.abs().sum()
    return total


def train_logged(steps=3):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(steps):
        opt.zero_grad()
        loss = model(batch()).square().mean()
        loss.backward()
        opt.step()
        log(loss)
    finish(model)


def train_gan(steps=3, seed=0):
    # two models, two optimizers: the discriminator's steps, then the generator's
    torch.manual_seed(seed)
    gen = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    disc = nn.Sequential(nn.Linear(4, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-3)
    bce = nn.BCEWithLogitsLoss()
    for _ in range(steps):
        real, fake = torch.randn(8, 4), gen(torch.randn(8, 8))
        opt_d.zero_grad()
        loss = bce(disc(real), torch.ones(8, 1)) + bce(disc(fake.detach()), torch.zeros(8, 1))
        loss.backward()
        opt_d.step()
        opt_g.zero_grad()
        bce(disc(fake), torch.ones(8, 1)).backward()
        opt_g.step()


def infer(calls=2):
    model = Net().eval()
    with torch.no_grad():
        for _ in range(calls):
            model(batch())
"""


@pytest.fixture
def slmodel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    yield from importable_module(tmp_path, monkeypatch, "slmodel", MODEL)


def invoke(*args: str | Path) -> Any:
    cli = create_cli(create_plugin_manager())
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def traced(folder: Path, label: str, body: Any, split: bool = True) -> Path:
    with trace_callsites(label=label, output_dir=folder, rank=0, split=split) as tracer:
        body()
    assert tracer.written is not None
    return tracer.written


def counts_by_site(trace: DecodedTrace) -> collections.Counter[tuple[Any, ...]]:
    """Count per (stack from the model's outermost frame, api, op): comparable between
    traces made from different lines of a test."""
    counts: collections.Counter[tuple[Any, ...]] = collections.Counter()
    for site in trace.callsites:
        frames = [trace.frames[i] for i in site.stack]
        first = next(i for i, f in enumerate(frames) if f.module == "slmodel")
        counts[(tuple(frames[first:]), site.api, site.op)] += site.count
    return counts


def run_dir(tmp_path: Path, *inputs: Path) -> Path:
    out = tmp_path / f"run{len(list(tmp_path.glob('run*')))}"
    result = invoke("run", *[a for i in inputs for a in ("-i", i)], "--output-base", out)
    assert result.exit_code == 0, result.stderr
    return Path(result.stdout.strip().splitlines()[-1])


def check(config: Path, trace: Path) -> dict[str, Any]:
    result = invoke("check", "--config", config, "-i", trace, "--format", "json")
    assert result.exit_code in (0, 1), result.stderr
    return json.loads(result.stdout)  # type: ignore[no-any-return]


def kinds(report: dict[str, Any]) -> list[tuple[str, str, str]]:
    return sorted((v["kind"], v["target"], v.get("op") or "") for v in report["violations"])


# ---------------------------------------------------------------------------
# the tracer
# ---------------------------------------------------------------------------


def test_the_trace_splits_at_the_end_of_the_first_step(tmp_path: Path, slmodel: Any) -> None:
    loop_path = traced(tmp_path / "split", "s", lambda: slmodel.train(steps=4))
    whole_path = traced(tmp_path / "whole", "s", lambda: slmodel.train(steps=4), split=False)
    assert loop_path.name == "s_callsite_rank0.json"
    loop, whole = load_trace(loop_path), load_trace(whole_path)
    setup = load_trace(tmp_path / "split" / "s_setup_rank0.json")
    assert (loop.meta["phase"], loop.meta["steps"]) == ("loop", 3)
    assert (setup.meta["phase"], setup.meta["steps"]) == ("setup", 1)
    assert "phase" not in whole.meta and whole.meta["steps"] == 4
    assert not (tmp_path / "whole" / "s_setup_rank0.json").exists()
    # the two phases add up to the whole process, callsite by callsite
    assert counts_by_site(setup) + counts_by_site(loop) == counts_by_site(whole)
    # construction and initialisation are set-up; the optimizer's lazy state (AdamW's
    # first step) too, so each loop step issues the same ops
    setup_names = {f.qualname for f in setup.frames}
    loop_names = {f.qualname for f in loop.frames}
    assert "Net.__init__" in setup_names and "Net.__init__" not in loop_names
    assert any(name.endswith("._init_group") for name in setup_names)
    assert all(site.count % 3 == 0 for site in loop.callsites), "3 equal loop steps"
    # record_function's enter and exit (optimizer.step, zero_grad) are no program op
    assert not {s.op for s in whole.callsites if s.op.startswith("profiler::")}


def test_a_program_that_never_steps_is_one_file(tmp_path: Path, slmodel: Any) -> None:
    folder = tmp_path / "t"
    traced(folder, "i", lambda: slmodel.train(steps=2))
    assert (folder / "i_setup_rank0.json").exists()
    # the same label and rank again, no optimizer step: one file, the stale set-up gone
    path = traced(folder, "i", lambda: slmodel.infer())
    trace = load_trace(path)
    assert "phase" not in trace.meta and "steps" not in trace.meta
    assert not (folder / "i_setup_rank0.json").exists()


# ---------------------------------------------------------------------------
# check and guard at another step count
# ---------------------------------------------------------------------------


def test_another_step_count_is_clean_in_check_and_guard(tmp_path: Path, slmodel: Any) -> None:
    """The issue's case: a 6-step run against a 2-step config gave count_drift warnings
    (construction and init counted per step) and missing ones (pruned at a smaller
    share); with the set-up apart, none, in check and in guard."""
    two = tmp_path / "two"
    traced(two, "m", lambda: slmodel.train(steps=2))
    six = tmp_path / "six"
    traced(six, "r", lambda: slmodel.train(steps=6))
    directory = run_dir(tmp_path, two / "m_callsite_rank0.json", two / "m_setup_rank0.json")
    final = directory / "final_combined_instrumentation.yaml"
    meta = load_config(final)["meta"]
    assert meta["phases"] == {"m_callsite": "loop", "m_setup": "setup"}
    assert meta["steps"] == {"m_callsite": 1, "m_setup": 1}
    for phase in ("callsite", "setup"):
        report = check(final, six / f"r_{phase}_rank0.json")
        assert report["violations"] == [], (phase, kinds(report))
    loop_config = directory / "m_callsite_instrumentation.yaml"
    with guarded(loop_config, report_dir=tmp_path / "g", rank=0, whole_run=True) as guard:
        slmodel.train(steps=6)
    document = load_report(guard.written or tmp_path)
    assert document["violations"] == [] and document["steps"] == 6
    # from the end of the first step: the five loop steps, and what follows the last
    assert document["checked_steps"] == 6


def test_the_whole_process_config_still_counts_every_step(tmp_path: Path, slmodel: Any) -> None:
    """A config of a whole-process trace (--no-split, or from before) is checked from
    the first op: the set-up's ops are counted per step, as they always were."""
    whole = traced(tmp_path / "w", "w", lambda: slmodel.train(steps=2), split=False)
    config = run_dir(tmp_path, whole) / "w_callsite_instrumentation.yaml"
    assert "phases" not in load_config(config)["meta"]
    with guarded(config, report_dir=tmp_path / "g", rank=0, whole_run=True) as guard:
        slmodel.train(steps=2)
    document = load_report(guard.written or tmp_path)
    assert document["violations"] == [] and document["checked_steps"] == 3
    with guarded(config, report_dir=tmp_path / "g6", rank=0, whole_run=True) as guard:
        slmodel.train(steps=6)
    drift = {v["target"] for v in load_report(guard.written or tmp_path)["violations"]}
    assert "slmodel:Net.__init__" in drift  # built once, compared per step


#: a bug injected into the loop -> (kind, target, op) that check and guard must report
#: as an error
BUGS: dict[str, tuple[dict[str, Any], tuple[str, str, str]]] = {
    "added op": ({"extra_from": 1}, ("unexpected_op", "slmodel:Net.forward", "aten::sigmoid")),
    "removed op": ({"relu": False}, ("missing_op", "slmodel:Net.forward", "aten::relu")),
    "swapped optimizer": (
        {"optimizer": "sgd"},
        ("missing", "torch.optim.adam:_single_tensor_adam", ""),
    ),
    "eval mode left on": (
        {"eval_mode": True},
        ("missing_op", "torch.nn.modules.batchnorm:_BatchNorm.forward", "aten::add_"),
    ),
    "model in float64": (
        {"dtype": "float64"},
        ("unexpected_dtype", "slmodel:Net.forward", ""),
    ),
}


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_bugs_in_the_loop_are_errors_in_check_and_guard(
    tmp_path: Path, slmodel: Any, bug: str
) -> None:
    """What a config of the loop ran in every step must run: an op added, an op or a
    function gone (a swapped optimizer, BatchNorm's running-stats update in eval
    mode), the model in another dtype, is an error naming the function, in check and
    in guard alike; the same
    program unchanged has none, at the config's step count and at another."""
    kwargs, wanted = BUGS[bug]
    if "dtype" in kwargs:
        kwargs = {**kwargs, "dtype": getattr(torch, kwargs["dtype"])}
    folder = tmp_path / "t"
    traced(folder, "m", lambda: slmodel.train(steps=3))
    config = run_dir(tmp_path, folder / "m_callsite_rank0.json") / "m_callsite_instrumentation.yaml"
    for steps in (3, 5):
        traced(folder, f"same{steps}", lambda steps=steps: slmodel.train(steps=steps))
        same = check(config, folder / f"same{steps}_callsite_rank0.json")
        assert same["violations"] == [], kinds(same)
    traced(folder, "x", lambda: slmodel.train(steps=4, **kwargs))
    report = check(config, folder / "x_callsite_rank0.json")
    errors = [(v["kind"], v["target"], v.get("op") or "") for v in report["violations"]
              if v["severity"] == "error"]  # fmt: skip
    assert wanted in errors, kinds(report)
    with guarded(config, report_dir=tmp_path / "g", rank=0, whole_run=True) as guard:
        slmodel.train(steps=4, **kwargs)
    document = load_report(guard.written or tmp_path)
    errors = [(v["kind"], v["target"], v.get("op") or "") for v in document["violations"]
              if v["severity"] == "error"]  # fmt: skip
    assert wanted in errors, document["violations"]


def test_with_two_optimizers_the_setup_ends_after_the_first_step_of_each(
    tmp_path: Path, slmodel: Any
) -> None:
    """A GAN: the discriminator's optimizer steps first, the generator's second. The
    set-up ends after the generator's first step (both optimizers' lazy state is the
    set-up's), so every loop step is alike: a 3-iteration config holds a 10-iteration
    run with nothing to say, in check and in the guard (before: a dozen count_drift
    warnings, the generator's first step counted in the loop)."""
    folder = tmp_path / "t"
    loop = traced(folder, "g", lambda: slmodel.train_gan(steps=3))
    setup = load_trace(folder / "g_setup_rank0.json").meta
    assert (setup["steps"], load_trace(loop).meta["steps"]) == (2, 4)
    config = run_dir(tmp_path, loop) / "g_callsite_instrumentation.yaml"
    traced(folder, "long", lambda: slmodel.train_gan(steps=10, seed=1))
    report = check(config, folder / "long_callsite_rank0.json")
    assert report["violations"] == [], kinds(report)
    with guarded(config, report_dir=tmp_path / "g", rank=0, whole_run=True) as guard:
        slmodel.train_gan(steps=10, seed=1)
    document = load_report(guard.written or tmp_path)
    assert document["violations"] == [] and document["steps"] == 20


def test_phases_survive_merge_and_projection(tmp_path: Path, slmodel: Any) -> None:
    folder = tmp_path / "t"
    traced(folder, "a", lambda: slmodel.train(steps=2))
    traced(folder, "b", lambda: slmodel.train(steps=3))
    inputs = [folder / f"{x}_{p}_rank0.json" for x in "ab" for p in ("callsite", "setup")]
    final = run_dir(tmp_path, *inputs) / "final_combined_instrumentation.yaml"
    config = load_config(final)
    assert config["meta"]["phases"] == {
        "a_callsite": "loop",
        "a_setup": "setup",
        "b_callsite": "loop",
        "b_setup": "setup",
    }
    mine = project(dict(config), ["b_callsite"])
    assert mine["meta"]["phases"] == {"b_callsite": "loop"}
    assert mine["meta"]["steps"] == {"b_callsite": 2}


def test_a_bad_phase_is_refused_in_one_line(tmp_path: Path, slmodel: Any) -> None:
    folder = tmp_path / "t"
    traced(folder, "a", lambda: slmodel.train(steps=2))
    config = run_dir(tmp_path, folder / "a_callsite_rank0.json") / "a_callsite_instrumentation.yaml"
    text = config.read_text()
    assert "phases: {a_callsite: loop}" in text
    config.write_text(text.replace("phases: {a_callsite: loop}", "phases: {a_callsite: warmup}"))
    with pytest.raises(InputError, match=r"meta\.phases must map sources to setup or loop"):
        load_config(config)


@pytest.mark.parametrize(
    ("raised", "reason"),
    [(RuntimeError, "exception"), (KeyboardInterrupt, "sigint"), (SystemExit, None)],
)
def test_a_block_left_by_an_exception_writes_a_trace_marked_partial(
    tmp_path: Path, raised: type[BaseException], reason: str | None
) -> None:
    """As ``opguard trace`` marks a process that died of one; ``sys.exit`` ends a
    complete record. The exception goes on."""
    with pytest.raises(raised), trace_callsites("blk", tmp_path, rank=0, split=False) as t:
        torch.ones(3) + 1
        raise raised()
    meta = load_trace(Path(str(t.written))).meta
    assert (meta.get("partial") or {}).get("reason") == reason
    if raised is RuntimeError:
        assert meta["partial"]["exception"] == "RuntimeError" and meta["partial"]["step"] == 0


def test_a_set_up_that_ended_is_written_complete_when_the_loop_is_not(tmp_path: Path) -> None:
    """A process that dies after its first step leaves its set-up whole: only the loop's
    file is marked partial, so check compares the set-up's counts (before: both files
    said ``exception at step 3`` and the set-up's counts were skipped)."""
    w = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([w], lr=0.1)
    with pytest.raises(RuntimeError), trace_callsites("die", tmp_path, rank=0) as t:
        for _ in range(3):
            (w * 2).sum().backward()
            opt.step()
        raise RuntimeError("collective failed")
    loop = load_trace(Path(str(t.written))).meta
    setup = load_trace(tmp_path / "die_setup_rank0.json").meta
    assert (loop["phase"], loop["partial"]["reason"]) == ("loop", "exception")
    assert (setup["phase"], setup["steps"], setup.get("partial")) == ("setup", 1, None)


def test_the_split_env_variable_is_no_split(tmp_path: Path) -> None:
    """``$OPGUARD_TRACE_SPLIT=0`` is ``opguard trace --no-split`` (tracing.md): one file
    (the command line once set the variable back to 1 for the program)."""
    import os
    import subprocess
    import sys

    program = tmp_path / "two_steps.py"
    program.write_text(
        "import torch\n"
        "model = torch.nn.Linear(2, 2)\n"
        "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for _ in range(2):\n"
        "    optimizer.zero_grad()\n"
        "    model(torch.ones(1, 2)).sum().backward()\n"
        "    optimizer.step()\n"
    )
    out = tmp_path / "traces"
    result = subprocess.run(
        [sys.executable, "-m", "opguard_core.cli.app", "trace", "--label", "s",
         "--output-dir", str(out), "--", sys.executable, str(program)],
        env={**os.environ, "OPGUARD_TRACE_SPLIT": "0"}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert sorted(p.name for p in out.glob("*.json")) == ["s_callsite_rank0.json"]
    assert load_trace(out / "s_callsite_rank0.json").meta["steps"] == 2


def test_a_function_too_small_to_be_an_entry_in_a_longer_run_did_not_never_run(
    tmp_path: Path, slmodel: Any
) -> None:
    """An entry of every loop step (``log``, a few ops a step) and one run once after
    the loop with as many ops as the config has steps (``finish``, as a final barrier
    or save): at more steps both fall below the longer run's pruning threshold, and
    were a ``missing`` error, "never ran", in check and in guard, though both ran.
    They are a warning that says so; a function that is gone is still the error."""
    folder = tmp_path / "t"
    loop = traced(folder, "c", lambda: slmodel.train_logged(steps=3))
    out = tmp_path / "run"
    result = invoke("run", "-i", loop, "--output-base", out, "--min-fraction", "0.044")
    assert result.exit_code == 0, result.stderr
    config = Path(result.stdout.strip().splitlines()[-1]) / "c_callsite_instrumentation.yaml"
    targets = {e["target"] for e in load_config(config)["entries"]}
    assert {"slmodel:log", "slmodel:finish"} <= targets
    traced(folder, "long", lambda: slmodel.train_logged(steps=60))
    report = check(config, folder / "long_callsite_rank0.json")
    found = {(v["kind"], v["target"], v["severity"]) for v in report["violations"]}
    assert not [v for v in report["violations"] if v["severity"] == "error"], found
    assert ("missing", "slmodel:finish", "warning") in found
    with guarded(config, report_dir=tmp_path / "g", rank=0, whole_run=True) as guard:
        slmodel.train_logged(steps=60)
    document = load_report(guard.written or tmp_path)
    assert {(v["kind"], v["target"], v["severity"]) for v in document["violations"]} == found
    # gone for good: the error it was
    slmodel.log = lambda loss: None
    traced(folder, "gone", lambda: slmodel.train_logged(steps=60))
    report = check(config, folder / "gone_callsite_rank0.json")
    errors = {(v["kind"], v["target"]) for v in report["violations"] if v["severity"] == "error"}
    assert ("missing", "slmodel:log") in errors


def test_a_run_that_died_in_its_first_step_is_not_held_to_the_loop(
    tmp_path: Path, slmodel: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process that dies in its first step writes one trace (no phase: it is split
    at the end of that step), its set-up and part of a step. Against a config of the
    loop, check reported the set-up as 10 errors and 36 warnings (``aten::uniform_``
    inside ``main``, every ``__init__`` an ``unknown_target``) on a DDP job whose
    targets were int32; the guard checks nothing there. Such a rank is now said not to
    be compared; where no rank is left, nothing was compared, which is no pass (1)."""
    loop = traced(tmp_path / "t", "a", lambda: slmodel.train(steps=3))
    config = run_dir(tmp_path, loop) / "a_callsite_instrumentation.yaml"
    good = traced(tmp_path / "j", "b", lambda: slmodel.train(steps=3))
    monkeypatch.setattr(slmodel, "batch", lambda dtype=None: torch.randn(2, 5, 6, 6))
    with pytest.raises(RuntimeError), trace_callsites("b", tmp_path / "j", rank=1) as t:
        slmodel.train(steps=3)  # 5 channels where the conv takes 3: dies in step 0
    died = Path(str(t.written))
    meta = load_trace(died).meta
    assert "phase" not in meta and meta["partial"]["step"] == 0
    alone = invoke("check", "--config", config, "-i", died, "--format", "json")
    report = json.loads(alone.stdout)
    assert alone.exit_code == 1 and report["violations"] == [], report["violations"]
    (note,) = [n for n in report["notes"] if "first step" in n]
    assert "nothing compared" in note and "rank 1: exception RuntimeError at step 0" in note
    both = invoke("check", "--config", config, "-i", good, "-i", died, "--format", "json")
    report = json.loads(both.stdout)
    assert both.exit_code == 0, report["violations"]
    assert all(1 not in v["ranks"] for v in report["violations"]), report["violations"]
    (note,) = [n for n in report["notes"] if "first step" in n]
    assert "not compared" in note and "nothing compared" not in note
