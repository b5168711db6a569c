"""Chapter 7 checkers accept right answers and reject the usual wrong ones with a hint."""

import pytest
import torch

from ampcourse import exercises
from ampcourse.device import pick
from ampcourse.exercises import ExerciseError


# --- 7.1 data parallelism by hand ----------------------------------------------------------------

def make_step(average="before", reduce="mean", autocast=None, use_scaler_step=True, update=True, zero=True):
    """The right data-parallel step and the mistakes learners make."""

    def average_grads(replicas):
        for params in zip(*(m.parameters() for m in replicas)):
            stacked = torch.stack([p.grad for p in params])
            combined = stacked.mean(0) if reduce == "mean" else stacked.sum(0)
            for p in params:
                p.grad.copy_(combined)

    def step(replicas, batches, optimizers, scalers, loss_fn):
        for model, (x, y), opt, scaler in zip(replicas, batches, optimizers, scalers):
            if zero:
                opt.zero_grad(set_to_none=True)
            with autocast() if autocast else torch.autocast("cpu", enabled=False):
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
        if average == "check_first":  # each replica looks for inf in its own gradient, then averages
            for opt, scaler in zip(optimizers, scalers):
                scaler.unscale_(opt)
        if average in ("before", "check_first"):
            average_grads(replicas)
        for opt, scaler in zip(optimizers, scalers):
            if use_scaler_step:
                scaler.step(opt)
            else:
                opt.step()
            if update:
                scaler.update()
        if average == "after":
            average_grads(replicas)
    return step


@pytest.mark.parametrize("autocast", [None, pick("cpu", "bf16").autocast, pick("cpu", "fp16").autocast])
def test_data_parallel_accepts_right_answers(autocast, capsys):
    exercises.check_data_parallel_step(make_step(autocast=autocast))
    assert "✅" in capsys.readouterr().out


@pytest.mark.parametrize("wrong,hint", [
    (make_step(average="none"), "replace every replica's gradient with the mean"),
    (make_step(average="after"), "replace every replica's gradient with the mean"),
    (make_step(average="check_first"), "the inf check .* must come after the gradients were averaged"),
    (make_step(reduce="sum"), "SUM of the replicas' gradients"),
    (make_step(use_scaler_step=False), "let scaler.step\\(optimizer\\) take the step"),
    (make_step(update=False), "call scaler.update\\(\\)"),
    (make_step(zero=False), "zero each replica's gradients first"),
    (lambda *a: (_ for _ in ()).throw(NotImplementedError()), "replace the `raise NotImplementedError`"),
    ("not a function", "pass the function itself"),
])
def test_data_parallel_rejects_wrong_answers(wrong, hint, capsys):
    with pytest.raises(ExerciseError, match=hint):
        exercises.check_data_parallel_step(wrong)
    assert "❌" in capsys.readouterr().out


# --- 7.2 bytes per GPU -----------------------------------------------------------------------------

def right(n, world, strategy):
    return 16 * n / (world if strategy == "fsdp" else 1)


def test_state_bytes_accepts_the_right_answer(capsys):
    exercises.check_state_bytes(right)
    assert "✅" in capsys.readouterr().out


@pytest.mark.parametrize("wrong,hint", [
    (lambda n, w, s: 16 * n / w, "DDP keeps a full replica"),
    (lambda n, w, s: 16 * n, "FSDP2 shards weights, gradients and optimizer state"),
    (lambda n, w, s: 8 * n / (w if s == "fsdp" else 1), "AdamW keeps two fp32 moments"),
    (lambda n, w, s: 12 * n / (w if s == "fsdp" else 1), "count the gradients too"),
    (lambda n, w, s: 14 * n / (w if s == "fsdp" else 1), "AMP keeps weights and gradients in fp32"),
    (lambda n, w, s: 18 * n / (w if s == "fsdp" else 1), "the 2-byte autocast copy is transient"),
    (lambda n, w, s: "16n", "return a number"),
    (lambda n, w, s: (_ for _ in ()).throw(NotImplementedError()), "replace the `raise NotImplementedError`"),
    (lambda n, w: 0, "TypeError"),
])
def test_state_bytes_rejects_wrong_answers(wrong, hint, capsys):
    with pytest.raises(ExerciseError, match=hint):
        exercises.check_state_bytes(wrong)
    assert "❌" in capsys.readouterr().out


def test_worker_side_files_another_rank_reads_are_written_atomically():
    """The runners (`_run_*`, under torchrun) share files between ranks: one rank writes, the others read. A plain
    write_text truncates first, so a reader can see an empty file: 7.6's resume-<case>.json did, under load (rank 1
    raised JSONDecodeError and a correct solution failed). Every such write goes through replace_atomically."""
    import ast
    import inspect

    from ampcourse.exercises import ch07 as ch07_mod

    tree = ast.parse(inspect.getsource(ch07_mod))
    runners = [f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name.startswith("_run_")]
    assert runners, "no worker-side runners found"
    plain = [(f.name, n.lineno) for f in runners for n in ast.walk(f)
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("write_text", "write_bytes")]
    assert not plain, f"write_text/write_bytes in worker-side runners (use checkpoint.saving.replace_atomically): {plain}"
