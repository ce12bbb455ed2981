"""Built-in plugin: the export formats ``collapsed``, ``speedscope`` and ``pprof``.

Each writer turns a list of :class:`~opguard_core.formats.stacks.Stack` into a file's bytes;
the op is the leaf frame of every stack. ``opguard export`` (``export.py``) asks
every plugin's ``opguard_export_formats`` for writers, so a plugin adds a format
the same way.
"""

from __future__ import annotations

import gzip
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgspec

from opguard_core import __version__, hookimpl
from opguard_core.errors import one_line
from opguard_core.formats.stacks import Stack

SPEEDSCOPE_SCHEMA = "https://www.speedscope.app/file-format-schema.json"


def _folded(stacks: list[Stack]) -> Counter[tuple[str, ...]]:
    """Counts per frame path with the op as the leaf (streams added together)."""
    counts: Counter[tuple[str, ...]] = Counter()
    for stack in stacks:
        counts[(*stack.frames, stack.op)] += stack.weight
    return counts


def write_collapsed(stacks: list[Stack]) -> bytes:
    """Brendan Gregg's folded stacks: ``frame;frame;op count``, one line per path.

    ``;`` and line breaks inside a name would break the format; they become ``_``.
    Other control characters (ESC, BEL, bidi overrides) are escaped
    (:func:`~opguard_core.errors.one_line`): folded files are read on terminals.
    """
    lines = [
        ";".join(_clean(name) for name in path) + f" {count}"
        for path, count in sorted(_folded(stacks).items())
    ]
    return ("\n".join(lines) + "\n").encode() if lines else b""


def _clean(name: str) -> str:
    return one_line(name.replace(";", "_").replace("\n", "_").replace("\r", "_"))


def write_speedscope(stacks: list[Stack]) -> bytes:
    """speedscope's file format: one sampled profile, weights are op counts."""
    index: dict[str, int] = {}
    samples: list[list[int]] = []
    weights: list[int] = []
    for path, count in sorted(_folded(stacks).items()):
        samples.append([index.setdefault(name, len(index)) for name in path])
        weights.append(count)
    doc = {
        "$schema": SPEEDSCOPE_SCHEMA,
        "name": "opguard ops",
        "exporter": f"opguard {__version__}",
        "activeProfileIndex": 0,
        "shared": {"frames": [{"name": name} for name in index]},
        "profiles": [
            {
                "type": "sampled",
                "name": "ops",
                "unit": "none",
                "startValue": 0,
                "endValue": sum(weights),
                "samples": samples,
                "weights": weights,
            }
        ],
    }
    return msgspec.json.encode(doc) + b"\n"


# --- pprof: profile.proto, hand-encoded (see docs/viewing.md for why) -------------


def _varint(value: int) -> bytes:
    """A protobuf varint; a negative int64 (a trace's line may be any int) as its 64-bit
    two's complement, ten bytes, as protobuf encodes it."""
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _int_field(number: int, value: int) -> bytes:
    return _varint(number << 3) + _varint(value)


def _bytes_field(number: int, data: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def _packed(number: int, values: list[int]) -> bytes:
    return _bytes_field(number, b"".join(_varint(v) for v in values))


def write_pprof(stacks: list[Stack]) -> bytes:
    """A gzipped ``profile.proto``: sample type ops/count, one sample per stack.

    A function per distinct frame name (``module:qualname``, or the op for the leaf)
    with its ``filename`` and ``start_line`` (the smallest line the tree recorded for
    it) and, as ``system_name``, the qualname: pprof shortens a name only when it
    equals its system name, and would cut ``train:<module>`` to ``train:``. A
    location per (function, line): a frame's line is its tree node's first line,
    so ``go tool pprof -list`` shows the counts in the source where the file is
    found. The op is the leaf frame (no file) and the stream role a label ``stream``.
    """
    strings: dict[str, int] = {"": 0}

    def string(text: str) -> int:
        return strings.setdefault(text, len(strings))

    ops_type = _int_field(1, string("ops")) + _int_field(2, string("count"))
    #: name -> [id, system name, file, start line]
    functions: dict[str, list[Any]] = {}
    locations: dict[tuple[int, int], int] = {}

    def location(name: str, system: str, file: str, line: int) -> int:
        function = functions.get(name)
        if function is None:
            function = functions[name] = [len(functions) + 1, system, file, line]
        elif line and (not function[3] or line < function[3]):
            function[3] = line
        if file and not function[2]:
            function[2] = file
        return locations.setdefault((function[0], line), len(locations) + 1)

    body = bytearray(_bytes_field(1, ops_type))
    stream_key = string("stream")
    for stack in stacks:
        sites = stack.sites or (("", 0),) * len(stack.frames)
        ids = [
            location(name, name.partition(":")[2] or name, *site)
            for name, site in zip(stack.frames, sites, strict=True)
        ]
        ids.append(location(stack.op, stack.op, "", 0))
        label = _int_field(1, stream_key) + _int_field(2, string(stack.stream))
        sample = (
            _packed(1, ids[::-1])  # leaf first
            + _packed(2, [stack.weight])
            + _bytes_field(3, label)
        )
        body += _bytes_field(2, sample)
    for (function_id, line), ident in locations.items():
        entry = _int_field(1, function_id) + (_int_field(2, line) if line else b"")
        body += _bytes_field(4, _int_field(1, ident) + _bytes_field(4, entry))
    for name, (ident, system, file, start) in functions.items():
        fields = _int_field(1, ident) + _int_field(2, string(name))
        fields += _int_field(3, string(system)) + _int_field(4, string(file))
        fields += _int_field(5, start) if start else b""
        body += _bytes_field(5, fields)
    period_type = _bytes_field(11, ops_type)
    for text in strings:
        body += _bytes_field(6, text.encode())
    body += period_type + _int_field(12, 1)
    return gzip.compress(bytes(body), mtime=0)


@hookimpl
def opguard_export_formats() -> dict[str, Callable[[list[Stack]], bytes]]:
    return {"collapsed": write_collapsed, "speedscope": write_speedscope, "pprof": write_pprof}
