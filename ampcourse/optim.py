"""Pure bf16 training without fp32 master weights: AdamW whose weight update is rounded to nearest,
rounded stochastically, or Kahan-compensated.

Mixed precision keeps an fp32 copy of every weight because a typical update (about ``lr``) is smaller
than half the bf16 spacing around the weight and rounds away (chapter 4, section 4.8). Pure bf16
training drops that copy (and the fp32 optimizer state) and repairs the update instead:

- ``"nearest"``: plain round-to-nearest; small updates are lost. The baseline that fails.
- ``"stochastic"``: round up with probability equal to the fraction of the gap, so the update survives
  *on average* (the expected weight equals the fp32 result).
- ``"kahan"``: keep the rounding error of every update in a bf16 compensation buffer and add it to the
  next update (Kahan summation), so errors do not accumulate.

    >>> from ampcourse.optim import BF16AdamW
    >>> model = model.to(torch.bfloat16)
    >>> opt = BF16AdamW(model.parameters(), lr=1e-4, rounding="kahan")

The update itself is computed in fp32 from bf16 gradients and bf16 moments; only storage is bf16.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from . import _args

__all__ = ["ROUNDINGS", "stochastic_round", "BF16AdamW"]

#: How the fp32 result of an update is stored back into a bf16 weight.
ROUNDINGS = ("nearest", "stochastic", "kahan")


def stochastic_round(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Round an fp32 tensor to bf16, up with probability equal to the fraction of the gap (unbiased)."""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
        raise TypeError(f"stochastic_round takes a float32 tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {_args.shown(generator)}")
    # bf16 is the top 16 bits of fp32: adding a uniform 16-bit integer to the bit pattern and cutting
    # the low 16 bits off rounds up exactly when the random number exceeds the distance to the next value.
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    bits = (x.view(torch.int32) + noise) & -65536  # -65536 == 0xFFFF0000 as int32
    out = bits.view(torch.float32).to(torch.bfloat16)  # exact: the low 16 bits are already zero
    return torch.where(torch.isfinite(x), out, x.to(torch.bfloat16))  # inf/nan pass through unchanged


def _betas(betas) -> tuple[float, float]:
    """betas as two Python floats in [0, 1); ValueError naming them otherwise."""
    what = "two numbers in [0, 1), such as (0.9, 0.999)"
    if isinstance(betas, (str, bytes)) or not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be {what}, got {_args.shown(betas)}")
    out = tuple(_args.real(b, "betas", nonnegative=True, what=what) for b in betas)
    if not all(b < 1.0 for b in out):
        raise ValueError(f"betas must be {what}, got {_args.shown(betas)}")
    return out


_CHECKS = {
    "lr": lambda v: _args.real(v, "lr", positive=True, what="a positive finite number"),
    "betas": lambda v: _betas(v),
    "eps": lambda v: _args.real(v, "eps", positive=True, what="> 0 (a finite number)"),
    "weight_decay": lambda v: _args.real(v, "weight_decay", nonnegative=True, what=">= 0 (a finite number)"),
}


def _settings(values: dict) -> dict:
    """The given optimizer settings as plain Python numbers, each checked (ValueError naming the first bad one)."""
    return {k: _CHECKS[k](v) for k, v in values.items()}


class BF16AdamW(torch.optim.Optimizer):
    """AdamW for bf16 parameters: bf16 weights and moments, update in fp32, rounding chosen by `rounding`."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, rounding: str = "kahan", seed: int = 0):
        # Plain Python numbers from here on (numpy scalars and 0-d tensors too), each checked before any work.
        rounding = _args.choice(rounding, "rounding", ROUNDINGS)
        lr, betas, eps, weight_decay = _settings(dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)).values()
        seed = _args.seed(seed)
        what = "params must be an iterable of parameters or of parameter-group dicts"
        if isinstance(params, torch.Tensor) or not isinstance(params, Iterable):  # torch's own words would follow
            raise ValueError(f"{what} (such as model.parameters()), got {_args.shown(params)}")
        params = list(params)
        if not params:
            raise ValueError(f"{what}, got an empty parameter list")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype != torch.bfloat16:
                    raise TypeError(f"BF16AdamW trains bf16 parameters; got a {p.dtype} parameter of shape "
                                    f"{tuple(p.shape)} (call model.to(torch.bfloat16) first)")
        self.rounding = rounding
        self.generator = torch.Generator().manual_seed(seed)  # CPU generator: reproducible on any device

    def add_param_group(self, param_group: dict) -> None:
        """torch's add_param_group, with a group's own settings (lr, betas, eps, weight_decay) checked like the defaults."""
        if isinstance(param_group, dict):
            param_group = {**param_group, **_settings({k: v for k, v in param_group.items() if k in _CHECKS})}
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step; the new weight is stored in bf16 with this optimizer's rounding."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)  # bf16, like the weights: no fp32 copy anywhere
                    state["exp_avg_sq"] = torch.zeros_like(p)
                    if self.rounding == "kahan":
                        state["compensation"] = torch.zeros_like(p)
                state["step"] += 1
                t = state["step"]
                g = p.grad.float()
                m = state["exp_avg"].float().lerp_(g, 1 - beta1)
                v = state["exp_avg_sq"].float().mul_(beta2).addcmul_(g, g, value=1 - beta2)
                state["exp_avg"].copy_(m)
                state["exp_avg_sq"].copy_(v)
                denom = (v / (1 - beta2**t)).sqrt_().add_(group["eps"])
                w = p.float()
                update = -group["lr"] * (m / (1 - beta1**t) / denom + group["weight_decay"] * w)
                self._store(p, w, update, state)
        return loss

    def _store(self, p: torch.Tensor, w: torch.Tensor, update: torch.Tensor, state: dict) -> None:
        """Write w + update into the bf16 parameter p, rounded as self.rounding says."""
        if self.rounding == "nearest":
            p.copy_(w + update)
        elif self.rounding == "stochastic":
            noise_src = (w + update).cpu() if p.device.type != "cpu" else w + update
            p.copy_(stochastic_round(noise_src, self.generator))
        else:  # Kahan: add last step's rounding error to this update, keep the new rounding error
            comp = state["compensation"]
            corrected = update + comp.float()
            p.copy_(w + corrected)
            comp.copy_(corrected - (p.float() - w))  # what the bf16 store lost (exact in fp32)
