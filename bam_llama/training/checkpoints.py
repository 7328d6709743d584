"""Which Trainer checkpoint to resume from (`--resume-from-checkpoint PATH | latest`), shared by `bam-finetune` and
`bam-pretrain`. A checkpoint counts as complete once its trainer_state.json (which Trainer writes last) reads."""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

logger = logging.getLogger(__name__)


def resolve_checkpoint(args) -> str | None:
    """The checkpoint folder to resume from: the given one, or with 'latest' the newest complete one in the output
    folder (a checkpoint interrupted while saving is skipped, with a warning)."""
    if args.resume_from_checkpoint in (None, ""):
        return None
    if args.resume_from_checkpoint != "latest":
        if not Path(args.resume_from_checkpoint).is_dir():
            raise ValueError(f"checkpoint folder {args.resume_from_checkpoint} does not exist")
        if checkpoint_step(args.resume_from_checkpoint) is None:
            raise ValueError(f"checkpoint {args.resume_from_checkpoint} is incomplete (no readable trainer_state.json)")
        return args.resume_from_checkpoint
    folders = checkpoint_folders(args.output_dir)
    for folder in folders:
        if checkpoint_step(folder) is not None:
            return str(folder)
        logger.warning("skipping %s: it is incomplete (no readable trainer_state.json; interrupted while saving?)", folder)
    found = f"only incomplete checkpoints ({', '.join(folder.name for folder in folders)})" if folders else "no checkpoint-* folder"
    # As Trainer's resume_from_checkpoint=True: nothing to resume is an error, not a silent fresh start.
    raise ValueError(f"--resume-from-checkpoint latest: {found} in {args.output_dir}, nothing to continue (a run "
                     "stopped before its first checkpoint starts again without --resume-from-checkpoint)")


def checkpoint_folders(folder: str | os.PathLike) -> list[Path]:
    """The checkpoint-N folders in `folder`, newest first, complete or not."""
    folders = sorted(Path(folder).glob("checkpoint-*"), key=checkpoint_number, reverse=True)
    return [folder for folder in folders if folder.is_dir() and checkpoint_number(folder) >= 0]


def latest_checkpoint(folder: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint in `folder`: what --resume-from-checkpoint latest resumes; None if none."""
    return next((checkpoint for checkpoint in checkpoint_folders(folder) if checkpoint_step(checkpoint) is not None), None)


def checkpoint_number(folder: Path) -> int:
    match = re.fullmatch(r"checkpoint-(\d+)", folder.name)
    return int(match.group(1)) if match else -1


def checkpoint_step(checkpoint: str | os.PathLike) -> int | None:
    """The step a checkpoint was saved at, from its trainer_state.json (written last by Trainer); None when the
    file is missing or unreadable, i.e. the save did not finish."""
    try:
        return int(json.loads((Path(checkpoint) / "trainer_state.json").read_text())["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
