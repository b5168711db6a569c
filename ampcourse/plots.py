"""Static matplotlib figures used by the chapters (the interactive ones live in widgets)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from . import formats

__all__ = ["bit_layouts", "ulp_staircase", "relative_error"]

FIELD_COLORS = {"sign": "#d62728", "exponent": "#1f77b4", "mantissa": "#2ca02c"}


def bit_layouts(fmts=("fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2")) -> plt.Figure:
    """One row of coloured boxes per format: sign, exponent and mantissa bits to scale."""
    specs = [formats.spec(f) for f in fmts]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(specs) + 0.6), dpi=80)
    for row, f in enumerate(specs):
        y = len(specs) - 1 - row
        start = 0
        for field, width in (("sign", 1), ("exponent", f.exponent_bits), ("mantissa", f.mantissa_bits)):
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


def ulp_staircase(fmts=("fp16", "bf16", "fp32"), lo: float = 2.0**-26, hi: float = 2.0**17) -> plt.Figure:
    """The gap to the next representable value (ulp) across magnitudes, one staircase per format."""
    x = np.geomspace(lo, hi, 2000)
    fig, ax = plt.subplots(figsize=(7, 3.2), dpi=80)
    for f in fmts:
        spec = formats.spec(f)
        u = np.array([formats.ulp(v, spec) for v in x])
        ax.step(x, u, where="post", label=spec.name)
    ax.set(xscale="log", yscale="log", xlabel="|x|", ylabel="spacing to the next value (ulp)",
           title="Precision shrinks as magnitude grows; below the normals it stops shrinking")
    ax.axvline(formats.spec("fp16").min_normal, color="grey", ls=":", lw=1)
    ax.axvline(formats.spec("fp16").max, color="grey", ls="--", lw=1)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def relative_error(fmts=("fp16", "bf16"), lo: float = 1e-9, hi: float = 1e6, n: int = 4000, seed: int = 0) -> plt.Figure:
    """Relative rounding error of random values across magnitudes: flat for normals, rising for subnormals."""
    rng = np.random.default_rng(seed)
    x = np.exp(rng.uniform(np.log(lo), np.log(hi), n))
    fig, ax = plt.subplots(figsize=(7, 3.2), dpi=80)
    for f in fmts:
        with np.errstate(invalid="ignore"):
            err = np.abs(formats.quantize(x, f) - x) / x
        err = np.where(np.isfinite(err), err, np.nan)
        ax.scatter(x, np.clip(err, 1e-12, 1), s=2, label=formats.spec(f).name)
    ax.set(xscale="log", yscale="log", xlabel="|x|", ylabel="relative error", ylim=(1e-6, 1.5))
    ax.axvline(formats.spec("fp16").min_normal, color="grey", ls=":", lw=1)
    ax.axvline(formats.spec("fp16").max, color="grey", ls="--", lw=1)
    ax.legend(fontsize=8, markerscale=4)
    fig.tight_layout()
    return fig
