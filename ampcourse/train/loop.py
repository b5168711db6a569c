"""The training loop: :func:`train` (checks, build, the loop), its :class:`History` and its :class:`Parallel` settings.

The loop is short on purpose: every check of the arguments lives in ``checks`` (all of them run before
any work), one optimizer step in ``step``, which samples each step sees in ``batches``, the command line
in ``cli``. What stays here is what a reader of nanoGPT's train.py expects to find in one place.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from tqdm.auto import tqdm

from .. import _args, inputs, models
from .._args import InputError
from ..inputs import Batches
from . import checks
from .batches import StepIndices, data_on_device, local_indices
from .settings import Parallel, TrainSettings, settings_from
from .step import StepStats, make_optimizer, make_scheduler, state_checksum, train_step

__all__ = ["History", "Parallel", "TrainSettings", "train"]

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


def _checkpoint_due(done: int, steps: int, every: int | None) -> bool:
    """Write a checkpoint after the last step and after every `every`-th one."""
    return done == steps or (every is not None and done % every == 0)


class _Default:
    """The default of train()'s positional settings: 'take it from settings (or TrainSettings' default)'."""

    def __repr__(self) -> str:
        return "<from settings>"


_FROM_SETTINGS: Any = _Default()


def train(model: nn.Module | str | Callable[[], nn.Module], data: Any = None, precision: str | None = None,
          steps: int = _FROM_SETTINGS, lr: float = _FROM_SETTINGS, seed: int = _FROM_SETTINGS,
          device: str | torch.device | None = _FROM_SETTINGS, *, settings: TrainSettings | None = None,
          **overrides: Any) -> History:
    """Train `model` for `steps` optimizer steps in fp32, fp16 (+ GradScaler) or bf16; returns a :class:`History`.

    One loop serves every precision: autocast and the GradScaler are switched by ``enabled=`` flags from
    ``ampcourse.device.pick`` (for fp32 and bf16 the scaler is disabled and its calls are no-ops). Everything
    is checked before any work (an :class:`ampcourse.InputError`, a ValueError, that says what to do): the
    settings by :class:`TrainSettings`, the model, data and precision by the front door, ``ampcourse.inputs``.

    Args:
        model: an ``nn.Module`` (trained in place, moved to the device), ``'mlp'``, ``'cnn'``, ``'transformer'``
            (built with `size` and `seed`), or a callable returning a fresh ``nn.Module`` (called under the seed).
        data: ``TensorDataset(inputs, targets)`` or a pair of tensors (each step's global batch drawn by the seeded
            order of :func:`batch_indices`); a ``DataLoader`` or any re-iterable of ``(inputs, targets)`` batches,
            iterated as it gives them, one batch per micro-batch (``accum_steps`` per optimizer step; under several
            processes each rank iterates the loader it was given); or None for the reference model's synthetic
            dataset. A resume with batches to iterate skips the batches already trained on (see
            ``ampcourse.inputs.Batches`` for when that is bit-identical).
        precision: ``'fp32'``, ``'fp16'`` or ``'bf16'``. Default: None, the device's choice (``pick``).
        steps, lr, seed, device: settings that may be passed by position (see :class:`TrainSettings`).
        settings: a :class:`TrainSettings` (every setting in one checked object). Default: its defaults.
        **overrides: any setting of :class:`TrainSettings` by name (``grad_clip=1.0``, ``checkpoint_dir=...``,
            ``batch_size=``, ``scheduler=``, ``parallel=``, ``on_step=``, ...), applied over `settings`; an unknown
            name is refused with the nearest one.

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
        >>> train(my_model, DataLoader(my_dataset, batch_size=32, shuffle=True), "bf16", steps=500)
    """
    positional = {"steps": steps, "lr": lr, "seed": seed, "device": device}
    s = settings_from(settings, {**{k: v for k, v in positional.items() if v is not _FROM_SETTINGS}, **overrides})
    run = checks.check_run(model, data, precision, s)
    amp, par = run.amp, s.parallel
    rank, world = par.rank, par.world_size
    loss_fn = s.loss_fn

    # --- build ---
    module = run.module.to(amp.device)
    batches = run.data if isinstance(run.data, Batches) else None
    course_loss = models.loss_fn if loss_fn is None else None
    if batches is None:
        n, local_batch = len(run.data), run.batch_size // world
        first = local_indices(0, s.seed, n, run.batch_size, rank, world)[:local_batch // s.accum_steps]
        xs0, ys0 = run.data.tensors
        classes = inputs.preflight(module, xs0[first].to(amp.device), ys0[first].to(amp.device), course_loss, amp,
                                   par.autocast, labels=ys0 if course_loss is not None else None)
    else:
        x0, y0 = batches.first()
        classes = inputs.preflight(module, x0.to(amp.device), y0.to(amp.device), course_loss, amp, par.autocast)
    if amp.device_type == "cuda":  # the peak we report is the training steps', not the preflight's
        torch.cuda.reset_peak_memory_stats(amp.device)
    loss_fn = loss_fn or models.loss_fn
    net = par.wrap(module) if par.wrap is not None else module
    if not isinstance(net, nn.Module):  # else an AttributeError from inside make_optimizer
        raise InputError(f"parallel.wrap must return the model to train (an nn.Module), got {_args.shown(net)}"
                         + ("; did it forget to `return` the model?" if net is None else ""))
    opt = make_optimizer(s.optimizer, net.parameters(), s.lr, s.weight_decay)
    sched = make_scheduler(s.scheduler, opt, s.steps)
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
            torch.manual_seed(s.seed)
        hist.start_step = start
        if batches is None:
            xs, ys = data_on_device(run.data.tensors, amp.device)
            indices = StepIndices(s.seed, n, run.batch_size, rank, world, device=xs.device)  # no host copy per step
        else:
            stream = batches.stream(skip=start * s.accum_steps)  # a resume: the batches already trained on, dropped
        bar = tqdm(total=s.steps, initial=start, desc=f"train {amp.precision}", disable=not s.progress or rank != 0,
                   unit="step")
        for step in range(start, s.steps):
            t0 = time.perf_counter()
            if batches is None:
                idx = indices(step)
                micro = [(xs[i].to(amp.device, non_blocking=True), ys[i].to(amp.device, non_blocking=True))
                         for i in (idx.view(s.accum_steps, -1) if s.accum_steps > 1 else (idx,))]
            else:
                micro = [_on_device(next(stream), amp.device, classes, step) for _ in range(s.accum_steps)]
            stats = train_step(net, micro, loss_fn, opt, scaler, amp, grad_clip=s.grad_clip, scheduler=sched,
                               autocast=par.autocast)
            if not bar.disable:
                bar.update(1)
                bar.set_postfix(loss=f"{stats.loss:.4g}", scale=f"{stats.scale:g}", refresh=False)
            # The step's wall time covers everything the loop does per step except writing a checkpoint.
            hist.append(stats, time.perf_counter() - t0)
            if run.checkpoint_dir is not None and _checkpoint_due(step + 1, s.steps, s.checkpoint_every):
                run.store.write(run.checkpoint_dir, step + 1, config=run.config, history=hist.series(), **pieces)
            if s.on_step is not None:
                s.on_step(step, stats)
        bar.close()
    hist.final_scale = scaler.get_scale()
    if amp.device_type == "cuda":
        hist.peak_device_bytes = torch.cuda.max_memory_allocated(amp.device)
    return hist


def _on_device(batch: tuple[torch.Tensor, torch.Tensor], device: torch.device, classes: int | None,
               step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch from the loader on the training device; with the course's loss, its labels checked while on the CPU.

    On the host the check costs a min and a max over the labels (no device sync); a bad label would otherwise be
    cross-entropy's IndexError at this step (on CUDA, a device-side assert that ends the process).
    """
    x, y = batch
    if classes is not None and y.device.type == "cpu":
        inputs.check_labels(y, classes, f"data targets of step {step}")
    return x.to(device, non_blocking=True), y.to(device, non_blocking=True)
