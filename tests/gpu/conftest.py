"""GPU-only tests (marker `gpu`): `make test` deselects them (pyproject addopts), `make gpu-test` runs them."""

from pathlib import Path

import pytest
import torch

from ampcourse.device import AmpSetup, pick


HERE = Path(__file__).parent


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(items):
    """Everything under tests/gpu is marked gpu, so no GPU test can slip into `make test`."""
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.gpu)


@pytest.fixture(scope="session")
def amp() -> AmpSetup:
    """fp16 autocast + GradScaler on the first CUDA device; selecting GPU tests without one is an error."""
    if not torch.cuda.is_available():
        pytest.fail("tests/gpu need a CUDA device; run `make gpu-test` on a GPU machine "
                    "(without CUDA it is a dry run that runs none of them)", pytrace=False)
    return pick("cuda", "fp16")
