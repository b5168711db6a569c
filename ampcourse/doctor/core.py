"""examine(): the passes in order, the fp32-island search, the verdicts, the rules, and the advice."""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn

from .. import _compiled, _errors, emulate, formats
from .. import inputs as _inputs
from ..device import AmpSetup, pick
from . import rules
from .audit import audit
from .calls import check_inputs, resolve_device, to_device
from .passes import Context, PassFailed, PassResult, autocast_pass, gradient_pass, reference_pass
from .snapshot import Snapshot
from . import confirm
from .report import Finding, Report, _sort_key, quoted
from .rules import MAX_ISLANDS, Evidence
from .verdict import Confirmation, Decision, _rank, decide, refused_model_wide

_LOW = formats.AUTOCAST_DTYPES  # one home: ampcourse.formats
#: Training steps examine() confirms each recipe over by default.
DEFAULT_STEPS = 10


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


#: The note of a report on a torch.compile'd model.
_COMPILED_NOTE = ("torch.compile: examined the eager module inside each compiled one (its _orig_mod, the same "
                  "parameters): the doctor watches every op, which compiled code does not run one by one; compiled "
                  "kernels may fuse and round differently (chapter 10), so confirm a recipe by training the compiled "
                  "model too.")


def _has_low(model: nn.Module) -> bool:
    """Some of the model's parameters are fp16/bf16 (a .half() model, a bf16 body with an fp32 head, a frozen fp16
    base with fp32 adapters): its fp32 reference runs on an fp32 copy."""
    return any(p.dtype in _LOW for p in model.parameters())


def trainable_format(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> str | None:
    """"fp16" or "bf16" when what trains (the optimizer's parameters, else those with requires_grad) is in that
    format (fp16 if any is), else None: advice about master weights and scalers reads this, not the frozen ones.

    Example::

        >>> trainable_format(nn.Linear(2, 2).half())
        'fp16'
    """
    params = ([p for g in optimizer.param_groups for p in g["params"]] if optimizer is not None
              else [p for p in model.parameters() if p.requires_grad])
    dts = {p.dtype for p in params if p.is_floating_point()}
    return "fp16" if torch.float16 in dts else "bf16" if torch.bfloat16 in dts else None


def fp32_copy(model: nn.Module) -> nn.Module:
    """An fp32 copy of a model whose parameters are (partly) fp16/bf16, for the fp32 reference: its fp16/bf16
    parameters and buffers become fp32 (float64 ones stay float64: wider than fp32 is no error to measure against),
    and every module with parameters of its own takes its fp16/bf16 inputs in fp32, as the model itself feeds each
    module the dtype its parameters expect (a frozen fp16 base called on x.half() next to fp32 adapters; a bf16 body
    before an fp32 head under autocast).

    Example::

        >>> ref = fp32_copy(nn.Sequential(nn.Linear(2, 2).half(), nn.Linear(2, 2).double()))
        >>> [p.dtype for p in ref.parameters()][::2]
        [torch.float32, torch.float64]
    """
    ref = copy.deepcopy(model)._apply(lambda t: t.float() if t.dtype in _LOW else t)
    for _, m in ref.named_modules():
        if any(True for _ in m.parameters(recurse=False)):
            m.register_forward_pre_hook(_to_fp32_inputs, with_kwargs=True)
    return ref


def _to_fp32_inputs(module, args, kwargs):
    cast = lambda t: t.float() if isinstance(t, torch.Tensor) and t.dtype in _LOW else t  # noqa: E731
    return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}


def examine(model: nn.Module, inputs, targets=None, loss_fn: Callable | None = None,
            optimizer: torch.optim.Optimizer | None = None, device: str | torch.device | None = None,
            precisions: Sequence[str] = ("fp16", "bf16"), steps: int = DEFAULT_STEPS,
            policy: str | None = None) -> Report:
    """Measure the model in fp32 and under autocast in each precision, forward and backward, audit the optimizer's
    step, derive each precision's verdict from the findings, confirm the recipes it would recommend by training them
    ``steps`` steps beside fp32 (:mod:`.confirm`), and advise; leaves the model, the optimizer, the inputs and every
    RNG stream as they were.

    Args:
        model: the ``nn.Module`` as you train it (fp32, or already fp16/bf16: then the fp32 reference is a copy).
        inputs: a tensor, a tuple (positional arguments) or a dict (keyword arguments) for ``model``.
        targets: passed to ``loss_fn(output, targets)``; None with a model that returns its own loss.
        loss_fn: ``loss_fn(output, targets)`` (or ``loss_fn(output)``); None: the output, its ``.loss`` or ``["loss"]``.
        optimizer: its step is audited on copies (never stepped itself); None skips the audit.
        device: must name the model's own device, if given (examine never moves a model).
        precisions: which of "fp16" and "bf16" to examine (default both).
        steps: training steps that confirm each recipe (default 10), on copies, with ``ampcourse.trial``; 0 gives
            the quick forensic pass, whose verdicts say "unconfirmed". Where a recipe departs, the forensic pass runs
            again at that run's weights from just before it and the departure names the module and op it finds
            (``verdicts[p].confirmation.culprit``); a precision refused by model-wide findings alone is trained
            too, only to name where it breaks.
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
    compiled = _compiled.is_compiled(model)
    if compiled:  # its parameters are the eager module's: examining that one examines what trains
        model = _compiled.eager(model)
    _inputs.read_model(model, "model", accept=("module",), trainable=False)  # the front door: InputError (a TypeError)
    check_inputs(inputs)
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable (e.g. nn.functional.cross_entropy) or None, got {type(loss_fn).__name__}")
    if loss_fn is None and targets is not None:
        raise ValueError("targets were given but loss_fn is None: pass loss_fn=, or put the labels in inputs "
                         "for a model that returns its own loss")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
    if optimizer is not None:
        ours = {id(p) for p in model.parameters()}
        held = [p for g in optimizer.param_groups for p in g["params"]]
        if held and not any(id(p) in ours for p in held):
            raise _inputs.InputError(
                f"optimizer holds none of this model's parameters ({len(held)} tensor(s) of another model): build it "
                f"on this one's, e.g. torch.optim.AdamW(model.parameters()), or pass optimizer=None")
    precs = _inputs.precision_names(precisions, "precisions", allowed=("fp16", "bf16"), refused={
        "fp32": "it lists the low-precision formats to examine ('fp16', 'bf16'); fp32 is always run as the reference"})
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps must be an int >= 0 (0: the forensic pass, unconfirmed), got {steps!r}")
    dev = resolve_device(model, device)
    session, name = emulate.session(policy, dev.type)
    # compiled submodules run eager while examined (as a compiled model does: it is unwrapped above)
    with _compiled.eager_children(model) as compiled_parts, session, known_state(dev):
        # the emulation outside: known_state's autocast-off regions then switch it off
        report = _examine(model, inputs, targets, loss_fn, optimizer, dev, precs, steps)
    report.policy = name
    if compiled or compiled_parts:
        report.notes = [_COMPILED_NOTE] + report.notes
    if name != dev.type:  # measured under CUDA's lists: the note on CPU's lists does not apply
        report.notes = [f"Measured under CUDA's autocast lists (emulated on {dev.type}: CUDA's casts, this CPU's "
                        "arithmetic; ampcourse.emulate.LIMITS)."] + [n for n in report.notes if not _is_cpu_lists_note(n)]
    return report


def _examine(model, inputs, targets, loss_fn, optimizer, dev: torch.device, precs: tuple[str, ...],
             steps: int = 0) -> Report:
    inputs, targets = to_device(inputs, dev), to_device(targets, dev)
    snapshot = Snapshot.take(model, optimizer)
    mdt = _model_dtype(model)
    ref_model = model
    if _has_low(model):
        ref_model = fp32_copy(model)  # the reference on an fp32 copy; the model itself is not touched
        snapshot.follow(ref_model)  # its own copies of the model's generators start where the model's do
    ctx = Context(model, ref_model, inputs, targets, loss_fn, dev, snapshot)
    ev = Evidence(ctx, precs, model_dtype=mdt)
    ev.low_trainable = trainable_format(model, optimizer)
    confirmations: dict[str, Confirmation] = {}
    train_info: dict[str, Any] = {}
    try:
        ctx.ref_loss = reference_pass(ctx)
        if rules.fp32_fails(ctx):
            ctx.reference_watch()  # where fp32 itself goes inf/NaN, forward or backward
        ev.gradients, ev.scale = rules.gradient_info(ctx)
        ev.audit = audit(ctx, optimizer)
        for p in precs:
            ev.verdicts[p] = _precision(ctx, ev, p)
        if "fp16" in ev.passes and not rules.fp32_fails(ctx) and _may_flush_at_1(ctx):
            ev.flushed_at_1 = _flushed_at_1(ctx, ev) if ev.scale != 1.0 else {
                n: g["flushed"] for n, g in ev.passes["fp16"].grads.items() if not g["nonfinite"]}
            _measured_shares(ev)
        if any(res.watch.origins for res in ev.passes.values()):
            ctx.reference_watch()  # the rules compare with it; it must run before the state is restored
        findings = _findings(ev)
        decision = _decide(ev, findings, {})
        if steps:
            # a precision refused by model-wide findings alone names no module: training it is what can
            locate = [p for p, v in decision.verdicts.items()
                      if refused_model_wide(p, ev.verdicts[p], v, findings, ev.low_trainable)]
            confirmations, train_info = confirm.confirm(ctx, ev, decision, optimizer, steps, locate_only=locate,
                                                        forensic=_examine)
            findings = sorted(findings + _departures(confirmations), key=_sort_key)
            decision = _decide(ev, findings, confirmations)
    finally:
        snapshot.restore(model)
    if not steps:
        confirmations = {p: Confirmation("unconfirmed", 0) for p in ev.verdicts}
        decision = _decide(ev, findings, confirmations)
    rec = decision.recommended
    report = Report(findings, rec, ev.scale, decision.fp32_modules, str(dev), decision.verdicts,
                    ev.gradients, ev.audit, _module_table(ctx, ev), notes=_notes(dev) + _unmeasured(ctx, ev),
                    headline=decision.headline, master_weights=decision.master_weights, steps=steps,
                    confirmation=train_info)
    report.advice = _advice(report, ev, decision)
    return report


def _departures(confirmations: Mapping[str, Confirmation]) -> list[Finding]:
    """A recipe that departed from fp32 when trained is a finding of its own (what a one-step check cannot see),
    naming the module and op where it breaks when the forensic pass at that run's later weights found them (its
    phase stays "model": it is about a training run; the culprit's own phase is in its confirmation's culprit)."""
    out = []
    for p, c in confirmations.items():
        if c.status != "departed":
            continue
        where = c.culprit or {}
        fix = ("the forensic pass at those weights names where it breaks: run that module in fp32, or use another "
               "precision" if where else
               "use another precision, or find what grows during training: the attention logits, the activations, "
               "ampcourse.trial's monitors show which")
        out.append(Finding("training_departs", where.get("module", ""), p,
                           c.gap if c.gap is not None else math.inf,
                           f"Trained {c.steps} steps beside fp32 on this batch, the recipe ({c.recipe}) "
                           f"{c.sentence()}: the one-step measurements at the initial weights did not show it; do not "
                           f"use this recipe ({fix})", "error", "model", op=where.get("op", "")))
    return out


def _findings(ev: Evidence) -> list[Finding]:
    """Every rule's findings, worst first."""
    findings: list[Finding] = []
    for rule in rules.RULES:
        findings += rule(ev)
    findings.sort(key=_sort_key)
    return findings


def lists_measured(dev: torch.device) -> str:
    """Whose autocast op lists a report measured under, for its first line: a verdict under CPU's lists may not hold
    on the GPU a learner trains on (CPU autocast keeps layer_norm and softmax low, CUDA runs them in fp32).

    Example::

        >>> lists_measured(torch.device("cpu"))
        "CPU autocast's op lists"
    """
    if emulate.is_active():
        return "CUDA's autocast op lists emulated"
    return "CUDA's autocast op lists" if dev.type == "cuda" else f"{dev.type.upper()} autocast's op lists"


def _decide(ev: Evidence, findings: list[Finding], confirmations: Mapping[str, Confirmation]) -> Decision:
    """The verdict layer (:func:`.verdict.decide`) on what examine measured."""
    dev = ev.ctx.dev
    default = pick(dev).precision if dev.type in ("cpu", "cuda", "mps") else "bf16"
    return decide(ev.verdicts, findings, device=f"{dev}, {lists_measured(dev)}", default=default, scale=ev.scale,
                  low_trainable=ev.low_trainable, tolerances={p: rules.tolerances(p) for p in ev.verdicts},
                  confirmations=confirmations,
                  state_only=bool(ev.audit is not None and ev.audit.get("fp32_master_weights")))


def _measured_shares(ev: Evidence) -> None:
    """The aggregate flushed shares as the fp16 backwards measured them (every parameter, weighted by its count of
    fp32-nonzero gradient values), in place of the histogram's prediction (kept as *_predicted)."""
    grads = ev.passes["fp16"].grads
    live = {n: g.get("live", 0) for n, g in grads.items()}
    total = sum(live.values())
    if not total or ev.gradients.get("nonzero", 0) == 0:
        return
    g = ev.gradients
    g["flush_at_1_predicted"] = g.get("flush_at_1", 0.0)
    g["flush_at_recommended_predicted"] = g.get("flush_at_recommended", 0.0)
    g["flush_at_1"] = sum(ev.flushed_at_1.get(n, 0.0) * c for n, c in live.items()) / total
    if not any(x["nonfinite"] for x in grads.values()):
        g["flush_at_recommended"] = sum(grads[n]["flushed"] * c for n, c in live.items()) / total
        # GradScaler's default, after its backoffs, is the scale the fp16 backward ran at: one measured number for
        # both (the histogram's prediction counts module outputs' gradients too: 0.07% against 0.000% measured)
        if rules.default_is_recommended(g):
            g["flush_at_default_predicted"] = g.get("flush_at_default", 0.0)
            g["flush_at_default"] = g["flush_at_recommended"]
        else:
            # still a prediction, but of the population the backwards measured (parameters), and never more than a
            # smaller measured scale flushed: the aggregate histogram's 26.6% stood beside 15.8% measured at scale 1
            default = rules.DEFAULT_SCALE / 2.0 ** g.get("default_backoff_steps", 0)
            g["flush_at_default"] = rules.bounded_by_measured(
                rules.param_flush_share(ev.ctx, ev.passes["fp16"], default), default,
                [(1.0, g["flush_at_1"]), (ev.scale, g["flush_at_recommended"])])
    if ev.flushed_at_1:  # the worst parameter as measured at scale 1, not as its histogram predicts
        name = max(ev.flushed_at_1, key=ev.flushed_at_1.get)  # ties: the first in the model's parameter order
        if ev.flushed_at_1[name] > 0:
            g["worst_param"] = (name, ev.flushed_at_1[name])
    g["measured"] = "fp16 backward, per parameter (share of fp32's nonzero gradient values that came back zero)"


def _may_flush_at_1(ctx: Context) -> bool:
    """Whether any fp32 gradient (a parameter's, or a module output's on its way back) lies where fp16 flushes at
    scale 1: if none does, an fp16 backward at scale 1 has nothing to lose and is not run."""
    from .hist import Log2Hist
    if getattr(ctx, "_may_flush_at_1", None) is None:  # asked once per fp16 pass: merged once per examine
        hists = [*ctx.param_grads.values(), *(r.grad for r in ctx.records.values())]
        ctx._may_flush_at_1 = Log2Hist.merged(hists)._share("underflow", 1.0) > 0
    return ctx._may_flush_at_1


def _wants_at_1(ctx: Context, ev: Evidence | None, p: str, scale: float | None = None) -> bool:
    """Whether precision p's passes should also run their backward at scale 1 (:func:`_flushed_at_1` reads it): fp16
    at a scale other than 1, fp32 finite, and some fp32 gradient where fp16 flushes at scale 1."""
    scale = ev.scale if scale is None else scale
    return p == "fp16" and scale != 1.0 and not rules.fp32_fails(ctx) and _may_flush_at_1(ctx)


def _flushed_at_1(ctx: Context, ev: Evidence) -> dict[str, float]:
    """Per parameter, the share of its fp32-nonzero gradient that one fp16 backward at scale 1 (no GradScaler) gave
    back as zero: measured, whatever dtype the module's output has (an Embedding's output stays fp32, but its
    gradient arrives through the fp16 op that reads it)."""
    islands = list(ev.verdicts["fp16"].get("fp32_modules", []))
    res = ev.passes.get("fp16")
    if res is not None and res.grads_at_1 is not None and list(res.islands) == islands:
        grads = res.grads_at_1  # measured in the verdict's own pass, off its forward's graph
        return {n: g["flushed"] for n, g in grads.items() if not g["nonfinite"]}
    try:
        grads = gradient_pass(ctx, pick(ctx.dev, "fp16"), islands, 1.0)
    except Exception:  # noqa: BLE001 (the watched passes already reported what raises; nothing more to measure)
        return {}
    return {n: g["flushed"] for n, g in grads.items() if not g["nonfinite"]}


def _precision(ctx: Context, ev: Evidence, p: str) -> dict[str, Any]:
    """Run one precision, forward and backward, and search fp32 islands when it is not clean: its verdict."""
    try:
        amp = pick(ctx.dev, p)
    except ValueError as err:
        return {"status": "unsupported", "reason": str(err), "fp32_modules": []}
    scale = ev.scale if p == "fp16" else 1.0
    at_1 = _wants_at_1(ctx, ev, p)
    try:
        res = autocast_pass(ctx, amp, scale=scale, at_1=at_1)
    except PassFailed as fail:
        if _errors.missing_kernel(fail.error):  # this device or torch has no such kernel: nothing about the model
            return {"status": "unsupported", "fp32_modules": [], "reason": _no_kernel_reason(ctx, p, fail)}
        clash = _dtype_clash(ctx.model, amp, fail.error)
        if clash:  # the model's own fp16/bf16 weights meet the other autocast dtype: a fact of the device, not a bug
            where = f" (in {quoted(fail.where.module)})" if fail.where and fail.where.module else ""
            return {"status": "unsupported", "fp32_modules": [],
                    "reason": f"{p} autocast cannot run this model's own {clash} weights on {ctx.dev.type}{where}: "
                              f"{fail}; examine {clash}, or fp32 master weights (model.float()) under {p}"}
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
    at_1 = _wants_at_1(ctx, None, p, scale)
    for _ in range(MAX_ISLANDS + 1):
        if rules.pass_ok(ctx, res):
            return ("islands" if islands else "clean"), islands, res.loss
        new = [n for n in rules.culprits(ctx, res) if n not in islands]
        if not new or "" in new or len(islands) + len(new) > max(limit, 1):
            return "refused", islands + [n for n in new if n], res.loss
        islands += new
        try:
            res = autocast_pass(ctx, amp, islands, scale=scale, at_1=at_1)
        except PassFailed:  # these islands make it raise: no set found
            return "refused", islands, math.nan
    return "refused", islands, res.loss


def _dtype_clash(model: nn.Module, amp: AmpSetup, err: BaseException) -> str:
    """"float16"/"bfloat16" when the model has parameters of a low-precision dtype other than amp's and err is about
    dtypes (CPU's bf16 autocast cannot run an fp16 LayerNorm's weights): the device cannot run this precision for
    the model's own dtypes. "" otherwise."""
    other = {p.dtype for p in model.parameters() if p.dtype in _LOW} - {amp.amp_dtype}
    text = str(err).lower()
    # "scalartype": autocast's own promote ops (cat, stack, index_put ...) raise "Unexpected floating ScalarType in
    # at::autocast::prioritize" on a floating dtype that is neither fp32 nor autocast's (a ViT's fp16 cls token)
    if other and any(w in text for w in ("dtype", "half", "bfloat16", "float16", "same type", "mixed", "scalar type",
                                         "scalartype")):
        return str(next(iter(other))).removeprefix("torch.")
    return ""


def _no_kernel_reason(ctx: Context, p: str, fail: PassFailed) -> str:
    """Why `p` is unsupported when an op has no `p` kernel here, and what to do; honest about emulation: under CUDA's
    emulated lists the arithmetic is this CPU's, so a kernel missing here says nothing about CUDA's."""
    where = fail.where
    if where and where.op:
        op = where.op + (f" (in {quoted(where.module)})" if where.module else "")
    else:  # raised above the op watch (a composite op's own dtype check, as torch.fft's): the learner's line
        op = _errors.learner_line(fail.error) or "an op"
    dev = ctx.dev.type
    if emulate.is_active():
        return (f"CUDA's {p} cannot be emulated for this model on this {dev}: {op} has no {p} kernel here ({fail}), "
                f"and whether CUDA has one this {dev} cannot tell; examine on the GPU, or compute that op in fp32 (an "
                "explicit .float() before it) to examine the rest")
    return (f"{p} autocast cannot run this model on this {dev}: {op} has no {p} kernel here ({fail}); compute it in "
            f"fp32 (an explicit .float() before it, or an fp32 island around its module) to run {p} for the rest")


#: What a kernel library says when it has no kernel for the dtype on this processor: oneDNN's bf16/fp16 LSTM on a
#: CPU without AVX512 ("could not create a primitive descriptor for the LSTM forward propagation primitive").
_KERNEL_GAPS = ("could not create a primitive",)


def _kernel_gap(err: BaseException) -> bool:
    """An error from a kernel library that has no kernel for this dtype on this device: a fact of the device (a
    module in fp32 runs there), not of the model's code."""
    return any(s in str(err) for s in _KERNEL_GAPS)


def _raised(ctx: Context, ev: Evidence, amp: AmpSetup, scale: float, fail: PassFailed) -> dict[str, Any]:
    """The verdict when the model raises under autocast where fp32 ran: where (module, op), and whether running that
    module in fp32 lets the rest be examined (then that pass is the precision's evidence, islands grown from it)."""
    p, where = amp.precision, fail.where
    raised = {"error": str(fail), "module": where.module if where else None, "op": where.op if where else "",
              "phase": where.phase if where else "forward", "inline": bool(where and where.inline),
              "node": where.node if where else "", "kernel_gap": _kernel_gap(fail.error)}
    refused = {"status": "refused", "fp32_modules": [], "tried_fp32_modules": [], "raised": raised, "scale": scale,
               "native": amp.native, "units": amp.units, "loss": math.nan,
               "reason": f"the model raises under {p} autocast where fp32 ran ({fail})"}
    if not (where and where.module):
        return refused  # not inside a module's call (the loss, or the model's own top level): no island can fix it
    try:
        res = autocast_pass(ctx, amp, [where.module], scale=scale, at_1=_wants_at_1(ctx, None, p, scale))
    except PassFailed:
        return {**refused, "tried_fp32_modules": [where.module]}
    ev.passes[p] = res
    status, islands, fixed = _islands_for(ctx, amp, res, scale, start=[where.module])
    if status != "refused":
        del refused["reason"]  # the finding says what raised; the verdict line needs no more
    return {**refused, "status": status, "fp32_modules": islands if status == "islands" else [],
            "tried_fp32_modules": islands, "loss": res.loss, "loss_with_islands": fixed,
            "output_error": rules.output_error(ctx, res), "loss_gap": rules.loss_gap(ctx, res)}


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


#: The start of _notes' CPU sentence: replaced when the report was measured under CUDA's lists.
_CPU_LISTS_NOTE = "Measured with CPU autocast, whose op lists differ from CUDA's"


def _is_cpu_lists_note(note: str) -> bool:
    """Whether a note is _notes' sentence on CPU autocast's lists (wrong for a report measured under CUDA's)."""
    return note.startswith(_CPU_LISTS_NOTE)


def _notes(dev: torch.device) -> list[str]:
    """What the learner should know about where the measurement ran."""
    if dev.type == "cpu":
        return [_CPU_LISTS_NOTE + " (on CPU, layer_norm and softmax of a "
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


def _status_phrase(p: str, w) -> str:
    """How the advice names another precision's status: 'fp16 needs fp32 modules 'mid'', 'bf16 is clean too'."""
    if w["status"] == "islands":
        names = w.get("fp32_modules") or []
        return f"{p} needs fp32 modules {', '.join(quoted(n) for n in names)}" if names else f"{p} needs fp32 islands"
    return f"{p} is {w['status']}" + (" too" if w["status"] == "clean" else "")


def _advice(r: Report, ev: Evidence, d: Decision) -> list[str]:
    """Sentences derived from the verdicts and the findings, each citing the measurement behind it."""
    out = []
    ref_loss = ev.ctx.ref_loss
    rec = r.recommended_precision
    v = r.verdicts.get(rec)
    if d.fp32_fails:
        first = next((f for f in r.findings if f.precision == "fp32" and f.severity == "error"), None)
        out.append(_sentence("The fp32 run itself fails" + (f": {first.message}" if first else "")
                             + "; no precision is judged until the fp32 run is finite"))
        return out + _loss_side(r)
    rank = _rank(v) if v is not None else 3
    others = "; ".join(_status_phrase(p, w) for p, w in r.verdicts.items() if p != rec)
    if rank >= 2:
        states = "; ".join(f"{p} is {w['status']}" + (f" ({w['reason']})" if w.get("reason") else "")
                           for p, w in r.verdicts.items())
        if all(_rank(w) == 3 for w in r.verdicts.values()):
            out.append(f"No precision examined could run here ({states}): train in fp32 here; what each reason "
                       "names is what to change, or where to examine instead.")
        else:
            out.append(f"No precision examined here ran clean ({states}): train in fp32 until the findings above "
                       "are fixed.")
    else:
        loss = v.get("loss_with_islands", v.get("loss", math.nan))
        how = ("" if rank == 0 or not v.master_weights else
               " with the optimizer's state in fp32" if ev.audit is not None and ev.audit.get("fp32_master_weights")
               else " with fp32 master weights (fp32 trainable parameters + autocast)")
        scaled = rank == 1 and "scaler" in v.needs and v.get("scale")
        why = ("no op made inf/NaN, no module passed the error tolerance, and the output, loss and gradients match "
               "fp32" + (f" once a GradScaler scales the loss by 2**{int(math.log2(v['scale']))} (its gradients "
                         "flush to zero without it)" if scaled else "")
               if v.status == "clean" or (rank == 1 and not v.fp32_modules) else
               f"clean once {', '.join(quoted(n) for n in r.fp32_modules)} run in fp32 (the snippet below applies it)")
        conf = v.confirmation
        confirmed = (f"; {conf.sentence()}" if conf is not None and conf.status != "unconfirmed" else
                     "; unconfirmed by training (steps=0: the forensic pass)" if conf is not None and not conf.reason
                     else f"; {conf.sentence()}" if conf is not None else "")
        tol = v.tolerances or {}
        tol_txt = (f" Tolerances of this verdict: {', '.join(f'{k} {x:.3g}' for k, x in tol.items())} (relative)."
                   if tol else "")
        out.append(f"Use {rec} autocast{how}: {why} (loss {loss:.4g} against {ref_loss:.4g} in fp32){confirmed}"
                   + (f"; {others}" if others else "") + "." + tol_txt)
    info = r.confirmation
    if info.get("trained"):
        each = " each" if len(info["trained"]) > 1 else ""
        out.append(f"The confirmation trained {' and '.join(info['trained'])}, {info['steps']} steps{each} beside fp32 "
                   f"with {info['optimizer']}, on {info['batch']}.")
    elif info.get("error"):
        out.append(_sentence(f"The recipes could not be confirmed by training: {info['error']}"))
    if ev.ctx.dev.type == "cpu":
        chosen = pick(ev.ctx.dev)
        if chosen.precision == "fp32":
            # chosen.units is "fp32" here: name the units this CPU lacks (pick's reason), not the fp32 it keeps
            lacks = pick(ev.ctx.dev, "bf16").units
            out.append(f"On this CPU ampcourse.device.pick() keeps fp32 too ({lacks})." if rec == "fp32" else
                       f"On this CPU ampcourse.device.pick() keeps fp32 ({lacks}): {rec} is correct here but "
                       "slower than fp32; it pays on hardware with units for it.")
        else:
            out.append(f"On this CPU ampcourse.device.pick() chooses {chosen.precision} ({chosen.units}); low "
                       "precision is only faster where the CPU has the units for it.")
    g = r.gradients
    if rec == "fp16" and rank <= 1 and "recommended_scale" in g:
        k = int(math.log2(g["recommended_scale"]))
        if ev.low_trainable == "fp16" and rank == 0:
            out.append("Do not add a GradScaler: the trainable parameters are fp16, whose gradients it refuses to "
                       "unscale; the fp16 backward ran at scale 1 here.")
        else:
            dflt, backoffs = 2**16, g.get("default_backoff_steps", 0)
            ratio = g["recommended_scale"] / dflt
            cost = (f"it costs {backoffs} skipped step(s) to back off from 2**16" if backoffs else
                    f"from 2**16 it grows only x2 per growth_interval (2000) steps, so set init_scale" if ratio > 1
                    else "")
            out.append(f"Use torch.amp.GradScaler({r.device.split(':')[0]!r}, init_scale=2**{k})"
                       + (" on the fp32 master weights" if rank == 1 and "master_weights" in v.needs else "")
                       + f": max|grad| {g['max']:.3g} x 2**{k} stays {rules.headroom(g['max'], 2.0**k)} below 65504, "
                       "leaving "
                       f"{g['flush_at_recommended']:.2%} of the gradients flushed (against {g['flush_at_1']:.2%} at "
                       "scale 1" + ("; none flush at scale 1 on this batch, so it only guards later steps, whose "
                                    "gradients shrink as training converges" if g["flush_at_1"] == 0 else "")
                       + f"); GradScaler's default init_scale is 2**16 ({g.get('flush_at_default', 0):.2%} flushed"
                       + (", predicted from the fp32 gradients" if rules.default_share_predicted(g) else "")
                       + f"{'; ' + cost if cost else ''}); the fp16 backward ran at 2**{k} here.")
    elif rec == "bf16" and rank <= 1:
        out.append("No GradScaler: bf16 has fp32's exponent range"
                   + (f" ({g['bf16_flush_at_1']:.3%} of the gradients flush at scale 1)." if "bf16_flush_at_1" in g
                      else "."))
    for f in r.findings:
        if f.phase == "optimizer" and f.severity != "info":
            out.append(_sentence(f"The optimizer step ({f.kind}): {f.message}"))
        elif f.kind == "low_precision_model":
            out.append(_sentence(f.message))
    return out + _loss_side(r)


def _loss_side(r: Report) -> list[str]:
    """Advice about the loss (compute it in fp32), once, naming every precision it applies to."""
    loss = [f for f in r.findings if f.fix == "loss_fp32" and f.severity != "info"]
    if not loss:
        return []
    precs = sorted({f.precision for f in loss})
    first = loss[0].message.rstrip(".")
    return [f"Compute the loss in fp32 for {' and '.join(precs)} (outside autocast, on .float() outputs; it applies to "
            f"every precision listed): {first[0].lower() + first[1:]}."]
