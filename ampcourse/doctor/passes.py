"""The passes: one fp32 reference forward + backward (histograms of every module's outputs and gradients, the fp32
parameter gradients), one forward + backward per precision under autocast with the instruments of :mod:`.watch`
(fp16's through a real GradScaler), and an unwatched pass for a second scale; each parameter's gradient compared with
fp32's. Every pass starts from cloned inputs, the caller's buffers and the caller's torch, CUDA, Python and NumPy RNG
states (:mod:`.snapshot`), so passes see the same data and dropout masks.
"""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from ..device import AmpSetup
from ..formats import AUTOCAST_DTYPES as _LOW
from ..models import data_errors
from ..policy import apply_policy, remove_policy
from .calls import LossShapeError, call, first_tensor, fresh_copy, grad_of, scalar_loss
from .hist import COUNT_CAP, Log2Hist
from .snapshot import Snapshot
from .watch import ModuleRecord, OpEvent, OpWatch, Tracker, _first_line


@dataclass
class Context:
    """What every pass needs: the model (and its fp32 reference copy), its inputs and loss, the device, the snapshot."""

    model: nn.Module
    ref_model: nn.Module  # the model itself when it is fp32 (or float64), else an fp32 copy
    inputs: Any
    targets: Any
    loss_fn: Callable | None
    dev: torch.device
    snapshot: Snapshot
    records: dict[str, ModuleRecord] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    param_grads: dict[str, Log2Hist] = field(default_factory=dict)
    ref_grads: dict[str, torch.Tensor] = field(default_factory=dict)  # fp32 gradients of the reference pass (dense)
    sparse_grads: set[str] = field(default_factory=set)  # parameters with sparse gradients (Embedding(sparse=True))
    ref_loss: float = math.nan
    ref_watch: OpWatch | None = None
    ref_layout: tuple | None = None  # _ref_layout's per-examine cache of what fp32's gradients alone determine
    host_rng: bool = True  # the fp32 reference drew from Python's random or NumPy's global stream
    overflow_at: float = 65504.0  # fp32 op outputs beyond this (fp16's max) are recorded by the reference op watch

    def reference_watch(self) -> OpWatch:
        """The op watcher's record of the fp32 reference, forward and backward. Run only when a precision made an
        inf/NaN (to tell its origins from those fp32 has too, and to say what an overflowing op reaches in fp32):
        a healthy model does not pay for a second reference pass."""
        if self.ref_watch is None:
            self.ref_watch = _reference_run(self, {}, [], True, keep=False)[1]
        return self.ref_watch

    def forward_loss(self, model: nn.Module, inputs, about_data: bool = True) -> torch.Tensor:
        """One forward pass and the loss, with the model's own errors turned into a ValueError about the data (not
        with about_data=False: under autocast, after the fp32 reference ran on the same data, the data is not it)."""
        if not about_data:
            return scalar_loss(call(model, inputs), self.targets, self.loss_fn)
        targets = self.targets if isinstance(self.targets, torch.Tensor) else None
        try:
            with data_errors(model, first_tensor(inputs), targets):
                return scalar_loss(call(model, inputs), self.targets, self.loss_fn)
        except ValueError as err:
            if isinstance(err.__cause__, LossShapeError):  # what the call returned, not the data: say that alone
                raise ValueError(str(err.__cause__)) from None
            raise


def _float_dtype(model: nn.Module) -> torch.dtype | None:
    """The floating dtype of the model's parameters when it is not float32 (float16, bfloat16, float64), else None."""
    dts = {p.dtype for p in model.parameters() if p.is_floating_point()}
    return None if not dts or dts == {torch.float32} else max(dts, key=lambda d: (d == torch.float64, d.itemsize))


def reference_pass(ctx: Context, watch_ops: bool = False) -> float:
    """fp32 forward + backward on the reference model: activation and gradient histograms; keeps the fp32 parameter
    gradients; returns the loss. With watch_ops, the op watcher runs too (see Context.reference_watch)."""
    loss, watch = _reference_run(ctx, ctx.records, ctx.order, watch_ops, keep=True)
    # did the forward draw from Python's or NumPy's stream? (reset_rng put them at the caller's state first)
    ctx.host_rng = random.getstate() != ctx.snapshot.py_rng or not _same_np_state(np.random.get_state(),
                                                                                  ctx.snapshot.np_rng)
    if watch is not None:
        ctx.ref_watch = watch
    return loss


def _reference_run(ctx: Context, records: dict[str, ModuleRecord], order: list[str], watch_ops: bool,
                   keep: bool) -> tuple[float, OpWatch | None]:
    """One fp32 forward + backward of the reference model from the caller's RNG and buffers."""
    ctx.snapshot.reset_rng()
    ctx.snapshot.reset_buffers()
    model = ctx.ref_model
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    saved = {id(p): p.grad for _, p in params}  # the reference may be the model itself: its .grad is the caller's
    for _, p in params:
        p.grad = None
    low = _float_dtype(ctx.model)  # an fp16/bf16 model's batch is fp16/bf16 too: the fp32 copy takes it in fp32
    inputs = fresh_copy(ctx.inputs, torch.float32 if low in _LOW else None)
    tracker = Tracker(model, records, order, "fp32", ctx.dev, grads=True, tag=watch_ops)
    watch = OpWatch(tracker, ctx.overflow_at) if watch_ops else None
    try:
        with tracker, torch.autocast(ctx.dev.type, enabled=False):
            with watch if watch is not None else contextlib.nullcontext():
                loss = ctx.forward_loss(model, inputs)
                if tracker.tagging:
                    tracker.tag([loss], ("", -1))
                if loss.requires_grad:
                    tracker.in_backward = True
                    loss.backward()
                    tracker.in_backward = False
        if keep:
            counter = tracker.counter  # its buffer, flushed: one buffer per pass
            for n, p in params:
                g = grad_of(p)
                if g is not None:
                    if p.grad.is_sparse:
                        ctx.sparse_grads.add(n)
                    counter.add(g, [ctx.param_grads.setdefault(n, Log2Hist())], COUNT_CAP)
                    ctx.ref_grads[n] = g.float()
            counter.flush()
    finally:
        for _, p in params:
            p.grad = saved[id(p)]
    return float(loss.detach()), watch


def _same_np_state(a, b) -> bool:
    """Two NumPy legacy RNG states are the same (their key arrays compared by value)."""
    return a[0] == b[0] and bool(np.array_equal(a[1], b[1])) and tuple(a[2:]) == tuple(b[2:])


class PassFailed(Exception):
    """An autocast pass raised where the fp32 reference ran: the error, and the op and module where it was raised
    (None when it was not an op: a Python check in the model's code)."""

    def __init__(self, error: BaseException, where: OpEvent | None) -> None:
        super().__init__(f"{type(error).__name__}: {_first_line(error)}")
        self.error, self.where = error, where


@dataclass
class PassResult:
    """One pass under autocast, forward and backward: what it measured."""

    precision: str
    loss: float
    records: dict[str, ModuleRecord]
    watch: OpWatch
    scale: float
    grads: dict[str, dict[str, float]] = field(default_factory=dict)  # per parameter: error, flushed share, nonfinite
    error: str = ""  # the exception's first line, when the pass could not run
    islands: tuple[str, ...] = ()  # the fp32 islands it ran with
    #: fp16 with at_1: the same per-parameter comparison for the backward at scale 1 (no GradScaler); None if not run
    grads_at_1: dict[str, dict[str, float]] | None = None
    #: the learner's loss_fn run in fp32 (autocast off) on this pass's output cast to fp32: whether computing the loss
    #: in fp32 closes a loss gap, or the output itself lost what the loss measures; nan without a loss_fn
    loss_fp32_on_output: float = math.nan


def autocast_pass(ctx: Context, amp: AmpSetup, islands: Sequence[str] = (), scale: float = 1.0,
                  backward: bool = True, tag: bool = False, at_1: bool = False) -> PassResult:
    """One forward (and backward) pass of the model as it is under autocast, with fp32 islands if given.

    fp16's backward runs through a real ``torch.amp.GradScaler`` at ``scale`` (its scale(), as a training step's);
    the gradients are divided by the scale (exact: a power of two) and compared with fp32's, parameter by parameter.
    With ``at_1`` (and a scale other than 1) the same forward's graph is also run backward at scale 1 first,
    unwatched (no op watch, no tags: only the parameter gradients count), into ``result.grads_at_1``: what a
    separate :func:`gradient_pass` at scale 1 gives, without a second forward.
    """
    ctx.snapshot.reset_rng()
    ctx.snapshot.reset_buffers()
    model = ctx.model
    records = {n: ModuleRecord(n, r.leaf, samples=r.samples) for n, r in ctx.records.items()}
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    for _, p in params:
        p.grad = None  # the caller's gradients are in the snapshot
    remove_policy(model)
    rules = {**ctx.snapshot.policy, **{n: "fp32" for n in islands}}
    if rules:
        apply_policy(model, rules)
    # Tagging autograd nodes with module calls costs a walk of the graph per module call; it only matters when a
    # backward op makes an inf/NaN, so the pass runs again with tags then (same inputs, RNG: the same ops).
    tracker = Tracker(model, records, [], amp.precision, ctx.dev, grads=backward, tag=tag)
    tracker.host_rng = ctx.host_rng
    watch = OpWatch(tracker)
    tracker.watch = watch
    inputs = fresh_copy(ctx.inputs)
    result = PassResult(amp.precision, math.nan, records, watch, scale, islands=tuple(islands))
    at_1_grads = None
    # Autocast caches its casts of the weights until the outermost autocast context exits; examine() runs inside a
    # disabled one (the caller's autocast off), so the cache would carry fp16 weights into the bf16 pass: clear it.
    torch.clear_autocast_cache()
    try:
        with tracker, torch.set_grad_enabled(backward), _raising_as(watch):
            with watch:
                with amp.autocast():
                    out = call(model, inputs)
                    loss = scalar_loss(out, ctx.targets, ctx.loss_fn)
                result.loss = float(loss.detach().float())
            result.loss_fp32_on_output = _loss_in_fp32(ctx, out, amp)
            del out
            if backward and loss.requires_grad:
                if tracker.tagging:
                    tracker.tag([loss], ("", -1))
                at_1_grads = _backward_at_1(params, loss) if at_1 and scale != 1.0 else None
                scaler = torch.amp.GradScaler(ctx.dev.type, init_scale=scale, enabled=scale != 1.0)
                scaled = scaler.scale(loss)
                # The backward's only use of the op watch is an inf/NaN's origin: it runs watched (and tagged) only
                # in the rerun below, when the loss or a parameter's gradient came back inf/NaN (what a GradScaler
                # skips a step for). A healthy pass skips a Python call per backward op.
                with watch if tag else contextlib.nullcontext():
                    tracker.in_backward = True
                    scaled.backward()
                    tracker.in_backward = False
        if backward:
            result.grads = _compare_grads(ctx, params, scale)
        if backward and not tag and (not math.isfinite(result.loss)
                                     or any(g["nonfinite"] for g in result.grads.values())):
            remove_policy(model)
            return autocast_pass(ctx, amp, islands, scale, backward, tag=True, at_1=at_1)
        if backward and at_1_grads is not None:
            for n, p in params:
                p.grad = at_1_grads.get(n)
            result.grads_at_1 = _compare_grads(ctx, params, 1.0)
    finally:
        torch.clear_autocast_cache()
        remove_policy(model)
        for _, p in params:
            p.grad = None
    return result


def _loss_in_fp32(ctx: Context, out, amp: AmpSetup) -> float:
    """The learner's loss_fn on `out` cast to fp32, autocast off, no graph: nan without a loss_fn (a model that returns
    its own loss computes it inside) or when the loss refuses the copy (a ModelOutput's fields become a dict)."""
    if ctx.loss_fn is None:
        return math.nan
    try:
        with torch.no_grad(), torch.autocast(ctx.dev.type, enabled=False):
            return float(scalar_loss(fresh_copy(out, torch.float32), ctx.targets, ctx.loss_fn).float())
    except Exception:  # noqa: BLE001 (the copy is not what the loss takes: no verdict rests on it)
        return math.nan


def _backward_at_1(params, loss: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """The parameter gradients of one unwatched backward at scale 1 through loss's graph (kept for the scaled
    backward after it), taken off the parameters; None when it raises (the watched passes report what raises)."""
    try:
        loss.backward(retain_graph=True)
    except Exception:  # noqa: BLE001
        for _, p in params:
            p.grad = None
        return None
    grads = {n: grad_of(p) for n, p in params if p.grad is not None}
    for _, p in params:
        p.grad = None
    return grads


def gradient_pass(ctx: Context, amp: AmpSetup, islands: Sequence[str] = (), scale: float = 1.0
                  ) -> dict[str, dict[str, float]]:
    """One forward + backward of the model as it is under autocast, with nothing watched (no hooks, no op watch, no
    reruns): only its parameter gradients against fp32's (:func:`_compare_grads`), at ``scale`` (1.0: no
    GradScaler). What a second scale needs, at the price of the plain passes alone."""
    ctx.snapshot.reset_rng()
    ctx.snapshot.reset_buffers()
    model = ctx.model
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    for _, p in params:
        p.grad = None
    remove_policy(model)
    rules = {**ctx.snapshot.policy, **{n: "fp32" for n in islands}}
    if rules:
        apply_policy(model, rules)
    torch.clear_autocast_cache()
    try:
        with amp.autocast():
            loss = ctx.forward_loss(model, fresh_copy(ctx.inputs), about_data=False)
        if loss.requires_grad:
            (loss * scale if scale != 1.0 else loss).backward()
        return _compare_grads(ctx, params, scale)
    finally:
        torch.clear_autocast_cache()
        remove_policy(model)
        for _, p in params:
            p.grad = None


@contextlib.contextmanager
def _raising_as(watch: OpWatch):
    """Turn what a pass raises (not running out of memory) into PassFailed, with the op where it was raised."""
    try:
        yield
    except torch.OutOfMemoryError:
        raise
    except Exception as err:
        where, t = watch.raised, watch.tracker
        if where is None and t.raised_in is not None:  # not an op: the module whose own code raised
            where = OpEvent("forward", t.raised_in, -1, False, "", 0, math.nan, math.nan)
        raise PassFailed(err, where) from err


def _compare_grads(ctx: Context, params, scale: float) -> dict[str, dict[str, float]]:
    """Per parameter: relative error against fp32's gradient, the share of fp32's nonzero entries that came back
    zero (flushed), and the inf/NaN count, after dividing by the scale (a handful of batched reductions and one
    read-back for all parameters: a loop of small reductions per parameter cost more than the backward). What
    depends on fp32's gradients alone (their norms, their nonzero counts, where their few zeros are) is computed
    once per examine (:func:`_ref_layout`); the flushed counts are each gradient's zeros (one foreach count of the
    nonzero values for all parameters) less fp32's own zeros that stayed zero."""
    out = {}
    pairs = [(n, grad_of(p), ctx.ref_grads[n]) for n, p in params if n in ctx.ref_grads and p.grad is not None]
    for n, p in params:
        ref = ctx.ref_grads.get(n)
        if ref is not None and p.grad is None:
            den = float(torch.linalg.vector_norm(ref))
            out[n] = {"error": 1.0, "num": den, "den": den, "flushed": 1.0 if den else 0.0, "nonfinite": 0}
    if not pairs:
        return out
    names = [n for n, _, _ in pairs]
    refs = [r for _, _, r in pairs]
    dens, lives, ref_zeros = _ref_layout(ctx, names, refs)
    grads = [g.float() if g.dtype != torch.float32 else g for _, g, _ in pairs]
    # g / scale - ref, as (g - scale * ref) / scale: the same roundings (scale is a power of two), one copy fewer
    diffs = torch._foreach_sub(grads, refs, alpha=scale) if scale != 1.0 else torch._foreach_sub(grads, refs)
    flushed = [g.numel() - nz for g, nz in zip(grads, _nonzero_counts(grads))]  # zeros, fp32's own ones included
    for i, where in ref_zeros.items():
        if flushed[i]:  # fp32's own zeros (unused embedding rows) that stayed zero were not flushed
            flushed[i] -= int((grads[i].reshape(-1)[where] == 0).sum())
    nums = [x / scale for x in torch.stack(torch._foreach_norm(diffs)).double().cpu().tolist()]
    for i, (n, num, n_flushed) in enumerate(zip(names, nums, flushed)):
        den, n_live = dens[i], lives[i]
        # a gradient with an inf/NaN makes the norm of its difference inf/NaN (fp32's is finite where this is asked)
        bad = 0 if math.isfinite(num) else int((~torch.isfinite(grads[i])).sum())
        if not bad and not (math.isfinite(num) and math.isfinite(den)):
            # finite gradients whose squares (or scale x fp32's) pass float32's range: their norms in float64
            num = float(torch.linalg.vector_norm(grads[i].double() / scale - refs[i].double()))
            den = float(torch.linalg.vector_norm(refs[i], dtype=torch.float64))
        num = num if not bad and math.isfinite(num) else math.inf
        out[n] = {"error": num / den if den else (0.0 if num == 0 else math.inf), "num": num, "den": den,
                  "flushed": n_flushed / n_live if n_live else 0.0, "nonfinite": bad, "live": int(n_live)}
    return out


def _ref_layout(ctx: Context, names: list[str], refs: list[torch.Tensor]
                ) -> tuple[list[float], list[int], dict[int, torch.Tensor]]:
    """(norm of each fp32 gradient, its count of nonzero values, the flat positions of its zeros for those that
    have any) for these parameters, computed once per examine and kept on ctx."""
    key = tuple(names)
    if ctx.ref_layout is None or ctx.ref_layout[0] != key:
        lives = _nonzero_counts(refs)
        zeros = {i: (r.reshape(-1) == 0).nonzero().reshape(-1) for i, (r, live) in enumerate(zip(refs, lives))
                 if live < r.numel()}  # a gradient is mostly nonzero: few parameters have zeros, and few of them
        dens = torch.stack(torch._foreach_norm(refs)).double().cpu().tolist()
        ctx.ref_layout = (key, dens, lives, zeros)
    return ctx.ref_layout[1:]


#: the most values a float32 count holds exactly: a larger tensor's nonzero values are counted on their own
_EXACT_COUNT = 2**24


def _nonzero_counts(tensors: list[torch.Tensor]) -> list[int]:
    """How many values of each tensor are not zero (an inf or NaN is not zero; -0.0 is), all in one foreach L0 norm
    read back once: float32 counts, exact up to 2**24 values (a larger tensor is counted exactly on its own)."""
    counts = torch.stack(torch._foreach_norm(tensors, 0)).double().cpu().tolist()
    return [int(c) if t.numel() <= _EXACT_COUNT else int((t != 0).sum()) for c, t in zip(counts, tensors)]
