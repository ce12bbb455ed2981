"""Overhead of the callsite tracer's backends, side by side, on four training loops.

Loops (``examples/loops.py``): the bundled tiny GPT, a transformers-style encoder in
plain torch, a conv net, and a model under activation checkpointing with a custom
``autograd.Function``. Modes, each in the same process and run:

* ``untraced``;
* ``profiler``: ``torch.profiler.profile(activities=[CPU], with_stack=True)``, the
  reference (including its stop, which collects the events; no export);
* ``empty-mode``: a ``TorchDispatchMode`` whose ``__torch_dispatch__`` only calls the op
  (torch's price for a Python mode, the floor of the ``modes`` backend);
* ``opguard-modes``: ``trace_callsites(backend="modes")``, raw stacks keyed by
  ``id(code)``;
* ``opguard-modes-codekey``: the same with raw stacks keyed by the code objects
  themselves, as before issue 15 (a benchmark-only variant, to measure the change);
* ``opguard-profiler``: ``trace_callsites(backend="profiler")``.

Every traced mode includes writing (or, for torch's profiler, collecting) its result.

Figures:

* **steady**: seconds per step over ``--steps`` steps after ``--warmup`` traced steps
  (the tracer already started), including the end of tracing (writing the trace, the
  profiler's collection), median over ``--repeat`` rounds;
* **cold**: the first step of a freshly built loop right after the tracer starts
  (per-tracer caches empty), median over ``--repeat`` rounds; the very first use of a
  mode in the process (torch's one-time set-up) is paid in an untimed round first.

Rounds alternate between modes so that the machine's load drifts evenly over all of
them. Run: ``python benchmarks/trace_overhead.py [--steps 20] [--repeat 5]
[--loops tiny_gpt,hf_style,conv,checkpointed] [--modes ...] [--ddp]`` (``--ddp``
also times the whole ``torchrun --nproc-per-node 2 examples/train_ddp.py`` command,
untraced and under ``opguard trace`` with each backend).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import types
from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))
sys.path.insert(0, str(REPO))

from loops import LOOPS  # noqa: E402

from opguard_plugins import tracer as tracer_module  # noqa: E402
from opguard_plugins.tracer import CallsiteRecorder, trace_callsites  # noqa: E402

MODES = (
    "untraced",
    "profiler",
    "empty-mode",
    "opguard-modes",
    "opguard-modes-codekey",
    "opguard-profiler",
)


class EmptyMode(TorchDispatchMode):  # type: ignore[misc]
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


class CodeKeyRecorder(CallsiteRecorder):
    """The previous recorder: raw stacks keyed by the code objects themselves (hashed)."""

    def __init__(self) -> None:
        super().__init__()
        self.code_counts: dict[Any, int] = {}

    def record(self, func: Any, frame: types.FrameType | None) -> None:
        if not self.active:
            return
        op = tracer_module.op_name(func)
        api = getattr(self._local, "api", None)
        stack: list[tuple[types.CodeType, int]] = []
        append = stack.append
        modules = self.modules
        while frame is not None and frame.f_code.co_filename in tracer_module._WRAPPER_FILES:
            frame = frame.f_back
        while frame is not None:
            code = frame.f_code
            if code not in modules:
                modules[code] = frame.f_globals.get("__name__")
            append((code, frame.f_lineno))
            frame = frame.f_back
        stack.reverse()
        full = (tuple(stack), api, op, 0)
        with self._lock:
            self.code_counts[full] = self.code_counts.get(full, 0) + 1

    def finish(self) -> None:
        """Turn code keys into the id keys :meth:`CallsiteTracer.build` reads."""
        for (stack, api, op, stream), count in self.code_counts.items():
            for code, _ in stack:
                self.codes[id(code)] = code
            key = (tuple((id(code), line) for code, line in stack), api, op, stream)
            self.counts[key] = self.counts.get(key, 0) + count


@contextmanager
def codekey_tracing(directory: str) -> Any:
    tracer = tracer_module.CallsiteTracer("bench", directory, rank=0)
    recorder = CodeKeyRecorder()
    tracer.recorder = recorder
    tracer.start()
    try:
        yield
    finally:
        tracer.stop()
        recorder.finish()
        tracer.write()


def wrapper(mode: str, directory: str) -> Callable[[], AbstractContextManager[Any]]:
    if mode == "untraced":
        return nullcontext
    if mode == "profiler":
        return lambda: profile(activities=[ProfilerActivity.CPU], with_stack=True)
    if mode == "empty-mode":
        return EmptyMode
    if mode == "opguard-modes":
        return lambda: trace_callsites("bench", directory, rank=0, backend="modes")
    if mode == "opguard-modes-codekey":
        return lambda: codekey_tracing(directory)
    if mode == "opguard-profiler":
        return lambda: trace_callsites("bench", directory, rank=0, backend="profiler")
    raise ValueError(mode)


def steady_round(loop: str, wrap: Callable[[], Any], warmup: int, steps: int) -> float:
    torch.manual_seed(0)
    step = LOOPS[loop]()
    step()  # untraced warm-up: lazy initialisation of the model and the optimizer
    with wrap():
        for _ in range(warmup):
            step()
        start = time.perf_counter()
        for _ in range(steps):
            step()
    return (time.perf_counter() - start) / steps


def cold_round(loop: str, wrap: Callable[[], Any]) -> float:
    torch.manual_seed(0)
    step = LOOPS[loop]()
    start = time.perf_counter()
    with wrap():
        step()
    return time.perf_counter() - start


def run_command(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True)
    return time.perf_counter() - start


def ddp_rows(repeat: int, directory: str) -> list[tuple[str, float]]:
    """Median seconds of the whole 2-rank DDP example, untraced and per backend."""
    script = str(REPO / "examples" / "train_ddp.py")
    plain = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", script]
    rows = [("untraced", statistics.median(run_command(plain) for _ in range(repeat)))]
    for backend in ("modes", "profiler"):
        traced = [sys.executable, "-m", "opguard_core.cli", "trace", "--backend", backend]
        traced += ["--label", "bench", "--output-dir", directory, "--", *plain]
        rows.append(
            (
                f"opguard trace --backend {backend}",
                statistics.median(run_command(traced) for _ in range(repeat)),
            )
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--loops", default=",".join(LOOPS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--ddp", action="store_true", help="also time the 2-rank DDP example")
    args = parser.parse_args()
    torch.set_num_threads(1)
    loops = [name for name in args.loops.split(",") if name]
    modes = [name for name in args.modes.split(",") if name]
    steady: dict[tuple[str, str], list[float]] = {}
    cold: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:  # torch's one-time set-up of each mechanism, untimed
            cold_round(loops[0], wrapper(mode, tmp))
        for _ in range(args.repeat):
            for loop in loops:
                for mode in modes:
                    wrap = wrapper(mode, tmp)
                    steady.setdefault((loop, mode), []).append(
                        steady_round(loop, wrap, args.warmup, args.steps)
                    )
                    cold.setdefault((loop, mode), []).append(cold_round(loop, wrap))
        ddp = ddp_rows(args.repeat, tmp) if args.ddp else []
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"torch {torch.__version__}, Python {sys.version.split()[0]}, {os.cpu_count()} CPUs, "
        f"1 torch thread, load average {load:.1f}, {threading.active_count()} thread(s); "
        f"median of {args.repeat} rounds, steady = median of {args.steps} steps"
    )
    print()
    print("| loop | mode | steady ms/step | steady vs untraced | cold ms | cold vs untraced |")
    print("|---|---|---:|---:|---:|---:|")
    for loop in loops:
        base_steady = statistics.median(steady[(loop, modes[0])])
        base_cold = statistics.median(cold[(loop, modes[0])])
        for mode in modes:
            s = statistics.median(steady[(loop, mode)])
            c = statistics.median(cold[(loop, mode)])
            print(
                f"| {loop} | {mode} | {s * 1e3:.2f} | {s / base_steady:.2f}x "
                f"| {c * 1e3:.1f} | {c / base_cold:.2f}x |"
            )
    if ddp:
        print()
        print("| DDP, 2 ranks, whole torchrun command | seconds | vs untraced |")
        print("|---|---:|---:|")
        for mode, seconds in ddp:
            print(f"| {mode} | {seconds:.2f} | {seconds / ddp[0][1]:.2f}x |")


if __name__ == "__main__":
    main()
