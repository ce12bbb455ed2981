"""Built-in reader: torch.profiler (Kineto) Chrome-trace JSON as callsite traces.

Implements ``opguard_read_trace`` (docs/kineto.md has the semantics and their
reasons; formats.md §1 the document): a file is taken when its start is a JSON
object naming one of Kineto's top-level keys (``traceEvents``, ``schemaVersion``,
``deviceProperties``, ``distributedInfo``), whatever its name; ``.json.gz`` arrives
decompressed. One file is one rank. In brief:

* **ops**: per CPU thread, the outermost event named ``namespace::name`` (``aten::addmm``,
  ``c10d::allreduce_``); record-function labels, autograd nodes
  (``AddmmBackward0``, ``autograd::engine::evaluate_function: ...``) and
  ``record_param_comms`` are transparent. A collective (``c10d::``,
  ``_c10d_functional::``, ``c10d_functional::``) nested in a counted non-collective op
  is counted as well. ``profiler::*`` ops and ops the profiler itself issues are
  dropped, and counted.
* **stacks** (``meta.stack_source``): ``python_function`` events nested by time on the
  op's thread (``python``); else the op's ``Call stack`` argument (``call_stack``,
  2021 schema); else ``user_annotation`` labels as pseudo-frames (``labels``,
  file ``<record_function>``); ``ProfilerStep#N`` is never a frame.
* **backward**: an op on another thread while a thread is inside a backward call
  (``Tensor.backward`` / ``torch.autograd.backward`` / ``grad`` /
  ``_engine_run_backward``; with labels: any open label) gets that thread's stack at
  that moment as prefix, followed by its own thread's frames, and ``api`` names the
  backward entry (``Tensor.backward``), like OpGuard's tracer.
* **streams**: the stream of an op is the stream of its first device event
  (kernel, memcpy, memset) by launch time, linked launch → device through
  ``args.correlation``; a runtime launch belongs to the innermost counted op
  enclosing it in time on its thread. An op that launches nothing is on the compute
  stream. Roles: ``compute`` (the default stream: CUDA 7, HIP 0, else the lowest
  non-comm id), ``comm`` (streams running NCCL/RCCL kernels or a collective op's
  kernels; ``comm2``… if several), ``side1``, ``side2``… in order of first launch.
  Every collective op is on a comm role.
* **dtypes**: an op's ``dtype`` is its first tensor argument's, from its ``Input type``
  (recorded with ``record_shapes``; C++ names such as ``c10::BFloat16`` through
  :func:`~opguard_core.formats.dtypes.profiler_dtype`); none without it (formats.md,
  "Dtypes").
* **steps, ranks**: ``ProfilerStep#N`` into ``meta.steps``; ``distributedInfo`` into
  ``meta.rank``/``ranks``/``world_size``/``backend``.
* **window**: what the profiling window cut is counted in ``meta.window``.
"""

from __future__ import annotations

import math
import re
from bisect import bisect_right
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import msgspec

from opguard_core import hookimpl
from opguard_core.combine.accumulator import gc_paused
from opguard_core.errors import InputError
from opguard_core.formats.collectives import (
    Collectives,
    CollectiveSequence,
    Group,
    Signature,
    StepRecorder,
    is_collective,
    remap_runs,
)
from opguard_core.formats.dtypes import PROFILER_TYPES, profiler_dtype
from opguard_core.formats.readers import is_opguard_document, without_bom
from opguard_core.formats.streams import COMM_NAMESPACES, role_order
from opguard_core.formats.trace import TRACE_FORMAT, TRACE_VERSION, trace_ranks
from opguard_core.formats.values import is_count
from opguard_core.run.warnings import warn

#: ``meta.importer``: this reader and the version of its rules
IMPORTER = "opguard-kineto/1"
#: the raw stream of a collective with no device stream (gloo; kernels outside the window)
NO_STREAM = -1

# ---------------------------------------------------------------------------
# decoding: only the fields the importer reads; msgspec skips the rest in C
# ---------------------------------------------------------------------------


#: an absent raw field (empty: ``not raw``)
_NO_RAW = msgspec.Raw()


class _Args(
    msgspec.Struct,
    gc=False,
    rename={"call_stack": "Call stack", "input_type": "Input type"},
):
    correlation: int | None = None
    stream: int | None = None
    device: int | None = None
    call_stack: str | None = None
    #: an op's argument types (``record_shapes``): its dtype, and a collective's
    #: description; kept raw, decoded once per distinct list (:meth:`_Importer.dtype`)
    input_type: msgspec.Raw = _NO_RAW


class _CommArgs(
    _Args,
    gc=False,
    rename={
        "call_stack": "Call stack",
        "input_dims": "Input Dims",
        "input_type": "Input type",
        "concrete": "Concrete Inputs",
        "pg_name": "Process Group Name",
        "pg_desc": "Process Group Description",
        "group_size": "Group size",
        "pg_ranks": "Process Group Ranks",
        "in_nelems": "In msg nelems",
    },
):
    """An event's args with what describes a collective (the sequence, docs/kineto.md
    "Collective sequences"): decoded only for a distributed job's trace, since every
    field more slows the decoding of every event's args."""

    # a collective's description (the sequence, docs/kineto.md "Collective
    # sequences"): kept raw (shapes are on every op: decoded only for collectives)
    # (in the order torch writes them: msgspec looks the next field up first)
    concrete: msgspec.Raw = _NO_RAW
    input_dims: msgspec.Raw = _NO_RAW
    # only on record_param_comms: any JSON value, checked where read
    dtype: Any = None
    pg_name: Any = None
    pg_desc: Any = None
    group_size: Any = None
    pg_ranks: Any = None
    in_nelems: Any = None


#: an event's ``ts`` when it has none (JSON cannot spell it)
_NO_TS = -math.inf


class _Event(msgspec.Struct, gc=False):
    ph: str = ""
    cat: str | None = None
    name: str = ""
    pid: int | str = 0
    tid: int | str = 0
    ts: float = _NO_TS
    dur: float = 0.0
    args: _Args | None = None


class _CommEvent(_Event, gc=False):
    args: _CommArgs | None = None


class _Distributed(msgspec.Struct, gc=False):
    rank: int | None = None
    world_size: int | None = None
    backend: str | None = None
    #: torch >= 2.3: [{"pg_name", "pg_desc", "pg_size", "ranks"}, ...]; checked where read
    pg_config: Any = None


class _Document(
    msgspec.Struct,
    gc=False,
    rename={
        "trace_events": "traceEvents",
        "distributed_info": "distributedInfo",
        "schema_version": "schemaVersion",
    },
):
    trace_events: list[_Event]  # required: a file without it is no trace
    distributed_info: _Distributed | None = None
    schema_version: int | None = None
    roctracer_version: Any = None
    hip_runtime_version: Any = None


_DOCUMENT_KEYS = {
    "trace_events": "traceEvents",
    "distributed_info": "distributedInfo",
    "schema_version": "schemaVersion",
}


class _CommDocument(_Document, gc=False, rename=_DOCUMENT_KEYS):
    """A distributed job's trace: its events' args with collectives' descriptions."""

    trace_events: list[_CommEvent]  # type: ignore[assignment]


_DECODER = msgspec.json.Decoder(_Document)
_COMM_DECODER = msgspec.json.Decoder(_CommDocument)
#: what marks a distributed job's trace in its first :data:`HEAD` bytes (torch writes
#: ``distributedInfo`` before the events)
_DISTRIBUTED_KEY = b'"distributedInfo"'


class KinetoError(ValueError):
    """A Kineto trace that cannot be read (the message names the problem)."""


# ---------------------------------------------------------------------------
# content detection
# ---------------------------------------------------------------------------

#: how far into a file Kineto's top-level keys are looked for
HEAD = 65536
_KINETO_KEYS = (b'"traceEvents"', b'"schemaVersion"', b'"deviceProperties"', b'"distributedInfo"')


def looks_like_kineto(data: bytes) -> bool:
    """Whether a file's (decompressed) bytes look like a Kineto/Chrome trace: a JSON
    object that names one of Kineto's top-level keys in its first :data:`HEAD` bytes
    and is not an OpGuard document."""
    text = without_bom(data[:HEAD]).lstrip(b" \t\r\n")
    if not text.startswith(b"{"):
        return False
    if is_opguard_document(text):
        return False
    return any(key in text for key in _KINETO_KEYS)


#: ``meta.window`` counts that mean work the window cut off, as a person reads them
_CUTS = {
    "device_events_without_launch": "device events without a launch",
    "launches_outside_ops": "launches outside any op",
    "launches_without_device_events": "launches without device events",
    "ops_cut": "ops cut by the window's edges",
    "multi_stream_ops": "ops on several streams",
}


@hookimpl
def opguard_read_trace(path: Path, data: bytes) -> dict[str, Any] | None:
    if not looks_like_kineto(data):
        return None
    try:
        document = read_kineto(data, path.name)
    except KinetoError as error:
        raise InputError(path, str(error)) from None
    window = document["meta"]["window"]
    cut = [f"{window[key]} {text}" for key, text in _CUTS.items() if window.get(key)]
    if cut:
        warn(
            f"{path}: the profiling window cut work: {', '.join(cut)} (meta.window; "
            "docs/kineto.md)",
            alike="the profiling window cut work",
            file=str(path),
            window=window,
        )
    return document


# ---------------------------------------------------------------------------
# names: ops, frames, modules
# ---------------------------------------------------------------------------

_OP_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*::[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)?$")
_PROFILER_STEP = re.compile(r"^ProfilerStep#([0-9]{1,18})$")
_PY_FRAME = re.compile(r"^(.*)\((\d+)\): (.+)$")
_SITE_DIRS = re.compile(r"^.*/(?:site-packages|dist-packages)/")
_STDLIB_DIR = re.compile(r"^.*/lib/python\d+(?:\.\d+)?/")
_MODULE_CALL = "nn.Module: "
#: runtime calls that always put work on a device: kernel launches and copies (not
#: memsets: a trace may hold cudaMemsetAsync calls with no memset activity recorded)
_DEVICE_WORK = re.compile(r"Launch|Memcpy")
_COMM_KERNEL_PREFIXES = ("nccl", "void nccl", "rccl", "void rccl")

#: event categories, old (2021) and new schema
_CPU_OP_CATS = frozenset({"cpu_op", "Operator"})
_RUNTIME_CATS = frozenset({"cuda_runtime", "cuda_driver", "Runtime", "Driver"})
_DEVICE_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "Kernel", "Memcpy", "Memset"})

#: op kinds
_NOT_OP, _OP, _COLLECTIVE, _PROFILER_OP = 0, 1, 2, 3

#: frames OpGuard's tracer drops too (dispatch plumbing; docs/tracing.md, ``stack``)
_DROPPED_FILES = frozenset({"torch/overrides.py", "torch/utils/_python_dispatch.py"})
_DROPPED_FUNCTIONS = frozenset({("torch/_ops.py", "__call__")})
#: the profiler's own Python code: ops issued from it are the profiler's, not the program's
_PROFILER_FILES = ("torch/autograd/profiler.py", "torch/profiler/")

#: (file, function) → qualname for torch frames whose class Kineto does not say
_KNOWN_QUALNAMES: dict[tuple[str, str], str] = {
    ("torch/nn/modules/module.py", "_call_impl"): "Module._call_impl",
    ("torch/nn/modules/module.py", "_wrapped_call_impl"): "Module._wrapped_call_impl",
    ("torch/nn/modules/module.py", "__getattr__"): "Module.__getattr__",
    ("torch/nn/modules/module.py", "__setattr__"): "Module.__setattr__",
    ("torch/_tensor.py", "backward"): "Tensor.backward",
    ("torch/optim/optimizer.py", "zero_grad"): "Optimizer.zero_grad",
    ("torch/nn/parallel/distributed.py", "forward"): "DistributedDataParallel.forward",
    ("torch/nn/parallel/distributed.py", "_run_ddp_forward"): (
        "DistributedDataParallel._run_ddp_forward"
    ),
    ("torch/nn/parallel/distributed.py", "_pre_forward"): "DistributedDataParallel._pre_forward",
    ("torch/nn/parallel/distributed.py", "_post_forward"): (
        "DistributedDataParallel._post_forward"
    ),
}

#: frames that enter a backward pass → the api OpGuard's tracer records for it
_BACKWARD_ENTRIES: dict[tuple[str, str], str] = {
    ("torch/_tensor.py", "backward"): "Tensor.backward",
    ("torch/autograd/__init__.py", "backward"): "torch.autograd.backward",
    ("torch/autograd/__init__.py", "grad"): "torch.autograd.grad",
    ("torch/autograd/graph.py", "_engine_run_backward"): "",
}

_LABEL_FILE = "<record_function>"


def _op_kind(name: str) -> tuple[int, str]:
    """The kind of a CPU event's name, and the op it counts as (overload dropped)."""
    if not _OP_NAME.match(name):
        return _NOT_OP, name
    op = name.split(".", 1)[0]
    if name.startswith("profiler::"):
        return _PROFILER_OP, op
    if name.startswith(COMM_NAMESPACES):
        return _COLLECTIVE, op
    return _OP, op


def relative_file(path: str) -> str:
    """A path as OpGuard's tracer writes it: relative to site-packages or the stdlib."""
    if path.startswith("/"):
        stripped = _SITE_DIRS.sub("", path, count=1)
        if stripped == path:
            stripped = _STDLIB_DIR.sub("", path, count=1)
        return stripped
    return path


def module_of(file: str) -> str | None:
    """The dotted module of a (relative) ``.py`` path; the stem for an absolute one."""
    if file.startswith("<") or not file.endswith(".py"):
        return None
    if file.startswith("/"):
        stem = file.rsplit("/", 1)[-1][:-3]
        return stem if stem.isidentifier() else None
    parts = file[:-3].split("/")
    if parts[-1] == "__init__":
        parts.pop()
    if not parts or not all(p.isidentifier() for p in parts):
        return None
    return ".".join(parts)


class _Frames:
    """Interns raw frame names; resolves file, line, function, qualname, module at the end."""

    __slots__ = ("by_name", "classes", "names", "parsed")

    def __init__(self) -> None:
        self.by_name: dict[str, int] = {}
        self.names: list[str] = []
        #: (file, line, function) per frame id; None for a frame that is dropped
        self.parsed: list[tuple[str, int, str] | None] = []
        #: frame id → the module classes whose call entered it (``nn.Module: X_0``)
        self.classes: dict[int, set[str]] = {}

    def python(self, name: str) -> int:
        """Frame id of a ``python_function`` name (``file.py(12): f``); -1 to drop it."""
        found = self.by_name.get(name)
        if found is not None:
            return found
        match = _PY_FRAME.match(name)
        parsed: tuple[str, int, str] | None = None
        if match is not None:
            file = relative_file(match.group(1))
            function = match.group(3)
            if file not in _DROPPED_FILES and (file, function) not in _DROPPED_FUNCTIONS:
                parsed = (file, int(match.group(2)), function)
        if parsed is None:  # <built-in ...>, plumbing
            self.by_name[name] = -1
            return -1
        return self._add(name, parsed)

    def module_call(self) -> int:
        """Frame id of ``Module._wrapped_call_impl`` (line unknown) for module calls."""
        found = self.by_name.get(_MODULE_CALL)
        if found is not None:
            return found
        return self._add(_MODULE_CALL, ("torch/nn/modules/module.py", 0, "_wrapped_call_impl"))

    def label(self, name: str) -> int:
        key = "\0" + name
        found = self.by_name.get(key)
        if found is not None:
            return found
        return self._add(key, (_LABEL_FILE, 0, name))

    def _add(self, key: str, parsed: tuple[str, int, str]) -> int:
        fid = len(self.names)
        self.by_name[key] = fid
        self.names.append(key)
        self.parsed.append(parsed)
        return fid

    def frame(self, fid: int) -> dict[str, Any]:
        parsed = self.parsed[fid]
        assert parsed is not None
        file, line, function = parsed
        if file == _LABEL_FILE:
            return {"file": file, "line": 0, "function": function, "qualname": function}
        qualname = _KNOWN_QUALNAMES.get((file, function))
        classes = self.classes.get(fid)
        if qualname is None and classes is not None and len(classes) == 1:
            qualname = f"{next(iter(classes))}.{function}"
        frame: dict[str, Any] = {
            "file": file,
            "line": line,
            "function": function,
            "qualname": qualname or function,
        }
        module = module_of(file)
        if module is not None:
            frame["module"] = module
        return frame


class _Stacks:
    """Interned stacks: id 0 is the empty stack; each id is (parent id, frame id)."""

    __slots__ = ("frame", "ids", "parent")

    def __init__(self) -> None:
        self.parent: list[int] = [-1]
        self.frame: list[int] = [-1]
        self.ids: dict[int, int] = {}

    def push(self, sid: int, fid: int) -> int:
        key = (sid << 32) | fid
        found = self.ids.get(key)
        if found is None:
            found = self.ids[key] = len(self.parent)
            self.parent.append(sid)
            self.frame.append(fid)
        return found

    def frames(self, sid: int) -> list[int]:
        out: list[int] = []
        parent, frame = self.parent, self.frame
        while sid > 0:
            out.append(frame[sid])
            sid = parent[sid]
        out.reverse()
        return out

    def extend(self, sid: int, fids: Iterable[int]) -> int:
        for fid in fids:
            sid = self.push(sid, fid)
        return sid


# ---------------------------------------------------------------------------
# the import
# ---------------------------------------------------------------------------

_PY, _LABEL, _OPEV, _RUNTIME, _DEVICE, _WINDOW = 0, 1, 2, 3, 4, 5
_CAT_KIND: dict[str, int] = {
    "python_function": _PY,
    "user_annotation": _LABEL,
    **{cat: _OPEV for cat in _CPU_OP_CATS},
    **{cat: _RUNTIME for cat in _RUNTIME_CATS},
    **{cat: _DEVICE for cat in _DEVICE_CATS},
    "Trace": _WINDOW,
}
#: flags of a python_function event
_F_FRAME, _F_MODULE, _F_CALL_IMPL, _F_FORWARD, _F_BACKWARD = 1, 2, 4, 8, 16


class _Anchor(msgspec.Struct, gc=False, array_like=True):
    """A stretch of time during which ``thread`` was inside a backward call (or label)."""

    start: float
    end: float
    sid: int
    thread: int
    api: str


def read_kineto(data: bytes, name: str) -> dict[str, Any]:
    """Turn one Kineto trace file's (decompressed) bytes into an opguard-callsites dict.

    ``name`` is the file's name, for ``meta.source``. Raises :class:`KinetoError` with
    a one-line reason for anything unreadable.
    """
    data = without_bom(data)
    distributed = data.find(_DISTRIBUTED_KEY, 0, HEAD) >= 0
    with gc_paused():  # millions of acyclic tuples: no collection can free anything
        document = _decode(data, _COMM_DECODER if distributed else _DECODER)
        return _Importer(document, name, data).run()


def _decode(data: bytes, decoder: msgspec.json.Decoder[Any] = _DECODER) -> _Document:
    try:
        document: _Document = decoder.decode(data)
        return document
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        raise KinetoError(f"not a readable Kineto trace: {' '.join(str(error).split())}") from None


def _bad_time(index: int, event: _Event) -> None:
    """Refuse a complete event that has no start or ends before it starts: where it
    nests, and what it encloses, cannot be told."""
    problem = "no `ts`" if event.ts == _NO_TS else f"a negative `dur` ({event.dur:g})"
    raise KinetoError(
        f"not a readable Kineto trace: a complete event with {problem} - at "
        f"`$.traceEvents[{index}]` ({event.name[:80]!r}, cat {event.cat!r})"
    )


def _any_row(
    threads: dict[tuple[int | str, int | str], list[tuple[float, float, int, int]]], kind: int
) -> int | None:
    """The event index of some row of this kind, or None."""
    for rows in threads.values():
        for row in rows:
            if row[2] == kind:
                return row[3]
    return None


def _has_call_stack(
    threads: dict[tuple[int | str, int | str], list[tuple[float, float, int, int]]],
    events: list[_Event],
) -> bool:
    """Whether some op carries the 2021 ``Call stack`` argument."""
    for rows in threads.values():
        for row in rows:
            if row[2] == _OPEV:
                args = events[row[3]].args
                if args is not None and args.call_stack:
                    return True
    return False


class _Importer:
    def __init__(self, document: _Document, name: str, data: bytes) -> None:
        self.document = document
        self.name = name
        self.data = data
        self.frames = _Frames()
        self.stacks = _Stacks()
        self.window: dict[str, int] = {}
        # counted ops, column-wise
        self.op_name: list[str] = []
        self.op_sid: list[int] = []
        self.op_thread: list[int] = []
        self.op_ts: list[float] = []
        self.op_end: list[float] = []
        self.op_kind: list[int] = []
        self.op_api: list[str | None] = []
        self.op_dtype: list[str | None] = []
        #: an ``Input type`` list's bytes → its dtype
        self.dtypes: dict[bytes, str | None] = {}
        #: correlation → (op index or -1, launch ts, event index)
        self.launches: dict[int, tuple[int, float, int]] = {}
        self.anchors: list[_Anchor] = []
        self.steps: set[int] = set()
        self.step_threads: set[int] = set()
        self.op_kinds: dict[str, tuple[int, str]] = {}
        self.py_cache: dict[str, tuple[int, int, str]] = {}
        self.call_stacks: dict[str, tuple[int, str | None]] = {}
        self.window_bounds: tuple[float | None, float | None] = (None, None)
        #: collective op number → its event; → its record_param_comms; → its nccl:* label
        self.comm_ops: dict[int, int] = {}
        self.comm_params: dict[int, int] = {}
        self.comm_labels: dict[int, int] = {}
        #: (ts, N) of each ``ProfilerStep#N``; ends of ``Optimizer.step#`` labels
        self.step_starts: list[tuple[float, int]] = []
        self.optimizer_ends: list[float] = []

    def count(self, key: str, n: int = 1) -> None:
        self.window[key] = self.window.get(key, 0) + n

    def dtype(self, event: _Event) -> str | None:
        """An op's dtype from its ``Input type`` (None without one)."""
        args = event.args
        if args is None or not args.input_type:
            return None
        key = bytes(args.input_type)
        if key in self.dtypes:
            return self.dtypes[key]
        found = self.dtypes[key] = profiler_dtype(_decoded(args.input_type) or ())
        return found

    # -- partition --------------------------------------------------------

    def run(self) -> dict[str, Any]:
        events = self.document.trace_events
        threads: dict[tuple[int | str, int | str], list[tuple[float, float, int, int]]] = {}
        device: list[_Event] = []
        cat_kind = _CAT_KIND
        for index, event in enumerate(events):
            kind = cat_kind.get(event.cat)  # type: ignore[arg-type]
            if kind is None or event.ph != "X":
                continue
            if event.ts == _NO_TS or event.dur < 0:
                _bad_time(index, event)
            if kind < _DEVICE:
                key = (event.pid, event.tid)
                rows = threads.get(key)
                if rows is None:
                    rows = threads[key] = []
                rows.append((event.ts, -event.dur, kind, index))
            elif kind == _DEVICE:
                device.append(event)
            else:
                self.window_bounds = (event.ts, event.ts + event.dur)
        if _any_row(threads, _PY) is not None:
            self.stack_source = "python"
        elif _has_call_stack(threads, events):
            self.stack_source = "call_stack"
        else:
            self.stack_source = "labels"
        document = self.document
        self.hip = bool(document.roctracer_version or document.hip_runtime_version)
        if not self.hip:
            runtime = _any_row(threads, _RUNTIME)
            self.hip = runtime is not None and events[runtime].name.startswith("hip")
        thread_keys = sorted(threads, key=lambda k: (str(k[0]), str(k[1])))
        for number, key in enumerate(thread_keys):
            rows = threads[key]
            rows.sort()
            self.sweep(number, rows, events)
        self.attribute_backward()
        streams = self.link_device(device)
        return self.build(streams)

    # -- one thread -------------------------------------------------------

    def python_event(self, name: str) -> tuple[int, int, str]:
        """(frame id or -1, flags, module class) of a ``python_function`` name."""
        if name.startswith(_MODULE_CALL):
            # the module call stands for Module._wrapped_call_impl (torch >= 2.0), a
            # frame the profiler replaces by this event: its line is unknown (0)
            fid = self.frames.module_call()
            return fid, _F_FRAME | _F_MODULE, name[len(_MODULE_CALL) :].rsplit("_", 1)[0]
        fid = self.frames.python(name)
        flags = 0
        if fid >= 0:
            parsed = self.frames.parsed[fid]
            assert parsed is not None
            flags = _F_FRAME
            if parsed[2] == "_call_impl":
                flags |= _F_CALL_IMPL
            elif parsed[2] == "forward":
                flags |= _F_FORWARD
            if (parsed[0], parsed[2]) in _BACKWARD_ENTRIES:
                flags |= _F_BACKWARD
        return fid, flags, ""

    def sweep(
        self, thread: int, rows: list[tuple[float, float, int, int]], events: list[_Event]
    ) -> None:
        """Walk one thread's events in time order with a stack of open events."""
        stacks = self.stacks
        push = stacks.push
        source = self.stack_source
        use_python = source == "python"
        use_labels = source == "labels"
        use_call_stack = source == "call_stack"
        op_kinds = self.op_kinds
        py_cache = self.py_cache
        launches = self.launches
        op_name, op_sid, op_thread = self.op_name, self.op_sid, self.op_thread
        op_ts, op_end, op_kind = self.op_ts, self.op_end, self.op_kind
        op_dtype, dtype_of = self.op_dtype, self.dtype
        call_stacks = self.call_stacks
        anchors = self.anchors
        comm_ops, comm_params, comm_labels = self.comm_ops, self.comm_params, self.comm_labels
        classes = self.frames.classes
        # the open events: (end, state to restore when it closes)
        ends: list[float] = []
        saved: list[tuple[int, int, str]] = []
        sid = 0  # current stack
        op = -1  # innermost counted op open
        module_class = ""  # class of the module call whose forward comes next
        misnested = 0
        for ts, negdur, kind, index in rows:
            # an instant event (dur 0) at the very end of an open event is inside it:
            # timestamps in whole microseconds put a child (``aten::as_strided`` in
            # ``aten::select``, ``aten::_local_scalar_dense`` in ``aten::item``) there
            while ends and (ends[-1] < ts or (ends[-1] == ts and negdur)):
                ends.pop()
                sid, op, module_class = saved.pop()
            if kind == _RUNTIME:
                args = events[index].args
                if args is not None and args.correlation is not None:
                    launches[args.correlation] = (op, ts, index)
                continue
            event = events[index]
            if kind == _PY:
                if not use_python:
                    continue
                info = py_cache.get(event.name)
                if info is None:
                    info = py_cache[event.name] = self.python_event(event.name)
                fid, flags, cls = info
                if fid < 0:
                    continue  # a C function (or plumbing): changes nothing, needs no push
                ends.append(ts - negdur)
                saved.append((sid, op, module_class))
                if flags & _F_MODULE:
                    module_class = cls
                    sid = push(sid, fid)
                    continue
                if module_class and not flags & _F_CALL_IMPL:
                    if flags & _F_FORWARD:
                        found = classes.get(fid)
                        if found is None:
                            classes[fid] = {module_class}
                        else:
                            found.add(module_class)
                    module_class = ""
                sid = push(sid, fid)
                if flags & _F_BACKWARD:
                    anchors.append(_Anchor(ts, ts - negdur, sid, thread, self.backward_api(sid)))
                continue
            name = event.name
            if kind == _OPEV:
                known = op_kinds.get(name)
                if known is None:
                    known = op_kinds[name] = _op_kind(name)
                okind, base = known
                if okind == _NOT_OP:
                    if name[:1] == "P" and _PROFILER_STEP.match(name):
                        self.step(name, thread, ts)
                    elif (
                        name == "record_param_comms"
                        and op != -1
                        and op_kind[op] == _COLLECTIVE
                        and op not in comm_params
                    ):
                        comm_params[op] = index
                    continue
                end = ts - negdur
                if ends and end > ends[-1]:
                    misnested += 1
                if op != -1 and (okind != _COLLECTIVE or op_kind[op] == _COLLECTIVE):
                    continue  # inside a counted op: not issued by the program
                new_sid = sid
                if use_call_stack:
                    args = event.args
                    text = args.call_stack if args is not None else None
                    if text:
                        cached = call_stacks.get(text)
                        if cached is None:
                            cached = call_stacks[text] = self.call_stack(text)
                        new_sid = cached[0]
                        if cached[1] is not None:
                            anchors.append(_Anchor(ts, end, cached[0], thread, cached[1]))
                number = len(op_name)
                if okind == _COLLECTIVE:
                    comm_ops[number] = index
                op_name.append(base)
                op_sid.append(new_sid)
                op_thread.append(thread)
                op_ts.append(ts)
                op_end.append(end)
                op_kind.append(okind)
                op_dtype.append(dtype_of(event))
                ends.append(end)
                saved.append((sid, op, module_class))
                op = number
                continue
            # a record-function label
            first = name[:1]
            if first == "P" and _PROFILER_STEP.match(name):
                self.step(name, thread, ts)
                continue
            if first == "n":
                if (
                    op != -1
                    and op_kind[op] == _COLLECTIVE
                    and name.startswith("nccl:")
                    and op not in comm_labels
                ):
                    comm_labels[op] = index
            elif first == "O" and name.startswith("Optimizer.step#"):
                self.optimizer_ends.append(ts - negdur)
            if not use_labels:
                continue
            end = ts - negdur
            ends.append(end)
            saved.append((sid, op, module_class))
            sid = push(sid, self.frames.label(name))
            anchors.append(_Anchor(ts, end, sid, thread, ""))
        if misnested:
            self.count("misnested_ops", misnested)

    def step(self, name: str, thread: int, ts: float) -> None:
        """Note a ``ProfilerStep#N`` event."""
        number = int(name[len("ProfilerStep#") :])
        self.steps.add(number)
        self.step_starts.append((ts, number))
        self.step_threads.add(thread)

    def backward_api(self, sid: int) -> str:
        """The api of the outermost backward entry on a stack (``Tensor.backward``)."""
        for fid in self.stacks.frames(sid):
            parsed = self.frames.parsed[fid]
            assert parsed is not None
            api = _BACKWARD_ENTRIES.get((parsed[0], parsed[2]))
            if api:
                return api
        return ""

    def call_stack(self, text: str) -> tuple[int, str | None]:
        """Stack id of a ``Call stack`` argument (innermost first, ``;``-separated), and
        the backward api when it runs inside a backward entry (then the stack is cut
        to end at that entry, for attributing other threads' ops)."""
        fids = [self.frames.python(part) for part in reversed(text.split(";")) if part]
        fids = [f for f in fids if f >= 0]
        sid = self.stacks.extend(0, fids)
        for fid in fids:
            parsed = self.frames.parsed[fid]
            assert parsed is not None
            if (parsed[0], parsed[2]) in _BACKWARD_ENTRIES:
                return sid, self.backward_api(sid)
        return sid, None

    # -- backward ---------------------------------------------------------

    def attribute_backward(self) -> None:
        """Prefix ops on other threads with the stack of a running backward call.

        One sweep over the ops in time order with the anchors that are open: the
        innermost (latest started) open anchor on another thread wins.
        """
        anchors = self.anchors
        if self.stack_source == "call_stack":
            # an op stack inside backward marks its thread as in backward until the
            # thread's next op that is not
            anchors = self.call_stack_anchors()
        main = self._main_thread()
        if self.stack_source == "labels":
            anchors = [a for a in anchors if a.thread == main]
        self.op_api = [None] * len(self.op_name)
        self.backward = {"attributed": 0, "ambiguous": 0}
        if not anchors:
            return
        anchors.sort(key=lambda a: (a.start, -a.end))
        stacks = self.stacks
        op_ts, op_thread, op_sid, api_of = self.op_ts, self.op_thread, self.op_sid, self.op_api
        attributed = ambiguous = 0
        active: list[_Anchor] = []
        next_anchor = 0
        for number in sorted(range(len(op_ts)), key=op_ts.__getitem__):
            ts = op_ts[number]
            while next_anchor < len(anchors) and anchors[next_anchor].start <= ts:
                active.append(anchors[next_anchor])
                next_anchor += 1
            if not active:
                continue
            active = [a for a in active if a.end > ts]
            thread = op_thread[number]
            found: _Anchor | None = None
            for anchor in reversed(active):
                if anchor.thread != thread:
                    if found is None:
                        found = anchor
                    elif anchor.thread != found.thread:
                        ambiguous += 1
                        break
            if found is None:
                continue
            own = stacks.frames(op_sid[number])
            op_sid[number] = stacks.extend(found.sid, own)
            api_of[number] = found.api or None
            attributed += 1
        self.backward = {"attributed": attributed, "ambiguous": ambiguous}

    def _main_thread(self) -> int:
        """The training loop's thread: the one with ``ProfilerStep#N``, else the one
        with the most labels."""
        if self.step_threads:
            return min(self.step_threads)
        counts: dict[int, int] = {}
        for anchor in self.anchors:
            counts[anchor.thread] = counts.get(anchor.thread, 0) + 1
        return max(counts, key=lambda t: (counts[t], -t)) if counts else -1

    def call_stack_anchors(self) -> list[_Anchor]:
        by_thread: dict[int, list[int]] = {}
        for number, thread in enumerate(self.op_thread):
            by_thread.setdefault(thread, []).append(number)
        marked = {(a.thread, a.start): a for a in self.anchors}
        out: list[_Anchor] = []
        for thread, numbers in by_thread.items():
            numbers.sort(key=lambda n: self.op_ts[n])
            current: _Anchor | None = None
            for n in numbers:
                anchor = marked.get((thread, self.op_ts[n]))
                if anchor is not None:
                    if current is None:
                        current = _Anchor(
                            anchor.start, float("inf"), anchor.sid, thread, anchor.api
                        )
                elif current is not None:
                    current.end = self.op_ts[n]
                    out.append(current)
                    current = None
            if current is not None:
                out.append(current)
        # the op stack ends below the backward entry: cut it there
        for anchor in out:
            fids = self.stacks.frames(anchor.sid)
            for depth in range(len(fids) - 1, -1, -1):
                parsed = self.frames.parsed[fids[depth]]
                assert parsed is not None
                if (parsed[0], parsed[2]) in _BACKWARD_ENTRIES:
                    anchor.sid = self.stacks.extend(0, fids[: depth + 1])
                    break
        return out

    # -- device -----------------------------------------------------------

    def link_device(self, device: list[_Event]) -> dict[int, dict[str, Any]]:
        """Link device events to ops; assign stream roles. Returns raw id → stream info."""
        launches = self.launches
        first_stream: dict[int, tuple[float, int]] = {}  # op → (launch ts, stream)
        op_streams: dict[int, set[int]] = {}
        stream_first: dict[int, float] = {}
        stream_events: dict[int, int] = {}
        comm_streams: set[int] = set()
        linked: set[int] = set()
        op_kind = self.op_kind
        no_launch = no_op = unlinked = 0
        for event in device:
            args = event.args
            stream = args.stream if args is not None else None
            if stream is None:
                unlinked += 1
                continue
            stream_events[stream] = stream_events.get(stream, 0) + 1
            if event.name.startswith(_COMM_KERNEL_PREFIXES):
                comm_streams.add(stream)
            correlation = args.correlation if args is not None else None
            if correlation is not None:
                linked.add(correlation)
            launch = launches.get(correlation) if correlation is not None else None
            if launch is None:
                no_launch += 1
                when = event.ts
            else:
                op, when, _ = launch
                if op < 0:
                    no_op += 1
                else:
                    if op_kind[op] == _COLLECTIVE:
                        comm_streams.add(stream)
                    previous = first_stream.get(op)
                    if previous is None or when < previous[0]:
                        first_stream[op] = (when, stream)
                    seen = op_streams.get(op)
                    if seen is None:
                        op_streams[op] = {stream}
                    else:
                        seen.add(stream)
            old = stream_first.get(stream)
            if old is None or when < old:
                stream_first[stream] = when
        self.count("device_events", len(device))
        self.count("device_events_without_launch", no_launch)
        self.count("launches_outside_ops", no_op)
        self.count("launches_without_device_events", self.unlinked_launches(linked))
        if unlinked:
            self.count("device_events_without_stream", unlinked)
        self.count("multi_stream_ops", sum(1 for s in op_streams.values() if len(s) > 1))
        self.op_first_stream = first_stream
        return self.roles(stream_first, stream_events, comm_streams)

    def unlinked_launches(self, linked: set[int]) -> int:
        """Kernel launches and copies with no device event: run after the window
        ended, or dropped (sampling)."""
        events = self.document.trace_events
        names: dict[str, bool] = {}
        missing = 0
        for correlation, (_, _, index) in self.launches.items():
            if correlation in linked:
                continue
            name = events[index].name
            issues = names.get(name)
            if issues is None:
                issues = names[name] = _DEVICE_WORK.search(name) is not None
            missing += issues
        return missing

    def roles(
        self, first: dict[int, float], events: dict[int, int], comm: set[int]
    ) -> dict[int, dict[str, Any]]:
        """Raw stream id → ``{"role", "device_events"}``; there is always a compute
        stream (the runtime's default id when no device event names one)."""
        default = 0 if self.hip else 7
        others = [s for s in first if s not in comm]
        if default in others:
            compute: int | None = default
            self.compute_rule = "default"
        elif others:
            compute = min(others)
            self.compute_rule = "lowest"
        else:
            compute = None
            self.compute_rule = "none"
        info: dict[int, dict[str, Any]] = {}
        has_device = bool(first)
        if compute is None:  # no device stream but comm, or no device at all (CPU)
            compute = default if has_device else 0
        info[compute] = {"role": "compute"}
        for n, stream in enumerate(sorted(comm, key=lambda s: (first[s], s))):
            info[stream] = {"role": "comm" if n == 0 else f"comm{n + 1}"}
        sides = sorted((s for s in others if s != compute), key=lambda s: (first[s], s))
        for n, stream in enumerate(sides):
            info[stream] = {"role": f"side{n + 1}"}
        for stream, entry in info.items():
            entry["device_events"] = events.get(stream, 0)
        return info

    # -- output -----------------------------------------------------------

    def op_streams(self, streams: dict[int, dict[str, Any]]) -> list[tuple[int, str]]:
        """(raw stream, role) of every counted op.

        An op is on the stream of its first device event; one that launched nothing
        is on the compute stream; a collective is always on a comm role: its comm
        stream, else the trace's first comm stream, else the pseudo-stream
        :data:`NO_STREAM` (no device stream: gloo, or its kernels outside the window).
        """
        role_of = {raw: entry["role"] for raw, entry in streams.items()}
        compute = next(raw for raw, role in role_of.items() if role == "compute")
        comm = next((raw for raw, role in role_of.items() if role == "comm"), None)
        first = self.op_first_stream
        out: list[tuple[int, str]] = []
        for number, kind in enumerate(self.op_kind):
            launched = first.get(number)
            stream = launched[1] if launched is not None else compute
            if kind == _COLLECTIVE and not role_of[stream].startswith("comm"):
                if comm is None:
                    comm = NO_STREAM
                    streams[NO_STREAM] = {"role": "comm", "device_events": 0}
                    role_of[NO_STREAM] = "comm"
                stream = comm
            out.append((stream, role_of[stream]))
        return out

    def build(self, streams: dict[int, dict[str, Any]]) -> dict[str, Any]:
        """Count ops per (stack, api, op, stream, role, dtype); intern frames in canonical
        order."""
        counts: dict[tuple[int, str | None, str, int, str, str | None], int] = {}
        profiler_ops = without_stack = 0
        stack_apis: dict[int, str | None] = {}
        profiler_frames: dict[int, bool] = {}
        placed = self.op_streams(streams)
        for number, op in enumerate(self.op_name):
            sid = self.op_sid[number]
            if self.op_kind[number] == _PROFILER_OP or self._from_profiler(sid, profiler_frames):
                profiler_ops += 1
                self.comm_ops.pop(number, None)  # the profiler's, not the program's
                continue
            if sid == 0:
                without_stack += 1
            api = self.op_api[number]
            if api is None and sid:
                api = self.stack_api(sid, stack_apis)
            key = (sid, api, op, *placed[number], self.op_dtype[number])
            counts[key] = counts.get(key, 0) + 1
        if profiler_ops:
            self.count("profiler_ops", profiler_ops)
        self.count("ops_without_stack", without_stack)
        frames, callsites = self.canonical(counts)
        document: dict[str, Any] = {
            "format": TRACE_FORMAT,
            "version": TRACE_VERSION,
            "meta": self.meta(streams, sum(counts.values())),
            "frames": frames,
            "callsites": callsites,
        }
        if self.comm_ops:
            sequence = self.sequence(document["meta"])
            if sequence is not None:
                document["collectives"] = Collectives(sequences=[sequence])
        return document

    def canonical(
        self, counts: dict[tuple[int, str | None, str, int, str, str | None], int]
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Frames sorted by value, callsites by (stack, api, op, role, dtype), no dtype
        first (formats.md §1's canonical output; two frame ids with equal values merge,
        and so do callsites that differ only in their raw stream, which is then the
        smallest: a collective on its comm stream and one whose kernels the window
        cut)."""
        expanded = {sid: self.stacks.frames(sid) for sid, *_ in counts}
        used = {fid for fids in expanded.values() for fid in fids}
        values = {fid: self.frames.frame(fid) for fid in used}
        order = sorted({frame_key(v) for v in values.values()})
        index_of = {key: i for i, key in enumerate(order)}
        fid_index = {fid: index_of[frame_key(v)] for fid, v in values.items()}
        self.fid_index = fid_index
        # a dtype name is never "": "" (no dtype) sorts first
        merged: dict[tuple[tuple[int, ...], str, str, str, str], tuple[int, int]] = {}
        for (sid, api, op, stream, role, dtype), n in counts.items():
            key = (tuple(fid_index[f] for f in expanded[sid]), api or "", op, role, dtype or "")
            count, low = merged.get(key, (0, stream))
            merged[key] = (count + n, min(low, stream))
        callsites: list[dict[str, Any]] = []
        for (stack, api, op, role, dtype), (n, stream) in sorted(merged.items()):
            site: dict[str, Any] = {"stack": list(stack)}
            if api:
                site["api"] = api
            site.update({"op": op, "stream": stream, "role": role})
            if dtype:
                site["dtype"] = dtype
            site["count"] = n
            callsites.append(site)
        return [_frame_from_key(key) for key in order], callsites

    # -- collective sequence ------------------------------------------------

    def sequence(self, meta: dict[str, Any]) -> CollectiveSequence | None:
        """The rank's collective sequence (docs/kineto.md, "Collective sequences"):
        every collective op in time order, described from its ``record_param_comms``,
        its ``nccl:*`` label and its own args; None when it issued none."""
        events = self.document.trace_events
        if not isinstance(self.document, _CommDocument):
            # collectives in a trace without distributedInfo in its head: decode the
            # args that describe them now (rare: a second decoding)
            events = _decode(self.data, _COMM_DECODER).trace_events
        groups = _GroupTable(self.document.distributed_info)
        step_of = self.step_numbering()
        op_ts, op_thread, op_name, op_sid = self.op_ts, self.op_thread, self.op_name, self.op_sid
        raw: dict[tuple[Any, ...], int] = {}
        recorder = StepRecorder()
        for number in sorted(self.comm_ops, key=lambda n: (op_ts[n], op_thread[n])):
            op = op_name[number]
            if not is_collective(op):
                continue  # a wait
            params = self.comm_params.get(number)
            label = self.comm_labels.get(number)
            group, dtype, numel, shapes, reduce_op = _describe(
                op,
                _comm_args(events[self.comm_ops[number]]),
                _comm_args(events[params]) if params is not None else None,
                _comm_args(events[label]) if label is not None else None,
                groups,
            )
            key = (op_sid[number], op, group, dtype, numel, shapes, reduce_op)
            index = raw.get(key)
            if index is None:
                index = raw[key] = len(raw)
            recorder.add(step_of(op_ts[number]), index)
        if not raw:
            return None
        fid_index, frames_of = self.fid_index, self.stacks.frames
        # a name is one group in a process: what one event left unknown, another may say
        merged: dict[str, GroupKey] = {}
        for _, _, (name, desc, size, members), *_ in raw:
            known = merged.get(name)
            if known is None:
                merged[name] = (name, desc, size, members)
            else:
                size = known[2] or size
                members = known[3] or members
                if size is not None and members and len(members) != size:
                    members = ()
                merged[name] = (name, known[1] or desc, size, members)
        group_ids = {name: n for n, name in enumerate(merged)}
        signatures: dict[Signature, int] = {}
        remap: list[int] = []
        for sid, op, group, dtype, numel, shapes, reduce_op in raw:  # in id order
            gid = group_ids[group[0]]
            signature = Signature(
                op=op,
                group=gid,
                dtype=dtype,
                numel=numel,
                shapes=shapes,
                reduce_op=reduce_op,
                stack=tuple(fid_index[f] for f in frames_of(sid)),
            )
            remap.append(signatures.setdefault(signature, len(signatures)))
        runs = remap_runs(recorder.finish(), remap)
        return CollectiveSequence(
            ranks=trace_ranks(meta, self.name),
            groups=[Group(name=n, desc=d, size=z, ranks=r) for n, d, z, r in merged.values()],
            signatures=list(signatures),
            steps=runs,
        )

    def step_numbering(self) -> Callable[[float], int]:
        """A collective's step from its start time: ``N0 + k``, where ``ProfilerStep#N0``
        is the trace's first profiler step (0 without any) and ``k`` the
        ``Optimizer.step#`` labels that ended before it (the tracer's optimizer steps
        finished, counted from the window's start); in a trace without optimizer
        labels, the number ``N`` of the last ``ProfilerStep#N`` started before it."""
        starts = sorted(self.step_starts)
        first = min(n for _, n in starts) if starts else 0
        if self.optimizer_ends:
            ends = sorted(self.optimizer_ends)
            return lambda ts: first + bisect_right(ends, ts)
        if not starts:
            return lambda ts: 0
        times = [ts for ts, _ in starts]
        numbers = [n for _, n in starts]

        def step(ts: float) -> int:
            at = bisect_right(times, ts) - 1
            return numbers[at] if at >= 0 else first

        return step

    def stack_api(self, sid: int, cache: dict[int, str | None]) -> str | None:
        """The backward api of the outermost backward entry on a stack, else None
        (an op under ``loss.backward()`` on its own thread: OpGuard's tracer records
        ``api: Tensor.backward`` for it)."""
        found = cache.get(sid, False)
        if found is not False:
            return found  # type: ignore[return-value]
        chain: list[int] = []
        parent, frame, parsed = self.stacks.parent, self.stacks.frame, self.frames.parsed
        api: str | None = None
        while sid > 0 and sid not in cache:
            chain.append(sid)
            sid = parent[sid]
        if sid > 0:
            api = cache[sid]
        for link in reversed(chain):  # outermost first: the first entry's api wins
            if api is None:
                info = parsed[frame[link]]
                if info is not None:
                    api = _BACKWARD_ENTRIES.get((info[0], info[2])) or None
            cache[link] = api
        return api

    def _from_profiler(self, sid: int, cache: dict[int, bool]) -> bool:
        """Whether the op's innermost frame is the profiler's own code."""
        if sid == 0:
            return False
        found = cache.get(sid)
        if found is None:
            parsed = self.frames.parsed[self.stacks.frame[sid]]
            found = parsed is not None and parsed[0].startswith(_PROFILER_FILES)
            cache[sid] = found
        return found

    def meta(self, streams: dict[int, dict[str, Any]], total: int) -> dict[str, Any]:
        info = self.document.distributed_info
        has_device = any(entry["device_events"] for entry in streams.values())
        meta: dict[str, Any] = {
            "source_format": "kineto",
            "importer": IMPORTER,
            "source": self.name,
            "device": ("rocm" if self.hip else "cuda") if has_device or self.hip else "cpu",
            "stack_source": self.stack_source,
            "ops": total,
        }
        if info is not None and info.rank is not None:
            meta["rank"] = info.rank
            meta["ranks"] = [info.rank]
        if info is not None and info.world_size is not None:
            meta["world_size"] = info.world_size
        if info is not None and info.backend is not None:
            meta["backend"] = info.backend
        if self.steps:
            meta["steps"] = len(self.steps)
            meta["profiler_steps"] = [min(self.steps), max(self.steps)]
        order = sorted(streams, key=lambda s: role_order(streams[s]["role"]))
        meta["streams"] = {str(s): streams[s]["role"] for s in order}
        meta["stream_events"] = {str(s): streams[s]["device_events"] for s in order}
        meta["compute_stream"] = self.compute_rule
        if self.backward["attributed"] or self.backward["ambiguous"]:
            meta["backward"] = self.backward
        start, end = self.window_bounds
        cut = 0
        if start is not None and end is not None:
            for ts, e in zip(self.op_ts, self.op_end, strict=True):
                if ts < start or e > end:
                    cut += 1
        self.count("ops_cut", cut)
        meta["window"] = dict(sorted(self.window.items()))
        return meta


def frame_key(frame: dict[str, Any]) -> tuple[str, int, str, str, str]:
    """A frame's fields as a sortable tuple (a reader interns and orders its frames by it)."""
    return (
        frame["file"],
        frame["line"],
        frame["function"],
        frame["qualname"],
        frame.get("module") or "",
    )


def _frame_from_key(key: tuple[str, int, str, str, str]) -> dict[str, Any]:
    file, line, function, qualname, module = key
    frame: dict[str, Any] = {"file": file, "line": line, "function": function, "qualname": qualname}
    if module:
        frame["module"] = module
    return frame


# ---------------------------------------------------------------------------
# collective sequences: what one collective op's events say about it
# ---------------------------------------------------------------------------

#: (name, desc, size, ranks) of a process group
GroupKey = tuple[str, str | None, int | None, tuple[int, ...]]

#: dtype names → torch's (without ``torch.``): c10's ScalarType names, which
#: ``record_param_comms`` writes as ``dtype``, and the C++ type names of ``Input type``
#: (:data:`~opguard_core.formats.dtypes.PROFILER_TYPES`)
_DTYPES: dict[str, str] = {
    "Float": "float32",
    "Double": "float64",
    "Half": "float16",
    "BFloat16": "bfloat16",
    "Long": "int64",
    "Int": "int32",
    "Short": "int16",
    "Char": "int8",
    "Byte": "uint8",
    "Bool": "bool",
    "UInt16": "uint16",
    "UInt32": "uint32",
    "UInt64": "uint64",
    "ComplexHalf": "complex32",
    "ComplexFloat": "complex64",
    "ComplexDouble": "complex128",
    "Float8_e4m3fn": "float8_e4m3fn",
    "Float8_e5m2": "float8_e5m2",
    "Float8_e4m3fnuz": "float8_e4m3fnuz",
    "Float8_e5m2fnuz": "float8_e5m2fnuz",
    **PROFILER_TYPES,
}
#: ``Input type`` of a list of tensors (its ``Input Dims`` entry: one shape per tensor)
_TENSOR_LISTS = frozenset({"TensorList", "GenericList"})

#: the position of a collective's input tensor(s) among its args, where it is not the
#: first: the argument OpGuard's tracer describes (``input``/``inputs``/``tensors``…
#: by schema name, else the first tensor argument; a scatter's output, the first, which
#: every rank holds; torch 2.13's schemas)
_INPUT_ARG: dict[str, int] = {
    "c10d::reduce_scatter_": 1,
    "c10d::reduce_scatter_tensor_coalesced_": 1,
    "c10d::alltoall_": 1,
    "c10d::alltoall_base_": 1,
    "c10d::gather_": 1,
    "c10d::allgather_": 1,
    "c10d::allgather_into_tensor_coalesced_": 1,
    "c10d::_reduce_scatter_base_": 1,
    "c10d::_allgather_base_": 1,
    "_c10d_functional::batch_p2p_ops": 3,
    "c10d_functional::batch_p2p_ops": 3,
}
#: the position of the reduce op (a string) in ``Concrete Inputs``
_REDUCE_ARG: dict[str, int] = {
    f"{ns}::{name}": 1
    for ns in ("_c10d_functional", "c10d_functional")
    for name in (
        "all_reduce",
        "all_reduce_",
        "all_reduce_coalesced",
        "all_reduce_coalesced_",
        "reduce_scatter_tensor",
        "reduce_scatter_tensor_out",
        "reduce_scatter_tensor_coalesced",
    )
}
#: the position of the group name in ``Concrete Inputs`` (functional collectives)
_GROUP_ARG: dict[str, int] = {
    "_c10d_functional::all_reduce": 2,
    "_c10d_functional::all_reduce_": 2,
    "_c10d_functional::all_reduce_coalesced": 2,
    "_c10d_functional::all_reduce_coalesced_": 2,
    "_c10d_functional::all_gather_into_tensor": 2,
    "_c10d_functional::all_gather_into_tensor_out": 2,
    "_c10d_functional::all_gather_into_tensor_coalesced": 2,
    "_c10d_functional::broadcast": 2,
    "_c10d_functional::broadcast_": 2,
    "_c10d_functional::reduce_scatter_tensor": 3,
    "_c10d_functional::reduce_scatter_tensor_out": 3,
    "_c10d_functional::reduce_scatter_tensor_coalesced": 3,
    "_c10d_functional::all_to_all_single": 3,
    "_c10d_functional::isend": 3,
    "_c10d_functional::irecv": 3,
    "_c10d_functional::batch_p2p_ops": 4,
}

_LISTS = msgspec.json.Decoder(list[Any])


def _decoded(raw: msgspec.Raw) -> list[Any] | None:
    """A raw ``Input Dims``/``Input type``/``Concrete Inputs`` as a list; None if absent
    or not a list."""
    if not raw:
        return None
    try:
        return _LISTS.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def _shape(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, list) and all(is_count(d) for d in value):
        return tuple(value)
    return None


def _shapes_at(
    dims: list[Any] | None, types: list[Any] | None, at: int
) -> tuple[tuple[int, ...], ...] | None:
    """The shapes of the tensor(s) of argument ``at``: one for a tensor, one per tensor
    for a list; None where unknown (an older profiler records a list's dims as ``[]``)."""
    if dims is None or types is None or at >= len(dims) or at >= len(types):
        return None
    kind, value = types[at], dims[at]
    if kind in _DTYPES:
        shape = _shape(value)
        return None if shape is None else (shape,)
    if kind in _TENSOR_LISTS and isinstance(value, list) and value:
        shapes = [_shape(v) for v in value]
        if all(s is not None for s in shapes):
            return tuple(s for s in shapes if s is not None)
    return None


def _tensor_shapes(
    dims: list[Any] | None, types: list[Any] | None
) -> tuple[tuple[int, ...], ...] | None:
    """The shapes of every tensor argument (an ``nccl:*`` label's args are the inputs)."""
    if dims is None or types is None:
        return None
    shapes: list[tuple[int, ...]] = []
    for at in range(min(len(dims), len(types))):
        found = _shapes_at(dims, types, at)
        if found is not None:
            shapes.extend(found)
    return tuple(shapes) or None


def _first_dtype(types: list[Any] | None) -> str | None:
    for kind in types or ():
        if isinstance(kind, str) and kind in _DTYPES:
            return _DTYPES[kind]
    return None


def _positive(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    return None


def _rank_list(value: Any) -> tuple[int, ...] | None:
    """``Process Group Ranks`` (a string ``"[0, 1]"``, or a list); None if unreadable
    (torch shortens long lists)."""
    if isinstance(value, str):
        try:
            value = _LISTS.decode(value)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
    if isinstance(value, list) and value and all(is_count(r) for r in value):
        return tuple(value)
    return None


class _GroupTable:
    """Process groups as ``record_param_comms`` and ``distributedInfo.pg_config``
    describe them; the default group ``"0"`` where a trace names none."""

    def __init__(self, info: _Distributed | None) -> None:
        self.world_size = _positive(info.world_size) if info is not None else None
        self.config: dict[str, tuple[str | None, int | None, tuple[int, ...] | None]] = {}
        config = info.pg_config if info is not None else None
        for entry in config if isinstance(config, list) else ():
            if not isinstance(entry, dict) or entry.get("pg_name") is None:
                continue
            desc = entry.get("pg_desc")
            self.config[str(entry["pg_name"])] = (
                desc if isinstance(desc, str) and desc else None,
                _positive(entry.get("pg_size")),
                _rank_list(entry.get("ranks")),
            )
        self.cache: dict[Any, GroupKey] = {}

    def key(self, name: Any, desc: Any, size: Any, ranks: Any) -> GroupKey:
        """A group from what the events say (any of it may be missing), completed from
        ``pg_config``; no name: the default group ``"0"``, of the world's size."""
        lookup: Any = (name, desc, size, ranks)
        try:
            found = self.cache.get(lookup)
        except TypeError:  # a JSON array or object among them: cached by its text
            lookup = msgspec.json.encode(lookup)
            found = self.cache.get(lookup)
        if found is not None:
            return found
        text = str(name) if isinstance(name, str | int) and str(name) else None
        group_desc = desc if isinstance(desc, str) and desc else None
        group_size = _positive(size)
        members = _rank_list(ranks)
        if text is None:
            text = "0"
            if group_size is None:
                group_size = self.world_size
        if text == "0" and members is None and group_size and group_size == self.world_size:
            members = tuple(range(group_size))  # the default group: every rank
        known = self.config.get(text)
        if known is not None:
            group_desc = group_desc or known[0]
            group_size = group_size or known[1]
            members = members or known[2]
        if members is not None and group_size is not None and len(members) != group_size:
            members = None
        if group_size is None and members is not None:
            group_size = len(members)
        found = self.cache[lookup] = (text, group_desc, group_size, members or ())
        return found


def _comm_args(event: _Event) -> _CommArgs | None:
    args = event.args
    return args if isinstance(args, _CommArgs) else None


def _describe(
    op: str,
    own: _CommArgs | None,
    params: _CommArgs | None,
    label: _CommArgs | None,
    groups: _GroupTable,
) -> tuple[GroupKey, str | None, int | None, tuple[tuple[int, ...], ...] | None, str | None]:
    """(group, dtype, numel, shapes, reduce op) of one collective op from its own args,
    its ``record_param_comms`` (``params``) and its ``nccl:*`` label; unknowns None."""
    dims = _decoded(own.input_dims) if own is not None else None
    types = _decoded(own.input_type) if own is not None else None
    concrete = _decoded(own.concrete) if own is not None else None
    at = _INPUT_ARG.get(op, 0)
    shapes = _shapes_at(dims, types, at)
    label_types = _decoded(label.input_type) if label is not None else None
    if shapes is None and label is not None:
        shapes = _tensor_shapes(_decoded(label.input_dims), label_types)
    if shapes is None and params is not None:
        shapes = _shapes_at(_decoded(params.input_dims), _decoded(params.input_type), 0)
    numel: int | None = None
    if shapes is not None:
        numel = sum(math.prod(shape) for shape in shapes)
    elif params is not None and is_count(params.in_nelems):
        numel = params.in_nelems
    dtype: str | None = None
    if params is not None and isinstance(params.dtype, str):
        dtype = _DTYPES.get(params.dtype)
    if dtype is None:
        dtype = _first_dtype(label_types)
    if dtype is None and types is not None and at < len(types):
        kind = types[at]
        dtype = _DTYPES.get(kind) if isinstance(kind, str) else None
    reduce_op: str | None = None
    where = _REDUCE_ARG.get(op)
    if where is not None and concrete is not None and where < len(concrete):
        value = concrete[where]
        reduce_op = value.lower() if isinstance(value, str) and value else None
    name = params.pg_name if params is not None else None
    if name is None or name == "":
        name = _concrete_group(op, concrete)
    if params is not None:
        group = groups.key(name, params.pg_desc, params.group_size, params.pg_ranks)
    else:
        group = groups.key(name, None, None, None)
    return group, dtype, numel, shapes, reduce_op


def _concrete_group(op: str, concrete: list[Any] | None) -> Any:
    where = _GROUP_ARG.get(op)
    if where is not None and concrete is not None and where < len(concrete):
        return concrete[where]
    return None
