"""examine(): the passes in order, the fp32-island search, the verdicts, the rules, and the advice."""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn

from ..device import AmpSetup, pick
from . import rules
from .audit import audit
from .capture import (Context, PassFailed, PassResult, Snapshot, autocast_pass, check_inputs, check_precisions,
                      reference_pass, resolve_device, to_device)
from .report import Finding, Report, _sort_key, quoted
from .rules import MAX_ISLANDS, Evidence

_LOW = (torch.float16, torch.bfloat16)


@contextlib.contextmanager
def known_state(dev: torch.device):
    """Gradients on, inference mode off and every autocast off, whatever the caller's context (restored after)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.inference_mode(False))
        stack.enter_context(torch.enable_grad())
        for kind in {"cpu", dev.type} | ({"cuda"} if torch.cuda.is_available() else set()):
            stack.enter_context(torch.autocast(kind, enabled=False))
        yield


def _model_dtype(model: nn.Module) -> torch.dtype | None:
    """The model's floating parameter dtype when it is not float32 (the widest of them), else None."""
    dts = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if not dts or dts == {torch.float32}:
        return None
    if torch.float64 in dts:
        return torch.float64
    return torch.float16 if torch.float16 in dts else torch.bfloat16


def examine(model: nn.Module, inputs, targets=None, loss_fn: Callable | None = None,
            optimizer: torch.optim.Optimizer | None = None, device: str | torch.device | None = None,
            precisions: Sequence[str] = ("fp16", "bf16"), policy: str | None = None) -> Report:
    """Measure the model in fp32 and under autocast in each precision, forward and backward, audit one optimizer
    step, and advise; leaves the model, the optimizer, the inputs and every RNG stream as they were.

    Args:
        model: the ``nn.Module`` as you train it (fp32, or already fp16/bf16: then the fp32 reference is a copy).
        inputs: a tensor, a tuple (positional arguments) or a dict (keyword arguments) for ``model``.
        targets: passed to ``loss_fn(output, targets)``; None with a model that returns its own loss.
        loss_fn: ``loss_fn(output, targets)`` (or ``loss_fn(output)``); None: the output, its ``.loss`` or ``["loss"]``.
        optimizer: its step is audited on copies (never stepped itself); None skips the audit.
        device: must name the model's own device, if given (examine never moves a model).
        precisions: which of "fp16" and "bf16" to examine (default both).
        policy: whose autocast lists to measure under: None (the device's own) or ``"cuda"`` on a CPU (CUDA's,
            through ``ampcourse.emulate``); ``report.policy`` names it.

    Returns:
        A :class:`Report`: ``report.is_clean("bf16")``, ``report.verdicts``, ``report.findings``, ``report.advice``.

    Example::

        >>> from ampcourse.doctor import examine
        >>> report = examine(model, x, y, loss_fn=nn.functional.cross_entropy, optimizer=opt)
        >>> report.recommended_precision, report.is_clean("fp16"), report.policy_snippet()
    """
    if isinstance(model, torch.jit.ScriptModule):
        raise TypeError("model is a torch.jit.ScriptModule: the doctor needs hooks and op dispatch, which scripted "
                        "code does not run; pass the eager nn.Module (the one before torch.jit.script)")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    check_inputs(inputs)
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable (e.g. nn.functional.cross_entropy) or None, got {type(loss_fn).__name__}")
    if loss_fn is None and targets is not None:
        raise ValueError("targets were given but loss_fn is None: pass loss_fn=, or put the labels in inputs "
                         "for a model that returns its own loss")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
    precs = check_precisions(precisions)
    dev = resolve_device(model, device)
    session, name = _policy_session(policy, dev)
    with session, known_state(dev):  # the emulation outside: known_state's autocast-off regions then switch it off
        report = _examine(model, inputs, targets, loss_fn, optimizer, dev, precs)
    report.policy = name
    if name != dev.type:  # measured under CUDA's lists: the note on CPU's lists does not apply
        report.notes = [f"Measured under CUDA's autocast lists (emulated on {dev.type}: CUDA's casts, this CPU's "
                        "arithmetic; ampcourse.emulate.LIMITS)."] + report.notes[1:]
    return report


def _policy_session(policy: str | None, dev: torch.device):
    """(the context examine runs in, the policy's name): CUDA's lists on a CPU through one outer emulation."""
    if policy is None or policy == dev.type:
        return contextlib.nullcontext(), dev.type
    if policy != "cuda" or dev.type != "cpu":
        raise ValueError(f"policy must be None (the device's own) or 'cuda' (emulated on a CPU), got {policy!r} "
                         f"on {dev.type}")
    from .. import emulate

    return emulate.autocast("cuda", enabled=False), "cuda (emulated on cpu)"


def _examine(model, inputs, targets, loss_fn, optimizer, dev: torch.device, precs: tuple[str, ...]) -> Report:
    inputs, targets = to_device(inputs, dev), to_device(targets, dev)
    snapshot = Snapshot.take(model, optimizer)
    mdt = _model_dtype(model)
    ref_model = model
    if mdt in _LOW:
        ref_model = copy.deepcopy(model).float()  # the reference on an fp32 copy; the model itself is not touched
    ctx = Context(model, ref_model, inputs, targets, loss_fn, dev, snapshot)
    ev = Evidence(ctx, precs, model_dtype=mdt)
    try:
        ctx.ref_loss = reference_pass(ctx)
        if not math.isfinite(ctx.ref_loss) or any(r.act.nonfinite for r in ctx.records.values()):
            ctx.reference_watch()  # where fp32 itself goes inf/NaN
        ev.gradients, ev.scale = rules.gradient_info(ctx)
        ev.audit = audit(ctx, optimizer)
        for p in precs:
            ev.verdicts[p] = _precision(ctx, ev, p)
        if any(res.watch.origins for res in ev.passes.values()):
            ctx.reference_watch()  # the rules compare with it; it must run before the state is restored
    finally:
        snapshot.restore(model)
    if "fp16" in ev.passes:  # flushed shares over the layers autocast really ran in fp16
        info, _ = rules.gradient_info(ctx, ev.passes["fp16"])
        ev.gradients.update({k: v for k, v in info.items() if k not in ("max", "recommended_scale")})
    findings: list[Finding] = []
    for rule in rules.RULES:
        findings += rule(ev)
    findings.sort(key=_sort_key)
    supported = {p: v for p, v in ev.verdicts.items() if v["status"] != "unsupported"} or ev.verdicts
    rec = _choose(supported, dev, findings)
    ev.verdicts.setdefault(rec, {"status": "unsupported", "fp32_modules": [], "reason": "not examined"})
    report = Report(findings, rec, ev.scale, list(ev.verdicts[rec].get("fp32_modules", [])), str(dev), ev.verdicts,
                    ev.gradients, ev.audit, _module_table(ctx, ev), notes=_notes(dev) + _unmeasured(ctx, ev))
    report.advice = _advice(report, ev)
    return report


def _precision(ctx: Context, ev: Evidence, p: str) -> dict[str, Any]:
    """Run one precision, forward and backward, and search fp32 islands when it is not clean: its verdict."""
    try:
        amp = pick(ctx.dev, p)
    except ValueError as err:
        return {"status": "unsupported", "reason": str(err), "fp32_modules": []}
    scale = ev.scale if p == "fp16" else 1.0
    try:
        res = autocast_pass(ctx, amp, scale=scale)
    except PassFailed as fail:
        if _missing_kernel(fail.error):  # this device or torch has no such kernel: nothing about the model
            return {"status": "unsupported", "fp32_modules": [],
                    "reason": f"{p} autocast cannot run this model here: {fail}"}
        return _raised(ctx, ev, amp, scale, fail)
    ev.passes[p] = res
    base = {"native": amp.native, "units": amp.units, "loss": res.loss, "output_error": rules.output_error(ctx, res),
            "loss_gap": rules.loss_gap(ctx, res), "scale": scale}
    if res.watch.low_ops == 0:
        what = {torch.float64: "the model is float64, and autocast only lowers float32 ops"}.get(
            ev.model_dtype, "no op that autocast lowers ran")
        return {**base, "status": "unsupported", "fp32_modules": [], "no_low_precision": True,
                "reason": f"autocast ran no op in {p} ({what}): this examines nothing about {p}; cast the model to "
                          "float32 (model.float()) to examine mixed precision"}
    status, islands, fixed = _islands_for(ctx, amp, res, scale)
    return {**base, "status": status, "fp32_modules": islands if status == "islands" else [],
            "tried_fp32_modules": islands, "loss_with_islands": fixed}


def _islands_for(ctx: Context, amp: AmpSetup, res: PassResult, scale: float,
                 start: Sequence[str] = ()) -> tuple[str, list[str], float]:
    """('clean' | 'islands' | 'refused', fp32 modules, loss): grow fp32 islands (from start, those res ran with)
    until a pass comes back clean."""
    p = amp.precision
    low = str(amp.amp_dtype).removeprefix("torch.")
    # Islands over half of the leaves autocast runs low are fp32 training in disguise: refuse instead.
    limit = min(MAX_ISLANDS, sum(r.leaf and r.dtype.get(p) == low for r in res.records.values()) // 2)
    islands: list[str] = list(start)
    for _ in range(MAX_ISLANDS + 1):
        if rules.pass_ok(ctx, res):
            return ("islands" if islands else "clean"), islands, res.loss
        new = [n for n in rules.culprits(ctx, res) if n not in islands]
        if not new or "" in new or len(islands) + len(new) > max(limit, 1):
            return "refused", islands + [n for n in new if n], res.loss
        islands += new
        try:
            res = autocast_pass(ctx, amp, islands, scale=scale)
        except PassFailed:  # these islands make it raise: no set found
            return "refused", islands, math.nan
    return "refused", islands, res.loss


def _missing_kernel(err: BaseException) -> bool:
    """An error that says this device or torch build lacks a kernel for the dtype, not that the model is wrong."""
    return isinstance(err, NotImplementedError) or "not implemented for" in str(err)


def _raised(ctx: Context, ev: Evidence, amp: AmpSetup, scale: float, fail: PassFailed) -> dict[str, Any]:
    """The verdict when the model raises under autocast where fp32 ran: where (module, op), and whether running that
    module in fp32 lets the rest be examined (then that pass is the precision's evidence, islands grown from it)."""
    p, where = amp.precision, fail.where
    raised = {"error": str(fail), "module": where.module if where else None, "op": where.op if where else "",
              "phase": where.phase if where else "forward", "inline": bool(where and where.inline),
              "node": where.node if where else ""}
    refused = {"status": "refused", "fp32_modules": [], "tried_fp32_modules": [], "raised": raised, "scale": scale,
               "native": amp.native, "units": amp.units, "loss": math.nan,
               "reason": f"the model raises under {p} autocast where fp32 ran ({fail})"}
    if not (where and where.module):
        return refused  # not inside a module's call (the loss, or the model's own top level): no island can fix it
    try:
        res = autocast_pass(ctx, amp, [where.module], scale=scale)
    except PassFailed:
        return {**refused, "tried_fp32_modules": [where.module]}
    ev.passes[p] = res
    status, islands, fixed = _islands_for(ctx, amp, res, scale, start=[where.module])
    if status != "refused":
        del refused["reason"]  # the finding says what raised; the verdict line needs no more
    return {**refused, "status": status, "fp32_modules": islands if status == "islands" else [],
            "tried_fp32_modules": islands, "loss": res.loss, "loss_with_islands": fixed,
            "output_error": rules.output_error(ctx, res), "loss_gap": rules.loss_gap(ctx, res)}


def _choose(verdicts: Mapping[str, dict[str, Any]], dev: torch.device, findings: list[Finding]) -> str:
    """The precision to recommend: clean beats islands beats refused; fewer warnings; native units; the device's
    default as ampcourse.device.pick() decides it."""
    rank = {"clean": 0, "islands": 1, "refused": 2, "unsupported": 3}
    default = pick(dev).precision if dev.type in ("cpu", "cuda", "mps") else "bf16"
    bad = {p: sum(f.severity != "info" and f.precision == p for f in findings) for p in verdicts}

    def key(p: str) -> tuple:
        v = verdicts[p]
        return rank[v["status"]], bad[p] > 0, not v.get("native", False), p != default, p
    return min(verdicts, key=key)


def _module_table(ctx: Context, ev: Evidence) -> list[dict[str, Any]]:
    """Per module, in the order they finish: ranges of outputs and output gradients (flushed at 1 and at scale),
    dtypes and errors per precision, and how many times it was called."""
    rows, scale = [], ev.scale
    for n in ctx.order:
        r = ctx.records[n]
        dtype = {p: res.records[n].dtype.get(p) for p, res in ev.passes.items() if res.records[n].dtype.get(p)}
        local = {p: res.records[n].local_error[p] for p, res in ev.passes.items() if p in res.records[n].local_error}
        outerr = {p: res.records[n].output_error[p] for p, res in ev.passes.items() if p in res.records[n].output_error}
        nonfinite = {p: res.records[n].nonfinite.get(p, 0) for p, res in ev.passes.items()}
        rows.append({"name": n, "leaf": r.leaf, "calls": r.calls, "act_min": r.act.min, "act_max": r.act.max,
                     "act_fp16_overflow": r.act._share("overflow", 1.0, "fp16"),
                     "act_fp16_subnormal": r.act._share("subnormal", 1.0, "fp16"),
                     "act_fp16_underflow": r.act._share("underflow", 1.0, "fp16"),
                     "grad_min": r.grad.min, "grad_max": r.grad.max,
                     "grad_fp16_underflow": r.grad._share("underflow", 1.0, "fp16"),
                     "grad_fp16_underflow_at_recommended": r.grad._share("underflow", scale, "fp16"),
                     "dtype": dtype, "nonfinite": nonfinite, "local_error": local, "output_error": outerr})
    return rows


def _notes(dev: torch.device) -> list[str]:
    """What the learner should know about where the measurement ran."""
    if dev.type == "cpu":
        return ["Measured with CPU autocast, whose op lists differ from CUDA's (on CPU, layer_norm and softmax of a "
                "low-precision input stay low; CUDA runs them in fp32): run the doctor on the GPU you train on too, or "
                "examine(..., policy='cuda') (--policy cuda) for CUDA's lists from this CPU."]
    return [f"Measured with {dev.type} autocast."]


def _unmeasured(ctx: Context, ev: Evidence) -> list[str]:
    """A note for each module whose inline code ran fp16/bf16 ops but whose own error could not be measured: a silent
    gap would read as "nothing wrong there"."""
    out = []
    for n in ctx.order:
        why = {p: res.records[n].unmeasured[p] for p, res in ev.passes.items()
               if n in res.records and p in res.records[n].unmeasured}
        for reason in dict.fromkeys(why.values()):
            precs = ", ".join(p for p, r in why.items() if r == reason)
            out.append(f"The own error of {quoted(n)} (inline in forward) was not measured in {precs}: {reason}. "
                       "Its output error and any inf/NaN origin in it are still reported.")
    return out


def _sentence(text: str) -> str:
    """Capitalised, ending with a full stop."""
    text = text.strip()
    if not text:
        return text
    text = text[0].upper() + text[1:]
    return text if text.endswith((".", "!", "?")) else text + "."


def _advice(r: Report, ev: Evidence) -> list[str]:
    """Sentences, each citing the measurement behind it; only advice that was checked."""
    out = []
    ref_loss = ev.ctx.ref_loss
    rec = r.recommended_precision
    v = r.verdicts.get(rec, {})
    status = v.get("status", "unsupported")
    if not math.isfinite(ref_loss):
        out.append(f"The fp32 run itself gives a loss of {ref_loss}: fix the model or its data first; nothing below "
                   "can be trusted until fp32 is finite.")
    others = "; ".join(f"{p} is {w['status']}" for p, w in r.verdicts.items() if p != rec)
    if status in ("refused", "unsupported"):
        states = "; ".join(f"{p} is {w['status']}" for p, w in r.verdicts.items())
        out.append(f"No precision examined here ran clean ({states}): train in fp32 until the errors above are fixed.")
    else:
        loss = v.get("loss_with_islands", v.get("loss", math.nan))
        why = ("no op made inf/NaN, no module passed the error tolerance, and the output, loss and gradients match "
               "fp32" if status == "clean" else
               f"clean once {', '.join(quoted(n) for n in r.fp32_modules)} run in fp32 (the snippet below applies it)")
        warned = [f for f in r.findings if f.precision in (rec, "fp32") and f.severity != "info"]
        caveat = (f" Read the {len(warned)} error(s) and warning(s) on {rec} or every precision above first."
                  if any(f.precision == "fp32" for f in warned) else
                  f" Read the {len(warned)} warning(s) on {rec} above first." if warned else "")
        out.append(f"Use {rec} autocast: {why} (loss {loss:.4g} against {ref_loss:.4g} in fp32)"
                   + (f"; {others}" if others else "") + "." + caveat)
    if ev.ctx.dev.type == "cpu":
        chosen = pick(ev.ctx.dev)
        if chosen.precision == "fp32":
            out.append(f"On this CPU ampcourse.device.pick() keeps fp32 ({chosen.units}): {rec} is correct here but "
                       "slower than fp32; it pays on hardware with units for it.")
        else:
            out.append(f"On this CPU ampcourse.device.pick() chooses {chosen.precision} ({chosen.units}); low "
                       "precision is only faster where the CPU has the units for it.")
    g = r.gradients
    fp32_params = ev.model_dtype not in _LOW
    if rec == "fp16" and status in ("clean", "islands") and "recommended_scale" in g:
        k = int(math.log2(g["recommended_scale"]))
        if fp32_params:
            out.append(f"Use torch.amp.GradScaler({r.device.split(':')[0]!r}, init_scale=2**{k}): max|grad| "
                       f"{g['max']:.3g} x 2**{k} stays {rules.GRAD_MARGIN:g}x below 65504, leaving "
                       f"{g['flush_at_recommended']:.2%} of the gradients flushed (against {g['flush_at_1']:.2%} at "
                       f"scale 1); the fp16 backward ran at that scale here.")
        else:
            out.append("Do not add a GradScaler to fp16 parameters (it refuses to unscale fp16 gradients): keep fp32 "
                       "master weights (model.float() + autocast) and use a GradScaler there.")
    elif rec == "bf16" and status in ("clean", "islands"):
        out.append("No GradScaler: bf16 has fp32's exponent range"
                   + (f" ({g['bf16_flush_at_1']:.3%} of the gradients flush at scale 1)." if "bf16_flush_at_1" in g
                      else "."))
    for f in r.findings:
        if f.phase == "optimizer" and f.severity != "info":
            out.append(_sentence(f"The optimizer step ({f.kind}): {f.message}"))
        elif f.kind == "low_precision_model":
            out.append(_sentence(f.message))
    return out
