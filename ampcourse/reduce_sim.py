"""Gradient all-reduce in low precision, simulated rank by rank on one CPU (chapter 10).

When gradients are all-reduced in bf16 (DDP's ``bf16_compress_hook``, FSDP2's ``reduce_dtype=torch.bfloat16``),
the sum itself is computed in bf16: the collective adds two values, stores the partial sum in the wire dtype,
sends it on, and adds again. Every addition rounds. In a **ring** (NCCL's bandwidth-optimal algorithm, and the
usual one) the partial sum of each chunk travels around all N ranks: N-1 additions, each rounded, and the later
ones add a single rank's value to the sum of many, so the relative error grows with the world size. In a
**tree** the values added have equal weight (each side holds the sum of as many ranks), so there are only
ceil(log2 N) rounding levels. NCCL's maintainers say the same (NVIDIA/nccl#1026: "the least stable algorithm is
rings ... the tree algorithm is much more stable because it adds values of equal weights").

The ``"tree"`` here is a balanced pairwise tree: a model of equal-weight additions, not NCCL's own order. NCCL's
tree (from 2.4) is a *double binary tree* between nodes with a *chain* through the GPUs inside each node (NVIDIA's
"Massively Scale Your Deep Learning Training with NCCL 2.4", 2019), so inside a node it adds like a short ring;
NVLS (NVLink SHARP, on NVSwitch systems) forms the sum in the switch. Which one NCCL picks depends on the message
size and the topology: measure on the machine itself. Real collectives differ in a second way too: FSDP2
*reduce-scatters* gradients (each rank receives only its shard's sum; it all-reduces only across the replicas of
HSDP, ``torch.distributed.fsdp._fully_shard._fsdp_collectives.foreach_reduce``); a ring reduce-scatter does the
same N-1 rounded additions per element as the first half of a ring all-reduce.

**The error depends on the gradients, not only on N** (``reduction_error``'s ``spread``): rank r's gradient is a
shared signal plus ``spread`` times its own noise. With ``spread=0`` every rank sends the same value: a ring's
partial sum grows by the same 1/N share at every hop, and once it is about 2**8 shares large (bf16 keeps 8
significant bits) a share is below half its spacing and rounds away, so the sum stalls (64% at 1024 ranks).
Noise of both signs keeps the partial sums smaller than the final sum (3.1% at 1024 ranks for ``spread=10``,
34% for ``spread=1``; ``reduction_error``'s example runs them). Megatron-LM#6199 describes a ring bf16 reduce-scatter's error as growing about as sqrt(N).

This module reproduces those sums exactly (bf16 addition on the CPU is an fp32 addition rounded once to bf16,
as in NCCL's reduction kernels), so the error of an N-rank reduction can be measured without N GPUs:

    >>> import torch
    >>> from ampcourse.reduce_sim import simulate_reduction
    >>> grads = torch.randn(8, 1000)                      # 8 ranks, 1000 gradient values each
    >>> mean = simulate_reduction(grads, dtype=torch.bfloat16, algorithm="ring")
    >>> mean.dtype, mean.shape
    (torch.float32, torch.Size([1000]))

It is the one home for this simulation in the course (chapter 7 shows the error against world size; chapter 10
compares ring and tree from 2 to 1024 ranks).
"""

from __future__ import annotations

import math

import torch

from . import _args

__all__ = ["ALGORITHMS", "simulate_reduction", "reduction_error", "rounding_steps"]

#: How the partial sums travel: "ring" (N-1 roundings per element) or "tree" (ceil(log2 N) levels).
ALGORITHMS = ("ring", "tree")

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: reduction_error's largest world_size x numel: the gradients and their copies (float64 too) stay within a few GiB.
MAX_VALUES = 2**28


def _ring_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum over dim 0 the way a ring reduce-scatter does, rounding to ``values.dtype`` after every addition.

    The flat gradient is cut into N chunks, one per rank; chunk c starts on rank c+1 and collects the ranks in
    ring order (c+1, c+2, ..., c), so every chunk sees a different order, as on the real ring.
    """
    n, numel = values.shape
    chunk = torch.arange(numel) * n // numel  # which of the N chunks each element belongs to
    start = (chunk + 1) % n
    order = (start.unsqueeze(0) + torch.arange(n).unsqueeze(1)) % n  # order[k, i]: k-th rank to add element i
    ordered = torch.gather(values, 0, order)
    acc = ordered[0].clone()
    for k in range(1, n):  # one hop of the ring: add the next rank's value, store in the wire dtype (rounds)
        acc = acc + ordered[k]
    return acc


def _tree_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum over dim 0 pairwise (a binary tree), rounding to ``values.dtype`` after every addition."""
    level = values
    while level.shape[0] > 1:
        pairs = level.shape[0] // 2
        summed = level[0:2 * pairs:2] + level[1:2 * pairs:2]  # each addition rounds once
        level = torch.cat([summed, level[2 * pairs:]]) if level.shape[0] % 2 else summed
    return level[0]


def simulate_reduction(grads: torch.Tensor, *, dtype: torch.dtype = torch.bfloat16, algorithm: str = "ring",
                       average: bool = True) -> torch.Tensor:
    """The all-reduced gradient that N ranks would receive, computed the way the collective computes it.

    Each rank's fp32 gradient is cast to ``dtype``; with ``average=True`` it is then divided by N in ``dtype``
    before the sum (what ``default_hooks.bf16_compress_hook`` does: ``buffer.to(bf16).div_(world_size)``, then
    an all-reduce SUM); then the N values of every element are summed with one rounding to ``dtype`` per
    addition, in ring or tree order. ``dtype=torch.float32`` gives DDP's default fp32 all-reduce.

    Args:
        grads: float32 tensor of shape ``(N, ...)``: rank r's gradient is ``grads[r]``; N >= 1.
        dtype: the dtype on the wire and of the partial sums: torch.float32, torch.bfloat16 or torch.float16.
        algorithm: ``"ring"`` (N-1 rounded additions per element, each chunk starting on a different rank) or
            ``"tree"`` (pairwise, ceil(log2 N) rounded levels).
        average: divide by N before summing (DDP's hooks do); False returns the plain sum.

    Returns:
        The reduced gradient, shape ``grads.shape[1:]``, as float32 (what the hook copies back into the bucket).

    Example:
        >>> g = torch.full((4, 3), 1.0 + 2**-8)          # 4 ranks, same gradient: not a bf16 number
        >>> simulate_reduction(g, dtype=torch.float32)
        tensor([1.0039, 1.0039, 1.0039])
        >>> simulate_reduction(g, dtype=torch.bfloat16)  # rounded to bf16's 8 significant bits
        tensor([1., 1., 1.])
    """
    if not isinstance(grads, torch.Tensor):
        raise TypeError(f"grads must be a float32 tensor of shape (N, ...), one row per rank; got {_args.shown(grads)}")
    if grads.dtype != torch.float32 or grads.dim() < 1 or grads.shape[0] < 1:
        raise ValueError("grads must be a float32 tensor of shape (N, ...), one row per rank, N >= 1; "
                         f"got {grads.dtype} of shape {tuple(grads.shape)}")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {[str(d) for d in _DTYPES]}, got {_args.shown(dtype)}")
    algorithm = _args.choice(algorithm, "algorithm", ALGORITHMS)
    average = _args.flag(average, "average")  # average="no" is truthy: it would silently average
    n = grads.shape[0]
    values = grads.reshape(n, -1).to(dtype)
    if average:
        values = values / n  # in the wire dtype, as the hook does: exact for a power of two, one rounding otherwise
    if values.shape[1] == 0:
        return values.sum(0).reshape(grads.shape[1:]).float()
    summed = _ring_sum(values) if algorithm == "ring" else _tree_sum(values)
    return summed.reshape(grads.shape[1:]).float()


def reduction_error(world_size: int, *, dtype: torch.dtype = torch.bfloat16, algorithm: str = "ring",
                    numel: int = 4096, spread: float = 1.0, seed: int = 0) -> float:
    """Relative RMS error of a simulated N-rank averaged all-reduce against the exact (float64) average.

    Rank r's gradient is ``signal + spread * noise_r``: a shared signal (standard normal) plus independent
    per-rank noise, as data-parallel gradients are: the same direction, different samples. The result depends on
    that model, a ring's far more than a tree's (the module docstring says why). At 1024 bf16 ranks, in percent, for
    ``spread`` 0 (identical gradients), 1 and 10 (default numel and seed; bf16 sums rounded in software, so the same
    on every CPU)::

        >>> [round(100 * reduction_error(1024, spread=s), 1) for s in (0, 1, 10)]
        [64.2, 33.9, 3.1]
        >>> [round(100 * reduction_error(1024, spread=s, algorithm="tree"), 2) for s in (0, 1, 10)]
        [0.17, 0.26, 0.31]

    Args:
        world_size: number of ranks N >= 1.
        dtype: wire dtype (see ``simulate_reduction``).
        algorithm: ``"ring"`` or ``"tree"``.
        numel: gradient values per rank.
        spread: size of the per-rank noise relative to the shared signal (>= 0).
        seed: seed of the generator that draws the gradients (the same seed gives the same gradients).

    Returns:
        ``||reduced - exact|| / ||exact||`` as a Python float.

    Example:
        >>> reduction_error(64, dtype=torch.bfloat16) > reduction_error(2, dtype=torch.bfloat16)
        True
    """
    world_size = _args.integer(world_size, "world_size", low=1)
    numel = _args.integer(numel, "numel", low=1)
    if world_size * numel > MAX_VALUES:  # else torch's allocator fails deep inside, with a C++ message
        raise ValueError(f"world_size x numel = {world_size} x {numel} gradient values is more than this simulation "
                         f"holds in memory (at most 2**28 = {MAX_VALUES}); use fewer ranks or a smaller numel")
    spread = _args.real(spread, "spread", nonnegative=True, what=">= 0 (a finite number)")
    gen = torch.Generator().manual_seed(_args.seed(seed))
    signal = torch.randn(numel, generator=gen)
    grads = signal + spread * torch.randn(world_size, numel, generator=gen)
    if not torch.isfinite(grads).all():  # an inf gradient makes the "error" nan, silently
        raise ValueError(f"spread={spread!r} makes the simulated gradients overflow float32; use a spread below 1e30")
    exact = grads.double().mean(0)
    got = simulate_reduction(grads, dtype=dtype, algorithm=algorithm).double()
    return float((got - exact).norm() / exact.norm())


def rounding_steps(world_size: int, algorithm: str = "ring") -> int:
    """Rounded additions per element on the way to the sum: N-1 for a ring, ceil(log2 N) levels for a tree.

    Example:
        >>> rounding_steps(8, "ring"), rounding_steps(8, "tree")
        (7, 3)
    """
    world_size = _args.integer(world_size, "world_size", low=1)
    algorithm = _args.choice(algorithm, "algorithm", ALGORITHMS)
    return world_size - 1 if algorithm == "ring" else math.ceil(math.log2(world_size))
