"""ampcourse.checkpoint: exact resume, atomic writes, and clear errors for every kind of bad file."""

import errno
import os
import pickle
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ampcourse import checkpoint, models
from ampcourse.checkpoint import CheckpointError
from ampcourse.train import Parallel, state_checksum, train

FAST = dict(lr=1e-2, seed=0, batch_size=32, n_samples=256, progress=False)
# Each precision's full configuration: fp16 starts at a small scale that grows every 2 clean steps, so
# the GradScaler's scale *and* growth tracker must survive the checkpoint; cosine LR and clipping too.
CONFIGS = {
    "fp32": dict(scheduler="cosine", grad_clip=1.0),
    "fp16": dict(scheduler="cosine", grad_clip=1.0, scaler_kwargs={"init_scale": 2.0**8, "growth_interval": 2}),
    "bf16": dict(scheduler="cosine", grad_clip=1.0, accum_steps=2),
}


def same_run(a, b):
    """Bit-identical parameters and identical per-step records (timings aside)."""
    assert state_checksum(a.model) == state_checksum(b.model)
    for x, y in zip(a.model.state_dict().values(), b.model.state_dict().values()):
        assert torch.equal(x, y)
    assert a.series() | {"step_time": None} == b.series() | {"step_time": None}
    assert a.final_scale == b.final_scale


class Interrupt(Exception):
    """Stands in for a crash (or a pre-empted job) in the middle of a run."""


def crashing_loss(at_call: int):
    calls = []

    def loss_fn(out, y):
        calls.append(1)
        if len(calls) == at_call:
            raise Interrupt
        return models.loss_fn(out, y)
    return loss_fn


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_resume_is_bit_identical(precision, tmp_path):
    """Checkpoint every 3 steps, crash in step 5, resume from step 3: the same run as without the crash."""
    cfg = {**FAST, **CONFIGS[precision]}
    whole = train("cnn", None, precision, steps=6, **cfg)
    with pytest.raises(Interrupt):
        train("cnn", None, precision, steps=6, checkpoint_dir=tmp_path, checkpoint_every=3,
              loss_fn=crashing_loss(at_call=5 * cfg.get("accum_steps", 1)), **cfg)
    assert checkpoint.load(checkpoint.path_in(tmp_path))["step"] == 3
    rest = train("cnn", None, precision, steps=6, checkpoint_dir=tmp_path, resume=True, **cfg)
    assert rest.start_step == 3 and rest.steps_done == 6  # the history spans the whole run
    same_run(whole, rest)
    if precision == "fp16":
        assert whole.scale == [256.0, 256.0, 512.0, 512.0, 1024.0, 1024.0]


def test_extending_a_finished_run(tmp_path):
    """Without a schedule, a finished run can be continued for more steps: same as one longer run."""
    whole = train("mlp", None, "fp16", steps=5, **FAST)
    train("mlp", None, "fp16", steps=2, checkpoint_dir=tmp_path, **FAST)
    rest = train("mlp", None, "fp16", steps=5, checkpoint_dir=tmp_path, resume=True, **FAST)
    same_run(whole, rest)


def test_a_schedule_cannot_be_stretched_on_resume(tmp_path):
    train("mlp", None, "fp32", steps=2, checkpoint_dir=tmp_path, scheduler="cosine", **FAST)
    with pytest.raises(ValueError, match=r"steps=2 in the checkpoint, 4 now \(the LR schedule"):
        train("mlp", None, "fp32", steps=4, checkpoint_dir=tmp_path, resume=True, scheduler="cosine", **FAST)


def test_resume_after_a_crash_between_checkpoints(tmp_path):
    """Checkpoint every 2 steps, crash in step 5, resume from step 4: same result as no crash."""
    cfg = {**FAST, **CONFIGS["fp16"]}
    whole = train("mlp", None, "fp16", steps=7, **cfg)
    with pytest.raises(Interrupt):
        train("mlp", None, "fp16", steps=7, checkpoint_dir=tmp_path, checkpoint_every=2,
              loss_fn=crashing_loss(at_call=5), **cfg)
    assert checkpoint.load(checkpoint.path_in(tmp_path))["step"] == 4
    rest = train("mlp", None, "fp16", steps=7, checkpoint_dir=tmp_path, resume=True, **cfg)
    assert rest.start_step == 4
    same_run(whole, rest)


def test_resume_equality_needs_the_scaler_state(tmp_path):
    """The control: resume with the scaler's state reset and the run no longer matches."""
    cfg = {**FAST, "scaler_kwargs": CONFIGS["fp16"]["scaler_kwargs"]}
    whole = train("mlp", None, "fp16", steps=6, **cfg)
    train("mlp", None, "fp16", steps=3, checkpoint_dir=tmp_path, **cfg)
    path = checkpoint.path_in(tmp_path)
    state = checkpoint.load(path)
    assert state["scaler"]["scale"] == 512.0 and state["scaler"]["_growth_tracker"] == 1
    state["scaler"]["scale"], state["scaler"]["_growth_tracker"] = 256.0, 0
    checkpoint.save(state, path)
    rest = train("mlp", None, "fp16", steps=6, checkpoint_dir=tmp_path, resume=True, **cfg)
    # The scale history diverges (and with it which future steps overflow and get skipped); the weights
    # still agree here because power-of-two scales cancel exactly while no step overflows.
    assert rest.scale[3:] == [256.0, 256.0, 512.0] != whole.scale[3:] == [512.0, 1024.0, 1024.0]
    assert rest.final_scale == 512.0 != whole.final_scale


def test_resume_on_more_ranks_draws_the_same_global_batch(tmp_path):
    """world_size is not pinned by the checkpoint: the global batch of a step does not depend on it."""
    train("mlp", None, "fp32", steps=2, checkpoint_dir=tmp_path, **FAST)
    rest = train("mlp", None, "fp32", steps=3, checkpoint_dir=tmp_path, resume=True, parallel=Parallel(world_size=2), **FAST)
    assert rest.start_step == 2 and rest.steps_done == 3


def test_resume_at_the_end_does_nothing_and_before_it_is_refused(tmp_path):
    """steps equal to the checkpoint's: the finished run comes back. Fewer: refused (it silently came back, too)."""
    first = train("mlp", None, "fp32", steps=3, checkpoint_dir=tmp_path, **FAST)
    again = train("mlp", None, "fp32", steps=3, checkpoint_dir=tmp_path, resume=True, **FAST)
    assert again.steps_done == 3 and state_checksum(again.model) == state_checksum(first.model)
    with pytest.raises(ValueError, match="holds 3 completed steps and steps=2 now asks for fewer"):
        train("mlp", None, "fp32", steps=2, checkpoint_dir=tmp_path, resume=True, **FAST)


@pytest.mark.parametrize("change,name", [(dict(seed=1), "seed"), (dict(batch_size=16), "batch_size"),
                                         (dict(n_samples=128), "dataset_size"), (dict(precision="bf16"), "precision"),
                                         (dict(lr=2e-2), "lr"), (dict(weight_decay=0.1), "weight_decay")])
def test_resume_refuses_other_settings(change, name, tmp_path):
    train("mlp", None, "fp32", steps=2, checkpoint_dir=tmp_path, **FAST)
    args = {**FAST, "precision": "fp32", **change}
    with pytest.raises(ValueError, match=f"{name}=.* in the checkpoint"):
        train("mlp", None, steps=4, checkpoint_dir=tmp_path, resume=True, **args)


def test_resume_refuses_another_model(tmp_path):
    train("mlp", None, "fp32", steps=1, checkpoint_dir=tmp_path, **FAST)
    data = models.make_dataset("mlp", n=256)
    with pytest.raises(CheckpointError, match="does not fit this model"):
        train(torch.nn.Sequential(torch.nn.Linear(32, 10)), data, "fp32", steps=2, checkpoint_dir=tmp_path,
              resume=True, **FAST)


def test_existing_checkpoint_is_not_overwritten_without_resume(tmp_path):
    train("mlp", None, "fp32", steps=1, checkpoint_dir=tmp_path, **FAST)
    path = checkpoint.path_in(tmp_path)
    before = path.read_bytes()
    with pytest.raises(ValueError, match="already exists and would be overwritten; pass resume=True"):
        train("mlp", None, "fp32", steps=2, checkpoint_dir=tmp_path, **FAST)
    assert path.read_bytes() == before


def test_checkpoint_holds_every_piece(tmp_path):
    train("mlp", None, "fp16", steps=2, checkpoint_dir=tmp_path, scheduler="cosine", **FAST)
    state = checkpoint.load(checkpoint.path_in(tmp_path))
    assert state["format"] == checkpoint.FORMAT and state["version"] == checkpoint.VERSION and state["step"] == 2
    assert set(state["model"]) == set(models.make_model("mlp").state_dict())
    assert state["optimizer"]["state"] and state["scaler"]["scale"] == 65536.0
    assert state["scheduler"]["last_epoch"] == 2 and state["rng"]["cpu"].dtype == torch.uint8
    assert state["config"]["precision"] == "fp16" and len(state["history"]["loss"]) == 2


# --- atomic writes --------------------------------------------------------------------------

def test_save_is_atomic_and_leaves_no_temp_files(tmp_path):
    path = tmp_path / "c.pt"
    state = {"format": checkpoint.FORMAT, "x": torch.arange(3)}
    checkpoint.save(state, path)
    checkpoint.save({**state, "x": torch.arange(4)}, path)
    assert torch.load(path, weights_only=True)["x"].tolist() == [0, 1, 2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.pt"]


class FillingDisk:
    """os.fdopen's file, on a disk with `room` bytes left: a write beyond them raises OSError(errno) as the OS would."""

    def __init__(self, fh, room: int, errno_: int = errno.ENOSPC):
        self.fh, self.room, self.errno = fh, room, errno_

    def write(self, data) -> int:
        if len(data) > self.room:
            raise OSError(self.errno, os.strerror(self.errno))
        self.room -= len(data)
        return self.fh.write(data)

    def __getattr__(self, name):  # flush, fileno, close: the real file's
        return getattr(self.fh, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.fh.close()


def fill_disk(monkeypatch, room: int, errno_: int = errno.ENOSPC) -> None:
    """Every file checkpoint.save opens from now on sits on a disk that fills up after `room` bytes."""
    real = os.fdopen
    monkeypatch.setattr(checkpoint.saving.os, "fdopen", lambda fd, mode: FillingDisk(real(fd, mode), room, errno_))


@pytest.mark.parametrize("errno_,said", [(errno.ENOSPC, "no space left on device"), (errno.EFBIG, "file too large"),
                                         (errno.EIO, "input/output error")])
@pytest.mark.parametrize("room", [0, 100, 3000])  # before the zip header, inside it, inside the tensors' bytes
def test_a_disk_that_refuses_the_write_is_named_and_the_last_checkpoint_stays(errno_, said, room, tmp_path,
                                                                             monkeypatch):
    """The zip writer masks the OSError as 'unexpected pos'; save() names it, and where, and keeps the old file."""
    train("mlp", None, "fp32", steps=2, checkpoint_dir=tmp_path, **FAST)
    path = checkpoint.path_in(tmp_path)
    good = path.read_bytes()
    fill_disk(monkeypatch, room, errno_)
    with pytest.raises(CheckpointError) as info:
        train("mlp", None, "fp32", steps=4, checkpoint_dir=tmp_path, resume=True, **FAST)
    msg = str(info.value)
    assert said in msg.lower() and f"errno {errno_}" in msg and str(path) in msg and "\n" not in msg, msg
    assert "previous checkpoint there, if any, is intact" in msg and "unexpected pos" not in msg
    assert path.read_bytes() == good
    assert sorted(p.name for p in tmp_path.iterdir()) == [checkpoint.FILENAME]  # no temp file left
    monkeypatch.undo()
    assert checkpoint.load(path)["step"] == 2


def test_a_full_disk_on_the_first_save_leaves_nothing(tmp_path, monkeypatch):
    fill_disk(monkeypatch, 500)
    with pytest.raises(CheckpointError, match="no space left on device"):
        checkpoint.save({"format": checkpoint.FORMAT, "w": torch.ones(1000)}, tmp_path / "c.pt")
    assert list(tmp_path.iterdir()) == []


def test_an_interrupted_write_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    train("mlp", None, "fp32", steps=2, checkpoint_dir=tmp_path, **FAST)
    path = checkpoint.path_in(tmp_path)
    good = path.read_bytes()

    def half_written(obj, fh):
        fh.write(b"PK\x03\x04 partial")  # some bytes reach the temp file, then Ctrl-C
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint.saving.torch, "save", half_written)
    with pytest.raises(KeyboardInterrupt):
        train("mlp", None, "fp32", steps=4, checkpoint_dir=tmp_path, resume=True, **FAST)
    assert path.read_bytes() == good
    assert sorted(p.name for p in tmp_path.iterdir()) == [checkpoint.FILENAME]
    monkeypatch.undo()
    assert checkpoint.load(path)["step"] == 2


def test_a_file_size_limit_in_the_cli_is_one_line(tmp_path):
    """EFBIG for real: the CLI under a file-size limit smaller than its checkpoint (Python ignores SIGXFSZ)."""
    resource = pytest.importorskip("resource", reason="RLIMIT_FSIZE is POSIX")
    limit = 20_000  # the tiny MLP's checkpoint is larger; the summary is not written at all

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    run = subprocess.run([sys.executable, "-m", "ampcourse.train", "--model", "mlp", "--steps", "2", "--no-progress",
                          "--samples", "256", "--global-batch-size", "32", "--checkpoint-dir", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=300, preexec_fn=small_files)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert run.stderr.count("\n") == 1 and "file too large" in run.stderr.lower(), run.stderr
    assert run.stderr.startswith("ampcourse.train: error: cannot save a checkpoint to ")
    assert [p.name for p in (tmp_path / "run").iterdir()] == []  # the temp file is gone


@pytest.mark.parametrize("setting", ["crc32 off", "mmap on", "alignment 4096"])
def test_global_torch_serialization_settings_do_not_change_what_loads(setting, tmp_path):
    """Defect: with set_crc32_options(False) torch stored CRC 0 and load() refused our own file as damaged."""
    from torch.utils.serialization import config  # torch >= 2.6
    changes = {"crc32 off": (config.save, "compute_crc32", False), "mmap on": (config.load, "mmap", True),
               "alignment 4096": (config.save, "storage_alignment", 4096)}
    section, name, value = changes[setting]
    before = getattr(section, name)
    setattr(section, name, value)
    try:
        train("mlp", None, "fp16", steps=2, checkpoint_dir=tmp_path, **FAST)
        assert checkpoint.load(checkpoint.path_in(tmp_path))["step"] == 2
        assert train("mlp", None, "fp16", steps=3, checkpoint_dir=tmp_path, resume=True, **FAST).steps_done == 3
        assert getattr(section, name) == value  # the caller's setting is left as it was
    finally:
        setattr(section, name, before)


# --- every kind of bad file -------------------------------------------------------------------

class Payload:
    """A pickled object that would run code when unpickled without weights_only."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def _write_good(tmp_path) -> Path:
    """A real checkpoint in tmp_path/good, to corrupt."""
    d = tmp_path / "good"
    train("mlp", None, "fp32", steps=1, checkpoint_dir=d, **FAST)
    return checkpoint.path_in(d)


BAD_FILES = {
    "empty": (lambda tmp, good: b"", "empty"),
    "truncated": (lambda tmp, good: good[: len(good) // 2], "truncated or not a torch file"),
    "random bytes": (lambda tmp, good: random.Random(0).randbytes(4096), "truncated or not a torch file"),
    "random bytes 2": (lambda tmp, good: random.Random(1).randbytes(4096), "truncated or not a torch file"),
    "text": (lambda tmp, good: b"step=4\n", "truncated or not a torch file"),
    "plain pickle": (lambda tmp, good: pickle.dumps({"model": 1}), "truncated or not a torch file"),
    "plain pickle of an object": (lambda tmp, good: pickle.dumps(Payload(tmp / "pwned")), "not a torch file"),
}


def _write_bad(kind, tmp_path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    path = checkpoint.path_in(run)
    if kind in BAD_FILES:
        path.write_bytes(BAD_FILES[kind][0](tmp_path, _write_good(tmp_path).read_bytes()))
    elif kind == "code-running pickle":
        torch.save({"format": checkpoint.FORMAT, "evil": Payload(tmp_path / "pwned")}, path)
    elif kind == "foreign torch file":
        torch.save({"state_dict": {"w": torch.ones(2)}, "epoch": 3}, path)
    elif kind == "other version":
        state = torch.load(_write_good(tmp_path), weights_only=True)
        torch.save({**state, "version": 99}, path)
    elif kind == "missing pieces":
        torch.save({"format": checkpoint.FORMAT, "version": checkpoint.VERSION, "step": 1}, path)
    elif kind == "a directory":
        path.mkdir()
    elif kind == "legacy torch file":  # no zip, so no CRCs: refused even though torch could read it
        state = torch.load(_write_good(tmp_path), weights_only=True)
        torch.save(state, path, _use_new_zipfile_serialization=False)
    return path


KINDS = [*BAD_FILES, "code-running pickle", "foreign torch file", "other version", "missing pieces", "a directory",
         "legacy torch file"]
WHY = {**{k: v[1] for k, v in BAD_FILES.items()}, "code-running pickle": "weights_only=True\\) refused it",
       "foreign torch file": "not an ampcourse.checkpoint file", "other version": "format version 99",
       "missing pieces": "lacks model, optimizer", "a directory": "not a regular file",
       "legacy torch file": "legacy non-zip format, which carries no checksums"}


def _snapshot(path: Path):
    return path.read_bytes() if path.is_file() else "dir"


@pytest.mark.parametrize("kind", KINDS)
def test_bad_file_gives_a_clear_error_and_stays_untouched(kind, tmp_path):
    path = _write_bad(kind, tmp_path)
    before = _snapshot(path)
    with pytest.raises(CheckpointError) as info:
        checkpoint.load(path)
    msg = str(info.value)
    assert str(path) in msg and "left untouched" in msg and "move it aside" in msg
    assert re.search(WHY[kind], msg), msg
    assert "\n" not in msg  # one line
    # the same through train(resume=True): an error before any work, nothing deleted or overwritten
    with pytest.raises(CheckpointError, match=WHY[kind]):
        train("mlp", None, "fp32", steps=3, checkpoint_dir=path.parent, resume=True, **FAST)
    assert _snapshot(path) == before
    assert sorted(p.name for p in path.parent.iterdir()) == [checkpoint.FILENAME]
    assert not (tmp_path / "pwned").exists()  # the payload never ran


def test_missing_file():
    with pytest.raises(CheckpointError, match="no checkpoint at 'nowhere/checkpoint.pt'"):
        checkpoint.load("nowhere/checkpoint.pt")


def test_the_payload_would_have_run_without_weights_only(tmp_path):
    """The control for the test above: the pickle really is dangerous."""
    path = _write_bad("code-running pickle", tmp_path)
    torch.load(path, weights_only=False)
    assert (tmp_path / "pwned").exists()


def test_restore_checks_scaler_and_scheduler_presence(tmp_path):
    train("mlp", None, "bf16", steps=1, checkpoint_dir=tmp_path, **FAST)
    with pytest.raises(CheckpointError, match="no GradScaler state"):
        train("mlp", None, "bf16", steps=2, checkpoint_dir=tmp_path, resume=True, **FAST,
              scaler_kwargs={"enabled": True})
    with pytest.raises(CheckpointError, match="no scheduler state"):
        train("mlp", None, "bf16", steps=1, checkpoint_dir=tmp_path, resume=True, scheduler="cosine", **FAST)


def test_restore_refuses_an_fp16_scaler_state_into_a_disabled_scaler(tmp_path):
    """A bf16/fp32 scaler is disabled: loading an fp16 checkpoint into it used to drop the saved scale silently."""
    train("mlp", None, "fp16", steps=2, checkpoint_dir=tmp_path, **FAST)
    state = checkpoint.load(checkpoint.path_in(tmp_path))
    assert state["scaler"]["scale"] > 0
    model = models.make_model("mlp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    disabled = torch.amp.GradScaler("cpu", enabled=False)
    with pytest.raises(CheckpointError, match=r"holds a GradScaler state .*this scaler is disabled"):
        checkpoint.restore(state, model, opt, disabled)
    assert checkpoint.restore(state, model, opt, torch.amp.GradScaler("cpu")) == 2  # an enabled one takes it
    # dropping it on purpose, as the message says, restores into the disabled scaler
    assert checkpoint.restore({**state, "scaler": {}}, model, opt, disabled) == 2
    # train()'s own resume: the same precision still resumes
    h = train("mlp", None, "fp16", steps=3, checkpoint_dir=tmp_path, resume=True, **FAST)
    assert h.start_step == 2 and h.steps_done == 3


def test_rng_state_round_trip():
    state = checkpoint.rng_state()
    a = torch.rand(3)
    checkpoint.set_rng_state(state)
    assert torch.equal(torch.rand(3), a)


# --- integrity: a flipped bit is refused, never resumed from ----------------------------------------

def _members(path: Path) -> dict[str, tuple[int, int]]:
    """Each zip member's (start, length) of stored bytes in the file (torch stores them uncompressed)."""
    import zipfile

    out = {}
    with zipfile.ZipFile(path) as zf, open(path, "rb") as fh:
        for info in zf.infolist():
            fh.seek(info.header_offset + 26)
            name_len, extra_len = int.from_bytes(fh.read(2), "little"), int.from_bytes(fh.read(2), "little")
            out[info.filename] = (info.header_offset + 30 + name_len + extra_len, info.compress_size)
    return out


def test_a_flipped_bit_in_any_stored_piece_is_refused(tmp_path):
    """One bit flipped in each zip member in turn (every tensor, the pickle, the version record): CheckpointError."""
    path = _write_good(tmp_path)
    good = path.read_bytes()
    members = {k: v for k, v in _members(path).items() if v[1] > 0}
    assert sum("/data/" in k for k in members) >= 10, "the tensors are stored as separate members"
    rng = random.Random(0)
    for name, (start, length) in members.items():
        damaged = bytearray(good)
        damaged[start + rng.randrange(length)] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(damaged))
        with pytest.raises(CheckpointError, match="fails its CRC-32 check") as info:
            checkpoint.load(path)
        assert name in str(info.value) and "left untouched" in str(info.value)
    path.write_bytes(good)
    assert checkpoint.load(path)["step"] == 1


def test_a_flipped_bit_in_a_tensor_would_load_silently_without_the_check(tmp_path):
    """The control: torch.load itself does not look at the CRCs, so the damage would reach the model."""
    path = _write_good(tmp_path)
    name, (start, length) = next((k, v) for k, v in _members(path).items() if "/data/" in k and v[1] >= 64)
    damaged = bytearray(path.read_bytes())
    damaged[start + length // 2] ^= 0x10
    path.write_bytes(bytes(damaged))
    loaded = torch.load(path, weights_only=True)  # no error
    fresh = torch.load(_write_good(tmp_path / "again"), weights_only=True)
    differs = [k for k in loaded["model"] if not torch.equal(loaded["model"][k], fresh["model"][k])]
    differs += [k for k, v in loaded["optimizer"]["state"].items()
                if any(not torch.equal(t, fresh["optimizer"]["state"][k][n]) for n, t in v.items())]
    assert differs, "the flipped bit changed a stored tensor"


# --- numpy-typed settings ------------------------------------------------------------------------------

def test_numpy_typed_settings_write_a_checkpoint_that_resumes(tmp_path):
    np = pytest.importorskip("numpy")
    cfg = dict(lr=np.float64(1e-2), seed=np.int64(0), batch_size=np.int64(32), n_samples=np.int64(256), progress=False,
               grad_clip=np.float32(1.0), weight_decay=np.float64(0.0))
    whole = train("mlp", None, "fp16", steps=4, **{**cfg, "grad_clip": 1.0})
    train("mlp", None, "fp16", steps=np.int64(2), checkpoint_dir=tmp_path, checkpoint_every=np.int32(1), **cfg)
    state = checkpoint.load(checkpoint.path_in(tmp_path))  # weights_only=True: plain numbers only
    assert all(type(v) in (int, float, str) for v in state["config"].values())
    rest = train("mlp", None, "fp16", steps=4, checkpoint_dir=tmp_path, resume=True, **cfg)
    same_run(whole, rest)


def test_numpy_lr_inside_an_optimizer_of_your_own_is_saved_as_a_python_float(tmp_path):
    np = pytest.importorskip("numpy")

    def sgd(params, lr, weight_decay):
        return torch.optim.SGD(params, lr=np.float64(lr), momentum=np.float32(0.9))

    train("mlp", None, "fp32", steps=2, checkpoint_dir=tmp_path, optimizer=sgd, **FAST)
    group = checkpoint.load(checkpoint.path_in(tmp_path))["optimizer"]["param_groups"][0]
    assert type(group["lr"]) is float and type(group["momentum"]) is float
    train("mlp", None, "fp32", steps=3, checkpoint_dir=tmp_path, resume=True, optimizer=sgd, **FAST)


# --- impossible contents: refused before anything changes ----------------------------------------------

def _sgd_state(state):
    """The same checkpoint, with the optimizer state of an SGD (momentum) optimizer."""
    model = models.make_model("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 32)).sum().backward()
    opt.step()
    return {**state, "optimizer": opt.state_dict(), "config": {**state["config"], "optimizer": "SGD"}}


def _first_param_state(state, key, value):
    opt = {**state["optimizer"], "state": {**state["optimizer"]["state"]}}
    opt["state"][0] = {**opt["state"][0], key: value}
    return {**state, "optimizer": opt}


IMPOSSIBLE = {
    "optimizer None": (lambda s: {**s, "optimizer": None}, "optimizer state is missing"),
    "negative step": (lambda s: {**s, "step": -3}, "step must be an int >= 0"),
    "fractional step": (lambda s: {**s, "step": 1.5}, "step must be an int"),
    "RNG state of the wrong size": (lambda s: {**s, "rng": {"cpu": torch.zeros(10, dtype=torch.uint8), "cuda": None}},
                                    r"random-number state is \(10,\)"),
    "RNG state not a tensor": (lambda s: {**s, "rng": {"cpu": [1, 2], "cuda": None}}, "random-number state is list"),
    "no RNG state": (lambda s: {**s, "rng": None}, "random-number state"),
    "model tensor of another shape": (lambda s: {**s, "model": {**s["model"], "net.0.weight": torch.zeros(3, 3)}},
                                      r"'net.0.weight' has shape \(3, 3\)"),
    "model tensor missing": (lambda s: {**s, "model": {k: v for k, v in s["model"].items() if k != "net.0.bias"}},
                             r"missing \['net.0.bias'\]"),
    "model state not a dict": (lambda s: {**s, "model": [1, 2]}, "model state is a list"),
    "model tensor of another dtype": (lambda s: {**s, "model": {**s["model"], "net.0.bias": s["model"]["net.0.bias"].double()}},
                                      "'net.0.bias' is torch.float64 in the checkpoint, torch.float32 here"),
    "another optimizer (SGD into AdamW)": (_sgd_state, "written by a SGD optimizer, and this run uses AdamW"),
    "another optimizer, unnamed": (lambda s: {**_sgd_state(s), "config": {}}, r"lack \['amsgrad'"),
    "one parameter group too many": (lambda s: {**s, "optimizer": {**s["optimizer"], "param_groups":
                                     s["optimizer"]["param_groups"] * 2}}, "2 parameter groups, this one 1"),
    "optimizer moment of another shape": (lambda s: _first_param_state(s, "exp_avg", torch.zeros(7)),
                                          r"'exp_avg' of parameter 0 has shape \(7,\)"),
    "optimizer state for no parameter": (lambda s: {**s, "optimizer": {**s["optimizer"], "state":
                                         {**s["optimizer"]["state"], 99: {}}}}, "parameter 99, which no group holds"),
    "scaler scale nan": (lambda s: {**s, "scaler": {**s["scaler"], "scale": float("nan")}}, "GradScaler state is impossible"),
    "scaler counter negative": (lambda s: {**s, "scaler": {**s["scaler"], "_growth_tracker": -1}}, "_growth_tracker"),
    "scaler interval beyond int64": (lambda s: {**s, "scaler": {**s["scaler"], "growth_interval": 2**70}}, "growth_interval"),
    "history not lists": (lambda s: {**s, "history": {"loss": 3.0}}, r"history entries \['loss'\] are not lists"),
}


def _live(seed=5):
    """A model, optimizer and scaler as train() builds them, in a state of their own (to detect any change)."""
    torch.manual_seed(seed)
    model = models.make_model("mlp", seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    return model, opt, scaler


def _fingerprint(model, opt, scaler):
    return ([v.clone() for v in model.state_dict().values()],
            [(k, {n: (t.clone() if isinstance(t, torch.Tensor) else t) for n, t in v.items()})
             for k, v in opt.state_dict()["state"].items()], opt.state_dict()["param_groups"], scaler.state_dict(),
            torch.get_rng_state())


def _same_fingerprint(a, b):
    assert all(torch.equal(x, y) for x, y in zip(a[0], b[0]))
    assert [k for k, _ in a[1]] == [k for k, _ in b[1]]
    assert all(torch.equal(x[n], y[n]) if isinstance(x[n], torch.Tensor) else x[n] == y[n]
               for (_, x), (_, y) in zip(a[1], b[1]) for n in x)
    assert a[2:4] == b[2:4] and torch.equal(a[4], b[4])


@pytest.mark.parametrize("kind", IMPOSSIBLE)
def test_impossible_contents_are_refused_and_nothing_changes(kind, tmp_path):
    train("mlp", None, "fp16", steps=2, checkpoint_dir=tmp_path, **FAST)
    path = checkpoint.path_in(tmp_path)
    mutate, why = IMPOSSIBLE[kind]
    checkpoint.save(mutate(checkpoint.load(path)), path)
    state = checkpoint.load(path)  # well-formed: it loads; restoring it is what must fail
    model, opt, scaler = _live()
    before = _fingerprint(model, opt, scaler)
    with pytest.raises(CheckpointError, match=why):
        checkpoint.restore(state, model, opt, scaler, path=path)
    _same_fingerprint(before, _fingerprint(model, opt, scaler))
    # through train(): the caller's own model keeps its weights too
    own = models.make_model("mlp", seed=7)
    weights = [v.clone() for v in own.state_dict().values()]
    with pytest.raises(CheckpointError):
        train(own, models.make_dataset("mlp", n=256), "fp16", steps=3, checkpoint_dir=tmp_path, resume=True, **FAST)
    assert all(torch.equal(a, b) for a, b in zip(weights, own.state_dict().values()))


def test_resume_with_another_optimizer_is_refused_by_name(tmp_path):
    train("mlp", None, "fp32", steps=2, checkpoint_dir=tmp_path, optimizer="adamw", **FAST)
    with pytest.raises(CheckpointError, match="written by a AdamW optimizer, and this run uses SGD"):
        train("mlp", None, "fp32", steps=3, checkpoint_dir=tmp_path, resume=True, optimizer="sgd", **FAST)


def test_a_restore_that_fails_midway_puts_everything_back(tmp_path, monkeypatch):
    """Even an error that no check foresaw (here: inside the scaler's load) leaves model and optimizer as they were."""
    train("mlp", None, "fp16", steps=2, checkpoint_dir=tmp_path, **FAST)
    state = checkpoint.load(checkpoint.path_in(tmp_path))
    model, opt, scaler = _live()
    before = _fingerprint(model, opt, scaler)
    real_load, calls = scaler.load_state_dict, []

    def failing_once(sd):
        calls.append(sd)
        if len(calls) == 1:  # the restore's load fails; the roll-back's load works
            raise RuntimeError("disk on fire")
        real_load(sd)

    monkeypatch.setattr(scaler, "load_state_dict", failing_once)
    with pytest.raises(CheckpointError, match="disk on fire"):
        checkpoint.restore(state, model, opt, scaler)
    _same_fingerprint(before, _fingerprint(model, opt, scaler))


def test_save_turns_numpy_scalars_into_python_numbers(tmp_path):
    """A state built by hand with numpy numbers still loads with weights_only=True."""
    np = pytest.importorskip("numpy")
    path = tmp_path / "c.pt"
    checkpoint.save({"format": checkpoint.FORMAT, "lr": np.float64(0.5), "steps": [np.int64(3)],
                     "x": torch.arange(2)}, path)
    state = torch.load(path, weights_only=True)
    assert type(state["lr"]) is float and type(state["steps"][0]) is int and state["x"].tolist() == [0, 1]


def test_check_settings_serves_sharded_checkpoints_without_the_model(tmp_path):
    """FSDP2's meta file (no model tensors) is checked the same way before DCP loads any shard."""
    train("mlp", None, "fp16", steps=2, checkpoint_dir=tmp_path, **FAST)
    state = checkpoint.load(checkpoint.path_in(tmp_path))
    meta = {k: v for k, v in state.items() if k != "model"}
    model, opt, scaler = _live()
    assert checkpoint.check_settings(meta, opt, scaler) == 2
    for bad, why in [({"step": -1}, "step must be"), ({"scaler": {**meta["scaler"], "scale": -2.0}}, "GradScaler state"),
                     (_sgd_state(state), "written by a SGD optimizer")]:
        with pytest.raises(CheckpointError, match=why):
            checkpoint.check_settings({**meta, **bad}, opt, scaler)


# --- checkpoint.load with a map_location this machine lacks: the good file was blamed ------------------------

@pytest.mark.parametrize("where,says", [
    ("cuda:{n}", "CUDA device"),  # one past the last GPU (cuda:0 on a machine without one)
    ("foo", "is not a device"),
    (3.5, "map_location must be a device"),
])
def test_load_names_a_bad_map_location_not_the_file(tmp_path: Path, where, says) -> None:
    from ampcourse import checkpoint
    train("mlp", steps=1, checkpoint_dir=tmp_path, progress=False, precision="fp32")
    # before: CheckpointError "it is truncated or not a torch file (RuntimeError)": move a good file aside?
    with pytest.raises(ValueError, match=says) as caught:
        checkpoint.load(checkpoint.path_in(tmp_path),
                        map_location=where.format(n=torch.cuda.device_count()) if isinstance(where, str) else where)
    assert "truncated" not in str(caught.value)
    assert checkpoint.load(checkpoint.path_in(tmp_path), map_location=torch.device("cpu"))["step"] == 1


# --- checkpoint.save wrote files load() refuses, over the good checkpoint --------------------------------------

def _good_state():
    from ampcourse import checkpoint
    m = torch.nn.Linear(4, 2)
    return checkpoint.capture(1, m, torch.optim.AdamW(m.parameters()), torch.amp.GradScaler("cpu"))


class _Note:  # a user's own object in the config: weights_only=True cannot unpickle it
    pass


@pytest.mark.parametrize("bad,says", [
    (lambda s: {**s, "config": {"note": _Note()}}, r"state\['config'\]\['note'\] is a _Note"),
    (lambda s: {**s, "history": {"loss": [1.0, _Note()]}}, r"state\['history'\]\['loss'\]\[1\] is a _Note"),
    (lambda s: [1, 2], "save\\(\\) writes a checkpoint made by checkpoint.capture"),
])
def test_save_refuses_what_load_could_not_read_and_keeps_the_good_file(tmp_path: Path, bad, says) -> None:
    from ampcourse import checkpoint
    target = tmp_path / "checkpoint.pt"
    checkpoint.save(_good_state(), target)
    # before: save() succeeded, replacing the good checkpoint with one that load() refuses ("holds Python objects")
    with pytest.raises(checkpoint.CheckpointError, match=says):
        checkpoint.save(bad(_good_state()), target)
    assert checkpoint.load(target)["step"] == 1 and [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]


@pytest.mark.parametrize("pieces,says", [
    (lambda m, o, s: (None, o, s), "model must be a torch.nn"),
    (lambda m, o, s: (m, None, s), "optimizer must be a torch.optim"),
    (lambda m, o, s: (m, o, None), r"scaler must be .*GradScaler\(enabled=False\)"),
])
def test_capture_and_restore_name_a_missing_piece(pieces, says) -> None:
    from ampcourse import checkpoint
    m = torch.nn.Linear(4, 2)
    o = torch.optim.AdamW(m.parameters())
    s = torch.amp.GradScaler("cpu")
    state = checkpoint.capture(0, m, o, s)
    # before: AttributeError: 'NoneType' object has no attribute 'state_dict' / 'is_enabled'
    with pytest.raises(TypeError, match=says):
        checkpoint.capture(1, *pieces(m, o, s))
    with pytest.raises(TypeError, match=says):
        checkpoint.restore(state, *pieces(m, o, s))
    with pytest.raises(TypeError, match="history must be a dict"):
        checkpoint.capture(1, m, o, s, history=[1.0])
