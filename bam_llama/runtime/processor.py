"""What a results page records of the processor it ran on: CPU kernels round float sums differently from one
processor model to another (and by instruction set), so trained models and their retrieval rows differ with it."""

from __future__ import annotations

import platform
from pathlib import Path

import torch


def cpu_fields(cpuinfo: str) -> dict[str, str]:
    """The first processor's `model name`, `cpu family` and `model` from /proc/cpuinfo's text."""
    fields = {}
    for line in cpuinfo.splitlines():
        name, colon, value = line.partition(":")
        name = name.strip()
        if colon and name in ("model name", "cpu family", "model") and name not in fields:
            fields[name] = value.strip()
    return fields


def cpu_model() -> str:
    """The processor, as "NAME (family F model M), PyTorch CPU kernels: ISA", e.g. "Intel(R) Xeon(R) Processor
    (family 6 model 167), PyTorch CPU kernels: AVX512" (the instruction set PyTorch's kernels use here). The name
    alone can be a generic "Intel(R) Xeon(R) Processor"; the family and model tell the generations apart. Off Linux:
    platform.processor()."""
    cpuinfo = Path("/proc/cpuinfo")
    fields = cpu_fields(cpuinfo.read_text()) if cpuinfo.exists() else {}
    name = fields.get("model name") or platform.processor() or platform.machine() or "unknown processor"
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']} model {fields['model']})"
    return f"{name}, PyTorch CPU kernels: {torch.backends.cpu.get_cpu_capability()}"
