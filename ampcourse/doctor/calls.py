"""Argument checks and calling the model: what every pass of the doctor does with the learner's model, inputs and
loss (check them, move them, copy them, call the model, take the scalar loss), and the small tensor measures the
passes share (a sample of values, inf/NaN counts, relative errors).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping

import torch
import torch.nn as nn

from ..device import pick
from .hist import _abs_max

_SAMPLE = 1024  # output values per module call kept to compare a precision's outputs with fp32


def check_inputs(inputs) -> None:
    """TypeError unless inputs is a tensor, a tuple (positional arguments) or a dict (keyword arguments)."""
    if isinstance(inputs, (torch.Tensor, tuple)):
        return
    if isinstance(inputs, Mapping) and all(isinstance(k, str) for k in inputs):
        return
    raise TypeError(f"inputs must be a tensor, a tuple of tensors (positional arguments) or a dict with str keys "
                    f"(keyword arguments), got {type(inputs).__name__}")


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter or buffer (cpu for a model without either)."""
    t = next(iter(model.parameters()), None)
    if t is None:
        t = next(iter(model.buffers()), None)
    return t.device if t is not None else torch.device("cpu")


def resolve_device(model: nn.Module, device) -> torch.device:
    """The device to examine on: the model's own, which device= (if given) must name."""
    here = model_device(model)
    if device is None:
        return here
    dev = pick(device, "fp32").device  # validates the name and that CUDA exists
    if dev.type != here.type or (dev.index is not None and here.index is not None and dev.index != here.index):
        raise ValueError(f"device={str(device)!r} but the model is on {here}: move it first "
                         f"(model.to({str(dev)!r})) or leave device=None")
    return here


def to_device(obj, dev: torch.device):
    """Tensors in a (nested) tuple, list or dict, detached (backward must not reach the caller's) and on dev."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to(dev)
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(o, dev) for o in obj)
    if isinstance(obj, Mapping):
        return {k: to_device(v, dev) for k, v in obj.items()}
    return obj


def fresh_copy(obj, dtype: torch.dtype | None = None):
    """A clone of every tensor in obj (floating ones in dtype, if given): each pass gets its own inputs, so a forward
    that edits its input in place changes neither the caller's batch nor the next pass."""
    if isinstance(obj, torch.Tensor):
        if dtype is not None and obj.is_floating_point():
            return obj.detach().to(dtype, copy=True)
        return obj.detach().clone()
    if isinstance(obj, (list, tuple)):
        return type(obj)(fresh_copy(o, dtype) for o in obj)
    if isinstance(obj, Mapping):
        return {k: fresh_copy(v, dtype) for k, v in obj.items()}
    return obj


def call(model: nn.Module, inputs):
    """model(inputs), model(*inputs) or model(**inputs)."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, tuple):
        return model(*inputs)
    return model(inputs)


class LossShapeError(ValueError):
    """What the model or loss_fn returned is not a scalar loss: a question of the call, not of the data."""


def _is_scalar(t) -> bool:
    return isinstance(t, torch.Tensor) and t.numel() == 1 and t.is_floating_point()


def scalar_loss(output, targets, loss_fn: Callable | None) -> torch.Tensor:
    """The scalar loss: loss_fn(output, targets), else the output itself, its .loss / ['loss'], or the first element
    of a tuple that leads with a scalar (Hugging Face's ``return_dict=False`` returns ``(loss, logits, ...)``)."""
    if loss_fn is None:
        loss = getattr(output, "loss", None)
        if loss is None and isinstance(output, Mapping):
            loss = output.get("loss")
        if loss is None and isinstance(output, (tuple, list)) and output and _is_scalar(output[0]):
            loss = output[0]
        if loss is None:
            loss = output
    else:
        loss = loss_fn(output) if targets is None else loss_fn(output, targets)
    if not _is_scalar(loss):
        what = (f"a {tuple(loss.shape)} {loss.dtype} tensor" if isinstance(loss, torch.Tensor) else
                f"a {type(loss).__name__} of {len(loss)}" if isinstance(loss, (tuple, list)) else type(loss).__name__)
        raise LossShapeError(
            f"the loss must be a one-element floating-point tensor, got {what}" + (
                ": with loss_fn=None the model must return a scalar loss, an output with .loss (pass labels in inputs) "
                "or a tuple that starts with it; otherwise pass loss_fn= (a function of the output and the targets, "
                "e.g. F.cross_entropy)" if loss_fn is None else
                ": loss_fn must reduce to one number (reduction='mean' or 'sum')"))
    return loss.reshape(())


def first_tensor(inputs):
    """The first tensor of inputs (for error messages)."""
    if isinstance(inputs, torch.Tensor):
        return inputs
    values = inputs.values() if isinstance(inputs, Mapping) else inputs
    return next((v for v in values if isinstance(v, torch.Tensor)), inputs)


def float_tensors(obj) -> Iterator[torch.Tensor]:
    """Every floating-point tensor in a module's output (tensor, tuple, list, dict or ModelOutput)."""
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point():
            yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from float_tensors(o)
    elif isinstance(obj, Mapping):
        for o in obj.values():
            yield from float_tensors(o)


def grad_of(p: torch.Tensor) -> torch.Tensor | None:
    """p's gradient, detached and dense: an Embedding(sparse=True) gets a sparse one, which is measured like any other
    (histograms, comparisons and norms take dense tensors).

    Example::

        >>> e = nn.Embedding(4, 2, sparse=True); e(torch.tensor([1])).sum().backward()
        >>> grad_of(e.weight).layout
        torch.strided
    """
    g = p.grad
    if g is None:
        return None
    g = g.detach()
    return g.to_dense() if g.is_sparse else g


def is_leaf(module: nn.Module) -> bool:
    """No child modules: its forward is the math the doctor can rerun on its own."""
    return next(module.children(), None) is None


def sample(t: torch.Tensor) -> torch.Tensor:
    """Up to _SAMPLE evenly spaced values of t, as float32 (the same positions in every pass)."""
    flat = t.detach().reshape(-1)
    step = max(1, flat.numel() // _SAMPLE)
    return flat[::step][:_SAMPLE].float()


def _sum_finite(t: torch.Tensor) -> bool:
    """Whether a non-empty floating tensor surely has no inf/NaN, in one reduction (an op watcher's test per op): its
    float32 sum is finite. A non-finite sum may still come from finite values past float32's range: then the caller
    looks again with the exact max."""
    return math.isfinite(float(t.detach().sum(dtype=torch.float32)))


def count_nonfinite(t: torch.Tensor) -> int:
    """How many values of t are inf or NaN (a finite float32 sum first, one reduction; the max |x| next: a bool mask
    only when one is there)."""
    if t.numel() == 0 or _sum_finite(t) or math.isfinite(float(_abs_max(t.detach()))):
        return 0
    return int((~torch.isfinite(t)).sum())


def rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| (0 when both are 0, inf when got is not finite or ref is 0): the norms in float32, a
    quarter of float64's cost on a CPU (its copies, not its arithmetic, cost the time), and again in float64 when a
    float32 norm is not finite (an inf/NaN, or finite values whose squares pass float32's range)."""
    got, ref = (t.detach().reshape(-1) for t in (got, ref))
    got, ref = (t.float() if t.dtype == torch.float64 else t for t in (got, ref))  # compared as float32 values
    if got.shape != ref.shape:
        return math.inf
    # a float32 operand makes the difference float32 (the other converted exactly): no float copy of it first
    diff = got - ref if torch.float32 in (got.dtype, ref.dtype) else got.float() - ref.float()
    num = float(torch.linalg.vector_norm(diff))
    den = float(torch.linalg.vector_norm(ref.float()))
    if not (math.isfinite(num) and math.isfinite(den)):
        num = float(torch.linalg.vector_norm(got.double().sub_(ref)))
        den = float(torch.linalg.vector_norm(ref, dtype=torch.float64))
    if not math.isfinite(num) and (math.isfinite(den) or not bool(torch.isfinite(got).all())):
        return math.inf
    if den == 0:
        return 0.0 if num == 0 else math.inf
    return num / den


def copy_as(obj, dtype: torch.dtype):
    """Fresh copies in dtype of the floating tensors in obj (a rerun must not write into the real activations)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to(dtype, copy=True) if obj.is_floating_point() else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(copy_as(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: copy_as(v, dtype) for k, v in obj.items()}
    return obj
