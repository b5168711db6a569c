"""ampcourse.reduce_sim: an N-rank all-reduce in bf16 rounds at every addition, and the ring's error grows with N."""

import pytest
import torch

from ampcourse.reduce_sim import reduction_error, rounding_steps, simulate_reduction

HALF_ULP_AT_1 = 2.0**-8  # bf16 keeps 8 significant bits: spacing 2**-7 at 1.0


def three_ranks() -> torch.Tensor:
    """Rank 0 sends 1.0, ranks 1 and 2 send half a bf16 ulp of 1.0, for three gradient elements."""
    return torch.tensor([[1.0] * 3, [HALF_ULP_AT_1] * 3, [HALF_ULP_AT_1] * 3])


def test_ring_rounds_after_every_hop_and_each_chunk_starts_on_its_own_rank():
    # Element c (chunk c) starts on rank c+1. Element 0: 2**-8 + 2**-8 = 2**-7, then + 1 -> 1 + 2**-7 exactly.
    # Elements 1 and 2 meet 1.0 first: 1 + 2**-8 is a tie that rounds to 1 (even), twice: both halves are lost.
    got = simulate_reduction(three_ranks(), dtype=torch.bfloat16, algorithm="ring", average=False)
    assert got.tolist() == [1.0 + 2**-7, 1.0, 1.0]
    # In fp32 nothing rounds away.
    assert simulate_reduction(three_ranks(), dtype=torch.float32, average=False).tolist() == [1.0 + 2**-7] * 3


def test_tree_adds_pairs_then_the_carry():
    # (rank 0 + rank 1) rounds to 1, then + rank 2 rounds to 1 again.
    got = simulate_reduction(three_ranks(), dtype=torch.bfloat16, algorithm="tree", average=False)
    assert got.tolist() == [1.0, 1.0, 1.0]


def test_average_divides_in_the_wire_dtype_before_the_sum_like_bf16_compress_hook():
    grads = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    want = (grads.to(torch.bfloat16) / 5)  # the hook: buffer.to(bf16).div_(world_size), then SUM
    acc = want[1]  # the ring order of chunk 0 (elements 0..12): ranks 1, 2, 3, 4, 0
    for r in (2, 3, 4, 0):
        acc = acc + want[r]
    got = simulate_reduction(grads, dtype=torch.bfloat16)
    assert got.dtype == torch.float32 and got.shape == (64,)
    assert torch.equal(got[:12], acc[:12].float())


def test_one_rank_is_the_cast_of_its_gradient_and_shape_is_kept():
    g = torch.randn(1, 2, 3)
    assert torch.equal(simulate_reduction(g, dtype=torch.bfloat16), g[0].to(torch.bfloat16).float())
    assert simulate_reduction(torch.randn(4, 2, 3), algorithm="tree").shape == (2, 3)


def test_ring_error_grows_with_world_size_in_bf16_and_the_tree_does_not():
    ring = {n: reduction_error(n, dtype=torch.bfloat16, algorithm="ring") for n in (2, 64, 1024)}
    tree = {n: reduction_error(n, dtype=torch.bfloat16, algorithm="tree") for n in (2, 64, 1024)}
    assert ring[2] < ring[64] < ring[1024]
    assert ring[1024] > 10 * ring[2]  # the small late additions to a large partial sum round away
    assert tree[1024] < 1.5 * tree[2]  # equal-weight additions: about the error of the cast alone
    # fp32 on the wire: hundreds of times smaller at every size
    assert all(reduction_error(n, dtype=torch.float32) < ring[n] / 100 for n in (2, 64, 1024))


def test_rounding_steps():
    assert [rounding_steps(n) for n in (1, 2, 8, 1024)] == [0, 1, 7, 1023]
    assert [rounding_steps(n, "tree") for n in (1, 2, 8, 1000)] == [0, 1, 3, 10]


@pytest.mark.parametrize("call, error", [
    (lambda: simulate_reduction([[1.0]]), TypeError),
    (lambda: simulate_reduction(torch.ones(2, 3, dtype=torch.float16)), ValueError),
    (lambda: simulate_reduction(torch.ones(0, 3)), ValueError),
    (lambda: simulate_reduction(torch.ones(2, 3), dtype=torch.float64), ValueError),
    (lambda: simulate_reduction(torch.ones(2, 3), algorithm="butterfly"), ValueError),
    (lambda: reduction_error(0), ValueError),
    (lambda: reduction_error(4, spread=-1.0), ValueError),
])
def test_bad_input_says_what_to_pass(call, error):
    with pytest.raises(error, match="must be"):
        call()


def test_exercise_7_4_tolerance_counts_one_rounding_per_ring_addition():
    """7.4's checker allows one half-ulp per share plus one per addition: it widens with the world size."""
    from ampcourse.exercises.ch07 import _bf16_tolerance

    assert _bf16_tolerance(2) == 2.0**-7  # the cast of each share, and one addition
    assert _bf16_tolerance(8) == 8 * 2.0**-8
    # and the simulated worst case on 8 ranks stays inside it
    grads = torch.randn(8, 4096, generator=torch.Generator().manual_seed(3))
    exact = grads.double().mean(0)
    err = (simulate_reduction(grads).double() - exact).abs().max() / exact.abs().max()
    assert err <= _bf16_tolerance(8)


@pytest.mark.parametrize("call, says", [
    # average="no" is truthy: before, it silently averaged
    (lambda: simulate_reduction(torch.ones(2, 3), average="no"), "average must be True or False"),
    # before: nan, silently (the gradients themselves overflowed float32)
    (lambda: reduction_error(2, spread=1e39), "overflow float32"),
    # before: a RuntimeError from torch's CPU allocator ("you tried to allocate 16384000000000 bytes")
    (lambda: reduction_error(10**9), "more than this simulation holds"),
    (lambda: reduction_error(2, numel=10**12), "more than this simulation holds"),
])
def test_edge_inputs_are_refused_naming_the_argument(call, says):
    with pytest.raises(ValueError, match=says):
        call()


def test_the_ring_error_depends_on_the_gradient_model_as_the_docstring_says():
    """Identical gradients (spread 0) stall a bf16 ring's partial sum; noise of both signs keeps it smaller."""
    ring = {s: reduction_error(1024, spread=s, numel=1024) for s in (0.0, 1.0, 10.0)}
    assert ring[0.0] > ring[1.0] > ring[10.0]
    assert ring[0.0] > 0.5 and 0.2 < ring[1.0] < 0.5 and ring[10.0] < 0.05  # ~64%, ~35%, ~3.1%
    tree = [reduction_error(1024, spread=s, numel=1024, algorithm="tree") for s in (0.0, 1.0, 10.0)]
    assert max(tree) < 0.005


def test_identical_shares_stall_after_about_two_to_the_eight_of_them():
    """spread=0: the same share added again and again; past 2**8 shares each one is below half the spacing."""
    share = torch.full((1024, 1), 1.0)
    summed = simulate_reduction(share, dtype=torch.bfloat16, average=False)
    assert summed.item() == 256.0  # 256 + 1 is a tie that rounds to even (256); every later 1 rounds away too
