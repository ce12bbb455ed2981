"""Callsite tracer runtime: records which torch operators ran, from where (formats.md §1).

Two of torch's Python-level modes are pushed for the traced region:

* a :class:`~torch.overrides.TorchFunctionMode` sees every *public* torch callable that
  Python code invokes (``torch.cat``, ``Tensor.reshape``, ``torch.nn.functional.linear``)
  and remembers it, per thread, as the current ``api`` while the call runs (torch
  disables the mode inside the call, so this is always the outermost public call);
* a :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees every operator that
  reaches the dispatcher (``aten::addmm``, ``c10d::allreduce_``, ``fsdp::chunk_cat``)
  and records it with the current Python stack (a ``sys._getframe`` walk), the current
  ``api``, the device stream and the op's dtype (its first tensor argument's:
  :func:`~opguard_plugins.record.dtypes.op_dtype`, formats.md "Dtypes").

Identical (stack, api, op, stream, dtype) tuples are counted. Each callsite is written with
its raw stream id and its stream role (formats.md, "Streams and roles": a collective
op is on ``comm``, whichever stream called it, as NCCL runs it on its own stream;
the default stream, id 0, is ``compute``; other streams are ``side1``, ``side2``, … in
order of first use, :class:`~opguard_core.formats.streams.StreamRoles`). Stacks are kept as raw
``(id(code), f_lasti)`` positions while recording; turning positions into lines, code
objects into frames (relative paths, module names) and dropping the tracer's own frames
and torch's dispatch plumbing happens once, when the trace is written. The per-operator
path runs in C (``opguard_plugins/record/_recorder.c``) when that extension was built, and
in Python otherwise or with ``OPGUARD_PURE_PYTHON=1`` (:mod:`opguard_core.native`): same
keys, same trace (tracing.md, "The recorder's fast path").

Backward: on CPU the autograd engine runs backward on the thread that called
``.backward()``, so backward ops carry that Python stack naturally, with ``api``
``Tensor.backward``. On CUDA, the engine runs backward on its device threads, which
have no Python stack of the forward; torch propagates the dispatch mode to them, and
ops seen on a thread other than the one that started a backward, while a backward is
running, are attributed to the stack (and ``api``) recorded when ``Tensor.backward`` /
``torch.autograd.backward`` / ``torch.autograd.grad`` was called, followed by any
Python frames of that thread (a custom ``autograd.Function.backward``).

Collectives: on torch 2.13 with gloo (and NCCL), ``torch.distributed`` collectives go
through the dispatcher as ``c10d::`` operators (functional collectives, used by
``torch.compile``, DTensor and tensor parallelism, as ``_c10d_functional::``), so the
dispatch mode records them like any other op, including those DDP's reducer issues
from autograd hooks during backward. Each collective is also appended, with its
process group, dtype, shapes and reduce op, to the rank's collective sequence
(:mod:`opguard_plugins.record.collectives`, formats.md "Collective sequences"), and
a custom op's kernels are run so that the collectives they issue are recorded too.

:class:`CallsiteTracer` is also the base of the ``profiler`` backend
(:mod:`opguard_plugins.record.profiler`). The ways to run a tracer, ``trace_callsites``
(a context manager, public as ``opguard_plugins.tracer.trace_callsites``) and
``start_process_tracer`` (``opguard trace``'s bootstrap), choose the backend in
:mod:`opguard_plugins.record.backends`.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import os
import platform
import shlex
import site
import sys
import sysconfig
import tempfile
import threading
import types
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.overrides import TorchFunctionMode, resolve_name
from torch.utils._python_dispatch import TorchDispatchMode

from opguard_core.files.atomic import atomic_write_bytes
from opguard_core.formats.collectives import Collectives, CollectiveSequence, is_collective
from opguard_core.formats.streams import StreamRoles, is_comm_op
from opguard_core.formats.trace import LOOP_PHASE, SETUP_PHASE, Frame, encode_trace
from opguard_core.native import load_native
from opguard_plugins.record.collectives import SequenceRecorder, describe, diverts, run_nested
from opguard_plugins.record.dtypes import native_naming, op_dtype

if TYPE_CHECKING:
    from opguard_plugins.record._recorder import Counter

#: ``meta.tracer``. Version 2 (issue 29): both backends name ``__main__``'s functions
#: alike, write ``meta.tracer_backend`` and ``meta.steps``, and keep compile-time work
#: out (:data:`COMPILER_FILES`); a trace of version 1 without ``tracer_backend`` is
#: the ``modes`` backend's (:func:`opguard_core.formats.trace.recorded_by`). Version 3:
#: the set-up apart from the loop (:data:`SETUP_PHASE`), ``profiler::`` ops left out.
TRACER_NAME = "opguard/3"
#: ``meta.tracer_backend`` of this backend (the ``profiler`` backend overrides it).
BACKEND_NAME = "modes"
#: ops of this namespace (``record_function``'s enter and exit, which torch's optimizers
#: and ``zero_grad`` issue) are profiling marks, not the program's work: left out, as
#: the ``profiler`` backend and the Kineto reader leave them out
PROFILER_NAMESPACE = "profiler::"

#: torch callables whose call starts an autograd backward pass.
BACKWARD_APIS = frozenset({"Tensor.backward", "torch.autograd.backward", "torch.autograd.grad"})

_THIS_FILE = os.path.normcase(os.path.abspath(__file__))
#: the tracer's own files, whose frames never show in a stack
_OWN_FILES = frozenset(
    {_THIS_FILE, os.path.normcase(os.path.join(os.path.dirname(_THIS_FILE), "collectives.py"))}
)
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
#: Files whose frames are dispatch plumbing: they only forward a call into a mode.
_PLUMBING_FILES = frozenset(
    os.path.normcase(os.path.join(_TORCH_DIR, *parts))
    for parts in (("overrides.py",), ("utils", "_python_dispatch.py"))
)
#: Files of the wrappers torch puts around a mode's ``__torch_dispatch__``.
_WRAPPER_FILES = frozenset(
    os.path.join(_TORCH_DIR, *parts) for parts in (("_compile.py",), ("_dynamo", "eval_frame.py"))
)
#: How far back a re-entered function is looked for after a run of plumbing frames.
_REENTRY_DEPTH = 3
_OPS_FILE = os.path.normcase(os.path.join(_TORCH_DIR, "_ops.py"))
#: Where ``torch.compile`` compiles, relative to torch's directory: Dynamo converting
#: a frame (tracing it with fake tensors, then calling the backend compiler for the
#: forward) and AOTAutograd's compiler wrappers (the backward, compiled lazily at the
#: first backward pass: ``AotAutograd.__call__.<locals>.wrap_bw_compiler``). An op
#: with a frame of these files on its stack is compile-time work, not the program's:
#: both backends leave it out and count it in ``meta.compile_ops`` (tracing.md,
#: "torch.compile").
COMPILER_PARTS = (("_dynamo", "convert_frame.py"), ("_dynamo", "backends", "common.py"))
COMPILER_FILES = frozenset(
    os.path.normcase(os.path.join(_TORCH_DIR, *parts)) for parts in COMPILER_PARTS
)
#: Inductor's default cache directory prefix (``$TORCHINDUCTOR_CACHE_DIR`` overrides it)
_INDUCTOR_CACHE_PREFIX = os.path.join(tempfile.gettempdir(), "torchinductor_")


def is_generated_file(filename: str) -> bool:
    """Is ``filename`` code that ``torch.compile`` or FX generated at run time?

    FX's ``GraphModule`` code (``<eval_with_key>.N``) and Inductor's generated modules
    (hash-named files in its cache directory): their frames never show in a stack, as
    their names change from run to run; their ops stay, attributed to the program's
    frames above them.
    """
    if filename.startswith("<eval_with_key>"):
        return True
    if filename.startswith("<"):
        return False
    path = os.path.abspath(filename)
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")  # set by Inductor once it ran
    if cache and path.startswith(os.path.join(os.path.abspath(cache), "")):
        return True
    return path.startswith(_INDUCTOR_CACHE_PREFIX)


#: A raw stack: ``id(code), position`` flattened, outermost first; a position is the
#: frame's ``f_lasti`` (the modes backend; turned into a line when the trace is built)
#: or a line (the profiler backend). Keying by ``id`` avoids hashing code objects (not
#: cached on Python 3.11); the recorder's ``codes`` table keeps every code object
#: alive, so an id stays unique.
RawStack = tuple[int, ...]
#: what the recorder counts: (raw stack, api, op, raw stream, dtype)
Key = tuple[RawStack, "str | None", str, int, "str | None"]


def _native_counter() -> type[Counter] | None:
    """The C fast path of the modes backend, or None: the Python path (not built, or
    ``OPGUARD_PURE_PYTHON=1``; :func:`opguard_core.native.load_native`)."""
    if load_native("opguard_plugins.record._recorder") is None:
        return None
    from opguard_plugins.record._recorder import Counter

    return Counter


_Counter = _native_counter()


# ---------------------------------------------------------------------------
# Names
# ---------------------------------------------------------------------------

_API_CACHE: dict[Any, str | None] = {}


def api_name(func: Callable[..., Any]) -> str | None:
    """The public name of a torch callable seen by a ``TorchFunctionMode``.

    ``torch.Tensor.reshape`` reads ``Tensor.reshape``, a property getter
    (``Tensor.shape.__get__``) reads ``Tensor.shape``, an operator overload reads
    ``torch.ops.aten.add.Tensor``; a function torch does not list is named by its
    shortest public module path (``torch.distributed.all_reduce``).
    """
    try:
        return _API_CACHE[func]
    except KeyError:
        pass
    except TypeError:  # unhashable callable
        return _resolve_api_name(func)
    name = _resolve_api_name(func)
    if len(_API_CACHE) < 100_000:
        _API_CACHE[func] = name
    return name


def _resolve_api_name(func: Callable[..., Any]) -> str | None:
    if isinstance(func, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        return f"torch.ops.{func}"
    try:
        name = resolve_name(func)
    except Exception:
        name = None
    if name:
        if name.endswith(".__get__"):
            name = name[: -len(".__get__")]
        name = _prefer_own_name(name, func)
        if name.startswith("torch.Tensor."):
            name = name[len("torch.") :]
        return name
    module = getattr(func, "__module__", None)
    qualname = getattr(func, "__qualname__", None) or getattr(func, "__name__", None)
    if not qualname:
        return None
    if not module:
        return str(qualname)
    if "." not in qualname:
        parts = module.split(".")
        for end in range(1, len(parts)):
            prefix = ".".join(parts[:end])
            if getattr(sys.modules.get(prefix), qualname, None) is func:
                return f"{prefix}.{qualname}"
    return f"{module}.{qualname}"


def _prefer_own_name(name: str, func: Callable[..., Any]) -> str:
    """``torch.spmm`` is ``torch.mm``: prefer the alias that matches ``func.__name__``."""
    own = getattr(func, "__name__", None)
    prefix, _, last = name.rpartition(".")
    if not own or own == last or not prefix or own.startswith("_"):
        return name
    holder: Any = sys.modules.get(prefix)
    if holder is None and prefix.startswith("torch.Tensor"):
        holder = torch.Tensor
    if holder is not None and getattr(holder, own, None) is func:
        return f"{prefix}.{own}"
    return name


_OP_CACHE: dict[Any, str] = {}
#: op names the C path hands to Python with their arguments (collectives, custom ops
#: that may issue one: :func:`opguard_plugins.record.collectives.diverts`)
_DIVERT: set[str] = set()


def op_name(func: Any) -> str:
    """``namespace::name`` of an operator overload, without the overload suffix."""
    try:
        return _OP_CACHE[func]
    except (KeyError, TypeError):
        pass
    schema = getattr(func, "_schema", None)
    if schema is not None:
        name = str(schema.name)
    else:  # a higher-order operator or something unusual
        name = str(getattr(func, "name", None) or getattr(func, "__name__", func))
        if callable(name):
            name = str(func)
        if "::" not in name:
            name = f"{getattr(func, 'namespace', 'unknown')}::{name}"
    name = name.split(".", 1)[0] if "::" in name and "." in name.split("::", 1)[1] else name
    if diverts(name):
        _DIVERT.add(name)  # before the cache: the C path checks the name it finds there
    with contextlib.suppress(TypeError):
        _OP_CACHE[func] = name
    return name


# ---------------------------------------------------------------------------
# Recording
# ---------------------------------------------------------------------------


class _BackwardContext:
    """The stack and api of a running backward pass, for ops on autograd's threads."""

    __slots__ = ("api", "stack", "thread")

    def __init__(self, stack: RawStack, api: str, thread: int) -> None:
        self.stack = stack
        self.api = api
        self.thread = thread


def _walk(
    frame: types.FrameType | None,
    codes: dict[int, types.CodeType],
    modules: dict[types.CodeType, str | None],
) -> RawStack:
    """The raw stack from ``frame`` outwards, outermost first (``_recorder.c`` mirrors it)."""
    stack: list[int] = []
    append = stack.append
    while frame is not None and frame.f_code.co_filename in _WRAPPER_FILES:
        frame = frame.f_back  # torch wraps __torch_dispatch__ in a dynamo-disable wrapper
    while frame is not None:
        code = frame.f_code
        key = id(code)
        if key not in codes:
            codes[key] = code
            modules[code] = frame.f_globals.get("__name__")
        append(frame.f_lasti)  # reversed below: (id, position) pairs, outermost first
        append(key)
        frame = frame.f_back
    stack.reverse()
    return tuple(stack)


LineTable = tuple[list[int], list["int | None"]]


def line_at(
    code: types.CodeType, offset: int, tables: dict[types.CodeType, LineTable] | None = None
) -> int:
    """The line of the instruction at byte ``offset`` (what ``frame.f_lineno`` reads
    when ``frame.f_lasti == offset``); the first line when the offset has none.
    ``tables`` caches each code's line table between calls (one trace's build)."""
    table = tables.get(code) if tables is not None else None
    if table is None:
        starts: list[int] = []
        lines: list[int | None] = []
        for start, _end, line in code.co_lines():
            starts.append(start)
            lines.append(line)
        table = (starts, lines)
        if tables is not None:
            tables[code] = table
    index = bisect.bisect_right(table[0], offset) - 1
    line = table[1][index] if index >= 0 else None
    return code.co_firstlineno if line is None else line


class _ThreadApi(threading.local):
    """Per thread: the public torch callable running (None outside one); a class
    default, so reading it on a new thread raises no AttributeError (the C path)."""

    api: str | None = None


class CallsiteRecorder:
    """Counts (stack, api, op, stream, dtype) tuples; thread-safe."""

    def __init__(self, *, accelerated: bool = True) -> None:
        self._counts: dict[Key, int] = {}
        self.modules: dict[types.CodeType, str | None] = {}
        self.codes: dict[int, types.CodeType] = {}
        self.rank: int | None = None
        self.world_size: int | None = None
        self.device = "cpu"
        self._lock = threading.RLock()
        self._local = _ThreadApi()
        self._backward: list[_BackwardContext] = []
        self._cuda = torch.cuda.is_available()
        #: roles of the raw streams seen (each op's stream is noted, in order)
        self.streams = StreamRoles()
        #: the collective sequence; ``step`` is the step collectives are recorded in
        self.sequence = SequenceRecorder()
        self.step = 0
        self._active = False
        #: the C fast path (``_recorder.Counter``), or None: :meth:`record` does it all
        self.counter: Counter | None = None
        overridden = any(
            getattr(type(self), name) is not getattr(CallsiteRecorder, name)
            for name in ("record", "call", "enter_api", "exit_api", "dispatch")
        )
        if accelerated and _Counter is not None and not overridden:
            self.counter = _Counter(
                self._counts,
                self.codes,
                self.modules,
                _OP_CACHE,
                self._local,
                self._backward,
                _WRAPPER_FILES,
                self.record,
                _API_CACHE,
                BACKWARD_APIS,
                self.enter_api,
                self.exit_api,
                torch._ops.OpOverload,
                self.current_stream if self._cuda else None,
                _DIVERT,
                self.dispatch,
                *native_naming(),
            )

    @property
    def counts(self) -> dict[Key, int]:
        """Count per (stack, api, op, stream, dtype), the C path's pending counts included."""
        if self.counter is not None:
            self.counter.flush()
        return self._counts

    @property
    def active(self) -> bool:
        return self._active

    @active.setter
    def active(self, value: bool) -> None:
        self._active = value
        if self.counter is not None:
            self.counter.active = value

    def line(
        self, code: types.CodeType, position: int, tables: dict[types.CodeType, LineTable]
    ) -> int:
        """The line of a raw stack's position in ``code`` (an ``f_lasti`` offset here)."""
        return line_at(code, position, tables)

    def reset_after_fork(self) -> None:
        """In a forked child: forget the parent's counts; new locks (a lock held by
        another thread at the fork would stay held forever), no running backward."""
        self._lock = threading.RLock()
        self._counts.clear()  # in place: the C path holds these two
        self._backward.clear()
        self.sequence.reset()
        if self.counter is not None:
            self.counter.discard()

    # -- api (TorchFunctionMode side) ---------------------------------------

    def call(
        self,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        frame: types.FrameType | None,
    ) -> Any:
        """Run ``func`` with it marked as this thread's current api."""
        if getattr(self._local, "api", None) is not None:
            return func(*args, **kwargs)
        context = self.enter_api(func, frame)
        try:
            return func(*args, **kwargs)
        finally:
            self.exit_api(context)

    def enter_api(
        self, func: Callable[..., Any], frame: types.FrameType | None
    ) -> _BackwardContext | None:
        """Mark ``func``'s public name as this thread's api; for a backward pass, also
        remember the stack that started it (returned, for :meth:`exit_api`)."""
        name = api_name(func)
        self._local.api = name
        if name not in BACKWARD_APIS:
            return None
        context = _BackwardContext(
            _walk(frame, self.codes, self.modules), name, threading.get_ident()
        )
        with self._lock:
            self._backward.append(context)
        return context

    def exit_api(self, context: _BackwardContext | None) -> None:
        """Undo :meth:`enter_api` once the call returned or raised."""
        self._local.api = None
        if context is not None:
            with self._lock:
                self._backward.remove(context)

    # -- ops (TorchDispatchMode side) -----------------------------------------

    def dispatch(
        self,
        func: Any,
        frame: types.FrameType | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None,
    ) -> Any:
        """Record one operator call issued from ``frame`` and run it (the dispatch
        mode's work; the C path hands over a new operator, a collective and a custom
        op, whose kernels may issue collectives: :func:`run_nested`)."""
        self.record(func, frame, args, kwargs)
        if self._active and op_name(func) in _DIVERT and not is_comm_op(op_name(func)):
            return run_nested(func, args, kwargs, self.record, op_name)
        return func(*args, **(kwargs or {}))

    def record(
        self,
        func: Any,
        frame: types.FrameType | None,
        args: tuple[Any, ...] | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> None:
        """Count one operator call issued from ``frame`` (the C fast path hands over the
        cases it leaves to Python: a new operator, a collective, a backward, with the
        positional arguments); its dtype is read from ``args`` (None without them); a
        collective whose arguments are given joins the collective sequence."""
        if not self._active:
            return
        op = op_name(func)
        api = getattr(self._local, "api", None)
        stack = _walk(frame, self.codes, self.modules)
        if api is None and self._backward:
            # An op on a thread that did not start the running backward: an autograd
            # engine thread. Attribute it to the stack that called .backward().
            me = threading.get_ident()
            with self._lock:
                contexts = [c for c in self._backward if c.thread != me]
            if contexts:
                context = contexts[-1]
                stack = context.stack + stack
                api = context.api
        stream = self.current_stream() if self._cuda else 0
        if is_comm_op(op) and self.rank is None:
            self.snapshot_rank()
        key = (stack, api, op, stream, op_dtype(args) if args is not None else None)
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + 1
        if args is not None and is_collective(op):
            self.sequence.add(stack, op, describe(func, op, args, kwargs), self.step)

    def current_stream(self) -> int:
        """The id of this thread's current CUDA stream (0 before CUDA is initialised)."""
        # torch.cuda.is_initialized has no annotations (unused where torch is absent)
        if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call, unused-ignore]
            return 0
        self.device = "cuda"
        return self.streams.see(int(torch.cuda.current_stream().stream_id))

    def snapshot_rank(self) -> None:
        """Remember rank and world size while the default process group exists."""
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                self.rank = dist.get_rank()
                self.world_size = dist.get_world_size()
        except Exception:
            pass


#: function modes whose ``__torch_function__`` is a C method bound on the instance
#: (:func:`bind_fast_function`), which Dynamo cannot trace
_FAST_FUNCTION_MODES: weakref.WeakSet[Any] = weakref.WeakSet()
#: what was unbound while ``torch.compile`` compiles: mode -> its C method
_UNBOUND: dict[Any, Any] = {}


def bind_fast_function(mode: Any, method: Callable[..., Any]) -> None:
    """Make ``method`` (a C ``__torch_function__``) ``mode``'s, as an instance
    attribute (torch calls it with no Python frame in between). While ``torch.compile``
    compiles (Dynamo's compile callbacks) it is taken off, so Dynamo traces the class's
    Python ``__torch_function__``, which passes every call through while compiling
    (``torch.compiler.is_compiling()``): a program compiles under the tracer and the
    guard as it does untraced (tracing.md, "Backends")."""
    mode.__torch_function__ = types.MethodType(method, mode)
    _FAST_FUNCTION_MODES.add(mode)
    # registered again when gone: ``torch._dynamo.reset()`` clears the callbacks
    handler = getattr(getattr(torch, "_dynamo", None), "callback_handler", None)
    if handler is not None and _unbind_for_compile not in handler.start_callbacks:
        handler.register_start_callback(_unbind_for_compile)
        handler.register_end_callback(_rebind_after_compile)


def _unbind_for_compile(_args: Any) -> None:
    for mode in list(_FAST_FUNCTION_MODES):
        method = mode.__dict__.pop("__torch_function__", None)
        if method is not None:
            _UNBOUND[mode] = method


def _rebind_after_compile(_args: Any) -> None:
    while _UNBOUND:
        mode, method = _UNBOUND.popitem()
        mode.__torch_function__ = method


# Without torch, mypy sees its mode classes as Any: subclassing them is `misc`.
class _FunctionMode(TorchFunctionMode):  # type: ignore[misc, unused-ignore]
    """Learns the public torch callable that Python code invoked."""

    def __init__(self, recorder: CallsiteRecorder) -> None:
        super().__init__()
        self.recorder = recorder
        if recorder.counter is not None:  # the C path, bound as a method (torch wants one)
            bind_fast_function(self, recorder.counter.function)

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if torch.compiler.is_compiling():  # Dynamo traces the call into its graph
            return func(*args, **(kwargs or {}))
        return self.recorder.call(func, args, kwargs or {}, sys._getframe(1))


# TorchDispatchMode's __init_subclass__ and __init__ have no annotations; without torch
# the class is Any (misc)
class _DispatchMode(TorchDispatchMode):  # type: ignore[no-untyped-call, misc, unused-ignore]
    """Sees every operator that ran and records it with the Python stack."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """``torch.compile`` compiles under this mode (torch would otherwise run a
        compiled function eagerly); the compiled code's operators still come here."""
        return True

    def __init__(self, recorder: CallsiteRecorder) -> None:
        super().__init__()  # type: ignore[no-untyped-call, unused-ignore]
        self.recorder = recorder
        if recorder.counter is not None:  # the C path: no Python frame per operator
            self.__torch_dispatch__ = types.MethodType(recorder.counter.dispatch, self)  # type: ignore[method-assign]

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        return self.recorder.dispatch(func, sys._getframe(1), args, kwargs)


def count_optimizer_steps(callback: Callable[[Any], None]) -> Any:
    """Call ``callback(optimizer)`` after every optimizer step of the process (any
    optimizer).

    Uses torch's global ``register_optimizer_step_post_hook``; returns its removable
    handle. Shared by the tracer (``meta.steps``) and the guard (``--sample``).
    """
    from torch.optim.optimizer import register_optimizer_step_post_hook

    return register_optimizer_step_post_hook(lambda optimizer, args, kwargs: callback(optimizer))


class SetupEnd:
    """Where the set-up ends (tracing.md, "Set-up and loop"): at the end of the first
    step of each optimizer that steps before any optimizer steps a second time, the
    last such end. A program of one optimizer: its first step. A GAN (the
    discriminator's optimizer, then the generator's, each iteration): the generator's
    first step, so both optimizers' lazy state is set-up and every loop iteration is
    alike. Shared by the tracers and the guard."""

    def __init__(self) -> None:
        self._seen: weakref.WeakSet[Any] = weakref.WeakSet()
        #: an optimizer stepped a second time: no later first step is the set-up's
        self.closed = False
        #: optimizer steps up to the set-up's end so far (``meta.steps`` of the set-up)
        self.steps = 0

    def first(self, optimizer: Any) -> bool:
        """Whether a step of ``optimizer`` (about to run) is one the set-up holds."""
        return not self.closed and optimizer not in self._seen

    def ended(self, optimizer: Any, steps: int) -> bool:
        """After a step of ``optimizer`` (``steps`` counted so far): whether the set-up
        ends here (until a later first step moves its end)."""
        if self.closed:
            return False
        if optimizer in self._seen:
            self.closed = True
            return False
        self._seen.add(optimizer)
        self.steps = steps
        return True


# ---------------------------------------------------------------------------
# Frames and paths
# ---------------------------------------------------------------------------


def _path_roots(program_roots: list[str]) -> list[str]:
    """Directories that recorded file paths are made relative to (longest wins)."""
    roots: list[str] = []
    candidates: list[str] = []
    with contextlib.suppress(AttributeError):  # old virtualenv site.py
        candidates.extend(site.getsitepackages())
    user_site = site.getusersitepackages() if hasattr(site, "getusersitepackages") else None
    if isinstance(user_site, str):
        candidates.append(user_site)
    candidates.extend(
        p for p in sys.path if p.rstrip("/").endswith(("site-packages", "dist-packages"))
    )
    paths = sysconfig.get_paths()
    candidates.extend(
        paths[k] for k in ("purelib", "platlib", "stdlib", "platstdlib") if k in paths
    )
    candidates.extend(program_roots)
    for candidate in candidates:
        if not candidate:
            continue
        root = os.path.normcase(os.path.abspath(candidate)).rstrip(os.sep) + os.sep
        if root not in roots:
            roots.append(root)
    roots.sort(key=len, reverse=True)
    return roots


def default_program_roots() -> list[str]:
    """The traced program's roots: its script's directory and the working directory."""
    roots: list[str] = []
    argv0 = sys.argv[0] if sys.argv else ""
    if argv0 and argv0 not in {"-c", "-m"} and os.path.isfile(argv0):
        roots.append(os.path.dirname(os.path.abspath(argv0)))
    main = sys.modules.get("__main__")
    main_file = getattr(main, "__file__", None)
    if isinstance(main_file, str) and getattr(main, "__spec__", None) is None:
        roots.append(os.path.dirname(os.path.abspath(main_file)))
    roots.append(os.getcwd())
    return roots


def program_module_name(name: str | None, filename: str) -> str | None:
    """The module name a trace records for code whose globals' ``__name__`` is
    ``name``: ``__main__`` becomes the script's module (``python -m pkg.train``: its
    spec's name) or its file's stem (``python train.py``: ``train``), so a script's
    functions are named alike however it is run. The runtime guard names frames the
    same way (docs/guard.md)."""
    if name != "__main__":
        return name
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and getattr(main, "__file__", None) == filename:
        return str(spec.name)
    if not filename.startswith("<"):
        return Path(filename).stem
    return name


class _FrameMaker:
    """Turns raw (code, line) pairs into interned :class:`Frame` values."""

    def __init__(self, modules: dict[types.CodeType, str | None], roots: list[str]) -> None:
        self.modules = modules
        self.roots = roots
        self._files: dict[str, str] = {}
        self._hidden: dict[types.CodeType, bool] = {}
        self._generated: dict[types.CodeType, bool] = {}
        self._compiling: dict[types.CodeType, bool] = {}
        self._module_names: dict[types.CodeType, str | None] = {}

    def relative(self, filename: str) -> str:
        cached = self._files.get(filename)
        if cached is not None:
            return cached
        result = filename
        if not filename.startswith("<"):
            absolute = os.path.normcase(os.path.abspath(filename))
            for root in self.roots:
                if absolute.startswith(root):
                    result = absolute[len(root) :].replace(os.sep, "/")
                    break
        self._files[filename] = result
        return result

    def hidden(self, code: types.CodeType) -> bool:
        """Is this frame the tracer's own or torch's dispatch plumbing?"""
        cached = self._hidden.get(code)
        if cached is not None:
            return cached
        filename = os.path.normcase(os.path.abspath(code.co_filename))
        hidden = (
            filename in _OWN_FILES
            or filename in _PLUMBING_FILES
            or (filename == _OPS_FILE and code.co_name in ("__call__", "redispatch"))
        )
        self._hidden[code] = hidden
        return hidden

    def generated(self, code: types.CodeType) -> bool:
        """Is this frame code generated at run time (:func:`is_generated_file`)?"""
        cached = self._generated.get(code)
        if cached is None:
            cached = self._generated[code] = is_generated_file(code.co_filename)
        return cached

    def compiling(self, code: types.CodeType) -> bool:
        """Is this a frame of ``torch.compile`` compiling (:data:`COMPILER_FILES`)?"""
        cached = self._compiling.get(code)
        if cached is None:
            filename = code.co_filename
            cached = not filename.startswith("<") and (
                os.path.normcase(os.path.abspath(filename)) in COMPILER_FILES
            )
            self._compiling[code] = cached
        return cached

    def module_name(self, code: types.CodeType) -> str | None:
        if code in self._module_names:
            return self._module_names[code]
        name = program_module_name(self.modules.get(code), code.co_filename)
        self._module_names[code] = name
        return name

    def clean(self, stack: list[tuple[types.CodeType, int]]) -> list[tuple[types.CodeType, int]]:
        """Drop hidden frames; where a call re-enters the function that dispatched it
        to a mode (``handle_torch_function``), keep only the inner, executing frame."""
        kept: list[tuple[types.CodeType, int]] = []
        after_hidden = False
        for code, line in stack:
            if self.generated(code):
                continue  # not plumbing: what follows re-enters nothing
            if self.hidden(code):
                after_hidden = True
                continue
            if after_hidden:
                # The call re-entered (possibly through its decorator) a function that
                # handed it to the mode: drop the outer copies of those frames.
                for back in range(1, min(_REENTRY_DEPTH, len(kept)) + 1):
                    if kept[-back][0] is code:
                        del kept[-back:]
                        break
            after_hidden = False
            kept.append((code, line))
        return kept

    def frame(self, code: types.CodeType, line: int) -> Frame:
        return Frame(
            file=self.relative(code.co_filename),
            line=line,
            function=code.co_name,
            qualname=code.co_qualname,
            module=self.module_name(code),
        )


# ---------------------------------------------------------------------------
# The tracer
# ---------------------------------------------------------------------------


class CallsiteTracer:
    """Records callsites while started; :meth:`write` saves them as a trace file."""

    #: ``meta.tracer_backend``
    backend = BACKEND_NAME
    #: start recording at the program's first torch call rather than at :meth:`start`
    #: (set for a whole process, started at ``import torch``); the ``modes`` backend
    #: records from :meth:`start` either way (its modes cost nothing before a call)
    start_at_first_call = False
    #: write the set-up phase (up to the end of the first optimizer step) apart from
    #: the loop (tracing.md, "Set-up and loop"); False: one file for the whole process
    split_setup = True

    def __init__(
        self,
        label: str = "trace",
        output_dir: str | os.PathLike[str] = ".",
        rank: int | None = None,
        command: str | None = None,
        extra_meta: dict[str, Any] | None = None,
    ) -> None:
        self.label = label
        #: the label given; ``label`` differs in a forked child
        #: (:func:`~opguard_plugins.record.backends.fork_label`)
        self.base_label = label
        self.marker: Path | None = None
        self.output_dir = Path(output_dir)
        self.fixed_rank = rank
        self.command = command
        self.extra_meta = dict(extra_meta or {})
        self.recorder = CallsiteRecorder()
        self._modes: list[Any] = []
        self._step_hook: Any = None
        #: optimizer steps finished while started (torch's global step hook); ``meta.steps``
        self.steps = 0
        #: op calls issued while ``torch.compile`` compiled that a backend dropped
        #: before :meth:`build` (the profiler's fold); ``meta.compile_ops`` adds those
        #: the build leaves out
        self.compile_ops = 0
        #: the collective sequence :meth:`build` made (None: no collective recorded)
        self.collectives: Collectives | None = None
        self.written: Path | None = None
        #: held while a trace is built and written (the periodic flush's thread, a
        #: signal handler and the exit handler may all write)
        self.writing = threading.RLock()
        #: called after every optimizer step counted (the periodic flush by steps)
        self.on_step: Callable[[int], None] | None = None
        #: the counts at the end of the set-up (the first optimizer step; of each
        #: optimizer, where several step: :class:`SetupEnd`); None until then
        self.setup_counts: dict[Key, int] | None = None
        self.setup_end = SetupEnd()
        #: :attr:`compile_ops` at that moment
        self._setup_compile_ops = 0

    # -- lifecycle ------------------------------------------------------------

    def start(self) -> None:
        """Push the modes on this thread and start counting."""
        if self._modes:
            return
        function_mode = _FunctionMode(self.recorder)
        dispatch_mode = _DispatchMode(self.recorder)
        # the modes' __enter__ and __exit__ have no annotations (unused without torch)
        function_mode.__enter__()  # type: ignore[no-untyped-call, unused-ignore]
        try:
            dispatch_mode.__enter__()  # type: ignore[no-untyped-call, unused-ignore]
        except BaseException:
            function_mode.__exit__(None, None, None)  # type: ignore[no-untyped-call, unused-ignore]
            raise
        self._modes = [function_mode, dispatch_mode]
        self.recorder.active = True
        self._step_hook = count_optimizer_steps(self._count_step)

    @property
    def steps_done(self) -> int:
        """Optimizer steps finished while started (``meta.partial.step``)."""
        return self.steps

    def _count_step(self, optimizer: Any) -> None:
        if self.recorder.active:
            self.steps += 1
            self.recorder.step = self.steps
            if self.split_setup and self.setup_end.ended(optimizer, self.steps):
                self.end_setup()
            if self.on_step is not None:
                self.on_step(self.steps)

    def stop(self) -> None:
        """Stop counting and pop the modes (when they are still on top of the stack)."""
        self.recorder.active = False
        self.recorder.snapshot_rank()
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None
        modes, self._modes = self._modes, []
        for mode in reversed(modes):
            # fails when another mode was pushed above ours and left in place
            with contextlib.suppress(Exception):
                mode.__exit__(None, None, None)

    def end_setup(self) -> None:
        """Keep the counts so far as the set-up phase's (called at the end of the first
        step of each optimizer, :class:`SetupEnd`): what follows is the loop."""
        with self.recorder._lock, _gc_paused():
            self.setup_counts = dict(self.recorder.counts)
        self._setup_compile_ops = self.compile_ops

    def _phase_counts(self, phase: str | None) -> list[tuple[Key, int]]:
        """The counts of ``phase``: the whole process (None), ``setup`` or ``loop``."""
        with self.recorder._lock, _gc_paused():
            counts = self.recorder.counts
            setup = self.setup_counts
            if phase is None or setup is None:
                return list(counts.items())
            if phase == SETUP_PHASE:
                return list(setup.items())
            before = setup.get
            return [(key, n - before(key, 0)) for key, n in counts.items() if n > before(key, 0)]

    # -- output ---------------------------------------------------------------

    def resolve_rank(self) -> int:
        """Rank: given, else torch.distributed's, else ``$RANK``, else 0."""
        if self.fixed_rank is not None:
            return self.fixed_rank
        self.recorder.snapshot_rank()
        if self.recorder.rank is not None:
            return self.recorder.rank
        try:
            return int(os.environ.get("RANK", "0"))
        except ValueError:
            return 0

    def world_size(self) -> int:
        if self.recorder.world_size is not None:
            return self.recorder.world_size
        try:
            return int(os.environ.get("WORLD_SIZE", "1"))
        except ValueError:
            return 1

    def build(
        self, program_roots: list[str] | None = None, phase: str | None = None
    ) -> tuple[dict[str, Any], list[Frame], list[dict[str, Any]]]:
        """The trace as (meta, frames, callsites) ready for :func:`encode_trace`: of the
        whole process (``phase`` None), or of its ``setup`` or ``loop`` phase."""
        rank = self.resolve_rank()
        roots = _path_roots(program_roots if program_roots is not None else default_program_roots())
        maker = _FrameMaker(self.recorder.modules, roots)
        raw = self._phase_counts(phase)
        #: (frames, api, op, role, dtype) -> [count, raw stream]: a collective called
        #: from several streams is one callsite (its role is comm), on the smallest
        merged: dict[tuple[tuple[Frame, ...], str | None, str, str, str | None], list[int]] = {}
        role = self.recorder.streams.role
        streams: dict[int, str] = {}
        frame_cache: dict[tuple[types.CodeType, int], Frame] = {}
        codes = self.recorder.codes
        line = self.recorder.line
        tables: dict[types.CodeType, LineTable] = {}
        positions: dict[tuple[int, int], tuple[types.CodeType, int]] = {}

        def frames_of(stack: RawStack) -> tuple[Frame, ...]:
            pairs = []
            for index in range(0, len(stack), 2):
                at = (stack[index], stack[index + 1])
                pair = positions.get(at)
                if pair is None:
                    code = codes[at[0]]
                    pair = positions[at] = (code, line(code, at[1], tables))
                pairs.append(pair)
            frames = []
            for pair in maker.clean(pairs):
                value = frame_cache.get(pair)
                if value is None:
                    value = frame_cache[pair] = maker.frame(*pair)
                frames.append(value)
            return tuple(frames)

        compile_ops = self.compile_ops
        if phase == SETUP_PHASE:
            compile_ops = self._setup_compile_ops
        elif phase == LOOP_PHASE:
            compile_ops -= self._setup_compile_ops
        # ids of the compiler's frames (:data:`COMPILER_FILES`); usually none
        compiler = {key for key, code in list(codes.items()) if maker.compiling(code)}
        for (stack, api, op, stream, dtype), count in raw:
            if compiler and not compiler.isdisjoint(stack[0::2]):
                compile_ops += count  # torch.compile compiling: not the program's op
                continue
            if op.startswith(PROFILER_NAMESPACE):
                continue  # a record_function's enter or exit: not the program's work
            frames = frames_of(stack)
            site_role = role(stream, op)
            if not is_comm_op(op):
                streams[stream] = site_role
            key = (frames, api, op, site_role, dtype)
            slot = merged.get(key)
            if slot is None:
                merged[key] = [count, stream]
            else:
                slot[0] += count
                slot[1] = min(slot[1], stream)
        # the collective sequence (every step, numbered from 0) goes with the loop
        sequenced = phase != SETUP_PHASE
        stacks = (
            {stack: frames_of(stack) for stack in self.recorder.sequence.stacks()}
            if sequenced
            else {}
        )
        unique = sorted(
            {f for key in merged for f in key[0]} | {f for fs in stacks.values() for f in fs},
            key=Frame.sort_key,
        )
        ids = {frame: index for index, frame in enumerate(unique)}
        sequence = (
            self.recorder.sequence.build(rank, lambda stack: tuple(ids[f] for f in stacks[stack]))
            if sequenced
            else None
        )
        if sequence is None and sequenced and self.world_size() > 1:
            # a rank of a distributed job that issued no collective: an empty sequence,
            # which differs from "not recorded"
            sequence = CollectiveSequence(ranks=[rank])
        self.collectives = Collectives(sequences=[sequence]) if sequence is not None else None
        callsites: list[dict[str, Any]] = []
        rows = sorted(
            (([ids[f] for f in frames], api, op, site_role, dtype, count, stream)
             for (frames, api, op, site_role, dtype), (count, stream) in merged.items()),
            key=lambda row: (row[0], row[2], row[1] or "", row[3], row[4] is not None,
                             row[4] or ""),
        )  # fmt: skip
        for stack_ids, api, op, site_role, dtype, count, stream in rows:
            site_dict: dict[str, Any] = {"stack": stack_ids}
            if api is not None:
                site_dict["api"] = api
            site_dict.update({"op": op, "stream": stream, "role": site_role})
            if dtype is not None:
                site_dict["dtype"] = dtype
            site_dict["count"] = count
            callsites.append(site_dict)
        meta: dict[str, Any] = {
            "label": self.label,
            "rank": rank,
            "world_size": self.world_size(),
            "ranks": [rank],
            "torch_version": str(torch.__version__),
            "device": self.recorder.device,
            "command": self.command
            or os.environ.get("OPGUARD_TRACE_COMMAND")
            or shlex.join(sys.argv),
            "python_version": platform.python_version(),
            "tracer": TRACER_NAME,
            "tracer_backend": self.backend,
            "streams": {str(s): streams[s] for s in sorted(streams)},
        }
        steps = self.steps
        if phase is not None and self.setup_counts is not None:
            meta["phase"] = phase
            setup_steps = self.setup_end.steps
            steps = setup_steps if phase == SETUP_PHASE else steps - setup_steps
        if steps:
            meta["steps"] = steps
        if compile_ops:
            meta["compile_ops"] = compile_ops
        meta.update(self.extra_meta)
        return meta, unique, callsites

    def path(self) -> Path:
        """Where :meth:`write` puts the trace: ``{label}_callsite_rank{R}.json``."""
        return self.output_dir / f"{self.label}_callsite_rank{self.resolve_rank()}.json"

    def write(self, partial: dict[str, Any] | None = None) -> Path:
        """Write the trace atomically and return its path; ``partial`` (``meta.partial``,
        formats.md §1: why and up to when) marks a trace the process is not done with.

        After the first optimizer step the set-up phase goes to
        ``{label}_setup_rank{R}.json``, never marked partial (the set-up has ended, so
        its record is complete), and the path returned holds the loop; before
        it (or in a program that never steps) the one file holds the whole process,
        and a set-up file of an earlier run under this label and rank is removed, so
        the directory describes one run (tracing.md, "Set-up and loop")."""
        with self.writing:
            split = self.setup_counts is not None
            path = self.output_dir
            for phase in (SETUP_PHASE, LOOP_PHASE) if split else (None,):
                meta, frames, callsites = self.build(phase=phase)
                if partial and phase != SETUP_PHASE:
                    meta["partial"] = partial
                kind = "setup" if phase == SETUP_PHASE else "callsite"
                path = self.output_dir / f"{self.label}_{kind}_rank{meta['rank']}.json"
                path.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_bytes(
                    path, encode_trace(meta, frames, callsites, collectives=self.collectives)
                )
            if not split:
                stale = self.output_dir / f"{self.label}_setup_rank{meta['rank']}.json"
                with contextlib.suppress(FileNotFoundError):
                    stale.unlink()
            self.written = path
            return path

    def quiesced(self) -> contextlib.AbstractContextManager[bool]:
        """Entered by a periodic flush from another thread around :meth:`write`: whether
        the recorded counts may be read now (always, for this backend)."""
        return contextlib.nullcontext(True)


@contextlib.contextmanager
def _gc_paused() -> Any:
    """No garbage collection while the counts are copied: a collection can run Python
    code (finalizers), which lets another thread run and record in the middle of the
    copy (the periodic flush copies from its own thread)."""
    global GC_PAUSED
    enabled = gc.isenabled()
    gc.disable()
    GC_PAUSED = enabled
    try:
        yield
    finally:
        if enabled:
            GC_PAUSED = False
            gc.enable()


#: whether :func:`_gc_paused` has the collector off now (a fork then must turn it on
#: again in the child: the thread that would have is not there)
GC_PAUSED = False


def _is_launcher() -> bool:
    """Is this process torchrun's elastic agent (not a worker)?"""
    argv0 = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    if argv0 in {"torchrun", "torchrun.exe"}:
        return True
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return getattr(spec, "name", None) in {"torch.distributed.run", "torch.distributed.launch"}
