"""examine(..., policy="cuda") and --policy cuda: the doctor under CUDA's autocast lists on a CPU (emulate)."""

import json

import torch
import torch.nn as nn
import torch.nn.functional as F

from ampcourse import emulate
from ampcourse.doctor import examine
from ampcourse.doctor.cli import main


class PowNorm(nn.Module):
    """A hand-written RMSNorm with the square as pow(2): pow is on CUDA's fp32 list, not on CPU's."""

    def forward(self, h):
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)


class MatVec(nn.Module):
    """A matrix-vector product per sample (torch.mv) whose values exceed fp16's range before a rescale: mv is on
    CUDA's lower-precision list, not on CPU's."""

    def __init__(self, n, scale=2e4):
        super().__init__()
        self.scale = scale
        self.weight = nn.Parameter(torch.randn(n, n) / n ** 0.5)

    def forward(self, x):
        return torch.stack([torch.mv(self.weight * self.scale, row) for row in x]) / self.scale


def _patient(middle, n=16, gain=300.0):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, n), middle, nn.Linear(n, 4))
    with torch.no_grad():
        model[0].weight.mul_(gain)
    return model


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)


def test_a_problem_only_under_cpus_lists_is_gone_under_cudas():
    model, (x, y) = _patient(PowNorm()), _data()
    on_cpu = examine(model, x, y, loss_fn=F.cross_entropy, precisions=("fp16",))
    on_cuda = examine(model, x, y, loss_fn=F.cross_entropy, precisions=("fp16",), policy="cuda")
    assert any(f.kind == "nonfinite" and "pow" in f.message for f in on_cpu.findings)
    assert not any(f.kind == "nonfinite" for f in on_cuda.findings) and on_cuda.is_clean("fp16")
    assert (on_cpu.policy, on_cuda.policy) == ("cpu", "cuda (emulated on cpu)")
    assert "policy='cuda'" in on_cpu.notes[0] and "CUDA's autocast lists" in on_cuda.notes[0]
    assert json.loads(on_cuda.to_json())["policy"] == "cuda (emulated on cpu)"
    assert not emulate.is_active() and not torch.is_autocast_enabled("cuda")


def test_a_problem_only_under_cudas_lists_is_found_from_a_cpu():
    model, (x, y) = _patient(MatVec(16), gain=4.0), _data()
    on_cpu = examine(model, x, y, loss_fn=F.cross_entropy, precisions=("fp16",))
    on_cuda = examine(model, x, y, loss_fn=F.cross_entropy, precisions=("fp16",), policy="cuda")
    assert not any(f.kind == "nonfinite" for f in on_cpu.findings)
    assert any(f.kind == "nonfinite" and "mv" in f.message for f in on_cuda.findings)


def test_cli_policy_flag(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["--model", "mlp", "--device", "cpu", "--precisions", "bf16", "--policy", "cuda",
                 "--out", str(out)]) == 0
    assert json.loads(out.read_text())["policy"] == "cuda (emulated on cpu)"
