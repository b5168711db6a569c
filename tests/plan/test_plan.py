"""ampcourse.plan: counts checked by hand, memory checked against the CPU allocator, the roofline and its refusals."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ampcourse import models
from ampcourse.plan import GPU, GPUS, NeedsRealValues, capture_step, plan
from ampcourse.plan.capture import autocast_policy
from ampcourse.plan.roofline import op_time
from planted import SparseBag

ROOT = Path(__file__).resolve().parents[2]


def _sum_loss(out, _targets):
    """A loss whose backward is one ones-like gradient: keeps the hand counts to the layer itself."""
    return out.sum()


def _ops(counts, phase, op=None):
    return [r for r in counts.ops if r.phase == phase and (op is None or r.op == op)]


# --- counts, by hand ---------------------------------------------------------------------------------------------

def test_linear_fp32_flops_and_bytes_by_hand():
    lin = nn.Linear(64, 32)
    c = capture_step(lin, torch.empty(16, 64), loss_fn=_sum_loss)
    (fwd,) = _ops(c, "forward", "aten.addmm")
    assert fwd.flops == 2 * 16 * 64 * 32
    assert fwd.bytes_read == 4 * (32 + 16 * 64 + 64 * 32)  # bias, input, weight
    assert fwd.bytes_written == 4 * 16 * 32
    assert fwd.dtype == "float32"
    mms = _ops(c, "backward", "aten.mm")
    # the input is not a leaf that needs a gradient: only the weight's gradient is a matmul
    assert [m.flops for m in mms] == [2 * 32 * 16 * 64]
    assert sum(r.bytes_written for r in _ops(c, "backward", "aten.sum")) == 4 * 32  # the bias gradient
    assert c.weights_bytes == 4 * (64 * 32 + 32) and c.gradients_bytes == c.weights_bytes
    assert c.optimizer_state_bytes == 2 * c.weights_bytes  # AdamW's exp_avg and exp_avg_sq, fp32
    assert c.saved_bytes == 4 * 16 * 64  # addmm keeps its input (the weight is a parameter: not counted)


def test_linear_bf16_follows_cuda_autocast():
    lin = nn.Linear(64, 32)
    c = capture_step(lin, torch.empty(16, 64), precision="bf16", loss_fn=_sum_loss)
    (fwd,) = _ops(c, "forward", "aten.addmm")
    assert fwd.dtype == "bfloat16" and fwd.flops == 2 * 16 * 64 * 32
    assert fwd.bytes_read == 2 * (32 + 16 * 64 + 64 * 32) and fwd.bytes_written == 2 * 16 * 32
    casts = _ops(c, "forward", "aten._to_copy")
    assert sorted(r.bytes_written for r in casts) == sorted([2 * 16 * 64, 2 * 64 * 32, 2 * 32])  # input, weight, bias
    # the loss's sum: CUDA runs it with dtype=float32 (reads the bf16 output, sums in fp32)
    (total,) = _ops(c, "forward", "aten.sum")
    assert total.bytes_read == 2 * 16 * 32 and total.bytes_written == 4
    assert c.saved_bytes == 2 * 16 * 64  # the bf16 input; no input gradient is needed, so no weight copy is kept
    assert c.gradients_bytes == 4 * (64 * 32 + 32)  # fp32 master weights: fp32 gradients


def test_autocast_weight_copies_are_saved_where_an_input_gradient_is_needed():
    net = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 8))
    c = capture_step(net, torch.empty(16, 64), precision="bf16", loss_fn=_sum_loss)
    # layer 1 keeps its bf16 input; layer 2 its bf16 input and autocast's bf16 copy of its weight
    assert c.saved_bytes == 2 * 16 * 64 + 2 * 16 * 32 + 2 * 8 * 32
    assert c.weight_copy_bytes == 2 * 8 * 32
    # per op: what each op's output costs backward (every saved storage here was made by an op: the casts, addmm 1)
    first, second = _ops(c, "forward", "aten.addmm")
    assert first.saved_bytes == 2 * 16 * 32 and second.saved_bytes == 0
    assert sum(r.saved_bytes for r in c.ops) == c.saved_bytes


def test_saved_bytes_match_cpu_autocast_where_the_policies_agree():
    """An MLP body (linear, gelu) autocasts alike on CPU and CUDA: the saved tensors must agree byte for byte.
    (The loss does not: CUDA's cross_entropy runs log_softmax in bf16 and keeps it, CPU's casts to fp32 first.)"""
    from ampcourse import memory
    task = models.make_task("mlp", n=512, seed=0)
    x, y = task.data.tensors

    def loss_fn(out, _):
        return out.float().sum()

    real = memory.forward_saved_bytes(task.model, loss_fn, x, y, torch.autocast("cpu", dtype=torch.bfloat16))
    c = capture_step(task.model, x, precision="bf16", loss_fn=loss_fn, targets=y)
    assert c.saved_bytes == real.activation_bytes + real.weight_copy_bytes
    assert c.weight_copy_bytes == real.weight_copy_bytes > 0


def test_attention_block_flops_and_bytes_by_hand():
    b, h, t, d = 2, 4, 128, 64

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(h * d, 3 * h * d)

        def forward(self, x):
            q, k, v = self.qkv(x).view(b, t, 3, h, d).permute(2, 0, 3, 1, 4)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    c = capture_step(Attention(), torch.empty(b, t, h * d), precision="bf16", loss_fn=_sum_loss)
    (att,) = _ops(c, "forward", "aten._scaled_dot_product_flash_attention")
    causal = (t + 1) / (2 * t)  # is_causal=True: the kernel skips the key blocks above the diagonal
    assert att.flops == int(2 * 2 * b * h * t * t * d * causal)  # q @ k.T and p @ v, the unmasked part
    assert att.dtype == "bfloat16"
    assert att.bytes_read == 3 * 2 * b * h * t * d
    # the output in bf16 and the fp32 log-sum-exp per row (plus flash's RNG seed and offset: three 8-byte words)
    assert att.bytes_written == 2 * b * h * t * d + 4 * b * h * t + 3 * 8
    (grad,) = _ops(c, "backward", "aten._scaled_dot_product_flash_attention_backward")
    assert grad.flops == int(5 * 2 * b * h * t * t * d * causal)  # five T x T matmuls: scores again, dv, dp, dq, dk
    # fp32 runs the memory-efficient kernel as a GPU does: no T x T matrix anywhere
    c32 = capture_step(Attention(), torch.empty(b, t, h * d), loss_fn=_sum_loss)
    assert _ops(c32, "forward", "aten._scaled_dot_product_efficient_attention")
    assert all(r.shape[-2:] != (t, t) for r in c32.ops + c.ops)


def test_conv_flops_and_bytes_by_hand():
    conv = nn.Conv2d(3, 8, 3, padding=1)
    c = capture_step(conv, torch.empty(2, 3, 16, 16), loss_fn=_sum_loss)
    (fwd,) = _ops(c, "forward", "aten.convolution")
    assert fwd.flops == 2 * 2 * 8 * 16 * 16 * 3 * 3 * 3
    assert fwd.bytes_read == 4 * (2 * 3 * 16 * 16 + 8 * 3 * 3 * 3 + 8)
    assert fwd.bytes_written == 4 * 2 * 8 * 16 * 16
    (bwd,) = _ops(c, "backward", "aten.convolution_backward")
    assert bwd.flops == fwd.flops  # the weight gradient only (the input needs none)


# --- memory against the CPU allocator ----------------------------------------------------------------------------

def _tensor_peak(fn) -> int:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from doctor_cost import tensor_peak
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return tensor_peak(fn)


def _real_step_peak(model, x, y, loss_fn) -> int:
    """Peak tensor bytes a real CPU step allocates above what exists before it (profiler memory events)."""
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)

    def step():
        loss = loss_fn(model(x), y)
        loss.backward()
        del loss
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _tensor_peak(step)


@pytest.mark.parametrize("name,precision,batch", [("mlp", "fp32", 512), ("cnn", "fp32", 64), ("transformer", "fp32", 64)])
def test_peak_memory_matches_the_cpu_allocator(name, precision, batch):
    """Within 5% of the peak of live tensor bytes a real CPU step reaches (fp32: under autocast this CPU's bf16
    matmuls allocate scratch buffers of their own, ~600 KB per GEMM measured, that a GPU's cuBLAS does not)."""
    task = models.make_task(name, n=batch, seed=0)
    x, y = task.data.tensors
    real = _real_step_peak(task.model, x, y, task.loss_fn)
    counted = capture_step(task.model, x, precision=precision, loss_fn=task.loss_fn, targets=y)
    assert abs(counted.step_peak_bytes / real - 1) < 0.05, (counted.step_peak_bytes, real)
    before = sum(p.numel() * 4 * 3 for p in task.model.parameters()) + x.nbytes + y.nbytes
    assert counted.peak_bytes == counted.step_peak_bytes + before + sum(b.nbytes for b in task.model.buffers())


def test_bf16_saves_less_than_fp32_and_keeps_fp32_master_state():
    task = models.make_task("transformer", n=64, size="small")
    x, y = task.data.tensors
    r = plan(task.model, x, loss_fn=task.loss_fn, targets=y, precisions=("fp32", "bf16"))
    m32, m16 = r.memory("fp32"), r.memory("bf16")
    assert m16["activations saved"] < m32["activations saved"]
    assert m16["weights"] == m32["weights"] and m16["optimizer state"] == m32["optimizer state"]
    assert m16["of which weight copies"] > 0 == m32["of which weight copies"]


def test_the_model_is_not_moved_or_changed():
    task = models.make_task("mlp", n=8)
    before = {k: v.clone() for k, v in task.model.state_dict().items()}
    x, y = task.data.tensors
    plan(task.model, x, loss_fn=task.loss_fn, targets=y)
    assert all(p.device.type == "cpu" and p.grad is None for p in task.model.parameters())
    assert all(torch.equal(before[k], v) for k, v in task.model.state_dict().items())


# --- the policy ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("source", ["emulate", "fallback"])
def test_policy_is_cuda_autocast_not_cpu(source, monkeypatch):
    """CUDA autocast runs layer_norm and softmax of a low-precision input in fp32 (CPU autocast does not), with
    ampcourse.emulate and with the plan's own fallback (op lists) alike."""
    from ampcourse.plan import capture
    if source == "fallback":
        monkeypatch.setattr(capture, "_emulate_module", lambda: None)
    assert ("emulate" in capture.policy_name()) == (source == "emulate")
    x = torch.empty(4, 8, device="meta", dtype=torch.bfloat16)
    with autocast_policy("bf16"):
        assert F.layer_norm(x, (8,)).dtype == torch.float32
        assert F.softmax(x, dim=-1).dtype == torch.float32
        assert F.linear(x.float(), torch.empty(3, 8, device="meta")).dtype == torch.bfloat16
        assert torch.cat([x, x.float()]).dtype == torch.float32
        assert F.gelu(x).dtype == torch.bfloat16  # not on a list: left alone
        assert x.sum().dtype == torch.float32 and F.cross_entropy(x, torch.zeros(4, dtype=torch.long,
                                                                                 device="meta")).dtype == torch.float32
    with autocast_policy("fp32"):
        assert F.linear(x.float(), torch.empty(3, 8, device="meta")).dtype == torch.float32


def test_fp16_recipe_counts_the_scaler():
    c = capture_step(nn.Linear(8, 4), torch.empty(2, 8), precision="fp16", loss_fn=_sum_loss)
    assert _ops(c, "optimizer", "aten._amp_foreach_non_finite_check_and_unscale_")
    assert not _ops(capture_step(nn.Linear(8, 4), torch.empty(2, 8), precision="bf16", loss_fn=_sum_loss),
                    "optimizer", "aten._amp_foreach_non_finite_check_and_unscale_")


def test_accumulation_counts_each_micro_step():
    one = capture_step(nn.Linear(64, 32), torch.empty(16, 64), loss_fn=_sum_loss)
    four = capture_step(nn.Linear(64, 32), torch.empty(16, 64), loss_fn=_sum_loss, accum_steps=4)
    assert len(_ops(four, "forward", "aten.addmm")) == 4 * len(_ops(one, "forward", "aten.addmm"))
    # micro-steps after the first add into the existing gradients
    assert len(_ops(four, "backward", "aten.add_")) + len(_ops(four, "backward", "aten.add")) >= 3


# --- the roofline ---------------------------------------------------------------------------------------------------

def test_roofline_bounds_a_big_matmul_by_compute_and_a_pointwise_op_by_memory():
    gpu = GPUS["h100-sxm"]
    n = 8192
    c = capture_step(nn.Linear(n, n, bias=False), torch.empty(n, n), precision="bf16", loss_fn=_sum_loss)
    (mm,) = _ops(c, "forward", "aten.mm")
    t = op_time(mm, gpu, "bf16")
    assert t.bound == "compute"
    assert t.compute_s == pytest.approx(2 * n**3 / (989.5e12 * 0.803))
    (cast,) = [r for r in _ops(c, "forward", "aten._to_copy") if r.shape == (n, n) and r.bytes_read == 4 * n * n][:1]
    assert op_time(cast, gpu, "bf16").bound == "memory"
    assert op_time(cast, gpu, "bf16").memory_s == pytest.approx(6 * n * n / (3350e9 * 0.88))


def test_gpt2_on_h100_gains_less_than_its_matmuls():
    """The step's speedup is diluted by the memory-bound ops the tensor cores do not touch."""
    from ampcourse.plan.zoo import build
    s = build("gpt2", batch=8, seq=1024)
    r = plan(s.model, s.inputs, gpu="h100-sxm", loss_fn=s.loss_fn, targets=s.targets, precisions=("fp32", "tf32", "bf16"))
    assert 1 < r.speedup("tf32") < r.speedup("bf16") < r.matmul_speedup("bf16")
    # bf16 / fp32 tensor rates bound the matmuls' gain; a few memory-bound matmuls (bias gradients) gain less
    assert 0.9 * 989.5 / 67 < r.matmul_speedup("bf16") <= 989.5 / 67 * (1 + 1e-9)
    assert r.peak_memory_bytes["bf16"] < r.peak_memory_bytes["fp32"]
    assert r.step_seconds["fp32"] == max(r.gpu_seconds["fp32"], r.host_seconds["fp32"])
    assert " mm " in r.table("bf16") and "bf16" in r.summary()


def test_vit_b16_from_a_config_plans_on_meta():
    """The zoo's ViT-B/16 (Hugging Face, labels in its inputs: it returns its own loss) is ViT-B/16's size and its
    bf16 step is faster than TF32's, which is faster than fp32's, on an A100."""
    from ampcourse.plan.zoo import build
    s = build("vit-b16", batch=8)
    assert all(p.is_meta for p in s.model.parameters())
    assert 86.0e6 < sum(p.numel() for p in s.model.parameters()) < 86.7e6  # ViT-B/16 with a 1000-class head
    r = plan(s.model, s.inputs, gpu="a100-sxm4-80gb", precisions=("fp32", "tf32", "bf16"))
    assert r.step_seconds["bf16"] < r.step_seconds["tf32"] < r.step_seconds["fp32"]
    assert r.peak_memory_bytes["bf16"] < r.peak_memory_bytes["fp32"]


def test_a_tiny_model_is_launch_bound():
    task = models.make_task("mlp", n=32)
    x, y = task.data.tensors
    r = plan(task.model, x, gpu="a100-sxm4-80gb", loss_fn=task.loss_fn, targets=y, precisions=("fp32", "bf16"))
    assert r.host_seconds["bf16"] > r.gpu_seconds["bf16"]
    assert r.speedup("bf16") < 1.15  # more ops (the casts), nothing gained: the right side of 1.15x
    assert "launch" in r.summary()


def test_gpu_without_bf16_units_falls_back_and_says_so():
    task = models.make_task("mlp", n=32)
    x, y = task.data.tensors
    r = plan(task.model, x, gpu="v100-sxm2-16gb", loss_fn=task.loss_fn, targets=y, precisions=("fp32", "bf16"))
    assert any("no bf16" in n for n in r.notes)
    assert all(t.math == "fp32" for t in r.ops["bf16"] if t.record.matmul)


def test_gpus_table_has_the_issue_keys_and_sources():
    for key in ("v100-sxm2-16gb", "v100-sxm2-32gb", "t4", "a100-sxm4-40gb", "a100-sxm4-80gb", "l4", "h100-sxm",
                "h100-pcie", "h200"):
        g = GPUS[key]
        assert g.sources and g.peak_tflops["fp32"] > 0 and g.hbm_gbps > 0
    assert GPUS["a100-sxm4-80gb"].peak_tflops["tf32"] / GPUS["a100-sxm4-80gb"].peak_tflops["fp32"] == 8
    assert 7 < GPUS["h100-sxm"].peak_tflops["tf32"] / GPUS["h100-sxm"].peak_tflops["fp32"] < 7.5
    mine = GPU("mine", "My card", {"fp32": 10.0, "bf16": 100.0}, hbm_gbps=500.0, memory_gb=8)
    r = plan(nn.Linear(8, 4), torch.empty(2, 8), gpu=mine, loss_fn=_sum_loss, precisions=("fp32",))
    assert r.gpu is mine
    with pytest.raises(ValueError, match="peak_tflops"):
        GPU("bad", "Bad", {"bf16": 1.0}, hbm_gbps=1.0, memory_gb=1)


# --- refusals -------------------------------------------------------------------------------------------------------

class _ReadsAValue(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        return y * 2 if y.sum().item() > 0 else y


def test_a_forward_that_reads_values_is_refused_with_the_reason():
    with pytest.raises(NeedsRealValues, match="reads a tensor's value"):
        plan(_ReadsAValue(), torch.empty(2, 4), loss_fn=_sum_loss)


@pytest.mark.parametrize("kwargs,match", [
    ({"gpu": "h100"}, "gpu"), ({"precisions": ("fp8",)}, "precisions"), ({"precisions": ("bf16", "bf16")}, "distinct"),
    ({"accum_steps": 0}, "accum_steps"), ({"optimizer": "adam"}, "optimizer"), ({"loss_fn": 3}, "loss_fn"),
])
def test_bad_arguments_are_refused_naming_them(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan(nn.Linear(4, 4), torch.empty(2, 4), **{"loss_fn": _sum_loss, **kwargs})


def test_no_loss_is_refused():
    with pytest.raises(ValueError, match="scalar loss"):
        plan(nn.Linear(4, 4), torch.empty(2, 4))


class _Blocks(nn.Module):
    """Two residual blocks, optionally under activation checkpointing (torch.utils.checkpoint), as LLMs train."""

    def __init__(self, checkpointed: bool):
        super().__init__()
        self.checkpointed = checkpointed
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256),
                                                  nn.LayerNorm(256)) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = x + (torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if self.checkpointed
                     else block(x))
        return x


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_activation_checkpointing_saves_less_and_recomputes_in_backward(precision):
    # was: 'Tensor on device cpu is not on the expected device meta!' (functional_call put the real weights back
    # before backward, where the checkpoint recomputes), then a CheckpointError under the bf16/fp16 policies
    x = torch.empty(64, 256)
    plain, ckpt = (capture_step(_Blocks(c), x, precision=precision, loss_fn=_sum_loss) for c in (False, True))
    assert ckpt.saved_bytes < plain.saved_bytes / 2
    assert len(_ops(ckpt, "backward", "aten.addmm")) == len(_ops(plain, "forward", "aten.addmm"))  # the recompute
    assert len(_ops(ckpt, "forward")) == len(_ops(plain, "forward"))


class _CpuNoise(nn.Module):
    """Inline noise made on the CPU (torch.rand without device=): fails on a GPU as on meta."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) * torch.rand(8)


def test_a_model_whose_step_cannot_run_on_meta_is_one_line_naming_the_cause():
    t = torch.zeros(4, 6, dtype=torch.long)
    with pytest.raises(ValueError, match=r"Adam does not support sparse gradients.*pass optimizer="):
        plan(SparseBag(100, 16, 4), t, loss_fn=_sum_loss)  # was a RuntimeError traceback from torch.optim
    r = plan(SparseBag(100, 16, 4), t, loss_fn=_sum_loss, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    assert r.step_seconds["bf16"] > 0
    with pytest.raises(ValueError, match=r"cannot run on meta tensors.*without device="):
        plan(_CpuNoise(), torch.empty(2, 8), loss_fn=_sum_loss)


# --- the command line ---------------------------------------------------------------------------------------------

def test_cli_prints_the_table_and_writes_json(tmp_path, capsys):
    from ampcourse.plan.cli import main
    out = tmp_path / "plan.json"
    assert main(["--model", "gpt2", "--gpu", "h100-sxm", "--batch", "2", "--seq", "128", "--precisions", "fp32,bf16",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "H100 SXM5" in text and "bf16" in text and "mm" in text
    import json
    data = json.loads(out.read_text())
    assert set(data["step_seconds"]) == {"fp32", "bf16"} and data["gpu"] == "h100-sxm"


@pytest.mark.parametrize("argv,match", [
    (["--model", "gpt3"], "--model 'gpt3'"), (["--model", "gpt2", "--gpu", "h100"], "--gpu 'h100'"),
    (["--model", "gpt2", "--precisions", "fp8"], "--precisions"), (["--model", "gpt2", "--batch", "0"], "--batch"),
    (["--model", "nosuchmodule:make"], "cannot import"), (["--gpu", "t4"], "--model"),
])
def test_cli_errors_are_one_line_exit_2(argv, match, capsys):
    from ampcourse.plan.cli import main
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and match in err and err.startswith("ampcourse.plan: error:")


def test_on_another_gpu_retimes_the_same_counts():
    task = models.make_task("mlp", n=64)
    x, y = task.data.tensors
    a100 = plan(task.model, x, gpu="a100-sxm4-80gb", loss_fn=task.loss_fn, targets=y, precisions=("fp32", "bf16"))
    h100 = a100.on("h100-sxm")
    assert h100.counts == a100.counts and h100.gpu.key == "h100-sxm"
    direct = plan(task.model, x, gpu="h100-sxm", loss_fn=task.loss_fn, targets=y, precisions=("fp32", "bf16"))
    assert h100.step_seconds == direct.step_seconds and h100.peak_memory_bytes == direct.peak_memory_bytes
    with pytest.raises(ValueError, match="gpu"):
        a100.on("h200x")


def test_plot_draws_one_bar_per_recipe_and_group():
    import matplotlib
    matplotlib.use("Agg")
    task = models.make_task("mlp", n=64)
    x, y = task.data.tensors
    r = plan(task.model, x, loss_fn=task.loss_fn, targets=y, precisions=("fp32", "bf16"))
    ax = r.plot(top=4)
    assert len(ax.get_yticklabels()) == 5 and len(ax.patches) == 2 * 5
    assert sum(p.get_width() for p in ax.patches[:5]) == pytest.approx(r.gpu_seconds["fp32"] * 1e3)
    assert ax.get_xscale() == "log"


def test_a_hugging_face_model_with_labels_returns_its_own_loss():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
                                  vocab_size=1000, attn_implementation="sdpa")
    with torch.device("meta"):
        model = transformers.BertForMaskedLM(cfg)
    ids = torch.zeros(4, 32, dtype=torch.long)
    r = plan(model, {"input_ids": ids, "labels": ids}, gpu="a100-sxm4-80gb", precisions=("fp32", "bf16"))
    n = sum(p.numel() for p in model.parameters())
    assert r.memory("fp32")["weights"] == 4 * n  # the tied decoder weight counted once
    fwd = [t.record for t in r.ops["bf16"] if t.record.phase == "forward" and t.record.matmul]
    assert fwd and all(rec.dtype == "bfloat16" for rec in fwd)
    assert any("attention" in rec.op for rec in fwd)  # the fused kernel a GPU runs, not a T x T matmul


def test_inputs_must_hold_a_tensor():
    with pytest.raises(ValueError, match="inputs must be"):
        plan(nn.Linear(4, 4), [1, 2], loss_fn=_sum_loss)
    with pytest.raises(ValueError, match="model must be"):
        plan(lambda x: x, torch.empty(2, 4), loss_fn=_sum_loss)


def test_cli_plans_a_factory_of_yours(tmp_path, monkeypatch, capsys):
    from ampcourse.plan.cli import main
    (tmp_path / "plan_cli_models.py").write_text(
        "import torch\n"
        "def make():\n"
        "    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 10))\n"
        "    return net, torch.empty(128, 32), torch.nn.functional.cross_entropy, torch.zeros(128, dtype=torch.long)\n"
        "def broken():\n"
        "    raise RuntimeError('no data here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "plan_cli_models", raising=False)  # a name of its own: no other test's module
    assert main(["--model", "plan_cli_models:make", "--gpu", "l4", "--precisions", "fp32,bf16", "--top", "3"]) == 0
    assert "L4" in capsys.readouterr().out
    assert main(["--model", "plan_cli_models:broken"]) == 2
    assert "the factory raised RuntimeError: no data here" in capsys.readouterr().err
    assert main(["--model", "plan_cli_models.py:make"]) == 2
    assert "not a file path" in capsys.readouterr().err


# --- the second audit's defects -------------------------------------------------------------------------------

def test_bert_refuses_a_seq_beyond_its_positions_and_defaults_to_them(capsys, monkeypatch):
    # was: --seq 1024 (the default) failed with "cannot run on meta tensors (... expanded size ... 512)"
    from ampcourse.plan import cli, zoo
    assert cli.main(["--model", "bert-base", "--seq", "1024"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--seq 1024" in err and "512 positions" in err and "meta" not in err
    with pytest.raises(ValueError, match="512 positions"):
        zoo.build("bert-large", batch=1, seq=513)
    seen = {}

    def fake_build(name, batch, seq):  # the default, without building BERT (transformers takes seconds to import)
        seen["seq"] = seq
        raise ValueError("stop here")

    monkeypatch.setattr(cli, "build", fake_build)
    assert cli.main(["--model", "bert-large"]) == 2
    assert seen["seq"] == 512 and "--seq 512" in capsys.readouterr().out
    assert cli.main(["--model", "gpt2", "--batch", "1"]) == 2 and seen["seq"] == 1024  # others keep 1024


def test_building_bert_keeps_torchao_load_noise_out():
    pytest.importorskip("transformers")
    import subprocess
    code = "from ampcourse.plan.zoo import build; build('bert-base', batch=1, seq=8)"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr[-500:]
    assert "Failed to load" not in done.stderr and "_pytree" not in done.stderr, done.stderr[-500:]


class _Attention(nn.Module):
    def __init__(self, causal: bool = False, t: int = 256):
        super().__init__()
        self.causal, self.t = causal, t
        self.qkv = nn.Linear(64, 3 * 64)

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.shape[0], self.t, 3, 1, 64).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)


def test_fp32_attention_runs_3xtf32_on_tensor_cores_where_the_gpu_has_tf32():
    # was: timed at the CUDA-core fp32 rate (fp32 recipe) or the full TF32 rate (tf32 recipe)
    r = plan(_Attention(), torch.empty(8, 256, 64), gpu="a100-sxm4-80gb", precisions=("fp32", "tf32"),
             loss_fn=_sum_loss)
    for p in ("fp32", "tf32"):
        att = [t for t in r.ops[p] if "efficient_attention" in t.record.op]
        assert {t.record.phase for t in att} == {"forward", "backward"}
        for t in att:
            assert t.math == "3xtf32"
            assert t.compute_s == pytest.approx(t.record.flops / (GPUS["a100-sxm4-80gb"].ceiling_tflops("tf32") / 3
                                                                  * 1e12))
    assert "3xTF32" in r.summary()
    v100 = r.on("v100-sxm2-16gb")  # sm70: the kernel's fallback is plain fp32 FMA on CUDA cores
    assert all(t.math == "fp32" for t in v100.ops["fp32"] if "attention" in t.record.op)
    assert "3xTF32" not in v100.summary()


def test_a_half_model_gets_a_note_that_gradscaler_refuses_it():
    # was: notes == [] and an fp16 prediction GradScaler("cuda") would refuse ('Attempting to unscale FP16 gradients')
    r = plan(nn.Linear(8, 4).half(), torch.empty(2, 8).half(), precisions=("fp32", "fp16"), loss_fn=_sum_loss)
    assert any("GradScaler refuses float16 gradients" in n for n in r.notes)
    assert "maths in float16, not fp32" in r.summary().splitlines()[1]
    b = plan(nn.Linear(8, 4).bfloat16(), torch.empty(2, 8).bfloat16(), precisions=("fp32", "bf16"), loss_fn=_sum_loss)
    assert any("bfloat16, not fp32" in n for n in b.notes) and not any("GradScaler" in n for n in b.notes)
    fp32_line = b.summary().splitlines()[1]
    assert fp32_line.lstrip().startswith("fp32") and "maths in bfloat16, not fp32" in fp32_line
    assert plan(nn.Linear(8, 4), torch.empty(2, 8), loss_fn=_sum_loss).notes == []  # an fp32 model: no note


class _TupleLoss(nn.Module):
    """Returns (loss, logits) given labels, as a Hugging Face model with return_dict=False does."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 4)

    def forward(self, x, labels=None):
        out = self.lin(x)
        return (F.cross_entropy(out, labels), out) if labels is not None else (out,)


def test_a_loss_first_tuple_is_the_loss_and_a_tuple_without_one_is_named():
    # was: "pass loss_fn=, or inputs with labels" although the labels had been passed
    x, y = torch.empty(2, 16), torch.zeros(2, dtype=torch.long)
    r = plan(_TupleLoss(), {"x": x, "labels": y}, precisions=("fp32",))
    assert any(t.record.op == "aten.nll_loss_forward" for t in r.ops["fp32"])
    with pytest.raises(ValueError, match=r"returned a tuple of 1 \(tensor \(2, 4\) float32\).*out\[0\]") as err:
        plan(_TupleLoss(), {"x": x}, precisions=("fp32",))
    assert "labels" not in str(err.value)


def test_an_embedding_reads_the_rows_it_gathers_not_the_table():
    # was: bytes_read = the whole 100000 x 512 table (204.8 MB) for 128 looked-up rows
    emb = nn.Embedding(100_000, 512)
    ids = torch.zeros(8, 16, dtype=torch.long)
    c = capture_step(emb, ids, loss_fn=_sum_loss)
    (fwd,) = _ops(c, "forward", "aten.embedding")
    assert fwd.bytes_read == 8 * 16 * 8 + 8 * 16 * 512 * 4  # the int64 indices and the rows gathered
    (bwd,) = _ops(c, "backward", "aten.embedding_dense_backward")
    assert bwd.bytes_written == 100_000 * 512 * 4  # the gradient is the whole table


def test_causal_attention_counts_the_unmasked_half():
    # was: the same FLOPs with and without is_causal, though the kernels skip the blocks above the diagonal
    x = torch.empty(4, 256, 64)
    for precision in ("bf16", "fp32"):  # flash and memory-efficient kernels
        full, causal = (capture_step(_Attention(c), x, precision=precision, loss_fn=_sum_loss) for c in (False, True))
        for phase in ("forward", "backward"):
            f = [r.flops for r in _ops(full, phase) if "attention" in r.op]
            h = [r.flops for r in _ops(causal, phase) if "attention" in r.op]
            assert len(f) == len(h) == 1 and h[0] == int(f[0] * 257 / 512)


def test_report_methods_refuse_a_recipe_not_planned_naming_what_was():
    # was: KeyError: 'fp32' and KeyError: 'fp8'
    r = plan(nn.Linear(8, 4), torch.empty(2, 8), precisions=("bf16", "fp16"), loss_fn=_sum_loss)
    with pytest.raises(ValueError, match=r"over='fp32' was not planned \(this report has bf16, fp16\).*precisions="):
        r.speedup("bf16")
    assert r.speedup("bf16", over="fp16") > 0
    with pytest.raises(ValueError, match=r"one of this report's recipes, bf16, fp16.*'fp8'"):
        r.table("fp8")
    for call in (lambda: r.memory("fp32"), lambda: r.split("tf32"), lambda: r.rows("fp8"),
                 lambda: r.matmul_speedup("bf16")):
        with pytest.raises(ValueError, match="bf16, fp16"):
            call()
