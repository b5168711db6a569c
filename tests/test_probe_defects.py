"""Defects an independent tester hit in the newer code (train, trial, checkpoint resume), each pinned by a test.

Every test here failed before its fix: a raw RuntimeError from inside torch, a setting silently replaced on
resume, or an error only after all the work was done.
"""
import io
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import numpy as np
import pytest
import torch

from ampcourse import trial as trial_mod
from ampcourse.trial import cli as trial_cli, runs as trial_runs
from ampcourse.train import cli, make_optimizer, train
try:
    from ampcourse.train import optimizer_settings
except ImportError:
    optimizer_settings = None


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


def test_trial_refuses_an_lr_beyond_float32() -> None:
    with pytest.raises(ValueError, match="lr must be a number float32 can hold"):
        trial_mod.trial("mlp", steps=1, lr=1e39)


def _run_cli(main, argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with redirect_stderr(err), redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as done:
            code = done.code
    return code, err.getvalue()


def test_train_cli_huge_lr_is_one_line_exit_2() -> None:
    code, err = _run_cli(cli.main, ["--steps", "1", "--lr", "1e39", "--no-progress"])
    assert code == 2 and err.startswith("ampcourse.train: error: --lr must be") and err.count("\n") == 1


def test_trial_cli_huge_lr_is_one_line_exit_2() -> None:
    code, err = _run_cli(trial_mod.main, ["--model", "mlp", "--steps", "1", "--lr", "1e39"])
    assert code == 2 and err.startswith("ampcourse.trial: error: lr must be")


# --- trial --plot with a suffix matplotlib cannot write: refused after all the steps had run ------------------

def test_trial_cli_refuses_an_unknown_plot_format_before_training(tmp_path: Path, monkeypatch) -> None:
    ran = []
    monkeypatch.setattr(trial_cli, "trial", lambda *a, **k: ran.append(1))
    code, err = _run_cli(trial_mod.main, ["--model", "mlp", "--steps", "1", "--plot", str(tmp_path / "t.txt")])
    assert code == 2 and "--plot" in err and ".png" in err
    assert ran == []  # before: the trial ran to the end, printed its summary, then failed in savefig


# --- resume with other GradScaler settings: the checkpoint's were put back silently ---------------------------

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


# --- checkpoint.load with a map_location this machine lacks: the good file was blamed ------------------------

@pytest.mark.parametrize("where,says", [
    ("cuda:{n}", "CUDA device"),  # one past the last GPU (cuda:0 on a machine without one)
    ("foo", "is not a device"),
    (3.5, "map_location must be a device"),
])
def test_load_names_a_bad_map_location_not_the_file(tmp_path: Path, where, says) -> None:
    from ampcourse import checkpoint
    train("mlp", steps=1, checkpoint_dir=tmp_path, progress=False, precision="fp32")
    # before: CheckpointError "it is truncated or not a torch file (RuntimeError)": move a good file aside?
    with pytest.raises(ValueError, match=says) as caught:
        checkpoint.load(checkpoint.path_in(tmp_path),
                        map_location=where.format(n=torch.cuda.device_count()) if isinstance(where, str) else where)
    assert "truncated" not in str(caught.value)
    assert checkpoint.load(checkpoint.path_in(tmp_path), map_location=torch.device("cpu"))["step"] == 1


# --- the train CLI's errors named train()'s Python arguments, not its flags ----------------------------------

@pytest.mark.parametrize("argv,says", [
    (["--steps", "0"], "error: --steps must be an int >= 1"),  # was "steps must be"
    (["--global-batch-size", "2048"], "error: --global-batch-size 2048 is larger than the dataset"),  # "batch_size"
    (["--samples", "0"], "error: --samples must be a positive int"),  # "n_samples"
    (["--resume"], "error: --resume needs a --checkpoint-dir"),  # "resume and checkpoint_every need a checkpoint_dir"
])
def test_train_cli_errors_name_the_flags(argv, says) -> None:
    code, err = _run_cli(cli.main, ["--no-progress", *argv])
    assert code == 2 and says in err, err


def test_train_cli_existing_checkpoint_says_add_resume(tmp_path: Path) -> None:
    base = ["--no-progress", "--steps", "1", "--checkpoint-dir", str(tmp_path)]
    assert _run_cli(cli.main, base)[0] == 0
    code, err = _run_cli(cli.main, base)
    # before: "... pass resume=True to continue that run, or choose an empty checkpoint_dir" (Python names)
    assert code == 2 and "pass --resume to continue that run, or choose an empty --checkpoint-dir" in err, err


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


# --- checkpoint.save wrote files load() refuses, over the good checkpoint --------------------------------------

def _good_state():
    from ampcourse import checkpoint
    m = torch.nn.Linear(4, 2)
    return checkpoint.capture(1, m, torch.optim.AdamW(m.parameters()), torch.amp.GradScaler("cpu"))


class _Note:  # a user's own object in the config: weights_only=True cannot unpickle it
    pass


@pytest.mark.parametrize("bad,says", [
    (lambda s: {**s, "config": {"note": _Note()}}, r"state\['config'\]\['note'\] is a _Note"),
    (lambda s: {**s, "history": {"loss": [1.0, _Note()]}}, r"state\['history'\]\['loss'\]\[1\] is a _Note"),
    (lambda s: [1, 2], "save\\(\\) writes a checkpoint made by checkpoint.capture"),
])
def test_save_refuses_what_load_could_not_read_and_keeps_the_good_file(tmp_path: Path, bad, says) -> None:
    from ampcourse import checkpoint
    target = tmp_path / "checkpoint.pt"
    checkpoint.save(_good_state(), target)
    # before: save() succeeded, replacing the good checkpoint with one that load() refuses ("holds Python objects")
    with pytest.raises(checkpoint.CheckpointError, match=says):
        checkpoint.save(bad(_good_state()), target)
    assert checkpoint.load(target)["step"] == 1 and [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]


@pytest.mark.parametrize("pieces,says", [
    (lambda m, o, s: (None, o, s), "model must be a torch.nn"),
    (lambda m, o, s: (m, None, s), "optimizer must be a torch.optim"),
    (lambda m, o, s: (m, o, None), r"scaler must be .*GradScaler\(enabled=False\)"),
])
def test_capture_and_restore_name_a_missing_piece(pieces, says) -> None:
    from ampcourse import checkpoint
    m = torch.nn.Linear(4, 2)
    o = torch.optim.AdamW(m.parameters())
    s = torch.amp.GradScaler("cpu")
    state = checkpoint.capture(0, m, o, s)
    # before: AttributeError: 'NoneType' object has no attribute 'state_dict' / 'is_enabled'
    with pytest.raises(TypeError, match=says):
        checkpoint.capture(1, *pieces(m, o, s))
    with pytest.raises(TypeError, match=says):
        checkpoint.restore(state, *pieces(m, o, s))
    with pytest.raises(TypeError, match="history must be a dict"):
        checkpoint.capture(1, m, o, s, history=[1.0])


# --- local_indices / StepIndices: a rank past the world, or an uneven split, lost samples silently -------------

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


def test_train_cli_refuses_one_file_for_summary_and_history(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    # before: the history was written, then the summary overwrote it: exit 0, history lost
    code, err = _run_cli(cli.main, ["--no-progress", "--steps", "1", "--out", "r.json", "--history-out", "./r.json"])
    assert code == 2 and "--out and --history-out name the same file" in err
    assert list(tmp_path.iterdir()) == []


def test_trial_cli_refuses_one_file_for_json_and_plot(tmp_path: Path, monkeypatch) -> None:
    ran = []
    monkeypatch.setattr(trial_cli, "trial", lambda *a, **k: ran.append(1))
    out = str(tmp_path / "t.png")
    code, err = _run_cli(trial_mod.main, ["--model", "mlp", "--steps", "1", "--out", out, "--plot", out])
    assert code == 2 and "--out and --plot name the same file" in err and ran == []


def test_train_cli_ctrl_c_is_one_line_and_keeps_the_last_checkpoint(tmp_path: Path, monkeypatch) -> None:
    from ampcourse import checkpoint
    from ampcourse.train import loop
    real, calls = loop.train_step, []

    def interrupted_at_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, "train_step", interrupted_at_third)
    argv = ["--no-progress", "--steps", "5", "--checkpoint-every", "2", "--checkpoint-dir", str(tmp_path)]
    # before: a KeyboardInterrupt traceback from inside train()
    code, err = _run_cli(cli.main, argv)
    assert code == 130 and err.count("\n") == 1 and "add --resume to the same command" in err, err
    assert checkpoint.load(checkpoint.path_in(tmp_path))["step"] == 2  # the step-2 checkpoint survived


@pytest.mark.parametrize("damage", ["bytes", "folder"])
def test_sharded_latest_pointer_damage_is_a_checkpoint_error(tmp_path: Path, damage) -> None:
    from ampcourse import checkpoint
    pointer = checkpoint.ShardedCheckpointer().path(tmp_path)
    pointer.parent.mkdir(parents=True)
    if damage == "bytes":
        pointer.write_bytes(b"\xff\xfe\x00garbage")  # before: UnicodeDecodeError
    else:
        pointer.mkdir()  # before: IsADirectoryError, a traceback from the CLI
    with pytest.raises(checkpoint.CheckpointError, match="cannot resume from"):
        checkpoint.ShardedCheckpointer().read(tmp_path)


@pytest.mark.parametrize("argv,says", [
    (["--fused", "--optimizer", "sgd"], "--fused applies to --optimizer adam and adamw only"),  # was ignored, exit 0
    (["--inject-inf", "0:5"], "this launch runs at most --steps 2 steps"),  # never fired, exit 0
])
def test_train_cli_refuses_flags_that_would_do_nothing(argv, says, monkeypatch) -> None:
    from ampcourse.train import loop
    monkeypatch.setattr(loop, "train_step", lambda *a, **k: pytest.fail("trained despite a flag that does nothing"))
    code, err = _run_cli(cli.main, ["--no-progress", "--steps", "2", *argv])
    assert code == 2 and says in err, err


def test_resume_without_the_scheduler_it_was_written_with_is_refused(tmp_path: Path) -> None:
    kw = dict(checkpoint_dir=tmp_path, progress=False, precision="fp32")
    train("mlp", steps=2, scheduler="cosine", **kw)
    # before: resumed silently at the schedule's lr of step 2, held constant from there
    with pytest.raises(ValueError, match="written with an LR scheduler and this run has none"):
        train("mlp", steps=2, resume=True, **kw)
    assert train("mlp", steps=2, resume=True, scheduler="cosine", **kw).steps_done == 2


def test_train_cli_flag_names_leave_prose_and_double_names_alone() -> None:
    text = "move it aside or point checkpoint_dir / --checkpoint-dir at another directory; the steps of the first run"
    assert cli._as_flags(text) == ("move it aside or point --checkpoint-dir at another directory; "
                                   "the steps of the first run")


def test_trial_pair_of_tensors_of_different_lengths_is_a_value_error() -> None:
    # before: AssertionError "Size mismatch between tensors" from torch's TensorDataset
    with pytest.raises(ValueError, match=r"inputs \(64, 32\) and targets \(10,\) must have one row per sample"):
        trial_mod.trial(lambda: torch.nn.Linear(32, 10), data=(X, Y[:10]), steps=1)
