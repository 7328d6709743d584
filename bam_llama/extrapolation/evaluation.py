"""A trained model's passkey retrieval and position-matched perplexity by length.

Passkey: a prompt per (length, depth) with a key of its own, from the seed's key stream (`PasskeyKeys`: the same keys
at the same length and depth for every model of the seed, none twice, none that occurs in the training texts),
scored strict (the greedy answer is the key and no further digit) and teacher-forced (the reference code's scoring:
the first digit given, each later digit the argmax after the true ones). Perplexity: each never-trained document's
first tokens as a sequence of its own behind BOS, read at the positions past the training length and on the last
training-length window (`evaluation.perplexity.position_matched_perplexity`). Each length's seconds and peak RSS.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from ..evaluation.costs import measured
from ..evaluation.passkey import PasskeyKeys, evaluate_passkey
from ..evaluation.perplexity import position_matched_perplexity
from .data import PASSKEY_DIGITS, TEXT_TEMPLATE, SeedData


def load(folder: Path, rope_scaling: str | None, length: int, train_length: int):
    """The saved model in float32; with `rope_scaling`, Transformers' dynamic-NTK or YaRN rope_parameters that stretch
    `train_length` to `length`."""
    config = AutoConfig.from_pretrained(folder)
    if rope_scaling is not None:
        theta = config.rope_parameters["rope_theta"]
        config.rope_parameters = (
            # Dynamic NTK stretches by factor * n / train_length - (factor - 1) at n tokens: factor 1 stretches by
            # exactly n / train_length (base theta * (n / train_length) ** (d / (d - 2))), whatever the prompt's n.
            {"rope_type": "dynamic", "factor": 1.0, "rope_theta": theta} if rope_scaling == "dynamic"
            else {"rope_type": "yarn", "factor": max(length / train_length, 1.0), "rope_theta": theta,
                  "original_max_position_embeddings": train_length}
        )
        config.max_position_embeddings = train_length
    return AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=torch.float32).eval()


def seed_keys(seed: int, data: SeedData) -> PasskeyKeys:
    """The seed's evaluation keys: one drawer for all the lengths of a model, so no key repeats."""
    return PasskeyKeys(seed, PASSKEY_DIGITS, excluded=data.training_keys)


def evaluate(folder: Path, rope_scaling: str | None, data: SeedData, tokenizer, keys: PasskeyKeys, train_length: int,
             prompts: dict[int, int]) -> dict:
    """Perplexity and passkey at each length of `prompts` ({length: passkey prompts}), with each length's seconds and
    peak RSS, and the evaluation keys' counts (drawn, in the training texts, redrawn for being there); the keys from
    `keys` (`seed_keys`)."""
    result = {"perplexity": {}, "passkey": {}, "seconds": {}, "peak_rss_mib": {}}
    model = None
    for length, count in prompts.items():
        if model is None or rope_scaling is not None:
            model = load(folder, rope_scaling, length, train_length)
        with measured() as cost:
            result["perplexity"][length] = position_matched_perplexity(model, tokenizer, data.documents, length,
                                                                       train_length)
            found = evaluate_passkey(model, tokenizer, [length], num_depths=count, template=TEXT_TEMPLATE, add_bos=True,
                                     progress=False, keys=keys, teacher_forced=True)
            result["passkey"][length] = found.to_dict()
        result["seconds"][length], result["peak_rss_mib"][length] = cost.seconds, cost.peak_rss_mib
    passkeys = result["passkey"].values()
    result["evaluation_keys"] = {"keys": sum(len(row) for found in passkeys for row in found["passkeys"]),
                                 "in_training": sum(found["keys_in_training"] for found in passkeys),
                                 "redrawn": sum(found["keys_redrawn"] for found in passkeys)}
    return result
