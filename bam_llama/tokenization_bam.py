"""A byte-level tokenizer built locally (no download): every byte is one token, so digits are single tokens.

Used by the demo, by the evaluation tools when no tokenizer is given, and by the tests.
"""

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
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
