"""The ``profiler`` tracer backend: callsites from torch's own observer machinery.

Where the ``modes`` backend (:mod:`opguard_plugins.record.tracer`) pushes two Python modes,
this backend records with torch's profiler (RecordFunction observers on every
operator, plus the profiler's Python tracer for stacks: ``with_stack=True``). Nothing
sits between the program and the dispatcher, so the program runs the ops it runs
untraced: ``add_`` stays ``add_``, no ``aten::detach`` is added, fused fast paths stay
fused, and ``torch.compile`` compiles.

Started for a whole process (``opguard trace``: at ``import torch``), the profiler is
started at the program's first torch call on that thread instead (a one-shot
``TorchFunctionMode``, popped before the first module call or optimizer step, so
``torch.compile`` never sees it): the imports that follow
``import torch`` and the Python work before the model exists (transformers' imports,
data set-up) are not in its first cycle, so the first step's fold costs what later
steps' do. Nothing is lost: no operator runs before the first torch call.

Memory stays bounded: at the first optimizer step (a global
``register_optimizer_step_post_hook``) at least ``FOLD_SECONDS`` after a cycle began,
and when tracing stops, the profiler is stopped, the cycle's event tree is folded into
callsite counts and dropped, and the profiler restarts. A program that never steps an
optimizer keeps one cycle until the end (call :meth:`ProfilerTracer.fold` yourself).

What is counted, per thread's event tree:

* an **operator** is a ``RecordScope.FUNCTION`` event named ``namespace::name``
  (``aten::addmm``, ``c10d::allreduce_``); only the *outermost* one is counted (the op
  the program issued: ``aten::linear``, not the ``aten::t`` / ``aten::addmm`` it runs);
* a ``torch.compile`` frame that runs compiled (``Torch-Compiled Region: F/G``) is
  counted as the op ``dynamo::compiled_region``, and the operators its graph calls
  (extern kernels such as ``aten::mm``; not Inductor's fused C++/Triton kernels) are
  counted beneath it;
* nothing below ``torch.compile`` compiling (a frame of
  :data:`~opguard_plugins.record.tracer.COMPILER_FILES`: Dynamo converting a frame,
  AOTAutograd compiling a backward lazily): those ops are not the program's and are
  only counted, in ``meta.compile_ops``, as the modes backend does;
* record-function annotations (``autograd::engine::evaluate_function: ...``,
  ``Optimizer.step#AdamW.step``, ``## Call CompiledFxGraph ... ##``) are not counted,
  the operators inside them are.

Frames are named as the modes backend names them (``_Qualnames``: the code object
found by file, name and line; ``__main__``'s module by the script's stem), so both
backends give a function the same target (docs/tracing.md, "What both backends share").

The stack is the chain of Python calls the profiler saw above the op, outermost first;
frame lines are the lines of the calls between them; the innermost frame's line is
the line of the last Python-visible call before the op (exact when the op is reached
through a function call, approximate for operator syntax such as ``a + b``).
``api`` is not recorded (the profiler does not see torch's Python function layer),
``stream`` is 0 (role ``compute``; a collective is on ``comm``). The op's ``dtype``
is its first tensor input's, from the shapes and types the profiler records
(``record_shapes=True``: :func:`~opguard_plugins.record.dtypes.profiled_dtype`).

The trace is built and written by the same code as the modes backend's
(:class:`~opguard_plugins.record.tracer.CallsiteTracer`), so the format is identical.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import linecache
import os
import re
import sys
import threading
import time
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch._C._profiler import RecordScope, _EventType
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.overrides import TorchFunctionMode
from torch.overrides import _get_current_function_mode_stack as _function_modes

from opguard_core.formats.collectives import is_collective
from opguard_plugins.record.collectives import data_sized, describe_profiled, may_nest
from opguard_plugins.record.dtypes import profiled_dtype
from opguard_plugins.record.tracer import (
    COMPILER_PARTS,
    CallsiteRecorder,
    CallsiteTracer,
    LineTable,
    RawStack,
)

BACKEND_NAME = "profiler"
#: The pseudo-operator counted once per run of a ``torch.compile``d frame.
COMPILED_REGION_OP = "dynamo::compiled_region"
#: A cycle ends at the first optimizer step this many seconds after it began.
FOLD_SECONDS = 2.0
#: Where torch.compile compiles (:data:`~opguard_plugins.record.tracer.COMPILER_FILES`)
#: as the profiler names the files: the ops below are not the program's.
_COMPILER_FILES = tuple(os.path.join("torch", *parts) for parts in COMPILER_PARTS)
_COMPILED_REGION_PREFIX = "Torch-Compiled Region"
#: the record-function label torch's optimizers wrap ``step`` in (one per step)
_OPTIMIZER_STEP_PREFIX = "Optimizer.step#"
_OP_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*::[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)?$")


class ProfiledCode:
    """A stand-in for a code object, made from what the profiler reports for a frame.

    Has the attributes :class:`~opguard_plugins.record.tracer._FrameMaker` reads
    (``co_filename``, ``co_name``, ``co_qualname``, ``co_firstlineno``); interned, so
    ``is`` compares frames as it does for real code objects.
    """

    __slots__ = ("co_filename", "co_firstlineno", "co_name", "co_qualname")

    def __init__(self, filename: str, name: str, firstlineno: int) -> None:
        self.co_filename = filename
        self.co_name = name
        self.co_firstlineno = firstlineno
        self.co_qualname = name  # resolved when the trace is built

    def __repr__(self) -> str:
        return f"<ProfiledCode {self.co_qualname} {self.co_filename}:{self.co_firstlineno}>"


class _Qualnames:
    """``co_qualname`` for a (file, function name, line) the profiler reported.

    The profiler names a frame by file, function name and line only. The frame is the
    innermost function of that name whose lines hold the line, looked up first among
    the code objects of the module that owns the file (its functions, its classes'
    methods and the functions nested in those, found through ``sys.modules``; cheap),
    then, where that finds none (a decorated method, whose wrapper the module holds, a
    closure, a module no longer in ``sys.modules``), among the code objects of the
    file's source compiled (never run): every function, method, nested function and
    closure, with the qualname Python gives it. A function still not found (no source:
    a zip import, a file gone) keeps its bare name.
    """

    Index = dict[str, list[tuple[int, int, str]]]

    def __init__(self, modules: dict[str, str]) -> None:
        self.modules = modules
        self._walked: dict[str, _Qualnames.Index] = {}
        self._compiled: dict[str, _Qualnames.Index] = {}

    @staticmethod
    def _index(codes: list[types.CodeType]) -> _Qualnames.Index:
        found: _Qualnames.Index = {}
        while codes:
            code = codes.pop()
            lines = [line for _, _, line in code.co_lines() if line is not None]
            last = max(lines, default=code.co_firstlineno)
            found.setdefault(code.co_name, []).append((code.co_firstlineno, last, code.co_qualname))
            codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
        return found

    def _walk(self, filename: str) -> _Qualnames.Index:
        found = self._walked.get(filename)
        if found is None:
            found = self._walked[filename] = self._index(self._module_codes(filename))
        return found

    def _compile(self, filename: str) -> _Qualnames.Index:
        found = self._compiled.get(filename)
        if found is None:
            top = _compiled_source(filename)
            found = self._compiled[filename] = self._index([top] if top is not None else [])
        return found

    def _module_codes(self, filename: str) -> list[types.CodeType]:
        """The code objects of the functions the module owning ``filename`` holds."""
        module = sys.modules.get(self.modules.get(filename, ""))
        pending: list[Any] = list(vars(module).values()) if module is not None else []
        seen: set[int] = set()
        codes: list[types.CodeType] = []
        while pending:  # exact type checks only: module globals may be lazy proxies
            value = pending.pop()
            kind = type(value)
            if id(value) in seen:
                continue
            seen.add(id(value))
            if kind is staticmethod or kind is classmethod:
                value, kind = value.__func__, type(value.__func__)
            if kind is property:
                pending.extend(f for f in (value.fget, value.fset, value.fdel) if f is not None)
            elif kind is types.FunctionType:
                if value.__code__.co_filename == filename:
                    codes.append(value.__code__)
            elif issubclass(kind, type):
                members = list(type.__dict__["__dict__"].__get__(value).values())
                if any(
                    type(m) is types.FunctionType and m.__code__.co_filename == filename
                    for m in members
                ) or any(issubclass(type(m), type) for m in members):
                    pending.extend(members)
        return codes

    def resolve(self, code: ProfiledCode) -> str:
        if code.co_name.startswith("<") and code.co_name != "<lambda>":
            return code.co_name
        # the profiler reports the line a frame was at when it was first seen (its first
        # line, or its current line for frames already running when a cycle starts)
        line = code.co_firstlineno
        if line <= 0 or not (code.co_name.isidentifier() or code.co_name == "<lambda>"):
            return code.co_name  # the profiler garbled it: nothing to look up
        for index in (self._walk, self._compile):
            best: tuple[int, int, str] | None = None
            for first, last, qualname in index(code.co_filename).get(code.co_name, ()):
                if first <= line <= last and (best is None or first > best[0]):
                    best = (first, last, qualname)
            if best is not None:
                return best[2]
        return code.co_name


def _compiled_source(filename: str) -> types.CodeType | None:
    """``filename``'s source compiled (not run), or None where it cannot be read or
    compiled (no file, a zip import, a syntax this Python refuses)."""
    if filename.startswith("<"):
        return None
    try:
        source = "".join(linecache.getlines(filename))
        if not source:
            return None
        return compile(source, filename, "exec", dont_inherit=True)
    except (SyntaxError, ValueError, OverflowError, MemoryError, RecursionError):
        return None


def _main_file() -> str | None:
    """The absolute path of the script ``__main__`` runs, while it has one: Python
    deletes ``__main__.__file__`` once a script ends, before the exit handlers (which
    write the trace) run."""
    filename = getattr(sys.modules.get("__main__"), "__file__", None)
    return os.path.abspath(filename) if isinstance(filename, str) else None


def _module_names(main_file: str | None = None) -> dict[str, str]:
    """File → module name for every imported module with a file; ``main_file`` (see
    :func:`_main_file`) is ``__main__``'s, which the frame maker names as the modes
    backend does (the script's stem, or the ``-m`` name)."""
    names: dict[str, str] = {}
    for name, module in list(sys.modules.items()):
        filename = getattr(module, "__file__", None)
        if isinstance(filename, str):
            names.setdefault(os.path.abspath(filename), name)
    if main_file is not None:
        names.setdefault(main_file, "__main__")
    return names


def _search_dirs() -> list[str]:
    """Where the profiler's shortened file names are looked up (it strips sys.path)."""
    dirs = [p or os.getcwd() for p in sys.path]
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    if isinstance(main, str):
        dirs.insert(0, os.path.dirname(os.path.abspath(main)))
    dirs.append(os.getcwd())
    return [d for d in dict.fromkeys(dirs) if os.path.isdir(d)]


def _absolute(filename: str, search: list[str]) -> str:
    """The absolute path of a file name as the profiler reports it."""
    if filename.startswith("<") or os.path.isabs(filename):
        return filename
    for directory in search:
        candidate = os.path.join(directory, filename)
        if os.path.isfile(candidate):
            return os.path.abspath(candidate)
    return filename


class ProfilerRecorder(CallsiteRecorder):
    """Counts (stack, None, op, 0, dtype) tuples folded from the profiler's event trees."""

    def __init__(self) -> None:
        super().__init__(accelerated=False)
        self._codes: dict[tuple[str, str, int], ProfiledCode] = {}
        #: op calls issued while torch.compile compiled, left out (``meta.compile_ops``)
        self.compile_ops = 0

    def line(self, code: Any, position: int, tables: dict[Any, LineTable]) -> int:
        """The profiler reports lines: a raw stack's position is already one."""
        return position

    def code(self, filename: str, name: str, line: int) -> ProfiledCode:
        key = (filename, name, line)
        code = self._codes.get(key)
        if code is None:
            code = self._codes[key] = ProfiledCode(filename, name, line)
            self.codes[id(code)] = code  # type: ignore[assignment]
        return code

    def fold(self, roots: list[Any], first_step: int = 0) -> None:
        """Count the operators of one cycle's event trees (one root per thread's top);
        the cycle's collectives join the sequence, in time order, each in its step:
        ``first_step`` (the steps finished when the cycle began) plus the optimizer
        steps (``Optimizer.step#…`` events) that ended before it."""
        counts: dict[tuple[RawStack, str, str | None], int] = {}
        collectives: list[tuple[int, RawStack, str, Any]] = []
        step_ends: list[int] = []
        compile_ops = 0
        op_tag, py_tag, c_tag = _EventType.TorchOp, _EventType.PyCall, _EventType.PyCCall
        function_scope = RecordScope.FUNCTION
        code_of = self.code
        # explicit stack: (event, frames above its frame, its frame as [code, line]);
        # a frame's line is shared by its children, so an op takes the line of the last
        # call its frame made before it
        work: list[tuple[Any, RawStack, list[Any] | None]] = [
            (root, (), None) for root in reversed(roots)
        ]
        while work:
            event, outer, cell = work.pop()
            tag = event.tag
            if tag == py_tag:
                fields = event.extra_fields
                site = fields.callsite
                try:
                    file_name, function_name = site.file_name, site.function_name
                except UnicodeDecodeError:  # seen on torch 2.13: a garbled name
                    file_name = function_name = "<unknown>"
                if file_name.endswith(_COMPILER_FILES):
                    compile_ops += _count_ops(event)  # compiling: its ops are not the program's
                    continue
                if cell is not None:
                    cell[1] = fields.caller.line_number
                    outer = (*outer, id(cell[0]), cell[1])
                line = site.line_number if file_name != "<unknown>" else 0
                code = code_of(file_name, function_name, line)
                cell = [code, code.co_firstlineno]
            elif tag == c_tag:
                if cell is not None:
                    cell[1] = event.extra_fields.caller.line_number
            elif tag == op_tag:
                name = event.name
                if event.extra_fields.scope == function_scope:
                    op = None
                    if name.startswith(_COMPILED_REGION_PREFIX):
                        op = COMPILED_REGION_OP
                    elif _OP_NAME.match(name):
                        op = name.split(".", 1)[0]
                    if op is not None:
                        stack = outer if cell is None else (*outer, id(cell[0]), cell[1])
                        dtype = None
                        if op != COMPILED_REGION_OP:
                            dtype = profiled_dtype(event.extra_fields.inputs)
                        key = (stack, op, dtype)
                        counts[key] = counts.get(key, 0) + 1
                        if is_collective(op):
                            collectives.append((event.start_time_ns, stack, op, event))
                        elif may_nest(op):  # a custom op: the collectives it issues
                            collectives += [
                                (inner.start_time_ns, stack, inner_op, inner)
                                for inner, inner_op in _collectives_below(event)
                            ]
                        if op != COMPILED_REGION_OP:
                            continue  # its sub-ops are not what the program issued
                elif name.startswith(_OPTIMIZER_STEP_PREFIX):
                    step_ends.append(event.end_time_ns)
            else:
                continue
            for child in reversed(event.children):
                work.append((child, outer, cell))
        with self._lock:
            self.compile_ops += compile_ops
            for (stack, op, dtype), count in counts.items():
                site = (stack, None, op, 0, dtype)
                self.counts[site] = self.counts.get(site, 0) + count
        step_ends.sort()
        collectives.sort(key=lambda item: item[0])
        for start, stack, op, event in collectives:
            step = first_step + bisect.bisect_right(step_ends, start)
            description = data_sized(
                describe_profiled(event.extra_fields.inputs),
                functools.partial(map, self.codes.__getitem__, stack[0::2]),
            )
            self.sequence.add(stack, op, description, step)


def _collectives_below(root: Any) -> list[tuple[Any, str]]:
    """The outermost collective op events below ``root`` (a custom op's), with their ops."""
    found = []
    work = list(root.children)
    while work:
        event = work.pop()
        op = _op_of(event)
        if op is not None and is_collective(op):
            found.append((event, op))
            continue
        work.extend(event.children)
    return found


def _op_of(event: Any) -> str | None:
    """The op an event counts as (:meth:`ProfilerRecorder.fold`), or None."""
    if event.tag != _EventType.TorchOp or event.extra_fields.scope != RecordScope.FUNCTION:
        return None
    name = event.name
    if name.startswith(_COMPILED_REGION_PREFIX):
        return COMPILED_REGION_OP
    return name.split(".", 1)[0] if _OP_NAME.match(name) else None


def _count_ops(root: Any) -> int:
    """The ops below ``root`` counted as :meth:`ProfilerRecorder.fold` counts them
    (an op's own sub-ops are not)."""
    count = 0
    work = list(root.children)
    while work:
        event = work.pop()
        op = _op_of(event)
        if op is not None:
            count += 1
            if op != COMPILED_REGION_OP:
                continue
        work.extend(event.children)
    return count


# TorchFunctionMode's __init__ has no annotations; without torch the class is Any (misc)
class _StartOnFirstCall(TorchFunctionMode):  # type: ignore[misc, unused-ignore]
    """Starts the tracer's profiler at the first torch call it sees, then only passes
    calls through until it is popped (the first module call or optimizer step, or
    stop)."""

    def __init__(self, tracer: ProfilerTracer) -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        self.tracer.begin_on_first_call()
        return func(*args, **(kwargs or {}))


class ProfilerTracer(CallsiteTracer):
    """:class:`~opguard_plugins.record.tracer.CallsiteTracer` recording with torch's profiler."""

    backend = BACKEND_NAME

    def __init__(self, *args: Any, fold_seconds: float = FOLD_SECONDS, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.recorder: ProfilerRecorder = ProfilerRecorder()
        self.fold_seconds = fold_seconds
        self._cycle_started = 0.0
        #: cycles whose events torch's profiler failed to give back (said on stderr)
        self.lost_cycles = 0
        #: the optimizer steps finished when the current cycle began
        self._cycle_steps = 0
        self._profile: Any = None
        self._hook: Any = None
        self._thread = threading.get_ident()
        #: ``__main__``'s script, seen while it ran (:func:`_main_file`)
        self._main_file: str | None = None
        self._qualnames = _Qualnames({})
        # re-entrant: a SIGTERM handler may stop the tracer while this thread folds
        self._folding = threading.RLock()
        #: the mode that starts the profiler at the first torch call
        #: (``start_at_first_call``), until it is popped
        self._trigger: _StartOnFirstCall | None = None
        #: the profiler waits for the first torch call (never started yet)
        self._waiting = False
        self._trigger_hook: Any = None

    def _begin(self) -> None:
        # input shapes and types: each op's dtype, and what the collective sequence
        # records of each collective (dtype, shapes)
        profile = torch.autograd.profiler.profile(
            use_cpu=True, use_kineto=True, with_stack=True, record_shapes=True
        )
        # torch's profile.__enter__ has no annotations (unused where torch is absent)
        profile.__enter__()  # type: ignore[no-untyped-call, unused-ignore]
        self._profile = profile
        self._cycle_started = time.monotonic()
        self._cycle_steps = self.steps

    def _end(self) -> None:
        profile, self._profile = self._profile, None
        if profile is None:
            return
        try:
            profile.__exit__(None, None, None)
            results = profile.kineto_results
            profile.kineto_results = None
            if results is not None:
                self.recorder.fold(results.experimental_event_tree(), self._cycle_steps)
        except Exception as exc:  # torch's profiler failing must not end the program
            self.lost_cycles += 1
            print(  # inside the traced program, as the backends' other messages
                f"opguard trace: a profiler cycle was lost at step {self.steps}, its ops "
                f"not counted: {type(exc).__name__}: {exc}",
                file=sys.stderr,
            )

    def start(self) -> None:
        """Start the profiler (or, with ``start_at_first_call``, the mode that starts
        it at the first torch call) and the fold-every-N-optimizer-steps hook."""
        if self._profile is not None or self._trigger is not None:
            return
        self._thread = threading.get_ident()
        self._main_file = _main_file() or self._main_file
        if self.start_at_first_call:
            self._waiting = True
            self._trigger = _StartOnFirstCall(self)
            # torch's mode __enter__ has no annotations (unused where torch is absent)
            self._trigger.__enter__()  # type: ignore[no-untyped-call, unused-ignore]
            # gone before a module first runs: torch.compile never sees the mode
            self._trigger_hook = register_module_forward_pre_hook(self._before_forward)
        else:
            self._begin()
        self.recorder.active = True
        self._hook = register_optimizer_step_post_hook(self._on_step)

    def begin_on_first_call(self) -> None:
        """Start the profiler if it waits for the first torch call (on the thread that
        started the tracer)."""
        if self._waiting and threading.get_ident() == self._thread:
            with self._folding:
                if self._waiting and self.recorder.active:
                    self._waiting = False
                    self._begin()

    def _before_forward(self, module: Any, args: Any) -> None:
        if threading.get_ident() == self._thread:
            self.begin_on_first_call()
            self._drop_trigger()

    def _drop_trigger(self) -> None:
        """Pop the first-call mode where it is the innermost (never inside a torch
        call, where torch has popped it for the while): at the first module call, the
        first optimizer step or stop, whichever comes first."""
        trigger = self._trigger
        if trigger is not None and _function_modes()[-1:] == [trigger]:  # type: ignore[no-untyped-call, unused-ignore]
            trigger.__exit__(None, None, None)  # type: ignore[no-untyped-call, unused-ignore]
            self._trigger = None
            if self._trigger_hook is not None:
                self._trigger_hook.remove()
                self._trigger_hook = None

    def _on_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.steps += 1  # meta.steps, as the modes backend counts them
        if threading.get_ident() != self._thread:
            return
        if self._trigger is not None:
            self.begin_on_first_call()  # no torch call on this thread yet
            self._drop_trigger()
        if self.split_setup and self.setup_end.ended(optimizer, self.steps):
            self.fold(wait=True)  # the set-up's events folded now: its counts are whole
            self.compile_ops = self.recorder.compile_ops
            self.end_setup()
        elif time.monotonic() - self._cycle_started >= self.fold_seconds:
            self.fold()
        if self.on_step is not None:
            self.on_step(self.steps)

    def fold(self, wait: bool = False) -> None:
        """End the profiler's current cycle, fold its events into counts, start the next;
        skipped while another fold runs, unless ``wait``."""
        if not self._folding.acquire(blocking=wait):
            return
        try:
            if self._profile is None:
                return
            self._end()
            self._begin()
        finally:
            self._folding.release()

    @contextlib.contextmanager
    def quiesced(self) -> Iterator[bool]:
        """True (and no fold starts) unless a fold is running: a periodic flush from
        another thread then skips, rather than read counts being folded into."""
        acquired = self._folding.acquire(blocking=False)
        try:
            yield acquired
        finally:
            if acquired:
                self._folding.release()

    def stop(self) -> None:
        """Fold the last cycle and stop the profiler."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if threading.get_ident() == self._thread:
            self._drop_trigger()
        if self._trigger_hook is not None:
            self._trigger_hook.remove()
            self._trigger_hook = None
        with self._folding:
            self._end()
        self.recorder.active = False
        self.recorder.snapshot_rank()

    def build(
        self, program_roots: list[str] | None = None, phase: str | None = None
    ) -> tuple[dict[str, Any], list[Any], list[dict[str, Any]]]:
        """Resolve qualnames and module names of the recorded frames, then build."""
        self._main_file = _main_file() or self._main_file
        modules = _module_names(self._main_file)
        qualnames = self._qualnames  # files indexed once per tracer (flushes rebuild)
        qualnames.modules = modules
        recorder = self.recorder
        assert isinstance(recorder, ProfilerRecorder)
        search = _search_dirs()
        for code in list(recorder._codes.values()):
            code.co_filename = _absolute(code.co_filename, search)
            code.co_qualname = qualnames.resolve(code)
            name = modules.get(code.co_filename)
            if name is not None:
                recorder.modules[code] = name  # type: ignore[index]
        self.compile_ops = recorder.compile_ops
        return super().build(program_roots, phase)
