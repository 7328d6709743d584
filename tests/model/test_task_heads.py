"""The task heads, beside Llama's: `BamLlamaForSequenceClassification`, `...ForTokenClassification` and
`...ForQuestionAnswering`, built from the Auto classes on a tiny config, give what their head gives over the base
model's hidden states (computed here), train a step, save and reload (also as Hub remote code, without bam_llama).
A same-size Llama head passes the same checks. Transformers' own common tests (`ModelTesterMixin` and the like) live
in its repository's tests/, which the installed package does not ship, so these checks are written here."""

import shutil
import textwrap

import pytest
import torch
from helpers import tiny_config
from test_payload import HIDE_BAM_LLAMA, run_without_bam_llama
from transformers import (
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    LlamaConfig,
)

PAD = 0
HEADS = {
    "sequence": AutoModelForSequenceClassification,
    "token": AutoModelForTokenClassification,
    "question": AutoModelForQuestionAnswering,
}


def head_config(family: str):
    bam = tiny_config(pad_token_id=PAD, num_labels=3, ssmax=True)
    if family == "bam":
        return bam
    sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads")
    return LlamaConfig(pad_token_id=PAD, num_labels=3, **{name: getattr(bam, name) for name in sizes})


def head_model(family: str, task: str, seed: int = 0):
    torch.manual_seed(seed)
    model = HEADS[task].from_config(head_config(family))
    if family == "bam":
        model.set_attn_implementation("sdpa")
    return model.eval()


def padded_batch(side: str):
    """Two rows of real tokens (never the pad id), the second with 5 pads on `side`."""
    generator = torch.Generator().manual_seed(3)
    input_ids = torch.randint(3, 97, (2, 12), generator=generator)
    mask = torch.ones_like(input_ids)
    pads = slice(0, 5) if side == "left" else slice(7, 12)
    input_ids[1, pads], mask[1, pads] = PAD, 0
    return input_ids, mask


def expected_outputs(model, task: str, input_ids, mask) -> dict[str, torch.Tensor]:
    """The head applied to the base model's hidden states; sequence classification at each row's last real token."""
    hidden = model.base_model(input_ids, attention_mask=mask).last_hidden_state
    if task == "sequence":
        last_real = torch.tensor([max(i for i in range(len(row)) if row[i]) for row in mask.tolist()])
        return {"logits": model.score(hidden[torch.arange(len(hidden)), last_real])}
    if task == "token":
        return {"logits": model.score(hidden)}
    start, end = model.qa_outputs(hidden).unbind(-1)
    return {"start_logits": start, "end_logits": end}


def labels_for(task: str, input_ids) -> dict[str, torch.Tensor]:
    if task == "sequence":
        return {"labels": torch.tensor([0, 2])}
    if task == "token":
        return {"labels": input_ids % 3}
    return {"start_positions": torch.tensor([1, 2]), "end_positions": torch.tensor([4, 6])}


@pytest.mark.parametrize("family", ["bam", "llama"])
@pytest.mark.parametrize("task", list(HEADS))
@pytest.mark.parametrize("side", ["left", "right"])
def test_a_head_gives_its_head_over_the_base_model(family, task, side):
    model = head_model(family, task)
    input_ids, mask = padded_batch(side)
    with torch.no_grad():
        outputs = model(input_ids, attention_mask=mask)
        expected = expected_outputs(model, task, input_ids, mask)
    for name, value in expected.items():
        torch.testing.assert_close(getattr(outputs, name), value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["bam", "llama"])
@pytest.mark.parametrize("task", list(HEADS))
def test_a_head_trains_a_step_saves_and_reloads(family, task, tmp_path):
    model = head_model(family, task).train()
    input_ids, mask = padded_batch("right")
    loss = model(input_ids, attention_mask=mask, **labels_for(task, input_ids)).loss
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    gradients = {name for name, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    head = "qa_outputs" if task == "question" else "score"
    assert any(name.startswith(head) for name in gradients) and any("embed_tokens" in name for name in gradients)
    if family == "bam":
        assert any(".prior." in name for name in gradients), sorted(gradients)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert any(not torch.equal(before[name], p) for name, p in model.named_parameters())

    model.eval().save_pretrained(tmp_path)
    reloaded = HEADS[task].from_pretrained(tmp_path).eval()
    assert type(reloaded) is type(model)
    with torch.no_grad():
        output, reloaded_output = model(input_ids, attention_mask=mask), reloaded(input_ids, attention_mask=mask)
    for name in expected_outputs(model, task, input_ids, mask):
        assert torch.equal(getattr(reloaded_output, name), getattr(output, name)), name


def test_the_heads_load_as_remote_code_without_bam_llama(tmp_path):
    input_ids, mask = padded_batch("left")
    expected = {}
    for task in HEADS:
        model = head_model("bam", task)
        model.save_pretrained(tmp_path / "saved" / task)
        shutil.copytree(tmp_path / "saved" / task, tmp_path / "elsewhere" / task)
        with torch.no_grad():
            output = model(input_ids, attention_mask=mask)
        expected[task] = {name: getattr(output, name) for name in ("logits", "start_logits") if name in output}
    torch.save({"input_ids": input_ids, "mask": mask, "expected": expected}, tmp_path / "expected.pt")
    script = HIDE_BAM_LLAMA + textwrap.dedent(
        f"""
        import torch
        from transformers import AutoModelForQuestionAnswering, AutoModelForSequenceClassification
        from transformers import AutoModelForTokenClassification
        saved = torch.load({str(tmp_path / "expected.pt")!r})
        autos = {{"sequence": AutoModelForSequenceClassification, "token": AutoModelForTokenClassification,
                 "question": AutoModelForQuestionAnswering}}
        for task, auto in autos.items():
            model = auto.from_pretrained({str(tmp_path / "elsewhere")!r} + "/" + task, trust_remote_code=True).eval()
            assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
            with torch.no_grad():
                output = model(saved["input_ids"], attention_mask=saved["mask"])
            for name, value in saved["expected"][task].items():
                assert torch.equal(getattr(output, name), value), (task, name)
        print("remote heads OK")
        """
    )
    assert "remote heads OK" in run_without_bam_llama(script, tmp_path)


def test_the_heads_are_registered_and_exported():
    import transformers

    import bam_llama

    for task, auto in HEADS.items():
        model_class = auto._model_mapping[type(tiny_config())]
        assert getattr(bam_llama, model_class.__name__) is model_class
        assert getattr(transformers, model_class.__name__) is model_class  # where `transformers serve` looks
