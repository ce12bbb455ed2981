"""Train the tiny GPT for a few steps in a single process (CPU, AdamW).

Run directly (``python examples/train_single.py``) or traced::

    opguard trace --label single --output-dir examples/traces -- python examples/train_single.py
"""

from __future__ import annotations

import argparse

import torch
from tiny_gpt import GPTConfig, TinyGPT, make_batch, train_step


def main(argv: list[str] | None = None) -> float:
    """Train for ``--steps`` steps and return the last loss."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    config = GPTConfig()
    model = TinyGPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = float("nan")
    for step in range(args.steps):
        idx, targets = make_batch(step, config)
        loss = train_step(model, optimizer, idx, targets)
    print(f"single: {args.steps} steps, last loss {loss:.4f}")
    return loss


if __name__ == "__main__":
    main()
