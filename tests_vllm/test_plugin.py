"""The vLLM plugin is reached only through vLLM's entry point: the package and Hub remote code never import vLLM."""

import ast
import sys
from importlib.metadata import entry_points
from pathlib import Path

from conftest import build_tiny_bam
from waiting import run_within

import bam_llama


def test_entry_point_registers_bam_llama_with_vllm():
    (plugin,) = [point for point in entry_points(group="vllm.general_plugins") if point.name == "bam_llama"]
    assert plugin.value == "bam_llama.serving.vllm_plugin:register"
    script = (
        "import bam_llama.serving.vllm_plugin as plugin; plugin.register(); plugin.register()\n"  # twice: vLLM calls it per process
        "from vllm import ModelRegistry\n"
        "from transformers import AutoConfig\n"
        "assert 'BamLlamaForCausalLM' in ModelRegistry.get_supported_archs()\n"
        "assert ModelRegistry._try_load_model_cls('BamLlamaForCausalLM') is plugin.BamLlamaForCausalLM\n"
        "assert AutoConfig.for_model('bam_llama').model_type == 'bam_llama'\n"
    )
    completed = run_within([sys.executable, "-c", script], 300)
    assert completed.returncode == 0, completed.stderr[-3000:]


def test_no_other_module_of_the_package_imports_vllm():
    """Statically for every module (some need extras this venv lacks), and at run time for the model's modules.
    serving/paged_*.py take plain tensors: tests/serving/ runs them without vLLM."""
    package = Path(bam_llama.__file__).parent
    plugin = package / "serving" / "vllm_plugin.py"
    modules = sorted(path for path in package.rglob("*.py") if path != plugin)
    assert len(modules) > 30 and package / "serving" / "paged_attention.py" in modules
    for path in modules:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            )
            assert not any(name.split(".")[0] == "vllm" for name in names), f"{path} imports {names}"
    script = (
        "import sys, bam_llama, bam_llama.model.modeling_bam, bam_llama.model.configuration_bam, bam_llama.data.tokenizers\n"
        "leaked = sorted(name for name in sys.modules if name.split('.')[0] == 'vllm')\n"
        "assert not leaked, leaked\n"
    )
    completed = run_within([sys.executable, "-c", script], 300)
    assert completed.returncode == 0, completed.stderr[-3000:]


def test_saved_remote_code_does_not_ship_the_plugin(tmp_path):
    folder = build_tiny_bam(tmp_path, seed=0)
    shipped = {path.name for path in folder.glob("*.py")}
    assert "modeling_bam.py" in shipped
    serving = {"vllm_plugin.py", "paged_attention.py", "paged_batch.py", "paged_cpu_path.py", "paged_triton.py",
               "paged_kernels.py"}
    assert not shipped & serving
