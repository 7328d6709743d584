"""Checks of a model folder (or Hub id) before Transformers reads it, with errors that name what is wrong."""

import os
from pathlib import Path


def check_model_path(path) -> None:
    """A path that can only be local (absolute, ./ or ../, more than one '/') must exist: Transformers would
    otherwise report it as an invalid Hub repo id."""
    text = str(path)
    looks_local = isinstance(path, Path) or text.startswith((os.sep, ".", "~")) or text.count("/") > 1
    if looks_local and not Path(text).expanduser().exists():
        raise FileNotFoundError(f"no model folder at {text}")


def check_safetensors_files(model_path) -> None:
    """Every safetensors file of a local model folder must open: a corrupt or truncated one is named (safetensors
    itself only says "Error while deserializing header")."""
    folder = Path(model_path)
    if not folder.is_dir():
        return
    from safetensors import SafetensorError, safe_open

    for path in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(path, framework="pt"):
                pass
        except SafetensorError as error:
            raise ValueError(f"{path} is not a readable safetensors file, probably corrupt or truncated ({error})") from None
