"""Chapter 5 exercises: an fp32 island, a custom autograd function under autocast, an fp8 scale."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from .. import formats
from ._core import call_learner, failed, passed

__all__ = ["check_rms_norm", "check_square_function", "check_fp8_scale"]


def _rms_norm_reference(h: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float64: the answer every version is compared with."""
    x = h.double()
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def check_rms_norm(rms_norm: Callable[[torch.Tensor], torch.Tensor], eps: float = 1e-6) -> None:
    """Exercise 5.1: rms_norm(h) stays accurate for fp16 activations, large and small, under fp16 autocast."""
    title = "Exercise 5.1 (RMSNorm in an fp32 island)"
    gen = torch.Generator().manual_seed(5)
    for magnitude in (1.0, 500.0, 3000.0, 3e-3):
        h = (torch.randn(4, 64, generator=gen) * magnitude).half()
        with torch.autocast("cpu", dtype=torch.float16):
            out = call_learner(title, rms_norm, h)
        if not isinstance(out, torch.Tensor) or not out.is_floating_point() or out.shape != h.shape:
            failed(title, f"a floating-point tensor of shape {tuple(h.shape)}", repr(out)[:80], "return the normalised tensor")
        want = _rms_norm_reference(h, eps)
        got = out.detach().double()
        if not torch.isfinite(got).all():
            failed(title, f"finite values for activations of size ~{magnitude:g}", "inf or NaN",
                   "h * h overflows fp16 above 256: cast to float32 before squaring")
        err = ((got - want).abs() / (want.abs() + 1e-3)).max().item()
        if err > 2e-3:
            failed(title, f"relative error below 2e-3 for activations of size ~{magnitude:g} (output dtype {out.dtype})",
                   f"relative error {err:.2g}",
                   "compute in h.float(): autocast leaves elementwise ops in their inputs' dtype, so fp16 squares "
                   "overflow or become subnormals, and bf16 keeps only 8 bits (autocast(enabled=False) alone "
                   "casts nothing back; it matters only once the island holds a matmul, linear or conv)")
    passed(title, "Squares, mean and rsqrt run in fp32, so neither overflow nor subnormals bite. The .float() cast "
                  "is what did it; for an island with a matmul inside, also turn autocast off.")


def check_square_function(square_cls: Any) -> None:
    """Exercise 5.2: a torch.autograd.Function whose forward squares in fp32 under fp16 autocast, with the right gradient."""
    title = "Exercise 5.2 (custom autograd function under autocast)"
    if not (isinstance(square_cls, type) and issubclass(square_cls, torch.autograd.Function)):
        failed(title, "a subclass of torch.autograd.Function", repr(square_cls)[:80],
               "pass the class itself (class Square(torch.autograd.Function): ...)")
    x = torch.tensor([300.0, -2.5, 1e-3, 0.0], dtype=torch.float16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.float16):
        out = call_learner(title, square_cls.apply, x)
    if not isinstance(out, torch.Tensor) or out.dtype != torch.float32:
        failed(title, "a float32 output under fp16 autocast", getattr(out, "dtype", repr(out)),
               "decorate forward with @torch.amp.custom_fwd(device_type=..., cast_inputs=torch.float32)")
    want = x.detach().double() ** 2
    if not torch.allclose(out.detach().double(), want, rtol=1e-6, atol=0):
        failed(title, f"x * x = {want.tolist()}", out.detach().tolist(), "square the (fp32) input")
    try:
        out.sum().backward()
    except Exception as err:  # the learner's backward: report any failure as feedback
        failed(title, "a working backward", f"{type(err).__name__}: {err}", "return grad_output * 2 * x (save x in forward)")
    grad = None if x.grad is None else x.grad.double()
    if grad is None or not torch.allclose(grad, 2 * x.detach().double(), rtol=1e-3):
        failed(title, f"d(x*x)/dx = 2x = {(2 * x.detach().double()).tolist()}", None if grad is None else grad.tolist(),
               "backward gets grad_output; multiply it by 2 * x")
    passed(title, "cast_inputs=torch.float32 ran the forward in fp32 with autocast off; custom_bwd matched the backward.")


def _fp8_scale_reference(t: torch.Tensor, fmt: str) -> float:
    """The largest power of two s with max|t| * s <= fmt's largest value (1.0 for an all-zero tensor).

    That is an MX scale rounded up, RCEIL (NVIDIA's and torchao's default): 1 / s is ``ampcourse.fp8``'s
    ``mx_rounding="rceil"`` scale, so nothing clips. The OCP MX v1.0 spec itself rounds down (``"floor"``).
    """
    amax = t.detach().abs().max().item()
    if amax == 0:
        return 1.0
    from .. import fp8  # the one home of the MX scale rules

    return 1.0 / fp8._mx_scale(torch.tensor(amax, dtype=torch.float64), formats.spec(fmt), "rceil").item()


def _ocp_floor_scale(amax: float, fmt: str) -> float:
    """What OCP MX v1.0's floor rule gives as a multiplier: 2**(emax - floor(log2(amax))); may saturate."""
    return 2.0 ** (formats.spec(fmt).emax - math.floor(math.log2(amax)))


def check_fp8_scale(fp8_scale: Callable[[torch.Tensor], float], fmt: str = "fp8_e4m3") -> None:
    """Exercise 5.3: fp8_scale(t) is the largest power of two s with max|t| * s <= the fp8 maximum.

    That rule is the MX scale rounded up (RCEIL, as NVIDIA and torchao compute it), not the OCP MX v1.0
    spec's floor rule, which lets a block's largest values saturate; a floor answer gets a hint that says so.
    """
    f = formats.spec(fmt)
    title = f"Exercise 5.3 (power-of-two scale for {f.name})"
    cases = [torch.tensor([1.0, -0.5]), torch.tensor([f.max]), torch.tensor([f.max + 1]), torch.tensor([1e-3, 2e-4]),
             torch.tensor([3.5, -700.0, 2.0]), torch.tensor([0.1, -1.9]), torch.tensor([0.0, 0.0]), torch.randn(100, generator=torch.Generator().manual_seed(0)) * 37]
    for t in cases:
        want = _fp8_scale_reference(t, fmt)
        got = call_learner(title, fp8_scale, t)
        try:
            got = float(got)
        except (TypeError, ValueError):
            failed(title, "a number", repr(got)[:80], "return the scale as a float")
        if got != want:
            amax = t.abs().max().item()
            hint = ("a power of two (2**k): fp8 scales in MX formats are stored as a bare exponent" if got > 0 and math.frexp(got)[0] != 0.5
                    else ("that is the OCP MX spec's floor rule (2**(emax - floor(log2 amax))): "
                          f"{amax:g} x {got:g} = {amax * got:g} saturates at {f.max:g}; round the scale's exponent "
                          "the other way, so nothing clips (RCEIL)") if amax > 0 and got == _ocp_floor_scale(amax, fmt)
                    else f"use max(|t|) (here {amax:g}), the largest magnitude, not the largest value" if got * t.max().item() <= f.max < got * amax
                    else f"the largest k with {amax:g} * 2**k <= {f.max:g}")
            failed(title, f"fp8_scale(tensor with max|t| = {amax:g}) == {want!r}", got, hint)
    passed(title, f"Scaled tensors use {f.name}'s top binade without saturating at {f.max:g}. This is the MX "
           "scale rounded up (RCEIL, torchao's default); the OCP spec's floor rule can saturate (chapter 9).")
