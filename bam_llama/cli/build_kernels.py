"""`bam-build-kernels`: build BAM's C++ CPU kernels for this Python and PyTorch, once, ahead of the first forward.

    bam-build-kernels [--check] [--verbose]
"""

import argparse
import sys

from ..files.outputs import exit_on_sigterm
from .reporting import run_reported

DESCRIPTION = (
    "Build BAM's C++ CPU kernels (the fused attention; the vLLM plugin's paged decode) for this Python and PyTorch, "
    "into $TORCH_EXTENSIONS_DIR/bam_llama (else ~/.cache/torch_extensions/bam_llama), one folder per installation. "
    "Needs a C++ compiler (g++, or $CXX) and ninja. A forward never compiles: where they are not built, attention "
    "runs in PyTorch (slower) and says so in one line."
)


class KernelsNotReady(Exception):
    """A build failed, or --check found a kernel without one."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bam-build-kernels", description=DESCRIPTION)
    parser.add_argument("--check", action="store_true",
                        help="only say whether each kernel is built for this installation (exit 1 where one is not)")
    parser.add_argument("--verbose", action="store_true", help="show the compiler's command lines")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    exit_on_sigterm()
    status = run_reported("bam-build-kernels", run, args, failures=(KernelsNotReady,))
    if status:
        sys.exit(status)


def run(args) -> None:
    from ..model.cpu_kernels_bam import FUSED_CPU, KernelBuildError, build_and_report, library_path
    from ..serving.paged_cpu import PAGED_CPU

    kernels = [FUSED_CPU, PAGED_CPU]
    if args.check:
        for kernel in kernels:
            state = "built" if library_path(kernel).is_file() else "not built"
            print(f"bam-build-kernels: {kernel.label}: {state}: {library_path(kernel)}")
        if not all(library_path(kernel).is_file() for kernel in kernels):
            raise KernelsNotReady("not every kernel is built for this installation: run bam-build-kernels")
        return
    try:
        build_and_report(kernels, "bam-build-kernels", args.verbose)
    except KernelBuildError as error:
        raise KernelsNotReady(str(error)) from None


if __name__ == "__main__":
    main()
