"""GPU tests: they run only where torch sees a CUDA device (scripts/gpu_check.sh).

Everywhere else every test in this folder is reported as skipped. Where CUDA *is* available but
our kernels fail to build, the kernel tests fail (they must not pass by skipping).
"""
import warnings
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

try:
    import torch

    HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover - torch is a dependency
    HAS_CUDA = False


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            if not HAS_CUDA:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def kernels():
    """The compiled kernels (minipaged.kernels.build.CUDA_OP); fails if they did not build."""
    from minipaged.kernels import build

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = build.CUDA_OP.load()
    if loaded is None:
        messages = "\n".join(str(w.message) for w in caught) or "(see the first warning)"
        pytest.fail(f"CUDA is available but the minipaged kernels did not load:\n{messages}")
    return loaded
