// What every C++ CPU kernel of the package includes (model/csrc/fused_cpu.cpp, serving/csrc/paged_cpu.cpp): ATen's
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
