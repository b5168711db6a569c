"""Sharded (FSDP2, DCP) checkpoints cannot lie either: every shard is CRC-checked, every damage is one CheckpointError.

Fast: FSDP2 on a one-process gloo group in this process (``distributed.single_process_group``), which writes and
reads the same DCP files a torchrun job does. The torchrun leg (one line from a 2-process job, no traceback) is
marked slow.
"""

from __future__ import annotations

import functools
import os
import stat
from pathlib import Path

import pytest
import torch

from ampcourse import checkpoint, distributed
from ampcourse.checkpoint import CheckpointError, checkpointers
from ampcourse.device import pick
from ampcourse.train import Parallel, state_checksum, train

SMALL = dict(n_samples=256, batch_size=32, progress=False, optimizer="sgd", lr=0.1)


def fsdp_run(directory: Path, steps: int, resume: bool = False):
    """train() with FSDP2 on a one-process group and sharded checkpoints in `directory`."""
    with distributed.single_process_group() as ctx:
        amp = pick("cpu", "fp32")
        wrap = functools.partial(distributed.wrap_model, strategy="fsdp", amp=amp, ctx=ctx)
        par = Parallel(wrap=wrap, checkpointer=checkpoint.ShardedCheckpointer(0), autocast=False)
        hist = train("mlp", None, "fp32", steps=steps, checkpoint_dir=directory, resume=resume, parallel=par, **SMALL)
        return state_checksum(hist.model), hist.steps_done


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    """A 2-step sharded checkpoint, written once for the module (copied by each test before it damages it)."""
    with distributed.single_process_group():
        problem = distributed.fsdp_problem("cpu")
    if problem:
        pytest.skip(problem)
    directory = tmp_path_factory.mktemp("sharded")
    fsdp_run(directory, 2)
    return directory


@pytest.fixture
def copy(written, tmp_path) -> Path:
    import shutil

    shutil.copytree(written, tmp_path / "run")
    return tmp_path / "run"


def step_folder(directory: Path) -> Path:
    return directory / "sharded" / "step-00000002"


def test_meta_lists_every_dcp_file_with_its_crc(copy):
    meta = checkpoint.ShardedCheckpointer().read(copy)
    folder = step_folder(copy)
    assert sorted(meta["files"]) == sorted(p.name for p in folder.iterdir() if p.name != "meta.pt")
    assert ".metadata" in meta["files"] and any(n.endswith(".distcp") for n in meta["files"])
    checkpointers.verify_shards(folder, meta["files"])  # the intact folder passes


def test_an_intact_sharded_checkpoint_still_resumes(copy, tmp_path):
    """The control: the check refuses nothing good (and the resume equals an uninterrupted run)."""
    resumed = fsdp_run(copy, 4, resume=True)
    whole = fsdp_run(tmp_path / "whole", 4)
    assert resumed == whole


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


DAMAGES = {
    "a flipped bit in a shard": (lambda f: _flip(f / "__0_0.distcp"), "fails its CRC-32 check"),
    "a flipped bit in .metadata": (lambda f: _flip(f / ".metadata"), "(CRC-32|unreadable or unsafe)"),
    "a truncated shard": (lambda f: (f / "__0_0.distcp").write_bytes((f / "__0_0.distcp").read_bytes()[:1000]),
                          "has 1000 bytes"),
    "an empty shard": (lambda f: (f / "__0_0.distcp").write_bytes(b""), "has 0 bytes"),
    "no .metadata": (lambda f: (f / ".metadata").unlink(), "'.metadata' is missing"),
    "no shard file": (lambda f: (f / "__0_0.distcp").unlink(), "'__0_0.distcp' is missing"),
    "no meta.pt": (lambda f: (f / "meta.pt").unlink(), "no checkpoint at"),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_every_damage_is_one_checkpoint_error(copy, damage):
    """Before: a flipped bit in a shard resumed silently from the damaged weight; a truncated, empty or missing file
    escaped as torch's CheckpointException (a BaseException in torch 2.13, missed by `except Exception`)."""
    hurt, said = DAMAGES[damage]
    hurt(step_folder(copy))
    with pytest.raises(CheckpointError, match=said):
        fsdp_run(copy, 4, resume=True)


def test_a_meta_without_checksums_is_refused(copy):
    """A meta.pt without the list of files (an older ampcourse) cannot be checked, so it is not resumed."""
    folder = step_folder(copy)
    meta = checkpoint.load(folder / "meta.pt", required=())
    del meta["files"]
    checkpoint.save(meta, folder / "meta.pt")
    with pytest.raises(CheckpointError, match="lists no checksums"):
        fsdp_run(copy, 4, resume=True)


def test_what_dcp_itself_raises_is_a_checkpoint_error_too(copy, monkeypatch):
    """Past the checksums (switched off here), DCP's CheckpointException (a BaseException) becomes one line."""
    assert not issubclass(checkpointers._checkpoint_exception(), Exception)  # why `except Exception` missed it
    monkeypatch.setattr(checkpointers, "verify_shards", lambda folder, files: None)
    shard = step_folder(copy) / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=r"DCP could not load it into this model \(rank 0: ") as info:
        fsdp_run(copy, 4, resume=True)
    assert "\n" not in str(info.value) and "Traceback" not in str(info.value)


# ---------------------------------------------------------------------------------------------
# Write then rename never replaces what is not a regular file
# ---------------------------------------------------------------------------------------------

def _state():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return checkpoint.capture(0, model, opt, torch.amp.GradScaler("cpu", enabled=False))


@pytest.mark.parametrize("writer", ["save", "latest pointer"])
def test_a_fifo_is_refused_not_replaced(tmp_path, writer):
    """Before: the temp file was renamed over the name, so a FIFO (or, as root, /dev/null) became a regular file."""
    fifo = tmp_path / "checkpoint.pt"
    os.mkfifo(fifo)
    with pytest.raises(CheckpointError, match="named pipe"):
        if writer == "save":
            checkpoint.save(_state(), fifo)
        else:
            checkpointers._replace_text(fifo, "step-00000001")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="making a device node needs root")
def test_a_device_node_is_refused_and_stays_a_device(tmp_path):
    """As root the rename would replace a device (the old code turned /dev/null into a regular file). A copy of
    /dev/null's node in tmp_path stands in for it: a regression must never damage the machine's own."""
    node = tmp_path / "null"
    os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    with pytest.raises(CheckpointError, match="character device"):
        checkpoint.save(_state(), node)
    assert stat.S_ISCHR(os.lstat(node).st_mode)


def test_a_symlink_is_written_through_and_stays_a_link(tmp_path):
    real = tmp_path / "real.pt"
    checkpoint.save(_state(), real)
    link = tmp_path / "link.pt"
    link.symlink_to(real)
    checkpoint.save(_state(), link)
    assert link.is_symlink() and checkpoint.load(link)["step"] == 0


@pytest.mark.slow
def test_a_damaged_shard_under_torchrun_is_one_line(tmp_path):
    """2 processes, FSDP2: a flipped bit in rank 1's shard; the resume exits 2 with one line, no traceback."""
    common = ["--model", "mlp", "--device", "cpu", "--global-batch-size", "32", "--samples", "256",
              "--no-progress", "--strategy", "fsdp", "--precision", "fp32", "--optimizer", "sgd", "--lr", "0.1",
              "--checkpoint-dir", "ckpt"]
    first = distributed.launch([*common, "--steps", "2"], cwd=tmp_path, timeout=120)
    if "--strategy fsdp cannot run here" in first.stderr:
        pytest.skip("this torch's gloo cannot run FSDP2")
    first.check()
    _flip(tmp_path / "ckpt" / "sharded" / "step-00000002" / "__1_0.distcp")
    again = distributed.launch([*common, "--steps", "4", "--resume"], cwd=tmp_path, timeout=120)
    assert again.returncode != 0
    ours = [line for line in again.stderr.splitlines() if line.startswith("ampcourse.train: error:")]
    assert len(ours) == 1 and "fails its CRC-32 check" in ours[0], again.stderr[-2000:]
    # torchrun's agent prints its own failure report (a traceback of torchrun itself); no worker prints one
    worker_frames = [line for line in again.stderr.splitlines()
                     if line.strip().startswith("File ") and ("ampcourse" in line or "distributed/checkpoint" in line)]
    assert not worker_frames, again.stderr[-2000:]


def test_a_damaged_zip_end_record_is_a_checkpoint_error(tmp_path):
    """zipfile.is_zipfile itself raised BadZipFile ("zipfiles that span multiple disks are not supported") for a
    flipped bit in the end record's disk number: it escaped load() (found by tests/test_faults.py's random flips)."""
    path = tmp_path / "checkpoint.pt"
    checkpoint.save(_state(), path)
    data = bytearray(path.read_bytes())
    locator = data.rfind(b"PK\x06\x07")  # the zip64 end-of-central-directory locator (torch writes zip64 records)
    assert locator > 0
    data[locator + 4] ^= 0x01  # the number of the disk that holds the zip64 record: now 1
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="truncated or not a torch file"):
        checkpoint.load(path)


# --- a damaged latest pointer: a CheckpointError, not a UnicodeDecodeError or IsADirectoryError ---------------

@pytest.mark.parametrize("damage", ["bytes", "folder"])
def test_sharded_latest_pointer_damage_is_a_checkpoint_error(tmp_path: Path, damage) -> None:
    from ampcourse import checkpoint
    pointer = checkpoint.ShardedCheckpointer().path(tmp_path)
    pointer.parent.mkdir(parents=True)
    if damage == "bytes":
        pointer.write_bytes(b"\xff\xfe\x00garbage")  # before: UnicodeDecodeError
    else:
        pointer.mkdir()  # before: IsADirectoryError, a traceback from the CLI
    with pytest.raises(checkpoint.CheckpointError, match="cannot resume from"):
        checkpoint.ShardedCheckpointer().read(tmp_path)
