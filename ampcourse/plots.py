"""Static matplotlib figures used by the chapters (chapters 1-10; the interactive ones live in widgets)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from . import formats

__all__ = ["hidpi_figures", "FIGURE_FORMAT", "bit_layouts", "ulp_staircase", "relative_error", "gradient_histogram", "scale_trajectories",
           "loss_curves", "training_monitor", "legend_outside", "shade_zones", "format_zones", "zone_names", "has_zero", "log2_window"]

FIELD_COLORS = {"sign": "#d62728", "exponent": "#1f77b4", "mantissa": "#2ca02c"}

#: How a Jupyter kernel shows static figures, course-wide: "retina" renders a figure at twice its dots per inch
#: and shows it at its own size (width and height in the output's metadata), so it is sharp on a HiDPI screen;
#: the inline backend's default, "png", is 1x and blurry there. The widgets draw at 2x themselves (widgets/figure.py).
FIGURE_FORMAT = "retina"


def hidpi_figures(fmt: str = FIGURE_FORMAT) -> bool:
    """Show static figures of this Jupyter kernel at 2x pixels; False (nothing changed) outside a kernel.

    Run when ``ampcourse.plots`` is imported, and by ``import ampcourse`` in a kernel that has pyplot loaded,
    so every chapter's figures are sharp without a line of its own. A notebook can still choose another
    format with ``%config InlineBackend.figure_formats = ["png"]``.

    Args:
        fmt: an inline figure format ("retina", "png", "svg", ...).

    Example:
        >>> hidpi_figures()  # in a script: no kernel, nothing to do
        False
    """
    import sys

    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if getattr(shell, "kernel", None) is None:  # a script, pytest, a plain IPython terminal
        return False
    try:
        from matplotlib_inline.backend_inline import set_matplotlib_formats
    except ImportError:  # an old or other front end: leave it as it is
        return False
    set_matplotlib_formats(fmt)
    return True


hidpi_figures()


def _sixteen_bit() -> tuple[str, ...]:
    """The 16-bit formats of the registry (fp16, bf16): the ones AMP chooses between."""
    return tuple(n for n in formats.names() if formats.spec(n).bits == 16)


def bit_layouts(fmts=None) -> plt.Figure:
    """One row of coloured boxes per format: sign, exponent and mantissa bits to scale (default: formats.names()).

    Only the fields a format has are drawn: e8m0 is 8 exponent bits, with no sign and no mantissa.
    """
    specs = [formats.spec(f) for f in (formats.names() if fmts is None else fmts)]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(specs) + 0.6), dpi=80)
    for row, f in enumerate(specs):
        y = len(specs) - 1 - row
        start = 0
        for field, width in (("sign", int(f.signed)), ("exponent", f.exponent_bits), ("mantissa", f.mantissa_bits)):
            if not width:  # a field the format does not have (e8m0: no sign, no mantissa): no box, no "0" label
                continue
            ax.barh(y, width, left=start, color=FIELD_COLORS[field], edgecolor="white", height=0.7)
            ax.text(start + width / 2, y, str(width), ha="center", va="center", color="white", fontsize=9)
            start += width
        ax.text(-0.5, y, f.name, ha="right", va="center", fontsize=10)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in FIELD_COLORS.values()]
    ax.legend(handles, [f"{k} bits" for k in FIELD_COLORS], ncol=3, loc="lower right", fontsize=8, frameon=False,
              bbox_to_anchor=(1, 1))
    ax.set_xlim(-6, 32)
    ax.axis("off")
    fig.tight_layout()
    return fig


def ulp_staircase(fmts=None, lo: float = 2.0**-26, hi: float = 2.0**17) -> plt.Figure:
    """The gap to the next representable value (ulp) across magnitudes, one staircase per format (default: the
    16-bit formats and fp32)."""
    fmts = (*_sixteen_bit(), "fp32") if fmts is None else fmts
    x = np.geomspace(lo, hi, 2000)
    fig, ax = plt.subplots(figsize=(8, 3.4), dpi=80, layout="constrained")
    for f in fmts:
        spec = formats.spec(f)
        u = np.array([formats.ulp(v, spec) for v in x])
        ax.step(x, u, where="post", label=spec.name)
    ax.set(xscale="log", yscale="log")
    # Readable at the figure's size: 10-11 pt (11-12 px at 80 dpi), and every line named, the guides included
    ax.set_xlabel("|x|", fontsize=11)
    ax.set_ylabel("spacing to the next value (ulp)", fontsize=11)
    ax.set_title("The gap grows with magnitude; below the normals it stops shrinking", fontsize=11, loc="left")
    ax.tick_params(labelsize=10)
    f16 = formats.spec("fp16")
    ax.axvline(f16.min_normal, color="grey", ls=":", lw=1.2, label=f"fp16 min normal\n(2**{f16.emin})")
    ax.axvline(f16.max, color="grey", ls="--", lw=1.2, label=f"fp16 max\n({f16.max:g})")
    ax.legend(fontsize=10, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, frameon=False)
    return fig


def relative_error(fmts=None, lo: float = 1e-9, hi: float = 1e6, n: int = 4000, seed: int = 0) -> plt.Figure:
    """Relative rounding error of random values across magnitudes: flat for normals, rising for subnormals
    (default: the 16-bit formats)."""
    fmts = _sixteen_bit() if fmts is None else fmts
    rng = np.random.default_rng(seed)
    x = np.exp(rng.uniform(np.log(lo), np.log(hi), n))
    fig, ax = plt.subplots(figsize=(7, 3.2), dpi=80, layout="constrained")
    for f in fmts:
        with np.errstate(invalid="ignore"):
            err = np.abs(formats.quantize(x, f) - x) / x
        err = np.where(np.isfinite(err), err, np.nan)
        ax.scatter(x, np.clip(err, 1e-12, 1), s=2, label=formats.spec(f).name)
    ax.set(xscale="log", yscale="log", xlabel="|x|", ylabel="relative error", ylim=(1e-6, 1.5))
    ax.axvline(formats.spec("fp16").min_normal, color="grey", ls=":", lw=1)
    ax.axvline(formats.spec("fp16").max, color="grey", ls="--", lw=1)
    legend_outside(ax, markerscale=4)
    return fig


# -- loss scaling (chapter 6) ------------------------------------------------------------------------

ZONE_COLORS = {"underflow": "#9e9e9e", "clamped up": "#7f7f7f", "subnormal": "#f4a259", "normal": "#8cc084",
               "overflow": "#d62728", "saturated": "#9467bd"}


def has_zero(fmt="fp16") -> bool:
    """Whether fmt can store 0, asked of ``formats.quantize`` (e8m0 cannot: its tiny values are clamped up instead).

    Args:
        fmt: a format name, alias, torch dtype or FormatSpec.

    Example:
        >>> has_zero("fp16"), has_zero("fp8_e8m0")
        (True, False)
    """
    return bool(formats.quantize([0.0], fmt)[0] == 0.0)


def zone_names(fmt="fp16") -> tuple[str, str]:
    """What fmt does below its smallest value and past its largest, as zone names: (bottom, top).

    Read from ``formats``: "underflow" (flush to zero) unless the format has no zero ("clamped up" to its smallest
    value, e8m0); "saturated" (clamped to +-max) where ``spec(fmt).saturates`` (e4m3, fp6, fp4), else "overflow".

    Args:
        fmt: a format name, alias, torch dtype or FormatSpec.

    Example:
        >>> zone_names("fp16"), zone_names("fp8_e4m3"), zone_names("fp8_e8m0")
        (('underflow', 'overflow'), ('underflow', 'saturated'), ('clamped up', 'overflow'))
    """
    bottom = "underflow" if has_zero(fmt) else "clamped up"
    return bottom, ("saturated" if formats.spec(fmt).saturates else "overflow")


def format_zones(fmt="fp16") -> list[tuple[str, float, float]]:
    """The underflow, subnormal, normal and overflow zones of a format as (name, lo, hi) in log2|x|.

    The first and last are named by ``zone_names``: a saturating format's top zone is "saturated", a zero-less
    format's bottom one "clamped up". A format without subnormals (e8m0) has an empty subnormal zone (lo == hi).
    """
    from .scaling import zone_thresholds

    flush, normal, over = (float(np.log2(t)) for t in zone_thresholds(fmt))
    bottom, top = zone_names(fmt)
    return [(bottom, -np.inf, flush), ("subnormal", flush, normal), ("normal", normal, over), (top, over, np.inf)]


def shade_zones(ax, fmt="fp16", label: bool = True, fontsize: float = 8) -> None:
    """Shade a log2 x-axis by what fmt does to values there (flush to zero, subnormal, normal, overflow).

    Labels never overprint or leave the axes: each is centred on its zone but kept inside the axes,
    and one that would touch the previous label drops to the next row (bf16's narrow subnormal zone).
    """
    lo, hi = ax.get_xlim()
    width_in = ax.get_position().width * ax.figure.get_figwidth()  # axes width in inches (before layout)
    rows_right: list[float] = []  # right edge (axes fraction) of the last label in each row
    for name, a, b in format_zones(fmt):
        a, b = max(a, lo), min(b, hi)
        if a >= b:
            continue
        ax.axvspan(a, b, color=ZONE_COLORS[name], alpha=0.18, lw=0)
        if not label:
            continue
        half = 0.62 * fontsize * len(name) / 72 / width_in / 2 + 0.005  # half the label's width, axes fraction
        centre = min(max(((a + b) / 2 - lo) / (hi - lo), half), 1 - half)
        row = next((r for r, right in enumerate(rows_right) if centre - half > right), len(rows_right))
        if row == len(rows_right):
            rows_right.append(0.0)
        rows_right[row] = centre + half
        ax.text(centre, 0.97 - 0.1 * row, name, transform=ax.transAxes, ha="center", va="top",
                fontsize=fontsize, color=ZONE_COLORS[name])
    ax.set_xlim(lo, hi)


def log2_window(fmt="fp16") -> tuple[float, float]:
    """A log2 x-range that shows all four zones of fmt with some margin."""
    f = formats.spec(fmt)
    return float(np.floor(np.log2(f.min_subnormal))) - 12, float(np.ceil(np.log2(f.max))) + 8


def gradient_histogram(values, fmt="fp16", log2_scales=(0,), bins_per_octave: int = 4) -> plt.Figure:
    """Histogram of log2|values * 2**k| for each k, on the zones of fmt, with the share in each zone."""
    from .scaling import range_counts

    v = np.abs(np.asarray(values, dtype=np.float64)).ravel()
    nz = v[(v > 0) & np.isfinite(v)]
    lo, hi = log2_window(fmt)
    edges = np.arange(lo, hi + 1e-9, 1 / bins_per_octave)
    bottom, top = zone_names(fmt)  # range_counts' "underflow"/"overflow" are these for fmt
    fig, axes = plt.subplots(len(log2_scales), 1, figsize=(7, 1.9 * len(log2_scales) + 0.5), dpi=80,
                             sharex=True, squeeze=False)
    for ax, k in zip(axes[:, 0], log2_scales):
        counts, _ = np.histogram(np.clip(np.log2(nz) + k, lo, hi - 1e-9), edges)
        ax.stairs(100 * counts / max(v.size, 1), edges, fill=True, color="#1f77b4", alpha=0.85)
        ax.set_xlim(lo, hi)
        shade_zones(ax, fmt)
        c = range_counts(v, 2.0**k, fmt)
        share = {n: 100 * c[n] / max(v.size, 1) for n in c}
        ax.set_ylabel("% of values")
        ax.set_title(f"loss scale 2^{k}: {share['underflow']:.1f}% {'flush to zero' if bottom == 'underflow' else bottom}, "
                     f"{share['subnormal']:.1f}% subnormal, {share['overflow']:.1f}% {top}", fontsize=9)
    axes[-1, 0].set_xlabel(f"log2 |gradient x scale|   (zones: {formats.spec(fmt).name})")
    fig.tight_layout()
    return fig


#: Where a loss scale of 0 is drawn on a log axis: log2(0) is -inf, which matplotlib drops with its markers. 2**-160
#: is below float32's smallest scale (2**-149), so it is the bottom of the plot and never a real scale.
ZERO_SCALE_LOG2 = -160.0


def _drawable_scales(scales) -> np.ndarray:
    """scales as float64 with 0 (a scale that collapsed) raised to 2**ZERO_SCALE_LOG2, so a log axis keeps it."""
    s = np.asarray(scales, dtype=np.float64)
    return np.where(s == 0, 2.0**ZERO_SCALE_LOG2, s)


def scale_trajectories(runs: dict[str, tuple[list[float], list[bool]]], title: str = "") -> plt.Figure:
    """log2(scale) over steps for several settings, skipped (overflow) steps marked with dots."""
    fig, ax = plt.subplots(figsize=(7, 3), dpi=80, layout="constrained")
    for label, (scales, overflows) in runs.items():
        steps = np.arange(1, len(scales) + 1)
        y = np.log2(_drawable_scales(scales))  # a zero scale's skipped steps drawn at the bottom, not dropped
        (line,) = ax.plot(steps, y, drawstyle="steps-post", label=label, lw=1.3)
        skipped = np.asarray(overflows, dtype=bool)
        ax.plot(steps[skipped], y[skipped], ".", color=line.get_color(), ms=5)
    ax.set(xlabel="step", ylabel="log2(scale)", title=title)
    legend_outside(ax)
    return fig


def legend_outside(ax, **kwargs) -> None:
    """A legend right of the axes (with a constrained layout the figure makes room): it never covers data."""
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, frameon=False, **kwargs)


# Lines that often coincide (fp32 and bf16 loss curves): the first wide and pale, the next dashed, the
# next dotted with markers, so each stays visible where another runs on top of it.
_OVERLAP_STYLES = [dict(lw=4.0, alpha=0.4, zorder=2), dict(lw=1.8, ls="--", zorder=3),
                   dict(lw=1.2, ls=":", marker="o", ms=3, zorder=4), dict(lw=1.0, ls="-.", zorder=5)]


def loss_curves(ax, runs: dict, key: str = "loss", steps_taken: bool = False) -> None:
    """Plot runs[name].<key> per step on ax, styled so that curves lying on top of each other all stay visible.

    Run i gets style i in every panel, so one run looks the same wherever it is drawn. With
    ``steps_taken`` only finite values of steps that were not skipped are drawn (a skipped step's
    gradient norm is inf or NaN and would break the line).
    """
    for i, (name, hist) in enumerate(runs.items()):
        style = dict(_OVERLAP_STYLES[i % len(_OVERLAP_STYLES)])
        values = list(getattr(hist, key))
        skipped = list(getattr(hist, "skipped", [])) if steps_taken else []
        steps = [k for k, v in enumerate(values)
                 if not steps_taken or (np.isfinite(v) and not (k < len(skipped) and skipped[k]))]
        if "marker" in style:
            style["markevery"] = max(len(steps) // 12, 1)
        ax.plot(steps, [values[k] for k in steps], label=name, **style)


def training_monitor(runs: dict, scaled: str = "fp16") -> plt.Figure:
    """Chapter 4's monitor: loss of every run, the loss scale of runs[scaled] with its skipped steps, gradient norms."""
    if scaled not in runs:
        raise ValueError(f"scaled must name one of the runs {list(runs)}, got {scaled!r}")
    h = runs[scaled]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4), dpi=80, layout="constrained")
    loss_curves(axes[0], runs)
    axes[0].set(xlabel="step", ylabel="loss", title="loss curves")
    axes[0].legend(fontsize=8)
    skipped = [k for k, s in enumerate(h.skipped) if s]
    scale = _drawable_scales(h.scale)  # a scale of 0 and its skipped steps stay on the log axis, at the bottom
    axes[1].semilogy(scale, drawstyle="steps-post", base=2, label="loss scale")
    axes[1].scatter(skipped, scale[skipped], color="C3", zorder=3, label="skipped step")
    axes[1].set(xlabel="step", ylabel="loss scale", title=f"{scaled} loss scale")
    axes[1].legend(fontsize=8)
    loss_curves(axes[2], runs, "grad_norm", steps_taken=True)  # same style per run as the loss panel
    axes[2].set(xlabel="step", ylabel="true gradient norm", title="gradient norm (steps taken)")
    axes[2].legend(fontsize=8)
    return fig
