"""Model cards for saved BamLlama folders: Hub metadata, architecture, the learned prior, evaluation results and
plots, rendered from `card_template.md`. Publishing a folder is `publish.py`; the command, `bam-card`."""

import importlib.resources
import json
import math
import shutil
from pathlib import Path

import jinja2
from huggingface_hub import ModelCard, ModelCardData
from huggingface_hub.utils import HFValidationError, validate_repo_id
from safetensors import safe_open

from ..data.tokenizers import TOKENIZER_FILES
from ..evaluation.needles import NeedleResults
from ..evaluation.passkey import PasskeyResults
from ..evaluation.perplexity import PerplexityResults
from ..evaluation.results import results_from_dict
from ..files.outputs import staged_files
from ..model.configuration_bam import BamLlamaConfig
from ..model.prior_bam import THETA_PARAMETERS, prior_offset
from ..positional_variants import POSITIONAL_VARIANTS

TEMPLATE_NAME = "card_template.md"  # package data of bam_llama.hub, so wheels carry it
BAM_TAGS = ["bam", "ggd-bam", "custom_code", "long-context"]


def card_template() -> str:
    return importlib.resources.files(__package__).joinpath(TEMPLATE_NAME).read_text(encoding="utf-8")


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
    try:
        BamLlamaConfig.from_dict(config)  # every field checked, as loading the model would
    except (ValueError, TypeError) as error:
        raise ValueError(f"{config_path} is not a valid BamLlama config: {error}") from None
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


def read_shared_prior(model_dir: Path) -> dict:
    """theta_alpha / theta_beta / theta_mu of a prior shared by all layers ({} for per-layer priors)."""
    found = {}
    for weights in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(weights), framework="pt") as handle:
            for name in THETA_PARAMETERS:
                if f"model.prior.{name}" in handle.keys():
                    found[name] = handle.get_tensor(f"model.prior.{name}").float().flatten()
    return found if len(found) == 3 else {}


def prior_table(model_dir: Path) -> str | None:
    """Markdown table of the learned prior per head; per-layer priors are left to the prior plot."""
    theta = read_shared_prior(model_dir)
    if not theta:
        return None
    mu = prior_offset(theta["theta_mu"])
    lines = ["| Head | theta_alpha | theta_beta | theta_mu | mu |", "|---|---|---|---|---|"]
    for head, row in enumerate(zip(theta["theta_alpha"], theta["theta_beta"], theta["theta_mu"], mu)):
        lines.append(f"| {head} | " + " | ".join(f"{value.item():.4f}" for value in row) + " |")
    return "\n".join(lines)


def count_parameters(model_dir: Path) -> str:
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


def needle_section(results: NeedleResults) -> dict:
    task = results.needle_task
    description = (
        f"Needles ({task.kind}: {task.describe()}, {task.digits}-digit values) in real text, the asked one at "
        f"{results.describe_depths()}; greedy decoding, correct only when the answer is exactly the asked values "
        f"in order. Mean accuracy {100 * results.mean_accuracy():.1f}%."
    )
    return {"title": f"Needles: {task.kind}", "description": description, "table": results.to_markdown().strip()}


def passkey_section(results: PasskeyResults) -> dict:
    digits = len(results.passkeys[0][0]) if results.passkeys else "random"
    description = (
        f"Passkey retrieval: a {digits}-digit key hidden at {results.describe_depths()} uniformly spaced through "
        "filler text; greedy decoding, correct when the answer starts with the key (and no other digit follows). "
        f"Mean accuracy {100 * results.mean_accuracy():.1f}%."
    )
    return {"title": "Passkey retrieval", "description": description, "table": results.to_markdown().strip()}


def perplexity_section(results: PerplexityResults) -> dict:
    description = (
        "Perplexity of non-overlapping sequences of each context length (one chunked KV-cache pass each), "
        f"and of the last {results.window}-token window of positions."
    )
    return {"title": "Perplexity by context length", "description": description, "table": results.to_markdown().strip()}


# The card's section for each kind of results `bam-eval` writes (`evaluation/results.py`), by exact class: a new
# kind (a subclass included) is refused until it has its own section here.
EVALUATION_SECTIONS = {
    PasskeyResults: passkey_section,
    NeedleResults: needle_section,
    PerplexityResults: perplexity_section,
}


def evaluation_sections(results) -> list[dict]:
    """The card's sections of one `eval_results` item: bam-eval results (an object, its `to_dict()`, its .json
    file) give their one section, bam-demo's results.json (or its dict) a passkey section for each model it trained."""
    source = "evaluation results"
    if isinstance(results, (str, Path)):
        source, results = str(results), json.loads(Path(results).read_text(encoding="utf-8"))
    if is_demo_results(results):
        return demo_sections(results, source)
    if isinstance(results, dict):
        results = results_from_dict(results, source)
    return [evaluation_section(results)]


def is_demo_results(values) -> bool:
    """bam-demo's results.json (`demo/pipeline.py`): {"run": {"argv", "settings", ...}, MODEL: its passkey results, ...}."""
    return isinstance(values, dict) and isinstance(values.get("run"), dict) and "settings" in values["run"]


def demo_sections(values: dict, source: str) -> list[dict]:
    run = values["run"]
    train_length = run["settings"]["data"]["train_length"]
    quick = " A --quick run, for testing: its numbers mean nothing." if "--quick" in run.get("argv", []) else ""
    sections = []
    for name, model_results in values.items():
        if name == "run":
            continue
        section = passkey_section(results_from_dict(model_results, f"{source} ({name})"))
        label = POSITIONAL_VARIANTS[name].label if name in POSITIONAL_VARIANTS else name
        section["title"] = f"Passkey retrieval: {label} (bam-demo)"
        section["description"] += f" Trained by `bam-demo` at {train_length} tokens.{quick}"
        sections.append(section)
    return sections


def evaluation_section(results) -> dict:
    section = EVALUATION_SECTIONS.get(type(results))
    if section is None:
        known = ", ".join(kind.__name__ for kind in EVALUATION_SECTIONS)
        raise TypeError(f"the model card has no section for {type(results).__name__}; it shows {known}")
    return section(results)


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


def copy_plots(model_dir: Path, staging: Path, links: dict[Path, str]) -> None:
    """Into `staging`, the plots that are not in `model_dir` already."""
    for plot, link in links.items():
        if model_dir / link != plot:
            (staging / link).parent.mkdir(exist_ok=True)
            shutil.copyfile(plot, staging / link)


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
        absolute_positions=config.get("absolute_positions"),
        train_context_length=config.get("train_context_length"),
        base_model=base_model,
        base_model_is_hub_id=hub_base_model is not None,
        license=license,
        code_files=remote_code_files(model_dir),
        has_tokenizer=any((model_dir / name).is_file() for name in TOKENIZER_FILES),
        training_text=training_text(config, datasets, base_model),
        prior_table=prior_table(model_dir),
        eval_sections=[section for results in eval_results for section in evaluation_sections(results)],
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
    NeedleResults / PerplexityResults (objects, their `to_dict()`, or bam-eval .json files), each shown in its own
    section (`EVALUATION_SECTIONS`), or bam-demo's results.json (a passkey section per model); `plots` are image files,
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
    with staged_files(model_dir, "README.md") as staging:  # README.md and plots replaced together, or not at all
        copy_plots(model_dir, staging, links)
        card.save(staging / "README.md")
    return model_dir / "README.md"



def remote_code_files(model_dir: Path) -> list[str]:
    return sorted(path.name for path in model_dir.glob("*.py"))


def check_repo_id(repo_id: str) -> None:
    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise ValueError(f"invalid Hub repo id {repo_id!r}: {error}") from None
