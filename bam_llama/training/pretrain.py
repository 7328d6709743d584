"""Pretraining a model from a fresh config with `transformers.Trainer` (the `bam-pretrain` command).

The paper's evidence comes from models trained from scratch at a short length. This command trains one on the
same data sources as `bam-finetune` (`data.documents`), packed with per-document masking (`data.packing`), through the
same run as `bam-finetune` (`training.run`), with one recipe for every positional encoding of
`positional_variants` so that baselines compare:

* `bam`: BamLlama with the paper's init (uniform prior: theta_alpha = theta_beta = 0), alpha and beta trained,
  mu frozen; `--ssmax` adds Scalable Softmax (its order, scale's init and learning rate: `--ssmax-prior` /
  `--no-ssmax-prior`, `--ssmax-scale-init`, `--ssmax-learning-rate`); `--frozen-prior-from MODEL` gives it the
  prior MODEL learned instead, frozen (`training.frozen_prior`: the second stage of two);
* `alibi`: BamLlama with the prior fixed to ALiBi's slopes (theta_alpha = log slope, theta_beta = 1, frozen);
* `nope`: BamLlama with a flat prior, fixed (theta_beta = 0: the same bias at every distance, so no position);
* `rope`: Transformers' `LlamaForCausalLM` of the same sizes (RoPE base 500,000 as in the reference's baselines);
* `rope-local`: the paper's "RoPE local", Transformers' `MistralForCausalLM` (Llama's architecture with a sliding
  window) whose window is the training length: trained like `rope`, but at any length each query sees only the last
  context-length tokens, the distances it trained on;
* `sinusoidal`: `nope`'s BamLlama plus Vaswani et al.'s fixed sinusoidal position embedding added to the token
  embeddings (`absolute_positions="sinusoidal"`); with `--ssmax`, "Sinusoidal + SSMax".
* `rope` and `rope-local` with `--ssmax`: the same models with Scalable Softmax (`baselines.ssmax_models`: model types
  `llama_ssmax`, `mistral_ssmax`), its per-head scales starting at `--ssmax-scale-init` and trained at
  `--ssmax-learning-rate`, as BamLlama's.

Sizes: the paper's presets (`--preset l6 ... l24`: SwiGLU width 2x hidden, multi-head attention, untied output),
each field overridable by the size flags. Tokenizer: `byte` (built in), `bpe` (trained on the training documents
with the `tokenizers` library, digits one per token) or a tokenizer folder / Hub id.

Output folder: `checkpoint-N/` (Trainer), `tokenizer/` (a trained BPE), `model/` (the trained model with its
tokenizer and `train_context_length`, loadable with `AutoModelForCausalLM`) and `summary.json`. Final folders are
written to a temporary folder and renamed into place.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch
from transformers import AutoTokenizer, PretrainedConfig, PreTrainedModel, TrainingArguments
from transformers.integrations import get_available_reporting_integrations

from ..baselines.ssmax_models import SSMAX_ATTENTION
from ..data.documents import load_documents, looks_like_a_local_path, tokenize_documents
from ..data.tokenizers import build_byte_tokenizer, train_bpe_tokenizer
from ..files.outputs import staged_output_dir
from ..model.configuration_bam import PRIOR_SCOPES
from ..positional_models import variant_config, variant_model
from ..positional_variants import POSITIONAL_VARIANTS
from .arguments import PRESETS, REFERENCE_ROPE_THETA, PretrainArguments
from .frozen_prior import FROZEN_PRIOR, FROZEN_SSMAX, check_prior_source, set_frozen_prior
from .output_hold import OutputDirHold
from .run import TrainingCommand, TrainingData, packed_training_data, run_training
from .summary import TrainingSummary, format_rows, training_rows
from .trainer import training_arguments

BUILT_IN_TOKENIZERS = ("byte", "bpe")
LLAMA_ATTENTION = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")
SMALLEST_BPE_VOCABULARY = 3 + 256  # <pad>, <s>, </s> and every byte, as data.tokenizers builds it


def check_arguments(args: PretrainArguments) -> None:
    """A ValueError naming the first bad setting; reads no data and no weights."""
    if args.positional not in POSITIONAL_VARIANTS:
        raise ValueError(f"--positional must be one of {', '.join(POSITIONAL_VARIANTS)}, got {args.positional!r}")
    if args.preset is not None and args.preset not in PRESETS:
        raise ValueError(f"--preset must be one of {', '.join(PRESETS)}, got {args.preset!r}")
    variant = POSITIONAL_VARIANTS[args.positional]
    rotary = not variant.is_bam_llama
    if args.ssmax and not variant.takes_ssmax:
        raise ValueError(f"--ssmax: --positional {args.positional} has no model with Scalable Softmax")
    if args.ssmax_prior is not None and rotary:
        raise ValueError(f"--ssmax-prior orders SSMax with BAM's prior; --positional {args.positional} has no prior")
    for flag, value in (("--ssmax-prior", args.ssmax_prior), ("--ssmax-scale-init", args.ssmax_scale_init),
                        ("--ssmax-learning-rate", args.ssmax_learning_rate)):
        if value is not None and not args.ssmax:
            raise ValueError(f"{flag} is a Scalable Softmax setting: add --ssmax")
    if args.ssmax_learning_rate is not None and not args.ssmax_learning_rate > 0:
        raise ValueError(f"--ssmax-learning-rate must be positive, got {args.ssmax_learning_rate}")
    if args.ssmax_scale_init is not None and not math.isfinite(args.ssmax_scale_init):
        raise ValueError(f"--ssmax-scale-init must be a finite number, got {args.ssmax_scale_init}")
    if args.prior_scope not in PRIOR_SCOPES:
        raise ValueError(f"--prior-scope must be one of {', '.join(PRIOR_SCOPES)}, got {args.prior_scope!r}")
    if args.prior_scope != "global" and rotary:
        raise ValueError(f"--prior-scope is a BamLlama option; --positional {args.positional} trains a Transformers model")
    if args.rope_theta is not None and not rotary:
        raise ValueError(f"--rope-theta is a RoPE option; --positional {args.positional} has no rotary embedding")
    if args.rope_theta is not None and not args.rope_theta > 0:
        raise ValueError(f"--rope-theta must be positive, got {args.rope_theta}")
    sizes = args.model_sizes()
    hidden, heads, kv_heads = sizes["hidden_size"], sizes["num_attention_heads"], sizes["num_key_value_heads"]
    if hidden % heads:
        raise ValueError(f"--hidden-size ({hidden}) must be divisible by --heads ({heads})")
    if heads % kv_heads:
        raise ValueError(f"--kv-heads ({kv_heads}) must divide --heads ({heads})")
    attention = SSMAX_ATTENTION if args.ssmax else LLAMA_ATTENTION
    if rotary and args.attn_implementation not in (None, *attention):
        raise ValueError(f"--attn-implementation {args.attn_implementation}: --positional {args.positional}"
                         f"{' --ssmax' if args.ssmax else ''} takes {', '.join(attention)}")
    if rotary and (hidden // heads) % 2:
        raise ValueError(f"RoPE needs an even head size; --hidden-size {hidden} / --heads {heads} = {hidden // heads}")
    check_tokenizer_choice(args.tokenizer)
    if args.tokenizer == "bpe" and args.vocab_size < SMALLEST_BPE_VOCABULARY:
        raise ValueError(f"--vocab-size {args.vocab_size}: a BPE needs at least {SMALLEST_BPE_VOCABULARY} tokens (3 special + 256 bytes)")
    check_report_to(args.report_to)
    check_frozen_prior_arguments(args)


def check_frozen_prior_arguments(args: PretrainArguments) -> None:
    """--frozen-prior-from needs a variant whose prior trains (bam, kerple) and a folder whose prior fits the fresh
    model; --frozen-ssmax needs both --frozen-prior-from and --ssmax."""
    if args.frozen_ssmax and (args.frozen_prior_from is None or not args.ssmax):
        raise ValueError("--frozen-ssmax takes the SSMax scales of --frozen-prior-from's model: give --frozen-prior-from and --ssmax")
    if args.frozen_prior_from is None:
        return
    learned = [name for name, variant in POSITIONAL_VARIANTS.items() if variant.prior_trains]
    if args.positional not in learned:
        raise ValueError(f"--frozen-prior-from gives a model the prior another one learned: --positional must be one "
                         f"of {', '.join(learned)}, got {args.positional}")
    try:
        no_tokens = dict.fromkeys(("bos_token_id", "eos_token_id", "pad_token_id"))  # no tokenizer yet: the prior's fields only
        check_prior_source(args.frozen_prior_from, build_config(args, 1, no_tokens), with_ssmax=args.frozen_ssmax)
    except ValueError as error:
        raise ValueError(f"--frozen-prior-from {error}") from None


def check_tokenizer_choice(choice: str) -> None:
    if choice in BUILT_IN_TOKENIZERS:
        return
    path = Path(choice).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(f"--tokenizer {choice}: not a folder (give a tokenizer folder, a Hub id, byte or bpe)")
    if looks_like_a_local_path(choice) and not path.exists():
        raise ValueError(f"--tokenizer {choice}: the folder does not exist (or use byte or bpe)")


def check_report_to(report_to: str) -> None:
    """Every name in the comma-separated `--report-to` is an installed Transformers integration ('none', 'all')."""
    names = [name.strip() for name in report_to.split(",") if name.strip()]
    if names in (["none"], ["all"]):
        return
    available = get_available_reporting_integrations()
    for name in names:
        if name in ("none", "all") or name not in available:
            raise ValueError(
                f"--report-to {name}: not an installed reporting integration (installed: "
                f"{', '.join(available) or 'none'}; or none / all)"
            )


def report_to_value(report_to: str) -> str | list[str]:
    names = [name.strip() for name in report_to.split(",") if name.strip()]
    return names[0] if len(names) == 1 else names


@dataclasses.dataclass
class PretrainSummary(TrainingSummary):
    positional: str
    ssmax: bool
    sizes: dict[str, int]
    parameters: int
    tokenizer: str
    vocab_size: int
    frozen_prior_from: str | None  # the saved model whose prior this one took, frozen
    frozen_ssmax: bool = False  # its SSMax scales too

    def format_table(self) -> str:
        rows = [
            ("model", f"{self.positional}{' + SSMax' if self.ssmax else ''}, {self.parameters:,} parameters, "
             + ", ".join(f"{name} {value}" for name, value in self.sizes.items())),
            *([("prior", f"frozen{' with the SSMax scales' if self.frozen_ssmax else ''}, from {self.frozen_prior_from}")]
              if self.frozen_prior_from else []),
            ("tokenizer", f"{self.tokenizer} ({self.vocab_size} tokens)"),
            ("context length", str(self.context_length)),
            *training_rows(self),
            ("saved", self.final_dir),
        ]
        return format_rows("bam-pretrain summary", rows)


# --------------------------------------------------------------------------------------------------------
# Tokenizer and model
# --------------------------------------------------------------------------------------------------------


def named_tokenizer(choice: str):
    """`--tokenizer byte` or a tokenizer folder / Hub id; loaded before any data, so a bad one stops the run early."""
    if choice == "byte":
        return build_byte_tokenizer()
    try:
        return AutoTokenizer.from_pretrained(choice)
    except (OSError, ValueError) as error:
        raise ValueError(f"--tokenizer {choice}: cannot load a tokenizer ({error})") from error


def bpe_tokenizer(args: PretrainArguments, documents: list[str], checkpoint: str | None, is_main: bool):
    """A BPE trained on the training documents by the main process and saved in OUTPUT_DIR/tokenizer, where the
    other processes read it; a resumed run reads the checkpoint's own."""
    if checkpoint is not None:
        return AutoTokenizer.from_pretrained(checkpoint)
    folder = Path(args.output_dir) / "tokenizer"
    if not is_main:
        return AutoTokenizer.from_pretrained(folder)
    tokenizer = train_bpe_tokenizer(documents, args.vocab_size)
    with staged_output_dir(folder, force=True) as staging:
        tokenizer.save_pretrained(staging)
    return tokenizer


def special_token_ids(tokenizer) -> dict[str, int | None]:
    pad = next((token for token in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if token is not None))
    return {"pad_token_id": pad, "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}


def build_config(args: PretrainArguments, vocab_size: int, token_ids: dict[str, int | None]) -> PretrainedConfig:
    """A fresh config of the run's positional variant and sizes: BamLlamaConfig (bam, alibi, nope, kerple, t5,
    sinusoidal), LlamaConfig (rope) or MistralConfig (rope-local), or with --ssmax their `llama_ssmax` /
    `mistral_ssmax`."""
    fields = dict(vocab_size=vocab_size, tie_word_embeddings=False, **args.model_sizes(), **token_ids)
    if POSITIONAL_VARIANTS[args.positional].is_bam_llama:
        ssmax = {name: value for name, value in (("ssmax_prior", args.ssmax_prior), ("ssmax_scale_init", args.ssmax_scale_init))
                 if value is not None}
        fields.update(ssmax=args.ssmax, prior_scope=args.prior_scope, **ssmax)
        if args.frozen_prior_from is not None:
            fields.update(FROZEN_PRIOR, **(FROZEN_SSMAX if args.frozen_ssmax else {}))
    else:
        rope = {"rope_type": "default", "rope_theta": args.rope_theta or REFERENCE_ROPE_THETA}
        fields.update(max_position_embeddings=args.context_length, rope_parameters=rope)
        if args.ssmax:
            fields.update(ssmax=True, **({} if args.ssmax_scale_init is None else {"ssmax_scale_init": args.ssmax_scale_init}))
    return variant_config(args.positional, args.context_length, **fields)


def build_model(args: PretrainArguments, config: PretrainedConfig) -> PreTrainedModel:
    """In float32, with the asked attention (Transformers' models: sdpa by default)."""
    default_attention = None if POSITIONAL_VARIANTS[args.positional].is_bam_llama else "sdpa"
    model = variant_model(config, attn_implementation=args.attn_implementation or default_attention, dtype=torch.float32)
    if args.frozen_prior_from is not None:
        set_frozen_prior(model, args.frozen_prior_from, with_ssmax=args.frozen_ssmax)
    model.config.use_cache = False  # no cache while training; restored before saving
    return model


# --------------------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------------------


def save_final(model, tokenizer, args: PretrainArguments, state_dict: dict | None = None) -> str:
    """Rank 0 only. state_dict: the gathered one of a sharded model (FSDP, ZeRO-3)."""
    final_dir = Path(args.output_dir) / "model"
    model.config.use_cache = True
    model.config.train_context_length = args.context_length
    with staged_output_dir(final_dir, force=True) as staging:
        model.save_pretrained(staging, state_dict=state_dict)
        tokenizer.save_pretrained(staging)
    return str(final_dir)


# --------------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------------


class Pretraining(TrainingCommand):
    """`bam-pretrain`'s part of the run: a tokenizer (a BPE trained on the data where asked), a fresh model of the
    positional variant, and the model folder."""

    name = "bam-pretrain"
    # What a run leaves in its output folder: a new run does not write over it unless it resumes that run or is told
    # to (--overwrite-output-dir), and two live runs never share the folder (see `training/output_hold.py`). The BPE in
    # tokenizer/ is written before training: a run stopped before its first checkpoint leaves only it, and the
    # same command run again replaces it.
    results = ("checkpoint-*", "model", "summary.json")
    prepared = ("tokenizer",)
    summary_class = PretrainSummary

    def check_arguments(self) -> None:
        check_arguments(self.args)

    def training_arguments(self) -> TrainingArguments:
        return training_arguments(self.args, report_to=report_to_value(self.args.report_to))

    def load_data(self, checkpoint: str | None, training_args: TrainingArguments, hold: OutputDirHold,
                  show_progress: bool) -> TrainingData:
        args = self.args
        tokenizer = None if args.tokenizer == "bpe" else named_tokenizer(args.tokenizer)
        documents = load_documents(args.data, args.text_field, args.dataset_split, args.dataset_config)
        hold.clear_earlier_results()  # --overwrite-output-dir: only once the data loaded, before the tokenizer is written
        if tokenizer is None:
            with training_args.main_process_first(desc="tokenizer"):
                tokenizer = bpe_tokenizer(args, documents, checkpoint, training_args.process_index == 0)
        pad_token_id = special_token_ids(tokenizer)["pad_token_id"]
        tokenized = tokenize_documents(documents, tokenizer, show_progress)
        return packed_training_data(tokenizer, tokenized, args.context_length, pad_token_id, args.eval_rows)

    def build_model(self, data: TrainingData) -> PreTrainedModel:
        model = build_model(self.args, build_config(self.args, len(data.tokenizer), special_token_ids(data.tokenizer)))
        self.parameters = sum(parameter.numel() for parameter in model.parameters())
        return model

    def description(self) -> str:
        return f"pretraining {self.args.positional} ({self.parameters} parameters)"

    def learning_rates(self) -> dict[str, float | None]:
        return {"prior_learning_rate": self.args.resolved_prior_learning_rate,
                "ssmax_learning_rate": self.args.ssmax_learning_rate}

    def final_folders(self) -> dict[str, str | None]:
        return {"final_dir": str(Path(self.args.output_dir) / "model")}

    def save(self, model: PreTrainedModel, tokenizer, state_dict: dict | None) -> dict[str, str | None]:
        return {"final_dir": save_final(model, tokenizer, self.args, state_dict)}

    def summary_fields(self, data: TrainingData, model: PreTrainedModel, state_dict: dict | None,
                       reads_weights: bool) -> dict:
        args = self.args
        return dict(positional=args.positional, ssmax=args.ssmax, sizes=args.model_sizes(), parameters=self.parameters,
                    tokenizer=args.tokenizer, vocab_size=len(data.tokenizer), frozen_prior_from=args.frozen_prior_from,
                    frozen_ssmax=args.frozen_ssmax)


def pretrain(args: PretrainArguments) -> PretrainSummary:
    """Train a fresh model on `args.data` at `args.context_length`; returns (and on rank 0 writes and prints) the
    summary. Every argument is checked before any data loads."""
    summary, _, _ = run_pretraining(args)
    return summary


def run_pretraining(args: PretrainArguments):
    """`pretrain`, also returning the trained model and its tokenizer: (summary, model, tokenizer)."""
    return run_training(Pretraining(args))
