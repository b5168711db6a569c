"""Stored chapter outputs must not depend on which vector kernels the learner's CPU runs.

The chapters were executed on an AVX512 machine; a learner's (or CI's) CPU may have only AVX2, whose fp32
kernels round differently in the last bits. This runs every chapter through strict nbval again with torch,
oneDNN and MKL held to their AVX2 kernels, as on such a CPU. An output that changes is a claim that holds
only on the machine that stored it: compute it exactly (e.g. `record_gradients(exact=True)`), print a
comparison instead of the raw float, or tag the cell `nbval-ignore-output` with an assert that keeps the
claim tested.
"""

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The kernels, and the flags ampcourse.device reads (so pick() decides as on a CPU without bf16 units: fp32).
AVX2_ONLY = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
             "AMPCOURSE_CPU_FLAGS": "sse4_2 avx avx2 fma"}


def _has_avx2() -> bool:
    """Whether this is an x86-64 CPU with AVX2 and FMA (where torch has AVX2 kernels to fall back to)."""
    from ampcourse.device import cpu_flags
    return platform.machine() in ("x86_64", "AMD64") and {"avx2", "fma"} <= cpu_flags()


def _has_wider_kernels() -> bool:
    """Whether this CPU has AVX512, i.e. kernels wider than AVX2 that torch, oneDNN and MKL pick by themselves.

    On an AVX2-only CPU (no avx512f) they already run their AVX2 kernels and `ampcourse.device` already sees no
    bf16 units, so the suite's own strict nbval run of `chapters/` is this test's run: repeating it proves nothing.
    """
    from ampcourse.device import cpu_flags
    return "avx512f" in cpu_flags()


@pytest.mark.slow
@pytest.mark.skipif(not _has_avx2(), reason="no x86-64 AVX2 CPU: there are no AVX2 kernels to hold torch to")
@pytest.mark.skipif(_has_avx2() and not _has_wider_kernels(),
                    reason="this CPU has AVX2 and no AVX512: the suite's own strict nbval run of chapters/ ran "
                           "the AVX2 kernels already")
def test_chapters_give_the_stored_outputs_with_avx2_kernels():
    env = {**os.environ, **AVX2_ONLY, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "chapters/"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    tail = "\n".join(out.stdout.splitlines()[-40:])
    assert out.returncode == 0, f"a stored output depends on the CPU's vector kernels:\n{tail}"
