"""Fault injection: inf/NaN in fp16 gradients (ampcourse.train and LossScaler), checkpoint writers killed mid-write.

Overflow sweeps: each run draws a scaler configuration and a plan of injections (step, micro-batch,
where, which element, inf/-inf/NaN). An injection writes into the fp16 gradient of an autocast
activation (a Linear's output) or into a parameter's gradient during backward. Checked at every step:
the step is skipped exactly when something was injected, the parameters and the optimizer state are
bit-identical to before a skipped step (and do change on the others), the scale follows
``simulate_scale`` for the configured factors exactly, and the loss falls again afterwards.

Killed writers: a real process is SIGKILLed while ``checkpoint.save`` writes, once at a chosen
point (half the bytes written) through ``python -m ampcourse.train``, and at random moments in a
sweep. The previous checkpoint must stay loadable and unchanged, and a resume must give the
uninterrupted run.

Damaged files: single bit flips at random places in a real checkpoint, and bursts of flips. Each must be
refused with ``CheckpointError``, or (a flip in bytes no data depends on, such as zip padding) load with
every tensor and number bit-identical to the undamaged file: a checkpoint never loads as something else.
Impossible settings: resumes whose optimizer, lr or state cannot fit are refused with the model untouched.

A rank killed under ``torchrun --max-restarts 1`` at a random step (three seeds; slow: a torchrun job
each) must resume from the last checkpoint and end exactly where an uninterrupted job ends.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from ampcourse import checkpoint, distributed, models
from ampcourse import train as train_mod
from ampcourse.checkpoint import CheckpointError
from ampcourse.device import pick
from ampcourse.scaling import LossScaler, simulate_scale
from ampcourse.train import state_checksum, train

ROOT = Path(__file__).resolve().parents[1]
VALUES = (math.inf, -math.inf, math.nan)


# --- injection plans ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Injection:
    """Write `value` into element `index` of one gradient during backward of (step, micro-batch)."""

    step: int
    micro: int
    where: str  # "activation": the fp16 gradient of a Linear's autocast output; "param": a parameter's gradient
    target: str  # module or parameter name
    index: int
    value: float


def scaler_config(rng: random.Random) -> dict:
    """GradScaler/LossScaler settings, including factors that are not powers of two."""
    return {"init_scale": rng.choice([2.0**8, 2.0**11, 2.0**14]), "growth_factor": rng.choice([2.0, 1.5, 3.0]),
            "backoff_factor": rng.choice([0.5, 0.25, 0.7]), "growth_interval": rng.choice([1, 2, 3])}


#: Plans keep the scale at or below this (the GradScaler default), so that no step of these small models
#: overflows by itself: then "skipped" must mean "poisoned", exactly.
MAX_SCALE = 2.0**16


def make_plan(rng: random.Random, model: torch.nn.Module, steps: int, accum: int, clean_tail: int,
              cfg: dict) -> list[Injection]:
    """About half the steps get one injection, none in the last `clean_tail` steps (where training must recover)."""
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    params = [n for n, _ in model.named_parameters()]
    for _ in range(1000):
        poisoned = [rng.random() < 0.5 for _ in range(steps - clean_tail)] + [False] * clean_tail
        if max(simulate_scale(poisoned, **cfg)) <= MAX_SCALE:
            break
    else:
        raise AssertionError(f"no plan keeps the scale under {MAX_SCALE} with {cfg}")
    plan = []
    for step in (k for k, p in enumerate(poisoned) if p):
        where = rng.choice(["activation", "param"])
        plan.append(Injection(step, rng.randrange(accum), where, rng.choice(linears if where == "activation" else params),
                              rng.randrange(10**6), rng.choice(VALUES)))
    return plan


class Injector:
    """Hooks that carry out a plan: a forward pre-hook counts micro-batches, tensor hooks rewrite gradients."""

    def __init__(self, model: torch.nn.Module, plan: list[Injection]):
        self.due = {(i.step, i.micro, i.where, i.target): i for i in plan}
        self.step, self.micro = -1, -1
        self.fired: list[Injection] = []
        self.activation_dtypes: list[torch.dtype] = []
        model.register_forward_pre_hook(self._next_micro)
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_hook(self._on_output(name))
        for name, p in model.named_parameters():
            p.register_hook(self._on_grad("param", name))

    def begin_step(self, step: int) -> None:
        """The training loop starts optimizer step `step`."""
        self.step, self.micro = step, -1

    def _next_micro(self, module, args) -> None:
        self.micro += 1

    def _on_output(self, name: str):
        def hook(module, args, out):
            if out.requires_grad and (self.step, self.micro, "activation", name) in self.due:
                out.register_hook(self._on_grad("activation", name))
        return hook

    def _on_grad(self, where: str, name: str):
        def hook(grad: torch.Tensor) -> torch.Tensor | None:
            inj = self.due.get((self.step, self.micro, where, name))
            if inj is None:
                return None
            if where == "activation":
                self.activation_dtypes.append(grad.dtype)
            grad = grad.clone()
            grad.view(-1)[inj.index % grad.numel()] = inj.value
            self.fired.append(inj)
            return grad
        return hook


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor (torch.equal would call -0.0 and 0.0 equal)."""
    return t.detach().clone().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Bits of every parameter and every optimizer state tensor (Adam's step count included)."""
    out = [bits(p) for p in model.parameters()]
    for state in opt.state.values():
        out += [bits(v) if v.is_floating_point() else v.clone() for v in state.values() if torch.is_tensor(v)]
    return out


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def expected_scales(pattern: list[bool], cfg: dict) -> tuple[list[float], float]:
    """The scale each step uses and the final scale, from the configured factors (GradScaler's float32 arithmetic)."""
    after = simulate_scale(pattern, **cfg)
    return [float(np.float32(cfg["init_scale"]))] + after[:-1], after[-1]


# --- ampcourse.train --------------------------------------------------------------------------------

TRAIN_RUNS = 10
TRAIN_STEPS = 30
CLEAN_TAIL = 4


def train_run_setup(seed: int):
    """Model name, accumulation, scaler settings and injection plan of one train() run."""
    rng = random.Random(1000 + seed)
    name = "transformer" if seed % 4 == 3 else "mlp"
    accum = rng.choice([1, 2])
    cfg = scaler_config(rng)
    model = models.make_model(name, seed=seed)
    return name, accum, cfg, model, make_plan(rng, model, TRAIN_STEPS, accum, CLEAN_TAIL, cfg)


def test_the_train_sweep_injects_at_least_100_times():
    assert sum(len(train_run_setup(seed)[4]) for seed in range(TRAIN_RUNS)) >= 100


@pytest.mark.parametrize("seed", range(TRAIN_RUNS))
def test_train_skips_exactly_the_poisoned_steps(seed, monkeypatch):
    name, accum, cfg, model, plan = train_run_setup(seed)
    injector = Injector(model, plan)
    records = []
    real_step = train_mod.train_step

    def observed_step(net, micro, loss_fn, opt, *args, **kwargs):
        injector.begin_step(len(records))
        before = snapshot(net, opt)
        stats = real_step(net, micro, loss_fn, opt, *args, **kwargs)
        records.append((before, snapshot(net, opt)))
        return stats

    monkeypatch.setattr(train_mod.loop, "train_step", observed_step)
    hist = train(model, None, "fp16", steps=TRAIN_STEPS, lr=3e-3, seed=seed, batch_size=32, n_samples=256,
                 accum_steps=accum, scaler_kwargs=cfg, progress=False)

    poisoned = [any(i.step == k for i in plan) for k in range(TRAIN_STEPS)]
    assert sorted(injector.fired, key=lambda i: i.step) == plan  # every planned injection happened, once
    # activation gradients under fp16 autocast are fp16
    assert injector.activation_dtypes == [torch.float16] * sum(i.where == "activation" for i in plan)
    assert hist.skipped == poisoned and hist.nonfinite == poisoned
    scales, final = expected_scales(poisoned, cfg)
    assert hist.scale == scales and hist.final_scale == final  # backoff and growth exactly as configured
    for k, (before, after) in enumerate(records):
        assert same(before, after) == poisoned[k], f"step {k}: {'changed' if poisoned[k] else 'did not change'}"
    # recovery: the clean steps at the end train, and the run ends below where it started
    assert all(math.isfinite(v) for v in hist.loss + hist.grad_norm[-CLEAN_TAIL:])
    assert np.mean(hist.loss[-CLEAN_TAIL:]) < np.mean(hist.loss[:CLEAN_TAIL])


# --- LossScaler in a hand-written loop ------------------------------------------------------------------

SCALER_RUNS = 8
SCALER_STEPS = 30


def scaler_run_setup(seed: int):
    """Scaler settings, model and injection plan of one LossScaler run (one micro-batch per step)."""
    rng = random.Random(2000 + seed)
    cfg = scaler_config(rng)
    model = models.make_model("mlp", seed=seed)
    return cfg, model, make_plan(rng, model, SCALER_STEPS, 1, CLEAN_TAIL, cfg)


def test_the_loss_scaler_sweep_injects_at_least_100_times():
    assert sum(len(scaler_run_setup(seed)[2]) for seed in range(SCALER_RUNS)) >= 100


@pytest.mark.parametrize("seed", range(SCALER_RUNS))
def test_loss_scaler_skips_exactly_the_poisoned_steps(seed):
    cfg, model, plan = scaler_run_setup(seed)
    amp = pick("cpu", "fp16")
    injector = Injector(model, plan)
    data = models.make_dataset("mlp", n=256, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    stepped = []
    opt.register_step_post_hook(lambda *_: stepped.append(injector.step))
    scaler = LossScaler("cpu", **cfg)
    scales, losses, changed = [], [], []
    for step in range(SCALER_STEPS):
        injector.begin_step(step)
        x, y = data[train_mod.batch_indices(step, seed, 256, 32)]
        before = snapshot(model, opt)
        opt.zero_grad(set_to_none=True)
        with amp.autocast():
            loss = models.loss_fn(model(x), y)
        scales.append(scaler.get_scale())
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        changed.append(not same(before, snapshot(model, opt)))
        losses.append(loss.item())

    poisoned = [any(i.step == k for i in plan) for k in range(SCALER_STEPS)]
    assert sorted(injector.fired, key=lambda i: i.step) == plan
    assert injector.activation_dtypes == [torch.float16] * sum(i.where == "activation" for i in plan)
    assert stepped == [k for k in range(SCALER_STEPS) if not poisoned[k]]  # optimizer.step() ran on clean steps only
    assert changed == [not p for p in poisoned]  # bit-identical parameters and optimizer state across a skip
    expected, final = expected_scales(poisoned, cfg)
    assert scales == expected and scaler.get_scale() == final
    assert all(math.isfinite(v) for v in losses) and all(torch.isfinite(p).all() for p in model.parameters())
    assert np.mean(losses[-CLEAN_TAIL:]) < np.mean(losses[:CLEAN_TAIL])


# --- damaged checkpoint files: refused, or identical; never silently different --------------------------

N_FLIP_TRIALS = 150


def _identical(a, b) -> bool:
    """Two loaded checkpoints are the same, tensors compared bit for bit (NaNs included)."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_identical(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_identical(x, y) for x, y in zip(a, b))
    return a == b or (isinstance(a, float) and math.isnan(a) and isinstance(b, float) and math.isnan(b))


@pytest.mark.parametrize("burst", [1, 8], ids=["one bit", "8 bits"])
def test_flipped_bits_are_refused_or_harmless(burst, tmp_path):
    train("mlp", None, "fp16", steps=2, checkpoint_dir=tmp_path / "good", scheduler="cosine", **RUN)
    good_path = checkpoint.path_in(tmp_path / "good")
    good_bytes, good = good_path.read_bytes(), checkpoint.load(good_path)
    path = tmp_path / "damaged.pt"
    rng = random.Random(burst)
    refused = 0
    for _ in range(N_FLIP_TRIALS):
        data = bytearray(good_bytes)
        for _ in range(burst):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
        try:
            state = checkpoint.load(path)
        except CheckpointError:
            refused += 1
            continue
        assert _identical(state, good), "a damaged checkpoint loaded with different contents"
    # almost every byte of the file is data or a header the zip checks; padding is all that may flip unseen
    assert refused >= N_FLIP_TRIALS * 0.8, refused


def test_resume_refusals_leave_the_callers_model_untouched(tmp_path):
    """Another optimizer, another lr, an impossible step: refused before the caller's model changes."""
    train("mlp", None, "fp32", steps=2, checkpoint_dir=tmp_path, **RUN)
    path = checkpoint.path_in(tmp_path)
    data = models.make_dataset("mlp", n=256)
    for change, why in [({"optimizer": "sgd"}, "AdamW"), ({"lr": 1e-2}, "lr=0.001 in the checkpoint"),
                        ({"optimizer": "adam"}, "written by a AdamW optimizer")]:
        mine = models.make_model("mlp", seed=3)
        before = state_checksum(mine)
        with pytest.raises(ValueError, match=why):
            train(mine, data, "fp32", steps=4, checkpoint_dir=tmp_path, resume=True, **{**RUN, **change})
        assert state_checksum(mine) == before
    state = checkpoint.load(path)
    checkpoint.save({**state, "step": -3}, path)
    mine = models.make_model("mlp", seed=3)
    before = state_checksum(mine)
    with pytest.raises(CheckpointError, match="step must be an int >= 0"):
        train(mine, data, "fp32", steps=4, checkpoint_dir=tmp_path, resume=True, **RUN)
    assert state_checksum(mine) == before


# --- checkpoint writers killed mid-write -----------------------------------------------------------------

CHILD_ENV = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(ROOT))
RUN = dict(lr=1e-3, seed=0, batch_size=32, n_samples=256, progress=False)  # python -m ampcourse.train's defaults
CLI = ["--model", "mlp", "--precision", "fp16", "--global-batch-size", "32", "--samples", "256", "--no-progress"]

# python -m ampcourse.train, with torch.save slowed down: it writes half of the checkpoint's bytes to the
# temp file, makes them durable, says so, and waits to be killed.
HALF_WRITER = textwrap.dedent("""
    import io, os, sys, time
    import torch
    from ampcourse import train
    real_save = torch.save
    def half_save(obj, fh):
        buf = io.BytesIO()
        real_save(obj, buf)
        fh.write(buf.getvalue()[: len(buf.getvalue()) // 2])
        fh.flush()
        os.fsync(fh.fileno())
        print("MIDWRITE", flush=True)
        time.sleep(300)
    torch.save = half_save
    sys.exit(train.main(sys.argv[1:]))
""")


def temp_files(folder: Path) -> list[Path]:
    """checkpoint.save's temp files in a folder."""
    return sorted(folder.glob(f".{checkpoint.FILENAME}.*.tmp"))


def test_sigkill_during_a_checkpoint_write_keeps_the_previous_one(tmp_path):
    run = tmp_path / "run"
    train("mlp", None, "fp16", steps=2, checkpoint_dir=run, **RUN)
    path = checkpoint.path_in(run)
    good = path.read_bytes()
    child = subprocess.Popen([sys.executable, "-c", HALF_WRITER, *CLI, "--steps", "4", "--checkpoint-dir", str(run),
                              "--checkpoint-every", "1", "--resume"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=CHILD_ENV, cwd=ROOT)
    try:
        line = child.stdout.readline()  # blocks until the child is half-way through writing step 3's checkpoint
        assert line.strip() == "MIDWRITE", child.stderr.read()
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL

    # the previous checkpoint: same bytes, loadable, step 2; the torn write sits in a temp file nobody reads
    assert path.read_bytes() == good and checkpoint.load(path)["step"] == 2
    (torn,) = temp_files(run)
    assert f".{socket.gethostname()}.{child.pid}." in torn.name and 0 < torn.stat().st_size < len(good) * 1.5
    with pytest.raises(CheckpointError, match="truncated or not a torch file"):
        checkpoint.load(torn)

    # resuming gives the uninterrupted run, and its first save clears the dead writer's temp file
    resumed = train("mlp", None, "fp16", steps=4, checkpoint_dir=run, checkpoint_every=1, resume=True, **RUN)
    whole = train("mlp", None, "fp16", steps=4, **RUN)
    assert resumed.start_step == 2 and state_checksum(resumed.model) == state_checksum(whole.model)
    assert resumed.loss == whole.loss and resumed.scale == whole.scale
    assert temp_files(run) == [] and sorted(p.name for p in run.iterdir()) == [checkpoint.FILENAME]


# A process that checkpoints as fast as it can (8 MB each, fsync'd) in forked children, and kills each child
# with SIGKILL after a random delay; it reports the last step each child confirmed through a pipe.
KILL_SWEEP = textwrap.dedent("""
    import json, os, random, signal, sys, time
    from pathlib import Path
    import torch
    from ampcourse import checkpoint
    torch.set_num_threads(1)
    root, tries, seed = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    rng = random.Random(seed)
    payload = torch.arange(2_000_000, dtype=torch.float32)

    def state(step):
        return {"format": checkpoint.FORMAT, "version": checkpoint.VERSION, "step": step,
                "model": {"w": payload + step}, "optimizer": {}, "scaler": {}, "scheduler": None,
                "rng": checkpoint.rng_state()}

    report = []
    for i in range(tries):
        path = checkpoint.path_in(root / f"try{i}")
        path.parent.mkdir()
        checkpoint.save(state(0), path)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the writer
            os.close(r)
            step = 0
            while True:
                step += 1
                checkpoint.save(state(step), path)
                os.write(w, step.to_bytes(4, "little"))
        os.close(w)
        time.sleep(rng.uniform(0.01, 0.3))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        data = b""
        while chunk := os.read(r, 1 << 16):
            data += chunk
        os.close(r)
        steps = [int.from_bytes(data[j:j + 4], "little") for j in range(0, len(data) - 3, 4)]
        report.append({"dir": str(path.parent), "confirmed": max(steps, default=0)})
    print(json.dumps(report))
""")


def test_sigkill_at_random_moments_never_leaves_a_torn_checkpoint(tmp_path):
    tries = 12
    out = subprocess.run([sys.executable, "-c", KILL_SWEEP, str(tmp_path), str(tries), "0"], capture_output=True,
                         text=True, env=CHILD_ENV, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    mid_write = 0
    for entry in report:
        folder = Path(entry["dir"])
        state = checkpoint.load(checkpoint.path_in(folder))  # never torn: the old file or the new one, whole
        # the kill may land after os.replace and before the child confirmed that step
        assert state["step"] in (entry["confirmed"], entry["confirmed"] + 1), (entry, state["step"])
        assert torch.equal(state["model"]["w"], torch.arange(2_000_000, dtype=torch.float32) + state["step"])
        mid_write += bool(temp_files(folder))
        checkpoint.save(state, checkpoint.path_in(folder))  # the next save clears what the dead writer left
        assert [p.name for p in folder.iterdir()] == [checkpoint.FILENAME]
    assert sum(e["confirmed"] > 0 for e in report) >= tries // 2  # the writers really wrote, repeatedly
    assert mid_write >= 1, "no kill landed in the middle of a write; the sweep proved nothing"


# --- a rank killed at a random step under torchrun --max-restarts ---------------------------------------

WORKER = ROOT / "tests" / "dist_worker.py"  # the CLI plus AMPCOURSE_TEST_KILL=RANK:STEP (SIGKILL, first round)
ELASTIC = ["--model", "mlp", "--device", "cpu", "--global-batch-size", "32", "--samples", "256", "--seed", "0",
           "--no-progress", "--strategy", "ddp", "--precision", "fp16", "--steps", "10", "--checkpoint-every", "3",
           "--checkpoint-dir", "ckpt", "--out", "summary.json"]
KILL_SEEDS = range(3)


def kill_point(seed: int) -> tuple[int, int]:
    """(rank, step) at whose start that rank SIGKILLs itself: drawn from the seed (here (0, 6), (1, 7), (1, 1):
    the rank that writes checkpoints right after it wrote one, the other rank, and a kill before any checkpoint)."""
    rng = random.Random(5000 + seed)
    return rng.randrange(2), rng.randrange(1, 10)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    """The summary of the same torchrun job without a fault."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    distributed.launch(ELASTIC, cwd=folder, timeout=180, script=WORKER, max_restarts=1).check()
    return json.loads((folder / "summary.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("seed", KILL_SEEDS)
def test_rank_killed_at_a_random_step_resumes_to_the_uninterrupted_result(seed, uninterrupted, tmp_path):
    rank, step = kill_point(seed)
    fault = distributed.launch(ELASTIC, cwd=tmp_path, timeout=240, script=WORKER, max_restarts=1,
                               env={"AMPCOURSE_TEST_KILL": f"{rank}:{step}"}).check()
    assert "exitcode: -9" in fault.stderr  # the kill happened, and torchrun restarted the job
    last = 3 * (step // 3)  # the last checkpoint written before the kill (steps 0..step-1 done)
    said = "resuming from the last checkpoint" if last else "no checkpoint yet, starting over"
    assert f"ampcourse.train: torchrun restart 1: {said}" in fault.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["resumed_from_step"] == last and summary["steps_done"] == 10
    for key in ("checksum", "final_loss", "final_loss_scale", "skipped_steps"):
        assert summary[key] == uninterrupted[key], key
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == [checkpoint.FILENAME]  # no torn or stray files
