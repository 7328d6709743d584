"""The no-download Python corpus: split by document name with SHA-256, independent of order and machine."""

import hashlib
import json
import random

from bam_llama.data.corpus import (
    Document,
    python_documents,
    split_documents,
    write_corpus,
)


def held_out_by_name(name: str, fraction: float) -> bool:
    """The documented rule, written here: the first 8 bytes of SHA-256(name), big-endian, below fraction * 2^64."""
    return int(hashlib.sha256(name.encode()).hexdigest()[:16], 16) < fraction * 2**64


def test_corpus_holds_the_language_reference_and_library_sources_but_no_test_suites():
    documents = python_documents()
    names = [document.name for document in documents]
    assert names == sorted(names) and len(set(names)) == len(names)
    assert "pydoc_data/topics/assignment" in names and "json/decoder.py" in names
    assert not any(part in ("test", "tests", "site-packages") for name in names for part in name.split("/"))
    assert sum(len(document.text) for document in documents) > 1_000_000


def test_the_language_reference_is_in_the_corpus_once():
    """pydoc_data/topics.py holds every topic again as a Python dict: with it, a topic could be trained on and held
    out at once."""
    import pydoc_data.topics

    documents = python_documents()
    reference = [document for document in documents if document.name.startswith("pydoc_data/")]
    assert sorted(document.name for document in reference) == sorted(f"pydoc_data/topics/{topic}" for topic in pydoc_data.topics.topics)
    sample = pydoc_data.topics.topics["assignment"][:200]
    assert sum(sample in document.text or repr(sample)[1:-1][:100] in document.text for document in documents) == 1


def test_split_follows_the_name_hash_whatever_the_order():
    documents = [Document(f"package/module_{index}.py", "x = 1\n") for index in range(400)]
    train, heldout = split_documents(documents, 0.1)
    assert [document.name for document in heldout] == [d.name for d in documents if held_out_by_name(d.name, 0.1)]
    assert {d.name for d in train} | {d.name for d in heldout} == {d.name for d in documents}
    assert not {d.name for d in train} & {d.name for d in heldout}
    assert 20 <= len(heldout) <= 60  # about a tenth of 400
    shuffled = documents[:]
    random.Random(0).shuffle(shuffled)
    assert sorted(d.name for d in split_documents(shuffled, 0.1)[1]) == sorted(d.name for d in heldout)


def test_written_corpus_matches_its_statistics(tmp_path):
    statistics = write_corpus(tmp_path / "corpus", heldout_fraction=0.05)
    for split in ("train", "heldout"):
        records = [json.loads(line) for line in (tmp_path / "corpus" / f"{split}.jsonl").read_text().splitlines()]
        assert len(records) == statistics[split]["documents"] > 0
        assert sum(len(record["text"]) for record in records) == statistics[split]["characters"]
        assert all(held_out_by_name(record["name"], 0.05) == (split == "heldout") for record in records)
    assert json.loads((tmp_path / "corpus" / "corpus.json").read_text()) == statistics
