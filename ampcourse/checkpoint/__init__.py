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
  is a :class:`CheckpointError`, never a silently different resume; a sharded (FSDP2, DCP) checkpoint's meta.pt
  lists the size and CRC-32 of every DCP file, which every rank checks before DCP reads one
  (:func:`~ampcourse.checkpoint.checkpointers.verify_shards`), and what DCP itself raises (its
  ``CheckpointException`` is a BaseException) becomes a CheckpointError too;
- never over what is not a file: a path that names a device (``/dev/null``), a FIFO or a socket is refused before
  the temp file is renamed over it; a symbolic link is written through (the link stays);
- plain contents: numpy scalars in the settings, history, optimizer or scheduler state are turned into
  Python numbers by ``capture`` (``weights_only=True`` refuses numpy objects);
- whatever the global torch settings: ``save`` writes with CRC-32s on even after
  ``torch.serialization.set_crc32_options(False)`` (a file with CRC 0 would fail ``load``'s check);
- all or nothing: ``restore`` checks the whole state against the live model, optimizer, scaler and
  scheduler (names, shapes, optimizer kind and settings, RNG state size, a step >= 0) *before* changing
  any of them, and puts everything back if loading still fails: a refused checkpoint leaves them untouched.

Where each piece lives: ``saving`` (the file: atomic save, CRC-checked ``weights_only`` load, disk errors),
``state`` (capture, restore and the checks before it), ``checkpointers`` (:class:`FileCheckpointer` and
:class:`ShardedCheckpointer`, how train() keeps a run's checkpoints). Nothing here imports
``ampcourse.distributed`` or ``ampcourse.train``: they import it.
"""

from __future__ import annotations

from .checkpointers import FileCheckpointer, ShardedCheckpointer
from .saving import FILENAME, FORMAT, VERSION, CheckpointError, load, path_in, save
from .state import capture, check_fits, check_settings, restore, rng_state, set_rng_state

__all__ = ["FORMAT", "VERSION", "FILENAME", "CheckpointError", "FileCheckpointer", "ShardedCheckpointer", "path_in",
           "capture", "save", "load", "restore", "check_fits", "check_settings", "rng_state", "set_rng_state"]
