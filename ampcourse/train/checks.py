"""train()'s argument checks: every one runs before any work, and each refusal is one ValueError that says what to do.

Numbers are normalised by ``ampcourse._args`` (Python, numpy or 0-d tensor scalars in, plain int/float
out); GradScaler settings are checked by their owner, ``ampcourse._scaler``.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

from .. import _args, _scaler, checkpoint, models
from ..device import AmpSetup, parse_precision, pick
from .step import OPTIMIZERS, SCHEDULERS, optimizer_settings


# Settings a resumed run must share with the checkpoint: they fix which samples each step sees
# and what the saved scaler state means.
# lr and weight_decay too: optimizer.load_state_dict would silently put back the checkpoint's values, so a
# resume "with lr=1e-4" would go on with the old one. Refused, not warned: a resumed run stays the run it was.
# accum_steps and grad_clip too: another micro-batching rounds the summed gradient differently and another clip
# moves every clipped step, so either one is silently another run.
_MUST_MATCH = ("precision", "seed", "batch_size", "dataset_size", "lr", "weight_decay", "accum_steps", "grad_clip")


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
        raise ValueError(f"cannot resume from {str(path)!r}: " + "; ".join(diffs)
                         + ". Resume with the same settings, or start a new run in another checkpoint_dir")


def _check_arguments(*, steps, lr, seed, accum_steps, batch_size, rank, world_size, grad_clip, weight_decay,
                     resume, checkpoint_dir, checkpoint_every, optimizer, scheduler, size, n_samples) -> dict[str, Any]:
    """The checks on train()'s arguments that need neither the model nor the data; returns them as Python values.

    Numbers may come as Python, numpy or 0-d tensor scalars; what goes on (into the loop, the batch order,
    the checkpoint's settings) is plain int/float, so a checkpoint written with np.float64 lr loads with
    weights_only=True like any other.
    """
    v = {"steps": _args.integer(steps, "steps", low=1, what="an int >= 1"),
         "seed": _args.seed(seed),
         "accum_steps": _args.integer(accum_steps, "accum_steps", low=1, what="an int >= 1 (1 = no accumulation)"),
         "batch_size": _args.integer(batch_size, "batch_size", low=1, what="an int >= 1 (the global batch size)"),
         "world_size": _args.integer(world_size, "world_size", low=1, what="an int >= 1"),
         "n_samples": _args.integer(n_samples, "n_samples", low=1, what="a positive int (the synthetic dataset size)"),
         "resume": _args.flag(resume, "resume")}
    world = v["world_size"]
    v["rank"] = _args.integer(rank, "rank", low=0, high=world - 1,
                              what=f"an int in 0..{world - 1} (world_size={world})")
    v["grad_clip"] = None if grad_clip is None else _args.real(grad_clip, "grad_clip", positive=True)
    v["lr"], v["weight_decay"] = optimizer_settings(lr, weight_decay)  # both within float32's range
    v["checkpoint_every"] = (None if checkpoint_every is None else
                             _args.integer(checkpoint_every, "checkpoint_every", low=1,
                                           what="an int >= 1 or None (only at the end)"))
    if checkpoint_dir is None and (v["resume"] or v["checkpoint_every"] is not None):
        raise ValueError(f"{'resume=True' if v['resume'] else 'checkpoint_every'} needs a checkpoint_dir (where the "
                         "checkpoint is read or written); pass one, or leave it out")
    if checkpoint_dir is not None:
        v["checkpoint_dir"] = _args.as_path(checkpoint_dir, "checkpoint_dir")  # not bytes, no NUL byte
    if not callable(optimizer) and optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZERS)} or pass a callable")
    if scheduler is not None and not callable(scheduler) and scheduler not in SCHEDULERS:
        raise ValueError(f"unknown scheduler {scheduler!r}; choose None, {', '.join(SCHEDULERS)} or pass a callable")
    if not isinstance(size, str) or size not in models.SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(models.SIZES)}")
    return v


def _check_finite(data: TensorDataset) -> None:
    """ValueError if a floating-point input or target is nan or inf: every step would give a nan loss."""
    for what, t in zip(("inputs", "targets"), data.tensors):
        if t.is_floating_point():
            bad = ~torch.isfinite(t)
            if bad.any():
                first = int(bad.reshape(len(t), -1).any(1).nonzero()[0])
                raise ValueError(f"data {what} hold {int(bad.sum())} nan/inf values (the first in sample {first}); "
                                 "every step would give a nan loss: clean or drop those samples")


def preflight(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable | None, amp: AmpSetup,
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


def _check_fp16_parameters(module: nn.Module, amp: AmpSetup, scaler_kwargs: dict) -> None:
    """ValueError if fp16 loss scaling would meet fp16 parameters: GradScaler cannot unscale fp16 gradients.

    It would fail in the first step with "Attempting to unscale FP16 gradients"; here it fails before any
    work, saying why and what to do (AMP keeps fp32 parameters; autocast runs the matmuls in fp16).
    """
    if not scaler_kwargs.get("enabled", amp.use_scaler):
        return
    half = [n for n, p in module.named_parameters() if p.requires_grad and p.dtype == torch.float16]
    if half:
        raise ValueError(f"model parameter {half[0]!r} is float16 ({len(half)} trainable fp16 parameters): fp16 AMP keeps "
                         "the parameters in float32 and autocast runs the matmuls in fp16, and GradScaler cannot unscale "
                         "fp16 gradients; call model.float() before train(), or train the fp16 model with precision='fp32' "
                         "(no autocast, no scaler)")


@dataclass
class Run:
    """train()'s arguments after every check: plain Python numbers, the AMP setup, model, data and checkpoint plan."""

    steps: int
    lr: float
    seed: int
    accum_steps: int
    batch_size: int
    grad_clip: float | None
    weight_decay: float
    checkpoint_every: int | None
    rank: int
    world_size: int
    amp: AmpSetup
    module: nn.Module
    data: TensorDataset
    scaler_kwargs: dict[str, Any]
    config: dict[str, Any]  # what a checkpoint records, and a resume must match
    store: Any  # the checkpointer
    checkpoint_dir: Path | None
    state: dict[str, Any] | None  # the checkpoint to resume from


def check_run(*, model, data, precision, steps, lr, seed, device, grad_clip, accum_steps, checkpoint_dir, resume,
              weight_decay,
              batch_size, checkpoint_every, optimizer, scheduler, loss_fn, scaler_kwargs, size, n_samples, rank,
              world_size, wrap, checkpointer, autocast, on_step) -> Run:
    """Every check of train()'s arguments, in order, before any work; the checked run, or a ValueError."""
    prec = parse_precision(precision) if precision is not None else None
    v = _check_arguments(steps=steps, lr=lr, seed=seed, accum_steps=accum_steps, batch_size=batch_size, rank=rank,
                         world_size=world_size, grad_clip=grad_clip, weight_decay=weight_decay, resume=resume,
                         checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every, optimizer=optimizer,
                         scheduler=scheduler, size=size, n_samples=n_samples)
    scaler_kwargs = _scaler.gradscaler_kwargs(scaler_kwargs)
    for name, hook in (("loss_fn", loss_fn), ("parallel.wrap", wrap), ("on_step", on_step)):
        if hook is not None and not callable(hook):  # else a TypeError from deep inside the first step
            raise ValueError(f"{name} must be a callable or None, got {_args.shown(hook)}")
    _args.flag(autocast, "parallel.autocast")
    amp = pick(device, prec)
    problem = _amp_works(amp.device_type, amp.precision)
    if problem:
        raise ValueError(f"precision {amp.precision!r} cannot run on {amp.device} with torch {torch.__version__} "
                         f"({problem}); use {'bf16 or ' if amp.precision == 'fp16' else ''}fp32")
    module, name = _resolve_model(model, size, v["seed"])
    _check_fp16_parameters(module, amp, scaler_kwargs)
    data = _resolve_data(data, name, v["n_samples"], v["seed"], size)
    n, batch, split = len(data), v["batch_size"], v["world_size"] * v["accum_steps"]
    if n == 0:
        raise ValueError("data is empty (0 samples); pass a TensorDataset with at least batch_size samples")
    if batch > n:
        raise ValueError(f"batch_size {batch} is larger than the dataset ({n} samples); use at most {n}")
    if batch % split:
        raise ValueError(f"batch_size {batch} must divide by world_size * accum_steps = "
                         f"{v['world_size']} * {v['accum_steps']}, so every micro-batch has the same size")
    models.check_data(module, data, targets=loss_fn is None)
    _check_finite(data)
    config = {"precision": amp.precision, "seed": v["seed"], "batch_size": batch, "dataset_size": n,
              "steps": v["steps"], "model": name or type(module).__name__, "accum_steps": v["accum_steps"],
              "world_size": v["world_size"], "lr": v["lr"], "weight_decay": v["weight_decay"], "grad_clip": v["grad_clip"]}
    if checkpointer is not None and not all(callable(getattr(checkpointer, m, None))
                                            for m in ("path", "read", "restore", "write")):
        raise ValueError(f"parallel.checkpointer must be None (one file from rank 0), checkpoint.FileCheckpointer(rank) "
                         f"or checkpoint.ShardedCheckpointer(rank) (FSDP2), got {_args.shown(checkpointer)}")
    store = checkpointer if checkpointer is not None else checkpoint.FileCheckpointer(v["rank"])
    directory, state = v.get("checkpoint_dir"), None
    if directory is not None:
        ckpt = store.path(directory)
        _check_checkpoint_dir(directory, v["resume"], ckpt)
        if v["resume"]:
            state = store.read(directory)
            scaled = scaler_kwargs.get("enabled", amp.use_scaler)
            _check_resumable(state, config, ckpt, scheduler is not None, scaler_kwargs if scaled else None)
    return Run(steps=v["steps"], lr=v["lr"], seed=v["seed"], accum_steps=v["accum_steps"], batch_size=batch,
               grad_clip=v["grad_clip"], weight_decay=v["weight_decay"], checkpoint_every=v["checkpoint_every"],
               rank=v["rank"], world_size=v["world_size"], amp=amp, module=module, data=data, scaler_kwargs=scaler_kwargs, config=config, store=store,
               checkpoint_dir=directory, state=state)
