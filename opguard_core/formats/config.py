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

import copy
import io
import os
import re
import stat
from pathlib import Path
from typing import Any, Protocol

from ruamel.yaml import YAML
from ruamel.yaml.anchor import Anchor
from ruamel.yaml.comments import (
    CommentedMap,
    CommentedSeq,
    comment_attrib,
    format_attrib,
    merge_attrib,
)
from ruamel.yaml.composer import Composer
from ruamel.yaml.constructor import DuplicateKeyError
from ruamel.yaml.emitter import Emitter
from ruamel.yaml.error import YAMLError
from ruamel.yaml.events import AliasEvent
from ruamel.yaml.nodes import MappingNode, ScalarNode, SequenceNode
from ruamel.yaml.representer import RoundTripRepresenter
from ruamel.yaml.scalarint import ScalarInt
from ruamel.yaml.tag import Tag

from opguard_core.errors import InputError, InvariantError
from opguard_core.formats.config_collectives import (
    CONFIG_COLLECTIVES_VERSION,
    read_config_collectives,
)
from opguard_core.formats.config_reader import Found, NoStrictReader, read_fast, read_strict
from opguard_core.formats.divergence import DIVERGENCE_FORMAT
from opguard_core.formats.dtypes import is_dtype
from opguard_core.formats.kinds import DOCUMENT_KINDS
from opguard_core.formats.op_ranks import read_ranges
from opguard_core.formats.streams import is_role, legacy_side_roles, legacy_stream_counts
from opguard_core.formats.styles import block_map, elements_of, items_of, put_new
from opguard_core.formats.trace import GZIP_MAGIC, PHASES, TRACE_FORMAT
from opguard_core.formats.tree import TREE_FORMAT
from opguard_core.formats.values import is_count

#: the layout written: version 6 may carry an entry's ``op_ranks`` and ``meta.op_ranks``
#: (formats.md, "Which ranks ran an op"); version 5 may carry an entry's
#: ``dtype_counts`` (formats.md, "Dtypes"); version 4 may carry ``collectives`` (the
#: good run's collective sequences: :mod:`opguard_core.formats.config_collectives`); since version 3
#: ``stream_counts`` are keyed by stream role (formats.md, "Streams and roles");
#: version 2 (raw stream ids) and version 1 (also flow maps of ops, no summary
#: comments) are still read, and upgraded (:func:`upgrade_config`)
CONFIG_VERSION = 6
READ_VERSIONS = (1, 2, 3, 4, 5, 6)
#: the first version whose ``stream_counts`` are by role
ROLE_VERSION = 3
#: the first version whose entries may carry ``dtype_counts``
DTYPE_VERSION = 5
#: the first version whose entries may carry ``op_ranks`` (and ``meta.op_ranks``)
OP_RANKS_VERSION = 6
EntryKey = tuple[str, tuple[str, ...]]


_STR_TAG = "tag:yaml.org,2002:str"
#: strings ruamel's emitter would write plain (or with a raw line break) in a form
#: its own parser refuses or reads differently: both writers quote them
_LEADS_NEEDING_QUOTES = ("?", ":")
#: a letter, then letters, digits and ``_ . + / : -``, not ending in ``:`` (a ``:`` is an
#: indicator only before a space or the end): no indicator, space or break, so ruamel
#: writes it plain in block and flow context unless it resolves to another type
#: (``true``, ``null``: :meth:`_FastWriter._plain_str`). Names such as a merged config's
#: ``source`` (``job0+job1+…``) and targets (``mod:fn``, ``aten::add``) skip the
#: emitter's per-character analysis.
_SAFE_PLAIN = re.compile(r"[A-Za-z][A-Za-z0-9_.+/:-]*(?<!:)")
_BREAKS_NEEDING_ESCAPES = ("\x85", "\u2028", "\u2029")


def _forced_style(value: str) -> str | None:
    """The quoting both writers force on ``value`` (None: the emitter's own choice)."""
    if any(ch in value for ch in _BREAKS_NEEDING_ESCAPES):
        return '"'
    if value.startswith(_LEADS_NEEDING_QUOTES):
        return "'"
    return None


class _Representer(RoundTripRepresenter):
    """ruamel's round-trip representer, quoting the strings of :func:`_forced_style`."""

    def represent_str(self, data: str) -> Any:
        style = _forced_style(data)
        if style is None:
            return super().represent_str(data)
        return self.represent_scalar(_STR_TAG, data, style=style)


_Representer.add_representer(str, _Representer.represent_str)


# ------------------------------------------------------------ hostile input limits

#: the largest config file read, in bytes (docs/configs.md, "Limits"): the round-trip
#: loader reads ~160 kB/s and holds ~100 bytes per byte of YAML, so this bounds a
#: read at about a minute and 1 GB. ``OPGUARD_MAX_CONFIG_BYTES`` raises it.
MAX_CONFIG_BYTES = 8 * 2**20
MAX_CONFIG_BYTES_ENV = "OPGUARD_MAX_CONFIG_BYTES"
#: the deepest nesting of mappings and sequences read (a config needs 5)
MAX_DEPTH = 32
#: how many nodes all aliases of a document may stand for together: an alias costs
#: the size of what it names, so "billion laughs" documents stop here
MAX_ALIAS_NODES = 100_000
#: the longest integer read, in digits (counts need 20; Python refuses 4300)
MAX_INT_DIGITS = 100
_INT_TAG = "tag:yaml.org,2002:int"


class ConfigLimitError(Exception):
    """A config breaks one of the limits above; :func:`parse_config` names the file."""

    def __init__(self, problem: str, mark: Any = None) -> None:
        line = getattr(mark, "line", None)
        super().__init__(problem + (f" (line {line + 1})" if isinstance(line, int) else ""))


def _node_size(node: Any, sizes: dict[int, int]) -> int:
    """How many nodes ``node`` stands for once every alias in it is expanded."""
    known = sizes.get(id(node))
    if known is not None:
        return known
    size = 1
    if isinstance(node, SequenceNode):
        size += sum(_node_size(item, sizes) for item in node.value)
    elif isinstance(node, MappingNode):
        size += sum(_node_size(k, sizes) + _node_size(v, sizes) for k, v in node.value)
    sizes[id(node)] = size
    return size


class BoundedComposer(Composer):
    """ruamel's composer with the limits of hostile input: nesting depth
    (:data:`MAX_DEPTH`, before Python's recursion limit), the nodes aliases expand to
    (:data:`MAX_ALIAS_NODES`) and the digits of an integer (:data:`MAX_INT_DIGITS`)."""

    def __init__(self, loader: Any = None) -> None:
        super().__init__(loader)
        self._nesting = 0
        self._expanded = 0
        self._sizes: dict[int, int] = {}

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.parser.check_event(AliasEvent):
            event = self.parser.peek_event()
            target = self.anchors.get(event.anchor)
            if target is not None:
                self._expanded += _node_size(target, self._sizes)
                if self._expanded > MAX_ALIAS_NODES:
                    raise ConfigLimitError(
                        f"YAML aliases expand to more than {MAX_ALIAS_NODES} nodes",
                        event.start_mark,
                    )
            return super().compose_node(parent, index)
        self._nesting += 1
        if self._nesting > MAX_DEPTH:
            mark = self.parser.peek_event().start_mark
            raise ConfigLimitError(f"nested deeper than {MAX_DEPTH} levels", mark)
        try:
            return super().compose_node(parent, index)
        finally:
            self._nesting -= 1

    def compose_scalar_node(self, anchor: Any) -> Any:
        node = super().compose_scalar_node(anchor)
        if str(node.tag) == _INT_TAG and len(node.value) > MAX_INT_DIGITS:
            raise ConfigLimitError(
                f"an integer of {len(node.value)} characters (at most {MAX_INT_DIGITS})",
                node.start_mark,
            )
        return node


class _PortableEmitter(Emitter):
    r"""ruamel's emitter, but a string holding ``?`` is never plain in flow context:
    YAML 1.2 (ruamel) reads ``[a?b]`` as ``a?b``, PyYAML (YAML 1.1, the most common
    Python reader) stops the scalar at ``?`` and fails on every config whose
    ``meta.settings.hide`` holds the default ``…Module\._(wrapped_)?call_impl``.
    Quoted, both read it alike; the fast writer asks this emitter too."""

    def analyze_scalar(self, scalar: Any) -> Any:
        analysis = super().analyze_scalar(scalar)
        if "?" in scalar:
            analysis.allow_flow_plain = False
        return analysis


def _yaml() -> YAML:
    yaml = YAML(typ="rt", pure=True)
    yaml.Emitter = _PortableEmitter
    yaml.Composer = BoundedComposer
    yaml.Representer = _Representer
    yaml.width = 2**30  # never wrap: flow maps of ops can be longer than any fixed width
    yaml.indent(mapping=2, sequence=4, offset=2)
    yaml.default_flow_style = False
    return yaml


def _copy_attributes(source: CommentedMap | CommentedSeq, target: Any) -> None:
    """The YAML attributes of ``source`` that a dump reads (comments, flow style,
    anchor, tag, merge keys) onto ``target``; not line and column, which only say
    where ``source`` was read from. An empty comment is made anew, not copied."""
    comment = getattr(source, comment_attrib, None)
    if comment is not None and (
        comment.comment or comment.items or comment.end or getattr(comment, "_pre", None)
    ):
        setattr(target, comment_attrib, copy.deepcopy(comment))
    fmt = getattr(source, format_attrib, None)
    if fmt is not None:
        setattr(target, format_attrib, copy.copy(fmt))
    for attrib in (Anchor.attrib, Tag.attrib, merge_attrib):
        if hasattr(source, attrib):
            setattr(target, attrib, copy.deepcopy(getattr(source, attrib)))


def copy_config(value: Any) -> Any:
    """A deep copy of a loaded or built config (or any part of it), linear in its size.

    ``copy.deepcopy`` of a ruamel sequence copies the sequence's YAML attributes
    (line and column of every item) once per item: quadratic in a config read from a
    file (2 x 4000 entries: minutes). This copies each container's attributes once."""
    kind = type(value)
    if kind is CommentedMap:
        mapping = CommentedMap()
        for key, item in items_of(value):
            put_new(mapping, key, copy_config(item))
        _copy_attributes(value, mapping)
        return mapping
    if kind is CommentedSeq:
        seq = CommentedSeq([copy_config(item) for item in elements_of(value)])
        _copy_attributes(value, seq)
        return seq
    if kind is dict:
        return {key: copy_config(item) for key, item in value.items()}
    if kind is list:
        return [copy_config(item) for item in value]
    if kind in (str, int, float, bool) or value is None:
        return value
    return copy.deepcopy(value)


def entry_key(entry: dict[str, Any]) -> EntryKey:
    """The matching key of an entry: (target, context)."""
    return (str(entry["target"]), tuple(str(c) for c in entry.get("context") or ()))


def dump_config(config: CommentedMap) -> str:
    """Serialise a config to YAML text (deterministic for the same mapping).

    Uses the fast writer when it can, else ruamel.yaml; both give the same bytes.
    Each entry is preceded by its summary line (:func:`summary_comment`), derived
    from the data at write time and dropped again on load.
    """
    text = _dump_fast(config)
    if text is None:
        text = _dump_with_ruamel(config)
    return annotate_entries(text, config)


# ------------------------------------------------------------ summary comments

#: the summary line written before each entry; loading drops lines of exactly this form
SUMMARY_RE = re.compile(r"  # [0-9]+ ops(, [0-9]+\.[0-9]% of total)?\n")
_ENTRY_START = "  - "


def summary_comment(entry: dict[str, Any], total: int) -> str:
    """``  # 768 ops, 0.8% of total``: the entry's inclusive op dispatches and their
    share of ``meta.total`` (the share is left out when the total is 0)."""
    count = int(entry.get("count", 0))
    share = f", {100 * count / total:.1f}% of total" if total > 0 else ""
    return f"  # {count} ops{share}\n"


def _entry_starts(lines: list[str]) -> list[int]:
    """Indexes of the lines that open an item of the top-level ``entries`` sequence.

    In the block layout an item starts with exactly two spaces and a dash; values
    inside it are indented by four or more, and top-level keys by none."""
    starts: list[int] = []
    inside = False
    for index, line in enumerate(lines):
        if line and line[0] not in " #\n":
            inside = line == "entries:\n"
        elif inside and line.startswith(_ENTRY_START):
            starts.append(index)
    return starts


def annotate_entries(text: str, config: dict[str, Any]) -> str:
    """``text`` with a summary line before each entry (None when the entries and the
    text disagree, which would be a writer bug: then the text is returned as is)."""
    entries = config.get("entries")
    if not isinstance(entries, list) or not entries:
        return text
    lines = text.splitlines(keepends=True)
    starts = _entry_starts(lines)
    if len(starts) != len(entries):
        return text
    total = int((config.get("meta") or {}).get("total", 0) or 0)
    out: list[str] = []  # one pass (inserting into ``lines`` would be quadratic)
    previous = 0
    for index, entry in zip(starts, entries, strict=True):
        out.extend(lines[previous:index])
        out.append(summary_comment(entry, total))
        previous = index
    out.extend(lines[previous:])
    return "".join(out)


def _is_block_line(line: str) -> bool:
    """A blank line, or a whole-line comment indented by at most two spaces: the lines
    that may stand between two entries and belong to the entry below them."""
    stripped = line.lstrip(" ")
    return not stripped.strip() or (stripped.startswith("#") and len(line) - len(stripped) <= 2)


def split_entry_comments(text: str) -> tuple[str, list[list[str]]]:
    """Cut the comment block above each entry out of ``text``.

    Returns the text without those blocks and, per entry in order, the comment lines
    a person wrote there (``# …``, stripped). Blank lines and summary lines
    (:data:`SUMMARY_RE`, the writer's own) are dropped. Comments indented deeper than
    an entry's dash stay where they are: they belong to the lines around them.
    """
    lines = text.splitlines(keepends=True)
    kept: list[str] = []  # the lines between the blocks, a slice at a time
    after = 0  # the first line after the last block cut
    blocks: list[list[str]] = []
    for start in _entry_starts(lines):
        first = start
        while first > 0 and _is_block_line(lines[first - 1]):
            first -= 1
        # blocks never overlap: the line before an entry's block is not a block line
        kept.extend(lines[after:first])
        after = start
        blocks.append(
            [
                lines[i].strip()
                for i in range(first, start)
                if lines[i].strip() and not SUMMARY_RE.fullmatch(lines[i])
            ]
        )
    if len(kept) + len(lines) - after == len(lines):
        return text, blocks
    kept.extend(lines[after:])
    return "".join(kept), blocks


def entry_comments(entry: object) -> list[str]:
    """The comment lines a person wrote above ``entry`` (``# …``), as loaded."""
    comment = getattr(entry, comment_attrib, None)
    if comment is None or not comment.comment or len(comment.comment) < 2:
        return []
    return [token.value.strip() for token in comment.comment[1] or () if token.value.strip()]


def set_entry_comments(entry: CommentedMap, lines: list[str]) -> None:
    """Write ``lines`` (``# …``) as the comment block above ``entry``."""
    if lines:
        entry.yaml_set_start_comment("\n".join(lines), indent=2)
    elif entry_comments(entry):
        entry.ca.comment[1] = []


def _dump_with_ruamel(config: CommentedMap) -> str:
    """The reference dump: ruamel.yaml's round-trip dumper."""
    stream = io.StringIO()
    _yaml().dump(config, stream)
    return stream.getvalue()


# ------------------------------------------------------------------ fast writer

#: ruamel writes a mapping key shorter than 128 characters (with its 5-character
#: tag) as a simple key, longer ones as ``? key``; the fast writer stays well below.
_MAX_KEY = 100
#: the writer's caches of quoted strings are emptied when they grow past this
_CACHE_LIMIT = 200_000


class _Unusual(Exception):
    """Something the fast writer does not handle: the caller dumps with ruamel."""


def is_tagged(value: object) -> bool:
    """Whether a loaded YAML value carries an explicit tag (``!foo [a]``): inert data
    to the round-trip loader, refused wherever a field has a type."""
    tag = getattr(value, Tag.attrib, None)
    return tag is not None and bool(tag.trval)


def _is_names(value: object) -> bool:
    """A list of strings, untagged (``context``, ``tags``, ``meta.recorded_by``)."""
    return (
        isinstance(value, list)
        and not is_tagged(value)
        and all(isinstance(v, str) for v in elements_of(value))
    )


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
    if is_tagged(obj):
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
        self.representer: Any = yaml.representer
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
        if _SAFE_PLAIN.fullmatch(value) and self._plain_str(value):
            return value  # what the analysis below decides, without its per-character loop
        analysis = self.emitter.analyze_scalar(value)
        if analysis.multiline:
            raise _Unusual
        resolve = self.resolver.resolve
        if resolve(ScalarNode, value, (False, True)) != _STR_TAG:
            raise _Unusual
        if _forced_style(value) is not None:  # only "'" here: breaks are multiline
            return (
                "'" + value.replace("'", "''") + "'"
                if analysis.allow_single_quoted
                else self.double_quoted(value)
            )
        if resolve(ScalarNode, value, (True, False)) == _STR_TAG and (
            analysis.allow_flow_plain if flow else analysis.allow_block_plain
        ):
            return value
        if analysis.allow_double_quoted and "'" in value:
            return self.double_quoted(value)
        if analysis.allow_single_quoted:
            return "'" + value.replace("'", "''") + "'"
        return self.double_quoted(value)

    def _plain_str(self, value: str) -> bool:
        resolve = self.resolver.resolve
        return bool(
            resolve(ScalarNode, value, (False, True)) == _STR_TAG
            and resolve(ScalarNode, value, (True, False)) == _STR_TAG
        )

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
        if kind is ScalarInt:  # a loaded ``0`` or ``007``: ruamel writes its width back
            anchor = getattr(value, Anchor.attrib, None)
            if getattr(value, "_underscore", None) is not None or (
                anchor is not None and anchor.value is not None
            ):
                raise _Unusual
            width = getattr(value, "_width", None)
            return format(value, "d") if width is None else f"{value:0{width}d}"
        if kind is float:  # settings such as min_fraction: ruamel's own representation
            node = self.representer.represent_float(value)
            if node.style or node.tag != "tag:yaml.org,2002:float":
                raise _Unusual
            return str(node.value)
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

    def flow_seq(self, seq: object, seen: set[int], nested: bool = True) -> str:
        """A flow sequence of scalars, or of scalars and flow sequences of scalars
        (``op_ranks``' ranges, ``[[0, 3], 7]``): ``[a, b]``."""
        if type(seq) is not CommentedSeq or not _is_flow(seq) or id(seq) in seen:
            raise _Unusual
        seen.add(id(seq))
        scalar = self.scalar
        return (
            "["
            + ", ".join(
                [
                    self.flow_seq(item, seen, False)
                    if nested and type(item) is CommentedSeq
                    else scalar(item, True)
                    for item in elements_of(seq)
                ]
            )
            + "]"
        )

    def flow_map(self, mapping: CommentedMap, seen: set[int]) -> str:
        """A flow mapping of scalar keys to scalars or flow sequences of scalars."""
        if not _is_flow(mapping) or id(mapping) in seen:
            raise _Unusual
        seen.add(id(mapping))
        parts = []
        key, scalar = self.key, self.scalar
        for name, value in items_of(mapping):
            kind = type(value)
            if kind is int:
                text = int.__repr__(value)
            elif kind is CommentedSeq:
                text = self.flow_seq(value, seen)
            else:
                text = scalar(value, True)
            parts.append(f"{key(name, True)}: {text}")
        return "{" + ", ".join(parts) + "}"

    def block_field(self, head: str, value: object, indent: int, seen: set[int]) -> str:
        """``head:`` and what follows it in a block mapping whose keys sit at ``indent``:
        a scalar, None, a flow collection, or a non-empty block mapping written on the
        following lines (``meta``, ``ops`` and ``stream_counts`` in v2)."""
        kind = type(value)
        if value is None:
            return f"{head}:\n"
        if kind is CommentedMap:
            if not value:
                _check_plain(value)  # type: ignore[arg-type]
                return f"{head}: {{}}\n"
            if _is_flow(value):  # type: ignore[arg-type]
                return f"{head}: {self.flow_map(value, seen)}\n"  # type: ignore[arg-type]
            return f"{head}:\n" + self.block_map(value, indent + 2, seen)  # type: ignore[arg-type]
        if kind is CommentedSeq:
            return f"{head}: {self.flow_seq(value, seen)}\n"
        return f"{head}: {self.scalar(value, False)}\n"

    def block_map(self, mapping: CommentedMap, indent: int, seen: set[int]) -> str:
        """A non-empty block mapping whose keys sit at ``indent``."""
        if id(mapping) in seen:
            raise _Unusual
        seen.add(id(mapping))
        pad = " " * indent
        key, field = self.key, self.block_field
        return "".join([field(pad + key(k, False), v, indent, seen) for k, v in items_of(mapping)])

    def document(self, config: CommentedMap) -> str:
        """The whole document; raises :class:`_Unusual` for anything off its shape."""
        seen: set[int] = {id(config)}
        if type(config) is not CommentedMap or not config or _check_plain(config) is True:
            raise _Unusual
        out: list[str] = []
        key, field = self.key, self.block_field
        for name, value in items_of(config):
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
                for item in elements_of(value):
                    if (
                        type(item) is not CommentedMap
                        or not item
                        or _check_plain(item) is True
                        or id(item) in seen
                    ):
                        raise _Unusual
                    seen.add(id(item))
                    lead = "  - "
                    for item_key, item_value in items_of(item):
                        out.append(field(lead + key(item_key, False), item_value, 4, seen))
                        lead = "    "
            else:
                out.append(field(head, value, 0, seen))
        return "".join(out)


_writer: _FastWriter | None = None


def _dump_fast(config: CommentedMap) -> str | None:
    """The config text written directly, or None when ruamel must write it.

    Handles a block mapping of scalars (None too), flow collections, block mappings
    (nested the same way) and block sequences of block mappings, whose values are
    scalars, None, flow collections or block mappings; flow sequences hold scalars,
    flow mappings scalar keys and scalars or flow sequences. No comments, anchors,
    tags, merge keys or shared collections; strings
    without line breaks or characters that need escapes; keys below 100 characters.
    """
    global _writer
    try:
        if _writer is None:
            _writer = _FastWriter()
        return _writer.document(config)
    except _Unusual:
        return None


def _load_fast(text: str) -> CommentedMap | None:
    """``text`` read by the fast reader (:mod:`opguard_core.formats.config_reader`)
    when the fast writer writes the result back to exactly ``text``; else None (then
    ruamel reads it: anything unusual, comments inside entries, aliases, duplicate
    keys, other styles).

    With the C reader the write-back is checked as it reads
    (:func:`~opguard_core.formats.config_reader.read_strict`: the layout the writer
    writes, nothing else) and here for each distinct string and float, against the
    writer's own spelling of it; without it, the whole config is written back and
    compared (the reference: both accept the same texts as the same configs)."""
    try:
        found = read_strict(text)
    except NoStrictReader:
        config = read_fast(text)
        if config is None or _dump_fast(config) != text:
            return None
        return config
    return None if found is None else _spelled_as_written(found)


def _spelled_as_written(found: Found) -> CommentedMap | None:
    """The config of ``found`` when each string and float in it was read from the
    spelling the fast writer gives it in its context; else None."""
    global _writer
    config, block, flow, floats = found
    try:
        if _writer is None:
            _writer = _FastWriter()
        string = _writer.string
        for strings, in_flow in ((block, False), (flow, True)):
            for value, token in strings.items():
                if string(value, in_flow) != token:
                    return None
        for number, token, in_flow in floats:
            if _writer.scalar(number, in_flow) != token:
                return None
    except _Unusual:
        return None
    return config


def parse_config(text: str, path: Path | str) -> CommentedMap:
    """Parse and validate config text; raise :class:`InputError` naming the problem."""
    limit = max_config_bytes()
    if len(text) > limit:  # characters: never more than the bytes
        raise InputError(path, _too_large(len(text.encode("utf-8", "surrogatepass")), limit))
    stripped, blocks = split_entry_comments(text)
    config: Any = _load_fast(stripped)
    if config is None:
        try:
            config = _yaml().load(stripped)
        except ConfigLimitError as exc:
            raise InputError(path, str(exc)) from None
        except DuplicateKeyError as exc:
            line = getattr(exc.problem_mark, "line", None)
            found = str(exc.problem or "").split(" with value")[0].removeprefix("found ")
            where = f" (line {line + 1})" if isinstance(line, int) else ""
            raise InputError(path, f"malformed YAML: {found or 'duplicate key'}{where}") from None
        except YAMLError as exc:
            problem = str(exc).splitlines()
            raise InputError(path, f"malformed YAML: {' '.join(problem)}") from None
        except RecursionError:  # the limits above keep the composer far from it
            raise InputError(path, f"nested deeper than {MAX_DEPTH} levels") from None
        except ValueError as exc:  # a value the constructor refuses (int digits, dates, ...)
            raise InputError(path, f"unreadable value: {exc}") from None
        except MemoryError:
            raise InputError(path, "out of memory reading this config") from None
    if "\\u" in text or "\\U" in text:  # only an escape can make a surrogate
        _join_surrogates(config, path)
    validate_config(config, path)
    entries = config["entries"]
    if len(blocks) == len(entries):
        for entry, block in zip(entries, blocks, strict=True):
            if block and isinstance(entry, CommentedMap):
                set_entry_comments(entry, block)
    upgrade_config(config)
    return config  # type: ignore[no-any-return]


_SURROGATE = re.compile("[\ud800-\udfff]")


def _joined(text: str, path: Path | str) -> str:
    """``text`` with each surrogate pair (``"\\ud83d\\ude00"``, how JSON writes a
    character past U+FFFF) made the one character it stands for; a lone surrogate is
    refused: not text, so no output (a terminal, UTF-8 files, JSON) could carry it."""
    if not _SURROGATE.search(text):
        return text
    try:
        joined = text.encode("utf-16", "surrogatepass").decode("utf-16")
    except UnicodeDecodeError:
        joined = text
    if _SURROGATE.search(joined):
        raise InputError(path, f"{text!a} holds a lone surrogate, which is not text")
    return joined


def _join_surrogates(value: Any, path: Path | str) -> Any:
    """``value`` with :func:`_joined` applied to every string, keys included (mappings
    and lists changed in place, their order kept)."""
    if isinstance(value, str):
        return _joined(value, path)
    if isinstance(value, dict):
        for position, key in enumerate(list(value)):
            item = value[key]
            new_item = _join_surrogates(item, path)
            new_key = _joined(key, path) if isinstance(key, str) else key
            if new_key is not key and hasattr(value, "insert"):
                del value[key]
                value.insert(position, new_key, new_item)
            elif new_item is not item:
                value[key] = new_item
    elif isinstance(value, list):
        for index, item in enumerate(value):
            new_item = _join_surrogates(item, path)
            if new_item is not item:
                value[index] = new_item
    return value


def upgrade_config(config: CommentedMap) -> None:
    """Bring a loaded config of an older version to the current one in place.

    Version 1: ``meta``, ``ops`` and ``stream_counts`` become block mappings
    (comments stay where they were; v1 simply had no run settings in ``meta``).
    Versions 1 and 2: ``stream_counts`` by raw stream id become counts by role
    (:func:`~opguard_core.formats.streams.legacy_stream_counts`: 0 is ``compute``,
    the other ids ``side1``, … ascending over the whole config, and the entry's
    collective ops ``comm``)."""
    version = config["version"]
    if version == 1:
        for mapping in [config.get("meta")] + [
            entry.get(field) for entry in config["entries"] for field in ("ops", "stream_counts")
        ]:
            if isinstance(mapping, CommentedMap):
                mapping.fa.set_block_style()
    if version < ROLE_VERSION:
        entries = config["entries"]
        sides = legacy_side_roles(s for e in entries for s in (e.get("stream_counts") or {}))
        for entry in entries:
            if "stream_counts" in entry:
                counts = legacy_stream_counts(
                    entry.get("stream_counts") or {}, entry.get("ops") or {}, sides
                )
                entry["stream_counts"] = block_map(counts.items())
    config["version"] = CONFIG_VERSION


def max_config_bytes() -> int:
    """:data:`MAX_CONFIG_BYTES`, or ``$OPGUARD_MAX_CONFIG_BYTES`` when it is a
    positive integer."""
    value = os.environ.get(MAX_CONFIG_BYTES_ENV, "").strip()
    if value.isdigit() and len(value) < 19 and int(value) > 0:
        return int(value)
    return MAX_CONFIG_BYTES


def _too_large(size: int, limit: int) -> str:
    return (
        f"config too large: {size} bytes (more than {limit}; set {MAX_CONFIG_BYTES_ENV} to read it)"
    )


#: what to give instead of another document than a config, by its ``format``
_INSTEAD = {
    TRACE_FORMAT: "`opguard run --input` makes a config from it, `opguard check --input` "
    "holds it to one",
    TREE_FORMAT: "the config made from it is the *_instrumentation.yaml beside it (or give "
    "the run directory)",
    DIVERGENCE_FORMAT: "give the run directory, or its *_instrumentation.yaml",
}
#: the first key of a JSON object and, where it is a string, its value
_FIRST_KEY = re.compile(
    rb'\A(?:\xef\xbb\xbf)?\s*\{\s*"([A-Za-z_]{1,40})"\s*:\s*(?:"([^"\\]{0,80})")?'
)
#: first keys of documents that other tools write (torch.profiler's Kineto traces),
#: or that a run writes beside its configs (pipeline_summary.json)
_OTHER_FIRST_KEYS = {
    "opguard_version": "a run's pipeline summary, not an instrumentation config: give its "
    "run directory",
    **dict.fromkeys(
        ("schemaVersion", "traceEvents", "deviceProperties", "distributedInfo"),
        "a torch.profiler (Kineto) trace, not an instrumentation config: "
        "`opguard run --input` makes a config from it",
    ),
}


def not_a_config(head: bytes) -> str | None:
    """What a file whose first bytes are ``head`` is, when it is plainly another
    document than a config (a trace, a tree, a report, a gzip file): the one-line
    problem :func:`load_config` names, before a size limit or a YAML error would
    mislead. None for anything else, a config written as JSON included."""
    if head.startswith(GZIP_MAGIC):
        return (
            "a gzip file, not an instrumentation config (YAML text): a trace? "
            "`opguard run --input` reads traces"
        )
    match = _FIRST_KEY.match(head)
    if match is None:
        return None
    key, value = match.group(1).decode(), match.group(2)
    if key == "format":
        name = (value or b"").decode("utf-8", "replace")
        kind = DOCUMENT_KINDS.get(name, f"a JSON document of format {name!r}")
        instead = _INSTEAD.get(name)
        return f"{kind}, not an instrumentation config" + (f": {instead}" if instead else "")
    return _OTHER_FIRST_KEYS.get(key)


def load_config(path: Path) -> CommentedMap:
    """Read, parse and validate an instrumentation config file (one larger than
    :func:`max_config_bytes` is refused before it is read; a trace, a tree or a
    report is named as such: :func:`not_a_config`)."""
    limit = max_config_bytes()
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):  # a FIFO or a device would block
            kind = "Is a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file"
            raise InputError(path, f"cannot read file: {kind}")
        with path.open("rb") as file:
            problem = not_a_config(file.read(512))
        if problem is not None:
            raise InputError(path, problem)
        if info.st_size > limit:
            raise InputError(path, _too_large(info.st_size, limit))
        data = path.read_bytes()
        if len(data) > limit:  # it grew since
            raise InputError(path, _too_large(len(data), limit))
        # universal newlines, as ``read_text`` reads
        text = data.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
    except InputError:
        raise
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
    if not _is_int(config.get("version")) or config.get("version") not in READ_VERSIONS:
        known = " or ".join(str(v) for v in READ_VERSIONS)
        version = config.get("version")
        newer = isinstance(version, int) and version > READ_VERSIONS[-1]
        raise InputError(
            path,
            f"unknown config version {version!r} (expected {known}"
            + ("; written by a newer OpGuard?)" if newer else ")"),
        )
    if "source" in config and not isinstance(config["source"], str):
        raise InputError(path, "'source' must be a string (the sources' names joined by +)")
    meta = config.get("meta", {})
    if meta is None:
        meta = {}
    if not isinstance(meta, dict) or is_tagged(meta):
        raise InputError(path, "'meta' must be a mapping")
    all_ranks = meta.get("ranks", [])
    if not isinstance(all_ranks, list) or not all(is_count(r) for r in all_ranks):
        raise InputError(path, "meta.ranks must be a list of integers (0 or more)")
    total = meta.get("total", 0)
    if not is_count(total):
        raise InputError(path, "meta.total must be an integer (0 or more)")
    steps = meta.get("steps", {})
    if not isinstance(steps, dict) or not all(
        isinstance(k, str) and _is_int(v) and v >= 0 for k, v in steps.items()
    ):
        raise InputError(path, "meta.steps must map sources to step counts")
    phases = meta.get("phases", {})
    if not isinstance(phases, dict) or not all(
        isinstance(k, str) and v in PHASES for k, v in phases.items()
    ):
        raise InputError(path, "meta.phases must map sources to setup or loop")
    source_ranks = meta.get("source_ranks", {})
    if not isinstance(source_ranks, dict) or not all(
        isinstance(k, str) and isinstance(v, list) and all(is_count(r) for r in v)
        for k, v in source_ranks.items()
    ):
        raise InputError(path, "meta.source_ranks must map sources to lists of ranks")
    if not _is_names(meta.get("recorded_by", [])):
        raise InputError(path, "meta.recorded_by must be a list of names")
    if "op_ranks" in meta:
        if config["version"] < OP_RANKS_VERSION:
            needs = f"needs config version {OP_RANKS_VERSION} or later"
            raise InputError(path, f"meta.op_ranks {needs}")
        if type(meta["op_ranks"]) is not bool:
            raise InputError(path, "meta.op_ranks must be true or false")
    if not _is_names(meta.get("sources", [])):
        raise InputError(path, "meta.sources must be a list of names")
    validate_settings(meta.get("settings"), path)
    entries = config.get("entries")
    if not isinstance(entries, list):
        raise InputError(path, "'entries' must be a list")
    seen: dict[EntryKey, int] = {}
    for index, entry in enumerate(entries):
        where = f"entries[{index}]"
        if not isinstance(entry, dict):
            raise InputError(path, f"{where} must be a mapping")
        if not isinstance(entry.get("target"), str):
            raise InputError(path, f"{where}.target must be a string")
        for field in ("context", "tags"):
            if not _is_names(entry.get(field, [])):
                raise InputError(path, f"{where}.{field} must be a list of strings")
        key = entry_key(entry)
        first = seen.setdefault(key, index)
        if first != index:
            raise InputError(
                path,
                f"{where} repeats entries[{first}] (target {key[0]!r}, same context):"
                " each (target, context) may appear once",
            )
        lines = entry.get("lines", [])
        if not isinstance(lines, list) or not all(_is_int(v) for v in elements_of(lines)):
            raise InputError(path, f"{where}.lines must be a list of integers")
        ranks = entry.get("ranks", [])
        if not isinstance(ranks, list) or not all(is_count(v) for v in elements_of(ranks)):
            raise InputError(path, f"{where}.ranks must be a list of integers (0 or more)")
        ops = entry.get("ops", {})
        if not isinstance(ops, dict) or not all(
            isinstance(k, str) and _is_int(v) and v >= 0 for k, v in items_of(ops)
        ):
            raise InputError(path, f"{where}.ops must map op names to counts")
        streams = entry.get("stream_counts", {})
        by_role = config["version"] >= ROLE_VERSION
        if not isinstance(streams, dict) or not all(
            (is_role(k) if by_role else _is_int(k)) and _is_int(v) and v >= 0
            for k, v in items_of(streams)
        ):
            raise InputError(
                path,
                f"{where}.stream_counts must map "
                + ("stream roles (compute, comm, side1, …)" if by_role else "stream ids")
                + " to counts",
            )
        if "dtype_counts" in entry:
            dtypes = entry["dtype_counts"]
            if config["version"] < DTYPE_VERSION:
                raise InputError(
                    path, f"{where}.dtype_counts needs config version {DTYPE_VERSION} or later"
                )
            if not isinstance(dtypes, dict) or not all(
                is_dtype(k) and is_count(v) for k, v in items_of(dtypes)
            ):
                raise InputError(
                    path, f"{where}.dtype_counts must map dtype names (float32, int64, …) to counts"
                )
        if "op_ranks" in entry:
            _check_op_ranks(
                entry["op_ranks"],
                ops,
                [int(r) for r in elements_of(entry.get("ranks") or all_ranks)],
                config["version"],
                f"{where}.op_ranks",
                path,
            )
        if not is_count(entry.get("count", 0)):
            raise InputError(path, f"{where}.count must be an integer (0 or more)")
        if total and entry.get("count", 0) > total:  # counts are inclusive: at most all ops
            raise InputError(
                path, f"{where}.count {entry['count']} is more than meta.total {total}"
            )
        by_source = entry.get("sources", {})
        if not isinstance(by_source, dict) or not all(
            isinstance(k, str) and is_count(v) for k, v in by_source.items()
        ):
            raise InputError(path, f"{where}.sources must map sources to counts")
        if "kind" in entry and not isinstance(entry["kind"], str):
            raise InputError(path, f"{where}.kind must be a string")
        if entry.get("file") is not None and not isinstance(entry["file"], str):
            raise InputError(path, f"{where}.file must be a string or null")
    if "collectives" in config:
        if config["version"] < CONFIG_COLLECTIVES_VERSION:
            raise InputError(
                path, f"collectives needs config version {CONFIG_COLLECTIVES_VERSION} or later"
            )
        read_config_collectives(config["collectives"], path)


def _check_op_ranks(
    op_ranks: object,
    ops: dict[str, Any],
    entry_ranks: list[int],
    version: int,
    where: str,
    path: Path | str,
) -> None:
    """An entry's ``op_ranks``: some of its ops, each with some of the entry's ranks
    (``entry_ranks``) that ran it, as ranges (formats.md, "Which ranks ran an op"); a
    range past the entry's last rank is refused before it is spelled out."""
    if version < OP_RANKS_VERSION:
        raise InputError(path, f"{where} needs config version {OP_RANKS_VERSION} or later")
    if not isinstance(op_ranks, dict):
        raise InputError(path, f"{where} must map ops to the ranks that ran them")
    mine = set(entry_ranks)
    last = max(mine, default=-1)
    for op, ranges in items_of(op_ranks):
        if op not in ops:
            raise InputError(path, f"{where} names {op!r}, which is not one of the entry's ops")
        try:
            ranks = read_ranges(ranges, f"{where}[{op!r}]", last)
        except InvariantError as exc:
            raise InputError(path, str(exc)) from None
        if not ranks:
            raise InputError(path, f"{where}[{op!r}] lists no rank")
        if not mine.issuperset(ranks):
            raise InputError(path, f"{where}[{op!r}] lists a rank that is not one of the entry's")


# ------------------------------------------------------------------ meta.settings

#: the largest integer a setting may hold (a C ``int64``): larger ones overflow the
#: floats and slices they are used in
_MAX_SETTING_INT = 2**63 - 1


class _Check(Protocol):
    def __call__(self, value: object, /) -> bool: ...


def _is_setting_bool(value: object) -> bool:
    """``true``/``false``, also an anchored one (ruamel's ``ScalarBoolean``, an int)."""
    from ruamel.yaml.scalarbool import ScalarBoolean

    return isinstance(value, bool | ScalarBoolean)


def _is_setting_int(value: object) -> bool:
    if not isinstance(value, int) or _is_setting_bool(value):
        return False
    return 0 <= value <= _MAX_SETTING_INT


def _is_fraction(value: object) -> bool:
    """A finite number in [0, 1] (the comparisons are false for nan)."""
    if not (_is_setting_int(value) or isinstance(value, float)):
        return False
    return 0.0 <= value <= 1.0  # type: ignore[operator]


def _is_ratio(value: object) -> bool:
    """A finite number, 0 or more (the comparisons are false for nan)."""
    if not (_is_setting_int(value) or isinstance(value, float)):
        return False
    return 0.0 <= value < float("inf")  # type: ignore[operator]


def _is_strings(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _is_string(value: object) -> bool:
    return isinstance(value, str)


def _is_mapping(value: object) -> bool:
    return isinstance(value, dict)


def _is_optional_string(value: object) -> bool:
    return value is None or isinstance(value, str)


_INTEGER = (_is_setting_int, "an integer from 0 to 2**63-1")
_BOOLEAN = (_is_setting_bool, "true or false")
_PATTERNS = (_is_strings, "a list of regular expressions")
_NAMES = (_is_strings, "a list of strings")

#: every ``meta.settings`` key OpGuard reads (``opguard check`` rebuilds a run with
#: them, ``opguard guard`` uses ``min_count``, ``min_fraction`` and ``context_depth``):
#: the test a value must pass and what it must be. Other keys are ignored.
SETTINGS: dict[str, tuple[_Check, str]] = {
    "min_count": _INTEGER,
    "min_fraction": (_is_fraction, "a finite number from 0 to 1"),
    "chains": _BOOLEAN,
    "hide": _PATTERNS,
    "focus": _PATTERNS,
    "ignore": _PATTERNS,
    "filter_focus": _PATTERNS,
    "filter_ignore": _PATTERNS,
    "default_hide": _BOOLEAN,
    "context_depth": _INTEGER,
    "filters": _NAMES,
    "basic": _BOOLEAN,
    "basic_list": (_is_optional_string, "a file name or null"),
    "compressor": (_is_optional_string, "a plugin name or null"),
    "executor": (_is_string, "an executor name"),
    "jobs": _INTEGER,
    "verbose": _BOOLEAN,
    "skew": (_is_ratio, "a finite number, 0 or more"),
    "fail_on_divergence": _BOOLEAN,
    "extra": (_is_mapping, "a mapping"),
}
#: settings keys that are never read from a config (where a run was started, not how
#: its config was made)
IGNORED_SETTINGS = frozenset({"base_dir"})


def _shown(value: object) -> str:
    """A setting's value in an error: its repr, cut to 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def validate_settings(settings: object, path: Path | str) -> None:
    """Refuse a ``meta.settings`` that is not a mapping, or any key of :data:`SETTINGS`
    whose value has the wrong type or range, with one line naming the field
    (``meta.settings.context_depth must be an integer from 0 to 2**63-1, not 'deep'``);
    patterns must compile (``meta.settings.hide[2] …``)."""
    if settings is None:
        return
    if not isinstance(settings, dict):
        raise InputError(path, f"meta.settings must be a mapping, not {_shown(settings)}")
    for key, value in settings.items():
        rule = SETTINGS.get(key) if isinstance(key, str) else None
        if rule is None:
            continue
        test, expected = rule
        if not test(value):
            raise InputError(path, f"meta.settings.{key} must be {expected}, not {_shown(value)}")
        if rule is _PATTERNS:
            for index, pattern in enumerate(value):
                try:
                    re.compile(pattern)
                except (re.error, OverflowError, RecursionError, ValueError) as exc:
                    raise InputError(
                        path,
                        f"meta.settings.{key}[{index}] {_shown(pattern)}: not a regular "
                        f"expression: {exc}",
                    ) from None
