"""Train the tiny GPT with FSDP2 (``torch.distributed.fsdp.fully_shard``): gloo, CPU.

Each transformer block is sharded on its own, then the whole model. Launch with::

    torchrun --nproc-per-node 2 examples/train_fsdp.py
    opguard trace --label fsdp --output-dir examples/traces -- \
        torchrun --nproc-per-node 2 examples/train_fsdp.py
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from tiny_gpt import GPTConfig, TinyGPT, make_batch, train_step
from torch.distributed.fsdp import fully_shard


def main(argv: list[str] | None = None) -> float:
    """Train for ``--steps`` steps on every rank; return the mean loss of the last step."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    dist.init_process_group(backend="gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    config = GPTConfig()
    model = TinyGPT(config)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = torch.zeros(())
    for step in range(args.steps):
        idx, targets = make_batch(step, config, rank=rank)
        loss = torch.tensor(train_step(model, optimizer, idx, targets))
    dist.all_reduce(loss)
    mean_loss = float(loss) / dist.get_world_size()
    if rank == 0:
        print(f"fsdp: {args.steps} steps on {dist.get_world_size()} ranks, loss {mean_loss:.4f}")
    dist.barrier()
    dist.destroy_process_group()
    return mean_loss


if __name__ == "__main__":
    main()
