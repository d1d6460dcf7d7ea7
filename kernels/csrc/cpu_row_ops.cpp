// The per-request row operations of the CPU attention kernels (see cpu_attention.h):
// portable code, and AVX2 + FMA code in tiles of 8 positions.
//
// AVX2: pass 1 keeps one 8-lane accumulator per position of a tile and sums the 8
// of them across lanes in one transpose-reduce, so a tile costs one horizontal
// reduction instead of eight; the tile's K rows stay in L1 while every query head
// of the group reads them.  Pass 2 adds the tile's 8 weighted V rows into each
// head's accumulator.  exp is a vectorised polynomial (cpu_vector_math.h).
#include "cpu_attention.h"

#include <algorithm>
#include <cmath>

#include "cpu_vector_math.h"

namespace kvserve::cpu {
namespace {

// ---- portable ----------------------------------------------------------------------------

void scores_portable(const float* q, int64_t group, int64_t head_dim, const float* rows, int64_t row_stride,
                     int64_t count, float* scores, int64_t scores_stride) {
  for (int64_t i = 0; i < count; ++i) {
    const float* k = rows + i * row_stride;
    for (int64_t g = 0; g < group; ++g) {
      const float* q_g = q + g * head_dim;
      float dot = 0.f;
      // NOTE: without the pragma the compiler may not reorder the sum, and it stays scalar.
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < head_dim; ++d) dot += q_g[d] * k[d];
      scores[g * scores_stride + i] = dot;
    }
  }
}

float max_portable(const float* scores, int64_t n) {
  float max = scores[0];
  for (int64_t i = 1; i < n; ++i) max = std::max(max, scores[i]);
  return max;
}

float exp_sum_portable(float* scores, int64_t n, float max) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) {
    scores[i] = std::exp(scores[i] - max);
    sum += scores[i];
  }
  return sum;
}

void accumulate_portable(const float* weights, int64_t weights_stride, int64_t group, int64_t head_dim,
                         const float* rows, int64_t row_stride, int64_t count, float* acc) {
  for (int64_t i = 0; i < count; ++i) {
    const float* v = rows + i * row_stride;
    for (int64_t g = 0; g < group; ++g) {
      const float weight = weights[g * weights_stride + i];
      float* acc_g = acc + g * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) acc_g[d] += weight * v[d];
    }
  }
}

constexpr RowOps kPortableOps{scores_portable, max_portable, exp_sum_portable, accumulate_portable};

// ---- AVX2 + FMA ----------------------------------------------------------------------------

#ifdef KVSERVE_HAVE_X86_BUILD
// [sum(a0), sum(a1), ..., sum(a7)]: the lane sums of 8 vectors in one transpose-reduce.
KVSERVE_AVX2_INLINE __m256 lane_sums8(const __m256* a) {
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  // lo 128 bits: partial sums of a0..a3 from their low halves; hi: from their high halves.
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

KVSERVE_AVX2_INLINE float lane_sum(__m256 a) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
}

KVSERVE_AVX2 void scores_avx2(const float* q, int64_t group, int64_t head_dim, const float* rows,
                              int64_t row_stride, int64_t count, float* scores, int64_t scores_stride) {
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const float* k = rows + i * row_stride;
    for (int64_t g = 0; g < group; ++g) {
      const float* q_g = q + g * head_dim;
      __m256 acc[8];
      for (int t = 0; t < 8; ++t) acc[t] = _mm256_setzero_ps();
      for (int64_t d = 0; d < head_dim; d += 8) {
        const __m256 q_d = _mm256_loadu_ps(q_g + d);
        for (int t = 0; t < 8; ++t) acc[t] = _mm256_fmadd_ps(q_d, _mm256_loadu_ps(k + t * row_stride + d), acc[t]);
      }
      _mm256_storeu_ps(scores + g * scores_stride + i, lane_sums8(acc));
    }
  }
  for (; i < count; ++i) {
    const float* k = rows + i * row_stride;
    for (int64_t g = 0; g < group; ++g) {
      const float* q_g = q + g * head_dim;
      __m256 acc = _mm256_setzero_ps();
      for (int64_t d = 0; d < head_dim; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q_g + d), _mm256_loadu_ps(k + d), acc);
      scores[g * scores_stride + i] = lane_sum(acc);
    }
  }
}

KVSERVE_AVX2 float max_avx2(const float* scores, int64_t n) {
  // Four independent chains: maxps has a latency of 4 cycles.
  __m256 m[4];
  for (int t = 0; t < 4; ++t) m[t] = _mm256_set1_ps(scores[0]);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    for (int t = 0; t < 4; ++t) m[t] = _mm256_max_ps(m[t], _mm256_loadu_ps(scores + i + 8 * t));
  }
  for (; i + 8 <= n; i += 8) m[0] = _mm256_max_ps(m[0], _mm256_loadu_ps(scores + i));
  const __m256 m8 = _mm256_max_ps(_mm256_max_ps(m[0], m[1]), _mm256_max_ps(m[2], m[3]));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  float max = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  for (; i < n; ++i) max = std::max(max, scores[i]);
  return max;
}

KVSERVE_AVX2 float exp_sum_avx2(float* scores, int64_t n, float max) {
  const __m256 max_v = _mm256_set1_ps(max);
  __m256 sum_v = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(scores + i), max_v));
    _mm256_storeu_ps(scores + i, e);
    sum_v = _mm256_add_ps(sum_v, e);
  }
  if (i < n) {  // the tail through a masked load and store
    alignas(32) int32_t lanes[8];
    for (int t = 0; t < 8; ++t) lanes[t] = i + t < n ? -1 : 0;
    const __m256i mask = _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes));
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_maskload_ps(scores + i, mask), max_v));
    _mm256_maskstore_ps(scores + i, mask, e);
    sum_v = _mm256_add_ps(sum_v, _mm256_and_ps(e, _mm256_castsi256_ps(mask)));
  }
  return lane_sum(sum_v);
}

KVSERVE_AVX2 void accumulate_avx2(const float* weights, int64_t weights_stride, int64_t group, int64_t head_dim,
                                  const float* rows, int64_t row_stride, int64_t count, float* acc) {
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const float* v = rows + i * row_stride;
    for (int64_t g = 0; g < group; ++g) {
      const float* w = weights + g * weights_stride + i;
      __m256 w_t[8];
      for (int t = 0; t < 8; ++t) w_t[t] = _mm256_broadcast_ss(w + t);
      float* acc_g = acc + g * head_dim;
      for (int64_t d = 0; d < head_dim; d += 8) {
        __m256 sum = _mm256_loadu_ps(acc_g + d);
        for (int t = 0; t < 8; ++t) sum = _mm256_fmadd_ps(w_t[t], _mm256_loadu_ps(v + t * row_stride + d), sum);
        _mm256_storeu_ps(acc_g + d, sum);
      }
    }
  }
  for (; i < count; ++i) {
    const float* v = rows + i * row_stride;
    for (int64_t g = 0; g < group; ++g) {
      const __m256 w = _mm256_broadcast_ss(weights + g * weights_stride + i);
      float* acc_g = acc + g * head_dim;
      for (int64_t d = 0; d < head_dim; d += 8) {
        _mm256_storeu_ps(acc_g + d, _mm256_fmadd_ps(w, _mm256_loadu_ps(v + d), _mm256_loadu_ps(acc_g + d)));
      }
    }
  }
}

constexpr RowOps kAvx2Ops{scores_avx2, max_avx2, exp_sum_avx2, accumulate_avx2};
#endif  // KVSERVE_HAVE_X86_BUILD

}  // namespace

Capability detect_capability() {
#ifdef KVSERVE_HAVE_X86_BUILD
  static const Capability detected = [] {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return Capability::kPortable;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq")) return Capability::kAvx512;
    return Capability::kAvx2;
  }();
  return detected;
#else
  return Capability::kPortable;
#endif
}

const RowOps& row_ops(Capability capability, int64_t head_dim) {
#ifdef KVSERVE_HAVE_X86_BUILD
  if (capability >= Capability::kAvx2 && head_dim % 8 == 0) return kAvx2Ops;
#endif
  return kPortableOps;
}

}  // namespace kvserve::cpu
