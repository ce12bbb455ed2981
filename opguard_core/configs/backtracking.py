"""Refuse regular expressions that can backtrack catastrophically (docs/configs.md,
"Patterns").

Python's ``re`` is a backtracking engine: ``(a+)+$`` against thirty ``a`` and a ``!``
tries 2**30 ways before it fails, and a ``hide`` pattern a config carries is matched
against every frame of every trace ``opguard check`` reads. Rather than a second
engine (re2 refuses backreferences and lookarounds, which recorded patterns may use)
or a timeout (which ``re`` does not have), a pattern is refused up front when a
repetition can split the same text between its iterations in more than one way, the
cause of exponential matching:

* a repeated part that can match the empty string (``(a*)*``, ``(a?)+``);
* a repetition nested in a repetition, unless a character the inner one cannot match
  must follow it in the outer one (``(a+)+`` is refused, ``(\\w+\\.)*`` is not: each
  ``.`` ends an inner run);
* alternatives in a repetition that can start with the same character (``(a|ab)*``,
  ``(\\w|_)+``; ``(foo|bar)*`` is fine).

A possessive repetition (``(?:a+)*+``) never gives back what it matched and is
allowed. The check is conservative: where it cannot tell two parts apart it refuses,
and the message says how to rewrite (possessive, or a separator). It looks at
exponential blow-up only; a chain of independent quantifiers (``\\w*\\w*\\w*x``) is
polynomial in the length of a name and is allowed.
"""

from __future__ import annotations

import re._constants as _c  # the parser's opcodes (Python >= 3.11)
import re._parser as _parser
from collections.abc import Callable, Sequence
from typing import Any

#: a repetition that may run this many times or more counts as a loop
_LOOP = 10
_REPEATS = (_c.MAX_REPEAT, _c.MIN_REPEAT)
CharTest = Callable[[int], bool]
#: code points a character test is sampled on (ASCII and Latin-1; others by literal)
_SAMPLE = range(256)

_CATEGORIES: dict[Any, CharTest] = {
    _c.CATEGORY_DIGIT: lambda c: chr(c).isdigit(),
    _c.CATEGORY_NOT_DIGIT: lambda c: not chr(c).isdigit(),
    _c.CATEGORY_SPACE: lambda c: chr(c).isspace(),
    _c.CATEGORY_NOT_SPACE: lambda c: not chr(c).isspace(),
    _c.CATEGORY_WORD: lambda c: chr(c).isalnum() or c == 95,
    _c.CATEGORY_NOT_WORD: lambda c: not (chr(c).isalnum() or c == 95),
}


class Backtracking(Exception):
    """The reason a pattern could backtrack catastrophically."""


def check_backtracking(pattern: str) -> None:
    """Raise :class:`Backtracking` (its message the reason) when ``pattern`` (which
    ``re`` compiles) could take exponential time to fail."""
    _walk(_parser.parse(pattern))


def _walk(items: Any) -> None:
    for op, av in items:
        if op in _REPEATS:
            _low, high, body = av
            if high >= _LOOP:
                _check_loop(body)
            _walk(body)
        elif op is _c.POSSESSIVE_REPEAT:
            _walk(av[2])
        elif op is _c.SUBPATTERN:
            _walk(av[-1])
        elif op is _c.ATOMIC_GROUP:
            _walk(av)
        elif op is _c.BRANCH:
            for branch in av[1]:
                _walk(branch)
        elif op in (_c.ASSERT, _c.ASSERT_NOT):
            _walk(av[1])
        elif op is _c.GROUPREF_EXISTS:
            _walk(av[1])
            if av[2] is not None:
                _walk(av[2])


def _check_loop(body: Any) -> None:
    """``body`` is repeated without bound: refuse what could split a text two ways."""
    if body.getwidth()[0] == 0:
        raise Backtracking("a repeated part can match the empty string")
    items = _flatten(body)
    for index, (op, av) in enumerate(items):
        if op in _REPEATS and av[1] > 1:
            inner = _last_char(av[2])
            after = _char_test([items[(index + 1) % len(items)]]) if len(items) > 1 else None
            if inner is None or after is None or _overlap(inner, after):
                raise Backtracking("a repetition inside a repetition")
        elif op is _c.BRANCH:
            firsts = [_first_char(branch) for branch in av[1]]
            for i, one in enumerate(firsts):
                for other in firsts[i + 1 :]:
                    if one is None or other is None or _overlap(one, other):
                        raise Backtracking("repeated alternatives that can start alike")
        elif _has_loop(op, av):
            raise Backtracking("a repetition inside a repetition")


def _flatten(items: Any) -> list[tuple[Any, Any]]:
    """The sequence ``items``, with plain groups opened (``(a+)`` is ``a+`` here)."""
    out: list[tuple[Any, Any]] = []
    for op, av in items:
        if op is _c.SUBPATTERN:
            out.extend(_flatten(av[-1]))
        else:
            out.append((op, av))
    return out


def _has_loop(op: Any, av: Any) -> bool:
    """Whether the item holds a repetition that may run more than once."""
    if op in _REPEATS:
        return bool(av[1] > 1)
    if op is _c.POSSESSIVE_REPEAT:
        return False
    children: list[Any] = []
    if op is _c.SUBPATTERN:
        children = [av[-1]]
    elif op is _c.ATOMIC_GROUP:
        children = [av]
    elif op is _c.BRANCH:
        children = list(av[1])
    elif op in (_c.ASSERT, _c.ASSERT_NOT):
        children = [av[1]]
    return any(_has_loop(o, a) for child in children for o, a in child)


def _char_test(items: Sequence[tuple[Any, Any]]) -> CharTest | None:
    """The test of a one-character item (a literal, a class, ``.``), else None."""
    if len(items) != 1:
        return None
    op, av = items[0]
    if op is _c.LITERAL:
        return lambda c: c == av
    if op is _c.NOT_LITERAL:
        return lambda c: c != av
    if op is _c.ANY:
        return lambda c: True
    if op is _c.IN:
        return _class_test(av)
    if op is _c.SUBPATTERN:
        return _char_test(list(av[-1]))
    return None


def _equal(value: int) -> CharTest:
    return lambda c: c == value


def _between(low: int, high: int) -> CharTest:
    return lambda c: low <= c <= high


def _class_test(members: Any) -> CharTest | None:
    tests: list[CharTest] = []
    negate = False
    for op, av in members:
        if op is _c.NEGATE:
            negate = True
        elif op is _c.LITERAL:
            tests.append(_equal(av))
        elif op is _c.RANGE:
            tests.append(_between(*av))
        elif op is _c.CATEGORY and av in _CATEGORIES:
            tests.append(_CATEGORIES[av])
        else:
            return None
    if negate:
        return lambda c: not any(t(c) for t in tests)
    return lambda c: any(t(c) for t in tests)


def _first_char(items: Any) -> CharTest | None:
    flat = _flatten(items)
    return _char_test(flat[:1]) if flat else None


def _last_char(items: Any) -> CharTest | None:
    flat = _flatten(items)
    return _char_test(flat[-1:]) if flat else None


def _overlap(one: CharTest, other: CharTest) -> bool:
    """Whether two character tests accept a common character (sampled; when neither
    accepts any sampled character they are taken to overlap: conservative)."""
    hits = [c for c in _SAMPLE if one(c)]
    if not hits:
        return True
    return any(other(c) for c in hits) or not any(other(c) for c in _SAMPLE)


__all__ = ["Backtracking", "check_backtracking"]
