"""What a pass records: what every module call and every aten op did, forward and backward.

Two instruments, both removed when a pass ends:

* module hooks (a forward pre-hook and a forward hook on every submodule) keep the stack of module calls, so each
  op knows the module whose forward runs it, and a non-leaf module's own code is told apart from its children's
  ("(inline in forward)"). The same hooks tag every autograd node a module call creates (``node.metadata``), so an
  op in backward is attributed through ``torch._C._current_autograd_node()``, as torch's DebugMode does;
* an op watcher (a ``TorchDispatchMode``) sees every aten op in forward and backward: the first op whose inputs are
  finite and whose output is not is the origin of an inf/NaN; in the fp32 reference, an op whose output passes
  fp16's largest value is an overflow waiting to happen.

Per module call it keeps log2 histograms (:mod:`.hist`) of the outputs and their gradients, a sample of 1024
output values (to compare a precision's outputs with fp32's, call by call), and each module's *own* error under
autocast, what its children do not explain: for a leaf, its output against the module rerun in fp32 on the same
inputs; for a non-leaf module whose inline code ran fp16/bf16 compute ops (the op watcher counts them per call; a
container that only calls its children is not rerun), its output rerun under autocast with every descendant exact
(fp32 inside, outputs handed back in the dtypes autocast gave them) against its fp32 rerun. The passes that run
these instruments are in :mod:`.passes`.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import random
import sys
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from .. import _args
from ..formats import AUTOCAST_DTYPES as _LOW
from .._rng import held_streams, set_stream_state, stream_state
from .calls import _sum_finite, copy_as, count_nonfinite, float_tensors, fresh_copy, is_leaf, rel_error, sample
from .hist import COUNT_CAP, Log2Hist, _abs_max, _Counter

#: Modules whose output only selects or rearranges input values: rerun in fp32 on the same inputs (converted exactly),
#: they return the same values, so their own error is 0 (or inf with an inf/NaN) without running them again.
_EXACT = frozenset({nn.Identity, nn.Flatten, nn.Unflatten, nn.ReLU, nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d})
_TAG = "ampcourse.doctor"  # key of the (module, call) tag in an autograd node's metadata
#: Ops whose output is uninitialised memory or a fill value: never the origin of an inf/NaN.
#: Ops that move or cast values without computing new ones: inline code made of these alone has no own error worth a
#: rerun (autocast's own casts, aten::_to_copy, are attributed to the module whose op autocast lowers).
_NO_COMPUTE = frozenset(f"aten::{n}" for n in (
    "_to_copy", "clone", "copy_", "cat", "stack", "_unsafe_view", "index", "index_select", "gather", "constant_pad_nd",
    "masked_fill", "masked_fill_", "where", "repeat", "flip", "roll", "tril", "triu", "contiguous", "zeros_like",
    "ones_like", "fill_", "fill", "full", "full_like", "empty", "empty_like", "new_empty", "new_zeros", "new_ones",
    "zero_", "detach", "lift_fresh", "scalar_tensor", "neg", "relu", "abs", "split", "split_with_sizes", "unbind",
    "chunk", "select", "slice", "narrow"))
#: Ops whose output is uninitialised memory: an inf/NaN bit pattern in it is not a value any module computed.
_UNINITIALISED = frozenset(("empty", "new_empty", "empty_like", "empty_strided"))
_NO_ORIGIN = ("empty", "new_empty", "empty_like", "empty_strided", "full", "full_like", "fill", "scalar_tensor",
              "lift_fresh", "detach", "alias")


@dataclass
class ModuleRecord:
    """What one module did in one pass (all its calls; per-call values where a call matters)."""

    name: str
    leaf: bool
    act: Log2Hist = field(default_factory=Log2Hist)
    grad: Log2Hist = field(default_factory=Log2Hist)
    samples: list[torch.Tensor] = field(default_factory=list)  # per call (reference pass)
    dtype: dict[str, str] = field(default_factory=dict)
    nonfinite: dict[str, int] = field(default_factory=dict)
    local_error: dict[str, float] = field(default_factory=dict)
    output_error: dict[str, float] = field(default_factory=dict)
    #: non-leaf modules: per precision, (aten op, relative error) of each inline op of the call with the largest own
    #: error, in the order they ran (children exact); the rules name the first beyond the tolerance
    inline_ops: dict[str, list[tuple[str, float]]] = field(default_factory=dict)
    #: non-leaf modules: per precision, why the own error of its inline code could not be measured (said in the report)
    unmeasured: dict[str, str] = field(default_factory=dict)
    #: the custom autograd.Function backward node (such as "_FusedRMSFnBackward") behind this module's output, if its
    #: own call made it: a backward no forward measure sees, tried as an fp32 island when gradients are off
    custom_backward: str = ""
    calls: int = 0


@dataclass
class OpEvent:
    """One op call worth reporting: an inf/NaN origin, or (in fp32) an output beyond fp16's range."""

    phase: str  # "forward" or "backward"
    module: str  # qualified name of the module whose code ran the op ("" = the model or the loss)
    call: int  # which call of that module
    inline: bool  # the module has children: the op is its own code, not a child's
    op: str  # "aten::mul"
    index: int  # how many earlier calls of this op in this module call (to match the same op across passes)
    value: float  # max |output| (finite part) or inf
    input_max: float  # max |input|
    node: str = ""  # the autograd node (backward), e.g. "MulBackward0" or "MyFunctionBackward"
    dtype: str = ""

    @property
    def key(self) -> tuple:
        """Identity of the op call across passes."""
        return self.phase, self.module, self.call, self.op, self.index, self.node

    @property
    def where(self) -> str:
        """"'block' (inline in forward)", "'attn.o'", "the loss", for messages."""
        if self.module == "" and self.call < 0:
            return "the loss"
        name = f"'{self.module}'" if self.module else "the model's forward"
        if self.phase == "backward" and self.node:
            return f"{name} ({self.node.removeprefix('torch::autograd::')} in backward)"
        return name + (" (inline in forward)" if self.inline and self.phase == "forward" else "")


@functools.cache
def _op_name(func) -> str:
    """'aten::mul' for aten.mul.Tensor (once per op: the op watcher asks at every call)."""
    return func._schema.name if hasattr(func, "_schema") else str(func)


def _current_node():
    """The autograd node the engine is running now (None outside backward, or on a torch without the call)."""
    fn = getattr(torch._C, "_current_autograd_node", None)
    return fn() if fn is not None else None


@functools.cache
def _is_view(func) -> bool:
    """An op whose output is a view of its input (view, transpose, expand, slice, ...): it computes no value, so it can
    neither make an inf/NaN nor pass fp16's range; skipping it saves a reduction per view."""
    try:
        schema = func._schema
        return not schema.is_mutable and any(r.alias_info is not None for r in schema.returns)
    except AttributeError:
        return False


@functools.cache
def _mutated(func) -> tuple[int, ...]:
    """Positions of the arguments an op writes into (in-place and out= ops)."""
    try:
        return tuple(i for i, a in enumerate(func._schema.arguments) if a.alias_info is not None and a.alias_info.is_write)
    except AttributeError:
        return ()


def _finite(x) -> bool:
    """A tensor, number or (nested) list of them has no inf/NaN."""
    if isinstance(x, torch.Tensor):
        if not x.is_floating_point() or x.numel() == 0:
            return True
        return math.isfinite(float(_abs_max(x.detach())))
    if isinstance(x, float):
        return math.isfinite(x)
    if isinstance(x, (list, tuple)):
        return all(_finite(v) for v in x)
    return True


def _input_max(args) -> float:
    """max |x| over the floating tensors in args (0.0 without any)."""
    top = 0.0
    for a in args:
        if isinstance(a, (list, tuple)):
            top = max(top, _input_max(a))
        elif isinstance(a, torch.Tensor) and a.is_floating_point() and a.numel():
            a = a.detach()
            fin = a[torch.isfinite(a)] if not _finite(a) else a
            if fin.numel():
                top = max(top, float(fin.abs().max()))
    return top


class OpWatch(TorchDispatchMode):
    """Every aten op in forward and backward: inf/NaN origins, fp32 outputs beyond a limit, low-precision outputs.

    An origin is an op whose inputs are all finite (for an in-place op: before it ran) and whose output is not.
    """

    MAX_EVENTS = 64  # per kind: the first ones are the ones that matter

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ to keep torch.compile out of it, importing torch._dynamo (and sympy)
        # on its first op: seconds, for nothing here (the doctor runs eagerly). Older torch has no such hook.
        return False

    def __init__(self, tracker: Tracker, overflow_at: float | None = None) -> None:
        super().__init__()
        self.tracker = tracker
        self.overflow_at = overflow_at
        self.origins: list[OpEvent] = []
        self.overflows: list[OpEvent] = []
        self.seen_nonfinite = False  # any op output so far had an inf/NaN (until then, module outputs are finite)
        self.low_ops = 0
        self.ops = 0
        self.inline_low: dict[tuple[str, int], int] = {}  # (module, call) -> inline fp16/bf16 compute ops in forward
        self._seen: dict[tuple, int] = {}
        self.raised: OpEvent | None = None  # the first op that raised (a value fp16 cannot hold, a missing kernel)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        written = _mutated(func)
        before = all(_finite(args[i]) for i in written if i < len(args)) if written else True
        try:
            out = func(*args, **kwargs)
        except Exception:
            if self.raised is None and not self.tracker.quiet:
                phase, module, ncall, inline, node = self.tracker.where()
                low = next((str(t.dtype).removeprefix("torch.") for t in float_tensors(list(args))
                            if t.dtype in _LOW), "")
                self.raised = OpEvent(phase, module, ncall, inline, _op_name(func), 0, math.nan,
                                      _input_max(list(args) + list(kwargs.values())), node, low)
            raise
        if self.tracker.quiet or _is_view(func):
            return out
        if isinstance(out, torch.Tensor):  # most ops: one tensor (no generator walk)
            outs = [out] if out.is_floating_point() and out.numel() else []
        else:
            outs = [t for t in float_tensors(out) if t.numel()]
        if not outs:
            return out
        self.ops += 1
        low = any(t.dtype in _LOW for t in outs)
        if low:
            self.low_ops += 1
        name = _op_name(func)
        phase, module, ncall, inline, node = self.tracker.where()
        if low and inline and ncall >= 0 and phase == "forward" and name not in _NO_COMPUTE:
            self.inline_low[(module, ncall)] = self.inline_low.get((module, ncall), 0) + 1
        key = (phase, module, ncall, name, node)
        index = self._seen.get(key, 0)
        self._seen[key] = index + 1
        if self.overflow_at is None and all(_sum_finite(t) for t in outs):
            return out  # no limit to compare with and all finite: nothing to record
        tops = [float(_abs_max(t.detach())) for t in outs]
        if not all(math.isfinite(v) for v in tops):
            if name.split("::")[-1] in _UNINITIALISED:
                return out  # garbage bits, not values: the op that fills it is watched (dropout's empty_like)
            self.seen_nonfinite = True
            if len(self.origins) >= self.MAX_EVENTS or name.split("::")[-1].rstrip("_") in _NO_ORIGIN:
                return out
            others = [a for i, a in enumerate(args) if i not in written]
            if before and _finite(others) and _finite(list(kwargs.values())):
                self.origins.append(OpEvent(phase, module, ncall, inline, name, index, math.inf,
                                            _input_max(list(args) + list(kwargs.values())), node,
                                            str(outs[0].dtype).removeprefix("torch.")))
        elif self.overflow_at is not None and phase == "forward" and max(tops) > self.overflow_at:
            if len(self.overflows) < self.MAX_EVENTS:
                self.overflows.append(OpEvent(phase, module, ncall, inline, name, index, max(tops),
                                              _input_max(list(args) + list(kwargs.values())), node,
                                              str(outs[0].dtype).removeprefix("torch.")))
        return out


class Tracker:
    """Module hooks for one pass: the stack of module calls, autograd-node tags, histograms, samples, own errors."""

    def __init__(self, model: nn.Module, records: dict[str, ModuleRecord], order: list[str], precision: str,
                 dev: torch.device, grads: bool = False, tag: bool = True) -> None:
        self.model, self.records, self.order, self.precision, self.dev = model, records, order, precision, dev
        self.grads = grads
        self.tagging = grads and tag  # tag autograd nodes with module calls (for attributing backward ops)
        self.stack: list[tuple[str, int]] = []
        self.counter = _Counter()  # histograms are filled in batches, at the latest when the pass ends
        self.counted: dict[int, tuple] = {}  # id(output tensor) -> (weakref, its queued counts, gradient histograms)
        self.rng_before: dict[int, Any] = {}  # id(module) -> RNG state when it started (nothing stored on the model)
        self.custom_nodes: dict[int, Any] = {}  # custom autograd.Function nodes claimed by a module this pass
        self.raised_in: str | None = None  # the innermost module whose forward an exception left
        self.seen: set[str] = set()
        self.busy = False  # True while a module is being rerun in fp32: its own hooks stay quiet
        self.quiet = 0  # > 0 while the doctor's own measuring runs: the op watcher ignores those ops
        self.in_backward = False  # set around loss.backward(): ops then belong to the backward phase
        self.watch: OpWatch | None = None  # the pass's op watcher, when it has one
        self.handles: list = []
        self.grad_handles: list = []  # tensor hooks: removed when the pass ends (a module may return a parameter)
        self.leaves: dict[str, bool] = {}
        self.reruns: dict[str, bool] = {}  # module -> its own error is measured by an fp32 rerun (_reruns)
        self.own_dtype: dict[str, torch.dtype] = {}  # module -> the dtype of its own parameters (a rerun's dtype)
        self.out_dtypes: dict[str, tuple[torch.dtype, ...]] = {}  # module -> its last call's floating output dtypes
        self.host_rng = True  # replay Python's and NumPy's streams in reruns (off when the model never draws on them)
        self.held = list(held_streams(model).values())  # generators the model's modules hold: replayed too

    def __enter__(self) -> Tracker:
        for name, module in self.model.named_modules():
            leaf = is_leaf(module)
            self.leaves[name] = leaf
            if name not in self.records:
                self.records[name] = ModuleRecord(name, leaf)
            self.reruns[name] = self._reruns(module)
            self.handles.append(module.register_forward_pre_hook(self._pre(name, module), with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._hook(name), with_kwargs=True, always_call=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles + self.grad_handles:
            h.remove()
        self.handles, self.grad_handles = [], []
        self.custom_nodes.clear()  # the nodes hold the graph's saved tensors: not beyond the pass
        self.counter.flush()

    # where an op runs
    def where(self) -> tuple[str, str, int, bool, str]:
        """(phase, module, call, inline, autograd node name) of the op running now."""
        node = _current_node() if self.in_backward else None
        if self.in_backward and node is None:
            return "backward", "", -1, True, ""  # a torch without _current_autograd_node: the phase, not the module
        if node is not None:
            module, ncall = node.metadata.get(_TAG, ("", -1))
            return "backward", module, ncall, not self.leaves.get(module, True), node.name()
        if not self.stack:
            return "forward", "", -1, True, ""
        module, ncall = self.stack[-1]
        return "forward", module, ncall, not self.leaves[module], ""

    def tag(self, tensors, tag: tuple[str, int]) -> None:
        """Tag the autograd nodes behind tensors that no module call has claimed yet with (module, call)."""
        todo = [t.grad_fn for t in tensors if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        while todo:
            n = todo.pop()
            md = n.metadata
            if _TAG in md or hasattr(n, "variable"):  # claimed already, or a parameter's AccumulateGrad (kept)
                continue
            md[_TAG] = tag
            todo.extend(f for f, _ in n.next_functions if f is not None)

    def _pre(self, name: str, module: nn.Module):
        def pre(mod, args, kwargs):
            if self.busy:
                return None
            if self.tagging and torch.is_grad_enabled():
                # What the caller computed before this call is the caller's code (inline), not this module's.
                self.tag(list(float_tensors(args)), self.stack[-1] if self.stack else ("", -1))
            rec = self.records[name]
            self.stack.append((name, rec.calls))
            rec.calls += 1
            if self.precision != "fp32" and (self.reruns[name] or not self.leaves[name]):
                # The inputs' versions too: a forward that edits its input in place leaves nothing to rerun it on.
                # A non-leaf module handed a stateful object (a Hugging Face KV cache, which the call appends to)
                # is rerun on a copy of that object as it was now, taken before the call changes it.
                state = None
                if not self.leaves[name] and not (_plain(args) and _plain(kwargs)):
                    state = _stateful_copy((args, kwargs))
                    if state is None:
                        rec.unmeasured.setdefault(self.precision, "it is called with an object that cannot be copied "
                                                                  f"(at most {STATE_COPY_CAP >> 20} MiB)")
                self.rng_before[id(module)] = (self._rng_state(), [t._version for t in float_tensors(args)], state)
            return None
        return pre

    def _hook(self, name: str):
        def hook(module, args, kwargs, out):
            if self.busy:
                return None
            if self.raised_in is None and sys.exc_info()[1] is not None:
                # called by always_call while an exception leaves this module's forward: the innermost such module
                self.raised_in = name
            ncall = self.stack.pop()[1] if self.stack and self.stack[-1][0] == name else self.records[name].calls - 1
            rec = self.records[name]
            tensors = list(float_tensors(out))
            if self.tagging and torch.is_grad_enabled():
                self.tag(tensors, (name, ncall))
            with self.measuring():
                if self.precision == "fp32":
                    self._reference(name, rec, tensors)
                elif tensors:
                    self.out_dtypes[name] = tuple(t.dtype for t in tensors)
                    self._custom_backward(rec, tensors)
                    self._under_autocast(module, rec, ncall, tensors, args, kwargs)
            return None
        return hook

    def measuring(self) -> _Measuring:
        """The doctor's own ops (histograms, fp32 reruns): off the op watcher's books, and outside every dispatch mode
        (a Python call per op would cost more than the measuring itself)."""
        return _Measuring(self)

    def _reruns(self, module: nn.Module) -> bool:
        """Leaf modules whose own error is measured; not dropout (random by design) nor in-place ones."""
        return (is_leaf(module) and not isinstance(module, nn.modules.dropout._DropoutNd)
                and not getattr(module, "inplace", False))

    def _rng_state(self):
        """Every stream a module's forward may draw from: torch's (CPU, and the device's on CUDA), Python's random
        and NumPy's global one (inline dropout, a layer drop decided by random.random()) and the generators the
        model holds (torch.rand(..., generator=self.gen)): a rerun replays them all."""
        cuda = torch.cuda.get_rng_state(self.dev) if self.dev.type == "cuda" else None
        held = [stream_state(g) for g in self.held]
        if not self.host_rng:  # the fp32 reference drew nothing from them: not worth NumPy's 0.1 ms per call
            return torch.get_rng_state(), cuda, None, None, held
        return torch.get_rng_state(), cuda, random.getstate(), np.random.get_state(), held

    def _set_rng_state(self, state) -> None:
        cpu, cuda, py, npy, held = state
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, self.dev)
        if py is not None:
            random.setstate(py)
            np.random.set_state(npy)
        for g, s in zip(self.held, held):
            set_stream_state(g, s)

    def _count_grad(self, hists: list[Log2Hist], grad: torch.Tensor) -> None:
        """A tensor hook: histogram one output gradient once, into every module record that output belongs to."""
        with self.measuring():
            self.counter.add(grad, hists, COUNT_CAP)

    def _reference(self, name: str, rec: ModuleRecord, tensors: list[torch.Tensor]) -> None:
        """fp32 pass: histogram of the outputs, a sample per call, and hooks that histogram their gradients."""
        if name not in self.seen:
            self.seen.add(name)
            self.order.append(name)
        for t in tensors:
            # A container often returns its last child's output tensor: count it (and its gradient) once.
            seen = self.counted.get(id(t))
            if seen is None or seen[0]() is not t:
                seen = (weakref.ref(t), self.counter.add(t, [], COUNT_CAP), [])
                self.counted[id(t)] = seen
                if self.grads and t.requires_grad:
                    self.grad_handles.append(t.register_hook(functools.partial(self._count_grad, seen[2])))
            seen[1].feed(rec.act)
            seen[2].append(rec.grad)
        if tensors and "." not in name:
            # Sampled per call for the model and its direct children only: enough to see where the output error
            # grows, at a fraction of the cost of every module (the op watch and the own errors localise further).
            rec.samples.append(sample(tensors[0]))

    def _custom_backward(self, rec: ModuleRecord, tensors) -> None:
        """Note a custom autograd.Function's backward node behind the outputs, on the innermost module whose call made
        it (module hooks finish innermost first; a container returning the same tensor finds the node claimed)."""
        for t in tensors:
            node = t.grad_fn
            if isinstance(node, torch.autograd.function.BackwardCFunction) and id(node) not in self.custom_nodes:
                self.custom_nodes[id(node)] = node  # kept alive for the pass, so the id stays this node's
                rec.custom_backward = rec.custom_backward or node.name()

    def _under_autocast(self, module, rec: ModuleRecord, ncall: int, tensors, args, kwargs) -> None:
        """Autocast pass: output dtype, inf/NaN, error of each call's output against the same fp32 call, own error."""
        p = self.precision
        rec.dtype[p] = str(tensors[0].dtype).removeprefix("torch.")
        # Until the op watch has seen an inf/NaN anywhere in this pass, every output is finite: no need to count.
        clean = self.watch is not None and not self.watch.seen_nonfinite
        bad = 0 if clean else sum(count_nonfinite(t) for t in tensors)
        rec.nonfinite[p] = rec.nonfinite.get(p, 0) + bad
        if ncall < len(rec.samples):
            err = rel_error(sample(tensors[0]), rec.samples[ncall])
            rec.output_error[p] = max(rec.output_error.get(p, 0.0), err)
        before = self.rng_before.pop(id(module), None)
        if before is None or "_ampcourse_forward" in module.__dict__:
            return  # not a rerun module, or a policy already decides its precision
        before, versions, state = before
        if versions != [t._version for t in float_tensors(args)]:
            # it changed its inputs in place: a rerun would see other inputs, so no own error for it (said, when it
            # is inline code that ran low-precision ops: the leaves that do so are exact ones such as ReLU(inplace))
            if not rec.leaf and self.watch is not None and self.watch.inline_low.get((rec.name, ncall)):
                rec.unmeasured.setdefault(p, "it changes its inputs in place, so a rerun would see other inputs")
            return
        if not rec.leaf:
            if bad == 0 and self.watch is not None and self.watch.inline_low.get((rec.name, ncall)):
                if _plain(args) and _plain(kwargs):
                    self._inline_error(module, rec, before, tensors, lambda: (args, kwargs))
                elif state is not None:
                    # each rerun gets its own copy of the state the call began with
                    self._inline_error(module, rec, before, tensors, lambda: _stateful_copy(state))
            return
        if type(module) in _EXACT:
            rec.local_error[p] = max(rec.local_error.get(p, 0.0), 0.0 if bad == 0 else math.inf)
            return
        after = self._rng_state()
        self._set_rng_state(before)
        # Without autocast, in the dtype of the module's own parameters (fp32 normally; bf16 for a pure-bf16 model).
        dtype = self.own_dtype.get(rec.name)
        if dtype is None:
            dtype = self.own_dtype[rec.name] = next((q.dtype for q in module.parameters(recurse=False)
                                                     if q.is_floating_point()), torch.float32)
        self.busy = True
        try:
            with torch.no_grad(), torch.autocast(self.dev.type, enabled=False):
                ref = module(*copy_as(args, dtype), **copy_as(kwargs, dtype))
        except Exception:  # a module that cannot run outside autocast on these inputs: no own error for it
            return
        finally:
            self.busy = False
            self._set_rng_state(after)
        ref_t = list(float_tensors(ref))
        if ref_t:
            err = rel_error(tensors[0], ref_t[0]) if bad == 0 else math.inf
            rec.local_error[p] = max(rec.local_error.get(p, 0.0), err)


    def _inline_error(self, module: nn.Module, rec: ModuleRecord, before, tensors,
                      inputs: Callable[[], tuple[tuple, dict]]) -> None:
        """A non-leaf module's own error: what its children do not explain. The module runs twice more on copies of
        the same inputs, from the same RNG state: under autocast with every descendant exact (run in fp32, and its
        outputs handed back in the dtypes autocast gave them in this pass, so the inline code sees what it saw), and
        in fp32 (inputs converted exactly). Their outputs' relative error is the error of the module's inline code;
        each inline op's output is compared too, to name the op where the error appears. inputs() gives the call's
        (args, kwargs), a fresh copy of any stateful object in them each time."""
        p = self.precision
        after = self._rng_state()
        dtype = next((q.dtype for q in module.parameters(recurse=False) if q.is_floating_point()), torch.float32)
        prefix = f"{rec.name}." if rec.name else ""
        kids = [(prefix + n, m) for n, m in module.named_modules() if m is not module]
        # BatchNorm's statistics would take two more updates: put back what the reruns wrote (only that: a write
        # bumps a tensor's version, and autograd refuses a saved tensor whose version moved, as a buffer a mul saved)
        buffers = [(b, b._version, b.detach().clone()) for b in module.buffers()]
        low_ops, ref_ops = _InlineOps(), _InlineOps()
        self.busy = True
        try:
            with torch.no_grad():
                self._set_rng_state(before)
                args, kwargs = inputs()
                with _exact_children(kids, self.out_dtypes, self.dev.type), low_ops:
                    low = module(*fresh_copy(args), **fresh_copy(kwargs))
                self._set_rng_state(before)
                args, kwargs = inputs()
                with _exact_children(kids, {}, self.dev.type), torch.autocast(self.dev.type, enabled=False), ref_ops:
                    ref = module(*copy_as(args, dtype), **copy_as(kwargs, dtype))
        except Exception as err:  # a module that cannot run this way on these inputs: no own error for it, said so
            rec.unmeasured.setdefault(p, f"a rerun of it failed ({type(err).__name__}: {_first_line(err)})")
            return
        finally:
            self.busy = False
            with torch.no_grad():
                for b, version, saved in buffers:
                    if b._version != version:
                        b.copy_(saved)
            self._set_rng_state(after)
        low_t, ref_t = list(float_tensors(low)), list(float_tensors(ref))
        if not (low_t and ref_t):
            return
        err = rel_error(low_t[0], ref_t[0])
        if err >= rec.local_error.get(p, 0.0):
            rec.local_error[p] = err
            rec.inline_ops[p] = low_ops.errors(ref_ops)


class _ModesOff:
    """Every TorchDispatchMode off while inside, as torch's ``_disable_current_modes``, at a sixth of its cost (about
    6 us against 39 us, paid at every module call of a watched pass): the modes are popped and pushed back through
    torch's own stack calls. With a pre-dispatch mode (torch.export's tracing) or without those calls, it is torch's
    context manager itself."""

    __slots__ = ("modes", "inner")

    def __enter__(self) -> _ModesOff:
        self.inner = None
        if _LEAN_MODES and not _pre_dispatch_modes():
            self.modes = [_pop_mode() for _ in range(_len_modes())]
        else:
            self.inner = _disable_current_modes()
            self.inner.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.inner is not None:
            self.inner.__exit__(*exc)
            return
        for mode in reversed(self.modes):
            _push_mode(mode)


_len_modes = getattr(torch._C, "_len_torch_dispatch_stack", None)
_pop_mode = functools.partial(torch._C._pop_torch_dispatch_stack, None) if hasattr(
    torch._C, "_pop_torch_dispatch_stack") else None
_push_mode = getattr(torch._C, "_push_on_torch_dispatch_stack", None)
try:
    from torch._ops import _len_torch_dispatch_stack_pre_dispatch as _pre_dispatch_modes
except ImportError:  # an older torch: no pre-dispatch stack (then _LEAN_MODES decides alone)
    _pre_dispatch_modes = lambda: 0  # noqa: E731
_LEAN_MODES = None not in (_len_modes, _pop_mode, _push_mode)


class _Measuring:
    """Tracker.measuring(): the tracker quiet and every dispatch mode off while inside (a class: a generator-based
    context manager costs more per module call)."""

    __slots__ = ("tracker", "modes")

    def __init__(self, tracker: Tracker) -> None:
        self.tracker = tracker

    def __enter__(self) -> None:
        self.tracker.quiet += 1
        self.modes = _ModesOff()
        try:
            self.modes.__enter__()
        except BaseException:
            self.tracker.quiet -= 1
            raise

    def __exit__(self, *exc) -> None:
        try:
            self.modes.__exit__(*exc)
        finally:
            self.tracker.quiet -= 1


class _InlineOps(TorchDispatchMode):
    """A sample of every op output a module's own forward computes (its children run outside this mode)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __init__(self) -> None:
        super().__init__()
        self.samples: dict[tuple[str, int], torch.Tensor] = {}  # (aten op, index among that op's calls) -> sample

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = _op_name(func)
        if _is_view(func) or name in _NO_COMPUTE:
            return out
        t = next(float_tensors(out), None)
        if t is not None and t.numel():
            index = sum(k[0] == name for k in self.samples)
            self.samples[(name, index)] = sample(t)
        return out

    def errors(self, ref: _InlineOps) -> list[tuple[str, float]]:
        """(op, relative error against the same op call in ref) for each op call both ran, in this one's order."""
        return [(k[0], rel_error(v, ref.samples[k])) for k, v in self.samples.items()
                if k in ref.samples and ref.samples[k].shape == v.shape]


@contextlib.contextmanager
def _exact_children(kids: list[tuple[str, nn.Module]], out_dtypes: Mapping[str, tuple[torch.dtype, ...]],
                    device_type: str):
    """While inside: each module of kids runs its forward in fp32 (autocast off, floating inputs cast to fp32, no
    dispatch mode), and hands back its floating outputs in the dtypes out_dtypes names (those it gave under autocast),
    so the caller's inline code sees the dtypes it saw, without the children's errors. A child called inside another
    runs as part of it."""
    depth = [0]
    saved: list[tuple[nn.Module, Any]] = []  # (module, its own instance forward or None), for those wrapped so far

    def exact(name: str, module: nn.Module, forward):
        def run(*args, **kwargs):
            if depth[0]:
                return forward(*args, **kwargs)
            depth[0] += 1
            try:
                args, kwargs = copy_as(args, torch.float32), copy_as(kwargs, torch.float32)
                with _ModesOff(), torch.autocast(device_type, enabled=False):
                    # A child with fp16/bf16 weights (a model.half()) runs on fp32 copies of them: fp32 inputs would
                    # not even multiply its own weights, and exact means fp32 throughout.
                    low = _low_state(module)
                    out = (torch.func.functional_call(module, low, args, kwargs) if low
                           else forward(*args, **kwargs))
            finally:
                depth[0] -= 1
            return _cast_like(out, iter(out_dtypes.get(name, ())))
        return run

    try:
        for name, m in kids:
            own = m.__dict__.get("forward")
            m.forward = exact(name, m, m.forward)
            saved.append((m, own))
        yield
    finally:
        for m, forward in saved:
            if forward is None:
                del m.forward
            else:
                m.forward = forward


def _low_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """fp32 copies of a module's fp16/bf16 parameters and buffers (its whole subtree), by name; {} if it has none."""
    named = [*module.named_parameters(), *module.named_buffers()]
    return {n: t.detach().float() for n, t in named if t.dtype in _LOW}


_PLAIN = (int, float, complex, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size, slice)


def _plain(obj) -> bool:
    """Tensors, numbers, strings and (nested) tuples, lists and dicts of them: nothing whose state a call may change
    besides a tensor's values (which the versions check). A module called with anything else (a Hugging Face KV
    cache, which the call appends to) is not rerun: a rerun would see the state after the call and change it again."""
    if isinstance(obj, (torch.Tensor, *_PLAIN)):
        return True
    if isinstance(obj, (list, tuple)):
        return all(_plain(o) for o in obj)
    if isinstance(obj, dict):
        return all(_plain(v) for v in obj.values())
    return False


#: the most tensor bytes copied to rerun one call on the state it began with (a KV cache); beyond, no own error
STATE_COPY_CAP = 256 << 20


def _tensors_inside(obj, found: dict[int, torch.Tensor], seen: set[int], depth: int = 0) -> None:
    """Every tensor reachable from obj through attributes, slots, lists, tuples, dicts and sets, by id."""
    if id(obj) in seen or depth > 8:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        found[id(obj)] = obj
        return
    if isinstance(obj, _PLAIN) or isinstance(obj, (type, nn.Module)) or callable(obj):
        return
    if isinstance(obj, Mapping):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        items = list(obj)
    else:
        items = list(getattr(obj, "__dict__", {}).values())
        items += [getattr(obj, s) for s in getattr(type(obj), "__slots__", ()) if hasattr(obj, s)]
    for o in items:
        _tensors_inside(o, found, seen, depth + 1)


def _stateful_copy(obj):
    """obj with every object in it that is not a tensor, a plain value or a container of them deep-copied, the
    tensors inside those as detached clones: the state a call began with, for a rerun that must not change it.
    None if it cannot be copied (a module inside, a lock, a file) or holds more than STATE_COPY_CAP tensor bytes."""
    if isinstance(obj, (torch.Tensor, *_PLAIN)):
        return obj
    if isinstance(obj, (list, tuple)):
        items = [_stateful_copy(o) for o in obj]
        if any(i is None and o is not None for i, o in zip(items, obj)):
            return None
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, dict):
        out = {k: _stateful_copy(v) for k, v in obj.items()}
        return None if any(out[k] is None and v is not None for k, v in obj.items()) else out
    found: dict[int, torch.Tensor] = {}
    _tensors_inside(obj, found, set())
    if sum(t.numel() * t.element_size() for t in found.values()) > STATE_COPY_CAP:
        return None
    memo: dict[int, Any] = {i: t.detach().clone() for i, t in found.items()}
    memo[id(memo)] = list(found.values())  # deepcopy's keep-alive list: the originals stay alive while it copies
    try:
        return copy.deepcopy(obj, memo)
    except Exception:  # an object deepcopy refuses (a lock, a generator, a non-leaf tensor it found itself)
        return None


def _first_line(err: BaseException) -> str:
    """The first line of an exception's message, at most 120 characters."""
    text = _args.first_line(err)
    return text if len(text) <= 120 else text[:117] + "..."


def _cast_like(obj, dtypes: Iterator[torch.dtype]):
    """obj with its floating tensors (in float_tensors' order) cast to the next dtype when that is fp16/bf16."""
    if isinstance(obj, torch.Tensor):
        if not obj.is_floating_point():
            return obj
        dt = next(dtypes, None)
        return obj.to(dt) if dt in _LOW and obj.dtype != dt else obj
    if isinstance(obj, (list, tuple)):
        items = [_cast_like(o, dtypes) for o in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, Mapping):
        out = copy.copy(obj)
        for k, v in obj.items():
            out[k] = _cast_like(v, dtypes)
        return out
    return obj
