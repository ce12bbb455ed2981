"""A tiny 2-rank job whose ranks diverge, for the divergence tests (gloo, CPU).

Rank 1 issues one extra ``all_reduce`` per step (in ``extra_sync``, on a group of
its own, so that gloo completes it instead of mismatching the next collective), and
rank 0 runs a logging helper (``log_metrics``) the other rank never runs. Recorded
with::

    opguard trace --label divergent --output-dir tests/data/divergent -- \
        torchrun --nproc-per-node 2 tests/data/divergent/divergent_job.py
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist


def log_metrics(loss: torch.Tensor) -> float:
    """Rank 0 only: a few ops to summarise the loss."""
    scaled = loss.detach() * 100.0
    rounded = torch.round(scaled)
    return float(rounded.abs())


def extra_sync(tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Rank 1 only: one all_reduce the other rank never issues."""
    dist.all_reduce(tensor, group=group)


def train_step(
    model: torch.nn.Linear, batch: torch.Tensor, rank: int, solo: dist.ProcessGroup | None
) -> torch.Tensor:
    loss = model(batch).pow(2).mean()
    loss.backward()
    for param in model.parameters():
        assert param.grad is not None
        dist.all_reduce(param.grad)
        param.grad = None
    if rank == 1 and solo is not None:
        extra_sync(loss.detach().clone(), solo)
    return loss


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group(backend="gloo")
    rank = dist.get_rank()
    solo = dist.new_group([1])  # every rank must call new_group; only rank 1 is in it
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    for step in range(args.steps):
        batch = torch.full((3, 4), float(step + rank))
        loss = train_step(model, batch, rank, solo if rank == 1 else None)
        if rank == 0:
            log_metrics(loss)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
