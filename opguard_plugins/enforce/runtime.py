"""The runtime guard: enforces an instrumentation config inside a running program.

Used by ``opguard guard`` (through the bootstrap, :func:`start_process_guard`) and by
hand with :func:`guarded`::

    from opguard_plugins.enforce.runtime import guarded

    with guarded("config.yaml", report_dir="reports", on_violation="raise"):
        for step in range(steps):
            train_step(...)

How it works (docs/guard.md):

* **Targets are found on the stack.** Nothing is wrapped or replaced: at each op
  the Python frames are walked and each code object is named once, as the tracer
  names it (:func:`~opguard_plugins.record.tracer.program_module_name`), so
  ``__main__``'s functions, nested functions and closures and modules imported at
  any time are guarded alike, and a config never causes an import. A
  ``TorchFunctionMode`` notes the public torch call running (the config's
  ``torch_api`` entries). The tuple of config targets found is resolved once into
  the config's keys (:meth:`Guard._resolve`, the config's parents skipping what
  chain pruning folded away).
* **A state** is the (target, context) key of the innermost active target plus the
  set of every active config entry (the key and all its active ancestors), with the
  intersection of their op lists: an op is accepted when it is in that
  intersection, which is exactly "every active entry lists it" (inclusive counting,
  as the config counts). States are interned by the tuple of targets on the stack,
  so after the walk the per-op check is one dict lookup.
* **One TorchDispatchMode** sees every operator and checks it against the current
  thread's state. Streams are checked by role (formats.md, "Streams and roles"):
  on CUDA every op's current stream is noted (:class:`StreamRoles`, so side streams
  are numbered in order of first use, as the tracer numbers them; with ``sample``, a
  stream first used in an unchecked step is numbered when it is next seen). A
  violation's first occurrence keeps the Python stack; ``warn`` logs it once (an
  ``unknown_context`` when the guard finishes, if it ran enough ops to count: the
  console shows what the report counts), ``raise`` raises :class:`OpGuardViolation`
  inside the offending call.
* **Sampling**: with ``sample=P`` only every ``round(1/P)``-th optimizer step is
  checked (steps counted with torch's global optimizer step hook, from 0, so step 0,
  which includes everything before the first ``optimizer.step()``, is checked); in
  the other steps the modes are popped and ops cost nothing.
* **The whole run** (``whole_run``: ``opguard guard``): at exit ``missing``,
  ``count_drift`` and ``unknown_target`` by check's rules on the ops counted per
  entry, so a guard report and a check report of the same run agree.
* **The report** ``guard_report_rank{R}.json`` (formats.md §5) is written atomically
  at exit: by ``atexit`` (also after an uncaught exception), on SIGTERM (torchrun
  stopping the other workers) and when :func:`guarded` exits, however it exits.
"""

from __future__ import annotations

import atexit
import os
import sys
import sysconfig
import threading
import types
from collections import deque
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.overrides import TorchFunctionMode
from torch.overrides import _get_current_function_mode_stack as _function_modes
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from opguard_core.configs.selection import recorded_selection
from opguard_core.errors import one_line
from opguard_core.formats.check import (
    ACROSS_TRACERS,
    ERROR,
    GUARD_VIEW,
    WARNING,
    CheckInput,
    EntryKey,
    Violation,
    guard_report,
    sample_every,
    write_json,
)
from opguard_core.formats.collectives import Collectives, is_collective
from opguard_core.formats.config import entry_key, load_config
from opguard_core.formats.sources import config_steps, loop_only, share_of
from opguard_core.formats.streams import StreamRoles
from opguard_core.formats.tree import (
    TORCH_API,
    api_target,
    pruning_floor,
    pruning_settings,
    target_name,
    threshold,
)
from opguard_core.logs import escape_controls, resolve_format
from opguard_core.native import load_native
from opguard_core.processes import at_sigterm, multiprocessing_child, signals_deferred
from opguard_plugins.enforce import sequence_guard
from opguard_plugins.enforce.rules import (
    DEFAULT_TOLERANCE,
    JUDGED_BY_JOB,
    count_drift,
    missing,
    missing_ops,
)
from opguard_plugins.enforce.sequence_guard import (
    LAST,
    NAMESPACES,
    SequenceChecker,
    Watchdog,
    call_text,
    config_sequences,
    load_collectives,
    work_of,
)
from opguard_plugins.enforce.status import clear_status, write_job_counts, write_status
from opguard_plugins.record.backends import ended_by
from opguard_plugins.record.collectives import describe
from opguard_plugins.record.dtypes import op_dtype
from opguard_plugins.record.flush import partial_marker
from opguard_plugins.record.tracer import (
    SetupEnd,
    _is_launcher,
    api_name,
    bind_fast_function,
    count_optimizer_steps,
    op_name,
    program_module_name,
)

if TYPE_CHECKING:
    from opguard_plugins.record._recorder import TargetWalker

ON_VIOLATION = ("warn", "raise")
_THIS_FILE = os.path.abspath(__file__)
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_PLUMBING = frozenset(
    os.path.join(_TORCH_DIR, *parts)
    for parts in (
        ("overrides.py",),
        ("_ops.py",),
        ("_compile.py",),
        ("utils", "_python_dispatch.py"),
        ("_dynamo", "eval_frame.py"),
    )
)
_STACK_LIMIT = 40
_OWN_FILES = frozenset({_THIS_FILE, os.path.abspath(sequence_guard.__file__)})
_TORCH_PREFIX = _TORCH_DIR + os.sep
_UNSEEN: Any = object()
_native = load_native("opguard_plugins.record._recorder")
#: the C twin of the guard's per-op path, or None: the Python path runs (not built,
#: or ``OPGUARD_PURE_PYTHON=1``)
_TargetWalker: type[TargetWalker] | None = None if _native is None else _native.TargetWalker


def _profiling_marks() -> frozenset[Any]:
    """The overloads of torch's ``profiler::`` ops (``record_function``'s enter and
    exit, issued by every optimizer step and ``zero_grad``): profiling marks, not the
    program's work, which the tracer leaves out (``PROFILER_NAMESPACE``); the guard
    neither checks nor counts them."""
    marks: set[Any] = set()
    space = torch.ops.profiler
    for name in ("_record_function_enter", "_record_function_enter_new", "_record_function_exit"):
        packet = getattr(space, name, None)
        for overload in packet.overloads() if packet is not None else ():
            marks.add(getattr(packet, overload))
    return frozenset(marks)


PROFILING_MARKS = _profiling_marks()
#: kinds logged when the guard finishes (they need the whole run's counts)
_AT_EXIT = frozenset({"unknown_context", "missing", "missing_op", "count_drift", "unknown_target"})


class OpGuardViolation(RuntimeError):
    """Raised inside the offending call by ``on_violation="raise"``.

    :ivar violation: the :class:`~opguard_core.formats.check.Violation` (the first of
        the call, when it breaks several entries).
    """

    def __init__(self, violation: Violation) -> None:
        super().__init__(f"opguard guard: {violation.kind}: {violation.message}")
        self.violation = violation


class _State:
    """What is active on a thread: the innermost target's key and the active entries."""

    __slots__ = (
        "allowed",
        "chain",
        "children",
        "dtypes",
        "extra",
        "folds",
        "key",
        "keys",
        "known",
        "ok",
        "ops",
        "path",
        "streams",
        "unknown",
        "watch",
    )

    def __init__(
        self,
        path: tuple[str, ...],
        key: EntryKey | None,
        known: frozenset[EntryKey],
        allowed: frozenset[str] | None,
        streams: frozenset[str] | None,
        dtypes: frozenset[str] | None = None,
    ) -> None:
        self.path = path  # the last `depth` active targets, outermost first
        self.key = key
        self.known = known
        self.allowed = allowed
        self.streams = streams
        #: the dtypes every known entry that records them lists (None: none records)
        self.dtypes = dtypes
        self.ok: dict[Any, bool] = {}
        self.children: dict[str, _State] = {}
        self.unknown: tuple[Any, ...] | None = None  # an unknown_context identity
        #: the unknown_context identities active here (own and ancestors'): their op counts
        self.chain: tuple[tuple[Any, ...], ...] = ()
        self.watch = bool(known)  # anything to do per op: known entries or a chain
        self.ops = 0  # ops checked in this state (the at-exit counts: count_drift, missing)
        #: targets the config lacks that run here (unknown_target candidates at exit)
        self.extra: tuple[EntryKey, ...] = ()
        #: the keys of the chain of targets this state was resolved from, outermost
        #: first (the branch of the run's tree its ops count for)
        self.keys: tuple[EntryKey, ...] = ()
        #: the paths (targets, innermost first) this state read as folded chains
        self.folds: tuple[tuple[str, ...], ...] = ()


class _Record:
    __slots__ = ("count", "ops", "stack", "violation")

    def __init__(self, violation: Violation, stack: list[dict[str, Any]]) -> None:
        self.violation = violation
        self.stack = stack
        self.count = 0
        self.ops = 0  # ops run while it was active (unknown_context)


# TorchDispatchMode's __init_subclass__ and __init__ have no annotations; without torch
# the class is Any (misc); the ignores are unused there
class _ApiMode(TorchFunctionMode):  # type: ignore[misc, unused-ignore]
    """Notes, per thread, the config's ``torch_api`` target of the public torch call
    running (the outermost: torch disables the mode inside it), as the tracer's
    ``api``; its ops are then checked against that entry too."""

    def __init__(self, guard: Guard) -> None:
        super().__init__()
        self.local = guard.api_local
        self.api_target = guard.api_target
        if guard.walker is not None:  # the C path, bound as a method (torch wants one)
            bind_fast_function(self, guard.walker.function)

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if torch.compiler.is_compiling():  # Dynamo traces the call into its graph
            return func(*args, **(kwargs or {}))
        local = self.local
        local.api = self.api_target(func)
        try:
            return func(*args, **(kwargs or {}))
        finally:
            local.api = None


class _Mode(TorchDispatchMode):  # type: ignore[no-untyped-call, misc, unused-ignore]
    """Checks every operator against the current thread's state."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """``torch.compile`` compiles under the guard; compiled code's ops are checked."""
        return True

    def __init__(self, guard: Guard) -> None:
        super().__init__()  # type: ignore[no-untyped-call, unused-ignore]
        self.guard = guard
        self.cuda = guard.cuda
        if guard.walker is not None:  # the C path, bound as a method (torch wants one)
            self.__torch_dispatch__ = types.MethodType(guard.walker.dispatch, self)  # type: ignore[method-assign]

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        guard = self.guard
        if func in PROFILING_MARKS:
            return func(*args, **(kwargs or {}))  # not the program's work: the tracer skips it
        stream = guard.current_stream() if self.cuda else None
        if guard.checking:
            # the state of the stack: its config targets, found by code object
            # (Guard.active_targets or its C twin), with the torch_api target of the
            # public call running first, resolved once per distinct tuple of them
            active = guard.walk(sys._getframe(1), getattr(guard.api_local, "api", None))
            state = guard._by_active.get(active) or guard._resolve_with_leaves(active)
            state.ops += 1
            if state.watch:
                if state.extra:
                    guard.count_extra(state.extra)
                if state.chain:
                    guard.count_ops(state.chain)
                if state.known:
                    key: Any = (
                        (func, stream, op_dtype(args))
                        if guard.check_dtypes
                        else func
                        if stream is None
                        else (func, stream)
                    )
                    ok = state.ok.get(key)
                    if ok is None:
                        guard.check_op(state, key)
                    elif not ok:
                        guard.repeat_op(state, key)
        if guard.collective_checks and getattr(func, "namespace", None) in NAMESPACES:
            return guard.run_collective(func, args, kwargs)
        return func(*args, **(kwargs or {}))


class Guard:
    """Enforces one config in this process; see the module docstring."""

    def __init__(
        self,
        config: Mapping[str, Any],
        config_path: str = "",
        report_dir: str | os.PathLike[str] = ".",
        on_violation: str = "warn",
        sample: float = 1.0,
        rank: int | None = None,
        collectives: Collectives | None = None,
        collective_timeout: float | None = None,
        source: str | None = None,
        whole_run: bool = False,
    ) -> None:
        if on_violation not in ON_VIOLATION:
            raise ValueError(f"on_violation must be warn or raise, not {on_violation!r}")
        self.config = config
        #: the source the program is (``--source``): a merged config's share to compare
        self.source = source
        #: compare the whole run at exit (``missing``, ``count_drift``): the guard
        #: saw the whole program (``opguard guard``), and it ended normally
        self.whole_run_rules = whole_run
        #: why the program ended early (``meta.partial``'s shape, formats.md §1: an
        #: uncaught exception, SIGTERM, a raised violation, ``sys.exit`` with a
        #: failure): its counts cover part of a run, so no whole-run rules; the
        #: report says so (``partial``). None: not (yet) ended early
        self.partial: dict[str, Any] | None = None
        self.config_path = config_path
        self.report_dir = Path(report_dir)
        self.on_violation = on_violation
        self.sample = sample
        self.every = sample_every(sample)
        self.fixed_rank = rank
        self.rank: int | None = None
        self.world_size: int | None = None
        #: what the whole-run rules counted, for ``opguard guard``'s view of the job
        #: (:meth:`job_counts`; None until they ran)
        self.counted: dict[EntryKey, dict[str, Any]] | None = None
        meta = config.get("meta") or {}
        settings = meta.get("settings") or {}
        ranks = len(meta.get("ranks") or [0]) or 1
        self.min_count, self.min_fraction = pruning_settings(meta)
        #: an unknown_context with fewer ops (per rank) is below what the config keeps
        self.threshold = threshold(
            float(meta.get("total", 0) or 0) / ranks, self.min_count, self.min_fraction
        )
        #: the optimizer steps the config's counts cover (None: not recorded), so the
        #: threshold grows with a longer guarded run (:meth:`unknown_threshold`)
        self.config_steps = config_steps(meta)
        sources = meta.get("sources")
        # Set-up and loop (tracing.md): a source traced in two phases has each in
        # ``meta.phases``. A config of the loop alone says nothing of the set-up (it is
        # not checked: from the end of the first optimizer step on); when the sources
        # compared at exit are the loop's, the counts start there.
        names = [str(s) for s in sources] if isinstance(sources, list) else []
        #: the whole-run counts are the loop's (forgotten at the end of the first step)
        self.loop_counts = loop_only(meta, [source] if source in names else None)
        #: the config has no set-up: nothing before the end of the first step is checked
        self.skip_setup = loop_only(meta)
        self.depth = int(settings.get("context_depth", 1) or 0)
        #: what recorded the config's traces, where that is not what the guard sees (the
        #: ``modes`` tracer's view): then only which functions ran, where, is compared
        #: (:data:`ACROSS_TRACERS`), as ``opguard check`` compares across tracers
        recorded = meta.get("recorded_by")
        self.other_view: list[str] = (
            sorted(map(str, recorded))
            if isinstance(recorded, list) and recorded and set(recorded) != {GUARD_VIEW}
            else []
        )
        self.entries: dict[EntryKey, Any] = {entry_key(e): e for e in config["entries"]}
        self.ops = {
            k: frozenset(str(o) for o in (e.get("ops") or {})) for k, e in self.entries.items()
        }
        #: the stream roles each entry lists; ``streams`` gives this process's roles
        self.stream_sets = {
            k: frozenset(str(s) for s in (e.get("stream_counts") or {}))
            for k, e in self.entries.items()
        }
        self.streams = StreamRoles()
        #: the dtypes each entry lists; None for an entry without ``dtype_counts``,
        #: which says nothing about them (formats.md, "Dtypes")
        self.dtype_sets: dict[EntryKey, frozenset[str] | None] = {
            k: None if e.get("dtype_counts") is None else frozenset(map(str, e["dtype_counts"]))
            for k, e in self.entries.items()
        }
        #: whether an op's key holds its dtype (some entry records dtypes)
        self.check_dtypes = any(v is not None for v in self.dtype_sets.values())
        kinds: dict[str, set[str]] = {}
        for (target, _), entry in self.entries.items():
            kinds.setdefault(target, set()).add(str(entry.get("kind") or ""))
        self.entry_targets = frozenset(kinds)
        context_targets = {t for _, context in self.entries for t in context}
        watched = {t for t, k in kinds.items() if k != {TORCH_API}}
        watched |= {t for t in context_targets if kinds.get(t) != {TORCH_API}}
        #: the config's targets that a Python frame can run (``torch_api`` entries are
        #: not frames: their ops count for the enclosing functions' entries)
        self.names = frozenset(watched)
        #: the config's ``torch_api`` targets (``torch:Tensor.view``), by callable
        self.api_names = frozenset(t for t, k in kinds.items() if TORCH_API in k)
        self._api_targets: dict[Any, str | None] = {}
        self.api_local = threading.local()
        #: target -> the targets the config has directly above it (None: top level)
        parents: dict[str, set[str | None]] = {}
        for target, context in self.entries:
            parents.setdefault(target, set()).add(context[-1] if context else None)
        self.parents = {t: frozenset(p) for t, p in parents.items()}
        #: targets with both kinds of entries, a public call's (``torch_api``: a leaf
        #: of check's tree, where the call's frame is the api's own function) and a
        #: function's (a frame node: Python ran below it, a saved-tensor hook in a
        #: checkpoint's recomputation, so chains fold through it), and per kind
        #: (True: the api's) their parents: which entry a stack reads depends on
        #: which the target is there
        self.dual = frozenset(t for t, k in kinds.items() if TORCH_API in k and len(k) > 1)
        by_kind: dict[bool, dict[str, set[str | None]]] = {True: {}, False: {}}
        for (target, context), entry in self.entries.items():
            if target in self.dual:
                as_api = entry.get("kind") == TORCH_API
                by_kind[as_api].setdefault(target, set()).add(context[-1] if context else None)
        self.parents_by_kind = {
            kind: {t: frozenset(p) for t, p in found.items()} for kind, found in by_kind.items()
        }
        #: id(code) -> the config target that code runs, or None; ``_codes`` keeps
        #: the code objects alive so that their ids stay theirs
        self._code_targets: dict[int, str | None] = {}
        self._codes: list[types.CodeType] = []
        #: the config targets on a stack (innermost first) -> their state
        self._nothing = _State((), None, frozenset(), None, None)
        self._by_active: dict[tuple[Any, ...], _State] = {}
        #: the tuples of config targets (innermost first) that ops ran under: a target
        #: with ops of its own on a path is no chain the config could have folded there
        self._ran: set[tuple[str, ...]] = set()
        #: such a path read as folded -> the stacks (``_by_active`` keys) so resolved
        self._folded_over: dict[tuple[str, ...], list[tuple[Any, ...]]] = {}
        #: states with ``extra`` (copies of interned ones): counted at exit too
        self._copies: list[_State] = []
        #: ops of targets the config lacks, by (target, context): ``unknown_target``
        self.extra_ops: dict[EntryKey, int] = {}
        #: report those: only where the config was made without filters, focus or
        #: ignore patterns (which the guard does not run), and lists public calls
        self.report_unknown = not any(
            settings.get(k) for k in ("filters", "focus", "ignore", "basic_list")
        ) and bool(self.api_names)
        #: the entries ``opguard filter --focus/--ignore`` kept: what it cut out is no
        #: ``unknown_context`` or ``unknown_target`` (check's view: ``select_observed``)
        self.selection = recorded_selection(config)
        self._states: dict[tuple[Any, ...], _State] = {}
        self.records: dict[tuple[Any, ...], _Record] = {}
        #: (state, op key) -> the identities of the violations it makes
        self._bad: dict[tuple[int, Any], list[tuple[Any, ...]]] = {}
        self._lock = threading.RLock()
        self.cuda = torch.cuda.is_available()
        self.step = 0
        self.checked_steps = 0
        #: ops checked against the config (first sights per state): 0 means the guard
        #: checked nothing (no config target ran)
        self.checked_ops = 0
        self.checking = True
        #: the C twin (``_recorder.TargetWalker``) of the per-op path where it was built:
        #: the walk (:meth:`active_targets`), the api mode's ``__torch_function__`` and the
        #: dispatch mode's for an op already accepted in its state
        self.walker = (
            None
            if _TargetWalker is None
            else _TargetWalker(
                self._name_code,
                self.api_local,
                self._api_targets,
                self.api_target,
                self,
                _Mode.__torch_dispatch__,
                self.current_stream if self.cuda else None,
                NAMESPACES,
                PROFILING_MARKS,
            )
        )
        if self.walker is not None and self.check_dtypes:
            self.walker.dtypes = 1  # its op keys hold the dtype, as _Mode's do
        self.walk = self.active_targets if self.walker is None else self.walker.active_targets
        self._mode = _Mode(self)
        self._api_mode = _ApiMode(self) if self.api_names else None
        self._pushed = False
        self._started = False
        self._step_hook: Any = None
        self._step_pre_hook: Any = None
        #: where the set-up ends (the first step of each optimizer: SetupEnd)
        self.setup_end = SetupEnd()
        self._finished = False
        self.written: Path | None = None
        #: why the report could not be written (None: written, or not yet)
        self.write_error: str | None = None
        #: the collective checks (sequence_guard.py): the good run's sequences, a watchdog
        self.sequences = (
            SequenceChecker(collectives, self._collective_violation, self.checks)
            if collectives is not None
            else None
        )
        self.collective_timeout = collective_timeout
        self.watchdog: Watchdog | None = None
        #: the last collectives this process issued (a watchdog report names them)
        self.last_collectives: deque[str] = deque(maxlen=LAST)
        self.collective_checks = self.sequences is not None or collective_timeout is not None
        console = resolve_format(os.environ.get("OPGUARD_GUARD_LOG_FORMAT")) == "console"
        escape: list[Any] = [escape_controls] if console else []
        self.log = structlog.wrap_logger(
            structlog.PrintLogger(file=sys.stderr),
            processors=[
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="iso"),
                # names from the config: control characters escaped (JSON escapes them)
                *escape,
                structlog.dev.ConsoleRenderer(colors=False)
                if console
                else structlog.processors.JSONRenderer(),
            ],
        )

    # -- lifecycle ------------------------------------------------------------

    def start(self) -> None:
        """Push the mode and count optimizer steps (and start the watchdog, if asked)."""
        self._started = True
        if self.other_view:
            self.log.warning(
                "opguard guard: the config was recorded by "
                f"{', '.join(self.other_view)}, the guard sees ops as {GUARD_VIEW} does: "
                "ops, streams, dtypes and counts differ between them, so only "
                f"{', '.join(sorted(ACROSS_TRACERS))} are checked "
                '(docs/tracing.md, "Backends")'
            )
        self._step_hook = count_optimizer_steps(self._after_step)
        self._step_pre_hook = register_optimizer_step_pre_hook(self._before_step)
        self.checking = self.checks(0)
        self.checked_steps = int(self.checking)
        if self.collective_timeout is not None and self.watchdog is None:
            last = self.last_collectives
            self.watchdog = Watchdog(
                self.collective_timeout, self._waited_too_long, lambda: list(last)
            )
        if self.checking:
            self._push()

    def stop(self) -> None:
        """Pop the mode and remove the hooks; nothing else in the program was changed."""
        self._pop()
        if self.watchdog is not None:
            self.watchdog.stop()
        for hook in (self._step_hook, self._step_pre_hook):
            if hook is not None:
                hook.remove()
        self._step_hook = self._step_pre_hook = None

    def _push(self) -> None:
        if not self._pushed:
            # the modes' __enter__ and __exit__ have no annotations (unused without torch)
            self._mode.__enter__()  # type: ignore[no-untyped-call, unused-ignore]
            if self._api_mode is not None:
                self._api_mode.__enter__()  # type: ignore[no-untyped-call, unused-ignore]
            self._pushed = True

    def _pop(self) -> None:
        if self._pushed and _get_current_dispatch_mode() is self._mode:
            modes = _function_modes()  # type: ignore[no-untyped-call, unused-ignore]
            if self._api_mode is not None and modes[-1:] == [self._api_mode]:
                self._api_mode.__exit__(None, None, None)  # type: ignore[no-untyped-call, unused-ignore]
            self._mode.__exit__(None, None, None)  # type: ignore[no-untyped-call, unused-ignore]
            self._pushed = False

    def checks(self, step: int) -> bool:
        """Whether the step after ``step`` finished steps is checked: every
        ``round(1/sample)``-th, from the first (step 0: everything before the first
        optimizer step ended), or from the first step of the loop (step 1) when the
        config has no set-up (:attr:`skip_setup`)."""
        if self.skip_setup:
            return step >= 1 and (step - 1) % self.every == 0
        return step % self.every == 0

    def _forget_setup_counts(self) -> None:
        """The end of the set-up (the first optimizer step; of each optimizer, where
        several step: :class:`SetupEnd`): the whole-run counts start again, as the
        config's loop phase counts (:attr:`loop_counts`)."""
        with self._lock:
            for state in [*self._by_active.values(), *self._copies]:
                state.ops = 0
                state.ok.clear()  # each op seen again once: which ran in the loop
            self.extra_ops.clear()

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """A config of the loop does not hold an optimizer's first step (its lazy state:
        the set-up's), though another optimizer stepped before it (a GAN's)."""
        if self.skip_setup and self.checking and self.setup_end.first(optimizer):
            self.checking = False
            self._pop()

    def _after_step(self, optimizer: Any) -> None:
        self.step += 1
        if self.setup_end.ended(optimizer, self.step) and self.loop_counts:
            self._forget_setup_counts()
        checking = self.checks(self.step)
        if checking:
            self.checked_steps += 1
        if checking != self.checking:
            self.checking = checking
            if checking:
                self._push()
            else:
                self._pop()  # when another mode sits above ours, `checking` alone skips

    # -- states ---------------------------------------------------------------

    def _parents(self, target: str, as_api: bool = False) -> frozenset[str | None]:
        """The targets the config has directly above ``target`` (None: top level), by
        the kind of entry it is on this stack where it has both (:attr:`dual`)."""
        if target in self.dual:
            return self.parents_by_kind[as_api].get(target, frozenset())
        return self.parents.get(target, frozenset())

    def _has(self, key: EntryKey, as_api: bool) -> bool:
        """Whether the config has ``key`` as the kind of entry its target is here: a
        key that holds both kinds' nodes is given the frame's kind (formats.md §3), so
        an api's node may be in an entry of a function's kind, not the reverse."""
        entry = self.entries.get(key)
        if entry is None:
            return False
        return key[0] not in self.dual or as_api or entry.get("kind") != TORCH_API

    def _state(
        self,
        path: tuple[str, ...],
        target: str,
        known: frozenset[EntryKey],
        chain: tuple[tuple[Any, ...], ...] = (),
        as_api: bool = False,
    ) -> _State:
        context = path[-self.depth :] if self.depth > 0 else ()
        key = (target, context)
        has = self._has(key, as_api)
        if has:
            known = known | {key}
        child_path = (*path, target)[-self.depth :] if self.depth > 0 else ()
        interned = self._states.get((child_path, known, chain, as_api))
        if interned is not None and interned.key == key:
            return interned
        allowed: frozenset[str] | None = None
        streams: frozenset[str] | None = None
        dtypes: frozenset[str] | None = None
        for item in () if self.other_view else known:  # another view: ops not compared
            ops, ss, ds = self.ops[item], self.stream_sets[item], self.dtype_sets[item]
            allowed = ops if allowed is None else allowed & ops
            streams = ss if streams is None else streams & ss
            if ds is not None:
                dtypes = ds if dtypes is None else dtypes & ds
        state = _State(child_path, key, known, allowed, streams, dtypes)
        if not has and target in self.entry_targets and self.selection.keeps((*context, target)):
            listed = "; ".join(
                " > ".join(c) or "(top level)" for t, c in sorted(self.entries) if t == target
            )
            violation = Violation(
                "unknown_context",
                WARNING,
                target,
                list(context),
                [],
                f"{target} ran under [{' > '.join(context)}]; the config has it under {listed}",
            )
            state.unknown = self.remember(violation)
        state.chain = (*chain, state.unknown) if state.unknown is not None else chain
        state.watch = bool(state.known or state.chain)
        self._states[(child_path, known, chain, as_api)] = state
        return state

    def active_targets(
        self, frame: types.FrameType | None, api: str | None = None
    ) -> tuple[str | None, ...]:
        """``api``; the program's innermost function when the config lacks it and no
        config target runs inside it (else None); then the config targets running on
        the stack from ``frame`` outwards, innermost first. Each code object is named
        once (:meth:`_name_code`), as the tracer names it, so ``__main__``'s functions,
        nested functions and closures are found like any other; nothing is imported
        or replaced. ``_recorder.TargetWalker`` is its C twin."""
        names = self._code_targets
        found: list[str | None] = [api, None]
        leaf = True  # still looking for the program's innermost function
        crossed = False  # passed the guard's or torch's dispatch frames since the last
        while frame is not None:
            code = frame.f_code
            name = names.get(id(code), _UNSEEN)
            if name is _UNSEEN:
                name = self._name_code(code, frame.f_globals)
            if name is not None:
                mark = name[0]
                if mark == "\1":  # the guard's or torch's plumbing
                    crossed = True
                elif mark == "\0":  # a program function the config lacks
                    if leaf and len(found) == 2:
                        found[1] = name[1:]
                    leaf = crossed = False
                else:
                    # a call that re-entered the function which handed it to the api
                    # mode (handle_torch_function): the outer copy is not a caller
                    if not (crossed and len(found) > 2 and found[-1] == name):
                        found.append(name)
                    leaf = crossed = False
            frame = frame.f_back
        return tuple(found)

    def current_stream(self) -> int | None:
        """This guard's number of the current CUDA stream (noted as used: the first
        sight fixes it), or None before CUDA is initialized."""
        # torch.cuda.is_initialized has no annotations (unused without torch)
        if torch.cuda.is_initialized():  # type: ignore[no-untyped-call, unused-ignore]
            return self.streams.see(int(torch.cuda.current_stream().stream_id))
        return None

    def api_target(self, func: Any) -> str | None:
        """The ``torch_api`` target of the torch callable ``func``, named as the tracer
        and compress name it (``torch:Tensor.mul``); None for one without a name."""
        try:
            return self._api_targets[func]
        except KeyError:
            pass
        except TypeError:  # unhashable
            return None
        name = api_name(func)
        target = api_target(name) if name else None
        if len(self._api_targets) < 100_000:
            self._api_targets[func] = target
        return target

    def _name_code(self, code: types.CodeType, namespace: dict[str, Any]) -> str | None:
        """The config target ``code`` runs (``module:qualname``, the tracer's naming,
        ``__main__`` as the script's module), or None; remembered by ``id(code)``.
        Marked names: ``"\\1"`` torch's or the guard's plumbing, ``"\\0" + name`` a
        program function the config lacks, ``"\\2" + name`` a frame the config's
        ``--ignore`` cut out (walked as a target: :meth:`_cut_by_ignore`)."""
        module = program_module_name(namespace.get("__name__"), code.co_filename)
        name = target_name(module, code.co_filename, code.co_qualname)
        found: str | None = name if name in self.names else None
        if found is None and _dispatch_code(code):
            found = "\1"  # marked: the guard's or torch's dispatch plumbing
        elif found is None and self.selection.ignore and self.selection.hits(name)[1]:
            found = "\2" + name  # marked: a frame the config's --ignore cut out
        elif found is None and self.report_unknown and _program_code(code):
            found = "\0" + name  # marked: not a target, a program function it lacks
        with self._lock:
            self._codes.append(code)
            self._code_targets[id(code)] = found
        return found

    def _placed(self, active: tuple[str, ...], index: int) -> bool:
        """Whether ``active[index]`` sits where the config has it: one of its parents
        runs above it, or it is a top-level entry (a frame here: not the innermost)."""
        parents = self._parents(active[index])
        return None in parents or any(a in parents for a in active[index + 1 :])

    def _resolve_with_leaves(self, active: tuple[str | None, ...]) -> _State:
        """The state of ``(api, leaf, *targets)``: that of the targets, with the api
        below them when the config lists it; an api or a program function the
        config lacks is noted on a copy of it (``extra``) for the whole-run
        ``unknown_target``, under the context the check's tree gives it."""
        api, leaf = active[0], active[1]
        targets = tuple(t for t in active[2:] if t is not None)
        # where the config's --ignore cut out the op's own node (its api, or a frame
        # below every target), the targets count the op (the entries `filter` kept
        # count what ran inside the cut ones, as check's observed entries do), and
        # nothing cut out is checked or an unknown_*, as check's select_observed drops it
        cut = below = False
        if self.selection.ignore:
            targets, below = self._cut_by_ignore(targets)
            cut = below or (api is not None and self.selection.hits(api)[1])
        # an api that is the innermost target's own function (``F.batch_norm`` calling
        # itself through the api mode) is that frame's node in check's tree (compress
        # replaces the frame by its api), known whatever kind its entry was given
        known_api = api is not None and (
            api in self.api_names or (bool(targets) and targets[0] == api)
        )
        if targets not in self._ran and not below:  # an api's ops are its caller's own
            with self._lock:
                self._ran.add(targets)
                for stack in self._folded_over.pop(targets, ()):
                    self._by_active.pop(stack, None)  # no folded chain: resolved again
        if cut:
            state = self._resolve(targets) if targets else self._nothing
            self._by_active[active] = state
            return state
        if api is not None and known_api:
            base = self._resolve((api, *targets), api_first=True)
        else:
            base = self._resolve(targets)
        with self._lock:
            for path in base.folds:
                self._folded_over.setdefault(path, []).append(active)
        extra: list[EntryKey] = []
        if self.report_unknown and base.known:
            context = base.path[-self.depth :] if self.depth > 0 else ()
            if leaf is not None:
                extra.append((leaf, context))
                context = (leaf,)[-self.depth :] if self.depth > 0 else ()
            if api is not None and not known_api:
                extra.append((api, context))
        state = base
        if extra:
            state = _State(base.path, base.key, base.known, base.allowed, base.streams, base.dtypes)
            state.unknown, state.chain, state.extra = base.unknown, base.chain, tuple(extra)
            state.keys = base.keys
            state.watch = True
            with self._lock:
                self._copies.append(state)
        self._by_active[active] = state
        return state

    def _cut_by_ignore(self, targets: tuple[str, ...]) -> tuple[tuple[str, ...], bool]:
        """``targets`` without the frames the config's ``--ignore`` cut out
        (:meth:`_name_code` marks them ``"\\2"``), and whether the op's own node was cut
        out with them: such a frame below every target. A cut frame between two
        targets (torch's module plumbing under ``--ignore 'torch[.:].*'``, which check's
        tree hides) is passed over."""
        kept = tuple(t for t in targets if t[0] != "\2")
        return kept, len(kept) < len(targets) and targets[0][0] == "\2"

    def count_extra(self, keys: tuple[EntryKey, ...]) -> None:
        """One op of each target the config lacks in ``keys``."""
        counts = self.extra_ops
        for key in keys:
            counts[key] = counts.get(key, 0) + 1

    def _resolve(self, active: tuple[str, ...], api_first: bool = False) -> _State:
        """The state of the config targets ``active`` (innermost first).

        Each target's parent is the nearest target above it that the config has
        directly above it, skipping targets that cannot be where they are (none of
        their own parents above them, not top level: folded away on this path when
        the config was made, chain pruning, docs/compression.md); a target that can
        be where it is stops the search, and the target is under it (an
        ``unknown_context``, as ``opguard check`` finds it). A target the config has
        at top level ends the chain when no parent of its runs above it. Every chosen
        target's entry is active, as the config counts (inclusive).

        Where that makes an ``unknown_context`` but one of the target's parents runs
        further up, the targets between may be a chain the config folded into its
        deepest frame (a link with no ops of its own on this path: a function whose
        only work there is a hook, ``torch.utils.checkpoint``'s recomputation stopping
        inside it), which check's tree of this run folds alike; then the folded
        reading names the contexts, and an op either reading allows is accepted; not
        where a target between ran ops of its own on this path before (then it is a
        node check's tree keeps). Ops it runs only later leave the folded reading in
        place: the guard may then miss what check finds there, never the reverse."""
        chosen, folds = self._choose(active, fold=False, api_first=api_first)
        with self._lock:
            state = self._build(chosen, api_first)
            if folds and state.chain:
                chosen, folds = self._choose(active, fold=True, api_first=api_first)
                folded = self._build(chosen, api_first)
                if len(folded.chain) < len(state.chain):
                    state = self._either(state, folded)
                    state.folds = tuple(folds)
            self._by_active[active] = state
        return state

    def _choose(
        self, active: tuple[str, ...], fold: bool, api_first: bool = False
    ) -> tuple[list[str], list[tuple[str, ...]]]:
        """The targets of ``active`` whose entries are active (:meth:`_resolve`), and
        the paths (from a target up) where a target was placed under a nearer one
        though a parent of its ran further up (``fold``: skip those between, as a
        folded chain)."""
        chosen: list[str] = []
        folds: list[tuple[str, ...]] = []
        api = active[0] if api_first else None
        index = 0
        while index < len(active):
            target = active[index]
            chosen.append(target)
            parents = self._parents(target, as_api=api_first and index == 0)
            if target in self.dual and not any(a in parents for a in active[index + 1 :]):
                # one entry may hold both kinds' nodes (a frame's in a recomputation, the
                # api's in the forward pass, under the same parent): it has one kind
                parents = self.parents.get(target, frozenset())
            above = index + 1
            while above < len(active) and active[above] not in parents:
                if active[above] != target and self._placed(active, above):
                    if active[above:] in self._ran or not any(
                        a in parents for a in active[above + 1 :]
                    ):
                        break  # a real node here: ``target`` ran under it (unknown_context)
                    folds.append(active[above:])  # no op of its own here yet: maybe folded
                    if not fold:
                        break
                # folded away on this path when the config was made (the same target
                # above itself, which the config never has there: a chain folded into
                # its deepest frame, a decorator's wrapper calling another)
                above += 1
            if (
                index > 0
                and above < len(active)
                and active[above] == api
                and any(a in parents for a in active[above + 1 :])
            ):
                # the public call's own frame, not the innermost: check's tree gives
                # its ops to the call's node, so on this path the frame has none and
                # is folded into its child, which the config has further up too
                above += 1
                while above < len(active) and active[above] not in parents:
                    above += 1
            if above == len(active) and None in parents:
                break  # a top-level entry with no parent of its above it
            if above == len(active):
                above = index + 1
            index = above
        return chosen, folds

    def _build(self, chosen: list[str], api_first: bool = False) -> _State:
        """The interned state of the chosen targets (innermost first; ``api_first``:
        the innermost is the public call's entry)."""
        state = self._nothing
        path: tuple[str, ...] = ()
        known: frozenset[EntryKey] = frozenset()
        chain: tuple[tuple[Any, ...], ...] = ()
        keys: list[EntryKey] = []
        for at in range(len(chosen) - 1, -1, -1):
            target = chosen[at]
            state = self._state(path, target, known, chain, as_api=api_first and at == 0)
            path, known, chain = state.path, state.known, state.chain
            keys.append(state.key)  # type: ignore[arg-type]
        if keys and not state.keys:
            state.keys = tuple(keys)
        return state

    def _either(self, near: _State, folded: _State) -> _State:
        """``folded``'s entries and contexts, accepting what either state accepts."""

        def union(a: frozenset[str] | None, b: frozenset[str] | None) -> frozenset[str] | None:
            return None if a is None or b is None else a | b

        state = _State(
            folded.path,
            folded.key,
            folded.known,
            union(near.allowed, folded.allowed),
            union(near.streams, folded.streams),
            union(near.dtypes, folded.dtypes),
        )
        state.unknown, state.chain, state.keys = folded.unknown, folded.chain, folded.keys
        state.watch = folded.watch
        self._copies.append(state)
        return state

    # -- violations -----------------------------------------------------------

    def check_op(self, state: _State, key: Any) -> None:
        """First sight of an op (with its raw stream and dtype: the key is ``func``,
        ``(func, stream)`` or, where the config records dtypes, ``(func, stream, dtype)``)
        in ``state``: accept it or record why not."""
        self.checked_ops += 1
        func, raw, dtype = (*key, None)[:3] if isinstance(key, tuple) else (key, None, None)
        op = op_name(func)
        if op.startswith("c10d::") and self.rank is None:
            self._snapshot_rank()
        stream = None if raw is None else self.streams.role(raw, op)
        op_ok = state.allowed is None or op in state.allowed
        stream_ok = stream is None or state.streams is None or stream in state.streams
        dtype_ok = dtype is None or state.dtypes is None or dtype in state.dtypes
        state.ok[key] = op_ok and stream_ok and dtype_ok
        if op_ok and stream_ok and dtype_ok:
            return
        identities: list[tuple[Any, ...]] = []
        with self._lock:
            for item in sorted(state.known):
                target, context = item
                where = f"{target} [{' > '.join(context)}]" if context else target
                if not op_ok and op not in self.ops[item]:
                    message = f"{op} ran inside {where}, which does not list it"
                    identities.append(
                        self.remember(
                            Violation(
                                "unexpected_op", ERROR, target, list(context), [], message, op=op
                            )
                        )
                    )
                if not stream_ok and stream not in self.stream_sets[item]:
                    message = f"{op} of {where} ran on stream {stream}, which it does not list"
                    identities.append(
                        self.remember(
                            Violation(
                                "unexpected_stream",
                                ERROR,
                                target,
                                list(context),
                                [],
                                message,
                                stream=stream,
                            )
                        )
                    )
                dtypes = self.dtype_sets[item]
                if not dtype_ok and dtypes is not None and dtype not in dtypes:
                    message = f"{op} of {where} ran in {dtype}, which it does not list"
                    identities.append(
                        self.remember(
                            Violation(
                                "unexpected_dtype",
                                ERROR,
                                target,
                                list(context),
                                [],
                                message,
                                dtype=dtype,
                            )
                        )
                    )
            state.ok[key] = False
            self._bad[(id(state), key)] = identities
        self.repeat_op(state, key)

    def repeat_op(self, state: _State, key: Any) -> None:
        identities = self._bad.get((id(state), key), [])
        for identity in identities:
            self.hit(identity)
        if identities and self.on_violation == "raise":
            self.end_early(OpGuardViolation)
            raise OpGuardViolation(self.records[identities[0]].violation)

    def remember(self, violation: Violation) -> tuple[Any, ...]:
        """Register a violation (without counting it); return its identity."""
        identity = violation.identity()
        with self._lock:
            if identity not in self.records:
                self.records[identity] = _Record(violation, [])
        return identity

    def count_ops(self, chain: tuple[tuple[Any, ...], ...]) -> None:
        """One op under each ``unknown_context`` of ``chain``: its ``count`` and the
        ops its threshold test needs (:meth:`counts`)."""
        for identity in chain:
            self.hit(identity)
            self.records[identity].ops += 1

    def hit(self, identity: tuple[Any, ...]) -> None:
        """Count one occurrence; the first keeps the stack and (``warn``) is logged, but
        an ``unknown_context``'s, which needs the whole run's op count
        (:meth:`counts`), is logged when the guard finishes."""
        record = self.records[identity]
        record.count += 1
        if record.count == 1:
            record.stack = python_stack(sys._getframe(1))
            if record.violation.kind not in _AT_EXIT:
                self._log(record)

    def unknown_threshold(self) -> float:
        """The ops an ``unknown_context`` must run to count: the config's pruning
        threshold per rank, scaled up by the steps this guard checked over the
        config's (``meta.steps``) when the config records them, so a guarded run
        longer than the traced one keeps what the config pruned."""
        if not self.config_steps:
            return self.threshold
        checked = self.loop_steps() / self.every
        return self.threshold * max(checked, self.config_steps) / self.config_steps

    def counts(self, record: _Record) -> bool:
        """Whether ``record`` is a violation of this run (the report's and the
        console's test): it occurred, and an ``unknown_context`` ran enough ops."""
        if record.count == 0:
            return False
        kind = record.violation.kind
        return kind != "unknown_context" or record.ops >= self.unknown_threshold()

    def _log(self, record: _Record) -> None:
        """Log a violation on the console (``warn``): once per identity."""
        v = record.violation
        if self.on_violation == "warn":
            log = self.log.error if v.severity == ERROR else self.log.warning
            log(
                "opguard guard: violation",
                kind=v.kind,
                severity=v.severity,
                target=v.target,
                context=v.context,
                op=v.op,
                stream=v.stream,
                dtype=v.dtype,
                message=v.message,
            )

    # -- collectives (sequence_guard.py) -----------------------------------------

    def run_collective(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None
    ) -> Any:
        """Check a collective against the good run's sequence, then issue it (under the
        watchdog's eye when there is one)."""
        op = op_name(func)
        frame = sys._getframe(1)
        target = caller_target(frame)
        if is_collective(op):
            group, dtype, numel, shapes, reduce_op = describe(func, op, args, kwargs)
            call = (group[0] if group is not None else "?", dtype, numel, shapes, reduce_op)
            self.last_collectives.append(call_text(op, call, self.step))
            if self.sequences is not None:
                if self.sequences.rank is None:
                    self.sequences.bind(self.resolve_rank())
                self.sequences.check(op, call, self.step, target)
        watchdog = self.watchdog
        if watchdog is None:
            return func(*args, **(kwargs or {}))
        token = watchdog.enter(op, target, python_stack(frame))
        try:
            result = func(*args, **(kwargs or {}))
            work = work_of(result)
        except BaseException:
            watchdog.leave(token)
            raise
        if work is None:
            watchdog.leave(token)
        else:
            try:
                work.get_future().add_done_callback(lambda _: watchdog.leave(token))
            except Exception:  # a backend without futures: timed while the call ran
                watchdog.leave(token)
        return result

    def _collective_violation(self, violation: Violation, message: str, may_raise: bool) -> None:
        """A departure from the good run's collective sequence: counted and logged; the
        first of each is written to the report at once, since the job may hang on it
        and be killed, or the backend abort this rank, before the guard's exit."""
        identity = self.remember(violation)
        self.hit(identity)
        if self.records[identity].count == 1 and violation.severity == ERROR:
            self._write_now("its first collective departure")
        if may_raise and self.on_violation == "raise":
            self.end_early(OpGuardViolation)
            raise OpGuardViolation(violation)  # this call's (the record keeps the first)

    def _waited_too_long(
        self, op: str, target: str, message: str, stack: list[dict[str, Any]]
    ) -> None:
        """The watchdog's report: a ``collective_timeout`` error, logged and written now
        (a hung job may be killed before it exits)."""
        rank = self.resolve_rank()
        violation = Violation(
            "collective_timeout", ERROR, target, [], [], f"rank {rank}: {message}", op=op
        )
        identity = self.remember(violation)
        record = self.records[identity]
        record.count += 1
        if record.count == 1:
            record.stack = stack
        self.log.error(
            "opguard guard: collective timeout",
            kind="collective_timeout",
            rank=rank,
            op=op,
            message=violation.message,
            stack=[f"{f['file']}:{f['line']} {f['function']}" for f in stack[-8:]],
        )
        self._write_now("its collective timeout")

    def _write_now(self, as_of: str) -> None:
        """Write the report as it stands (the one at exit replaces it); never raises.
        Under ``opguard guard`` the process's status names it and ``as_of`` (what made
        it write: "its collective timeout"), so a process then killed is said to have
        left it, as of what."""
        try:
            written = self.write()
        except Exception as exc:
            print(f"opguard guard: could not write the report: {exc!r}", file=sys.stderr)
        else:
            write_status("started", report=str(written), as_of=as_of)

    # -- report ---------------------------------------------------------------

    def _snapshot_rank(self) -> None:
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                self.rank = dist.get_rank()
                self.world_size = dist.get_world_size()
        except Exception:
            pass

    def resolve_rank(self) -> int:
        """Rank: given, else torch.distributed's (seen at a collective or now), else
        ``$RANK``, else 0."""
        if self.fixed_rank is not None:
            return self.fixed_rank
        if self.rank is None:
            self._snapshot_rank()
        if self.rank is not None:
            return self.rank
        try:
            return int(os.environ.get("RANK", "0"))
        except ValueError:
            return 0

    def resolve_world_size(self) -> int:
        """The world size: torch.distributed's (seen with the rank), else
        ``$WORLD_SIZE``, else 1."""
        if self.world_size is not None:
            return self.world_size
        try:
            return int(os.environ.get("WORLD_SIZE", "1"))
        except ValueError:
            return 1

    def job_counts(self) -> dict[str, Any] | None:
        """What ``opguard guard`` needs of this rank to judge the whole-run kinds by
        the job as a whole (docs/guard.md, "One view of the job"): the rank, the world
        size, the loop steps; per config entry that ran, its ops counted and the ops
        that ran in it (``count_drift``, ``missing_op``:
        :class:`~opguard_plugins.enforce.rules.JobView`); the ops of every
        ``unknown_target`` and ``unknown_context`` seen, below this rank's threshold
        too, and that threshold (the job's is the ranks' added up, as the config's
        tree pruned the job's ops added up). None where the whole-run rules did not
        run."""
        if self.counted is None:
            return None
        pruned, total = self.pruned_entries()
        unknown = [
            ["unknown_target", target, list(context), ops]
            for (target, context), ops in self.extra_ops.items()
            if (target, context) not in self.entries
        ]
        unknown += [
            ["unknown_context", v.target, list(v.context), record.ops]
            for record in self.records.values()
            if (v := record.violation).kind == "unknown_context" and record.count
        ]
        return {
            "rank": self.resolve_rank(),
            "world_size": self.resolve_world_size(),
            "steps": self.loop_steps() or None,
            "entries": [
                [target, list(context), entry["count"], sorted(entry["ops"])]
                for (target, context), entry in sorted(self.counted.items())
            ],
            "threshold": self.unknown_threshold(),
            "unknown": sorted(unknown),
            "pruned": [
                [target, list(context), ops] for (target, context), ops in sorted(pruned.items())
            ],
            "total": total,
        }

    def violations(self) -> list[dict[str, Any]]:
        """The counted violations as report objects (formats.md §5), sorted."""
        from opguard_core.formats.check import sort_key

        rank = self.resolve_rank()
        out = []
        for record in sorted(self.records.values(), key=lambda r: sort_key(r.violation)):
            if not self.counts(record):
                continue  # (unknown_context: the config's thresholds would have pruned it)
            data = record.violation.to_dict()
            data["ranks"] = [rank]
            data.update({"rank": rank, "count": record.count, "stack": record.stack})
            out.append(data)
        return out

    def _counted(self) -> list[_State]:
        """Every state that ops were counted in, once (a copy resolved again since
        keeps the ops it counted)."""
        states = [*self._by_active.values(), *self._copies]
        return list({id(s): s for s in states}.values())

    def seen_targets(self) -> frozenset[str]:
        """The config targets that ran (in a checked step) on this process's stacks."""
        states = self._counted()
        return frozenset(key[0] for state in states if state.ops for key in state.known)

    def keys_ran(self) -> frozenset[EntryKey]:
        """The config keys active while checked ops ran, pruned or not (``CheckInput.ran``:
        a key too little here to be an entry of its own still ran)."""
        return frozenset(key for state in self._counted() if state.ops for key in state.keys)

    def _entry_tree(self) -> tuple[_Branch, int]:
        """The states' branches as a tree of entries (counts inclusive) and this
        run's ops (the total the pruning threshold is a fraction of)."""
        root: _Branch = [0, {}]
        total = 0
        for state in self._counted():
            total += state.ops
            if state.ops and state.keys:
                node = root
                for key in state.keys:
                    node = node[1].setdefault(key, [0, {}])
                node[0] += state.ops
        return root, total

    def observed_entries(self) -> dict[EntryKey, dict[str, Any]]:
        """Each config entry that was active while ops were checked, with their
        number, as ``opguard check`` would find it in a trace of this run: the
        states' branches make a tree of entries (counts inclusive), pruned as the
        config's settings prune (a subtree below ``max(min_count, min_fraction ×
        this run's ops)`` is folded into its parent and counts for no entry of its
        own: compression.md), then merged by key."""
        root, total = self._entry_tree()
        floor = pruning_floor(total, self.min_count, self.min_fraction)
        counts: dict[EntryKey, int] = {}
        todo = [root]
        while todo:
            for key, child in todo.pop()[1].items():
                count = _branch_total(child)
                if count >= floor:
                    counts[key] = counts.get(key, 0) + count
                    todo.append(child)
        # the ops each entry saw (first sights are noted per state: ``ok``)
        ran: dict[EntryKey, set[str]] = {}
        for state in self._counted():
            if state.ops and state.known:
                names = {op_name(k[0] if isinstance(k, tuple) else k) for k in list(state.ok)}
                for key in state.known:
                    ran.setdefault(key, set()).update(names)
        return {
            key: {"count": count, "ops": dict.fromkeys(sorted(ran.get(key, ())), 1)}
            for key, count in counts.items()
            if key in self.entries
        }

    def pruned_entries(self) -> tuple[dict[EntryKey, int], int]:
        """The config entries that ran here but too little to be entries of their own
        (:meth:`observed_entries` folded them into their parents), each with the ops
        it ran (inclusive, its outermost appearance on each path), and this run's
        ops: what ``opguard guard`` adds up over the ranks to prune the job's tree as
        ``opguard check`` does (docs/guard.md, "One view of the job")."""
        root, total = self._entry_tree()
        kept = self.counted or {}
        ran: dict[EntryKey, int] = {}
        todo: list[tuple[_Branch, frozenset[EntryKey]]] = [(root, frozenset())]
        while todo:
            node, above = todo.pop()
            for key, child in node[1].items():
                if key not in above and key in self.entries and key not in kept:
                    ran[key] = ran.get(key, 0) + _branch_total(child)
                todo.append((child, above | {key}))
        return ran, total

    def loop_steps(self) -> int:
        """The optimizer steps the whole-run counts cover (the loop's, where they start
        at the end of the set-up)."""
        return max(self.step - self.setup_end.steps, 0) if self.loop_counts else self.step

    def whole_run_config(self) -> Mapping[str, Any] | None:
        """The config the whole-run rules compare with: this config, or the share of
        ``source`` in a merged config that records its sources; None (no whole-run
        rules) for a merged config without a source named (docs/guard.md)."""
        return share_of(dict(self.config), self.source)

    @property
    def ended_early(self) -> bool:
        """Whether the program ended early (:attr:`partial`)."""
        return self.partial is not None

    def end_early(self, kind: type[BaseException] | None, status: Any = None) -> None:
        """Note that the program ends early, by an exception of ``kind`` (``sigint``
        for a KeyboardInterrupt, ``exit`` with the exit ``status`` for ``SystemExit``,
        else ``exception`` and its class name) or by SIGTERM (``kind`` None); the
        first cause is kept."""
        if self.partial is not None:
            return
        if kind is None:
            self.partial = partial_marker("sigterm", self.step)
        elif issubclass(kind, SystemExit):
            code = 0 if status is None else status if isinstance(status, int) else 1
            self.partial = partial_marker("exit", self.step, status=code)
        else:
            self.partial = ended_by(kind, self.step)

    def whole_run(self) -> list[Violation]:
        """What needs the whole run, by check's own rules: ``missing`` (a config
        entry of a Python function that never ran on this rank, where the config has
        it) and ``count_drift`` (its op count per step beyond check's default
        tolerance); both only when every step was checked (``sample`` 1)."""
        if not self.whole_run_rules or self.ended_early or self.checked_ops == 0:
            return []
        config = self.whole_run_config()
        if config is None:
            return []
        rank = self.resolve_rank()
        tracked = self.names | self.api_names
        expected = {entry_key(e): e for e in config["entries"] if entry_key(e)[0] in tracked}
        observed = self.observed_entries()
        ran = self.keys_ran()
        self.counted = {key: entry for key, entry in observed.items() if key in expected}
        ranks = [int(r) for r in (config.get("meta") or {}).get("ranks") or [rank]]
        # the steps of what is compared: a merged config's source's own, not the sum
        # over every source (which made each count look short: count_drift everywhere)
        expected_steps = config_steps(config.get("meta") or {})
        found: list[Violation] = []
        # sampled: what ran between checked steps was not seen, so "never ran" and
        # drift would be invented (guard.md: sampling may miss, never invent)
        for key in sorted(expected) if self.every == 1 else ():
            check = CheckInput(
                rank=rank,
                key=key,
                config=dict(config),
                expected=expected,
                observed={rank: observed},
                ranks=ranks,
                tolerance=DEFAULT_TOLERANCE,
                expected_steps=expected_steps,
                observed_steps={rank: self.loop_steps() or None},
                loop=self.loop_counts and not self.other_view,  # a rule of one view
                ran={rank: ran},
            )
            found.extend(missing(observed.get(key), expected[key], check))
            if self.other_view:
                continue  # what ran, not how much of which op (ACROSS_TRACERS)
            found.extend(missing_ops(observed.get(key), expected[key], check))
            found.extend(count_drift(observed.get(key), expected[key], check))
        threshold = self.unknown_threshold()
        for (target, context), ops in sorted(self.extra_ops.items()):
            if (
                ops >= threshold
                and (target, context) not in self.entries
                and self.selection.keeps((*context, target))
            ):
                where = f"{target} [{' > '.join(context)}]" if context else target
                message = f"{where} ran ({ops} ops) and is not in the config"
                found.append(
                    Violation("unknown_target", WARNING, target, list(context), [rank], message)
                )
        return found

    def report(self) -> dict[str, Any]:
        """The ``opguard-guard-report`` document."""
        return guard_report(
            config=self.config_path,
            rank=self.resolve_rank(),
            violations=self.violations(),
            on_violation=self.on_violation,
            sample=self.sample,
            steps=self.step,
            checked_steps=min(self.checked_steps, self.step + 1),
            targets_seen=len(self.seen_targets()),
            partial=self.partial,
        )

    def write(self) -> Path:
        """Write ``guard_report_rank{R}.json`` atomically; return its path."""
        document = self.report()
        self.report_dir.mkdir(parents=True, exist_ok=True)
        path = self.report_dir / f"guard_report_rank{document['rank']}.json"
        write_json(path, document)
        self.written = path
        return path

    def finish(self) -> Path | None:
        """Stop, add the whole-run violations, and write the report, once; never raises."""
        if self._finished:
            return self.written
        self._finished = True
        try:
            self.stop()
        except Exception as exc:
            print(f"opguard guard: could not stop cleanly: {exc!r}", file=sys.stderr)
        try:
            for violation in self.whole_run():
                identity = self.remember(violation)
                self.records[identity].count += 1
        except Exception as exc:
            print(f"opguard guard: could not check the whole run: {exc!r}", file=sys.stderr)
        # under `opguard guard`, which judges count_drift and missing_op by the whole
        # job from every rank's counts, those are logged there, once judged
        counts = self.job_counts()
        judged_later = JUDGED_BY_JOB if counts is not None and write_job_counts(counts) else ()
        try:  # what needs the run's counts is logged now: unknown_context, missing, drift
            from opguard_core.formats.check import sort_key

            for record in sorted(self.records.values(), key=lambda r: sort_key(r.violation)):
                kind = record.violation.kind
                if kind in _AT_EXIT and kind not in judged_later and self.counts(record):
                    self._log(record)
        except Exception as exc:
            print(f"opguard guard: could not log: {exc!r}", file=sys.stderr)
        try:
            return self.write()
        except Exception as exc:
            self.write_error = one_line(str(exc) or repr(exc))
            print(f"opguard guard: could not write the report: {self.write_error}", file=sys.stderr)
            return None


_STDLIB = tuple(
    os.path.abspath(p) + os.sep
    for p in {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]}
)
_OPGUARD_PREFIXES = tuple(
    os.path.dirname(os.path.abspath(m.__file__)) + os.sep
    for m in (sys.modules["opguard_core"], sys.modules["opguard_plugins"])
    if m.__file__
)


#: a node of the tree of entries at exit: [own ops, children by key]
_Branch = list[Any]


def _branch_total(node: _Branch) -> int:
    """The ops of a branch of entries and everything below it."""
    total, todo = 0, [node]
    while todo:
        item = todo.pop()
        total += item[0]
        todo.extend(item[1].values())
    return int(total)


def _dispatch_code(code: types.CodeType) -> bool:
    """Whether ``code`` is the guard's own or torch's dispatch plumbing."""
    filename = os.path.abspath(code.co_filename)
    return filename in _OWN_FILES or filename in _PLUMBING


def _program_code(code: types.CodeType) -> bool:
    """Whether ``code`` is the program's own (or a library's it uses): not torch's,
    opguard's, the standard library's, or generated (``<string>``)."""
    filename = code.co_filename
    if filename.startswith("<"):
        return False
    path = os.path.abspath(filename)
    if path.startswith(_TORCH_PREFIX) or path.startswith(_OPGUARD_PREFIXES):
        return False
    return not (path.startswith(_STDLIB) and os.sep + "site-packages" + os.sep not in path)


def caller_target(frame: types.FrameType | None) -> str:
    """``module:qualname`` of the innermost frame outside torch and the guard (the
    program's line that issued the call); ``?`` when there is none."""
    while frame is not None:
        filename = os.path.abspath(frame.f_code.co_filename)
        if filename not in _OWN_FILES and not filename.startswith(_TORCH_PREFIX):
            module = program_module_name(frame.f_globals.get("__name__"), filename)
            return f"{module}:{frame.f_code.co_qualname}"
        frame = frame.f_back
    return "?"


def python_stack(frame: types.FrameType | None) -> list[dict[str, Any]]:
    """The Python stack at ``frame``, outermost first, without the guard's and torch's
    dispatch frames; at most the innermost 40."""
    frames: list[tuple[types.CodeType, int]] = []
    while frame is not None:
        frames.append((frame.f_code, frame.f_lineno or 0))
        frame = frame.f_back
    kept: list[tuple[types.CodeType, int]] = []
    crossed = False
    for code, line in reversed(frames):  # outermost first
        if _dispatch_code(code):
            crossed = True
            continue
        if crossed:  # a call that re-entered its caller through a mode: the inner copy
            for back in range(1, min(4, len(kept)) + 1):
                if kept[-back][0] is code:
                    del kept[-back:]
                    break
        crossed = False
        kept.append((code, line))
    out = [
        {"file": code.co_filename, "line": line, "function": code.co_qualname}
        for code, line in kept
    ]
    return out[-_STACK_LIMIT:]


def _load(config: str | os.PathLike[str] | Mapping[str, Any]) -> tuple[Mapping[str, Any], str]:
    if isinstance(config, Mapping):
        return config, str(config.get("source", ""))
    path = Path(config)
    if path.is_dir():  # a run directory: its final config, as `opguard guard --config RUN`
        from opguard_core.run.summary import config_source

        path = config_source(path)
    return load_config(path), str(path)


@contextmanager
def guarded(
    config: str | os.PathLike[str] | Mapping[str, Any],
    report_dir: str | os.PathLike[str] = ".",
    on_violation: str = "warn",
    sample: float = 1.0,
    rank: int | None = None,
    collectives: str | os.PathLike[str] | Collectives | None = None,
    collective_timeout: float | None = None,
    source: str | None = None,
    whole_run: bool = False,
) -> Iterator[Guard]:
    """Enforce ``config`` on the ``with`` block; write the report when it ends.

    :param config: a config path, a run directory (its final config, as
        ``opguard guard --config RUN``) or a loaded config.
    :param report_dir: where ``guard_report_rank{R}.json`` goes (created if missing).
    :param on_violation: ``warn`` (log each violation's first occurrence) or ``raise``
        (:class:`OpGuardViolation` inside the offending call).
    :param sample: check every ``round(1/sample)``-th optimizer step (1.0: all).
    :param rank: the rank to report; by default torch.distributed's, else ``$RANK``.
    :param collectives: the good run's collective sequences (a callsite trace's path,
        or loaded): each collective is checked before it is issued (sequence_guard.py);
        by default the config's own (config version 4), if it recorded any.
    :param source: which source's sequences, when the config has several.
    :param collective_timeout: report a collective call that waits longer (seconds).
    :param whole_run: the block is the whole program run: at its end, also report
        ``missing`` and ``count_drift`` (docs/guard.md, "What needs the whole run");
        skipped when the block ends by an exception.
    """
    loaded, path = _load(config)
    if collectives is None:
        collectives = config_sequences(loaded, path, source)
    elif not isinstance(collectives, Collectives):
        collectives = load_collectives(Path(collectives))
    guard = Guard(
        loaded,
        path,
        report_dir,
        on_violation,
        sample,
        rank,
        collectives,
        collective_timeout,
        source,
        whole_run,
    )
    guard.start()
    try:
        yield guard
    except SystemExit as exc:
        if exc.code not in (None, 0):  # sys.exit(0) ends the block as it should, as at exit
            guard.end_early(SystemExit, exc.code)
        raise
    except BaseException as exc:
        guard.end_early(type(exc))
        raise
    finally:
        guard.finish()


# ---------------------------------------------------------------------------
# Whole-process guarding (used by `opguard guard`'s bootstrap)
# ---------------------------------------------------------------------------

_PROCESS_GUARD: Guard | None = None


def start_process_guard() -> Guard | None:
    """Guard this whole process from now on, as the ``OPGUARD_GUARD_*`` environment says.

    Does nothing in torchrun's launcher. The report is written at exit (``atexit``,
    which also runs after an uncaught exception) or on SIGTERM.
    """
    global _PROCESS_GUARD
    if _PROCESS_GUARD is not None or _is_launcher():
        return _PROCESS_GUARD
    config_path = os.environ["OPGUARD_GUARD_CONFIG"]
    sequences = os.environ.get("OPGUARD_GUARD_COLLECTIVES")
    timeout = os.environ.get("OPGUARD_GUARD_COLLECTIVE_TIMEOUT")
    config = load_config(Path(config_path))
    source = os.environ.get("OPGUARD_GUARD_SOURCE")
    guard = Guard(
        config,
        config_path,
        os.environ.get("OPGUARD_GUARD_DIR", "."),
        os.environ.get("OPGUARD_GUARD_ON_VIOLATION", "warn"),
        float(os.environ.get("OPGUARD_GUARD_SAMPLE", "1")),
        collectives=load_collectives(Path(sequences))
        if sequences
        else config_sequences(config, config_path, source),
        collective_timeout=float(timeout) if timeout else None,
        source=source,
        whole_run=True,
    )
    guard.start()
    _note_uncaught_exceptions(guard)
    _PROCESS_GUARD = guard
    write_status("started", **({"helper": True} if multiprocessing_child() else {}))
    atexit.register(_finish_process_guard)
    at_sigterm(_on_sigterm)
    return guard


def _finish_process_guard() -> None:
    """At exit: write the report, except in torchrun's launcher (known only by now)."""
    if _PROCESS_GUARD is None:
        return
    if _is_launcher():
        _PROCESS_GUARD.stop()
        clear_status()
        return
    if _PROCESS_GUARD._finished:
        return
    if multiprocessing_child() and _PROCESS_GUARD.checked_ops == 0:
        # a DataLoader worker ended as its work did: nothing of the config ran here, and
        # a report would stand in the report of the rank it inherited
        _PROCESS_GUARD.stop()
        write_status("finished", report=None, checked=0, helper=True)
        return
    # a SIGTERM while the report is written (torchrun tearing down the job as this
    # rank exits) waits for it, instead of ending the process half-way through
    with signals_deferred():
        written = _PROCESS_GUARD.finish()
        write_status(
            "finished",
            report=None if written is None else str(written),
            error=_PROCESS_GUARD.write_error,
            checked=_PROCESS_GUARD.checked_ops,
            # a config of the loop is checked from the end of the first step on
            waits_for_a_step=_PROCESS_GUARD.skip_setup and _PROCESS_GUARD.step == 0,
        )


def _note_uncaught_exceptions(guard: Guard) -> None:
    """Mark the guard's run as ended early when an exception goes uncaught (the
    program's own ``sys.excepthook`` still runs) or the program calls ``sys.exit``
    with a failure status."""
    previous = sys.excepthook
    program_exit = sys.exit

    def hook(kind: Any, value: Any, traceback: Any) -> None:
        guard.end_early(kind)
        previous(kind, value, traceback)

    def exit_noting_failure(status: Any = None) -> Any:
        if status not in (None, 0):
            guard.end_early(SystemExit, status)
        return program_exit(status)

    sys.excepthook = hook
    sys.exit = exit_noting_failure


def _on_sigterm(ends: bool) -> None:
    """SIGTERM: write the report now when the process ends with it; else the program's
    own handler runs and the report is written at exit."""
    if _PROCESS_GUARD is not None:
        _PROCESS_GUARD.end_early(None)
    if ends:
        _finish_process_guard()


__all__ = [
    "Guard",
    "OpGuardViolation",
    "guarded",
    "python_stack",
    "sample_every",
    "start_process_guard",
]
