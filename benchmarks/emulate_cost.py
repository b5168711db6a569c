"""What measuring under CUDA's autocast lists on a CPU costs: examine() with policy=None and policy="cuda".

    .venv/bin/python benchmarks/emulate_cost.py --repeats 3

Hugging Face GPT-2 and BERT from tiny configs (2 layers, width 64, batch 4 x 16 tokens, random init, no
download), each examined (fp16 + bf16, forward and backward, optimizer audit) under the CPU's own lists and under
CUDA's (``ampcourse.emulate``), interleaved, ``--repeats`` times; medians of the wall time and their ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # random init from a config: nothing to download

import torch  # noqa: E402
import transformers  # noqa: E402

from ampcourse import emulate  # noqa: E402
from ampcourse.doctor import examine  # noqa: E402


def gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=100, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def bert() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                                  vocab_size=100, max_position_embeddings=32)
    return transformers.BertForMaskedLM(cfg)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    transformers.logging.set_verbosity_error()
    emulate.policy(torch.float16), emulate.policy(torch.bfloat16)  # the probe (or its disk cache) is not timed
    ids = torch.randint(0, 100, (4, 16), generator=torch.Generator().manual_seed(0))
    for name, make in (("gpt2", gpt2), ("bert", bert)):
        model = make()
        opt = torch.optim.AdamW(model.parameters())
        times: dict[str | None, list[float]] = {None: [], "cuda": []}
        for _ in range(args.repeats):
            for policy in times:
                t0 = time.perf_counter()
                examine(model, {"input_ids": ids, "labels": ids}, optimizer=opt, policy=policy)
                times[policy].append(time.perf_counter() - t0)
        cpu, cuda = statistics.median(times[None]), statistics.median(times["cuda"])
        print(f"{name}: CPU's lists {cpu:.2f} s, CUDA's (emulated) {cuda:.2f} s, ratio {cuda / cpu:.2f}")


if __name__ == "__main__":
    main()
