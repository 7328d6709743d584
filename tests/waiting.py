"""How a test waits for its subprocesses: until they end, with a bound only against a hang. The bound is seconds of
an idle machine, stretched by how busy the machine is while the test waits (`timeout_scale`), so that a test on a
loaded machine (other runs beside the suite) waits for its workers instead of failing on a clock; past it the test
fails saying it was a time limit and what it was waiting for. Standard library and pytest only (tests_vllm/ imports
it in vLLM's venv)."""

import contextlib
import os
import queue
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

SCALE_VARIABLE = "BAM_TEST_TIMEOUT_SCALE"
POLL_S = 2.0  # how often a wait looks at the machine's load again


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def timeout_scale() -> float:
    """How many times an idle machine's time a wait may take now: BAM_TEST_TIMEOUT_SCALE where set, else the
    runnable processes per core (the larger of the 1-minute load average and those running now), at least 1."""
    if (value := os.environ.get(SCALE_VARIABLE, "").strip()):
        try:
            scale = float(value)
        except ValueError:
            scale = 0.0
        if not scale > 0:
            raise ValueError(f"{SCALE_VARIABLE} must be a positive number, got {value!r}")
        return scale
    runnable = os.getloadavg()[0]
    with contextlib.suppress(OSError, IndexError, ValueError):  # /proc/loadavg: "0.5 0.4 0.3 3/250 1234"
        runnable = max(runnable, int(Path("/proc/loadavg").read_text().split()[3].split("/")[0]))
    return max(1.0, runnable / cores())


class HangGuard:
    """A last-resort bound on one wait: `limit_s` seconds of an idle machine times the largest `timeout_scale()` seen
    while waiting (read again at each `left()`)."""

    def __init__(self, limit_s: float, waiting_for: str):
        self.limit_s, self.waiting_for = limit_s, waiting_for
        self.started = time.monotonic()
        self.scale = timeout_scale()

    def left(self) -> float:
        """Seconds left before the guard trips (<= 0 once it has)."""
        self.scale = max(self.scale, timeout_scale())
        return self.started + self.limit_s * self.scale - time.monotonic()

    def fail(self, detail: str = ""):
        waited = time.monotonic() - self.started
        pytest.fail(f"waited {waited:.0f} s for {self.waiting_for}: a hang guard of {self.limit_s:g} s on an idle "
                    f"machine, x{self.scale:.1f} for this machine's load (not a wrong result; "
                    f"{SCALE_VARIABLE} widens it){detail}", pytrace=False)


def last_line(stderr) -> str:
    """What a command was doing: the last line it wrote to stderr (progress lines), or that it wrote none."""
    text = stderr.decode(errors="replace") if isinstance(stderr, bytes) else stderr or ""
    lines = [line for line in text.splitlines() if line.strip()]
    return f"; its last line on stderr: {lines[-1].strip()}" if lines else "; it wrote nothing on stderr"


def end_process_group(process: subprocess.Popen) -> None:
    """Kill a process started with start_new_session=True and everything it started (torchrun's workers)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        process.kill()


def run_within(command: list, limit_s: float, input: str | None = None, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(command, capture_output=True, text=True, input=input) (`stderr=subprocess.STDOUT` may be
    given): waits for the command to end, however long a busy machine makes it, up to a hang guard of `limit_s` idle
    seconds (`HangGuard`). Past it the command and its children are killed and the test fails naming the command and
    its last line on stderr."""
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    streams = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **kwargs}  # stderr=STDOUT may replace one
    process = subprocess.Popen(command, text=True, start_new_session=True, **streams)
    stdout, stderr = communicate_within(process, limit_s, " ".join(str(part) for part in command), input)
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def communicate_within(process: subprocess.Popen, limit_s: float, waiting_for: str, input: str | None = None):
    """process.communicate(input): (stdout, stderr) once it ended, up to a hang guard of `limit_s` idle seconds; past
    it the process (and its session, where it leads one) is killed and the test fails saying it waited for
    `waiting_for`, with the last line it wrote on stderr."""
    guard = HangGuard(limit_s, waiting_for)
    try:
        while True:
            try:
                return process.communicate(input, timeout=max(0.1, min(POLL_S, guard.left())))
            except subprocess.TimeoutExpired:
                input = None  # sent by the first call; a retry may not send it again
                if guard.left() <= 0:
                    end_process_group(process)
                    try:
                        stdout, stderr = process.communicate(timeout=scaled(30))
                    except subprocess.TimeoutExpired as still_open:  # a child outside its group holds the pipes
                        stdout, stderr = still_open.output, still_open.stderr
                    guard.fail(last_line(stdout if stderr is None else stderr))
    except BaseException:
        end_process_group(process)  # interrupted or failed: leave nothing running
        raise


def wait_within(process: subprocess.Popen, limit_s: float, waiting_for: str, detail=lambda: "") -> int:
    """process.wait() up to a hang guard of `limit_s` idle seconds; past it the process (and its session, where it
    leads one) is killed and the test fails saying it waited for `waiting_for`, then `detail()`."""
    guard = HangGuard(limit_s, waiting_for)
    while True:
        try:
            return process.wait(timeout=max(0.1, min(POLL_S, guard.left())))
        except subprocess.TimeoutExpired:
            if guard.left() <= 0:
                end_process_group(process)
                guard.fail(detail())


def wait_until(condition, limit_s: float, waiting_for: str, poll_s: float = 0.2) -> None:
    """Until `condition()` is true (processes gone, a file written); the test fails at a hang guard of `limit_s`
    idle seconds, saying it waited for `waiting_for`."""
    guard = HangGuard(limit_s, waiting_for)
    while not condition():
        if guard.left() <= 0:
            guard.fail()
        time.sleep(poll_s)


def scaled(limit_s: float) -> float:
    """`limit_s` idle seconds at this machine's present load: for a deadline handed to a child process (how long
    it stays alive waiting to be killed) or a library call that takes one timeout."""
    return limit_s * timeout_scale()


class WatchedProcess:
    """A subprocess whose stdout and stderr are drained by threads (a full pipe cannot block it): its stdout lines are
    waited for (`wait_for_line`), and its stderr is kept for failure messages. Popen's keyword arguments pass on."""

    def __init__(self, command: list, **kwargs):
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
        self.lines, self.stderr = queue.Queue(), []
        threading.Thread(target=self._read, args=(self.process.stdout, self.lines.put), daemon=True).start()
        threading.Thread(target=self._read, args=(self.process.stderr, self.stderr.append), daemon=True).start()

    @staticmethod
    def _read(stream, keep):
        for line in stream:
            keep(line)

    def error_output(self, last: int | None = 4000) -> str:
        """Its stderr so far: the last `last` characters, or all of it."""
        text = "".join(self.stderr)
        return text[-last:] if last else text

    def wait_for_line(self, expected: str, limit_s: float) -> None:
        """Until the process writes the line `expected` on stdout; the test fails if it ends first, or at a hang
        guard of `limit_s` idle seconds."""
        guard = HangGuard(limit_s, f"the line {expected!r} on stdout")
        while (left := guard.left()) > 0:
            try:
                if self.lines.get(timeout=min(left, 1.0)).strip() == expected:
                    return
            except queue.Empty:
                if self.process.poll() is not None and self.lines.empty():
                    pytest.fail(f"ended (exit {self.process.returncode}) before writing {expected!r}:\n"
                                f"{self.error_output()}", pytrace=False)
        self.process.kill()
        guard.fail(f":\n{self.error_output()}")

    def wait(self, limit_s: float, waiting_for: str = "the process to exit") -> int:
        return wait_within(self.process, limit_s, waiting_for, lambda: f":\n{self.error_output()}")
