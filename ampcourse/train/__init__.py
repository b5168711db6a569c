"""One AMP training loop for fp32, fp16 (+ GradScaler) and bf16, with clipping, accumulation and resume.

Launch commands::

    # 1 process (CPU, one GPU or Apple MPS), with a JSON summary:
    python -m ampcourse.train --model mlp --precision bf16 --steps 200 --out summary.json
    # checkpoint every 50 steps, then continue an interrupted run exactly where it stopped:
    python -m ampcourse.train --model mlp --steps 200 --checkpoint-dir runs/a --checkpoint-every 50
    python -m ampcourse.train --model mlp --steps 400 --checkpoint-dir runs/a --resume
    # N processes on one node: one per GPU (NCCL), or N CPU processes over gloo on a machine without one.
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: a fresh TCPStore per restart round, so torchrun's restarts
    # work (pytorch/pytorch#135712); harmless without --max-restarts.
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node N \\
        -m ampcourse.train --strategy ddp --precision fp16 --steps 200 --out summary.json
    # CPU only (laptop, CI): the same, with --device cpu (gloo); one OpenMP thread per process
    OMP_NUM_THREADS=1 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node 2 \\
        -m ampcourse.train --strategy ddp --device cpu --precision bf16 --steps 200
    # M nodes (run on every node; HOST = the first node; --checkpoint-dir on a shared filesystem);
    # after a failure torchrun restarts all workers, which resume from the last checkpoint by themselves:
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes M --nproc-per-node N --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29500 --rdzv-id myjob --max-restarts 1 \\
        -m ampcourse.train --strategy fsdp --precision bf16 --checkpoint-dir /shared/run --checkpoint-every 50
    # SLURM: ampcourse.distributed.render_slurm(nodes, gpus_per_node) writes the batch script (srun + torchrun).

Under torchrun, rank 0 logs, shows the progress bar and writes --out; --strategy ddp wraps the model in
DistributedDataParallel, --strategy fsdp shards it with FSDP2 (``ampcourse.distributed``). The summary
holds world size, backend (nccl/gloo), device type, precision, steps, skipped steps, the final loss of
the global batch, the final loss scale and a checksum of the final (full) parameters.

From Python::

    >>> from ampcourse.train import train
    >>> hist = train("mlp", None, precision="bf16", steps=50, lr=1e-3, seed=0, progress=False)
    >>> hist.loss[-1], hist.skipped_steps, hist.model

Where each piece lives (one concern per file):

- ``loop``: :func:`train` (checks, build, the loop) and :class:`History`;
- ``settings``: :class:`TrainSettings` (every setting in one frozen, checked object: a setting is added there) and
  :class:`Parallel` (rank, world size, wrapper, checkpointer, autocast in one object);
- ``step``: :func:`train_step` (one optimizer step, each AMP decision with its reason), :func:`make_optimizer`
  (and :func:`optimizer_settings`, the lr and weight_decay it takes: within float32's range),
  :func:`make_scheduler`, :func:`state_checksum`;
- ``batches``: which samples each step sees (:func:`batch_indices`, :func:`local_indices`, ``StepIndices``);
- ``checks``: the checks that need the model or the data (the batch split, the checkpoint, a resume), before any
  work; the model, data and precision themselves are read by ``ampcourse.inputs``, the front door trial and the
  doctor share;
- ``cli`` and ``__main__``: ``python -m ampcourse.train``.

Design, and why:

- Device, autocast dtype and scaler come from ``ampcourse.device.pick``; one loop with ``enabled=``
  flags serves every precision (for fp32 and bf16 the GradScaler is disabled and its calls are no-ops).
- The global batch of step k is a fixed function of (seed, k, dataset size, global batch size)
  (:func:`batch_indices`); a rank takes its slice (:func:`local_indices`). So 1 process and N processes
  see the same global batches, and a resumed run draws exactly the batches an uninterrupted one would.
- Process groups and model wrapping stay in ``ampcourse.distributed``; :class:`Parallel` carries what the
  loop needs of them: ``rank``/``world_size`` pick the slice, ``wrap`` receives the model after it moved
  to the device (DDP or ``fully_shard`` plug in there), micro-batches before the last one run under
  ``model.no_sync()`` when the wrapper has it, and a ``checkpointer`` writes one file from rank 0
  (single, DDP) or DCP shards from every rank (FSDP2) (``ampcourse.checkpoint``).
"""

from __future__ import annotations

from .batches import batch_indices, local_indices
from .cli import STRATEGIES, main
from .loop import History, Parallel, train
from .settings import TrainSettings
from .step import OPTIMIZERS, SCHEDULERS, StepStats, make_optimizer, optimizer_settings, make_scheduler, state_checksum, train_step

__all__ = ["History", "StepStats", "Parallel", "TrainSettings", "train", "train_step", "batch_indices", "local_indices",
           "make_optimizer", "optimizer_settings", "make_scheduler", "state_checksum", "main", "OPTIMIZERS", "SCHEDULERS", "STRATEGIES"]
