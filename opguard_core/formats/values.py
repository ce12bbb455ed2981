"""Equality of carried JSON/YAML values by type and value, not by Python's ``==``.

Python says ``1 == True == 1.0`` (and ``{"a": 1, "b": 2} == {"b": 2, "a": 1}``),
but each is written differently. Combine keeps an unknown field only when every
input agrees on it, and merge picks one of two disagreeing values by a fixed rule;
both compare with :func:`same_json`, so which input came first (or which worker
of ``--jobs N``) can never change the bytes written (docs/reliability.md).
"""

from __future__ import annotations

from typing import Any

import msgspec


def is_count(value: object) -> bool:
    """Whether a JSON value is a count: an int (not a bool) of 0 or more (counts,
    totals, ranks, steps)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def is_counts(value: object) -> bool:
    """Whether a JSON value is a list of counts (a list of ranks)."""
    return isinstance(value, list) and all(map(is_count, value))


def _fallback(value: Any) -> str:
    # a value msgspec cannot encode (a YAML tag, ...): its type and repr
    return f"{type(value).__module__}.{type(value).__qualname__}:{value!r}"


_encoder = msgspec.json.Encoder(enc_hook=_fallback)


def json_bytes(value: Any) -> bytes:
    """How ``value`` is written as JSON (insertion-ordered keys): the identity
    :func:`same_json` compares."""
    try:
        return _encoder.encode(value)
    except (TypeError, ValueError, OverflowError, RecursionError):
        return _fallback(value).encode()


def same_json(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are the same value *and* written the same way:
    ``1``, ``true`` and ``1.0`` differ; so do mappings whose keys are ordered
    differently."""
    if a is b:
        return True
    if a != b:
        return False
    return json_bytes(a) == json_bytes(b)


def value_order(value: Any) -> tuple[str, bytes]:
    """A total order of carried values that does not depend on where they came from
    (``repr`` first, as merge always did; the written form breaks ties)."""
    return repr(value), json_bytes(value)
