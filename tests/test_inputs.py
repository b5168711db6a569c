"""The front door (ampcourse.inputs): train, trial and examine read a model, data, settings and precisions one way.

Also the trial defects of issue 30 (item 5) and the DataLoader and settings parts: each test says what it was before.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import ampcourse
from ampcourse import checkpoint, inputs, models
from ampcourse.doctor import examine
from ampcourse.train import TrainSettings, state_checksum, train
from ampcourse.trial import Monitor, default_monitors, trial

ROOT = Path(__file__).resolve().parents[1]
FAST = dict(lr=1e-2, seed=0, progress=False)


def mlp_data(n: int = 256, seed: int = 0) -> TensorDataset:
    return models.make_dataset("mlp", n=n, seed=seed)


def same_weights(a: nn.Module, b: nn.Module) -> bool:
    return state_checksum(a) == state_checksum(b)


# ---------------------------------------------------------------------------------------------
# One exception, one reader
# ---------------------------------------------------------------------------------------------

def test_input_error_is_both_value_and_type_error():
    assert ampcourse.InputError is inputs.InputError
    assert issubclass(inputs.InputError, ValueError) and issubclass(inputs.InputError, TypeError)


@pytest.mark.parametrize("entry", ["train", "trial", "examine"])
def test_the_same_bad_model_is_the_same_error_everywhere(entry):
    """Before: train(model=42) raised ValueError and examine(model=42) TypeError, with other words."""
    x, y = mlp_data(8).tensors
    call = {"train": lambda: train(42, None, "fp32", steps=1, **FAST),
            "trial": lambda: trial(42, steps=1),
            "examine": lambda: examine(42, x, y, loss_fn=models.loss_fn)}[entry]
    with pytest.raises(inputs.InputError, match=r"(model|model_factory) must be .*got 42"):
        call()


def test_no_entry_point_imports_another_ones_private_helpers():
    """trial called train's _amp_works and _check_finite; the doctor had its own precision reader."""
    trial_files = sorted((ROOT / "ampcourse" / "trial").glob("*.py"))
    for path in [*trial_files, *sorted((ROOT / "ampcourse" / "doctor").glob("*.py"))]:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and "train" in node.module.split("."):
                assert not any(a.name.startswith("_") or a.name == "checks" for a in node.names), path
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("_checks",):
                raise AssertionError(f"{path}: {node.value.id}.{node.attr}")
    assert trial_files
    for path in trial_files:
        assert "_check_finite" not in path.read_text() and "_amp_works" not in path.read_text(), path


@pytest.mark.parametrize("given,kw,want", [
    ("bf16", {}, ("bf16",)), ((torch.float16, "FP16 "), {}, ("fp16",)),
    (["bf16", "Fp16-NoScaler"], dict(extra=("fp16-noscaler",)), ("bf16", "fp16-noscaler")),
])
def test_precision_names(given, kw, want):
    assert inputs.precision_names(given, **kw) == want


def test_one_precision_reader_serves_trial_and_the_doctor():
    x, y = mlp_data(8).tensors
    with pytest.raises(inputs.InputError, match="precisions: unknown precision 'fp8'; choose from fp16, bf16"):
        examine(models.make_model("mlp"), x, y, loss_fn=models.loss_fn, precisions=["fp8"])
    with pytest.raises(inputs.InputError, match="precisions: unknown precision 'fp8'; choose from fp32, bf16, fp16"):
        trial("mlp", precisions=["fp8"], steps=1)
    with pytest.raises(inputs.InputError, match="fp32 is always run as the reference"):
        examine(models.make_model("mlp"), x, y, loss_fn=models.loss_fn, precisions=["float32"])


@pytest.mark.parametrize("setting", [dict(steps=0), dict(batch_size=0), dict(loss_fn="ce"), dict(size="huge"),
                                     dict(grad_clip=-1.0), dict(lr=1e39), dict(progress="no"),
                                     dict(scaler_kwargs={"growth_interval": 0})])
def test_trial_refuses_a_setting_it_shares_with_train_in_train_s_words(setting):
    """Before: trial checked these settings itself, in words of its own ('steps must be an int >= 1 (at most
    2**63 - 1)', 'loss_fn must be a callable(output, targets) or None'); now train's TrainSettings checks both."""
    with pytest.raises(ValueError) as by_train:
        TrainSettings(**setting)
    with pytest.raises(ValueError) as by_trial:
        trial("mlp", steps=setting.pop("steps", 1), **setting)
    assert str(by_trial.value) == str(by_train.value)


def test_a_factory_works_for_train_too():
    a = train(lambda: models.make_model("mlp", seed=3), mlp_data(), "fp32", steps=2, batch_size=32, **FAST)
    b = train(models.make_model("mlp", seed=3), mlp_data(), "fp32", steps=2, batch_size=32, **FAST)
    assert same_weights(a.model, b.model)


# ---------------------------------------------------------------------------------------------
# Labels out of range: before any work, wherever they are
# ---------------------------------------------------------------------------------------------

class OwnNet(nn.Module):
    """A model of your own: the reference checks (models.check_data) do not know it."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.lin = nn.Linear(32, classes)

    def forward(self, x):
        return self.lin(x)


def test_a_bad_label_deep_in_the_data_is_refused_before_any_work(monkeypatch):
    """Before: a raw IndexError ("Target 99 is out of bounds") at the step whose batch held it."""
    from ampcourse.train import loop

    monkeypatch.setattr(loop, "train_step", lambda *a, **k: (_ for _ in ()).throw(AssertionError("work started")))
    x, y = mlp_data().tensors
    y = y.clone()
    y[200] = 99
    with pytest.raises(inputs.InputError, match=r"from 0 to 99, and the model's output has 10 classes \(0\.\.9\)"):
        train(OwnNet(), (x, y), "fp32", steps=5, batch_size=32, **FAST)


def test_a_bad_label_in_a_later_loader_batch_is_named_at_its_step():
    x, y = mlp_data(96).tensors
    y = y.clone()
    y[70] = -1
    loader = DataLoader(TensorDataset(x, y), batch_size=32)
    with pytest.raises(inputs.InputError, match=r"data targets of step 2 hold class indices from -1"):
        train(OwnNet(), loader, "fp32", steps=3, **FAST)


# ---------------------------------------------------------------------------------------------
# trial: what it is handed is checked before the fp32 reference runs
# ---------------------------------------------------------------------------------------------

def test_trial_refuses_fp16_parameters_under_fp16_before_the_reference_runs(monkeypatch):
    """Before: "Attempting to unscale FP16 gradients" from inside GradScaler, after the fp32 reference had run."""
    from ampcourse.trial import runs as trial_runs

    monkeypatch.setattr(trial_runs, "_steps", lambda *a, **k: (_ for _ in ()).throw(AssertionError("a run started")))
    with pytest.raises(inputs.InputError, match=r"is float16 .* call model.float\(\) before trial\(\)"):
        trial(lambda: models.make_model("mlp").half(), mlp_data(), precisions=("fp16",), steps=2)
    trial_mod_ok = trial  # fp16 without a scaler, and bf16, are not refused for it
    assert trial_mod_ok is not None


def test_trial_refuses_a_meta_model_and_meta_data():
    """Before: torch's internal errors from deep inside (copying a meta tensor, indexing meta data)."""
    with pytest.raises(inputs.InputError, match="meta device"):
        trial(lambda: models.make_model("mlp").to("meta"), mlp_data(), steps=1)
    x, y = mlp_data().tensors
    with pytest.raises(inputs.InputError, match="data inputs are on the meta device"):
        trial(lambda: models.make_model("mlp"), (x.to("meta"), y), steps=1)


class WithAux(nn.Module):
    """Returns (logits, aux), as a mixture-of-experts or a model with an auxiliary loss does."""

    def __init__(self):
        super().__init__()
        self.net = nn.ModuleList([nn.Linear(32, 32), nn.Linear(32, 10)])

    def forward(self, x):
        h = torch.relu(self.net[0](x))
        return self.net[1](h), h.pow(2).mean()


def aux_loss(out, y):
    logits, aux = out
    return models.loss_fn(logits, y) + 0.01 * aux


def test_trial_monitors_read_a_logits_aux_output():
    """Before: the default output monitor crashed on the tuple ('tuple' object has no attribute 'abs')."""
    t = trial(WithAux, mlp_data(), steps=2, loss_fn=aux_loss)
    assert all(v > 0 for v in t.get("reference", "output_logit_max/output"))


BAD_MONITORS = {
    "a float": (Monitor("f", lambda m: [("output", m, lambda mod, a, o: 1.0)]), "returned 1.0 \\(a float, not a tensor\\)"),
    "None": (Monitor("n", lambda m: [("output", m, lambda mod, a, o: None)]), "returned None"),
    "a vector": (Monitor("v", lambda m: [("output", m, lambda mod, a, o: o.abs().amax(0))]),
                 "returned a tensor of shape \\(10,\\)"),
    "where gives a string": (Monitor("w", lambda m: "output"), "where\\(model\\) returned 'output'"),
}


@pytest.mark.parametrize("kind", BAD_MONITORS)
def test_a_bad_monitor_is_named_not_blamed_on_the_data(kind):
    """Before: 'MLP cannot run on this data (a batch of ...)' or a TypeError from inside the hooks."""
    monitor, said = BAD_MONITORS[kind]
    with pytest.raises(inputs.InputError, match=f"monitor '{monitor.name}.*{said}") as info:
        trial("mlp", steps=1, monitors=[monitor])
    assert "cannot run on this data" not in str(info.value)


# ---------------------------------------------------------------------------------------------
# Data as learners have it: DataLoaders and lists of batches
# ---------------------------------------------------------------------------------------------

def batches_of(data: TensorDataset, size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = data.tensors
    return [(x[i:i + size], y[i:i + size]) for i in range(0, len(x), size)]


def test_a_dataloader_is_iterated_as_it_gives_its_batches():
    """The loader's own batches, in its order (not its .dataset re-batched by train's seeded order)."""
    data = mlp_data()
    loader = DataLoader(data, batch_size=32, shuffle=False)
    a = train("mlp", loader, "fp32", steps=10, **FAST)  # 10 steps > 8 batches: a second epoch
    b = train("mlp", batches_of(data, 32), "fp32", steps=10, **FAST)
    assert same_weights(a.model, b.model) and a.loss == b.loss
    c = train("mlp", data, "fp32", steps=10, batch_size=32, **FAST)  # the tensor path draws other batches
    assert a.loss != c.loss


def test_a_shuffling_loader_gives_the_same_batches_to_every_run():
    loader = DataLoader(mlp_data(), batch_size=32, shuffle=True)
    torch.manual_seed(123)
    a = train("mlp", loader, "fp32", steps=12, **FAST)
    torch.manual_seed(456)  # the caller's RNG does not decide the order: (seed, epoch) does
    b = train("mlp", loader, "fp32", steps=12, **FAST)
    assert same_weights(a.model, b.model)
    c = train("mlp", loader, "fp32", steps=12, **{**FAST, "seed": 1})
    assert not same_weights(a.model, c.model)


def test_accumulation_takes_one_loader_batch_per_micro_batch():
    data = mlp_data()
    a = train("mlp", DataLoader(data, batch_size=16), "fp32", steps=3, accum_steps=2, **FAST)
    b = train("mlp", batches_of(data, 16), "fp32", steps=3, accum_steps=2, **FAST)
    assert same_weights(a.model, b.model) and a.steps_done == 3


@pytest.mark.parametrize("shuffle", [False, True])
def test_resume_with_a_loader_is_bit_identical(tmp_path, shuffle):
    """Resume skips the batches already trained on (8 per epoch here: the resume crosses an epoch)."""
    make = lambda: DataLoader(mlp_data(), batch_size=32, shuffle=shuffle)  # noqa: E731 (a fresh loader, as after a crash)
    whole = train("mlp", make(), "fp16", steps=11, **FAST)
    train("mlp", make(), "fp16", steps=5, checkpoint_dir=tmp_path, **FAST)
    rest = train("mlp", make(), "fp16", steps=11, checkpoint_dir=tmp_path, resume=True, **FAST)
    assert rest.start_step == 5 and same_weights(whole.model, rest.model) and whole.loss == rest.loss


def test_resume_refuses_a_loader_of_another_length_or_tensor_data(tmp_path):
    train("mlp", DataLoader(mlp_data(), batch_size=32), "fp32", steps=2, checkpoint_dir=tmp_path, **FAST)
    with pytest.raises(ValueError, match="dataset_size=8 in the checkpoint, 4 now"):
        train("mlp", DataLoader(mlp_data(), batch_size=64), "fp32", steps=4, checkpoint_dir=tmp_path, resume=True,
              **FAST)
    with pytest.raises(ValueError, match="data='batches' in the checkpoint, 'tensors' now"):
        train("mlp", mlp_data(), "fp32", steps=4, checkpoint_dir=tmp_path, resume=True, batch_size=32, **FAST)
    assert checkpoint.load(checkpoint.path_in(tmp_path))["config"]["batch_size"] is None


@pytest.mark.parametrize("data,said", [
    ("batch_size", "batch_size=32 with data a DataLoader: its batches have their size already"),
    ((b for b in [(torch.zeros(2, 32), torch.zeros(2, dtype=torch.long))]), "is an iterator"),
    (mlp_data(), None),
    ("dataset", "of single samples; wrap it in a DataLoader"),
    ([(torch.zeros(2, 32),)], "must be a TensorDataset"),
    ([], "gave no batch in epoch 0 \\(it is empty\\)"),
    ("empty loader", "gave no batch in epoch 0"),
    ("dict batches", "a list of \\(inputs, targets\\) batches, got \\[\\{'x'"),
    ("loader of dicts", "batch 0 is .* each batch must be an \\(inputs, targets\\) pair"),
])
def test_bad_data_is_named(data, said):
    class Samples(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return torch.zeros(32), 0

    kw = {}
    if data == "batch_size":
        data, kw = DataLoader(mlp_data(), batch_size=32), {"batch_size": 32}
    elif data == "dataset":
        data = Samples()
    elif data == "empty loader":
        data = DataLoader(TensorDataset(torch.zeros(0, 32), torch.zeros(0, dtype=torch.long)), batch_size=4)
    elif data == "dict batches":
        data = [{"x": torch.zeros(2, 32)}]
    elif data == "loader of dicts":
        data = DataLoader([{"x": torch.zeros(32)}] * 4, batch_size=2)
    if said is None:  # the control: a TensorDataset with batch_size is fine
        assert train("mlp", data, "fp32", steps=1, batch_size=32, **FAST).steps_done == 1
        return
    with pytest.raises(inputs.InputError, match=said):
        train("mlp", data, "fp32", steps=1, **FAST, **kw)


def test_trial_takes_a_loader_and_gives_every_run_the_same_batches():
    loader = DataLoader(mlp_data(), batch_size=32, shuffle=True)
    t = trial("mlp", loader, precisions=("fp32",), steps=10, monitors=[])
    assert t.get("fp32", "loss") == t.get("reference", "loss")  # a second fp32 run on the same batches: no gap
    again = trial("mlp", loader, precisions=("fp32",), steps=10, monitors=[])
    assert again.get("reference", "loss") == t.get("reference", "loss")
    with pytest.raises(inputs.InputError, match="batch_size=16 with data a DataLoader"):
        trial("mlp", loader, steps=1, batch_size=16)


# ---------------------------------------------------------------------------------------------
# Settings as one thing
# ---------------------------------------------------------------------------------------------

#: train()'s keywords before issue 30 (23 parameters): every one must still work.
OLD_KEYWORDS = ("model", "data", "precision", "steps", "lr", "seed", "device", "grad_clip", "accum_steps",
                "checkpoint_dir", "resume", "batch_size", "checkpoint_every", "optimizer", "weight_decay", "scheduler",
                "loss_fn", "scaler_kwargs", "progress", "size", "n_samples", "parallel", "on_step")


def test_train_takes_at_most_12_parameters_and_every_old_keyword():
    params = inspect.signature(train).parameters
    assert len(params) <= 12
    settings = {f.name for f in __import__("dataclasses").fields(TrainSettings)}
    assert set(OLD_KEYWORDS) - {"model", "data", "precision"} <= settings


def test_keywords_and_a_settings_object_give_the_same_run(tmp_path):
    kw = dict(steps=4, lr=3e-3, seed=1, grad_clip=1.0, accum_steps=2, batch_size=32, optimizer="sgd",
              weight_decay=0.01, scheduler="cosine", n_samples=256, progress=False,
              scaler_kwargs={"init_scale": 2.0**8})
    a = train("mlp", None, "fp16", **kw)
    s = TrainSettings(**kw)
    b = train("mlp", None, "fp16", settings=s)
    c = train("mlp", None, "fp16", settings=s.replace(lr=1e-2), lr=3e-3)  # a keyword overrides the settings
    assert same_weights(a.model, b.model) and same_weights(a.model, c.model)


def test_settings_are_frozen_checked_and_plain():
    s = TrainSettings(lr=np.float64(3e-3), steps=np.int64(5), grad_clip=torch.tensor(0.5))
    assert (s.lr, s.steps, s.grad_clip) == (3e-3, 5, 0.5) and type(s.steps) is int and type(s.lr) is float
    with pytest.raises(Exception):
        s.lr = 1.0  # frozen
    with pytest.raises(inputs.InputError, match="grad_clip must be a finite number > 0"):
        TrainSettings(grad_clip=-1)
    with pytest.raises(inputs.InputError, match="grad_clip must be a finite number > 0"):
        s.replace(grad_clip=0)
    with pytest.raises(inputs.InputError, match="unexpected setting 'stpes' \\(did you mean 'steps'\\?\\)"):
        train("mlp", None, "fp32", stpes=3)
    with pytest.raises(inputs.InputError, match="settings must be an ampcourse.train.TrainSettings"):
        train("mlp", None, "fp32", settings={"steps": 3})


def test_positional_steps_lr_seed_still_work():
    a = train("mlp", None, "fp32", 3, 3e-3, 1, "cpu", batch_size=32, n_samples=256, progress=False)
    b = train("mlp", None, "fp32", steps=3, lr=3e-3, seed=1, device="cpu", batch_size=32, n_samples=256, progress=False)
    assert same_weights(a.model, b.model)
