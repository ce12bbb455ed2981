"""Built-in reader: PyTorch Flight Recorder dumps as callsite traces with collective sequences.

Implements ``opguard_read_trace`` (docs/flight_recorder.md has the semantics and how
to record dumps; formats.md §1 and "Collective sequences" the document). A file is
taken by its content, whatever its name:

* a **pickle** (first bytes ``0x80`` and a protocol 2 to 5): what
  ``torch._C._distributed_c10d._dump_fr_trace()`` returns and NCCL's watchdog writes
  to ``TORCH_FR_DUMP_TEMP_FILE<rank>`` (``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``). It is
  **never unpickled as such**: :class:`PlainUnpickler` refuses every global (a class,
  a function: what makes unpickling run code), every persistent id and out-of-band
  buffer, so only plain data (dicts, lists, tuples, sets, strings, numbers) can come
  out; :func:`check_cost` then bounds what the fields read expand to (a pickle can
  repeat one object by reference, so a small file could otherwise stand for a huge
  tree);
* a **JSON dump** (``_dump_fr_trace_json()``): a JSON object naming a dump's own keys
  (``comm_lib_version``, ``pg_status``, ...) near its start, and none of Kineto's. It has no
  stacks (torch's JSON dump omits ``frames``).

One dump is one rank, and a dump does not say which: its rank is the number its file
name ends with (torch names dumps ``<prefix><rank>``; ``torchfrtrace`` reads them the
same way). Each entry is one collective as issued (``profiling_name`` such as
``gloo:all_reduce``, ``nccl:_allgather_base``, ``nccl:send 0->1``), in ``record_id``
order; it becomes

* a **signature** of the rank's collective sequence: ``op`` the c10d dispatcher op the
  Python call issues (``c10d::allreduce_``; :data:`OPS`), its process group
  (``process_group``: name and description; members from ``pg_config`` where the dump
  has them: NCCL's, not gloo's, whose ``pg_config`` is keyed by ``''``), ``dtype``
  (torch's name: ``Float`` → ``float32``), ``shapes`` and ``numel`` from
  ``input_sizes``, no ``reduce_op`` (a dump does not record it), and the stack from
  ``frames`` (innermost first in the dump, outermost first here);
* a **callsite** (stack, op, role ``comm``, no raw stream: ``-1``), counted; its
  ``dtype`` (formats.md, "Dtypes") is the entry's for the ops whose first argument is
  one tensor (:data:`TENSOR_FIRST`), none for the others, whose tensors come in a list.

A dump has no steps: every collective is in step 0. Its ring buffer keeps the last
``TORCH_FR_BUFFER_SIZE`` entries; when it has wrapped, the first collectives are
gone: a group's ``first`` (formats.md, "Collective sequences") is then its first
entry's ``collective_seq_id`` less one, so positions still count from the job's
start and ranks whose buffers wrapped at different points line up (as
``torchfrtrace`` pairs them); a warning says what was lost.
"""

from __future__ import annotations

import io
import math
import pickle
import re
from pathlib import Path
from typing import Any

import msgspec

from opguard_core import hookimpl
from opguard_core.combine.accumulator import gc_paused
from opguard_core.errors import InputError
from opguard_core.formats.collectives import (
    Collectives,
    CollectiveSequence,
    Group,
    Signature,
    StepRun,
    compared_by_position,
)
from opguard_core.formats.readers import is_opguard_document, without_bom
from opguard_core.formats.trace import TRACE_FORMAT, TRACE_VERSION, trace_stem
from opguard_core.run.warnings import warn
from opguard_plugins.readers.kineto import frame_key, module_of, relative_file

#: ``meta.importer``: this reader and the version of its rules
IMPORTER = "opguard-flight-recorder/1"
#: the raw stream of every collective (a dump names no stream)
NO_STREAM = -1
#: how far into a file a JSON dump's keys are looked for
HEAD = 65536
#: values a dump may expand to, per byte of the file, beyond :data:`BASE_VALUES`: a
#: real dump stays under one per byte (strings are shared by reference, containers
#: are not); a pickle that repeats a container by reference goes far past it
VALUES_PER_BYTE = 4
BASE_VALUES = 100_000

#: keys only a dump has (torch writes its keys sorted: ``comm_lib_version`` first)
_JSON_KEYS = (b'"comm_lib_version"', b'"pg_status"', b'"nccl_comm_state"')
#: Kineto's top-level keys: its ``distributedInfo`` has a ``pg_config`` too
_KINETO_KEYS = (b'"traceEvents"', b'"schemaVersion"', b'"deviceProperties"', b'"distributedInfo"')
_RANK_AT_END = re.compile(r"(\d+)$")
_RANKS = re.compile(r"-?\d+")

#: Flight Recorder's collective type (``profiling_name`` after the backend) → the c10d
#: dispatcher op the Python call issues, as OpGuard's tracer records it
OPS = {
    "all_reduce": "c10d::allreduce_",
    "allreduce_coalesced": "c10d::allreduce_coalesced_",
    "broadcast": "c10d::broadcast_",
    "_broadcast_oop": "c10d::broadcast_",
    "reduce": "c10d::reduce_",
    "_reduce_oop": "c10d::reduce_",
    "all_gather": "c10d::allgather_",
    "_all_gather_base": "c10d::_allgather_base_",
    "_allgather_base": "c10d::_allgather_base_",
    "all_gather_into_tensor_coalesced": "c10d::allgather_into_tensor_coalesced_",
    "ALLGATHER_coalesced": "c10d::allgather_coalesced_",
    "reduce_scatter": "c10d::reduce_scatter_",
    "_reduce_scatter_base": "c10d::_reduce_scatter_base_",
    "reduce_scatter_tensor_coalesced": "c10d::reduce_scatter_tensor_coalesced_",
    "REDUCE_SCATTER_coalesced": "c10d::reduce_scatter_tensor_coalesced_",
    "gather": "c10d::gather_",
    "scatter": "c10d::scatter_",
    "all_to_all": "c10d::alltoall_",
    "all_to_all_single": "c10d::alltoall_base_",
    "alltoall_base": "c10d::alltoall_base_",
    "barrier": "c10d::barrier",
    "all_reduce_barrier": "c10d::barrier",
    "send": "c10d::send",
    "recv": "c10d::recv_",
}

#: the ops of :data:`OPS` whose first argument is one tensor (torch 2.13's schemas; the
#: others take lists, ``barrier`` a placeholder the dump does not describe): a callsite's
#: dtype, which the tracer reads from that tensor (the output, of the input's dtype)
TENSOR_FIRST = frozenset(
    {"c10d::_allgather_base_", "c10d::_reduce_scatter_base_", "c10d::alltoall_base_"}
)

#: c10 ScalarType names (what a dump's ``input_dtypes`` hold) → torch's dtype names
DTYPES = {
    "Byte": "uint8",
    "Char": "int8",
    "Short": "int16",
    "Int": "int32",
    "Long": "int64",
    "Half": "float16",
    "Float": "float32",
    "Double": "float64",
    "ComplexHalf": "complex32",
    "ComplexFloat": "complex64",
    "ComplexDouble": "complex128",
    "Bool": "bool",
    "BFloat16": "bfloat16",
    "UInt16": "uint16",
    "UInt32": "uint32",
    "UInt64": "uint64",
}


class FlightRecorderError(ValueError):
    """A Flight Recorder dump that cannot be read (the message names the problem)."""


# ---------------------------------------------------------------------------
# content detection
# ---------------------------------------------------------------------------


def looks_like_pickle(data: bytes) -> bool:
    """Whether ``data`` starts like a pickle of protocol 2 to 5 (torch's dumps: 2)."""
    return len(data) >= 2 and data[0] == 0x80 and 2 <= data[1] <= 5


def looks_like_json_dump(data: bytes) -> bool:
    """Whether ``data`` looks like ``_dump_fr_trace_json()``'s output: a JSON object
    naming one of a dump's own keys in its first :data:`HEAD` bytes, and none of
    Kineto's."""
    text = without_bom(data[:HEAD]).lstrip(b" \t\r\n")
    if not text.startswith(b"{") or is_opguard_document(text):
        return False
    if any(key in text for key in _KINETO_KEYS):
        return False
    return any(key in text for key in _JSON_KEYS) or (
        b'"entries"' in text and b'"profiling_name"' in text
    )


# ---------------------------------------------------------------------------
# loading: plain data only
# ---------------------------------------------------------------------------


class Refused(pickle.UnpicklingError):
    """What :class:`PlainUnpickler` raises for a global or a persistent id."""


class PlainUnpickler(pickle.Unpickler):
    """An unpickler that builds plain data only: it refuses every global (so no
    class is instantiated and no function called) and every persistent id."""

    def find_class(self, module: str, name: str) -> Any:
        raise Refused(
            f"refuses the global {module}.{name} (a dump holds plain data only; "
            "it is never unpickled as code)"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise Refused("refuses a persistent id (a dump holds plain data only)")


def load_pickle(data: bytes) -> Any:
    """The plain data a pickle holds; :class:`FlightRecorderError` for anything else."""
    try:
        value = PlainUnpickler(io.BytesIO(data)).load()
    except Refused as exc:
        raise FlightRecorderError(f"not a plain-data pickle: {exc}") from None
    except EOFError:
        raise FlightRecorderError("truncated pickle (ran out of data)") from None
    except MemoryError:
        raise FlightRecorderError("pickle declares more data than memory holds") from None
    except Exception as exc:  # the C unpickler reports bad opcodes as many types
        raise FlightRecorderError(
            f"not a readable pickle: {type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
        ) from None
    return value


def check_cost(value: dict[Any, Any], budget: int) -> None:
    """Refuse a dump whose fields that are read hold more than ``budget`` values when a
    value shared by reference is counted each time it is referenced: what converting
    them costs. A pickle can reference one object many times for two bytes each, so a
    small file could otherwise stand for an entries list of a million entries each with
    a million frames. Only the fields read count (the rest is never walked), and it
    stops as soon as the budget is spent."""
    cost = 0

    def spent() -> FlightRecorderError:
        return FlightRecorderError(
            f"expands to more than {budget} values (a pickle that repeats objects "
            "by reference, far beyond what a dump holds)"
        )

    entries = value.get("entries")
    if isinstance(entries, list | tuple):
        cost += len(entries)
        for entry in entries:
            if not isinstance(entry, dict):
                continue
            cost += len(entry)
            for key in _LISTS:
                field = entry.get(key)
                if isinstance(field, list | tuple):
                    cost += len(field)
                    for item in field:
                        if isinstance(item, dict | list | tuple):
                            cost += len(item)
            if cost > budget:
                raise spent()
    config = value.get("pg_config")
    if isinstance(config, dict):
        cost += len(config)
        for group in config.values():
            if isinstance(group, dict):
                cost += len(group)
                ranks = group.get("ranks")
                if isinstance(ranks, list | tuple):
                    cost += len(ranks)
    if cost > budget:
        raise spent()


#: an entry's fields that hold containers
_LISTS = ("frames", "input_sizes", "input_dtypes", "process_group")


# ---------------------------------------------------------------------------
# the dump's fields that are read (the rest is skipped)
# ---------------------------------------------------------------------------


class _Frame(msgspec.Struct, gc=False):
    filename: str = ""
    line: int = 0
    name: str = ""


class _Entry(msgspec.Struct, gc=False):
    profiling_name: str
    process_group: tuple[str, str]
    record_id: int = 0
    collective_seq_id: int = 0
    p2p_seq_id: int = 0
    is_p2p: bool = False
    input_sizes: list[list[int]] = []
    input_dtypes: list[str] = []
    frames: list[_Frame] = []
    state: str = ""


class _PgConfig(msgspec.Struct, gc=False):
    name: str = ""
    desc: str = ""
    ranks: str | list[int] = ""


class _Dump(msgspec.Struct, gc=False):
    version: str
    entries: list[_Entry] = []
    pg_config: dict[str, _PgConfig] = {}


_JSON_DECODER = msgspec.json.Decoder(_Dump)


_TOO_DEEP = "invalid dump: nesting too deep"


def _problem(exc: Exception) -> str:
    return " ".join(str(exc).split())[:300]


def decode_dump(data: bytes) -> _Dump:
    """The dump's fields, from a pickle (plain data only) or a JSON dump."""
    if looks_like_pickle(data):
        value = load_pickle(data)
        if not isinstance(value, dict) or ("entries" not in value and "version" not in value):
            raise FlightRecorderError(
                "a pickle that is not a Flight Recorder dump (no 'version' or 'entries')"
            )
        check_cost(value, VALUES_PER_BYTE * len(data) + BASE_VALUES)
        try:
            return msgspec.convert(value, _Dump)
        except msgspec.ValidationError as exc:
            raise FlightRecorderError(f"invalid dump: {_problem(exc)}") from None
        except RecursionError:
            raise FlightRecorderError(_TOO_DEEP) from None
    try:
        return _JSON_DECODER.decode(without_bom(data))
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise FlightRecorderError(f"invalid dump: {_problem(exc)}") from None
    except RecursionError:  # msgspec's own bound on nesting (a dump nests 5 levels)
        raise FlightRecorderError(_TOO_DEEP) from None


# ---------------------------------------------------------------------------
# the trace document
# ---------------------------------------------------------------------------


def rank_of(path: Path) -> int:
    """The rank a dump's file name ends with (``nccl_trace_rank_3`` → 3), before a
    trace suffix (``rank_3.json``) or at the very end (``dump.3``, ``trace.rank_3``)."""
    match = _RANK_AT_END.search(trace_stem(path)) or _RANK_AT_END.search(Path(path).name)
    if match is None:
        raise FlightRecorderError(
            "cannot tell the rank: a Flight Recorder dump's file name ends with its rank "
            "(torch writes <prefix><rank>, e.g. nccl_trace_rank_0)"
        )
    return int(match.group(1))


def split_name(profiling_name: str) -> tuple[str, str, str]:
    """(backend, collective type, rest) of ``nccl:send 0->1``; no backend → ''."""
    backend, _, name = profiling_name.rpartition(":")
    kind, _, rest = name.partition(" ")
    return backend, kind, rest


#: the op of a point-to-point entry whose type names none (``nccl:coalesced``, which
#: ends a ``batch_isend_irecv``): not compared by position (:func:`compared_by_position`)
P2P_BATCH_OP = "c10d::batch_p2p_ops"


def op_of(kind: str) -> str:
    """The c10d op of a Flight Recorder collective type (:data:`OPS`; else ``c10d::kind``)."""
    return OPS.get(kind) or f"c10d::{kind}"


def _group_ranks(config: _PgConfig | None) -> tuple[int, ...]:
    if config is None:
        return ()
    if isinstance(config.ranks, list):
        return tuple(config.ranks)
    return tuple(int(r) for r in _RANKS.findall(config.ranks))


def read_dump(data: bytes, path: Path) -> tuple[dict[str, Any], list[str]]:
    """A dump as an ``opguard-callsites`` document (one rank), and the warnings."""
    rank = rank_of(path)
    with gc_paused():  # many small acyclic containers: no collection could free any
        dump = decode_dump(data)
    entries = sorted(dump.entries, key=lambda e: e.record_id)
    warnings: list[str] = []

    frame_ids: dict[tuple[str, int, str], int] = {}
    raw_ids: dict[tuple[str, int, str], int] = {}
    raw_signatures: dict[tuple[Any, ...], int] = {}
    groups: dict[tuple[str, str], int] = {}
    group_list: list[Group] = []
    signatures: dict[Signature, int] = {}
    calls: list[int] = []
    counts: dict[tuple[tuple[int, ...], str, str | None], int] = {}
    backends: set[str] = set()
    first_seq: dict[str, int] = {}
    with_frames = 0
    for entry in entries:
        backend, kind, _ = split_name(entry.profiling_name)
        if backend:
            backends.add(backend)
        op = op_of(kind)
        if entry.is_p2p and compared_by_position(op):  # ``nccl:coalesced`` of a batch
            op = P2P_BATCH_OP  # of sends and recvs (batch_isend_irecv): point-to-point
        name, desc = entry.process_group
        group = groups.get((name, desc))
        if group is None:
            ranks = _group_ranks(dump.pg_config.get(name))
            bad = next((r for r in ranks if r < 0), None)
            if bad is not None:
                raise FlightRecorderError(f"pg_config[{name!r}] has a negative rank ({bad})")
            group = groups[(name, desc)] = len(group_list)
            group_list.append(
                Group(name=name, desc=desc or None, size=len(ranks) or None, ranks=ranks)
            )
        if not entry.is_p2p and entry.collective_seq_id > 0:
            first_seq.setdefault(name, entry.collective_seq_id)
        stack: list[int] = []
        for frame in reversed(entry.frames):
            raw = (frame.filename, frame.line, frame.name)
            fid = raw_ids.get(raw)
            if fid is None:
                key = (relative_file(frame.filename), frame.line, frame.name)
                fid = frame_ids.get(key)
                if fid is None:
                    fid = frame_ids[key] = len(frame_ids)
                raw_ids[raw] = fid
            stack.append(fid)
        if entry.frames:
            with_frames += 1
        dtype = entry.input_dtypes[0] if entry.input_dtypes else None
        raw_signature = (op, group, dtype, tuple(map(tuple, entry.input_sizes)), tuple(stack))
        sid = raw_signatures.get(raw_signature)
        if sid is None:
            shapes = raw_signature[3]
            if any(d < 0 for shape in shapes for d in shape):
                raise FlightRecorderError(
                    f"entry {entry.record_id} has a negative size in input_sizes "
                    f"{entry.input_sizes}"
                )
            signature = Signature(
                op=op,
                group=group,
                dtype=DTYPES.get(dtype, dtype) if dtype is not None else None,
                numel=sum(math.prod(shape) for shape in shapes) if shapes else None,
                shapes=shapes or None,
                reduce_op=None,
                stack=raw_signature[4],
            )
            sid = signatures.get(signature)
            if sid is None:
                sid = signatures[signature] = len(signatures)
            raw_signatures[raw_signature] = sid
        calls.append(sid)
        site = (tuple(stack), op, DTYPES.get(dtype or "") if op in TENSOR_FIRST else None)
        counts[site] = counts.get(site, 0) + 1

    wrapped = sorted(name for name, seq in first_seq.items() if seq > 1)
    if entries and (entries[0].record_id > 0 or wrapped):
        warnings.append(
            f"{path}: the Flight Recorder ring buffer wrapped (the dump starts at record "
            f"{entries[0].record_id}"
            + (f", group(s) {', '.join(wrapped)} past their first collective" if wrapped else "")
            + "): collectives before it are compared only where other ranks' dumps kept "
            "them; raise TORCH_FR_BUFFER_SIZE (docs/flight_recorder.md)"
        )
    group_list = [
        msgspec.structs.replace(group, first=first_seq.get(group.name, 1) - 1)
        for group in group_list
    ]

    # frames in canonical order (formats.md §1): sorted by value
    values = {fid: _frame(*key) for key, fid in frame_ids.items()}
    order = sorted(values, key=lambda fid: frame_key(values[fid]))
    new_id = {fid: i for i, fid in enumerate(order)}
    frames = [values[fid] for fid in order]

    def remap(stack: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(new_id[f] for f in stack)

    callsites = [
        {
            "stack": list(stack),
            "op": op,
            "stream": NO_STREAM,
            "role": "comm",
            **({"dtype": dtype} if dtype else {}),
            "count": n,
        }
        for stack, op, dtype, n in sorted(
            (remap(s), op, dtype or "", n) for (s, op, dtype), n in counts.items()
        )
    ]
    sequence = CollectiveSequence(
        ranks=[rank],
        groups=group_list,
        signatures=[
            msgspec.structs.replace(sig, stack=remap(sig.stack))
            for sig, _ in sorted(signatures.items(), key=lambda item: item[1])
        ],
        steps=[StepRun(0, 0, tuple(calls))] if calls else [],
    )
    meta: dict[str, Any] = {
        "source_format": "flight_recorder",
        "importer": IMPORTER,
        "source": path.name,
        "rank": rank,
        "ranks": [rank],
        "flight_recorder_version": dump.version,
        "entries": len(entries),
        "stack_source": "frames" if with_frames else "none",
        "streams": {str(NO_STREAM): "comm"},
    }
    if len(backends) == 1:
        meta["backend"] = next(iter(backends))
    default = next((g for g in group_list if g.name == "0"), None)
    if default is not None and default.size is not None:
        meta["world_size"] = default.size
    pending = [e.record_id for e in entries if e.state and e.state != "completed"]
    if pending and any(e.state == "completed" for e in entries):
        meta["not_completed"] = len(pending)
    document = {
        "format": TRACE_FORMAT,
        "version": TRACE_VERSION,
        "meta": meta,
        "frames": frames,
        "callsites": callsites,
        "collectives": msgspec.to_builtins(Collectives(sequences=[sequence])),
    }
    for group in document["collectives"]["sequences"][0]["groups"]:
        if not group["first"]:
            del group["first"]  # as the format writes it
    return document, warnings


def _frame(file: str, line: int, function: str) -> dict[str, Any]:
    frame: dict[str, Any] = {"file": file, "line": line, "function": function, "qualname": function}
    module = module_of(file)
    if module is not None:
        frame["module"] = module
    return frame


@hookimpl
def opguard_read_trace(path: Path, data: bytes) -> dict[str, Any] | None:
    if not (looks_like_pickle(data) or looks_like_json_dump(data)):
        return None
    try:
        document, warnings = read_dump(data, path)
    except FlightRecorderError as error:
        raise InputError(path, f"Flight Recorder dump: {error}") from None
    for message in warnings:
        warn(message, file=str(path))
    return document
