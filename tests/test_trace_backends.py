"""The tracer's backends (``modes``, ``profiler``): what each sees, torch.compile, memory,
and library/user tags by location (docs/tracing.md, docs/tags.md)."""

from __future__ import annotations

import collections
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from opguard_core.formats.config import load_config  # noqa: E402
from opguard_core.formats.trace import DecodedTrace, load_trace  # noqa: E402
from opguard_plugins.record.profiler import COMPILED_REGION_OP  # noqa: E402
from opguard_plugins.record.tracer import COMPILER_PARTS  # noqa: E402
from opguard_plugins.stages import locations  # noqa: E402
from opguard_plugins.stages.generate import tags_for  # noqa: E402
from opguard_plugins.tracer import trace_callsites  # noqa: E402

pytestmark = pytest.mark.torch

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
OPGUARD = [sys.executable, "-m", "opguard_core.cli.app"]


@pytest.fixture
def loops(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import loops

    return loops


def traced(tmp_path: Path, backend: str, body: Callable[[], object]) -> DecodedTrace:
    torch.manual_seed(0)
    # the whole block in one file (these tests look at what each backend sees)
    with trace_callsites("t", tmp_path / backend, rank=0, backend=backend, split=False) as tracer:
        body()
    assert tracer.written is not None
    return load_trace(tracer.written)


def op_counts(trace: DecodedTrace) -> collections.Counter[str]:
    counts: collections.Counter[str] = collections.Counter()
    for site in trace.callsites:
        counts[site.op] += site.count
    return counts


def qualnames_of(trace: DecodedTrace, op: str) -> set[str]:
    return {trace.frames[i].qualname for s in trace.callsites if s.op == op for i in s.stack}


# ---------------------------------------------------------------------------
# what each backend sees
# ---------------------------------------------------------------------------


@pytest.mark.profiler
def test_fused_transformer_encoder_layer(tmp_path: Path) -> None:
    """The profiler sees the fused inference path; under modes torch takes the slow path."""
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True).eval()
    x = torch.randn(2, 5, 16)

    def run() -> None:
        with torch.inference_mode():
            layer(x)

    profiler, modes = (
        op_counts(traced(tmp_path, "profiler", run)),
        op_counts(traced(tmp_path, "modes", run)),
    )
    assert profiler == {"aten::_transformer_encoder_layer_fwd": 1}
    assert "aten::_transformer_encoder_layer_fwd" not in modes
    assert {"aten::scaled_dot_product_attention", "aten::linear", "aten::layer_norm"} <= set(modes)
    assert sum(modes.values()) > 10


@pytest.mark.profiler
def test_composite_ops_outermost_vs_decomposed(tmp_path: Path) -> None:
    """The profiler counts the op the program called, modes what it decomposed into."""
    x = torch.randn(4, 6)

    def run() -> None:
        x.t().reshape(24)  # a copy: reshape decomposes into clone + _unsafe_view

    profiler, modes = (
        op_counts(traced(tmp_path, "profiler", run)),
        op_counts(traced(tmp_path, "modes", run)),
    )
    assert profiler == {"aten::t": 1, "aten::reshape": 1}
    assert modes == {"aten::t": 1, "aten::clone": 1, "aten::_unsafe_view": 1}


@pytest.mark.profiler
def test_ops_from_cpp_below_python_are_seen_only_by_the_profiler(tmp_path: Path) -> None:
    """nn.Parameter creation detaches in C++ below the Python dispatch key."""

    def run() -> None:
        torch.nn.Parameter(torch.zeros(3))

    profiler, modes = (
        op_counts(traced(tmp_path, "profiler", run)),
        op_counts(traced(tmp_path, "modes", run)),
    )
    assert profiler["aten::detach"] == 1
    assert "aten::detach" not in modes
    assert profiler["aten::zeros"] == modes["aten::zeros"] == 1


@pytest.mark.profiler
def test_in_place_ops_and_gradient_accumulation(tmp_path: Path) -> None:
    xs = [torch.randn(2, 4) for _ in range(2)]

    for backend in ("profiler", "modes"):
        lin = torch.nn.Linear(4, 4)

        def run(lin: Any = lin) -> None:
            for x in xs:  # the second backward accumulates into .grad
                lin(x).sum().backward()
            lin.weight.data.mul_(0.5)

        counts = op_counts(traced(tmp_path, backend, run))
        assert counts["aten::add_"] == 2, backend  # weight and bias, second micro-batch
        assert counts["aten::mul_"] == 1, backend
        assert counts["aten::sum"] == 4, backend  # two losses, two bias gradients


@pytest.mark.profiler
def test_profiler_stacks_on_transformers_style_and_checkpointed_models(
    tmp_path: Path, loops: Any
) -> None:
    hf_step = loops.hf_style_loop()
    trace = traced(tmp_path, "profiler", lambda: hf_step())
    counts = op_counts(trace)
    assert counts["aten::softmax"] == 2  # two layers
    assert {"HFSelfAttention.forward", "HFLayer.forward", "HFStyleModel.forward"} <= (
        qualnames_of(trace, "aten::softmax")
    )
    assert counts["aten::_softmax_backward_data"] == 2
    assert "Tensor.backward" in qualnames_of(trace, "aten::_softmax_backward_data")
    frames = {(f.qualname, f.module) for f in trace.frames}
    assert ("HFSelfAttention.split_heads", "loops") in frames

    ck_step = loops.checkpointed_loop()
    trace = traced(tmp_path, "profiler", lambda: ck_step())
    counts = op_counts(trace)
    blocks = 3
    # forward and the checkpoint's recomputation during backward
    assert counts["aten::tanh"] == 2 * blocks
    backward_tanh = [
        s
        for s in trace.callsites
        if s.op == "aten::tanh" and "Tensor.backward" in {trace.frames[i].qualname for i in s.stack}
    ]
    assert sum(s.count for s in backward_tanh) == blocks
    assert "ScaledTanh.forward" in qualnames_of(trace, "aten::tanh")
    assert "ScaledTanh.backward" in {f.qualname for f in trace.frames}


@pytest.mark.slow  # ~15 s: a traced subprocess with the profiler
def test_trace_command_profiler_backend(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            *OPGUARD,
            *("trace", "--backend", "profiler", "--label", "p", "--output-dir", str(tmp_path)),
            *("--", str(EXAMPLES / "train_single.py"), "--steps", "2"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    trace = load_trace(tmp_path / "p_callsite_rank0.json")
    assert trace.meta["tracer_backend"] == "profiler"
    assert {"TinyGPT.forward", "Block.forward", "train_step", "main"} <= qualnames_of(
        trace, "aten::linear"
    )
    assert all(site.api is None and site.stream == 0 for site in trace.callsites)
    assert {site.role for site in trace.callsites} == {"compute"}
    bad = subprocess.run(
        [*OPGUARD, "trace", "--backend", "nope", "--", "true"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "nope" in bad.stderr


_SCRIPT = """
import torch


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.lin(x)) * torch.sigmoid(x)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.Sequential(Block(), Block())

    def forward(self, x):
        return self.blocks(x).sum()

    @torch.no_grad()
    def score(self, x):
        return self.forward(x).abs()


def main():
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    for _ in range(3):
        opt.zero_grad()
        net(x).backward()
        opt.step()
    net.score(x)


if __name__ == "__main__":
    main()
"""


@pytest.mark.slow  # ~25 s: the script traced by each backend, then a run of each trace
def test_both_backends_name_a_scripts_functions_alike(tmp_path: Path) -> None:
    """A model written in the script run as ``python net.py`` (``__main__``): both
    backends give its functions and methods, a decorated one too, the same frames
    and so the same config targets; both record the optimizer steps and themselves."""
    script = tmp_path / "net.py"
    script.write_text(_SCRIPT)
    names: dict[str, set[tuple[str | None, str]]] = {}
    targets: dict[str, set[str]] = {}
    for backend in ("modes", "profiler"):
        out = tmp_path / backend
        proc = subprocess.run(
            [
                *(*OPGUARD, "trace", "--backend", backend, "--label", "net"),
                *("--output-dir", str(out), "--", str(script)),
            ],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,
        )
        assert proc.returncode == 0, proc.stderr
        trace = load_trace(out / "net_callsite_rank0.json")
        assert trace.meta["tracer_backend"] == backend
        # both split the set-up (up to the end of the first step) from the loop
        setup = load_trace(out / "net_setup_rank0.json")
        assert (trace.meta["phase"], trace.meta["steps"]) == ("loop", 2)
        assert (setup.meta["phase"], setup.meta["steps"]) == ("setup", 1)
        names[backend] = {(f.module, f.qualname) for f in trace.frames if f.file == "net.py"}
        run = subprocess.run(
            [
                *(*OPGUARD, "run", "-i", str(out / "net_callsite_rank*.json")),
                *("--output-base", str(tmp_path / f"run_{backend}")),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stderr
        config = load_config(
            Path(run.stdout.strip().splitlines()[-1]) / "net_callsite_instrumentation.yaml"
        )
        assert list(config["meta"]["recorded_by"]) == [backend]
        targets[backend] = {e["target"] for e in config["entries"] if e["target"].startswith("net")}
    own = {("net", q) for q in ("Block.forward", "Net.forward", "Net.score", "main")}
    assert own <= names["modes"], names["modes"]
    assert names["profiler"] == names["modes"]
    assert {"net:Block.forward", "net:Net.forward", "net:main"} <= targets["modes"]
    assert targets["profiler"] == targets["modes"]


# ---------------------------------------------------------------------------
# torch.compile
# ---------------------------------------------------------------------------


def _compiled_run(backend: str, compile_backend: str, tmp_path: Path) -> tuple[DecodedTrace, int]:
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    compiled = torch.compile(model, backend=compile_backend)
    x = torch.randn(4, 8)

    def run() -> None:
        for _ in range(2):
            compiled(x).sum().backward()

    trace = traced(tmp_path, backend, run)
    return trace, int(counters["stats"]["unique_graphs"])


def assert_no_compile_time_work(trace: DecodedTrace) -> None:
    """No frame of torch.compile compiling, none of code generated at run time."""
    compiler = {"/".join(("torch", *parts)) for parts in COMPILER_PARTS}
    files = {frame.file for frame in trace.frames}
    assert not files & compiler, files & compiler
    generated = {f for f in files if f.startswith("<eval_with_key>") or "torchinductor_" in f}
    assert not generated, generated
    assert not {f.qualname for f in trace.frames if "bw_compiler" in f.qualname}


@pytest.mark.profiler
@pytest.mark.slow
def test_torch_compile_compiles_under_the_profiler_backend(tmp_path: Path) -> None:
    trace, graphs = _compiled_run("profiler", "aot_eager", tmp_path)
    assert graphs >= 1
    counts = op_counts(trace)
    assert counts[COMPILED_REGION_OP] == 2
    # the graphs' ops (aot_eager runs them as aten ops; its backward recomputes gelu)
    assert counts["aten::addmm"] == 4 and counts["aten::gelu"] >= 2
    # compile-time work is left out, counted in meta (FX's <eval_with_key> frames of
    # the graphs that run are dropped, their ops kept)
    assert trace.meta["compile_ops"] > 0
    assert_no_compile_time_work(trace)
    # the modes backend compiles too (its dispatch mode ignores compile internals, its
    # function mode is taken off while Dynamo traces): the graph's aten ops, no
    # compile-time op at all, no region marker (that is the profiler's event)
    trace, graphs = _compiled_run("modes", "aot_eager", tmp_path)
    assert graphs == 1
    counts = op_counts(trace)
    assert COMPILED_REGION_OP not in counts
    assert counts["aten::addmm"] == 4 and counts["aten::gelu"] == 2
    assert "compile_ops" not in trace.meta
    assert_no_compile_time_work(trace)


@pytest.mark.slow
def test_torch_compile_inductor_compiles_under_the_modes_backend_and_the_guard(
    tmp_path: Path,
) -> None:
    """Inductor compiles under the modes tracer and under the guard, which check the
    compiled code's ops (its extern kernels; fused ones are no ops) against a config
    of the same compiled program: no violation."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from opguard_core.formats.check import load_report
    from opguard_plugins.enforce.runtime import guarded

    trace, graphs = _compiled_run("modes", "inductor", tmp_path)
    assert graphs == 1
    counts = op_counts(trace)
    assert counts["aten::addmm"] == 4 and "aten::gelu" not in counts  # fused
    assert_no_compile_time_work(trace)
    result = subprocess.run(
        [*OPGUARD, "run", "-i", str(tmp_path / "modes" / "t_callsite_rank0.json"),
         "--output-base", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    config = Path(result.stdout.strip().splitlines()[-1]) / "t_callsite_instrumentation.yaml"
    torch._dynamo.reset()
    counters.clear()
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    compiled = torch.compile(model, backend="inductor")
    with guarded(config, report_dir=tmp_path / "g", rank=0) as guard:
        for _ in range(2):
            compiled(torch.randn(4, 8)).sum().backward()
    assert int(counters["stats"]["unique_graphs"]) == 1
    assert guard.checked_ops > 0
    document = load_report(guard.written or tmp_path)
    assert document["errors"] == 0, document["violations"]


@pytest.mark.profiler
@pytest.mark.slow
def test_torch_compile_inductor_under_the_profiler_backend(tmp_path: Path) -> None:
    trace, graphs = _compiled_run("profiler", "inductor", tmp_path)
    assert graphs >= 1
    counts = op_counts(trace)
    assert counts[COMPILED_REGION_OP] == 2
    assert counts["aten::addmm"] >= 4  # extern kernels the generated code calls
    assert "aten::gelu" not in counts  # fused into Inductor's own C++ kernel
    # compiling (the forward under Dynamo, the backward lazily at the first backward
    # pass) is left out; the hash-named generated module is no frame, so no target
    assert trace.meta["compile_ops"] > 0
    assert_no_compile_time_work(trace)
    # the backward's extern kernels, 3 a run (2 weight gradients, 1 input gradient);
    # the one the backward's compilation ran is not among them
    assert counts["aten::mm"] == 3 * 2


_FAKE_COMPILER = """
import torch


def compile_me(x):
    return torch.ones(3) * x.sum()
"""


@pytest.mark.profiler
@pytest.mark.parametrize("backend", ["modes", "profiler"])
def test_the_compile_rule_is_the_same_in_both_backends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    """Both backends leave out the ops below a compiler frame, by one list of files
    (torch.compile itself compiles only under the profiler backend: a stand-in file
    joins the list here), and count them in ``meta.compile_ops``."""
    from opguard_plugins.record import profiler, tracer

    source = tmp_path / "fake_compiler_h29.py"
    source.write_text(_FAKE_COMPILER)
    monkeypatch.syspath_prepend(str(tmp_path))
    import fake_compiler_h29

    monkeypatch.setattr(
        tracer, "COMPILER_FILES", tracer.COMPILER_FILES | {os.path.normcase(str(source))}
    )
    monkeypatch.setattr(profiler, "_COMPILER_FILES", (*profiler._COMPILER_FILES, source.name))
    x = torch.ones(2)

    def run() -> None:
        fake_compiler_h29.compile_me(x)
        torch.relu(x)

    trace = traced(tmp_path, backend, run)
    counts = op_counts(trace)
    assert trace.meta["compile_ops"] == 3  # ones, sum, mul
    assert counts == {"aten::relu": 1}
    assert "compile_me" not in {f.qualname for f in trace.frames}


# ---------------------------------------------------------------------------
# memory over a long run
# ---------------------------------------------------------------------------


def _rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.profiler
@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")
@pytest.mark.parametrize("backend", ["modes", "profiler"])
def test_memory_is_flat_over_10000_steps(
    tmp_path: Path, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from opguard_plugins.record import profiler
    from opguard_plugins.record.backends import make_tracer

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 8)
    tracer = make_tracer(backend, "m", tmp_path, rank=0)
    folds = 0
    if backend == "profiler":
        # A cycle of 0.5 s held as many steps' events as the machine ran in 0.5 s:
        # 1,000-2,000 steps, 500-800 MiB, and the size of the cycle that happened to
        # be held at the two readings was the "growth" (+107 and +207 MiB on a machine
        # where it had passed hours before). On a clock that ticks 10 ms a reading (one
        # reading a step), a cycle is 50 steps whatever the machine: 180 folds in the
        # 9,000 steps measured, so what a fold failed to release would add up.
        ticks = iter(range(1 << 62))
        clock = type("Clock", (), {"monotonic": staticmethod(lambda: next(ticks) * 0.01)})
        monkeypatch.setattr(profiler, "time", clock)
        tracer.fold_seconds = 0.5  # type: ignore[attr-defined]
        fold = tracer.recorder.fold  # type: ignore[attr-defined]

        def counted_fold(roots: list[Any], first_step: int = 0) -> None:
            nonlocal folds
            folds += 1
            fold(roots, first_step)

        tracer.recorder.fold = counted_fold  # type: ignore[attr-defined]
    # The baseline is taken after the first 1,000 steps and, for the profiler backend,
    # after its second fold: on a fast machine 1,000 steps take less than one cycle, and
    # the profiler's buffers of the first cycle are not "the first steps" settled.
    baseline: tuple[int, int] | None = None
    final = 0
    tracer.start()
    try:
        step = 0
        while baseline is None or step < baseline[0] + 9_000:
            step += 1
            optimizer.zero_grad()
            model(x).sum().backward()
            optimizer.step()
            settled = backend != "profiler" or folds >= 2
            if baseline is None and step >= 1_000 and settled:
                baseline = (step, _rss_bytes())
                sites = len(tracer.recorder.counts)
        final = _rss_bytes()
    finally:
        tracer.stop()
    assert baseline is not None
    growth = final - baseline[1]
    print(
        f"{backend}: RSS {baseline[1] / 2**20:.1f} (step {baseline[0]}) -> {final / 2**20:.1f} MiB"
    )
    assert growth < 8 * 2**20, f"{backend} grew {growth / 2**20:.1f} MiB over 9,000 steps"
    assert len(tracer.recorder.counts) == sites
    assert sum(tracer.recorder.counts.values()) > 10_000


def _profiled_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, steps: int, fail: set[int] = frozenset()
) -> tuple[Any, list[int]]:
    """``steps`` steps of a small loop under the profiler backend, on a clock of 10 ms a
    reading (one reading a step: a cycle of 0.5 s is 50 steps); the ops each fold
    counted (the folds numbered in ``fail`` raise, as torch's profiler can:
    ``IndexError`` out of ``_disable_profiler``)."""
    from opguard_plugins.record import profiler
    from opguard_plugins.record.backends import make_tracer

    ticks = iter(range(1 << 62))
    clock = type("Clock", (), {"monotonic": staticmethod(lambda: next(ticks) * 0.01)})
    monkeypatch.setattr(profiler, "time", clock)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 8)
    tracer = make_tracer("profiler", "m", tmp_path, rank=0)
    tracer.fold_seconds = 0.5  # type: ignore[attr-defined]
    fold, folded = tracer.recorder.fold, []

    def counted_fold(roots: list[Any], first_step: int = 0) -> None:
        if len(folded) in fail:
            folded.append(0)
            raise IndexError("Argument passed to at() was not in the map.")
        before = sum(tracer.recorder.counts.values())
        fold(roots, first_step)
        folded.append(sum(tracer.recorder.counts.values()) - before)

    tracer.recorder.fold = counted_fold
    tracer.start()
    try:
        for _ in range(steps):
            optimizer.zero_grad()
            model(x).sum().backward()
            optimizer.step()
    finally:
        tracer.stop()
    return tracer, folded


@pytest.mark.profiler
def test_a_lost_profiler_cycle_does_not_end_the_program(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """torch's profiler raised out of its stop once in a few thousand cycles (``IndexError:
    Argument passed to at() was not in the map.``), inside the program's
    ``optimizer.step()``: the training ended with a traceback. The cycle is lost, said
    on stderr, and the next one starts."""
    tracer, folded = _profiled_loop(tmp_path, monkeypatch, 300, fail={2})
    assert tracer.lost_cycles == 1 and len(folded) > 3 and min(folded[3:]) > 0
    err = capfd.readouterr().err
    assert "opguard trace: a profiler cycle was lost at step" in err
    assert "IndexError: Argument passed to at() was not in the map." in err


# ---------------------------------------------------------------------------
# library / user by location
# ---------------------------------------------------------------------------


def test_library_or_user_by_location(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "myproject_mod15"
    package.mkdir()
    (package / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    import pluggy  # installed: under site-packages, and on no list

    assert locations.is_library_path(pluggy.__file__)
    assert "library" in tags_for("pluggy._hooks:HookCaller.__call__", "method", {})
    assert "library" in tags_for("json.decoder:JSONDecoder.decode", "method", {})
    assert "user" in tags_for("myproject_mod15.model:Net.forward", "method", {})
    assert "user" in tags_for("not_installed_anywhere_15:f", "function", {})
    # the fixed list is an override: library even where it is not installed
    assert "library" in tags_for("deepspeed.runtime.engine:DeepSpeedEngine.forward", "method", {})
    monkeypatch.setenv("OPGUARD_USER_PACKAGES", "pluggy")
    assert "user" in tags_for("pluggy._hooks:HookCaller.__call__", "method", {})
    monkeypatch.setenv("OPGUARD_LIBRARY_PACKAGES", "myproject_mod15")
    assert "library" in tags_for("myproject_mod15.model:Net.forward", "method", {})


# ---------------------------------------------------------------------------
# the profiler backend started for a whole process
# ---------------------------------------------------------------------------


@pytest.mark.profiler
@pytest.mark.slow
def test_a_whole_process_profiler_starts_at_the_first_torch_call(tmp_path: Path) -> None:
    """Started at ``import torch`` (``start_at_first_call``), the profiler waits for the
    program's first torch call, so the imports and Python work before it are not in
    its first cycle; the first-call mode is gone after the first optimizer step; and
    the trace counts what a profiler started at once counts."""
    from torch.autograd import _profiler_enabled
    from torch.overrides import _get_current_function_mode_stack as function_modes

    from opguard_plugins.record.profiler import ProfilerTracer

    def program() -> None:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            model(torch.ones(2, 4)).relu().sum().backward()
            optimizer.step()

    traces = []
    for first_call in (True, False):
        tracer = ProfilerTracer("p", tmp_path / str(first_call), rank=0)
        tracer.start_at_first_call = first_call
        tracer.split_setup = False  # the whole block in one file
        tracer.start()
        try:
            assert _profiler_enabled() != first_call
            sorted(str(i) for i in range(1000))  # Python work before any torch call
            assert _profiler_enabled() != first_call
            program()
            assert _profiler_enabled() and not function_modes()
        finally:
            tracer.stop()
        assert not _profiler_enabled()
        tracer.write()
        assert tracer.written is not None
        traces.append(load_trace(tracer.written))
    assert op_counts(traces[0]) == op_counts(traces[1])
    assert op_counts(traces[0])["aten::relu"] == 3
    assert traces[0].meta["steps"] == 3


@pytest.mark.profiler
def test_a_whole_process_profiler_that_never_sees_a_torch_call_stops_cleanly(
    tmp_path: Path,
) -> None:
    from torch.autograd import _profiler_enabled
    from torch.overrides import _get_current_function_mode_stack as function_modes

    from opguard_plugins.record.profiler import ProfilerTracer

    tracer = ProfilerTracer("q", tmp_path, rank=0)
    tracer.start_at_first_call = True
    tracer.start()
    tracer.fold()  # a flush before the first call folds nothing
    tracer.stop()
    assert not _profiler_enabled() and not function_modes()
    assert not tracer.recorder.counts


COMPILED_PROGRAM = """
import torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
compiled = torch.compile(model, backend="aot_eager")
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    compiled(torch.randn(4, 8)).sum().backward()
    optimizer.step()
"""


@pytest.mark.slow
def test_opguard_trace_with_the_profiler_compiles_from_the_first_call(tmp_path: Path) -> None:
    """``opguard trace --backend profiler`` (the profiler waits for the first torch
    call): a module compiled before the first step still compiles, its regions and
    its model building are in the trace."""
    program = tmp_path / "compiled.py"
    program.write_text(COMPILED_PROGRAM)
    out = tmp_path / "traces"
    result = subprocess.run(
        [*OPGUARD, "trace", "--backend", "profiler", "--label", "c", "--output-dir", str(out),
         "--no-split", "--", sys.executable, str(program)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    trace = load_trace(out / "c_callsite_rank0.json")
    counts = op_counts(trace)
    assert counts[COMPILED_REGION_OP] == 2, counts
    assert trace.meta["steps"] == 2
    # model building ran before any step, after the first torch call: recorded
    assert counts["aten::uniform_"] >= 4 or counts["aten::kaiming_uniform_"] >= 2, counts
