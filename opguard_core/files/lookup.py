"""What a path names, asked without raising: ``Path.is_dir`` and ``Path.is_file``
raise ``OSError`` for a name the system cannot look up (longer than ``NAME_MAX``,
``ENAMETOOLONG``), where a command must say one line about the input instead of
showing a traceback. Such a path is then read as a file, and reading it names the
problem (``cannot be read: File name too long``)."""

from __future__ import annotations

from pathlib import Path


def is_directory(path: Path) -> bool:
    """Whether ``path`` is a directory; False where that cannot be told."""
    try:
        return path.is_dir()
    except (OSError, ValueError):
        return False


def is_special_file(path: Path) -> bool:
    """Whether ``path`` exists but is no regular file (a FIFO, device or socket, or a
    directory), which reading would block on or fail; False where that cannot be
    told."""
    try:
        return path.exists() and not path.is_file()
    except (OSError, ValueError):
        return False


def is_regular_file(path: Path) -> bool:
    """Whether ``path`` is a file; False where that cannot be told."""
    try:
        return path.is_file()
    except (OSError, ValueError):
        return False


__all__ = ["is_directory", "is_regular_file", "is_special_file"]
