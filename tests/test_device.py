"""ampcourse.device: one place picks device, dtype and scaler, with a CPU fallback."""

import pytest
import torch

from ampcourse import device
from ampcourse.device import parse_precision, pick


def test_cpu_defaults_to_bf16_without_scaler():
    amp = pick("cpu")
    assert amp.device == torch.device("cpu")
    assert (amp.precision, amp.amp_dtype, amp.use_scaler, amp.enabled) == ("bf16", torch.bfloat16, False, True)


def test_auto_picks_cpu_when_no_gpu(monkeypatch):
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
