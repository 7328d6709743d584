// BAM attention's decoding step over vLLM's paged KV cache on the CPU, the cache write and a prompt's key gathering;
// their Python wrappers are serving/paged_cpu.py, which also says what they compute.
#include "cpu_kernel_common.h"

namespace bam_cpu {
namespace {

// Rows of a block as float32: `count` cells' channels first .. first + dim - 1, `stride` apart; the cache itself where
// it is float32, else converted into `scratch` (rows dim apart)
template <typename scalar_t>
std::pair<const float*, int64_t> rows_as_float(const scalar_t* cells, int64_t stride, int64_t count, int64_t dim,
                                               float* scratch) {
  for (int64_t t = 0; t < count; ++t)
    for (int64_t d = 0; d < dim; ++d) scratch[t * dim + d] = static_cast<float>(cells[t * stride + d]);
  return {scratch, dim};
}
template <>
std::pair<const float*, int64_t> rows_as_float<float>(const float* cells, int64_t stride, int64_t, int64_t, float*) {
  return {cells, stride};
}

// out[t] = q . rows[t] for `count` rows `stride` apart, four rows at a time (independent sums keep the FMA units busy)
void dot_rows(const float* q, const float* rows, int64_t stride, int64_t count, int64_t dim, float* out) {
  const int64_t vectors = dim / Vec::size() * Vec::size();
  int64_t t = 0;
  for (; t + 4 <= count; t += 4) {
    const float *r0 = rows + t * stride, *r1 = r0 + stride, *r2 = r1 + stride, *r3 = r2 + stride;
    Vec a0(0.0f), a1(0.0f), a2(0.0f), a3(0.0f);
    for (int64_t d = 0; d < vectors; d += Vec::size()) {
      const Vec x = Vec::loadu(q + d);
      a0 = at::vec::fmadd(x, Vec::loadu(r0 + d), a0);
      a1 = at::vec::fmadd(x, Vec::loadu(r1 + d), a1);
      a2 = at::vec::fmadd(x, Vec::loadu(r2 + d), a2);
      a3 = at::vec::fmadd(x, Vec::loadu(r3 + d), a3);
    }
    float s0 = reduce_sum(a0), s1 = reduce_sum(a1), s2 = reduce_sum(a2), s3 = reduce_sum(a3);
    for (int64_t d = vectors; d < dim; ++d) s0 += q[d] * r0[d], s1 += q[d] * r1[d], s2 += q[d] * r2[d], s3 += q[d] * r3[d];
    out[t] = s0, out[t + 1] = s1, out[t + 2] = s2, out[t + 3] = s3;
  }
  for (; t < count; ++t) out[t] = dot(q, rows + t * stride, dim);
}

// acc += sum_t weights[t] * rows[t] for `count` rows `stride` apart, the accumulator in registers 4 vectors at a time
void add_weighted_rows(float* acc, const float* weights, const float* rows, int64_t stride, int64_t count, int64_t dim) {
  constexpr int64_t width = 4 * Vec::size();
  int64_t d = 0;
  for (; d + width <= dim; d += width) {
    Vec a0 = Vec::loadu(acc + d), a1 = Vec::loadu(acc + d + Vec::size());
    Vec a2 = Vec::loadu(acc + d + 2 * Vec::size()), a3 = Vec::loadu(acc + d + 3 * Vec::size());
    for (int64_t t = 0; t < count; ++t) {
      const float* row = rows + t * stride + d;
      const Vec w(weights[t]);
      a0 = at::vec::fmadd(Vec::loadu(row), w, a0);
      a1 = at::vec::fmadd(Vec::loadu(row + Vec::size()), w, a1);
      a2 = at::vec::fmadd(Vec::loadu(row + 2 * Vec::size()), w, a2);
      a3 = at::vec::fmadd(Vec::loadu(row + 3 * Vec::size()), w, a3);
    }
    a0.store(acc + d), a1.store(acc + d + Vec::size()), a2.store(acc + d + 2 * Vec::size());
    a3.store(acc + d + 3 * Vec::size());
  }
  for (int64_t t = 0; t < count; ++t) add_scaled(acc + d, rows + t * stride + d, weights[t], dim - d);
}

// One step as the decode reads it. Cache (blocks, Hkv, N, 2D): a token's key in channels 0 .. D - 1 of its cell,
// its value in D .. 2D - 1, channels contiguous, blocks / heads / tokens at any stride.
struct PagedStep {
  int64_t kv_heads, group, dim, block_size, block_stride, head_stride, token_stride;
  int64_t query_stride, output_stride, table_len, table_stride;
  const int32_t *starts, *seq_lens, *block_table;
  const float *table, *ssmax_scale;
  bool ssmax_prior;
  float scaling;

  // the cell of the first key of request r's block `index` (keys index * N ..) in key/value head g
  template <typename scalar_t>
  const scalar_t* block_cells(const scalar_t* cache, int64_t r, int64_t g, int64_t index) const {
    return cache + block_table[r * table_stride + index] * block_stride + g * head_stride;
  }

  // f(first, count, cells) for each block of request r's keys first .. first + count - 1 in key/value head g
  template <typename scalar_t, typename F>
  void for_each_block(const scalar_t* cache, int64_t r, int64_t g, int64_t keys, F f) const {
    for (int64_t index = 0, first = 0; first < keys; ++index, first += block_size)
      f(first, std::min(block_size, keys - first), block_cells(cache, r, g, index));
  }
};

// One thread's working memory: the group's queries (group x D), scores (group x keys), accumulated values
// (group x D), a block converted to float32 (N x D), each row's softmax sum
struct DecodeBuffers {
  std::vector<float> queries, scores, acc, scratch, sums;
  explicit DecodeBuffers(const PagedStep& s)
      : queries(s.group * s.dim), acc(s.group * s.dim), scratch(s.block_size * s.dim), sums(s.group) {}
};

// Query heads g * group .. of request r (one query, at position keys - 1) against its keys 0 .. keys - 1 of
// key/value head g: scores, logits c * (scaling q.k + b) or c * scaling q.k + b, softmax, P.V
template <typename scalar_t>
void decode_one(const PagedStep& s, const scalar_t* query, const scalar_t* cache, scalar_t* output, int64_t r,
                int64_t g, DecodeBuffers& buffers) {
  const int64_t keys = s.seq_lens[r], row = s.starts[r], dim = s.dim, group = s.group;
  auto& [queries, scores, acc, scratch, sums] = buffers;
  scores.resize(group * keys);
  for (int64_t i = 0; i < group; ++i) {
    const scalar_t* q = query + row * s.query_stride + (g * group + i) * dim;
    for (int64_t d = 0; d < dim; ++d) queries[i * dim + d] = static_cast<float>(q[d]);
  }
  s.for_each_block(cache, r, g, keys, [&](int64_t first, int64_t count, const scalar_t* cells) {
    const auto [rows, stride] = rows_as_float(cells, s.token_stride, count, dim, scratch.data());
    for (int64_t i = 0; i < group; ++i)
      dot_rows(queries.data() + i * dim, rows, stride, count, dim, scores.data() + i * keys + first);
  });
  const float log_count = std::log(static_cast<float>(keys));
  for (int64_t i = 0; i < group; ++i) {
    const int64_t h = g * group + i;
    const float factor = s.ssmax_scale ? s.ssmax_scale[h] * log_count : 1.0f;
    const float* window = s.table + h * s.table_len + s.table_len - keys;
    float* row_scores = scores.data() + i * keys;
    const float row_max = write_logits(row_scores, window, nullptr, keys, s.scaling * factor,
                                       s.ssmax_prior ? factor : 1.0f);
    sums[i] = exponentiate(row_scores, 0, keys, keys, row_max);
  }
  std::fill(acc.begin(), acc.end(), 0.0f);
  s.for_each_block(cache, r, g, keys, [&](int64_t first, int64_t count, const scalar_t* cells) {
    const auto [rows, stride] = rows_as_float(cells + dim, s.token_stride, count, dim, scratch.data());
    for (int64_t i = 0; i < group; ++i)
      add_weighted_rows(acc.data() + i * dim, scores.data() + i * keys + first, rows, stride, count, dim);
  });
  for (int64_t i = 0; i < group; ++i) {
    scalar_t* out = output + row * s.output_stride + (g * group + i) * dim;
    const float inverse = 1.0f / sums[i];
    for (int64_t d = 0; d < dim; ++d) out[d] = static_cast<scalar_t>(acc[i * dim + d] * inverse);
  }
}

// The blocks holding a request's `keys` keys: within its row of the block table and within the cache
void check_blocks(const int32_t* ids, int64_t keys, int64_t block_size, int64_t row_length, int64_t cache_blocks) {
  const int64_t needed = (keys + block_size - 1) / block_size;
  TORCH_CHECK(needed <= row_length, "bam paged attention: a request's keys need more blocks than its block table row");
  for (int64_t index = 0; index < needed; ++index)
    TORCH_CHECK(ids[index] >= 0 && ids[index] < cache_blocks, "bam paged attention: block id ", ids[index],
                " outside the cache's ", cache_blocks, " blocks");
}

void check_step(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& output,
                const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& block_table,
                const at::Tensor& table, const at::Tensor& ssmax_scale) {
  TORCH_CHECK(query.dim() == 2 && output.dim() == 2 && kv_cache.dim() == 4 && query.stride(1) == 1 &&
                  output.stride(1) == 1 && kv_cache.stride(3) == 1 && query.scalar_type() == kv_cache.scalar_type() &&
                  output.scalar_type() == query.scalar_type(),
              "bam paged decode: query / output (T, H * D) and the cache (blocks, Hkv, N, 2D) of one dtype, rows "
              "and cells contiguous");
  for (const auto* t : {&query_start_loc, &seq_lens, &block_table})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(), "bam paged decode: int32 contiguous metadata");
  TORCH_CHECK(table.scalar_type() == at::kFloat && table.is_contiguous() &&
                  (ssmax_scale.numel() == 0 || (ssmax_scale.scalar_type() == at::kFloat && ssmax_scale.is_contiguous())),
              "bam paged decode: float32 contiguous prior table and SSMax scale");
}

}  // namespace

// Every request r with one query row (query_start_loc[r + 1] - query_start_loc[r] == 1) of the step: its output row
// from its seq_lens[r] keys in the cache; the other requests' rows are left as they are.
void paged_decode(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& output,
                  const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& block_table,
                  const at::Tensor& table, const at::Tensor& ssmax_scale, bool ssmax_prior, double scaling) {
  check_step(query, kv_cache, output, query_start_loc, seq_lens, block_table, table, ssmax_scale);
  const int64_t heads = table.size(0), kv_heads = kv_cache.size(1), dim = kv_cache.size(3) / 2;
  TORCH_CHECK(heads % kv_heads == 0 && query.size(1) == heads * dim, "bam paged decode: heads and head size");
  PagedStep s{kv_heads, heads / kv_heads, dim, kv_cache.size(2), kv_cache.stride(0), kv_cache.stride(1),
              kv_cache.stride(2), query.stride(0), output.stride(0), table.size(1), block_table.stride(0),
              query_start_loc.const_data_ptr<int32_t>(), seq_lens.const_data_ptr<int32_t>(),
              block_table.const_data_ptr<int32_t>(), table.const_data_ptr<float>(),
              ssmax_scale.numel() ? ssmax_scale.const_data_ptr<float>() : nullptr, ssmax_prior,
              static_cast<float>(scaling)};
  const int64_t requests = seq_lens.size(0);
  TORCH_CHECK(query_start_loc.size(0) == requests + 1 && block_table.size(0) >= requests &&
                  s.starts[requests] <= std::min(query.size(0), output.size(0)),
              "bam paged decode: query_start_loc, seq_lens, the block table and the query rows disagree");
  std::vector<int64_t> decoding;
  for (int64_t r = 0; r < requests; ++r)
    if (s.starts[r + 1] - s.starts[r] == 1 && s.seq_lens[r] > 0) {
      TORCH_CHECK(s.seq_lens[r] <= s.table_len, "bam paged decode: a request longer than the prior table");
      check_blocks(s.block_table + r * s.table_stride, s.seq_lens[r], s.block_size, block_table.size(1),
                   kv_cache.size(0));
      decoding.push_back(r);
    }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "bam_paged_decode", [&] {
    const scalar_t* q = query.const_data_ptr<scalar_t>();
    const scalar_t* cache = kv_cache.const_data_ptr<scalar_t>();
    scalar_t* out = output.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, static_cast<int64_t>(decoding.size()) * kv_heads, 1, [&](int64_t begin, int64_t end) {
      FlushSubnormals flush;
      DecodeBuffers buffers(s);
      for (int64_t task = begin; task < end; ++task)
        decode_one(s, q, cache, out, decoding[task / kv_heads], task % kv_heads, buffers);
    });
  });
}

// Request keys 0 .. keys - 1 (in blocks block_ids[0], block_ids[1], ...) as two float32 (Hkv, keys, D) tensors: what
// the fused attention reads for a prompt or a chunk of one
std::tuple<at::Tensor, at::Tensor> gather(const at::Tensor& kv_cache, const at::Tensor& block_ids, int64_t keys) {
  const int64_t kv_heads = kv_cache.size(1), block_size = kv_cache.size(2), dim = kv_cache.size(3) / 2;
  const int64_t blocks = (keys + block_size - 1) / block_size;
  TORCH_CHECK(kv_cache.stride(3) == 1 && block_ids.scalar_type() == at::kInt && block_ids.dim() == 1 &&
                  block_ids.stride(0) == 1, "bam gather: int32 block ids, and a cache whose cells are contiguous");
  check_blocks(block_ids.const_data_ptr<int32_t>(), keys, block_size, block_ids.size(0), kv_cache.size(0));
  auto key = at::empty({kv_heads, keys, dim}, kv_cache.options().dtype(at::kFloat));
  auto value = at::empty_like(key);
  const int32_t* ids = block_ids.const_data_ptr<int32_t>();
  float *k = key.data_ptr<float>(), *v = value.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kv_cache.scalar_type(), "bam_gather", [&] {
    const scalar_t* cache = kv_cache.const_data_ptr<scalar_t>();
    at::parallel_for(0, kv_heads * blocks, 16, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t g = task / blocks, index = task % blocks, first = index * block_size;
        const scalar_t* cells = cache + ids[index] * kv_cache.stride(0) + g * kv_cache.stride(1);
        for (int64_t t = 0; t < std::min(block_size, keys - first); ++t) {
          const scalar_t* cell = cells + t * kv_cache.stride(2);
          float *k_row = k + (g * keys + first + t) * dim, *v_row = v + (g * keys + first + t) * dim;
          for (int64_t d = 0; d < dim; ++d) k_row[d] = static_cast<float>(cell[d]), v_row[d] = static_cast<float>(cell[dim + d]);
        }
      }
    });
  });
  return {key, value};
}

// Token t's key and value (rows of (T, Hkv * D), channels contiguous) into cache cell slot_mapping[t]
// (block * N + offset); slots < 0 (padding) skipped
void write_cache(const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv_cache,
                 const at::Tensor& slot_mapping) {
  const int64_t kv_heads = kv_cache.size(1), block_size = kv_cache.size(2), dim = kv_cache.size(3) / 2;
  TORCH_CHECK(key.scalar_type() == kv_cache.scalar_type() && value.scalar_type() == kv_cache.scalar_type() &&
                  key.stride(1) == 1 && value.stride(1) == 1 && kv_cache.stride(3) == 1 &&
                  key.size(1) == kv_heads * dim && value.size(1) == kv_heads * dim &&
                  slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.size(0) <= key.size(0),
              "bam write cache: keys / values (T, Hkv * D) of the cache's dtype, int64 slots");
  const int64_t bytes = dim * kv_cache.element_size();
  const auto* slots = slot_mapping.const_data_ptr<int64_t>();
  const char *k = static_cast<const char*>(key.const_data_ptr()), *v = static_cast<const char*>(value.const_data_ptr());
  char* cache = static_cast<char*>(kv_cache.mutable_data_ptr());
  const int64_t element = kv_cache.element_size();
  const int64_t cells = kv_cache.size(0) * block_size;
  for (int64_t t = 0; t < slot_mapping.size(0); ++t)  // all checked before any is written
    TORCH_CHECK(slots[t] < cells, "bam write cache: slot ", slots[t], " outside the cache's ", cells, " cells");
  for (int64_t t = 0; t < slot_mapping.size(0); ++t) {
    if (slots[t] < 0) continue;
    const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
    for (int64_t g = 0; g < kv_heads; ++g) {
      char* cell = cache + (block * kv_cache.stride(0) + g * kv_cache.stride(1) + offset * kv_cache.stride(2)) * element;
      std::memcpy(cell, k + (t * key.stride(0) + g * dim) * element, bytes);
      std::memcpy(cell + bytes, v + (t * value.stride(0) + g * dim) * element, bytes);
    }
  }
}

}  // namespace bam_cpu

// TORCH_EXTENSION_NAME: the library's name, which PyTorch's extension build defines (one per build)
TORCH_LIBRARY(TORCH_EXTENSION_NAME, m) {
  m.def("decode(Tensor query, Tensor kv_cache, Tensor(a!) output, Tensor query_start_loc, Tensor seq_lens, "
        "Tensor block_table, Tensor table, Tensor ssmax_scale, bool ssmax_prior, float scaling) -> ()");
  m.def("write_cache(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
  m.def("gather(Tensor kv_cache, Tensor block_ids, int keys) -> (Tensor, Tensor)");
  m.impl("gather", c10::DispatchKey::CPU, &bam_cpu::gather);
  m.impl("decode", c10::DispatchKey::CPU, &bam_cpu::paged_decode);
  m.impl("write_cache", c10::DispatchKey::CPU, &bam_cpu::write_cache);
}
