"""Processes that end with their command, and work done when a process is told to stop.

Two small things every launcher and every traced process of OpGuard shares:

* :func:`die_with_parent` asks the kernel to send a signal to this process when its
  parent dies (Linux ``prctl(PR_SET_PDEATHSIG)``), then checks the parent is still the
  one it was (it may have died before the request). :func:`child_dies_with_parent` is
  the ``preexec_fn`` form for :class:`subprocess.Popen`: ``opguard trace`` and
  ``opguard guard`` start their command with it (SIGTERM, so a traced program writes
  its trace on the way out), and ``opguard run``'s forked helpers call
  :func:`die_with_parent` (SIGKILL) first thing. Elsewhere (macOS, Windows) there is
  no such request: :func:`die_with_parent` returns False and a command killed with
  SIGKILL leaves its child running (docs/reliability.md, "Crash-safe recording").
  The request reaches the direct child only, and is tied to the *thread* that
  started it: launch from the main thread (both launchers do).
* :func:`signals_deferred` holds SIGINT and SIGTERM back for a block whose locks a
  signal's exception would leak (``multiprocessing.Queue.put`` takes a lock its
  feeder thread and its finalizer need: a KeyboardInterrupt between the acquire and
  the ``with`` block leaves it held, and the process hangs at exit); the signals
  arrive when the block ends.
* :func:`multiprocessing_child` tells a process that ``multiprocessing`` started by
  spawn or forkserver (a DataLoader worker): its parent ends it as it exits, so it
  may leave no trace or report, and that is no failure of COMMAND's.
* :func:`at_sigterm` runs callbacks when SIGTERM arrives (the tracer writes its trace,
  the guard its report; a SIGTERM that arrives while they run does not start them
  again), then does what would have happened without them: the
  handler that was installed before is called, or, where there was none, the process
  dies of SIGTERM as it would have (status 128+15 to a shell).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

#: ``prctl`` option: the signal to get when the parent dies (linux/prctl.h)
PR_SET_PDEATHSIG = 1

_PRCTL: Any = None


def _prctl() -> Any:
    """libc's ``prctl``, or None off Linux (looked up once, before any fork)."""
    global _PRCTL
    if _PRCTL is None:
        function: Any = False
        if sys.platform.startswith("linux"):
            with contextlib.suppress(OSError, AttributeError):
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
                function = libc.prctl
                function.argtypes = [ctypes.c_int, ctypes.c_ulong]
                function.restype = ctypes.c_int
        _PRCTL = function
    return _PRCTL or None


def before_fork() -> None:
    """Look up now what :func:`die_with_parent` needs in a child about to be forked:
    in the child, ctypes' ``find_library`` runs ``ldconfig -p``, a fork of the child
    (all the parent's pages, counted again in the process tree's RSS while it lasts)
    and ~10 ms at its start."""
    _prctl()


def die_with_parent(sig: int, parent: int) -> bool:
    """Get signal ``sig`` when the parent process dies; ``parent`` is the pid it had
    before the fork. If it is gone already (this process was re-parented before the
    request took effect), ``sig`` is sent now. False where the platform cannot do it."""
    prctl = _prctl()
    if prctl is None or prctl(PR_SET_PDEATHSIG, int(sig)) != 0:
        return False
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)
    return True


def child_dies_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` for :class:`subprocess.Popen` making the child get ``sig``
    when this process dies; None where the platform cannot do it (nothing to run)."""
    if _prctl() is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        die_with_parent(sig, parent)

    return preexec


#: the signals :func:`signals_deferred` holds back
DEFERRED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM back for the block: a handler that only notes them
    replaces the installed ones, which come back as the block ends and then get each
    noted signal (raised again, so a default action still ends the process).

    Python runs signal handlers in the main thread whichever thread the kernel picks,
    so this holds for a process with threads too (a signal mask would not: it blocks
    one thread). Outside the main thread, or where a handler was installed from C (it
    could not be put back), nothing is held back. A child forked inside the block
    inherits the noting handler: it installs its own first thing, and a signal sent
    to it before then is lost (so its parent follows SIGTERM with SIGKILL)."""
    previous = {sig: signal.getsignal(sig) for sig in DEFERRED_SIGNALS}
    if threading.current_thread() is not threading.main_thread() or None in previous.values():
        yield
        return
    noted: list[int] = []

    def note(signum: int, frame: Any) -> None:
        if signum not in noted:
            noted.append(signum)

    for sig in DEFERRED_SIGNALS:
        signal.signal(sig, note)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for signum in noted:
            signal.raise_signal(signum)


_CALLBACKS: list[Callable[[bool], None]] = []
_PREVIOUS: Any = None
_INSTALLED = False


def sigterm_ends_process() -> bool:
    """Whether SIGTERM ends this process once the :func:`at_sigterm` callbacks ran:
    no handler of the program's was installed before ours, and it was not ignored."""
    return not callable(_PREVIOUS) and _PREVIOUS != signal.SIG_IGN


_RUNNING = False


def _on_sigterm(signum: int, frame: Any) -> None:
    global _RUNNING
    if _RUNNING:
        # a second SIGTERM (a launcher that sends two, a user who presses twice) while
        # the callbacks write: the first call finishes them, then does what SIGTERM does;
        # running them again here would end the process with a report half-written
        return
    _RUNNING = True
    ends = sigterm_ends_process()
    try:
        for callback in list(_CALLBACKS):
            try:
                callback(ends)
            except Exception as exc:  # one failing callback must not stop the others
                print(f"opguard: at SIGTERM: {exc!r}", file=sys.stderr)
    finally:
        _RUNNING = False
    previous = _PREVIOUS
    if callable(previous):
        previous(signum, frame)
        return
    if previous == signal.SIG_IGN:
        return
    # no handler before ours: die of SIGTERM, as the process would have
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def at_sigterm(callback: Callable[[bool], None]) -> bool:
    """Run ``callback(ends)`` when this process gets SIGTERM, then what SIGTERM did
    before (the handler installed then, nothing if it was ignored, else die of it);
    ``ends`` says whether the process ends then (:func:`sigterm_ends_process`).

    The handler is installed once, from the main thread (Python runs signal handlers
    only there); False when that is not possible (called from another thread). A
    handler the program installs later replaces it (its own, then, decides)."""
    global _INSTALLED, _PREVIOUS
    if not _INSTALLED:
        if threading.current_thread() is not threading.main_thread():
            return False
        try:
            _PREVIOUS = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, _on_sigterm)
        except (ValueError, OSError):
            return False
        _INSTALLED = True
    if callback not in _CALLBACKS:
        _CALLBACKS.append(callback)
    return True


def multiprocessing_child() -> bool:
    """Whether this process is a child that ``multiprocessing`` started with the spawn
    or forkserver method (a DataLoader worker, a pool's worker, or the forkserver
    itself): such a process is ended by its parent (``terminate()``, SIGTERM) as the
    parent exits, before its own exit handlers run. Children of the fork method are
    not (they share the parent's state and end by ``os._exit``)."""
    # spawn: `python -c '… spawn_main(…)' --multiprocessing-fork` (then ``sys.argv`` is
    # the parent's); forkserver: `python -c 'from multiprocessing.forkserver import main…'`
    started_by = sys.orig_argv
    return "--multiprocessing-fork" in started_by or any(
        "from multiprocessing.forkserver import main" in arg for arg in started_by
    )


__all__ = [
    "at_sigterm",
    "before_fork",
    "child_dies_with_parent",
    "die_with_parent",
    "multiprocessing_child",
    "signals_deferred",
    "sigterm_ends_process",
]
