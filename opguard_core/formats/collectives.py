"""Collective sequences (formats.md, "Collective sequences"): what each rank issued, in order.

A callsite trace of version 6 may carry a top-level ``"collectives"`` object: for each
distinct sequence, the ranks that issued it, the process groups it used, the distinct
collective *signatures* it issued, and, step by step, the order it issued them in::

    "collectives": {"sequences": [
      {"ranks": [0, 1],
       "groups": [{"name": "0", "desc": "default_pg", "size": 2, "ranks": [0, 1]}],
       "signatures": [
         {"op": "c10d::allreduce_", "group": 0, "dtype": "float32", "numel": 6,
          "shapes": [[6]], "reduce_op": "sum", "stack": [0, 3]}],
       "steps": [[0, 0, [0, 0]], [1, 999, [0]]]}]}

* ``groups``: the process groups the sequence used, by c10d name (``"0"`` is the
  default group; torch numbers the others in creation order, the same on every rank
  that creates them in the same order), ``desc`` (torch's description, e.g.
  ``default_pg``, or null), ``size`` (null when unknown) and ``ranks``, its members'
  global ranks in group rank order.
* ``signatures``: each distinct collective call: ``op`` (the dispatcher's name,
  ``c10d::allreduce_``, ``_c10d_functional::all_reduce``), ``group`` (an index into
  ``groups``), ``dtype`` (torch's name without ``torch.``: ``float32``), ``numel`` (the
  elements of its input tensors, summed), ``shapes`` (each input tensor's shape: one
  for most collectives, several for list collectives), ``reduce_op`` (``sum``,
  ``avg``, ``max``…; null where the op has none) and ``stack`` (frame ids into the
  trace's ``frames``, outermost first, as a callsite's). Fields may be null when the
  recorder could not tell (a dump without them).
* ``steps``: runs ``[first, last, [signature ids]]``: every step from ``first`` to
  ``last`` (inclusive) issued exactly this list of signatures, in this order. Steps
  count the optimizer steps finished before the collective was issued (the tracer's
  ``meta.steps`` numbering): collectives before the first step are step 0. Runs are
  ascending and do not overlap; a step absent from every run issued no collective.
  A job that repeats itself costs one run, however many steps it ran.
* ``ranks``: the ranks that issued exactly this sequence. A rank file has one sequence
  (its own rank); a combined trace one per distinct sequence, so ranks that agree cost
  one sequence, however many there are.

A rank's **position** in a process group is the index of a collective among those it
issued on that group, steps in order (filter a step's list on ``group``, concatenate).
Divergence compares ranks by position per group (docs/divergence.md), on
:meth:`Signature.key` (the collective's kind, dtype, shapes, reduce op, not its
stack: ranks issuing the same sequence from different lines agree).

Collective ops are those of :data:`COLLECTIVE_NAMESPACES` except the waits
(:data:`NOT_COLLECTIVES`); :func:`collective_kind` names what an op does, so
``c10d::allreduce_`` and ``_c10d_functional::all_reduce`` compare equal. Point-to-point
ops (``send``, ``recv``…) are recorded but not compared by position
(:func:`compared_by_position`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Annotated, Any

import msgspec

from opguard_core.errors import InputError

NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]

#: the first callsite trace version that may carry ``collectives``
COLLECTIVES_VERSION = 6
#: op namespaces whose ops are collectives (``c10d_functional`` is the legacy funcol)
COLLECTIVE_NAMESPACES = ("c10d::", "_c10d_functional::", "c10d_functional::")
#: ops in those namespaces that issue no collective (they wait for one)
NOT_COLLECTIVES = frozenset(
    {
        "_c10d_functional::wait_tensor",
        "c10d_functional::wait_tensor",
        "_c10d_functional_autograd::wait_tensor",
        "_c10d_functional::_wrap_tensor_autograd",
    }
)

#: the name of the group of a collective whose process group the recorder could not
#: tell (the profiler backend's): compared as one group, whatever the real ones were
UNKNOWN_GROUP = "?"

#: op name (namespace and trailing ``_`` taken off) -> what it does
_KINDS = {
    "allreduce": "allreduce",
    "all_reduce": "allreduce",
    "allreduce_coalesced": "allreduce_coalesced",
    "all_reduce_coalesced": "allreduce_coalesced",
    "allgather": "allgather",
    "_allgather_base": "allgather",
    "all_gather_into_tensor": "allgather",
    "all_gather_into_tensor_out": "allgather",
    "allgather_into_tensor_coalesced": "allgather_coalesced",
    "all_gather_into_tensor_coalesced": "allgather_coalesced",
    "allgather_coalesced": "allgather_coalesced",
    "reduce_scatter": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_coalesced",
    "alltoall": "all_to_all",
    "alltoall_base": "all_to_all",
    "all_to_all": "all_to_all",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
    "barrier": "barrier",
    "monitored_barrier": "barrier",
    "gather": "gather",
    "scatter": "scatter",
    "reduce": "reduce",
    "send": "send",
    "recv": "recv",
    "recv_any_source": "recv",
}


def is_collective(op: str) -> bool:
    """Whether ``op`` issues a collective (a wait does not)."""
    return op.startswith(COLLECTIVE_NAMESPACES) and op not in NOT_COLLECTIVES


#: what point-to-point ops do (:func:`collective_kind`): a send on one rank pairs with
#: a recv on its peer, not with what the group's other members issue at its position
POINT_TO_POINT = frozenset({"send", "recv", "isend", "irecv", "batch_p2p_ops"})
#: the torch.distributed APIs of point-to-point ops (a callsite a trace without
#: collective sequences names by its API)
POINT_TO_POINT_APIS = frozenset(
    f"torch.distributed.{name}" for name in ("send", "recv", "isend", "irecv", "batch_isend_irecv")
)


#: kinds (:func:`collective_kind`) whose sizes differ between ranks, and between steps,
#: by design (uneven splits: an MoE's token dispatch); any kind named ``*_v``
#: (``allgather_v``, ``reduce_scatter_v``) too: compared without their size
UNEVEN = frozenset({"all_to_all"})


@functools.lru_cache(maxsize=4096)  # a job has a few ops, called millions of times
def compared_by_position(op: str) -> bool:
    """Whether ranks are compared on ``op`` by position on its group (docs/divergence.md):
    a collective every member issues, not a wait (:data:`NOT_COLLECTIVES`) nor a
    point-to-point op (:data:`POINT_TO_POINT`), where a send and a recv differ."""
    return op not in NOT_COLLECTIVES and collective_kind(op) not in POINT_TO_POINT


@functools.lru_cache(maxsize=4096)
def collective_kind(op: str) -> str:
    """What a collective op does, whatever its API: ``c10d::allreduce_`` and
    ``_c10d_functional::all_reduce`` are both ``allreduce``; an unknown op is its own
    name without namespace and trailing ``_``."""
    name = op.split("::", 1)[-1].rstrip("_") if "::" in op else op
    if name.startswith("_") and name not in _KINDS:
        name = name.lstrip("_")
    return _KINDS.get(name, name)


def compared_size(
    op: str, numel: int | None, shapes: tuple[tuple[int, ...], ...] | None
) -> tuple[int | None, tuple[tuple[int, ...], ...] | None]:
    """The element count and shapes of a call of ``op`` that every rank must share:
    none (None, None: not compared) for an uneven kind (:data:`UNEVEN`, ``*_v``); a
    scatter's one rank's share (its first shape: a trace written before the tracer
    described a scatter by its output, on every rank, holds the root's whole list);
    otherwise ``numel`` and ``shapes`` as recorded."""
    kind = collective_kind(op)
    if kind in UNEVEN or kind.endswith("_v"):
        return None, None
    if kind == "scatter" and shapes:
        return math.prod(shapes[0]), shapes[:1]
    return numel, shapes


class Group(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A process group as its members know it."""

    name: str
    desc: str | None = None
    #: None where the recorder could not tell (a gloo Flight Recorder dump)
    size: PositiveInt | None = None
    ranks: tuple[NonNegativeInt, ...] = ()
    #: the position on this group of the sequence's first collective on it: the ones
    #: before were not recorded (a Flight Recorder ring buffer that wrapped); 0 when
    #: the sequence starts with the job (written only when it is not 0)
    first: NonNegativeInt = 0


def _encode_group(group: Group) -> bytes:
    if group.first:
        return msgspec.json.encode(group)
    return msgspec.json.encode({f: getattr(group, f) for f in ("name", "desc", "size", "ranks")})


class Signature(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=False, forbid_unknown_fields=True
):
    """One distinct collective call (see the module docstring)."""

    op: str
    group: NonNegativeInt
    dtype: str | None = None
    numel: NonNegativeInt | None = None
    shapes: tuple[tuple[NonNegativeInt, ...], ...] | None = None
    reduce_op: str | None = None
    stack: tuple[NonNegativeInt, ...] = ()

    def key(self) -> tuple[Any, ...]:
        """What ranks must agree on at one position: kind, dtype, size
        (:func:`compared_size`), reduce op (not the op's API, nor the stack). The group
        is compared separately."""
        size = compared_size(self.op, self.numel, self.shapes)
        return (collective_kind(self.op), self.dtype, *size, self.reduce_op)


class StepRun(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """Steps ``first`` to ``last`` each issued ``calls`` (signature ids), in order."""

    first: NonNegativeInt
    last: NonNegativeInt
    calls: tuple[NonNegativeInt, ...]


class CollectiveSequence(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The collectives the ranks ``ranks`` each issued, in order (module docstring)."""

    ranks: list[NonNegativeInt]
    groups: list[Group] = []
    signatures: list[Signature] = []
    steps: list[StepRun] = []

    def calls(self) -> Iterator[tuple[int, int]]:
        """Every collective issued, in order, as (step, signature id); lazily, so a
        million repeated steps are never expanded in memory at once."""
        for run in self.steps:
            for step in range(run.first, run.last + 1):
                for call in run.calls:
                    yield step, call

    def count(self) -> int:
        """How many collectives were issued in all."""
        return sum((run.last - run.first + 1) * len(run.calls) for run in self.steps)


class Collectives(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A trace's ``collectives``: one :class:`CollectiveSequence` per distinct sequence."""

    sequences: list[CollectiveSequence] = []

    def by_rank(self) -> dict[int, CollectiveSequence]:
        """Each rank's sequence."""
        return {rank: seq for seq in self.sequences for rank in seq.ranks}


class StepRecorder:
    """Builds a sequence's ``steps`` as a process runs: :meth:`add` one call at a time,
    in order; consecutive steps with the same list of calls share one run, so memory
    stays flat for a job that repeats itself."""

    def __init__(self) -> None:
        self.runs: list[list[Any]] = []  # [first, last, calls tuple]
        self._step: int | None = None
        self._calls: list[int] = []

    def add(self, step: int, call: int) -> None:
        if step != self._step:
            self._close()
            self._step = step
        self._calls.append(call)

    def _close(self) -> None:
        if self._step is None:
            return
        calls = tuple(self._calls)
        last = self.runs[-1] if self.runs else None
        if last is not None and last[1] + 1 == self._step and last[2] == calls:
            last[1] = self._step
        else:
            self.runs.append([self._step, self._step, calls])
        self._step = None
        self._calls = []

    def finish(self) -> list[StepRun]:
        """The runs so far (the current step included); recording may go on."""
        runs = [StepRun(first, last, calls) for first, last, calls in self.runs]
        if self._step is not None:
            calls = tuple(self._calls)
            if runs and runs[-1].last + 1 == self._step and runs[-1].calls == calls:
                runs[-1] = StepRun(runs[-1].first, self._step, calls)
            else:
                runs.append(StepRun(self._step, self._step, calls))
        return runs


_DECODER = msgspec.json.Decoder(Collectives)


def decode_collectives(
    value: Any, path: Path | str, frames: int, ranks: Sequence[int]
) -> Collectives:
    """Validate a decoded ``collectives`` value (a JSON object) against its trace:
    ``frames`` frames, covering ``ranks``; one-line :class:`InputError` otherwise."""
    try:
        found = (
            _DECODER.decode(value)
            if isinstance(value, bytes | bytearray | memoryview)
            else msgspec.convert(value, Collectives)
        )
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise InputError(path, f"invalid trace: {' '.join(str(exc).split())}") from None
    check_collectives(found, path, frames, ranks)
    return found


def check_collectives(
    found: Collectives,
    path: Path | str,
    frames: int,
    ranks: Sequence[int],
    label: Callable[[int], str] = "collectives.sequences[{}]".format,
) -> None:
    """Refuse a ``collectives`` whose ids point outside their tables, whose runs are
    out of order, or whose ranks are not the trace's or appear twice (``label(s)``
    names sequence ``s`` in the message)."""
    allowed, seen = set(ranks), set[int]()
    for s, seq in enumerate(found.sequences):
        where = label(s)
        if not seq.ranks:
            raise InputError(path, f"{where}.ranks is empty")
        for rank in seq.ranks:
            if rank not in allowed:
                raise InputError(path, f"{where}.ranks has rank {rank}, not one of the trace's")
            if rank in seen:
                raise InputError(path, f"{where}.ranks has rank {rank} a second time")
            seen.add(rank)
        for g, group in enumerate(seq.groups):
            if group.ranks and group.size is not None and len(group.ranks) != group.size:
                raise InputError(
                    path, f"{where}.groups[{g}] has size {group.size} but {len(group.ranks)} ranks"
                )
        for i, sig in enumerate(seq.signatures):
            if sig.group >= len(seq.groups):
                raise InputError(
                    path,
                    f"{where}.signatures[{i}].group is {sig.group}, "
                    f"but the sequence has only {len(seq.groups)} groups",
                )
            if sig.stack and max(sig.stack) >= frames:
                raise InputError(
                    path,
                    f"{where}.signatures[{i}].stack refers to frame {max(sig.stack)}, "
                    f"but the trace has only {frames} frames",
                )
        previous = -1
        for r, run in enumerate(seq.steps):
            if run.first > run.last or run.first <= previous:
                raise InputError(
                    path, f"{where}.steps[{r}] is out of order ([{run.first}, {run.last}])"
                )
            previous = run.last
            if run.calls and max(run.calls) >= len(seq.signatures):
                raise InputError(
                    path,
                    f"{where}.steps[{r}] refers to signature {max(run.calls)}, "
                    f"but the sequence has only {len(seq.signatures)}",
                )


def encode_collectives(found: Collectives) -> bytes:
    """The ``collectives`` value as JSON, one group, signature or run per line."""
    encode = msgspec.json.encode
    parts = [b'{"sequences":[']
    for s, seq in enumerate(found.sequences):
        parts.append(b"\n" if s == 0 else b",\n")
        parts.append(b'{"ranks":' + encode(seq.ranks) + b',\n"groups":[')
        parts.append(b",".join(_encode_group(g) for g in seq.groups))
        parts.append(b'],\n"signatures":[\n')
        parts.append(b",\n".join(encode(sig) for sig in seq.signatures))
        parts.append(b'],\n"steps":[\n')
        parts.append(b",\n".join(encode(run) for run in seq.steps))
        parts.append(b"]}")
    parts.append(b"]}")
    return b"".join(parts)


def remap_runs(runs: Sequence[StepRun], remap: Sequence[int]) -> list[StepRun]:
    """``runs`` with their signature ids mapped through ``remap``; neighbouring runs
    that end up with the same calls (two raw signatures that became one) merged."""
    merged: list[StepRun] = []
    for run in runs:
        calls = tuple(remap[c] for c in run.calls)
        if merged and merged[-1].last + 1 == run.first and merged[-1].calls == calls:
            merged[-1] = StepRun(merged[-1].first, run.last, calls)
        else:
            merged.append(StepRun(run.first, run.last, calls))
    return merged


def remap_stacks(seq: CollectiveSequence, remap: dict[int, int]) -> CollectiveSequence:
    """``seq`` with its signatures' frame ids mapped through ``remap`` (to another
    document's frame table, as a combine does)."""
    signatures = [
        msgspec.structs.replace(sig, stack=tuple(remap[f] for f in sig.stack))
        for sig in seq.signatures
    ]
    return CollectiveSequence(
        ranks=list(seq.ranks), groups=list(seq.groups), signatures=signatures, steps=list(seq.steps)
    )
