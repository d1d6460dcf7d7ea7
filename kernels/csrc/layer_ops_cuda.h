// Host interface of the decoder layer's small CUDA kernels (layer_ops_kernels.cuh): the
// residual add + RMSNorm, RoPE of the q/k heads with the k/v cache write, and SiLU-and-mul.
// Each is one launch from C++, where the Triton versions (kernels/fused_elementwise.py) cost a
// Python launch of tens of microseconds: the host's time of an eager step.
//
// Half precision only (float16, bfloat16); each rounds where torch's ops round, as the Triton
// kernels do (see fused_elementwise.py's docstring).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "paged_attention_cuda.h"

namespace kvserve {

// out = weight * norm(s), s = x + residual rounded to T (written to residual_out), or s = x
// without a residual.  Rows of x and residual have strides in elements, the outputs are
// contiguous [rows, hidden].
struct RmsNormParams {
  const void* x;
  const void* residual;  // null: no residual
  const void* weight;    // [hidden]
  void* out;
  void* residual_out;  // null without a residual
  int64_t x_stride;
  int64_t residual_stride;
  int32_t rows;
  int32_t hidden;
  float eps;
  DType dtype;
};

// A packed qkv row per token (q heads, then k heads, then v heads, head_dim each): q and k
// rotated by the token's cos/sin ([num_tokens, head_dim / 2], strided rows); q into query
// ([num_tokens, num_heads, head_dim], contiguous), k and v into the caches at the token's
// slot ([num_blocks, block_size, num_kv_heads, head_dim], contiguous; slots < 0 skipped).
struct RopeWriteParams {
  const void* qkv;
  const void* cos;
  const void* sin;
  const int64_t* slot_mapping;
  void* query;
  void* key_cache;
  void* value_cache;
  int64_t qkv_stride;
  int64_t cos_stride;
  int32_t num_tokens;
  int32_t num_heads;
  int32_t num_kv_heads;
  int32_t head_dim;
  DType dtype;
};

// out[r] = silu(x[r, :d]) * x[r, d:2d], out contiguous [rows, d].
struct SiluMulParams {
  const void* x;
  void* out;
  int64_t x_stride;
  int32_t rows;
  int32_t d;
  DType dtype;
};

// Each returns the launch's error (cudaErrorInvalidValue for float32 or a shape out of range).
cudaError_t launch_add_rms_norm(const RmsNormParams& params, cudaStream_t stream);
cudaError_t launch_rope_and_write_kv(const RopeWriteParams& params, cudaStream_t stream);
cudaError_t launch_silu_and_mul(const SiluMulParams& params, cudaStream_t stream);

}  // namespace kvserve
