"""Compile the fused GGD-BAM kernels ahead of time for NVIDIA GPUs, without a GPU, and report their resources.

Every kernel of `bam_llama/model/triton_kernels_bam.py` is compiled with Triton's own compiler (ptxas ships in the
triton wheel) in every configuration the launcher (`triton_bam.cuda_launch_configs`) can pick: each autotune
config of the prefill kernels, each decode tile and combine split block, every supported head size and 16/32-bit
dtype, and the flag sets (padding, documents, prior/SSMax gradients) given by --flags. So are the vLLM plugin's
paged kernels (`bam_llama/serving/paged_kernels.py`: paged_prefill, paged_decode, paged_write), in the launches
`paged_triton.cuda_launch_configs` lists for 1 to 16 query heads per key/value head, SSMax on or off.

One JSON object per compiled variant goes to --json (keys: kernel, arch, dtype, head_dim, config, compiled,
n_regs, n_spills, shared_bytes, shared_limit, loop_instructions) and a markdown table to stdout; each variant is
named on stderr before it compiles. --check makes the result a verdict: exit status 1 when a variant does not
compile, spills registers or exceeds the shared memory limit (.ci/gpu-readiness runs it so on every bf16 launch at
head sizes 64 and 128). --sample compiles only the first launch the launcher lists for each kernel (the suite's
tests/project/test_gpu_readiness.py); --list prints the variants as JSON lines and compiles nothing.

- n_spills is what `CompiledKernel.n_spills` reports on a GPU: the local memory per thread (ptxas' stack frame)
  in 4-byte words. ptxas' spill stores are in the same place (any spill needs a stack frame).
- shared_limit is the opt-in shared memory per block: 227 KiB on sm_90 (H100), 163 KiB on sm_80 (A100).
- loop_instructions: SASS instructions in each innermost loop body (one iteration over a key or query tile),
  from cuobjdump; "/"-separated in code order when a kernel has several innermost loops: for the prefill kernels
  first the masked tiles (diagonal, padding, document boundaries), then the unmasked interior. The table also
  shows them per score (times the threads of a program, over BLOCK_M x BLOCK_N).

    python benchmarks/gpu_readiness.py --arch 90 80 --json benchmarks/results/gpu-readiness.jsonl
    python benchmarks/gpu_readiness.py --dtype bf16 --head-dim 128 --kernel forward dq
    python benchmarks/gpu_readiness.py --dtype bf16 --head-dim 64 128 --check     # .ci/gpu-readiness
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import io
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # the compiler, not the interpreter: set before triton is imported
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bam_llama.model import triton_bam  # noqa: E402
from bam_llama.model.triton_kernels_bam import activate_kernels  # noqa: E402
from bam_llama.serving import paged_kernels, paged_triton  # noqa: E402

ARCHS = (90, 80)
SHARED_LIMIT = {90: 232448, 80: 166912}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
HEAD_DIMS = (32, 48, 64, 80, 96, 128, 256)
KERNELS = tuple(triton_bam.KERNEL_NAMES) + tuple(paged_triton.KERNEL_NAMES)
FLAG_NAMES = ("HAS_KEY_VALID", "HAS_DOCS", "PRIOR_GRADS", "SSMAX_GRAD", "SSMAX_PRIOR", "HAS_SSMAX")
FLAG_SETS = {
    "all": {name: True for name in FLAG_NAMES},
    "none": {name: False for name in FLAG_NAMES},
    "baseline": {**{name: False for name in FLAG_NAMES}, "HAS_PRIOR": False},  # plain causal attention
}
KEYS = ("kernel", "arch", "dtype", "head_dim", "config", "compiled", "n_regs", "n_spills", "shared_bytes",
        "shared_limit", "loop_instructions")

# Element type of each pointer argument that is not a query/key/value-like tensor (those take the input dtype).
POINTER_TYPES = {"Positions": "*i64", "KeyValid": "*u8", "DocIds": "*i32", "DocStart": "*i32", "DocEnd": "*i32",
                 "PaddingEnd": "*i32", "BlockTable": "*i32", "QueryStart": "*i32", "SeqLens": "*i32", "Slots": "*i64"}
INPUT_LIKE = {"Q", "K", "V", "Out", "GradOut", "GradQ", "GradK", "GradV", "Cache", "Key", "Value"}
FLOAT_SCALARS = {"scaling"}


def signature(kernel, dtype_name: str, constants: dict) -> tuple[dict, dict]:
    """Argument types as the launcher passes them: pointers, unit feature strides (constexpr 1, as Triton
    specializes them), 16-divisible other strides, int32 sizes."""
    types, attrs = {}, {}
    constants = dict(constants)
    for index, name in enumerate(kernel.arg_names):
        if name in constants or kernel.params[index].is_constexpr:
            types[name] = "constexpr"
        elif name[0].isupper():
            element = f"*{dtype_name}" if name in INPUT_LIKE else "*fp32"
            types[name] = POINTER_TYPES.get(name, element)
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif name.startswith("stride") and name.endswith("d"):
            types[name] = "constexpr"
            constants[name] = 1
        elif name.startswith("stride"):
            types[name] = "i32"
            attrs[(index,)] = [["tt.divisibility", 16]]
        else:
            types[name] = "fp32" if name in FLOAT_SCALARS else "i32"
    return types, attrs, constants


def kernel_constants(kernel, kind: str, dtype_name: str, head_dim: int, flags: dict, config) -> dict:
    values = dict(HEAD_DIM=head_dim, BLOCK_D=triton_bam.dot_tile_size(head_dim),
                  **triton_bam.dot_options(DTYPES[dtype_name]), **flags, **dict(config.meta))
    constants = {param.name: param.default for param in kernel.params  # constexpr defaults (HAS_PRIOR=True)
                 if param.is_constexpr and param.default is not inspect.Parameter.empty}
    constants.update({name: value for name, value in values.items() if name in kernel.arg_names})
    return constants


def compile_variant(triton, kernel, constants, dtype_name, arch, config):
    """(compiled kernel, ptxas log) or raises."""
    from triton.backends.compiler import GPUTarget

    types, attrs, constants = signature(kernel, dtype_name, constants)
    source = triton.compiler.ASTSource(fn=kernel, signature=types, constexprs=constants, attrs=attrs)
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                                  options=dict(num_warps=config.num_warps, num_stages=config.num_stages))
    return compiled, log.getvalue()


def resources(compiled, log: str) -> dict:
    registers = re.search(r"Used (\d+) registers", log)
    stack = re.search(r"(\d+) bytes stack frame", log)
    return dict(
        n_regs=int(registers.group(1)) if registers else None,
        n_spills=int(stack.group(1)) // 4 if stack else None,
        shared_bytes=compiled.metadata.shared,
    )


def innermost_loop_sizes(sass: str) -> list[int]:
    """Instruction count of every innermost loop: a branch back to an earlier label, with no such loop inside."""
    lines = [line.strip() for line in sass.splitlines() if line.strip()]
    labels, instructions, loops = {}, 0, []
    for line in lines:
        if re.match(r"^[.\w]+:$", line):
            labels[line[:-1]] = instructions
            continue
        if line.startswith("Function:"):
            continue
        instructions += 1
        branch = re.search(r"\bBRA\s+`?\(?([.\w]+)", line)
        if branch and branch.group(1) in labels and labels[branch.group(1)] < instructions:
            loops.append((labels[branch.group(1)], instructions))
    loops = [(a, b) for a, b in loops if b - a > 2]  # not the branch-to-self after EXIT
    innermost = [(a, b) for a, b in loops if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in loops)]
    return [b - a for a, b in sorted(innermost)]


def launch_configs(kind: str, head_dim: int, dtype: torch.dtype) -> list:
    """The launcher's configurations of one kernel (the model's kernels, or the serving plugin's paged ones); none
    for a head size the launcher does not run on a GPU."""
    if not triton_bam.head_dim_supported(head_dim, dtype):
        return []
    if kind in paged_triton.KERNEL_NAMES:
        return paged_triton.cuda_launch_configs(kind, head_dim, dtype)
    return triton_bam.cuda_launch_configs(kind, triton_bam.dot_tile_size(head_dim), dtype)


def matrix(args):
    kernels = {**activate_kernels(), **paged_kernels.activate_kernels()}
    names = {**triton_bam.KERNEL_NAMES, **paged_triton.KERNEL_NAMES}
    for kind in args.kernel:
        for dtype_name in args.dtype:
            for head_dim in args.head_dim:
                configs = launch_configs(kind, head_dim, DTYPES[dtype_name])
                for config in configs[:1] if args.sample else configs:
                    for flag_name in args.flags:
                        kernel = kernels[names[kind]]
                        if flag_name == "baseline" and "HAS_PRIOR" not in kernel.arg_names:
                            continue
                        constants = kernel_constants(kernel, kind, dtype_name, head_dim, FLAG_SETS[flag_name], config)
                        flags = [name for name in FLAG_NAMES if constants.get(name)]
                        flags = "no prior, no mask (baseline)" if flag_name == "baseline" else ",".join(flags) or "none"
                        label = f"{config}" + (f" flags={flags}" if kind not in ("decode_combine", "paged_write") else "")
                        for arch in args.arch:
                            yield kind, kernel, dtype_name, head_dim, config, constants, label, arch


def readiness_rows(args):
    triton = __import__("triton")
    from triton import knobs

    knobs.nvidia.dump_ptxas_log = True  # the register / stack report, printed by make_cubin
    knobs.compilation.always_compile = True  # a cache hit would skip ptxas and its report
    variants = list(matrix(args))
    for number, (kind, kernel, dtype_name, head_dim, config, constants, label, arch) in enumerate(variants, 1):
        print(f"[{number}/{len(variants)}] compiling {kind} for sm_{arch}, {dtype_name}, head size {head_dim}: {label}",
              file=sys.stderr, flush=True)
        row = dict(kernel=kind, arch=f"sm_{arch}", dtype=dtype_name, head_dim=head_dim, config=label,
                   compiled=False, n_regs=None, n_spills=None, shared_bytes=None, shared_limit=SHARED_LIMIT[arch],
                   loop_instructions=None)
        try:
            compiled, log = compile_variant(triton, kernel, constants, dtype_name, arch, config)
        except Exception as error:  # noqa: BLE001 - a failed compile is a result, reported in the table
            row["error"] = str(error).strip().splitlines()[-1][:200] if str(error).strip() else type(error).__name__
        else:
            row.update(compiled=True, **resources(compiled, log))
            loops = innermost_loop_sizes(compiled.asm["sass"])
            row["loop_instructions"] = "/".join(str(n) for n in loops) or "-"
            row["per_score"] = per_score(loops, config)
        yield row


def per_score(loops: list[int], config) -> str:
    """Loop instructions per score of the (rows, BLOCK_N) tile: each thread runs the loop body once per tile. Rows:
    BLOCK_M, or BLOCK_Q x GROUP (paged prefill), or ROWS (paged decode)."""
    meta = dict(config.meta)
    if "BLOCK_N" not in meta or not loops:
        return "-"
    rows = meta.get("BLOCK_M") or meta.get("ROWS") or meta["BLOCK_Q"] * meta["GROUP"]
    threads = 32 * config.num_warps
    return "/".join(f"{n * threads / (rows * meta['BLOCK_N']):.1f}" for n in loops)


def failures(rows) -> list[dict]:
    """The variants a GPU could not run as launched: not compiled, registers spilled, or too much shared memory."""
    return [row for row in rows
            if not row["compiled"] or row["n_spills"] != 0 or row["shared_bytes"] > row["shared_limit"]]


def listed_variants(args) -> list[dict]:
    """The variants `readiness_rows` would compile, without compiling them."""
    return [dict(kernel=kind, arch=f"sm_{arch}", dtype=dtype_name, head_dim=head_dim, config=label)
            for kind, _, dtype_name, head_dim, _, _, label, arch in matrix(args)]


def markdown(rows) -> str:
    header = ["kernel", "arch", "dtype", "d", "config", "compiled", "regs", "spills", "shared", "limit",
              "loop insts", "insts/score"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        ok = "yes" if row["compiled"] else f"no ({row.get('error', '')})"
        cells = [row["kernel"], row["arch"], row["dtype"], row["head_dim"], row["config"], ok, row["n_regs"],
                 row["n_spills"], row["shared_bytes"], row["shared_limit"], row["loop_instructions"],
                 row.get("per_score")]
        lines.append("| " + " | ".join("-" if cell is None else str(cell) for cell in cells) + " |")
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, nargs="+", default=list(ARCHS), choices=ARCHS)
    parser.add_argument("--dtype", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--head-dim", type=int, nargs="+", default=list(HEAD_DIMS), choices=HEAD_DIMS)
    parser.add_argument("--kernel", nargs="+", default=list(KERNELS), choices=KERNELS)
    parser.add_argument("--flags", nargs="+", default=["all"], choices=list(FLAG_SETS),
                        help="flag sets: 'all' turns on padding, documents and every gradient (the most registers), "
                             "'none' turns them off, 'baseline' also drops the prior (kernels that can)")
    parser.add_argument("--json", type=Path, help="write one JSON object per compiled variant to this file")
    parser.add_argument("--sample", action="store_true",
                        help="only the first launch configuration of each kernel, head size and dtype")
    parser.add_argument("--check", action="store_true",
                        help="exit with status 1 if a variant does not compile, spills or exceeds the shared memory")
    parser.add_argument("--list", action="store_true", help="print the variants as JSON lines; compile nothing")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        __import__("triton")
    except ImportError:
        print("gpu_readiness: the `triton` package is not installed", file=sys.stderr)
        return 2
    if args.list:
        print("\n".join(json.dumps(variant) for variant in listed_variants(args)))
        return 0
    start = time.time()
    rows = list(readiness_rows(args))
    elapsed = time.time() - start
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=args.json.parent, delete=False, suffix=".tmp") as handle:
            for row in rows:
                handle.write(json.dumps({key: row[key] for key in KEYS}) + "\n")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(handle.name, 0o666 & ~umask)  # a temporary file is private (0600); the result is not
        os.replace(handle.name, args.json)
    print(markdown(rows))
    print(f"\n{len(rows)} variants compiled in {elapsed:.0f} s; triton {__import__('triton').__version__}")
    if args.check and failures(rows):
        for row in failures(rows):
            print(f"gpu_readiness: not ready: {json.dumps({key: row.get(key) for key in (*KEYS, 'error')})}",
                  file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
