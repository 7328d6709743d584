"""The model a saved folder carries as Hub remote code: the config, the model, and the attention it runs.

`save_pretrained` copies `modeling_bam.py` and every file it imports with `from .x import` flat into the folder, so
the files here import only each other (relatively), PyTorch and Transformers: never anything else of `bam_llama`.
"""
