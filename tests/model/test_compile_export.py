"""torch.compile(fullgraph=True) and torch.export as on Llama: no graph break, no data-dependent guard, the same
results as eager. Every test runs a same-size LlamaForCausalLM through the same steps as the bar.

The block planning of BAM's attention reads shapes and the cache length (a Python int, read before the cache is
updated), never tensor values; a static cache, whose length is a tensor, gets the attention from tensor positions.
Compiled graphs run under the "aot_eager" backend: Dynamo's capture and AOTAutograd's forward and backward graphs
(what inductor compiles) without inductor's C++ build, which would take minutes on CPU.
"""

import pytest
import torch
from helpers import route_path_calls, tiny_llama, tiny_model
from transformers import StaticCache

VOCAB = 97
BATCH, LENGTH = 2, 40  # SSMax, padding or packing materialize block masks of 32 rows: 2 blocks


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def inputs(kind: str) -> dict:
    """plain rows; left padding (row 1 starts after 4 pads); two packed documents a row (positions restart)."""
    generator = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(3, VOCAB, (BATCH, LENGTH), generator=generator)}
    if kind == "padding":
        batch["attention_mask"] = torch.ones(BATCH, LENGTH, dtype=torch.long)
        batch["attention_mask"][1, :4] = 0
    elif kind == "packed":
        batch["position_ids"] = torch.cat([torch.arange(5), torch.arange(LENGTH - 5)])[None].expand(BATCH, -1)
    return batch


def model_of(name: str, attention: str = "sdpa", **config):
    """"bam": the default configuration (global prior, SSMax, sdpa) unless `config` says otherwise; "sinusoidal": the
    same with the sinusoidal position embedding; "llama"."""
    if name == "llama":
        return tiny_llama(attention)
    if name == "sinusoidal":
        config = {"absolute_positions": "sinusoidal", **config}
    return tiny_model(attention, **{"ssmax": True, **config})


BAM_CASES = {
    "default": dict(),
    "eager": dict(attention="eager"),
    "layer-prior": dict(prior_scope="layer"),
    "no-ssmax": dict(ssmax=False),
    "ssmax-unscaled-prior": dict(ssmax_prior=False),
    "sinusoidal": dict(absolute_positions="sinusoidal"),
}


def labelled(batch: dict) -> dict:
    labels = batch["input_ids"].clone()
    if "attention_mask" in batch:
        labels[batch["attention_mask"] == 0] = -100
    return {**batch, "labels": labels, "use_cache": False}


@pytest.mark.parametrize(
    "case, kind, training",
    [
        ("default", "plain", False),
        ("default", "padding", True),
        ("eager", "packed", True),
        ("layer-prior", "packed", True),
        ("no-ssmax", "plain", True),
        ("sinusoidal", "padding", True),
        ("llama", "plain", False),
        ("llama", "padding", True),
    ],
)
def test_no_graph_break(case, kind, training):
    """torch._dynamo.explain over a whole forward: one graph, 0 breaks, like Llama. In training mode the prior's
    gradient runs BAM's own backward, which stays one opaque operator in the graph. (Every fullgraph=True test
    below proves the same for its configuration.)"""
    model = tiny_llama() if case == "llama" else model_of("bam", **BAM_CASES[case])
    with torch.set_grad_enabled(training):
        explanation = torch._dynamo.explain(model.train(training))(**labelled(inputs(kind)))
    reasons = [reason.reason.splitlines()[0] for reason in explanation.break_reasons]
    assert explanation.graph_break_count == 0, reasons
    assert explanation.graph_count == 1


def trained_step(model, batch, compiled=False):
    """Logits and every parameter's gradient after one forward and backward (of the compiled model if asked)."""
    model.zero_grad()
    output = (torch.compile(model, fullgraph=True, backend="aot_eager") if compiled else model)(**labelled(batch))
    output.loss.backward()
    grads = {name: parameter.grad.clone() for name, parameter in model.named_parameters() if parameter.grad is not None}
    return output.logits.detach(), grads


@pytest.mark.parametrize("name, kind", [("bam", "plain"), ("bam", "padding"), ("bam", "packed"), ("llama", "plain")])
def test_fullgraph_compiled_training_step_equals_eager(name, kind):
    """Forward and backward of `torch.compile(model, fullgraph=True)`: the same logits and the same gradient for
    every parameter, the prior's and SSMax's included (they train here: alpha, beta and the SSMax scale)."""
    model = model_of(name).train()
    batch = inputs(kind)
    eager_logits, eager_grads = trained_step(model, batch)
    compiled_logits, compiled_grads = trained_step(model, batch, compiled=True)
    torch.testing.assert_close(compiled_logits, eager_logits, rtol=1e-5, atol=1e-5)
    assert compiled_grads.keys() == eager_grads.keys()
    if name == "bam":
        prior = {"model.prior.theta_alpha", "model.prior.theta_beta", "model.layers.1.self_attn.ssmax.scale"}
        assert prior <= set(eager_grads)
    for parameter, expected in eager_grads.items():
        torch.testing.assert_close(compiled_grads[parameter], expected, rtol=1e-5, atol=1e-6, msg=parameter)


def test_fullgraph_compiled_training_with_attention_dropout_equals_eager():
    """With dropout the eager path replays each block in its backward (`_RecomputedBlock`); a compiled graph
    differentiates the blocks with autograd instead. Same seed, same dropout pattern: the same gradients."""
    model = tiny_model("sdpa", ssmax=True, attention_dropout=0.2).train()
    batch = inputs("padding")
    torch.manual_seed(7)
    eager_logits, eager_grads = trained_step(model, batch)
    torch.manual_seed(7)
    compiled_logits, compiled_grads = trained_step(model, batch, compiled=True)
    torch.testing.assert_close(compiled_logits, eager_logits, rtol=1e-5, atol=1e-5)
    assert compiled_grads.keys() == eager_grads.keys()
    for parameter, expected in eager_grads.items():
        torch.testing.assert_close(compiled_grads[parameter], expected, rtol=1e-5, atol=1e-6, msg=parameter)


@pytest.mark.parametrize("case", ["eager", "layer-prior", "ssmax-unscaled-prior", "sinusoidal"])
def test_fullgraph_compiled_inference_equals_eager(case):
    model = model_of("bam", **BAM_CASES[case])
    batch = {**inputs("padding"), "use_cache": False}
    with torch.no_grad():
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")(**batch).logits
        torch.testing.assert_close(compiled, model(**batch).logits, rtol=1e-5, atol=1e-5)


def graph_calls(model, batch, grad: bool) -> tuple[torch.Tensor, list]:
    """The logits of `torch.compile(model, fullgraph=True)` and the functions its captured graph calls."""
    graphs = []

    def recording_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    with torch.set_grad_enabled(grad):
        logits = torch.compile(model, fullgraph=True, backend=recording_backend)(**batch).logits
    calls = [node.target for graph in graphs for node in graph.graph.nodes if node.op == "call_function"]
    return logits, calls


@pytest.mark.parametrize("case", ["default", "no-ssmax", "layer-prior"])
def test_compiled_inference_calls_the_eager_blocks_as_one_operator_a_layer(case):
    """Without gradients a compiled graph runs each layer's blocks as one opaque operator (the eager code: a reused
    mask buffer, key tiles, views of the table) instead of tracing them: Inductor's loops writing the masks took
    2.3x their time. With gradients the blocks stay traced (or BAM's own backward operator), as before."""
    model = model_of("bam", **BAM_CASES[case])
    batch = {**inputs("padding"), "use_cache": False}
    inference = torch.ops.bam_llama.blocked_attention_inference.default
    logits, calls = graph_calls(model.eval(), batch, grad=False)
    with torch.no_grad():
        torch.testing.assert_close(logits, model(**batch).logits, rtol=1e-5, atol=1e-5)
    assert calls.count(inference) == model.config.num_hidden_layers
    assert torch.nn.functional.scaled_dot_product_attention not in calls
    torch._dynamo.reset()
    _, training_calls = graph_calls(model.train(), labelled(batch), grad=True)
    assert inference not in training_calls


@pytest.mark.parametrize("name", ["bam", "llama"])
def test_export_runs_like_eager_for_any_padding(name):
    """`torch.export.export` with an attention mask: the exported program gives eager's logits for another mask
    too (its graph does not depend on the mask's values) and holds only ATen operators, none of BAM's own."""
    model = model_of(name)
    traced = inputs("padding")
    program = torch.export.export(model, (), {**traced, "use_cache": False})
    graphs = [module.graph for module in program.graph_module.modules() if isinstance(module, torch.fx.GraphModule)]
    targets = {str(node.target) for graph in graphs for node in graph.nodes if node.op == "call_function"}
    assert "aten.scaled_dot_product_attention.default" in targets  # the attention itself, as ATen
    assert not [target for target in targets if "bam_llama" in target or not target.startswith(("aten.", "<"))]
    exported = program.module()
    mask_free = {"input_ids": traced["input_ids"], "attention_mask": torch.ones_like(traced["attention_mask"])}
    other_padding = {"input_ids": traced["input_ids"], "attention_mask": traced["attention_mask"].flip(0)}
    with torch.no_grad():
        for batch in (traced, mask_free, other_padding):
            expected = model(**batch, use_cache=False).logits
            torch.testing.assert_close(exported(**batch, use_cache=False).logits, expected, rtol=1e-5, atol=1e-5)


def padded(length: int) -> dict:
    """`length` tokens a row, row 1 left-padded by 7."""
    generator = torch.Generator().manual_seed(length)
    attention_mask = torch.ones(BATCH, length, dtype=torch.long)
    attention_mask[1, :7] = 0
    return {"input_ids": torch.randint(3, VOCAB, (BATCH, length), generator=generator), "attention_mask": attention_mask}


@pytest.mark.parametrize("name", ["bam", "sinusoidal", "llama"])
def test_export_with_a_dynamic_length_runs_like_eager_at_any_length(name):
    """`torch.export.export` with `dynamic_shapes={"input_ids": {1: Dim("seq")}, ...}`, traced at 48 tokens: the
    program keeps the length symbolic (no "specialized it to be a constant") and gives eager's logits at 48 and 80
    tokens, with left padding and without."""
    model = model_of(name)
    seq = torch.export.Dim("seq")
    dynamic = {"input_ids": {1: seq}, "attention_mask": {1: seq}, "use_cache": None}
    program = torch.export.export(model, (), {**padded(48), "use_cache": False}, dynamic_shapes=dynamic)
    exported = program.module()
    with torch.no_grad():
        for length in (48, 80):
            unpadded = {**padded(length), "attention_mask": torch.ones(BATCH, length, dtype=torch.long)}
            for batch in (padded(length), unpadded):
                expected = model(**batch, use_cache=False).logits
                torch.testing.assert_close(exported(**batch, use_cache=False).logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["bam", "llama"])
def test_onnx_export_with_a_dynamic_length_runs_like_eager_at_any_length(name, tmp_path):
    """`torch.onnx.export(..., dynamo=True)` with a dynamic length, traced at 48 tokens: the ONNX graph keeps the
    length symbolic, and onnxruntime gives eager's logits at 48 and 80 tokens with left padding. At the padded
    positions (queries that see no key) BAM's logits are eager's too; Llama's differ there (by ~0.05), so the
    comparison is over real tokens for both."""
    pytest.importorskip("onnxscript")
    onnxruntime = pytest.importorskip("onnxruntime")
    model = model_of(name)
    seq = torch.export.Dim("seq")
    dynamic = {"input_ids": {1: seq}, "attention_mask": {1: seq}, "use_cache": None}
    program = torch.onnx.export(model, (), kwargs={**padded(48), "use_cache": False}, dynamic_shapes=dynamic,
                                dynamo=True, verbose=False)
    program.save(tmp_path / "model.onnx")
    session = onnxruntime.InferenceSession(tmp_path / "model.onnx", providers=["CPUExecutionProvider"])
    assert [type(graph_input.shape[1]) for graph_input in session.get_inputs()] == [str, str]  # not fixed to 48
    for length in (48, 80):
        batch = padded(length)
        (logits, *_) = session.run(None, {key: tensor.numpy() for key, tensor in batch.items()})
        with torch.no_grad():
            expected = model(**batch, use_cache=False).logits
        real = batch["attention_mask"].bool()
        torch.testing.assert_close(torch.from_numpy(logits)[real], expected[real], rtol=1e-5, atol=1e-5)
        if name == "bam":
            torch.testing.assert_close(torch.from_numpy(logits), expected, rtol=1e-5, atol=1e-5)


def test_blocked_attention_exported_with_a_dynamic_length_says_it_cannot():
    """The blocked attention plans its query blocks in Python from the length: exported with a dynamic length it
    raises a clear error, never a program fixed to the example's length (which `torch.onnx.export(dynamo=True)`
    would otherwise make silently from export's suggested fix)."""
    from bam_llama.model.attention_route_bam import bam_attention_blocked

    class Blocked(torch.nn.Module):
        def forward(self, query, key, value):
            positions = torch.arange(query.shape[2])
            table = -positions.flip(0).float()[None].expand(query.shape[1], -1)
            return bam_attention_blocked(query, key, value, positions, table, scaling=0.5)

    query, key = torch.randn(1, 2, 40, 8), torch.randn(1, 2, 40, 8)
    seq = torch.export.Dim("seq")
    dynamic = {"query": {2: seq}, "key": {2: seq}, "value": {2: seq}}
    with pytest.raises(NotImplementedError, match="dynamic length"):
        torch.export.export(Blocked(), (query, key, key), dynamic_shapes=dynamic)


@pytest.mark.parametrize("name", ["bam", "sinusoidal", "llama"])
def test_compiled_decoding_with_a_static_cache_equals_generate(name):
    """Transformers' recipe: prefill into a `StaticCache`, then every decoding step through
    `torch.compile(model.forward, fullgraph=True)`: one graph for all steps (the position lives in the cache's
    length tensor, so no step recompiles) and `generate()`'s greedy tokens."""
    model = model_of(name)
    prompt = torch.randint(3, VOCAB, (BATCH, 7))
    expected = model.generate(prompt, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    graphs = []

    def recording_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    step = torch.compile(model.forward, fullgraph=True, backend=recording_backend)
    cache = StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        tokens = [model(prompt, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)]
        for _ in range(5):
            tokens.append(step(tokens[-1], past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1))
    assert torch.equal(torch.cat([prompt, *tokens], dim=1), expected)
    assert len(graphs) == 1


def test_eager_attention_plans_blocks_from_the_cache_length(monkeypatch):
    """Outside a traced graph the "sdpa" path stays the blocked one (a window of one prior table per head), its
    table ending at the last query's position: read from the cache length, a tensor only for a static cache."""
    paths = route_path_calls(monkeypatch, refuse=("materialized",))
    model = model_of("bam")
    prompt = torch.randint(3, VOCAB, (BATCH, 7))
    cache = StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        model(prompt, use_cache=False)
        model.generate(prompt, max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0)
        model(prompt, past_key_values=cache, use_cache=True)
        model(prompt[:, :1], past_key_values=cache, use_cache=True)  # the cache's length is a tensor now
    calls = [(7, 7, 7), (7, 7, 7), (8, 8, 8), (7, 7, 16), (8, 8, 16)]  # (table, last position + 1, keys)
    tables = [(call.prior_table.shape[-1], int(call.query_positions[-1]) + 1, call.key.shape[2]) for _, call in paths]
    assert tables == [call for call in calls for _ in range(model.config.num_hidden_layers)]


def compiled_static_cache_logits(model, prompt, attention_mask, steps, backend="aot_eager", four_d=False):
    """Prefill `prompt` (B, L) into a StaticCache, then `steps` forced tokens (token t is 3 + t) through
    `torch.compile(model.forward, fullgraph=True)`, each step given the mask of every slot of the cache (the prompt's,
    then ones: one shape for all steps), or with `four_d` the boolean (B, 1, 1, slots) mask `generate` builds for
    such a step (padding and causality: slots after the step's position hidden): the steps' logits (B, steps, V)
    and the ids they were computed on."""
    step = torch.compile(model.forward, fullgraph=True, backend=backend)
    slots = prompt.shape[1] + steps + 3
    cache = StaticCache(config=model.config, max_cache_len=slots)
    slot_mask = torch.nn.functional.pad(attention_mask, (0, slots - prompt.shape[1]), value=1)
    ids, logits = prompt, []
    with torch.no_grad():
        model(prompt, attention_mask=attention_mask, past_key_values=cache, use_cache=True)
        for t in range(steps):
            token = torch.full((prompt.shape[0], 1), 3 + t)
            ids = torch.cat([ids, token], 1)
            mask = slot_mask
            if four_d:
                mask = (slot_mask.bool() & (torch.arange(slots) < ids.shape[1]))[:, None, None, :]
            logits.append(step(token, attention_mask=mask, past_key_values=cache, use_cache=True).logits)
    return torch.cat(logits, 1), ids


@pytest.mark.parametrize("four_d", [False, True], ids=["2d-mask", "4d-mask"])
@pytest.mark.parametrize("operator", [True, False], ids=["operator", "materialized"])
@pytest.mark.parametrize("case", ["default", "no-ssmax", "layer-prior", "ssmax-unscaled-prior"])
def test_compiled_static_cache_step_on_the_cpu(case, operator, four_d, monkeypatch):
    """A static cache's step in a compiled CPU graph over more than TRACED_DECODE_MIN_SLOTS slots (lowered here to
    run on a small cache) is one BAM operator a layer (no SDPA, no prior over every slot of the cache in the graph):
    it reads the position, attends to the keys filled so far and keeps one prior table for all steps, computed
    again when the parameters change. A smaller cache keeps the materialized step. Either way the logits equal a
    full forward without a cache over the same ids (another path: the prompt attention), left padding included,
    with a 2D mask or the 4D one `generate` builds."""
    from bam_llama.model import attention_route_bam, prior_bam

    monkeypatch.setattr(attention_route_bam, "TRACED_DECODE_MIN_SLOTS", 8 if operator else 16)  # the cache: 16 slots
    model = model_of("bam", **BAM_CASES[case])
    tables = []
    computed = prior_bam.prior_table
    monkeypatch.setattr(prior_bam, "prior_table", lambda *args: tables.append(args[0]) or computed(*args))
    prompt = torch.randint(3, VOCAB, (BATCH, 9), generator=torch.Generator().manual_seed(2))
    attention_mask = torch.ones_like(prompt)
    attention_mask[1, :3] = 0
    graphs = []

    def recording_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    logits, ids = compiled_static_cache_logits(model, prompt, attention_mask, 4, recording_backend, four_d)
    priors = 1 if case != "layer-prior" else model.config.num_hidden_layers
    # one table for the eager prefill (every layer's prior in it), and the operator's own for each prior, for all
    # four compiled steps
    assert len(tables) == 1 + (priors if operator else 0)
    with torch.no_grad():
        mask = torch.nn.functional.pad(attention_mask, (0, 4), value=1)
        expected = model(ids, attention_mask=mask, use_cache=False).logits[:, -4:]
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    calls = [node.target for graph in graphs for node in graph.graph.nodes if node.op == "call_function"]
    assert len(graphs) == 1
    operators = calls.count(torch.ops.bam_llama.traced_decode_step.default)
    assert operators == (model.config.num_hidden_layers if operator else 0)
    assert (torch.nn.functional.scaled_dot_product_attention in calls) is not operator

    torch._dynamo.reset()
    with torch.no_grad():  # new prior values: the kept table must not be reused
        for name, tensor in model.state_dict(keep_vars=True).items():
            if name.endswith("theta_beta"):
                tensor.mul_(-1.0)
    tables.clear()
    logits, ids = compiled_static_cache_logits(model, prompt, attention_mask, 2, four_d=four_d)
    assert len(tables) == 1 + (priors if operator else 0)
    with torch.no_grad():
        mask = torch.nn.functional.pad(attention_mask, (0, 2), value=1)
        expected = model(ids, attention_mask=mask, use_cache=False).logits[:, -2:]
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ssmax, ssmax_prior", [(False, True), (True, True), (True, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_traced_decode_step_operator_against_the_float64_reference(ssmax, ssmax_prior, dtype):
    """The operator alone, per element against the suite's float64 reference over keys 0..P: a static cache's
    slots past the position hold huge values (read, they would show), one row is left-padded, one head has a
    negative beta, query head h reads key/value head h // 2."""
    from reference import bam_attention

    generator = torch.Generator().manual_seed(3)
    batch, heads, kv_heads, slots, head_dim, position = 2, 4, 2, 24, 8, 13
    query = torch.randn(batch, heads, 1, head_dim, generator=generator)
    key = torch.randn(batch, kv_heads, slots, head_dim, generator=generator)
    value = torch.randn(batch, kv_heads, slots, head_dim, generator=generator)
    key[:, :, position + 1 :], value[:, :, position + 1 :] = 1e4, 1e4  # unfilled slots
    key_valid = torch.ones(batch, slots, dtype=torch.bool)
    key_valid[1, :4] = False
    theta_alpha = torch.tensor([-1.0, -0.3, 0.2, -2.0])
    theta_beta = torch.tensor([0.5, 1.0, -0.4, 0.0])
    theta_mu = torch.tensor([0.0, 0.1, -0.2, 0.3])
    scale = torch.tensor([0.9, 1.1, 1.3, 0.7]) if ssmax else None
    positions = torch.tensor([position])
    output = torch.ops.bam_llama.traced_decode_step(
        query.to(dtype), key.to(dtype), value.to(dtype), positions, theta_alpha, theta_beta, theta_mu,
        "current", 1e-5, head_dim**-0.5, scale, ssmax_prior, key_valid,
    )
    cut = slice(0, position + 1)
    expected = bam_attention(
        query.to(dtype), key[:, :, cut].to(dtype), value[:, :, cut].to(dtype), positions, theta_alpha, theta_beta,
        theta_mu, ssmax_scale=scale, ssmax_prior=ssmax_prior, key_valid=key_valid[:, cut],
    )
    assert output.shape == (batch, 1, heads, head_dim) and output.dtype == dtype
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(output.double(), expected.transpose(1, 2), **tolerance)


@pytest.mark.parametrize("size", [1024, 2048, 4096])
def test_traced_decode_steps_at_and_around_a_kept_table_s_length(size):
    """The operator keeps its prior's table between steps (by the parameters' tensor): steps at positions size - 2,
    size - 1, size and size + 1 in order, then size - 1 again, cross the length a table kept for the first step
    holds (a power of two of distances). Each step against the suite's float64 reference over keys 0..P; the
    static cache's unfilled slots hold huge values."""
    from reference import bam_attention

    generator = torch.Generator().manual_seed(5)
    heads, kv_heads, head_dim, slots = 4, 2, 8, size + 8
    query = torch.randn(1, heads, 1, head_dim, generator=generator)
    key = torch.randn(1, kv_heads, slots, head_dim, generator=generator)
    value = torch.randn(1, kv_heads, slots, head_dim, generator=generator)
    theta_alpha = torch.tensor([-1.0, -0.3, 0.2, -2.0])
    theta_beta = torch.tensor([0.5, 1.0, -0.4, 0.0])
    theta_mu = torch.tensor([0.0, 0.1, -0.2, 0.3])
    for position in (size - 2, size - 1, size, size + 1, size - 1):
        filled_key, filled_value = key.clone(), value.clone()
        filled_key[:, :, position + 1 :], filled_value[:, :, position + 1 :] = 1e4, 1e4
        positions = torch.tensor([position])
        output = torch.ops.bam_llama.traced_decode_step(
            query, filled_key, filled_value, positions, theta_alpha, theta_beta, theta_mu, "current", 1e-5,
            head_dim**-0.5, None, True, None,
        )
        cut = slice(0, position + 1)
        expected = bam_attention(query, key[:, :, cut], value[:, :, cut], positions, theta_alpha, theta_beta, theta_mu)
        torch.testing.assert_close(output.double(), expected.transpose(1, 2), rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"position {position}: {m}")
