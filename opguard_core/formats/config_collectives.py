"""A config's ``collectives`` (version 4): the collective sequences of the good run.

The trace's ``collectives`` (formats.md, "Collective sequences") written into the
instrumentation config, so the config alone tells ``opguard guard`` which collective
each rank must issue next (docs/guard.md, "Collective sequences"). One item per
(source, sequence), in the layout the config's fast reader and writer handle (block
mappings, flow collections of scalars)::

    collectives:
      - source: gpt_callsite
        ranks: [0, 1]
        groups:
          0: {name: '0', desc: default_pg, size: 2, ranks: [0, 1]}
        signatures:
          0: {op: 'c10d::allreduce_', group: 0, dtype: float32, numel: 6, shapes: ['2x3'],
              reduce_op: sum, at: 'train:step (train.py:42)'}
        steps:
          0-0: [0, 0]
          1-999: [0]

The trace's fields, but: a field the recorder did not know is left out (not null);
``shapes`` are strings (``2x3``; ``''`` for a scalar); a signature's frame ids become
``at``, the function that issued it (the innermost frame outside torch) with its
file and line, for the person reading; ``steps`` map ``first-last`` to the signature
ids each of those steps issued. Merge keeps every source's items; where two inputs
both carry a source, the items whose JSON form sorts first (associative, commutative).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ruamel.yaml.comments import CommentedMap, CommentedSeq

from opguard_core.errors import InputError
from opguard_core.formats.collectives import (
    Collectives,
    CollectiveSequence,
    Group,
    Signature,
    StepRun,
    check_collectives,
)
from opguard_core.formats.styles import block_map, flow_map, flow_seq
from opguard_core.formats.trace import Frame, is_torch_module
from opguard_core.formats.tree import target_name
from opguard_core.formats.values import is_count, is_counts, json_bytes

#: the first config version that may carry ``collectives``
CONFIG_COLLECTIVES_VERSION = 4

_STEPS = re.compile(r"(0|[1-9][0-9]*)-(0|[1-9][0-9]*)")
_SHAPE = re.compile(r"(?:(?:0|[1-9][0-9]*)(?:x(?:0|[1-9][0-9]*))*)?")


def shape_text(shape: Iterable[int]) -> str:
    """``2x3`` for (2, 3); ``''`` for a scalar."""
    return "x".join(str(n) for n in shape)


def _shape(text: str) -> tuple[int, ...]:
    return tuple(int(n) for n in text.split("x")) if text else ()


def issued_at(frames: Sequence[Frame]) -> Callable[[tuple[int, ...]], str | None]:
    """``where(stack)`` for :func:`config_collectives`: the innermost frame of the
    stack outside torch (else the innermost), as ``module:qualname (file:line)``."""

    def where(stack: tuple[int, ...]) -> str | None:
        if not stack:
            return None
        ids = [fid for fid in stack if not is_torch_module(frames[fid].module)]
        frame = frames[(ids or list(stack))[-1]]
        name = target_name(frame.module, frame.file, frame.qualname)
        return f"{name} ({frame.file}:{frame.line})"

    return where


def sequence_item(
    source: str, seq: CollectiveSequence, where: Callable[[tuple[int, ...]], str | None]
) -> CommentedMap:
    """One ``collectives`` item for ``seq`` of ``source``; ``where(stack)`` names the
    function that issued a signature (None: no ``at``)."""
    groups = []
    for g in seq.groups:
        fields: list[tuple[str, Any]] = [("name", g.name)]
        fields += [("desc", g.desc)] if g.desc is not None else []
        fields += [("size", g.size)] if g.size is not None else []
        fields.append(("ranks", flow_seq(g.ranks)))
        fields += [("first", g.first)] if g.first else []
        groups.append(flow_map(fields))
    signatures = []
    for sig in seq.signatures:
        fields = [("op", sig.op), ("group", sig.group)]
        for name in ("dtype", "numel", "reduce_op"):
            value = getattr(sig, name)
            fields += [(name, value)] if value is not None else []
        if sig.shapes is not None:
            fields.append(("shapes", flow_seq(shape_text(s) for s in sig.shapes)))
        at = where(sig.stack) if sig.stack else None
        fields += [("at", at)] if at else []
        signatures.append(flow_map(fields))
    return block_map(
        [
            ("source", source),
            ("ranks", flow_seq(seq.ranks)),
            ("groups", block_map(enumerate(groups))),
            ("signatures", block_map(enumerate(signatures))),
            ("steps", block_map((f"{r.first}-{r.last}", flow_seq(r.calls)) for r in seq.steps)),
        ]
    )


def config_collectives(
    source: str, found: Collectives, where: Callable[[tuple[int, ...]], str | None]
) -> CommentedSeq:
    """The ``collectives`` value of a config generated from one source's trace."""
    seq = CommentedSeq(sequence_item(source, s, where) for s in found.sequences)
    seq.fa.set_block_style()
    return seq


def _fail(path: Path | str, where: str, problem: str) -> InputError:
    return InputError(path, f"{where} {problem}")


def _optional(item: Mapping[str, Any], key: str, check: Callable[[object], bool]) -> bool:
    return key not in item or check(item[key])


def _indexed(value: object, path: Path | str, where: str) -> list[Any]:
    """A block mapping ``0: …, 1: …`` as the list of its values (keys 0, 1, … in order)."""
    if not isinstance(value, dict) or list(value) != list(range(len(value))):
        raise _fail(path, where, "must map 0, 1, … in order to items")
    return list(value.values())


def _group(value: object, path: Path | str, where: str) -> Group:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        raise _fail(path, where, "must be a mapping with a string name")
    if not (
        _optional(value, "desc", lambda v: isinstance(v, str))
        and _optional(value, "size", lambda v: is_count(v) and v > 0)  # type: ignore[operator]
        and _optional(value, "ranks", is_counts)
        and _optional(value, "first", is_count)
        and set(value) <= {"name", "desc", "size", "ranks", "first"}
    ):
        raise _fail(path, where, "must hold name, desc, size, ranks and first of a group")
    return Group(
        name=value["name"],
        desc=value.get("desc"),
        size=value.get("size"),
        ranks=tuple(value.get("ranks", ())),
        first=value.get("first", 0),
    )


def _signature(value: object, path: Path | str, where: str) -> Signature:
    if not isinstance(value, dict) or not isinstance(value.get("op"), str):
        raise _fail(path, where, "must be a mapping with a string op")
    shapes = value.get("shapes")
    if not (
        is_count(value.get("group"))
        and _optional(value, "dtype", lambda v: isinstance(v, str))
        and _optional(value, "numel", is_count)
        and _optional(value, "reduce_op", lambda v: isinstance(v, str))
        and _optional(value, "at", lambda v: isinstance(v, str))
        and (
            shapes is None
            or (
                isinstance(shapes, list)
                and all(isinstance(s, str) and _SHAPE.fullmatch(s) for s in shapes)
            )
        )
        and set(value) <= {"op", "group", "dtype", "numel", "shapes", "reduce_op", "at"}
    ):
        raise _fail(
            path, where, "must hold op, group, dtype, numel, shapes (2x3), reduce_op and at"
        )
    return Signature(
        op=value["op"],
        group=value["group"],
        dtype=value.get("dtype"),
        numel=value.get("numel"),
        shapes=None if shapes is None else tuple(_shape(s) for s in shapes),
        reduce_op=value.get("reduce_op"),
    )


def _steps(value: object, path: Path | str, where: str) -> list[StepRun]:
    if not isinstance(value, dict):
        raise _fail(path, where, "must map first-last step ranges to signature ids")
    runs = []
    for key, calls in value.items():
        match = _STEPS.fullmatch(key) if isinstance(key, str) else None
        if match is None or not is_counts(calls):
            raise _fail(path, f"{where}.{key}", "must be first-last: [signature ids]")
        runs.append(StepRun(int(match[1]), int(match[2]), tuple(calls)))
    return runs


def read_config_collectives(value: object, path: Path | str) -> dict[str, Collectives]:
    """A config's ``collectives``, validated, by source; one-line :class:`InputError`
    naming the field otherwise (ids in range, steps in order, a rank once per source)."""
    if not isinstance(value, list):
        raise _fail(path, "collectives", "must be a list")
    found: dict[str, Collectives] = {}
    items: dict[str, list[int]] = {}  # per source, the index of each of its items
    for index, item in enumerate(value):
        where = f"collectives[{index}]"
        if not isinstance(item, dict) or not isinstance(item.get("source"), str):
            raise _fail(path, where, "must be a mapping with a string source")
        if not (isinstance(item.get("ranks"), list) and item["ranks"] and is_counts(item["ranks"])):
            raise _fail(path, f"{where}.ranks", "must be a non-empty list of ranks")
        seq = CollectiveSequence(
            ranks=list(item["ranks"]),
            groups=[
                _group(g, path, f"{where}.groups.{i}")
                for i, g in enumerate(_indexed(item.get("groups", {}), path, f"{where}.groups"))
            ],
            signatures=[
                _signature(s, path, f"{where}.signatures.{i}")
                for i, s in enumerate(
                    _indexed(item.get("signatures", {}), path, f"{where}.signatures")
                )
            ],
            steps=_steps(item.get("steps", {}), path, f"{where}.steps"),
        )
        found.setdefault(item["source"], Collectives()).sequences.append(seq)
        items.setdefault(item["source"], []).append(index)
    for source, collectives in found.items():
        # the trace's checks, without frames (a config names no frame ids); a rank
        # may appear once per source
        ranks = sorted({r for seq in collectives.sequences for r in seq.ranks})
        label = [f"collectives[{index}]" for index in items[source]].__getitem__
        check_collectives(collectives, path, 0, ranks, label)
    return found


def merge_config_collectives(left: object, right: object) -> CommentedSeq:
    """Both configs' ``collectives``: every source's items; a source both carry keeps
    the items whose JSON form sorts first (associative and commutative)."""
    by_source: dict[str, list[Any]] = {}
    for value in (left, right):
        mine: dict[str, list[Any]] = {}
        for item in value or []:  # type: ignore[attr-defined]
            mine.setdefault(str(item["source"]), []).append(item)
        for source, items in mine.items():
            if source not in by_source or json_bytes(items) < json_bytes(by_source[source]):
                by_source[source] = items
    seq = CommentedSeq(item for source in sorted(by_source) for item in by_source[source])
    seq.fa.set_block_style()
    return seq


__all__ = [
    "CONFIG_COLLECTIVES_VERSION",
    "config_collectives",
    "issued_at",
    "merge_config_collectives",
    "read_config_collectives",
    "sequence_item",
    "shape_text",
]
