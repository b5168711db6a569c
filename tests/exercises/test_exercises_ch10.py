"""Chapter 10's checkers accept the reference answers and reject typical wrong ones with a hint that names the bug.

10.3 runs on 2 CPU ranks under torchrun: the reference and the wrong answers share one launch.
"""


import math

import pytest
import torch

from ampcourse.exercises import ExerciseError, ch10, check_tf32_round, check_z_loss
from ampcourse.exercises._torchrun import run_on_ranks
from learner_variants import variants


def rne_bits(x):
    """The bit trick alone: right on every number, but NaNs with a low payload come out as inf."""
    b = x.view(torch.int32)
    return ((b + 0xFFF + ((b >> 13) & 1)) & ~0x1FFF).view(torch.float32)


def rne(x):
    return torch.where(x.isnan(), x, rne_bits(x))


def test_tf32_accepts_round_to_nearest_even(capsys):
    check_tf32_round(rne)
    assert "✅" in capsys.readouterr().out


def test_tf32_reference_agrees_with_torch_where_torch_rounds_the_same_way():
    """formats.quantize with TF32's layout equals the bit trick on every case (a second, independent computation)."""
    x = ch10._tf32_cases()
    want = torch.from_numpy(ch10.formats.quantize(x.numpy(), ch10.TF32)).float()
    assert ch10._same(rne(x), want)
    assert torch.equal(rne(x).isnan(), x.isnan())  # NaN stays NaN, nothing else becomes one


def test_tf32_cases_cover_nan_inf_and_the_top_of_the_range():
    x = ch10._tf32_cases()
    bits = {b & 0xFFFFFFFF for b in x.view(torch.int32).tolist()}
    assert set(ch10.TF32_NAN_BITS) <= bits and {0x7F800001, 0x7F801000} <= bits  # low-payload NaNs, both audited
    fp32_max = torch.finfo(torch.float32).max
    assert {math.inf, -math.inf, fp32_max, -fp32_max} <= set(x[~x.isnan()].tolist())
    want = torch.from_numpy(ch10.formats.quantize(x.numpy(), ch10.TF32)).float()
    assert want[x == fp32_max].item() == math.inf  # fp32's max is past TF32's max + half an ulp: it rounds to inf


def test_tf32_rejects_nan_turned_into_inf(capsys):
    """The bit trick without a NaN guard (the chapter's old model solution): 0x7F800001 -> inf. Rejected, named."""
    with pytest.raises(ExerciseError, match="a NaN must stay NaN"):
        check_tf32_round(rne_bits)
    assert "bits 0x7F800001" in capsys.readouterr().out


@pytest.mark.parametrize("answer,hint", [
    (lambda x: (x.view(torch.int32) & ~0x1FFF).view(torch.float32), "truncates"),
    (lambda x: x, "unchanged"),
    (lambda x: ((x.view(torch.int32) + 0x1000) & ~0x1FFF).view(torch.float32), "ties go away from zero"),
    (lambda x: x.bfloat16().float(), "ties to even"),  # 7 bits, not 10
    (lambda x: rne(x).double(), "fp32 tensor"),
    (lambda x: rne(x)[:10], "shaped like x"),
])
def test_tf32_rejects(answer, hint, capsys):
    with pytest.raises(ExerciseError, match=hint):
        check_tf32_round(answer)
    out = capsys.readouterr().out
    assert "❌" in out
    # a hint gives the idea, never the solution's bit expression (issue 28, item 14)
    assert "0xFFF" not in out and "& 1" not in out and "~0x1FFF" not in out


def test_tf32_text_says_what_hardware_does_on_ties(capsys):
    check_tf32_round(rne)
    assert "cvt.rna.tf32.f32 rounds ties away from zero" in capsys.readouterr().out
    assert "cvt.rna.tf32.f32" in check_tf32_round.__doc__


def test_z_loss_accepts_the_reference(capsys):
    check_z_loss(lambda logits, weight: weight * logits.float().logsumexp(-1).square().mean())
    assert "✅" in capsys.readouterr().out


@pytest.mark.parametrize("answer,hint", [
    (lambda l, w: w * l.logsumexp(-1).square().mean(), "upcast first"),  # bf16 result
    (lambda l, w: w * l.logsumexp(-1).float().square().mean(), "upcast before logsumexp"),
    (lambda l, w: w * l.float().logsumexp(-1).mean().square(), "mean of squares"),
    (lambda l, w: w * l.float().logsumexp(-1).abs().mean(), "square log Z"),
    (lambda l, w: l.float().logsumexp(-1).square().mean(), "multiply by the weight"),
    (lambda l, w: w * l.float().logsumexp(-1).square(), "0-d tensor"),
    (lambda l, w: torch.tensor(w * l.detach().float().logsumexp(-1).square().mean().item()), "backpropagates"),
    # naive log(sum(exp)): exp(200) is inf in float32
    (lambda l, w: w * l.float().exp().sum(-1).log().square().mean(), "exp overflows"),
])
def test_z_loss_rejects(answer, hint, capsys):
    with pytest.raises(ExerciseError, match=hint):
        check_z_loss(answer)
    out = capsys.readouterr().out
    assert "❌" in out and "logsumexp(-1).square()" not in out  # the hint never spells out the answer


class _Raises(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("a custom backward that fails")


class _Doubled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return 2 * grad


def _z(l, w):
    return w * l.float().logsumexp(-1).square().mean()


def _backward_inside(l, w):
    loss = _z(l, w)
    loss.backward()  # the checker's backward is then the second one: before, a raw RuntimeError escaped
    return loss


def _backward_inside_retained(l, w):
    loss = _z(l, w)
    loss.backward(retain_graph=True)  # the checker's backward would double the gradients
    return loss


@pytest.mark.parametrize("answer,hint", [
    (_backward_inside, "without calling .backward"),
    (_backward_inside_retained, "without calling .backward"),
    (lambda l, w: _z(_Raises.apply(l), w), "backward raised RuntimeError|backward raised a custom backward"),
    (lambda l, w: _z(_Doubled.apply(l), w), "changed the gradient"),
])
def test_z_loss_backward_problems_get_a_verdict(answer, hint, capsys):
    with pytest.raises(ExerciseError, match=hint):
        check_z_loss(answer)
    assert "❌" in capsys.readouterr().out


def test_reduce_lambda_in_brackets_is_told_to_use_def(capsys):
    """A lambda over two lines inside brackets: inspect.getsource gives lines that do not parse (was SyntaxError)."""
    with pytest.raises(ExerciseError, match="define it with `def"):
        ch10.check_reduce_across_ranks(
            lambda grad, dtype:
                grad)
    assert "❌" in capsys.readouterr().out


# --- 10.3 under torchrun ----------------------------------------------------------------------------



@pytest.fixture(scope="module")
def reduce_launch():
    cases = variants(ch10.reference_reduce,
                     summed=[(".div_(dist.get_world_size())", "")],
                     fp32_wire=[("grad.to(dtype)", "grad.float()")],
                     # rounds each gradient to bf16, then sums in fp32: its error lay inside the accepted band
                     cast_only=[("grad.to(dtype)", "grad.to(dtype).float()")],
                     bf16_out=[("return wire.float()", "return wire")],
                     local=[("    dist.all_reduce(wire)", "    pass")],
                     # all-reduces in fp32, then rounds the mean to bf16: its result is on bf16's grid
                     fp32_then_round=[("grad.to(dtype)", "grad.float()"), ("return wire.float()",
                                                                         "return wire.to(dtype).float()")],
                     # never communicates: rebuilds every rank's gradient from the checker's own helper
                     rebuilt=[("    dist.all_reduce(wire)",
                               "    from ampcourse.exercises.ch10 import _rank_grad\n"
                               "    wire = sum(_rank_grad(r, grad.device).to(dtype).div_(dist.get_world_size())\n"
                               "               for r in range(dist.get_world_size()))")],
                     # NCCL-like: reduce-scatter, then all-gather, both in bf16 (a correct bf16 reduction)
                     scatter_gather=[("    dist.all_reduce(wire)",
                                      "    n = dist.get_world_size()\n"
                                      "    part = torch.empty(wire.numel() // n, dtype=wire.dtype, device=wire.device)\n"
                                      "    dist.reduce_scatter_tensor(part, wire)\n"
                                      "    dist.all_gather_into_tensor(wire, part)")],
                     stub=[("    wire = grad", "    raise NotImplementedError\n    wire = grad")])
    return run_on_ranks("10.3", "ampcourse.exercises.ch10:_run_reduce", cases)


@pytest.mark.slow
def test_reduce_accepts_the_reference_and_reports_the_error(reduce_launch, capsys):
    assert reduce_launch.nproc == 2 and reduce_launch.device == "cpu"
    ch10.judge_reduce("10.3", reduce_launch, "right")
    out = capsys.readouterr().out
    assert "✅" in out and "reduced in bf16 is" in out
    errs, simulated = ch10._errors(reduce_launch, "right")
    assert errs["fp32"] < 1e-6 < errs["bf16"] and errs["bf16"] == pytest.approx(simulated, rel=1e-6)
    # what went onto the wire is recorded, per dtype
    assert reduce_launch.results["right"][0]["bf16_wire"] == ["all_reduce bfloat16 4096"]
    assert reduce_launch.results["right"][0]["fp32_wire"] == ["all_reduce float32 4096"]


@pytest.mark.slow
def test_reduce_accepts_a_bf16_reduce_scatter_and_all_gather(reduce_launch, capsys):
    ch10.judge_reduce("10.3", reduce_launch, "scatter_gather")
    assert "✅" in capsys.readouterr().out


def _judged_offline(world: int, bf16_mean):
    """RankResults as `world` GPU ranks would return them, with `bf16_mean(grads)` as the bf16 result."""
    from ampcourse.exercises._torchrun import RankResults

    grads = torch.stack([ch10._rank_grad(r, torch.device("cpu")) for r in range(world)])
    fp32 = grads.double().mean(0).float()
    bf16 = bf16_mean(grads)
    rank = {"fp32": fp32, "bf16": bf16, "fp32_wire": ["all_reduce float32 4096"],
            "bf16_wire": ["all_reduce bfloat16 4096"]}
    return RankResults({"x": [{"grad": grads[r], **rank} for r in range(world)]}, world, "cuda", 1.0)


@pytest.mark.parametrize("algorithm", ["tree", "nvls"])
def test_reduce_accepts_a_correct_bf16_reduction_whatever_nccls_algorithm(algorithm, capsys):
    """On 256 GPUs NCCL may use a tree, or NVLS (the switch sums; one rounding at the end): fewer roundings than
    the simulated ring, so a smaller error. Before, anything below a quarter of the ring's error was refused."""
    from ampcourse.reduce_sim import simulate_reduction

    def nvls(grads):  # each share cast and divided in bf16, the sum formed exactly, rounded once to bf16
        shares = grads.to(torch.bfloat16) / grads.shape[0]
        return shares.double().sum(0).to(torch.bfloat16).float()

    bf16 = {"tree": lambda g: simulate_reduction(g, dtype=torch.bfloat16, algorithm="tree"), "nvls": nvls}[algorithm]
    res = _judged_offline(256, bf16)
    errs, simulated = ch10._errors(res, "x")
    assert errs["bf16"] < simulated / 4  # the old rule's band: this correct answer was refused
    ch10.judge_reduce("10.3", res, "x")
    assert "✅" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("name,hint", [
    ("summed", "2x the mean: all_reduce SUMS"),
    ("fp32_wire", "communicated in bfloat16 for dtype=bf16"),
    ("bf16_out", "then return .float()"),
    ("cast_only", "all_reduce of a float32 tensor"),
    ("local", "each rank kept its own gradient: call dist.all_reduce"),
    ("stub", "NotImplementedError"),
    ("fp32_then_round", "all-reducing in another dtype and casting the mean afterwards"),
    ("rebuilt", "no collective carried it"),
])
def test_reduce_rejects(reduce_launch, name, hint, capsys):
    with pytest.raises(ExerciseError, match=hint):
        ch10.judge_reduce("10.3", reduce_launch, name)
    assert "❌" in capsys.readouterr().out


def _z_by_hand(logits, weight):
    x = logits.float()
    m = x.max(-1, keepdim=True).values  # the largest logit taken out first, by hand: gradients through max too
    return weight * (m.squeeze(-1) + (x - m).exp().sum(-1).log()).square().mean()


def _z_detached_max(logits, weight):
    x = logits.float()
    m = x.amax(-1, keepdim=True).detach()
    return weight * (m.squeeze(-1) + (x - m).exp().sum(-1).log()).pow(2).mean()


@pytest.mark.parametrize("answer", [_z_by_hand, _z_detached_max])
def test_z_loss_accepts_a_stable_logsumexp_written_by_hand(answer, capsys):
    """The gradient check (a custom or doubled backward) must not refuse a right answer written another way."""
    check_z_loss(answer)
    assert "✅" in capsys.readouterr().out
