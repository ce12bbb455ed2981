"""Op dtypes as every recorder records them (formats.md, "Dtypes"; issue 29, point 5):
the modes backend on its C and Python paths, the guard's C walker, the profiler
backend and the Kineto reader. An op's dtype is its first tensor argument's; a list
of tensors does not count, and an op without a tensor argument has none."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from opguard_core.formats.trace import TRACE_VERSION, DecodedTrace, load_trace, read_bytes  # noqa: E402
from opguard_plugins.readers.kineto import read_kineto  # noqa: E402
from opguard_plugins.record import dtypes as record_dtypes  # noqa: E402
from opguard_plugins.record import tracer as tracer_module  # noqa: E402
from opguard_plugins.record.tracer import CallsiteRecorder, CallsiteTracer  # noqa: E402
from opguard_plugins.tracer import trace_callsites  # noqa: E402
from tests.compiled import compiled, needs  # noqa: E402

pytestmark = pytest.mark.torch

_recorder = compiled("opguard_plugins.record._recorder")
KINETO = Path(__file__).resolve().parent / "data" / "kineto"
#: the C recorder is in use (built, and OPGUARD_PURE_PYTHON not set)
needs_c = pytest.mark.skipif(
    tracer_module._Counter is None, reason="the C recorder is not built or not in use"
)


class Tiny(torch.nn.Module):
    """An embedding and a linear layer: float weights, int64 indices."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.out = torch.nn.Linear(4, 3)

    def forward(self, ids: Any) -> Any:
        flat = ids.view(-1)  # an op on the index tensor: int64
        return self.out(self.embed(flat))


def _run(model: Tiny) -> None:
    ids = torch.tensor([[1, 2, 3]])
    model(ids).sum().backward()


def _traced(tmp_path: Path, body: Callable[[], object], backend: str = "modes") -> DecodedTrace:
    torch.manual_seed(0)
    with trace_callsites("d", tmp_path / backend, rank=0, backend=backend, split=False) as tracer:
        body()
    assert tracer.written is not None
    return load_trace(tracer.written)


def _dtypes_of(trace: DecodedTrace, op: str) -> set[str | None]:
    return {site.dtype for site in trace.callsites if site.op == op}


def test_callsites_carry_the_dtype_of_the_first_tensor_argument(tmp_path: Path) -> None:
    model = Tiny()

    def body() -> None:
        for to_double in (False, True):  # the same lines in float32, then in float64
            if to_double:
                model.double()
            _run(model)
        torch.zeros(3)  # a factory: no tensor argument
        torch.cat([torch.ones(2), torch.ones(2)])  # a list of tensors does not count

    trace = _traced(tmp_path, body)
    assert trace.meta["tracer_backend"] == "modes"
    # one stack that ran addmm in float32 and in float64 is two callsites
    addmm = [site for site in trace.callsites if site.op == "aten::addmm"]
    assert sorted(site.dtype or "" for site in addmm) == ["float32", "float64"]
    assert len({site.stack for site in addmm}) == 1
    assert _dtypes_of(trace, "aten::view") >= {"int64"}  # the index's view
    assert _dtypes_of(trace, "aten::embedding") == {"float32", "float64"}  # weight first
    assert _dtypes_of(trace, "aten::zeros") == {None}
    assert _dtypes_of(trace, "aten::cat") == {None}
    # written as formats.md orders the fields, and omitted where there is none
    text = Path(trace.path).read_text()
    assert '"role":"compute","dtype":"float64","count":' in text
    assert not any('"dtype":null' in line for line in text.splitlines())


def _mixed() -> None:
    """Ops in several dtypes, a first sighting (the C path hands it to Python), a
    backward pass and a list argument."""
    x = torch.randn(3, 3, requires_grad=True)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        (x.to(dtype) @ x.to(dtype)).sum().backward()
    ids = torch.arange(6)
    (ids + 1).remainder(4)
    mask = ids > 2
    mask.logical_not()
    torch.stack([x, x]).mean()
    torch.empty(2, dtype=torch.float16).fill_(1)


@needs_c
def test_the_c_and_python_recorders_write_the_same_dtypes(tmp_path: Path) -> None:
    written = []
    for accelerated in (True, False):
        tracer = CallsiteTracer("t", tmp_path / str(accelerated), rank=0)
        tracer.recorder = CallsiteRecorder(accelerated=accelerated)
        assert (tracer.recorder.counter is not None) == accelerated
        torch.manual_seed(0)
        tracer.start()
        try:
            _mixed()
        finally:
            tracer.stop()
        written.append(tracer.write().read_bytes())
    assert written[0] == written[1]
    trace = load_trace(tmp_path / "True" / "t_callsite_rank0.json")
    assert {site.dtype for site in trace.callsites} >= {
        None, "float32", "float64", "bfloat16", "float16", "int64", "bool"
    }  # fmt: skip
    # the C path names each dtype once, into the Python reference's cache
    assert record_dtypes._NAMES[torch.bfloat16] == "bfloat16"


@needs_c
def test_the_c_recorder_reads_no_dtype_from_a_list_or_keywords() -> None:
    recorder = CallsiteRecorder(accelerated=True)
    assert recorder.counter is not None
    x = torch.ones(2)
    tracer = CallsiteTracer("t", ".", rank=0)
    tracer.recorder = recorder
    tracer.start()
    try:
        torch.cat([x, x])
        torch.add(torch.ones(2, dtype=torch.int32), 1)
        torch.ones(2, out=torch.empty(2, dtype=torch.float64))  # a keyword tensor only
    finally:
        tracer.stop()
    found = {(key[2], key[4]) for key in recorder.counts}
    assert ("aten::cat", None) in found
    assert ("aten::add", "int32") in found
    assert ("aten::ones", None) in found


def _profiler_program(steps: int = 3) -> Callable[[], None]:
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def body() -> None:
        for _ in range(steps):
            x = torch.randn(2, 4)
            y = torch.mm(x.double(), x.double().t())
            ids = torch.arange(4).add(1)
            mask = ids.gt(2)
            mask.logical_not()
            x.to(torch.bfloat16).sin()
            torch.cat([x, x])
            model(x).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            y.relu()

    return body


@pytest.mark.profiler
def test_the_profiler_backend_records_the_dtypes_the_modes_backend_records(
    tmp_path: Path,
) -> None:
    """The same program's loop: for every op both backends see (they see different ops:
    formats.md), the same dtypes."""
    pairs = {}
    for backend in ("modes", "profiler"):
        for attempt in range(3):  # torch's profiler, not the backend: see below
            torch.manual_seed(0)
            try:
                with trace_callsites(
                    "p", tmp_path / f"{backend}{attempt}", rank=0, backend=backend
                ) as tracer:
                    _profiler_program()()
            except RuntimeError as exc:
                if backend == "profiler" and "bad_alloc" in str(exc):
                    continue
                raise
            if getattr(tracer, "lost_cycles", 0) == 0:
                break
        # torch 2.13's profiler, in a few percent of pytest processes (never seen
        # in plain ones), loses its cycle (`IndexError: … at() …` on being stopped,
        # said on stderr) or raises `std::bad_alloc` out of its Python tracer into
        # the program (docs/tracing.md): tried again, at most 3 times in all
        assert tracer.written is not None
        loop = load_trace(tracer.written)
        assert loop.meta["phase"] == "loop"
        pairs[backend] = {(site.op, site.dtype) for site in loop.callsites}
    common = {op for op, _ in pairs["modes"]} & {op for op, _ in pairs["profiler"]}
    assert {"aten::mm", "aten::add", "aten::gt", "aten::sin", "aten::cat", "aten::relu"} <= common
    modes = {pair for pair in pairs["modes"] if pair[0] in common}
    profiler = {pair for pair in pairs["profiler"] if pair[0] in common}
    assert modes == profiler
    assert {("aten::mm", "float64"), ("aten::sin", "bfloat16"), ("aten::add", "int64")} <= modes
    assert {("aten::logical_not", "bool"), ("aten::cat", None)} <= modes


def test_the_kineto_reader_reads_dtypes_from_input_types() -> None:
    """A trace recorded with ``record_shapes`` (``Input type``: ``c10::BFloat16``…):
    the same callsites as without it, split by dtype."""
    typed = read_kineto(read_bytes(KINETO / "h100_bert_small_types.pt.trace.json.gz"), "b.json")
    plain = read_kineto(read_bytes(KINETO / "h100_bert_small.pt.trace.json.gz"), "b.json")
    assert typed["version"] == TRACE_VERSION
    dtypes = Counter(site.get("dtype") for site in typed["callsites"])
    assert dtypes["bfloat16"] > 10 and {"int64", "bool"} <= set(dtypes)
    assert all("dtype" not in site for site in plain["callsites"])

    def summed(doc: dict[str, Any]) -> Counter[tuple[Any, ...]]:
        found: Counter[tuple[Any, ...]] = Counter()
        for site in doc["callsites"]:
            key = (tuple(site["stack"]), site.get("api"), site["op"], site["role"])
            found[key] += site["count"]
        return found

    assert typed["frames"] == plain["frames"] and summed(typed) == summed(plain)
    keys = [
        (site["stack"], site.get("api") or "", site["op"], site["role"], site.get("dtype", ""))
        for site in typed["callsites"]
    ]
    assert keys == sorted(keys)  # canonical order: no dtype before a dtype, then by name
    fields = [list(site) for site in typed["callsites"] if "dtype" in site]
    assert all(f[f.index("dtype") - 1] == "role" and f[-1] == "count" for f in fields)


# ---------------------------------------------------------------------------
# the guard's C walker
# ---------------------------------------------------------------------------


class _State:
    """What ``TargetWalker.dispatch`` reads of a guard's state."""

    def __init__(self, ok: dict[Any, bool]) -> None:
        self.watch = True
        self.extra = self.chain = False
        self.known = True
        self.ok = ok
        self.ops = 0


class _Guard:
    def __init__(self, state: _State) -> None:
        self.checking = True
        self.collective_checks = False
        #: every code object names None: the active targets are (api, leaf) = (None, None)
        self._by_active = {(None, None): state}


def _walker(ok: dict[Any, bool], slow: list[Any]) -> tuple[Any, _State]:
    assert _recorder is not None
    state = _State(ok)
    local = threading.local()

    def python_path(*args: Any) -> str:  # the guard's _Mode.__torch_dispatch__
        slow.append(args[1])
        return "slow"

    walker = _recorder.TargetWalker(
        lambda code, namespace: None,
        local,
        {},
        lambda func: None,
        _Guard(state),
        python_path,
        None,
        frozenset({"c10d"}),
        frozenset(),
    )
    return walker, state


@needs(_recorder)
def test_the_walker_keys_ops_by_dtype_when_told() -> None:
    add = torch.ops.aten.add.Tensor
    args = (torch.ones(2, dtype=torch.float64), torch.ones(2))
    slow: list[Any] = []
    walker, state = _walker({add: True}, slow)
    assert walker.dtypes == 0
    result = walker.dispatch(None, add, (), args)  # key: func (no stream)
    assert torch.equal(result, torch.full((2,), 2.0, dtype=torch.float64))
    assert state.ops == 1 and slow == []

    walker.dtypes = 1  # key: (func, stream, dtype), the stream None without one
    assert walker.dispatch(None, add, (), args) == "slow" and slow == [add]
    state.ok[(add, None, "float64")] = True
    walker.dispatch(None, add, (), args)
    assert state.ops == 2 and len(slow) == 1
    # another dtype is another key: first sight (or a violation) goes to Python
    assert walker.dispatch(None, add, (), (torch.ones(2), torch.ones(2))) == "slow"
    # no tensor argument: dtype None
    state.ok[(torch.ops.aten.ones.default, None, None)] = True
    walker.dispatch(None, torch.ops.aten.ones.default, (), ([2],))
    assert state.ops == 3 and len(slow) == 2

    walker.dtypes = 0
    walker.dispatch(None, add, (), args)
    assert state.ops == 4
    with pytest.raises(ValueError, match="0 or 1"):
        walker.dtypes = 2
    with pytest.raises(TypeError):
        walker.dtypes = "yes"
