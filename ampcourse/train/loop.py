"""The training loop: :func:`train` (checks, build, the loop), its :class:`History` and its :class:`Parallel` settings.

The loop is short on purpose: every check of the arguments lives in ``checks`` (all of them run before
any work), one optimizer step in ``step``, which samples each step sees in ``batches``, the command line
in ``cli``. What stays here is what a reader of nanoGPT's train.py expects to find in one place.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.utils.data import TensorDataset
from tqdm.auto import tqdm

from .. import _args, models
from . import checks
from .batches import StepIndices, data_on_device, local_indices
from .step import StepStats, make_optimizer, make_scheduler, state_checksum, train_step

__all__ = ["History", "Parallel", "train"]

# History fields saved in a checkpoint, so a resumed run returns the whole run's history.
_SERIES = ("loss", "scale", "skipped", "grad_norm", "lr", "step_time")


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


@dataclass(frozen=True)
class Parallel:
    """How this process takes part in a multi-process run; the defaults are one process (what most callers want).

    ``ampcourse.train``'s command line fills it in from torchrun's environment (``ampcourse.distributed``).

    Args:
        rank: this process's global rank, 0 .. world_size - 1: it picks this rank's slice of every global batch.
        world_size: how many processes share each global batch.
        wrap: called once with the model on its device; returns the model to train (DDP, or FSDP2's
            ``fully_shard``). Micro-batches before the last run under its ``no_sync()`` when it has one.
        checkpointer: how checkpoints are written and read: ``checkpoint.FileCheckpointer(rank)`` (default: one
            file, written by rank 0) or ``checkpoint.ShardedCheckpointer(rank)`` (FSDP2, DCP shards).
        autocast: False leaves the forward pass alone (FSDP2's MixedPrecisionPolicy casts the parameters instead).

    Example::

        >>> train("mlp", parallel=Parallel(rank=1, world_size=2))   # rank 1's half of each batch, no process group
    """

    rank: int = 0
    world_size: int = 1
    wrap: Callable[[nn.Module], nn.Module] | None = None
    checkpointer: Any = None
    autocast: bool = True


def _checkpoint_due(done: int, steps: int, every: int | None) -> bool:
    """Write a checkpoint after the last step and after every `every`-th one."""
    return done == steps or (every is not None and done % every == 0)


def train(model: nn.Module | str, data: TensorDataset | None = None, precision: str | None = None,
          steps: int = 100, lr: float = 1e-3, seed: int = 0, device: str | torch.device | None = None,
          grad_clip: float | None = None, accum_steps: int = 1, checkpoint_dir: str | os.PathLike | None = None,
          resume: bool = False, *, batch_size: int = 64, checkpoint_every: int | None = None,
          optimizer: str | Callable = "adamw", weight_decay: float = 0.0, scheduler: str | Callable | None = None,
          loss_fn: Callable | None = None, scaler_kwargs: dict | None = None, progress: bool = True,
          size: str = "tiny", n_samples: int = 1024, parallel: Parallel | None = None,
          on_step: Callable[[int, StepStats], None] | None = None) -> History:
    """Train `model` for `steps` optimizer steps in fp32, fp16 (+ GradScaler) or bf16; returns a :class:`History`.

    One loop serves every precision: autocast and the GradScaler are switched by ``enabled=`` flags from
    ``ampcourse.device.pick`` (for fp32 and bf16 the scaler is disabled and its calls are no-ops). Every
    argument is checked before any work (a ValueError that says what to do); numbers may be Python, numpy
    or 0-d tensor scalars and are turned into Python ints/floats first (``ampcourse._args``).

    Args:
        model: an ``nn.Module`` (trained in place, moved to the device), or ``'mlp'``, ``'cnn'``,
            ``'transformer'`` (built with `size` and `seed`).
        data: ``TensorDataset(inputs, targets)``, or None for the reference model's synthetic dataset of
            `n_samples`.
        precision: ``'fp32'``, ``'fp16'`` or ``'bf16'``. Default: None, the device's choice (``pick``).
        steps: optimizer steps in the whole run (a resumed run continues up to it). Default: 100.
        lr: learning rate. Default: 1e-3.
        seed: seeds the model, the synthetic data and the batch order. Default: 0.
        device: ``'cpu'``, ``'cuda'``, ``'cuda:N'``, ``'mps'``. Default: None, the best available.
        grad_clip: max L2 norm of the true (unscaled) gradients; None: no clipping.
        accum_steps: micro-batches per optimizer step (gradient accumulation). Default: 1.
        checkpoint_dir: write ``checkpoint.pt`` there every `checkpoint_every` steps and after the last.
        resume: continue from `checkpoint_dir` (bit-identical to an uninterrupted run on CPU). Refused
            (ValueError) if precision, seed, batch_size, the dataset size, lr or weight_decay differ from the
            checkpoint's: the optimizer state would silently put the old lr back.
        batch_size: the GLOBAL batch per optimizer step (all ranks and micro-batches); it must divide by
            ``world_size * accum_steps``. Default: 64.
        checkpoint_every: steps between checkpoints; None: only after the last step.
        optimizer: ``'adamw'`` (default; fused on CUDA), ``'adam'``, ``'sgd'``, or a
            ``callable(params, lr=, weight_decay=)``; see :func:`make_optimizer`.
        weight_decay: the optimizer's weight decay. Default: 0.0.
        scheduler: None, ``'cosine'`` or a ``callable(optimizer)``; not stepped on steps the GradScaler skipped.
        loss_fn: ``callable(outputs, targets)``; None: the reference models' cross-entropy.
        scaler_kwargs: GradScaler's settings (``init_scale``, ``growth_factor``, ``backoff_factor``,
            ``growth_interval``, ``enabled``), checked by their owner, ``ampcourse._scaler``.
        progress: show a tqdm progress bar (rank 0 only). Default: True.
        size: the reference models' size (``'tiny'``, ...). Default: ``'tiny'``.
        n_samples: size of the synthetic dataset when `data` is None. Default: 1024.
        parallel: a :class:`Parallel`: rank, world size, model wrapper, checkpointer, autocast. Default: one process.
        on_step: called as ``on_step(step, stats)`` after each optimizer step has been recorded (and
            checkpointed, when one was due); e.g. to log, or to time something between two steps
            (``ampcourse.bench``). Default: None.

    Returns:
        A :class:`History`: per-step loss, scale, skipped flags, gradient norms, learning rates and step
        times (a resumed run includes the steps before it), the final scale, and the trained model.

    Example::

        >>> from ampcourse.train import train
        >>> hist = train("mlp", precision="bf16", steps=50, lr=1e-3, seed=0, progress=False)
        >>> hist.loss[-1] < hist.loss[0], hist.skipped_steps, hist.model
        >>> # fp16 with a GradScaler, resumable: run twice, the second run continues where the first stopped
        >>> train("mlp", precision="fp16", steps=100, checkpoint_dir="runs/a", checkpoint_every=25)
        >>> train("mlp", precision="fp16", steps=200, checkpoint_dir="runs/a", resume=True)
    """
    par = parallel if parallel is not None else Parallel()
    if not isinstance(par, Parallel):
        raise ValueError(f"parallel must be an ampcourse.train.Parallel or None, got {type(par).__name__}")
    run = checks.check_run(model=model, data=data, precision=precision, steps=steps, lr=lr, seed=seed, device=device,
                           grad_clip=grad_clip, accum_steps=accum_steps, checkpoint_dir=checkpoint_dir, resume=resume,
                           batch_size=batch_size, checkpoint_every=checkpoint_every, optimizer=optimizer,
                           weight_decay=weight_decay, scheduler=scheduler, loss_fn=loss_fn, scaler_kwargs=scaler_kwargs,
                           size=size, n_samples=n_samples, rank=par.rank, world_size=par.world_size, wrap=par.wrap,
                           checkpointer=par.checkpointer, autocast=par.autocast, on_step=on_step)
    amp, rank, world = run.amp, run.rank, run.world_size
    n, local_batch = len(run.data), run.batch_size // world

    # --- build ---
    module = run.module.to(amp.device)
    first = local_indices(0, run.seed, n, run.batch_size, rank, world)[:local_batch // run.accum_steps]
    checks.preflight(module, run.data.tensors[0][first].to(amp.device), run.data.tensors[1][first].to(amp.device),
                      models.loss_fn if loss_fn is None else None, amp, par.autocast)
    if amp.device_type == "cuda":  # the peak we report is the training steps', not the preflight's
        torch.cuda.reset_peak_memory_stats(amp.device)
    loss_fn = loss_fn or models.loss_fn
    net = par.wrap(module) if par.wrap is not None else module
    if not isinstance(net, nn.Module):  # else an AttributeError from inside make_optimizer
        raise ValueError(f"parallel.wrap must return the model to train (an nn.Module), got {_args.shown(net)}"
                         + ("; did it forget to `return` the model?" if net is None else ""))
    opt = make_optimizer(optimizer, net.parameters(), run.lr, run.weight_decay)
    sched = make_scheduler(scheduler, opt, run.steps)
    scaler = amp.make_scaler(**run.scaler_kwargs)
    run.config["optimizer"] = type(opt).__name__  # restore() refuses a checkpoint of another optimizer by this name
    hist = History(precision=amp.precision, device_type=amp.device_type, world_size=world, model=module)
    if run.checkpoint_dir is not None:
        run.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    pieces = dict(net=net, module=module, optimizer=opt, scaler=scaler, scheduler=sched, device=amp.device)

    # --- the loop ---
    with torch.random.fork_rng(devices=[amp.device] if amp.device_type == "cuda" else []):  # the caller's RNG stays
        start = 0
        if run.state is not None:
            start = run.store.restore(run.state, run.checkpoint_dir, **pieces)
            for key, values in run.state.get("history", {}).items():
                if key in _SERIES:
                    getattr(hist, key).extend(values)
        else:
            torch.manual_seed(run.seed)
        hist.start_step = start
        xs, ys = data_on_device(run.data.tensors, amp.device)
        indices = StepIndices(run.seed, n, run.batch_size, rank, world, device=xs.device)  # no host copy per step
        bar = tqdm(total=run.steps, initial=start, desc=f"train {amp.precision}", disable=not progress or rank != 0,
                   unit="step")
        for step in range(start, run.steps):
            t0 = time.perf_counter()
            idx = indices(step)
            micro = [(xs[i].to(amp.device, non_blocking=True), ys[i].to(amp.device, non_blocking=True))
                     for i in (idx.view(run.accum_steps, -1) if run.accum_steps > 1 else (idx,))]
            stats = train_step(net, micro, loss_fn, opt, scaler, amp, grad_clip=run.grad_clip, scheduler=sched,
                               autocast=par.autocast)
            if not bar.disable:
                bar.update(1)
                bar.set_postfix(loss=f"{stats.loss:.4g}", scale=f"{stats.scale:g}", refresh=False)
            # The step's wall time covers everything the loop does per step except writing a checkpoint.
            hist.append(stats, time.perf_counter() - t0)
            if run.checkpoint_dir is not None and _checkpoint_due(step + 1, run.steps, run.checkpoint_every):
                run.store.write(run.checkpoint_dir, step + 1, config=run.config, history=hist.series(), **pieces)
            if on_step is not None:
                on_step(step, stats)
        bar.close()
    hist.final_scale = scaler.get_scale()
    if amp.device_type == "cuda":
        hist.peak_device_bytes = torch.cuda.max_memory_allocated(amp.device)
    return hist
