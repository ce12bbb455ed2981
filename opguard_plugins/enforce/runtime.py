"""The runtime guard: enforces an instrumentation config inside a running program.

Used by ``opguard guard`` (through the bootstrap, :func:`start_process_guard`) and by
hand with :func:`guarded`::

    from opguard_plugins.enforce.runtime import guarded

    with guarded("config.yaml", report_dir="reports", on_violation="raise"):
        for step in range(steps):
            train_step(...)

How it works (docs/guard.md):

* **Targets are wrapped.** Every config target of kind ``function``/``method`` and
  every target named in a context is replaced, where it is defined (module attribute
  or class ``__dict__``), by a thin wrapper that pushes an *active-target state*
  while it runs; module-level functions are also replaced in every module that
  imported them by name. Modules not imported yet are wrapped right after they are
  (an import hook); a module still being imported when the guard starts (the
  program's first import imports torch, a circular import) is wrapped when its
  import finishes (:class:`_LoadingSpec`). A target that cannot be imported or
  wrapped is listed in the report's ``unwrapped`` with the reason, never an error.
  ``torch_api`` entries are not wrapped: their ops count for the enclosing function
  entries (inclusive).
* **A state** is the (target, context) key of the innermost active target plus the
  set of every active config entry (the key and all its active ancestors), with the
  intersection of their op lists: an op is accepted when it is in that
  intersection, which is exactly "every active entry lists it" (inclusive counting,
  as the config counts). States are interned, so the per-op check is one dict lookup.
* **One TorchDispatchMode** sees every operator and checks it against the current
  thread's state. Streams are checked by role (formats.md, "Streams and roles"):
  on CUDA every op's current stream is noted (:class:`StreamRoles`, so side streams
  are numbered in order of first use, as the tracer numbers them; with ``sample``, a
  stream first used in an unchecked step is numbered when it is next seen). A
  violation's first occurrence keeps the Python stack; ``warn`` logs it once,
  ``raise`` raises :class:`OpGuardViolation` inside the offending call.
* **Sampling**: with ``sample=P`` only every ``round(1/P)``-th optimizer step is
  checked (steps counted with torch's global optimizer step hook, from 0, so step 0,
  which includes everything before the first ``optimizer.step()``, is checked); in
  the other steps the mode is popped and ops cost nothing. Targets stay wrapped so
  the active-target stack stays right.
* **The report** ``guard_report_rank{R}.json`` (formats.md §5) is written atomically
  at exit: by ``atexit`` (also after an uncaught exception), on SIGTERM (torchrun
  stopping the other workers) and when :func:`guarded` exits, however it exits.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib.abc
import importlib.machinery
import os
import sys
import threading
import types
from collections import deque
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import structlog
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from opguard_core.errors import one_line
from opguard_core.formats.check import (
    ERROR,
    WARNING,
    EntryKey,
    Violation,
    guard_report,
    sample_every,
    write_json,
)
from opguard_core.formats.collectives import Collectives, is_collective
from opguard_core.formats.config import entry_key, load_config
from opguard_core.formats.streams import StreamRoles
from opguard_core.formats.tree import TORCH_API
from opguard_core.logs import escape_controls, resolve_format
from opguard_core.processes import at_sigterm
from opguard_plugins.enforce import sequence_guard
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
from opguard_plugins.enforce.status import clear_status, write_status
from opguard_plugins.record.collectives import describe
from opguard_plugins.record.tracer import _is_launcher, count_optimizer_steps, op_name

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
MAIN_REASON = (
    "defined in the program's __main__ script, which is running before its functions "
    "exist; its entries are checked through the targets it calls"
)


class OpGuardViolation(RuntimeError):
    """Raised inside the offending call by ``on_violation="raise"``.

    :ivar violation: the :class:`~opguard_core.formats.check.Violation` (the first of
        the call, when it breaks several entries).
    """

    def __init__(self, violation: Violation) -> None:
        super().__init__(f"opguard guard: {violation.kind}: {violation.message}")
        self.violation = violation


def main_module_alias() -> str | None:
    """The name the tracer records for ``__main__``: its spec's name, else the file stem."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and getattr(spec, "name", None):
        return str(spec.name)
    path = getattr(main, "__file__", None)
    return Path(path).stem if isinstance(path, str) else None


class _State:
    """What is active on a thread: the innermost target's key and the active entries."""

    __slots__ = (
        "allowed",
        "chain",
        "children",
        "key",
        "known",
        "ok",
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
    ) -> None:
        self.path = path  # the last `depth` active targets, outermost first
        self.key = key
        self.known = known
        self.allowed = allowed
        self.streams = streams
        self.ok: dict[Any, bool] = {}
        self.children: dict[str, _State] = {}
        self.unknown: tuple[Any, ...] | None = None  # an unknown_context identity
        #: the unknown_context identities active here (own and ancestors'): their op counts
        self.chain: tuple[tuple[Any, ...], ...] = ()
        self.watch = bool(known)  # anything to do per op: known entries or a chain


class _Record:
    __slots__ = ("count", "ops", "stack", "violation")

    def __init__(self, violation: Violation, stack: list[dict[str, Any]]) -> None:
        self.violation = violation
        self.stack = stack
        self.count = 0
        self.ops = 0  # ops run while it was active (unknown_context)


# TorchDispatchMode's __init_subclass__ and __init__ have no annotations; without torch
# the class is Any (misc); the ignores are unused there
class _Mode(TorchDispatchMode):  # type: ignore[no-untyped-call, misc, unused-ignore]
    """Checks every operator against the current thread's state."""

    def __init__(self, guard: Guard) -> None:
        super().__init__()  # type: ignore[no-untyped-call, unused-ignore]
        self.guard = guard
        self.local = guard.local
        self.cuda = guard.cuda

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        stream: int | None = None
        # torch.cuda.is_initialized has no annotations (unused without torch)
        if self.cuda and torch.cuda.is_initialized():  # type: ignore[no-untyped-call, unused-ignore]
            stream = self.guard.streams.see(int(torch.cuda.current_stream().stream_id))
        state = getattr(self.local, "state", None)
        if state is not None and state.watch and self.guard.checking:
            guard = self.guard
            if state.chain:
                guard.count_ops(state.chain)
            if state.known:
                key: Any = func if stream is None else (func, stream)
                ok = state.ok.get(key)
                if ok is None:
                    guard.check_op(state, key)
                elif not ok:
                    guard.repeat_op(state, key)
        if self.guard.collective_checks and getattr(func, "namespace", None) in NAMESPACES:
            return self.guard.run_collective(func, args, kwargs)
        return func(*args, **(kwargs or {}))


class _ImportWatcher(importlib.abc.MetaPathFinder):
    """Wraps a target module's targets right after the module has been executed."""

    def __init__(self, guard: Guard) -> None:
        self.guard = guard
        self._busy = threading.local()

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name not in self.guard.pending or getattr(self._busy, "on", False):
            return None
        self._busy.on = True
        try:
            spec = None
            for finder in sys.meta_path:  # the finders after us, in their order
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
        finally:
            self._busy.on = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module
        guard = self.guard

        def exec_then_wrap(module: types.ModuleType) -> None:
            exec_module(module)
            guard.wrap_module(name, module)

        spec.loader.exec_module = exec_then_wrap  # type: ignore[method-assign]
        return spec


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
    ) -> None:
        if on_violation not in ON_VIOLATION:
            raise ValueError(f"on_violation must be warn or raise, not {on_violation!r}")
        self.config_path = config_path
        self.report_dir = Path(report_dir)
        self.on_violation = on_violation
        self.sample = sample
        self.every = sample_every(sample)
        self.fixed_rank = rank
        self.rank: int | None = None
        meta = config.get("meta") or {}
        settings = meta.get("settings") or {}
        ranks = len(meta.get("ranks") or [0]) or 1
        #: an unknown_context with fewer ops (per rank) is below what the config keeps
        self.threshold = max(
            float(settings.get("min_count", 1) or 0),
            float(settings.get("min_fraction", 0) or 0) * float(meta.get("total", 0) or 0) / ranks,
        )
        self.depth = int(settings.get("context_depth", 1) or 0)
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
        kinds: dict[str, set[str]] = {}
        for (target, _), entry in self.entries.items():
            kinds.setdefault(target, set()).add(str(entry.get("kind") or ""))
        self.entry_targets = frozenset(kinds)
        context_targets = {t for _, context in self.entries for t in context}
        watched = {t for t, k in kinds.items() if k != {TORCH_API}}
        watched |= {t for t in context_targets if kinds.get(t) != {TORCH_API}}
        self.watched = frozenset(watched)
        self.names = self.watched | frozenset(context_targets)
        #: module -> qualnames still to wrap
        self.pending: dict[str, set[str]] = {}
        for target in sorted(self.watched):
            module, _, qualname = target.partition(":")
            self.pending.setdefault(module, set()).add(qualname)
        self.unwrapped: dict[str, str] = {}
        self.wrapped: set[str] = set()
        self._restore: list[tuple[Any, str, Any, Any]] = []
        self._states: dict[tuple[Any, ...], _State] = {}
        self._tops: dict[tuple[tuple[str, ...], str], _State] = {}
        self.records: dict[tuple[Any, ...], _Record] = {}
        #: (state, op key) -> the identities of the violations it makes
        self._bad: dict[tuple[int, Any], list[tuple[Any, ...]]] = {}
        self._lock = threading.RLock()
        self.local = threading.local()
        self.cuda = torch.cuda.is_available()
        self.step = 0
        self.checked_steps = 0
        #: ops checked against the config (first sights per state): 0 means the guard
        #: checked nothing (no config target ran)
        self.checked_ops = 0
        #: modules that were still being imported when the guard started: wrapped
        #: when their import finishes (:func:`_when_loaded`)
        self.loading: set[str] = set()
        self.checking = True
        self._mode = _Mode(self)
        self._pushed = False
        self._watcher: _ImportWatcher | None = None
        self._step_hook: Any = None
        self._finished = False
        self.written: Path | None = None
        #: why the report could not be written (None: written, or not yet)
        self.write_error: str | None = None
        #: the collective checks (sequence_guard.py): the good run's sequences, a watchdog
        self.sequences = (
            SequenceChecker(collectives, self._collective_violation)
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
        """Wrap the targets (now and on import), push the mode, count optimizer steps."""
        alias = main_module_alias()
        replaced: dict[Any, Any] = {}
        for module_name in list(self.pending):
            module = sys.modules.get(module_name)
            if module is None and module_name == alias:
                module = sys.modules.get("__main__")
            # half-loaded (the program's first import imports torch, or a circular
            # import): its functions may not exist yet; wrap when it is done
            later = functools.partial(self._loaded, module_name)
            if module is not None and _initializing(module) and _when_loaded(module, later):
                self.loading.add(module_name)
                continue
            if module is not None:
                self.wrap_module(module_name, module, replaced)
        if replaced:
            self._replace_references(replaced)
        self._watcher = _ImportWatcher(self)
        sys.meta_path.insert(0, self._watcher)
        self._step_hook = count_optimizer_steps(self._after_step)
        self.checked_steps = 1
        if self.collective_timeout is not None and self.watchdog is None:
            last = self.last_collectives
            self.watchdog = Watchdog(
                self.collective_timeout, self._waited_too_long, lambda: list(last)
            )
        self._push()

    def _loaded(self, module_name: str) -> None:
        """A module that was half-loaded when the guard started has finished importing:
        wrap its targets now (if the guard still runs and the import succeeded)."""
        self.loading.discard(module_name)
        module = sys.modules.get(module_name)
        if self._watcher is None or module is None or module_name not in self.pending:
            return
        self.wrap_module(module_name, module)

    def stop(self, unwrap: bool = True) -> None:
        """Pop the mode, remove the hooks and (by default) restore every original."""
        self._pop()
        if self.watchdog is not None:
            self.watchdog.stop()
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None
        if self._watcher is not None:
            with contextlib.suppress(ValueError):
                sys.meta_path.remove(self._watcher)
            self._watcher = None
        if unwrap:
            for owner, name, original, wrapper in reversed(self._restore):
                with contextlib.suppress(Exception):
                    if isinstance(owner, dict):
                        if owner.get(name) is wrapper:
                            owner[name] = original
                    else:
                        setattr(owner, name, original)
            self._restore.clear()

    def _push(self) -> None:
        if not self._pushed:
            # the mode's __enter__ and __exit__ have no annotations (unused without torch)
            self._mode.__enter__()  # type: ignore[no-untyped-call, unused-ignore]
            self._pushed = True

    def _pop(self) -> None:
        if self._pushed and _get_current_dispatch_mode() is self._mode:
            self._mode.__exit__(None, None, None)  # type: ignore[no-untyped-call, unused-ignore]
            self._pushed = False

    def _after_step(self) -> None:
        self.step += 1
        checking = self.step % self.every == 0
        if checking:
            self.checked_steps += 1
        if checking != self.checking:
            self.checking = checking
            if checking:
                self._push()
            else:
                self._pop()  # when another mode sits above ours, `checking` alone skips

    # -- wrapping -------------------------------------------------------------

    def wrap_module(
        self,
        module_name: str,
        module: types.ModuleType,
        replaced: dict[Any, Any] | None = None,
    ) -> None:
        """Wrap every pending target of ``module_name`` found in ``module``; module-level
        functions are replaced in other modules too (now, or by the caller that passes
        ``replaced`` to collect them)."""
        scan = replaced is None
        replaced = {} if replaced is None else replaced
        with self._lock:
            qualnames = self.pending.pop(module_name, set())
            for qualname in sorted(qualnames):
                target = f"{module_name}:{qualname}"
                try:
                    reason = self._wrap(module, target, qualname, replaced)
                except Exception as exc:  # never break the program
                    reason = f"cannot wrap: {exc!r}"
                if reason is None:
                    self.wrapped.add(target)
                    self.unwrapped.pop(target, None)
                else:
                    self.unwrapped[target] = reason
            if scan and replaced:
                self._replace_references(replaced)

    def _wrap(
        self,
        module: types.ModuleType,
        target: str,
        qualname: str,
        replaced: dict[Any, Any],
    ) -> str | None:
        if "<locals>" in qualname or "<" in qualname:
            return "a nested or generated function (its qualname has <...>) cannot be reached"
        parts = qualname.split(".")
        owner: Any = module
        for part in parts[:-1]:
            owner = getattr(owner, part, None)
            if owner is None:
                return f"{'.'.join(parts[:-1])} not found in module {module.__name__}"
        name = parts[-1]
        is_class = isinstance(owner, type)
        value = owner.__dict__.get(name) if is_class else getattr(owner, name, None)
        if value is None and module.__name__ == "__main__":
            return MAIN_REASON
        if value is None:
            return f"{name} not found in {getattr(owner, '__name__', owner)}"
        descriptor: type[Any] | None = None
        function = value
        if isinstance(value, staticmethod | classmethod):
            descriptor, function = type(value), value.__func__
        if getattr(function, "__opguard_guard__", False):
            return None
        if not isinstance(function, types.FunctionType):
            return f"not a Python function (a {type(function).__name__}); it cannot be wrapped"
        wrapper = self._make_wrapper(function, target)
        new_value = descriptor(wrapper) if descriptor is not None else wrapper
        setattr(owner, name, new_value)
        self._restore.append((owner, name, value, new_value))
        if is_class:
            self._wrap_subclass_copies(owner, name, function, target)
        else:
            replaced[function] = wrapper
        return None

    def _wrap_subclass_copies(
        self, owner: type, name: str, function: types.FunctionType, target: str
    ) -> None:
        """Subclasses that already hold a decorated copy of the method (torch's
        optimizers patch ``step`` per class) get that copy wrapped too."""
        seen: set[type] = set()
        todo: list[type] = list(owner.__subclasses__())
        while todo:
            sub = todo.pop()
            if sub in seen:
                continue
            seen.add(sub)
            todo.extend(sub.__subclasses__())
            link, hops = sub.__dict__.get(name), 0
            while link is not None and hops < 8:
                inner = getattr(link, "__wrapped__", None)
                if inner is function:
                    self._wrap_closure(link, function, target)
                    break
                link, hops = inner, hops + 1

    def _wrap_closure(self, link: Any, function: types.FunctionType, target: str) -> None:
        """Wrap ``function`` inside the decorator ``link`` that closes over it, so the
        decorator's own work stays outside the target (as in the trace)."""
        for cell in getattr(link, "__closure__", None) or ():
            if cell.cell_contents is function:
                wrapper = self._make_wrapper(function, target)
                cell.cell_contents = wrapper
                self._restore.append((cell, "cell_contents", function, wrapper))
                return

    def _replace_references(self, replaced: dict[Any, Any]) -> None:
        """Replace ``from m import f`` copies of wrapped functions in every module."""
        function = types.FunctionType
        for module in list(sys.modules.values()):
            namespace = getattr(module, "__dict__", None)
            if not isinstance(namespace, dict):
                continue
            hits = [
                (name, value)
                for name, value in namespace.items()
                if type(value) is function and value in replaced
            ]
            for name, value in hits:
                namespace[name] = replaced[value]
                self._restore.append((namespace, name, value, replaced[value]))

    def _make_wrapper(self, original: types.FunctionType, target: str) -> Any:
        local = self.local
        guard = self

        @functools.wraps(original)
        def opguard_guarded(*args: Any, **kwargs: Any) -> Any:
            if not guard.checking:  # an unsampled step: ops inside go to the last state
                return original(*args, **kwargs)
            parent = getattr(local, "state", None)
            if parent is None:
                child = guard.top_state(target)
            else:
                child = parent.children.get(target)
                if child is None:
                    child = guard.child_state(parent, target)
            if child.unknown is not None:
                guard.hit(child.unknown)
            local.state = child
            try:
                return original(*args, **kwargs)
            finally:
                local.state = parent

        opguard_guarded.__opguard_guard__ = True  # type: ignore[attr-defined]
        return opguard_guarded

    # -- states ---------------------------------------------------------------

    def _state(
        self,
        path: tuple[str, ...],
        target: str,
        known: frozenset[EntryKey],
        chain: tuple[tuple[Any, ...], ...] = (),
    ) -> _State:
        context = path[-self.depth :] if self.depth > 0 else ()
        key = (target, context)
        if key in self.entries:
            known = known | {key}
        child_path = (*path, target)[-self.depth :] if self.depth > 0 else ()
        interned = self._states.get((child_path, known, chain))
        if interned is not None and interned.key == key:
            return interned
        allowed: frozenset[str] | None = None
        streams: frozenset[str] | None = None
        for item in known:
            ops, ss = self.ops[item], self.stream_sets[item]
            allowed = ops if allowed is None else allowed & ops
            streams = ss if streams is None else streams & ss
        state = _State(child_path, key, known, allowed, streams)
        if key not in self.entries and target in self.entry_targets:
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
        self._states[(child_path, known, chain)] = state
        return state

    def child_state(self, parent: _State, target: str) -> _State:
        with self._lock:
            state = self._state(parent.path, target, parent.known, parent.chain)
            parent.children[target] = state
            return state

    def top_state(self, target: str) -> _State:
        """A target entered with no active target on this thread: its context comes
        from the Python stack (targets that are not wrapped, e.g. in ``__main__``)."""
        path = self._frame_context(sys._getframe(2))
        cached = self._tops.get((path, target))
        if cached is not None:
            return cached
        with self._lock:
            state = self._state(path, target, frozenset())
            self._tops[(path, target)] = state
            return state

    def _frame_context(self, frame: types.FrameType | None) -> tuple[str, ...]:
        if self.depth <= 0:
            return ()
        alias = main_module_alias()
        found: list[str] = []
        while frame is not None and len(found) < self.depth:
            module = frame.f_globals.get("__name__")
            if module == "__main__":
                module = alias
            name = f"{module}:{frame.f_code.co_qualname}"
            if name in self.names:
                found.append(name)
            frame = frame.f_back
        return tuple(reversed(found))

    # -- violations -----------------------------------------------------------

    def check_op(self, state: _State, key: Any) -> None:
        """First sight of an op (and raw stream) in ``state``: accept it or record why not."""
        self.checked_ops += 1
        func, raw = key if isinstance(key, tuple) else (key, None)
        op = op_name(func)
        if op.startswith("c10d::") and self.rank is None:
            self._snapshot_rank()
        stream = None if raw is None else self.streams.role(raw, op)
        op_ok = state.allowed is None or op in state.allowed
        stream_ok = stream is None or state.streams is None or stream in state.streams
        state.ok[key] = op_ok and stream_ok
        if op_ok and stream_ok:
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
            state.ok[key] = False
            self._bad[(id(state), key)] = identities
        self.repeat_op(state, key)

    def repeat_op(self, state: _State, key: Any) -> None:
        identities = self._bad.get((id(state), key), [])
        for identity in identities:
            self.hit(identity)
        if identities and self.on_violation == "raise":
            raise OpGuardViolation(self.records[identities[0]].violation)

    def remember(self, violation: Violation) -> tuple[Any, ...]:
        """Register a violation (without counting it); return its identity."""
        identity = violation.identity()
        with self._lock:
            if identity not in self.records:
                self.records[identity] = _Record(violation, [])
        return identity

    def count_ops(self, chain: tuple[tuple[Any, ...], ...]) -> None:
        for identity in chain:
            self.records[identity].ops += 1

    def hit(self, identity: tuple[Any, ...]) -> None:
        """Count one occurrence; the first keeps the stack and (``warn``) is logged."""
        record = self.records[identity]
        record.count += 1
        if record.count == 1:
            record.stack = python_stack(sys._getframe(1))
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
        identity = self.remember(violation)
        self.hit(identity)
        if may_raise and self.on_violation == "raise":
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
        try:
            self.write()
        except Exception as exc:
            print(f"opguard guard: could not write the report: {exc!r}", file=sys.stderr)

    # -- report ---------------------------------------------------------------

    def _snapshot_rank(self) -> None:
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                self.rank = dist.get_rank()
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

    def violations(self) -> list[dict[str, Any]]:
        """The counted violations as report objects (formats.md §5), sorted."""
        from opguard_core.formats.check import sort_key

        rank = self.resolve_rank()
        out = []
        for record in sorted(self.records.values(), key=lambda r: sort_key(r.violation)):
            if record.count == 0:
                continue
            if record.violation.kind == "unknown_context" and record.ops < self.threshold:
                continue  # the config's thresholds would have pruned it too
            data = record.violation.to_dict()
            data["ranks"] = [rank]
            data.update({"rank": rank, "count": record.count, "stack": record.stack})
            out.append(data)
        return out

    def report(self) -> dict[str, Any]:
        """The ``opguard-guard-report`` document."""
        unwrapped = dict(self.unwrapped)
        alias = main_module_alias()
        for module, qualnames in self.pending.items():
            reason = MAIN_REASON if module == alias else f"module {module} was never imported"
            if module in self.loading:
                reason = (
                    f"module {module} was being imported when the guard started, "
                    "and that import never finished"
                )
            for qualname in qualnames:
                unwrapped[f"{module}:{qualname}"] = reason
        return guard_report(
            config=self.config_path,
            rank=self.resolve_rank(),
            violations=self.violations(),
            unwrapped=[{"target": t, "reason": r} for t, r in sorted(unwrapped.items())],
            on_violation=self.on_violation,
            sample=self.sample,
            steps=self.step,
            checked_steps=min(self.checked_steps, self.step + 1),
            wrapped=len(self.wrapped),
        )

    def write(self) -> Path:
        """Write ``guard_report_rank{R}.json`` atomically; return its path."""
        document = self.report()
        self.report_dir.mkdir(parents=True, exist_ok=True)
        path = self.report_dir / f"guard_report_rank{document['rank']}.json"
        write_json(path, document)
        self.written = path
        return path

    def finish(self, unwrap: bool = True) -> Path | None:
        """Stop and write the report, once; never raises."""
        if self._finished:
            return self.written
        self._finished = True
        try:
            self.stop(unwrap=unwrap)
        except Exception as exc:
            print(f"opguard guard: could not stop cleanly: {exc!r}", file=sys.stderr)
        try:
            return self.write()
        except Exception as exc:
            self.write_error = one_line(str(exc) or repr(exc))
            print(f"opguard guard: could not write the report: {self.write_error}", file=sys.stderr)
            return None


def _initializing(module: types.ModuleType) -> bool:
    """Whether ``module`` is still being imported (its code has not finished running)."""
    spec = getattr(module, "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


class _LoadingSpec(importlib.machinery.ModuleSpec):
    """A half-loaded module's spec while the guard waits for its import to finish:
    importlib sets ``spec._initializing = False`` right after the module's code ran
    (``importlib._bootstrap._load_unlocked``, in a ``finally``), which calls the
    callbacks :func:`_when_loaded` registered and turns the spec back into a plain
    ``ModuleSpec``."""

    @property
    def _initializing(self) -> bool:
        return bool(self.__dict__.get("_initializing", False))

    @_initializing.setter
    def _initializing(self, value: bool) -> None:
        self.__dict__["_initializing"] = value
        if value:
            return
        callbacks = self.__dict__.pop("_opguard_when_loaded", [])
        self.__class__ = importlib.machinery.ModuleSpec  # type: ignore[assignment]
        for callback in callbacks:
            try:
                callback()
            except Exception as exc:  # never break the program's import
                print(f"opguard guard: cannot wrap a late module: {exc!r}", file=sys.stderr)


def _when_loaded(module: types.ModuleType, callback: Any) -> bool:
    """Call ``callback()`` once ``module``'s import finishes; False when that cannot be
    watched (a spec that is not a plain ``ModuleSpec``)."""
    spec = getattr(module, "__spec__", None)
    if type(spec) is _LoadingSpec:
        spec.__dict__.setdefault("_opguard_when_loaded", []).append(callback)
        return True
    if type(spec) is not importlib.machinery.ModuleSpec:
        return False
    try:
        spec.__dict__["_opguard_when_loaded"] = [callback]
        spec.__class__ = _LoadingSpec
    except TypeError:
        spec.__dict__.pop("_opguard_when_loaded", None)
        return False
    return True


def caller_target(frame: types.FrameType | None) -> str:
    """``module:qualname`` of the innermost frame outside torch and the guard (the
    program's line that issued the call); ``?`` when there is none."""
    while frame is not None:
        filename = os.path.abspath(frame.f_code.co_filename)
        if filename not in _OWN_FILES and not filename.startswith(_TORCH_PREFIX):
            module = frame.f_globals.get("__name__")
            if module == "__main__":
                module = main_module_alias() or module
            return f"{module}:{frame.f_code.co_qualname}"
        frame = frame.f_back
    return "?"


def python_stack(frame: types.FrameType | None) -> list[dict[str, Any]]:
    """The Python stack at ``frame``, outermost first, without the guard's and torch's
    dispatch frames; at most the innermost 40."""
    out: list[dict[str, Any]] = []
    while frame is not None:
        code = frame.f_code
        filename = os.path.abspath(code.co_filename)
        if filename not in _OWN_FILES and filename not in _PLUMBING:
            out.append(
                {"file": code.co_filename, "line": frame.f_lineno, "function": code.co_qualname}
            )
        frame = frame.f_back
    out.reverse()
    return out[-_STACK_LIMIT:]


def _load(config: str | os.PathLike[str] | Mapping[str, Any]) -> tuple[Mapping[str, Any], str]:
    if isinstance(config, Mapping):
        return config, str(config.get("source", ""))
    return load_config(Path(config)), str(config)


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
) -> Iterator[Guard]:
    """Enforce ``config`` on the ``with`` block; write the report when it ends.

    :param config: a config path or a loaded config.
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
    """
    loaded, path = _load(config)
    if collectives is None:
        collectives = config_sequences(loaded, path, source)
    elif not isinstance(collectives, Collectives):
        collectives = load_collectives(Path(collectives))
    guard = Guard(
        loaded, path, report_dir, on_violation, sample, rank, collectives, collective_timeout
    )
    guard.start()
    try:
        yield guard
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
    guard = Guard(
        config,
        config_path,
        os.environ.get("OPGUARD_GUARD_DIR", "."),
        os.environ.get("OPGUARD_GUARD_ON_VIOLATION", "warn"),
        float(os.environ.get("OPGUARD_GUARD_SAMPLE", "1")),
        collectives=load_collectives(Path(sequences))
        if sequences
        else config_sequences(config, config_path, os.environ.get("OPGUARD_GUARD_SOURCE")),
        collective_timeout=float(timeout) if timeout else None,
    )
    guard.start()
    _PROCESS_GUARD = guard
    write_status("started")
    atexit.register(_finish_process_guard)
    at_sigterm(_on_sigterm)
    return guard


def _finish_process_guard() -> None:
    """At exit: write the report, except in torchrun's launcher (known only by now)."""
    if _PROCESS_GUARD is None:
        return
    if _is_launcher():
        _PROCESS_GUARD.stop(unwrap=False)
        clear_status()
        return
    if _PROCESS_GUARD._finished:
        return
    written = _PROCESS_GUARD.finish(unwrap=False)
    write_status(
        "finished",
        report=None if written is None else str(written),
        error=_PROCESS_GUARD.write_error,
        checked=_PROCESS_GUARD.checked_ops,
    )


def _on_sigterm(ends: bool) -> None:
    """SIGTERM: write the report now when the process ends with it; else the program's
    own handler runs and the report is written at exit."""
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
