"""CUDA fp16 autocast and GradScaler do what the chapters teach (they can only be shown on a GPU)."""

import math

import pytest
import torch
import torch.nn.functional as F

from ampcourse.device import pick
from ampcourse.models import make_task

pytestmark = pytest.mark.gpu


def test_pick_defaults_to_bf16_where_native_else_fp16_and_a_scaler(amp):
    default = pick()
    native = torch.cuda.get_device_capability(default.device) >= (8, 0)
    assert default.device_type == "cuda" and default.precision == ("bf16" if native else "fp16") and default.native
    assert default.make_scaler().is_enabled() == (not native)
    assert pick("cuda", "fp16").make_scaler().is_enabled()
    assert not pick("cuda", "fp32").make_scaler().is_enabled()


def test_cuda_autocast_runs_matmuls_in_fp16_and_reductions_in_fp32(amp):
    x = torch.randn(8, 16, device=amp.device)
    lin = torch.nn.Linear(16, 4).to(amp.device)
    target = torch.randint(0, 4, (8,), device=amp.device)
    with amp.autocast():
        logits = lin(x)
        assert logits.dtype == torch.float16, "Linear runs in fp16 under CUDA autocast"
        assert (x @ x.T).dtype == torch.float16
        # CUDA autocast's fp32 list (CPU autocast differs: there these follow their input)
        assert F.softmax(logits, dim=-1).dtype == torch.float32
        assert F.log_softmax(logits, dim=-1).dtype == torch.float32
        assert F.layer_norm(logits, (4,)).dtype == torch.float32
        assert F.cross_entropy(logits, target).dtype == torch.float32
    assert lin.weight.dtype == torch.float32, "autocast casts inputs per op; the weights stay fp32"


def test_fp16_autocast_with_gradscaler_trains(amp):
    task = make_task("mlp", n=512, seed=0)
    model = task.model.to(amp.device)
    x, y = (t.to(amp.device) for t in task.data.tensors)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = amp.make_scaler()
    losses = []
    for _ in range(60):
        opt.zero_grad(set_to_none=True)
        with amp.autocast():
            loss = task.loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.5 * losses[0], losses[::10]
    assert all(p.dtype == torch.float32 for p in model.parameters()), "master weights stay fp32"
    assert scaler.get_scale() > 0 and scaler._scale.dtype == torch.float32  # the scale lives in an fp32 tensor


def test_gradscaler_skips_the_step_and_backs_off_on_inf(amp):
    lin = torch.nn.Linear(4, 1).to(amp.device)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(amp.device_type, init_scale=2.0**16, backoff_factor=0.5)
    before = lin.weight.detach().clone()
    with amp.autocast():
        loss = lin(torch.full((2, 4), 60000.0, device=amp.device)).float().sum() * 1e6  # far past fp16's max once scaled
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert torch.equal(lin.weight.detach(), before), "a step with inf/nan gradients must be skipped"
    assert scaler.get_scale() == 2.0**15


def test_small_gradients_underflow_in_fp16_unless_scaled(amp):
    """Why fp16 needs loss scaling: a gradient of 1e-8 is zero in fp16, and survives when scaled by 2**16."""
    g = torch.full((4,), 1e-8, device=amp.device)
    assert g.half().eq(0).all()
    assert (g * 2.0**16).half().ne(0).all()
    assert g.bfloat16().ne(0).all(), "bf16 keeps fp32's exponent range: no scaling needed"


def test_exercise_5_2_square_for_cuda_is_checked_on_the_gpu(amp, capsys):
    """The chapter's own cells decorate with device_type="cuda" on a GPU: the checker runs that answer under CUDA's
    autocast and passes it (on a CPU the same answer gets the device_type hint: tests/exercises)."""
    from ampcourse import exercises

    class Square(torch.autograd.Function):  # the right answer, decorated as the chapter's cells are on a GPU
        @staticmethod
        @torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float32)
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        @torch.amp.custom_bwd(device_type="cuda")
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            return grad * 2 * x

    exercises.check_square_function(Square)
    assert "✅" in capsys.readouterr().out

