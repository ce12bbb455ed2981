"""Which ranks ran an op (config version 6, tree version 6; formats.md, "Which ranks
ran an op").

A config entry's ``ops`` are summed over ranks. Where the compressor recorded it
(``meta.op_ranks: true``), an entry's ``op_ranks`` lists the ops that *not every one*
of the entry's ranks ran, each with the ranks that did, as ranges (``[[0, 3], 7]``,
:func:`~opguard_core.formats.tree.ranks_to_ranges`); every other op of the entry ran on
all of its ranks. Without ``meta.op_ranks`` which rank ran which op is unknown.
"""

from __future__ import annotations

from typing import Any

from ruamel.yaml.comments import CommentedSeq

from opguard_core.formats.styles import elements_of, flow_seq, items_of
from opguard_core.formats.tree import ranges_to_ranks, ranks_to_ranges


def ranges_seq(ranks: list[int]) -> CommentedSeq:
    """Sorted distinct ``ranks`` as a YAML flow sequence of ranges: ``[[0, 3], 7]``."""
    return flow_seq(
        flow_seq(item) if isinstance(item, list) else item for item in ranks_to_ranges(ranks)
    )


def read_ranges(value: Any, where: str, top: int | None = None) -> list[int]:
    """The ranks a ranges value (as loaded from YAML) lists; raises
    :class:`~opguard_core.errors.InvariantError` naming ``where`` when it is not one
    (or, with ``top``, lists a rank past it)."""
    return ranges_to_ranks(_plain(value), where, top)


def _plain(value: Any) -> Any:
    """A loaded YAML value with sequences as lists and integers as ``int``, as
    :func:`~opguard_core.formats.tree.ranges_to_ranks` reads them (anything else stays,
    and is refused there)."""
    if isinstance(value, list):
        return [_plain(item) for item in elements_of(value)]
    if isinstance(value, int) and not isinstance(value, bool):
        return int(value)
    return value


def records_op_ranks(config: dict[str, Any]) -> bool:
    """Whether ``config`` records which ranks ran each op (``meta.op_ranks: true``)."""
    return (config.get("meta") or {}).get("op_ranks") is True


def entry_op_ranks(entry: dict[str, Any]) -> dict[str, list[int]]:
    """The ops of a (validated) entry that not all of its ranks ran, each with its ranks."""
    return {
        str(op): read_ranges(value, f"op_ranks[{op!r}]")
        for op, value in items_of(entry.get("op_ranks") or {})
    }


def ranks_of_op(
    entry: dict[str, Any], op: str, config: dict[str, Any], all_ranks: list[int]
) -> list[int] | None:
    """The ranks that ran ``op`` inside ``entry`` of ``config`` (whose ``meta.ranks``
    are ``all_ranks``), or None when the config does not record it."""
    if not records_op_ranks(config):
        return None
    listed = (entry.get("op_ranks") or {}).get(op)
    if listed is not None:
        return read_ranges(listed, f"op_ranks[{op!r}]")
    return [int(rank) for rank in elements_of(entry.get("ranks") or all_ranks)]
