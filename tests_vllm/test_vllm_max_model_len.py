"""vLLM's own reading of a BamLlama folder's length (its `ModelConfig`, no engine started): a config that sets no
`max_position_embeddings` declares 65,536 tokens (or its training length where longer), so `--max-model-len` up to
it is accepted without `--hf-overrides`, and past it refused, as for a same-size Llama declaring the same length."""

import pytest
from conftest import HEAD_DIM, VOCAB_SIZE, build_tiny_bam

DECLARED = 65536


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    from bam_llama.data.tokenizers import build_byte_tokenizer

    root = tmp_path_factory.mktemp("lengths")
    bam = build_tiny_bam(root / "bam", seed=0, max_position_embeddings=None, train_context_length=64)
    llama = root / "llama"
    LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM,
                                 max_position_embeddings=DECLARED)).save_pretrained(llama)
    build_byte_tokenizer().save_pretrained(llama)
    return {"bam": bam, "llama": llama}


def model_config(folder, **options):
    from vllm.config import ModelConfig
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # the package's entry point: BamLlamaForCausalLM served by the plugin
    return ModelConfig(model=str(folder), dtype="float32", skip_tokenizer_init=True, **options)


@pytest.mark.parametrize("name", ["bam", "llama"])
def test_max_model_len_up_to_the_declared_length_without_overrides(folders, name):
    assert model_config(folders[name]).max_model_len == DECLARED
    for asked in (64, 32768, DECLARED):
        assert model_config(folders[name], max_model_len=asked).max_model_len == asked
    with pytest.raises(ValueError, match="greater than the derived max_model_len"):
        model_config(folders[name], max_model_len=DECLARED + 1)
