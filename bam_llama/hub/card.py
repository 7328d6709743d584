"""Model cards for saved BamLlama folders, and publishing a folder (remote code, weights, tokenizer, card) on the Hub.

    bam-card MODEL_DIR [--base-model ID] [--dataset ID ...] [--results passkey.json ...] [--plot a.png ...]
             [--push REPO_ID]

`BamLlamaForCausalLM.push_to_hub` goes through `push_pretrained_model` here, so a model pushed from Python gets the
same card as a folder pushed with `bam-card --push`.
"""

import argparse
import importlib.resources
import json
import math
import shutil
import tempfile
from pathlib import Path

import jinja2
import yaml
from huggingface_hub import HfApi, ModelCard, ModelCardData
from huggingface_hub.utils import HFValidationError, validate_repo_id

from ..outputs import check_safetensors_files


TEMPLATE_NAME = "model_card_template.md"  # a symlink to model_cards/bam_llama_card_template.md, copied into wheels
BAM_TAGS = ["bam", "ggd-bam", "custom_code", "long-context"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
IGNORE_PATTERNS = ["__pycache__/*", "*.pyc", ".ipynb_checkpoints/*", ".cache/*"]


def card_template() -> str:
    return importlib.resources.files("bam_llama").joinpath(TEMPLATE_NAME).read_text(encoding="utf-8")


# --------------------------------------------------------------------------------------------------------
# What the folder holds
# --------------------------------------------------------------------------------------------------------


def read_config(model_dir: Path) -> dict:
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json; save the model there with save_pretrained first")
    config = json.loads(config_path.read_text(encoding="utf-8"))
    if config.get("model_type") != "bam_llama":
        raise ValueError(f"{model_dir} holds a {config.get('model_type')!r} model; bam-card describes BamLlama models")
    return config


def check_weights(model_dir: Path) -> None:
    """The folder must hold its weights, every shard its index names included: a card for a folder without them
    would count 0 parameters and explain how to load a model that cannot load."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text(encoding="utf-8")).get("weight_map", {}).values()))
        missing = [shard for shard in shards if not (model_dir / shard).is_file()]
        if missing:
            raise FileNotFoundError(f"{model_dir} lacks the weight shards {', '.join(missing)} that {index.name} names")
    elif not any(model_dir.glob("*.safetensors")):
        raise FileNotFoundError(
            f"{model_dir} holds no weights (no .safetensors file); save the model there with save_pretrained first"
        )


def remote_code_files(model_dir: Path) -> list[str]:
    return sorted(path.name for path in model_dir.glob("*.py"))


def check_uploadable(model_dir: Path) -> None:
    """The folder must hold weights and every module its auto_map names, or the pushed repo will not load."""
    auto_map = read_config(model_dir).get("auto_map")
    if not auto_map:
        raise ValueError(f"{model_dir}/config.json has no auto_map; save the model with save_pretrained")
    needed = {reference.split(".")[0] + ".py" for reference in auto_map.values()}
    missing = sorted(needed - set(remote_code_files(model_dir)))
    if missing:
        raise FileNotFoundError(f"{model_dir} lacks the remote code {', '.join(missing)}; save it with save_pretrained")
    check_weights(model_dir)


def check_repo_id(repo_id: str) -> None:
    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise ValueError(f"invalid Hub repo id {repo_id!r}: {error}") from None


def read_shared_prior(model_dir: Path) -> dict:
    """theta_alpha / theta_beta / theta_mu of a prior shared by all layers ({} for per-layer priors)."""
    from safetensors import safe_open

    found = {}
    for weights in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(weights), framework="pt") as handle:
            for name in ("theta_alpha", "theta_beta", "theta_mu"):
                if f"model.prior.{name}" in handle.keys():
                    found[name] = handle.get_tensor(f"model.prior.{name}").float().flatten()
    return found if len(found) == 3 else {}


def prior_table(model_dir: Path) -> str | None:
    """Markdown table of the learned prior per head; per-layer priors are left to the prior plot."""
    from ..model.prior_bam import prior_offset

    theta = read_shared_prior(model_dir)
    if not theta:
        return None
    mu = prior_offset(theta["theta_mu"])
    lines = ["| Head | theta_alpha | theta_beta | theta_mu | mu |", "|---|---|---|---|---|"]
    for head, row in enumerate(zip(theta["theta_alpha"], theta["theta_beta"], theta["theta_mu"], mu)):
        lines.append(f"| {head} | " + " | ".join(f"{value.item():.4f}" for value in row) + " |")
    return "\n".join(lines)


def count_parameters(model_dir: Path) -> str:
    from safetensors import safe_open

    total = 0
    for weights in model_dir.glob("*.safetensors"):
        with safe_open(str(weights), framework="pt") as handle:
            total += sum(math.prod(handle.get_slice(key).get_shape()) for key in handle.keys())
    return f"{total / 1e6:.1f}M" if total >= 1e5 else f"{total:,}"


# --------------------------------------------------------------------------------------------------------
# What the card says
# --------------------------------------------------------------------------------------------------------


def recorded_base_model(config: dict) -> str | None:
    """The model this one was converted or fine-tuned from, as the converter / fine-tuning recorded it."""
    return config.get("base_model") or (config.get("converted_from") or {}).get("base_model")


def is_hub_id(name: str) -> bool:
    """A Hub repo id rather than a local folder: the base_model metadata field only takes ids."""
    if Path(name).exists():
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def training_text(config: dict, datasets: list[str], base_model: str | None) -> str:
    converted_from = config.get("converted_from") or {}
    lines = []
    if converted_from.get("format") == "llama":
        lines.append(
            f"Converted from the Llama checkpoint `{base_model}`: RoPE dropped, every other weight kept, the prior "
            f"initialised `{converted_from.get('prior_init', 'uniform')}`."
        )
    elif converted_from.get("format") == "bam-reference":
        lines.append(
            f"Converted from a run of the GGD-BAM reference code (variant `{converted_from.get('variant')}`, "
            f"prior formula `{config.get('prior_formula', 'current')}`)."
        )
    elif base_model:
        lines.append(f"Fine-tuned from `{base_model}`.")
    lines.append(f"Trained with a context length of {config.get('train_context_length')} tokens.")
    if datasets:
        lines.append("Training data: " + ", ".join(f"`{name}`" for name in datasets) + ".")
    return " ".join(lines)


def as_results(results):
    """PasskeyResults / PerplexityResults from an object, its `to_dict()`, or a `bam-eval --out` .json file."""
    from ..evaluation.passkey import PasskeyResults, PerplexityResults, load_results

    if isinstance(results, (str, Path)):
        return load_results(results)
    if isinstance(results, dict):
        kinds = {"passkey": PasskeyResults, "perplexity": PerplexityResults}
        if results.get("kind") not in kinds:
            raise ValueError(f"evaluation results of unknown kind {results.get('kind')!r}")
        return kinds[results["kind"]].from_dict(results)
    if not isinstance(results, (PasskeyResults, PerplexityResults)):
        raise TypeError(f"expected PasskeyResults or PerplexityResults, got {type(results).__name__}")
    return results


def evaluation_section(results) -> dict:
    from ..evaluation.passkey import PasskeyResults

    if isinstance(results, PasskeyResults):
        digits = len(results.passkeys[0][0]) if results.passkeys else "random"
        description = (
            f"Passkey retrieval: a {digits}-digit key hidden at {len(results.depths)} depths uniformly spaced through "
            "filler text; greedy decoding, correct when the answer starts with the key. "
            f"Mean accuracy {100 * results.mean_accuracy():.1f}%."
        )
        return {"title": "Passkey retrieval", "description": description, "table": results.to_markdown().strip()}
    description = (
        "Perplexity of non-overlapping sequences of each context length (one chunked KV-cache pass each), "
        f"and of the last {results.window}-token window of positions."
    )
    return {"title": "Perplexity by context length", "description": description, "table": results.to_markdown().strip()}


def plot_links(model_dir: Path, plots) -> dict[Path, str]:
    """{plot file: its path relative to model_dir}: plots outside the folder go to `plots/`."""
    links = {}
    for plot in (Path(path).resolve() for path in plots):
        if not plot.is_file():
            raise FileNotFoundError(f"plot {plot} does not exist")
        link = plot.relative_to(model_dir).as_posix() if plot.is_relative_to(model_dir) else f"plots/{plot.name}"
        if link in links.values():
            raise ValueError(f"two plots would be stored as {link}; rename one")
        links[plot] = link
    return links


def copy_plots(model_dir: Path, links: dict[Path, str]) -> None:
    for plot, link in links.items():
        target = model_dir / link
        if target != plot:
            target.parent.mkdir(exist_ok=True)
            shutil.copyfile(plot, target)


def render_card(model_dir: Path, config: dict, *, base_model, datasets, license, tags, eval_results, plot_paths,
                repo_id, model_name, description, extra) -> ModelCard:
    hub_base_model = base_model if base_model and is_hub_id(base_model) else None
    card_data = ModelCardData(
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=BAM_TAGS + [tag for tag in tags if tag not in BAM_TAGS],
        license=license,
        datasets=datasets or None,
        base_model=hub_base_model,
    )
    num_heads = config["num_attention_heads"]
    template = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(card_template())
    text = template.render(
        card_data=card_data.to_yaml(),
        model_name=model_name,
        repo_id=repo_id or f"path/to/{model_name}",
        description=description,
        num_layers=config["num_hidden_layers"],
        hidden_size=config["hidden_size"],
        num_heads=num_heads,
        num_kv_heads=config.get("num_key_value_heads") or num_heads,
        vocab_size=config["vocab_size"],
        num_parameters=count_parameters(model_dir),
        prior_scope=config.get("prior_scope", "global"),
        prior_formula=config.get("prior_formula", "current"),
        prior_eps=config.get("prior_eps", 1e-5),
        ssmax=bool(config.get("ssmax")),
        ssmax_prior=config.get("ssmax_prior", True),
        train_context_length=config.get("train_context_length"),
        base_model=base_model,
        base_model_is_hub_id=hub_base_model is not None,
        license=license,
        code_files=remote_code_files(model_dir),
        has_tokenizer=any((model_dir / name).is_file() for name in TOKENIZER_FILES),
        training_text=training_text(config, datasets, base_model),
        prior_table=prior_table(model_dir),
        eval_sections=[evaluation_section(as_results(results)) for results in eval_results],
        plots=[{"caption": Path(link).stem.replace("_", " ").replace("-", " "), "path": link} for link in plot_paths],
        extra=extra,
    )
    return ModelCard(text)


def write_model_card(
    model_dir,
    *,
    base_model: str | None = None,
    datasets=(),
    license: str = "apache-2.0",
    tags=(),
    eval_results=(),
    plots=(),
    repo_id: str | None = None,
    model_name: str | None = None,
    description: str | None = None,
    extra: str | None = None,
) -> Path:
    """Write `model_dir/README.md` for a folder saved by `save_pretrained` and return its path.

    The metadata has library_name, pipeline_tag, tags (`bam`, `custom_code`, ... plus `tags`), license, datasets and
    base_model: the argument, else the one config.json records (converted or fine-tuned models); it goes into the
    metadata only when it is a Hub id, local paths are named in the text. `eval_results` are PasskeyResults /
    PerplexityResults (objects, their `to_dict()`, or bam-eval .json files), shown as tables; `plots` are image files,
    copied into `model_dir/plots/` unless already inside the folder, and linked relatively. Everything is checked
    before anything is written: a folder without weights is refused.
    """
    model_dir = Path(model_dir).resolve()
    config = read_config(model_dir)
    check_weights(model_dir)
    if repo_id is not None:
        check_repo_id(repo_id)
    datasets = [datasets] if isinstance(datasets, str) else list(datasets)
    if eval_results is None or not isinstance(eval_results, (list, tuple)):
        eval_results = [] if eval_results is None else [eval_results]
    links = plot_links(model_dir, plots)
    card = render_card(
        model_dir,
        config,
        base_model=base_model or recorded_base_model(config),
        datasets=datasets,
        license=license,
        tags=list(tags),
        eval_results=eval_results,
        plot_paths=list(links.values()),
        repo_id=repo_id,
        model_name=model_name or (repo_id.split("/")[-1] if repo_id else model_dir.name),
        description=description,
        extra=extra,
    )
    copy_plots(model_dir, links)
    card.save(model_dir / "README.md")
    return model_dir / "README.md"


# --------------------------------------------------------------------------------------------------------
# Pushing
# --------------------------------------------------------------------------------------------------------


def has_bam_card(model_dir: Path) -> bool:
    """A README.md written by `write_model_card` (or as complete): kept on push, anything else is replaced."""
    readme = model_dir / "README.md"
    if not readme.is_file():
        return False
    try:
        data = ModelCard.load(readme).data
    except (ValueError, yaml.YAMLError):  # unreadable metadata: replace the card
        return False
    return (
        data.library_name == "transformers"
        and data.pipeline_tag == "text-generation"
        and {"bam", "custom_code"} <= set(data.tags or [])
    )


def push_model_to_hub(
    model_dir,
    repo_id: str,
    *,
    token: str | None = None,
    private: bool | None = None,
    commit_message: str | None = None,
    commit_description: str | None = None,
    revision: str | None = None,
    create_pr: bool = False,
):
    """Upload a saved BamLlama folder (config, weights, remote code, tokenizer, card) to `repo_id` in one commit.

    A BAM card already in the folder (e.g. with evaluation results) is kept; otherwise one is written first. The repo
    is created if needed. Returns the huggingface_hub CommitInfo."""
    model_dir = Path(model_dir).resolve()
    check_repo_id(repo_id)
    check_uploadable(model_dir)
    if not has_bam_card(model_dir):
        write_model_card(model_dir, repo_id=repo_id)
    api = HfApi(token=token)
    repo_id = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model").repo_id
    if revision is not None and not revision.startswith("refs/pr"):
        api.create_branch(repo_id, branch=revision, exist_ok=True)
    return api.upload_folder(
        repo_id=repo_id,
        folder_path=model_dir,
        repo_type="model",
        commit_message=commit_message or "Upload BamLlama model: remote code, weights and model card",
        commit_description=commit_description,
        revision=revision,
        create_pr=create_pr,
        ignore_patterns=IGNORE_PATTERNS,
    )


def push_pretrained_model(
    model,
    repo_id: str,
    *,
    commit_message: str | None = None,
    commit_description: str | None = None,
    private: bool | None = None,
    token: str | None = None,
    revision: str | None = None,
    create_pr: bool = False,
    max_shard_size="50GB",
    tags: list[str] | None = None,
):
    """`BamLlamaPreTrainedModel.push_to_hub` (same arguments): save the model to a temporary folder, write the BAM
    card there and upload the folder in one commit. The card replaces the one on the Hub, if any."""
    check_repo_id(repo_id)
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder, max_shard_size=max_shard_size)
        write_model_card(folder, repo_id=repo_id, tags=tags or ())
        return push_model_to_hub(
            folder,
            repo_id,
            token=token,
            private=private,
            commit_message=commit_message,
            commit_description=commit_description,
            revision=revision,
            create_pr=create_pr,
        )


# --------------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bam-card",
        description="Write README.md (a Hub model card) for a saved BamLlama folder; optionally push the folder.",
    )
    parser.add_argument("model_dir", help="folder written by save_pretrained (config.json, weights, remote code)")
    parser.add_argument(
        "--base-model", help="Hub id of the model it was converted or fine-tuned from (default: config.json's)"
    )
    parser.add_argument("--dataset", action="append", default=[], help="training dataset (Hub id); repeatable")
    parser.add_argument("--license", default="apache-2.0", help="license identifier (default: %(default)s)")
    parser.add_argument("--tag", action="append", default=[], help="extra Hub tag; repeatable")
    parser.add_argument("--results", nargs="+", default=[], help="results .json files written by bam-eval --out")
    parser.add_argument("--plot", nargs="+", default=[], help="images to show (copied into MODEL_DIR/plots)")
    parser.add_argument("--name", help="model name in the title (default: the repo or folder name)")
    parser.add_argument("--description", help="a paragraph under the title")
    parser.add_argument("--extra", help="a markdown file appended as 'Additional information'")
    parser.add_argument("--push", metavar="REPO_ID", help="then upload the folder to this Hub repo in one commit")
    parser.add_argument("--private", action="store_true", help="create the Hub repo private")
    parser.add_argument("--token", help="Hub token (default: the logged-in one)")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        run(args)
    except (FileNotFoundError, ValueError) as error:
        parser.exit(2, f"bam-card: error: {error}\n")


def run(args) -> None:
    model_dir = Path(args.model_dir)
    check_safetensors_files(model_dir)
    if args.push:
        check_repo_id(args.push)
        check_uploadable(model_dir.resolve())
    path = write_model_card(
        model_dir,
        base_model=args.base_model,
        datasets=args.dataset,
        license=args.license,
        tags=args.tag,
        eval_results=args.results,
        plots=args.plot,
        repo_id=args.push,
        model_name=args.name,
        description=args.description,
        extra=Path(args.extra).read_text(encoding="utf-8") if args.extra else None,
    )
    print(f"Wrote {path}")
    if args.push:
        commit = push_model_to_hub(model_dir, args.push, token=args.token, private=args.private or None)
        print(f"Pushed {model_dir} to {getattr(commit, 'commit_url', args.push)}")


if __name__ == "__main__":
    main()
