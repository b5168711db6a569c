"""ampcourse.train: determinism, batches, accumulation, clipping after unscale_, skipped steps, bad arguments."""

import contextlib
import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from ampcourse import checkpoint, models
from ampcourse.device import pick
from ampcourse import train as train_mod
from ampcourse.train import (History, Parallel, batch_indices, local_indices, make_optimizer, optimizer_settings,
                             state_checksum, train)

FAST = dict(steps=4, lr=1e-2, seed=0, batch_size=32, n_samples=256, progress=False)


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def inject_inf(model: torch.nn.Module, at_calls: set[int]) -> list[int]:
    """Make the first weight's gradient inf on the given backward calls (0-based); returns the call log."""
    calls = []

    def hook(grad):
        calls.append(len(calls))
        return grad * math.inf if calls[-1] in at_calls else grad

    next(model.parameters()).register_hook(hook)
    return calls


# --- determinism and history ---------------------------------------------------------------

@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_same_seed_same_run(precision):
    a = train("mlp", None, precision, **FAST)
    b = train("mlp", None, precision, **FAST)
    assert a.loss == b.loss and a.grad_norm == b.grad_norm and a.scale == b.scale
    assert state_checksum(a.model) == state_checksum(b.model)


def test_other_seed_other_run():
    a = train("mlp", None, "fp32", **FAST)
    b = train("mlp", None, "fp32", **{**FAST, "seed": 1})
    assert state_checksum(a.model) != state_checksum(b.model) and a.loss != b.loss


def test_caller_rng_is_left_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    train("mlp", None, "fp32", **FAST)
    assert torch.equal(torch.rand(3), expected)


def test_history_contents():
    h = train("cnn", None, "fp16", **FAST)
    assert isinstance(h, History) and h.steps_done == 4 and h.start_step == 0
    for name in ("loss", "scale", "skipped", "grad_norm", "lr", "step_time"):
        assert len(getattr(h, name)) == 4, name
    assert all(math.isfinite(x) and x > 0 for x in h.loss + h.grad_norm)
    assert h.scale == [65536.0] * 4 and h.final_scale == 65536.0  # torch's default init_scale, no overflow
    assert h.skipped == [False] * 4 and h.skipped_steps == 0 and h.nonfinite == [False] * 4
    assert h.lr == [1e-2] * 4 and all(t > 0 for t in h.step_time)
    assert h.precision == "fp16" and h.device_type == "cpu" and h.world_size == 1 and h.backend == "none"
    assert h.final_loss == h.loss[-1] and isinstance(h.model, models.SmallCNN)
    s = h.summary()
    assert s["checksum"] == state_checksum(h.model) and s["steps_done"] == 4 and s["final_loss_scale"] == 65536.0


def test_loss_goes_down_in_every_precision():
    for precision in ("fp32", "fp16", "bf16"):
        h = train("mlp", None, precision, **{**FAST, "steps": 30})
        assert sum(h.loss[-5:]) < 0.9 * sum(h.loss[:5]), precision


def test_scale_is_one_without_scaler():
    for precision in ("fp32", "bf16"):
        h = train("mlp", None, precision, **FAST)
        assert h.scale == [1.0] * 4 and h.final_scale == 1.0


def test_trains_a_given_module_in_place():
    model = models.make_model("transformer")
    before = flat_params(model).clone()
    h = train(model, None, "fp32", **FAST)
    assert h.model is model and not torch.equal(before, flat_params(model))


def test_own_model_and_data():
    x = torch.randn(64, 3, generator=torch.Generator().manual_seed(0))
    data = TensorDataset(x, x @ torch.tensor([[1.0], [-2.0], [0.5]]))
    model = torch.nn.Linear(3, 1)
    h = train(model, data, "fp32", steps=20, lr=0.1, batch_size=16, progress=False,
              loss_fn=torch.nn.functional.mse_loss)
    assert h.steps_done == 20 and h.loss[-1] < 0.1 * h.loss[0]


def test_progress_bar_goes_to_stderr(capsys):
    train("mlp", None, "fp32", **{**FAST, "progress": True})
    err = capsys.readouterr().err
    assert "train fp32" in err and "4/4" in err


# --- which samples each step sees -------------------------------------------------------------

def test_batch_indices_depend_only_on_their_arguments():
    a = batch_indices(7, seed=3, dataset_size=100, batch_size=10)
    torch.manual_seed(999)  # the global RNG plays no part
    assert torch.equal(a, batch_indices(7, seed=3, dataset_size=100, batch_size=10))
    assert not torch.equal(a, batch_indices(7, seed=4, dataset_size=100, batch_size=10))
    assert not torch.equal(a, batch_indices(8, seed=3, dataset_size=100, batch_size=10))


def test_an_epoch_is_a_permutation():
    idx = torch.cat([batch_indices(k, 0, 100, 10) for k in range(10)])
    assert sorted(idx.tolist()) == list(range(100))
    nxt = torch.cat([batch_indices(k, 0, 100, 10) for k in range(10, 20)])
    assert sorted(nxt.tolist()) == list(range(100)) and not torch.equal(idx, nxt)  # reshuffled


def test_remainder_is_dropped():
    idx = [batch_indices(k, 0, 25, 10) for k in range(2)]
    assert all(len(i) == 10 and len(set(i.tolist())) == 10 for i in idx)
    assert len(set(torch.cat(idx).tolist())) == 20


def test_rank_slices_make_up_the_global_batch():
    for world in (1, 2, 4):
        parts = [local_indices(5, 0, 256, 32, rank, world) for rank in range(world)]
        assert torch.equal(torch.cat(parts), batch_indices(5, 0, 256, 32))


# --- accumulation, clipping, scaler skips -------------------------------------------------------

@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_accumulation_matches_one_big_batch(optimizer):
    """Same global batch of 64 as 1 x 64, 2 x 32 and 4 x 16 micro-batches: equal up to fp32 rounding."""
    cfg = {**FAST, "steps": 8, "batch_size": 64, "optimizer": optimizer}
    runs = [train("mlp", None, "fp32", **cfg, accum_steps=k) for k in (1, 2, 4)]
    ref = flat_params(runs[0].model)
    for h in runs[1:]:
        assert torch.allclose(flat_params(h.model), ref, rtol=0, atol=1e-5)  # observed <= 2e-7
        assert max(abs(a - b) for a, b in zip(h.loss, runs[0].loss)) < 1e-5


def test_accumulation_tolerance_is_tight_enough_to_catch_a_bug():
    """Forgetting to divide by accum_steps=2 doubles SGD's step (same as lr x 2): far outside 1e-5."""
    cfg = {**FAST, "steps": 8, "batch_size": 64, "optimizer": "sgd"}
    good = flat_params(train("mlp", None, "fp32", **cfg).model)
    undivided = flat_params(train("mlp", None, "fp32", **{**cfg, "lr": 2 * cfg["lr"]}).model)
    assert (good - undivided).abs().max() > 1e-3


def test_accumulation_divides_the_loss(monkeypatch):
    """Each micro-batch's loss is divided by accum_steps before backward."""
    seen = []
    real_scale = torch.amp.GradScaler.scale

    def spy(self, outputs):
        seen.append(outputs.detach().clone())
        return real_scale(self, outputs)

    monkeypatch.setattr(torch.amp.GradScaler, "scale", spy)
    h = train("mlp", None, "fp32", **{**FAST, "steps": 1, "accum_steps": 4})
    assert len(seen) == 4 and abs(sum(float(s) for s in seen) - h.loss[0]) < 1e-6


def test_clipping_acts_on_unscaled_gradients():
    """fp16 + scaler + SGD: the update is lr * grad_clip, not lr * grad_clip / scale."""
    model = models.make_model("mlp")
    before = flat_params(model).clone()
    h = train(model, None, "fp16", steps=1, lr=0.1, seed=0, batch_size=32, n_samples=256, optimizer="sgd",
              grad_clip=0.05, progress=False)
    step = (flat_params(model) - before).norm().item()
    assert h.grad_norm[0] > 0.05 * 2  # the clip was active
    assert step == pytest.approx(0.1 * 0.05, rel=1e-3)
    # the recorded norm is the true gradient norm: the fp32 run agrees to fp16 accuracy
    ref = train("mlp", None, "fp32", steps=1, lr=0.1, seed=0, batch_size=32, n_samples=256, optimizer="sgd",
                progress=False)
    assert h.grad_norm[0] == pytest.approx(ref.grad_norm[0], rel=1e-2)


def test_no_clip_updates_by_the_full_gradient():
    model = models.make_model("mlp")
    before = flat_params(model).clone()
    h = train(model, None, "fp32", steps=1, lr=0.1, seed=0, batch_size=32, n_samples=256, optimizer="sgd",
              progress=False)
    assert (flat_params(model) - before).norm().item() == pytest.approx(0.1 * h.grad_norm[0], rel=1e-5)


def step_lr(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def test_scheduler_is_not_stepped_on_skipped_steps():
    model = models.make_model("mlp")
    inject_inf(model, {0, 2})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        h = train(model, None, "fp16", **{**FAST, "steps": 5, "lr": 0.1}, scheduler=step_lr)
    assert h.skipped == [True, False, True, False, False]
    assert h.scale == [65536.0, 32768.0, 32768.0, 16384.0, 16384.0] and h.final_scale == 16384.0
    # the LR only moves after a step that happened
    assert h.lr == [0.1, 0.1, 0.05, 0.05, 0.025]
    assert h.nonfinite == h.skipped
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]


def test_naive_loop_would_warn():
    """The control: stepping the scheduler after a skipped first step triggers torch's UserWarning."""
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = step_lr(opt)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.ones(1, 2)).sum() * math.inf).backward()
    with pytest.warns(UserWarning, match=r"lr_scheduler\.step\(\)` before `optimizer\.step\(\)"):
        scaler.step(opt)
        scaler.update()
        sched.step()


def test_skipped_step_leaves_the_weights_alone():
    model = models.make_model("mlp")
    before = flat_params(model).clone()
    inject_inf(model, {0})
    h = train(model, None, "fp16", **{**FAST, "steps": 1})
    assert h.skipped == [True] and torch.equal(flat_params(model), before)


def test_bf16_has_no_scaler_to_skip():
    model = models.make_model("mlp")
    inject_inf(model, {1})
    h = train(model, None, "bf16", **{**FAST, "steps": 2})
    assert h.skipped == [False, False] and h.nonfinite == [False, True]


def test_cosine_schedule():
    h = train("mlp", None, "fp32", **{**FAST, "steps": 4}, scheduler="cosine")
    assert h.lr[0] == 1e-2 and h.lr[1] < h.lr[0] and h.lr[2] == pytest.approx(0.5e-2)


def test_scaler_kwargs_reach_the_scaler():
    h = train("mlp", None, "fp16", **FAST, scaler_kwargs={"init_scale": 2.0**10, "growth_interval": 2})
    assert h.scale == [1024.0, 1024.0, 2048.0, 2048.0] and h.final_scale == 4096.0


# --- hooks for the distributed follow-up -------------------------------------------------------

class CountingWrapper(torch.nn.Module):
    """Stands in for DDP: forwards to the module and counts no_sync() windows."""

    def __init__(self, module):
        super().__init__()
        self.module, self.no_sync_calls = module, 0

    def forward(self, x):
        return self.module(x)

    def no_sync(self):
        self.no_sync_calls += 1
        return contextlib.nullcontext()


def test_wrap_hook_and_no_sync_for_all_but_the_last_micro_batch():
    wrappers = []

    def wrap(module):
        wrappers.append(CountingWrapper(module))
        return wrappers[-1]

    h = train("mlp", None, "fp32", **{**FAST, "steps": 2, "accum_steps": 4}, parallel=Parallel(wrap=wrap))
    assert wrappers[0].no_sync_calls == 2 * 3
    assert isinstance(h.model, models.MLP)  # the checksum and checkpoints use the unwrapped model


def test_rank_takes_its_slice(monkeypatch):
    seen = []
    real = train_mod.train_step

    def spy(model, micro, *args, **kwargs):
        seen.append(torch.cat([x for x, _ in micro]))
        return real(model, micro, *args, **kwargs)

    monkeypatch.setattr(train_mod.loop, "train_step", spy)
    data = models.make_dataset("mlp", n=256)
    train("mlp", data, "fp32", **{**FAST, "steps": 1}, parallel=Parallel(rank=1, world_size=2))
    assert torch.equal(seen[0], data.tensors[0][local_indices(0, 0, 256, 32, 1, 2)])


# --- bad arguments: ValueError saying what is allowed, before any work -------------------------

BAD = [
    (dict(precision="fp64"), "fp32, fp16, bf16"),
    (dict(steps=0), "steps must be an int >= 1"),
    (dict(steps=2.5), "steps must be an int"),
    (dict(steps=True), "steps must be an int"),
    (dict(accum_steps=0), "accum_steps must be an int >= 1"),
    (dict(lr=0.0), "lr must be a finite number > 0"),
    (dict(lr=-1e-3), "lr must be a finite number > 0"),
    (dict(lr=float("nan")), "lr must be a finite number > 0"),
    (dict(lr=float("inf")), "lr must be a finite number > 0"),
    (dict(seed=-1), "seed must be an int >= 0"),
    (dict(model="resnet"), "choose one of mlp, cnn, transformer"),
    (dict(model=42), "model must be a reference model name .*an nn.Module.*got 42"),
    (dict(batch_size=0), "batch_size must be an int >= 1"),
    (dict(batch_size=512), r"larger than the dataset \(256 samples\); use at most 256"),
    (dict(batch_size=30, accum_steps=4), "must divide by world_size \\* accum_steps"),
    (dict(batch_size=30, parallel=Parallel(world_size=4)), "must divide by world_size \\* accum_steps"),
    (dict(parallel=Parallel(rank=2, world_size=2)), "rank must be an int in 0..1"),
    (dict(parallel={"rank": 0}), "parallel must be an ampcourse.train.Parallel or None, got dict"),
    (dict(parallel=Parallel(autocast="no")), "parallel.autocast must be True or False"),
    (dict(on_step="print"), "on_step must be a callable or None"),
    (dict(checkpoint_dir="runs/a\0b"), r"checkpoint_dir 'runs/a\\x00b' contains a NUL byte"),
    (dict(checkpoint_dir=b"runs/a"), "checkpoint_dir must be a path"),
    (dict(grad_clip=0.0), "grad_clip must be a finite number > 0"),
    (dict(weight_decay=-0.1), "weight_decay must be a finite number >= 0"),
    (dict(optimizer="lamb"), "adamw, adam, sgd"),
    (dict(scheduler="onecycle"), "cosine"),
    (dict(size="huge"), "tiny, small, large"),
    (dict(device="cuda"), "CUDA is not available"),
    (dict(device="tpu"), "unknown device"),
    (dict(resume=True), "resume=True needs a checkpoint_dir"),
    (dict(checkpoint_every=5), "checkpoint_every needs a checkpoint_dir"),
    (dict(data=[1, 2, 3]), "TensorDataset"),
    (dict(model=torch.nn.Linear(2, 2)), "data=None only works for the reference models"),
]


@pytest.mark.parametrize("kwargs,message", BAD, ids=[str(k) for k, _ in BAD])
def test_bad_arguments(kwargs, message, monkeypatch):
    def no_work(*a, **k):
        raise AssertionError("work started before validation")

    monkeypatch.setattr(train_mod.loop, "train_step", no_work)
    args = {"model": "mlp", "data": None, **{k: v for k, v in FAST.items()}, **kwargs}
    with pytest.raises(ValueError, match=message):
        train(**args)


def test_checkpoint_every_zero():
    with pytest.raises(ValueError, match="checkpoint_every must be an int >= 1"):
        train("mlp", None, "fp32", **FAST, checkpoint_dir="unused", checkpoint_every=0)


def test_fp16_on_a_device_that_cannot_run_it(monkeypatch):
    from ampcourse import inputs

    monkeypatch.setattr(inputs, "amp_problem", lambda device_type, precision:
                        "no fp16 kernels" if precision == "fp16" else None)
    with pytest.raises(ValueError, match="precision 'fp16' cannot run on cpu .*no fp16 kernels.*use bf16 or fp32"):
        train("mlp", None, "fp16", **FAST)
    train("mlp", None, "bf16", **FAST)  # the other precisions still work


def test_amp_probe_on_this_cpu():
    from ampcourse import inputs

    assert inputs.amp_problem("cpu", "fp16") is None and inputs.amp_problem("cpu", "bf16") is None


def test_checkpoint_dir_not_writable(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="cannot be created.*is a file"):
        train("mlp", None, "fp32", **FAST, checkpoint_dir=blocker / "run")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        train("mlp", None, "fp32", **FAST, checkpoint_dir=blocker)
    assert blocker.read_text() == "x"


def test_resume_without_a_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="no checkpoint at .*run once without resume"):
        train("mlp", None, "fp32", **FAST, checkpoint_dir=tmp_path / "run", resume=True)
    assert not (tmp_path / "run").exists()  # validation created nothing


def test_state_checksum_sees_every_bit():
    model = models.make_model("cnn")
    a = state_checksum(model)
    assert a == state_checksum(models.make_model("cnn")) and len(a) == 64
    with torch.no_grad():
        w = next(model.parameters())
        w.view(-1)[0] = torch.nextafter(w.view(-1)[0], torch.tensor(math.inf))
    assert state_checksum(model) != a


# --- the per-step gradient norm and batch indices, after their speed-ups ---------------------------

@pytest.mark.parametrize("path", ["cpu concat", "fused per-tensor", "get_total_norm"])
def test_recorded_norm_equals_get_total_norm(path, monkeypatch):
    """Each way _squared_norm_parts takes gives the norm torch.nn.utils.get_total_norm gives."""
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(shape, generator=gen) * s for shape, s in [((7, 5), 1e-3), ((64,), 3.0), ((3, 3, 3), 1e2)]]
    if path == "fused per-tensor":
        monkeypatch.setattr(train_mod.step, "_CPU_CONCAT_NORM_MAX", 0)
    if path == "get_total_norm":
        grads[1] = grads[1].double()  # mixed dtypes take the general route
    parts = train_mod.step._squared_norm_parts(grads)
    assert len(parts) == {"cpu concat": 1, "fused per-tensor": 3, "get_total_norm": 1}[path]
    norm = math.sqrt(sum(float(p) for p in parts))
    assert norm == pytest.approx(float(torch.nn.utils.get_total_norm(grads)), rel=1e-6)
    grads[0][0, 0] = math.inf
    assert math.isinf(math.sqrt(sum(float(p) for p in train_mod.step._squared_norm_parts(grads))))


def test_batch_indices_are_a_copy():
    """The epoch permutation is cached: writing into a returned batch must not change later batches."""
    a = batch_indices(3, 0, 100, 10)
    expected = a.clone()
    a.fill_(0)
    assert torch.equal(batch_indices(3, 0, 100, 10), expected)


# --- host syncs per step (issue 14, part A item 7) ---------------------------------------------------------
# A CPU has no host syncs, but every GPU sync in a training step is a device-to-host read: .item(), .tolist(),
# float()/bool()/int() of a tensor, .cpu(). Counting those reads on a CPU run counts the syncs a GPU would make.

_READS = ("item", "tolist", "__float__", "__bool__", "__int__", "cpu")


@contextlib.contextmanager
def _count_host_reads(monkeypatch):
    """Count tensor reads to the host, and train_step's one batched read-back (its own .item()s not counted)."""
    counts = {"reads": 0, "read_back": 0, "get_scale": 0}
    state = {"inside": False}
    for name in _READS:
        real = getattr(torch.Tensor, name)

        def counted(self, *args, _real=real, **kwargs):
            if not state["inside"]:
                counts["reads"] += 1
            return _real(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counted)
    real_read_back = train_mod.step._read_back

    def read_back(tensors):
        counts["read_back"] += 1
        state["inside"] = True
        try:
            return real_read_back(tensors)
        finally:
            state["inside"] = False
    monkeypatch.setattr(train_mod.step, "_read_back", read_back)
    real_get_scale = torch.amp.GradScaler.get_scale

    def get_scale(self):
        counts["get_scale"] += 1
        return real_get_scale(self)
    monkeypatch.setattr(torch.amp.GradScaler, "get_scale", get_scale)
    yield counts


def _fp16_parts(fused: bool, optimizer: str = "adamw"):
    """A model, fp16 scaler and optimizer on the CPU, and one batch."""
    from ampcourse.device import pick

    amp = pick("cpu", "fp16")
    model = models.make_model("mlp", seed=0)
    opt = train_mod.make_optimizer(optimizer, model.parameters(), 1e-3, fused=fused)
    x, y = models.make_dataset("mlp", n=32, seed=0).tensors
    return amp, model, opt, amp.make_scaler(), (x, y)


def test_an_fp16_step_with_fused_adamw_reads_the_host_once(monkeypatch):
    amp, model, opt, scaler, batch = _fp16_parts(fused=True)
    assert opt.defaults["fused"]
    with _count_host_reads(monkeypatch) as counts:
        for _ in range(3):
            stats = train_mod.train_step(model, [batch, batch], models.loss_fn, opt, scaler, amp)
    # one stacked read-back per step (losses, norm, scale before and after); no get_scale(), no found_inf.item()
    assert counts == {"reads": 0, "read_back": 3, "get_scale": 0}
    assert stats.scale == scaler.get_scale() and not stats.skipped


def test_an_fp16_step_with_a_plain_optimizer_adds_only_gradscalers_inf_check(monkeypatch):
    """Without a fused optimizer, GradScaler.step reads found_inf on the host: one more sync, and no others.

    (SGD: a plain CPU Adam also reads its step counters, which live on the host on a GPU too.)
    """
    amp, model, opt, scaler, batch = _fp16_parts(fused=False, optimizer="sgd")
    with _count_host_reads(monkeypatch) as counts:
        for _ in range(2):
            train_mod.train_step(model, [batch], models.loss_fn, opt, scaler, amp)
    assert counts["read_back"] == 2 and counts["get_scale"] == 0
    assert counts["reads"] == 2  # found_inf.item() in GradScaler._maybe_opt_step, once per step


def test_skips_are_still_seen_without_get_scale(monkeypatch):
    amp, model, opt, scaler, (x, y) = _fp16_parts(fused=True)
    bad = x.clone()
    bad[0, 0] = float("inf")
    before = [p.detach().clone() for p in model.parameters()]
    stats = train_mod.train_step(model, [(bad, y)], models.loss_fn, opt, scaler, amp)
    assert stats.skipped and stats.scale == 2.0**16 and scaler.get_scale() == 2.0**15
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def nan_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A loss that is NaN on every step, so that every fp16 step is skipped."""
    return models.loss_fn(out, y) * math.nan


def test_skips_are_still_seen_once_the_scale_has_backed_off_to_zero():
    """0 * backoff == 0: from there on the scale no longer drops on a skip, and the scheduler must still hold."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # 2**-140 is a float32 subnormal: 10 backoffs reach exactly 0, then 4 more skipped steps at scale 0
        h = train("mlp", None, "fp16", **{**FAST, "steps": 14, "lr": 0.1}, loss_fn=nan_loss, scheduler=step_lr,
                  scaler_kwargs={"init_scale": 2.0**-140})
    assert h.scale[-4:] == [0.0] * 4 and h.final_scale == 0.0
    assert h.skipped == [True] * 14 and h.lr == [0.1] * 14
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("scaler_kind", ["GradScaler", "LossScaler"])
def test_train_step_reads_the_skip_from_the_scalers_inf_flag(scaler_kind, fused):
    """Both scalers, fused or not: a skip at scale 0 is seen, and a clean step that grows the scale is not a skip."""
    from ampcourse.scaling import LossScaler

    amp, model, opt, _, (x, y) = _fp16_parts(fused=fused)
    model2 = models.make_model("mlp", seed=0)
    opt2 = train_mod.make_optimizer("adamw", model2.parameters(), 1e-3, fused=fused)
    make = torch.amp.GradScaler if scaler_kind == "GradScaler" else LossScaler
    scaler = make("cpu", init_scale=2.0**-149, growth_interval=1)
    stats = train_mod.train_step(model, [(x, y)], nan_loss, opt, scaler, amp)
    assert stats.skipped and scaler.get_scale() == 0.0
    stats = train_mod.train_step(model, [(x, y)], nan_loss, opt, scaler, amp)
    assert stats.skipped and stats.scale == 0.0 and scaler.get_scale() == 0.0
    # A clean loss at scale 0: zero gradients pass the inf check and the step is taken (with NaN): the flag says
    # "not skipped" where the scale (0 -> 0) cannot tell, so this shows the flag is what was read.
    stats = train_mod.train_step(model, [(x, y)], models.loss_fn, opt, scaler, amp)
    assert not stats.skipped and stats.scale == 0.0
    scaler = make("cpu", init_scale=2.0**10, growth_interval=1)
    stats = train_mod.train_step(model2, [(x, y)], models.loss_fn, opt2, scaler, amp)
    assert not stats.skipped and scaler.get_scale() == 2.0**11


def test_a_scaler_without_an_inf_flag_falls_back_to_the_scale_with_zero_as_a_skip(monkeypatch):
    amp, model, opt, scaler, (x, y) = _fp16_parts(fused=False)
    monkeypatch.setattr(train_mod.step, "_found_inf", lambda scaler, optimizer: None)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**-149)
    assert [train_mod.train_step(model, [(x, y)], nan_loss, opt, scaler, amp).skipped for _ in range(2)] == [True, True]


def test_make_optimizer_fuses_adam_on_cuda_only_by_default():
    params = [torch.nn.Parameter(torch.zeros(2))]
    assert not train_mod.make_optimizer("adamw", params, 1e-3).defaults.get("fused")
    assert train_mod.make_optimizer("adam", params, 1e-3, fused=True).defaults["fused"]
    assert isinstance(train_mod.make_optimizer("sgd", params, 1e-3, fused=True), torch.optim.SGD)


def test_data_stays_where_it_is_off_cuda():
    xs, ys = torch.zeros(4, 2), torch.zeros(4)
    placed = train_mod.batches.data_on_device((xs, ys), torch.device("cpu"))
    assert placed[0] is xs and placed[1] is ys


@pytest.mark.parametrize("precision,refused", [("fp16", True), ("bf16", False)])
def test_fp16_parameters_with_a_gradscaler_are_refused_before_any_work(precision, refused, monkeypatch):
    """fp16 parameters under fp16 autocast + GradScaler failed inside step 1 ("Attempting to unscale FP16 gradients")."""
    monkeypatch.setattr(train_mod.loop, "train_step", lambda *a, **k: pytest.fail("work started"))
    model = models.make_model("mlp").half()
    data = models.make_dataset("mlp", n=64)
    call = lambda: train(model, data, precision, **{**FAST, "steps": 1})  # noqa: E731
    if refused:
        with pytest.raises(ValueError, match=r"model parameter '.*' is float16 .* call model.float\(\) before train\(\)"):
            call()
    else:
        with pytest.raises(pytest.fail.Exception, match="work started"):  # checks passed, the loop began
            call()
    # an fp16 run whose scaler is switched off is the caller's choice, not refused
    with pytest.raises(pytest.fail.Exception, match="work started"):
        train(model, data, "fp16", **{**FAST, "steps": 1}, scaler_kwargs={"enabled": False})


# --- chapter 4's hand-written loops equal train() on a GPU too (issue 19, part 2, item 1) -------------------------

def _hand_loop(precision: str, optimizer, steps: int = 6):
    """Chapter 4's amp_step loop (cell 'hand_built_run'), with the optimizer the caller builds."""
    import torch.nn.functional as F

    from ampcourse.device import pick

    setup = pick("cpu", precision)
    data = models.make_dataset("mlp", n=256, seed=0)
    model = models.make_model("mlp", seed=0)
    opt = optimizer(model.parameters())
    scaler = torch.amp.GradScaler("cpu", enabled=setup.use_scaler)
    for step in range(steps):
        idx = batch_indices(step, 0, 256, 32)
        opt.zero_grad(set_to_none=True)
        with torch.amp.autocast("cpu", dtype=setup.amp_dtype, enabled=setup.enabled):
            loss = F.cross_entropy(model(data.tensors[0][idx]), data.tensors[1][idx])
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return model, data


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_hand_written_loop_matches_train_when_train_picks_fused_adamw(precision, monkeypatch):
    """On CUDA train() builds a fused AdamW; chapter 4 asserted bit-identity with a loop using plain AdamW
    (foreach on CUDA), which failed on every GPU. Here the fused default is forced on, on the CPU (CPU fused AdamW
    exists): the loop that builds its optimizer with make_optimizer, as chapter 4 now does, still matches."""
    monkeypatch.setattr(train_mod.step, "default_fused", lambda params: True)  # what a CUDA device decides
    assert train_mod.make_optimizer("adamw", [torch.nn.Parameter(torch.ones(1))], 1e-3).defaults["fused"]
    hand, data = _hand_loop(precision, lambda params: train_mod.make_optimizer("adamw", params, lr=3e-3))
    run = train("mlp", data, precision, steps=6, lr=3e-3, seed=0, batch_size=32, device="cpu", progress=False)
    assert state_checksum(hand) == state_checksum(run.model)
    # the old notebook loop (plain AdamW) does not match a fused train(): this test would have caught it
    plain, _ = _hand_loop(precision, lambda params: torch.optim.AdamW(params, lr=3e-3, weight_decay=0.0))
    assert state_checksum(plain) != state_checksum(run.model)


def test_chapter_4_loops_build_the_optimizer_train_builds():
    """The cells that assert bit-identity with train() must not build their own AdamW (tests/train/test_train.py above)."""
    import json
    from pathlib import Path

    nb = json.loads((Path(__file__).resolve().parents[2] / "chapters" / "04_amp_training_loop.ipynb").read_text())
    sources = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    for name in ("def hand_built_run", "def accumulated_run"):
        (cell,) = [s for s in sources if name in s]
        assert 'make_optimizer("adamw"' in cell and "torch.optim.AdamW(" not in cell, name


# --- the hot loop keeps the batch order on the device (issue 19, part 2, item 13) ----------------------------------

def test_step_indices_equal_local_indices_across_epochs_and_ranks():
    from ampcourse.train.batches import StepIndices

    for rank, world in ((0, 1), (1, 2), (3, 4)):
        indices = StepIndices(seed=7, dataset_size=100, batch_size=32, rank=rank, world_size=world)
        for step in range(12):  # 3 batches per epoch: four epochs
            assert torch.equal(indices(step), local_indices(step, 7, 100, 32, rank, world)), (rank, step)


def test_step_indices_cross_to_the_device_once_per_epoch(monkeypatch):
    """The bare loop's pattern: the permutation moves once per epoch, a step's indices are a slice on the device
    (the loop used to copy each step's index tensor from pageable host memory: a sync per step on a GPU)."""
    from ampcourse.train.batches import StepIndices

    moves, real_to = [], torch.Tensor.to

    def counted_to(self, *args, **kwargs):
        moves.append(args)
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", counted_to)
    indices = StepIndices(seed=0, dataset_size=96, batch_size=32, device="meta")  # a device that is not the host
    got = [indices(step) for step in range(9)]  # three epochs
    assert len(moves) == 3 and all(t.device.type == "meta" and t.shape == (32,) for t in got)


# --- the per-step hook --------------------------------------------------------------------------------------------

def test_on_step_sees_every_step_after_it_is_recorded(tmp_path):
    seen = []
    h = train("mlp", None, "fp16", **{**FAST, "steps": 3}, checkpoint_dir=tmp_path, checkpoint_every=1,
              on_step=lambda step, stats: seen.append((step, stats, checkpoint.load(checkpoint.path_in(tmp_path))["step"])))
    assert [s for s, _, _ in seen] == [0, 1, 2]
    assert [st.loss for _, st, _ in seen] == h.loss  # the stats of that very step
    assert [saved for _, _, saved in seen] == [1, 2, 3]  # the checkpoint due at that step is already written
    resumed = []
    train("mlp", None, "fp16", **{**FAST, "steps": 5}, checkpoint_dir=tmp_path, resume=True,
          on_step=lambda step, stats: resumed.append(step))
    assert resumed == [3, 4]  # a resumed run counts from where it stopped


def test_bench_times_the_trainer_through_the_hook_alone():
    """bench.paired_step_times needs nothing of train() but on_step: no patching of train's internals."""
    from types import SimpleNamespace

    from ampcourse import bench
    from ampcourse.device import pick

    calls = []

    def fake_train(*args, on_step, steps, **kwargs):
        for step in range(steps):
            calls.append(step)
            on_step(step, None)

    amp = pick("cpu", "fp32")
    data = models.make_dataset("mlp", n=64)
    trainer_ms, bare_ms = bench.paired_step_times(SimpleNamespace(train=fake_train), "mlp", data, amp, steps=4,
                                                  warmup=1, batch=32)
    assert calls == [0, 1, 2, 3] and trainer_ms >= 0 and bare_ms > 0


def test_train_step_inside_an_enclosing_autocast_trains_on_the_new_weights():
    """An enclosing autocast context (even enabled=False) keeps autocast's weight-cast cache alive across steps:
    without clearing it after the optimizer step, every forward after the first ran on the first step's bf16 copies."""
    def losses(outer) -> list[float]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        x, y = torch.randn(32, 8), torch.randint(0, 2, (32,))
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        amp = pick("cpu", "bf16")
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        with outer:
            return [train_mod.train_step(model, [(x, y)], torch.nn.functional.cross_entropy, opt, scaler, amp).loss
                    for _ in range(4)]

    plain = losses(contextlib.nullcontext())
    enclosed = losses(torch.autocast("cpu", enabled=False))
    assert len(set(plain)) == 4  # the loss moves every step
    assert enclosed == plain


# --- lr / weight_decay beyond float32: torch's optimizers fail at the first step -----------------------------

@pytest.mark.parametrize("lr", [1e39, 1e300, 1e-320])
def test_train_refuses_an_lr_float32_cannot_hold(lr: float) -> None:
    # before: 1e39 raised RuntimeError "value cannot be converted to type float without overflow" from
    # torch/optim/adam.py after the model and data were built; 1e-320 rounded to 0 and the run silently did not learn
    with pytest.raises(ValueError, match=r"^lr must be a number float32 can hold"):
        train("mlp", steps=1, lr=lr, progress=False)


def test_train_refuses_a_weight_decay_beyond_float32() -> None:
    with pytest.raises(ValueError, match=r"^weight_decay must be at most"):
        train("mlp", steps=1, weight_decay=1e39, progress=False)


def test_make_optimizer_refuses_an_lr_beyond_float32_before_any_step() -> None:
    params = [torch.nn.Parameter(torch.ones(2))]
    with pytest.raises(ValueError, match="lr must be a number float32 can hold"):
        make_optimizer("adamw", params, lr=1e39)


def test_optimizer_settings_keeps_sane_values_as_python_floats() -> None:
    lr, wd = optimizer_settings(np.float64(3e-4), torch.tensor(0.01))
    assert (lr, wd) == (3e-4, pytest.approx(0.01)) and type(lr) is float and type(wd) is float


# --- resume with other GradScaler or scheduler settings: the checkpoint's were put back silently --------------

def test_resume_refuses_changed_scaler_settings(tmp_path: Path) -> None:
    kw = dict(precision="fp16", device="cpu", progress=False, checkpoint_dir=tmp_path)
    train("mlp", steps=2, scaler_kwargs={"growth_interval": 1}, **kw)
    # before: the resumed run went on with growth_interval=1 (scale doubled every step) although 1000 was asked
    with pytest.raises(ValueError, match=r"growth_interval=1 in the checkpoint, 1000 now"):
        train("mlp", steps=4, resume=True, scaler_kwargs={"growth_interval": 1000}, **kw)
    with pytest.raises(ValueError, match=r"growth_interval=1 in the checkpoint, 2000 now"):  # GradScaler's default
        train("mlp", steps=4, resume=True, **kw)
    h = train("mlp", steps=4, resume=True, scaler_kwargs={"growth_interval": 1, "init_scale": 8.0}, **kw)
    assert h.series()["scale"][-1] > h.series()["scale"][0]  # same settings: resumes (init_scale may differ)


def test_resume_without_the_scheduler_it_was_written_with_is_refused(tmp_path: Path) -> None:
    kw = dict(checkpoint_dir=tmp_path, progress=False, precision="fp32")
    train("mlp", steps=2, scheduler="cosine", **kw)
    # before: resumed silently at the schedule's lr of step 2, held constant from there
    with pytest.raises(ValueError, match="written with an LR scheduler and this run has none"):
        train("mlp", steps=2, resume=True, **kw)
    assert train("mlp", steps=2, resume=True, scheduler="cosine", **kw).steps_done == 2


# --- local_indices / StepIndices: a rank past the world, or an uneven split, lost samples silently ------------

@pytest.mark.parametrize("rank,world,says", [
    (3, 2, r"rank must be an int in 0..1 \(world_size=2\)"),  # before: an empty tensor
    (0, 4, "batch_size 6 must divide by world_size 4"),  # before: 1 sample per rank, 2 of 6 never seen
    (0, 0, "world_size must be an int >= 1"),  # before: ZeroDivisionError
])
def test_local_indices_refuse_a_split_that_loses_samples(rank, world, says) -> None:
    from ampcourse.train import local_indices
    from ampcourse.train.batches import StepIndices
    with pytest.raises(ValueError, match=says):
        local_indices(0, 0, 16, 6 if world == 4 else 8, rank=rank, world_size=world)
    with pytest.raises(ValueError, match=says):
        StepIndices(0, 16, 6 if world == 4 else 8, rank=rank, world_size=world)


def test_local_indices_still_cover_the_batch() -> None:
    from ampcourse.train import batch_indices, local_indices
    parts = [local_indices(2, 0, 16, 8, rank=r, world_size=4) for r in range(4)]
    assert torch.equal(torch.cat(parts), batch_indices(2, 0, 16, 8))


# --- train() with callables of your own that return the wrong thing: AttributeError / RuntimeError inside ------

X, Y = torch.randn(64, 32), torch.randint(0, 10, (64,))


@pytest.mark.parametrize("kwargs,says", [
    (dict(optimizer=lambda p, lr, weight_decay: None), "optimizer callable must return a torch.optim.Optimizer, got NoneType"),
    (dict(scheduler=lambda opt: 5), "scheduler callable must return an LR scheduler"),
    (dict(loss_fn=lambda out, t: out.float().sum(1)), r"loss_fn must return a 0-d tensor .* shape \(8,\)"),
    (dict(loss_fn=lambda out, t: 1.0), "loss_fn must return a 0-d tensor .* got a float"),
])
def test_train_names_a_callable_that_returns_the_wrong_thing(kwargs, says) -> None:
    from torch.utils.data import TensorDataset
    with pytest.raises(ValueError, match=says):
        train(torch.nn.Linear(32, 10), TensorDataset(X, Y), steps=1, batch_size=8, progress=False, **kwargs)
