"""Confirmation by training: before the doctor recommends a recipe (precision, fp32 islands, init_scale, fp32 master
weights, the learner's own optimizer and loss), it trains it ``steps`` steps beside fp32 on the learner's batch with
:func:`ampcourse.trial.trial`, and says "confirmed over N steps" or names the step and measure where it departed.

One trial serves every recipe: one fp32 reference run, then one run per precision, each from a copy of the model as
it is (never the model itself: it, its optimizer, the inputs and every RNG stream are left bit-identical). The
recipe's islands are applied by the copy itself, for the autocast dtype it finds itself running under, so one
factory serves every precision. Every step trains on the same batch, the one examine() was given.

"Departs" (:func:`departure`): a non-finite loss, or a loss outside the band fp32's own loss spans over
``LAG_STEPS`` steps either side of that step, by more than ``LOSS_DEPARTS`` (5%) of fp32's loss there: a recipe that
lags or leads fp32 by one step of its progress is not a departure, one that keeps drifting away is, however fast
fp32's loss fell at its first steps (calibrated on the gallery's healthy models: tests/doctor/test_doctor_gallery.py).

Where a run departs (:func:`locate`): the step where the loss leaves fp32 is not where it went wrong, so the run is
replayed up to the departure and the forensic pass (examine(steps=0), on a copy) runs at its weights from just
before it: the module and op it names are where training broke. A precision refused by model-wide findings alone
(:func:`.verdict.refused_model_wide`) is trained too, for that only: never recommended, and a healthy model (no
departure) pays nothing for it.
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from .. import _args, emulate, formats
from ..policy import apply_policy, remove_policy
from .calls import call, fresh_copy, scalar_loss
from .passes import Context
from .verdict import Confirmation, Decision, _rank

__all__ = ["confirm", "departure", "locate", "loss_tolerance", "LOSS_DEPARTS", "DEFAULT_LR"]

#: The smallest relative loss gap to fp32 that counts as a departure (the issue's 5%), beyond fp32's own band.
LOSS_DEPARTS = 0.05
#: How many steps a recipe may lag or lead fp32 before its gap counts: fp32's loss over steps k-1..k+1 is its band at
#: step k (the largest change over the whole run was the band before: a loss falling 3x at its first step let any
#: later gap under 200% pass).
LAG_STEPS = 1
#: The learning rate of the AdamW that trains a recipe when examine() got no optimizer.
DEFAULT_LR = 1e-3
#: torch.amp.GradScaler's own default init_scale: a refused fp16, trained only to locate where it breaks, uses it.
DEFAULT_INIT_SCALE = 2.0**16
_LOW = formats.AUTOCAST_DTYPES  # one home: ampcourse.formats


class _Spy:
    """Shared by every deep copy of a _Recipe (deepcopy returns it as is): the replay of :func:`locate` reads the
    run it watches through it."""

    def __init__(self, precision: str) -> None:
        self.precision, self.run, self.weights, self.step, self.calls = precision, None, None, -1, 0

    def __deepcopy__(self, memo):
        return self


def _finite(model: nn.Module) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in model.state_dict().values() if t.is_floating_point())


class _Recipe(nn.Module):
    """The learner's model on its one batch, returning the loss: what ampcourse.trial trains. Under autocast it runs
    the fp32 islands of the recipe for that autocast dtype (applied to itself, so each deep copy has its own)."""

    def __init__(self, model: nn.Module, inputs, targets, loss_fn, islands: Mapping[str, Sequence[str]],
                 policy: Mapping[str, str], device_type: str, rng: tuple) -> None:
        super().__init__()
        self.model = model
        self._batch = (inputs, targets)  # plain attributes: deep copies take them along, parameters() does not
        self._loss_fn, self._islands, self._policy = loss_fn, dict(islands), dict(policy)
        self._device_type, self._rng, self._applied = device_type, rng, None
        self._spy: _Spy | None = None  # set only while locate() replays a run

    def _precision(self) -> str:
        # through emulate: under policy="cuda" torch's own CPU state reads bf16 (and "on") in every emulated region
        enabled, dtype = emulate.autocast_state(self._device_type)
        if not enabled:
            return "fp32"
        return {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, "fp32")

    def rules(self, p: str) -> dict[str, str]:
        """The precision policy precision p's recipe runs with: the learner's own policy, then its fp32 islands."""
        return {**self._policy, **{n: "fp32" for n in self._islands.get(p, ())}}

    def forward(self, _index: torch.Tensor) -> torch.Tensor:
        # examine() runs inside a disabled autocast context, so autocast's cache of fp16/bf16 weight casts would
        # outlive each step's own autocast context: last step's weights, forever. Each step casts afresh.
        torch.clear_autocast_cache()
        p = self._precision()
        if self._applied != p:
            rules = self.rules(p)
            remove_policy(self.model)
            if rules:
                apply_policy(self.model, rules)
            self._applied = p
        # Python's and NumPy's streams as the caller left them, at every step of every run (torch's stream is the
        # trial's own, per run): inline randomness draws the same numbers in fp32 and in each precision
        random.setstate(self._rng[0])
        np.random.set_state(self._rng[1])
        spy = self._spy
        if spy is not None and p == spy.precision:  # the replayed run: the forward of step j sees its weights W_j
            spy.run = self
            if _finite(self.model):
                spy.weights = {k: t.detach().clone() for k, t in self.model.state_dict().items()}
                spy.step = spy.calls
            spy.calls += 1
        inputs, targets = self._batch
        return scalar_loss(call(self.model, fresh_copy(inputs)), targets, self._loss_fn)


def _loss_of_output(out: torch.Tensor, _target: torch.Tensor) -> torch.Tensor:
    return out


def _master_copy(model: nn.Module, trainable: set[int]) -> nn.Module:
    """A copy of the model whose trainable parameters are fp32 (fp32 master weights; frozen ones stay as they are)."""
    ids = {id(p): n for n, p in model.named_parameters()}
    net = copy.deepcopy(model)
    names = {ids[i] for i in trainable if i in ids}
    with torch.no_grad():
        for n, p in net.named_parameters():
            if n in names and p.dtype in _LOW:
                p.data = p.data.float()
    return net


def _optimizer_factory(model: nn.Module, optimizer: torch.optim.Optimizer | None, master: bool):
    """(callable(params) -> optimizer for a copy of the model, what it is in words): the learner's optimizer class and
    per-group options, rebuilt on the copy's parameters (fresh state); AdamW(lr=DEFAULT_LR) without one."""
    order = {id(p): i for i, p in enumerate(model.parameters())}
    if optimizer is None:
        def default(params):
            return torch.optim.AdamW([p for p in params if p.requires_grad], lr=DEFAULT_LR)
        return default, f"AdamW(lr={DEFAULT_LR:g}), the default (no optimizer= was given: pass yours to confirm with it)"
    groups = [({k: v for k, v in g.items() if k != "params"}, [order[id(p)] for p in g["params"] if id(p) in order])
              for g in optimizer.param_groups]

    def rebuild(params):
        params = list(params)
        spec = [{**opts, "params": [params[i] for i in idx]} for opts, idx in groups]
        try:
            return type(optimizer)(spec)
        except (TypeError, ValueError):  # its constructor refuses the recipe's weights (BF16AdamW on fp32 masters)
            return torch.optim.AdamW(spec, lr=groups[0][0].get("lr", DEFAULT_LR))
    name = type(optimizer).__name__
    return rebuild, f"{name} with your param groups' options" + (" (AdamW where it refuses fp32 master weights)"
                                                                 if master else "")


def loss_tolerance(ref: Sequence[float], k: int | None = None) -> float:
    """The relative gap to fp32's loss that step k of a recipe may show without departing: LOSS_DEPARTS beyond the
    band fp32's own loss spans over steps k-LAG_STEPS..k+LAG_STEPS, as a fraction of fp32's loss at k (with the band
    on the side the gap is on, :func:`departure` is exact; this is the wider side, for the report). k None: the
    last step.

    Example::

        >>> loss_tolerance([1.0, 1.0, 1.0])                 # a flat fp32 loss: 5%
        0.05
        >>> round(loss_tolerance([2.0, 1.0, 0.9], k=1), 3)  # fp32 halves its loss at step 1: lagging a step is fine
        1.05
    """
    k = len(ref) - 1 if k is None else k
    lo, hi = _band(ref, k)
    if not (math.isfinite(ref[k]) and math.isfinite(lo)):
        return LOSS_DEPARTS
    scale = max(abs(ref[k]), 1e-12)
    return LOSS_DEPARTS + max(hi - ref[k], ref[k] - lo) / scale


def _band(ref: Sequence[float], k: int) -> tuple[float, float]:
    """(lowest, highest) finite fp32 loss over steps k-LAG_STEPS..k+LAG_STEPS (nan, nan: none is finite)."""
    near = [v for v in ref[max(0, k - LAG_STEPS):k + LAG_STEPS + 1] if math.isfinite(v)]
    return (min(near), max(near)) if near else (math.nan, math.nan)


def departure(loss: Sequence[float], ref: Sequence[float]) -> tuple[int, str, float, float] | None:
    """(step, measure, gap, tolerance) of the first step where a run departs from the fp32 reference, or None.

    measure: "non-finite" (its loss is inf/NaN where fp32's is finite) or "loss" (further than LOSS_DEPARTS of fp32's
    loss outside the band fp32's loss spans within LAG_STEPS steps); gap: |loss - fp32's| / |fp32's| at that step;
    tolerance: the gap that step allowed on that side.

    Example::

        >>> departure([2.0, 1.9, 1.81], [2.0, 1.9, 1.8]) is None
        True
        >>> departure([2.0, 1.9, float("nan")], [2.0, 1.9, 1.8])[:2]
        (2, 'non-finite')
        >>> departure([0.1, 0.035, 0.012, 0.014], [0.1, 0.035, 0.012, 0.012])[:2]  # fell fast, then drifted off
        (3, 'loss')
    """
    for k, (a, b) in enumerate(zip(loss, ref)):
        if not math.isfinite(a) and math.isfinite(b):
            return k, "non-finite", math.inf, LOSS_DEPARTS
        if not (math.isfinite(a) and math.isfinite(b)):
            continue
        lo, hi = _band(ref, k)
        scale = max(abs(b), 1e-12)
        outside = (a - hi) if a > hi else (lo - a) if a < lo else 0.0
        if outside > LOSS_DEPARTS * scale:
            edge = hi if a > hi else lo
            return k, "loss", abs(a - b) / scale, LOSS_DEPARTS + abs(edge - b) / scale
    return None


def confirm(ctx: Context, ev, decision: Decision, optimizer: torch.optim.Optimizer | None,
            steps: int, locate_only: Sequence[str] = (), forensic: Callable | None = None
            ) -> tuple[dict[str, Confirmation], dict[str, Any]]:
    """Train every recipe the decision could recommend (rank 0 or 1) ``steps`` steps beside one fp32 reference,
    and those of ``locate_only`` (refused precisions, trained only to name where they break); where a run departs,
    :func:`locate` names the module and op, with ``forensic`` (core's forensic pass, passed in: core imports this
    module, so this module never imports core; None: departures name no module).

    Returns (per precision its Confirmation, what was trained: steps, optimizer, master weights, islands, scale).
    """
    from ..trial import trial  # the trial module imports the training stack: only when confirming

    recommendable = [p for p, v in decision.verdicts.items() if _rank(v) <= 1]
    extra = [p for p in locate_only if p in decision.verdicts and p not in recommendable]
    candidates = recommendable + extra
    out = {p: Confirmation("unconfirmed", steps, reason="not a candidate: its verdict is "
                           f"{decision.verdicts[p].status}") for p in decision.verdicts if p not in candidates}
    if not candidates:
        return out, {"steps": steps, "trained": []}
    master = any(decision.verdicts[p].master_weights for p in recommendable)
    trainable = ({id(p) for g in optimizer.param_groups for p in g["params"]} if optimizer is not None
                 else {id(p) for p in ctx.model.parameters() if p.requires_grad})
    if not any(p.requires_grad and id(p) in trainable for p in ctx.model.parameters()):
        why = ("nothing in the model trains (no parameter with requires_grad=True" +
               (" in the optimizer" if optimizer is not None else "") + "): training cannot confirm a recipe")
        out.update({p: Confirmation("unconfirmed", steps, reason=why) for p in candidates})
        return out, {"steps": steps, "trained": [], "error": why}
    try:
        net = _master_copy(ctx.model, trainable) if master else copy.deepcopy(ctx.model)
    except Exception as err:  # noqa: BLE001 (a model deepcopy refuses: it holds non-leaf tensors, a lock, ...)
        why = f"the model cannot be copied to train it ({type(err).__name__}: {_args.first_line(err, 120)})"
        out.update({p: Confirmation("unconfirmed", steps, reason=why) for p in candidates})
        return out, {"steps": steps, "trained": [], "error": why}
    remove_policy(net)
    inputs = fresh_copy(ctx.inputs, torch.float32) if master and any(
        p.dtype in _LOW for p in ctx.model.parameters() if id(p) in trainable) else ctx.inputs
    islands = {p: list(decision.verdicts[p].fp32_modules if p in recommendable else
                       ev.verdicts[p].get("fp32_modules") or []) for p in candidates}
    rng = (random.getstate(), np.random.get_state())
    recipe = _Recipe(net, inputs, ctx.targets, ctx.loss_fn, islands, ctx.snapshot.policy, ctx.dev.type, rng)
    make_opt, opt_text = _optimizer_factory(ctx.model, optimizer, master)
    fp16_scaled = ev.low_trainable != "fp16" or master  # GradScaler refuses fp16 gradients
    # a refused fp16 trains as a learner would run it anyway, with GradScaler's default init_scale: the doctor's own
    # scale is part of a recipe it does not recommend (on llama_large_qk, 2**3 flushes half of q's gradient and the
    # run stays finite over 10 steps, where 2**16 and the course's 2**12 reach inf in the attention's matmul)
    scale = ev.scale if "fp16" in recommendable else DEFAULT_INIT_SCALE
    labels = {p: ("fp16" if fp16_scaled else "fp16-noscaler") if p == "fp16" else p for p in candidates}
    info: dict[str, Any] = {"steps": steps, "trained": candidates, "optimizer": opt_text, "master_weights": master,
                            "fp32_modules": islands, "init_scale": scale if fp16_scaled else None,
                            "batch": "the batch examine() was given, at every step"}
    data = (torch.zeros(1, 1), torch.zeros(1, dtype=torch.long))

    def train(names: Sequence[str], n: int):
        return trial(lambda: recipe, data, precisions=tuple(names), steps=n, optimizer_factory=make_opt,
                     monitors=[], batch_size=1, loss_fn=_loss_of_output, tolerance=1e30, device=ctx.dev,
                     scaler_kwargs={"init_scale": scale} if fp16_scaled and "fp16" in labels else None)
    try:
        t = train(labels.values(), steps)
    except Exception as err:  # noqa: BLE001 (the learner's model or optimizer may refuse to train: say so)
        why = f"training it failed: {type(err).__name__}: {_args.first_line(err, 160)}"
        out.update({p: Confirmation("unconfirmed", steps, reason=why) for p in candidates})
        info["error"] = why
        return out, info
    ref = t.series["reference"]["loss"]
    for p, label in labels.items():
        s = t.series[label]
        dep = departure(s["loss"], ref)
        skipped = int(sum(s.get("skipped", [])))
        common = {"steps": steps, "loss": s["loss"][-1], "ref_loss": ref[-1], "skipped": skipped,
                  "recipe": _recipe_text(p, islands[p], master, scale if p == "fp16" and fp16_scaled else None)}
        if dep is None and p in extra:  # trained only to find where it breaks: still refused by its findings
            out[p] = Confirmation("unconfirmed", steps, reason=f"not a candidate: its verdict is refused (trained "
                                  f"{steps} steps to find where it breaks: it did not depart)")
        elif dep is None:
            out[p] = Confirmation("confirmed", tolerance=loss_tolerance(ref), **common)
        else:
            k, measure, gap, tol = dep
            # where the loss first goes inf/NaN is where it breaks; a loss that only lags (skipped steps) names
            # nothing, so a later non-finite step is the one examined
            bad = next((j for j, (a, b) in enumerate(zip(s["loss"], ref)) if not math.isfinite(a)
                        and math.isfinite(b)), k)
            culprit = locate(ctx, recipe, train, p, label, bad, islands[p], forensic=forensic) if forensic else None
            if culprit is not None and bad != k:
                culprit["nonfinite_step"] = bad
            out[p] = Confirmation("departed", step=k, measure=measure, gap=gap, tolerance=tol, culprit=culprit,
                                  **common)
    if extra:
        info["located_only"] = extra
    return out, info


def locate(ctx: Context, recipe: _Recipe, train, p: str, label: str, k: int,
           islands: Sequence[str] = (), *, forensic: Callable) -> dict[str, Any] | None:
    """Where a run that departed at step k breaks: replay it (``train([label], k)``, the same deterministic trial)
    up to its weights before step k (those of the last step where they were all finite, if step k's are not), and
    run the forensic pass (examine(steps=0), precision p only, on a copy of the run's model, with the recipe's
    ``islands`` in fp32 as the run had them) there. Returns its worst
    error or warning finding that names a module outside the recipe's ``islands`` (those already run in fp32: not
    where it breaks), as a dict (module, op, kind, phase, precision, value, message, weights_step), or None
    (nothing named there, or the replay failed).

    Args:
        ctx: examine's context (the device, the learner's model for its train/eval mode).
        recipe: the _Recipe the confirmation trained (its copies are what the trial trains).
        train: callable(labels, steps) -> Trial: the confirmation's own trial call.
        p, label: the precision ("fp16") and its trial label ("fp16" or "fp16-noscaler").
        k: the step whose loss departed (or went inf/NaN).
        islands: the recipe's fp32 modules.
        forensic: the forensic pass, core's ``_examine(model, inputs, targets, loss_fn, optimizer, dev, precs, steps)``
            (passed in by core, which imports this module: no import back).

    Example::

        culprit = locate(ctx, recipe, train, "fp16", "fp16", 6, forensic=core._examine)
        culprit["module"], culprit["op"]   # ('model.layers.0.self_attn', 'aten::bmm')
    """
    spy = _Spy(p)
    recipe._spy = spy
    try:
        if k > 0:
            train([label], k)
    except Exception:  # noqa: BLE001 (it trained the first time: a failure now names nothing)
        return None
    finally:
        recipe._spy = None
    if spy.run is None:
        net, step = copy.deepcopy(recipe.model), 0  # departed at its first step: the initial weights
    elif _finite(spy.run.model):
        net, step = copy.deepcopy(spy.run.model), k  # the weights after k updates: what step k's forward ran on
    elif spy.weights is not None:
        net, step = copy.deepcopy(spy.run.model), spy.step
        net.load_state_dict(spy.weights)
    else:
        return None
    # the run's own recipe, islands included, as the model's policy (the forensic pass keeps a model's policy): at a
    # departure the islands still run in fp32, so what it names is what broke beyond them, not the islands again
    remove_policy(net)
    rules = recipe.rules(p)
    if rules:
        apply_policy(net, rules)
    net.train(ctx.model.training)
    try:
        sub = forensic(net, recipe._batch[0], recipe._batch[1], recipe._loss_fn, None, ctx.dev, (p,), 0)
    except Exception:  # noqa: BLE001 (the forensic pass at those weights raised: nothing to name)
        return None
    inside = lambda n: any(n == i or n.startswith(i + ".") for i in islands)  # noqa: E731
    named = [f for f in sub.findings if f.severity in ("error", "warning") and f.module and not inside(f.module)
             and f.precision in (p, "fp32") and f.phase in ("forward", "backward")]
    if not named:
        return None
    f = next((f for f in named if f.op), named[0])  # an op named beats a module alone
    return {"module": f.module, "op": f.op, "kind": f.kind, "phase": f.phase, "precision": f.precision,
            "value": f.value, "message": f.message, "weights_step": step}


def _recipe_text(p: str, islands: Sequence[str], master: bool, scale: float | None) -> str:
    """'fp16 autocast, GradScaler(init_scale=2**15), fp32 modules 'norm', fp32 master weights'."""
    parts = [f"{p} autocast"]
    if scale is not None:
        parts.append(f"GradScaler(init_scale=2**{int(math.log2(scale))})")
    if islands:
        parts.append("fp32 modules " + ", ".join(f"'{n}'" for n in islands))
    if master:
        parts.append("fp32 master weights")
    return ", ".join(parts)
