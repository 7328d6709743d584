"""How much a newcomer has to read: the package's longest functions, its files over 600 lines, the imports that
sit inside functions and the `TYPE_CHECKING` blocks, per part (issue 43's before-and-after figures).

    python benchmarks/code_layout.py            # a Markdown report on stdout
    python benchmarks/code_layout.py --json     # the same figures as JSON

It reads the source as text (`ast`), imports nothing of the package and runs in about a second.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "bam_llama"
LONG_FILE_LINES = 600
LONGEST_SHOWN = 10


@dataclass
class FunctionLength:
    where: str
    lines: int


@dataclass
class Layout:
    files: int
    lines: int
    long_files: dict[str, int]
    longest_functions: list[FunctionLength]
    imports_in_functions: dict[str, int]
    type_checking_blocks: int


def part_of(path: Path, package: Path) -> str:
    relative = path.relative_to(package)
    return relative.parts[0] if len(relative.parts) > 1 else relative.name


def functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def imports_inside_functions(node: ast.AST) -> int:
    """Import statements anywhere inside the functions below `node` (a nested function's counted once)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return sum(isinstance(inner, (ast.Import, ast.ImportFrom)) for inner in ast.walk(node))
    return sum(imports_inside_functions(child) for child in ast.iter_child_nodes(node))


def is_type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def measure(package: Path = PACKAGE) -> Layout:
    long_files, lengths, in_functions, type_checking, total_lines = {}, [], Counter(), 0, 0
    sources = sorted(package.rglob("*.py"))
    for path in sources:
        text = path.read_text(encoding="utf-8")
        name = path.relative_to(package.parent).as_posix()
        lines = text.count("\n")
        total_lines += lines
        if lines > LONG_FILE_LINES:
            long_files[name] = lines
        tree = ast.parse(text)
        for function in functions(tree):
            lengths.append(FunctionLength(f"{name}:{function.name}", function.end_lineno - function.lineno + 1))
        in_functions[part_of(path, package)] += imports_inside_functions(tree)
        type_checking += sum(is_type_checking_block(node) for node in ast.walk(tree))
    lengths.sort(key=lambda item: (-item.lines, item.where))
    return Layout(len(sources), total_lines, long_files, lengths[:LONGEST_SHOWN], dict(sorted(in_functions.items())),
                  type_checking)


def markdown(layout: Layout) -> str:
    lines = [f"{layout.files} files, {layout.lines} lines in `bam_llama/`", "",
             f"Files over {LONG_FILE_LINES} lines: " + (", ".join(f"`{k}` ({v})" for k, v in layout.long_files.items())
                                                         or "none"), "",
             "Longest functions:", ""]
    lines += [f"- `{item.where}`: {item.lines} lines" for item in layout.longest_functions]
    imports = layout.imports_in_functions
    lines += ["", f"Imports inside functions: {sum(imports.values())} "
                  f"({', '.join(f'{part} {count}' for part, count in imports.items() if count)}); "
                  f"`TYPE_CHECKING` blocks: {layout.type_checking_blocks}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    layout = measure()
    print(json.dumps(asdict(layout), indent=2) if args.json else markdown(layout))
    return 0


if __name__ == "__main__":
    sys.exit(main())
