"""Chapter 10 exercises: TF32 rounding by hand, PaLM's z-loss in fp32 from bf16 logits, and a gradient all-reduce in
bf16 vs fp32 across real ranks under torchrun (10.3; see _torchrun.py), with its error measured against the exact mean.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from .. import _args, formats
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

#: NaN bit patterns among the cases: the default quiet NaN, and NaNs whose payload sits only in the 13 low bits that
#: rounding drops (clearing or carrying into them turns such a NaN into inf), of both signs.
TF32_NAN_BITS = (0x7FC00000, 0x7F800001, 0x7F801000, 0xFF800001, 0x7FFFFFFF)


def _from_bits(words: list[int]) -> torch.Tensor:
    """fp32 values with these 32-bit patterns (written unsigned, as in 0xFF800001)."""
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32).view(torch.float32)


def _tf32_cases() -> torch.Tensor:
    """fp32 values to round: ties both ways, negatives, zeros, subnormals, the top of the range (fp32's max rounds up
    to inf), inf, NaNs (low-payload ones included), random ones.

    Example::

        >>> x = _tf32_cases()
        >>> int(x.isnan().sum()), int(x.isinf().sum()), x.numel()
        (5, 2, 2025)
    """
    ulp = 2.0**-10
    tie_even, tie_odd = 1 + ulp / 2, 1 + ulp + ulp / 2  # exactly halfway: ties go to the even neighbour
    fp32_max = torch.finfo(torch.float32).max
    special = [0.0, -0.0, 1.0, tie_even, tie_odd, -tie_odd, 1 + ulp / 2 + 2.0**-20, 1 + ulp / 2 - 2.0**-20,
               3.14159265, -2.718281828, 1e-40, -3e-39, 3.3e38, 1e-3, 65504.0, 2.0**100 * 1.9999,
               fp32_max, -fp32_max, math.inf, -math.inf]
    gen = torch.Generator().manual_seed(10)
    rand = torch.randn(2000, generator=gen) * torch.exp2(torch.randint(-60, 60, (2000,), generator=gen).float())
    return torch.cat([torch.tensor(special, dtype=torch.float32), _from_bits(list(TF32_NAN_BITS)), rand.float()])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, a NaN matching any NaN (torch.equal says NaN != NaN)."""
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def _truncate(x: torch.Tensor) -> torch.Tensor:
    """Drop the 13 low mantissa bits without rounding (what a wrong answer often does)."""
    return (x.view(torch.int32) & ~0x1FFF).view(torch.float32)


def _ties_away(x: torch.Tensor) -> torch.Tensor:
    """Round to 10 mantissa bits, ties away from zero: what PTX's cvt.rna.tf32.f32 does (add half, then clear)."""
    return ((x.view(torch.int32) + 0x1000) & ~0x1FFF).view(torch.float32)


def check_tf32_round(tf32_round: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Exercise 10.1: tf32_round(x) rounds an fp32 tensor to TF32 (10 mantissa bits, nearest, ties to even),
    returned as fp32.

    Ties to even is IEEE 754's default rounding and what ``formats.quantize`` does. NVIDIA documents no rounding
    for the fp32 operands a tensor core reads as TF32, and its conversion instruction on Ampere,
    ``cvt.rna.tf32.f32``, rounds ties *away* from zero (``.rn``, ties to even, arrived with sm_90: LLVM's
    NVPTX builtins ``__nvvm_f2tf32_rna`` SM_80 and ``__nvvm_f2tf32_rn`` SM_90); the two differ only on exact
    ties, which this checker includes.
    """
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
        if not bad[~x.isnan()].any():  # right everywhere except on NaNs
            i = int((bad & x.isnan()).nonzero()[0])
            bits = x[i:i + 1].view(torch.int32).item() & 0xFFFFFFFF
            failed(title, f"nan for x = nan (bits 0x{bits:08X})", got[i].item(),
                   "a NaN must stay NaN: one whose payload sits only in the 13 low bits becomes inf when those bits "
                   "are cleared or rounded away; leave NaNs as they are (x.isnan() finds them)")
        if _same(got, _truncate(x)):
            hint = ("that truncates (rounds toward zero): to round to nearest, add something to the bits before "
                    "you clear the 13 low ones (how much is half of what you drop?)")
        elif _same(got, x):
            hint = "the values came back unchanged: TF32 keeps 10 of fp32's 23 mantissa bits"
        elif _same(got, _ties_away(x)):
            hint = ("nearest, but exact ties go away from zero (what PTX's cvt.rna.tf32.f32 does); the exercise asks "
                    "ties to even: on a tie, let the lowest kept bit decide whether to round up")
        else:
            hint = ("round to nearest, ties to even, on the int32 bits; compare your value with "
                    "formats.quantize(x.numpy(), TF32) on the x shown")
        failed(title, f"{want[i].item()!r} for x = {x[i].item()!r}", got[i].item(), hint)
    passed(title, f"{x.numel()} values rounded to 10 mantissa bits, ties to even (IEEE's default; Ampere's "
                  "cvt.rna.tf32.f32 rounds ties away from zero, the only difference).")


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
            if not math.isfinite(g):
                failed(title, f"{want.item():.6g} for {str(logits.dtype)[6:]} logits near "
                              f"{logits.float().mean().item():.0f}", g,
                       "exp overflows: float32's largest value is about 3.4e38 = e**88.7, so exp of these logits is "
                       "inf before the sum; log(sum(exp(z))) needs the largest logit taken out first (torch has a "
                       "function that does it)")
            if math.isclose(g, (weight * lse.mean().square()).item(), rel_tol=1e-4):
                hint = "square each position's log Z, then average (the mean of squares, not the square of the mean)"
            elif math.isclose(g, (weight * lse.abs().mean()).item(), rel_tol=1e-4):
                hint = "square log Z: the loss pushes log Z towards 0 from both sides"
            elif math.isclose(g, want.item() / weight, rel_tol=1e-4):
                hint = "multiply by the weight (PaLM uses 1e-4)"
            elif math.isclose(g, (weight * logits.logsumexp(-1).float().square().mean()).item(), rel_tol=1e-4):
                hint = "upcast before logsumexp, not after: logsumexp in bf16 has already rounded log Z"
            else:
                hint = ("log Z of each position (over the last dimension, in fp32), squared, averaged over the "
                        "positions, times the weight")
            failed(title, f"{want.item():.6g} for {str(logits.dtype)[6:]} logits of shape {tuple(logits.shape)}",
                   g, hint)
        if leaf.grad is not None:
            failed(title, "a loss for the checker to backpropagate (once)", "gradients already on the logits",
                   "return the loss without calling .backward() on it: the training loop calls backward once, "
                   "on the whole loss")
        try:
            got.backward()
        except RuntimeError as err:  # the learner's graph: a custom backward that raises, a graph already freed
            failed(title, "a loss whose backward runs", f"backward raised {_args.first_line(err, 120)}",
                   "build the loss from torch ops on the logits and return it without calling backward yourself")
        if leaf.grad is None or not torch.isfinite(leaf.grad).all():
            failed(title, "finite gradients on the logits", "none" if leaf.grad is None else "non-finite",
                   "keep the computation on the logits tensor you were given")
        ref = logits.clone().requires_grad_(True)
        _z_loss(ref, weight).backward()
        if not torch.allclose(leaf.grad.float(), ref.grad.float(), rtol=1e-2, atol=1e-6 * weight):
            failed(title, "the gradient of weight * mean(log Z ** 2)",
                   f"gradients up to {(leaf.grad.float() - ref.grad.float()).abs().max().item():.3g} off",
                   "a custom backward (or a second backward) changed the gradient: let autograd differentiate it")
    passed(title, "log Z squared, averaged, weighted, and computed in fp32 from bf16 logits.")


# --- 10.3 all-reduce in bf16 vs fp32, on real ranks ------------------------------------------------

_RUNNERS = "ampcourse.exercises.ch10"
_NUMEL = 4096
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


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


#: torch.distributed's collectives and point-to-point calls that carry data: the ones 10.3's worker watches.
_WATCHED = ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_gather", "all_gather_into_tensor",
            "all_to_all", "all_to_all_single", "broadcast", "gather", "scatter", "send", "recv", "isend", "irecv",
            "all_reduce_coalesced")


def _tensors(value) -> list[torch.Tensor]:
    """The tensors in a collective's argument (a tensor, or a list of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


@contextlib.contextmanager
def _watch_collectives(calls: list[str]) -> Iterator[None]:
    """Record every data-carrying torch.distributed call made inside: 'name dtype numel' per floating tensor passed.

    The learner's ``dist`` is the torch.distributed module: its functions (and distributed_c10d's, which they
    are) are wrapped for the duration, so the checker sees the dtype that actually went onto the wire.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    saved = []
    for module in (dist, distributed_c10d):
        for name in _WATCHED:
            original = getattr(module, name, None)
            if original is None:
                continue

            def wrapped(*args, _original=original, _name=name, **kwargs):
                for t in _tensors([*args, *kwargs.values()]):
                    if t.is_floating_point():
                        calls.append(f"{_name} {str(t.dtype).removeprefix('torch.')} {t.numel()}")
                return _original(*args, **kwargs)
            saved.append((module, name, original))
            setattr(module, name, functools.wraps(original)(wrapped))
    try:
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


def _run_reduce(fn: Callable, ctx, params: dict) -> dict:
    """Worker side of 10.3: fn on this rank's gradient with dtype fp32 and bf16; what came back, and what went
    onto the wire (every collective's floating tensors: name, dtype, size)."""
    grad = _rank_grad(ctx.rank, ctx.device)
    out: dict = {"grad": grad.cpu()}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        calls: list[str] = []
        with _watch_collectives(calls):
            got = fn(grad.clone(), dtype)
        if not isinstance(got, torch.Tensor):
            raise TypeError(f"expected a tensor back for dtype {name}, got {type(got).__name__}")
        out[name] = got.detach().cpu()
        out[f"{name}_wire"] = calls
    return out


def _wire(calls: list[str], world: int) -> list[tuple[str, str, int]]:
    """(collective, dtype, elements) of the calls that carried the gradient (at least its share per rank)."""
    parsed = [(c.split()[0], c.split()[1], int(c.split()[2])) for c in calls]
    return [(name, dtype, numel) for name, dtype, numel in parsed if numel * world >= _NUMEL]


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
    for dtype in ("fp32", "bf16"):
        wire = _wire(out[0].get(f"{dtype}_wire", []), world)
        if not wire:
            failed(title, f"the gradient sent between the ranks with dtype={dtype}",
                   "no collective carried it (no dist.all_reduce, reduce_scatter, ... of a gradient-sized tensor)",
                   "the mean must come from the other ranks through a collective: call dist.all_reduce on every rank "
                   "(building the other ranks' gradients locally communicates nothing)")
        sent = sorted({d for _, d, _ in wire})
        if sent != [str(_DTYPES[dtype]).removeprefix("torch.")]:
            want = str(_DTYPES[dtype]).removeprefix("torch.")
            failed(title, f"the gradient communicated in {want} for dtype={dtype}",
                   f"{', '.join(sorted({n for n, _, _ in wire}))} of a {' and '.join(sent)} tensor",
                   f"cast to `dtype` first and pass that tensor to dist.all_reduce: the collective then sums in "
                   f"{want}; all-reducing in another dtype and casting the mean afterwards is another reduction")
    errs, simulated = _errors(res, name)
    grads = torch.stack([r["grad"] for r in out])
    ratio = float(out[0]["fp32"].double() @ grads.double().mean(0) / grads.double().mean(0).square().sum())
    if not errs["fp32"] < 1e-6:
        hint = (f"the result is {ratio:.3g}x the mean: all_reduce SUMS; divide by dist.get_world_size()"
                if math.isclose(ratio, world, rel_tol=0.05) else
                "all-reduce (SUM) every rank's gradient and divide by the world size")
        failed(title, "the mean over ranks to within 1e-6 (relative) with dtype=float32",
               f"relative error {errs['fp32']:.3g}", hint)
    # The simulated ring is the worst case: NCCL's tree, or NVLS (the sum formed in the NVLink switch), round
    # fewer times, so a correct bf16 reduction can sit anywhere below it; what went onto the wire is checked above.
    if not errs["bf16"] < 4 * simulated + 1e-6:
        failed(title, f"a bf16 error at most near the simulated ring's ({simulated:.2g})",
               f"relative error {errs['bf16']:.3g}",
               "divide by the world size (or sum) in the wire dtype, then all-reduce; nothing else should round")
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
