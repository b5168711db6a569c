"""The AMP doctor on architectures nobody in this project wrote: torch's own transformer, and Hugging Face
GPT-2, BERT and a ResNet-18-like ResNet built from tiny configs with random weights (no downloads).

torchvision's ResNet is not used: PyPI's torchvision does not install beside the CPU torch build this
project pins, so the ResNet here is transformers' ``ResNetForImageClassification`` with ResNet-18's
layout (basic blocks, depths 2-2-2-2, widths 64-128-256-512).
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # random init from a config: nothing to download, and nothing may be
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from ampcourse.doctor import examine as _examine  # noqa: E402


def examine(*args, steps=0, **kwargs):
    """The forensic pass (steps=0): these tests are about what one forward + backward finds in each architecture;
    the GPT-2 one confirms by training too."""
    return _examine(*args, steps=steps, **kwargs)

transformers = pytest.importorskip("transformers")


def quiet_config(cls, **kw):
    """A transformers config with logging of its own warnings turned down."""
    transformers.logging.set_verbosity_error()
    return cls(**kw)


@pytest.fixture()
def encoder():
    """torch's nn.TransformerEncoder (dropout on: training mode) with a linear head."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)
    return nn.Sequential(nn.TransformerEncoder(layer, 2), nn.Linear(32, 10))


def encoder_batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 10, 32, generator=g), torch.randint(0, 10, (8, 10), generator=g)


def seq_ce(out, y):
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def gpt2():
    torch.manual_seed(0)
    cfg = quiet_config(transformers.GPT2Config, n_layer=2, n_head=4, n_embd=64, vocab_size=100, n_positions=32,
                       bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def resnet18_like():
    torch.manual_seed(0)
    cfg = quiet_config(transformers.ResNetConfig, layer_type="basic", depths=[2, 2, 2, 2],
                       hidden_sizes=[64, 128, 256, 512], num_labels=10)
    return transformers.ResNetForImageClassification(cfg)


def ids(n=4, t=16):
    return torch.randint(0, 100, (n, t), generator=torch.Generator().manual_seed(2))


def test_torch_transformer_encoder_healthy(encoder):
    x, y = encoder_batch()
    r = examine(encoder, x, y, loss_fn=seq_ce, optimizer=torch.optim.AdamW(encoder.parameters(), lr=1e-3))
    assert r.warnings == [], r.summary()
    assert {v["status"] for v in r.verdicts.values()} == {"clean"}  # same dropout masks in every pass


def test_torch_encoder_overflow_in_one_linear(encoder):
    with torch.no_grad():
        encoder[0].layers[1].linear1.weight.mul_(3e5)
    x, y = encoder_batch()
    r = examine(encoder, x, y, loss_fn=seq_ce)
    over = r.find("activation_overflow", "fp16")
    assert over and over[0].module == "0.layers.1.linear1"
    assert r.verdicts["fp16"]["status"] in ("refused", "islands") and r.verdicts["bf16"]["status"] == "clean"
    assert r.recommended_precision == "bf16"


def test_gpt2_healthy_with_its_own_loss_and_state_unchanged():
    model = gpt2()
    x = ids()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    rng = torch.get_rng_state()
    r = examine(model, {"input_ids": x, "labels": x}, optimizer=opt, steps=10)
    assert r.warnings == [], r.summary()
    assert all(torch.equal(before[n], p) and p.grad is None for n, p in model.named_parameters())
    assert torch.equal(rng, torch.get_rng_state()) and model.training and not opt.state
    assert r.verdicts["bf16"].confirmed and r.confirmation["optimizer"].startswith("AdamW with your param groups")


def test_gpt2_overflowing_mlp_named():
    model = gpt2()
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.weight.mul_(1e6)
    x = ids()
    r = examine(model, {"input_ids": x, "labels": x})
    over = r.find("activation_overflow", "fp16")
    assert over and over[0].module == "transformer.h.0.mlp.c_fc"
    assert r.recommended_precision == "bf16" and r.verdicts["bf16"]["status"] == "clean"


def test_bert_healthy():
    torch.manual_seed(0)
    cfg = quiet_config(transformers.BertConfig, num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                       intermediate_size=128, vocab_size=100, num_labels=3)
    model = transformers.BertForSequenceClassification(cfg)
    r = examine(model, {"input_ids": ids(), "labels": torch.tensor([0, 1, 2, 0])})
    assert r.warnings == [], r.summary()


def test_resnet18_like_healthy_and_scaled_down_loss():
    model = resnet18_like()
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g)
    r = examine(model, {"pixel_values": x, "labels": y}, precisions=("fp16",))
    assert r.warnings == [], r.summary()
    tiny = examine(model, {"pixel_values": x}, y, loss_fn=lambda out, t: F.cross_entropy(out.logits, t) * 2.0**-24,
                   precisions=("fp16",))
    under = tiny.find("gradient_underflow", "fp16")
    assert under and under[0].value > 0.5 and under[0].severity == "warning"
    assert tiny.recommended_init_scale >= 2.0**24 * r.recommended_init_scale / 2
