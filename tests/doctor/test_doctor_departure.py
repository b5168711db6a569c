"""Issue 25 class 2: a run that departs in training is located: the forensic pass re-run at that run's weights from
just before the departure names the module and op where it breaks (the initial weights show nothing there)."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ampcourse.doctor import confirm, examine
from ampcourse.doctor.verdict import refused_model_wide
from ampcourse.doctor.report import Finding
from ampcourse.doctor.verdict import Verdict

from test_doctor_verdict import assert_consistent  # tests/doctor is on sys.path (rootdir-relative imports)


def _state(model, opt):
    return [t.clone() for t in model.state_dict().values()], copy.deepcopy(opt.state_dict())


def test_a_refused_fp16_whose_run_breaks_later_names_the_attention_matmul_at_those_weights():
    """llama_large_qk: at the initial weights fp16 is refused for the gradients' range only (no module named); trained
    as a learner would (GradScaler's default), its loss is inf from a later step, and the forensic pass at that
    run's weights names aten::bmm in layer 0's attention, past fp16's max in fp32. Before: no module, no op."""
    pytest.importorskip("transformers")
    import doctor_gallery as G
    s = G.case("llama_large_qk").build(0)
    before = _state(s.model, s.optimizer)
    rng = torch.get_rng_state()
    r = examine(s.model, s.inputs, s.targets, loss_fn=s.loss_fn, optimizer=s.optimizer)
    dep = [f for f in r.findings if f.kind == "training_departs" and f.precision == "fp16"]
    assert dep and dep[0].module == "model.layers.0.self_attn" and dep[0].op == "aten::bmm", r.summary()
    c = r.verdicts["fp16"].confirmation
    assert c.status == "departed" and c.culprit["op"] == "aten::bmm" and c.culprit["weights_step"] > 0
    assert "65504" in c.sentence() and "model.layers.0.self_attn" in c.sentence()
    assert r.verdicts["fp16"].status == "refused" and r.recommended_precision != "fp16"
    # bf16: the gradients of layer 0's RMSNorm and of the embedding come back 75-172x fp32's (q @ k.T near 6e4, where
    # bf16's spacing is 256, unsaturates the softmax's backward); no module holding them runs bf16 code inline, so
    # the first that does after them (the attention) is tried as an fp32 island: it brings them back, and the recipe
    # trains like fp32. Before: "bf16: refused (no set of fp32 islands made it clean)" with nothing tried, and the
    # headline "train in fp32" though bf16 with that island trains like fp32.
    b = r.verdicts["bf16"]
    assert b.status == "islands" and b.fp32_modules == ["model.layers.0.self_attn"] and b.confirmed, r.summary()
    assert r.recommended_precision == "bf16" and "use bf16 with fp32 modules 'model.layers.0.self_attn'" in r.headline
    sus = [f for f in r.findings if f.kind == "gradient_error" and f.module == "model.layers.0.self_attn"]
    assert sus and sus[0].severity == "error" and "first fp16/bf16 code after those parameters' modules" in \
        sus[0].message and "they match fp32" in sus[0].message
    assert_consistent(r)
    # the learner's model, optimizer and torch's stream are as they were; the report is the same twice
    after = _state(s.model, s.optimizer)
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0])) and torch.equal(rng, torch.get_rng_state())
    assert repr(before[1]) == repr(after[1])
    again = examine(s.model, s.inputs, s.targets, loss_fn=s.loss_fn, optimizer=s.optimizer)
    assert r.to_json() == again.to_json()
    # the forensic pass alone is unchanged: no training, no departure
    quick = examine(s.model, s.inputs, s.targets, loss_fn=s.loss_fn, optimizer=s.optimizer, steps=0)
    assert not quick.find("training_departs")


class Gram(nn.Module):
    """Inline (y * gain) @ y.T with a trained gain: finite at the initial gain, past fp16's max a few steps later."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.tensor(1.0))

    def forward(self, y):
        return (y * self.gain) @ y.T


class GramNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.gram = nn.Linear(16, 16), Gram()

    def forward(self, x):
        return self.gram(self.lin(x))


def _gram_setup():
    """The largest product at 70% of fp16's max at the initial weights; Adam moves the gain by 12% a step, so the
    products pass 65504 after a few steps (fp32 and bf16 have the range)."""
    torch.manual_seed(0)
    x, net = torch.randn(8, 16), GramNet()
    with torch.no_grad():
        y = net.lin(x)
        gain = 0.7 * 65504 / float((y @ y.T).abs().max())
        net.gram.gain.fill_(gain)
    opt = torch.optim.Adam([{"params": net.lin.parameters(), "lr": 1e-4}, {"params": [net.gram.gain], "lr": 0.12 * gain}])
    return net, x, (lambda out, t=None: -out.float().mean() / gain), opt


def test_a_run_that_breaks_after_a_few_steps_names_the_module_and_op_only_the_later_weights_show():
    """fp16 is finite and within tolerance at the initial weights (the forensic pass finds nothing to warn of); trained,
    its loss goes inf at step 4. The departure names 'gram' and its inline aten::mm, past fp16's max in fp32, at that
    run's weights. Before: 'departs at step 4' and no module, no op."""
    net, x, loss, opt = _gram_setup()
    quick = examine(net, x, None, loss_fn=loss, optimizer=opt, steps=0)
    assert not [f for f in quick.findings if f.severity in ("error", "warning")], quick.summary()
    before = _state(net, opt)
    r = examine(net, x, None, loss_fn=loss, optimizer=opt, steps=6)
    c = r.verdicts["fp16"].confirmation
    assert c.status == "departed" and c.measure == "non-finite" and 0 < c.step < 6, r.summary()
    assert (c.culprit["module"], c.culprit["op"], c.culprit["weights_step"]) == ("gram", "aten::mm", c.step)
    dep = r.find("training_departs")
    assert [(f.module, f.op, f.precision) for f in dep] == [("gram", "aten::mm", "fp16")]
    assert "65504" in dep[0].message and "'gram'" in dep[0].message
    assert r.verdicts["fp16"].status == "refused" and r.recommended_precision == "bf16" and r.is_clean("bf16")
    assert_consistent(r)
    after = _state(net, opt)
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0])) and repr(before[1]) == repr(after[1])
    assert r.to_json() == examine(net, x, None, loss_fn=loss, optimizer=opt, steps=6).to_json()


def test_a_healthy_model_pays_for_no_replay(monkeypatch):
    """No departure, no re-run: locate() is never called on a model that trains like fp32."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))

    def boom(*a, **k):
        raise AssertionError("locate() ran on a healthy model")
    monkeypatch.setattr(confirm, "locate", boom)
    r = examine(model, x, y, loss_fn=F.cross_entropy, steps=3)
    assert r.is_clean("bf16") and "located_only" not in r.confirmation, r.summary()


def test_only_a_refusal_on_model_wide_findings_alone_is_trained_to_locate():
    wide = Finding("gradient_underflow", "", "fp16", 0.02, "msg", "warning", "backward")
    named = Finding("nonfinite", "attn", "fp16", 1.0, "msg", "error", "forward", fix="islands")
    refused = Verdict("fp16", "refused")
    assert refused_model_wide("fp16", {"status": "clean"}, refused, [wide], None)
    assert not refused_model_wide("fp16", {"status": "clean"}, refused, [wide, named], None)  # a module is named
    assert not refused_model_wide("fp16", {"status": "refused"}, refused, [wide], None)  # its passes refused it
    assert not refused_model_wide("fp16", {"status": "clean"}, Verdict("fp16", "clean"), [], None)
