"""The modes backend's two recording paths: the C fast path (``opguard_plugins/record/_recorder.c``)
and the Python reference path must write the same trace (docs/tracing.md, "The
recorder's fast path"). Needs torch; the C-path tests skip where the extension was not
built, unless ``OPGUARD_REQUIRE_NATIVE=1`` (set by .ci/run) makes that a failure
(tests/compiled.py); tests/test_native.py checks ``OPGUARD_PURE_PYTHON``."""

from __future__ import annotations

import sys
import threading
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from compiled import compiled

torch = pytest.importorskip("torch")

from opguard_plugins.record import tracer as tracer_module  # noqa: E402
from opguard_plugins.record.tracer import (  # noqa: E402
    CallsiteRecorder,
    CallsiteTracer,
    _walk,
    line_at,
)

pytestmark = pytest.mark.torch

REPO = Path(__file__).resolve().parent.parent
compiled("opguard_plugins.record._recorder")  # under OPGUARD_REQUIRE_NATIVE: fails if not built
#: the C path is in use (built, and OPGUARD_PURE_PYTHON not set)
BUILT = tracer_module._Counter is not None
needs_c = pytest.mark.skipif(not BUILT, reason="the C recorder is not built or not in use")


def _trace(tmp_path: Path, name: str, accelerated: bool, body: Callable[[], object]) -> Any:
    tracer = CallsiteTracer(name, tmp_path, rank=0)
    tracer.recorder = CallsiteRecorder(accelerated=accelerated)
    assert (tracer.recorder.counter is not None) == (accelerated and BUILT)
    tracer.start()
    try:
        body()
    finally:
        tracer.stop()
    return tracer


def _run_loop(loops: Any, name: str) -> Callable[[], None]:
    torch.manual_seed(0)
    step = loops.LOOPS[name]()

    def body() -> None:
        for _ in range(2):
            step()

    return body


@pytest.fixture
def loops(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(REPO / "examples"))
    import loops

    return loops


@needs_c
@pytest.mark.parametrize("loop", ["tiny_gpt", "hf_style", "conv", "checkpointed"])
def test_both_paths_write_the_same_trace(tmp_path: Path, loops: Any, loop: str) -> None:
    written = []
    for accelerated in (True, False):
        torch.set_num_threads(1)
        tracer = _trace(tmp_path / str(accelerated), loop, accelerated, _run_loop(loops, loop))
        written.append(tracer.write().read_bytes())
    assert written[0] == written[1]
    assert b'"aten::' in written[0]


def _ops_with_api(recorder: CallsiteRecorder) -> dict[tuple[str | None, str], int]:
    totals: dict[tuple[str | None, str], int] = {}
    for (_stack, api, op, _stream, _dtype), count in recorder.counts.items():
        totals[(api, op)] = totals.get((api, op), 0) + count
    return totals


@needs_c
def test_c_path_counts_apis_and_ops_like_python(tmp_path: Path) -> None:
    def body() -> None:
        torch.manual_seed(0)
        x = torch.randn(4, 4, requires_grad=True)
        for _ in range(3):
            y = torch.nn.functional.gelu(x @ x).sum()  # api + several ops
            y.backward()  # a backward api: the Python path records its stack
            torch.cat([x, x]).relu_()

    fast = _trace(tmp_path / "c", "t", True, body)
    slow = _trace(tmp_path / "py", "t", False, body)
    assert _ops_with_api(fast.recorder) == _ops_with_api(slow.recorder)
    assert _ops_with_api(fast.recorder)[("torch.nn.functional.gelu", "aten::gelu")] == 3
    assert sum(fast.recorder.counts.values()) == sum(slow.recorder.counts.values())


@needs_c
def test_c_walk_matches_the_python_walk() -> None:
    recorder = CallsiteRecorder(accelerated=True)

    def both() -> tuple[tuple[int, ...], tuple[int, ...]]:
        frame = sys._getframe(1)  # paused at this call: its f_lasti does not move
        python = _walk(frame, recorder.codes, recorder.modules)
        return recorder.counter.walk(frame), python

    def deeper(depth: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return both() if depth == 0 else deeper(depth - 1)

    fast, python = deeper(300)  # past the C walk's on-stack buffer of 256 frames
    assert fast == python
    assert len(fast) > 600
    assert all(key in recorder.codes for key in fast[::2])


def test_positions_are_turned_into_the_lines_f_lineno_reads() -> None:
    frame: types.FrameType | None = sys._getframe()
    checked = 0
    while frame is not None:
        assert line_at(frame.f_code, frame.f_lasti) == frame.f_lineno
        frame = frame.f_back
        checked += 1
    assert checked > 3
    code = test_positions_are_turned_into_the_lines_f_lineno_reads.__code__
    assert line_at(code, -1) == code.co_firstlineno


@needs_c
def test_an_op_that_raises_leaves_no_api_behind(tmp_path: Path) -> None:
    def body() -> None:
        with pytest.raises(RuntimeError, match="shape"):
            torch.ones(2).view(3)  # raised inside the op, under the api Tensor.view
        torch.ones(2).add(1)

    tracer = _trace(tmp_path, "t", True, body)
    apis = {api for (api, op) in _ops_with_api(tracer.recorder) if op == "aten::add"}
    assert apis == {"Tensor.add"}


@needs_c
def test_a_forked_child_starts_from_zero(tmp_path: Path) -> None:
    recorder = CallsiteRecorder(accelerated=True)
    tracer = CallsiteTracer("t", tmp_path, rank=0)
    tracer.recorder = recorder
    tracer.start()
    try:
        torch.ones(2).add(1)
        recorder.reset_after_fork()  # what the tracer does in a forked child
        torch.ones(2).mul(2)
    finally:
        tracer.stop()
    ops = {op for (_api, op) in _ops_with_api(recorder)}
    assert "aten::mul" in ops
    assert "aten::add" not in ops


@needs_c
def test_ops_on_another_thread_are_counted(tmp_path: Path) -> None:
    def body() -> None:
        worker = threading.Thread(target=lambda: torch.ones(3).sin())
        worker.start()
        worker.join()
        torch.ones(3).cos()

    tracer = _trace(tmp_path, "t", True, body)
    ops = {op for (_api, op) in _ops_with_api(tracer.recorder)}
    assert {"aten::cos"} <= ops  # modes are per thread: the worker's sin is not traced
    assert "aten::sin" not in ops


@pytest.mark.parametrize("accelerated", [True, False])
def test_ops_carry_the_current_stream(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, accelerated: bool
) -> None:
    if accelerated and not BUILT:
        pytest.skip("the C recorder was not built (no compiler)")
    # a CUDA machine as the recorder sees one: streams are read on every op
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    streams = iter(range(7, 10_000))
    monkeypatch.setattr(CallsiteRecorder, "current_stream", lambda self: next(streams) // 2)
    tracer = _trace(tmp_path, "t", accelerated, lambda: [torch.ones(2).add(1) for _ in range(4)])
    adds = {key[3]: n for key, n in tracer.recorder.counts.items() if key[2] == "aten::add"}
    assert len(adds) >= 2 and all(stream >= 3 for stream in adds)
    assert sum(adds.values()) == 4


@needs_c
def test_a_warning_from_a_kernel_points_at_the_programs_line(tmp_path: Path) -> None:
    import warnings

    def resize_out() -> None:
        out = torch.empty(2)
        torch.add(torch.ones(3), torch.ones(3), out=out)  # the kernel warns: out resized

    line = resize_out.__code__.co_firstlineno + 2
    for _ in range(2):  # the first call names torch.add in Python, the second does not
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _trace(tmp_path, "w", True, resize_out)
        assert [(Path(w.filename).name, w.lineno) for w in caught] == [
            ("test_trace_recorder.py", line)
        ]
