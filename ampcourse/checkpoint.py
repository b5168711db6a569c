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
"""

from __future__ import annotations

import os
import pickle
import re
import socket
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

__all__ = ["FORMAT", "VERSION", "FILENAME", "CheckpointError", "FileCheckpointer", "path_in", "capture", "save",
           "load", "restore", "rng_state", "set_rng_state"]

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
    return Path(directory) / FILENAME


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
    return {
        "format": FORMAT, "version": VERSION, "step": int(step),
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(),  # {} when the scaler is disabled (fp32, bf16)
        "scheduler": None if scheduler is None else scheduler.state_dict(),
        "rng": rng_state(device),
        "config": dict(config or {}),
        "history": dict(history or {}),
    }


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
    path = Path(path)
    _check_writable_folder(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(path), suffix=".tmp", dir=path.parent)
    except OSError as err:
        raise CheckpointError(f"cannot save a checkpoint to {str(path)!r}: cannot create a file in "
                              f"{str(path.parent)!r} ({err.strerror}); choose a folder you can write to") from err
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(state, fh)
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


def load(path: str | os.PathLike, map_location: str | torch.device = "cpu",
         required: tuple[str, ...] = _REQUIRED) -> dict[str, Any]:
    """Read a checkpoint with torch.load(weights_only=True) and check it is ours; CheckpointError if not."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {str(path)!r}; train without resume first, or check the path")
    if not path.is_file():
        raise _unreadable(path, "it is not a regular file")
    if path.stat().st_size == 0:
        raise _unreadable(path, "the file is empty (a write that never finished?)")
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
    """Load a captured state into live objects; returns the number of completed steps."""
    try:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    except (RuntimeError, ValueError, KeyError) as err:
        raise CheckpointError(f"checkpoint {str(path)!r} does not fit this model or optimizer: "
                              f"{str(err).splitlines()[0]}; resume with the same model and optimizer") from err
    if scaler.is_enabled():
        if not state["scaler"]:
            raise CheckpointError(f"checkpoint {str(path)!r} has no GradScaler state (written without fp16); "
                                  "resume with the precision it was written with")
        scaler.load_state_dict(state["scaler"])
    if scheduler is not None:
        if state["scheduler"] is None:
            raise CheckpointError(f"checkpoint {str(path)!r} has no scheduler state; resume without a scheduler")
        scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"], device)
    return int(state["step"])


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
