"""trial(..., policy="cuda"): the precisions' runs under CUDA's autocast lists on a CPU (ampcourse.emulate)."""

import json

import pytest
import torch

from ampcourse import emulate
from ampcourse.trial import main, trial


def test_trial_under_cudas_policy_differs_where_the_lists_differ_and_says_so():
    kw = dict(precisions=("bf16",), steps=3, device="cpu", seed=0)
    cpu = trial("transformer", **kw)
    cuda = trial("transformer", policy="cuda", **kw)
    assert cpu.config["policy"] == "cpu" and cuda.config["policy"] == "cuda (emulated on cpu)"
    assert json.loads(cuda.to_json())["config"]["policy"] == "cuda (emulated on cpu)"
    # the reference is fp32 either way; the bf16 run differs (layer_norm and softmax: bf16 on CPU, fp32 on CUDA)
    assert cpu.series["reference"]["loss"] == cuda.series["reference"]["loss"]
    assert cpu.series["bf16"]["loss"] != cuda.series["bf16"]["loss"]
    assert not emulate.is_active() and not torch.is_autocast_enabled("cuda")


def test_trial_policy_is_checked_before_any_step():
    with pytest.raises(ValueError, match="policy must be None"):
        trial("mlp", steps=1, device="cpu", policy="tpu")


def test_cli_policy_flag(tmp_path, capsys):
    out = tmp_path / "t.json"
    assert main(["--model", "mlp", "--steps", "2", "--device", "cpu", "--policy", "cuda", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["config"]["policy"] == "cuda (emulated on cpu)"


def test_one_outer_emulation_trains_on_each_steps_new_weights():
    """trial/examine run every step inside one outer emulate.autocast(enabled=False): the emulated weight-cast cache
    must be dropped when train_step clears torch's after the optimizer step (else every step reuses step 1's casts)."""
    from ampcourse import emulate
    from ampcourse.device import pick
    from ampcourse.train import train_step

    def losses(per_step: bool) -> list[float]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        x, y = torch.randn(32, 8), torch.randint(0, 2, (32,))
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        amp, scaler = pick("cpu", "bf16"), torch.amp.GradScaler("cpu", enabled=False)
        step = lambda: train_step(model, [(x, y)], torch.nn.functional.cross_entropy, opt, scaler, amp).loss
        if per_step:  # each step its own outermost region: nothing cached survives a step
            out = []
            for _ in range(4):
                with emulate.autocast("cuda", enabled=False):
                    out.append(step())
            return out
        with emulate.autocast("cuda", enabled=False):
            return [step() for _ in range(4)]

    fresh = losses(per_step=True)
    assert len(set(fresh)) == 4
    assert losses(per_step=False) == fresh
