// The decoder layer's small kernels (see layer_ops_cuda.h): device code only, plain CUDA headers.
//
// Every result is rounded where torch's ops round theirs (each op's output in T), so these
// agree with the unfused layer and with the Triton kernels of kernels/fused_elementwise.py
// to a unit in the last place: RoPE bit for bit (each product is rounded before the sum, so
// nothing can contract into an FMA), the norm's sum of squares in another order, expf in
// SiLU within its last float bit of torch's.
//
// Rows of RMSNorm and SiLU-and-mul are read and written kVec elements at a time: 8 (16 bytes)
// where every pointer and row stride allows it, else 1.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "layer_ops_cuda.h"

namespace kvserve {
namespace layer_ops {

constexpr int kWarp = 32;

template <typename T>
__device__ __forceinline__ float to_float(T value) {
  if constexpr (std::is_same<T, __half>::value) {
    return __half2float(value);
  } else {
    return __bfloat162float(value);
  }
}

template <typename T>
__device__ __forceinline__ T from_float(float value) {
  if constexpr (std::is_same<T, __half>::value) {
    return __float2half_rn(value);
  } else {
    return __float2bfloat16_rn(value);
  }
}

// value as torch stores an op's result in T, read back as float.
template <typename T>
__device__ __forceinline__ float rounded(float value) {
  return to_float(from_float<T>(value));
}

// kVec consecutive elements, one memory access.
template <typename T, int kVec>
struct alignas(sizeof(T) * kVec) Pack {
  T v[kVec];
};

template <typename T, int kVec>
__device__ __forceinline__ Pack<T, kVec> load_pack(const T* base, int64_t pack) {
  return reinterpret_cast<const Pack<T, kVec>*>(base)[pack];
}

template <typename T, int kVec>
__device__ __forceinline__ void store_pack(T* base, int64_t pack, const Pack<T, kVec>& value) {
  reinterpret_cast<Pack<T, kVec>*>(base)[pack] = value;
}

// The sum of value over the CTA (blockDim.x a multiple of 32, at most 1024), in every thread.
__device__ __forceinline__ float block_sum(float value) {
  __shared__ float warp_sums[kWarp];
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffffu, value, offset);
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  if (lane == 0) warp_sums[warp] = value;
  __syncthreads();
  value = lane < static_cast<int>(blockDim.x / kWarp) ? warp_sums[lane] : 0.f;
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

// One CTA per row.  The summed row is written to residual_out in the first pass; the second
// pass reuses each thread's first pack from registers (a thread's only one while the row has
// at most one pack per thread: hidden <= 8192 with 16-byte packs) and reads any others back
// (each thread handles the same packs in both passes).
template <typename T, int kVec>
__global__ void add_rms_norm_kernel(const RmsNormParams p) {
  const int64_t row = blockIdx.x;
  const int num_packs = p.hidden / kVec;
  const T* x = static_cast<const T*>(p.x) + row * p.x_stride;
  const T* residual = p.residual != nullptr ? static_cast<const T*>(p.residual) + row * p.residual_stride : nullptr;
  T* residual_out = p.residual != nullptr ? static_cast<T*>(p.residual_out) + row * p.hidden : nullptr;
  Pack<T, kVec> first{};
  float sum_sq = 0.f;
  for (int i = threadIdx.x; i < num_packs; i += blockDim.x) {
    Pack<T, kVec> summed = load_pack<T, kVec>(x, i);
    if (residual != nullptr) {
      const Pack<T, kVec> r = load_pack<T, kVec>(residual, i);
#pragma unroll
      for (int j = 0; j < kVec; ++j) summed.v[j] = from_float<T>(to_float(summed.v[j]) + to_float(r.v[j]));
      store_pack<T, kVec>(residual_out, i, summed);
    }
    if (i == static_cast<int>(threadIdx.x)) first = summed;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float value = to_float(summed.v[j]);
      sum_sq += value * value;
    }
  }
  const float inv_rms = rsqrtf(block_sum(sum_sq) / static_cast<float>(p.hidden) + p.eps);
  const T* summed_row = residual != nullptr ? residual_out : x;
  const T* weight = static_cast<const T*>(p.weight);
  T* out = static_cast<T*>(p.out) + row * p.hidden;
  for (int i = threadIdx.x; i < num_packs; i += blockDim.x) {
    const Pack<T, kVec> summed = i == static_cast<int>(threadIdx.x) ? first : load_pack<T, kVec>(summed_row, i);
    const Pack<T, kVec> w = load_pack<T, kVec>(weight, i);
    Pack<T, kVec> result;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      result.v[j] = from_float<T>(rounded<T>(to_float(summed.v[j]) * inv_rms) * to_float(w.v[j]));
    }
    store_pack<T, kVec>(out, i, result);
  }
}

// One CTA per (token, head) of the q and k heads, a thread per rotated pair.  A k head's CTA
// writes the rotated head and the token's v head of the same index into their cache slot.
template <typename T>
__global__ void rope_and_write_kv_kernel(const RopeWriteParams p) {
  const int64_t token = blockIdx.x;
  const int head = blockIdx.y;
  const int half = p.head_dim / 2;
  const T* row = static_cast<const T*>(p.qkv) + token * p.qkv_stride;
  const T* x = row + static_cast<int64_t>(head) * p.head_dim;
  const T* cos = static_cast<const T*>(p.cos) + token * p.cos_stride;
  const T* sin = static_cast<const T*>(p.sin) + token * p.cos_stride;
  T* dst;
  if (head < p.num_heads) {
    dst = static_cast<T*>(p.query) + (token * p.num_heads + head) * p.head_dim;
  } else {
    const int64_t slot = p.slot_mapping[token];
    if (slot < 0) return;  // a padding row
    const int kv_head = head - p.num_heads;
    const int64_t offset = (slot * p.num_kv_heads + kv_head) * p.head_dim;
    dst = static_cast<T*>(p.key_cache) + offset;
    const T* value = row + static_cast<int64_t>(p.num_heads + p.num_kv_heads + kv_head) * p.head_dim;
    T* value_dst = static_cast<T*>(p.value_cache) + offset;
    for (int i = threadIdx.x; i < p.head_dim; i += blockDim.x) value_dst[i] = value[i];
  }
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    const float x1 = to_float(x[i]), x2 = to_float(x[i + half]);
    const float c = to_float(cos[i]), s = to_float(sin[i]);
    dst[i] = from_float<T>(rounded<T>(x1 * c) - rounded<T>(x2 * s));
    dst[i + half] = from_float<T>(rounded<T>(x2 * c) + rounded<T>(x1 * s));
  }
}

// grid (rows, packs / blockDim.x rounded up); d a multiple of kVec.
template <typename T, int kVec>
__global__ void silu_and_mul_kernel(const SiluMulParams p) {
  const int64_t row = blockIdx.x;
  const int pack = blockIdx.y * blockDim.x + threadIdx.x;
  if (pack >= p.d / kVec) return;
  const T* x = static_cast<const T*>(p.x) + row * p.x_stride;
  const Pack<T, kVec> gate = load_pack<T, kVec>(x, pack);
  const Pack<T, kVec> up = load_pack<T, kVec>(x + p.d, pack);
  Pack<T, kVec> result;
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    const float g = to_float(gate.v[j]);
    result.v[j] = from_float<T>(rounded<T>(g / (1.f + expf(-g))) * to_float(up.v[j]));
  }
  store_pack<T, kVec>(static_cast<T*>(p.out) + row * p.d, pack, result);
}

}  // namespace layer_ops
}  // namespace kvserve
