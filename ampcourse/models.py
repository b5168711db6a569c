"""Reference models and synthetic datasets that train in seconds on a CPU, no downloads (chapter 4 and every chapter).

    >>> from ampcourse.models import make_task
    >>> task = make_task("mlp", seed=0)               # or "cnn", "transformer"
    >>> model, data = task.model, task.data           # nn.Module, TensorDataset
    >>> loss = task.loss_fn(model(x), y)

``size`` scales every model ("tiny" for CPU notebooks and tests, "small" and "large" for GPUs,
where autocast has enough work to show tensor-core speedups).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from . import _args

__all__ = ["MODELS", "SIZES", "Task", "make_task", "make_model", "make_dataset", "loss_fn", "expected_data",
           "check_data", "data_errors", "MLP", "SmallCNN", "TinyTransformer"]

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


def _check_seed(seed: int) -> int:
    """A seed as a Python int in torch's range (torch would wrap a negative one and truncate a float without a word)."""
    return _args.seed(seed)


#: The synthetic datasets are for teaching: refuse one that would need more memory than this, before allocating.
MAX_DATASET_BYTES = 2**31


def _check_samples(name: str, n: int, w: int) -> int:
    """n as a Python int >= 1 whose dataset fits in MAX_DATASET_BYTES; ValueError naming it otherwise."""
    n = _args.integer(n, "dataset size (n_samples)", low=1, high=None, what="a positive int")
    seq = 16 if w < 32 else 256
    per_sample = {"mlp": 32 * 4 + 8, "cnn": 16 * 16 * 4 + 8}.get(name, 2 * seq * 8)  # inputs + targets
    most = MAX_DATASET_BYTES // per_sample
    if n > most:
        raise ValueError(f"dataset size (n_samples) must be a positive int of at most {most} for {name!r} "
                         f"(the synthetic data would need {n * per_sample:.3g} bytes), got {n!r}")
    return n


def make_model(name: str, size: str = "tiny", seed: int = 0) -> nn.Module:
    """A freshly initialised reference model ('mlp', 'cnn' or 'transformer'), seeded."""
    _check_name(name)
    w = _check_size(size)
    seed = _check_seed(seed)
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
    n = _check_samples(name, n, w)
    seed = _check_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    if name == "mlp":
        return _mlp_data(n, gen)
    if name == "cnn":
        return _cnn_data(n, gen)
    return _transformer_data(n, gen, vocab=64 if w < 32 else 8192, seq_len=16 if w < 32 else 256)


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy for class logits (B, C) or token logits (B, T, V)."""
    if not isinstance(logits, torch.Tensor):  # nn.LSTM's (output, (h, c)), a dict: which part is the logits?
        raise _args.InputError(
            f"the model returns a {type(logits).__name__}, not one logits tensor: the course's loss (cross-entropy) "
            "takes the logits; pass loss_fn=, e.g. lambda out, y: torch.nn.functional.cross_entropy(out[0][:, -1], y) "
            "for nn.LSTM's (output, (h, c))")
    if logits.shape[:-1] != target.shape:  # else torch fails deep inside, or broadcasts a wrong loss
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(target.shape)} do not match: targets must "
                         f"have the logits' shape without the last (class) dimension, {tuple(logits.shape[:-1])}")
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _layout(model: nn.Module) -> tuple[tuple, torch.dtype, int, int] | None:
    """For a reference model: (input shape after N, input dtype kind, classes, tokens per sequence or 0)."""
    if isinstance(model, MLP):
        return (model.net[0].in_features,), torch.float32, model.net[-1].out_features, 0
    if isinstance(model, SmallCNN):
        return (1, 16, 16), torch.float32, model.head.out_features, 0
    if isinstance(model, TinyTransformer):
        return (), torch.int64, model.tok.num_embeddings, model.pos.num_embeddings
    return None


def expected_data(model: nn.Module) -> str | None:
    """What a reference model takes, in words ('inputs (N, 32) float, targets (N,) int64 in 0..9'); None for others."""
    layout = _layout(model)
    if layout is None:
        return None
    shape, _, classes, seq = layout
    if seq:
        return (f"inputs (N, T) int64 token ids in 0..{classes - 1} with 1 <= T <= {seq}, "
                f"targets (N, T) int64 in 0..{classes - 1}")
    dims = ", ".join(map(str, ("N", *shape)))
    return f"inputs ({dims}) float, targets (N,) int64 class indices in 0..{classes - 1}"


def _describe(t: torch.Tensor) -> str:
    """'(64, 7) float32': a tensor's shape and dtype, as error messages show them."""
    return f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"


def check_data(model: nn.Module, data: TensorDataset, targets: bool = True) -> None:
    """ValueError, naming the tensor and what is expected, if data cannot feed this model (reference models only).

    targets=False checks the inputs only (for a loss function of your own, which may take other targets).
    """
    layout = _layout(model)
    if layout is None:
        return
    shape, kind, classes, seq = layout
    x, y = data.tensors
    want = expected_data(model)
    name = type(model).__name__
    if seq:
        ok_x = x.dim() == 2 and 1 <= x.shape[1] <= seq and not x.is_floating_point() and not x.is_complex()
        ok_y = y.shape == x.shape
    else:
        ok_x = tuple(x.shape[1:]) == shape and x.is_floating_point()
        ok_y = y.dim() == 1
    ok_y = ok_y and y.dtype == torch.int64  # what cross_entropy takes as class indices
    if not ok_x:
        raise ValueError(f"data inputs {_describe(x)} do not fit {name}: it takes {want}")
    if targets and not ok_y:
        raise ValueError(f"data targets {_describe(y)} do not fit {name}: it takes {want}")
    checked = ((("targets", y),) if targets else ()) + ((("inputs", x),) if seq else ())
    for what, t in checked:
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= classes):
            raise ValueError(f"data {what} hold values from {int(t.min())} to {int(t.max())}; {name} takes {want}")


@contextlib.contextmanager
def data_errors(model: nn.Module, x: torch.Tensor, y: torch.Tensor | None = None) -> Iterator[None]:
    """Re-raise what a model (or its loss) raises on a batch as a ValueError naming the batch and what the model takes.

    Shape, dtype and index errors otherwise surface deep inside torch (``mat1 and mat2 shapes cannot be
    multiplied``); out-of-memory errors pass through unchanged.
    """
    try:
        yield
    except torch.OutOfMemoryError:
        raise
    except (RuntimeError, IndexError, ValueError, TypeError, AssertionError) as err:
        batch = f"inputs {_describe(x) if isinstance(x, torch.Tensor) else type(x).__name__}"
        if y is not None:
            batch += f", targets {_describe(y) if isinstance(y, torch.Tensor) else type(y).__name__}"
        expected = expected_data(model)
        raise ValueError(f"{type(model).__name__} cannot run on this data (a batch of {batch}): {type(err).__name__}: "
                         f"{_args.first_line(err)}" + (f"; it takes {expected}" if expected else "")) from err


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
