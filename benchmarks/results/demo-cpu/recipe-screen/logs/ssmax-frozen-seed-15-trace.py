"""Re-trace bam-demo --models bam --seed 15 --ssmax --no-train-ssmax-scale (loss NaN at step 1558): the same model,
data and loop; the prior's extremes and the gradient norm every step from 1400, and the model saved at 1550."""
import json, sys, tempfile
from pathlib import Path
import torch
from transformers import TrainerCallback, set_seed
from bam_llama.data.tokenizers import build_byte_tokenizer
from bam_llama.demo.pipeline import DEMO_TEMPLATE, PasskeyRows, build_model, train_model
from bam_llama.demo.settings import default_settings
from bam_llama.runtime.cpu_threads import use_threads

seed, out = int(sys.argv[1]), Path(sys.argv[2])
torch.use_deterministic_algorithms(True, warn_only=True)
use_threads(1, "cpu")
settings = default_settings(False)
tokenizer = build_byte_tokenizer()
set_seed(seed)
model = build_model("bam", settings.size, settings.data.train_length, prior_scope="layer", ssmax=True, train_ssmax_scale=False)
rows = PasskeyRows(tokenizer, DEMO_TEMPLATE, settings.data, seed, settings.train.steps * settings.train.batch_size, set())
trace = []

class Trace(TrainerCallback):
    def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
        if state.global_step >= 1400:
            norm = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in model.parameters() if p.grad is not None)).item()
            theta = {n.split("layers.")[1]: [round(x, 3) for x in p.detach().flatten().tolist()]
                     for n, p in model.named_parameters() if "theta_" in n and "mu" not in n}
            trace.append({"step": state.global_step + 1, "grad_norm": norm, "theta": theta})
    def on_log(self, args, state, control, logs=None, **kw):
        if state.global_step >= 1400 and trace:
            trace[-1]["loss"] = logs.get("loss")
        (out / "trace.json").write_text(json.dumps(trace))
    def on_step_end(self, args, state, control, model=None, **kw):
        if state.global_step == 1550:
            model.save_pretrained(out / "step-1550")
        if state.global_step >= 1570:
            control.should_training_stop = True

with tempfile.TemporaryDirectory() as folder:
    try:
        train_model(model, rows, settings.train, seed, "cpu", Path(folder), callbacks=[Trace()])
    except Exception as error:
        print("stopped:", error)
(out / "trace.json").write_text(json.dumps(trace))
