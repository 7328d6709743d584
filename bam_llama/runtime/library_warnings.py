"""What a command's first screen leaves out: warnings of other libraries that say nothing true about the user's run.
Light on purpose: every command calls it before it imports the library, and every model process of `bam-demo`.

DeepSpeed (in `.[dev]`) prints "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to
detect it." on every machine without CUDA, the first time anything imports it (Transformers does while saving).
Where PyTorch sees no CUDA device the line only repeats that the run is on the CPU, so it is dropped; where a CUDA
device is visible and DeepSpeed still falls back to the CPU, the warning is true and stays.
"""

import logging
import sys

DEEPSPEED_LOGGER = "DeepSpeed"
DEEPSPEED_CPU_FALLBACK = "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it"


class CpuFallbackWithoutCuda(logging.Filter):
    """Drops DeepSpeed's CPU-fallback warning where PyTorch sees no CUDA device."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith(DEEPSPEED_CPU_FALLBACK):
            return True
        torch = sys.modules["torch"]  # loaded by now: DeepSpeed imports it before it looks for an accelerator
        return torch.cuda.is_available()


def keep_first_screen_quiet() -> None:
    """Install the filters above (once per process)."""
    logger = logging.getLogger(DEEPSPEED_LOGGER)
    if not any(isinstance(existing, CpuFallbackWithoutCuda) for existing in logger.filters):
        logger.addFilter(CpuFallbackWithoutCuda())
