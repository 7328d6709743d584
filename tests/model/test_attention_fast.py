"""The "sdpa" attention path (CPU default, GPU fallback) against the suite's independent float64 reference
(tests/reference.py, the GGD-BAM definition evaluated element by element)."""


import pytest
import reference
import torch
from helpers import fused_kernel_calls, tiny_config, tiny_model

from bam_llama.model.attention_route_bam import bam_attention_blocked
from bam_llama.model.dispatch_bam import bam_sdpa_attention_forward
from bam_llama.model.modeling_bam import BamAttention
from bam_llama.model.prior_bam import ggd_bias
from bam_llama.model.prior_modules_bam import BamPrior

HALF_TOLERANCE = {torch.float16: dict(atol=2e-3, rtol=2e-3), torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


def reference_attention(query, key, value, positions, theta_alpha, theta_beta, theta_mu, ssmax_scale=None,
                        ssmax_prior=True, key_valid=None, document_ids=None, dropout=0.0, dropout_keep=None):
    """tests/reference.py's float64 attention, with this module's argument order."""
    return reference.bam_attention(
        query, key, value, positions, theta_alpha, theta_beta, theta_mu, ssmax_scale=ssmax_scale,
        ssmax_prior=ssmax_prior, key_valid=key_valid, document_ids=document_ids, dropout=dropout,
        dropout_keep=dropout_keep,
    )


def attention_module(theta_beta, ssmax=True, ssmax_prior=True, heads=4, kv_heads=2, head_dim=8):
    config = tiny_config(
        hidden_size=heads * head_dim, num_attention_heads=heads, num_key_value_heads=kv_heads,
        ssmax=ssmax, ssmax_prior=ssmax_prior,
    )
    module = BamAttention(config, layer_idx=0)
    prior = BamPrior(config)
    with torch.no_grad():
        prior.theta_alpha.copy_(torch.linspace(-1.0, 3.0, heads))
        prior.theta_beta.copy_(torch.as_tensor(theta_beta, dtype=torch.float32).expand(heads))
        prior.theta_mu.copy_(torch.linspace(-0.4, 0.3, heads) * (torch.arange(heads) % 2))  # mu = 0 in even heads
        if ssmax:
            module.ssmax.scale.copy_(torch.linspace(0.7, 1.3, heads))
    return module, prior


def run_sdpa_path(module, prior, query, key, value, positions, key_valid=None, document_ids=None):
    output, _ = bam_sdpa_attention_forward(
        module, query, key, value, key_valid, scaling=query.shape[-1] ** -0.5,
        query_positions=positions, prior=prior, document_ids=document_ids, last_position=int(positions[-1]),
    )
    return output.transpose(1, 2)  # (B, H, Lq, D)


def reference_for(module, prior, query, key, value, positions, key_valid=None, document_ids=None):
    ssmax = module.ssmax
    return reference_attention(
        query, key, value, positions, prior.theta_alpha, prior.theta_beta, prior.theta_mu,
        None if ssmax is None else ssmax.scale, module.config.ssmax_prior, key_valid, document_ids,
    )


def random_qkv(batch, heads, kv_heads, q_len, k_len, head_dim, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shapes = [(batch, heads, q_len, head_dim), (batch, kv_heads, k_len, head_dim), (batch, kv_heads, k_len, head_dim)]
    return [torch.randn(shape, generator=generator).to(dtype) for shape in shapes]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("theta_beta", [-3.0, -0.96, 0.0, 0.2, 1.5, 3.0])
@pytest.mark.parametrize("ssmax", [True, False])
def test_half_precision_matches_float64_reference(dtype, theta_beta, ssmax):
    """Packed documents (every document's first token sees one key), 16-bit inputs."""
    module, prior = attention_module(theta_beta, ssmax=ssmax)
    query, key, value = random_qkv(2, 4, 2, 24, 24, 8, dtype)
    positions = torch.arange(24)
    document_ids = torch.tensor([[0] * 9 + [1] * 10 + [2] * 5, [0] * 24])
    output = run_sdpa_path(module, prior, query, key, value, positions, document_ids=document_ids)
    assert output.dtype == dtype
    expected = reference_for(module, prior, query, key, value, positions, document_ids=document_ids)
    torch.testing.assert_close(output.double(), expected, **HALF_TOLERANCE[dtype])
    # the first token of every document sees only itself: its output is its own value vector
    for row, start in [(0, 0), (0, 9), (0, 19), (1, 0)]:
        torch.testing.assert_close(output[row, :, start].double(), value[row, [0, 0, 1, 1], start].double(), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_left_padding_and_cache_offset(dtype):
    """Queries at positions 20..23 of a 24-key cache, first keys padded, prior without SSMax scaling."""
    module, prior = attention_module(-2.0, ssmax_prior=False)
    query, key, value = random_qkv(2, 4, 2, 4, 24, 8, dtype, seed=1)
    positions = torch.arange(20, 24)
    key_valid = torch.ones(2, 24, dtype=torch.long)
    key_valid[1, :19] = 0
    output = run_sdpa_path(module, prior, query, key, value, positions, key_valid=key_valid)
    expected = reference_for(module, prior, query, key, value, positions, key_valid=key_valid)
    torch.testing.assert_close(output.double(), expected, **HALF_TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_model_matches_float32_eager(dtype):
    """Whole model with strongly negative beta: 16-bit sdpa logits against float32 eager on the same weights."""
    model = tiny_model("eager", ssmax=True)
    with torch.no_grad():
        model.model.prior.theta_beta.copy_(torch.tensor([-3.0, -1.5, -0.96, 2.0]))
    model = model.to(dtype).float()  # weights representable in both precisions
    input_ids = torch.randint(0, 97, (2, 20))
    with torch.no_grad():
        expected = model(input_ids, use_cache=False).logits
        model.to(dtype).set_attn_implementation("sdpa")
        actual = model(input_ids, use_cache=False).logits.float()
    scale = expected.abs().max()
    torch.testing.assert_close(actual, expected, atol=float(scale) * (4e-3 if dtype == torch.float16 else 3e-2), rtol=0)


BLOCKED_CASES = {
    "prior": dict(ssmax=False),
    "ssmax": dict(ssmax=True),
    "ssmax_unscaled_prior": dict(ssmax=True, ssmax_prior=False),
    "left_padding": dict(ssmax=True, padded=True),
    "packed_documents": dict(ssmax=True, packed=True),
    "cache_offset": dict(ssmax=True, offset=7),
    "frozen_prior": dict(ssmax=False, frozen=True),
    # a frozen prior with a materialized mask: SDPA keeps each block's mask for the q/k/v gradients
    "frozen_prior_padded": dict(ssmax=False, frozen=True, padded=True),
    "frozen_ssmax_packed": dict(ssmax=True, frozen=True, packed=True),
}


@pytest.mark.parametrize("case", list(BLOCKED_CASES))
# (queries, query heads) per block: one query of every head; 3 queries of one key/value head's 2 query heads (the
# second block of heads must use the second key/value head); the default (all 13 queries, every head here)
@pytest.mark.parametrize("block_shape", [(1, 4), (3, 2), (None, None)])
def test_blocked_attention_and_gradients_match_float64_reference(case, block_shape):
    """Blocks of queries and heads against the keys they can see, outputs AND gradients (q, k, v, prior, SSMax
    scale)."""
    options = BLOCKED_CASES[case]
    ssmax, offset = options["ssmax"], options.get("offset", 0)
    heads, kv_heads, q_len, head_dim = 4, 2, 13, 8
    k_len = q_len + offset
    query, key, value = random_qkv(2, heads, kv_heads, q_len, k_len, head_dim, torch.float64, seed=3)
    for tensor in (query, key, value):
        tensor.requires_grad_(True)
    positions = torch.arange(offset, k_len)
    parameters = {
        "theta_alpha": torch.linspace(-1.0, 1.0, heads, dtype=torch.float64),
        "theta_beta": torch.tensor([-2.0, -0.5, 0.7, 2.5], dtype=torch.float64),
        "theta_mu": torch.tensor([0.0, 0.3, -0.2, 0.0], dtype=torch.float64),
        "ssmax_scale": torch.tensor([0.8, 1.2, -0.5, 1.0], dtype=torch.float64),
    }
    for tensor in parameters.values():
        tensor.requires_grad_(not options.get("frozen"))
    key_valid = document_ids = None
    if options.get("padded"):
        key_valid = torch.ones(2, k_len, dtype=torch.long)
        key_valid[1, :5] = 0  # queries 0..4 of row 1 are padding and see no key
    if options.get("packed"):
        document_ids = torch.tensor([[0] * 4 + [1] * 6 + [2] * 3, [0] * 13])
    ssmax_scale = parameters["ssmax_scale"] if ssmax else None
    table = ggd_bias(
        torch.arange(-(k_len - 1), 1), parameters["theta_alpha"], parameters["theta_beta"], parameters["theta_mu"]
    ).double()
    actual = bam_attention_blocked(
        query, key, value, positions, table, head_dim**-0.5, ssmax_scale=ssmax_scale,
        ssmax_prior=options.get("ssmax_prior", True), key_valid=key_valid, document_ids=document_ids,
        block_rows=block_shape[0], block_heads=block_shape[1],
    )
    expected = reference_attention(
        query, key, value, positions, parameters["theta_alpha"], parameters["theta_beta"], parameters["theta_mu"],
        ssmax_scale, options.get("ssmax_prior", True), key_valid, document_ids,
    )
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)  # ggd_bias computes in float32
    if key_valid is not None:
        assert actual[1, :, :5].abs().max() == 0
    inputs = [query, key, value] + [
        t for name, t in parameters.items() if t.requires_grad and (ssmax or name != "ssmax_scale")
    ]
    weights = torch.randn(expected.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    actual_grads = torch.autograd.grad((actual * weights).sum(), inputs)
    expected_grads = torch.autograd.grad((expected * weights).sum(), inputs)
    for name, got, want in zip(["q", "k", "v", *parameters], actual_grads, expected_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4, msg=lambda m: f"gradient of {name}: {m}")


@pytest.mark.parametrize("ssmax", [False, True])
def test_a_frozen_prior_keeps_no_block_masks_for_the_backward(ssmax):
    """q, k, v train, the prior and SSMax scales are frozen, keys are padded (every block's mask is materialized):
    what autograd keeps for the backward is O(L) (about the inputs), not a mask per block (O(L^2): 8x the inputs
    here). Same gradients as the float64 reference."""
    heads, kv_heads, length, head_dim = 4, 2, 256, 8
    query, key, value = random_qkv(2, heads, kv_heads, length, length, head_dim, torch.float32, seed=5)
    for tensor in (query, key, value):
        tensor.requires_grad_(True)
    positions = torch.arange(length)
    theta = dict(theta_alpha=torch.linspace(-1.0, 1.0, heads), theta_beta=torch.linspace(-0.5, 1.5, heads),
                 theta_mu=torch.zeros(heads))
    ssmax_scale = torch.linspace(0.8, 1.2, heads) if ssmax else None
    key_valid = torch.ones(2, length, dtype=torch.long)
    key_valid[1, :40] = 0
    saved_bytes = []

    def pack(tensor):
        saved_bytes.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        table = ggd_bias(torch.arange(-(length - 1), 1), theta["theta_alpha"], theta["theta_beta"], theta["theta_mu"])
        actual = bam_attention_blocked(
            query, key, value, positions, table, head_dim**-0.5, ssmax_scale=ssmax_scale, key_valid=key_valid
        )
    input_bytes = sum(t.numel() * t.element_size() for t in (query, key, value))
    assert sum(saved_bytes) < 2 * input_bytes
    expected = reference_attention(query, key, value, positions, **theta, ssmax_scale=ssmax_scale, key_valid=key_valid)
    weights = torch.randn(expected.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    actual_grads = torch.autograd.grad((actual.double() * weights).sum(), (query, key, value))
    expected_grads = torch.autograd.grad((expected * weights).sum(), (query, key, value))
    for name, got, want in zip("qkv", actual_grads, expected_grads):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-3, msg=lambda m: f"gradient of {name}: {m}")


def test_blocks_that_split_a_key_value_group_are_refused():
    query, key, value = random_qkv(1, 4, 2, 5, 5, 8, torch.float32)
    table = torch.zeros(4, 5)
    with pytest.raises(ValueError, match="block_heads=3 must be a multiple of the 2 query heads"):
        bam_attention_blocked(query, key, value, torch.arange(5), table, 0.25, block_heads=3)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("fused", [True, False])
def test_a_decoding_step_is_one_call_for_every_head(request, monkeypatch, padded, fused):
    """One query against 4096 keys with SSMax scaling the prior: one fused-kernel call for all heads where the CPU
    kernel runs (eager float32), else one (scores, P V) matmul pair, each key/value head's query heads as the rows
    of one matrix; never a call per head (each call costs a fixed overhead, which dominates a decoding step), and no
    SDPA call."""
    if fused:
        request.getfixturevalue("cpu_kernels")
    if not fused:
        monkeypatch.setenv("BAM_CPU_KERNELS", "0")
    shapes = []

    def counting(name, function):
        def counted(*args, **kwargs):
            shapes.append((name, tuple(args[1].shape)))
            return function(*args, **kwargs)
        return counted

    monkeypatch.setattr(torch, "baddbmm", counting("baddbmm", torch.baddbmm))
    monkeypatch.setattr(torch, "bmm", counting("bmm", torch.bmm))
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", None)
    kernel_calls = fused_kernel_calls(monkeypatch)
    query, key, value = random_qkv(1, 8, 4, 1, 4096, 4, torch.float32)
    key_valid = torch.ones(1, 4096, dtype=torch.long) if padded else None
    bam_attention_blocked(
        query, key, value, torch.tensor([4095]), torch.zeros(8, 4096), 0.5, ssmax_scale=torch.ones(8),
        key_valid=key_valid,
    )
    if fused:
        assert kernel_calls == [(1, 8, 1, 4)] and shapes == []
    else:  # (B x Hkv, group, D), (B x Hkv, keys, D)
        assert kernel_calls == [] and shapes == [("baddbmm", (4, 2, 4)), ("bmm", (4, 4096, 4))]


@pytest.mark.parametrize("ssmax, ssmax_prior", [(False, True), (True, True), (True, False)])
@pytest.mark.parametrize("theta_beta", [-0.9, 0.6])
@pytest.mark.parametrize("fused", [True, False])
def test_a_decoding_step_matches_float64_reference_with_padding_and_static_cache_slots(
    request, monkeypatch, ssmax, ssmax_prior, theta_beta, fused
):
    """One query at position 40 without gradients (the single-query path): its mask is the prior table itself.
    Row 0 sees every key, row 1 only the keys after its left padding (SSMax counts 29 keys), row 2 none at all
    (zeros), row 3 only its own (an SSMax factor of 0: ln 1; the hidden keys stay hidden); keys 41..47 are a static
    cache's unfilled slots, holding values a correct step never reads. Both engines: the fused CPU kernel, and the
    three PyTorch calls that run where it does not (BAM_CPU_KERNELS=0)."""
    if fused:
        request.getfixturevalue("cpu_kernels")
    if not fused:
        monkeypatch.setenv("BAM_CPU_KERNELS", "0")
    kernel_calls = fused_kernel_calls(monkeypatch)
    module, prior = attention_module(theta_beta, ssmax=ssmax, ssmax_prior=ssmax_prior)
    query, key, value = random_qkv(4, 4, 2, 1, 48, 8, torch.float32, seed=5)
    key[:, :, 41:], value[:, :, 41:] = 1e4, 1e4
    positions = torch.tensor([40])
    key_valid = torch.ones(4, 48, dtype=torch.long)
    key_valid[1, :12] = 0
    key_valid[2, :41] = 0
    key_valid[3, :40] = 0
    with torch.no_grad():
        for valid in (None, key_valid):
            output = run_sdpa_path(module, prior, query, key, value, positions, key_valid=valid)
            expected = reference_for(module, prior, query, key[:, :, :41], value[:, :, :41], positions, key_valid=(
                None if valid is None else valid[:, :41]))
            torch.testing.assert_close(output.double(), expected, atol=1e-5, rtol=1e-5)
    assert output[2].abs().max() == 0
    assert len(kernel_calls) == (2 if fused else 0)


def test_the_kept_prior_table_follows_its_parameters():
    """Without gradients `BamPrior.table` keeps a longer table and returns its tail: equal to the float64 prior at
    every length, shared between decoding steps (one storage), and recomputed after a change of a parameter: in
    place (an optimizer step, a loaded state dict), and through `.data`, which leaves the version counter as it
    was (as ZeRO-3 and FSDP write gathered values)."""
    _, prior = attention_module(-0.7)

    def expected(last):
        distance = torch.arange(-last, 1)
        return reference.prior(distance, prior.theta_alpha, prior.theta_beta, prior.theta_mu)

    with torch.no_grad():
        first, second = prior.table(1500), prior.table(1501)
        torch.testing.assert_close(first.double(), expected(1500), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(second.double(), expected(1501), atol=1e-6, rtol=1e-6)
        assert first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
        prior.theta_beta.add_(0.25)
        torch.testing.assert_close(prior.table(1501).double(), expected(1501), atol=1e-6, rtol=1e-6)
        version = prior.theta_alpha._version
        prior.theta_alpha.data.mul_(0.5)
        assert prior.theta_alpha._version == version
        torch.testing.assert_close(prior.table(1501).double(), expected(1501), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(prior.table(5000).double(), expected(5000), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(prior.table(0).double(), expected(0), atol=1e-6, rtol=1e-6)


TABLE_SIZES = [2**power for power in range(1, 16)]  # every power of two a kept table may hold, to 32K distances


@pytest.mark.parametrize("size", TABLE_SIZES)
def test_a_kept_table_serves_the_positions_at_and_around_its_length(size):
    """Decoding steps at positions size - 2, size - 1, size, size + 1, then size - 1 and size again (a shorter
    request after a longer one), on one prior without gradients: a table kept at a power of two of distances holds
    positions up to size - 1, so the step at `size` is the first it cannot serve (one column, not P + 1, where
    it is reused there). Each step's table is the float64 prior at distances -P, ..., 0, computed here."""
    _, prior = attention_module(-0.7)
    with torch.no_grad():
        for last in (size - 2, size - 1, size, size + 1, size - 1, size):
            table = prior.table(last)
            expected = reference.prior(torch.arange(-last, 1), prior.theta_alpha, prior.theta_beta, prior.theta_mu)
            assert table.shape == expected.shape, f"position {last}: {tuple(table.shape)}"
            torch.testing.assert_close(table.double(), expected, atol=1e-6, rtol=1e-6, msg=lambda m: f"{last}: {m}")


@pytest.mark.parametrize("size", [1024, 2048])
@pytest.mark.parametrize("overrides", [dict(), dict(prior_scope="layer", ssmax=True)], ids=["global", "layer"])
def test_decoding_steps_at_and_around_a_kept_table_s_length_equal_the_eager_model(size, overrides):
    """A prompt of size - 1 tokens through the cache, then decoding steps at positions size - 1, size and size + 1:
    the tables the model keeps (a global prior's; the per-layer priors' one for all layers) are first kept for
    the prompt's last position, size - 2, at a power of two of distances, so the steps cross the kept length.
    Each step's logits equal those of the eager model, which computes its bias from the positions (no table), at
    the same positions of one forward over the whole sequence."""
    from bam_llama.model.modeling_bam import CACHE_NAME

    model, eager = tiny_model("sdpa", **overrides), tiny_model("eager", **overrides)
    input_ids = torch.randint(0, model.config.vocab_size, (2, size + 2), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = eager(input_ids).logits
        cache = getattr(model(input_ids[:, : size - 1], use_cache=True), CACHE_NAME)
        for position in (size - 1, size, size + 1):
            step = model(input_ids[:, position : position + 1], **{CACHE_NAME: cache}, use_cache=True)
            torch.testing.assert_close(step.logits[:, -1], expected[:, position], atol=2e-5, rtol=2e-5,
                                       msg=lambda m: f"position {position}: {m}")


def test_priors_per_layer_come_from_one_kept_table_each_layer_its_own_rows(monkeypatch):
    """Without gradients the layers' own priors come from one table kept for all of them (`_prior_tables`): each
    layer attends with its own prior (a prefill and every decoding step equal the eager model's logits, whose layers
    compute their own bias from their own parameters: every layer's differ), the parameters are checked once a
    forward, not once a layer, and a value written through `.data` into the last layer's prior (which leaves its
    version counter as it was; the cache holds nothing that layer computed) moves the next step as it moves the eager
    model's."""
    from bam_llama.model import prior_bam
    from bam_llama.model.modeling_bam import CACHE_NAME

    overrides = dict(prior_scope="layer", ssmax=True, num_hidden_layers=3)
    model, eager = tiny_model("sdpa", **overrides), tiny_model("eager", **overrides)
    windows = []
    window = prior_bam.KeptPriorTable.window
    monkeypatch.setattr(prior_bam.KeptPriorTable, "window", lambda self, *args: windows.append((self, args[0])) or
                        window(self, *args))
    input_ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        output = model(input_ids[:, :18], use_cache=True)
        torch.testing.assert_close(output.logits, eager(input_ids[:, :18]).logits, atol=1e-5, rtol=1e-5)
        cache = getattr(output, CACHE_NAME)
        for step in range(18, 24):
            if step == 21:
                for changed in (model, eager):
                    changed.model.layers[-1].self_attn.prior.theta_beta.data.mul_(-0.5)  # not in the cache
            logits = model(input_ids[:, step : step + 1], **{CACHE_NAME: cache}, use_cache=True).logits[:, -1]
            expected = eager(input_ids[:, : step + 1]).logits[:, -1]
            torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5, msg=lambda m: f"step {step}: {m}")
    kept = model.model._layer_tables
    assert [last for table, last in windows if table is kept] == list(range(17, 24))  # a table a forward, all layers
    assert all(table in (kept, eager.model._layer_tables) for table, _ in windows)  # no layer keeps one of its own


@pytest.mark.parametrize("queries", [40, 200])
def test_long_key_blocks_keep_32_queries_and_stay_exact(monkeypatch, queries):
    """SSMax scaling the prior past ~24K keys of a batch (2 rows x 2 query heads a key/value head x 13,000 keys):
    the 6 MiB mask budget alone would leave 30 queries a call (15 of all 4 heads for a 40-query chunk), below SDPA's
    CPU tiles. Every call keeps 32 queries of whole key/value groups, the last block the rest, and the rows, left
    padding and SSMax counts included, match the float64 reference. The prior's parameters require gradients here:
    the untiled path that compiled training graphs take (inference past 8K keys runs key tiles, tested below), with
    the fused CPU kernel, which eager float32 calls run instead, switched off."""
    import bam_llama.model.blocked_bam as attention

    monkeypatch.setenv("BAM_CPU_KERNELS", "0")

    shapes = []
    sdpa = attention.F.scaled_dot_product_attention

    def counting_sdpa(query, *args, **kwargs):
        shapes.append(tuple(query.shape[1:3]))
        return sdpa(query, *args, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", counting_sdpa)
    keys, heads, kv_heads = 13_000, 4, 2
    module, prior = attention_module(-0.8, heads=heads, kv_heads=kv_heads, head_dim=4)
    query, key, value = random_qkv(2, heads, kv_heads, queries, keys, 4, torch.float32)
    positions = torch.arange(keys - queries, keys)
    key_valid = torch.ones(2, keys, dtype=torch.long)
    key_valid[1, :700] = 0  # left padding: SSMax counts 12,300 keys for the last query of row 1
    output = run_sdpa_path(module, prior, query, key, value, positions, key_valid=key_valid)
    rows_per_call = [rows for _, rows in shapes]
    assert {head_count for head_count, _ in shapes} == {2}  # one key/value group a call
    assert rows_per_call[:-2] == [32] * (len(shapes) - 2) and sum(rows_per_call) == 2 * queries
    expected = reference_for(module, prior, query, key, value, positions, key_valid=key_valid)
    torch.testing.assert_close(output.double(), expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("theta_beta", [-3.0, -9.0])
@pytest.mark.parametrize("ssmax", [True, False])
def test_float32_prior_gradient_with_single_key_rows_and_negative_beta(ssmax, theta_beta):
    """float32, beta = -3: the prior at distance 0 is ~-1e15 and its beta-gradient ~1e16, so a row that sees only
    its own key (every document's first token) must contribute exactly zero, as the softmax backward gives; beta = -9
    (a retrieval head's, reached in training): ~-1e45, past float32's range, finite in the float64 reference.
    Gradients of the prior and SSMax scale against the float64 reference, per head."""
    module, prior = attention_module(theta_beta, ssmax=ssmax)
    query, key, value = random_qkv(2, 4, 2, 24, 24, 8, torch.float32, seed=5)
    positions = torch.arange(24)
    document_ids = torch.tensor([[0] * 9 + [1] * 10 + [2] * 5, [0] * 3 + [1] * 21])
    parameters = [prior.theta_alpha, prior.theta_beta] + ([module.ssmax.scale] if ssmax else [])
    weights = torch.randn(2, 4, 24, 8, generator=torch.Generator().manual_seed(6))
    actual = run_sdpa_path(module, prior, query, key, value, positions, document_ids=document_ids)
    actual_grads = torch.autograd.grad((actual * weights).sum(), parameters)
    expected = reference_for(module, prior, query, key, value, positions, document_ids=document_ids)
    torch.testing.assert_close(actual.double(), expected, atol=1e-5, rtol=1e-4)
    expected_grads = torch.autograd.grad((expected * weights.double()).sum(), parameters)
    for name, got, want in zip(["theta_alpha", "theta_beta", "ssmax_scale"], actual_grads, expected_grads):
        for head in range(4):
            torch.testing.assert_close(
                got[head].double(), want[head].double(), atol=1e-4 * float(want.abs().max()) + 1e-6, rtol=1e-3,
                msg=lambda m: f"gradient of {name}, head {head}: {m}",
            )


def test_blocked_attention_with_dropout_has_the_gradient_of_its_own_random_masks():
    """Attention dropout with a trained prior: each block is replayed in the backward pass with the forward's
    random state. Checked by central differences in float64, re-seeding before every evaluation so that every
    forward draws the same dropout masks: a backward with other masks (or none) gives another gradient."""
    heads, kv_heads, length, head_dim = 4, 2, 11, 8
    query, key, value = random_qkv(2, heads, kv_heads, length, length, head_dim, torch.float64, seed=7)
    theta_beta = torch.tensor([-1.5, -0.5, 0.8, 2.0], dtype=torch.float64, requires_grad=True)
    ssmax_scale = torch.tensor([0.9, 1.1, 0.7, 1.3], dtype=torch.float64, requires_grad=True)
    weights = torch.randn(2, heads, length, head_dim, dtype=torch.float64, generator=torch.Generator().manual_seed(8))

    def loss(beta, scale, q, seed=123):
        torch.manual_seed(seed)
        flat = torch.zeros(heads, dtype=torch.float64)
        table = ggd_bias(torch.arange(-(length - 1), 1), flat, beta, flat)
        output = bam_attention_blocked(
            q, key, value, torch.arange(length), table.double(), head_dim**-0.5, ssmax_scale=scale, dropout=0.3,
            block_rows=3, block_heads=2,
        )
        return (output * weights).sum()

    query.requires_grad_(True)
    grads = torch.autograd.grad(loss(theta_beta, ssmax_scale, query), [theta_beta, ssmax_scale, query])
    with torch.no_grad():  # dropout is on: another seed drops other probabilities
        assert abs(float(loss(theta_beta, ssmax_scale, query) - loss(theta_beta, ssmax_scale, query, seed=124))) > 1e-3
    with torch.no_grad():
        for name, index, grad in [("theta_beta", 0, grads[0]), ("ssmax_scale", 1, grads[1])]:
            for head in range(heads):
                step = torch.zeros(heads, dtype=torch.float64)
                step[head] = 1e-4
                args_plus = [theta_beta, ssmax_scale, query]
                args_minus = [theta_beta, ssmax_scale, query]
                args_plus[index] = args_plus[index] + step
                args_minus[index] = args_minus[index] - step
                numeric = (loss(*args_plus) - loss(*args_minus)) / 2e-4
                assert abs(float(grad[head]) - float(numeric)) < 2e-3 * (1 + abs(float(numeric))), (name, head)
        direction = torch.randn(query.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
        shifted = [loss(theta_beta, ssmax_scale, query + sign * 1e-5 * direction) for sign in (1, -1)]
        numeric = (shifted[0] - shifted[1]) / 2e-5
        torch.testing.assert_close((grads[2] * direction).sum(), numeric, atol=1e-5, rtol=1e-5)


# Several forward blocks (5 query rows) and several backward blocks (4 rows, not aligned with the forward's), so
# that every block boundary of the prior-gradient backward is crossed; a cache offset shifts every position.
SEVERAL_BLOCK_CASES = {
    **{name: options for name, options in BLOCKED_CASES.items() if not options.get("frozen")},
    "padded_packed_cache_offset": dict(ssmax=True, padded=True, packed=True, offset=6),
    # no row factor: the written mask is the table's windows, the hidden keys and (key tiles) the row shift alone
    "prior_padded_packed_cache_offset": dict(ssmax=False, padded=True, packed=True, offset=6),
}


def several_block_inputs(options, q_len=23, seed=11):
    """float64 q, k, v, positions, trained prior/SSMax parameters (theta_mu included), key_valid, document_ids."""
    heads, kv_heads, head_dim, offset = 4, 2, 8, options.get("offset", 0)
    k_len = q_len + offset
    query, key, value = random_qkv(2, heads, kv_heads, q_len, k_len, head_dim, torch.float64, seed=seed)
    parameters = {
        "theta_alpha": torch.tensor([-1.2, -0.3, 0.4, 0.9], dtype=torch.float64),
        "theta_beta": torch.tensor([-1.5, -0.4, 0.6, 1.8], dtype=torch.float64),
        "theta_mu": torch.tensor([0.25, -0.35, 0.0, 0.15], dtype=torch.float64),
        "ssmax_scale": torch.tensor([0.8, 1.2, 0.6, 1.1], dtype=torch.float64),
    }
    if not options["ssmax"]:
        del parameters["ssmax_scale"]
    for tensor in [query, key, value, *parameters.values()]:
        tensor.requires_grad_(True)
    key_valid = document_ids = None
    if options.get("padded"):
        key_valid = torch.ones(2, k_len, dtype=torch.long)
        key_valid[0, :3] = 0
        key_valid[1, :9] = 0  # crosses the first forward and backward blocks
    if options.get("packed"):
        cuts = [(0, 7, 15, k_len), (0, 11, 12, k_len)]  # a one-token document in row 1
        document_ids = torch.stack([
            torch.cat([torch.full((end - begin,), d) for d, (begin, end) in enumerate(zip(c[:-1], c[1:]))])
            for c in cuts
        ])
    return query, key, value, torch.arange(offset, k_len), parameters, key_valid, document_ids


def blocked_output(query, key, value, positions, parameters, options, key_valid, document_ids, **kwargs):
    table = ggd_bias(
        torch.arange(-int(positions[-1]), 1), parameters["theta_alpha"], parameters["theta_beta"],
        parameters["theta_mu"],
    ).double()
    return bam_attention_blocked(
        query, key, value, positions, table, query.shape[-1] ** -0.5, ssmax_scale=parameters.get("ssmax_scale"),
        ssmax_prior=options.get("ssmax_prior", True), key_valid=key_valid, document_ids=document_ids, **kwargs,
    )


def assert_gradients_per_head(names, actual_grads, expected_grads, atol=1e-5, rtol=1e-4):
    """q, k, v per element; every (H,) parameter per head, so that one wrong head cannot hide behind the others."""
    for name, got, want in zip(names, actual_grads, expected_grads):
        if got.dim() == 1:
            for head in range(got.shape[0]):
                torch.testing.assert_close(
                    got[head].double(), want[head].double(), atol=atol * (1 + float(want.abs().max())), rtol=rtol,
                    msg=lambda m: f"gradient of {name}, head {head}: {m}",
                )
        else:
            torch.testing.assert_close(
                got.double(), want.double(), atol=atol, rtol=rtol, msg=lambda m: f"gradient of {name}: {m}"
            )


def assert_output_and_gradients_match_reference(
    actual, query, key, value, positions, parameters, options, key_valid, document_ids, seed, **dropout
):
    """`actual` (B, H, Lq, D) float64 and its gradients (a random projection of the output) against the float64
    reference's, for q, k, v and every (H,) parameter in `parameters`."""
    expected = reference_attention(
        query, key, value, positions, *(parameters[n] for n in ("theta_alpha", "theta_beta", "theta_mu")),
        parameters.get("ssmax_scale"), options.get("ssmax_prior", True), key_valid, document_ids, **dropout,
    )
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    inputs = [query, key, value, *parameters.values()]
    weights = torch.randn(expected.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    actual_grads = torch.autograd.grad((actual * weights).sum(), inputs)
    expected_grads = torch.autograd.grad((expected * weights).sum(), inputs)
    assert_gradients_per_head(["q", "k", "v", *parameters], actual_grads, expected_grads)


@pytest.mark.parametrize("case", list(SEVERAL_BLOCK_CASES))
def test_prior_gradients_across_several_forward_and_backward_blocks(monkeypatch, case):
    """The prior-gradient backward walks the queries in blocks of BACKWARD_BLOCK_ROWS (64 by default) and adds each
    block's dS diagonals into the prior table: with 4 rows a block here, 23 queries cross 5 backward boundaries and
    4 forward ones (5 rows a block). Every trained parameter (theta_alpha, theta_beta, theta_mu, SSMax scale) and
    q, k, v against the float64 reference."""
    import bam_llama.model.blocked_bam as attention

    monkeypatch.setattr(attention, "BACKWARD_BLOCK_ROWS", 4)
    options = SEVERAL_BLOCK_CASES[case]
    query, key, value, positions, parameters, key_valid, document_ids = several_block_inputs(options)
    actual = blocked_output(query, key, value, positions, parameters, options, key_valid, document_ids, block_rows=5)
    assert_output_and_gradients_match_reference(
        actual, query, key, value, positions, parameters, options, key_valid, document_ids, seed=12
    )


@pytest.mark.parametrize("case", list(SEVERAL_BLOCK_CASES))
@pytest.mark.parametrize("block_shape", [(None, None), (5, 2)])
def test_inference_over_key_tiles_matches_float64_reference(monkeypatch, case, block_shape):
    """Without gradients, a long block whose mask is written out runs over tiles of its keys, each tile's output
    merged through SDPA's log-sum-exp. With tiles of 4 keys past 8 (23 queries, blocks of 5 or the default), every
    block crosses several tiles and its last tile the diagonal; padding, packed documents, SSMax counts and a cache
    offset against the float64 reference, per element. View masks (no SSMax on the prior, no padding, no
    documents) keep one SDPA call a block."""
    import bam_llama.model.blocked_bam as attention

    monkeypatch.setattr(attention, "KEY_TILE", 4)
    monkeypatch.setattr(attention, "KEY_TILED_AFTER", 8)
    tiles = []
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

    def counting_flash(query, key, *args, **kwargs):
        tiles.append(key.shape[2])
        return flash(query, key, *args, **kwargs)

    monkeypatch.setattr(attention.torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", counting_flash)
    options = SEVERAL_BLOCK_CASES[case]
    query, key, value, positions, parameters, key_valid, document_ids = several_block_inputs(options)
    rows, heads = block_shape
    with torch.no_grad():
        actual = blocked_output(
            query, key, value, positions, parameters, options, key_valid, document_ids, block_rows=rows,
            block_heads=heads,
        )
        expected = reference_attention(
            query, key, value, positions, *(parameters[n] for n in ("theta_alpha", "theta_beta", "theta_mu")),
            parameters.get("ssmax_scale"), options.get("ssmax_prior", True), key_valid, document_ids,
        )
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)  # the table is float32: as the other paths
    mask_is_view = not (options["ssmax"] and options.get("ssmax_prior", True)) and not (
        options.get("padded") or options.get("packed")
    )
    assert (len(tiles) == 0) == mask_is_view
    assert all(width <= 4 + (rows or 23) for width in tiles)


@pytest.mark.parametrize("padded_packed", [False, True])
def test_model_sdpa_prior_gradients_at_default_blocks_on_a_long_sequence(padded_packed):
    """The model's own sdpa call at its default block sizes, float32: 150 queries are 3 backward blocks (64 rows)
    and, with a materialized mask (padding / packed documents with SSMax), 5 forward blocks. theta_mu trains."""
    module, prior = attention_module(theta_beta=0.0, ssmax=True)
    with torch.no_grad():
        prior.theta_beta.copy_(torch.tensor([-0.8, 0.3, 0.9, 1.4]))
    prior.theta_mu.requires_grad_(True)
    length = 150
    query, key, value = random_qkv(2, 4, 2, length, length, 8, torch.float32, seed=13)
    for tensor in (query, key, value):
        tensor.requires_grad_(True)
    positions = torch.arange(length)
    key_valid = document_ids = None
    if padded_packed:
        key_valid = torch.ones(2, length, dtype=torch.long)
        key_valid[1, :70] = 0  # row 1's queries start in the second backward block
        document_ids = torch.tensor([[0] * 50 + [1] * 100, [0] * 120 + [1] * 30])
    parameters = [prior.theta_alpha, prior.theta_beta, prior.theta_mu, module.ssmax.scale]
    weights = torch.randn(2, 4, length, 8, generator=torch.Generator().manual_seed(14))
    actual = run_sdpa_path(module, prior, query, key, value, positions, key_valid, document_ids)
    expected = reference_for(module, prior, query, key, value, positions, key_valid, document_ids)
    torch.testing.assert_close(actual.double(), expected, atol=2e-5, rtol=1e-4)
    inputs = [query, key, value, *parameters]
    actual_grads = torch.autograd.grad((actual * weights).sum(), inputs)
    expected_grads = torch.autograd.grad((expected * weights.double()).sum(), inputs)
    names = ["q", "k", "v", "theta_alpha", "theta_beta", "theta_mu", "ssmax_scale"]
    assert_gradients_per_head(names, actual_grads, expected_grads, atol=1e-4, rtol=1e-3)


def dropout_keep_pattern(query, key, parameters, positions, options, key_valid, document_ids, seed, **kwargs):
    """Which probabilities the code's dropout kept, (B, H, Lq, Lk) bool: the same call under the same seed, with
    values that are one-hot per key (value = identity), so that its output IS the dropped probability matrix.
    The random draws depend on the probabilities' shapes and the call order only, not on the values."""
    batch, kv_heads, k_len, _ = key.shape
    one_hot = torch.eye(k_len, dtype=torch.float64).expand(batch, kv_heads, k_len, k_len)
    torch.manual_seed(seed)
    with torch.no_grad():
        dropped = blocked_output(query, key, one_hot, positions, parameters, options, key_valid, document_ids, **kwargs)
    return dropped != 0


@pytest.mark.parametrize("case", ["left_padding", "packed_documents", "padded_packed_cache_offset"])
def test_dropout_gradients_with_padding_and_documents_under_the_same_random_masks(case):
    """Attention dropout with a trained prior, on padded / packed sequences of several blocks: output and gradients
    (every theta, SSMax scale, q, k, v) against the float64 reference given the code's own keep pattern. The keep
    pattern is read off a forward with one-hot values under the same seed (see `dropout_keep_pattern`); the
    reference hides padded keys itself, so a dropout path that forgets the padding mask fails."""
    options = SEVERAL_BLOCK_CASES[case]
    query, key, value, positions, parameters, key_valid, document_ids = several_block_inputs(options, seed=15)
    p, seed, blocks = 0.3, 1234, dict(block_rows=5, block_heads=2, dropout=0.3)
    keep = dropout_keep_pattern(query, key, parameters, positions, options, key_valid, document_ids, seed, **blocks)
    nonzero = dropout_keep_pattern(
        query, key, parameters, positions, options, key_valid, document_ids, seed, **{**blocks, "dropout": 0.0}
    )
    assert 0.6 < keep.sum() / nonzero.sum() < 0.8  # about 1 - p of the non-zero probabilities kept
    torch.manual_seed(seed)
    actual = blocked_output(query, key, value, positions, parameters, options, key_valid, document_ids, **blocks)
    assert_output_and_gradients_match_reference(
        actual, query, key, value, positions, parameters, options, key_valid, document_ids, seed=16,
        dropout=p, dropout_keep=keep,
    )
