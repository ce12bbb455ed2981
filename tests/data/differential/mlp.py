"""A 2-layer MLP trained for a few steps on CPU (the differential check's program).

python mlp.py                       # plain run (for `opguard trace -- python mlp.py`)
python mlp.py --profile OUT.json    # under torch.profiler(with_stack=True), Chrome JSON
"""

from __future__ import annotations

import argparse
import contextlib

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def make_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(8, 16, generator=generator), torch.randn(8, 4, generator=generator)


def train_step(model: MLP, optimizer: torch.optim.Optimizer, step: int) -> float:
    x, y = make_batch(step)
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile")
    parser.add_argument("--steps", type=int, default=3)
    options = parser.parse_args()
    profiler: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
    if options.profile:
        # no schedule: every step is recorded (a schedule's first cycle drops steps)
        profiler = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True, record_shapes=False
        )
    with profiler as prof:  # the whole program, as `opguard trace` sees it
        torch.manual_seed(0)
        model = MLP()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(options.steps):
            train_step(model, optimizer, step)
            if prof is not None:
                prof.step()  # type: ignore[attr-defined]
    if options.profile:
        prof.export_chrome_trace(options.profile)  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
