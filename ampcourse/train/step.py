"""One optimizer step under AMP (:func:`train_step`), the optimizers and schedulers train() builds, and a checksum.

Each AMP decision in :func:`train_step` carries a comment saying why: backward outside autocast, unscale
before clipping, the scaler's own inf/NaN flag as the skip signal, one read-back of losses, norms, scales
and that flag per step.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from .. import _args
from ..device import AmpSetup

__all__ = ["OPTIMIZERS", "SCHEDULERS", "StepStats", "optimizer_settings", "make_optimizer", "default_fused", "make_scheduler", "train_step",
           "state_checksum"]

OPTIMIZERS = ("adamw", "adam", "sgd")
SCHEDULERS = ("cosine",)


@dataclass
class StepStats:
    """What one optimizer step did."""

    loss: float  # mean loss over the global (local) batch, unscaled
    grad_norm: float  # L2 norm of the true (unscaled) gradients, before clipping; inf/nan if non-finite
    scale: float  # the loss scale this step used (1.0 without a scaler)
    skipped: bool  # the GradScaler found inf/nan and skipped optimizer.step()
    lr: float  # learning rate of the first param group during this step


#: The largest float32: torch's optimizers hand lr and weight_decay to float32 kernels (``_foreach_*`` with a
#: scalar), which fail in the first step with "value cannot be converted to type float without overflow".
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)
#: The smallest positive float32 (a subnormal): a smaller lr rounds to 0 there, and the run would silently not learn.
_FLOAT32_TINY = 2.0**-149


def optimizer_settings(lr: Any, weight_decay: Any = 0.0) -> tuple[float, float]:
    """lr and weight_decay as Python floats a float32 optimizer can use; ValueError naming the bad one.

    Args:
        lr: the learning rate, > 0 and within float32's range (2**-149 .. 3.4e38).
        weight_decay: >= 0 and at most 3.4e38.

    Example::

        >>> optimizer_settings(np.float64(1e-3))   # (0.001, 0.0)
        >>> optimizer_settings(1e39)               # ValueError: lr must be ... (float32 overflows)
    """
    lr = _args.real(lr, "lr", positive=True)
    if not _FLOAT32_TINY <= lr <= _FLOAT32_MAX:
        raise ValueError(f"lr must be a number float32 can hold (2**-149 .. 3.4e38), got {lr!r}: the optimizer "
                         f"computes in float32, where it would {'overflow' if lr > 1 else 'round to 0'}; "
                         "a typical lr is 1e-4 .. 1e-2")
    weight_decay = _args.real(weight_decay, "weight_decay", nonnegative=True)
    if weight_decay > _FLOAT32_MAX:
        raise ValueError(f"weight_decay must be at most float32's largest number (3.4e38), got {weight_decay!r}; "
                         "a typical weight_decay is 0 .. 0.1")
    return lr, weight_decay


def make_optimizer(spec: str | Callable, params, lr: float, weight_decay: float = 0.0,
                   fused: bool | None = None) -> torch.optim.Optimizer:
    """'adamw', 'adam', 'sgd' (plain, no momentum) or a callable(params, lr, weight_decay).

    fused (Adam/AdamW only): one fused kernel per step that also takes GradScaler's inf check on the device,
    so scaler.step() needs no host sync. None: :func:`default_fused` decides (fused when every parameter is
    on a CUDA device). A loop written by hand that must match train() bit for bit builds its optimizer here
    too: fused and foreach AdamW round differently (chapter 4).

    Example::

        >>> opt = make_optimizer("adamw", model.parameters(), lr=1e-3)   # what train() uses
    """
    if callable(spec):
        made = spec(params, lr=lr, weight_decay=weight_decay)
        if not isinstance(made, torch.optim.Optimizer):  # else AttributeError: ... has no attribute 'zero_grad'
            raise ValueError(f"optimizer callable must return a torch.optim.Optimizer, got {type(made).__name__}")
        return made
    lr, weight_decay = optimizer_settings(lr, weight_decay)  # not a RuntimeError at the first step
    if spec in ("adam", "adamw"):
        params = list(params)
        if fused is None:
            fused = default_fused(params)
        cls = torch.optim.AdamW if spec == "adamw" else torch.optim.Adam
        return cls(params, lr=lr, weight_decay=weight_decay, **({"fused": True} if fused else {}))
    if spec == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {spec!r}; choose one of {', '.join(OPTIMIZERS)} or pass a callable")


def default_fused(params: Sequence[Any]) -> bool:
    """train()'s choice of fused Adam/AdamW: True when there are parameters and every one is on a CUDA device."""
    return bool(params) and all(isinstance(p, torch.Tensor) and p.device.type == "cuda" for p in params)


def make_scheduler(spec: str | Callable | None, optimizer: torch.optim.Optimizer, steps: int):
    """None, 'cosine' (to zero over `steps`) or a callable(optimizer) returning an LRScheduler."""
    if spec is None:
        return None
    if callable(spec):
        made = spec(optimizer)
        if not all(callable(getattr(made, name, None)) for name in ("step", "state_dict", "load_state_dict")):
            raise ValueError(f"scheduler callable must return an LR scheduler (step, state_dict, load_state_dict), "
                             f"such as torch.optim.lr_scheduler.LambdaLR(optimizer, ...); got {type(made).__name__}")
        return made
    if spec == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    raise ValueError(f"unknown scheduler {spec!r}; choose None, {', '.join(SCHEDULERS)} or pass a callable")


def _grad_sync(model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    """DDP's no_sync() for micro-batches before the last: all-reduce once per window, not per micro-batch."""
    if sync or not hasattr(model, "no_sync"):
        return contextlib.nullcontext()
    return model.no_sync()


#: Up to this many gradient values on a CPU, the norm is taken over one concatenated copy (see _squared_norm_parts).
_CPU_CONCAT_NORM_MAX = 1 << 20


def _full(norm: torch.Tensor) -> torch.Tensor:
    """FSDP2's gradient norm is a DTensor of per-shard partial norms: the whole norm (a collective, on every rank)."""
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def _squared_norm_parts(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """0-dim tensors whose sum is the squared total L2 norm of the gradients, computed without a host sync.

    Why not get_total_norm: on every step it sorts the tensors into (device, dtype) groups and launches
    one kernel per tensor plus two more; on a CPU, where each extra kernel of a training step costs
    microseconds, that was several percent of a tiny model's step (benchmarks/README.md). So: plain
    dense float32 gradients on a CPU, up to _CPU_CONCAT_NORM_MAX values: one concatenated copy and one
    BLAS dot product. Plain dense gradients on one device and dtype otherwise: the per-tensor norms from
    the fused kernel get_total_norm uses, squared. A sparse gradient (which torch's norms refuse) counts by
    its coalesced values. Anything else (DTensor shards, mixed gradients): get_total_norm itself (made whole
    across FSDP2 shards), squared. Like torch's norms, this accumulates in the gradients' dtype.
    """
    if not grads:
        return []
    # a sparse gradient (Embedding(sparse=True)) has the norm of its coalesced values; torch's norms refuse it
    grads = [g.coalesce().values() if g.is_sparse else g for g in grads]
    first = grads[0]
    device, dtype = first.device, first.dtype
    if not all(type(g) is torch.Tensor and g.layout == torch.strided and g.device == device and g.dtype == dtype
               for g in grads):
        return [_full(torch.nn.utils.get_total_norm(grads)).square()]
    if device.type == "cpu" and dtype == torch.float32 and sum(g.numel() for g in grads) <= _CPU_CONCAT_NORM_MAX:
        flat = torch.cat([g.reshape(-1) for g in grads])
        return [torch.dot(flat, flat)]
    norms = torch._foreach_norm(grads, 2.0)
    return list(torch._foreach_mul(norms, norms))


def _scale_tensor(scaler: torch.amp.GradScaler) -> torch.Tensor | None:
    """A copy of the scaler's scale, still on the device (no host sync); None when the scaler is disabled.

    A copy because update() changes the scale in place. get_scale() would be a .item(): a host sync.
    """
    if not scaler.is_enabled():
        return None
    scale = getattr(scaler, "_get_scale_async", lambda: None)()
    return scale.detach().clone() if isinstance(scale, torch.Tensor) else None


def _found_inf(scaler: Any, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
    """This step's inf/NaN flag for `optimizer` (> 0: its step was skipped), still on the device; None if unknown.

    Read between ``scaler.step()`` and ``scaler.update()``: update() starts a new iteration and forgets it.
    torch.amp.GradScaler (and FSDP1's ShardedGradScaler) keep one flag per device in
    ``_per_optimizer_states[id(optimizer)]["found_inf_per_device"]`` (no public accessor: its layout is read here
    and nowhere else); the course's ``scaling.LossScaler`` answers ``found_inf(optimizer)``. Why not compare the scale before and after: once it
    has backed off to 0 (about 166 overflows in a row from 2**16 in float32), 0 * 0.5 == 0, and a skip no
    longer lowers it.

    Args:
        scaler: the enabled scaler that just ran ``step(optimizer)``.
        optimizer: the optimizer it stepped (or skipped).

    Example::

        >>> scaler.step(opt); flag = _found_inf(scaler, opt); scaler.update()
        >>> bool(flag)   # True if opt.step() was skipped
    """
    states = getattr(scaler, "_per_optimizer_states", None)
    if isinstance(states, dict):  # torch's GradScaler; .get, not [], so that its defaultdict gains no entry
        flags = list((states.get(id(optimizer)) or {}).get("found_inf_per_device", {}).values())
    elif callable(getattr(scaler, "found_inf", None)):
        found = scaler.found_inf(optimizer)
        flags = [found] if found is not None else []
    else:
        flags = []
    if not flags or not all(isinstance(f, torch.Tensor) for f in flags):
        return None
    # A new tensor, summed on the first flag's device without a sync: update() adds the other optimizers'
    # flags into GradScaler's first one in place.
    return torch.stack([f.detach().to(flags[0].device, torch.float32) for f in flags]).sum()


def _read_back(tensors: list[torch.Tensor]) -> list[float]:
    """0-dim tensors as Python floats: on a GPU stacked into one device-to-host copy, on a CPU one by one."""
    first = tensors[0]
    if first.device.type != "cpu" and all(type(t) is torch.Tensor and t.device == first.device for t in tensors):
        with torch.no_grad():
            return torch.stack(tensors).tolist()  # stack promotes mixed dtypes to the widest
    return [t.item() for t in tensors]  # a CPU has no sync to save, and .item() is cheaper than a stack there


def _loss_shown(loss: Any) -> str:
    """A bad loss, described for an error message: its shape if a tensor, its type otherwise."""
    if isinstance(loss, torch.Tensor):
        return f"a tensor of shape {tuple(loss.shape)}"
    return f"a {type(loss).__name__}"


def _check_window(micro_batches: Any) -> int:
    """How many micro-batches the step has: at least one, each an (inputs, targets) pair; ValueError otherwise."""
    if isinstance(micro_batches, (str, bytes)) or not isinstance(micro_batches, Sequence):
        raise ValueError(f"micro_batches must be a list of (inputs, targets) pairs, got {_args.shown(micro_batches)}")
    if not micro_batches:  # else an IndexError from reading the losses back
        raise ValueError("micro_batches is empty: an optimizer step needs at least one (inputs, targets) pair")
    bad = [i for i, mb in enumerate(micro_batches) if not isinstance(mb, (tuple, list)) or len(mb) != 2]
    if bad:
        raise ValueError(f"micro_batches[{bad[0]}] must be an (inputs, targets) pair, "
                         f"got {_args.shown(micro_batches[bad[0]])}")
    return len(micro_batches)


def _no_graph(model: nn.Module) -> str:
    """Why a loss has no autograd graph, for the error message (train and trial share train_step)."""
    if not torch.is_grad_enabled():
        return ("the loss does not require grad because gradients are off (torch.no_grad() or "
                "torch.inference_mode() around the step); call train_step outside it")
    if not any(p.requires_grad for p in model.parameters()):
        return "the loss does not require grad: no parameter of the model has requires_grad=True; unfreeze some"
    return ("loss_fn returned a tensor that does not depend on the model's parameters (detached with .detach(), "
            "rebuilt from .item() or a number, or a constant), so there is nothing to backpropagate; compute the "
            "loss from the model's output with torch operations")


def train_step(model: nn.Module, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]], loss_fn: Callable,
               optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, amp: AmpSetup, *,
               grad_clip: float | None = None, scheduler: Any = None, autocast: bool = True) -> StepStats:
    """One optimizer step over an accumulation window: autocast forward, scaled backward, unscale, clip, step.

    autocast=False leaves the forward pass alone: FSDP2 casts the parameters per module instead.
    grad_clip: a finite number > 0, or None (no clipping). NaN would make every weight NaN, a negative one
    flips every gradient (an uphill step) and 0 zeroes them: refused (ValueError) before the step, as train() does.
    """
    n = _check_window(micro_batches)
    if grad_clip is not None:
        grad_clip = _args.real(grad_clip, "grad_clip", positive=True, what="a finite number > 0 or None (no clipping)")
    optimizer.zero_grad(set_to_none=True)
    losses = []
    for i, (x, y) in enumerate(micro_batches):
        with _grad_sync(model, sync=i == n - 1):
            with amp.autocast(enabled=autocast):  # forward and loss only; backward runs outside autocast
                loss = loss_fn(model(x), y)
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:  # shape only: no host sync
                raise ValueError(f"loss_fn must return a 0-d tensor (one number, e.g. a mean over the batch), "
                                 f"got {_loss_shown(loss)}; reduce it with .mean()")
            if not loss.requires_grad:  # else autograd's "element 0 of tensors does not require grad" from backward()
                raise ValueError(_no_graph(model))
            # Divide by n so the summed gradient is the mean over the whole window, as with one big batch
            # (n == 1: no division, which is exact anyway, and one kernel less).
            scaler.scale(loss / n if n > 1 else loss).backward()
        losses.append(loss)
    scaler.unscale_(optimizer)  # from here on .grad holds true gradients: norms and clipping mean what they say
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if grad_clip is None:  # the norm is only recorded: its squared parts are summed on the host, after the sync
        norm_parts = _squared_norm_parts([p.grad for p in params])
    else:
        norm_parts = [_full(torch.nn.utils.clip_grad_norm_(params, grad_clip))]
    lr = optimizer.param_groups[0]["lr"]
    before = _scale_tensor(scaler)  # read on the device: get_scale() here and below would be two more syncs
    scale_host = scaler.get_scale() if before is None else None  # 1.0 for a disabled scaler, without a sync
    # Skips optimizer.step() if unscale_ found inf/nan. A non-fused optimizer costs a host sync here (GradScaler
    # reads found_inf with .item()); a fused one (make_optimizer's default on CUDA) gets found_inf as a tensor.
    scaler.step(optimizer)
    found_inf = _found_inf(scaler, optimizer) if scaler.is_enabled() else None  # before update() forgets it
    scaler.update()
    # The step changed the weights in place: autocast's cached low-precision copies of them are stale now. Autocast
    # clears that cache only when its outermost context exits, and an enclosing one (even enabled=False: the doctor,
    # a learner's own wrapper) keeps it alive across steps, so the next forward would run on the old weights.
    torch.clear_autocast_cache()
    scales = [before, _scale_tensor(scaler)] if before is not None else []
    flag = [found_inf] if found_inf is not None else []
    # Losses, norms, the scale before and after and the inf flag reach the host together: on a GPU one sync per step.
    values = _read_back([*losses, *norm_parts, *scales, *flag])
    found = values.pop() > 0 if flag else False
    if scales:
        scale, new_scale = values[-2:]
        values = values[:-2]
    else:  # a disabled scaler (fp32, bf16): 1.0 both times, never a skip
        scale, new_scale = scale_host, scaler.get_scale()
    # optimizer.step() returns None either way, so the scaler's inf flag says whether it ran. A scaler that keeps
    # no flag where _found_inf looks lowers the scale exactly when it skips, except at 0, where 0 * backoff stays 0:
    # a step there counts as skipped. The run is dead at 0 anyway: a finite loss times 0 gives zero gradients, which
    # pass the inf check (made on the scaled gradients), unscale to 0 * (1/0) = NaN and are stepped with; every later
    # loss is NaN (chapter 6, pitfall 5). A skipped step must not advance the LR schedule.
    skipped = found if flag else (new_scale < scale or scale == 0.0)
    if scheduler is not None and not skipped:
        scheduler.step()
    norm = values[n] if grad_clip is not None else math.sqrt(sum(values[n:], 0.0))  # inf or nan if a gradient was
    return StepStats(loss=sum(values[:n], 0.0) / n, grad_norm=norm, scale=scale, skipped=skipped, lr=float(lr))


def state_checksum(model: nn.Module) -> str:
    """sha256 over key names and fp32 bytes (int64 for integer buffers) of the state_dict, in key order.

    For an FSDP2 model the sharded tensors are gathered first, so every rank must call it (a collective)
    and gets the checksum of the full model: the same number a single process would print.
    """
    digest = hashlib.sha256()
    for key, value in model.state_dict().items():
        digest.update(key.encode())
        if hasattr(value, "full_tensor"):  # a DTensor shard: all-gather the whole tensor
            value = value.full_tensor()
        t = value.detach().to("cpu")
        t = t.float() if t.is_floating_point() else t.long()
        digest.update(t.contiguous().numpy().tobytes())
    return digest.hexdigest()
