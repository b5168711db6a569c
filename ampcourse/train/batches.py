"""Which samples each step sees: a fixed function of (seed, step, dataset size, global batch size).

The global batch of step k is cut from a seeded per-epoch permutation (:func:`batch_indices`); a rank
takes its contiguous slice (:func:`local_indices`). So 1 process and N processes see the same global
batches, and a resumed run draws exactly the batches an uninterrupted one would. The loop itself asks a
:class:`StepIndices`, which gives the same indices already on the data's device.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from .. import _args

__all__ = ["batch_indices", "local_indices", "StepIndices"]


def _epoch_generator(seed: int, epoch: int) -> torch.Generator:
    """A generator for one epoch's permutation, seeded from (seed, epoch) alone."""
    mixed = (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + 1) % (2**63)  # distinct per pair
    return torch.Generator().manual_seed(mixed)


@functools.lru_cache(maxsize=4)
def _epoch_permutation(seed: int, epoch: int, dataset_size: int) -> torch.Tensor:
    """One epoch's permutation, computed once per epoch instead of once per step (it is a pure function)."""
    return torch.randperm(dataset_size, generator=_epoch_generator(seed, epoch))


def batch_indices(step: int, seed: int, dataset_size: int, batch_size: int) -> torch.Tensor:
    """Dataset indices of the GLOBAL batch for `step`: a function of these four numbers only.

    Each epoch is a fresh seeded permutation cut into floor(dataset_size / batch_size) batches
    (the remainder is dropped, so every batch has distinct samples).
    """
    # Plain ints: a numpy seed would overflow in _epoch_generator's arithmetic and miss the permutation cache.
    step, seed = _args.integer(step, "step", low=0), _args.seed(seed)
    dataset_size, batch_size = _args.integer(dataset_size, "dataset_size", low=1), _args.integer(batch_size, "batch_size", low=1)
    per_epoch = dataset_size // batch_size
    if per_epoch < 1:
        raise ValueError(f"batch_size {batch_size} is larger than the dataset ({dataset_size} samples)")
    epoch, pos = divmod(step, per_epoch)
    # A copy: the cached permutation must not change if a caller writes into the batch it got.
    return _epoch_permutation(seed, epoch, dataset_size)[pos * batch_size:(pos + 1) * batch_size].clone()


def _check_split(batch_size: int, rank: Any, world_size: Any) -> tuple[int, int]:
    """(rank, world_size) as ints, with 0 <= rank < world_size and batch_size dividing evenly among the ranks.

    Otherwise a ValueError naming the argument: a rank past the world got an empty slice, and an uneven split
    silently dropped the last samples of every batch (6 samples on 4 ranks: 1 each, 2 never seen).
    """
    world_size = _args.integer(world_size, "world_size", low=1, what="an int >= 1")
    rank = _args.integer(rank, "rank", low=0, high=world_size - 1,
                         what=f"an int in 0..{world_size - 1} (world_size={world_size})")
    if batch_size % world_size:
        raise ValueError(f"batch_size {batch_size} must divide by world_size {world_size}, "
                         "so every rank gets the same number of samples")
    return rank, world_size


def local_indices(step: int, seed: int, dataset_size: int, batch_size: int, rank: int = 0,
                  world_size: int = 1) -> torch.Tensor:
    """This rank's contiguous slice of the global batch for `step`."""
    indices = batch_indices(step, seed, dataset_size, batch_size)
    rank, world_size = _check_split(len(indices), rank, world_size)
    if world_size == 1:
        return indices
    local = batch_size // world_size
    return indices[rank * local:(rank + 1) * local]


class StepIndices:
    """local_indices(step, ...) for one run, on `device`: each epoch's permutation crosses to the device once.

    On a GPU the loop would otherwise copy every step's few index bytes from pageable host memory (a
    synchronising copy); here the whole permutation moves once per epoch and a step's indices are a
    slice of it, a view on the device. Values are exactly local_indices' (tests/train/test_train.py).

    Example::

        >>> indices = StepIndices(seed=0, dataset_size=1024, batch_size=64, device=torch.device("cpu"))
        >>> torch.equal(indices(3), local_indices(3, 0, 1024, 64))
        True
    """

    def __init__(self, seed: int, dataset_size: int, batch_size: int, rank: int = 0, world_size: int = 1,
                 device: torch.device | str = "cpu") -> None:
        self.seed, self.dataset_size, self.batch_size = seed, dataset_size, batch_size
        self.per_epoch = dataset_size // batch_size
        if self.per_epoch < 1:
            raise ValueError(f"batch_size {batch_size} is larger than the dataset ({dataset_size} samples)")
        rank, world_size = _check_split(batch_size, rank, world_size)
        self.local = batch_size // world_size
        self.offset = rank * self.local
        self.device = torch.device(device)
        self._epoch: int | None = None
        self._permutation: torch.Tensor | None = None

    def __call__(self, step: int) -> torch.Tensor:
        """This rank's indices for `step` (a view into the epoch's permutation on the device: do not write to it)."""
        epoch, pos = divmod(step, self.per_epoch)
        if epoch != self._epoch:  # once per epoch: the one host-to-device copy of indices
            self._permutation = _epoch_permutation(self.seed, epoch, self.dataset_size).to(self.device)
            self._epoch = epoch
        start = pos * self.batch_size + self.offset
        return self._permutation[start:start + self.local]


#: A dataset moves to the GPU once when it needs at most this share of the free device memory.
_DATA_ON_DEVICE_SHARE = 0.25


def data_on_device(tensors: Sequence[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, ...]:
    """The dataset on the device when it fits comfortably (a CUDA device), else where it is.

    On the device, each step's batch is a gather on the GPU; otherwise a gather from pageable host memory
    and a copy every step. Values are identical either way.
    """
    if device.type != "cuda":
        return tuple(tensors)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    free, _ = torch.cuda.mem_get_info(device)
    if nbytes > _DATA_ON_DEVICE_SHARE * free:
        return tuple(tensors)
    return tuple(t.to(device) for t in tensors)
