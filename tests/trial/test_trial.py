"""ampcourse.trial: fp32 and AMP side by side over N steps (issue 22).

What is checked: runs are deterministic; an fp32 run against the fp32 reference has a gap of exactly zero; a
planted attention-logit growth is caught in the layer and at the step where it was planted (and nowhere else);
a healthy model is not flagged; skipped steps show in the scaler's record and in the optimizer's own counter;
only Python floats are kept; bad input gets one line that says what to pass (API and command line).
"""

import json
import math
import random
from pathlib import Path

import numpy as np

import pytest
import torch
import torch.nn as nn

from ampcourse import models, trial as trial_mod
from ampcourse.models import TinyTransformer
from ampcourse.trial import REFERENCE, Monitor, default_monitors, main, trial
from ampcourse.trial import runs as trial_runs  # where trial() reads CHUNK_BYTES
from ampcourse.trial import cli as trial_cli  # where main() calls trial()
from clirun import run_cli


class GrowingLogits(TinyTransformer):
    """The reference transformer with a planted fault: from training step `start` on, block `layer` multiplies its
    queries and keys by a factor that grows every step, so its pre-softmax logits grow (in fp32 too)."""

    def __init__(self, layer: int = 1, start: int = 6, growth: float = 8.0):
        super().__init__()
        self.calls, self.start, self.growth = 0, start, growth
        self.blocks[layer].qkv.register_forward_hook(self._grow)

    def _grow(self, module, args, out):
        k = self.calls - self.start
        if k < 0:
            return out
        d = out.shape[-1] // 3
        scale = torch.ones(3 * d, dtype=out.dtype, device=out.device)
        scale[:2 * d] = 1.0 + self.growth * (k + 1)
        return out * scale

    def forward(self, idx):
        out = super().forward(idx)
        if self.training:  # count training steps (the trial's one-batch preflight runs in eval mode)
            self.calls += 1
        return out


DATA = models.make_dataset("transformer", n=256, seed=0)


def test_fp32_against_fp32_has_a_zero_gap():
    t = trial("transformer", DATA, precisions=("fp32",), steps=8)
    s = t.series["fp32"]
    assert s["loss"] == t.series[REFERENCE]["loss"] and set(s["loss_gap"]) == {0.0}
    assert set(s["grad_norm_ratio"]) == {1.0}
    drift = t.layer_series("fp32", "drift")
    assert len(drift) == len(t.layers) == 15 and {v for vs in drift.values() for v in vs} == {0.0}
    for key in s:  # every monitor reads the same value in both runs
        if key.split("/")[0] in t.monitors:
            assert s[key] == t.series[REFERENCE][key], key
    assert t.departure("fp32") is None


def test_deterministic():
    a = trial("transformer", DATA, precisions=("bf16", "fp16"), steps=6, seed=3)
    b = trial("transformer", DATA, precisions=("bf16", "fp16"), steps=6, seed=3)
    assert a.series == b.series and a.departures == b.departures
    c = trial("transformer", DATA, precisions=("bf16", "fp16"), steps=6, seed=4)
    assert c.series[REFERENCE]["loss"] != a.series[REFERENCE]["loss"]  # the seed matters: not a constant


def test_callers_random_stream_is_left_alone():
    torch.manual_seed(123)
    want = torch.rand(3)
    torch.manual_seed(123)
    trial("transformer", DATA, steps=2)
    assert torch.equal(torch.rand(3), want)


class _HeldNoise(nn.Module):
    """Draws noise from generators it holds, in eval mode too (the trial's preflight runs the model in eval mode)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)
        self.gens = [torch.Generator().manual_seed(5), random.Random(5), np.random.default_rng(5)]

    def forward(self, x):
        torch_gen, py_gen, np_gen = self.gens
        noise = torch.rand(x.shape, generator=torch_gen) * py_gen.random() * float(np_gen.random())
        return self.fc(x + noise)


def test_the_preflight_leaves_every_stream_the_model_holds_so_fp32_and_each_precision_draw_alike():
    g = torch.Generator().manual_seed(0)
    data = (torch.randn(64, 16, generator=g), torch.randint(0, 4, (64,), generator=g))
    t = trial(_HeldNoise, data, precisions=("bf16",), steps=3, batch_size=16)
    ref, low = t.series[REFERENCE]["loss"], t.series["bf16"]["loss"]
    # bf16's own rounding: gaps below 1e-3; when the preflight drew from the reference's generators (only), every
    # step of fp32 saw other noise than bf16's: gaps of 0.03-0.05
    assert max(abs(a - b) for a, b in zip(ref, low)) < 5e-3, (ref, low)


def test_rng_kept_restores_global_and_held_streams():
    from ampcourse import _rng
    m = _HeldNoise()
    states = [_rng.stream_state(g) for g in m.gens]
    assert sorted(_rng.held_streams(m)) == ["gens[0]", "gens[1]", "gens[2]"]
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    want = (torch.rand(1), random.random(), np.random.rand())
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    with _rng.kept(m):
        m(torch.zeros(2, 16)), torch.rand(1), random.random(), np.random.rand()
    assert (torch.rand(1), random.random(), np.random.rand()) == want
    for g, s in zip(m.gens, states):
        assert repr(_rng.stream_state(g)) == repr(s)


@pytest.mark.parametrize("layer,start", [(1, 6), (0, 4)])
def test_planted_logit_growth_is_caught_at_its_layer_and_step(layer, start):
    t = trial(lambda: GrowingLogits(layer, start), DATA, precisions=("bf16", "fp16"), steps=start + 4)
    bf16, fp16 = t.departure("bf16"), t.departure("fp16")
    assert (bf16.step, bf16.series, bf16.layer) == (start, "attention_logit_max", f"blocks.{layer}")
    # fp16 keeps 3 more mantissa bits: the same logits are caught one step later (its rounding error is 1/8)
    assert (fp16.step, fp16.series, fp16.layer) == (start + 1, "attention_logit_max", f"blocks.{layer}")
    before = t.series[REFERENCE][f"attention_logit_max/blocks.{layer}"][:start]
    assert max(before) < 10 < t.series[REFERENCE][f"attention_logit_max/blocks.{layer}"][start]
    assert "departs at step" in t.summary() and str(bf16).startswith(f"bf16 departs at step {start}")
    # the attention flag is a threshold on the logit's size (|L| * u), not a measured gap to fp32: it says so
    assert bf16.by_magnitude and "|L|*u" in str(bf16) and "not a measured gap" in str(bf16)
    assert bf16.gap == pytest.approx(t.series["bf16"][f"attention_logit_max/blocks.{layer}"][start] * 2.0**-8)


def test_a_healthy_model_is_not_flagged():
    t = trial("transformer", DATA, precisions=("bf16", "fp16"), steps=60)
    assert t.departure("bf16") is None and t.departure("fp16") is None, t.summary()
    assert 0 < max(v[-1] for v in t.layer_series("bf16", "drift").values()) < t.tolerance
    assert t.series["bf16"]["loss"][-1] < t.series["bf16"]["loss"][0]  # it trained
    assert "stays within the tolerance" in t.summary()


def test_a_lower_tolerance_flags_the_same_healthy_run():
    """The departure rule can fire on a healthy run too: the tolerance is what decides."""
    t = trial("transformer", DATA, precisions=("bf16",), steps=10, tolerance=1e-4)
    assert t.departure("bf16") is not None and t.departure("bf16").gap > 1e-4


def test_skips_show_in_the_scaler_and_in_the_optimizer_counter():
    # init_scale 2**40: the first steps overflow fp16 and are skipped until the scale has come down
    t = trial("mlp", precisions=("fp16", "fp16-noscaler", "bf16"), steps=40, scaler_kwargs={"init_scale": 2.0**40})
    fp16 = t.series["fp16"]
    skipped = int(sum(fp16["skipped"]))
    assert skipped >= 10 and fp16["skipped"][0] == 1.0 and fp16["scale"][0] == 2.0**40
    assert fp16["optimizer_steps"][-1] == 40 - skipped  # optimizer.step() never ran on a skipped step
    done = [k + 1 - sum(fp16["skipped"][:k + 1]) for k in range(40)]  # steps taken so far, by the scaler's record
    assert fp16["optimizer_steps"] == done and fp16["optimizer_steps"][9] == 0.0
    assert t.series["fp16-noscaler"]["optimizer_steps"][-1] == 40 and set(t.series["bf16"]["scale"]) == {1.0}
    # the skipped steps left fp16 behind fp32 (its weights did not move): the trial sees it before the skips end
    assert t.departure("fp16") is not None and t.departure("fp16").step < skipped


def test_only_python_floats_are_kept():
    t = trial("transformer", DATA, precisions=("bf16",), steps=3)
    for run, series in t.series.items():
        for name, values in series.items():
            assert len(values) == 3 and all(type(v) is float for v in values), (run, name)
    tensors = [k for k, v in vars(t).items() if isinstance(v, (torch.Tensor, nn.Module))]
    assert not tensors


def test_user_monitor_and_activation_checkpointing_keep_one_value_per_step():
    def log_z(model):
        return [("output", model, lambda m, args, out: out.float().logsumexp(-1).abs().max())]

    monitors = [*default_monitors(), Monitor("log_z", log_z)]
    t = trial("transformer", DATA, precisions=("bf16",), steps=3, monitors=monitors)
    assert len(t.series["bf16"]["log_z/output"]) == 3 and t.series["bf16"]["log_z/output"][0] > 0
    assert "log_z" in t.monitors and "log_z" in json.loads(t.to_json())["monitors"]


def test_to_json_and_plot(tmp_path):
    t = trial("transformer", DATA, precisions=("bf16", "fp16-noscaler"), steps=3)
    path = tmp_path / "t.json"
    text = t.to_json(path)
    back = json.loads(path.read_text())
    assert json.loads(text) == back and back["series"]["bf16"]["loss"] == t.series["bf16"]["loss"]
    assert back["precisions"] == ["bf16", "fp16-noscaler"] and back["departures"]["bf16"] is None
    fig = t.plot("bf16")
    titles = [ax.get_title() for ax in fig.axes]
    assert "loss and its gap to fp32" in titles and "bf16: parameter drift per layer" in titles
    assert any("logit growth" in title for title in titles)
    import matplotlib.pyplot as plt
    plt.close(fig)


def test_non_finite_values_survive_json():
    t = trial("mlp", precisions=("fp16",), steps=2, scaler_kwargs={"init_scale": 2.0**40})
    back = json.loads(t.to_json())
    assert back["series"]["fp16"]["grad_norm"][0] in ("inf", "nan")


@pytest.mark.parametrize("kwargs,message", [
    (dict(precisions=("fp8",)), "precisions: unknown precision"),
    (dict(precisions=()), "precisions must be a non-empty sequence"),
    (dict(steps=0), "steps must be an int >= 1"),
    (dict(tolerance=-1), "tolerance must be a finite number > 0"),
    (dict(batch_size=10_000), "batch_size 10000 is larger than the dataset"),
    (dict(monitors=["attention"]), "monitors must be Monitor objects"),
    (dict(optimizer_factory="lamb"), "unknown optimizer 'lamb'"),
    (dict(scaler_kwargs={"init_scale": -1}), "init_scale"),
    (dict(data=(torch.randn(8, 16), torch.zeros(8, dtype=torch.long))), "data inputs"),
    (dict(model_factory=nn.Linear(2, 2)), "must build a fresh model"),
    (dict(model_factory="gpt"), "unknown model 'gpt'"),
    (dict(model_factory=lambda: 3), "must return an nn.Module"),
    (dict(model_factory=TinyTransformer), "data is None: pass a TensorDataset"),
    (dict(loss_fn="ce"), "loss_fn must be a callable"),
    (dict(chunk=0), "chunk must be an int >= 1"),
    # was: AttributeError: 'tuple' object has no attribute 'shape' (the course's loss on nn.LSTM's output)
    (dict(model_factory=lambda: nn.LSTM(16, 4, batch_first=True),
          data=(torch.randn(8, 3, 16), torch.zeros(8, dtype=torch.long)), batch_size=4),
     r"the model returns a tuple, not one logits tensor.*pass loss_fn="),
])
def test_bad_input_gets_one_clear_line(kwargs, message):
    args = {"model_factory": "transformer", **kwargs}
    with pytest.raises(ValueError, match=message) as err:
        trial(args.pop("model_factory"), **args)
    assert "\n" not in str(err.value)


def test_unknown_precision_lookup_names_the_runs():
    t = trial("mlp", precisions=("bf16",), steps=1)
    with pytest.raises(ValueError, match="it ran bf16"):
        t.departure("fp16")
    with pytest.raises(ValueError, match="series: loss"):
        t.get("bf16", "nothing")


def test_cli(tmp_path, capsys):
    out = tmp_path / "t.json"
    assert main(["--model", "mlp", "--steps", "3", "--precisions", "bf16,fp16", "--out", str(out)]) == 0
    assert "trial: 3 steps" in capsys.readouterr().out
    assert json.loads(out.read_text())["steps"] == 3


@pytest.mark.parametrize("argv,message", [
    (["--model", "gpt"], "--model must be one of mlp, cnn, transformer"),
    (["--model", "mlp", "--precisions", "fp8"], "precisions: unknown precision"),
    (["--model", "mlp", "--steps", "0"], "steps must be an int >= 1"),
    (["--model", "mlp", "--out", "/nonexistent/x.json"], "cannot write --out"),
    # a device that opens but refuses data: found by _args.writable_file's probe byte, before the trainings
    (["--model", "mlp", "--plot", "/dev/full"], "cannot write --plot '/dev/full': No space left on device"),
    (["--model", "mlp", "--steps", "x"], "invalid int value"),
])
def test_cli_bad_input_is_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("ampcourse.trial: error:") and message in err and err.count("\n") == 1


def test_module_is_on_the_lazy_map():
    import ampcourse
    assert ampcourse.trial is trial_mod and math.isclose(trial_mod.unit_roundoff("bf16"), 2.0**-8)


def test_departure_of_one_series_and_another_tolerance():
    t = trial(lambda: GrowingLogits(1, 4), DATA, precisions=("bf16",), steps=7)
    assert t.departure("bf16", series="attention_logit_max") == t.departure("bf16")
    assert t.departure("bf16", series="loss") is None or t.departure("bf16", series="loss").step >= 4
    assert t.departure("bf16", series="attention_logit_max", tolerance=1e6) is None
    assert t.departure("bf16", tolerance=1e-9).step == 0
    with pytest.raises(ValueError, match="series must be one of loss, drift, attention_logit_max"):
        t.departure("bf16", series="logits")


def test_attention_monitor_computes_scores_in_fp32_inside_autocast():
    """The hooks run inside the step's autocast region; the scores must not be rounded to bf16 there."""
    model = TinyTransformer()
    (layer, module, measure), *_ = trial_mod.attention_logit_max().where(model)
    torch.manual_seed(0)
    out = (torch.randn(4, 16, 96) * 3).to(torch.bfloat16)  # a bf16 qkv output, as autocast makes it
    want = measure(module, (), out)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = measure(module, (), out)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    q, k = (out[..., i * 32:(i + 1) * 32].float().view(4, 16, 4, 8).transpose(1, 2) for i in (0, 1))
    assert torch.equal(want, (q @ k.transpose(-2, -1)).abs().amax() / math.sqrt(8))  # the fp32 value
    assert float(got) != float(want.to(torch.bfloat16))  # and not one rounded to bf16 (this input tells them apart)


@pytest.mark.parametrize("precisions", [("bf16", "fp16"), ("fp32",)])
def test_chunks_give_the_same_series_as_strict_lockstep(precisions):
    """Runs take a chunk of steps each (the reference first): any chunk gives the lockstep series, bit for bit."""
    strict = trial("transformer", DATA, precisions=precisions, steps=7, chunk=1)
    assert strict.config["chunk"] == 1
    for chunk in (3, None):
        t = trial("transformer", DATA, precisions=precisions, steps=7, chunk=chunk)
        assert t.series == strict.series and t.departures == strict.departures
    assert t.config["chunk"] == 7  # the default: every step at once for a model this small (CHUNK_BYTES)


def test_the_default_chunk_follows_chunk_bytes(monkeypatch):
    """chunk=None takes as many steps at once as CHUNK_BYTES of flat weight copies allow (at least one)."""
    default = trial("transformer", DATA, precisions=("bf16",), steps=7)
    assert default.config["chunk"] == 7  # a model this small fits every step
    monkeypatch.setattr(trial_runs, "CHUNK_BYTES", 1)
    tight = trial("transformer", DATA, precisions=("bf16",), steps=7)
    assert tight.config["chunk"] == 1 and tight.series == default.series  # one step at a time, the same series


# --- issue 28 (the flag, the causal mask, recompute) and issue 30 item 7 (fused optimizers' step count) -----------

def test_attention_monitor_applies_the_causal_mask():
    """A future key's score never reaches softmax: it must not be the monitor's largest logit."""
    model = TinyTransformer()
    (_, module, measure), *_ = trial_mod.attention_logit_max().where(model)
    out = torch.zeros(1, 16, 96)
    out[0, 0, 0:8] = 1.0  # the query of position 0, head 0
    out[0, 5, 32:40] = 10.0  # the key of position 5, head 0: only queries 5.. see it
    out[0, 0, 32:40] = 0.5  # the key of position 0
    # visible: q0.k0 = 8 * 0.5 = 4; hidden (future): q0.k5 = 8 * 10 = 80
    assert float(measure(module, (), out)) == pytest.approx(4 / math.sqrt(8))
    model.blocks[0].causal = False  # a block that says it is not causal is read unmasked
    (_, _, measure), *_ = trial_mod.attention_logit_max().where(model)
    assert float(measure(module, (), out)) == pytest.approx(80 / math.sqrt(8))


def test_the_flag_is_named_for_what_it_measures():
    assert trial_mod.attention_logit_max().by_magnitude and trial_mod.output_logit_max().by_magnitude
    assert not trial_mod.activation_max().by_magnitude
    t = trial("transformer", DATA, precisions=("bf16",), steps=2)
    assert t.magnitude_monitors == ["attention_logit_max", "output_logit_max"]
    assert json.loads(t.to_json())["magnitude_monitors"] == t.magnitude_monitors


class _ForgetfulRecompute(torch.autograd.Function):
    """Chapter 10's bug: recompute fn(x) in backward, outside the forward's autocast state."""

    @staticmethod
    def forward(ctx, fn, x):
        ctx.fn = fn
        ctx.save_for_backward(x)
        with torch.no_grad():
            return fn(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_(True)
        with torch.enable_grad():
            out = ctx.fn(x)  # fp32 here: the forward ran in bf16
        torch.autograd.backward(out, grad)
        return None, x.grad


class Checkpointed(TinyTransformer):
    """The reference transformer, its blocks recomputed in backward: by torch.utils.checkpoint or by the bug."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how

    def forward(self, idx):
        from torch.utils.checkpoint import checkpoint

        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            if self.how == "torch" and self.training:
                x = checkpoint(block, x, use_reentrant=False)
            elif self.how == "forgetful" and self.training:
                x = _ForgetfulRecompute.apply(block, x)
            else:
                x = block(x)
        return self.ln(x) @ self.tok.weight.t()


@pytest.mark.parametrize("how", ["none", "torch", "forgetful"])
def test_recompute_gap_sees_a_recompute_that_strays_either_way(how):
    t = trial(lambda: Checkpointed(how), DATA, precisions=("bf16",), steps=3)
    gap = t.series["bf16"][trial_mod.RECOMPUTE_GAP]
    assert len(gap) == 3 and set(t.series[REFERENCE][trial_mod.RECOMPUTE_GAP]) == {0.0}  # fp32: nothing differs
    if how == "forgetful":
        assert min(gap) > 1e-4 and "a recompute in backward differed" in t.summary()
    else:  # no recompute, or a faithful one: exactly the forward's values
        assert set(gap) == {0.0} and "recompute" not in t.summary()
    # the forward's values are what the monitors keep, with or without a recompute
    plain = trial(lambda: Checkpointed("none"), DATA, precisions=("bf16",), steps=1)
    first = {k: v[0] for k, v in t.series["bf16"].items() if k.startswith("activation_max/")}
    assert first == {k: v[0] for k, v in plain.series["bf16"].items() if k.startswith("activation_max/")}


@pytest.mark.parametrize("fused", [False, True])
def test_optimizer_steps_count_updates_with_fused_optimizers_too(fused):
    """GradScaler always calls a fused optimizer's step() (the kernel skips on found_inf): 22 skipped, 30 counted
    before; the count must be the updates."""
    t = trial("mlp", precisions=("fp16",), steps=30, scaler_kwargs={"init_scale": 2.0**40},
              optimizer_factory=lambda params: torch.optim.AdamW(params, lr=1e-3, fused=fused))
    s = t.series["fp16"]
    skipped = int(sum(s["skipped"]))
    assert skipped >= 10
    assert s["optimizer_steps"][-1] == 30 - skipped
    assert s["optimizer_steps"] == [k + 1 - sum(s["skipped"][:k + 1]) for k in range(30)]
    assert all(u == 0.0 for u, sk in zip(s["update/net.0"], s["skipped"]) if sk)  # and those steps changed nothing
    assert f"optimizer steps {30 - skipped};" in t.summary()


def test_plot_names_the_runs_and_the_layers_that_drift_most():
    import matplotlib.pyplot as plt

    t = trial("transformer", DATA, precisions=("bf16", "fp16", "fp16-noscaler"), steps=3)
    fig = t.plot("bf16")
    loss_ax, drift_ax = fig.axes[0], fig.axes[2]
    labels = [text.get_text() for text in loss_ax.get_legend().get_texts()]
    assert labels == ["fp32 loss (left)", "bf16 - fp32 (right)", "fp16 - fp32 (right)", "fp16-noscaler - fp32 (right)"]
    drift_labels = [text.get_text() for text in drift_ax.get_legend().get_texts()]
    final = {k: v[-1] for k, v in t.layer_series("bf16", "drift").items()}
    top = sorted(final, key=final.get, reverse=True)[:trial_mod.DRIFT_LINES]
    assert drift_labels == [f"the other {len(final) - len(top)} layers", *top, "tolerance 0.1"]
    plt.close(fig)


def test_progress_bar_on_request(capsys):
    trial("mlp", precisions=("bf16",), steps=3, progress=True)
    assert "6/6" in capsys.readouterr().err  # 3 steps of the reference and of bf16
    trial("mlp", precisions=("bf16",), steps=3)
    assert capsys.readouterr().err == ""
    with pytest.raises(ValueError, match="progress must be True or False"):
        trial("mlp", steps=1, progress="yes")


def test_cli_shows_progress_unless_told_not_to(capsys):
    assert main(["--model", "mlp", "--steps", "2"]) == 0
    assert "4/4" in capsys.readouterr().err  # the reference's 2 steps and bf16's
    assert main(["--model", "mlp", "--steps", "2", "--no-progress"]) == 0
    assert capsys.readouterr().err == ""


# --- defects an independent tester hit in trial; each test failed before its fix (its comment says how) -------

def test_trial_refuses_an_lr_beyond_float32() -> None:
    with pytest.raises(ValueError, match="lr must be a number float32 can hold"):
        trial_mod.trial("mlp", steps=1, lr=1e39)


def test_trial_cli_huge_lr_is_one_line_exit_2() -> None:
    code, err = run_cli(trial_mod.main, ["--model", "mlp", "--steps", "1", "--lr", "1e39"])
    assert code == 2 and err.startswith("ampcourse.trial: error: --lr must be")


def test_trial_cli_refuses_an_unknown_plot_format_before_training(tmp_path: Path, monkeypatch) -> None:
    ran = []
    monkeypatch.setattr(trial_cli, "trial", lambda *a, **k: ran.append(1))
    code, err = run_cli(trial_mod.main, ["--model", "mlp", "--steps", "1", "--plot", str(tmp_path / "t.txt")])
    assert code == 2 and "--plot" in err and ".png" in err
    assert ran == []  # before: the trial ran to the end, printed its summary, then failed in savefig


def test_trial_cli_refuses_one_file_for_json_and_plot(tmp_path: Path, monkeypatch) -> None:
    ran = []
    monkeypatch.setattr(trial_cli, "trial", lambda *a, **k: ran.append(1))
    out = str(tmp_path / "t.png")
    code, err = run_cli(trial_mod.main, ["--model", "mlp", "--steps", "1", "--out", out, "--plot", out])
    assert code == 2 and "--out and --plot name the same file" in err and ran == []


# --- trial reads precision names as train() does; settings it would drop or typos it would hide are refused ----

@pytest.mark.parametrize("given,want", [(("FP16 ",), ("fp16",)), ((torch.bfloat16,), ("bf16",)), ("bf16", ("bf16",)),
                                        (("Fp16-NoScaler", "float16"), ("fp16-noscaler", "fp16"))])
def test_trial_reads_precision_names_like_train(given, want) -> None:
    # before: 'FP16 ' and torch.bfloat16 were "unknown name(s)", though train(precision=...) takes both
    assert trial_runs._check_precisions(given) == want


def test_trial_still_refuses_unknown_precisions() -> None:
    with pytest.raises(ValueError, match=r"precisions: unknown precision 'fp8'; choose from fp32, bf16, fp16, fp16-noscaler"):
        trial_runs._check_precisions(("bf16", "fp8"))
    with pytest.raises(ValueError, match="non-empty sequence"):
        trial_runs._check_precisions(None)


def test_trial_refuses_scaler_enabled_instead_of_dropping_it() -> None:
    # before: scaler_kwargs={"enabled": False} was ignored and the fp16 run used a GradScaler anyway
    with pytest.raises(ValueError, match="'fp16-noscaler' without"):
        trial_mod.trial("mlp", steps=1, precisions=("fp16",), scaler_kwargs={"enabled": False})


def test_trial_layer_series_refuses_an_unknown_prefix() -> None:
    t = trial_mod.trial("mlp", steps=2, monitors=[])
    assert set(t.layer_series("bf16", "drift")) == set(t.layers)
    # before: {} for a typo, which reads as "no layer has that series"
    with pytest.raises(ValueError, match="no per-layer series 'drfit'; choose one of drift, update"):
        t.layer_series("bf16", "drfit")
    with pytest.raises(ValueError, match="run 'fp8' is not in this trial"):
        t.layer_series("fp8", "drift")


X, Y = torch.randn(64, 32), torch.randint(0, 10, (64,))


def test_trial_pair_of_tensors_of_different_lengths_is_a_value_error() -> None:
    # before: AssertionError "Size mismatch between tensors" from torch's TensorDataset
    with pytest.raises(ValueError, match=r"inputs \(64, 32\) and targets \(10,\) must have one row per sample"):
        trial_mod.trial(lambda: torch.nn.Linear(32, 10), data=(X, Y[:10]), steps=1)


def test_a_compiled_model_is_named_by_its_layers_as_written():
    """torch.compile's wrapper holds the model as `_orig_mod`: its layers are still "0", "blocks.1", not "_orig_mod.0"."""
    def compiled():
        return torch.compile(TinyTransformer(vocab=64, seq_len=16), backend="eager")

    t = trial(compiled, DATA, precisions=("fp32",), steps=2)
    eager = trial(lambda: TinyTransformer(vocab=64, seq_len=16), DATA, precisions=("fp32",), steps=2)
    assert t.layers == eager.layers and not any("_orig_mod" in name for name in t.layers)
    keys = [k for k in t.series[REFERENCE] if "/" in k]
    assert keys == [k for k in eager.series[REFERENCE] if "/" in k] and not any("_orig_mod" in k for k in keys)


def test_a_run_that_raises_says_which_run_which_step_and_the_learners_line():
    """Was the bare "RuntimeError: Unsupported dtype Half" of torch.fft under CUDA's emulated lists, read as fp16
    failing on CUDA (cuFFT has fp16 kernels for power-of-two sizes; this CPU has none)."""
    from ampcourse.trial import RunFailed
    from planted import Spectral

    x, y = torch.randn(64, 32), torch.randint(0, 4, (64,))
    with pytest.raises(RunFailed) as info:
        trial(Spectral, (x, y), precisions=("fp16",), steps=2, policy="cuda")
    msg = str(info.value)
    assert msg.startswith("the fp16 run raised at step 1, where fp32 ran, at `f = torch.fft.rfft(h, dim=-1)` "
                          "(planted.py:"), msg
    assert "Unsupported dtype Half" in msg
    assert "CUDA's fp16 cannot be emulated for this model here" in msg and isinstance(info.value, RuntimeError)
    assert isinstance(info.value.__cause__, RuntimeError)  # the torch error, chained
    ok = trial(Spectral, (x, y), precisions=("fp16",), steps=2)  # CPU's own lists run torch.fft in fp32
    assert ok.departure("fp16") is None


def test_a_measure_on_another_device_joins_the_models_read_back() -> None:
    """A measure's value is moved to the model's device: the step stacks every value in one read-back.

    On CUDA the built-in measures give a CPU nan for an output without a tensor (and a learner's measure may return
    ``torch.tensor(x.item())``); stacking that with CUDA values raised "Expected all tensors to be on the same
    device". A model on the meta device stands in for CUDA here: the same device check, no GPU needed.
    """
    from ampcourse.trial.monitors import _abs_max, _Hooks, output_logit_max

    model = nn.Linear(2, 2, device="meta")
    hooks = _Hooks(model, [output_logit_max()])
    label = hooks.labels[0]
    hooks._hook(label, _abs_max)(model, (), ("an output", "without a tensor"))  # a CPU nan from the measure
    values = hooks.take()
    stacked = torch.stack(values)  # the read-back trial's step does
    assert stacked.device.type == "meta" and stacked.shape == (2,)
