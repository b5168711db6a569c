"""Models at real size, built on the meta device (no memory): what ``python -m ampcourse.plan --model`` names.

    >>> from ampcourse.plan.zoo import build, ZOO
    >>> setup = build("gpt2", batch=16, seq=1024)        # the course's transformer at GPT-2 124M size
    >>> plan(setup.model, setup.inputs, loss_fn=setup.loss_fn, targets=setup.targets)

``gpt2`` is ``ampcourse.models.TinyTransformer`` at GPT-2 124M's shape (12 layers, 12 heads, width 768, vocab
50257, tied head, ``scaled_dot_product_attention``); ``nanogpt-eager`` is the same network as nanoGPT's
first version wrote its attention (``q @ k.T``, a causal mask, softmax, ``@ v``: the T x T matrices in
memory); ``bert-base``/``bert-large`` are Hugging Face ``BertForMaskedLM`` from a config (no weights, no
download; they return their own loss from ``labels``); ``vit-b16`` is Hugging Face ``ViTForImageClassification``
at ViT-B/16's shape, built the same way; ``resnet50`` is torchvision's ResNet-50 v1.5 written
out (torchvision is not a dependency of the course).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["Setup", "ZOO", "MAX_SEQ", "build", "NanoGPT", "ResNet50"]


@dataclass
class Setup:
    """A model with its inputs (and loss_fn/targets where the model does not return its loss)."""

    model: nn.Module
    inputs: Any
    loss_fn: Callable | None = None
    targets: Any = None


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy over (batch, time, vocab) logits."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class _NanoBlock(nn.Module):
    """nanoGPT's block: pre-norm, attention written out with a causal mask buffer, tanh-GELU MLP."""

    def __init__(self, dim: int, heads: int, seq: int):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.c_attn, self.c_proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.c_fc, self.mlp_proj = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.register_buffer("bias", torch.tril(torch.ones(seq, seq)).view(1, 1, seq, seq))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(b, t, d))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class NanoGPT(nn.Module):
    """GPT-2 as nanoGPT's train_gpt2.py first wrote it (eager attention, tied head)."""

    def __init__(self, vocab: int = 50257, dim: int = 768, heads: int = 12, layers: int = 12, seq: int = 1024):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.h = nn.ModuleList(_NanoBlock(dim, heads, seq) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.t()


class _Bottleneck(nn.Module):
    """ResNet v1.5 bottleneck: 1x1, 3x3 (stride here), 1x1, batch norm after each, projection shortcut."""

    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        cout = 4 * width
        self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + (x if self.down is None else self.down(x)))


class ResNet50(nn.Module):
    """ResNet-50 v1.5 (torchvision's layout: 3, 4, 6, 3 bottlenecks, 25.6M parameters)."""

    def __init__(self, classes: int = 1000):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        blocks, cin = [], 64
        for width, n, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            for i in range(n):
                blocks.append(_Bottleneck(cin, width, stride if i == 0 else 1))
                cin = 4 * width
        self.layers = nn.Sequential(*blocks)
        self.fc = nn.Linear(2048, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.layers(self.stem(x)), 1), 1))


#: The longest sequence a named model takes: BERT's learned position table has 512 rows
#: (BertConfig.max_position_embeddings); gpt2 and nanogpt-eager are built with as many positions as asked.
MAX_SEQ = {"bert-base": 512, "bert-large": 512}


def _bert(size: str, batch: int, seq: int) -> Setup:
    """Hugging Face BertForMaskedLM (base or large) from a config, on meta, with labels (it returns its loss)."""
    from ..fp8 import quiet_torchao  # transformers imports torchao when installed: its load warnings are noise here
    try:
        with quiet_torchao():
            from transformers import BertConfig, BertForMaskedLM
    except ImportError as err:  # an optional dependency of this one entry
        raise ValueError(f"bert-{size} needs the transformers package ({err})") from None
    dims = {"base": (768, 12, 12), "large": (1024, 24, 16)}[size]
    cfg = BertConfig(hidden_size=dims[0], num_hidden_layers=dims[1], num_attention_heads=dims[2],
                     intermediate_size=4 * dims[0], attn_implementation="sdpa")
    with torch.device("meta"), quiet_torchao():
        model = BertForMaskedLM(cfg)
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return Setup(model, {"input_ids": ids, "labels": ids})


def _vit(batch: int, image: int) -> Setup:
    """Hugging Face ViTForImageClassification at ViT-B/16's shape (ViTConfig's defaults: width 768, 12 layers, 12
    heads, 16 x 16 patches), 1000 classes, from a config on meta, with labels (it returns its loss)."""
    from ..fp8 import quiet_torchao  # transformers imports torchao when installed: its load warnings are noise here
    try:
        with quiet_torchao():
            from transformers import ViTConfig, ViTForImageClassification
    except ImportError as err:  # an optional dependency of this one entry
        raise ValueError(f"vit-b16 needs the transformers package ({err})") from None
    cfg = ViTConfig(image_size=image, patch_size=16, num_labels=1000, attn_implementation="sdpa")
    with torch.device("meta"), quiet_torchao():
        model = ViTForImageClassification(cfg)
    images = torch.empty(batch, 3, image, image, device="meta")
    return Setup(model, {"pixel_values": images, "labels": torch.zeros(batch, dtype=torch.long, device="meta")})


def build(name: str, batch: int, seq: int = 1024, image: int = 224) -> Setup:
    """A model of :data:`ZOO` on the meta device with inputs of the given batch and sequence length (or image size).

    Args:
        name: a key of :data:`ZOO`.
        batch: the batch size.
        seq: tokens per sequence (language models).
        image: image side in pixels (resnet50, vit-b16).

    Example:
        >>> build("resnet50", batch=256).inputs.shape
        torch.Size([256, 3, 224, 224])
    """
    if name not in ZOO:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(ZOO)}")
    if name in MAX_SEQ and seq > MAX_SEQ[name]:
        raise ValueError(f"seq={seq} is beyond {name}'s {MAX_SEQ[name]} positions (max_position_embeddings): "
                         f"use seq <= {MAX_SEQ[name]}")
    if name.startswith("bert-"):
        return _bert(name.removeprefix("bert-"), batch, seq)
    if name == "vit-b16":
        return _vit(batch, image)
    tokens = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    with torch.device("meta"):
        if name == "gpt2":
            from ..models import TinyTransformer
            return Setup(TinyTransformer(vocab=50257, dim=768, heads=12, layers=12, seq_len=seq), tokens,
                         lm_loss, tokens)
        if name == "nanogpt-eager":
            return Setup(NanoGPT(seq=seq), tokens, lm_loss, tokens)
        model = ResNet50()
    images = torch.empty(batch, 3, image, image, device="meta")
    return Setup(model, images, F.cross_entropy, torch.zeros(batch, dtype=torch.long, device="meta"))


#: What :func:`build` makes, in a few words each.
ZOO = {
    "gpt2": "the course's transformer at GPT-2 124M size (scaled_dot_product_attention)",
    "nanogpt-eager": "GPT-2 124M as nanoGPT first wrote it (attention as q @ k.T, mask, softmax, @ v)",
    "bert-base": "Hugging Face BertForMaskedLM, 110M (needs transformers)",
    "bert-large": "Hugging Face BertForMaskedLM, 335M (needs transformers)",
    "resnet50": "ResNet-50 v1.5, 25.6M, 224 x 224 images",
    "vit-b16": "Hugging Face ViTForImageClassification at ViT-B/16 size, 86M, 224 x 224 images (needs transformers)",
}
