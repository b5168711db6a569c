"""train()'s checks that need the model or the data: every one runs before any work, and each refusal says what to do.

The settings themselves are checked when the :class:`~ampcourse.train.settings.TrainSettings` is made; what
train() is handed (the model, the data, the precision) is read by the front door, ``ampcourse.inputs``, the
same reader trial and the doctor use. What stays here is train's own: the batch split, the checkpoint directory
and whether a checkpoint may be resumed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.nn as nn
from torch.utils.data import TensorDataset

from .. import _args, _scaler, checkpoint, inputs, models
from .._args import InputError
from ..device import AmpSetup, pick
from ..inputs import Batches
from .settings import DEFAULT_BATCH_SIZE, TrainSettings


# Settings a resumed run must share with the checkpoint: they fix which samples each step sees
# and what the saved scaler state means.
# lr and weight_decay too: optimizer.load_state_dict would silently put back the checkpoint's values, so a
# resume "with lr=1e-4" would go on with the old one. Refused, not warned: a resumed run stays the run it was.
# accum_steps and grad_clip too: another micro-batching rounds the summed gradient differently and another clip
# moves every clipped step, so either one is silently another run.
_MUST_MATCH = ("precision", "seed", "batch_size", "dataset_size", "lr", "weight_decay", "accum_steps", "grad_clip",
               "data")


def _check_checkpoint_dir(directory: Path, resume: bool, ckpt: Path) -> None:
    """The directory can be written to, and holds a checkpoint exactly when we resume."""
    _args.creatable_dir(directory, "checkpoint_dir")
    if resume and not ckpt.exists():
        raise InputError(f"resume=True but there is no checkpoint at {str(ckpt)!r}; "
                         "run once without resume (with this checkpoint_dir) to create one")
    if not resume and ckpt.exists():
        raise InputError(f"{str(ckpt)!r} already exists and would be overwritten; pass resume=True to continue "
                         "that run, or choose an empty checkpoint_dir")


# GradScaler settings a resumed run must share: scaler.load_state_dict puts the checkpoint's back silently, so
# scaler_kwargs={"growth_interval": 1000} on resume would go on growing at the old interval. init_scale is not
# among them: a resumed scaler continues from the saved scale, as it should.
_SCALER_MUST_MATCH = ("growth_factor", "backoff_factor", "growth_interval")


def _sane_scaler_state(saved: Any) -> bool:
    """True for a saved GradScaler state whose settings make sense (restore's checks refuse the others, clearly)."""
    try:
        _scaler.check_state(saved)
    except (ValueError, TypeError):
        return False
    return True


def _check_resumable(state: dict, config: dict, path: Path, scheduler: bool,
                     scaler_kwargs: dict[str, Any] | None = None) -> None:
    """The checkpoint was written by a run with the same data order, precision, scaler settings (and schedule length).

    scaler_kwargs: this run's checked GradScaler settings when its scaler is enabled (None: no scaler).
    """
    saved = state.get("config", {})
    diffs = [f"{k}={saved.get(k)!r} in the checkpoint, {config[k]!r} now" for k in _MUST_MATCH
             if k in saved and saved[k] != config[k]]
    saved_scaler = state.get("scaler")
    if scaler_kwargs is not None and _sane_scaler_state(saved_scaler):  # an impossible one: CheckpointError later
        now = {**_scaler.DEFAULTS, **scaler_kwargs}
        diffs += [f"scaler_kwargs {k}={saved_scaler[k]!r} in the checkpoint, {now[k]!r} now" for k in _SCALER_MUST_MATCH
                  if k in saved_scaler and saved_scaler[k] != now[k]]
    if not scheduler and state.get("scheduler") is not None:
        # the optimizer state would bring back the schedule's lr of that moment, then hold it: silently another run
        diffs.append("the checkpoint was written with an LR scheduler and this run has none (pass the same scheduler)")
    done = state.get("step")
    if isinstance(done, int) and not isinstance(done, bool) and done > config["steps"]:
        # else the longer run came back as if it were this one (steps_done 4 when 2 were asked for)
        diffs.append(f"it holds {done} completed steps and steps={config['steps']} now asks for fewer (pass "
                     f"steps={done} or more to continue it; a shorter run needs a fresh checkpoint_dir)")
    if scheduler and saved.get("steps", config["steps"]) != config["steps"]:
        diffs.append(f"steps={saved['steps']} in the checkpoint, {config['steps']} now (the LR schedule spans the "
                     "steps of the first run)")
    if diffs:
        raise InputError(f"cannot resume from {str(path)!r}: " + "; ".join(diffs)
                         + ". Resume with the same settings, or start a new run in another checkpoint_dir")


@dataclass
class Run:
    """train()'s inputs after every check: the settings, the AMP setup, model, data and the checkpoint plan."""

    settings: TrainSettings
    amp: AmpSetup
    module: nn.Module
    data: TensorDataset | Batches
    batch_size: int | None  # the global batch of tensor data; None for batches to iterate
    scaler_kwargs: dict[str, Any]
    config: dict[str, Any]  # what a checkpoint records, and a resume must match
    store: Any  # the checkpointer
    checkpoint_dir: Path | None
    state: dict[str, Any] | None  # the checkpoint to resume from

    @property
    def rank(self) -> int:
        return self.settings.parallel.rank

    @property
    def world_size(self) -> int:
        return self.settings.parallel.world_size


def _check_split(data: TensorDataset, settings: TrainSettings) -> int:
    """The global batch size of tensor data: at most the dataset, dividing evenly into micro-batches on every rank."""
    n, batch = len(data), settings.batch_size or DEFAULT_BATCH_SIZE
    world, accum = settings.parallel.world_size, settings.accum_steps
    if batch > n:
        raise InputError(f"batch_size {batch} is larger than the dataset ({n} samples); use at most {n}")
    if batch % (world * accum):
        raise InputError(f"batch_size {batch} must divide by world_size * accum_steps = {world} * {accum}, "
                         "so every micro-batch has the same size")
    return batch


def check_run(model: Any, data: Any, precision: Any, settings: TrainSettings) -> Run:
    """Every check of what train() was handed, in order, before any work; the checked run, or an InputError."""
    s = settings
    amp = pick(s.device, inputs.precision(precision))
    inputs.check_amp(amp)
    module, name = inputs.read_model(model, size=s.size, seed=s.seed)
    scaled = s.scaler_kwargs.get("enabled", amp.use_scaler)
    inputs.check_fp16_parameters(module, scaled)
    data = inputs.read_data(data, reference=name, n_samples=s.n_samples, seed=s.seed, size=s.size,
                            batch_size=s.batch_size)
    if isinstance(data, Batches):
        batch, size, sample = None, data.batches_per_epoch, TensorDataset(*data.first())
    else:
        batch, size, sample = _check_split(data, s), len(data), data
    models.check_data(module, sample, targets=s.loss_fn is None)
    inputs.check_finite(*sample.tensors)
    config = {"precision": amp.precision, "seed": s.seed, "batch_size": batch, "dataset_size": size,
              "steps": s.steps, "model": name or type(module).__name__, "accum_steps": s.accum_steps,
              "world_size": s.parallel.world_size, "lr": s.lr, "weight_decay": s.weight_decay,
              "grad_clip": s.grad_clip, "data": "batches" if isinstance(data, Batches) else "tensors"}
    par = s.parallel
    store = par.checkpointer if par.checkpointer is not None else checkpoint.FileCheckpointer(par.rank)
    directory, state = s.checkpoint_dir, None
    if directory is not None:
        ckpt = store.path(directory)
        _check_checkpoint_dir(directory, s.resume, ckpt)
        if s.resume:
            state = store.read(directory)
            _check_resumable(state, config, ckpt, s.scheduler is not None, s.scaler_kwargs if scaled else None)
    return Run(settings=s, amp=amp, module=module, data=data, batch_size=batch, scaler_kwargs=s.scaler_kwargs,
               config=config, store=store, checkpoint_dir=directory, state=state)
