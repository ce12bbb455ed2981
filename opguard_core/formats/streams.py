"""Stream roles (formats.md, "Streams and roles"): device streams named by what they do.

A raw stream id is the runtime's number (CUDA's default stream is 0 to torch and 7 to
Kineto/CUPTI, HIP's is 0; NCCL picks its own), so the same program traced on two
machines, or by two tools, records different ids. Every callsite therefore also
carries a *role*, and configs, compare and check use the role:

* ``compute``: the default stream (where work goes unless the program picks a stream);
* ``comm``, ``comm2``, …: the communication streams, in order of first use; every
  collective op (``c10d::``, ``_c10d_functional::``, ``c10d_functional::``) is on one;
* ``side1``, ``side2``, …: any other stream, in order of first use.

:class:`StreamRoles` assigns roles as a process runs (the tracer, the guard);
:func:`legacy_roles` and :func:`legacy_stream_counts` give files written before roles
existed (callsite traces version 1 and 2, configs 1 and 2, trees 1) theirs.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable, Mapping

COMPUTE = "compute"
COMM = "comm"
#: every valid role: ``compute``, ``comm``, ``commN`` (N >= 2), ``sideN`` (N >= 1)
ROLE_PATTERN = r"^(compute|comm([2-9]|[1-9][0-9]+)?|side[1-9][0-9]*)\Z"
_ROLE = re.compile(ROLE_PATTERN)
#: op namespaces of collectives (they run on a communication stream)
COMM_NAMESPACES = ("c10d::", "_c10d_functional::", "c10d_functional::")


def is_role(value: object) -> bool:
    """Whether ``value`` is a valid role name."""
    return isinstance(value, str) and _ROLE.match(value) is not None


def is_comm_op(op: str) -> bool:
    """Whether ``op`` is a collective, which runs on a communication stream."""
    return op.startswith(COMM_NAMESPACES)


def role_order(role: str) -> tuple[int, int]:
    """Sort key of a role: ``compute``, then ``comm``, ``comm2``, …, then ``side1``, …"""
    if role == COMPUTE:
        return (0, 0)
    if role.startswith(COMM):
        return (1, int(role[len(COMM) :] or 1))
    if role.startswith("side") and role[4:].isdigit():
        return (2, int(role[4:]))
    return (3, 0)


def sorted_roles(counts: Mapping[str, int]) -> list[tuple[str, int]]:
    """``counts`` (role -> count) as items in :func:`role_order`."""
    return sorted(counts.items(), key=lambda item: role_order(item[0]))


class StreamRoles:
    """Roles of the raw streams a process uses, as it uses them: a collective op is on
    ``comm``; the default stream (``default``: torch's id 0) is ``compute``; every
    other stream is ``sideN``, numbered in order of first sight (:meth:`see`, called
    for every op, collectives too, so a number may go unused)."""

    __slots__ = ("_lock", "default", "sides")

    def __init__(self, default: int = 0) -> None:
        self.default = default
        #: raw id -> its side role, in order of first sight
        self.sides: dict[int, str] = {}
        self._lock = threading.Lock()

    def see(self, stream: int) -> int:
        """Note ``stream`` as used (the first sight fixes its number); returns it."""
        if stream != self.default and stream not in self.sides:
            with self._lock:  # two threads' new streams get two numbers
                self.sides.setdefault(stream, f"side{len(self.sides) + 1}")
        return stream

    def role(self, stream: int, op: str) -> str:
        """The role of ``op`` run on raw ``stream``."""
        if is_comm_op(op):
            return COMM
        if stream == self.default:
            return COMPUTE
        return self.sides[self.see(stream)]


def legacy_roles(sites: Iterable[tuple[str, int]]) -> dict[tuple[str, int], str]:
    """Roles for a file written before roles existed, from its (op, raw stream) pairs:
    a collective op is ``comm``; stream 0 is ``compute``; every other id is
    ``side1``, ``side2``, … in ascending order (the order of first use is not known)."""
    pairs = set(sites)
    others = sorted({stream for op, stream in pairs if stream != 0 and not is_comm_op(op)})
    side = {stream: f"side{n}" for n, stream in enumerate(others, start=1)}
    return {
        (op, stream): COMM if is_comm_op(op) else COMPUTE if stream == 0 else side[stream]
        for op, stream in pairs
    }


def legacy_side_roles(streams: Iterable[int]) -> dict[int, str]:
    """Raw id -> role of the streams of a config or tree written before roles: 0 is
    ``compute``, the others ``side1``, ``side2``, … in ascending order."""
    others = sorted({s for s in streams if s != 0})
    return {0: COMPUTE, **{s: f"side{n}" for n, s in enumerate(others, start=1)}}


def legacy_stream_counts(
    streams: Mapping[int, int], ops: Mapping[str, int], sides: Mapping[int, str]
) -> dict[str, int]:
    """A pre-role count by raw stream (``stream_counts``, ``self_streams``) as a count
    by role: the collective ops' count (``ops``) moves to ``comm`` (taken from stream
    0 first, then from the other streams in ascending id order: old tracers recorded
    a collective on the caller's stream), the rest keeps its stream's role (``sides``,
    :func:`legacy_side_roles` of the whole document)."""
    left = {s: c for s, c in sorted(streams.items()) if c > 0}
    comm = min(sum(c for op, c in ops.items() if is_comm_op(op)), sum(left.values()))
    out: dict[str, int] = {}
    if comm:
        out[COMM] = comm
    for stream in sorted(left, key=lambda s: (s != 0, s)):
        take = min(comm, left[stream])
        comm -= take
        if left[stream] - take:
            role = sides[stream]
            out[role] = out.get(role, 0) + left[stream] - take
    return dict(sorted_roles(out))
