"""torchao's float8 and MXFP8 training on CUDA: the code paths that the course's CPU recipes (ampcourse.fp8, emulated)
stand for. Each test says on which GPUs it runs; elsewhere it is skipped with the hardware reason, which the report
lists as a capability skip, not a failure.

- float8 (tensorwise scales, torchao's `convert_to_float8_training` with `torch._scaled_mm`): float8 tensor cores,
  compute capability 8.9 and up (Ada, Hopper, Blackwell);
- MXFP8 on CUDA tensors with the emulated kernel (what chapter 9 runs on a CPU), wherever this torchao runs the recipe;
- MXFP8 with hardware MX kernels: compute capability 10.0 and up (Blackwell).
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ampcourse import fp8

pytestmark = pytest.mark.gpu

STEPS = 30


def _capability() -> tuple[int, int]:
    return torch.cuda.get_device_capability(0)


def _model() -> nn.Module:
    """An MLP whose Linear dims are multiples of 32 (float8 needs 16, MX blocks 32), on the GPU."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256), nn.GELU(), nn.Linear(256, 64)).cuda()


def _train(model: nn.Module, autocast_bf16: bool = True) -> list[float]:
    """STEPS AdamW steps on a fixed regression task (the same batches for every recipe); the loss of each."""
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(STEPS, 128, 256, device="cuda", generator=g)
    target = torch.randn(256, 64, device="cuda", generator=g)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dtype = next(model.parameters()).dtype  # a bf16 model takes bf16 inputs
    losses = []
    for i in range(STEPS):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast_bf16):
            out = model(x[i].to(dtype))
        loss = F.mse_loss(out.float(), (x[i] @ target).tanh())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _close_to_bf16(losses: list[float], reference: list[float]) -> None:
    """A low-precision run trains like the bf16 one: finite, going down, and its last loss near bf16's."""
    assert all(v == v and v != float("inf") for v in losses), losses
    assert losses[-1] < 0.8 * losses[0], losses
    assert abs(losses[-1] - reference[-1]) <= 0.1 * reference[-1] + 1e-3, (losses[-1], reference[-1])


@pytest.fixture(scope="module")
def bf16_losses(amp):
    return _train(_model())


def test_float8_training_on_float8_tensor_cores(amp, bf16_losses):
    if _capability() < fp8.FP8_CAPABILITY:
        pytest.skip(f"float8 matmuls need compute capability 8.9 or more (this GPU: {_capability()})")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    model = _model()
    convert_to_float8_training(model, config=Float8LinearConfig())  # not emulated: torch._scaled_mm on the GPU
    assert sum(isinstance(m, Float8Linear) for m in model.modules()) == 3
    _close_to_bf16(_train(model), bf16_losses)


def test_mxfp8_training_emulated_on_cuda_tensors(amp, bf16_losses):
    reason = fp8.recipe_unavailable("mxfp8")
    if reason is not None:
        pytest.skip(f"torchao cannot run MXFP8 training with this torch: {reason}")
    model = fp8.to_recipe(_model(), "mxfp8")  # the EMULATED kernel chapter 9 uses, here on CUDA tensors
    _close_to_bf16(_train(model, autocast_bf16=False), bf16_losses)


def test_mxfp8_training_on_mx_tensor_cores(amp, bf16_losses):
    if _capability() < (10, 0):
        pytest.skip(f"MX matmuls need compute capability 10.0 or more (Blackwell; this GPU: {_capability()})")
    if fp8.recipe_unavailable("mxfp8") is not None:
        pytest.skip(f"torchao cannot run MXFP8 training with this torch: {fp8.recipe_unavailable('mxfp8')}")
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig
    from torchao.quantization import quantize_

    model = _model().to(torch.bfloat16)
    quantize_(model, MXFP8TrainingOpConfig())  # KernelPreference.AUTO: the hardware kernels where they exist
    _close_to_bf16(_train(model, autocast_bf16=False), bf16_losses)
