"""examine(..., policy="cuda") and --policy cuda: the doctor under CUDA's autocast lists on a CPU (emulate)."""

import json

import torch

from ampcourse import emulate
from ampcourse.doctor import examine
from ampcourse.doctor.cli import main

import doctor_gallery as G


def _examine(name: str, policy: str | None):
    """examine on gallery case name (tests/doctor_gallery.py's POLICY_DIFFERS) in fp16, forensics only (steps=0)."""
    s = G.case(name).build(0)
    return examine(s.model, s.inputs, s.targets, loss_fn=s.loss_fn, precisions=("fp16",), steps=0, policy=policy)


def test_a_problem_only_under_cpus_lists_is_gone_under_cudas():
    # h.pow(2) in an inline RMSNorm: pow is on CUDA's fp32 list, not on CPU's.
    on_cpu, on_cuda = _examine("pow_rmsnorm", None), _examine("pow_rmsnorm", "cuda")
    assert any(f.kind == "nonfinite" and f.module == "block" and f.op == "aten::pow" for f in on_cpu.findings)
    assert not any(f.kind == "nonfinite" for f in on_cuda.findings) and on_cuda.is_clean("fp16")
    assert (on_cpu.policy, on_cuda.policy) == ("cpu", "cuda (emulated on cpu)")
    assert "policy='cuda'" in on_cpu.notes[0] and "CUDA's autocast lists" in on_cuda.notes[0]
    assert json.loads(on_cuda.to_json())["policy"] == "cuda (emulated on cpu)"
    assert not emulate.is_active() and not torch.is_autocast_enabled("cuda")


def test_a_problem_only_under_cudas_lists_is_found_from_a_cpu():
    # torch.mv on an upcast vector: mv is on CUDA's lower-precision list, on none of CPU's.
    on_cpu, on_cuda = _examine("matvec_overflow", None), _examine("matvec_overflow", "cuda")
    assert not any(f.kind == "nonfinite" for f in on_cpu.findings) and on_cpu.is_clean("fp16")
    assert any(f.kind == "nonfinite" and f.module == "mid" and f.op == "aten::mv" for f in on_cuda.findings)


def test_cli_policy_flag(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["--model", "mlp", "--device", "cpu", "--precisions", "bf16", "--policy", "cuda",
                 "--out", str(out)]) == 0
    assert json.loads(out.read_text())["policy"] == "cuda (emulated on cpu)"
