"""The optimizer audit: step a copy of the optimizer AS IT IS (its class, options, state and attributes, bound to
copies of the parameters) with the fp32 reference gradients, and measure what the step did.

Measured per parameter: inf/NaN weights after the step, the update |dw| against the same step taken with fp32
master weights and fp32 state, the share of update elements that rounded to no change, the share of Adam's second
moment that underflowed to zero, and the loss after each step. Nothing of the caller's optimizer or model changes:
the copy is made with ``copy.deepcopy(optimizer.__dict__, memo)``, the memo mapping each parameter to its copy.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn

from dataclasses import dataclass

from .. import _args, formats
from ..scaling import range_counts
from .calls import fresh_copy, scalar_loss
from .passes import Context
from .verdict import _FieldMapping

_LOW = formats.AUTOCAST_DTYPES  # one home: ampcourse.formats
#: Optimizer steps the audit takes on its copies: the state is stored in its own dtype between them, so a state that
#: underflows when stored (a fused Adam computes step 1's second moment in fp32 registers, then keeps it in fp16)
#: shows from the second step on.
AUDIT_STEPS = 2


def second_moment_threshold(fmt: str, beta2: float = 0.999) -> float:
    """|g| below which Adam's first update of the second moment, (1 - beta2) * g**2, rounds to zero in fmt: below
    half of fmt's smallest subnormal (round to nearest). fp16 at beta2 = 0.999: 5.5e-3.

    Example::

        >>> round(second_moment_threshold("fp16"), 4)
        0.0055
    """
    return math.sqrt(formats.spec(fmt).min_subnormal / 2 / (1 - beta2))


@dataclass(frozen=True, eq=False)
class Audit(_FieldMapping):
    """What the optimizer audit measured (also read as a mapping: ``report.optimizer["lost_update_share"]``).

    ``outcome``: "nonfinite" (the step made inf/NaN weights), "blowup" (the loss or an update far beyond the
    fp32-master step's), "lost_updates" (updates rounded away: over LOST_WARN of the whole update, or over LOST_PARAM
    of one parameter's, named in ``lost_params``), "ok", or "not_stepped" (fp32 weights and state:
    the step is the fp32-master step). ``lost_update_share`` is NaN when the step destroyed the weights (a share of
    an update that is not there would read as a fine step).
    """

    _ALIASES = {"class": "class_name"}

    class_name: str
    param_dtypes: dict
    grad_dtypes: dict
    state_dtypes: list
    fp32_master_weights: bool
    eps: list
    params: dict
    trainable_dtypes: dict | None = None
    nonfinite_after: int | None = None
    lost_update_share: float | None = None
    loss_before: float | None = None
    loss_after: float | None = None
    loss_after_master: float | None = None
    stepped: bool | None = None
    steps: int | None = None
    master_reference: bool | None = None
    second_moment_underflow: float | None = None
    lost_params: list | None = None
    outcome: str | None = None
    error: str | None = None
    master_error: str | None = None

    @classmethod
    def of(cls, d: Mapping[str, Any]) -> Audit:
        """From the dict audit() builds (its "class" key is class_name)."""
        return cls(**{cls._ALIASES.get(k, k): v for k, v in d.items()})


def _dt(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _tally(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for i in items:
        out[i] = out.get(i, 0) + 1
    return out


def _state_dtype(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> torch.dtype:
    """The dtype of p's optimizer state (its tensors' dtype, else p's own: Adam creates state like the parameter)."""
    for v in optimizer.state.get(p, {}).values():
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0:
            return v.dtype
    return p.dtype


def step_copy(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], grads: Mapping[int, torch.Tensor],
              dtype: torch.dtype | None = None, steps: int = 1) -> tuple[dict[int, torch.Tensor], torch.optim.Optimizer]:
    """steps steps of a copy of optimizer, bound to copies of params (in dtype, if given, with its state cast to it),
    each with the same gradients; between steps the state stays as the optimizer stored it.

    The copy keeps the optimizer's class, options and extra attributes (BF16AdamW's rounding and generator):
    it is not rebuilt from param_groups. An instance-level ``step`` (an LR scheduler's wrapper) is not copied:
    it would step the original; the class's step is called instead.
    """
    memo: dict[int, Any] = {}
    copies = {}
    for p in params:
        c = nn.Parameter(p.detach().to(dtype or p.dtype, copy=True), requires_grad=p.requires_grad)
        g = grads.get(id(p))
        c.grad = None if g is None else g.to(c.dtype, copy=True)
        memo[id(p)] = copies[id(p)] = c
    opt = object.__new__(type(optimizer))
    opt.__dict__.update(copy.deepcopy({k: v for k, v in optimizer.__dict__.items()
                                       if k not in ("step", "zero_grad")}, memo))
    if dtype == torch.float32 and getattr(opt, "rounding", None) == "kahan":
        # fp32 master weights have no bf16 rounding to compensate; BF16AdamW's Kahan buffer would even count the
        # update twice there from the second step on (p.float() is p itself in fp32)
        opt.rounding = "nearest"
    if dtype is not None:
        for st in opt.state.values():
            for k, v in list(st.items()):
                if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0:
                    st[k] = v.to(dtype)
    for i in range(steps):
        if i:
            for p in params:
                g = grads.get(id(p))
                copies[id(p)].grad = None if g is None else g.to(copies[id(p)].dtype, copy=True)
        type(opt).step(opt)
    return copies, opt


def _loss_with(ctx: Context, weights: Mapping[str, torch.Tensor]) -> float:
    """The fp32 reference model's loss with these weights (fp16/bf16 ones as fp32, float64 ones as they are: the
    reference keeps them), on fresh inputs, the caller's RNG and buffers."""
    model = ctx.ref_model
    ctx.snapshot.reset_rng()
    state = {n: b.detach().clone() for n, b in model.named_buffers()}
    state.update({n: w.detach().float() if w.dtype in _LOW else w.detach() for n, w in weights.items()})
    inputs = fresh_copy(ctx.inputs, torch.float32 if any(p.dtype in _LOW for p in ctx.model.parameters()) else None)
    args, kwargs = ((), inputs) if isinstance(inputs, Mapping) else (inputs, {}) if isinstance(inputs, tuple) \
        else ((inputs,), {})
    try:
        with torch.no_grad(), torch.autocast(ctx.dev.type, enabled=False):
            out = torch.func.functional_call(model, state, args, kwargs)
            return float(scalar_loss(out, ctx.targets, ctx.loss_fn).float())
    except Exception:  # noqa: BLE001 (a loss we cannot recompute is reported as unknown, not as a crash)
        return math.nan


def audit(ctx: Context, optimizer: torch.optim.Optimizer | None) -> Audit | None:
    """What AUDIT_STEPS steps of the optimizer do to the model's weights, against fp32 master weights (None: no
    optimizer)."""
    if optimizer is None:
        return None
    return Audit.of(_audit(ctx, optimizer))


def _audit(ctx: Context, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    names = {id(p): n for n, p in ctx.model.named_parameters()}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    grads = {id(p): ctx.ref_grads[names[id(p)]] for p in params if names.get(id(p)) in ctx.ref_grads}
    state_dtypes = sorted({_dt(v) for p in params for v in optimizer.state.get(p, {}).values()
                           if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0})
    out: dict[str, Any] = {
        "class": type(optimizer).__name__, "param_dtypes": _tally(_dt(p) for p in params),
        "grad_dtypes": _tally(_dt(p) for p in params if id(p) in grads),
        "state_dtypes": state_dtypes or sorted({_dt(p) for p in params}),
        # fp32 or wider: a float64 head is no low-precision weight
        "fp32_master_weights": all(p.dtype not in _LOW for p in params if p.is_floating_point()),
        "eps": [], "params": {},
        "trainable_dtypes": _tally(_dt(p) for p in ctx.model.parameters() if p.requires_grad)}
    for gi, group in enumerate(optimizer.param_groups):
        eps = group.get("eps")
        # a fused step adds eps in fp32 registers: it never rounds to the state's format (the second moment still
        # underflows when stored, which the two audited steps measure)
        if isinstance(eps, (int, float)) and eps > 0 and not group.get("fused"):
            for fmt in ("fp16", "bf16"):
                dtype = formats.spec(fmt).torch_dtype
                in_state = [p for p in group["params"] if _state_dtype(optimizer, p) == dtype]
                if in_state and range_counts([eps], 1.0, fmt)["underflow"]:
                    betas = group.get("betas", (0.9, 0.999))
                    out["eps"].append({"group": gi, "eps": float(eps), "format": fmt, "params": len(in_state),
                                       "beta2": float(betas[1]) if isinstance(betas, (tuple, list)) else 0.999,
                                       "first": names.get(id(in_state[0]), f"param_groups[{gi}]")})
    # fp32 weights and fp32 state: the step *is* the fp32-master step, nothing of it depends on low precision. The
    # state is known fp32 once it exists, or before the first step for torch's own optimizers (they make it like the
    # parameter); any other optimizer may keep its state low (8-bit, fp16 moments), so its step is taken and checked.
    builtin = type(optimizer).__module__.startswith("torch.optim")
    wide = all(d in ("float32", "float64") for d in state_dtypes)
    if out["fp32_master_weights"] and wide and (state_dtypes or builtin):
        out.update(nonfinite_after=0, lost_update_share=0.0, loss_before=ctx.ref_loss, loss_after=math.nan,
                   loss_after_master=math.nan, stepped=False, steps=0, outcome="not_stepped")
        return out
    # the optimizer gets its gradients in the layout backward gives them (SparseAdam refuses dense ones)
    given = {i: g.to_sparse(min(1, g.dim())) if names[i] in ctx.sparse_grads else g for i, g in grads.items()}
    try:
        actual, opt_a = step_copy(optimizer, params, given, steps=AUDIT_STEPS)
    except Exception as err:  # noqa: BLE001 (an optimizer we cannot copy: say so, never rebuild it differently)
        out["error"] = f"{type(err).__name__}: {_args.first_line(err)}"
        return out
    out["stepped"], out["steps"] = True, AUDIT_STEPS
    out["state_dtypes"] = sorted({_dt(v) for st in opt_a.state.values() for v in st.values()
                                  if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0}
                                 ) or out["state_dtypes"]
    low = [p for p in params if p.dtype in _LOW and id(p) in grads]
    low_state = [p for p in params if id(p) in grads and _state_dtype(optimizer, p) in _LOW]
    master, opt_m = actual, opt_a
    # with no low state before the step (an optimizer that makes its own), there is no fp32-state step to compare with
    out["master_reference"] = bool(low or low_state)
    if low or low_state:
        try:
            master, opt_m = step_copy(optimizer, params, given, torch.float32, steps=AUDIT_STEPS)
        except Exception as err:  # noqa: BLE001
            out["master_error"] = f"{type(err).__name__}: {_args.first_line(err)}"
            master, opt_m = None, None
    moved = lost = 0.0
    nonfinite = 0
    for p in params:
        if id(p) not in grads:
            continue
        name = names.get(id(p), "?")
        c = actual[id(p)]
        a = c.detach().float()
        w = p.detach().float()
        row: dict[str, Any] = {"dtype": _dt(p), "nonfinite_after": int((~torch.isfinite(a)).sum())}
        nonfinite += row["nonfinite_after"]
        if master is not None:
            m = master[id(p)].detach().float()
            dw, dwm = a - w, m - w
            # An optimizer that keeps what rounding dropped (Kahan compensation, as BF16AdamW's) has not lost it.
            comp_before = optimizer.state.get(p, {}).get("compensation")
            comp_after = opt_a.state.get(c, {}).get("compensation")
            if isinstance(comp_after, torch.Tensor):
                dw = dw + comp_after.float() - (comp_before.float() if isinstance(comp_before, torch.Tensor) else 0.0)
            norm_m2 = float((dwm.double() ** 2).sum())
            finite = bool(torch.isfinite(dw).all())
            # The share of the fp32-master update that did not arrive, as a projection: rounding to nearest that
            # drops a small update loses all of it; stochastic rounding delivers it on average (moving few elements
            # by a whole ulp), so an element count would condemn it wrongly. A NaN did not "move".
            got = float((dw.double() * dwm.double()).sum()) if finite else 0.0
            row.update(update_ratio=(float(torch.linalg.vector_norm(dw)) / math.sqrt(norm_m2) if finite else math.inf)
                       if norm_m2 else (1.0 if finite and not bool((dw != 0).any()) else math.inf),
                       lost_share=min(1.0, max(0.0, 1.0 - got / norm_m2)) if norm_m2 else 0.0,
                       unchanged_share=int(((dwm != 0) & ((a - w) == 0)).sum()) / max(1, int((dwm != 0).sum())))
            if p.dtype in _LOW:
                moved += norm_m2
                lost += norm_m2 - min(norm_m2, max(0.0, got))
            sq_a = opt_a.state.get(c, {}).get("exp_avg_sq")
            sq_m = opt_m.state.get(master[id(p)], {}).get("exp_avg_sq")
            if isinstance(sq_a, torch.Tensor) and isinstance(sq_m, torch.Tensor) and sq_a.dtype in _LOW:
                nz = sq_m != 0
                row["second_moment_underflow"] = int((nz & (sq_a == 0)).sum()) / max(1, int(nz.sum()))
        out["params"][name] = row
    out["nonfinite_after"] = nonfinite
    out["lost_update_share"] = lost / moved if moved else 0.0
    # Stochastic rounding delivers a small update on average, by moving a few elements a whole ulp: over two steps
    # one small tensor's share is a coin toss, so only the whole update's share judges it.
    out["lost_params"] = ([] if getattr(optimizer, "rounding", None) == "stochastic" else
                          _lost_params(out["params"], params, names, grads))
    sq = [r["second_moment_underflow"] for r in out["params"].values() if "second_moment_underflow" in r]
    if sq:
        out["second_moment_underflow"] = max(sq)
    by_name = {names[i]: c for i, c in actual.items() if i in names}
    out["loss_before"] = ctx.ref_loss
    out["loss_after"] = _loss_with(ctx, by_name)
    if master is not None and (low or low_state):
        out["loss_after_master"] = _loss_with(ctx, {names[i]: c for i, c in master.items() if i in names})
    else:
        out["loss_after_master"] = out["loss_after"] if master is not None else math.nan
    out["outcome"] = _outcome(out)
    if out["outcome"] in ("nonfinite", "blowup"):
        out["lost_update_share"] = math.nan  # the update did not "arrive" or "get lost": the step destroyed weights
    return out


#: An update this many times larger than the fp32-master update is a blow-up.
BLOWUP_RATIO = 4.0
#: More than this share of the fp32-master update rounded away is lost updates.
LOST_WARN = 0.10
#: ... and so is more than this share of one parameter's own update (a LayerNorm gain at 1.0 in bf16 whose AdamW
#: update of lr=1e-4 is below half its ulp never trains, however small its part of the whole update is).
LOST_PARAM = 0.5
#: A parameter whose largest fp32 gradient is below this times the median parameter's is rounding noise (a key bias
#: before softmax, ~1e-14): AdamW still gives it an lr-sized fp32 update, whose loss in low precision is harmless.
GRAD_NOISE = 1e-6


def _lost_params(rows: Mapping[str, Mapping[str, Any]], params, names, grads) -> list[str]:
    """The low-precision parameters that lose more than LOST_PARAM of their own fp32-master update, those whose
    gradient is rounding noise left out; most lost first."""
    tops = {names.get(id(p), "?"): float(grads[id(p)].abs().max()) for p in params
            if id(p) in grads and grads[id(p)].numel()}
    if not tops:
        return []
    floor = GRAD_NOISE * sorted(tops.values())[len(tops) // 2]
    lost = [n for n, r in rows.items() if r.get("dtype") in ("float16", "bfloat16")
            and r.get("lost_share", 0.0) > LOST_PARAM and tops.get(n, 0.0) > floor]
    return sorted(lost, key=lambda n: -rows[n]["lost_share"])


def blown_up(a: Mapping[str, Any]) -> bool:
    """The loss after the steps far above the loss before (twice it, and by at least 1), or not finite, while the
    fp32-master steps stay finite; or an update BLOWUP_RATIO times the fp32-master update's size."""
    after, before = a.get("loss_after", math.nan), a.get("loss_before", math.nan)
    master_ok = math.isfinite(a.get("loss_after_master", math.nan))
    reference_ok = master_ok or not a.get("master_reference", True)
    if (math.isfinite(before) and reference_ok
            and (not math.isfinite(after) or after > max(2 * abs(before), before + 1.0))):
        return True
    ratios = [r["update_ratio"] for r in a.get("params", {}).values()
              if "update_ratio" in r and a.get("master_reference", True)]
    return bool(ratios) and max(ratios) > BLOWUP_RATIO


def _outcome(a: Mapping[str, Any]) -> str:
    """nonfinite, blowup, lost_updates or ok: what the audited steps did, worst first."""
    if a.get("nonfinite_after"):
        return "nonfinite"
    if blown_up(a):
        return "blowup"
    return "lost_updates" if a.get("lost_update_share", 0.0) > LOST_WARN or a.get("lost_params") else "ok"
