"""`bam-convert llama` on a GGUF checkpoint: a tiny Llama (2 layers, GQA, tied embeddings, byte-level BPE tokenizer in
the metadata, some tensors Q8_0-quantized) written here with the `gguf` package, converted by the CLI and checked
against the LlamaForCausalLM and tokenizer Transformers builds from the same file."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import AutoTokenizer, GenerationConfig, LlamaForCausalLM

from bam_llama import BamLlamaForCausalLM
from bam_llama.cli.convert import main

gguf = pytest.importorskip("gguf")

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, LAYERS = 64, 4, 2, 16, 96, 2
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2: pad, bos, eos
MERGES = ["t h", "th e", "Ġ the", "m e", "Ġthe me"]
CHAT_TEMPLATE = "{% for message in messages %}<|im_start|>{{ message['content'] }}<|im_end|>{% endfor %}"
QUANTIZED = ("ffn_gate", "ffn_up", "ffn_down")  # stored Q8_0: the converter must dequantize them


def gpt2_byte_alphabet() -> list[str]:
    """GPT-2's printable spelling of the 256 bytes, in byte order: printable Latin-1 bytes stand for themselves,
    the others are shifted to 256 + n in order of appearance (so the space byte is 'Ġ')."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))
    return [chr(byte) if byte in printable else chr(next(shifted)) for byte in range(256)]


VOCABULARY = SPECIAL_TOKENS + gpt2_byte_alphabet() + [merge.replace(" ", "") for merge in MERGES]
TOKEN_ID = {token: index for index, token in enumerate(VOCABULARY)}


def random_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """GGUF tensor name -> float32 array in (out_features, in_features) layout; no output.weight (tied)."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: (rng.standard_normal(shape) * 0.2).astype(np.float32)  # noqa: E731
    norm = lambda: (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)  # noqa: E731
    weights = {"token_embd.weight": normal(len(VOCABULARY), HIDDEN), "output_norm.weight": norm()}
    for layer in range(LAYERS):
        weights.update({
            f"blk.{layer}.attn_norm.weight": norm(),
            f"blk.{layer}.attn_q.weight": normal(HEADS * HEAD_DIM, HIDDEN),
            f"blk.{layer}.attn_k.weight": normal(KV_HEADS * HEAD_DIM, HIDDEN),
            f"blk.{layer}.attn_v.weight": normal(KV_HEADS * HEAD_DIM, HIDDEN),
            f"blk.{layer}.attn_output.weight": normal(HIDDEN, HEADS * HEAD_DIM),
            f"blk.{layer}.ffn_norm.weight": norm(),
            f"blk.{layer}.ffn_gate.weight": normal(INTERMEDIATE, HIDDEN),
            f"blk.{layer}.ffn_up.weight": normal(INTERMEDIATE, HIDDEN),
            f"blk.{layer}.ffn_down.weight": normal(HIDDEN, INTERMEDIATE),
        })
    return weights


def write_tiny_gguf(path: Path, weights: dict[str, np.ndarray], architecture: str = "llama") -> None:
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("tiny-llama")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_context_length(256)
    writer.add_block_count(LAYERS)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(VOCABULARY))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(VOCABULARY)
    writer.add_token_types([3] * len(SPECIAL_TOKENS) + [1] * (len(VOCABULARY) - len(SPECIAL_TOKENS)))  # 3: control
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, array in weights.items():
        if name.split(".")[-2] in QUANTIZED:
            quantized = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    weights = random_weights()
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.Q8_0.gguf"
    write_tiny_gguf(path, weights)
    return path, weights


@pytest.fixture(scope="module")
def converted(tiny_gguf, tmp_path_factory) -> Path:
    out_dir = tmp_path_factory.mktemp("converted") / "bam"
    assert main(["llama", str(tiny_gguf[0]), str(out_dir)]) == 0
    return out_dir


@pytest.fixture(scope="module")
def transformers_llama(tiny_gguf) -> LlamaForCausalLM:
    path = tiny_gguf[0]
    return LlamaForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def test_tokenizer_is_carried_over(tiny_gguf, converted):
    path = tiny_gguf[0]
    text = "the theme<|im_end|>"
    expected = [TOKEN_ID["the"], TOKEN_ID["Ġtheme"], TOKEN_ID["<|im_end|>"]]  # BPE by the merges, written out here
    original = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    carried = AutoTokenizer.from_pretrained(converted)
    assert original(text).input_ids == expected
    assert carried(text).input_ids == expected
    assert carried.decode(expected) == text
    assert carried.chat_template == CHAT_TEMPLATE
    assert (carried.bos_token, carried.eos_token, carried.pad_token) == ("<|im_start|>", "<|im_end|>", "<|endoftext|>")


def test_config_keeps_gqa_tied_embeddings_and_generation_config(tiny_gguf, converted):
    config = json.loads((converted / "config.json").read_text())
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (HEADS, KV_HEADS, HEAD_DIM)
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (HIDDEN, INTERMEDIATE, LAYERS)
    assert config["vocab_size"] == len(VOCABULARY) and config["tie_word_embeddings"] is True
    assert config["converted_from"]["format"] == "gguf" and config["converted_from"]["gguf_file_type"] == "Q8_0"
    assert config["converted_from"]["source"] == str(tiny_gguf[0].resolve())
    assert "quantization_config" not in config
    generation = GenerationConfig.from_pretrained(converted)
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (1, 2, 0)
    with safe_open(converted / "model.safetensors", framework="pt") as weights:
        names = set(weights.keys())
        assert "lm_head.weight" not in names  # tied: saved once, as the embedding
        assert weights.get_slice("model.layers.1.self_attn.k_proj.weight").get_shape() == [KV_HEADS * HEAD_DIM, HIDDEN]
        assert weights.get_slice("model.layers.1.self_attn.q_proj.weight").get_shape() == [HEADS * HEAD_DIM, HIDDEN]
    model = BamLlamaForCausalLM.from_pretrained(converted)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_weights_are_the_dequantized_llama_weights(tiny_gguf, converted, transformers_llama):
    bam = BamLlamaForCausalLM.from_pretrained(converted).state_dict()
    llama = transformers_llama.state_dict()
    for name, tensor in llama.items():
        torch.testing.assert_close(bam[name], tensor, rtol=0, atol=0, msg=name)
    # Q8_0 keeps each weight within half a quantization step (block max / 127, the step itself rounded to fp16:
    # up to 127 * 2**-11 of a step more) of the value written.
    written = torch.from_numpy(tiny_gguf[1]["blk.1.ffn_down.weight"])
    step = written.reshape(HIDDEN, -1, 32).abs().amax(-1, keepdim=True) / 127
    error = (bam["model.layers.1.mlp.down_proj.weight"].reshape(HIDDEN, -1, 32) - written.reshape(HIDDEN, -1, 32)).abs()
    assert (error <= (0.5 + 127 * 2**-11) * step).all()
    torch.testing.assert_close(bam["model.embed_tokens.weight"], torch.from_numpy(tiny_gguf[1]["token_embd.weight"]))


@pytest.mark.parametrize("attn_implementation", ["bam_eager", "bam_sdpa"])
def test_position_zero_logits_match_the_llama(converted, transformers_llama, attn_implementation):
    """With a flat prior and no SSMax, the first position attends only to itself in both models and RoPE is the
    identity there, so every vocabulary token as a first token gives the Llama's logits."""
    bam = BamLlamaForCausalLM.from_pretrained(converted, attn_implementation=attn_implementation).eval()
    first_tokens = torch.arange(len(VOCABULARY))
    input_ids = torch.stack([first_tokens, first_tokens.roll(1), first_tokens.roll(7)], dim=1)
    with torch.no_grad():
        bam_logits = bam(input_ids, use_cache=False).logits
        llama_logits = transformers_llama(input_ids, use_cache=False).logits
    torch.testing.assert_close(bam_logits[:, 0], llama_logits[:, 0], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(bam_logits[:, 2], llama_logits[:, 2], atol=1e-3)  # later positions: RoPE is gone


def test_folder_with_gguf_file_option(tiny_gguf, converted, tmp_path):
    path = tiny_gguf[0]
    out_dir = tmp_path / "from-folder"
    assert main(["llama", str(path.parent), str(out_dir), "--gguf-file", path.name, "--prior", "alibi"]) == 0
    config = json.loads((out_dir / "config.json").read_text())
    assert config["converted_from"]["prior_init"] == "alibi"
    with safe_open(out_dir / "model.safetensors", framework="pt") as weights, safe_open(converted / "model.safetensors", framework="pt") as reference:
        torch.testing.assert_close(weights.get_tensor("model.layers.0.mlp.up_proj.weight"), reference.get_tensor("model.layers.0.mlp.up_proj.weight"))


def test_bad_gguf_inputs_are_one_line_errors(tiny_gguf, tmp_path, capsys):
    path = tiny_gguf[0]
    assert main(["llama", str(path.parent), str(tmp_path / "a"), "--gguf-file", "missing.gguf"]) == 2
    assert main(["llama", str(path.parent), str(tmp_path / "b"), "--gguf-file", "."]) == 2
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("not a GGUF file")
    assert main(["llama", str(not_gguf), str(tmp_path / "c")]) == 2
    other = tmp_path / "other.gguf"
    write_tiny_gguf(other, random_weights(), architecture="gpt2")
    assert main(["llama", str(other), str(tmp_path / "d")]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 4 and all(line.startswith("bam-convert: error: ") for line in errors)
    assert "does not exist" in errors[0] and "--gguf-file" in errors[1]
    assert "not a readable GGUF file" in errors[2] and "'gpt2' model" in errors[3]
    assert not any((tmp_path / name).exists() for name in "abcd")


def test_missing_gguf_package_is_named(tiny_gguf, tmp_path, monkeypatch, capsys):
    """`import gguf` failing (its sys.modules entry set to None, as Python does for a hidden module): one line naming
    the package and how to install it, exit status 2, nothing written."""
    monkeypatch.setitem(sys.modules, "gguf", None)
    out_dir = tmp_path / "bam"
    assert main(["llama", str(tiny_gguf[0]), str(out_dir)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.startswith("bam-convert: error: ")
    assert "`gguf`" in error and "pip install 'bam-llama[gguf]'" in error
    assert not out_dir.exists()
