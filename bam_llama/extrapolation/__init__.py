"""The paper's length-extrapolation comparison on real text (Figures 2 and 3), trained and evaluated on the CPU:
every positional encoding trained at a short length on the same data, its learning rate, steps and stages chosen on
validation seeds, and the chosen recipe of each reported on seeds no choice used, with passkey retrieval and
position-matched perplexity to 512x the training length. `benchmarks/text_extrapolation.py` is its command.

* `settings.py`: the study's sizes, steps, lengths, prompts and seeds (light);
* `encodings.py`: the encodings compared and the trials each gets on validation (light);
* `data.py`: a seed's training texts (the Python corpus with passkey documents), tokenizer and evaluation documents;
* `stages.py`: one trial trained: its stages through `bam-pretrain`, the context extension through `bam-finetune`;
* `evaluation.py`: passkey and perplexity of a trained model by length;
* `selection.py`: each encoding's recipe chosen on validation, and which go past 64x;
* `jobs.py`: one job (a trial of a model and seed) start to end: its stages, evaluations, commit and attention path;
* `run.py`: a phase's jobs planned and run, a few at a time, each published as it ends, resumable;
* `report.py`, `figures.py`: the results page, its tables and figures.
"""
