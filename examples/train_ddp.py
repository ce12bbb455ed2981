"""Train the tiny GPT with DistributedDataParallel: gloo, CPU, launched by torchrun.

::

    torchrun --nproc-per-node 2 examples/train_ddp.py
    opguard trace --label ddp --output-dir examples/traces -- \
        torchrun --nproc-per-node 2 examples/train_ddp.py
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from tiny_gpt import GPTConfig, TinyGPT, make_batch, train_step
from torch.nn.parallel import DistributedDataParallel


def main(argv: list[str] | None = None) -> float:
    """Train for ``--steps`` steps on every rank; return the mean loss of the last step."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    dist.init_process_group(backend="gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # same initial weights everywhere (DDP also broadcasts them)
    config = GPTConfig()
    model = DistributedDataParallel(TinyGPT(config))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = torch.zeros(())
    for step in range(args.steps):
        idx, targets = make_batch(step, config, rank=rank)
        loss = torch.tensor(train_step(model, optimizer, idx, targets))
    dist.all_reduce(loss)
    mean_loss = float(loss) / dist.get_world_size()
    if rank == 0:
        print(f"ddp: {args.steps} steps on {dist.get_world_size()} ranks, loss {mean_loss:.4f}")
    dist.barrier()
    dist.destroy_process_group()
    return mean_loss


if __name__ == "__main__":
    main()
