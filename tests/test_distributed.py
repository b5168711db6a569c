"""ampcourse.distributed and the multi-process CLI, on CPU processes over gloo.

Fast tests check the plumbing in this process (torchrun's environment, device binding, the warning, the
command lines, the SLURM script, the memory model, refusing unsafe sharded checkpoints). Tests marked
slow start real torchrun jobs (2 CPU processes each, ~5-15 s): DDP and FSDP2 against one process,
overflow on one rank, checkpoints across world sizes, an elastic restart after SIGKILL, and two torchrun
agents acting as two nodes. Every launch has a hard timeout and kills its process group on expiry.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from ampcourse import checkpoint, distributed, models
from ampcourse.train import main, train

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "dist_worker.py"
TIMEOUT = 120  # seconds per torchrun launch; a healthy one takes 5-15 s here

# The settings every multi-process run shares. SGD makes "same result" mean rounding level: its update
# is lr * gradient, so a gradient that differs in its last bit moves a weight by far less than an ulp.
# (Adam divides by sqrt(v) + eps and so magnifies last-bit differences of near-zero gradients.)
COMMON = ["--model", "mlp", "--device", "cpu", "--global-batch-size", "32", "--samples", "256", "--seed", "0",
          "--no-progress"]
SGD = ["--optimizer", "sgd", "--lr", "0.1"]
IN_PROCESS = dict(seed=0, batch_size=32, n_samples=256, progress=False)


def run(tmp_path: Path, args: list[str], timeout: float = TIMEOUT, **kwargs) -> distributed.LaunchResult:
    """torchrun in tmp_path; fails the test with the output's tail unless it exits 0."""
    return distributed.launch(args, cwd=tmp_path, timeout=timeout, **kwargs).check()


def read_json(path: Path) -> dict:
    """A summary or history file."""
    return json.loads(path.read_text())


def assert_rounding_level(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], ulps: float = 4) -> float:
    """Every tensor within `ulps` fp32 ulps of its largest entry; returns the largest difference in those ulps."""
    worst = 0.0
    assert got.keys() == want.keys()
    for key in want:
        unit = torch.finfo(torch.float32).eps * want[key].abs().max().item()
        diff = (got[key].float() - want[key].float()).abs().max().item()
        worst = max(worst, diff / unit)
        assert diff <= ulps * unit, f"{key}: differs by {diff:.3g} = {diff / unit:.1f} ulps (allowed {ulps})"
    return worst


def dcp_model(folder: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    """The full model tensors of a sharded (DCP) checkpoint, read in this single process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / f"{folder.name}.pt"
    dcp_to_torch_save(folder, out)
    return torch.load(out, weights_only=True)["model"]


# ---------------------------------------------------------------------------------------------
# torchrun's environment, devices, the warning
# ---------------------------------------------------------------------------------------------

TORCHRUN_ENV = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
                "TORCHELASTIC_RUN_ID": "x", "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "1",
                "TORCHELASTIC_USE_AGENT_STORE": "True"}


def test_torchrun_env_is_read():
    env = distributed.torchrun_env(TORCHRUN_ENV)
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (1, 1, 4, 2)
    assert env.launched and env.use_agent_store and env.max_restarts == 1 and not env.is_main
    plain = distributed.torchrun_env({})
    assert not plain.launched and plain.world_size == 1 and plain.is_main


@pytest.mark.parametrize("bad,message", [({"RANK": "x"}, "RANK='x' is not an integer"),
                                         ({"RANK": "4"}, "RANK=4 and WORLD_SIZE=4 from the environment do not fit")])
def test_torchrun_env_garbage(bad, message):
    with pytest.raises(ValueError, match=message):
        distributed.torchrun_env(TORCHRUN_ENV | bad)


@pytest.mark.parametrize("change,warns", [({}, True), ({"TORCHELASTIC_MAX_RESTARTS": "0"}, False),
                                          ({"TORCHELASTIC_USE_AGENT_STORE": "False"}, False)])
def test_shared_store_warning(change, warns):
    message = distributed.shared_store_warning(distributed.torchrun_env(TORCHRUN_ENV | change))
    assert (message is not None) == warns
    if warns:
        assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in message and "pytorch/pytorch#135712" in message


def test_backend_by_device():
    assert distributed.backend_for("cuda") == "nccl" and distributed.backend_for("cpu") == "gloo"
    with pytest.raises(ValueError, match="cuda \\(NCCL\\) or cpu \\(gloo\\), not 'mps'"):
        distributed.backend_for("mps")


def fake_gpus(monkeypatch, count: int) -> None:
    """Pretend this machine has `count` CUDA devices (only the counting functions; nothing runs on them)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_worker_device_binds_local_rank(monkeypatch):
    env = distributed.torchrun_env(TORCHRUN_ENV)
    assert distributed.worker_device(env, "cpu") == "cpu"
    fake_gpus(monkeypatch, 2)
    assert distributed.worker_device(env, None) == distributed.worker_device(env, "cuda") == "cuda:1"
    with pytest.raises(ValueError, match="every worker uses cuda:LOCAL_RANK; pass --device cuda"):
        distributed.worker_device(env, "cuda:0")


def test_more_processes_than_gpus(monkeypatch):
    fake_gpus(monkeypatch, 1)
    with pytest.raises(ValueError, match="started 2 processes on this node .* has 1 CUDA device; use "
                                         "--nproc-per-node 1 or fewer"):
        distributed.worker_device(distributed.torchrun_env(TORCHRUN_ENV), "cuda")


def test_cuda_requested_without_cuda(monkeypatch):
    fake_gpus(monkeypatch, 0)
    with pytest.raises(ValueError, match="CUDA is not available; use --device cpu"):
        distributed.worker_device(distributed.torchrun_env(TORCHRUN_ENV), "cuda")
    with pytest.raises(ValueError, match="device 'cuda:1' requested"):  # as given, the index kept
        distributed.worker_device(distributed.torchrun_env(TORCHRUN_ENV), "cuda:1")


# --- the CLI refuses bad launches before any process group exists (one line, no traceback) ------

def as_worker(monkeypatch, **change) -> None:
    """Make this process look like rank 0 of a 2-process torchrun job."""
    for key, value in (TORCHRUN_ENV | {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                                       "TORCHELASTIC_MAX_RESTARTS": "0"} | change).items():
        monkeypatch.setenv(key, value)


def cli_error(capsys, argv) -> str:
    """The one line main(argv) printed to stderr before exiting 2 (the CLI's one error style)."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.startswith("ampcourse.train: error: ") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("flags,message", [
    (["--strategy", "single"], "--strategy single runs one process, but torchrun started WORLD_SIZE=2"),
    (["--strategy", "ddp", "--global-batch-size", "33"],
     "--global-batch-size 33 must divide by world size x accum steps = 2 x 1"),
    (["--strategy", "ddp", "--device", "cuda"], "CUDA is not available"),
    (["--strategy", "ddp", "--inject-inf", "2:0"], "there is no rank 2 in a world of 2"),
    (["--strategy", "ddp", "--resume", "--checkpoint-dir", "nowhere"],
     "there is no checkpoint at 'nowhere/checkpoint.pt'"),
])
def test_bad_launch_exits_with_one_line(flags, message, monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    as_worker(monkeypatch)
    monkeypatch.setattr(distributed, "init", lambda *a, **k: pytest.fail("started a process group"))
    assert message in cli_error(capsys, ["--model", "mlp", "--steps", "2", "--no-progress", *flags])


def test_nproc_larger_than_gpus_from_the_cli(monkeypatch, capsys):
    as_worker(monkeypatch)
    fake_gpus(monkeypatch, 1)
    monkeypatch.setattr(distributed, "init", lambda *a, **k: pytest.fail("started a process group"))
    assert re.match(r"^ampcourse.train: error: torchrun started 2 processes on this node \(--nproc-per-node\) but it "
                    r"has 1 CUDA device", cli_error(capsys, ["--strategy", "ddp", "--device", "cuda", "--steps", "1"]))


def test_other_ranks_exit_quietly(monkeypatch, capsys):
    """Every rank sees the same bad flag; only local rank 0 says so, the others exit with the same status, silently."""
    as_worker(monkeypatch, RANK="1", LOCAL_RANK="1")
    with pytest.raises(SystemExit) as info:
        main(["--strategy", "ddp", "--global-batch-size", "33"])
    assert info.value.code == 2 and capsys.readouterr().err == ""


def test_resume_across_checkpoint_kinds_is_refused(monkeypatch, tmp_path, capsys):
    train("mlp", None, "fp32", steps=1, checkpoint_dir=tmp_path, **IN_PROCESS)
    as_worker(monkeypatch)
    assert re.search("holds a single-file checkpoint .* --strategy fsdp resumes from a sharded",
                     cli_error(capsys, ["--strategy", "fsdp", "--device", "cpu", "--checkpoint-dir", str(tmp_path),
                                        "--resume"]))


# ---------------------------------------------------------------------------------------------
# Command lines, SLURM, memory model, unsafe checkpoints
# ---------------------------------------------------------------------------------------------

def test_torchrun_command_one_node():
    cmd = distributed.torchrun_command(["--strategy", "ddp"], nproc_per_node=4, max_restarts=1)
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    text = " ".join(cmd[3:])
    assert text == ("--standalone --nproc-per-node 4 --max-restarts 1 --local-addr 127.0.0.1 "
                    "-m ampcourse.train --strategy ddp")


def test_torchrun_command_many_nodes():
    cmd = distributed.torchrun_command(nnodes=2, nproc_per_node=8, rdzv_endpoint="node1:29500", rdzv_id="job7",
                                       local_addr=None, script="train.py")
    assert " ".join(cmd[3:]) == ("--nnodes 2 --rdzv-backend c10d --rdzv-endpoint node1:29500 --rdzv-id job7 "
                                 "--nproc-per-node 8 --max-restarts 0 train.py")
    with pytest.raises(ValueError, match="nnodes > 1 needs rdzv_endpoint"):
        distributed.torchrun_command(nnodes=2)
    with pytest.raises(ValueError, match="nproc_per_node must be an int >= 1"):
        distributed.torchrun_command(nproc_per_node=0)


def test_launch_environment_has_the_fix():
    env = distributed.launch_env()
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1" and env["OMP_NUM_THREADS"]
    assert distributed.launch_env({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"})[distributed.STORE_FIX_ENV] == "0"


@pytest.mark.parametrize("nodes,gpus", [(1, 1), (2, 4), (16, 8)])
def test_slurm_script_renders_and_parses(nodes, gpus, tmp_path):
    text = distributed.render_slurm(nodes, gpus, ["--strategy", "fsdp", "--checkpoint-dir", "/shared/my run"],
                                    job_name="amp-test", time_limit="02:00:00")
    assert f"#SBATCH --nodes={nodes}" in text and f"#SBATCH --gpus-per-node={gpus}" in text
    assert f"--nnodes {nodes}" in text and f"--nproc-per-node {gpus}" in text and "--rdzv-backend c10d" in text
    assert "srun" in text and "torchrun" in text and "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in text
    assert "'/shared/my run'" in text and "{{" not in text  # arguments are shell-quoted, every field filled
    script = tmp_path / "train.slurm"
    script.write_text(text)
    check = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stderr


def _run_slurm_script(text: str, tmp_path: Path, cpus_per_task: int, nodes: int = 2) -> list[str]:
    """Run a rendered batch script as SLURM would on the first node, with stub `scontrol` (listing `nodes` hosts) and
    `srun` first on PATH: returns the arguments srun was called with (one per line)."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "scontrol").write_text(f"#!/bin/sh\nseq 1 {nodes} | sed 's/^/node/'\n")
    (stubs / "srun").write_text(f'#!/bin/sh\nfor a in "$@"; do echo "$a"; done > {tmp_path / "srun.args"}\n')
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    script = tmp_path / "train.slurm"
    script.write_text(text)
    env = {"PATH": f"{stubs}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NUM_NODES": "2", "SLURM_CPUS_PER_TASK": str(cpus_per_task)}
    run = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    return (tmp_path / "srun.args").read_text().splitlines()


def test_slurm_script_gives_srun_the_cpus_per_task(tmp_path):
    """Since Slurm 22.05 srun no longer inherits sbatch's --cpus-per-task (nor reads SLURM_CPUS_PER_TASK): the
    script must pass it again, or the one task per node (torchrun and its workers) may get one CPU."""
    args = _run_slurm_script(distributed.render_slurm(2, 4, cpus_per_task=24), tmp_path, cpus_per_task=24)
    assert "#SBATCH --cpus-per-task=24" in distributed.render_slurm(2, 4, cpus_per_task=24)
    torchrun = args.index("torchrun")
    assert "--cpus-per-task=24" in args[:torchrun], args  # an srun option, before the command it runs
    assert args[torchrun + 1:torchrun + 3] == ["--nnodes", "2"] and "node1:29500" in args


def test_the_head_node_is_read_without_breaking_the_pipe_of_a_long_node_list(tmp_path):
    """`scontrol show hostnames ... | head -n 1` under `set -o pipefail`: head exits after one line, scontrol gets
    SIGPIPE on a long list, the pipeline exits 141 and `set -e` ends the job before torchrun starts (the 2-node
    stub hit it too, now and then: a flaky test on torch 2.15's leg). The script reads the whole list."""
    args = _run_slurm_script(distributed.render_slurm(2, 4), tmp_path, cpus_per_task=8, nodes=200_000)
    assert "node1:29500" in args


def test_bash_n_would_catch_a_broken_script(tmp_path):
    """The syntax check is not a formality: a damaged script fails it."""
    broken = tmp_path / "broken.slurm"
    broken.write_text(distributed.render_slurm(2, 4).replace("sed -n 1p)", "sed -n 1p"))
    assert subprocess.run(["bash", "-n", str(broken)], capture_output=True, timeout=30).returncode != 0


@pytest.mark.parametrize("kwargs,message", [(dict(nodes=0), "nodes must be an int >= 1"),
                                            (dict(gpus_per_node=1.5), "gpus_per_node must be an int"),
                                            (dict(job_name="a b; rm -rf"), "job_name"),
                                            (dict(time_limit="1h"), "time_limit")])
def test_slurm_refuses_bad_values(kwargs, message):
    args = dict(nodes=2, gpus_per_node=4) | kwargs
    nodes, gpus = args.pop("nodes"), args.pop("gpus_per_node")
    with pytest.raises(ValueError, match=message):
        distributed.render_slurm(nodes, gpus, **args)


def test_memory_model():
    ddp = distributed.memory_per_gpu(1_000_000, 8, "ddp")
    fsdp = distributed.memory_per_gpu(1_000_000, 8, "fsdp")
    assert ddp["total"] == 16_000_000 and fsdp["total"] == 2_000_000
    assert ddp["params"] == 4_000_000 and fsdp["adam_v"] == 500_000
    assert distributed.memory_per_gpu(10, 1, "fsdp")["total"] == distributed.memory_per_gpu(10, 1, "ddp")["total"]
    with pytest.raises(ValueError, match="unknown strategy 'zero'"):
        distributed.memory_per_gpu(10, 2, "zero")


def test_local_state_bytes_single_process():
    model = models.make_model("mlp")
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    n = sum(p.numel() for p in model.parameters())
    assert distributed.local_state_bytes(model, opt) == {"params": 4 * n, "grads": 4 * n, "optimizer": 8 * n,
                                                         "total": 16 * n}
    assert distributed.memory_per_gpu(n, 1, "ddp")["total"] == 16 * n


class Payload:
    """A 'metadata' file that would create a file when unpickled."""

    def __init__(self, target: Path):
        self.target = target

    def __reduce__(self):
        return (open, (str(self.target), "w"))


def test_unsafe_dcp_metadata_is_refused_before_it_runs(tmp_path):
    folder = tmp_path / "step-00000001"
    folder.mkdir()
    victim = tmp_path / "pwned"
    (folder / ".metadata").write_bytes(pickle.dumps(Payload(victim)))
    with pytest.raises(checkpoint.CheckpointError, match="global 'io.open' is not allowed|global 'builtins.open'"):
        checkpoint.checkpointers._safe_reader(folder).read_metadata()
    assert not victim.exists()


def test_sharded_pointer_must_name_a_step_folder(tmp_path):
    (tmp_path / "sharded").mkdir()
    (tmp_path / "sharded" / "latest").write_text("../../etc\n")
    with pytest.raises(checkpoint.CheckpointError, match="which is not a step folder"):
        checkpoint.ShardedCheckpointer().read(tmp_path)


def test_non_tensor_items_are_never_written():
    with pytest.raises(TypeError, match="non-tensor float at .optim.lr"):
        checkpoint.checkpointers._tensor_leaves_only({"model": {"w": torch.ones(1)}, "optim": {"lr": 0.1}})


def test_fsdp_problem_names_the_missing_collective(monkeypatch):
    """Where gloo lacks reduce-scatter (older torch), FSDP2 is refused with torch's own reason, not a crash."""
    import torch.distributed as dist

    with distributed.single_process_group():
        assert distributed.fsdp_problem("cpu") is None  # this torch can

        def missing(*args, **kwargs):
            raise RuntimeError("ProcessGroupGloo does not support reduce_scatter")

        monkeypatch.setattr(dist, "reduce_scatter_single", missing, raising=False)
        monkeypatch.setattr(dist, "reduce_scatter_tensor", missing)
        reason = distributed.fsdp_problem("cpu")
    assert reason.startswith("gloo in torch ") and reason.endswith(
        "has no reduce-scatter (ProcessGroupGloo does not support reduce_scatter)")


def test_single_process_group_is_torn_down_and_not_nested():
    import torch.distributed as dist

    with distributed.single_process_group() as ctx:
        assert dist.is_initialized() and ctx.world_size == 1 and ctx.backend == "gloo"
        with pytest.raises(RuntimeError, match="already running"):
            with distributed.single_process_group():
                pass
    assert not dist.is_initialized()


def test_launch_timeout_kills_the_whole_group(tmp_path):
    """A hung job: torchrun and its workers all go on timeout (none survives as an orphan)."""
    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text("import os, time\nopen(f'pid{os.environ[\"RANK\"]}', 'w').write(str(os.getpid()))\n"
                       "time.sleep(600)\n")
    with pytest.raises(distributed.LaunchTimeout, match="did not finish in 8 s"):
        distributed.launch([], script=sleeper, nproc_per_node=2, timeout=8, cwd=tmp_path)
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in (0, 1) if (tmp_path / f"pid{r}").exists()]
    assert pids, "the workers never started: raise the timeout"
    time.sleep(0.5)
    for pid in pids:
        assert not running(pid), f"worker {pid} survived the timeout"


def running(pid: int) -> bool:
    """The process exists and is not a zombie waiting to be reaped."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


# ---------------------------------------------------------------------------------------------
# Real torchrun jobs: DDP
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ddp_sgd(tmp_path_factory):
    """One DDP job on 2 CPU processes: fp32, SGD, 8 steps, checkpoint at the end, every rank's history."""
    tmp = tmp_path_factory.mktemp("ddp")
    result = run(tmp, [*COMMON, *SGD, "--strategy", "ddp", "--precision", "fp32", "--steps", "8",
                       "--checkpoint-dir", "ckpt", "--out", "summary.json", "--history-out", "history.json"])
    return tmp, result


@pytest.mark.slow
def test_ddp_two_processes_match_one(ddp_sgd):
    """Same global batch and seed: N=2 ends at the weights of N=1 to within 4 ulps (measured: < 1 ulp).

    The only difference is the order of the gradient sum: N=1 averages 32 per-sample gradients in one
    reduction; N=2 averages 16 on each rank, all-reduces the sums (gloo) and divides by 2. In fp32 that
    changes a gradient in its last bits, and SGD moves a weight by lr times that: below one ulp of the
    weights, per step. A real bug (a rank training on the wrong slice, gradients summed instead of
    averaged, a missing all-reduce) changes weights by orders of magnitude more.
    """
    tmp, result = ddp_sgd
    summary = read_json(tmp / "summary.json")
    assert summary | {"final_loss": None, "checksum": None} == {
        "world_size": 2, "backend": "gloo", "device_type": "cpu", "precision": "fp32", "steps_done": 8,
        "skipped_steps": 0, "final_loss": None, "final_loss_scale": 1.0, "checksum": None, "strategy": "ddp",
        "model": "mlp", "seed": 0, "global_batch_size": 32, "resumed_from_step": 0}
    one = train("mlp", None, "fp32", steps=8, optimizer="sgd", lr=0.1, **IN_PROCESS)
    two = checkpoint.load(checkpoint.path_in(tmp / "ckpt"))["model"]
    assert_rounding_level(two, one.model.state_dict())
    assert summary["final_loss"] == pytest.approx(one.final_loss, rel=1e-6)  # mean of the two ranks' halves
    # rank-0 logging: one summary line, not one per rank
    assert result.stdout.count("ampcourse.train: 8 steps on 2 processes") == 1


@pytest.mark.slow
def test_ddp_rounding_tolerance_would_catch_a_wrong_slice(ddp_sgd):
    """The 4-ulp tolerance is tight: training on a different batch order misses it by far."""
    tmp, _ = ddp_sgd
    other = train("mlp", None, "fp32", steps=8, optimizer="sgd", lr=0.1, **IN_PROCESS | {"seed": 1})
    two = checkpoint.load(checkpoint.path_in(tmp / "ckpt"))["model"]
    other_state = {k: v for k, v in other.model.state_dict().items()}
    with pytest.raises(AssertionError, match="ulps"):
        assert_rounding_level(two, other_state)


@pytest.mark.slow
def test_ddp_replicas_and_history(ddp_sgd):
    tmp, _ = ddp_sgd
    history = read_json(tmp / "history.json")
    ranks = history["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and history["world_size"] == 2
    assert ranks[0]["replica_checksum"] == ranks[1]["replica_checksum"] == read_json(tmp / "summary.json")["checksum"]
    assert ranks[0]["loss"] != ranks[1]["loss"]  # each rank's loss is over its own half of the batch
    n = sum(p.numel() for p in models.make_model("mlp").parameters())
    for r in ranks:  # SGD without momentum keeps no state: weights and gradients, whole, on every rank
        assert r["state_bytes"] == {"params": 4 * n, "grads": 4 * n, "optimizer": 0, "total": 8 * n}


@pytest.mark.slow
def test_ddp_checkpoint_from_two_processes_resumes_on_one(ddp_sgd, tmp_path):
    """Rank 0 saved a plain state dict: a single process continues it as if it had trained all along."""
    tmp, _ = ddp_sgd
    import shutil

    shutil.copytree(tmp / "ckpt", tmp_path / "ckpt")
    resumed = train("mlp", None, "fp32", steps=12, optimizer="sgd", lr=0.1, checkpoint_dir=tmp_path / "ckpt",
                    resume=True, **IN_PROCESS)
    whole = train("mlp", None, "fp32", steps=12, optimizer="sgd", lr=0.1, **IN_PROCESS)
    assert resumed.start_step == 8 and resumed.steps_done == 12
    assert_rounding_level(resumed.model.state_dict(), whole.model.state_dict())


@pytest.mark.slow
def test_ddp_resumes_a_single_process_checkpoint(tmp_path):
    """The reverse: one process trains 4 steps, a 2-process DDP job continues to 8."""
    ckpt = tmp_path / "ckpt"
    train("mlp", None, "fp32", steps=4, optimizer="sgd", lr=0.1, checkpoint_dir=ckpt, **IN_PROCESS)
    run(tmp_path, [*COMMON, *SGD, "--strategy", "ddp", "--precision", "fp32", "--steps", "8",
                   "--checkpoint-dir", "ckpt", "--resume", "--out", "summary.json"])
    summary = read_json(tmp_path / "summary.json")
    assert summary["resumed_from_step"] == 4 and summary["steps_done"] == 8 and summary["world_size"] == 2
    whole = train("mlp", None, "fp32", steps=8, optimizer="sgd", lr=0.1, **IN_PROCESS)
    assert_rounding_level(checkpoint.load(checkpoint.path_in(ckpt))["model"], whole.model.state_dict())


@pytest.mark.slow
def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    """Rank 1's gradients turn inf in step 2 (before DDP's all-reduce): both ranks skip it, alike.

    DDP all-reduces during backward, so the inf reaches every rank's gradient before any rank's
    GradScaler looks for it: unscale_ finds it everywhere, every rank skips, every rank halves its scale.
    """
    run(tmp_path, [*COMMON, "--strategy", "ddp", "--precision", "fp16", "--steps", "5", "--inject-inf", "1:2",
                   "--out", "summary.json", "--history-out", "history.json"])
    ranks = read_json(tmp_path / "history.json")["ranks"]
    for r in ranks:
        assert r["skipped"] == [False, False, True, False, False]
        assert r["scale"] == [65536.0, 65536.0, 65536.0, 32768.0, 32768.0]
        assert r["final_scale"] == 32768.0
    assert ranks[0]["replica_checksum"] == ranks[1]["replica_checksum"]  # identical weights after the skip
    summary = read_json(tmp_path / "summary.json")
    assert summary["skipped_steps"] == 1 and summary["final_loss_scale"] == 32768.0
    assert all(torch.isfinite(torch.tensor(r["loss"])).all() for r in ranks)  # nothing inf reached the weights


@pytest.mark.slow
def test_bad_flag_under_torchrun_prints_one_line(tmp_path):
    """All ranks reject the flag before any process group; the user sees one line from the workers."""
    launched = distributed.launch([*COMMON, "--strategy", "ddp", "--global-batch-size", "33", "--steps", "2"],
                                  cwd=tmp_path, timeout=TIMEOUT)
    assert launched.returncode != 0
    worker_lines = [line for line in launched.stderr.splitlines() if line.startswith("ampcourse.train:")]
    assert worker_lines == ["ampcourse.train: error: --global-batch-size 33 must divide by world size x accum steps "
                            "= 2 x 1, so every rank gets the same number of samples"]
    assert "[rank0]" not in launched.stderr and "[rank1]" not in launched.stderr  # no worker traceback


# ---------------------------------------------------------------------------------------------
# Real torchrun jobs: FSDP2 with sharded checkpoints
# ---------------------------------------------------------------------------------------------

def skip_if_fsdp_unsupported(result: distributed.LaunchResult) -> None:
    """Skip (with torch's reason) where this torch's gloo lacks reduce-scatter; the CLI says so in one line."""
    if "--strategy fsdp cannot run here" in result.stderr:
        pytest.skip(next(line for line in result.stderr.splitlines() if "cannot run here" in line))


@pytest.fixture(scope="module")
def fsdp_fp32(tmp_path_factory):
    """FSDP2 on 2 CPU processes: fp32, SGD, 4 steps, sharded checkpoint every 2 steps."""
    tmp = tmp_path_factory.mktemp("fsdp")
    result = distributed.launch([*COMMON, *SGD, "--strategy", "fsdp", "--precision", "fp32", "--steps", "4",
                                 "--checkpoint-dir", "ckpt", "--checkpoint-every", "2", "--out", "summary.json",
                                 "--history-out", "history.json"], cwd=tmp, timeout=TIMEOUT)
    return tmp, result


@pytest.mark.slow
def test_fsdp_two_processes_match_one(fsdp_fp32, tmp_path):
    tmp, result = fsdp_fp32
    skip_if_fsdp_unsupported(result)
    result.check()
    one = train("mlp", None, "fp32", steps=4, optimizer="sgd", lr=0.1, **IN_PROCESS)
    root = tmp / "ckpt" / "sharded"
    assert (root / "latest").read_text().strip() == "step-00000004"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000004"]  # step 2 was superseded
    shards = sorted(p.name for p in (root / "step-00000004").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]  # one shard file per rank
    assert_rounding_level(dcp_model(root / "step-00000004", tmp_path), one.model.state_dict())
    summary = read_json(tmp / "summary.json")
    assert summary["strategy"] == "fsdp" and summary["world_size"] == 2
    # each rank holds half of the weights, gradients and Adam-free SGD state (the checksum gathers them)
    n = sum(p.numel() for p in models.make_model("mlp").parameters())
    for r in read_json(tmp / "history.json")["ranks"]:
        assert r["state_bytes"]["params"] == pytest.approx(4 * n / 2, rel=0.02)  # up to shard padding
        assert r["state_bytes"]["grads"] == r["state_bytes"]["params"]


@pytest.mark.slow
def test_fsdp_checkpoint_reshards_from_two_processes_to_one(fsdp_fp32, tmp_path):
    """DCP reshards on load: a 2-rank FSDP2 checkpoint resumes under 1 rank and lands where 1 process would."""
    tmp, result = fsdp_fp32
    skip_if_fsdp_unsupported(result)
    import shutil

    shutil.copytree(tmp / "ckpt", tmp_path / "ckpt")
    launched = distributed.launch([*COMMON, *SGD, "--strategy", "fsdp", "--precision", "fp32", "--steps", "6",
                                   "--checkpoint-dir", "ckpt", "--resume", "--out", "summary.json"],
                                  nproc_per_node=1, cwd=tmp_path, timeout=TIMEOUT).check()
    assert "6 steps on 1 process" in launched.stdout
    summary = read_json(tmp_path / "summary.json")
    assert summary["resumed_from_step"] == 4 and summary["world_size"] == 1
    whole = train("mlp", None, "fp32", steps=6, optimizer="sgd", lr=0.1, **IN_PROCESS)
    assert_rounding_level(dcp_model(tmp_path / "ckpt" / "sharded" / "step-00000006", tmp_path),
                          whole.model.state_dict())


@pytest.mark.slow
def test_fsdp_fp16_one_shard_overflows_after_reduce_scatter(tmp_path):
    """FSDP2 in fp16 (MixedPrecisionPolicy), resumed on 2 ranks from a 1-rank checkpoint (resharding 1 -> 2).

    After the reduce-scatter each rank holds only its shard of the gradient, so an inf in rank 1's shard
    is invisible to rank 0's own check. The GradScaler still skips on both ranks, because unscale_ on
    DTensor gradients all-reduces the found-inf flag (MAX) across the mesh. The model is the transformer
    (one FSDP unit per block), trained with AdamW so the optimizer state is resharded too.
    """
    args = [*COMMON[:1], "transformer", *COMMON[2:], "--strategy", "fsdp", "--precision", "fp16"]
    first = distributed.launch([*args, "--steps", "3", "--checkpoint-dir", "ckpt"], nproc_per_node=1, cwd=tmp_path,
                               timeout=TIMEOUT)
    skip_if_fsdp_unsupported(first)
    first.check()
    run(tmp_path, [*args, "--steps", "7", "--checkpoint-dir", "ckpt", "--resume", "--out", "summary.json",
                   "--history-out", "history.json"], script=WORKER,
        env={"AMPCOURSE_TEST_SHARD_INF": "1:1"})  # this launch's step 1 = global step 4
    ranks = read_json(tmp_path / "history.json")["ranks"]
    for r in ranks:
        assert r["skipped"] == [False] * 4 + [True] + [False] * 2
        assert r["scale"][3:] == [65536.0, 65536.0, 32768.0, 32768.0] and r["final_scale"] == 32768.0
    summary = read_json(tmp_path / "summary.json")
    assert summary["resumed_from_step"] == 3 and summary["skipped_steps"] == 1 and summary["precision"] == "fp16"
    assert summary["final_loss"] < ranks[0]["loss"][0]  # and it trains


# ---------------------------------------------------------------------------------------------
# Elastic restart and multi-node on one machine
# ---------------------------------------------------------------------------------------------

ELASTIC = [*COMMON, "--strategy", "ddp", "--precision", "fp16", "--steps", "10", "--checkpoint-every", "3",
           "--out", "summary.json"]


@pytest.mark.slow
def test_elastic_restart_after_sigkill_resumes_and_matches(tmp_path):
    """torchrun --max-restarts 1; rank 1 SIGKILLs itself in step 5; the job restarts, resumes from step 3's
    checkpoint and ends bit-identical to an uninterrupted run (AdamW + GradScaler state restored).

    Both launches keep torchrun as the launcher. The uninterrupted one runs without the store fix, so it
    must print ampcourse's warning; the faulty one has TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (what
    distributed.launch sets) and must not.
    """
    (tmp_path / "whole").mkdir()
    (tmp_path / "fault").mkdir()
    whole = run(tmp_path / "whole", [*ELASTIC, "--checkpoint-dir", "ckpt"], script=WORKER,
                max_restarts=1, env={distributed.STORE_FIX_ENV: "0"})
    assert whole.stderr.count("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1") == 1  # the warning, once (rank 0)
    fault = run(tmp_path / "fault", [*ELASTIC, "--checkpoint-dir", "ckpt"], script=WORKER,
                max_restarts=1, env={"AMPCOURSE_TEST_KILL": "1:5"}, timeout=180)
    assert "exitcode: -9" in fault.stderr  # the SIGKILL really happened, and torchrun saw it
    assert "torchrun restart 1: resuming from the last checkpoint" in fault.stderr
    assert "ampcourse.train: warning" not in fault.stderr
    a, b = read_json(tmp_path / "whole" / "summary.json"), read_json(tmp_path / "fault" / "summary.json")
    assert b["resumed_from_step"] == 3 and b["steps_done"] == 10
    assert a["checksum"] == b["checksum"] and a["final_loss"] == b["final_loss"]
    assert a["final_loss_scale"] == b["final_loss_scale"]


# --- the rendezvous listens on loopback only, for a one-node job (the course's default) ---------------------------

def listening_sockets(pids: set[int]) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state that one of `pids` holds open (from /proc)."""
    import ipaddress

    inodes: set[str] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if link.startswith("socket:["):
                        inodes.add(link[8:-1])
    found = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for row in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
                fields = row.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    hex_addr, hex_port = fields[1].split(":")
                    raw = bytes.fromhex(hex_addr)  # 32-bit words in host (little-endian) order
                    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                    found.add((str(ipaddress.ip_address(raw)), int(hex_port, 16)))
    return found


def test_listening_sockets_reads_proc():
    """The helper itself: a socket bound to 127.0.0.1 and one bound to every address are told apart."""
    import socket

    with socket.socket() as lo, socket.socket() as anywhere:
        lo.bind(("127.0.0.1", 0))
        anywhere.bind(("0.0.0.0", 0))
        lo.listen()
        anywhere.listen()
        seen = listening_sockets({os.getpid()})
        assert ("127.0.0.1", lo.getsockname()[1]) in seen and ("0.0.0.0", anywhere.getsockname()[1]) in seen


def test_is_loopback():
    assert distributed.is_loopback("127.0.0.1") and distributed.is_loopback("127.1.2.3")
    assert distributed.is_loopback("::1") and distributed.is_loopback("localhost")
    assert not any(map(distributed.is_loopback, ["0.0.0.0", "10.0.0.7", "node1", "", "::"]))


def test_init_hosts_the_store_on_loopback_only(monkeypatch):
    """torchrun --local-addr 127.0.0.1 sets MASTER_ADDR=127.0.0.1, but env://'s TCPStore listened on every address
    (*:PORT in ss); rank 0's store from distributed.init listens on 127.0.0.1 only."""
    port = distributed.free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    env = distributed.TorchrunEnv(rank=0, world_size=1, launched=True)
    distributed.init("cpu", env, timeout_s=30, rendezvous_timeout_s=30)
    try:
        store_sockets = {s for s in listening_sockets({os.getpid()}) if s[1] == port}
        assert dist_get_rank() == 0
    finally:
        distributed.teardown()
    assert store_sockets == {("127.0.0.1", port)}, store_sockets


def dist_get_rank() -> int:
    """The rank of this process in the default group."""
    import torch.distributed as dist

    return dist.get_rank()


def test_rendezvous_store_elsewhere_is_env_rendezvous(monkeypatch):
    """Another MASTER_ADDR (several nodes must reach it) or the agent's shared store: env://'s store, as before."""
    calls = []

    def rendezvous(url, rank, world_size, timeout):
        calls.append(url)
        yield "env-store", rank, world_size

    monkeypatch.setattr(distributed.dist, "rendezvous", rendezvous)
    timeout = __import__("datetime").timedelta(seconds=5)
    node = distributed.TorchrunEnv(rank=0, world_size=2, launched=True)
    assert distributed.rendezvous_store(node, timeout, {"MASTER_ADDR": "node1", "MASTER_PORT": "29500"}) == "env-store"
    shared = distributed.TorchrunEnv(rank=0, world_size=2, launched=True, use_agent_store=True)
    assert distributed.rendezvous_store(shared, timeout, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}) \
        == "env-store"
    assert calls == ["env://", "env://"]


def test_launch_meets_through_a_private_file_on_one_node():
    cmd = distributed.torchrun_command(["--strategy", "ddp"], rdzv_file="/tmp/x/rdzv")
    assert "--standalone" not in cmd and cmd[cmd.index("--rdzv-conf") + 1] == "store_type=file"
    assert cmd[cmd.index("--rdzv-endpoint") + 1] == "/tmp/x/rdzv"
    with pytest.raises(ValueError, match="one-node rendezvous"):
        distributed.torchrun_command(nnodes=2, rdzv_endpoint="node1:29500", rdzv_file="/tmp/x/rdzv")


@pytest.mark.slow
def test_a_launched_job_listens_on_loopback_only(tmp_path):
    """Every listening socket of a one-node launch (torchrun's agent, the workers' store, gloo) is on loopback.

    Before: torchrun --standalone's own rendezvous TCPStore and rank 0's env:// TCPStore both listened on every
    address (*:PORT) although the job runs with --local-addr 127.0.0.1. The job's processes are those whose
    working directory is this test's folder.
    """
    with sockets_of_job_in(tmp_path) as seen:
        run(tmp_path, [*COMMON, *SGD, "--strategy", "ddp", "--precision", "fp32", "--steps", "30"])
    assert seen, "no listening socket of the job was seen: the watcher is broken"
    assert all(distributed.is_loopback(addr) for addr, _ in seen), sorted(seen)


@contextlib.contextmanager
def sockets_of_job_in(folder: Path):
    """The set, filled while inside, of every listening socket of the processes whose working directory is `folder`
    (a job started there: torchrun's agent and its workers), polled every 0.1 s."""
    import threading

    seen: set[tuple[str, int]] = set()
    done = threading.Event()

    def watch():
        while not done.is_set():
            pids = set()
            for entry in os.listdir("/proc"):
                with contextlib.suppress(OSError):
                    if entry.isdigit() and os.readlink(f"/proc/{entry}/cwd") == str(folder):
                        pids.add(int(entry))
            seen.update(listening_sockets(pids))
            done.wait(0.1)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        yield seen
    finally:
        done.set()
        watcher.join()


@pytest.mark.slow
def test_two_nodes_on_one_machine_match_one_node(ddp_sgd, tmp_path):
    """Two torchrun agents (--nnodes 2, c10d rendezvous on 127.0.0.1), one process each = 2 processes on one node."""
    tmp, _ = ddp_sgd
    port = distributed.free_port()
    args = [*COMMON, *SGD, "--strategy", "ddp", "--precision", "fp32", "--steps", "8", "--out", "summary.json"]
    with ThreadPoolExecutor(2) as pool:
        agents = [pool.submit(distributed.launch, args, nnodes=2, nproc_per_node=1, cwd=tmp_path, timeout=TIMEOUT,
                              rdzv_endpoint=f"127.0.0.1:{port}", rdzv_id="test-two-nodes") for _ in range(2)]
        results = [a.result() for a in agents]
    for r in results:
        r.check()
    summary = read_json(tmp_path / "summary.json")  # written by global rank 0, on whichever agent it landed
    assert summary["world_size"] == 2
    assert summary["checksum"] == read_json(tmp / "summary.json")["checksum"]  # bit-identical


# ---------------------------------------------------------------------------------------------
# The documented launch commands
# ---------------------------------------------------------------------------------------------

def readme_commands() -> list[str]:
    """The shell commands in README.md's torchrun section, continuation lines joined."""
    text = (ROOT / "README.md").read_text()
    section = text.split("### Several processes, GPUs and nodes (torchrun)", 1)[1].split("```bash", 1)[1]
    block = section.split("```", 1)[0].replace("\\\n", " ")
    return [" ".join(line.split()) for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_every_documented_torchrun_has_the_store_fix():
    commands = readme_commands()
    torchruns = [c for c in commands if "torchrun" in c]
    assert len(torchruns) == 3  # N processes, CPU, M nodes
    assert all("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun" in c for c in torchruns)
    assert any(c.startswith("python -m ampcourse.train") for c in commands)  # 1 process
    assert any("render_slurm" in c for c in commands) and "sbatch train.slurm" in commands
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun" in " ".join(distributed.__doc__.replace("\\\n", " ").split())


def test_as_shell():
    cmd = distributed.torchrun_command(["--strategy", "ddp", "--checkpoint-dir", "my run"])
    assert distributed.as_shell(cmd) == ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node 2 "
                                         "--max-restarts 0 --local-addr 127.0.0.1 -m ampcourse.train --strategy ddp "
                                         "--checkpoint-dir 'my run'")


def test_readme_slurm_command_writes_a_valid_script(tmp_path):
    command = next(c for c in readme_commands() if "render_slurm" in c).replace("python ", f"{sys.executable} ", 1)
    run_ = subprocess.run(["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert run_.returncode == 0, run_.stderr
    assert subprocess.run(["bash", "-n", "train.slurm"], cwd=tmp_path, timeout=30).returncode == 0
    assert "--nnodes 2" in (tmp_path / "train.slurm").read_text()


@pytest.mark.slow
def test_readme_cpu_command_runs_as_written(tmp_path):
    """The README's CPU launch, typed into bash as it stands (torchrun from the virtual environment): it runs, and
    every port it opens is on loopback (a laptop on a café's network, a shared Binder host)."""
    command = next(c for c in readme_commands() if "--device cpu" in c)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    with sockets_of_job_in(tmp_path) as seen:
        proc = subprocess.Popen(["bash", "-c", command], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=env, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            distributed._kill_group(proc)  # bash, torchrun and the workers
            raise
    assert proc.returncode == 0, err[-3000:]
    assert seen and all(distributed.is_loopback(addr) for addr, _ in seen), sorted(seen)
    summary = json.loads(out[out.index("{"):])  # rank 0 prints the summary (no --out)
    assert summary["world_size"] == 2 and summary["backend"] == "gloo" and summary["steps_done"] == 200


# --- the rendezvous and the collectives have separate bounds (issue 19, part 2, item 14) -----------------------

def test_rendezvous_and_collectives_have_separate_timeouts(monkeypatch):
    """--dist-timeout bounds each collective; --rdzv-timeout bounds reaching the store, which a cold node needs longer.

    init_process_group(timeout=30) alone also bounded the rendezvous by 30 s: a node whose last worker starts later
    than that failed before training began.
    """
    import datetime

    seen = {}

    class Store:
        def set_timeout(self, timeout):
            seen["store timeout after setup"] = timeout

    store = Store()

    def rendezvous(url, rank, world_size, timeout):
        seen["rendezvous"] = (url, rank, world_size, timeout)
        yield store, rank, world_size

    def init_process_group(**kwargs):
        seen["init"] = kwargs

    monkeypatch.setattr(distributed.dist, "rendezvous", rendezvous)
    monkeypatch.setattr(distributed.dist, "init_process_group", init_process_group)
    env = distributed.TorchrunEnv(rank=1, local_rank=1, world_size=2, local_world_size=2, launched=True)
    ctx = distributed.init("cpu", env, timeout_s=30, rendezvous_timeout_s=600)
    assert seen["rendezvous"] == ("env://", 1, 2, datetime.timedelta(seconds=600))
    assert seen["init"] == {"backend": "gloo", "timeout": datetime.timedelta(seconds=30), "store": store,
                            "rank": 1, "world_size": 2}
    assert seen["store timeout after setup"] == datetime.timedelta(seconds=30)  # a dead rank is noticed in 30 s
    assert ctx.backend == "gloo" and ctx.rank == 1
    distributed.init("cpu", env)  # the defaults: the rendezvous bound is not the collectives' 300 s
    assert seen["rendezvous"][3] == datetime.timedelta(seconds=distributed.DEFAULT_RENDEZVOUS_TIMEOUT_S) > \
        seen["init"]["timeout"] == datetime.timedelta(seconds=distributed.DEFAULT_TIMEOUT_S)


def test_the_cli_passes_both_timeouts(monkeypatch, capsys):
    as_worker(monkeypatch)
    got = {}

    def init(device, env, timeout_s, rendezvous_timeout_s):
        got.update(timeout_s=timeout_s, rendezvous_timeout_s=rendezvous_timeout_s)
        raise ValueError("stop here")

    monkeypatch.setattr(distributed, "init", init)
    assert "stop here" in cli_error(capsys, ["--strategy", "ddp", "--device", "cpu", "--dist-timeout", "30",
                                             "--rdzv-timeout", "1200"])
    assert got == {"timeout_s": 30.0, "rendezvous_timeout_s": 1200.0}
    assert "--rdzv-timeout must be a number of seconds > 0" in cli_error(
        capsys, ["--strategy", "ddp", "--device", "cpu", "--rdzv-timeout", "0"])


def test_chapter_7_says_where_the_ddp_bound_was_measured():
    """Exercise 7.7 promised 4-GPU vs 1-GPU fp32+SGD runs of the transformer within 4 fp32 ulps over 200 steps; the
    bound is test_ddp_two_processes_match_one's: 2 CPU processes (gloo), the MLP, 8 steps. The exercise says so and
    asks the learner to measure the GPU gap."""
    import nbformat

    cells = nbformat.read(ROOT / "chapters" / "07_multi_gpu.ipynb", as_version=4).cells
    text = " ".join(next(c.source for c in cells if "**7.7**" in c.source).split())
    assert "they agree to within 4 fp32 ulps" not in text
    assert "measured with 2 CPU processes (gloo) against 1, on the MLP, for 8 SGD steps" in text
    assert "is for you to measure" in text and "tests/test_distributed.py" in text
    listens = " ".join(next(c.source for c in cells if "**Where the job listens.**" in c.source).split())
    assert "store_type=file" in listens and "listens on every address" in listens
