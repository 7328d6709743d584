"""Train short, test long on real text: the paper's Figure 2 (perplexity) and Figure 3 (passkey) on 2 CPU cores.

Six models trained by `bam-pretrain` (its Python API) with one recipe at a short length (128 tokens) on the same
data: BAM, BAM + SSMax, ALiBi, NoPE, RoPE and RoPE local (RoPE with a sliding window of the training length). The
data is the no-download Python corpus (`bam_llama.data.corpus`: language reference + standard library sources, split
by file) with a share of synthetic passkey documents (the prompt `bam-demo` trains on, answer included) mixed into
the training split, so the same models answer both questions. Then, for every model:

* perplexity of whole held-out sequences of 1x, 2x, ..., 64x the training length, always of the same tokens: the
  first 64x tokens of each of the first 8 held-out files that long, cut into non-overlapping sequences of each
  length (so a sequence never spans two files), each behind BOS; log axes; and the same over the positions past the
  training length only;
* passkey retrieval at the same lengths, 20 depths each (`bam_llama.evaluation.passkey.evaluate_passkey`);
* RoPE also with Transformers' dynamic-NTK and YaRN `rope_parameters` set for each evaluation length (no
  retraining), the context extension a RoPE user would reach for.

    python benchmarks/text_extrapolation.py              # the full run -> benchmarks/results/text-extrapolation/
    python benchmarks/text_extrapolation.py --quick      # the same pipeline in seconds (numbers mean nothing)

Results (results.md, results.json, perplexity.png, passkey-*.png) are written to a temporary folder beside the
output folder and renamed into place when everything succeeded.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import resource
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPOSITORY))

from bam_llama.data.corpus import Document, corpus_statistics, python_documents, split_documents  # noqa: E402
from bam_llama.evaluation.passkey import PasskeyTemplate, random_passkey  # noqa: E402
from bam_llama.outputs import staged_output_dir  # noqa: E402
from benchmarks.machine import cpu_model  # noqa: E402

MODELS = {  # name: (bam-pretrain --positional, --ssmax)
    "bam": ("bam", False),
    "bam-ssmax": ("bam", True),
    "alibi": ("alibi", False),
    "nope": ("nope", False),
    "rope": ("rope", False),
    "rope-local": ("rope-local", False),
}
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
    hidden_size: int = 128
    layers: int = 4
    heads: int = 4
    steps: int = 2000
    batch_size: int = 16
    learning_rate: float = 1e-3
    warmup_steps: int = 100
    vocab_size: int = 4096
    passkey_share: float = 0.5  # passkey documents' share of the training characters
    prior_scope: str = "layer"  # BamLlama models: one prior per layer and head
    heldout_fraction: float = 0.05
    max_train_characters: int | None = None  # None: the whole training split
    perplexity_documents: int = 8  # at most: held-out files with at least the longest length of tokens
    num_depths: int = 20
    seed: int = 0
    threads: int | None = None  # torch threads; None: PyTorch's default (one per core)
    models: tuple[str, ...] = tuple(MODELS)  # which of MODELS to train (rope brings its two extensions)

    @property
    def lengths(self) -> list[int]:
        return [self.train_length * scale for scale in self.scales]


QUICK = Recipe(
    train_length=32, scales=(1, 2, 4), hidden_size=32, layers=2, heads=4, steps=15, batch_size=4, learning_rate=3e-3,
    warmup_steps=0, vocab_size=1000, max_train_characters=20_000, perplexity_documents=2,
    num_depths=2, threads=1,
)


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
    the longest document must fit in one training row (split over two, its answer would lose its key)."""
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
            f"training length {train_length}: the tokenizer splits the pieces finer than {FILLER_TOKENS} tokens a filler"
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


def training_texts(train: list[Document], recipe: Recipe) -> list[str]:
    """The training split (cut to `max_train_characters`) with passkey documents mixed in at random places, so that
    they make `passkey_share` of the characters."""
    rng = random.Random(recipe.seed)
    texts = [document.text for document in first_documents(train, recipe.max_train_characters)]
    characters = sum(map(len, texts))
    max_fillers = max_passkey_fillers(recipe.train_length)
    passkey_characters = recipe.passkey_share / (1 - recipe.passkey_share) * characters
    while passkey_characters > 0:
        document = passkey_document(rng, max_fillers)
        texts.insert(rng.randint(0, len(texts)), document)
        passkey_characters -= len(document)
    return texts


def perplexity_documents(heldout: list[Document], tokenizer, recipe: Recipe) -> dict[str, list[int]]:
    """The first `perplexity_documents` held-out files (name order) with at least the longest evaluation length of
    tokens, each cut to that many tokens: every length is measured on these same tokens."""
    longest = max(recipe.lengths)
    documents = {}
    for document in heldout:
        tokens = tokenizer(document.text, add_special_tokens=False)["input_ids"]
        if len(tokens) >= longest:
            documents[document.name] = tokens[:longest]
        if len(documents) == recipe.perplexity_documents:
            break
    if not documents:
        raise ValueError(f"no held-out file has {longest} tokens: evaluate shorter lengths or hold out more files")
    return documents


# ------------------------------------------------------------------------------------------------- models


def train(name: str, data: Path, tokenizer_dir: Path, work: Path, recipe: Recipe, **overrides):
    from bam_llama.training.pretrain import ROTARY_POSITIONALS, PretrainArguments, run_pretraining

    positional, ssmax = MODELS[name]
    args = PretrainArguments(
        data=str(data), output_dir=str(work / name), context_length=recipe.train_length, positional=positional,
        ssmax=ssmax, hidden_size=recipe.hidden_size, num_hidden_layers=recipe.layers,
        num_attention_heads=recipe.heads, tokenizer=str(tokenizer_dir), learning_rate=recipe.learning_rate,
        warmup_steps=recipe.warmup_steps, max_steps=recipe.steps, per_device_train_batch_size=recipe.batch_size,
        save_steps=max(recipe.steps, 1), save_total_limit=1, logging_steps=max(recipe.steps // 10, 1),
        seed=recipe.seed, disable_progress_bars=True, eval_rows=8,
        **({} if positional in ROTARY_POSITIONALS else {"prior_scope": recipe.prior_scope}), **overrides,
    )
    started = time.perf_counter()
    summary, _, _ = run_pretraining(args)
    return Path(summary.final_dir), {**asdict(summary), "train_seconds": time.perf_counter() - started}


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


def sequence_perplexity(model, tokenizer, documents: dict[str, list[int]], length: int, train_length: int) -> dict:
    """Each document cut into whole sequences of `length` tokens, each behind BOS (as a document starts in
    training) and run in one chunked forward. `perplexity`: exp of the mean loss over all their tokens (the paper's
    measure); `past_training_length`: the same over the positions past `train_length` only (None at 1x), where a
    positional encoding meets distances it never trained on."""
    import math

    from bam_llama.evaluation.perplexity import evaluate_perplexity

    whole, past = [], []
    for tokens in documents.values():
        result = evaluate_perplexity(
            model, tokenizer, tokens, [length], window=train_length, chunk_size=1024, max_sequences=None,
            add_bos=True, progress=False,
        )
        whole.append(math.log(result.perplexity[0]))
        past_windows = [math.log(value) for value in result.window_perplexity[0][1:]]  # windows of equal size
        past.append(sum(past_windows) / len(past_windows) if past_windows else None)

    def mean_exp(logs: list[float]) -> float:  # every document has the same number of tokens
        return math.exp(sum(logs) / len(logs))

    return {"perplexity": mean_exp(whole), "past_training_length": None if None in past else mean_exp(past)}


def evaluate(folder: Path, extension: str | None, documents: dict[str, list[int]], tokenizer, recipe: Recipe) -> dict:
    """Whole-sequence perplexity and passkey accuracy per length (a RoPE extension is set per length)."""
    from bam_llama.evaluation.passkey import evaluate_passkey

    perplexity, passkey = {}, {}
    model = None
    for length in recipe.lengths:
        if model is None or extension is not None:
            model = load(folder, extension, length, recipe.train_length)
        perplexity[length] = {
            **sequence_perplexity(model, tokenizer, documents, length, recipe.train_length),
            "sequences": len(documents) * (max(recipe.lengths) // length),
        }
        keys = evaluate_passkey(
            model, tokenizer, [length], num_depths=recipe.num_depths, seed=recipe.seed, template=TEXT_TEMPLATE,
            add_bos=True, progress=False,
        )
        passkey[length] = keys.to_dict()
    return {"perplexity": perplexity, "passkey": passkey}


# ------------------------------------------------------------------------------------------------- report


def accuracy(passkey_result: dict) -> float:
    correct = [flag for row in passkey_result["correct"] for flag in row]
    return sum(correct) / len(correct)


def progress_line(name: str, result: dict, recipe: Recipe, started: float) -> str:
    """One model's perplexity and passkey rows as soon as it is evaluated (a long run shows where it stands)."""
    perplexity = " ".join(f"{result['perplexity'][length]['perplexity']:.2f}" for length in recipe.lengths)
    passkey = " ".join(f"{accuracy(result['passkey'][length]):.0%}" for length in recipe.lengths)
    return f"[{(time.perf_counter() - started) / 60:.1f} min] {name}: perplexity {perplexity} | passkey {passkey}"


def tables(results: dict, recipe: Recipe) -> str:
    def table(lengths: list[int], cell) -> str:
        """A Markdown table: a row per model, a column per length, `cell(result, length)` in each."""
        header = "| model | " + " | ".join(f"{length} ({length // recipe.train_length}x)" for length in lengths) + " |"
        rows = [f"| {name} | " + " | ".join(cell(result, length) for length in lengths) + " |" for name, result in results.items()]
        return "\n".join([header, "|---|" + "---:|" * len(lengths), *rows])

    perplexity = table(recipe.lengths, lambda result, length: f"{result['perplexity'][length]['perplexity']:.2f}")
    past = table(recipe.lengths[1:], lambda result, length: f"{result['perplexity'][length]['past_training_length']:.2f}")
    passkey = table(recipe.lengths, lambda result, length: f"{accuracy(result['passkey'][length]):.0%}")
    return (
        f"Held-out perplexity (whole sequences)\n\n{perplexity}\n\n"
        f"Held-out perplexity of the positions past the training length ({recipe.train_length}) only\n\n{past}\n\n"
        f"Passkey retrieval\n\n{passkey}\n"
    )


def target_lines(results: dict, recipe: Recipe) -> list[str]:
    """The issue's targets, each met or missed with its numbers (only those whose lengths were evaluated)."""
    length = {scale: recipe.train_length * scale for scale in recipe.scales}

    def perplexity(name: str, scale: int) -> float:
        return results[name]["perplexity"][length[scale]]["perplexity"]

    def passkey(name: str, scale: int) -> float:
        return accuracy(results[name]["passkey"][length[scale]])

    lines = []
    if {1, 64} <= set(length) and "bam" in results:
        ratio = perplexity("bam", 64) / perplexity("bam", 1)
        lines.append(f"BAM perplexity 64x / 1x = {ratio:.3f} (target <= 1.10): {'met' if ratio <= 1.10 else 'MISSED'}")
    if {1, 8} <= set(length):
        for name in [name for name in ("rope", "nope") if name in results]:
            ratio = perplexity(name, 8) / perplexity(name, 1)
            lines.append(f"{name} perplexity 8x / 1x = {ratio:.2f} (target >= 3): {'met' if ratio >= 3 else 'MISSED'}")
    for scale in (32, 64):
        if scale in length and {"bam", "alibi"} <= set(results):
            bam, alibi = passkey("bam", scale), passkey("alibi", scale)
            met = bam >= 0.9 and bam - alibi >= 0.3
            lines.append(f"passkey at {scale}x: BAM {bam:.0%}, ALiBi {alibi:.0%} (target BAM >= 90% and >= 30 points "
                         f"above ALiBi): {'met' if met else 'MISSED'}")
    return lines


def plot_perplexity(results: dict, recipe: Recipe, path: Path) -> None:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4.5))
    axes = figure.subplots()
    for name, result in results.items():
        axes.plot(recipe.lengths, [result["perplexity"][length]["perplexity"] for length in recipe.lengths], marker="o", label=name)
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.axvline(recipe.train_length, color="gray", linestyle="--", label=f"training length {recipe.train_length}")
    axes.set_xlabel("sequence length (tokens)")
    axes.set_ylabel("held-out perplexity")
    axes.set_title("Perplexity of whole held-out sequences, trained at %d tokens" % recipe.train_length)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def run(recipe: Recipe, output_dir: Path) -> dict:
    import torch
    import transformers

    from bam_llama.data.tokenizers import train_bpe_tokenizer
    from bam_llama.evaluation.passkey import PasskeyResults

    if recipe.threads is not None:
        torch.set_num_threads(recipe.threads)
    started = time.perf_counter()
    train_documents, heldout_documents = split_documents(python_documents(), recipe.heldout_fraction)
    texts = training_texts(train_documents, recipe)
    with tempfile.TemporaryDirectory(prefix="text-extrapolation-") as scratch:
        work = Path(scratch)
        data = work / "train.jsonl"
        data.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
        tokenizer = train_bpe_tokenizer(texts, recipe.vocab_size)
        tokenizer.save_pretrained(work / "tokenizer")
        check_passkey_documents(tokenizer, recipe.train_length)
        documents = perplexity_documents(heldout_documents, tokenizer, recipe)
        corpus = corpus_statistics(train_documents, heldout_documents, recipe.heldout_fraction)
        corpus["train_used"] = {"texts": len(texts), "characters": sum(map(len, texts))}
        corpus["perplexity_documents"] = {name: len(tokens) for name, tokens in documents.items()}
        training, results = {}, {}
        for name in recipe.models:
            folder, training[name] = train(name, data, work / "tokenizer", work, recipe)
            results[name] = evaluate(folder, None, documents, tokenizer, recipe)
            print(progress_line(name, results[name], recipe, started), flush=True)
            if name == "rope":
                for extension in ROPE_EXTENSIONS:
                    results[f"rope-{extension}"] = evaluate(folder, extension, documents, tokenizer, recipe)
                    print(progress_line(f"rope-{extension}", results[f"rope-{extension}"], recipe, started), flush=True)
        training = json.loads(json.dumps(training).replace(str(work), "<scratch>"))  # no local paths in results
        report = {
            "recipe": asdict(recipe),
            "corpus": corpus,
            "minutes": (time.perf_counter() - started) / 60,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "machine": {"platform": platform.platform(), "processor": cpu_model(), "threads": torch.get_num_threads(),
                        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__},
            "training": training,
            "results": results,
        }
        with staged_output_dir(output_dir, force=True) as staging:
            (staging / "results.json").write_text(json.dumps(report, indent=2) + "\n")
            summary = (
                f"Trained at {recipe.train_length} tokens for {recipe.steps} steps of {recipe.batch_size} rows; "
                f"each perplexity point averages the same {len(documents) * max(recipe.lengths)} tokens: the first "
                f"{max(recipe.lengths)} of each of {len(documents)} held-out files ({', '.join(documents)}), cut into "
                f"whole sequences of the length; passkey at {recipe.num_depths} depths per length. "
                f"{report['minutes']:.1f} min, peak RSS {report['peak_rss_mib']:.0f} MiB, "
                f"{report['machine']['threads']} threads, torch {torch.__version__}, transformers {transformers.__version__}.\n\n"
            )
            targets = "\n".join(f"- {line}" for line in target_lines(results, recipe))
            (staging / "results.md").write_text(summary + tables(results, recipe) + ("\nTargets\n\n" + targets + "\n" if targets else ""))
            plot_perplexity(results, recipe, staging / "perplexity.png")
            for name, result in results.items():
                rows = [result["passkey"][length] for length in recipe.lengths]
                merged = PasskeyResults.from_dict({**rows[0], **{key: [row[key][0] for row in rows] for key in
                                                   ("lengths", "correct", "prompt_lengths", "passkeys", "predictions")}})
                merged.save_heatmap(staging / f"passkey-{name}.png", title=f"{name}, trained at {recipe.train_length} tokens")
    print(summary + tables(results, recipe))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny models, few steps, 1x-4x: seconds (the numbers mean nothing)")
    parser.add_argument("--output-dir", type=Path, default=None,
                        help="default benchmarks/results/text-extrapolation (with --quick: text-extrapolation-quick)")
    parser.add_argument("--steps", type=int, default=None, help="override the recipe's training steps")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: PyTorch's; --quick: 1)")
    parser.add_argument("--models", default=None,
                        help=f"comma-separated subset of {','.join(MODELS)} (default: all; rope brings its extensions)")
    args = parser.parse_args(argv)
    recipe = QUICK if args.quick else Recipe()
    if args.steps is not None:
        if args.steps <= 0:
            parser.error(f"--steps must be positive, got {args.steps}")
        recipe = replace(recipe, steps=args.steps)
    if args.threads is not None:
        if args.threads <= 0:
            parser.error(f"--threads must be positive, got {args.threads}")
        recipe = replace(recipe, threads=args.threads)
    if args.models is not None:
        models = tuple(name.strip() for name in args.models.split(","))
        unknown = [name for name in models if name not in MODELS]
        if unknown or len(set(models)) != len(models):
            parser.error(f"--models takes distinct names from {', '.join(MODELS)}, got {args.models!r}")
        recipe = replace(recipe, models=models)
    output_dir = args.output_dir or REPOSITORY / "benchmarks" / "results" / ("text-extrapolation-quick" if args.quick else "text-extrapolation")
    run(recipe, output_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
