"""Problems planted in models for the doctor's tests (shared by tests/ and tests/gpu/)."""

import torch
import torch.nn as nn


class NaiveRMSNorm(nn.Module):
    """RMSNorm written the obvious way: x*x overflows fp16 once |x| passes the square root of fp16's max."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * self.weight


class SparseBag(nn.Module):
    """Bag of Embedding(sparse=True) rows, then a Linear: its embedding gradient comes sparse (SGD and SparseAdam
    take it; AdamW refuses it)."""

    def __init__(self, vocab: int = 50, dim: int = 32, classes: int = 10):
        super().__init__()
        self.emb, self.out = nn.Embedding(vocab, dim, sparse=True), nn.Linear(dim, classes)

    def forward(self, t):
        return self.out(self.emb(t).mean(1))


class Spectral(nn.Module):
    """A spectral mixing layer (FNet, Fourier neural operators): torch.fft on a Linear's output, inline. Healthy;
    under CUDA's lists (emulated on a CPU) rfft gets fp16/bf16, for which a CPU has no FFT kernel."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.inp, self.out = nn.Linear(d, d), nn.Linear(d, 4)
        self.w = nn.Parameter(torch.randn(d // 2 + 1) * 0.1)

    def forward(self, x):
        h = self.inp(x)
        f = torch.fft.rfft(h, dim=-1)
        return self.out(torch.relu(torch.fft.irfft(f * self.w, n=h.shape[-1], dim=-1)))
