"""CI: the reference-fixture tests may skip on a developer's machine without ../shared, and the tests needing an
optional module of .[dev] without it, never under CI=true; the oldest claimed Transformers is tested too."""

import re
import subprocess
from pathlib import Path

import pytest
from helpers import require_modules, require_reference_fixtures
from packaging.requirements import Requirement


def test_missing_fixtures_skip_outside_ci(tmp_path, monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="reference fixtures not found"):
        require_reference_fixtures(tmp_path / "missing")


@pytest.mark.parametrize("value", ["true", "True", "1"])
def test_missing_fixtures_fail_under_ci(tmp_path, monkeypatch, value):
    monkeypatch.setenv("CI", value)
    with pytest.raises(pytest.fail.Exception, match="CI=true requires them"):
        require_reference_fixtures(tmp_path / "missing")


def test_present_fixtures_are_returned(tmp_path, monkeypatch):
    monkeypatch.setenv("CI", "true")
    assert require_reference_fixtures(tmp_path) == tmp_path


def test_ci_tests_the_oldest_transformers_the_package_claims():
    """.ci/run ends with .ci/oldest-transformers, which installs the lower bound of pyproject's Transformers
    requirement: a changed claim moves the tested version with it."""
    root = Path(__file__).resolve().parents[2]
    assert "bash .ci/oldest-transformers" in (root / ".ci" / "run").read_text()
    script = (root / ".ci" / "oldest-transformers").read_text()
    extraction = re.search(r'^oldest="\$\((.*)\)"$', script, re.MULTILINE).group(1)
    found = subprocess.run(["bash", "-c", extraction], cwd=root, capture_output=True, text=True, check=True).stdout
    pyproject = (root / "pyproject.toml").read_text()
    requirement = Requirement(re.search(r'"(transformers[^"]*)"', pyproject).group(1))
    (lower,) = [spec.version for spec in requirement.specifier if spec.operator == ">="]
    assert found.strip() == lower
    assert '"transformers==$oldest"' in script


PIP_INDEX_LISTING = """transformers (6.0.0)
Available versions: 6.0.0, 5.26.1, 5.26.0, 5.25.0, 5.9.0, 4.57.6
"""


def test_ci_runs_the_suite_on_the_newest_transformers_5_and_fails_on_another(tmp_path):
    """.ci/run reads the newest 5.x from the registry's listing (`pip index versions transformers`, newest first) and
    fails unless the README's venv holds it: run here on a listing written in the test (a fake `python`)."""
    root = Path(__file__).resolve().parents[2]
    run = (root / ".ci" / "run").read_text()
    extract = re.search(r'^newest_transformers="\$\((.*?)\)"$', run, re.MULTILINE | re.DOTALL).group(1)
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\n[ \"$*\" = \"-m pip index versions transformers\" ] && cat <<'EOF'\n"
                    f"{PIP_INDEX_LISTING}EOF\n")
    fake.chmod(0o755)
    environment = {"PATH": f"{tmp_path}:/usr/bin:/bin"}
    newest = subprocess.run(["bash", "-c", extract.replace("\\\n", "")], env=environment, capture_output=True,
                            text=True, check=True).stdout.strip()
    assert newest == "5.26.1"  # not 6.0.0 (outside the claimed range), not 5.9.0 (sorted as text)
    check = run[run.index('if [ -z "$newest_transformers" ]'):run.index('part_done "newest-transformers"')]
    for installed, status in (("5.26.1", 0), ("5.25.0", 1)):
        script = f"installed_transformers={installed}; newest_transformers=5.26.1\n{check}"
        assert subprocess.run(["bash", "-c", script], capture_output=True).returncode == status


def test_ci_reports_every_parts_seconds():
    """Each part of .ci/run (the venv, the version check, the suite, and each step script it calls) ends with
    `part_done`, which prints the part's seconds; the summary lists them all when CI ends."""
    root = Path(__file__).resolve().parents[2]
    run = (root / ".ci" / "run").read_text()
    steps = re.findall(r"bash \.ci/([\w-]+)", run)
    assert set(steps) == {"readme-venv", "gpu-readiness", "oldest-transformers", "vllm"}
    for step in steps:
        assert re.search(rf"bash \.ci/{step}.*\n?.*part_done \"?{step}", run), step
    assert 'part_done "suite"' in run and "trap 'rm -rf \"$work\"; summary' EXIT" in run


def readme_first_block(root: Path) -> list[str]:
    """The README's first bash block, comments stripped: what a newcomer types."""
    block = (root / "README.md").read_text().split("```bash\n", 1)[1].split("```", 1)[0]
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.split("#", 1)[0].strip()]


def test_ci_installs_and_tests_exactly_what_the_readme_says():
    """.ci/run makes a fresh venv with the README's pip lines and its kernel build line (.ci/readme-venv) and runs the
    README's test command in it: the lines each script extracts are the README's own."""
    root = Path(__file__).resolve().parents[2]
    commands = readme_first_block(root)
    run = (root / ".ci" / "run").read_text()
    assert "bash .ci/readme-venv" in run and '. "$work/venv/bin/activate"' in run
    extract_tests = re.search(r'^test_command="\$\((.*?)\)"$', run, re.MULTILINE | re.DOTALL).group(1)
    found = subprocess.run(["bash", "-c", extract_tests.replace("\\\n", "")], cwd=root, capture_output=True,
                           text=True, check=True).stdout.strip()
    assert found == next(line for line in commands if line.startswith("python -m pytest"))
    script = (root / ".ci" / "readme-venv").read_text()
    extract_installs = re.search(r'^mapfile -t installs < <\((.*?)\)$', script, re.MULTILINE | re.DOTALL).group(1)
    installs = subprocess.run(["bash", "-c", extract_installs.replace("\\\n", "").replace('"$repo/README.md"', "README.md")],
                              cwd=root, capture_output=True, text=True, check=True).stdout.split("\n")
    assert [line for line in installs if line] == [line for line in commands if line.startswith("pip install")]
    extract_builds = re.search(r'^mapfile -t builds < <\((.*?)\)$', script, re.MULTILINE | re.DOTALL).group(1)
    builds = subprocess.run(["bash", "-c", extract_builds.replace("\\\n", "").replace('"$repo/README.md"', "README.md")],
                            cwd=root, capture_output=True, text=True, check=True).stdout.split("\n")
    assert [line for line in builds if line] == ["bam-build-kernels"] == [
        line for line in commands if line.startswith("bam-build-kernels")]
    assert 'eval "\\"$venv/bin/\\"$command"' in script  # run in the venv, after the installs


def test_ci_compiles_every_kernel_launch_after_the_suite_within_a_budget_of_its_own():
    """The suite compiles a sample of the Triton launches (tests/project/test_gpu_readiness.py); .ci/run then runs
    .ci/gpu-readiness, which compiles all of them with --check (a failure is CI's) under its own time limit."""
    root = Path(__file__).resolve().parents[2]
    run = (root / ".ci" / "run").read_text()
    assert run.index('eval "$test_command') < run.index("bash .ci/gpu-readiness") < run.index("bash .ci/oldest-transformers")
    step = (root / ".ci" / "gpu-readiness").read_text()
    command = next(line for line in step.splitlines() if "benchmarks/gpu_readiness.py" in line and "timeout" in line)
    assert "--check" in command and "--sample" not in command and '--head-dim 64 128' in command


def test_missing_modules_skip_outside_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="no_such_module_for_bam not installed"):
        require_modules("json", "no_such_module_for_bam", provided_by="an extra")


def test_missing_modules_fail_under_ci(monkeypatch):
    """The serve and chat tests' packages (transformers[serving], in .[dev]) are in CI's README venv: a missing
    one fails there instead of skipping the tests."""
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true requires them"):
        require_modules("no_such_module_for_bam", provided_by="an extra")
    require_modules("json", provided_by="the standard library")
