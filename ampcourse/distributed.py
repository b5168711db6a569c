"""Run the course's AMP loop on several processes: torchrun's environment, DDP, FSDP2, sharded checkpoints (chapter 7).

torchrun (``torch.distributed.run``) is the launcher; this module only reads what torchrun hands each
worker, sets up the process group and wraps the model. Launch commands (`--help` lists every flag)::

    # 1 process: no torchrun needed
    python -m ampcourse.train --model mlp --precision bf16 --steps 200
    # N processes on one node (one per GPU; on a CPU-only machine the same runs N CPU processes over gloo)
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node N \\
        -m ampcourse.train --strategy ddp --precision fp16 --steps 200
    # M nodes: run this on every node (HOST = the first node)
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes M --nproc-per-node N --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29500 --rdzv-id myjob --max-restarts 1 -m ampcourse.train --strategy fsdp ...

Why ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: it gives every restart round a fresh TCPStore, so a
restarted job does not read the dead round's peer addresses (pytorch/pytorch#135712); with
``--max-restarts 0`` it changes nothing. :func:`launch` sets it (and builds the command line) for the
notebook and the tests; :func:`render_slurm` writes a SLURM batch script that does the same per node.

What lives here, and why:

- :func:`torchrun_env` reads RANK, LOCAL_RANK, WORLD_SIZE, ... (what torchrun sets for each worker).
- :func:`worker_device` binds a worker to ``cuda:LOCAL_RANK`` (or the CPU) and refuses more workers than
  GPUs; :func:`init` starts the process group (NCCL on CUDA, gloo on CPU) with two bounds: one for the
  rendezvous (every worker reaching the store; a cold node can take minutes), one for each collective.
- :func:`wrap_model` wraps for ``ddp`` (DistributedDataParallel) or ``fsdp`` (FSDP2's ``fully_shard``
  with a :func:`mixed_precision_policy`); the training loop itself stays in ``ampcourse.train``.
- FSDP2 runs save and restore with ``ampcourse.checkpoint.ShardedCheckpointer`` (``torch.distributed.checkpoint``,
  which reshards on load, so a run saved on N ranks resumes on M); the name is re-exported here.
- :func:`memory_per_gpu` is the bytes-per-GPU model chapter 7 checks against live runs.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import re
import shlex
import signal
import socket
import subprocess
import tempfile
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from . import _args, _proctree, models
from .device import AmpSetup

__all__ = ["STORE_FIX_ENV", "UPSTREAM_ISSUE", "TorchrunEnv", "Context", "torchrun_env", "backend_for",
           "worker_device", "shared_store_warning", "is_loopback", "rendezvous_store", "init", "teardown", "exit_worker", "single_process_group", "wrap_model",
           "mixed_precision_policy", "fsdp_problem", "gather", "local_state_bytes",
           "memory_per_gpu", "torchrun_command", "as_shell", "launch", "launch_env", "LaunchResult", "LaunchTimeout", "LaunchInterrupted",
           "render_slurm", "free_port"]

#: The environment variable that makes every torchrun restart round use a fresh TCPStore.
STORE_FIX_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
#: Where the stale-store restart failure is tracked upstream.
UPSTREAM_ISSUE = "pytorch/pytorch#135712"
#: Default bound on every collective (a rank that died must not hang the rest).
DEFAULT_TIMEOUT_S = 300.0
#: Default bound on the rendezvous (every worker reaching the store): separate from the collectives' bound, because
#: a cold node (8 GPUs initialising, a slow shared filesystem importing torch) can take minutes before its first
#: worker connects, while a collective that takes that long means a dead rank. torchrun's own join timeout is 900 s.
DEFAULT_RENDEZVOUS_TIMEOUT_S = 900.0


# ---------------------------------------------------------------------------------------------
# What torchrun tells each worker
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TorchrunEnv:
    """The variables torchrun sets for every worker (defaults: one process, no torchrun)."""

    rank: int = 0  # global rank, 0..world_size-1
    local_rank: int = 0  # rank on this node: which GPU to use
    world_size: int = 1
    local_world_size: int = 1  # workers on this node (torchrun --nproc-per-node)
    restart_count: int = 0  # how many times torchrun restarted the workers (elastic restarts)
    max_restarts: int = 0  # torchrun --max-restarts
    use_agent_store: bool = False  # workers share the agent's TCPStore (torch >= 2.4 default)
    launched: bool = False  # running under torchrun at all

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that logs, writes the summary and single-file checkpoints."""
        return self.rank == 0


def _int_env(environ: Mapping[str, str], name: str, default: int) -> int:
    """An integer environment variable, with a clear error if torchrun's value is garbage."""
    raw = environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def torchrun_env(environ: Mapping[str, str] | None = None) -> TorchrunEnv:
    """Read torchrun's per-worker variables (os.environ by default)."""
    env = os.environ if environ is None else environ
    launched = "TORCHELASTIC_RUN_ID" in env or ("RANK" in env and "WORLD_SIZE" in env and "LOCAL_RANK" in env)
    world = _int_env(env, "WORLD_SIZE", 1)
    rank = _int_env(env, "RANK", 0)
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"RANK={rank} and WORLD_SIZE={world} from the environment do not fit together")
    return TorchrunEnv(
        rank=rank, local_rank=_int_env(env, "LOCAL_RANK", 0), world_size=world,
        local_world_size=_int_env(env, "LOCAL_WORLD_SIZE", 1),
        restart_count=_int_env(env, "TORCHELASTIC_RESTART_COUNT", 0),
        max_restarts=_int_env(env, "TORCHELASTIC_MAX_RESTARTS", 0),
        use_agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
        launched=launched,
    )


def shared_store_warning(env: TorchrunEnv) -> str | None:
    """The warning for elastic restarts over torchrun's shared TCPStore, or None if it does not apply."""
    if not (env.launched and env.max_restarts > 0 and env.use_agent_store):
        return None
    return (f"torchrun --max-restarts {env.max_restarts} with the workers sharing the agent's TCPStore "
            f"(TORCHELASTIC_USE_AGENT_STORE=True): after a failure the restarted round can read the dead round's "
            f"peer addresses and fail with 'Connection refused' ({UPSTREAM_ISSUE}). Launch torchrun with "
            f"{STORE_FIX_ENV}=1 in its environment to give every round a fresh store.")


def backend_for(device_type: str) -> str:
    """NCCL for CUDA devices, gloo for the CPU."""
    if device_type == "cuda":
        return "nccl"
    if device_type == "cpu":
        return "gloo"
    raise ValueError(f"multi-process training runs on cuda (NCCL) or cpu (gloo), not {device_type!r}; "
                     "pass --device cpu or cuda")


def worker_device(env: TorchrunEnv, device: str | None) -> str:
    """The device this worker trains on: cuda:LOCAL_RANK on a GPU node, else cpu; ValueError if impossible."""
    if device is None or device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {device!r}; under torchrun use 'cuda' or 'cpu'") from None
    if dev.type == "cpu":
        return "cpu"
    if dev.type != "cuda":
        backend_for(dev.type)  # raises with the explanation
    if not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available; use --device cpu")
    if dev.index is not None and env.world_size > 1:
        raise ValueError(f"--device {device}: under torchrun every worker uses cuda:LOCAL_RANK; pass --device cuda")
    count = torch.cuda.device_count()
    if env.local_world_size > count:
        raise ValueError(f"torchrun started {env.local_world_size} processes on this node (--nproc-per-node) but it "
                         f"has {count} CUDA device{'s' if count != 1 else ''}; use --nproc-per-node {count} or fewer")
    return f"cuda:{env.local_rank}"


# ---------------------------------------------------------------------------------------------
# Process group
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Context:
    """A started process group: who we are and where we compute."""

    env: TorchrunEnv
    backend: str
    device: torch.device

    @property
    def rank(self) -> int:
        """Global rank."""
        return self.env.rank

    @property
    def world_size(self) -> int:
        """Number of workers in the job."""
        return self.env.world_size


def is_loopback(host: str) -> bool:
    """Whether `host` is this machine's loopback interface: ``localhost`` or an address in 127.0.0.0/8 or ::1.

    Args:
        host: a host name or an IP address, as in MASTER_ADDR.

    Example::

        >>> is_loopback("127.0.0.1"), is_loopback("::1"), is_loopback("localhost"), is_loopback("10.0.0.7")
        (True, True, True, False)
    """
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost: it may resolve to any interface
        return False


def rendezvous_store(env: TorchrunEnv, timeout: datetime.timedelta,
                     environ: Mapping[str, str] | None = None) -> dist.Store:
    """The store the workers meet at (env://'s TCPStore at MASTER_ADDR:MASTER_PORT, hosted by rank 0), listening on
    loopback only when MASTER_ADDR is a loopback address.

    Why not ``dist.rendezvous("env://")``: its TCPStore server listens on every address of the machine whatever
    MASTER_ADDR says (seen with ``ss -ltnp`` in torch 2.13: ``*:PORT`` under ``torchrun --local-addr 127.0.0.1``),
    so anyone on the network could read and write the keys the workers exchange. TCPStore has no bind address, but
    takes ``master_listen_fd``, a socket already bound: rank 0 binds one to MASTER_ADDR:MASTER_PORT and hands it over.
    With another MASTER_ADDR (several nodes must reach it), or when the workers share the agent's store
    (TORCHELASTIC_USE_AGENT_STORE=True: torchrun without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1; that store is the
    agent's, not ours), this is env://'s store.

    Args:
        env: this worker's torchrun variables (rank, world size, whether the agent's store is shared).
        timeout: how long to wait for every worker to reach the store.
        environ: where MASTER_ADDR and MASTER_PORT are read (os.environ by default).

    Example (in a torchrun worker)::

        store = rendezvous_store(torchrun_env(), datetime.timedelta(minutes=15))
        dist.init_process_group("gloo", store=store, rank=env.rank, world_size=env.world_size)
    """
    environ = os.environ if environ is None else environ
    addr, port = environ.get("MASTER_ADDR", ""), environ.get("MASTER_PORT", "")
    if env.use_agent_store or not port.isdigit() or not is_loopback(addr):
        return next(dist.rendezvous("env://", env.rank, env.world_size, timeout=timeout))[0]
    fd = None
    if env.rank == 0:
        host = "127.0.0.1" if addr == "localhost" else addr
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            # as TCPStore's own server does: a port that torchrun just probed may still be in TIME_WAIT
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, int(port)))
            sock.listen(socket.SOMAXCONN)
        except OSError:
            sock.close()
            raise
        # The store owns the socket from here and closes it when it goes (so it is not closed here, even if the
        # store fails: by then the number may belong to another file).
        fd = sock.detach()
    return dist.TCPStore(addr, int(port), env.world_size, is_master=env.rank == 0, timeout=timeout,
                         master_listen_fd=fd)


def init(device: str, env: TorchrunEnv | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
         rendezvous_timeout_s: float = DEFAULT_RENDEZVOUS_TIMEOUT_S) -> Context:
    """Start the default process group from torchrun's variables (NCCL on CUDA, gloo on CPU), bounded in time.

    Two bounds: `rendezvous_timeout_s` for reaching the store and setting up the group (every worker must
    have started), `timeout_s` for every collective afterwards. init_process_group(timeout=) alone would
    apply one number to both, so a bound tight enough to catch a dead rank in seconds would fail a cold
    node's start.
    """
    env = env or torchrun_env()
    if not env.launched:
        raise ValueError("--strategy ddp/fsdp needs several processes started by torchrun, e.g. "
                         "torchrun --standalone --nproc-per-node 2 -m ampcourse.train --strategy ddp ...")
    timeout_s = _args.real(timeout_s, "timeout_s", positive=True, what="a finite number of seconds > 0")
    rendezvous_timeout_s = _args.real(rendezvous_timeout_s, "rendezvous_timeout_s", positive=True,
                                      what="a finite number of seconds > 0")
    dev = torch.device(device)
    backend = backend_for(dev.type)
    # The env:// rendezvous init_process_group would do, but with its own bound (and on loopback only when every
    # worker is on this machine); the store keeps that bound for the group's setup (gloo's full mesh, NCCL's unique
    # id with device_id), the collectives get timeout_s.
    store = rendezvous_store(env, datetime.timedelta(seconds=rendezvous_timeout_s))
    kwargs: dict[str, Any] = {"backend": backend, "timeout": datetime.timedelta(seconds=timeout_s),
                              "store": store, "rank": env.rank, "world_size": env.world_size}
    if dev.type == "cuda":
        torch.cuda.set_device(dev)  # before NCCL starts: each process talks to its own GPU
        kwargs["device_id"] = dev
    dist.init_process_group(**kwargs)
    # Set up: from here on the store serves the collectives (gloo and NCCL exchange through it, lazily too), so it
    # gets their bound, as init_process_group(timeout=) would have given it: a rank that died is noticed in timeout_s.
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    return Context(env=env, backend=backend, device=dev)


def teardown(barrier: bool = False) -> None:
    """Destroy the process group if one is up (safe to call twice); barrier=True waits for every rank first."""
    if dist.is_available() and dist.is_initialized():
        if barrier:
            dist.barrier()  # no rank shuts down its side while another is still in a collective
        dist.destroy_process_group()


def exit_worker(code: int) -> None:
    """End a torchrun worker: flush stdout/stderr, then os._exit(code) without interpreter finalization.

    destroy_process_group() does not free a process group that DDP's reducer or FSDP2's DTensors still
    reference; its gloo threads and the TCPStore (hosted by worker rank 0 with the restart fix) then go
    down during interpreter finalization, where we saw a worker abort ("terminate called without an
    active exception", exit code -6) or hang after finishing its work, a few times in our test runs
    under load (pytorch/pytorch#179291 describes the same finalization hazard). Everything that must
    survive is written before this point (summary, history, fsynced checkpoints). Outside torchrun
    this is plain sys.exit.
    """
    if not torchrun_env().launched:
        sys.exit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@contextlib.contextmanager
def single_process_group(device: str = "cpu"):
    """A one-process gloo group over an in-memory store (no sockets, no torchrun): to look inside DDP and FSDP2
    from a notebook. Yields a Context; the group is destroyed on exit."""
    if dist.is_initialized():
        raise RuntimeError("a process group is already running in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield Context(env=TorchrunEnv(), backend="gloo", device=torch.device(device))
    finally:
        dist.destroy_process_group()


def gather(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank (a collective; [obj] without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# ---------------------------------------------------------------------------------------------
# Wrapping the model
# ---------------------------------------------------------------------------------------------

def mixed_precision_policy(amp: AmpSetup, root: bool = True):
    """FSDP2's per-module precision: compute in the AMP dtype, reduce gradients in fp32 (and, at the root, return fp32).

    param_dtype: the all-gathered weights, and so the module's forward and backward, in fp16/bf16 (None for
    fp32: no cast). reduce_dtype fp32: gradients are summed across ranks in fp32, as DDP sums fp32
    gradients. output_dtype fp32 only for the root module: the loss (cross_entropy) then runs on fp32
    logits, as autocast would arrange, while inner units hand low-precision activations to each other.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=amp.amp_dtype, reduce_dtype=torch.float32,
                                output_dtype=torch.float32 if root else None)


def fsdp_problem(device_type: str) -> str | None:
    """Why FSDP2 cannot run here (None if it can): fully_shard missing, or gloo without reduce-scatter.

    Needs a process group on CPU: it tries one tiny reduce-scatter, the collective FSDP2 needs.
    """
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        del MixedPrecisionPolicy, fully_shard  # only checking that they exist
    except ImportError as err:
        return f"torch {torch.__version__} has no FSDP2 (fully_shard): {err}"
    if device_type != "cpu":
        return None
    world = dist.get_world_size()
    out = torch.zeros(1)
    # reduce_scatter_single is the newer name (torch >= 2.12 deprecates reduce_scatter_tensor)
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    try:
        reduce_scatter(out, torch.ones(world))
    except (RuntimeError, NotImplementedError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return f"gloo in torch {torch.__version__} has no reduce-scatter ({first})"
    return None


def wrap_model(module: nn.Module, strategy: str, amp: AmpSetup, ctx: Context) -> nn.Module:
    """DDP(module) for 'ddp'; for 'fsdp', fully_shard each transformer block and then the root (in place)."""
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(module, device_ids=[amp.device.index] if amp.device_type == "cuda" else None)
    if strategy == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(amp.device_type, (ctx.world_size,))
        # One FSDP unit per transformer block: only one block's full weights exist at a time. The MLP and
        # CNN are small enough to be a single unit (the root).
        for sub in module.modules():
            if isinstance(sub, models.Block):
                fully_shard(sub, mesh=mesh, mp_policy=mixed_precision_policy(amp, root=False))
        fully_shard(module, mesh=mesh, mp_policy=mixed_precision_policy(amp, root=True))
        return module
    raise ValueError(f"unknown strategy {strategy!r}; choose ddp or fsdp")


# ---------------------------------------------------------------------------------------------
# Memory per GPU
# ---------------------------------------------------------------------------------------------

#: Bytes per parameter for each piece of training state under AMP with AdamW (weights stay fp32).
STATE_BYTES = {"params": 4, "grads": 4, "adam_m": 4, "adam_v": 4}


def memory_per_gpu(n_params: int, world_size: int, strategy: str) -> dict[str, float]:
    """Bytes per GPU of weights, gradients and AdamW state under AMP (activations and buffers not included).

    AMP keeps weights, gradients and both Adam moments in fp32: 16 bytes per parameter. DDP holds all of
    it on every GPU; FSDP2 (full sharding) holds 1/world_size of each. The low-precision copies (autocast's
    cached weight casts under DDP, FSDP2's all-gathered unit) are transient and listed separately:
    DDP's autocast copy is the whole model, FSDP2's is one unit at a time (here: the whole model, an upper
    bound for a single-unit model).
    """
    n_params = _args.integer(n_params, "n_params", low=0)  # numpy and 0-d tensor ints too
    world_size = _args.integer(world_size, "world_size", low=1)
    if strategy not in ("ddp", "fsdp"):
        raise ValueError(f"unknown strategy {strategy!r}; choose ddp or fsdp")
    share = 1.0 if strategy == "ddp" else 1.0 / world_size
    out = {name: nbytes * n_params * share for name, nbytes in STATE_BYTES.items()}
    out["total"] = sum(out.values())
    out["transient_low_precision_copy"] = 2.0 * n_params
    return out


def local_state_bytes(net: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank actually holds for weights, gradients and optimizer state (local shards only)."""

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    params = list(net.parameters())
    out = {"params": sum(local(p).nbytes for p in params),
           "grads": sum(local(p.grad).nbytes for p in params if p.grad is not None),
           "optimizer": sum(local(v).nbytes for s in optimizer.state.values() for v in s.values()
                            if isinstance(v, torch.Tensor) and v.dim() > 0)}  # Adam's scalar 'step' left out
    out["total"] = sum(out.values())
    return out


# ---------------------------------------------------------------------------------------------
# Launching torchrun (from the notebook and the tests) and SLURM scripts
# ---------------------------------------------------------------------------------------------

def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now (for a rendezvous endpoint)."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def torchrun_command(args: Sequence[str] = (), *, nproc_per_node: int = 2, nnodes: int = 1,
                     rdzv_endpoint: str | None = None, rdzv_id: str = "ampcourse", max_restarts: int = 0,
                     local_addr: str | None = "127.0.0.1", module: str | None = None,
                     script: str | os.PathLike | None = None, python: str | None = None,
                     monitor_interval: float | None = None, rdzv_file: str | os.PathLike | None = None) -> list[str]:
    """The torchrun command line (as ``python -m torch.distributed.run``, torchrun's own entry point).

    One node: ``--standalone`` (a private rendezvous on a free local port), or with `rdzv_file` the same
    rendezvous through that file (c10d over a FileStore: torchrun's agent then opens no port; --standalone's
    TCPStore listens on every address of the machine, whatever `local_addr` says). Several nodes: c10d rendezvous
    at `rdzv_endpoint` (HOST:PORT on the first node). `local_addr` pins the address workers publish to
    loopback (the default; pass None on a real cluster). Runs ``-m module`` (default ampcourse.train) or
    `script`, with `args`.
    """
    if module is not None and script is not None:
        raise ValueError("pass module= or script=, not both")
    if rdzv_file is not None and (nnodes != 1 or rdzv_endpoint is not None):
        raise ValueError("rdzv_file is a one-node rendezvous: pass it without nnodes > 1 or rdzv_endpoint")
    if script is None:
        module = module or "ampcourse.train"
    nproc_per_node = _args.integer(nproc_per_node, "nproc_per_node", low=1)
    nnodes = _args.integer(nnodes, "nnodes", low=1)
    max_restarts = _args.integer(max_restarts, "max_restarts", low=0)
    cmd = [python or sys.executable, "-m", "torch.distributed.run"]
    if rdzv_file is not None:
        cmd += ["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", str(rdzv_file), "--rdzv-conf",
                "store_type=file", "--rdzv-id", rdzv_id]
    elif nnodes == 1 and rdzv_endpoint is None:
        cmd += ["--standalone"]
    else:
        if rdzv_endpoint is None:
            raise ValueError("nnodes > 1 needs rdzv_endpoint='HOST:PORT' (the first node)")
        cmd += ["--nnodes", str(nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint,
                "--rdzv-id", rdzv_id]
    cmd += ["--nproc-per-node", str(nproc_per_node), "--max-restarts", str(max_restarts)]
    if local_addr is not None:
        cmd += ["--local-addr", local_addr]
    if monitor_interval is not None:
        cmd += ["--monitor-interval", str(monitor_interval)]
    cmd += ["-m", module] if module is not None else [str(script)]
    return cmd + [str(a) for a in args]


def as_shell(cmd: Sequence[str]) -> str:
    """A torchrun_command() as you would type it: the store fix in front, `torchrun` for the interpreter."""
    if list(cmd[1:3]) != ["-m", "torch.distributed.run"]:
        raise ValueError("expected a command from torchrun_command()")
    return f"{STORE_FIX_ENV}=1 " + shlex.join(["torchrun", *cmd[3:]])


@dataclass
class LaunchResult:
    """What a torchrun launch printed and returned."""

    command: list[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    def check(self) -> LaunchResult:
        """Raise RuntimeError with the output's tail unless torchrun exited 0."""
        if self.returncode != 0:
            raise RuntimeError(f"torchrun exited {self.returncode}: {shlex.join(self.command)}\n"
                               f"--- stdout (tail) ---\n{self.stdout[-3000:]}\n--- stderr (tail) ---\n"
                               f"{self.stderr[-3000:]}")
        return self


class LaunchTimeout(TimeoutError):
    """torchrun did not finish in time; its whole process group was killed."""


class LaunchInterrupted(KeyboardInterrupt):
    """A launch stopped by Ctrl-C or a notebook's stop button; torchrun and every worker were stopped.

    Still a KeyboardInterrupt (a stop stays a stop). A Jupyter kernel shows it as one line instead of a traceback
    through the checker, run_on_ranks and launch (21 lines in chapter 7): IPython calls an exception's
    `_render_traceback_` for the lines it prints.

    Example::

        >>> LaunchInterrupted("torchrun was interrupted")._render_traceback_()
        ['KeyboardInterrupt: torchrun was interrupted']
    """

    def _render_traceback_(self) -> list[str]:
        return [f"KeyboardInterrupt: {self}"]


def launch_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for torchrun: ours, plus the restart fix and one OpenMP thread per worker."""
    env = dict(os.environ)
    env.setdefault(STORE_FIX_ENV, "1")  # fresh TCPStore per restart round (pytorch/pytorch#135712)
    env.setdefault("OMP_NUM_THREADS", "1")  # N workers sharing few cores: busy-waiting threads would starve them
    env.update(extra or {})
    return env


def launch(args: Sequence[str] = (), *, timeout: float = 120.0, cwd: str | os.PathLike | None = None,
           env: Mapping[str, str] | None = None, progress: bool | None = None, **command: Any) -> LaunchResult:
    """Run torchrun (built by :func:`torchrun_command` from `command`) as a subprocess and wait for it.

    The subprocess gets its own session; on `timeout` the whole group (torchrun and its workers) gets
    SIGKILL and LaunchTimeout is raised with the output so far. An interrupt (Ctrl-C, a notebook's stop
    button) stops them the same way and raises a one-line KeyboardInterrupt. Processes the workers
    started and left behind are stopped too, and never delay the result (the output goes to files,
    which they cannot hold open the way they would hold a pipe). progress: a live status line (elapsed
    time, workers running, the job's latest line) while it runs; None: only in a Jupyter kernel.

    One node on loopback (the default: no `nnodes`, `rdzv_endpoint` or `rdzv_file`, `local_addr` 127.0.0.1): the
    agents meet through a file in a private temporary folder instead of ``--standalone``'s TCPStore, which would
    listen on every address; the workers' own store (:func:`rendezvous_store`) listens on loopback. So the job opens
    no port beyond loopback.
    """
    with contextlib.ExitStack() as stack:
        if (command.get("nnodes", 1) == 1 and command.get("rdzv_endpoint") is None and command.get("rdzv_file") is None
                and is_loopback(str(command.get("local_addr", "127.0.0.1")))):
            command = {**command, "rdzv_file": Path(stack.enter_context(tempfile.TemporaryDirectory())) / "rdzv"}
        return _launch(args, timeout, cwd, env, progress, command)


def _launch(args: Sequence[str], timeout: float, cwd: str | os.PathLike | None, env: Mapping[str, str] | None,
            progress: bool | None, command: dict[str, Any]) -> LaunchResult:
    """launch() with the command's keywords settled."""
    cmd = torchrun_command(args, **command)
    # checked before anything starts: a timeout of 0 or less would kill the job it just launched
    timeout = _args.real(timeout, "timeout", positive=True, what="a finite number of seconds > 0")
    status = _LaunchStatus(int(command.get("nproc_per_node", 2)), progress)  # this node's workers
    start = time.perf_counter()
    seen: set[int] = set()  # the sessions of torchrun and its workers: what is left in them is stopped after
    with tempfile.TemporaryFile() as out_file, tempfile.TemporaryFile() as err_file:
        def output() -> tuple[str, str]:
            out_file.seek(0)
            err_file.seek(0)
            return out_file.read().decode(errors="replace"), err_file.read().decode(errors="replace")

        proc = subprocess.Popen(cmd, stdout=out_file, stderr=err_file, text=True, cwd=cwd, env=launch_env(env),
                                start_new_session=True)
        try:
            while not _exited(proc, 0.5):
                seen.update(_family(proc.pid))
                status.show(time.perf_counter() - start, max(len(seen) - 1, 0), out_file, err_file)
                if time.perf_counter() - start > timeout:
                    _kill_group(proc)
                    proc.wait()
                    out, err = output()
                    raise LaunchTimeout(f"torchrun did not finish in {timeout:g} s and was killed: {shlex.join(cmd)}\n"
                                        f"--- stdout (tail) ---\n{out[-2000:]}\n--- stderr (tail) ---\n{err[-2000:]}")
        except KeyboardInterrupt:
            _kill_group(proc)  # an interrupted notebook cell must not leave workers behind
            raise LaunchInterrupted("torchrun was interrupted; it and its workers were stopped") from None
        except BaseException:
            _kill_group(proc)
            raise
        finally:
            _stop_orphans(seen)
            status.close()
        out, err = output()
    return LaunchResult(cmd, proc.returncode, out, err, time.perf_counter() - start)


def _exited(proc: subprocess.Popen, seconds: float) -> bool:
    """Wait up to `seconds` for proc; whether it has exited."""
    try:
        proc.wait(timeout=seconds)
        return True
    except subprocess.TimeoutExpired:
        return False


def _family(pid: int) -> set[int]:
    """The session ids of `pid` and its descendants now: torchrun and each worker run in a session of their own,
    and what a worker starts inherits the worker's (empty where /proc does not exist)."""
    return {int(f[3]) for p in [pid, *_proctree.descendants(pid)] if len(f := _proctree.stat(p)) > 3}


def _stop_orphans(sessions: set[int]) -> None:
    """SIGKILL every process still in one of the job's sessions (a helper a worker started and left behind)."""
    if not sessions:
        return
    own = os.getsid(0)
    killed = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        fields = _proctree.stat(int(stat.parent.name))
        if len(fields) > 3 and int(fields[3]) in sessions and int(fields[3]) != own:
            try:
                os.kill(int(stat.parent.name), signal.SIGKILL)
                killed.append(int(stat.parent.name))
            except (ProcessLookupError, PermissionError):
                pass
    _wait_gone(killed)


def _wait_gone(pids: Sequence[int], timeout: float = 10.0) -> None:
    """Wait until each process is gone or a zombie (dead, waiting for its parent to reap it), at most `timeout` s.

    A SIGKILL takes effect when the process is next scheduled: on a loaded machine that is later, and a launch
    that returned at once would leave its workers alive for a moment (CI saw one).
    """
    deadline = time.monotonic() + timeout
    left = [p for p in pids if _proctree.alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.02)
        left = [p for p in left if _proctree.alive(p)]


class _LaunchStatus:
    """A one-line live status of a launch in a Jupyter output (a display that is updated in place).

    The line shown at the start and left at the end is the same, so a stored notebook's output does not
    depend on timing (nbval compares the first display; nbclient stores the last); so it says only what is true
    before, while and after the job runs (a "live status here" note stayed in every stored output).
    """

    def __init__(self, nproc: int, enabled: bool | None):
        self.handle = None
        self.resting = f"torchrun: {nproc} worker process{'es' if nproc != 1 else ''}"
        ipython = sys.modules.get("IPython")
        shell = ipython.get_ipython() if ipython is not None else None
        if enabled is False or (enabled is None and getattr(shell, "kernel", None) is None):
            return
        from IPython.display import display

        self.handle = display({"text/plain": self.resting}, raw=True, display_id=True)
        self._shown = ""

    def show(self, seconds: float, started: int, *files) -> None:
        """Update the line: elapsed time, workers started (sessions), the job's latest line of output."""
        if self.handle is None:
            return
        latest = ""
        for f in files:
            f.seek(0, os.SEEK_END)
            skip = int(f.tell() > 2000)  # the first line read may be cut: leave it out
            f.seek(max(f.tell() - 2000, 0))
            lines = [line.strip() for line in f.read().decode(errors="replace").splitlines()[skip:] if line.strip()]
            latest = lines[-1][:140] if lines else latest
        text = f"torchrun running: {seconds:.0f} s, {started} workers started" + (f" | {latest}" if latest else "")
        if text != self._shown:
            self.handle.update({"text/plain": text}, raw=True)
            self._shown = text

    def close(self) -> None:
        """Back to the resting line."""
        if self.handle is not None:
            self.handle.update({"text/plain": self.resting}, raw=True)


def _kill_group(proc: subprocess.Popen) -> None:
    """Stop torchrun and every worker it spawned.

    torchrun starts each worker in a session of its own, so killing torchrun's process group alone would
    orphan them. Where /proc lists them we SIGKILL torchrun's group and each descendant; elsewhere we
    SIGTERM torchrun (it then stops its workers) and SIGKILL it if it has not exited after 10 s.
    """
    if Path("/proc").is_dir():  # frozen, torchrun cannot start a worker between our look at /proc and the kill
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGSTOP)
    family = _proctree.descendants(proc.pid)
    if not family and not Path("/proc").is_dir():
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=10)
            return
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    for pid, group in [(proc.pid, True)] + [(pid, False) for pid in family]:
        try:
            if group:
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    _wait_gone(family)  # torchrun itself is reaped by the caller's proc.wait()


_SLURM_FIELDS = ("job_name", "nodes", "gpus_per_node", "cpus_per_task", "time", "port", "max_restarts", "train_args")


def render_slurm(nodes: int, gpus_per_node: int, train_args: Sequence[str] = ("--strategy", "fsdp"), *,
                 job_name: str = "ampcourse", time_limit: str = "01:00:00", cpus_per_task: int | None = None,
                 port: int = 29500, max_restarts: int = 1) -> str:
    """The SLURM batch script (templates/train.slurm) for `nodes` nodes with `gpus_per_node` GPUs each."""
    nodes, gpus_per_node = _args.integer(nodes, "nodes", low=1), _args.integer(gpus_per_node, "gpus_per_node", low=1)
    port = _args.integer(port, "port", low=1, high=65535)
    max_restarts = _args.integer(max_restarts, "max_restarts", low=0)
    if cpus_per_task is not None:
        cpus_per_task = _args.integer(cpus_per_task, "cpus_per_task", low=1)
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", job_name):
        raise ValueError(f"job_name {job_name!r}: use letters, digits, '_', '.', '-' (at most 64)")
    if not re.fullmatch(r"(\d+-)?\d{1,2}:\d{2}:\d{2}", time_limit):
        raise ValueError(f"time_limit {time_limit!r}: use HH:MM:SS or D-HH:MM:SS")
    values = {"job_name": job_name, "nodes": nodes, "gpus_per_node": gpus_per_node,
              "cpus_per_task": cpus_per_task or 8 * gpus_per_node, "time": time_limit, "port": port,
              "max_restarts": max_restarts, "train_args": shlex.join(str(a) for a in train_args)}
    text = resources.files("ampcourse").joinpath("templates/train.slurm").read_text()
    filled = re.sub(r"\{\{(\w+)\}\}", lambda m: str(values[m.group(1)]), text)
    assert "{{" not in filled and set(values) == set(_SLURM_FIELDS)
    return filled

