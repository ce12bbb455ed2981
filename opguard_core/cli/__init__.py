"""The ``opguard`` command line: the group (:mod:`.app`), ``opguard run``
(:mod:`.run_command`), and what command plugins use: the one exit-code table
(:mod:`.exits`) and the shared options (:mod:`.options`).

``main`` (the console script) and ``create_cli`` are loaded on first use, so a plugin
importing :mod:`.exits` or :mod:`.options` does not load the group.
"""

from __future__ import annotations

from typing import Any

__all__ = ["create_cli", "main"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from opguard_core.cli import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
