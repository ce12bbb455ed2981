"""SIGINT and SIGTERM during ``opguard run``: stop between writes, say where.

While a run runs, SIGTERM raises :class:`~opguard_core.errors.Interrupted` and SIGINT
a ``KeyboardInterrupt`` noted as the user's (when Python's default handler was
installed), so a KeyboardInterrupt raised by a plugin without a SIGINT is told apart:
it fails its stage instead of stopping the run.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from types import FrameType

from opguard_core.errors import Interrupted


class Interrupts:
    """The run's signal handlers (see the module docstring)."""

    def __init__(self) -> None:
        self.sigint_tracked = False
        self.sigint_received = False

    def from_user(self, exc: KeyboardInterrupt) -> bool:
        """Whether a KeyboardInterrupt came from a SIGINT (not raised by a plugin)."""
        return not self.sigint_tracked or self.sigint_received

    @contextlib.contextmanager
    def handled(self) -> Iterator[None]:
        """Install the handlers for the block; the previous ones come back after it."""
        previous_term = signal.getsignal(signal.SIGTERM)
        previous_int = signal.getsignal(signal.SIGINT)
        signal.signal(signal.SIGTERM, _raise_interrupted)
        if previous_int is signal.default_int_handler:
            signal.signal(signal.SIGINT, self._on_sigint)
            self.sigint_tracked = True
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous_term)
            if self.sigint_tracked:
                signal.signal(signal.SIGINT, previous_int)

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        self.sigint_received = True
        raise KeyboardInterrupt


def _raise_interrupted(signum: int, frame: FrameType | None) -> None:
    raise Interrupted(signal.Signals(signum).name)


__all__ = ["Interrupts"]
