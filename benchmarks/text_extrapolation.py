"""Train short, test long on real text: the paper's Figure 2 (perplexity) and Figure 3 (passkey) on 2 CPU cores, to
512x the training length, with RULER-style needle variants and the Scalable Softmax study of issue 36.

Models trained by `bam-pretrain` (its Python API) with one recipe at a short length (128 tokens) on the same data:
by default BAM, BAM + SSMax, ALiBi, NoPE, RoPE and RoPE local (RoPE with a sliding window of the training length);
`--models` runs any subset of `MODELS`, which also holds the SSMax study's variants (`bam-ssmax-qk`,
`bam-ssmax-init`, `bam-ssmax-lr10x`, `bam-ssmax-lr50x`, `bam-ssmax-long`) and the recipe study's, each changing one
thing of `bam` (`bam-long`: twice the steps; `bam-prior-lr`: the prior's learning rate 5e-2, bam-demo's, against
the weights' 1e-3 that `--prior-lr` otherwise gives it; `bam-frozen-prior`: the prior `bam-prior-lr` of the same
seed learned, frozen, the weights trained from scratch (`bam-pretrain --frozen-prior-from` its saved model), a
diagnostic of prior against content; `bam-wide`: hidden
192 at the same training FLOPs, 1056 steps), and `bam-ssmax-frozen-prior`: the same two stages for BAM + SSMax (the
prior `bam-ssmax` of the same seed learned, frozen on a fresh SSMax model). The data is the no-download
Python corpus (`bam_llama.data.corpus`: language reference + standard library sources, split by file) with synthetic
passkey documents (the prompt `bam-demo` trains on, answer included) and needle documents (the four tasks of
`bam_llama.evaluation.needles`, their haystack from the training split) mixed into the training split, so the same
models answer every question. Then, for every model:

* position-matched perplexity at 1x, 2x, ..., 64x the training length, on the same documents at every length and
  for every model (`perplexity_documents`): each document's first tokens as one sequence of its own behind BOS
  (no sequence crosses documents), read at (1) the positions past the training length and (2) the last
  training-length window (the same number of tokens at every length, as the paper plots it), with the counts of
  documents and tokens. The documents are never trained on: held-out files first, then the standard library's
  test suites (which the corpus leaves out; no held-out file reaches 128x), minus generated tables
  (`is_generated_table`: the codec tables `encodings/cp*.py`, `mac_*.py` and the like);
* passkey retrieval at the same lengths, 50 prompts each (50 depths, a key of its own at each), scored strict
  (greedy: the key and no further digit) and teacher-forced (the reference code's scoring: the key's first digit
  given, every later digit the argmax given the true ones before it), each with its 95% Clopper-Pearson interval.
  The keys come from a stream of their own (`PasskeyKeys`, not the training documents' `random.Random(seed)`),
  none twice in a model's evaluation, and none that occurs as a digit string in the training texts (redrawn);
  results.json records how many evaluation keys the training data holds (0) and how many draws were redrawn;
* RoPE also with Transformers' dynamic-NTK and YaRN `rope_parameters` set to each evaluation length;

and for the BamLlama priors (the BAM variants and ALiBi; NoPE and RoPE fail by 4x):

* the four needle tasks at every length (`evaluate_needles`, held-out haystack, exact answers);
* 128x, 256x and 512x too (16K, 32K, 64K tokens): position-matched perplexity on the same documents, passkey at
  20 prompts a length there (`Recipe.long_depths`) and needles at fewer depths (`long_needle_depths`).

Cost of the evaluation (the tiny models' measured seconds per 1-thread prompt: 1.9 s at 8K, 7.4 s at 16K, 27 s at
32K, 100 s at 64K tokens; a document's perplexity forward costs about one prompt): 1x-64x about 5 min a model
(50 prompts a length, 8 documents); 128x-512x about 45 min of passkey (20 prompts a length, against 12 min with
the earlier 10/6/5) and 20 min of perplexity (8 documents) a model with a prior, besides the needles. Those passkey
minutes were measured before the prompts of a length shared the KV cache of their common filler
(`sharing_prefixes`): about 0.7x of them since (estimated from 0.76x measured at 16K with 8 prompts).

Every length's seconds and peak RSS are recorded; the learned SSMax scales (and priors) of every BamLlama model
are read back after training.

`--seeds 0,1,2` makes each seed a run of its own (its passkey and needle documents, BPE, models' initialisation and
data order, evaluation keys and needle prompts): results.json holds each as `<model>/seed-N` and `means` their mean
per model and cell (perplexity: the mean of the seeds'; rates: the mean of the seeds', with the pooled count and
its 95% interval); results.md shows the seeds' rows and the mean's; the targets and plots take the means. With one
seed (the default, 0) the entries are the models' names, as before. `--recipe passkey` is issue 44's option (a):
no needle documents, passkey documents 50% of the characters (as before the needles); whole-document packing fills
the rows >= 95% only without the needle documents, which run longer than half a row (seed 0: 92.7% full with
needles, 97.6% without).

    python benchmarks/text_extrapolation.py              # the full run -> benchmarks/results/text-extrapolation/
    python benchmarks/text_extrapolation.py --quick      # the same pipeline in seconds (numbers mean nothing)
    python benchmarks/text_extrapolation.py --models bam-ssmax,bam-ssmax-qk --scales 1,2,4,8,16,32,64 --no-needles
    python benchmarks/text_extrapolation.py --jobs 2 --threads 1 --models bam,alibi,bam-ssmax-qk --long-models bam,alibi

`--jobs 2 --threads 1` trains and evaluates two models at once (the results are those of one at a time on 1
thread); `--long-models` names the models with a prior that go on to 128x-512x, the costly part (with the earlier
5 prompts at 512x, a 1-thread 4-layer model spent 24-37 min at 512x alone, 5-6 min at 1x-64x).

Results (results.md, results.json, perplexity.png, passkey.png, passkey-*.png, needles.png) are written to a temporary folder
beside the output folder and renamed into place after every model, marked partial until the last one is done.
`--resume` continues such a run: the models (each seed's) it left are kept, the others trained (same recipe but
for --models, --long-models, --seeds and --jobs, same machine, threads and versions, or it says what differs).

Issue 44's recipe study, then its result, each one command (on the 2-core VM, 1 thread a model, two at a time;
rerun the same command with --resume after a stop):

    # the study, 1x-64x, with the needle recipe and with --recipe passkey (output folders of their own)
    python benchmarks/text_extrapolation.py --jobs 2 --threads 1 --long-scales none \
        --models bam-prior-lr,bam-long,bam-frozen-prior,bam,bam-wide --output-dir benchmarks/results/recipe-study/needles
    python benchmarks/text_extrapolation.py --jobs 2 --threads 1 --long-scales none --recipe passkey \
        --models bam-prior-lr,bam-long,bam-frozen-prior,bam,bam-wide --output-dir benchmarks/results/recipe-study/passkey
    # the result, with the recipe the study picked (benchmarks/results/recipe-study.md: the prior learned at 5e-2,
    # then frozen on a fresh model, 49/50 at 64x for seed 0), 3 seeds, to 512x beside BAM + SSMax and ALiBi
    python benchmarks/text_extrapolation.py --jobs 2 --threads 1 --seeds 0,1,2 --recipe passkey --prior-lr 5e-2 \
        --models bam-prior-lr,bam-frozen-prior,bam-ssmax,alibi --long-models bam-frozen-prior,bam-ssmax,alibi

Their cost, in 1-thread minutes a model, from the last run (training 15.7-16.5 min at 2000 steps, two models at a
time; evaluation 42 min for bam and 60 for bam-ssmax, 1.4x) and the evaluation's cost above: training 16 (bam-long
32; bam-wide at most 16: the same FLOPs, and wider matrices run faster per FLOP on a CPU); 1x-64x 5, and 3 more for
the needles (the needle recipe); 128x-512x 65 (45 passkey, 20 perplexity), and 21 more for the needles (4, 3, 2
prompts of each task at 16K, 32K, 64K tokens); bam-ssmax's evaluation 1.4x. Building a seed's data takes about a
minute (the BPE). So:

* the study: 136 model-minutes with needles, 121 with --recipe passkey; two at a time, bam-frozen-prior waiting for
  bam-prior-lr (the order above starts the longest first), about 72 and 63 min: 2.3 hours for both;
* the result as above: per seed about 307 model-minutes (bam-prior-lr 21 to 64x only, bam-frozen-prior and ALiBi 86
  each, bam-ssmax 114), bam-frozen-prior waiting for its seed's bam-prior-lr; three seeds two at a time about 7.7
  hours.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import re
import resource
import sys
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPOSITORY))

from bam_llama.data.corpus import Document, corpus_statistics, python_documents, split_documents  # noqa: E402
from bam_llama.evaluation.needle_tasks import NEEDLE_KINDS, NeedleTask  # noqa: E402
from bam_llama.evaluation.intervals import clopper_pearson, interval_text  # noqa: E402
from bam_llama.evaluation.passkey import PasskeyKeys, PasskeyTemplate, keys_in_texts, random_passkey  # noqa: E402
from bam_llama.evaluation.perplexity import position_matched_perplexity  # noqa: E402
from bam_llama.outputs import exit_on_sigterm, staged_output_dir  # noqa: E402
from bam_llama.positional_variants import POSITIONAL_VARIANTS  # noqa: E402
from bam_llama.machine import cpu_model  # noqa: E402


@dataclass(frozen=True)
class Variant:
    """One trained model: bam-pretrain's --positional (a `POSITIONAL_VARIANTS` name) and Scalable Softmax settings,
    what else it changes of the recipe, and what that is."""

    positional: str
    ssmax: bool = False
    ssmax_prior: bool | None = None  # None: bam-pretrain's default (the factor scales the prior)
    ssmax_scale_init: float | str | None = None  # "neutral": 1 / ln(training length), the factor 1 there
    ssmax_learning_rate_factor: float | None = None  # the scales' rate, times the recipe's learning rate
    steps_factor: int = 1
    prior_learning_rate: float | None = None  # None: the recipe's
    frozen_prior_of: str | None = None  # the model of the same seed whose learned prior this one takes, frozen; the
    # weights train from scratch
    hidden_factor: float = 1.0  # the hidden size times this, the steps cut to keep the training FLOPs (`training_flops`)
    what: str = ""

    def pretrain_overrides(self, recipe: Recipe) -> dict:
        """PretrainArguments fields besides the recipe's."""
        values = {"positional": self.positional, "ssmax": self.ssmax, "max_steps": self.steps(recipe)}
        if self.ssmax_prior is not None:
            values["ssmax_prior"] = self.ssmax_prior
        if self.ssmax_scale_init is not None:
            neutral = 1 / math.log(recipe.train_length)
            values["ssmax_scale_init"] = neutral if self.ssmax_scale_init == "neutral" else self.ssmax_scale_init
        if self.ssmax_learning_rate_factor is not None:
            values["ssmax_learning_rate"] = self.ssmax_learning_rate_factor * recipe.learning_rate
        if self.prior_learning_rate is not None:
            values["prior_learning_rate"] = self.prior_learning_rate
        if self.hidden_factor != 1:
            values["hidden_size"] = self.hidden_size(recipe)
        return values

    def hidden_size(self, recipe: Recipe) -> int:
        hidden = round(recipe.hidden_size * self.hidden_factor)
        if hidden % recipe.heads:
            raise ValueError(f"a hidden size of {hidden} ({self.hidden_factor} x {recipe.hidden_size}) does not divide "
                             f"into {recipe.heads} heads")
        return hidden

    def steps(self, recipe: Recipe) -> int:
        """The recipe's steps times `steps_factor`; a wider model as many fewer as its training FLOPs per token are
        more, so that it trains in about the same time."""
        flops = training_flops(recipe, recipe.hidden_size) / training_flops(recipe, self.hidden_size(recipe))
        return max(round(recipe.steps * self.steps_factor * flops), 1)

    @property
    def has_prior(self) -> bool:
        """A BamLlama whose prior carries position (BAM, ALiBi): evaluated to 512x and on the needles."""
        return POSITIONAL_VARIANTS[self.positional].prior_carries_position


def training_flops(recipe: Recipe, hidden: int) -> int:
    """A training token's multiply-adds x 2 at `hidden` (forward, and backward at twice the forward): per layer the
    attention's four and the SwiGLU's three matrices (4h^2 + 3 x 2h^2) and the causal attention's scores and
    values (about 2 x length/2 x h); the output layer (vocabulary x h), which at the recipe's sizes is 40% of the
    total. The embedding is a lookup; norms and the prior's bias are left out. At 128 -> 192 hidden the ratio is 1.89
    ((192/128)^2 = 2.25 counts the layers' matrices only); on the busy 2-core VM one 1-thread training step took
    1.3-1.5x as long, so the wide model's wall time is, if anything, below bam's (the run records both)."""
    per_layer = 10 * hidden * hidden + recipe.train_length * hidden
    return 3 * 2 * (recipe.layers * per_layer + recipe.vocab_size * hidden)


MODELS = {
    "bam": Variant("bam", what="learned GGD prior"),
    "bam-ssmax": Variant("bam", ssmax=True, what="+ Scalable Softmax on q.k and the prior (the reference's order)"),
    "alibi": Variant("alibi", what="the prior fixed to ALiBi's slopes"),
    "nope": Variant("nope", what="a flat prior, fixed"),
    "rope": Variant("rope", what="Transformers' Llama, RoPE base 500,000"),
    "rope-local": Variant("rope-local", what="RoPE with a sliding window of the training length"),
    # The SSMax study (issue 36): each changes one thing of bam-ssmax; not in the default run (--models)
    "bam-ssmax-qk": Variant("bam", ssmax=True, ssmax_prior=False, what="SSMax on q.k only: c*q.k/sqrt(d) + b"),
    "bam-ssmax-init": Variant("bam", ssmax=True, ssmax_scale_init="neutral",
                              what="scales initialised at 1/ln(training length): c = 1 at the training length"),
    "bam-ssmax-lr10x": Variant("bam", ssmax=True, ssmax_learning_rate_factor=10, what="the scales' learning rate 10x"),
    "bam-ssmax-lr50x": Variant("bam", ssmax=True, ssmax_learning_rate_factor=50,
                               what="the scales' learning rate 50x (bam-demo's prior rate)"),
    "bam-ssmax-long": Variant("bam", ssmax=True, steps_factor=2, what="twice the steps"),
    # The recipe study (issue 44): each changes one thing of bam
    "bam-long": Variant("bam", steps_factor=2, what="bam with twice the steps (bam-ssmax-long's control)"),
    "bam-prior-lr": Variant("bam", prior_learning_rate=5e-2, what="the prior's learning rate 5e-2 (bam-demo's)"),
    "bam-frozen-prior": Variant("bam", frozen_prior_of="bam-prior-lr",
                                what="the prior set to bam-prior-lr's learned one (same seed) and frozen, the weights "
                                     "trained from scratch: prior against content"),
    # After the 3-seed result: BAM + SSMax's prior (learned at the recipe's prior rate) frozen on a fresh SSMax model
    "bam-ssmax-frozen-prior": Variant("bam", ssmax=True, frozen_prior_of="bam-ssmax",
                                      what="+ Scalable Softmax, the prior set to bam-ssmax's learned one (same seed) "
                                           "and frozen, the weights and scales trained from scratch"),
    "bam-wide": Variant("bam", hidden_factor=1.5, what="1.5x the hidden size (the recipe's 128: 192, head size 48), "
                                                      "the steps cut to the same training FLOPs (2000: 1056)"),
}
DEFAULT_MODELS = ("bam", "bam-ssmax", "alibi", "nope", "rope", "rope-local")
ROPE_EXTENSIONS = ("dynamic", "yarn")

# bam-demo's prompt with each piece opening on a space: a byte-level BPE splits words with their leading space, so
# the pieces tokenized one by one (as the evaluation builds its prompts) give the same tokens as the training
# documents tokenized whole (checked by `check_passkey_documents`).
TEXT_TEMPLATE = PasskeyTemplate(
    task="", filler=" The sky is blue.", info=" The pass key is {passkey}.", question=" The pass key is",
)


@dataclass
class Recipe:
    train_length: int = 128
    scales: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    long_scales: tuple[int, ...] = (128, 256, 512)  # BAM variants and ALiBi only
    long_models: tuple[str, ...] | None = None  # which models with a prior go to long_scales; None: all of them
    hidden_size: int = 128
    layers: int = 4
    heads: int = 4
    steps: int = 2000
    batch_size: int = 16
    learning_rate: float = 1e-3
    prior_learning_rate: float | None = None  # the prior's (and SSMax scales'); None: learning_rate, as before issue 44
    warmup_steps: int = 100
    vocab_size: int = 4096
    passkey_share: float = 0.35  # passkey documents' share of the training characters
    needle_share: float = 0.15  # needle documents' share (the four tasks in turn); the corpus has the rest
    needle_sizes: dict = field(default_factory=lambda: dict(keys=4, values=3, queries=3, chains=2, hops=2))
    prior_scope: str = "layer"  # BamLlama models: one prior per layer and head
    heldout_fraction: float = 0.05
    max_train_characters: int | None = None  # None: the whole training split
    perplexity_documents: int = 8  # at most: never-trained documents with at least the longest length of tokens
    num_depths: int = 50  # passkey prompts (depths, a key each) per length up to the longest short scale
    long_depths: dict = field(default_factory=lambda: {128: 20, 256: 20, 512: 20})  # passkey prompts by long scale
    needle_depths: int = 10
    long_needle_depths: dict = field(default_factory=lambda: {128: 4, 256: 3, 512: 2})
    needles: bool = True
    seeds: tuple[int, ...] = (0,)  # each a whole run of its own: training data, tokenizer, models, evaluation keys
    frozen_prior_from: str | None = None  # frozen-prior models' prior: a saved model or results folder (`frozen_prior_source`)
    threads: int | None = None  # torch threads of each model; None: PyTorch's default (one per core), 1 with jobs > 1
    jobs: int = 1  # models trained and evaluated at once, each in a process of its own
    models: tuple[str, ...] = DEFAULT_MODELS  # which of MODELS to train (rope brings its two extensions)

    @property
    def seed(self) -> int:
        """The seed of a one-seed recipe (`for_seed`): its passkey and needle documents, the model's initialisation
        and data order, the evaluation keys and needle prompts."""
        if len(self.seeds) != 1:
            raise ValueError(f"a recipe of seeds {self.seeds} has no one seed: take for_seed(seed)")
        return self.seeds[0]

    def for_seed(self, seed: int) -> Recipe:
        return replace(self, seeds=(seed,))

    @property
    def lengths(self) -> list[int]:
        """The lengths every model is evaluated at."""
        return [self.train_length * scale for scale in self.scales]

    @property
    def long_lengths(self) -> list[int]:
        """The lengths only the models with a prior are evaluated at."""
        return [self.train_length * scale for scale in self.long_scales]

    @property
    def perplexity_length(self) -> int:
        """The tokens every perplexity document holds: the longest length any model is evaluated at."""
        return max(self.lengths + self.long_lengths)

    def goes_long(self, name: str) -> bool:
        """Whether model `name` (one with a prior) is evaluated at the long scales too."""
        return self.long_models is None or name in self.long_models

    def passkey_depths(self, length: int) -> int:
        return self.long_depths.get(length // self.train_length, self.num_depths)

    def needle_depth_count(self, length: int) -> int:
        return self.long_needle_depths.get(length // self.train_length, self.needle_depths)

    def needle_task(self, kind: str) -> NeedleTask:
        return NeedleTask(kind, **self.needle_sizes)


QUICK = Recipe(
    train_length=128, scales=(1, 2), long_scales=(4,), hidden_size=32, layers=2, heads=4, steps=15, batch_size=4,
    learning_rate=3e-3, warmup_steps=0, vocab_size=1000, max_train_characters=20_000, perplexity_documents=2,
    num_depths=2, long_depths={4: 1}, needle_depths=2, long_needle_depths={4: 1}, threads=1,
    needle_sizes=dict(keys=2, values=2, queries=2, chains=1, hops=1),
)

# --recipe: the training texts' mix. "needles" (the default): passkey documents 35% of the characters, needle
# documents 15%. "passkey": issue 44's option (a), the passkey share restored to the 50% of before the needles and no
# needle documents (nor needle evaluation). Whole-document packing fills rows >= 95% only without needle documents:
# they run longer than half a row, so most leave a gap no other needle document fits (seed 0's rows: 92.7% full
# with needles, 97.6% with "passkey").
RECIPES = {
    "needles": {},
    "passkey": {"needles": False, "needle_share": 0.0, "passkey_share": 0.5},
}


# ------------------------------------------------------------------------------------------------- data


# Token counts of the passkey pieces in the benchmark's BPE (digits one per token): BOS, info line 11, question 4,
# answer 6 (a space, then the digits), EOS, and one to spare; a filler is 5 (' The', ' sky', ' is', ' blue', '.').
PASSKEY_OVERHEAD_TOKENS = 24
FILLER_TOKENS = 5


def max_passkey_fillers(train_length: int) -> int:
    """The most fillers a passkey document can hold and still fit in one training row."""
    return max((train_length - PASSKEY_OVERHEAD_TOKENS) // FILLER_TOKENS, 0)


def passkey_document(rng: random.Random, max_fillers: int) -> str:
    """The passkey prompt the evaluation builds and its answer: 0 to `max_fillers` fillers in all (so documents run
    up to the training length, as the evaluation's prompts do at 1x), the key at a uniformly drawn depth."""
    template = TEXT_TEMPLATE
    passkey = random_passkey(rng, 5)
    total = rng.randint(0, max_fillers)
    before = rng.randint(0, total)
    info = template.info.format(passkey=passkey)
    return template.task + template.filler * before + info + template.filler * (total - before) + template.question + " " + passkey


def check_passkey_documents(tokenizer, train_length: int) -> None:
    """The passkey pieces must tokenize the same one by one (evaluation prompts) as whole (training documents), and
    the longest passkey document must fit in one training row: packing (`pack_documents`) keeps a document that fits
    whole in one row, so every passkey document is trained with its key in view of its answer."""
    template = TEXT_TEMPLATE
    fillers = max_passkey_fillers(train_length)
    pieces = [template.info.format(passkey="12345"), *[template.filler] * fillers, template.question, " 12345"]
    whole = tokenizer("".join(pieces), add_special_tokens=False)["input_ids"]
    one_by_one = [token for piece in pieces for token in tokenizer(piece, add_special_tokens=False)["input_ids"]]
    if whole != one_by_one:
        raise ValueError(f"the tokenizer merges passkey pieces across their boundaries: {whole} != {one_by_one}")
    if len(whole) + 2 > train_length:
        raise ValueError(
            f"a passkey document of {fillers} fillers has {len(whole)} tokens plus BOS and EOS, more than the "
            f"training length {train_length}: packing would cut it into pieces and train its answer without its key "
            f"in view (the tokenizer splits the pieces finer than {FILLER_TOKENS} tokens a filler)"
        )


def first_documents(documents: list[Document], max_characters: int | None) -> list[Document]:
    """Whole documents in name order until `max_characters` is reached (all of them with None)."""
    kept, characters = [], 0
    for document in documents:
        if max_characters is not None and characters >= max_characters:
            break
        kept.append(document)
        characters += len(document.text)
    return kept


def corpus_share(recipe: Recipe) -> float:
    return 1.0 - recipe.passkey_share - (recipe.needle_share if recipe.needles else 0.0)


def training_texts(train: list[Document], recipe: Recipe) -> list[str]:
    """The training split (cut to `max_train_characters`) with passkey documents mixed in at random places, so that
    they make `passkey_share` of the characters once the needle documents are in (`with_needle_documents`)."""
    rng = random.Random(recipe.seed)
    texts = [document.text for document in first_documents(train, recipe.max_train_characters)]
    characters = sum(map(len, texts))
    max_fillers = max_passkey_fillers(recipe.train_length)
    passkey_characters = recipe.passkey_share / corpus_share(recipe) * characters
    while passkey_characters > 0:
        document = passkey_document(rng, max_fillers)
        texts.insert(rng.randint(0, len(texts)), document)
        passkey_characters -= len(document)
    return texts


def needle_documents(haystack, tokenizer, recipe: Recipe, characters: float) -> list[str]:
    """Needle prompts and their answers of the four tasks in turn, `characters` of them, each at most the training
    length with BOS and EOS; a uniformly drawn prompt length and depth, the haystack from the training split. Each
    must tokenize whole to its prompt's ids and its answer's (else the models would be asked in a form they never
    saw): a ValueError otherwise."""
    from bam_llama.evaluation.needles import build_needle_prompt

    rng = random.Random(recipe.seed + 1)  # not the passkey documents' stream: their places stay those of before
    documents, kinds = [], [recipe.needle_task(kind) for kind in NEEDLE_KINDS]
    while characters > 0:
        task = kinds[len(documents) % len(kinds)]
        prompt = build_needle_prompt(tokenizer, haystack, task, rng.randint(0, recipe.train_length), rng.random(), rng)
        answer = tokenizer(prompt.question.answer, add_special_tokens=False)["input_ids"]
        if len(prompt.ids) + len(answer) + 2 > recipe.train_length:
            if not prompt.texts[:-1] or all(text.startswith((" The special", " VAR ")) for text in prompt.texts[:-1]):
                raise ValueError(f"{task.kind}'s needles and question alone do not fit in {recipe.train_length} tokens")
            continue  # too long for a row with its answer: drawn again
        text = prompt.text + prompt.question.answer
        if tokenizer(text, add_special_tokens=False)["input_ids"] != prompt.ids + answer:
            raise ValueError(f"a {task.kind} document does not tokenize whole to its pieces: {text!r}")
        documents.append(text)
        characters -= len(text)
    return documents


def with_needle_documents(texts: list[str], needles: list[str], seed: int) -> list[str]:
    """`texts` with the needle documents inserted at random places (a stream of their own)."""
    rng, texts = random.Random(seed + 2), list(texts)
    for document in needles:
        texts.insert(rng.randint(0, len(texts)), document)
    return texts


def training_data(train: list[Document], recipe: Recipe):
    """(training texts, tokenizer, needle documents): the training split with passkey documents, a BPE trained on
    them (as before needles existed, so that the tokenizer is the one of earlier runs), then needle documents whose
    haystack is the same training text, at their share."""
    from bam_llama.data.tokenizers import train_bpe_tokenizer
    from bam_llama.evaluation.needles import Haystack

    texts = training_texts(train, recipe)
    tokenizer = train_bpe_tokenizer(texts, recipe.vocab_size)
    check_passkey_documents(tokenizer, recipe.train_length)
    if not recipe.needles:
        return texts, tokenizer, []
    corpus = [document.text for document in first_documents(train, recipe.max_train_characters)]
    characters = recipe.needle_share / corpus_share(recipe) * sum(map(len, corpus))
    needles = needle_documents(Haystack(corpus), tokenizer, recipe, characters)
    return with_needle_documents(texts, needles, recipe.seed), tokenizer, needles


# A file is a generated table (a codec's mapping, an opcode list) rather than text when more than this share of its
# non-blank lines open with a literal (a digit, a quote, a bracket) instead of a name, a keyword or a comment: the
# codec tables `encodings/cp*.py` and `mac_*.py` have 85-93%, the held-out code files at most 25%.
GENERATED_TABLE_SHARE = 0.5
LITERAL_LINE = re.compile(r"\s*[\d'\"(\[{-]")


def is_generated_table(text: str) -> bool:
    lines = [line for line in text.splitlines() if line.strip()]
    return bool(lines) and sum(bool(LITERAL_LINE.match(line)) for line in lines) > GENERATED_TABLE_SHARE * len(lines)


def python_test_suites() -> list[Document]:
    """The standard library's test suites (`test/`, name order), which `python_documents` leaves out, so never
    trained on: the only never-trained Python files long enough for 128x-512x. Empty on a Python shipped without
    them."""
    folder = Path(sysconfig.get_paths()["stdlib"]) / "test"
    return [Document("test/" + path.relative_to(folder).as_posix(), path.read_text(encoding="utf-8", errors="replace"))
            for path in sorted(folder.rglob("*.py"))]


def perplexity_documents(heldout: list[Document], tokenizer, recipe: Recipe,
                         never_trained: list[Document] = ()) -> dict[str, list[int]]:
    """The first `perplexity_documents` documents with at least `recipe.perplexity_length` tokens, generated tables
    left out: held-out files first, then `never_trained` ones (the test suites), each in name order and cut to that
    many tokens. Every length and every model is measured on these same documents."""
    longest = recipe.perplexity_length
    documents = {}
    for document in [*heldout, *never_trained]:
        if len(documents) == recipe.perplexity_documents:
            break
        if len(document.text) < longest or is_generated_table(document.text):
            continue  # a token holds at least one character
        tokens = tokenizer(document.text, add_special_tokens=False)["input_ids"]
        if len(tokens) >= longest:
            documents[document.name] = tokens[:longest]
    if not documents:
        raise ValueError(f"no never-trained document has {longest} tokens: evaluate shorter lengths or hold out more files")
    return documents


# ------------------------------------------------------------------------------------------------- models


def train(name: str, data: Path, tokenizer_dir: Path, work: Path, recipe: Recipe, frozen_prior: str | None = None):
    """(saved folder, training summary with the learned prior and SSMax scales). `frozen_prior`: a frozen-prior
    model's prior, the saved BamLlama folder bam-pretrain takes it from (`--frozen-prior-from`)."""
    from bam_llama.training.pretrain import PretrainArguments, run_pretraining

    variant = MODELS[name]
    fields = dict(
        data=str(data), output_dir=str(work / name), context_length=recipe.train_length,
        hidden_size=recipe.hidden_size, num_hidden_layers=recipe.layers,
        num_attention_heads=recipe.heads, tokenizer=str(tokenizer_dir), learning_rate=recipe.learning_rate,
        prior_learning_rate=recipe.prior_learning_rate,
        warmup_steps=recipe.warmup_steps, per_device_train_batch_size=recipe.batch_size,
        save_steps=variant.steps(recipe), save_total_limit=1,
        logging_steps=max(recipe.steps // 10, 1), seed=recipe.seed, disable_progress_bars=True, eval_rows=8,
        **({"prior_scope": recipe.prior_scope} if POSITIONAL_VARIANTS[variant.positional].is_bam_llama else {}),
    )
    if variant.frozen_prior_of and frozen_prior is None:
        raise ValueError(f"{name} needs the prior it freezes ({variant.frozen_prior_of}'s learned one)")
    if variant.frozen_prior_of:
        fields["frozen_prior_from"] = str(frozen_prior)
    args = PretrainArguments(**{**fields, **variant.pretrain_overrides(recipe)})
    started = time.perf_counter()
    summary, model, _ = run_pretraining(args)
    return Path(summary.final_dir), {
        **asdict(summary), "train_seconds": time.perf_counter() - started, "learned": learned_parameters(model),
    }


def learned_parameters(model) -> dict:
    """Each BamLlama layer's learned SSMax scales and prior (per head), as lists [layer][head]; {} for others."""
    layers = getattr(getattr(model, "model", None), "layers", [])
    shared = getattr(model.model, "prior", None) if layers else None
    learned = {}
    for name, module_name in (("ssmax_scale", "ssmax"), ("theta_alpha", "prior"), ("theta_beta", "prior")):
        rows = []
        for layer in layers:
            module = getattr(layer.self_attn, module_name, None) or (shared if module_name == "prior" else None)
            if module is not None:
                rows.append(getattr(module, name.removeprefix("ssmax_")).detach().float().tolist())
        if rows:
            learned[name] = rows
    return learned


def load(folder: Path, extension: str | None, length: int, train_length: int):
    """The saved model; for RoPE with `extension`, its rope_parameters set for evaluation at `length`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    if extension is not None:
        theta = config.rope_parameters["rope_theta"]
        factor = max(length / train_length, 1.0)
        config.rope_parameters = (
            {"rope_type": "dynamic", "factor": factor, "rope_theta": theta} if extension == "dynamic"
            else {"rope_type": "yarn", "factor": factor, "rope_theta": theta, "original_max_position_embeddings": train_length}
        )
        config.max_position_embeddings = train_length
    return AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=torch.float32).eval()


PASSKEY_DIGITS = 5  # the training documents' keys (`passkey_document`) and the evaluation's


@dataclass
class EvaluationData:
    """What every model is evaluated on."""

    documents: dict[str, list[int]]  # never-trained documents for position-matched perplexity, each of the longest length
    haystack: object | None  # the held-out needle haystack (`needles.Haystack`)
    training_keys: frozenset[str]  # every 5-digit string of the training texts: no evaluation key is one of them


def evaluate(folder: Path, extension: str | None, data: EvaluationData, tokenizer, recipe: Recipe, name: str) -> dict:
    """Position-matched perplexity, passkey (strict and teacher-forced) and, for the models with a prior, needles
    per length, each length's seconds and peak RSS; the long lengths for the models with a prior that
    `recipe.goes_long`. A RoPE extension is set per length. One key drawer for all lengths: a key is never used
    twice, and every model gets the same keys at the same length and depth."""
    from bam_llama.evaluation.costs import measured
    from bam_llama.evaluation.needles import evaluate_needles
    from bam_llama.evaluation.passkey import evaluate_passkey

    result = {"perplexity": {}, "passkey": {}, "needles": {kind: {} for kind in NEEDLE_KINDS},
              "seconds": {}, "peak_rss_mib": {}}
    prior = MODELS[name].has_prior and extension is None
    keys = PasskeyKeys(recipe.seed, PASSKEY_DIGITS, excluded=data.training_keys)
    model = None
    for length in recipe.lengths + (recipe.long_lengths if prior and recipe.goes_long(name) else []):
        if model is None or extension is not None:
            model = load(folder, extension, length, recipe.train_length)
        with measured() as cost:
            result["perplexity"][length] = position_matched_perplexity(
                model, tokenizer, data.documents, length, recipe.train_length)
            found = evaluate_passkey(
                model, tokenizer, [length], num_depths=recipe.passkey_depths(length), template=TEXT_TEMPLATE,
                add_bos=True, progress=False, keys=keys, teacher_forced=True,
            )
            result["passkey"][length] = found.to_dict()
            if prior and data.haystack is not None:
                for kind in NEEDLE_KINDS:
                    needles = evaluate_needles(
                        model, tokenizer, recipe.needle_task(kind), [length], num_depths=recipe.needle_depth_count(length),
                        seed=recipe.seed, haystack=data.haystack, add_bos=True, progress=False,
                    )
                    result["needles"][kind][length] = needles.to_dict()
        result["seconds"][length], result["peak_rss_mib"][length] = cost.seconds, cost.peak_rss_mib
    passkeys = result["passkey"].values()
    result["evaluation_keys"] = {"keys": sum(len(row) for found in passkeys for row in found["passkeys"]),
                                 "in_training": sum(found["keys_in_training"] for found in passkeys),
                                 "redrawn": sum(found["keys_redrawn"] for found in passkeys)}
    if not any(result["needles"].values()):
        del result["needles"]
    return result


# ------------------------------------------------------------------------------------------------- report


def found(retrieval_result: dict, score: str = "correct") -> tuple[int, int]:
    """(prompts found, prompts) of a retrieval result: `correct` (strict) or `teacher_forced`; of a mean over seeds
    (`mean_over_seeds`), the seeds' pooled counts."""
    cell = retrieval_result[score]
    if isinstance(cell, dict):
        return cell["found"], cell["prompts"]
    flags = [flag for row in cell for flag in row]
    return sum(flags), len(flags)


def accuracy(retrieval_result: dict, score: str = "correct") -> float:
    """The share of prompts found; of a mean over seeds, the mean of the seeds' shares."""
    cell = retrieval_result[score]
    if isinstance(cell, dict):
        return cell["rate"]
    hits, prompts = found(retrieval_result, score)
    return hits / prompts


def rate_cell(hits: int, prompts: int, count: bool = False) -> str:
    """"45% (23-69)": the rate and its 95% Clopper-Pearson interval; with `count`, "45% (23-69) 9/20"."""
    return f"{hits / prompts:.0%} ({interval_text(hits, prompts)})" + (f" {hits}/{prompts}" if count else "")


def retrieval_cell(retrieval_result: dict, score: str = "correct") -> str:
    """`rate_cell`; a mean over seeds with its pooled count."""
    return rate_cell(*found(retrieval_result, score), count=isinstance(retrieval_result[score], dict))


def wrong_digits(key: str, prediction: str) -> int | None:
    """How many digits of `key` the answer's leading digits get wrong; None where it has another number of digits."""
    answer = prediction.strip()
    digits = answer[: len(answer) - len(answer.lstrip("0123456789"))]
    if len(digits) != len(key):
        return None
    return sum(given != true for given, true in zip(digits, key))


def wrong_digits_cell(passkey_result: dict) -> str:
    """"1: 13, 2: 3, other: 1" over the strict misses of a length (answers and keys of every prompt); "none"."""
    counts = {}
    for keys, predictions, hits in zip(passkey_result["passkeys"], passkey_result["predictions"],
                                       passkey_result["correct"]):
        for key, prediction, hit in zip(keys, predictions, hits):
            if not hit:
                wrong = wrong_digits(key, prediction)
                counts[wrong] = counts.get(wrong, 0) + 1
    if not counts:
        return "none"
    ordered = sorted((wrong for wrong in counts if wrong is not None)) + [None] * (None in counts)
    return ", ".join(f"{'other' if wrong is None else wrong}: {counts[wrong]}" for wrong in ordered)


def depth_halves_cell(passkey_result: dict) -> str:
    """"2/10 · 8/10": keys found among the prompts whose key sits in the first half (depth < 0.5) and the rest."""
    halves = [[0, 0], [0, 0]]
    for depths, hits in zip(passkey_result["depths"], passkey_result["correct"]):
        for depth, hit in zip(depths, hits):
            half = halves[depth >= 0.5]
            half[0], half[1] = half[0] + bool(hit), half[1] + 1
    return " · ".join(f"{hits}/{prompts}" for hits, prompts in halves)


def entry_name(row: str, seed: int, seeds: tuple[int, ...]) -> str:
    """A row's (a model's, or a RoPE extension's) entry of the results and training summaries: the row itself in a
    one-seed run, `<row>/seed-N` in a run of several."""
    return row if len(seeds) == 1 else f"{row}/seed-{seed}"


def model_rows(name: str) -> list[str]:
    """The result rows of model `name`: RoPE brings its extensions."""
    return [name] + [f"rope-{extension}" for extension in ROPE_EXTENSIONS] * (name == "rope")


def mean_over_seeds(results: list[dict]) -> dict:
    """One row's mean over its seeds' results, cell by cell: each perplexity the mean of the seeds' (`by_seed`
    beside it); each retrieval rate the mean of the seeds' rates, with the pooled count of prompts found (every seed
    asks as many prompts, so the pooled rate is the mean) for its 95% interval; the evaluation keys summed."""
    first = results[0]
    mean = {"seeds": len(results), "perplexity": {}, "passkey": {}}
    for length in first["perplexity"]:
        points = [result["perplexity"][length] for result in results]
        mean["perplexity"][length] = {measure: mean_point([point[measure] for point in points])
                                      for measure in ("last_window", "past_training_length")}
    for length, cell in first["passkey"].items():
        mean["passkey"][length] = {score: pooled_rate([result["passkey"][length] for result in results], score)
                                   for score in ("correct", "teacher_forced") if score in cell}
    if "needles" in first:
        mean["needles"] = {kind: {length: {"correct": pooled_rate([result["needles"][kind][length] for result in results])}
                                  for length in by_length} for kind, by_length in first["needles"].items()}
    if all("evaluation_keys" in result for result in results):
        mean["evaluation_keys"] = {key: sum(result["evaluation_keys"][key] for result in results)
                                   for key in first["evaluation_keys"]}
    return mean


def mean_point(points: list[dict | None]) -> dict | None:
    """The mean of the seeds' perplexities of one measure (None where a seed has none)."""
    if any(point is None for point in points):
        return None
    values = [point["perplexity"] for point in points]
    return {"perplexity": sum(values) / len(values), "by_seed": values}


def pooled_rate(retrieval_results: list[dict], score: str = "correct") -> dict:
    counts = [found(result, score) for result in retrieval_results]
    rates = [hits / prompts for hits, prompts in counts]
    hits, prompts = sum(hits for hits, _ in counts), sum(prompts for _, prompts in counts)
    return {"rate": sum(rates) / len(rates), "found": hits, "prompts": prompts,
            "interval": list(clopper_pearson(hits, prompts)), "by_seed": rates}


def seed_means(results: dict, recipe: Recipe) -> dict:
    """Every row's `mean_over_seeds`, over the seeds it has results of so far ({} for a one-seed run)."""
    if len(recipe.seeds) == 1:
        return {}
    means = {}
    for name in recipe.models:
        for row in model_rows(name):
            done = [results[key] for seed in recipe.seeds if (key := entry_name(row, seed, recipe.seeds)) in results]
            if done:
                means[row] = mean_over_seeds(done)
    return means


def needles_found(result: dict, length: int) -> tuple[int, int] | None:
    """(answers found, prompts) of the four needle tasks together at `length` (None where not evaluated)."""
    needles = result.get("needles", {})
    counts = [found(needles[kind][length]) for kind in NEEDLE_KINDS if length in needles.get(kind, {})]
    return (sum(hits for hits, _ in counts), sum(prompts for _, prompts in counts)) if counts else None


def needle_accuracy(result: dict, length: int) -> float | None:
    """The exact-answer accuracy of the four needle tasks together at `length` (None where not evaluated)."""
    counts = needles_found(result, length)
    return None if counts is None else counts[0] / counts[1]


def window_perplexity(result: dict, length: int, measure: str = "last_window") -> float | None:
    """The position-matched perplexity `measure` at `length` (None where not measured or undefined)."""
    point = result["perplexity"].get(length, {}).get(measure)
    return None if point is None else point["perplexity"]


def progress_line(name: str, result: dict, recipe: Recipe, started: float) -> str:
    """One model's perplexity and passkey rows as soon as it is evaluated (a long run shows where it stands)."""
    perplexity = " ".join(f"{window_perplexity(result, length):.2f}" for length in result["perplexity"])
    passkey = " ".join(f"{accuracy(result['passkey'][length]):.0%}" for length in result["passkey"])
    needles = " ".join(f"{value:.0%}" for value in (needle_accuracy(result, length) for length in result["passkey"]) if value is not None)
    return (f"[{(time.perf_counter() - started) / 60:.1f} min] {name}: last-window perplexity {perplexity} | passkey {passkey}"
            + (f" | needles {needles}" if needles else ""))


def markdown_table(results: dict, lengths: list[int], train_length: int, cell) -> str:
    """A row per model, a column per length, `cell(result, length)` in each ("—" where it gives None)."""
    header = "| model | " + " | ".join(f"{length} ({length // train_length}x)" for length in lengths) + " |"
    rows = []
    for name, result in results.items():
        cells = [cell(result, length) for length in lengths]
        rows.append(f"| {name} | " + " | ".join("—" if value is None else value for value in cells) + " |")
    return "\n".join([header, "|---|" + "---:|" * len(lengths), *rows])


def percent(value: float | None) -> str | None:
    return None if value is None else f"{value:.0%}"


def tables(results: dict, recipe: Recipe, documents: int) -> str:
    every_length = recipe.lengths + recipe.long_lengths
    table = lambda chosen, lengths, cell: markdown_table(chosen, lengths, recipe.train_length, cell)  # noqa: E731
    on = f"{documents} never-trained documents, each its own sequence behind BOS"
    past = lambda result, length: (  # noqa: E731
        f"{value:.2f}" if (value := window_perplexity(result, length, "past_training_length")) else None)
    window = lambda result, length: f"{value:.2f}" if (value := window_perplexity(result, length)) else None  # noqa: E731
    sections = [
        (f"Perplexity of the positions past the training length {recipe.train_length} ({on}; "
         f"{documents} x (length - {recipe.train_length}) tokens)", table(results, every_length[1:], past)),
        (f"Perplexity of the last {recipe.train_length} positions of each length ({on}; "
         f"{documents * recipe.train_length} tokens at every length)", table(results, every_length, window)),
    ]
    for score, what in (("correct", "strict: the greedy answer is the key and no further digit"),
                        ("teacher_forced", "teacher-forced, the reference code's scoring: the first digit given, every "
                                           "later digit the argmax given the true ones before it")):
        cell = lambda result, length, score=score: (  # noqa: E731
            retrieval_cell(result["passkey"][length], score) if length in result["passkey"] else None)
        sections.append((f"Passkey retrieval, {what} ({depths_line(recipe, recipe.passkey_depths)}; 95% intervals)",
                         table(results, every_length, cell)))
    answered = {name: result for name, result in results.items()  # each seed's rows: the means keep no answers
                if any("predictions" in cell for cell in result["passkey"].values())}
    miss_cell = lambda result, length: (  # noqa: E731
        wrong_digits_cell(result["passkey"][length]) if "predictions" in result["passkey"].get(length, {}) else None)
    sections.append(("Passkey misses (strict) by their wrong digits: how many answers had 1, 2, ... digits of the key "
                     "wrong ('other': not as many digits as the key)", table(answered, every_length, miss_cell)))
    half_cell = lambda result, length: (  # noqa: E731
        depth_halves_cell(result["passkey"][length]) if "depths" in result["passkey"].get(length, {}) else None)
    sections.append(("Passkeys found (strict) by where the key sits: in the prompt's first half (farthest from the "
                     "question) / in its second half", table(answered, every_length, half_cell)))
    with_needles = {name: result for name, result in results.items() if "needles" in result}
    if with_needles:
        depths = depths_line(recipe, recipe.needle_depth_count)
        for kind in NEEDLE_KINDS:
            task = recipe.needle_task(kind)
            cell = lambda result, length, kind=kind: (  # noqa: E731
                retrieval_cell(result["needles"][kind][length]) if length in result["needles"][kind] else None)
            sections.append((f"Needles, {kind} ({task.describe()}; {depths}; exact answers; 95% intervals)",
                             table(with_needles, every_length, cell)))
        pooled = lambda result, length: (  # noqa: E731
            rate_cell(*counts, count="seeds" in result) if (counts := needles_found(result, length)) else None)
        sections.append(("Needles, the four tasks together", table(with_needles, every_length, pooled)))
    measured = {name: result for name, result in results.items() if "seconds" in result}  # not the means over seeds
    seconds = lambda result, length: f"{result['seconds'][length]:.0f}" if length in result["seconds"] else None  # noqa: E731
    evaluated = "perplexity, passkey and needles" if with_needles else "perplexity and passkey"
    sections.append((f"Seconds per length ({evaluated} of the length)", table(measured, every_length, seconds)))
    rss = lambda result, length: f"{result['peak_rss_mib'][length]:.0f}" if result["peak_rss_mib"].get(length) else None  # noqa: E731
    sections.append(("Peak RSS per length (MiB)", table(measured, every_length, rss)))
    return "".join(f"{title}\n\n{body}\n\n" for title, body in sections)


def depths_line(recipe: Recipe, count) -> str:
    """"50 depths per length, 20 at 128x, ..."."""
    usual = count(recipe.lengths[0])
    others = [f"{count(length)} at {length // recipe.train_length}x" for length in recipe.lengths + recipe.long_lengths
              if count(length) != usual]
    return f"{usual} depths per length" + (", " + ", ".join(others) if others else "")


def studies(results: dict, training: dict, recipe: Recipe) -> str:
    """The SSMax study's and the recipe study's tables, each where one of its variants ran."""
    ssmax = study_table("SSMax study", [name for name in results if name in MODELS and
                                        (MODELS[name].ssmax or name in ("bam", "bam-long"))],
                        results, training, recipe, "learned s, mean per layer", "ssmax_scale", mean_per_layer)
    recipe_study = study_table("Recipe study", [name for name in results if name in MODELS and
                                                MODELS[name].positional == "bam" and not MODELS[name].ssmax],
                               results, training, recipe, "theta_beta, lowest to highest head per layer", "theta_beta",
                               range_per_layer)
    return ssmax + recipe_study


def mean_per_layer(rows: list[list[float]]) -> str:
    return ", ".join(f"{sum(layer) / len(layer):.2f}" for layer in rows)


def range_per_layer(rows: list[list[float]]) -> str:
    return ", ".join(f"{min(layer):.2f} to {max(layer):.2f}" for layer in rows)


def study_table(title: str, names: list[str], results: dict, training: dict, recipe: Recipe, learned_title: str,
                parameter: str, learned_text) -> str:
    """What each variant of a study changes, against bam: passkey (strict) and needles by length, the last-window
    perplexity at 1x and its ratio at the longest length, a learned parameter (`learned_text` of its [layer][head]
    values; none for a mean over seeds: every seed's are in the tables of learned values)."""
    if not any(name not in DEFAULT_MODELS for name in names):
        return ""
    lengths = recipe.lengths
    longest = max(lengths)
    header = ("| model | what | passkey " + " / ".join(f"{length // recipe.train_length}x" for length in lengths)
              + f" | needles at {longest // recipe.train_length}x | last-window perplexity 1x | {longest // recipe.train_length}x / 1x | {learned_title} |")
    rows = [header, "|---|---|---|---:|---:|---:|---|"]
    for name in names:
        result, learned = results[name], training.get(name, {}).get("learned", {})
        passkey = " / ".join(f"{100 * accuracy(result['passkey'][length]):.0f}" for length in lengths)
        first, last = (window_perplexity(result, length) for length in (lengths[0], longest))
        rows.append(f"| {name} | {MODELS[name].what} | {passkey} | {percent(needle_accuracy(result, longest)) or '—'} "
                    f"| {first:.2f} | {last / first:.3f} | {learned_text(learned[parameter]) if parameter in learned else '—'} |")
    seeds = {results[name].get("seeds", 1) for name in names}
    means = "" if seeds == {1} else (
        f", the mean of {seed_count(seeds.pop())}" if len(seeds) == 1 else ", each the mean of its seeds: see the tables above")
    return f"{title} (passkey in %{means})\n\n" + "\n".join(rows) + "\n\n"


def seed_count(seeds: int) -> str:
    return f"{seeds} seed" + ("s" if seeds != 1 else "")


def learned_tables(training: dict) -> str:
    """Every SSMax model's learned scales, and every BAM model's prior (learned, or frozen), per layer and head."""
    bams = {entry: summary for entry, summary in training.items() if MODELS[entry.split("/")[0]].positional == "bam"}
    return (learned_table(training, "ssmax_scale", "Learned SSMax scales s (c = s ln n)")
            + learned_table(bams, "theta_alpha", "BAM priors: theta_alpha (the bias's scale exp(theta_alpha))")
            + learned_table(bams, "theta_beta", "BAM priors: theta_beta (the shape: the bias grows as distance^theta_beta)"))


def learned_table(training: dict, parameter: str, title: str) -> str:
    """A row per model and layer, a column per head: the learned `parameter` ("" where no model has it)."""
    lines = []
    for name, summary in training.items():
        for layer, heads in enumerate(summary.get("learned", {}).get(parameter, [])):
            lines.append(f"| {name} | {layer} | " + " | ".join(f"{value:.3f}" for value in heads) + " |")
    if not lines:
        return ""
    heads = lines[0].count("|") - 3
    header = "| model | layer | " + " | ".join(f"head {head}" for head in range(heads)) + " |"
    return f"{title}\n\n" + "\n".join([header, "|---|---:|" + "---:|" * heads, *lines]) + "\n\n"


def target_lines(results: dict, recipe: Recipe) -> list[str]:
    """The issues' targets, each met or missed with its numbers (only those whose lengths and models were run)."""
    length = {scale: recipe.train_length * scale for scale in recipe.scales + recipe.long_scales}

    def perplexity(name: str, scale: int) -> float:
        return window_perplexity(results[name], length[scale])

    def passkey(name: str, scale: int) -> float | None:
        found = results[name]["passkey"].get(length.get(scale))
        return None if found is None else accuracy(found)

    lines = []
    if {2, 64} <= set(recipe.scales) and "bam" in results:
        ratio = perplexity("bam", 64) / perplexity("bam", 2)
        lines.append(f"BAM last-window perplexity 64x / 2x = {ratio:.3f} (target <= 1.10): {'met' if ratio <= 1.10 else 'MISSED'}")
    if {1, 8} <= set(recipe.scales):
        for name in [name for name in ("rope", "nope") if name in results]:
            ratio = perplexity(name, 8) / perplexity(name, 1)
            lines.append(f"{name} last-window perplexity 8x / 1x = {ratio:.2f} (target >= 3): {'met' if ratio >= 3 else 'MISSED'}")
    for scale in (32, 64):
        if scale in recipe.scales and {"bam", "alibi"} <= set(results):
            bam, alibi = passkey("bam", scale), passkey("alibi", scale)
            met = bam >= 0.9 and bam - alibi >= 0.3
            lines.append(f"passkey at {scale}x: BAM {bam:.0%}, ALiBi {alibi:.0%} (target BAM >= 90% and >= 30 points "
                         f"above ALiBi): {'met' if met else 'MISSED'}")
    return lines + best_variant_lines(results, recipe, passkey)


def best_variant_lines(results: dict, recipe: Recipe, passkey) -> list[str]:
    """Issue 36's targets for BAM's best variant (the BAM model finding the most keys at the longest lengths)."""
    bams = [name for name in results if name.startswith("bam")]
    if not bams:
        return []
    scales = sorted(recipe.scales + recipe.long_scales, reverse=True)
    best = max(bams, key=lambda name: [passkey(name, scale) or 0.0 for scale in scales])
    lines = [f"BAM's best variant: {best}"]
    for scale, target in ((64, 0.95), (512, 0.80)):
        found = passkey(best, scale)
        if found is not None:
            lines.append(f"{best} passkey at {scale}x {found:.0%} (target >= {target:.0%}): {'met' if found >= target else 'MISSED'}")
    ratio, control = (last_window_drift(results.get(name), recipe) for name in (best, "alibi"))
    if ratio is not None and control is not None:
        relative = ratio / control
        lines.append(f"{best} last-window perplexity 512x / 2x = {ratio:.3f}, ALiBi's on the same tokens {control:.3f}: "
                     f"{relative:.3f} of ALiBi's (target <= 1.10): {'met' if relative <= 1.10 else 'MISSED'}")
    elif ratio is not None:
        lines.append(f"{best} last-window perplexity 512x / 2x = {ratio:.3f} (target <= 1.10; not judged: the two windows "
                     "hold other tokens, and no ALiBi ran to 512x to compare the same tokens with)")
    length = recipe.train_length * 32
    bam_needles = needle_accuracy(results[best], length)
    alibi_needles = needle_accuracy(results["alibi"], length) if "alibi" in results else None
    if bam_needles is not None and alibi_needles is not None:
        met = bam_needles - alibi_needles >= 0.3
        lines.append(f"needles at 32x (the four tasks together): {best} {bam_needles:.0%}, ALiBi {alibi_needles:.0%} "
                     f"(target >= 30 points above ALiBi): {'met' if met else 'MISSED'}")
    return lines


def last_window_drift(result: dict | None, recipe: Recipe) -> float | None:
    """The last-window perplexity at 512x over that at 2x: the last 128 tokens of each document's first 65,536
    against its tokens 128-255, other text, so a ratio mixes the model's drift with how hard each stretch of the
    documents is. Divided by ALiBi's ratio on the same tokens (whose perplexity stays flat with length), the
    documents' part cancels. None where either length was not measured."""
    if result is None:
        return None
    first, last = (window_perplexity(result, recipe.train_length * scale) for scale in (2, 512))
    return last / first if first and last else None


def plot_perplexity(results: dict, recipe: Recipe, path: Path, documents: int) -> None:
    """Position-matched perplexity against length: the last training-length window (solid) and the positions past
    the training length (dashed), one colour per model."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4.5))
    axes = figure.subplots()
    for index, (name, result) in enumerate(results.items()):
        for measure, style, what in (("last_window", "-", "last window"), ("past_training_length", "--", "past training length")):
            points = [(length, value) for length in result["perplexity"]
                      if (value := window_perplexity(result, length, measure)) is not None]
            if points:
                axes.plot(*zip(*points), style, marker="o", color=f"C{index}", label=f"{name}, {what}")
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.axvline(recipe.train_length, color="gray", linestyle="--", label=f"training length {recipe.train_length}")
    axes.set_xlabel("sequence length (tokens)")
    axes.set_ylabel("perplexity")
    axes.set_title(f"Position-matched perplexity on {documents} never-trained documents,\ntrained at {recipe.train_length} tokens",
                   fontsize=10)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def plot_rates(axes, rates: dict[str, dict], recipe: Recipe, title: str, ylabel: str) -> None:
    """Found rates (%) against length, one line per model (`rates`: name -> {length: (found, prompts)}), with their
    95% Clopper-Pearson intervals as error bars."""
    for name, by_length in rates.items():
        points, below, above = [], [], []
        for hits, prompts in by_length.values():
            low, high = clopper_pearson(hits, prompts)
            points.append(100 * hits / prompts)
            below.append(points[-1] - 100 * low)
            above.append(100 * high - points[-1])
        axes.errorbar(list(by_length), points, yerr=[below, above], marker="o", capsize=3, label=name)
    axes.set_xscale("log", base=2)
    axes.set_ylim(-5, 105)
    axes.axvline(recipe.train_length, color="gray", linestyle="--")
    axes.set_title(title, fontsize=10)
    axes.set_xlabel("prompt length (tokens)")
    axes.set_ylabel(ylabel)
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=8)


def plot_passkey(results: dict, recipe: Recipe, path: Path) -> None:
    """Passkey found against length, strict and teacher-forced, one line per model, 95% intervals as error bars."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 4.5))
    for axes, (score, title) in zip(figure.subplots(1, 2).flat, (("correct", "strict"), ("teacher_forced", "teacher-forced"))):
        rates = {name: {length: found(value, score) for length, value in result["passkey"].items()}
                 for name, result in results.items()}
        plot_rates(axes, rates, recipe, f"passkey, {title} (95% intervals)", "keys found (%)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def plot_needles(results: dict, recipe: Recipe, path: Path) -> None:
    """Exact-answer accuracy against length, one panel per task, one line per model, 95% intervals as error bars."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 7))
    for axes, kind in zip(figure.subplots(2, 2).flat, NEEDLE_KINDS):
        rates = {name: {length: found(value) for length, value in result["needles"][kind].items()}
                 for name, result in results.items() if result.get("needles", {}).get(kind)}
        plot_rates(axes, rates, recipe, f"{kind}: {recipe.needle_task(kind).describe()}", "exact answers (%)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def write_report(staging: Path, report: dict, recipe: Recipe, documents: dict[int, list[str]]) -> str:
    """results.json, results.md and the plots of `report`; `documents`: each seed's perplexity documents. With
    several seeds, the tables hold each seed's row and their mean's, and the targets and plots take the means."""
    from bam_llama.evaluation.passkey import PasskeyResults

    (staging / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    results, means = report["results"], report.get("means", {})
    judged = means if len(recipe.seeds) > 1 else results
    machine = report["machine"]
    summary = (
        f"Trained at {recipe.train_length} tokens for {recipe.steps} steps of {recipe.batch_size} rows, learning rate "
        f"{recipe.learning_rate:g}, the prior's {recipe.prior_learning_rate or recipe.learning_rate:g}. "
        f"{seeds_line(recipe)}Perplexity is position-matched on the same {documents_line(documents)} at every length "
        f"and for every model (generated tables left out), each document's first tokens one sequence behind BOS. "
        f"{evaluation_keys_line(results)} "
        + ("" if report["complete"] else f"**Partial: {len(report['training'])} of the recipe's "
                                        f"{len(recipe.models) * len(recipe.seeds)} models; the run went on, or was stopped.** ")
        + (f"{', '.join(report['resumed'])} measured by the earlier run this one resumed (--resume; the minutes "
           "add up both). " if report.get("resumed") else "")
        + f"{report['minutes']:.1f} min, peak RSS {report['peak_rss_mib']:.0f} MiB, {threads_line(machine, recipe)} on "
        f"{machine['processor']}, torch {machine['torch']}, transformers {machine['transformers']}.\n\n"
    )
    targets = "\n".join(f"- {line}" for line in target_lines(judged, recipe))
    judged_on = f" (judged on the mean of seeds {', '.join(map(str, recipe.seeds))})" if means else ""
    text = (summary + tables(rows_with_means(results, means, recipe), recipe, len(documents[recipe.seeds[0]]))
            + studies(judged, report["training"], recipe) + learned_tables(report["training"])
            + (f"Targets{judged_on}\n\n" + targets + "\n" if targets else ""))
    (staging / "results.md").write_text(text)
    plot_perplexity(judged, recipe, staging / "perplexity.png", len(documents[recipe.seeds[0]]))
    plot_passkey(judged, recipe, staging / "passkey.png")
    if any("needles" in result for result in judged.values()):
        plot_needles(judged, recipe, staging / "needles.png")
    for name, result in results.items():
        merged = PasskeyResults.concatenate([PasskeyResults.from_dict(value) for value in result["passkey"].values()])
        merged.save_heatmap(staging / f"passkey-{name.replace('/', '-')}.png",
                            title=f"{name}, trained at {recipe.train_length} tokens")
    return text


def threads_line(machine: dict, recipe: Recipe) -> str:
    threads = f"{machine['threads']} thread{'s' if machine['threads'] != 1 else ''}"
    return f"{threads} a model, {recipe.jobs} models at a time" if recipe.jobs > 1 else threads


def seeds_line(recipe: Recipe) -> str:
    if len(recipe.seeds) == 1:
        return f"Seed {recipe.seed}. "
    documents = "passkey and needle documents" if recipe.needle_share > 0 else "passkey documents"
    return (f"Seeds {', '.join(map(str, recipe.seeds))}, each a run of its own ({documents}, BPE, "
            "model initialisation and data order, evaluation keys): a row per seed (`<model>/seed-N`) and their mean "
            "(each perplexity the mean of the seeds'; each rate the mean of the seeds' rates, with the pooled count of "
            "prompts found and its 95% interval, which takes every seed's prompts as independent draws). ")


def documents_line(documents: dict[int, list[str]]) -> str:
    """"8 never-trained documents (a.py, ...)", each seed's where their tokenizers chose different ones."""
    names = list(documents.values())
    if all(chosen == names[0] for chosen in names):
        return f"{len(names[0])} never-trained documents ({', '.join(names[0])})"
    return f"{len(names[0])} never-trained documents of each seed (" + "; ".join(
        f"seed {seed}: {', '.join(chosen)}" for seed, chosen in documents.items()) + ")"


def rows_with_means(results: dict, means: dict, recipe: Recipe) -> dict:
    """The tables' rows: each result row, and after a row's seeds their mean."""
    if not means:
        return results
    rows = {}
    for row, mean in means.items():
        rows.update({key: results[key] for seed in recipe.seeds if (key := entry_name(row, seed, recipe.seeds)) in results})
        rows[f"{row}, mean of {seed_count(mean['seeds'])}"] = mean
    return rows


def evaluation_keys_line(results: dict) -> str:
    """How many passkey evaluation keys the training texts hold (0: each found there was drawn again)."""
    counts = [result["evaluation_keys"] for result in results.values() if "evaluation_keys" in result]
    if not counts:
        return "Evaluation keys: not recorded (a run from before they were checked)."
    return (f"Evaluation keys: {max(count['keys'] for count in counts)} a model, none twice, drawn apart from the "
            f"training keys; found in the training texts: {sum(count['in_training'] for count in counts)} "
            f"({max(count['redrawn'] for count in counts)} draws redrawn for occurring there).")


class ResumeError(ValueError):
    """--resume found no earlier run it may continue."""


RESUMABLE_CHANGES = ("models", "long_models", "jobs", "seeds")  # what a resumed run may change of the earlier one's recipe


def as_json(value):
    return json.loads(json.dumps(value))


def with_length_keys(value):
    """Results read back from JSON, their lengths (object keys there) integers again as in a run's own results."""
    if isinstance(value, dict):
        return {int(key) if key.isdigit() else key: with_length_keys(item) for key, item in value.items()}
    if isinstance(value, list):
        return [with_length_keys(item) for item in value]
    return value


def recorded_seeds(recipe: dict) -> tuple[int, ...]:
    """The seeds of a recipe read back from results.json (one `seed` before there were several)."""
    return tuple(recipe["seeds"]) if "seeds" in recipe else (recipe["seed"],)


def earlier_run(output_dir: Path, recipe: Recipe, machine: dict) -> dict:
    """The report of the run in `output_dir` that `recipe` continues (--resume): same recipe but for the models, which
    of them go long, the seeds and --jobs, on the same machine, threads and versions. A ResumeError names what
    differs."""
    path = output_dir / "results.json"
    if not path.is_file():
        raise ResumeError(f"--resume: {output_dir} holds no results.json of an earlier run")
    earlier = json.loads(path.read_text())
    earlier["recipe"]["seeds"] = list(recorded_seeds(earlier["recipe"]))
    earlier["recipe"].pop("seed", None)
    now = as_json(asdict(recipe))
    changed = sorted(key for key in now.keys() | earlier["recipe"].keys()
                     if key not in RESUMABLE_CHANGES and now.get(key) != earlier["recipe"].get(key))
    changed += sorted(f"machine {key}" for key in machine if key != "jobs" and machine[key] != earlier["machine"].get(key))
    if changed:
        raise ResumeError(f"--resume: the run in {output_dir} differs in {', '.join(changed)}; its results would not "
                          "compare with this run's")
    return earlier


def kept_models(earlier: dict, recipe: Recipe) -> dict[tuple[str, int], str]:
    """The (model, seed) pairs of `earlier` this run keeps instead of training again, with their entry there: asked
    for now, and evaluated at the same lengths (a model that goes long now must have gone long then, and the
    reverse)."""
    went_long = earlier["recipe"]["long_models"]
    seeds = recorded_seeds(earlier["recipe"])
    kept = {}
    for name in recipe.models:
        for seed in recipe.seeds:
            entry = entry_name(name, seed, seeds)
            if seed in seeds and entry in earlier["training"] and recipe.goes_long(name) == (went_long is None or name in went_long):
                kept[name, seed] = entry
    return kept


@dataclass
class SeedData:
    """What one seed's models train on and are evaluated on."""

    work: Path  # the seed's scratch folder: its tokenizer, training texts and trained models
    evaluation: EvaluationData
    corpus: dict  # the training texts' counts and the perplexity documents' tokens, for results.json

    @property
    def texts(self) -> Path:
        return self.work / "train.jsonl"

    @property
    def tokenizer(self) -> Path:
        return self.work / "tokenizer"


def seed_data(train_documents: list[Document], heldout_documents: list[Document], recipe: Recipe, work: Path,
              suites: list[Document]) -> SeedData:
    """The training texts and tokenizer of a one-seed recipe, written in `work`, and its evaluation data."""
    from bam_llama.evaluation.needles import Haystack

    texts, tokenizer, needles = training_data(train_documents, recipe)
    tokenizer.save_pretrained(work / "tokenizer")
    (work / "train.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    with_prior = any(MODELS[name].has_prior for name in recipe.models)
    evaluation = EvaluationData(
        documents=perplexity_documents(heldout_documents, tokenizer, recipe, suites),
        haystack=Haystack([document.text for document in heldout_documents]) if with_prior and recipe.needles else None,
        training_keys=frozenset(keys_in_texts(texts, PASSKEY_DIGITS)),
    )
    corpus = {"train_used": {"texts": len(texts), "characters": sum(map(len, texts)), "needle_documents": len(needles),
                             "needle_characters": sum(map(len, needles))},
              "perplexity_documents": {name: len(tokens) for name, tokens in evaluation.documents.items()}}
    return SeedData(work, evaluation, corpus)


@dataclass
class ModelJob:
    """One model of one seed to train and evaluate; a frozen-prior model's carries the prior it freezes once known."""

    name: str
    seed: int
    data: SeedData
    recipe: Recipe  # the run's, for this seed (`Recipe.for_seed`)
    frozen_prior: str | None = None  # the saved BamLlama folder whose prior it freezes
    frozen_prior_from: str | None = None  # where that prior comes from

    @property
    def ready(self) -> bool:
        """Whether it can start: a model with a frozen prior once that prior is known, the others at once."""
        return not MODELS[self.name].frozen_prior_of or self.frozen_prior is not None

    def with_prior(self, folder: str | Path, entry: str) -> ModelJob:
        """This job with the prior of the saved model `folder` (learned by `entry`) to freeze."""
        return replace(self, frozen_prior=str(folder), frozen_prior_from=entry)


def frozen_prior_source(folder: Path, seed: int, recipe: Recipe, source: str | None = None) -> tuple[Path | dict, str]:
    """(prior, where from) for a frozen-prior model from --frozen-prior-from: a saved BamLlama (config.json), whose
    prior every seed takes (the folder itself), or the output folder of an earlier run of this benchmark
    (results.json), whose `source` model (the one whose prior it freezes; default bam-frozen-prior's) of the same seed
    gives its learned prior (theta_alpha and theta_beta [layer][head]; `prior_folder` saves it for bam-pretrain). A
    ValueError where neither holds one that fits."""
    source = source or MODELS["bam-frozen-prior"].frozen_prior_of
    if (folder / "config.json").is_file():
        from bam_llama.training.frozen_prior import check_prior_source

        try:
            check_prior_source(str(folder), recipe.layers, recipe.heads, recipe.prior_scope)
        except ValueError as error:
            raise ValueError(f"--frozen-prior-from {error}") from None
        return folder, str(folder)
    if (folder / "results.json").is_file():
        report = json.loads((folder / "results.json").read_text())
        entry = entry_name(source, seed, recorded_seeds(report["recipe"]))
        if seed not in recorded_seeds(report["recipe"]) or entry not in report["training"]:
            raise ValueError(f"--frozen-prior-from {folder}: its run has no {source} of seed {seed}")
        learned, where = report["training"][entry]["learned"], f"{entry} of {folder}"
    else:
        raise ValueError(f"--frozen-prior-from {folder}: neither a saved model (config.json) nor a run of this "
                         "benchmark (results.json)")
    if "theta_beta" not in learned:
        raise ValueError(f"--frozen-prior-from {folder}: no BamLlama prior there")
    return {name: learned[name] for name in ("theta_alpha", "theta_beta")}, where


def prior_folder(prior: Path | dict, recipe: Recipe, folder: Path) -> Path:
    """A folder `bam-pretrain --frozen-prior-from` reads `prior` from: a saved model's own, or learned lists
    (theta_alpha and theta_beta [layer][head], as results.json keeps them; theta_mu 0, bam's frozen value) written
    to `folder` as a BamLlama config of the recipe's layers, heads and prior scope with the prior tensors alone."""
    if isinstance(prior, Path):
        return prior
    import torch
    from safetensors.torch import save_file

    from bam_llama import BamLlamaConfig

    BamLlamaConfig(hidden_size=recipe.hidden_size, num_hidden_layers=recipe.layers, num_attention_heads=recipe.heads,
                   prior_scope=recipe.prior_scope).save_pretrained(folder)
    modules = ["model.prior"] if recipe.prior_scope == "global" else [
        f"model.layers.{layer}.self_attn.prior" for layer in range(recipe.layers)]
    tensors = {}
    for layer, module in enumerate(modules):  # a global prior: the first layer's row, the same in every layer
        for name in ("theta_alpha", "theta_beta"):
            tensors[f"{module}.{name}"] = torch.tensor(prior[name][layer], dtype=torch.float32)
        tensors[f"{module}.theta_mu"] = torch.zeros(recipe.heads)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def check_frozen_prior_source(recipe: Recipe) -> None:
    """A frozen-prior model needs a prior to freeze: --frozen-prior-from's for every seed, or the model it takes the
    prior of in the same run. A ValueError otherwise."""
    for name in recipe.models:
        source = MODELS[name].frozen_prior_of
        if source is None:
            continue
        if recipe.frozen_prior_from is not None:
            for seed in recipe.seeds:
                frozen_prior_source(Path(recipe.frozen_prior_from), seed, recipe.for_seed(seed), source)
        elif source not in recipe.models:
            raise ValueError(f"--models {name} freezes the prior {source} learned: add {source} to --models (trained "
                             "first, same seed), or give --frozen-prior-from (a saved model, or the output folder of a "
                             "run with it)")


def run(recipe: Recipe, output_dir: Path, resume: bool = False) -> dict:
    """Train and evaluate `recipe.models` with each of `recipe.seeds`, publishing the results in `output_dir` after
    every model. With `resume`, the models an earlier run of the same recipe left there are kept (`kept_models`),
    the others trained."""
    import torch
    import transformers

    check_frozen_prior_source(recipe)
    if recipe.threads is not None:
        torch.set_num_threads(recipe.threads)
    started = time.perf_counter()
    machine = {"platform": platform.platform(), "processor": cpu_model(), "threads": model_threads(recipe),
               "jobs": recipe.jobs, "python": platform.python_version(), "torch": torch.__version__,
               "transformers": transformers.__version__}
    earlier = earlier_run(output_dir, recipe, machine) if resume else None
    kept = kept_models(earlier, recipe) if earlier else {}
    earlier_minutes = earlier["minutes"] if kept else 0.0
    earlier_seeds = recorded_seeds(earlier["recipe"]) if earlier else ()
    train_documents, heldout_documents = split_documents(python_documents(), recipe.heldout_fraction)
    suites = python_test_suites()
    with tempfile.TemporaryDirectory(prefix="text-extrapolation-") as scratch:
        work = Path(scratch)
        data = {}
        for seed in recipe.seeds:
            (work / f"seed-{seed}").mkdir()
            data[seed] = seed_data(train_documents, heldout_documents, recipe.for_seed(seed), work / f"seed-{seed}", suites)
        corpus = corpus_statistics(train_documents, heldout_documents, recipe.heldout_fraction)
        corpus.update(data[recipe.seeds[0]].corpus)
        if len(recipe.seeds) > 1:
            corpus["by_seed"] = {f"seed-{seed}": data[seed].corpus for seed in recipe.seeds}
        documents = {seed: list(data[seed].evaluation.documents) for seed in recipe.seeds}
        training, results = {}, {}
        for (name, seed), entry in kept.items():
            training[entry_name(name, seed, recipe.seeds)] = earlier["training"][entry]
            for row in model_rows(name):
                results[entry_name(row, seed, recipe.seeds)] = with_length_keys(earlier["results"][entry_name(row, seed, earlier_seeds)])
        resumed = [entry_name(name, seed, recipe.seeds) for name, seed in kept]

        def publish() -> tuple[dict, str]:
            """The report of the models done so far, renamed into `output_dir` whole."""
            training_here = json.loads(json.dumps(training).replace(str(work), "<scratch>"))  # no local paths in results
            peak_rss = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)) / 1024
            report = {
                "recipe": asdict(recipe),
                "models": {name: asdict(MODELS[name]) for name in recipe.models},
                "complete": len(training) == len(recipe.models) * len(recipe.seeds),
                "resumed": resumed,  # models measured by the earlier run this one continued
                "corpus": corpus,
                "minutes": earlier_minutes + (time.perf_counter() - started) / 60,
                "peak_rss_mib": max(peak_rss, earlier["peak_rss_mib"] if kept else 0.0, *model_peaks_mib(results)),
                "machine": machine,
                "training": training_here,
                "results": results,
                **({"means": seed_means(results, recipe)} if len(recipe.seeds) > 1 else {}),
            }
            with staged_output_dir(output_dir, force=True) as staging:
                return report, write_report(staging, report, recipe, documents)

        jobs = model_jobs(recipe, data, kept, training)
        if not jobs:
            report, text = publish()
        for job, summary, model_results in trained_models(jobs, recipe):
            training[entry_name(job.name, job.seed, recipe.seeds)] = summary
            results.update({entry_name(row, job.seed, recipe.seeds): result for row, result in model_results.items()})
            results = {key: results[key] for key in result_names(recipe) if key in results}
            training = {key: training[key] for key in training_names(recipe) if key in training}
            for row, result in model_results.items():
                print(progress_line(entry_name(row, job.seed, recipe.seeds), result, recipe, started), flush=True)
            # Every model's results are published as soon as it is done: a run of hours stopped early keeps what it measured
            report, text = publish()
    print(text)
    return report


def model_peaks_mib(results: dict) -> list[float]:
    """Every peak RSS the models' evaluations recorded: the workers of --jobs > 1 are alive when the report is
    written, so the main process's RUSAGE_CHILDREN does not count them yet."""
    return [rss for result in results.values() for rss in result.get("peak_rss_mib", {}).values() if rss]


def model_jobs(recipe: Recipe, data: dict[int, SeedData], kept: dict, training: dict) -> list[ModelJob]:
    """The (model, seed) pairs to train, seed by seed in the recipe's order; a frozen-prior model's with its prior
    where it is known already (--frozen-prior-from, or the model it takes the prior of kept from the earlier run)."""
    jobs = []
    for seed in recipe.seeds:
        for name in recipe.models:
            if (name, seed) in kept:
                continue
            job = ModelJob(name, seed, data[seed], recipe.for_seed(seed))
            source = MODELS[name].frozen_prior_of
            if source is not None:
                saved = data[seed].work / f"frozen-prior-of-{source}"  # a prior known only as lists, for bam-pretrain
                entry = entry_name(source, seed, recipe.seeds)
                if recipe.frozen_prior_from is not None:
                    prior, where = frozen_prior_source(Path(recipe.frozen_prior_from), seed, job.recipe, source)
                    job = job.with_prior(prior_folder(prior, job.recipe, saved), where)
                elif entry in training:  # kept from the earlier run: its model is gone, its prior not
                    job = job.with_prior(prior_folder(training[entry]["learned"], job.recipe, saved), entry)
            jobs.append(job)
    return jobs


def result_names(recipe: Recipe) -> list[str]:
    """The rows of the results in the recipe's order, RoPE's extensions after it, each row's seeds together."""
    return [entry_name(row, seed, recipe.seeds) for name in recipe.models for row in model_rows(name) for seed in recipe.seeds]


def training_names(recipe: Recipe) -> list[str]:
    return [entry_name(name, seed, recipe.seeds) for name in recipe.models for seed in recipe.seeds]


def model_threads(recipe: Recipe) -> int:
    import torch

    return recipe.threads or (1 if recipe.jobs > 1 else torch.get_num_threads())


def train_and_evaluate(job: ModelJob) -> tuple[ModelJob, dict, dict]:
    """One model trained and evaluated (RoPE also with its extensions): (job, training summary, results by row)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(job.data.tokenizer)
    folder, summary = train(job.name, job.data.texts, job.data.tokenizer, job.data.work, job.recipe, job.frozen_prior)
    if job.frozen_prior_from is not None:
        summary["frozen_prior_from"] = job.frozen_prior_from
    results = {row: evaluate(folder, None if row == job.name else row.removeprefix("rope-"), job.data.evaluation,
                             tokenizer, job.recipe, job.name) for row in model_rows(job.name)}
    return job, summary, results


def trained_models(jobs: list[ModelJob], recipe: Recipe):
    """`train_and_evaluate` of every job, yielded as each finishes: one after another here, or with `recipe.jobs` > 1
    in a pool of spawned processes (a fresh PyTorch each, `model_threads` threads). A frozen-prior job starts once
    the model of its seed whose prior it takes is done (`ModelJob.ready`). The workers ignore Ctrl-C; this process stops them
    on Ctrl-C, SIGTERM or an error."""
    waiting = list(jobs)

    def ready_after(done: tuple | None) -> list[ModelJob]:
        """The waiting jobs that can start, once `done` (a finished job's result) is known."""
        if done is not None:
            source, summary = done[0], done[1]
            for index, job in enumerate(waiting):
                if MODELS[job.name].frozen_prior_of == source.name and job.frozen_prior is None and job.seed == source.seed:
                    waiting[index] = job.with_prior(summary["final_dir"], entry_name(source.name, source.seed, recipe.seeds))
        ready = [job for job in waiting if job.ready]
        for job in ready:
            waiting.remove(job)
        return ready

    if recipe.jobs == 1:
        queue = ready_after(None)
        while queue:
            done = train_and_evaluate(queue.pop(0))
            yield done
            queue += ready_after(done)
    else:
        yield from pooled(ready_after, min(recipe.jobs, len(jobs)), model_threads(recipe))
    if waiting:
        raise ValueError(", ".join(f"{job.name}: no {MODELS[job.name].frozen_prior_of} trained to take the prior from"
                                   for job in waiting))


def pooled(ready_after, processes: int, threads: int):
    """The jobs `ready_after(None)` gives, and those it gives after each finished one, in a pool of `processes`
    spawned processes; yielded as each finishes."""
    import multiprocessing
    import queue

    if processes == 0:
        return
    finished = queue.SimpleQueue()
    pool = multiprocessing.get_context("spawn").Pool(processes, initializer=_start_worker, initargs=(threads,))
    try:
        running = 0
        for job in ready_after(None):
            pool.apply_async(train_and_evaluate, (job,), callback=finished.put, error_callback=finished.put)
            running += 1
        while running:
            done = finished.get()
            running -= 1
            if isinstance(done, BaseException):
                raise done
            yield done
            for job in ready_after(done):
                pool.apply_async(train_and_evaluate, (job,), callback=finished.put, error_callback=finished.put)
                running += 1
        pool.close()
    finally:
        pool.terminate()
        pool.join()


def _start_worker(threads: int) -> None:
    import signal

    import torch

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)


def scale_list(text: str) -> tuple[int, ...]:
    scales = tuple(int(part) for part in text.split(",") if part.strip())
    if not scales or min(scales) <= 0 or list(scales) != sorted(set(scales)):
        raise ValueError(f"scales are increasing positive integers, got {text!r}")
    return scales


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser()
    args = parser.parse_args(argv)
    recipe = QUICK if args.quick else Recipe()
    try:
        recipe = recipe_from_args(recipe, args)
    except ValueError as error:
        parser.error(str(error))
    output_dir = args.output_dir or REPOSITORY / "benchmarks" / "results" / ("text-extrapolation-quick" if args.quick else "text-extrapolation")
    exit_on_sigterm()  # like Ctrl-C: the model processes are stopped, the last published results kept
    try:
        run(recipe, output_dir, resume=args.resume)
    except ResumeError as error:
        parser.error(str(error))
    return 0


def argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny models, few steps, 1x-4x: seconds (the numbers mean nothing)")
    parser.add_argument("--output-dir", type=Path, default=None,
                        help="default benchmarks/results/text-extrapolation (with --quick: text-extrapolation-quick)")
    parser.add_argument("--steps", type=int, default=None, help="override the recipe's training steps")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads of each model (default: PyTorch's, 1 with --jobs > 1; --quick: 1)")
    parser.add_argument("--jobs", type=int, default=None, help="models trained and evaluated at once, each in a process "
                        "of its own (default 1); on 2 AMD EPYC cores --jobs 2 --threads 1 trained 1.18x the tokens/s of "
                        "one model on 2 threads")
    parser.add_argument("--models", default=None,
                        help=f"comma-separated names among {','.join(MODELS)} (default: {','.join(DEFAULT_MODELS)}; "
                        "rope brings its extensions)")
    parser.add_argument("--scales", default=None, help="evaluation lengths for every model, in training lengths "
                        "(default 1,2,4,8,16,32,64)")
    parser.add_argument("--long-scales", default=None, help="longer lengths for the models with a prior (BAM "
                        "variants, ALiBi; default 128,256,512); 'none' for none")
    parser.add_argument("--long-models", default=None, help="comma-separated models with a prior evaluated at the "
                        "long scales (default: all of them; the SSMax study's variants need only 1x-64x)")
    parser.add_argument("--resume", action="store_true", help="keep the models an earlier run of the same recipe "
                        "left in --output-dir (stopped, or with other --models) and train only the others")
    parser.add_argument("--seeds", default=None, help="comma-separated seeds, each a run of its own (training data, "
                        "tokenizer, models, evaluation keys): results per <model>/seed-N and their mean (default 0)")
    parser.add_argument("--recipe", choices=RECIPES, default=None, help="the training texts' mix: needles (default: "
                        "passkey 35%%, needles 15%%) or passkey (passkey 50%%, no needle documents, no needle evaluation; "
                        "packed rows >= 95%% full); the share flags below override it")
    parser.add_argument("--prior-lr", type=float, default=None, help="the prior's (and SSMax scales') learning rate "
                        "(default: the weights' 1e-3; bam-prior-lr trains at 5e-2 whatever this says)")
    parser.add_argument("--hidden-size", type=int, default=None, help="every model's hidden size (default 128)")
    parser.add_argument("--frozen-prior-from", default=None, help="the frozen-prior models' prior (bam-frozen-prior: "
                        "bam-prior-lr's, bam-ssmax-frozen-prior: bam-ssmax's): a saved BamLlama folder, or the output "
                        "folder of a run of this benchmark with that model (its learned prior of the same seed); "
                        "default: that model of this run, which --models must then hold")
    parser.add_argument("--no-needles", action="store_true", help="no needle documents in training, no needle evaluation")
    parser.add_argument("--passkey-share", type=float, default=None, help="passkey documents' share of the training characters (default 0.35)")
    parser.add_argument("--needle-share", type=float, default=None, help="needle documents' share of the training characters (default 0.15)")
    return parser


def recipe_from_args(recipe: Recipe, args: argparse.Namespace) -> Recipe:
    """The recipe with the command line's overrides; a ValueError naming the first bad one."""
    if args.steps is not None:
        if args.steps <= 0:
            raise ValueError(f"--steps must be positive, got {args.steps}")
        recipe = replace(recipe, steps=args.steps)
    if args.threads is not None:
        if args.threads <= 0:
            raise ValueError(f"--threads must be positive, got {args.threads}")
        recipe = replace(recipe, threads=args.threads)
    if args.jobs is not None:
        if args.jobs <= 0:
            raise ValueError(f"--jobs must be positive, got {args.jobs}")
        recipe = replace(recipe, jobs=args.jobs)
    if args.models is not None:
        models = tuple(name.strip() for name in args.models.split(","))
        unknown = [name for name in models if name not in MODELS]
        if unknown or len(set(models)) != len(models):
            raise ValueError(f"--models takes distinct names from {', '.join(MODELS)}, got {args.models!r}")
        recipe = replace(recipe, models=models)
    if args.scales is not None:
        recipe = replace(recipe, scales=scale_list(args.scales))
    if args.long_scales is not None:
        recipe = replace(recipe, long_scales=() if args.long_scales == "none" else scale_list(args.long_scales))
    if recipe.long_scales and min(recipe.long_scales) <= max(recipe.scales):
        raise ValueError(f"--long-scales must lie past --scales (up to {max(recipe.scales)})")
    if args.long_models is not None:
        long_models = tuple(name.strip() for name in args.long_models.split(","))
        outside = [name for name in long_models if name not in recipe.models or not MODELS[name].has_prior]
        if outside:
            raise ValueError(f"--long-models takes models with a prior among --models, got {', '.join(outside)}")
        recipe = replace(recipe, long_models=long_models)
    if args.seeds is not None:
        parts = [part.strip() for part in args.seeds.split(",") if part.strip()]
        seeds = tuple(int(part) for part in parts if part.isdigit())
        if not seeds or len(seeds) != len(parts) or len(set(seeds)) != len(seeds):
            raise ValueError(f"--seeds takes distinct seeds >= 0, got {args.seeds!r}")
        recipe = replace(recipe, seeds=seeds)
    if args.prior_lr is not None:
        if not args.prior_lr > 0:
            raise ValueError(f"--prior-lr must be positive, got {args.prior_lr}")
        recipe = replace(recipe, prior_learning_rate=args.prior_lr)
    if args.hidden_size is not None:
        if args.hidden_size <= 0 or args.hidden_size % recipe.heads:
            raise ValueError(f"--hidden-size must be a positive multiple of the {recipe.heads} heads, got {args.hidden_size}")
        recipe = replace(recipe, hidden_size=args.hidden_size)
    if args.frozen_prior_from is not None:
        recipe = replace(recipe, frozen_prior_from=args.frozen_prior_from)
    check_frozen_prior_source(recipe)
    if args.recipe is not None:
        recipe = replace(recipe, **RECIPES[args.recipe])
    if args.no_needles:
        recipe = replace(recipe, needles=False, needle_share=0.0)
    for name in ("passkey_share", "needle_share"):
        value = getattr(args, name)
        if value is not None:
            recipe = replace(recipe, **{name: value})
    if not (0 <= recipe.passkey_share and 0 <= recipe.needle_share and corpus_share(recipe) > 0):
        raise ValueError("--passkey-share and --needle-share must be >= 0 and leave the corpus a share")
    return recipe


if __name__ == "__main__":
    sys.exit(main())
