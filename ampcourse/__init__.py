"""ampcourse: the helper package behind the mixed-precision course.

Modules, one idea each:
    device     pick device, AMP dtype and scaler, with a CPU fallback
    formats    fp32/fp16/bf16/fp8/MX fp6, fp4 from their bit layout (spec, decompose, quantize)
    plots      static matplotlib figures for the chapters
    models     reference models (mlp, cnn, transformer) and synthetic datasets
    train      one AMP training loop (fp32/fp16/bf16), History, Parallel, `python -m ampcourse.train` (a package)
    checkpoint atomic save, weights_only load, exact resume; File- and ShardedCheckpointer (a package)
    scaling    loss scaling written out: LossScaler (== GradScaler), scale simulations, range counts
    policy     per-module precision policies on top of autocast
    optim      pure-bf16 AdamW: nearest, stochastic or Kahan-compensated weight updates (no fp32 master)
    distributed torchrun env, process groups, DDP/FSDP2 wrapping, launch(), SLURM scripts
    reduce_sim an N-rank all-reduce in bf16/fp16/fp32 (ring or tree), simulated addition by addition
    widgets    ipywidgets + matplotlib explorers used in the chapters (a package, a file per explorer)
    autocast_ops  the autocast op table, measured live per device and dtype (CUDA's too, without a GPU)
    emulate    CUDA's autocast on CPU and meta tensors (emulate.autocast), from the probed policy
    memory     bytes saved for backward, weights, gradients, optimizer state
    fp8        below 16 bits: scaled quantization (tensor/row/MX/NVFP4/tiles), delayed vs current scaling
    bench      matmul/train-step/memory benchmark (python -m ampcourse.bench)
    exercises  checkers for the chapter exercises
    course     the course map: chapters, source-outline mapping, bilingual glossary (00_index)
    doctor     examine(model, ...): measure fp16/bf16 on your own model and advise (python -m ampcourse.doctor)
    trial      fp32 and AMP side by side over N steps: drift per layer, logit growth, first departure (python -m ampcourse.trial)
    inputs     the front door: one reader of a model, data (DataLoaders too), precisions; InputError; the preflight
    plan       what AMP buys on a GPU, predicted on a CPU: a step counted on meta tensors, a roofline per GPU (python -m ampcourse.plan)
    shipped    files beside the package in a checkout (examples/ddp_amp.py, the GPU report), found in a wheel too
Private helpers: _args (one rule for arguments and CLI errors), _scaler (GradScaler's settings: one owner),
_rng (every random stream a forward may draw from, the generators a model holds too).
Submodules load on first use (``ampcourse.formats``), so ``import ampcourse`` stays cheap.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_SUBMODULES = {
    "device", "formats", "scaling", "models", "train", "checkpoint", "distributed",
    "bench", "plots", "widgets", "exercises", "autocast_ops", "memory", "course", "policy",
    "fp8", "optim", "reduce_sim",
    "doctor", "trial", "inputs", "emulate", "plan", "shipped",
}


def __getattr__(name: str):
    """Import submodules lazily: ``ampcourse.formats`` works without importing every module."""
    if name == "InputError":  # the one exception for bad input (ValueError and TypeError), raised by ampcourse.inputs
        from ._args import InputError
        return InputError
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'ampcourse' has no attribute {name!r}")


def _sharp_figures() -> None:
    """In a Jupyter kernel with pyplot loaded, static figures at 2x pixels (``plots.hidpi_figures``, issue 28 item 17)."""
    import sys

    if "matplotlib.pyplot" in sys.modules and "ipykernel" in sys.modules:  # else: no figures yet, nothing to import
        from .plots import hidpi_figures

        hidpi_figures()


_sharp_figures()
