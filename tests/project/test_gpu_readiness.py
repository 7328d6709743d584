"""benchmarks/gpu_readiness.py compiles the Triton kernels' launches for sm_90 and sm_80 with Triton's own compiler
(no GPU needed): each must compile, spill no register and fit the shared memory of the GPU.

The suite lists every bf16 launch at head sizes 64 and 128 (84 variants: every kernel and target there, the autotuned
kernels with several configurations each) and compiles a sample: the first launch of each kernel at head size 128,
the largest, on both targets (16 compiles: 29 s on 2 CPU cores shared at load 5, 44-51 s at load 9-10). Compiling
all 84 (365 s at load 9-10; 1,200 s was not enough at load 10-14) is `.ci/gpu-readiness`, a CI step with its own
time budget after the suite: a test's verdict must not depend on the machine's speed.

The benchmark runs in its own process with TRITON_INTERPRET unset: the conftest imports triton in interpreter mode,
and the ahead-of-time compiler needs it imported without. Each process has a wide limit, and one that runs past it
fails naming the variant it was compiling (`run_within`).
"""

import json
import os
import sys
from collections import Counter
from pathlib import Path

import pytest
from waiting import run_within

pytest.importorskip("triton")

REPO_ROOT = Path(__file__).resolve().parents[2]
BENCHMARK = REPO_ROOT / "benchmarks" / "gpu_readiness.py"
LIMIT_S = 3600  # idle seconds, stretched by the machine's load (waiting.py): a verdict, not a race
KERNELS = {"forward", "dkdv", "dq", "decode_split", "decode_combine", "paged_prefill", "paged_decode", "paged_write"}
ONE_LAUNCH = {"paged_decode", "paged_write"}  # the serving plugin's fixed launches (no autotuning)
KEYS = {"kernel", "arch", "dtype", "head_dim", "config", "compiled", "n_regs", "n_spills", "shared_bytes",
        "shared_limit", "loop_instructions"}
SHARED_LIMIT = {"sm_90": 227 * 1024, "sm_80": 163 * 1024}  # opt-in shared memory per block: H100, A100


def run_benchmark(*arguments: str, limit_s: float = LIMIT_S):
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return run_within([sys.executable, str(BENCHMARK), *arguments], limit_s, env=env)


def test_the_matrix_lists_every_kernel_and_target_and_the_autotuned_configurations():
    """What .ci/gpu-readiness compiles, listed without compiling: every kernel on both targets at both head sizes,
    each autotuned kernel in more than one configuration."""
    result = run_benchmark("--dtype", "bf16", "--head-dim", "64", "128", "--list")
    assert result.returncode == 0, result.stderr[-4000:]
    variants = [json.loads(line) for line in result.stdout.splitlines()]
    configs = Counter((row["kernel"], row["arch"], row["head_dim"]) for row in variants)
    assert set(configs) == {(kernel, arch, d) for kernel in KERNELS for arch in ("sm_90", "sm_80") for d in (64, 128)}
    assert min(count for (kernel, _, _), count in configs.items() if kernel not in ONE_LAUNCH) >= 2, configs
    assert len(variants) == len({json.dumps(row, sort_keys=True) for row in variants})  # none twice


def test_a_sample_of_every_kernel_compiles_without_spills_and_fits_shared_memory(tmp_path):
    """One launch per kernel, head size 128 (the most registers and shared memory of the matrix), sm_90 and sm_80
    (the smaller shared memory); the whole matrix is .ci/gpu-readiness's."""
    output = tmp_path / "readiness.jsonl"
    result = run_benchmark("--dtype", "bf16", "--head-dim", "128", "--sample", "--check", "--json", str(output))
    assert result.returncode == 0, result.stderr[-4000:]
    assert "| kernel | arch |" in result.stdout
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert all(set(row) == KEYS for row in rows)
    assert sorted((row["kernel"], row["arch"]) for row in rows) == sorted(
        (kernel, arch) for kernel in KERNELS for arch in ("sm_90", "sm_80"))  # one launch each, no more
    for row in rows:
        assert row["dtype"] == "bf16" and row["head_dim"] == 128 and row["shared_limit"] == SHARED_LIMIT[row["arch"]]
        assert row["compiled"] and row["n_spills"] == 0 and row["shared_bytes"] <= row["shared_limit"], row


def test_check_fails_on_a_variant_that_does_not_compile_spills_or_exceeds_shared_memory():
    """--check's verdict on rows written here: only the ready one passes."""
    rows = [
        {"kernel": "ready", "compiled": True, "n_spills": 0, "shared_bytes": 1000, "shared_limit": 1000},
        {"kernel": "uncompiled", "compiled": False, "n_spills": None, "shared_bytes": None, "shared_limit": 1000},
        {"kernel": "spilling", "compiled": True, "n_spills": 1, "shared_bytes": 10, "shared_limit": 1000},
        {"kernel": "too-much-shared", "compiled": True, "n_spills": 0, "shared_bytes": 1001, "shared_limit": 1000},
    ]
    script = (f"import json, sys; sys.path.insert(0, {str(BENCHMARK.parent)!r}); import gpu_readiness; "
              f"print(json.dumps([row['kernel'] for row in gpu_readiness.failures({rows!r})]))")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = run_within([sys.executable, "-c", script], LIMIT_S, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    assert json.loads(result.stdout.splitlines()[-1]) == ["uncompiled", "spilling", "too-much-shared"]


def test_bad_arguments_exit_with_status_2():
    result = run_within([sys.executable, str(BENCHMARK), "--arch", "70"], LIMIT_S)
    assert result.returncode == 2
    assert "--arch" in result.stderr and "Traceback" not in result.stderr
