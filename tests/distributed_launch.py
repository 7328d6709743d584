"""Start a worker script under torchrun: gloo on CPU, a free loopback port, bounded in time."""

import socket
import subprocess
import sys
from pathlib import Path

from conftest import checkout_environment


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def torchrun(script: str, *arguments: str, processes: int = 2, timeout: float = 300, **environment: str):
    """Run tests/`script` on `processes` ranks; fails the test with the workers' output if any rank fails."""
    command = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={processes}", "--nnodes=1",
        "--master_addr=127.0.0.1", f"--master_port={free_port()}",
        str(Path(__file__).with_name(script)), *arguments,
    ]
    variables = dict(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", **environment)
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, env=checkout_environment(**variables)
    )
    if result.returncode != 0:
        raise AssertionError(f"{script} failed ({result.returncode}):\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}")
    return result
