"""`transformers serve FOLDER --trust-remote-code` (plain and `--continuous-batching`) on a tiny saved BamLlama,
where bam_llama cannot be imported (a remote-code-only user; with the package installed the server loads the same
folder code): the server starts on a loopback port and answers `/v1/completions` with `generate()`'s greedy text.

Transformers 5.24's server loads a model as `getattr(transformers, config.architectures[0])`; the folder's config
puts each model's Auto class there (configuration_bam.expose_on_transformers). Needs `transformers[serving]`
(fastapi, uvicorn, openai), not in `.[dev]`: skipped without it.
"""

import json
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request

import pytest
import torch
from helpers import tiny_model
from test_payload import HIDE_BAM_LLAMA, remote_code_environment

from bam_llama.data.tokenizers import build_byte_tokenizer

for module in ("fastapi", "uvicorn", "openai"):
    pytest.importorskip(module, reason="transformers serve needs transformers[serving]")

PROMPT = "Hello"
NEW_TOKENS = 5
START_SECONDS = 120


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def saved_model_with_tokenizer(folder) -> str:
    """A tiny BamLlama with the byte tokenizer, saved; its greedy continuation of PROMPT."""
    tokenizer = build_byte_tokenizer()
    model = tiny_model("sdpa", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    input_ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        output = model.generate(input_ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    return tokenizer.decode(output[0, input_ids.shape[1]:])


def request(url: str, body: dict | None = None, timeout: float = 60) -> dict:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=timeout) as reply:
        return json.loads(reply.read())


def wait_until_serving(server: subprocess.Popen, url: str) -> None:
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"transformers serve exited with {server.returncode}:\n{server.stdout.read()[-3000:]}")
        try:
            request(f"{url}/health", timeout=5)
            return
        except OSError:
            time.sleep(1)
    raise AssertionError(f"transformers serve did not answer within {START_SECONDS} s")


# A small paged cache: on CPU the cache is sized from free memory, and Transformers' (batch tokens x cache tokens)
# float mask then takes minutes to fill (docs/using-a-model.md#continuous-batching).
CONTINUOUS_BATCHING = ["--continuous-batching", "--cb-num-blocks", "32", "--cb-block-size", "16", "--cb-max-batch-tokens", "16"]


@pytest.mark.parametrize("mode", [[], CONTINUOUS_BATCHING], ids=["plain", "continuous-batching"])
def test_transformers_serve_answers_completions_like_generate(mode, tmp_path):
    folder = tmp_path / "model"
    expected = saved_model_with_tokenizer(folder)
    port = free_port()
    script = HIDE_BAM_LLAMA + textwrap.dedent(
        """
        from transformers.cli.transformers import main
        main()
        """
    )
    command = [sys.executable, "-c", script, "serve", str(folder), "--trust-remote-code", "--device", "cpu",
               "--host", "127.0.0.1", "--port", str(port), *mode]
    server = subprocess.Popen(command, env=remote_code_environment(tmp_path), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_serving(server, url)
        body = {"model": str(folder), "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0}
        reply = request(f"{url}/v1/completions", body)
        assert reply["choices"][0]["text"] == expected, reply
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
