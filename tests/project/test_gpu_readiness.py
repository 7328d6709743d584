"""benchmarks/gpu_readiness.py compiles every kernel configuration the launcher can pick for sm_90 and sm_80 with
Triton's own compiler (no GPU needed): each must compile, spill no register and fit the shared memory of the GPU.

It runs in its own process with TRITON_INTERPRET unset: the conftest imports triton in interpreter mode, and the
ahead-of-time compiler needs it imported without. bf16 at head sizes 64 and 128 on both targets: 56 compiles of
the model's kernels and 28 of the serving plugin's paged ones, measured at 1.5-3 s each on the 2 shared CPU cores of
CI (about 2.5-4 min); benchmarks/results/gpu-readiness.md holds the full matrix.
"""

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("triton")

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_every_bf16_config_compiles_without_spills_and_fits_shared_memory(tmp_path):
    output = tmp_path / "readiness.jsonl"
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / "gpu_readiness.py"), "--dtype", "bf16", "--head-dim", "64",
         "128", "--json", str(output)],
        capture_output=True, text=True, timeout=1200, env=env,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert "| kernel | arch |" in result.stdout

    keys = {"kernel", "arch", "dtype", "head_dim", "config", "compiled", "n_regs", "n_spills", "shared_bytes",
            "shared_limit", "loop_instructions"}
    assert all(set(row) == keys for row in rows)
    assert {(row["arch"], row["head_dim"]) for row in rows} == {(arch, d) for arch in ("sm_90", "sm_80")
                                                                for d in (64, 128)}
    configs = Counter((row["kernel"], row["arch"], row["head_dim"]) for row in rows)
    assert {kernel for kernel, _, _ in configs} == {"forward", "dkdv", "dq", "decode_split", "decode_combine",
                                                    "paged_prefill", "paged_decode", "paged_write"}
    one_launch = ("paged_decode", "paged_write")  # the serving plugin's fixed launches (no autotuning)
    assert min(count for (kernel, _, _), count in configs.items() if kernel not in one_launch) >= 2, configs
    failures = [row for row in rows
                if not row["compiled"] or row["n_spills"] != 0 or row["shared_bytes"] > row["shared_limit"]]
    assert not failures, "\n".join(json.dumps(row) for row in failures)


def test_bad_arguments_exit_with_status_2():
    result = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "gpu_readiness.py"), "--arch", "70"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "--arch" in result.stderr and "Traceback" not in result.stderr
