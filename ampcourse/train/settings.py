"""train()'s settings as one frozen, validated object (:class:`TrainSettings`), in the style of torchao's
``Float8LinearConfig``: a setting is added in one place (a field, its check, its line in the docstring).

Every keyword train() took before still works (``train("mlp", lr=1e-3)`` builds the settings from them); a run
can also be described once and reused or varied::

    >>> from ampcourse.train import TrainSettings, train
    >>> base = TrainSettings(steps=200, lr=1e-3, grad_clip=1.0, progress=False)
    >>> train("mlp", precision="bf16", settings=base)
    >>> train("mlp", precision="fp16", settings=base, lr=3e-4)       # keywords override the settings
    >>> base.replace(accum_steps=2)                                  # a new, checked TrainSettings

Numbers may be Python, numpy or 0-d tensor scalars; the object holds plain Python ints/floats (``ampcourse._args``),
so what goes into a checkpoint loads with ``weights_only=True``. A bad value is an :class:`ampcourse.InputError` (a
ValueError) naming the setting, raised when the object is made, before any work.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from .. import _args, _scaler, models
from .._args import InputError
from .step import OPTIMIZERS, SCHEDULERS, StepStats, optimizer_settings

__all__ = ["Parallel", "TrainSettings", "DEFAULT_BATCH_SIZE"]

#: The global batch size for tensor data when batch_size is not given (a DataLoader has its own).
DEFAULT_BATCH_SIZE = 64


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


def _callable_or_none(value: Any, name: str) -> Any:
    """value if it is None or callable; InputError naming it otherwise (else a TypeError deep inside the first step)."""
    if value is not None and not callable(value):
        raise InputError(f"{name} must be a callable or None, got {_args.shown(value)}")
    return value


def _check_parallel(par: Any) -> Parallel:
    """A Parallel with plain ints, a callable wrap, a checkpointer that is one, a bool autocast."""
    if par is None:
        return Parallel()
    if not isinstance(par, Parallel):
        raise InputError(f"parallel must be an ampcourse.train.Parallel or None, got {type(par).__name__}")
    world = _args.integer(par.world_size, "world_size", low=1, what="an int >= 1")
    rank = _args.integer(par.rank, "rank", low=0, high=world - 1, what=f"an int in 0..{world - 1} (world_size={world})")
    _callable_or_none(par.wrap, "parallel.wrap")
    if par.checkpointer is not None and not all(callable(getattr(par.checkpointer, m, None))
                                                for m in ("path", "read", "restore", "write")):
        raise InputError(f"parallel.checkpointer must be None (one file from rank 0), checkpoint.FileCheckpointer(rank) "
                         f"or checkpoint.ShardedCheckpointer(rank) (FSDP2), got {_args.shown(par.checkpointer)}")
    autocast = _args.flag(par.autocast, "parallel.autocast")
    return dataclasses.replace(par, rank=rank, world_size=world, autocast=autocast)


@dataclass(frozen=True)
class TrainSettings:
    """Everything about a run of :func:`ampcourse.train.train` except the model, the data and the precision.

    Args:
        steps: optimizer steps in the whole run (a resumed run continues up to it). Default: 100.
        lr: learning rate, within float32's range. Default: 1e-3.
        seed: seeds the model, the synthetic data and the batch order. Default: 0.
        device: ``'cpu'``, ``'cuda'``, ``'cuda:N'``, ``'mps'``. Default: None, the best available.
        grad_clip: max L2 norm of the true (unscaled) gradients, a finite number > 0; None: no clipping.
        accum_steps: micro-batches per optimizer step (gradient accumulation). Default: 1.
        checkpoint_dir: write a checkpoint there every `checkpoint_every` steps and after the last.
        resume: continue from `checkpoint_dir` (bit-identical to an uninterrupted run on CPU). Refused if
            precision, seed, batch_size, the dataset size, lr, weight_decay, accum_steps or grad_clip differ from
            the checkpoint's, or if steps is below the steps it holds.
        batch_size: the GLOBAL batch per optimizer step of tensor data (all ranks and micro-batches); it must divide
            by ``world_size * accum_steps``. None: 64. Refused with a DataLoader, whose batches have their size.
        checkpoint_every: steps between checkpoints; None: only after the last step.
        optimizer: ``'adamw'`` (default; fused on CUDA), ``'adam'``, ``'sgd'``, or a
            ``callable(params, lr=, weight_decay=)``.
        weight_decay: the optimizer's weight decay. Default: 0.0.
        scheduler: None, ``'cosine'`` or a ``callable(optimizer)``; not stepped on steps the GradScaler skipped.
        loss_fn: ``callable(outputs, targets)``; None: the reference models' cross-entropy.
        scaler_kwargs: GradScaler's settings (``init_scale``, ``growth_factor``, ``backoff_factor``,
            ``growth_interval``, ``enabled``), checked by their owner, ``ampcourse._scaler``.
        progress: show a tqdm progress bar (rank 0 only). Default: True.
        size: the reference models' size (``'tiny'``, ...). Default: ``'tiny'``.
        n_samples: size of the synthetic dataset when data is None. Default: 1024.
        parallel: a :class:`Parallel`: rank, world size, model wrapper, checkpointer, autocast. Default: one process.
        on_step: called as ``on_step(step, stats)`` after each optimizer step has been recorded (and checkpointed).

    Example::

        >>> s = TrainSettings(steps=50, lr=np.float64(3e-3))
        >>> s.lr, type(s.lr)                           # (0.003, <class 'float'>)
        >>> TrainSettings(grad_clip=-1)                # InputError: grad_clip must be a finite number > 0
    """

    steps: int = 100
    lr: float = 1e-3
    seed: int = 0
    device: str | torch.device | None = None
    grad_clip: float | None = None
    accum_steps: int = 1
    checkpoint_dir: str | os.PathLike | None = None
    resume: bool = False
    batch_size: int | None = None
    checkpoint_every: int | None = None
    optimizer: str | Callable = "adamw"
    weight_decay: float = 0.0
    scheduler: str | Callable | None = None
    loss_fn: Callable | None = None
    scaler_kwargs: Mapping[str, Any] | None = field(default=None, hash=False)
    progress: bool = True
    size: str = "tiny"
    n_samples: int = 1024
    parallel: Parallel | None = None
    on_step: Callable[[int, StepStats], None] | None = None

    def __post_init__(self) -> None:
        """Check every setting and keep it as a plain Python value (what a checkpoint records)."""
        put = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen: set once, here)
        put("steps", _args.integer(self.steps, "steps", low=1, what="an int >= 1"))
        put("seed", _args.seed(self.seed))
        put("accum_steps", _args.integer(self.accum_steps, "accum_steps", low=1,
                                         what="an int >= 1 (1 = no accumulation)"))
        if self.batch_size is not None:
            put("batch_size", _args.integer(self.batch_size, "batch_size", low=1,
                                            what="an int >= 1 (the global batch size)"))
        put("n_samples", _args.integer(self.n_samples, "n_samples", low=1,
                                       what="a positive int (the synthetic dataset size)"))
        put("resume", _args.flag(self.resume, "resume"))
        put("progress", _args.flag(self.progress, "progress"))
        put("parallel", _check_parallel(self.parallel))
        if self.grad_clip is not None:
            put("grad_clip", _args.real(self.grad_clip, "grad_clip", positive=True))
        lr, weight_decay = optimizer_settings(self.lr, self.weight_decay)  # both within float32's range
        put("lr", lr)
        put("weight_decay", weight_decay)
        if self.checkpoint_every is not None:
            put("checkpoint_every", _args.integer(self.checkpoint_every, "checkpoint_every", low=1,
                                                  what="an int >= 1 or None (only at the end)"))
        if self.checkpoint_dir is None and (self.resume or self.checkpoint_every is not None):
            raise InputError(f"{'resume=True' if self.resume else 'checkpoint_every'} needs a checkpoint_dir (where the "
                             "checkpoint is read or written); pass one, or leave it out")
        if self.checkpoint_dir is not None:
            put("checkpoint_dir", _args.as_path(self.checkpoint_dir, "checkpoint_dir"))  # not bytes, no NUL byte
        if not callable(self.optimizer) and self.optimizer not in OPTIMIZERS:
            raise InputError(f"unknown optimizer {self.optimizer!r}; choose one of {', '.join(OPTIMIZERS)} or pass a "
                             "callable")
        if self.scheduler is not None and not callable(self.scheduler) and self.scheduler not in SCHEDULERS:
            raise InputError(f"unknown scheduler {self.scheduler!r}; choose None, {', '.join(SCHEDULERS)} or pass a "
                             "callable")
        if not isinstance(self.size, str) or self.size not in models.SIZES:
            raise InputError(f"unknown size {self.size!r}; choose one of {', '.join(models.SIZES)}")
        put("scaler_kwargs", _scaler.gradscaler_kwargs(self.scaler_kwargs))
        _callable_or_none(self.loss_fn, "loss_fn")
        _callable_or_none(self.on_step, "on_step")

    def replace(self, **changes: Any) -> TrainSettings:
        """A copy with some settings changed, checked again (unknown names are refused, with the nearest one)."""
        return dataclasses.replace(self, **_known(changes, "TrainSettings.replace()"))


_FIELDS = tuple(f.name for f in dataclasses.fields(TrainSettings))


def _known(keywords: Mapping[str, Any], where: str) -> dict[str, Any]:
    """keywords, if every name is a setting; InputError naming the unknown one and the nearest setting otherwise."""
    unknown = [k for k in keywords if k not in _FIELDS]
    if unknown:
        near = difflib.get_close_matches(unknown[0], _FIELDS, n=1)
        raise InputError(f"{where} got an unexpected setting {unknown[0]!r}"
                         + (f" (did you mean {near[0]!r}?)" if near else "")
                         + f"; the settings are {', '.join(_FIELDS)}")
    return dict(keywords)


def settings_from(settings: Any, overrides: Mapping[str, Any]) -> TrainSettings:
    """The run's settings: `settings` (a TrainSettings, or None for the defaults) with the keyword overrides applied."""
    if settings is not None and not isinstance(settings, TrainSettings):
        raise InputError(f"settings must be an ampcourse.train.TrainSettings or None, got {_args.shown(settings)}")
    changes = _known(overrides, "train()")
    if settings is None:
        return TrainSettings(**changes)
    return dataclasses.replace(settings, **changes) if changes else settings
