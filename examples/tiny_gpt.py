"""A tiny GPT-style transformer in plain torch, used by the example training programs.

Token and position embeddings, a stack of pre-norm blocks (causal self-attention and an
MLP), a final layer norm and a language-model head. Small enough that a few training
steps run in well under a second on a CPU; deterministic under ``torch.manual_seed``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    """Model size. The defaults make a ~0.1M-parameter model."""

    vocab_size: int = 128
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    dropout: float = 0.0


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention with a causal mask."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, channels = x.shape
        q, k, v = self.qkv(x).split(channels, dim=2)
        head = channels // self.n_head
        q = q.view(batch, seq, self.n_head, head).transpose(1, 2)
        k = k.view(batch, seq, self.n_head, head).transpose(1, 2)
        v = v.view(batch, seq, self.n_head, head).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(batch, seq, channels)
        return self.proj(y)


class MLP(nn.Module):
    """Position-wise feed-forward network."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """A pre-norm transformer block."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """The whole model: ``forward(idx, targets)`` returns ``(logits, loss)``."""

    def __init__(self, config: GPTConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or GPTConfig()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        seq = idx.size(1)
        pos = torch.arange(seq, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def make_batch(
    step: int, config: GPTConfig, batch_size: int = 4, rank: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic random batch of token ids and next-token targets."""
    generator = torch.Generator().manual_seed(1000 * rank + step)
    data = torch.randint(
        config.vocab_size, (batch_size, config.block_size + 1), generator=generator
    )
    return data[:, :-1], data[:, 1:]


def train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, idx: torch.Tensor, targets: torch.Tensor
) -> float:
    """One optimisation step; returns the loss."""
    optimizer.zero_grad(set_to_none=True)
    _, loss = model(idx, targets)
    assert loss is not None
    loss.backward()
    optimizer.step()
    return float(loss.detach())
