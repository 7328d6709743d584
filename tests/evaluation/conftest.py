"""Set-up for the evaluation tests: one torch thread."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The tiny models are latency bound; several threads on a shared 2-core machine are 10-50x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
