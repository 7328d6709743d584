"""The package's import directions (docs/architecture.md): who may import whom, read from every import statement.

The payload rule itself (bam_llama/model/ imports only itself) is tests/model/test_payload.py.
"""

import ast
import sys
from pathlib import Path

from helpers import REPO_ROOT


PACKAGE = REPO_ROOT / "bam_llama"
# part -> the parts it may import (a part is a sub-package or a top-level module); written out, as the doc states it
ALLOWED = {
    "model": set(),
    "registration": {"model", "baselines"},
    "files": set(),
    "runtime": set(),
    "positional_variants": set(),
    "positional_models": {"model", "positional_variants"},
    "baselines": {"model"},
    "data": {"model", "files"},
    "evaluation": {"model", "data", "files", "registration", "runtime"},
    "hub": {"model", "data", "evaluation", "files", "positional_variants"},
    "training": {"model", "data", "evaluation", "hub", "files", "registration", "positional_variants",
                 "positional_models", "runtime", "baselines"},
    "conversion": {"model", "data", "hub", "files", "positional_variants"},
    "demo": {"model", "data", "evaluation", "training", "files", "positional_variants", "positional_models",
             "runtime"},
    "extrapolation": {"model", "data", "evaluation", "training", "files", "positional_variants", "positional_models",
                      "runtime"},
    "serving": {"model", "registration"},
    "cli": {"model", "data", "evaluation", "hub", "training", "conversion", "demo", "files", "positional_variants",
            "runtime", "serving"},  # bam-build-kernels builds the vLLM decode's C++ kernel (serving/paged_cpu.py) too
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


def test_the_package_root_holds_at_most_eight_modules():
    """The rest lives in sub-packages whose names say what they hold (docs/architecture.md)."""
    modules = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(modules) <= 8, modules


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


# Library modules import what they use at the top (Transformers' way); only the command layer (cli/) imports the
# library late, inside each command's main after parsing. Exempt: the lazy package root and what it runs, and imports
# of optional packages (not dependencies, or CUDA-only).
LAZY_ON_PURPOSE = ("bam_llama/__init__.py", "bam_llama/registration.py")  # `import bam_llama` loads no PyTorch
OPTIONAL_PACKAGES = {"triton", "vllm", "deepspeed", "datasets", "gguf", "lm_eval", "trl"}
LIGHT_ON_PURPOSE = "Light on purpose"  # in the docstring of a module the commands import before they parse


def library_modules(exempt: tuple[str, ...] = ()):
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(REPO_ROOT).as_posix()
        if not name.startswith(("bam_llama/cli/", *exempt)):
            yield name, ast.parse(path.read_text())


def imports_inside_functions(tree: ast.Module):
    """(line, top-level name or "." for a relative import) of every import in a function body."""
    for function in ast.walk(tree):
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(function):
                if isinstance(node, ast.Import):
                    yield from ((node.lineno, alias.name.split(".")[0]) for alias in node.names)
                elif isinstance(node, ast.ImportFrom):
                    yield node.lineno, "." if node.level else node.module.split(".")[0]


def test_library_modules_import_at_the_top():
    problems = [
        f"{name}:{line} imports {imported} inside a function"
        for name, tree in library_modules(LAZY_ON_PURPOSE)
        for line, imported in sorted(set(imports_inside_functions(tree)))
        if imported not in OPTIONAL_PACKAGES
    ]
    problems += [
        f"{name}:{node.lineno} has an `if TYPE_CHECKING:` block: import what it names at the top"
        for name, tree in library_modules()
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
    ]
    assert not problems, "\n".join(problems)


def module_path(path: Path, node: ast.ImportFrom | ast.Import, alias: ast.alias) -> Path | None:
    """The file of the package module an import statement loads (None: outside the package)."""
    if isinstance(node, ast.Import):
        parts = alias.name.split(".")
    elif node.level:
        base = path.relative_to(REPO_ROOT).with_suffix("").parts[: -node.level]
        parts = [*base, *(node.module.split(".") if node.module else [])]
    else:
        parts = node.module.split(".")
    if parts[0] != "bam_llama":
        return None
    folder = REPO_ROOT.joinpath(*parts)
    return folder / "__init__.py" if folder.is_dir() else folder.with_suffix(".py")


def top_level_imports(path: Path):
    """(line, name, package module file or None) of the imports run when `path` is imported."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                name = alias.name if isinstance(node, ast.Import) else "." * node.level + (node.module or "")
                yield node.lineno, name, module_path(path, node, alias)


def is_light(path: Path) -> bool:
    docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
    return LIGHT_ON_PURPOSE in " ".join(docstring.split()) or not path.read_text().strip()  # or an empty __init__


def test_commands_import_only_light_modules_before_parsing():
    """Every module a command imports before it parses (cli/ modules at their top, and what those import at theirs)
    says it is light on purpose and imports only the standard library and other light modules. The library itself is
    imported inside each command's main. (tests/cli/test_imports.py runs each --help and checks the same by
    sys.modules.)"""
    problems, seen, queue = [], set(), sorted(PACKAGE.glob("cli/*.py"))
    while queue:
        path = queue.pop()
        if path in seen:
            continue
        seen.add(path)
        where = path.relative_to(REPO_ROOT)
        if path.parent.name != "cli" and not is_light(path):
            problems.append(f"{where} is imported before parsing but does not say '{LIGHT_ON_PURPOSE}'")
        for line, name, target in top_level_imports(path):
            if target is None:
                if name.split(".")[0] not in sys.stdlib_module_names and not name.startswith("__future__"):
                    problems.append(f"{where}:{line} imports {name}, not the standard library, at the top")
                continue
            queue.append(target)
            queue.extend(parent / "__init__.py" for parent in target.parents if parent.is_relative_to(PACKAGE))
    assert not problems, "\n".join(problems)
