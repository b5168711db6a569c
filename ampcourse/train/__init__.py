"""One AMP training loop for fp32, fp16 (+ GradScaler) and bf16, with clipping, accumulation and resume.

It is chapter 4's loop, packaged: :func:`ampcourse.device.pick` chooses the device, the autocast dtype and the
scaler, and one loop with ``enabled=`` flags serves every precision. The same code trains in one process or in
many under torchrun (DDP, FSDP2), and a resumed run continues exactly where it stopped.

From Python::

    >>> from ampcourse.train import train
    >>> hist = train("mlp", None, precision="bf16", steps=50, lr=1e-3, seed=0, progress=False)
    >>> hist.loss[-1], hist.skipped_steps, hist.model

From a shell (``cli`` says what each process does and what the summary holds)::

    python -m ampcourse.train --model mlp --precision bf16 --steps 200 --out summary.json
    python -m ampcourse.train --model mlp --steps 200 --checkpoint-dir runs/a --checkpoint-every 50
    python -m ampcourse.train --model mlp --steps 400 --checkpoint-dir runs/a --resume
    # N processes on one node, one per GPU (NCCL); the variable: a fresh TCPStore per restart (pytorch#135712)
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node N \\
        -m ampcourse.train --strategy ddp --precision fp16 --steps 200 --out summary.json
    # N CPU processes over gloo (a laptop, CI); a file rendezvous: no port beyond loopback (--standalone's store
    # listens on every address; README.md, "Several processes")
    OMP_NUM_THREADS=1 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes 1 --nproc-per-node 2 \\
        --rdzv-backend c10d --rdzv-endpoint "$(mktemp -d)/rdzv" --rdzv-conf store_type=file --local-addr 127.0.0.1 \\
        -m ampcourse.train --strategy ddp --device cpu --precision bf16 --steps 200
    # M nodes (HOST: the first one); restarted workers resume from the last checkpoint
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes M --nproc-per-node N --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29500 --rdzv-id myjob --max-restarts 1 \\
        -m ampcourse.train --strategy fsdp --precision bf16 --checkpoint-dir /shared/run --checkpoint-every 50
    # SLURM: ampcourse.distributed.render_slurm(nodes, gpus_per_node) writes the batch script

Where each concern lives:

- ``loop``: :func:`train` and its :class:`History`;
- ``settings``: :class:`TrainSettings` (every setting, checked once) and :class:`Parallel` (rank, world size,
  model wrapper, checkpointer);
- ``step``: :func:`train_step` (one optimizer step, each AMP decision with its reason), the optimizers and
  schedulers, :func:`state_checksum`;
- ``batches``: which samples each step sees, the same in 1 and in N processes;
- ``checks``: the checks that need the model or the data (the model, data and precision themselves are read by
  the front door, ``ampcourse.inputs``);
- ``cli`` and ``__main__``: ``python -m ampcourse.train``.
"""

from __future__ import annotations

from .batches import batch_indices, local_indices
from .cli import STRATEGIES, main
from .loop import History, Parallel, train
from .settings import TrainSettings
from .step import OPTIMIZERS, SCHEDULERS, StepStats, make_optimizer, optimizer_settings, make_scheduler, state_checksum, train_step

__all__ = ["History", "StepStats", "Parallel", "TrainSettings", "train", "train_step", "batch_indices", "local_indices",
           "make_optimizer", "optimizer_settings", "make_scheduler", "state_checksum", "main", "OPTIMIZERS", "SCHEDULERS", "STRATEGIES"]
