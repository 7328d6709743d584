"""Publishing a saved BamLlama folder (remote code, weights, tokenizer, card) on the Hub in one commit.

`BamLlamaForCausalLM.push_to_hub` goes through `push_pretrained_model` here, so a model pushed from Python gets the
same card as a folder pushed with `bam-card --push`.
"""

import tempfile
from pathlib import Path

import yaml
from huggingface_hub import HfApi, ModelCard

from .card import check_repo_id, check_weights, read_config, remote_code_files, write_model_card

IGNORE_PATTERNS = ["__pycache__/*", "*.pyc", ".ipynb_checkpoints/*", ".cache/*"]


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
