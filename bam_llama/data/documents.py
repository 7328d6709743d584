"""Documents from the sources every command accepts (`bam-finetune`, `bam-pretrain`, `bam-eval perplexity`), and
their tokenization: one loader, one set of rules.

A source is a `.txt` file (documents separated by blank lines), a `.jsonl` file (one JSON object per line, text in
`text_field`), a `.json` / `.csv` / `.parquet` file, a folder of `.txt` / `.jsonl` files, a folder written by
`datasets.save_to_disk`, or a `datasets` name on the Hub (streamed when `max_documents` bounds it). `datasets` is
optional (not a dependency): imported only where a source needs it.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from tqdm.auto import tqdm

TEXT_SUFFIXES = (".txt", ".jsonl")
DATASETS_FILE_BUILDERS = {".json": "json", ".csv": "csv", ".parquet": "parquet"}


def load_documents(
    source: str,
    text_field: str = "text",
    split: str = "train",
    config_name: str | None = None,
    max_documents: int | None = None,
    purpose: str = "training",
) -> list[str]:
    """The non-empty documents of `source` (the first `max_documents` of them, if given); a ValueError naming
    `source` when there are none. `purpose` ("training", "evaluation") names the data in errors."""
    path = Path(source)
    if looks_like_a_local_path(source) and not path.exists():
        raise FileNotFoundError(f"no {purpose} data at {source} (the file or folder does not exist)")
    if path.is_dir() and not _is_saved_dataset(path):
        documents = [document for file in _text_files(path, purpose) for document in _read_text_file(file, text_field)]
    elif path.is_file() and path.suffix in TEXT_SUFFIXES:
        documents = _read_text_file(path, text_field)
    else:
        documents = _read_dataset(source, text_field, split, config_name, max_documents)
    documents = [document for document in documents if document.strip()][:max_documents]
    if not documents:
        raise ValueError(f"no {purpose} text found in {source!r} (field {text_field!r} for JSON lines and datasets)")
    return documents


def looks_like_a_local_path(source: str) -> bool:
    """A data source that can only be local: absolute, ./ ../ ~, more than one '/', or a data-file extension. Hub
    dataset names ('wikitext', 'user/name') are none of these."""
    return (
        source.startswith((os.sep, "/", ".", "~"))
        or source.count("/") > 1
        or (os.sep != "/" and os.sep in source)
        or Path(source).suffix.lower() in (*TEXT_SUFFIXES, *DATASETS_FILE_BUILDERS)
    )


def _text_files(folder: Path, purpose: str) -> list[Path]:
    files = sorted(file for file in folder.rglob("*") if file.is_file() and file.suffix in TEXT_SUFFIXES)
    if not files:
        raise ValueError(f"no {purpose} text found in {str(folder)!r}: the folder holds no .txt or .jsonl files")
    return files


def _read_text_file(path: Path, text_field: str) -> list[str]:
    text = read_utf8_text(path)
    if path.suffix == ".txt":
        return [document.strip() for document in re.split(r"\n\s*\n", text)]
    documents = []
    for line_number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{line_number} is not valid JSON ({error})") from None
        if not isinstance(record, dict) or text_field not in record:
            raise ValueError(f"{path}:{line_number} has no field {text_field!r} (choose it with --text-field)")
        documents.append(checked_text(record[text_field], f"{path}:{line_number}", text_field))
    return documents


def checked_text(value, where: str, text_field: str) -> str:
    """`value` if it is text; otherwise a ValueError naming where it is and its type (never train on "None")."""
    if not isinstance(value, str):
        kind = "null" if value is None else type(value).__name__
        raise ValueError(f"{where}: field {text_field!r} is {kind} ({value!r:.40}), not text")
    return value


def _is_saved_dataset(folder: Path) -> bool:
    return any((folder / name).is_file() for name in ("dataset_info.json", "dataset_dict.json", "state.json"))


def _read_dataset(source: str, text_field: str, split: str, config_name: str | None, max_documents: int | None) -> list[str]:
    import datasets

    path = Path(source)
    if max_documents is not None and not path.exists():  # a Hub dataset, streamed only as far as needed
        rows = datasets.load_dataset(source, config_name, split=split, streaming=True)
        return [_row_text(row, source, index, text_field) for index, row in zip(range(max_documents), rows)]
    if path.is_dir():
        dataset = datasets.load_from_disk(source)
    elif path.is_file() and path.suffix in DATASETS_FILE_BUILDERS:
        dataset = datasets.load_dataset(DATASETS_FILE_BUILDERS[path.suffix], data_files=source, split="train")
    elif path.exists():
        raise ValueError(f"cannot read training data from {source!r}: use .txt, .jsonl, .json, .csv or .parquet")
    else:
        dataset = datasets.load_dataset(source, config_name, split=split)
    if isinstance(dataset, datasets.DatasetDict):
        if split not in dataset:
            raise ValueError(f"{source!r} has no split {split!r} (it has {sorted(dataset)}); choose one with --dataset-split")
        dataset = dataset[split]
    if len(dataset) and text_field not in dataset.column_names:
        raise ValueError(f"{source!r} has no column {text_field!r} (it has {dataset.column_names}); use --text-field")
    texts = dataset[text_field] if len(dataset) else []
    return [checked_text(text, f"{source} row {index}", text_field) for index, text in enumerate(texts)]


def _row_text(row: dict, source: str, index: int, text_field: str) -> str:
    if text_field not in row:
        raise ValueError(f"{source!r} has no column {text_field!r} (it has {sorted(row)}); use --text-field")
    return checked_text(row[text_field], f"{source} row {index}", text_field)


def tokenize_documents(documents: list[str], tokenizer, show_progress: bool = True, batch_size: int = 512) -> list[list[int]]:
    """Token ids per document, framed by the tokenizer's <s> and </s> when it has them."""
    prefix = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    suffix = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    tokenized = []
    for start in tqdm(range(0, len(documents), batch_size), desc="tokenizing", unit="batch", disable=not show_progress):
        batch = tokenizer(documents[start : start + batch_size], add_special_tokens=False)["input_ids"]
        tokenized.extend(prefix + ids + suffix for ids in batch)
    return tokenized


def read_utf8_text(path: Path) -> str:
    """The text of a user's data file; a file that is not UTF-8 (a binary file in a data folder) is a ValueError
    naming the file, the line and the byte, like the JSON-lines errors (Python names neither file nor line)."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise ValueError(
            f"{path}:{line} is not UTF-8 text (byte 0x{data[error.start]:02x} at offset {error.start}): a binary "
            "file? Only UTF-8 text files can be read as training or evaluation text"
        ) from None
