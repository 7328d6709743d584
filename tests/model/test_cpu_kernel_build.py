"""BAM's C++ CPU kernels built ahead of the first forward (model/cpu_kernels_bam.py, `bam-build-kernels`): a forward
only loads a build and never compiles or waits; a build killed midway blocks neither a forward nor the next build;
one build per installation, named by what its command line is made of; the remote code's copy of the sources is the
files'; under CI=true a missing compiler fails the kernel tests.

The kill tests stop a build while its compiler runs (a compiler process in the build's session, read from /proc)."""

import dataclasses
import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import REPO_ROOT, checkout_environment, tiny_model
from waiting import run_within, timeout_scale

from bam_llama.model import cpu_kernels_bam, cpu_sources_bam
from bam_llama.model.cpu_kernels_bam import FUSED_CPU, library_name, library_path
from bam_llama.serving.paged_cpu import PAGED_CPU

MODEL_CSRC = REPO_ROOT / "bam_llama" / "model" / "csrc"
BUILD_COMMAND = [sys.executable, "-m", "bam_llama.cli.build_kernels"]
COMPILERS = {"cc1plus", "c++", "g++", "clang++", "clang"}
needs_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc (Linux)")

# A forward of a saved tiny model in a fresh process where nothing may compile; it saves the logits and how many
# times the model's attention called the fused kernel.
FORWARD = """
import sys, torch, torch.utils.cpp_extension as extension
def no_compiling(*arguments, **keywords):
    raise AssertionError("a forward compiled a kernel")
extension.load = extension.load_inline = no_compiling
import bam_llama.model.decode_step_bam as decode_step
import bam_llama.model.fused_cpu_path_bam as fused_path
from bam_llama import BamLlamaForCausalLM
calls, kernel = [], fused_path.bam_attention_fused_cpu
for module in (decode_step, fused_path):  # the kernel's two call sites (the route's fused and decoding paths)
    module.bam_attention_fused_cpu = lambda *arguments: calls.append(1) or kernel(*arguments)
folder, inputs, out = sys.argv[1:]
model = BamLlamaForCausalLM.from_pretrained(folder).eval()
model.set_attn_implementation("sdpa")
with torch.no_grad():
    logits = model(torch.load(inputs)).logits
torch.save({"logits": logits, "kernel_calls": len(calls)}, out)
"""

# A kernel that compiles in seconds, for the tests that build (its library doubles a tensor).
TINY_KERNEL = """
import sys, torch
from bam_llama.model.cpu_kernels_bam import CpuKernel, build_kernel, load_kernel
SOURCE = '''#include <ATen/ATen.h>
#include <torch/library.h>
at::Tensor twice(const at::Tensor& x) { return x * 2; }
TORCH_LIBRARY(TORCH_EXTENSION_NAME, m) {
  m.def("twice(Tensor x) -> Tensor");
  m.impl("twice", c10::DispatchKey::CPU, &twice);
}
'''
TINY = CpuKernel("bam_test_twice", (("twice.cpp", SOURCE),), "test", "nothing")
if sys.argv[1] == "build":
    path, built_now = build_kernel(TINY)
    print(path, built_now)
else:
    print(getattr(torch.ops, load_kernel(TINY)).twice(torch.arange(3.0)).tolist())
"""


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    """A saved tiny model, its input ids and the eager attention's logits (the float32 materialized reference)."""
    folder = tmp_path_factory.mktemp("saved")
    tiny_model("sdpa", ssmax=True).save_pretrained(folder / "model")
    input_ids = torch.randint(0, 97, (2, 300), generator=torch.Generator().manual_seed(0))
    torch.save(input_ids, folder / "inputs.pt")
    with torch.no_grad():
        expected = tiny_model("eager", ssmax=True)(input_ids).logits
    return folder, expected


def forward_in_fresh_process(saved_model, tmp_path, **variables) -> tuple[dict, list[str]]:
    """FORWARD's results and the lines of its stderr that say a kernel is not built."""
    folder, _ = saved_model
    out = tmp_path / "forward.pt"
    completed = run_within([sys.executable, "-c", FORWARD, str(folder / "model"), str(folder / "inputs.pt"), str(out)],
                           300, env=checkout_environment(**variables))
    assert completed.returncode == 0, completed.stderr[-3000:]
    return torch.load(out), [line for line in completed.stderr.splitlines() if "not built" in line]


def wait_until_compiling(builder: subprocess.Popen) -> None:
    """Return once a compiler process of the builder's session runs: the build is midway."""
    deadline = time.monotonic() + 600 * timeout_scale()  # a safety net for a hung build, not a measurement
    while builder.poll() is None and time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and os.getsid(int(entry.name)) == builder.pid and \
                        (entry / "comm").read_text().strip() in COMPILERS:
                    return
            except OSError:  # the process ended meanwhile
                continue
        time.sleep(0.05)
    builder.kill()
    pytest.fail(f"the build never reached its compiler (exit status {builder.poll()})", pytrace=False)


def kill_midway(command: list[str], environment: dict[str, str]) -> None:
    """Start `command` (a build) in a session of its own and kill the session while its compiler runs."""
    builder = subprocess.Popen(command, env=environment, start_new_session=True, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    wait_until_compiling(builder)
    os.killpg(builder.pid, signal.SIGKILL)
    builder.wait()


def lock_is_free(lock: Path) -> bool:
    with open(lock, "a") as file:
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True


def test_the_remote_codes_copy_of_the_sources_is_the_files():
    """cpu_sources_bam.py (what a saved folder builds from) holds model/csrc's files, every one, verbatim; the package
    builds from the files themselves. `.ci/kernel-source-copy --check` agrees."""
    files = {path.name: path.read_text(encoding="utf-8") for path in MODEL_CSRC.iterdir()}
    assert cpu_sources_bam.SOURCES == files
    assert dict(FUSED_CPU.sources) == files
    completed = run_within([sys.executable, str(REPO_ROOT / ".ci" / "kernel-source-copy"), "--check"], 60)
    assert completed.returncode == 0, completed.stdout


def test_the_build_is_named_by_what_its_command_line_is_made_of(monkeypatch, tmp_path):
    """Another source, flag, compiler, PyTorch or Python headers: another library (and folder); the same inputs: the
    same one, in any process. Where builds live does not name them."""
    name = library_name(FUSED_CPU)
    edited = tuple((file, text.replace("KEY_TILE = 512", "KEY_TILE = 256")) for file, text in FUSED_CPU.sources)
    assert edited != FUSED_CPU.sources
    names = [name, library_name(dataclasses.replace(FUSED_CPU, sources=edited))]
    other_capability = "AVX2" if torch.backends.cpu.get_cpu_capability() != "AVX2" else "AVX512"
    compiler = tmp_path / "c++"
    compiler.write_text("#!/bin/sh\n")
    compiler.chmod(0o755)
    changes = [
        (torch.backends.cpu, "get_cpu_capability", lambda: other_capability),
        (torch, "__version__", "0.0.1"),
        (torch, "__file__", str(tmp_path / "torch" / "__init__.py")),
        (cpu_kernels_bam.sysconfig, "get_path", lambda *arguments, **keywords: str(tmp_path / "include")),
    ]
    for target, attribute, value in changes:
        with monkeypatch.context() as patch:
            patch.setattr(target, attribute, value)
            names.append(library_name(FUSED_CPU))
    with monkeypatch.context() as patch:
        patch.setenv("CXX", str(compiler))
        names.append(library_name(FUSED_CPU))
    assert len(set(names)) == len(names)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "elsewhere"))
    assert library_name(FUSED_CPU) == name and library_path(FUSED_CPU).is_relative_to(tmp_path / "elsewhere")
    script = "from bam_llama.model.cpu_kernels_bam import FUSED_CPU, library_name; print(library_name(FUSED_CPU))"
    fresh = run_within([sys.executable, "-c", script], 300, env=checkout_environment())
    assert fresh.stdout.strip() == name, fresh.stderr[-2000:]


def test_the_switch_and_its_former_name(monkeypatch):
    for variable in (cpu_kernels_bam.SWITCH, cpu_kernels_bam.FORMER_SWITCH):
        monkeypatch.delenv(variable, raising=False)
    assert cpu_kernels_bam.cpu_kernels_enabled()
    monkeypatch.setenv(cpu_kernels_bam.FORMER_SWITCH, "0")
    assert not cpu_kernels_bam.cpu_kernels_enabled()
    monkeypatch.setenv(cpu_kernels_bam.SWITCH, "1")  # the current name wins
    assert cpu_kernels_bam.cpu_kernels_enabled()
    monkeypatch.setenv(cpu_kernels_bam.SWITCH, "0")
    assert not cpu_kernels_bam.cpu_kernels_enabled()


def test_without_a_build_one_line_per_process_says_so(monkeypatch, tmp_path, caplog):
    """Where this installation has no build, loading any kernel, any number of times, returns None and the process
    gets one line, naming the folder it looked in and the command."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_kernels_bam, "_loaded", set())  # a fresh process's
    monkeypatch.setattr(cpu_kernels_bam, "_said_not_built", False)
    assert [cpu_kernels_bam.load_kernel(kernel) for kernel in (FUSED_CPU, FUSED_CPU, PAGED_CPU)] == [None] * 3
    (line,) = [record.getMessage() for record in caplog.records]
    assert str(library_path(FUSED_CPU).parent) in line and line.endswith("Build the kernels once with: bam-build-kernels")


@pytest.mark.usefixtures("cpu_kernels")
def test_a_fresh_process_runs_the_built_kernel_without_compiling(saved_model, tmp_path):
    _, expected = saved_model
    results, not_built = forward_in_fresh_process(saved_model, tmp_path)
    assert not_built == [] and results["kernel_calls"] == 2  # both layers
    torch.testing.assert_close(results["logits"], expected, atol=1e-4, rtol=1e-4)


@needs_proc
def test_a_build_killed_midway_blocks_no_forward(saved_model, tmp_path, monkeypatch):
    """`bam-build-kernels` killed while it compiles (its whole session: ninja, the compiler): a forward in a new
    process runs blocked SDPA at once, says in one line that the kernel is not built and how to build it, and gets
    the right logits; the killed build left its staging folder, no library, and no lock anyone waits on."""
    _, expected = saved_model
    builds = tmp_path / "builds"
    kill_midway(BUILD_COMMAND, checkout_environment(TORCH_EXTENSIONS_DIR=str(builds)))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(builds))
    folder = library_path(FUSED_CPU).parent
    assert not folder.exists() and list(folder.parent.glob(f"{folder.name}.staging-*"))
    results, not_built = forward_in_fresh_process(saved_model, tmp_path, TORCH_EXTENSIONS_DIR=str(builds))
    assert len(not_built) == 1 and not_built[0].endswith("Build the kernels once with: bam-build-kernels")
    assert "blocked SDPA runs instead" in not_built[0] and results["kernel_calls"] == 0
    torch.testing.assert_close(results["logits"], expected, atol=1e-4, rtol=1e-4)
    assert lock_is_free(folder.parent / f"{folder.name}.lock")


@needs_proc
def test_a_build_killed_midway_blocks_no_later_build(tmp_path):
    """A later build of the same library proceeds (the killed one's lock died with it), removes the killed one's
    staging folder, and renames a library that loads in a fresh process into place."""
    script = tmp_path / "twice.py"
    script.write_text(TINY_KERNEL)
    builds = tmp_path / "builds"
    environment = checkout_environment(TORCH_EXTENSIONS_DIR=str(builds))
    kill_midway([sys.executable, str(script), "build"], environment)
    (killed,) = (builds / "bam_llama").glob("bam_test_twice_*.staging-*")
    built = run_within([sys.executable, str(script), "build"], 600, env=environment)
    assert built.returncode == 0, built.stderr[-3000:]
    path, built_now = built.stdout.split()
    assert built_now == "True" and Path(path).is_file() and not killed.exists()
    assert list((builds / "bam_llama").glob("*.staging-*")) == []
    loaded = run_within([sys.executable, str(script), "load"], 300, env=environment)
    assert loaded.stdout.strip() == "[0.0, 2.0, 4.0]", loaded.stderr[-3000:]


def test_under_ci_a_missing_compiler_fails_the_kernel_tests_instead_of_skipping(tmp_path):
    """No compiler (CXX names a missing one) and no build: the suite's build ahead fails; the kernel tests then skip
    on a developer's machine and fail under CI=true."""
    test = "tests/model/test_fused_cpu.py::test_two_threads_give_what_one_gives"
    outcomes = {}
    for ci in ("true", ""):
        environment = checkout_environment(CI=ci, CXX=str(tmp_path / "missing-c++"),
                                           TORCH_EXTENSIONS_DIR=str(tmp_path / "builds"))
        outcomes[ci] = run_within([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", test], 600,
                                  cwd=REPO_ROOT, env=environment)
    failed, skipped = outcomes["true"], outcomes[""]
    assert failed.returncode == 1 and "1 error" in failed.stdout, failed.stdout[-3000:]
    assert "no C++ compiler" in failed.stdout and "CI=true requires them" in failed.stdout
    assert skipped.returncode == 0 and "1 skipped" in skipped.stdout and "no C++ compiler" in skipped.stdout
