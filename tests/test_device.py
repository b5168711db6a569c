"""ampcourse.device: one place picks device, dtype and scaler, with a CPU fallback."""

import pytest
import torch

from ampcourse import device
from ampcourse.device import parse_precision, pick


@pytest.mark.parametrize("flags", [{"avx2", "amx_bf16", "amx_tile"}, {"avx2", "avx512f", "avx512_bf16"}])
def test_a_cpu_with_bf16_units_defaults_to_bf16_without_scaler(monkeypatch, flags):
    monkeypatch.setattr(device, "cpu_flags", lambda: frozenset(flags))
    amp = pick("cpu")
    assert amp.device == torch.device("cpu")
    assert (amp.precision, amp.amp_dtype, amp.use_scaler, amp.enabled, amp.native) == ("bf16", torch.bfloat16, False, True, True)
    assert amp.summary().endswith("expect AMP to be faster here")


@pytest.mark.parametrize("flags,seen", [({"avx", "avx2", "fma"}, "flags: avx2, avx"), (set(), "no CPU flags readable here")])
def test_a_cpu_without_bf16_units_defaults_to_fp32_and_says_why(monkeypatch, flags, seen):
    """Issue 20 erratum 8: on an AVX2-only CPU emulated bf16 is 10-200x slower than fp32: fp32 is the honest default."""
    monkeypatch.setattr(device, "cpu_flags", lambda: frozenset(flags))
    amp = pick("cpu")
    assert (amp.precision, amp.enabled, amp.use_scaler) == ("fp32", False, False)
    assert amp.summary() == (f"cpu ({device.platform.machine() or 'unknown'}), fp32 (autocast off, no GradScaler): this "
                             f"CPU has no AMX or AVX512-BF16 units ({seen}), so bf16 matmuls would be emulated, 10-200x "
                             "slower than fp32; pick(precision='bf16') runs autocast anyway")
    asked = pick("cpu", "bf16")  # an explicit request still runs, marked slow
    assert asked.precision == "bf16" and not asked.native and asked.summary().endswith("expect AMP to be slower here")
    assert "AMX" not in pick("cpu", "fp32").summary()  # an explicit fp32 needs no excuse


def test_amp_asks_for_the_devices_autocast_dtype_fast_or_not(monkeypatch):
    """What a chapter needs to show autocast on any CPU; on GPUs the same as the default."""
    monkeypatch.setattr(device, "cpu_flags", lambda: frozenset({"avx2"}))
    assert pick("cpu", "amp").precision == "bf16" and pick("cpu", " AMP ").precision == "bf16"
    _fake_gpu(monkeypatch, (7, 5), "Tesla T4")
    assert pick("cuda", "amp").precision == "fp16" == pick("cuda").precision


def test_auto_picks_cpu_when_no_gpu(monkeypatch):  # noqa: D103
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert pick().device.type == "cpu"
    assert pick("auto").device.type == "cpu"


@pytest.mark.parametrize("name,canonical", [("fp16", "fp16"), ("half", "fp16"), ("BF16", "bf16"),
                                            (torch.bfloat16, "bf16"), ("float32", "fp32"), (torch.float32, "fp32")])
def test_parse_precision(name, canonical):
    assert parse_precision(name) == canonical


@pytest.mark.parametrize("bad", ["fp64", "int8", "", torch.float64, 16])
def test_parse_precision_rejects_with_the_allowed_names(bad):
    with pytest.raises(ValueError, match="choose one of fp32, fp16, bf16"):
        parse_precision(bad)


def test_fp16_on_cpu_uses_a_scaler_and_autocasts():
    amp = pick("cpu", "fp16")
    assert amp.use_scaler
    scaler = amp.make_scaler()
    assert scaler.is_enabled() and scaler.get_scale() == 2.0**16
    lin = torch.nn.Linear(4, 4)
    with amp.autocast():
        assert lin(torch.randn(2, 4)).dtype == torch.float16
    with amp.autocast(enabled=False):
        assert lin(torch.randn(2, 4)).dtype == torch.float32


def test_fp32_disables_autocast_and_scaler():
    amp = pick("cpu", "fp32")
    assert not amp.enabled and amp.amp_dtype is None
    assert not amp.make_scaler().is_enabled()
    lin = torch.nn.Linear(4, 4)
    with amp.autocast():
        assert lin(torch.randn(2, 4)).dtype == torch.float32
    assert "fp32 (autocast off" in amp.summary()


def test_bf16_scaler_is_disabled_because_bf16_needs_none():
    assert not pick("cpu", "bf16").make_scaler().is_enabled()


def test_summary_says_what_to_expect(monkeypatch):
    monkeypatch.setattr(device, "cpu_flags", lambda: frozenset({"avx2"}))
    slow = pick("cpu", "bf16")
    assert not slow.native
    assert slow.summary().endswith("no native bf16 units: expect AMP to be slower here")
    monkeypatch.setattr(device, "cpu_flags", lambda: frozenset({"avx2", "amx_bf16"}))
    fast = pick("cpu", "bf16")
    assert fast.native and "AMX bf16 tiles: expect AMP to be faster here" in fast.summary()


def test_cuda_requested_without_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="CUDA is not available"):
        pick("cuda")


@pytest.mark.parametrize("bad", ["tpu", "gpu0", "meta"])
def test_unknown_device_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="device"):
        pick(bad)


def _fake_gpu(monkeypatch, capability: tuple[int, int], name: str, count: int = 1) -> None:
    """Pretend CUDA has `count` GPUs of this compute capability (no CUDA call reaches the driver)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    # What is_bf16_supported() says on these GPUs with its default including_emulation=True: it must not be used.
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)


@pytest.mark.parametrize("capability,name,default,scaler", [((7, 0), "Tesla V100", "fp16", True),
                                                            ((7, 5), "Tesla T4", "fp16", True),
                                                            ((8, 0), "A100", "bf16", False),
                                                            ((8, 9), "L4", "bf16", False),
                                                            ((9, 0), "H200", "bf16", False)])
def test_cuda_default_is_bf16_exactly_where_bf16_is_native(monkeypatch, capability, name, default, scaler):
    _fake_gpu(monkeypatch, capability, name)
    amp = pick()
    assert amp.device == torch.device("cuda", 0)
    assert (amp.precision, amp.use_scaler, amp.native) == (default, scaler, True)
    assert device.native_bf16("cuda") == (capability >= (8, 0))


def test_bf16_on_a_t4_runs_but_is_marked_emulated(monkeypatch):
    _fake_gpu(monkeypatch, (7, 5), "Tesla T4")
    amp = pick("cuda", "bf16")
    assert amp.precision == "bf16" and not amp.native
    assert "sm_75 < sm_80" in amp.summary() and amp.summary().endswith("expect AMP to be slower here")
    fp16 = pick("cuda", "fp16")
    assert fp16.native and fp16.use_scaler


def test_native_bf16_looks_at_the_chosen_gpu_not_the_current_one(monkeypatch):
    _fake_gpu(monkeypatch, (7, 5), "mixed", count=2)
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda device=None: (9, 0) if torch.device(device).index == 1 else (7, 5))
    assert pick("cuda:1").precision == "bf16" and pick("cuda:0").precision == "fp16"
    assert device.native_bf16("cuda:1") and not device.native_bf16("cuda:0")


def test_a_gpu_index_that_does_not_exist_is_a_clear_error(monkeypatch):
    _fake_gpu(monkeypatch, (9, 0), "H200", count=1)
    with pytest.raises(ValueError, match="there are 1 CUDA devices"):
        pick("cuda:1")


def test_native_bf16_is_false_off_cuda():
    assert not device.native_bf16("cpu")


def test_cpu_flags_can_be_pretended_for_tests(monkeypatch):
    """AMPCOURSE_CPU_FLAGS replaces /proc/cpuinfo's flags, so the chapters can be run as on another CPU."""
    from ampcourse import device
    monkeypatch.setenv(device.CPU_FLAGS_ENV, "sse4_2, avx2 fma")
    assert device.cpu_flags() == frozenset({"sse4_2", "avx2", "fma"})
    assert device.pick("cpu").precision == "fp32"
    monkeypatch.setenv(device.CPU_FLAGS_ENV, "avx2 avx512_bf16")
    assert device.pick("cpu").precision == "bf16"
