"""The ``opguard`` command line: the group, the shared options, the one exit-code map.

``main`` is the console script; ``create_cli`` builds the group around a plugin manager.
"""

from opguard_core.cli.app import create_cli, main

__all__ = ["create_cli", "main"]
