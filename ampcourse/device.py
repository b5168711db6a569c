"""Pick the device, the AMP dtype and whether a GradScaler is needed: one place, one answer (chapter 2 and every chapter's setup).

    >>> from ampcourse.device import pick
    >>> amp = pick()                      # cuda, else mps, else cpu
    >>> print(amp.summary())
    >>> with amp.autocast():              # torch.amp.autocast(device_type=..., dtype=...)
    ...     ...
    >>> scaler = amp.make_scaler()        # torch.amp.GradScaler(device), enabled only for fp16

Defaults, decided by the units the hardware has (``AmpSetup.summary()`` says which, and why):

- CUDA GPUs with native bf16 tensor cores (compute capability >= 8.0: Ampere and later): bf16, no GradScaler;
- older GPUs (Volta, Turing: bf16 there is emulated): fp16 + GradScaler;
- CPUs with AMX or AVX512-BF16 (``/proc/cpuinfo`` flags ``amx_bf16``, ``avx512_bf16``): bf16;
- other CPUs (AVX2 only, or flags unknown): **fp32**. Without those units a bf16 matmul is emulated and
  10-200x slower than fp32 (benchmarks/README.md), so low precision would only cost there;
- Apple MPS: fp16.

``pick(precision="amp")`` asks for this device's autocast dtype even where it is not the fast choice
(bf16 on any CPU): what a chapter needs to *show* autocast on a CPU without bf16 units. Chapters that
teach the GradScaler ask for fp16 explicitly: ``pick(precision="fp16")``.

Native bf16 is decided by the compute capability of the device picked, not by
``torch.cuda.is_bf16_supported()``: that defaults to ``including_emulation=True`` (True on a T4 or
V100, which have no bf16 units) and looks at the *current* device, not necessarily the chosen one.
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
from dataclasses import dataclass

import torch

__all__ = ["PRECISIONS", "AmpSetup", "pick", "parse_precision", "cpu_flags", "native_bf16", "NATIVE_BF16_CAPABILITY",
           "CPU_BF16_FLAGS", "AMP_REQUEST", "default_rule", "amp_rule"]

#: The first CUDA compute capability with bf16 (and tf32) tensor cores: Ampere, sm_80.
NATIVE_BF16_CAPABILITY = (8, 0)

#: CPU flags of units that multiply bf16 natively (Intel AMX tiles; AVX512-BF16 on Intel and AMD Zen 4+).
CPU_BF16_FLAGS = {"amx_bf16": "AMX bf16 tiles", "avx512_bf16": "AVX512-BF16"}

#: The precision request that means "this device's autocast dtype, fast or not" (see the module docstring).
AMP_REQUEST = "amp"

#: Precision names the course accepts, mapped to the autocast dtype (None: autocast off).
PRECISIONS: dict[str, torch.dtype | None] = {
    "fp32": None,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}

_PRECISION_ALIASES = {"float32": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16"}


def parse_precision(precision: str | torch.dtype) -> str:
    """Normalise a precision name or dtype to 'fp32', 'fp16' or 'bf16'; ValueError otherwise."""
    if isinstance(precision, torch.dtype):
        for name, dtype in PRECISIONS.items():
            if dtype == precision or (dtype is None and precision == torch.float32):
                return name
    elif isinstance(precision, str):
        key = precision.strip().lower().removeprefix("torch.")
        key = _PRECISION_ALIASES.get(key, key)
        if key in PRECISIONS:
            return key
    raise ValueError(
        f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)} "
        "(fp32 = no autocast, fp16 = autocast + GradScaler, bf16 = autocast, no scaler needed)"
    )


#: Environment variable that replaces the flags read from /proc/cpuinfo (space- or comma-separated), so a test can
#: run the chapters as on another CPU (tests/course/test_portable_outputs.py: an AVX2-only CPU, where pick() says fp32).
CPU_FLAGS_ENV = "AMPCOURSE_CPU_FLAGS"


def cpu_flags() -> frozenset[str]:
    """CPU feature flags from /proc/cpuinfo (empty where that file does not exist), or from $AMPCOURSE_CPU_FLAGS.

    Example::

        >>> "avx2" in cpu_flags()      # True on any x86-64 CPU of the last decade
    """
    pretend = os.environ.get(CPU_FLAGS_ENV)
    if pretend is not None:
        return frozenset(pretend.replace(",", " ").split())
    return _proc_cpu_flags()


@functools.cache
def _proc_cpu_flags() -> frozenset[str]:
    """The flags line of /proc/cpuinfo, read once."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def native_bf16(device: str | torch.device) -> bool:
    """True if this CUDA device has bf16 tensor cores (compute capability >= 8.0); False for any other device."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return tuple(torch.cuda.get_device_capability(device)) >= NATIVE_BF16_CAPABILITY


def _native_units(device: torch.device, precision: str) -> tuple[bool, str]:
    """Whether the hardware has fast units for this precision, and what they are called."""
    if precision == "fp32":
        return True, "fp32"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if precision == "bf16" and not native_bf16(device):  # bf16 tensor cores arrived with Ampere (sm_80)
            return False, f"no bf16 tensor cores (sm_{major}{minor} < sm_80: bf16 is emulated)"
        return major >= 7, f"tensor cores (sm_{major}{minor})"
    if device.type == "mps":
        return True, "Apple GPU"
    flags = cpu_flags()
    if precision == "bf16":
        for flag, units in CPU_BF16_FLAGS.items():
            if flag in flags:
                return True, units
    if precision == "fp16" and "amx_fp16" in flags:
        return True, "AMX fp16 tiles"
    return False, f"no native {precision} units"


#: The torch releases the course is tested on, oldest and newest (pyproject.toml: torch>=2.11 and
#: [tool.ampcourse] torch-tested; tests/course/test_environments.py checks they agree). summary() warns outside them.
TORCH_RANGE = ("2.11", "2.15")


@dataclass(frozen=True)
class AmpSetup:
    """The device, precision and scaler choice for one process."""

    device: torch.device
    precision: str  # "fp32", "fp16" or "bf16"
    native: bool  # the hardware has fast units for `precision`
    units: str  # what those units are (or that there are none)
    reason: str = ""  # why pick() chose this precision when none was asked for, where that needs saying

    @property
    def device_type(self) -> str:
        """'cuda', 'cpu' or 'mps': what torch.amp.autocast and GradScaler take."""
        return self.device.type

    @property
    def amp_dtype(self) -> torch.dtype | None:
        """The autocast dtype, or None when precision is fp32."""
        return PRECISIONS[self.precision]

    @property
    def enabled(self) -> bool:
        """True when autocast is on (fp16 or bf16)."""
        return self.amp_dtype is not None

    @property
    def use_scaler(self) -> bool:
        """Only fp16 needs loss scaling: bf16 has fp32's exponent range."""
        return self.precision == "fp16"

    def autocast(self, enabled: bool = True) -> contextlib.AbstractContextManager:
        """torch.amp.autocast for this device and dtype (a no-op context for fp32)."""
        if not (enabled and self.enabled):
            return contextlib.nullcontext()
        return torch.amp.autocast(device_type=self.device_type, dtype=self.amp_dtype)

    def make_scaler(self, **kwargs) -> torch.amp.GradScaler:
        """A torch.amp.GradScaler for this device, enabled only when fp16 needs it; settings checked by ampcourse._scaler."""
        from ._scaler import gradscaler_kwargs  # the one owner of GradScaler's settings

        kwargs = gradscaler_kwargs(kwargs, "make_scaler arguments")
        kwargs.setdefault("enabled", self.use_scaler)
        return torch.amp.GradScaler(self.device_type, **kwargs)

    def describe_device(self) -> str:
        """A short name for the device: 'cpu (x86_64)', 'cuda:0 (NVIDIA H200)', ..."""
        if self.device.type == "cuda":
            return f"{self.device} ({torch.cuda.get_device_name(self.device)})"
        if self.device.type == "cpu":
            return f"cpu ({platform.machine() or 'unknown'})"
        return str(self.device)

    def summary(self) -> str:
        """One line a notebook prints: device, precision, scaler, and what to expect (and a torch outside TORCH_RANGE)."""
        if not self.enabled:
            line = f"{self.describe_device()}, fp32 (autocast off, no GradScaler)" + (f": {self.reason}" if self.reason else "")
        else:
            scaler = " + GradScaler" if self.use_scaler else ", no GradScaler needed"
            speed = "expect AMP to be faster here" if self.native else "expect AMP to be slower here"
            line = f"{self.describe_device()}, {self.precision} autocast{scaler}; {self.units}: {speed}"
        version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
        low, high = (tuple(int(p) for p in v.split(".")) for v in TORCH_RANGE)
        if not low <= version <= high:  # said only outside the range, so stored outputs hold on every tested torch
            line += (f"\nWARNING: torch {torch.__version__} is outside the course's tested range "
                     f"{TORCH_RANGE[0]} to {TORCH_RANGE[1]}: "
                     + ("install a newer torch (README, 'Environments')" if version < low else
                        "it may work, but the course has not been tested on it (README, 'Environments')"))
        return line


def _default_device() -> torch.device:
    """cuda if present, else Apple mps, else cpu."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def _amp_precision(device: torch.device) -> str:
    """This device's autocast dtype, fast or not: bf16 on CPUs and on GPUs with native bf16, fp16 on older GPUs and MPS."""
    if device.type == "cuda":
        return "bf16" if native_bf16(device) else "fp16"
    return "bf16" if device.type == "cpu" else "fp16"


def _default_precision(device: torch.device) -> tuple[str, str]:
    """The precision to use by default, and why where it needs saying: the AMP dtype where the hardware has units
    for it; fp32 on a CPU without bf16 units (emulated bf16 is many times slower than fp32 there)."""
    if device.type != "cpu":
        return _amp_precision(device), ""
    flags = cpu_flags()
    if any(flag in flags for flag in CPU_BF16_FLAGS):
        return "bf16", ""
    seen = "no CPU flags readable here" if not flags else (
        "flags: " + (", ".join(f for f in ("avx512f", "avx2", "avx") if f in flags) or "no AVX"))
    return "fp32", (f"this CPU has no AMX or AVX512-BF16 units ({seen}), so bf16 matmuls would be emulated, "
                    "10-200x slower than fp32; pick(precision='bf16') runs autocast anyway")


def default_rule() -> str:
    """pick()'s default precision rule in one line, built from the thresholds pick() itself uses: what every CLI's
    --help says the default --precision is (the rule, not this machine's answer: --help is read before a run).

    Example::

        >>> default_rule()
        'bf16 on GPUs with compute capability >= 8.0 and on CPUs with AMX bf16 tiles or AVX512-BF16; fp16 + GradScaler on older GPUs and Apple MPS; fp32 on other CPUs (bf16 would be emulated there, many times slower)'
    """
    units = " or ".join(CPU_BF16_FLAGS.values())
    return (f"bf16 on GPUs with compute capability >= {'.'.join(map(str, NATIVE_BF16_CAPABILITY))} and on CPUs "
            f"with {units}; fp16 + GradScaler on older GPUs and Apple MPS; fp32 on other CPUs (bf16 would be "
            "emulated there, many times slower)")


def amp_rule() -> str:
    """``pick(precision="amp")``'s rule in one line: this device's autocast dtype, fast or not (the benchmark's default).

    Example::

        >>> amp_rule()
        'bf16 on any CPU and on GPUs with compute capability >= 8.0; fp16 on older GPUs and Apple MPS'
    """
    return (f"bf16 on any CPU and on GPUs with compute capability >= {'.'.join(map(str, NATIVE_BF16_CAPABILITY))}; "
            "fp16 on older GPUs and Apple MPS")


def pick(device: str | torch.device | None = None, precision: str | torch.dtype | None = None) -> AmpSetup:
    """Choose the device and the precision, and say what the hardware does with them.

    Args:
        device: 'cpu', 'cuda', 'cuda:N', 'mps', a torch.device, or None/'auto' for the best available.
        precision: 'fp32', 'fp16', 'bf16' (or a dtype); None for the device's default (the module docstring's
            table: fp32 on a CPU without bf16 units); 'amp' for the device's autocast dtype even there.

    Example::

        >>> amp = pick()                       # e.g. cuda:0, bf16 on an H100; fp32 on an AVX2-only CPU
        >>> print(amp.summary())               # what was chosen, on which units, and what to expect
        >>> show = pick(precision="amp")       # autocast on any device, to see what it does
    """
    if device is None or device == "auto":
        dev = _default_device()
    else:
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError) as err:
            raise ValueError(f"unknown device {device!r}; use 'cpu', 'cuda', 'cuda:N' or 'mps', "
                             "or leave device=None for the best available") from err
        if dev.type == "cuda" and not torch.cuda.is_available():
            # the device as given ('cuda:7', not 'cuda'), and advice a CLI can translate (_args.as_flags)
            raise ValueError(f"device {str(device)!r} requested but CUDA is not available here; "
                             "leave device=None for the best available, or use 'cpu'")
        if dev.type == "cuda":
            # Name the GPU explicitly, so capability checks and tensor placement agree on which one.
            dev = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
            if dev.index >= torch.cuda.device_count():
                raise ValueError(f"device {device!r}: there are {torch.cuda.device_count()} CUDA devices "
                                 f"(cuda:0..cuda:{torch.cuda.device_count() - 1})")
        if dev.type not in ("cpu", "cuda", "mps"):
            raise ValueError(f"unsupported device type {dev.type!r}; use 'cpu', 'cuda' or 'mps'")
        if dev.type == "mps" and not torch.backends.mps.is_available():
            raise ValueError(f"device {str(device)!r} requested but Apple MPS is not available here; "
                             "leave device=None for the best available, or use 'cpu'")
    reason = ""
    if precision is None:
        prec, reason = _default_precision(dev)
    elif isinstance(precision, str) and precision.strip().lower() == AMP_REQUEST:
        prec = _amp_precision(dev)
    else:
        prec = parse_precision(precision)
    # An explicit bf16 on a pre-Ampere GPU or a CPU without bf16 units is allowed (torch emulates it, so it
    # runs), but it is marked not native: the summary then says to expect it to be slow.
    native, units = _native_units(dev, prec)
    return AmpSetup(dev, prec, native, units, reason)
