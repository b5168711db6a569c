"""Reference models and synthetic data: deterministic, learnable, validated names."""

import pytest
import torch

from ampcourse.models import MODELS, loss_fn, make_dataset, make_model, make_task


@pytest.mark.parametrize("name", MODELS)
def test_same_seed_same_model_and_data(name):
    a, b = make_task(name, n=64, seed=3), make_task(name, n=64, seed=3)
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(p, q)
    for s, t in zip(a.data.tensors, b.data.tensors):
        assert torch.equal(s, t)
    c = make_task(name, n=64, seed=4)
    assert not torch.equal(a.data.tensors[0], c.data.tensors[0])


@pytest.mark.parametrize("name", MODELS)
def test_models_learn_in_a_few_steps(name):
    task = make_task(name, n=256, seed=0)
    x, y = task.data.tensors
    opt = torch.optim.AdamW(task.model.parameters(), lr=3e-3)
    losses = []
    for _ in range(40):
        loss = loss_fn(task.model(x[:64]), y[:64])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


def test_make_model_does_not_disturb_the_global_rng():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    make_model("transformer")
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("call,match", [
    (lambda: make_model("resnet"), "unknown model 'resnet'; choose one of mlp, cnn, transformer"),
    (lambda: make_model("mlp", size="huge"), "unknown size 'huge'; choose one of tiny, small, large"),
    (lambda: make_dataset("mlp", n=0), "positive int"),
    (lambda: make_dataset("cnn", n=2.5), "positive int"),
])
def test_bad_names_and_sizes(call, match):
    with pytest.raises(ValueError, match=match):
        call()
