"""The front door: the one reader of what train, trial and examine are handed (a model, data, precisions) and the checks
every one of them runs before any work (finite data, labels in range, a model that can train, AMP that runs here, a
preflight forward pass).

A rule about an input is written once, here, and holds in every entry point. A refusal is an :class:`InputError`,
a ``ValueError`` and a ``TypeError`` at once (the pattern of numpy's ``AxisError``), so code that catches either keeps
working; each message names the argument (the command lines rename it to their flag) and says what is allowed.

    >>> from ampcourse import inputs
    >>> module, name = inputs.read_model("mlp", seed=0)               # a reference name, a module or a factory
    >>> data = inputs.read_data(loader)                                # a DataLoader: batches as it gives them
    >>> inputs.precision_names("bf16", allowed=("fp32", "bf16"))       # ('bf16',): one name is a list of one

What data may be (:func:`read_data`): ``None`` (a reference model's synthetic dataset), a ``TensorDataset(inputs,
targets)`` or a pair of tensors (indexed by ``ampcourse.train``'s seeded batch order), or what a learner's own training
code iterates: a ``torch.utils.data.DataLoader`` or any re-iterable of ``(inputs, targets)`` batches (a list of pairs),
read as :class:`Batches`: iterated as given (the loader's sampler, batch size and collate_fn; never its ``.dataset``
re-batched), epoch after epoch. Each epoch's iteration starts under a torch seed fixed by ``(seed, epoch)``, so a
shuffling DataLoader without a generator of its own yields the same batches in every run that is compared.

Layering: this module uses ``_args``, ``device`` and ``models`` only; ``train``, ``trial`` and ``doctor`` import it.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.utils.data import Dataset, IterableDataset, TensorDataset

from . import _args, _rng, models
from ._args import InputError
from .device import PRECISIONS as _DEVICE_PRECISIONS
from .device import AmpSetup, parse_precision

__all__ = ["InputError", "Batches", "reference_name", "read_model", "check_trainable", "read_data", "check_tensors",
           "check_finite", "check_labels", "precision", "precision_names", "amp_problem", "check_amp",
           "check_fp16_parameters", "preflight", "first_tensor", "cli_precision"]

#: The precisions train() takes (one autocast dtype each, fp32 without autocast).
PRECISIONS = tuple(_DEVICE_PRECISIONS)

_REFERENCE_TYPES = {models.MLP: "mlp", models.SmallCNN: "cnn", models.TinyTransformer: "transformer"}


# ---------------------------------------------------------------------------------------------
# The model: a reference name, a module or a factory
# ---------------------------------------------------------------------------------------------

def reference_name(module: nn.Module) -> str | None:
    """'mlp', 'cnn' or 'transformer' for a reference model of ``ampcourse.models``, None for a model of your own."""
    return _REFERENCE_TYPES.get(type(module))


def check_trainable(module: nn.Module, name: str = "model", *, trainable: bool = True) -> None:
    """InputError unless the model holds real (not meta) tensors and, with trainable=True, a parameter that trains."""
    meta = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
    if meta:
        raise InputError(f"{name} holds tensors on the meta device (shapes without values), e.g. {meta[0]!r}; give it "
                         "real weights first (model.to_empty(device='cpu') and initialise, or load a state_dict)")
    if trainable and not any(p.requires_grad for p in module.parameters()):
        none = not [*module.parameters(), *module.buffers()]
        raise InputError(f"{name} {type(module).__name__} has no trainable parameters "
                         f"({'none at all' if none else 'all have requires_grad=False'}); "
                         "unfreeze some (p.requires_grad_(True)) before training")


def read_model(value: Any, name: str = "model", *, size: str = "tiny", seed: int = 0,
               accept: Sequence[str] = ("name", "module", "factory"), trainable: bool = True) -> tuple[nn.Module, str | None]:
    """The model an entry point was handed, and its reference name (None for a model of your own).

    Args:
        value: a reference name (``'mlp'``, ``'cnn'``, ``'transformer'``, built with `size` and `seed`), an
            ``nn.Module`` (returned as it is, after the checks), or a factory: a callable returning a fresh
            ``nn.Module``, called once under ``torch.manual_seed(seed)`` (the caller's RNG is left as it was).
        name: the argument's name, for the messages. accept: which of the three forms this entry point takes.
        trainable: refuse a model without a parameter that trains (the doctor examines frozen models too).

    Example::

        >>> read_model("mlp")                         # (MLP(...), 'mlp')
        >>> read_model(lambda: MyNet(), seed=1)       # (MyNet(...), None)
    """
    forms = {"name": f"a reference model name ({', '.join(models.MODELS)})", "module": "an nn.Module",
             "factory": "a callable that returns a fresh nn.Module"}
    allowed = " or ".join(forms[a] for a in accept)
    if isinstance(value, str) and "name" in accept:
        if value not in models.MODELS:
            raise InputError(f"{name}: unknown model {value!r}; choose one of {', '.join(models.MODELS)} or pass "
                             + " or ".join(forms[a] for a in accept if a != "name"))
        return models.make_model(value, size=size, seed=seed), value
    if isinstance(value, nn.Module):
        if "module" not in accept:
            raise InputError(f"{name} must build a fresh model ({allowed}), not be one: this entry point trains "
                             "several copies of a fresh one and must not change yours (pass e.g. `lambda: MyNet()`)")
        check_trainable(value, name, trainable=trainable)
        return value, reference_name(value)
    if callable(value) and "factory" in accept:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            made = value()
        if not isinstance(made, nn.Module):
            raise InputError(f"{name}() must return an nn.Module, got {_args.shown(made)}")
        check_trainable(made, f"the model from {name}", trainable=trainable)
        return made, None  # built by your code: its size is yours, so no reference dataset is assumed to fit
    raise InputError(f"{name} must be {allowed}, got {_args.shown(value)}")


# ---------------------------------------------------------------------------------------------
# Data: tensors to index, or batches to iterate
# ---------------------------------------------------------------------------------------------

def first_tensor(out: Any) -> torch.Tensor | None:
    """The tensor a model's output leads with: itself, the first of a tuple/list (``(logits, aux)``), ``.logits``."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out:
        return first_tensor(out[0])
    logits = out.get("logits") if isinstance(out, Mapping) else getattr(out, "logits", None)
    return logits if isinstance(logits, torch.Tensor) else None


def check_tensors(inputs: Any, targets: Any, name: str = "data") -> None:
    """InputError unless inputs and targets are real tensors (not on the meta device) with one row per sample."""
    for what, t in (("inputs", inputs), ("targets", targets)):
        if not isinstance(t, torch.Tensor):
            raise InputError(f"{name} {what} must be a tensor, got {_args.shown(t)}")
        if t.is_meta:
            raise InputError(f"{name} {what} are on the meta device (shapes without values); pass real tensors")
        if t.dim() == 0:
            raise InputError(f"{name} {what} must have one row per sample, got a 0-d tensor")


def _pair(value: Any) -> bool:
    """A tuple or list of exactly two tensors."""
    return isinstance(value, (tuple, list)) and len(value) == 2 and all(isinstance(t, torch.Tensor) for t in value)


def _batch(item: Any, index: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch from an iterable, checked: an (inputs, targets) pair of real tensors with the same number of rows."""
    if not _pair(item):
        raise InputError(f"{name}: batch {index} is {_args.shown(item)}; each batch must be an (inputs, targets) pair "
                         "of tensors (a DataLoader over a TensorDataset gives them)")
    x, y = item
    check_tensors(x, y, f"{name} batch {index}")
    if len(x) != len(y):
        raise InputError(f"{name}: batch {index} has {len(x)} inputs and {len(y)} targets; give one target per input")
    return x, y


def _epoch_seed(seed: int, epoch: int) -> int:
    """The torch seed under which epoch `epoch`'s iteration of a Batches starts (distinct per (seed, epoch))."""
    return (seed * 0x9E3779B97F4A7C15 + (epoch + 1) * 0xD1B54A32D192ED03) % (2**63)


class Batches:
    """A re-iterable of (inputs, targets) batches read as the learner's training code reads it, epoch after epoch.

    Each epoch calls ``iter(source)`` afresh and takes its batches in the order it gives them. The iteration starts
    (``iter()`` and the first batch: where a DataLoader draws its shuffle and worker seeds) under
    ``torch.manual_seed`` of a number fixed by ``(seed, epoch)``, inside a forked RNG: the same batches for every run
    that is compared, and the caller's random stream untouched. A DataLoader with a ``generator`` of its own draws
    from that instead, as it would in your loop.

    Resume: ``stream(skip=k)`` iterates (and drops) the first k batches, so a resumed run trains on the batches an
    uninterrupted one would have reached, exactly when iterating the source afresh gives the same batches again
    (a DataLoader without shuffle, one that shuffles without a generator of its own (seeded here per epoch), or
    one rebuilt with a freshly seeded generator).

    Example::

        >>> loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)
        >>> data = Batches(loader, seed=0)
        >>> x0, y0 = data.first()
    """

    def __init__(self, source: Iterable, seed: int = 0, name: str = "data") -> None:
        self.source, self.seed, self.name = source, _args.seed(seed), name
        self._first: tuple[torch.Tensor, torch.Tensor] | None = None

    def __len__(self) -> int:
        """Batches per epoch, if the source knows (a DataLoader, a list); TypeError otherwise."""
        return len(self.source)  # type: ignore[arg-type]

    @property
    def batches_per_epoch(self) -> int | None:
        """len(source) where it has one, else None."""
        try:
            return len(self.source)  # type: ignore[arg-type]
        except TypeError:
            return None

    def _epoch(self, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """One epoch's batches, checked; its start seeded by (seed, epoch)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_epoch_seed(self.seed, epoch))
            it = iter(self.source)
            first = next(it, _END)
        if first is _END:
            raise InputError(f"{self.name} gave no batch in epoch {epoch}" + (" (it is empty)" if epoch == 0 else
                             "; a re-iterable must give its batches every time it is iterated (an exhausted "
                             "iterator does not)"))
        yield _batch(first, 0, self.name)
        for i, item in enumerate(it, 1):
            yield _batch(item, i, self.name)

    def first(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The first batch of epoch 0 (what the checks and the preflight run on), read once: a DataLoader with
        workers starts them for every iteration."""
        if self._first is None:
            self._first = next(self._epoch(0))
        return self._first

    def stream(self, skip: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Every batch, epoch after epoch, without end; the first `skip` are iterated and dropped (a resume)."""
        epoch = 0
        while True:
            for batch in self._epoch(epoch):
                if skip:
                    skip -= 1
                    continue
                yield batch
            epoch += 1

    def __repr__(self) -> str:
        return f"Batches({type(self.source).__name__}, seed={self.seed})"


_END = object()


def read_data(value: Any, name: str = "data", *, reference: str | None = None, n_samples: int = 1024, seed: int = 0,
              size: str = "tiny", batch_size: Any = None) -> TensorDataset | Batches:
    """The data an entry point was handed: a TensorDataset of two tensors, or :class:`Batches` to iterate.

    Args:
        value: None (the synthetic dataset of the reference model `reference`, `n_samples` of it), a
            ``TensorDataset(inputs, targets)``, a pair ``(inputs, targets)`` of tensors, a DataLoader, or any
            re-iterable of ``(inputs, targets)`` batches (a list of pairs). Not an iterator that runs out (a
            generator): every epoch iterates the data afresh.
        batch_size: the entry point's batch_size argument: None with batches to iterate (they have their size
            already; a second one would be ignored silently), so any other value is refused there.

    Example::

        >>> read_data((x, y))                                 # TensorDataset(x, y)
        >>> read_data(DataLoader(ds, batch_size=32))          # Batches(DataLoader, seed=0)
    """
    if value is None:
        if reference is None:
            raise InputError(f"{name} is None: pass a TensorDataset(inputs, targets), a pair of tensors or a "
                             f"DataLoader for your own model ({name}=None only works for the reference models "
                             f"{', '.join(models.MODELS)})")
        return models.make_dataset(reference, n=n_samples, seed=seed, size=size)
    if _pair(value):
        check_tensors(*value, name)
        if len(value[0]) != len(value[1]):  # else TensorDataset's AssertionError
            raise InputError(f"{name}: inputs {tuple(value[0].shape)} and targets {tuple(value[1].shape)} must have "
                             "one row per sample, the same number of rows")
        value = TensorDataset(*value)
    if isinstance(value, TensorDataset):
        if len(value.tensors) != 2:
            raise InputError(f"{name} must be a TensorDataset of two tensors (inputs, targets), got one with "
                             f"{len(value.tensors)} tensors")
        check_tensors(*value.tensors, name)
        if len(value) == 0:
            raise InputError(f"{name} is empty (0 samples); pass at least batch_size samples")
        return value
    if isinstance(value, (Dataset, IterableDataset)) and not hasattr(value, "batch_sampler"):
        raise InputError(f"{name} is a {type(value).__name__} of single samples; wrap it in a DataLoader "
                         f"(DataLoader({name}, batch_size=32, shuffle=True)) so that it gives batches, or pass a "
                         "TensorDataset(inputs, targets)")
    if isinstance(value, Sequence) and value and not isinstance(value, (str, bytes)) and not _pair(value[0]):
        raise InputError(f"{name} must be a TensorDataset(inputs, targets), a pair of tensors, a DataLoader or a list "
                         f"of (inputs, targets) batches, got {_args.shown(value)}")
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise InputError(f"{name} must be a TensorDataset(inputs, targets), a pair of tensors, a DataLoader or a list "
                         f"of (inputs, targets) batches, got {_args.shown(value)}")
    if iter(value) is value:  # a generator or another iterator: the second epoch would find it empty
        raise InputError(f"{name} is an iterator ({type(value).__name__}), which runs out after one pass; pass a "
                         "DataLoader or a list of (inputs, targets) batches, which can be iterated every epoch")
    if batch_size is not None:
        raise InputError(f"batch_size={_args.shown(batch_size)} with {name} a {type(value).__name__}: its batches "
                         "have their size already (the loader's batch_size); leave batch_size out")
    return Batches(value, seed, name)


def check_finite(inputs: torch.Tensor, targets: torch.Tensor, name: str = "data") -> None:
    """InputError if a floating-point input or target is nan or inf: every step would give a nan loss."""
    for what, t in (("inputs", inputs), ("targets", targets)):
        if t.is_floating_point():
            bad = ~torch.isfinite(t)
            if bad.any():
                first = int(bad.reshape(len(t), -1).any(1).nonzero()[0])
                raise InputError(f"{name} {what} hold {int(bad.sum())} nan/inf values (the first in sample {first}); "
                                 "every step would give a nan loss: clean or drop those samples")


def check_labels(targets: torch.Tensor, classes: int, name: str = "data targets") -> None:
    """InputError unless targets are integer class indices in 0..classes-1 (what cross-entropy takes).

    Else cross_entropy raises IndexError ("Target 12 is out of bounds") at the first batch that holds one, which may
    be step 500 (on CUDA a device-side assert that ends the process).
    """
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise InputError(f"{name} are {str(targets.dtype).removeprefix('torch.')}; the course's loss (cross-entropy) "
                         f"takes int64 class indices in 0..{classes - 1} (pass loss_fn= for other targets)")
    if targets.numel():
        low, high = int(targets.min()), int(targets.max())
        if low < 0 or high >= classes:
            raise InputError(f"{name} hold class indices from {low} to {high}, and the model's output has {classes} "
                             f"classes (0..{classes - 1}); fix the labels or the model's output size")


# ---------------------------------------------------------------------------------------------
# Precisions
# ---------------------------------------------------------------------------------------------

def precision(value: Any, name: str = "precision") -> str | None:
    """One precision: None (the device's choice) or a name/dtype as ``device.parse_precision`` reads it."""
    if value is None:
        return None
    try:
        return parse_precision(value)
    except ValueError as err:
        raise InputError(f"{name}: {err}") from None


def precision_names(value: Any, name: str = "precisions", *, allowed: Sequence[str] = PRECISIONS,
                    extra: Sequence[str] = (), refused: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """A sequence of precision names, each once, read as train() reads one ('FP16 ', 'bfloat16', torch.float16).

    One name alone (a str or a dtype) counts as a sequence of one. `extra` names (``'fp16-noscaler'``) are taken as
    they are; `refused` maps a precision to the reason it is not allowed here (the doctor: fp32 is its reference).

    Example::

        >>> precision_names("bfloat16")                                   # ('bf16',)
        >>> precision_names(["bf16", "fp16-noscaler"], extra=("fp16-noscaler",))
    """
    names = [*allowed, *extra]
    listed, quoted = ", ".join(names), [repr(n) for n in names]
    either = quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} and/or {quoted[-1]}"
    if isinstance(value, (str, torch.dtype)):
        value = (value,)
    if isinstance(value, (bytes, Mapping)) or not isinstance(value, (Sequence, set, frozenset)) or not value:
        raise InputError(f"{name} must be a non-empty sequence of {either}; got {_args.shown(value)}")
    out = []
    for item in value:
        key = item.strip().lower() if isinstance(item, str) else None
        if key in extra:
            out.append(key)
            continue
        try:
            parsed = parse_precision(item)  # the one reading of precision names (ampcourse.device)
        except ValueError:
            raise InputError(f"{name}: unknown precision {_args.shown(item)}; choose from {listed} "
                             "(dtype names such as 'bfloat16' work too)") from None
        if refused and parsed in refused:
            raise InputError(f"{name}: {refused[parsed]}")
        if parsed not in allowed:
            raise InputError(f"{name}: {parsed!r} is not examined here; choose from {listed}")
        out.append(parsed)
    return tuple(dict.fromkeys(out))


# ---------------------------------------------------------------------------------------------
# Will AMP run, and will the first step?
# ---------------------------------------------------------------------------------------------

@functools.cache
def amp_problem(device_type: str, precision: str) -> str | None:
    """None if autocast (and, for fp16, GradScaler) runs on this device type; else why not (cached per pair)."""
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
    if dtype is None:
        return None
    try:
        with warnings.catch_warnings(record=True) as caught:  # unsupported autocast warns and disables itself
            warnings.simplefilter("always")
            with torch.amp.autocast(device_type=device_type, dtype=dtype):
                a = torch.ones(2, 2, device=device_type)
                out = a @ a
            if precision == "fp16":
                torch.amp.GradScaler(device_type)
    except (RuntimeError, TypeError, ValueError) as err:
        return f"{type(err).__name__}: {str(err).splitlines()[0]}"
    if out.dtype != dtype:
        return "; ".join(str(w.message).splitlines()[0] for w in caught) or f"autocast gave {out.dtype}"
    return None


def check_amp(amp: AmpSetup, name: str = "precision", label: str | None = None) -> None:
    """InputError naming the precision if autocast (or fp16's GradScaler) cannot run on amp's device here."""
    problem = amp_problem(amp.device_type, amp.precision)
    if problem:
        raise InputError(f"{name} {label or amp.precision!r} cannot run on {amp.device} with torch {torch.__version__} "
                         f"({problem}); use {'bf16 or ' if amp.precision == 'fp16' else ''}fp32")


def check_fp16_parameters(module: nn.Module, scaled: bool, name: str = "model", entry: str = "train()") -> None:
    """InputError if fp16 loss scaling would meet fp16 parameters: GradScaler cannot unscale fp16 gradients.

    It would fail in the first step with "Attempting to unscale FP16 gradients" (in a trial: after the fp32
    reference had run); here it fails before any work, saying why and what to do.
    """
    if not scaled:
        return
    half = [n for n, p in module.named_parameters() if p.requires_grad and p.dtype == torch.float16]
    if half:
        raise InputError(f"{name} parameter {half[0]!r} is float16 ({len(half)} trainable fp16 parameters): fp16 AMP "
                         "keeps the parameters in float32 and autocast runs the matmuls in fp16, and GradScaler cannot "
                         f"unscale fp16 gradients; call model.float() before {entry}, or train the fp16 model with "
                         "precision='fp32' (no autocast, no scaler)")


def preflight(model: nn.Module, x: Any, y: Any, loss_fn: Callable | None, amp: AmpSetup, autocast: bool = True,
              labels: torch.Tensor | None = None) -> int | None:
    """Run the model (and the course's loss) once on one micro-batch: data that does not fit fails now, clearly.

    Eval mode, no gradients and every random stream kept (``_rng.kept``: torch's, Python's, NumPy's and the
    generators the model holds): no parameter, running statistic or random stream changes, so the
    run that follows is exactly the one without this check. A loss function of your own is not called here (it
    may count its calls); pass loss_fn=None to check only the model. With the course's loss, `labels` (all the
    targets of a dataset; default: y) are checked against the output's class count before it runs. An InputError
    raised inside (a monitor's hook) comes out as it is; anything else the model raises becomes a ValueError
    naming the batch (``models.data_errors``).

    Returns:
        With the course's loss, the class count of the output (its last dimension), which later batches' labels
        must fit; None otherwise.
    """
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    classes = None
    try:
        with _rng.kept(model, amp.device), torch.no_grad():  # every stream: torch's, Python's, NumPy's, the model's
            with models.data_errors(model, x, y), amp.autocast(enabled=autocast):
                out = model(x)
                if loss_fn is not None:
                    logits = first_tensor(out)
                    if logits is not None and logits.dim() >= 1 and isinstance(y, torch.Tensor):
                        classes = logits.shape[-1]
                        check_labels(y if labels is None else labels, classes)
                    loss_fn(out, y)
    except ValueError as err:
        if isinstance(err.__cause__, InputError):
            raise err.__cause__ from None
        raise
    finally:
        for m, mode in modes:
            m.training = mode
    return classes


def cli_precision(text: str, flag: str, *, allowed: Sequence[str] = ("fp32", "fp16", "bf16"),
                  refused: Mapping[str, str] | None = None) -> str:
    """A --precision value read as every API reads it (``precision_names``, which asks
    ``device.parse_precision``): 'BF16', 'half', 'float16', 'bfloat16' work in every CLI; InputError otherwise,
    worded as trial's and the doctor's --precisions errors are.

    Args:
        text: what the command line gave.
        flag: the flag's name, for the message ('--precision').
        allowed: the precisions this CLI takes.
        refused: precision -> why this CLI refuses it (the benchmark: fp32 is its baseline).

    Example:
        >>> cli_precision("BF16", "--precision")
        'bf16'
    """
    return precision_names(text, flag, allowed=allowed, refused=refused)[0]
