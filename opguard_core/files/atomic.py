"""Atomic artifact writes and run-directory creation.

Every artifact is written to a temporary file in its final directory and then
renamed over the final name, so a reader (or a run killed mid-write) never sees a
half-written file.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import glob
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from opguard_core.errors import OpGuardError, WriteError

TMP_SUFFIX = ".tmp"
#: the temporary name keeps at most this many characters of the final name (<= 160 bytes
#: of UTF-8), so that a final name
#: close to the file-system limit (255 bytes) still gets a temporary file that fits
_TMP_STEM_CHARS = 40


def _umask_mode() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


#: mkstemp creates files 0600; artifacts get the mode ``open()`` would give them.
_FILE_MODE = _umask_mode()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (temp file in the same dir, fsync, rename).

    On failure the temporary file is removed; an ``OSError`` is raised as
    :class:`WriteError` (an ``OSError`` with the same ``errno``) naming ``path``."""
    atomic_write_parts(path, (data,))


def atomic_write_parts(path: Path, parts: Iterable[bytes]) -> None:
    """:func:`atomic_write_bytes` of ``b"".join(parts)``, written part by part as
    they come (a large document never has to be whole in memory, nor copied)."""
    directory = path.parent
    prefix = f".{path.name[:_TMP_STEM_CHARS]}."
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=prefix, suffix=TMP_SUFFIX, dir=directory)
    except OSError as exc:
        raise WriteError(path, exc) from exc
    try:
        os.fchmod(fd, _FILE_MODE)
        with os.fdopen(fd, "wb") as handle:
            for part in parts:
                handle.write(part)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp_name)
        if isinstance(exc, OSError) and not isinstance(exc, WriteError):
            # ENOSPC, EFBIG, EIO ...: name the file (the OS error does not)
            raise WriteError(path, exc) from exc
        raise


def remove_temporaries(path: Path) -> None:
    """Remove the temporary files :func:`atomic_write_bytes` may have left for
    ``path`` when a process writing it was killed (SIGKILL runs no cleanup)."""
    pattern = f".{glob.escape(path.name[:_TMP_STEM_CHARS])}.*{TMP_SUFFIX}"
    for leftover in path.parent.glob(pattern):
        with contextlib.suppress(OSError):
            leftover.unlink()


def atomic_write_text(path: Path, text: str) -> None:
    """Write UTF-8 ``text`` to ``path`` atomically."""
    atomic_write_bytes(path, text.encode("utf-8"))


def safe_child(directory: Path, filename: str) -> Path:
    """Return ``directory / filename``, refusing any name that would leave ``directory``
    (or a link there that leads out of it). The path is returned unresolved: an atomic
    write replaces a link in the directory, never the file the link points at (a
    ``report.html`` linked to a config would otherwise overwrite the config)."""
    if not filename or filename in {".", ".."} or "/" in filename or "\\" in filename:
        raise OpGuardError(f"refusing to write artifact with unsafe name {filename!r}")
    candidate = directory / filename
    if candidate.resolve().parent != directory.resolve():
        raise OpGuardError(f"refusing to write {filename!r} outside the run directory")
    return candidate


def create_run_directory(base: Path, now: _dt.datetime | None = None) -> Path:
    """Create a fresh ``preprocessing_{YYYYMMDD_HHMMSS}`` directory under ``base``.

    Two runs in the same second never share a directory: the later one gets a
    ``_2``, ``_3``, ... suffix (``mkdir`` is atomic, so this is race-free).
    """
    base.mkdir(parents=True, exist_ok=True)
    stamp = (now or _dt.datetime.now()).strftime("%Y%m%d_%H%M%S")
    name = f"preprocessing_{stamp}"
    attempt = 1
    while True:
        candidate = base / (name if attempt == 1 else f"{name}_{attempt}")
        try:
            candidate.mkdir()
        except FileExistsError:
            attempt += 1
            continue
        return candidate
