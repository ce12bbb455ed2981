"""A fast reader for configs of the shape the fast writer writes (formats.md §3).

ruamel.yaml's pure-Python round-trip loader reads about 0.5 MB/s: two 4000-entry
configs take 15 s to load, against about 1 s to merge them. This reader handles only
the fixed layout :func:`opguard_core.formats.config._dump_fast` writes (block
mappings, one block sequence of block mappings, flow sequences and flow mappings of
scalars, plain and quoted scalars without escapes), builds the same ruamel types with
the same flow and block styles (an item of ``entries`` unmarked, as generate builds
it: both writers write it in block style), and raises :class:`Unusual` for anything
else. The caller (:func:`opguard_core.formats.config.parse_config`) accepts its result
only when the fast writer writes it back to exactly the text read, and otherwise loads
with ruamel: a text that round-trips through the writer is one ruamel reads to the
same document (the writer quotes every string that would read back as anything else),
so the fast path never changes what a config means, only how long reading it takes.
What ruamel's loader refuses by its limits (``config.MAX_DEPTH``,
``config.MAX_INT_DIGITS``) is left to it here too.

:func:`py_read_fast` is the reference; ``_config_reader.c`` is its C twin
(:func:`read_fast`, about 5x sooner), and :func:`read_strict` the C reader that also
checks the write-back as it reads (docs/performance.md, "Scale of the small things").
"""

from __future__ import annotations

import re
from typing import Any

from ruamel.yaml.comments import CommentedMap, CommentedSeq, Format

from opguard_core.formats.styles import put_new
from opguard_core.native import load_native

#: a plain integer as the writer writes one (no sign, no leading zeros, no "_")
_INT = re.compile(r"-?(?:0|[1-9][0-9]*)")
#: a plain token that may be a float (the writer's round trip decides)
_FLOAT = re.compile(r"-?(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?|-?[0-9]+[eE][-+]?[0-9]+")


#: the deepest collection read, the top mapping being level 1: ruamel's loader
#: (``config.MAX_DEPTH``, 32) refuses a node nested deeper than 32 levels, so a
#: collection deeper than 31 (whose items would be deeper than 32) is left to it
MAX_LEVEL = 31
#: the longest integer read, in characters: ruamel's loader (``config.MAX_INT_DIGITS``)
#: refuses longer ones, so they are left to it
MAX_INT_CHARS = 100


class Unusual(Exception):
    """Not of the fast writer's shape: load with ruamel."""


def _plain(token: str) -> Any:
    if not token:
        raise Unusual
    if token in ("true", "false"):
        return token == "true"
    if _INT.fullmatch(token):
        if len(token) > MAX_INT_CHARS:
            raise Unusual
        return int(token)
    if _FLOAT.fullmatch(token):
        return float(token)
    return token


def _single_quoted(text: str, at: int) -> tuple[str, int]:
    """The single-quoted scalar starting at ``text[at]`` and the index after it."""
    out = []
    i = at + 1
    while True:
        end = text.find("'", i)
        if end < 0:
            raise Unusual
        out.append(text[i:end])
        if text.startswith("''", end):
            out.append("'")
            i = end + 2
            continue
        return "".join(out), end + 1


def _double_quoted(text: str, at: int) -> tuple[str, int]:
    end = text.find('"', at + 1)
    if end < 0 or "\\" in text[at + 1 : end]:
        raise Unusual
    return text[at + 1 : end], end + 1


def _quoted(text: str, at: int) -> tuple[str, int]:
    return _single_quoted(text, at) if text[at] == "'" else _double_quoted(text, at)


def _block_scalar(text: str) -> Any:
    if text[0] in "'\"":
        value, end = _quoted(text, 0)
        if end != len(text):
            raise Unusual
        return value
    if text[0] in "[{&*!|>%@`#":
        raise Unusual
    return _plain(text)


def _level(level: int) -> int:
    """``level`` for a new collection, unless it is too deep (:data:`MAX_LEVEL`)."""
    if level > MAX_LEVEL:
        raise Unusual
    return level


class _Flow:
    """A flow collection on one line: ``[a, 'b', 3]``, ``{k: v, k2: [1, 2]}``, at
    ``level`` (its items one deeper)."""

    def __init__(self, text: str, level: int) -> None:
        self.text = text
        self.at = 0
        self.level = level

    def item(self, closers: str) -> Any:
        text, at = self.text, self.at
        if at >= len(text):
            raise Unusual
        if text[at] in "'\"":
            value, self.at = _quoted(text, at)
            return value
        if text[at] == "[":
            self.level += 1
            seq = self.seq()
            self.level -= 1
            return seq
        if text[at] in "{&*!|>%@`#":
            raise Unusual
        end = at
        while end < len(text) and text[end] not in closers:
            end += 1
        self.at = end
        return _plain(text[at:end])

    def _next(self, closer: str) -> bool:
        """After an item: True at ``closer`` (consumed), False after ``", "``."""
        text, at = self.text, self.at
        if text.startswith(closer, at):
            self.at = at + 1
            return True
        if text.startswith(", ", at):
            self.at = at + 2
            return False
        raise Unusual

    def seq(self) -> CommentedSeq:
        _level(self.level)
        self.at += 1  # [
        seq = CommentedSeq()
        seq.fa.set_flow_style()
        if self.text.startswith("]", self.at):
            self.at += 1
            return seq
        items = []
        while True:
            items.append(self.item(",]"))
            if self._next("]"):
                list.extend(seq, items)  # CommentedSeq.append runs in Python, per item
                return seq

    def map(self) -> CommentedMap:
        _level(self.level)
        self.at += 1  # {
        mapping = CommentedMap()
        mapping.fa.set_flow_style()
        if self.text.startswith("}", self.at):
            self.at += 1
            return mapping
        while True:
            text, at = self.text, self.at
            if at < len(text) and text[at] in "'\"":
                key, at = _quoted(text, at)
            else:
                end = text.find(": ", at)
                if end < 0:
                    raise Unusual
                key, at = _plain(text[at:end]), end
            if not text.startswith(": ", at):
                raise Unusual
            self.at = at + 2
            put_new(mapping, key, self.item(",}"))
            if self._next("}"):
                return mapping


def _value(rest: str, level: int) -> Any:
    """A value written on its key's line, at ``level``."""
    if rest[0] in "[{":
        flow = _Flow(rest, level)
        value = flow.seq() if rest[0] == "[" else flow.map()
        if flow.at != len(rest):
            raise Unusual
        return value
    return _block_scalar(rest)


class _Reader:
    def __init__(self, text: str) -> None:
        if not text.endswith("\n"):
            raise Unusual
        self.lines = text[:-1].split("\n")
        self.at = 0

    def _key(self, line: str, indent: int) -> tuple[Any, str]:
        """The key of a ``key: value`` line at ``indent`` and the text after ``: ``."""
        if line[indent] in "'\"":
            key, end = _quoted(line, indent)
        else:
            end = line.find(": ", indent)
            if end < 0:
                if not line.endswith(":"):
                    raise Unusual
                end = len(line) - 1
            key = _plain(line[indent:end])
        if line.startswith(": ", end):
            return key, line[end + 2 :]
        if end == len(line) - 1 and line[end] == ":":
            return key, ""
        raise Unusual

    def _indent_of(self, index: int) -> int:
        line = self.lines[index]
        return len(line) - len(line.lstrip(" "))

    def block_map(self, indent: int, level: int, first: str | None = None) -> CommentedMap:
        _level(level)
        mapping = CommentedMap()
        if first is None:  # an item of ``entries`` stays unmarked, as generate builds
            mapping.fa.set_block_style()  # it: both writers write it in block style
        pad = " " * indent
        while self.at < len(self.lines):
            line = first if first is not None else self.lines[self.at]
            first = None
            if not line.startswith(pad) or len(line) <= indent or line[indent] in " -#":
                break
            key, rest = self._key(line, indent)
            if key in mapping:
                raise Unusual  # a duplicate key: ruamel decides
            self.at += 1
            put_new(mapping, key, self._after_key(rest, indent, level + 1))
        if not mapping:
            raise Unusual
        return mapping

    def _after_key(self, rest: str, indent: int, level: int) -> Any:
        """The value after a key at ``indent``; the value is at ``level``."""
        if rest:
            return _value(rest, level)
        if self.at >= len(self.lines):
            return None
        below = self._indent_of(self.at)
        line = self.lines[self.at]
        if indent == 0 and line.startswith("  - "):
            return self.block_seq(level)
        if below > indent:
            if below != indent + 2:
                raise Unusual
            return self.block_map(indent + 2, level)
        return None

    def block_seq(self, level: int) -> CommentedSeq:
        """The top-level sequence of block mappings (``entries``), items at ``  - ``."""
        _level(level)
        seq = CommentedSeq()
        seq.fa.set_block_style()
        items = []
        while self.at < len(self.lines) and self.lines[self.at].startswith("  - "):
            items.append(self.block_map(4, level + 1, "    " + self.lines[self.at][4:]))
        list.extend(seq, items)
        return seq

    def document(self) -> CommentedMap:
        config = self.block_map(0, 1)
        if self.at != len(self.lines):
            raise Unusual
        return config


def py_read_fast(text: str) -> CommentedMap | None:
    """``text`` read as a config of the fast writer's shape, or None (see the module
    docstring: the caller still checks the result writes back to ``text``). The
    reference for :func:`read_fast`'s C twin."""
    try:
        return _Reader(text).document()
    except (Unusual, IndexError, ValueError, RecursionError):
        return None


_native = load_native("opguard_core.formats._config_reader")
if _native is not None:
    from opguard_core.formats._config_reader import read_fast as _c_read_fast
    from opguard_core.formats._config_reader import read_strict as _c_read_strict

#: what :func:`read_strict` finds: the config, each string read mapped to its token
#: (as written, quotes included) in block and in flow context, and each float read
#: with its token and whether it sits in a flow collection
Found = tuple[CommentedMap, dict[str, str], dict[str, str], list[tuple[float, str, bool]]]


class NoStrictReader(Exception):
    """:func:`read_strict` cannot read this text (the C extension is not loaded, or
    the text holds lone surrogates): read it with :func:`py_read_fast` and check it."""


def read_fast(text: str) -> CommentedMap | None:
    """:func:`py_read_fast`, in C where ``opguard_core.formats._config_reader`` was built
    (and ``OPGUARD_PURE_PYTHON`` is not set): the same result, about 5x sooner."""
    if _native is not None:
        try:
            return _c_read_fast(text, CommentedMap, CommentedSeq, Format, MAX_LEVEL, MAX_INT_CHARS)
        except UnicodeEncodeError:  # lone surrogates: not UTF-8, so the C cannot see it
            pass
    return py_read_fast(text)


def read_strict(text: str) -> Found | None:
    """:func:`read_fast` that also refuses (None) whatever the fast writer would write
    back otherwise, except each string's and float's spelling, which it returns for
    the caller to check against the writer (:func:`opguard_core.formats.config._load_fast`):

    - keys that are not strings or integers (``true``, ``1.5``), strings of 100
      characters or more and integers of 100 digits or more as keys;
    - ``-0`` (the writer writes ``0``);
    - a flow sequence inside a flow sequence inside a flow sequence (one inside one,
      ``[[0, 3], 7]``, is ``op_ranks``' ranges); a key twice in one flow mapping;
    - one string written two ways in the same context (one of them is not the writer's).

    The rest of the layout the reader already accepts only as the writer writes it
    (one space after ``:`` and ``,``, two per indent, ``  - `` items, ``key:`` for
    null, ``[]`` and ``{}`` for empty collections), so a text read here whose tokens
    are the writer's is one the writer writes back byte for byte.

    :raises NoStrictReader: the C reader is not loaded or cannot read ``text``.
    """
    if _native is None:
        raise NoStrictReader
    try:
        return _c_read_strict(text, CommentedMap, CommentedSeq, Format, MAX_LEVEL, MAX_INT_CHARS)
    except UnicodeEncodeError:
        raise NoStrictReader from None
