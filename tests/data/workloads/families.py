"""Small equivalents of the workloads issue 29 names (GPT-2 and BERT from transformers,
a torchvision ResNet, a GRU, activation checkpointing, autocast), written the way
their libraries write them, for tests/test_workloads.py. ``run(family, steps, seed,
batch)`` builds the model and trains it; nothing here knows about OpGuard."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

VOCAB, WIDTH, LENGTH = 64, 32, 8


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.heads = 4

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.heads, WIDTH // self.heads).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(WIDTH, dim=2)
        y = F.scaled_dot_product_attention(
            self.split_heads(q), self.split_heads(k), self.split_heads(v), is_causal=True
        )
        return self.proj(y.transpose(1, 2).reshape(x.shape))


class GPTBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = Attention()
        self.mlp = nn.Sequential(
            nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2's shape: tied embeddings, pre-norm blocks, ``_init_weights`` by ``apply``."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Embedding(LENGTH, WIDTH)
        self.h = nn.ModuleList(GPTBlock() for _ in range(2))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            module.bias.data.zero_()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), idx[:, 1:].reshape(-1))


class BertLike(nn.Module):
    """An encoder with dropout (train mode), a pooler and a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        layer = nn.TransformerEncoderLayer(WIDTH, 4, 64, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.pooler = nn.Linear(WIDTH, WIDTH)
        self.classifier = nn.Linear(WIDTH, 3)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(self.embed(idx))
        pooled = torch.tanh(self.pooler(hidden[:, 0]))
        return F.cross_entropy(self.classifier(pooled), idx[:, 0] % 3)


class Bottleneck(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + x)


class ResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.layer1 = nn.Sequential(Bottleneck(8), Bottleneck(8))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 10)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.layer1(self.stem(x))).flatten(1)
        return F.cross_entropy(self.fc(x), y)


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.gru = nn.GRU(WIDTH, WIDTH, batch_first=True)
        self.out = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.gru(self.embed(idx))
        logits = self.out(hidden[:, :-1])
        return F.cross_entropy(logits.reshape(-1, VOCAB), idx[:, 1:].reshape(-1))


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(3)
        )
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return self.head(x).square().mean()


class Autocast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(WIDTH, 64), nn.GELU(), nn.Linear(64, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = self.net(x)
        return y.float().square().mean()


def _tokens(generator: torch.Generator, batch: int) -> tuple[torch.Tensor, ...]:
    return (torch.randint(0, VOCAB, (batch, LENGTH), generator=generator),)


def _images(generator: torch.Generator, batch: int) -> tuple[torch.Tensor, ...]:
    x = torch.randn(batch, 3, 10, 10, generator=generator)
    return x, torch.randint(0, 10, (batch,), generator=generator)


def _vectors(generator: torch.Generator, batch: int) -> tuple[torch.Tensor, ...]:
    return (torch.randn(batch, WIDTH, generator=generator),)


#: family -> (model, data, optimizer, scheduler or None, gradient clipping)
FAMILIES = {
    "gpt2": (GPT, _tokens, lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1), None, 1.0),
    "bert": (BertLike, _tokens, lambda p: torch.optim.AdamW(p, lr=1e-3), None, None),
    "resnet": (
        ResNet,
        _images,
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-4),
        lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=10),
        None,
    ),
    "gru": (Recurrent, _tokens, lambda p: torch.optim.Adam(p, lr=1e-3), None, 0.5),
    "checkpoint": (Checkpointed, _vectors, lambda p: torch.optim.SGD(p, lr=0.01), None, None),
    "autocast": (Autocast, _vectors, lambda p: torch.optim.AdamW(p, lr=1e-3), None, None),
}


def run(family: str, steps: int, seed: int = 0, batch: int = 4) -> float:
    """Build ``family``'s model and train it ``steps`` steps; the last loss."""
    make, data, optimizer_of, scheduler_of, clip = FAMILIES[family]
    torch.manual_seed(seed)
    model = make()
    optimizer = optimizer_of(model.parameters())
    scheduler = scheduler_of(optimizer) if scheduler_of is not None else None
    generator = torch.Generator().manual_seed(seed)
    model.train()
    loss = torch.zeros(())
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = model(*data(generator, batch))
        loss.backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    value = float(loss.detach())
    assert math.isfinite(value)
    return value
