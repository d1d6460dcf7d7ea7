// The float32 building blocks of the CPU attention kernels.
//
// No ATen here: these files compile in seconds, and their vector code carries
// per-function target attributes instead of -m flags, so nothing they share
// with other translation units (inline functions of the standard library) is
// ever compiled for a CPU the machine may lack.
#pragma once

#include <cstdint>

namespace kvserve::cpu {

// The instruction sets the kernels use, in increasing order.
enum class Capability : int { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };

// The best capability of this CPU (AVX2 means AVX2 + FMA; AVX-512 means F + DQ).
Capability detect_capability();

// ---- per request: the query heads of one kv head, two passes over the context ----------
//
//   scores:     scores[g * scores_stride + i] = q[g] . rows[i]                    i < count
//   max:        max_i scores[i] for i < n (n >= 1)
//   exp_sum:    scores[i] = exp(scores[i] - max) for i < n; returns their sum
//   accumulate: acc[g] += sum_i weights[g * weights_stride + i] * rows[i]       i < count
//
// for `group` query heads of `head_dim`; rows are `row_stride` floats apart.
struct RowOps {
  void (*scores)(const float* q, int64_t group, int64_t head_dim, const float* rows, int64_t row_stride,
                 int64_t count, float* scores, int64_t scores_stride);
  float (*max)(const float* scores, int64_t n);
  float (*exp_sum)(float* scores, int64_t n, float max);
  void (*accumulate)(const float* weights, int64_t weights_stride, int64_t group, int64_t head_dim,
                     const float* rows, int64_t row_stride, int64_t count, float* acc);
};

// AVX2 code at kAvx2 and above when head_dim is a multiple of 8, else portable code.
const RowOps& row_ops(Capability capability, int64_t head_dim);

// ---- row tiles (AVX2, AVX-512): many query rows over one context -----------------------
//
// kTileRows query rows that read the same K/V rows (the tokens of a prefill
// chunk, or decode requests over a prefix they share) sit in vector lanes.  Each
// K row is then loaded once for all of them, and scores come out one vector per
// position with no horizontal sum.  Row r sees positions [0, lens[r]); the online
// softmax state of the tile is
//
//   max[r], sum[r]          running maximum and sum of exp(score - max)
//   acc[d * kTileRows + r]  running sum of exp(score - max) * v[d]   (rows in lanes)
//
// max starts at -FLT_MAX (not -inf: exp(-inf - -inf) would be NaN), sum and acc at 0.
constexpr int64_t kTileRows = 16;

// Advances the state over `count` consecutive positions from `first_pos`, whose rows
// are `key_stride` / `value_stride` floats apart.  `queries_t` is [head_dim][kTileRows],
// scaled.  Only at the capability of their name and above.
using AttendTile = void (*)(const float* queries_t, const float* lens, int64_t first_pos, const float* keys,
                            int64_t key_stride, const float* values, int64_t value_stride, int64_t count,
                            int64_t head_dim, float* max, float* sum, float* acc);
void attend_tile_avx512(const float* queries_t, const float* lens, int64_t first_pos, const float* keys,
                        int64_t key_stride, const float* values, int64_t value_stride, int64_t count,
                        int64_t head_dim, float* max, float* sum, float* acc);
void attend_tile_avx2(const float* queries_t, const float* lens, int64_t first_pos, const float* keys,
                      int64_t key_stride, const float* values, int64_t value_stride, int64_t count,
                      int64_t head_dim, float* max, float* sum, float* acc);

}  // namespace kvserve::cpu
