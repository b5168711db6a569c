"""The six classes of problem a leaf-only, forward-only doctor cannot see (issue 18), and issue 21's doctor items.

Each test plants one problem and checks that the doctor finds it, names the op's module and phase, and gives
advice that works when followed; healthy controls check that it does not cry wolf.
"""

import copy
import math
import random

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ampcourse.doctor import examine
from ampcourse.models import loss_fn, make_model, make_task
from ampcourse.policy import apply_policy


def batch(name: str = "mlp", n: int = 64):
    x, y = make_task(name, n=n).data.tensors
    return x, y


# -- 1. inline code in a non-leaf module's forward ----------------------------------------------------------------

class InlineRMSBlock(nn.Module):
    """A block whose RMSNorm is written inline in its own forward (x * x overflows fp16 before the mean)."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.weight = nn.Parameter(torch.ones(64))
        with torch.no_grad():
            self.up.weight.mul_(500)

    def forward(self, x):
        h = self.up(x)
        return h * torch.rsqrt((h * h).mean(-1, keepdim=True) + 1e-6) * self.weight


class WithInlineBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.block, self.head = InlineRMSBlock(), nn.Linear(64, 10)

    def forward(self, x):
        return self.head(F.gelu(self.block(x)))


def test_inline_rmsnorm_is_named_with_its_op_and_the_island_works():
    torch.manual_seed(0)
    model = WithInlineBlock()
    x, y = batch()
    r = examine(model, x, y, loss_fn=loss_fn)
    assert not r.is_clean("fp16")
    bad = r.find("nonfinite", "fp16")
    assert bad and bad[0].module == "block" and bad[0].op == "aten::mul" and bad[0].phase == "forward"
    assert "(inline in forward)" in bad[0].message and "65504" in bad[0].message
    assert r.verdicts["fp16"]["status"] == "islands" and r.verdicts["fp16"]["fp32_modules"] == ["block"]
    assert r.is_clean("bf16") and r.recommended_precision == "bf16"
    # the advice works: with the island, fp16 examines clean and its loss matches fp32
    apply_policy(model, {"block": "fp32"})
    fixed = examine(model, x, y, loss_fn=loss_fn, precisions=("fp16",))
    assert fixed.is_clean("fp16"), fixed.summary()


class InlineAttention(nn.Module):
    """Attention with the logits computed inline and no 1/sqrt(d): q.k passes fp16's max."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        with torch.no_grad():
            self.q.weight.mul_(80)
            self.k.weight.mul_(80)

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        att = (q @ k.transpose(-2, -1)).softmax(-1)
        return self.o(att @ v)


class TinyAttnModel(nn.Module):
    def __init__(self, d: int = 32):
        super().__init__()
        self.attn, self.head = InlineAttention(d), nn.Linear(d, 10)

    def forward(self, x):
        return self.head(self.attn(x)).mean(1)


def attn_batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 12, 32, generator=g) * 3, torch.randint(0, 10, (8,), generator=g)


def test_inline_attention_logits_blame_the_attention_not_the_next_leaf():
    torch.manual_seed(0)
    model = TinyAttnModel()
    x, y = attn_batch()
    r = examine(model, x, y, loss_fn=F.cross_entropy)
    bad = r.find("nonfinite", "fp16")
    assert bad and bad[0].module == "attn" and bad[0].op in ("aten::bmm", "aten::mm", "aten::matmul"), r.summary()
    assert "attn.o" not in r.verdicts["fp16"].get("tried_fp32_modules", [])
    assert not r.is_clean("fp16")


# -- 2. problems that only exist in backward ----------------------------------------------------------------------

class _FusedRMSFn(torch.autograd.Function):
    """RMSNorm whose forward computes in fp32 (safe), but whose backward recomputes x*x in the input's dtype."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        xf = x.float()
        return (xf * torch.rsqrt((xf * xf).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        r = torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6)  # x*x in fp16 under autocast: overflows
        return r * (g - x * r * r * (g * x).mean(-1, keepdim=True))


class FusedNorm(nn.Module):
    def forward(self, x):
        return _FusedRMSFn.apply(x)


class WithFusedNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.norm, self.head = nn.Linear(32, 64), FusedNorm(), nn.Linear(64, 10)
        with torch.no_grad():
            self.up.weight.mul_(500)

    def forward(self, x):
        return self.head(self.norm(self.up(x)))


def test_backward_only_overflow_in_a_custom_function_is_found():
    torch.manual_seed(0)
    model = WithFusedNorm()
    x, y = batch()
    r = examine(model, x, y, loss_fn=loss_fn)
    assert not r.find("nonfinite", "fp16"), r.summary()  # the forward is fine
    bad = r.find("backward_nonfinite", "fp16")
    assert bad and bad[0].phase == "backward" and bad[0].module == "norm" and bad[0].op == "aten::mul", r.summary()
    assert "_FusedRMSFnBackward" in bad[0].message
    assert not r.is_clean("fp16")
    assert r.verdicts["fp16"]["fp32_modules"] == ["norm"]  # in fp32, its backward gets fp32 inputs too
    assert r.is_clean("bf16")


class _LSEFn(torch.autograd.Function):
    """log_softmax: a safe fp32 forward; the backward recomputes softmax from a log-sum-exp kept in x's dtype."""

    @staticmethod
    def forward(ctx, x):
        lse = torch.logsumexp(x.float(), -1, keepdim=True)
        ctx.save_for_backward(x, lse.to(x.dtype))
        return x.float() - lse

    @staticmethod
    def backward(ctx, g):
        x, lse = ctx.saved_tensors
        return (g - torch.exp(x - lse) * g.sum(-1, keepdim=True)).to(x.dtype)


class LSE(nn.Module):
    def forward(self, x):
        return _LSEFn.apply(x)


class OffsetLogits(nn.Module):
    def __init__(self, offset: float):
        super().__init__()
        self.stem, self.head, self.logp = nn.Linear(16, 32), nn.Linear(32, 10), LSE()
        with torch.no_grad():
            self.head.bias.fill_(offset)

    def forward(self, x):
        return self.logp(self.head(torch.relu(self.stem(x))))


def _nll(out, y):
    return F.nll_loss(out.float(), y)


def test_finite_wrong_gradients_from_a_custom_backward_are_found_per_parameter_and_pinned():
    """No inf/NaN and nothing wrong in forward: only the gradients show it, named parameter by parameter, and the
    custom backward is pinned by an fp32 island that brings them back (the doctor before this check called bf16 clean
    on the gallery's custom_backward_precision case)."""
    from ampcourse.doctor import GRAD_TOL

    torch.manual_seed(0)
    model = OffsetLogits(1000.0)
    x, y = torch.randn(64, 16), torch.randint(0, 10, (64,))
    r = examine(model, x, y, loss_fn=_nll)
    per_param = [f for f in r.find("gradient_error", "bf16") if f.module != "logp"]
    assert per_param and all(f.value > GRAD_TOL["bf16"] for f in per_param), r.summary()
    assert {f.module for f in per_param} <= {"stem.weight", "stem.bias", "head.weight", "head.bias"}
    [pinned] = [f for f in r.find("gradient_error", "bf16") if f.module == "logp"]
    assert pinned.severity == "error" and "_LSEFnBackward" in pinned.message and "in fp32 they match" in pinned.message
    assert r.verdicts["bf16"]["status"] == "islands" and r.verdicts["bf16"]["fp32_modules"] == ["logp"]
    assert not r.find("nonfinite") and not r.find("backward_nonfinite", "bf16")


def test_a_healthy_custom_backward_is_not_suspected():
    torch.manual_seed(0)
    model = OffsetLogits(0.0)  # logits near 0: bf16 keeps x - lse to its own precision
    x, y = torch.randint(0, 1, (64, 16)).float() + torch.randn(64, 16), torch.randint(0, 10, (64,))
    r = examine(model, x, y, loss_fn=_nll)
    assert not r.find("gradient_error"), r.summary()
    assert r.is_clean("bf16") and r.is_clean("fp16")


# -- 3. the optimizer step's real outcome -------------------------------------------------------------------------

def test_pure_fp16_adam_step_outcome_is_checked():
    torch.manual_seed(0)
    model = make_model("mlp").half()
    x, y = batch()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-8)
    r = examine(model, x.half(), y, loss_fn=loss_fn, optimizer=opt)
    broken = r.find("optimizer_nonfinite") + r.find("optimizer_blowup")
    assert broken and broken[0].severity == "error" and broken[0].phase == "optimizer", r.summary()
    assert r.optimizer["lost_update_share"] > 0.5 or r.optimizer["nonfinite_after"] > 0
    text = " ".join(r.advice) + " ".join(f.message for f in r.findings)
    assert "raise eps" not in text and "or raise eps" not in text
    assert "fp32 master weights" in text
    assert not any("GradScaler(" in a for a in r.advice)  # GradScaler refuses fp16 parameters
    # eps=1e-7 (just past fp16's smallest subnormal) is not a fix: still a blow-up
    opt7 = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-7)
    r7 = examine(model, x.half(), y, loss_fn=loss_fn, optimizer=opt7)
    assert r7.find("optimizer_blowup") or r7.find("optimizer_nonfinite"), r7.summary()
    assert not r7.is_clean("fp16")


@pytest.mark.parametrize("rounding", ["kahan", "stochastic"])
def test_bf16adamw_is_audited_as_it_is(rounding):
    from ampcourse.optim import BF16AdamW
    torch.manual_seed(0)
    model = make_model("mlp").to(torch.bfloat16)
    x, y = batch()
    opt = BF16AdamW(model.parameters(), lr=1e-5, rounding=rounding)
    r = examine(model, x.bfloat16(), y, loss_fn=loss_fn, optimizer=opt, precisions=("bf16",))
    assert not r.find("lost_updates"), r.summary()
    assert r.optimizer["class"] == "BF16AdamW" and r.optimizer["lost_update_share"] < 0.2
    # the same bf16 weights with plain rounding to nearest do lose the update
    nearest = BF16AdamW(model.parameters(), lr=1e-5, rounding="nearest")
    assert examine(model, x.bfloat16(), y, loss_fn=loss_fn, optimizer=nearest, precisions=("bf16",)).find("lost_updates")


# -- 4. models already in fp16/bf16 -------------------------------------------------------------------------------

class NormModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.norm, self.head = nn.Linear(32, 64), nn.LayerNorm(64), nn.Linear(64, 10)

    def forward(self, x):
        return self.head(self.norm(self.lin(x)))


def test_half_model_with_layernorm_runs_against_an_fp32_copy():
    torch.manual_seed(0)
    model = NormModel().half()
    before = {n: p.clone() for n, p in model.state_dict().items()}
    x, y = batch()
    r = examine(model, x.half(), y, loss_fn=loss_fn)  # default precisions: bf16 autocast on fp16 weights
    assert not r.find("nonfinite", "fp32"), r.summary()  # the fp32 copy is fine
    assert r.find("low_precision_model") and r.find("low_precision_model")[0].precision == "fp16"
    for p, v in r.verdicts.items():
        assert v["status"] in ("clean", "islands", "refused", "unsupported")
        if v["status"] == "unsupported":
            assert v["reason"]
    assert all(torch.equal(before[n], t) for n, t in model.state_dict().items())
    assert model.lin.weight.dtype == torch.float16


def test_float64_model_says_autocast_ran_nothing_low():
    model = make_model("mlp").double()
    x, y = batch()
    r = examine(model, x.double(), y, loss_fn=loss_fn)
    for p in ("fp16", "bf16"):
        assert r.verdicts[p]["status"] == "unsupported" and "float64" in r.verdicts[p]["reason"]
        assert not r.is_clean(p)
        assert r.find("no_low_precision", p)


# -- 5. layer-local gradient underflow ----------------------------------------------------------------------------

class TinyFirstLayer(nn.Module):
    """The first layer sees inputs near 1e-6: its weight gradient (grad_out x input) flushes in fp16 at scale 1."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(32, 256)
        self.rest = nn.Sequential(nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(),
                                  nn.Linear(256, 10))
        with torch.no_grad():
            self.first.weight.mul_(1e4)  # fits fp16 (1e6 overflowed it, and the island then trained it in fp32)

    def forward(self, x):
        return self.rest(self.first(x * 1e-6))


def test_a_layer_losing_its_gradient_is_named_however_small_the_aggregate():
    torch.manual_seed(0)
    model = TinyFirstLayer()
    x, y = batch()
    r = examine(model, x, y, loss_fn=loss_fn, precisions=("fp16",))
    named = {f.module for f in r.find("layer_gradient_underflow", "fp16")}
    assert "first.weight" in named, r.summary()
    assert r.gradients["flush_at_1"] < 0.5  # the aggregate alone would not have warned
    assert all(f.severity == "warning" for f in r.find("layer_gradient_underflow"))


class EmbedModel(nn.Module):
    """An Embedding (its output stays fp32 under autocast) whose gradients are tiny: they arrive through the fp16
    Linear that reads it, whose backward flushes them at scale 1."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(64, 32), nn.Linear(32, 10)

    def forward(self, idx):
        return self.head(self.emb(idx).mean(1))


def test_an_embedding_whose_output_stays_fp32_still_loses_its_gradient_through_the_fp16_op_that_reads_it():
    """Issue 25, class 5: gradient loss is measured in the fp16 backward itself, whatever the module's output dtype."""
    torch.manual_seed(0)
    model = EmbedModel()
    g = torch.Generator().manual_seed(0)
    idx, y = torch.randint(0, 64, (16, 8), generator=g), torch.randint(0, 10, (16,), generator=g)
    small = lambda o, t: F.cross_entropy(o, t) * 2.0**-20  # noqa: E731
    r = examine(model, idx, y, loss_fn=small, precisions=("fp16",), steps=0)
    rows = {m["name"]: m for m in r.modules}
    assert rows["emb"]["dtype"]["fp16"] == "float32"  # its own output stays fp32 ...
    lost = {f.module: f for f in r.find("layer_gradient_underflow")}
    assert {"emb.weight", "head.weight"} <= set(lost), r.summary()  # ... and every parameter over the bar is named
    assert lost["emb.weight"].fix == "scaler" and not r.is_clean("fp16")  # the recommended scale brings it back
    # it is real: one fp16 backward at scale 1, by hand, gives the embedding no gradient at all
    with torch.autocast("cpu", dtype=torch.float16):
        loss = small(model(idx), y)
    loss.backward()
    assert model.emb.weight.grad.abs().max() == 0
    model.zero_grad(set_to_none=True)
    small(model(idx), y).backward()
    assert model.emb.weight.grad.abs().max() > 0


# -- 6. multi-call modules, in-place forwards, determinism ---------------------------------------------------------

class SharedDropout(nn.Module):
    """One dropout called twice (as T5's); the overflow comes from 'up' between the two calls."""

    def __init__(self):
        super().__init__()
        self.drop, self.up, self.head = nn.Dropout(0.1), nn.Linear(32, 64), nn.Linear(64, 10)
        with torch.no_grad():
            self.up.weight.mul_(1e5)

    def forward(self, x):
        return self.head(self.drop(self.up(self.drop(x))))


def test_a_module_called_twice_is_not_blamed_for_what_follows_its_first_call():
    torch.manual_seed(0)
    model = SharedDropout()
    x, y = batch()
    r = examine(model, x, y, loss_fn=loss_fn, precisions=("fp16",))
    bad = r.find("nonfinite", "fp16")
    assert bad and bad[0].module == "up", r.summary()
    assert {m["name"]: m["calls"] for m in r.modules}["drop"] == 2


class InPlace(nn.Module):
    """A forward that edits its input in place and draws Python and NumPy random numbers."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 10)

    def forward(self, x):
        x.mul_(0.5)
        noise = random.random() + float(np.random.rand())
        return self.lin(x) * (1 + 1e-3 * noise)


def test_in_place_forward_leaves_the_batch_and_two_calls_give_the_same_report():
    torch.manual_seed(0)
    model = InPlace()
    x, y = batch()
    x0 = x.clone()
    random.seed(1)
    np.random.seed(1)
    r1 = examine(model, x, y, loss_fn=loss_fn, optimizer=torch.optim.AdamW(model.parameters()))
    assert torch.equal(x, x0)
    r2 = examine(model, x, y, loss_fn=loss_fn, optimizer=torch.optim.AdamW(model.parameters()))
    assert r1.to_dict() == r2.to_dict()
    assert random.random() == random.Random(1).random()  # the caller's Python RNG is where it was


# -- issue 21: a known state, hooks, scripted modules ----------------------------------------------------------------

@pytest.mark.parametrize("context", ["no_grad", "inference_mode", "autocast"])
def test_examine_runs_in_a_known_state_whatever_the_callers(context):
    torch.manual_seed(0)
    model = make_model("mlp")
    x, y = batch()
    plain = examine(model, x, y, loss_fn=loss_fn).to_dict()
    ctx = {"no_grad": torch.no_grad(), "inference_mode": torch.inference_mode(),
           "autocast": torch.autocast("cpu", dtype=torch.bfloat16)}[context]
    with ctx:
        inside = examine(model, x, y, loss_fn=loss_fn).to_dict()
    assert inside == plain
    assert plain["gradients"]["nonzero"] > 0


class ReturnsParam(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(10))

    def forward(self):
        return self.w


class UsesParam(nn.Module):
    def __init__(self):
        super().__init__()
        self.bias, self.lin = ReturnsParam(), nn.Linear(32, 10)

    def forward(self, x):
        return self.lin(x) + self.bias()


def test_no_hook_left_on_a_parameter_a_module_returns():
    model = UsesParam()
    x, y = batch()
    examine(model, x, y, loss_fn=loss_fn)
    assert not model.bias.w._backward_hooks


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_scripted_module_is_one_clear_line():
    model = torch.jit.script(nn.Linear(4, 2))
    with pytest.raises(TypeError, match="ScriptModule.*eager nn.Module"):
        examine(model, torch.randn(3, 4))


def test_healthy_models_stay_clean_with_backward_and_the_op_watch():
    for name in ("mlp", "cnn", "transformer"):
        model = make_model(name)
        x, y = batch(name, 32)
        r = examine(model, x, y, loss_fn=loss_fn, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
        assert r.is_clean("fp16") and r.is_clean("bf16"), r.summary()


# -- calibration and the report a learner reads (issue 20: errata 4-7, learner path 7) ----------------------------------

@pytest.mark.parametrize("fmt, dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_rel_tol_is_calibrated_on_linear_layers(fmt, dtype):
    """REL_TOL's comment states what is measured: an nn.Linear's own error under autocast is 0.2-0.4 eps (eps is the
    spacing at 1; the rounding unit u = eps/2), so REL_TOL = 8 eps is 20-40x a healthy layer's."""
    from ampcourse import formats
    from ampcourse.doctor import REL_TOL
    eps = formats.spec(fmt).eps
    g = torch.Generator().manual_seed(0)
    own = []
    for d in (64, 256):
        lin = nn.Linear(d, d)
        x = torch.randn(128, d, generator=g)
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
            low = lin(x)
        with torch.no_grad():
            ref = lin(x.to(dtype).float())  # the same (rounded) inputs, in fp32: only the layer's own rounding differs
        own.append(float((low.float() - ref).norm() / ref.norm()) / eps)
    assert all(0.1 < e < 0.6 for e in own), own
    assert REL_TOL[fmt] == 8 * eps and REL_TOL[fmt] > 10 * max(own) * eps


def test_the_report_reads_as_sentences_quotes_names_and_names_the_oversized_weight():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 10))
    with torch.no_grad():
        model[0].weight.mul_(3e4)
    x, y = batch()
    r = examine(model, x, y, loss_fn=loss_fn)
    over = r.find("activation_overflow", "fp16")
    assert over and over[0].module == "0"
    msg = over[0].message
    assert msg.startswith("'0' outputs") and "'0.weight'" in msg and "cause" in msg
    text, page = r.summary(), r._repr_html_()
    assert "{'fp16'" not in text and "{'fp16'" not in page  # no Python dicts in the advice
    assert all(isinstance(a, str) and a[0].isupper() and a.rstrip().endswith(".") for a in r.advice)
    assert "'0'" in page or "&#x27;0&#x27;" in page
    # policy_snippet: a reason when there is nothing to apply; both forms of the island when there is
    clean_only = examine(make_model("mlp"), x, y, loss_fn=loss_fn, precisions=("bf16",))
    assert clean_only.policy_snippet().startswith("# no fp32 islands: bf16 ran clean")
    torch.manual_seed(0)
    fixed = examine(WithInlineBlock(), x, y, loss_fn=loss_fn, precisions=("fp16",))
    snippet = fixed.policy_snippet("fp16")
    assert "apply_policy(model, {'block': 'fp32'})" in snippet and "torch.autocast" in snippet
    m2 = WithInlineBlock()
    plain = snippet.split("# or in plain PyTorch")[1].split("\n", 1)[1]
    exec(plain, {"model": m2})
    with torch.autocast("cpu", dtype=torch.float16):
        out = m2(x)
    assert torch.isfinite(out).all()  # the plain-PyTorch island works


def test_no_scaler_advice_for_fp16_parameters():
    torch.manual_seed(0)
    model = make_model("mlp").half()
    x, y = batch()
    r = examine(model, x.half(), y, loss_fn=loss_fn, precisions=("fp16",))
    text = " ".join([f.message for f in r.findings] + r.advice)
    assert "still the safe default" not in text
    assert "GradScaler(" not in " ".join(r.advice)
    assert r.find("low_precision_model")


def test_backward_is_still_told_apart_on_a_torch_without_current_autograd_node(monkeypatch):
    """torch 2.11's floor: if torch._C._current_autograd_node were missing, backward ops keep their phase (the
    module is then unknown) instead of being blamed on the forward."""
    monkeypatch.delattr(torch._C, "_current_autograd_node", raising=False)
    torch.manual_seed(0)
    x, y = batch()
    r = examine(WithFusedNorm(), x, y, loss_fn=loss_fn, precisions=("fp16",))
    bad = r.find("backward_nonfinite", "fp16")
    assert bad and bad[0].phase == "backward" and not r.find("nonfinite", "fp16"), r.summary()
    assert not r.is_clean("fp16")


class HalvesInPlace(nn.Module):
    def forward(self, x):
        return x.mul_(0.5)


def test_a_leaf_that_edits_its_input_in_place_is_not_blamed_by_its_rerun():
    torch.manual_seed(0)
    model = nn.Sequential(HalvesInPlace(), nn.Linear(32, 10))
    x, y = batch()
    r = examine(model, x, y, loss_fn=loss_fn)
    assert not r.find("precision_loss"), r.summary()
    assert r.is_clean("fp16") and r.is_clean("bf16")


# -- a model that raises under autocast where fp32 runs ------------------------------------------------------------

class MaskedAttention(nn.Module):
    """Attention that masks with -1e9 inline: fine in fp32 and bf16, a value fp16 cannot hold (masked_fill raises)."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x, mask):
        scores = (self.q(x) @ self.k(x).transpose(-2, -1)) / 32 ** 0.5
        return self.o(torch.softmax(scores.masked_fill(mask, -1e9), -1) @ self.v(x))


class MaskedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.attn, self.head = nn.Linear(16, 32), MaskedAttention(), nn.Linear(32, 10)

    def forward(self, x):
        mask = torch.zeros(x.shape[0], x.shape[1], x.shape[1], dtype=torch.bool)
        mask[:, :, -1] = True  # the last position is padding
        return self.head(self.attn(self.emb(x), mask)).mean(1)


def test_an_op_that_raises_under_fp16_is_named_and_its_island_lets_the_model_run():
    torch.manual_seed(0)
    model, x, y = MaskedNet(), torch.randn(8, 6, 16), torch.randint(0, 10, (8,))
    with pytest.raises(RuntimeError, match="Half"), torch.autocast("cpu", dtype=torch.float16):
        model(x)  # the planted failure, as a learner meets it
    r = examine(model, x, y, loss_fn=F.cross_entropy)
    [f] = r.find("raises", "fp16")
    assert f.severity == "error" and f.module == "attn" and f.op == "aten::masked_fill", r.summary()
    assert "(inline in forward)" in f.message and "with 'attn' in fp32 it runs" in f.message
    assert "cannot run on this data" not in r.summary()  # fp32 ran on the same data: the data is not the cause
    assert r.verdicts["fp16"]["status"] == "islands" and r.verdicts["fp16"]["fp32_modules"] == ["attn"]
    assert r.is_clean("bf16") and not r.find("raises", "bf16")
    # the advice works: with the island, fp16 autocast runs and matches fp32
    with torch.no_grad():
        ref = float(F.cross_entropy(model(x), y))
    apply_policy(model, {"attn": "fp32"})
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    assert abs(float(F.cross_entropy(out.float(), y)) - ref) / ref < 0.02


class NoHalfKernel(nn.Module):
    """Stands for an op this device or torch build has no fp16 kernel for."""

    def forward(self, x):
        if x.dtype == torch.float16:
            raise RuntimeError('"fancy_op_cpu" not implemented for \'Half\'')
        return x


def test_a_missing_kernel_is_unsupported_not_a_finding_about_the_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), NoHalfKernel(), nn.Linear(32, 10))
    r = examine(model, torch.randn(64, 16), torch.randint(0, 10, (64,)), loss_fn=F.cross_entropy)
    assert r.verdicts["fp16"]["status"] == "unsupported" and "not implemented for 'Half'" in r.verdicts["fp16"]["reason"]
    assert not r.find("raises") and r.is_clean("bf16")


class NoLowPrimitive(nn.Module):
    """Stands for oneDNN's LSTM on a CPU without AVX512: no bf16/fp16 primitive on this processor (a Linear that
    raises what oneDNN raises when its input is fp16/bf16)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, x):
        if x.dtype != torch.float32 or torch.is_autocast_enabled("cpu"):
            raise RuntimeError("could not create a primitive descriptor for the LSTM forward propagation primitive")
        return self.lin(x)


def test_a_kernel_library_without_a_low_precision_kernel_here_is_the_devices_gap_not_the_models_code():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), NoLowPrimitive(), nn.Linear(32, 10))
    r = examine(model, torch.randn(64, 16), torch.randint(0, 10, (64,)), loss_fn=F.cross_entropy, steps=0)
    for p in ("fp16", "bf16"):
        assert r.verdicts[p]["status"] == "islands" and r.verdicts[p]["fp32_modules"] == ["1"], r.summary()
        (f,) = [f for f in r.findings if f.kind == "raises" and f.precision == p]
        # was: an error with advice to make the code fp16-safe ("torch.finfo(t.dtype).min instead of -1e9")
        assert f.severity == "warning" and f.fix == "islands", f
        assert "kernel library has no" in f.message and "-1e9" not in f.message and "not at fault" in f.message


class DtypeCheck(nn.Module):
    def forward(self, x):
        if x.dtype != torch.float32:
            raise TypeError(f"expects float32, got {x.dtype}")
        return x


def test_model_code_that_raises_outside_any_op_is_pinned_on_its_module():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), DtypeCheck(), nn.Linear(32, 10))
    r = examine(model, torch.randn(64, 16), torch.randint(0, 10, (64,)), loss_fn=F.cross_entropy)
    for p in ("fp16", "bf16"):
        [f] = r.find("raises", p)
        assert "expects float32" in f.message and f.severity == "error" and f.op == ""
        assert f.module == "1" and f.message.startswith("'1' raises under")  # the module whose own code raised
        assert r.verdicts[p]["status"] == "islands" and r.verdicts[p]["fp32_modules"] == ["1"]


class CheckedTop(nn.Module):
    """The model's own top-level forward refuses a low-precision activation: no fp32 island can reach it."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 10)

    def forward(self, x):
        h = self.a(x)
        if h.dtype != torch.float32:
            raise TypeError(f"expects float32, got {h.dtype}")
        return self.b(h)


def test_top_level_code_that_raises_is_refused_and_fp32_is_advised():
    torch.manual_seed(0)
    r = examine(CheckedTop(), torch.randn(64, 16), torch.randint(0, 10, (64,)), loss_fn=F.cross_entropy)
    for p in ("fp16", "bf16"):
        assert r.verdicts[p]["status"] == "refused", r.verdicts[p]
        [f] = r.find("raises", p)
        assert f.module == "" and f.message.startswith("The model raises under")
    assert "train in fp32" in r.summary()


# -- an optimizer of the learner's own that keeps its state low, on fp32 weights -----------------------------------

class HalfStateAdam(torch.optim.Optimizer):
    """Adam that keeps its second moment in fp16 "to save memory": g**2 below fp16's subnormals flushes to 0, and
    m / (sqrt(v) + eps) then divides by eps alone."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, state_dtype=torch.float16):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps))
        self.state_dtype = state_dtype

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            b1, b2 = g["betas"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    st["exp_avg"] = torch.zeros_like(p)
                    st["exp_avg_sq"] = torch.zeros_like(p, dtype=self.state_dtype)
                st["step"] += 1
                st["exp_avg"].mul_(b1).add_(p.grad, alpha=1 - b1)
                st["exp_avg_sq"].mul_(b2).add_((p.grad * p.grad).to(self.state_dtype), alpha=1 - b2)
                m = st["exp_avg"] / (1 - b1 ** st["step"])
                v = st["exp_avg_sq"].float() / (1 - b2 ** st["step"])
                p.add_(-g["lr"] * m / (v.sqrt() + g["eps"]))


def _mlp_batch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 10))
    return model, torch.randn(64, 16), torch.randint(0, 10, (64,))


def test_fp32_weights_with_an_optimizer_that_keeps_fp16_state_are_audited():
    model, x, y = _mlp_batch()
    probe = copy.deepcopy(model)
    opt = HalfStateAdam(probe.parameters())
    losses = []
    for _ in range(2):  # the planted failure, as a learner meets it: one step and the loss explodes
        opt.zero_grad()
        loss = F.cross_entropy(probe(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert losses[1] > 100 * losses[0]
    r = examine(model, x, y, loss_fn=F.cross_entropy, optimizer=HalfStateAdam(model.parameters()))
    bad = r.find("optimizer_blowup") + r.find("optimizer_nonfinite")
    # tagged with the dtype measured (the state's), counted against every recipe (phase "optimizer")
    assert bad and bad[0].severity == "error" and bad[0].precision == "fp16" and bad[0].phase == "optimizer", r.summary()
    assert "keeps it in float16" in bad[0].message and "as far as the fp32-master step" not in bad[0].message
    assert not r.is_clean("fp16") and not r.is_clean("bf16")
    assert r.verdicts["bf16"]["status"] == "refused" and r.verdicts["bf16"]["needs"] == ["master_weights"]
    assert "keep the optimizer's state in fp32, then use" in r.headline and "master weights" not in r.headline


def test_an_optimizer_of_ones_own_with_fp32_state_is_stepped_and_stays_quiet():
    model, x, y = _mlp_batch()
    r = examine(model, x, y, loss_fn=F.cross_entropy,
                optimizer=HalfStateAdam(model.parameters(), state_dtype=torch.float32))
    assert r.optimizer["stepped"] and r.optimizer["state_dtypes"] == ["float32"]
    assert not r.find("optimizer_blowup") and not r.find("optimizer_nonfinite") and r.is_clean("bf16")


def test_torch_optimizers_on_fp32_weights_are_not_stepped():
    model, x, y = _mlp_batch()
    r = examine(model, x, y, loss_fn=F.cross_entropy, optimizer=torch.optim.AdamW(model.parameters()))
    assert r.optimizer["stepped"] is False and r.is_clean("bf16")


def test_gradients_off_behind_a_saturated_softmax_name_the_attention_that_holds_them():
    """Llama's eager attention upcasts its softmax, so its forward output stays within tolerance; with q/k weights
    x200 the logits reach the thousands and bf16's rounding of them moves the saturated softmax's gradients: the
    per-parameter check sees it, and the attention module holding q_proj and k_proj is the one named."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=32)
    cfg._attn_implementation = "eager"
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for proj in (model.model.layers[0].self_attn.q_proj, model.model.layers[0].self_attn.k_proj):
            proj.weight.mul_(200)
    g = torch.Generator().manual_seed(1000)
    ids = torch.randint(0, 128, (8, 16), generator=g)
    r = examine(model, {"input_ids": ids, "labels": ids.clone()})
    assert not r.find("precision_loss", "bf16") and not r.find("nonfinite")  # nothing to see in forward
    params = {f.module for f in r.find("gradient_error", "bf16")}
    assert {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"} <= params, r.summary()
    assert "model.layers.0.self_attn" in params and not r.is_clean("bf16")
