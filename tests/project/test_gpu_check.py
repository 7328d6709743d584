"""benchmarks/gpu_check.py on a machine without a GPU: its arguments, the clear line it skips with, the commands
its steps run (checked against the parsers of the scripts they call), its report, and that it and the whole suite
import without the optional packages (DeepSpeed, vLLM, gguf), which the stock CUDA image it targets lacks."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO_ROOT, checkout_environment
from waiting import run_within

SCRIPT = REPO_ROOT / "benchmarks" / "gpu_check.py"
OPTIONAL_PACKAGES = ("deepspeed", "vllm", "gguf")


def load_script(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gpu_check():
    return load_script("gpu_check", SCRIPT)


@pytest.fixture
def without_optional_packages(tmp_path) -> dict[str, str]:
    """A subprocess environment in which importing DeepSpeed, vLLM or gguf fails, as on the stock image."""
    blockers = tmp_path / "blockers"
    blockers.mkdir()
    for name in OPTIONAL_PACKAGES:
        # What a missing package raises (pytest >= 9.1's importorskip skips only this, not a bare ImportError)
        (blockers / f"{name}.py").write_text(
            f"raise ModuleNotFoundError({f'No module named {name!r} (not on the stock image)'!r}, name={name!r})\n")
    environment = checkout_environment(CUDA_VISIBLE_DEVICES="")
    environment["PYTHONPATH"] = f"{blockers}:{environment['PYTHONPATH']}"
    return environment


def run(*arguments, env=None):
    return run_within(
        [sys.executable, str(SCRIPT), *map(str, arguments)], 300, cwd=REPO_ROOT, env=env or checkout_environment(),
    )


def test_the_steps_fit_in_ten_minutes_and_help_lists_them(gpu_check):
    assert sum(gpu_check.STEPS.values()) < 600
    result = run("--help")
    assert result.returncode == 0
    for name, limit in gpu_check.STEPS.items():
        assert f"{name} ({limit} s)" in result.stdout


@pytest.mark.parametrize("arguments, named", [(["--steps", "kernel"], "--steps"), (["--full"], "--full")])
def test_bad_arguments_exit_with_status_2(arguments, named):
    result = run(*arguments)
    assert result.returncode == 2 and named in result.stderr and "Traceback" not in result.stderr


def test_an_output_path_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "taken").write_text("")
    result = run("--out", tmp_path / "taken")
    assert result.returncode == 2 and "is a file, not a folder" in result.stderr.splitlines()[-1]


def test_without_a_gpu_every_step_is_skipped_with_a_clear_line_and_nothing_is_written(tmp_path,
                                                                                      without_optional_packages):
    result = run("--out", tmp_path / "check", "--steps", "kernels", "pretrain", env=without_optional_packages)
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines() == [
        "gpu_check: no CUDA GPU found (torch.cuda.is_available() is False): every step needs one; nothing run, "
        "nothing written"
    ]
    assert result.stdout.splitlines() == ["skipped  kernels: no CUDA GPU", "skipped  pretrain: no CUDA GPU"]
    assert not (tmp_path / "check").exists()


def test_the_pretrain_command_is_one_bam_pretrain_accepts(gpu_check, tmp_path):
    from bam_llama.cli.pretrain import build_parser

    command = gpu_check.pretrain_command(tmp_path / "corpus.txt", tmp_path / "out")
    assert command[1:3] == ["-m", "bam_llama.cli.pretrain"]
    args = build_parser().parse_args(command[3:])
    assert args.bf16 and args.ssmax and args.max_steps == 30 and args.report_to == "none"


def test_the_benchmark_commands_are_ones_attention_py_accepts(gpu_check, tmp_path):
    attention = load_script("attention_benchmark", REPO_ROOT / "benchmarks" / "attention.py")
    for full in (False, True):
        command = gpu_check.benchmark_command(tmp_path / "attention.md", full)
        args = attention.parse_args(command[2:])
        assert args.out == tmp_path / "attention.md" and not args.smoke
        assert args.lengths == ([2048, 16384] if not full else attention.parse_args([]).lengths)


def test_the_pretrain_corpus_is_real_text_that_ships_with_python(gpu_check):
    corpus = gpu_check._documentation_corpus()
    assert len(corpus) > 300_000 and 'The "assert" statement' in corpus  # 30 steps of 8 x 256 bytes use 61,440


def test_the_report_tables_every_step_and_keeps_its_figures(gpu_check, tmp_path):
    results = [
        gpu_check.StepResult("environment", "passed", "H100 (sm_90)", 1.2, {"gpu": "NVIDIA H100"}),
        gpu_check.StepResult("gpu-tests", "skipped", "pytest is not installed", 0.1),
        gpu_check.StepResult("autocast", "failed", "sdpa: RuntimeError", 9.6, {"paths": {"sdpa": {"error": "x"}}}),
    ]
    gpu_check.write_report(results, tmp_path, ["python", "benchmarks/gpu_check.py"])
    table = (tmp_path / "summary.md").read_text()
    assert "NVIDIA H100" in table.splitlines()[2]
    assert "| environment | passed | 1 | H100 (sm_90) |" in table
    assert "| gpu-tests | skipped | 0 | pytest is not installed |" in table
    assert "| autocast | failed | 10 | sdpa: RuntimeError |" in table
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [step["status"] for step in summary["steps"]] == ["passed", "skipped", "failed"]
    assert summary["steps"][2]["figures"] == {"paths": {"sdpa": {"error": "x"}}}


def test_the_suite_and_the_check_import_without_the_optional_packages(without_optional_packages):
    modules = "bam_llama.model.modeling_bam bam_llama.model.triton_bam bam_llama.cli.pretrain bam_llama.training.pretrain"
    imported = run_within(
        [sys.executable, "-c", f"import importlib; [importlib.import_module(m) for m in {modules.split()!r}]; "
         f"import runpy; runpy.run_path({str(SCRIPT)!r}, run_name='gpu_check')"],
        300, cwd=REPO_ROOT, env=without_optional_packages,
    )
    assert imported.returncode == 0, imported.stderr[-3000:]
    collected = run_within(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests"], 600,
        cwd=REPO_ROOT, env=without_optional_packages,
    )
    assert collected.returncode == 0, collected.stdout[-3000:]
    assert "error" not in collected.stdout.splitlines()[-1].lower()
