"""The YAML styles a config is written in: flow and block collections (ruamel types).

Shared by :mod:`opguard_core.formats.config` and the modules it reads sections with
(:mod:`opguard_core.formats.config_collectives`), which cannot import it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import ItemsView, Iterable, Iterator
from typing import Any

from ruamel.yaml.comments import CommentedMap, CommentedSeq


def flow_seq(items: Iterable[Any]) -> CommentedSeq:
    seq = CommentedSeq(items)
    seq.fa.set_flow_style()
    return seq


def flow_map(items: Iterable[tuple[Any, Any]]) -> CommentedMap:
    mapping = CommentedMap(items)
    mapping.fa.set_flow_style()
    return mapping


def block_map(items: Iterable[tuple[Any, Any]]) -> CommentedMap:
    """A block mapping (one key per line), as v2 writes ``meta``, ``ops`` and
    ``stream_counts``."""
    mapping = CommentedMap(items)
    mapping.fa.set_block_style()
    return mapping


def put_new(mapping: CommentedMap, key: Any, value: Any) -> None:
    """``mapping[key] = value`` for a key not in ``mapping`` yet, without ruamel's
    Python-level ``__setitem__`` (which looks the key up first, to keep the style of a
    scalar string it would replace)."""
    OrderedDict.__setitem__(mapping, key, value)
    mapping._ok.add(key)


def items_of(mapping: Any) -> ItemsView[Any, Any]:
    """``mapping.items()``, at C speed for a ruamel mapping: its own view iterates in
    Python and looks each key up again (the same pairs: a merged key is not stored)."""
    return OrderedDict.items(mapping) if isinstance(mapping, OrderedDict) else mapping.items()


def elements_of(seq: Any) -> Iterator[Any]:
    """``iter(seq)``, at C speed for a ruamel sequence (whose ``__iter__`` is the
    ``Sequence`` mixin's: one ``__getitem__`` call per item)."""
    return list.__iter__(seq) if isinstance(seq, list) else iter(seq)


__all__ = ["block_map", "elements_of", "flow_map", "flow_seq", "items_of", "put_new"]
