"""Memory of the collective sequence for a job that repeats itself (formats.md,
"Collective sequences"): trace ``--steps`` steps of a one-process gloo job (two
all_reduces and a broadcast per step) with the modes backend and print, as JSON, the
signatures and step runs recorded, the collectives they stand for, the bytes of the
written ``collectives``, and what tracemalloc saw the process grow by after the first
step (all of it, and the part allocated in opguard's files)::

    python benchmarks/sequence_memory.py --steps 10
    python benchmarks/sequence_memory.py --steps 1000
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import tracemalloc

import torch
import torch.distributed as dist

from opguard_plugins.tracer import trace_callsites


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=1000)
    args = parser.parse_args()
    tmp = tempfile.mkdtemp()
    store = dist.FileStore(os.path.join(tmp, "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.ones(2, 4)

    def step() -> None:
        model(x).sum().backward()
        for param in model.parameters():
            assert param.grad is not None
            dist.all_reduce(param.grad)
        dist.broadcast(x, 0)
        opt.step()
        opt.zero_grad()

    with trace_callsites(label="memory", output_dir=tmp) as tracer:
        for number in range(args.steps):
            if number == 1:  # after the first step: every callsite and signature seen
                gc.collect()
                tracemalloc.start()
                before = tracemalloc.take_snapshot()
            step()
        gc.collect()
        after = tracemalloc.take_snapshot()
        tracemalloc.stop()
    diffs = after.compare_to(before, "filename")
    assert tracer.written is not None
    text = tracer.written.read_bytes()
    doc = json.loads(text)["collectives"]["sequences"][0]
    runs = doc["steps"]
    print(
        json.dumps(
            {
                "steps": args.steps,
                "signatures": len(doc["signatures"]),
                "runs": len(runs),
                "collectives": sum((r[1] - r[0] + 1) * len(r[2]) for r in runs),
                "collectives_bytes": len(text) - text.index(b'"collectives"'),
                "grown_bytes": sum(d.size_diff for d in diffs),
                "grown_opguard_bytes": sum(
                    d.size_diff for d in diffs if "opguard" in str(d.traceback)
                ),
            }
        )
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
