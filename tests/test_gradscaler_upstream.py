"""PyTorch's own GradScaler tests, ported to CPU and run against both torch.amp.GradScaler and LossScaler.

Where they come from (pytorch/pytorch, read for this port; re-expressed here, not copied):

- test/test_torch.py, TestTorchDeviceType: ``test_grad_scaling_state_dict``, ``test_grad_scaling_autocast``
  (SGD, Adam, AdamW; for-loop and foreach), ``test_grad_scaling_clipping``,
  ``test_grad_scaling_clipping_separate_unscale``, ``test_grad_scaling_penalty``,
  ``test_grad_scaling_accumulation``, ``test_grad_scaling_multiple``, plus the shared harness
  ``_create_scaling_case`` / ``_run_scaling_case``: two identical models, one trained plainly and one
  through the scaler with an inf injected at one iteration; the final scale must be
  init x growth**clean x backoff**skipped and the weights must match the control.
- test/test_optim.py: ``test_grad_scaling_autocast_fused_optimizers`` (a fused optimizer, which unscales
  and skips inside its own kernel, against the same optimizer unfused, both under fp16 autocast).
- test/test_cuda.py: ``test_grad_scaling_scale`` (nested lists/tuples of outputs), on CPU.

Left out, because they test private pieces rather than the public API: ``test_grad_scaling_unscale``
and ``test_grad_scaling_update_scale`` (they call the kernels ``torch._amp_foreach_non_finite_check_and_unscale_``
and ``torch._amp_update_scale_`` directly; tests/test_scaling.py compares LossScaler's versions of both with
them), ``test_grad_scaling_unscale_sparse`` (calls ``GradScaler._unscale_grads_``), the parts of the state-dict
test that read ``_init_growth_tracker``, and the deprecated ``step(grad_scaler=...)`` protocol. The multi-GPU
test needs two GPUs.
"""

from __future__ import annotations

import copy
import itertools
import pickle

import pytest
import torch

from ampcourse.scaling import LossScaler

DEVICE = "cpu"
SCALERS = {"GradScaler": torch.amp.GradScaler, "LossScaler": LossScaler}


@pytest.fixture(params=SCALERS.values(), ids=SCALERS.keys())
def Scaler(request):
    return request.param


# --- the shared harness ---------------------------------------------------------------------------------

def create_scaling_case(optimizer_ctor=torch.optim.SGD, optimizer_kwargs=None, dtype=torch.float32):
    """Two identical 2-layer models with their optimizers, 4 batches of data, MSE loss, and the iteration to poison."""
    torch.manual_seed(0)
    data = [(torch.randn(8, 8, dtype=dtype), torch.randn(8, 8, dtype=dtype)) for _ in range(4)]
    control = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)).to(dtype)
    scaling = copy.deepcopy(control)
    kwargs = {"lr": 1.0, **(optimizer_kwargs or {})}
    return (control, scaling, optimizer_ctor(control.parameters(), **kwargs), optimizer_ctor(scaling.parameters(), **kwargs),
            data, torch.nn.MSELoss(), 2)


def run_scaling_case(Scaler, run, unskipped, skipped, atol=1e-7, optimizer_ctor=torch.optim.SGD, optimizer_kwargs=None):
    """Train control (no scaling API) and scaling (with it) and compare; check the final scale's arithmetic."""
    for enabled in (True, False):
        control, scaling, opt_control, opt_scaling, data, loss_fn, skip_iter = create_scaling_case(
            optimizer_ctor, optimizer_kwargs)
        scaler = Scaler(DEVICE, init_scale=128.0, growth_factor=2.0, enabled=enabled, growth_interval=1)
        run(data, control, opt_control, scaler, loss_fn, skip_iter, False)
        run(data, scaling, opt_scaling, scaler, loss_fn, skip_iter, True)
        if enabled:
            growth = scaler.get_growth_factor() ** unskipped if unskipped > 0 else 1.0
            backoff = scaler.get_backoff_factor() ** skipped
            assert scaler.get_scale() == 128.0 * growth * backoff
        else:
            assert scaler.get_scale() == 1.0
        for c, s in zip(control.parameters(), scaling.parameters()):
            torch.testing.assert_close(c, s, atol=atol, rtol=1e-5)


def poison(model, i, skip_iter, scaler):
    """At skip_iter, make one gradient inf when the scaler is on (the control run skips that step itself)."""
    if i == skip_iter and scaler.is_enabled():
        model[1].weight.grad.data.fill_(float("inf"))


def backward_and_step(loss, model, optimizer, scaler, i, skip_iter, try_scaling_api):
    """Upstream's common tail: the scaler's backward/step/update (poisoned at skip_iter), or the control run that
    skips skip_iter itself."""
    if try_scaling_api:
        scaler.scale(loss).backward()
        poison(model, i, skip_iter, scaler)
        scaler.step(optimizer)
        scaler.update()
    else:
        loss.backward()
        if not scaler.is_enabled() or i != skip_iter:
            optimizer.step()


# --- test_torch.py --------------------------------------------------------------------------------------

@pytest.mark.parametrize("lazy_init_scale", [True, False])
def test_grad_scaling_state_dict(Scaler, lazy_init_scale):
    s0 = Scaler(DEVICE, init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
    s1 = Scaler(DEVICE, init_scale=6.0, growth_factor=7.0, backoff_factor=0.8, growth_interval=1)
    if lazy_init_scale:  # the scale tensor exists before the load
        s1.scale(torch.full((1,), 4.0, dtype=torch.float32, device=DEVICE))
    s1.load_state_dict(s0.state_dict())
    assert s1.get_scale() == 3.0
    assert s1.get_growth_factor() == 4.0
    assert s1.get_backoff_factor() == 0.5
    assert s1.get_growth_interval() == 2
    assert s1.state_dict()["_growth_tracker"] == 0


def test_grad_scaling_setters(Scaler):
    s = Scaler(DEVICE)
    s.set_growth_factor(3.0)
    s.set_backoff_factor(0.25)
    s.set_growth_interval(7)
    assert (s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval()) == (3.0, 0.25, 7)
    assert s.state_dict()["growth_factor"] == 3.0 and s.is_enabled()


def test_grad_scaling_pickles_between_iterations(Scaler):
    s = Scaler(DEVICE, init_scale=8.0, growth_interval=3)
    s.scale(torch.ones(()))
    t = pickle.loads(pickle.dumps(s))
    assert t.get_scale() == 8.0 and t.get_growth_interval() == 3


def autocast_run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
    for i, (x, y) in enumerate(data):
        optimizer.zero_grad()
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            loss = loss_fn(model(x), y)
        backward_and_step(loss, model, optimizer, scaler, i, skip_iter, try_scaling_api)


AUTOCAST_CASES = [(torch.optim.SGD, {"foreach": False}), (torch.optim.SGD, {"foreach": True}),
                  (torch.optim.Adam, {"foreach": False, "lr": 1e-3}), (torch.optim.Adam, {"foreach": True, "lr": 1e-3}),
                  (torch.optim.AdamW, {"foreach": False, "lr": 1e-3}), (torch.optim.AdamW, {"foreach": True, "lr": 1e-3})]


@pytest.mark.parametrize("optimizer_ctor, optimizer_kwargs", AUTOCAST_CASES,
                         ids=[f"{c.__name__}-{'foreach' if k['foreach'] else 'forloop'}" for c, k in AUTOCAST_CASES])
def test_grad_scaling_autocast(Scaler, optimizer_ctor, optimizer_kwargs):
    # 3 clean iterations grow the scale, the poisoned one backs it off; bf16 autocast needs a looser atol
    run_scaling_case(Scaler, autocast_run, unskipped=3, skipped=1, atol=1e-3, optimizer_ctor=optimizer_ctor,
                     optimizer_kwargs=optimizer_kwargs)


def test_grad_scaling_clipping(Scaler):
    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        max_norm = 0.2  # small enough that clipping acts
        for i, (x, y) in enumerate(data):
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            if try_scaling_api:
                scaler.scale(loss).backward()
                # clip the *scaled* gradients against a scaled threshold: same result as unscale-then-clip
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm * scaler.get_scale())
                poison(model, i, skip_iter, scaler)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                if not scaler.is_enabled() or i != skip_iter:
                    optimizer.step()

    run_scaling_case(Scaler, run, unskipped=3, skipped=1, atol=1e-5)


def test_grad_scaling_clipping_separate_unscale(Scaler):
    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        max_norm = 0.2
        for i, (x, y) in enumerate(data):
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            if try_scaling_api:
                scaler.scale(loss).backward()
                poison(model, i, skip_iter, scaler)
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, error_if_nonfinite=False)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                if not scaler.is_enabled() or i != skip_iter:
                    optimizer.step()

    run_scaling_case(Scaler, run, unskipped=3, skipped=1)


def test_grad_scaling_penalty(Scaler):
    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        for i, (x, y) in enumerate(data):
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            if try_scaling_api:
                # a gradient penalty: autograd.grad of the scaled loss, unscaled by hand before use
                grads = torch.autograd.grad(scaler.scale(loss), model.parameters(), create_graph=True)
                inv_scale = 1.0 / scaler.get_scale()
                grads = [g * inv_scale for g in grads]
            else:
                grads = torch.autograd.grad(loss, model.parameters(), create_graph=True)
            penalty = sum(g.pow(2).sum() for g in grads).sqrt()
            loss = loss + penalty
            backward_and_step(loss, model, optimizer, scaler, i, skip_iter, try_scaling_api)

    run_scaling_case(Scaler, run, unskipped=3, skipped=1)


def test_grad_scaling_accumulation(Scaler):
    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        iters_to_accumulate = 2
        for i, (x, y) in enumerate(data):
            loss = loss_fn(model(x), y) / iters_to_accumulate
            if try_scaling_api:
                scaler.scale(loss).backward()
            else:
                loss.backward()
            if (i + 1) % iters_to_accumulate == 0:
                if try_scaling_api:
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    optimizer.step()
                optimizer.zero_grad()

    run_scaling_case(Scaler, run, unskipped=2, skipped=0)


def test_grad_scaling_multiple(Scaler):
    """Two models, two optimizers, two losses, one scaler: an inf in one optimizer's gradients skips only its step."""
    for enabled in (True, False):
        c0, s0, oc0, os0, data, loss_fn, skip_iter = create_scaling_case()
        c1, s1, oc1, os1, _, _, _ = create_scaling_case()
        scaler = Scaler(DEVICE, init_scale=128.0, growth_factor=2.0, enabled=enabled, growth_interval=1)

        def run(m0, m1, o0, o1, try_scaling_api):
            for i, (x, y) in enumerate(data):
                o0.zero_grad()
                o1.zero_grad()
                out0, out1 = m0(x), m1(x)
                loss0 = loss_fn(0.3 * out0 + 0.7 * out1, y)
                loss1 = loss_fn(0.6 * out0 - 0.4 * out1, y)
                if try_scaling_api:
                    scaler.scale(loss0).backward(retain_graph=True)
                    scaler.scale(loss1).backward()
                    poison(m1, i, skip_iter, scaler)
                    scaler.unscale_(o0)  # one optimizer unscaled by hand, the other inside step()
                    scaler.step(o0)
                    scaler.step(o1)
                    scaler.update()
                else:
                    loss0.backward(retain_graph=True)
                    loss1.backward()
                    o0.step()  # only m1's gradient is poisoned: o0 steps every time
                    if not scaler.is_enabled() or i != skip_iter:
                        o1.step()

        run(c0, c1, oc0, oc1, False)
        run(s0, s1, os0, os1, True)
        expected = 128.0 * scaler.get_growth_factor() ** 3 * scaler.get_backoff_factor() if enabled else 1.0
        assert scaler.get_scale() == expected
        for c, s in zip(itertools.chain(c0.parameters(), c1.parameters()), itertools.chain(s0.parameters(), s1.parameters())):
            torch.testing.assert_close(c, s, rtol=1e-5, atol=1e-7)


# --- test_optim.py: fused optimizers --------------------------------------------------------------------

FUSED = [(torch.optim.Adam, {}), (torch.optim.Adam, {"amsgrad": True}), (torch.optim.AdamW, {}),
         (torch.optim.AdamW, {"amsgrad": True}), (torch.optim.SGD, {}), (torch.optim.SGD, {"momentum": 0.9}),
         (torch.optim.Adagrad, {})]


@pytest.mark.parametrize("optimizer_ctor, optimizer_kwargs", FUSED,
                         ids=[f"{c.__name__}-{'-'.join(k) or 'plain'}" for c, k in FUSED])
def test_grad_scaling_autocast_fused_optimizers(Scaler, optimizer_ctor, optimizer_kwargs):
    """A fused optimizer (scale and found_inf handed to its kernel) gives what the unfused one gives."""
    control, scaling, _, _, data, loss_fn, _ = create_scaling_case()
    kwargs = {"lr": 1e-2 if optimizer_ctor is not torch.optim.SGD else 1.0, **optimizer_kwargs}
    try:
        opt_scaling = optimizer_ctor(scaling.parameters(), fused=True, **kwargs)
    except RuntimeError as err:  # a CPU build without the fused kernel for this optimizer
        pytest.skip(f"{optimizer_ctor.__name__}(fused=True) unavailable on CPU: {err}")
    opt_control = optimizer_ctor(control.parameters(), fused=False, **kwargs)
    scaler_control, scaler_scaling = Scaler(DEVICE, init_scale=128.0), Scaler(DEVICE, init_scale=128.0)
    for x, y in data:
        for model, opt, scaler in ((control, opt_control, scaler_control), (scaling, opt_scaling, scaler_scaling)):
            opt.zero_grad()
            with torch.autocast(DEVICE, dtype=torch.half):
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        for pc, ps in zip(control.parameters(), scaling.parameters()):
            torch.testing.assert_close(pc.grad, ps.grad)
            torch.testing.assert_close(pc, ps)
            for key, value in opt_control.state[pc].items():
                torch.testing.assert_close(value, opt_scaling.state[ps][key])
    assert scaler_control.get_scale() == scaler_scaling.get_scale()


# --- test_cuda.py's scale test, on CPU ------------------------------------------------------------------

def test_grad_scaling_scale(Scaler):
    scaler = Scaler(DEVICE, init_scale=2.0)
    t0 = torch.full((1,), 4.0, dtype=torch.float32)
    t1 = torch.full((1,), 4.0, dtype=torch.float32)
    outputs = scaler.scale(t1)  # a single tensor
    assert outputs.item() == 8.0
    outputs = (t1.clone(), (t0.clone(), t1.clone()), [t0.clone(), (t1.clone(), t0.clone())])
    outputs = scaler.scale(outputs)  # nested tuples and lists keep their structure
    assert isinstance(outputs, tuple) and isinstance(outputs[1], tuple) and isinstance(outputs[2], list)
    assert outputs[0] == 8.0 and outputs[1][0] == 8.0 and outputs[1][1] == 8.0
    assert outputs[2][0] == 8.0 and outputs[2][1][0] == 8.0 and outputs[2][1][1] == 8.0
    mapped = scaler.scale(iter([t0, t1]))  # any other iterable comes back as an iterator
    assert [m.item() for m in mapped] == [8.0, 8.0]
    with pytest.raises(ValueError):
        scaler.scale(1.0)
