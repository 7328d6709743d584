"""Ulysses sequence parallelism: 2 gloo processes, each holding half of every sequence, give the loss, logits and
gradients of one process holding all of it, in training and in eval mode; 4 processes share 2 key/value heads among
8 query heads alike; and every setup that would see wrong positions or drop the prior is refused with one error.
The workers run in tests/model/sequence_parallel_worker.py (one torchrun per number of ranks)."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from distributed_launch import require_deepspeed, torchrun
from helpers import checkout_environment, tiny_model
from sequence_parallel_worker import CASES, DEEPSPEED_CASE, build_batch, build_model
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from waiting import run_within

# float32 throughout; the sharded run adds in another order (attention per head group, gradients summed over 2 ranks)
LOSS_TOLERANCE = 1e-6
LOGIT_TOLERANCE = 1e-6  # per element, logits of size ~1 (measured: equal)
GRADIENT_TOLERANCE = dict(rtol=1e-5, atol=1e-7)  # per element (measured: at most 2.6e-8 apart)


def run_workers(tmp_path_factory, processes: int) -> dict:
    output = tmp_path_factory.mktemp(f"ulysses-{processes}") / "results.pt"
    torchrun("model/sequence_parallel_worker.py", str(output), processes=processes)
    return torch.load(output)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    return run_workers(tmp_path_factory, 2)


@pytest.fixture(scope="module")
def sharded_4(tmp_path_factory):
    return run_workers(tmp_path_factory, 4)


def one_process(name: str) -> dict:
    """The reference: the same model and global batch, unsharded, in this process."""
    model = build_model(name)
    batch = build_batch(name)
    if CASES[name].mode != "train":
        batch.pop("labels")
        with torch.no_grad():
            return {"logits": model(**batch).logits}
    output = model(**batch)
    output.loss.backward()
    labels = F.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
    expected = F.cross_entropy(output.logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    torch.testing.assert_close(output.loss, expected)  # the loss the workers sum: the mean over all tokens
    gradients = {name: parameter.grad for name, parameter in model.named_parameters()}
    return {"loss": output.loss.detach(), "logits": output.logits.detach(), "gradients": gradients}


@pytest.mark.parametrize("name", sorted(CASES))
def test_sharded_ranks_give_the_one_process_loss_logits_and_gradients(request, name):
    got = request.getfixturevalue("sharded_4" if CASES[name].ranks == 4 else "sharded")[name]
    expected = one_process(name)
    torch.testing.assert_close(got["logits"], expected["logits"], rtol=0, atol=LOGIT_TOLERANCE)
    if CASES[name].mode != "train":
        return
    assert abs(got["loss"].item() - expected["loss"].item()) < LOSS_TOLERANCE
    assert got["gradients"].keys() == expected["gradients"].keys()
    prior_gradients = 0
    for parameter, gradient in expected["gradients"].items():
        torch.testing.assert_close(got["gradients"][parameter], gradient, **GRADIENT_TOLERANCE, msg=parameter)
        if "theta" in parameter or "ssmax" in parameter:
            prior_gradients += 1
            assert gradient.abs().min() > 0, f"{parameter}: every head's gradient is compared, none is trivially 0"
    assert prior_gradients >= 3


def test_deepspeed_ulysses_registered_as_accelerate_does_gives_the_one_process_gradients(sharded):
    require_deepspeed()
    got, expected = sharded["deepspeed:" + DEEPSPEED_CASE], one_process(DEEPSPEED_CASE)
    assert abs(got["loss"].item() - expected["loss"].item()) < LOSS_TOLERANCE
    for parameter, gradient in expected["gradients"].items():
        torch.testing.assert_close(got["gradients"][parameter], gradient, **GRADIENT_TOLERANCE, msg=parameter)


def test_the_sharded_positions_matter(sharded):
    """A witness that the comparison can fail: attention within each chunk alone (what BamLlama did under
    DeepSpeed's wrapper before) gives other logits than the whole sequence's."""
    name = "packed_ssmax_prior_global"
    model, batch = build_model(name), build_batch(name)
    with torch.no_grad():
        chunks = [model(input_ids=batch["input_ids"][:, part], position_ids=batch["position_ids"][:, part]).logits
                  for part in (slice(0, 12), slice(12, 24))]
    assert (torch.cat(chunks, dim=1) - sharded[name]["logits"]).abs().max() > 100 * LOGIT_TOLERANCE


@pytest.mark.parametrize(
    "setup, words",
    [
        ("no_position_ids", ["position_ids"]),
        ("left_padding", ["left padding", "right"]),
        ("heads_3_3", ["num_attention_heads=3", "divisible by 2"]),
        ("heads_6_3", ["num_key_value_heads=3"]),
        ("context_parallel", ["context parallelism", "prior", "Ulysses"]),
    ],
)
def test_what_would_be_wrong_is_refused(sharded, setup, words):
    message = sharded["refusals"][setup]
    assert message is not None, f"{setup} was not refused"
    assert "\n" not in message
    for word in words:
        assert word in message


def test_an_attention_wrapper_the_model_never_calls_is_refused():
    """A sequence-parallel (or any) wrapper registered for the model's attention name in Transformers' registry
    expects the model to call it; BamLlama's own attention would bypass it silently."""
    model = tiny_model("sdpa")
    inputs = torch.randint(1, 97, (1, 8))

    def sequence_parallel_wrapper(module, query, key, value, attention_mask, **kwargs):
        raise AssertionError("never called")

    ALL_ATTENTION_FUNCTIONS["sdpa"] = sequence_parallel_wrapper
    try:
        with pytest.raises(ValueError, match="replaced by 'test_an_attention_wrapper.*would bypass"):
            model(input_ids=inputs)
    finally:
        del ALL_ATTENTION_FUNCTIONS["sdpa"]
    model(input_ids=inputs)  # Transformers' own entry again: runs


def test_the_model_imports_no_deepspeed():
    """DeepSpeed is optional: the model (and its sequence-parallel guard) only reads it from sys.modules."""
    code = (
        "import sys, torch\n"
        "sys.path.insert(0, 'tests')\n"
        "from helpers import tiny_model\n"
        "tiny_model('sdpa')(input_ids=torch.ones(1, 4, dtype=torch.long))\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'deepspeed'))\n"
    )
    completed = run_within([sys.executable, "-c", code], 300, env=checkout_environment(), cwd=Path(__file__).parents[2])
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert completed.stdout.strip().endswith("[]"), completed.stdout[-500:]
