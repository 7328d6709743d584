"""Tokenizers built locally (no download): a byte-level one (every byte is one token, so digits are single tokens),
and a small byte-level BPE trained on the user's documents with digits split one per token (as the paper does
for passkeys).

Used by the demo, by `bam-pretrain`, by the evaluation tools when no tokenizer is given, and by the tests.
"""

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast


SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")
PAD_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID = 0, 1, 2
BYTE_VOCAB_SIZE = len(SPECIAL_TOKENS) + 256


def build_byte_tokenizer(model_max_length: int = 1 << 20) -> PreTrainedTokenizerFast:
    """A `PreTrainedTokenizerFast` over the 256 bytes, ids 3..258, with <pad>=0, <s>=1, </s>=2.

    It adds no special tokens by itself; callers place <s>/</s> where they want them.
    """
    byte_symbols = list(pre_tokenizers.ByteLevel.alphabet())
    byte_symbols.sort(key=_byte_value)
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({symbol: len(SPECIAL_TOKENS) + index for index, symbol in enumerate(byte_symbols)})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return _with_special_tokens(backend, model_max_length)


def train_bpe_tokenizer(documents: Iterable[str], vocab_size: int, model_max_length: int = 1 << 20) -> PreTrainedTokenizerFast:
    """A byte-level BPE of `vocab_size` tokens trained on `documents`: <pad>=0, <s>=1, </s>=2, then the 256 bytes
    (so any text encodes), then the merges. Digits are split one per token before the merges, so a number never
    becomes one token. Deterministic for the same documents in the same order."""
    if vocab_size < BYTE_VOCAB_SIZE:
        raise ValueError(f"a BPE vocabulary needs at least {BYTE_VOCAB_SIZE} tokens (3 special + 256 bytes), got {vocab_size}")
    backend = Tokenizer(models.BPE(unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(documents, trainer=trainer)
    return _with_special_tokens(backend, model_max_length)


def _with_special_tokens(backend: Tokenizer, model_max_length: int) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        model_max_length=model_max_length,
    )


def _byte_value(symbol: str) -> int:
    """ByteLevel maps each byte to a printable character; recover the byte so ids follow byte order."""
    return _BYTE_OF_SYMBOL[symbol]


def _bytes_to_symbols() -> dict[str, int]:
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    symbols = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in symbols:
            symbols[byte] = chr(256 + extra)
            extra += 1
    return {symbol: byte for byte, symbol in symbols.items()}


_BYTE_OF_SYMBOL = _bytes_to_symbols()
