"""The GPUs a plan predicts for: datasheet peaks, measured ceilings and launch costs, each with its source.

    >>> from ampcourse.plan import GPUS, GPU
    >>> GPUS["h100-sxm"].peak_tflops["tf32"] / GPUS["h100-sxm"].peak_tflops["fp32"]   # about 7.4
    >>> GPUS["my-card"] = GPU("my-card", "My card", {"fp32": 40.0, "tf32": 80.0, "bf16": 160.0, "fp16": 160.0},
    ...                       hbm_gbps=1000.0, memory_gb=24, sources=("my own datasheet",))

Every number is dense (no 2:4 sparsity) and at the boost clock. ``peak_tflops`` is the datasheet's;
``matmul_efficiency`` is the fraction of that peak the best measured bf16 matmul reached (None where no
measurement is published: the datasheet peak is then used as the ceiling, and predictions are optimistic);
``bandwidth_efficiency`` is the fraction of the HBM datasheet bandwidth a streaming kernel reached.
A dtype missing from ``peak_tflops`` has no tensor-core path on that GPU (V100 and T4 have no bf16 or TF32):
a plan of that precision falls back to the next rate, as torch does (``"bf16"`` on a V100 is emulated through
fp32 math).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["GPU", "GPUS", "LAUNCH_SECONDS", "HOST_SECONDS_PER_OP", "SOURCES"]

#: Where the table's numbers come from (cited by key in each GPU's ``sources``).
SOURCES = {
    "v100": "NVIDIA V100 Tensor Core GPU datasheet (2020): SXM2 FP32 15.7 TFLOPS, Tensor 125 TFLOPS, HBM2 900 GB/s",
    "t4": "NVIDIA T4 datasheet: FP32 8.1 TFLOPS, mixed FP16/FP32 65 TFLOPS, GDDR6 320 GB/s",
    "a100": "NVIDIA A100 Tensor Core GPU datasheet (2021): FP32 19.5, TF32 156, BF16/FP16 312 TFLOPS (dense); "
            "HBM2 1,555 GB/s (40GB), HBM2e 2,039 GB/s (80GB SXM)",
    "l4": "NVIDIA L4 datasheet: FP32 30.3, TF32 60, BF16/FP16 121 TFLOPS (dense, half the sparse figures); 300 GB/s",
    "h100": "NVIDIA H100 Tensor Core GPU datasheet (2023): SXM FP32 67, TF32 494.5, BF16/FP16 989.5 TFLOPS; "
            "PCIe FP32 51, TF32 378, BF16/FP16 756 TFLOPS (dense, half the sparse figures); HBM3 3.35 TB/s (SXM), "
            "HBM2e 2.0 TB/s (PCIe)",
    "h200": "NVIDIA H200 datasheet: compute as H100 SXM (FP32 67, TF32 494.5, BF16/FP16 989.5 TFLOPS dense), "
            "HBM3e 4.8 TB/s, 141 GB",
    "mamf": "S. Bekman, ml-engineering, compute/accelerator/README.md, 'Maximum Achievable Matmul FLOPS comparison "
            "table' (mamf-finder.py, bf16): A100 SXM 271.2/312 (86.9%), A100 PCIe 252.9/312 (81.1%), "
            "H100 SXM 794.5/989 (80.3%, 'H200 is the same')",
    "hbm-a100": "NVIDIA developer forum thread 339083 'Trouble to reach peak bandwidth of A100' (2025): a read "
                "kernel reaches 1.80 of 2.04 TB/s on an A100 80GB SXM (88%, confirmed by Nsight Compute); the "
                "GTC talk cited there saw ~90% at best. Used as the streaming fraction of every GPU's HBM",
    "launch": "per-op CPU-side cost of eager PyTorch (Python, autograd, dispatcher, cudaLaunchKernel) ~5-25 us; "
              "cudaLaunchKernel ~1-3 us on CUDA 12 drivers (J. Lin, 'From PyTorch op to kernel launch', "
              "gpu_kernel_serving lesson 18)",
}

#: GPU-side cost of one kernel beyond its roofline time (launch gap and ramp), seconds: the low end of the
#: ~1-3 us per cudaLaunchKernel in SOURCES['launch'].
LAUNCH_SECONDS = 2e-6
#: CPU-side cost of one eager op (Python + autograd + dispatch + launch), seconds: a step cannot be faster than
#: its ops can be issued. The low end of SOURCES['launch']'s 5-25 us, for a fast host CPU.
HOST_SECONDS_PER_OP = 5e-6


@dataclass
class GPU:
    """One GPU's datasheet peaks and measured fractions of them.

    Args:
        key: the name ``plan(gpu=...)`` takes, e.g. ``"a100-sxm4-80gb"``.
        name: a display name.
        peak_tflops: dense datasheet TFLOP/s per math mode: ``fp32`` (CUDA cores), ``tf32``, ``bf16``, ``fp16``
            (tensor cores); leave a mode out where the GPU has no unit for it.
        hbm_gbps: datasheet memory bandwidth, GB/s.
        memory_gb: memory size, GB.
        matmul_efficiency: measured best matmul / datasheet peak (None: not published, the peak is used).
        bandwidth_efficiency: measured streaming bandwidth / datasheet bandwidth.
        sources: keys of :data:`SOURCES` (or free text) for every number above.

    Example:
        >>> GPU("x", "X", {"fp32": 10.0, "fp16": 80.0}, hbm_gbps=500.0, memory_gb=16).ceiling_tflops("bf16")
        10.0
    """

    key: str
    name: str
    peak_tflops: dict[str, float]
    hbm_gbps: float
    memory_gb: float
    matmul_efficiency: float | None = None
    bandwidth_efficiency: float = 0.88
    sources: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self):
        if "fp32" not in self.peak_tflops:
            raise ValueError(f"GPU {self.key!r}: peak_tflops needs an 'fp32' entry, got {sorted(self.peak_tflops)}")
        for mode, value in self.peak_tflops.items():
            if mode not in ("fp32", "tf32", "bf16", "fp16") or not value > 0:
                raise ValueError(f"GPU {self.key!r}: peak_tflops[{mode!r}] must be a positive number for one of "
                                 f"fp32, tf32, bf16, fp16, got {value!r}")
        if not self.hbm_gbps > 0:
            raise ValueError(f"GPU {self.key!r}: hbm_gbps must be positive, got {self.hbm_gbps!r}")
        for name in ("matmul_efficiency", "bandwidth_efficiency"):
            value = getattr(self, name)
            if value is not None and not 0 < value <= 1:
                raise ValueError(f"GPU {self.key!r}: {name} must be in (0, 1], got {value!r}")

    def math_mode(self, mode: str) -> str:
        """The mode that really runs: bf16 without bf16 units runs as fp32 math, TF32 without TF32 units is fp32."""
        if mode in self.peak_tflops:
            return mode
        return "fp32"

    def ceiling_tflops(self, mode: str) -> float:
        """The matmul ceiling for a math mode: the datasheet peak times the measured efficiency (if published)."""
        return self.peak_tflops[self.math_mode(mode)] * (self.matmul_efficiency or 1.0)

    def bandwidth_bytes_per_s(self) -> float:
        """Achievable HBM bandwidth in bytes/s."""
        return self.hbm_gbps * 1e9 * self.bandwidth_efficiency


def _table() -> dict[str, GPU]:
    """The built-in GPUs."""
    a100 = {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}
    h100_sxm = {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5}
    gpus = [
        GPU("v100-sxm2-16gb", "V100 SXM2 16GB", {"fp32": 15.7, "fp16": 125.0}, 900.0, 16, sources=("v100", "hbm-a100")),
        GPU("v100-sxm2-32gb", "V100 SXM2 32GB", {"fp32": 15.7, "fp16": 125.0}, 900.0, 32, sources=("v100", "hbm-a100")),
        GPU("t4", "T4", {"fp32": 8.1, "fp16": 65.0}, 320.0, 16, sources=("t4", "hbm-a100")),
        GPU("a100-sxm4-40gb", "A100 SXM4 40GB", dict(a100), 1555.0, 40, matmul_efficiency=0.869,
            sources=("a100", "mamf", "hbm-a100")),
        GPU("a100-sxm4-80gb", "A100 SXM4 80GB", dict(a100), 2039.0, 80, matmul_efficiency=0.869,
            sources=("a100", "mamf", "hbm-a100")),
        GPU("l4", "L4", {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0}, 300.0, 24,
            sources=("l4", "hbm-a100")),
        GPU("h100-sxm", "H100 SXM5 80GB", dict(h100_sxm), 3350.0, 80, matmul_efficiency=0.803,
            sources=("h100", "mamf", "hbm-a100")),
        GPU("h100-pcie", "H100 PCIe 80GB", {"fp32": 51.0, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0}, 2000.0, 80,
            sources=("h100", "hbm-a100")),
        GPU("h200", "H200 SXM 141GB", dict(h100_sxm), 4800.0, 141, matmul_efficiency=0.803,
            sources=("h200", "mamf", "hbm-a100")),
    ]
    return {g.key: g for g in gpus}


#: The built-in GPUs by key; add your own card with ``GPUS["key"] = GPU(...)``.
GPUS: dict[str, GPU] = _table()
