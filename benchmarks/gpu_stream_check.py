"""Issue 28's GPU check: one small CUDA program with two streams and a one-rank NCCL
group, traced by ``opguard trace`` and by torch.profiler (then imported by the Kineto
reader); do ops, streams and roles agree?

    python benchmarks/gpu_stream_check.py                # on a GPU machine (CUDA, NCCL)
    python benchmarks/gpu_stream_check.py --cpu          # the same plumbing on CPU (gloo)

The program (written to a temporary directory) runs three steps of: ``compute`` on the
default stream (``torch.mm``, ``torch.relu``), ``on_side`` on a second stream
(``x + 1``, ``torch.mul``), ``communicate`` (``dist.all_reduce``). The script traces it
with ``opguard trace`` (the default ``modes`` backend: it records streams) and profiles
it with ``torch.profiler`` (CPU and CUDA activities, ``with_stack=True``), imports the
profile, and prints, per (function, op): the count and the (raw stream, role) pairs
each side saw, and a verdict per question. Expected on a GPU: the same counts; roles
``compute`` in ``compute``, ``side1`` in ``on_side``, ``comm`` for the collective; raw
ids differing (the tracer's 0 and the side stream's id against CUPTI's 7 and its own
numbers). Exit status 0 when ops and roles agree. Nothing is written outside the
temporary directory (``--keep DIR`` keeps the traces there instead).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import msgspec

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from opguard_core.formats.trace import DecodedTrace, decode_trace, load_trace  # noqa: E402
from opguard_plugins.readers.kineto import read_kineto  # noqa: E402

PROGRAM = """
import contextlib
import sys

import torch
import torch.distributed as dist

CUDA = sys.argv[1] == "cuda"
DEVICE = "cuda" if CUDA else "cpu"


def compute(x):
    return torch.relu(torch.mm(x, x))


def on_side(x):
    return torch.mul(x + 1, 2)


def communicate(x):
    dist.all_reduce(x)
    return x


def run(steps=3):
    side = torch.cuda.Stream() if CUDA else None
    x = torch.ones(64, 64, device=DEVICE)
    for _ in range(steps):
        y = compute(x)
        with torch.cuda.stream(side) if CUDA else contextlib.nullcontext():
            z = on_side(x)
        if CUDA:
            torch.cuda.current_stream().wait_stream(side)
        communicate(y + z)
    if CUDA:
        torch.cuda.synchronize()


def main():
    store, profile = sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else ""
    backend = "nccl" if CUDA else "gloo"
    if CUDA:
        torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    if profile:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if CUDA:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities, with_stack=True) as prof:
            run()
        prof.export_chrome_trace(profile)
    else:
        run()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
"""

FUNCTIONS = ("compute", "on_side", "communicate")
Seen = dict[tuple[str, str], dict[str, Any]]


def per_function(trace: DecodedTrace) -> Seen:
    """(function of the program, op) -> count and the (raw stream, role) pairs."""
    seen: Seen = defaultdict(lambda: {"count": 0, "streams": set()})
    for site in trace.callsites:
        names = [trace.frames[i].function for i in site.stack]
        own = [n for n in names if n in FUNCTIONS]
        if not own:
            continue
        row = seen[(own[-1], site.op)]
        row["count"] += site.count
        row["streams"].add((site.stream, site.role))
    return dict(seen)


def run(command: list[str], cwd: Path) -> None:
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=600)
    if done.returncode:
        sys.exit(f"failed ({done.returncode}): {' '.join(command)}\n{done.stderr[-4000:]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="run on CPU with gloo (plumbing)")
    parser.add_argument("--keep", type=Path, help="keep the program and traces here")
    options = parser.parse_args()
    device = "cpu" if options.cpu else "cuda"
    with tempfile.TemporaryDirectory() as scratch:
        work = options.keep or Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        program = work / "streams_program.py"
        program.write_text(PROGRAM)
        profile = work / "streams.pt.trace.json"
        python = sys.executable
        run([python, str(program), device, str(work / "store1"), str(profile)], work)
        run([python, "-m", "opguard_core.cli.app", "trace", "--label", "streams",
             "--output-dir", str(work), "--", python, str(program), device,
             str(work / "store2")], work)  # fmt: skip
        traced = load_trace(work / "streams_callsite_rank0.json")
        imported = read_kineto(profile.read_bytes(), profile.name)
        kineto = decode_trace(msgspec.json.encode(imported), profile)
    ours, theirs = per_function(traced), per_function(kineto)
    print(f"device {device}; tracer meta.streams {traced.meta.get('streams')}; "
          f"kineto meta.streams {imported['meta']['streams']}")  # fmt: skip
    print(f"{'function':12} {'op':22} {'tracer':>7} {'kineto':>7}  tracer (stream, role) | kineto")
    ops_agree = roles_agree = True
    for key in sorted(set(ours) | set(theirs)):
        a, b = ours.get(key, {}), theirs.get(key, {})
        count_a, count_b = a.get("count", 0), b.get("count", 0)
        pairs_a, pairs_b = sorted(a.get("streams", ())), sorted(b.get("streams", ()))
        ops_agree &= count_a == count_b
        roles_agree &= {r for _, r in pairs_a} == {r for _, r in pairs_b} or not (a and b)
        print(f"{key[0]:12} {key[1]:22} {count_a:7} {count_b:7}  {pairs_a} | {pairs_b}")
    print(f"ops agree: {ops_agree}; roles agree (where both saw the op): {roles_agree}")
    return 0 if ops_agree and roles_agree else 1


if __name__ == "__main__":
    raise SystemExit(main())
