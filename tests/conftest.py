"""Set-up for every test: Triton imported for its interpreter, the C++ CPU kernels built ahead (as users build them),
a fixed seed, no Hub access. Shared helpers live in helpers.py (tiny models, subprocess environments, the reference
fixtures) and the float64 attention reference in reference.py; both are imported by name (pyproject's pytest
`pythonpath`)."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from helpers import checkout_environment, skip_outside_ci

from bam_llama.model.cpu_kernels_bam import FUSED_CPU, library_path
from bam_llama.serving.paged_cpu import PAGED_CPU


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


@pytest.fixture(scope="session", autouse=True)
def cpu_kernels_build() -> str | None:
    """Before any test: the C++ CPU kernels, built by the command users run (`bam-build-kernels`, in a process of its
    own) unless this installation has them; a forward never builds them. None once built, else the command's error
    line (the tests of the kernels then skip, or fail under CI=true: `cpu_kernels`)."""
    if all(library_path(kernel).is_file() for kernel in (FUSED_CPU, PAGED_CPU)):
        return None
    completed = subprocess.run([sys.executable, "-m", "bam_llama.cli.build_kernels"], capture_output=True, text=True,
                               env=checkout_environment())
    lines = completed.stderr.strip().splitlines()
    return None if completed.returncode == 0 else (lines[-1] if lines else f"exit status {completed.returncode}")


@pytest.fixture
def cpu_kernels(cpu_kernels_build):
    """The tests of the C++ CPU kernels: skipped where they could not be built, failed under CI=true."""
    if cpu_kernels_build is not None:
        skip_outside_ci(f"BAM's C++ CPU kernels could not be built ({cpu_kernels_build})")


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


def pytest_configure(config):
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
