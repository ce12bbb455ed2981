"""torch alone, no OpGuard: the profiler (``with_stack``, ``record_shapes``) stopped and
restarted at every optimizer step while gloo runs a functional collective and a custom
op's all-gather. On torch 2.13 (CPU) a few runs in a hundred die by SIGSEGV or SIGABRT
in the profiler (a corrupted heap, seen in ``PythonTracer::recordPyCall`` and in
``_disable_profiler``)::

    n=0; for i in $(seq 60); do python tests/data/desync/torch_profiler_cycles.py \
        >/dev/null 2>&1 || n=$((n+1)); done; echo "$n crashes in 60"

(4 in 60 here). docs/tracing.md, "Limits".
"""

from __future__ import annotations

import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.optim.optimizer import register_optimizer_step_post_hook


def gather(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.numel() * dist.get_world_size(), dtype=x.dtype)
    dist.all_gather_into_tensor(out, x)
    return out


def main() -> None:
    custom = torch.library.custom_op(
        "repro::gather", gather, mutates_args=(), schema="(Tensor x) -> Tensor"
    )
    store = tempfile.mktemp()
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    cycle: list[Any] = []

    def begin() -> None:
        profile = torch.autograd.profiler.profile(
            use_cpu=True, use_kineto=True, with_stack=True, record_shapes=True
        )
        profile.__enter__()
        cycle.append(profile)

    def end() -> None:
        profile = cycle.pop()
        profile.__exit__(None, None, None)
        results, profile.kineto_results = profile.kineto_results, None
        work = list(results.experimental_event_tree())
        while work:  # read every op's inputs, as the profiler backend does
            event = work.pop()
            if event.tag == torch._C._profiler._EventType.TorchOp:
                event.extra_fields.inputs  # noqa: B018
            work.extend(event.children)

    register_optimizer_step_post_hook(lambda *_: (end(), begin()))
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    begin()
    for _ in range(3):
        dist.all_reduce(torch.ones(6), op=dist.ReduceOp.MAX)
        funcol.all_reduce(torch.ones(2, 3, dtype=torch.int32), "sum", dist.group.WORLD).wait()
        custom(torch.ones(3))
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
    dist.broadcast(torch.ones(4), 0)
    end()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
