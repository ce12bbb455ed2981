"""Callsite trace documents (formats.md §1): validated decoding and canonical encoding.

Decoding uses msgspec structs, which parse and validate in one C pass. Documents
that carry fields this version does not know (forward compatibility) take a slower
path that keeps those fields, so they can be carried through a combine.
"""

from __future__ import annotations

import datetime
import gzip
import re
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import islice
from pathlib import Path
from typing import Annotated, Any

import msgspec

from opguard_core.errors import InputError
from opguard_core.formats.collectives import Collectives, check_collectives, encode_collectives
from opguard_core.formats.deep_json import nests_deeper_than
from opguard_core.formats.dtypes import DTYPE_PATTERN
from opguard_core.formats.streams import ROLE_PATTERN, legacy_roles

TRACE_FORMAT = "opguard-callsites"
#: the version rank files (the tracer's, the readers') and combined traces are written
#: in. Version 2 added per-rank statistics (``meta.per_rank_stats``, a callsite's
#: ``per_rank``) for combined traces; version 4 a stream ``role`` on every callsite
#: (formats.md, "Streams and roles"), which a combined trace keys on instead of the
#: raw ``stream``; version 5 ``meta.partial`` on a rank file written before its process
#: was done (a periodic flush, SIGTERM, an uncaught exception); version 6 the ranks'
#: collective sequences (top-level ``collectives``,
#: :mod:`opguard_core.formats.collectives`); version 7 an op ``dtype`` on callsites
#: (formats.md, "Dtypes"), part of a callsite's key like its role; version 8
#: ``meta.partial_ranks`` on a combined trace (the ranks whose rank files were partial).
#: Versions 1 and 2 are read, their roles derived (:func:`legacy_roles`); 4 and 5 have
#: no sequences, 6 and older no dtypes, 7 and older no ``partial_ranks``.
TRACE_VERSION = 8
COMBINED_VERSION = TRACE_VERSION
#: the first version whose callsites carry a ``role``
ROLE_VERSION = 4
#: the first version whose callsites may carry a ``dtype``
DTYPE_VERSION = 7
READ_VERSIONS = (1, 2, 4, 5, 6, 7, 8)
#: ``meta.phase`` of the two files the tracer writes once a program's first optimizer
#: step has ended: what ran up to the end of it (construction, initialisation, the first
#: step) and what followed (tracing.md, "Set-up and loop")
SETUP_PHASE = "setup"
LOOP_PHASE = "loop"
PHASES = (SETUP_PHASE, LOOP_PHASE)
RANK_IN_NAME = re.compile(r"_rank(\d+)$")
#: what a trace file's name ends with after its stem: ``.json``, Kineto's
#: ``.pt.trace.json``, either gzip'd; else any one suffix (``.txt``)
_TRACE_SUFFIX = re.compile(r"((\.pt\.trace)?\.json|\.[^.]*)?(\.gz)?$")
#: Ranks are kept as bits of an integer mask, so an absurd rank (``10**12``) would
#: allocate gigabytes; anything at or above this is refused as bad input.
MAX_RANK = 1 << 20

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
Role = Annotated[str, msgspec.Meta(pattern=ROLE_PATTERN)]
Dtype = Annotated[str, msgspec.Meta(pattern=DTYPE_PATTERN)]


def trace_stem(path: Path | str) -> str:
    """A trace file's name without its suffixes (``x_rank1.pt.trace.json.gz`` ->
    ``x_rank1``, ``x_rank1.txt`` -> ``x_rank1``): what rank numbers in names and entry
    names are read from."""
    name = Path(path).name
    return _TRACE_SUFFIX.sub("", name, count=1) or name


def is_torch_module(module: str | None) -> bool:
    """Whether ``module`` is torch's own (``torch``, ``torch.nn.functional``), not a
    package whose name merely starts so (``torchvision``, ``torchtitan``)."""
    return module is not None and (module == "torch" or module.startswith("torch."))


class Frame(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, gc=False):
    """One Python code location; hashable, so it can be interned by value."""

    file: str
    line: int
    function: str
    qualname: str
    module: str | None = None

    def sort_key(self) -> tuple[str, int, str, str, str]:
        return (self.file, self.line, self.function, self.qualname, self.module or "")


class PerRank(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """How a callsite's count varies between the ranks that ran it (version 2).

    Written only where the ranks disagree: ``min``/``max`` are the smallest and
    largest per-rank counts and ``min_ranks``/``max_ranks`` the ranks that hold them;
    ``counts`` lists every distinct per-rank count with its ranks, ascending, when
    known: always for a collective callsite, for any other while it has at most
    :data:`opguard_core.combine.accumulator.MAX_DISTINCT` distinct counts.
    """

    min: PositiveInt
    min_ranks: list[NonNegativeInt]
    max: PositiveInt
    max_ranks: list[NonNegativeInt]
    counts: list[tuple[PositiveInt, list[NonNegativeInt]]] | None = None


class Callsite(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, gc=False):
    """One (stack, api, op, role, dtype) with its count; ``stack`` holds frame ids.

    ``stream`` is the raw stream id a rank file records (None in a combined trace,
    which keys on ``role``; version 1 and 2 files default it to 0); ``role`` is set
    on every decoded callsite (:func:`assign_roles`); ``dtype`` the op's dtype
    (version 7; None: no tensor argument, or not recorded). ``stack`` is a tuple: msgspec
    decodes a JSON array into an exactly sized tuple faster than into a list, and a
    combine uses it as (part of) a dict key.
    """

    stack: tuple[NonNegativeInt, ...]
    op: str
    api: str | None = None
    stream: int | None = None
    role: Role | None = None
    dtype: Dtype | None = None
    count: PositiveInt
    ranks: list[NonNegativeInt] | None = None
    per_rank: PerRank | None = None


class TraceDocument(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A whole callsite trace as it is on disk."""

    format: str
    version: int
    meta: dict[str, Any] = {}
    frames: list[Frame]
    callsites: list[Callsite]
    collectives: Collectives | None = None


class TraceHead(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A trace's header decoded, its ``callsites`` left as bytes for a scanner
    (``opguard_core.combine.stack_table.scan_callsites``)."""

    format: str
    version: int
    meta: dict[str, Any] = {}
    frames: list[Frame]
    callsites: msgspec.Raw
    collectives: Collectives | None = None


class _LaxFrame(Frame, frozen=True, kw_only=True, forbid_unknown_fields=False):
    pass


class _LaxCallsite(Callsite, kw_only=True, forbid_unknown_fields=False):
    pass


class _LaxTraceDocument(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    format: str
    version: int
    meta: dict[str, Any] = {}
    frames: list[_LaxFrame]
    callsites: list[_LaxCallsite]
    collectives: Collectives | None = None


#: How deep a trace document may nest JSON containers (the document itself is level 1;
#: only ``meta`` and unknown fields can nest freely). msgspec stops at a depth that
#: differs by Python (1000 less the stack's depth on 3.11, 1500 on 3.12, 10000 on
#: 3.13); this bound, below all three, refuses the same documents on every version.
MAX_NESTING = 500
_TOO_DEEP = f"invalid trace: nesting too deep (more than {MAX_NESTING} levels)"

_STRICT_DECODER = msgspec.json.Decoder(TraceDocument)
_ANY_DECODER = msgspec.json.Decoder()
_FRAME_FIELDS = frozenset(Frame.__struct_fields__)
_CALLSITE_FIELDS = frozenset(Callsite.__struct_fields__)
_TRACE_FIELDS = frozenset(TraceDocument.__struct_fields__)


class DecodedTrace(msgspec.Struct, kw_only=True):
    """A decoded trace plus any unknown fields found on its parts.

    ``frame_extras[i]`` / ``callsite_extras[j]`` exist only for parts that had
    unknown fields; most documents have none and these stay empty.
    """

    path: str
    meta: dict[str, Any]
    frames: list[Frame]
    callsites: list[Callsite]
    extras: dict[str, Any] = {}
    frame_extras: dict[int, dict[str, Any]] = {}
    callsite_extras: dict[int, dict[str, Any]] = {}
    #: whether some callsite's role was derived (a version 1 or 2 document): two of
    #: them may then share a role (a collective recorded on two streams)
    derived_roles: bool = False
    #: the ranks' collective sequences (version 6), None where none was recorded
    collectives: Collectives | None = None

    def ranks(self) -> list[int]:
        """The ranks this trace covers: ``meta.ranks``, ``meta.rank``, the file name, or [0]."""
        return trace_ranks(self.meta, self.path)


def trace_ranks(meta: dict[str, Any], path: str) -> list[int]:
    """Ranks covered by a trace (see :meth:`DecodedTrace.ranks`)."""
    ranks = meta.get("ranks")
    if isinstance(ranks, list) and ranks and all(_is_rank(r) for r in ranks):
        return sorted(set(ranks))
    rank = meta.get("rank")
    if isinstance(rank, int) and _is_rank(rank):
        return [rank]
    match = RANK_IN_NAME.search(trace_stem(path))
    if match:
        return [int(match.group(1))]
    return [0]


#: ``meta.tracer`` of the tracer's first version, whose ``modes`` backend wrote no
#: ``meta.tracer_backend`` (its ``profiler`` backend did)
_FIRST_TRACER = "opguard/1"


def recorded_by(meta: dict[str, Any]) -> str | None:
    """What recorded a trace, from its ``meta``: the tracer's backend (``modes``,
    ``profiler``) or the reader's source format (``kineto``, ``flight_recorder``);
    None where the meta does not say (a combine of traces that disagree drops the
    keys it is told by). Configs record it as ``meta.recorded_by`` (formats.md §3)."""
    source = meta.get("source_format")
    if isinstance(source, str) and source:
        return source
    backend = meta.get("tracer_backend")
    if isinstance(backend, str) and backend:
        return backend
    if meta.get("tracer") == _FIRST_TRACER:
        return "modes"
    return None


#: ``meta`` key of a combined trace (version 8): each rank whose rank file was written
#: before its process was done, with that file's ``meta.partial``
PARTIAL_RANKS_KEY = "partial_ranks"


def partial_ranks_of(meta: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """A trace's ``meta.partial_ranks`` by rank; empty where there is none, or where a
    combine plugin of another make wrote something else there."""
    listed = meta.get(PARTIAL_RANKS_KEY)
    if not isinstance(listed, dict):
        return {}
    return {
        int(key): marker
        for key, marker in listed.items()
        if isinstance(key, str) and _is_rank_key(key) and isinstance(marker, dict)
    }


def _is_rank_key(key: str) -> bool:
    """Whether a JSON key spells a rank number (ASCII digits, no longer than the
    largest rank: ``int`` of 5,000 digits raises)."""
    return key.isascii() and key.isdigit() and len(key) <= len(str(MAX_RANK))


def absent_ranks(meta: dict[str, Any], ranks: list[int]) -> list[int]:
    """The ranks below a trace's ``meta.world_size`` (every input agreeing on it) that
    it has no record of: a rank whose process died before it wrote its trace, or a
    rank file not given."""
    world = meta.get("world_size")
    if not isinstance(world, int) or isinstance(world, bool) or len(ranks) >= world:
        return []
    have = set(ranks)
    return [rank for rank in range(min(world, MAX_RANK)) if rank not in have]


def describe_partial(partial: dict[int, dict[str, Any]]) -> str:
    """Partial ranks (:func:`partial_ranks_of`) in words, ranks that ended alike
    together: ``rank 1: sigterm at step 3; ranks 4, 5: exception RuntimeError``."""
    alike: dict[str, list[int]] = {}
    for rank, marker in partial.items():
        why = " ".join(str(marker[k]) for k in ("reason", "exception") if marker.get(k))
        if isinstance(marker.get("step"), int) and not isinstance(marker["step"], bool):
            why += f" at step {marker['step']}"
        alike.setdefault(why or "partial", []).append(rank)
    parts = []
    for why, ranks in sorted(alike.items(), key=lambda item: min(item[1])):
        ranks.sort()
        parts.append(f"{'rank' if len(ranks) == 1 else 'ranks'} {list_ranks(ranks)}: {why}")
    return "; ".join(parts)


#: partial reasons of a process told to stop (a launcher, a scheduler or a timeout
#: stopping every rank at once): when its record ends says nothing of who went first
TOLD_TO_STOP = ("sigterm", "sigint")
#: ``meta.partial.reason`` of a flushed trace whose process then ended without writing
#: its own (``os._exit``, SIGKILL): ``opguard trace`` sets it over the flush's
#: (version 8), so the trace says its process was lost, not only flushed
LOST = "lost"
#: partial reasons whose ``at`` is the last periodic flush, not when the process ended
FLUSHED = ("flush", LOST)


def end_times(
    partial: dict[int, dict[str, Any]], leave_out: tuple[str, ...] = ()
) -> dict[int, float]:
    """When each partial rank's record ends (its marker's ``at``, as a POSIX time),
    for the ranks whose marker says so in ISO 8601 and whose ``reason`` is not one of
    ``leave_out``."""
    times: dict[int, float] = {}
    for rank, marker in partial.items():
        if marker.get("reason") in leave_out:
            continue
        at = marker.get("at")
        if isinstance(at, str):
            try:
                times[rank] = datetime.datetime.fromisoformat(at.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return times


def issued_per_group(collectives: Collectives | None) -> dict[int, dict[tuple[Any, ...], int]]:
    """Each rank's count of collectives on each of its groups (name and members), for
    :func:`first_to_end`; run-length encoded steps are counted, not expanded."""
    issued: dict[int, dict[tuple[Any, ...], int]] = {}
    for seq in collectives.sequences if collectives is not None else []:
        per_sig: dict[int, int] = {}
        for run in seq.steps:
            for call in run.calls:
                per_sig[call] = per_sig.get(call, 0) + run.last - run.first + 1
        counts: dict[tuple[Any, ...], int] = {}
        for number, n in per_sig.items():
            if number < len(seq.signatures) and seq.signatures[number].group < len(seq.groups):
                group = seq.groups[seq.signatures[number].group]
                gid = (group.name, tuple(group.ranks))
                counts[gid] = counts.get(gid, 0) + n
        for rank in seq.ranks:
            issued[rank] = counts
    return issued


def first_to_end(
    partial: dict[int, dict[str, Any]],
    issued: Mapping[int, Mapping[tuple[Any, ...], int]] | None = None,
) -> str | None:
    """Of partial ranks (:func:`partial_ranks_of`), the rank whose record ends first,
    when two or more say when they ended (``at``; not a :data:`FLUSHED` marker's, the
    time of a flush), one is earliest and it did not end because it was told to
    (:data:`TOLD_TO_STOP`): in a job that fell apart, the rank that went first is where
    to look (``rank 1 ended first, at …, 0.342 s before the next``). None otherwise.

    ``issued`` (each rank's count of collectives per group, where the trace has
    sequences: :func:`issued_per_group`) tells a hang from a crash: a rank that timed
    out waiting in a collective ends first too, having issued more collectives on the
    groups it shares with a rank that ended after it (the one it waited for, stopped
    later by the launcher); then the message says so and names those ranks. Only the
    groups two ranks share are compared: ranks of other pipeline stages or groups
    issue other numbers of collectives by design."""
    times = end_times(partial, leave_out=FLUSHED)
    ends = sorted((when, rank, partial[rank]["at"]) for rank, when in times.items())
    if len(ends) < 2 or ends[0][0] == ends[1][0]:
        return None
    first = ends[0][1]
    if partial[first].get("reason") in TOLD_TO_STOP:
        return None  # told to stop (a launcher or a timeout stopping every rank): no culprit
    text = (
        f"rank {first} ended first, at {ends[0][2]}, "
        f"{ends[1][0] - ends[0][0]:.3f} s before the next (rank {ends[1][1]})"
    )
    if issued is not None and first in issued:
        mine = issued[first]
        shared: dict[int, tuple[int, int]] = {}  # rank -> (first's, its) on shared groups
        for _, rank, _ in ends[1:]:
            theirs = issued.get(rank, {})
            common = [gid for gid in mine if gid in theirs]
            counts = (sum(mine[g] for g in common), sum(theirs[g] for g in common))
            if counts[1] < counts[0]:
                shared[rank] = counts
        behind = sorted(shared)
        if behind:
            text += (
                f", but it had issued more collectives than rank(s) {list_ranks(behind)} "
                "on the groups they share ("
                + ", ".join(f"{shared[r][0]} to {shared[r][1]}" for r in behind[:8])
                + "), which ended after it: it was likely left waiting in a collective "
                "they never issued"
            )
    return text


def list_ranks(ranks: list[int], limit: int = 8) -> str:
    """Ranks for a message: the first ``limit``, then how many there are."""
    text = ", ".join(map(str, ranks[:limit]))
    return text + (f" … ({len(ranks)} ranks)" if len(ranks) > limit else "")


def _is_rank(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


#: the first bytes of a gzip file
GZIP_MAGIC = b"\x1f\x8b"
#: the UTF-8 byte order mark some editors and Windows tools put first
_BOM = b"\xef\xbb\xbf"


def without_bom(data: bytes) -> bytes:
    """``data`` without a leading UTF-8 byte order mark: JSON must not have one, but
    a file that has one is read past it, whatever its format."""
    return data[len(_BOM) :] if data.startswith(_BOM) else data


def read_bytes(path: Path) -> bytes:
    """Read a whole input file (a gzip file decompressed: ``.json.gz`` traces, by
    content), turning OS and gzip errors into one-line :class:`InputError`."""
    try:
        if path.is_dir():
            raise InputError(path, "is a directory, not a trace file")
        data = path.read_bytes()
        if data.startswith(GZIP_MAGIC):
            try:
                return without_bom(gzip.decompress(data))
            except (OSError, EOFError, zlib.error) as exc:
                raise InputError(path, f"not a readable gzip file: {exc}") from None
        return without_bom(data)
    except InputError:
        raise
    except FileNotFoundError:
        raise InputError(path, "no such file") from None
    except PermissionError:
        raise InputError(path, "permission denied (file is not readable)") from None
    except OSError as exc:
        raise InputError(path, f"cannot read file: {exc.strerror or exc}") from None
    except MemoryError:  # a gzip file that inflates past memory (a few MB can)
        raise InputError(path, "out of memory reading this file") from None


def read_head(path: Path, size: int = 4096) -> bytes:
    """The first ``size`` bytes of an input file (of its decompressed content when it
    is gzip'd), to tell its format by; one-line :class:`InputError` when unreadable."""
    try:
        with path.open("rb") as file:
            head = file.read(size)
            if not head.startswith(GZIP_MAGIC):
                return head
            file.seek(0)
            inflate = zlib.decompressobj(wbits=31)
            out = b""
            while len(out) < size and not inflate.eof and (chunk := file.read(16384)):
                out += inflate.decompress(chunk)
            return out[:size]
    except zlib.error as exc:
        raise InputError(path, f"not a readable gzip file: {exc}") from None
    except OSError as exc:
        raise InputError(path, f"cannot read file: {exc.strerror or exc}") from None


def decode_trace(data: bytes, path: Path | str, check_frame_ids: bool = True) -> DecodedTrace:
    """Decode and validate one trace document; raise :class:`InputError` on any problem.

    ``check_frame_ids=False`` leaves the check that every stack's frame ids are in
    range to the caller: ``TraceAccumulator.add`` gets it for free when it re-interns
    the stacks, and raises the same error. Its message still comes before any rank
    error here, as with the check on.
    """
    data = without_bom(data)
    if not data.strip():
        raise InputError(path, "empty file (expected an opguard-callsites JSON document)")
    try:
        doc = _STRICT_DECODER.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        return _decode_lax(data, path)
    _check_header(doc.format, doc.version, path)
    check_nesting(doc.meta, path)
    derived = assign_roles(doc.callsites, doc.version, path)
    if check_frame_ids:
        validate_frame_ids(doc.frames, doc.callsites, path)
        check_ranks(doc.meta, doc.callsites, path)
    else:
        try:
            check_ranks(doc.meta, doc.callsites, path)
        except InputError:
            validate_frame_ids(doc.frames, doc.callsites, path)
            raise
    if doc.collectives is not None:
        check_collectives(doc.collectives, path, len(doc.frames), trace_ranks(doc.meta, str(path)))
    return DecodedTrace(
        path=str(path),
        meta=doc.meta,
        frames=doc.frames,
        callsites=doc.callsites,
        derived_roles=derived,
        collectives=doc.collectives,
    )


def load_trace(path: Path, check_frame_ids: bool = True) -> DecodedTrace:
    """Read and decode a trace file (see :func:`decode_trace`)."""
    return decode_trace(read_bytes(path), path, check_frame_ids)


def _decode_lax(data: bytes, path: Path | str) -> DecodedTrace:
    """Slow path: explain what is wrong, or keep the unknown fields of a valid document."""
    try:
        raw = _ANY_DECODER.decode(data)
    except msgspec.DecodeError as exc:
        raise InputError(path, f"not valid JSON: {_problem(exc)}") from None
    except RecursionError:
        raise InputError(path, _TOO_DEEP) from None
    if nests_deeper_than(raw, MAX_NESTING):
        raise InputError(path, _TOO_DEEP)
    if not isinstance(raw, dict):
        raise InputError(path, f"expected a JSON object at top level, got {_json_type(raw)}")
    _check_header(raw.get("format"), raw.get("version"), path)
    try:
        doc = msgspec.convert(raw, _LaxTraceDocument)
    except RecursionError:
        raise InputError(path, _TOO_DEEP) from None
    except msgspec.ValidationError as exc:
        raise InputError(path, f"invalid trace: {_problem(exc)}") from None
    frames = [Frame(**msgspec.structs.asdict(f)) for f in doc.frames]
    callsites = [Callsite(**msgspec.structs.asdict(c)) for c in doc.callsites]
    derived = assign_roles(callsites, doc.version, path)
    validate_frame_ids(frames, callsites, path)
    check_ranks(doc.meta, callsites, path)
    if doc.collectives is not None:
        check_collectives(doc.collectives, path, len(frames), trace_ranks(doc.meta, str(path)))
    frame_extras = _extras(raw["frames"], _FRAME_FIELDS)
    callsite_extras = _extras(raw["callsites"], _CALLSITE_FIELDS)
    extras = {k: v for k, v in raw.items() if k not in _TRACE_FIELDS}
    return DecodedTrace(
        path=str(path),
        meta=doc.meta,
        frames=frames,
        callsites=callsites,
        extras=extras,
        frame_extras=frame_extras,
        callsite_extras=callsite_extras,
        derived_roles=derived,
        collectives=doc.collectives,
    )


def _extras(items: list[dict[str, Any]], known: frozenset[str]) -> dict[int, dict[str, Any]]:
    found: dict[int, dict[str, Any]] = {}
    for index, item in enumerate(items):
        extra = {k: v for k, v in item.items() if k not in known}
        if extra:
            found[index] = extra
    return found


def _check_header(fmt: object, version: object, path: Path | str) -> None:
    if fmt != TRACE_FORMAT or version not in READ_VERSIONS or isinstance(version, bool):
        newer = fmt == TRACE_FORMAT and isinstance(version, int) and version > READ_VERSIONS[-1]
        what = (
            'no "format" key: not an OpGuard document'
            if fmt is None
            else f"unknown format {fmt!r} version {version!r}"
            + (" (written by a newer OpGuard?)" if newer else "")
        )
        raise InputError(
            path,
            f"{what} (expected format {TRACE_FORMAT!r} version "
            f"{', '.join(map(str, READ_VERSIONS[:-1]))} or {READ_VERSIONS[-1]})",
        )


def assign_roles(callsites: list[Callsite], version: int, path: Path | str) -> bool:
    """Give every callsite its ``role``: a version-4 document must state each one; a
    version 1 or 2 document's are derived from op and raw stream (:func:`legacy_roles`;
    a role it states anyway is kept). Whether any role was derived."""
    if version >= ROLE_VERSION:
        for index, site in enumerate(callsites):
            if site.role is None:
                raise InputError(
                    path, f"callsites[{index}] has no role (version {version} needs one)"
                )
        return False
    missing = [site for site in callsites if site.role is None]
    if missing:
        roles = legacy_roles((site.op, site.stream or 0) for site in missing)
        for site in missing:
            site.role = roles[(site.op, site.stream or 0)]
    return bool(missing)


def validate_frame_ids(frames: list[Frame], callsites: list[Callsite], path: Path | str) -> None:
    """Refuse a stack that refers to a frame the trace does not have."""
    limit = len(frames)
    for index, site in enumerate(callsites):
        stack = site.stack
        if stack and max(stack) >= limit:
            bad = max(stack)
            raise InputError(
                path,
                f"callsites[{index}].stack refers to frame {bad}, "
                f"but the trace has only {limit} frames",
            )


def check_nesting(meta: dict[str, Any], path: Path | str) -> None:
    """Refuse a ``meta`` that nests deeper than :data:`MAX_NESTING` allows (its values
    are the only free-form part a strict decode keeps)."""
    if nests_deeper_than(meta, MAX_NESTING - 1):
        raise InputError(path, _TOO_DEEP)


def check_ranks(meta: dict[str, Any], callsites: list[Callsite], path: Path | str) -> None:
    """Refuse invalid ``meta.rank``/``meta.ranks`` values (never a silent fallback to the
    file name or rank 0) and ranks at or above :data:`MAX_RANK` (in meta, the file name
    or a callsite)."""
    if "ranks" in meta:
        ranks = meta["ranks"]
        if not (isinstance(ranks, list) and ranks and all(_is_rank(r) for r in ranks)):
            raise InputError(
                path,
                "meta.ranks must be a non-empty list of non-negative integers, "
                f"got {_short(ranks)}",
            )
    if "rank" in meta and not _is_rank(meta["rank"]):
        raise InputError(
            path, f"meta.rank must be a non-negative integer, got {_short(meta['rank'])}"
        )
    covered = trace_ranks(meta, str(path))
    if covered[-1] >= MAX_RANK:
        raise InputError(path, f"rank {covered[-1]} is too large (ranks must be < {MAX_RANK})")
    for index, site in enumerate(callsites):
        if site.ranks and max(site.ranks) >= MAX_RANK:
            raise InputError(
                path,
                f"callsites[{index}].ranks has rank {max(site.ranks)}, "
                f"too large (ranks must be < {MAX_RANK})",
            )


def _short(value: object, limit: int = 40) -> str:
    """A JSON value as text, cut to ``limit`` characters (for one-line messages)."""
    try:
        text = msgspec.json.encode(value).decode()
    except (TypeError, ValueError, OverflowError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _problem(exc: Exception) -> str:
    return " ".join(str(exc).split())


def _json_type(value: object) -> str:
    return {list: "an array", str: "a string", int: "a number", float: "a number"}.get(
        type(value), "null" if value is None else type(value).__name__
    )


def encode_trace(
    meta: dict[str, Any],
    frames: list[Frame],
    callsites: Sequence[Any],
    extras: dict[str, Any] | None = None,
    frame_extras: dict[int, dict[str, Any]] | None = None,
    version: int = TRACE_VERSION,
    collectives: Collectives | None = None,
) -> bytes:
    """Encode a trace canonically: fixed key order, one callsite per line, trailing newline."""
    return b"".join(
        encode_trace_parts(meta, frames, callsites, extras, frame_extras, version, collectives)
    )


#: callsites encoded per part of :func:`encode_trace_parts`: a part is its callsites'
#: structs, their encoded lines and the lines joined, all at once (0.8-1 KB a
#: callsite: 20,000 a part peaked at 16-20 MiB in the helper that writes the combined
#: trace beside the divergence stage, 2,000 at 3.6 MiB with the frames' part, in the
#: same CPU time: 8 and 128 ranks x 20k, other generator)
PART_CALLSITES = 2_000


def encode_trace_parts(
    meta: dict[str, Any],
    frames: list[Frame],
    callsites: Iterable[Any],
    extras: dict[str, Any] | None = None,
    frame_extras: dict[int, dict[str, Any]] | None = None,
    version: int = TRACE_VERSION,
    collectives: Collectives | None = None,
) -> Iterator[bytes]:
    """:func:`encode_trace` in parts, the callsites :data:`PART_CALLSITES` at a time
    (taken from ``callsites`` as they come), to write as they come: neither the
    document nor its callsites' objects need to be whole in memory."""
    head = {"format": TRACE_FORMAT, "version": version, "meta": meta, **(extras or {})}
    encoder = msgspec.json.Encoder()
    yield msgspec.json.Encoder(order="deterministic").encode(head)[:-1] + b',\n"frames":[\n'
    frame_extras = frame_extras or {}
    yield b",\n".join(
        encoder.encode({**_frame_dict(f), **frame_extras.get(i, {})}) for i, f in enumerate(frames)
    )
    yield b'\n],\n"callsites":[\n'
    encode, sites, first = encoder.encode, iter(callsites), True
    while part := list(islice(sites, PART_CALLSITES)):
        if not first:
            yield b",\n"
        yield b",\n".join(map(encode, part))
        first = False
    if collectives is None:
        yield b"\n]}\n"
    else:
        yield b'\n],\n"collectives":' + encode_collectives(collectives) + b"}\n"


def _frame_dict(frame: Frame) -> dict[str, Any]:
    return {
        "file": frame.file,
        "line": frame.line,
        "function": frame.function,
        "qualname": frame.qualname,
        "module": frame.module,
    }
