"""The doctor's own error of a non-leaf module (issue 18): what its children do not explain.

A finite precision loss in code written inline in a module's forward (no inf/NaN, so no op-level origin) is pinned on
that module as precision_loss "(inline in forward)", with the op where it appears; moved into a leaf child, the same
code is pinned on the child and not on the parent; healthy models get no such finding.
"""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ampcourse.device import pick
from ampcourse.doctor import LOSS_TOL, OUTPUT_TOL, REL_TOL, examine
from ampcourse.models import make_task
from ampcourse.policy import apply_policy

PRECISIONS = ("fp16", "bf16")


def naive_standardize(h: torch.Tensor) -> torch.Tensor:
    """(h - mean) / std with the variance as E[h^2] - E[h]^2: catastrophic cancellation when |mean| >> std, since
    E[h^2] ~ 1e4 rounds to fp16's spacing 8 and bf16's 64, far coarser than a variance of ~1."""
    mean = h.mean(-1, keepdim=True)
    var = (h * h).mean(-1, keepdim=True) - mean ** 2
    return (h - mean) / torch.sqrt(var.clamp_min(0) + 1e-5)


class Standardize(nn.Module):
    """The same computation as a leaf module."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return naive_standardize(h)


class OffsetBlock(nn.Module):
    """fc's bias puts a mean of 100 under features of std ~1; the block standardizes them, inline or in a leaf child,
    and adds a well-conditioned residual (inline low-precision ops that lose nothing)."""

    def __init__(self, dim: int, child: bool):
        super().__init__()
        self.fc, self.out = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.norm = Standardize() if child else None
        with torch.no_grad():
            self.fc.bias.fill_(100.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        n = self.norm(h) if self.norm is not None else naive_standardize(h)
        return h * 0.5 + self.out(n)


class Net(nn.Module):
    def __init__(self, child: bool = False):
        super().__init__()
        self.inp, self.block, self.head = nn.Linear(16, 32), OffsetBlock(32, child), nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.inp(x)))


def planted(child: bool = False):
    torch.manual_seed(0)
    return Net(child), torch.randn(64, 16), torch.randint(0, 10, (64,))


def run(model, x, y, precision=None):
    """(output, loss): fp32 when precision is None, else under CPU autocast in it."""
    with torch.no_grad(), (pick("cpu", precision).autocast() if precision else torch.autocast("cpu", enabled=False)):
        out = model(x)
    out = out.float()
    return out, float(F.cross_entropy(out, y))


@pytest.mark.parametrize("precision", PRECISIONS)
def test_the_planted_inline_cancellation_really_breaks_and_an_fp32_block_fixes_it(precision):
    model, x, y = planted()
    ref, ref_loss = run(model, x, y)
    out, loss = run(model, x, y, precision)
    assert math.isfinite(loss) and bool(torch.isfinite(out).all())  # finite: no op-level origin can name it
    assert float((out - ref).norm() / ref.norm()) > OUTPUT_TOL[precision]
    assert abs(loss - ref_loss) / ref_loss > LOSS_TOL[precision]
    apply_policy(model, {"block": "fp32"})
    fixed, fixed_loss = run(model, x, y, precision)
    assert float((fixed - ref).norm() / ref.norm()) < OUTPUT_TOL[precision]
    assert abs(fixed_loss - ref_loss) / ref_loss < LOSS_TOL[precision]


def _own_error(report, name: str) -> dict:
    return next(row["local_error"] for row in report.modules if row["name"] == name)


def test_finite_precision_loss_in_inline_code_is_pinned_on_its_module():
    model, x, y = planted()
    report = examine(model, x, y, loss_fn=F.cross_entropy)
    for p in PRECISIONS:
        losses = report.find("precision_loss", p)
        assert [f.module for f in losses] == ["block"], report.summary()
        f = losses[0]
        assert f.phase == "forward" and f.op == "aten::sub" and "(inline in forward)" in f.message
        assert f.value > REL_TOL[p] and f.severity == "error"
        assert _own_error(report, "block")[p] == f.value
        # its children are exact in that measurement: none of them is blamed
        assert all(_own_error(report, n)[p] < REL_TOL[p] for n in ("inp", "block.fc", "block.out", "head"))
    assert report.verdicts["bf16"]["status"] == "islands" and report.verdicts["bf16"]["fp32_modules"] == ["block"]
    assert report.fp32_modules == ["block"] and "'block'" in report.policy_snippet()


def test_the_same_code_in_a_leaf_child_is_pinned_on_the_child_not_the_parent():
    model, x, y = planted(child=True)
    out, loss = run(model, x, y, "bf16")
    ref, ref_loss = run(model, x, y)
    assert abs(loss - ref_loss) / ref_loss > LOSS_TOL["bf16"]  # it breaks just the same
    report = examine(model, x, y, loss_fn=F.cross_entropy)
    for p in PRECISIONS:
        assert {f.module for f in report.find("precision_loss", p)} == {"block.norm"}, report.summary()
        # the parent's inline code (the residual h * 0.5 + ...) was measured, with its children exact: within tolerance
        assert 0 < _own_error(report, "block")[p] < REL_TOL[p]
    assert report.fp32_modules == ["block.norm"]


def test_examining_the_planted_model_leaves_it_as_it_was_and_repeats():
    model, x, y = planted()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    forwards = {n: m.__dict__.get("forward") for n, m in model.named_modules()}
    a = examine(model, x, y, loss_fn=F.cross_entropy)
    b = examine(model, x, y, loss_fn=F.cross_entropy)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert {n: m.__dict__.get("forward") for n, m in model.named_modules()} == forwards  # no wrapper left behind
    assert [(f.kind, f.module, f.precision, f.op, f.value) for f in a.findings] == \
        [(f.kind, f.module, f.precision, f.op, f.value) for f in b.findings]


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_healthy_reference_models_get_no_inline_precision_loss(name):
    task = make_task(name, n=64, seed=0)
    x, y = task.data.tensors[0][:16], task.data.tensors[1][:16]
    report = examine(task.model, x, y, loss_fn=task.loss_fn)
    assert not report.find("precision_loss"), report.summary()
    measured = {row["name"]: row["local_error"] for row in report.modules if not row["leaf"] and row["local_error"]}
    if name == "transformer":
        # its blocks run attention inline and the model multiplies by the tied head inline: measured, and small
        assert {"blocks.0", "blocks.1", ""} <= set(measured)
    else:
        assert not measured  # containers with no inline compute ops are not rerun (cost)
    for errors in measured.values():
        assert all(errors[p] < REL_TOL[p] for p in errors)


class BufferBlock(nn.Module):
    """Inline code that multiplies by a buffer (autograd saves it for the backward) around a BatchNorm child in
    training mode (its forward writes its running statistics)."""

    def __init__(self, dim: int = 32):
        super().__init__()
        self.fc, self.bn = nn.Linear(dim, dim), nn.BatchNorm1d(dim)
        self.register_buffer("gain", torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gain * self.bn(self.fc(x)) + x @ self.fc.weight.t()


def test_the_reruns_leave_saved_buffers_alone_and_put_back_what_they_write():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), BufferBlock(), nn.Linear(32, 10))
    x, y = torch.randn(64, 16), torch.randint(0, 10, (64,))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    report = examine(model, x, y, loss_fn=F.cross_entropy)
    # restoring an unwritten buffer would bump its version and break the backward ("modified by an inplace operation")
    assert all(v["status"] != "unsupported" for v in report.verdicts.values()), report.verdicts
    assert set(_own_error(report, "1")) == set(PRECISIONS)  # the block's inline code was measured
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


class Cache:
    """A stateful argument like a Hugging Face KV cache: each call appends its tensor, and reads all it holds."""

    def __init__(self):
        self.entries: list[torch.Tensor] = []
        self.calls = 0

    def update(self, t: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.entries = self.entries + [t]  # rebinds, as DynamicCache's torch.cat does
        return torch.stack(self.entries).mean(0)


class CachedBlock(nn.Module):
    """Reads the cache after adding its own entry: a rerun that saw the cache after the call would read two entries,
    a different value, and report an own error that is not there. offset=True plants the inline cancellation."""

    def __init__(self, dim: int = 32, offset: bool = False):
        super().__init__()
        self.fc, self.out = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.offset = offset
        if offset:
            with torch.no_grad():
                self.fc.bias.fill_(100.0)

    def forward(self, x: torch.Tensor, cache: Cache) -> torch.Tensor:
        h = self.fc(x)
        mixed = cache.update(h * 0.5)  # inline low-precision ops around the stateful call
        n = naive_standardize(h) if self.offset else mixed
        return h * 0.25 + self.out(n)


class CachedNet(nn.Module):
    def __init__(self, offset: bool = False, state=Cache):
        super().__init__()
        self.inp, self.block, self.head = nn.Linear(16, 32), CachedBlock(offset=offset), nn.Linear(32, 10)
        self.state, self.caches = state, []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.caches.append(self.state())
        return self.head(self.block(self.inp(x), cache=self.caches[-1]))


def test_a_module_called_with_a_stateful_object_is_rerun_on_the_state_it_began_with():
    torch.manual_seed(0)
    model = CachedNet()
    x, y = torch.randn(64, 16), torch.randint(0, 10, (64,))
    report = examine(model, x, y, loss_fn=F.cross_entropy)
    # the real calls' caches saw one call each: the reruns used copies
    assert model.caches and all(c.calls == 1 and len(c.entries) == 1 for c in model.caches)
    own = _own_error(report, "block")
    assert set(own) == set(PRECISIONS), report.summary()  # measured, where it used to be skipped
    # healthy: a rerun on the cache as it was after the call would read two entries and show a large error
    assert all(own[p] < REL_TOL[p] for p in PRECISIONS), own
    assert not report.find("precision_loss") and not any("not measured" in n for n in report.notes)


def test_inline_precision_loss_beside_a_stateful_object_is_pinned_on_its_module():
    torch.manual_seed(0)
    model = CachedNet(offset=True)
    x, y = torch.randn(64, 16), torch.randint(0, 10, (64,))
    report = examine(model, x, y, loss_fn=F.cross_entropy)
    for p in PRECISIONS:
        assert [f.module for f in report.find("precision_loss", p)] == ["block"], report.summary()


class LockedCache(Cache):
    """A state deepcopy refuses (it holds a lock): the doctor cannot rerun the call, and must say so."""

    def __init__(self):
        super().__init__()
        import threading
        self.lock = threading.Lock()


def test_a_stateful_object_that_cannot_be_copied_is_not_rerun_and_the_report_says_so():
    torch.manual_seed(0)
    model = CachedNet(offset=True, state=LockedCache)
    x, y = torch.randn(64, 16), torch.randint(0, 10, (64,))
    report = examine(model, x, y, loss_fn=F.cross_entropy)
    assert all(c.calls == 1 for c in model.caches)
    assert not _own_error(report, "block")
    [note] = [n for n in report.notes if "not measured" in n]
    assert note.startswith("The own error of 'block' (inline in forward) was not measured in fp16, bf16"), note
    assert "cannot be copied" in note


class InlineTop(nn.Module):
    """The model's own forward standardizes inline: the module is the model itself ('')."""

    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(16, 32), nn.Linear(32, 10)
        with torch.no_grad():
            self.fc.bias.fill_(100.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(naive_standardize(self.fc(x)))


def test_inline_code_of_the_model_itself_is_pinned_on_the_model():
    torch.manual_seed(0)
    model, x, y = InlineTop(), torch.randn(64, 16), torch.randint(0, 10, (64,))
    report = examine(model, x, y, loss_fn=F.cross_entropy)
    for p in PRECISIONS:
        [f] = report.find("precision_loss", p)
        assert f.module == "" and f.op == "aten::sub", report.summary()
        assert f.message.startswith("The model (inline in forward)") and "fp32 island" not in f.message
        assert "torch.autocast(..., enabled=False)" in f.message
    # no fp32 island can fix the model's own code (one on the whole model is fp32 training): refused, not islands
    assert report.verdicts["bf16"]["status"] == "refused"


def test_a_child_that_cannot_be_wrapped_leaves_every_other_child_as_it_was(monkeypatch):
    """If wrapping a child's forward fails half-way, the children wrapped so far get their own forward back."""
    from ampcourse.doctor import watch

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[1].__dict__["forward"] = own = model[1].forward  # an instance forward of the caller's, kept as it is

    class Refuses(nn.Module):
        def __setattr__(self, name, value):
            if name == "forward":
                raise AttributeError("this module refuses a new forward")
            super().__setattr__(name, value)

    kids = [("0", model[0]), ("1", model[1]), ("2", Refuses())]
    with pytest.raises(AttributeError, match="refuses a new forward"):
        with watch._exact_children(kids, {}, "cpu"):
            pass
    assert "forward" not in model[0].__dict__ and model[1].__dict__["forward"] is own


class InPlaceBlock(nn.Module):
    """Halves its input in place, then computes inline: its own error cannot be measured by a rerun."""

    def __init__(self, dim: int = 32):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(0.5)
        return self.fc(x) * 1.5 + x @ self.fc.weight.t()


def test_inline_code_whose_module_edits_its_input_in_place_is_said_to_be_unmeasured():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), InPlaceBlock(), nn.Linear(32, 10))
    x, y = torch.randn(64, 16), torch.randint(0, 10, (64,))
    report = examine(model, x, y, loss_fn=F.cross_entropy)
    assert not _own_error(report, "1")
    [note] = [n for n in report.notes if "not measured" in n]
    assert note.startswith("The own error of '1' (inline in forward) was not measured in fp16, bf16") and "in place" in note


def test_inline_code_of_a_half_model_is_measured_with_its_children_exact_in_fp32():
    """model.half(): the inline rerun runs the fp16 children on fp32 copies of their weights (fp32 inputs would not
    multiply fp16 weights), so the planted cancellation is found in 'block' as in the fp32 model, not "not measured"."""
    model, x, y = planted()
    model = model.half()
    report = examine(model, x.half(), y, loss_fn=lambda out, t: F.cross_entropy(out.float(), t), steps=0)
    assert not [n for n in report.notes if "not measured" in n], report.notes
    for p in PRECISIONS:
        [f] = report.find("precision_loss", p)
        assert (f.module, f.op) == ("block", "aten::sub") and f.value > REL_TOL[p]
        assert all(_own_error(report, n)[p] < REL_TOL[p] for n in ("inp", "block.fc", "block.out", "head"))
    assert all(prm.dtype == torch.float16 for prm in model.parameters())
