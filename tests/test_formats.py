"""ampcourse.formats against numpy float16 (exhaustively) and torch's own casts."""

import math

import numpy as np
import pytest
import torch

from ampcourse import formats
from ampcourse.formats import decompose, quantize, spec

TORCH_DTYPES = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal as floats, NaN where NaN, and the same sign (NaN's sign carries no meaning)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    signs_agree = (np.signbit(a) == np.signbit(b)) | np.isnan(a)
    return bool(np.array_equal(a, b, equal_nan=True) and signs_agree.all())


def torch_cast(x: np.ndarray, name: str) -> np.ndarray:
    """Round float32 values through torch's dtype cast and back to float64."""
    t = torch.from_numpy(np.asarray(x, np.float32)).to(TORCH_DTYPES[name])
    return t.to(torch.float64).numpy()


@pytest.mark.parametrize("name", formats.names())
def test_spec_matches_torch_finfo(name):
    f, fi = spec(name), torch.finfo(TORCH_DTYPES[name])
    assert f.bits == fi.bits
    assert f.max == fi.max
    assert f.min_normal == fi.smallest_normal
    assert f.eps == fi.eps
    assert f.exponent_bits + f.mantissa_bits + 1 == f.bits


def test_fp16_facts_blog_posts_get_wrong():
    f = spec("fp16")
    assert f.max == 65504
    assert f.min_normal == 2.0**-14
    assert f.min_subnormal == 2.0**-24
    assert (f.bias, f.exponent_bits, f.mantissa_bits) == (15, 5, 10)
    assert spec("bf16").bias == 127 and spec("fp8_e4m3").max == 448 and spec("fp8_e5m2").max == 57344


def test_spec_accepts_aliases_and_dtypes():
    assert spec("half") is spec("fp16") is spec(torch.float16) is spec("FP16")
    assert spec(torch.bfloat16).name == "bf16"
    assert spec("torch.float8_e4m3fn").name == "fp8_e4m3"
    assert spec(spec("fp32")) is spec("fp32")


@pytest.mark.parametrize("bad", ["fp64", "", "float8", "int8", 16, None])
def test_spec_rejects_unknown_names_listing_valid_ones(bad):
    with pytest.raises(ValueError, match="fp16, bf16"):
        spec(bad)


def test_spec_rejects_unsupported_dtype():
    with pytest.raises(ValueError, match="unsupported dtype torch.float64"):
        spec(torch.float64)


def all_fp16_values() -> np.ndarray:
    """Every one of the 65,536 fp16 bit patterns as float64."""
    return np.arange(2**16, dtype=np.uint16).view(np.float16).astype(np.float64)


def test_quantize_fp16_fixes_every_fp16_value():
    v = all_fp16_values()
    assert same(quantize(v, "fp16"), v)


def test_quantize_fp16_matches_numpy_on_midpoints_and_neighbours():
    # For each pair of adjacent finite fp16 values: the midpoint (a tie) and points just either
    # side of it, as float64; numpy rounds float64 -> float16 once, correctly.
    v = all_fp16_values()
    v = np.unique(v[np.isfinite(v)])
    mid = (v[:-1] + v[1:]) / 2
    probes = np.concatenate([mid, np.nextafter(mid, -np.inf), np.nextafter(mid, np.inf), v * 1.5])
    probes = np.concatenate([probes, [65504 + 16, 65504 + 16.000001, 65520, 1e6, 2.0**-25, 2.0**-25 * 1.0001, 2.0**-26]])
    with np.errstate(over="ignore"):
        expected = probes.astype(np.float16).astype(np.float64)
    assert same(quantize(probes, "fp16"), expected)


def test_quantize_fp16_exhaustive_on_float32_against_torch():
    # Every fp16 value, halfway points and their float32 neighbours through torch's cast too.
    v = all_fp16_values()
    v = np.unique(v[np.isfinite(v)]).astype(np.float32)
    mid = ((v[:-1].astype(np.float64) + v[1:]) / 2).astype(np.float32)
    probes = np.concatenate([v, mid, np.nextafter(mid, np.float32(-np.inf)), np.nextafter(mid, np.float32(np.inf))])
    assert same(quantize(probes, "fp16"), torch_cast(probes, "fp16"))


def edge_cases(name: str) -> np.ndarray:  # float64; callers cast to float32 (3e38 overflows there)
    """Values at the edges of a format: max, just above, min subnormal, halfway ties."""
    f = spec(name)
    m, tiny, sub = f.max, f.min_normal, f.min_subnormal
    ulp_max = math.ldexp(1.0, f.emax - f.mantissa_bits)
    pts = [0.0, -0.0, 1.0, -1.0, m, -m, m + ulp_max / 2, m + ulp_max / 4, m + ulp_max, 2 * m, -2 * m,
           tiny, tiny / 2, sub, sub / 2, sub / 2 * 1.0001, sub * 1.5, sub * 2.5, sub / 4,
           1 + f.eps / 2, 1 + f.eps * 1.5, 1 + f.eps / 2 * 1.001, 3e38, -3e38,
           np.inf, -np.inf, np.nan]
    return np.array(pts, dtype=np.float64)


def random_values(n: int, seed: int) -> np.ndarray:
    """Float32 values spread over every exponent: random bit patterns plus log-uniform magnitudes."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 2**32, size=n // 2, dtype=np.uint64).astype(np.uint32).view(np.float32)
    mags = np.exp2(rng.uniform(-150, 128, size=n - n // 2)) * rng.choice([-1.0, 1.0], size=n - n // 2)
    with np.errstate(over="ignore"):
        return np.concatenate([bits, mags.astype(np.float32)])


@pytest.mark.parametrize("name", ["bf16", "fp8_e4m3", "fp8_e5m2", "fp16", "fp32"])
def test_quantize_matches_torch_cast_on_a_million_values(name):
    with np.errstate(over="ignore"):
        x = np.concatenate([random_values(1_000_000, seed=len(name)), edge_cases(name).astype(np.float32)])
    assert same(quantize(x, name), torch_cast(x, name))


@pytest.mark.parametrize("name", formats.names())
def test_quantize_edge_cases_against_torch(name):
    with np.errstate(over="ignore"):
        x = edge_cases(name).astype(np.float32)
    got, want = quantize(x, name), torch_cast(x, name)
    bad = [(float(a), float(g), float(w)) for a, g, w in zip(x, got, want) if not same([g], [w])]
    assert not bad, f"(x, ours, torch) differ: {bad}"


def test_quantize_ties_round_to_even():
    # 1 + eps/2 is halfway between 1 and 1 + eps: even mantissa (1.0) wins; 1 + 3eps/2 rounds up.
    for name in ["fp16", "bf16", "fp8_e4m3", "fp8_e5m2"]:
        e = spec(name).eps
        assert quantize([1 + e / 2, 1 + 1.5 * e], name).tolist() == [1.0, 1 + 2 * e]


def test_quantize_overflow_underflow_rules():
    assert quantize([70000.0, -70000.0], "fp16").tolist() == [math.inf, -math.inf]
    assert quantize([65519.99], "fp16")[0] == 65504  # below the halfway point to 65536 rounds down
    assert quantize([1e6, np.inf, -np.inf], "fp8_e4m3").tolist() == [448.0, 448.0, -448.0]  # saturates
    assert math.isnan(quantize([np.nan], "fp8_e4m3")[0])
    assert quantize([1e6], "fp8_e5m2")[0] == math.inf
    assert quantize([1e-8], "fp16")[0] == 0.0  # below half the smallest subnormal
    assert np.signbit(quantize([-1e-9], "fp16")[0])  # underflow keeps the sign: -0.0


def test_quantize_accepts_tensors_and_lists():
    t = torch.tensor([1.0001, 70000.0])
    assert quantize(t, torch.float16).tolist() == [1.0, math.inf]
    assert quantize(t.to(torch.float64), "fp16").dtype == np.float64
    assert quantize(3.0, "bf16").shape == ()


def test_decompose_fields_of_known_values():
    one = decompose(1.0, "fp16")
    assert (one.sign, one.exponent, one.mantissa, one.kind, one.bits) == (0, 15, 0, "normal", "0 01111 0000000000")
    m = decompose(65504, "fp16")
    assert (m.exponent, m.mantissa, m.kind, m.overflow) == (30, 1023, "normal", False)
    sub = decompose(2.0**-24, "fp16")
    assert (sub.exponent, sub.mantissa, sub.kind) == (0, 1, "subnormal")
    neg = decompose(-2.5, "bf16")
    assert (neg.sign, neg.exponent, neg.mantissa, neg.value) == (1, 128, 0b0100000, -2.5)


def test_decompose_reports_overflow_underflow_and_error():
    o = decompose(70000, "fp16")
    assert (o.kind, o.overflow, o.value, o.exponent, o.mantissa) == ("inf", True, math.inf, 31, 0)
    u = decompose(1e-8, "fp16")
    assert (u.kind, u.underflow, u.value) == ("zero", True, 0.0)
    r = decompose(1.0001, "fp16")
    assert r.value == 1.0 and r.rel_error == pytest.approx(1e-4 / 1.0001)
    s = decompose(500.0, "fp8_e4m3")
    assert (s.value, s.overflow, s.kind) == (448.0, True, "normal")
    n = decompose(float("nan"), "fp8_e4m3")
    assert (n.kind, n.exponent, n.mantissa) == ("nan", 15, 7)
    z = decompose(0.0, "bf16")
    assert (z.kind, z.rel_error, z.underflow) == ("zero", 0.0, False)


def test_decompose_rebuilds_its_value_for_every_fp16_pattern():
    f = spec("fp16")
    for bits in range(0, 2**16, 7):  # a stride keeps this fast; the fields are checked bit for bit
        v = float(np.array([bits], np.uint16).view(np.float16)[0])
        d = decompose(v, "fp16")
        if d.kind == "nan":
            continue
        assert (d.sign << 15) | (d.exponent << 10) | d.mantissa == bits, (bits, d)
        if d.kind in ("normal", "subnormal"):
            lead = 1 if d.kind == "normal" else 0
            rebuilt = (-1) ** d.sign * (lead + d.mantissa / 2**10) * 2.0 ** d.power
            assert rebuilt == v
    assert f.bits == 16


def test_ulp():
    assert formats.ulp(1.0, "fp16") == 2.0**-10
    assert formats.ulp(1000.0, "fp16") == 0.5
    assert formats.ulp(2.0**-20, "fp16") == 2.0**-24  # subnormal spacing is fixed
    assert formats.ulp(1.0, "bf16") == 2.0**-7
    assert math.isnan(formats.ulp(1e6, "fp16"))
