"""One piece of work in a forked child while this process goes on: the second core.

``ForkedCall.start(work)`` forks; the child runs ``work()`` and sends its result back
pickled through a pipe, then leaves with ``os._exit`` (no ``atexit`` handler, no
``finally`` of the parent's stack runs twice). ``result()`` waits for it; ``cancel()``
kills it. The child shares the parent's memory copy-on-write, so it starts at once
with everything already loaded and built. It dies with the parent (SIGKILL, Linux:
:func:`opguard_core.processes.die_with_parent`), so a killed ``opguard run`` leaves no
helper holding its run directory.

A fork is only safe with a single thread (another thread may hold a lock the child
would never see released), so :func:`can_fork` says no while any other thread runs
(a progress bar refreshing, a queue's feeder thread) and callers then do the work
in-process.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from opguard_core.errors import OpGuardError
from opguard_core.processes import before_fork, die_with_parent


def can_fork() -> bool:
    """Whether :meth:`ForkedCall.start` may fork here and now."""
    return "fork" in multiprocessing.get_all_start_methods() and threading.active_count() == 1


class ForkedCall:
    """A call running in a forked child (see the module docstring)."""

    def __init__(self, pid: int, fd: int, what: str) -> None:
        self.pid = pid
        self.fd = fd
        self.what = what
        #: the child's wait status, once it is reaped
        self.status: int | None = None
        #: whether result() or cancel() has taken the pipe (closed it)
        self.taken = False

    @classmethod
    def start(cls, work: Callable[[], Any], what: str) -> ForkedCall | None:
        """Fork and run ``work()`` in the child; None (nothing started) when this
        process may not fork. ``what`` names the work in errors."""
        if not can_fork():
            return None
        for stream in (sys.stdout, sys.stderr):  # or the child would write them again
            with contextlib.suppress(Exception):
                stream.flush()
        before_fork()  # die_with_parent's libc, looked up here, not in the child
        read_fd, write_fd = os.pipe()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the child
            code = 0
            try:
                # an orphan would hold the run directory: die with the parent
                die_with_parent(signal.SIGKILL, parent)
                os.close(read_fd)
                signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                try:
                    data = pickle.dumps(("ok", work()), protocol=pickle.HIGHEST_PROTOCOL)
                except BaseException as exc:  # everything goes back
                    data = pickle.dumps(("error", f"{type(exc).__name__}: {exc}"))
                view = memoryview(data)
                while view:
                    view = view[os.write(write_fd, view) :]
                for stream in (sys.stdout, sys.stderr):
                    with contextlib.suppress(Exception):
                        stream.flush()
            except BaseException:  # never return into the parent's stack
                code = 1
            finally:
                os._exit(code)
        os.close(write_fd)
        return cls(pid, read_fd, what)

    def result(self) -> Any:
        """Wait for the child; its ``work()`` result. Raises :class:`OpGuardError`
        naming ``what`` when ``work()`` raised or the child died without a result (or
        with part of one: killed while it sent it)."""
        chunks = []
        self.taken = True
        try:
            while chunk := os.read(self.fd, 1 << 20):
                chunks.append(chunk)
        except BaseException:  # interrupted while waiting: killed, not waited for
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            raise
        finally:
            os.close(self.fd)
            if self.status is None:
                _, self.status = os.waitpid(self.pid, 0)
        status = self.status
        try:
            kind, value = pickle.loads(b"".join(chunks))
        except Exception:  # nothing, or cut short: the child died before or while sending it
            if os.WIFSIGNALED(status):
                how = f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
            else:
                how = f"exit code {os.waitstatus_to_exitcode(status)}"
            raise OpGuardError(
                f"{self.what}: its helper process died ({how}; out of memory?)"
            ) from None
        if kind == "error":
            raise OpGuardError(f"{self.what}: {value}")
        return value

    def ended(self) -> bool:
        """Whether the child has ended and its result (if it sent one) waits in the pipe
        for :meth:`result`, which will not block; False once the pipe is taken."""
        if self.status is None and not self.taken:
            with contextlib.suppress(ChildProcessError):
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                self.status = status if pid else None
        return self.status is not None and not self.taken

    def cancel(self) -> None:
        """Kill the child (if it still runs) and reap it. Once reaped, never again: the
        pid and the pipe's descriptor may by then be another process's and file's."""
        if not self.taken:
            self.taken = True
            with contextlib.suppress(OSError):
                os.close(self.fd)
        if self.status is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                _, self.status = os.waitpid(self.pid, 0)
