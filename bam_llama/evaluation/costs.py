"""What one length of an evaluation costs: its wall time and the peak memory of the process while it ran.

Peak resident memory (RSS) is the kernel's high-water mark. On Linux it is reset before each length (writing 5 to
/proc/self/clear_refs), so each length reports its own peak; where that is not possible the peak since the process
started is reported, which can only overstate a length's. On CUDA the peak of PyTorch's allocator is reported too.
"""

from __future__ import annotations

import resource
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

CLEAR_REFS = Path("/proc/self/clear_refs")
STATUS = Path("/proc/self/status")
RESET_PEAK_RSS = "5"  # proc(5): "reset the peak resident set size (VmHWM) to the process's current RSS"


@dataclass
class Cost:
    seconds: float = 0.0
    peak_rss_mib: float | None = None
    peak_gpu_mib: float | None = None  # PyTorch's CUDA allocator; None off CUDA


def reset_peak_rss() -> bool:
    """Reset the kernel's peak RSS of this process; False where it cannot be (not Linux, no permission)."""
    try:
        CLEAR_REFS.write_text(RESET_PEAK_RSS)
    except OSError:
        return False
    return True


def peak_rss_mib() -> float:
    """The process's peak resident memory in MiB: VmHWM (since the last reset) where /proc has it, else ru_maxrss
    (since the process started)."""
    try:
        for line in STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # bytes on macOS, kB elsewhere


@contextmanager
def measured(device=None):
    """`with measured(device) as cost:` fills `cost` (a `Cost`) when the block ends: its seconds, the peak RSS while
    it ran, and the CUDA allocator's peak when `device` is a CUDA device."""
    cuda = device is not None and torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    reset_peak_rss()
    cost = Cost()
    started = time.perf_counter()
    yield cost
    if cuda:
        torch.cuda.synchronize(device)
        cost.peak_gpu_mib = torch.cuda.max_memory_allocated(device) / 2**20
    cost.seconds = time.perf_counter() - started
    cost.peak_rss_mib = peak_rss_mib()
