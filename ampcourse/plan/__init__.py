"""What AMP buys on a GPU, predicted on a CPU: FLOPs, bytes and memory per op, and a roofline per GPU.

    >>> from ampcourse.plan import plan, GPUS
    >>> report = plan(model, inputs, gpu="a100-sxm4-80gb", precisions=("fp32", "tf32", "bf16", "fp16"),
    ...               loss_fn=loss_fn, targets=targets)
    >>> report.step_seconds["bf16"], report.peak_memory_bytes["bf16"]
    >>> print(report.summary()); print(report.table("bf16"))

The model runs forward, backward and one optimizer step on meta tensors (no memory, no arithmetic), under
CUDA's autocast policy for bf16/fp16; every aten op is counted (dtype, FLOPs, bytes, saved tensors, live
memory) and timed on the chosen GPU by a roofline (``roofline``) from datasheet and measured ceilings
(``gpus``). Layers: ``gpus`` (the table) -> ``capture`` (counting) -> ``roofline`` (times) -> ``core``
(``plan`` and its report) -> ``cli`` (``python -m ampcourse.plan``).
"""

from .capture import NeedsRealValues, OpRecord, StepCounts, autocast_policy, capture_step
from .core import PRECISIONS, PlanReport, plan
from .gpus import GPU, GPUS
from .roofline import OpTime

__all__ = ["plan", "PlanReport", "PRECISIONS", "GPUS", "GPU", "NeedsRealValues", "OpRecord", "OpTime", "StepCounts",
           "autocast_policy", "capture_step"]
