"""The YAML styles a config is written in: flow and block collections (ruamel types).

Shared by :mod:`opguard_core.formats.config` and the modules it reads sections with
(:mod:`opguard_core.formats.config_collectives`), which cannot import it.
"""

from __future__ import annotations

from collections.abc import Iterable
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


__all__ = ["block_map", "flow_map", "flow_seq"]
