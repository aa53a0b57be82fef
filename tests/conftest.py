"""Test setup: without CUDA, kernels run in Triton's CPU interpreter with small shapes.

TRITON_INTERPRET must be set before Triton builds any kernel, so it is set here, before the
test modules import flashkernel.
"""

import os
import zlib

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Every output the public API allocates starts as NaN (an integer buffer as its dtype's
    largest value), so an unwritten element fails."""
    from flashkernel.kernels import _launch

    def nan_empty(shape, dtype, device):
        poison = float("nan") if dtype.is_floating_point else torch.iinfo(dtype).max
        return torch.full(shape, poison, dtype=dtype, device=device)

    monkeypatch.setattr(_launch, "empty", nan_empty)


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    """Fresh random inputs per case, yet reproducible: the seed derives from the test id.

    ``zlib.crc32``, not ``hash``: Python salts ``hash`` of a string per process, so a failing
    case would get other inputs in the next run (and in each xdist worker)."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def pytest_collection_modifyitems(config, items):
    if ON_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_call_caches():
    """Every test starts with no recorded calls, so a replay never outlives a monkeypatch."""
    from flashkernel import interface, ops

    interface._EAGER_CALLS.clear()
    ops._OP_CALLS.clear()
