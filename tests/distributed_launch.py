"""Start a worker script under torchrun: gloo on CPU, a free loopback port, bounded in time."""

import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import checkout_environment


def require_deepspeed() -> None:
    """Skip without DeepSpeed, except under CI=true, where it is in the `dev` extra: fail there."""
    if importlib.util.find_spec("deepspeed") is not None:
        return
    if os.environ.get("CI", "").strip().lower() in ("true", "1", "yes"):
        pytest.fail("DeepSpeed is not installed; CI=true requires it (pip install -e '.[dev]')", pytrace=False)
    pytest.skip("DeepSpeed is not installed (pip install -e '.[deepspeed]')")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def torchrun(script: str, *arguments: str, processes: int = 2, timeout: float = 300, **environment: str):
    """Run `script` (a path under tests/, e.g. model/sequence_parallel_worker.py) on `processes` ranks; fails the
    test with the workers' output if any rank fails."""
    command = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={processes}", "--nnodes=1",
        "--master_addr=127.0.0.1", f"--master_port={free_port()}",
        str(Path(__file__).parent / script), *arguments,
    ]
    variables = dict(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", **environment)
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, env=checkout_environment(**variables)
    )
    if result.returncode != 0:
        raise AssertionError(f"{script} failed ({result.returncode}):\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}")
    return result
