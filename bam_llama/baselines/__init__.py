"""Transformers' own models as the positional comparison trains them: Llama (RoPE) and Mistral (RoPE local) with
Scalable Softmax (`ssmax_configs.py`, `ssmax_models.py`)."""
