"""``plan(model, inputs, gpu=...)``: one training step counted on meta tensors, predicted per recipe on a GPU."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from .. import _args
from .capture import StepCounts, capture_step
from .gpus import GPU, GPUS
from .roofline import OpTime, step_time

__all__ = ["PRECISIONS", "PlanReport", "plan"]

#: The recipes a plan predicts: fp32 with TF32 off, fp32 with TF32 matmuls, bf16 and fp16 autocast (fp16 with a
#: GradScaler), all with fp32 master weights (torch.amp).
PRECISIONS = ("fp32", "tf32", "bf16", "fp16")


@dataclass
class PlanReport:
    """A plan's answer: per recipe the step time, the peak memory, and every op's predicted time.

    Attributes:
        gpu: the GPU predicted for.
        precisions: the recipes, in the order asked.
        counts: per recipe what was counted (ops, bytes of weights, gradients, optimizer state, activations).
        step_seconds: per recipe the predicted step time (the larger of GPU time and host issue time).
        gpu_seconds, host_seconds: the two sides of that maximum.
        peak_memory_bytes: per recipe the most bytes live at once during the step.
        ops: per recipe the per-op predictions (:class:`ampcourse.plan.roofline.OpTime`).
        policy: the autocast policy applied to the low-precision recipes.
        plan_seconds: how long counting took on this machine.

    Example:
        >>> report = plan(model, tokens, gpu="h100-sxm", loss_fn=loss, targets=targets)
        >>> report.step_seconds["fp32"] / report.step_seconds["bf16"]     # AMP's predicted speedup
        >>> print(report.table("bf16", top=10))
    """

    gpu: GPU
    precisions: tuple[str, ...]
    counts: dict[str, StepCounts]
    step_seconds: dict[str, float]
    gpu_seconds: dict[str, float]
    host_seconds: dict[str, float]
    peak_memory_bytes: dict[str, int]
    ops: dict[str, list[OpTime]]
    policy: str
    plan_seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def on(self, gpu: str | GPU) -> "PlanReport":
        """The same counted step timed on another GPU (counting is device-independent: nothing is re-run).

        Example:
            >>> h100 = report.on("h100-sxm")
        """
        target = gpu if isinstance(gpu, GPU) else GPUS[_args.choice(gpu, "gpu", tuple(GPUS))]
        return _timed(target, self.precisions, self.counts, self.plan_seconds)

    def plot(self, precisions: Sequence[str] | None = None, top: int = 8, ax=None):
        """Bars of GPU time per op group and recipe (log scale); hatched where the group is memory-bound.

        Args:
            precisions: the recipes to show (default: all).
            top: op groups shown (the longest in the first recipe; the rest summed as "other ops").
            ax: a matplotlib axis (default: a new figure).
        """
        import matplotlib.pyplot as plt
        precisions = _args.names(precisions or self.precisions, "precisions", self.precisions)
        totals: dict[str, dict[str, dict[str, float]]] = {}
        for p in precisions:
            per: dict[str, dict[str, float]] = defaultdict(lambda: {"compute": 0.0, "memory": 0.0})
            for t in self.ops[p]:
                per[_group(t.record)][t.bound] += t.seconds * 1e3
            totals[p] = per
        first = totals[precisions[0]]
        names = sorted(first, key=lambda n: -sum(first[n].values()))[:top]
        if ax is None:
            _, ax = plt.subplots(figsize=(9, 0.5 * (len(names) + 1) + 1.4), dpi=80)
        height = 0.8 / len(precisions)
        for i, p in enumerate(precisions):
            rest = {"compute": 0.0, "memory": 0.0}
            for n, v in totals[p].items():
                if n not in names:
                    rest["compute"] += v["compute"]
                    rest["memory"] += v["memory"]
            groups = [totals[p].get(n, {"compute": 0.0, "memory": 0.0}) for n in names] + [rest]
            ys = [j + i * height for j in range(len(groups))]
            widths = [g["compute"] + g["memory"] for g in groups]
            bars = ax.barh(ys, widths, height=height, label=p)
            for bar, g in zip(bars, groups):
                if g["memory"] > g["compute"]:
                    bar.set_hatch("//")
        ax.set_yticks([j + 0.4 - height / 2 for j in range(len(names) + 1)], [*names, "other ops"])
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set(xlabel="predicted GPU time per step (ms, log scale); hatched: memory-bound",
               title=f"{self.gpu.name}: time per op group")
        ax.legend(fontsize=8, loc="lower right")
        ax.figure.tight_layout()
        return ax

    def _planned(self, precision: str, name: str = "precision") -> str:
        """precision if this report planned it; a one-line ValueError naming what was planned otherwise."""
        if isinstance(precision, str) and precision in self.precisions:
            return precision
        planned = ", ".join(self.precisions)
        if isinstance(precision, str) and precision in PRECISIONS:
            raise _args.InputError(f"{name}={precision!r} was not planned (this report has {planned}): pass one of "
                                   f"those, or plan again with precisions=(..., {precision!r})")
        raise _args.InputError(f"{name} must be one of this report's recipes, {planned} (plan knows "
                               f"{', '.join(PRECISIONS)}); got {_args.shown(precision)}")

    def speedup(self, precision: str, over: str = "fp32") -> float:
        """Predicted step-time ratio ``over / precision`` (> 1: precision is faster).

        Args:
            precision: a recipe this report planned.
            over: the recipe compared with (default fp32, which must have been planned).

        Example:
            >>> report.speedup("bf16")            # fp32 step time / bf16 step time
            >>> report.speedup("bf16", over="tf32")
        """
        precision, over = self._planned(precision), self._planned(over, "over")
        return self.step_seconds[over] / self.step_seconds[precision]

    def split(self, precision: str) -> dict[str, float]:
        """GPU seconds of the recipe's step by kind: matmuls (compute-bound and memory-bound) and the rest."""
        out: dict[str, float] = defaultdict(float)
        for t in self.ops[self._planned(precision)]:
            kind = "matmul" if t.record.matmul else "other"
            out[f"{kind}, {t.bound}-bound"] += t.seconds
        return dict(out)

    def matmul_speedup(self, precision: str, over: str = "fp32") -> float:
        """The speedup of the matmul-like ops alone: what the tensor cores buy before the rest of the step dilutes it."""
        def mm(p: str) -> float:
            return sum(t.seconds for t in self.ops[p] if t.record.matmul)
        return mm(self._planned(over, "over")) / mm(self._planned(precision))

    def memory(self, precision: str) -> dict[str, int]:
        """Bytes of the recipe's step: weights, gradients, optimizer state, activations saved, peak.

        Under torch.amp the parameters themselves are the fp32 master weights (autocast's low-precision copies are
        transient and counted in the activations, as "of which weight copies"); a model whose parameters are bf16
        with an optimizer that keeps fp32 masters shows those masters in "optimizer state".
        """
        c = self.counts[self._planned(precision)]
        return {"weights": c.weights_bytes, "gradients": c.gradients_bytes,
                "optimizer state": c.optimizer_state_bytes, "activations saved": c.saved_bytes,
                "of which weight copies": c.weight_copy_bytes, "peak": c.peak_bytes}

    def rows(self, precision: str) -> list[dict]:
        """The per-op table of a recipe, grouped by phase, op and dtype, longest first."""
        groups: dict[tuple, dict] = {}
        for t in self.ops[self._planned(precision)]:
            r = t.record
            key = (r.phase, r.op, r.dtype, t.bound)
            g = groups.setdefault(key, {"phase": r.phase, "op": r.op, "dtype": r.dtype, "bound": t.bound,
                                        "math": t.math, "count": 0, "flops": 0, "bytes": 0, "saved": 0,
                                        "seconds": 0.0})
            g["count"] += 1
            g["saved"] += r.saved_bytes
            g["flops"] += r.flops
            g["bytes"] += r.bytes_read + r.bytes_written
            g["seconds"] += t.seconds
        return sorted(groups.values(), key=lambda g: -g["seconds"])

    def table(self, precision: str | None = None, top: int = 12) -> str:
        """The longest op groups of a recipe (default: the last asked) as text."""
        p = self.precisions[-1] if precision is None else self._planned(precision)
        total = self.gpu_seconds[p]
        lines = [f"{self.gpu.name}, {p}: the {top} longest op groups of {total * 1e3:.2f} ms on the GPU",
                 f"{'phase':9} {'op':46} {'dtype':9} {'n':>4} {'GFLOP':>9} {'MB':>9} {'saved MB':>9} {'ms':>8} "
                 f"{'share':>6}  bound"]
        for g in self.rows(p)[:top]:
            lines.append(f"{g['phase']:9} {g['op'].removeprefix('aten.')[:46]:46} {g['dtype']:9} {g['count']:>4} "
                         f"{g['flops'] / 1e9:>9.1f} {g['bytes'] / 1e6:>9.1f} {g['saved'] / 1e6:>9.1f} "
                         f"{g['seconds'] * 1e3:>8.2f} {g['seconds'] / total:>6.1%}  {g['bound']}")
        return "\n".join(lines)

    def summary(self) -> str:
        """One line per recipe (step time, speedup over fp32, what bounds it, peak memory), then what the fp32
        recipes' maths really is where that differs from plain fp32, and the report's notes.

        Example:
            >>> print(report.summary())
        """
        lines = [f"plan on {self.gpu.name} (predicted; autocast policy: {self.policy})"]
        base = "fp32" if "fp32" in self.step_seconds else self.precisions[0]
        for p in self.precisions:
            split = self.split(p)
            compute = sum(v for k, v in split.items() if k.endswith("compute-bound")) / self.gpu_seconds[p]
            bound = "host (launch)-bound" if self.host_seconds[p] > self.gpu_seconds[p] else f"{compute:.0%} compute-bound"
            maths = self._matmul_dtype(p)
            own = f"  maths in {maths}, not fp32" if p in ("fp32", "tf32") and maths not in ("float32", None) else ""
            lines.append(f"  {p:5} step {self.step_seconds[p] * 1e3:9.2f} ms  x{self.speedup(p, base):5.2f} vs {base}  "
                         f"{bound:22} peak {_size(self.peak_memory_bytes[p])}{own}")
        fp32ish = [p for p in self.precisions if p in ("fp32", "tf32")]
        if any(t.math == "3xtf32" for p in fp32ish for t in self.ops[p]):
            lines.append(f"  {'/'.join(fp32ish)} attention: torch's fp32 memory-efficient kernel runs 3xTF32 on the "
                         f"tensor cores (a third of the TF32 rate) whatever the TF32 setting")
        if "fp32" in self.precisions and any("convolution" in t.record.op for t in self.ops["fp32"]):
            lines.append("  fp32 means TF32 off for convolutions too: torch's default (cudnn.allow_tf32=True) runs "
                         "them in TF32, at the tf32 recipe's rate")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _matmul_dtype(self, precision: str) -> str | None:
        """The dtype most of a recipe's matmul FLOPs run in (None without matmuls)."""
        flops: dict[str, int] = defaultdict(int)
        for r in self.counts[precision].ops:
            if r.flops:
                flops[r.dtype] += r.flops
        return max(flops, key=flops.get) if flops else None

    def __repr__(self) -> str:
        return self.summary()

    def to_dict(self) -> dict:
        """The report as plain data (JSON-ready)."""
        return {"gpu": self.gpu.key, "policy": self.policy, "precisions": list(self.precisions),
                "step_seconds": self.step_seconds, "gpu_seconds": self.gpu_seconds, "host_seconds": self.host_seconds,
                "peak_memory_bytes": self.peak_memory_bytes,
                "memory": {p: self.memory(p) for p in self.precisions},
                "ops": {p: self.rows(p) for p in self.precisions}, "plan_seconds": self.plan_seconds,
                "notes": self.notes}

    def to_json(self, path: str) -> None:
        """Write :meth:`to_dict` to path."""
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(self.to_dict(), fh, indent=1)


def _size(nbytes: int) -> str:
    """Bytes as GiB, MiB or KiB, whichever reads best."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if nbytes >= scale:
            return f"{nbytes / scale:7.2f} {unit}"
    return f"{nbytes / 2**10:7.2f} KiB"


def _group(record) -> str:
    """An op's group for the plot: phase and op, with the attention kernels (flash, memory-efficient) as one."""
    op = record.op.removeprefix("aten.").lstrip("_")
    if "attention" in op:
        op = "attention" + ("_backward" if op.endswith("backward") else "")
    return f"{record.phase[:3]} {op.removesuffix('_backward')}" if record.phase != "forward" else f"fwd {op}"


def _check(model, inputs, gpu, precisions, loss_fn, optimizer, accum_steps) -> tuple[GPU, tuple[str, ...], int]:
    """Validate plan()'s arguments before any work; ValueError naming the argument."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {_args.shown(model)}")
    leaves = inputs.values() if isinstance(inputs, Mapping) else inputs if isinstance(inputs, tuple) else [inputs]
    if not isinstance(inputs, (torch.Tensor, tuple, Mapping)) or not any(isinstance(t, torch.Tensor) for t in leaves):
        raise ValueError("inputs must be a tensor, a tuple of tensors or a dict of keyword tensors, got "
                         f"{_args.shown(inputs)}")
    if isinstance(gpu, GPU):
        target = gpu
    else:
        key = _args.choice(gpu, "gpu", tuple(GPUS))
        target = GPUS[key]
    if isinstance(precisions, str):
        precisions = (precisions,)
    precisions = tuple(_args.choice(p, "precisions", ("fp32", "tf32", "bf16", "fp16")) for p in precisions)
    if not precisions or len(set(precisions)) != len(precisions):
        raise ValueError(f"precisions must be distinct names from fp32, tf32, bf16, fp16, got {precisions!r}")
    if loss_fn is not None and not callable(loss_fn):
        raise ValueError(f"loss_fn must be a callable (output, targets) -> loss or None, got {_args.shown(loss_fn)}")
    if optimizer is not None and not callable(optimizer):
        raise ValueError("optimizer must be a callable params -> torch.optim.Optimizer (e.g. "
                         f"lambda ps: torch.optim.SGD(ps, lr=0.1)) or None, got {_args.shown(optimizer)}")
    return target, precisions, _args.integer(accum_steps, "accum_steps", low=1)


def plan(model: nn.Module, inputs, gpu: str | GPU = "a100-sxm4-80gb", precisions: Sequence[str] = PRECISIONS, *,
         loss_fn: Callable | None = None, targets=None, optimizer: Callable | None = None,
         accum_steps: int = 1) -> PlanReport:
    """Predict one training step of model on a GPU in each recipe, counted on meta tensors (nothing is computed).

    A step is ``accum_steps`` forward + backward passes and one optimizer step (AdamW with fp32 state by
    default), under CUDA's autocast policy for bf16 and fp16 (fp16 with a GradScaler's scale and unscale), with
    fp32 master weights. The model is never moved or changed; it may live on the meta device.

    Args:
        model: the model.
        inputs: a tensor, a tuple of positional tensors, or a dict of keyword tensors (a Hugging Face model given
            ``labels`` returns its own loss).
        gpu: a key of :data:`GPUS` (``"a100-sxm4-80gb"``, ``"h100-sxm"``, ...) or a :class:`GPU`.
        precisions: recipes from ``fp32`` (TF32 off), ``tf32``, ``bf16``, ``fp16``.
        loss_fn: ``loss_fn(output, targets) -> scalar``; None if the model returns its loss.
        targets: what loss_fn compares with.
        optimizer: a callable ``params -> optimizer``, e.g. ``lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)``.
        accum_steps: micro-batches per optimizer step (gradient accumulation).

    Returns:
        A :class:`PlanReport`: ``step_seconds``, ``peak_memory_bytes``, ``table()``, ``summary()``.

    Raises:
        NeedsRealValues: the forward reads a value (``.item()``, data-dependent control flow).

    Example:
        >>> from ampcourse.plan import plan
        >>> with torch.device("meta"):
        ...     net = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 10))
        >>> r = plan(net, torch.empty(512, 4096, device="meta"), gpu="h100-sxm",
        ...          loss_fn=torch.nn.functional.cross_entropy, targets=torch.zeros(512, dtype=torch.long))
        >>> round(r.speedup("bf16"), 1)
    """
    target, precisions, accum = _check(model, inputs, gpu, precisions, loss_fn, optimizer, accum_steps)
    start = time.perf_counter()
    counts: dict[str, StepCounts] = {}
    for p in precisions:
        recipe = "fp32" if p == "tf32" else p  # TF32 changes the math, not the ops or the bytes
        if recipe not in counts:
            counts[recipe] = capture_step(model, inputs, precision=recipe, loss_fn=loss_fn, targets=targets,
                                          optimizer=optimizer, accum_steps=accum)
        counts[p] = counts[recipe]
    return _timed(target, precisions, {p: counts[p] for p in precisions}, time.perf_counter() - start)


def _timed(target: GPU, precisions: tuple[str, ...], counts: dict[str, StepCounts], elapsed: float) -> PlanReport:
    """A report: each recipe's counted step timed on target."""
    step, gpu_s, host_s, ops, peak = {}, {}, {}, {}, {}
    for p in precisions:
        device, host, times = step_time(counts[p].ops, target, p)
        step[p], gpu_s[p], host_s[p], ops[p] = max(device, host), device, host, times
        peak[p] = counts[p].peak_bytes
    notes = []
    for p in precisions:
        mode = {"tf32": "tf32", "bf16": "bf16", "fp16": "fp16"}.get(p)
        if mode and mode not in target.peak_tflops:
            notes.append(f"{target.name} has no {mode} tensor-core math: {p} matmuls are predicted at its fp32 rate")
    if target.matmul_efficiency is None:
        notes.append(f"{target.name}: no published matmul measurement, the datasheet peak is the ceiling (optimistic)")
    for p in precisions:  # what counting found about the model itself (its parameters' dtype, accumulation)
        notes += [n for n in counts[p].notes if n not in notes]
    policy = next((counts[p].policy for p in precisions if p in ("bf16", "fp16")), "none (fp32 recipes only)")
    return PlanReport(target, precisions, counts, step, gpu_s, host_s, peak, ops, policy, elapsed, notes)



