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
    """Round float32 values through torch's dtype cast and back to float64.

    Before torch 2.13 a cast to float8_e4m3fn gives NaN where it should saturate (values that round past
    448, and +-inf); there the expected result is the OCP rule's +-448, which quantize implements on every
    torch, and test_torch_e4m3_cast_overflow_follows_the_version checks what the cast itself does.
    """
    t = torch.from_numpy(np.asarray(x, np.float32)).to(TORCH_DTYPES[name])
    out = t.to(torch.float64).numpy()
    if name == "fp8_e4m3" and not formats.torch_e4m3_cast_saturates():
        with np.errstate(invalid="ignore"):  # signalling NaNs among the random float32 bit patterns
            x64 = np.asarray(x, np.float32).astype(np.float64)
        a = np.abs(x64)
        past = np.isnan(out) & ~np.isnan(a) & (formats._round_unbounded(np.where(np.isfinite(a), a, 0.0), spec(name)) > 448)
        past |= np.isinf(a)
        out = np.where(past, np.copysign(448.0, x64), out)
    return out


def test_torch_e4m3_cast_overflow_follows_the_version():
    """From torch 2.13 the eager cast saturates (as quantize does on every torch); before, it gives NaN."""
    big = torch.tensor([500.0, 1e5, math.inf, -math.inf])
    got = big.to(torch.float8_e4m3fn).float().tolist()
    if formats.torch_version() >= (2, 13):
        assert formats.torch_e4m3_cast_saturates() and got == [448.0, 448.0, 448.0, -448.0]
    else:
        assert not formats.torch_e4m3_cast_saturates() and all(math.isnan(v) for v in got), got
    assert quantize(big, "fp8_e4m3").tolist() == [448.0, 448.0, 448.0, -448.0]  # ours saturates on every torch
    # values that round down to 448 are fine on every torch
    assert torch.tensor([460.0]).to(torch.float8_e4m3fn).float().item() == 448.0


def test_the_saturation_answer_is_a_probe_of_the_device_not_the_version(monkeypatch):
    """A GPU's cast is its own kernel: the answer comes from casting there, whatever the version says."""
    formats._e4m3_cast_saturates.cache_clear()
    try:
        monkeypatch.setattr(formats, "torch_version", lambda: (2, 6))  # a version says NaN; this torch's cast decides
        assert formats.torch_e4m3_cast_saturates("cpu") == (torch.tensor([1e6]).to(torch.float8_e4m3fn).item() == 448)
        assert formats.torch_e4m3_cast_saturates(torch.device("cpu")) == formats.torch_e4m3_cast_saturates()
    finally:
        formats._e4m3_cast_saturates.cache_clear()


def test_fnuz_casts_still_give_nan_past_their_range():
    """float8_e4m3fnuz (MI300's e4m3: max 240, no inf) did not change with e4m3fn's saturation (2.11-2.15, CPU)."""
    got = torch.tensor([240.0, 250.0, 448.0, 1e6]).to(torch.float8_e4m3fnuz).float().tolist()
    assert got[0] == 240.0 and all(math.isnan(v) for v in got[1:]), got


@pytest.mark.parametrize("name", ["fp32", "bf16"])
def test_integers_beyond_2_53_round_once(name):
    """float64 holds 53 bits: converting first and rounding again lands on the wrong side of a tie."""
    p, e = spec(name).mantissa_bits + 1, 60
    n = 2**e + 2 ** (e - p) + 1  # a tie in the format plus 1, which float64 drops: must round up
    want = 2.0**e + 2.0 ** (e - p + 1)
    assert quantize(n, name) == want and quantize([n, -n], name).tolist() == [want, -want]
    assert quantize(np.array([n]), name)[0] == want and quantize(torch.tensor([n]), name)[0] == want
    assert decompose(n, name).value == want
    assert quantize(2**e, name) == 2.0**e and quantize(True, name) == 1.0  # exact ones and bools unchanged


def test_integers_beyond_2_53_match_torch_int64_to_fp32():
    """torch casts int64 to float32 directly (to bf16 it goes through float32, rounding twice: not compared)."""
    ints = [2**53 + 1, 2**60 + 2**36 + 1, -(2**62 + 2**39 + 3), 2**63 - 1, 3, 2**54 + 2**30 + 2**29]
    want = torch.tensor(ints, dtype=torch.int64).to(torch.float32).double().numpy()
    assert same(quantize(ints, "fp32"), want) and same(quantize(np.array(ints), "fp32"), want)


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



def test_ulp_rounds_x_first_and_keeps_the_binade_spacing_at_max():
    """ulp is the spacing at |x| rounded to the format: a value that rounds up to a power of two gets the binade above."""
    assert formats.ulp(2047.9, "fp16") == 2.0  # stored as 2048: the spacing above 2048, not the 1.0 below it
    assert formats.ulp(0.99999, "fp16") == 2.0**-10  # stored as 1.0
    h = torch.tensor(65504.0, dtype=torch.float16)
    below = torch.nextafter(h, torch.tensor(0.0, dtype=torch.float16)).item()
    assert math.isinf(torch.nextafter(h, torch.tensor(math.inf, dtype=torch.float16)).item())  # no next value up
    assert formats.ulp(65504.0, "fp16") == 65504.0 - below == 32.0  # the docstring's convention at max
    assert (formats.ulp(1.0, "fp16"), formats.ulp(2047.9, "fp16"), formats.ulp(65504.0, "fp16")) == (0.0009765625, 2.0, 32.0)
    # everywhere below max: the gap to torch.nextafter's next fp16 value up, from x's fp16 rounding
    for x in (2047.9, 0.99999, 1.0, 3.0, 6.1e-5, 2.0**-20, 0.0, -7.0, 65000.0):
        r = torch.tensor(abs(x), dtype=torch.float32).to(torch.float16)
        up = torch.nextafter(r, torch.tensor(math.inf, dtype=torch.float16))
        assert formats.ulp(x, "fp16") == (up.float() - r.float()).item(), x


@pytest.mark.parametrize("bad", [None, [1.0, None], [[1.0, 2.0], [3.0, None]], "1.5", ["1", 2], b"1",
                                 np.array([1.0, None], dtype=object), {"a": 1}])
def test_quantize_rejects_non_numbers(bad):
    """numpy reads None as NaN and '1.5' as 1.5: quantize says these are not numbers (decompose already did)."""
    with pytest.raises(ValueError, match="must be real numbers"):
        quantize(bad, "fp16")
    with pytest.raises(ValueError):
        formats.ulp(bad, "fp16")


def test_quantize_still_accepts_every_kind_of_real_number():
    from fractions import Fraction
    assert quantize([torch.tensor(1.0), torch.tensor(2.0)], "fp16").tolist() == [1.0, 2.0]
    assert quantize(np.array([1, 2], dtype=object), "fp16").tolist() == [1.0, 2.0]
    assert quantize([2**60 + 1, 3], "bf16").tolist() == [2.0**60, 3.0]  # big ints still rounded once
    assert quantize(Fraction(1, 2), "fp16") == 0.5 and quantize([True, 2.0], "fp16").tolist() == [1.0, 2.0]
    assert quantize([1.0001, 70000.0], "fp16").tolist() == [1.0, math.inf]  # the docstring's example
    assert math.isnan(quantize([math.nan, 1.0], "fp16")[0])  # a NaN given is a number: it stays NaN

# --- The OCP MX formats (e8m0 scale, fp6, fp4) against ml_dtypes, an independent implementation ---

#: our name -> ml_dtypes' dtype name; looked up when a test runs (ml_dtype below), so a missing ml_dtypes skips
#: only the tests that need it, not this whole module
NARROW = {
    "fp8_e8m0": "float8_e8m0fnu",
    "fp6_e2m3": "float6_e2m3fn",
    "fp6_e3m2": "float6_e3m2fn",
    "fp4_e2m1": "float4_e2m1fn",
}


def ml_dtype(name: str):
    """ml_dtypes' dtype for one of our narrow formats (a skip naming ml_dtypes when it is not installed)."""
    return getattr(pytest.importorskip("ml_dtypes"), NARROW[name])


E8M0_QUIRK = (2.0**-127, 2.0**-126)  # open interval where ml_dtypes and torch round up (formats docstring)


def outside_e8m0_quirk(x: np.ndarray) -> np.ndarray:
    """x without the values strictly inside E8M0_QUIRK (and their negatives)."""
    a = np.abs(np.asarray(x, np.float64))
    return np.asarray(x)[~((a > E8M0_QUIRK[0]) & (a < E8M0_QUIRK[1]))]


def ml_cast(x: np.ndarray, name: str) -> np.ndarray:
    """Round through ml_dtypes' cast and back to float64."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(x).astype(ml_dtype(name)).astype(np.float64)


def every_value(name: str) -> np.ndarray:
    """Every bit pattern of the format (ml_dtypes stores one value per byte) as float64."""
    bits = spec(name).bits
    return np.arange(2**bits, dtype=np.uint8).view(ml_dtype(name)).astype(np.float64)


def probes(name: str) -> np.ndarray:
    """Every value, each halfway point between neighbours, the float32 numbers either side, and far points."""
    v = every_value(name)
    v = np.unique(v[np.isfinite(v)])
    mid = (v[:-1] + v[1:]) / 2  # exact in float32: these formats have at most 4 significant bits
    f32 = np.concatenate([v, mid]).astype(np.float32)
    near = np.concatenate([np.nextafter(f32, np.float32(-np.inf)), np.nextafter(f32, np.float32(np.inf))])
    f = spec(name)
    far = [f.max * 1.5, f.max * 1.25, f.max * 1.0001, f.min_subnormal / 2, f.min_subnormal / 3,
           f.min_subnormal * 0.5001, 1e30, 1e-30, 3e38, 1e-45]
    far = np.array(far + [-p for p in far], np.float32)
    return np.concatenate([f32, near, far]).astype(np.float64)


def test_names_lists_the_narrow_formats_only_when_asked():
    assert formats.names() == ["fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2"]
    assert formats.names(narrow=True)[5:] == list(NARROW)


@pytest.mark.parametrize("name", list(NARROW))
def test_narrow_spec_matches_ml_dtypes_finfo(name):
    f, fi = spec(name), pytest.importorskip("ml_dtypes").finfo(ml_dtype(name))
    assert (f.bits, f.max, f.min_normal, f.eps) == (fi.bits, float(fi.max), float(fi.smallest_normal), float(fi.eps))
    assert f.min_subnormal == float(fi.smallest_subnormal)
    assert float(fi.min) == (-f.max if f.signed else f.min_normal)


def test_narrow_format_facts():
    assert [spec(n).max for n in ("fp6_e2m3", "fp6_e3m2", "fp4_e2m1")] == [7.5, 28.0, 6.0]
    e8 = spec("e8m0")
    assert (e8.bits, e8.bias, e8.min_normal, e8.max) == (8, 127, 2.0**-127, 2.0**127)
    assert spec("e2m1").min_subnormal == 0.5 and spec(torch.float8_e8m0fnu) is e8
    assert spec("fp6_e2m3").torch_dtype is None and e8.torch_dtype == torch.float8_e8m0fnu


@pytest.mark.parametrize("name", list(NARROW))
def test_quantize_fixes_every_bit_pattern(name):
    v = every_value(name)
    assert same(quantize(v, name), v)


@pytest.mark.parametrize("name", list(NARROW))
@pytest.mark.parametrize("width", [np.float32, np.float64])
def test_quantize_matches_ml_dtypes_on_halfway_points_and_neighbours(name, width):
    x = probes(name).astype(width)
    if name == "fp8_e8m0":
        x = outside_e8m0_quirk(x)
    got, want = quantize(x, name), ml_cast(x, name)
    bad = [(float(a), float(g), float(w)) for a, g, w in zip(x, got, want) if not same([g], [w])]
    assert not bad, f"(x, ours, ml_dtypes) differ: {bad[:10]}"


@pytest.mark.parametrize("name", list(NARROW))
def test_quantize_matches_ml_dtypes_on_random_float32(name):
    x = random_values(200_000, seed=len(name) + 7)
    x = outside_e8m0_quirk(x[np.isfinite(x)])
    assert same(quantize(x, name), ml_cast(x, name))


def test_e8m0_matches_torch_cast_on_positive_values():
    with np.errstate(over="ignore", invalid="ignore"):
        x = np.concatenate([probes("fp8_e8m0"), random_values(200_000, seed=11)]).astype(np.float32)
    x = outside_e8m0_quirk(x[(x > 0) & np.isfinite(x)])
    got = quantize(x, "fp8_e8m0")
    want = torch.from_numpy(x).to(torch.float8_e8m0fnu).to(torch.float64).numpy()
    assert same(got, want)


def test_e8m0_convention_differences_from_torch_are_the_documented_ones():
    # ours and ml_dtypes: zero and negatives have no encoding -> NaN; torch: 0 -> 2**-127, -x -> |x|
    x = np.array([0.0, -0.0, -3.0, -1e-40, np.inf, np.nan], np.float32)
    ours = quantize(x, "fp8_e8m0")
    torch_out = torch.from_numpy(x).to(torch.float8_e8m0fnu).to(torch.float64).numpy()
    assert np.isnan(ours).all() and same(ours, ml_cast(x, "fp8_e8m0"))
    assert torch_out[:4].tolist() == [2.0**-127, 2.0**-127, 4.0, 2.0**-127]
    assert np.isnan(torch_out[4:]).all()


def test_e8m0_quirk_below_2_to_minus_126_is_the_documented_one():
    # strictly between 2**-127 and 2**-126, ml_dtypes and torch round up; we round to nearest
    x = np.array([2.0**-127 * k for k in (1.0, 1.0001, 1.25, 1.4999, 1.5, 1.75)], np.float32)
    ours = quantize(x, "fp8_e8m0")
    theirs = torch.from_numpy(x).to(torch.float8_e8m0fnu).to(torch.float64).numpy()
    assert ours.tolist() == [2.0**-127] * 4 + [2.0**-126] * 2
    assert theirs.tolist() == [2.0**-127] + [2.0**-126] * 5 and same(theirs, ml_cast(x, "fp8_e8m0"))


def test_e8m0_rounds_to_the_nearest_power_ties_up_and_never_to_zero():
    x = [1.5, 1.49, 3.0, 5.0, 6.0, 2.0**-130, 2.0**127 * 1.49, 2.0**127 * 1.5]
    got = quantize(x, "e8m0")
    assert got[:7].tolist() == [2.0, 1.0, 4.0, 4.0, 8.0, 2.0**-127, 2.0**127] and math.isnan(got[7])


def test_fp6_fp4_saturate_and_have_no_nan():
    for name in ("fp6_e2m3", "fp6_e3m2", "fp4_e2m1"):
        m = spec(name).max
        assert quantize([1e9, np.inf, -np.inf], name).tolist() == [m, m, -m]
        assert ml_cast(np.array([np.inf]), name)[0] == m
        # documented difference: ml_dtypes turns NaN into -0.0; we keep NaN so it is not hidden
        assert math.isnan(quantize([np.nan], name)[0]) and ml_cast(np.array([np.nan]), name)[0] == 0.0
        with pytest.raises(ValueError, match=f"{name} cannot encode"):
            decompose(float("nan"), name)


def test_fp4_cast_is_not_available_in_torch_on_cpu():
    # why the fp4 checks use ml_dtypes only: torch's fp4 dtype packs two values per byte, with no cast
    with pytest.raises((NotImplementedError, RuntimeError)):
        torch.tensor([1.0, 2.0]).to(torch.float4_e2m1fn_x2)


@pytest.mark.parametrize("name", list(NARROW))
def test_decompose_rebuilds_every_bit_pattern(name):
    f = spec(name)
    for bits, v in enumerate(every_value(name)):
        if math.isnan(v):
            d = decompose(v, name)
            assert d.kind == "nan" and d.exponent == 2**f.exponent_bits - 1 and not f.signed
            continue
        d = decompose(float(v), name)
        word = (d.sign << (f.exponent_bits + f.mantissa_bits)) | (d.exponent << f.mantissa_bits) | d.mantissa
        assert word == bits and d.value == v, (name, bits, d)
        assert d.bits.replace(" ", "") == format(bits, f"0{f.bits}b")
        if d.kind in ("normal", "subnormal"):
            lead = 1 if d.kind == "normal" else 0
            assert (-1) ** d.sign * (lead + d.mantissa / 2**f.mantissa_bits) * 2.0**d.power == v


def test_decompose_narrow_overflow_flags():
    s = decompose(100.0, "fp4_e2m1")
    assert (s.value, s.overflow, s.kind, s.bits) == (6.0, True, "normal", "0 11 1")
    e = decompose(2.0**128, "fp8_e8m0")
    assert (e.kind, e.overflow, e.bits) == ("nan", True, "11111111")
    one = decompose(1.0, "e8m0")
    assert (one.exponent, one.bits, one.power, one.overflow) == (127, "01111111", 0, False)
