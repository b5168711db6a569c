"""The scaler simulator: GradScaler's four settings and an overflow pattern in, the scale over steps out (chapter 6).

    >>> s = scaler_simulator()             # GradScaler's scale over steps
    >>> s.backoff_factor.value = 0.25; s.summary["skipped"]
"""

from __future__ import annotations

import html
import math

import ipywidgets as W
import numpy as np

from .. import _args, _scaler, plots, scaling
from .common import _LABEL, _WIDE, _Guarded, _error_html, _plural, parse_steps
from .figure import _FigureImage

__all__ = ["ScalerSimulator", "scaler_simulator"]


def _scale_trajectory(overflows: np.ndarray, init_scale: float, growth_factor: float, backoff_factor: float,
                      growth_interval: int) -> np.ndarray:
    """scaling.simulate_scale's scales (same float32 values), one update per event instead of one per step.

    The scale changes only at an overflow and at every growth_interval-th clean step in a row; between those
    it stays put. So this jumps from event to event and applies ``scaling._next_scale`` (the one home of the
    update rule) at each: a 20k-step drag costs a few hundred updates instead of 20k (benchmarks/README.md).
    """
    n = len(overflows)
    out = np.empty(n, dtype=np.float64)
    scale, tracker, i = scaling._float32(init_scale), 0, 0
    rule = dict(growth_factor=growth_factor, backoff_factor=backoff_factor, growth_interval=growth_interval)
    for nxt in [*np.flatnonzero(overflows).tolist(), n]:  # each overflow, then the end of the run
        while i < nxt:  # clean steps up to the next overflow: the scale grows every growth_interval of them
            grow_at = i + growth_interval - tracker - 1
            if grow_at >= nxt:
                out[i:nxt], tracker, i = scale, tracker + (nxt - i), nxt
                break
            out[i:grow_at] = scale
            scale, tracker = scaling._next_scale(scale, growth_interval - 1, False, **rule)
            out[grow_at], i = scale, grow_at + 1
        if i < n:
            scale, tracker = scaling._next_scale(scale, tracker, True, **rule)
            out[i], i = scale, i + 1
    return out


def _check_simulator_args(steps: int, probability: float, seed: int) -> None:
    """ValueError naming the argument unless each fits its control (a slider would clamp it without a word)."""
    if isinstance(steps, bool) or not isinstance(steps, int) or not 10 <= steps <= 20000:
        raise ValueError(f"steps must be an int from 10 to 20000 (the steps slider's range), got {steps!r}")
    ok = isinstance(probability, (int, float)) and not isinstance(probability, bool) and 1e-5 <= probability <= 1
    if not ok:
        raise ValueError(f"probability must be a number from 1e-05 to 1 (the P(overflow) slider's range), got {probability!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")


_AXIS_ENDS = (1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8)  # x-axis ends' mantissas: a run fills 80-100% of it


def _axis_end(n_steps: int) -> int:
    """The right end of the simulator's step axis: the smallest 'round' number >= n_steps (10, 12, 15, ..., 20000).

    A drag of the steps slider then changes the axes only when it crosses one of these (13 per decade),
    and each is drawn once (``_FigureImage.key``); the rest of the drag is a move. The run fills 80-100% of it.

        >>> _axis_end(6000), _axis_end(6010), _axis_end(20000)
        (6000, 7000, 20000)
    """
    n = max(int(n_steps), 1)
    decade = 10 ** (len(str(n)) - 1)
    return next(int(m * decade) for m in (*_AXIS_ENDS, 10) if m * decade >= n)


class ScalerSimulator(_Guarded, W.VBox):
    """GradScaler's four settings and an overflow pattern in, the scale over steps (skipped steps marked) out."""

    def __init__(self, steps: int = 6000, probability: float = 5e-4, burst: str = "3000-3005", seed: int = 0):
        steps, probability, seed = _args.scalar(steps), _args.scalar(probability), _args.scalar(seed)  # numpy, 0-d tensors
        _check_simulator_args(steps, probability, seed)
        label = dict(style=_LABEL, layout=_WIDE)
        self.init_log2 = W.IntSlider(value=16, min=-24, max=40, description="log2 init_scale", **label)
        self.growth_factor = W.FloatSlider(value=2.0, min=1.05, max=8.0, step=0.05, description="growth_factor", **label)
        self.backoff_factor = W.FloatSlider(value=0.5, min=0.05, max=0.95, step=0.05, description="backoff_factor",
                                            **label)
        self.growth_interval = W.IntSlider(value=2000, min=1, max=5000, description="growth_interval", **label)
        self.steps = W.IntSlider(value=steps, min=10, max=20000, step=10, description="steps", **label)
        self.probability = W.FloatLogSlider(value=probability, base=10, min=-5, max=0, description="P(overflow)",
                                            readout_format=".1e", **label)
        self.burst = W.Text(value=burst, description="burst steps", continuous_update=False,
                            placeholder="e.g. 1000-1020, 4000", **label)
        self.seed = W.IntText(value=seed, description="seed", **label)
        self.message = W.HTML()
        self.summary_html = W.HTML()
        self.summary_html.add_class("ampcourse-scaler-summary")
        self._figure = _FigureImage((7, 2.8), css_class="ampcourse-scaler-figure")
        self.fig, self.image = self._figure.fig, self._figure.image
        self.ax = self.fig.add_subplot()
        (self._line,) = self.ax.plot([], [], drawstyle="steps-post", lw=1.3, color="#1f77b4", label="scale")
        (self._skips,) = self.ax.plot([], [], "|", color="#d62728", ms=9, label="skipped step (overflow)")
        self.ax.set(xlabel="step", ylabel="log2(scale)")
        self.ax.set_title(" ", fontsize=9)
        # right of the axes: inside, the legend would cover the trajectory wherever the scale goes
        self.ax.legend(["scale", "skipped step\n(overflow)"], fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                       frameon=False, borderaxespad=0.0)
        self._figure.dynamic = [self._line, self._skips, self.ax.title]
        self.overflows: list[bool] = []
        self.scales: list[float] = []
        self.summary: dict = {}
        # parsed against the longest run the steps slider allows, not this one: a burst past the current run is
        # kept and comes back when the run grows (_pattern leaves out the steps beyond the run)
        self._burst_steps: list[int] = parse_steps(burst, self.steps.max)
        controls = [self.init_log2, self.growth_factor, self.backoff_factor, self.growth_interval, self.steps,
                    self.probability, self.seed]
        for c in controls:
            self._watch(c, self._on_change)
        self._watch(self.burst, self._on_burst)
        super().__init__([W.HBox([W.VBox(controls[:4]), W.VBox(controls[4:] + [self.burst])]), self.message,
                          self.image, self.summary_html])
        self._update()

    def __repr__(self) -> str:
        return (f"ScalerSimulator(init_scale=2**{self.init_log2.value}, growth_factor={self.growth_factor.value}, "
                f"backoff_factor={self.backoff_factor.value}, growth_interval={self.growth_interval.value}, "
                f"steps={self.steps.value})")

    def _on_change(self, change) -> None:
        """Any slider moved."""
        self._update()

    def _on_burst(self, change) -> None:
        """Scripted overflow steps typed: show why they do not parse, or use them."""
        try:
            self._burst_steps = parse_steps(change["new"], self.steps.max)  # as in __init__: the run may grow
        except ValueError as err:  # the plot still shows the last good burst: say which
            shown = ", ".join(map(str, self._burst_steps[:6])) + (", ..." if len(self._burst_steps) > 6 else "")
            self.message.value = _error_html(err, f" The plot still shows the burst at steps {html.escape(shown or 'none')}.")
            return
        self.message.value = ""
        self._update()

    def pattern(self) -> list[bool]:
        """The overflow pattern: random overflows with P(overflow), plus the scripted burst."""
        return self._pattern().tolist()

    def _pattern(self) -> np.ndarray:
        """pattern() as a boolean array."""
        n = self.steps.value
        rng = np.random.default_rng(self.seed.value)
        over = rng.random(n) < self.probability.value
        burst = np.asarray([s for s in self._burst_steps if s <= n], dtype=np.int64)
        over[burst - 1] = True
        return over

    def _check_controls(self) -> None:
        """ValueError naming the control whose value (typed, or set from code) the simulation cannot use."""
        _check_simulator_args(self.steps.value, self.probability.value, self.seed.value)
        _scaler.check_args(2.0 ** self.init_log2.value, self.growth_factor.value, self.backoff_factor.value,
                          self.growth_interval.value)

    def _update(self) -> None:
        """Simulate GradScaler's scale for the pattern and redraw."""
        self._check_controls()
        skipped = self._pattern()
        self.overflows = skipped.tolist()
        scales = _scale_trajectory(skipped, 2.0 ** self.init_log2.value, self.growth_factor.value,
                                   self.backoff_factor.value, self.growth_interval.value)
        self.scales = scales.tolist()
        steps = np.arange(1, len(scales) + 1)
        with np.errstate(divide="ignore"):
            y = np.log2(scales)
        y = np.maximum(y, plots.ZERO_SCALE_LOG2)  # a scale that collapsed to 0 is drawn at the bottom, not dropped
        # A step plot only needs the steps where the scale changes (usually a few hundred of thousands).
        change = np.flatnonzero(np.diff(y, prepend=np.nan, append=np.nan) != 0)
        change = change[change < len(y)]
        self._line.set_data(np.append(steps[change], len(y) + 1), np.append(y[change], y[-1:] if len(y) else []))
        self._skips.set_data(steps[skipped], y[skipped])
        self._set_limits(len(steps), float(y.min(initial=0.0)), float(y.max(initial=1.0)))
        self.summary = self._summarize(skipped)
        self.ax.title.set_text(f"{self.summary['skipped']} of {_plural(len(steps), 'step')} skipped; "
                                     f"final scale {self.summary['final_scale']:.4g}")
        self.summary_html.value = self._summary_html()
        self._figure.render()

    def _set_limits(self, n_steps: int, y_min: float, y_max: float) -> None:
        """Change the axes only when the data leaves them or fills less than half (cached axes = fast redraws).

        Each (x range, y range) keeps its bitmap (``_FigureImage.key``): a steps value or scale range seen
        before is redrawn as a move. A new y range runs the layout again (its tick labels may be wider).
        """
        lo, hi = 8 * math.floor((y_min - 1) / 8), 8 * math.ceil((y_max + 1) / 8)  # whole multiples of 8 octaves
        cur_lo, cur_hi = self.ax.get_ylim()
        if lo < cur_lo or hi > cur_hi or (hi - lo) < 0.5 * (cur_hi - cur_lo):
            self.ax.set_ylim(lo, hi)
            if max(len(f"{lo:g}"), len(f"{hi:g}")) != max(len(f"{cur_lo:g}"), len(f"{cur_hi:g}")):
                self._figure.relayout()  # tick labels of another width: the axes may need another place
        right = _axis_end(n_steps)
        if self.ax.get_xlim() != (0, right):
            self.ax.set_xlim(0, right)
        self._figure.key = (self.ax.get_xlim(), self.ax.get_ylim())

    def _summarize(self, skipped: np.ndarray) -> dict:
        """Skipped steps, final/min/max scale, and how long the scale took to recover after the first overflow."""
        scales = np.asarray(self.scales, dtype=np.float64)
        init = float(np.float32(2.0 ** self.init_log2.value))
        recovery = None
        if skipped.any():
            first = int(np.argmax(skipped))
            before = scales[first - 1] if first > 0 else init
            later = np.nonzero(scales[first:] >= before)[0]
            recovery = int(later[0]) if later.size else None
        return {"skipped": int(skipped.sum()), "final_scale": float(scales[-1]) if scales.size else init,
                "min_scale": float(scales.min(initial=init)), "max_scale": float(scales.max(initial=init)),
                "recovery_steps": recovery}

    def _summary_html(self) -> str:
        """The summary as a small table."""
        s = self.summary
        rec = "never (within the run)" if s["recovery_steps"] is None and s["skipped"] else (
            "no overflow" if s["recovery_steps"] is None else _plural(s["recovery_steps"], "step"))
        rows = [("skipped steps", f"{s['skipped']}"), ("final scale", f"{s['final_scale']:.6g}"),
                ("min / max scale", f"{s['min_scale']:.3g} / {s['max_scale']:.3g}"),
                ("back to the pre-overflow scale after the first overflow", rec)]
        return "<table>" + "".join(f"<tr><td>{k}</td><td>{v}</td></tr>" for k, v in rows) + "</table>"


def scaler_simulator(steps: int = 6000, probability: float = 5e-4, burst: str = "3000-3005", seed: int = 0) -> ScalerSimulator:
    """GradScaler's scale trajectory for chosen settings and an overflow pattern (simulate_scale, drawn live)."""
    return ScalerSimulator(steps, probability, burst, seed)
