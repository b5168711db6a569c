"""Fidelity of emulate.autocast against CUDA's own autocast kernels (run on fake CUDA tensors, no GPU needed).

- per op: for each of the course's ops (autocast_ops.OPS) and each input pattern (fp32, low, mixed), the
  emulator's output dtype on CPU tensors equals the fake-CUDA probe's (fp16 and bf16);
- per overload: every aten overload with an AutocastCUDA kernel, called with the arguments the policy probe
  built from its schema, gives the same output dtype on CPU under the emulator as on fake CUDA;
- per model: the course's models, Hugging Face GPT-2, BERT, T5 and Llama (tiny configs, random weights,
  no download) and every case of the doctor's gallery (tests/doctor_gallery.py): every autocast op the forward
  reaches is replayed, as called, on CUDA's kernels and must give the dtype the emulator gave; backward runs
  (and for the models above, the weights' gradients are fp32).

``python tests/test_emulate_fidelity.py`` prints the counts recorded in benchmarks/README.md.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # random init from a config: nothing to download
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from ampcourse import autocast_ops, emulate, models  # noqa: E402

LOW = [torch.float16, torch.bfloat16]
IDS = ["fp16", "bf16"]


def _cpu_inputs(spec, dtypes):
    """The probe's inputs on CPU: positive values (log, pow, bce stay defined), in the probe's dtypes."""
    g = torch.Generator().manual_seed(0)
    return [(torch.rand(s, generator=g) + 0.5).to(dt) for s, dt in zip(spec.shapes, dtypes)]


def op_agreement(low):
    """(agree, disagree, skipped) over OPS x input patterns: emulator on CPU vs CUDA's kernels on fake CUDA."""
    agree, disagree, skipped = [], [], []
    rows = {r.op: r for r in autocast_ops.op_table("cuda", low)}
    with emulate.autocast(dtype=low):
        for spec in autocast_ops.OPS:
            row = rows[spec.name]
            for probe in (row.from_fp32, row.from_low, row.from_mixed):
                if probe is None:
                    continue
                if probe.failed:
                    skipped.append((spec.name, probe.inputs))
                    continue
                try:
                    got = autocast_ops._name(spec.call(*_cpu_inputs(spec, [getattr(torch, d) for d in probe.inputs])).dtype)
                except RuntimeError as err:
                    got = "error: " + str(err).splitlines()[0]
                (agree if got == probe.output else disagree).append((spec.name, probe.inputs, got, probe.output))
    return agree, disagree, skipped


def overload_agreement(low):
    """(agree, disagree, not runnable on CPU) over every registered overload x input pattern."""
    agree, disagree, cpu_only_errors = [], [], []
    patterns = [(torch.float32,) * 2, (low, low), (low, torch.float32)]
    with emulate.autocast(dtype=low):
        for name, pol in autocast_ops.policy("cuda", low).items():
            op = autocast_ops._overload(name)
            for dts, expected in zip(patterns, pol.outputs):
                if expected is None:  # the call raised on fake CUDA too (shapes the schema-built call got wrong)
                    continue
                made = []

                def make(dts=dts, made=made):
                    made.append((torch.rand(2, 2) + 0.5).to(dts[0] if not made else dts[1]))
                    return made[-1]

                args, kwargs, _ = autocast_ops.schema_args(op, make)
                try:
                    out = op(*args, **kwargs)
                except (RuntimeError, IndexError) as err:  # fake CUDA checks less than CPU kernels (index_put)
                    cpu_only_errors.append((name, str(err).splitlines()[0]))
                    continue
                got = autocast_ops._name((out[0] if isinstance(out, (tuple, list)) else out).dtype)
                (agree if got == expected else disagree).append((name, [str(d) for d in dts], got, expected))
    return agree, disagree, cpu_only_errors


# --- the models -------------------------------------------------------------------------------------------------


def _hf(name):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if name == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=100, n_positions=32,
                                      bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(cfg)
    if name == "bert":
        cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                      intermediate_size=128, vocab_size=100, max_position_embeddings=32)
        return transformers.BertForMaskedLM(cfg)
    if name == "t5":
        cfg = transformers.T5Config(num_layers=2, num_decoder_layers=2, num_heads=4, d_model=64, d_kv=16, d_ff=128,
                                    vocab_size=100, decoder_start_token_id=0, pad_token_id=0)
        return transformers.T5ForConditionalGeneration(cfg)
    cfg = transformers.LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                                   intermediate_size=128, vocab_size=100, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(cfg)


def _run(name, low):
    """Forward under the emulator (traced) and backward outside it: (trace, model)."""
    if name in ("mlp", "cnn", "transformer"):
        model = models.make_model(name)
        x, y = models.make_dataset(name, n=8)[:8]
        with emulate.autocast(dtype=low, trace=True) as emu:
            loss = models.loss_fn(model(x), y)
    else:
        model = _hf(name)
        ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
        with emulate.autocast(dtype=low, trace=True) as emu:
            loss = model(input_ids=ids, labels=ids).loss
    assert loss.dtype == torch.float32
    loss.backward()
    return emu.calls, model


MODELS = ["mlp", "cnn", "transformer", "gpt2", "bert", "t5", "llama"]


def gallery_agreement(name, low):
    """(calls replayed, disagreements) for one case of the doctor's gallery (tests/doctor_gallery.py), as built."""
    from doctor_gallery import call_model, case, model_loss

    s = case(name).build(0)
    with emulate.autocast(dtype=low, trace=True) as emu:
        loss = model_loss(call_model(s.model, s.inputs), s.targets, s.loss_fn)
    loss.float().backward()
    calls = [c for c in emu.calls if c.category != "off"]
    return calls, [(c.op, c.output, r) for c, r in zip(calls, autocast_ops.replay(calls)) if c.output != r]


def _gallery_names():
    from doctor_gallery import CASES

    return [c.name for c in CASES]


def model_agreement(name, low):
    """(calls replayed, disagreements) for one model's forward."""
    calls, _ = _run(name, low)
    calls = [c for c in calls if c.category != "off"]
    replayed = autocast_ops.replay(calls)
    return calls, [(c.op, c.output, r) for c, r in zip(calls, replayed) if c.output != r]


# --- the tests ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("low", LOW, ids=IDS)
def test_every_course_op_matches_cudas_kernels(low):
    agree, disagree, skipped = op_agreement(low)
    assert disagree == [] and len(agree) >= 60 and skipped == []


@pytest.mark.parametrize("low", LOW, ids=IDS)
def test_every_registered_overload_matches_cudas_kernels(low):
    agree, disagree, cpu_only_errors = overload_agreement(low)
    assert disagree == []
    assert len(agree) >= 150  # 193 of the overloads' calls in torch 2.13
    # _cudnn_rnn is cuDNN's alone: no CPU kernel (the RNN modules that reach it on CUDA: test_emulate.py)
    assert {name for name, _ in cpu_only_errors} <= {"aten::index_put", "aten::_cudnn_rnn"}


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("low", LOW, ids=IDS)
def test_models_forward_dtypes_match_cudas_kernels_and_backward_runs(name, low):
    calls, disagree = model_agreement(name, low)
    assert calls and disagree == []
    ops = {c.op for c in calls}
    assert ops & {"aten::linear", "aten::addmm", "aten::conv2d", "aten::matmul"}  # something ran low
    _, model = _run(name, low)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(g.dtype == torch.float32 for g in grads)


@pytest.mark.parametrize("name", _gallery_names())
def test_the_doctors_gallery_forward_dtypes_match_cudas_kernels(name):
    for low in LOW:
        calls, disagree = gallery_agreement(name, low)
        assert disagree == [], (name, low)


if __name__ == "__main__":  # the counts for benchmarks/README.md
    print(f"torch {torch.__version__}")
    for low in LOW:
        a, d, s = op_agreement(low)
        print(f"{low}: course ops {len(a)} agree, {len(d)} disagree, {len(s)} not probeable")
        a, d, e = overload_agreement(low)
        print(f"{low}: registered overloads' calls {len(a)} agree, {len(d)} disagree, {len(e)} not runnable on CPU "
              f"({sorted({n for n, _ in e})})")
        for name in MODELS:
            calls, d = model_agreement(name, low)
            print(f"{low}: {name}: {len(calls)} autocast calls replayed on CUDA's kernels, {len(d)} disagree")
        names = _gallery_names()
        results = [gallery_agreement(name, low) for name in names]
        print(f"{low}: doctor's gallery, {len(names)} cases: {sum(len(c) for c, _ in results)} autocast calls "
              f"replayed, {sum(len(d) for _, d in results)} disagree")
