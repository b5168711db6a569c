"""What a trial returns (chapter 10): :class:`Trial`, the per-step series of every run (summary, plot, JSON), and
:class:`Departure`, the first step where a precision left fp32, and where.

Only Python floats are kept (series, not tensors), so memory grows with steps x layers, not with the model. How a
departure is judged lives here too (``_first_departure``, :func:`unit_roundoff`), so a Trial can judge its series
again with another tolerance or one kind of series. Reading one: ``series`` names what crossed the tolerance
(``loss``, a monitor, or ``drift``), ``layer`` where; a monitor departs within the forward pass of that step, drift
after its update.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import _args, formats
from ..device import parse_precision
from .monitors import RECOMPUTE_GAP

__all__ = ["Departure", "Trial", "unit_roundoff", "REFERENCE", "PRECISIONS", "DRIFT_LINES"]

#: Trial.plot names this many layers (those that drift most); the others are drawn grey, as one legend entry.
DRIFT_LINES = 5
#: The key of the fp32 reference run in Trial.series.
REFERENCE = "reference"
#: Precision names a trial compares against the fp32 reference.
PRECISIONS = ("fp32", "bf16", "fp16", "fp16-noscaler")


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

        from ..plots import legend_outside
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


def _precision(label: str) -> tuple[str, bool]:
    """(autocast precision, scaler enabled) for a precision name of a trial."""
    if label == "fp16-noscaler":
        return "fp16", False
    if label == REFERENCE:
        return "fp32", False
    return parse_precision(label), label == "fp16"


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
