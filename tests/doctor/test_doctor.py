"""The AMP doctor finds every planted problem, raises no false alarm on healthy models, and changes nothing."""

import json
import math
import random

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ampcourse import doctor
from ampcourse.doctor import KINDS, Log2Hist, Report, examine
from ampcourse.models import loss_fn, make_model, make_task
from ampcourse.policy import apply_policy, policy_of
from ampcourse.scaling import range_counts, record_gradients
from planted import NaiveRMSNorm  # noqa: E402


def batch(name: str, n: int = 64):
    """A batch of a reference model's synthetic data."""
    x, y = make_task(name, n=n).data.tensors
    return x, y


class WithRMSNorm(nn.Module):
    """A linear layer whose outputs reach a few hundred, a naive RMSNorm, a head."""

    def __init__(self):
        super().__init__()
        self.up, self.norm, self.head = nn.Linear(32, 64), NaiveRMSNorm(64), nn.Linear(64, 10)
        with torch.no_grad():
            self.up.weight.mul_(500)

    def forward(self, x):
        return self.head(F.gelu(self.norm(self.up(x))))


# -- the histogram agrees with range_counts -------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
@pytest.mark.parametrize("scale", [1.0, 2.0**-3, 2.0**10, 2.0**24, 2.0**120])
def test_histogram_counts_match_range_counts(fmt, scale):
    rng = np.random.default_rng(1)
    v = rng.choice([-1.0, 1.0], 20000) * 2.0 ** rng.uniform(-40, 20, 20000)
    v[:50] = 0.0
    v[50:53] = [np.inf, -np.inf, np.nan]
    # values on and beside every rounding threshold, where a coarser histogram would miscount
    edges = [65504.0, 65519.0, 65520.0, 65521.0, 65535.0, 2.0**-25, 2.0**-24, 2.0**-14 - 2.0**-25, 2.0**-14 - 2.0**-24,
             2.0**-14, 2.0**-126 - 2.0**-134, 2.0**-133, 2.0**-134, 3.3961e38]
    v[53:53 + len(edges)] = [e / scale for e in edges]
    t = torch.tensor(v, dtype=torch.float32)
    h = Log2Hist()
    h.add(t[:7000])
    h.add(t[7000:])  # two adds accumulate
    assert h.counts(scale, fmt) == range_counts(t.numpy(), scale, fmt)
    assert h.numel == 20000 and h.zeros == int((t == 0).sum()) and h.nonfinite == int((~torch.isfinite(t)).sum())
    assert h.max == float(t[torch.isfinite(t)].abs().max())
    with pytest.raises(ValueError, match="power of two"):
        h.counts(3.0, fmt)


def test_histogram_of_recorded_gradients_matches_range_counts():
    """The doctor's parameter histograms count what record_gradients + range_counts count (chapter 6's pieces)."""
    model = make_model("transformer")
    x, y = batch("transformer", 16)
    rec = record_gradients(model, x, y, loss_fn, activations=False)
    model.zero_grad(set_to_none=True)
    r = examine(model, x, y, loss_fn=loss_fn, precisions=("fp16",))
    assert r.gradients["nonzero"] >= sum(int((g != 0).sum()) for g in rec.params.values())
    total = Log2Hist()
    for g in rec.params.values():
        total.add(g)
    for s in (1.0, 2.0**16):
        assert total.counts(s) == range_counts(rec.values("params").numpy(), s)


# -- healthy models: no false alarm ---------------------------------------------------------------------------

def expected_choice(r) -> str:
    """The rule for a report whose precisions all ran clean: one with native units on this device first, then the one
    ampcourse.device.pick() chooses, then by name."""
    from ampcourse.device import pick
    default = pick(r.device).precision
    return min(r.verdicts, key=lambda p: (not r.verdicts[p].get("native", False), p != default, p))


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_healthy_reference_models(name):
    model = make_model(name)
    x, y = batch(name, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    r = examine(model, x, y, loss_fn=loss_fn, optimizer=opt)
    assert r.warnings == [], r.summary()
    assert r.kinds() <= {"scaler_needed", "no_scaler_needed"}
    assert {v["status"] for v in r.verdicts.values()} == {"clean"}
    assert r.fp32_modules == []
    # fp16 with the default scaler is fine: it does not overflow here, and leaves almost nothing flushed
    assert r.gradients["default_backoff_steps"] <= 2 and r.gradients["flush_at_default"] < 0.01
    assert math.log2(r.recommended_init_scale).is_integer()
    assert r.recommended_precision == expected_choice(r)
    assert any("CPU autocast" in n for n in r.notes)


# -- planted problems ------------------------------------------------------------------------------------------

def test_activation_overflow_found_and_named():
    model = make_model("mlp")
    with torch.no_grad():
        model.net[2].weight.mul_(1e5)  # net.2's outputs pass 65504 in fp32
    x, y = batch("mlp")
    r = examine(model, x, y, loss_fn=loss_fn)
    over = r.find("activation_overflow", "fp16")
    assert over and over[0].module == "net.2" and over[0].value > 65504
    assert "65504" in over[0].message
    assert not r.find("activation_overflow", "bf16")
    assert r.verdicts["fp16"]["status"] in ("refused", "islands")
    if r.verdicts["fp16"]["status"] == "islands":
        assert "net.2" in r.verdicts["fp16"]["fp32_modules"]
    assert r.verdicts["bf16"]["status"] == "clean"
    assert r.recommended_precision == "bf16"
    assert r.findings[0].severity == "error"  # worst first


def test_naive_rmsnorm_gets_an_fp32_island_for_exactly_that_module():
    torch.manual_seed(0)
    model = WithRMSNorm()
    x, y = batch("mlp")
    r = examine(model, x, y, loss_fn=loss_fn)
    bad = [f for f in r.findings if f.precision == "fp16" and f.kind in ("precision_loss", "nonfinite")]
    assert bad and {f.module for f in bad} == {"norm"}
    assert r.verdicts["fp16"]["status"] == "islands" and r.verdicts["fp16"]["fp32_modules"] == ["norm"]
    assert r.verdicts["bf16"]["status"] == "clean"
    only16 = examine(model, x, y, loss_fn=loss_fn, precisions=("fp16",))
    assert only16.recommended_precision == "fp16" and only16.fp32_modules == ["norm"]
    assert "apply_policy(model, {'norm': 'fp32'})" in only16.policy_snippet()
    # the advice works: with the island the examined loss matches fp32 again
    apply_policy(model, {"norm": "fp32"})
    fixed = examine(model, x, y, loss_fn=loss_fn, precisions=("fp16",))
    assert fixed.warnings == [] and fixed.fp32_modules == []
    assert policy_of(model) == {"norm": "fp32"}  # the caller's policy survives examine()


SMALL = 2.0**-20


def tiny_loss(out, target):
    """Cross entropy scaled down so that most fp16 gradients flush at scale 1."""
    return loss_fn(out, target) * SMALL


def test_scaled_down_loss_underflow_and_recommended_scale_trains():
    from ampcourse.train import train
    model = make_model("mlp")
    x, y = batch("mlp")
    r = examine(model, x, y, loss_fn=tiny_loss, precisions=("fp16",))
    under = r.find("gradient_underflow", "fp16")
    assert under and under[0].value > 0.5  # most gradients flush at scale 1
    assert r.gradients["flush_at_recommended"] < 0.001
    scale = r.recommended_init_scale
    assert scale > 2.0**16 and math.log2(scale).is_integer()
    assert r.gradients["max"] * scale * doctor.GRAD_MARGIN <= 65504
    assert r.find("scaler_needed", "fp16")
    # A real run: SGD (not Adam, which would divide the tiny scale away) on the scaled loss.
    runs = {}
    for label, prec, init in (("fp32", "fp32", None), ("recommended", "fp16", scale), ("scale 1", "fp16", 1.0)):
        h = train("mlp", precision=prec, steps=60, lr=0.5 / SMALL, optimizer="sgd", loss_fn=tiny_loss,
                  progress=False, n_samples=512, batch_size=64,
                  scaler_kwargs=None if init is None else {"init_scale": init})
        runs[label] = h.loss[-1] / SMALL
    start = math.log(10)
    assert runs["fp32"] < 0.5 * start
    assert abs(runs["recommended"] - runs["fp32"]) < 0.05 * runs["fp32"]
    assert runs["scale 1"] > 0.9 * start  # flushed gradients: it barely moves


def test_lost_updates_in_pure_bf16_with_small_lr():
    model = make_model("mlp").to(torch.bfloat16)
    x, y = batch("mlp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    r = examine(model, x.bfloat16(), y, loss_fn=loss_fn, optimizer=opt)
    lost = r.find("lost_updates")
    assert lost and lost[0].precision == "bf16" and lost[0].value > 0.5
    assert lost[0].module in dict(model.named_parameters())
    assert r.optimizer["fp32_master_weights"] is False
    # control: fp32 master weights at the same lr lose nothing
    fp32 = make_model("mlp")
    r32 = examine(fp32, x, y, loss_fn=loss_fn, optimizer=torch.optim.AdamW(fp32.parameters(), lr=1e-5))
    assert not r32.find("lost_updates") and r32.optimizer["fp32_master_weights"] is True


def test_adam_eps_in_fp16_state():
    model = make_model("mlp").half()
    x, y = batch("mlp")
    r = examine(model, x.half(), y, loss_fn=loss_fn, optimizer=torch.optim.Adam(model.parameters(), eps=1e-8))
    eps = r.find("eps_underflow")
    assert eps and eps[0].precision == "fp16" and eps[0].value == 1e-8
    ok = examine(model, x.half(), y, loss_fn=loss_fn, optimizer=torch.optim.Adam(model.parameters(), eps=1e-4))
    assert not ok.find("eps_underflow")


# -- nothing changes -------------------------------------------------------------------------------------------

def _state(model, opt):
    """Everything examine() must leave alone, as bit patterns."""
    return ({n: p.detach().clone() for n, p in model.named_parameters()},
            {n: b.detach().clone() for n, b in model.named_buffers()},
            {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
            {n: m.training for n, m in model.named_modules()},
            {k: (v.clone() if isinstance(v, torch.Tensor) else v) for s in opt.state.values() for k, v in s.items()},
            torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())


def _same(a, b):
    if isinstance(a, torch.Tensor):
        as_bytes = lambda t: t.reshape(-1).view(torch.uint8)  # noqa: E731 (bit for bit, NaN included)
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(as_bytes(a), as_bytes(b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(u, v) for u, v in zip(a, b))
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    return a == b


@pytest.mark.parametrize("name", ["cnn", "transformer"])
def test_model_optimizer_and_rng_unchanged(name):
    model = make_model(name)  # cnn: BatchNorm running stats move in every training-mode forward
    x, y = batch(name, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn(model(x), y).backward()
    opt.step()
    loss_fn(model(x), y).backward()  # leave gradients in .grad
    next(model.children()).eval()  # a mixed training mode
    random.seed(3)
    np.random.seed(3)
    before = _state(model, opt)
    attrs = {n: (sorted(m.__dict__), len(m._forward_hooks), len(m._forward_pre_hooks)) for n, m in model.named_modules()}
    if x.is_floating_point():
        x.requires_grad_(True)  # backward must not reach the caller's tensors
    examine(model, x, y, loss_fn=loss_fn, optimizer=opt)
    after = _state(model, opt)
    for what, a, b in zip(["params", "buffers", "grads", "training", "optimizer", "torch rng", "random", "numpy"],
                          before, after):
        assert _same(a, b), what
    assert attrs == {n: (sorted(m.__dict__), len(m._forward_hooks), len(m._forward_pre_hooks))
                     for n, m in model.named_modules()}  # no hook or attribute left behind
    assert x.grad is None


# -- inputs and outputs of every shape ------------------------------------------------------------------------

class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 4), nn.Linear(8, 4)

    def forward(self, x, z, labels=None):
        out = self.a(x) + self.b(z)
        if labels is None:
            return out
        return type("Out", (), {"loss": F.cross_entropy(out, labels), "logits": out})()


def test_tuple_dict_and_loss_attribute_inputs():
    torch.manual_seed(0)
    m = TwoInputs()
    x, z, labels = torch.randn(16, 8), torch.randn(16, 8), torch.randint(0, 4, (16,))
    r1 = examine(m, (x, z), labels, loss_fn=F.cross_entropy, precisions=("bf16",))
    r2 = examine(m, {"x": x, "z": z, "labels": labels})  # the model's own .loss
    r3 = examine(m, {"x": x, "z": z}, labels, loss_fn=F.cross_entropy)
    for r in (r1, r2, r3):
        assert isinstance(r, Report) and r.warnings == []
    assert r1.verdicts.keys() == {"bf16"} and r1.recommended_precision == "bf16"
    scalar = examine(nn.Sequential(nn.Linear(8, 1), nn.Flatten(0)), torch.randn(1, 8))  # output is the loss
    assert scalar.recommended_precision == expected_choice(scalar)


def test_report_json_html_plot(tmp_path):
    torch.manual_seed(0)
    model = WithRMSNorm()
    x, y = batch("mlp")
    r = examine(model, x, y, loss_fn=loss_fn)
    path = tmp_path / "doctor.json"
    text = r.to_json(str(path))
    data = json.loads(path.read_text())
    assert data == json.loads(text)
    assert data["recommended_precision"] == r.recommended_precision
    assert [f["kind"] for f in data["findings"]] == [f.kind for f in r.findings]
    assert all(f["kind"] in KINDS for f in data["findings"])
    assert {"kind", "module", "precision", "value", "message"} <= set(data["findings"][0])
    page = r._repr_html_()
    assert "precision_loss" in page and "norm" in page and "<table>" in page
    fig = r.plot()
    assert len(fig.axes) == 1 and fig.axes[0].get_yticklabels()
    import matplotlib.pyplot as plt
    plt.close(fig)


# -- bad input ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, err, match", [
    (dict(model="mlp"), TypeError, "model must be"),
    (dict(inputs=[torch.randn(2, 32)]), TypeError, "inputs must be"),
    (dict(loss_fn=None), ValueError, "targets were given"),
    (dict(loss_fn="ce"), TypeError, "loss_fn must be callable"),
    (dict(optimizer="adam"), TypeError, "optimizer must be"),
    (dict(precisions=("fp32",)), ValueError, "fp32 is always run"),
    (dict(precisions=("fp8",)), ValueError, "unknown precision"),
    (dict(precisions=()), ValueError, "non-empty"),
    (dict(device="tpu"), ValueError, "device"),
    (dict(inputs=torch.randn(4, 7)), ValueError, "cannot run on this data"),
    (dict(loss_fn=lambda o, t: o), ValueError, "one-element"),
])
def test_bad_input_is_a_clear_error(kwargs, err, match):
    x, y = batch("mlp", 8)
    args = dict(model=make_model("mlp"), inputs=x, targets=y, loss_fn=loss_fn)
    args.update(kwargs)
    with pytest.raises(err, match=match):
        examine(**args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error when CUDA is missing")
def test_cuda_device_without_cuda():
    x, y = batch("mlp", 8)
    with pytest.raises(ValueError, match="CUDA is not available"):
        examine(make_model("mlp"), x, y, loss_fn=loss_fn, device="cuda")


def test_nan_in_fp32_is_blamed_on_fp32_not_on_autocast():
    model = make_model("mlp")
    with torch.no_grad():
        model.net[0].weight[0, 0] = float("inf")
    x, y = batch("mlp")
    r = examine(model, x, y, loss_fn=loss_fn)
    bad = r.find("nonfinite")
    assert [(f.precision, f.module) for f in bad] == [("fp32", "net.0")]
    assert "fix the model or its data first" in r.advice[0]


def test_islands_over_most_of_the_model_refuse_fp16():
    model = make_model("mlp")
    with torch.no_grad():
        model.net[0].weight.mul_(1e30)  # every layer after it overflows fp16: fp32 islands everywhere is just fp32
    x, y = batch("mlp")
    r = examine(model, x, y, loss_fn=loss_fn)
    assert r.verdicts["fp16"]["status"] == "refused" and r.verdicts["fp16"]["fp32_modules"] == []
    assert r.recommended_precision == "bf16" and r.find("gradient_overflow", "fp16")
    assert r.find("scaler_needed", "fp16")  # gradients above 65504 need a scale below 1


def test_gradient_details_per_parameter_and_module():
    model = make_model("mlp")
    x, y = batch("mlp")
    r = examine(model, x, y, loss_fn=tiny_loss, precisions=("fp16",))
    params = r.gradients["params"]
    assert set(params) == {n for n, _ in model.named_parameters()}
    assert all(p["flush_at_recommended"] <= p["flush_at_1"] for p in params.values())
    assert max(p["max"] for p in params.values()) <= r.gradients["max"]
    leaves = [m for m in r.modules if m["leaf"]]
    assert all(m["grad_fp16_underflow_at_recommended"] <= m["grad_fp16_underflow"] for m in leaves)
    assert r.gradients["largest_scale_without_overflow"] >= r.recommended_init_scale * doctor.GRAD_MARGIN / 2


# -- batched counting counts what was there when each tensor was seen -----------------------------------------

class AddsInPlace(nn.Module):
    """A linear layer whose output the parent then changes in place (as a residual block's += does)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x):
        h = self.lin(x)
        h += 1000.0  # after lin's forward hook ran: lin's histogram must not see it
        return h


def test_outputs_changed_in_place_later_are_counted_as_they_were():
    model = AddsInPlace()
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    r = examine(model, x, precisions=("bf16",), loss_fn=lambda out: out.float().mean())
    row = next(m for m in r.modules if m["name"] == "lin")
    alone = Log2Hist()
    with torch.no_grad():
        alone.add(model.lin(x))
    assert alone.min < 1.0 and row["act_min"] == alone.min and row["act_max"] == alone.max


def test_batched_counter_matches_one_histogram_per_tensor():
    """Tensors queued together (one with fp32 subnormals, one capped, one empty) count as each one alone would."""
    g = torch.Generator().manual_seed(3)
    tensors = [torch.randn(5000, generator=g) * 2.0 ** -130, torch.randn(300000, generator=g),
               torch.randn(0), torch.randn(70, generator=g).half(), torch.tensor([0.0, math.inf, -2.0**-149, 65520.0]),
               torch.tensor([-0.0, -0.0])]
    counter = doctor._Counter()
    together = [Log2Hist() for _ in tensors]
    for t, h in zip(tensors, together):
        counter.add(t, [h], doctor.COUNT_CAP)
    counter.flush()
    for t, h in zip(tensors, together):
        alone = Log2Hist()
        alone.add(t, doctor.COUNT_CAP)
        assert h.to_dict() == alone.to_dict() and h.counts(2.0**16) == alone.counts(2.0**16)
        finite = t[torch.isfinite(t)].float()
        assert math.copysign(1.0, h.max) == 1.0 and h.max == (float(finite.abs().max()) if finite.numel() else 0.0)
        if t.numel() <= doctor.COUNT_CAP:
            assert h.counts(1.0, "fp16") == range_counts(t.float().numpy(), 1.0, "fp16")


def test_value_selecting_modules_report_the_error_a_rerun_measures():
    """Identity, ReLU, MaxPool, Flatten are not rerun in fp32: what they report is what a rerun would measure."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Identity(), nn.Flatten(), nn.Linear(36, 2))
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    r = examine(model, x, torch.tensor([0, 1, 0, 1]), loss_fn=F.cross_entropy, precisions=("bf16",))
    rows = {m["name"]: m for m in r.modules}
    checked = 0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        h = x
        for i, m in enumerate(model):
            out = m(h)
            if type(m) in doctor._EXACT:
                with torch.autocast("cpu", enabled=False):
                    ref = m(h.detach().float())
                assert rows[str(i)]["local_error"]["bf16"] == doctor._rel_error(out, ref) == 0.0
                checked += 1
            h = out
    assert checked == 4


# -- the forensic pass's shortcuts measure what the long way measures (issue 25's cost) --------------------------

def _fp16_context(model, x, y):
    """A Context with the fp32 reference run, as examine() builds it."""
    from ampcourse.doctor import passes, snapshot
    snap = snapshot.Snapshot.take(model, None)
    ctx = passes.Context(model, model, x, y, F.cross_entropy, torch.device("cpu"), snap)
    ctx.ref_loss = passes.reference_pass(ctx)
    return ctx, snap


def test_backward_at_scale_1_off_the_verdict_pass_equals_a_separate_gradient_pass():
    """The fp16 pass's extra unwatched backward at scale 1 (same forward graph) gives what a second, plain forward +
    backward at scale 1 gives, parameter by parameter, and the scaled backward's figures are unchanged by it."""
    from ampcourse.device import pick
    from ampcourse.doctor import passes
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Dropout(0.1), nn.GELU(), nn.Linear(64, 4))
    x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
    ctx, snap = _fp16_context(model, x, y)
    amp = pick(torch.device("cpu"), "fp16")
    try:
        with_1 = passes.autocast_pass(ctx, amp, scale=2.0**10, at_1=True)
        alone = passes.autocast_pass(ctx, amp, scale=2.0**10)
        at_1 = passes.gradient_pass(ctx, amp, [], 1.0)
    finally:
        snap.restore(model)
    assert with_1.grads_at_1 is not None and alone.grads_at_1 is None
    assert with_1.grads_at_1 == at_1
    assert with_1.grads == alone.grads


def test_compare_grads_batched_matches_the_per_parameter_definition():
    """error, flushed share, inf/NaN count and live count, batched over parameters, as defined one by one."""
    from ampcourse.doctor import passes
    ctx, _ = _fp16_context(nn.Linear(4, 3), torch.randn(8, 4), torch.randint(0, 3, (8,)))
    ref = {"a": torch.tensor([1.0, -2.0, 0.0, 3e-8]), "b": torch.tensor([0.5, 0.25]), "c": torch.tensor([1.0, 2.0])}
    got = {"a": torch.tensor([1.0, 0.0, 0.0, 0.0]), "b": torch.tensor([0.5, 0.25]),
           "c": torch.tensor([math.inf, 2.0])}
    ctx.ref_grads = dict(ref)
    params = []
    for n, g in got.items():
        p = nn.Parameter(torch.zeros_like(g))
        p.grad = g * 4.0  # the backward ran at scale 4
        params.append((n, p))
    out = passes._compare_grads(ctx, params, 4.0)
    for n in ref:
        r, g = ref[n].double(), got[n].double()
        live = int((r != 0).sum())
        assert out[n]["live"] == live
        assert out[n]["flushed"] == int(((r != 0) & (g == 0)).sum()) / live
        assert out[n]["nonfinite"] == int((~torch.isfinite(g)).sum())
        want = math.inf if out[n]["nonfinite"] else float((g - r).norm() / r.norm())
        assert out[n]["error"] == pytest.approx(want, rel=1e-6)
    assert passes._compare_grads(ctx, params, 4.0) == out  # the cached fp32 side gives the same the second time


def test_rel_error_in_float32_agrees_with_float64_and_falls_back_past_float32s_range():
    from ampcourse.doctor.calls import rel_error
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(5000, generator=g)
    got = (ref + 1e-3 * torch.randn(5000, generator=g)).half()
    want = float((got.double() - ref.double()).norm() / ref.double().norm())
    assert rel_error(got, ref) == pytest.approx(want, rel=1e-5)
    big = torch.full((4,), 1e25)  # squares pass float32's range: the float64 norms answer
    assert rel_error(big * (1 + 1e-3), big) == pytest.approx(1e-3, rel=1e-4)
    assert rel_error(torch.tensor([math.inf, 1.0]), torch.tensor([1.0, 1.0])) == math.inf


def test_uninitialised_memory_is_not_an_inf_nan_a_pass_has_seen():
    """An empty_like whose garbage bits read as NaN (dropout allocates its mask so) does not make the watcher count
    every later module output as possibly inf/NaN; a real inf does, and is an origin."""
    from ampcourse.doctor import watch as watch_module

    class GarbageEmptyLike:  # aten::empty_like whose memory happens to hold NaN bit patterns
        _schema = torch.ops.aten.empty_like.default._schema

        def __call__(self, t):
            return torch.full_like(t, math.nan)

    tracker = watch_module.Tracker(nn.Identity(), {}, [], "fp16", torch.device("cpu"))
    watch = watch_module.OpWatch(tracker)
    out = watch.__torch_dispatch__(GarbageEmptyLike(), (), (torch.zeros(4),))
    assert out.isnan().all() and not watch.seen_nonfinite and not watch.origins
    with watch:
        torch.ones(3) / torch.zeros(3)
    assert watch.seen_nonfinite and watch.origins[0].op == "aten::div"


@pytest.mark.parametrize("policy", [None, "cuda"])
def test_the_default_scale_and_the_recommended_one_give_one_share_when_they_are_equal(policy):
    # When GradScaler's default is the recommended scale, the fp16 backward ran at it: one measured share for both.
    # (The default's was the fp32 histograms' prediction, over module outputs' gradients too: the transformer under
    # CUDA's lists read "the default 2**16 ... leaves 0.07% flushed; init_scale=2**16 leaves 0.000% flushed".)
    task = make_task("transformer", n=16, seed=0)
    x, y = task.data.tensors
    r = examine(task.model, x, y, loss_fn=task.loss_fn, precisions=("fp16",), steps=0, policy=policy,
                optimizer=torch.optim.AdamW(task.model.parameters(), lr=1e-3))
    g = r.gradients
    assert g["recommended_scale"] == 2.0**16 and g["default_backoff_steps"] == 0, g
    assert g["flush_at_default"] == g["flush_at_recommended"], g
    (f,) = [f for f in r.findings if f.kind in ("scaler_needed", "no_scaler_needed")]
    assert "init_scale=2**16 leaves" not in f.message and f.message.count("flushed") <= 1, f.message


def test_the_default_scales_share_says_it_is_predicted_when_no_backward_ran_there():
    # A tiny loss: the recommended scale is far above the default, so the fp16 backwards ran at 1 and at the
    # recommended scale only; the default's share comes from the fp32 histograms and is labelled so.
    task = make_task("mlp", n=32, seed=0)
    x, y = task.data.tensors
    r = examine(task.model, x, y, loss_fn=lambda out, t: task.loss_fn(out, t) * 2.0**-20, precisions=("fp16",),
                steps=0)
    g = r.gradients
    assert g["recommended_scale"] > 2.0**16 and "flush_at_default_predicted" not in g, g
    (f,) = [f for f in r.findings if f.kind == "scaler_needed"]
    assert f"leaves {g['flush_at_default']:.2%} (predicted from the fp32 gradients) flushed" in f.message, f.message
    # fp16 is refused as it is and recommended with its GradScaler (rank 1): the advice says so, and names no master
    # weights (the weights are fp32; it read "GradScaler(...) on the fp32 master weights" for any rank-1 verdict)
    assert r.recommended_precision == "fp16" and r.verdicts["fp16"].needs == ["scaler"]
    text = " ".join(r.advice)
    assert f"2**16 ({g['flush_at_default']:.2%} flushed, predicted from the fp32 gradients" in text, text
    assert "master weights" not in text and "once a GradScaler scales the loss by 2**" in text, text
