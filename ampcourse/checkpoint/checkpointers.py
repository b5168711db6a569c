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
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .saving import FORMAT, VERSION, CheckpointError, load, path_in, replace_atomically, save
from .state import capture, check_settings, restore, rng_state, set_rng_state

__all__ = ["FileCheckpointer", "ShardedCheckpointer"]


class FileCheckpointer:
    """How train() keeps its checkpoint: one checkpoint.pt with everything, written by rank 0 only.

    Enough for a single process and for DDP, whose ranks hold identical replicas; the file does not
    depend on the world size, so a run resumes on any number of ranks. FSDP2 shards the weights across
    ranks and uses :class:`ShardedCheckpointer` (below: the same methods, DCP files) instead.
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

#: The file in a step folder that is not a DCP file (it holds the checksums of the others, and its own zip CRCs).
_META = "meta.pt"


def _crc32_of(path: Path) -> tuple[int, int]:
    """(size in bytes, CRC-32) of a file, read in 1 MiB pieces."""
    crc, size = 0, 0
    with open(path, "rb") as fh:
        while piece := fh.read(1 << 20):
            crc, size = zlib.crc32(piece, crc), size + len(piece)
    return size, crc


def shard_checksums(folder: Path) -> dict[str, list[int]]:
    """{file name: [size, CRC-32]} of every DCP file in a step folder (its .metadata and every rank's shards).

    Rank 0 computes them after ``dcp.save`` has returned there, when every rank's shards are written; they go
    into meta.pt, whose own bytes the zip CRCs of ``checkpoint.save`` protect. DCP itself checks no checksum:
    without these a flipped bit in a shard resumed silently from the damaged weight.
    """
    return {p.name: list(_crc32_of(p)) for p in sorted(folder.iterdir()) if p.name != _META and p.is_file()}


def verify_shards(folder: Path, files: Any) -> None:
    """CheckpointError unless every file meta.pt lists is in `folder` with its size and CRC-32 (changes nothing).

    Every rank checks every file, so all ranks reach the same verdict without a collective: none of them starts
    DCP's load (and its collectives) on a damaged checkpoint while another refuses it.
    """
    if not isinstance(files, Mapping) or ".metadata" not in files or not all(
            isinstance(k, str) and isinstance(v, (list, tuple)) and len(v) == 2 and all(type(x) is int for x in v)
            for k, v in files.items()):
        raise CheckpointError(f"cannot resume from {str(folder)!r}: its meta.pt lists no checksums of the DCP files "
                              "(written by an older ampcourse, or not by ampcourse); its shards cannot be checked, so "
                              "it is not resumed. Start a fresh run in another checkpoint_dir")
    for name, (size, crc) in files.items():
        path = folder / name
        if "/" in name or name in ("", ".", "..") or not path.is_file():
            raise CheckpointError(f"cannot resume from {str(folder)!r}: {name!r} is missing (a copy that stopped "
                                  "early, or a file deleted); move the folder aside or start a fresh run")
        try:
            got_size, got_crc = _crc32_of(path)
        except OSError as err:
            raise CheckpointError(f"cannot resume from {str(folder)!r}: {name!r} cannot be read "
                                  f"({err.strerror or err})") from None
        if got_size != size:
            raise CheckpointError(f"cannot resume from {str(folder)!r}: {name!r} has {got_size} bytes, "
                                  f"{size} when it was written (truncated or damaged); move the folder aside or "
                                  "start a fresh run")
        if got_crc != crc:
            raise CheckpointError(f"cannot resume from {str(folder)!r}: {name!r} fails its CRC-32 check (a flipped "
                                  "bit, a failing disk or an incomplete copy): its bytes differ from what was "
                                  "saved; move the folder aside or start a fresh run")


def _dcp_failure(err: BaseException) -> str:
    """One line for what DCP raised: the first failing rank's own error (its CheckpointException str is tracebacks)."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, Mapping) and failures:
        rank, pair = next(iter(failures.items()))
        inner = pair[0] if isinstance(pair, tuple) else pair
        text = str(inner).strip().splitlines()[0][:300] if str(inner).strip() else ""
        return f"rank {rank}: {type(inner).__name__}: {text}"
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0][:300] if text else ''}"


def _checkpoint_exception() -> type[BaseException]:
    """torch's CheckpointException: it derives from BaseException (torch 2.13), so `except Exception` misses it."""
    try:
        from torch.distributed.checkpoint.api import CheckpointException
    except ImportError:  # pragma: no cover - a torch without it
        return Exception
    return CheckpointException


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
        return load(self._current(directory) / _META, required=_SHARDED_REQUIRED)

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
        verify_shards(folder, state.get("files"))  # every byte DCP is about to read, as it was written
        target, _ = self._dcp_state(net, optimizer)
        try:
            dcp.load(target, storage_reader=_safe_reader(folder), planner=_tensor_only_planner())
        except CheckpointError:
            raise
        except (Exception, _checkpoint_exception()) as err:  # DCP wraps per-rank failures in CheckpointException
            raise CheckpointError(f"cannot resume from {str(folder)!r}: DCP could not load it into this "
                                  f"model ({_dcp_failure(err)})") from None
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
                    "world_size": dist.get_world_size(), "files": shard_checksums(folder)}
            save(meta, folder / _META)
            _replace_text(self.path(directory), folder.name)
            for old in root.glob("step-*"):
                if old != folder and old.is_dir():
                    shutil.rmtree(old)  # superseded: `latest` already points at the complete new folder
        dist.barrier()  # nobody reads `latest` (or starts the next save) before it moved


def _replace_text(path: Path, text: str) -> None:
    """Write a small text file atomically (``saving.replace_atomically``: temp file + os.replace)."""
    replace_atomically(path, (text + "\n").encode())
