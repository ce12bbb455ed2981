"""OpGuard core: hook specifications, plugin manager, runner, formats and CLI.

Plugins import the markers from here::

    from opguard_core import hookimpl

    @hookimpl
    def opguard_filter(config):
        ...
"""

from importlib.metadata import PackageNotFoundError, version

import pluggy

PROJECT_NAME = "opguard"
ENTRY_POINT_GROUP = "opguard"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

try:
    __version__ = version("opguard")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = ["ENTRY_POINT_GROUP", "PROJECT_NAME", "__version__", "hookimpl", "hookspec"]
