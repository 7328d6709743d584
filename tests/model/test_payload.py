"""The payload rule: a saved folder carries bam_llama/model/ as Hub remote code, flat, and loads without the package.

`save_pretrained` copies `modeling_bam.py` and, recursively, every file it imports with `from .x import` into the
folder; Transformers then imports them as siblings of one `transformers_modules` package. A model file that imported
anything else of bam_llama would break every machine without the package.
"""

import ast
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import REPO_ROOT, tiny_model
from waiting import run_within

from bam_llama.model.cpu_kernels_bam import FUSED_CPU, library_path


MODEL_PACKAGE = REPO_ROOT / "bam_llama" / "model"
# Written out, not derived: a file added to the payload (or dropped from it) must be a decision seen here.
SHIPPED_CODE = {
    "configuration_bam.py",
    "modeling_bam.py",
    "dispatch_bam.py",
    "prior_bam.py",
    "prior_modules_bam.py",
    "reference_bam.py",
    "attention_route_bam.py",
    "blocked_bam.py",
    "block_masks_bam.py",
    "decode_step_bam.py",
    "prior_backward_bam.py",
    "prior_tables_bam.py",
    "fused_cpu_path_bam.py",
    "fused_cpu_bam.py",
    "cpu_kernels_bam.py",
    "cpu_sources_bam.py",
    "triton_bam.py",
    "triton_kernels_bam.py",
    "sequence_parallel_bam.py",
    "continuous_batching_bam.py",
    "absolute_positions_bam.py",
}
HIDE_BAM_LLAMA = """
import sys
from importlib.machinery import PathFinder

class PathFinderWithoutBamLlama(PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        return None if name.split(".")[0] == "bam_llama" else super().find_spec(name, path, target)

sys.meta_path = [PathFinderWithoutBamLlama if finder is PathFinder else finder for finder in sys.meta_path]
sys.meta_path = [finder for finder in sys.meta_path if "editable" not in getattr(finder, "__module__", "").lower()]
try:
    import bam_llama
except ImportError:
    pass
else:
    raise AssertionError(f"bam_llama is still importable from {bam_llama.__file__}")
"""


def test_a_saved_folder_ships_exactly_the_model_package(tmp_path):
    tiny_model("sdpa", ssmax=True).save_pretrained(tmp_path)
    shipped = {path.name for path in tmp_path.iterdir() if path.suffix == ".py"}
    assert shipped == SHIPPED_CODE
    assert {path.name for path in MODEL_PACKAGE.glob("*.py")} - {"__init__.py"} == SHIPPED_CODE
    for name in SHIPPED_CODE:
        assert (tmp_path / name).read_bytes() == (MODEL_PACKAGE / name).read_bytes(), name


def test_model_files_import_only_each_other():
    siblings = {name.removesuffix(".py") for name in SHIPPED_CODE}
    for path in sorted(MODEL_PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                assert node.level == 1 and node.module in siblings, f"{path.name}:{node.lineno}: from {'.' * node.level}{node.module or ''}"
            elif isinstance(node, ast.ImportFrom):
                assert node.module.split(".")[0] != "bam_llama", f"{path.name}:{node.lineno}: from {node.module}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    assert alias.name.split(".")[0] != "bam_llama", f"{path.name}:{node.lineno}: import {alias.name}"


def test_a_saved_folder_loads_where_bam_llama_cannot_be_imported(tmp_path):
    model = tiny_model("sdpa", ssmax=True, prior_scope="layer")
    model.save_pretrained(tmp_path / "saved")
    folder = shutil.copytree(tmp_path / "saved", tmp_path / "elsewhere" / "model")  # nothing but the folder itself
    input_ids = torch.randint(0, 97, (2, 10))
    with torch.no_grad():
        expected = model(input_ids, use_cache=False).logits
    torch.save({"input_ids": input_ids, "logits": expected}, tmp_path / "expected.pt")
    script = HIDE_BAM_LLAMA + textwrap.dedent(
        f"""
        import torch
        from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
        expected = torch.load({str(tmp_path / "expected.pt")!r})
        config = AutoConfig.from_pretrained({str(folder)!r}, trust_remote_code=True)
        model = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        with torch.no_grad():
            logits = model(expected["input_ids"], use_cache=False).logits
        assert torch.equal(logits, expected["logits"]), (logits - expected["logits"]).abs().max()
        assert type(AutoModel.from_pretrained({str(folder)!r}, trust_remote_code=True)).__name__ == "BamLlamaModel"
        assert not any(name.split(".")[0] == "bam_llama" for name in sys.modules if sys.modules[name] is not None)
        print("remote code OK")
        """
    )
    completed = run_remote_code(script, tmp_path)
    assert "remote code OK" in completed.stdout
    assert "not built" not in completed.stderr  # the folder's code found the package's build of the fused kernel
    assert Path(tmp_path / "modules").is_dir()  # Transformers really imported the folder's copies


@pytest.mark.usefixtures("cpu_kernels")
def test_a_saved_folder_without_a_kernel_build_runs_at_once_and_names_its_build_command(tmp_path):
    """Remote code where this installation has no build of the fused kernel: the forward compiles nothing, says so
    in one line naming the command that builds it from the folder's own copy, and runs blocked SDPA. That command
    names the package's build (the same sources, flags and installation: the same library)."""
    model = tiny_model("sdpa", ssmax=True)
    model.save_pretrained(tmp_path / "model")
    input_ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(input_ids, use_cache=False).logits
    torch.save(input_ids, tmp_path / "inputs.pt")
    script = HIDE_BAM_LLAMA + textwrap.dedent(
        f"""
        import torch, torch.utils.cpp_extension as extension
        def no_compiling(*arguments, **keywords):
            raise AssertionError("a forward compiled a kernel")
        extension.load = extension.load_inline = no_compiling
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(tmp_path / "model")!r}, trust_remote_code=True).eval()
        with torch.no_grad():
            torch.save(model(torch.load({str(tmp_path / "inputs.pt")!r}), use_cache=False).logits,
                       {str(tmp_path / "logits.pt")!r})
        """
    )
    completed = run_remote_code(script, tmp_path, TORCH_EXTENSIONS_DIR=str(tmp_path / "no-builds"))
    (line,) = [line for line in completed.stderr.splitlines() if "not built" in line]
    assert "blocked SDPA runs instead" in line and "python -m transformers_modules." in line
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), expected, atol=1e-4, rtol=1e-4)
    command = line.split("Build the kernels once with: ")[1]
    built = run_within(["bash", "-c", command], 300, env=remote_code_environment(tmp_path))
    assert built.returncode == 0, built.stderr[-3000:]
    assert built.stdout.strip().endswith(f"fused attention: already built: {library_path(FUSED_CPU)}")


def remote_code_environment(tmp_path) -> dict[str, str]:
    """A subprocess's environment in which Transformers imports remote code into `tmp_path/modules`, offline."""
    return {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}


def run_without_bam_llama(script: str, tmp_path) -> str:
    """Run `script` (which starts with HIDE_BAM_LLAMA) in a fresh Python; its stdout, once it succeeded."""
    return run_remote_code(script, tmp_path).stdout


def run_remote_code(script: str, tmp_path, **variables: str) -> subprocess.CompletedProcess:
    """run_without_bam_llama's run, with more environment variables; its output once it succeeded."""
    result = run_within([sys.executable, "-c", script], 300, env={**remote_code_environment(tmp_path), **variables},
                        cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    return result
