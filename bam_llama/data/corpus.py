"""A real-text corpus with no download: the text that ships with Python itself.

Documents: every topic of the language reference (`pydoc_data.topics`, the text `help()` shows) and every `.py`
file of the standard library (its sources with their docstrings and comments), minus test suites, installed
packages and `pydoc_data/topics.py` (the language reference again, as one Python dict: it would put every topic
on both sides of the split). Each document has a name (`pydoc_data/topics/<topic>` or the file's path relative to the library).

Split by document, never by position: a document is held out when the first 8 bytes of the SHA-256 of its name,
read as an integer, fall in the held-out share of [0, 2^64). The split depends only on names, so it is the same on
every machine and in every file order for a given Python version (a Python with other files gives another corpus:
its version and sizes are recorded with the corpus). Held-out documents are never trained on.

    python -m bam_llama.cli.corpus OUTPUT_DIR [--heldout-percent 5]

writes OUTPUT_DIR/train.jsonl and OUTPUT_DIR/heldout.jsonl (`{"name", "text"}` per line, sorted by name) and
OUTPUT_DIR/corpus.json (Python version, documents and characters per split), through a temporary folder.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import platform
import pydoc_data.topics
import sysconfig
from pathlib import Path

from ..files.outputs import staged_output_dir

SKIPPED_FOLDERS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
SKIPPED_FILES = frozenset({"pydoc_data/topics.py"})  # the topics below, a second time
TOPIC_PREFIX = "pydoc_data/topics/"


@dataclasses.dataclass(frozen=True)
class Document:
    name: str
    text: str


def python_documents() -> list[Document]:
    """The language reference's topics and the standard library's sources, sorted by name."""
    documents = [Document(TOPIC_PREFIX + topic, text) for topic, text in pydoc_data.topics.topics.items()]
    library = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(library.rglob("*.py")):
        relative = path.relative_to(library)
        if SKIPPED_FOLDERS.isdisjoint(relative.parts) and relative.as_posix() not in SKIPPED_FILES:
            documents.append(Document(relative.as_posix(), path.read_text(encoding="utf-8", errors="replace")))
    return sorted((document for document in documents if document.text.strip()), key=lambda document: document.name)


def is_held_out(name: str, heldout_fraction: float) -> bool:
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") < heldout_fraction * 2**64


def split_documents(documents: list[Document], heldout_fraction: float) -> tuple[list[Document], list[Document]]:
    """(train, held-out), each in the input order."""
    train = [document for document in documents if not is_held_out(document.name, heldout_fraction)]
    heldout = [document for document in documents if is_held_out(document.name, heldout_fraction)]
    return train, heldout


def corpus_statistics(train: list[Document], heldout: list[Document], heldout_fraction: float) -> dict:
    return {
        "source": "pydoc_data.topics + standard library .py files (no test suites, no pydoc_data/topics.py)",
        "python": platform.python_version(),
        "split": f"by document name: SHA-256(name)[:8] / 2^64 < {heldout_fraction}",
        "heldout_fraction": heldout_fraction,
        "train": {"documents": len(train), "characters": sum(len(document.text) for document in train)},
        "heldout": {"documents": len(heldout), "characters": sum(len(document.text) for document in heldout)},
    }


def write_corpus(output_dir: Path, heldout_fraction: float = 0.05, force: bool = False) -> dict:
    """Write train.jsonl, heldout.jsonl and corpus.json to `output_dir`; returns the statistics."""
    train, heldout = split_documents(python_documents(), heldout_fraction)
    statistics = corpus_statistics(train, heldout, heldout_fraction)
    with staged_output_dir(Path(output_dir), force=force) as staging:
        for name, documents in (("train", train), ("heldout", heldout)):
            with open(staging / f"{name}.jsonl", "w", encoding="utf-8") as file:
                for document in documents:
                    file.write(json.dumps({"name": document.name, "text": document.text}) + "\n")
        (staging / "corpus.json").write_text(json.dumps(statistics, indent=2) + "\n")
    return statistics
