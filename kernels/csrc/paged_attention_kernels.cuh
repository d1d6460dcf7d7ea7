// CUDA paged attention over a sharded KV cache: device code only, plain CUDA headers.
//
// Cache layout, per layer, keys and values alike (contiguous):
//
//   key_cache[num_blocks][block_size][num_kv_heads][head_dim]     one slot = num_kv_heads rows
//
//   context position t of request r  ->  block block_tables[r][t / BS], offset t % BS
//   the row of kv head h: 16-byte vectors, head_dim * sizeof(T) / 16 of them, contiguous
//
// Work decomposition (flash-decoding): one CTA = (query rows, kv head, context split).
//
//   query rows   (token, head) pairs that read the same kv head: the GQA group of one
//                decode token, or 8 consecutive pairs of a prefill chunk.  Every K/V row a
//                CTA loads serves all of them.
//   split        context positions [z * S, (z + 1) * S), S = split_tokens, or with
//                even_splits the request's own S (split_tokens_of).  A row whose context
//                fits in one split (position < S) writes its output directly; the others
//                write an unnormalised partial (acc, max, sum) per split that
//                combine_splits_kernel merges.
//
// Inside a CTA (4 warps), a "thread group" of head_dim * sizeof(T) / 16 lanes owns one key
// row at a time: lane c loads the 16 bytes at dims [c*E, c*E + E) of K and V (E = 16 /
// sizeof(T)), so one warp load instruction reads kKeysPerLoad = 32 / group size whole
// rows.  Each warp streams its own keys with an online softmax per query row (scores in
// log2 units, q pre-scaled by scale * log2(e)); at the end the thread groups of a warp
// merge through shuffles and the warps through shared memory.
//
//   warp w, step s:  keys  kv_begin + (s * 4 + w) * kKeysPerWarpStep + u * kKeysPerLoad + g
//                    for unroll slot u < kUnroll and thread group g < kKeysPerLoad: all K
//                    and V loads of step s + 1 are issued before step s is computed
//                    (software pipelining: a warp always has a step in flight).
//
// Scores: each lane holds kUnroll * kRows partial dot products, summed over its thread group
// transposed (transpose_reduce below): each lane ends owning 1-2 scores, runs the online
// softmax on those, and the lanes then fetch the weights they need from the owners.  (A
// butterfly per score cost 64 shuffles a step; see NOTES.md.)  Each lane's query rows and
// unroll slots are permuted by its lane (perm below), so a load instruction reads kUnroll
// keys' quarter (or half) rows per thread group: the same sectors, each read once, in whole
// 32-byte runs.
//
// Everything accumulates in float32.  Positions at or beyond seq_len are never read, so
// NaN in unwritten slots of the cache cannot leak into the output.  A prefill tile reads
// the keys up to its last row's position for all of its rows, with weight 0 for the rows
// they are past: safe only because every position below seq_len has been written (a NaN
// there would leak, 0 * NaN being NaN).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "paged_attention_cuda.h"

namespace kvserve {

constexpr int kWarpSize = 32;
constexpr int kNumWarps = kNumThreads / kWarpSize;
constexpr float kLog2e = 1.4426950408889634f;

// ---------------------------------------------------------------------------------------
// 16-byte vectors of T <-> float

template <typename T>
struct VecTraits;
template <>
struct VecTraits<float> {
  static constexpr int kElems = 4;
};
template <>
struct VecTraits<__half> {
  static constexpr int kElems = 8;
};
template <>
struct VecTraits<__nv_bfloat16> {
  static constexpr int kElems = 8;
};

__device__ __forceinline__ void unpack(const uint4& raw, float (&out)[4]) {
  out[0] = __uint_as_float(raw.x);
  out[1] = __uint_as_float(raw.y);
  out[2] = __uint_as_float(raw.z);
  out[3] = __uint_as_float(raw.w);
}

__device__ __forceinline__ float2 half2_bits_to_float2(uint32_t bits) {
  __half2 pair;
  memcpy(&pair, &bits, sizeof(pair));
  return __half22float2(pair);
}

// bfloat16 -> float is exact: the 16 bits become the high half of a float.
__device__ __forceinline__ float2 bf162_bits_to_float2(uint32_t bits) {
  return make_float2(__uint_as_float(bits << 16), __uint_as_float(bits & 0xffff0000u));
}

template <typename T>
__device__ __forceinline__ void unpack(const uint4& raw, float (&out)[8]) {
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 pair = std::is_same<T, __half>::value ? half2_bits_to_float2(words[i])
                                                       : bf162_bits_to_float2(words[i]);
    out[2 * i] = pair.x;
    out[2 * i + 1] = pair.y;
  }
}

template <typename T>
__device__ __forceinline__ void unpack_vec(const uint4& raw, float (&out)[VecTraits<T>::kElems]) {
  if constexpr (std::is_same<T, float>::value) {
    unpack(raw, out);
  } else {
    unpack<T>(raw, out);
  }
}

// Two floats as two T, stored at dst (aligned to 2 * sizeof(T)).
template <typename T>
__device__ __forceinline__ void store_pair(T* dst, float a, float b) {
  if constexpr (std::is_same<T, float>::value) {
    *reinterpret_cast<float2*>(dst) = make_float2(a, b);
  } else if constexpr (std::is_same<T, __half>::value) {
    *reinterpret_cast<__half2*>(dst) = __floats2half2_rn(a, b);
  } else {
    *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(a, b);
  }
}

__device__ __forceinline__ uint4 load_vec(const void* ptr) {
  return __ldg(reinterpret_cast<const uint4*>(ptr));
}

// A K/V row piece: read once per CTA, so not kept in L1, and each miss fetches the whole
// 256 bytes around it into L2 (a row of head_dim 128 in 16-bit types is 256 bytes, read by
// the lanes of one thread group together).  Measured on an H200: 0.5-4% faster at batch
// >= 16, 12% at batch 1 x 16k (NOTES.md).  Plain __ldg before sm_80, which lacks the hints.
__device__ __forceinline__ uint4 load_kv(const void* ptr) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint4 raw;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(raw.x), "=r"(raw.y), "=r"(raw.z), "=r"(raw.w)
      : "l"(ptr));
  return raw;
#else
  return load_vec(ptr);
#endif
}

// exp2(x - max) for a running max that may still be -inf (no key seen yet): the max is
// then replaced by 0, so that exp2(-inf - 0) = 0 instead of exp2(-inf + inf) = NaN.
__device__ __forceinline__ float finite_or_zero(float running_max) {
  return running_max == -INFINITY ? 0.f : running_max;
}

// Transposed sum of kCount values over the kLanes lanes of a thread group (both powers of 2):
// at each xor level, while a lane holds more than one value, it keeps the lower half of its
// slots and adds the partner's copy of them, sending the upper half.  Level k costs
// kCount >> (k + 1) shuffles: 15 in all for 16 values over 16 lanes, where a butterfly per
// value costs 64.  A lane ends with max(kCount / kLanes, 1) sums in values[0, ...); with
// fewer values than lanes, the last levels are butterflies on the one value (replicated).
//
// Which sums a lane ends with: the caller lays its slots out XOR-permuted, slot s holding
// value s ^ perm with perm = (chunk / replicas) * owned (the kernel's transposed layout), so
// that "keep the lower half" is the same slots in every lane and the partner, whose perm
// differs only in the level's bit, sends exactly those values.  Lane chunk then owns values
// perm + j, j < owned: the top bits of the value index are the lane's bits, high to low.
//
//   16 values (key u, row r at v = u * 4 + r), 16 lanes:   lane c ends with v = c
//   level 1 (offset 8): lanes 0-7 keep v 0-7, 8-15 keep v 8-15     (8 shuffles)
//   level 2 (offset 4): then v 0-3 / 4-7 / 8-11 / 12-15             (4)
//   levels 3, 4 (offsets 2, 1)                                       (2, 1)
//
// NOTE: one template instance per level, so that each level's slot count is a constant:
// with a loop over levels, nvcc unrolled the inner loop first, by a factor of 4, and kept the
// first level as a loop that indexed the register array through predicated moves.
template <int kHalf, int kOffset, int kCount>
__device__ __forceinline__ void transpose_reduce_level(float (&values)[kCount]) {
  if constexpr (kHalf >= 1 && kOffset >= 1) {
#pragma unroll
    for (int i = 0; i < kHalf; ++i) values[i] += __shfl_xor_sync(0xffffffffu, values[i + kHalf], kOffset);
    transpose_reduce_level<kHalf / 2, kOffset / 2>(values);
  } else if constexpr (kOffset >= 1) {  // one value left, lanes left: a butterfly
#pragma unroll
    for (int offset = kOffset; offset >= 1; offset /= 2) {
      values[0] += __shfl_xor_sync(0xffffffffu, values[0], offset);
    }
  }
}

template <int kCount, int kLanes>
__device__ __forceinline__ void transpose_reduce(float (&values)[kCount]) {
  transpose_reduce_level<kCount / 2, kLanes / 2>(values);
}

// value from the lane at xor distance lane_xor (its own value at distance 0: no shuffle).
__device__ __forceinline__ float from_lane_xor(float value, int lane_xor) {
  return lane_xor == 0 ? value : __shfl_xor_sync(0xffffffffu, value, lane_xor);
}

// ---------------------------------------------------------------------------------------
// Which request, query rows and context range a CTA owns

// The request r whose [starts[r], starts[r + 1]) holds token, for tokens < starts[num_reqs].
__device__ __forceinline__ int find_request_of_token(const int32_t* starts, int num_reqs, int token) {
  int lo = 0, hi = num_reqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (__ldg(starts + mid) <= token) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// Prefill tiles: request r owns tiles [first_tile(r), first_tile(r + 1)), which is at least
// ceil(query_len * group / kRows) of them; the grid has first_tile(num_reqs) tiles.
__device__ __forceinline__ int64_t first_prefill_tile(const int32_t* starts, int req, int group, int rows) {
  return static_cast<int64_t>(__ldg(starts + req)) * group / rows + req;
}

__device__ __forceinline__ int find_request_of_tile(const int32_t* starts, int num_reqs, int group, int rows,
                                                    int64_t tile) {
  int lo = 0, hi = num_reqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (first_prefill_tile(starts, mid, group, rows) <= tile) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

struct RowInfo {
  int token;     // index into the batch, -1 for an unused row
  int head;      // query head
  int position;  // absolute context position of the token; -1 for an unused row
};

// ---------------------------------------------------------------------------------------
// Attention: one CTA = kRows query rows of one kv head over one context split

// Register budget: at most 168 registers (3 CTAs, 12 warps per SM) up to 4 rows; 8 rows
// hold twice the query and accumulator registers and get 2 CTAs per SM.  (4 CTAs at 128
// registers leave no room for the next step's loads; measured slower, see NOTES.md.)
template <int kRows>
constexpr int min_ctas_per_sm() {
  return kRows <= 4 ? 3 : 2;
}

// Context positions per split of a request whose context is seq_len tokens (after this
// step), in the decode launch or the prefill one.  With p.even_splits, the context cut into
// the launch's split count, rounded up to kSplitTokensMultiple, no smaller than
// kMinSplitTokens and no larger than kMaxSplitTokens (the shared block-id array's bound; the
// host guarantees that count * kMaxSplitTokens covers every context).  The attention and
// combine kernels call it with the same values, so they agree on which rows were split.
__device__ __forceinline__ int split_tokens_of(const AttentionParams& p, int seq_len, bool decode) {
  if (!p.even_splits) return p.split_tokens;
  const int splits = decode ? p.num_decode_splits : p.num_prefill_splits;
  const int even = (seq_len + splits - 1) / splits;
  const int rounded = (even + kSplitTokensMultiple - 1) / kSplitTokensMultiple * kSplitTokensMultiple;
  return min(max(rounded, kMinSplitTokens), kMaxSplitTokens);
}

// decode: grid (num_kv_heads * head_tiles, num_reqs, splits), the requests with one new
// token; else grid (prefill tiles, num_kv_heads, splits), the requests with several.
template <typename T, int kHeadDim, int kBlockSize, int kRows>
__global__ void __launch_bounds__(kNumThreads, min_ctas_per_sm<kRows>())
    paged_attention_kernel(const AttentionParams p, const bool decode) {
  constexpr int kElems = VecTraits<T>::kElems;
  constexpr int kThreadsPerKey = kHeadDim / kElems;  // 8, 16 or 32 lanes per key row
  constexpr int kKeysPerLoad = kWarpSize / kThreadsPerKey;
  constexpr int kUnroll = kRows >= 8 ? 2 : 4;
  constexpr int kKeysPerWarpStep = kKeysPerLoad * kUnroll;
  constexpr int kKeysPerStep = kKeysPerWarpStep * kNumWarps;
  constexpr int kMaxBlocksPerSplit = kMaxSplitTokens / kBlockSize;
  // Scores (key u, row r) at v = u * kRows + r; each lane owns kOwned of them
  // (rows perm_row + j, j < kOwned, of key perm_key), each score held by kReplicas lanes.
  constexpr int kScores = kUnroll * kRows;
  constexpr int kOwned = kScores > kThreadsPerKey ? kScores / kThreadsPerKey : 1;
  constexpr int kReplicas = kThreadsPerKey > kScores ? kThreadsPerKey / kScores : 1;
  // The lanes that hold one row's scores of the step: xor distances kRowLanes, 2 * kRowLanes, ...
  constexpr int kRowLanes = kReplicas * kRows / kOwned;
  static_assert(kHeadDim % kElems == 0 && kWarpSize % kThreadsPerKey == 0, "head_dim must tile a warp");
  static_assert(kSplitTokensMultiple % kBlockSize == 0, "splits must start on a block boundary");

  __shared__ int32_t s_block_ids[kMaxBlocksPerSplit];
  __shared__ RowInfo s_rows[kRows];
  __shared__ float s_acc[kNumWarps][kRows][kHeadDim];
  __shared__ float s_max[kNumWarps][kRows];
  __shared__ float s_sum[kNumWarps][kRows];

  const int group = p.num_heads / p.num_kv_heads;
  const int split = blockIdx.z;

  // Which request and rows: the same answer in every thread, so exits are CTA-uniform.
  int req, kv_head, first_pair, num_rows;
  if (decode) {
    const int head_tiles = (group + kRows - 1) / kRows;
    req = blockIdx.y;
    kv_head = blockIdx.x / head_tiles;
    first_pair = (blockIdx.x % head_tiles) * kRows;
    if (__ldg(p.query_start_loc + req + 1) - __ldg(p.query_start_loc + req) != 1) return;
    num_rows = min(kRows, group - first_pair);
  } else {
    kv_head = blockIdx.y;
    req = find_request_of_tile(p.query_start_loc, p.num_reqs, group, kRows, blockIdx.x);
    const int query_len = __ldg(p.query_start_loc + req + 1) - __ldg(p.query_start_loc + req);
    if (query_len == 1) return;  // a decode: the decode launch owns it
    first_pair = static_cast<int>((blockIdx.x - first_prefill_tile(p.query_start_loc, req, group, kRows)) * kRows);
    if (first_pair >= query_len * group) return;
    num_rows = min(kRows, query_len * group - first_pair);
  }
  const int query_start = __ldg(p.query_start_loc + req);
  const int query_len = __ldg(p.query_start_loc + req + 1) - query_start;
  const int seq_len = __ldg(p.seq_lens + req);
  // (token, head-in-group) pairs are ordered token-major, so the last row is the latest token.
  const int last_position = seq_len - query_len + (first_pair + num_rows - 1) / group;
  const int split_tokens = split_tokens_of(p, seq_len, decode);
  const int kv_begin = split * split_tokens;
  const int kv_end = min(kv_begin + split_tokens, last_position + 1);
  if (kv_begin >= kv_end) return;

  const int tid = threadIdx.x;
  if (tid < kRows) {
    RowInfo row{-1, 0, -1};
    if (tid < num_rows) {
      const int pair = first_pair + tid;
      row.token = query_start + pair / group;
      row.head = kv_head * group + pair % group;
      row.position = seq_len - query_len + pair / group;
    }
    s_rows[tid] = row;
  }
  const int32_t* block_table = p.block_tables + static_cast<int64_t>(req) * p.max_blocks_per_req;
  const int num_split_blocks = (kv_end - kv_begin + kBlockSize - 1) / kBlockSize;
  for (int i = tid; i < num_split_blocks; i += kNumThreads) {
    s_block_ids[i] = __ldg(block_table + kv_begin / kBlockSize + i);
  }
  __syncthreads();

  const int warp = tid / kWarpSize;
  const int lane = tid % kWarpSize;
  const int key_in_load = lane / kThreadsPerKey;  // which of the warp's keys this lane reads
  const int chunk = lane % kThreadsPerKey;        // which 16 bytes of the row
  const int dim0 = chunk * kElems;
  // This lane's query row slot r holds row r ^ perm_row, its K/V slot u key u ^ perm_key (a
  // whole 32-byte-aligned run of a row's bytes is loaded by consecutive lanes, see NOTES.md),
  // so that score slot s holds value s ^ perm.
  const int perm = chunk / kReplicas * kOwned;
  const int perm_row = perm % kRows;
  const int perm_key = perm / kRows;

  // Query rows in registers, pre-scaled so that scores come out in log2 units.
  const float q_scale = p.scale * kLog2e;
  float q[kRows][kElems];
  int row_position[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const RowInfo row = s_rows[r ^ perm_row];
    row_position[r] = row.position;
    if (row.token >= 0) {
      const T* src = static_cast<const T*>(p.query) + row.token * p.query_token_stride +
                     row.head * p.query_head_stride + dim0;
      float values[kElems];
      unpack_vec<T>(load_vec(src), values);
#pragma unroll
      for (int e = 0; e < kElems; ++e) q[r][e] = values[e] * q_scale;
    } else {
#pragma unroll
      for (int e = 0; e < kElems; ++e) q[r][e] = 0.f;
    }
  }

  // row_max, row_sum: each row slot's max and sum, set after the loop for the merges.
  // NOTE: declared here: declared after the loop, nvcc 13.0 allocates 1-2 registers more or
  // fewer (16-bit 4 rows at head_dim 128: 165, not 163), and only these counts were timed.
  float row_max[kRows], row_sum[kRows], acc[kRows][kElems];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int e = 0; e < kElems; ++e) acc[r][e] = 0.f;
  }
  // The running max of the rows of the lane's owned scores (the same in every lane that
  // holds the row), and the sum of the lane's own weights only (rescaled with it).
  float owned_max[kOwned], owned_sum[kOwned];
#pragma unroll
  for (int j = 0; j < kOwned; ++j) {
    owned_max[j] = -INFINITY;
    owned_sum[j] = 0.f;
  }

  const int64_t slot_stride = static_cast<int64_t>(p.num_kv_heads) * kHeadDim;
  const T* key_base = static_cast<const T*>(p.key_cache) + kv_head * kHeadDim + dim0;
  const T* value_base = static_cast<const T*>(p.value_cache) + kv_head * kHeadDim + dim0;

  auto load_step = [&](int step, uint4 (&key_raw)[kUnroll], uint4 (&value_raw)[kUnroll]) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int t = step + (u ^ perm_key) * kKeysPerLoad + key_in_load;
      if (t < kv_end) {
        // NOTE: unsigned, so that the division and modulo by the block size are shifts.
        const unsigned in_split = static_cast<unsigned>(t - kv_begin);
        const int64_t block_id = s_block_ids[in_split / kBlockSize];
        const int64_t offset = (block_id * kBlockSize + in_split % kBlockSize) * slot_stride;
        key_raw[u] = load_kv(key_base + offset);
        value_raw[u] = load_kv(value_base + offset);
      } else {
        key_raw[u] = make_uint4(0, 0, 0, 0);
        value_raw[u] = make_uint4(0, 0, 0, 0);
      }
    }
  };
  // Software pipelining: a step's loads are issued before the previous step is computed,
  // so that every warp keeps a step of K/V in flight while it computes.
  uint4 key_raw[kUnroll], value_raw[kUnroll];
  load_step(kv_begin + warp * kKeysPerWarpStep, key_raw, value_raw);
  for (int step = kv_begin + warp * kKeysPerWarpStep; step < kv_end; step += kKeysPerStep) {
    uint4 next_key[kUnroll], next_value[kUnroll];
    load_step(step + kKeysPerStep, next_key, next_value);  // all zeros past kv_end: no loads

    // Scores: partial dot products, summed over the lanes of each thread group.
    float score[kScores];  // key slot u, row slot r at u * kRows + r
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float k[kElems];
      unpack_vec<T>(key_raw[u], k);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        float dot = 0.f;
#pragma unroll
        for (int e = 0; e < kElems; ++e) dot = fmaf(q[r][e], k[e], dot);
        score[u * kRows + r] = dot;
      }
    }
    transpose_reduce<kScores, kThreadsPerKey>(score);
    // Online softmax of the owned scores: (key perm_key, row perm_row + j) in slot j.
    const int t = step + perm_key * kKeysPerLoad + key_in_load;
    float owned_weight[kOwned], owned_rescale[kOwned];
#pragma unroll
    for (int j = 0; j < kOwned; ++j) {
      const float s = t >= kv_end || t > row_position[j] ? -INFINITY : score[j];
      float step_max = fmaxf(owned_max[j], s);
#pragma unroll
      for (int offset = kRowLanes; offset < kThreadsPerKey; offset *= 2) {
        step_max = fmaxf(step_max, __shfl_xor_sync(0xffffffffu, step_max, offset));
      }
      const float reference = finite_or_zero(step_max);
      owned_rescale[j] = exp2f(owned_max[j] - reference);
      owned_max[j] = step_max;
      owned_weight[j] = exp2f(s - reference);
      owned_sum[j] = fmaf(owned_sum[j], owned_rescale[j], owned_weight[j]);
    }
    // Every lane's slots from their owners: value s ^ perm is at xor distance (s / kOwned)
    // * kReplicas, in the owner's slot s % kOwned.
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float rescale = from_lane_xor(owned_rescale[r % kOwned], r / kOwned * kReplicas);
#pragma unroll
      for (int e = 0; e < kElems; ++e) acc[r][e] *= rescale;
    }
    float weight[kUnroll][kRows];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int s = u * kRows + r;
        weight[u][r] = from_lane_xor(owned_weight[s % kOwned], s / kOwned * kReplicas);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float v[kElems];
      unpack_vec<T>(value_raw[u], v);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
#pragma unroll
        for (int e = 0; e < kElems; ++e) acc[r][e] = fmaf(weight[u][r], v[e], acc[r][e]);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      key_raw[u] = next_key[u];
      value_raw[u] = next_value[u];
    }
  }

  // Each row slot's max and sum in every lane, for the merges below: first each owner's sum
  // over the lanes that hold its row, then every lane's slots from their owners.
#pragma unroll
  for (int j = 0; j < kOwned; ++j) {
#pragma unroll
    for (int offset = kRowLanes; offset < kThreadsPerKey; offset *= 2) {
      owned_sum[j] += __shfl_xor_sync(0xffffffffu, owned_sum[j], offset);
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    row_max[r] = from_lane_xor(owned_max[r % kOwned], r / kOwned * kReplicas);
    row_sum[r] = from_lane_xor(owned_sum[r % kOwned], r / kOwned * kReplicas);
  }

  // Merge the thread groups of each warp (they hold the same dims of different keys, and
  // the same perm).
#pragma unroll
  for (int offset = kThreadsPerKey; offset < kWarpSize; offset *= 2) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float other_max = __shfl_xor_sync(0xffffffffu, row_max[r], offset);
      const float other_sum = __shfl_xor_sync(0xffffffffu, row_sum[r], offset);
      const float merged_max = fmaxf(row_max[r], other_max);
      const float reference = finite_or_zero(merged_max);
      const float mine = exp2f(row_max[r] - reference);
      const float theirs = exp2f(other_max - reference);
      row_max[r] = merged_max;
      row_sum[r] = row_sum[r] * mine + other_sum * theirs;
#pragma unroll
      for (int e = 0; e < kElems; ++e) {
        const float other_acc = __shfl_xor_sync(0xffffffffu, acc[r][e], offset);
        acc[r][e] = acc[r][e] * mine + other_acc * theirs;
      }
    }
  }
  if (lane < kThreadsPerKey) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
      for (int e = 0; e < kElems; ++e) s_acc[warp][r ^ perm_row][dim0 + e] = acc[r][e];
      if (chunk == 0) {  // perm 0
        s_max[warp][r] = row_max[r];
        s_sum[warp][r] = row_sum[r];
      }
    }
  }
  __syncthreads();

  // Merge the warps and write: pairs of dims, consecutive threads on consecutive pairs.
  for (int i = tid; i < num_rows * (kHeadDim / 2); i += kNumThreads) {
    const int r = i / (kHeadDim / 2);
    const int d = (i % (kHeadDim / 2)) * 2;
    const RowInfo row = s_rows[r];
    if (row.position < kv_begin) continue;  // no key of this split is in the row's context
    float merged_max = -INFINITY;
#pragma unroll
    for (int w = 0; w < kNumWarps; ++w) merged_max = fmaxf(merged_max, s_max[w][r]);
    const float reference = finite_or_zero(merged_max);
    float sum = 0.f, out0 = 0.f, out1 = 0.f;
#pragma unroll
    for (int w = 0; w < kNumWarps; ++w) {
      const float factor = exp2f(s_max[w][r] - reference);
      sum = fmaf(s_sum[w][r], factor, sum);
      out0 = fmaf(s_acc[w][r][d], factor, out0);
      out1 = fmaf(s_acc[w][r][d + 1], factor, out1);
    }
    const int64_t row_index = static_cast<int64_t>(row.token) * p.num_heads + row.head;
    if (row.position < split_tokens) {  // the row's whole context is in this split
      const float inv_sum = 1.f / sum;
      store_pair(static_cast<T*>(p.out) + row_index * kHeadDim + d, out0 * inv_sum, out1 * inv_sum);
    } else {
      const int64_t partial = row_index * p.max_splits + split;
      *reinterpret_cast<float2*>(p.partial_out + partial * kHeadDim + d) = make_float2(out0, out1);
      if (d == 0) {
        p.partial_max[partial] = merged_max;
        p.partial_sum[partial] = sum;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// Split combine: one thread per 4 dims of one (token, head) whose context spans splits

template <typename T, int kHeadDim>
__global__ void __launch_bounds__(kNumThreads) combine_splits_kernel(const AttentionParams p) {
  constexpr int kThreadsPerHead = kHeadDim / 4;
  static_assert(kNumThreads % kThreadsPerHead == 0, "heads must tile the CTA");
  const int token = blockIdx.x;
  const int head = blockIdx.y * (kNumThreads / kThreadsPerHead) + threadIdx.x / kThreadsPerHead;
  if (head >= p.num_heads) return;
  const int req = find_request_of_token(p.query_start_loc, p.num_reqs, token);
  const int query_start = __ldg(p.query_start_loc + req);
  const int query_len = __ldg(p.query_start_loc + req + 1) - query_start;
  const int seq_len = __ldg(p.seq_lens + req);
  const int position = seq_len - query_len + (token - query_start);
  const int num_splits = position / split_tokens_of(p, seq_len, query_len == 1) + 1;
  if (num_splits == 1) return;  // written by the attention kernel

  const int64_t first = (static_cast<int64_t>(token) * p.num_heads + head) * p.max_splits;
  float merged_max = -INFINITY;
  for (int s = 0; s < num_splits; ++s) merged_max = fmaxf(merged_max, p.partial_max[first + s]);
  float sum = 0.f;
  float4 out = make_float4(0.f, 0.f, 0.f, 0.f);
  const int d = (threadIdx.x % kThreadsPerHead) * 4;
  for (int s = 0; s < num_splits; ++s) {
    const float factor = exp2f(p.partial_max[first + s] - merged_max);
    sum = fmaf(p.partial_sum[first + s], factor, sum);
    const float4 part = *reinterpret_cast<const float4*>(p.partial_out + (first + s) * kHeadDim + d);
    out.x = fmaf(part.x, factor, out.x);
    out.y = fmaf(part.y, factor, out.y);
    out.z = fmaf(part.z, factor, out.z);
    out.w = fmaf(part.w, factor, out.w);
  }
  const float inv_sum = 1.f / sum;
  T* dst = static_cast<T*>(p.out) + (static_cast<int64_t>(token) * p.num_heads + head) * kHeadDim + d;
  store_pair(dst, out.x * inv_sum, out.y * inv_sum);
  store_pair(dst + 2, out.z * inv_sum, out.w * inv_sum);
}

// ---------------------------------------------------------------------------------------
// Cache write (reshape_and_cache): one CTA per new token, one thread per 16 bytes

__global__ void write_kv_cache_kernel(const CacheWriteParams p) {
  const int token = blockIdx.x;
  const int64_t slot = __ldg(p.slot_mapping + token);
  if (slot < 0) return;
  const int vecs_per_head = p.head_dim * p.element_size / 16;
  const int vecs_per_slot = p.num_kv_heads * vecs_per_head;
  const int elems_per_vec = 16 / p.element_size;
  const char* key = static_cast<const char*>(p.key);
  const char* value = static_cast<const char*>(p.value);
  uint4* key_dst = static_cast<uint4*>(p.key_cache) + slot * vecs_per_slot;
  uint4* value_dst = static_cast<uint4*>(p.value_cache) + slot * vecs_per_slot;
  for (int i = threadIdx.x; i < vecs_per_slot; i += blockDim.x) {
    const int head = i / vecs_per_head;
    const int64_t elem = (i % vecs_per_head) * static_cast<int64_t>(elems_per_vec);
    const int64_t key_elem = token * p.key_token_stride + head * p.key_head_stride + elem;
    const int64_t value_elem = token * p.value_token_stride + head * p.value_head_stride + elem;
    key_dst[i] = *reinterpret_cast<const uint4*>(key + key_elem * p.element_size);
    value_dst[i] = *reinterpret_cast<const uint4*>(value + value_elem * p.element_size);
  }
}

}  // namespace kvserve
