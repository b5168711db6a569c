"""The numbers behind the loss-scale advice: from the fp32 gradients' log2 histograms, the recommended init_scale,
GradScaler's default after its backoffs, and the shares of gradients fp16 flushes at each; a prediction kept
consistent with what the fp16 backwards measured (:func:`bounded_by_measured`). :mod:`.rules` turns them into
findings, :mod:`.core` replaces predictions with measurements where it has them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from .. import formats
from ..scaling import zone_thresholds
from .hist import Log2Hist
from .passes import Context, PassResult

GRAD_MARGIN = 8.0  # the recommended scale keeps max|grad| x scale this many times below fp16's max
DEFAULT_SCALE = 2.0**16  # torch.amp.GradScaler's init_scale


def _owner(name: str) -> str:
    """The module that holds a parameter: 'blocks.0.lin' for 'blocks.0.lin.weight'."""
    return name.rpartition(".")[0]


def _ran_fp16(fp16: PassResult | None, module: str) -> bool:
    """Whether autocast ran `module` in fp16 in that pass (True when there is no pass or no record to ask)."""
    return fp16 is None or fp16.records.get(module) is None or fp16.records[module].dtype.get("fp16") == "float16"


def param_flush_share(ctx: Context, fp16: PassResult | None, scale: float) -> float:
    """The share of the fp32 parameter gradients (of layers autocast ran in fp16) that fp16 flushes at `scale`,
    predicted from their histograms: the population the fp16 backwards measure, parameter by parameter (module
    outputs' gradients, which gradient_info's aggregate also counts, flush more and are not what a step applies)."""
    hists = [h for n, h in ctx.param_grads.items() if _ran_fp16(fp16, _owner(n))]
    return Log2Hist.merged(hists)._share("underflow", scale) if hists else 0.0


def bounded_by_measured(predicted: float, scale: float, measured: Sequence[tuple[float, float]]) -> float:
    """A predicted flushed share at `scale` kept consistent with shares measured at other scales: a larger scale never
    flushes more (nor a smaller one less) than a measured one.

    Example::

        >>> bounded_by_measured(0.2656, 2.0**16, [(1.0, 0.158), (2.0**19, 0.0)])  # between: at most scale 1's
        0.158
    """
    lo, hi = 0.0, 1.0
    for s, share in measured:
        if scale >= s:
            hi = min(hi, share)
        if scale <= s:
            lo = max(lo, share)
    return min(max(predicted, lo), hi) if lo <= hi else predicted


def gradient_info(ctx: Context, fp16: PassResult | None = None) -> tuple[dict[str, Any], float]:
    """The numbers behind the loss-scale advice, from the fp32 gradients, and the recommended init_scale.

    With the fp16 pass given, the flushed shares count only the layers that autocast ran in fp16 (an Embedding's,
    or on CUDA a LayerNorm's, outputs and gradients stay fp32 under autocast: they lose nothing to fp16).
    """
    def ran_low(module: str) -> bool:
        return _ran_fp16(fp16, module)
    hists = [h for n, h in ctx.param_grads.items() if ran_low(_owner(n))]
    hists += [ctx.records[n].grad for n in ctx.order if ctx.records[n].leaf and ran_low(n)]
    total = Log2Hist.merged(hists)
    everything = Log2Hist.merged([*ctx.param_grads.values(), *(ctx.records[n].grad for n in ctx.order
                                                                if ctx.records[n].leaf)])
    gmax, nonzero = everything.max, everything.nonzero
    info: dict[str, Any] = {"max": gmax, "nonzero": nonzero, "nonfinite": everything.nonfinite, "margin": GRAD_MARGIN}
    if nonzero == 0:
        return info, DEFAULT_SCALE
    fmax = formats.spec("fp16").max
    over = zone_thresholds("fp16")[2]
    scale = 2.0 ** max(-126, min(126, math.floor(math.log2(fmax / (gmax * GRAD_MARGIN))))) if gmax > 0 else DEFAULT_SCALE
    backoffs, s = 0, DEFAULT_SCALE
    while gmax * s >= over and backoffs < 300:  # what GradScaler(init_scale=2**16) does: skip, halve, try again
        s, backoffs = s / 2, backoffs + 1
    info.update(flush_at_1=total._share("underflow", 1.0), recommended_scale=scale,
                flush_at_recommended=total._share("underflow", scale), flush_at_default=total._share("underflow", s),
                default_backoff_steps=backoffs,
                largest_scale_without_overflow=2.0 ** math.floor(math.log2(fmax / gmax)) if gmax > 0 else math.inf,
                bf16_flush_at_1=total._share("underflow", 1.0, "bf16"),
                params={n: {"max": h.max, "flush_at_1": h._share("underflow", 1.0),
                            "flush_at_recommended": h._share("underflow", scale)} for n, h in ctx.param_grads.items()})
    worst = max(((n, h) for n, h in ctx.param_grads.items() if ran_low(_owner(n))),
                key=lambda kv: kv[1]._share("underflow"), default=None)
    if worst is not None:
        info["worst_param"] = (worst[0], worst[1]._share("underflow"))
    return info, scale
