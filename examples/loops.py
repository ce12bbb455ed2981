"""Small training loops the tracer is measured and tested on (no downloads).

* :class:`HFStyleModel`: a transformers-style encoder written in plain torch (separate
  q/k/v projections, ``view``/``transpose`` head split, additive attention mask,
  softmax, dropout, residual + ``LayerNorm``, a classification head);
* :class:`ConvNet`: a small ResNet-like conv net (conv, batch norm, ReLU, residual);
* :class:`CheckpointedModel`: MLP blocks under ``torch.utils.checkpoint`` (non-reentrant)
  plus a custom ``autograd.Function``.

``LOOPS`` maps a name to a factory returning ``step()``, one training step (forward,
backward, optimizer step). ``tiny_gpt`` is the bundled GPT (``examples/tiny_gpt.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class HFSelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = hidden // heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.dropout = nn.Dropout(0.1)

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        return x.view(batch, length, self.heads, self.head_dim).transpose(1, 2)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q = self.split_heads(self.query(hidden))
        k = self.split_heads(self.key(hidden))
        v = self.split_heads(self.value(hidden))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        scores = scores + mask
        probs = self.dropout(F.softmax(scores, dim=-1))
        context = torch.matmul(probs, v).transpose(1, 2).contiguous()
        return context.view(hidden.shape)


class HFLayer(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.attention = HFSelfAttention(hidden, heads)
        self.attention_norm = nn.LayerNorm(hidden)
        self.intermediate = nn.Linear(hidden, 4 * hidden)
        self.output = nn.Linear(4 * hidden, hidden)
        self.output_norm = nn.LayerNorm(hidden)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        hidden = self.attention_norm(hidden + self.attention(hidden, mask))
        return self.output_norm(hidden + self.output(F.gelu(self.intermediate(hidden))))


class HFStyleModel(nn.Module):
    def __init__(self, vocab: int = 100, hidden: int = 32, heads: int = 4, layers: int = 2):
        super().__init__()
        self.embeddings = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(HFLayer(hidden, heads) for _ in range(layers))
        self.classifier = nn.Linear(hidden, 2)

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        mask = (1.0 - attention_mask[:, None, None, :].float()) * torch.finfo(torch.float).min
        hidden = self.embeddings(ids)
        for layer in self.layers:
            hidden = layer(hidden, mask)
        return self.classifier(hidden[:, 0])


class ConvNet(nn.Module):
    def __init__(self, channels: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(channels)
        self.fc = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.stem(x)))
        x = F.relu(x + self.bn2(self.conv(x)))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


class ScaledTanh(torch.autograd.Function):
    """A custom autograd Function: ``2 * tanh(x)``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        return 2 * y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        return grad * 2 * (1 - y * y)


class CheckpointedBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def inner(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(ScaledTanh.apply(self.fc1(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + checkpoint(self.inner, x, use_reentrant=False)


class CheckpointedModel(nn.Module):
    def __init__(self, width: int = 32, blocks: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(CheckpointedBlock(width) for _ in range(blocks))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _step_of(model: nn.Module, loss_of: Callable[[], torch.Tensor]) -> Callable[[], None]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        optimizer.zero_grad()
        loss_of().backward()
        optimizer.step()

    return step


def hf_style_loop() -> Callable[[], None]:
    model = HFStyleModel()
    ids = torch.randint(0, 100, (4, 16))
    attention_mask = torch.ones(4, 16, dtype=torch.long)
    attention_mask[:, 12:] = 0
    labels = torch.randint(0, 2, (4,))
    return _step_of(model, lambda: F.cross_entropy(model(ids, attention_mask), labels))


def conv_loop() -> Callable[[], None]:
    model = ConvNet()
    images = torch.randn(4, 3, 16, 16)
    labels = torch.randint(0, 10, (4,))
    return _step_of(model, lambda: F.cross_entropy(model(images), labels))


def checkpointed_loop() -> Callable[[], None]:
    model = CheckpointedModel()
    x = torch.randn(8, 32)
    return _step_of(model, lambda: model(x).pow(2).mean())


def tiny_gpt_loop() -> Callable[[], None]:
    from tiny_gpt import GPTConfig, TinyGPT, make_batch, train_step

    config = GPTConfig()
    model = TinyGPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx, targets = make_batch(0, config)

    def step() -> None:
        train_step(model, optimizer, idx, targets)

    return step


LOOPS: dict[str, Callable[[], Callable[[], None]]] = {
    "tiny_gpt": tiny_gpt_loop,
    "hf_style": hf_style_loop,
    "conv": conv_loop,
    "checkpointed": checkpointed_loop,
}
