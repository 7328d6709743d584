"""T5's bucketed relative bias as a prior family (`prior_formula="t5_buckets"`): its buckets against T5's definition
(tests/reference.py, written from it) and Transformers' own T5, the prior module's tensor, the tables every path
reads (kept tables compared by value), decoding, saving and loading, and the paths that cannot run it refusing.
Each attention path against the float64 reference: the T5 cases of test_attention_route.py; eager and sdpa models
with gradients: test_modeling.py's "t5_buckets" variant."""

import pytest
import reference
import torch
from helpers import tiny_config, tiny_model
from transformers import AutoModelForCausalLM, DynamicCache, StaticCache
from transformers.models.t5.modeling_t5 import T5Attention

from bam_llama.model.prior_bam import is_prior_parameter, prior_table, t5_bucket
from bam_llama.model.prior_tables_bam import kernel_prior_tables

T5 = dict(prior_formula="t5_buckets", t5_num_buckets=8, t5_max_distance=12)
LARGE = [65_536, 65_537, 100_003, 1 << 20, 10_000_019]
SETTINGS = [(32, 128), (8, 12), (16, 40), (2, 3)]


@pytest.mark.parametrize("num_buckets, max_distance", SETTINGS)
def test_buckets_are_t5s_at_every_distance_to_2000_and_far(num_buckets, max_distance):
    distances = list(range(2001)) + LARGE
    got = t5_bucket(torch.tensor(distances), num_buckets, max_distance).tolist()
    assert got == [reference.t5_bucket(n, num_buckets, max_distance) for n in distances]
    t5 = T5Attention._relative_position_bucket(  # Transformers' T5 decoder: key j at relative position j - i
        -torch.tensor(distances), bidirectional=False, num_buckets=num_buckets, max_distance=max_distance
    )
    assert got == t5.tolist()


def test_t5s_default_buckets_at_the_exact_boundary_and_the_cap():
    buckets = t5_bucket(torch.tensor([0, 15, 16, 17, 23, 24, 127, 128, 65_536]), 32, 128).tolist()
    # 16 + floor(ln(n / 16) / ln(8) * 16): 17 -> 16 (0.47), 23 -> 18 (2.8), 24 -> 19 (3.1), 127 -> 31 (15.94)
    assert buckets == [0, 15, 16, 16, 18, 19, 31, 31, 31]


def test_a_fresh_t5_prior_is_zero_a_bucket_and_trains_unless_frozen():
    model = tiny_model("sdpa", prior_scope="layer", **T5)
    fresh = type(model)(model.config)  # randomized by tiny_model: a fresh one for the init
    prior = fresh.model.layers[0].self_attn.prior
    assert dict(prior.named_parameters()).keys() == {"bucket_bias"} and prior.bucket_bias.shape == (4, 8)
    assert torch.equal(prior.bucket_bias, torch.zeros(4, 8)) and prior.bucket_bias.dtype == torch.float32
    assert is_prior_parameter("model.layers.0.self_attn.prior.bucket_bias")
    assert is_prior_parameter("base_model.model.model.prior.modules_to_save.default.bucket_bias")
    frozen = type(model)(tiny_config(train_bucket_bias=False, **T5))
    assert dict(frozen.model.prior.named_buffers()).keys() == {"bucket_bias"}
    half = type(model)(tiny_config(**T5)).to(torch.bfloat16)
    assert half.model.prior.bucket_bias.dtype == torch.float32  # kept in float32 under 16-bit casts


def test_the_table_is_bucket_bias_by_head_and_bucket():
    """Row h of the table at distance -n is bucket_bias[h, bucket(n)], for the reference's buckets."""
    bucket_bias = torch.randn(3, 8)
    table = prior_table(40, (bucket_bias,), "t5_buckets", 1e-5, 12)  # distances -39 .. 0
    for n in range(40):
        torch.testing.assert_close(table[:, 39 - n], bucket_bias[:, reference.t5_bucket(n, 8, 12)])


@pytest.mark.parametrize("prior_scope", ["global", "layer"])
def test_a_kept_table_follows_a_changed_bucket_bias(prior_scope):
    """Eager CPU inference keeps the table (a prior per layer: one for all layers, `layer_tables`): changing one
    bucket's bias in place must change the next answer, as the eager implementation's materialized bias does."""
    model = tiny_model("sdpa", prior_scope=prior_scope, **T5)
    prior = model.model.prior if prior_scope == "global" else model.model.layers[1].self_attn.prior
    input_ids = torch.randint(0, 97, (1, 14))
    with torch.no_grad():
        before = model(input_ids).logits
        prior.bucket_bias[1, 7] += 3.0  # the cap bucket of head 1: distances 10 .. 13 here
        after = model(input_ids).logits
        model.set_attn_implementation("eager")
        eager = model(input_ids).logits
    assert not torch.allclose(before[:, 10:], after[:, 10:], atol=1e-4)
    torch.testing.assert_close(after, eager, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("cache_class", ["dynamic", "static"])
def test_step_by_step_decoding_of_a_t5_model_equals_its_full_forward(implementation, cache_class):
    model = tiny_model(implementation, prior_scope="layer", ssmax=True, **T5)
    input_ids = torch.randint(0, 97, (2, 17))  # past the cap (distance 10)
    with torch.no_grad():
        full = model(input_ids, use_cache=False).logits
        cache = DynamicCache(config=model.config) if cache_class == "dynamic" else StaticCache(
            config=model.config, max_cache_len=20
        )
        steps = [model(input_ids[:, t : t + 1], cache=cache, use_cache=True).logits for t in range(17)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_a_t5_model_saves_and_loads_exactly(tmp_path):
    model = tiny_model("sdpa", prior_scope="layer", train_bucket_bias=False, **T5)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.prior_formula == "t5_buckets"
    assert (loaded.config.t5_num_buckets, loaded.config.t5_max_distance) == (8, 12)
    original = model.state_dict()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, original[name]), name
    assert {name for name, _ in loaded.named_buffers()} == {f"model.layers.{i}.self_attn.prior.bucket_bias" for i in (0, 1)}
    input_ids = torch.randint(0, 97, (1, 15))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids).logits, model(input_ids).logits, atol=0, rtol=0)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(t5_num_buckets=1), "t5_num_buckets must be an integer >= 2, got 1"),
        (dict(t5_num_buckets=8.0), "t5_num_buckets"),
        (dict(t5_max_distance=4), "t5_max_distance must be an integer above t5_num_buckets // 2 = 4"),
        (dict(train_bucket_bias="yes"), "train_bucket_bias"),
        (dict(prior_formula="t5"), "prior_formula must be one of .*'t5_buckets'"),
    ],
)
def test_bad_t5_settings_are_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**{**T5, **overrides})


def test_kernels_of_the_three_thetas_refuse_t5_by_name():
    """Triton's tables (and anything else computing the prior from theta_alpha, theta_beta, theta_mu) name T5's
    buckets instead of computing a GGD from parameters a T5 prior does not have."""
    thetas = torch.zeros(4), torch.zeros(4), torch.zeros(4)
    with pytest.raises(ValueError, match="'t5_buckets' is a table of bucket biases"):
        kernel_prior_tables(*thetas, 16, "t5_buckets", 1e-5, True)
