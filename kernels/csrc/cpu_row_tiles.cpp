// Row tiles (see cpu_attention.h): 16 query rows in vector lanes, an online
// softmax over the positions of one block.
//
// Per group of positions and for each dim d, one load of the rows' q[d] and one
// FMA per position against its k[d] broadcast from memory give one score vector
// per position (no horizontal sum); one exp per position and one for the rescale
// of the state; then per d one load and store of the accumulator around one FMA
// per position with v[d] broadcast.
//
// AVX-512: the 16 rows are one vector, positions 8 at a time.  AVX2: two 8-lane
// halves, positions 4 at a time (16 registers).
#include "cpu_attention.h"
#include "cpu_vector_math.h"

#ifdef KVSERVE_HAVE_X86_BUILD

namespace kvserve::cpu {
namespace {

static_assert(kTileRows == 16, "a tile is one 16-lane AVX-512 vector, or two AVX2 vectors");

// ---- AVX-512 -------------------------------------------------------------------------------

// kPositions consecutive positions (1..8): the whole online-softmax step.
template <int kPositions>
KVSERVE_AVX512_INLINE void attend_positions(const float* queries_t, __m512 lens, float first_pos,
                                            const float* keys, int64_t key_stride, const float* values,
                                            int64_t value_stride, int64_t head_dim, __m512& max, __m512& sum,
                                            float* acc) {
  __m512 scores[kPositions];
  for (int t = 0; t < kPositions; ++t) scores[t] = _mm512_setzero_ps();
  for (int64_t d = 0; d < head_dim; ++d) {
    const __m512 q_d = _mm512_loadu_ps(queries_t + d * kTileRows);
    for (int t = 0; t < kPositions; ++t) {
      scores[t] = _mm512_fmadd_ps(q_d, _mm512_set1_ps(keys[t * key_stride + d]), scores[t]);
    }
  }
  // Row r sees position p when p < lens[r] (causal rows of a chunk, shorter contexts).
  __mmask16 visible[kPositions];
  __m512 new_max = max;
  for (int t = 0; t < kPositions; ++t) {
    visible[t] = _mm512_cmp_ps_mask(_mm512_set1_ps(first_pos + t), lens, _CMP_LT_OQ);
    new_max = _mm512_mask_max_ps(new_max, visible[t], new_max, scores[t]);
  }
  const __m512 rescale = exp_nonpositive(_mm512_sub_ps(max, new_max));
  max = new_max;
  __m512 new_sum = _mm512_mul_ps(sum, rescale);
  for (int t = 0; t < kPositions; ++t) {
    scores[t] = _mm512_maskz_mov_ps(visible[t], exp_nonpositive(_mm512_sub_ps(scores[t], new_max)));
    new_sum = _mm512_add_ps(new_sum, scores[t]);
  }
  sum = new_sum;
  // Two chains per dim: 8 dependent FMAs would wait on each other's latency.
  for (int64_t d = 0; d < head_dim; ++d) {
    __m512 even = _mm512_mul_ps(_mm512_loadu_ps(acc + d * kTileRows), rescale), odd = _mm512_setzero_ps();
    for (int t = 0; t < kPositions; t += 2) {
      even = _mm512_fmadd_ps(scores[t], _mm512_set1_ps(values[t * value_stride + d]), even);
      if (t + 1 < kPositions) {
        odd = _mm512_fmadd_ps(scores[t + 1], _mm512_set1_ps(values[(t + 1) * value_stride + d]), odd);
      }
    }
    _mm512_storeu_ps(acc + d * kTileRows, _mm512_add_ps(even, odd));
  }
}

// ---- AVX2 ----------------------------------------------------------------------------------

// As above on two 8-lane halves (h = 0: rows 0-7, h = 1: rows 8-15), kPositions 1..4.
template <int kPositions>
KVSERVE_AVX2_INLINE void attend_positions(const float* queries_t, const __m256* lens, float first_pos,
                                          const float* keys, int64_t key_stride, const float* values,
                                          int64_t value_stride, int64_t head_dim, __m256* max, __m256* sum,
                                          float* acc) {
  __m256 scores[kPositions][2];
  for (int t = 0; t < kPositions; ++t) scores[t][0] = scores[t][1] = _mm256_setzero_ps();
  for (int64_t d = 0; d < head_dim; ++d) {
    const __m256 q_lo = _mm256_loadu_ps(queries_t + d * kTileRows);
    const __m256 q_hi = _mm256_loadu_ps(queries_t + d * kTileRows + 8);
    for (int t = 0; t < kPositions; ++t) {
      const __m256 k = _mm256_broadcast_ss(keys + t * key_stride + d);
      scores[t][0] = _mm256_fmadd_ps(q_lo, k, scores[t][0]);
      scores[t][1] = _mm256_fmadd_ps(q_hi, k, scores[t][1]);
    }
  }
  __m256 rescale[2];
  for (int h = 0; h < 2; ++h) {
    __m256 visible[kPositions];
    __m256 new_max = max[h];
    for (int t = 0; t < kPositions; ++t) {
      visible[t] = _mm256_cmp_ps(_mm256_set1_ps(first_pos + t), lens[h], _CMP_LT_OQ);
      new_max = _mm256_blendv_ps(new_max, _mm256_max_ps(new_max, scores[t][h]), visible[t]);
    }
    rescale[h] = exp_nonpositive(_mm256_sub_ps(max[h], new_max));
    max[h] = new_max;
    __m256 new_sum = _mm256_mul_ps(sum[h], rescale[h]);
    for (int t = 0; t < kPositions; ++t) {
      scores[t][h] = _mm256_and_ps(visible[t], exp_nonpositive(_mm256_sub_ps(scores[t][h], new_max)));
      new_sum = _mm256_add_ps(new_sum, scores[t][h]);
    }
    sum[h] = new_sum;
  }
  for (int64_t d = 0; d < head_dim; ++d) {
    float* acc_d = acc + d * kTileRows;
    __m256 lo = _mm256_mul_ps(_mm256_loadu_ps(acc_d), rescale[0]);
    __m256 hi = _mm256_mul_ps(_mm256_loadu_ps(acc_d + 8), rescale[1]);
    for (int t = 0; t < kPositions; ++t) {
      const __m256 v = _mm256_broadcast_ss(values + t * value_stride + d);
      lo = _mm256_fmadd_ps(scores[t][0], v, lo);
      hi = _mm256_fmadd_ps(scores[t][1], v, hi);
    }
    _mm256_storeu_ps(acc_d, lo);
    _mm256_storeu_ps(acc_d + 8, hi);
  }
}

}  // namespace

KVSERVE_AVX512 void attend_tile_avx512(const float* queries_t, const float* lens, int64_t first_pos,
                                       const float* keys, int64_t key_stride, const float* values,
                                       int64_t value_stride, int64_t count, int64_t head_dim, float* max,
                                       float* sum, float* acc) {
  const __m512 lens_v = _mm512_loadu_ps(lens);
  __m512 max_v = _mm512_loadu_ps(max), sum_v = _mm512_loadu_ps(sum);
  int64_t t = 0;
  for (; t + 8 <= count; t += 8) {
    attend_positions<8>(queries_t, lens_v, static_cast<float>(first_pos + t), keys + t * key_stride, key_stride,
                        values + t * value_stride, value_stride, head_dim, max_v, sum_v, acc);
  }
  const float tail_pos = static_cast<float>(first_pos + t);
  const float* tail_keys = keys + t * key_stride;
  const float* tail_values = values + t * value_stride;
  switch (count - t) {
#define KVSERVE_TAIL(n)                                                                                  \
  case n:                                                                                                \
    attend_positions<n>(queries_t, lens_v, tail_pos, tail_keys, key_stride, tail_values, value_stride, \
                        head_dim, max_v, sum_v, acc);                                                   \
    break;
    KVSERVE_TAIL(1)
    KVSERVE_TAIL(2)
    KVSERVE_TAIL(3)
    KVSERVE_TAIL(4)
    KVSERVE_TAIL(5)
    KVSERVE_TAIL(6)
    KVSERVE_TAIL(7)
#undef KVSERVE_TAIL
    default:
      break;
  }
  _mm512_storeu_ps(max, max_v);
  _mm512_storeu_ps(sum, sum_v);
}

KVSERVE_AVX2 void attend_tile_avx2(const float* queries_t, const float* lens, int64_t first_pos,
                                   const float* keys, int64_t key_stride, const float* values,
                                   int64_t value_stride, int64_t count, int64_t head_dim, float* max, float* sum,
                                   float* acc) {
  const __m256 lens_v[2] = {_mm256_loadu_ps(lens), _mm256_loadu_ps(lens + 8)};
  __m256 max_v[2] = {_mm256_loadu_ps(max), _mm256_loadu_ps(max + 8)};
  __m256 sum_v[2] = {_mm256_loadu_ps(sum), _mm256_loadu_ps(sum + 8)};
  int64_t t = 0;
  for (; t + 4 <= count; t += 4) {
    attend_positions<4>(queries_t, lens_v, static_cast<float>(first_pos + t), keys + t * key_stride, key_stride,
                        values + t * value_stride, value_stride, head_dim, max_v, sum_v, acc);
  }
  const float tail_pos = static_cast<float>(first_pos + t);
  const float* tail_keys = keys + t * key_stride;
  const float* tail_values = values + t * value_stride;
  switch (count - t) {
    case 1:
      attend_positions<1>(queries_t, lens_v, tail_pos, tail_keys, key_stride, tail_values, value_stride, head_dim,
                          max_v, sum_v, acc);
      break;
    case 2:
      attend_positions<2>(queries_t, lens_v, tail_pos, tail_keys, key_stride, tail_values, value_stride, head_dim,
                          max_v, sum_v, acc);
      break;
    case 3:
      attend_positions<3>(queries_t, lens_v, tail_pos, tail_keys, key_stride, tail_values, value_stride, head_dim,
                          max_v, sum_v, acc);
      break;
    default:
      break;
  }
  for (int h = 0; h < 2; ++h) {
    _mm256_storeu_ps(max + 8 * h, max_v[h]);
    _mm256_storeu_ps(sum + 8 * h, sum_v[h]);
  }
}

}  // namespace kvserve::cpu

#else  // not x86: detect_capability() never reports kAvx2 or above, so these are never called.

#include <cstdlib>

namespace kvserve::cpu {

void attend_tile_avx512(const float*, const float*, int64_t, const float*, int64_t, const float*, int64_t,
                        int64_t, int64_t, float*, float*, float*) {
  std::abort();
}

void attend_tile_avx2(const float*, const float*, int64_t, const float*, int64_t, const float*, int64_t,
                      int64_t, int64_t, float*, float*, float*) {
  std::abort();
}

}  // namespace kvserve::cpu

#endif
