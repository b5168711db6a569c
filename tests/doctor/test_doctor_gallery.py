"""The doctor gallery (tests/doctor_gallery.py) is a fair measuring stick: every planted case really breaks in its
planted precision and its fix really trains like fp32, every healthy case trains like fp32 in fp16 and bf16, the
judges can say both yes and no; and (issue 18) the AMP doctor is right on every case."""

import math
import random
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

import doctor_gallery as G

pytestmark = pytest.mark.starts_first  # minutes in one module: pytest-xdist starts it first (tests/conftest.py)

try:
    import transformers  # noqa: F401  (a test dependency in pyproject.toml; the Hugging Face cases need it)
    HAS_HF = True
except ImportError:
    HAS_HF = False


def names(cases):
    """Case names as pytest params; a Hugging Face case skips where transformers is not installed."""
    return [pytest.param(c.name, marks=pytest.mark.skipif(c.hf and not HAS_HF, reason="transformers not installed"))
            for c in cases]


PLANTED = names(G.planted())
HEALTHY = names(G.healthy())


def test_the_gallery_covers_issue_18s_six_classes_in_own_and_hugging_face_models():
    classes = {c.klass for c in G.planted()}
    assert classes == {1, 2, 3, 4, 5, 6}
    for k in (1, 4, 5, 6):  # where a Hugging Face model fits the class, it is planted there too
        assert any(c.klass == k and c.hf for c in G.CASES) and any(c.klass == k and not c.hf for c in G.CASES)
    assert len(HEALTHY) >= 6
    assert {"ref_mlp", "ref_cnn", "ref_transformer"} <= {c.name for c in G.healthy()}
    assert {c.name for c in G.healthy() if c.hf} == {"gpt2", "bert", "t5", "llama", "vit", "lora_llama",
                                                       "distilbert_dropout", "wav2vec2_random", "musicgen_random"}
    assert len({c.name for c in G.CASES}) == len(G.CASES)
    for c in G.planted():
        assert c.fix is not None and c.phase in ("forward", "backward", "optimizer", "model"), c.name
        assert set(c.precisions) <= {"fp16", "bf16"} and c.precisions, c.name
        if c.hf and not HAS_HF:
            continue
        model = c.build(0).model
        modules = {n for n, _ in model.named_modules()}
        assert all(n in modules for n in c.culprits), (c.name, c.culprits)  # it exists ("" is the model itself)
        assert all(n in modules for n in c.innocents) and not set(c.innocents) & set(c.culprits), c.name
    with pytest.raises(KeyError, match="no gallery case 'nope'"):
        G.case("nope")


def test_the_gallery_has_variants_of_issue_25s_classes_in_own_and_hugging_face_models():
    """Issue 25's classes 1, 2, 3, 5 and 6 each have a variant in a model of our own and one in a Hugging Face model
    (class 4, fp32's own failure, cannot be trained beside a finite fp32: it is in tests/test_doctor_verdict.py), and
    the healthy controls include a frozen half-precision base with fp32 adapters, inline randomness and a real
    Hugging Face model with its randomness on."""
    for k in (1, 2, 3, 5, 6):
        tagged = [c for c in G.CASES if k in c.issue25]
        assert any(c.hf for c in tagged) and any(not c.hf for c in tagged), (k, [c.name for c in tagged])
    assert all(set(c.issue25) <= {1, 2, 3, 4, 5, 6} for c in G.CASES)
    controls = {c.name for c in G.healthy() if c.issue25}
    assert {"lora_fp16_base", "lora_llama", "inline_random", "wav2vec2_random", "distilbert_dropout",
            "musicgen_random"} <= controls
    mixed = G.case("distilbert_bf16_body").build(0).model  # a mixed-dtype model: a bf16 body, an fp32 head
    assert {p.dtype for p in mixed.parameters()} == {torch.bfloat16, torch.float32}
    lora = G.case("lora_llama").build(0)
    trainable = [p for p in lora.model.parameters() if p.requires_grad]
    assert {p.dtype for p in trainable} == {torch.float32} and {p.dtype for p in lora.model.parameters()} == {
        torch.float16, torch.float32}
    assert {id(p) for g in lora.optimizer.param_groups for p in g["params"]} == {id(p) for p in trainable}


@pytest.mark.parametrize("name", names(G.CASES))
def test_a_case_builds_the_same_model_and_batch_from_a_seed(name):
    c = G.case(name)
    a, b = c.build(0), c.build(0)
    assert all(torch.equal(p, q) for p, q in zip(a.model.state_dict().values(), b.model.state_dict().values()))
    assert G._inputs_equal(a.inputs, b.inputs)
    assert a.targets is None and b.targets is None or torch.equal(a.targets, b.targets)
    assert type(a.optimizer) is type(b.optimizer)


@pytest.mark.parametrize("name", PLANTED)
def test_a_planted_problem_is_real_and_its_fix_trains_like_fp32(name):
    check_planted(G.case(name))


def check_planted(c):
    """Case c (planted under c.policy's lists) diverges from fp32 in each planted precision; its fix tracks fp32."""
    name = f"{c.name} ({c.policy})"
    ref = G.reference(c)
    assert ref.finite and ref.skipped == 0
    for p in c.precisions:
        broken = G.tracks(G.train(c, p), ref, c.watch)
        assert not broken.ok, f"{name} in {p} trains like fp32: {broken}"
        # Not a near miss: NaN/inf, skipped steps, a 10% loss gap or a watched parameter losing most of its update.
        assert (not broken.finite or broken.skipped >= 3 or broken.loss_gap > 0.1 or broken.update_error > 0.75), \
            f"{name} in {p}: {broken}"
    fixed = G.tracks(G.train(c, c.precisions[0], fixed=True), ref, c.watch)
    assert fixed.ok, f"{name}'s fix ({c.fix.__doc__}) does not track fp32: {fixed}"


@pytest.mark.parametrize("name", names(c for c in G.planted() if 2 in c.issue25))
def test_an_issue_25_class_2_case_is_right_at_its_initial_weights_and_wrong_over_the_run(name):
    """Issue 25 class 2's truth: in the planted precision, the loss at the initial weights is finite and within 5% of
    fp32's (a check of one step there would certify it), and the run still departs from fp32."""
    c = G.case(name)
    ref = G.reference(c)
    for p in c.precisions:
        run = G.train(c, p)
        first = abs(run.losses[0] - ref.losses[0]) / max(abs(ref.losses[0]), 1e-3)
        assert math.isfinite(first) and first < G.LOSS_TOL, (name, p, first)
        assert not G.tracks(run, ref, c.watch).ok


@pytest.mark.parametrize("name", HEALTHY)
def test_a_healthy_model_trains_like_fp32_in_fp16_and_bf16(name):
    check_healthy(G.case(name))


def check_healthy(c):
    """Case c (healthy under c.policy's lists) tracks fp32 in each of its precisions (fp16 and bf16) and loses little
    gradient at scale 1."""
    name = f"{c.name} ({c.policy})"
    ref = G.reference(c)
    for p in c.precisions:
        v = G.tracks(G.train(c, p), ref)
        assert v.ok and v.skipped == 0, f"{name} in {p}: {v}"
    # Even without a GradScaler no parameter loses more than a tenth of its gradient in fp16 (issue 18 asks the doctor
    # to warn at half), so a warning about gradients here is a false alarm.
    lost = {n: share for n, share in G.lost_at_scale_1(c).items() if share > 0.1}
    assert not lost, f"{name} loses gradients in fp16 at scale 1: {lost}"


@pytest.mark.parametrize("name", names(c for c in G.planted() if c.klass == 5))
def test_a_layer_local_underflow_case_loses_its_culprits_gradients_and_little_else(name):
    c = G.case(name)
    lost = G.lost_at_scale_1(c)
    culprit = {n: v for n, v in lost.items() if any(n.startswith(m + ".") for m in c.culprits)}
    assert culprit and all(v > 0.5 for v in culprit.values()), culprit
    n_all = sum(p.numel() for p in c.build(0).model.parameters())
    n_culprit = sum(p.numel() for n, p in c.build(0).model.named_parameters() if n in culprit)
    assert n_culprit / n_all < 0.1  # a few percent of the gradient values: an aggregate share hides them


def test_tracks_rejects_nan_skips_a_loss_gap_and_a_frozen_watched_parameter():
    up = {"a.weight": torch.ones(3), "b.weight": torch.ones(3)}
    ref = G.Trace([2.0, 1.5, 1.0], 0, up)
    assert G.tracks(G.Trace([2.0, 1.5, 1.01], 0, up), ref).ok
    assert not G.tracks(G.Trace([2.0, math.nan, 1.0], 0, up), ref).ok
    assert not G.tracks(G.Trace([2.0, 1.5, 1.0], 3, up), ref).ok
    assert not G.tracks(G.Trace([2.0, 1.5, 1.2], 0, up), ref).ok
    frozen = dict(up, **{"a.weight": torch.zeros(3)})
    assert G.tracks(G.Trace([2.0, 1.5, 1.0], 0, frozen), ref).ok  # not watched: losses only
    v = G.tracks(G.Trace([2.0, 1.5, 1.0], 0, frozen), ref, watch=("a.",))
    assert not v.ok and v.worst_param == "a.weight" and v.update_error == pytest.approx(1.0)


# -- the judges say yes and no --------------------------------------------------------------------------------------

@dataclass
class FakeFinding:
    kind: str
    module: str
    precision: str
    severity: str = "error"
    phase: str = "forward"
    op: str = ""
    value: float = 0.0
    message: str = ""


@dataclass
class FakeReport:
    findings: list
    verdicts: dict
    recommended_precision: str = "fp16"
    recommended_init_scale: float = 2.0**12
    fp32_modules: list = field(default_factory=list)
    advice: list = field(default_factory=list)

    def is_clean(self, p):
        return not any(f.severity != "info" and f.precision == p for f in self.findings)


def _fake_examine(report):
    return lambda *a, **k: report


def test_the_doctor_judge_scores_a_right_report_right_and_each_wrong_one_wrong():
    c = G.case("inline_attention")
    right = FakeReport([FakeFinding("nonfinite", "attn", "fp16", op="aten::bmm")],
                       {"fp16": {"status": "islands", "fp32_modules": ["attn"]}, "bf16": {"status": "clean"}},
                       fp32_modules=["attn"])
    r = G.judge_doctor(c, _fake_examine(right))
    assert (r["found"], r["named"], r["advice_works"]) == (True, True, True), r
    # Blaming the child that only receives the inf, and an island there: named and advice fail.
    child = FakeReport([FakeFinding("nonfinite", "attn.o", "fp16", op="aten::addmm")],
                       {"fp16": {"status": "islands", "fp32_modules": ["attn.o"]}}, fp32_modules=["attn.o"])
    r = G.judge_doctor(c, _fake_examine(child))
    assert (r["found"], r["named"], r["advice_works"]) == (True, False, False), r
    assert r["blames_innocent"] == ["attn.o"]
    both = FakeReport(right.findings + child.findings, right.verdicts, fp32_modules=["attn"])
    r = G.judge_doctor(c, _fake_examine(both))
    assert r["named"] and r["advice_works"] and r["blames_innocent"] == ["attn.o"]
    # The right module without the op it computes inline is not named.
    no_op = FakeReport([FakeFinding("nonfinite", "attn", "fp16")], right.verdicts, fp32_modules=["attn"])
    assert not G.judge_doctor(c, _fake_examine(no_op))["named"]
    # "Clean" finds nothing; a crash is recorded as such.
    clean = FakeReport([], {"fp16": {"status": "clean"}, "bf16": {"status": "clean"}})
    r = G.judge_doctor(c, _fake_examine(clean))
    assert (r["found"], r["named"], r["advice_works"]) == (False, False, False), r

    def crash(*a, **k):
        raise RuntimeError("boom")
    r = G.judge_doctor(c, crash)
    assert r["crash"] == "RuntimeError: boom" and not r["found"]
    assert r["inputs_kept"] and r["state_kept"]


@pytest.mark.parametrize("touch", ["inputs", "weight", "grad", "rng", "python_rng", "numpy_rng", "training",
                                   "optimizer"])
def test_the_doctor_judge_sees_any_change_to_the_inputs_or_the_state(touch):
    report = FakeReport([], {"fp16": {"status": "clean"}, "bf16": {"status": "clean"}})

    def careless(model, inputs, targets, loss_fn=None, optimizer=None):
        if touch == "inputs":
            inputs.mul_(0.5)
        elif touch == "weight":
            with torch.no_grad():
                model.fc1.weight.view(-1)[0] += 1e-7
        elif touch == "grad":
            model.fc1.weight.grad = torch.zeros_like(model.fc1.weight)
        elif touch == "rng":
            torch.rand(1)
        elif touch == "python_rng":
            random.random()
        elif touch == "numpy_rng":
            np.random.rand()
        elif touch == "training":
            model.eval()
        else:
            loss_fn(model(inputs), targets).backward()
            optimizer.step()
        return report

    r = G.judge_doctor(G.case("multi_call"), careless)
    assert (r["inputs_kept"], r["state_kept"]) == ((False, True) if touch == "inputs" else (True, False)), r


def test_the_doctor_judge_on_weights_and_optimizer_cases_needs_master_weight_advice():
    c = G.case("pure_fp16_adamw")
    said = FakeReport([FakeFinding("optimizer_nonfinite", "", "fp16", phase="optimizer")],
                      {"fp16": {"status": "refused"}, "bf16": {"status": "clean"}}, recommended_precision="bf16",
                      advice=["Keep fp32 master weights: model.float(), then autocast."])
    r = G.judge_doctor(c, _fake_examine(said))
    assert (r["found"], r["named"], r["advice_works"]) == (True, True, True), r
    silent = FakeReport(said.findings, said.verdicts, recommended_precision="bf16", advice=["Raise eps."])
    assert not G.judge_doctor(c, _fake_examine(silent))["advice_works"]
    # A healthy case with a warning is a false alarm.
    alarm = FakeReport([FakeFinding("precision_loss", "net.0", "bf16", severity="warning")],
                       {"fp16": {"status": "clean"}, "bf16": {"status": "clean"}})
    assert not G.judge_doctor(G.case("ref_mlp"), _fake_examine(alarm))["quiet"]


def test_the_peer_judges_find_and_name_what_the_peers_really_report():
    pytest.importorskip("transformers")
    # DebugUnderflowOverflow names the leaf whose output is inf, and the leaf after an inline overflow.
    duo = G.judge_debug_overflow(G.case("multi_call"))
    assert duo["found"] and duo["named"] and duo["pointed_at"] == "fc2"
    duo = G.judge_debug_overflow(G.case("inline_attention"))
    assert duo["found"] and not duo["named"] and duo["pointed_at"] == "attn.o"
    assert not G.judge_debug_overflow(G.case("custom_backward"))["found"]  # forward hooks: blind to backward
    # detect_anomaly raises on the custom backward's NaN, with a forward traceback into the norm's forward.
    an = G.judge_anomaly(G.case("custom_backward"))
    assert an["found"] and an["named"] and an["pointed_at"] == ["norm"]
    assert not G.judge_anomaly(G.case("inline_rmsnorm"))["found"]  # a wrong loss without NaN: no anomaly


# -- issue 18: the doctor on the gallery ----------------------------------------------------------------------------

def test_doctor_on_gallery():
    """The doctor finds, names and gives working advice on every planted case without blaming a module that only
    passes the trouble on, stays quiet on every healthy one,
    never crashes, leaves the caller's inputs and the model's and optimizer's state bit-identical and gives the same
    findings twice."""
    pytest.importorskip("transformers")
    wrong, still_missed = [], []
    for c in G.CASES:
        r = G.judge_doctor(c)
        if c.known_miss:  # measured and documented (benchmarks/README.md): it must still be missed, and only that
            still_missed.append(c.name)
            assert not r[c.known_miss], f"{c.name}: the doctor now gets {c.known_miss!r} right: clear known_miss"
            r = dict(r, **{c.known_miss: True})
        wrong += doctor_wrong(c, r)
    assert not wrong, "\n".join(wrong)
    assert still_missed == [c.name for c in G.CASES if c.known_miss]


def doctor_wrong(c, r):
    """What judge_doctor's result r on case c shows the doctor got wrong (an empty list when it is right)."""
    wrong = []
    if c.planted and r.get("blames_innocent"):
        wrong.append(f"{c.name}: errors or warnings on innocent {r['blames_innocent']}")
    if c.planted and not (r["found"] and r["named"] and r["advice_works"]):
        wrong.append(f"{c.name}: found {r['found']}, named {r['named']}, advice {r['advice_works']} "
                     f"{r.get('crash') or r.get('loud')} {r.get('advice_tried', '')}")
    if not c.planted and not r["quiet"]:
        wrong.append(f"{c.name} (healthy): {r.get('crash') or r.get('loud')}")
    if not r["inputs_kept"]:
        wrong.append(f"{c.name}: the caller's inputs changed")
    if not r["state_kept"]:
        wrong.append(f"{c.name}: the model's or optimizer's state changed")
    if not r.get("same_twice", False):
        wrong.append(f"{c.name}: two calls conclude differently (or crash)")
    return wrong


def test_the_peers_benchmark_builds_its_table_and_totals(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    import importlib.util
    import json
    import pathlib
    import sys
    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "doctor_peers.py"
    spec = importlib.util.spec_from_file_location("doctor_peers", path)
    peers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peers)
    out = tmp_path / "peers.json"
    monkeypatch.setattr(sys, "argv", ["doctor_peers.py", "--cases", "multi_call,ref_mlp", "--out", str(out)])
    threads = torch.get_num_threads()
    try:
        peers.main()
    finally:
        torch.set_num_threads(threads)  # main() pins one thread for the benchmark; leave the other tests theirs
    data = json.loads(out.read_text())
    assert [r["case"] for r in data["rows"]] == ["multi_call", "ref_mlp"]
    m = data["measured"]  # when and where: the README quotes it
    assert m["cores"] >= 1 and len(m["load_before"]) == 3 and m["wall_s"] > 0 and m["utc_end"] >= m["utc_start"]
    s = data["summary"]
    assert (s["planted"], s["healthy"]) == (1, 1)
    assert s["debug_underflow_overflow"] == {"right": 1, "found": 1, "named": 1, "false_alarms": 0}
    table = peers.markdown(data["rows"], s)
    assert "| multi_call | 6 | `fc2` |" in table and "| ref_mlp | - | healthy | " in table
    # issue 26: one case under both policies, side by side, each judged against its own policy's truth.
    monkeypatch.setattr(sys, "argv", ["doctor_peers.py", "--policy", "both", "--cases", "matvec_overflow",
                                      "--out", str(out)])
    try:
        peers.main()
    finally:
        torch.set_num_threads(threads)
    data = json.loads(out.read_text())
    assert data["policy"] == "both" and [(r["case"], r["policy"]) for r in data["rows"]] == [
        ("matvec_overflow", "cpu"), ("matvec_overflow", "cuda")]
    both = peers.policy_markdown(data["rows"])
    assert "| matvec_overflow | healthy | right: quiet | broken in fp16 | right: nonfinite@mid/fp16/aten::mv |" in both
    assert "right on 2 of 2" in both
    wrong = [dict(r, doctor=dict(r["doctor"], quiet=False, loud=["nonfinite@mid/fp16"])) for r in data["rows"][:1]]
    assert "**false alarm**" in peers.policy_markdown(wrong)  # a doctor loud on the healthy side is scored wrong


# -- issue 26: cases whose truth differs between CPU's and CUDA's autocast lists -------------------------------------

def test_a_policy_case_has_one_entry_per_policy_with_different_truths():
    assert set(G.POLICY_DIFFERS) == {c.name for c in G.POLICY_CASES}
    cpu_names = {c.name for c in G.CASES}
    for name, by in G.POLICY_DIFFERS.items():
        assert set(by) == {"cpu", "cuda"} and by["cpu"].policy == "cpu" and by["cuda"].policy == "cuda", name
        assert G.case(name) is by["cpu"] and G.case(name, "cuda") is by["cuda"] and name in cpu_names
        assert by["cpu"].build is by["cuda"].build  # the same model and batch: only the lists differ
        t = G.truth(name)
        assert t["cpu"] != t["cuda"] and (t["cpu"] or t["cuda"]), (name, t)
    truths = [G.truth(n) for n in G.POLICY_DIFFERS]
    assert any(t["cpu"] and not t["cuda"] for t in truths)  # a problem only under CPU's lists ...
    assert any(t["cuda"] and not t["cpu"] for t in truths)  # ... and one only under CUDA's (unseen from a laptop before)
    with pytest.raises(KeyError, match="under policy 'cuda'"):
        G.case("inline_rmsnorm", "cuda")  # no CUDA truth recorded for the other cases


@pytest.mark.parametrize("name", list(G.POLICY_DIFFERS))
def test_a_policy_case_is_real_under_cudas_lists(name):
    """The CUDA entry's truth, trained under the emulator (its CPU entry is checked with the rest of CASES)."""
    c = G.case(name, "cuda")
    check_planted(c) if c.planted else check_healthy(c)


def test_gradient_loss_at_scale_1_is_measured_under_cudas_lists_too():
    """lost_at_scale_1 under policy "cuda" runs the fp16 backward under CUDA's lists: a Linear is low on both lists,
    so the embedding_underflow model loses its whole gradient under each (it once measured fp32 against fp32 there,
    which made check_healthy's gradient check vacuous for CUDA's entries)."""
    import dataclasses
    c = G.case("embedding_underflow")
    for pol in ("cpu", "cuda"):
        lost = G.lost_at_scale_1(dataclasses.replace(c, policy=pol))
        assert lost["emb.weight"] == 1.0 and lost["head.weight"] == 1.0, (pol, lost)


def test_training_under_cudas_lists_casts_as_cuda_and_refreshes_the_weight_casts():
    c = G.case("pow_rmsnorm", "cuda")
    zeroed = {}  # whether some sample's normed row is all zeros: fp16 h.pow(2) = inf, so rsqrt(mean) = 0

    def watch(pol):
        def hook(module, args, out) -> None:  # (a hook that returns something replaces the output)
            zeroed.setdefault(pol, bool((out.abs().amax(-1) == 0).any()))
        return hook
    for pol in ("cuda", "cpu"):
        s = c.build(0)
        s.model.block.register_forward_hook(watch(pol))
        G.run_steps(s, G.standard("fp16"), steps=1, policy=pol)
    assert zeroed == {"cuda": False, "cpu": True}  # h.pow(2) runs in fp32 under CUDA's lists, in fp16 under CPU's
    # A learning run: the loss after step 2 differs from after step 1 only if step 2's forward saw step 1's update
    # (inside one outer emulation the weight-cast cache would otherwise keep step 1's fp16 weights).
    fp32 = G.reference(c, steps=3)
    run = G.run_steps(c.build(0), G.standard("fp16"), steps=3, policy="cuda")
    assert G.tracks(run, fp32).ok, G.tracks(run, fp32)


def test_doctor_on_the_policy_cases_under_both_policies():
    """Each case whose truth differs is judged under CPU's lists (examine without policy, i.e. policy=None) and
    CUDA's (policy="cuda"): the doctor is right under each, so it reports each problem only where it exists."""
    wrong, loud = [], {}
    for name, by in G.POLICY_DIFFERS.items():
        for pol, c in by.items():
            r = G.judge_doctor(c)
            wrong += [f"[{pol}] {w}" for w in doctor_wrong(c, r)]
            loud[name, pol] = r["loud"]
    assert not wrong, "\n".join(wrong)
    assert any("aten::pow" in f for f in loud["pow_rmsnorm", "cpu"]) and loud["pow_rmsnorm", "cuda"] == []
    assert any("aten::log" in f for f in loud["softmax_log", "cpu"]) and loud["softmax_log", "cuda"] == []
    assert loud["matvec_overflow", "cpu"] == [] and any("aten::mv" in f for f in loud["matvec_overflow", "cuda"])


def test_the_doctor_judge_passes_the_policy_only_for_cudas_entries():
    seen = []

    def examine(*a, **k):
        seen.append(k.get("policy", "absent"))
        return FakeReport([], {"fp16": {"status": "clean"}, "bf16": {"status": "clean"}})
    r = G.judge_doctor(G.case("matvec_overflow", "cuda"), examine)
    assert not r["found"] and seen == ["cuda", "cuda"]  # a clean report on CUDA's truth finds nothing
    assert G.judge_doctor(G.case("matvec_overflow"), examine)["quiet"] and seen[2:] == ["absent", "absent"]
