"""Overhead of the runtime guard on the example training loop, side by side.

In one process, on ``--steps`` training steps of ``examples/tiny_gpt.py`` (AdamW, CPU,
one thread, after one untimed warm-up step), interleaved so that machine noise hits
every mode alike, median of ``--repeat`` rounds:

* untraced;
* an empty ``TorchDispatchMode`` (``return func(*args, **kwargs)``): the floor of any
  Python-level per-op check;
* the guard (:func:`opguard_plugins.enforce.runtime.guarded`, what ``opguard guard``
  starts in each process), enforcing a config made from a trace of this very loop,
  report written at the end included;
* the guard with ``sample=0.1`` (every 10th optimizer step checked);
* the empty mode pushed in one optimizer step in ten only: what ``--sample 0.1``
  cannot go below with any Python-level per-op check;
* the tracer (``trace_callsites``, what ``opguard trace`` starts), trace written.

The table's ratios are of the timed loop; entering and leaving each mode (the guard
pushes its modes, then writes its report; the tracer writes its trace) is a
per-process cost, printed in its own column.

``--size small`` runs a larger model of the same code (128 wide, 64 tokens, batch 8:
0.47M parameters, about 10x the tiny model's time per step): the per-op cost of a
Python-level mode is fixed, so its share of a step falls as the ops grow, as it does
on a GPU job.

Run: ``python benchmarks/guard_overhead.py [--steps 200] [--repeat 3] [--size small]``. Goals
(docs/performance.md): guard ≤ 1.3× the empty mode (issue 12); ``--sample 0.1`` ≤ 1.1×
untraced at 200 steps (issue 29).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))
sys.path.insert(0, str(REPO))

from bench_config import config_of  # noqa: E402
from tiny_gpt import GPTConfig, TinyGPT, make_batch, train_step  # noqa: E402

from opguard_core.formats.config import load_config  # noqa: E402
from opguard_plugins.enforce.runtime import guarded  # noqa: E402
from opguard_plugins.record.tracer import count_optimizer_steps  # noqa: E402
from opguard_plugins.tracer import trace_callsites  # noqa: E402


class EmptyMode(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


@contextmanager
def sampled_empty_mode(every: int = 10) -> Iterator[None]:
    """The empty mode pushed in every ``every``-th optimizer step only (steps 0, 10,
    ...), as the guard samples: the floor of ``--sample 0.1``."""
    mode = EmptyMode()
    steps = [0]

    def after_step(optimizer: Any) -> None:
        steps[0] += 1
        if steps[0] % every == 0:
            mode.__enter__()
        elif steps[0] % every == 1:
            mode.__exit__(None, None, None)

    mode.__enter__()
    handle = count_optimizer_steps(after_step)
    try:
        yield
    finally:
        handle.remove()
        if steps[0] % every == 0:
            mode.__exit__(None, None, None)


#: the model sizes ``--size`` picks: (model config, batch size)
SIZES: dict[str, tuple[GPTConfig, int]] = {
    "tiny": (GPTConfig(), 4),
    "small": (GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=128), 8),
}
SIZE = ["tiny"]


def run_steps(
    steps: int, wrap: Callable[[], AbstractContextManager[object]]
) -> tuple[float, float]:
    """(seconds of ``steps`` training steps inside ``wrap()``, seconds of entering and
    leaving ``wrap()``), after one untimed warm-up step."""
    torch.manual_seed(0)
    config, batch = SIZES[SIZE[0]]
    model = TinyGPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_step(model, optimizer, *make_batch(0, config, batch))
    start = time.perf_counter()
    with wrap():
        loop_start = time.perf_counter()
        for step in range(steps):
            train_step(model, optimizer, *make_batch(step, config, batch))
        loop = time.perf_counter() - loop_start
    return loop, time.perf_counter() - start - loop


def make_config(steps: int, directory: Path) -> Path:
    """Trace the loop once and turn the trace into a config with ``opguard run``."""
    with trace_callsites(label="bench", output_dir=directory, rank=0):
        run_steps(steps, nullcontext)
    return config_of(directory / "bench_callsite_rank0.json", directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    args = parser.parse_args()
    SIZE[0] = args.size
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        config = load_config(make_config(args.steps, directory))  # loaded once, not timed

        @contextmanager
        def guard(sample: float) -> Iterator[None]:
            with guarded(config, report_dir=directory / "reports", sample=sample) as g:
                yield
            errors = [v for v in g.violations() if v["severity"] == "error"]
            if errors:
                raise SystemExit(f"the guard found errors in its own loop: {errors[:3]}")

        @contextmanager
        def tracing() -> Iterator[None]:
            with trace_callsites(label="timed", output_dir=directory, rank=0):
                yield

        modes: list[tuple[str, Callable[[], AbstractContextManager[object]]]] = [
            ("untraced", nullcontext),
            ("empty TorchDispatchMode", EmptyMode),
            ("empty mode, 1 step in 10", sampled_empty_mode),
            ("opguard guard", lambda: guard(1.0)),
            ("opguard guard --sample 0.1", lambda: guard(0.1)),
            ("opguard trace", tracing),
        ]
        for _, wrap in modes:  # warm every mode's one-time set-up (torch's mode machinery)
            run_steps(2, wrap)
        times: dict[str, list[float]] = {name: [] for name, _ in modes}
        setup: dict[str, list[float]] = {name: [] for name, _ in modes}
        for _ in range(args.repeat):
            for name, wrap in modes:
                loop, fixed = run_steps(args.steps, wrap)
                times[name].append(loop)
                setup[name].append(fixed)

    median = {name: statistics.median(values) for name, values in times.items()}
    fixed_cost = {name: statistics.median(values) for name, values in setup.items()}
    base, floor = median["untraced"], median["empty TorchDispatchMode"]
    print(
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, tiny_gpt ({args.size}) "
        f"{args.steps} steps, "
        f"median of {args.repeat} interleaved rounds"
    )
    print(
        f"{'mode':<28} {'loop s':>8} {'vs untraced':>12} {'vs empty mode':>14} {'enter+exit s':>13}"
    )
    for name, _ in modes:
        seconds = median[name]
        print(
            f"{name:<28} {seconds:>8.3f} {seconds / base:>11.2f}x {seconds / floor:>13.2f}x "
            f"{fixed_cost[name]:>13.3f}"
        )
    guard_ratio = median["opguard guard"] / floor
    sample_ratio = median["opguard guard --sample 0.1"] / base
    sample_floor = median["empty mode, 1 step in 10"] / base
    verdict = "met" if guard_ratio <= 1.3 else "NOT met"
    print(f"goal guard <= 1.3x empty mode: {guard_ratio:.2f}x {verdict}")
    print(
        f"goal --sample 0.1 <= 1.1x untraced: {sample_ratio:.2f}x "
        f"{'met' if sample_ratio <= 1.1 else 'NOT met'} "
        f"(its floor, the empty mode in 1 step in 10: {sample_floor:.2f}x)"
    )


if __name__ == "__main__":
    main()
