"""Pure bf16 training without fp32 master weights: AdamW whose weight update is rounded to nearest,
rounded stochastically, or Kahan-compensated (chapter 4).

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
    """AdamW for bf16 parameters: bf16 weights and moments, the update in fp32, stored with the rounding chosen.

    There is no fp32 master copy and no fp32 optimizer state (2 + 2 + 2 bytes per parameter, plus 2 for
    ``"kahan"``'s compensation buffer). The update is AdamW's, computed in fp32 registers from the bf16
    gradient and moments; only how its result is stored back differs:

    * ``"nearest"``: round to nearest; an update below half the bf16 spacing of its weight is lost.
    * ``"stochastic"``: round up with probability equal to the fraction of the gap (unbiased). The random
      bits come from one generator per device, on that device (no host round trip per step); their
      states are in :meth:`state_dict`, so a resumed run rounds exactly as the uninterrupted one.
    * ``"kahan"``: keep each rounding error in a bf16 buffer and add it to the next update.

    Args:
        params: bf16 parameters (or parameter-group dicts), as for any torch optimizer.
        lr: learning rate (default 1e-3).
        betas: coefficients of the running averages of the gradient and its square (default (0.9, 0.999)).
        eps: added to the denominator (default 1e-8).
        weight_decay: decoupled weight decay, as in AdamW (default 0).
        rounding: ``"nearest"``, ``"stochastic"`` or ``"kahan"`` (default).
        seed: seed of the stochastic rounding's generators (default 0).

    Example::

        >>> model = torch.nn.Linear(64, 64).to(torch.bfloat16)
        >>> opt = BF16AdamW(model.parameters(), lr=1e-4, rounding="stochastic")
        >>> model(torch.randn(8, 64, dtype=torch.bfloat16)).float().square().mean().backward()
        >>> opt.step()
        >>> torch.save(opt.state_dict(), "opt.pt")  # moments and the rounding generators: resume is exact
    """

    #: The key under which state_dict() keeps what torch's optimizer state does not: rounding and generators.
    EXTRA_KEY = "bf16adamw"

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
        self.rounding, self.seed = rounding, seed
        self._generators: dict[str, torch.Generator] = {}  # device name -> the rounding's random bits there
        self._pending: dict[str, torch.Tensor] = {}  # generator states loaded before their device was used
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @property
    def generator(self) -> torch.Generator:
        """The CPU generator of stochastic rounding (the one CPU parameters use)."""
        return self._generator(torch.device("cpu"))

    def _generator(self, device: torch.device) -> torch.Generator:
        """The stochastic rounding's generator on `device`, made on first use (from the seed or a loaded state)."""
        name = str(device)
        gen = self._generators.get(name)
        if gen is None:
            gen = torch.Generator(device=device).manual_seed(self.seed)
            if name in self._pending:
                gen.set_state(self._pending.pop(name))
            self._generators[name] = gen
        return gen

    def add_param_group(self, param_group: dict) -> None:
        """torch's add_param_group, refusing what the constructor refuses: non-bf16 parameters, bad settings."""
        if isinstance(param_group, dict):
            param_group = {**param_group, **_settings({k: v for k, v in param_group.items() if k in _CHECKS})}
            params = param_group.get("params")
            if isinstance(params, Iterable) and not isinstance(params, (torch.Tensor, set)):
                params = param_group["params"] = list(params)  # a generator is read once: keep what it gave
            for p in [params] if isinstance(params, torch.Tensor) else params if isinstance(params, list) else []:
                if isinstance(p, torch.Tensor) and p.dtype != torch.bfloat16:
                    raise TypeError(f"BF16AdamW trains bf16 parameters; got a {p.dtype} parameter of shape "
                                    f"{tuple(p.shape)} (call model.to(torch.bfloat16) first)")
        super().add_param_group(param_group)

    def state_dict(self) -> dict:
        """torch's optimizer state, plus this optimizer's rounding and its generators' states (resume is exact)."""
        out = super().state_dict()
        out[self.EXTRA_KEY] = {"rounding": self.rounding, "seed": self.seed,
                               "generators": {name: g.get_state() for name, g in self._generators.items()}}
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load_state_dict, after checking the state was saved by a BF16AdamW with this rounding."""
        if not isinstance(state_dict, dict) or "state" not in state_dict:
            raise ValueError(f"state_dict must be what BF16AdamW.state_dict() returns, got {_args.shown(state_dict)}")
        extra = state_dict.get(self.EXTRA_KEY) or {}
        saved = extra.get("rounding")
        needed = {"step", "exp_avg", "exp_avg_sq"} | ({"compensation"} if self.rounding == "kahan" else set())
        for key, st in state_dict["state"].items():
            missing = needed - set(st)
            if saved is None and "compensation" in st and self.rounding != "kahan":
                saved = "kahan"
            if missing and saved is None:
                raise ValueError(f"this optimizer state does not come from BF16AdamW(rounding={self.rounding!r}): "
                                 f"parameter {key} has no {', '.join(sorted(missing))}; load the state of a "
                                 "BF16AdamW built with the same rounding")
        if saved is not None and saved != self.rounding:
            raise ValueError(f"this state was saved by BF16AdamW(rounding={saved!r}); build the optimizer with "
                             f"rounding={saved!r} to resume it (this one has rounding={self.rounding!r})")
        super().load_state_dict({k: v for k, v in state_dict.items() if k != self.EXTRA_KEY})
        self._generators.clear()
        self._pending = dict(extra.get("generators", {}))
        if "seed" in extra:
            self.seed = int(extra["seed"])

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
                if p.grad.is_sparse:
                    raise RuntimeError(f"BF16AdamW does not support sparse gradients (a parameter of shape "
                                       f"{tuple(p.shape)}); build the layer without sparse=True, e.g. "
                                       "nn.Embedding(..., sparse=False)")
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
            p.copy_(stochastic_round(w + update, self._generator(p.device)))  # random bits made where p lives
        else:  # Kahan: add last step's rounding error to this update, keep the new rounding error
            comp = state["compensation"]
            corrected = update + comp.float()
            p.copy_(w + corrected)
            comp.copy_(corrected - (p.float() - w))  # what the bf16 store lost (exact in fp32)
