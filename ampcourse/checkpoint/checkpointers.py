"""How train() keeps its checkpoints: one file from rank 0 (:class:`FileCheckpointer`: one process, DDP) or DCP
shards from every rank (:class:`ShardedCheckpointer`: FSDP2). Both have the same four methods (path, read,
restore, write), so the loop does not know which one it holds.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .saving import FORMAT, VERSION, CheckpointError, load, path_in, save
from .state import capture, check_settings, restore, rng_state, set_rng_state

__all__ = ["FileCheckpointer", "ShardedCheckpointer"]


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


# Globals a DCP .metadata pickle may name. DCP reads that file with plain pickle.load, which would run
# any code a crafted file asks for; we check the file against this list first.
_DCP_SAFE_MODULES = ("torch.distributed.checkpoint.",)


_DCP_SAFE_GLOBALS = {("torch", "Size"), ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
                     ("torch.serialization", "_get_layout"),  # maps a name like 'torch.strided' to the layout
                     ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
                     ("pathlib", "PureWindowsPath")}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata, refusing any global outside the DCP metadata classes and torch dtypes."""

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith(_DCP_SAFE_MODULES) or (module, name) in _DCP_SAFE_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                         torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global '{module}.{name}' is not allowed in DCP metadata")


def _safe_reader(path: Path):
    """A DCP FileSystemReader whose metadata is checked by _MetadataUnpickler before DCP unpickles it."""
    from torch.distributed.checkpoint import FileSystemReader

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            rank = kwargs.get("rank")
            meta_path = Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata")
            try:
                with open(meta_path, "rb") as fh:
                    _MetadataUnpickler(fh).load()
            except FileNotFoundError:
                raise  # DCP looks for per-rank metadata after the global file; a missing one is not an error
            except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError) as err:
                raise CheckpointError(
                    f"cannot resume from {str(path)!r}: its DCP metadata is unreadable or unsafe "
                    f"({type(err).__name__}: {err}); move the directory aside or start a fresh run") from err
            return super().read_metadata(*args, **kwargs)

    return SafeReader(path)


def _tensor_only_planner():
    """A DCP load planner that refuses non-tensor items (we never save any: they would go through pickle)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class TensorOnlyLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            raise CheckpointError(
                f"the sharded checkpoint holds a non-tensor item {read_item.dest_index.fqn!r}; ampcourse writes "
                "tensors only, so this is not one of its checkpoints")

    return TensorOnlyLoadPlanner()


def _tensor_leaves_only(tree: Any, where: str = "") -> None:
    """Assert a state dict for DCP holds tensors only (non-tensors would be pickled)."""
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            _tensor_leaves_only(v, f"{where}.{k}")
    elif not isinstance(tree, torch.Tensor):
        raise TypeError(f"non-tensor {type(tree).__name__} at {where} would be pickled into the DCP checkpoint")


_SHARDED_REQUIRED = ("format", "version", "step", "scaler", "scheduler", "rng", "param_groups")


class ShardedCheckpointer(FileCheckpointer):
    """FSDP2 checkpoints: every rank writes its shards with DCP; rank 0 writes a small meta.pt beside them.

    Layout: ``<dir>/sharded/step-00000008/`` (DCP files + meta.pt) and ``<dir>/sharded/latest`` naming the
    complete step folder. A new checkpoint is written to a new folder; only then does ``latest`` move
    (atomically) and the old folder go, so a crash mid-save leaves the previous checkpoint usable.
    Tensors go through DCP (which reshards: saved on N ranks, restored on M); everything else (GradScaler,
    scheduler, RNG, config, history, optimizer hyper-parameters) goes through ``checkpoint.save`` and comes
    back through ``torch.load(weights_only=True)``; DCP's own metadata is checked before it is unpickled.
    """

    kind = "sharded checkpoint (--strategy fsdp)"

    def path(self, directory: str | os.PathLike) -> Path:
        """The pointer file `latest`: it exists once a complete sharded checkpoint does."""
        return Path(directory) / "sharded" / "latest"

    def _current(self, directory: str | os.PathLike) -> Path:
        """The step folder `latest` points to."""
        pointer = self.path(directory)
        try:  # garbage bytes or a folder named 'latest': the CheckpointError below, not a UnicodeDecodeError/OSError
            name = pointer.read_text(errors="replace").strip()
        except OSError as err:
            raise CheckpointError(f"cannot resume from {str(pointer.parent)!r}: 'latest' cannot be read "
                                  f"({err.strerror or err}); move the folder aside or start a fresh run") from None
        if not re.fullmatch(r"step-\d{8}", name) or not (pointer.parent / name).is_dir():
            raise CheckpointError(f"cannot resume from {str(pointer.parent)!r}: 'latest' names "
                                             f"{name[:40]!r}, which is not a step folder there")
        return pointer.parent / name

    def read(self, directory: str | os.PathLike) -> dict[str, Any]:
        """Load meta.pt of the latest step folder (config, history, scaler, ...); the shards come in restore()."""
        return load(self._current(directory) / "meta.pt", required=_SHARDED_REQUIRED)

    @staticmethod
    def _dcp_state(net: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, list]:
        """{'model': ..., 'optim': ...} of sharded tensors for DCP, and the optimizer's param_groups."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        osd = get_optimizer_state_dict(net, optimizer)  # creates Adam's state on a fresh optimizer
        return {"model": get_model_state_dict(net), "optim": osd["state"]}, osd["param_groups"]

    def restore(self, state: dict[str, Any], directory: str | os.PathLike, *, net: nn.Module, module: nn.Module,
                optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, scheduler: Any = None,
                device: torch.device | None = None) -> int:
        """Load the shards into the live (sharded) model and optimizer, resharding if the world size changed."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        folder = self._current(directory)
        # Everything but the shards first: a wrong optimizer, scaler state or step fails before DCP touches the model.
        check_settings({**state, "optimizer": {"state": {}, "param_groups": state.get("param_groups")}},
                                  optimizer, scaler, scheduler, path=folder)
        target, _ = self._dcp_state(net, optimizer)
        try:
            dcp.load(target, storage_reader=_safe_reader(folder), planner=_tensor_only_planner())
        except CheckpointError:
            raise
        except Exception as err:  # DCP wraps per-rank failures in CheckpointException and friends
            first = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
            raise CheckpointError(f"cannot resume from {str(folder)!r}: DCP could not load it into this "
                                             f"model ({type(err).__name__}: {first})") from err
        set_model_state_dict(net, target["model"])
        set_optimizer_state_dict(net, optimizer, {"state": target["optim"], "param_groups": state["param_groups"]})
        if scaler.is_enabled():  # present and sensible: check_settings said so
            scaler.load_state_dict(state["scaler"])
        if scheduler is not None:
            scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"], device)
        return int(state["step"])

    def write(self, directory: str | os.PathLike, step: int, *, net: nn.Module, module: nn.Module,
              optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, scheduler: Any = None,
              device: torch.device | None = None, config: dict | None = None, history: dict | None = None) -> None:
        """Every rank saves its shards (a collective); rank 0 then writes meta.pt and moves `latest`."""
        import torch.distributed.checkpoint as dcp

        root = Path(directory) / "sharded"
        folder = root / f"step-{step:08d}"
        tensors, param_groups = self._dcp_state(net, optimizer)
        _tensor_leaves_only(tensors)
        dcp.save(tensors, checkpoint_id=folder)  # returns on rank 0 after every rank's shards are written
        if self.rank == 0:
            meta = {"format": FORMAT, "version": VERSION, "step": int(step),
                    "scaler": scaler.state_dict(), "param_groups": param_groups,
                    "scheduler": None if scheduler is None else scheduler.state_dict(),
                    "rng": rng_state(device), "config": dict(config or {}), "history": dict(history or {}),
                    "world_size": dist.get_world_size()}
            save(meta, folder / "meta.pt")
            _replace_text(self.path(directory), folder.name)
            for old in root.glob("step-*"):
                if old != folder and old.is_dir():
                    shutil.rmtree(old)  # superseded: `latest` already points at the complete new folder
        dist.barrier()  # nobody reads `latest` (or starts the next save) before it moved


def _replace_text(path: Path, text: str) -> None:
    """Write a small text file atomically (temp file + os.replace)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    with os.fdopen(fd, "w") as fh:
        fh.write(text + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
