"""JSON of any nesting depth, without recursing per level.

msgspec encodes and decodes nested containers recursively in C, one recursion per
level, bounded by Python's recursion limit: a call tree a few hundred levels deep
raises ``RecursionError``, and with a raised limit a deep enough document can
overflow the C stack. Trees of deep stacks (docs/formats.md §2, "Deep trees") need
a writer and a reader whose memory, not stack, grows with depth:

* :func:`encode_indented` writes what ``msgspec.json.format(msgspec.json.encode(x),
  indent=1)`` writes (byte for byte) down to nesting level ``compact_from``; every
  container opened at that level or deeper is written compactly (msgspec's
  ``encode`` form, no whitespace), so indentation cannot grow with depth;
* :func:`decode` is ``msgspec.json.decode`` while the document is shallow (run under
  a recursion limit low enough that C recursion stays safe) and an explicit-stack
  parser otherwise. Scalars are always encoded and decoded by msgspec, so strings
  and numbers read and write exactly as msgspec's do.
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Iterator
from typing import Any

import msgspec

#: levels of C recursion msgspec may use before the explicit-stack path takes over
MSGSPEC_LEVELS = 800

_encode = msgspec.json.encode
_decode = msgspec.json.decode
_CONTAINERS = (dict, list, tuple)


class DeepJSONError(ValueError):
    """The bytes are not one JSON document; the message says where."""


def _stack_depth() -> int:
    depth = 0
    frame = sys._getframe()
    while frame is not None:
        depth += 1
        frame = frame.f_back  # type: ignore[assignment]
    return depth


@contextlib.contextmanager
def _bounded_recursion(levels: int) -> Iterator[None]:
    """Lower the recursion limit (never raise it) to ``levels`` above the current
    depth, so msgspec's C recursion raises RecursionError long before the C stack
    could overflow, even when a program raised the limit."""
    limit = sys.getrecursionlimit()
    bounded = min(limit, _stack_depth() + levels)
    sys.setrecursionlimit(bounded)
    try:
        yield
    finally:
        sys.setrecursionlimit(limit)


def nests_deeper_than(value: Any, levels: int) -> bool:
    """Whether ``value`` has a container at nesting level ``levels`` or deeper
    (the outermost container is level 0); iterative, stops at the first one."""
    if not isinstance(value, _CONTAINERS):
        return False
    todo: list[tuple[Any, int]] = [(value, 0)]
    while todo:
        container, depth = todo.pop()
        if depth >= levels:
            return True
        items = container.values() if isinstance(container, dict) else container
        todo.extend((item, depth + 1) for item in items if isinstance(item, _CONTAINERS))
    return False


def _key(key: Any) -> bytes:
    if isinstance(key, str):
        return _encode(key)
    # msgspec writes int (and other) keys as strings: take its own spelling
    return _encode({key: 0})[1:-3]


def _flat(container: Any) -> bool:
    items = container.values() if isinstance(container, dict) else container
    return not any(isinstance(item, _CONTAINERS) for item in items)


def encode_indented(value: Any, compact_from: int | None = None) -> bytes:
    """``msgspec.json.format(msgspec.json.encode(value), indent=1)``, iteratively, with
    containers at nesting level ``compact_from`` or deeper written compactly."""
    out: list[bytes] = []
    # frames: [items iterator, is a mapping, nesting level, compact, written so far]
    stack: list[list[Any]] = []

    def emit(item: Any, level: int) -> None:
        if not isinstance(item, _CONTAINERS):
            out.append(_encode(item))
            return
        if not item:
            out.append(b"{}" if isinstance(item, dict) else b"[]")
            return
        compact = compact_from is not None and level >= compact_from
        if _flat(item):  # no nested container: msgspec writes it in one call
            data = _encode(item)
            if not compact:
                data = msgspec.json.format(data, indent=1).replace(b"\n", b"\n" + b" " * level)
            out.append(data)
            return
        if isinstance(item, dict):
            out.append(b"{")
            stack.append([iter(item.items()), True, level, compact, 0])
        else:
            out.append(b"[")
            stack.append([iter(item), False, level, compact, 0])

    emit(value, 0)
    done: Any = object()
    while stack:
        frame = stack[-1]
        iterator, is_map, level, compact, written = frame
        item: Any = next(iterator, done)
        if item is done:
            stack.pop()
            close = b"}" if is_map else b"]"
            out.append(close if compact else b"\n" + b" " * level + close)
            continue
        if written:
            out.append(b"," if compact else b",\n" + b" " * (level + 1))
        elif not compact:
            out.append(b"\n" + b" " * (level + 1))
        frame[4] = written + 1
        if is_map:
            key, item = item
            out.append(_key(key) + (b":" if compact else b": "))
        emit(item, level + 1)
    return b"".join(out)


_WS = rb"[ \t\n\r]*"
_TOKEN = re.compile(
    _WS
    + rb"(?:(?P<p>[\[\]{}:,])"
    + rb'|(?P<s>"(?:[^"\\\x00-\x1f]|\\.)*")'
    + rb"|(?P<n>-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?)"
    + rb"|(?P<w>true|false|null))",
    re.DOTALL,
)
_TAIL = re.compile(_WS)
_WORDS = {b"true": True, b"false": False, b"null": None}


def decode(data: bytes) -> Any:
    """``msgspec.json.decode(data)`` for a document of any nesting depth.

    Raises ``msgspec.DecodeError`` (shallow path) or :class:`DeepJSONError` (deep
    path) for bytes that are not JSON; both subclass ``ValueError``.
    """
    try:
        with _bounded_recursion(MSGSPEC_LEVELS):
            return _decode(data)
    except RecursionError:
        return decode_iterative(data)


def decode_iterative(data: bytes) -> Any:
    """The explicit-stack parser behind :func:`decode` (strict JSON, as msgspec)."""
    try:
        return _parse(data)
    except (UnicodeDecodeError, msgspec.DecodeError) as exc:
        raise DeepJSONError(f"JSON is malformed: {exc}") from None


def _parse(data: bytes) -> Any:
    containers: list[Any] = []  # open containers, outermost first
    keys: list[Any] = []  # per open container: the key awaiting its value (maps)
    # what may come next: "value", "key" (or "}" when empty), ":", "," (or a close)
    want = "value"
    empty = False  # the innermost container was just opened
    result: Any = None
    position = 0
    size = len(data)
    match = _TOKEN.match
    while True:
        token = match(data, position)
        if token is None:
            end = _TAIL.match(data, position)
            position = end.end() if end else position
            if position >= size:
                if not containers and want == ",":
                    return result
                raise DeepJSONError("JSON is truncated")
            raise DeepJSONError(f"JSON is malformed: invalid character (byte {position})")
        position = token.end()
        kind = token.lastgroup
        text = token.group(kind or 0)
        if want == "," and not containers:
            raise DeepJSONError(f"JSON is malformed: trailing characters (byte {token.start()})")
        if kind == "p":
            if text in b"]}":
                if not containers or (want != "," and not empty):
                    raise DeepJSONError(f"JSON is malformed: unexpected {text.decode()!r}")
                closing = containers.pop()
                keys.pop()
                if isinstance(closing, dict) != (text == b"}"):
                    raise DeepJSONError(f"JSON is malformed: mismatched {text.decode()!r}")
                want, empty = ",", False
                continue
            if text == b",":
                if want != "," or not containers:
                    raise DeepJSONError("JSON is malformed: unexpected ','")
                want = "key" if isinstance(containers[-1], dict) else "value"
                empty = False
                continue
            if text == b":":
                if want != ":":
                    raise DeepJSONError("JSON is malformed: unexpected ':'")
                want = "value"
                continue
            if want != "value":
                raise DeepJSONError(f"JSON is malformed: unexpected {text.decode()!r}")
            value: Any = {} if text == b"{" else []
            _place(containers, keys, value)
            if not containers:
                result = value
            containers.append(value)
            keys.append(None)
            want, empty = ("key" if text == b"{" else "value"), True
            continue
        if kind == "s":
            string = _decode(text) if b"\\" in text else text[1:-1].decode("utf-8", "strict")
            if want == "key":
                keys[-1] = string
                want, empty = ":", False
                continue
            value = string
        elif want == "key":
            raise DeepJSONError("JSON is malformed: object keys must be strings")
        elif kind == "n":
            value = _decode(text)
        else:
            value = _WORDS[text]
        if want != "value":
            raise DeepJSONError("JSON is malformed: expected ',' or a closing bracket")
        if not containers:
            result = value
        else:
            _place(containers, keys, value)
        want, empty = ",", False


def _place(containers: list[Any], keys: list[Any], value: Any) -> None:
    if not containers:
        return
    parent = containers[-1]
    if isinstance(parent, dict):
        parent[keys[-1]] = value
    else:
        parent.append(value)
