"""Overhead of the callsite tracer's backends, side by side, on four training loops.

Loops (``examples/loops.py``): the bundled tiny GPT, a transformers-style encoder in
plain torch, a conv net, and a model under activation checkpointing with a custom
``autograd.Function``. Modes, each in the same process and run:

* ``untraced``;
* ``profiler``: ``torch.profiler.profile(activities=[CPU], with_stack=True)``, the
  reference (including its stop, which collects the events; no export);
* ``empty-mode``: a ``TorchDispatchMode`` whose ``__torch_dispatch__`` only calls the op
  (torch's price for a Python mode, the floor of the ``modes`` backend);
* ``empty-modes``: an empty ``TorchFunctionMode`` above the empty dispatch mode (the
  two Python modes the ``modes`` backend pushes, doing nothing: its floor);
* ``opguard-modes``: ``trace_callsites(backend="modes")``, its per-operator path in C
  (``opguard_plugins/record/_recorder.c``) when built;
* ``opguard-modes-python``: the same on its Python path (as without the extension);
* ``opguard-profiler``: ``trace_callsites(backend="profiler")``;
* ``opguard-guard``: the runtime guard (``guarded()``, what ``opguard guard`` starts)
  enforcing a config made from a 4-step ``modes`` trace of the same loop (issue 29's
  goal: at most 1.3x the empty dispatch mode).

Every traced mode includes writing (or, for torch's profiler, collecting) its result.

Figures:

* **steady**: seconds per step over ``--steps`` steps after ``--warmup`` traced steps
  (the tracer already started), including the end of tracing (writing the trace, the
  profiler's collection), median over ``--repeat`` rounds;
* **cold**: the first step of a freshly built loop, from the tracer's start to its stop
  (per-tracer caches empty), median over ``--repeat`` rounds; the very first use of a
  mode in the process (torch's one-time set-up) is paid in an untimed round first;
* **write**: then writing that trace (build, encode, atomic write with fsync), once per
  traced process; not in the cold figure, as torch.profiler's export is not in its.

Rounds alternate between modes so that the machine's load drifts evenly over all of
them. Run: ``python benchmarks/trace_overhead.py [--steps 20] [--repeat 5]
[--loops tiny_gpt,hf_style,conv,checkpointed] [--modes ...] [--ddp]`` (``--ddp``
also times the whole ``torchrun --standalone --nproc-per-node 2 examples/train_ddp.py``
command (``--standalone``: a free port, so back-to-back runs do not collide),
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
from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))
sys.path.insert(0, str(REPO))

from loops import LOOPS  # noqa: E402

from opguard_plugins.record import tracer as tracer_module  # noqa: E402
from opguard_plugins.record.backends import make_tracer  # noqa: E402
from opguard_plugins.record.tracer import CallsiteRecorder  # noqa: E402

MODES = (
    "untraced",
    "profiler",
    "empty-mode",
    "empty-modes",
    "opguard-modes",
    "opguard-modes-python",
    "opguard-profiler",
    "opguard-guard",
)


class EmptyMode(TorchDispatchMode):  # type: ignore[misc]
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


class EmptyFunctionMode(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


@contextmanager
def empty_modes() -> Any:
    with EmptyFunctionMode(), EmptyMode():
        yield


class Traced:
    """An opguard tracer as a context manager that stops on exit; :meth:`finish` writes
    the trace (timed on its own in the cold rounds)."""

    def __init__(self, directory: str, backend: str, python_path: bool = False) -> None:
        self.tracer = make_tracer(backend, "bench", directory, rank=0)
        if python_path:  # the modes backend as without the C extension
            self.tracer.recorder = CallsiteRecorder(accelerated=False)

    def __enter__(self) -> Traced:
        self.tracer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.tracer.stop()

    def finish(self) -> None:
        self.tracer.write()


_CONFIGS: dict[str, Any] = {}


def loop_config(loop: str, directory: str) -> Any:
    """A config of ``loop``: traced 4 steps with the ``modes`` backend, then ``opguard
    run`` (made once per loop, loaded once; not timed)."""
    if loop not in _CONFIGS:
        from bench_config import config_of

        from opguard_core.formats.config import load_config

        folder = Path(directory) / f"config_{loop}"
        torch.manual_seed(0)
        step = LOOPS[loop]()
        step()
        traced = Traced(str(folder), "modes")
        with traced:
            for _ in range(4):
                step()
        traced.finish()
        _CONFIGS[loop] = load_config(config_of(folder / "bench_callsite_rank0.json", folder))
    return _CONFIGS[loop]


def wrapper(mode: str, directory: str, loop: str) -> Callable[[], AbstractContextManager[Any]]:
    if mode == "untraced":
        return nullcontext
    if mode == "profiler":
        return lambda: profile(activities=[ProfilerActivity.CPU], with_stack=True)
    if mode == "empty-mode":
        return EmptyMode
    if mode == "empty-modes":
        return empty_modes
    if mode == "opguard-modes":
        return lambda: Traced(directory, "modes")
    if mode == "opguard-modes-python":
        return lambda: Traced(directory, "modes", python_path=True)
    if mode == "opguard-profiler":
        return lambda: Traced(directory, "profiler")
    if mode == "opguard-guard":
        from opguard_plugins.enforce.runtime import guarded

        config = loop_config(loop, directory)
        reports = Path(directory) / "reports"
        return lambda: guarded(config, report_dir=reports, rank=0)
    raise ValueError(mode)


def finish(context: Any) -> float:
    """Seconds to write the trace of an opguard mode (0 for the others)."""
    if not isinstance(context, Traced):
        return 0.0
    start = time.perf_counter()
    context.finish()
    return time.perf_counter() - start


def steady_round(loop: str, wrap: Callable[[], Any], warmup: int, steps: int) -> float:
    torch.manual_seed(0)
    step = LOOPS[loop]()
    step()  # untraced warm-up: lazy initialisation of the model and the optimizer
    start = 0.0
    with wrap() as context:
        for _ in range(warmup):
            step()
        start = time.perf_counter()
        for _ in range(steps):
            step()
    finish(context)
    return (time.perf_counter() - start) / steps


def cold_round(loop: str, wrap: Callable[[], Any]) -> tuple[float, float]:
    """(first step incl. the tracer's start and stop, writing its trace) in seconds."""
    torch.manual_seed(0)
    step = LOOPS[loop]()
    start = time.perf_counter()
    with wrap() as context:
        step()
    cold = time.perf_counter() - start
    return cold, finish(context)


def run_command(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True)
    return time.perf_counter() - start


def ddp_rows(repeat: int, directory: str) -> list[tuple[str, float]]:
    """Median seconds of the whole 2-rank DDP example, untraced and per backend."""
    script = str(REPO / "examples" / "train_ddp.py")
    plain = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        script,
    ]
    rows = [("untraced", statistics.median(run_command(plain) for _ in range(repeat)))]
    for backend in ("modes", "profiler"):
        traced = [sys.executable, "-m", "opguard_core.cli.app", "trace", "--backend", backend]
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
    writes: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:  # torch's one-time set-up of each mechanism, untimed
            cold_round(loops[0], wrapper(mode, tmp, loops[0]))
        for _ in range(args.repeat):
            for loop in loops:
                for mode in modes:
                    wrap = wrapper(mode, tmp, loop)
                    steady.setdefault((loop, mode), []).append(
                        steady_round(loop, wrap, args.warmup, args.steps)
                    )
                    first, write = cold_round(loop, wrap)
                    cold.setdefault((loop, mode), []).append(first)
                    writes.setdefault((loop, mode), []).append(write)
        ddp = ddp_rows(args.repeat, tmp) if args.ddp else []
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"torch {torch.__version__}, Python {sys.version.split()[0]}, {os.cpu_count()} CPUs, "
        f"1 torch thread, load average {load:.1f}, {threading.active_count()} thread(s); "
        f"median of {args.repeat} rounds, steady = mean of {args.steps} steps; "
        f"C recorder {'built' if tracer_module._Counter is not None else 'NOT built'}"
    )
    print()
    reference = "empty-mode" if "empty-mode" in modes else None
    print(
        "| loop | mode | steady ms/step | steady vs untraced | vs empty mode "
        "| cold ms | cold vs untraced | vs empty mode | write ms |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for loop in loops:
        base_steady = statistics.median(steady[(loop, modes[0])])
        base_cold = statistics.median(cold[(loop, modes[0])])
        ref_steady = statistics.median(steady[(loop, reference)]) if reference else None
        ref_cold = statistics.median(cold[(loop, reference)]) if reference else None
        for mode in modes:
            s = statistics.median(steady[(loop, mode)])
            c = statistics.median(cold[(loop, mode)])
            w = statistics.median(writes[(loop, mode)])
            vs_s = f"{s / ref_steady:.2f}x" if ref_steady else "-"
            vs_c = f"{c / ref_cold:.2f}x" if ref_cold else "-"
            print(
                f"| {loop} | {mode} | {s * 1e3:.2f} | {s / base_steady:.2f}x | {vs_s} "
                f"| {c * 1e3:.1f} | {c / base_cold:.2f}x | {vs_c} "
                f"| {f'{w * 1e3:.1f}' if w else '-'} |"
            )
    if ddp:
        print()
        print("| DDP, 2 ranks, whole torchrun command | seconds | vs untraced |")
        print("|---|---:|---:|")
        for mode, seconds in ddp:
            print(f"| {mode} | {seconds:.2f} | {seconds / ddp[0][1]:.2f}x |")


if __name__ == "__main__":
    main()
