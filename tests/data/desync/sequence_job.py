"""One process's collective sequence (a one-rank gloo group): c10d, functional and
nested collectives over three steps, then a broadcast after the last step, traced by
one backend::

    python tests/data/desync/sequence_job.py OUTPUT_DIR {modes,modes-python,profiler}

prints the path of the trace it wrote. ``modes`` records with the recorder's C path,
``modes-python`` with its Python path; ``profiler`` folds a cycle at every optimizer
step (``fold_seconds=0``) and, with ``WORLD_SIZE`` 2, records shapes as in a job of
several ranks.

Run in its own process by ``tests/test_collective_sequences.py``: torch 2.13's
profiler, stopped and restarted while gloo runs functional collectives or a custom op's
collectives, now and then corrupts its own heap (docs/tracing.md, "Limits"); a crash
ends this process, not the test session.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from opguard_plugins.record.tracer import CallsiteTracer


def gather(x: torch.Tensor) -> torch.Tensor:
    """A custom op's kernel that issues an all-gather."""
    out = torch.empty(x.numel() * dist.get_world_size(), dtype=x.dtype)
    dist.all_gather_into_tensor(out, x)
    return out


def make_tracer(backend: str, output_dir: Path) -> CallsiteTracer:
    if backend == "profiler":
        from opguard_plugins.record.profiler import ProfilerTracer

        os.environ["WORLD_SIZE"] = "2"  # record_shapes: a job of several ranks
        return ProfilerTracer(label="seq", output_dir=output_dir, fold_seconds=0.0)
    from opguard_plugins.record.tracer import CallsiteRecorder

    tracer = CallsiteTracer(label="seq", output_dir=output_dir)
    tracer.recorder = CallsiteRecorder(accelerated=backend == "modes")
    return tracer


def main(output_dir: Path, backend: str) -> None:
    custom = torch.library.custom_op(
        "opguard_test::gather", gather, mutates_args=(), schema="(Tensor x) -> Tensor"
    )
    dist.init_process_group(
        "gloo", init_method=f"file://{output_dir / 'store'}", rank=0, world_size=1
    )
    try:
        tracer = make_tracer(backend, output_dir)
        model = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        tracer.start()
        try:
            for _ in range(3):
                dist.all_reduce(torch.ones(6), op=dist.ReduceOp.MAX)
                funcol.all_reduce(torch.ones(2, 3, dtype=torch.int32), "sum", dist.group.WORLD)
                custom(torch.ones(3))
                model(torch.ones(1, 2)).sum().backward()
                opt.step()  # the profiler folds a cycle here: steps span cycles
            dist.broadcast(torch.ones(4), 0)
        finally:
            tracer.stop()
        print(tracer.write())
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
