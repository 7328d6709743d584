"""A seed's training texts: passkey documents that fit a row whole (their answer trained with the key in view), at
the asked share of the characters, the seed's own; the evaluation keys never among the training texts' digits, and
other seeds' keys other keys."""

import random

import pytest

from bam_llama.data.corpus import Document
from bam_llama.data.tokenizers import build_byte_tokenizer, train_bpe_tokenizer
from bam_llama.extrapolation.data import (
    PASSKEY_DIGITS, TEXT_TEMPLATE, check_passkey_documents, max_passkey_fillers, passkey_document, training_texts,
)
from bam_llama.extrapolation.evaluation import seed_keys
from bam_llama.extrapolation.settings import QUICK

STUDY = QUICK
CORPUS = [Document(f"module_{index}.py", f"def f{index}(x):\n    return x * {index % 7} + 1\n" * 20) for index in range(40)]


@pytest.fixture(scope="module")
def tokenizer():
    return train_bpe_tokenizer(training_texts(CORPUS, STUDY, 0), STUDY.vocab_size)


def test_every_passkey_document_fits_a_row_whole_with_its_key_before_its_answer(tokenizer):
    check_passkey_documents(tokenizer, STUDY.train_length)
    rng = random.Random(5)
    for _ in range(200):
        text = passkey_document(rng, max_passkey_fillers(STUDY.train_length))
        key = text.split(" The pass key is ")[1].split(".")[0]
        assert len(key) == PASSKEY_DIGITS and text.endswith(TEXT_TEMPLATE.question + " " + key)
        assert len(tokenizer(text)["input_ids"]) + 2 <= STUDY.train_length


def test_a_tokenizer_that_splits_fillers_finer_is_refused():
    with pytest.raises(ValueError, match="more than the training length"):  # bytes: a filler is 17 tokens, not 5
        check_passkey_documents(build_byte_tokenizer(), STUDY.train_length)


def test_the_passkey_share_of_the_characters_and_the_seed_s_own_texts():
    texts = training_texts(CORPUS, STUDY, 1)
    passkey = sum(len(text) for text in texts if "The pass key is" in text)
    corpus = sum(len(document.text) for document in CORPUS)
    assert passkey / (passkey + corpus) == pytest.approx(STUDY.passkey_share, abs=0.01)
    assert [text for text in texts if "pass key" not in text] == [document.text for document in CORPUS]  # in order
    assert training_texts(CORPUS, STUDY, 1) == texts and training_texts(CORPUS, STUDY, 2) != texts


class Data:
    def __init__(self, excluded):
        self.training_keys = frozenset(excluded)


def test_evaluation_keys_avoid_the_training_texts_and_differ_by_seed():
    first = [seed_keys(3, Data(())).draw() for _ in range(1)] + []
    drawer = seed_keys(3, Data(()))
    keys = [drawer.draw() for _ in range(50)]
    assert keys[0] == first[0] and len(set(keys)) == 50
    excluded = set(keys[:10])
    avoiding = seed_keys(3, Data(excluded))
    again = [avoiding.draw() for _ in range(40)]
    assert not excluded & set(again) and again == keys[10:]  # the excluded ones redrawn, the stream otherwise the same
    assert avoiding.redrawn == 10
    other = seed_keys(4, Data(()))
    assert len(set(keys) & {other.draw() for _ in range(50)}) < 5  # another seed, other keys


def test_the_test_phase_finds_its_perplexity_documents_at_the_longest_length(tmp_path):
    """The default study's test phase measures perplexity at 512x (65,536 tokens) on `test_documents` never-trained
    documents: a test seed's BPE must find that many that long (asking for more fails the phase before any job)."""
    from bam_llama.extrapolation.run import phase_data
    from bam_llama.extrapolation.settings import TEST, Study

    study = Study(test_seeds=Study().test_seeds[:1])
    data = phase_data(TEST, study, tmp_path)[study.test_seeds[0]]
    longest = study.train_length * study.longest_scale(TEST)
    assert len(data.documents) == study.test_documents
    assert all(len(tokens) == longest for tokens in data.documents.values())


def test_the_extension_s_own_texts_hold_keys_farther_from_the_question_than_training_rows_can(tokenizer, tmp_path):
    """With `extension_passkeys`, the extension trains on texts of its own: passkey documents too long for a training
    row and none too long for an extension row, drawn apart from the training texts; their keys are kept from the
    evaluation too. Without it, the extension reads the training texts."""
    from dataclasses import replace

    from bam_llama.extrapolation.data import seed_data
    from bam_llama.extrapolation.settings import VALIDATION

    study = replace(STUDY, extension_passkeys=STUDY.extension_length).check()
    extension = training_texts(CORPUS, study, 1, study.extension_passkeys)
    lengths = [len(tokenizer(text)["input_ids"]) + 2 for text in extension if "The pass key is" in text]
    assert max(lengths) <= study.extension_length and max(lengths) > STUDY.train_length
    training = [text for text in training_texts(CORPUS, study, 1) if "The pass key is" in text]
    assert not set(training) & set(extension)

    data = seed_data(CORPUS, CORPUS, study, 1, study.documents(VALIDATION), tmp_path / "own")
    assert data.extension_texts.name == "extension.jsonl"
    keys = {text.split(" The pass key is ")[1][:PASSKEY_DIGITS] for text in extension if "The pass key is" in text}
    assert keys <= data.training_keys
    plain = seed_data(CORPUS, CORPUS, STUDY, 1, STUDY.documents(VALIDATION), tmp_path / "plain")
    assert plain.extension_texts == plain.texts


@pytest.mark.parametrize("length", [QUICK.train_length, QUICK.extension_length + 1])
def test_extension_passkeys_must_be_longer_than_training_rows_and_fit_the_extension_s(length):
    from bam_llama.extrapolation.settings import with_settings

    with pytest.raises(ValueError, match=f"extension_passkeys={length}"):
        with_settings(QUICK, [f"extension_passkeys={length}"])
