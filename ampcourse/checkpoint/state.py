"""What a checkpoint holds, and putting it back: capture(), restore() (all or nothing) and the checks behind it.

restore() checks the whole state against the live model, optimizer, scaler and scheduler (names, shapes,
optimizer kind and settings, GradScaler settings, RNG state size, a step >= 0) *before* changing any of
them, and puts everything back if loading still fails: a refused checkpoint leaves them untouched.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from typing import Any

import torch

from .. import _args, _scaler
from .saving import FORMAT, VERSION, CheckpointError, _plain

__all__ = ["rng_state", "set_rng_state", "capture", "restore", "check_fits", "check_settings"]


def rng_state(device: torch.device | None = None) -> dict[str, torch.Tensor | None]:
    """The CPU generator state, plus the CUDA one for a CUDA device."""
    cuda = None
    if device is not None and device.type == "cuda":
        cuda = torch.cuda.get_rng_state(device)
    return {"cpu": torch.get_rng_state(), "cuda": cuda}


def set_rng_state(state: dict[str, torch.Tensor | None], device: torch.device | None = None) -> None:
    """Restore what rng_state() returned."""
    torch.set_rng_state(state["cpu"])
    if state.get("cuda") is not None and device is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def _check_pieces(model: Any, optimizer: Any, scaler: Any, scheduler: Any) -> None:
    """TypeError naming the argument unless model, optimizer, scaler (and scheduler) are what capture/restore take."""
    for name, value, kind in (("model", model, torch.nn.Module), ("optimizer", optimizer, torch.optim.Optimizer),
                              ("scaler", scaler, torch.amp.GradScaler)):
        if not isinstance(value, kind):  # else AttributeError: 'NoneType' object has no attribute 'state_dict'
            raise TypeError(f"{name} must be a {kind.__module__}.{kind.__qualname__}, got {_args.shown(value)}"
                            + ("; for fp32 or bf16 pass a disabled one: torch.amp.GradScaler(enabled=False)"
                               if name == "scaler" else ""))
    if scheduler is not None and not callable(getattr(scheduler, "state_dict", None)):
        raise TypeError(f"scheduler must be an LR scheduler (with state_dict) or None, got {_args.shown(scheduler)}")


def capture(step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
            scheduler: Any = None, *, device: torch.device | None = None, config: dict | None = None,
            history: dict | None = None) -> dict[str, Any]:
    """Everything needed to continue after `step` completed steps, as plain tensors and containers."""
    _check_pieces(model, optimizer, scaler, scheduler)
    for name, value in (("config", config), ("history", history)):
        if value is not None and not isinstance(value, Mapping):
            raise TypeError(f"{name} must be a dict or None, got {_args.shown(value)}")
    return _plain({
        "format": FORMAT, "version": VERSION, "step": _args.integer(step, "step", low=0),
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(),  # {} when the scaler is disabled (fp32, bf16)
        "scheduler": None if scheduler is None else scheduler.state_dict(),
        "rng": rng_state(device),
        "config": dict(config or {}),
        "history": dict(history or {}),
    })


def restore(state: dict[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer,
            scaler: torch.amp.GradScaler, scheduler: Any = None, *, device: torch.device | None = None,
            path: str | os.PathLike = "<checkpoint>") -> int:
    """Load a captured state into live objects; returns the number of completed steps.

    All or nothing: check_fits() looks at everything first, and if loading still fails midway the
    model, optimizer, scaler and scheduler get their previous state back before the error is raised.
    """
    _check_pieces(model, optimizer, scaler, scheduler)
    step = check_fits(state, model, optimizer, scaler, scheduler, path=path)
    before = _snapshot(model, optimizer, scaler, scheduler)
    try:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if scaler.is_enabled():
            scaler.load_state_dict(state["scaler"])
        if scheduler is not None:
            scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"], device)
    except Exception as err:
        _put_back(before, model, optimizer, scaler, scheduler)
        raise CheckpointError(f"checkpoint {str(path)!r} does not fit this model or optimizer: {type(err).__name__}: "
                              f"{str(err).splitlines()[0] if str(err) else ''}; the model and optimizer were left "
                              "as they were. Resume with the model, optimizer and precision it was written with") from err
    return step


def _snapshot(model, optimizer, scaler, scheduler) -> tuple:
    """Copies of what restore() changes, to put back if loading fails midway."""
    return ({k: v.detach().clone() for k, v in model.state_dict().items()}, copy.deepcopy(optimizer.state_dict()),
            scaler.state_dict(), None if scheduler is None else copy.deepcopy(scheduler.state_dict()),
            torch.get_rng_state())


def _put_back(before: tuple, model, optimizer, scaler, scheduler) -> None:
    """Undo a partial restore()."""
    weights, opt, scl, sched, rng = before
    model.load_state_dict(weights)
    optimizer.load_state_dict(opt)
    if scl:
        scaler.load_state_dict(scl)
    if scheduler is not None:
        scheduler.load_state_dict(sched)
    torch.set_rng_state(rng)


def _bad(path: str | os.PathLike, what: str) -> CheckpointError:
    """The error for a well-formed checkpoint whose contents cannot be restored into this run."""
    return CheckpointError(f"checkpoint {str(path)!r} does not fit this model or optimizer: {what}. Nothing was changed; resume "
                           "with the model, optimizer, scheduler and precision it was written with, or start a "
                           "fresh run in another checkpoint_dir")


def check_fits(state: dict[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               scaler: torch.amp.GradScaler, scheduler: Any = None, *, path: str | os.PathLike = "<checkpoint>") -> int:
    """CheckpointError unless every piece of state can be restored into these objects; returns the step. Changes nothing."""
    if not isinstance(state, Mapping):
        raise _bad(path, f"it holds a {type(state).__name__}, not a dict")
    _check_model_state(state.get("model"), model, path)
    return check_settings(state, optimizer, scaler, scheduler, path=path)


def check_settings(state: dict[str, Any], optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                   scheduler: Any = None, *, path: str | os.PathLike = "<checkpoint>") -> int:
    """check_fits without the model (FSDP2's sharded files check the weights through DCP); returns the step."""
    if not isinstance(state, Mapping):
        raise _bad(path, f"it holds a {type(state).__name__}, not a dict")
    try:
        step = _args.integer(state.get("step"), "step", low=0)
    except ValueError as err:
        raise _bad(path, f"its {err}") from None
    _check_optimizer_state(state.get("optimizer"), optimizer, state.get("config"), path)
    if scaler.is_enabled():
        saved = state.get("scaler")
        if not saved:
            raise CheckpointError(f"checkpoint {str(path)!r} has no GradScaler state (written without fp16); "
                                  "resume with the precision it was written with")
        try:
            _scaler.check_state(saved)  # GradScaler's settings have one owner
        except ValueError as err:
            raise _bad(path, f"its GradScaler state is impossible ({err})") from None
    elif isinstance(state.get("scaler"), Mapping) and "scale" in state["scaler"]:
        # A disabled scaler (fp32, bf16) would drop the saved scale silently: an fp16 run resumed so has lost it.
        raise CheckpointError(
            f"checkpoint {str(path)!r} holds a GradScaler state (scale {state['scaler']['scale']!r}: written with fp16), "
            "but this scaler is disabled (fp32 or bf16), so restoring would drop it. Resume with an enabled scaler "
            "(ampcourse.device.pick(device, 'fp16').make_scaler() or torch.amp.GradScaler(device)); to change the "
            "precision on purpose, set state['scaler'] = {} before restore")
    if scheduler is not None:
        if state.get("scheduler") is None:
            raise CheckpointError(f"checkpoint {str(path)!r} has no scheduler state; resume without a scheduler")
        if not isinstance(state["scheduler"], Mapping):
            raise _bad(path, f"its scheduler state is a {type(state['scheduler']).__name__}, not a dict")
    _check_rng_state(state.get("rng"), path)
    for key in ("config", "history"):
        if not isinstance(state.get(key, {}), Mapping):
            raise _bad(path, f"its {key} is a {type(state[key]).__name__}, not a dict")
    bad_series = [k for k, v in state.get("history", {}).items() if not isinstance(v, (list, tuple))]
    if bad_series:
        raise _bad(path, f"its history entries {bad_series} are not lists")
    return step


def _check_model_state(saved: Any, model: torch.nn.Module, path) -> None:
    """Same names, and a tensor of the same shape under each (load_state_dict would copy the matching ones first)."""
    if not isinstance(saved, Mapping):
        raise _bad(path, f"its model state is {'missing' if saved is None else 'a ' + type(saved).__name__}")
    live = model.state_dict()
    missing, unexpected = sorted(set(live) - set(saved)), sorted(set(saved) - set(live))
    if missing or unexpected:
        raise _bad(path, f"the model's names differ (missing {missing[:5]}, unexpected {unexpected[:5]}): "
                         "it was written for another model")
    for key, value in live.items():
        got = saved[key]
        if not isinstance(got, torch.Tensor) or got.shape != value.shape:
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            raise _bad(path, f"model tensor {key!r} has shape {shape} in the checkpoint, {tuple(value.shape)} here")
        if got.dtype != value.dtype:  # load_state_dict would cast silently: float64 -> float32 is no exact resume
            raise _bad(path, f"model tensor {key!r} is {got.dtype} in the checkpoint, {value.dtype} here")


def _check_optimizer_state(saved: Any, optimizer: torch.optim.Optimizer, config: Any, path) -> None:
    """Same kind of optimizer, same groups and settings' names, per-parameter state of the right shapes."""
    if not isinstance(saved, Mapping) or not isinstance(saved.get("param_groups"), (list, tuple)) \
            or not isinstance(saved.get("state"), Mapping):
        raise _bad(path, "its optimizer state is missing or is not an optimizer's state_dict "
                         "(a dict with 'state' and 'param_groups')")
    kind = config.get("optimizer") if isinstance(config, Mapping) else None
    if isinstance(kind, str) and kind != type(optimizer).__name__:
        raise _bad(path, f"it was written by a {kind} optimizer, and this run uses {type(optimizer).__name__}")
    groups, live = saved["param_groups"], optimizer.param_groups
    if len(groups) != len(live):
        raise _bad(path, f"its optimizer has {len(groups)} parameter groups, this one {len(live)}")
    params = {}
    for i, (g, lg) in enumerate(zip(groups, live)):
        if not isinstance(g, Mapping) or not isinstance(g.get("params"), (list, tuple)):
            raise _bad(path, f"its optimizer's parameter group {i} is not a dict with a 'params' list")
        # Every setting this optimizer reads must be there (AdamW's state lacks SGD's 'momentum': KeyError in
        # step 1). Extra keys are allowed: an LR scheduler adds 'initial_lr' to the groups it drives.
        missing = sorted(set(lg) - set(g) - {"initial_lr"})
        if missing:
            raise _bad(path, f"its optimizer settings lack {missing} (group {i}), which {type(optimizer).__name__} "
                             "needs: it was written by another kind of optimizer")
        if len(g["params"]) != len(lg["params"]):
            raise _bad(path, f"its optimizer's group {i} holds {len(g['params'])} parameters, this one {len(lg['params'])}")
        params.update(zip(g["params"], lg["params"]))
    for pid, entry in saved["state"].items():
        if pid not in params or not isinstance(entry, Mapping):
            raise _bad(path, f"its optimizer state has an entry for parameter {pid!r}, which no group holds")
        for name, value in entry.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != params[pid].shape:
                raise _bad(path, f"optimizer state {name!r} of parameter {pid!r} has shape {tuple(value.shape)}, "
                                 f"the parameter {tuple(params[pid].shape)}")


def _check_rng_state(saved: Any, path) -> None:
    """A CPU generator state of the size and dtype torch.set_rng_state takes (and a CUDA one that is a byte tensor)."""
    want = torch.get_rng_state()
    cpu = saved.get("cpu") if isinstance(saved, Mapping) else None
    if not isinstance(cpu, torch.Tensor) or cpu.dtype != want.dtype or cpu.shape != want.shape:
        got = (f"{tuple(cpu.shape)} {cpu.dtype}" if isinstance(cpu, torch.Tensor)
               else type(cpu if isinstance(saved, Mapping) else saved).__name__)
        raise _bad(path, f"its CPU random-number state is {got}, not {tuple(want.shape)} {want.dtype}")
    cuda = saved.get("cuda")
    if cuda is not None and (not isinstance(cuda, torch.Tensor) or cuda.dtype != torch.uint8):
        raise _bad(path, "its CUDA random-number state is not a byte tensor")
