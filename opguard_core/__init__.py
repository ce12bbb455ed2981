"""OpGuard core: hook specifications, plugin manager, runner, formats and CLI.

Plugins import the markers from here::

    from opguard_core import hookimpl

    @hookimpl
    def opguard_filter(config):
        ...

The markers are made on first use (a module ``__getattr__``), so that importing
``opguard_core`` for ``opguard --version`` or ``opguard run --help`` does not import
pluggy (and, through it, ``importlib.metadata``): docs/performance.md, start-up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pluggy

    hookspec: pluggy.HookspecMarker
    hookimpl: pluggy.HookimplMarker

PROJECT_NAME = "opguard"
ENTRY_POINT_GROUP = "opguard"

#: the one place the version is written (pyproject.toml reads it from here)
__version__ = "0.1.0"

_MARKERS = {"hookspec": "HookspecMarker", "hookimpl": "HookimplMarker"}


def __getattr__(name: str) -> Any:
    """``hookspec`` and ``hookimpl``, the pluggy markers, made on first use."""
    if name in _MARKERS:
        import pluggy

        marker = getattr(pluggy, _MARKERS[name])(PROJECT_NAME)
        globals()[name] = marker
        return marker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ENTRY_POINT_GROUP", "PROJECT_NAME", "__version__", "hookimpl", "hookspec"]
