"""The attention route (`attention_route_bam`): one case per path of its table, built where the table says the path
runs (device, dtype, gradients, compiling, one query, packed documents, padding, SSMax, GQA, a custom 4D mask, kernel
availability). Each case asserts that the route picks its path, and compares the output, and the gradients where the
path trains, per element with the suite's float64 reference (tests/reference.py). Triton runs in its interpreter.
"""

import dataclasses
import importlib.util

import pytest
import reference
import torch
from helpers import route_path_calls, tiny_config

from bam_llama.model import attention_route_bam, blocked_bam
from bam_llama.model.attention_route_bam import ATTENTION_PATHS, bam_attention_blocked
from bam_llama.model.dispatch_bam import (
    bam_eager_attention_forward, bam_sdpa_attention_forward, bam_triton_attention_forward,
)
from bam_llama.model.fused_cpu_bam import fused_cpu_available
from bam_llama.model.modeling_bam import BamAttention
from bam_llama.model.prior_bam import ggd_bias
from bam_llama.model.prior_modules_bam import BamPrior

BATCH, HEADS, KV_HEADS, HEAD_DIM = 2, 4, 2, 8  # two query heads a key/value head
PARAMETERS = {
    "theta_alpha": [-1.2, -0.3, 0.4, 0.9], "theta_beta": [-1.5, -0.4, 0.6, 1.8], "theta_mu": [0.25, -0.35, 0.0, 0.15],
    "ssmax_scale": [0.8, 1.2, 0.6, 1.1],
}
EVERYTHING = ("query", "key", "value", *PARAMETERS)


@dataclasses.dataclass(frozen=True)
class Case:
    """Inputs of a call to `bam_attention_blocked`: queries at positions offset .. offset + queries - 1."""

    dtype: torch.dtype = torch.float64
    queries: int = 13
    offset: int = 3
    trains: tuple = ()  # the inputs that require gradients
    ssmax: bool = True
    padded: bool = False
    packed: bool = False
    block_rows: int | None = None  # an explicit block shape (the fused kernel then stays out)
    dropout: float = 0.0
    compiled: bool = False
    fused_kernel: bool = False  # the case needs the fused CPU kernel built


PLANNED_CASES = {
    "decode_step_fused": Case(torch.float32, queries=1, offset=11, padded=True, fused_kernel=True),
    "decode_step": Case(queries=1, offset=11, padded=True),  # float64: the kernel is float32's
    "compiled_inference": Case(torch.float32, padded=True, compiled=True),
    "fused_cpu": Case(torch.float32, trains=EVERYTHING, packed=True, fused_kernel=True),
    "prior_gradient": Case(trains=EVERYTHING, padded=True, block_rows=5),
    "key_tiles": Case(padded=True, block_rows=5),  # past KEY_TILED_AFTER keys (lowered below)
    "blocks": Case(trains=("query", "key", "value"), ssmax=False, block_rows=5),  # a view mask: SDPA's backward
    "traced_blocks": Case(trains=EVERYTHING, padded=True, dropout=0.3, block_rows=5, compiled=True),
    "replayed_blocks": Case(trains=EVERYTHING, packed=True, dropout=0.3, block_rows=5),
}
MODULE_CASES = ("materialized", "traced_decode_step", "triton")


def test_every_path_of_the_route_has_a_case():
    assert set(PLANNED_CASES) | set(MODULE_CASES) == set(ATTENTION_PATHS)


def case_inputs(case: Case, seed=7):
    """q, k, v, positions, the (H,) parameters, key_valid, document_ids; the inputs `case.trains` require grad."""
    keys = case.offset + case.queries
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(BATCH, HEADS, case.queries, HEAD_DIM, generator=generator, dtype=torch.float64)
    key, value = (torch.randn(BATCH, KV_HEADS, keys, HEAD_DIM, generator=generator, dtype=torch.float64)
                  for _ in range(2))
    tensors = {"query": query.to(case.dtype), "key": key.to(case.dtype), "value": value.to(case.dtype)}
    tensors |= {name: torch.tensor(values, dtype=torch.float64) for name, values in PARAMETERS.items()}
    if not case.ssmax:
        del tensors["ssmax_scale"]
    for name in case.trains:
        if name in tensors:
            tensors[name].requires_grad_(True)
    key_valid = document_ids = None
    if case.padded:
        key_valid = torch.ones(BATCH, keys, dtype=torch.long)
        key_valid[1, :5] = 0  # left padding of row 1: its first queries see no key
    if case.packed:  # documents as runs of keys, one of a single token
        document_ids = torch.tensor([[0] * 6 + [1] * (keys - 6), [0] * 4 + [1] + [2] * (keys - 5)])
    return tensors, torch.arange(case.offset, keys), key_valid, document_ids


def expected_attention(tensors, positions, key_valid, document_ids, ssmax_prior=True, **dropout):
    return reference.bam_attention(
        tensors["query"], tensors["key"], tensors["value"], positions, tensors["theta_alpha"], tensors["theta_beta"],
        tensors["theta_mu"], ssmax_scale=tensors.get("ssmax_scale"), ssmax_prior=ssmax_prior, key_valid=key_valid,
        document_ids=document_ids, **dropout,
    )


def blocked_call(case: Case, tensors, positions, key_valid, document_ids, value=None, table=None):
    """`bam_attention_blocked` on the case's inputs (compiled with dynamo only where the case says): (B, H, Lq, D).
    The prior's table is the GGD's of the case's thetas unless given."""
    if table is None:
        parameters = (tensors[name] for name in ("theta_alpha", "theta_beta", "theta_mu"))
        table = ggd_bias(torch.arange(-int(positions[-1]), 1), *parameters)

    def attend(query, key, value, table):
        return bam_attention_blocked(
            query, key, value, positions, table, HEAD_DIM**-0.5, ssmax_scale=tensors.get("ssmax_scale"),
            key_valid=key_valid, document_ids=document_ids, dropout=case.dropout, block_rows=case.block_rows,
        )

    attend = torch.compile(attend, backend="eager", fullgraph=True) if case.compiled else attend
    return attend(tensors["query"], tensors["key"], tensors["value"] if value is None else value, table.to(case.dtype))


def dropout_keep(case: Case, tensors, positions, key_valid, document_ids, seed, table=None) -> torch.Tensor:
    """Which probabilities the path's dropout kept, (B, H, Lq, Lk): the same call under the same seed with values
    one-hot per key, so that its output is the dropped probability matrix."""
    keys = tensors["key"].shape[2]
    one_hot = torch.eye(keys, dtype=case.dtype).expand(BATCH, KV_HEADS, keys, keys)
    torch.manual_seed(seed)
    with torch.no_grad():
        table = None if table is None else table.detach()
        return blocked_call(case, tensors, positions, key_valid, document_ids, value=one_hot, table=table) != 0


def assert_matches(actual, expected, tensors, trains, tolerance):
    """Output per element, then the gradients of a random projection for every input that trains: q, k, v per
    element, each prior parameter per head ((H,), or T5's (H, buckets) by head)."""
    torch.testing.assert_close(actual.double(), expected, **tolerance)
    inputs = [tensors[name] for name in trains if name in tensors]
    if not inputs:
        return
    weights = torch.randn(expected.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    actual_grads = torch.autograd.grad((actual.double() * weights).sum(), inputs)
    expected_grads = torch.autograd.grad((expected * weights).sum(), inputs)
    for name, got, want in zip([n for n in trains if n in tensors], actual_grads, expected_grads):
        got, want = got.double(), want.double()
        if name in ("query", "key", "value"):
            torch.testing.assert_close(got, want, **tolerance, msg=lambda m: f"gradient of {name}: {m}")
            continue
        atol = tolerance["atol"] * (1 + float(want.abs().max()))  # a parameter's gradient sums every score's
        for head in range(got.shape[0]):
            torch.testing.assert_close(
                got[head], want[head], atol=atol, rtol=tolerance["rtol"], msg=lambda m: f"{name}, head {head}: {m}"
            )


@pytest.mark.parametrize("family", ["ggd", "t5"])
@pytest.mark.parametrize("path", list(PLANNED_CASES))
def test_the_route_picks_each_planned_path_and_it_matches_the_float64_reference(monkeypatch, path, family):
    """With the GGD table of PARAMETERS, and with the table of a T5 prior (`BamPrior.table`: bucket_bias gathered by
    bucket), bucket_bias trained where the case trains the prior (its gradient compared per head)."""
    case = PLANNED_CASES[path]
    if case.fused_kernel and not fused_cpu_available():
        pytest.skip("no C++ compiler to build the fused kernel")
    if path == "key_tiles":
        monkeypatch.setattr(blocked_bam, "KEY_TILE", 4)
        monkeypatch.setattr(blocked_bam, "KEY_TILED_AFTER", 8)
    torch._dynamo.reset()
    tensors, positions, key_valid, document_ids, trains, table, expected_of = planned_inputs(family, case)
    dropout_kwargs = {}
    if case.dropout:
        keep = dropout_keep(case, tensors, positions, key_valid, document_ids, seed=21, table=table)
        dropout_kwargs = dict(dropout=case.dropout, dropout_keep=keep)
    paths = route_path_calls(monkeypatch)
    torch.manual_seed(21)
    with torch.set_grad_enabled(bool(case.trains)):
        actual = blocked_call(case, tensors, positions, key_valid, document_ids, table=table)
    assert [name for name, _ in paths] == [path]
    tolerance = dict(atol=1e-5, rtol=1e-5) if case.dtype == torch.float64 else dict(atol=2e-5, rtol=1e-4)
    expected = expected_of(tensors, positions, key_valid, document_ids, **dropout_kwargs)
    assert_matches(actual, expected, tensors, trains, tolerance)


def planned_inputs(family: str, case: Case):
    """A planned case's tensors, positions, key_valid, document_ids, the inputs that train, the prior's table (None:
    `blocked_call`'s GGD of the thetas) and the family's float64 reference."""
    if family == "ggd":
        tensors, positions, key_valid, document_ids = case_inputs(case)
        return tensors, positions, key_valid, document_ids, case.trains, None, expected_attention
    prior = t5_prior(trained="theta_alpha" in case.trains)
    tensors, positions, key_valid, document_ids, trains = t5_tensors(case, prior)
    with torch.set_grad_enabled(bool(case.trains)):
        table = prior.table(int(positions[-1])).to(case.dtype)
    return tensors, positions, key_valid, document_ids, trains, table, t5_expected


def attention_module(ssmax=True):
    """A layer's attention and its prior (float32), the parameters PARAMETERS' and all of them trained."""
    config = tiny_config(
        hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, ssmax=ssmax,
        train_theta_mu=True,
    )
    module, prior = BamAttention(config, layer_idx=0), BamPrior(config)
    with torch.no_grad():
        for name in ("theta_alpha", "theta_beta", "theta_mu"):
            getattr(prior, name).copy_(torch.tensor(PARAMETERS[name]))
        if ssmax:
            module.ssmax.scale.copy_(torch.tensor(PARAMETERS["ssmax_scale"]))
    return module, prior


def module_tensors(module, prior, case: Case):
    tensors, positions, key_valid, document_ids = case_inputs(case)
    for name in ("theta_alpha", "theta_beta", "theta_mu"):
        tensors[name] = getattr(prior, name)
    tensors["ssmax_scale"] = module.ssmax.scale
    return tensors, positions, key_valid, document_ids


@pytest.mark.parametrize("family", ["ggd", "t5"])
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_a_custom_4d_mask_takes_the_materialized_path(monkeypatch, implementation, family):
    """The "sdpa" route's materialized path, and the "eager" implementation (which materializes the bias itself),
    for the GGD prior of PARAMETERS and a T5 prior (`BamPrior.bias`), gradients included."""
    case = Case(torch.float32, padded=True, trains=EVERYTHING)
    module, prior, tensors, positions, key_valid, trains, expected_of = prior_family(family, case)
    mask = reference.visible(positions, tensors["key"].shape[2], key_valid, batch=BATCH)[:, None]  # (B, 1, Lq, Lk)
    paths = route_path_calls(monkeypatch)
    forward = bam_sdpa_attention_forward if implementation == "sdpa" else bam_eager_attention_forward
    output, _ = forward(
        module, tensors["query"], tensors["key"], tensors["value"], mask, HEAD_DIM**-0.5, query_positions=positions,
        prior=prior, last_position=int(positions[-1]),
    )
    assert [name for name, _ in paths] == (["materialized"] if implementation == "sdpa" else [])
    expected = expected_of(tensors, positions, key_valid, None)
    assert_matches(output.transpose(1, 2), expected, tensors, trains, dict(atol=2e-5, rtol=1e-4))


@pytest.mark.parametrize("family", ["ggd", "t5"])
def test_a_compiled_static_cache_step_takes_the_traced_decode_step(monkeypatch, family):
    """One query at position 9 of a 16-slot cache, the position known only as a tensor: the route's operator reads
    it and attends to slots 0..9 (the unfilled ones hold noise here). The operator computes the prior from the three
    thetas: a T5 prior's step stays materialized, attending to the filled slots only too."""
    monkeypatch.setattr(attention_route_bam, "TRACED_DECODE_MIN_SLOTS", 8)
    case = Case(torch.float32, queries=1, offset=15)
    module, prior, tensors, _, _, _, expected_of = prior_family(family, case)
    positions = torch.tensor([9])
    graphs = []
    paths = route_path_calls(monkeypatch)

    def recording_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    @torch.compile(backend=recording_backend, fullgraph=True)
    def step(query, key, value):
        return bam_sdpa_attention_forward(
            module, query, key, value, None, HEAD_DIM**-0.5, query_positions=positions, prior=prior
        )[0]

    torch._dynamo.reset()
    with torch.no_grad():
        output = step(tensors["query"], tensors["key"], tensors["value"])
    targets = {node.target for graph in graphs for node in graph.graph.nodes if node.op == "call_function"}
    assert (torch.ops.bam_llama.traced_decode_step.default in targets) == (family == "ggd")
    assert [name for name, _ in paths] == ["traced_decode_step" if family == "ggd" else "materialized"]
    filled = {name: tensor[:, :, :10] if name in ("key", "value") else tensor for name, tensor in tensors.items()}
    expected = expected_of(filled, positions, None, None)
    torch.testing.assert_close(output.transpose(1, 2).double(), expected, atol=2e-5, rtol=1e-4)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_bam_triton_takes_the_triton_kernels_where_they_run(monkeypatch):
    """In Triton's interpreter (tiny float32 shapes), with padding, SSMax and GQA, gradients included; with dropout
    the route hands the same call to the "sdpa" paths."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    case = Case(torch.float32, queries=5, offset=2, padded=True, trains=EVERYTHING)
    module, prior = attention_module()
    tensors, positions, key_valid, _ = module_tensors(module, prior, case)
    paths = route_path_calls(monkeypatch)
    output, _ = bam_triton_attention_forward(
        module, tensors["query"], tensors["key"], tensors["value"], key_valid.bool(), HEAD_DIM**-0.5,
        query_positions=positions, prior=prior, last_position=int(positions[-1]),
    )
    assert [name for name, _ in paths] == ["triton"]
    expected = expected_attention(tensors, positions, key_valid, None)
    assert_matches(output.transpose(1, 2), expected, tensors, EVERYTHING, dict(atol=2e-5, rtol=1e-4))
    module.train()
    with torch.no_grad():
        bam_triton_attention_forward(
            module, tensors["query"], tensors["key"], tensors["value"], key_valid.bool(), HEAD_DIM**-0.5, dropout=0.5,
            query_positions=positions, prior=prior, last_position=int(positions[-1]),
        )
    assert paths[-1][0] != "triton"


# ---------------------------------------------------------------------------------------------- T5's buckets

# 4 exact buckets (distances 0-3), then wider ones: 4-5, 6, 7-9, and the last from 10 on (the cases see up to 15)
T5_BUCKETS = dict(prior_formula="t5_buckets", t5_num_buckets=8, t5_max_distance=12)
THETAS = ("theta_alpha", "theta_beta", "theta_mu")


def t5_prior(trained: bool) -> BamPrior:
    """A prior of T5's buckets (float32), its bucket_bias random and trained where asked."""
    config = tiny_config(
        hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        train_bucket_bias=trained, **T5_BUCKETS,
    )
    prior = BamPrior(config)
    with torch.no_grad():
        prior.bucket_bias.copy_(torch.randn(HEADS, 8, generator=torch.Generator().manual_seed(5)) * 2)
    return prior


def t5_tensors(case: Case, prior: BamPrior, module=None):
    """The case's inputs with the T5 prior's bucket_bias in place of the thetas (and `module`'s SSMax scale), and
    the inputs that train: bucket_bias where the case trains the prior."""
    tensors, positions, key_valid, document_ids = case_inputs(case)
    for name in THETAS:
        del tensors[name]
    tensors["bucket_bias"] = prior.bucket_bias
    if module is not None:
        tensors["ssmax_scale"] = module.ssmax.scale
    trains = tuple(name for name in case.trains if name not in THETAS)
    trains += ("bucket_bias",) if prior.bucket_bias.requires_grad else ()
    return tensors, positions, key_valid, document_ids, trains


def prior_family(family: str, case: Case):
    """A layer's attention with the GGD prior of PARAMETERS ("ggd") or a trained T5 prior ("t5"): (module, prior,
    the case's tensors, positions, key_valid, the inputs that train, the float64 reference of the family)."""
    module, prior = attention_module()
    if family == "ggd":
        tensors, positions, key_valid, _ = module_tensors(module, prior, case)
        return module, prior, tensors, positions, key_valid, case.trains, expected_attention
    prior = t5_prior(trained=True)
    tensors, positions, key_valid, _, trains = t5_tensors(case, prior, module)
    return module, prior, tensors, positions, key_valid, trains, t5_expected


def t5_expected(tensors, positions, key_valid, document_ids, **dropout):
    return reference.bam_attention(
        tensors["query"], tensors["key"], tensors["value"], positions, None, None, None, formula="t5_buckets",
        bucket_bias=tensors["bucket_bias"], t5_max_distance=T5_BUCKETS["t5_max_distance"],
        ssmax_scale=tensors.get("ssmax_scale"), key_valid=key_valid, document_ids=document_ids, **dropout,
    )


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_bam_triton_hands_t5_buckets_to_the_sdpa_paths(monkeypatch):
    """Triton's kernels compute the prior from the three thetas: where they would run, a T5 prior takes the rows
    below "triton" (here the prior's gradient, over its table), with the same result as the reference."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    case = Case(torch.float32, queries=5, offset=2, padded=True, trains=EVERYTHING)
    module, prior = attention_module()[0], t5_prior(trained=True)
    tensors, positions, key_valid, _, trains = t5_tensors(case, prior, module)
    paths = route_path_calls(monkeypatch)
    output, _ = bam_triton_attention_forward(
        module, tensors["query"], tensors["key"], tensors["value"], key_valid.bool(), HEAD_DIM**-0.5,
        query_positions=positions, prior=prior, last_position=int(positions[-1]),
    )
    assert [name for name, _ in paths] != ["triton"] and len(paths) == 1
    expected = t5_expected(tensors, positions, key_valid, None)
    assert_matches(output.transpose(1, 2), expected, tensors, trains, dict(atol=2e-5, rtol=1e-4))
