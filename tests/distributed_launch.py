"""Start a worker script under torchrun (gloo on CPU, a free loopback port) and wait for its workers, and end one
(`finish_worker`, called by the workers)."""

import importlib.util
import os
import socket
import sys
from pathlib import Path

import pytest
from helpers import checkout_environment
from waiting import run_within


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


def torchrun(script: str, *arguments: str, processes: int = 2, limit_s: float = 600, **environment: str):
    """Run `script` (a path under tests/, e.g. model/sequence_parallel_worker.py) on `processes` ranks and wait for
    them (torchrun ends when a rank fails); fails the test with the workers' output if any rank fails. `limit_s`
    idle seconds only guard against a hang (`waiting.run_within`)."""
    command = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={processes}", "--nnodes=1",
        "--master_addr=127.0.0.1", f"--master_port={free_port()}",
        str(Path(__file__).parent / script), *arguments,
    ]
    variables = dict(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", **environment)
    result = run_within(command, limit_s, env=checkout_environment(**variables))
    if result.returncode != 0:
        raise AssertionError(f"{script} failed ({result.returncode}):\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}")
    return result


def finish_worker(rank: int, results, path: Path) -> None:
    """End a torchrun worker: rank 0 writes `results` to `path` (whole, then renamed in), every rank waits at a
    barrier until it is there, the process group is destroyed, and the process exits with status 0 at once.

    os._exit skips the interpreter's own teardown, where gloo's worker threads, DeepSpeed's communication backend and
    C++ static destructors are torn down in no fixed order: one such teardown aborted a worker (SIGABRT, exit -6)
    after its results were written, failing the test. Nothing is left to do there once the results are on disk."""
    import torch
    import torch.distributed as dist

    if rank == 0:
        partial = path.with_name(path.name + ".partial")
        torch.save(results, partial)
        os.replace(partial, path)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
