"""Shared pytest setup for dsakit.

* Every test starts from the same torch seed (``_seed_torch``), so failures reproduce.
* Hypothesis runs the ``dsakit`` profile: derandomized (same examples on every run, no flaky failures),
  no per-example deadline (the first call of a Triton interpreter kernel is slow), a modest example count
  to keep the CPU suite fast. ``HYPOTHESIS_PROFILE=thorough`` raises the count for local soak runs.
* ``@pytest.mark.gpu`` tests are skipped when CUDA is not available.
* Fixtures ``triton_backend`` (skip unless Triton kernels can run: CUDA, or ``TRITON_INTERPRET=1`` on CPU)
  and ``device`` (``"cuda"`` when available, else ``"cpu"``).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

try:
    from hypothesis import HealthCheck, settings

    settings.register_profile(
        "dsakit", derandomize=True, deadline=None, max_examples=25, print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    settings.register_profile(
        "thorough", derandomize=False, deadline=None, max_examples=500, print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dsakit"))
except ImportError:  # hypothesis is a test dependency; tests that import it fail with a clear message
    pass


def cuda_available() -> bool:
    return torch.cuda.is_available()


def triton_runnable() -> tuple[bool, str]:
    """(can Triton kernels run here, why not)."""
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed"
    if cuda_available():
        return True, ""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True, ""
    return False, "Triton kernels need CUDA or TRITON_INTERPRET=1 (./dev.sh test sets it)"


def pytest_collection_modifyitems(config, items):
    if cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (gpu marker); none is available")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed_torch():
    torch.manual_seed(0)
    yield


@pytest.fixture
def triton_backend() -> str:
    """Skip the test unless Triton kernels can run; returns ``"triton"`` for a ``backend=`` argument.

    Put the test's tensors on the ``device`` fixture's device: CUDA when there is one (Triton cannot launch
    on CPU tensors there), the CPU under ``TRITON_INTERPRET=1``.
    """
    ok, why = triton_runnable()
    if not ok:
        pytest.skip(why)
    return "triton"


@pytest.fixture
def device() -> str:
    return "cuda" if cuda_available() else "cpu"


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module's tests (``pytestmark = pytest.mark.usefixtures("one_thread")``): their
    matmuls are tiny, and two threads on a busy 2-core machine are ~10x slower than one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
