"""emulate.autocast on CPU against real CUDA autocast on a GPU: per op, and per model forward and backward.

On CPU-only machines tests/test_emulate_fidelity.py checks the emulator against CUDA's kernels run on fake CUDA
tensors; here the same comparisons run on real CUDA tensors.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import copy  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from ampcourse import autocast_ops, emulate, models  # noqa: E402

pytestmark = pytest.mark.gpu
LOW = [torch.float16, torch.bfloat16]
IDS = ["fp16", "bf16"]


def _inputs(spec, dtypes, device):
    g = torch.Generator().manual_seed(0)
    return [(torch.rand(s, generator=g) + 0.5).to(device=device, dtype=dt) for s, dt in zip(spec.shapes, dtypes)]


@pytest.mark.parametrize("low", LOW, ids=IDS)
def test_per_op_output_dtypes_equal_real_cuda(amp, low):
    if low == torch.bfloat16 and not torch.cuda.is_bf16_supported(including_emulation=False):
        pytest.skip("bf16 autocast needs compute capability >= 8.0")
    disagree = []
    for spec in autocast_ops.OPS:
        n = len(spec.shapes)
        for dts in ([torch.float32] * n, [low] * n, [low] + [torch.float32] * (n - 1)):
            try:
                with torch.autocast("cuda", dtype=low):
                    real = spec.call(*_inputs(spec, dts, "cuda")).dtype
            except RuntimeError:
                continue
            with emulate.autocast(dtype=low):
                emu = spec.call(*_inputs(spec, dts, "cpu")).dtype
            if emu != real:
                disagree.append((spec.name, dts, emu, real))
    assert disagree == []


@pytest.mark.parametrize("low", LOW, ids=IDS)
def test_the_fake_cuda_probe_agrees_with_the_gpu(amp, low):
    """op_table('cuda') on real CUDA tensors and the fake-CUDA probe (what a laptop gets) give the same rows."""
    if low == torch.bfloat16 and not torch.cuda.is_bf16_supported(including_emulation=False):
        pytest.skip("bf16 autocast needs compute capability >= 8.0")
    real = {r.op: (r.category, r.kind) for r in autocast_ops.op_table("cuda", low)}
    fake = {r.op: (r.category, r.kind) for r in autocast_ops._fake_cuda_table(low, autocast_ops.OPS)}
    assert real == fake


def _hf_gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=100, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def _dtypes_of_a_step(model, batch, device, ctx):
    """Every module's output dtype in forward and every parameter's gradient dtype after backward."""
    model = copy.deepcopy(model).to(device)
    seen = {}

    def record(name):
        def hook(module, inputs, out):  # returns None: the output is left as it is
            first = out if isinstance(out, torch.Tensor) else out[0] if isinstance(out, tuple) and out else out
            seen.setdefault(name, getattr(first, "dtype", None))
        return hook

    hooks = [m.register_forward_hook(record(name)) for name, m in model.named_modules() if name]
    x, y = (t.to(device) for t in batch)
    with ctx:
        loss = model(input_ids=x, labels=y).loss if hasattr(model, "config") else models.loss_fn(model(x), y)
    loss.float().backward()
    for h in hooks:
        h.remove()
    return seen, {n: p.grad.dtype for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer", "gpt2"])
@pytest.mark.parametrize("low", LOW, ids=IDS)
def test_per_model_forward_and_backward_dtypes_equal_real_cuda(amp, name, low):
    if low == torch.bfloat16 and not torch.cuda.is_bf16_supported(including_emulation=False):
        pytest.skip("bf16 autocast needs compute capability >= 8.0")
    if name == "gpt2":
        model = _hf_gpt2()
        ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
        batch = (ids, ids)
    else:
        model = models.make_model(name)
        batch = models.make_dataset(name, n=8)[:8]
    real = _dtypes_of_a_step(model, batch, "cuda", torch.autocast("cuda", dtype=low))
    emu = _dtypes_of_a_step(model, batch, "cpu", emulate.autocast(dtype=low))
    assert emu == real
