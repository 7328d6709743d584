"""GGD-BAM's attention forward as one fused CPU kernel (C++, built on first use with PyTorch's own compiler
tooling): queries in blocks, keys in tiles, an online softmax whose logits take the prior from the table and the
SSMax factor per row in the same pass that reads the scores. Nothing of size (Lq x Lk) is written to memory: where
SDPA's fused kernel must read a written mask (SSMax scaling the prior: c_i * b(j - i) differs per row), this kernel
reads a window of the (H, P + 1) table, which stays in cache.

Without gradients only (inference: forward, prefill, decoding); training keeps `blocked_bam`'s paths. The plain-
PyTorch reference it is tested against is `reference_bam.bam_attention_reference` (and the tests' own formula).

Shapes: B batch, H query heads, Hkv key/value heads, Lq queries, Lk keys, D head size; P = the last query's position.
"""

import functools
import hashlib
import os
import warnings

import torch

# Set to 0 to keep blocked SDPA everywhere (the kernel is then never built).
ENVIRONMENT_SWITCH = "BAM_FUSED_CPU"

_SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>
#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc);

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t QUERY_BLOCK = QUERY_BLOCK_ROWS;
constexpr int64_t KEY_TILE = KEY_TILE_KEYS;

// row-major C (m x n, ldc) = A (m x k, lda) . B^T, B (n x k, ldb): column-major C^T = B^T' . A
void scores_gemm(int m, int n, int k, const float* a, int lda, const float* b, int ldb, float* c, int ldc) {
  const float one = 1.0f, zero = 0.0f;
  sgemm_("T", "N", &n, &m, &k, &one, b, &ldb, a, &lda, &zero, c, &ldc);
}

// row-major C (m x n, ldc) += A (m x k, lda) . B (k x n, ldb)
void accumulate_gemm(int m, int n, int k, const float* a, int lda, const float* b, int ldb, float* c, int ldc) {
  const float one = 1.0f;
  sgemm_("N", "N", &n, &m, &k, &one, b, &ldb, a, &lda, &one, c, &ldc);
}

// logits[t] = score_scale * scores[t] + prior_scale * table[t] (+ key_bias[t]) for t < visible; returns their max
float write_logits(float* scores, const float* table, const float* key_bias, int64_t visible, float score_scale,
                   float prior_scale) {
  const Vec vs(score_scale), vp(prior_scale);
  Vec vmax(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + Vec::size() <= visible; t += Vec::size()) {
    Vec x = at::vec::fmadd(Vec::loadu(scores + t), vs, Vec::loadu(table + t) * vp);
    if (key_bias) x = x + Vec::loadu(key_bias + t);
    x.store(scores + t);
    vmax = at::vec::maximum(vmax, x);
  }
  float row_max = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, vmax);
  for (; t < visible; ++t) {
    float x = score_scale * scores[t] + prior_scale * table[t];
    if (key_bias) x += key_bias[t];
    scores[t] = x;
    row_max = std::max(row_max, x);
  }
  return row_max;
}

// scores[t] = exp(scores[t] - row_max) for t < visible, 0 for visible <= t < width; returns their sum
float exponentiate(float* scores, int64_t visible, int64_t width, float row_max) {
  const Vec vmax(row_max);
  Vec vsum(0.0f);
  int64_t t = 0;
  for (; t + Vec::size() <= visible; t += Vec::size()) {
    Vec p = (Vec::loadu(scores + t) - vmax).exp_u20();
    p.store(scores + t);
    vsum = vsum + p;
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, vsum);
  for (; t < visible; ++t) {
    scores[t] = std::exp(scores[t] - row_max);
    sum += scores[t];
  }
  if (width > visible) std::memset(scores + visible, 0, sizeof(float) * (width - visible));
  return sum;
}

// Probabilities below float32's normal range (a far key under a steep prior) are flushed to 0 while the kernel runs:
// as subnormal inputs of the P.V matmul they slowed a 4K-token call by 18% (BAM + SSMax, a linear prior).
class FlushSubnormals {
 public:
#if defined(__SSE__)
  FlushSubnormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040); }  // flush-to-zero, denormals-are-zero
  ~FlushSubnormals() { _mm_setcsr(saved_); }
 private:
  unsigned int saved_;
#endif
};

void scale_row(float* row, int64_t size, float factor) {
  at::vec::map([factor](Vec x) { return x * Vec(factor); }, row, row, size);
}

}  // namespace

// query (B, H, Lq, D), key / value (B, Hkv, Lk, D), table (H, P + 1) with P = first_position + Lq - 1: all contiguous
// float32. factor: (1 or B, H, Lq) or empty (c_i = 1); key_bias: (B, Lk) or empty. Returns (B, Lq, H, D).
at::Tensor bam_attention_forward(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                 const at::Tensor& table, const at::Tensor& factor, const at::Tensor& key_bias,
                                 double scaling, bool ssmax_prior, int64_t first_position) {
  const int64_t batch = query.size(0), heads = query.size(1), q_len = query.size(2), dim = query.size(3);
  const int64_t kv_heads = key.size(1), k_len = key.size(2), group = heads / kv_heads;
  const int64_t last = first_position + q_len - 1, table_len = table.size(1);
  TORCH_CHECK(table_len == last + 1 && last < k_len, "bam fused attention: table / positions / keys disagree");
  auto output = at::empty({batch, q_len, heads, dim}, query.options());
  const float* q = query.const_data_ptr<float>();
  const float* k = key.const_data_ptr<float>();
  const float* v = value.const_data_ptr<float>();
  const float* tab = table.const_data_ptr<float>();
  const bool has_factor = factor.numel() > 0, has_bias = key_bias.numel() > 0;
  const float* fac = has_factor ? factor.const_data_ptr<float>() : nullptr;
  const int64_t factor_batch = has_factor ? factor.size(0) : 0;
  const float* bias = has_bias ? key_bias.const_data_ptr<float>() : nullptr;
  float* out = output.data_ptr<float>();
  const int64_t blocks = (q_len + QUERY_BLOCK - 1) / QUERY_BLOCK;
  const int64_t max_rows = group * QUERY_BLOCK;

  at::parallel_for(0, batch * kv_heads * blocks, 1, [&](int64_t begin, int64_t end) {
    FlushSubnormals flush;
    std::vector<float> stacked(max_rows * dim), scores(max_rows * KEY_TILE), acc(max_rows * dim);
    std::vector<float> row_max(max_rows), row_sum(max_rows), score_scale(max_rows), prior_scale(max_rows);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / (kv_heads * blocks), kvh = (task / blocks) % kv_heads, blk = task % blocks;
      const int64_t first_row = blk * QUERY_BLOCK, rows = std::min(QUERY_BLOCK, q_len - first_row);
      const int64_t m = group * rows;
      for (int64_t g = 0; g < group; ++g) {
        const int64_t h = kvh * group + g;
        std::memcpy(stacked.data() + g * rows * dim, q + ((b * heads + h) * q_len + first_row) * dim,
                    sizeof(float) * rows * dim);
        for (int64_t r = 0; r < rows; ++r) {
          const float c = has_factor ? fac[((factor_batch > 1 ? b : 0) * heads + h) * q_len + first_row + r] : 1.0f;
          score_scale[g * rows + r] = static_cast<float>(scaling) * c;
          prior_scale[g * rows + r] = ssmax_prior ? c : 1.0f;
        }
      }
      std::fill(row_max.begin(), row_max.begin() + m, -std::numeric_limits<float>::infinity());
      std::fill(row_sum.begin(), row_sum.begin() + m, 0.0f);
      std::fill(acc.begin(), acc.begin() + m * dim, 0.0f);
      const float* k_head = k + (b * kv_heads + kvh) * k_len * dim;
      const float* v_head = v + (b * kv_heads + kvh) * k_len * dim;
      const int64_t block_keys = first_position + first_row + rows;  // keys 0 .. the block's last position
      for (int64_t first_key = 0; first_key < block_keys; first_key += KEY_TILE) {
        const int64_t width = std::min(KEY_TILE, block_keys - first_key);
        scores_gemm(m, width, dim, stacked.data(), dim, k_head + first_key * dim, dim, scores.data(), KEY_TILE);
        for (int64_t row = 0; row < m; ++row) {
          const int64_t g = row / rows, r = row % rows, h = kvh * group + g;
          const int64_t position = first_position + first_row + r;
          const int64_t visible = std::min(width, position - first_key + 1);
          float* s = scores.data() + row * KEY_TILE;
          if (visible <= 0) {  // every key of the tile is in this row's future
            std::memset(s, 0, sizeof(float) * width);
            continue;
          }
          // key j sits at table entry j - position + last
          const float* window = tab + h * table_len + (first_key - position + last);
          const float* key_row_bias = has_bias ? bias + b * k_len + first_key : nullptr;
          const float tile_max = write_logits(s, window, key_row_bias, visible, score_scale[row], prior_scale[row]);
          const float new_max = std::max(row_max[row], tile_max);
          const float correction = std::exp(row_max[row] - new_max);  // exp(-inf) = 0 on the first tile
          row_sum[row] = row_sum[row] * correction + exponentiate(s, visible, width, new_max);
          if (row_max[row] != new_max && first_key > 0) scale_row(acc.data() + row * dim, dim, correction);
          row_max[row] = new_max;
        }
        accumulate_gemm(m, dim, width, scores.data(), KEY_TILE, v_head + first_key * dim, dim, acc.data(), dim);
      }
      for (int64_t row = 0; row < m; ++row) {
        const int64_t g = row / rows, r = row % rows, h = kvh * group + g;
        float* o = out + ((b * q_len + first_row + r) * heads + h) * dim;
        const float inverse = row_sum[row] > 0.0f ? 1.0f / row_sum[row] : 0.0f;
        at::vec::map([inverse](Vec x) { return x * Vec(inverse); }, o, acc.data() + row * dim, dim);
      }
    }
  });
  return output;
}

TORCH_LIBRARY(LIBRARY_NAME, m) {
  m.def("forward(Tensor query, Tensor key, Tensor value, Tensor table, Tensor factor, Tensor key_bias, float scaling, "
        "bool ssmax_prior, int first_position) -> Tensor");
  m.impl("forward", c10::DispatchKey::CPU, &bam_attention_forward);
}
"""

QUERY_BLOCK_ROWS = 128
KEY_TILE_KEYS = 512


def _compile_flags() -> list[str]:
    capability = torch.backends.cpu.get_cpu_capability()
    flags = ["-O3", "-std=c++17"]
    if capability == "AVX512":
        flags += ["-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512", "-mavx512f", "-mavx512bw", "-mavx512vl",
                  "-mavx512dq", "-mfma"]
    elif capability == "AVX2":
        flags += ["-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2", "-mavx2", "-mfma", "-mf16c"]
    return flags


@functools.cache
def _library() -> str | None:
    """Builds (once per source, flags and PyTorch version; cached on disk by PyTorch) and loads the kernel; returns
    its operator namespace, or None where it cannot be built (no compiler): the caller keeps blocked SDPA."""
    flags = _compile_flags()
    digest = hashlib.sha256("\n".join([_SOURCE, *flags, torch.__version__]).encode()).hexdigest()[:12]
    name = f"bam_fused_cpu_{digest}"
    source = (
        _SOURCE.replace("QUERY_BLOCK_ROWS", str(QUERY_BLOCK_ROWS)).replace("KEY_TILE_KEYS", str(KEY_TILE_KEYS))
        .replace("LIBRARY_NAME", name)
    )
    try:
        from torch.utils.cpp_extension import load_inline

        load_inline(name, cpp_sources=[source], extra_cflags=flags, is_python_module=False, verbose=False)
    except Exception as error:  # noqa: BLE001 - no compiler, no headers: the blocked path stays
        warnings.warn(
            f"BAM's fused CPU attention could not be built ({type(error).__name__}: {str(error)[:200]}); "
            f"attention runs as blocked SDPA (set {ENVIRONMENT_SWITCH}=0 to skip the build)",
            stacklevel=3,
        )
        return None
    return name


def fused_cpu_available() -> bool:
    """Whether the kernel runs: not switched off (BAM_FUSED_CPU=0, read at every call), and built."""
    return os.environ.get(ENVIRONMENT_SWITCH, "1") != "0" and _library() is not None


def bam_attention_fused_cpu(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    first_position: int,
    prior_table: torch.Tensor,
    scaling: float,
    row_factor: torch.Tensor | None,
    ssmax_prior: bool,
    key_bias: torch.Tensor | None,
) -> torch.Tensor:
    """Attention of queries at positions first_position .. P against keys 0 .. P, float32, no gradients.

    Args:
        query: (B, H, Lq, D); key, value: (B, Hkv, Lk >= P + 1, D).
        prior_table: (H, P + 1) prior at distances -P .. 0.
        row_factor: (1 or B, H, Lq) SSMax factor c_i, or None.
        key_bias: (B, Lk) 0 for a key, a large negative score for padding, or None.
    Returns:
        (B, Lq, H, D).
    """
    name = _library()
    empty = query.new_empty(0)
    operator = getattr(torch.ops, name).forward
    return operator(
        query.contiguous(), key.contiguous(), value.contiguous(), prior_table.contiguous(),
        empty if row_factor is None else row_factor.contiguous(), empty if key_bias is None else key_bias.contiguous(),
        float(scaling), bool(ssmax_prior), int(first_position),
    )
