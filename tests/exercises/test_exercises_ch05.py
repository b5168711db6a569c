"""Chapter 5 checkers accept right answers and reject wrong ones with feedback."""

import math

import pytest
import torch

from ampcourse import exercises
from ampcourse.exercises import ExerciseError


def rms_norm_fp32(h, eps=1e-6):
    with torch.autocast(h.device.type, enabled=False):
        x = h.float()
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps)


def rms_norm_back_to_fp16(h, eps=1e-6):
    return rms_norm_fp32(h, eps).to(h.dtype)  # fp16 output of an fp32 computation is fine


def rms_norm_cast_only(h, eps=1e-6):
    x = h.float()  # no autocast(enabled=False): elementwise ops follow their inputs' dtype
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps)


def rms_norm_autocast_off_only(h, eps=1e-6):
    with torch.autocast(h.device.type, enabled=False):  # turns autocast off but casts nothing back
        return h * torch.rsqrt((h * h).mean(-1, keepdim=True) + eps)


def test_rms_norm_accepts(capsys):
    exercises.check_rms_norm(rms_norm_fp32)
    exercises.check_rms_norm(rms_norm_back_to_fp16)
    assert capsys.readouterr().out.count("✅") == 2


def test_rms_norm_agrees_with_chapter_5_the_cast_is_the_island(capsys):
    """The .float() cast alone is a right answer; autocast off without the cast is a wrong one, and the hint says so."""
    exercises.check_rms_norm(rms_norm_cast_only)
    assert "✅" in capsys.readouterr().out
    with pytest.raises(ExerciseError):
        exercises.check_rms_norm(rms_norm_autocast_off_only)
    out = capsys.readouterr().out
    assert "h.float()" in out and "casts nothing back" in out


@pytest.mark.parametrize("wrong", [
    lambda h, eps=1e-6: h * torch.rsqrt((h * h).mean(-1, keepdim=True) + eps),            # naive fp16: overflows
    lambda h, eps=1e-6: (h * torch.rsqrt((h * h).mean(-1, keepdim=True) + eps)).float(),  # cast too late
    lambda h, eps=1e-6: rms_norm_fp32(h.bfloat16().float(), eps).bfloat16(),              # bf16: 8 bits
    lambda h, eps=1e-6: rms_norm_fp32(h, eps)[..., :10],                                  # wrong shape
    lambda h, eps=1e-6: (_ for _ in ()).throw(NotImplementedError()),
])
def test_rms_norm_rejects(wrong, capsys):
    with pytest.raises(ExerciseError):
        exercises.check_rms_norm(wrong)
    assert "❌" in capsys.readouterr().out


def _square(cast_inputs=torch.float32, backward_factor=2.0, decorate=True):
    """Build a Square function, right or wrong in one chosen way."""
    fwd_dec = torch.amp.custom_fwd(device_type="cpu", cast_inputs=cast_inputs) if decorate else (lambda f: f)
    bwd_dec = torch.amp.custom_bwd(device_type="cpu") if decorate else (lambda f: f)

    class Square(torch.autograd.Function):
        @staticmethod
        @fwd_dec
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        @bwd_dec
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            return grad * backward_factor * x

    return Square


def test_square_function_accepts(capsys):
    exercises.check_square_function(_square())
    assert "✅" in capsys.readouterr().out


@pytest.mark.parametrize("wrong", [_square(decorate=False), _square(cast_inputs=None), _square(backward_factor=1.0),
                                   lambda x: x * x, "Square"])
def test_square_function_rejects(wrong):
    with pytest.raises(ExerciseError):
        exercises.check_square_function(wrong)


class HandCastSquare(torch.autograd.Function):
    """fp32 output by casting by hand: autocast stays on inside forward (a matmul there would run in fp16)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.float() * x.float()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * 2 * x


def test_square_function_rejects_a_hand_cast_forward_that_leaves_autocast_on(capsys):
    with pytest.raises(ExerciseError, match="autocast was on inside forward") as err:
        exercises.check_square_function(HandCastSquare)
    assert "custom_fwd(device_type='cpu', cast_inputs=torch.float32)" in str(err.value)
    assert "✅" not in capsys.readouterr().out  # no praise for an autocast-off forward it did not have


def _square_for(device_type: str):
    """The right Square, decorated for `device_type` (what a learner copying the chapter's DEVICE_TYPE writes)."""

    class Square(torch.autograd.Function):
        @staticmethod
        @torch.amp.custom_fwd(device_type=device_type, cast_inputs=torch.float32)
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        @torch.amp.custom_bwd(device_type=device_type)
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            return grad * 2 * x

    return Square


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="with a GPU, a Square for 'cuda' is checked on it (tests/gpu/test_cuda_amp.py)")
def test_square_function_names_a_device_type_mismatch(capsys):
    with pytest.raises(ExerciseError, match="device_type='cuda'.*runs under cpu autocast") as err:
        exercises.check_square_function(_square_for("cuda"))
    assert "use device_type='cpu'" in str(err.value)  # not the old hint, which repeated what the learner did


def test_square_function_reads_the_declared_device_type():
    from ampcourse.exercises import ch05

    assert ch05._declared_device_type(_square_for("cuda")) == "cuda"
    assert ch05._declared_device_type(_square()) == "cpu" and ch05._declared_device_type(HandCastSquare) is None


def fp8_scale(t):
    amax = t.abs().max().item()
    if amax == 0:
        return 1.0
    k = math.floor(math.log2(448.0 / amax))
    return 2.0**k


def test_fp8_scale_accepts(capsys):
    exercises.check_fp8_scale(fp8_scale)
    assert "✅" in capsys.readouterr().out


@pytest.mark.parametrize("wrong", [
    lambda t: 448.0 / t.abs().max().item() if t.abs().max() > 0 else 1.0,       # not a power of two
    lambda t: 2.0 ** math.floor(math.log2(448.0 / t.max().item())) if t.max() > 0 else 1.0,  # max, not max|t|
    lambda t: 2 * fp8_scale(t),                                                   # one binade too far: saturates
    lambda t: 2.0 ** math.floor(math.log2(57344.0 / max(t.abs().max().item(), 1e-30))),  # e5m2's maximum
    lambda t: "big",
])
def test_fp8_scale_rejects(wrong):
    with pytest.raises(ExerciseError):
        exercises.check_fp8_scale(wrong)


def ocp_floor_scale(t):
    """OCP MX v1.0's rule: X = 2**(floor(log2 amax) - emax), emax = 8 for E4M3; as a multiplier 1 / X."""
    amax = t.abs().max().item()
    return 1.0 if amax == 0 else 2.0 ** (8 - math.floor(math.log2(amax)))


def test_fp8_scale_is_rceil_and_the_floor_rule_is_rejected_with_a_hint_that_names_it(capsys):
    from ampcourse import fp8

    # The exercise's rule is the MX scale rounded up: ampcourse.fp8's rceil scale, not the spec's floor.
    t = torch.tensor([0.1, -1.9] + [0.0] * 30)  # one MX block; 1.9 * 2**8 = 486 > 448: floor saturates, RCEIL takes 2**7
    rceil = fp8.quantize_scaled(t.reshape(1, 32), "fp8_e4m3", "mx", mx_rounding="rceil")
    floor = fp8.quantize_scaled(t.reshape(1, 32), "fp8_e4m3", "mx", mx_rounding="floor")
    assert fp8_scale(t) == 2.0**7 and ocp_floor_scale(t) == 2.0**8
    assert rceil.saturated == 0 < floor.saturated
    with pytest.raises(ExerciseError, match="floor rule"):
        exercises.check_fp8_scale(ocp_floor_scale)
    assert "RCEIL" in capsys.readouterr().out
