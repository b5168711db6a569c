"""ampcourse.scaling.LossScaler on CUDA: the same trajectory and parameters as torch.amp.GradScaler."""

import pytest
import torch

from ampcourse.scaling import LossScaler

pytestmark = pytest.mark.gpu


def _same(a, b) -> bool:
    """Bit-identical floats or tensors (NaN equal to NaN)."""
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan())
    return a == b or (a != a and b != b)


def test_loss_scaler_matches_grad_scaler_on_cuda(amp):
    for seed in range(10):
        traces = []
        for make in (lambda: torch.amp.GradScaler("cuda", init_scale=2.0**20), lambda: LossScaler("cuda", init_scale=2.0**20)):
            torch.manual_seed(seed)
            model = torch.nn.Linear(64, 64, device="cuda")
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            scaler, trace = make(), []
            for i in range(30):
                opt.zero_grad()
                with torch.autocast("cuda", dtype=torch.float16):
                    out = model(torch.randn(8, 64, device="cuda") * (1e4 if i % 7 == 3 else 1.0))
                scaler.scale(out.float().pow(2).mean()).backward()
                scaler.step(opt)
                scaler.update()
                trace += [scaler.get_scale(), model.weight.detach().clone()]
            traces.append(trace)
        assert all(_same(a, b) for a, b in zip(*traces))
