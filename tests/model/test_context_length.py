"""The context length a saved BamLlama reports to tools: `max_position_embeddings`, which lm-evaluation-harness,
vLLM and `generate` read as the length to plan for, is the length the model was trained at unless set, never the
2^20 ("no limit") of earlier releases, which sent lm-eval's batch-size probe through million-token rows; and the
model still generates past it."""

import json

import pytest
import torch
from helpers import tiny_model
from transformers import AutoConfig, AutoModelForCausalLM

from bam_llama.data.tokenizers import BYTE_VOCAB_SIZE, build_byte_tokenizer

TRAIN_LENGTH = 16


def test_a_saved_config_reports_the_train_length(tmp_path):
    tiny_model("sdpa", train_context_length=TRAIN_LENGTH).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["max_position_embeddings"] == TRAIN_LENGTH
    assert AutoConfig.from_pretrained(tmp_path).max_position_embeddings == TRAIN_LENGTH


def test_a_folder_of_an_earlier_release_reads_its_no_limit_as_the_train_length(tmp_path):
    model = tiny_model("sdpa", train_context_length=TRAIN_LENGTH)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1 << 20}))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.max_position_embeddings == TRAIN_LENGTH
    input_ids = torch.randint(3, 97, (1, 9))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids).logits, model(input_ids).logits)
    explicit = tiny_model("sdpa", train_context_length=TRAIN_LENGTH, max_position_embeddings=4096)
    explicit.save_pretrained(tmp_path / "explicit")
    assert AutoConfig.from_pretrained(tmp_path / "explicit").max_position_embeddings == 4096  # a value set is kept


def test_generation_runs_past_the_reported_length():
    """12 prompt tokens and 10 new ones with max_position_embeddings 16: the tokens of full forward passes."""
    model = tiny_model("sdpa", ssmax=True, train_context_length=TRAIN_LENGTH)
    prompt = torch.randint(3, 97, (1, 12))
    generated = model.generate(prompt, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    sequence = prompt
    with torch.no_grad():
        for _ in range(10):
            next_token = model(sequence, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            sequence = torch.cat([sequence, next_token], dim=1)
    assert generated.shape[1] == 22 > model.config.max_position_embeddings
    assert torch.equal(generated, sequence)


def test_lm_eval_auto_batch_size_plans_for_the_reported_length(tmp_path):
    """lm-evaluation-harness (a dev extra, never a runtime dependency): `batch_size="auto"` probes batches of
    `max_length` rows, which it reads from max_position_embeddings; every forward it makes stays within the train
    length, and its rolling log-likelihood is the model's own."""
    lm_eval_huggingface = pytest.importorskip("lm_eval.models.huggingface")
    from lm_eval.api.instance import Instance

    torch.manual_seed(0)
    model = tiny_model("sdpa", ssmax=True, vocab_size=BYTE_VOCAB_SIZE, train_context_length=TRAIN_LENGTH)
    model.save_pretrained(tmp_path)
    tokenizer = build_byte_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    lm = lm_eval_huggingface.HFLM(pretrained=str(tmp_path), batch_size="auto", max_batch_size=4, device="cpu")
    assert lm.max_length == TRAIN_LENGTH
    rows = []

    def within_the_reported_length(module, args, kwargs):
        length = (args[0] if args else kwargs["input_ids"]).shape[1]
        assert length <= TRAIN_LENGTH, f"lm-eval ran a {length}-token row"
        rows.append(length)

    lm.model.register_forward_pre_hook(within_the_reported_length, with_kwargs=True)
    text = "BAM attends."  # 12 bytes: one rolling window
    (loglikelihood,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    assert rows and max(rows) == TRAIN_LENGTH  # the batch-size probe ran, at the reported length

    ids = [lm.prefix_token_id] + tokenizer(text, add_special_tokens=False).input_ids
    with torch.no_grad():
        log_probs = model(torch.tensor([ids]), use_cache=False).logits[0, :-1].float().log_softmax(-1)
    expected = log_probs.gather(1, torch.tensor(ids[1:])[:, None]).sum()
    assert loglikelihood == pytest.approx(float(expected), abs=1e-3)
