"""Hardening round 4 (issue 30): each defect class found by trying it, with the input that found it.

Each test failed on the code before its fix (the comment says how); together with tests/checkpoint/test_checkpoint_sharded.py
(sharded checkpoints) and tests/test_inputs.py (the front door).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from ampcourse import checkpoint, models
from ampcourse.device import pick
from ampcourse.train import Parallel, train, train_step

FAST = dict(lr=1e-2, seed=0, batch_size=32, n_samples=256, progress=False)


def one_step_setup():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp = pick("cpu", "fp32")
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    return model, opt, amp.make_scaler(), amp, x, y


# ---------------------------------------------------------------------------------------------
# Resume: fewer steps, another grad_clip or accum_steps
# ---------------------------------------------------------------------------------------------

def test_resume_with_fewer_steps_than_the_checkpoint_holds_is_refused(tmp_path):
    """Before: exit 0 and the 4-step run came back (steps_done 4) when 2 steps were asked for."""
    train("mlp", None, "fp32", steps=4, checkpoint_dir=tmp_path, **FAST)
    with pytest.raises(ValueError, match=r"holds 4 completed steps and steps=2 now asks for fewer"):
        train("mlp", None, "fp32", steps=2, checkpoint_dir=tmp_path, resume=True, **FAST)
    same = train("mlp", None, "fp32", steps=4, checkpoint_dir=tmp_path, resume=True, **FAST)  # equal: the finished run
    assert same.steps_done == 4 and same.start_step == 4


def test_resume_with_fewer_steps_is_one_line_from_the_cli(tmp_path, capsys):
    from ampcourse.train import main

    common = ["--no-progress", "--samples", "256", "--global-batch-size", "32", "--checkpoint-dir", str(tmp_path)]
    assert main([*common, "--steps", "4"]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        main([*common, "--steps", "2", "--resume"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.count("\n") == 1 and "holds 4 completed steps" in err, err


@pytest.mark.parametrize("change,name", [(dict(grad_clip=0.5), "grad_clip"), (dict(accum_steps=2), "accum_steps")])
def test_resume_with_another_grad_clip_or_accum_steps_is_refused(tmp_path, change, name):
    """Before: accepted silently, and the resumed run was another run."""
    train("mlp", None, "fp32", steps=2, checkpoint_dir=tmp_path, grad_clip=1.0, **FAST)
    with pytest.raises(ValueError, match=f"{name}=.* in the checkpoint"):
        train("mlp", None, "fp32", steps=4, checkpoint_dir=tmp_path, resume=True, **{**FAST, "grad_clip": 1.0, **change})


def test_a_checkpoint_records_grad_clip(tmp_path):
    train("mlp", None, "fp32", steps=1, checkpoint_dir=tmp_path, grad_clip=0.25, **FAST)
    assert checkpoint.load(checkpoint.path_in(tmp_path))["config"]["grad_clip"] == 0.25


# ---------------------------------------------------------------------------------------------
# train_step: grad_clip, an empty window, a loss without a graph
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("clip", [math.nan, -1.0, 0.0, math.inf, "1"])
def test_train_step_refuses_a_bad_grad_clip_and_changes_nothing(clip):
    """Before: nan made every weight nan, -1 stepped uphill, 0 zeroed the gradients; all without a word."""
    model, opt, scaler, amp, x, y = one_step_setup()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="grad_clip must be a finite number > 0 or None"):
        train_step(model, [(x, y)], models.loss_fn, opt, scaler, amp, grad_clip=clip)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_train_step_still_clips_with_a_good_value():
    model, opt, scaler, amp, x, y = one_step_setup()
    stats = train_step(model, [(x, y)], models.loss_fn, opt, scaler, amp, grad_clip=1e-3)
    assert stats.grad_norm > 1e-3  # recorded before clipping


@pytest.mark.parametrize("window,said", [([], "micro_batches is empty"), ([(1,)], r"micro_batches\[0\] must be"),
                                         ("xy", "must be a list of")])
def test_train_step_refuses_an_empty_or_malformed_window(window, said):
    """Before: train_step([]) was an IndexError from reading the losses back."""
    model, opt, scaler, amp, *_ = one_step_setup()
    with pytest.raises(ValueError, match=said):
        train_step(model, window, models.loss_fn, opt, scaler, amp)


LOSSES_WITHOUT_GRAPH = {
    "detached": lambda out, y: models.loss_fn(out, y).detach(),
    "rewrapped from .item()": lambda out, y: torch.tensor(models.loss_fn(out, y).item()),
    "constant": lambda out, y: torch.tensor(1.0),
}


@pytest.mark.parametrize("kind", LOSSES_WITHOUT_GRAPH)
def test_a_loss_without_a_graph_is_named_in_train(kind):
    """Before: autograd's "element 0 of tensors does not require grad and does not have a grad_fn"."""
    with pytest.raises(ValueError, match="does not depend on the model's parameters"):
        train("mlp", None, "fp32", steps=2, loss_fn=LOSSES_WITHOUT_GRAPH[kind], **FAST)


def test_a_step_under_no_grad_says_so():
    model, opt, scaler, amp, x, y = one_step_setup()
    with torch.no_grad(), pytest.raises(ValueError, match="gradients are off"):
        train_step(model, [(x, y)], models.loss_fn, opt, scaler, amp)


@pytest.mark.parametrize("kind", LOSSES_WITHOUT_GRAPH)
def test_a_loss_without_a_graph_is_named_in_trial(kind):
    from ampcourse.trial import trial

    with pytest.raises(ValueError, match="does not depend on the model's parameters"):
        trial("mlp", steps=2, loss_fn=LOSSES_WITHOUT_GRAPH[kind], monitors=[])


# ---------------------------------------------------------------------------------------------
# Parallel: a wrap that forgets to return, a checkpointer that is a string
# ---------------------------------------------------------------------------------------------

def test_a_wrap_that_returns_none_is_named():
    """Before: AttributeError: 'NoneType' object has no attribute 'parameters', from inside train()."""
    def wrap(module):
        module.train()  # forgot `return module`

    with pytest.raises(ValueError, match="parallel.wrap must return the model to train .* forget to `return`"):
        train("mlp", None, "fp32", steps=1, parallel=Parallel(wrap=wrap), **FAST)


def test_a_checkpointer_that_is_a_string_is_named(tmp_path):
    """Before: AttributeError: 'str' object has no attribute 'path'."""
    with pytest.raises(ValueError, match="parallel.checkpointer must be None"):
        train("mlp", None, "fp32", steps=1, checkpoint_dir=tmp_path, parallel=Parallel(checkpointer="file"), **FAST)
