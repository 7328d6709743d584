"""The byte tokenizer's special tokens, their ids and its vocabulary size (the tokenizers: `tokenizers.py`). Light on
purpose: `bam-pretrain --help` and the demo's settings read it."""

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")
PAD_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID = 0, 1, 2
BYTE_VOCAB_SIZE = len(SPECIAL_TOKENS) + 256
