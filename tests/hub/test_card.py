import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import tiny_model
from huggingface_hub import HfApi, ModelCard
from waiting import run_within

from bam_llama.cli.card import main
from bam_llama.data.tokenizers import build_byte_tokenizer
from bam_llama.evaluation.passkey import PasskeyResults, evaluate_passkey
from bam_llama.evaluation.results import RESULT_KINDS, results_from_dict
from bam_llama.evaluation.retrieval import DepthPlan, RetrievalResults
from bam_llama.evaluation.perplexity import PerplexityResults
from bam_llama.evaluation.plots import plot_prior
from bam_llama.hub.card import card_template, write_model_card
from bam_llama.hub.publish import push_model_to_hub

REPO_ROOT = Path(__file__).resolve().parents[2]
REMOTE_CODE = {"configuration_bam.py", "modeling_bam.py", "prior_bam.py", "reference_bam.py", "blocked_bam.py", "triton_bam.py"}


@pytest.fixture(scope="module")
def byte_model():
    return tiny_model(vocab_size=259)


@pytest.fixture(scope="module")
def saved_model(byte_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("saved") / "tiny-bam"
    byte_model.save_pretrained(folder)
    return folder


@pytest.fixture
def model_dir(saved_model, tmp_path):
    return Path(shutil.copytree(saved_model, tmp_path / "tiny-bam"))


@pytest.fixture
def hub(monkeypatch):
    """HfApi with the network calls replaced; records what each upload would send."""
    calls = SimpleNamespace(created=[], uploads=[], commits=[])

    def create_repo(self, repo_id, **kwargs):
        calls.created.append(repo_id)
        return SimpleNamespace(repo_id=repo_id)

    def upload_folder(self, *, repo_id, folder_path, **kwargs):
        folder = Path(folder_path)
        files = {path.relative_to(folder).as_posix() for path in folder.rglob("*") if path.is_file()}
        readme = (folder / "README.md").read_text(encoding="utf-8")
        calls.uploads.append(SimpleNamespace(repo_id=repo_id, files=files, readme=readme, kwargs=kwargs))
        return SimpleNamespace(commit_url=f"https://huggingface.co/{repo_id}/commit/1")

    def create_commit(self, *, repo_id, operations, **kwargs):
        readme = next(op.path_or_fileobj for op in operations if op.path_in_repo == "README.md")
        files = {op.path_in_repo for op in operations}
        calls.commits.append(SimpleNamespace(repo_id=repo_id, files=files, readme=Path(readme).read_text()))
        return SimpleNamespace(commit_url=f"https://huggingface.co/{repo_id}/commit/1")

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    monkeypatch.setattr(HfApi, "create_commit", create_commit)
    return calls


def edit_config(model_dir: Path, **values) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    config.update(values)
    (model_dir / "config.json").write_text(json.dumps(config))


def assert_bam_metadata(card: ModelCard) -> None:
    assert card.data.library_name == "transformers"
    assert card.data.pipeline_tag == "text-generation"
    assert {"custom_code", "bam"} <= set(card.data.tags)


def test_card_metadata_and_text(model_dir):
    path = write_model_card(model_dir, base_model="meta-llama/Llama-3.2-1B", datasets=["HuggingFaceFW/fineweb"],
                            license="mit", repo_id="someone/tiny-bam", tags=["demo"])

    card = ModelCard.load(path)
    assert_bam_metadata(card)
    assert card.data.license == "mit"
    assert card.data.datasets == ["HuggingFaceFW/fineweb"]
    assert card.data.base_model == "meta-llama/Llama-3.2-1B"
    assert "demo" in card.data.tags
    assert card.text.lstrip().startswith("# tiny-bam")
    assert 'from_pretrained("someone/tiny-bam", trust_remote_code=True)' in card.text
    assert "| Head | theta_alpha | theta_beta | theta_mu | mu |" in card.text
    assert all(f"`{name}`" in card.text for name in REMOTE_CODE)
    assert "No evaluation results" in card.text
    assert "Absolute positions" not in card.text
    assert ModelCard(path.read_text()).data.to_dict() == card.data.to_dict()
    assert card_template() == (REPO_ROOT / "bam_llama" / "hub" / "card_template.md").read_text()


def test_base_model_from_config_and_absent_without_one(model_dir, tmp_path):
    plain = ModelCard.load(write_model_card(model_dir))
    assert plain.data.base_model is None and plain.data.datasets is None
    assert "base_model" not in plain.content.split("---")[1]

    edit_config(model_dir, base_model="someone/tiny-llama")  # what fine-tuning records
    assert ModelCard.load(write_model_card(model_dir)).data.base_model == "someone/tiny-llama"

    local_llama = tmp_path / "llama-dir"
    local_llama.mkdir()
    edit_config(model_dir, base_model=None, converted_from={"format": "llama", "base_model": str(local_llama)})
    converted = ModelCard.load(write_model_card(model_dir))
    assert converted.data.base_model is None  # a local folder is no Hub id: named in the text only
    assert f"Converted from the Llama checkpoint `{local_llama}`" in converted.text


def test_card_follows_the_config(tmp_path):
    folder = tmp_path / "variant"
    tiny_model(prior_scope="layer", prior_formula="legacy", ssmax=True, ssmax_prior=False,
               absolute_positions="sinusoidal").save_pretrained(folder)

    text = ModelCard.load(write_model_card(folder)).text
    assert "one prior per layer; formula `legacy`" in text
    assert "b_h(i, j) = -(|((j - i) - mu_h) * exp(theta_alpha_h)|" in text
    assert "| Scalable Softmax | on, prior unscaled |" in text
    assert "prior excluded" in text
    assert "| Absolute positions | `sinusoidal`: a fixed embedding of each token's absolute position" in text
    assert "theta_alpha | theta_beta" not in text  # per-layer priors are left to the prior plot


def test_evaluation_tables_and_plots(model_dir, byte_model, tmp_path):
    passkey = evaluate_passkey(byte_model, build_byte_tokenizer(), lengths=[40, 64], num_depths=DepthPlan(3, {64: 2}),
                               num_digits=2, progress=False, chunk_size=32)
    perplexity = PerplexityResults(context_lengths=[16, 32], window=16, perplexity=[90.5, 120.25],
                                   window_perplexity=[[90.5], [95.0, 150.0]], num_sequences=[4, 2])
    heatmap = tmp_path / "passkey_heatmap.png"
    passkey.save_heatmap(heatmap)
    prior_plot = model_dir / "prior.png"  # already in the folder: linked where it is
    plot_prior(byte_model, prior_plot, max_distance=64)

    path = write_model_card(model_dir, eval_results=[passkey, perplexity.to_dict()], plots=[heatmap, prior_plot])

    text = path.read_text()
    assert passkey.to_markdown().strip() in text
    assert perplexity.to_markdown().strip() in text
    assert f"Mean accuracy {100 * passkey.mean_accuracy():.1f}%" in text
    assert "2-digit key hidden at 3 depths (2 at 64 tokens) uniformly spaced" in text
    assert "![passkey heatmap](plots/passkey_heatmap.png)" in text
    assert "![prior](prior.png)" in text
    assert (model_dir / "plots" / "passkey_heatmap.png").read_bytes() == heatmap.read_bytes()
    assert str(tmp_path) not in text
    assert_bam_metadata(ModelCard.load(path))


# One results file of each kind bam-eval writes, and what its card section must say, written here by hand.
RETRIEVAL_FIELDS = dict(lengths=[32, 64], depths=[[0.0, 1.0], [0.0, 1.0]], correct=[[True, True], [True, False]],
                        prompt_lengths=[31, 63])
RESULTS_OF_EACH_KIND = {
    "passkey": (
        {"kind": "passkey", **RETRIEVAL_FIELDS, "passkeys": [["123", "456"], ["789", "012"]]},
        "### Passkey retrieval",
        "a 3-digit key hidden at 2 depths uniformly spaced through filler text",
        "Mean accuracy 75.0%.",
    ),
    "needles": (
        {"kind": "needles", **RETRIEVAL_FIELDS, "task": {"kind": "multikey", "keys": 3, "digits": 4}},
        "### Needles: multikey",
        "Needles (multikey: 3 keys, one asked, 4-digit values) in real text, the asked one at 2 depths",
        "Mean accuracy 75.0%.",
    ),
    "perplexity": (
        {"kind": "perplexity", "context_lengths": [16], "window": 8, "perplexity": [42.0],
         "window_perplexity": [[40.0, 44.0]], "num_sequences": [3]},
        "### Perplexity by context length",
        "and of the last 8-token window of positions.",
        "| 16 | 3 | 42.000 | 44.000 |",
    ),
}
SECTION_TITLES = {title for _, title, _, _ in RESULTS_OF_EACH_KIND.values()}


def test_every_results_kind_of_bam_eval_has_a_sample_here():
    """A kind bam-eval learns to write needs a sample above, and so its own card section."""
    assert set(RESULT_KINDS) == set(RESULTS_OF_EACH_KIND)


@pytest.mark.parametrize("kind", sorted(RESULTS_OF_EACH_KIND))
def test_each_results_kind_renders_its_own_section(model_dir, tmp_path, kind):
    values, title, description, table_or_accuracy = RESULTS_OF_EACH_KIND[kind]
    results_file = tmp_path / f"{kind}.json"
    results_file.write_text(json.dumps(values))
    for results in (results_file, values, results_from_dict(values)):  # a bam-eval file, its dict, the object
        text = write_model_card(model_dir, eval_results=[results]).read_text()
        assert title in text and description in text and table_or_accuracy in text, text
        assert [line for line in text.splitlines() if line in SECTION_TITLES] == [title]


def test_results_of_a_kind_without_a_section_are_refused(model_dir):
    class LongRangeResults(PasskeyResults):  # a new kind, built on a known one
        KIND = "long-range"

    retrieval = RETRIEVAL_FIELDS | {"predictions": [["a", "b"], ["c", "d"]]}
    looks_like_perplexity = SimpleNamespace(window=8, to_markdown=lambda: "| 16 | 3 | 42.000 | 44.000 |")
    for results in (LongRangeResults(**retrieval), RetrievalResults(**retrieval), looks_like_perplexity):
        with pytest.raises(TypeError, match="model card has no section for") as error:
            write_model_card(model_dir, eval_results=[results])
        assert "PasskeyResults, NeedleResults, PerplexityResults" in str(error.value)
        assert not (model_dir / "README.md").exists()
    with pytest.raises(ValueError, match="not a bam-eval results file"):
        write_model_card(model_dir, eval_results=[{"kind": "long-range", **retrieval}])


def test_push_folder_uploads_code_weights_and_card_in_one_commit(model_dir, hub):
    push_model_to_hub(model_dir, "someone/tiny-bam", commit_message="first")

    (upload,) = hub.uploads
    assert hub.created == ["someone/tiny-bam"] and not hub.commits
    assert {"README.md", "config.json", "model.safetensors", *REMOTE_CODE} <= upload.files
    assert upload.kwargs["commit_message"] == "first"
    card = ModelCard(upload.readme)
    assert_bam_metadata(card)
    assert 'from_pretrained("someone/tiny-bam"' in card.text


def test_push_keeps_a_bam_card_and_replaces_another(model_dir, hub):
    write_model_card(model_dir, description="Card with results.", datasets=["someone/data"])
    push_model_to_hub(model_dir, "someone/tiny-bam")
    assert "Card with results." in hub.uploads[-1].readme

    for other_card in ("---\nlibrary_name: transformers\ntags:\n- bam\n---\n# converted\n", "---\n[broken\n---\n"):
        (model_dir / "README.md").write_text(other_card)
        push_model_to_hub(model_dir, "someone/tiny-bam")
        assert_bam_metadata(ModelCard(hub.uploads[-1].readme))


def test_model_push_to_hub_uploads_the_bam_card(byte_model, hub):
    byte_model.push_to_hub("someone/tiny-bam", tags=["demo"], commit_message="from python")

    (upload,) = hub.uploads
    assert not hub.commits
    assert {"README.md", "config.json", "model.safetensors", *REMOTE_CODE} <= upload.files
    assert not {"card.py", "publish.py"} & upload.files  # not shipped as remote code
    card = ModelCard(upload.readme)
    assert_bam_metadata(card)
    assert "demo" in card.data.tags
    assert upload.kwargs["commit_message"] == "from python"


def test_model_push_to_hub_without_bam_llama_falls_back_to_transformers(byte_model, hub, monkeypatch):
    monkeypatch.setitem(sys.modules, "bam_llama.hub.publish", None)  # as in a remote-code-only environment
    generic = ModelCard("---\nlibrary_name: transformers\n---\nGeneric card")
    monkeypatch.setattr("transformers.utils.hub.create_and_tag_model_card", lambda *args, **kwargs: generic)

    byte_model.push_to_hub("someone/tiny-bam")

    (commit,) = hub.commits
    assert not hub.uploads
    assert {"README.md", "config.json", "model.safetensors", *REMOTE_CODE} <= commit.files
    assert "Generic card" in commit.readme


def test_cli_help():
    result = run_within(["bam-card", "--help"], 120)
    assert result.returncode == 0
    assert "--push" in result.stdout and "--results" in result.stdout and "--plot" in result.stdout


def test_cli_writes_card_and_pushes(model_dir, tmp_path, hub, capsys):
    results = tmp_path / "perplexity.json"
    perplexity = PerplexityResults(context_lengths=[16], window=8, perplexity=[42.0], window_perplexity=[[40.0, 44.0]],
                                   num_sequences=[3])
    results.write_text(json.dumps(perplexity.to_dict()))

    main([str(model_dir), "--dataset", "someone/data", "--base-model", "someone/base", "--results", str(results),
          "--push", "someone/tiny-bam"])

    card = ModelCard.load(model_dir / "README.md")
    assert card.data.datasets == ["someone/data"] and card.data.base_model == "someone/base"
    assert perplexity.to_markdown().strip() in card.text
    assert hub.uploads[0].readme == (model_dir / "README.md").read_text()
    assert "Pushed" in capsys.readouterr().out


def test_cli_puts_the_results_of_a_quick_demo_on_its_models_card(tmp_path, capsys):
    """bam-demo --quick's results.json on the card of the BAM model it saved: a passkey section per trained model,
    each with its mean accuracy as the demo's results give it."""
    from bam_llama.cli.demo import run_demo

    demo = tmp_path / "bam-demo-output"
    run_demo(["--quick", "--models", "bam,alibi", "--output-dir", str(demo)])

    main([str(demo / "bam-model"), "--results", str(demo / "results.json")])

    text = (demo / "bam-model" / "README.md").read_text()
    saved = json.loads((demo / "results.json").read_text())
    for name, label in (("bam", "BAM (GGD prior)"), ("alibi", "ALiBi")):
        correct = [found for row in saved[name]["correct"] for found in row]
        assert f"### Passkey retrieval: {label} (bam-demo)" in text
        assert f"Mean accuracy {100 * sum(correct) / len(correct):.1f}%. Trained by `bam-demo` at 64 tokens." in text
    assert text.count("A --quick run, for testing: its numbers mean nothing.") == 2
    assert "Wrote" in capsys.readouterr().out


def listing(folder: Path) -> dict:
    return {path.relative_to(folder).as_posix(): path.stat().st_mtime_ns for path in folder.rglob("*")}


def test_bad_input_raises_and_writes_nothing(model_dir, tmp_path, hub, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        write_model_card(empty)
    assert not any(empty.iterdir())

    before = listing(model_dir)
    with pytest.raises(ValueError, match="invalid Hub repo id"):
        write_model_card(model_dir, repo_id="not a repo id")
    with pytest.raises(ValueError, match="invalid Hub repo id"):
        push_model_to_hub(model_dir, "owner/name/extra")
    with pytest.raises(FileNotFoundError, match="missing.png"):
        write_model_card(model_dir, plots=[tmp_path / "missing.png"])
    with pytest.raises(SystemExit) as exit_info:
        main([str(model_dir), "--push", "bad--id"])
    assert exit_info.value.code == 2 and "invalid Hub repo id" in capsys.readouterr().err
    assert listing(model_dir) == before

    (model_dir / "modeling_bam.py").unlink()
    with pytest.raises(FileNotFoundError, match="modeling_bam.py"):
        push_model_to_hub(model_dir, "someone/tiny-bam")

    edit_config(model_dir, model_type="llama")
    before = listing(model_dir)
    with pytest.raises(ValueError, match="'llama' model"):
        write_model_card(model_dir)
    assert listing(model_dir) == before
    assert not hub.uploads and not hub.created


def test_a_corrupt_safetensors_file_is_named(model_dir, capsys):
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(SystemExit) as exit_info:
        main([str(model_dir)])
    assert exit_info.value.code == 2
    assert f"bam-card: error: {weights} is not a readable safetensors file" in capsys.readouterr().err


def test_a_folder_without_weights_gets_no_card(model_dir, capsys):
    """bam-card on a folder with config.json but no weights: one error line, exit 2, no README.md (before, a card
    claiming "Parameters | 0" with loading instructions). A sharded folder missing a shard is named too."""
    weights = model_dir / "model.safetensors"
    weights.rename(model_dir / "elsewhere.bin")
    before = listing(model_dir)
    with pytest.raises(SystemExit) as exit_info:
        main([str(model_dir)])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error == f"bam-card: error: {model_dir} holds no weights (no .safetensors file); save the model there " \
                    "with save_pretrained first\n"
    assert listing(model_dir) == before and not (model_dir / "README.md").exists()

    (model_dir / "elsewhere.bin").rename(model_dir / "model-00001-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="lacks the weight shards model-00002-of-00002.safetensors"):
        write_model_card(model_dir)
    assert not (model_dir / "README.md").exists()
