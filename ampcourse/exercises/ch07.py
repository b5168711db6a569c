"""Chapter 7 exercises: data parallelism by hand with a consistent skip, and bytes per GPU under DDP vs FSDP2."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn

from ..distributed import memory_per_gpu
from ._core import failed, passed

__all__ = ["check_data_parallel_step", "check_state_bytes"]

_SCALE = 2.0**10
_LR = 0.5
# Local batches with small integers: every autocast dtype (fp16, bf16) computes the gradient y^T x exactly,
# so the checker knows each replica's gradient to the bit, whatever precision the learner picked.
_BATCHES = [(torch.tensor([[1.0, 2.0, 0.0, 1.0]]), torch.tensor([[1.0, 0.0, 2.0]])),
            (torch.tensor([[0.0, 1.0, 3.0, 1.0]]), torch.tensor([[2.0, 1.0, 0.0]]))]


def _probe_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(out * y).sum(): for a bias-free linear layer, d loss / d weight = y^T x, whatever the weights."""
    return (out.float() * y).sum()


def _replicas(n: int) -> list[nn.Linear]:
    """n identical Linear(4 -> 3) models without bias, weights zero."""
    models = []
    for _ in range(n):
        m = nn.Linear(4, 3, bias=False)
        with torch.no_grad():
            m.weight.zero_()
        models.append(m)
    return models


def _overflow_on(model: nn.Module, when: dict) -> None:
    """Make this replica's backward overflow (inf in its output gradient) while when['now'] is True."""

    def hook(module, inputs, output):
        if when["now"]:
            output.register_hook(lambda g: g.index_fill(-1, torch.tensor([0]), math.inf))
    model.register_forward_hook(hook)


def _call(title: str, fn: Callable, *args) -> None:
    """Run the learner's step, turning its exceptions into feedback."""
    if not callable(fn):
        failed(title, "a function", f"{type(fn).__name__} {fn!r}", "pass the function itself, without calling it")
    try:
        fn(*args)
    except NotImplementedError:
        failed(title, "an implementation", "NotImplementedError",
               "replace the `raise NotImplementedError` stub with your code")
    except Exception as err:  # the learner's code: report any failure as feedback
        text = str(err).strip().splitlines()[0] if str(err).strip() else ""
        if "already been called since the last update" in text:
            hint = "call scaler.update() after scaler.step(optimizer), on every replica, every step"
        elif "No inf checks were recorded" in text:
            hint = ("let scaler.step(optimizer) take the step (not optimizer.step()): it skips optimizer.step() "
                    "when unscale_ found inf/nan")
        else:
            hint = "run your step on the two replicas and read the error"
        failed(title, "your step function to run", f"{type(err).__name__}: {text}", hint)


def _weights(models: list[nn.Module]) -> list[torch.Tensor]:
    """A detached copy of each replica's weight."""
    return [m.weight.detach().clone() for m in models]


def check_data_parallel_step(data_parallel_step: Callable) -> None:
    """Exercise 7.1: data_parallel_step(replicas, batches, optimizers, scalers, loss_fn) is one AMP step of
    data parallelism by hand: every replica skips when any replica's gradient overflows."""
    title = "Exercise 7.1 (data parallelism by hand, with a consistent skip)"
    replicas = _replicas(2)
    optimizers = [torch.optim.SGD(m.parameters(), lr=_LR) for m in replicas]
    scalers = [torch.amp.GradScaler("cpu", init_scale=_SCALE) for _ in replicas]
    when = {"now": False}
    _overflow_on(replicas[1], when)
    grads = [y.t() @ x for x, y in _BATCHES]  # each replica's true gradient of its local loss
    mean = sum(grads) / len(grads)

    for step, overflow in enumerate([False, True, False]):
        when["now"] = overflow
        before = _weights(replicas)
        _call(title, data_parallel_step, replicas, _BATCHES, optimizers, scalers, _probe_loss)
        after = _weights(replicas)
        scales = [s.get_scale() for s in scalers]
        if len(set(scales)) > 1:
            failed(title, f"the same loss scale on every replica after step {step}", scales,
                   "every replica must find the same inf: the inf check (scaler.unscale_ or scaler.step) must come "
                   "after the gradients were averaged, so one replica's inf reaches all of them through the average")
        if not torch.equal(after[0], after[1]):
            moved = [not torch.equal(a, b) for a, b in zip(after, before)]
            hint = ("one replica stepped while the other skipped: the inf check happened before the gradients were "
                    "averaged (unscale_ looks for inf/nan; call it only after averaging)" if moved.count(True) == 1
                    else "replace every replica's gradient with the mean over replicas before the optimizer step: "
                         "that is what DDP's all-reduce does during backward")
            failed(title, f"identical replicas after step {step}",
                   f"replica weights differ by {(after[0] - after[1]).abs().max().item():.3g}", hint)
        if overflow:
            if not all(torch.equal(a, b) for a, b in zip(after, before)):
                failed(title, "every replica skipped the step with the overflow (weights unchanged)",
                       "weights changed" if all(torch.isfinite(a).all() for a in after) else "non-finite weights",
                       "let scaler.step(optimizer) decide: it skips optimizer.step() when unscale_ found inf/nan")
            if scales[0] != _SCALE / 2:
                failed(title, f"scale {_SCALE / 2:g} after the overflow", scales[0],
                       "call scaler.update() after scaler.step(optimizer), on every replica, every step")
            continue
        want = before[0] - _LR * mean
        if not torch.allclose(after[0], want, atol=1e-6):
            got = (before[0] - after[0]) / _LR
            summed = torch.allclose(got, sum(grads), atol=1e-6)
            hint = ("the update is as large as the SUM of the replicas' gradients: divide by the number of "
                    "replicas (average, as DDP does)" if summed else
                    "zero each replica's gradients first, scale the loss with its scaler, average the scaled "
                    "gradients across replicas, then scaler.step(optimizer) and scaler.update()")
            failed(title, f"weights {want.flatten().tolist()} after step {step} (one SGD step on the mean gradient)",
                   after[0].flatten().tolist(), hint)
    passed(title, "Both replicas stepped on the mean gradient, and both skipped when one of them overflowed.")


# (n_params, world_size, strategy) cases: DDP and FSDP2, one GPU and many
_CASES = [(1_000_000, 1, "ddp"), (1_000_000, 8, "ddp"), (1_000_000, 8, "fsdp"), (7_000_000_000, 64, "fsdp"),
          (350_000_000, 4, "fsdp"), (350_000_000, 1, "fsdp")]


def _diagnose(n: int, world: int, strategy: str, got: float) -> str:
    """A hint naming the likely mistake behind a wrong byte count."""
    share = 1 if strategy == "ddp" else world
    per = got * share / n if n else math.nan
    if strategy == "ddp" and world > 1 and math.isclose(got, 16 * n / world, rel_tol=1e-3):
        return "DDP keeps a full replica (weights, gradients, optimizer state) on every GPU: nothing is divided"
    if strategy == "fsdp" and world > 1 and math.isclose(got, 16 * n, rel_tol=1e-3):
        return "FSDP2 shards weights, gradients and optimizer state: each GPU holds 1/world_size of each"
    for bytes_per, why in [(8, "AdamW keeps two fp32 moments (exp_avg, exp_avg_sq) per parameter: 8 bytes"),
                           (12, "count the gradients too: one fp32 gradient per parameter"),
                           (14, "AMP keeps weights and gradients in fp32 (autocast casts copies): 4 bytes each"),
                           (10, "AMP keeps weights and gradients in fp32 (autocast casts copies): 4 bytes each"),
                           (18, "count the fp32 weights once (4 bytes); the 2-byte autocast copy is transient")]:
        if math.isclose(per, bytes_per, rel_tol=1e-3):
            return why
    return "weights 4 + gradients 4 + AdamW moments 4 + 4 bytes per parameter, divided by world_size under FSDP2"


def check_state_bytes(state_bytes: Callable) -> None:
    """Exercise 7.2: state_bytes(n_params, world_size, strategy) -> bytes per GPU of weights, gradients and
    AdamW state under AMP, for 'ddp' and 'fsdp'."""
    title = "Exercise 7.2 (bytes per GPU under DDP and FSDP2)"
    if not callable(state_bytes):
        failed(title, "a function", f"{type(state_bytes).__name__} {state_bytes!r}",
               "pass the function itself, without calling it")
    for n, world, strategy in _CASES:
        want = memory_per_gpu(n, world, strategy)["total"]
        try:
            got = state_bytes(n, world, strategy)
        except NotImplementedError:
            failed(title, "an implementation", "NotImplementedError",
                   "replace the `raise NotImplementedError` stub with your code")
        except Exception as err:  # the learner's code
            failed(title, f"a number for {(n, world, strategy)}", f"{type(err).__name__}: {err}",
                   "run your function on that input and read the error")
        if not isinstance(got, (int, float)) or isinstance(got, bool) or not math.isclose(got, want, rel_tol=1e-3):
            failed(title, f"{want:,.0f} bytes for {n:,} parameters on {world} GPU(s) with {strategy}", got,
                   _diagnose(n, world, strategy, got) if isinstance(got, (int, float)) else "return a number")
    passed(title, "16 bytes per parameter under AMP + AdamW: all of them on every GPU with DDP, "
                  "1/world_size of them with FSDP2.")
