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
  arrive when the block ends. A child forked inside the block inherits the mask and
  calls :func:`signals_undeferred` first.
* :func:`at_sigterm` runs callbacks when SIGTERM arrives (the tracer writes its trace,
  the guard its report), then does what would have happened without them: the
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
DEFERRED_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM back for the block; their handlers run as it ends
    (where the platform has no signal mask, nothing is held back)."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, DEFERRED_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def signals_undeferred() -> None:
    """Let SIGINT and SIGTERM in again: a child started inside
    :func:`signals_deferred` calls this first."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, DEFERRED_SIGNALS)


_CALLBACKS: list[Callable[[bool], None]] = []
_PREVIOUS: Any = None
_INSTALLED = False


def sigterm_ends_process() -> bool:
    """Whether SIGTERM ends this process once the :func:`at_sigterm` callbacks ran:
    no handler of the program's was installed before ours, and it was not ignored."""
    return not callable(_PREVIOUS) and _PREVIOUS != signal.SIG_IGN


def _on_sigterm(signum: int, frame: Any) -> None:
    ends = sigterm_ends_process()
    for callback in list(_CALLBACKS):
        try:
            callback(ends)
        except Exception as exc:  # one failing callback must not stop the others
            print(f"opguard: at SIGTERM: {exc!r}", file=sys.stderr)
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


__all__ = [
    "at_sigterm",
    "child_dies_with_parent",
    "die_with_parent",
    "signals_deferred",
    "signals_undeferred",
    "sigterm_ends_process",
]
