"""A roofline per op: compute time at the ceiling of its dtype, memory time at the achievable bandwidth.

    >>> from ampcourse.plan.roofline import op_time
    >>> op_time(record, GPUS["a100-sxm4-80gb"], "bf16").seconds

An op takes the larger of its compute time (FLOPs / the GPU's matmul ceiling for the math the op runs in) and
its memory time (bytes read + written / the achievable HBM bandwidth), plus a launch cost per kernel. Ops
without a FLOP formula (elementwise, normalisation, reductions, casts, optimizer updates) are memory-bound by
construction: their arithmetic is far below any ceiling. A step takes the sum of its ops on the GPU, or the
time the host needs to issue them, whichever is longer (eager PyTorch issues ops one by one; a small model is
launch-bound).

What the roofline leaves out: kernel fusion (torch.compile, fused optimizers, flash attention is the one fused
kernel it knows), caches (a small tensor read twice in a row comes from L2, not HBM), matmul shapes too small
or too odd to reach the ceiling, data loading, host-device copies and communication between GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass

from .capture import OpRecord
from .gpus import GPU, HOST_SECONDS_PER_OP, LAUNCH_SECONDS

__all__ = ["OpTime", "EFFICIENT_ATTENTION", "math_mode", "op_time", "step_time"]

#: torch's memory-efficient attention kernels (the cutlass kernels from xformers), forward and backward: what an
#: fp32 ``scaled_dot_product_attention`` runs on a GPU (flash attention has no fp32 kernel).
EFFICIENT_ATTENTION = frozenset({"aten._scaled_dot_product_efficient_attention",
                                 "aten._scaled_dot_product_efficient_attention_backward",
                                 "aten._efficient_attention_forward", "aten._efficient_attention_backward"})


@dataclass(frozen=True)
class OpTime:
    """An op's predicted time on one GPU: compute and memory times, the larger plus launch, which one bounds it."""

    record: OpRecord
    math: str
    compute_s: float
    memory_s: float
    seconds: float

    @property
    def bound(self) -> str:
        """'compute' or 'memory': which roof the op sits under."""
        return "compute" if self.compute_s > self.memory_s else "memory"


def math_mode(dtype: str, precision: str) -> str:
    """The math an op of this dtype runs in under a recipe: fp32 matmuls use TF32 only in the 'tf32' recipe."""
    if dtype == "bfloat16":
        return "bf16"
    if dtype == "float16":
        return "fp16"
    return "tf32" if precision == "tf32" else "fp32"


def op_time(record: OpRecord, gpu: GPU, precision: str) -> OpTime:
    """The roofline time of one op on gpu under a recipe.

    Args:
        record: the counted op.
        gpu: the GPU (``GPUS[key]``).
        precision: the recipe (``fp32``, ``tf32``, ``bf16``, ``fp16``).

    Example:
        >>> r = OpRecord("forward", "aten.mm", "bfloat16", flops=2 * 4096**3, bytes_read=2 * 2 * 4096**2,
        ...              bytes_written=2 * 4096**2)
        >>> op_time(r, GPUS["h100-sxm"], "bf16").bound
        'compute'
    """
    mode = math_mode(record.dtype, precision)
    ceiling, math = gpu.ceiling_tflops(mode), gpu.math_mode(mode)
    if record.dtype == "float32" and record.op in EFFICIENT_ATTENTION and "tf32" in gpu.peak_tflops:
        # fp32 attention ignores the TF32 setting both ways. torch's memory-efficient kernel picks its GEMM by
        # architecture: for float on compute capability >= 8.0 (DISPATCH_ARCHTAG maps every CC >= 80, H100
        # included, to Sm80) DefaultGemmType is OpClassTensorOp with cutlass::arch::OpMultiplyAddFastF32, i.e.
        # 3xTF32 (each product as three TF32 products) on the tensor cores; older GPUs get OpClassSimt, plain fp32
        # FMA (pytorch aten/src/ATen/native/transformers/cuda/mem_eff_attention/gemm_kernel_utils.h). So on a
        # GPU with TF32 units it runs at a third of the TF32 rate in the fp32 *and* the tf32 recipe.
        ceiling, math = gpu.ceiling_tflops("tf32") / 3, "3xtf32"
    compute = record.flops / (ceiling * 1e12) if record.flops else 0.0
    memory = (record.bytes_read + record.bytes_written) / gpu.bandwidth_bytes_per_s()
    return OpTime(record, math, compute, memory, max(compute, memory) + LAUNCH_SECONDS * record.kernels)


def step_time(records: list[OpRecord], gpu: GPU, precision: str) -> tuple[float, float, list[OpTime]]:
    """(GPU seconds, host seconds, per-op times) of a step: the step takes the larger of the two seconds."""
    times = [op_time(r, gpu, precision) for r in records]
    device = sum(t.seconds for t in times)
    host = HOST_SECONDS_PER_OP * len(records)
    return device, host, times
