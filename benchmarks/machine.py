"""What the benchmarks record of the machine they ran on."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_model() -> str:
    """The processor's model name (/proc/cpuinfo on Linux; platform.processor() elsewhere, "unknown" if empty).
    CPU kernels round differently from one processor model to another, so trained models differ with it."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"
