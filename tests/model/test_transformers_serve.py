"""`transformers serve FOLDER --trust-remote-code` (plain and `--continuous-batching`) and `transformers chat` on a
tiny saved BamLlama, with the package installed (bam_llama importable) and as a remote-code-only user (bam_llama
hidden): the server starts on a loopback port, `/v1/completions` answers with `generate()`'s greedy text, and
`transformers chat`, its stdin piped, prints `generate()`'s greedy reply to the chat-templated prompt.

Transformers 5.24's server never imports bam_llama and loads a model as `getattr(transformers,
config.architectures[0])`; the folder's config code puts each model's Auto class there
(configuration_bam.expose_on_transformers), so the command is the same either way. Needs `transformers[serving]`
(fastapi, uvicorn, openai; in `.[dev]`): skipped without it, except under CI=true, where that fails.
"""

import contextlib
import json
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch
from helpers import checkout_environment, require_modules, tiny_model
from test_payload import HIDE_BAM_LLAMA, remote_code_environment
from waiting import HangGuard, run_within, scaled

from bam_llama.data.tokenizers import build_byte_tokenizer

require_modules("fastapi", "uvicorn", "openai", "rich", provided_by="transformers[serving], in .[dev]")

PROMPT = "Hello"
NEW_TOKENS = 5
START_SECONDS = 120
CHAT_SECONDS = 120

# A chat template for the byte tokenizer, and what it makes of one user line, written out: the prompt the server's
# generate() continues for `transformers chat`.
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
                 "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
CHAT_PROMPT = "<s>user: Hello\nassistant:"

# The `transformers` console script (transformers.cli.transformers:main), run by this Python; the two users of
# `transformers serve` below run the same command line, in different environments.
TRANSFORMERS_CLI = "from transformers.cli.transformers import main\nmain()\n"
PACKAGE_INSTALLED = "package installed"
REMOTE_CODE_ONLY = "remote code only"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def greedy_continuation(model, tokenizer, text: str, add_special_tokens: bool = True) -> str:
    """`generate()`'s greedy NEW_TOKENS tokens after `text`, decoded."""
    input_ids = tokenizer(text, add_special_tokens=add_special_tokens, return_tensors="pt").input_ids
    with torch.no_grad():
        output = model.generate(input_ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    return tokenizer.decode(output[0, input_ids.shape[1]:])


def saved_model_with_tokenizer(folder):
    """A tiny BamLlama with the byte tokenizer and CHAT_TEMPLATE, saved, and the tokenizer. Its weights are drawn
    wide enough (initializer_range=1) for its reply to depend on the whole prompt: at the default 0.02 a tiny model's
    next token is nearly a function of the last token alone, and a wrong prompt would go unseen."""
    tokenizer = build_byte_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    model = tiny_model("sdpa", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, initializer_range=1.0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model, tokenizer


def request(url: str, body: dict | None = None, timeout: float | None = None) -> dict:
    """The JSON reply of a GET (or a POST of `body`); without `timeout`, a hang guard of 120 idle seconds."""
    timeout = scaled(120) if timeout is None else timeout
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=timeout) as reply:
        return json.loads(reply.read())


def wait_until_serving(server: subprocess.Popen, url: str, log) -> None:
    """Until the server answers /health (or exits: the test fails with its log), up to a hang guard."""
    guard = HangGuard(START_SECONDS, f"transformers serve to answer {url}/health")
    while guard.left() > 0:
        if server.poll() is not None:
            raise AssertionError(f"transformers serve exited with {server.returncode}:\n{log.read_text()[-3000:]}")
        try:
            request(f"{url}/health", timeout=scaled(5))
            return
        except OSError:
            time.sleep(1)
    guard.fail(f"; its log ends:\n{log.read_text()[-3000:]}")


@contextlib.contextmanager
def transformers_serve(folder, tmp_path, user: str, options=()):
    """`transformers serve FOLDER --trust-remote-code` on a free loopback port, started as `user` would: with
    bam_llama importable (this checkout first on the path) or hidden. Yields the server's URL once it answers."""
    port = free_port()
    arguments = ["serve", str(folder), "--trust-remote-code", "--device", "cpu", "--host", "127.0.0.1",
                 "--port", str(port), *options]
    if user == PACKAGE_INSTALLED:
        command = [sys.executable, "-c", TRANSFORMERS_CLI, *arguments]
        environment = checkout_environment(HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1")
    else:
        command = [sys.executable, "-c", HIDE_BAM_LLAMA + TRANSFORMERS_CLI, *arguments]
        environment = remote_code_environment(tmp_path)
    log = tmp_path / "serve.log"
    with log.open("w") as output:
        server = subprocess.Popen(command, env=environment, cwd=tmp_path, stdout=output, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_serving(server, url, log)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=scaled(30))
        except subprocess.TimeoutExpired:  # a server that ignores SIGTERM still ends: its test has its answer
            server.kill()
            server.wait()


# A small paged cache: on CPU the cache is sized from free memory, and Transformers' (batch tokens x cache tokens)
# float mask then takes minutes to fill (docs/using-a-model.md#continuous-batching).
CONTINUOUS_BATCHING = ["--continuous-batching", "--cb-num-blocks", "32", "--cb-block-size", "16", "--cb-max-batch-tokens", "16"]


@pytest.mark.parametrize("user", [PACKAGE_INSTALLED, REMOTE_CODE_ONLY], ids=["installed", "remote-code-only"])
@pytest.mark.parametrize("mode", [[], CONTINUOUS_BATCHING], ids=["plain", "continuous-batching"])
def test_transformers_serve_answers_completions_like_generate(mode, user, tmp_path):
    folder = tmp_path / "model"
    expected = greedy_continuation(*saved_model_with_tokenizer(folder), PROMPT)
    with transformers_serve(folder, tmp_path, user, mode) as url:
        body = {"model": str(folder), "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0}
        reply = request(f"{url}/v1/completions", body)
    assert reply["choices"][0]["text"] == expected, reply


def test_transformers_chat_prints_the_greedy_reply_to_the_chat_templated_prompt(tmp_path):
    """`transformers chat MODEL URL max_new_tokens=5 ...` with one user line on stdin: chat streams the reply
    (rendered as Markdown by rich), asks whether to continue past the token limit ("n"), then `!exit` ends it. Chat's
    HTTP client refuses any URL, loopback too, under HF_HUB_OFFLINE=1; HF_HUB_DISABLE_UPDATE_CHECK keeps the CLI off
    PyPI."""
    folder = tmp_path / "model"
    model, tokenizer = saved_model_with_tokenizer(folder)
    expected = greedy_continuation(model, tokenizer, CHAT_PROMPT, add_special_tokens=False)
    # The reply tells the templated prompt from the user's line alone and from the template without its <s>.
    assert expected not in {greedy_continuation(model, tokenizer, prompt, add_special_tokens=False)
                            for prompt in ("Hello", CHAT_PROMPT.removeprefix("<s>"))}
    with transformers_serve(folder, tmp_path, PACKAGE_INSTALLED) as url:
        flags = [f"max_new_tokens={NEW_TOKENS}", f"min_new_tokens={NEW_TOKENS}", "do_sample=False"]
        command = [sys.executable, "-c", TRANSFORMERS_CLI, "chat", str(folder), url, *flags, "--user", "tester"]
        environment = checkout_environment(HF_HUB_DISABLE_UPDATE_CHECK="1", COLUMNS="1000")  # no wrapped lines
        environment.pop("HF_HUB_OFFLINE", None)
        chat = run_within(command, CHAT_SECONDS, input="Hello\nn\n!exit\n", env=environment, cwd=tmp_path)
    assert chat.returncode == 0, chat.stderr[-3000:]
    lines = [line.rstrip() for line in chat.stdout.splitlines()]
    reply = lines[lines.index(f"<{folder}>:") + 1]
    assert reply == expected, "\n".join(lines)
    assert f"{NEW_TOKENS} tokens in" in chat.stdout
