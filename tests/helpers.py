"""Helpers the tests share: tiny BamLlama models with a non-trivial prior, the environment of a subprocess that
imports this checkout, the reference implementation's fixtures and the optional modules a test needs (skipped
outside CI, failing under CI=true), what the tests of failing commands share (the one error line, a full disk, an
unwritable folder), and a reading of needle prompts (the values their question asks for, found in their text)."""

import contextlib
import errno
import importlib
import os
import re
import shutil
import signal
import subprocess
import uuid
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
FIXTURES_DIR = REPO_ROOT.parent / "shared" / "fixtures" / "official-bam"


def default_sigint() -> None:
    """Popen's preexec_fn for a child the test interrupts: the suite run as a background job (`bash .ci/run &` in
    a non-interactive shell) hands its children an ignored SIGINT, and Python then never raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def child_processes(pid: int) -> list[int]:
    """The live children of process `pid` (Linux /proc), read across all its threads."""
    children = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(FileNotFoundError):  # a thread that ended while we read
            children += [int(child) for child in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    return children


def still_running(pids: list[int]) -> list[int]:
    """Those of `pids` that are alive and not zombies (a process may end while we read)."""
    running = []
    for pid in pids:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            if "zombie" not in Path(f"/proc/{pid}/status").read_text():
                running.append(pid)
    return running


def checkout_environment(**variables: str) -> dict[str, str]:
    """os.environ for a subprocess that must import this checkout's bam_llama (first on PYTHONPATH)."""
    path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **variables}


def skip_outside_ci(message: str) -> None:
    """Skip the test (or the module, when called at its top) for `message`, except under CI=true, where it fails:
    what CI installs or provides must be tested there, never silently skipped."""
    if os.environ.get("CI", "").strip().lower() in ("true", "1", "yes"):
        pytest.fail(f"{message}; CI=true requires them", pytrace=False)
    pytest.skip(message, allow_module_level=True)


def require_reference_fixtures(folder: Path = FIXTURES_DIR) -> Path:
    """The reference fixtures folder. Missing, the test is skipped, except under CI=true, where it fails: CI must
    not go green without its only external ground truth."""
    if not folder.exists():
        skip_outside_ci(f"reference fixtures not found at {folder} (CI puts ../shared beside the clone)")
    return folder


def require_modules(*names: str, provided_by: str) -> None:
    """Import each module of `names`. One missing (ModuleNotFoundError), the test is skipped, except under CI=true,
    where it fails: `provided_by` (an extra of `.[dev]`) is what CI's README venv installs."""
    missing = []
    for name in names:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError:
            missing.append(name)
    if missing:
        skip_outside_ci(f"{', '.join(missing)} not installed (from {provided_by})")


def tiny_config(**overrides):
    from bam_llama import BamLlamaConfig

    values = dict(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        train_context_length=16,
    )
    values.update(overrides)
    return BamLlamaConfig(**values)


def randomize_prior(model, seed: int = 0) -> None:
    """Give every prior / SSMax tensor distinct non-trivial values (negative beta, non-zero mu, T5's bucket biases
    included); those the config freezes are buffers, hence the state dict."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.state_dict(keep_vars=True).items():
            heads = parameter.numel()
            if name.endswith("theta_alpha"):
                parameter.copy_(torch.rand(heads, generator=generator) * 2 - 1.5)
            elif name.endswith("theta_beta"):
                parameter.copy_(torch.linspace(-0.5, 1.2, heads))
            elif name.endswith("theta_mu"):
                parameter.copy_(torch.rand(heads, generator=generator) - 0.5)
            elif name.endswith("ssmax.scale"):
                parameter.copy_(0.8 + 0.4 * torch.rand(heads, generator=generator))
            elif name.endswith("bucket_bias"):  # T5's buckets: (H, buckets)
                parameter.copy_(torch.randn(parameter.shape, generator=generator))


def tiny_model(attn_implementation: str = "eager", seed: int = 0, **overrides):
    from bam_llama import BamLlamaForCausalLM

    torch.manual_seed(seed)
    model = BamLlamaForCausalLM(tiny_config(**overrides))
    model.set_attn_implementation(attn_implementation)
    randomize_prior(model, seed)
    return model.eval()


def tiny_llama(attn_implementation: str = "sdpa", seed: int = 0, **overrides):
    """The `LlamaForCausalLM` of `tiny_model`'s sizes: the peer a BamLlama test holds itself to."""
    from transformers import LlamaConfig, LlamaForCausalLM

    bam = tiny_config(**overrides)
    sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{name: getattr(bam, name) for name in sizes}))
    model.set_attn_implementation(attn_implementation)
    return model.eval()


@contextlib.contextmanager
def training_linear_dtypes():
    """The set of output dtypes of every `nn.Linear` that runs in training mode inside the block, any model: what
    shows whether a training run's forward ran under autocast."""
    dtypes = set()

    def record(module, args, output):
        if isinstance(module, torch.nn.Linear) and module.training:
            dtypes.add(output.dtype)

    handle = torch.nn.modules.module.register_module_forward_hook(record)
    try:
        yield dtypes
    finally:
        handle.remove()


@contextlib.contextmanager
def torch_threads_in_training(monkeypatch, omp_num_threads: str | None = None):
    """The number of torch threads at each `nn.Linear` forward in training mode inside the block, with the process
    started as torch starts it: OMP_NUM_THREADS set to `omp_num_threads` and torch's threads that number, or unset
    and torch's threads one per core (4 here, whatever the machine). Torch's threads are restored after."""
    threads, seen = torch.get_num_threads(), set()
    if omp_num_threads is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp_num_threads)
    torch.set_num_threads(int(omp_num_threads or 4))

    def record(module, args, output):
        if isinstance(module, torch.nn.Linear) and module.training:
            seen.add(torch.get_num_threads())

    handle = torch.nn.modules.module.register_module_forward_hook(record)
    try:
        yield seen
    finally:
        handle.remove()
        torch.set_num_threads(threads)


def created_optimizers(monkeypatch) -> list:
    """Every optimizer a BamTrainer creates from now on (its param_groups tell each parameter's learning rate)."""
    from bam_llama.training.trainer import BamTrainer

    created, original = [], BamTrainer.create_optimizer

    def record(self, model=None):
        created.append(original(self, model))
        return created[-1]

    monkeypatch.setattr(BamTrainer, "create_optimizer", record)
    return created


# ---------------------------------------------------------------------------------------- failures of commands


def one_error_line(stderr: str, prog: str) -> str:
    """The one error line, last on stderr (progress bars and notes may come before it); no traceback."""
    errors = [line for line in stderr.splitlines() if line.startswith(f"{prog}: ")]
    assert len(errors) == 1 and errors[0].startswith(f"{prog}: error: "), stderr
    assert stderr.rstrip("\n").splitlines()[-1] == errors[0] and "Traceback" not in stderr, stderr
    return errors[0]


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (hidden ones included) and its bytes."""
    return {path.relative_to(folder).as_posix(): path.read_bytes() for path in folder.rglob("*") if path.is_file()}


def disk_full_after_half(write, error=None):
    """A stand-in for a file writer `write(self_or_path, path, ...)`: writes half of what the real one writes, then
    raises ENOSPC naming the file, as a full disk does, or `error` (e.g. the SafetensorError safetensors raises)."""

    def write_half_then_fail(target, path, *args, **kwargs):
        write(target, path, *args, **kwargs)
        data = Path(path).read_bytes()
        Path(path).write_bytes(data[: len(data) // 2])
        raise error or OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    return write_half_then_fail


# How safetensors (a Rust library) says the disk is full: no OSError, no errno attribute, only the message.
SAFETENSORS_DISK_FULL_MESSAGES = [
    "Error while serializing: I/O error: No space left on device (os error 28)",  # 0.8, on a full tmpfs
    'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })',  # older
]


@contextlib.contextmanager
def small_tmpfs(parent: Path, size: str):
    """A tmpfs of `size` mounted at parent/disk, or a skip where this machine does not let the suite mount one."""
    mount_point = parent / "disk"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", f"bam-test-{uuid.uuid4().hex[:8]}",
                              str(mount_point)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (not root, or no mount rights): the injected ENOSPC tests stand in")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=True)


def fill(folder: Path, leave: int) -> None:
    """Fill the file system of `folder` until about `leave` bytes are free."""
    free = shutil.disk_usage(folder).free - leave
    if free > 0:
        (folder / "filler").write_bytes(b"\0" * free)


@contextlib.contextmanager
def unwritable(folder: Path, monkeypatch):
    """`folder` as a user sees a folder they cannot write: chmod 0555, or, as root (which writes anyway), an
    EACCES from every attempt to create something in it."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        try:
            yield
        finally:
            folder.chmod(0o755)
        return
    from bam_llama.files import outputs

    real_mkdtemp, real_mkdir = outputs.tempfile.mkdtemp, Path.mkdir

    def refuse(where: Path):
        if Path(where).resolve() == folder.resolve():
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(where))

    def mkdtemp(*args, dir=None, **kwargs):
        refuse(dir)
        return real_mkdtemp(*args, dir=dir, **kwargs)

    def mkdir(self, *args, **kwargs):
        refuse(self.parent)
        return real_mkdir(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(outputs.tempfile, "mkdtemp", mkdtemp)
        patch.setattr(Path, "mkdir", mkdir)
        yield


# ---------------------------------------------------------------------------------- needle prompts, read back

NEEDLE_PATTERN = re.compile(r" The special magic number for (\w+) is (\d+)\.")
ASSIGNMENT_PATTERN = re.compile(r" VAR (\w+) = (?:VAR (\w+)|(\d+))\.")


def asked_values(text: str) -> list[str]:
    """The values the prompt's question asks for, read from the prompt's text alone."""
    question = text[text.rindex(" The "):]
    variable = re.fullmatch(r" The value of VAR (\w+) is", question)
    if variable:
        assignments = {label: (source, value) for label, source, value in ASSIGNMENT_PATTERN.findall(text)}
        label = variable.group(1)
        while assignments[label][0]:  # follow VAR x = VAR y to the number
            label = assignments[label][0]
        return [assignments[label][1]]
    needles = NEEDLE_PATTERN.findall(text)
    one = re.fullmatch(r" The special magic number for (\w+) is", question)
    if one:
        return [value for label, value in needles if label == one.group(1)]
    labels = re.fullmatch(r" The special magic numbers for (.+) are", question).group(1)
    labels = re.split(r", | and ", labels)
    if len(labels) == 1:  # one key, all its values in the order they appear
        return [value for label, value in needles if label == labels[0]]
    return [next(value for label, value in needles if label == asked) for asked in labels]


def fused_kernel_calls(monkeypatch) -> list[tuple]:
    """The query shape of every call of the fused CPU attention kernel from the model's attention, from now on: its
    two call sites, the decoding step's and the fused path's."""
    import bam_llama.model.decode_step_bam as decode_step
    import bam_llama.model.fused_cpu_path_bam as fused_path

    calls = []
    kernel = fused_path.bam_attention_fused_cpu

    def counting(query, *arguments):
        calls.append(tuple(query.shape))
        return kernel(query, *arguments)

    for module in (decode_step, fused_path):
        monkeypatch.setattr(module, "bam_attention_fused_cpu", counting)
    return calls


def route_path_calls(monkeypatch, refuse=()) -> list[tuple]:
    """(path, call) of every call the attention route (`attention_route_bam.ATTENTION_PATHS`) runs, from now on; a
    path named in `refuse` raises instead."""
    from bam_llama.model import attention_route_bam

    calls = []

    def counted(name, run):
        def path(call):
            if name in refuse:
                raise AssertionError(f"the route ran {name!r}")
            calls.append((name, call))
            return run(call)

        return path

    for name, run in list(attention_route_bam.ATTENTION_PATHS.items()):
        monkeypatch.setitem(attention_route_bam.ATTENTION_PATHS, name, counted(name, run))
    return calls
