"""The package's import directions (docs/architecture.md): who may import whom, read from every import statement.

The payload rule itself (bam_llama/model/ imports only itself) is tests/model/test_payload.py.
"""

import ast
from pathlib import Path

from helpers import REPO_ROOT


PACKAGE = REPO_ROOT / "bam_llama"
# part -> the parts it may import (a part is a sub-package or a top-level module); written out, as the doc states it
ALLOWED = {
    "model": set(),
    "registration": {"model"},
    "outputs": set(),
    "model_folders": set(),
    "positional_variants": set(),
    "demo_settings": set(),
    "positional_models": {"model", "positional_variants"},
    "data": {"model", "outputs", "model_folders"},
    "evaluation": {"model", "data", "outputs", "model_folders", "registration"},
    "hub": {"model", "data", "evaluation", "outputs", "model_folders"},
    "training": {"model", "data", "evaluation", "hub", "outputs", "model_folders", "registration", "positional_variants",
                 "positional_models"},
    "conversion": {"model", "data", "hub", "outputs", "model_folders", "positional_variants"},
    "demo": {"model", "data", "evaluation", "outputs", "model_folders", "positional_variants", "positional_models",
             "demo_settings"},
    "serving": {"model", "registration"},
    "cli": {"model", "data", "evaluation", "hub", "training", "conversion", "demo", "outputs", "model_folders",
            "positional_variants", "demo_settings"},
    "__init__": {"model", "registration"},
}


def part_of(path: Path) -> str:
    relative = path.relative_to(PACKAGE)
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def imported_parts(path: Path):
    """(line, part) for every import of the package in `path`, relative or absolute; part None: the package root."""
    package = path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1]  # ("bam_llama", "training")
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else ()
            target = (*base, *(node.module.split(".") if node.module else ()))
            if target[:1] != ("bam_llama",):
                continue
            if len(target) == 1:  # from bam_llama import x / from .. import x
                for alias in node.names:
                    yield node.lineno, alias.name if (PACKAGE / alias.name).exists() or (PACKAGE / f"{alias.name}.py").exists() else None
            else:
                yield node.lineno, target[1]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "bam_llama":
                    yield node.lineno, parts[1] if len(parts) > 1 else None


def test_every_part_imports_only_what_it_may():
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        part = part_of(path)
        allowed = ALLOWED[part] | {part}
        for line, imported in imported_parts(path):
            if imported is None and part != "__init__":
                problems.append(f"{path.relative_to(REPO_ROOT)}:{line} imports the package root")
            elif imported is not None and imported not in allowed:
                problems.append(f"{path.relative_to(REPO_ROOT)}:{line} ({part}) imports {imported}")
    assert not problems, "\n".join(problems)


def test_every_part_is_listed():
    parts = {part_of(path) for path in PACKAGE.rglob("*.py")}
    assert parts == set(ALLOWED)


def test_the_directions_have_no_cycle():
    visiting, done = set(), set()

    def visit(part, trail):
        assert part not in visiting, f"import cycle: {' -> '.join(trail + [part])}"
        if part in done:
            return
        visiting.add(part)
        for imported in ALLOWED[part]:
            visit(imported, trail + [part])
        visiting.discard(part)
        done.add(part)

    for part in ALLOWED:
        visit(part, [])
