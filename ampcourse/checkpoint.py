"""Save and resume an AMP training run exactly: model, optimizer, GradScaler, scheduler, step, RNG.

    >>> from ampcourse import checkpoint
    >>> state = checkpoint.capture(step, model, optimizer, scaler, scheduler)
    >>> checkpoint.save(state, "runs/a/checkpoint.pt")            # atomic: temp file, fsync, os.replace
    >>> state = checkpoint.load("runs/a/checkpoint.pt")           # torch.load(..., weights_only=True)
    >>> step = checkpoint.restore(state, model, optimizer, scaler, scheduler)

Why each piece is saved: the model and optimizer hold the weights and Adam's moments; the GradScaler
holds the current loss scale and how many clean steps it has seen (resume without it and fp16 restarts
at scale 65536, skipping steps an uninterrupted run would not); the RNG state keeps dropout and any
other random draws on the same sequence. With all of it, a resumed run is bit-identical on CPU.

A file that cannot be read (missing, empty, truncated, random bytes, a pickled object that
``weights_only=True`` refuses, a torch file of some other program) raises :class:`CheckpointError`,
a ``ValueError`` naming the path and what to do. Nothing here deletes or overwrites a checkpoint
except ``save`` replacing one with a complete newer file; a failed write leaves the old file in place.

What a checkpoint promises (README, "Reliability"):

- integrity: torch writes every piece (each tensor's bytes, the pickled structure) as a member of a zip
  file with its CRC-32; ``load`` checks every CRC before unpickling, so a flipped bit anywhere in the data
  is a :class:`CheckpointError`, never a silently different resume;
- plain contents: numpy scalars in the settings, history, optimizer or scheduler state are turned into
  Python numbers by ``capture`` (``weights_only=True`` refuses numpy objects);
- all or nothing: ``restore`` checks the whole state against the live model, optimizer, scaler and
  scheduler (names, shapes, optimizer kind and settings, RNG state size, a step >= 0) *before* changing
  any of them, and puts everything back if loading still fails: a refused checkpoint leaves them untouched.
"""

from __future__ import annotations

import copy
import os
import pickle
import re
import socket
import tempfile
import warnings
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import _args

__all__ = ["FORMAT", "VERSION", "FILENAME", "CheckpointError", "FileCheckpointer", "path_in", "capture", "save",
           "load", "restore", "check_fits", "check_settings", "rng_state", "set_rng_state"]

#: Marker and version stored in every file, so a foreign torch file is recognised as such.
FORMAT = "ampcourse.checkpoint"
VERSION = 1
#: The file name train() uses inside its checkpoint directory.
FILENAME = "checkpoint.pt"
_REQUIRED = ("format", "version", "step", "model", "optimizer", "scaler", "scheduler", "rng")


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or written; the message names the file and what to do about it."""


def path_in(directory: str | os.PathLike) -> Path:
    """The checkpoint file inside a run directory."""
    return _as_path(directory, "directory") / FILENAME


def _as_path(value: Any, name: str) -> Path:
    """value as a Path (a str or os.PathLike); ValueError naming it otherwise (pathlib's TypeError names nothing)."""
    if isinstance(value, (str, os.PathLike)) and not isinstance(value, bytes):
        return Path(value)
    raise ValueError(f"{name} must be a path (str or pathlib.Path), got {_args.shown(value)}")


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


def capture(step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
            scheduler: Any = None, *, device: torch.device | None = None, config: dict | None = None,
            history: dict | None = None) -> dict[str, Any]:
    """Everything needed to continue after `step` completed steps, as plain tensors and containers."""
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


def _plain(obj: Any) -> Any:
    """obj with numpy scalars (and 0-d arrays) turned into Python numbers, through dicts, lists and tuples.

    torch.load(weights_only=True) refuses numpy objects, so a run started with lr=np.float64(1e-3) (which an
    optimizer stores in its param_groups as given) would write a checkpoint it can never read back.
    """
    if isinstance(obj, (np.generic, np.ndarray)) and np.ndim(obj) == 0:
        return obj.item()
    if isinstance(obj, dict):
        return {_plain(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):  # namedtuples stay as they are
        return type(obj)(_plain(v) for v in obj)
    return obj


def _temp_prefix(path: Path) -> str:
    """Temp files name their writer (host and pid), so a later save can tell a dead writer's leftovers."""
    return f".{path.name}.{socket.gethostname()}.{os.getpid()}."


def _writer_is_dead(host: str, pid: int) -> bool:
    """True only when the writer ran on this host and that process no longer exists (POSIX; never on Windows)."""
    if os.name != "posix" or host != socket.gethostname() or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return True
    except OSError:  # e.g. it exists but belongs to another user
        return False
    return False


def _remove_stale_temps(path: Path) -> list[Path]:
    """Delete temp files that writers of this checkpoint left when they were killed mid-write; return them.

    Such a file was never renamed into place, so no run resumes from it; the checkpoint just saved
    is newer. Files of live writers, of other hosts (a shared filesystem) and of other names stay.
    """
    pattern = re.compile(rf"^\.{re.escape(path.name)}\.(?P<host>.+)\.(?P<pid>\d+)\.[A-Za-z0-9_]+\.tmp$")
    removed = []
    for candidate in path.parent.iterdir():
        m = pattern.match(candidate.name)
        if m and _writer_is_dead(m["host"], int(m["pid"])):
            candidate.unlink(missing_ok=True)
            removed.append(candidate)
    return removed


def _check_writable_folder(path: Path) -> None:
    """CheckpointError naming the path unless its folder exists and is a directory (before any bytes are written)."""
    folder = path.parent
    if path.is_dir():
        raise CheckpointError(f"cannot save a checkpoint to {str(path)!r}: it is a directory; give a file path "
                              f"such as {str(path / FILENAME)!r}")
    if not folder.exists():
        raise CheckpointError(f"cannot save a checkpoint to {str(path)!r}: the folder {str(folder)!r} does not exist; "
                              "create it first (train() creates its checkpoint_dir itself)")
    if not folder.is_dir():
        raise CheckpointError(f"cannot save a checkpoint to {str(path)!r}: {str(folder)!r} is not a directory")


def save(state: dict[str, Any], path: str | os.PathLike) -> Path:
    """Write atomically: a temp file in the same directory, fsync, then os.replace over the old file.

    A writer killed mid-write (SIGKILL, power loss) leaves the previous checkpoint intact and a temp file
    named after its host and pid; the next successful save here deletes such leftovers of dead writers.
    """
    path = _as_path(path, "path")
    _check_writable_folder(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(path), suffix=".tmp", dir=path.parent)
    except OSError as err:
        raise CheckpointError(f"cannot save a checkpoint to {str(path)!r}: cannot create a file in "
                              f"{str(path.parent)!r} ({err.strerror}); choose a folder you can write to") from err
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(_plain(state), fh)  # numpy scalars would make the file unreadable with weights_only=True
            fh.flush()
            os.fsync(fh.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, path)  # atomic on POSIX and Windows: readers see the old file or the new one
    except BaseException:
        Path(tmp).unlink(missing_ok=True)  # only our own temp file; the previous checkpoint stays
        raise
    _fsync_dir(path.parent)
    _remove_stale_temps(path)
    return path


def _fsync_dir(directory: Path) -> None:
    """Make the rename itself durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _unreadable(path: Path, why: str) -> CheckpointError:
    """The error for a file that is not a usable checkpoint, with what to do."""
    return CheckpointError(
        f"cannot resume from {str(path)!r}: {why}. It was left untouched; move it aside or point "
        "checkpoint_dir / --checkpoint-dir at another directory, or start without resume to train from step 0 "
        "in a fresh directory.")


def _verify_crcs(path: Path) -> bool:
    """For a zip file (torch's format): CheckpointError unless every member matches its CRC-32; True once checked.

    torch.load itself does not check them, so without this a flipped bit in a tensor loads silently.
    Not a zip at all: False, and torch.load's own error (or load()'s refusal of a legacy file) follows.
    """
    if not zipfile.is_zipfile(path):
        return False
    try:
        with zipfile.ZipFile(path) as zf:
            damaged = zf.testzip()  # reads every member and compares its CRC-32
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError, NotImplementedError) as err:
        raise _unreadable(path, f"it is truncated or not a torch file ({type(err).__name__}: {err})") from err
    except OSError as err:  # a read error, or a damaged header that made a member unreadable
        raise _unreadable(path, f"it cannot be read ({err.strerror or err})") from err
    if damaged is not None:
        raise _unreadable(path, f"its data are damaged: {damaged!r} fails its CRC-32 check (a flipped bit, "
                                "a failing disk or an incomplete copy); the bytes differ from what was saved")
    return True


def load(path: str | os.PathLike, map_location: str | torch.device = "cpu",
         required: tuple[str, ...] = _REQUIRED) -> dict[str, Any]:
    """Read a checkpoint with torch.load(weights_only=True) and check it is ours; CheckpointError if not."""
    path = _as_path(path, "path")
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {str(path)!r}; train without resume first, or check the path")
    if not path.is_file():
        raise _unreadable(path, "it is not a regular file")
    if path.stat().st_size == 0:
        raise _unreadable(path, "the file is empty (a write that never finished?)")
    checked = _verify_crcs(path)
    try:
        with warnings.catch_warnings():  # a garbage file can make the unpickler warn before it fails
            warnings.simplefilter("ignore", UserWarning)
            state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        if "global" in str(err).lower():  # a pickled object of some class or function: never unpickle it
            raise _unreadable(path, "torch.load(weights_only=True) refused it: it holds Python objects other than "
                                    "tensors and plain containers, which could run code when unpickled") from err
        raise _unreadable(path, "it is truncated or not a torch file (the unpickler met bytes it cannot read)") from err
    except Exception as err:  # torch.load on random bytes raises RuntimeError, IndexError, KeyError, ...
        raise _unreadable(path, f"it is truncated or not a torch file ({type(err).__name__})") from err
    if not checked:  # torch's legacy (non-zip) format: no checksums, and never written by save()
        raise _unreadable(path, "it is a torch file in the legacy non-zip format, which carries no checksums "
                                "(checkpoint.save writes zip files only)")
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise _unreadable(path, f"it is a torch file but not an {FORMAT} file")
    if state.get("version") != VERSION:
        raise _unreadable(path, f"it has format version {state.get('version')!r}; this ampcourse reads {VERSION}")
    missing = [k for k in required if k not in state]
    if missing:
        raise _unreadable(path, f"it lacks {', '.join(missing)}")
    return state


def restore(state: dict[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer,
            scaler: torch.amp.GradScaler, scheduler: Any = None, *, device: torch.device | None = None,
            path: str | os.PathLike = "<checkpoint>") -> int:
    """Load a captured state into live objects; returns the number of completed steps.

    All or nothing: check_fits() looks at everything first, and if loading still fails midway the
    model, optimizer, scaler and scheduler get their previous state back before the error is raised.
    """
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
            from .scaling import check_scaler_args  # scaling imports models only; no cycle
            if not isinstance(saved, Mapping):
                raise ValueError(f"it is a {type(saved).__name__}")
            check_scaler_args(saved.get("scale"), saved.get("growth_factor"), saved.get("backoff_factor"),
                              saved.get("growth_interval"))
            _args.integer(saved.get("_growth_tracker"), "_growth_tracker", low=0)
        except ValueError as err:
            raise _bad(path, f"its GradScaler state is impossible ({err})") from None
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


class FileCheckpointer:
    """How train() keeps its checkpoint: one checkpoint.pt with everything, written by rank 0 only.

    Enough for a single process and for DDP, whose ranks hold identical replicas; the file does not
    depend on the world size, so a run resumes on any number of ranks. FSDP2 shards the weights across
    ranks and uses ``ampcourse.distributed.ShardedCheckpointer`` (same methods, DCP files) instead.
    """

    kind = "single-file checkpoint (--strategy single or ddp)"

    def __init__(self, rank: int = 0):
        self.rank = rank

    def path(self, directory: str | os.PathLike) -> Path:
        """The file whose existence means 'there is a checkpoint in this directory'."""
        return path_in(directory)

    def read(self, directory: str | os.PathLike) -> dict[str, Any]:
        """Load the checkpoint (before the model is built): a dict with 'config' and 'history'."""
        return load(self.path(directory))

    def restore(self, state: dict[str, Any], directory: str | os.PathLike, *, net: torch.nn.Module,
                module: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                scheduler: Any = None, device: torch.device | None = None) -> int:
        """Put what read() returned into the live objects; returns the completed steps."""
        return restore(state, module, optimizer, scaler, scheduler, device=device, path=self.path(directory))

    def write(self, directory: str | os.PathLike, step: int, *, net: torch.nn.Module, module: torch.nn.Module,
              optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, scheduler: Any = None,
              device: torch.device | None = None, config: dict | None = None, history: dict | None = None) -> None:
        """Rank 0 writes checkpoint.pt atomically; other ranks hold the same replica and write nothing."""
        if self.rank == 0:
            save(capture(step, module, optimizer, scaler, scheduler, device=device, config=config, history=history),
                 self.path(directory))
