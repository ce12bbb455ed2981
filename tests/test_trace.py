"""The callsite tracer (``opguard trace`` and ``trace_callsites``) on real torch programs.

These tests need torch (the ``.[trace]`` extra) and are skipped cleanly without it.
They check real captured content: ops, apis, stacks (forward and backward), the
format contract, a 2-rank DDP run with collectives, and the pipeline end to end.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from ruamel.yaml import YAML  # noqa: E402

from opguard_core.formats.trace import DecodedTrace, load_trace  # noqa: E402
from opguard_plugins.record.tracer import CallsiteTracer, api_name, op_name  # noqa: E402
from opguard_plugins.tracer import trace_callsites  # noqa: E402

# traced torch programs take tens of seconds: the slow group (README, .ci/run)
pytestmark = [pytest.mark.torch, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
OPGUARD = [sys.executable, "-m", "opguard_core.cli.app"]


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def _stack(trace: DecodedTrace, site: Any) -> list[Any]:
    return [trace.frames[i] for i in site.stack]


def _qualnames(trace: DecodedTrace, site: Any) -> list[str]:
    return [frame.qualname for frame in _stack(trace, site)]


def _sites(trace: DecodedTrace, op: str) -> list[Any]:
    return [site for site in trace.callsites if site.op == op]


def _run_backward(loss: Any) -> None:
    """A named caller of ``.backward()`` that backward ops must be attributed to."""
    loss.backward()


@pytest.fixture
def tiny_gpt(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import tiny_gpt

    return tiny_gpt


@pytest.fixture
def one_step_trace(tmp_path: Path, tiny_gpt: Any) -> DecodedTrace:
    """A trace of one training step of the tiny GPT, recorded in-process."""
    torch.manual_seed(0)
    config = tiny_gpt.GPTConfig()
    model = tiny_gpt.TinyGPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx, targets = tiny_gpt.make_batch(0, config)
    # one file: a one-step trace is all set-up (docs/tracing.md, "Set-up and loop")
    with trace_callsites(label="unit", output_dir=tmp_path, rank=0, split=False) as tracer:
        optimizer.zero_grad()
        _, loss = model(idx, targets)
        _run_backward(loss)
        optimizer.step()
    assert tracer.written == tmp_path / "unit_callsite_rank0.json"
    return load_trace(tracer.written)


def _traced_env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["OPGUARD_TRACE_OUTPUT_BASE"] = str(tmp_path / "runs")
    env.pop("OPGUARD_DISABLE_PLUGINS", None)
    return env


# ---------------------------------------------------------------------------
# in-process: the context manager
# ---------------------------------------------------------------------------


def test_forward_ops_apis_and_model_stack(one_step_trace: DecodedTrace) -> None:
    trace = one_step_trace
    ops = {site.op for site in trace.callsites}
    assert {"aten::embedding", "aten::native_layer_norm", "aten::gelu"} <= ops
    assert ops & {"aten::addmm", "aten::mm"}
    assert all("." not in op.split("::", 1)[1] for op in ops), "overload suffix left in"

    linear = [s for s in _sites(trace, "aten::addmm") if s.api == "torch.nn.functional.linear"]
    assert linear, "F.linear -> aten::addmm not captured"
    attention = [s for s in linear if "CausalSelfAttention.forward" in _qualnames(trace, s)]
    assert attention
    frames = _stack(trace, attention[0])
    model_frames = [f for f in frames if f.module == "tiny_gpt"]
    assert [f.qualname for f in model_frames][-3:] == [
        "TinyGPT.forward",
        "Block.forward",
        "CausalSelfAttention.forward",
    ]
    assert frames[-1].qualname == "Linear.forward"  # innermost: the code that called torch
    assert frames[-1].file == "torch/nn/modules/linear.py"
    # outermost first: this test function comes before the model's frames
    names = [f.qualname for f in frames]
    assert names.index("one_step_trace") < names.index("TinyGPT.forward")

    apis = {site.api for site in trace.callsites}
    assert {"torch.nn.functional.embedding", "Tensor.backward"} <= apis


def test_backward_ops_attributed_to_backward_caller(one_step_trace: DecodedTrace) -> None:
    trace = one_step_trace
    backward = [s for s in trace.callsites if s.op.endswith("_backward")]
    assert {s.op for s in backward} >= {"aten::gelu_backward", "aten::native_layer_norm_backward"}
    for site in backward:
        assert site.api == "Tensor.backward"
        frames = _stack(trace, site)
        callers = [f for f in frames if f.qualname == "_run_backward"]
        assert callers and callers[0].module == __name__
        assert any(f.qualname == "Tensor.backward" for f in frames)


def test_format_contract_and_relative_paths(one_step_trace: DecodedTrace) -> None:
    trace = one_step_trace
    meta = trace.meta
    assert meta["label"] == "unit" and meta["rank"] == 0 and meta["ranks"] == [0]
    assert meta["world_size"] == 1 and meta["device"] == "cpu"
    assert meta["tracer"] == "opguard/3" and meta["tracer_backend"] == "modes"
    assert meta["torch_version"] == str(torch.__version__)
    assert {"command", "python_version"} <= meta.keys()
    assert trace.ranks() == [0]
    assert all(site.stream == 0 and site.count >= 1 for site in trace.callsites)
    # on CPU every op is on the default stream: compute (a collective would be comm)
    assert {site.role for site in trace.callsites} == {"compute"}
    assert meta["streams"] == {"0": "compute"}
    keys = [(tuple(s.stack), s.api, s.op, s.stream) for s in trace.callsites]
    assert len(keys) == len(set(keys)), "identical callsites must be counted, not repeated"
    assert len(set(trace.frames)) == len(trace.frames), "frames must be interned"
    for frame in trace.frames:
        assert not os.path.isabs(frame.file), frame
        assert frame.file != "torch/overrides.py"
        assert frame.file != "torch/utils/_python_dispatch.py"
        assert frame.module != "opguard_plugins.record.tracer"
    files = {frame.file for frame in trace.frames}
    assert "torch/nn/modules/module.py" in files
    assert "tiny_gpt.py" in files or "examples/tiny_gpt.py" in files


def test_identical_callsites_are_counted(tmp_path: Path) -> None:
    a = torch.ones(4, 4)
    with trace_callsites(label="count", output_dir=tmp_path) as tracer:
        for _ in range(5):
            torch.mm(a, a)
    trace = load_trace(tracer.written)
    mm = _sites(trace, "aten::mm")
    assert len(mm) == 1
    assert mm[0].count == 5 and mm[0].api == "torch.mm"
    assert _stack(trace, mm[0])[-1].qualname == "test_identical_callsites_are_counted"


def test_ops_on_autograd_threads_use_the_backward_stack(tmp_path: Path) -> None:
    """An op seen on another thread while a backward runs gets the .backward() stack."""
    tracer = CallsiteTracer("threads", tmp_path, rank=0)
    recorder = tracer.recorder

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any) -> Any:
            return x * 2

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            def engine_thread_op() -> None:
                recorder.record(torch.ops.aten.sigmoid.default, sys._getframe())

            worker = threading.Thread(target=engine_thread_op)
            worker.start()
            worker.join()
            return grad * 2

    x = torch.ones(3, requires_grad=True)
    tracer.start()
    try:
        y = Probe.apply(x).sum()
        _run_backward(y)
    finally:
        tracer.stop()
    trace = load_trace(tracer.write())
    [site] = _sites(trace, "aten::sigmoid")
    assert site.api == "Tensor.backward"
    names = _qualnames(trace, site)
    assert "_run_backward" in names
    assert names[-1].endswith("engine_thread_op")


def test_names() -> None:
    import torch.distributed as dist
    import torch.nn.functional as F

    assert api_name(F.linear) == "torch.nn.functional.linear"
    assert api_name(torch.cat) == "torch.cat"
    assert api_name(torch.Tensor.reshape) == "Tensor.reshape"
    assert api_name(torch.Tensor.backward) == "Tensor.backward"
    assert api_name(torch.Tensor.shape.__get__) == "Tensor.shape"
    assert api_name(dist.all_reduce) == "torch.distributed.all_reduce"
    assert op_name(torch.ops.aten.add.Tensor) == "aten::add"
    assert op_name(torch.ops.aten.addmm.default) == "aten::addmm"


# ---------------------------------------------------------------------------
# `opguard trace` in subprocesses
# ---------------------------------------------------------------------------


def test_trace_command_exit_code_and_chained_sitecustomize(tmp_path: Path) -> None:
    existing = tmp_path / "existing"
    existing.mkdir()
    marker = tmp_path / "marker"
    (existing / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').write('chained')\n")
    script = tmp_path / "prog.py"
    script.write_text(
        "import sys\nimport torch\n\n\ndef work():\n    torch.ones(2) + 1\n\n\n"
        "work()\nsys.exit(3)\n"
    )
    env = _traced_env(tmp_path)
    env["PYTHONPATH"] = str(existing)
    out = tmp_path / "traces"
    proc = subprocess.run(
        [*OPGUARD, "trace", "--label", "prog", "--output-dir", str(out), "--", str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 3, proc.stderr
    assert marker.read_text() == "chained"
    assert "wrote 1 trace file(s)" in proc.stderr
    trace = load_trace(out / "prog_callsite_rank0.json")
    [add] = _sites(trace, "aten::add")
    assert add.api == "Tensor.add"
    frames = _stack(trace, add)
    assert [(f.file, f.module, f.qualname) for f in frames] == [
        ("prog.py", "prog", "<module>"),
        ("prog.py", "prog", "work"),
    ]
    assert trace.meta["command"] == str(script)


def test_trace_ddp_two_ranks_with_collectives(tmp_path: Path) -> None:
    out = tmp_path / "traces"
    proc = subprocess.run(
        [
            *OPGUARD,
            "trace",
            "--label",
            "ddp",
            "--output-dir",
            str(out),
            "--",
            "torchrun",
            "--nproc-per-node",
            "2",
            str(EXAMPLES / "train_ddp.py"),
            "--steps",
            "2",
        ],
        env=_traced_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        "ddp_callsite_rank0.json",
        "ddp_callsite_rank1.json",
        "ddp_setup_rank0.json",
        "ddp_setup_rank1.json",
    ]
    for rank in (0, 1):
        trace = load_trace(out / f"ddp_callsite_rank{rank}.json")
        setup = load_trace(out / f"ddp_setup_rank{rank}.json")
        assert trace.meta["rank"] == rank and trace.meta["world_size"] == 2
        assert (trace.meta["phase"], setup.meta["phase"]) == ("loop", "setup")
        # DDP broadcasts the model's state when it wraps it: set-up; its gradient
        # all-reduce runs in every step, the first one's in the set-up too
        assert {s.op for s in setup.callsites} >= {"c10d::broadcast_", "c10d::allreduce_"}
        assert trace.collectives is not None and setup.collectives is None
        collectives = [s for s in trace.callsites if s.op.startswith("c10d::")]
        ops = {s.op for s in collectives}
        assert "c10d::allreduce_" in ops
        # DDP's gradient all-reduce runs inside backward: attributed to .backward()'s caller
        reducer = [
            s for s in collectives if s.op == "c10d::allreduce_" and s.api == "Tensor.backward"
        ]
        assert reducer
        assert "train_step" in _qualnames(trace, reducer[0])
        explicit = [s for s in collectives if s.api == "torch.distributed.all_reduce"]
        assert explicit and _stack(trace, explicit[0])[1].module == "train_ddp"


def test_end_to_end_trace_then_run(tmp_path: Path) -> None:
    out = tmp_path / "traces"
    env = _traced_env(tmp_path)
    proc = subprocess.run(
        [
            *OPGUARD,
            "trace",
            "--label",
            "single",
            "--output-dir",
            str(out),
            "--",
            str(EXAMPLES / "train_single.py"),
            "--steps",
            "2",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run(
        [*OPGUARD, "run", "--input", str(out / "single_callsite_rank*.json")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    [config_path] = (tmp_path / "runs").glob("preprocessing_*/single_callsite_instrumentation.yaml")
    config = YAML(typ="safe").load(config_path.read_text())
    entries = {entry["target"]: entry for entry in config["entries"]}
    for target in (
        "tiny_gpt:TinyGPT.forward",
        "tiny_gpt:Block.forward",
        "tiny_gpt:CausalSelfAttention.forward",
        "tiny_gpt:MLP.forward",
    ):
        assert target in entries, sorted(entries)
        assert entries[target]["kind"] == "method"
        assert entries[target]["count"] > 0
    assert "aten::addmm" in entries["tiny_gpt:MLP.forward"]["ops"]
