"""The fused CPU kernel (`fused_cpu_bam`, BAM's float32 inference on the CPU) against the suite's float64 reference
(tests/reference.py): shapes past its query block (128 rows) and key tile (512 keys), so that blocks meet several
tiles and rows whose every key of a tile is in their future; GQA groups, SSMax on the prior or on q.k only, left
padding, a cache offset, rows that see one key or none."""

import functools

import pytest
import reference
import torch
import torch.utils.cpp_extension
from helpers import fused_kernel_calls, tiny_model

from bam_llama.model import cpu_kernels_bam, fused_cpu_bam
from bam_llama.model.attention_route_bam import bam_attention_blocked
from bam_llama.model.prior_bam import ggd_bias

pytestmark = pytest.mark.usefixtures("cpu_kernels")  # built ahead by tests/conftest.py

THETAS = {
    "theta_alpha": torch.tensor([-1.2, -0.3, 0.4, 0.9, -2.0, 0.1, 1.3, -0.7]),
    "theta_beta": torch.tensor([-1.5, -0.4, 0.6, 1.8, 0.0, 0.3, -0.9, 1.1]),
    "theta_mu": torch.tensor([0.0, 0.3, 0.0, -0.2, 0.1, 0.0, 0.0, 0.4]),
}
SSMAX_SCALE = torch.tensor([0.6, 1.4, 0.9, 1.1, 0.8, 1.2, 0.5, 1.0])

CASES = {
    # name: (heads, kv_heads, queries, cache offset, ssmax, ssmax_prior, padded, packed)
    "ssmax_prior_gqa2_offset": (4, 2, 300, 400, True, True, False, False),
    "ssmax_prior_padded_gqa4": (8, 2, 280, 250, True, True, True, False),
    "ssmax_on_qk_gqa1_padded": (4, 4, 200, 330, True, False, True, False),
    "prior_only_gqa2_no_offset": (4, 2, 600, 0, False, True, False, False),
    "prior_only_padded_gqa2": (4, 2, 150, 600, False, True, True, False),
    "ssmax_prior_packed_gqa2": (4, 2, 700, 0, True, True, False, True),
    "ssmax_on_qk_packed_padded_offset": (4, 2, 300, 400, True, False, True, True),
}
# packed rows: documents start at these keys (within a tile, on a tile's first key, past a block of rows)
DOCUMENT_STARTS = ([137, 512, 530], [300, 601])


def document_ids_for(keys: int) -> torch.Tensor:
    ids = torch.zeros(2, keys, dtype=torch.long)
    for row, starts in enumerate(DOCUMENT_STARTS):
        for start in starts:
            ids[row, start:] += 1
    return ids


def inputs(heads, kv_heads, queries, offset, padded, head_dim=8, seed=3):
    generator = torch.Generator().manual_seed(seed)
    keys = queries + offset
    query = torch.randn(2, heads, queries, head_dim, generator=generator)
    key, value = (torch.randn(2, kv_heads, keys, head_dim, generator=generator) for _ in range(2))
    positions = torch.arange(offset, keys)
    key_valid = None
    if padded:  # row 1 left-padded past the first queries: they see no key, the next one key
        key_valid = torch.ones(2, keys, dtype=torch.long)
        key_valid[1, : offset + 5] = 0
    return query, key, value, positions, key_valid


@pytest.mark.parametrize("case", list(CASES))
def test_fused_kernel_matches_float64_reference(monkeypatch, case):
    heads, kv_heads, queries, offset, ssmax, ssmax_prior, padded, packed = CASES[case]
    query, key, value, positions, key_valid = inputs(heads, kv_heads, queries, offset, padded)
    document_ids = document_ids_for(queries + offset) if packed else None
    thetas = {name: value[:heads] for name, value in THETAS.items()}
    scale = SSMAX_SCALE[:heads] if ssmax else None
    table = ggd_bias(torch.arange(-int(positions[-1]), 1), **thetas)
    calls = fused_kernel_calls(monkeypatch)
    with torch.no_grad():
        output = bam_attention_blocked(
            query, key, value, positions, table, query.shape[-1] ** -0.5, ssmax_scale=scale,
            ssmax_prior=ssmax_prior, key_valid=key_valid, document_ids=document_ids,
        )
    assert calls == [tuple(query.shape)]
    expected = reference.bam_attention(
        query, key, value, positions, **thetas, ssmax_scale=scale, ssmax_prior=ssmax_prior, key_valid=key_valid,
        document_ids=document_ids,
    )
    actual = output.double()
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-4)  # the table is float32: as blocked SDPA
    if padded:  # queries on padding see no key: zeros; the first real one sees itself: its value vector
        assert (actual[1, :, :5] == 0).all()
        own_value = value[1, torch.arange(heads) // (heads // kv_heads), offset + 5].double()
        torch.testing.assert_close(actual[1, :, 5], own_value, atol=1e-6, rtol=1e-6)


def reference_gradients(
    query, key, value, positions, thetas, scale, ssmax_prior, key_valid, document_ids, grad_output
):
    parameters = [query, key, value, *thetas.values()] + ([scale] if scale is not None else [])
    expected = reference.bam_attention(
        query, key, value, positions, **thetas, ssmax_scale=scale, ssmax_prior=ssmax_prior, key_valid=key_valid,
        document_ids=document_ids,
    )
    return expected, torch.autograd.grad(expected, parameters, grad_output.double())


@pytest.mark.parametrize("case", list(CASES))
def test_fused_gradients_match_float64_reference(monkeypatch, case):
    """The kernel's backward: dQ, dK, dV per element, the prior's parameters and the SSMax scales per head."""
    heads, kv_heads, queries, offset, ssmax, ssmax_prior, padded, packed = CASES[case]
    query, key, value, positions, key_valid = inputs(heads, kv_heads, queries, offset, padded)
    document_ids = document_ids_for(queries + offset) if packed else None
    for tensor in (query, key, value):
        tensor.requires_grad_()
    thetas = {name: value[:heads].clone().requires_grad_() for name, value in THETAS.items()}
    scale = SSMAX_SCALE[:heads].clone().requires_grad_() if ssmax else None
    calls = fused_kernel_calls(monkeypatch)
    table = ggd_bias(torch.arange(-int(positions[-1]), 1), **thetas)
    output = bam_attention_blocked(
        query, key, value, positions, table, query.shape[-1] ** -0.5, ssmax_scale=scale, ssmax_prior=ssmax_prior,
        key_valid=key_valid, document_ids=document_ids,
    )
    assert len(calls) == 1
    grad_output = torch.randn(output.shape, generator=torch.Generator().manual_seed(5))
    parameters = [query, key, value, *thetas.values()] + ([scale] if ssmax else [])
    actual = torch.autograd.grad(output, parameters, grad_output)
    expected_output, expected = reference_gradients(
        query, key, value, positions, thetas, scale, ssmax_prior, key_valid, document_ids, grad_output
    )
    torch.testing.assert_close(output.double(), expected_output, atol=2e-5, rtol=1e-4)
    names = ["query", "key", "value", *thetas] + (["ssmax scale"] if ssmax else [])
    for name, got, want in zip(names, actual, expected):
        if got.dim() == 1:  # per head: a wrong head cannot hide behind a large one
            for head in range(heads):
                torch.testing.assert_close(
                    got[head].double(), want[head].double(), atol=1e-5 * (1 + float(want.abs().max())), rtol=1e-4,
                    msg=lambda m: f"{name}, head {head}: {m}",
                )
        else:
            torch.testing.assert_close(got.double(), want.double(), atol=1e-4, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def test_dropout_unordered_documents_explicit_blocks_and_float64_keep_blocked_sdpa(monkeypatch):
    """Dropout, document ids that are not runs (an id back after another: the kernel knows a document by its first
    key), explicit block shapes and float64 run the blocked SDPA paths; a training call and an inference call run
    the kernel."""
    heads, kv_heads = 4, 2
    query, key, value, positions, _ = inputs(heads, kv_heads, 40, 10, False)
    table = ggd_bias(torch.arange(-int(positions[-1]), 1), **{n: v[:heads] for n, v in THETAS.items()})
    calls = fused_kernel_calls(monkeypatch)
    scaling = query.shape[-1] ** -0.5
    bam_attention_blocked(query, key, value, positions, table.requires_grad_(), scaling, dropout=0.1)
    bam_attention_blocked(query, key, value, positions, table, scaling, block_rows=8)
    unordered = torch.tensor([[0] * 20 + [1] * 10 + [0] * 20] * 2)
    with torch.no_grad():
        output = bam_attention_blocked(query, key, value, positions, table, scaling, document_ids=unordered)
    expected = reference.bam_attention(query, key, value, positions, **{n: v[:heads] for n, v in THETAS.items()},
                                       document_ids=unordered)
    torch.testing.assert_close(output.double(), expected, atol=2e-5, rtol=1e-4)
    with torch.no_grad():
        bam_attention_blocked(query.double(), key.double(), value.double(), positions, table.double(), scaling)
    assert calls == []
    bam_attention_blocked(query, key, value, positions, table, scaling).sum().backward()
    assert table.grad is not None and len(calls) == 1
    with torch.no_grad():
        bam_attention_blocked(query, key, value, positions, table, scaling)
    assert len(calls) == 2


def test_switched_off_or_unbuilt_the_model_runs_blocked_sdpa_alike(monkeypatch, tmp_path, caplog):
    """BAM_CPU_KERNELS=0 (or its former name BAM_FUSED_CPU=0), or no build for this installation: the same logits from
    blocked SDPA; an installation without a build says so in one line, once, naming the command that builds it, and
    the model runs without compiling anything."""
    model = tiny_model("sdpa", ssmax=True).eval()
    input_ids = torch.randint(0, model.config.vocab_size, (2, 300), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :7] = 0
    calls = fused_kernel_calls(monkeypatch)
    results = {}
    with torch.no_grad():
        results["fused"] = model(input_ids, attention_mask=attention_mask).logits
        assert len(calls) == model.config.num_hidden_layers
        for switch in (cpu_kernels_bam.SWITCH, cpu_kernels_bam.FORMER_SWITCH):
            monkeypatch.setenv(switch, "0")
            results[switch] = model(input_ids, attention_mask=attention_mask).logits
            monkeypatch.delenv(switch)
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # this installation's build is elsewhere
        monkeypatch.setattr(torch.utils.cpp_extension, "load", _no_compiling)
        monkeypatch.setattr(cpu_kernels_bam, "_said_not_built", False)
        monkeypatch.setattr(cpu_kernels_bam, "_loaded", set())  # a fresh process's
        monkeypatch.setattr(fused_cpu_bam, "_library", functools.cache(fused_cpu_bam._library.__wrapped__))
        results["unbuilt"] = model(input_ids, attention_mask=attention_mask).logits
        model(input_ids, attention_mask=attention_mask)
    lines = [record.getMessage() for record in caplog.records if "not built" in record.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0] and "Build the kernels once with: bam-build-kernels" in lines[0]
    assert str(tmp_path) in lines[0] and "blocked SDPA runs instead" in lines[0]
    assert len(calls) == model.config.num_hidden_layers
    eager = tiny_model("eager", ssmax=True).eval()
    with torch.no_grad():
        expected = eager(input_ids, attention_mask=attention_mask).logits
    keep = attention_mask.bool()
    for logits in results.values():
        torch.testing.assert_close(logits[keep], expected[keep], atol=1e-4, rtol=1e-4)


def _no_compiling(*arguments, **keywords):
    raise AssertionError("a forward compiled a kernel")


def test_two_threads_give_what_one_gives():
    """Tasks (a block of rows of one key/value group forward, one (batch, key/value head) pair backward) write only
    their own rows, keys and table gradients: the output and every gradient on 2 threads are those of 1 thread, up to
    the rounding of the BLAS's own blocking (a lost or doubled update would be off by the whole update)."""
    heads, kv_heads, queries, offset, ssmax, ssmax_prior, padded, packed = CASES["ssmax_on_qk_packed_padded_offset"]
    results = []
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            query, key, value, positions, key_valid = inputs(heads, kv_heads, queries, offset, padded)
            for tensor in (query, key, value):
                tensor.requires_grad_()
            thetas = {name: value[:heads].clone().requires_grad_() for name, value in THETAS.items()}
            scale = SSMAX_SCALE[:heads].clone().requires_grad_()
            table = ggd_bias(torch.arange(-int(positions[-1]), 1), **thetas)
            output = bam_attention_blocked(
                query, key, value, positions, table, 0.3, ssmax_scale=scale, ssmax_prior=True, key_valid=key_valid,
                document_ids=document_ids_for(queries + offset),
            )
            output.square().sum().backward()
            results.append([output, query.grad, key.grad, value.grad, scale.grad, *(t.grad for t in thetas.values())])
    finally:
        torch.set_num_threads(threads)
    for one, two in zip(*results):
        torch.testing.assert_close(two, one, atol=1e-5, rtol=1e-5)
