"""Overhead of the callsite tracer on the example workloads.

Single process (in-process, after one warm-up step, median of ``--repeat`` runs of
``--steps`` training steps of ``examples/tiny_gpt.py``):

* untraced;
* ``opguard_plugins.tracer.trace_callsites`` (including writing the trace), once cold
  (the first use in a process pays torch's one-time set-up of its mode machinery) and
  then warm;
* ``torch.profiler.profile(with_stack=True)`` (including the profiler's stop, which
  collects the events; no export).

With ``--ddp``, also the whole ``torchrun --nproc-per-node 2 examples/train_ddp.py``
command, untraced vs under ``opguard trace`` (process start-up included).

Run: ``python benchmarks/trace_overhead.py [--steps 10] [--repeat 3] [--ddp]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))
sys.path.insert(0, str(REPO))

from tiny_gpt import GPTConfig, TinyGPT, make_batch, train_step  # noqa: E402

from opguard_plugins.tracer import trace_callsites  # noqa: E402


def run_steps(steps: int, wrap: Callable[[], AbstractContextManager[object]]) -> float:
    """Seconds for ``steps`` training steps (after one untimed warm-up) inside ``wrap()``."""
    torch.manual_seed(0)
    config = GPTConfig()
    model = TinyGPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_step(model, optimizer, *make_batch(0, config))
    start = time.perf_counter()
    with wrap():
        for step in range(steps):
            train_step(model, optimizer, *make_batch(step, config))
    return time.perf_counter() - start


@contextmanager
def opguard_tracing(directory: str) -> Iterator[None]:
    with trace_callsites(label="bench", output_dir=directory):
        yield


def torch_profiling() -> AbstractContextManager[object]:
    return profile(activities=[ProfilerActivity.CPU], with_stack=True)


def median_of(repeat: int, measure: Callable[[], float]) -> float:
    return statistics.median(measure() for _ in range(repeat))


def run_command(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--ddp", action="store_true", help="also time the 2-rank DDP example")
    args = parser.parse_args()
    torch.set_num_threads(1)

    rows: list[tuple[str, str, float, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        base = median_of(args.repeat, lambda: run_steps(args.steps, nullcontext))
        cold = run_steps(args.steps, lambda: opguard_tracing(tmp))  # first use in the process
        traced = median_of(args.repeat, lambda: run_steps(args.steps, lambda: opguard_tracing(tmp)))
        profiled = median_of(args.repeat, lambda: run_steps(args.steps, torch_profiling))
        workload = f"single, {args.steps} steps"
        rows += [
            (workload, "untraced", base, 1.0),
            (workload, "opguard, first use (cold)", cold, cold / base),
            (workload, "opguard trace_callsites", traced, traced / base),
            (workload, "torch.profiler with_stack=True", profiled, profiled / base),
        ]
        if args.ddp:
            script = str(REPO / "examples" / "train_ddp.py")
            torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
            plain = [*torchrun, script, "--steps", str(args.steps)]
            opguard = [sys.executable, "-m", "opguard_core.cli", "trace", "--label", "bench"]
            opguard += ["--output-dir", tmp, "--", *plain]
            env_note = "ddp 2 ranks (whole command)"
            ddp_base = median_of(args.repeat, lambda: run_command(plain))
            ddp_traced = median_of(args.repeat, lambda: run_command(opguard))
            rows += [
                (env_note, "untraced", ddp_base, 1.0),
                (env_note, "opguard trace", ddp_traced, ddp_traced / ddp_base),
            ]

    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, median of {args.repeat} runs")
    print(f"{'workload':<30} {'mode':<32} {'seconds':>8} {'vs untraced':>12}")
    for workload, mode, seconds, ratio in rows:
        print(f"{workload:<30} {mode:<32} {seconds:>8.3f} {ratio:>11.2f}x")


if __name__ == "__main__":
    main()
