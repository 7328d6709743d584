"""Set-up for every test: Triton imported for its interpreter, a fixed seed, no Hub access. Shared helpers live in
helpers.py (tiny models, subprocess environments, the reference fixtures) and the float64 attention reference in
reference.py; both are imported by name (pyproject's pytest `pythonpath`)."""

import importlib.util
import os

import pytest
import torch


def _import_triton_for_the_interpreter():
    """Triton chooses between its interpreter and its compiler when it is first imported, and other libraries
    (peft, torch.compile) may import it before tests/model/test_triton_kernels.py runs. Without a GPU, import it
    here in interpreter mode, then unset the variable: triton_bam reads it at call time, so only the kernel
    tests (which set it per test) run the interpreter."""
    if torch.cuda.is_available() or importlib.util.find_spec("triton") is None:
        return
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    import triton.language  # noqa: F401

    if previous is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = previous


_import_triton_for_the_interpreter()


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


def pytest_configure(config):
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
