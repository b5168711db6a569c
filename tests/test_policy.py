"""ampcourse.policy: per-module precision inside autocast, without touching names or state_dict."""

import copy

import pytest
import torch
import torch.nn as nn

from ampcourse.device import pick
from ampcourse.models import make_task
from ampcourse.policy import apply_policy, cast_floats, policy_of, precision_report, remove_policy


@pytest.fixture
def mlp():
    task = make_task("mlp", n=16)
    return task.model, task.data[:8][0]


def test_policy_keeps_the_head_in_fp32(mlp):
    model, x = mlp
    amp = pick("cpu", "bf16")
    before = precision_report(model, x, amp=amp)
    assert before["net.4"] == torch.bfloat16 and before["net.0"] == torch.bfloat16
    keys = list(model.state_dict())
    assert apply_policy(model, {"net.4": "fp32"}) == {"net.4": "fp32"}
    after = precision_report(model, x, amp=amp)
    assert after["net.4"] == torch.float32 and after["net.0"] == torch.bfloat16
    assert list(model.state_dict()) == keys
    # the fp32 head computes exactly what an fp32 layer computes on the (bf16) hidden activations
    with amp.autocast():
        hidden = model.net[:4](x)
        out = model.net[4](hidden)
    assert torch.equal(out, nn.functional.linear(hidden.float(), model.net[4].weight, model.net[4].bias))


def test_rules_by_class_and_glob_later_rules_win(mlp):
    model, x = mlp
    chosen = apply_policy(model, {nn.Linear: "fp32", "net.2": "bf16"})
    assert chosen == {"net.0": "fp32", "net.2": "bf16", "net.4": "fp32"} == policy_of(model)
    report = precision_report(model, x, amp=pick("cpu", "fp16"))
    assert report["net.2"] == torch.bfloat16 and report["net.0"] == torch.float32


def test_policy_survives_deepcopy_and_backward(mlp):
    model, x = mlp
    apply_policy(model, {"net.4": "fp32"})
    clone = copy.deepcopy(model)
    with torch.no_grad():
        clone.net[4].weight.zero_()
        clone.net[4].bias.zero_()
    with pick("cpu", "bf16").autocast():
        assert clone(x).abs().sum() == 0 and model(x).abs().sum() > 0  # the copy runs its own weights
        model(x).float().sum().backward()
    assert model.net[4].weight.grad.dtype == torch.float32


def test_remove_policy(mlp):
    model, x = mlp
    apply_policy(model, {"net.*": "fp32"})
    remove_policy(model)
    assert policy_of(model) == {} and "forward" not in model.net[4].__dict__
    assert precision_report(model, x, amp=pick("cpu", "bf16"))["net.4"] == torch.bfloat16


def test_bad_rules(mlp):
    model, _ = mlp
    with pytest.raises(ValueError, match="match no module"):
        apply_policy(model, {"head": "fp32"})
    with pytest.raises(ValueError, match="unknown precision"):
        apply_policy(model, {"net.4": "fp12"})
    with pytest.raises(ValueError, match="rule"):
        apply_policy(model, {4: "fp32"})


def test_cast_floats():
    out = cast_floats((torch.ones(1, dtype=torch.half), [torch.ones(1, dtype=torch.long)], {"a": torch.ones(1)}, 3), torch.float32)
    assert out[0].dtype == torch.float32 and out[1][0].dtype == torch.long and out[2]["a"].dtype == torch.float32 and out[3] == 3
