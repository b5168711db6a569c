"""A torchrun worker for the tests: ampcourse.train's CLI plus fault injection that has no place in the package.

    AMPCOURSE_TEST_KILL=RANK:STEP       RANK SIGKILLs itself at the start of STEP, in torchrun's first round only
    AMPCOURSE_TEST_SHARD_INF=RANK:STEP  in STEP, after the gradients were averaged (DDP all-reduce, FSDP2
                                        reduce-scatter), RANK writes inf into one entry of its local gradient

STEP counts the optimizer steps this process runs, from 0. Usage (what the tests do)::

    AMPCOURSE_TEST_KILL=1:5 torchrun --standalone --nproc-per-node 2 --max-restarts 1 tests/dist_worker.py \\
        --strategy ddp --device cpu ...
"""

from __future__ import annotations

import os
import signal
import sys

from ampcourse import distributed
from ampcourse import train as train_mod


def _rank_step(name: str) -> tuple[int, int] | None:
    """RANK:STEP from an environment variable, or None."""
    value = os.environ.get(name)
    return None if not value else tuple(int(v) for v in value.split(":"))  # type: ignore[return-value]


def _poison_after_sync(scaler) -> None:
    """Make the next scaler.unscale_ see one inf in this rank's (local shard of the) averaged gradient."""
    real = scaler.unscale_

    def unscale_(optimizer):
        param = next(p for group in optimizer.param_groups for p in group["params"] if p.grad is not None)
        grad = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
        grad.view(-1)[0] = float("inf")
        del scaler.unscale_  # once: back to the class method
        return real(optimizer)

    scaler.unscale_ = unscale_


def main() -> int:
    """Patch train_step with the requested faults, then run the real CLI."""
    rank = int(os.environ.get("RANK", "0"))
    first_round = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    kill, shard_inf = _rank_step("AMPCOURSE_TEST_KILL"), _rank_step("AMPCOURSE_TEST_SHARD_INF")
    real_step, calls = train_mod.loop.train_step, [0]

    def step(model, micro, loss_fn, optimizer, scaler, amp, **kwargs):
        n = calls[0]
        calls[0] += 1
        if kill and first_round and (rank, n) == kill:
            os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no exception: as if the node lost power
        if shard_inf and (rank, n) == shard_inf:
            _poison_after_sync(scaler)
        return real_step(model, micro, loss_fn, optimizer, scaler, amp, **kwargs)

    train_mod.loop.train_step = step  # the loop calls the train_step of its own module
    return train_mod.main(sys.argv[1:])


if __name__ == "__main__":
    distributed.exit_worker(main())
