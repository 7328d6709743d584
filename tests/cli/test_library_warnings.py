"""A command's first screen: DeepSpeed's CPU-fallback warning says nothing true on a machine without CUDA and is
kept off it; where PyTorch sees a CUDA device the same warning is true and stays."""

import io
import logging
import subprocess
import sys

import pytest
import torch
from helpers import checkout_environment
from waiting import run_within

from bam_llama.runtime.library_warnings import keep_first_screen_quiet

FALLBACK = "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."


@pytest.fixture
def deepspeed_like_logger():
    """A logger of DeepSpeed's name writing to a buffer, as DeepSpeed sets its own up; its filters restored after."""
    logger = logging.getLogger("DeepSpeed")
    saved_filters, saved_handlers, saved_propagate = list(logger.filters), list(logger.handlers), logger.propagate
    buffer = io.StringIO()
    logger.handlers = [logging.StreamHandler(buffer)]
    logger.propagate = False
    yield logger, buffer
    logger.filters, logger.handlers, logger.propagate = saved_filters, saved_handlers, saved_propagate


@pytest.mark.parametrize("cuda", [False, True])
def test_the_fallback_warning_is_dropped_only_without_cuda(deepspeed_like_logger, monkeypatch, cuda):
    logger, buffer = deepspeed_like_logger
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    keep_first_screen_quiet()
    keep_first_screen_quiet()  # a second call adds no second filter
    logger.warning(FALLBACK)
    logger.warning("Some other DeepSpeed warning")
    lines = buffer.getvalue().splitlines()
    assert lines == ([FALLBACK] if cuda else []) + ["Some other DeepSpeed warning"]


def test_a_quick_demo_prints_no_accelerator_warning(tmp_path):
    """The whole command in a fresh process (DeepSpeed imported there for the first time), both models in their own
    processes: the warning is on neither stream."""
    pytest.importorskip("deepspeed")
    completed = run_within(
        [sys.executable, "-m", "bam_llama.cli.demo", "--quick", "--models", "bam,rope", "--jobs", "2", "--lengths", "64",
         "--output-dir", str(tmp_path / "demo")],
        600, env=checkout_environment(CUDA_VISIBLE_DEVICES=""),
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert "Passkey retrieval accuracy" in completed.stdout
    assert "Setting accelerator" not in completed.stdout + completed.stderr
