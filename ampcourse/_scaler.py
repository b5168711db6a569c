"""The one owner of GradScaler's settings: their defaults, what values make sense, and a saved scaler state.

Everything that builds or checks a loss scaler asks here: ``AmpSetup.make_scaler`` (ampcourse.device),
``train(scaler_kwargs=...)``, ``scaling.LossScaler`` and its setters, ``scaling.simulate_*`` and
``checkpoint`` (a saved GradScaler state). It sits on the lowest floor (it imports only ``_args``), so
every caller reaches it without climbing.

    >>> from ampcourse import _scaler
    >>> _scaler.gradscaler_kwargs({"init_scale": np.float64(2**10)})   # {'init_scale': 1024.0}
    >>> _scaler.check_args(2**16, 2.0, 0.5, 2000)                      # (65536.0, 2.0, 0.5, 2000)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from . import _args

__all__ = ["DEFAULTS", "MAX_GROWTH_INTERVAL", "check_args", "gradscaler_kwargs", "check_state"]

#: torch.amp.GradScaler's defaults (tests/test_scaling.py compares them with GradScaler's and LossScaler's signatures).
DEFAULTS = {"init_scale": 2.0**16, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000}
#: The clean-step counter is an int32 tensor (as in GradScaler), so it cannot count further than this.
MAX_GROWTH_INTERVAL = _args.INT32_MAX


def _float32(x: float) -> float:
    """Round a Python float to the nearest float32 (ties to even), as a C++ static_cast<float> does."""
    with np.errstate(over="ignore"):  # too big for float32 becomes inf, which the caller handles
        return float(np.float32(x))


def check_args(init_scale: Any, growth_factor: Any, backoff_factor: Any,
               growth_interval: Any) -> tuple[float, float, float, int]:
    """The four scaler settings as Python numbers; ValueError naming the first one that makes no sense.

    Each may be an int, a float, a numpy scalar or a 0-d tensor (see ampcourse._args). GradScaler itself
    accepts a negative scale and a growth_interval its int32 counter cannot reach.
    """
    init = _args.real(init_scale, "init_scale", what="a positive finite float32 number (2**-149 .. 3.4e38)")
    if not (init > 0 and math.isfinite(_float32(init)) and _float32(init) > 0):
        raise ValueError(f"init_scale must be a positive finite float32 number (2**-149 .. 3.4e38), "
                         f"got {_args.shown(init_scale)}; GradScaler's default is 2**16 = 65536")
    growth = _args.real(growth_factor, "growth_factor", what="a finite number > 1 (the scale grows by it)")
    if not growth > 1:
        raise ValueError(f"growth_factor must be a finite number > 1 (the scale grows by it), got {_args.shown(growth_factor)}")
    backoff = _args.real(backoff_factor, "backoff_factor",
                         what="a number strictly between 0 and 1 (the scale shrinks by it)")
    if not 0 < backoff < 1:
        raise ValueError(f"backoff_factor must lie strictly between 0 and 1 (the scale shrinks by it), "
                         f"got {_args.shown(backoff_factor)}")
    interval = _args.integer(growth_interval, "growth_interval", low=1, high=MAX_GROWTH_INTERVAL,
                             what="an int >= 1 and <= 2**31 - 1 (clean steps before the scale grows; "
                                  "the step counter is an int32)")
    return init, growth, backoff, interval


def gradscaler_kwargs(kwargs: Mapping[str, Any] | None, name: str = "scaler_kwargs") -> dict[str, Any]:
    """Keyword arguments for torch.amp.GradScaler, checked: only its settings, each sensible, as Python numbers.

    Only the keys given come back (GradScaler fills in its defaults); 'enabled' must be True or False.
    Python numbers because GradScaler hands them to a C++ kernel that takes no numpy scalars.
    """
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise ValueError(f"{name} must be a dict or None, got {_args.shown(kwargs)}")
    unknown = sorted(set(kwargs) - {*DEFAULTS, "enabled"})
    if unknown:
        raise ValueError(f"unknown {name} {unknown}; GradScaler takes {', '.join([*DEFAULTS, 'enabled'])}")
    full = dict(zip(DEFAULTS, check_args(**{**DEFAULTS, **{k: v for k, v in kwargs.items() if k != "enabled"}})))
    out = {k: full[k] for k in DEFAULTS if k in kwargs}
    if "enabled" in kwargs:
        out["enabled"] = _args.flag(kwargs["enabled"], f"{name}['enabled']")
    return out


def check_state(saved: Any) -> None:
    """ValueError unless `saved` is an enabled GradScaler's state_dict with sensible values (a checkpoint's, say)."""
    if not isinstance(saved, Mapping):
        raise ValueError(f"it is a {type(saved).__name__}")
    check_args(saved.get("scale"), saved.get("growth_factor"), saved.get("backoff_factor"), saved.get("growth_interval"))
    _args.integer(saved.get("_growth_tracker"), "_growth_tracker", low=0, high=MAX_GROWTH_INTERVAL)
