"""A 2-rank gloo job for the guard's collective check (tests/test_sequence_guard.py)::

    opguard guard --config C --collectives T -- \\
        torchrun --nproc-per-node 2 tests/data/guard_desync/guard_job.py --case dtype

Every step all-reduces ``a`` (float32, 6 elements) then ``b`` (float32, 8 elements);
steps count optimizer steps. Rank 1 departs in step 1 only: ``none`` (no departure),
``dtype`` (``a`` as int32), ``order`` (``b`` before ``a``), ``skip`` (no ``a``),
``wait`` (rank 1 sleeps 2.5 s first, so rank 0 waits in ``a``'s all-reduce), ``abort``
(``a`` as int32, then the process aborts, as a backend that aborts a rank does: no
``atexit``, no SIGTERM handler). With ``--sub`` every step also all-reduces ``a`` on
a group of both ranks right after the world group's, and ``swap`` issues those two the
other way round (each group alone agrees; both ranks wait for the other). An
exception ends the rank with exit 3 after printing ``rank R: TYPE: MESSAGE``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def step(case: str, rank: int, departs: bool, sub: dist.ProcessGroup | None) -> None:
    odd = rank == 1 and departs
    # the dtype case: the same op, another dtype
    a = torch.ones(6, dtype=torch.int32 if odd and case in ("dtype", "abort") else torch.float32)
    b = torch.ones(8)
    if odd and case == "wait":
        time.sleep(2.5)
    if odd and case == "order":
        dist.all_reduce(b)
        dist.all_reduce(a)
        return
    if odd and case == "swap" and sub is not None:
        dist.all_reduce(a, group=sub)
        dist.all_reduce(a)
    elif not (odd and case == "skip"):
        dist.all_reduce(a)
        if sub is not None:
            dist.all_reduce(a, group=sub)
    if odd and case == "abort":
        os.abort()
    dist.all_reduce(b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--case", default="none")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--sub", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group(backend="gloo", timeout=timedelta(seconds=10))
    rank = dist.get_rank()
    sub = dist.new_group([0, 1]) if args.sub else None
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        for number in range(args.steps):
            step(args.case, rank, number == 1, sub)
            model(torch.ones(1, 2)).sum().backward()
            opt.step()
    except Exception as exc:
        print(f"rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        sys.exit(3)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
