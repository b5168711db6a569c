"""One AMP training loop for fp32, fp16 (+ GradScaler) and bf16, with clipping, accumulation and resume.

Launch commands::

    # 1 process (CPU, one GPU or Apple MPS), with a JSON summary:
    python -m ampcourse.train --model mlp --precision bf16 --steps 200 --out summary.json
    # checkpoint every 50 steps, then continue an interrupted run exactly where it stopped:
    python -m ampcourse.train --model mlp --steps 200 --checkpoint-dir runs/a --checkpoint-every 50
    python -m ampcourse.train --model mlp --steps 400 --checkpoint-dir runs/a --resume
    # N processes on one node and N nodes (--strategy ddp|fsdp): not implemented yet, they will read
    #   torchrun --standalone --nproc-per-node N -m ampcourse.train --strategy ddp ...
    #   torchrun --nnodes M --nproc-per-node N --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
    #       -m ampcourse.train --strategy fsdp ...

From Python::

    >>> from ampcourse.train import train
    >>> hist = train("mlp", None, precision="bf16", steps=50, lr=1e-3, seed=0, progress=False)
    >>> hist.loss[-1], hist.skipped_steps, hist.model

Design, and why:

- Device, autocast dtype and scaler come from ``ampcourse.device.pick``; one loop with ``enabled=``
  flags serves every precision (for fp32 and bf16 the GradScaler is disabled and its calls are no-ops).
- The global batch of step k is a fixed function of (seed, k, dataset size, global batch size)
  (:func:`batch_indices`); a rank takes its slice (:func:`local_indices`). So 1 process and N processes
  see the same global batches, and a resumed run draws exactly the batches an uninterrupted one would.
- Process groups and model wrapping stay outside this module: ``rank``/``world_size`` pick the slice,
  ``wrap`` receives the model after it moved to the device (DDP or ``fully_shard`` plug in there), and
  micro-batches before the last one run under ``model.no_sync()`` when the wrapper has it.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import json
import math
import numbers
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.utils.data import TensorDataset
from tqdm.auto import tqdm

from . import checkpoint, models, scaling
from .device import AmpSetup, parse_precision, pick

__all__ = ["History", "StepStats", "train", "train_step", "batch_indices", "local_indices", "make_optimizer",
           "make_scheduler", "state_checksum", "main", "OPTIMIZERS", "SCHEDULERS", "STRATEGIES"]

OPTIMIZERS = ("adamw", "adam", "sgd")
SCHEDULERS = ("cosine",)
STRATEGIES = ("single",)  # ddp and fsdp arrive with ampcourse.distributed
# History fields saved in a checkpoint, so a resumed run returns the whole run's history.
_SERIES = ("loss", "scale", "skipped", "grad_norm", "lr", "step_time")
# Settings a resumed run must share with the checkpoint: they fix which samples each step sees
# and what the saved scaler state means.
_MUST_MATCH = ("precision", "seed", "batch_size", "dataset_size")


@dataclass
class StepStats:
    """What one optimizer step did."""

    loss: float  # mean loss over the global (local) batch, unscaled
    grad_norm: float  # L2 norm of the true (unscaled) gradients, before clipping; inf/nan if non-finite
    scale: float  # the loss scale this step used (1.0 without a scaler)
    skipped: bool  # the GradScaler found inf/nan and skipped optimizer.step()
    lr: float  # learning rate of the first param group during this step


@dataclass
class History:
    """Per-step record of a run (all steps, including those before a resume) and the trained model."""

    precision: str
    device_type: str
    world_size: int = 1
    backend: str = "none"  # the process-group backend (nccl, gloo) once distributed strategies exist
    start_step: int = 0  # the step this call started from (> 0 after a resume)
    loss: list[float] = field(default_factory=list)
    scale: list[float] = field(default_factory=list)
    skipped: list[bool] = field(default_factory=list)
    grad_norm: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    step_time: list[float] = field(default_factory=list)  # seconds per step, wall clock
    final_scale: float = 1.0  # the scaler's scale after the last update
    model: nn.Module | None = field(default=None, repr=False, compare=False)

    @property
    def steps_done(self) -> int:
        """Completed optimizer steps (skipped ones included)."""
        return len(self.loss)

    @property
    def skipped_steps(self) -> int:
        """How many steps the GradScaler skipped."""
        return sum(self.skipped)

    @property
    def nonfinite(self) -> list[bool]:
        """Steps whose gradients held inf or nan (fp16 skips them; fp32/bf16 have no scaler to do so)."""
        return [not math.isfinite(g) for g in self.grad_norm]

    @property
    def final_loss(self) -> float:
        """Loss of the last step (nan before any step)."""
        return self.loss[-1] if self.loss else math.nan

    def append(self, stats: StepStats, seconds: float) -> None:
        """Record one step."""
        for name in ("loss", "scale", "skipped", "grad_norm", "lr"):
            getattr(self, name).append(getattr(stats, name))
        self.step_time.append(seconds)

    def series(self) -> dict[str, list]:
        """The per-step lists, as saved in a checkpoint."""
        return {name: list(getattr(self, name)) for name in _SERIES}

    def summary(self) -> dict[str, Any]:
        """The run's outcome as JSON-ready values (what `python -m ampcourse.train --out` writes)."""
        return {
            "world_size": self.world_size, "backend": self.backend, "device_type": self.device_type,
            "precision": self.precision, "steps_done": self.steps_done, "skipped_steps": self.skipped_steps,
            "final_loss": self.final_loss, "final_loss_scale": self.final_scale,
            "checksum": state_checksum(self.model) if self.model is not None else None,
        }


# ---------------------------------------------------------------------------------------------
# Which samples each step sees
# ---------------------------------------------------------------------------------------------

def _epoch_generator(seed: int, epoch: int) -> torch.Generator:
    """A generator for one epoch's permutation, seeded from (seed, epoch) alone."""
    mixed = (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + 1) % (2**63)  # distinct per pair
    return torch.Generator().manual_seed(mixed)


@functools.lru_cache(maxsize=4)
def _epoch_permutation(seed: int, epoch: int, dataset_size: int) -> torch.Tensor:
    """One epoch's permutation, computed once per epoch instead of once per step (it is a pure function)."""
    return torch.randperm(dataset_size, generator=_epoch_generator(seed, epoch))


def batch_indices(step: int, seed: int, dataset_size: int, batch_size: int) -> torch.Tensor:
    """Dataset indices of the GLOBAL batch for `step`: a function of these four numbers only.

    Each epoch is a fresh seeded permutation cut into floor(dataset_size / batch_size) batches
    (the remainder is dropped, so every batch has distinct samples).
    """
    per_epoch = dataset_size // batch_size
    if per_epoch < 1:
        raise ValueError(f"batch_size {batch_size} is larger than the dataset ({dataset_size} samples)")
    epoch, pos = divmod(step, per_epoch)
    # A copy: the cached permutation must not change if a caller writes into the batch it got.
    return _epoch_permutation(seed, epoch, dataset_size)[pos * batch_size:(pos + 1) * batch_size].clone()


def local_indices(step: int, seed: int, dataset_size: int, batch_size: int, rank: int = 0,
                  world_size: int = 1) -> torch.Tensor:
    """This rank's contiguous slice of the global batch for `step`."""
    indices = batch_indices(step, seed, dataset_size, batch_size)
    if world_size == 1:
        return indices
    local = batch_size // world_size
    return indices[rank * local:(rank + 1) * local]


# ---------------------------------------------------------------------------------------------
# Building blocks: optimizer, scheduler, one step
# ---------------------------------------------------------------------------------------------

def make_optimizer(spec: str | Callable, params, lr: float, weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """'adamw', 'adam', 'sgd' (plain, no momentum) or a callable(params, lr, weight_decay)."""
    if callable(spec):
        return spec(params, lr=lr, weight_decay=weight_decay)
    if spec == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    if spec == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    if spec == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {spec!r}; choose one of {', '.join(OPTIMIZERS)} or pass a callable")


def make_scheduler(spec: str | Callable | None, optimizer: torch.optim.Optimizer, steps: int):
    """None, 'cosine' (to zero over `steps`) or a callable(optimizer) returning an LRScheduler."""
    if spec is None:
        return None
    if callable(spec):
        return spec(optimizer)
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


def _squared_norm_parts(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """0-dim tensors whose sum is the squared total L2 norm of the gradients, computed without a host sync.

    Why not get_total_norm: on every step it sorts the tensors into (device, dtype) groups and launches
    one kernel per tensor plus two more; on a CPU, where each extra kernel of a training step costs
    microseconds, that was several percent of a tiny model's step (benchmarks/README.md). So: plain
    dense float32 gradients on a CPU, up to _CPU_CONCAT_NORM_MAX values: one concatenated copy and one
    BLAS dot product. Plain dense gradients on one device and dtype otherwise: the per-tensor norms from
    the fused kernel get_total_norm uses, squared. Anything else (DTensor shards, sparse or mixed
    gradients): get_total_norm itself, squared. Like torch's norms, this accumulates in the gradients' dtype.
    """
    if not grads:
        return []
    first = grads[0]
    device, dtype = first.device, first.dtype
    if not all(type(g) is torch.Tensor and g.layout == torch.strided and g.device == device and g.dtype == dtype
               for g in grads):
        return [torch.nn.utils.get_total_norm(grads).square()]
    if device.type == "cpu" and dtype == torch.float32 and sum(g.numel() for g in grads) <= _CPU_CONCAT_NORM_MAX:
        flat = torch.cat([g.reshape(-1) for g in grads])
        return [torch.dot(flat, flat)]
    norms = torch._foreach_norm(grads, 2.0)
    return list(torch._foreach_mul(norms, norms))


def _read_back(tensors: list[torch.Tensor]) -> list[float]:
    """0-dim tensors as Python floats: on a GPU stacked into one device-to-host copy, on a CPU one by one."""
    first = tensors[0]
    if first.device.type != "cpu" and all(type(t) is torch.Tensor and t.device == first.device for t in tensors):
        with torch.no_grad():
            return torch.stack(tensors).tolist()  # stack promotes mixed dtypes to the widest
    return [t.item() for t in tensors]  # a CPU has no sync to save, and .item() is cheaper than a stack there


def train_step(model: nn.Module, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]], loss_fn: Callable,
               optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, amp: AmpSetup, *,
               grad_clip: float | None = None, scheduler: Any = None) -> StepStats:
    """One optimizer step over an accumulation window: autocast forward, scaled backward, unscale, clip, step."""
    optimizer.zero_grad(set_to_none=True)
    n = len(micro_batches)
    losses = []
    for i, (x, y) in enumerate(micro_batches):
        with _grad_sync(model, sync=i == n - 1):
            with amp.autocast():  # forward and loss only; backward runs outside autocast
                loss = loss_fn(model(x), y)
            # Divide by n so the summed gradient is the mean over the whole window, as with one big batch
            # (n == 1: no division, which is exact anyway, and one kernel less).
            scaler.scale(loss / n if n > 1 else loss).backward()
        losses.append(loss)
    scaler.unscale_(optimizer)  # from here on .grad holds true gradients: norms and clipping mean what they say
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if grad_clip is None:  # the norm is only recorded: its squared parts are summed on the host, after the sync
        norm_parts = _squared_norm_parts([p.grad for p in params])
    else:
        norm_parts = [torch.nn.utils.clip_grad_norm_(params, grad_clip)]
    scale, lr = scaler.get_scale(), optimizer.param_groups[0]["lr"]
    scaler.step(optimizer)  # skips optimizer.step() if unscale_ found inf/nan
    scaler.update()
    # The scaler lowers its scale exactly when it skipped the step; optimizer.step() returns None either
    # way, so the scale is the signal. A skipped step must not advance the LR schedule.
    skipped = scaler.get_scale() < scale
    if scheduler is not None and not skipped:
        scheduler.step()
    # Losses and norms reach the host together: on a GPU one sync per step, not one per micro-batch and norm.
    values = _read_back([*losses, *norm_parts])
    norm = values[n] if grad_clip is not None else math.sqrt(sum(values[n:], 0.0))  # inf or nan if a gradient was
    return StepStats(loss=sum(values[:n], 0.0) / n, grad_norm=norm, scale=scale, skipped=skipped, lr=float(lr))


def state_checksum(model: nn.Module) -> str:
    """sha256 over key names and fp32 bytes (int64 for integer buffers) of the state_dict, in key order."""
    digest = hashlib.sha256()
    for key, value in model.state_dict().items():
        digest.update(key.encode())
        t = value.detach().to("cpu")
        t = t.float() if t.is_floating_point() else t.long()
        digest.update(t.contiguous().numpy().tobytes())
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------
# Argument checks: all before any work
# ---------------------------------------------------------------------------------------------

def _is_int(x: Any) -> bool:
    """An int that is not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _need_int(name: str, value: Any, low: int, what: str) -> None:
    """ValueError unless value is an int >= low."""
    if not _is_int(value) or value < low:
        raise ValueError(f"{name} must be {what}, got {value!r}")


def _need_positive_float(name: str, value: Any, allow_zero: bool = False) -> None:
    """ValueError unless value is a finite real number > 0 (or >= 0)."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value >= 0 if allow_zero else value > 0)
    if not ok:
        raise ValueError(f"{name} must be a finite number {'>= 0' if allow_zero else '> 0'}, got {value!r}")


_MODEL_NAMES = {models.MLP: "mlp", models.SmallCNN: "cnn", models.TinyTransformer: "transformer"}


def _resolve_model(model: nn.Module | str, size: str, seed: int) -> tuple[nn.Module, str | None]:
    """The module to train and its reference-model name (None for a model of your own)."""
    if isinstance(model, str):
        if model not in models.MODELS:
            raise ValueError(f"unknown model {model!r}; choose one of {', '.join(models.MODELS)} or pass an nn.Module")
        return models.make_model(model, size=size, seed=seed), model
    if isinstance(model, nn.Module):
        return model, _MODEL_NAMES.get(type(model))
    raise ValueError(f"model must be an nn.Module or one of {', '.join(models.MODELS)}, got {type(model).__name__}")


def _resolve_data(data: TensorDataset | None, name: str | None, n: int, seed: int, size: str) -> TensorDataset:
    """The dataset to draw batches from: the one given, or the reference model's synthetic one."""
    if data is None:
        if name is None:
            raise ValueError("data=None only works for the reference models (mlp, cnn, transformer); "
                             "pass a TensorDataset(inputs, targets) for your own model")
        return models.make_dataset(name, n=n, seed=seed, size=size)
    if not isinstance(data, TensorDataset) or len(data.tensors) != 2:
        raise ValueError(f"data must be a TensorDataset(inputs, targets) or None, got {type(data).__name__}"
                         + (f" with {len(data.tensors)} tensors" if isinstance(data, TensorDataset) else ""))
    return data


@functools.cache
def _amp_works(device_type: str, precision: str) -> str | None:
    """None if autocast (and, for fp16, GradScaler) runs on this device type; else why not."""
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
    if dtype is None:
        return None
    try:
        with warnings.catch_warnings(record=True) as caught:  # unsupported autocast warns and disables itself
            warnings.simplefilter("always")
            with torch.amp.autocast(device_type=device_type, dtype=dtype):
                a = torch.ones(2, 2, device=device_type)
                out = a @ a
            if precision == "fp16":
                torch.amp.GradScaler(device_type)
    except (RuntimeError, TypeError, ValueError) as err:
        return f"{type(err).__name__}: {str(err).splitlines()[0]}"
    if out.dtype != dtype:
        reason = "; ".join(str(w.message).splitlines()[0] for w in caught) or f"autocast gave {out.dtype}"
        return reason
    return None


def _check_checkpoint_dir(directory: Path, resume: bool) -> None:
    """The directory can be written to, and holds a checkpoint exactly when we resume."""
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"checkpoint_dir {str(directory)!r} exists and is not a directory; pass a directory path")
    probe = directory
    while not probe.exists():  # the nearest existing ancestor must let us create the directory
        probe = probe.parent
    if not probe.is_dir():
        raise ValueError(f"checkpoint_dir {str(directory)!r} cannot be created: {str(probe)!r} is a file")
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as err:
        raise ValueError(f"checkpoint_dir {str(directory)!r} is not writable ({err.strerror}); "
                         "choose a directory you can write to") from err
    ckpt = checkpoint.path_in(directory)
    if resume and not ckpt.exists():
        raise ValueError(f"resume=True but there is no checkpoint at {str(ckpt)!r}; "
                         "run once without resume (with this checkpoint_dir) to create one")
    if not resume and ckpt.exists():
        raise ValueError(f"{str(ckpt)!r} already exists and would be overwritten; pass resume=True to continue "
                         "that run, or choose an empty checkpoint_dir")


def _check_resumable(state: dict, config: dict, path: Path, scheduler: bool) -> None:
    """The checkpoint was written by a run with the same data order, precision (and schedule length)."""
    saved = state.get("config", {})
    diffs = [f"{k}={saved.get(k)!r} in the checkpoint, {config[k]!r} now" for k in _MUST_MATCH
             if k in saved and saved[k] != config[k]]
    if scheduler and saved.get("steps", config["steps"]) != config["steps"]:
        diffs.append(f"steps={saved['steps']} in the checkpoint, {config['steps']} now (the LR schedule spans the "
                     "steps of the first run)")
    if diffs:
        raise ValueError(f"cannot resume from {str(path)!r}: " + "; ".join(diffs)
                         + ". Resume with the same settings, or start a new run in another checkpoint_dir")


def _check_arguments(*, steps, lr, seed, accum_steps, batch_size, rank, world_size, grad_clip, weight_decay,
                     resume, checkpoint_dir, checkpoint_every, optimizer, scheduler, size) -> None:
    """The checks on train()'s arguments that need neither the model nor the data."""
    _need_int("steps", steps, 1, "an int >= 1")
    _need_positive_float("lr", lr)
    _need_int("seed", seed, 0, "an int >= 0")
    _need_int("accum_steps", accum_steps, 1, "an int >= 1 (1 = no accumulation)")
    _need_int("batch_size", batch_size, 1, "an int >= 1 (the global batch size)")
    _need_int("world_size", world_size, 1, "an int >= 1")
    if not _is_int(rank) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in 0..{world_size - 1} (world_size={world_size}), got {rank!r}")
    if grad_clip is not None:
        _need_positive_float("grad_clip", grad_clip)
    _need_positive_float("weight_decay", weight_decay, allow_zero=True)
    if checkpoint_every is not None:
        _need_int("checkpoint_every", checkpoint_every, 1, "an int >= 1 or None (only at the end)")
    if checkpoint_dir is None and (resume or checkpoint_every is not None):
        raise ValueError("resume and checkpoint_every need a checkpoint_dir")
    if not callable(optimizer) and optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZERS)} or pass a callable")
    if scheduler is not None and not callable(scheduler) and scheduler not in SCHEDULERS:
        raise ValueError(f"unknown scheduler {scheduler!r}; choose None, {', '.join(SCHEDULERS)} or pass a callable")
    if size not in models.SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(models.SIZES)}")


_SCALER_DEFAULTS = {"init_scale": 2.0**16, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000}


def _check_scaler_kwargs(scaler_kwargs: dict | None) -> None:
    """scaler_kwargs holds only GradScaler's settings, each one sensible (GradScaler itself accepts a negative scale)."""
    if scaler_kwargs is None:
        return
    if not isinstance(scaler_kwargs, dict):
        raise ValueError(f"scaler_kwargs must be a dict or None, got {scaler_kwargs!r}")
    unknown = sorted(set(scaler_kwargs) - {*_SCALER_DEFAULTS, "enabled"})
    if unknown:
        raise ValueError(f"unknown scaler_kwargs {unknown}; GradScaler takes {', '.join([*_SCALER_DEFAULTS, 'enabled'])}")
    settings = {**_SCALER_DEFAULTS, **{k: v for k, v in scaler_kwargs.items() if k != "enabled"}}
    scaling.check_scaler_args(**settings)


def _check_finite(data: TensorDataset) -> None:
    """ValueError if a floating-point input or target is nan or inf: every step would give a nan loss."""
    for what, t in zip(("inputs", "targets"), data.tensors):
        if t.is_floating_point():
            bad = ~torch.isfinite(t)
            if bad.any():
                first = int(bad.reshape(len(t), -1).any(1).nonzero()[0])
                raise ValueError(f"data {what} hold {int(bad.sum())} nan/inf values (the first in sample {first}); "
                                 "every step would give a nan loss: clean or drop those samples")


def _preflight(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable | None, amp: AmpSetup) -> None:
    """Run the model (and the course's loss) once on one micro-batch: data that does not fit fails now, clearly.

    Eval mode, no gradients and a forked RNG: no parameter, running statistic or random stream changes,
    so the run that follows is exactly the one without this check. A loss function of your own is not
    called here (it may count its calls); pass loss_fn=None to check only the model.
    """
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.random.fork_rng(devices=[amp.device] if amp.device_type == "cuda" else []), torch.no_grad():
            with models.data_errors(model, x, y), amp.autocast():
                out = model(x)
                if loss_fn is not None:
                    loss_fn(out, y)
    finally:
        for m, mode in modes:
            m.training = mode


def _checkpoint_due(done: int, steps: int, every: int | None) -> bool:
    """Write a checkpoint after the last step and after every `every`-th one."""
    return done == steps or (every is not None and done % every == 0)


# ---------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------

def train(model: nn.Module | str, data: TensorDataset | None = None, precision: str | None = None,
          steps: int = 100, lr: float = 1e-3, seed: int = 0, device: str | torch.device | None = None,
          grad_clip: float | None = None, accum_steps: int = 1, checkpoint_dir: str | os.PathLike | None = None,
          resume: bool = False, *, batch_size: int = 64, checkpoint_every: int | None = None,
          optimizer: str | Callable = "adamw", weight_decay: float = 0.0, scheduler: str | Callable | None = None,
          loss_fn: Callable | None = None, scaler_kwargs: dict | None = None, progress: bool = True,
          size: str = "tiny", n_samples: int = 1024, rank: int = 0, world_size: int = 1,
          wrap: Callable[[nn.Module], nn.Module] | None = None) -> History:
    """Train `model` for `steps` optimizer steps in fp32, fp16 (+ GradScaler) or bf16; returns a History.

    model: an nn.Module (trained in place, moved to the device) or 'mlp' | 'cnn' | 'transformer'
        (built with `size` and `seed`). data: TensorDataset(inputs, targets), or None for the reference
        model's synthetic dataset of `n_samples`. precision: 'fp32' | 'fp16' | 'bf16' (None: the device's
        default from `pick`). batch_size: the GLOBAL batch per optimizer step (all ranks and micro-batches);
        it must divide by world_size * accum_steps. grad_clip: max L2 norm of the true gradients.
        checkpoint_dir: write checkpoint.pt there every `checkpoint_every` steps and at the end;
        resume=True continues from it (bit-identical to an uninterrupted run on CPU).
        optimizer: 'adamw' | 'adam' | 'sgd' or callable(params, lr=, weight_decay=). scheduler: None |
        'cosine' | callable(optimizer); it is not stepped on steps the GradScaler skipped.
        rank/world_size/wrap: hooks for ampcourse.distributed (wrap gets the model on its device).
    """
    # --- validate everything before any work ---
    prec = parse_precision(precision) if precision is not None else None
    _check_arguments(steps=steps, lr=lr, seed=seed, accum_steps=accum_steps, batch_size=batch_size, rank=rank,
                     world_size=world_size, grad_clip=grad_clip, weight_decay=weight_decay, resume=resume,
                     checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every, optimizer=optimizer,
                     scheduler=scheduler, size=size)
    amp = pick(device, prec)
    problem = _amp_works(amp.device_type, amp.precision)
    if problem:
        raise ValueError(f"precision {amp.precision!r} cannot run on {amp.device} with torch {torch.__version__} "
                         f"({problem}); use {'bf16 or ' if amp.precision == 'fp16' else ''}fp32")
    module, name = _resolve_model(model, size, seed)
    data = _resolve_data(data, name, n_samples, seed, size)
    n = len(data)
    if n == 0:
        raise ValueError("data is empty (0 samples); pass a TensorDataset with at least batch_size samples")
    if batch_size > n:
        raise ValueError(f"batch_size {batch_size} is larger than the dataset ({n} samples); use at most {n}")
    if batch_size % (world_size * accum_steps):
        raise ValueError(f"batch_size {batch_size} must divide by world_size * accum_steps = "
                         f"{world_size} * {accum_steps}, so every micro-batch has the same size")
    _check_scaler_kwargs(scaler_kwargs)
    models.check_data(module, data, targets=loss_fn is None)
    _check_finite(data)
    config = {"precision": amp.precision, "seed": seed, "batch_size": batch_size, "dataset_size": n, "steps": steps,
              "model": name or type(module).__name__, "accum_steps": accum_steps, "world_size": world_size}
    state, ckpt_path = None, None
    if checkpoint_dir is not None:
        ckpt_path = checkpoint.path_in(checkpoint_dir)
        _check_checkpoint_dir(Path(checkpoint_dir), resume)
        if resume:
            state = checkpoint.load(ckpt_path)
            _check_resumable(state, config, ckpt_path, scheduler is not None)

    # --- build ---
    module = module.to(amp.device)
    first = local_indices(0, seed, n, batch_size, rank, world_size)[:batch_size // (world_size * accum_steps)]
    _preflight(module, data.tensors[0][first].to(amp.device), data.tensors[1][first].to(amp.device),
               models.loss_fn if loss_fn is None else None, amp)
    loss_fn = loss_fn or models.loss_fn
    net = wrap(module) if wrap is not None else module
    opt = make_optimizer(optimizer, net.parameters(), lr, weight_decay)
    sched = make_scheduler(scheduler, opt, steps)
    scaler = amp.make_scaler(**(scaler_kwargs or {}))
    hist = History(precision=amp.precision, device_type=amp.device_type, world_size=world_size, model=module)
    if checkpoint_dir is not None:
        Path(checkpoint_dir).mkdir(parents=True, exist_ok=True)

    devices = [amp.device] if amp.device_type == "cuda" else []
    with torch.random.fork_rng(devices=devices):  # the caller's RNG streams are left as they were
        start = 0
        if state is not None:
            start = checkpoint.restore(state, module, opt, scaler, sched, device=amp.device, path=ckpt_path)
            for key, values in state.get("history", {}).items():
                if key in _SERIES:
                    getattr(hist, key).extend(values)
        else:
            torch.manual_seed(seed)
        hist.start_step = start
        xs, ys = data.tensors
        bar = tqdm(total=steps, initial=start, desc=f"train {amp.precision}", disable=not progress or rank != 0,
                   unit="step")
        for step in range(start, steps):
            t0 = time.perf_counter()
            idx = local_indices(step, seed, n, batch_size, rank, world_size)
            micro = [(xs[i].to(amp.device, non_blocking=True), ys[i].to(amp.device, non_blocking=True))
                     for i in (idx.view(accum_steps, -1) if accum_steps > 1 else (idx,))]
            stats = train_step(net, micro, loss_fn, opt, scaler, amp, grad_clip=grad_clip, scheduler=sched)
            if not bar.disable:
                bar.update(1)
                bar.set_postfix(loss=f"{stats.loss:.4g}", scale=f"{stats.scale:g}", refresh=False)
            # The step's wall time covers everything the loop does per step except writing a checkpoint.
            hist.append(stats, time.perf_counter() - t0)
            done = step + 1
            if ckpt_path is not None and rank == 0 and _checkpoint_due(done, steps, checkpoint_every):
                checkpoint.save(checkpoint.capture(done, module, opt, scaler, sched, device=amp.device,
                                                   config=config, history=hist.series()), ckpt_path)
        bar.close()
    hist.final_scale = scaler.get_scale()
    return hist


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    """The argparse parser for python -m ampcourse.train."""
    p = argparse.ArgumentParser(prog="python -m ampcourse.train",
                                description="Train a reference model with AMP and write a JSON summary.")
    p.add_argument("--model", choices=models.MODELS, default="mlp")
    p.add_argument("--precision", choices=("fp32", "fp16", "bf16"), default=None,
                   help="default: the device's AMP dtype (fp16 on CUDA, bf16 on CPU)")
    p.add_argument("--strategy", choices=STRATEGIES, default="single", help="ddp and fsdp: not yet")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--global-batch-size", type=int, default=64, help="samples per optimizer step, all ranks")
    p.add_argument("--accum-steps", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--grad-clip", type=float, default=None)
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--size", choices=tuple(models.SIZES), default="tiny")
    p.add_argument("--samples", type=int, default=1024, help="synthetic dataset size")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=None)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N, mps (default: best available)")
    p.add_argument("--out", default=None, metavar="SUMMARY.json", help="write the summary here (default: stdout)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; bad arguments exit non-zero with one line, not a traceback."""
    args = _parser().parse_args(argv)
    if args.out is not None:  # fail before training, not after
        parent = Path(args.out).resolve().parent
        if not parent.is_dir() or Path(args.out).is_dir():
            raise SystemExit(f"ampcourse.train: error: cannot write --out {args.out!r}: "
                             f"{'it is a directory' if Path(args.out).is_dir() else 'its folder does not exist'}")
    try:
        hist = train(args.model, None, precision=args.precision, steps=args.steps, lr=args.lr, seed=args.seed,
                     device=args.device, grad_clip=args.grad_clip, accum_steps=args.accum_steps,
                     checkpoint_dir=args.checkpoint_dir, resume=args.resume, batch_size=args.global_batch_size,
                     checkpoint_every=args.checkpoint_every, optimizer=args.optimizer,
                     weight_decay=args.weight_decay, progress=not args.no_progress, size=args.size,
                     n_samples=args.samples)
    except ValueError as err:  # includes CheckpointError
        raise SystemExit(f"ampcourse.train: error: {err}") from None
    summary = {**hist.summary(), "strategy": args.strategy, "model": args.model, "seed": args.seed,
               "global_batch_size": args.global_batch_size, "resumed_from_step": hist.start_step}
    text = json.dumps(summary, indent=2)
    if args.out is None:
        print(text)
    else:
        try:
            Path(args.out).write_text(text + "\n")
        except OSError as err:
            raise SystemExit(f"ampcourse.train: error: cannot write --out {args.out!r}: {err.strerror}") from None
        print(f"ampcourse.train: {summary['steps_done']} steps, final loss {summary['final_loss']:.4g}, "
              f"{summary['skipped_steps']} skipped; summary in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
