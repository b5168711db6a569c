"""python -m ampcourse.train: a run writes its JSON summary; resume works; bad flags exit with one line."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ampcourse import train as train_mod
from ampcourse.device import pick
from ampcourse.train import cli, main, state_checksum, train
from clirun import run_cli

BASE = ["--model", "mlp", "--steps", "3", "--global-batch-size", "32", "--samples", "256", "--no-progress"]
SUMMARY_KEYS = {"world_size", "backend", "device_type", "precision", "steps_done", "skipped_steps", "final_loss",
                "final_loss_scale", "checksum", "strategy", "model", "seed", "global_batch_size", "resumed_from_step"}


def test_module_runs_and_writes_a_summary(tmp_path):
    """The real entry point, as a learner types it (one subprocess: importing torch takes seconds)."""
    out = tmp_path / "summary.json"
    run = subprocess.run([sys.executable, "-m", "ampcourse.train", *BASE, "--precision", "fp16", "--out", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "3 steps" in run.stdout and "summary in" in run.stdout
    summary = json.loads(out.read_text())
    assert set(summary) == SUMMARY_KEYS
    assert summary | {"final_loss": None, "checksum": None} == {
        "world_size": 1, "backend": "none", "device_type": "cpu", "precision": "fp16", "steps_done": 3,
        "skipped_steps": 0, "final_loss": None, "final_loss_scale": 65536.0, "checksum": None, "strategy": "single",
        "model": "mlp", "seed": 0, "global_batch_size": 32, "resumed_from_step": 0}
    # the same run from Python gives the same weights
    h = train("mlp", None, "fp16", steps=3, lr=1e-3, seed=0, batch_size=32, n_samples=256, progress=False)
    assert summary["checksum"] == state_checksum(h.model) and summary["final_loss"] == h.final_loss


def test_summary_to_stdout(capsys):
    assert main([*BASE, "--precision", "bf16"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["precision"] == "bf16" and summary["final_loss_scale"] == 1.0 and summary["steps_done"] == 3


def test_default_precision_is_the_devices(capsys):
    main(BASE)
    # pick()'s default: bf16 on a CPU with bf16 units, fp32 on one without (an Intel Xeon with AVX512 but no
    # AVX512-BF16 is one)
    assert json.loads(capsys.readouterr().out)["precision"] == pick("cpu").precision


def test_resume_from_the_command_line(tmp_path, capsys):
    ckpt = str(tmp_path / "run")
    main([*BASE, "--precision", "fp16", "--checkpoint-dir", ckpt, "--checkpoint-every", "1"])
    capsys.readouterr()
    main([*BASE[:2], "--steps", "5", *BASE[4:], "--precision", "fp16", "--checkpoint-dir", ckpt, "--resume"])
    resumed = json.loads(capsys.readouterr().out)
    main([*BASE[:2], "--steps", "5", *BASE[4:], "--precision", "fp16"])
    whole = json.loads(capsys.readouterr().out)
    assert resumed["resumed_from_step"] == 3 and resumed["steps_done"] == 5
    assert resumed["checksum"] == whole["checksum"] and resumed["final_loss"] == whole["final_loss"]


@pytest.mark.parametrize("flags,message", [
    (["--precision", "fp64"], "--precision: unknown precision 'fp64'; choose from fp32, fp16, bf16"),
    (["--strategy", "zero3"], "argument --strategy: invalid choice: 'zero3'"),
    (["--model", "resnet"], "argument --model: invalid choice: 'resnet'"),
    (["--steps", "ten"], "argument --steps: invalid int value: 'ten'"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_argparse_rejects_bad_flags(flags, message, capsys):
    with pytest.raises(SystemExit) as info:
        main([*BASE, *flags])
    assert info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("flags,message", [
    (["--steps", "0"], "steps must be an int >= 1"),
    (["--lr", "nan"], "lr must be a finite number > 0"),
    (["--lr", "-1"], "lr must be a finite number > 0"),
    (["--accum-steps", "0"], "--accum-steps must be an int >= 1"),
    (["--global-batch-size", "1000"], "larger than the dataset (256 samples)"),
    (["--global-batch-size", "30", "--accum-steps", "4"], "must divide by world size x accum steps = 1 x 4"),
    (["--device", "cuda"], "CUDA is not available"),
    (["--resume"], "--resume needs a --checkpoint-dir"),
    (["--checkpoint-every", "2"], "--checkpoint-every needs a --checkpoint-dir"),
    (["--out", "no/such/folder/s.json"], "its folder does not exist"),
    (["--history-out", "no/such/folder/h.json"], "cannot write --history-out"),
    (["--strategy", "ddp"], "--strategy ddp runs under torchrun: torchrun --standalone --nproc-per-node N"),
    (["--strategy", "fsdp"], "--strategy fsdp runs under torchrun"),
    (["--dist-timeout", "0"], "--dist-timeout must be a number of seconds > 0"),
])
def test_bad_values_exit_with_one_line(flags, message, monkeypatch, capsys):
    monkeypatch.setattr(train_mod.loop, "train_step", lambda *a, **k: pytest.fail("trained despite a bad flag"))
    text = cli_error(capsys, [*BASE, *flags])
    assert message in text


def cli_error(capsys, argv) -> str:
    """The one line main(argv) printed before exiting 2: the CLI's single error style, argparse's errors included."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2, info.value.code
    assert err.startswith("ampcourse.train: error: ") and err.count("\n") == 1, err
    return err


def test_one_error_style_for_argparse_and_for_the_checks(capsys):
    assert "argument --steps: invalid int value: 'ten' (see --help)" in cli_error(capsys, [*BASE, "--steps", "ten"])
    assert "steps must be an int >= 1, got 0" in cli_error(capsys, [*BASE, "--steps", "0"])


def test_resume_with_no_checkpoint(tmp_path, capsys):
    assert re.search("no checkpoint at .*run once without resume",
                     cli_error(capsys, [*BASE, "--checkpoint-dir", str(tmp_path), "--resume"]))


def test_corrupt_checkpoint_exits_with_one_line_and_no_traceback(tmp_path):
    (tmp_path / "checkpoint.pt").write_bytes(b"\x00" * 100)
    run = subprocess.run([sys.executable, "-m", "ampcourse.train", *BASE, "--checkpoint-dir", str(tmp_path),
                          "--resume"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.startswith("ampcourse.train: error: cannot resume from") and "Traceback" not in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1
    assert (tmp_path / "checkpoint.pt").read_bytes() == b"\x00" * 100


def test_docstring_has_the_launch_commands():
    doc = " ".join(train_mod.__doc__.replace("\\\n", " ").split())  # join continued lines
    assert "python -m ampcourse.train --model mlp --precision bf16" in doc
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node N -m ampcourse.train" in doc
    assert "torchrun --nnodes M --nproc-per-node N --rdzv-backend c10d --rdzv-endpoint HOST:29500" in doc
    assert ("--rdzv-conf store_type=file --local-addr 127.0.0.1 -m ampcourse.train --strategy ddp --device cpu"
            in doc)  # the CPU line opens no port beyond loopback, as README's
    assert "render_slurm" in doc


def test_an_output_the_disk_refuses_is_one_line(tmp_path, capsys):
    """/dev/full opens and refuses data (ENOSPC): the pre-check's probe byte finds it before any training, one line,
    exit 2, no traceback (a disk that fills during the run: test_a_file_size_limit_in_the_cli_is_one_line)."""
    if not Path("/dev/full").exists():
        pytest.skip("/dev/full is Linux's")
    err = cli_error(capsys, [*BASE, "--out", "/dev/full"])
    assert "cannot write --out '/dev/full': No space left on device" in err


# --- defects an independent tester hit in the CLI; each test failed before its fix (its comment says how) -----

def test_train_cli_huge_lr_is_one_line_exit_2() -> None:
    code, err = run_cli(cli.main, ["--steps", "1", "--lr", "1e39", "--no-progress"])
    assert code == 2 and err.startswith("ampcourse.train: error: --lr must be") and err.count("\n") == 1


@pytest.mark.parametrize("argv,says", [
    (["--steps", "0"], "error: --steps must be an int >= 1"),  # was "steps must be"
    (["--global-batch-size", "2048"], "error: --global-batch-size 2048 is larger than the dataset"),  # "batch_size"
    (["--samples", "0"], "error: --samples must be a positive int"),  # "n_samples"
    (["--resume"], "error: --resume needs a --checkpoint-dir"),  # "resume and checkpoint_every need a checkpoint_dir"
])
def test_train_cli_errors_name_the_flags(argv, says) -> None:
    code, err = run_cli(cli.main, ["--no-progress", *argv])
    assert code == 2 and says in err, err


def test_train_cli_existing_checkpoint_says_add_resume(tmp_path: Path) -> None:
    base = ["--no-progress", "--steps", "1", "--checkpoint-dir", str(tmp_path)]
    assert run_cli(cli.main, base)[0] == 0
    code, err = run_cli(cli.main, base)
    # before: "... pass resume=True to continue that run, or choose an empty checkpoint_dir" (Python names)
    assert code == 2 and "pass --resume to continue that run, or choose an empty --checkpoint-dir" in err, err


def test_train_cli_refuses_one_file_for_summary_and_history(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    # before: the history was written, then the summary overwrote it: exit 0, history lost
    code, err = run_cli(cli.main, ["--no-progress", "--steps", "1", "--out", "r.json", "--history-out", "./r.json"])
    assert code == 2 and "--out and --history-out name the same file" in err
    assert list(tmp_path.iterdir()) == []


def test_train_cli_ctrl_c_is_one_line_and_keeps_the_last_checkpoint(tmp_path: Path, monkeypatch) -> None:
    from ampcourse import checkpoint
    from ampcourse.train import loop
    real, calls = loop.train_step, []

    def interrupted_at_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, "train_step", interrupted_at_third)
    argv = ["--no-progress", "--steps", "5", "--checkpoint-every", "2", "--checkpoint-dir", str(tmp_path)]
    # before: a KeyboardInterrupt traceback from inside train()
    code, err = run_cli(cli.main, argv)
    assert code == 130 and err.count("\n") == 1 and "add --resume to the same command" in err, err
    assert checkpoint.load(checkpoint.path_in(tmp_path))["step"] == 2  # the step-2 checkpoint survived


@pytest.mark.parametrize("argv,says", [
    (["--fused", "--optimizer", "sgd"], "--fused applies to --optimizer adam and adamw only"),  # was ignored, exit 0
    (["--inject-inf", "0:5"], "this launch runs at most --steps 2 steps"),  # never fired, exit 0
])
def test_train_cli_refuses_flags_that_would_do_nothing(argv, says, monkeypatch) -> None:
    from ampcourse.train import loop
    monkeypatch.setattr(loop, "train_step", lambda *a, **k: pytest.fail("trained despite a flag that does nothing"))
    code, err = run_cli(cli.main, ["--no-progress", "--steps", "2", *argv])
    assert code == 2 and says in err, err


def test_train_cli_flag_names_leave_prose_and_double_names_alone() -> None:
    text = "move it aside or point checkpoint_dir / --checkpoint-dir at another directory; the steps of the first run"
    assert cli._as_flags(text) == ("move it aside or point --checkpoint-dir at another directory; "
                                   "the steps of the first run")
