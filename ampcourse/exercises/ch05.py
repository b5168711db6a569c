"""Chapter 5 exercises: an fp32 island, a custom autograd function under autocast, an fp8 scale."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

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


class _AutocastSeen(TorchFunctionMode):
    """Records, for each torch call made while it is active, whether autocast was on for one device type.

    The check of exercise 5.2 runs ``Square.apply`` inside it: every op of the learner's forward passes through
    here, so "autocast was off inside forward" is observed, not inferred from the output's dtype (a forward that
    casts by hand, ``x.float() * x.float()``, gives the same fp32 output with autocast still on).

    Example::

        >>> with torch.autocast("cpu", dtype=torch.float16), _AutocastSeen("cpu") as seen:
        ...     y = x.float() * x.float()
        >>> seen.enabled   # [True, True, True]: autocast was on for each of the three calls
    """

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type
        self.enabled: list[bool] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.enabled.append(torch.is_autocast_enabled(self.device_type))
        return func(*args, **(kwargs or {}))


def _declared_device_type(function_cls: type) -> str | None:
    """The device_type that torch.amp.custom_fwd was given on `function_cls.forward`; None without the decorator.

    Read from the decorator's closure (torch 2.4+ keeps ``device_type`` there); anything else gives None.

    Args:
        function_cls: a torch.autograd.Function subclass.

    Example::

        >>> _declared_device_type(Square)   # 'cpu' for @torch.amp.custom_fwd(device_type="cpu", ...)
    """
    forward = inspect.getattr_static(function_cls, "forward", None)
    forward = getattr(forward, "__func__", forward)
    try:
        declared = inspect.getclosurevars(forward).nonlocals.get("device_type")
    except TypeError:  # not a Python function
        return None
    return declared if isinstance(declared, str) else None


def _square_device(declared: str | None) -> str:
    """Where 5.2 is checked: on CUDA when the learner's decorators name it and a GPU is here, else on the CPU."""
    return "cuda" if declared == "cuda" and torch.cuda.is_available() else "cpu"


def check_square_function(square_cls: Any) -> None:
    """Exercise 5.2: a torch.autograd.Function whose forward squares in fp32, with autocast off, under fp16 autocast,
    and whose backward gives the right gradient.

    It runs under fp16 autocast of the device type the learner's ``custom_fwd`` names (CUDA where a GPU is present,
    else the CPU), and watches the autocast state inside forward (:class:`_AutocastSeen`).
    """
    title = "Exercise 5.2 (custom autograd function under autocast)"
    if not (isinstance(square_cls, type) and issubclass(square_cls, torch.autograd.Function)):
        failed(title, "a subclass of torch.autograd.Function", repr(square_cls)[:80],
               "pass the class itself (class Square(torch.autograd.Function): ...)")
    declared = _declared_device_type(square_cls)
    device = _square_device(declared)
    other_device = declared is not None and declared != device
    device_hint = (f"your custom_fwd says device_type={declared!r}, but this check runs under {device} autocast "
                   f"(there is no {declared} device here), and a decorator for another device type does nothing: "
                   f"use device_type={device!r} (or x.device.type where the device varies)")
    x = torch.tensor([300.0, -2.5, 1e-3, 0.0], dtype=torch.float16, device=device, requires_grad=True)
    with torch.autocast(device, dtype=torch.float16), _AutocastSeen(device) as seen:
        out = call_learner(title, square_cls.apply, x)
    if not isinstance(out, torch.Tensor) or out.dtype != torch.float32:
        failed(title, f"a float32 output under fp16 autocast ({device})", getattr(out, "dtype", repr(out)),
               device_hint if other_device else
               f"decorate forward with @torch.amp.custom_fwd(device_type={device!r}, cast_inputs=torch.float32)")
    if any(seen.enabled):
        failed(title, f"forward run with {device} autocast off", "autocast was on inside forward",
               device_hint if other_device else
               f"the output is fp32, but forward ran under autocast (a matmul in it would still run in fp16): decorate "
               f"forward with @torch.amp.custom_fwd(device_type={device!r}, cast_inputs=torch.float32), which casts "
               "the inputs and turns autocast off inside it")
    want = x.detach().double().cpu() ** 2
    if not torch.allclose(out.detach().double().cpu(), want, rtol=1e-6, atol=0):
        failed(title, f"x * x = {want.tolist()}", out.detach().cpu().tolist(), "square the (fp32) input")
    try:
        out.sum().backward()
    except Exception as err:  # the learner's backward: report any failure as feedback
        failed(title, "a working backward", f"{type(err).__name__}: {err}", "return grad_output * 2 * x (save x in forward)")
    grad = None if x.grad is None else x.grad.double().cpu()
    want_grad = 2 * x.detach().double().cpu()
    if grad is None or not torch.allclose(grad, want_grad, rtol=1e-3):
        failed(title, f"d(x*x)/dx = 2x = {want_grad.tolist()}", None if grad is None else grad.tolist(),
               "backward gets grad_output; multiply it by 2 * x")
    passed(title, f"Forward ran in fp32 with {device} autocast off (cast_inputs=torch.float32, checked inside it), "
                  "and backward returned grad_output * 2x.")


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
