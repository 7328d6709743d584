"""Validation of the context extension (`bam-demo --extension-steps N`): a saved `bam-demo --steps 6000` model of a
validation seed (stage one, the default recipe), its context extended by the package's `extend_context` exactly as
bam-demo would after training, then evaluated at every default length as bam-demo does (keys of the seed, every
training and extension key excluded, one thread)."""
import json, sys, tempfile
from pathlib import Path
import torch
import bam_llama  # registers the model
from transformers import AutoModelForCausalLM, set_seed
from bam_llama.data.tokenizers import build_byte_tokenizer
from bam_llama.demo.pipeline import DEMO_TEMPLATE, PasskeyRows, extend_context
from bam_llama.demo.settings import default_settings
from bam_llama.evaluation.passkey import PasskeyKeys, evaluate_passkey
from bam_llama.runtime.cpu_threads import use_threads
from bam_llama.training.callbacks import StepProgress

run_dir, seed, steps, extension_steps, out = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5])
torch.use_deterministic_algorithms(True, warn_only=True)
use_threads(1, "cpu")
settings = default_settings(False)
settings.train.steps, settings.extension.steps = steps, extension_steps
tokenizer = build_byte_tokenizer()
trained_keys = set()
for _ in PasskeyRows(tokenizer, DEMO_TEMPLATE, settings.data, seed, steps * settings.train.batch_size, trained_keys):
    pass
model = AutoModelForCausalLM.from_pretrained(run_dir / "bam-model", dtype=torch.float32)
set_seed(seed)
with tempfile.TemporaryDirectory() as folder:
    losses = extend_context(model, tokenizer, settings, seed, "cpu", Path(folder), trained_keys, StepProgress("extend bam"))
print("extension losses (first, last 8):", losses[:8], losses[-8:], flush=True)
result = evaluate_passkey(model, tokenizer, settings.lengths, num_depths=settings.num_depths, template=DEMO_TEMPLATE,
                          add_bos=settings.data.add_bos, progress=True, description="evaluate bam",
                          keys=PasskeyKeys(seed, settings.data.num_digits, excluded=trained_keys))
prior = {name: value.tolist() for name, value in model.state_dict().items() if "theta" in name}
out.write_text(json.dumps({"source": str(run_dir), "seed": seed, "steps": steps, "extension_steps": extension_steps,
                           "extension_losses": losses, "prior": prior, "bam": result.to_dict()}, indent=2))
print("saved", out)
