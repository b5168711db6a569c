"""Below 16 bits: scaled quantization (per tensor, per row, MX, NVFP4, tiles), delayed vs current scaling, memory (chapter 9).

A format with 3 mantissa bits or fewer covers too small a range to hold a tensor as it is, so every
fp8/fp4 recipe stores ``q = round(x / s)`` and a scale ``s`` per *group* of elements, and multiplies
back (``x ~ q * s``). The recipes differ in the group and in the format of ``s``:

    granularity  group                      scale s                       who uses it
    "tensor"     the whole tensor           fp32, amax / max              TE / torchao tensorwise fp8
    "row"        one row                    fp32, amax / max              torchao rowwise fp8
    "1x128"      128 values along a row     fp32, amax / max              DeepSeek-V3 activations
    "128x128"    a 128 x 128 tile           fp32, amax / max              DeepSeek-V3 weights
    "mx"         32 values along a row      e8m0 (a power of two)         OCP MXFP8 / MXFP6 / MXFP4
    "nvfp4"      16 values along a row      fp8_e4m3, amax / 6            NVIDIA NVFP4 (one level)

The MX scale follows the OCP Microscaling spec v1.0 (section 6.3): ``X = 2**(floor(log2(amax)) - emax)``
with emax the element format's largest exponent. That is a *floor* of the exponent, so amax / X lies in
[2**emax, 2**(emax+1)) and can exceed the element's max (448 for e4m3 = 1.75 * 2**8): those values are
clamped (saturated), as the spec says. ``mx_rounding="rceil"`` rounds the exponent *up* instead,
``2**ceil(log2(amax / max))``, which never clips (NVIDIA's RCEIL: cuDNN's block-scale quantize documents
``scale = quantize_round_up(amax / vmax)`` and ``output = quantize_round_to_even(vals / scale)``). Both
exponents are computed exactly (``torch.frexp``, no floating-point log2), and clamped to e8m0's
[-127, 127], as the spec authors' reference library (microsoft/microxcaling, ``_quantize_mx``) does.

Against torchao 0.18 (``torchao_quantize``: ``MXTensor.to_mx``, ``NVFP4Tensor.to_nvfp4``), bit for bit
(tests/test_fp8.py): equal on ordinary tensors, with and without outliers, every element format and both
roundings; different at three edges, where torchao departs from the rule above (``MX_EDGE_CASES``):

- a block whose scale is 2**-127 (amax below about 2**(emax - 126)): FLOOR divides by 2**-126, float32's
  smallest normal (torchao clamps the float32 scale there: 2**-127 is float32-subnormal), then multiplies
  back by 2**-127, so every element comes back halved; RCEIL multiplies by 1 instead of 2**127 (TE's
  ``exp2f_rcp`` convention for the biased exponent 0), so every element flushes to zero;
- RCEIL with amax one float32 ulp above ``max * 2**k``: torchao's eager path takes ``ceil(log2(amax / max))``
  in float32, whose log2 rounds to exactly k, so it picks 2**k where the round-up rule gives 2**(k + 1)
  (and where its own Blackwell path, ``cvt.rp.satfinite.ue8m0x2.f32``, rounds up); the block's top value
  then saturates by less than an ulp;
- NVFP4 exact ties (x / s halfway between two fp4 values): torchao 0.18 (not 0.17) multiplies by the float32 reciprocal
  of the e4m3 scale (to match the MSLK kernel), which moves a tie by an ulp and rounds it away from even;
  here the quotient is exact and the tie goes to even, as cuDNN's formula says.

Element rounding uses ``ampcourse.formats.quantize`` (round to nearest, ties to even, exact for every
format); values beyond the element's max are clamped to +-max before rounding (saturation).

    >>> from ampcourse import fp8
    >>> x = torch.randn(4, 128)
    >>> r = fp8.quantize_scaled(x, "fp8_e4m3", "mx")      # or "tensor", "row", "1x128", "128x128", "nvfp4"
    >>> r.values, r.scales, fp8.sqnr_db(x, r.values)      # dequantized values, one scale per block of 32
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from . import _args, formats

__all__ = ["GRANULARITIES", "Quantized", "quantize_scaled", "relative_error", "median_relative_error", "sqnr_db", "compare_granularities",
           "ScalingStep", "simulate_scaling", "spike_sequence", "Component", "TrainingScheme", "SCHEMES",
           "bytes_per_parameter", "scaled_matmul", "quiet_torchao", "torchao_unavailable", "torchao_quantize", "EdgeCase",
           "mx_edge_cases", "torchao_departs", "element_formats", "RECIPES", "to_recipe", "recipe_unavailable", "train_recipe",
           "ROWWISE_SCALED_MM_CPU", "SCALED_MM_MULTIPLE", "AMAX_EPS"]

#: granularity name -> (group shape: rows, cols; None = the whole dimension), scale format
GRANULARITIES: dict[str, tuple[tuple[int | None, int | None], str]] = {
    "tensor": ((None, None), "fp32"),
    "row": ((1, None), "fp32"),
    "1x128": ((1, 128), "fp32"),
    "128x128": ((128, 128), "fp32"),
    "mx": ((1, 32), "fp8_e8m0"),
    "nvfp4": ((1, 16), "fp8_e4m3"),
}


@dataclass(frozen=True)
class Quantized:
    """A tensor after scaled quantization: what a low-precision kernel would see, multiplied back."""

    values: torch.Tensor  # dequantized, float64, same shape as the input
    scales: torch.Tensor  # one per group (float64 values of the stored scales), shape (row groups, col groups)
    granularity: str
    element: str  # the element format's name
    block: tuple[int, int]  # the group shape actually used
    saturated: int  # elements clamped at the element format's max (they would have rounded above it)
    underflowed: int  # non-zero elements that became zero


def _as_matrix(x, name: str = "x") -> torch.Tensor:
    """x as a 2-D float64 tensor (1-D becomes one row); ValueError for anything else."""
    if not isinstance(x, torch.Tensor):
        x = torch.as_tensor(formats._real_array(x, name))
    if x.is_complex() or not (x.is_floating_point() or x.dtype in (torch.int32, torch.int64)):
        raise ValueError(f"{name} must be a real tensor, got dtype {x.dtype}")
    if x.dim() == 1:
        x = x.unsqueeze(0)
    if x.dim() != 2 or x.numel() == 0:
        raise ValueError(f"{name} must be a non-empty 1-D or 2-D tensor, got shape {tuple(x.shape)}")
    if not torch.isfinite(x).all():
        raise ValueError(f"{name} holds inf or NaN; scaled quantization needs finite values")
    return x.detach().cpu().to(torch.float64)


def _group_shape(x: torch.Tensor, granularity: str, block_size: int | None) -> tuple[tuple[int, int], str]:
    """The (rows, cols) of one group and the scale format, checked against x's shape."""
    if not isinstance(granularity, str) or granularity not in GRANULARITIES:
        raise ValueError(f"unknown granularity {_args.shown(granularity)}; choose one of {', '.join(GRANULARITIES)}")
    (r, c), scale_fmt = GRANULARITIES[granularity]
    if block_size is not None:
        if granularity not in ("mx", "nvfp4", "1x128"):
            raise ValueError(f"block_size applies to 'mx', 'nvfp4' and '1x128' only, not {granularity!r}")
        c = _args.integer(block_size, "block_size", low=1, what="a positive int")
    rows, cols = x.shape
    r = rows if r is None else r
    c = cols if c is None else c
    if rows % r or cols % c:
        raise ValueError(f"granularity {granularity!r} needs blocks of {r}x{c}: shape {tuple(x.shape)} "
                         f"is not a multiple of it (pad the tensor or pick another granularity)")
    return (r, c), scale_fmt


def _floor_log2(x: torch.Tensor) -> torch.Tensor:
    """floor(log2(x)) of positive float64 values, exactly: frexp's exponent (a floating-point log2 rounds
    log2(2**k * (1 - 2**-53)) to k)."""
    return (torch.frexp(x).exponent - 1).to(torch.float64)


def _ceil_log2_ratio(x: torch.Tensor, top: float) -> torch.Tensor:
    """The smallest integer k with x <= top * 2**k, exactly (positive float64 x): no rounded log2 or quotient."""
    k = _floor_log2(x) - _floor_log2(torch.tensor(top, dtype=torch.float64))  # within one of the answer
    k = torch.where(x > torch.ldexp(torch.full_like(x, top), k), k + 1, k)
    return torch.where(x <= torch.ldexp(torch.full_like(x, top), k - 1), k - 1, k)


def _mx_scale(amax: torch.Tensor, element: formats.FormatSpec, rounding: str) -> torch.Tensor:
    """The e8m0 scale per group: OCP's floor rule, or round-up ('rceil'); exponent clamped to [-127, 127]."""
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    if rounding == "floor":  # OCP MX v1.0: X = 2**(floor(log2(amax)) - emax_elem)
        exp = _floor_log2(safe) - element.emax
    else:  # rceil: the smallest power of two with amax / X <= max, so nothing clips
        exp = _ceil_log2_ratio(safe, element.max)
    exp = torch.where(amax > 0, exp, torch.full_like(exp, -127.0))  # an all-zero block: the smallest scale
    # e8m0 holds 2**-127 .. 2**127; below, the spec's reference library (microxcaling) clamps to 2**-127 too
    return torch.exp2(exp.clamp(-127, 127))


#: The smallest amax an fp32 scale is computed from (torchao's float8 EPS): all-tiny groups stay finite.
AMAX_EPS = 1e-12


def _scales(amax: torch.Tensor, element: formats.FormatSpec, scale_fmt: str, rounding: str) -> torch.Tensor:
    """One scale per group from its amax, in the scale format of the granularity."""
    if scale_fmt == "fp8_e8m0":
        return _mx_scale(amax, element, rounding)
    if scale_fmt == "fp8_e4m3":  # NVFP4: amax / 6 rounded to e4m3, kept inside e4m3's normal range
        e4m3 = formats.spec("fp8_e4m3")
        raw = (amax / element.max).clamp(e4m3.min_normal, e4m3.max)
        return torch.from_numpy(formats.quantize(raw, e4m3))
    # fp32 scale: amax maps onto the largest element value. amax is clamped first, as torchao does
    # (torchao/float8/float8_utils.py, EPS = 1e-12 "to avoid division by zero"): an all-tiny group would
    # otherwise get a scale that rounds to fp32 zero (0/0 = NaN), and a float64 amax past fp32's range a
    # scale of inf (x/inf * inf = NaN). Clamped, such groups underflow or saturate, and the counts say so.
    fp32_max = formats.spec("fp32").max
    s = amax.clamp(AMAX_EPS, fp32_max) / element.max
    s = torch.from_numpy(formats.quantize(s, "fp32"))
    return torch.where(amax > 0, s, torch.ones_like(s))


def element_formats() -> list[str]:
    """The element formats scaled quantization takes, from the formats registry: every signed format narrower
    than fp32 (fp32 needs no scale; e8m0 has no sign and is a scale format), widest first.

    Example::

        >>> element_formats()[:3]
        ['fp16', 'bf16', 'fp8_e4m3']
    """
    # formats.names(narrow=True): the storage formats (TF32 is a compute format: nothing is stored in it)
    return [name for name in formats.names(narrow=True)
            if formats.spec(name).signed and formats.spec(name).bits < formats.spec("fp32").bits]


def _element(element) -> formats.FormatSpec:
    """The element format: one of element_formats(); ValueError listing them otherwise."""
    allowed = ", ".join(element_formats())
    try:
        f = formats.spec(element)
    except ValueError:
        raise ValueError(f"element must be a narrow signed format ({allowed}), got {_args.shown(element)}") from None
    if f.name not in element_formats():
        raise ValueError(f"element must be a narrow signed format ({allowed}), got {f.name!r}")
    return f


def _count_saturated(scaled: torch.Tensor, f: formats.FormatSpec) -> int:
    """Elements that saturation changed: they would have rounded above max (an fp32 scale's last-bit error does not count)."""
    half_ulp_at_max = math.ldexp(0.5, f.emax - f.mantissa_bits)
    return int((scaled.abs() > f.max + half_ulp_at_max).sum())


def quantize_scaled(x, element: str = "fp8_e4m3", granularity: str = "tensor", *,
                    block_size: int | None = None, mx_rounding: str = "floor") -> Quantized:
    """Scale x per group, round to the element format (saturating), and multiply back; see the module table."""
    m = _as_matrix(x)
    f = _element(element)
    if not isinstance(mx_rounding, str) or mx_rounding not in ("floor", "rceil"):
        raise ValueError(f"mx_rounding must be 'floor' (OCP MX spec) or 'rceil' (round up), got {_args.shown(mx_rounding)}")
    if granularity == "nvfp4" and f.name != "fp4_e2m1":
        raise ValueError(f"granularity 'nvfp4' has fp4_e2m1 elements (its e4m3 scale is amax / 6), got {f.name!r}")
    (r, c), scale_fmt = _group_shape(m, granularity, block_size)
    rows, cols = m.shape
    g = m.reshape(rows // r, r, cols // c, c)  # group (i, j) is g[i, :, j, :]
    amax = g.abs().amax(dim=(1, 3))
    s = _scales(amax, f, scale_fmt, mx_rounding)
    scaled = g / s[:, None, :, None]
    saturated = _count_saturated(scaled, f)
    q = torch.from_numpy(formats.quantize(scaled.clamp(-f.max, f.max), f))
    values = (q * s[:, None, :, None]).reshape(rows, cols)
    underflowed = int(((values == 0) & (m != 0)).sum())
    if isinstance(x, torch.Tensor) and x.dim() == 1:
        values = values.reshape(x.shape)
    return Quantized(values, s, granularity, f.name, (r, c), saturated, underflowed)


def _pair(x, approx) -> tuple[torch.Tensor, torch.Tensor]:
    """x and approx as float64 matrices of one shape; ValueError when approx has another number of elements."""
    a, b = _as_matrix(x), _as_matrix(approx, "approx")
    if a.numel() != b.numel():
        raise ValueError(f"approx must have x's {a.numel()} elements (x {tuple(a.shape)}), got shape {tuple(b.shape)}")
    return a, b.reshape(a.shape)


def relative_error(x, approx) -> float:
    """||x - approx|| / ||x|| (Frobenius norms); 0 when both are zero."""
    a, b = _pair(x, approx)
    den = float(a.norm())
    num = float((a - b).norm())
    return 0.0 if num == 0 else (math.inf if den == 0 else num / den)


def sqnr_db(x, approx) -> float:
    """Signal-to-quantization-noise ratio in dB: 10 log10(sum x^2 / sum (x - approx)^2); inf when exact."""
    err = relative_error(x, approx)
    return math.inf if err == 0 else -20.0 * math.log10(err)


def median_relative_error(x, approx) -> float:
    """The median over non-zero elements of |x - approx| / |x|: how a typical element fares (1.0 = flushed to zero)."""
    a, b = _pair(x, approx)
    nz = a != 0
    if not nz.any():
        return 0.0
    return float(((a - b).abs()[nz] / a.abs()[nz]).median())


def compare_granularities(x, element: str = "fp8_e4m3", granularities: Sequence[str] = tuple(GRANULARITIES),
                          **kwargs) -> dict[str, dict[str, float]]:
    """For each granularity that fits x's shape and element: relative error (overall and of a typical element), SQNR, counts."""
    granularities = _args.names(granularities, "granularities", tuple(GRANULARITIES))
    element_name = _element(element).name
    out = {}
    for g in granularities:
        if g == "nvfp4" and element_name != "fp4_e2m1":
            continue  # NVFP4 is defined for fp4 elements only
        try:
            r = quantize_scaled(x, element, g, **kwargs)
        except ValueError as e:
            if "not a multiple" in str(e):  # e.g. 128x128 tiles on a 64-row tensor: skip, not fail
                continue
            raise
        out[g] = {"rel_error": relative_error(x, r.values), "median_rel_error": median_relative_error(x, r.values),
                  "sqnr_db": sqnr_db(x, r.values),
                  "saturated": r.saturated, "underflowed": r.underflowed, "scales": r.scales.numel()}
    return out


# --- delayed vs current scaling ---------------------------------------------------------------------

@dataclass(frozen=True)
class ScalingStep:
    """One tensor of a sequence, quantized with the scale a recipe chose for it."""

    step: int
    amax: float  # the tensor's own amax
    scale: float  # the dequantization scale used (x ~ q * scale)
    saturated: int
    underflowed: int
    rel_error: float


def simulate_scaling(tensors: Sequence, element: str = "fp8_e4m3", mode: str = "delayed", *,
                     history: int = 16, margin: int = 0) -> list[ScalingStep]:
    """Quantize a sequence per tensor with delayed (Transformer Engine) or current (just-in-time) scaling.

    current: each tensor's own amax sets its scale, amax / max.
    delayed: the scale comes from the largest amax of the previous ``history`` tensors, before this one is
    seen (TE's DelayedScaling with amax_compute_algo="max"): scale = amax_history_max * 2**margin / max.
    The first step has no history and uses scale 1 (TE's initial value).
    """
    f = _element(element)
    if not isinstance(mode, str) or mode not in ("delayed", "current"):
        raise ValueError(f"mode must be 'delayed' or 'current', got {_args.shown(mode)}")
    history = _args.integer(history, "history", low=1)
    # 2**margin multiplies a float64 scale: past 2**127 (float32's largest power) a scale helps nobody
    margin = _args.integer(margin, "margin", low=0, high=127)
    if isinstance(tensors, (str, bytes)) or not isinstance(tensors, Iterable):
        raise ValueError(f"tensors must be a sequence of tensors (one per step), got {_args.shown(tensors)}")
    seen: list[float] = []
    scale = 1.0
    out = []
    for i, t in enumerate(tensors):
        m = _as_matrix(t, f"tensors[{i}]")
        amax = float(m.abs().max())
        if mode == "current":
            scale = amax / f.max if amax > 0 else 1.0
        scaled = m / scale
        q = torch.from_numpy(formats.quantize(scaled.clamp(-f.max, f.max), f)) * scale
        out.append(ScalingStep(i, amax, scale, _count_saturated(scaled, f),
                               int(((q == 0) & (m != 0)).sum()), relative_error(m, q)))
        seen = (seen + [amax])[-history:]  # the amax history is updated *after* the tensor is cast
        if mode == "delayed" and max(seen) > 0:
            scale = max(seen) * 2.0**margin / f.max
    return out


#: spike_sequence's output at most (float64 bytes): a typo in steps or size must not fill the memory.
MAX_SEQUENCE_BYTES = 2**31


def spike_sequence(steps: int = 40, spike_at: int = 20, spike: float = 100.0, size: int = 256,
                   seed: int = 0) -> list[torch.Tensor]:
    """Gaussian tensors with a slowly drifting std and one step whose values are ``spike`` times larger."""
    steps, size = _args.integer(steps, "steps", low=1), _args.integer(size, "size", low=1)
    if steps * size * 8 > MAX_SEQUENCE_BYTES:  # float64 values: refuse before allocating, not in the allocator
        raise ValueError(f"steps * size must be at most {MAX_SEQUENCE_BYTES // 8} values "
                         f"({MAX_SEQUENCE_BYTES // 2**30} GiB of float64), got steps={steps}, size={size}")
    spike_at = _args.integer(spike_at, "spike_at", low=0, high=steps - 1)
    spike, seed = _args.real(spike, "spike"), _args.seed(seed)
    gen = torch.Generator().manual_seed(seed)
    seq = []
    for i in range(steps):
        t = torch.randn(size, generator=gen, dtype=torch.float64) * (1.0 + 0.01 * i)
        seq.append(t * spike if i == spike_at else t)
    return seq


# --- bytes per parameter --------------------------------------------------------------------------

@dataclass(frozen=True)
class Component:
    """One stored copy per parameter: what it is, its format, and how many parameters share one value."""

    what: str
    fmt: str
    per: int = 1  # 1: one value per parameter; 16384: one scale per 128x128 tile

    def __post_init__(self) -> None:
        formats.spec(self.fmt)  # an unknown name fails here, listing the format names, not when bytes is read
        object.__setattr__(self, "per", _args.integer(self.per, "per", low=1))

    @property
    def bytes(self) -> float:
        """Bytes per parameter this component costs."""
        return formats.spec(self.fmt).bits / 8 / self.per


@dataclass(frozen=True)
class TrainingScheme:
    """A training recipe's per-parameter state (Adam), component by component; activations not counted."""

    name: str
    components: tuple[Component, ...]
    source: str

    def __post_init__(self) -> None:
        if not isinstance(self.components, (tuple, list)) or not all(isinstance(c, Component) for c in self.components):
            raise ValueError(f"components must be a tuple of Component, got {_args.shown(self.components)}")
        object.__setattr__(self, "components", tuple(self.components))

    @property
    def bytes(self) -> float:
        """Total bytes per parameter."""
        return sum(c.bytes for c in self.components)


_ADAM32 = (Component("Adam first moment", "fp32"), Component("Adam second moment", "fp32"))

#: The recipes in use, from their papers and docs (the source field says which). Byte counts are computed.
SCHEMES: tuple[TrainingScheme, ...] = (
    TrainingScheme("bf16 mixed precision", (
        Component("bf16 weights (compute copy)", "bf16"), Component("bf16 gradients", "bf16"),
        Component("fp32 master weights", "fp32"), *_ADAM32),
        "ZeRO paper's count (Rajbhandari et al. 2020) with bf16 in place of fp16"),
    TrainingScheme("TE fp8 (delayed scaling)", (
        Component("bf16 weights", "bf16"), Component("fp8 weight copy (cast once per step)", "fp8_e4m3"),
        Component("bf16 gradients", "bf16"), Component("fp32 master weights", "fp32"), *_ADAM32),
        "Transformer Engine: parameters stay in high precision; fp8 copies are made for the GEMMs"),
    TrainingScheme("DeepSeek-V3 fp8", (
        Component("fp8 weights (e4m3)", "fp8_e4m3"), Component("fp32 scale per 128x128 tile", "fp32", 128 * 128),
        Component("fp32 weight gradients", "fp32"), Component("fp32 master weights", "fp32"),
        Component("Adam first moment", "bf16"), Component("Adam second moment", "bf16")),
        "DeepSeek-V3 report, section 3.3: fp32 master weights and gradients, bf16 Adam moments"),
    # MS-AMP's table "details of different MS-AMP optimization levels" (docs/user-tutorial/optimization-level.md):
    # weight / master weight / weight gradient / optimizer states per level. O3 is the one with an fp16 master.
    TrainingScheme("MS-AMP O1", (
        Component("fp16 weights", "fp16"), Component("fp8 weight gradients", "fp8_e4m3"), *_ADAM32),
        "MS-AMP docs, optimization levels table: O1 = fp16 weights, fp8 gradients (and all-reduce), fp32+fp32 Adam"),
    TrainingScheme("MS-AMP O2", (
        Component("fp16 weights", "fp16"), Component("fp8 weight gradients", "fp8_e4m3"),
        Component("Adam first moment", "fp8_e4m3"), Component("Adam second moment", "fp16")),
        "MS-AMP docs, optimization levels table: O2 = O1 with fp8+fp16 Adam states (FP8-LM's '16 -> 6 bytes')"),
    TrainingScheme("MS-AMP O3", (
        Component("fp8 weights", "fp8_e4m3"), Component("fp16 master weights", "fp16"),
        Component("fp8 weight gradients", "fp8_e4m3"),
        Component("Adam first moment", "fp8_e4m3"), Component("Adam second moment", "fp16")),
        "MS-AMP docs, optimization levels table: O3 = fp8 weights with an fp16 master (ZeRO), fp8+fp16 Adam"),
)


def bytes_per_parameter(scheme: str | None = None) -> dict[str, float] | float:
    """Bytes per parameter of one scheme by name, or of all SCHEMES as name -> bytes."""
    table = {s.name: s.bytes for s in SCHEMES}
    if scheme is None:
        return table
    if not isinstance(scheme, str) or scheme not in table:
        raise ValueError(f"unknown scheme {_args.shown(scheme)}; choose one of {', '.join(table)}")
    return table[scheme]


# --- fp8 matmul on CPU --------------------------------------------------------------------------------

#: The first torch whose CPU ``torch._scaled_mm`` takes rowwise scales (measured: before 2.13 it takes only
#: per-tensor scales on CPU).
ROWWISE_SCALED_MM_CPU = (2, 13)

#: torch._scaled_mm on CUDA wants both dimensions of the second operand (K and N) divisible by 16 (cuBLASLt's
#: fp8 alignment); checked on every device, so a CPU run shows what a GPU would refuse.
SCALED_MM_MULTIPLE = 16

#: The first CUDA compute capability with fp8 tensor cores (Ada, sm_89; Hopper is 9.0): below it CUDA's
#: ``torch._scaled_mm`` has no kernel, per-tensor or rowwise.
FP8_CAPABILITY = (8, 9)


def _scaled_matmul_args(a, b, granularity, out_dtype) -> torch.dtype:
    """Check scaled_matmul's arguments (ValueError naming the fix); return the output dtype to use."""
    if not isinstance(granularity, str) or granularity not in ("tensor", "row"):
        raise ValueError(f"granularity must be 'tensor' or 'row' (what _scaled_mm takes), got {_args.shown(granularity)}")
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {_args.shown(t)}")
    if a.device != b.device:
        raise ValueError(f"a and b must be on one device, got {a.device} and {b.device}")
    if a.device.type == "cuda" and not torch.version.hip:  # ROCm decides fp8 support by its own architecture names
        cap = tuple(torch.cuda.get_device_capability(a.device))
        if cap < FP8_CAPABILITY:
            raise NotImplementedError(
                f"{torch.cuda.get_device_name(a.device)} (compute capability {cap[0]}.{cap[1]}) has no fp8 tensor cores: "
                f"torch._scaled_mm needs {FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} or later (Ada, Hopper, Blackwell); "
                "run scaled_matmul on CPU tensors to see the same numbers (slowly), or use bf16 on this GPU")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"a and b must be 2-D with a.shape[1] == b.shape[0], got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.numel() == 0 or b.numel() == 0:
        raise ValueError(f"a and b must be non-empty (a scale needs an amax), got {tuple(a.shape)} and {tuple(b.shape)}")
    k, n = b.shape
    if k % SCALED_MM_MULTIPLE or n % SCALED_MM_MULTIPLE:
        raise ValueError(f"fp8 matmul kernels need K and N to be multiples of {SCALED_MM_MULTIPLE}: "
                         f"got K={k}, N={n} (pad b, and a's columns, with zeros)")
    for name, t in (("a", a), ("b", b)):
        if not torch.isfinite(t).all():
            raise ValueError(f"{name} holds inf or NaN; scaled quantization needs finite values")
    if out_dtype is None:  # what every device and torch accepts for this granularity
        out_dtype = torch.float32 if granularity == "tensor" else torch.bfloat16
    if out_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"out_dtype must be torch.float32, torch.bfloat16 or torch.float16, got {_args.shown(out_dtype)}")
    if granularity == "row" and out_dtype != torch.bfloat16:
        # CUDA's rowwise kernel (aten/src/ATen/native/cuda/RowwiseScaledMM: f8f8bf16_rowwise) writes bf16 only;
        # refusing other dtypes everywhere keeps CPU runs honest about what a GPU will do
        raise ValueError(f"rowwise scaling needs out_dtype=torch.bfloat16 (CUDA's rowwise fp8 kernel writes bf16 only), "
                         f"got {out_dtype}")
    if granularity == "row" and a.device.type == "cpu" and formats.torch_version() < ROWWISE_SCALED_MM_CPU:
        raise NotImplementedError(
            f"rowwise torch._scaled_mm on CPU needs torch >= {'.'.join(map(str, ROWWISE_SCALED_MM_CPU))} "
            f"(this is {torch.__version__}, which scales per tensor only on CPU): use granularity='tensor'")
    return out_dtype


def scaled_matmul(a: torch.Tensor, b: torch.Tensor, granularity: str = "tensor",
                  out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """a @ b through ``torch._scaled_mm`` in e4m3 (per-tensor or rowwise scales), and the dequantize-then-matmul reference.

    Args:
        a: (M, K) floating-point matrix.
        b: (K, N) floating-point matrix; K and N must be multiples of 16 (fp8 GEMM kernels require it).
        granularity: "tensor" (one fp32 scale per operand) or "row" (one per row of a and per column of b).
        out_dtype: the product's dtype; default float32 for "tensor" and bfloat16 for "row" (CUDA's rowwise
            kernel writes bf16 only, so "row" refuses anything else).

    Returns:
        (out, reference): ``_scaled_mm``'s product, and the fp32 product of the dequantized operands.

    Raises:
        ValueError: bad shapes, dtypes or values, with the fix in the message.
        NotImplementedError: "row" on a CPU with torch < 2.13, whose CPU ``_scaled_mm`` scales per tensor only; CUDA
            tensors on a GPU below compute capability 8.9 (no fp8 tensor cores).

    Example::

        >>> out, ref = scaled_matmul(torch.randn(32, 64), torch.randn(64, 16), "tensor")
        >>> out.dtype, out.shape
        (torch.float32, torch.Size([32, 16]))
    """
    out_dtype = _scaled_matmul_args(a, b, granularity, out_dtype)
    e4m3 = torch.float8_e4m3fn
    fmax = torch.finfo(e4m3).max
    a, b = a.float(), b.float()
    if granularity == "tensor":
        sa, sb = a.abs().amax() / fmax, b.abs().amax() / fmax
    else:  # one scale per row of a and per column of b: the dimensions the product keeps
        sa, sb = a.abs().amax(1, keepdim=True) / fmax, b.abs().amax(0, keepdim=True) / fmax
    sa, sb = sa.clamp_min(torch.finfo(torch.float32).tiny), sb.clamp_min(torch.finfo(torch.float32).tiny)
    # Clamp before the cast: the fp32 scale's last bit can put an amax a hair above 448 (448.00003), and eager
    # casts to e4m3fn saturate only from torch 2.13 (before, a value that rounds past 448 becomes NaN): the
    # saturation is made explicit here, so it holds on every torch.
    qa, qb = (a / sa).clamp(-fmax, fmax).to(e4m3), (b / sb).clamp(-fmax, fmax).to(e4m3)
    # _scaled_mm wants the second operand column-major: transpose a contiguous copy of b.T
    out = torch._scaled_mm(qa, qb.t().contiguous().t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype)
    reference = (qa.float() * sa) @ (qb.float() * sb)
    return out, reference


# --- torchao, quietly -------------------------------------------------------------------------------

@contextlib.contextmanager
def quiet_torchao() -> Iterator[None]:
    """Import torchao without its log lines (wrap the first torchao import in it).

    Why: on a CPU-only torch, torchao's compiled CUDA extensions fail to load and it logs
    "Failed to load .../_C_*.so" at WARNING; torch's pytree logs a deprecation about torchao's Enum
    registrations. Neither affects the emulated paths this course uses, and both would land in
    notebook outputs and test logs. Only those two loggers are raised to ERROR, and only meanwhile.
    """
    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, lvl in zip(loggers, levels):
            lg.setLevel(lvl)


# --- torchao's MX and NVFP4 quantization, side by side ---------------------------------------------

#: our element name -> the attribute of torch (a dtype) or torchao's own name (fp6) that MXTensor.to_mx takes
_TORCHAO_MX_ELEMENTS = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2", "fp6_e2m3": "fp6_e2m3",
                        "fp6_e3m2": "fp6_e3m2", "fp4_e2m1": "float4_e2m1fn_x2"}


@functools.cache
def torchao_unavailable() -> str | None:
    """Why torchao's MX and NVFP4 classes cannot be used here, in one line; None when they can.

    Where a course installs with ``pip install --no-deps`` (Colab), torchao may be missing or built for
    another torch: the chapter skips what needs it and prints this reason.

    Example::

        >>> torchao_unavailable() is None or "torchao" in torchao_unavailable()
        True
    """
    try:
        with quiet_torchao():
            from torchao.prototype.mx_formats.config import ScaleCalculationMode  # noqa: F401
            from torchao.prototype.mx_formats.mx_tensor import MXTensor  # noqa: F401
            from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor  # noqa: F401
    except (ImportError, AttributeError, RuntimeError) as err:  # missing, or built against another torch
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return f"torchao's MX formats cannot be imported on torch {torch.__version__} ({first}); `pip install torchao` adds them"
    return None


def torchao_quantize(x, element: str = "fp8_e4m3", granularity: str = "mx", *,
                     mx_rounding: str = "floor") -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's version of ``quantize_scaled(x, element, granularity)``: (dequantized values, scales) as float64.

    Args:
        x: a 2-D tensor; torchao takes float32 (and bf16), so x is cast to float32 first.
        element: an MX element format (``_TORCHAO_MX_ELEMENTS``), or "fp4_e2m1" for "nvfp4".
        granularity: "mx" (``MXTensor.to_mx``, blocks of 32) or "nvfp4" (``NVFP4Tensor.to_nvfp4``, one level).
        mx_rounding: "floor" or "rceil" (torchao's ``ScaleCalculationMode``), for "mx".

    Raises:
        RuntimeError: torchao is not usable here (``torchao_unavailable`` says why).
        ValueError: an element or granularity torchao's classes do not take.

    Example::

        >>> x = torch.randn(2, 64)
        >>> values, scales = torchao_quantize(x, "fp8_e4m3", "mx")
        >>> torch.equal(values, quantize_scaled(x.float(), "fp8_e4m3", "mx").values)
        True
    """
    reason = torchao_unavailable()
    if reason is not None:
        raise RuntimeError(reason)
    if granularity not in ("mx", "nvfp4"):
        raise ValueError(f"granularity must be 'mx' or 'nvfp4' (torchao's MXTensor, NVFP4Tensor), got {_args.shown(granularity)}")
    if not isinstance(mx_rounding, str) or mx_rounding not in ("floor", "rceil"):
        raise ValueError(f"mx_rounding must be 'floor' or 'rceil', got {_args.shown(mx_rounding)}")
    m = _as_matrix(x).to(torch.float32).contiguous()
    name = _element(element).name
    with quiet_torchao():
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import MXTensor
        from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor
    if granularity == "nvfp4":
        if name != "fp4_e2m1":
            raise ValueError(f"granularity 'nvfp4' has fp4_e2m1 elements, got {name!r}")
        t = NVFP4Tensor.to_nvfp4(m)
    else:
        if name not in _TORCHAO_MX_ELEMENTS:
            raise ValueError(f"torchao's MX elements are {', '.join(_TORCHAO_MX_ELEMENTS)}, got {name!r}")
        elem = _TORCHAO_MX_ELEMENTS[name]
        elem = elem if elem.startswith("fp6") else getattr(torch, elem)
        mode = ScaleCalculationMode.FLOOR if mx_rounding == "floor" else ScaleCalculationMode.RCEIL
        t = MXTensor.to_mx(m, elem, 32, mode)
    values = t.dequantize(torch.float32).to(torch.float64)
    return values, t.scale.float().to(torch.float64).reshape(m.shape[0], -1)


@dataclass(frozen=True)
class EdgeCase:
    """A block where torchao departs from the rule ``quantize_scaled`` follows, and what the rule says."""

    name: str
    x: torch.Tensor  # float32, one row of 32 (MX) or 16 (NVFP4) values
    element: str
    granularity: str
    mx_rounding: str
    rule: str  # the rule, and who states it
    torchao: str  # what torchao does instead, and why (from its source)
    unit: float = 1.0  # a convenient unit to print this block's values in (a power of two, or its scale)
    # the first torchao that departs here (measured: 0.17, torch 2.11's, still rounds NVFP4 ties to even)
    torchao_since: tuple[int, int] = (0, 17)


def torchao_departs(case: EdgeCase) -> bool:
    """Whether the installed torchao departs from the rule on this case (it does from ``case.torchao_since`` on).

    Args:
        case: one of :func:`mx_edge_cases`.

    Example::

        >>> [torchao_departs(c) for c in mx_edge_cases()]  # torchao 0.18
        [True, True, True, True]
    """
    import torchao

    have = tuple(int(p) for p in re.findall(r"\d+", torchao.__version__)[:2])
    return have >= case.torchao_since


def mx_edge_cases() -> list[EdgeCase]:
    """The blocks where torchao's MX and NVFP4 quantization differ from the spec's rule (see the module doc; 0.17
    follows the rule on NVFP4 ties: :func:`torchao_departs`).

    Example::

        >>> [c.name for c in mx_edge_cases()][:1]
        ['FLOOR, scale 2**-127']
    """
    tiny = torch.tensor([1.5, 1.0, 0.75, 0.5] * 8, dtype=torch.float32) * 2.0**-120  # floor(log2) - 8 < -127
    k = 16
    top = torch.tensor(448.0 * 2.0**k, dtype=torch.float32)
    ulp_above = torch.full((32,), 1.25 * 2.0 ** (k - 7), dtype=torch.float32)  # small values that feel the scale
    ulp_above[0] = torch.nextafter(top, torch.tensor(math.inf))
    s = 0.9375  # an e4m3 number (1.875 * 2**-1) whose reciprocal is not exact in float32
    tie = torch.tensor([6.0, 2.5, 1.25, 5.0] * 4, dtype=torch.float32) * s  # x / s: 6 (sets s), then ties
    return [
        EdgeCase("FLOOR, scale 2**-127", tiny[None], "fp8_e4m3", "mx", "floor",
                 "OCP MX v1.0 6.3: X = 2**-127 (shared_exp clamped, as microxcaling does), P = quantize(V / X)",
                 "divides by 2**-126 (its float32 scale is clamped to the smallest normal), multiplies back by 2**-127: halves",
                 2.0**-120),
        EdgeCase("RCEIL, scale 2**-127", tiny[None], "fp8_e4m3", "mx", "rceil",
                 "cuDNN: scale = round_up(amax / max) = 2**-127 (clamped), output = round_to_even(x / scale)",
                 "multiplies by 1 for the biased exponent 0 (TE's exp2f_rcp), not by 2**127: flushes to zero",
                 2.0**-120),
        EdgeCase(f"RCEIL, amax one ulp above 448 * 2**{k}", ulp_above[None], "fp8_e4m3", "mx", "rceil",
                 f"cuDNN: scale = round_up(amax / 448) = 2**{k + 1} (the quotient is above 2**{k}; PTX cvt.rp rounds it up)",
                 f"ceil(log2(amax / 448)) in float32: log2 rounds to exactly {k}, so 2**{k}; the top value saturates",
                 2.0 ** (k - 7)),
        EdgeCase("NVFP4, exact ties", tie[None], "fp4_e2m1", "nvfp4", "floor",
                 "cuDNN: output = quantize_round_to_even(vals / scale): 2.5 -> 2, 1.25 -> 1, 5 -> 4",
                 "multiplies by the float32 reciprocal of the scale (MSLK's numerics): a tie moves up an ulp, rounds up",
                 s, torchao_since=(0, 18)),
    ]


# --- emulated low-precision training (torchao) ---------------------------------------------------------

#: training recipes train_recipe knows: how the Linear layers' matmuls run
RECIPES = ("fp32", "bf16", "float8", "mxfp8")


def _check_recipe(recipe) -> None:
    """ValueError listing RECIPES unless recipe is one of them."""
    if not isinstance(recipe, str) or recipe not in RECIPES:
        raise ValueError(f"unknown recipe {_args.shown(recipe)}; choose one of {', '.join(RECIPES)}")


def to_recipe(model: torch.nn.Module, recipe: str) -> torch.nn.Module:
    """Convert model's nn.Linear layers in place for a recipe ('float8': torchao tensorwise, 'mxfp8': torchao MX), emulated.

    'float8' is torchao's ``convert_to_float8_training`` with ``Float8LinearConfig(emulate=True)``: e4m3
    forward, e5m2 gradients, dynamic per-tensor scales, the fp8 matmul done in high precision.
    'mxfp8' is torchao's ``MXFP8TrainingOpConfig`` with the EMULATED kernel: e4m3 in blocks of 32 with
    e8m0 scales (RCEIL) for all three matmuls of each Linear; every Linear dim must be a multiple of 32.
    'fp32' and 'bf16' leave the model as it is ('bf16' runs under autocast in train_recipe).
    Raises NotImplementedError, with the reason, where this torch and torchao cannot run the recipe
    (``recipe_unavailable``: MXFP8 with torchao 0.17 on torch 2.11).
    """
    _check_recipe(recipe)
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {_args.shown(model)}")
    reason = recipe_unavailable(recipe)
    if reason is not None:
        raise NotImplementedError(f"recipe {recipe!r} cannot run here: {reason}")
    _convert(model, recipe)
    return model


def _convert(model: torch.nn.Module, recipe: str) -> None:
    """Swap model's Linear layers for torchao's recipe in place (no checks: to_recipe makes them)."""
    with quiet_torchao():
        if recipe == "float8":
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
            convert_to_float8_training(model, config=Float8LinearConfig(emulate=True))
        elif recipe == "mxfp8":
            from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig
            from torchao.quantization import quantize_
            from torchao.quantization.quantize_.common import KernelPreference
            quantize_(model, MXFP8TrainingOpConfig(kernel_preference=KernelPreference.EMULATED,
                                                   out_dtype=torch.float32))


@functools.cache
def recipe_unavailable(recipe: str) -> str | None:
    """Why this torch and torchao cannot run a recipe, in one line; None when they can.

    Tried on a one-Linear model, so the answer is what torchao does, not a version table: torchao 0.17's
    MXFP8 training asserts a torch with newer DTensor hooks than 2.11 has ("Please install the latest torch
    nightly build"); torch 2.13 with torchao 0.18 runs it.

    Example::

        >>> recipe_unavailable("fp32") is None
        True
    """
    _check_recipe(recipe)
    if recipe in ("fp32", "bf16"):
        return None
    try:
        _convert(torch.nn.Sequential(torch.nn.Linear(32, 32)), recipe)
    except ImportError as err:  # no torchao (Colab with --no-deps), or one that lacks the recipe
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return f"torchao cannot be imported for it on torch {torch.__version__} ({first}); `pip install torchao` adds it"
    except (AssertionError, RuntimeError, NotImplementedError) as err:
        try:
            import torchao
            ao = f"torchao {torchao.__version__}"
        except ImportError:
            ao = "torchao (not installed)"
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return f"{ao} on torch {torch.__version__} refuses it ({first})"
    return None


def train_recipe(recipe: str, steps: int = 30, batch: int = 32, lr: float = 3e-3, seed: int = 0) -> list[float]:
    """Train the tiny reference transformer with one recipe on CPU; the loss after each step (deterministic)."""
    from .models import make_task  # models imports nothing from here: no cycle

    _check_recipe(recipe)
    steps = _args.integer(steps, "steps", low=1)
    what = "an even int >= 2 (MX blocks of 32 tokens need batch * 16 % 32 == 0)"
    batch = _args.integer(batch, "batch", low=2, what=what)
    if batch % 2:
        raise ValueError(f"batch must be {what}, got {batch!r}")
    lr, seed = _args.real(lr, "lr", positive=True), _args.seed(seed)
    try:
        task = make_task("transformer", n=steps * batch, seed=seed)
    except ValueError as err:  # too many samples: say which arguments made them
        raise ValueError(f"steps * batch = {steps} * {batch} samples is too many: {err}") from None
    model = to_recipe(task.model, recipe)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    x, y = task.data.tensors
    losses = []
    for s in range(steps):
        xb, yb = x[s * batch:(s + 1) * batch], y[s * batch:(s + 1) * batch]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=recipe == "bf16"):
            loss = task.loss_fn(model(xb), yb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses
