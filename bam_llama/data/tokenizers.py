"""Tokenizers built locally (no download): a byte-level one (every byte is one token, so digits are single tokens),
and a small byte-level BPE trained on the user's documents with digits split one per token (as the paper does
for passkeys).

Used by the demo, by `bam-pretrain`, by the evaluation tools when no tokenizer is given, and by the tests. The
special tokens and their ids: `special_tokens.py`.
"""

import sys
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from .special_tokens import BYTE_VOCAB_SIZE, SPECIAL_TOKENS

# The files a saved tokenizer may consist of (copied by the conversions, looked for by the model card).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)


def encode(tokenizer, text: str) -> list[int]:
    """The token ids of `text` alone, without special tokens: pieces encoded one by one never merge."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]


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


def load_tokenizer(model_path, config, tokenizer=None):
    """`tokenizer` (an object, or a path to load), else the one saved at `model_path`, else the built-in byte
    tokenizer (with a note on stderr, and a warning when the model's vocabulary is not the byte tokenizer's)."""
    if tokenizer is not None and not isinstance(tokenizer, (str, Path)):
        return tokenizer
    try:
        return AutoTokenizer.from_pretrained(tokenizer if tokenizer is not None else model_path)
    except (OSError, ValueError, TypeError):
        if tokenizer is not None:
            raise
    vocab_size = getattr(config, "vocab_size", BYTE_VOCAB_SIZE)
    if vocab_size != BYTE_VOCAB_SIZE:
        raise ValueError(
            f"no tokenizer found in {model_path}, and the built-in byte tokenizer does not fit the model: its "
            f"vocab_size is {vocab_size}, the byte tokenizer's {BYTE_VOCAB_SIZE}; save the model's tokenizer in its "
            "folder (bam-eval can also take one with --tokenizer)"
        )
    print(f"No tokenizer found in {model_path}; using the built-in byte tokenizer.", file=sys.stderr)
    return build_byte_tokenizer()
