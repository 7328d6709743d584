"""A generated copy of the fused CPU kernel's C++ sources, model/csrc/'s cpu_kernel_common.h and fused_cpu.cpp.
Do not edit it: edit those files and run `.ci/kernel-source-copy`.

Why a copy: a saved folder's remote code is model/'s .py files only (`save_pretrained` copies modeling_bam.py and the
modules it imports relatively, and `trust_remote_code` loads nothing else), so where the package is not installed
cpu_kernels_bam.py builds the kernel from these strings. The package builds from the files; their texts are the
same, so both find the same build. tests/model/test_cpu_kernel_build.py fails while they differ.
"""

SOURCES = {
    "cpu_kernel_common.h": r"""// What every C++ CPU kernel of the package includes (model/csrc/fused_cpu.cpp, serving/csrc/paged_cpu.cpp): ATen's
// headers, the BLAS inside PyTorch, vector helpers. Built by model/cpu_kernels_bam.py; a saved folder's remote code
// carries a copy of this file in model/cpu_sources_bam.py.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc);

// MKL's, where PyTorch's BLAS is MKL: weak, so that another BLAS leaves it null
extern "C" int MKL_Set_Num_Threads_Local(int) __attribute__((weak));

namespace bam_cpu {

using Vec = at::vec::Vectorized<float>;
inline constexpr float MINUS_INFINITY = -std::numeric_limits<float>::infinity();

// Row-major C (m x n, ldc) = alpha op(A) op(B) + beta C, op(X) = X^T where transposed: column-major BLAS computes
// C^T = op(B)^T op(A)^T, whose operands are the row-major B and A as stored.
inline void gemm(bool transpose_a, bool transpose_b, int m, int n, int k, float alpha, const float* a,
                 int lda, const float* b, int ldb, float beta, float* c, int ldc) {
  sgemm_(transpose_b ? "T" : "N", transpose_a ? "T" : "N", &n, &m, &k, &alpha, b, &ldb, a, &lda, &beta, c, &ldc);
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

// Each task's matmuls on its own thread: MKL called from inside the kernel's parallel loop would otherwise start
// threads of its own beside PyTorch's (2 threads scaled a 2K x 8K call by 1.3x where SDPA scales by 1.9x)
class SequentialBlas {
 public:
  SequentialBlas() : saved_(MKL_Set_Num_Threads_Local ? MKL_Set_Num_Threads_Local(1) : 0) {}
  ~SequentialBlas() { if (MKL_Set_Num_Threads_Local) MKL_Set_Num_Threads_Local(saved_); }
 private:
  int saved_;
};

inline float reduce_max(Vec v) { return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, v); }
inline float reduce_sum(Vec v) { return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v); }

// logits[t] = scaling * scores[t] + prior_scale * table[t] (+ key_bias[t]) for t < visible; returns their max
inline float write_logits(float* scores, const float* table, const float* key_bias, int64_t visible,
                          float scaling, float prior_scale) {
  const Vec vs(scaling), vp(prior_scale);
  Vec vmax(MINUS_INFINITY);
  int64_t t = 0;
  for (; t + Vec::size() <= visible; t += Vec::size()) {
    Vec x = at::vec::fmadd(Vec::loadu(scores + t), vs, Vec::loadu(table + t) * vp);
    if (key_bias) x = x + Vec::loadu(key_bias + t);
    x.store(scores + t);
    vmax = at::vec::maximum(vmax, x);
  }
  float row_max = reduce_max(vmax);
  for (; t < visible; ++t) {
    float x = scaling * scores[t] + prior_scale * table[t];
    if (key_bias) x += key_bias[t];
    scores[t] = x;
    row_max = std::max(row_max, x);
  }
  return row_max;
}

// scores[t] = exp(scores[t] - shift) for lo <= t < visible, 0 elsewhere in 0 .. width - 1; returns their sum
inline float exponentiate(float* scores, int64_t lo, int64_t visible, int64_t width, float shift) {
  const Vec vshift(shift);
  Vec vsum(0.0f);
  if (lo > 0) std::memset(scores, 0, sizeof(float) * lo);
  int64_t t = lo;
  for (; t + Vec::size() <= visible; t += Vec::size()) {
    Vec p = (Vec::loadu(scores + t) - vshift).exp_u20();
    p.store(scores + t);
    vsum = vsum + p;
  }
  float sum = reduce_sum(vsum);
  for (; t < visible; ++t) {
    scores[t] = std::exp(scores[t] - shift);
    sum += scores[t];
  }
  if (width > visible) std::memset(scores + visible, 0, sizeof(float) * (width - visible));
  return sum;
}

inline float dot(const float* a, const float* b, int64_t size) {
  Vec acc(0.0f);
  int64_t t = 0;
  for (; t + Vec::size() <= size; t += Vec::size()) acc = at::vec::fmadd(Vec::loadu(a + t), Vec::loadu(b + t), acc);
  float sum = reduce_sum(acc);
  for (; t < size; ++t) sum += a[t] * b[t];
  return sum;
}

// y[t] += a * x[t]
inline void add_scaled(float* y, const float* x, float a, int64_t size) {
  const Vec va(a);
  int64_t t = 0;
  for (; t + Vec::size() <= size; t += Vec::size()) at::vec::fmadd(Vec::loadu(x + t), va, Vec::loadu(y + t)).store(y + t);
  for (; t < size; ++t) y[t] += a * x[t];
}

inline void scale_row(float* row, int64_t size, float factor) {
  at::vec::map([factor](Vec x) { return x * Vec(factor); }, row, row, size);
}

}  // namespace bam_cpu
""",
    "fused_cpu.cpp": r"""// GGD-BAM's attention as one fused CPU kernel, forward and backward; its Python wrapper and autograd are
// model/fused_cpu_bam.py, which also says what it computes.
#include "cpu_kernel_common.h"

namespace bam_cpu {
namespace {

constexpr int64_t QUERY_BLOCK = 128;  // rows of queries a task takes
constexpr int64_t KEY_TILE = 512;  // keys a block meets at once

// The shapes of one call and the rows of one block: `group` query heads of key/value head `kv_head` stacked, rows
// first_row .. first_row + rows - 1 of each (row = g * rows + r).
struct Problem {
  int64_t batch, heads, q_len, dim, kv_heads, k_len, group, first_position, last, table_len, table_stride, blocks,
      factor_batch;
  Problem(const at::Tensor& query, const at::Tensor& key, const at::Tensor& table, const at::Tensor& prior_factor,
          int64_t first) {
    batch = query.size(0), heads = query.size(1), q_len = query.size(2), dim = query.size(3);
    kv_heads = key.size(1), k_len = key.size(2), group = heads / kv_heads;
    first_position = first, last = first + q_len - 1, table_len = table.size(1), table_stride = table.stride(0);
    blocks = (q_len + QUERY_BLOCK - 1) / QUERY_BLOCK;
    factor_batch = prior_factor.numel() > 0 ? prior_factor.size(0) : 0;
    TORCH_CHECK(table_len == last + 1 && last < k_len && heads % kv_heads == 0,
                "bam fused attention: the table, the positions and the keys disagree");
  }
  int64_t head(int64_t kv_head, int64_t row, int64_t rows) const { return kv_head * group + row / rows; }
  // the first key row `query_row` of batch b may see: its document's first (0 without documents)
  int64_t document_start(const int64_t* key_start, int64_t b, int64_t query_row) const {
    return key_start ? key_start[b * q_len + query_row] : 0;
  }
  int64_t factor_index(int64_t b, int64_t h, int64_t query_row) const {
    return ((factor_batch > 1 ? b : 0) * heads + h) * q_len + query_row;
  }
  // the table entry of key first_key for the query at `position` (key j: j - position + P), in head h's row
  int64_t table_entry(int64_t h, int64_t first_key, int64_t position) const {
    return h * table_stride + first_key - position + last;
  }
};

// The keys of a tile (first_key .. first_key + width - 1) one row sees: lo .. visible - 1 of the tile, from its
// document's first key to its own position; none where visible <= lo.
struct TileKeys {
  int64_t lo, visible;
  TileKeys(int64_t row_start, int64_t position, int64_t first_key, int64_t width)
      : lo(std::max<int64_t>(0, row_start - first_key)), visible(std::min(width, position - first_key + 1)) {}
  bool none() const { return visible <= lo; }
  int64_t count() const { return visible - lo; }
};

// The first key tile any of a block's rows sees (tiles before it hold other documents' keys only)
int64_t first_tile(const std::vector<int64_t>& row_start, int64_t rows) {
  const int64_t first = *std::min_element(row_start.begin(), row_start.begin() + rows);
  return first / KEY_TILE * KEY_TILE;
}

void check_key_start(const at::Tensor& key_start, const at::Tensor& query) {
  TORCH_CHECK(key_start.numel() == 0 || (key_start.scalar_type() == at::kLong && key_start.is_contiguous() &&
                                         key_start.size(0) == query.size(0) && key_start.size(1) == query.size(2)),
              "key_start: contiguous int64 (B, Lq)");
}

// The forward reads the table's rows where they lie: a window of a longer kept table (rows apart in memory) is
// not copied. The backward, which writes a gradient laid out like the table, takes contiguous tables only.
void check_table_rows(const at::Tensor& table) {
  TORCH_CHECK(table.scalar_type() == at::kFloat && table.device().is_cpu() && table.dim() == 2 &&
                  (table.stride(1) == 1 || table.size(1) <= 1),
              "bam fused attention: the table is a float32 CPU tensor whose rows are contiguous");
}

at::Tensor or_empty(const std::optional<at::Tensor>& tensor, const at::TensorOptions& options) {
  return tensor.has_value() ? *tensor : at::empty({0}, options);
}

void check_inputs(const std::vector<at::Tensor>& tensors) {
  for (const auto& t : tensors)
    TORCH_CHECK(t.numel() == 0 || (t.scalar_type() == at::kFloat && t.is_contiguous() && t.device().is_cpu()),
                "bam fused attention takes contiguous float32 CPU tensors");
}

}  // namespace

// query (B, H, Lq, D) (the SSMax factor already in it), key / value (B, Hkv, Lk, D), table (H, P + 1) with
// P = first_position + Lq - 1, each row contiguous; prior_factor (1 or B, H, Lq) or None (the prior unscaled);
// key_bias (B, Lk) or None; key_start (B, Lq) or None (0). An absent input is None: an empty tensor made for it in
// Python would be one more operator in every decoding step.
// logit = scaling q.k + prior_factor * table[j - position + P] + key_bias[j]. Returns the output (B, Lq, H, D) and,
// with_lse, the log-sum-exp of every row (B, H, Lq) for the backward.
std::tuple<at::Tensor, at::Tensor> bam_attention_forward(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& table,
    const std::optional<at::Tensor>& prior_factor_, const std::optional<at::Tensor>& key_bias_,
    const std::optional<at::Tensor>& key_start_, double scaling_, int64_t first_position, bool with_lse) {
  const at::Tensor prior_factor = or_empty(prior_factor_, query.options());
  const at::Tensor key_bias = or_empty(key_bias_, query.options());
  const at::Tensor key_start = or_empty(key_start_, query.options().dtype(at::kLong));
  check_inputs({query, key, value, prior_factor, key_bias});
  check_table_rows(table);
  check_key_start(key_start, query);
  const Problem p(query, key, table, prior_factor, first_position);
  const float scaling = static_cast<float>(scaling_);
  auto output = at::empty({p.batch, p.q_len, p.heads, p.dim}, query.options());
  auto lse = with_lse ? at::empty({p.batch, p.heads, p.q_len}, query.options()) : at::empty({0}, query.options());
  const float *q = query.const_data_ptr<float>(), *k = key.const_data_ptr<float>();
  const float *v = value.const_data_ptr<float>(), *tab = table.const_data_ptr<float>();
  const float* fac = prior_factor.numel() ? prior_factor.const_data_ptr<float>() : nullptr;
  const float* bias = key_bias.numel() ? key_bias.const_data_ptr<float>() : nullptr;
  const int64_t* starts = key_start.numel() ? key_start.const_data_ptr<int64_t>() : nullptr;
  float* out = output.data_ptr<float>();
  float* lse_out = with_lse ? lse.data_ptr<float>() : nullptr;
  // buffers for the rows a block has: one query's `group` rows in a decoding step, whose buffers for a whole block
  // (0.5 MiB of scores, zeroed) cost more than its attention
  const int64_t max_rows = p.group * std::min(QUERY_BLOCK, p.q_len), dim = p.dim;

  at::parallel_for(0, p.batch * p.kv_heads * p.blocks, 1, [&](int64_t begin, int64_t end) {
    FlushSubnormals flush;
    SequentialBlas sequential;
    std::vector<float> stacked(max_rows * dim), scores(max_rows * KEY_TILE), acc(max_rows * dim);
    std::vector<float> row_max(max_rows), row_sum(max_rows), prior_scale(max_rows);
    std::vector<int64_t> row_start(max_rows);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / (p.kv_heads * p.blocks), kvh = (task / p.blocks) % p.kv_heads;
      const int64_t first_row = (task % p.blocks) * QUERY_BLOCK, rows = std::min(QUERY_BLOCK, p.q_len - first_row);
      const int64_t m = p.group * rows;
      for (int64_t row = 0; row < m; ++row) {
        const int64_t h = p.head(kvh, row, rows), r = row % rows;
        std::memcpy(stacked.data() + row * dim, q + ((b * p.heads + h) * p.q_len + first_row + r) * dim,
                    sizeof(float) * dim);
        prior_scale[row] = fac ? fac[p.factor_index(b, h, first_row + r)] : 1.0f;
        row_start[row] = p.document_start(starts, b, first_row + r);
      }
      std::fill(row_max.begin(), row_max.begin() + m, MINUS_INFINITY);
      std::fill(row_sum.begin(), row_sum.begin() + m, 0.0f);
      std::fill(acc.begin(), acc.begin() + m * dim, 0.0f);
      const float* k_head = k + (b * p.kv_heads + kvh) * p.k_len * dim;
      const float* v_head = v + (b * p.kv_heads + kvh) * p.k_len * dim;
      const int64_t block_keys = first_position + first_row + rows;  // keys 0 .. the block's last position
      for (int64_t first_key = first_tile(row_start, m); first_key < block_keys; first_key += KEY_TILE) {
        const int64_t width = std::min(KEY_TILE, block_keys - first_key);
        gemm(false, true, m, width, dim, 1.0f, stacked.data(), dim, k_head + first_key * dim, dim, 0.0f,
             scores.data(), KEY_TILE);
        for (int64_t row = 0; row < m; ++row) {
          const int64_t h = p.head(kvh, row, rows), position = first_position + first_row + row % rows;
          const TileKeys keys(row_start[row], position, first_key, width);
          float* s = scores.data() + row * KEY_TILE;
          if (keys.none()) {  // every key of the tile is in this row's future, or before its document
            std::memset(s, 0, sizeof(float) * width);
            continue;
          }
          const float* window = tab + p.table_entry(h, first_key, position);
          const float* key_row_bias = bias ? bias + b * p.k_len + first_key + keys.lo : nullptr;
          const float tile_max =
              write_logits(s + keys.lo, window + keys.lo, key_row_bias, keys.count(), scaling, prior_scale[row]);
          const float new_max = std::max(row_max[row], tile_max);
          const float correction = std::exp(row_max[row] - new_max);  // exp(-inf) = 0 on the row's first tile
          row_sum[row] = row_sum[row] * correction + exponentiate(s, keys.lo, keys.visible, width, new_max);
          if (row_max[row] != new_max) scale_row(acc.data() + row * dim, dim, correction);
          row_max[row] = new_max;
        }
        gemm(false, false, m, dim, width, 1.0f, scores.data(), KEY_TILE, v_head + first_key * dim, dim, 1.0f,
             acc.data(), dim);
      }
      for (int64_t row = 0; row < m; ++row) {
        const int64_t h = p.head(kvh, row, rows), r = row % rows;
        float* o = out + ((b * p.q_len + first_row + r) * p.heads + h) * dim;
        const float inverse = row_sum[row] > 0.0f ? 1.0f / row_sum[row] : 0.0f;
        at::vec::map([inverse](Vec x) { return x * Vec(inverse); }, o, acc.data() + row * dim, dim);
        if (lse_out) lse_out[(b * p.heads + h) * p.q_len + first_row + r] = row_max[row] + std::log(row_sum[row]);
      }
    }
  });
  return {output, lse};
}

// The gradients of bam_attention_forward: dQ (B, H, Lq, D), dK, dV (B, Hkv, Lk, D), d table (B, H, P + 1) (summed
// over the batch by the caller), d prior_factor (B, H, Lq) (empty unless asked for). grad_output and output:
// (B, Lq, H, D); lse: (B, H, Lq); single_key: (1 or B, Lq) uint8, 1 for a row that sees one key (its dS is 0 exactly:
// dP - rowsum(dO * O) is 0 there up to rounding, and the prior's gradient at distance 0 is ~1e16 for beta = -3).
// Flash-style: per block of rows, key tiles in order; P = exp(logit - lse), dP = dO V^T, dS = P (dP - rowsum(dO * O)),
// dV += P^T dO, dK += scaling dS^T Q, dQ += scaling dS K, d table[j - position + P] += prior_scale dS,
// d prior_factor += dS . table window. Every (batch, key/value head) pair is one task: its dK, dV are its own.
std::vector<at::Tensor> bam_attention_backward(
    const at::Tensor& grad_output, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const at::Tensor& output, const at::Tensor& lse, const at::Tensor& table, const at::Tensor& prior_factor,
    const at::Tensor& key_bias, const at::Tensor& key_start, const at::Tensor& single_key, double scaling_,
    int64_t first_position, bool table_grad, bool factor_grad) {
  check_inputs({grad_output, query, key, value, output, lse, table, prior_factor, key_bias});
  check_key_start(key_start, query);
  TORCH_CHECK(single_key.scalar_type() == at::kByte && single_key.is_contiguous(), "single_key: contiguous uint8");
  const Problem p(query, key, table, prior_factor, first_position);
  const float scaling = static_cast<float>(scaling_);
  auto grad_query = at::empty_like(query);
  auto grad_key = at::zeros_like(key), grad_value = at::zeros_like(value);
  auto grad_table = table_grad ? at::zeros({p.batch, p.heads, p.table_len}, table.options()) : at::empty({0}, table.options());
  auto grad_factor = factor_grad ? at::zeros({p.batch, p.heads, p.q_len}, query.options()) : at::empty({0}, query.options());
  const float *q = query.const_data_ptr<float>(), *k = key.const_data_ptr<float>();
  const float *v = value.const_data_ptr<float>(), *tab = table.const_data_ptr<float>();
  const float *dout = grad_output.const_data_ptr<float>(), *out = output.const_data_ptr<float>();
  const float* lse_in = lse.const_data_ptr<float>();
  const float* fac = prior_factor.numel() ? prior_factor.const_data_ptr<float>() : nullptr;
  const float* bias = key_bias.numel() ? key_bias.const_data_ptr<float>() : nullptr;
  const uint8_t* single = single_key.const_data_ptr<uint8_t>();
  const int64_t* starts = key_start.numel() ? key_start.const_data_ptr<int64_t>() : nullptr;
  const int64_t single_batch = single_key.size(0);
  float *dq = grad_query.data_ptr<float>(), *dk = grad_key.data_ptr<float>(), *dv = grad_value.data_ptr<float>();
  float* dtab = table_grad ? grad_table.data_ptr<float>() : nullptr;
  float* dfac = factor_grad ? grad_factor.data_ptr<float>() : nullptr;
  const int64_t max_rows = p.group * std::min(QUERY_BLOCK, p.q_len), dim = p.dim;

  at::parallel_for(0, p.batch * p.kv_heads, 1, [&](int64_t begin, int64_t end) {
    FlushSubnormals flush;
    SequentialBlas sequential;
    std::vector<float> stacked(max_rows * dim), grads(max_rows * dim), acc(max_rows * dim);
    std::vector<float> probs(max_rows * KEY_TILE), dscores(max_rows * KEY_TILE);
    std::vector<float> row_lse(max_rows), delta(max_rows), prior_scale(max_rows);
    std::vector<uint8_t> row_single(max_rows);
    std::vector<int64_t> row_start(max_rows);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / p.kv_heads, kvh = task % p.kv_heads;
      const float* k_head = k + (b * p.kv_heads + kvh) * p.k_len * dim;
      const float* v_head = v + (b * p.kv_heads + kvh) * p.k_len * dim;
      float* dk_head = dk + (b * p.kv_heads + kvh) * p.k_len * dim;
      float* dv_head = dv + (b * p.kv_heads + kvh) * p.k_len * dim;
      for (int64_t first_row = 0; first_row < p.q_len; first_row += QUERY_BLOCK) {
        const int64_t rows = std::min(QUERY_BLOCK, p.q_len - first_row), m = p.group * rows;
        for (int64_t row = 0; row < m; ++row) {
          const int64_t h = p.head(kvh, row, rows), r = row % rows, query_row = first_row + r;
          std::memcpy(stacked.data() + row * dim, q + ((b * p.heads + h) * p.q_len + query_row) * dim,
                      sizeof(float) * dim);
          const int64_t out_index = ((b * p.q_len + query_row) * p.heads + h) * dim;
          std::memcpy(grads.data() + row * dim, dout + out_index, sizeof(float) * dim);
          delta[row] = dot(dout + out_index, out + out_index, dim);
          row_lse[row] = lse_in[(b * p.heads + h) * p.q_len + query_row];
          prior_scale[row] = fac ? fac[p.factor_index(b, h, query_row)] : 1.0f;
          row_single[row] = single[(single_batch > 1 ? b : 0) * p.q_len + query_row];
          row_start[row] = p.document_start(starts, b, query_row);
        }
        std::fill(acc.begin(), acc.begin() + m * dim, 0.0f);
        const int64_t block_keys = first_position + first_row + rows;
        for (int64_t first_key = first_tile(row_start, m); first_key < block_keys; first_key += KEY_TILE) {
          const int64_t width = std::min(KEY_TILE, block_keys - first_key);
          gemm(false, true, m, width, dim, 1.0f, stacked.data(), dim, k_head + first_key * dim, dim, 0.0f,
               probs.data(), KEY_TILE);
          gemm(false, true, m, width, dim, 1.0f, grads.data(), dim, v_head + first_key * dim, dim, 0.0f,
               dscores.data(), KEY_TILE);
          for (int64_t row = 0; row < m; ++row) {
            const int64_t h = p.head(kvh, row, rows), query_row = first_row + row % rows;
            const int64_t position = first_position + query_row;
            const TileKeys keys(row_start[row], position, first_key, width);
            float* prob = probs.data() + row * KEY_TILE;
            float* ds = dscores.data() + row * KEY_TILE;
            if (keys.none()) {
              std::memset(prob, 0, sizeof(float) * width);
              std::memset(ds, 0, sizeof(float) * width);
              continue;
            }
            const float* window = tab + p.table_entry(h, first_key, position);
            const float* key_row_bias = bias ? bias + b * p.k_len + first_key + keys.lo : nullptr;
            write_logits(prob + keys.lo, window + keys.lo, key_row_bias, keys.count(), scaling, prior_scale[row]);
            exponentiate(prob, keys.lo, keys.visible, width, row_lse[row]);
            if (row_single[row]) {  // dV takes its P (1 on its key), nothing else
              std::memset(ds, 0, sizeof(float) * width);
              continue;
            }
            // dS = P (dP - delta), 0 past the visible keys (P is 0 there)
            const Vec vdelta(delta[row]);
            int64_t t = 0;
            for (; t + Vec::size() <= width; t += Vec::size())
              (Vec::loadu(prob + t) * (Vec::loadu(ds + t) - vdelta)).store(ds + t);
            for (; t < width; ++t) ds[t] = prob[t] * (ds[t] - delta[row]);
            if (dtab) add_scaled(dtab + b * p.heads * p.table_len + p.table_entry(h, first_key, position) + keys.lo,
                                 ds + keys.lo, prior_scale[row], keys.count());
            if (dfac)
              dfac[(b * p.heads + h) * p.q_len + query_row] += dot(ds + keys.lo, window + keys.lo, keys.count());
          }
          gemm(true, false, width, dim, m, 1.0f, probs.data(), KEY_TILE, grads.data(), dim, 1.0f,
               dv_head + first_key * dim, dim);
          gemm(true, false, width, dim, m, scaling, dscores.data(), KEY_TILE, stacked.data(), dim, 1.0f,
               dk_head + first_key * dim, dim);
          gemm(false, false, m, dim, width, scaling, dscores.data(), KEY_TILE, k_head + first_key * dim, dim, 1.0f,
               acc.data(), dim);
        }
        for (int64_t row = 0; row < m; ++row) {
          const int64_t h = p.head(kvh, row, rows), r = row % rows;
          std::memcpy(dq + ((b * p.heads + h) * p.q_len + first_row + r) * dim, acc.data() + row * dim,
                      sizeof(float) * dim);
        }
      }
    }
  });
  return {grad_query, grad_key, grad_value, grad_table, grad_factor};
}

}  // namespace bam_cpu

// TORCH_EXTENSION_NAME: the library's name, which PyTorch's extension build defines (one per build)
TORCH_LIBRARY(TORCH_EXTENSION_NAME, m) {
  m.def("forward(Tensor query, Tensor key, Tensor value, Tensor table, Tensor? prior_factor, Tensor? key_bias, "
        "Tensor? key_start, float scaling, int first_position, bool with_lse) -> (Tensor, Tensor)");
  m.def("backward(Tensor grad_output, Tensor query, Tensor key, Tensor value, Tensor output, Tensor lse, "
        "Tensor table, Tensor prior_factor, Tensor key_bias, Tensor key_start, Tensor single_key, float scaling, "
        "int first_position, "
        "bool table_grad, bool factor_grad) -> Tensor[]");
  m.impl("forward", c10::DispatchKey::CPU, &bam_cpu::bam_attention_forward);
  m.impl("backward", c10::DispatchKey::CPU, &bam_cpu::bam_attention_backward);
}
""",
}
