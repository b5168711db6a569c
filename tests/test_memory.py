"""ampcourse.memory counts saved-for-backward storages and training state exactly."""

import pytest
import torch

from ampcourse import memory, models


def test_pointwise_op_saves_its_result_once():
    x = torch.randn(4, 8, requires_grad=True)
    saved = memory.saved_for_backward(lambda: x.exp().sum())  # exp saves its output; sum saves nothing
    assert saved.activation_bytes == 4 * 8 * 4
    assert [t.saved_by for t in saved.tensors] == ["ExpBackward0.result"]


def test_views_of_one_storage_are_counted_once():
    x = torch.randn(6, 8, requires_grad=True)
    y = x * 2  # a fresh 6x8 fp32 storage (192 bytes)
    # the matmuls save views (transposes, a slice) of y's storage: one storage, counted once, in full
    saved = memory.saved_for_backward(lambda: (y.t() @ y).sum() + (y[:2] @ y.t()).sum())
    activations = [t for t in saved.tensors if t.kind == "activation"]
    assert len(activations) == 1 and saved.activation_bytes == 6 * 8 * 4


def test_linear_fp32_vs_autocast_bytes_and_kinds():
    lin = torch.nn.Linear(8, 3)
    x = torch.randn(4, 8, requires_grad=True)
    fp32 = memory.saved_for_backward(lambda: lin(x), params=lin.parameters())
    assert fp32.activation_bytes == 4 * 8 * 4  # the input
    assert fp32.bytes("parameter") == 3 * 8 * 4  # the weight itself: no extra memory
    assert fp32.weight_copy_bytes == 0

    def low():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return lin(x)

    bf16 = memory.saved_for_backward(low, params=lin.parameters())
    assert bf16.activation_bytes == 4 * 8 * 2  # a bf16 copy of the input
    assert bf16.weight_copy_bytes == 3 * 8 * 2  # autocast's bf16 copy of the weight
    assert bf16.bytes("parameter") == 0
    assert bf16.by_dtype() == {"bfloat16": 64}
    assert bf16.extra_bytes == 64 + 48


def test_transformer_breakdown_names_the_fp32_savers():
    task = models.make_task("transformer", n=8, seed=0)
    x, y = task.data.tensors
    saved = memory.forward_saved_bytes(task.model, task.loss_fn, x, y, torch.autocast("cpu", dtype=torch.bfloat16))
    fp32 = saved.by_saver("float32")
    # the residual stream stays fp32 (fp32 + bf16 promotes), so every LayerNorm saves an fp32 input;
    # the loss runs in fp32 under autocast and saves fp32 log-probabilities
    assert "NativeLayerNormBackward0" in fp32
    assert {"LogSoftmaxBackward0", "NllLossBackward0"} & set(fp32)
    assert "?" not in {t.saved_by for t in saved.tensors}
    assert saved.by_dtype()["bfloat16"] > 0


def test_training_state_bytes_after_an_adam_step():
    model = models.make_model("mlp")
    opt = torch.optim.Adam(model.parameters())
    x, y = models.make_dataset("mlp", n=8).tensors
    models.loss_fn(model(x), y).backward()
    opt.step()
    n = sum(p.numel() for p in model.parameters())
    got = memory.training_state_bytes(model, opt)
    assert got["weights"] == got["gradients"] == got["exp_avg"] == got["exp_avg_sq"] == 4 * n
    assert got["step"] == 4 * len(list(model.parameters()))  # one fp32 step counter per parameter tensor


def test_training_state_without_gradients_or_optimizer():
    model = models.make_model("mlp")
    assert memory.training_state_bytes(model) == {"weights": 4 * sum(p.numel() for p in model.parameters()),
                                                  "gradients": 0}


@pytest.mark.parametrize("dtype, name", [(torch.bfloat16, "bfloat16"), (torch.int64, "int64")])
def test_dtype_name(dtype, name):
    assert memory.dtype_name(dtype) == name
