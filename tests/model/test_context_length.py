"""The length a BamLlama declares it serves and is evaluated at: `max_position_embeddings`, which vLLM,
lm-evaluation-harness and `generate` read as the model's length, is by default 65,536 tokens, or the training
length where that is longer (one rule for the config and for what `bam-pretrain`, `bam-finetune`, `bam-convert` and
`bam-demo` save); never the 2^20 ("no limit") of earlier releases, which sent lm-eval's batch-size probe through
million-token rows. Each tool's reading of a config is written here from its source, and checked beside a Llama that
declares the same length."""

import json
import logging

import pytest
import torch
from helpers import tiny_llama, tiny_model
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from bam_llama import BamLlamaConfig
from bam_llama.data.tokenizers import BYTE_VOCAB_SIZE, build_byte_tokenizer

TRAIN_LENGTH = 16
DECLARED = 65536  # the documented default: 64K tokens, or the training length where longer


def expected_length(train_context_length: int) -> int:
    return max(train_context_length, DECLARED)


# ------------------------------------------------------------------------------------------------- the rule


def test_a_config_declares_64k_or_its_training_length():
    assert BamLlamaConfig().max_position_embeddings == DECLARED  # trained at 512
    assert BamLlamaConfig(train_context_length=TRAIN_LENGTH).max_position_embeddings == DECLARED
    assert BamLlamaConfig(train_context_length=131072).max_position_embeddings == 131072
    assert BamLlamaConfig(train_context_length=64, max_position_embeddings=4096).max_position_embeddings == 4096


def test_a_saved_config_keeps_its_declared_length(tmp_path):
    tiny_model("sdpa", train_context_length=TRAIN_LENGTH).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["max_position_embeddings"] == DECLARED
    assert AutoConfig.from_pretrained(tmp_path).max_position_embeddings == DECLARED
    explicit = tiny_model("sdpa", train_context_length=TRAIN_LENGTH, max_position_embeddings=TRAIN_LENGTH)
    explicit.save_pretrained(tmp_path / "explicit")  # as saved by the release before: the training length
    assert AutoConfig.from_pretrained(tmp_path / "explicit").max_position_embeddings == TRAIN_LENGTH


def test_a_folder_of_an_earlier_release_reads_its_no_limit_as_the_default(tmp_path):
    model = tiny_model("sdpa", train_context_length=TRAIN_LENGTH)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1 << 20}))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.max_position_embeddings == DECLARED
    input_ids = torch.randint(3, 97, (1, 9))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids).logits, model(input_ids).logits)


@pytest.mark.parametrize("declared", [(1 << 20) - 1, (1 << 20) + 1, 1 << 21])
def test_a_declared_length_beside_the_old_no_limit_is_read_as_saved(tmp_path, declared):
    """Only 2**20 itself meant "no limit": a config declaring a length next to it, or past it, keeps its length."""
    tiny_model("sdpa", train_context_length=TRAIN_LENGTH, max_position_embeddings=declared).config.save_pretrained(tmp_path)
    assert AutoConfig.from_pretrained(tmp_path).max_position_embeddings == declared


def test_every_command_saves_the_same_rule(tmp_path):
    """What bam-pretrain, bam-finetune (context extension), bam-convert (Llama and reference runs) and bam-demo
    build their saved config with."""
    from bam_llama.conversion.llama import convert_llama_checkpoint
    from bam_llama.conversion.reference import reference_config
    from bam_llama.demo.pipeline import build_model
    from bam_llama.demo.settings import ModelSize
    from bam_llama.training.arguments import FinetuneArguments, PretrainArguments
    from bam_llama.training.finetune import record_extension
    from bam_llama.training.pretrain import build_config

    sizes = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
    pretrained = build_config(PretrainArguments(data="d", output_dir="o", context_length=256, **sizes), 97, {})
    assert pretrained.max_position_embeddings == expected_length(256)

    demo = build_model("bam", ModelSize(**sizes), 128).config
    assert demo.train_context_length == 128 and demo.max_position_embeddings == expected_length(128)

    for base, target in ((pretrained, 4096), (BamLlamaConfig(train_context_length=65536), 131072)):
        record_extension(base, FinetuneArguments(model="m", data="d", output_dir="o", context_length=target))
        assert base.train_context_length == target and base.max_position_embeddings == expected_length(target)

    model_args = dict(vocab_size=97, dim=32, n_layers=2, n_heads=4, max_seq_len=384)
    reference = reference_config({"model_args": model_args, "args": {"sequence_length": 256}}, "bam", "global", "current")
    assert reference.train_context_length == 256 and reference.max_position_embeddings == expected_length(256)

    llama_dir = tmp_path / "llama"
    llama_config = dict(vocab_size=61, num_key_value_heads=2, intermediate_size=48, max_position_embeddings=2048, **sizes)
    LlamaForCausalLM(LlamaConfig(**llama_config)).save_pretrained(llama_dir)
    converted = convert_llama_checkpoint(llama_dir, tmp_path / "bam", prior="alibi", verbose=False)
    config = json.loads((converted / "config.json").read_text())
    assert config["train_context_length"] == 2048 and config["max_position_embeddings"] == expected_length(2048)


# ------------------------------------------------------------------------------------------------- vLLM


def vllm_derived_max_model_len(config: dict, tokenizer_config: dict) -> tuple[int, str]:
    """vLLM 0.32's reading of a config.json without RoPE (vllm/transformers_utils/model_arch_config_convertor.py,
    `derive_max_model_len_and_key`, and vllm/config/model.py, `_get_and_verify_max_len`): the smallest of these keys
    present, unless `model_max_length` is (then it alone), capped by the tokenizer_config's `model_max_length`."""
    keys = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
            "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")
    found = {key: config[key] for key in keys if config.get(key) is not None}
    key = "model_max_length" if config.get("model_max_length") else min(found, key=found.get, default=None)
    derived = found[key] if key else 2048  # vLLM assumes 2048 (and warns) where no key is present
    return min(derived, tokenizer_config.get("model_max_length", derived)), key


def vllm_max_model_len(config: dict, tokenizer_config: dict, asked: int | None) -> int:
    """`_get_and_verify_max_len`: the derived length by default; a longer `--max-model-len` is refused unless the
    config's own `model_max_length` allows it (or VLLM_ALLOW_LONG_MAX_MODEL_LEN=1, "use with extreme caution")."""
    derived, key = vllm_derived_max_model_len(config, tokenizer_config)
    if asked is None:
        return derived
    if asked > derived and (config.get("model_max_length") is None or asked > config["model_max_length"]):
        raise ValueError(f"User-specified max_model_len ({asked}) is greater than the derived max_model_len ({key}={derived})")
    return asked


def saved_configs(folder) -> tuple[dict, dict]:
    return tuple(json.loads((folder / name).read_text()) for name in ("config.json", "tokenizer_config.json"))


def test_vllm_serves_up_to_the_declared_length_without_overrides_like_llama(tmp_path):
    """`vllm serve FOLDER --max-model-len N`: accepted for every N up to the declared length, refused past it, as
    for a same-size Llama declaring that length. (`tests_vllm/test_vllm_max_model_len.py` runs vLLM's own code.)"""
    folders = {"bam": tmp_path / "bam", "llama": tmp_path / "llama"}
    tiny_model("sdpa", train_context_length=TRAIN_LENGTH, vocab_size=BYTE_VOCAB_SIZE).save_pretrained(folders["bam"])
    llama_declaring(DECLARED, vocab_size=BYTE_VOCAB_SIZE).save_pretrained(folders["llama"])
    for folder in folders.values():
        build_byte_tokenizer().save_pretrained(folder)
        config, tokenizer_config = saved_configs(folder)
        assert vllm_derived_max_model_len(config, tokenizer_config) == (DECLARED, "max_position_embeddings")
        assert vllm_max_model_len(config, tokenizer_config, None) == DECLARED
        for asked in (TRAIN_LENGTH, 4 * TRAIN_LENGTH, 32768, DECLARED):
            assert vllm_max_model_len(config, tokenizer_config, asked) == asked
        with pytest.raises(ValueError, match="greater than the derived max_model_len"):
            vllm_max_model_len(config, tokenizer_config, DECLARED + 1)


# ------------------------------------------------------------------------------------------------- generate


class Recorded(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def generation_reminders(model, prompt_length: int, new_tokens: int) -> list[str]:
    """The "maximum length" reminders of one greedy `generate` (Transformers' loggers do not propagate to pytest's
    caplog: a handler of its own on the stopping criteria's logger)."""
    from transformers.generation import stopping_criteria

    stopping_criteria.logger.warning_once.cache_clear()  # it warns once a process
    recorded = Recorded()
    stopping_criteria.logger.addHandler(recorded)
    try:
        model.generate(torch.randint(3, 97, (1, prompt_length)), max_new_tokens=new_tokens, do_sample=False,
                       eos_token_id=None, pad_token_id=0)
    finally:
        stopping_criteria.logger.removeHandler(recorded)
    return [message for message in recorded.messages if "predefined maximum length" in message]


def llama_declaring(length: int, **overrides) -> LlamaForCausalLM:
    llama = tiny_llama(**overrides)
    llama.config.max_position_embeddings = length
    return llama


def test_generating_within_the_declared_length_prints_no_reminder_and_past_it_runs():
    """Transformers' MaxLengthCriteria warns once ("This is a friendly reminder - the current text generation call
    has exceeded the model's predefined maximum length") when a sequence grows past max_position_embeddings. A
    model trained at 16 tokens generates 40 without it; one declaring 16 gets it, like a Llama declaring 16, and its
    tokens are still those of full forward passes."""
    model = tiny_model("sdpa", ssmax=True, train_context_length=TRAIN_LENGTH)
    assert generation_reminders(model, 12, 28) == []

    declared_16 = tiny_model("sdpa", ssmax=True, train_context_length=TRAIN_LENGTH, max_position_embeddings=TRAIN_LENGTH)
    for peer in (declared_16, llama_declaring(TRAIN_LENGTH)):
        (reminder,) = generation_reminders(peer, 12, 10)
        assert f"maximum length ({TRAIN_LENGTH})" in reminder

    prompt = torch.randint(3, 97, (1, 12))
    generated = declared_16.generate(prompt, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    sequence = prompt
    with torch.no_grad():
        for _ in range(10):
            next_token = declared_16(sequence, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            sequence = torch.cat([sequence, next_token], dim=1)
    assert generated.shape[1] == 22 > declared_16.config.max_position_embeddings
    assert torch.equal(generated, sequence)


# ------------------------------------------------------------------------------------------------- lm-eval


def lm_eval_model(folder, model, **options):
    """lm-evaluation-harness' HFLM (a dev-time tool, not a dependency: skipped where not installed) over a saved
    folder with the byte tokenizer; each forward's row length recorded."""
    lm_eval_huggingface = pytest.importorskip("lm_eval.models.huggingface")
    model.save_pretrained(folder)
    build_byte_tokenizer().save_pretrained(folder)
    lm = lm_eval_huggingface.HFLM(pretrained=str(folder), device="cpu", **options)
    rows = []
    lm.model.register_forward_pre_hook(
        lambda module, args, kwargs: rows.append((args[0] if args else kwargs["input_ids"]).shape), with_kwargs=True
    )
    return lm, rows


def own_log_likelihood(model, ids: list[int], continuation_length: int) -> float:
    with torch.no_grad():
        log_probs = model(torch.tensor([ids]), use_cache=False).logits[0, :-1].float().log_softmax(-1)
    picked = log_probs.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    return float(picked[-continuation_length:].sum())


def test_lm_eval_reads_the_declared_length_and_keeps_long_contexts_whole(tmp_path):
    """A model trained at 16 tokens: lm-eval's window is the declared 65,536 tokens, so a 200-token context is read
    whole (it was cut to the last 16 when the config declared the training length), and `batch_size="auto"` on a
    log-likelihood task probes rows of the longest request, not of the window."""
    Instance = pytest.importorskip("lm_eval.api.instance").Instance  # lm-eval: not in .[dev] (see pyproject.toml)

    torch.manual_seed(0)
    model = tiny_model("sdpa", ssmax=True, vocab_size=BYTE_VOCAB_SIZE, train_context_length=TRAIN_LENGTH)
    lm, rows = lm_eval_model(tmp_path, model, batch_size="auto", max_batch_size=2)
    assert lm.max_length == DECLARED
    context, continuation = ("BAM reads long contexts. " * 8).strip(), " The end."
    (result,) = lm.loglikelihood([Instance("loglikelihood", {}, (context, continuation), 0)])
    tokenizer = build_byte_tokenizer()
    context_ids = tokenizer(context, add_special_tokens=False).input_ids
    continuation_ids = tokenizer(continuation, add_special_tokens=False).input_ids
    whole = context_ids + continuation_ids  # no BOS: lm-eval adds none to a causal model's context
    assert len(whole) > 200 and max(shape[1] for shape in rows) == len(whole) - 1  # the probe and the request
    assert result[0] == pytest.approx(own_log_likelihood(model, whole, len(continuation_ids)), abs=1e-3)


def test_lm_eval_auto_batch_probe_runs_rows_of_the_declared_length_like_llama(tmp_path):
    """Rolling log-likelihood and generation probe `batch_size="auto"` with rows of the window, the declared length:
    for a BamLlama and a same-size Llama declaring 64 tokens, the same probe, within it every forward, and the
    rolling log-likelihood the model's own."""
    Instance = pytest.importorskip("lm_eval.api.instance").Instance  # lm-eval: not in .[dev] (see pyproject.toml)

    torch.manual_seed(0)
    declared = 64
    bam = tiny_model("sdpa", ssmax=True, vocab_size=BYTE_VOCAB_SIZE, train_context_length=TRAIN_LENGTH,
                     max_position_embeddings=declared)
    llama = llama_declaring(declared, vocab_size=BYTE_VOCAB_SIZE)
    text = "BAM attends."  # 12 bytes: one rolling window
    probes = {}
    for name, model in (("bam", bam), ("llama", llama)):
        lm, rows = lm_eval_model(tmp_path / name, model, batch_size="auto", max_batch_size=4)
        assert lm.max_length == declared
        (loglikelihood,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
        probes[name] = rows[:5]  # _detect_batch_size: five forwards of (max_batch_size, max_length) ones
        assert all(shape[1] <= declared for shape in rows)
        ids = [lm.prefix_token_id] + build_byte_tokenizer()(text, add_special_tokens=False).input_ids
        assert loglikelihood == pytest.approx(own_log_likelihood(model, ids, len(ids) - 1), abs=1e-3)
    assert probes["bam"] == probes["llama"] == [torch.Size([4, declared])] * 5
