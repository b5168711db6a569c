"""ampcourse.scaling: LossScaler is torch.amp.GradScaler, bit for bit; simulate_scale is its trajectory."""

import copy
import math
import random
import warnings

import numpy as np
import pytest
import torch

from ampcourse import formats
from ampcourse._scaler import check_args as check_scaler_args  # GradScaler's settings: their one owner
from ampcourse.models import make_task
from ampcourse.scaling import (EXACT_NOISE, LossScaler, RangeCounter, range_counts, record_gradients,
                               simulate_scale, simulate_training, zone_thresholds, _unscale_and_check_,
                               _update_scale_)

N_SEQUENCES = 200


# -- helpers: drive GradScaler and LossScaler through the same script -------------------------------

def _random_config(rng: random.Random) -> dict:
    """Scaler settings, including the extremes and factors that are not powers of two."""
    return {
        "init_scale": rng.choice([2.0**16, 2.0**-24, 2.0**40, 1000.0, 2.0 ** rng.uniform(-24, 40)]),
        "growth_factor": rng.choice([2.0, 2.0, rng.uniform(1.01, 4.0)]),
        "backoff_factor": rng.choice([0.5, 0.5, rng.uniform(0.01, 0.99)]),
        "growth_interval": rng.choice([1, 2, 3, 5, 2000]),
    }


class _Run:
    """One model, its optimizer(s) and a scaler, plus everything observed along the way."""

    def __init__(self, scaler, model, optimizers):
        self.scaler, self.model, self.optimizers = scaler, model, optimizers
        self.steps_taken = 0
        for opt in optimizers:
            opt.register_step_post_hook(self._count)
        self.trace = []

    def _count(self, *_):
        self.steps_taken += 1

    def observe(self, what):
        """Record a value for the comparison at the end (tensors are cloned)."""
        self.trace.append(what.detach().clone() if isinstance(what, torch.Tensor) else what)


def _make_runs(rng: random.Random, seed: int, param_dtype: torch.dtype) -> tuple[_Run, _Run, dict]:
    """Two identical models and optimizers, one driven by GradScaler, one by LossScaler."""
    cfg = _random_config(rng)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3)).to(param_dtype)
    kind = rng.choice(["sgd", "momentum", "adam", "fused_adam", "two"])

    def optimizers(m):
        params = list(m.parameters())
        if kind == "sgd":
            return [torch.optim.SGD(params, lr=0.1)]
        if kind == "momentum":
            return [torch.optim.SGD(params, lr=0.05, momentum=0.9)]
        if kind == "adam":
            return [torch.optim.Adam(params, lr=0.01)]
        if kind == "fused_adam":
            return [torch.optim.Adam(params, lr=0.01, fused=True)]
        return [torch.optim.SGD(params[:2], lr=0.1), torch.optim.Adam(params[2:], lr=0.01)]

    if kind == "fused_adam" and param_dtype == torch.float64:
        kind = "adam"
    m_ref, m_ours = model, copy.deepcopy(model)
    ref = _Run(torch.amp.GradScaler("cpu", **cfg), m_ref, optimizers(m_ref))
    ours = _Run(LossScaler("cpu", **cfg), m_ours, optimizers(m_ours))
    return ref, ours, cfg | {"optimizer": kind}


def _script(rng: random.Random, n_steps: int) -> list[dict]:
    """A random sequence of iterations: clean or overflowing, with optional extras."""
    steps = []
    for _ in range(n_steps):
        steps.append({
            "poison": rng.choices([None, "inf", "nan", "huge", "fp16_autocast_big"], [6, 1, 1, 1, 1])[0],
            "micro": rng.choice([1, 1, 1, 2]),  # gradient accumulation
            "unscale_and_clip": rng.random() < 0.3,
            "list_of_losses": rng.random() < 0.15,
            "new_scale": rng.choice([None] * 12 + [2.0**10, 3.0, 2.0**-20]),
            "reload": rng.random() < 0.1,  # save and reload the scaler state mid-run
            "input_seed": rng.randrange(2**31),
        })
    return steps


def _loss(run: _Run, step: dict, micro: int):
    """The loss of one micro-batch, poisoned as the script says."""
    gen = torch.Generator().manual_seed(step["input_seed"] + micro)
    dtype = next(run.model.parameters()).dtype
    x = torch.randn(5, 8, generator=gen).to(dtype)
    y = torch.randn(5, 3, generator=gen).to(dtype)
    if step["poison"] == "fp16_autocast_big":
        with torch.autocast("cpu", dtype=torch.float16):
            out = run.model(x * 3e4)  # the fp16 matmul overflows for most scales
        return ((out.float() - y) ** 2).mean()
    loss = ((run.model(x) - y) ** 2).mean()
    if step["poison"] == "inf":
        loss = loss * float("inf")
    elif step["poison"] == "nan":
        loss = loss * float("nan")
    elif step["poison"] == "huge":
        loss = loss * 1e30  # finite in fp32, but scaled gradients overflow for large scales
    return loss


def _iterate(run: _Run, step: dict) -> None:
    """One training iteration under the scaler, observing grads, params, scale and counters."""
    sc = run.scaler
    for opt in run.optimizers:
        opt.zero_grad(set_to_none=True)
    for micro in range(step["micro"]):
        loss = _loss(run, step, micro)
        if step["list_of_losses"]:
            a, b = sc.scale([loss * 0.5, (loss * 0.5,)])
            (a + b[0]).backward()
        else:
            sc.scale(loss).backward()
    if step["unscale_and_clip"]:
        for opt in run.optimizers:
            sc.unscale_(opt)
        run.observe(torch.nn.utils.clip_grad_norm_(run.model.parameters(), 1.0))
    for p in run.model.parameters():
        if p.grad is not None:
            run.observe(p.grad)
    for opt in run.optimizers:
        sc.step(opt)
    if step["new_scale"] is not None:
        sc.update(step["new_scale"])
    else:
        sc.update()
    run.observe(run.steps_taken)
    run.observe(sc.get_scale())
    run.observe(sc.state_dict()["_growth_tracker"])
    for p in run.model.parameters():
        run.observe(p)


def _reload(run: _Run, make) -> None:
    """Replace the scaler by a fresh one loaded from its state dict (checkpoint and resume)."""
    fresh = make()
    fresh.load_state_dict(run.scaler.state_dict())
    run.scaler = fresh


def _same(a, b) -> bool:
    """Bitwise equality for tensors (NaNs included), plain equality otherwise."""
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
            a.view(-1).view(torch.uint8) if a.numel() else a, b.view(-1).view(torch.uint8) if b.numel() else b)
    return a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b))


# -- the equivalence --------------------------------------------------------------------------------

@pytest.mark.parametrize("block", range(4))
def test_loss_scaler_matches_grad_scaler_on_random_sequences(block):
    """200 random runs (50 per block): every gradient, parameter, scale, counter and skip is identical."""
    skipped_total = 0
    for seed in range(block * N_SEQUENCES // 4, (block + 1) * N_SEQUENCES // 4):
        rng = random.Random(seed)
        param_dtype = rng.choice([torch.float32] * 6 + [torch.float64, torch.bfloat16])
        ref, ours, cfg = _make_runs(rng, seed, param_dtype)
        for i, step in enumerate(_script(rng, rng.randint(10, 40))):
            if step["reload"]:
                _reload(ref, lambda: torch.amp.GradScaler("cpu", **{k: cfg[k] for k in cfg if k != "optimizer"}))
                _reload(ours, lambda: LossScaler("cpu", **{k: cfg[k] for k in cfg if k != "optimizer"}))
            before = ours.steps_taken
            _iterate(ref, step)
            _iterate(ours, step)
            assert len(ref.trace) == len(ours.trace)
            for k, (a, b) in enumerate(zip(ref.trace, ours.trace)):
                assert _same(a, b), f"seed {seed} ({cfg}, {param_dtype}), step {i}: observation {k} differs: {a!r} vs {b!r}"
            skipped_total += ours.steps_taken - before < len(ours.optimizers) and cfg["optimizer"] != "fused_adam"
            ref.trace.clear()
            ours.trace.clear()
    assert skipped_total > 20, "the random sequences must contain skipped steps"


def test_fp16_parameters_are_refused_like_grad_scaler():
    """Pure fp16 parameters: both scalers refuse to unscale fp16 gradients with a ValueError."""
    for scaler in (torch.amp.GradScaler("cpu"), LossScaler("cpu")):
        model = torch.nn.Linear(4, 2).half()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler.scale(model(torch.randn(3, 4).half()).float().sum()).backward()
        with pytest.raises(ValueError, match="FP16"):
            scaler.step(opt)


def test_fp16_gradients_with_a_fused_optimizer_match():
    """The fused path checks fp16 gradients without unscaling them (the optimizer divides)."""
    results = []
    for scaler in (torch.amp.GradScaler("cpu", init_scale=2.0**10), LossScaler("cpu", init_scale=2.0**10)):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2).half()
        opt = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
        trace = []
        for poison in [1.0, float("inf"), 1.0, 1.0]:
            opt.zero_grad()
            scaler.scale((model(torch.randn(3, 4).half()).float() * poison).sum()).backward()
            scaler.step(opt)
            scaler.update()
            trace += [scaler.get_scale(), model.weight.detach().clone()]
        results.append(trace)
    assert all(_same(a, b) for a, b in zip(*results))


def test_unscale_kernel_matches_torch_for_every_dtype():
    """_unscale_and_check_ == torch._amp_foreach_non_finite_check_and_unscale_ bit for bit."""
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        for trial in range(50):
            mags = 10 ** (torch.rand(500, generator=gen) * 12 - 8)
            g = (torch.randn(500, generator=gen) * mags).to(dtype)
            if trial % 5 == 0:
                g[trial] = [float("inf"), float("nan"), -float("inf")][trial % 3]
            inv = torch.tensor(1.0 / float(torch.rand((), generator=gen) * 1e4 + 0.5), dtype=torch.float32)
            ref, ours = g.clone(), g.clone()
            f_ref, f_ours = torch.zeros(()), torch.zeros(())
            torch._amp_foreach_non_finite_check_and_unscale_([ref], f_ref, inv)
            _unscale_and_check_([ours], inv, f_ours)
            assert _same(ref, ours) and f_ref.item() == f_ours.item(), (dtype, trial)


def test_update_rule_matches_torch_kernel():
    """_update_scale_ == torch._amp_update_scale_ on random scales, factors and counters."""
    rng = random.Random(1)
    for _ in range(3000):
        s = float(np.float32(2.0 ** rng.uniform(-149, 128)))
        gf, bf, gi = rng.uniform(1.0001, 8.0), rng.uniform(1e-6, 0.9999), rng.randint(1, 4)
        tracker, found = rng.randint(0, gi - 1), float(rng.random() < 0.4)
        a = (torch.tensor(s), torch.tensor(tracker, dtype=torch.int32))
        b = (torch.tensor(s), torch.tensor(tracker, dtype=torch.int32))
        torch._amp_update_scale_(a[0], a[1], torch.tensor(found), gf, bf, gi)
        _update_scale_(b[0], b[1], torch.tensor(found), gf, bf, gi)
        assert a[0].item() == b[0].item() and a[1].item() == b[1].item(), (s, gf, bf, gi, tracker, found)


# -- simulate_scale ---------------------------------------------------------------------------------

def _grad_scaler_trajectory(overflows, **cfg) -> list[float]:
    """Drive a real GradScaler with a one-parameter model: inf gradient where overflows[i]."""
    scaler = torch.amp.GradScaler("cpu", **cfg)
    p = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([p], lr=0.0)
    out = []
    for bad in overflows:
        opt.zero_grad()
        scaler.scale((p * (float("inf") if bad else 1e-3)).sum()).backward()
        scaler.step(opt)
        scaler.update()
        out.append(scaler.get_scale())
    return out


@pytest.mark.parametrize("seed", range(40))
def test_simulate_scale_matches_grad_scaler(seed):
    rng = random.Random(seed)
    cfg = _random_config(rng)
    p = rng.choice([0.0, 0.01, 0.2, 0.7, 1.0])
    overflows = [rng.random() < p for _ in range(rng.randint(1, 120))]
    assert simulate_scale(overflows, **cfg) == _grad_scaler_trajectory(overflows, **cfg)


def test_simulate_scale_extremes():
    # growth stops below float32's maximum instead of reaching inf
    top = simulate_scale([False] * 200, init_scale=2.0**120, growth_interval=1)
    assert top[-1] == 2.0**127 and math.isfinite(top[-1])
    assert top == _grad_scaler_trajectory([False] * 200, init_scale=2.0**120, growth_interval=1)
    # repeated overflows drive the scale down through the float32 subnormals to exactly 0
    bottom = simulate_scale([True] * 200, init_scale=2.0**-24)
    assert bottom[-1] == 0.0 and bottom == _grad_scaler_trajectory([True] * 200, init_scale=2.0**-24)
    assert simulate_scale([]) == []


def test_growth_tracker_resets_on_overflow():
    # 3 clean steps, an overflow, then it needs 4 fresh clean steps to grow
    s = simulate_scale([False, False, False, True, False, False, False, False], init_scale=8.0, growth_interval=4)
    assert s == [8.0, 8.0, 8.0, 4.0, 4.0, 4.0, 4.0, 8.0]


# -- the API around it ------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    ({"growth_factor": 1.0}, "growth_factor"), ({"growth_factor": 0.5}, "growth_factor"),
    ({"growth_factor": float("inf")}, "growth_factor"), ({"backoff_factor": 1.0}, "backoff_factor"),
    ({"backoff_factor": 0.0}, "backoff_factor"), ({"backoff_factor": -0.5}, "backoff_factor"),
    ({"growth_interval": 0}, "growth_interval"), ({"growth_interval": 2.5}, "growth_interval"),
    ({"growth_interval": True}, "growth_interval"), ({"init_scale": 0.0}, "init_scale"),
    ({"init_scale": -1.0}, "init_scale"), ({"init_scale": float("inf")}, "init_scale"),
    ({"init_scale": float("nan")}, "init_scale"), ({"init_scale": 1e39}, "init_scale"),
    ({"init_scale": "65536"}, "init_scale"),
])
def test_bad_arguments_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LossScaler("cpu", **kwargs)
    full = {"init_scale": 2.0**16, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000} | kwargs
    with pytest.raises(ValueError, match=match):
        simulate_scale([True], **full)
    with pytest.raises(ValueError, match=match):
        check_scaler_args(**full)


def _one_step_setup(scaler):
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.ones(2, 3)).sum()).backward()
    return model, opt


def test_misuse_raises_runtime_error_like_grad_scaler():
    for make in (lambda: torch.amp.GradScaler("cpu"), lambda: LossScaler("cpu")):
        scaler = make()
        model, opt = _one_step_setup(scaler)
        scaler.unscale_(opt)
        with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called"):
            scaler.unscale_(opt)
        scaler.step(opt)
        with pytest.raises(RuntimeError, match="step\\(\\) has already been called"):
            scaler.step(opt)
        with pytest.raises(RuntimeError, match="after step"):
            scaler.unscale_(opt)
        with pytest.raises(RuntimeError, match="[Cc]losure"):
            scaler.step(opt, closure=lambda: 0.0)
        scaler.update()
    with pytest.raises(RuntimeError, match="scale\\(loss\\)"):
        LossScaler("cpu").step(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))]))


def test_step_after_inf_skips_the_optimizer_and_backs_off():
    scaler = LossScaler("cpu", init_scale=1024.0)
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler.scale((p * float("inf")).sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert p.tolist() == [1.0, 1.0] and scaler.get_scale() == 512.0 and scaler.growth_tracker == 0


def test_update_with_new_scale():
    for make in (lambda: torch.amp.GradScaler("cpu", growth_interval=3), lambda: LossScaler("cpu", growth_interval=3)):
        scaler = make()
        _, opt = _one_step_setup(scaler)
        scaler.step(opt)
        scaler.update(123.5)
        assert scaler.get_scale() == 123.5 and scaler.state_dict()["_growth_tracker"] == 0
        _, opt = _one_step_setup(scaler)
        scaler.step(opt)
        scaler.update(torch.tensor(7.0))
        assert scaler.get_scale() == 7.0
    with pytest.raises(ValueError):
        _bad_new_scale()


def _bad_new_scale():
    scaler = LossScaler("cpu")
    _, opt = _one_step_setup(scaler)
    scaler.step(opt)
    scaler.update("big")


def test_state_dict_round_trips_between_both_scalers():
    ours = LossScaler("cpu", init_scale=3.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=7)
    _, opt = _one_step_setup(ours)
    ours.step(opt)
    ours.update()
    sd = ours.state_dict()
    ref = torch.amp.GradScaler("cpu")
    ref.load_state_dict(sd)
    assert ref.state_dict() == sd == {"scale": 3.0, "growth_factor": 3.0, "backoff_factor": 0.25,
                                      "growth_interval": 7, "_growth_tracker": 1}
    back = LossScaler("cpu")
    back.load_state_dict(ref.state_dict())
    assert back.state_dict() == sd
    with pytest.raises(RuntimeError, match="empty"):
        LossScaler("cpu").load_state_dict({})


def test_disabled_scaler_passes_through():
    scaler = LossScaler("cpu", enabled=False)
    model, opt = _one_step_setup(scaler)
    loss = torch.tensor(2.0)
    assert scaler.scale(loss) is loss and scaler.get_scale() == 1.0 and scaler.state_dict() == {}
    w = model.weight.detach().clone()
    scaler.step(opt)
    assert not torch.equal(w, model.weight) and not scaler.is_enabled()
    assert "enabled=False" in repr(scaler)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only fallback")
def test_cuda_scaler_without_cuda_warns_and_disables():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scaler = LossScaler("cuda")
    assert not scaler.is_enabled() and any("CUDA is not available" in str(w.message) for w in caught)
    with pytest.raises(ValueError, match="unknown device"):
        LossScaler("tpu9")


# -- range_counts and record_gradients --------------------------------------------------------------

def test_range_counts_against_torch_casts():
    """Every category agrees with what torch's fp16/bf16 casts do to float32 values."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(20000, generator=gen) * 2.0 ** (torch.rand(20000, generator=gen) * 80 - 50)).float()
    x[:3] = torch.tensor([0.0, float("inf"), float("nan")])
    for fmt, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        for k in (-24, -3, 0, 7, 16, 40):
            c = range_counts(x, 2.0**k, fmt)
            scaled = x.double() * 2.0**k
            y = scaled.float().to(dtype).double()  # scaled by a power of two: exact in float32 here
            finite_in = torch.isfinite(x)
            assert c["zero"] == int((x == 0).sum())
            assert c["overflow"] == int((~finite_in | torch.isinf(y)).sum())
            assert c["underflow"] == int((finite_in & (x != 0) & (y == 0)).sum())
            tiny = formats.spec(fmt).min_normal
            assert c["subnormal"] == int(((y != 0) & (y.abs() < tiny)).sum())
            assert sum(c.values()) == x.numel()


def test_range_counts_boundaries_and_saturating_fp8():
    f16 = formats.spec("fp16")
    c = range_counts([f16.max, 65519.0, 65520.0, f16.min_subnormal / 2, f16.min_subnormal * 0.51,
                      f16.min_normal - f16.min_subnormal / 2, f16.min_normal - f16.min_subnormal * 0.6])
    assert c == {"overflow": 1, "fine": 3, "subnormal": 2, "underflow": 1, "zero": 0}
    assert range_counts([500.0, 448.0], fmt="fp8_e4m3")["overflow"] == 1  # e4m3 saturates: 500 is clipped
    with pytest.raises(ValueError, match="scale"):
        range_counts([1.0], scale=0.0)


def test_record_gradients_matches_autograd():
    task = make_task("mlp", n=64)
    x, y = task.data[:32]
    rec = record_gradients(task.model, x, y, task.loss_fn)
    assert set(rec.params) == {n for n, _ in task.model.named_parameters()}
    assert {"net.0", "net.1", "net.4"} <= set(rec.activations)
    assert rec.activations["net.4"].numel() == 32 * 10 and math.isfinite(rec.loss)
    w = task.model.net[0].weight
    task.model.zero_grad()
    task.loss_fn(task.model(x), y).backward()
    assert torch.equal(rec.params["net.0.weight"], w.grad.flatten())
    assert rec.values().numel() == rec.values("params").numel() + rec.values("activations").numel()
    assert not task.model.net[0]._forward_hooks  # hooks removed
    with pytest.raises(ValueError):
        rec.values("weights")


def test_range_counter_equals_range_counts():
    """The binary-search counter agrees with the definition, on boundaries and at extreme scales."""
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(5000, generator=gen).double() * 2.0 ** (torch.rand(5000, generator=gen).double() * 100 - 70))
    edges = []
    for fmt in formats.names():
        edges += [t * m for t in zone_thresholds(fmt) for m in (1.0, 1 + 2**-40, 1 - 2**-40)]
    x = torch.cat([x, torch.tensor(edges, dtype=torch.float64), torch.tensor([0.0, 0.0, float("inf"), float("nan"), 1e300])])
    counter = RangeCounter(x)
    for fmt in formats.names():
        for scale in [2.0**k for k in (-24, -1, 0, 1, 13, 16, 40)] + [1000.0, 3.0, 0.7, 1e30]:
            assert counter.counts(scale, fmt) == range_counts(x, scale, fmt), (fmt, scale)
    empty = RangeCounter([])
    assert empty.counts(2.0**40) == {"overflow": 0, "fine": 0, "subnormal": 0, "underflow": 0, "zero": 0}


def test_simulate_training_is_simulate_scale_with_feedback():
    rng = np.random.default_rng(0)
    max_grads = 2.0 ** rng.normal(-6, 1, 3000)
    max_grads[[500, 501, 2000]] = [np.inf, np.nan, 1e6]
    scales, overflows = simulate_training(max_grads, init_scale=2.0**24, growth_interval=50)
    assert scales == simulate_scale(overflows, init_scale=2.0**24, growth_interval=50)
    used = [2.0**24] + scales[:-1]  # the scale each step ran with
    limit = zone_thresholds("fp16")[2]
    assert overflows == [not (g * s < limit) for g, s in zip(max_grads, used)]
    assert overflows[0] and overflows[500] and overflows[501] and overflows[2000]
    assert overflows[:3] == [True] * 3  # 2**24 is too big for gradients near 2**-6: it calibrates first


# -- NaN bit patterns: "bit for bit" includes the bits of NaNs -----------------------------------------------

_INT_VIEW = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32, torch.float64: torch.int64}
# NaNs of both signs, quiet and signalling, with and without payload, in each format's bits
_NAN_BITS = {torch.float16: [0x7E00, 0x7C01, 0x7D00, -0x0200, -1], torch.bfloat16: [0x7FC0, 0x7F81, 0x7FC1, -0x40, -1],
             torch.float32: [0x7FC00000, 0x7F800001, 0x7FC00001, -0x400000, -1],
             torch.float64: [0x7FF8000000000000, 0x7FF0000000000001, -1]}


def _with_nans(dtype: torch.dtype, n: int, gen: torch.Generator) -> torch.Tensor:
    """n random values of dtype with NaNs of every kind at the start, the middle and the end, and an inf."""
    g = torch.randn(n, generator=gen).to(dtype)
    bits = g.view(_INT_VIEW[dtype])
    for k, pattern in enumerate(_NAN_BITS[dtype]):
        for pos in (k, n // 2 + k, n - 1 - k):
            if 0 <= pos < n:
                bits[pos] = pattern
    if n > 12:
        g[n // 3] = float("inf")
    return g


@pytest.mark.parametrize("threads", [1, 2])
def test_nan_bit_patterns_match_the_kernel(threads):
    """Every NaN comes out with the bits torch's kernel writes: fp32, bf16, fp16 and fp64, small and large tensors.

    The sizes put NaNs in the kernel's vectorised body, in its scalar tail (bf16 writes 0xFFFF in one and
    0x7FC0 in the other on a CPU), and, above 32768 elements with 2 threads, at each thread's boundary.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(threads)
    seen = set()
    try:
        for dtype in _INT_VIEW:
            for n in (1, 3, 15, 31, 32, 33, 100, 40_001, 70_003):
                for inv in (1.0, 0.5, 2.0**-20, 0.0):  # 0: inf * 0 makes new NaNs
                    g = _with_nans(dtype, n, gen)
                    ref, ours = g.clone(), g.clone()
                    f_ref, f_ours = torch.zeros(()), torch.zeros(())
                    torch._amp_foreach_non_finite_check_and_unscale_([ref], f_ref, torch.tensor(inv))
                    _unscale_and_check_([ours], torch.tensor(inv), f_ours)
                    diff = (ref.view(_INT_VIEW[dtype]) != ours.view(_INT_VIEW[dtype])).nonzero().flatten()
                    assert diff.numel() == 0, (dtype, n, inv, [(int(i), hex(int(ref.view(_INT_VIEW[dtype])[i])),
                                                                 hex(int(ours.view(_INT_VIEW[dtype])[i]))) for i in diff[:4]])
                    assert f_ref.item() == f_ours.item() == 1.0
                    if dtype == torch.bfloat16:
                        seen.update(int(b) & 0xFFFF for b in ref.view(torch.int16)[torch.isnan(ref)])
    finally:
        torch.set_num_threads(before)
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):  # DEFAULT has no vectorised body
        assert {0x7FC0, 0xFFFF} <= seen, "the sizes must reach both the vectorised body and the scalar tail"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_unscale_with_nan_gradients_is_bit_identical_end_to_end(dtype):
    """A model in dtype (bf16 included: its small bias lies in the kernel's scalar tail), NaN gradients, unscale_, step."""
    results = []
    for make in (lambda: torch.amp.GradScaler("cpu", init_scale=8.0), lambda: LossScaler("cpu", init_scale=8.0)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(40, 7), torch.nn.Linear(7, 3)).to(dtype)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = make()
        trace = []
        for poison in (False, True, False):
            opt.zero_grad()
            scaler.scale(model(torch.randn(5, 40).to(dtype)).float().sum()).backward()
            if poison:
                for p in model.parameters():
                    p.grad.view(-1)[::3] = float("nan")
            scaler.unscale_(opt)
            trace += [p.grad.clone() for p in model.parameters()]
            scaler.step(opt)
            scaler.update()
            trace += [p.detach().clone() for p in model.parameters()] + [scaler.get_scale()]
        results.append(trace)
    assert all(_same(a, b) for a, b in zip(*results))


# -- arguments: numpy and tensor scalars in, torch's integer limits honoured up front ----------------------

@pytest.mark.parametrize("convert", [np.float64, np.float32, torch.tensor], ids=["np.float64", "np.float32", "tensor"])
def test_numbers_may_come_as_numpy_or_tensor_scalars(convert):
    ref = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=3)
    ours = LossScaler("cpu", init_scale=convert(1024.0), growth_factor=convert(4.0), backoff_factor=convert(0.25),
                      growth_interval=np.int64(3) if convert is not torch.tensor else torch.tensor(3))
    assert ours.state_dict() == ref.state_dict()
    assert all(type(v) in (int, float) for v in ours.state_dict().values())  # plain numbers: weights_only can load them
    assert simulate_scale([False] * 7, init_scale=convert(2.0), growth_interval=np.int32(3)) == \
        simulate_scale([False] * 7, init_scale=2.0, growth_interval=3)


@pytest.mark.parametrize("kwargs", [{"growth_interval": 2**63}, {"growth_interval": 2**31}, {"growth_interval": 10**30},
                                    {"init_scale": 10**400}, {"growth_factor": 10**400}, {"backoff_factor": 10**400},
                                    {"growth_interval": np.float64(3.0)}, {"init_scale": torch.ones(2)}])
def test_values_torch_cannot_hold_are_refused_up_front(kwargs):
    """GradScaler takes growth_interval=2**63 and fails at the first update() inside torch; LossScaler refuses it."""
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=name):
        LossScaler("cpu", **kwargs)


def test_grad_scaler_itself_fails_late_on_a_huge_growth_interval():
    """The control for the test above: torch's kernel takes an int64, so 2**63 overflows only at update()."""
    scaler = torch.amp.GradScaler("cpu", growth_interval=2**63)
    model, opt = _one_step_setup(scaler)
    scaler.step(opt)
    with pytest.raises((ValueError, RuntimeError), match="[Oo]verflow"):
        scaler.update()


def test_setters_check_their_value_and_keep_the_old_one():
    s = LossScaler("cpu")
    for setter, bad in ((s.set_growth_factor, 1.0), (s.set_backoff_factor, 1.5), (s.set_growth_interval, 0),
                        (s.set_growth_interval, 2**40), (s.set_growth_factor, 10**400)):
        with pytest.raises(ValueError):
            setter(bad)
    assert (s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval()) == (2.0, 0.5, 2000)
    s.set_growth_interval(np.int64(5))
    assert s.get_growth_interval() == 5 and type(s.get_growth_interval()) is int


def test_load_state_dict_checks_everything_before_changing_anything():
    s = LossScaler("cpu", init_scale=4.0)
    s.scale(torch.ones(()))
    good = s.state_dict()
    for bad in ({**good, "_growth_tracker": -1}, {**good, "growth_interval": 2**63}, {**good, "scale": float("nan")},
                {**good, "backoff_factor": 2.0}):
        with pytest.raises(ValueError):
            s.load_state_dict(bad)
        assert s.state_dict() == good


def test_update_new_scale_accepts_numbers_and_refuses_bad_ones():
    s = scaler_after_one_scale()
    for value, expected in ((np.float64(8.0), 8.0), (torch.tensor(16.0), 16.0), (torch.tensor([32.0]), 32.0), (64, 64.0)):
        s.update(value)
        assert s.get_scale() == expected
    for bad in (10**400, float("inf"), -1, "2", torch.ones(2)):
        with pytest.raises(ValueError, match="new_scale"):
            s.update(bad)
    assert s.get_scale() == 64.0


def scaler_after_one_scale() -> LossScaler:
    s = LossScaler("cpu")
    s.scale(torch.tensor(1.0))
    return s


def test_exact_gradients_are_float64_rounded_once_and_leave_the_model_alone():
    task = make_task("transformer", n=32, seed=0)
    x, y = task.data[:32]
    before = {n: p.detach().clone() for n, p in task.model.named_parameters()}
    rec = record_gradients(task.model, x, y, task.loss_fn, exact=True)
    assert all(p.dtype == torch.float32 and torch.equal(p, before[n]) for n, p in task.model.named_parameters())
    ref = copy.deepcopy(task.model).double()
    task.loss_fn(ref(x), y).backward()
    flushed = 0
    for n, p in ref.named_parameters():
        g = p.grad.flatten()
        noise = g.abs() < g.abs().max() * EXACT_NOISE
        want = torch.where(noise, torch.zeros_like(g), g).float()
        assert rec.params[n].dtype == torch.float32 and torch.equal(rec.params[n], want)
        flushed += int((noise & (g != 0)).sum())
        if n.endswith("qkv.bias"):  # the key bias: softmax ignores a common shift, so its gradient is exactly 0
            assert torch.all(rec.params[n][32:64] == 0) and torch.all(rec.params[n][:32] != 0)
    assert flushed > 0


_ZONES_SCRIPT = """
import json
from ampcourse.models import make_task
from ampcourse.scaling import range_counts, record_gradients
task = make_task("transformer", n=64, seed=0)
x, y = task.data[:64]
counts = {}
for exact in (False, True):
    g = record_gradients(task.model, x, y, task.loss_fn, exact=exact).values("all")
    counts[str(exact)] = [range_counts(g, 2.0**k) for k in (0, 8, 16)]
print(json.dumps(counts))
"""


@pytest.mark.slow
def test_exact_gradient_counts_do_not_depend_on_the_cpus_vector_kernels():
    """Chapters 5 and 6 store zone counts of recorded gradients: with exact=True they are the same whether
    torch and oneDNN run their AVX2 or their best kernels (the fp32 pass is not: 87% of its values differ)."""
    import json
    import os
    import subprocess
    import sys
    runs = []
    for isa in ({}, {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}):
        env = {**os.environ, "OMP_NUM_THREADS": "1", **isa}
        out = subprocess.run([sys.executable, "-c", _ZONES_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    assert runs[0]["True"] == runs[1]["True"]


# --- following LossScaler's own advice works; a bad scale is refused however it is given --------------------------

@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("first", ["step", "unscale_ then step"])
def test_calling_backward_as_the_error_says_then_works(first, fused):
    """step() before backward() says "call backward() before step()"; doing exactly that must then succeed.

    It used to stay stuck: the failed attempt left the optimizer marked as unscaled with no inf check, so every
    later step() raised the same advice. The result must equal a GradScaler run that never made the mistake.
    """
    def setup():
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        opt = torch.optim.Adam(model.parameters(), lr=0.1, fused=fused)
        return model, opt

    model, opt = setup()
    ours = LossScaler("cpu", init_scale=2.0**4)
    loss = ours.scale(model(torch.ones(2, 3)).sum())
    with pytest.raises(RuntimeError, match=r"call backward\(\) before step\(\)"):
        if first != "step":
            ours.unscale_(opt)
        ours.step(opt)
    loss.backward()
    ours.step(opt)  # as advised
    ours.update()

    ref_model, ref_opt = setup()
    ref = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    ref.scale(ref_model(torch.ones(2, 3)).sum()).backward()
    ref.step(ref_opt)
    ref.update()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters()))
    assert ours.state_dict() == ref.state_dict()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -4.0, 1e39])
@pytest.mark.parametrize("as_tensor", [False, True])
def test_update_refuses_a_scale_no_step_could_use(bad, as_tensor):
    """update(torch.tensor(nan)) used to be copied in (as GradScaler does): every later step then skipped silently."""
    s = scaler_after_one_scale()
    with pytest.raises(ValueError, match="new_scale must be a positive finite"):
        s.update(torch.tensor(bad, dtype=torch.float64) if as_tensor else bad)
    assert s.get_scale() == 2.0**16  # unchanged


def test_scaler_defaults_have_one_owner():
    """GradScaler's defaults, LossScaler's and the owner's (ampcourse._scaler) are the same numbers."""
    import inspect

    from ampcourse import _scaler
    from ampcourse.device import pick

    ours = inspect.signature(LossScaler).parameters
    torch_ = inspect.signature(torch.amp.GradScaler).parameters
    for name, value in _scaler.DEFAULTS.items():
        assert ours[name].default == value == torch_[name].default, name
    scaler = pick("cpu", "fp16").make_scaler()
    assert (scaler.get_scale(), scaler.get_growth_factor(), scaler.get_backoff_factor(),
            scaler.get_growth_interval()) == tuple(_scaler.DEFAULTS.values())


@pytest.mark.parametrize("kwargs,message", [
    ({"init_scale": -1.0}, "init_scale must be a positive finite float32"),
    ({"growth_interval": 2**40}, "growth_interval must be an int >= 1 and <= 2\\*\\*31 - 1"),
    ({"growth_factor": 0.5}, "growth_factor must be a finite number > 1"),
    ({"init_scal": 8.0}, r"unknown make_scaler arguments \['init_scal'\]"),
    ({"enabled": "yes"}, r"make_scaler arguments\['enabled'\] must be True or False"),
])
def test_make_scaler_asks_the_owner(kwargs, message):
    """AmpSetup.make_scaler used to hand anything to GradScaler (a negative scale was accepted)."""
    from ampcourse.device import pick

    with pytest.raises(ValueError, match=message):
        pick("cpu", "fp16").make_scaler(**kwargs)
    scaler = pick("cpu", "fp16").make_scaler(init_scale=np.float64(8.0), growth_interval=np.int64(3))
    assert scaler.get_scale() == 8.0 and scaler.get_growth_interval() == 3


def test_found_inf_is_public_and_what_train_step_reads():
    """found_inf(optimizer): this iteration's flag (1 after an inf gradient, 0 after a clean one), gone after update().

    train.step's skip detection asks for it instead of reading the scaler's private per-optimizer layout.
    """
    from ampcourse.train.step import _found_inf

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler("cpu", init_scale=4.0)
    assert scaler.found_inf(opt) is None
    for bad, expected in ((True, 1.0), (False, 0.0)):
        opt.zero_grad()
        loss = model(torch.ones(1, 2)).sum() * (float("inf") if bad else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        assert scaler.found_inf(opt).item() == expected
        assert _found_inf(scaler, opt).item() == expected
        scaler.update()
        assert scaler.found_inf(opt) is None
    assert LossScaler("cpu", enabled=False).found_inf(opt) is None
