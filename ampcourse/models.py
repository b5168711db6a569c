"""Reference models and synthetic datasets that train in seconds on a CPU (no downloads).

    >>> from ampcourse.models import make_task
    >>> task = make_task("mlp", seed=0)               # or "cnn", "transformer"
    >>> model, data = task.model, task.data           # nn.Module, TensorDataset
    >>> loss = task.loss_fn(model(x), y)

``size`` scales every model ("tiny" for CPU notebooks and tests, "small" and "large" for GPUs,
where autocast has enough work to show tensor-core speedups).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

__all__ = ["MODELS", "SIZES", "Task", "make_task", "make_model", "make_dataset", "loss_fn",
           "MLP", "SmallCNN", "TinyTransformer"]

#: width multipliers per size name
SIZES = {"tiny": 1, "small": 4, "large": 32}


class MLP(nn.Module):
    """Two hidden layers with GELU: the smallest model where autocast matters."""

    def __init__(self, in_features: int = 32, hidden: int = 64, classes: int = 10):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(in_features, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                                 nn.Linear(hidden, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class SmallCNN(nn.Module):
    """Two conv layers, batch norm, pooling and a linear head for 1x16x16 images."""

    def __init__(self, channels: int = 8, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.BatchNorm2d(2 * channels), nn.ReLU(),
            nn.AdaptiveAvgPool2d(4),
        )
        self.head = nn.Linear(2 * channels * 16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention and a GELU MLP."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    """A GPT-style language model: token + position embeddings, blocks, final norm, tied head."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, layers: int = 2, seq_len: int = 16):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        for emb in (self.tok, self.pos):  # GPT-2's init: small embeddings keep the tied logits near 0
            nn.init.normal_(emb.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.ln(x) @ self.tok.weight.t()  # weight tying, as in GPT-2


def _mlp_data(n: int, gen: torch.Generator, in_features: int = 32, classes: int = 10) -> TensorDataset:
    """Gaussian inputs labelled by a fixed random teacher: learnable, not trivial."""
    x = torch.randn(n, in_features, generator=gen)
    teacher = torch.randn(in_features, classes, generator=gen)
    return TensorDataset(x, (x @ teacher).argmax(1))


def _cnn_data(n: int, gen: torch.Generator, classes: int = 10) -> TensorDataset:
    """16x16 images of noisy stripes whose orientation and frequency encode the class."""
    y = torch.randint(0, classes, (n,), generator=gen)
    grid = torch.arange(16, dtype=torch.float32)
    angle = (y % 5).float()[:, None, None] * (math.pi / 5)
    freq = (1 + y // 5).float()[:, None, None] * 0.5
    xx, yy = grid[None, :, None], grid[None, None, :]
    img = torch.sin(freq * (xx * torch.cos(angle) + yy * torch.sin(angle)))
    img = img + 0.5 * torch.randn(n, 16, 16, generator=gen)
    return TensorDataset(img.unsqueeze(1), y)


def _transformer_data(n: int, gen: torch.Generator, vocab: int = 64, seq_len: int = 16) -> TensorDataset:
    """Sequences that count up with a per-sequence stride: predict the next token."""
    start = torch.randint(0, vocab, (n, 1), generator=gen)
    stride = torch.randint(1, 4, (n, 1), generator=gen)
    seq = (start + stride * torch.arange(seq_len + 1)) % vocab
    return TensorDataset(seq[:, :-1], seq[:, 1:])


MODELS = ("mlp", "cnn", "transformer")


def _check_name(name: str) -> str:
    """Validate a model name."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    return name


def _check_size(size: str) -> int:
    """Validate a size name and return its width multiplier."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    return SIZES[size]


def make_model(name: str, size: str = "tiny", seed: int = 0) -> nn.Module:
    """A freshly initialised reference model ('mlp', 'cnn' or 'transformer'), seeded."""
    _check_name(name)
    w = _check_size(size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if name == "mlp":
            return MLP(hidden=64 * w)
        if name == "cnn":
            return SmallCNN(channels=8 * w)
        return TinyTransformer(dim=32 * w, heads=4, layers=2 if w < 32 else 4, seq_len=16 if w < 32 else 256,
                               vocab=64 if w < 32 else 8192)


def make_dataset(name: str, n: int = 1024, seed: int = 0, size: str = "tiny") -> TensorDataset:
    """A synthetic dataset for a reference model; the same seed gives the same data."""
    _check_name(name)
    w = _check_size(size)
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"dataset size must be a positive int, got {n!r}")
    gen = torch.Generator().manual_seed(seed)
    if name == "mlp":
        return _mlp_data(n, gen)
    if name == "cnn":
        return _cnn_data(n, gen)
    return _transformer_data(n, gen, vocab=64 if w < 32 else 8192, seq_len=16 if w < 32 else 256)


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy for class logits (B, C) or token logits (B, T, V)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


@dataclass
class Task:
    """A model, its data and its loss: everything a training loop needs besides the optimiser."""

    name: str
    model: nn.Module
    data: TensorDataset
    loss_fn: object = loss_fn


def make_task(name: str, n: int = 1024, seed: int = 0, size: str = "tiny") -> Task:
    """A reference model with a matching synthetic dataset."""
    return Task(name, make_model(name, size=size, seed=seed), make_dataset(name, n=n, seed=seed, size=size))
