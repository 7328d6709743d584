"""`bam-card`: write README.md (a Hub model card) for a saved BamLlama folder; optionally push the folder.

    bam-card MODEL_DIR [--base-model ID] [--dataset ID ...] [--results passkey.json ...] [--plot a.png ...]
             [--push REPO_ID]
"""

import argparse
import sys
from pathlib import Path

from ..files.outputs import exit_on_sigterm
from .reporting import run_reported


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
    parser.add_argument("--results", nargs="+", default=[], help="results .json files written by bam-eval --out, or bam-demo's results.json")
    parser.add_argument("--plot", nargs="+", default=[], help="images to show (copied into MODEL_DIR/plots)")
    parser.add_argument("--name", help="model name in the title (default: the repo or folder name)")
    parser.add_argument("--description", help="a paragraph under the title")
    parser.add_argument("--extra", help="a markdown file appended as 'Additional information'")
    parser.add_argument("--push", metavar="REPO_ID", help="then upload the folder to this Hub repo in one commit")
    parser.add_argument("--private", action="store_true", help="create the Hub repo private")
    parser.add_argument("--token", help="Hub token (default: the logged-in one)")
    return parser


def main(argv: list[str] | None = None) -> None:
    """Exits with `reporting.run_reported`'s status when something stops the command."""
    args = build_parser().parse_args(argv)
    exit_on_sigterm()
    status = run_reported("bam-card", run, args)
    if status:
        sys.exit(status)


def run(args) -> None:
    from ..hub.card import check_repo_id, write_model_card
    from ..hub.publish import check_uploadable, push_model_to_hub
    from ..files.model_folders import check_finite_weights, check_safetensors_files

    model_dir = Path(args.model_dir)
    check_safetensors_files(model_dir)
    check_finite_weights(model_dir)
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
