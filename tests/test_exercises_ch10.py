"""Chapter 10's checkers accept the reference answers and reject typical wrong ones with a hint that names the bug.

10.3 runs on 2 CPU ranks under torchrun: the reference and the wrong answers share one launch.
"""


import pytest
import torch

from ampcourse.exercises import ExerciseError, ch10, check_tf32_round, check_z_loss
from ampcourse.exercises._torchrun import run_on_ranks
from learner_variants import variants


def rne(x):
    b = x.view(torch.int32)
    return ((b + 0xFFF + ((b >> 13) & 1)) & ~0x1FFF).view(torch.float32)


def test_tf32_accepts_round_to_nearest_even(capsys):
    check_tf32_round(rne)
    assert "✅" in capsys.readouterr().out


def test_tf32_reference_agrees_with_torch_where_torch_rounds_the_same_way():
    """formats.quantize with TF32's layout equals the bit trick on every case (a second, independent computation)."""
    x = ch10._tf32_cases()
    want = torch.from_numpy(ch10.formats.quantize(x.numpy(), ch10.TF32)).float()
    assert torch.equal(rne(x), want)


@pytest.mark.parametrize("answer,hint", [
    (lambda x: (x.view(torch.int32) & ~0x1FFF).view(torch.float32), "truncates"),
    (lambda x: x, "unchanged"),
    (lambda x: ((x.view(torch.int32) + 0x1000) & ~0x1FFF).view(torch.float32), "ties to even"),  # ties away
    (lambda x: x.bfloat16().float(), "ties to even"),  # 7 bits, not 10
    (lambda x: rne(x).double(), "fp32 tensor"),
    (lambda x: rne(x)[:10], "shaped like x"),
])
def test_tf32_rejects(answer, hint, capsys):
    with pytest.raises(ExerciseError, match=hint):
        check_tf32_round(answer)
    assert "❌" in capsys.readouterr().out


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
])
def test_z_loss_rejects(answer, hint, capsys):
    with pytest.raises(ExerciseError, match=hint):
        check_z_loss(answer)
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


@pytest.mark.slow
@pytest.mark.parametrize("name,hint", [
    ("summed", "2x the mean: all_reduce SUMS"),
    ("fp32_wire", "cast the gradient to `dtype` before dist.all_reduce"),
    ("bf16_out", "then return .float()"),
    ("cast_only", "summed in fp32"),
    ("local", "each rank kept its own gradient: call dist.all_reduce"),
    ("stub", "NotImplementedError"),
])
def test_reduce_rejects(reduce_launch, name, hint, capsys):
    with pytest.raises(ExerciseError, match=hint):
        ch10.judge_reduce("10.3", reduce_launch, name)
    assert "❌" in capsys.readouterr().out
