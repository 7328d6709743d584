"""BAM's C++ CPU kernels: built once per installation ahead of the first forward, and only loaded by a forward.

A kernel (`CpuKernel`: a name and its C++ sources) is built by `build_kernel`, which the command
`bam-build-kernels` runs (a saved folder's remote code without the package: `python -m <this module>`, the line a
forward prints says it in full), with PyTorch's own `torch.utils.cpp_extension.load`. Its folder,
`$TORCH_EXTENSIONS_DIR/bam_llama/<stem>_<key>` (else `~/.cache/torch_extensions/bam_llama/...`), is named by a hash
of everything its build's command line is made of: the sources, the flags (the CPU's vector instructions among
them), the compiler, PyTorch's version and place, Python's headers. A process of another venv, compiler or source
looks for another folder and never rebuilds this one, and a finished folder is never written again: the build runs
in a staging folder beside it that is renamed into place once its library loads.

A forward only loads (`load_kernel`). Where this installation's folder holds no library, or it does not load, the
caller's PyTorch path runs at once and one line per process says so and names the command that builds it. Nothing
here waits on a compiler or on another process: builders take an OS lock (fcntl.flock, released by the kernel when
its holder dies, so a killed build blocks no one), readers none, and the next build removes a killed one's staging
folder.

`BAM_CPU_KERNELS=0` switches every C++ CPU kernel off (`BAM_FUSED_CPU=0`, its former name, still does).

The sources are C++ files, `model/csrc/` (and serving/csrc/ for vLLM's decode). A saved folder's remote code is
model/'s .py files only (Transformers copies `modeling_bam.py` and the modules it imports relatively), so the fused
kernel's sources travel as the generated module `cpu_sources_bam.py`, kept equal to the files by
tests/model/test_cpu_kernel_build.py and rewritten by `.ci/kernel-source-copy`; the package builds from the files.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import logging
import os
import shlex
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch
import torch.utils.cpp_extension

from .cpu_sources_bam import SOURCES

try:
    import fcntl
except ImportError:  # Windows: builders do not lock (a race costs a second build, never a broken folder)
    fcntl = None

SWITCH = "BAM_CPU_KERNELS"
FORMER_SWITCH = "BAM_FUSED_CPU"
BUILD_COMMAND = "bam-build-kernels"
CSRC = Path(__file__).with_name("csrc")
COMMON_HEADER = "cpu_kernel_common.h"
LIBRARY_SUFFIX = getattr(torch.utils.cpp_extension, "LIB_EXT", ".so")

logger = logging.getLogger(__name__)


class KernelBuildError(RuntimeError):
    """A kernel that could not be built: no compiler, or the compiler failed (its output printed before)."""


@dataclasses.dataclass(frozen=True)
class CpuKernel:
    """A C++ library of operators: `stem` (its name before the build's key), `sources` ((file name, C++ text) pairs:
    the .cpp files are compiled, the rest included), `label` (what it is, for messages) and `fallback` (what runs
    where it is not built)."""

    stem: str
    sources: tuple[tuple[str, str], ...]
    label: str
    fallback: str


def csrc_sources(folder: Path, names: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    return tuple((name, (folder / name).read_text(encoding="utf-8")) for name in names)


def payload_sources(names: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """model/csrc's files where the package has them, else (a saved folder's remote code) their copy."""
    return csrc_sources(CSRC, names) if CSRC.is_dir() else tuple((name, SOURCES[name]) for name in names)


FUSED_CPU = CpuKernel("bam_fused_cpu", payload_sources((COMMON_HEADER, "fused_cpu.cpp")), "fused attention",
                      "blocked SDPA")


# ---------------------------------------------------------------------------------------------- the build's key


def _openmp_flags() -> list[str]:
    """-fopenmp where PyTorch's own threads are OpenMP's: ATen's parallel_for is a header of `#pragma omp` loops,
    serial without it (the library then links the libgomp.so.1 PyTorch has already loaded)."""
    return ["-fopenmp"] if torch.backends.openmp.is_available() and sys.platform.startswith("linux") else []


def compile_flags() -> list[str]:
    capability = torch.backends.cpu.get_cpu_capability()
    flags = ["-O3", "-std=c++17", *_openmp_flags()]
    if capability == "AVX512":
        flags += ["-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512", "-mavx512f", "-mavx512bw", "-mavx512vl",
                  "-mavx512dq", "-mfma"]
    elif capability == "AVX2":
        flags += ["-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2", "-mavx2", "-mfma", "-mf16c"]
    return flags


def compiler() -> str:
    """The compiler PyTorch's build runs (CXX, else c++) as the file it resolves to; "" where there is none."""
    found = shutil.which(torch.utils.cpp_extension.get_cxx_compiler())
    return os.path.realpath(found) if found else ""


def build_inputs(kernel: CpuKernel) -> list[str]:
    """What the build's command line is made of, besides the folder it runs in."""
    return [
        *(f"{name}\n{text}" for name, text in kernel.sources), *compile_flags(), *_openmp_flags(), compiler(),
        torch.__version__, os.path.dirname(torch.__file__), sysconfig.get_path("include", scheme="posix_prefix"),
        sys.implementation.cache_tag,
    ]


def library_name(kernel: CpuKernel) -> str:
    """The library's name and operator namespace (torch.ops.<name>): its stem and the hash of its build inputs."""
    digest = hashlib.sha256("\0".join(build_inputs(kernel)).encode()).hexdigest()[:16]
    return f"{kernel.stem}_{digest}"


def builds_root() -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or torch.utils.cpp_extension.get_default_build_root()
    return Path(root) / "bam_llama"


def library_path(kernel: CpuKernel) -> Path:
    name = library_name(kernel)
    return builds_root() / name / f"{name}{LIBRARY_SUFFIX}"


# ---------------------------------------------------------------------------------------------- loading


_loaded: set[str] = set()
_said_not_built = False


def cpu_kernels_enabled() -> bool:
    """Whether the C++ CPU kernels may run (BAM_CPU_KERNELS=0, or BAM_FUSED_CPU=0, switches them off; read at
    every call)."""
    return os.environ.get(SWITCH, os.environ.get(FORMER_SWITCH, "1")) != "0"


def load_kernel(kernel: CpuKernel) -> str | None:
    """The kernel's operator namespace once its built library is loaded; None where this installation has none (or
    it does not load), after one line per process saying so. Never compiles, never waits."""
    name = library_name(kernel)
    if name in _loaded:
        return name
    path = library_path(kernel)
    if not path.is_file():
        _say_not_built(kernel, f"no build at {path.parent}")
        return None
    try:
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as error:
        _say_not_built(kernel, f"{path.name} does not load: {str(error).splitlines()[0][:200]}")
        return None
    _loaded.add(name)
    return name


def _say_not_built(kernel: CpuKernel, reason: str) -> None:
    global _said_not_built
    if not _said_not_built:
        _said_not_built = True
        logger.warning(
            "BAM's C++ CPU kernel (%s) is not built for this Python and PyTorch (%s): %s runs instead, slower. "
            "Build the kernels once with: %s", kernel.label, reason, kernel.fallback, build_command(),
        )


def build_command() -> str:
    """The command that builds this installation's kernels: the package's, or this module run from the folder
    Transformers imported a saved folder's remote code into."""
    if __name__.startswith("bam_llama."):
        return BUILD_COMMAND
    root = Path(__file__).resolve().parents[__name__.count(".")]
    return f"PYTHONPATH={shlex.quote(str(root))} {shlex.quote(sys.executable)} -m {__name__}"


# ---------------------------------------------------------------------------------------------- building


def build_kernel(kernel: CpuKernel, verbose: bool = False) -> tuple[Path, bool]:
    """Builds the kernel's library for this installation unless it is built; returns its path and whether it was
    built now (then it is loaded in this process too). Waits for a live process building the same library, never
    for a dead one's lock."""
    path = library_path(kernel)
    if not path.is_file():
        _check_compiler()
        path.parent.parent.mkdir(parents=True, exist_ok=True)
        with _builder_lock(path.parent):
            if not path.is_file():
                _build_into_place(kernel, path.parent, verbose)
                _loaded.add(path.parent.name)
                return path, True
    return path, False


def _build_into_place(kernel: CpuKernel, folder: Path, verbose: bool) -> None:
    """Compile in a staging folder beside `folder` and rename it into place once the library loads."""
    if fcntl is not None:  # we hold the lock: another staging folder of this library is a killed build's
        for stale in folder.parent.glob(f"{folder.name}.staging-*"):
            shutil.rmtree(stale, ignore_errors=True)
    shutil.rmtree(folder, ignore_errors=True)  # a folder without its library: not a finished build
    staging = Path(tempfile.mkdtemp(prefix=f"{folder.name}.staging-", dir=folder.parent))
    try:
        for name, text in kernel.sources:
            (staging / name).write_text(text, encoding="utf-8")
        _ninja_on_path()
        try:
            torch.utils.cpp_extension.load(
                folder.name, [str(staging / name) for name, _ in kernel.sources if name.endswith(".cpp")],
                extra_cflags=compile_flags(), extra_ldflags=_openmp_flags(), build_directory=str(staging),
                is_python_module=False, verbose=verbose,
            )
        except (RuntimeError, OSError) as error:
            print(error, file=sys.stderr)
            raise KernelBuildError(f"the build of the {kernel.label} kernel failed (its output above)") from None
        staging.chmod(0o755)  # mkdtemp's 0o700 would hide the build from a shared TORCH_EXTENSIONS_DIR's users
        os.rename(staging, folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _check_compiler() -> None:
    if not compiler():
        name = torch.utils.cpp_extension.get_cxx_compiler()
        where = "CXX names it" if "CXX" in os.environ else "the default compiler"
        raise KernelBuildError(f"no C++ compiler: {name} ({where}) is not found; install g++ (or set CXX) and build "
                               "again")


def _ninja_on_path() -> None:
    """PyTorch's build runs `ninja` from PATH: the one beside this Python (the `ninja` package's) where PATH, e.g.
    an unactivated venv's, has none."""
    if shutil.which("ninja") is None:
        os.environ["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])


@contextlib.contextmanager
def _builder_lock(folder: Path):
    """An exclusive flock on `<folder>.lock`: held by one builder, released by the OS when it exits or is killed."""
    path = folder.parent / f"{folder.name}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                print(f"waiting for another process building {folder.name}", file=sys.stderr, flush=True)
                fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def build_and_report(kernels: list[CpuKernel], prog: str, verbose: bool = False) -> None:
    """Build each kernel, printing where it lives and how long its build took; a failed build is raised."""
    for kernel in kernels:
        started = time.monotonic()
        path, built = build_kernel(kernel, verbose)
        done = f"built in {time.monotonic() - started:.0f} s" if built else "already built"
        print(f"{prog}: {kernel.label}: {done}: {path}", flush=True)


def main(argv: list[str] | None = None) -> int:
    """`python -m <this module>`: the fused kernel's build where only a saved folder's remote code has it."""
    prog = f"python -m {__spec__.name if __spec__ else __name__}"
    argparse.ArgumentParser(prog=prog, description="Build BAM's fused CPU attention kernel for this Python and "
                            f"PyTorch, into {builds_root()}: once; a forward never compiles.").parse_args(argv)
    try:
        build_and_report([FUSED_CPU], prog)
    except KernelBuildError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
