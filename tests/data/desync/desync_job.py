"""A tiny 2-rank gloo job whose ranks disagree about their collectives, one way per
``--case``, for the collective-sequence tests (docs/divergence.md)::

    opguard trace --label desync --output-dir out -- \
        torchrun --nproc-per-node 2 tests/data/desync/desync_job.py --case order

Every step all-reduces ``a`` (float32, 6 elements) then ``b`` (float32, 8 elements)
on the default group; rank 1 departs from that in step 1 only (steps count optimizer
steps, so step 0 is before the first ``opt.step()``):

* ``none``: no departure; ``lines``: rank 1 issues the same collectives from other
  lines (a legitimate program: no finding);
* ``order``: ``b`` before ``a``; ``dtype``: ``a`` as int32; ``size``: ``a`` with 8
  elements; ``skip``: no ``a``; ``group``: ``a`` on another group of the same ranks;
* ``funcol``: both ranks use functional collectives
  (``torch.distributed._functional_collectives``), rank 1 with ``a`` as int32;
* ``nested``: an all-gather runs inside a custom op (``desync::gather``), rank 1's
  in int32 (a size mismatch would make gloo abort the process);
* ``p2p``, ``scatter``, ``a2a``: no departure; every step first has rank 0 send to
  rank 1, or scatter from rank 0, or an ``all_to_all_single`` with uneven splits
  (legitimate programs whose ranks issue different p2p ops or sizes: no finding).

A departing collective does not complete (gloo times out after ``--timeout``
seconds, or completes with wrong values); the job catches the error and goes on, so
that it ends and its traces are written.
"""

from __future__ import annotations

import argparse
import contextlib
from datetime import timedelta

import torch
import torch.distributed as dist


def collective(fn, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
    """Run one collective; a mismatch makes gloo fail: go on."""
    with contextlib.suppress(RuntimeError):
        fn(*args, **kwargs)


@torch.library.custom_op("desync::gather", mutates_args=())
def gather(x: torch.Tensor) -> torch.Tensor:
    """A custom op that issues an all-gather inside (as vLLM's ``all_gather`` does)."""
    out = torch.empty(x.numel() * dist.get_world_size(), dtype=x.dtype)
    collective(dist.all_gather_into_tensor, out, x)
    return out


def step(case: str, rank: int, departs: bool, other: dist.ProcessGroup) -> None:
    a = torch.ones(6)
    b = torch.ones(8)
    odd = rank == 1 and departs
    if case == "funcol":
        import torch.distributed._functional_collectives as funcol

        x = a.to(torch.int32) if odd else a
        with contextlib.suppress(RuntimeError):
            funcol.all_reduce(x, "sum", dist.group.WORLD).wait()
            funcol.all_reduce(b, "sum", dist.group.WORLD).wait()
        return
    if case == "nested":
        gather(torch.ones(3, dtype=torch.int32 if odd else torch.float32))
        collective(dist.all_reduce, b)
        return
    if case == "p2p":  # rank 0 sends, rank 1 receives
        t = torch.ones(16)
        if rank == 0:
            collective(dist.send, t, 1)
        else:
            collective(dist.recv, t, 0)
    if case == "scatter":  # the scatter list is the root's alone
        out = torch.empty(4)
        collective(dist.scatter, out, [torch.ones(4), torch.ones(4)] if rank == 0 else None, 0)
    if case == "a2a":  # uneven splits: each rank sends and receives its own sizes
        sent, got = [[1, 3], [2, 3]][rank], [[1, 2], [3, 3]][rank]
        out = torch.empty(sum(got))
        collective(dist.all_to_all_single, out, torch.ones(sum(sent)), got, sent)
    if case == "lines" and rank == 1:
        collective(dist.all_reduce, a)  # the same collectives, from other lines
        collective(dist.all_reduce, b)
        return
    if odd and case == "order":
        collective(dist.all_reduce, b)
        collective(dist.all_reduce, a)
        return
    if odd and case == "dtype":
        a = a.to(torch.int32)
    if odd and case == "size":
        a = torch.ones(8)
    if not (odd and case == "skip"):
        collective(dist.all_reduce, a, group=other if odd and case == "group" else None)
    collective(dist.all_reduce, b)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--case", default="none")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=3.0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    timeout = timedelta(seconds=args.timeout)
    dist.init_process_group(backend="gloo", timeout=timeout)
    rank = dist.get_rank()
    other = dist.new_group([0, 1], timeout=timeout)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for number in range(args.steps):
        step(args.case, rank, number == 1, other)
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
