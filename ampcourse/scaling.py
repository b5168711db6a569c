"""Loss scaling, written out: a from-scratch ``torch.amp.GradScaler`` and the tools of chapter 6.

    >>> from ampcourse.scaling import LossScaler
    >>> scaler = LossScaler("cpu")                 # same arguments as torch.amp.GradScaler("cpu")
    >>> scaler.scale(loss).backward()              # gradients of loss * scale
    >>> scaler.unscale_(optimizer)                 # optional: divide the gradients back (e.g. to clip)
    >>> scaler.step(optimizer)                     # optimizer.step(), skipped if a gradient is inf/NaN
    >>> scaler.update()                            # back off after an overflow, grow after a clean run

``LossScaler`` behaves exactly like ``torch.amp.GradScaler`` (the tests drive both through random
sequences of clean and overflowing steps and compare scales, skipped steps and parameters bit for
bit), but it is plain PyTorch tensor code you can read in one sitting. Two details it copies from
torch's kernels, because they decide the last bit:

- the scale is a float32 tensor; growth and backoff multiply it in float64 and round the product
  to float32 once (``_amp_update_scale_``), and an update that would overflow float32 is dropped;
- unscaling multiplies by ``1 / scale`` computed in float64 and rounded to float32, and low-precision
  gradients are multiplied in float32 and rounded once (``_amp_foreach_non_finite_check_and_unscale_``);
  even the bits of NaN gradients come out as that CPU kernel writes them (see ``_nan_bits_like_kernel``).

It has the whole public API of ``torch.amp.GradScaler``: ``scale`` (a tensor or nested lists/tuples/iterables),
``unscale_``, ``step`` (fused optimizers included), ``update(new_scale)``, ``get_scale``, ``get``/``set_growth_factor``,
``get``/``set_backoff_factor``, ``get``/``set_growth_interval``, ``is_enabled``, ``state_dict``/``load_state_dict``
and pickling; tests/test_gradscaler_upstream.py runs PyTorch's own GradScaler tests against both. It leaves
out GradScaler's private pieces (``_unscale_grads_``, ``_per_optimizer_states``, ``_check_inf_per_device``,
per-device found-inf dicts for multi-GPU models) and the deprecated ``step(grad_scaler=...)`` protocol.

Where it differs on purpose: bad constructor and setter arguments raise ``ValueError`` naming the argument
(GradScaler asserts only on the two factors; it takes ``growth_interval=2**63`` and fails inside torch at the
first ``update()``), numbers may be numpy or 0-d tensor scalars (stored as Python numbers), and misuse that GradScaler reports with an
``AssertionError`` (``step``/``update`` before ``scale``, ``update`` without any ``step``) is a
``RuntimeError`` saying what to do. The misuse errors GradScaler raises as ``RuntimeError``
(``unscale_`` twice, ``step`` twice, closures) are the same here. Two more, where GradScaler gets stuck or
poisoned: ``step`` with no gradient says "call backward() first" and forgets that iteration, so doing just
that works (GradScaler keeps refusing); ``update(new_scale)`` refuses nan, inf, 0 and negative scales given
as tensors too (GradScaler copies them in, and every later step is skipped).

Also here: :func:`simulate_scale` (the scale trajectory for a given overflow pattern, without a
model), :func:`simulate_training` (the same with feedback: a step overflows when scale x its largest
gradient leaves the format), :func:`range_counts` and :class:`RangeCounter` (how many values overflow,
go subnormal or flush to zero in a format at a given scale) and :func:`record_gradients` (the real
gradients of one forward/backward pass).
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from . import _args, _scaler, formats
from .models import data_errors

__all__ = ["LossScaler", "simulate_scale", "simulate_training", "range_counts", "RANGE_CATEGORIES",
           "zone_thresholds", "RangeCounter",
           "GradientRecord", "record_gradients", "EXACT_NOISE"]

_READY, _UNSCALED, _STEPPED = "ready", "unscaled", "stepped"  # per-optimizer stage within one iteration


# GradScaler's settings have one owner, ampcourse._scaler (defaults, checks, saved states): the checks below are its
# check_args. Its limit and its float32 rounding keep short names here (this module and the scaler widget use them).
MAX_GROWTH_INTERVAL = _scaler.MAX_GROWTH_INTERVAL
_float32 = _scaler._float32


def _next_scale(scale: float, tracker: int, overflow: bool, growth_factor: float, backoff_factor: float,
                growth_interval: int) -> tuple[float, int]:
    """One update() on Python floats, rounded to float32 exactly as torch's kernel does."""
    if overflow:
        return _float32(scale * backoff_factor), 0  # back off, and start counting clean steps again
    if tracker + 1 == growth_interval:
        grown = _float32(scale * growth_factor)
        return (grown if math.isfinite(grown) else scale), 0  # never grow past float32's largest value
    return scale, tracker + 1


def _sequence(values, name: str, what: str) -> Iterable:
    """values if it is an iterable other than a string; ValueError naming it otherwise."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise ValueError(f"{name} must be a sequence of {what}, got {values!r}")
    return values


def simulate_scale(overflows: Iterable[bool], init_scale: float = 2.0**16, growth_factor: float = 2.0,
                   backoff_factor: float = 0.5, growth_interval: int = 2000) -> list[float]:
    """The scale after each update() for a sequence of steps (True: that step overflowed), as GradScaler computes it."""
    init_scale, growth_factor, backoff_factor, growth_interval = _scaler.check_args(
        init_scale, growth_factor, backoff_factor, growth_interval)
    overflows = _sequence(overflows, "overflows", "booleans (True: that step overflowed)")
    scale, tracker, out = _float32(init_scale), 0, []
    for overflow in overflows:
        scale, tracker = _next_scale(scale, tracker, bool(overflow), growth_factor, backoff_factor, growth_interval)
        out.append(scale)
    return out


def simulate_training(max_grads: Iterable[float], init_scale: float = 2.0**16, growth_factor: float = 2.0,
                      backoff_factor: float = 0.5, growth_interval: int = 2000,
                      fmt: str = "fp16") -> tuple[list[float], list[bool]]:
    """Dynamic scaling with feedback: step i overflows when scale * max_grads[i] overflows fmt; (scales, overflows)."""
    init_scale, growth_factor, backoff_factor, growth_interval = _scaler.check_args(
        init_scale, growth_factor, backoff_factor, growth_interval)
    limit = zone_thresholds(fmt)[2]
    max_grads = formats._real_array(_sequence(max_grads, "max_grads", "numbers (each step's largest |gradient|)"),
                                    "max_grads").ravel().tolist()
    scale, tracker, scales, overflows = _float32(init_scale), 0, [], []
    for g in max_grads:
        overflow = not (abs(g) * scale < limit)  # NaN and inf gradients overflow too
        scale, tracker = _next_scale(scale, tracker, overflow, growth_factor, backoff_factor, growth_interval)
        scales.append(scale)
        overflows.append(overflow)
    return scales, overflows


def _update_scale_(scale: torch.Tensor, growth_tracker: torch.Tensor, found_inf: torch.Tensor,
                   growth_factor: float, backoff_factor: float, growth_interval: int) -> None:
    """One update of the scale and the clean-step counter, in place, with tensor ops (no host sync)."""
    found = found_inf > 0
    successful = growth_tracker + 1
    grow = ~found & (successful == growth_interval)
    wide = _wide_dtype(scale.device)  # products in float64, rounded to float32 once, like torch's kernel
    backed_off = (scale.to(wide) * backoff_factor).float()
    grown = (scale.to(wide) * growth_factor).float()
    grown = torch.where(torch.isfinite(grown), grown, scale)  # never grow to inf
    scale.copy_(torch.where(found, backed_off, torch.where(grow, grown, scale)))
    growth_tracker.copy_(torch.where(found | grow, torch.zeros_like(successful), successful))


def _wide_dtype(device: torch.device) -> torch.dtype:
    """float64 where the device has it (Apple MPS does not), for the reciprocal and the scale updates."""
    return torch.float32 if device.type == "mps" else torch.float64


def _unscale_and_check_(grads: Sequence[torch.Tensor], inv_scale: torch.Tensor, found_inf: torch.Tensor) -> None:
    """Multiply each gradient by inv_scale in place and set found_inf to 1 if any input value was inf or NaN."""
    for g in grads:
        # Check the *scaled* values: a finite gradient that overflows only after unscaling is not caught,
        # exactly as in torch's kernel.
        nonfinite = (~torch.isfinite(g)).any().to(device=found_inf.device, dtype=found_inf.dtype)
        found_inf.copy_(torch.maximum(found_inf, nonfinite))
        inv = inv_scale.to(g.device)
        if g.dtype in (torch.float16, torch.bfloat16):
            out = (g.float() * inv).to(g.dtype)  # compute in float32 and round once, like the kernel
            g.copy_(_nan_bits_like_kernel(out, g))
        elif inv.device.type == "cpu":
            # The kernel leaves the values alone when inv_scale is exactly 1 (a signalling NaN stays signalling);
            # float64 widens the float32 reciprocal exactly. Reading a CPU scalar costs no sync.
            if inv.item() != 1.0:
                g.mul_(inv.to(g.dtype))
        else:
            g.copy_(torch.where(inv == 1, g, g * inv.to(g.dtype)))  # the same choice, without a host sync


#: Elements of a 16-bit format the kernel's vectorised loop handles per step, by torch's CPU capability; the
#: scalar tail converts the rest (see _nan_bits_like_kernel). Measured: 32 on AVX512 and on AVX2 (forced with
#: ATEN_CPU_CAPABILITY=avx2). Capabilities not listed (DEFAULT: no vector kernel) convert element by element.
_LANES = {"AVX512": 32, "AVX2": 32}
#: torch's at::parallel_for splits an element-wise kernel across threads only above this many elements.
_GRAIN_SIZE = 32768


def _nan_bits_like_kernel(out: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """out (grad unscaled, in fp16/bf16) with every NaN given the bit pattern torch's CPU unscale kernel writes.

    The values are the same either way; only the bits of NaNs differ, and "bit for bit" includes them.
    A plain cast widens and narrows NaNs with vector instructions that replace them by 0x7FFF (fp16) or
    0xFFFF (bf16); the kernel converts element by element in places:
    fp16 with a vector kernel (AVX2/AVX512): a NaN keeps its sign and payload and becomes quiet
    (bits | 0x0200); without one: sign | 0x7E00. A NaN made by inf x 0 is the x86 default NaN, 0xFE00.
    bf16: the kernel's vectorised body writes 0xFFFF, but its scalar tail, the last len % lanes elements
    of each thread's share, writes 0x7FC0 (c10::BFloat16's NaN). Small tensors such as biases lie wholly
    in the tail: that was the 0xFFFF-versus-0x7FC0 mismatch.
    """
    if out.device.type != "cpu":  # measured on CPU kernels only; and on a GPU the check below would be a host sync
        return out
    nan = torch.isnan(out)
    if not bool(nan.any()):  # the common case: nothing to fix
        return out
    bits = out.view(torch.int16)
    lanes = _LANES.get(torch.backends.cpu.get_cpu_capability())
    if out.dtype == torch.float16:
        kept = grad.view(torch.int16) | 0x0200 if lanes else (grad.view(torch.int16) & -0x8000) | 0x7E00
        made = torch.tensor(0xFE00 - 0x10000, dtype=torch.int16)  # int16 holds the bits 0xFE00 as a negative
        return torch.where(nan, torch.where(torch.isnan(grad), kept, made), bits).view(torch.float16)
    if not out.is_contiguous():
        return out
    tail = torch.ones(out.numel(), dtype=torch.bool) if lanes is None else _scalar_tail(out.numel(), lanes)
    canonical = torch.tensor(0x7FC0, dtype=torch.int16)
    return torch.where(nan & tail.view(out.shape), canonical, bits).view(torch.bfloat16)


def _scalar_tail(n: int, lanes: int) -> torch.Tensor:
    """Which of n elements torch's element-wise CPU loop handles one at a time: per thread's share, the last n % lanes."""
    threads = torch.get_num_threads()
    tasks = 1 if n <= _GRAIN_SIZE or threads == 1 else min(threads, -(-n // _GRAIN_SIZE))
    chunk = -(-n // tasks)
    tail = torch.zeros(n, dtype=torch.bool)
    for begin in range(0, n, chunk):
        end = min(n, begin + chunk)
        tail[end - (end - begin) % lanes:end] = True
    return tail


@dataclass
class _OptimizerState:
    """What the scaler knows about one optimizer during the current iteration."""

    stage: str = _READY
    found_inf: torch.Tensor | None = None  # 1.0 if a gradient was inf/NaN, on the scale's device


class LossScaler:
    """Dynamic loss scaling, written out; behaves exactly like ``torch.amp.GradScaler``.

    * ``scale(loss)`` multiplies the loss by the scale factor, so that small fp16 gradients do not flush to zero.
    * ``step(optimizer)`` unscales the gradients (unless ``unscale_`` already did) and calls ``optimizer.step()``,
      unless a gradient is inf or NaN: then the step is skipped.
    * ``update()`` backs the scale off by `backoff_factor` after a skipped step, and grows it by `growth_factor`
      after `growth_interval` clean steps in a row.

    Args:
        device: where the losses live (``'cpu'``, ``'cuda'``, ...). Default: ``'cpu'``.
        init_scale: the first scale factor. Default: ``2.0**16``.
        growth_factor: multiplies the scale after `growth_interval` clean steps (> 1). Default: 2.0.
        backoff_factor: multiplies the scale after an overflow (between 0 and 1). Default: 0.5.
        growth_interval: clean steps in a row before the scale grows (1 .. 2**31 - 1). Default: 2000.
        enabled: False makes every method a pass-through (fp32, bf16). Default: True.

    The defaults are GradScaler's; their one owner is ``ampcourse._scaler``, which also checks them.

    Example::

        >>> scaler = LossScaler("cpu")
        >>> for x, y in batches:
        ...     optimizer.zero_grad()
        ...     with torch.autocast("cpu", dtype=torch.float16):
        ...         loss = loss_fn(model(x), y)
        ...     scaler.scale(loss).backward()
        ...     scaler.unscale_(optimizer)                      # optional: to clip the true gradients
        ...     torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        ...     scaler.step(optimizer)                          # skipped if a gradient is inf/NaN
        ...     scaler.update()
    """

    def __init__(self, device: str | torch.device = "cpu", init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True) -> None:
        init_scale, growth_factor, backoff_factor, growth_interval = _scaler.check_args(
            init_scale, growth_factor, backoff_factor, growth_interval)
        self.device = _device_type(device)
        self._enabled = bool(enabled)
        if self._enabled and self.device == "cuda" and not torch.cuda.is_available():
            warnings.warn("LossScaler('cuda') is enabled, but CUDA is not available: disabling it "
                          "(like torch.amp.GradScaler). Use LossScaler('cpu') or ampcourse.device.pick().",
                          stacklevel=2)
            self._enabled = False
        self._init_scale = init_scale
        self._init_growth_tracker = 0
        self._growth_factor = growth_factor
        self._backoff_factor = backoff_factor
        self._growth_interval = growth_interval
        # Created by the first scale() call, on the loss's device (so no device needs to be guessed here).
        self._scale: torch.Tensor | None = None
        self._growth_tracker: torch.Tensor | None = None
        self._per_optimizer: dict[int, _OptimizerState] = {}

    def __repr__(self) -> str:
        if not self._enabled:
            return f"LossScaler(device={self.device!r}, enabled=False)"
        return (f"LossScaler(device={self.device!r}, scale={self.get_scale()!r}, growth_tracker={self.growth_tracker}, "
                f"growth_factor={self._growth_factor}, backoff_factor={self._backoff_factor}, "
                f"growth_interval={self._growth_interval})")

    # -- multiply the loss ---------------------------------------------------------------------------
    def scale(self, outputs):
        """Multiply a loss (or a nested list/tuple of tensors) by the current scale."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            self._lazy_init(outputs.device)
            # A 0-dim float32 tensor does not promote: an fp16 loss stays fp16 (and may overflow, as in torch).
            return outputs * self._scale.to(outputs.device)
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        if isinstance(outputs, Iterable) and not isinstance(outputs, (str, bytes)):
            return map(self.scale, outputs)
        raise ValueError(f"scale() takes a Tensor or an iterable of Tensors, got {type(outputs).__name__}")

    def _lazy_init(self, device: torch.device) -> None:
        """Create the scale (float32) and the clean-step counter (int32) on the device of the first loss."""
        if self._scale is None:
            self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=device)
            self._growth_tracker = torch.full((), self._init_growth_tracker, dtype=torch.int32, device=device)

    def _require_scale(self, method: str) -> torch.Tensor:
        """The scale tensor, or a RuntimeError that says scale(loss) must come first."""
        if self._scale is None:
            raise RuntimeError(f"{method}() was called before scale(loss): call scaler.scale(loss).backward() first "
                               "in every iteration")
        return self._scale

    # -- divide the gradients back -------------------------------------------------------------------
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale, in place, and remember whether any was inf/NaN."""
        if not self._enabled:
            return
        scale = self._require_scale("unscale_")
        state = self._state(optimizer)
        if state.stage == _UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update(): "
                               "call it at most once per iteration (step() knows the gradients are unscaled).")
        if state.stage == _STEPPED:
            raise RuntimeError("unscale_() is being called after step(): call it between backward() and step().")
        # 1/scale in float64, rounded to float32: float32 division can be imprecise under some compile options.
        inv_scale = scale.to(_wide_dtype(scale.device)).reciprocal().float()
        state.found_inf = self._check_and_unscale(optimizer, inv_scale, allow_fp16=False)
        state.stage = _UNSCALED

    def _check_and_unscale(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor,
                           allow_fp16: bool) -> torch.Tensor | None:
        """Unscale every gradient the optimizer owns; return found_inf (None if no parameter has a gradient)."""
        grads = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not allow_fp16 and p.grad.dtype == torch.float16:
                    raise ValueError("Attempting to unscale FP16 gradients: keep the parameters in float32 "
                                     "(autocast runs the matmuls in fp16 for you); fp16 parameters cannot hold "
                                     "the small updates that loss scaling exists to protect.")
                if p.grad.is_sparse:
                    if p.grad.dtype == torch.float16:
                        p.grad = p.grad.coalesce()  # duplicates summed first: the sum may overflow too
                    grads.append(p.grad._values())
                else:
                    grads.append(p.grad)
        if not grads:
            return None
        found_inf = torch.zeros((), dtype=torch.float32, device=self._scale.device)
        with torch.no_grad():
            _unscale_and_check_(grads, inv_scale, found_inf)
        return found_inf

    # -- step, or skip -------------------------------------------------------------------------------
    def step(self, optimizer: torch.optim.Optimizer, *args, **kwargs):
        """Unscale (unless done already) and call optimizer.step(), unless a gradient was inf or NaN."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not supported with loss scaling (nor by torch.amp.GradScaler).")
        scale = self._require_scale("step")
        state = self._state(optimizer)
        if state.stage == _STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            return self._fused_step(optimizer, state, scale, *args, **kwargs)
        if state.stage == _READY:
            self.unscale_(optimizer)
        if state.found_inf is None:
            self._no_gradients(optimizer)
        retval = None
        if not state.found_inf.item():  # the one host sync: the decision is made in Python
            retval = optimizer.step(*args, **kwargs)
        state.stage = _STEPPED
        return retval

    def _fused_step(self, optimizer: torch.optim.Optimizer, state: _OptimizerState, scale: torch.Tensor, *args, **kwargs):
        """Fused optimizers (Adam(fused=True), ...) unscale and skip inside their own kernel: hand them scale and found_inf."""
        if state.stage == _READY:  # check for inf/NaN without unscaling (fp16 gradients are fine here)
            state.found_inf = self._check_and_unscale(optimizer, torch.ones((), device=scale.device), allow_fp16=True)
        if state.found_inf is None:
            self._no_gradients(optimizer)
        # Already unscaled: nothing left to divide (grad_scale None); otherwise the optimizer divides by the scale.
        optimizer.grad_scale = (getattr(optimizer, "grad_scale", None) if state.stage == _UNSCALED
                                else scale * getattr(optimizer, "grad_scale", 1))
        optimizer.found_inf = state.found_inf
        try:
            retval = optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale, optimizer.found_inf
        state.stage = _STEPPED
        return retval

    def _no_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Raise the "call backward() first" error, after forgetting this optimizer's iteration.

        Forgetting it is what makes the advice work: an unscale_ that found no gradient would otherwise
        stay recorded, and step() after backward() would refuse again forever (GradScaler does that).
        """
        self._per_optimizer.pop(id(optimizer), None)
        raise RuntimeError("no parameter of this optimizer has a gradient: call backward() before step()")

    # -- adapt the scale -----------------------------------------------------------------------------
    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Back off after an overflow, grow after growth_interval clean steps (or set new_scale); end the iteration."""
        if not self._enabled:
            return
        scale = self._require_scale("update")
        if new_scale is not None:
            self._set_scale(new_scale)
        else:
            found = [s.found_inf for s in self._per_optimizer.values() if s.found_inf is not None]
            if not found:
                raise RuntimeError("update() found no inf checks: call step(optimizer) (or unscale_) before update()")
            found_inf = torch.stack([f.to(scale.device) for f in found]).sum()
            _update_scale_(scale, self._growth_tracker, found_inf,
                           self._growth_factor, self._backoff_factor, self._growth_interval)
        self._per_optimizer = {}  # a new iteration starts

    def _set_scale(self, new_scale: float | torch.Tensor) -> None:
        """Fill the scale with a number or a one-element tensor (the growth counter is left alone, as in torch)."""
        if isinstance(new_scale, torch.Tensor) and new_scale.dim() > 0:
            if new_scale.numel() != 1 or new_scale.requires_grad:
                raise ValueError("new_scale must be a positive finite number or a one-element tensor that does not "
                                 f"require grad, got a tensor of shape {tuple(new_scale.shape)}")
            new_scale = new_scale.reshape(())
        if isinstance(new_scale, torch.Tensor) and new_scale.requires_grad:
            raise ValueError("new_scale must be a positive finite number or a one-element tensor that does not "
                             "require grad")
        # A tensor is read once (a host sync GradScaler avoids): GradScaler copies nan, inf, 0 or a negative scale
        # in silently, after which every step is skipped or every gradient is nan. Here it is refused, like a number.
        value = _args.real(new_scale, "new_scale", positive=True, what="a positive finite number or a one-element tensor")
        if not math.isfinite(_float32(value)) or _float32(value) <= 0:
            raise ValueError(f"new_scale must be a positive finite float32 number, got {_args.shown(new_scale)} "
                             "(it overflows or underflows float32, the scale's dtype)")
        self._scale.fill_(value)

    def _state(self, optimizer: torch.optim.Optimizer) -> _OptimizerState:
        """This iteration's state for one optimizer (created on first use)."""
        return self._per_optimizer.setdefault(id(optimizer), _OptimizerState())

    # -- inspect, save, restore ----------------------------------------------------------------------
    def found_inf(self, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        """This iteration's inf/NaN flag for `optimizer` (> 0: its step is or was skipped); None before any check.

        Valid between ``unscale_``/``step`` and ``update()``, which starts a new iteration and forgets it. The flag stays
        on the scale's device (no host sync). GradScaler has no public accessor; ``train.step`` reads its private one.

        Args:
            optimizer: the optimizer this iteration unscaled or stepped.

        Example::

            >>> scaler.step(opt); skipped = bool(scaler.found_inf(opt)); scaler.update()
        """
        state = self._per_optimizer.get(id(optimizer)) if self._enabled else None
        return None if state is None or state.found_inf is None else state.found_inf.detach().clone()

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled)."""
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else self._scale.item()

    @property
    def growth_tracker(self) -> int:
        """Clean steps since the last growth or backoff."""
        if not self._enabled:
            return 0
        return self._init_growth_tracker if self._growth_tracker is None else int(self._growth_tracker.item())

    def is_enabled(self) -> bool:
        """Whether scaling is on (a disabled scaler passes everything through)."""
        return self._enabled

    def get_growth_factor(self) -> float:
        """The factor the scale grows by after growth_interval clean steps."""
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor (a finite number > 1; checked, unlike GradScaler)."""
        self._growth_factor = _scaler.check_args(self._init_scale, new_factor, self._backoff_factor,
                                                 self._growth_interval)[1]

    def get_backoff_factor(self) -> float:
        """The factor the scale shrinks by after an overflow."""
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the backoff factor (strictly between 0 and 1; checked, unlike GradScaler)."""
        self._backoff_factor = _scaler.check_args(self._init_scale, self._growth_factor, new_factor,
                                                  self._growth_interval)[2]

    def get_growth_interval(self) -> int:
        """How many clean steps in a row make the scale grow."""
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval (an int in 1..2**31 - 1; checked, unlike GradScaler)."""
        self._growth_interval = _scaler.check_args(self._init_scale, self._growth_factor, self._backoff_factor,
                                                   new_interval)[3]

    def state_dict(self) -> dict[str, Any]:
        """The scale, the three settings and the growth counter (the keys GradScaler uses; {} when disabled)."""
        if not self._enabled:
            return {}
        return {"scale": self.get_scale(), "growth_factor": self._growth_factor, "backoff_factor": self._backoff_factor,
                "growth_interval": self._growth_interval, "_growth_tracker": self.growth_tracker}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from state_dict() (ours or a torch.amp.GradScaler's); checked whole before anything changes."""
        if not self._enabled:
            return
        if not isinstance(state_dict, dict):
            raise ValueError(f"state_dict must be a dict from state_dict(), got {type(state_dict).__name__}")
        if len(state_dict) == 0:
            raise RuntimeError("The source state dict is empty, possibly because it was saved from a disabled scaler.")
        missing = {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"} - set(state_dict)
        if missing:
            raise ValueError(f"scaler state dict lacks {sorted(missing)}")
        scale, growth, backoff, interval = _scaler.check_args(state_dict["scale"], state_dict["growth_factor"],
                                                              state_dict["backoff_factor"], state_dict["growth_interval"])
        tracker = _args.integer(state_dict["_growth_tracker"], "_growth_tracker", low=0, high=MAX_GROWTH_INTERVAL)
        self._init_scale, self._growth_factor, self._backoff_factor = scale, growth, backoff
        self._growth_interval, self._init_growth_tracker = interval, tracker
        if self._scale is not None:
            self._scale.fill_(self._init_scale)
            self._growth_tracker.fill_(self._init_growth_tracker)

    def __getstate__(self) -> dict[str, Any]:
        """Pickle support, as GradScaler: only between iterations; the tensors are rebuilt lazily after unpickling."""
        if self._enabled and self._per_optimizer:
            raise RuntimeError("A LossScaler can only be pickled at the start of an iteration or after update().")
        state = self.__dict__.copy()
        if self._enabled:
            state["_init_scale"] = self.get_scale()
            state["_init_growth_tracker"] = self.growth_tracker
            state["_scale"] = state["_growth_tracker"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Undo __getstate__."""
        self.__dict__.update(state)


def _device_type(device: str | torch.device) -> str:
    """'cpu', 'cuda', ... from a device or its name; ValueError for anything else."""
    try:
        return torch.device(device).type
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"unknown device {device!r}; use 'cpu', 'cuda' or 'mps' (or ampcourse.device.pick().device_type)") from err


# -- where values land in a format -----------------------------------------------------------------------

#: The categories :func:`range_counts` sorts values into.
RANGE_CATEGORIES = ("overflow", "fine", "subnormal", "underflow", "zero")


def range_counts(values, scale: float = 1.0, fmt: str = "fp16") -> dict[str, int]:
    """Count how values * scale land in fmt: overflow (or already inf/NaN), fine, subnormal, underflow (flushed to 0), zero."""
    f = formats.spec(fmt)
    x = np.abs(formats._real_array(values)).ravel()
    scale = _positive_scale(scale)
    zero = x == 0
    finite = np.isfinite(x)
    with np.errstate(over="ignore"):
        scaled = np.where(finite, x, 0.0) * scale
    rounded = formats._round_unbounded(np.where(np.isfinite(scaled), scaled, 0.0), f)
    overflow = ~finite | ~np.isfinite(scaled) | (rounded > f.max)
    ok = ~overflow & ~zero
    underflow = ok & (rounded == 0)
    subnormal = ok & (rounded > 0) & (rounded < f.min_normal)
    fine = ok & (rounded >= f.min_normal)
    return {"overflow": int(overflow.sum()), "fine": int(fine.sum()), "subnormal": int(subnormal.sum()),
            "underflow": int(underflow.sum()), "zero": int(zero.sum())}


def _positive_scale(scale) -> float:
    """A loss scale as a float; ValueError unless it is a positive finite number."""
    value = formats._real(scale, "scale")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    return value


def zone_thresholds(fmt: str = "fp16") -> tuple[float, float, float]:
    """The magnitudes where rounding to fmt flushes to zero, leaves the subnormals, and overflows."""
    f = formats.spec(fmt)
    return f.min_subnormal / 2, f.min_normal - f.min_subnormal / 2, f.max + formats.ulp(f.max, f) / 2


class RangeCounter:
    """range_counts for many scales of one set of values: sort once, then each count is a binary search."""

    def __init__(self, values) -> None:
        x = np.abs(formats._real_array(values)).ravel()
        self.size = x.size
        self.zero = int((x == 0).sum())
        self.nonfinite = int((~np.isfinite(x)).sum())
        self.sorted = np.sort(x[(x > 0) & np.isfinite(x)])

    def counts(self, scale: float = 1.0, fmt: str = "fp16") -> dict[str, int]:
        """Same result as range_counts(values, scale, fmt); fast when scale is a power of two."""
        f = formats.spec(fmt)
        scale = _positive_scale(scale)
        # Each category is an interval of |x| * scale (rounding is monotone), so binary search finds its ends.
        # A power of two divides the thresholds exactly; any other scale multiplies the values instead.
        power_of_two = math.frexp(scale)[0] == 0.5
        with np.errstate(over="ignore"):
            y = self.sorted if power_of_two else self.sorted * scale
        div = scale if power_of_two else 1.0
        n = len(self.sorted)
        ends = []
        for t in zone_thresholds(f):
            # A value exactly on a threshold goes where round-to-nearest-even sends the threshold itself.
            goes_up = formats._round_unbounded(np.array([t]), f)[0] > t
            ends.append(int(np.searchsorted(y, t / div, side="left" if goes_up else "right")))
        flush_end, sub_end, fine_end = ends
        return {"overflow": n - fine_end + self.nonfinite, "fine": fine_end - sub_end, "subnormal": sub_end - flush_end,
                "underflow": flush_end, "zero": self.zero}


# -- real gradients of a model ------------------------------------------------------------------------------

@dataclass
class GradientRecord:
    """The gradients of one forward/backward pass: per parameter and (optionally) per module output."""

    loss: float
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    activations: dict[str, torch.Tensor] = field(default_factory=dict)

    def values(self, kind: str = "all") -> torch.Tensor:
        """All recorded gradient values as one flat float32 tensor ('params', 'activations' or 'all')."""
        if kind not in ("params", "activations", "all"):
            raise ValueError(f"kind must be 'params', 'activations' or 'all', got {kind!r}")
        parts = ([*self.params.values()] if kind in ("params", "all") else []) + \
                ([*self.activations.values()] if kind in ("activations", "all") else [])
        return torch.cat(parts) if parts else torch.zeros(0)


def record_gradients(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                     loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *,
                     activations: bool = True, exact: bool = False) -> GradientRecord:
    """Run one forward and backward pass in fp32 and keep every gradient (no optimizer step).

    With ``exact=True`` the pass runs in float64 on a copy of the model (the model is not touched) and each
    gradient is rounded once to float32, after values below ``EXACT_NOISE`` times their tensor's largest
    magnitude are set to 0. Why: an fp32 pass differs in its last bits from one machine's kernels to another's
    (AVX2 vs AVX512, cuBLAS versions: measured, most values differ), so counts of values near a format's
    limits move with the machine. In float64 only one kind of value still does: gradients that are exactly
    zero in exact arithmetic (a key bias: softmax ignores a shift of all its inputs) come out as rounding
    noise around 1e-16 of the tensor's scale, with a kernel-dependent exponent. Real gradients do not sit
    there, so they are kept; the noise becomes the 0 it stands for. The result is the same on every machine.
    """
    if exact:
        model = copy.deepcopy(model).double()
        inputs, targets = (t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                           for t in (inputs, targets))
    acts: dict[str, torch.Tensor] = {}

    def keep_output_grad(name: str):
        """A forward hook that asks autograd for the gradient of this module's output."""
        def hook(module, args, out):
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda g: acts.__setitem__(name, _recorded(g, exact)))
        return hook

    handles = []
    if activations:  # leaf modules only: their outputs are the tensors the backward pass stores and reads
        handles = [m.register_forward_hook(keep_output_grad(n)) for n, m in model.named_modules()
                   if n and not any(True for _ in m.children())]
    model.zero_grad(set_to_none=True)
    try:
        with data_errors(model, inputs, targets):
            loss = loss_fn(model(inputs), targets)
        loss.backward()
    finally:
        for h in handles:
            h.remove()
    params = {n: _recorded(p.grad, exact) for n, p in model.named_parameters() if p.grad is not None}
    return GradientRecord(float(loss.detach()), params, acts)


#: In record_gradients(exact=True): float64 values below this share of their tensor's largest magnitude are
#: cancellation noise (float64 rounding is 2**-53; measured noise ~1e-16 of the scale), stored as 0.
EXACT_NOISE = 2.0**-40


def _recorded(grad: torch.Tensor, exact: bool) -> torch.Tensor:
    """A gradient as the flat fp32 CPU tensor a GradientRecord keeps (exact: float64 noise flushed first)."""
    g = grad.detach()
    if exact and g.numel():
        g = torch.where(g.abs() < g.abs().max() * EXACT_NOISE, torch.zeros_like(g), g)
    return g.float().flatten().cpu()
