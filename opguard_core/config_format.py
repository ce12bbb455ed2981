"""Instrumentation configs (formats.md §3): YAML loading, validation and dumping.

Configs are read and written with ruamel.yaml's round-trip mode, which builds only
plain mappings, sequences and scalars (never arbitrary Python objects, so it is
safe) and keeps the comments and key order a person added.

Dumping has a fast path (:func:`_dump_fast`): a config of the shape generate and
merge produce, without comments, anchors or tags, is written by plain string
building, byte-identical to ruamel's output. Quoting is decided per distinct string
with ruamel's own emitter analysis and resolver. Anything else, or any string the
fast path does not handle (line breaks, characters that need escapes), is dumped
by ruamel (:func:`_dump_with_ruamel`).
"""

from __future__ import annotations

import io
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.anchor import Anchor
from ruamel.yaml.comments import (
    CommentedMap,
    CommentedSeq,
    comment_attrib,
    format_attrib,
    merge_attrib,
)
from ruamel.yaml.error import YAMLError
from ruamel.yaml.nodes import ScalarNode
from ruamel.yaml.tag import Tag

from opguard_core.errors import InputError

CONFIG_VERSION = 1
EntryKey = tuple[str, tuple[str, ...]]


def _yaml() -> YAML:
    yaml = YAML(typ="rt", pure=True)
    yaml.width = 2**30  # never wrap: flow maps of ops can be longer than any fixed width
    yaml.indent(mapping=2, sequence=4, offset=2)
    yaml.default_flow_style = False
    return yaml


def flow_seq(items: Iterable[Any]) -> CommentedSeq:
    seq = CommentedSeq(items)
    seq.fa.set_flow_style()
    return seq


def flow_map(items: Iterable[tuple[Any, Any]]) -> CommentedMap:
    mapping = CommentedMap(items)
    mapping.fa.set_flow_style()
    return mapping


def entry_key(entry: dict[str, Any]) -> EntryKey:
    """The matching key of an entry: (target, context)."""
    return (str(entry["target"]), tuple(str(c) for c in entry.get("context") or ()))


def dump_config(config: CommentedMap) -> str:
    """Serialise a config to YAML text (deterministic for the same mapping).

    Uses the fast writer when it can, else ruamel.yaml; both give the same bytes.
    """
    text = _dump_fast(config)
    return _dump_with_ruamel(config) if text is None else text


def _dump_with_ruamel(config: CommentedMap) -> str:
    """The reference dump: ruamel.yaml's round-trip dumper."""
    stream = io.StringIO()
    _yaml().dump(config, stream)
    return stream.getvalue()


# ------------------------------------------------------------------ fast writer

_STR_TAG = "tag:yaml.org,2002:str"
#: ruamel writes a mapping key shorter than 128 characters (with its 5-character
#: tag) as a simple key, longer ones as ``? key``; the fast writer stays well below.
_MAX_KEY = 100
#: the writer's caches of quoted strings are emptied when they grow past this
_CACHE_LIMIT = 200_000


class _Unusual(Exception):
    """Something the fast writer does not handle: the caller dumps with ruamel."""


def _check_plain(obj: CommentedMap | CommentedSeq) -> bool | None:
    """Raise :class:`_Unusual` if ``obj`` carries comments, an anchor, a tag or merge
    keys; else return its flow style (True flow, False block, None unset)."""
    comment = getattr(obj, comment_attrib, None)
    if comment is not None and (
        comment.comment or comment.items or comment.end or getattr(comment, "_pre", None)
    ):
        raise _Unusual
    anchor = getattr(obj, Anchor.attrib, None)
    if anchor is not None and anchor.value is not None:
        raise _Unusual
    tag = getattr(obj, Tag.attrib, None)
    if tag is not None and tag.trval:
        raise _Unusual
    if getattr(obj, merge_attrib, None):
        raise _Unusual
    fmt = getattr(obj, format_attrib, None)
    return None if fmt is None else fmt.flow_style()


def _is_flow(obj: CommentedMap | CommentedSeq) -> bool:
    """Whether ruamel writes ``obj`` in flow style: when it is marked so, or when it is
    empty and unmarked (copies of empty flow collections lose the mark)."""
    style = _check_plain(obj)
    return style is True or (style is None and not obj)


class _FastWriter:
    """Writes configs of a fixed shape as ruamel's round-trip dumper would (see
    :func:`_dump_fast`). Holds the ruamel emitter and resolver whose analysis decides
    each string's quoting, and caches the decision per distinct string."""

    def __init__(self) -> None:
        yaml = _yaml()
        self.emitter: Any = yaml.emitter
        self.resolver: Any = yaml.resolver
        if not self.emitter.allow_unicode or self.emitter.canonical:
            raise _Unusual
        self.block: dict[str, str] = {}
        self.flow: dict[str, str] = {}

    # scalars

    def quote(self, value: str, flow: bool) -> str:
        """``value`` as ruamel writes a str in block (or flow) context: plain when it
        reads back as the same string, else single-quoted, else double-quoted
        (``Emitter.choose_scalar_style``)."""
        if not value:
            return "''"
        analysis = self.emitter.analyze_scalar(value)
        if analysis.multiline:
            raise _Unusual
        resolve = self.resolver.resolve
        if resolve(ScalarNode, value, (False, True)) != _STR_TAG:
            raise _Unusual
        if resolve(ScalarNode, value, (True, False)) == _STR_TAG and (
            analysis.allow_flow_plain if flow else analysis.allow_block_plain
        ):
            return value
        if analysis.allow_double_quoted and "'" in value:
            return self.double_quoted(value)
        if analysis.allow_single_quoted:
            return "'" + value.replace("'", "''") + "'"
        return self.double_quoted(value)

    @staticmethod
    def double_quoted(value: str) -> str:
        """``Emitter.write_double_quoted`` for text that needs no escapes but ``"`` and
        ``\\`` (with ``allow_unicode``); anything else is unusual."""
        for ch in value:
            if ch in "\x85\u2028\u2029\ufeff" or not (
                " " <= ch <= "~"
                or "\xa0" <= ch <= "\ud7ff"
                or "\ue000" <= ch <= "\ufffd"
                or ch >= "\U00010000"
            ):
                raise _Unusual
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'

    def string(self, value: str, flow: bool) -> str:
        cache = self.flow if flow else self.block
        text = cache.get(value)
        if text is None:
            if len(cache) >= _CACHE_LIMIT:
                cache.clear()
            text = cache[value] = self.quote(value, flow)
        return text

    def scalar(self, value: object, flow: bool) -> str:
        kind = type(value)
        if kind is str:
            return self.string(value, flow)  # type: ignore[arg-type]
        if kind is int:
            return int.__repr__(value)
        if kind is bool:
            return "true" if value else "false"
        raise _Unusual

    def key(self, value: object, flow: bool) -> str:
        kind = type(value)
        if kind is str:
            if len(value) >= _MAX_KEY:  # type: ignore[arg-type]
                raise _Unusual
            return self.string(value, flow)  # type: ignore[arg-type]
        if kind is int:
            text = int.__repr__(value)
            if len(text) >= _MAX_KEY:
                raise _Unusual
            return text
        raise _Unusual

    # collections

    def flow_seq(self, seq: object, seen: set[int]) -> str:
        """A flow sequence of scalars: ``[a, b]``."""
        if type(seq) is not CommentedSeq or not _is_flow(seq) or id(seq) in seen:
            raise _Unusual
        seen.add(id(seq))
        scalar = self.scalar
        return "[" + ", ".join([scalar(item, True) for item in seq]) + "]"

    def flow_map(self, mapping: CommentedMap, seen: set[int]) -> str:
        """A flow mapping of scalar keys to scalars or flow sequences of scalars."""
        if not _is_flow(mapping) or id(mapping) in seen:
            raise _Unusual
        seen.add(id(mapping))
        parts = []
        key, scalar = self.key, self.scalar
        for name, value in mapping.items():
            kind = type(value)
            if kind is int:
                text = int.__repr__(value)
            elif kind is CommentedSeq:
                text = self.flow_seq(value, seen)
            else:
                text = scalar(value, True)
            parts.append(f"{key(name, True)}: {text}")
        return "{" + ", ".join(parts) + "}"

    def block_value(self, value: object, seen: set[int]) -> str:
        """What follows ``key:`` in a block mapping for a scalar, None or flow collection."""
        kind = type(value)
        if value is None:
            return ""
        if kind is CommentedMap:
            return " " + self.flow_map(value, seen)  # type: ignore[arg-type]
        if kind is CommentedSeq:
            return " " + self.flow_seq(value, seen)
        return " " + self.scalar(value, False)

    def document(self, config: CommentedMap) -> str:
        """The whole document; raises :class:`_Unusual` for anything off its shape."""
        seen: set[int] = {id(config)}
        if type(config) is not CommentedMap or not config or _check_plain(config) is True:
            raise _Unusual
        out: list[str] = []
        key, block_value = self.key, self.block_value
        for name, value in config.items():
            head = key(name, False)
            if type(value) is list or (
                type(value) is CommentedSeq and _check_plain(value) is not True
            ):
                if id(value) in seen:
                    raise _Unusual
                seen.add(id(value))
                if not value:
                    out.append(f"{head}: []\n")
                    continue
                out.append(f"{head}:\n")
                for item in value:
                    if (
                        type(item) is not CommentedMap
                        or not item
                        or _check_plain(item) is True
                        or id(item) in seen
                    ):
                        raise _Unusual
                    seen.add(id(item))
                    lead = "  - "
                    for field, field_value in item.items():
                        out.append(f"{lead}{key(field, False)}:{block_value(field_value, seen)}\n")
                        lead = "    "
            else:
                out.append(f"{head}:{block_value(value, seen)}\n")
        return "".join(out)


_writer: _FastWriter | None = None


def _dump_fast(config: CommentedMap) -> str | None:
    """The config text written directly, or None when ruamel must write it.

    Handles a block mapping of scalars (None too), flow collections and block
    sequences of block mappings, whose values are scalars, None or flow collections;
    flow sequences hold scalars, flow mappings scalar keys and scalars or flow
    sequences. No comments, anchors, tags, merge keys or shared collections; strings
    without line breaks or characters that need escapes; keys below 100 characters.
    """
    global _writer
    try:
        if _writer is None:
            _writer = _FastWriter()
        return _writer.document(config)
    except _Unusual:
        return None


def parse_config(text: str, path: Path | str) -> CommentedMap:
    """Parse and validate config text; raise :class:`InputError` naming the problem."""
    try:
        config = _yaml().load(text)
    except YAMLError as exc:
        problem = str(exc).splitlines()
        raise InputError(path, f"malformed YAML: {' '.join(problem)}") from None
    validate_config(config, path)
    return config  # type: ignore[no-any-return]


def load_config(path: Path) -> CommentedMap:
    """Read, parse and validate an instrumentation config file."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(path, "no such file") from None
    except UnicodeDecodeError:
        raise InputError(path, "not UTF-8 text") from None
    except OSError as exc:
        raise InputError(path, f"cannot read file: {exc.strerror or exc}") from None
    return parse_config(text, path)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate_config(config: object, path: Path | str) -> None:
    """Check the shape of a config document (types of every field §3 names)."""
    if not isinstance(config, dict):
        raise InputError(path, "expected a YAML mapping at top level")
    if config.get("version") != CONFIG_VERSION:
        raise InputError(
            path, f"unknown config version {config.get('version')!r} (expected {CONFIG_VERSION})"
        )
    meta = config.get("meta", {})
    if meta is None:
        meta = {}
    if not isinstance(meta, dict):
        raise InputError(path, "'meta' must be a mapping")
    ranks = meta.get("ranks", [])
    if not isinstance(ranks, list) or not all(_is_int(r) for r in ranks):
        raise InputError(path, "meta.ranks must be a list of integers")
    if not _is_int(meta.get("total", 0)):
        raise InputError(path, "meta.total must be an integer")
    entries = config.get("entries")
    if not isinstance(entries, list):
        raise InputError(path, "'entries' must be a list")
    for index, entry in enumerate(entries):
        where = f"entries[{index}]"
        if not isinstance(entry, dict):
            raise InputError(path, f"{where} must be a mapping")
        if not isinstance(entry.get("target"), str):
            raise InputError(path, f"{where}.target must be a string")
        for field in ("context", "tags"):
            value = entry.get(field, [])
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise InputError(path, f"{where}.{field} must be a list of strings")
        for field in ("lines", "ranks"):
            value = entry.get(field, [])
            if not isinstance(value, list) or not all(_is_int(v) for v in value):
                raise InputError(path, f"{where}.{field} must be a list of integers")
        ops = entry.get("ops", {})
        if not isinstance(ops, dict) or not all(
            isinstance(k, str) and _is_int(v) and v >= 0 for k, v in ops.items()
        ):
            raise InputError(path, f"{where}.ops must map op names to counts")
        streams = entry.get("stream_counts", {})
        if not isinstance(streams, dict) or not all(
            _is_int(k) and _is_int(v) and v >= 0 for k, v in streams.items()
        ):
            raise InputError(path, f"{where}.stream_counts must map stream ids to counts")
        if not _is_int(entry.get("count", 0)):
            raise InputError(path, f"{where}.count must be an integer")
        if "kind" in entry and not isinstance(entry["kind"], str):
            raise InputError(path, f"{where}.kind must be a string")
        if entry.get("file") is not None and not isinstance(entry["file"], str):
            raise InputError(path, f"{where}.file must be a string or null")
