"""Input files of other formats, read as callsite traces through ``opguard_read_trace``.

Every command that reads traces (``opguard run``'s combine, ``check``, ``export``)
reads a file's bytes (a gzip file decompressed: :func:`opguard_core.formats.trace.read_bytes`);
an ``opguard-callsites`` document is decoded as it always was, and any other file is
offered to the installed readers (:class:`Readers`), whose document is then validated
like a trace file. A file no reader takes is refused with one line.

:class:`Readers` pickles (as the names of the disabled plugins) so that a combine's
worker processes, spawned or on a Dask cluster, read with the same plugins.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from opguard_core.errors import InputError, PluginError
from opguard_core.formats import names_a_config
from opguard_core.formats.kinds import DOCUMENT_KINDS
from opguard_core.formats.trace import TRACE_FORMAT, DecodedTrace, decode_trace, without_bom

if TYPE_CHECKING:
    from opguard_core.plugin.manager import OpGuardPluginManager

#: how far into a file its ``"format"`` is looked for (every writer puts it first)
HEAD = 4096


#: an OpGuard document's ``"format"`` (``opguard-callsites``, ``opguard-divergence``…),
#: the key every writer puts first
_OPGUARD_FORMAT = re.compile(rb'"format"\s*:\s*"(opguard-[A-Za-z0-9_-]{0,60})')


def is_opguard_document(data: bytes) -> bool:
    """Whether ``data`` names an OpGuard format (``"format": "opguard-…"``) near its
    start: what another format's reader leaves alone. Only the ``format`` key counts:
    a trace of another format may hold the text ``"opguard-`` anywhere (a frame of a
    program in ``opguard-demo/``, a label)."""
    return _OPGUARD_FORMAT.search(data, 0, HEAD) is not None


def document_format(data: bytes) -> str | None:
    """The OpGuard ``format`` ``data`` names near its start (:func:`is_opguard_document`)."""
    found = _OPGUARD_FORMAT.search(data, 0, HEAD)
    return None if found is None else found.group(1).decode("ascii")


def is_callsite_trace(data: bytes) -> bool:
    """Whether ``data`` says it is an ``opguard-callsites`` document near its start."""
    return f'"{TRACE_FORMAT}"'.encode() in data[:HEAD]


class Readers:
    """The ``opguard_read_trace`` implementations of a plugin manager."""

    def __init__(
        self, manager: OpGuardPluginManager | None = None, disabled: Sequence[str] = ()
    ) -> None:
        self._manager = manager
        self.disabled = list(manager.disabled if manager is not None else disabled)

    def __getstate__(self) -> dict[str, Any]:
        return {"disabled": self.disabled}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._manager = None
        self.disabled = list(state["disabled"])

    @property
    def manager(self) -> OpGuardPluginManager:
        if self._manager is None:  # in another process: the same plugins
            from opguard_core.plugin.manager import create_plugin_manager

            self._manager = create_plugin_manager(self.disabled)
        return self._manager

    def read(self, path: Path | str, data: bytes) -> DecodedTrace | None:
        """The file as a decoded trace, from the first reader that takes it; None if
        none does. A reader's document is validated as a trace file is."""
        from opguard_core.plugin.manager import call_impl

        for impl in self.manager.implementations("opguard_read_trace"):
            try:
                document = call_impl(impl, {"path": Path(path), "data": data})
            except (InputError, PluginError):
                raise
            except Exception as exc:
                raise PluginError(
                    f'plugin "{impl.plugin_name}": opguard_read_trace({path}): '
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            if document is not None:
                return _reader_trace(impl.plugin_name, path, document)
        return None

    def declined(self, error: InputError, data: bytes) -> InputError:
        """``error`` (the file refused as an OpGuard trace) saying also that no reader
        took it, and which readers there are and are disabled, for a file that is not
        an OpGuard document (``--disable-plugin kineto`` then a Kineto file)."""
        if is_opguard_document(data):
            named = document_format(data)
            if named != TRACE_FORMAT and named in DOCUMENT_KINDS:
                return InputError(error.path, f"{DOCUMENT_KINDS[named]}, not a callsite trace")
            return error
        if error.path is not None and names_a_config(Path(error.path).name):
            return InputError(
                error.path,
                "a YAML config, not a callsite trace: `opguard check --config` takes a "
                "config; compare, merge, filter and show read configs",
            )
        impls = self.manager.implementations("opguard_read_trace")
        names = sorted(impl.plugin_name for impl in impls)
        disabled = f"; disabled: {', '.join(sorted(self.disabled))}" if self.disabled else ""
        return InputError(
            error.path,
            f"{error.problem}; and no reader plugin took it (readers: {', '.join(names) or 'none'}"
            f"{disabled})",
        )


def _reader_trace(plugin: str, path: Path | str, document: Any) -> DecodedTrace:
    """A reader's document decoded and validated as a trace file is; a problem names the
    plugin (the file may be fine: the reader made the document)."""
    try:
        return decode_trace(msgspec.json.encode(document), path, check_frame_ids=False)
    except InputError as exc:
        raise InputError(
            path, f'plugin "{plugin}" read it as an invalid trace: {exc.problem}'
        ) from None
    except (TypeError, OverflowError) as exc:  # not JSON: a set, an object, a huge int
        raise PluginError(
            f'plugin "{plugin}": opguard_read_trace({path}) returned what is not JSON: {exc}'
        ) from None


__all__ = ["Readers", "is_callsite_trace", "without_bom"]
