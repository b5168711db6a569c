"""The runs of a trial (chapter 10): :func:`trial` trains the fp32 reference and each precision in lockstep, in
chunks of steps, and records every step.

Each run (``_Run``) trains a deep copy of one initial model with its own optimizer, scaler, hooks and random stream;
every step goes through ``ampcourse.train.train_step``. The weights are read as one flat fp32 vector per step through
views made once (``_flat_views``), so the update, norm and drift per layer are a few kernels and one read-back; the
reference keeps its weights after each step of a chunk (at most ``CHUNK_BYTES``) for the other runs to compare with.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.utils.data import TensorDataset
from tqdm.auto import tqdm

from .. import _args, _compiled, _errors, _scaler, emulate, models
from .. import inputs as _inputs
from .. import train as _train
from ..device import AmpSetup, pick
from .monitors import RECOMPUTE_GAP, Monitor, _Hooks, default_monitors
from .result import REFERENCE, Trial, _first_departure, _precision

__all__ = ["trial", "CHUNK_BYTES"]

#: The default chunk (trial's `chunk`) keeps at most this many bytes of the reference's weights (fp32 copies).
CHUNK_BYTES = 64 * 2**20


@dataclass
class _Run:
    """One training run of a trial: its model, optimizer, scaler, hooks, random stream and series."""

    label: str
    amp: AmpSetup
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    hooks: _Hooks
    rng: torch.Tensor
    params: list[torch.Tensor]
    views: list[torch.Tensor] = field(default_factory=list)  # 1-D views of `params`
    flat: torch.Tensor | None = None  # all trainable weights after the latest step, as one fp32 vector
    # Buffers of flat's size, reused every step (a fresh 1.6 MB vector per step and per difference cost the
    # small transformer ~1 ms of a ~28 ms CPU step): the update, and the next step's weights.
    scratch: torch.Tensor | None = None
    spare: torch.Tensor | None = None
    history: torch.Tensor | None = None  # the reference only: its weights after each step of a chunk (chunk x N)
    lengths: list[int] = field(default_factory=list)  # elements per layer in `flat` (layers are contiguous)
    layer_norms: list[float] = field(default_factory=list)  # ||W|| per layer after the latest step
    series: dict[str, list[float]] = field(default_factory=dict)
    rows: _Rows | None = None  # the lists of `series`, bound once
    optimizer_steps: int = 0  # steps that updated the weights (see _updated)
    step_calls: int = 0  # optimizer.step() calls (a step post-hook)


#: The per-step scalars of every run, in the order _step appends them.
_SCALARS = ("loss", "grad_norm", "scale", "skipped", "optimizer_steps", "loss_gap", "grad_norm_ratio")


@dataclass
class _Rows:
    """A run's series lists, made once with their keys: a step appends to them without building a key."""

    scalars: list[list[float]]  # in the order of _SCALARS
    monitors: list[list[float]]  # in the order of the run's hook labels
    update: list[list[float]]  # per layer
    drift: list[list[float]]  # per layer
    loss: list[float]
    grad_norm: list[float]


def _make_rows(series: dict[str, list[float]], monitor_labels: list[str], layers: list[str]) -> _Rows:
    """Create the (empty) series of a run in their lasting order; return their lists, bound for _step."""
    scalars = [series.setdefault(name, []) for name in _SCALARS]
    # the monitors' values, then the step's recompute gap: the order of _Hooks.take()
    monitors = [series.setdefault(label, []) for label in [*monitor_labels, RECOMPUTE_GAP]]
    update, drift = [], []
    for layer in layers:
        update.append(series.setdefault(f"update/{layer}", []))
        drift.append(series.setdefault(f"drift/{layer}", []))
    return _Rows(scalars, monitors, update, drift, series["loss"], series["grad_norm"])


def _layers(model: nn.Module) -> tuple[list[str], list[int]]:
    """Layer labels (modules that own trainable parameters) and, per trainable parameter, its layer's index."""
    labels, owner, seen = [], [], set()
    for name, module in _compiled.named_modules(model):  # a compiled model's layers as written, not "_orig_mod.0"
        # a parameter shared by two modules counts once, in the first (as model.parameters() yields it)
        own = [p for p in module.parameters(recurse=False) if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in own)
        if own:
            labels.append(name or "model")
            owner += [len(labels) - 1] * len(own)
    return labels, owner


def _flat_views(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """1-D views of the parameters, made once: optimizers update parameters in place, so the views stay current
    (a non-contiguous parameter is kept as it is and flattened at every step instead)."""
    return [p.detach().view(-1) if p.is_contiguous() else p.detach() for p in params]


def _flatten(views: list[torch.Tensor]) -> torch.Tensor:
    """The parameters as one fp32 vector (one copy)."""
    flat = torch.cat(views if all(v.dim() == 1 for v in views) else [v.reshape(-1) for v in views])
    return flat if flat.dtype == torch.float32 else flat.float()


def _flatten_into(views: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """The parameters written into `out` (an fp32 vector of their total size), without allocating one."""
    if all(v.dim() == 1 and v.dtype == torch.float32 for v in views):
        return torch.cat(views, out=out)
    return out.copy_(_flatten(views))


def _layer_norms(flat: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    """The L2 norm of each layer's slice of a flat vector (layers are contiguous), as 0-d tensors.

    One pass over the vector (no squared copy): on a CPU, one index_add_ over the elements was 5x slower, and
    squaring, stacking and summing rows cost a visible share of a small model's step in memory traffic.
    """
    return list(torch._foreach_norm(flat.split(lengths)))


def _make_optimizer(optimizer_factory, lr: float) -> Callable[[Any], torch.optim.Optimizer]:
    """A callable(params) -> Optimizer from a name ('adamw', 'adam', 'sgd') or a callable(params)."""
    if optimizer_factory is None or isinstance(optimizer_factory, str):
        spec = optimizer_factory or "adamw"
        if spec not in _train.OPTIMIZERS:
            raise ValueError(f"unknown optimizer {spec!r}; choose one of {', '.join(_train.OPTIMIZERS)} or pass a "
                             "callable(params) that returns a torch.optim.Optimizer")
        return lambda params: _train.make_optimizer(spec, params, lr)
    if not callable(optimizer_factory):
        raise ValueError(f"optimizer_factory must be a name or a callable(params), "
                         f"got {_args.shown(optimizer_factory)}")
    return optimizer_factory


def _start_run(label: str, model: nn.Module, device, make_opt, scaler_kwargs: dict, monitors, seed: int) -> _Run:
    """A deep copy of the initial model on the device, its optimizer, scaler and hooks, and a seeded random stream."""
    prec, scaled = _precision(label)
    amp = pick(device, prec)
    net = copy.deepcopy(model).to(amp.device)
    opt = make_opt(net.parameters())
    if not isinstance(opt, torch.optim.Optimizer):
        raise ValueError(f"optimizer_factory(params) must return a torch.optim.Optimizer, got {type(opt).__name__}")
    scaler = amp.make_scaler(**{**scaler_kwargs, "enabled": scaled})
    run = _Run(label, amp, net, opt, scaler, _Hooks(net, monitors),
               rng=torch.Generator().manual_seed(seed).get_state(),
               params=[p for p in net.parameters() if p.requires_grad])

    labels, owner = _layers(net)
    run.rows = _make_rows(run.series, run.hooks.labels, labels)
    run.lengths = [0] * (max(owner) + 1)
    for p, i in zip(run.params, owner):
        run.lengths[i] += p.numel()
    run.views = _flat_views(run.params)
    run.flat = _flatten(run.views)
    run.scratch, run.spare = torch.empty_like(run.flat), torch.empty_like(run.flat)
    run.layer_norms = torch.stack(_layer_norms(run.flat, run.lengths)).tolist()

    def count(optimizer, args, kwargs):  # every optimizer.step() call; _step decides whether it updated
        run.step_calls += 1
    opt.register_step_post_hook(count)
    return run


def _check_precisions(precisions) -> tuple[str, ...]:
    """Precision names, each once, from PRECISIONS, read by the front door as train() reads one (``ampcourse.inputs``)."""
    return _inputs.precision_names(precisions, "precisions", allowed=("fp32", "bf16", "fp16"), extra=("fp16-noscaler",))


def trial(model_factory: Callable[[], nn.Module] | str, data: TensorDataset | tuple | None = None,
          precisions: Sequence[str] = ("bf16",), steps: int = 200, optimizer_factory: Callable | str | None = None,
          seed: int = 0, monitors: Sequence[Monitor] | None = None, *, lr: float = 1e-3, batch_size: int | None = None,
          loss_fn: Callable | None = None, tolerance: float = 0.1, device: str | torch.device | None = None,
          scaler_kwargs: dict | None = None, size: str = "tiny", grad_clip: float | None = None,
          policy: str | None = None,
          chunk: int | None = None, progress: bool = False) -> Trial:
    """Train the same initial model on the same batches in fp32 and in each precision; compare them step by step.

    Args:
        model_factory: a reference model name (``"mlp"``, ``"cnn"``, ``"transformer"``, built with ``size`` and
            ``seed``) or a callable returning a fresh nn.Module (called once under ``torch.manual_seed(seed)``;
            every run trains a deep copy of that one model).
        data: TensorDataset(inputs, targets) or a pair of tensors (batches drawn by train's seeded order); a
            DataLoader or any re-iterable of (inputs, targets) batches, one batch per step, iterated as it gives
            them (``ampcourse.inputs.Batches``: every run gets the same batches); None: the reference model's
            synthetic data.
        precisions: names from ``PRECISIONS`` compared against the fp32 reference (default ``("bf16",)``).
        steps: optimizer steps per run (one batch per step, the same batch for every run).
        optimizer_factory: ``"adamw"`` (default), ``"adam"``, ``"sgd"`` (with ``lr``) or a callable(params).
        seed: model init (for a name or a factory), batch order and each run's random stream (dropout).
        monitors: per-layer forward measurements (default: :func:`default_monitors`); ``[]`` for none.
        lr: learning rate of a named optimizer. batch_size: samples per step of tensor data (at most the
            dataset's size; None: 32); refused with a DataLoader, whose batches have their size.
        loss_fn: callable(output, targets) -> loss; default: ``ampcourse.models.loss_fn`` (cross entropy).
        tolerance: the relative gap to fp32 (loss, monitors, per-layer drift) that counts as a departure.
        device: as ``ampcourse.device.pick`` takes it (default: the best available).
        scaler_kwargs: GradScaler settings for fp16 runs (init_scale, growth_factor, backoff_factor,
            growth_interval), checked as ``ampcourse.train`` checks them; its defaults otherwise.
        grad_clip: clip the true (unscaled) gradient norm, as in ``ampcourse.train``.
        progress: show a ``tqdm.auto`` progress bar (a widget in Jupyter) over every run's steps, as ``train`` does.
        chunk: how many steps one run takes before the next run takes the same steps (the fp32 reference first;
            drift compares each step with the reference's weights after that step, kept as one fp32 copy per
            step of a chunk). 1 is strict lockstep; None (default): as many steps as fit in
            ``CHUNK_BYTES`` (64 MiB) of those copies, at least 1. Every value gives the same series bit for bit
            on a CPU (each run has its own random stream); longer chunks save the cost of switching models at
            every step (cache locality on a CPU: measured 2-10% of a tiny model's training, benchmarks/README.md).
        policy: whose autocast lists the precisions' runs use: None (default) the device's own; ``"cuda"`` on a
            CPU runs them under CUDA's (``ampcourse.emulate``: CUDA's casts, this CPU's arithmetic). The report's
            ``config["policy"]`` names it.

    Returns:
        a :class:`Trial`. Raises ValueError (one line that says what to pass) on bad input, before any step;
        :class:`RunFailed` when a precision's run raises where fp32 ran (which run, the step, the learner's line,
        and for a kernel this device lacks what that means); the fp32 reference's own errors as raised.

    Example::

        t = trial("transformer", precisions=("bf16", "fp16"), steps=100, lr=3e-3)
        t.departure("bf16"), t.get("fp16", "scale")[-1], t.overhead
    """
    t_start = time.perf_counter()
    names = _check_precisions(precisions)
    if isinstance(scaler_kwargs, dict) and "enabled" in scaler_kwargs:  # it was dropped silently
        raise ValueError("scaler_kwargs: 'enabled' is set by the precision name: 'fp16' runs with GradScaler, "
                         "'fp16-noscaler' without; leave 'enabled' out")
    # The settings a trial shares with train are checked by train's own settings object: one check, one message.
    shared = _train.TrainSettings(steps=steps, seed=seed, lr=lr, batch_size=batch_size, grad_clip=grad_clip,
                                  progress=progress, size=size, loss_fn=loss_fn, scaler_kwargs=scaler_kwargs)
    steps, seed, lr, batch_size = shared.steps, shared.seed, shared.lr, shared.batch_size
    grad_clip, progress = shared.grad_clip, shared.progress
    tolerance = _args.real(tolerance, "tolerance", positive=True)
    chunk = None if chunk is None else _args.integer(chunk, "chunk", low=1)
    monitors = default_monitors() if monitors is None else list(monitors)
    bad = [m for m in monitors if not isinstance(m, Monitor)]
    if bad:
        raise ValueError(f"monitors must be Monitor objects (ampcourse.trial.Monitor), got {_args.shown(bad[0])}")
    if len({m.name for m in monitors}) != len(monitors):
        raise ValueError(f"monitor names must differ, got {[m.name for m in monitors]}")
    scaler_settings = {**_scaler.DEFAULTS, **{k: v for k, v in shared.scaler_kwargs.items() if k != "enabled"}}
    make_opt = _make_optimizer(optimizer_factory, lr)
    for name in names:  # fp16 on a device without fp16 autocast: say so now, not at step 0
        _inputs.check_amp(pick(device, _precision(name)[0]), "precision", label=name)
    model, ref_name = _inputs.read_model(model_factory, "model_factory", size=size, seed=seed, accept=("name", "factory"))
    # fp16 with a GradScaler cannot unscale fp16 gradients: refused now, not after the fp32 reference has run
    _inputs.check_fp16_parameters(model, any(_precision(n)[1] for n in names), "the model from model_factory", "trial()")
    data = _inputs.read_data(data, reference=ref_name, seed=seed, size=size, batch_size=batch_size)
    iterable = data if isinstance(data, _inputs.Batches) else None
    sample = TensorDataset(*iterable.first()) if iterable is not None else data
    models.check_data(model, sample, targets=loss_fn is None)
    if iterable is None:
        batch_size = 32 if batch_size is None else batch_size
        if batch_size > len(data):
            raise _inputs.InputError(f"batch_size {batch_size} is larger than the dataset ({len(data)} samples); "
                                     f"use at most {len(data)}")
    _inputs.check_finite(*sample.tensors)
    loss = loss_fn or models.loss_fn

    ref_amp = pick(device, "fp32")
    session, policy = emulate.session(policy, ref_amp.device_type)
    labels, _ = _layers(model)
    if chunk is None:
        weights = sum(p.numel() for p in model.parameters() if p.requires_grad)
        chunk = max(1, min(steps, CHUNK_BYTES // (4 * weights)))
    chunk = min(chunk, steps)
    runs = [_start_run(label, model, device, make_opt, scaler_settings, monitors, seed)
            for label in (REFERENCE, *names)]
    ref = runs[0]
    ref.history = ref.flat.new_empty((chunk, ref.flat.numel()))  # at most CHUNK_BYTES by default
    probe = sample.tensors[0][:1].to(ref_amp.device), sample.tensors[1][:1].to(ref_amp.device)
    all_targets = sample.tensors[1] if loss_fn is None and iterable is None else None
    classes = _inputs.preflight(ref.model, *probe, loss if loss_fn is None else None, ref.amp,
                                labels=all_targets)  # bad data: one line, now
    ref.hooks.take()
    xs, ys = sample.tensors
    stream = iterable.stream() if iterable is not None else None  # one stream: every run gets the same batches
    train_seconds = 0.0
    bar = tqdm(total=steps * len(runs), desc=f"trial {', '.join(names)} vs fp32", unit="step", disable=not progress)
    try:
        with torch.random.fork_rng(devices=[ref_amp.device] if ref_amp.device_type == "cuda" else []), session:
            for start in range(0, steps, chunk):
                batches = []
                for step in range(start, min(start + chunk, steps)):
                    if stream is not None:
                        x, y = next(stream)
                        if classes is not None and y.device.type == "cpu":  # on the host: no device sync
                            _inputs.check_labels(y, classes, f"data targets of step {step}")
                        batches.append((x.to(ref_amp.device), y.to(ref_amp.device)))
                        continue
                    idx = _train.batch_indices(step, seed, len(data), batch_size)
                    batches.append((xs[idx].to(ref_amp.device), ys[idx].to(ref_amp.device)))
                ref_after: list[tuple[torch.Tensor, list[float]]] = []  # the reference's weights after each step
                for run in runs:  # the reference first: drift compares against its weights after the same step
                    try:
                        train_seconds += _steps(run, ref, batches, ref_after, loss, grad_clip, len(labels))
                    except torch.OutOfMemoryError:
                        raise
                    except Exception as err:
                        if run is ref:  # the model's own failure, in fp32: as it was raised
                            raise
                        raise RunFailed(_run_failed(run, err, policy)) from err
                    bar.update(len(batches))
    finally:
        bar.close()
        for run in runs:
            run.hooks.remove()
    by_size = {m.name for m in monitors if m.by_magnitude}
    departures = {run.label: _first_departure(run.label, run.series, ref.series, tolerance, by_size)
                  for run in runs[1:]}
    config = {"model": ref_name or type(model).__name__, "seed": seed, "lr": lr, "batch_size": batch_size,
              "optimizer": type(ref.optimizer).__name__, "grad_clip": grad_clip, "scaler": scaler_settings,
              "chunk": chunk, "torch": torch.__version__}
    config["policy"] = policy  # whose autocast lists the runs used ('cuda (emulated on cpu)': ampcourse.emulate)
    return Trial(list(names), steps, tolerance, ref.amp.describe_device(), labels, [m.name for m in monitors],
                 {run.label: run.series for run in runs}, departures, magnitude_monitors=sorted(by_size),
                 seconds=time.perf_counter() - t_start,
                 train_seconds=train_seconds, config=config)


class RunFailed(RuntimeError):
    """A precision's run raised where the fp32 reference had run the same steps (its cause is chained)."""


def _run_failed(run: _Run, err: BaseException, policy: str) -> str:
    """One message for a precision's run that raised: the run, the step, the learner's line, and, for a kernel this
    device lacks, what that means (under CUDA's emulated lists: nothing about CUDA, whose kernels differ)."""
    step = len(run.series.get("loss", [])) + 1
    where = _errors.learner_line(err)
    text = (f"the {run.label} run raised at step {step}, where fp32 ran" + (f", at {where}" if where else "")
            + f": {type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}")
    if _errors.missing_kernel(err):
        dev = run.amp.device_type
        if policy != dev:  # CUDA's lists emulated on this CPU: its arithmetic, its kernels
            text += (f". This {dev} has no {run.label} kernel for that op, so CUDA's {run.label} cannot be emulated "
                     f"for this model here, and whether CUDA has one this {dev} cannot tell: run the trial on the GPU, "
                     "or compute that op in fp32 (an explicit .float() before it)")
        else:
            text += (f". This {dev} has no {run.label} kernel for that op: compute it in fp32 (an explicit .float() "
                     f"before it) to train the rest in {run.label}")
    return text


def _steps(run: _Run, ref: _Run, batches: list[tuple[torch.Tensor, torch.Tensor]],
           ref_after: list[tuple[torch.Tensor, list[float]]], loss_fn: Callable, grad_clip: float | None,
           n_layers: int) -> float:
    """One run's steps on a chunk of batches, in its own random stream; returns the seconds train_step took."""
    torch.set_rng_state(run.rng)  # each run draws from its own stream: as if it ran alone
    seconds = 0.0
    for j, (x, y) in enumerate(batches):
        seconds += _step(run, ref, x, y, loss_fn, grad_clip, n_layers, ref_after, j)
    run.rng = torch.get_rng_state()
    return seconds


def _step(run: _Run, ref: _Run, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable, grad_clip: float | None,
          n_layers: int, ref_after: list[tuple[torch.Tensor, list[float]]], j: int) -> float:
    """One optimizer step of one run and its record; returns the seconds train_step took.

    The weights go into one flat vector per step (layers contiguous): update, norm and drift per layer are then a
    few kernels and one foreach norm (per-tensor norms were a visible share of a tiny model's CPU step). The
    reference appends its weights and layer norms after the step to `ref_after`; another run compares its own
    weights after the step with entry `j` there.
    """
    t0 = time.perf_counter()
    calls = run.step_calls
    stats = _train.train_step(run.model, [(x, y)], loss_fn, run.optimizer, run.scaler, run.amp, grad_clip=grad_clip)
    seconds = time.perf_counter() - t0
    run.optimizer_steps += _updated(run.optimizer, run.step_calls > calls, stats.skipped)
    with torch.no_grad():
        # buffers reused every step; the reference's weights go to a row of its history for the other runs
        new = _flatten_into(run.views, ref.history[j] if run is ref else run.spare)
        vectors = [torch.sub(new, run.flat, out=run.scratch), new]  # run.flat: the weights before this step
        if run is not ref:  # the reference took this step first
            ref_flat, ref_norms = ref_after[j]
            vectors.append(torch.sub(new, ref_flat, out=run.flat))  # the weights before are no longer needed
        monitors = run.hooks.take()
        # all layers of all vectors in one foreach call, then one read-back for everything (the sync also makes
        # the buffers safe to reuse on a GPU)
        norms = torch._foreach_norm([part for v in vectors for part in v.split(run.lengths)])
        values = torch.stack([*monitors, *norms]).tolist()
        if run is ref:
            run.flat.copy_(new)
        else:
            run.flat, run.spare = new, run.flat
    n_mon = len(monitors)
    ups, wgt = values[n_mon:n_mon + n_layers], values[n_mon + n_layers:n_mon + 2 * n_layers]
    drifts = values[n_mon + 2 * n_layers:]
    rows = run.rows  # the series' lists, bound once (no key lookups or formatting per step)
    if run is ref:
        gap, ratio = 0.0, 1.0
    else:
        k = len(rows.loss)
        ref_gn = ref.rows.grad_norm[k]
        gap, ratio = stats.loss - ref.rows.loss[k], (stats.grad_norm / ref_gn if ref_gn else math.nan)
    for values_list, v in zip(rows.scalars, (stats.loss, stats.grad_norm, stats.scale, float(stats.skipped),
                                             float(run.optimizer_steps), gap, ratio)):
        values_list.append(v)
    for values_list, v in zip(rows.monitors, values[:n_mon]):
        values_list.append(v)
    before_norms, run.layer_norms = run.layer_norms, wgt
    for values_list, up, before in zip(rows.update, ups, before_norms):
        values_list.append(_ratio(up, before))
    if run is ref:
        ref_after.append((new, wgt))
        for values_list in rows.drift:
            values_list.append(0.0)
    else:
        for values_list, drift, ref_norm in zip(rows.drift, drifts, ref_norms):
            values_list.append(_ratio(drift, ref_norm))
    return seconds


def _ratio(num: float, den: float) -> float:
    """num / den for norms: 0 when both are 0, inf when only den is; non-finite stays non-finite (as inf)."""
    if not math.isfinite(num):
        return math.inf
    if den == 0:
        return 0.0 if num == 0 else math.inf
    return num / den


def _updated(optimizer: torch.optim.Optimizer, called: bool, skipped: bool) -> bool:
    """Whether this step's optimizer.step() updated the weights.

    GradScaler skips a plain optimizer's step() on a found inf: no call. An optimizer that handles the scaling
    itself (``_step_supports_amp_scaling``: fused Adam/AdamW/SGD) is always called, with the scaler's
    ``found_inf``, and its kernel leaves the weights alone (torch.amp.GradScaler.step): a call, no update.
    The scaler's record (its scale went down) says which.
    """
    if not called:
        return False
    return not (skipped and getattr(optimizer, "_step_supports_amp_scaling", False))
