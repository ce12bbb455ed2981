"""Kineto import speed and memory, side by side with a GC-off msgspec parse of the same file.

    python benchmarks/kineto_import.py                 # the real traces in /work/shared/kineto
    python benchmarks/kineto_import.py --repeat 11 FILE ...  # any traces (.json, .json.gz)
    python benchmarks/kineto_import.py --fixtures      # the trimmed ones in tests/data/kineto

Per file (decompressed first, as the pipeline's ``read_bytes`` does; the DLRM tar's
ranks 0 and 1 by default): its size; **parse**, a generic ``msgspec.json.decode`` to
Python objects with the garbage collector off (the yardstick of issue 28: the import
must take at most twice as long); **import**, ``read_kineto`` (the reader plugin's
work, which pauses the collector itself), and **read**, the whole
``opguard_read_trace`` path a combine takes (the reader, then the validation of its
document as a trace file); the ratio of the best import to the best parse and the
median ratio of back-to-back pairs (both halves see the same machine load); and the
peak Python memory (tracemalloc) of one import and of one parse, and the import's
over the file's size. Times are process CPU time (``--clock wall`` for the wall
clock), best of ``--repeat`` (small files three times as many).
"""

from __future__ import annotations

import argparse
import gc
import gzip
import statistics
import sys
import tarfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from opguard_core.formats.readers import Readers  # noqa: E402
from opguard_plugins.readers import kineto  # noqa: E402
from opguard_plugins.readers.kineto import read_kineto  # noqa: E402

SHARED = Path("/work/shared/kineto")
FIXTURES = REPO / "tests" / "data" / "kineto"
#: files below this size (bytes) are left out of the verdict: fixed costs dominate them
SMALL = 100_000


def unpacked(raw: bytes) -> bytes:
    return gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw


def shared_inputs() -> list[tuple[str, bytes]]:
    """The real traces: the DLRM job's ranks 0 and 1, and every other trace there."""
    out: list[tuple[str, bytes]] = []
    with tarfile.open(SHARED / "param_dlrm_kineto_8ranks.tar.gz") as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            if member.isfile() and ("worker0_" in member.name or "worker1_" in member.name):
                handle = tar.extractfile(member)
                assert handle is not None
                out.append((Path(member.name).name, handle.read()))
    out += [(p.name, unpacked(p.read_bytes())) for p in sorted(SHARED.glob("*.json*"))]
    return out


def timed(fn: Callable[[], Any], gc_off: bool, clock: Callable[[], float]) -> float:
    enabled = gc.isenabled()
    if gc_off:
        gc.disable()
    start = clock()
    result = fn()
    elapsed = clock() - start
    if enabled:
        gc.enable()
    del result
    return elapsed


def peak(fn: Callable[[], Any]) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def measure(name: str, data: bytes, repeat: int, clock: Callable[[], float]) -> dict[str, Any]:
    readers = Readers()
    path = Path(name)

    def parse() -> Any:
        return msgspec.json.decode(data)

    def load() -> Any:
        return read_kineto(data, name)

    def read() -> Any:
        return readers.read(path, data)

    parses, imports, reads, ratios = [], [], [], []
    for _ in range(repeat):
        p = timed(parse, True, clock)
        i = timed(load, False, clock)
        parses.append(p)
        imports.append(i)
        ratios.append(i / p)
        reads.append(timed(read, False, clock))
    size = len(data)
    import_peak = peak(load)
    return {
        "file": name[-44:],
        "MB": size / 1e6,
        "parse ms": min(parses) * 1e3,
        "import ms": min(imports) * 1e3,
        "read ms": min(reads) * 1e3,
        "ratio": min(imports) / min(parses),
        "median": statistics.median(ratios),
        "import peak MB": import_peak / 1e6,
        "parse peak MB": peak(parse) / 1e6,
        "peak/size": import_peak / size,
    }


COLUMNS = (
    ("file", "{:44}", 44),
    ("MB", "{:6.1f}", 6),
    ("parse ms", "{:9.2f}", 9),
    ("import ms", "{:9.2f}", 9),
    ("read ms", "{:9.2f}", 9),
    ("ratio", "{:6.2f}", 6),
    ("median", "{:6.2f}", 6),
    ("import peak MB", "{:14.1f}", 14),
    ("parse peak MB", "{:13.1f}", 13),
    ("peak/size", "{:9.2f}", 9),
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    parser.add_argument("--fixtures", action="store_true", help="the traces in tests/data/kineto")
    parser.add_argument("files", nargs="*", type=Path)
    options = parser.parse_args()
    clock = time.process_time if options.clock == "cpu" else time.perf_counter
    # the reader warns about the window's cuts on every read: not what is measured here
    vars(kineto)["warn"] = lambda message, **fields: None
    if options.files:
        inputs = [(str(p), unpacked(p.read_bytes())) for p in options.files]
    elif options.fixtures:
        inputs = [(p.name, unpacked(p.read_bytes())) for p in sorted(FIXTURES.glob("*.json*"))]
    elif SHARED.is_dir():
        inputs = shared_inputs()
    else:
        print(f"no inputs: {SHARED} is absent; give files or --fixtures", file=sys.stderr)
        return 2
    print(" ".join(f"{name:>{width}}" if name != "file" else f"{name:{width}}"
                   for name, _, width in COLUMNS))  # fmt: skip
    worst = 0.0
    for name, data in inputs:
        repeat = options.repeat if len(data) > 4e6 else options.repeat * 3
        row = measure(name, data, repeat, clock)
        if len(data) >= SMALL:
            worst = max(worst, row["median"])
        cells = [
            fmt.format(row[key][:44] if key == "file" else row[key]) for key, fmt, _ in COLUMNS
        ]
        print(" ".join(cells))
    print(
        f"worst median import/parse ratio, files of {SMALL // 1000} kB or more: {worst:.2f} "
        "(issue 28's bound: 2; smaller files take the import's fixed ~40 µs)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
