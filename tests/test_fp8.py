"""ampcourse.fp8: scaled quantization (against the OCP MX definition and torchao), scaling recipes, memory."""

import math
import warnings

import numpy as np
import pytest
import torch

from ampcourse import formats, fp8
from ampcourse.fp8 import quantize_scaled

# torchao and torch's fp4 dtype are imported inside the tests that need them (torchao_mx below): a torch or
# torchao without them skips those tests with the reason, instead of turning this module into one
# collection error that hides every other result (the floor torch, 2.11, runs this module too).


def torchao_mx():
    """torchao's MX/NVFP4 reference classes (ScaleCalculationMode, MXTensor, NVFP4Tensor), or a skip naming why."""
    try:
        with fp8.quiet_torchao():
            from torchao.prototype.mx_formats.config import ScaleCalculationMode
            from torchao.prototype.mx_formats.mx_tensor import MXTensor
            from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor
    except ImportError as err:
        import torchao
        pytest.skip(f"torchao {torchao.__version__} on torch {torch.__version__} lacks the MX reference: {err}")
    return ScaleCalculationMode, MXTensor, NVFP4Tensor


def torch_dtype(name: str) -> torch.dtype:
    """A torch dtype by attribute name, or a skip naming the torch version that lacks it."""
    if not hasattr(torch, name):
        pytest.skip(f"torch {torch.__version__} has no torch.{name}")
    return getattr(torch, name)


def sample(rows: int = 8, cols: int = 256, seed: int = 0, outlier: float | None = None) -> torch.Tensor:
    """Gaussian float32 values with per-row magnitudes spread over several octaves, and an optional outlier."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen) * 2.0 ** torch.randint(-6, 6, (rows, 1), generator=gen).float()
    if outlier is not None:
        x[0, 5] = outlier
    return x


def ocp_mx_reference(x: torch.Tensor, element: str) -> tuple[np.ndarray, np.ndarray]:
    """The OCP MX v1.0 section 6.3 algorithm written out block by block in Python floats."""
    f = formats.spec(element)
    vals, scales = [], []
    for block in x.double().reshape(-1, 32).tolist():
        amax = max(abs(v) for v in block)
        e = (math.floor(math.log2(amax)) - f.emax) if amax > 0 else -127
        scale = 2.0 ** max(-127, min(127, e))
        q = [float(formats.quantize(max(-f.max, min(f.max, v / scale)), f)) for v in block]
        vals.append([v * scale for v in q])
        scales.append(scale)
    return np.array(vals).reshape(x.shape), np.array(scales).reshape(x.shape[0], -1)


@pytest.mark.parametrize("element", ["fp8_e4m3", "fp8_e5m2", "fp6_e2m3", "fp6_e3m2", "fp4_e2m1"])
def test_mx_equals_the_ocp_definition(element):
    x = sample(4, 128, seed=1, outlier=300.0)
    x[1, :32] = 0.0  # an all-zero block
    r = quantize_scaled(x, element, "mx")
    vals, scales = ocp_mx_reference(x, element)
    assert np.array_equal(r.values.numpy(), vals) and np.array_equal(r.scales.numpy(), scales)
    assert r.scales.shape == (4, 4) and r.block == (1, 32)


#: our element name -> what torchao's to_mx takes for it (a torch dtype by name, or torchao's fp6 name)
TORCHAO_ELEMENTS = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2",
                    "fp6_e2m3": "fp6_e2m3", "fp6_e3m2": "fp6_e3m2", "fp4_e2m1": "float4_e2m1fn_x2"}


@pytest.mark.parametrize("element", list(TORCHAO_ELEMENTS))
@pytest.mark.parametrize("rounding", ["floor", "rceil"])
def test_mx_equals_torchao_to_mx(element, rounding):
    ScaleCalculationMode, MXTensor, _ = torchao_mx()
    mode = ScaleCalculationMode.FLOOR if rounding == "floor" else ScaleCalculationMode.RCEIL
    elem = TORCHAO_ELEMENTS[element]
    elem = elem if elem.startswith("fp6") else torch_dtype(elem)
    for seed in range(3):
        x = sample(8, 256, seed=seed, outlier=1000.0 * (seed + 1))
        ours = quantize_scaled(x, element, "mx", mx_rounding=rounding)
        mx = MXTensor.to_mx(x, elem, 32, mode)
        assert torch.equal(ours.scales.float(), mx.scale.float().reshape(ours.scales.shape)), (element, seed)
        assert torch.equal(ours.values.float(), mx.dequantize(torch.float32)), (element, seed)


def test_mx_floor_clips_what_rceil_keeps():
    # amax = 500 in a block: floor gives X = 2**(8 - 8) = 1, so 500 > 448 saturates; rceil picks X = 2
    x = torch.ones(1, 32)
    x[0, 0] = 500.0
    floor, rceil = quantize_scaled(x, "fp8_e4m3", "mx"), quantize_scaled(x, "fp8_e4m3", "mx", mx_rounding="rceil")
    assert (floor.scales.item(), floor.values[0, 0].item(), floor.saturated) == (1.0, 448.0, 1)
    assert (rceil.scales.item(), rceil.values[0, 0].item(), rceil.saturated) == (2.0, 512.0, 0)


def test_nvfp4_equals_torchao_to_nvfp4():
    _, _, NVFP4Tensor = torchao_mx()
    for seed in range(3):
        x = sample(8, 128, seed=seed, outlier=50.0)
        ours = quantize_scaled(x, "fp4_e2m1", "nvfp4")
        nv = NVFP4Tensor.to_nvfp4(x)
        assert torch.equal(ours.scales.float(), nv.scale.float().reshape(ours.scales.shape))
        assert torch.equal(ours.values.float(), nv.dequantize(torch.float32))


def test_fp32_scales_map_each_groups_amax_onto_the_format_max():
    x = sample(256, 256, seed=2)
    for g, shape in [("tensor", (1, 1)), ("row", (256, 1)), ("1x128", (256, 2)), ("128x128", (2, 2))]:
        r = quantize_scaled(x, "fp8_e4m3", g)
        assert r.scales.shape == shape and r.saturated == 0, g
        # the amax of each group lands on 448 (to the fp32 scale's last bit)
        assert r.values.abs().max().item() == pytest.approx(x.abs().max().item(), rel=1e-6)
    tiles = quantize_scaled(x, "fp8_e4m3", "128x128").scales
    assert tiles[1, 0].item() == pytest.approx(x[128:, :128].abs().max().item() / 448, rel=1e-7)


def test_finer_granularity_wins_when_there_is_an_outlier():
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(0))
    x[0, 5] = 100.0
    res = fp8.compare_granularities(x, "fp4_e2m1")
    assert "128x128" not in res  # 8 rows do not make a 128-row tile: skipped, not an error
    err = {g: res[g]["rel_error"] for g in res}
    assert err["tensor"] > err["row"] > err["1x128"] > err["mx"] > err["nvfp4"]
    assert res["tensor"]["median_rel_error"] == 1.0  # most elements flushed to zero
    under = {g: res[g]["underflowed"] for g in res}
    assert under["tensor"] > under["row"] > under["mx"] > 0
    assert res["mx"]["sqnr_db"] == pytest.approx(-20 * math.log10(err["mx"]))
    assert "nvfp4" not in fp8.compare_granularities(x, "fp8_e4m3")  # NVFP4 means fp4 elements


def test_error_measures():
    x = torch.tensor([3.0, 4.0])
    assert fp8.relative_error(x, torch.tensor([3.0, 4.5])) == pytest.approx(0.1)
    assert fp8.sqnr_db(x, torch.tensor([3.0, 4.5])) == pytest.approx(20.0)
    assert fp8.sqnr_db(x, x) == math.inf and fp8.relative_error(torch.zeros(2), torch.zeros(2)) == 0.0
    # the median looks at a typical element: one big error barely moves it, flushing half of them does
    assert fp8.median_relative_error(torch.tensor([1.0, 2.0, 4.0]), torch.tensor([1.0, 2.0, 0.0])) == 0.0
    assert fp8.median_relative_error(torch.tensor([1.0, 2.0, 4.0]), torch.tensor([0.0, 0.0, 4.0])) == 1.0


def test_quantize_scaled_keeps_1d_shape_and_accepts_block_size():
    r = quantize_scaled(torch.arange(64.0), "fp8_e4m3", "mx", block_size=16)
    assert r.values.shape == (64,) and r.scales.shape == (1, 4) and r.block == (1, 16)


@pytest.mark.parametrize("call, match", [
    (lambda: quantize_scaled(torch.ones(4, 30), "fp8_e4m3", "mx"), "not a multiple"),
    (lambda: quantize_scaled(torch.ones(4, 32), "fp8_e4m3", "blockwise"), "unknown granularity 'blockwise'"),
    (lambda: quantize_scaled(torch.ones(4, 32), "fp32", "mx"), "narrow signed format"),
    (lambda: quantize_scaled(torch.ones(4, 32), "fp8_e4m3", "nvfp4"), "fp4_e2m1 elements"),
    (lambda: quantize_scaled(torch.ones(4, 32), "fp8_e4m3", "mx", mx_rounding="up"), "mx_rounding"),
    (lambda: quantize_scaled(torch.ones(4, 32), "fp8_e4m3", "row", block_size=8), "block_size applies"),
    (lambda: quantize_scaled(torch.ones(4, 32), "fp8_e4m3", "mx", block_size=0), "positive int"),
    (lambda: quantize_scaled(torch.tensor([1.0, float("inf")]), "fp8_e4m3"), "inf or NaN"),
    (lambda: quantize_scaled(torch.ones(2, 2, 2), "fp8_e4m3"), "1-D or 2-D"),
    (lambda: fp8.simulate_scaling([torch.ones(4)], mode="lazy"), "'delayed' or 'current'"),
    (lambda: fp8.simulate_scaling([torch.ones(4)], history=0), "history"),
    (lambda: fp8.bytes_per_parameter("fp4 magic"), "unknown scheme"),
    (lambda: fp8.scaled_matmul(torch.ones(2, 3), torch.ones(2, 3)), "a.shape\\[1\\] == b.shape\\[0\\]"),
])
def test_bad_input_is_rejected_clearly(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_delayed_scaling_saturates_at_a_spike_and_then_underflows():
    seq = fp8.spike_sequence(steps=30, spike_at=10, spike=1000.0, size=512)
    delayed = fp8.simulate_scaling(seq, mode="delayed", history=8)
    current = fp8.simulate_scaling(seq, mode="current")
    assert all(s.saturated == 0 for s in current)  # just-in-time scales never clip
    assert delayed[10].saturated > 100  # the spike meets a scale made for values 1000x smaller
    assert delayed[10].rel_error > 10 * current[10].rel_error
    # afterwards the spike's amax sits in the history for 8 steps: scales are ~1000x too coarse
    after = delayed[11:19]
    assert sum(s.underflowed for s in after) > 0 and sum(current[s.step].underflowed for s in after) == 0
    assert all(s.scale > 500 * current[s.step].scale for s in after)
    assert delayed[19].scale < 2 * current[19].scale  # the spike has left the window
    assert delayed[0].scale == 1.0 and delayed[1].scale == pytest.approx(seq[0].abs().max().item() / 448)


def test_delayed_scaling_margin_and_history_follow_transformer_engine():
    seq = [torch.full((4,), float(v)) for v in (1.0, 4.0, 2.0, 2.0)]
    d = fp8.simulate_scaling(seq, mode="delayed", history=2, margin=1)
    # step 2 uses max(history = [1, 4]) * 2**1 / 448; step 3 uses max([4, 2]); history 2 forgets step 0
    assert d[2].scale == pytest.approx(4.0 * 2 / 448) and d[3].scale == pytest.approx(4.0 * 2 / 448)
    d1 = fp8.simulate_scaling(seq, mode="delayed", history=1)
    assert d1[3].scale == pytest.approx(2.0 / 448)


def test_bytes_per_parameter_are_computed_from_components():
    table = fp8.bytes_per_parameter()
    assert table["bf16 mixed precision"] == 2 + 2 + 4 + 4 + 4
    assert table["TE fp8 (delayed scaling)"] > table["bf16 mixed precision"]  # fp8 compute saves no state
    assert table["DeepSeek-V3 fp8"] == pytest.approx(1 + 4 / 16384 + 4 + 4 + 2 + 2)
    # MS-AMP's optimization-level table: O1 11 B, O2 6 B (FP8-LM's "16 -> 6 bytes"), O3 7 B (fp8 weights + fp16 master)
    assert (table["MS-AMP O1"], table["MS-AMP O2"], table["MS-AMP O3"]) == (2 + 1 + 4 + 4, 2 + 1 + 1 + 2, 1 + 2 + 1 + 1 + 2)
    assert table["MS-AMP O2"] < table["MS-AMP O3"] < table["MS-AMP O1"] < table["bf16 mixed precision"]
    for s in fp8.SCHEMES:
        assert s.bytes == sum(formats.spec(c.fmt).bits / 8 / c.per for c in s.components)


def rowwise_on_cpu() -> bool:
    """Whether this torch's CPU _scaled_mm takes rowwise scales (measured: from 2.13)."""
    return formats.torch_version() >= fp8.ROWWISE_SCALED_MM_CPU


def test_scaled_mm_per_tensor_matches_dequantize_then_matmul():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(32, 64, generator=gen), torch.randn(64, 16, generator=gen)
    out, ref = fp8.scaled_matmul(a, b, "tensor")
    assert out.dtype == torch.float32 and out.shape == (32, 16)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert fp8.relative_error(a @ b, out) < 0.1  # e4m3 keeps ~2 significant digits


def test_scaled_mm_rowwise_writes_bf16_as_cuda_does():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(32, 64, generator=gen), torch.randn(64, 16, generator=gen)
    if not rowwise_on_cpu():
        with pytest.raises(NotImplementedError, match="torch >= 2.13.*granularity='tensor'"):
            fp8.scaled_matmul(a, b, "row")
        return
    out, ref = fp8.scaled_matmul(a, b, "row")
    assert out.dtype == torch.bfloat16 and out.shape == (32, 16)  # the default for "row": CUDA's only choice
    torch.testing.assert_close(out.float(), ref, rtol=2**-8, atol=1e-2)  # bf16 rounding of the output
    assert fp8.relative_error(a @ b, out.float()) < 0.1


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_scaled_mm_rowwise_refuses_what_cuda_refuses(out_dtype):
    with pytest.raises(ValueError, match="rowwise scaling needs out_dtype=torch.bfloat16"):
        fp8.scaled_matmul(torch.ones(16, 16), torch.ones(16, 16), "row", out_dtype=out_dtype)


@pytest.mark.parametrize("shape_a, shape_b, what", [
    ((16, 24), (24, 16), "K=24, N=16"), ((16, 16), (16, 8), "K=16, N=8"), ((3, 32), (32, 48), None),
])
def test_scaled_mm_needs_k_and_n_multiples_of_16(shape_a, shape_b, what):
    a, b = torch.ones(shape_a), torch.ones(shape_b)
    if what is None:  # M is free: only K and N meet the kernel's alignment
        out, _ = fp8.scaled_matmul(a, b)
        assert out.shape == (3, 48)
        return
    with pytest.raises(ValueError, match=f"multiples of 16: got {what}"):
        fp8.scaled_matmul(a, b)


@pytest.mark.parametrize("shape_a, shape_b", [((0, 16), (16, 16)), ((16, 0), (0, 16)), ((16, 16), (16, 0))])
def test_scaled_mm_refuses_empty_matrices_clearly(shape_a, shape_b):
    with pytest.raises(ValueError, match="non-empty"):
        fp8.scaled_matmul(torch.ones(shape_a), torch.ones(shape_b))


def test_scaled_mm_operands_stay_inside_e4m3_on_every_torch():
    """amax / fp32(amax / 448) is 448.00003 for this amax: the operand is clamped to 448 before the cast."""
    a = torch.ones(16, 16)
    a[0, 0] = 65.13379669189453
    assert (a[0, 0] / (a[0, 0] / 448)).item() > 448  # the scale's last bit really overshoots
    out, ref = fp8.scaled_matmul(a, torch.eye(16))
    assert torch.isfinite(out).all() and torch.equal(out, ref)


@pytest.mark.parametrize("granularity", list(fp8.GRANULARITIES))
@pytest.mark.parametrize("values", [
    [[1e-45, 0.0, -0.0, 1e-44] * 8],  # all tiny: an unclamped fp32 scale rounds to 0 and 0/0 is NaN
    [[1e300, 1.0, -2.0, 3.0] * 8],  # float64 beyond fp32: an unclamped scale is inf and x/inf*inf is NaN
    [[1e-300, 1e-310, 0.0, -1e-305] * 8],
])
def test_quantize_scaled_keeps_finite_input_finite(granularity, values):
    x = torch.tensor(values, dtype=torch.float64).repeat(16, 4)  # 16 x 128: every granularity's block fits
    element = "fp4_e2m1" if granularity == "nvfp4" else "fp8_e4m3"
    if granularity == "128x128":
        x = x.repeat(8, 1)
    r = quantize_scaled(x, element, granularity)
    assert torch.isfinite(r.values).all() and torch.isfinite(r.scales).all() and (r.scales > 0).all(), granularity
    assert r.underflowed + r.saturated + int((r.values != 0).sum()) >= int((x != 0).sum())  # counted, not lost


def test_fp32_scales_clamp_amax_as_torchao_does():
    tiny = quantize_scaled(torch.full((1, 4), 1e-20, dtype=torch.float64), "fp8_e4m3")
    assert tiny.scales.item() == pytest.approx(fp8.AMAX_EPS / 448, rel=1e-6)
    assert tiny.underflowed == 4  # 1e-20 / (1e-12 / 448) is far below e4m3's smallest subnormal


def test_quiet_torchao_restores_logger_levels():
    import logging
    lg = logging.getLogger("torchao")
    before = lg.level
    with fp8.quiet_torchao():
        assert lg.level == logging.ERROR
    assert lg.level == before


def test_importing_ampcourse_fp8_emits_no_warnings():
    import importlib
    import sys
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sys.modules.pop("ampcourse.fp8", None)
        importlib.import_module("ampcourse.fp8")
    assert not caught


def test_every_recipe_runs_on_the_locked_torch_and_says_why_elsewhere():
    """With torch 2.13+ and torchao 0.18 every recipe runs; elsewhere an unavailable one names the versions."""
    missing = {r: fp8.recipe_unavailable(r) for r in fp8.RECIPES}
    assert missing["fp32"] is None and missing["bf16"] is None
    if formats.torch_version() >= (2, 13):
        assert missing == dict.fromkeys(fp8.RECIPES), missing
    for recipe, reason in missing.items():
        if reason is not None:
            assert f"torch {torch.__version__}" in reason and "torchao" in reason
            with pytest.raises(NotImplementedError, match=f"recipe '{recipe}' cannot run here"):
                fp8.to_recipe(torch.nn.Linear(32, 32), recipe)


def test_emulated_training_recipes_are_deterministic_and_track_fp32():
    recipes = [r for r in fp8.RECIPES if fp8.recipe_unavailable(r) is None]  # the test above covers the others
    runs = {r: fp8.train_recipe(r, steps=6, batch=4) for r in recipes}
    for r in set(recipes) - {"fp32", "bf16"}:
        assert fp8.train_recipe(r, steps=6, batch=4) == runs[r]  # bit-for-bit on CPU
    for r, losses in runs.items():
        assert losses[-1] < losses[0], r  # every recipe learns
        assert abs(losses[-1] - runs["fp32"][-1]) < 0.05, r
    assert all(runs[r] != runs["fp32"] for r in set(recipes) - {"fp32"})  # the casts really happen


def test_to_recipe_swaps_the_linear_layers():
    from ampcourse.models import make_model
    m = fp8.to_recipe(make_model("transformer"), "float8")
    assert type(m.blocks[0].qkv).__name__ == "Float8Linear"
    if fp8.recipe_unavailable("mxfp8") is None:
        mx = fp8.to_recipe(make_model("transformer"), "mxfp8")
        assert type(mx.blocks[0].qkv.weight).__name__ == "MXFP8TrainingWeightWrapperTensor"
    with pytest.raises(ValueError, match="unknown recipe 'fp4'"):
        fp8.to_recipe(m, "fp4")
    with pytest.raises(ValueError, match="even int"):
        fp8.train_recipe("fp32", batch=3)


def test_element_formats_come_from_the_formats_registry(monkeypatch):
    assert fp8.element_formats() == ["fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "fp6_e2m3", "fp6_e3m2", "fp4_e2m1"]
    # a format added to the registry reaches scaled quantization and its error message without another edit
    monkeypatch.setitem(formats.FORMATS, "fp5_e2m2", formats.FormatSpec("fp5_e2m2", 2, 2, has_inf=False,
                                                                         saturates=True, has_nan=False))
    assert "fp5_e2m2" in fp8.element_formats()
    assert quantize_scaled(torch.ones(1, 32), "fp5_e2m2", "mx").element == "fp5_e2m2"
    with pytest.raises(ValueError, match="fp5_e2m2"):
        quantize_scaled(torch.ones(1, 32), "fp8_e8m0", "mx")


# --- torchao side by side: agreement away from the edges, and each edge where torchao departs from the rule ---

def need_torchao() -> None:
    """Skip, naming why, where torchao's MX classes cannot be imported (fp8.torchao_unavailable)."""
    reason = fp8.torchao_unavailable()
    if reason is not None:
        pytest.skip(reason)


@pytest.mark.parametrize("element", list(TORCHAO_ELEMENTS))
@pytest.mark.parametrize("rounding", ["floor", "rceil"])
def test_torchao_quantize_agrees_on_ordinary_tensors(element, rounding):
    need_torchao()
    for seed in range(2):
        x = sample(8, 256, seed=seed + 10, outlier=300.0)
        ours = quantize_scaled(x, element, "mx", mx_rounding=rounding)
        values, scales = fp8.torchao_quantize(x, element, "mx", mx_rounding=rounding)
        assert torch.equal(ours.values, values) and torch.equal(ours.scales, scales), (element, rounding, seed)


def test_torchao_nvfp4_agrees_off_ties():
    need_torchao()
    x = sample(16, 256, seed=3, outlier=40.0)
    ours = quantize_scaled(x, "fp4_e2m1", "nvfp4")
    values, scales = fp8.torchao_quantize(x, "fp4_e2m1", "nvfp4")
    assert torch.equal(ours.values, values) and torch.equal(ours.scales, scales)


def edge(name: str) -> fp8.EdgeCase:
    """One of fp8.mx_edge_cases() by the start of its name."""
    return next(c for c in fp8.mx_edge_cases() if c.name.startswith(name))


def both(case: fp8.EdgeCase):
    """Ours (a Quantized) and torchao's (values, scales) for one edge case."""
    ours = quantize_scaled(case.x, case.element, case.granularity, mx_rounding=case.mx_rounding)
    return ours, fp8.torchao_quantize(case.x, case.element, case.granularity, mx_rounding=case.mx_rounding)


def test_edge_floor_scale_2_pow_minus_127_torchao_halves():
    need_torchao()
    case = edge("FLOOR, scale 2**-127")
    ours, (values, scales) = both(case)
    x = case.x.double()
    assert ours.scales.item() == scales.item() == 2.0**-127
    vals, _ = ocp_mx_reference(case.x, "fp8_e4m3")  # the spec's algorithm in Python floats
    assert np.array_equal(ours.values.numpy(), vals) and torch.equal(ours.values, x)  # e4m3 holds x / 2**-127 exactly
    assert torch.equal(values, x / 2)  # torchao divided by 2**-126 and multiplied back by 2**-127


def test_edge_rceil_scale_2_pow_minus_127_torchao_flushes():
    need_torchao()
    case = edge("RCEIL, scale 2**-127")
    ours, (values, scales) = both(case)
    assert ours.scales.item() == scales.item() == 2.0**-127
    assert torch.equal(ours.values, case.x.double()) and ours.underflowed == 0
    assert torch.count_nonzero(values) == 0


def test_edge_rceil_one_ulp_above_a_boundary_torchao_rounds_down():
    need_torchao()
    case = edge("RCEIL, amax one ulp above")
    ours, (values, scales) = both(case)
    amax = case.x.abs().max().double()
    assert amax > 448 * scales.item()  # torchao's scale leaves the top value above 448: it saturates
    assert ours.scales.item() == 2 * scales.item() and ours.saturated == 0
    assert values[0, 0].item() == 448 * scales.item() == ours.values[0, 0].item()  # the top value ends equal
    assert ours.values[0, 1].item() == 512.0 and values[0, 1].item() == 640.0  # the small ones do not: one subnormal bit


def test_edge_nvfp4_ties_torchao_rounds_away_from_even_from_0_18():
    """torchao 0.18 multiplies by the scale's float32 reciprocal and rounds these ties away from even; 0.17 (torch
    2.11's) still divides and agrees with the rule (measured on the 2.11 leg): torchao_departs says which."""
    need_torchao()
    import torchao
    case = edge("NVFP4, exact ties")
    ours, (values, scales) = both(case)
    s = ours.scales.item()
    assert s == scales.item() == 0.9375
    assert (ours.values[0, :4] / s).tolist() == [6.0, 2.0, 1.0, 4.0]  # ties to even (2.5, 1.25, 5 -> 2, 1, 4)
    from_0_18 = tuple(int(p) for p in torchao.__version__.split(".")[:2]) >= (0, 18)
    assert fp8.torchao_departs(case) == from_0_18
    assert (values[0, :4] / s).tolist() == ([6.0, 3.0, 1.5, 6.0] if from_0_18 else [6.0, 2.0, 1.0, 4.0])


def test_mx_exponents_are_exact_at_every_boundary():
    # floor(log2) and the round-up exponent by frexp: a float64 log2 would round 2**k * (1 - 2**-53) to k
    for k in [-100, -3, 0, 5, 60]:
        below = torch.full((1, 32), 2.0**k * (1 - 2.0**-53), dtype=torch.float64)
        assert quantize_scaled(below, "fp8_e4m3", "mx").scales.item() == 2.0 ** (k - 1 - 8)
        at = torch.full((1, 32), 448 * 2.0**k, dtype=torch.float64)
        above = torch.full((1, 32), 448 * 2.0**k * (1 + 2.0**-52), dtype=torch.float64)
        assert quantize_scaled(at, "fp8_e4m3", "mx", mx_rounding="rceil").scales.item() == 2.0**k
        assert quantize_scaled(above, "fp8_e4m3", "mx", mx_rounding="rceil").scales.item() == 2.0 ** (k + 1)


def test_torchao_quantize_refuses_what_torchao_does_not_take():
    need_torchao()
    with pytest.raises(ValueError, match="'mx' or 'nvfp4'"):
        fp8.torchao_quantize(torch.ones(1, 32), "fp8_e4m3", "row")
    with pytest.raises(ValueError, match="fp4_e2m1 elements"):
        fp8.torchao_quantize(torch.ones(1, 16), "fp8_e4m3", "nvfp4")
    with pytest.raises(ValueError, match="MX elements"):
        fp8.torchao_quantize(torch.ones(1, 32), "bf16", "mx")


@pytest.mark.parametrize("capability, name", [((8, 0), "NVIDIA A100-SXM4-80GB"), ((7, 5), "Tesla T4")])
def test_scaled_matmul_on_a_gpu_without_fp8_units_names_the_gpu_and_the_fix(monkeypatch, capability, name):
    """CUDA's _scaled_mm has no kernel below compute capability 8.9: a clear refusal, not cuBLAS's error.

    Fake CUDA tensors (FakeTensorMode holds no data) and a pretended device stand in for the GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    with FakeTensorMode():
        a, b = torch.empty(16, 16, device="cuda"), torch.empty(16, 16, device="cuda")
    for granularity in ("tensor", "row"):
        with pytest.raises(NotImplementedError, match=rf"{name} \(compute capability {capability[0]}\.{capability[1]}\) "
                                                      r"has no fp8 tensor cores.*8\.9 or later"):
            fp8.scaled_matmul(a, b, granularity)
