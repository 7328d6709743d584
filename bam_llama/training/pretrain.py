"""Pretraining a model from a fresh config with `transformers.Trainer` (the `bam-pretrain` command).

The paper's evidence comes from models trained from scratch at a short length. This command trains one on the
same data sources as `bam-finetune` (`data.documents`), packed with per-document masking (`data.packing`), through the
same Trainer set-up (`training.trainer`), with one recipe for every positional encoding so that baselines compare:

* `bam`: BamLlama with the paper's init (uniform prior: theta_alpha = theta_beta = 0), alpha and beta trained,
  mu frozen; `--ssmax` adds Scalable Softmax (its order, scale's init and learning rate: `--ssmax-prior` /
  `--no-ssmax-prior`, `--ssmax-scale-init`, `--ssmax-learning-rate`);
* `alibi`: BamLlama with the prior fixed to ALiBi's slopes (theta_alpha = log slope, theta_beta = 1, frozen);
* `nope`: BamLlama with a flat prior, fixed (theta_beta = 0: the same bias at every distance, so no position);
* `rope`: Transformers' `LlamaForCausalLM` of the same sizes (RoPE base 500,000 as in the reference's baselines);
* `rope-local`: the paper's "RoPE local", Transformers' `MistralForCausalLM` (Llama's architecture with a sliding
  window) whose window is the training length: trained like `rope`, but at any length each query sees only the last
  context-length tokens, the distances it trained on.

Sizes: the paper's presets (`--preset l6 ... l24`: SwiGLU width 2x hidden, multi-head attention, untied output),
each field overridable by the size flags. Tokenizer: `byte` (built in), `bpe` (trained on the training documents
with the `tokenizers` library, digits one per token) or a tokenizer folder / Hub id.

Output folder: `checkpoint-N/` (Trainer), `tokenizer/` (a trained BPE), `model/` (the trained model with its
tokenizer and `train_context_length`, loadable with `AutoModelForCausalLM`) and `summary.json`. Final folders are
written to a temporary folder and renamed into place.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from pathlib import Path

from ..data.documents import load_documents, looks_like_a_local_path, tokenize_documents
from ..data.packing import PackedRows, collate_packed_rows, pack_documents, packing_fill, split_eval_rows
from ..model_folders import check_finite_weights
from ..outputs import staged_output_dir
from .arguments import (
    POSITIONALS,
    PRESETS,
    PRIOR_SCOPES,
    REFERENCE_ROPE_THETA,
    ROTARY_POSITIONALS,
    PretrainArguments,
)
from .checkpoints import checkpoint_step, resolve_checkpoint
from .lock import OutputDirHold, hold_output_dir, resumes_in
from .summary import TrainingSummary, format_rows, training_rows, write_summary

logger = logging.getLogger(__name__)

BUILT_IN_TOKENIZERS = ("byte", "bpe")
LLAMA_ATTENTION = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")
SMALLEST_BPE_VOCABULARY = 3 + 256  # <pad>, <s>, </s> and every byte, as data.tokenizers builds it


def check_arguments(args: PretrainArguments) -> None:
    """A ValueError naming the first bad setting; reads no data and no weights."""
    if args.positional not in POSITIONALS:
        raise ValueError(f"--positional must be one of {', '.join(POSITIONALS)}, got {args.positional!r}")
    if args.preset is not None and args.preset not in PRESETS:
        raise ValueError(f"--preset must be one of {', '.join(PRESETS)}, got {args.preset!r}")
    rotary = args.positional in ROTARY_POSITIONALS
    if args.ssmax and rotary:
        raise ValueError(f"--ssmax is a BamLlama option; --positional {args.positional} trains a Transformers model")
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
    if rotary and args.attn_implementation not in (None, *LLAMA_ATTENTION):
        raise ValueError(f"--attn-implementation {args.attn_implementation}: --positional {args.positional} takes {', '.join(LLAMA_ATTENTION)}")
    if rotary and (hidden // heads) % 2:
        raise ValueError(f"RoPE needs an even head size; --hidden-size {hidden} / --heads {heads} = {hidden // heads}")
    check_tokenizer_choice(args.tokenizer)
    if args.tokenizer == "bpe" and args.vocab_size < SMALLEST_BPE_VOCABULARY:
        raise ValueError(f"--vocab-size {args.vocab_size}: a BPE needs at least {SMALLEST_BPE_VOCABULARY} tokens (3 special + 256 bytes)")
    check_report_to(args.report_to)


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
    from transformers.integrations import get_available_reporting_integrations

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

    def format_table(self) -> str:
        rows = [
            ("model", f"{self.positional}{' + SSMax' if self.ssmax else ''}, {self.parameters:,} parameters, "
             + ", ".join(f"{name} {value}" for name, value in self.sizes.items())),
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
    from transformers import AutoTokenizer

    from ..data.tokenizers import build_byte_tokenizer

    if choice == "byte":
        return build_byte_tokenizer()
    try:
        return AutoTokenizer.from_pretrained(choice)
    except (OSError, ValueError) as error:
        raise ValueError(f"--tokenizer {choice}: cannot load a tokenizer ({error})") from error


def bpe_tokenizer(args: PretrainArguments, documents: list[str], checkpoint: str | None, is_main: bool):
    """A BPE trained on the training documents by the main process and saved in OUTPUT_DIR/tokenizer, where the
    other processes read it; a resumed run reads the checkpoint's own."""
    from transformers import AutoTokenizer

    from ..data.tokenizers import train_bpe_tokenizer

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


def build_config(args: PretrainArguments, vocab_size: int, token_ids: dict[str, int | None]):
    """A fresh BamLlamaConfig (bam, alibi, nope), LlamaConfig (rope) or MistralConfig (rope-local) of the run's
    sizes."""
    common = dict(vocab_size=vocab_size, tie_word_embeddings=False, **args.model_sizes(), **token_ids)
    if args.positional in ROTARY_POSITIONALS:
        rotary = dict(
            max_position_embeddings=args.context_length,
            rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta or REFERENCE_ROPE_THETA}, **common,
        )
        if args.positional == "rope":
            from transformers import LlamaConfig

            config = LlamaConfig(attention_bias=False, mlp_bias=False, **rotary)
        else:  # the paper's "RoPE local": each query sees the last context-length tokens, at any length
            from transformers import MistralConfig

            config = MistralConfig(sliding_window=args.context_length, **rotary)
        config.train_context_length = args.context_length
        return config
    from ..model.configuration_bam import BamLlamaConfig

    prior = {
        "bam": dict(theta_alpha_init=0.0, theta_beta_init=0.0, train_theta_alpha=True, train_theta_beta=True),
        "alibi": dict(theta_alpha_init="alibi", theta_beta_init=1.0, train_theta_alpha=False, train_theta_beta=False),
        "nope": dict(theta_alpha_init=0.0, theta_beta_init=0.0, train_theta_alpha=False, train_theta_beta=False),
    }[args.positional]
    ssmax = {name: value for name, value in (("ssmax_prior", args.ssmax_prior), ("ssmax_scale_init", args.ssmax_scale_init))
             if value is not None}
    return BamLlamaConfig(
        train_context_length=args.context_length, theta_mu_init=0.0, train_theta_mu=False, ssmax=args.ssmax,
        prior_scope=args.prior_scope, **prior, **ssmax, **common
    )


def build_model(args: PretrainArguments, config):
    import torch

    if args.positional in ROTARY_POSITIONALS:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(config, attn_implementation=args.attn_implementation or "sdpa", dtype=torch.float32)
    else:
        from ..model.modeling_bam import BamLlamaForCausalLM

        model = BamLlamaForCausalLM._from_config(config, attn_implementation=args.attn_implementation, dtype=torch.float32)
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
# Entry points
# --------------------------------------------------------------------------------------------------------


def pretrain(args: PretrainArguments) -> PretrainSummary:
    """Train a fresh model on `args.data` at `args.context_length`; returns (and on rank 0 writes and prints) the
    summary. Every argument is checked before any data loads."""
    summary, _, _ = run_pretraining(args)
    return summary


# What a run leaves in its output folder: a new run does not write over it unless it resumes that run or is told to
# (--overwrite-output-dir), and two live runs never share the folder (see `training.lock`).
PRETRAIN_RESULTS = ("checkpoint-*", "tokenizer", "model", "summary.json")


def run_pretraining(args: PretrainArguments):
    """`pretrain`, also returning the trained model and its tokenizer: (summary, model, tokenizer)."""
    started = time.perf_counter()
    check_arguments(args)
    continuing = resumes_in(args.output_dir, args.resume_from_checkpoint)
    with hold_output_dir(args.output_dir, "bam-pretrain", PRETRAIN_RESULTS, continuing, args.overwrite_output_dir) as hold:
        return _run_pretraining(args, hold, started)


def _run_pretraining(args: PretrainArguments, hold: OutputDirHold, started: float):
    from transformers import set_seed

    from .distributed import gathered_state_dict, parameters_sharded
    from .trainer import BamTrainer, mean_token_loss, training_arguments

    checkpoint = resolve_checkpoint(args)
    if checkpoint is not None:
        check_finite_weights(checkpoint)
    resumed_from_step = 0 if checkpoint is None else checkpoint_step(checkpoint)
    training_args = training_arguments(args, report_to=report_to_value(args.report_to))
    is_main = training_args.process_index == 0
    show_progress = is_main and not args.disable_progress_bars

    tokenizer = None if args.tokenizer == "bpe" else named_tokenizer(args.tokenizer)
    documents = load_documents(args.data, args.text_field, args.dataset_split, args.dataset_config)
    hold.clear_earlier_results()  # --overwrite-output-dir: only once the data loaded, before the tokenizer is written
    if tokenizer is None:
        with training_args.main_process_first(desc="tokenizer"):
            tokenizer = bpe_tokenizer(args, documents, checkpoint, is_main)
    token_ids = special_token_ids(tokenizer)
    tokenized = tokenize_documents(documents, tokenizer, show_progress)
    rows = pack_documents(tokenized, args.context_length, token_ids["pad_token_id"])
    fill = packing_fill(tokenized, len(rows), args.context_length)
    del tokenized
    train_rows, eval_rows, eval_split = split_eval_rows(rows, args.eval_rows)

    set_seed(args.seed)
    config = build_config(args, len(tokenizer), token_ids)
    model = build_model(args, config)
    parameters = sum(parameter.numel() for parameter in model.parameters())
    if is_main:
        logger.info(
            "pretraining %s (%d parameters) at %d tokens: %d documents, %d train rows, %d %s eval rows",
            args.positional, parameters, args.context_length, len(documents), len(train_rows), len(eval_rows), eval_split,
        )
    trainer = BamTrainer(
        model=model,
        args=training_args,
        train_dataset=PackedRows(train_rows),
        data_collator=collate_packed_rows,
        processing_class=tokenizer,
        before_saving=hold.ensure_held,
        prior_learning_rate=args.resolved_prior_learning_rate,
        ssmax_learning_rate=args.ssmax_learning_rate,
    )
    evaluate = lambda: mean_token_loss(  # noqa: E731
        model, eval_rows, args.per_device_train_batch_size, training_args.device, training_args.bf16, show_progress
    )
    loss_before = evaluate() if is_main else math.nan
    train_output = trainer.train(resume_from_checkpoint=checkpoint)
    sharded = parameters_sharded(trainer)  # FSDP / ZeRO-3: forward and state dict need every rank
    loss_after = evaluate() if is_main or sharded else math.nan
    state_dict = gathered_state_dict(trainer)

    final_dir = str(Path(args.output_dir) / "model")
    if is_main:
        hold.ensure_held()
        final_dir = save_final(model, tokenizer, args, state_dict)
    summary = PretrainSummary(
        data=args.data,
        output_dir=args.output_dir,
        positional=args.positional,
        ssmax=args.ssmax,
        sizes=args.model_sizes(),
        parameters=parameters,
        tokenizer=args.tokenizer,
        vocab_size=len(tokenizer),
        context_length=args.context_length,
        documents=len(documents),
        train_rows=len(train_rows),
        eval_rows=len(eval_rows),
        eval_split=eval_split,
        **fill._asdict(),
        steps=trainer.state.global_step,
        resumed_from_step=resumed_from_step,
        tokens_seen=int(trainer.state.num_input_tokens_seen),
        train_loss=train_output.training_loss,
        loss_before=loss_before,
        loss_after=loss_after,
        world_size=training_args.world_size,
        runtime_seconds=time.perf_counter() - started,
        final_dir=final_dir,
    )
    if is_main:
        write_summary(summary, args.output_dir)
        print(summary.format_table(), flush=True)
    trainer.accelerator.wait_for_everyone()
    return summary, model, tokenizer
