"""Probe (not a shipped feature): a saved `bam-demo` model (no SSMax) evaluated as bam-demo does, every default
length, with each attention row's logits (prior included) multiplied at evaluation by c_i = max(1, ln(n_i) / ln(128)),
n_i the keys query i sees: exactly the trained model up to the training length, log-n sharpening past it (SSMax's
factor with s = 1/ln(128), floored at n = 128). Patched in: the SSMax row factor of the blocked/fused paths and the
decode step's host-side log."""
import json, math, sys, types
from pathlib import Path
import torch
import bam_llama
from transformers import AutoConfig, AutoModelForCausalLM
from bam_llama.data.tokenizers import build_byte_tokenizer
from bam_llama.demo.pipeline import DEMO_TEMPLATE, PasskeyRows
from bam_llama.demo.settings import default_settings
from bam_llama.evaluation.passkey import PasskeyKeys, evaluate_passkey
from bam_llama.runtime.cpu_threads import use_threads
from bam_llama.model import blocked_bam, prior_modules_bam, decode_step_bam, fused_cpu_path_bam, prior_bam

FLOOR = 128

def floored_factor(counts, ssmax_scale):
    log_counts = counts.clamp(min=FLOOR).to(torch.float32).log()
    return ssmax_scale.float()[None, :, None, None] * log_counts[:, None, :, None]

for module in (blocked_bam, prior_modules_bam, fused_cpu_path_bam, prior_bam):
    if hasattr(module, "ssmax_factor"):
        module.ssmax_factor = floored_factor
decode_step_bam.math = types.SimpleNamespace(log=lambda x: math.log(max(x, FLOOR)))

run_dir, seed, steps, out = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
torch.use_deterministic_algorithms(True, warn_only=True)
use_threads(1, "cpu")
settings = default_settings(False)
settings.train.steps = steps
tokenizer = build_byte_tokenizer()
trained_keys = set()
for _ in PasskeyRows(tokenizer, DEMO_TEMPLATE, settings.data, seed, steps * settings.train.batch_size, trained_keys):
    pass
config = AutoConfig.from_pretrained(run_dir / "bam-model")
assert not config.ssmax
config.ssmax, config.ssmax_prior, config.train_ssmax_scale, config.ssmax_scale_init = True, True, False, 1 / math.log(FLOOR)
model = AutoModelForCausalLM.from_pretrained(run_dir / "bam-model", config=config, dtype=torch.float32).eval()
scales = {n: t for n, t in model.state_dict().items() if n.endswith("ssmax.scale")}
with torch.no_grad():
    for t in scales.values():
        t.fill_(1 / math.log(FLOOR))
print("scales", len(scales), [round(float(t[0]), 5) for t in scales.values()], flush=True)
result = evaluate_passkey(model, tokenizer, settings.lengths, num_depths=settings.num_depths, template=DEMO_TEMPLATE,
                          add_bos=settings.data.add_bos, progress=True, description="evaluate bam",
                          keys=PasskeyKeys(seed, settings.data.num_digits, excluded=trained_keys))
out.write_text(json.dumps({"source": str(run_dir), "seed": seed, "steps": steps, "floor": FLOOR, "bam": result.to_dict()}, indent=2))
print("saved", out)
