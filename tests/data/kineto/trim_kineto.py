"""Cut a Kineto trace to one profiler step (or a time span), keeping it consistent.

    python tests/data/kineto/trim_kineto.py SRC OUT.json.gz --step 16
    python trim_kineto.py SRC OUT.json.gz --start-ms 0 --ms 5

What is kept, for a window [t0, t1) (the CPU-side ``ProfilerStep#N`` event's span,
or ``--start-ms``/``--ms`` after the first CPU event):

* CPU-side complete events (``python_function``, ``cpu_op``/``Operator``,
  ``user_annotation``, runtime/driver launches) that overlap the window, so every
  kept event keeps the frames and ops that enclose it;
* device events (kernel, memcpy, memset) launched by a kept runtime event, plus those
  in the window whose launch is not in the source trace at all (queued before the
  profiler started: they keep the importer's ``device_events_without_launch`` honest);
* flow events whose id is a kept correlation (``ac2g``, ``async``), ``fwdbwd`` flows in
  the window, process/thread metadata (``ph: M``), the ``Trace`` span set to the window;
* args reduced to the keys a reader needs (:data:`KEEP_ARGS`): shapes, strides,
  concrete inputs and occupancy figures go (most of a trace's bytes); with
  ``--comm-args``, the events that describe a collective (``c10d::*`` and
  ``_c10d_functional::*`` ops, ``record_param_comms``, ``nccl:*`` annotations) keep
  all their args (their input shapes and types give the collective sequence);
  with ``--types``, every event keeps its ``Input type`` too (the ops' dtypes,
  formats.md "Dtypes");
* with ``--comm-only``, only those events, ``ProfilerStep#N`` and ``Optimizer.step#``
  labels and the metadata (a small excerpt of a long trace's collectives).

Written compact and gzip'd with mtime 0, so the same input gives the same bytes.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from pathlib import Path
from typing import Any

CPU_CATS = {
    "python_function",
    "cpu_op",
    "Operator",
    "user_annotation",
    "cuda_runtime",
    "cuda_driver",
    "Runtime",
    "Driver",
}
RUNTIME_CATS = {"cuda_runtime", "cuda_driver", "Runtime", "Driver"}
DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset", "Kernel", "Memcpy", "Memset"}
KEEP_ARGS = {
    "External id",
    "external id",
    "correlation",
    "stream",
    "device",
    "context",
    "cbid",
    "Python id",
    "Python parent id",
    "Python module id",
    "Call stack",
    "Fwd thread id",
    "Sequence number",
    "Record function id",
    "Collective name",
    "Process Group Name",
    "Process Group Description",
    "Group size",
    "dtype",
    "In msg nelems",
    "Out msg nelems",
    "kind",
    "bytes",
    "name",
    "labels",
    "sort_index",
    "Op count",
}
STEP = re.compile(r"^ProfilerStep#(\d+)$")
COMM_OPS = ("c10d::", "_c10d_functional::", "c10d_functional::")


def is_comm(event: dict[str, Any]) -> bool:
    """Whether an event describes a collective (its args give the sequence)."""
    name = str(event.get("name", ""))
    cat = event.get("cat")
    if cat in ("cpu_op", "Operator"):
        return name.startswith(COMM_OPS) or name == "record_param_comms"
    return cat == "user_annotation" and name.startswith("nccl:")


def keeps_comm_only(event: dict[str, Any]) -> bool:
    name = str(event.get("name", ""))
    return is_comm(event) or bool(STEP.match(name)) or name.startswith("Optimizer.step#")


def load(path: Path) -> dict[str, Any]:
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    data: dict[str, Any] = json.loads(raw)
    return data


def window(
    events: list[dict[str, Any]], step: int | None, start_ms: float, span_ms: float
) -> tuple[float, float]:
    if step is not None:
        for event in events:
            match = STEP.match(str(event.get("name", "")))
            if match and int(match.group(1)) == step and event.get("cat") in CPU_CATS | {"cpu_op"}:
                return float(event["ts"]), float(event["ts"]) + float(event["dur"])
        raise SystemExit(f"no ProfilerStep#{step} in the trace")
    first = min(float(e["ts"]) for e in events if e.get("ph") == "X" and e.get("cat") in CPU_CATS)
    t0 = first + start_ms * 1000
    return t0, t0 + span_ms * 1000


def slim(event: dict[str, Any], comm_args: bool = False, types: bool = False) -> dict[str, Any]:
    args = event.get("args")
    if comm_args and is_comm(event):
        return event
    if isinstance(args, dict):
        event = dict(event)
        event["args"] = {
            k: v for k, v in args.items() if k in KEEP_ARGS or (types and k == "Input type")
        }
    return event


def trim(
    data: dict[str, Any],
    t0: float,
    t1: float,
    comm_args: bool = False,
    comm_only: bool = False,
    types: bool = False,
) -> dict[str, Any]:
    events: list[dict[str, Any]] = data["traceEvents"]
    all_correlations = {
        e["args"]["correlation"]
        for e in events
        if e.get("cat") in RUNTIME_CATS and "correlation" in e.get("args", {})
    }
    kept_correlations: set[Any] = set()
    out: list[dict[str, Any]] = []
    for event in events:
        if event.get("ph") == "X" and event.get("cat") in CPU_CATS:
            ts, end = float(event["ts"]), float(event["ts"]) + float(event.get("dur", 0))
            if comm_only and not keeps_comm_only(event):
                continue
            if ts < t1 and end > t0:
                out.append(slim(event, comm_args or comm_only, types))
                if event["cat"] in RUNTIME_CATS:
                    kept_correlations.add(event.get("args", {}).get("correlation"))
    for event in events:
        ph, cat = event.get("ph"), event.get("cat")
        if comm_only and ph != "M":
            continue
        if ph == "X" and cat in DEVICE_CATS:
            correlation = event.get("args", {}).get("correlation")
            if correlation in kept_correlations or (
                correlation not in all_correlations and t0 <= float(event["ts"]) < t1
            ):
                out.append(slim(event))
        elif ph in ("s", "f") and cat in ("ac2g", "async"):
            if event.get("id") in kept_correlations:
                out.append(event)
        elif ph in ("s", "f") and cat == "fwdbwd":
            if t0 <= float(event["ts"]) < t1:
                out.append(event)
        elif ph == "M":
            out.append(event)
        elif cat == "Trace":
            trace = dict(event)
            trace["ts"], trace["dur"] = t0, t1 - t0
            out.append(trace)
    result = {k: v for k, v in data.items() if k != "traceEvents"}
    result["traceEvents"] = out
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--step", type=int)
    parser.add_argument("--start-ms", type=float, default=0.0)
    parser.add_argument("--ms", type=float, default=5.0)
    parser.add_argument("--comm-args", action="store_true", help="keep collectives' args")
    parser.add_argument("--comm-only", action="store_true", help="only collectives and steps")
    parser.add_argument("--types", action="store_true", help="keep the ops' Input type")
    options = parser.parse_args()
    data = load(options.source)
    t0, t1 = window(data["traceEvents"], options.step, options.start_ms, options.ms)
    trimmed = trim(data, t0, t1, options.comm_args, options.comm_only, options.types)
    text = json.dumps(trimmed, separators=(",", ":")).encode()
    options.out.parent.mkdir(parents=True, exist_ok=True)
    with (
        options.out.open("wb") as handle,
        gzip.GzipFile(filename="", mode="wb", fileobj=handle, mtime=0, compresslevel=9) as gz,
    ):
        gz.write(text)
    print(
        f"{options.out}: {len(trimmed['traceEvents'])} events, {len(text)} bytes, "
        f"{options.out.stat().st_size} gzip'd"
    )


if __name__ == "__main__":
    main()
