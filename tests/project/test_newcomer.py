"""The newcomer's path: the README's steps chain (the demo's model carries its passkey prompt, bam-eval uses it),
the package works without triton, saved folders load without the package, PEFT keeps frozen prior parameters
frozen, and the plots read at a glance."""

import json
import math
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import tiny_model
from waiting import run_within

from bam_llama.cli.demo import run_demo
from bam_llama.cli.eval import main
from bam_llama.evaluation import retrieval
from bam_llama.evaluation import plots
from bam_llama.evaluation.passkey import PasskeyResults, uniform_depths
from bam_llama.evaluation.plots import plot_prior
from bam_llama.hub.card import write_model_card

REPO_ROOT = Path(__file__).resolve().parents[2]

# The demo's training prompt, written out here (not imported): BOS, then "The sky is blue." fillers.
DEMO_PROMPT_RECORD = {
    "task": "",
    "filler": "The sky is blue. ",
    "info": "The pass key is {passkey}. ",
    "question": "The pass key is",
    "add_bos": True,
}
BOS_ID = 1


def subprocess_env(**extra) -> dict:
    """This checkout first on the path (also for the child), offline, quiet."""
    path = os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **extra}


@pytest.fixture(scope="module")
def demo_output(tmp_path_factory):
    """A --quick demo run (BAM only) in `<tmp>/bam-demo-output`, the README's default folder."""
    output = tmp_path_factory.mktemp("newcomer") / "bam-demo-output"
    run_demo(["--quick", "--models", "bam", "--output-dir", str(output)])
    return output


# ------------------------------------------------------------------------------------- passkey template


def test_the_demo_model_carries_its_passkey_prompt_through_a_resave(demo_output, tmp_path):
    from transformers import AutoModelForCausalLM

    config = json.loads((demo_output / "bam-model" / "config.json").read_text())
    assert config["passkey_template"] == DEMO_PROMPT_RECORD
    # a fine-tuned / merged copy is a reload followed by save_pretrained
    AutoModelForCausalLM.from_pretrained(demo_output / "bam-model").save_pretrained(tmp_path / "copy")
    assert json.loads((tmp_path / "copy" / "config.json").read_text())["passkey_template"] == DEMO_PROMPT_RECORD


def test_bam_finetune_merged_copy_keeps_the_passkey_prompt(demo_output, tmp_path):
    from bam_llama.cli import finetune as finetune_cli

    documents = ["The sky is blue. " * 5 + f"The pass key is {key}. The pass key is {key}." for key in range(10000, 10060)]
    (tmp_path / "corpus.txt").write_text("\n\n".join(documents))
    finetune_cli.main([
        "--model", str(demo_output / "bam-model"), "--data", str(tmp_path / "corpus.txt"),
        "--output-dir", str(tmp_path / "ft"), "--context-length", "128", "--max-steps", "1", "--eval-rows", "2",
        "--batch-size", "2", "--merge", "--disable-progress-bars",
    ])
    merged = json.loads((tmp_path / "ft" / "merged" / "config.json").read_text())
    assert merged["passkey_template"] == DEMO_PROMPT_RECORD


@pytest.fixture
def recorded_prompts(monkeypatch):
    """Every prompt bam-eval passkey decodes from; the model 'answers' nothing useful (no decoding run)."""
    prompts = []

    def fake_continuation(model, prompt_ids, max_new_tokens, chunk_size):
        prompts.append(list(prompt_ids))
        return [ord("0") + 3] * max_new_tokens  # the byte tokenizer's id of "0"

    monkeypatch.setattr(retrieval, "greedy_continuation", fake_continuation)
    return prompts


def run_passkey(model_dir, out, *extra):
    main(["passkey", str(model_dir), "--lengths", "100", "--depths", "2", "--device", "cpu", "--quiet",
          "--out", str(out), *extra])
    return json.loads((out / "passkey.json").read_text())["passkeys"][0]


def decode_bytes(ids: list[int]) -> str:
    """The byte tokenizer's ids are 3 + byte; 0..2 are specials."""
    return bytes(token - 3 for token in ids if token >= 3).decode("utf-8")


def test_bam_eval_uses_the_model_prompt_by_default(demo_output, tmp_path, recorded_prompts, capsys):
    keys = run_passkey(demo_output / "bam-model", tmp_path / "default")
    assert "use the model's own prompt" in capsys.readouterr().err
    for prompt, key in zip(recorded_prompts, keys):
        assert prompt[0] == BOS_ID and BOS_ID not in prompt[1:]
        text = decode_bytes(prompt)
        assert re.fullmatch(rf"(The sky is blue\. )*The pass key is {key}\. (The sky is blue\. )*The pass key is", text)
        assert 100 - 17 < len(prompt) <= 100  # filled up to the requested length with 17-byte fillers


def test_the_template_flag_overrides_the_model_prompt(demo_output, tmp_path, recorded_prompts, capsys):
    keys = run_passkey(demo_output / "bam-model", tmp_path / "paper", "--template", "paper")
    for prompt, key in zip(recorded_prompts, keys):
        text = decode_bytes(prompt)
        assert prompt[0] != BOS_ID and text.startswith("There is an important info hidden")
        assert f"The pass key is {key}. Remember it. {key} is the pass key. " in text
        assert text.endswith("What is the pass key? The pass key is") and "The sky is blue. The sky" not in text
    assert len(recorded_prompts) == 2

    recorded_prompts.clear()
    custom = tmp_path / "template.json"
    custom.write_text(json.dumps({"task": "Find it. ", "filler": "a b c. ", "info": "key={passkey}. ",
                                  "question": "key=", "add_bos": False}))
    keys = run_passkey(demo_output / "bam-model", tmp_path / "custom", "--template", str(custom))
    assert f"the prompt in {custom}" in capsys.readouterr().err
    for prompt, key in zip(recorded_prompts, keys):
        text = decode_bytes(prompt)
        assert prompt[0] != BOS_ID
        assert re.fullmatch(rf"Find it\. (a b c\. )*key={key}\. (a b c\. )*key=", text)


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "no file at"),
        ("not json", "is not JSON"),
        ('{"info": "no key here"}', "'info' must contain {passkey}"),
        ('{"prefix": "x"}', "a passkey template has the keys"),
    ],
)
def test_a_bad_template_is_one_clear_error(demo_output, tmp_path, content, message, capsys):
    path = tmp_path / "template.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as exit_info:
        main(["passkey", str(demo_output / "bam-model"), "--lengths", "100", "--template", str(path), "--quiet"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("bam-eval passkey: error:") and message in error


def test_a_model_without_a_template_gets_the_paper_prompt(tmp_path, recorded_prompts, capsys):
    from bam_llama.data.tokenizers import build_byte_tokenizer

    tiny_model(vocab_size=259).save_pretrained(tmp_path / "model")
    build_byte_tokenizer().save_pretrained(tmp_path / "model")
    run_passkey(tmp_path / "model", tmp_path / "out", "--lengths", "300")
    assert "the paper's prompt (the model carries no passkey template)" in capsys.readouterr().err
    assert all(decode_bytes(prompt).startswith("There is an important info hidden") for prompt in recorded_prompts)


# ------------------------------------------------------------------------------------------ the README


def readme_block(heading: str, language: str) -> str:
    """The first fenced `language` block after `heading` in README.md."""
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme[readme.index(heading) :]
    return re.search(rf"```{language}\n(.*?)```", section, re.S).group(1)


def test_the_readme_usage_snippet_runs_on_the_demo_model(demo_output):
    snippet = readme_block("## Using a model", "python")
    assert 'from_pretrained("bam-demo-output/bam-model")' in snippet
    completed = run_within([sys.executable, "-c", snippet], 300, cwd=demo_output.parent, env=subprocess_env())
    assert completed.returncode == 0, completed.stderr
    assert len(completed.stdout.strip().splitlines()) == 1  # the model's answer (meaningless after a quick run)


# ------------------------------------------------------------------------------------- without triton


HIDE_TRITON = """
import sys
from importlib.machinery import PathFinder

class PathFinderWithoutTriton(PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        return None if name.split(".")[0] == "triton" else super().find_spec(name, path, target)

sys.meta_path = [PathFinderWithoutTriton if finder is PathFinder else finder for finder in sys.meta_path]
"""


def run_without_triton(script: str, tmp_path) -> subprocess.CompletedProcess:
    """`script` in a fresh interpreter in which `triton` cannot be found, as when it is not installed."""
    completed = run_within(
        [sys.executable, "-c", HIDE_TRITON + textwrap.dedent(script)], 300,
        env=subprocess_env(HF_MODULES_CACHE=str(tmp_path / "modules")), cwd=tmp_path,
    )
    assert completed.returncode == 0, completed.stderr
    return completed


def test_the_package_works_without_triton(tmp_path):
    run_without_triton(
        """
        import importlib.util, sys
        import torch
        assert importlib.util.find_spec("triton") is None
        import bam_llama
        from bam_llama import BamLlamaConfig, BamLlamaForCausalLM
        from transformers import AutoModelForCausalLM

        config = BamLlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2)
        torch.manual_seed(0)
        model = BamLlamaForCausalLM(config).eval()
        assert "triton" not in model.config._attn_implementation  # bam_sdpa (named "sdpa" by newer configs)
        ids = torch.randint(0, 50, (2, 12))
        with torch.no_grad():
            logits = model(ids).logits
            model.set_attn_implementation("bam_eager")
            torch.testing.assert_close(model(ids).logits, logits, atol=1e-5, rtol=1e-4)
        try:
            model.set_attn_implementation("bam_triton")
            raise AssertionError("bam_triton was accepted without triton")
        except ValueError as error:
            assert "needs the `triton` package" in str(error)
        model.save_pretrained("saved")
        for kwargs in ({}, {"trust_remote_code": True}):
            loaded = AutoModelForCausalLM.from_pretrained("saved", **kwargs).eval()
            with torch.no_grad():
                torch.testing.assert_close(loaded(ids).logits, logits)
        import bam_llama.training.finetune, bam_llama.conversion.reference, bam_llama.hub.card, bam_llama.demo.pipeline  # noqa: F401
        assert "triton" not in sys.modules
        """,
        tmp_path,
    )


def test_triton_is_an_extra_not_a_core_dependency():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    assert not [requirement for requirement in project["dependencies"] if requirement.startswith("triton")]
    for extra in ("triton", "dev"):
        assert any(requirement.startswith("triton") for requirement in project["optional-dependencies"][extra])
    assert project["requires-python"].startswith(">=3.")


# ------------------------------------------------------------------------------ loading without the package


def test_a_saved_folder_loads_with_the_card_lines_without_the_package(demo_output, tmp_path):
    """The card's `trust_remote_code` lines load model and tokenizer where bam_llama cannot be imported, without
    an interactive question, and the tokenizer gives byte ids (3 + byte) for non-ASCII text too."""
    folder = shutil.copytree(demo_output / "bam-model", tmp_path / "bam-model")
    card = write_model_card(folder).read_text()
    lines = re.search(r"Or without it:.*?```python\n(.*?)```", card, re.S).group(1)
    lines = lines.replace("path/to/bam-model", str(folder))
    check = """
    for text in ["The pass key is 41234.", "héllo wörld ✓", "日本語 🙂"]:
        assert tokenizer(text)["input_ids"] == [3 + byte for byte in text.encode("utf-8")], text
        assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert sys.modules["bam_llama"] is None and type(model).__module__.startswith("transformers_modules")
    """
    hide_package = 'import sys\nsys.modules["bam_llama"] = None  # import bam_llama fails, as if not installed\n'
    completed = run_within(
        [sys.executable, "-c", hide_package + lines + textwrap.dedent(check)], 300, stdin=subprocess.DEVNULL,
        cwd=tmp_path, env=subprocess_env(HF_MODULES_CACHE=str(tmp_path / "modules")),
    )
    assert completed.returncode == 0, completed.stderr
    assert "Do you wish to run the custom code" not in completed.stdout + completed.stderr


# ---------------------------------------------------------------------------------------------------- PEFT


def test_apply_prior_trainability_refreezes_what_peft_unfreezes():
    from peft import LoraConfig, get_peft_model

    model = tiny_model("bam_sdpa", ssmax=True)  # alpha and beta trained, theta_mu frozen (non-zero here)
    frozen_mu = model.model.prior.theta_mu.detach().clone()
    peft_model = get_peft_model(model, LoraConfig(
        r=2, target_modules=["q_proj", "v_proj"], modules_to_save=["prior", "ssmax"], task_type="CAUSAL_LM",
    ))
    peft_model.get_base_model().apply_prior_trainability()
    trainable = {name for name, parameter in peft_model.named_parameters() if parameter.requires_grad}
    prior_trainable = {name.split("modules_to_save.default.")[-1] for name in trainable if "lora" not in name}
    assert prior_trainable == {"theta_alpha", "theta_beta", "scale"}
    assert not [name for name in trainable if "original_module" in name]

    wrapper = peft_model.base_model.model.model.prior
    before = {name: parameter.detach().clone() for name, parameter in wrapper.named_parameters()}
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=0.1, weight_decay=0.1)
    ids = torch.randint(0, 97, (2, 16))
    peft_model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    trained = wrapper.modules_to_save["default"]
    torch.testing.assert_close(trained.theta_mu.detach(), frozen_mu, rtol=0, atol=0)
    assert not torch.equal(trained.theta_alpha.detach(), before["modules_to_save.default.theta_alpha"])
    assert not torch.equal(trained.theta_beta.detach(), before["modules_to_save.default.theta_beta"])
    for name, value in before.items():
        if "original_module" in name:
            torch.testing.assert_close(dict(wrapper.named_parameters())[name].detach(), value, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------------- plots


@pytest.fixture
def saved_figures(monkeypatch):
    """The matplotlib figures the plot functions would write."""
    figures = []
    monkeypatch.setattr(plots, "save_figure", lambda figure, path: figures.append(figure))
    return figures


def test_heatmap_has_the_table_lengths_depth_ticks_and_a_legend(saved_figures):
    lengths, depths = [128, 256, 512], uniform_depths(5)
    correct = [[True] * 5, [True, False, True, True, True], [False, False, False, False, True]]
    PasskeyResults(lengths=lengths, depths=depths, correct=correct, prompt_lengths=[125, 253, 509]).save_heatmap("x")
    axes, legend = saved_figures[0].axes
    assert [label.get_text() for label in axes.get_xticklabels()] == ["128", "256", "512"]
    assert list(axes.get_xticks()) == [0, 1, 2]
    assert [label.get_text() for label in axes.get_yticklabels()] == ["0%", "25%", "50%", "75%", "100%"]
    assert list(axes.get_yticks()) == [0, 1, 2, 3, 4]  # rows are the depths 0, 0.25, ... 1
    grid = axes.images[0].get_array()
    assert grid[1, 1] == 0 and grid[4, 2] == 1 and grid[0, 2] == 0  # row = depth, column = length
    assert [label.get_text() for label in legend.get_yticklabels()] == ["missed", "retrieved"]


def test_heatmap_depth_ticks_fall_between_rows_for_twenty_depths(saved_figures):
    results = PasskeyResults(lengths=[64], depths=uniform_depths(20), correct=[[True] * 20], prompt_lengths=[60])
    results.save_heatmap("x")
    assert list(saved_figures[0].axes[0].get_yticks()) == [0, 4.75, 9.5, 14.25, 19]


def test_prior_plot_is_log_log_and_shows_every_head(saved_figures):
    model = tiny_model()
    prior = model.model.prior
    alphas, betas = [1.0, 0.0, -1.0, -2.0], [-2.0, 0.0, 0.5, 3.0]
    with torch.no_grad():
        prior.theta_alpha.copy_(torch.tensor(alphas))
        prior.theta_beta.copy_(torch.tensor(betas))
        prior.theta_mu.zero_()
    plot_prior(model, "x", max_distance=200)
    axes = saved_figures[0].axes[0]
    assert axes.get_xscale() == "log" and axes.get_yscale() == "log"
    head_lines = [line for line in axes.get_lines() if line.get_label().startswith("head")]
    assert len(head_lines) == 4
    low, high = axes.get_ylim()
    # the test's own penalty: exp(alpha) * (d + 1e-5) ** beta at distance d (mu = 0)
    for line, alpha, beta in zip(head_lines, alphas, betas):
        assert list(line.get_xdata()) == list(range(1, 201))
        for distance in (1, 10, 200):
            expected = math.exp(alpha) * (distance + 1e-5) ** beta
            assert line.get_ydata()[distance - 1] == pytest.approx(expected, rel=1e-5)
            assert low <= expected <= high  # from 4e-5 (head 0 at 200) to 1e6 (head 3 at 200): all on the chart
        assert f"b(0)={-math.exp(alpha) * 1e-5**beta:.2g}" in line.get_label()
    assert any(line.get_label() == "training length 16" for line in axes.get_lines())
