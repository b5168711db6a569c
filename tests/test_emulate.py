"""emulate.autocast gives CPU and meta tensors CUDA's autocast: the casts, the level, the state it leaves."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ampcourse import autocast_ops, emulate

LOW = [torch.float16, torch.bfloat16]
IDS = ["fp16", "bf16"]


def x_w(requires_grad=False):
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 8, generator=g), torch.randn(3, 8, generator=g).requires_grad_(requires_grad)


@pytest.mark.parametrize("low", LOW, ids=IDS)
def test_cuda_casts_on_cpu_tensors(low):
    x, w = x_w()
    with emulate.autocast("cuda", dtype=low):
        y = F.linear(x, w)
        assert y.dtype == low  # lower
        assert torch.softmax(y, -1).dtype == torch.float32  # fp32 on CUDA (CPU autocast keeps it low)
        assert F.layer_norm(y, (3,)).dtype == torch.float32
        assert y.sum().dtype == y.exp().dtype == torch.float32
        assert F.cross_entropy(y, torch.arange(4) % 3).dtype == torch.float32
        assert torch.addcmul(y, x[:, :3], x[:, :3]).dtype == torch.float32  # promote to the widest
        assert torch.relu(y).dtype == low  # not on CUDA's lists: follows its input
        assert torch.softmax(y, -1, dtype=low).dtype == low  # set_opt_dtype keeps an explicit dtype
        d = torch.randn(4, 8, dtype=torch.float64)
        assert F.linear(d, w.double()).dtype == torch.float64  # fp64 is never cast
        assert torch.ops.aten.mm.default(x, w.t()).dtype == low  # a direct aten call


def test_the_policy_applies_before_decomposition():
    """cross_entropy is not on CUDA's lists but its pieces are: log_softmax keeps the dtype it is given
    (cross_entropy_loss passes the input's), nll_loss runs in fp32 -- as the replay on CUDA's kernels shows."""
    x, _ = x_w()
    with emulate.autocast(dtype=torch.bfloat16, trace=True) as emu:
        F.cross_entropy(x.bfloat16(), torch.arange(4) % 8)
    ops = [(c.op, c.output) for c in emu.calls]
    assert ops == [("aten::log_softmax.int", "bfloat16"), ("aten::nll_loss", "float32")]
    assert autocast_ops.replay(emu.calls) == ["bfloat16", "float32"]


def test_meta_tensors_get_the_casts_too():
    with emulate.autocast(dtype=torch.bfloat16):
        y = F.linear(torch.empty(4, 8, device="meta"), torch.empty(3, 8, device="meta"))
        p = torch.softmax(y, -1)
    assert (y.device.type, y.dtype, p.dtype) == ("meta", torch.bfloat16, torch.float32)


def test_a_model_built_on_meta_runs_forward_and_backward():
    """What a planner needs: shapes and CUDA's dtypes of a whole model without memory."""
    from ampcourse import models

    with torch.device("meta"):
        model = models.TinyTransformer()
    idx = torch.zeros(2, 16, dtype=torch.long, device="meta")
    with emulate.autocast(dtype=torch.bfloat16, trace=True) as emu:
        out = model(idx)
    assert (out.device.type, out.dtype) == ("meta", torch.bfloat16)
    assert {c.op for c in emu.calls} >= {"aten::linear", "aten::layer_norm"}
    out.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters() if p.requires_grad)


def test_banned_ops_raise_as_on_cuda():
    with emulate.autocast(dtype=torch.float16), pytest.raises(RuntimeError, match="unsafe to autocast"):
        F.binary_cross_entropy(torch.rand(3), torch.rand(3))
    assert F.binary_cross_entropy(torch.rand(3), torch.rand(3)).dtype == torch.float32  # outside: fine


def test_nesting_and_disabled_regions():
    x, w = x_w()
    with emulate.autocast(dtype=torch.float16):
        with emulate.autocast(enabled=False):
            assert F.linear(x, w).dtype == torch.float32
        with emulate.autocast(dtype=torch.bfloat16):
            assert F.linear(x, w).dtype == torch.bfloat16
        assert F.linear(x, w).dtype == torch.float16
        assert torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == torch.float16


def test_torch_autocast_regions_inside_the_model_are_honoured():
    """HF models open torch.autocast("cuda", ...) (and torch.autocast(x.device.type, enabled=False)) regions."""
    x, w = x_w()
    with emulate.autocast(dtype=torch.float16):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            assert F.linear(x, w).dtype == torch.bfloat16
        with torch.autocast("cuda", enabled=False):
            assert F.linear(x, w).dtype == torch.float32
        with torch.autocast(x.device.type, enabled=False):  # "cpu": device-derived, as HF's RoPE does
            assert F.linear(x, w).dtype == torch.float32
        assert F.linear(x, w).dtype == torch.float16


def test_a_loop_written_for_cpu_autocast_gets_cudas_policy_inside_an_emulation():
    x, w = x_w()
    with emulate.autocast(enabled=False):
        assert F.linear(x, w).dtype == torch.float32  # the outer region casts nothing
        with torch.autocast("cpu", dtype=torch.bfloat16):  # CPU tensors stand for CUDA ones
            y = F.linear(x, w)
            assert y.dtype == torch.bfloat16 and torch.softmax(y, -1).dtype == torch.float32  # CUDA's lists
            assert torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == torch.bfloat16
        assert not torch.is_autocast_enabled("cuda")
    with torch.autocast("cpu", dtype=torch.bfloat16):  # outside: CPU autocast, CPU's lists
        assert torch.softmax(F.linear(x, w), -1).dtype == torch.bfloat16


class _UpcastMatmul(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float32)
    def forward(ctx, a, b):
        ctx.seen = (a.dtype, b.dtype, torch.is_autocast_enabled("cuda"))
        return a @ b

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, g):
        return g, g


class _PlainMatmul(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a @ b

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        ctx.bwd = (g @ b.t()).dtype  # custom_bwd: backward runs under forward's autocast state
        return g @ b.t(), a.t() @ g


def test_custom_fwd_and_custom_bwd_for_cuda():
    a = torch.randn(4, 4, requires_grad=True)
    b = torch.randn(4, 4, requires_grad=True)
    with emulate.autocast(dtype=torch.float16):
        up = _UpcastMatmul.apply(a.half(), b)
        plain = _PlainMatmul.apply(a, b)
    assert up.grad_fn.seen == (torch.float32, torch.float32, False) and up.dtype == torch.float32
    assert plain.dtype == torch.float16
    with emulate.autocast(enabled=False):  # backward inside an emulation: custom_bwd's region needs the kernels
        plain.float().sum().backward()
    assert plain.grad_fn.bwd == torch.float16 and a.grad.dtype == torch.float32


@pytest.mark.parametrize("enabled, low", [(False, torch.float16), (True, torch.float16), (True, torch.bfloat16)])
def test_activation_checkpointing_recomputes_in_the_region_its_forward_ran_in(enabled, low):
    """torch.utils.checkpoint re-enters the autocast state it read at forward; inside an emulation CPU's reads "on,
    bf16" in every region, so a block checkpointed with autocast off (or in fp16) was recomputed in bf16 and backward
    raised ("Recomputed values for the following tensors have different metadata")."""
    import torch.utils.checkpoint as ckpt
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    x = torch.randn(4, 8)
    grads = []
    for checkpointed in (False, True):
        block.zero_grad()
        with emulate.autocast(dtype=torch.float16, enabled=False):  # one outer emulation: backward inside it
            with emulate.autocast(dtype=low, enabled=enabled):
                y = ckpt.checkpoint(block, x, use_reentrant=False) if checkpointed else block(x)
            assert y.dtype == (low if enabled else torch.float32)
            y.float().square().sum().backward()
        grads.append([p.grad.clone() for p in block.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))  # the recompute ran as the forward did, bit for bit
    assert torch.utils.checkpoint._get_autocast_kwargs.__module__ == "torch.utils.checkpoint"  # unpatched on exit


@pytest.mark.parametrize("first", ["no_grad", "inference_mode"])
def test_a_weight_cast_made_without_gradients_still_trains_the_weight_later_in_the_region(first):
    """As torch's cached_cast (pytorch#158232): a weight cast cached under no_grad is made with gradients on, so the
    next forward in the region (an evaluation before a training step, a reentrant checkpoint's recompute) trains
    the weight; under inference_mode nothing is cached. Was: 'element 0 of tensors does not require grad'."""
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8)
    with emulate.autocast(dtype=torch.bfloat16):
        with getattr(torch, first)():
            lin(x)
        y = lin(x)
    y.float().sum().backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the real autocast, for the same sequence
        with getattr(torch, first)():
            lin(x)
        want = torch.autograd.grad(lin(x).float().sum(), lin.weight)[0]
    assert lin.weight.grad is not None and torch.equal(lin.weight.grad, want)


@pytest.mark.parametrize("low", [torch.float16, torch.bfloat16])
def test_a_reentrant_checkpoint_trains_its_weights_under_the_emulator(low):
    import torch.utils.checkpoint as ckpt
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    grads = []
    for checkpointed in (False, True):
        block.zero_grad()
        x.grad = None
        with emulate.autocast(dtype=torch.float16, enabled=False):
            with emulate.autocast(dtype=low):
                y = ckpt.checkpoint(block, x, use_reentrant=True) if checkpointed else block(x)
            y.float().square().sum().backward()
        grads.append([p.grad.clone() for p in block.parameters()] + [x.grad.clone()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_autograd_sees_the_casts():
    """Backward runs in the dtypes the forward casts imply: a low-precision gradient into the matmul, fp32 on the weight."""
    x, w = x_w(requires_grad=True)
    seen = {}
    with emulate.autocast(dtype=torch.bfloat16):
        y = F.linear(x, w)
        y.register_hook(lambda g: seen.update(y=g.dtype))
        loss = torch.softmax(y, -1).sum()
    loss.backward()
    assert seen["y"] == torch.bfloat16 and w.grad.dtype == torch.float32


def test_weights_are_cast_once_per_region():
    x, w = x_w(requires_grad=True)
    with emulate.autocast(dtype=torch.float16):
        a, b = F.linear(x, w), F.linear(x, w)
    cast_a, cast_b = (out.grad_fn.next_functions[1][0].next_functions[0][0] for out in (a, b))
    assert cast_a is cast_b  # one ToCopyBackward: the cached cast of w
    with emulate.autocast(dtype=torch.float16, cache_enabled=False):
        c, d = F.linear(x, w), F.linear(x, w)
    assert c.grad_fn.next_functions[1][0].next_functions[0][0] is not d.grad_fn.next_functions[1][0].next_functions[0][0]


def test_exit_leaves_no_state_behind():
    x, w = x_w()
    before = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"), torch.is_autocast_enabled("cpu"),
              torch.is_autocast_cache_enabled(), torch._C._dispatch_tls_is_dispatch_key_included(
                  torch._C.DispatchKey.AutocastCPU))
    init = torch.amp.autocast_mode.autocast.__init__
    with pytest.raises(ZeroDivisionError), emulate.autocast(dtype=torch.bfloat16):
        F.linear(x, w)
        1 / 0  # an error inside the region still restores everything
    assert (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"), torch.is_autocast_enabled("cpu"),
            torch.is_autocast_cache_enabled(), torch._C._dispatch_tls_is_dispatch_key_included(
                torch._C.DispatchKey.AutocastCPU)) == before
    assert torch.amp.autocast_mode.autocast.__init__ is init and not emulate.is_active()
    assert emulate._local.cache == {} and emulate._global["lib"] is None
    with torch.autocast("cpu", dtype=torch.bfloat16):  # CPU autocast's own kernels are back
        y = F.linear(x, w)
        assert y.dtype == torch.bfloat16 and torch.softmax(y, -1).dtype == torch.bfloat16
    assert F.linear(x, w).dtype == torch.float32


@pytest.mark.parametrize("kw, match", [
    ({"device_type": "cpu"}, "device_type must be 'cuda'"),
    ({"dtype": torch.float32}, "float16 or torch.bfloat16"),
    ({"enabled": "yes"}, "must be bools"),
])
def test_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        emulate.autocast(**kw)


def test_works_as_a_decorator():
    x, w = x_w()

    @emulate.autocast(dtype=torch.bfloat16)
    def f():
        return F.linear(x, w)

    assert f().dtype == torch.bfloat16 and f().dtype == torch.bfloat16 and not emulate.is_active()


def test_limits_are_stated():
    text = " ".join(emulate.LIMITS)
    for word in ("accumulation", "TF32", "softmax", "reduced-precision", "nn.LSTM", "cudnn.enabled=False",
                 "named tensors", "rename(None)"):
        assert word in text


def test_an_nn_module_trains_under_the_emulator():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
    losses = []
    with emulate.autocast(enabled=False):  # one outer region: the kernels stay registered across steps
        for _ in range(5):
            with emulate.autocast(dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    assert losses[-1] < losses[0] and all(p.dtype == torch.float32 for p in model.parameters())


def test_an_op_without_a_low_precision_cpu_kernel_runs_in_fp32_and_comes_out_low():
    """CUDA runs it low; a CPU without the fp16/bf16 kernel computes it in fp32 and casts the result (said in .fallbacks)."""
    err = RuntimeError('"addmm_impl_cpu_" not implemented for \'Half\'')
    from ampcourse._errors import missing_low_kernel
    assert missing_low_kernel(err) and not missing_low_kernel(RuntimeError("shape mismatch"))
    assert missing_low_kernel(RuntimeError("Unsupported dtype BFloat16"))  # torch.fft's words on a CPU
    assert not missing_low_kernel(RuntimeError("Unsupported dtype Float8_e4m3fn"))  # not fp16/bf16
    a, b = torch.randn(4, 8).half(), torch.randn(8, 3).half()
    out = emulate._fp32_then_low(torch.ops.aten.mm.default, [a, b], {}, torch.float16)
    assert out.dtype == torch.float16 and torch.equal(out, (a.float() @ b.float()).half())


@pytest.mark.parametrize("low", LOW, ids=IDS)
@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU, nn.RNN])
def test_rnn_modules_run_in_fp16_as_cudnns_autocast_wrapper_casts_them(cls, low):
    """On CUDA nn.LSTM/GRU/RNN reach _cudnn_rnn, whose wrapper (AutocastRNN.cpp) casts input, hx, cx and weights to
    at::kHalf, in bf16 regions too; on a CPU they never reach it, and the emulator left them in fp32."""
    torch.manual_seed(0)
    rnn = cls(4, 5, num_layers=2, bidirectional=True)
    with emulate.autocast(dtype=low, trace=True) as emu:
        out, hidden = rnn(torch.randn(3, 2, 4))
    states = hidden if isinstance(hidden, tuple) else (hidden,)
    assert [t.dtype for t in (out, *states)] == [torch.float16] * (1 + len(states))
    assert [(c.op.split(".")[0], c.category, c.output) for c in emu.calls] == [
        ({nn.LSTM: "aten::lstm", nn.GRU: "aten::gru", nn.RNN: "aten::rnn_tanh"}[cls], "lower", "float16")]
    out.float().sum().backward()  # the weight casts are recorded by autograd: fp32 gradients for the fp32 weights
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in rnn.parameters())
    packed = nn.utils.rnn.pack_padded_sequence(torch.randn(3, 2, 4), [3, 2])
    with emulate.autocast(dtype=low):
        assert rnn(packed)[0].data.dtype == torch.float16  # packed sequences: the .data overloads
    with emulate.autocast(dtype=low), torch.backends.cudnn.flags(enabled=False):
        assert rnn(torch.randn(3, 2, 4))[0].dtype == torch.float32  # CUDA's native path: not emulated (LIMITS)


def test_an_rnn_under_cudas_lists_through_the_doctors_session_comes_out_fp16():
    """The doctor's policy="cuda": one outer emulate.session, its own torch.autocast("cpu", ...) regions inside."""
    context, _ = emulate.session("cuda", "cpu")
    lstm = nn.LSTM(4, 5, proj_size=3)
    with context, torch.autocast("cpu", dtype=torch.bfloat16):
        out, (h, c) = lstm(torch.randn(3, 2, 4))
    assert (out.dtype, h.dtype, c.dtype) == (torch.float16,) * 3


@pytest.mark.parametrize("low", LOW, ids=IDS)
def test_matrix_norm_with_a_number_ord_runs_in_fp32_as_on_cuda(low):
    """CUDA's linalg_matrix_norm (Scalar ord) is set_opt_dtype fp32; the probe once called it with ord=2, which
    rejects fp16/bf16 before dispatch, so it read "not probeable" and ran low under the emulator."""
    x = torch.randn(6, 6).to(low)
    with emulate.autocast(dtype=low):
        assert torch.linalg.matrix_norm(x, ord=1).dtype == torch.float32
        assert torch.linalg.norm(x, ord=float("inf")).dtype == torch.float32
    assert (emulate.policy(low)["aten::linalg_matrix_norm"].category,
            emulate.policy(low)["aten::linalg_matrix_norm"].kind) == ("fp32", "fp32_set_opt_dtype")


def test_an_overload_the_probe_cannot_classify_still_gets_the_casts_of_the_ops_it_calls(monkeypatch):
    """As a real autocast fallthrough: the overload itself runs unchanged, the registered ops inside it get CUDA's
    policy (here linalg_matrix_norm read as not probeable: its inner vector norm/sum runs in fp32)."""
    real = emulate.policy

    def unclassified(dtype=torch.float16):
        pol = real(dtype)
        pol["aten::linalg_matrix_norm"] = autocast_ops.Policy("aten::linalg_matrix_norm", "unsupported",
                                                              reason="not probeable: (as a test)")
        return pol

    monkeypatch.setattr(emulate, "policy", unclassified)
    with emulate.autocast(dtype=torch.bfloat16, trace=True) as emu:
        out = torch.linalg.matrix_norm(torch.randn(6, 6).bfloat16(), ord=1)
    *inner, outer = emu.calls  # traced as each returns: the ops inside first
    assert outer.op == "aten::linalg_matrix_norm" and outer.category == "unsupported"
    assert inner and all(c.category == "fp32" for c in inner), inner
    assert out.dtype == torch.float32


def test_a_named_tensor_in_a_region_works_or_says_what_to_do():
    """torch 2.11 cannot box a named tensor into the emulator's Python kernels ("NYI: ... TorchScript"); the
    error says so in the emulator's words. Later torches have no named tensors."""
    if not hasattr(torch.Tensor, "refine_names"):
        pytest.skip("this torch has no named tensors")
    x = torch.randn(4, 8).refine_names("N", "C")
    try:
        with emulate.autocast(dtype=torch.bfloat16):
            y = x.softmax(-1)
    except RuntimeError as err:
        assert str(err).startswith("emulate.autocast: ") and "rename(None)" in str(err), err
    else:
        assert y.dtype == torch.float32
    assert not emulate.is_active()
