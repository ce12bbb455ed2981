"""Logging and progress: structlog to stderr, console on a terminal, JSON otherwise.

``configure_logging`` is called once by the CLI; it only records the format and
level, and structlog is imported and configured on the first :func:`get_logger`, so
a command that logs nothing (``opguard --version``, ``--help``) never imports it.
``progress`` shows a rich progress
bar only in console mode on a terminal; in JSON mode, or when stderr is not a
terminal, it shows nothing.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

from opguard_core.errors import one_line

_state: dict[str, Any] = {"format": "json", "tty": False, "level": logging.INFO, "applied": False}


def resolve_format(requested: str | None) -> str:
    """``console`` on a terminal, ``json`` otherwise, unless ``requested`` forces one."""
    if requested in ("console", "json"):
        return requested
    return "console" if sys.stderr.isatty() else "json"


def configure_logging(log_format: str | None = None, verbose: int = 0) -> str:
    """Set the format and level of this process's logs; returns the format in use.
    structlog itself is configured when the first logger is made."""
    fmt = resolve_format(log_format)
    _state["format"] = fmt
    _state["tty"] = sys.stderr.isatty()
    _state["level"] = logging.DEBUG if verbose else logging.INFO
    _state["applied"] = False
    if "structlog" in sys.modules:  # already in use: apply now, as before
        _apply()
    return fmt


def _apply() -> None:
    """Configure structlog from ``_state``."""
    import structlog

    renderer: Any
    escape: list[Any] = []
    if _state["format"] == "console":
        renderer = structlog.dev.ConsoleRenderer(colors=_state["tty"])
        escape = [escape_controls]  # JSON escapes them itself
    else:
        renderer = structlog.processors.JSONRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            *escape,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_state["level"]),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    _state["applied"] = True


def escape_controls(logger: Any, method: str, event: dict[str, Any]) -> dict[str, Any]:
    """A structlog processor: control characters in the event and in every string
    value (and in strings inside lists, tuples and dicts) escaped, so a file name
    or a trace string cannot forge a console log line."""
    return {key: _escaped(value) for key, value in event.items()}


def _escaped(value: Any) -> Any:
    if isinstance(value, str):
        return one_line(value)
    if isinstance(value, list | tuple):
        return [_escaped(v) for v in value]
    if isinstance(value, dict):
        return {_escaped(k): _escaped(v) for k, v in value.items()}
    return value


def current_format() -> str:
    """The log format :func:`configure_logging` set: ``console`` or ``json``."""
    return str(_state["format"])


def get_logger(**initial: Any) -> Any:
    """The ``opguard`` structlog logger (structlog configured first if it is not yet)."""
    import structlog

    if not _state["applied"]:
        _apply()
    return structlog.get_logger("opguard").bind(**initial)


def progress_enabled() -> bool:
    return bool(_state["format"] == "console" and _state["tty"] and sys.stderr.isatty())


@contextlib.contextmanager
def progress(description: str, total: int) -> Iterator[Callable[[int], None]]:
    """Yield ``advance(n)``; draws a bar on a terminal in console mode, else nothing."""
    if not progress_enabled() or total <= 1:
        yield _ignore
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as bar:
        task = bar.add_task(description, total=total)

        def advance(n: int = 1) -> None:
            bar.advance(task, n)

        yield advance


def _ignore(n: int = 1) -> None:
    """Progress callback that draws nothing."""
