"""examine(..., policy="cuda") and --policy cuda: the doctor under CUDA's autocast lists on a CPU (emulate)."""

import json

import torch

from ampcourse import emulate
from ampcourse.doctor import examine
from ampcourse.doctor.cli import main

import doctor_gallery as G
from planted import Spectral


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


def test_confirmation_under_cudas_lists_trains_the_recipes_islands():
    # The confirmation's copy reads which autocast dtype it runs under to apply that recipe's islands. Under an
    # emulation torch's CPU state reads "on, bf16" in every region (the emulator's kernels sit at the CPU key), so
    # fp16's recipe (fp32 module 'mid') trained without its island: NaN at step 0, "departs", no culprit named.
    s = G.case("matvec_overflow").build(0)
    r = examine(s.model, s.inputs, s.targets, loss_fn=s.loss_fn, steps=10, policy="cuda")
    v = r.verdicts["fp16"]
    assert v["status"] == "islands" and v["fp32_modules"] == ["mid"], r.summary()
    assert v["confirmation"].status == "confirmed" and v["confirmation"].skipped == 0, r.summary()
    assert r.recommended_precision == "bf16"
    assert "fp16 needs fp32 modules 'mid'" in " ".join(r.advice), r.advice
    assert "The confirmation trained fp16 and bf16, 10 steps each beside fp32 with AdamW" in " ".join(r.advice)


def test_autocast_state_reads_the_emulated_region_for_cpu_tensors():
    assert emulate.autocast_state("cpu") == (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
    with emulate.autocast("cuda", dtype=torch.float16, enabled=False):
        assert torch.is_autocast_enabled("cpu")  # the emulator's own key: what a plain read gets wrong
        assert emulate.autocast_state("cpu") == (False, torch.float16)
        with torch.autocast("cpu", dtype=torch.float16):  # opens CUDA's region (CPU tensors stand for CUDA's)
            assert emulate.autocast_state("cpu") == (True, torch.float16)
            assert emulate.autocast_state("meta") == (True, torch.float16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert emulate.autocast_state("cpu") == (True, torch.bfloat16)
    assert emulate.autocast_state("meta")[0] is False


def test_a_departure_is_located_with_the_recipes_islands(monkeypatch):
    # Where a recipe with fp32 islands departs, the forensic pass at the departure runs with those islands, as the
    # run had them: without them it finds the islands' own overflow first (NaN from there on) and names nothing else.
    from ampcourse.doctor import confirm as C
    from ampcourse.doctor import core
    from ampcourse.policy import policy_of

    seen, forensic = [], core._examine

    def spy(model, inputs, targets, loss_fn, optimizer, dev, precs, steps):
        if steps == 0 and precs == ("fp16",):
            seen.append(policy_of(model))
        return forensic(model, inputs, targets, loss_fn, optimizer, dev, precs, steps)

    monkeypatch.setattr(core, "_examine", spy)
    monkeypatch.setattr(C, "departure", lambda loss, ref: (3, "loss", 1.0, 0.05) if len(loss) else None)
    s = G.case("matvec_overflow").build(0)
    r = examine(s.model, s.inputs, s.targets, loss_fn=s.loss_fn, precisions=("fp16",), steps=4, policy="cuda")
    assert r.verdicts["fp16"]["confirmation"].status == "departed"
    assert seen and seen[-1] == {"mid": "fp32"}, seen


class _Checkpointed(torch.nn.Module):
    """Activation checkpointing (torch.utils.checkpoint, as LLM training uses it) around each block."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU(),
                                                              torch.nn.LayerNorm(32)) for _ in range(2))
        self.head = torch.nn.Linear(32, 10)

    def forward(self, x):
        for block in self.blocks:
            x = x + torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return self.head(x)


def test_a_checkpointed_model_is_examined_under_cudas_lists():
    # was: CheckpointError "Recomputed values ... have different metadata" (the fp32 reference's blocks recomputed
    # in bf16: inside the emulation CPU's autocast state reads "on, bf16" in every region)
    torch.manual_seed(0)
    model = _Checkpointed()
    x, y = torch.randn(32, 32), torch.randint(0, 10, (32,))
    r = examine(model, x, y, loss_fn=torch.nn.functional.cross_entropy, steps=3, policy="cuda")
    assert r.policy.startswith("cuda") and r.is_clean("bf16") and r.is_clean("fp16"), r.summary()


def test_the_first_line_says_whose_autocast_lists_it_measured_under():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 10))
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
    cpu = examine(model, x, y, loss_fn=torch.nn.functional.cross_entropy, steps=0)
    cuda = examine(model, x, y, loss_fn=torch.nn.functional.cross_entropy, steps=0, policy="cuda")
    # was "AMP doctor on cpu: use ..." for both: the one a learner acts on did not say which lists it rests on
    assert cpu.headline.startswith("AMP doctor on cpu, CPU autocast's op lists: use ")
    assert cuda.headline.startswith("AMP doctor on cpu, CUDA's autocast op lists emulated: use ")
    assert cpu.summary().splitlines()[0] == cpu.headline


def test_an_op_this_cpu_has_no_low_kernel_for_is_unsupported_under_cudas_lists_not_the_models_fault():
    # CUDA's lists leave torch.fft alone, so rfft gets the Linear's fp16/bf16 output; this CPU has no such FFT
    # kernel ("Unsupported dtype Half"), which says nothing about CUDA's (cuFFT runs fp16 for powers of two). Was:
    # "refused", an error of the model with advice about -1e9 constants.
    from test_doctor_verdict import assert_consistent
    torch.manual_seed(0)
    x, y = torch.randn(64, 32), torch.randint(0, 4, (64,))
    r = examine(Spectral(), x, y, loss_fn=torch.nn.functional.cross_entropy, steps=2, policy="cuda")
    for p in ("fp16", "bf16"):
        v = r.verdicts[p]
        assert v["status"] == "unsupported", r.summary()
        assert v["reason"].startswith(f"CUDA's {p} cannot be emulated for this model on this cpu: "
                                      "`f = torch.fft.rfft(h, dim=-1)` (planted.py:"), v["reason"]
        assert "whether CUDA has one this cpu cannot tell" in v["reason"]
    assert not [f for f in r.findings if f.severity == "error"] and "-1e9" not in r.summary()
    assert r.recommended_precision == "fp32" and "no low precision could be examined here" in r.headline
    assert_consistent(r)
    on_cpu = examine(Spectral(), x, y, loss_fn=torch.nn.functional.cross_entropy, steps=2)  # CPU's lists: fft fp32
    assert on_cpu.is_clean("bf16")
