"""The commands answer --help without importing the model stack, and `import bam_llama` stays light while still
registering BamLlama with the Auto classes before they can be used (checked in fresh processes)."""

import subprocess
import sys

import pytest
from helpers import checkout_environment, tiny_model
from waiting import run_within

HEAVY = ("torch", "transformers", "tokenizers", "safetensors", "matplotlib")


def run_python(code: str) -> subprocess.CompletedProcess:
    return run_within([sys.executable, "-c", code], 300, env=checkout_environment())


@pytest.mark.parametrize(
    "module",
    [
        "bam_llama.cli.eval", "bam_llama.cli.demo", "bam_llama.cli.finetune", "bam_llama.cli.pretrain", "bam_llama.cli.convert",
        "bam_llama.cli.card", "bam_llama.cli.corpus", "bam_llama.cli.build_kernels",
    ],
)
def test_help_imports_no_heavy_module(module):
    completed = run_python(
        "import runpy, sys\n"
        f"sys.argv = ['{module}', '--help']\n"
        "try:\n"
        f"    runpy.run_module('{module}', run_name='__main__')\n"
        "except SystemExit as exit:\n"
        "    assert exit.code == 0, exit.code\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))\n"
    )
    assert completed.returncode == 0, completed.stderr
    assert "usage:" in completed.stdout and completed.stdout.strip().endswith("[]"), completed.stdout[-500:]


@pytest.fixture(scope="module")
def saved_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model") / "bam"
    tiny_model(vocab_size=50).save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    "imports",
    [
        "import bam_llama\nfrom transformers import AutoConfig, AutoModelForCausalLM",
        "from transformers import AutoConfig, AutoModelForCausalLM\nimport bam_llama",
        "import bam_llama.model.modeling_bam\nfrom transformers import AutoConfig, AutoModelForCausalLM",
        "import bam_llama.model.configuration_bam\nimport transformers\nAutoConfig = transformers.AutoConfig\n"
        "AutoModelForCausalLM = transformers.AutoModelForCausalLM",
    ],
    ids=["bam_llama_first", "transformers_first", "modeling_first", "configuration_first"],
)
def test_auto_classes_load_a_saved_folder_after_import_bam_llama(saved_folder, imports):
    completed = run_python(
        f"{imports}\n"
        f"config = AutoConfig.from_pretrained({str(saved_folder)!r}, trust_remote_code=False)\n"
        f"model = AutoModelForCausalLM.from_pretrained({str(saved_folder)!r}, trust_remote_code=False)\n"
        "print(type(config).__module__, type(model).__module__, type(model).__name__)\n"
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert completed.stdout.split() == ["bam_llama.model.configuration_bam", "bam_llama.model.modeling_bam", "BamLlamaForCausalLM"]
