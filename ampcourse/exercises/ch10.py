"""Chapter 10 exercises: TF32 rounding by hand, PaLM's z-loss in fp32 from bf16 logits, and a gradient all-reduce in
bf16 vs fp32 across real ranks under torchrun (10.3; see _torchrun.py), with its error measured against the exact mean.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from .. import formats
from ..reduce_sim import simulate_reduction
from ._core import call_learner, failed, passed

# _torchrun is imported where a launch happens, never at import (as in ch07): torchrun runs it as a script
# (-m ampcourse.exercises._torchrun), and a module the package already imported makes runpy warn in every worker.
if TYPE_CHECKING:
    from ._torchrun import RankResults

__all__ = ["check_tf32_round", "check_z_loss", "check_reduce_across_ranks", "TF32", "real_reduction"]

#: TF32 (from the formats registry): fp32's 8 exponent bits, fp16's 10 mantissa bits (19 bits; stored in a 32-bit word).
TF32 = formats.spec("tf32")


# --- 10.1 rounding to TF32 ------------------------------------------------------------------------

def _tf32_cases() -> torch.Tensor:
    """fp32 values to round: ties both ways, negatives, zeros, subnormals, the top of the range, random ones."""
    ulp = 2.0**-10
    tie_even, tie_odd = 1 + ulp / 2, 1 + ulp + ulp / 2  # exactly halfway: ties go to the even neighbour
    special = [0.0, -0.0, 1.0, tie_even, tie_odd, -tie_odd, 1 + ulp / 2 + 2.0**-20, 1 + ulp / 2 - 2.0**-20,
               3.14159265, -2.718281828, 1e-40, -3e-39, 3.3e38, 1e-3, 65504.0, 2.0**100 * 1.9999]
    gen = torch.Generator().manual_seed(10)
    rand = torch.randn(2000, generator=gen) * torch.exp2(torch.randint(-60, 60, (2000,), generator=gen).float())
    return torch.cat([torch.tensor(special, dtype=torch.float32), rand.float()])


def _truncate(x: torch.Tensor) -> torch.Tensor:
    """Drop the 13 low mantissa bits without rounding (what a wrong answer often does)."""
    return (x.view(torch.int32) & ~0x1FFF).view(torch.float32)


def check_tf32_round(tf32_round: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Exercise 10.1: tf32_round(x) rounds an fp32 tensor to TF32 (10 mantissa bits, nearest, ties to even),
    returned as fp32."""
    title = "Exercise 10.1 (rounding to TF32)"
    x = _tf32_cases()
    got = call_learner(title, tf32_round, x.clone())
    if not isinstance(got, torch.Tensor) or got.shape != x.shape:
        failed(title, f"a tensor of shape {tuple(x.shape)}", repr(got)[:80], "return a tensor shaped like x")
    if got.dtype != torch.float32:
        failed(title, "an fp32 tensor (TF32 values are stored in fp32)", str(got.dtype),
               "round the bits of the fp32 values and view them as fp32 again; do not cast to another dtype")
    want = torch.from_numpy(formats.quantize(x.numpy(), TF32)).float()
    bad = ~((got == want) | (got.isnan() & want.isnan()))
    if bad.any():
        i = int(bad.nonzero()[0])
        if torch.equal(got, _truncate(x)):
            hint = ("that truncates (rounds toward zero): add half an ulp first, 0xFFF plus the lowest kept bit "
                    "((bits >> 13) & 1), then clear the 13 low bits")
        elif torch.equal(got, x):
            hint = "the values came back unchanged: TF32 keeps 10 of fp32's 23 mantissa bits"
        else:
            hint = ("round to nearest, ties to even: on the int32 bits, bits + 0xFFF + ((bits >> 13) & 1), then "
                    "& ~0x1FFF; or compare with formats.quantize(x, TF32)")
        failed(title, f"{want[i].item()!r} for x = {x[i].item()!r}", got[i].item(), hint)
    passed(title, f"{x.numel()} values rounded to 10 mantissa bits, ties to even, as a TF32 tensor core reads them.")


# --- 10.2 z-loss ----------------------------------------------------------------------------------

def _z_loss(logits: torch.Tensor, weight: float) -> torch.Tensor:
    """PaLM's auxiliary loss: weight * mean(log Z ** 2), log Z = logsumexp of the logits, in fp32."""
    return weight * logits.float().logsumexp(-1).square().mean()


def check_z_loss(z_loss: Callable) -> None:
    """Exercise 10.2: z_loss(logits, weight) = weight * mean over positions of logsumexp(logits)**2, computed in
    fp32 even when the logits are bf16, differentiable."""
    title = "Exercise 10.2 (z-loss, in fp32)"
    gen = torch.Generator().manual_seed(2)
    cases = [(torch.randn(4, 8, 50, generator=gen), 1e-4), (torch.randn(3, 64, generator=gen) * 3 + 200, 1e-4),
             ((torch.randn(2, 5, 256, generator=gen) * 4 + 300).bfloat16(), 1e-3)]
    for logits, weight in cases:
        leaf = logits.clone().requires_grad_(True)
        got = call_learner(title, z_loss, leaf, weight)
        want = _z_loss(logits, weight)
        if not isinstance(got, torch.Tensor) or got.dim() != 0:
            failed(title, "a 0-d tensor (one number to add to the loss)", repr(got)[:80],
                   "average over every position: .mean() at the end")
        if got.dtype != torch.float32:
            failed(title, f"an fp32 loss for {str(logits.dtype)[6:]} logits", str(got.dtype),
                   "upcast first (logits.float()): log Z of bf16 logits near 300 is rounded to steps of 2 in bf16")
        if not got.requires_grad:
            failed(title, "a loss that backpropagates to the logits", "a result without grad",
                   "compute it with torch ops on the logits (no .item(), no torch.no_grad())")
        if not torch.allclose(got.detach(), want, rtol=1e-4):
            g = got.item()
            lse = logits.float().logsumexp(-1)
            if math.isclose(g, (weight * lse.mean().square()).item(), rel_tol=1e-4):
                hint = "square each position's log Z, then average (the mean of squares, not the square of the mean)"
            elif math.isclose(g, (weight * lse.abs().mean()).item(), rel_tol=1e-4):
                hint = "square log Z: the loss pushes log Z towards 0 from both sides"
            elif math.isclose(g, want.item() / weight, rel_tol=1e-4):
                hint = "multiply by the weight (PaLM uses 1e-4)"
            elif math.isclose(g, (weight * logits.logsumexp(-1).float().square().mean()).item(), rel_tol=1e-4):
                hint = "upcast before logsumexp, not after: logsumexp in bf16 has already rounded log Z"
            else:
                hint = "weight * logits.float().logsumexp(-1).square().mean()"
            failed(title, f"{want.item():.6g} for {str(logits.dtype)[6:]} logits of shape {tuple(logits.shape)}",
                   g, hint)
        got.backward()
        if leaf.grad is None or not torch.isfinite(leaf.grad).all():
            failed(title, "finite gradients on the logits", "none" if leaf.grad is None else "non-finite",
                   "keep the computation on the logits tensor you were given")
    passed(title, "log Z squared, averaged, weighted, and computed in fp32 from bf16 logits.")


# --- 10.3 all-reduce in bf16 vs fp32, on real ranks ------------------------------------------------

_RUNNERS = "ampcourse.exercises.ch10"
_NUMEL = 4096


def reference_reduce(grad, dtype):
    """Average `grad` over all ranks, communicating (and summing) in `dtype`; return the mean as fp32."""
    import torch
    import torch.distributed as dist

    wire = grad.to(dtype).div_(dist.get_world_size())  # divide first, as DDP's compression hooks do
    dist.all_reduce(wire)  # SUM, rounded to `dtype` at every addition
    return wire.float()


def _rank_grad(rank: int, device: torch.device) -> torch.Tensor:
    """This rank's gradient: a shared signal plus per-rank noise (same direction, different samples)."""
    gen = torch.Generator().manual_seed(0)
    signal = torch.randn(_NUMEL, generator=gen)
    noise = torch.randn(rank + 1, _NUMEL, generator=gen)[rank]
    return (signal + noise).to(device)


def _run_reduce(fn: Callable, ctx, params: dict) -> dict:
    """Worker side of 10.3: fn on this rank's gradient with dtype fp32 and bf16; what came back."""
    grad = _rank_grad(ctx.rank, ctx.device)
    out: dict = {"grad": grad.cpu()}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        got = fn(grad.clone(), dtype)
        if not isinstance(got, torch.Tensor):
            raise TypeError(f"expected a tensor back for dtype {name}, got {type(got).__name__}")
        out[name] = got.detach().cpu()
    return out


def _errors(res: RankResults, name: str) -> tuple[dict[str, float], float]:
    """(relative RMS error per dtype on rank 0 against the exact float64 mean, the simulated bf16 error)."""
    grads = torch.stack([r["grad"] for r in res.results[name]])
    exact = grads.double().mean(0)
    errs = {}
    for dtype in ("fp32", "bf16"):
        got = res.results[name][0][dtype].double()
        errs[dtype] = float((got - exact).norm() / exact.norm()) if got.shape == exact.shape else math.nan
    simulated = simulate_reduction(grads, dtype=torch.bfloat16, algorithm="ring").double()
    return errs, float((simulated - exact).norm() / exact.norm())


def check_reduce_across_ranks(reduce: Callable, nproc: int | None = None, device: str | None = None) -> None:
    """Exercise 10.3: reduce(grad, dtype) averages each rank's fp32 gradient over all ranks, communicating in
    `dtype`, and returns fp32; checked on N ranks under torchrun, with its error reported."""
    title = "Exercise 10.3 (gradients reduced in bf16 vs fp32 across ranks)"
    from ._torchrun import learner_source, run_on_ranks

    source = learner_source(title, reduce)
    res = run_on_ranks(title, f"{_RUNNERS}:_run_reduce", {"yours": (source, reduce.__name__)}, nproc=nproc,
                       device=device)
    judge_reduce(title, res, "yours")


def _on_bf16_grid(t: torch.Tensor) -> bool:
    """True if every value of the fp32 tensor is a bf16 value, up to fp32 rounding (a division by 3 in fp32, say)."""
    return bool(((t - t.bfloat16().float()).abs() <= t.abs() * 2.0**-16).all())


def judge_reduce(title: str, res: RankResults, name: str) -> None:
    """The verdict on solution `name` of a 10.3 launch (separate from the launch so tests batch several)."""
    errors = res.errors(name)
    if errors:
        rank, text = errors[0]
        if "NotImplementedError" in text:
            failed(title, "an implementation", "NotImplementedError",
                   "replace the `raise NotImplementedError` stub with your code")
        failed(title, "your function to run on every rank", f"rank {rank} raised {text}",
               "it runs in fresh processes with torch and dist imported; run dist.all_reduce on a tensor of `dtype`")
    world = res.nproc
    out = res.results[name]
    for dtype in ("fp32", "bf16"):
        got = [r[dtype] for r in out]
        if got[0].shape != (_NUMEL,):
            failed(title, f"a tensor of shape ({_NUMEL},) for dtype {dtype}", f"shape {tuple(got[0].shape)}",
                   "return the averaged gradient, shaped like the one you were given")
        if got[0].dtype != torch.float32:
            failed(title, f"an fp32 result for dtype {dtype} (what goes back into the fp32 .grad)", str(got[0].dtype),
                   "communicate in `dtype`, then return .float()")
        if any(not torch.equal(g, got[0]) for g in got):
            failed(title, f"the same mean on all {world} ranks ({dtype})", "ranks differ",
                   "each rank kept its own gradient: call dist.all_reduce on the tensor in `dtype` on every rank "
                   "(it works in place) and return that tensor")
    errs, simulated = _errors(res, name)
    grads = torch.stack([r["grad"] for r in out])
    ratio = float(out[0]["fp32"].double() @ grads.double().mean(0) / grads.double().mean(0).square().sum())
    if not errs["fp32"] < 1e-6:
        hint = (f"the result is {ratio:.3g}x the mean: all_reduce SUMS; divide by dist.get_world_size()"
                if math.isclose(ratio, world, rel_tol=0.05) else
                "all-reduce (SUM) every rank's gradient and divide by the world size")
        failed(title, "the mean over ranks to within 1e-6 (relative) with dtype=float32",
               f"relative error {errs['fp32']:.3g}", hint)
    if not errs["bf16"] < 4 * simulated + 1e-6:
        failed(title, f"a bf16 error near the simulated one ({simulated:.2g})", f"relative error {errs['bf16']:.3g}",
               "divide by the world size (or sum) in the wire dtype, then all-reduce; nothing else should round")
    if errs["bf16"] < simulated / 4:
        failed(title, f"the rounding of a bf16 all-reduce (simulated: {simulated:.2g})",
               f"relative error {errs['bf16']:.3g}: that is fp32's",
               "cast the gradient to `dtype` before dist.all_reduce: what travels, and is summed, must be bf16")
    mean = out[0]["bf16"]
    if not (_on_bf16_grid(mean) or _on_bf16_grid(mean * world)):  # a sum in bf16 leaves only bf16 values
        failed(title, "the mean summed in bf16 (every value one that bf16 can hold, before or after dividing)",
               "values between bf16's: the gradients were rounded to bf16, then summed in fp32",
               "all-reduce the bf16 tensor itself (wire = grad.to(dtype) ...; dist.all_reduce(wire)); "
               "call .float() only on the result")
    passed(title, f"on {world} ranks ({res.device}) the mean reduced in bf16 is {errs['bf16']:.2g} off the exact mean "
                  f"(relative RMS; the simulation of a {world}-rank ring says {simulated:.2g}), in fp32 "
                  f"{errs['fp32']:.2g}.")


def real_reduction(nproc: int | None = None, device: str | None = None) -> dict[str, float]:
    """Run the reference reduction on N real ranks (2 gloo CPU processes, or one per GPU): its relative errors
    in fp32 and bf16 against the exact mean, and the simulated bf16 ring error for the same gradients."""
    from ._torchrun import run_on_ranks

    res = run_on_ranks("chapter 10.5", f"{_RUNNERS}:_run_reduce",
                       {"reference": (inspect.getsource(reference_reduce), "reference_reduce")}, nproc=nproc,
                       device=device)
    errors = res.errors("reference")
    if errors:
        raise RuntimeError(f"the reference reduction failed on rank {errors[0][0]}: {errors[0][1]}")
    errs, simulated = _errors(res, "reference")
    return {"ranks": res.nproc, "device": res.device, "fp32": errs["fp32"], "bf16": errs["bf16"],
            "bf16_simulated": simulated, "seconds": res.seconds}
