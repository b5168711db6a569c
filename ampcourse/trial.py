"""fp32 and AMP side by side over N steps: where a long run in bf16 or fp16 departs from fp32, and in which layer (chapter 10).

The AMP doctor (``ampcourse.doctor``) examines one step. A trial trains the *same* initial model on the *same*
batches once in fp32 (the reference) and once in each precision asked for, in lockstep (in chunks of steps, the
reference first: see ``chunk``), and records per step:

- the loss and its gap to fp32, the gradient-norm ratio, the loss scale and skipped steps (fp16 runs use a real
  ``torch.amp.GradScaler`` with the settings ``ampcourse.train`` uses), and how many optimizer steps updated the
  weights (``optimizer.step()`` calls, less those a fused optimizer's kernel skipped on the scaler's found-inf);
- per layer (a module that owns parameters): the relative parameter drift from the fp32 run and the
  update-to-weight ratio of the step;
- through monitors (forward hooks; add your own): the largest pre-softmax attention logit per block, the largest
  output logit, and the largest activation per block; and ``recompute_gap``, how far a module recomputed during
  backward (activation checkpointing) strayed from what its forward recorded.

It reports the first step where a precision departs from fp32 by more than ``tolerance`` (relative) and the layer
that departs first. Only Python floats are kept (series, not tensors), so memory grows with steps x layers, not
with the model. Each step of every run goes through :func:`ampcourse.train.train_step`, the course's one AMP step.

    >>> from ampcourse.trial import trial
    >>> t = trial("transformer", precisions=("bf16", "fp16"), steps=200)
    >>> print(t.summary())        # per precision: final loss gap, worst drift, skips, the first departure
    >>> t.departure("bf16")       # Departure(step=..., series='attention_logit_max', layer='blocks.1', ...) or None
    >>> t.plot(); t.to_json("trial.json")

From a shell (like the doctor's)::

    python -m ampcourse.trial --model transformer --steps 200
    python -m ampcourse.trial --model transformer --precisions bf16,fp16,fp16-noscaler --lr 3e-3 --out trial.json

Precision names: ``fp32`` (a second fp32 run: its gap is exactly zero, a check of determinism), ``bf16``,
``fp16`` (autocast + GradScaler) and ``fp16-noscaler`` (autocast without a scaler: what happens when people
forget it). Runs are deterministic: the same arguments give the same series, bit for bit, on one machine.
How to read a departure: ``series`` names what crossed the tolerance (``loss``, a monitor, or ``drift``),
``layer`` where; a monitor departs within the forward pass of that step, drift after its update.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.utils.data import TensorDataset
from tqdm.auto import tqdm

from . import _args, _scaler, emulate, formats, models
from . import inputs as _inputs
from . import train as _train
from .device import AmpSetup, parse_precision, pick

__all__ = ["Monitor", "Departure", "Trial", "trial", "attention_logit_max", "output_logit_max", "activation_max",
           "default_monitors", "unit_roundoff", "REFERENCE", "PRECISIONS", "CHUNK_BYTES", "main"]

#: Trial.plot names this many layers (those that drift most); the others are drawn grey, as one legend entry.
DRIFT_LINES = 5
#: The key of the fp32 reference run in Trial.series.
REFERENCE = "reference"
#: Precision names a trial compares against the fp32 reference.
PRECISIONS = ("fp32", "bf16", "fp16", "fp16-noscaler")
#: The default chunk (trial's `chunk`) keeps at most this many bytes of the reference's weights (fp32 copies).
CHUNK_BYTES = 64 * 2**20

#: A monitor's measure: (module, forward inputs, forward output) -> a 0-d tensor (kept on the device until the
#: end of the step, so a monitor costs no host sync of its own).
Measure = Callable[[nn.Module, tuple, Any], torch.Tensor]


# ---------------------------------------------------------------------------------------------
# Monitors: forward hooks that record one number per layer per step
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Monitor:
    """A per-layer quantity recorded at every step of every run.

    Args:
        name: the series name (``"attention_logit_max"``); its values are ``Trial.series[run][f"{name}/{layer}"]``.
        where: ``where(model)`` returns ``[(layer label, module to hook, measure), ...]``; the measure runs in a
            forward hook of that module, gets ``(module, inputs, output.detach())`` and returns a 0-d tensor.
            When a module runs more than once in a step's forward pass (a shared module), the step keeps the
            largest value; calls during backward (activation checkpointing recomputing it) are not recorded here
            but compared with it: see ``Trial`` (``recompute_gap``).
        by_magnitude: judge the run's own values by their size, not by their gap to fp32: the monitor departs when
            |L| * u passes the tolerance, with L the value and u the unit roundoff of the run's format (2**-8
            for bf16, 2**-11 for fp16; bf16 at |L| > 25.6 for tolerance 0.1). It is a threshold on a magnitude,
            not a measured error: it says how large a rounding error *could* be, for values that feed a softmax
            (attention scores, output logits). Softmax is shift-invariant, so what matters there is the absolute
            error of its inputs: logits each moved by at most delta = |L| * u change a probability by a factor
            within exp(+-2 * delta). Other monitors (the default) depart on their relative gap to the fp32 run.

    Example::

        def logsumexp(model):  # PaLM's z-loss watches log Z of the output logits
            return [("output", model, lambda m, args, out: out.float().logsumexp(-1).abs().max())]
        t = trial("transformer", monitors=[*default_monitors(), Monitor("log_z", logsumexp)])
    """

    name: str
    where: Callable[[nn.Module], list[tuple[str, nn.Module, Measure]]]
    by_magnitude: bool = False


def _scores_max(block: nn.Module) -> Measure:
    """The largest |q.k|/sqrt(d_head) from a block's fused qkv projection output (B, T, 3*D): the pre-softmax logits.

    A block with ``q_norm`` and ``k_norm`` modules (QK-norm) has them applied first, so the monitor reads the
    logits softmax sees. The scores are masked as the attention masks them: causally (a query sees the keys up
    to its own position, as the reference ``Block`` does), unless the block has ``causal = False``.
    """
    heads = block.heads
    q_norm, k_norm = getattr(block, "q_norm", None), getattr(block, "k_norm", None)
    causal = bool(getattr(block, "causal", True))

    def measure(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        # The hook runs inside the step's autocast region, where `@` would cast q and k back to bf16/fp16: the
        # scores would be rounded, and on a CPU a low-precision `@` of this shape took ~4x as long (torch 2.13).
        if not torch.is_autocast_enabled(out.device.type):  # the fp32 run: no context to enter
            return _scores(out)
        with torch.autocast(out.device.type, enabled=False):
            return _scores(out)

    def _scores(out: torch.Tensor) -> torch.Tensor:
        b, t, three_d = out.shape
        d = three_d // 3
        qk = out[..., :2 * d].float().view(b, t, 2, heads, d // heads)  # fp32 (see measure)
        q, k = qk[:, :, 0].transpose(1, 2), qk[:, :, 1].transpose(1, 2)  # v is never copied
        if q_norm is not None and k_norm is not None:
            with torch.no_grad():  # their weights require grad: without this they would build a graph
                q, k = q_norm(q), k_norm(k)
        scores = q @ k.transpose(-2, -1)  # (B, heads, query, key)
        if causal:  # a future key's score never reaches softmax: unmasked, the largest |score| can be one of those
            scores = torch.tril(scores)  # zeros above the diagonal; the diagonal itself is always seen
        return _abs_amax(scores) / math.sqrt(d // heads)
    return measure


def _attention_blocks(model: nn.Module) -> list[tuple[str, nn.Module, Measure]]:
    """Every module with a fused ``qkv`` Linear and a ``heads`` count (the reference transformer's Block)."""
    found = []
    for name, module in model.named_modules():
        qkv, heads = getattr(module, "qkv", None), getattr(module, "heads", None)
        if isinstance(qkv, nn.Linear) and isinstance(heads, int):
            found.append((name, qkv, _scores_max(module)))
    return found


def attention_logit_max() -> Monitor:
    """The largest pre-softmax attention logit |q.k|/sqrt(d) per block (modules with ``qkv`` and ``heads``)."""
    return Monitor("attention_logit_max", _attention_blocks, by_magnitude=True)


def _abs_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a 0-d tensor of x's dtype (nan if any element is nan).

    ``x.abs().amax()``, not ``torch.linalg.vector_norm(x, inf)``: the same value, but on a CPU (torch 2.13, a
    tensor of 16k-32k elements) the norm took ~45-90 us against ~5-12 us, a visible share of a tiny model's step.
    """
    return x.abs().amax()


def _abs_max(module: nn.Module, args: tuple, out: Any) -> torch.Tensor:
    """max |output| as 0-d fp32 (the max of bf16 values is a bf16 value: exact in fp32).

    Of the tensor the output leads with (``(logits, aux)``: the logits; ``.logits``); nan for an output without one.
    """
    t = out if isinstance(out, torch.Tensor) else _inputs.first_tensor(out)
    if t is None:
        return torch.tensor(math.nan)
    return _abs_amax(t.detach()).float()  # in the output's dtype: no fp32 copy of it (the hook passes it detached)


def output_logit_max() -> Monitor:
    """The largest |output| of the whole model: the output (vocabulary) logits of a language model."""
    return Monitor("output_logit_max", lambda model: [("output", model, _abs_max)], by_magnitude=True)


def _blocks(model: nn.Module) -> list[tuple[str, nn.Module, Measure]]:
    """The members of every nn.ModuleList (a transformer's blocks); the top-level children where there is none."""
    found = [(f"{name}.{i}", block, _abs_max) for name, module in model.named_modules()
             if isinstance(module, nn.ModuleList) for i, block in enumerate(module)]
    return found or [(name, child, _abs_max) for name, child in model.named_children()]


def activation_max() -> Monitor:
    """The largest |activation| leaving each block (ModuleList members, else the top-level children)."""
    return Monitor("activation_max", _blocks)


def default_monitors() -> list[Monitor]:
    """Attention-logit max per block, output-logit max, activation max per block."""
    return [attention_logit_max(), output_logit_max(), activation_max()]


def _measured(value: Any) -> str:
    """What a monitor's measure returned, for the error message."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"{_args.shown(value)} (a {type(value).__name__}, not a tensor)"


def _where(monitor: Monitor, model: nn.Module) -> list[tuple[str, nn.Module, Measure]]:
    """monitor.where(model), checked: a list of (layer label, module of the model, callable measure) triples."""
    found = monitor.where(model)
    triples = list(found) if isinstance(found, (list, tuple)) else None
    ours = {id(m) for m in model.modules()}
    if triples is None or not all(isinstance(t, (tuple, list)) and len(t) == 3 and isinstance(t[0], str)
                                  and isinstance(t[1], nn.Module) and id(t[1]) in ours and callable(t[2])
                                  for t in triples):
        raise _inputs.InputError(f"monitor {monitor.name!r}: where(model) returned {_args.shown(found)}; it must return "
                                 "a list of (layer label, module of the model, measure) triples")
    return triples


class _Hooks:
    """The forward hooks of one run's monitors: each step's values stay 0-d tensors until read()."""

    def __init__(self, model: nn.Module, monitors: Sequence[Monitor]):
        self.labels: list[str] = []
        self.values: dict[str, torch.Tensor] = {}  # this step's forward calls
        self.reruns: dict[str, torch.Tensor] = {}  # this step's calls during backward (a recompute)
        # made once, on the model's device: they are stacked with the other values in the step's one read-back
        device = next(model.parameters()).device
        self.nan, self.zero = torch.tensor(math.nan, device=device), torch.tensor(0.0, device=device)
        self.handles = []
        for monitor in monitors:
            for layer, module, measure in _where(monitor, model):
                label = f"{monitor.name}/{layer}"
                if label not in self.labels:
                    self.labels.append(label)
                    self.handles.append(module.register_forward_hook(self._hook(label, measure)))

    def _hook(self, label: str, measure: Measure):
        def hook(module, args, out):
            # A detached output: the measure's ops build no autograd graph (cheaper than a no_grad block per call).
            value = measure(module, args, out.detach() if isinstance(out, torch.Tensor) else out)
            if not isinstance(value, torch.Tensor) or value.numel() != 1:  # else an error that blamed the data
                raise _inputs.InputError(f"monitor {label!r}: its measure returned {_measured(value)}; a measure "
                                         "returns a 0-d tensor (one number, e.g. out.abs().amax())")
            if value.dtype != torch.float32 or value.dim():  # the built-in measures return 0-d fp32 already
                value = value.detach().float().reshape(())
            # Inside the autograd engine (a graph task is running) this call is a recompute for backward
            # (torch.utils.checkpoint, a hand-written recompute): kept apart, compared with the forward's in take().
            store = self.reruns if torch._C._current_graph_task_id() != -1 else self.values
            old = store.get(label)
            store[label] = value if old is None else torch.maximum(old, value)
        return hook

    def take(self) -> list[torch.Tensor]:
        """This step's values in label order (nan for a layer that did not run), then the recompute gap; reset.

        The recompute gap is the largest |recomputed - forward| / |forward| over the labels that ran again
        during backward (0 when none did): a faithful recompute gives exactly the forward's values, so
        exactly 0 (on a deterministic device), whichever way a wrong one strays.
        """
        nan = self.nan
        out = [self.values.get(label, nan) for label in self.labels]
        gaps = [(again - self.values[label]).abs() / self.values[label].abs().clamp_min(1e-30)
                for label, again in self.reruns.items() if label in self.values]
        out.append(torch.stack(gaps).amax() if gaps else self.zero)
        self.values, self.reruns = {}, {}
        return out

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


# ---------------------------------------------------------------------------------------------
# What a trial returns
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Departure:
    """The first step where a precision's run left the fp32 run by more than the tolerance, and where."""

    precision: str
    step: int  # 0-based optimizer step
    series: str  # "loss", a monitor name, or "drift"
    layer: str  # the layer label ("blocks.1", "blocks.0.qkv", "output"; "model" for the loss)
    gap: float  # relative gap |run - fp32| / |fp32| (inf when only one is finite); for a by-magnitude monitor
    #             |L| * u of its value: a bound on its rounding, not a measured difference (see Monitor)
    tolerance: float
    by_magnitude: bool = False  # gap is |L| * u (Monitor.by_magnitude), not a gap to fp32

    def __str__(self) -> str:
        if self.by_magnitude:
            return (f"{self.precision} departs at step {self.step}: {self.series} of {self.layer} is large enough "
                    f"that its rounding could reach |L|*u = {self.gap:.3g} (tolerance {self.tolerance:g}; a "
                    "threshold on the value, not a measured gap to fp32)")
        return (f"{self.precision} departs from fp32 at step {self.step}: {self.series} of {self.layer} "
                f"is {self.gap:.3g} apart (relative; tolerance {self.tolerance:g})")


def _relative_gap(value: float, ref: float) -> float:
    """|value - ref| / |ref|; 0 when both are equal (nan == nan too), inf when only one is finite."""
    if value == ref or (math.isnan(value) and math.isnan(ref)):
        return 0.0
    if not (math.isfinite(value) and math.isfinite(ref)):
        return math.inf
    return abs(value - ref) / max(abs(ref), 1e-30)


@dataclass
class Trial:
    """Per-step series of an fp32 reference run and of each precision's run (Python floats only).

    ``series[run][name]`` is a list with one value per step; ``run`` is ``"reference"`` or a precision name.
    Names: ``loss``, ``loss_gap`` (run - fp32), ``grad_norm``, ``grad_norm_ratio`` (run / fp32), ``scale``,
    ``skipped`` (1.0 when the GradScaler skipped the step), ``optimizer_steps`` (how many optimizer steps
    updated the weights, cumulative: ``optimizer.step()`` calls, less those where GradScaler handed a fused
    optimizer its found-inf and the kernel skipped the update), ``recompute_gap`` (the largest relative
    difference between a monitor's value recomputed during backward and its forward value; 0 when nothing was
    recomputed or the recompute was faithful), ``drift/<layer>`` (||W_run - W_fp32|| / ||W_fp32|| after the
    step), ``update/<layer>`` (||W_after - W_before|| / ||W_before||), and ``<monitor>/<layer>``.
    """

    precisions: list[str]
    steps: int
    tolerance: float
    device: str
    layers: list[str]
    monitors: list[str]
    series: dict[str, dict[str, list[float]]]
    departures: dict[str, Departure | None]
    magnitude_monitors: list[str] = field(default_factory=list)  # judged by |L| * u (Monitor.by_magnitude)
    seconds: float = 0.0  # wall time of the whole trial
    train_seconds: float = 0.0  # of which inside train_step (the trainings themselves)
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def overhead(self) -> float:
        """Wall time of the trial / time spent in the training steps it ran (1.0: no overhead)."""
        return self.seconds / self.train_seconds if self.train_seconds else math.nan

    def departure(self, precision: str, series: str | None = None, tolerance: float | None = None) -> Departure | None:
        """The first departure of one precision's run (None: it stayed within the tolerance).

        Args:
            precision: one of the trial's precisions.
            series: only this kind of series: ``"loss"``, ``"drift"`` or a monitor's name (default: all of them).
            tolerance: another tolerance than the trial's (default: the trial's).

        Example::

            t.departure("bf16", series="attention_logit_max")   # when bf16's attention logits got too large
        """
        if precision not in self.departures:
            raise ValueError(f"precision {precision!r} was not in this trial; it ran {', '.join(self.precisions)}")
        kinds = ["loss", "drift", *self.monitors]
        if series is not None and series not in kinds:
            raise ValueError(f"series must be one of {', '.join(kinds)}, got {series!r}")
        if series is None and tolerance is None:
            return self.departures[precision]
        tol = self.tolerance if tolerance is None else _args.real(tolerance, "tolerance", positive=True)
        return _first_departure(precision, self.series[precision], self.series[REFERENCE], tol,
                                self.magnitude_monitors, only=series)

    def get(self, run: str, name: str) -> list[float]:
        """One series (``t.get("bf16", "drift/blocks.0.qkv")``); ValueError naming what exists otherwise."""
        if run not in self.series:
            raise ValueError(f"run {run!r} is not in this trial; runs: {', '.join(self.series)}")
        if name not in self.series[run]:
            raise ValueError(f"no series {name!r}; series: {', '.join(self.series[run])}")
        return self.series[run][name]

    def layer_series(self, run: str, prefix: str) -> dict[str, list[float]]:
        """{layer: values} for every series ``prefix/<layer>`` of a run (``"drift"``, ``"attention_logit_max"``)."""
        if run not in self.series:
            raise ValueError(f"run {run!r} is not in this trial; runs: {', '.join(self.series)}")
        known = ("drift", "update", *self.monitors)
        if not isinstance(prefix, str) or prefix.rstrip("/") not in known:  # a typo gave {}: "no layer departed"
            raise ValueError(f"no per-layer series {_args.shown(prefix)}; choose one of {', '.join(known)}")
        start = prefix.rstrip("/") + "/"
        return {k[len(start):]: v for k, v in self.series[run].items() if k.startswith(start)}

    def summary(self) -> str:
        """One line per precision: final loss gap, worst drift and its layer, skipped steps, the first departure."""
        lines = [f"trial: {self.steps} steps on {self.device}, tolerance {self.tolerance:g} (relative to fp32)"]
        for p in self.precisions:
            s = self.series[p]
            drift = {k: v[-1] for k, v in self.layer_series(p, "drift").items()}
            worst = max(drift, key=lambda k: drift[k] if math.isfinite(drift[k]) else math.inf) if drift else "-"
            skipped = int(sum(s["skipped"]))
            dep = self.departures[p]
            what = "|L|*u" if dep is not None and dep.by_magnitude else "gap"
            rerun = max(s.get(RECOMPUTE_GAP, [0.0]))
            lines.append(f"  {p:14} final loss {s['loss'][-1]:.5g} (gap {s['loss_gap'][-1]:+.3g}), "
                         f"worst drift {drift.get(worst, math.nan):.3g} in {worst}, skipped {skipped}, "
                         f"optimizer steps {int(s['optimizer_steps'][-1])}; "
                         + (f"departs at step {dep.step} ({dep.series} of {dep.layer}, {what} {dep.gap:.3g})"
                            if dep else "stays within the tolerance")
                         + (f"; a recompute in backward differed from its forward by up to {rerun:.2g}"
                            if rerun > 0 else ""))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"Trial({', '.join(self.precisions)} vs fp32, {self.steps} steps)"

    def to_dict(self) -> dict[str, Any]:
        """Everything as JSON-ready values (non-finite floats as the strings 'nan', 'inf', '-inf')."""
        def clean(v):
            if isinstance(v, float) and not math.isfinite(v):
                return str(v)
            if isinstance(v, dict):
                return {k: clean(x) for k, x in v.items()}
            if isinstance(v, (list, tuple)):
                return [clean(x) for x in v]
            return v
        return clean({"precisions": self.precisions, "steps": self.steps, "tolerance": self.tolerance,
                      "device": self.device, "layers": self.layers, "monitors": self.monitors,
                      "magnitude_monitors": self.magnitude_monitors, "seconds": self.seconds,
                      "train_seconds": self.train_seconds, "config": self.config,
                      "departures": {p: (None if d is None else d.__dict__) for p, d in self.departures.items()},
                      "series": self.series})

    def to_json(self, path: str | Path | None = None) -> str:
        """The trial as JSON text; written to `path` too when one is given."""
        text = json.dumps(self.to_dict(), indent=1)
        if path is not None:
            Path(_args.writable_file(path, "path")).write_text(text + "\n", encoding="utf-8")
        return text

    def plot(self, precision: str | None = None):
        """Three panels: loss and its gap, logit growth (attention and output), drift per layer of one precision."""
        import matplotlib.pyplot as plt

        from .plots import legend_outside
        p = precision or self.precisions[0]
        self.departure(p)  # names the precisions if p is not one of them
        fig, axes = plt.subplots(1, 3, figsize=(13, 3.4), dpi=80, layout="constrained")
        # The runs' losses usually lie within a line width of fp32's: drawn together they look like one curve.
        # So the fp32 loss on the left axis, and each precision's gap to it on the right.
        axes[0].plot(self.series[REFERENCE]["loss"], color="k", lw=2.5, alpha=0.4, label="fp32 loss (left)")
        gap_ax = axes[0].twinx()
        for i, run in enumerate(self.precisions):
            gap_ax.plot(self.series[run]["loss_gap"], color=f"C{i}", lw=1.0, label=f"{run} - fp32 (right)")
        gap_ax.axhline(0.0, color="k", lw=0.5, ls=":")
        gap_ax.set_ylabel("loss gap to fp32")
        axes[0].set(xlabel="step", ylabel="fp32 loss", title="loss and its gap to fp32")
        handles = [h for ax in (axes[0], gap_ax) for h in ax.get_legend_handles_labels()[0]]
        # below the axes (constrained layout makes room): inside, the gaps of every step would run under it
        axes[0].legend(handles=handles, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2,
                       frameon=False)
        for run, style in ((REFERENCE, dict(lw=2.5, alpha=0.5)), (p, dict(lw=1.0, ls="--"))):
            for i, (layer, values) in enumerate({**self.layer_series(run, "attention_logit_max"),
                                                 **self.layer_series(run, "output_logit_max")}.items()):
                axes[1].plot(values, color=f"C{i}", label=f"{layer} ({'fp32' if run == REFERENCE else run})", **style)
        axes[1].set(xlabel="step", ylabel="max |logit|", title="logit growth (attention per block, output)")
        axes[1].set_yscale("log")
        legend_outside(axes[1])
        drift = self.layer_series(p, "drift")
        # The layers that drift most at the end, named; the others thin and grey, under one legend entry.
        final = {layer: values[-1] if math.isfinite(values[-1]) else math.inf for layer, values in drift.items()}
        named = sorted(final, key=final.get, reverse=True)[:DRIFT_LINES]
        others = [layer for layer in drift if layer not in named]
        for j, layer in enumerate(others):
            axes[2].plot([v if v > 0 else math.nan for v in drift[layer]], color="0.7", lw=0.7,
                         label=f"the other {len(others)} layers" if j == 0 else None)
        for i, layer in enumerate(named):
            axes[2].plot([v if v > 0 else math.nan for v in drift[layer]], color=f"C{i}", lw=1.2, label=layer)
        axes[2].axhline(self.tolerance, color="k", lw=0.8, ls=":", label=f"tolerance {self.tolerance:g}")
        axes[2].set(xlabel="step", ylabel="||W - W_fp32|| / ||W_fp32||", title=f"{p}: parameter drift per layer")
        axes[2].set_yscale("log")
        legend_outside(axes[2])
        return fig


# ---------------------------------------------------------------------------------------------
# The runs
# ---------------------------------------------------------------------------------------------

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


#: The series of a step's recompute gap (see _Hooks.take), one value per step.
RECOMPUTE_GAP = "recompute_gap"
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
    for name, module in model.named_modules():
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


def _precision(label: str) -> tuple[str, bool]:
    """(autocast precision, scaler enabled) for a precision name of a trial."""
    if label == "fp16-noscaler":
        return "fp16", False
    if label == REFERENCE:
        return "fp32", False
    return parse_precision(label), label == "fp16"


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
        a :class:`Trial`. Raises ValueError (one line that says what to pass) on bad input, before any step.

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
                    train_seconds += _steps(run, ref, batches, ref_after, loss, grad_clip, len(labels))
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


def unit_roundoff(precision: str) -> float:
    """Half the gap between 1 and the next number of the autocast format of a precision (bf16 2**-8, fp32 2**-24)."""
    return formats.spec(_precision(precision)[0]).eps / 2


def _first_departure(label: str, series: dict[str, list[float]], ref: dict[str, list[float]], tolerance: float,
                     by_size: set[str] | list[str], only: str | None = None) -> Departure | None:
    """The first step where loss, a monitor or a layer's drift is more than `tolerance` apart from fp32.

    By-magnitude monitors count |L| * u of their own value instead (Monitor.by_magnitude). Within the
    first step that departs, the series furthest past the tolerance names the layer. `only`: look at one
    series name ("loss", "drift" or a monitor's name).
    """
    u = unit_roundoff(label)
    compared = [("loss", "model", series["loss"], ref["loss"])]
    for key, values in series.items():
        if key.startswith("drift/"):
            compared.append(("drift", key[6:], values, None))
        elif "/" in key and not key.startswith("update/"):
            name, layer = key.split("/", 1)
            compared.append((name, layer, values, "magnitude" if name in by_size else ref[key]))
    if only is not None:
        compared = [c for c in compared if c[0] == only]
    for k in range(len(series["loss"])):
        worst = None
        for name, layer, values, ref_values in compared:
            if ref_values is None:
                gap = values[k]
            elif ref_values == "magnitude":
                gap = abs(values[k]) * u
            else:
                gap = _relative_gap(values[k], ref_values[k])
            if math.isnan(gap):
                gap = math.inf
            if gap > tolerance and (worst is None or gap > worst[0]):
                worst = (gap, name, layer)
        if worst is not None:
            return Departure(label, k, worst[1], worst[2], worst[0], tolerance, by_magnitude=worst[1] in by_size)
    return None


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    """The command line of python -m ampcourse.trial."""
    ap = _args.OneLineParser(prog="python -m ampcourse.trial", description=__doc__.split("\n\n")[0],
                             error_prefix="ampcourse.trial", formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help=f"a reference model: {', '.join(models.MODELS)}")
    ap.add_argument("--precisions", default="bf16",
                    help=f"comma-separated, from {', '.join(PRECISIONS)} (default bf16)")
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps per run (default 200)")
    ap.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    ap.add_argument("--batch-size", type=int, default=32, help="samples per step (default 32)")
    ap.add_argument("--tolerance", type=float, default=0.1, help="relative gap that counts as a departure (0.1)")
    ap.add_argument("--seed", type=int, default=0, help="seed for the model, the batches and dropout (default 0)")
    ap.add_argument("--size", default="tiny", help=f"reference model size: {', '.join(models.SIZES)} (default tiny)")
    ap.add_argument("--device", default=None, help="cpu, cuda, cuda:N or mps (default: the best available)")
    ap.add_argument("--policy", default=None, choices=["cuda"], help="cuda: CUDA's autocast lists on a CPU (emulated)")
    ap.add_argument("--out", default=None, help="write the trial as JSON here")
    ap.add_argument("--plot", default=None, help="save the plot (PNG) here")
    ap.add_argument("--no-progress", dest="progress", action="store_false",
                    help="no progress bar on stderr (shown by default)")
    return ap


def _check_plot_format(path: str) -> None:
    """ValueError unless matplotlib can save a figure in the format `path`'s suffix names (no suffix: PNG)."""
    suffix = Path(path).suffix.lower().lstrip(".")
    if not suffix:
        return
    from matplotlib.figure import Figure
    formats = Figure().canvas.get_supported_filetypes()
    if suffix not in formats:
        raise ValueError(f"--plot {path!r}: matplotlib cannot write .{suffix} files; "
                         f"end the name with one of {', '.join('.' + f for f in sorted(formats))} (e.g. trial.png)")


def main(argv: Sequence[str] | None = None) -> int:
    """Run a trial from the command line; 0 on success, 2 with one line on stderr for bad input."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as done:  # --help (0), or a bad flag (2) whose one line is already on stderr
        return done.code if isinstance(done.code, int) else 2
    try:
        _args.output_files([("--out", args.out), ("--plot", args.plot)])  # before the work, not after it
        if args.plot is not None:
            _check_plot_format(args.plot)  # an unknown suffix fails now, not after every step has run
        if args.model not in models.MODELS:
            raise ValueError(f"--model must be one of {', '.join(models.MODELS)}, got {args.model!r}")
        precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
        t = trial(args.model, precisions=precisions, steps=args.steps, lr=args.lr, batch_size=args.batch_size,
                  tolerance=args.tolerance, seed=args.seed, size=args.size, device=args.device,
                  policy=args.policy, progress=args.progress)
        print(t.summary())
        if args.out:
            t.to_json(args.out)
        if args.plot:
            import matplotlib
            matplotlib.use("Agg")
            t.plot().savefig(args.plot)
    except (ValueError, TypeError, OSError) as err:
        print(f"ampcourse.trial: error: {_args.first_line(err)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
