"""Chapter 2 exercises: the memory bill of training (optimizer state, activations saved for backward)."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .. import memory, models
from ._core import call_learner, failed, passed

__all__ = ["SAVED_BYTES_MODEL", "saved_bytes_question", "check_adam_bytes", "check_saved_bytes"]


def _adam_models() -> list[tuple[str, torch.nn.Module]]:
    """Models to test the learner's byte count on: the three references and a bf16 copy of the MLP."""
    out = [(name, models.make_model(name)) for name in models.MODELS]
    out.append(("mlp stored in bf16", models.make_model("mlp").to(torch.bfloat16)))
    return out


def _measured_adam_bytes(model: torch.nn.Module) -> int:
    """Weights + gradients + Adam's exp_avg and exp_avg_sq, measured after one real Adam step."""
    opt = torch.optim.Adam(model.parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    got = memory.training_state_bytes(model, opt)
    for p in model.parameters():
        p.grad = None
    return got["weights"] + got["gradients"] + got["exp_avg"] + got["exp_avg_sq"]


def check_adam_bytes(adam_bytes: Callable[[torch.nn.Module], int]) -> None:
    """Exercise 2.1: adam_bytes(model) = bytes of weights + gradients + Adam's two moment buffers.

    Args:
        adam_bytes: the learner's function; it must return a whole number of bytes (an int, or what
            ``operator.index`` reads as one, such as np.int64): a float or a float tensor is refused first,
            with its own verdict, whatever its value.

    Example:
        >>> check_adam_bytes(lambda m: sum(4 * p.numel() * p.element_size() for p in m.parameters()))  # doctest: +ELLIPSIS
        ✅ Exercise 2.1 (bytes of weights, gradients and Adam state): correct. ...
    """
    title = "Exercise 2.1 (bytes of weights, gradients and Adam state)"
    for name, model in _adam_models():
        got = call_learner(title, adam_bytes, model)
        want = _measured_adam_bytes(model)
        n = sum(p.numel() for p in model.parameters())
        value = _whole_number(got)
        if value is None:  # the type first: a right value as 110752.0 is still not a byte count
            failed(title, f"an int (a number of bytes) for the {name}", f"{type(got).__name__} {got!r}",
                   "return a whole number of bytes: p.numel() and p.element_size() are ints, and so are their "
                   "products and sums (a float or a tensor crept in: int(...) it, or count with Python ints)")
        if value != want:
            hint = ("each parameter has a weight, a gradient and two Adam moments, all in the parameter's dtype: "
                    "use p.numel() * p.element_size()")
            low = any(p.dtype != torch.float32 for p in model.parameters())
            if low and n and value == 16 * n:  # 4 copies x 4 bytes: right for fp32 parameters only
                hint = "16 bytes per parameter holds for fp32 only: this model is stored in bf16 (element_size 2)"
            failed(title, f"{want:,} bytes for the {name} ({n:,} parameters)", got, hint)
    passed(title, "Weights, gradients and both Adam moments: 4 copies of every parameter.")


def _whole_number(v: Any) -> int | None:
    """v as an int if operator.index reads it as one (int, np.int64, a one-element integer tensor), else None.

    Booleans are not byte counts: operator.index reads True as 1, so they are refused by hand.
    """
    if isinstance(v, (bool, np.bool_)) or getattr(v, "dtype", None) == torch.bool:
        return None
    try:
        return operator.index(v)
    except (TypeError, ValueError, RuntimeError):
        return None


#: The model of exercise 2.2: Linear(16 -> 32), ReLU, Linear(32 -> 4), batch of 8.
SAVED_BYTES_MODEL = "torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)), x: 8 x 16 fp32"


def saved_bytes_question(autocast: bool) -> int:
    """Activation bytes autograd saves for SAVED_BYTES_MODEL (weights and weight copies excluded)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    x = torch.randn(8, 16)
    ctx = torch.amp.autocast("cpu", dtype=torch.bfloat16) if autocast else None
    return memory.forward_saved_bytes(net, lambda out, _: out.sum(), x, None, ctx).activation_bytes


def check_saved_bytes(fp32_bytes: Any, bf16_bytes: Any) -> None:
    """Exercise 2.2: activation bytes saved for backward by SAVED_BYTES_MODEL, in fp32 and under bf16 autocast."""
    title = "Exercise 2.2 (activation bytes saved for backward)"
    for label, got, autocast in (("fp32", fp32_bytes, False), ("bf16 autocast", bf16_bytes, True)):
        want = saved_bytes_question(autocast)
        if not isinstance(got, int) or isinstance(got, bool):
            failed(title, f"an int for {label}", repr(got), "answer in bytes, e.g. 8 * 16 * 4")
        if got != want:
            size = 4 if not autocast else 2
            hints = {
                want + 8 * 32 * size: "ReLU saves its output and the second Linear saves that same tensor as input: "
                                      "one storage, counted once",
                want + (16 * 32 + 32 * 4) * size: "leave the weights out: they exist anyway (or, under autocast, "
                                                  "count as weight copies, not activations)",
            }
            failed(title, f"{label}: {want} bytes", got, hints.get(got, "list what each layer saves for backward: "
                   "Linear saves its input, ReLU its output; under autocast the saved copies are bf16"))
    passed(title, f"fp32 saves {fp32_bytes} bytes, bf16 autocast {bf16_bytes}: half, because every saved "
           "activation here is a low-precision copy.")
