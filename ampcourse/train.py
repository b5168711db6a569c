"""One AMP training loop for fp32, fp16 (+ GradScaler) and bf16, with clipping, accumulation and resume.

Launch commands::

    # 1 process (CPU, one GPU or Apple MPS), with a JSON summary:
    python -m ampcourse.train --model mlp --precision bf16 --steps 200 --out summary.json
    # checkpoint every 50 steps, then continue an interrupted run exactly where it stopped:
    python -m ampcourse.train --model mlp --steps 200 --checkpoint-dir runs/a --checkpoint-every 50
    python -m ampcourse.train --model mlp --steps 400 --checkpoint-dir runs/a --resume
    # N processes on one node: one per GPU (NCCL), or N CPU processes over gloo on a machine without one.
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: a fresh TCPStore per restart round, so torchrun's restarts
    # work (pytorch/pytorch#135712); harmless without --max-restarts.
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node N \\
        -m ampcourse.train --strategy ddp --precision fp16 --steps 200 --out summary.json
    # CPU only (laptop, CI): the same, with --device cpu (gloo); one OpenMP thread per process
    OMP_NUM_THREADS=1 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node 2 \\
        -m ampcourse.train --strategy ddp --device cpu --precision bf16 --steps 200
    # M nodes (run on every node; HOST = the first node; --checkpoint-dir on a shared filesystem);
    # after a failure torchrun restarts all workers, which resume from the last checkpoint by themselves:
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes M --nproc-per-node N --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29500 --rdzv-id myjob --max-restarts 1 \\
        -m ampcourse.train --strategy fsdp --precision bf16 --checkpoint-dir /shared/run --checkpoint-every 50
    # SLURM: ampcourse.distributed.render_slurm(nodes, gpus_per_node) writes the batch script (srun + torchrun).

Under torchrun, rank 0 logs, shows the progress bar and writes --out; --strategy ddp wraps the model in
DistributedDataParallel, --strategy fsdp shards it with FSDP2 (``ampcourse.distributed``). The summary
holds world size, backend (nccl/gloo), device type, precision, steps, skipped steps, the final loss of
the global batch, the final loss scale and a checksum of the final (full) parameters.

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
- Process groups and model wrapping stay in ``ampcourse.distributed``: ``rank``/``world_size`` pick the
  slice, ``wrap`` receives the model after it moved to the device (DDP or ``fully_shard`` plug in there),
  micro-batches before the last one run under ``model.no_sync()`` when the wrapper has it, and a
  ``checkpointer`` writes one file from rank 0 (single, DDP) or DCP shards from every rank (FSDP2).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import TensorDataset
from tqdm.auto import tqdm

from . import _args, checkpoint, models, scaling
from .device import AmpSetup, parse_precision, pick

__all__ = ["History", "StepStats", "train", "train_step", "batch_indices", "local_indices", "make_optimizer",
           "make_scheduler", "state_checksum", "main", "OPTIMIZERS", "SCHEDULERS", "STRATEGIES"]

OPTIMIZERS = ("adamw", "adam", "sgd")
SCHEDULERS = ("cosine",)
STRATEGIES = ("single", "ddp", "fsdp")  # ddp and fsdp run under torchrun, through ampcourse.distributed
# History fields saved in a checkpoint, so a resumed run returns the whole run's history.
_SERIES = ("loss", "scale", "skipped", "grad_norm", "lr", "step_time")
# Settings a resumed run must share with the checkpoint: they fix which samples each step sees
# and what the saved scaler state means.
# lr and weight_decay too: optimizer.load_state_dict would silently put back the checkpoint's values, so a
# resume "with lr=1e-4" would go on with the old one. Refused, not warned: a resumed run stays the run it was.
_MUST_MATCH = ("precision", "seed", "batch_size", "dataset_size", "lr", "weight_decay")


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
    backend: str = "none"  # the process-group backend (nccl, gloo) under --strategy ddp/fsdp
    start_step: int = 0  # the step this call started from (> 0 after a resume)
    loss: list[float] = field(default_factory=list)
    scale: list[float] = field(default_factory=list)
    skipped: list[bool] = field(default_factory=list)
    grad_norm: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    step_time: list[float] = field(default_factory=list)  # seconds per step, wall clock
    final_scale: float = 1.0  # the scaler's scale after the last update
    peak_device_bytes: int | None = None  # CUDA: peak memory allocated by the training steps (after the preflight)
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
    # Plain ints: a numpy seed would overflow in _epoch_generator's arithmetic and miss the permutation cache.
    step, seed = _args.integer(step, "step", low=0), _args.seed(seed)
    dataset_size, batch_size = _args.integer(dataset_size, "dataset_size", low=1), _args.integer(batch_size, "batch_size", low=1)
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

def make_optimizer(spec: str | Callable, params, lr: float, weight_decay: float = 0.0,
                   fused: bool | None = None) -> torch.optim.Optimizer:
    """'adamw', 'adam', 'sgd' (plain, no momentum) or a callable(params, lr, weight_decay).

    fused (Adam/AdamW only): one fused kernel per step that also takes GradScaler's inf check on the device,
    so scaler.step() needs no host sync. None: fused when every parameter is on a CUDA device.
    """
    if callable(spec):
        return spec(params, lr=lr, weight_decay=weight_decay)
    if spec in ("adam", "adamw"):
        params = list(params)
        if fused is None:
            fused = bool(params) and all(isinstance(p, torch.Tensor) and p.device.type == "cuda" for p in params)
        cls = torch.optim.AdamW if spec == "adamw" else torch.optim.Adam
        return cls(params, lr=lr, weight_decay=weight_decay, **({"fused": True} if fused else {}))
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
    the fused kernel get_total_norm uses, squared. Anything else (DTensor shards, sparse or mixed
    gradients): get_total_norm itself (made whole across FSDP2 shards), squared. Like torch's norms, this
    accumulates in the gradients' dtype.
    """
    if not grads:
        return []
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


#: A dataset moves to the GPU once when it needs at most this share of the free device memory.
_DATA_ON_DEVICE_SHARE = 0.25


def _data_on_device(tensors: Sequence[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, ...]:
    """The dataset on the device when it fits comfortably (a CUDA device), else where it is.

    On the device, each step's batch is a gather on the GPU; otherwise a gather from pageable host memory
    and a copy every step. Values are identical either way.
    """
    if device.type != "cuda":
        return tuple(tensors)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    free, _ = torch.cuda.mem_get_info(device)
    if nbytes > _DATA_ON_DEVICE_SHARE * free:
        return tuple(tensors)
    return tuple(t.to(device) for t in tensors)


def _read_back(tensors: list[torch.Tensor]) -> list[float]:
    """0-dim tensors as Python floats: on a GPU stacked into one device-to-host copy, on a CPU one by one."""
    first = tensors[0]
    if first.device.type != "cpu" and all(type(t) is torch.Tensor and t.device == first.device for t in tensors):
        with torch.no_grad():
            return torch.stack(tensors).tolist()  # stack promotes mixed dtypes to the widest
    return [t.item() for t in tensors]  # a CPU has no sync to save, and .item() is cheaper than a stack there


def train_step(model: nn.Module, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]], loss_fn: Callable,
               optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, amp: AmpSetup, *,
               grad_clip: float | None = None, scheduler: Any = None, autocast: bool = True) -> StepStats:
    """One optimizer step over an accumulation window: autocast forward, scaled backward, unscale, clip, step.

    autocast=False leaves the forward pass alone: FSDP2 casts the parameters per module instead.
    """
    optimizer.zero_grad(set_to_none=True)
    n = len(micro_batches)
    losses = []
    for i, (x, y) in enumerate(micro_batches):
        with _grad_sync(model, sync=i == n - 1):
            with amp.autocast(enabled=autocast):  # forward and loss only; backward runs outside autocast
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
        norm_parts = [_full(torch.nn.utils.clip_grad_norm_(params, grad_clip))]
    lr = optimizer.param_groups[0]["lr"]
    before = _scale_tensor(scaler)  # read on the device: get_scale() here and below would be two more syncs
    scale_host = scaler.get_scale() if before is None else None  # 1.0 for a disabled scaler, without a sync
    # Skips optimizer.step() if unscale_ found inf/nan. A non-fused optimizer costs a host sync here (GradScaler
    # reads found_inf with .item()); a fused one (make_optimizer's default on CUDA) gets found_inf as a tensor.
    scaler.step(optimizer)
    scaler.update()
    scales = [before, _scale_tensor(scaler)] if before is not None else []
    # Losses, norms and the scale before and after reach the host together: on a GPU one sync per step.
    values = _read_back([*losses, *norm_parts, *scales])
    if scales:
        scale, new_scale = values[-2:]
        values = values[:-2]
    else:  # a disabled scaler (fp32, bf16): 1.0 both times, never a skip
        scale, new_scale = scale_host, scaler.get_scale()
    # The scaler lowers its scale exactly when it skipped the step; optimizer.step() returns None either
    # way, so the scale is the signal. A skipped step must not advance the LR schedule.
    skipped = new_scale < scale
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


# ---------------------------------------------------------------------------------------------
# Argument checks: all before any work
# ---------------------------------------------------------------------------------------------

def _need_int(name: str, value: Any, low: int, what: str) -> int:
    """value as a Python int >= low (ints, numpy ints, 0-d int tensors); ValueError naming it otherwise."""
    return _args.integer(value, name, low=low, what=what)


def _need_positive_float(name: str, value: Any, allow_zero: bool = False) -> float:
    """value as a finite Python float > 0 (or >= 0); ValueError naming it otherwise (10**400 included)."""
    return _args.real(value, name, positive=not allow_zero, nonnegative=allow_zero)


def _need_bool(name: str, value: Any) -> bool:
    """True or False (numpy bools too); ValueError naming it otherwise ('no' would be truthy)."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise ValueError(f"{name} must be True or False, got {_args.shown(value)}")


_MODEL_NAMES = {models.MLP: "mlp", models.SmallCNN: "cnn", models.TinyTransformer: "transformer"}


def _resolve_model(model: nn.Module | str, size: str, seed: int) -> tuple[nn.Module, str | None]:
    """The module to train and its reference-model name (None for a model of your own)."""
    if isinstance(model, str):
        if model not in models.MODELS:
            raise ValueError(f"unknown model {model!r}; choose one of {', '.join(models.MODELS)} or pass an nn.Module")
        return models.make_model(model, size=size, seed=seed), model
    if isinstance(model, nn.Module):
        _check_trainable(model)
        return model, _MODEL_NAMES.get(type(model))
    raise ValueError(f"model must be an nn.Module or one of {', '.join(models.MODELS)}, got {type(model).__name__}")


def _check_trainable(model: nn.Module) -> None:
    """ValueError unless the model holds real (not meta) tensors and at least one parameter that trains."""
    tensors = [*model.parameters(), *model.buffers()]
    meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if meta:
        raise ValueError(f"model holds tensors on the meta device (shapes without values), e.g. {meta[0]!r}; "
                         "give it real weights first (model.to_empty(device='cpu') and initialise, or load a state_dict)")
    if not tensors or not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"model {type(model).__name__} has no trainable parameters "
                         f"({'none at all' if not tensors else 'all have requires_grad=False'}); "
                         "unfreeze some (p.requires_grad_(True)) before training")


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
    for what, t in zip(("inputs", "targets"), data.tensors):
        if t.is_meta:
            raise ValueError(f"data {what} are on the meta device (shapes without values); pass real tensors")
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


def _check_checkpoint_dir(directory: Path, resume: bool, ckpt: Path) -> None:
    """The directory can be written to, and holds a checkpoint exactly when we resume."""
    _args.creatable_dir(directory, "checkpoint_dir")
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
                     resume, checkpoint_dir, checkpoint_every, optimizer, scheduler, size, n_samples) -> dict[str, Any]:
    """The checks on train()'s arguments that need neither the model nor the data; returns them as Python values.

    Numbers may come as Python, numpy or 0-d tensor scalars; what goes on (into the loop, the batch order,
    the checkpoint's settings) is plain int/float, so a checkpoint written with np.float64 lr loads with
    weights_only=True like any other.
    """
    v = {"steps": _need_int("steps", steps, 1, "an int >= 1"),
         "lr": _need_positive_float("lr", lr),
         "seed": _args.seed(seed),
         "accum_steps": _need_int("accum_steps", accum_steps, 1, "an int >= 1 (1 = no accumulation)"),
         "batch_size": _need_int("batch_size", batch_size, 1, "an int >= 1 (the global batch size)"),
         "world_size": _need_int("world_size", world_size, 1, "an int >= 1"),
         "n_samples": _need_int("n_samples", n_samples, 1, "a positive int (the synthetic dataset size)"),
         "resume": _need_bool("resume", resume)}
    world = v["world_size"]
    v["rank"] = _args.integer(rank, "rank", low=0, high=world - 1,
                              what=f"an int in 0..{world - 1} (world_size={world})")
    v["grad_clip"] = None if grad_clip is None else _need_positive_float("grad_clip", grad_clip)
    v["weight_decay"] = _need_positive_float("weight_decay", weight_decay, allow_zero=True)
    v["checkpoint_every"] = (None if checkpoint_every is None else
                             _need_int("checkpoint_every", checkpoint_every, 1, "an int >= 1 or None (only at the end)"))
    if checkpoint_dir is None and (v["resume"] or v["checkpoint_every"] is not None):
        raise ValueError("resume and checkpoint_every need a checkpoint_dir")
    if checkpoint_dir is not None and not isinstance(checkpoint_dir, (str, os.PathLike)):
        raise ValueError(f"checkpoint_dir must be a path (str or pathlib.Path) or None, got {_args.shown(checkpoint_dir)}")
    if not callable(optimizer) and optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZERS)} or pass a callable")
    if scheduler is not None and not callable(scheduler) and scheduler not in SCHEDULERS:
        raise ValueError(f"unknown scheduler {scheduler!r}; choose None, {', '.join(SCHEDULERS)} or pass a callable")
    if not isinstance(size, str) or size not in models.SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(models.SIZES)}")
    return v


_SCALER_DEFAULTS = {"init_scale": 2.0**16, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000}


def _check_scaler_kwargs(scaler_kwargs: dict | None) -> dict[str, Any]:
    """scaler_kwargs holds only GradScaler's settings, each one sensible (GradScaler itself accepts a negative scale).

    Returns them as Python numbers (GradScaler passes them to a C++ kernel that takes no numpy scalars).
    """
    if scaler_kwargs is None:
        return {}
    if not isinstance(scaler_kwargs, dict):
        raise ValueError(f"scaler_kwargs must be a dict or None, got {scaler_kwargs!r}")
    unknown = sorted(set(scaler_kwargs) - {*_SCALER_DEFAULTS, "enabled"})
    if unknown:
        raise ValueError(f"unknown scaler_kwargs {unknown}; GradScaler takes {', '.join([*_SCALER_DEFAULTS, 'enabled'])}")
    settings = {**_SCALER_DEFAULTS, **{k: v for k, v in scaler_kwargs.items() if k != "enabled"}}
    normalised = dict(zip(_SCALER_DEFAULTS, scaling.check_scaler_args(**settings)))
    if "enabled" in scaler_kwargs:
        normalised["enabled"] = _need_bool("scaler_kwargs['enabled']", scaler_kwargs["enabled"])
    return normalised


def _check_finite(data: TensorDataset) -> None:
    """ValueError if a floating-point input or target is nan or inf: every step would give a nan loss."""
    for what, t in zip(("inputs", "targets"), data.tensors):
        if t.is_floating_point():
            bad = ~torch.isfinite(t)
            if bad.any():
                first = int(bad.reshape(len(t), -1).any(1).nonzero()[0])
                raise ValueError(f"data {what} hold {int(bad.sum())} nan/inf values (the first in sample {first}); "
                                 "every step would give a nan loss: clean or drop those samples")


def _preflight(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable | None, amp: AmpSetup,
               autocast: bool = True) -> None:
    """Run the model (and the course's loss) once on one micro-batch: data that does not fit fails now, clearly.

    Eval mode, no gradients and a forked RNG: no parameter, running statistic or random stream changes,
    so the run that follows is exactly the one without this check. A loss function of your own is not
    called here (it may count its calls); pass loss_fn=None to check only the model.
    """
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.random.fork_rng(devices=[amp.device] if amp.device_type == "cuda" else []), torch.no_grad():
            with models.data_errors(model, x, y), amp.autocast(enabled=autocast):
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
          wrap: Callable[[nn.Module], nn.Module] | None = None, checkpointer: Any = None,
          autocast: bool = True) -> History:
    """Train `model` for `steps` optimizer steps in fp32, fp16 (+ GradScaler) or bf16; returns a History.

    model: an nn.Module (trained in place, moved to the device) or 'mlp' | 'cnn' | 'transformer'
        (built with `size` and `seed`). data: TensorDataset(inputs, targets), or None for the reference
        model's synthetic dataset of `n_samples`. precision: 'fp32' | 'fp16' | 'bf16' (None: the device's
        default from `pick`). batch_size: the GLOBAL batch per optimizer step (all ranks and micro-batches);
        it must divide by world_size * accum_steps. grad_clip: max L2 norm of the true gradients.
        checkpoint_dir: write checkpoint.pt there every `checkpoint_every` steps and at the end;
        resume=True continues from it (bit-identical to an uninterrupted run on CPU). A resume is refused
        (ValueError) if precision, seed, batch_size, the dataset size, lr or weight_decay differ from the
        checkpoint's: the optimizer state would silently put the old lr back, so a changed lr is an error,
        not a warning. Numbers may be Python, numpy or 0-d tensor scalars; they are checked and converted
        to Python ints/floats before any work (ampcourse._args).
        optimizer: 'adamw' | 'adam' | 'sgd' or callable(params, lr=, weight_decay=). scheduler: None |
        'cosine' | callable(optimizer); it is not stepped on steps the GradScaler skipped.
        rank/world_size/wrap: hooks for ampcourse.distributed (wrap gets the model on its device).
        checkpointer: how checkpoints are written and read (default: checkpoint.FileCheckpointer(rank),
        one file from rank 0; FSDP2 passes distributed.ShardedCheckpointer). autocast=False: no autocast
        around the forward pass (FSDP2's MixedPrecisionPolicy casts the parameters instead).
    """
    # --- validate everything before any work ---
    prec = parse_precision(precision) if precision is not None else None
    checked = _check_arguments(steps=steps, lr=lr, seed=seed, accum_steps=accum_steps, batch_size=batch_size,
                               rank=rank, world_size=world_size, grad_clip=grad_clip, weight_decay=weight_decay,
                               resume=resume, checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every,
                               optimizer=optimizer, scheduler=scheduler, size=size, n_samples=n_samples)
    # From here on every number is a plain Python int/float (numpy and tensor scalars were normalised).
    steps, lr, seed, accum_steps, batch_size = (checked[k] for k in ("steps", "lr", "seed", "accum_steps", "batch_size"))
    rank, world_size, grad_clip, weight_decay = (checked[k] for k in ("rank", "world_size", "grad_clip", "weight_decay"))
    resume, checkpoint_every, n_samples = checked["resume"], checked["checkpoint_every"], checked["n_samples"]
    scaler_kwargs = _check_scaler_kwargs(scaler_kwargs)
    for name, hook in (("loss_fn", loss_fn), ("wrap", wrap)):
        if hook is not None and not callable(hook):  # else a TypeError from deep inside the first step
            raise ValueError(f"{name} must be a callable or None, got {_args.shown(hook)}")
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
    models.check_data(module, data, targets=loss_fn is None)
    _check_finite(data)
    config = {"precision": amp.precision, "seed": seed, "batch_size": batch_size, "dataset_size": n, "steps": steps,
              "model": name or type(module).__name__, "accum_steps": accum_steps, "world_size": world_size,
              "lr": lr, "weight_decay": weight_decay}
    state, ckpt_path = None, None
    store = checkpointer if checkpointer is not None else checkpoint.FileCheckpointer(rank)
    if checkpoint_dir is not None:
        ckpt_path = store.path(checkpoint_dir)
        _check_checkpoint_dir(Path(checkpoint_dir), resume, ckpt_path)
        if resume:
            state = store.read(checkpoint_dir)
            _check_resumable(state, config, ckpt_path, scheduler is not None)

    # --- build ---
    module = module.to(amp.device)
    first = local_indices(0, seed, n, batch_size, rank, world_size)[:batch_size // (world_size * accum_steps)]
    _preflight(module, data.tensors[0][first].to(amp.device), data.tensors[1][first].to(amp.device),
               models.loss_fn if loss_fn is None else None, amp, autocast)
    if amp.device_type == "cuda":  # the peak we report is the training steps', not the preflight's
        torch.cuda.reset_peak_memory_stats(amp.device)
    loss_fn = loss_fn or models.loss_fn
    net = wrap(module) if wrap is not None else module
    opt = make_optimizer(optimizer, net.parameters(), lr, weight_decay)
    sched = make_scheduler(scheduler, opt, steps)
    scaler = amp.make_scaler(**scaler_kwargs)
    config["optimizer"] = type(opt).__name__  # restore() refuses a checkpoint of another optimizer by this name
    hist = History(precision=amp.precision, device_type=amp.device_type, world_size=world_size, model=module)
    if checkpoint_dir is not None:
        Path(checkpoint_dir).mkdir(parents=True, exist_ok=True)

    devices = [amp.device] if amp.device_type == "cuda" else []
    with torch.random.fork_rng(devices=devices):  # the caller's RNG streams are left as they were
        start = 0
        if state is not None:
            start = store.restore(state, checkpoint_dir, net=net, module=module, optimizer=opt, scaler=scaler,
                                  scheduler=sched, device=amp.device)
            for key, values in state.get("history", {}).items():
                if key in _SERIES:
                    getattr(hist, key).extend(values)
        else:
            torch.manual_seed(seed)
        hist.start_step = start
        xs, ys = _data_on_device(data.tensors, amp.device)
        bar = tqdm(total=steps, initial=start, desc=f"train {amp.precision}", disable=not progress or rank != 0,
                   unit="step")
        for step in range(start, steps):
            t0 = time.perf_counter()
            idx = local_indices(step, seed, n, batch_size, rank, world_size)
            if xs.device != idx.device:  # the data lives on the GPU: gather there (the indices are a few bytes)
                idx = idx.to(xs.device, non_blocking=True)
            micro = [(xs[i].to(amp.device, non_blocking=True), ys[i].to(amp.device, non_blocking=True))
                     for i in (idx.view(accum_steps, -1) if accum_steps > 1 else (idx,))]
            stats = train_step(net, micro, loss_fn, opt, scaler, amp, grad_clip=grad_clip, scheduler=sched,
                               autocast=autocast)
            if not bar.disable:
                bar.update(1)
                bar.set_postfix(loss=f"{stats.loss:.4g}", scale=f"{stats.scale:g}", refresh=False)
            # The step's wall time covers everything the loop does per step except writing a checkpoint.
            hist.append(stats, time.perf_counter() - t0)
            done = step + 1
            if ckpt_path is not None and _checkpoint_due(done, steps, checkpoint_every):
                store.write(checkpoint_dir, done, net=net, module=module, optimizer=opt, scaler=scaler,
                            scheduler=sched, device=amp.device, config=config, history=hist.series())
        bar.close()
    hist.final_scale = scaler.get_scale()
    if amp.device_type == "cuda":
        hist.peak_device_bytes = torch.cuda.max_memory_allocated(amp.device)
    return hist


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

def _rank_step(text: str) -> tuple[int, int]:
    """argparse type for RANK:STEP."""
    try:
        rank, step = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected RANK:STEP (two ints), got {text!r}") from None
    if rank < 0 or step < 0:
        raise argparse.ArgumentTypeError(f"RANK and STEP must be >= 0, got {text!r}")
    return rank, step


def _parser() -> argparse.ArgumentParser:
    """The argparse parser for python -m ampcourse.train."""
    p = argparse.ArgumentParser(prog="python -m ampcourse.train",
                                description="Train a reference model with AMP and write a JSON summary. "
                                            "Under torchrun, --strategy ddp|fsdp trains on every process.")
    p.add_argument("--model", choices=models.MODELS, default="mlp")
    p.add_argument("--precision", choices=("fp32", "fp16", "bf16"), default=None,
                   help="default: the device's AMP dtype (bf16 on CPU and on GPUs with native bf16, "
                        "compute capability >= 8.0; fp16 + GradScaler on older GPUs)")
    p.add_argument("--strategy", choices=STRATEGIES, default="single",
                   help="single: one process; ddp (DistributedDataParallel) and fsdp (FSDP2): under torchrun")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--global-batch-size", type=int, default=64, help="samples per optimizer step, all ranks")
    p.add_argument("--accum-steps", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--grad-clip", type=float, default=None)
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    p.add_argument("--fused", action=argparse.BooleanOptionalAction, default=None,
                   help="fused Adam/AdamW kernel (no host sync in the scaler's step); default: on for CUDA")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--size", choices=tuple(models.SIZES), default="tiny")
    p.add_argument("--samples", type=int, default=1024, help="synthetic dataset size")
    p.add_argument("--checkpoint-dir", default=None, help="shared by all ranks (on every node)")
    p.add_argument("--checkpoint-every", type=int, default=None)
    p.add_argument("--resume", action="store_true",
                   help="continue from --checkpoint-dir (after a torchrun restart this happens by itself)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N, mps (default: best available; "
                                                  "under torchrun: cuda:LOCAL_RANK or cpu)")
    p.add_argument("--out", default=None, metavar="SUMMARY.json", help="write the summary here (default: stdout)")
    p.add_argument("--history-out", default=None, metavar="HISTORY.json",
                   help="write every rank's per-step loss, scale and skipped flags here (rank 0 writes)")
    p.add_argument("--dist-timeout", type=float, default=300.0, metavar="SECONDS",
                   help="bound on process-group setup and on every collective (default 300)")
    p.add_argument("--inject-inf", type=_rank_step, default=None, metavar="RANK:STEP",
                   help="teaching aid: make RANK's gradients non-finite (before they are averaged across ranks) "
                        "in the STEP-th step this launch runs, counting from 0")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return p


@dataclass(frozen=True)
class _Plan:
    """What main() decided before any process group exists."""

    device: str | None
    resume: bool
    checkpointer: Any


def _fail(message: str, local_rank: int) -> None:
    """Exit non-zero with one line; under torchrun only local rank 0 prints it (the others would repeat it)."""
    if local_rank == 0:
        raise SystemExit(f"ampcourse.train: error: {message}")
    raise SystemExit(1)


def _plan(args: argparse.Namespace, env) -> _Plan:
    """All the checks that need no process group: strategy vs launcher, devices, batch split, checkpoints."""
    from . import distributed

    for flag, path in (("--out", args.out), ("--history-out", args.history_out)):
        if path is not None:  # fail before training, not after it
            _args.writable_file(path, flag)
    if args.strategy == "single":
        if env.world_size > 1:
            raise ValueError(f"--strategy single runs one process, but torchrun started WORLD_SIZE={env.world_size}; "
                             "use --strategy ddp or fsdp")
        device = args.device
    else:
        if not env.launched:
            raise ValueError(f"--strategy {args.strategy} runs under torchrun: torchrun --standalone "
                             f"--nproc-per-node N -m ampcourse.train --strategy {args.strategy} ... "
                             "(see the module docstring)")
        device = distributed.worker_device(env, args.device)
    if not math.isfinite(args.dist_timeout) or args.dist_timeout <= 0:
        raise ValueError(f"--dist-timeout must be a number of seconds > 0, got {args.dist_timeout!r}")
    split = env.world_size * args.accum_steps
    if args.global_batch_size >= 1 and args.accum_steps >= 1 and args.global_batch_size % split:
        raise ValueError(f"--global-batch-size {args.global_batch_size} must divide by world size x accum steps = "
                         f"{env.world_size} x {args.accum_steps}, so every rank gets the same number of samples")
    if args.inject_inf is not None and args.inject_inf[0] >= env.world_size:
        raise ValueError(f"--inject-inf {args.inject_inf[0]}:{args.inject_inf[1]}: there is no rank "
                         f"{args.inject_inf[0]} in a world of {env.world_size}")
    store = (distributed.ShardedCheckpointer(env.rank) if args.strategy == "fsdp"
             else checkpoint.FileCheckpointer(env.rank))
    resume = args.resume
    if args.checkpoint_dir is not None:
        here = store.path(args.checkpoint_dir).exists()
        other = (checkpoint.FileCheckpointer() if args.strategy == "fsdp" else distributed.ShardedCheckpointer())
        if args.resume and not here and other.path(args.checkpoint_dir).exists():
            raise ValueError(f"--resume: {args.checkpoint_dir!r} holds a {other.kind}, and --strategy {args.strategy} "
                             f"resumes from a {store.kind}; resume with the strategy that wrote it")
        if args.resume and not here:  # now, not after every rank has joined a process group
            raise ValueError(f"--resume: there is no checkpoint at {str(store.path(args.checkpoint_dir))!r}; "
                             "run once without resume (with this --checkpoint-dir) to create one")
        if env.restart_count > 0 and here:
            resume = True  # torchrun restarted the workers after a failure: continue from the last checkpoint
    return _Plan(device=device, resume=resume, checkpointer=store)


def _inject_inf(rank: int, step: int, accum_steps: int, loss_fn: Callable) -> Callable:
    """loss_fn that gives the logits one infinite gradient entry on `rank` in this launch's `step`-th step."""
    calls = {"n": 0}

    def wrapped(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        me = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if me == rank and calls["n"] == step * accum_steps:
            # One entry of dLoss/dlogits becomes inf, as when an fp16 backward overflows on this rank only;
            # every parameter gradient upstream turns inf/nan here, before DDP or FSDP2 averages them.
            logits.register_hook(lambda g: g.index_fill(-1, torch.tensor([0], device=g.device), float("inf")))
        calls["n"] += 1
        return loss_fn(logits, target)
    return wrapped


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI (one process, or one torchrun worker); bad arguments exit non-zero with one line."""
    from . import distributed

    args = _parser().parse_args(argv)
    try:
        env = distributed.torchrun_env()
    except ValueError as err:
        raise SystemExit(f"ampcourse.train: error: {err}") from None
    try:
        plan = _plan(args, env)
    except (ValueError, TypeError) as err:
        _fail(str(err), env.local_rank)
    warning = distributed.shared_store_warning(env)
    if warning and env.is_main and env.restart_count == 0:  # once per job, from rank 0
        print(f"ampcourse.train: warning: {warning}", file=sys.stderr, flush=True)
    if env.restart_count > 0 and env.is_main:
        print(f"ampcourse.train: torchrun restart {env.restart_count}: "
              + ("resuming from the last checkpoint" if plan.resume else "no checkpoint yet, starting over"),
              file=sys.stderr, flush=True)
    try:
        try:
            summary, history = _run(args, env, plan)
        except BaseException:
            distributed.teardown()
            raise
        distributed.teardown(barrier=True)  # every rank is done communicating before any rank shuts down
    except (ValueError, TypeError) as err:  # includes CheckpointError
        _fail(str(err), env.local_rank)
    if not env.is_main:
        return 0
    text = json.dumps(summary, indent=2)
    try:
        if args.history_out is not None:
            Path(args.history_out).write_text(json.dumps(history) + "\n")
        if args.out is not None:
            Path(args.out).write_text(text + "\n")
    except OSError as err:
        raise SystemExit(f"ampcourse.train: error: cannot write the output: {err.strerror}") from None
    if args.out is None:
        print(text)
    else:
        print(f"ampcourse.train: {summary['steps_done']} steps on {summary['world_size']} process"
              f"{'es' if summary['world_size'] > 1 else ''}, final loss {summary['final_loss']:.4g}, "
              f"{summary['skipped_steps']} skipped; summary in {args.out}")
    return 0


def _run(args: argparse.Namespace, env, plan: _Plan) -> tuple[dict, dict | None]:
    """Start the process group (ddp/fsdp), train, and build the summary (collectives on every rank)."""
    from . import distributed

    ctx, wrap = None, None
    if args.strategy != "single":
        ctx = distributed.init(plan.device, env, timeout_s=args.dist_timeout)
        if args.strategy == "fsdp":
            problem = distributed.fsdp_problem(ctx.device.type)
            if problem:
                raise ValueError(f"--strategy fsdp cannot run here: {problem}; use --strategy ddp")
        amp = pick(plan.device, args.precision)
        wrap = functools.partial(distributed.wrap_model, strategy=args.strategy, amp=amp, ctx=ctx)
    made: list[torch.optim.Optimizer] = []

    def optimizer(params, lr: float, weight_decay: float) -> torch.optim.Optimizer:
        made.append(make_optimizer(args.optimizer, params, lr, weight_decay, fused=args.fused))  # kept for the memory report
        return made[-1]

    loss = (models.loss_fn if args.inject_inf is None
            else _inject_inf(*args.inject_inf, args.accum_steps, models.loss_fn))
    hist = train(args.model, None, precision=args.precision, steps=args.steps, lr=args.lr, seed=args.seed,
                 device=plan.device, grad_clip=args.grad_clip, accum_steps=args.accum_steps,
                 checkpoint_dir=args.checkpoint_dir, resume=plan.resume, batch_size=args.global_batch_size,
                 checkpoint_every=args.checkpoint_every, optimizer=optimizer, weight_decay=args.weight_decay,
                 progress=not args.no_progress, size=args.size, n_samples=args.samples, rank=env.rank,
                 world_size=env.world_size, wrap=wrap, checkpointer=plan.checkpointer,
                 autocast=args.strategy != "fsdp", loss_fn=loss)
    hist.backend = ctx.backend if ctx is not None else "none"
    summary = hist.summary()  # for FSDP2 the checksum gathers the shards: every rank takes part
    # Each rank's loss is over its slice of the global batch; their mean is the global batch's loss.
    summary["final_loss"] = sum(distributed.gather(hist.final_loss)) / env.world_size
    summary.update({"strategy": args.strategy, "model": args.model, "seed": args.seed,
                    "global_batch_size": args.global_batch_size, "resumed_from_step": hist.start_step})
    history = None
    if args.history_out is not None:
        mine = {"rank": env.rank, **hist.series(), "final_scale": hist.final_scale,
                "state_bytes": distributed.local_state_bytes(hist.model, made[0]),
                "peak_cuda_bytes": hist.peak_device_bytes,  # whichever device train() picked, after its preflight
                # DDP replicas must stay identical; FSDP2 ranks hold different shards, so no per-rank checksum
                "replica_checksum": None if args.strategy == "fsdp" else state_checksum(hist.model)}
        ranks = distributed.gather(mine)
        history = {"strategy": args.strategy, "world_size": env.world_size, "precision": hist.precision,
                   "ranks": ranks}
    return summary, history


if __name__ == "__main__":
    from .distributed import exit_worker

    exit_worker(main())
