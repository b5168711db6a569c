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
    assert ROUNDINGS == ("nearest", "stochastic", "kahan")
