"""What one periodic flush of a traced process costs (docs/tracing.md, "periodic flush").

A flush is the tracer's ``write(partial=...)``: one trace build and an atomic write,
holding the GIL. Timed on two traces: the tiny GPT after some AdamW steps (a real
model's handful of callsites) and ``--functions`` generated functions of three ops
each (a trace with many callsites). Prints, for each, the median and largest of
``--repeat`` flushes and the share of the run they take at the default interval::

    python benchmarks/flush_cost.py [--steps 10] [--functions 5000] [--repeat 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from tiny_gpt import GPTConfig, TinyGPT, make_batch, train_step

from opguard_plugins.record.flush import DEFAULT_FLUSH_SECONDS, partial_marker
from opguard_plugins.tracer import trace_callsites


def _time_flushes(tracer: Any, repeat: int) -> list[float]:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        tracer.write(partial=partial_marker("flush", tracer.steps_done))
        times.append(time.perf_counter() - started)
    return times


def _report(name: str, tracer: Any, times: list[float]) -> None:
    median = statistics.median(times)
    size = tracer.written.stat().st_size if tracer.written else 0
    share = median / DEFAULT_FLUSH_SECONDS * 100
    print(
        f"{name}: {len(tracer.recorder.counts)} callsites, {size / 1e6:.2f} MB; flush "
        f"median {median * 1e3:.1f} ms, max {max(times) * 1e3:.1f} ms; "
        f"{share:.3f} % of the run at {DEFAULT_FLUSH_SECONDS:g} s"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--functions", type=int, default=5000)
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args(argv)
    out = tempfile.mkdtemp(prefix="flush_cost_")

    torch.manual_seed(0)
    config = GPTConfig()
    model = TinyGPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with trace_callsites(label="gpt", output_dir=out) as tracer:
        for step in range(args.steps):
            train_step(model, optimizer, *make_batch(step, config))
        _report("tiny GPT", tracer, _time_flushes(tracer, args.repeat))

    source = "\n".join(
        f"def f{i}(x):\n    return (x + {i}) * 2 - 1\n" for i in range(args.functions)
    )
    namespace: dict[str, Any] = {}
    exec(compile(source, "generated.py", "exec"), namespace)
    x = torch.ones(4)
    with trace_callsites(label="many", output_dir=out) as tracer:
        for i in range(args.functions):
            namespace[f"f{i}"](x)
        _report(f"{args.functions} functions", tracer, _time_flushes(tracer, args.repeat))


if __name__ == "__main__":
    main()
