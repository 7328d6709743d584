"""How many threads PyTorch's CPU operations use: the one setting behind every command's `--threads`.

On a CPU an operation split over several threads waits for the slowest of them, so where other programs share the
cores torch's default (one thread per core) stalls at every operation, while one thread keeps its pace
(`cli/arguments.py`'s `--threads` help gives the measurement). Hence the default on a CPU: one thread per process,
which is also right for several processes per machine (torchrun, `bam-demo --jobs`). OMP_NUM_THREADS, where set (by
the user, or by torchrun for several processes per node), is respected as it is: torch read it at start. On a GPU
the CPU only feeds the device, and torch's threads are left as they are.
"""

from __future__ import annotations

import os

import torch

CPU_DEFAULT_THREADS = 1


def default_threads(device_type: str) -> int | None:
    """The threads a run on `device_type` ("cpu", "cuda", ...) gets without `--threads`; None: torch's own (on an
    accelerator, or as OMP_NUM_THREADS says)."""
    if device_type != "cpu" or os.environ.get("OMP_NUM_THREADS", "").strip():
        return None
    return CPU_DEFAULT_THREADS


def use_threads(threads: int | None, device_type: str) -> int:
    """Set torch's threads to `threads`, or without it to `default_threads(device_type)`; returns the count torch
    now uses. Call it after the distributed set-up: Accelerate sets its own count on CPU ranks when
    OMP_NUM_THREADS is unset."""
    threads = threads or default_threads(device_type)
    if threads is not None:
        torch.set_num_threads(threads)
    return torch.get_num_threads()
