"""A block under torch.utils.checkpoint (non-reentrant), written as one script:
its recomputation in backward stops early, inside the last function whose op
saves a tensor (tests/test_guard_one_view.py)."""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--helper", action="store_true")
# a pre-LN block, x + fc(ln(x)), as transformers' are: LayerNorm's F.layer_norm is an
# api leaf in the forward pass and a frame (the pack hook below it) in recomputation
parser.add_argument("--pre-ln", action="store_true")
# a pre-LN attention block, x + attn(ln(x)): F.multi_head_attention_forward is the api
# of its own ops in the forward pass, a frame in the recomputation
parser.add_argument("--attention", action="store_true")
args = parser.parse_args()


def scaled_gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x) * 0.5


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.norm = nn.BatchNorm1d(16)
        self.ln = nn.LayerNorm(16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if args.attention:
            h = self.ln(x)
            return x + self.attn(h, h, h, need_weights=False)[0]
        if args.pre_ln:
            return x + self.fc(self.ln(x))
        y = torch.relu(self.norm(self.fc(x)))
        if args.helper:
            y = scaled_gelu(y)
        return x + y


def main() -> None:
    torch.manual_seed(0)
    blocks = nn.ModuleList([Block(), Block()])
    head = nn.Linear(16, 4)
    params = [*blocks.parameters(), *head.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.01)
    for _ in range(args.steps):
        x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
        if args.attention:  # a batch of 2 sequences of 4
            x = x.view(2, 4, 16)
        for block in blocks:
            x = checkpoint(block, x, use_reentrant=False)
        loss = F.cross_entropy(head(x.reshape(8, 16)), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


if __name__ == "__main__":
    main()
