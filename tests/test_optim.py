"""ampcourse.optim: stochastic rounding is unbiased, and pure-bf16 AdamW keeps small updates only when it
rounds stochastically or compensates (Kahan); nearest rounding loses them."""

import pytest
import torch

from ampcourse.optim import ROUNDINGS, BF16AdamW, stochastic_round

BF16_EPS = torch.finfo(torch.bfloat16).eps


def test_stochastic_round_lands_on_the_two_neighbours_and_is_unbiased():
    x = torch.full((40_000,), 1.0 + 0.25 * BF16_EPS)  # a quarter of the way from 1 to the next bf16 value
    out = stochastic_round(x, torch.Generator().manual_seed(0)).float()
    assert set(out.unique().tolist()) == {1.0, 1.0 + BF16_EPS}
    up = (out > 1.0).float().mean().item()
    assert abs(up - 0.25) < 0.01  # rounds up a quarter of the time
    assert abs(out.mean().item() - x[0].item()) < 0.02 * BF16_EPS


def test_stochastic_round_keeps_representable_values_and_specials():
    exact = torch.tensor([0.0, -0.0, 1.0, -2.5, torch.finfo(torch.bfloat16).max, 2.0**-130])  # all bf16 values
    assert torch.equal(stochastic_round(exact).float(), exact)
    special = stochastic_round(torch.tensor([float("inf"), float("-inf"), float("nan")]))
    assert special[0] == float("inf") and special[1] == float("-inf") and torch.isnan(special[2])


def test_stochastic_round_rejects_other_dtypes():
    with pytest.raises(TypeError, match="float32"):
        stochastic_round(torch.ones(3, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="float32"):
        stochastic_round([1.0])


def many_small_steps(rounding: str, steps: int = 200, lr: float = 1e-4) -> float:
    """A weight of 1.0 with a constant gradient: each Adam step moves it by about lr, far below half an ulp."""
    w = torch.nn.Parameter(torch.ones(256, dtype=torch.bfloat16))
    opt = BF16AdamW([w], lr=lr, rounding=rounding, seed=0)
    for _ in range(steps):
        w.grad = torch.ones_like(w)
        opt.step()
    return w.float().mean().item()


def fp32_reference(steps: int = 200, lr: float = 1e-4) -> float:
    """The same run with torch's AdamW on fp32 weights."""
    w = torch.nn.Parameter(torch.ones(256))
    opt = torch.optim.AdamW([w], lr=lr, weight_decay=0.0)
    for _ in range(steps):
        w.grad = torch.ones_like(w)
        opt.step()
    return w.mean().item()


def test_nearest_rounding_loses_small_updates_and_kahan_and_stochastic_keep_them():
    ref = fp32_reference()
    assert ref < 1.0 - 0.015  # the fp32 weights moved by about steps * lr
    assert many_small_steps("nearest") == 1.0  # every update rounded away
    assert abs(many_small_steps("kahan") - ref) < BF16_EPS  # within one bf16 spacing of fp32
    assert abs(many_small_steps("stochastic") - ref) < 0.1 * (1.0 - ref)  # on average, over 256 weights


def test_state_is_bf16_and_updates_match_fp32_adamw_when_they_are_large():
    torch.manual_seed(0)
    w32 = torch.nn.Parameter(torch.randn(64))
    w16 = torch.nn.Parameter(w32.detach().to(torch.bfloat16))
    w32.data.copy_(w16.float())  # the same starting values
    ref = torch.optim.AdamW([w32], lr=0.05, weight_decay=0.01)
    opt = BF16AdamW([w16], lr=0.05, weight_decay=0.01, rounding="nearest")
    for _ in range(5):
        g = torch.randn(64)
        w32.grad, w16.grad = g.clone(), g.to(torch.bfloat16)
        ref.step()
        opt.step()
    assert {t.dtype for t in opt.state[w16].values() if isinstance(t, torch.Tensor)} == {torch.bfloat16}
    assert torch.allclose(w16.float(), w32.detach(), atol=0.02)  # large updates survive bf16 storage


def test_closure_and_parameters_without_gradients():
    a = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    b = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    opt = BF16AdamW([a, b], lr=0.1)

    def closure():
        opt.zero_grad()
        loss = (a.float() ** 2).sum()
        loss.backward()
        return loss

    assert opt.step(closure).item() == 3.0
    assert (a < 1).all() and torch.equal(b, torch.ones(3, dtype=torch.bfloat16)) and b not in opt.state


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(rounding="up"), ValueError, "rounding must be one of nearest, stochastic, kahan"),
    (dict(lr=0.0), ValueError, "lr must be a positive"),
    (dict(betas=(0.9, 1.0)), ValueError, "betas"),
    (dict(eps=0.0), ValueError, "eps must be > 0"),
])
def test_bad_arguments_are_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        BF16AdamW([torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))], **kwargs)


def test_fp32_parameters_are_refused():
    with pytest.raises(TypeError, match=r"bf16 parameters; got a torch.float32 parameter of shape \(2,\)"):
        BF16AdamW([torch.nn.Parameter(torch.ones(2))])
    # every name in ROUNDINGS builds an optimizer whose step keeps bf16 weights (not a tuple compared with itself)
    for rounding in ROUNDINGS:
        w = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
        opt = BF16AdamW([w], rounding=rounding)
        w.grad = torch.ones_like(w)
        opt.step()
        assert opt.rounding == rounding and w.dtype == torch.bfloat16


# --- resuming, loading, groups, sparse gradients (issue 21 item 12; issue 19 item 13) ---------------------------

def _run(opt: BF16AdamW, w: torch.nn.Parameter, steps: int, start: int = 0) -> None:
    """`steps` steps with a seeded gradient per step (the same gradients whatever the split)."""
    for i in range(start, start + steps):
        w.grad = torch.randn(w.shape, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16) * 1e-2
        opt.step()


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_a_resumed_run_is_bit_identical_to_the_uninterrupted_one(rounding, tmp_path):
    """Save after 5 steps (torch.save, weights_only load), resume in a fresh optimizer: the same bits as 10 steps in one go."""
    start = torch.randn(512, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16) * 1e-2
    make = lambda: torch.nn.Parameter(start.clone())  # noqa: E731
    whole = make()
    _run(BF16AdamW([whole], lr=1e-4, rounding=rounding, seed=3), whole, 10)
    first = make()
    opt = BF16AdamW([first], lr=1e-4, rounding=rounding, seed=3)
    _run(opt, first, 5)
    torch.save({"w": first.detach(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    resumed = torch.nn.Parameter(ckpt["w"].clone())
    opt2 = BF16AdamW([resumed], lr=1e-4, rounding=rounding, seed=99)  # the saved seed and generator state win
    opt2.load_state_dict(ckpt["opt"])
    _run(opt2, resumed, 5, start=5)
    assert torch.equal(resumed, whole)
    assert not torch.equal(whole, start)  # the run moved the weights at all


@pytest.mark.parametrize("saved,loaded", [("stochastic", "kahan"), ("kahan", "stochastic"), ("nearest", "kahan")])
def test_a_state_saved_with_another_rounding_is_refused_clearly(saved, loaded):
    w = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = BF16AdamW([w], rounding=saved)
    _run(opt, w, 2)
    other = BF16AdamW([w], rounding=loaded)
    with pytest.raises(ValueError, match=f"saved by BF16AdamW\\(rounding='{saved}'\\); build the optimizer with "
                                         f"rounding='{saved}'"):
        other.load_state_dict(opt.state_dict())


def test_a_state_without_what_kahan_needs_is_refused_at_load_not_at_step():
    """A torch.optim.AdamW state (or an older BF16AdamW's, without the rounding recorded) has no compensation buffer:
    one line at load time instead of `KeyError: 'compensation'` at the next step()."""
    w32 = torch.nn.Parameter(torch.ones(4))
    adamw = torch.optim.AdamW([w32])
    w32.grad = torch.ones(4)
    adamw.step()
    w = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"does not come from BF16AdamW\(rounding='kahan'\): parameter 0 has no compensation"):
        BF16AdamW([w], rounding="kahan").load_state_dict(adamw.state_dict())
    with pytest.raises(ValueError, match="state_dict must be what BF16AdamW.state_dict"):
        BF16AdamW([w]).load_state_dict([1, 2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_add_param_group_refuses_what_the_constructor_refuses(dtype):
    opt = BF16AdamW([torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))])
    with pytest.raises(TypeError, match=f"bf16 parameters; got a {dtype} parameter of shape \\(3,\\)"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(3, dtype=dtype))]})
    with pytest.raises(TypeError, match="bf16 parameters"):
        opt.add_param_group({"params": torch.nn.Parameter(torch.ones(3, dtype=dtype))})  # one tensor, not a list
    with pytest.raises(ValueError, match="lr must be a positive"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))], "lr": -1})
    good = torch.nn.Linear(3, 3).to(torch.bfloat16)
    opt.add_param_group({"params": good.parameters()})  # a generator is read once and kept
    assert len(opt.param_groups) == 2 and len(opt.param_groups[1]["params"]) == 2


def test_sparse_gradients_get_one_line_not_an_aten_error():
    emb = torch.nn.Embedding(10, 4, sparse=True).to(torch.bfloat16)
    opt = BF16AdamW(emb.parameters())
    emb(torch.tensor([1, 2])).float().sum().backward()
    with pytest.raises(RuntimeError, match=r"does not support sparse gradients .*nn.Embedding\(\.\.\., sparse=False\)"):
        opt.step()


def test_stochastic_rounding_draws_its_bits_on_the_parameters_device(monkeypatch):
    """On CUDA the update used to go to the CPU and back every step (for a CPU generator): a device's parameters
    round with a generator made on that device. Pretended here: the generator asked for, and no host copy."""
    w = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    opt = BF16AdamW([w], rounding="stochastic")
    asked = []
    real = opt._generator
    monkeypatch.setattr(opt, "_generator", lambda device: asked.append(device) or real(device))
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: pytest.fail("a host copy in step()"))
    _run(opt, w, 2)
    assert asked == [w.device, w.device]
    made = []

    class FakeGenerator:
        def __init__(self, device="cpu"):
            made.append(torch.device(device))

        def manual_seed(self, seed):
            return self

    monkeypatch.setattr(torch, "Generator", FakeGenerator)
    opt._generator(torch.device("cuda", 1))
    assert made == [torch.device("cuda", 1)] and "cuda:1" in opt._generators
