"""Findings rules: each turns the measured :class:`Evidence` into findings, and every rule has the same shape::

    def rule(ev: Evidence) -> list[Finding]

:data:`RULES` lists them in the order they run. Thresholds live here, each with what it is calibrated on.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .. import formats
from ..scaling import zone_thresholds
from .audit import BLOWUP_RATIO, LOST_WARN, second_moment_threshold  # noqa: F401 (thresholds live there)
from .hist import Log2Hist
from .passes import Context, PassResult
from .report import Finding, quoted
# the loss-scale numbers have their own file; rules and core read them here, as before
from .scales import (DEFAULT_SCALE, GRAD_MARGIN, _owner, _ran_fp16, bounded_by_measured,  # noqa: F401
                     gradient_info, param_flush_share)
from .vocab import Quoted
from .watch import OpEvent

#: A module's own relative error under autocast (a leaf's output against the same module rerun in fp32 on the same,
#: already-rounded inputs; a non-leaf module's with its children exact, see watch.Tracker._inline_error) that counts
#: as precision loss: 8 eps (fp16 ~0.8%, bf16 ~6%). eps is the format's spacing at
#: 1 (2**-10, 2**-7); the rounding unit is u = eps/2. Calibration, measured by tests/doctor/test_doctor.py::
#: test_rel_tol_is_calibrated_on_linear_layers: an nn.Linear's own error is 0.2-0.4 eps in both formats (the output
#: rounding once, relative RMS ~ u/sqrt(3) ~ 0.3 eps), so 8 eps is 20-40x a healthy layer's.
REL_TOL = {p: 8 * formats.spec(p).eps for p in ("fp16", "bf16")}
#: The final output's relative error against fp32 (same inputs, same dropout masks) beyond which the output is a
#: finding, whatever the modules say one by one: 32 eps (fp16 ~3%, bf16 ~25%).
OUTPUT_TOL = {p: 32 * formats.spec(p).eps for p in ("fp16", "bf16")}
#: The loss's relative gap from fp32 beyond which it is a finding (a planted inline RMSNorm: 12%).
LOSS_TOL = {"fp16": 0.02, "bf16": 0.05}
#: The relative error of all parameter gradients together (after unscaling) against fp32's beyond which it is a finding.
#: Deep healthy models are far from 0 here (a ResNet-18 layout with BatchNorm at batch 4 measured 0.18 in fp16), so
#: the bar is where the gradient stops pointing the fp32 way: half its norm in fp16, its whole norm in bf16.
GRAD_TOL = {"fp16": 0.5, "bf16": 1.0}
#: A parameter whose fp32 gradient norm is below this share of the largest parameter's is left out of the per-parameter
#: gradient check: its relative error measures rounding noise (a bias before a norm has a true gradient of 0).
GRAD_PARAM_SHARE = 2.0**-10
MAX_PARAM_FINDINGS = 3  # per precision, the worst parameters named one by one; the rest counted


def headroom(gmax: float, scale: float, fmax: float = 65504.0) -> str:
    """How far max|grad| x scale stays below fmax, as measured, and the margin the recommendation asks for.

    Example::

        >>> headroom(0.0649, 2.0**16)
        '15.4x (at least 8x asked)'
    """
    if not gmax or not math.isfinite(gmax):
        return f"at least {GRAD_MARGIN:g}x"
    return f"{fmax / (gmax * scale):.3g}x (at least {GRAD_MARGIN:g}x asked)"
UNDERFLOW_WARN = 0.01  # warn when more than 1% of the nonzero gradients flush to zero
SECOND_MOMENT_WARN = 0.5  # warn when more than half of Adam's second moment is zero in a low-precision state
LAYER_UNDERFLOW_WARN = 0.5  # name a parameter that loses more than half of its gradient, however small the aggregate
#: A parameter gradient whose norm is below this share of all gradients' norm is fp32 rounding noise (fp32's eps).
NOISE = 2.0**-23
MAX_ISLANDS = 4  # more fp32 modules than this, and fp16 is not worth it: use bf16 or fp32
_LOW = formats.AUTOCAST_DTYPES  # one home: ampcourse.formats


@dataclass
class Evidence:
    """Everything examine() measured, which the rules read."""

    ctx: Context
    precisions: tuple[str, ...]
    passes: dict[str, PassResult] = field(default_factory=dict)  # the first pass per precision (no islands)
    verdicts: dict[str, dict[str, Any]] = field(default_factory=dict)
    audit: dict[str, Any] | None = None
    gradients: dict[str, Any] = field(default_factory=dict)
    scale: float = DEFAULT_SCALE
    model_dtype: torch.dtype | None = None  # the model's own floating dtype when not float32
    low_trainable: str | None = None  # "fp16"/"bf16" when what trains is in that format (core.trainable_format)
    #: per parameter, the share of its fp32-nonzero gradient an fp16 backward at scale 1 gave back as zero
    flushed_at_1: dict[str, float] = field(default_factory=dict)


def tolerances(precision: str) -> dict[str, float]:
    """The relative tolerances a "clean" verdict of precision allows, as the report prints them: each module's own
    error, the final output's, the loss's, and the gradients' (all parameters together, and each one's).

    Example::

        >>> tolerances("bf16")["output"]   # 32 eps of bf16: a forward that drifts less is not a finding
        0.25
    """
    return {"module": REL_TOL[precision], "output": OUTPUT_TOL[precision], "loss": LOSS_TOL[precision],
            "gradients": GRAD_TOL[precision]}


# -- what a pass shows ------------------------------------------------------------------------------------------

def new_origins(ev_ctx: Context, res: PassResult, phase: str) -> list[OpEvent]:
    """inf/NaN origins of a pass in one phase that the fp32 reference did not have."""
    mine = [e for e in res.watch.origins if e.phase == phase]
    if not mine:
        return []
    ref = {e.key for e in ev_ctx.reference_watch().origins}
    return [e for e in mine if e.key not in ref]


def own_tolerance(res: PassResult, module: str) -> float:
    """The own-error tolerance of a module in this pass: REL_TOL for a leaf (one op's rounding, calibrated on
    nn.Linear); for inline code, REL_TOL x sqrt(the fp16/bf16 compute ops it runs in one call), since independent
    roundings add up like a random walk (healthy inline code of three bf16-rounded ops measured 0.009-0.012 in fp16,
    against 0.0078 for one op)."""
    p = res.precision
    if res.records[module].leaf:
        return REL_TOL[p]
    ops = max((k for (m, _), k in res.watch.inline_low.items() if m == module), default=1)
    return REL_TOL[p] * math.sqrt(max(1, ops))


def lossy_modules(ctx: Context, res: PassResult) -> list[str]:
    """Modules whose own relative error exceeds their tolerance (not counting inf/NaN ones): a leaf's, or a non-leaf
    module's inline code (measured with its children exact, see watch.Tracker._inline_error)."""
    p = res.precision
    return [n for n in ctx.order if res.records[n].nonfinite.get(p, 0) == 0
            and res.records[n].local_error.get(p, 0.0) > own_tolerance(res, n)]


def inline_op(res: PassResult, module: str) -> str:
    """The first inline op of a non-leaf module whose own output is beyond REL_TOL against fp32 (where the error
    appears: the ops before it were within tolerance), or "" when no single op is."""
    p = res.precision
    tol = own_tolerance(res, module)
    return next((op for op, err in res.records[module].inline_ops.get(p, []) if err > tol), "")


def grad_error(res: PassResult) -> tuple[float, str]:
    """All gradients' relative error against fp32 (one norm over every parameter), and the worst parameter."""
    num = sum(g["num"] ** 2 for g in res.grads.values() if math.isfinite(g["num"]))
    den = sum(g["den"] ** 2 for g in res.grads.values())
    if any(not math.isfinite(g["num"]) for g in res.grads.values()):
        return math.inf, next(n for n, g in res.grads.items() if not math.isfinite(g["num"]))
    worst = max(res.grads, key=lambda n: res.grads[n]["num"], default="")
    return (math.sqrt(num / den) if den else 0.0), worst


def bad_gradients(res: PassResult) -> list[tuple[str, float]]:
    """(parameter, relative error) of each parameter whose own gradient in this pass is further from fp32's than
    GRAD_TOL, worst first: however small its share of all gradients, since that parameter trains on it. Left out: inf/NaN
    gradients (the backward rules' findings) and gradients negligible beside the largest (GRAD_PARAM_SHARE)."""
    p = res.precision
    top = max((g["den"] for g in res.grads.values() if math.isfinite(g["den"])), default=0.0)
    bad = [(n, g["error"]) for n, g in res.grads.items()
           if not g["nonfinite"] and top > 0 and g["den"] >= top * GRAD_PARAM_SHARE and g["error"] > GRAD_TOL[p]]
    return sorted(bad, key=lambda b: -b[1])


def custom_backwards(ctx: Context, res: PassResult) -> list[str]:
    """Modules whose call made a custom autograd.Function node in this pass: backward code no forward measure sees."""
    return [n for n in ctx.order if n in res.records and res.records[n].custom_backward]


def inline_ancestors(ctx: Context, res: PassResult, params: Sequence[str]) -> list[str]:
    """The modules that hold these parameters' modules and run fp16/bf16 ops inline, nearest first: their inline
    code's backward (a softmax saturated by large logits, say) is where those gradients pass first. Not the model
    itself: an island on it is fp32 training."""
    inline = {m for (m, _), n in res.watch.inline_low.items() if n}
    out: list[str] = []
    for name in params:
        owner = _owner(name)
        while owner:
            owner = owner.rpartition(".")[0] if "." in owner else ""
            if owner and owner in inline and owner not in out:
                out.append(owner)
                break
    return out


def inline_downstream(ctx: Context, res: PassResult, params: Sequence[str]) -> list[str]:
    """The first module after these parameters' modules (in the order modules finish) that runs fp16/bf16 ops
    inline: when no module holding them does, their gradients come back through what reads their outputs, and the
    nearest inline low-precision code on that way is the suspect (a tiny Llama's attention q @ k.T at 6e4, where
    bf16's spacing is 256: its softmax's backward is no longer saturated, and the gradients of the RMSNorm and the
    embedding before it come back 75-172x fp32's). [] when nothing runs inline after them. Not the model itself."""
    inline = {m for (m, _), n in res.watch.inline_low.items() if n}
    owners = {_owner(n) for n in params}
    pos = {m: i for i, m in enumerate(ctx.order)}
    last = max((pos[m] for m in owners if m in pos), default=None)
    if last is None:
        return []
    return next(([m] for m in ctx.order[last + 1:] if m and m in inline), [])


def gradient_suspects(ctx: Context, res: PassResult) -> list[str]:
    """Where to look when gradients are off with nothing wrong in forward: custom backwards, then the inline code
    nearest the parameters whose gradients are off (a module holding them, else the first one after them)."""
    bad = [n for n, _ in bad_gradients(res)]
    if not bad:
        return []
    near = custom_backwards(ctx, res) + inline_ancestors(ctx, res, bad)
    return list(dict.fromkeys(near or inline_downstream(ctx, res, bad)))


def output_error(ctx: Context, res: PassResult) -> float:
    """The model's final output's relative error against fp32 (sampled, same positions)."""
    return res.records[""].output_error.get(res.precision, 0.0) if "" in res.records else 0.0


def loss_gap(ctx: Context, res: PassResult) -> float:
    """|loss - fp32 loss| / |fp32 loss| (inf when one is not finite and the other is)."""
    a, b = res.loss, ctx.ref_loss
    if not (math.isfinite(a) and math.isfinite(b)):
        return 0.0 if math.isfinite(a) == math.isfinite(b) else math.inf
    return abs(a - b) / max(abs(b), 1e-12)


def culprits(ctx: Context, res: PassResult) -> list[str]:
    """Modules to try in fp32: where inf/NaN start (forward, then backward) and leaves beyond REL_TOL; "" when the
    cause is the model's own top-level code or the loss (no island can fix that)."""
    out = [e.module for e in new_origins(ctx, res, "forward")[:1]]
    out += [e.module for e in new_origins(ctx, res, "backward")[:1]]
    out += lossy_modules(ctx, res)
    if not out and bad_gradients(res):
        # gradients off with nothing wrong in forward: the backward code that no forward measure sees is the suspect
        out += gradient_suspects(ctx, res)
    if not out and output_error(ctx, res) > OUTPUT_TOL[res.precision]:
        # no module's own error explains a wrong output: a module that amplifies the small error of its input (a
        # BatchNorm subtracting the mean of values near 300, where fp16's spacing is 0.25) makes it; the leaf that
        # ran before it in low precision, in fp32, hands it an exact input
        out += amplified_input(ctx, res)
    if not out and output_loses_the_loss(ctx, res):
        # the output is within its tolerance, but the loss (its distance from the targets) is not, even computed in
        # fp32: the last module that made a low-precision output is where that error was made
        out += last_low_leaf(ctx, res)
    return list(dict.fromkeys(out))


def loss_gap_in_fp32(ctx: Context, res: PassResult) -> float:
    """The loss gap left when the learner's loss runs in fp32 on this pass's output (nan: not measured)."""
    a, b = res.loss_fp32_on_output, ctx.ref_loss
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.nan
    return abs(a - b) / max(abs(b), 1e-12)


def output_loses_the_loss(ctx: Context, res: PassResult) -> bool:
    """The loss is beyond its tolerance and stays there computed in fp32 on the pass's output: the output's own error,
    small next to the output (an offset of 100 with bf16's spacing 0.5 there), is large next to what the loss measures
    (its distance from the targets). Computing the loss in fp32 cannot fix that."""
    p = res.precision
    return loss_gap(ctx, res) > LOSS_TOL[p] and loss_gap_in_fp32(ctx, res) > LOSS_TOL[p]


def amplified_input(ctx: Context, res: PassResult) -> list[str]:
    """[the low-precision leaf that ran just before the first leaf whose output is beyond the output tolerance while
    its own error (on the same inputs) is within its own]: that leaf amplified its input's error (cancellation), and
    its input came from there. Empty when no recorded output shows it (outputs are sampled for the model's direct
    children) or nothing low ran before it."""
    pair = amplifier(ctx, res)
    return [pair[1]] if pair else []


def amplifier(ctx: Context, res: PassResult) -> tuple[str, str] | None:
    """(the amplifying leaf, the low-precision leaf that ran before it) for :func:`amplified_input`, or None."""
    p, low = res.precision, {"float16", "bfloat16"}
    before = ""
    for n in ctx.order:
        rec = res.records[n]
        if not (n and rec.leaf):
            continue
        err = rec.output_error.get(p)
        if before and err is not None and err > OUTPUT_TOL[p] and rec.local_error.get(p, 0.0) <= own_tolerance(res, n):
            return n, before
        if rec.dtype.get(p) in low:
            before = n
    return None


def last_low_leaf(ctx: Context, res: PassResult) -> list[str]:
    """[the last leaf, in call order, whose output autocast made fp16/bf16] (empty when none did)."""
    low = {"float16", "bfloat16"}
    leaves = [n for n in ctx.order if n and res.records[n].leaf and res.records[n].dtype.get(res.precision) in low]
    return leaves[-1:]


def pass_ok(ctx: Context, res: PassResult) -> bool:
    """Nothing to fix in this pass: no new inf/NaN, no lossy leaf, output, loss and gradients within tolerance."""
    p = res.precision
    return (not culprits(ctx, res) and loss_gap(ctx, res) <= LOSS_TOL[p] and output_error(ctx, res) <= OUTPUT_TOL[p]
            and (not res.grads or (grad_error(res)[0] <= GRAD_TOL[p] and not bad_gradients(res))))


# -- the rules ---------------------------------------------------------------------------------------------------

def fp32_nonfinite_grads(ctx: Context) -> dict[str, int]:
    """Parameters whose fp32 reference gradient has inf/NaN, with how many (from the histograms the reference pass
    filled: no pass over the gradients again)."""
    return {n: h.nonfinite for n, h in ctx.param_grads.items() if h.nonfinite}


def fp32_fails(ctx: Context) -> bool:
    """The fp32 reference itself has an inf/NaN loss, module output or parameter gradient."""
    return (not math.isfinite(ctx.ref_loss) or any(r.act.nonfinite for r in ctx.records.values())
            or bool(fp32_nonfinite_grads(ctx)))


def reference_nonfinite(ev: Evidence) -> list[Finding]:
    """The fp32 run itself has inf/NaN, in its loss, a module's output or a parameter's gradient: not a precision
    problem, and nothing else can be trusted until it is fixed (no precision is blamed for it)."""
    ctx = ev.ctx
    bad = next((n for n in ctx.order if ctx.records[n].act.nonfinite), None)
    grads = fp32_nonfinite_grads(ctx)
    if math.isfinite(ctx.ref_loss) and bad is None and not grads:
        return []
    fix = ("not a precision problem: fix the model or its data first (mixed precision cannot be judged while fp32 "
           "is inf/NaN)")
    if not math.isfinite(ctx.ref_loss) or bad is not None:
        origin = next((e for e in ctx.ref_watch.origins if e.phase == "forward"), None) if ctx.ref_watch else None
        where = bad if bad is not None else (origin.module if origin else "")
        at = f" ({origin.op} in {origin.where})" if origin else ""
        return [Finding("nonfinite", where, "fp32", ctx.ref_loss,
                        f"{quoted(where) if where else 'The model'} is already inf/NaN in fp32{at} (loss "
                        f"{ctx.ref_loss}): {fix}", "error", "forward", origin.op if origin else "", fix="fp32_first")]
    origin = next((e for e in ctx.ref_watch.origins if e.phase == "backward"), None) if ctx.ref_watch else None
    first = next(iter(grads))
    at = (f"; the first op to make it is {origin.op} in {origin.where}" if origin else "")
    more = f" ({len(grads) - 1} more parameter(s) too)" if len(grads) > 1 else ""
    return [Finding("backward_nonfinite", first, "fp32", float(sum(grads.values())),
                    f"The fp32 loss is finite ({ctx.ref_loss:.4g}) but the fp32 gradient of {quoted(first)} has "
                    f"{grads[first]} inf/NaN value(s){more}{at} (if a torch.where guards that op, it does not stop "
                    f"the NaN of the branch it discards from flowing back): {fix}", "error", "backward",
                    origin.op if origin else "", fix="fp32_first")]


def _overflow_note(ctx: Context, e: OpEvent) -> str:
    """What the same op reached in fp32, when it passed fp16's max there."""
    ref = next((o for o in ctx.reference_watch().overflows if (o.module, o.call, o.op, o.index) == (e.module, e.call, e.op,
                                                                                          e.index)), None)
    return f"; in fp32 it reaches {ref.value:.3g}, above fp16's max 65504" if ref else ""


def forward_origins(ev: Evidence) -> list[Finding]:
    """The first op whose finite inputs give inf/NaN under autocast (fp32 finite): named by module and op."""
    out = []
    for p, res in ev.passes.items():
        new = new_origins(ev.ctx, res, "forward")
        if new:
            e = new[0]
            fix = ("compute the loss in fp32 (outside autocast, on .float() outputs)" if e.call < 0 and not e.module
                   else f"run {quoted(e.module)} in fp32 (an fp32 island) or use bf16" if e.module
                   else "keep this code in fp32 (wrap it in torch.autocast(..., enabled=False) on .float() inputs)")
            out.append(Finding("nonfinite", e.module, p, math.inf,
                               f"{e.where}: {e.op} turns finite inputs (max |x| {e.input_max:.3g}) into inf/NaN under "
                               f"{p} autocast (output {e.dtype}){_overflow_note(ev.ctx, e)}; it is the first op to "
                               f"do so ({len(new)} in all): {fix}", "error", "forward", e.op,
                               fix="loss_fp32" if e.call < 0 and not e.module else "islands" if e.module else ""))
        elif not math.isfinite(res.loss) and math.isfinite(ev.ctx.ref_loss):
            out.append(Finding("nonfinite", "", p, res.loss, f"The loss is {res.loss} under {p} autocast although no "
                               "op turned finite inputs into inf/NaN: compute the loss in fp32", "error", "forward",
                               fix="loss_fp32"))
    return out


def backward_origins(ev: Evidence) -> list[Finding]:
    """The first backward op whose finite inputs give inf/NaN (the forward may be clean): GradScaler would skip every
    step."""
    out = []
    for p, res in ev.passes.items():
        if new_origins(ev.ctx, res, "forward"):
            continue  # the backward of an inf/NaN forward follows from it
        new = new_origins(ev.ctx, res, "backward")
        fp32_bad = fp32_nonfinite_grads(ev.ctx)  # what fp32 already does is fp32's finding, not this precision's
        bad = {n: g["nonfinite"] for n, g in res.grads.items() if g["nonfinite"] and n not in fp32_bad}
        if fp32_bad and not bad:
            continue  # every inf/NaN gradient of this pass is one fp32 has too: fp32's finding, not this precision's
        scale = f" at loss scale 2**{int(math.log2(res.scale))}" if res.scale != 1 else ""
        if new:
            e = new[0]
            out.append(Finding("backward_nonfinite", e.module, p, math.inf,
                               f"{e.where}: {e.op} returns inf/NaN from finite inputs (max |x| {e.input_max:.3g}) in "
                               f"the {p} backward{scale}, though the forward is finite; {len(bad)} parameter "
                               f"gradient(s) are inf/NaN, so GradScaler would skip every step: run "
                               f"{quoted(e.module)} in fp32, or give a custom autograd.Function's backward fp32 inputs "
                               "(torch.amp.custom_fwd(device_type=..., cast_inputs=torch.float32))", "error",
                               "backward", e.op, fix="islands" if e.module else ""))
        elif bad:
            n = next(iter(bad))
            out.append(Finding("backward_nonfinite", n, p, float(sum(bad.values())),
                               f"{len(bad)} parameter gradient(s) are inf/NaN after the {p} backward{scale} (first "
                               f"{quoted(n)}): lower the loss scale or use bf16", "error", "backward"))
    return out


def _cause(ctx: Context, module: str) -> str:
    """An oversized weight in the module, when one stands out from the model's others (the cause of an overflow)."""
    try:
        mod = ctx.ref_model.get_submodule(module)
    except AttributeError:
        return ""
    own = [(n, float(p.detach().abs().max())) for n, p in mod.named_parameters(recurse=False) if p.numel()]
    others = sorted(float(p.detach().abs().max()) for n, p in ctx.ref_model.named_parameters()
                    if p.numel() and not n.startswith(f"{module}.") and p.is_floating_point())
    if not own or not others:
        return ""
    name, top = max(own, key=lambda x: x[1])
    typical = others[len(others) // 2]
    if top > 100 * typical:
        full = f"{module}.{name}" if module else name
        return (f"; the cause is visible: its weight {quoted(full)} reaches {top:.3g}, {top / typical:.3g}x the "
                f"typical max|w| {typical:.3g} of the model's other parameters")
    return ""


def activation_overflow(ev: Evidence) -> list[Finding]:
    """Module outputs beyond the format's largest value in fp32: the first such module, and its cause when visible."""
    ctx, out = ev.ctx, []
    for p, res in ev.passes.items():
        top = formats.spec(p).max
        over = [n for n in ctx.order if ctx.records[n].act.max > top]
        if not over:
            continue
        n = over[0]
        r = ctx.records[n]
        v = ev.verdicts.get(p, {})
        stayed = v.get("status") != "refused" and n not in v.get("tried_fp32_modules", [])
        share = r.act._share("overflow", 1.0, p)
        more = f" ({len(over) - 1} module(s) after it too)" if len(over) > 1 else ""
        dtype = res.records[n].dtype.get(p, "?") if n in res.records else "?"
        # An fp16 op that read them would have made an inf (a cast to fp16 saturates to inf): a pass with none, in
        # which the module itself gave fp32 (an island the learner kept, an op autocast keeps fp32), is fine as it is.
        harmless = stayed and dtype == "float32" and not getattr(res.watch, "seen_nonfinite", True)
        if harmless:
            tail, severity = (f"; it runs in fp32 here and no {p} op read them (none made an inf or NaN in this pass): "
                              "fine as it is, keep it in fp32"), "info"
        elif stayed:
            tail, severity = (f"; they stayed finite here (output {dtype}), but any {p} op that reads them overflows"
                              ": keep it and what reads it in fp32, or use bf16"), "warning"
        else:
            tail, severity = ": keep it and what reads it in fp32, or use bf16", "error"
        out.append(Finding("activation_overflow", n, p, r.act.max,
                           f"{Quoted(n)} outputs values up to {r.act.max:.4g} in fp32 ({share:.2%} of them "
                           f"above {p}'s max {top:g}){more}{_cause(ctx, n)}" + tail, severity,
                           "forward", fix="" if harmless else "islands"))
    return out


def precision_loss(ev: Evidence) -> list[Finding]:
    """Modules whose own error under autocast exceeds REL_TOL: a leaf's output, or the code a non-leaf module runs
    inline in its forward (its children exact)."""
    out = []
    for p, res in ev.passes.items():
        for n in lossy_modules(ev.ctx, res):
            err = res.records[n].local_error[p]
            sqnr = -20 * math.log10(err) if 0 < err < math.inf else math.inf
            leaf = res.records[n].leaf
            op = "" if leaf else inline_op(res, n)
            what = (f"The own output of {quoted(n)}" if leaf else
                    f"{Quoted(n)} (inline in forward): its own code's output"
                    + (f" (from {op} on)" if op else ""))
            keep = "keep that code in fp32 (torch.autocast(..., enabled=False) on .float() inputs)"
            fix = ("run it in fp32" if leaf else f"run {quoted(n)} in fp32 (an fp32 island), or {keep}" if n
                   else keep)  # an island on the whole model would be fp32 training
            out.append(Finding("precision_loss", n, p, err,
                               f"{what} under {p} autocast differs from fp32 on the same inputs by {err:.3g} "
                               f"(relative, SQNR {sqnr + 0.0:.1f} dB; tolerance {own_tolerance(res, n):.3g})"
                               + ("" if leaf else ", with its children run exactly") + f": {fix}",
                               "error" if err > 0.5 else "warning", "forward", op, fix="islands" if n else ""))
    return out


def output_and_loss(ev: Evidence) -> list[Finding]:
    """The final output's error and the loss gap: findings, never silently stored numbers."""
    out = []
    for p, res in ev.passes.items():
        err = output_error(ev.ctx, res)
        if err > OUTPUT_TOL[p]:
            pair = amplifier(ev.ctx, res) if not lossy_modules(ev.ctx, res) else None
            where = (f"; it appears at the output of {quoted(pair[0])}, whose own error on the same inputs is within "
                     f"its tolerance: it amplifies the small error of its input (a difference of near-equal numbers, "
                     f"as a normalisation subtracting a large mean): run {quoted(pair[1])}, which ran before it, in "
                     "fp32 (tried as an island), or take the offset out of the data") if pair else ""
            out.append(Finding("output_error", "", p, err,
                               f"The model's output under {p} autocast differs from fp32 by {err:.3g} (relative; "
                               f"tolerance {OUTPUT_TOL[p]:.3g}){where}", "warning", "forward", fix="islands"))
        gap = loss_gap(ev.ctx, res)
        if gap > LOSS_TOL[p]:
            # the output matches fp32 and the loss does not: the loss's own code lost it (a focal loss in bf16), unless
            # the loss computed in fp32 on this same output is still off: then the output lost what the loss measures
            via_output = err <= OUTPUT_TOL[p] and output_loses_the_loss(ev.ctx, res)  # else output_error says it
            in_loss = (err <= OUTPUT_TOL[p] and math.isfinite(res.loss) and not via_output
                       and not culprits(ev.ctx, res))
            why = ""
            if in_loss:
                why = ("; the model's output matches fp32 (within its tolerance), so the loss's own code lost it: "
                       "compute the loss in fp32 (outside autocast, on .float() outputs)"
                       + (f" (measured: {res.loss_fp32_on_output:.4g} then)"
                          if math.isfinite(res.loss_fp32_on_output) else ""))
            elif via_output:
                last = last_low_leaf(ev.ctx, res)
                why = (f"; computed in fp32 on this output the loss is still {res.loss_fp32_on_output:.4g} "
                       f"({loss_gap_in_fp32(ev.ctx, res):.1%} apart), so the loss's code is not what lost it: the "
                       f"output's own error ({err:.2g} relative) is small next to the output but large next to what "
                       "the loss measures, its distance from the targets (a large offset, a difference of near-equal "
                       "numbers): run the module that makes the output in fp32"
                       + (f" ({quoted(last[0])}, tried as an fp32 island)" if last else "")
                       + ", or take the offset out of the targets (normalise them)")
            out.append(Finding("loss_gap", "", p, gap,
                               f"The loss under {p} autocast is {res.loss:.4g} against {ev.ctx.ref_loss:.4g} in fp32 "
                               f"({gap:.1%} apart; tolerance {LOSS_TOL[p]:.0%})" + why, "warning", "forward",
                               fix="loss_fp32" if in_loss else "islands"))
    return out


def gradient_error(ev: Evidence) -> list[Finding]:
    """The gradients of one autocast backward against fp32's (after unscaling): each parameter whose own gradient is
    beyond GRAD_TOL (however small its share of the total), else all parameters together; and each suspect tried as
    an fp32 island (a custom autograd.Function's module, the inline code nearest the parameters), named with whether
    that island brought them back."""
    out = []
    for p, res in ev.passes.items():
        if not res.grads:
            continue
        # after an inf/NaN the gradients are its consequence, which the origin's own error finding names
        bad = [] if new_origins(ev.ctx, res, "forward") or new_origins(ev.ctx, res, "backward") else bad_gradients(res)
        shown = bad[:MAX_PARAM_FINDINGS]
        for i, (n, err) in enumerate(shown):
            w = res.grads[n]
            more = len(bad) - len(shown) if i == len(shown) - 1 else 0
            out.append(Finding("gradient_error", n, p, err,
                               f"The gradient of {quoted(n)} in one {p} backward differs from fp32's by {err:.3g} "
                               f"(relative: error norm {w['num']:.3g} against its fp32 norm {w['den']:.3g}; tolerance "
                               f"{GRAD_TOL[p]:.3g})" + (f"; so do {more} more parameter(s)" if more else ""),
                               "warning", "backward", fix="islands"))
        err, worst = grad_error(res)
        if not bad and math.isfinite(err) and err > GRAD_TOL[p]:
            w = res.grads[worst]
            out.append(Finding("gradient_error", worst, p, err,
                               f"The parameter gradients of one {p} backward differ from fp32's by {err:.3g} (relative, "
                               f"all parameters together; tolerance {GRAD_TOL[p]:.3g}); the largest share of it is "
                               f"{quoted(worst)} (error norm {w['num']:.3g} against its fp32 gradient norm {w['den']:.3g})", "warning",
                               "backward", fix="islands"))
        tried = ev.verdicts.get(p, {}).get("tried_fp32_modules", [])
        for m in (m for m in gradient_suspects(ev.ctx, res) if bad and m in tried):
            node = res.records[m].custom_backward
            fixed = ev.verdicts[p]["status"] == "islands"
            holds = any(_owner(n) == m or _owner(n).startswith(m + ".") for n, _ in bad)
            what = (f"{Quoted(m)} ({node} in backward): its custom backward is the one code the forward "
                    "measures cannot see" if node else
                    f"{Quoted(m)} (inline in forward, and its backward): the first code the gradients of "
                    "its parameters' modules pass through on their way back" if holds else
                    f"{Quoted(m)} (inline in forward, and its backward): the first fp16/bf16 code after those "
                    "parameters' modules in forward, which their gradients pass through on the way back")
            how = ("give the backward fp32 inputs (torch.amp.custom_fwd(device_type=..., cast_inputs=torch.float32), "
                   "or .float() in backward)" if node else "keep that code in fp32 (torch.autocast(..., "
                   "enabled=False) on .float() inputs)")
            out.append(Finding("gradient_error", m, p, bad[0][1],
                               f"{what}; the gradients are off ({quoted(bad[0][0])} by {bad[0][1]:.3g}) with nothing "
                               "wrong in forward; "
                               + (f"with {quoted(m)} in fp32 they match fp32: run it in fp32, or {how}" if fixed
                                  else f"{quoted(m)} in fp32 was tried and did not bring them back"),
                               "error" if fixed else "warning", "backward", fix="islands"))
    return out


def default_share_predicted(info: dict[str, Any]) -> bool:
    """Whether GradScaler's default flushed share is the fp32 histograms' prediction while the other shares were
    measured by fp16 backwards (at scale 1 and the recommended scale): then the report says it is predicted."""
    return "measured" in info and "flush_at_default_predicted" not in info


def default_is_recommended(info: dict[str, Any]) -> bool:
    """Whether GradScaler's default init_scale, after the backoffs it needs, is the recommended scale."""
    return DEFAULT_SCALE / 2.0 ** info.get("default_backoff_steps", 0) == info.get("recommended_scale")


def gradient_scale(ev: Evidence) -> list[Finding]:
    """Loss-scale advice from the fp32 gradients, per layer and in aggregate."""
    ctx, info, scale, out = ev.ctx, ev.gradients, ev.scale, []
    if not info.get("nonzero"):
        return out
    gmax, fmax = info["max"], formats.spec("fp16").max
    over = zone_thresholds("fp16")[2]
    k = int(math.log2(scale))
    low_params = ev.low_trainable == "fp16"  # GradScaler cannot unscale fp16 gradients (bf16 ones need none)
    if (info["nonfinite"] and not fp32_fails(ctx)) or (math.isfinite(gmax) and gmax >= over):
        out.append(Finding("gradient_overflow", "", "fp16", gmax,
                           f"Gradients reach {gmax:.4g} in fp32 ({info['nonfinite']} inf/NaN), beyond fp16's max {fmax:g} "
                           f"at scale 1: fp16 needs a scale below 1 (init_scale=2**{k}) or use bf16", "warning",
                           "backward", fix="scaler"))
    if "fp16" in ev.precisions:
        flush1, flush_rec, flush_default = info["flush_at_1"], info["flush_at_recommended"], info["flush_at_default"]
        # the fp16 backwards ran at scale 1 and at the recommended scale; the default's share, unless it is the
        # recommended one, is predicted from the fp32 gradients' histograms: say which
        default_share = f"{flush_default:.2%}" + (" (predicted from the fp32 gradients)"
                                                  if default_share_predicted(info) else "")
        backoffs = info["default_backoff_steps"]
        worst = info.get("worst_param")
        worst_txt = f" (worst parameter: {quoted(worst[0])}, {worst[1]:.0%})" if worst else ""
        how = ("keep fp32 master weights (fp32 parameters + autocast), then use torch.amp.GradScaler(device, "
               f"init_scale=2**{k}); GradScaler cannot unscale the fp16 gradients of fp16 parameters" if low_params
               else f"use torch.amp.GradScaler(device, init_scale=2**{k})")
        if flush1 > UNDERFLOW_WARN:
            sev = "warning" if flush1 > 0.5 or flush_default > UNDERFLOW_WARN else "info"
            out.append(Finding("gradient_underflow", "", "fp16", flush1,
                               f"{flush1:.1%} of the nonzero gradients of layers that autocast runs in fp16 flush to "
                               f"zero at scale 1{worst_txt}; GradScaler's default leaves {default_share}; at "
                               f"init_scale=2**{k} (max|grad| {gmax:.3g} x scale stays {headroom(gmax, 2.0**k, fmax)} "
                               f"below {fmax:g}) "
                               f"{flush_rec:.2%} do: {how}", sev, "backward", fix="scaler"))
        if flush_rec > UNDERFLOW_WARN:
            out.append(Finding("gradient_underflow", "", "fp16", flush_rec,
                               f"Even at init_scale=2**{k} {flush_rec:.2%} of the nonzero gradients flush to zero: the "
                               "gradients span more binades than fp16 holds; use bf16", "warning", "backward"))
        default_txt = (f"GradScaler's default 2**16 overflows first and needs {backoffs} backoff step(s) (skipped "
                       f"steps) to get below fp16's max" if backoffs else
                       f"GradScaler's default 2**16 does not overflow and leaves {default_share} flushed")
        kind = "scaler_needed" if flush1 > 0 or gmax >= over else "no_scaler_needed"
        if low_params:
            msg = (f"{flush1:.3%} of the nonzero gradients flush to zero in fp16 at scale 1; the parameters are "
                   "fp16, where torch.amp.GradScaler refuses to unscale: keep fp32 master weights (fp32 parameters + "
                   "autocast) and scale there")
        else:
            msg = (f"{flush1:.3%} of the nonzero gradients flush to zero in fp16 at scale 1"
                   + (f" and the largest, {gmax:.3g}, overflows it" if gmax >= over else "")
                   + ((f"; use a GradScaler: its default init_scale=2**16 does not overflow and leaves "
                       f"{flush_rec:.3%} flushed" if default_is_recommended(info) and not backoffs else
                       f"; use a GradScaler: {default_txt}; init_scale=2**{k} leaves {flush_rec:.3%} flushed")
                      if kind == "scaler_needed" else "; no gradient flushes or overflows on this batch, so fp16 needs no "
                      "loss scale for it (gradients shrink as training converges: examine a later checkpoint too)"
                      + (f"; but a GradScaler at its default 2**16 overflows: it skips {backoffs} step(s) while it "
                         f"backs off, so if you use one, pass init_scale=2**{k}" if backoffs else "")))
        out.append(Finding(kind, "", "fp16", flush1, msg, "info", "backward"))
        out += _layer_underflow(ev)
    if "bf16" in ev.precisions:
        bflush = info["bf16_flush_at_1"]
        out.append(Finding("no_scaler_needed" if bflush == 0 else "scaler_needed", "", "bf16", bflush,
                           f"{bflush:.3%} of the nonzero gradients flush to zero in bf16 at scale 1 (bf16 has fp32's "
                           "exponent range)" + ("" if bflush else ": no GradScaler needed"), "info", "backward"))
    return out


def _mass_flushed(h: Log2Hist, scale: float) -> float:
    """The share of sum |x| held by values that fp16 flushes to zero at this scale (below 2**-25 / scale), to the
    binade."""
    bins = h._values()[0].sum(1).astype(np.float64)
    mass = bins * np.exp2(np.arange(bins.size) + h.LO)
    total = mass.sum()
    if total == 0:
        return 0.0
    cut = int(math.floor(-25 - math.log2(scale))) - h.LO
    return float(mass[:max(cut, 0)].sum() / total)


def _layer_underflow(ev: Evidence) -> list[Finding]:
    """Parameters that lose more than half of their gradient in fp16, measured in the fp16 backward itself (the share
    of fp32's nonzero gradient that came back zero), at scale 1 and at the recommended scale, whatever dtype their
    module's output has (an Embedding's output stays fp32 under autocast, but its gradient arrives through the fp16
    op that reads it). Every such parameter is named; with many, one finding per module prefix names them all."""
    ctx, out = ev.ctx, []
    res = ev.passes.get("fp16")
    if res is None:
        return out
    k = int(math.log2(ev.scale))
    norms = {n: float(torch.linalg.vector_norm(g)) for n, g in ctx.ref_grads.items()}
    total = math.sqrt(sum(v * v for v in norms.values()))
    broken = bool(res.watch.origins) or any(g["nonfinite"] for g in res.grads.values())
    lost: dict[str, tuple[float, float]] = {}
    for n in ctx.param_grads:
        # A gradient below fp32's own rounding of the whole (a conv bias before BatchNorm: mathematically zero) is
        # noise: losing it at scale 1 loses nothing. Measured losses at the recommended scale always count.
        noise = norms.get(n, 0.0) < NOISE * total
        at1 = 0.0 if noise else ev.flushed_at_1.get(n, 0.0)
        at_rec = 0.0 if broken else res.grads.get(n, {}).get("flushed", 0.0)
        if max(at1, at_rec) > LAYER_UNDERFLOW_WARN:
            lost[n] = (at1, at_rec)
    groups: dict[str, list[str]] = {}
    for n in lost:
        key = n if len(lost) <= 2 * MAX_PARAM_FINDINGS else (_owner(_owner(n)) or _owner(n))
        groups.setdefault(key, []).append(n)
    for key, names in groups.items():
        worst = max(names, key=lambda n: max(lost[n]))
        at1, at_rec = lost[worst]
        rec_bad = at_rec > LAYER_UNDERFLOW_WARN
        which = (f"{at1:.0%} of its gradient came back zero from the fp16 backward at scale 1, {at_rec:.0%} at the "
                 f"recommended 2**{k}")
        who = (f"{Quoted(worst)} loses more than half of its gradient" if len(names) == 1 else
               f"{len(names)} parameters under {quoted(key)} lose more than half of their gradient "
               f"({', '.join(quoted(n) for n in names)}; worst {quoted(worst)})")
        fix = ("even the recommended scale does not bring it back: run its module in fp32 or use bf16" if rec_bad else
               f"a GradScaler at the recommended init_scale=2**{k} brings it back (measured), or use bf16")
        out.append(Finding("layer_gradient_underflow", worst, "fp16", max(at1, at_rec),
                           f"{who}: {which}; that layer barely trains in fp16 however small the aggregate: {fix}",
                           "warning", "backward", fix="" if rec_bad else "scaler"))
    return out


def optimizer(ev: Evidence) -> list[Finding]:
    """What the audited steps of the optimizer as it is did, one finding per outcome: inf/NaN weights, a blow-up,
    lost updates (never a share of an update that a destroyed step did not make), eps in a low-precision state. Each
    is tagged with the dtype it measured (the weights', or the state's for fp32 weights) and phase "optimizer", and
    names the fp32 fix (master weights: it counts against every autocast recipe that trains these weights)."""
    a, out = ev.audit, []
    if a is None:
        return out
    if "error" in a:
        return [Finding("lost_updates", "", "fp32", math.nan, f"The optimizer could not be copied to audit its step "
                        f"({a['error']}): nothing about its step was checked", "info", "optimizer")]
    low_state = [d for d in a.get("state_dtypes", []) if d in ("float16", "bfloat16")]
    weights = "bf16" if "bfloat16" in a["param_dtypes"] else "fp16" if "float16" in a["param_dtypes"] else "fp32"
    fmt = weights if weights != "fp32" else ("fp16" if "float16" in low_state else "bf16" if low_state else "fp32")
    master_ok = math.isfinite(a.get("loss_after_master", math.nan))
    if a["fp32_master_weights"] and low_state:
        fix = (f"keep the optimizer's state in fp32: {a['class']} keeps it in {', '.join(low_state)} (use torch.optim's "
               "own optimizers, or that optimizer's fp32-state option)")
    else:
        fix = ("keep fp32 master weights: fp32 trainable parameters + autocast, so the optimizer's state is fp32 too"
               + (" (or ampcourse.optim.BF16AdamW for bf16 weights)" if fmt == "bf16" else ""))
    checked = (f" (checked: the same steps with fp32 master weights and fp32 state give loss "
               f"{a['loss_after_master']:.4g})" if master_ok and not a["fp32_master_weights"] else
               f" (checked: the same steps with the state cast to fp32 give loss {a['loss_after_master']:.4g})"
               if master_ok and a.get("master_reference") and low_state else "")
    n = a.get("steps") or 1
    steps = "one step" if n == 1 else f"{n} steps"
    outcome = a.get("outcome", "ok")
    sq = a.get("second_moment_underflow")
    why = (f"; {sq:.0%} of Adam's second moment underflowed to zero in the {fmt} state, so m/(sqrt(v)+eps) "
           "divides by eps alone" if sq else "")
    if outcome == "nonfinite":
        worst = max(a["params"], key=lambda n: a["params"][n]["nonfinite_after"])
        out.append(Finding("optimizer_nonfinite", worst, fmt, float(a["nonfinite_after"]),
                           f"{steps.capitalize()} of {a['class']} make {a['nonfinite_after']} weight(s) inf/NaN (first "
                           f"{quoted(worst)}){why}: {fix}{checked}", "error", "optimizer", fix="master_weights"))
    ratios = {n: r["update_ratio"] for n, r in a["params"].items()
              if "update_ratio" in r and a.get("master_reference", True)}
    worst_ratio = max(ratios, key=ratios.get, default=None)
    after, before = a.get("loss_after", math.nan), a.get("loss_before", math.nan)
    if outcome == "blowup":
        out.append(Finding("optimizer_blowup", worst_ratio or "", fmt,
                           ratios.get(worst_ratio, math.inf) if worst_ratio else after,
                           f"{steps.capitalize()} of {a['class']} take the loss from {before:.4g} to {after:.4g}"
                           + (f" and move {quoted(worst_ratio)} {ratios[worst_ratio]:.3g}x as far as the fp32-master "
                              "steps" if worst_ratio else "") + f"{why}: {fix}{checked}", "error", "optimizer",
                           fix="master_weights"))
    share = a.get("lost_update_share", 0.0)
    if outcome == "lost_updates":
        worst = max(a["params"], key=lambda n: a["params"][n].get("lost_share", 0.0))
        each = a.get("lost_params") or []
        # Per parameter too: a LayerNorm gain whose whole update rounds away never trains, however small its part
        # of the whole update (every such parameter is named, the most lost first).
        who = (f"; {len(each)} parameter(s) lose more than half of their own update: "
               + ", ".join(f"{quoted(n)} {a['params'][n]['lost_share']:.0%}" for n in each[:MAX_PARAM_FINDINGS])
               + (f" and {len(each) - MAX_PARAM_FINDINGS} more" if len(each) > MAX_PARAM_FINDINGS else "")
               if each else f" (worst {quoted(worst)}: {a['params'][worst]['lost_share']:.0%})")
        out.append(Finding("lost_updates", worst, fmt, share,
                           f"{share:.1%} of the update of {steps} rounds to no change in the {fmt} parameters"
                           f"{who}; the update is below half an ulp of the weight: {fix}{checked}", "warning",
                           "optimizer", fix="master_weights"))
    if sq is not None and sq > SECOND_MOMENT_WARN and outcome not in ("nonfinite", "blowup"):
        worst = max((n for n, r in a["params"].items() if "second_moment_underflow" in r),
                    key=lambda n: a["params"][n]["second_moment_underflow"], default="")
        out.append(Finding("second_moment_underflow", worst, fmt, sq,
                           f"After {steps} of {a['class']}, {sq:.0%} of Adam's second moment is zero in the {fmt} "
                           f"state (worst {quoted(worst)}): (1-beta2)*g**2 rounds to zero when stored once |g| is below "
                           f"{second_moment_threshold(fmt):.2g}; a step computed in fp32 registers (fused) is right "
                           "the first time and reads the zeros back from then on, so m/(sqrt(v)+eps) grows step by "
                           f"step toward m/eps: {fix}{checked}", "warning", "optimizer", fix="master_weights"))
    for e in a.get("eps", []):
        f = formats.spec(e["format"])
        measured = f" (measured: {sq:.0%} of the second moment underflowed in {steps})" if sq is not None else ""
        beta2 = e.get("beta2", 0.999)
        out.append(Finding("eps_underflow", e["first"], e["format"], e["eps"],
                           f"eps={e['eps']:g} rounds to 0 in the {e['format']} optimizer state of {e['params']} "
                           f"parameter(s) ({e['format']}'s smallest subnormal is {f.min_subnormal:.3g}); the main "
                           f"cause of low-precision Adam blow-ups is the second moment: (1-beta2)*g**2 rounds to zero "
                           f"once it is below half the smallest subnormal, |g| < "
                           f"{second_moment_threshold(e['format'], beta2):.2g} at beta2={beta2:g}{measured}, and then "
                           "lr*m/eps wrecks the weights whatever eps is: raising eps just past the smallest subnormal "
                           "does not help. Keep the optimizer state in fp32 (fp32 trainable parameters + autocast)",
                           "warning", "optimizer", fix="master_weights"))
    return out


def model_precision(ev: Evidence) -> list[Finding]:
    """A model already in fp16/bf16 (measured against an fp32 copy), and precisions under which autocast ran nothing
    in low precision (a float64 model)."""
    out = []
    dt = ev.model_dtype
    if dt in _LOW and ev.low_trainable is None:
        # what trains is fp32 (a frozen half-precision base with fp32 adapters): that is the point, nothing to change
        name = "fp16" if dt == torch.float16 else "bf16"
        n = sum(1 for p in ev.ctx.model.parameters() if p.dtype == dt)
        out.append(Finding("low_precision_model", "", name, float(n),
                           f"{n} parameter tensor(s) are {name} and frozen; what trains is fp32 (the trainable "
                           "parameters and the optimizer's param groups): no master weights needed, and the frozen "
                           "ones stay as they are", "info", "model"))
    elif dt in _LOW:
        name = ev.low_trainable
        n = sum(1 for p in ev.ctx.model.parameters() if p.dtype in _LOW and p.requires_grad)
        out.append(Finding("low_precision_model", "", name, float(n),
                           f"The model's trainable weights are {name} ({n} parameter tensors): the fp32 reference ran on an "
                           f"fp32 copy, and each precision ran on the model as it is. To train, keep fp32 master weights "
                           f"(model.float() + autocast) or a low-precision optimizer such as ampcourse.optim.BF16AdamW "
                           "(bf16)", "info", "model"))
    for p, v in ev.verdicts.items():
        if v.get("status") == "unsupported" and v.get("no_low_precision"):
            out.append(Finding("no_low_precision", "", p, 0.0,
                               f"{p} autocast ran no op in {p}: {v['reason']}", "warning", "model"))
    return out


def raises(ev: Evidence) -> list[Finding]:
    """The model raises under autocast where fp32 ran (a constant fp16 cannot hold, a dtype check): where, and whether
    that module in fp32 lets it run."""
    out = []
    for p, v in ev.verdicts.items():
        r = v.get("raised")
        if not r:
            continue
        m = r["module"]
        at = (f"{Quoted(m)}" + (" (inline in forward)" if r["inline"] and r["phase"] == "forward" else "")
              + (f" ({r['node']} in backward)" if r["phase"] == "backward" and r["node"] else "")
              if m is not None else "The model")
        op = f": {r['op']}" if r["op"] else ""
        runs = v["status"] in ("clean", "islands") and m in v.get("fp32_modules", [])
        if r.get("kernel_gap") and runs:
            # the device's kernel library has no such kernel: nothing in the model's code to make safe
            out.append(Finding("raises", m, p, math.inf,
                               f"{at}{op} raises under {p} autocast on this {ev.ctx.dev.type}, where fp32 ran: "
                               f"{r['error']}; this {ev.ctx.dev.type}'s kernel library has no {p} kernel for it (the "
                               f"model's code is not at fault): with {quoted(m)} in fp32 it runs here, so run it in "
                               f"fp32 on this device (an fp32 island); hardware with {p} kernels for it may not need "
                               "the island", "warning", r["phase"], r["op"], fix="islands"))
            continue
        fix = (f"with {quoted(m)} in fp32 it runs: run it in fp32 (an fp32 island), or make that code {p}-safe"
               if runs else f"{quoted(m)} in fp32 was tried and it still fails" if m and m in v.get(
                   "tried_fp32_modules", []) else "no fp32 island can reach it; make that code " + p + "-safe")
        out.append(Finding("raises", m or "", p, math.inf,
                           f"{at}{op} raises under {p} autocast, where fp32 ran: {r['error']}; {fix} (a constant "
                           f"{p} holds, such as torch.finfo(t.dtype).min instead of -1e9, or an explicit .float())",
                           "error", r["phase"], r["op"], fix="islands" if runs else ""))
    return out


RULES: Sequence[Callable[[Evidence], list[Finding]]] = (
    raises, reference_nonfinite, forward_origins, backward_origins, activation_overflow, precision_loss, output_and_loss,
    gradient_error, gradient_scale, optimizer, model_precision)
