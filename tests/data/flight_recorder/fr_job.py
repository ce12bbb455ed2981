"""A tiny 2-rank gloo job that records PyTorch's Flight Recorder and writes each
rank's dump, for OpGuard's Flight Recorder reader (README.md in this folder).

    TORCH_FR_BUFFER_SIZE=64 torchrun --nproc-per-node 3 fr_job.py SCENARIO OUTDIR [json]

writes ``OUTDIR/SCENARIO/rank_<R>`` (the pickle ``_dump_fr_trace()`` returns, the
bytes NCCL's watchdog writes to ``TORCH_FR_DUMP_TEMP_FILE<R>``; with ``json``,
``OUTDIR/SCENARIO_json/rank_<R>.json`` from ``_dump_fr_trace_json()``) when the job
ends, also when a collective fails or times out (gloo writes no dump by itself).
Scenarios: ok, order, dtype, size, skip, group; rank 1 is the culprit.
"""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _dump_fr_trace, _dump_fr_trace_json

STEPS = 2


def step(rank: int, scenario: str, step_no: int, sub: dist.ProcessGroup) -> None:
    a = torch.ones(8)
    b = torch.ones(6)
    culprit = rank == 1 and step_no == STEPS - 1
    if culprit and scenario == "order":
        dist.broadcast(b, src=0)
        dist.all_reduce(a)
    elif culprit and scenario == "skip":
        dist.broadcast(b, src=0)
    else:
        if culprit and scenario == "dtype":
            a = a.int()
        if culprit and scenario == "size":
            b = torch.ones(8)  # larger: gloo's receive check passes on every rank
        dist.all_reduce(a, group=sub if culprit and scenario == "group" else None)
        dist.broadcast(b, src=0)
    dist.all_reduce(torch.ones(2), group=sub)


def main() -> None:
    scenario, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3))
    rank = dist.get_rank()
    sub = dist.new_group(list(range(dist.get_world_size())))
    try:
        for step_no in range(STEPS):
            step(rank, scenario, step_no, sub)
    except Exception as exc:  # a desync: gloo fails or times out
        print(f"rank {rank}: {type(exc).__name__}: {str(exc)[:120]}", file=sys.stderr)
    finally:
        as_json = sys.argv[3:] == ["json"]
        folder = os.path.join(out, scenario + ("_json" if as_json else ""))
        os.makedirs(folder, exist_ok=True)
        name = f"rank_{rank}" + (".json" if as_json else "")
        data = _dump_fr_trace_json() if as_json else _dump_fr_trace()
        with open(os.path.join(folder, name + ".tmp"), "wb") as f:
            f.write(data)
        os.replace(os.path.join(folder, name + ".tmp"), os.path.join(folder, name))
    os._exit(0)  # no destroy_process_group: a desynced peer may be gone


if __name__ == "__main__":
    main()
